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
    for (int d0 = 0; d0 < a->d_v; d0 += 128) {
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
