/* test_scan.c - the scan steps of tensor/scan.h: every ISA this CPU has
 * gives the scalar reference's bits (state and output) over many tokens, for
 * state sizes with and without a tail past a multiple of 16 and head sizes
 * with and without a remainder of the 4-row blocks; and the step is the
 * recurrence it claims (checked against a double-precision evaluation). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/quant.h"
#include "tensor/scan.h"
#include "test_util.h"

static uint64_t ts_rng = 0x9e3779b97f4a7c15ull;
static float ts_uniform(void) {
    ts_rng ^= ts_rng << 13;
    ts_rng ^= ts_rng >> 7;
    ts_rng ^= ts_rng << 17;
    return (float)((ts_rng >> 40) / (double)(1 << 24)) * 2.0f - 1.0f;
}

static void fill(float *v, int n, float scale) {
    for (int i = 0; i < n; i++) v[i] = ts_uniform() * scale;
}

enum { TOKENS = 20 };

static void check_ssd(int P, int N) {
    size_t ns = (size_t)P * N;
    float *ref = calloc(ns, sizeof(float)), *got = malloc(ns * sizeof(float));
    float *x = malloc((size_t)TOKENS * P * sizeof(float)), *B = malloc((size_t)TOKENS * N * sizeof(float));
    float *C = malloc((size_t)TOKENS * N * sizeof(float)), *yr = malloc((size_t)P * sizeof(float));
    float *yg = malloc((size_t)P * sizeof(float)), dt[TOKENS], dA[TOKENS];
    fill(x, TOKENS * P, 1.0f);
    fill(B, TOKENS * N, 1.0f);
    fill(C, TOKENS * N, 1.0f);
    for (int t = 0; t < TOKENS; t++) {
        dt[t] = 0.05f + 0.5f * fabsf(ts_uniform());
        dA[t] = expf(-dt[t] * 2.0f);
    }
    for (int isa = QUANT_ISA_AVX2; isa <= (int)quant_best_isa(); isa++) {
        memset(ref, 0, ns * sizeof(float));
        memset(got, 0, ns * sizeof(float));
        for (int t = 0; t < TOKENS; t++) {
            const float *xt = x + (size_t)t * P, *Bt = B + (size_t)t * N, *Ct = C + (size_t)t * N;
            scan_ssd_kernel(QUANT_ISA_SCALAR)(ref, P, N, xt, Bt, Ct, dt[t], dA[t], 0.7f, yr);
            scan_ssd_kernel(isa)(got, P, N, xt, Bt, Ct, dt[t], dA[t], 0.7f, yg);
            if (memcmp(yr, yg, (size_t)P * sizeof(float)) != 0 || memcmp(ref, got, ns * sizeof(float)) != 0)
                fail_msg("ssd P=%d N=%d %s: token %d differs from scalar", P, N, quant_isa_name((quant_isa)isa), t);
        }
    }
    /* The recurrence itself, one step from a known state, in double. */
    fill(ref, (int)ns, 1.0f);
    float *s0 = malloc(ns * sizeof(float));
    memcpy(s0, ref, ns * sizeof(float));
    scan_ssd_step(ref, P, N, x, B, C, dt[0], dA[0], 0.7f, yr);
    for (int p = 0; p < P; p++) {
        double sum = 0;
        for (int n = 0; n < N; n++) {
            double st = (double)s0[(size_t)p * N + n] * dA[0] + (double)B[n] * ((double)x[p] * dt[0]);
            assert_true(fabs(st - ref[(size_t)p * N + n]) <= 1e-5 * (1 + fabs(st)));
            sum += st * C[n];
        }
        double y = sum + (double)x[p] * 0.7;
        assert_true(fabs(y - yr[p]) <= 1e-4 * (1 + fabs(y)));
    }
    free(s0);
    free(ref), free(got), free(x), free(B), free(C), free(yr), free(yg);
}

static void check_delta(int d_v, int d_k) {
    size_t ns = (size_t)d_v * d_k;
    float *ref = calloc(ns, sizeof(float)), *got = malloc(ns * sizeof(float));
    float *q = malloc((size_t)TOKENS * d_k * sizeof(float)), *k = malloc((size_t)TOKENS * d_k * sizeof(float));
    float *v = malloc((size_t)TOKENS * d_v * sizeof(float)), *yr = malloc((size_t)d_v * sizeof(float));
    float *yg = malloc((size_t)d_v * sizeof(float)), beta[TOKENS], decay[TOKENS];
    fill(q, TOKENS * d_k, 0.2f);
    fill(k, TOKENS * d_k, 0.2f);
    fill(v, TOKENS * d_v, 1.0f);
    for (int t = 0; t < TOKENS; t++) {
        beta[t] = 0.5f + 0.5f * fabsf(ts_uniform());
        decay[t] = 0.8f + 0.2f * fabsf(ts_uniform());
    }
    for (int isa = QUANT_ISA_AVX2; isa <= (int)quant_best_isa(); isa++) {
        memset(ref, 0, ns * sizeof(float));
        memset(got, 0, ns * sizeof(float));
        for (int t = 0; t < TOKENS; t++) {
            const float *qt = q + (size_t)t * d_k, *kt = k + (size_t)t * d_k, *vt = v + (size_t)t * d_v;
            scan_delta_kernel(QUANT_ISA_SCALAR)(ref, d_v, d_k, qt, kt, vt, beta[t], decay[t], yr);
            scan_delta_kernel(isa)(got, d_v, d_k, qt, kt, vt, beta[t], decay[t], yg);
            if (memcmp(yr, yg, (size_t)d_v * sizeof(float)) != 0 || memcmp(ref, got, ns * sizeof(float)) != 0)
                fail_msg("delta d_v=%d d_k=%d %s: token %d differs from scalar", d_v, d_k,
                         quant_isa_name((quant_isa)isa), t);
        }
    }
    fill(ref, (int)ns, 0.5f);
    float *s0 = malloc(ns * sizeof(float));
    memcpy(s0, ref, ns * sizeof(float));
    scan_delta_step(ref, d_v, d_k, q, k, v, beta[0], decay[0], yr);
    for (int j = 0; j < d_v; j++) {
        double sk = 0, o = 0;
        for (int i = 0; i < d_k; i++) sk += (double)s0[(size_t)j * d_k + i] * decay[0] * k[i];
        double du = beta[0] * (v[j] - sk);
        for (int i = 0; i < d_k; i++) {
            double st = (double)s0[(size_t)j * d_k + i] * decay[0] + k[i] * du;
            assert_true(fabs(st - ref[(size_t)j * d_k + i]) <= 1e-5 * (1 + fabs(st)));
            o += st * q[i];
        }
        assert_true(fabs(o - yr[j]) <= 1e-4 * (1 + fabs(o)));
    }
    free(s0);
    free(ref), free(got), free(q), free(k), free(v), free(yr), free(yg);
}

static void test_ssd_isas_agree(void **state) {
    (void)state;
    const int shapes[][2] = {{16, 16}, {32, 32}, {7, 21}, {64, 128}, {5, 3}, {9, 48}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) check_ssd(shapes[i][0], shapes[i][1]);
}

static void test_delta_isas_agree(void **state) {
    (void)state;
    const int shapes[][2] = {{16, 16}, {32, 32}, {7, 21}, {128, 128}, {5, 3}, {9, 48}};
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) check_delta(shapes[i][0], shapes[i][1]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ssd_isas_agree),
        cmocka_unit_test(test_delta_isas_agree),
    };
    return test_run_group(tests, NULL, NULL);
}
