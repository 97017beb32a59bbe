/* bench_bw.c - how close decode comes to this machine's memory bandwidth.
 *
 * Usage: bench_bw [--threads N[,N...]] [--ctx C] [--reps R] [--mb M] [--kv FORMAT] [--profile] [MODEL.gguf]...
 *        bench_bw --attention KEYS [--reps R]
 *
 * First the machine: a STREAM-like triad (a[i] = b[i] + s * c[i] over three
 * arrays of M MB each, default 256, far larger than the last-level cache;
 * counted as STREAM does, 3 arrays' bytes per pass, write-allocate traffic
 * not counted) and a read-only pass (a sum over one array: what decode
 * does with weights), both split over N threads the way the engine splits a
 * matmul, best of R passes. --threads takes a list (default 1,2): every
 * figure is measured at each thread count and compared with the bandwidth
 * of the same thread count.
 *
 * Then each model: decode one token at position C (default 512) after a
 * prefill, best and median of R steps, and the bytes such a step must read
 * from memory: every weight tensor except the token embedding (only its row
 * is read, unless it doubles as the LM head) plus the KV of the C earlier
 * positions in every layer, in the KV format of --kv (default f32; the
 * server's default is f16). Effective bandwidth = bytes / step time, printed
 * against both measured bandwidths. The machine is shared, so the passes
 * take turns: every round times, for each thread count, the triad, the read
 * pass and each model's step once, and each figure keeps its best round.
 * Each figure also comes per CPU second of the process (its best round),
 * which leaves out the time other processes held the cores: with one thread
 * the steadier measure on a shared machine (with more threads it counts the
 * pool's spin-waits).
 *
 * --profile: where a step goes, per class of model_ctx_set_profile (median
 * over the rounds, ms and share of the step, and for the matmul classes
 * their weight bytes / time), and the thread pool's work per step (tasks
 * handed to the workers = barriers, the caller's waits for workers' parts,
 * how many of those slept, the time waited).
 *
 * --attention KEYS: one decode token's attention on the qwen3-0.6b shape
 * (16 query heads over 8 kv heads of 128, 28 layers) over KEYS cached
 * positions, per KV row format (K rows in the pool's key format: q12h for
 * q8_0) and per instruction set (scalar, AVX2, AVX-512 where the CPU has
 * them), interleaved, best of R: ms per token. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/threadpool.h"
#include "gguf/gguf.h"
#include "kv/kv_pool.h"
#include "model/model.h"
#include "tensor/kv_rows.h"
#include "tensor/ops.h"
#include "tensor/quant.h"

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


/* The same two passes with 64-byte AVX-512 loads and stores, the width the
 * decode kernels load weights with: on this project's machine (AMD EPYC,
 * 2 vCPUs) one thread mostly reads 5-15% faster this way than with the
 * 16-byte loads above, so a reference measured with the narrow loads alone
 * understated what one thread can read. */
#if defined(__x86_64__)
#include <immintrin.h>
#define HAVE_WIDE 1
__attribute__((target("avx512f"))) static void triad_task_wide(void *ctx, int ith, int nth) {
    stream_task *t = ctx;
    long i0, i1;
    ember_split_range(t->n, 1024, ith, nth, &i0, &i1);
    const __m512 s = _mm512_set1_ps(t->s);
    for (long i = i0; i + 16 <= i1; i += 16)
        _mm512_store_ps(t->a + i, _mm512_fmadd_ps(s, _mm512_load_ps(t->c + i), _mm512_load_ps(t->b + i)));
}

__attribute__((target("avx512f"))) static void read_task_wide(void *ctx, int ith, int nth) {
    stream_task *t = ctx;
    long i0, i1;
    ember_split_range(t->n, 1024, ith, nth, &i0, &i1);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (long i = i0; i + 64 <= i1; i += 64) {
        a0 = _mm512_add_ps(a0, _mm512_load_ps(t->b + i));
        a1 = _mm512_add_ps(a1, _mm512_load_ps(t->b + i + 16));
        a2 = _mm512_add_ps(a2, _mm512_load_ps(t->b + i + 32));
        a3 = _mm512_add_ps(a3, _mm512_load_ps(t->b + i + 48));
    }
    t->sums[ith % 64] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#else
#define HAVE_WIDE 0
#endif

enum { MAX_THREADS = 4, MAX_MODELS = 8 };

/* One model at one thread count: its own context on the model's pool and
 * sequence (contexts take turns, so they share the prefilled KV). */
typedef struct model_at {
    model_ctx *c;
    double *times, cpu_best;
    model_profile *prof;       /* per round */
    ember_pool_stats *pstats;  /* per round: the step's pool work */
} model_at;

typedef struct model_run {
    const char *path;
    model *m;
    kv_pool *pool;
    kv_seq seq;
    int32_t token;
    float *logits;
    double weight_bytes, kv_bytes;
    double class_bytes[MODEL_PROF_N]; /* weight (and KV) bytes each profile class reads */
    model_at at[MAX_THREADS];
} model_run;

/* Bytes of weights one decode step reads: all tensors but the token
 * embedding, which counts only when it is also the output matrix; also
 * sorted by the profile class whose step reads them. */
static double weight_bytes(const char *path, double *class_bytes) {
    ember_error err;
    gguf_file *f = gguf_open(path, &err);
    if (f == NULL) return 0;
    bool tied = gguf_find_tensor(f, "output.weight") == NULL;
    static const struct { const char *part; model_prof_class cls; } parts[] = {
        {".attn_q.", MODEL_PROF_QKV}, {".attn_k.", MODEL_PROF_QKV}, {".attn_v.", MODEL_PROF_QKV},
        {".attn_output.", MODEL_PROF_WO}, {".ffn_gate.", MODEL_PROF_FFN_IN}, {".ffn_up.", MODEL_PROF_FFN_IN},
        {".ffn_down.", MODEL_PROF_FFN_DOWN},
    };
    double sum = 0;
    for (int64_t i = 0; i < gguf_tensor_count(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        bool embd = strcmp(t->name, "token_embd.weight") == 0;
        if (!tied && embd) continue;
        sum += (double)t->nbytes;
        if (embd || strcmp(t->name, "output.weight") == 0) class_bytes[MODEL_PROF_HEAD] += (double)t->nbytes;
        for (size_t k = 0; k < sizeof parts / sizeof parts[0]; k++)
            if (strstr(t->name, parts[k].part) && strstr(t->name, ".weight")) class_bytes[parts[k].cls] += (double)t->nbytes;
    }
    gguf_close(f);
    return sum;
}

static kv_format bench_kv_format = {KV_FORMAT_F32};

static int open_model(model_run *r, int ctx, const int *threads, int n_threads, int reps) {
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
    kc.format = bench_kv_format;
    r->pool = kv_pool_create(&kc, &err);
    if (r->pool == NULL) {
        fprintf(stderr, "bench_bw: %s\n", err.msg);
        return -1;
    }
    for (int t = 0; t < n_threads; t++) {
        model_at *a = &r->at[t];
        a->c = model_ctx_create(r->m, r->pool, threads[t], 512, &err);
        if (a->c == NULL) {
            fprintf(stderr, "bench_bw: %s\n", err.msg);
            return -1;
        }
        a->times = malloc((size_t)reps * sizeof(double));
        a->prof = calloc((size_t)reps, sizeof(model_profile));
        a->pstats = calloc((size_t)reps, sizeof(ember_pool_stats));
        a->cpu_best = 1e30;
    }
    r->weight_bytes = weight_bytes(r->path, r->class_bytes);
    r->kv_bytes = (double)kv_format_token_bytes(&kc) * ctx;
    r->class_bytes[MODEL_PROF_ATTN] = r->kv_bytes;
    int32_t *tok = malloc((size_t)ctx * sizeof(int32_t));
    for (int i = 0; i < ctx; i++) tok[i] = 1 + (int32_t)((i * 7919u) % (unsigned)(hp->n_vocab - 1));
    r->token = tok[ctx / 2];
    r->logits = malloc((size_t)hp->n_vocab * sizeof(float));
    kv_seq_init(&r->seq);
    int rc = model_eval(r->at[n_threads - 1].c, &r->seq, tok, ctx, false, r->logits, &err);
    free(tok);
    if (rc < 0) {
        fprintf(stderr, "bench_bw: %s\n", err.msg);
        return -1;
    }
    return 0;
}

/* The decode step's pool work: stats after minus stats before. */
static void stats_diff(ember_pool_stats *d, const ember_pool_stats *a, const ember_pool_stats *b) {
    d->tasks = b->tasks - a->tasks;
    d->parts = b->parts - a->parts;
    d->caller_parts = b->caller_parts - a->caller_parts;
    d->waits = b->waits - a->waits;
    d->sleeps = b->sleeps - a->sleeps;
    d->wait_ns = b->wait_ns - a->wait_ns;
    d->solo_tasks = b->solo_tasks - a->solo_tasks;
}

static double decode_step(model_run *r, model_at *a, int ctx, int round) {
    ember_error err;
    kv_seq_truncate(r->pool, &r->seq, ctx);
    ember_pool_stats s0, s1;
    model_ctx_pool_stats(a->c, &s0);
    model_ctx_set_profile(a->c, &a->prof[round]);
    double t0 = now_s(), c0 = cpu_s();
    if (model_eval(a->c, &r->seq, &r->token, 1, false, r->logits, &err) < 0) {
        fprintf(stderr, "bench_bw: %s\n", err.msg);
        exit(1);
    }
    double dc = cpu_s() - c0, dt = now_s() - t0;
    model_ctx_set_profile(a->c, NULL);
    model_ctx_pool_stats(a->c, &s1);
    stats_diff(&a->pstats[round], &s0, &s1);
    if (dc < a->cpu_best) a->cpu_best = dc;
    return dt;
}

static double median_of(double *v, int n) {
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return v[n / 2];
}

static void print_profile(const model_run *r, const model_at *a, int reps, double step_med) {
    double *v = malloc((size_t)reps * sizeof(double));
    printf("    %-13s %8s %6s %9s\n", "step", "ms", "share", "GB/s");
    for (int k = 0; k < MODEL_PROF_N; k++) {
        for (int i = 0; i < reps; i++) v[i] = (double)a->prof[i].ns[k] * 1e-6;
        double ms = median_of(v, reps);
        if (ms < 0.0005) continue;
        printf("    %-13s %8.3f %5.1f%%", model_prof_class_name((model_prof_class)k), ms, 100 * ms / (step_med * 1e3));
        if (r->class_bytes[k] > 0) printf(" %9.2f", r->class_bytes[k] / (ms * 1e-3) * 1e-9);
        printf("\n");
    }
    double tasks = 0, parts = 0, caller = 0, waits = 0, sleeps = 0, solo = 0;
    for (int i = 0; i < reps; i++) {
        tasks += (double)a->pstats[i].tasks, parts += (double)a->pstats[i].parts;
        caller += (double)a->pstats[i].caller_parts, waits += (double)a->pstats[i].waits;
        sleeps += (double)a->pstats[i].sleeps;
        solo += (double)a->pstats[i].solo_tasks;
        v[i] = (double)a->pstats[i].wait_ns * 1e-6;
    }
    double wait_med = median_of(v, reps);
    if (tasks > 0)
        printf("    pool per step: %.0f tasks (barriers), %.0f parts, %.0f%% run by the caller; caller waited %.0f times "
               "(%.0f slept), median %.3f ms = %.1f%% of the step\n",
               tasks / reps, parts / reps, 100 * caller / parts, waits / reps, sleeps / reps, wait_med,
               100 * wait_med / (step_med * 1e3));
    if (solo > 0)
        printf("    pool per step: %.0f tasks run by the caller alone (workers were costing more than they gave)\n",
               solo / reps);
    free(v);
}

/* ---- --attention: one decode token's attention per format and ISA ---- */

static int attention_bench(int n_keys, int reps) {
    enum { N_HEAD = 16, N_KV = 8, D = 128, LAYERS = 28 };
    const kv_row_type types[] = {KV_ROW_F32, KV_ROW_F16, KV_ROW_Q8_0};
    const quant_isa isas[] = {QUANT_ISA_SCALAR, QUANT_ISA_AVX2, QUANT_ISA_AVX512};
    const char *isa_names[] = {"scalar", "AVX2", "AVX-512"};
    int n_blocks = (n_keys + 15) / 16;
    quant_isa saved = quant_get_isa();
    bool have[3];
    for (int i = 0; i < 3; i++) have[i] = quant_set_isa(isas[i]);
    quant_set_isa(saved);
    float q[N_HEAD * D], out[N_HEAD * D], row[N_KV * D];
    float *scratch = malloc((size_t)N_HEAD * (size_t)(n_keys + 1) * sizeof(float));
    uint64_t seed = 1;
    double best[3][3];
    for (int t = 0; t < 3; t++)
        for (int i = 0; i < 3; i++) best[t][i] = 1e30;
    for (int t = 0; t < 3; t++) {
        /* K rows in the pool's key format (q12h for a q8_0 pool), V rows as the type */
        kv_row_type k_type = kv_row_key_type(types[t]);
        size_t k_rb = kv_row_bytes(k_type, N_KV * D), v_rb = kv_row_bytes(types[t], N_KV * D);
        /* separate K and V blocks per layer, as in a model: each layer's
         * attention streams its own KV from memory */
        void **kb = malloc((size_t)LAYERS * n_blocks * sizeof(void *)), **vb = malloc((size_t)LAYERS * n_blocks * sizeof(void *));
        for (int b = 0; b < LAYERS * n_blocks; b++) {
            kb[b] = malloc(16 * k_rb);
            vb[b] = malloc(16 * v_rb);
            for (int k = 0; k < 32; k++) {
                for (int e = 0; e < N_KV * D; e++) {
                    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
                    row[e] = (float)((seed >> 40) & 0xFFFF) / 65536.0f - 0.5f;
                }
                if (k < 16) kv_row_encode(k_type, row, (uint8_t *)kb[b] + (size_t)k * k_rb, N_KV * D);
                else kv_row_encode(types[t], row, (uint8_t *)vb[b] + (size_t)(k - 16) * v_rb, N_KV * D);
            }
        }
        for (int e = 0; e < N_HEAD * D; e++) q[e] = (float)(e % 17) * 0.05f - 0.4f;
        int64_t pos = n_keys - 1;
        for (int r = 0; r < reps; r++)
            for (int i = 0; i < 3; i++) {
                if (!have[i]) continue;
                quant_set_isa(isas[i]);
                double t0 = now_s();
                for (int l = 0; l < LAYERS; l++)
                    op_attention_paged_rows(out, N_HEAD * D, q, N_HEAD * D, (const void *const *)(kb + l * n_blocks),
                                            (const void *const *)(vb + l * n_blocks), types[t], &pos, 1, N_HEAD, N_KV,
                                            D, D, 0.0884f, 0, 0, N_HEAD, scratch);
                double dt = now_s() - t0;
                if (dt < best[t][i]) best[t][i] = dt;
            }
        for (int b = 0; b < LAYERS * n_blocks; b++) free(kb[b]), free(vb[b]);
        free(kb);
        free(vb);
    }
    quant_set_isa(saved);
    printf("attention of one decode token over %d keys, 16 heads / 8 kv heads of 128, %d layers, one thread, best of %d (ms):\n",
           n_keys, LAYERS, reps);
    printf("  %-6s", "KV");
    for (int i = 0; i < 3; i++)
        if (have[i]) printf(" %10s", isa_names[i]);
    for (int i = 1; i < 3; i++)
        if (have[i]) printf(" %10s", i == 1 ? "AVX2/sc" : "512/sc");
    printf("\n");
    for (int t = 0; t < 3; t++) {
        printf("  %-6s", kv_row_type_name(types[t]));
        for (int i = 0; i < 3; i++)
            if (have[i]) printf(" %10.3f", best[t][i] * 1e3);
        for (int i = 1; i < 3; i++)
            if (have[i]) printf(" %9.2fx", best[t][0] / best[t][i]);
        printf("\n");
    }
    free(scratch);
    return 0;
}

int main(int argc, char **argv) {
    int threads[MAX_THREADS] = {1, 2}, n_threads = 2, ctx = 512, reps = 10, mb = 256, n_models = 0, att_keys = 0;
    bool profile = false;
    model_run runs[MAX_MODELS];
    memset(runs, 0, sizeof runs);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            n_threads = 0;
            for (char *p = argv[++i]; *p && n_threads < MAX_THREADS;) {
                threads[n_threads++] = (int)strtol(p, &p, 10);
                if (*p == ',') p++;
                else if (*p) threads[n_threads - 1] = 0;
            }
        } else if (!strcmp(argv[i], "--ctx") && i + 1 < argc) ctx = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--mb") && i + 1 < argc) mb = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--attention") && i + 1 < argc) att_keys = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--kv") && i + 1 < argc) {
            if (kv_format_parse(argv[++i], &bench_kv_format) < 0) {
                fprintf(stderr, "bench_bw: unknown KV format '%s'\n", argv[i]);
                return 2;
            }
        }
        else if (!strcmp(argv[i], "--profile")) profile = true;
        else if (argv[i][0] != '-' && n_models < MAX_MODELS) runs[n_models++].path = argv[i];
        else {
            fprintf(stderr, "usage: bench_bw [--threads N[,N...]] [--ctx C] [--reps R] [--mb M] [--kv FORMAT] [--profile] "
                            "[MODEL.gguf]...\n"
                            "       bench_bw --attention KEYS [--reps R]\n");
            return 2;
        }
    }
    bool bad = n_threads < 1 || ctx < 1 || reps < 1 || mb < 1 || att_keys < 0;
    for (int t = 0; t < n_threads; t++) bad |= threads[t] < 1;
    if (bad) {
        fprintf(stderr, "bench_bw: --threads, --ctx, --reps, --mb and --attention must be positive\n");
        return 2;
    }
    if (att_keys > 0) return attention_bench(att_keys, reps);
    long n = (long)mb * (1 << 20) / (long)sizeof(float);
    size_t bytes_each = (size_t)n * sizeof(float); /* a multiple of 1 MB: aligned for 64-byte loads */
    float *a = aligned_alloc(4096, bytes_each), *b = aligned_alloc(4096, bytes_each), *c = aligned_alloc(4096, bytes_each);
    if (!a || !b || !c) {
        fprintf(stderr, "bench_bw: cannot allocate 3 x %d MB\n", mb);
        return 1;
    }
    for (long i = 0; i < n; i++) a[i] = 0, b[i] = (float)(i & 1023), c[i] = 1.0f / (float)(1 + (i & 7));
    ember_pool *pools[MAX_THREADS];
    for (int t = 0; t < n_threads; t++) pools[t] = ember_pool_create(threads[t]);
    for (int k = 0; k < n_models; k++)
        if (open_model(&runs[k], ctx, threads, n_threads, reps) < 0) return 1;
    stream_task st = {.a = a, .b = b, .c = c, .n = n, .s = 3.0f};
    /* passes: triad and read with baseline x86-64 code, then with AVX-512 where the CPU has it */
    enum { N_PASS = 4 };
    ember_task_fn pass_fn[N_PASS] = {triad_task, read_task, NULL, NULL};
#if HAVE_WIDE
    if (__builtin_cpu_supports("avx512f")) pass_fn[2] = triad_task_wide, pass_fn[3] = read_task_wide;
#endif
    double pass_best[MAX_THREADS][N_PASS], pass_cpu[MAX_THREADS][N_PASS];
    for (int t = 0; t < n_threads; t++)
        for (int p = 0; p < N_PASS; p++) {
            if (pass_fn[p]) ember_pool_run(pools[t], pass_fn[p], &st); /* first touch, page faults */
            pass_best[t][p] = pass_cpu[t][p] = 1e30;
        }
    for (int r = 0; r < reps; r++)
        for (int t = 0; t < n_threads; t++) {
            for (int p = 0; p < N_PASS; p++) {
                if (!pass_fn[p]) continue;
                double t0 = now_s(), c0 = cpu_s();
                ember_pool_run(pools[t], pass_fn[p], &st);
                double dt = now_s() - t0, dc = cpu_s() - c0;
                if (dt < pass_best[t][p]) pass_best[t][p] = dt;
                if (dc < pass_cpu[t][p]) pass_cpu[t][p] = dc;
            }
            for (int k = 0; k < n_models; k++) runs[k].at[t].times[r] = decode_step(&runs[k], &runs[k].at[t], ctx, r);
        }
    double check = 0;
    for (int k = 0; k < 64; k++) check += st.sums[k];
    printf("memory bandwidth, best of %d rounds (arrays of %d MB; checksum %.0f); each pass with 16-byte loads "
           "(baseline x86-64)%s, the reference the better of the two:\n",
           reps, mb, check, pass_fn[2] ? " and with 64-byte AVX-512 loads" : "");
    double triad_gbs[MAX_THREADS], read_gbs[MAX_THREADS], triad_cgbs[MAX_THREADS], read_cgbs[MAX_THREADS];
    for (int t = 0; t < n_threads; t++) {
        double gbs[N_PASS], cgbs[N_PASS];
        for (int p = 0; p < N_PASS; p++) {
            double traffic = (p % 2 == 0 ? 3.0 : 1.0) * (double)bytes_each; /* triad counts 3 arrays, as STREAM */
            gbs[p] = pass_fn[p] ? traffic / pass_best[t][p] * 1e-9 : 0;
            cgbs[p] = pass_fn[p] ? traffic / pass_cpu[t][p] * 1e-9 : 0;
        }
        triad_gbs[t] = gbs[2] > gbs[0] ? gbs[2] : gbs[0];
        read_gbs[t] = gbs[3] > gbs[1] ? gbs[3] : gbs[1];
        triad_cgbs[t] = cgbs[2] > cgbs[0] ? cgbs[2] : cgbs[0];
        read_cgbs[t] = cgbs[3] > cgbs[1] ? cgbs[3] : cgbs[1];
        printf("  %d thread%s: triad a = b + s*c %7.2f GB/s, read sum(b) %7.2f GB/s   (per CPU second: %7.2f / %7.2f)\n",
               threads[t], threads[t] > 1 ? "s" : "", triad_gbs[t], read_gbs[t], triad_cgbs[t], read_cgbs[t]);
        if (pass_fn[2])
            printf("     16-byte loads: triad %7.2f, read %7.2f GB/s; 64-byte loads: triad %7.2f, read %7.2f GB/s\n", gbs[0],
                   gbs[1], gbs[2], gbs[3]);
    }
    for (int k = 0; k < n_models; k++) {
        model_run *r = &runs[k];
        double bytes = r->weight_bytes + r->kv_bytes;
        const char *base = strrchr(r->path, '/');
        printf("decode %s at position %d: %.1f MB weights + %.1f MB %s KV per token\n", base ? base + 1 : r->path, ctx,
               r->weight_bytes / 1e6, r->kv_bytes / 1e6, kv_format_name(bench_kv_format));
        for (int t = 0; t < n_threads; t++) {
            model_at *at = &r->at[t];
            double *sorted = malloc((size_t)reps * sizeof(double));
            memcpy(sorted, at->times, (size_t)reps * sizeof(double));
            qsort(sorted, (size_t)reps, sizeof(double), cmp_double);
            double best = sorted[0], med = sorted[reps / 2];
            free(sorted);
            printf("  %d thread%s: best %7.2f ms = %6.2f GB/s = %5.1f%% of triad, %5.1f%% of read; median %7.2f ms = "
                   "%5.1f%% of triad\n",
                   threads[t], threads[t] > 1 ? "s" : "", best * 1e3, bytes / best * 1e-9,
                   100 * bytes / best * 1e-9 / triad_gbs[t], 100 * bytes / best * 1e-9 / read_gbs[t], med * 1e3,
                   100 * bytes / med * 1e-9 / triad_gbs[t]);
            printf("     per CPU second: best %7.2f ms = %6.2f GB/s = %5.1f%% of triad, %5.1f%% of read (same measure)\n",
                   at->cpu_best * 1e3, bytes / at->cpu_best * 1e-9, 100 * bytes / at->cpu_best * 1e-9 / triad_cgbs[t],
                   100 * bytes / at->cpu_best * 1e-9 / read_cgbs[t]);
            if (profile) print_profile(r, at, reps, med);
        }
    }
    for (int k = 0; k < n_models; k++) {
        model_run *r = &runs[k];
        kv_seq_release(r->pool, &r->seq);
        for (int t = 0; t < n_threads; t++) {
            model_ctx_free(r->at[t].c);
            free(r->at[t].times);
            free(r->at[t].prof);
            free(r->at[t].pstats);
        }
        kv_pool_free(r->pool);
        model_free(r->m);
        free(r->logits);
    }
    for (int t = 0; t < n_threads; t++) ember_pool_free(pools[t]);
    free(a), free(b), free(c);
    return 0;
}
