/* quant_avx512_reduce.h - the integer reduction trees shared by the
 * AVX-512 kernel files (quant_avx512.c, quant_iq4_avx512.c; internal to
 * src/tensor, included only by files built with the AVX-512 flags).
 *
 * They fold 16 vectors of per-lane partial sums into the 16 totals in a
 * fixed order, so a kernel that uses them adds its lanes the same way in
 * every file: part of the bit-identity between tiles, strips and the
 * single-row dot (quant.h). */
#ifndef EMBER_TENSOR_QUANT_AVX512_REDUCE_H
#define EMBER_TENSOR_QUANT_AVX512_REDUCE_H

#include <immintrin.h>
#include <stdint.h>

#define REDUCE_INLINE static inline __attribute__((always_inline))
#define REDUCE_UNROLL _Pragma("GCC unroll 16")

REDUCE_INLINE int32_t hsum256_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* Reduces 16 vectors of 8 lanes to their 16 sums: out[0] = sums 0..7, out[1] = 8..15. */
REDUCE_INLINE void reduce16_256(const __m256i t[16], __m256i out[2]) {
    __m256i u[8], w[4];
    REDUCE_UNROLL
    for (int k = 0; k < 8; k++)
        u[k] = _mm256_add_epi32(_mm256_unpacklo_epi32(t[2 * k], t[2 * k + 1]),
                                _mm256_unpackhi_epi32(t[2 * k], t[2 * k + 1]));
    REDUCE_UNROLL
    for (int k = 0; k < 4; k++)
        w[k] = _mm256_add_epi32(_mm256_unpacklo_epi64(u[2 * k], u[2 * k + 1]),
                                _mm256_unpackhi_epi64(u[2 * k], u[2 * k + 1]));
    REDUCE_UNROLL
    for (int k = 0; k < 2; k++)
        out[k] = _mm256_add_epi32(_mm256_permute2x128_si256(w[2 * k], w[2 * k + 1], 0x20),
                                  _mm256_permute2x128_si256(w[2 * k], w[2 * k + 1], 0x31));
}

/* Reduces 16 vectors of 16 lanes to one vector holding their 16 sums. */
REDUCE_INLINE __m512i reduce16_512(const __m512i t[16]) {
    __m512i u[8], w[4];
    REDUCE_UNROLL
    for (int k = 0; k < 8; k++)
        u[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(t[2 * k], t[2 * k + 1]),
                                _mm512_unpackhi_epi32(t[2 * k], t[2 * k + 1]));
    REDUCE_UNROLL
    for (int k = 0; k < 4; k++)
        w[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(u[2 * k], u[2 * k + 1]),
                                _mm512_unpackhi_epi64(u[2 * k], u[2 * k + 1]));
    /* w[k] holds, per 128-bit quarter, partial sums of vectors 4k..4k+3. */
    __m512i x0 = _mm512_add_epi32(_mm512_shuffle_i32x4(w[0], w[1], 0x88),
                                  _mm512_shuffle_i32x4(w[0], w[1], 0xdd));
    __m512i x1 = _mm512_add_epi32(_mm512_shuffle_i32x4(w[2], w[3], 0x88),
                                  _mm512_shuffle_i32x4(w[2], w[3], 0xdd));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(x0, x1, 0x88), _mm512_shuffle_i32x4(x0, x1, 0xdd));
}

#endif
