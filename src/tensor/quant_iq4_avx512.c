/* quant_iq4_avx512.c - AVX-512 (F/BW/VL + VNNI) dots and 4 x 4 matmul tiles
 * for IQ4_NL and IQ4_XS (see quant_iq4.h).
 *
 * Design: the nibbles index the 16-entry table with one pshufb per vector
 * (the table repeated in every 128-bit lane). Each block's exact integer
 * dot is then folded with quant.h's formula, the same as the scalar kernels,
 * so dots and tiles are bit-identical to them on every shape.
 *  - IQ4_NL (against Q8_0): the table is looked up shifted by +128, giving
 *    unsigned u = w + 128 for vpdpbusd; the offset is paid back with
 *    128 * sum(a) (one more vpdpbusd per activation block, shared by all the
 *    rows of a tile), as quant_avx512.c does for Q8_0.
 *  - IQ4_XS (against Q8_K): the sub-block scales ls - 32 multiply 32-element
 *    integer sums, so products go through pmaddubsw (16-bit pair sums) and
 *    vpdpwssd with the scale words. pmaddubsw takes |a| unsigned and w with
 *    a's sign: exact, since |a| <= 128 (Q8_K can hold -128), w >= -127 and
 *    2 * 128 * 127 < 2^15. |a| and a's sign mask depend on the token only,
 *    so a tile computes them once per super-block and token.
 *  - Tiles (4 weight rows x 4 tokens): each weight block is unpacked once and
 *    reused for 4 tokens; the 16 per-pair integer vectors are reduced
 *    together by a transpose-and-add tree and folded on 16 lanes with the
 *    scalar fold's operations (cvt, mul, fma). */
#include <immintrin.h>
#include <string.h>

#include "tensor/quant_iq4.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

enum { TILE = 4 };
/* Prefetch distance of the GEMV weight stream (as in quant_avx512.c). */
enum { GEMV_PREFETCH = 4096 };

ALWAYS_INLINE float load_f16(const void *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

ALWAYS_INLINE int32_t hsum256_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* 16 vectors of 8 lanes -> their 16 sums: out[0] = sums 0..7, out[1] = 8..15. */
ALWAYS_INLINE void reduce16_256(const __m256i t[16], __m256i out[2]) {
    __m256i u[8], w[4];
    UNROLL
    for (int k = 0; k < 8; k++)
        u[k] = _mm256_add_epi32(_mm256_unpacklo_epi32(t[2 * k], t[2 * k + 1]),
                                _mm256_unpackhi_epi32(t[2 * k], t[2 * k + 1]));
    UNROLL
    for (int k = 0; k < 4; k++)
        w[k] = _mm256_add_epi32(_mm256_unpacklo_epi64(u[2 * k], u[2 * k + 1]),
                                _mm256_unpackhi_epi64(u[2 * k], u[2 * k + 1]));
    UNROLL
    for (int k = 0; k < 2; k++)
        out[k] = _mm256_add_epi32(_mm256_permute2x128_si256(w[2 * k], w[2 * k + 1], 0x20),
                                  _mm256_permute2x128_si256(w[2 * k], w[2 * k + 1], 0x31));
}

/* 16 vectors of 16 lanes -> one vector of their 16 sums. */
ALWAYS_INLINE __m512i reduce16_512(const __m512i t[16]) {
    __m512i u[8], w[4];
    UNROLL
    for (int k = 0; k < 8; k++)
        u[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(t[2 * k], t[2 * k + 1]),
                                _mm512_unpackhi_epi32(t[2 * k], t[2 * k + 1]));
    UNROLL
    for (int k = 0; k < 4; k++)
        w[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(u[2 * k], u[2 * k + 1]),
                                _mm512_unpackhi_epi64(u[2 * k], u[2 * k + 1]));
    __m512i x0 = _mm512_add_epi32(_mm512_shuffle_i32x4(w[0], w[1], 0x88),
                                  _mm512_shuffle_i32x4(w[0], w[1], 0xdd));
    __m512i x1 = _mm512_add_epi32(_mm512_shuffle_i32x4(w[2], w[3], 0x88),
                                  _mm512_shuffle_i32x4(w[2], w[3], 0xdd));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(x0, x1, 0x88), _mm512_shuffle_i32x4(x0, x1, 0xdd));
}

/* ------------------------------------------------------------- IQ4_NL */

/* The table + 128 (0..241) in both lanes: unsigned weights for vpdpbusd. */
ALWAYS_INLINE __m256i table_u_256(void) {
    __m128i t = _mm_xor_si128(_mm_loadu_si128((const __m128i *)quant_iq4_values), _mm_set1_epi8((char)0x80));
    return _mm256_set_m128i(t, t);
}

/* u of one 32-element block, natural order. */
ALWAYS_INLINE __m256i unpack_nl(const uint8_t *qs, __m256i table_u) {
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    __m128i m = _mm_set1_epi8(15);
    __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
    return _mm256_shuffle_epi8(table_u, idx);
}

/* -128 * sum(a) of a 32-byte activation block, as 8 lanes. */
ALWAYS_INLINE __m256i neg_offset(__m256i av) {
    return _mm256_sub_epi32(_mm256_setzero_si256(),
                            _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)0x80), av));
}

static float dot_iq4_nl(int64_t n, const void *w, const void *a) {
    const block_iq4_nl *x = w;
    const block_q8_0 *y = a;
    const __m256i table_u = table_u_256();
    float acc = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        _mm_prefetch((const char *)(x + i) + GEMV_PREFETCH, _MM_HINT_T0);
        __m256i av = _mm256_loadu_si256((const __m256i *)y[i].qs);
        __m256i t = _mm256_dpbusd_epi32(neg_offset(av), unpack_nl(x[i].qs, table_u), av);
        acc = quant_fold(acc, hsum256_epi32(t), load_f16(&x[i].d), load_f16(&y[i].d));
    }
    return acc;
}

static void tile_iq4_nl(int64_t n, const void *w, size_t ws, const void *a, size_t as, float *yout,
                        size_t ys) {
    const uint8_t *x = w, *y = a;
    const __m256i table_u = table_u_256();
    const __m256i rows_lo = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i rows_hi = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 32; i++) {
        __m256i u[TILE], t[16];
        float dw[TILE], da[TILE];
        UNROLL
        for (int r = 0; r < TILE; r++) {
            const block_iq4_nl *b = (const block_iq4_nl *)(x + r * ws) + i;
            u[r] = unpack_nl(b->qs, table_u);
            dw[r] = load_f16(&b->d);
        }
        UNROLL
        for (int c = 0; c < TILE; c++) {
            const block_q8_0 *b = (const block_q8_0 *)(y + c * as) + i;
            __m256i av = _mm256_loadu_si256((const __m256i *)b->qs);
            __m256i neg = neg_offset(av);
            da[c] = load_f16(&b->d);
            UNROLL
            for (int r = 0; r < TILE; r++) t[r * TILE + c] = _mm256_dpbusd_epi32(neg, u[r], av);
        }
        __m256i isum[2];
        reduce16_256(t, isum);
        __m256 dw4 = _mm256_castps128_ps256(_mm_loadu_ps(dw));
        __m256 da8 = _mm256_broadcast_ps((const __m128 *)da);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[0]),
                               _mm256_mul_ps(_mm256_permutevar8x32_ps(dw4, rows_lo), da8), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[1]),
                               _mm256_mul_ps(_mm256_permutevar8x32_ps(dw4, rows_hi), da8), acc1);
    }
    float out[16];
    _mm256_storeu_ps(out, acc0);
    _mm256_storeu_ps(out + 8, acc1);
    UNROLL
    for (int r = 0; r < TILE; r++)
        UNROLL
        for (int c = 0; c < TILE; c++) yout[c * ys + r] = out[r * TILE + c];
}

/* ------------------------------------------------------------- IQ4_XS */

/* One super-block's weights: chunk k = sub-blocks 2k, 2k+1 (64 signed
 * values, natural order) and the scale of each 16-bit pair sum. */
typedef struct xs_block {
    __m512i w[4];
    __m512i sc[4];
    float d;
} xs_block;

ALWAYS_INLINE __m512i table_512(void) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)quant_iq4_values));
}

/* Word w of chunk k's scale vector is sub-block 2k + w / 16. */
ALWAYS_INLINE void xs_scale_index(__m512i idx[4]) {
    UNROLL
    for (int k = 0; k < 4; k++)
        idx[k] = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)(2 * k)),
                                         _mm512_set1_epi16((short)(2 * k + 1)));
}

/* The eight scales ls - 32 as int16 words 0..7. */
ALWAYS_INLINE __m128i xs_scales(const block_iq4_xs *b) {
    int16_t s[8];
    UNROLL
    for (int i = 0; i < 8; i++) s[i] = (int16_t)quant_iq4_xs_scale(b, i);
    return _mm_loadu_si128((const __m128i *)s);
}

ALWAYS_INLINE void unpack_xs(const block_iq4_xs *b, __m512i table, const __m512i idx[4], xs_block *xb) {
    const __m512i m4 = _mm512_set1_epi8(15);
    UNROLL
    for (int h = 0; h < 2; h++) {
        /* 64 bytes = sub-blocks 4h..4h+3; lanes of lo/hi: one sub-block each */
        __m512i q = _mm512_loadu_si512(b->qs + 64 * h);
        __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        /* sub-block s = (lo lane s, hi lane s): chunk 2h gets lanes 0, 1, chunk 2h + 1 lanes 2, 3 */
        __m512i c0 = _mm512_shuffle_i64x2(lo, hi, 0x44); /* lo0 lo1 hi0 hi1 */
        __m512i c1 = _mm512_shuffle_i64x2(lo, hi, 0xee); /* lo2 lo3 hi2 hi3 */
        c0 = _mm512_shuffle_i64x2(c0, c0, 0xd8);         /* lo0 hi0 lo1 hi1 */
        c1 = _mm512_shuffle_i64x2(c1, c1, 0xd8);
        xb->w[2 * h] = _mm512_shuffle_epi8(table, c0);
        xb->w[2 * h + 1] = _mm512_shuffle_epi8(table, c1);
    }
    __m512i s = _mm512_castsi128_si512(xs_scales(b));
    UNROLL
    for (int k = 0; k < 4; k++) xb->sc[k] = _mm512_permutexvar_epi16(idx[k], s);
    xb->d = load_f16(&b->d);
}

/* An activation chunk in the form the products need: |a| and a's signs. */
typedef struct xs_act {
    __m512i abs_a[4];
    __mmask64 neg[4];
} xs_act;

ALWAYS_INLINE void prepare_act(const int8_t *q8, xs_act *p) {
    UNROLL
    for (int k = 0; k < 4; k++) {
        __m512i av = _mm512_loadu_si512(q8 + 64 * k);
        p->abs_a[k] = _mm512_abs_epi8(av);
        p->neg[k] = _mm512_movepi8_mask(av);
    }
}

/* sum over sub-blocks of (ls - 32) * (w . a), lanes not yet reduced. */
ALWAYS_INLINE __m512i xs_lanes(const xs_block *xb, const xs_act *p) {
    __m512i acc = _mm512_setzero_si512();
    UNROLL
    for (int k = 0; k < 4; k++) {
        __m512i ws = _mm512_mask_sub_epi8(xb->w[k], p->neg[k], _mm512_setzero_si512(), xb->w[k]);
        acc = _mm512_dpwssd_epi32(acc, _mm512_maddubs_epi16(p->abs_a[k], ws), xb->sc[k]);
    }
    return acc;
}

static float dot_iq4_xs(int64_t n, const void *w, const void *a) {
    const block_iq4_xs *x = w;
    const block_q8_K *y = a;
    const __m512i table = table_512();
    __m512i idx[4];
    xs_scale_index(idx);
    float acc = 0;
    for (int64_t i = 0; i < n / 256; i++) {
        for (size_t off = 0; off < sizeof(block_iq4_xs); off += 64)
            _mm_prefetch((const char *)(x + i) + GEMV_PREFETCH + off, _MM_HINT_T0);
        xs_block xb;
        xs_act p;
        unpack_xs(&x[i], table, idx, &xb);
        prepare_act(y[i].qs, &p);
        acc = quant_fold(acc, _mm512_reduce_add_epi32(xs_lanes(&xb, &p)), xb.d, y[i].d);
    }
    return acc;
}

static void tile_iq4_xs(int64_t n, const void *w, size_t ws, const void *a, size_t as, float *yout,
                        size_t ys) {
    const uint8_t *x = w, *y = a;
    const __m512i table = table_512();
    __m512i idx[4];
    xs_scale_index(idx);
    /* pair p = 4r + c: its row and token for the fold's permutes */
    const __m512i row_of = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i tok_of = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        xs_act act[TILE];
        float dw[TILE], da[TILE];
        UNROLL
        for (int c = 0; c < TILE; c++) {
            const block_q8_K *yb = (const block_q8_K *)(y + c * as) + i;
            prepare_act(yb->qs, &act[c]);
            da[c] = yb->d;
        }
        __m512i t[16];
        UNROLL
        for (int r = 0; r < TILE; r++) {
            xs_block xb;
            unpack_xs((const block_iq4_xs *)(x + r * ws) + i, table, idx, &xb);
            dw[r] = xb.d;
            UNROLL
            for (int c = 0; c < TILE; c++) t[r * TILE + c] = xs_lanes(&xb, &act[c]);
        }
        __m512i isum = reduce16_512(t);
        __m512 dw16 = _mm512_permutexvar_ps(row_of, _mm512_castps128_ps512(_mm_loadu_ps(dw)));
        __m512 da16 = _mm512_permutexvar_ps(tok_of, _mm512_castps128_ps512(_mm_loadu_ps(da)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw16, da16), acc);
    }
    float out[16];
    _mm512_storeu_ps(out, acc);
    UNROLL
    for (int r = 0; r < TILE; r++)
        UNROLL
        for (int c = 0; c < TILE; c++) yout[c * ys + r] = out[r * TILE + c];
}

void quant_iq4_avx512_kernels(quant_dot_fn dots[DT_COUNT], quant_tile_fn tiles[DT_COUNT],
                              int tile_rows, int tile_cols) {
    dots[DT_IQ4_NL] = dot_iq4_nl;
    dots[DT_IQ4_XS] = dot_iq4_xs;
    /* matmul.c runs one tile shape per ISA; these tiles are 4 x 4. */
    if (tile_rows == TILE && tile_cols == TILE) {
        tiles[DT_IQ4_NL] = tile_iq4_nl;
        tiles[DT_IQ4_XS] = tile_iq4_xs;
    }
}
