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
 * kernel: bit-identical results.
 *
 * Strips (quant_avx2_strip.h): R rows x C tokens per call, for decode and
 * for AVX2's batches (matmul.c). Each weight run is looked up once for the
 * C tokens and each token's |a| taken once for the R rows; the pairs'
 * integers are the dots' own, reduced by one tree per block (IQ4_NL) or
 * super-block (IQ4_XS) and folded with the same formula. */
#include <immintrin.h>
#include <string.h>

#include "tensor/quant_iq4.h"
#include "tensor/quant_avx2_strip.h"

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

/* meta (quant.h): per (token, block) {-128 * sum(qs), d as f32}: the
 * activation scales already converted. */
ALWAYS_INLINE void strip_iq4_nl(const int R, const int C, int64_t n, const void *w, size_t ws, int rows,
                                const void *a, size_t as, const int32_t *meta, float *yout, size_t ys) {
    const uint8_t *wr[8], *act = a;
    rows_of(R, w, ws, rows, wr);
    const __m256i table = table_256(), ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 32; i++) {
        __m256i t[8], av[8], aabs[8];
        float dw[8], da[8];
        UNROLL
        for (int c = 0; c < C; c++) {
            const block_q8_0 *y = (const block_q8_0 *)(act + c * as) + i;
            da[c] = meta_d(meta_of(meta, n, c, i));
            av[c] = _mm256_loadu_si256((const __m256i *)y->qs);
            aabs[c] = _mm256_abs_epi8(av[c]);
        }
        UNROLL
        for (int r = 0; r < R; r++) {
            const block_iq4_nl *x = (const block_iq4_nl *)wr[r] + i;
            dw[r] = load_f16(&x->d);
            __m256i wv = iq4_weights(x->qs, table);
            UNROLL
            for (int c = 0; c < C; c++)
                t[r * C + c] = _mm256_madd_epi16(_mm256_maddubs_epi16(aabs[c], _mm256_sign_epi8(wv, av[c])), ones);
        }
        UNROLL
        for (int p = R * C; p < 8; p++) t[p] = _mm256_setzero_si256();
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(t)), _mm256_mul_ps(by_row(R, C, dw), by_tok(C, da)), acc);
    }
    store_pairs(R, C, rows, acc, yout, ys);
}

/* Q8_K activations carry their scale as f32 and have no meta. */
ALWAYS_INLINE void strip_iq4_xs(const int R, const int C, int64_t n, const void *w, size_t ws, int rows,
                                const void *a, size_t as, const int32_t *meta, float *yout, size_t ys) {
    (void)meta;
    const uint8_t *wr[8], *act = a;
    rows_of(R, w, ws, rows, wr);
    const __m256i table = table_256();
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        __m256i t[8];
        float dw[8], da[8];
        UNROLL
        for (int p = 0; p < 8; p++) t[p] = _mm256_setzero_si256();
        UNROLL
        for (int c = 0; c < C; c++) da[c] = ((const block_q8_K *)(act + c * as) + i)->d;
        UNROLL
        for (int r = 0; r < R; r++) dw[r] = load_f16(&((const block_iq4_xs *)wr[r] + i)->d);
        UNROLL
        for (int sb = 0; sb < 8; sb++) {
            __m256i av[8];
            UNROLL
            for (int c = 0; c < C; c++)
                av[c] = _mm256_loadu_si256((const __m256i *)(((const block_q8_K *)(act + c * as) + i)->qs + 32 * sb));
            UNROLL
            for (int r = 0; r < R; r++) {
                const block_iq4_xs *x = (const block_iq4_xs *)wr[r] + i;
                __m256i wv = iq4_weights(x->qs + 16 * sb, table);
                __m256i scale = _mm256_set1_epi16((short)quant_iq4_xs_scale(x, sb));
                UNROLL
                for (int c = 0; c < C; c++)
                    t[r * C + c] = _mm256_add_epi32(t[r * C + c], _mm256_madd_epi16(pair_sums(wv, av[c]), scale));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(t)), _mm256_mul_ps(by_row(R, C, dw), by_tok(C, da)), acc);
    }
    store_pairs(R, C, rows, acc, yout, ys);
}

STRIPS(iq4_nl, INT_H)
STRIPS(iq4_xs, INT_H)

void quant_iq4_avx2_kernels(quant_dot_fn dots[DT_COUNT], quant_strip_fn strips[DT_COUNT][QUANT_STRIP_TOKENS + 1],
                            int heights[DT_COUNT][QUANT_STRIP_TOKENS + 1]) {
    dots[DT_IQ4_NL] = dot_iq4_nl;
    dots[DT_IQ4_XS] = dot_iq4_xs;
    set_strips_iq4_nl(strips[DT_IQ4_NL], heights[DT_IQ4_NL]);
    set_strips_iq4_xs(strips[DT_IQ4_XS], heights[DT_IQ4_XS]);
}
