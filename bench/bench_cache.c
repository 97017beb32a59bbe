/* bench_cache.c - what the prompt cache saves and what it costs.
 *
 * Usage: bench_cache MODEL [--threads N] [--sizes 1024,4096,16384] [--step 512] [--reps R]
 *
 * For each prompt length P (random token ids, one generated token):
 *   cold off  a request with the cache bypassed (no lookup, no store);
 *   cold on   the same request on an empty cache: it looks up (miss) and
 *             stores (post-prefill and retirement);
 *   warm      the identical resend: adopts P-1 tokens, forwards one.
 * Reported: time to first token of each, warm/cold, and the store overhead
 * two ways: the time spent inside the cache during "cold on" as a share of
 * that request (exact), and (cold on - cold off) / cold off (noisy: two
 * separate prefills). Each figure is the median of --reps runs. Meant for a
 * Qwen3-0.6B-shape Q8_0 model from `ember mkmodel --preset qwen3-0.6b --type
 * q8_0`; EMBER_APC_FORCE_TIER=exact measures the exact tier instead. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "engine/engine.h"
#include "serve/serve_settings.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return v[n / 2];
}

static int generate(engine *e, const int32_t *prompt, int64_t n, engine_cache_mode mode, engine_result *r) {
    engine_request q = engine_default_request();
    q.prompt = prompt;
    q.n_prompt = n;
    q.max_tokens = 1;
    q.stop_at_eog = false;
    q.cache = mode;
    ember_error err;
    if (engine_generate(e, &q, r, &err) < 0) {
        fprintf(stderr, "bench_cache: %s\n", err.msg);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_cache MODEL [--threads N] [--sizes 1024,4096,16384] [--step 512] [--reps R]\n");
        return 2;
    }
    const char *path = argv[1];
    int threads = 0, step = 512, reps = 1;
    int64_t sizes[16] = {1024, 4096, 16384};
    int n_sizes = 3;
    for (int i = 2; i < argc; i++) {
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (val == NULL) {
            fprintf(stderr, "bench_cache: %s needs a value\n", argv[i]);
            return 2;
        }
        if (strcmp(argv[i], "--threads") == 0) threads = atoi(val);
        else if (strcmp(argv[i], "--step") == 0) step = atoi(val);
        else if (strcmp(argv[i], "--reps") == 0) reps = atoi(val);
        else if (strcmp(argv[i], "--sizes") == 0) {
            n_sizes = 0;
            char *copy = strdup(val);
            for (char *t = strtok(copy, ","); t && n_sizes < 16; t = strtok(NULL, ",")) sizes[n_sizes++] = atoll(t);
            free(copy);
        } else {
            fprintf(stderr, "bench_cache: unknown option %s\n", argv[i]);
            return 2;
        }
        i++;
    }
    if (reps < 1) reps = 1;
    ember_error err;
    model *m = model_load(path, &err);
    if (m == NULL) {
        fprintf(stderr, "bench_cache: %s\n", err.msg);
        return 1;
    }
    int64_t largest = 0;
    for (int i = 0; i < n_sizes; i++)
        if (sizes[i] > largest) largest = sizes[i];
    engine_config cfg = engine_default_config();
    cfg.n_threads = threads;
    cfg.prefill_step = step;
    cfg.n_ctx = (int)largest + 64;
    /* Room for the stored prompt and a live request beside it. */
    cfg.num_blocks = (int32_t)(2 * (largest / KV_BLOCK_TOKENS) + 16);
    /* EMBER_APC_FORCE_TIER=exact and the other cache switches */
    engine *e = serve_settings_apply_env_cache(&cfg.cache, &err) < 0 ? NULL : engine_create(m, &cfg, &err);
    if (e == NULL) {
        fprintf(stderr, "bench_cache: %s\n", err.msg);
        return 1;
    }
    const model_hparams *hp = model_get_hparams(m);
    printf("model %s (%s, %d layers, n_embd %d), tier %s, threads %d, step %d, reps %d\n", path, hp->arch_name,
           hp->n_layer, hp->n_embd, apc_tier_name(apc_get_tier(engine_cache(e))), threads, step, reps);
    printf("| prompt | cold TTFT, cache off | cold TTFT, cache on | warm TTFT | warm / cold | time in cache (cold on) "
           "| store overhead | cold on vs off |\n");
    printf("|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    uint64_t rng = 88172645463325252ull;
    int V = hp->n_vocab;
    for (int s = 0; s < n_sizes; s++) {
        int64_t n = sizes[s];
        int32_t *prompt = malloc((size_t)n * sizeof(int32_t));
        for (int64_t i = 0; i < n; i++) {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            prompt[i] = (int32_t)(rng % (uint64_t)V);
        }
        double off[16], on[16], on_total[16], off_total[16], warm[16], in_cache[16];
        int r_n = reps > 16 ? 16 : reps;
        for (int r = 0; r < r_n; r++) {
            engine_result a, b, c;
            apc_reset(engine_cache(e));
            if (generate(e, prompt, n, ENGINE_CACHE_BYPASS, &a) < 0) return 1;
            if (generate(e, prompt, n, ENGINE_CACHE_ON, &b) < 0) return 1;
            if (generate(e, prompt, n, ENGINE_CACHE_ON, &c) < 0) return 1;
            if (c.prompt_forwarded != 1) fprintf(stderr, "bench_cache: warm run forwarded %lld tokens\n", (long long)c.prompt_forwarded);
            off[r] = a.ttft_s;
            off_total[r] = a.total_s;
            on[r] = b.ttft_s;
            on_total[r] = b.total_s;
            in_cache[r] = b.cache_s;
            warm[r] = c.ttft_s;
            engine_result_free(&a);
            engine_result_free(&b);
            engine_result_free(&c);
        }
        double m_off = median(off, r_n), m_on = median(on, r_n), m_warm = median(warm, r_n);
        double m_cache = median(in_cache, r_n), m_on_total = median(on_total, r_n), m_off_total = median(off_total, r_n);
        printf("| %lld | %.3f s | %.3f s | %.2f ms | 1/%.0f | %.2f ms | %.3f%% | %+.2f%% |\n", (long long)n, m_off, m_on,
               m_warm * 1e3, m_off / m_warm, m_cache * 1e3, 100.0 * m_cache / m_on_total,
               100.0 * (m_on_total - m_off_total) / m_off_total);
        fflush(stdout);
        free(prompt);
    }
    engine_free(e);
    model_free(m);
    return 0;
}
