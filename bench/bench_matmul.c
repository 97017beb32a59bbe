/* bench_matmul.c - throughput of tensor_matmul on qwen3-0.6b-like shapes.
 *
 * Times 1024->3072 and 3072->1024 matmuls in Q8_0, Q4_K, Q6_K, F16, BF16, Q4_0, IQ4_NL
 * and IQ4_XS at n_tokens 1
 * (decode GEMV: also reports weight bandwidth) and 512 (prefill), and the
 * 1024 x 151936 output matrix at n_tokens 1 (out of cache), on a pool
 * of N threads (argv[1], default 2), and prints the best of several runs in
 * GFLOP/s (2 * n_in * n_out * n_tokens per call). Usage:
 *   bench_matmul [threads] [isa: scalar|avx2|avx512]
 *
 * bench_matmul --batch [threads] [isa]: small batches out of cache, what a
 * speculative verification step pays: 1024 x 3072 matrices, enough of them
 * to hold 4x the last-level cache, one pass over all at n_tokens 1..9; prints
 * ms per pass, the weight bandwidth and the cost relative to n_tokens 1
 * (wall time, best of 9, and CPU time, which a busy machine disturbs less).
 * BENCH_TYPE=q8_0 limits it to one type; BENCH_HOT=1 uses one matrix that
 * stays in cache (the kernels' compute cost alone). In the main table too,
 * BENCH_TYPE picks one type, and BENCH_SHAPES="2048x8192,8192x2048"
 * (n_in x n_out) and BENCH_TOKENS="128,512" replace the shapes and batch
 * sizes (e.g. the llama-3.2-1b matrices). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/threadpool.h"
#include "tensor/matmul.h"
#include "tensor/quant.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* CPU time of the process: on a shared machine it does not count the time
 * other processes hold the cores (with one thread, the kernel's own cost). */
static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t bench_rng = 88172645463325252ull;
static float bench_uniform(void) {
    bench_rng ^= bench_rng << 13;
    bench_rng ^= bench_rng >> 7;
    bench_rng ^= bench_rng << 17;
    return (float)((bench_rng >> 40) / (double)(1 << 24)) * 2.0f - 1.0f;
}

static void bench_one(ember_pool *pool, ember_dtype type, int64_t n_in, int64_t n_out, int64_t nt) {
    size_t rb = dtype_row_bytes(type, n_in);
    uint8_t *wd = malloc(rb * n_out);
    float *row = malloc(n_in * sizeof(float));
    for (int64_t o = 0; o < n_out; o++) {
        for (int64_t i = 0; i < n_in; i++) row[i] = bench_uniform() * 0.05f;
        quant_quantize_row(type, row, wd + o * rb, n_in);
    }
    float *x = malloc(nt * n_in * sizeof(float)), *y = malloc(nt * n_out * sizeof(float));
    for (int64_t i = 0; i < nt * n_in; i++) x[i] = bench_uniform();
    tensor_weight w = {.type = type, .n_in = n_in, .n_out = n_out, .row_bytes = rb, .data = wd};
    matmul_scratch *s = matmul_scratch_create();
    tensor_matmul(pool, s, &w, x, nt, y); /* warm-up */
    int reps = nt == 1 ? (n_out > 100000 ? 5 : 200) : 5;
    double best = 1e30;
    /* BENCH_CLOCK=cpu: process CPU time (with 1 thread, the kernel's cost whatever else runs) */
    double (*clock_fn)(void) = getenv("BENCH_CLOCK") && !strcmp(getenv("BENCH_CLOCK"), "cpu") ? cpu_s : now_s;
    for (int k = 0; k < 3; k++) {
        double t0 = clock_fn();
        for (int r = 0; r < reps; r++) tensor_matmul(pool, s, &w, x, nt, y);
        double dt = (clock_fn() - t0) / reps;
        if (dt < best) best = dt;
    }
    double gflops = 2.0 * n_in * n_out * nt / best * 1e-9;
    printf("%-5s %5lld x %-5lld n_tokens %4lld: %8.3f ms  %7.1f GFLOP/s", dtype_info_of(type)->name,
           (long long)n_in, (long long)n_out, (long long)nt, best * 1e3, gflops);
    if (nt == 1) printf("  %6.1f GB/s weights", rb * n_out / best * 1e-9);
    printf("\n");
    matmul_scratch_free(s);
    free(wd), free(row), free(x), free(y);
}

static void bench_batch(ember_pool *pool, ember_dtype type) {
    const int64_t n_in = 1024, n_out = 3072, max_tokens = 9;
    size_t rb = dtype_row_bytes(type, n_in), bytes = rb * n_out;
    int count = getenv("BENCH_HOT") ? 1 : (int)((128u << 20) / bytes) + 1;
    uint8_t *wd = malloc(bytes * count);
    float *row = malloc(n_in * sizeof(float));
    for (int64_t o = 0; o < n_out * count; o++) {
        for (int64_t i = 0; i < n_in; i++) row[i] = bench_uniform() * 0.05f;
        quant_quantize_row(type, row, wd + o * rb, n_in);
    }
    float *x = malloc(max_tokens * n_in * sizeof(float)), *y = malloc(max_tokens * n_out * sizeof(float));
    for (int64_t i = 0; i < max_tokens * n_in; i++) x[i] = bench_uniform();
    matmul_scratch *s = matmul_scratch_create();
    double base = 0, cbase = 0, ratio[10], cratio[10];
    for (int64_t nt = 1; nt <= max_tokens; nt++) {
        double best = 1e30, cbest = 1e30;
        for (int rep = 0; rep < 9; rep++) {
            double t0 = now_s(), c0 = cpu_s();
            for (int m = 0; m < count; m++) {
                tensor_weight w = {.type = type, .n_in = n_in, .n_out = n_out, .row_bytes = rb, .data = wd + bytes * m};
                tensor_matmul(pool, s, &w, x, nt, y);
            }
            double dt = now_s() - t0, dc = cpu_s() - c0;
            if (dt < best) best = dt;
            if (dc < cbest) cbest = dc;
        }
        if (nt == 1) base = best, cbase = cbest;
        ratio[nt] = best / base;
        cratio[nt] = cbest / cbase;
    }
    printf("%-5s %3d x (1024 x 3072) %4.0f MB  n=1: %6.2f ms %5.1f GB/s (cpu %6.2f ms)\n      wall x n=1:",
           dtype_info_of(type)->name, count, (double)bytes * count / 1e6, base * 1e3, bytes * count / base * 1e-9,
           cbase * 1e3);
    for (int64_t nt = 2; nt <= max_tokens; nt++) printf(" %lld:%.2f", (long long)nt, ratio[nt]);
    printf("\n      cpu  x n=1:");
    for (int64_t nt = 2; nt <= max_tokens; nt++) printf(" %lld:%.2f", (long long)nt, cratio[nt]);
    printf("\n");
    fflush(stdout);
    matmul_scratch_free(s);
    free(wd), free(row), free(x), free(y);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--batch")) {
        int threads = argc > 2 ? atoi(argv[2]) : 2;
        quant_isa isa;
        if (argc > 3 && !(quant_isa_parse(argv[3], &isa) && quant_set_isa(isa)))
            fprintf(stderr, "ISA %s not available\n", argv[3]);
        printf("threads %d, isa %s\n", threads, quant_isa_name(quant_get_isa()));
        ember_pool *pool = ember_pool_create(threads);
        const ember_dtype types[] = {DT_Q8_0, DT_Q4_0, DT_Q4_K, DT_Q6_K, DT_F16, DT_BF16, DT_F32};
        const char *only = getenv("BENCH_TYPE"); /* e.g. q8_0: that type alone */
        for (size_t t = 0; t < sizeof types / sizeof types[0]; t++)
            if (only == NULL || strcmp(only, dtype_info_of(types[t])->name) == 0) bench_batch(pool, types[t]);
        ember_pool_free(pool);
        return 0;
    }
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    quant_isa isa;
    if (argc > 2 && !(quant_isa_parse(argv[2], &isa) && quant_set_isa(isa)))
        fprintf(stderr, "ISA %s not available\n", argv[2]);
    printf("threads %d, isa %s\n", threads, quant_isa_name(quant_get_isa()));
    ember_pool *pool = ember_pool_create(threads);
    const ember_dtype types[] = {DT_Q8_0, DT_Q4_K, DT_Q6_K, DT_F16, DT_BF16, DT_Q4_0, DT_IQ4_NL, DT_IQ4_XS};
    int64_t shapes[8][2] = {{1024, 3072}, {3072, 1024}}, tokens[8] = {1, 512};
    int n_shapes = 2, n_tokens = 2;
    /* BENCH_SHAPES="2048x8192,8192x2048" (n_in x n_out), BENCH_TOKENS="128,512": other sizes */
    const char *env = getenv("BENCH_SHAPES");
    if (env) {
        n_shapes = 0;
        for (const char *p = env; *p && n_shapes < 8; p = strchr(p, ',') ? strchr(p, ',') + 1 : "") {
            long long a = 0, b = 0;
            if (sscanf(p, "%lldx%lld", &a, &b) == 2) shapes[n_shapes][0] = a, shapes[n_shapes++][1] = b;
        }
    }
    if ((env = getenv("BENCH_TOKENS")) != NULL) {
        n_tokens = 0;
        for (const char *p = env; *p && n_tokens < 8; p = strchr(p, ',') ? strchr(p, ',') + 1 : "")
            if (atoll(p) > 0) tokens[n_tokens++] = atoll(p);
    }
    const char *only = getenv("BENCH_TYPE"); /* e.g. bf16: that type alone */
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++)
        if (only == NULL || strcmp(only, dtype_info_of(types[t])->name) == 0)
            for (int s = 0; s < n_shapes; s++)
                for (int k = 0; k < n_tokens; k++) bench_one(pool, types[t], shapes[s][0], shapes[s][1], tokens[k]);
    /* The tied output matrix: a GEMV that does not fit in any cache. */
    if (only == NULL)
        for (size_t t = 0; t < 2; t++) bench_one(pool, types[t], 1024, 151936, 1);
    ember_pool_free(pool);
    return 0;
}
