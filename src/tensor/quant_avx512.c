/* quant_avx512.c - AVX-512 (F/BW/VL + VNNI) dot products and matmul tiles.
 *
 * Design: every quantized block is first brought into one "unsigned" form,
 * u = q + offset with u in 0..255, so that vpdpbusd (unsigned x signed bytes)
 * gives sum(u * a); the offset is paid back with activation sums
 * (offset * sum(a)), which are exact integers. That yields the block's exact
 * integer dot, which quant.h's quant_fold* turns into the f32 sum - the same
 * formula as the scalar code, so results are bit-identical to it.
 *
 *  - 32-element (legacy) blocks: one ymm of u per block; the offset sum is a
 *    second vpdpbusd of the activations with the broadcast offset.
 *  - K-quant super-blocks: 4 zmm of u (256 elements in natural order),
 *    16-bit scales per 16-element unit; pmaddubsw (u <= 63 so no saturation)
 *    then vpdpwssd with the scales. Offsets (Q3_K, Q6_K) and mins (Q2_K,
 *    Q4_K, Q5_K) go through the Q8_K bsums: sum_k coef_k * bsum_k.
 *  - Tiles (4 weight rows x 4 tokens): each weight block is unpacked once
 *    and reused for 4 tokens; the 16 per-pair integer vectors are reduced
 *    together by a transpose-and-add tree (much cheaper than 16 separate
 *    horizontal sums), and the fold runs on 16 lanes at once with the same
 *    float operations (cvt, mul, fma) as the scalar fold.
 *  - Small-batch strips (1..8 tokens, matmul.c's decode and verification
 *    path): Q4_0, Q5_0, Q8_0 and Q4_K put 16 rows in the 16 lanes by a
 *    transpose in registers, so a token costs a few vpdpbusd per block and no
 *    reduction; the other types use rows x tokens pair tiles with one shared
 *    reduction; float types keep per-pair FLOAT_DOT accumulators. */
#include <immintrin.h>
#include <string.h>

#include "tensor/quant.h"
#include "tensor/quant_avx512_reduce.h"
#include "tensor/quant_strip_table.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* Small fixed loops must be fully unrolled so that tile arrays live in registers. */
#define UNROLL _Pragma("GCC unroll 16")

enum { TILE = 4 };
/* Dot products stream weight rows that are contiguous in memory: prefetching
 * this far ahead (into the next rows) keeps enough lines in flight for the
 * decode GEMV to approach memory bandwidth (1 thread, qwen3-0.6b q8_0 decode:
 * 9 -> 15 tok/s). Prefetches never fault, past the matrix included. */
enum { GEMV_PREFETCH = 4096 };

ALWAYS_INLINE float load_f16(const void *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

ALWAYS_INLINE int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ------------------------------------------------ 32-element legacy blocks */

/* Unsigned form of one block (elements in natural order) and its offset. */
ALWAYS_INLINE __m256i nibbles_32(const uint8_t *qs) {
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    __m128i m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}
ALWAYS_INLINE __m256i fifth_bits_32(const uint8_t *qh) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(16));
}

ALWAYS_INLINE __m256i unpack_q4_0(const uint8_t *b) { return nibbles_32(b + 2); }
ALWAYS_INLINE __m256i unpack_q4_1(const uint8_t *b) { return nibbles_32(b + 4); }
ALWAYS_INLINE __m256i unpack_q5_0(const uint8_t *b) {
    return _mm256_or_si256(nibbles_32(b + 6), fifth_bits_32(b + 2));
}
ALWAYS_INLINE __m256i unpack_q5_1(const uint8_t *b) {
    return _mm256_or_si256(nibbles_32(b + 8), fifth_bits_32(b + 4));
}
ALWAYS_INLINE __m256i unpack_q8_0(const uint8_t *b) {
    return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 2)), _mm256_set1_epi8((char)0x80));
}

/* One legacy dot and its 4x4 tile per weight type. WB: weight block bytes,
 * AB/AQ: activation block bytes / offset of its qs, OFF: the u offset,
 * MIN: 1 when the weight has a min (Q4_1/Q5_1 against Q8_1). */
#define LEGACY_KERNELS(NAME, WB, AB, AQ, OFF, MIN)                                             \
    static float dot_##NAME(int64_t n, const void *w, const void *a) {                         \
        const uint8_t *x = w, *y = a;                                                          \
        const __m256i offv = _mm256_set1_epi8((char)(OFF));                                    \
        float acc = 0;                                                                         \
        for (int64_t i = 0; i < n / 32; i++, x += (WB), y += (AB)) {                           \
            _mm_prefetch((const char *)x + GEMV_PREFETCH, _MM_HINT_T0);                        \
            __m256i av = _mm256_loadu_si256((const __m256i *)(y + (AQ)));                      \
            __m256i t = _mm256_dpbusd_epi32(_mm256_setzero_si256(), unpack_##NAME(x), av);     \
            if (OFF) t = _mm256_sub_epi32(t, _mm256_dpbusd_epi32(_mm256_setzero_si256(), offv, av)); \
            int32_t isum = hsum256_epi32(t);                                                   \
            if (MIN)                                                                           \
                acc = quant_fold_q8_1(acc, isum, load_f16(x), load_f16(x + 2), load_f16(y),    \
                                      load_f16(y + 2));                                        \
            else                                                                               \
                acc = quant_fold(acc, isum, load_f16(x), load_f16(y));                         \
        }                                                                                      \
        return acc;                                                                            \
    }                                                                                          \
    static void tile_##NAME(int64_t n, const void *w, size_t ws, const void *a, size_t as,     \
                            float *yout, size_t ys) {                                          \
        const uint8_t *x = w, *y = a;                                                          \
        const __m256i offv = _mm256_set1_epi8((char)(OFF));                                    \
        const __m256i rows_lo = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);                    \
        const __m256i rows_hi = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);                    \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                         \
        for (int64_t i = 0; i < n / 32; i++) {                                                 \
            __m256i u[TILE], t[16];                                                            \
            float dw[TILE], da[TILE], mw[TILE], sa[TILE];                                      \
            UNROLL                                                                             \
            for (int r = 0; r < TILE; r++) {                                                   \
                const uint8_t *b = x + r * ws + i * (WB);                                      \
                u[r] = unpack_##NAME(b);                                                       \
                dw[r] = load_f16(b);                                                           \
                if (MIN) mw[r] = load_f16(b + 2);                                              \
            }                                                                                  \
            UNROLL                                                                             \
            for (int c = 0; c < TILE; c++) {                                                   \
                const uint8_t *b = y + c * as + i * (AB);                                      \
                __m256i av = _mm256_loadu_si256((const __m256i *)(b + (AQ)));                  \
                __m256i neg = _mm256_setzero_si256();                                          \
                if (OFF)                                                                       \
                    neg = _mm256_sub_epi32(neg, _mm256_dpbusd_epi32(_mm256_setzero_si256(), offv, av)); \
                da[c] = load_f16(b);                                                           \
                if (MIN) sa[c] = load_f16(b + 2);                                              \
                UNROLL                                                                               \
                for (int r = 0; r < TILE; r++) t[r * TILE + c] = _mm256_dpbusd_epi32(neg, u[r], av); \
            }                                                                                  \
            __m256i isum[2];                                                                   \
            reduce16_256(t, isum);                                                             \
            __m256 dw4 = _mm256_castps128_ps256(_mm_loadu_ps(dw));                             \
            __m256 da8 = _mm256_broadcast_ps((const __m128 *)da);                              \
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[0]),                                \
                                   _mm256_mul_ps(_mm256_permutevar8x32_ps(dw4, rows_lo), da8), acc0); \
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[1]),                                \
                                   _mm256_mul_ps(_mm256_permutevar8x32_ps(dw4, rows_hi), da8), acc1); \
            if (MIN) {                                                                         \
                __m256 mw4 = _mm256_castps128_ps256(_mm_loadu_ps(mw));                         \
                __m256 sa8 = _mm256_broadcast_ps((const __m128 *)sa);                          \
                acc0 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(mw4, rows_lo), sa8, acc0);     \
                acc1 = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(mw4, rows_hi), sa8, acc1);     \
            }                                                                                  \
        }                                                                                      \
        float out[16];                                                                         \
        _mm256_storeu_ps(out, acc0);                                                           \
        _mm256_storeu_ps(out + 8, acc1);                                                       \
        UNROLL                                                                                 \
        for (int r = 0; r < TILE; r++)                                                         \
            UNROLL                                                                             \
            for (int c = 0; c < TILE; c++) yout[c * ys + r] = out[r * TILE + c];               \
    }

LEGACY_KERNELS(q4_0, 18, 34, 2, 8, 0)
LEGACY_KERNELS(q4_1, 20, 36, 4, 0, 1)
LEGACY_KERNELS(q5_0, 22, 34, 2, 16, 0)
LEGACY_KERNELS(q5_1, 24, 36, 4, 0, 1)
LEGACY_KERNELS(q8_0, 34, 34, 2, 128, 0)

/* ------------------------------------------------------- K-quant blocks */

/* One super-block in the common unsigned form. isum = sum_k sc[k] * sum(u*a
 * over unit k) - (has_min ? 0 : sum_k coef[k] * bsum[k]); with a min,
 * msum = sum_k coef[k] * bsum[k]. */
typedef struct kblock {
    __m512i u[4];     /* 256 unsigned values, natural order */
    __m512i sc[4];    /* per 16-bit word of pmaddubsw output: its unit's scale */
    __m256i coef;     /* 16 x int16: offset*scale, or the min, per unit */
    float d, dmin;
} kblock;

/* Scales per unit (16 x int16) -> the 4 word patterns: chunk k, word w -> unit 4k + w/8. */
ALWAYS_INLINE void expand_scales(__m256i unit_scales, __m512i sc[4]) {
    __m512i src = _mm512_castsi256_si512(unit_scales);
    UNROLL
    for (int k = 0; k < 4; k++) {
        __m512i idx = _mm512_add_epi16(_mm512_set1_epi16((short)(4 * k)),
                                       _mm512_srli_epi16(_mm512_set_epi16(
                                           31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                           15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3));
        sc[k] = _mm512_permutexvar_epi16(idx, src);
    }
}

ALWAYS_INLINE __m512i join256(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

ALWAYS_INLINE void unpack_q4_K(const uint8_t *p, kblock *kb) {
    const block_q4_K *b = (const block_q4_K *)p;
    const __m512i m4 = _mm512_set1_epi8(15);
    UNROLL
    for (int h = 0; h < 2; h++) {
        __m512i q = _mm512_loadu_si512(b->qs + 64 * h);
        __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        /* lo = [sub 4h, sub 4h+2], hi = [sub 4h+1, sub 4h+3] -> natural order */
        kb->u[2 * h] = _mm512_shuffle_i64x2(lo, hi, 0x44);
        kb->u[2 * h + 1] = _mm512_shuffle_i64x2(lo, hi, 0xee);
    }
    int16_t scales[16], mins[16];
    UNROLL
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        quant_k4_scale_min(j, b->scales, &sc, &m);
        scales[2 * j] = scales[2 * j + 1] = sc;
        mins[2 * j] = mins[2 * j + 1] = m;
    }
    expand_scales(_mm256_loadu_si256((const __m256i *)scales), kb->sc);
    kb->coef = _mm256_loadu_si256((const __m256i *)mins);
    kb->d = load_f16(&b->d);
    kb->dmin = load_f16(&b->dmin);
}

ALWAYS_INLINE void unpack_q5_K(const uint8_t *p, kblock *kb) {
    const block_q5_K *b = (const block_q5_K *)p;
    const __m512i m4 = _mm512_set1_epi8(15), one = _mm512_set1_epi8(1);
    __m256i qh = _mm256_loadu_si256((const __m256i *)b->qh);
    __m512i qh2 = join256(qh, qh);
    UNROLL
    for (int h = 0; h < 2; h++) {
        __m512i q = _mm512_loadu_si512(b->qs + 64 * h);
        __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        UNROLL
        for (int k = 0; k < 2; k++) {
            int g = 2 * h + k; /* group g: sub-blocks 2g (bit 2g) and 2g+1 (bit 2g+1) */
            __m512i nib = k ? _mm512_shuffle_i64x2(lo, hi, 0xee) : _mm512_shuffle_i64x2(lo, hi, 0x44);
            __m512i bit_lo = _mm512_srli_epi16(qh2, 2 * g);
            __m512i bit_hi = _mm512_srli_epi16(qh2, 2 * g + 1);
            __m512i bits = _mm512_and_si512(_mm512_mask_blend_epi64(0xf0, bit_lo, bit_hi), one);
            kb->u[g] = _mm512_or_si512(nib, _mm512_slli_epi16(bits, 4));
        }
    }
    int16_t scales[16], mins[16];
    UNROLL
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        quant_k4_scale_min(j, b->scales, &sc, &m);
        scales[2 * j] = scales[2 * j + 1] = sc;
        mins[2 * j] = mins[2 * j + 1] = m;
    }
    expand_scales(_mm256_loadu_si256((const __m256i *)scales), kb->sc);
    kb->coef = _mm256_loadu_si256((const __m256i *)mins);
    kb->d = load_f16(&b->d);
    kb->dmin = load_f16(&b->dmin);
}

ALWAYS_INLINE void unpack_q6_K(const uint8_t *p, kblock *kb) {
    const block_q6_K *b = (const block_q6_K *)p;
    const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3);
    UNROLL
    for (int h = 0; h < 2; h++) {
        __m512i ql = _mm512_loadu_si512(b->ql + 64 * h);
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
        __m512i hb01 = join256(qh, _mm256_srli_epi16(qh, 2));                        /* bits 0-1, 2-3 */
        __m512i hb23 = join256(_mm256_srli_epi16(qh, 4), _mm256_srli_epi16(qh, 6)); /* bits 4-5, 6-7 */
        kb->u[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4),
                                       _mm512_slli_epi16(_mm512_and_si512(hb01, m2), 4));
        kb->u[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                           _mm512_slli_epi16(_mm512_and_si512(hb23, m2), 4));
    }
    __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b->scales));
    expand_scales(sc, kb->sc);
    kb->coef = _mm256_slli_epi16(sc, 5); /* q = u - 32 */
    kb->d = load_f16(&b->d);
    kb->dmin = 0;
}

/* Low 2 bits of Q2_K/Q3_K, natural order: chunk 2h+k holds bit pairs 2k, 2k+1 of qs[32h..]. */
ALWAYS_INLINE __m512i two_bit_chunk(__m256i qs32, int pair0) {
    const __m512i m2 = _mm512_set1_epi8(3);
    __m512i j = join256(_mm256_srli_epi16(qs32, 2 * pair0), _mm256_srli_epi16(qs32, 2 * pair0 + 2));
    return _mm512_and_si512(j, m2);
}

ALWAYS_INLINE void unpack_q3_K(const uint8_t *p, kblock *kb) {
    const block_q3_K *b = (const block_q3_K *)p;
    __m256i hm = _mm256_loadu_si256((const __m256i *)b->hmask);
    const __m512i one = _mm512_set1_epi8(1);
    UNROLL
    for (int h = 0; h < 2; h++) {
        __m256i qs = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * h));
        UNROLL
        for (int k = 0; k < 2; k++) {
            int s0 = 2 * k;
            __m512i low = two_bit_chunk(qs, s0);
            __m512i hb = join256(_mm256_srli_epi16(hm, 4 * h + s0), _mm256_srli_epi16(hm, 4 * h + s0 + 1));
            kb->u[2 * h + k] = _mm512_or_si512(low, _mm512_slli_epi16(_mm512_and_si512(hb, one), 2));
        }
    }
    int16_t scales[16];
    UNROLL
    for (int i = 0; i < 16; i++) scales[i] = (int16_t)quant_q3k_scale(i, b->scales);
    __m256i sc = _mm256_loadu_si256((const __m256i *)scales);
    expand_scales(sc, kb->sc);
    kb->coef = _mm256_slli_epi16(sc, 2); /* q = u - 4 */
    kb->d = load_f16(&b->d);
    kb->dmin = 0;
}

ALWAYS_INLINE void unpack_q2_K(const uint8_t *p, kblock *kb) {
    const block_q2_K *b = (const block_q2_K *)p;
    UNROLL
    for (int h = 0; h < 2; h++) {
        __m256i qs = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * h));
        kb->u[2 * h] = two_bit_chunk(qs, 0);
        kb->u[2 * h + 1] = two_bit_chunk(qs, 2);
    }
    __m256i raw = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)b->scales));
    expand_scales(_mm256_and_si256(raw, _mm256_set1_epi16(15)), kb->sc);
    kb->coef = _mm256_srli_epi16(raw, 4);
    kb->d = load_f16(&b->d);
    kb->dmin = load_f16(&b->dmin);
}

/* sum_k sc_k * sum(u*a over unit k), lanes not yet reduced. */
ALWAYS_INLINE __m512i kdot_lanes(const kblock *kb, const int8_t *q8) {
    __m512i acc = _mm512_setzero_si512();
    UNROLL
    for (int k = 0; k < 4; k++) {
        __m512i av = _mm512_loadu_si512(q8 + 64 * k);
        acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(kb->u[k], av), kb->sc[k]);
    }
    return acc;
}

ALWAYS_INLINE int32_t hsum_madd16(__m256i a, __m256i b) {
    return hsum256_epi32(_mm256_madd_epi16(a, b));
}

/* One block's contribution to a K-quant dot, 16 (row, token) pairs at a
 * time: with a min (Q2_K, Q4_K, Q5_K) the scaled integer sum and the scaled sum of
 * the mins subtracted as two FMAs (min's sign flipped by its bit); without
 * (Q3_K, Q6_K) the offset is in csum and one FMA serves. The K kernels and
 * the K strips share it so both keep the single-row dot's order. */
ALWAYS_INLINE __m512 k_scaled_fma(__m512 acc, __m512i isum, __m512i csum, __m512 dw16, __m512 dm16, __m512 da16,
                                  int has_min) {
    if (has_min) {
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw16, da16), acc);
        __m512 negm = _mm512_castsi512_ps(
            _mm512_xor_si512(_mm512_castps_si512(_mm512_cvtepi32_ps(csum)), _mm512_set1_epi32((int)0x80000000u)));
        return _mm512_fmadd_ps(negm, _mm512_mul_ps(dm16, da16), acc);
    }
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum, csum)), _mm512_mul_ps(dw16, da16), acc);
}

#define K_KERNELS(NAME, HAS_MIN)                                                               \
    __attribute__((unused)) static float dot_##NAME(int64_t n, const void *w, const void *a) {                         \
        const uint8_t *x = w;                                                                  \
        const block_q8_K *y = a;                                                               \
        float acc = 0;                                                                         \
        for (int64_t i = 0; i < n / 256; i++) {                                                \
            kblock kb;                                                                         \
            for (size_t off = 0; off < sizeof(block_##NAME); off += 64)                        \
                _mm_prefetch((const char *)x + i * sizeof(block_##NAME) + GEMV_PREFETCH + off, _MM_HINT_T0); \
            unpack_##NAME(x + i * sizeof(block_##NAME), &kb);                                  \
            __m512i lanes = kdot_lanes(&kb, y[i].qs);                                          \
            int32_t isum = _mm512_reduce_add_epi32(lanes);                                     \
            int32_t csum = hsum_madd16(kb.coef, _mm256_loadu_si256((const __m256i *)y[i].bsums)); \
            if (HAS_MIN)                                                                       \
                acc = quant_fold_min(acc, isum, csum, kb.d, kb.dmin, y[i].d);                  \
            else                                                                               \
                acc = quant_fold(acc, isum - csum, kb.d, y[i].d);                              \
        }                                                                                      \
        return acc;                                                                            \
    }                                                                                          \
    static void tile_##NAME(int64_t n, const void *w, size_t ws, const void *a, size_t as,     \
                            float *yout, size_t ys) {                                          \
        const uint8_t *x = w, *y = a;                                                          \
        /* pair p = 4r + c: its row and token patterns for permutes */                         \
        const __m512i row_of = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3); \
        const __m512i tok_of = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3); \
        __m512 acc = _mm512_setzero_ps();                                                      \
        for (int64_t i = 0; i < n / 256; i++) {                                                \
            __m512i t[16];                                                                     \
            float dw[TILE], dmw[TILE], da[TILE];                                               \
            int32_t coef_w[TILE][8], bs_w[TILE][8];                                            \
            UNROLL                                                                             \
            for (int r = 0; r < TILE; r++) {                                                   \
                kblock kb;                                                                     \
                unpack_##NAME(x + r * ws + i * sizeof(block_##NAME), &kb);                     \
                dw[r] = kb.d;                                                                  \
                dmw[r] = kb.dmin;                                                              \
                _mm256_storeu_si256((__m256i *)coef_w[r], kb.coef);                            \
                UNROLL                                                                         \
                for (int c = 0; c < TILE; c++) {                                               \
                    const block_q8_K *yb = (const block_q8_K *)(y + c * as) + i;               \
                    t[r * TILE + c] = kdot_lanes(&kb, yb->qs);                                 \
                }                                                                              \
            }                                                                                  \
            UNROLL                                                                             \
            for (int c = 0; c < TILE; c++) {                                                   \
                const block_q8_K *yb = (const block_q8_K *)(y + c * as) + i;                   \
                da[c] = yb->d;                                                                 \
                memcpy(bs_w[c], yb->bsums, 32);                                                \
            }                                                                                  \
            __m512i isum = reduce16_512(t);                                                    \
            /* csum[p] = sum over 8 int16 pairs of coef[row] * bsums[token] */                 \
            __m512i cw = _mm512_loadu_si512(coef_w[0]), cw2 = _mm512_loadu_si512(coef_w[2]);   \
            __m512i bw = _mm512_loadu_si512(bs_w[0]), bw2 = _mm512_loadu_si512(bs_w[2]);       \
            __m512i csum = _mm512_setzero_si512();                                             \
            UNROLL                                                                             \
            for (int j = 0; j < 8; j++) {                                                      \
                __m512i ridx = _mm512_add_epi32(_mm512_slli_epi32(row_of, 3), _mm512_set1_epi32(j)); \
                __m512i tidx = _mm512_add_epi32(_mm512_slli_epi32(tok_of, 3), _mm512_set1_epi32(j)); \
                csum = _mm512_dpwssd_epi32(csum, _mm512_permutex2var_epi32(cw, ridx, cw2),      \
                                           _mm512_permutex2var_epi32(bw, tidx, bw2));           \
            }                                                                                  \
            __m512 dw16 = _mm512_permutexvar_ps(row_of, _mm512_castps128_ps512(_mm_loadu_ps(dw))); \
            __m512 da16 = _mm512_permutexvar_ps(tok_of, _mm512_castps128_ps512(_mm_loadu_ps(da))); \
            __m512 dm16 = HAS_MIN ? _mm512_permutexvar_ps(row_of, _mm512_castps128_ps512(_mm_loadu_ps(dmw))) : _mm512_setzero_ps(); \
            acc = k_scaled_fma(acc, isum, csum, dw16, dm16, da16, HAS_MIN); \
        }                                                                                      \
        float out[16];                                                                         \
        _mm512_storeu_ps(out, acc);                                                            \
        UNROLL                                                                                 \
        for (int r = 0; r < TILE; r++)                                                         \
            UNROLL                                                                             \
            for (int c = 0; c < TILE; c++) yout[c * ys + r] = out[r * TILE + c];               \
    }

K_KERNELS(q2_K, 1)
K_KERNELS(q3_K, 0)
K_KERNELS(q4_K, 1)
K_KERNELS(q5_K, 1)
K_KERNELS(q6_K, 0)

/* Q4_K GEMV dot (decode): the 6-bit scales and mins are unpacked with 32-bit
 * word operations instead of per-byte scalar code and a store/reload, and
 * the per-16-element scale words come from one permute per 64 elements.
 * Same exact isum / msum as dot_q4_K (hence the same bits). */
static float dot_q4_K_gemv(int64_t n, const void *w, const void *a) {
    const block_q4_K *x = w;
    const block_q8_K *y = a;
    const __m256i m4 = _mm256_set1_epi8(15);
    __m512i idx[4];
    UNROLL
    for (int g = 0; g < 4; g++)
        idx[g] = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)(2 * g)),
                                         _mm512_set1_epi16((short)(2 * g + 1)));
    float acc = 0;
    for (int64_t i = 0; i < n / 256; i++) {
        for (size_t off = 0; off < sizeof(block_q4_K); off += 64)
            _mm_prefetch((const char *)(x + i) + GEMV_PREFETCH + off, _MM_HINT_T0);
        uint32_t s0, s1, s2;
        memcpy(&s0, x[i].scales, 4);
        memcpy(&s1, x[i].scales + 4, 4);
        memcpy(&s2, x[i].scales + 8, 4);
        uint64_t sc = (uint64_t)(s0 & 0x3f3f3f3fu) |
                      (uint64_t)((s2 & 0x0f0f0f0fu) | ((s0 >> 2) & 0x30303030u)) << 32;
        uint64_t mn = (uint64_t)(s1 & 0x3f3f3f3fu) |
                      (uint64_t)(((s2 >> 4) & 0x0f0f0f0fu) | ((s1 >> 2) & 0x30303030u)) << 32;
        __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc)));
        __m512i lanes = _mm512_setzero_si512();
        UNROLL
        for (int g = 0; g < 4; g++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * g));
            __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            __m512i av = _mm512_loadu_si512(y[i].qs + 64 * g);
            lanes = _mm512_dpwssd_epi32(lanes, _mm512_maddubs_epi16(u, av), _mm512_permutexvar_epi16(idx[g], sc16));
        }
        int32_t isum = _mm512_reduce_add_epi32(lanes);
        __m128i m8 = _mm_cvtsi64_si128((long long)mn);
        __m256i mdup = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        int32_t msum = hsum256_epi32(_mm256_madd_epi16(mdup, _mm256_loadu_si256((const __m256i *)y[i].bsums)));
        acc = quant_fold_min(acc, isum, msum, load_f16(&x[i].d), load_f16(&x[i].dmin), y[i].d);
    }
    return acc;
}

/* ------------------------------------------------ activation quantizers */

/* Same bytes as quant.c's quant_q8_0: amax is order-free, d and id are the
 * same scalar expressions, x * id is the same IEEE product, and vcvtps2dq
 * (round to nearest even) equals the magic-number rounding for |v| < 2^22. */
void quant_avx512_q8_0(const float *x, void *dst, int64_t nb) {
    block_q8_0 *b = dst;
    for (int64_t i = 0; i < nb; i++, x += 32) {
        __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
        __m512 a = _mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1));
        float amax = _mm512_reduce_max_ps(a);
        float d = amax / 127, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        b[i].d = quant_f32_to_f16(d);
        __m512 idv = _mm512_set1_ps(id);
        __m128i q0 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, idv)));
        __m128i q1 = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, idv)));
        _mm_storeu_si128((__m128i *)b[i].qs, q0);
        _mm_storeu_si128((__m128i *)(b[i].qs + 16), q1);
    }
}

/* Same bytes as quant_f32_to_bf16, 16 at a time: round to nearest even on
 * the bit pattern, NaNs made quiet. */
void quant_avx512_bf16(const float *x, void *dst, int64_t n) {
    uint16_t *out = dst;
    const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7fff);
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i v = _mm512_loadu_si512((const void *)(x + i));
        __m512i r = _mm512_add_epi32(v, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(v, 16), one)));
        __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(v, absmask), inf);
        r = _mm512_mask_or_epi32(_mm512_srli_epi32(r, 16), nan, _mm512_srli_epi32(v, 16), _mm512_set1_epi32(0x40));
        _mm256_storeu_si256((__m256i *)(out + i), _mm512_cvtepi32_epi16(r));
    }
    for (; i < n; i++) out[i] = quant_f32_to_bf16(x[i]);
}

/* Same bytes as quant_q8_K: the signed max is the first element of largest
 * magnitude; nearest_int is round-half-even like vcvtps2dq. */
void quant_avx512_q8_K(const float *x, void *dst, int64_t nb) {
    block_q8_K *b = dst;
    for (int64_t i = 0; i < nb; i++, x += 256) {
        __m512 a = _mm512_setzero_ps();
        UNROLL
        for (int k = 0; k < 16; k++) a = _mm512_max_ps(a, _mm512_abs_ps(_mm512_loadu_ps(x + 16 * k)));
        float amax = _mm512_reduce_max_ps(a);
        if (amax == 0) {
            memset(&b[i], 0, sizeof b[i]);
            continue;
        }
        float max = 0;
        __m512 av = _mm512_set1_ps(amax);
        for (int k = 0; k < 16; k++) {
            __mmask16 m = _mm512_cmpeq_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + 16 * k)), av);
            if (m) {
                max = x[16 * k + __builtin_ctz(m)];
                break;
            }
        }
        float iscale = -127.f / max;
        __m512 is = _mm512_set1_ps(iscale);
        __m512i t[16];
        UNROLL
        for (int k = 0; k < 16; k++) {
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(is, _mm512_loadu_ps(x + 16 * k)));
            v = _mm512_min_epi32(v, _mm512_set1_epi32(127));
            _mm_storeu_si128((__m128i *)(b[i].qs + 16 * k), _mm512_cvtepi32_epi8(v));
            t[k] = v;
        }
        _mm256_storeu_si256((__m256i *)b[i].bsums, _mm512_cvtepi32_epi16(reduce16_512(t)));
        b[i].d = 1 / iscale;
    }
}

/* ---------------------------------------------------------- float rows */

/* 16 lanes x 2 accumulators, fixed order; deterministic for this ISA. */
#define FLOAT_DOT(NAME, LOADW)                                                                 \
    static float dot_##NAME(int64_t n, const void *w, const void *a) {                         \
        const uint8_t *x = w;                                                                  \
        const float *y = a;                                                                    \
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();                         \
        int64_t i = 0;                                                                         \
        for (; i + 32 <= n; i += 32) {                                                         \
            acc0 = _mm512_fmadd_ps(LOADW(x, i), _mm512_loadu_ps(y + i), acc0);                 \
            acc1 = _mm512_fmadd_ps(LOADW(x, i + 16), _mm512_loadu_ps(y + i + 16), acc1);       \
        }                                                                                      \
        for (; i + 16 <= n; i += 16) acc0 = _mm512_fmadd_ps(LOADW(x, i), _mm512_loadu_ps(y + i), acc0); \
        if (i < n) {                                                                           \
            __mmask16 m = (__mmask16)((1u << (n - i)) - 1);                                    \
            acc1 = _mm512_fmadd_ps(LOADW##_MASKED(x, i, m), _mm512_maskz_loadu_ps(m, y + i), acc1); \
        }                                                                                      \
        return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));                                \
    }

#define LOAD_F32(x, i) _mm512_loadu_ps((const float *)(x) + (i))
#define LOAD_F32_MASKED(x, i, m) _mm512_maskz_loadu_ps(m, (const float *)(x) + (i))
#define LOAD_F16(x, i) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((x) + 2 * (i))))
#define LOAD_F16_MASKED(x, i, m) _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (x) + 2 * (i)))
#define LOAD_BF16(x, i) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((x) + 2 * (i)))), 16))
#define LOAD_BF16_MASKED(x, i, m) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (x) + 2 * (i))), 16))

FLOAT_DOT(f32, LOAD_F32)
FLOAT_DOT(f16, LOAD_F16)
FLOAT_DOT(bf16, LOAD_BF16)

/* Float weights in batches: 4 rows x 2 tokens per pass, each (row, token)
 * with the two accumulators, the chunk order and the masked tail of
 * FLOAT_DOT, so every result is that dot's bits. Each weight vector is
 * converted once for two tokens and each activation vector loaded once for
 * four rows (the dot converts and loads both per product): 16 FMAs per 12
 * loads instead of 2 per 4. 16 accumulators + 8 weights + 4 activations
 * fit the 32 zmm registers. The 4x4 tile is two such passes. */
#define FLOAT_TILE(NAME, LOADW)                                                                    \
    static void tile2_##NAME(int64_t n, const uint8_t *w, size_t ws, const float *a, size_t as,      \
                             float *y, size_t ys) {                                                  \
        __m512 acc0[4][2], acc1[4][2];                                                             \
        UNROLL for (int r = 0; r < 4; r++) UNROLL for (int c = 0; c < 2; c++) {                    \
            acc0[r][c] = _mm512_setzero_ps();                                                      \
            acc1[r][c] = _mm512_setzero_ps();                                                      \
        }                                                                                          \
        int64_t i = 0;                                                                             \
        for (; i + 32 <= n; i += 32) {                                                             \
            __m512 w0[4], w1[4], a0[2], a1[2];                                                     \
            UNROLL for (int r = 0; r < 4; r++) {                                                   \
                w0[r] = LOADW(w + r * ws, i);                                                      \
                w1[r] = LOADW(w + r * ws, i + 16);                                                 \
            }                                                                                      \
            UNROLL for (int c = 0; c < 2; c++) {                                                   \
                a0[c] = _mm512_loadu_ps(a + c * as + i);                                           \
                a1[c] = _mm512_loadu_ps(a + c * as + i + 16);                                      \
            }                                                                                      \
            UNROLL for (int r = 0; r < 4; r++) UNROLL for (int c = 0; c < 2; c++) {                \
                acc0[r][c] = _mm512_fmadd_ps(w0[r], a0[c], acc0[r][c]);                            \
                acc1[r][c] = _mm512_fmadd_ps(w1[r], a1[c], acc1[r][c]);                            \
            }                                                                                      \
        }                                                                                          \
        for (; i + 16 <= n; i += 16)                                                               \
            UNROLL for (int r = 0; r < 4; r++) {                                                   \
                __m512 wv = LOADW(w + r * ws, i);                                                  \
                UNROLL for (int c = 0; c < 2; c++)                                                 \
                    acc0[r][c] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(a + c * as + i), acc0[r][c]); \
            }                                                                                      \
        if (i < n) {                                                                               \
            __mmask16 m = (__mmask16)((1u << (n - i)) - 1);                                        \
            UNROLL for (int r = 0; r < 4; r++) {                                                   \
                __m512 wv = LOADW##_MASKED(w + r * ws, i, m);                                      \
                UNROLL for (int c = 0; c < 2; c++)                                                 \
                    acc1[r][c] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, a + c * as + i), acc1[r][c]); \
            }                                                                                      \
        }                                                                                          \
        UNROLL for (int r = 0; r < 4; r++) UNROLL for (int c = 0; c < 2; c++)                      \
            y[c * ys + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r][c], acc1[r][c]));           \
    }                                                                                              \
    static void tile_##NAME(int64_t n, const void *w, size_t w_stride, const void *a, size_t a_stride, \
                            float *y, size_t y_stride) {                                           \
        const size_t as = a_stride / sizeof(float);                                                \
        tile2_##NAME(n, w, w_stride, a, as, y, y_stride);                                          \
        tile2_##NAME(n, w, w_stride, (const float *)a + 2 * as, as, y + 2 * y_stride, y_stride);   \
    }

FLOAT_TILE(f32, LOAD_F32)
FLOAT_TILE(f16, LOAD_F16)
FLOAT_TILE(bf16, LOAD_BF16)

/* ------------------------------------------------ small-batch strips */

/* A strip is R weight rows x C tokens (C = 1..8) that share each weight
 * block: the block is loaded and unpacked once and dotted against the C
 * activation blocks (which stay in L1). Per (row, token) the integer work is
 * that of the single dot and the per-block fold is quant_fold* on one lane of
 * a 16-lane vector (pair p = r * C + c: row p / C, token p % C); the pair
 * vectors are reduced together by the transpose trees above, so a strip
 * costs one dpbusd per pair and block plus a shared reduction, instead of a
 * dot's horizontal sum and scalar fold. Rows past `rows` (the ragged end of
 * a range) repeat the last row, so no load leaves the matrix, and are not
 * stored. The next strip's rows are prefetched one strip ahead. */

/* Lane p of pair_index(C, 1) is p / C (its row), of pair_index(C, 0) p % C. */
ALWAYS_INLINE __m512i pair_index(const int C, int row) {
    int32_t v[16];
    UNROLL
    for (int p = 0; p < 16; p++) v[p] = row ? p / C : p % C;
    return _mm512_loadu_si512(v);
}

/* Reduces the first P (<= 16) of t to one vector of P sums (unused lanes: garbage). */
ALWAYS_INLINE __m512i reduce_pairs_256(const int P, __m256i t[16]) {
    UNROLL
    for (int p = P; p < 16; p++) t[p] = _mm256_setzero_si256();
    __m256i out[2];
    reduce16_256(t, out);
    if (P <= 8) return _mm512_zextsi256_si512(out[0]);
    return join256(out[0], out[1]);
}

ALWAYS_INLINE void strip_store(const int R, const int C, int rows, __m512 acc, float *y, size_t ys) {
    float out[16];
    _mm512_storeu_ps(out, acc);
    UNROLL
    for (int r = 0; r < R; r++)
        if (r < rows)
            UNROLL
            for (int c = 0; c < C; c++) y[c * ys + r] = out[r * C + c];
}

ALWAYS_INLINE void strip_rows(const int R, const uint8_t *w, size_t ws, int rows, const uint8_t *wr[16]) {
    UNROLL
    for (int r = 0; r < R; r++) wr[r] = w + (size_t)(r < rows ? r : rows - 1) * ws;
}

/* Scales are converted to f32 in a pass over a chunk of blocks before the
 * products (one f32 per row or token and block, laid out to be loaded as a
 * vector): building the vectors from scalar stores inside the block loop
 * would stall every block on store forwarding. The pass over the rows'
 * block headers also pulls their lines in ahead of the products. */
enum { STRIP_CHUNK = 64 }; /* blocks per scale pass */

#define LEGACY_STRIP(NAME, WB, AB, AQ, OFF, MIN)                                                   \
    ALWAYS_INLINE void strip_##NAME(const int R, const int C, int64_t n, const void *w, size_t ws,  \
                                    int rows, const void *a, size_t as, float *yout, size_t ys) {  \
        const uint8_t *wr[16], *y = a;                                                             \
        strip_rows(R, w, ws, rows, wr);                                                            \
        const size_t ahead = (size_t)R * ws;                                                       \
        const __m256i offv = _mm256_set1_epi8((char)(OFF));                                        \
        const __m512i row_of = pair_index(C, 1), tok_of = pair_index(C, 0);                        \
        float dwf[STRIP_CHUNK][16], mwf[MIN ? STRIP_CHUNK : 1][16];                                \
        float daf[STRIP_CHUNK][16], saf[MIN ? STRIP_CHUNK : 1][16];                                \
        __m512 acc = _mm512_setzero_ps();                                                          \
        const int64_t nb = n / 32;                                                                 \
        for (int64_t i0 = 0; i0 < nb; i0 += STRIP_CHUNK) {                                         \
            const int64_t i1 = nb - i0 < STRIP_CHUNK ? nb : i0 + STRIP_CHUNK;                      \
            UNROLL                                                                                 \
            for (int r = 0; r < R; r++)                                                            \
                for (int64_t i = i0; i < i1; i++) {                                                \
                    dwf[i - i0][r] = load_f16(wr[r] + i * (WB));                                   \
                    if (MIN) mwf[MIN ? i - i0 : 0][r] = load_f16(wr[r] + i * (WB) + 2);            \
                }                                                                                  \
            UNROLL                                                                                 \
            for (int c = 0; c < C; c++)                                                            \
                for (int64_t i = i0; i < i1; i++) {                                                \
                    daf[i - i0][c] = load_f16(y + c * as + i * (AB));                              \
                    if (MIN) saf[MIN ? i - i0 : 0][c] = load_f16(y + c * as + i * (AB) + 2);       \
                }                                                                                  \
            for (int64_t i = i0; i < i1; i++) {                                                    \
                __m256i t[16], neg[8];                                                             \
                UNROLL                                                                             \
                for (int c = 0; c < C; c++) {                                                      \
                    neg[c] = _mm256_setzero_si256();                                               \
                    if (OFF)                                                                       \
                        neg[c] = _mm256_sub_epi32(                                                 \
                            neg[c], _mm256_dpbusd_epi32(_mm256_setzero_si256(), offv,              \
                                                        _mm256_loadu_si256((const __m256i *)(y + c * as + i * (AB) + (AQ))))); \
                }                                                                                  \
                UNROLL                                                                             \
                for (int r = 0; r < R; r++) {                                                      \
                    const uint8_t *b = wr[r] + i * (WB);                                           \
                    _mm_prefetch((const char *)b + ahead, _MM_HINT_T0);                            \
                    __m256i u = unpack_##NAME(b);                                                  \
                    UNROLL                                                                         \
                    for (int c = 0; c < C; c++)                                                    \
                        t[r * C + c] = _mm256_dpbusd_epi32(                                        \
                            neg[c], u, _mm256_loadu_si256((const __m256i *)(y + c * as + i * (AB) + (AQ)))); \
                }                                                                                  \
                __m512i isum = reduce_pairs_256(R * C, t);                                         \
                __m512 dw = _mm512_permutexvar_ps(row_of, _mm512_loadu_ps(dwf[i - i0]));           \
                __m512 da = _mm512_permutexvar_ps(tok_of, _mm512_loadu_ps(daf[i - i0]));           \
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, da), acc);       \
                if (MIN) {                                                                         \
                    __m512 mw = _mm512_permutexvar_ps(row_of, _mm512_loadu_ps(mwf[MIN ? i - i0 : 0])); \
                    __m512 sa = _mm512_permutexvar_ps(tok_of, _mm512_loadu_ps(saf[MIN ? i - i0 : 0])); \
                    acc = _mm512_fmadd_ps(mw, sa, acc);                                            \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        strip_store(R, C, rows, acc, yout, ys);                                                    \
    }

/* Q4_1 and Q5_1 (min terms, Q8_1 activations); the other legacy types use
 * the 16-lane strips below. */
LEGACY_STRIP(q4_1, 20, 36, 4, 0, 1)
LEGACY_STRIP(q5_1, 24, 36, 4, 0, 1)

#define K_STRIP(NAME, HAS_MIN)                                                                     \
    ALWAYS_INLINE void strip_##NAME(const int R, const int C, int64_t n, const void *w, size_t ws,  \
                                    int rows, const void *a, size_t as, float *yout, size_t ys) {  \
        const uint8_t *wr[16], *y = a;                                                             \
        strip_rows(R, w, ws, rows, wr);                                                            \
        const size_t ahead = (size_t)R * ws;                                                       \
        const __m512i row_of = pair_index(C, 1), tok_of = pair_index(C, 0);                        \
        float dw[16] = {0}, dmw[16] = {0}, da[16] = {0};                                           \
        __m256i coef[16];                                                                          \
        __m512 acc = _mm512_setzero_ps();                                                          \
        for (int64_t i = 0; i < n / 256; i++) {                                                    \
            __m512i t[16];                                                                         \
            UNROLL                                                                                 \
            for (int r = 0; r < R; r++) {                                                          \
                const uint8_t *b = wr[r] + i * sizeof(block_##NAME);                               \
                for (size_t off = 0; off < sizeof(block_##NAME); off += 64)                        \
                    _mm_prefetch((const char *)b + ahead + off, _MM_HINT_T0);                      \
                kblock kb;                                                                         \
                unpack_##NAME(b, &kb);                                                             \
                dw[r] = kb.d;                                                                      \
                dmw[r] = kb.dmin;                                                                  \
                coef[r] = kb.coef;                                                                 \
                UNROLL                                                                             \
                for (int c = 0; c < C; c++)                                                        \
                    t[r * C + c] = kdot_lanes(&kb, ((const block_q8_K *)(y + c * as) + i)->qs);    \
            }                                                                                      \
            UNROLL                                                                                 \
            for (int p = R * C; p < 16; p++) t[p] = _mm512_setzero_si512();                        \
            __m512i isum = reduce16_512(t);                                                        \
            __m256i m[16];                                                                         \
            UNROLL                                                                                 \
            for (int c = 0; c < C; c++) {                                                          \
                const block_q8_K *yb = (const block_q8_K *)(y + c * as) + i;                       \
                da[c] = yb->d;                                                                     \
                __m256i bs = _mm256_loadu_si256((const __m256i *)yb->bsums);                       \
                UNROLL                                                                             \
                for (int r = 0; r < R; r++) m[r * C + c] = _mm256_madd_epi16(coef[r], bs);         \
            }                                                                                      \
            __m512i csum = reduce_pairs_256(R * C, m);                                             \
            __m512 dw16 = _mm512_permutexvar_ps(row_of, _mm512_loadu_ps(dw));                      \
            __m512 da16 = _mm512_permutexvar_ps(tok_of, _mm512_loadu_ps(da));                      \
            __m512 dm16 = HAS_MIN ? _mm512_permutexvar_ps(row_of, _mm512_loadu_ps(dmw)) : _mm512_setzero_ps(); \
            acc = k_scaled_fma(acc, isum, csum, dw16, dm16, da16, HAS_MIN); \
        }                                                                                          \
        strip_store(R, C, rows, acc, yout, ys);                                                    \
    }

/* Q4_K has a 16-lane strip below; Q6_K too, for 2 or more tokens (a lone
 * token is cheaper as 16 pairs here: the lanes rebuild the 6-bit values for
 * each of the 16 rows, which only pays off across tokens). */
K_STRIP(q2_K, 1)
K_STRIP(q3_K, 0)
K_STRIP(q5_K, 1)
K_STRIP(q6_K, 0)

/* Float rows: per pair FLOAT_DOT's two accumulators, chunk order and masked
 * tail, hence its bits; at most 8 pairs (16 accumulators). */
#define FLOAT_STRIP(NAME, LOADW, ES)                                                               \
    ALWAYS_INLINE void strip_##NAME(const int R, const int C, int64_t n, const void *w, size_t ws,  \
                                    int rows, const void *act, size_t as, float *y, size_t ys) {   \
        const uint8_t *wr[16];                                                                     \
        const float *a = act;                                                                      \
        const size_t ahead = (size_t)R * ws, fs = as / sizeof(float);                              \
        strip_rows(R, w, ws, rows, wr);                                                            \
        __m512 acc0[8], acc1[8];                                                                   \
        UNROLL                                                                                     \
        for (int p = 0; p < R * C; p++) acc0[p] = acc1[p] = _mm512_setzero_ps();                   \
        int64_t i = 0;                                                                             \
        for (; i + 32 <= n; i += 32) {                                                             \
            UNROLL                                                                                 \
            for (int r = 0; r < R; r++) {                                                          \
                for (int off = 0; off < 32 * (ES); off += 64)                                      \
                    _mm_prefetch((const char *)wr[r] + (ES) * i + ahead + off, _MM_HINT_T0);       \
                __m512 w0 = LOADW(wr[r], i), w1 = LOADW(wr[r], i + 16);                            \
                UNROLL                                                                             \
                for (int c = 0; c < C; c++) {                                                      \
                    acc0[r * C + c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(a + c * fs + i), acc0[r * C + c]); \
                    acc1[r * C + c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(a + c * fs + i + 16), acc1[r * C + c]); \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        for (; i + 16 <= n; i += 16)                                                               \
            UNROLL                                                                                 \
            for (int r = 0; r < R; r++) {                                                          \
                __m512 wv = LOADW(wr[r], i);                                                       \
                UNROLL                                                                             \
                for (int c = 0; c < C; c++)                                                        \
                    acc0[r * C + c] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(a + c * fs + i), acc0[r * C + c]); \
            }                                                                                      \
        if (i < n) {                                                                               \
            __mmask16 m = (__mmask16)((1u << (n - i)) - 1);                                        \
            UNROLL                                                                                 \
            for (int r = 0; r < R; r++) {                                                          \
                __m512 wv = LOADW##_MASKED(wr[r], i, m);                                           \
                UNROLL                                                                             \
                for (int c = 0; c < C; c++)                                                        \
                    acc1[r * C + c] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, a + c * fs + i), acc1[r * C + c]); \
            }                                                                                      \
        }                                                                                          \
        UNROLL                                                                                     \
        for (int r = 0; r < R; r++)                                                                \
            if (r < rows)                                                                          \
                UNROLL                                                                             \
                for (int c = 0; c < C; c++)                                                        \
                    y[c * ys + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r * C + c], acc1[r * C + c])); \
    }

FLOAT_STRIP(f32, LOAD_F32, 4)
FLOAT_STRIP(f16, LOAD_F16, 2)
FLOAT_STRIP(bf16, LOAD_BF16, 2)

/* Weights dotted with Q8_0 activations (Q4_0, Q5_0, Q8_0), any token count:
 * 16 rows in the 16 lanes, as in matmul_avx512.c's panels but transposed in
 * registers instead of packed in memory. Per block the 16 rows' unsigned
 * 32-byte forms are transposed (8 zmm; zmm j lane l = bytes 4j..4j+3 of row
 * LANE_ROW(l)) once, then each token adds 8 vpdpbusd with its 4-byte groups
 * broadcast, starting from meta's -OFF * sum(a): each lane is its row's
 * exact block dot, with no horizontal reduction, folded on 16 lanes with
 * quant_fold's cvt, dw * da, fma. SHIFT turns meta's -128 * sum(a) into
 * -OFF * sum(a) (an exact shift: the value is a multiple of 128). */

/* The transpose leaves the rows in the order 0-3, 8-11, 4-7, 12-15. */



#define LANE_AHEAD 1
/* The 32-element lane strips prefetch the next strip (16 rows: one
 * contiguous span of 16 * ws bytes) in address order: per block step, the
 * 16 * WB bytes of it that the step consumes of this strip (+ 1 line, as
 * the span is not line-aligned). Prefetching row r of the next strip at
 * block i instead, 16 addresses a row apart per step, touched the same
 * lines as 16 short streams: Q8_0 decode on the qwen3-0.6b shape ran 12%
 * slower at one thread (docs/engine-bench.md). The K strips keep their row
 * by row prefetch: in address order Q4_K read ~20% slower
 * (bench_matmul --batch), Q6_K no faster. */
#define LANE_PREFETCH_LINES(WB) ((16 * (WB) + 63) / 64 + 1)
#define LANE_ROW(l) ((l) < 4 || (l) >= 12 ? (l) : (l) < 8 ? (l) + 4 : (l) - 4)

/* z[k] = [row k | row k + 8] (8 dwords each) -> out[j] = dword j of every row. */
ALWAYS_INLINE void transpose_rows16(const __m512i z[8], __m512i out[8]) {
    __m512i a[8], b[8];
    UNROLL
    for (int k = 0; k < 4; k++) {
        a[2 * k] = _mm512_unpacklo_epi32(z[2 * k], z[2 * k + 1]);
        a[2 * k + 1] = _mm512_unpackhi_epi32(z[2 * k], z[2 * k + 1]);
    }
    /* b[4g + e]: quarter q holds dword e (q even) or 4 + e (q odd) of rows 4g..4g+3 (q < 2) or +8 */
    UNROLL
    for (int g = 0; g < 2; g++) {
        b[4 * g + 0] = _mm512_unpacklo_epi64(a[4 * g], a[4 * g + 2]);
        b[4 * g + 1] = _mm512_unpackhi_epi64(a[4 * g], a[4 * g + 2]);
        b[4 * g + 2] = _mm512_unpacklo_epi64(a[4 * g + 1], a[4 * g + 3]);
        b[4 * g + 3] = _mm512_unpackhi_epi64(a[4 * g + 1], a[4 * g + 3]);
    }
    UNROLL
    for (int e = 0; e < 4; e++) {
        out[e] = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x88);
        out[4 + e] = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xdd);
    }
}

/* Row r of a full strip is p[r % 4] + o[r / 4] (4 pointers and 3 offsets in
 * registers instead of 16 pointers that spill); a ragged strip (rows < 16)
 * takes its clamped row pointers from memory. */
#define LANE_ROW_PTR(r, WB)                                                                          \
    (FULL ? ((r) % 4 == 0 ? p0 : (r) % 4 == 1 ? p1 : (r) % 4 == 2 ? p2 : p3) +                    \
                ((r) / 4 == 0 ? 0 : (r) / 4 == 1 ? o4 : (r) / 4 == 2 ? o8 : o12)                   \
          : wr[r] + i * (WB))

#define LANE_STRIP(NAME, WB, SHIFT)                                                                \
    ALWAYS_INLINE void lanes_body_##NAME(const int FULL, const int C, int64_t n, const void *w,    \
                                         size_t ws, int rows, const void *a, size_t as,            \
                                         const int32_t *meta, float *yout, size_t ys) {            \
        const uint8_t *wr[16], *act = a;                                                           \
        strip_rows(16, w, ws, rows, wr);                                                           \
        int32_t off[16];                                                                           \
        UNROLL                                                                                     \
        for (int l = 0; l < 16; l++) off[l] = (int32_t)(wr[LANE_ROW(l)] - wr[0]);                  \
        const __m512i d_idx = _mm512_loadu_si512(off);                                             \
        const size_t o4 = 4 * ws, o8 = 8 * ws, o12 = 12 * ws;                                      \
        const char *next = (const char *)w + 16 * ws; /* the next strip: 16 rows, one span */      \
        const uint8_t *p0 = w, *p1 = p0 + ws, *p2 = p1 + ws, *p3 = p2 + ws;                        \
        const int64_t nb = n / 32;                                                                 \
        const size_t ms = 2 * (size_t)nb;                                                          \
        __m512 facc[8];                                                                            \
        UNROLL                                                                                     \
        for (int c = 0; c < C; c++) facc[c] = _mm512_setzero_ps();                                 \
        for (int64_t i = 0; i < nb; i++) {                                                         \
            __m512i z[8], wt[8];                                                                   \
            UNROLL                                                                                 \
            for (int k = 0; k < 8; k++) {                                                          \
                const uint8_t *b0 = LANE_ROW_PTR(k, WB), *b1 = LANE_ROW_PTR(k + 8, WB);                    \
                z[k] = join256(unpack_##NAME(b0), unpack_##NAME(b1));                              \
            }                                                                                      \
            /* the next strip's bytes, 16 blocks' worth per block step, in address order */        \
            UNROLL                                                                                 \
            for (int k = 0; k < LANE_PREFETCH_LINES(WB); k++)                                      \
                _mm_prefetch(next + (size_t)i * 16 * (WB) + 64 * k, _MM_HINT_T0);                  \
            transpose_rows16(z, wt);                                                               \
            __m512i dbits = _mm512_i32gather_epi32(d_idx, (const void *)(FULL ? p0 : wr[0] + i * (WB)), 1); \
            __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dbits));                             \
            UNROLL                                                                                 \
            for (int c = 0; c < C; c++) {                                                          \
                const uint8_t *q = act + c * as + i * 34 + 2;                                      \
                const int32_t *m = meta + c * ms + 2 * i;                                          \
                __m512i acc0 = _mm512_set1_epi32(m[0] >> (SHIFT)), acc1 = _mm512_setzero_si512();   \
                UNROLL                                                                             \
                for (int j = 0; j < 8; j += 2) {                                                   \
                    acc0 = _mm512_dpbusd_epi32(acc0, wt[j], _mm512_set1_epi32(load_i32(q + 4 * j))); \
                    acc1 = _mm512_dpbusd_epi32(acc1, wt[j + 1], _mm512_set1_epi32(load_i32(q + 4 * j + 4))); \
                }                                                                                  \
                float da;                                                                          \
                memcpy(&da, m + 1, 4);                                                             \
                facc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(acc0, acc1)),         \
                                          _mm512_mul_ps(dw, _mm512_set1_ps(da)), facc[c]);         \
            }                                                                                      \
            p0 += (WB), p1 += (WB), p2 += (WB), p3 += (WB);                                        \
        }                                                                                          \
        UNROLL                                                                                     \
        for (int c = 0; c < C; c++) {                                                              \
            float out[16];                                                                         \
            _mm512_storeu_ps(out, facc[c]);                                                        \
            UNROLL                                                                                 \
            for (int l = 0; l < 16; l++)                                                           \
                if (LANE_ROW(l) < rows) yout[c * ys + LANE_ROW(l)] = out[l];                       \
        }                                                                                          \
    }                                                                                              \
    ALWAYS_INLINE void lanes_##NAME(const int C, int64_t n, const void *w, size_t ws, int rows,    \
                                    const void *a, size_t as, const int32_t *meta, float *yout,    \
                                    size_t ys) {                                                   \
        if (rows == 16)                                                                            \
            lanes_body_##NAME(1, C, n, w, ws, rows, a, as, meta, yout, ys);                        \
        else                                                                                       \
            lanes_body_##NAME(0, C, n, w, ws, rows, a, as, meta, yout, ys);                        \
    }

LANE_STRIP(q4_0, 18, 4)
LANE_STRIP(q5_0, 22, 3)
LANE_STRIP(q8_0, 34, 0)

/* Q4_K with 16 rows in lanes: per super-block and 32-byte group g the 16
 * rows' nibble bytes are transposed (as for Q8_0), split into the low
 * (sub-block 2g) and high (2g+1) nibbles, and each token adds 8 vpdpbusd
 * per sub-block; a sub-block's sum times its 6-bit scale (vpmulld) goes
 * into isum, and the mins into msum through the Q8_K bsums (vpdpwssd on
 * (min, min) pairs), the exact isum and msum of dot_q4_K. The scales and
 * mins are unpacked in the lanes from three gathered dwords per row, with
 * quant_k4_scale_min's bit layout. */
ALWAYS_INLINE void lanes_body_q4_K(const int FULL, const int C, int64_t n, const void *w, size_t ws, int rows,
                                   const void *a, size_t as, float *yout, size_t ys) {
    enum { WB = sizeof(block_q4_K) };
    const uint8_t *wr[16], *act = a;
    strip_rows(16, w, ws, rows, wr);
    int32_t off[16];
    UNROLL
    for (int l = 0; l < 16; l++) off[l] = (int32_t)(wr[LANE_ROW(l)] - wr[0]);
    const __m512i idx = _mm512_loadu_si512(off);
    const __m512i m4 = _mm512_set1_epi8(15), low6 = _mm512_set1_epi32(63), low4 = _mm512_set1_epi32(15),
                  low2 = _mm512_set1_epi32(3), low16 = _mm512_set1_epi32(0xffff);
    const size_t ahead = LANE_AHEAD * 16 * ws, o4 = 4 * ws, o8 = 8 * ws, o12 = 12 * ws;
    const uint8_t *p0 = w, *p1 = p0 + ws, *p2 = p1 + ws, *p3 = p2 + ws;
    __m512 facc[8];
    UNROLL
    for (int c = 0; c < C; c++) facc[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        const uint8_t *base = FULL ? p0 : wr[0] + i * WB;
        /* scales and mins of every lane: sc[k], mn[k] = (min, min) int16 pairs */
        __m512i sc[8], mn[8];
        {
            __m512i s0 = _mm512_i32gather_epi32(idx, (const void *)(base + 4), 1);
            __m512i s1 = _mm512_i32gather_epi32(idx, (const void *)(base + 8), 1);
            __m512i s2 = _mm512_i32gather_epi32(idx, (const void *)(base + 12), 1);
            UNROLL
            for (int b = 0; b < 4; b++) {
                __m512i q0 = _mm512_srli_epi32(s0, 8 * b), q1 = _mm512_srli_epi32(s1, 8 * b),
                        q2 = _mm512_srli_epi32(s2, 8 * b);
                __m512i m_lo = _mm512_and_si512(q1, low6);
                __m512i m_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(q2, 4), low4),
                                               _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(q1, 6), low2), 4));
                sc[b] = _mm512_and_si512(q0, low6);
                sc[4 + b] = _mm512_or_si512(_mm512_and_si512(q2, low4),
                                            _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(q0, 6), low2), 4));
                mn[b] = _mm512_or_si512(m_lo, _mm512_slli_epi32(m_lo, 16));
                mn[4 + b] = _mm512_or_si512(m_hi, _mm512_slli_epi32(m_hi, 16));
            }
        }
        __m512i dd = _mm512_i32gather_epi32(idx, (const void *)base, 1);
        __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_and_si512(dd, low16)));
        __m512 dmw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16)));
        __m512i isum[8];
        UNROLL
        for (int c = 0; c < C; c++) isum[c] = _mm512_setzero_si512();
        for (int g = 0; g < 4; g++) {
            __m512i z[8], wt[8], lo[8], hi[8];
            UNROLL
            for (int k = 0; k < 8; k++) {
                const uint8_t *b0 = LANE_ROW_PTR(k, WB), *b1 = LANE_ROW_PTR(k + 8, WB);
                if (g < 3) {
                    _mm_prefetch((const char *)b0 + ahead + 48 * g, _MM_HINT_T0);
                    _mm_prefetch((const char *)b1 + ahead + 48 * g, _MM_HINT_T0);
                }
                z[k] = join256(_mm256_loadu_si256((const __m256i *)(b0 + 16 + 32 * g)),
                               _mm256_loadu_si256((const __m256i *)(b1 + 16 + 32 * g)));
            }
            transpose_rows16(z, wt);
            UNROLL
            for (int j = 0; j < 8; j++) {
                lo[j] = _mm512_and_si512(wt[j], m4);
                hi[j] = _mm512_and_si512(_mm512_srli_epi16(wt[j], 4), m4);
            }
            UNROLL
            for (int c = 0; c < C; c++) {
                const uint8_t *q = act + c * as + i * sizeof(block_q8_K) + offsetof(block_q8_K, qs) + 64 * g;
                __m512i s_lo = _mm512_setzero_si512(), s_hi = _mm512_setzero_si512();
                UNROLL
                for (int j = 0; j < 8; j++) {
                    s_lo = _mm512_dpbusd_epi32(s_lo, lo[j], _mm512_set1_epi32(load_i32(q + 4 * j)));
                    s_hi = _mm512_dpbusd_epi32(s_hi, hi[j], _mm512_set1_epi32(load_i32(q + 32 + 4 * j)));
                }
                isum[c] = _mm512_add_epi32(isum[c], _mm512_add_epi32(_mm512_mullo_epi32(s_lo, sc[2 * g]),
                                                                     _mm512_mullo_epi32(s_hi, sc[2 * g + 1])));
            }
        }
        UNROLL
        for (int c = 0; c < C; c++) {
            const uint8_t *ab = act + c * as + i * sizeof(block_q8_K);
            const uint8_t *bs = ab + offsetof(block_q8_K, bsums);
            __m512i msum = _mm512_setzero_si512();
            UNROLL
            for (int k = 0; k < 8; k++) msum = _mm512_dpwssd_epi32(msum, mn[k], _mm512_set1_epi32(load_i32(bs + 4 * k)));
            float daf;
            memcpy(&daf, ab, 4);
            __m512 da = _mm512_set1_ps(daf);
            facc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[c]), _mm512_mul_ps(dw, da), facc[c]);
            facc[c] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmw, da), facc[c]);
        }
        p0 += WB, p1 += WB, p2 += WB, p3 += WB;
    }
    UNROLL
    for (int c = 0; c < C; c++) {
        float out[16];
        _mm512_storeu_ps(out, facc[c]);
        UNROLL
        for (int l = 0; l < 16; l++)
            if (LANE_ROW(l) < rows) yout[c * ys + LANE_ROW(l)] = out[l];
    }
}

/* Q6_K with 16 rows in lanes: per super-block half h the rows' ql and qh
 * bytes are transposed (three 32-byte groups), the unsigned values
 * u = q + 32 are put together in the lanes with dot_q6_K's byte operations
 * (which act on each byte, so they commute with moving whole dwords), and a
 * token adds 4 vpdpbusd per 16-element sub-block, times its signed scale
 * (vpmulld); the -32 offset comes off through the bsums (vpdpwssd on scale
 * pairs): the exact integer of dot_q6_K. */
ALWAYS_INLINE void lanes_body_q6_K(const int FULL, const int C, int64_t n, const void *w, size_t ws, int rows,
                                   const void *a, size_t as, float *yout, size_t ys) {
    enum { WB = sizeof(block_q6_K) };
    const uint8_t *wr[16], *act = a;
    strip_rows(16, w, ws, rows, wr);
    int32_t off[16];
    UNROLL
    for (int l = 0; l < 16; l++) off[l] = (int32_t)(wr[LANE_ROW(l)] - wr[0]);
    const __m512i idx = _mm512_loadu_si512(off);
    const __m512i m4 = _mm512_set1_epi8(15), m2 = _mm512_set1_epi8(3), low16 = _mm512_set1_epi32(0xffff);
    const size_t ahead = LANE_AHEAD * 16 * ws, o4 = 4 * ws, o8 = 8 * ws, o12 = 12 * ws;
    const uint8_t *p0 = w, *p1 = p0 + ws, *p2 = p1 + ws, *p3 = p2 + ws;
    __m512 facc[8];
    UNROLL
    for (int c = 0; c < C; c++) facc[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        const uint8_t *base = FULL ? p0 : wr[0] + i * WB;
        __m512i sc[16], pair[8];
        UNROLL
        for (int q = 0; q < 4; q++) {
            __m512i v = _mm512_i32gather_epi32(idx, (const void *)(base + offsetof(block_q6_K, scales) + 4 * q), 1);
            UNROLL
            for (int b = 0; b < 4; b++) sc[4 * q + b] = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * b), 24);
        }
        UNROLL
        for (int k = 0; k < 8; k++)
            pair[k] = _mm512_or_si512(_mm512_and_si512(sc[2 * k], low16), _mm512_slli_epi32(sc[2 * k + 1], 16));
        /* d: the high half of the dword ending the block */
        __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(
            _mm512_srli_epi32(_mm512_i32gather_epi32(idx, (const void *)(base + WB - 4), 1), 16)));
        __m512i isum[8];
        UNROLL
        for (int c = 0; c < C; c++) isum[c] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            __m512i ql0[8], ql1[8], qh[8];
            {
                __m512i z0[8], z1[8], z2[8];
                UNROLL
                for (int k = 0; k < 8; k++) {
                    const uint8_t *b0 = LANE_ROW_PTR(k, WB), *b1 = LANE_ROW_PTR(k + 8, WB);
                    /* the next strip's 210 bytes: 4 lines, 2 per half */
                    _mm_prefetch((const char *)b0 + ahead + 128 * h, _MM_HINT_T0);
                    _mm_prefetch((const char *)b1 + ahead + 128 * h, _MM_HINT_T0);
                    _mm_prefetch((const char *)b0 + ahead + 128 * h + 64, _MM_HINT_T0);
                    _mm_prefetch((const char *)b1 + ahead + 128 * h + 64, _MM_HINT_T0);
                    if (h == 1) {
                        _mm_prefetch((const char *)b0 + ahead + WB - 1, _MM_HINT_T0);
                        _mm_prefetch((const char *)b1 + ahead + WB - 1, _MM_HINT_T0);
                    }
                    z0[k] = join256(_mm256_loadu_si256((const __m256i *)(b0 + 64 * h)),
                                    _mm256_loadu_si256((const __m256i *)(b1 + 64 * h)));
                    z1[k] = join256(_mm256_loadu_si256((const __m256i *)(b0 + 64 * h + 32)),
                                    _mm256_loadu_si256((const __m256i *)(b1 + 64 * h + 32)));
                    z2[k] = join256(_mm256_loadu_si256((const __m256i *)(b0 + 128 + 32 * h)),
                                    _mm256_loadu_si256((const __m256i *)(b1 + 128 + 32 * h)));
                }
                transpose_rows16(z0, ql0);
                transpose_rows16(z1, ql1);
                transpose_rows16(z2, qh);
            }
            for (int k = 0; k < 4; k++) {
                __m512i u[8];
                UNROLL
                for (int j = 0; j < 8; j++) {
                    __m512i l = k & 1 ? ql1[j] : ql0[j];
                    __m512i lo = k < 2 ? _mm512_and_si512(l, m4) : _mm512_and_si512(_mm512_srli_epi16(l, 4), m4);
                    __m512i hb = _mm512_and_si512(_mm512_srli_epi16(qh[j], 2 * k), m2);
                    u[j] = _mm512_or_si512(lo, _mm512_slli_epi16(hb, 4));
                }
                const int s = 8 * h + 2 * k; /* sub-blocks s (dwords 0-3) and s + 1 (4-7) */
                UNROLL
                for (int c = 0; c < C; c++) {
                    const uint8_t *q = act + c * as + i * sizeof(block_q8_K) + offsetof(block_q8_K, qs) + 128 * h + 32 * k;
                    __m512i sa = _mm512_setzero_si512(), sb = _mm512_setzero_si512();
                    UNROLL
                    for (int j = 0; j < 4; j++) {
                        sa = _mm512_dpbusd_epi32(sa, u[j], _mm512_set1_epi32(load_i32(q + 4 * j)));
                        sb = _mm512_dpbusd_epi32(sb, u[4 + j], _mm512_set1_epi32(load_i32(q + 16 + 4 * j)));
                    }
                    isum[c] = _mm512_add_epi32(isum[c], _mm512_add_epi32(_mm512_mullo_epi32(sa, sc[s]),
                                                                         _mm512_mullo_epi32(sb, sc[s + 1])));
                }
            }
        }
        UNROLL
        for (int c = 0; c < C; c++) {
            const uint8_t *ab = act + c * as + i * sizeof(block_q8_K);
            const uint8_t *bs = ab + offsetof(block_q8_K, bsums);
            __m512i csum = _mm512_setzero_si512();
            UNROLL
            for (int k = 0; k < 8; k++) csum = _mm512_dpwssd_epi32(csum, pair[k], _mm512_set1_epi32(load_i32(bs + 4 * k)));
            float daf;
            memcpy(&daf, ab, 4);
            __m512i tot = _mm512_sub_epi32(isum[c], _mm512_slli_epi32(csum, 5));
            facc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_mul_ps(dw, _mm512_set1_ps(daf)), facc[c]);
        }
        p0 += WB, p1 += WB, p2 += WB, p3 += WB;
    }
    UNROLL
    for (int c = 0; c < C; c++) {
        float out[16];
        _mm512_storeu_ps(out, facc[c]);
        UNROLL
        for (int l = 0; l < 16; l++)
            if (LANE_ROW(l) < rows) yout[c * ys + LANE_ROW(l)] = out[l];
    }
}

ALWAYS_INLINE void lanes_q6_K(const int C, int64_t n, const void *w, size_t ws, int rows, const void *a,
                              size_t as, const int32_t *meta, float *yout, size_t ys) {
    (void)meta;
    if (rows == 16) lanes_body_q6_K(1, C, n, w, ws, rows, a, as, yout, ys);
    else lanes_body_q6_K(0, C, n, w, ws, rows, a, as, yout, ys);
}

ALWAYS_INLINE void lanes_q4_K(const int C, int64_t n, const void *w, size_t ws, int rows, const void *a,
                              size_t as, const int32_t *meta, float *yout, size_t ys) {
    (void)meta;
    if (rows == 16) lanes_body_q4_K(1, C, n, w, ws, rows, a, as, yout, ys);
    else lanes_body_q4_K(0, C, n, w, ws, rows, a, as, yout, ys);
}

/* Strip heights per token count: 16 pairs for the integer types (the
 * reduction trees' width), 8 for the float ones (their accumulators). */
#define QUANT_H(C) ((C) == 1 ? 16 : (C) == 2 ? 8 : (C) == 3 ? 5 : (C) == 4 ? 4 : (C) == 5 ? 3 : 2)
#define FLOAT_H(C) ((C) == 1 ? 8 : (C) == 2 ? 4 : (C) <= 4 ? 2 : 1)

#define STRIP_FN(NAME, H, C)                                                                       \
    static void strip_##NAME##_##C(int64_t n, const void *w, size_t ws, int rows, const void *a,   \
                                   size_t as, const int32_t *meta, float *y, size_t ys) {          \
        (void)meta;                                                                                \
        strip_##NAME(H(C), C, n, w, ws, rows, a, as, y, ys);                                       \
    }
#define LANE_FN(NAME, H, C)                                                                        \
    static void strip_##NAME##_##C(int64_t n, const void *w, size_t ws, int rows, const void *a,   \
                                   size_t as, const int32_t *meta, float *y, size_t ys) {          \
        lanes_##NAME(C, n, w, ws, rows, a, as, meta, y, ys);                                       \
    }
#define STRIPS(NAME, H) QUANT_STRIPS_OF(NAME, H, STRIP_FN)

#define LANE_H(C) 16
QUANT_STRIPS_OF(q4_0, LANE_H, LANE_FN)
STRIPS(q4_1, QUANT_H)
QUANT_STRIPS_OF(q5_0, LANE_H, LANE_FN)
STRIPS(q5_1, QUANT_H)
QUANT_STRIPS_OF(q8_0, LANE_H, LANE_FN)
STRIPS(q2_K, QUANT_H)
STRIPS(q3_K, QUANT_H)
QUANT_STRIPS_OF(q4_K, LANE_H, LANE_FN)
STRIPS(q5_K, QUANT_H)
QUANT_STRIPS_OF(q6_K, LANE_H, LANE_FN)
STRIPS(f32, FLOAT_H)
STRIPS(f16, FLOAT_H)
STRIPS(bf16, FLOAT_H)

static void strip_q6_K_pairs_1(int64_t n, const void *w, size_t ws, int rows, const void *a, size_t as,
                               const int32_t *meta, float *y, size_t ys) {
    (void)meta;
    strip_q6_K(QUANT_H(1), 1, n, w, ws, rows, a, as, y, ys);
}

void quant_avx512_strips(quant_strip_fn strips[DT_COUNT][QUANT_STRIP_TOKENS + 1],
                         int heights[DT_COUNT][QUANT_STRIP_TOKENS + 1]) {
#define SET(T, NAME) set_strips_##NAME(strips[T], heights[T])
    SET(DT_Q4_0, q4_0);
    SET(DT_Q4_1, q4_1);
    SET(DT_Q5_0, q5_0);
    SET(DT_Q5_1, q5_1);
    SET(DT_Q8_0, q8_0);
    SET(DT_Q2_K, q2_K);
    SET(DT_Q3_K, q3_K);
    SET(DT_Q4_K, q4_K);
    SET(DT_Q5_K, q5_K);
    SET(DT_Q6_K, q6_K);
    SET(DT_F32, f32);
    SET(DT_F16, f16);
    SET(DT_BF16, bf16);
#undef SET
    /* A lone float token: the GEMV dot, one stream that the hardware
     * prefetcher follows, reads faster than 8 rows at once (decode on the
     * qwen3-0.6b shape, F16: 51 vs 62 ms). */
    strips[DT_F32][1] = NULL;
    strips[DT_F16][1] = NULL;
    strips[DT_BF16][1] = NULL;
    strips[DT_Q6_K][1] = strip_q6_K_pairs_1;
    heights[DT_Q6_K][1] = QUANT_H(1);
}

void quant_avx512_kernels(quant_dot_fn dots[DT_COUNT], quant_tile_fn tiles[DT_COUNT],
                          int *tile_rows, int *tile_cols) {
    dots[DT_F32] = dot_f32;
    dots[DT_F16] = dot_f16;
    dots[DT_BF16] = dot_bf16;
    dots[DT_Q4_0] = dot_q4_0;
    dots[DT_Q4_1] = dot_q4_1;
    dots[DT_Q5_0] = dot_q5_0;
    dots[DT_Q5_1] = dot_q5_1;
    dots[DT_Q8_0] = dot_q8_0;
    dots[DT_Q2_K] = dot_q2_K;
    dots[DT_Q3_K] = dot_q3_K;
    dots[DT_Q4_K] = dot_q4_K_gemv;
    dots[DT_Q5_K] = dot_q5_K;
    dots[DT_Q6_K] = dot_q6_K;
    tiles[DT_F32] = tile_f32;
    tiles[DT_F16] = tile_f16;
    tiles[DT_BF16] = tile_bf16;
    tiles[DT_Q4_0] = tile_q4_0;
    tiles[DT_Q4_1] = tile_q4_1;
    tiles[DT_Q5_0] = tile_q5_0;
    tiles[DT_Q5_1] = tile_q5_1;
    tiles[DT_Q8_0] = tile_q8_0;
    tiles[DT_Q2_K] = tile_q2_K;
    tiles[DT_Q3_K] = tile_q3_K;
    tiles[DT_Q4_K] = tile_q4_K;
    tiles[DT_Q5_K] = tile_q5_K;
    tiles[DT_Q6_K] = tile_q6_K;
    *tile_rows = TILE;
    *tile_cols = TILE;
}
