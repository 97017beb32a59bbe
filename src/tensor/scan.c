/* scan.c - the portable scan steps and the run-time choice of ISA (scan.h).
 *
 * The scalar code is the reference the SIMD files must match bit for bit: it
 * spells out the 16-lane sums and the fixed fold that the vector registers
 * perform, and uses fmaf wherever they fuse. A vector path is exact only
 * because of that: lanes are independent sums, the fold order is one tree,
 * and fmaf is correctly rounded like the vector FMA. */
#include "tensor/scan.h"

#include <math.h>

#include "tensor/quant.h"

float scan_fold16(const float lanes[16]) {
    float a8[8], a4[4];
    for (int i = 0; i < 8; i++) a8[i] = lanes[i] + lanes[i + 8];
    for (int i = 0; i < 4; i++) a4[i] = a8[i] + a8[i + 4];
    float a0 = a4[0] + a4[2], a1 = a4[1] + a4[3];
    return a0 + a1;
}

static void ssd_scalar(float *s, int P, int N, const float *x, const float *B, const float *C, float dt, float dA,
                       float D, float *y) {
    for (int p = 0; p < P; p++) {
        float x_dt = x[p] * dt, lanes[16] = {0};
        float *sp = s + (size_t)p * N;
        for (int n = 0; n < N; n++) {
            float st = fmaf(sp[n], dA, B[n] * x_dt);
            sp[n] = st;
            lanes[n & 15] = fmaf(st, C[n], lanes[n & 15]);
        }
        y[p] = fmaf(x[p], D, scan_fold16(lanes));
    }
}

static void delta_scalar(float *S, int d_v, int d_k, const float *q, const float *k, const float *v, float beta,
                         float decay, float *y) {
    for (int j = 0; j < d_v; j++) {
        float *row = S + (size_t)j * d_k, lanes[16] = {0};
        for (int i = 0; i < d_k; i++) {
            row[i] *= decay;
            lanes[i & 15] = fmaf(row[i], k[i], lanes[i & 15]);
        }
        float du = beta * (v[j] - scan_fold16(lanes));
        for (int i = 0; i < 16; i++) lanes[i] = 0.0f;
        for (int i = 0; i < d_k; i++) {
            row[i] = fmaf(k[i], du, row[i]);
            lanes[i & 15] = fmaf(row[i], q[i], lanes[i & 15]);
        }
        y[j] = scan_fold16(lanes);
    }
}

scan_ssd_fn scan_ssd_kernel(int isa) {
    switch (isa) {
    case QUANT_ISA_SCALAR: return ssd_scalar;
    case QUANT_ISA_AVX2: return scan_ssd_avx2;
    case QUANT_ISA_AVX512: return scan_ssd_avx512;
    }
    return NULL;
}

scan_delta_fn scan_delta_kernel(int isa) {
    switch (isa) {
    case QUANT_ISA_SCALAR: return delta_scalar;
    case QUANT_ISA_AVX2: return scan_delta_avx2;
    case QUANT_ISA_AVX512: return scan_delta_avx512;
    }
    return NULL;
}

void scan_ssd_step(float *s, int P, int N, const float *x, const float *B, const float *C, float dt, float dA, float D,
                   float *y) {
    scan_ssd_kernel((int)quant_get_isa())(s, P, N, x, B, C, dt, dA, D, y);
}

void scan_delta_step(float *S, int d_v, int d_k, const float *q, const float *k, const float *v, float beta,
                     float decay, float *y) {
    scan_delta_kernel((int)quant_get_isa())(S, d_v, d_k, q, k, v, beta, decay, y);
}
