/* attention_avx512_common.h - the pieces the AVX-512 attention kernels
 * share (internal to src/tensor; included only by files built with the
 * AVX-512 flags): decoding f16 / q8_0 / q12h rows into f32 (exact, the
 * values of kv_row_decode), exp() by a degree-6 polynomial, and the
 * softmax of one query's scores turned into its weights p_j = e_j / sum
 * (attention_avx512.c; attention_avx512bf16.c shares the decoders and
 * exp_ps and runs its softmax online, block by block). */
#ifndef EMBER_TENSOR_ATTENTION_AVX512_COMMON_H
#define EMBER_TENSOR_ATTENTION_AVX512_COMMON_H

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "tensor/attention_impl.h"
#include "tensor/quant.h"

/* The 12-bit integers of q12h values [in, in + n) of one block in lanes
 * [0, n), for n <= 16 values inside one half of the block (in + n <= 16,
 * or in >= 16): 16 hi + lo, lo from the low nibbles of bytes [in, in + n)
 * of the block's lo for the first half, the high nibbles of bytes
 * [in - 16, ...) for the second. Lanes from n on are not zero: callers
 * mask. */
static inline __m512i q12h_ints16(const uint8_t *blk, int in, __mmask16 m) {
    __m512i hi = _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, blk + 2 + in)), 4);
    __m512i lo;
    if (in < 16)
        lo = _mm512_and_si512(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, blk + 34 + in)), _mm512_set1_epi32(15));
    else
        lo = _mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, blk + 34 + in - 16)), 4);
    return _mm512_add_epi32(hi, lo);
}

/* Values [offset, offset + n) of an encoded row into dst. */
static inline void decode_avx512(kv_row_type type, const uint8_t *row, int offset, int n, float *dst) {
    if (type == KV_ROW_F16) {
        int i = 0;
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * (size_t)(offset + i)))));
        if (i < n) {
            __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
            __m256i h = _mm256_maskz_loadu_epi16(m, row + 2 * (size_t)(offset + i));
            _mm512_mask_storeu_ps(dst + i, m, _mm512_cvtph_ps(h));
        }
        return;
    }
    if (type == KV_ROW_Q8_0 && offset % KV_ROW_Q8_0_BLOCK == 0 && n % KV_ROW_Q8_0_BLOCK == 0) {
        const uint8_t *b = row + (size_t)(offset / KV_ROW_Q8_0_BLOCK) * sizeof(block_q8_0);
        for (int i = 0; i < n; i += KV_ROW_Q8_0_BLOCK, b += sizeof(block_q8_0)) {
            uint16_t h;
            memcpy(&h, b, 2);
            __m512 d = _mm512_set1_ps(quant_f16_to_f32(h));
            __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2))));
            __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18))));
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(d, lo));
            _mm512_storeu_ps(dst + i + 16, _mm512_mul_ps(d, hi));
        }
        return;
    }
    if (type == KV_ROW_Q12H && offset % KV_ROW_Q12H_BLOCK == 0 && n % KV_ROW_Q12H_BLOCK == 0) {
        const uint8_t *b = row + (size_t)(offset / KV_ROW_Q12H_BLOCK) * sizeof(kv_block_q12h);
        for (int i = 0; i < n; i += KV_ROW_Q12H_BLOCK, b += sizeof(kv_block_q12h)) {
            uint16_t h;
            memcpy(&h, b, 2);
            __m512 d = _mm512_set1_ps(quant_f16_to_f32(h));
            /* q12h_ints16 for both halves, the low nibbles' bytes widened once */
            __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 34)));
            __m512i q0 = _mm512_add_epi32(
                _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2))), 4),
                _mm512_and_si512(lo, _mm512_set1_epi32(15)));
            __m512i q1 = _mm512_add_epi32(
                _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18))), 4),
                _mm512_srli_epi32(lo, 4));
            _mm512_storeu_ps(dst + i, _mm512_mul_ps(d, _mm512_cvtepi32_ps(q0)));
            _mm512_storeu_ps(dst + i + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(q1)));
        }
        return;
    }
    kv_row_decode(type, row, offset, n, dst);
}

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

/* Scores s[0, n) into softmax weights in place, in f32. */
static inline void softmax_scale(float *s, int64_t n) {
    /* The max in 16 lanes: the same value as the scalar scan (NaN scores are
     * skipped alike: vmaxps returns the running max when s[j] is NaN; only
     * the sign of a zero max can differ, and s - (+0) and s - (-0) have the
     * same exp). */
    __m512 m16 = _mm512_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) m16 = _mm512_max_ps(_mm512_loadu_ps(s + j), m16);
    if (j < n) m16 = _mm512_max_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), (__mmask16)((1u << (n - j)) - 1), s + j), m16);
    float max = _mm512_reduce_max_ps(m16);
    __m512 vmax = _mm512_set1_ps(max), vsum = _mm512_setzero_ps();
    j = 0;
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

#endif
