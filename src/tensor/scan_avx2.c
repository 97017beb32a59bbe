/* scan_avx2.c - the scan steps of scan.h with two 8-lane registers per sum.
 *
 * Lanes 0-7 of the scalar reference (scan.c) live in the first register and
 * 8-15 in the second, so the fold (lane i + 8 first) starts by adding the two
 * registers and the results agree bit for bit; a tail shorter than 16
 * continues in scalar lanes with fmaf (a vfmadd here). */
#include <immintrin.h>
#include <math.h>

#include "tensor/scan.h"

/* Lane sums lo (0-7) and hi (8-15), then the scalar tail [n0, N) of a . b. */
static inline float fold_tail(__m256 lo, __m256 hi, const float *a, const float *b, int n0, int N) {
    float lanes[16];
    _mm256_storeu_ps(lanes, lo);
    _mm256_storeu_ps(lanes + 8, hi);
    for (int i = n0; i < N; i++) lanes[i & 15] = fmaf(a[i], b[i], lanes[i & 15]);
    return scan_fold16(lanes);
}

void scan_ssd_avx2(float *s, int P, int N, const float *x, const float *B, const float *C, float dt, float dA,
                   float D, float *y) {
    int nv = N / 16 * 16;
    __m256 vdA = _mm256_set1_ps(dA);
    for (int p = 0; p < P; p++) {
        float *sp = s + (size_t)p * N;
        float x_dt = x[p] * dt;
        __m256 xv = _mm256_set1_ps(x_dt), lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        for (int n = 0; n < nv; n += 16) {
            __m256 s0 = _mm256_fmadd_ps(_mm256_loadu_ps(sp + n), vdA, _mm256_mul_ps(_mm256_loadu_ps(B + n), xv));
            __m256 s1 = _mm256_fmadd_ps(_mm256_loadu_ps(sp + n + 8), vdA, _mm256_mul_ps(_mm256_loadu_ps(B + n + 8), xv));
            _mm256_storeu_ps(sp + n, s0);
            _mm256_storeu_ps(sp + n + 8, s1);
            lo = _mm256_fmadd_ps(s0, _mm256_loadu_ps(C + n), lo);
            hi = _mm256_fmadd_ps(s1, _mm256_loadu_ps(C + n + 8), hi);
        }
        for (int n = nv; n < N; n++) sp[n] = fmaf(sp[n], dA, B[n] * x_dt);
        y[p] = fmaf(x[p], D, fold_tail(lo, hi, sp, C, nv, N));
    }
}

void scan_delta_avx2(float *S, int d_v, int d_k, const float *q, const float *k, const float *v, float beta,
                     float decay, float *y) {
    int nv = d_k / 16 * 16;
    __m256 vdecay = _mm256_set1_ps(decay);
    for (int j = 0; j < d_v; j++) {
        float *row = S + (size_t)j * d_k;
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        for (int i = 0; i < nv; i += 16) {
            __m256 r0 = _mm256_mul_ps(_mm256_loadu_ps(row + i), vdecay);
            __m256 r1 = _mm256_mul_ps(_mm256_loadu_ps(row + i + 8), vdecay);
            _mm256_storeu_ps(row + i, r0);
            _mm256_storeu_ps(row + i + 8, r1);
            lo = _mm256_fmadd_ps(r0, _mm256_loadu_ps(k + i), lo);
            hi = _mm256_fmadd_ps(r1, _mm256_loadu_ps(k + i + 8), hi);
        }
        for (int i = nv; i < d_k; i++) row[i] *= decay;
        float du = beta * (v[j] - fold_tail(lo, hi, row, k, nv, d_k));
        __m256 vdu = _mm256_set1_ps(du);
        lo = _mm256_setzero_ps();
        hi = _mm256_setzero_ps();
        for (int i = 0; i < nv; i += 16) {
            __m256 r0 = _mm256_fmadd_ps(_mm256_loadu_ps(k + i), vdu, _mm256_loadu_ps(row + i));
            __m256 r1 = _mm256_fmadd_ps(_mm256_loadu_ps(k + i + 8), vdu, _mm256_loadu_ps(row + i + 8));
            _mm256_storeu_ps(row + i, r0);
            _mm256_storeu_ps(row + i + 8, r1);
            lo = _mm256_fmadd_ps(r0, _mm256_loadu_ps(q + i), lo);
            hi = _mm256_fmadd_ps(r1, _mm256_loadu_ps(q + i + 8), hi);
        }
        for (int i = nv; i < d_k; i++) row[i] = fmaf(k[i], du, row[i]);
        y[j] = fold_tail(lo, hi, row, q, nv, d_k);
    }
}
