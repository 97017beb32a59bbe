/* quant_iq4_avx2.c - AVX2 dots for IQ4_NL and IQ4_XS (see quant_iq4.h).
 *
 * Design: the nibbles index the 16-entry table with one pshufb (the table
 * sits in both 128-bit lanes), giving the signed weights w directly. Without
 * VNNI the byte products go through pmaddubsw, whose first operand is
 * unsigned: it takes |a| and the second operand takes w with a's sign. That
 * order is what keeps the products exact: |a| <= 128 is a valid unsigned
 * byte even for a = -128 (which Q8_K produces), w >= -127 can be negated,
 * and a pair sum stays within 2 * 128 * 127 < 2^15. pmaddwd then widens with
 * 1 (IQ4_NL) or with the sub-block scale ls - 32 (IQ4_XS), so each block's
 * integer dot is exact and folds with quant.h's formula like the scalar
 * kernel: bit-identical results. */
#include <immintrin.h>
#include <string.h>

#include "tensor/quant_iq4.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float load_f16(const void *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

ALWAYS_INLINE int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* 32 signed weights of one 32-element run, natural order. */
ALWAYS_INLINE __m256i iq4_weights(const uint8_t *qs, __m256i table) {
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    __m128i m = _mm_set1_epi8(15);
    __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
    return _mm256_shuffle_epi8(table, idx);
}

/* Exact w . a of 32 pairs as 16 int16 pair sums. */
ALWAYS_INLINE __m256i pair_sums(__m256i w, __m256i a) {
    return _mm256_maddubs_epi16(_mm256_abs_epi8(a), _mm256_sign_epi8(w, a));
}

ALWAYS_INLINE __m256i table_256(void) {
    __m128i t = _mm_loadu_si128((const __m128i *)quant_iq4_values);
    return _mm256_set_m128i(t, t);
}

static float dot_iq4_nl(int64_t n, const void *w, const void *a) {
    const block_iq4_nl *x = w;
    const block_q8_0 *y = a;
    const __m256i table = table_256(), ones = _mm256_set1_epi16(1);
    float acc = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        __m256i av = _mm256_loadu_si256((const __m256i *)y[i].qs);
        __m256i s = _mm256_madd_epi16(pair_sums(iq4_weights(x[i].qs, table), av), ones);
        acc = quant_fold(acc, hsum_epi32(s), load_f16(&x[i].d), load_f16(&y[i].d));
    }
    return acc;
}

static float dot_iq4_xs(int64_t n, const void *w, const void *a) {
    const block_iq4_xs *x = w;
    const block_q8_K *y = a;
    const __m256i table = table_256();
    float acc = 0;
    for (int64_t i = 0; i < n / 256; i++) {
        __m256i s = _mm256_setzero_si256();
        for (int sb = 0; sb < 8; sb++) {
            __m256i av = _mm256_loadu_si256((const __m256i *)(y[i].qs + 32 * sb));
            __m256i p = pair_sums(iq4_weights(x[i].qs + 16 * sb, table), av);
            __m256i scale = _mm256_set1_epi16((short)quant_iq4_xs_scale(&x[i], sb));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, scale));
        }
        acc = quant_fold(acc, hsum_epi32(s), load_f16(&x[i].d), y[i].d);
    }
    return acc;
}

void quant_iq4_avx2_kernels(quant_dot_fn dots[DT_COUNT]) {
    dots[DT_IQ4_NL] = dot_iq4_nl;
    dots[DT_IQ4_XS] = dot_iq4_xs;
}
