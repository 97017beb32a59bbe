/* bench_engine.c - prefill and decode throughput of the engine.
 *
 * Usage: bench_engine MODEL [--threads 2] [--reps 5] [--prefill 512,2048] [--decode 128]
 *
 * For each prefill length P: a fresh sequence forwards P tokens in one batch
 * (as llama-bench's pp test does). Decode: after a 16-token prompt, 128
 * single-token steps (llama-bench's tg test). Each figure is the median of
 * --reps runs with the spread (min..max). The baseline column is llama.cpp
 * build 9928 `llama-bench -t 2` on this machine for the qwen3-0.6b shape,
 * from the issue that set the target; ratio = ember / llama.cpp. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/clock.h"
#include "model/model.h"
#include "tensor/dtype.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct baseline {
    const char *type;
    double pp512, pp2048, tg128;
} baseline;

static const baseline llama_cpp[] = {
    {"q8_0", 143.3, 106.8, 23.6},
    {"q4_K", 192.1, 134.8, 34.7},
};

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_engine MODEL [--threads N] [--reps R] [--prefill 512,2048] [--decode 128]\n");
        return 2;
    }
    const char *path = argv[1];
    int threads = 2, reps = 5, decode_n = 128;
    int prefill[8] = {512, 2048}, n_prefill = 2;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--threads") == 0) threads = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--reps") == 0) reps = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--decode") == 0) decode_n = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--prefill") == 0) {
            n_prefill = 0;
            for (char *tok = strtok(argv[i + 1], ","); tok && n_prefill < 8; tok = strtok(NULL, ","))
                prefill[n_prefill++] = atoi(tok);
        }
    }
    if (reps < 1) reps = 1;
    ember_error err;
    model *m = model_load(path, &err);
    if (m == NULL) {
        fprintf(stderr, "bench_engine: %s\n", err.msg);
        return 1;
    }
    const model_hparams *hp = model_get_hparams(m);
    int max_p = decode_n + 16;
    for (int i = 0; i < n_prefill; i++)
        if (prefill[i] > max_p) max_p = prefill[i];
    kv_pool_config cfg;
    model_kv_config(m, max_p / KV_BLOCK_TOKENS + 2, &cfg);
    kv_pool *pool = kv_pool_create(&cfg, &err);
    model_ctx *ctx = pool ? model_ctx_create(m, pool, threads, max_p, &err) : NULL;
    if (ctx == NULL) {
        fprintf(stderr, "bench_engine: %s\n", err.msg);
        return 1;
    }
    int32_t *ids = malloc((size_t)max_p * sizeof *ids);
    float *logits = malloc((size_t)hp->n_vocab * sizeof(float));
    for (int i = 0; i < max_p; i++) ids[i] = (int32_t)((i * 7919 + 13) % (hp->n_vocab - 300)) + 256;

    /* The dominant weight type names the baseline row. */
    const char *wtype = "f32";
    const gguf_file *f = model_get_gguf(m);
    const gguf_tensor *probe = gguf_find_tensor(f, "blk.0.ffn_gate.weight");
    if (probe == NULL) probe = gguf_find_tensor(f, "blk.0.attn_q.weight");
    if (probe) wtype = dtype_info_of(probe->type)->name;
    const baseline *base = NULL;
    for (size_t i = 0; i < sizeof llama_cpp / sizeof llama_cpp[0]; i++)
        if (strcmp(llama_cpp[i].type, wtype) == 0) base = &llama_cpp[i];

    printf("model %s: %s, %d layers, n_embd %d, weights %s, %d threads, %d reps\n", path, hp->arch_name, hp->n_layer,
           hp->n_embd, wtype, threads, reps);
    printf("%-14s %12s %22s %12s %8s\n", "test", "tok/s (med)", "spread (min..max)", "llama.cpp", "ratio");
    double *rates = malloc((size_t)reps * sizeof(double));
    for (int t = 0; t < n_prefill + 1; t++) {
        bool is_decode = t == n_prefill;
        int n = is_decode ? decode_n : prefill[t];
        for (int r = 0; r < reps; r++) {
            kv_seq seq;
            kv_seq_init(&seq);
            double t0, t1;
            if (is_decode) {
                if (model_eval(ctx, &seq, ids, 16, false, logits, &err) < 0) goto fail;
                t0 = ember_now();
                for (int i = 0; i < n; i++)
                    if (model_eval(ctx, &seq, ids + 16 + i, 1, false, logits, &err) < 0) goto fail;
                t1 = ember_now();
            } else {
                t0 = ember_now();
                if (model_eval(ctx, &seq, ids, n, false, logits, &err) < 0) goto fail;
                t1 = ember_now();
            }
            rates[r] = n / (t1 - t0);
            kv_seq_release(pool, &seq);
        }
        qsort(rates, (size_t)reps, sizeof(double), cmp_double);
        double med = rates[reps / 2], ref = 0;
        if (base) ref = is_decode ? base->tg128 : n == 512 ? base->pp512 : n == 2048 ? base->pp2048 : 0;
        char name[32], spread[48];
        snprintf(name, sizeof name, "%s%d", is_decode ? "decode " : "prefill ", n);
        snprintf(spread, sizeof spread, "%.1f..%.1f", rates[0], rates[reps - 1]);
        if (ref > 0) printf("%-14s %12.1f %22s %12.1f %7.2fx\n", name, med, spread, ref, med / ref);
        else printf("%-14s %12.1f %22s %12s %8s\n", name, med, spread, "-", "-");
        fflush(stdout);
    }
    free(rates);
    free(ids);
    free(logits);
    model_ctx_free(ctx);
    kv_pool_free(pool);
    model_free(m);
    return 0;
fail:
    fprintf(stderr, "bench_engine: %s\n", err.msg);
    return 1;
}
