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
 *    scalar fold's operations (cvt, mul, fma). matmul.c uses them for
 *    batches below the panel size and for ragged rows.
 *  - Row panels (batches of 8+ tokens, matmul_avx512.c's scheme): 16 rows
 *    are repacked so one zmm holds the same 4 elements of every row, as
 *    u = w + 128; a vpdpbusd with 4 broadcast activation bytes then adds
 *    each row's partial dot in its own lane, with no reduction. IQ4_NL
 *    packs into the Q8_0 panel and reuses its kernel; IQ4_XS scales each
 *    32-element sub-block sum with vpmulld and pays the +128 back through
 *    the Q8_K bsums. */
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#include "tensor/quant_iq4.h"
#include "tensor/quant_avx512_reduce.h"

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

/* ------------------------------------------------- row panels (prefill) */

/* IQ4_NL: the Q8_0 panel layout of matmul_avx512.c (per block: 8 zmm, dword
 * j of zmm j holding elements 4j..4j+3 of the 16 rows, one row per 32-bit
 * lane, stored as u = w + 128; then the 16 row scales as f32), so the Q8_0
 * panel kernel and its -128 * sum(a) metadata apply unchanged. */
void quant_iq4_nl_pack_panel(const uint8_t *w, size_t wrb, int64_t nb, uint8_t *pk) {
    const __m256i table_u = table_u_256();
    for (int64_t b = 0; b < nb; b++, pk += IQ4_NL_PANEL_BLOCK) {
        float *d = (float *)(pk + 512);
        for (int r = 0; r < 16; r++) {
            const block_iq4_nl *blk = (const block_iq4_nl *)(w + (size_t)r * wrb) + b;
            uint32_t u[8];
            _mm256_storeu_si256((__m256i *)u, unpack_nl(blk->qs, table_u));
            UNROLL
            for (int j = 0; j < 8; j++) memcpy(pk + 64 * j + 4 * r, &u[j], 4);
            d[r] = load_f16(&blk->d);
        }
    }
}

/* IQ4_XS panel super-block: 64 zmm of u = w + 128 dwords in natural element
 * order (dword q = elements 4q..4q+3, sub-block s = dwords 8s..8s+7), 8 zmm
 * of int32 sub-block scales ls - 32, 8 zmm of int16 (scale, scale) pairs for
 * the Q8_K bsums, d. isum = sum_s sc_s * dot(u, a)_s - 128 * sum_s sc_s *
 * (bsum_2s + bsum_2s+1): dot_iq4_xs's integer. */
enum { XS_PANEL_BLOCK = (64 + 8 + 8 + 1) * 64 };

static void pack_xs(const uint8_t *w, size_t wrb, int64_t nb, uint8_t *pk) {
    const __m512i table = table_512(), flip = _mm512_set1_epi8((char)0x80);
    __m512i idx[4];
    xs_scale_index(idx);
    for (int64_t b = 0; b < nb; b++, pk += XS_PANEL_BLOCK) {
        int32_t *sc = (int32_t *)(pk + 64 * 64), *pairs = (int32_t *)(pk + 72 * 64);
        float *d = (float *)(pk + 80 * 64);
        for (int r = 0; r < 16; r++) {
            const block_iq4_xs *blk = (const block_iq4_xs *)(w + (size_t)r * wrb) + b;
            xs_block xb;
            unpack_xs(blk, table, idx, &xb);
            uint32_t u[64];
            UNROLL
            for (int k = 0; k < 4; k++) _mm512_storeu_si512(u + 16 * k, _mm512_xor_si512(xb.w[k], flip));
            for (int q = 0; q < 64; q++) memcpy(pk + 64 * q + 4 * r, &u[q], 4);
            for (int s = 0; s < 8; s++) {
                int v = quant_iq4_xs_scale(blk, s);
                sc[16 * s + r] = v;
                pairs[16 * s + r] = (int32_t)((uint32_t)(uint16_t)(int16_t)v | ((uint32_t)(uint16_t)(int16_t)v << 16));
            }
            d[r] = xb.d;
        }
    }
}

ALWAYS_INLINE int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

ALWAYS_INLINE void xs_panel(const int T, int64_t nb, const uint8_t *pk, const uint8_t *act, size_t as, float *y,
                            size_t ys) {
    __m512 facc[8];
    UNROLL
    for (int t = 0; t < T; t++) facc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, pk += XS_PANEL_BLOCK) {
        const __m512i *uw = (const __m512i *)pk, *sc = uw + 64, *pairs = uw + 72;
        __m512i isum[8];
        UNROLL
        for (int t = 0; t < T; t++) isum[t] = _mm512_setzero_si512();
        for (int s = 0; s < 8; s++) {
            __m512i w[8];
            UNROLL
            for (int j = 0; j < 8; j++) w[j] = _mm512_load_si512(uw + 8 * s + j);
            __m512i scs = _mm512_load_si512(sc + s);
            UNROLL
            for (int t = 0; t < T; t++) {
                const uint8_t *a = act + t * as + b * sizeof(block_q8_K) + offsetof(block_q8_K, qs) + 32 * s;
                __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
                UNROLL
                for (int j = 0; j < 8; j += 2) {
                    acc0 = _mm512_dpbusd_epi32(acc0, w[j], _mm512_set1_epi32(load_i32(a + 4 * j)));
                    acc1 = _mm512_dpbusd_epi32(acc1, w[j + 1], _mm512_set1_epi32(load_i32(a + 4 * j + 4)));
                }
                isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(_mm512_add_epi32(acc0, acc1), scs));
            }
        }
        __m512 dw = _mm512_load_ps((const float *)(uw + 80));
        UNROLL
        for (int t = 0; t < T; t++) {
            const uint8_t *ab = act + t * as + b * sizeof(block_q8_K);
            const uint8_t *bs = ab + offsetof(block_q8_K, bsums);
            __m512i csum = _mm512_setzero_si512();
            UNROLL
            for (int s = 0; s < 8; s++)
                csum = _mm512_dpwssd_epi32(csum, _mm512_load_si512(pairs + s), _mm512_set1_epi32(load_i32(bs + 4 * s)));
            __m512i tot = _mm512_sub_epi32(isum[t], _mm512_slli_epi32(csum, 7));
            float da;
            memcpy(&da, ab, 4);
            facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_mul_ps(dw, _mm512_set1_ps(da)), facc[t]);
        }
    }
    UNROLL
    for (int t = 0; t < T; t++) _mm512_storeu_ps(y + t * ys, facc[t]);
}

#define XS_PANEL_T(N)                                                                                        \
    static void xs_panel_##N(int64_t nb, const uint8_t *pk, const uint8_t *act, size_t as, float *y, size_t ys) { \
        xs_panel(N, nb, pk, act, as, y, ys);                                                                 \
    }
XS_PANEL_T(1) XS_PANEL_T(2) XS_PANEL_T(3) XS_PANEL_T(4)
XS_PANEL_T(5) XS_PANEL_T(6) XS_PANEL_T(7) XS_PANEL_T(8)

typedef void (*xs_panel_fn)(int64_t, const uint8_t *, const uint8_t *, size_t, float *, size_t);
static const xs_panel_fn xs_panels[9] = {NULL, xs_panel_1, xs_panel_2, xs_panel_3, xs_panel_4,
                                         xs_panel_5, xs_panel_6, xs_panel_7, xs_panel_8};

size_t quant_iq4_xs_panel_bytes(int64_t n_in) { return (size_t)(n_in / 256) * XS_PANEL_BLOCK; }

void quant_iq4_xs_panels(const uint8_t *w, size_t wrb, int64_t n_in, int64_t o0, int64_t o1, const uint8_t *act,
                         size_t as, int64_t n_tokens, float *y, int64_t n_out, uint8_t *pk) {
    enum { TB = 8 };
    int64_t nb = n_in / 256;
    for (int64_t o = o0; o + 16 <= o1; o += 16) {
        pack_xs(w + (size_t)o * wrb, wrb, nb, pk);
        for (int64_t t = 0; t < n_tokens; t += TB) {
            int64_t n = n_tokens - t < TB ? n_tokens - t : TB;
            xs_panels[n](nb, pk, act + (size_t)t * as, as, y + t * n_out + o, (size_t)n_out);
        }
    }
}
