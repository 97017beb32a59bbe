/* attention_avx512.c - one query head of causal attention, AVX-512.
 *
 * Same contract and operation order as the scalar head in ops.c, widened to
 * 16 lanes: scores by FMA dot products (masked loads for head sizes that are
 * not a multiple of 16), an exp() evaluated by a degree-6 polynomial with
 * 2^n applied by vscalefps, and the value sum accumulated key by key in
 * registers. Every step depends only on this query's row, so the result is
 * the same whatever batch the row is in; decode and prefill share it. */
#include <immintrin.h>
#include <math.h>

#include "tensor/attention_impl.h"

static inline __m512 exp_ps(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
    r = _mm512_fnmadd_ps(n, ln2_lo, r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 r2 = _mm512_mul_ps(r, r);
    p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

static inline float dot_avx512(const float *a, const float *b, int n) {
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

void attention_head_avx512(const attention_head_args *a) {
    int64_t n = a->n_keys - a->first;
    float *s = a->scores;
    for (int64_t j = a->first; j < a->n_keys; j++) {
        const float *k = a->k_blocks[j / 16] + (j % 16) * a->k_row + a->k_offset;
        s[j - a->first] = dot_avx512(a->q, k, a->d_k) * a->scale;
    }
    float max = -INFINITY;
    for (int64_t j = 0; j < n; j++) max = s[j] > max ? s[j] : max;
    __m512 vmax = _mm512_set1_ps(max), vsum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), vmax));
        _mm512_storeu_ps(s + j, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (j < n) {
        __mmask16 m = (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), vmax));
        _mm512_mask_storeu_ps(s + j, m, e);
        vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
    }
    float inv = 1.0f / _mm512_reduce_add_ps(vsum);

    /* out = sum_j p_j v_j, 8 registers (128 values) of the head at a time. */
    int d0 = 0;
    /* Full 128-wide slices: the same fma sequence with the accumulators
     * pinned in registers (a runtime register count keeps them in memory). */
    for (; d0 + 128 <= a->d_v; d0 += 128) {
        __m512 acc[8];
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t jj = a->first; jj < a->n_keys; jj++) {
            const float *v = a->v_blocks[jj / 16] + (jj % 16) * a->v_row + a->v_offset + d0;
            __m512 p = _mm512_set1_ps(s[jj - a->first] * inv);
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++) acc[r] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * r), acc[r]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) _mm512_storeu_ps(a->out + d0 + 16 * r, acc[r]);
    }
    for (; d0 < a->d_v; d0 += 128) {
        int width = a->d_v - d0 < 128 ? a->d_v - d0 : 128;
        int nreg = (width + 15) / 16;
        __mmask16 tail = (__mmask16)(width % 16 ? (1u << (width % 16)) - 1 : 0xFFFF);
        __m512 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t jj = a->first; jj < a->n_keys; jj++) {
            const float *v = a->v_blocks[jj / 16] + (jj % 16) * a->v_row + a->v_offset + d0;
            __m512 p = _mm512_set1_ps(s[jj - a->first] * inv);
            for (int r = 0; r < nreg; r++) {
                __mmask16 m = r == nreg - 1 ? tail : 0xFFFF;
                acc[r] = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(m, v + 16 * r), acc[r]);
            }
        }
        for (int r = 0; r < nreg; r++) {
            __mmask16 m = r == nreg - 1 ? tail : 0xFFFF;
            _mm512_mask_storeu_ps(a->out + d0 + 16 * r, m, acc[r]);
        }
    }
}

/* ---------------------------------------------------------------------------
 * Several queries over the same kv head (the heads of a GQA group, several
 * rows of a prefill batch). Each query goes through exactly the operations of
 * attention_head_avx512 - per key the same fma chain over d_k then
 * _mm512_reduce_add_ps and * scale; the same max / exp / sum; per output lane
 * fma(p_j, v_j, acc) over keys in order with p_j = e_j * inv - so the bits
 * are those of one head at a time; only the loop nest differs: each key and
 * value row is loaded once for all queries. Fast path for d_k = d_v = 128,
 * a shared first key, and up to 8 queries. */
enum { MQ = 8 };

static void softmax_scale(float *s, int64_t n) {
    float max = -INFINITY;
    for (int64_t j = 0; j < n; j++) max = s[j] > max ? s[j] : max;
    __m512 vmax = _mm512_set1_ps(max), vsum = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + j), vmax));
        _mm512_storeu_ps(s + j, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (j < n) {
        __mmask16 m = (__mmask16)((1u << (n - j)) - 1);
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), vmax));
        _mm512_mask_storeu_ps(s + j, m, e);
        vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
    }
    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
    for (j = 0; j + 16 <= n; j += 16) _mm512_storeu_ps(s + j, _mm512_mul_ps(_mm512_loadu_ps(s + j), inv));
    if (j < n) {
        __mmask16 m = (__mmask16)((1u << (n - j)) - 1);
        _mm512_mask_storeu_ps(s + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), inv));
    }
}

static inline __attribute__((always_inline)) void heads_multi(const int NQ, const attention_head_args *a) {
    const int64_t first = a[0].first;
    int64_t lo = a[0].n_keys, hi = a[0].n_keys;
    for (int i = 1; i < NQ; i++) {
        lo = a[i].n_keys < lo ? a[i].n_keys : lo;
        hi = a[i].n_keys > hi ? a[i].n_keys : hi;
    }
    /* Scores: one key row in registers against every query. */
    for (int64_t j = first; j < hi; j++) {
        const float *k = a[0].k_blocks[j / 16] + (j % 16) * a[0].k_row + a[0].k_offset;
        __m512 kv[8];
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) kv[c] = _mm512_loadu_ps(k + 16 * c);
#pragma GCC unroll 8
        for (int i = 0; i < NQ; i++) {
            if (j >= lo && j >= a[i].n_keys) continue;
            __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a[i].q + 16 * c), kv[c], acc);
            a[i].scores[j - first] = _mm512_reduce_add_ps(acc) * a[i].scale;
        }
    }
    for (int i = 0; i < NQ; i++) softmax_scale(a[i].scores, a[i].n_keys - first);
    /* Values: 32 output lanes of every query at a time, keys in order. */
    for (int d0 = 0; d0 < 128; d0 += 32) {
        __m512 acc[MQ][2];
#pragma GCC unroll 8
        for (int i = 0; i < NQ; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
        int64_t j = first;
        for (; j < lo; j++) {
            const float *v = a[0].v_blocks[j / 16] + (j % 16) * a[0].v_row + a[0].v_offset + d0;
            __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
#pragma GCC unroll 8
            for (int i = 0; i < NQ; i++) {
                __m512 p = _mm512_set1_ps(a[i].scores[j - first]);
                acc[i][0] = _mm512_fmadd_ps(p, v0, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(p, v1, acc[i][1]);
            }
        }
        for (; j < hi; j++) {
            const float *v = a[0].v_blocks[j / 16] + (j % 16) * a[0].v_row + a[0].v_offset + d0;
            __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
#pragma GCC unroll 8
            for (int i = 0; i < NQ; i++) {
                if (j >= a[i].n_keys) continue;
                __m512 p = _mm512_set1_ps(a[i].scores[j - first]);
                acc[i][0] = _mm512_fmadd_ps(p, v0, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(p, v1, acc[i][1]);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < NQ; i++) {
            _mm512_storeu_ps(a[i].out + d0, acc[i][0]);
            _mm512_storeu_ps(a[i].out + d0 + 16, acc[i][1]);
        }
    }
}

#define HEADS_MULTI(N) \
    static void heads_multi_##N(const attention_head_args *a) { heads_multi(N, a); }
HEADS_MULTI(1) HEADS_MULTI(2) HEADS_MULTI(3) HEADS_MULTI(4)
HEADS_MULTI(5) HEADS_MULTI(6) HEADS_MULTI(7) HEADS_MULTI(8)
static void (*const heads_multi_fns[MQ + 1])(const attention_head_args *) = {
    NULL, heads_multi_1, heads_multi_2, heads_multi_3, heads_multi_4,
    heads_multi_5, heads_multi_6, heads_multi_7, heads_multi_8};

void attention_heads_avx512(const attention_head_args *a, int n) {
    int i = 0;
    while (i < n) {
        int m = 1;
        if (a[i].d_k == 128 && a[i].d_v == 128)
            while (m < MQ && i + m < n && a[i + m].d_k == 128 && a[i + m].d_v == 128 &&
                   a[i + m].k_blocks == a[i].k_blocks && a[i + m].v_blocks == a[i].v_blocks &&
                   a[i + m].k_offset == a[i].k_offset && a[i + m].v_offset == a[i].v_offset &&
                   a[i + m].k_row == a[i].k_row && a[i + m].v_row == a[i].v_row && a[i + m].first == a[i].first)
                m++;
        if (a[i].d_k == 128 && a[i].d_v == 128)
            heads_multi_fns[m](a + i);
        else
            attention_head_avx512(a + i);
        i += m;
    }
}
