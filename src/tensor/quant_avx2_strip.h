/* quant_avx2_strip.h - the AVX2 small-batch strips' shared parts, internal
 * to src/tensor (quant_avx2.c, quant_iq4_avx2.c).
 *
 * Contract: a strip (quant.h: quant_strip_fn) computes R weight rows x C
 * tokens, pairs p = r * C + c in the 8 lanes of one vector, with the same
 * exact integer block dots and the same fold as the ISA's single-row dot,
 * so a strip's y equals the dot's bit for bit. What is here: the reduction
 * of 8 pair vectors, the per-pair scale vectors, the row pointers, the
 * store, and the macros that instantiate a strip for every token count
 * (heights INT_H / FLT_H) and fill quant.c's strip table. */
#ifndef EMBER_TENSOR_QUANT_AVX2_STRIP_H
#define EMBER_TENSOR_QUANT_AVX2_STRIP_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "tensor/quant.h"
#include "tensor/quant_strip_table.h"

#ifndef ALWAYS_INLINE
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#endif

/* R weight rows x C tokens (quant.h: quant_strip_fn), each weight block
 * loaded once for the C tokens. Pair p = r * C + c (at most 8: the 8 lanes
 * and 16 registers of AVX2) keeps the dot's integer lanes; the 8 pair
 * vectors are reduced together by one transpose-and-add tree instead of 8
 * horizontal sums, and the fold runs on 8 lanes with quant_fold's
 * operations (cvt, dw * da, fma): the same exact integers and bits as the
 * dots above. Rows past `rows` repeat the last row and are not stored. */

#define UNROLL _Pragma("GCC unroll 16")

/* 8 vectors of 8 lanes -> one vector of their 8 sums, in order. */
ALWAYS_INLINE __m256i reduce8(const __m256i t[8]) {
    __m256i u[4], w[2];
    UNROLL
    for (int k = 0; k < 4; k++)
        u[k] = _mm256_add_epi32(_mm256_unpacklo_epi32(t[2 * k], t[2 * k + 1]),
                                _mm256_unpackhi_epi32(t[2 * k], t[2 * k + 1]));
    UNROLL
    for (int k = 0; k < 2; k++)
        w[k] = _mm256_add_epi32(_mm256_unpacklo_epi64(u[2 * k], u[2 * k + 1]),
                                _mm256_unpackhi_epi64(u[2 * k], u[2 * k + 1]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(w[0], w[1], 0x20),
                            _mm256_permute2x128_si256(w[0], w[1], 0x31));
}

/* Lane p of a per-row (per-token) value: v[p / C] (v[p % C]); lanes past the strip repeat a row. */
#define ROW_OF(p) ((p) / C < R ? (p) / C : R - 1)
ALWAYS_INLINE __m256 by_row(const int R, const int C, const float *v) {
    return _mm256_setr_ps(v[ROW_OF(0)], v[ROW_OF(1)], v[ROW_OF(2)], v[ROW_OF(3)], v[ROW_OF(4)], v[ROW_OF(5)],
                          v[ROW_OF(6)], v[ROW_OF(7)]);
}
#undef ROW_OF
ALWAYS_INLINE __m256 by_tok(const int C, const float *v) {
    return _mm256_setr_ps(v[0 % C], v[1 % C], v[2 % C], v[3 % C], v[4 % C], v[5 % C], v[6 % C], v[7 % C]);
}
/* Token c's meta of block i (quant.h: per token 2 * n/32 int32, per block
 * {-128 * sum(qs), f32 bits of d}) for a strip over n inputs; its scale d. */
ALWAYS_INLINE const int32_t *meta_of(const int32_t *meta, int64_t n, int c, int64_t i) {
    return meta + (size_t)c * 2 * (size_t)(n / 32) + 2 * i;
}
ALWAYS_INLINE float meta_d(const int32_t *m) {
    float d;
    memcpy(&d, m + 1, sizeof d);
    return d;
}

ALWAYS_INLINE void rows_of(const int R, const void *w, size_t ws, int rows, const uint8_t *wr[8]) {
    UNROLL
    for (int r = 0; r < R; r++) wr[r] = (const uint8_t *)w + (size_t)(r < rows ? r : rows - 1) * ws;
}

ALWAYS_INLINE void store_pairs(const int R, const int C, int rows, __m256 acc, float *y, size_t ys) {
    float out[8];
    _mm256_storeu_ps(out, acc);
    UNROLL
    for (int r = 0; r < R; r++)
        if (r < rows)
            UNROLL
            for (int c = 0; c < C; c++) y[c * ys + r] = out[r * C + c];
}

/* Heights: 8 pairs for the integer types, 4 for the float ones (per pass). */
#define INT_H(C) ((C) == 1 ? 8 : (C) == 2 ? 4 : (C) <= 4 ? 2 : 1)
#define FLT_H(C) ((C) == 1 ? 4 : (C) == 2 ? 2 : 1)

#define STRIP_FN(NAME, H, C)                                                                       \
    static void strip_##NAME##_##C(int64_t n, const void *w, size_t ws, int rows, const void *a,   \
                                   size_t as, const int32_t *meta, float *y, size_t ys) {          \
        strip_##NAME(H(C), C, n, w, ws, rows, a, as, meta, y, ys);                                 \
    }
#define STRIPS(NAME, H) QUANT_STRIPS_OF(NAME, H, STRIP_FN)

#endif
