/* bench_float_panels.c - the F16 batch panels against this core's FMA peak.
 *
 * Prints first the core's f32 FMA peak: a loop of 24 independent 16-lane
 * FMAs (inline assembly, so no compiler choice moves it), in FMAs per ns and
 * GFLOP/s. Then times matmul_avx512_panels on F16 weights (the kernel
 * tensor_matmul runs for batches on AVX-512) for the Llama-3.2-1B matrices
 * at 512 tokens, one part at a time as the engine splits a matrix for two
 * threads (n_out / 16 rows), over enough matrices that the weights come
 * from memory as they do in a prefill, and reports per shape the best and
 * the median call in GFLOP/s and as a share of the peak. On a machine
 * shared with other jobs the best call is the figure to compare: the
 * median says how much the others took.
 *
 * Usage: bench_float_panels [--calls N] [--tokens T] [--misalign BYTES]
 * --misalign offsets the activations from a 64-byte boundary (calloc gives
 * 16): every 64-byte activation load then spans two cache lines. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tensor/quant.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* 14 accumulators (what the baseline target may clobber), each FMA
 * independent of the others, more than ports x latency: the loop runs at
 * the FMA ports' rate. */
static double fma_peak_per_ns(void) {
    const long iters = 20000000;
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        long n = iters;
        double t = now_s();
        __asm__ volatile("vxorps %%xmm0, %%xmm0, %%xmm0\n\t"
                         "vxorps %%xmm1, %%xmm1, %%xmm1\n\t"
                         "1:\n\t"
                         ".irp r,2,3,4,5,6,7,8,9,10,11,12,13,14,15\n\t"
                         "vfmadd231ps %%zmm0, %%zmm1, %%zmm\\r\n\t"
                         ".endr\n\t"
                         "dec %0\n\t"
                         "jnz 1b\n\t"
                         : "+r"(n)
                         :
                         : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
                           "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "memory", "cc");
        t = now_s() - t;
        double rate = (double)iters * 14 / t / 1e9;
        if (rate > best) best = rate;
    }
    return best;
}

static uint64_t rng = 88172645463325252ull;
static float uniform(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) / (double)(1 << 24)) * 2.0f - 1.0f;
}

static void bench_shape(int64_t n_in, int64_t n_out, int64_t tokens, int calls, size_t misalign, double peak) {
    const size_t rb = dtype_row_bytes(DT_F16, n_in), bytes = rb * (size_t)n_out;
    const int64_t part = n_out / 16 < 16 ? 16 : n_out / 16 / 16 * 16;
    int count = (int)((256u << 20) / bytes) + 1;
    uint8_t **w = malloc((size_t)count * sizeof *w);
    float *row = malloc((size_t)n_in * sizeof(float));
    for (int m = 0; m < count; m++) {
        w[m] = aligned_alloc(64, (bytes + 63) / 64 * 64);
        for (int64_t o = 0; o < n_out; o++) {
            for (int64_t i = 0; i < n_in; i++) row[i] = uniform() * 0.05f;
            quant_quantize_row(DT_F16, row, w[m] + (size_t)o * rb, n_in);
        }
    }
    uint8_t *xbuf = aligned_alloc(64, (size_t)tokens * n_in * sizeof(float) + 64);
    float *x = (float *)(xbuf + misalign);
    for (int64_t i = 0; i < tokens * n_in; i++) x[i] = uniform();
    float *y = malloc((size_t)tokens * n_out * sizeof(float));
    uint8_t *pk = aligned_alloc(64, (matmul_avx512_panel_bytes(DT_F16, n_in) + 63) / 64 * 64);
    double *t = malloc((size_t)calls * sizeof(double));
    for (int c = 0; c < calls; c++) {
        int64_t o0 = (int64_t)c * part % n_out;
        double t0 = now_s();
        matmul_avx512_panels(DT_F16, w[c % count], rb, n_in, o0, o0 + part, (const uint8_t *)x,
                             (size_t)n_in * sizeof(float), NULL, tokens, y, n_out, pk);
        t[c] = now_s() - t0;
    }
    qsort(t, (size_t)calls, sizeof(double), cmp_double);
    const double flop = 2.0 * (double)n_in * (double)part * (double)tokens;
    const double best = flop / t[0] / 1e9, median = flop / t[calls / 2] / 1e9;
    printf("f16 %5lld x %-5lld part %4lld rows, %lld tokens: best %6.1f GFLOP/s (%3.0f%% of peak), median %6.1f\n",
           (long long)n_in, (long long)n_out, (long long)part, (long long)tokens, best, 100 * best / peak, median);
    for (int m = 0; m < count; m++) free(w[m]);
    free(w), free(row), free(xbuf), free(y), free(pk), free(t);
}

int main(int argc, char **argv) {
    int calls = 40;
    int64_t tokens = 512;
    size_t misalign = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--calls") && i + 1 < argc) calls = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) tokens = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--misalign") && i + 1 < argc) misalign = (size_t)atoi(argv[++i]) % 64;
        else {
            fprintf(stderr, "usage: %s [--calls N] [--tokens T] [--misalign BYTES]\n", argv[0]);
            return 2;
        }
    }
    if (calls < 1 || tokens < 1) {
        fprintf(stderr, "bench_float_panels: --calls and --tokens must be positive\n");
        return 2;
    }
    if (quant_best_isa() < QUANT_ISA_AVX512) {
        printf("bench_float_panels: this CPU has no AVX-512; nothing to measure\n");
        return 0;
    }
    const double per_ns = fma_peak_per_ns(), peak = per_ns * 32;
    printf("FMA peak of one core: %.2f 16-lane FMAs per ns = %.1f GFLOP/s (%.2f GHz at 2 FMAs per cycle)\n", per_ns,
           peak, per_ns / 2);
    const int64_t shapes[][2] = {{2048, 2048}, {2048, 512}, {2048, 8192}, {8192, 2048}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        bench_shape(shapes[s][0], shapes[s][1], tokens, calls, misalign, peak);
    return 0;
}
