/* quant_avx512_reduce.h - the reduction trees shared by the AVX-512
 * kernel files (quant_avx512.c, quant_iq4_avx512.c, matmul_avx512.c,
 * bf16_avx512bf16.c; internal to src/tensor, included only by files built
 * with the AVX-512 flags).
 *
 * (It also holds the panels' next-panel prefetch, prefetch_panel_slice, for
 * the same files.)
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

/* The 16 horizontal sums of v[0..15], lane m = _mm512_reduce_add_ps(v[m])
 * bit for bit: the same pairings (lane k + lane k+8, then k + k+4, then
 * k + k+2, then k + k+1), done for 16 vectors at once. */
REDUCE_INLINE __m512 reduce16_ps(const __m512 v[16]) {
    __m512 s1[8], s2[4], s3[2];
    REDUCE_UNROLL
    for (int p = 0; p < 8; p++)
        s1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    REDUCE_UNROLL
    for (int r = 0; r < 4; r++)
        s2[r] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * r], s1[2 * r + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(s1[2 * r], s1[2 * r + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    REDUCE_UNROLL
    for (int q = 0; q < 2; q++)
        s3[q] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * q], s2[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(s2[2 * q], s2[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 f = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* f lane 4c + j holds vector c + 4j */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, f);
}

/* The sums of a register tile of R = 4 rows x C tokens (C <= 6), t[r][c],
 * stored at y[c * ys + r]: reduce16_ps over 4 tokens at a time (lane
 * 4c + r), so every sum has _mm512_reduce_add_ps's bits. */
REDUCE_INLINE void store_tile_sums_4xC(const int C, __m512 t[4][6], float *y, size_t ys) {
    REDUCE_UNROLL
    for (int c0 = 0; c0 < C; c0 += 4) {
        __m512 v[16];
        REDUCE_UNROLL
        for (int k = 0; k < 16; k++) v[k] = c0 + k / 4 < C ? t[k % 4][c0 + k / 4] : _mm512_setzero_ps();
        __m512 s = reduce16_ps(v);
        REDUCE_UNROLL
        for (int j = 0; j < 4; j++) {
            if (c0 + j >= C) break;
            __m128 q = j == 0   ? _mm512_castps512_ps128(s)
                       : j == 1 ? _mm512_extractf32x4_ps(s, 1)
                       : j == 2 ? _mm512_extractf32x4_ps(s, 2)
                                : _mm512_extractf32x4_ps(s, 3);
            _mm_storeu_ps(y + (size_t)(c0 + j) * ys, q);
        }
    }
}

/* A panel kernel's prefetch of the next panel (panel_bytes contiguous bytes
 * at next) into L2, spread over the `tiles` token tiles of the current one:
 * tile `tile` fetches its own slice, so the next pack reads cache instead
 * of DRAM at one row's pace. */
REDUCE_INLINE void prefetch_panel_slice(const uint8_t *next, size_t panel_bytes, int64_t tiles, int64_t tile) {
    const size_t ahead = (panel_bytes / (size_t)tiles + 63) & ~(size_t)63;
    size_t p0 = (size_t)tile * ahead, p1 = p0 + ahead < panel_bytes ? p0 + ahead : panel_bytes;
    for (size_t p = p0; p < p1; p += 64) _mm_prefetch((const char *)next + p, _MM_HINT_T1);
}

#endif
