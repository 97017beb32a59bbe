/* bench_bw.c - how close decode comes to this machine's memory bandwidth.
 *
 * Usage: bench_bw [--threads N] [--ctx C] [--reps R] [--mb M] [MODEL.gguf]...
 *
 * First the machine: a STREAM-like triad (a[i] = b[i] + s * c[i] over three
 * arrays of M MB each, default 256, far larger than the last-level cache;
 * counted as STREAM does, 3 arrays' bytes per pass, write-allocate traffic
 * not counted) and a read-only pass (a sum over one array: what decode
 * does with weights), both split over N threads (default 2) the way the
 * engine splits a matmul, best of R passes.
 *
 * Then each model: decode one token at position C (default 512) after a
 * prefill, best and median of R steps, and the bytes such a step must read
 * from memory: every weight tensor except the token embedding (only its row
 * is read, unless it doubles as the LM head) plus the KV of the C earlier
 * positions in every layer. Effective bandwidth = bytes / step time, printed
 * against both measured bandwidths. The machine is shared, so the passes
 * take turns: every round times the triad, the read pass and each model's
 * step once, and each figure keeps its best round. Each figure also comes
 * per CPU second of the process (its best round), which leaves out the time
 * other processes held the cores: with --threads 1 the steadier measure on
 * a shared machine (with more threads it counts the pool's spin-waits). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/threadpool.h"
#include "gguf/gguf.h"
#include "kv/kv_pool.h"
#include "model/model.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* CPU time of the process: on a shared machine it leaves out the time the
 * cores ran other processes (memory stalls still count), so with one thread
 * the ratios it gives move less than wall-clock ones. */
static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct stream_task {
    float *a;
    const float *b, *c;
    long n;
    float s;
    double sums[64]; /* read pass: per thread, so the loads are not dead code */
} stream_task;

static void triad_task(void *ctx, int ith, int nth) {
    stream_task *t = ctx;
    long i0, i1;
    ember_split_range(t->n, 1024, ith, nth, &i0, &i1);
    float *restrict a = t->a;
    const float *restrict b = t->b, *restrict c = t->c;
    const float s = t->s;
    for (long i = i0; i < i1; i++) a[i] = b[i] + s * c[i];
}

static void read_task(void *ctx, int ith, int nth) {
    stream_task *t = ctx;
    long i0, i1;
    ember_split_range(t->n, 1024, ith, nth, &i0, &i1);
    /* 8 independent 4-lane sums in registers (baseline x86-64 code): the
     * loads, not the adds, are the limit */
    typedef float v4 __attribute__((vector_size(16)));
    v4 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
    const v4 *b = (const v4 *)(t->b + i0); /* 4 KB aligned: i0 is a multiple of 1024 */
    for (long i = 0; i + 8 <= (i1 - i0) / 4; i += 8) {
        a0 += b[i], a1 += b[i + 1], a2 += b[i + 2], a3 += b[i + 3];
        a4 += b[i + 4], a5 += b[i + 5], a6 += b[i + 6], a7 += b[i + 7];
    }
    v4 acc = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
    double sum = (double)acc[0] + acc[1] + acc[2] + acc[3];
    t->sums[ith % 64] = sum;
}

typedef struct model_run {
    const char *path;
    model *m;
    kv_pool *pool;
    model_ctx *c;
    kv_seq seq;
    int32_t token;
    float *logits;
    double weight_bytes, kv_bytes;
    double *times, cpu_best;
} model_run;

/* Bytes of weights one decode step reads: all tensors but the token
 * embedding, which counts only when it is also the output matrix. */
static double weight_bytes(const char *path) {
    ember_error err;
    gguf_file *f = gguf_open(path, &err);
    if (f == NULL) return 0;
    bool tied = gguf_find_tensor(f, "output.weight") == NULL;
    double sum = 0;
    for (int64_t i = 0; i < gguf_tensor_count(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        if (!tied && strcmp(t->name, "token_embd.weight") == 0) continue;
        sum += (double)t->nbytes;
    }
    gguf_close(f);
    return sum;
}

static int open_model(model_run *r, int ctx, int threads) {
    ember_error err;
    r->m = model_load(r->path, &err);
    if (r->m == NULL) {
        fprintf(stderr, "bench_bw: %s\n", err.msg);
        return -1;
    }
    const model_hparams *hp = model_get_hparams(r->m);
    if (model_has_state(r->m)) {
        fprintf(stderr, "bench_bw: %s has recurrent state; this bench times attention models only\n", r->path);
        return -1;
    }
    kv_pool_config kc;
    model_kv_config(r->m, (ctx + 64) / KV_BLOCK_TOKENS + 2, &kc);
    r->pool = kv_pool_create(&kc, &err);
    r->c = r->pool ? model_ctx_create(r->m, r->pool, threads, 512, &err) : NULL;
    if (r->c == NULL) {
        fprintf(stderr, "bench_bw: %s\n", err.msg);
        return -1;
    }
    r->weight_bytes = weight_bytes(r->path);
    r->kv_bytes = (double)kv_format_token_bytes(&kc) * ctx;
    int32_t *tok = malloc((size_t)ctx * sizeof(int32_t));
    for (int i = 0; i < ctx; i++) tok[i] = 1 + (int32_t)((i * 7919u) % (unsigned)(hp->n_vocab - 1));
    r->token = tok[ctx / 2];
    r->logits = malloc((size_t)hp->n_vocab * sizeof(float));
    kv_seq_init(&r->seq);
    int rc = model_eval(r->c, &r->seq, tok, ctx, false, r->logits, &err);
    free(tok);
    if (rc < 0) {
        fprintf(stderr, "bench_bw: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static double decode_step(model_run *r, int ctx) {
    ember_error err;
    kv_seq_truncate(r->pool, &r->seq, ctx);
    double t0 = now_s(), c0 = cpu_s();
    if (model_eval(r->c, &r->seq, &r->token, 1, false, r->logits, &err) < 0) {
        fprintf(stderr, "bench_bw: %s\n", err.msg);
        exit(1);
    }
    double dc = cpu_s() - c0;
    if (dc < r->cpu_best) r->cpu_best = dc;
    return now_s() - t0;
}

int main(int argc, char **argv) {
    int threads = 2, ctx = 512, reps = 10, mb = 256, n_models = 0;
    model_run runs[8];
    memset(runs, 0, sizeof runs);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ctx") && i + 1 < argc) ctx = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--mb") && i + 1 < argc) mb = atoi(argv[++i]);
        else if (argv[i][0] != '-' && n_models < 8) runs[n_models++].path = argv[i];
        else {
            fprintf(stderr, "usage: bench_bw [--threads N] [--ctx C] [--reps R] [--mb M] [MODEL.gguf]...\n");
            return 2;
        }
    }
    if (threads < 1 || ctx < 1 || reps < 1 || mb < 1) {
        fprintf(stderr, "bench_bw: --threads, --ctx, --reps and --mb must be positive\n");
        return 2;
    }
    long n = (long)mb * (1 << 20) / (long)sizeof(float);
    float *a = malloc((size_t)n * sizeof(float)), *b = malloc((size_t)n * sizeof(float)),
          *c = malloc((size_t)n * sizeof(float));
    if (!a || !b || !c) {
        fprintf(stderr, "bench_bw: cannot allocate 3 x %d MB\n", mb);
        return 1;
    }
    for (long i = 0; i < n; i++) a[i] = 0, b[i] = (float)(i & 1023), c[i] = 1.0f / (float)(1 + (i & 7));
    ember_pool *pool = ember_pool_create(threads);
    for (int k = 0; k < n_models; k++) {
        if (open_model(&runs[k], ctx, threads) < 0) return 1;
        runs[k].times = malloc((size_t)reps * sizeof(double));
        runs[k].cpu_best = 1e30;
    }
    stream_task st = {.a = a, .b = b, .c = c, .n = n, .s = 3.0f};
    ember_pool_run(pool, triad_task, &st); /* first touch, page faults */
    ember_pool_run(pool, read_task, &st);
    double triad_best = 1e30, read_best = 1e30, triad_cpu = 1e30, read_cpu = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = now_s(), c0 = cpu_s();
        ember_pool_run(pool, triad_task, &st);
        double t1 = now_s(), c1 = cpu_s();
        ember_pool_run(pool, read_task, &st);
        double t2 = now_s(), c2 = cpu_s();
        if (t1 - t0 < triad_best) triad_best = t1 - t0;
        if (t2 - t1 < read_best) read_best = t2 - t1;
        if (c1 - c0 < triad_cpu) triad_cpu = c1 - c0;
        if (c2 - c1 < read_cpu) read_cpu = c2 - c1;
        for (int k = 0; k < n_models; k++) runs[k].times[r] = decode_step(&runs[k], ctx);
    }
    double triad_gbs = 3.0 * (double)n * sizeof(float) / triad_best * 1e-9;
    double read_gbs = (double)n * sizeof(float) / read_best * 1e-9;
    double check = 0;
    for (int k = 0; k < 64; k++) check += st.sums[k];
    printf("memory bandwidth, %d threads, best of %d (arrays of %d MB; checksum %.0f):\n", threads, reps, mb, check);
    double triad_cgbs = 3.0 * (double)n * sizeof(float) / triad_cpu * 1e-9;
    double read_cgbs = (double)n * sizeof(float) / read_cpu * 1e-9;
    printf("  triad a = b + s*c   %7.2f GB/s   (per CPU second of %d threads: %7.2f GB/s)\n", triad_gbs, threads,
           triad_cgbs);
    printf("  read  sum(b)        %7.2f GB/s   (per CPU second: %7.2f GB/s)\n", read_gbs, read_cgbs);
    for (int k = 0; k < n_models; k++) {
        model_run *r = &runs[k];
        qsort(r->times, (size_t)reps, sizeof(double), cmp_double);
        double best = r->times[0], med = r->times[reps / 2], bytes = r->weight_bytes + r->kv_bytes;
        const char *base = strrchr(r->path, '/');
        printf("decode %s at position %d: %.1f MB weights + %.1f MB KV per token\n", base ? base + 1 : r->path, ctx,
               r->weight_bytes / 1e6, r->kv_bytes / 1e6);
        printf("  best %7.2f ms = %6.2f GB/s = %5.1f%% of triad, %5.1f%% of read; median %7.2f ms = %5.1f%% of triad\n",
               best * 1e3, bytes / best * 1e-9, 100 * bytes / best * 1e-9 / triad_gbs,
               100 * bytes / best * 1e-9 / read_gbs, med * 1e3, 100 * bytes / med * 1e-9 / triad_gbs);
        printf("  per CPU second: best %7.2f ms = %6.2f GB/s = %5.1f%% of triad, %5.1f%% of read (same measure)\n",
               r->cpu_best * 1e3, bytes / r->cpu_best * 1e-9, 100 * bytes / r->cpu_best * 1e-9 / triad_cgbs,
               100 * bytes / r->cpu_best * 1e-9 / read_cgbs);
        kv_seq_release(r->pool, &r->seq);
        model_ctx_free(r->c);
        kv_pool_free(r->pool);
        model_free(r->m);
        free(r->logits);
        free(r->times);
    }
    ember_pool_free(pool);
    free(a), free(b), free(c);
    return 0;
}
