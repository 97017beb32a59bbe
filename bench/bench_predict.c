/* bench_predict.c - what one next-turn render prediction costs.
 *
 * Usage: bench_predict MODEL [--tokens T] [--reps R]
 *
 * A checkpoint-tier request asks for a prediction at each decode snapshot
 * point and at its retirement (chat_plan.h): render the conversation with
 * the reply as the assistant's message and tokenize it. Before the
 * request driver moved predictions to the engine's predictor thread, each
 * ran on the engine thread, so every batched decode row of every other
 * request waited for it. This prints that wait: the time of one
 * chat_turn_predict over a conversation of about T prompt tokens (turns of
 * ~400 tokens of pseudo-words, the model's own template), median and p99
 * over R repetitions, beside one batched decode step of 16 rows on the same
 * model for scale. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat/chat_plan.h"
#include "core/clock.h"
#include "engine/engine.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static char *words(size_t n, uint64_t *rng) {
    static const char *syl[] = {"ka", "ro", "mi", "the", "an", "de", "lu", "ser", "in", "to", "ve"};
    char *s = malloc(n + 8);
    size_t len = 0;
    while (len < n) {
        *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
        const char *w = syl[(*rng >> 33) % 11];
        size_t k = strlen(w);
        memcpy(s + len, w, k);
        len += k;
        if ((*rng >> 40) % 3 == 0) s[len++] = ' ';
    }
    s[len] = 0;
    return s;
}

int main(int argc, char **argv) {
    const char *path = NULL;
    int target = 8192, reps = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc) target = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else path = argv[i];
    }
    if (path == NULL || reps < 1) {
        fprintf(stderr, "usage: bench_predict MODEL [--tokens T] [--reps R]\n");
        return 2;
    }
    ember_error err;
    model *m = model_load(path, &err);
    if (m == NULL) {
        fprintf(stderr, "bench_predict: %s\n", err.msg);
        return 1;
    }
    const tokenizer *tok = model_get_tokenizer(m);
    chat_template *tpl = chat_template_for_model(tokenizer_chat_template(tok), NULL, NULL);
    chat_messages *msgs = chat_messages_create();
    uint64_t rng = 42;
    char *text = words(1200, &rng);
    chat_messages_append(msgs, "system", text, &err);
    free(text);
    chat_render_opts gen = {0};
    gen.add_generation_prompt = true;
    gen.enable_thinking = -1;
    char *prompt_text = NULL;
    int32_t *prompt = NULL;
    size_t n = 0;
    for (int turn = 0;; turn++) {
        text = words(1600, &rng);
        chat_messages_append(msgs, turn % 2 ? "assistant" : "user", text, &err);
        free(text);
        if (turn % 2) continue;
        free(prompt_text);
        free(prompt);
        if (chat_render(tpl, msgs, NULL, &gen, &prompt_text, &err) < 0 ||
            chat_encode_prompt(tok, prompt_text, &prompt, &n) < 0) {
            fprintf(stderr, "bench_predict: render: %s\n", err.msg);
            return 1;
        }
        if ((int)n >= target) break;
    }
    /* the prompt plus a 64-token reply */
    int32_t *reply = NULL;
    size_t nr = 0;
    text = words(300, &rng);
    chat_encode_prompt(tok, text, &reply, &nr);
    free(text);
    if (nr > 64) nr = 64;
    int64_t total = (int64_t)n + (int64_t)nr;
    int32_t *all = malloc((size_t)total * sizeof *all);
    memcpy(all, prompt, n * sizeof *all);
    memcpy(all + n, reply + (nr < 64 ? 0 : 1), nr * sizeof *all);
    chat_plan_params pp;
    memset(&pp, 0, sizeof pp);
    pp.tpl = tpl;
    pp.tok = tok;
    pp.messages = msgs;
    pp.prompt = prompt;
    pp.n_prompt = (int64_t)n;
    chat_cache_plan plan;
    chat_cache_plan_make(&pp, &plan);
    double *t = malloc((size_t)reps * sizeof *t);
    int64_t common = -1;
    for (int r = 0; r < reps; r++) {
        double t0 = ember_now();
        common = chat_turn_predict(plan.predictor, all, total);
        t[r] = ember_now() - t0;
    }
    qsort(t, (size_t)reps, sizeof *t, cmp_double);
    /* one decode step of 16 rows, for scale */
    engine_config cfg = engine_default_config();
    cfg.n_threads = 2;
    cfg.n_ctx = 4096;
    engine *e = engine_create(m, &cfg, &err);
    double step_s = 0;
    if (e) {
        engine_request q = engine_default_request();
        int32_t w[64];
        for (int i = 0; i < 64; i++) w[i] = prompt[i];
        q.prompt = w;
        q.n_prompt = 64;
        q.max_tokens = 17;
        q.cache = ENGINE_CACHE_BYPASS;
        q.stop_at_eog = false;
        engine_result res;
        if (engine_generate(e, &q, &res, &err) == 0) {
            step_s = (res.total_s - res.ttft_s) / 16.0;
            engine_result_free(&res);
        }
        engine_free(e);
    }
    printf("conversation %zu prompt tokens + %zu reply tokens (%s template); prediction common prefix %lld\n", n, nr,
           tokenizer_chat_template(tok) ? "the model's own" : "ChatML", (long long)common);
    printf("chat_turn_predict: median %.2f ms, p99 %.2f ms over %d runs; one decode step (1 row) %.2f ms\n",
           1e3 * t[reps / 2], 1e3 * t[(reps * 99) / 100 < reps ? (reps * 99) / 100 : reps - 1], reps, 1e3 * step_s);
    free(t);
    free(all);
    free(reply);
    free(prompt);
    free(prompt_text);
    chat_turn_predictor_free(plan.predictor);
    chat_messages_free(msgs);
    chat_template_free(tpl);
    model_free(m);
    return 0;
}
