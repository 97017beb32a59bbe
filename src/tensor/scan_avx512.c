/* scan_avx512.c - the scan steps of scan.h with one 16-lane register per sum.
 *
 * A register lane is exactly a lane of the scalar reference (scan.c), so the
 * results agree bit for bit; a tail shorter than 16 continues in scalar lanes
 * with fmaf (a vfmadd here). Four state rows go together: they share the
 * loads of B/C (Mamba2) or k/q (delta rule) and their four independent
 * accumulators hide the FMA latency that one sum chain would expose. */
#include <immintrin.h>
#include <math.h>

#include "tensor/scan.h"

enum { ROWS = 4 };

static inline float fold512(__m512 v) {
    __m256 lo = _mm512_castps512_ps256(v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 a8 = _mm256_add_ps(lo, hi);
    __m128 a4 = _mm_add_ps(_mm256_castps256_ps128(a8), _mm256_extractf128_ps(a8, 1));
    __m128 a2 = _mm_add_ps(a4, _mm_movehl_ps(a4, a4));
    return _mm_cvtss_f32(_mm_add_ss(a2, _mm_shuffle_ps(a2, a2, 1)));
}

/* Folds acc after the scalar tail [n0, N) of one row's sum of a[i] * b[i]. */
static inline float fold_tail(__m512 acc, const float *a, const float *b, int n0, int N) {
    if (n0 == N) return fold512(acc);
    float lanes[16];
    _mm512_storeu_ps(lanes, acc);
    for (int i = n0; i < N; i++) lanes[i & 15] = fmaf(a[i], b[i], lanes[i & 15]);
    return scan_fold16(lanes);
}

void scan_ssd_avx512(float *s, int P, int N, const float *x, const float *B, const float *C, float dt, float dA,
                     float D, float *y) {
    int nv = N / 16 * 16, p = 0;
    __m512 vdA = _mm512_set1_ps(dA);
    for (; p + ROWS <= P; p += ROWS) {
        __m512 acc[ROWS], xdt[ROWS];
        for (int r = 0; r < ROWS; r++) {
            acc[r] = _mm512_setzero_ps();
            xdt[r] = _mm512_set1_ps(x[p + r] * dt);
        }
        for (int n = 0; n < nv; n += 16) {
            __m512 b = _mm512_loadu_ps(B + n), c = _mm512_loadu_ps(C + n);
            for (int r = 0; r < ROWS; r++) {
                float *sp = s + (size_t)(p + r) * N + n;
                __m512 st = _mm512_fmadd_ps(_mm512_loadu_ps(sp), vdA, _mm512_mul_ps(b, xdt[r]));
                _mm512_storeu_ps(sp, st);
                acc[r] = _mm512_fmadd_ps(st, c, acc[r]);
            }
        }
        for (int r = 0; r < ROWS; r++) {
            float *sp = s + (size_t)(p + r) * N;
            float x_dt = x[p + r] * dt;
            for (int n = nv; n < N; n++) sp[n] = fmaf(sp[n], dA, B[n] * x_dt);
            y[p + r] = fmaf(x[p + r], D, fold_tail(acc[r], sp, C, nv, N));
        }
    }
    for (; p < P; p++) {
        float *sp = s + (size_t)p * N;
        float x_dt = x[p] * dt;
        __m512 acc = _mm512_setzero_ps(), xv = _mm512_set1_ps(x_dt);
        for (int n = 0; n < nv; n += 16) {
            __m512 st = _mm512_fmadd_ps(_mm512_loadu_ps(sp + n), vdA, _mm512_mul_ps(_mm512_loadu_ps(B + n), xv));
            _mm512_storeu_ps(sp + n, st);
            acc = _mm512_fmadd_ps(st, _mm512_loadu_ps(C + n), acc);
        }
        for (int n = nv; n < N; n++) sp[n] = fmaf(sp[n], dA, B[n] * x_dt);
        y[p] = fmaf(x[p], D, fold_tail(acc, sp, C, nv, N));
    }
}

/* Rows [j, j + nr) of the delta rule, nr <= ROWS. */
static inline void delta_rows(float *S, int j, int nr, int d_k, const float *q, const float *k, const float *v,
                              float beta, float decay, float *y) {
    int nv = d_k / 16 * 16;
    __m512 vdecay = _mm512_set1_ps(decay), acc[ROWS], du[ROWS];
    float dus[ROWS];
    for (int r = 0; r < nr; r++) acc[r] = _mm512_setzero_ps();
    for (int i = 0; i < nv; i += 16) {
        __m512 kv = _mm512_loadu_ps(k + i);
        for (int r = 0; r < nr; r++) {
            float *row = S + (size_t)(j + r) * d_k + i;
            __m512 st = _mm512_mul_ps(_mm512_loadu_ps(row), vdecay);
            _mm512_storeu_ps(row, st);
            acc[r] = _mm512_fmadd_ps(st, kv, acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) {
        float *row = S + (size_t)(j + r) * d_k;
        for (int i = nv; i < d_k; i++) row[i] *= decay;
        dus[r] = beta * (v[j + r] - fold_tail(acc[r], row, k, nv, d_k));
        du[r] = _mm512_set1_ps(dus[r]);
        acc[r] = _mm512_setzero_ps();
    }
    for (int i = 0; i < nv; i += 16) {
        __m512 kv = _mm512_loadu_ps(k + i), qv = _mm512_loadu_ps(q + i);
        for (int r = 0; r < nr; r++) {
            float *row = S + (size_t)(j + r) * d_k + i;
            __m512 st = _mm512_fmadd_ps(kv, du[r], _mm512_loadu_ps(row));
            _mm512_storeu_ps(row, st);
            acc[r] = _mm512_fmadd_ps(st, qv, acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) {
        float *row = S + (size_t)(j + r) * d_k;
        for (int i = nv; i < d_k; i++) row[i] = fmaf(k[i], dus[r], row[i]);
        y[j + r] = fold_tail(acc[r], row, q, nv, d_k);
    }
}

void scan_delta_avx512(float *S, int d_v, int d_k, const float *q, const float *k, const float *v, float beta,
                       float decay, float *y) {
    int j = 0;
    for (; j + ROWS <= d_v; j += ROWS) delta_rows(S, j, ROWS, d_k, q, k, v, beta, decay, y);
    if (j < d_v) delta_rows(S, j, d_v - j, d_k, q, k, v, beta, decay, y);
}
