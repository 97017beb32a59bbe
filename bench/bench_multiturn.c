/* bench_multiturn.c - the prompt cache on a multi-turn chat (issue 5's
 * benchmark): per turn, how many prompt tokens are prefilled again and the
 * time to first token, with the cache on and off.
 *
 * Usage: bench_multiturn [--model PATH]... [--turns N] [--turn-tokens T]
 *                        [--reply R] [--sys-tokens S] [--threads N] [--step S]
 *                        [--blocks B]
 *   With no --model, every family's `small` model in build/bench-models
 *   (qwen3 gemma3 qwen35 mamba2 falcon-h1, see `make bench-multiturn`).
 *   Defaults: 10 turns of ~1024 user tokens, replies of at most 32 tokens,
 *   a ~300-token system prompt, prefill step 512, 2 threads, a KV pool of
 *   two contexts plus 64 blocks (--blocks overrides).
 *
 * Design. The benchmark plays the client and the server's chat layer the
 * way `ember serve` would, so that the cache sees what it sees in service:
 *  - The conversation is a chat_messages (system prompt, then per turn a
 *    user message of synthetic, deterministic pseudo-words cut to ~T
 *    tokens), rendered with the model's own chat template (ChatML for the
 *    built-in vocabulary of the small models) and tokenized as the server
 *    does (BOS unless the render already starts with it; specials parsed).
 *  - The cache plan of engine_request (turn boundary, system-prompt anchor,
 *    next-turn predictor) comes from chat_cache_plan_make, the function
 *    the server uses (src/chat/chat_plan.h).
 *  - The reply (greedy, at most R tokens, stopping at end-of-generation) is
 *    decoded to text and appended as the assistant message: the client
 *    echoes text, not ids, so the next prompt may re-tokenize the reply
 *    differently from what the model generated -- the realistic case the
 *    turn checkpoint exists for.
 *  - Per turn the same prompt runs twice on one engine: cache off
 *    (ENGINE_CACHE_BYPASS: a cold request that leaves no trace) and cache on
 *    (the conversation's own request, whose reply continues the chat). Both
 *    are greedy and ask for logits; the generated tokens and the logits of
 *    every step must be bit-identical (the engine's promise), and any
 *    difference is reported as a cache bug.
 * Columns: prompt tokens N; new = N minus the longest common prefix with
 * what the server held at the end of the previous turn (previous prompt +
 * generated reply); cached / re-prefilled (engine_result.cached_tokens /
 * prompt_forwarded, which counts the last prompt token too) with the cache
 * on; re-prefilled with the cache off (always N); TTFT off / on and their
 * ratio; N / re-prefilled, the TTFT ratio a prefill whose cost is linear in
 * tokens would reach (attention-bound models, like the small presets at
 * these lengths, reach about half of it: cold work grows as N^2/2).
 * Targets (issue 5): from turn 2 on, re-prefilled <= new + one grid unit
 * (lcm(step, 16)) on stacks with arr/list layers, <= new + 16 on the others;
 * TTFT on at least 5x lower than off by turn 5. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "apc/apc.h"
#include "apc/apc_ckpt.h"
#include "chat/chat.h"
#include "chat/chat_plan.h"
#include "core/log.h"
#include "engine/engine.h"
#include "model/cache_stack.h"
#include "serve/serve_settings.h"
#include "tokenizer/tokenizer.h"

typedef struct opts {
    int turns, turn_tokens, reply, sys_tokens, threads, step;
    int32_t blocks;
} opts;

/* ---- synthetic text ---- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 24);
}

/* Pseudo-words from syllables, with some punctuation and capitals. */
static char *words(size_t n_chars) {
    static const char *syl[] = {"ka", "ro", "mi", "the", "an", "de", "lu", "ser", "in", "to", "ve",
                                "pa", "ion", "er", "co", "ma", "ti", "us", "re", "no", "al", "be"};
    const size_t n_syl = sizeof syl / sizeof syl[0];
    char *s = malloc(n_chars + 16);
    size_t len = 0;
    bool cap = true;
    while (len < n_chars) {
        int k = 1 + (int)(rnd() % 3);
        for (int i = 0; i < k; i++) {
            const char *p = syl[rnd() % n_syl];
            for (size_t j = 0; p[j]; j++) s[len++] = (char)(cap && j == 0 ? p[j] - 'a' + 'A' : p[j]);
            cap = false;
        }
        uint32_t r = rnd() % 16;
        if (r == 0) {
            s[len++] = '.';
            cap = true;
        } else if (r == 1) {
            s[len++] = ',';
        }
        s[len++] = (r == 2) ? '\n' : ' ';
    }
    s[len] = 0;
    return s;
}

/* Plain text (no BOS, no special tokens); prompts go through chat_encode_prompt. */
static int encode_text(const tokenizer *tok, const char *text, int32_t **ids, size_t *n) {
    ember_error err;
    if (tokenizer_encode(tok, text, strlen(text), false, false, ids, n, &err) < 0) {
        fprintf(stderr, "bench_multiturn: tokenize: %s\n", err.msg);
        return -1;
    }
    return 0;
}

/* Text of about n tokens: pseudo-words cut at n tokens and decoded. */
static char *text_of_tokens(const tokenizer *tok, int n) {
    size_t chars = (size_t)n * 8 + 64;
    for (;;) {
        char *w = words(chars);
        int32_t *ids;
        size_t k;
        if (encode_text(tok, w, &ids, &k) < 0) exit(1);
        if (k >= (size_t)n) {
            char *out;
            size_t len;
            ember_error err;
            if (tokenizer_decode(tok, ids, (size_t)n, false, &out, &len, &err) < 0) {
                fprintf(stderr, "bench_multiturn: decode: %s\n", err.msg);
                exit(1);
            }
            free(ids);
            free(w);
            return out;
        }
        free(ids);
        free(w);
        chars *= 2;
    }
}

/* The reply as the server returns it: valid UTF-8, specials dropped. */
static char *reply_text(const tokenizer *tok, const int32_t *ids, int64_t n) {
    tok_stream *s = tok_stream_create(tok, false);
    size_t cap = 64, len = 0, k;
    char *out = malloc(cap);
    for (int64_t i = 0; i <= n; i++) {
        const char *piece = i < n ? tok_stream_push(s, ids[i], &k) : tok_stream_flush(s, &k);
        if (len + k + 1 > cap) {
            while (len + k + 1 > cap) cap *= 2;
            out = realloc(out, cap);
        }
        memcpy(out + len, piece, k);
        len += k;
    }
    out[len] = 0;
    tok_stream_free(s);
    return out;
}

static int split_reply(const tokenizer *tok, const int32_t *ids, int64_t n, bool thinking_open, char **reasoning,
                       char **content) {
    char *text = reply_text(tok, ids, n);
    int rc = chat_split_reasoning(text, thinking_open, reasoning, content);
    free(text);
    return rc;
}

/* ---- one model ---- */

typedef struct turn_row {
    int64_t n, fresh, cached_on, fwd_on, fwd_off, bound, turn_pos, sys_pos;
    double ttft_on, ttft_off;
    int reply;
    bool same;
} turn_row;

static bool same_result(const engine_result *a, const engine_result *b) {
    if (a->n_tokens != b->n_tokens || memcmp(a->tokens, b->tokens, (size_t)a->n_tokens * sizeof(int32_t)) != 0)
        return false;
    return a->logits && b->logits &&
           memcmp(a->logits, b->logits, (size_t)a->n_tokens * (size_t)a->n_vocab * sizeof(float)) == 0;
}

static int bench_model(const char *path, const opts *o) {
    ember_error err;
    model *m = model_load(path, &err);
    if (m == NULL) {
        fprintf(stderr, "bench_multiturn: %s: %s\n", path, err.msg);
        return 1;
    }
    const model_hparams *hp = model_get_hparams(m);
    const tokenizer *tok = model_get_tokenizer(m);
    if (tok == NULL) {
        fprintf(stderr, "bench_multiturn: %s has no tokenizer\n", path);
        model_free(m);
        return 1;
    }
    /* The layer mix decides the target's slack. */
    const cache_layer *stack = model_cache_stack(m);
    int kinds[5] = {0};
    for (int l = 0; l < hp->n_layer; l++) kinds[stack[l].kind <= CACHE_KIND_OTHER ? stack[l].kind : CACHE_KIND_OTHER]++;
    bool arr = kinds[CACHE_KIND_ARR] + kinds[CACHE_KIND_LIST] > 0;
    int g = o->step, h = KV_BLOCK_TOKENS;
    while (h) {
        int t = g % h;
        g = h;
        h = t;
    }
    const int unit = o->step / g * KV_BLOCK_TOKENS; /* lcm(step, 16): the prefill grid unit */
    const int64_t slack = arr ? unit : 16;

    engine_config cfg = engine_default_config();
    cfg.n_threads = o->threads;
    cfg.prefill_step = o->step;
    cfg.n_ctx = (int)((int64_t)o->turns * (o->turn_tokens + o->reply + 64) + o->sys_tokens + 256);
    /* Room for the whole conversation in the cache beside one live request,
     * so that the cache-off run of a turn cannot evict what the cache-on run
     * of the next turn needs (the default pool, capped at 2 GiB, may not). */
    cfg.num_blocks =
        o->blocks > 0 ? o->blocks : (int32_t)(2 * ((cfg.n_ctx + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS) + 64);
    /* the EMBER_APC_* switches (the cache itself reads no environment) */
    engine *e = serve_settings_apply_env_cache(&cfg.cache, &err) < 0 ? NULL : engine_create(m, &cfg, &err);
    if (e == NULL) {
        fprintf(stderr, "bench_multiturn: %s\n", err.msg);
        model_free(m);
        return 1;
    }

    bool fell_back = false;
    chat_template *tpl = chat_template_for_model(tokenizer_chat_template(tok), &fell_back, NULL);
    char *bos = NULL, *eos = NULL;
    size_t bl = 0;
    const char *bt = tokenizer_bos(tok) >= 0 ? tokenizer_token_text(tok, tokenizer_bos(tok), &bl) : NULL;
    if (bt) bos = strndup(bt, bl);
    bt = tokenizer_eos(tok) >= 0 ? tokenizer_token_text(tok, tokenizer_eos(tok), &bl) : NULL;
    if (bt) eos = strndup(bt, bl);
    chat_render_opts gen = {0};
    gen.add_generation_prompt = true;
    gen.enable_thinking = -1;
    gen.bos_token = bos;
    gen.eos_token = eos;

    printf("\n### %s (%s, %d layers, n_embd %d, vocab %d)\n\n", path, hp->arch_name, hp->n_layer, hp->n_embd,
           hp->n_vocab);
    printf("stack kv %d / rot %d / arr %d / list %d / other %d, tier %s, template %s, step %d, threads %d, "
           "pool %d blocks; "
           "%d turns of ~%d user tokens, replies <= %d tokens, system prompt ~%d tokens; target slack +%lld\n\n",
           kinds[0], kinds[1], kinds[2], kinds[3], kinds[4], apc_tier_name(apc_get_tier(engine_cache(e))),
           fell_back ? "ChatML (fallback)" : "the model's own", o->step, o->threads, cfg.num_blocks, o->turns,
           o->turn_tokens, o->reply, o->sys_tokens, (long long)slack);
    printf("| turn | prompt | new | cached (on) | re-prefilled on | re-prefilled off | target | TTFT off | TTFT on "
           "| off/on | N/re-prefilled | reply | turn pos | sys pos | warm == cold |\n");
    printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|\n");
    fflush(stdout);

    { /* warm-up (threads, first-touch pages), so that turn 1 off and on compare fairly */
        int32_t w[64];
        for (int i = 0; i < 64; i++) w[i] = i % hp->n_vocab;
        engine_request q = engine_default_request();
        q.prompt = w;
        q.n_prompt = 64;
        q.max_tokens = 2;
        q.cache = ENGINE_CACHE_BYPASS;
        engine_result r;
        if (engine_generate(e, &q, &r, &err) == 0) engine_result_free(&r);
    }
    chat_messages *msgs = chat_messages_create();
    rng_state = 0x9e3779b97f4a7c15ull; /* same text for every model of one vocabulary */
    char *sys = text_of_tokens(tok, o->sys_tokens);
    if (o->sys_tokens > 0) chat_messages_append(msgs, "system", sys, &err);
    free(sys);
    turn_row *rows = calloc((size_t)o->turns, sizeof *rows);
    int32_t *held = NULL; /* previous prompt + its reply: what the server saw */
    int64_t n_held = 0;
    int rc = 0;
    for (int t = 0; t < o->turns; t++) {
        turn_row *row = &rows[t];
        char *user = text_of_tokens(tok, o->turn_tokens);
        chat_messages_append(msgs, "user", user, &err);
        free(user);
        char *prompt_text = NULL;
        if (chat_render(tpl, msgs, NULL, &gen, &prompt_text, &err) < 0) {
            fprintf(stderr, "bench_multiturn: render: %s\n", err.msg);
            rc = 1;
            break;
        }
        int32_t *prompt;
        size_t n;
        if (chat_encode_prompt(tok, prompt_text, &prompt, &n) < 0) exit(1);
        /* The server's cache plan (src/chat/chat_plan.h), as serve does it. */
        chat_plan_params pp;
        memset(&pp, 0, sizeof pp);
        pp.tpl = tpl;
        pp.tok = tok;
        pp.messages = msgs;
        pp.bos = bos;
        pp.eos = eos;
        pp.prompt = prompt;
        pp.n_prompt = (int64_t)n;
        pp.thinking_open = chat_prompt_opens_thinking(prompt_text);
        chat_cache_plan plan;
        chat_cache_plan_make(&pp, &plan);
        row->turn_pos = plan.turn_pos;
        row->sys_pos = plan.anchor_pos;
        row->n = (int64_t)n;
        row->fresh = row->n - chat_token_common_prefix(held, n_held, prompt, row->n);
        if ((int64_t)n + o->reply > cfg.n_ctx) {
            fprintf(stderr, "bench_multiturn: turn %d has %zu tokens, over the context\n", t + 1, n);
            rc = 1;
            free(prompt);
            free(prompt_text);
            break;
        }

        engine_request q = engine_default_request();
        q.prompt = prompt;
        q.n_prompt = row->n;
        q.max_tokens = o->reply;
        q.want_logits = true;
        q.plan = plan;
        engine_result off_r, on_r;
        q.cache = ENGINE_CACHE_BYPASS;
        if (engine_generate(e, &q, &off_r, &err) < 0) {
            fprintf(stderr, "bench_multiturn: turn %d (off): %s\n", t + 1, err.msg);
            rc = 1;
            break;
        }
        q.cache = ENGINE_CACHE_ON;
        if (engine_generate(e, &q, &on_r, &err) < 0) {
            fprintf(stderr, "bench_multiturn: turn %d (on): %s\n", t + 1, err.msg);
            rc = 1;
            break;
        }
        row->cached_on = on_r.cached_tokens;
        row->fwd_on = on_r.prompt_forwarded;
        row->fwd_off = off_r.prompt_forwarded;
        row->ttft_on = on_r.ttft_s;
        row->ttft_off = off_r.ttft_s;
        row->reply = on_r.n_tokens;
        row->same = same_result(&off_r, &on_r);
        row->bound = row->fresh + slack;
        printf("| %d | %lld | %lld | %lld | %lld | %lld | %s | %.3f s | %.3f s | %.1fx | %.1fx | %d | %lld | %lld "
               "| %s |\n",
               t + 1, (long long)row->n, (long long)row->fresh, (long long)row->cached_on, (long long)row->fwd_on,
               (long long)row->fwd_off, t == 0 ? "-" : (row->fwd_on <= row->bound ? "ok" : "MISS"), row->ttft_off,
               row->ttft_on, row->ttft_off / row->ttft_on, (double)row->n / (double)row->fwd_on, row->reply,
               (long long)row->turn_pos, (long long)row->sys_pos, row->same ? "yes" : "NO");
        fflush(stdout);

        /* The client appends the reply as text. */
        char *reasoning = NULL, *content = NULL;
        split_reply(tok, on_r.tokens, on_r.n_tokens, pp.thinking_open, &reasoning, &content);
        chat_reply r = {content ? content : "", reasoning, NULL};
        chat_messages_append_reply(msgs, &r, &err);
        free(reasoning);
        free(content);
        free(held);
        n_held = row->n + on_r.n_tokens;
        held = malloc((size_t)n_held * sizeof *held);
        memcpy(held, prompt, (size_t)row->n * sizeof *held);
        memcpy(held + row->n, on_r.tokens, (size_t)on_r.n_tokens * sizeof *held);
        engine_result_free(&off_r);
        engine_result_free(&on_r);
        chat_turn_predictor_free(plan.predictor);
        free(prompt);
        free(prompt_text);
    }

    int done = 0, miss = 0, diff = 0;
    for (int t = 0; t < o->turns && rows[t].n > 0; t++, done++) {
        if (t > 0 && rows[t].fwd_on > rows[t].bound) miss++;
        if (!rows[t].same) diff++;
    }
    apc_stats s;
    apc_get_stats(engine_cache(e), &s);
    printf("\n");
    if (done > 1)
        printf("re-prefill target (turns 2-%d: <= new + %lld): %s (%d over)\n", done, (long long)slack,
               miss ? "MISSED" : "met", miss);
    if (done >= 5)
        printf("TTFT target (>= 5x lower than cold by turn 5): %s (turn 5: %.1fx)\n",
               rows[4].ttft_off / rows[4].ttft_on >= 5.0 ? "met" : "MISSED", rows[4].ttft_off / rows[4].ttft_on);
    printf("warm results bit-identical to cold: %s\n", diff ? "NO" : "yes");
    printf("cache: lookups hit %llu miss %llu, block evictions %llu, exact hits %llu stores %llu, "
           "ckpt stores %llu hits %llu "
           "(matched %llu), records %d, anchors stored %llu hit %llu, missed adoptions %llu, pool evictions %llu, "
           "retire fallback full %llu suppressed %llu, grid truncates %llu, declines:",
           (unsigned long long)s.lookups_hit, (unsigned long long)s.lookups_miss, (unsigned long long)s.evictions,
           (unsigned long long)s.exact_hits, (unsigned long long)s.exact_stores, (unsigned long long)s.ckpt_stores,
           (unsigned long long)s.ckpt_hits, (unsigned long long)s.ckpt_matched_tokens, s.ckpt_records,
           (unsigned long long)s.anchor_stores, (unsigned long long)s.anchor_hits,
           (unsigned long long)s.ckpt_missed_adoptions, (unsigned long long)s.ckpt_pool_evictions,
           (unsigned long long)s.retire_fallback_full, (unsigned long long)s.retire_fallback_suppressed,
           (unsigned long long)s.ckpt_grid_truncate);
    int any = 0;
    for (int d = 0; d < APC_CKPT_DECLINE_COUNT_ && d < 16; d++)
        if (s.ckpt_declines[d]) {
            printf(" %s=%llu", apc_ckpt_decline_name((apc_ckpt_decline)d), (unsigned long long)s.ckpt_declines[d]);
            any = 1;
        }
    printf("%s\n", any ? "" : " none");
    fflush(stdout);

    free(held);
    free(rows);
    chat_messages_free(msgs);
    chat_template_free(tpl);
    free(bos);
    free(eos);
    engine_free(e);
    model_free(m);
    return rc ? rc : (diff ? 3 : 0);
}

int main(int argc, char **argv) {
    opts o = {10, 1024, 32, 300, 2, 512, 0};
    const char *models[16];
    int n_models = 0;
    for (int i = 1; i < argc; i++) {
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            printf("usage: bench_multiturn [--model PATH]... [--turns N] [--turn-tokens T] [--reply R] "
                   "[--sys-tokens S] [--threads N] [--step S] [--blocks B]\n");
            return 0;
        }
        if (val == NULL) {
            fprintf(stderr, "bench_multiturn: %s needs a value\n", argv[i]);
            return 2;
        }
        if (strcmp(argv[i], "--model") == 0) {
            if (n_models < 16) models[n_models++] = val;
        } else if (strcmp(argv[i], "--turns") == 0) o.turns = atoi(val);
        else if (strcmp(argv[i], "--turn-tokens") == 0) o.turn_tokens = atoi(val);
        else if (strcmp(argv[i], "--reply") == 0) o.reply = atoi(val);
        else if (strcmp(argv[i], "--sys-tokens") == 0) o.sys_tokens = atoi(val);
        else if (strcmp(argv[i], "--threads") == 0) o.threads = atoi(val);
        else if (strcmp(argv[i], "--step") == 0) o.step = atoi(val);
        else if (strcmp(argv[i], "--blocks") == 0) o.blocks = (int32_t)atoi(val);
        else {
            fprintf(stderr, "bench_multiturn: unknown option %s\n", argv[i]);
            return 2;
        }
        i++;
    }
    if (o.turns < 1 || o.turn_tokens < 1 || o.reply < 1 || o.sys_tokens < 0 || o.step < 1) {
        fprintf(stderr, "bench_multiturn: --turns, --turn-tokens, --reply and --step must be positive\n");
        return 2;
    }
    static const char *defaults[] = {
        "build/bench-models/qwen3-small-q8_0.gguf", "build/bench-models/gemma3-small-q8_0.gguf",
        "build/bench-models/qwen35-small-q8_0.gguf", "build/bench-models/mamba2-small-q8_0.gguf",
        "build/bench-models/falcon-h1-small-q8_0.gguf"};
    if (n_models == 0)
        for (size_t i = 0; i < sizeof defaults / sizeof defaults[0]; i++) models[n_models++] = defaults[i];
    if (getenv("EMBER_LOG") == NULL) ember_log_set_level(EMBER_LOG_WARN);
    int rc = 0;
    for (int i = 0; i < n_models; i++) {
        int r = bench_model(models[i], &o);
        if (r && !rc) rc = r;
    }
    return rc;
}
