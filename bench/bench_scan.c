/* bench_scan.c - the per-token scan steps of tensor/scan.h, per ISA, against
 * the plain loops the mixers ran before they were vectorized.
 *
 * Usage: bench_scan [--tokens 500] [--reps 30]
 *
 * Shapes: Mamba2 heads of P=64 channels with N=128 (mamba2-370m .. 2.7b) and
 * N=32 (`ember mkmodel --preset small`); gated-delta heads of 128 x 128
 * (qwen35 / qwen3next) and 32 x 32 (small). Each figure is ns per head per
 * token, best of --reps runs over --tokens tokens (on a shared machine
 * the best of many short runs is the figure least disturbed by others). "before" is the former scalar
 * loop (separate multiply and add, one running sum), kept here only as the
 * baseline. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/clock.h"
#include "tensor/quant.h"
#include "tensor/scan.h"

static void ssd_before(float *s, int P, int N, const float *x, const float *B, const float *C, float dt, float dA,
                       float D, float *y) {
    for (int p = 0; p < P; p++) {
        float x_dt = x[p] * dt, sum = 0.0f;
        float *sp = s + (size_t)p * N;
        for (int n = 0; n < N; n++) {
            float st = sp[n] * dA + B[n] * x_dt;
            sum += st * C[n];
            sp[n] = st;
        }
        y[p] = sum + x[p] * D;
    }
}

static void delta_before(float *S, int d_v, int d_k, const float *q, const float *k, const float *v, float beta,
                         float decay, float *y) {
    for (int j = 0; j < d_v; j++) {
        float *row = S + (size_t)j * d_k;
        float sk = 0.0f;
        for (int i = 0; i < d_k; i++) {
            row[i] *= decay;
            sk += row[i] * k[i];
        }
        float du = beta * (v[j] - sk), o = 0.0f;
        for (int i = 0; i < d_k; i++) {
            row[i] += k[i] * du;
            o += row[i] * q[i];
        }
        y[j] = o;
    }
}

static float *random_vec(size_t n, float scale) {
    float *v = malloc(n * sizeof(float));
    unsigned s = 12345;
    for (size_t i = 0; i < n; i++) {
        s = s * 1103515245u + 12345u;
        v[i] = ((float)((s >> 8) & 0xffff) / 65536.0f * 2.0f - 1.0f) * scale;
    }
    return v;
}

static int g_reps = 30;

static double time_ssd(scan_ssd_fn fn, int P, int N, int tokens) {
    float *s = random_vec((size_t)P * N, 0.1f), *x = random_vec((size_t)P, 1), *B = random_vec((size_t)N, 1);
    float *C = random_vec((size_t)N, 1), *y = malloc((size_t)P * sizeof(float));
    double best = 1e30;
    for (int rep = 0; rep < g_reps; rep++) {
        double t0 = ember_now();
        for (int t = 0; t < tokens; t++) fn(s, P, N, x, B, C, 0.1f, 0.95f, 0.5f, y);
        double dt = (ember_now() - t0) / tokens * 1e9;
        if (dt < best) best = dt;
    }
    free(s), free(x), free(B), free(C), free(y);
    return best;
}

static double time_delta(scan_delta_fn fn, int dv, int dk, int tokens) {
    float *S = random_vec((size_t)dv * dk, 0.1f), *q = random_vec((size_t)dk, 0.1f), *k = random_vec((size_t)dk, 0.1f);
    float *v = random_vec((size_t)dv, 1), *y = malloc((size_t)dv * sizeof(float));
    double best = 1e30;
    for (int rep = 0; rep < g_reps; rep++) {
        double t0 = ember_now();
        for (int t = 0; t < tokens; t++) fn(S, dv, dk, q, k, v, 0.5f, 0.97f, y);
        double dt = (ember_now() - t0) / tokens * 1e9;
        if (dt < best) best = dt;
    }
    free(S), free(q), free(k), free(v), free(y);
    return best;
}

int main(int argc, char **argv) {
    int tokens = 500;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--tokens") == 0) tokens = atoi(argv[i + 1]);
        if (strcmp(argv[i], "--reps") == 0) g_reps = atoi(argv[i + 1]);
    }
    if (tokens < 1) tokens = 1;
    if (g_reps < 1) g_reps = 1;
    int best = (int)quant_best_isa();
    printf("ns per head per token (best of %d x %d tokens)\n", g_reps, tokens);
    printf("%-22s %10s", "step", "before");
    for (int isa = 0; isa <= best; isa++) printf(" %12s", quant_isa_name((quant_isa)isa));
    printf(" %10s\n", "speedup");
    const int ssd_shapes[][2] = {{64, 128}, {64, 32}};
    for (int i = 0; i < 2; i++) {
        int P = ssd_shapes[i][0], N = ssd_shapes[i][1];
        char name[48];
        snprintf(name, sizeof name, "mamba2 P=%d N=%d", P, N);
        double before = time_ssd(ssd_before, P, N, tokens), last = 0;
        printf("%-22s %10.0f", name, before);
        for (int isa = 0; isa <= best; isa++) printf(" %12.0f", last = time_ssd(scan_ssd_kernel(isa), P, N, tokens));
        printf(" %9.1fx\n", before / last);
    }
    const int delta_shapes[][2] = {{128, 128}, {32, 32}};
    for (int i = 0; i < 2; i++) {
        int dv = delta_shapes[i][0], dk = delta_shapes[i][1];
        char name[48];
        snprintf(name, sizeof name, "delta d_v=%d d_k=%d", dv, dk);
        double before = time_delta(delta_before, dv, dk, tokens), last = 0;
        printf("%-22s %10.0f", name, before);
        for (int isa = 0; isa <= best; isa++) printf(" %12.0f", last = time_delta(scan_delta_kernel(isa), dv, dk, tokens));
        printf(" %9.1fx\n", before / last);
    }
    return 0;
}
