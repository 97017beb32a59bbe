/* matmul_avx512.c - AVX-512 VNNI "row panel" GEMM for batches (prefill).
 *
 * The 4x4 tiles of quant_avx512.c compute one integer vector per
 * (row, token) and then reduce 16 of them horizontally per block, which
 * costs about as much as the products themselves. Here 16 weight rows are
 * first repacked ("a panel") so that one zmm holds the same 4 bytes of all
 * 16 rows, one row per 32-bit lane; a vpdpbusd with 4 activation bytes
 * broadcast then adds the partial dot of each row into its own lane, so a
 * block's 16 exact integer dots end up in one register with no reduction.
 *
 * Bit-identity: per (row, token) every block still yields the same exact
 * integer dot, and it is folded with the same float operations in the same
 * block order as quant_vec_dot (quant.h: quant_fold / quant_fold_min, one
 * lane per row: cvt, dw * da, fma), so results do not depend on n_tokens or
 * on the thread split.
 *
 * Q8_0: weights are stored unsigned (q + 128); the 128 * sum(a) excess of
 * each activation block comes from matmul.c's per-block metadata
 * (matmul_q8_meta: -128 * sum(a) and the f32 scale).
 * Q4_K: the nibbles (0..15) are unsigned already; sub-block dots are scaled
 * with vpmulld, mins go through the Q8_K bsums with vpdpwssd.
 * Q6_K: u = q + 32 per 16-element sub-block, scaled with vpmulld; the
 * -32 offset through the bsums (vpdpwssd with scale pairs).
 * F32 / F16 / BF16: no integer dot; the panel holds the rows converted to
 * f32 once per call (per token block; F16 rows are copied as they are, in
 * groups of up to 64 rows, and converted as loaded), and 4 x 6 register
 * tiles redo the float dot's own two accumulator chains (see "F32, F16,
 * BF16" below) on f32 activations.
 * Where the CPU has AVX512_BF16, BF16 weights go to bf16_avx512bf16.c
 * instead (activations rounded to BF16, vdpbf16ps: docs/engine-bench.md,
 * "F16 and BF16 weights in batches"). */
#include <immintrin.h>
#include <string.h>

#include "tensor/quant.h"
#include "tensor/quant_avx512_reduce.h"
#include "tensor/quant_iq4.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

enum { PANEL = 16, Q8_PANEL_BLOCK = 8 * 64 + 64, Q4K_PANEL_BLOCK = (32 + 8 + 8 + 2) * 64,
       Q6K_PANEL_BLOCK = (64 + 8 + 1) * 64 };

ALWAYS_INLINE __m512i row_offsets(size_t wrb) {
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_epi32((int)wrb));
}

ALWAYS_INLINE __m512 gather_f16(__m512i idx, const uint8_t *base) {
    __m512i v = _mm512_i32gather_epi32(idx, (const void *)base, 1);
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v));
}

ALWAYS_INLINE int32_t load_i32(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}
ALWAYS_INLINE float load_f32(const void *p) {
    float v;
    memcpy(&v, p, 4);
    return v;
}

/* Float panels: 16-element chunks, the last one zero-padded. */
static int64_t float_chunks(int64_t n_in) { return (n_in + 15) / 16; }

_Static_assert((int)IQ4_NL_PANEL_BLOCK == (int)Q8_PANEL_BLOCK, "IQ4_NL packs into the Q8_0 panel");

/* F16 groups (see "F32, F16, BF16"): as many 16-row panels as keep the
 * packed copy within F16_GROUP_BYTES (L2 holds it while every token tile
 * passes over it), at most F16_GROUP_MAX rows (the accumulators parked
 * between K blocks, 3 KB per 4 rows, stay near L1). Where two copies fit in
 * F16_PIPE_BYTES the next group is packed while the current one computes
 * (double buffer); otherwise (8192-wide rows: 32 rows, 512 KB) each group
 * is packed before its tiles run. */
enum { F16_GROUP_MAX = 64, F16_GROUP_BYTES = 512 << 10, F16_PIPE_BYTES = 512 << 10 };
static int64_t f16_group_rows(int64_t n_in) {
    int64_t g = (int64_t)(F16_GROUP_BYTES / (n_in * 2)) / 16 * 16;
    return g < 16 ? 16 : g > F16_GROUP_MAX ? F16_GROUP_MAX : g;
}
static size_t f16_group_bytes(int64_t n_in) { return (size_t)f16_group_rows(n_in) * (size_t)(n_in / 16) * 32; }
static int f16_pipelined(int64_t n_in) { return 2 * f16_group_bytes(n_in) <= F16_PIPE_BYTES; }

size_t matmul_avx512_panel_bytes(ember_dtype type, int64_t n_in) {
    if (type == DT_Q8_0 || type == DT_IQ4_NL) return (size_t)(n_in / 32) * Q8_PANEL_BLOCK;
    if (type == DT_IQ4_XS) return quant_iq4_xs_panel_bytes(n_in);
    if (type == DT_Q4_K) return (size_t)(n_in / 256) * Q4K_PANEL_BLOCK;
    if (type == DT_Q6_K) return (size_t)(n_in / 256) * Q6K_PANEL_BLOCK;
    if (type == DT_BF16 && quant_dot_act(DT_BF16) == DT_BF16) return matmul_bf16dp_panel_bytes(n_in);
    if (type == DT_F16) return (f16_pipelined(n_in) ? 2 : 1) * f16_group_bytes(n_in) + 64;
    if (type == DT_F32 || type == DT_BF16) return (size_t)float_chunks(n_in) * PANEL * 64;
    return 0;
}

/* ------------------------------------------------------------------ Q8_0 */

static void pack_q8_0(const uint8_t *w, size_t wrb, int64_t nb, uint8_t *pk) {
    const __m512i idx = row_offsets(wrb), flip = _mm512_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nb; b++, pk += Q8_PANEL_BLOCK) {
        const uint8_t *base = w + b * 34;
        UNROLL
        for (int j = 0; j < 8; j++) {
            __m512i v = _mm512_i32gather_epi32(idx, (const void *)(base + 2 + 4 * j), 1);
            _mm512_store_si512((__m512i *)(pk + 64 * j), _mm512_xor_si512(v, flip));
        }
        _mm512_store_ps((float *)(pk + 512), gather_f16(idx, base));
    }
}

/* T tokens against one packed panel, the whole reduction. */
ALWAYS_INLINE void q8_0_panel(const int T, int64_t nb, const uint8_t *pk, const uint8_t *act, size_t as,
                              const int32_t *meta, size_t ms, float *y, size_t ys) {
    __m512 facc[8];
    UNROLL
    for (int t = 0; t < T; t++) facc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, pk += Q8_PANEL_BLOCK) {
        __m512i w[8];
        UNROLL
        for (int j = 0; j < 8; j++) w[j] = _mm512_load_si512((const __m512i *)(pk + 64 * j));
        __m512 dw = _mm512_load_ps((const float *)(pk + 512));
        UNROLL
        for (int t = 0; t < T; t++) {
            const uint8_t *a = act + t * as + b * 34 + 2;
            const int32_t *m = meta + t * ms + 2 * b;
            __m512i acc0 = _mm512_set1_epi32(m[0]), acc1 = _mm512_setzero_si512();
            UNROLL
            for (int j = 0; j < 8; j += 2) {
                acc0 = _mm512_dpbusd_epi32(acc0, w[j], _mm512_set1_epi32(load_i32(a + 4 * j)));
                acc1 = _mm512_dpbusd_epi32(acc1, w[j + 1], _mm512_set1_epi32(load_i32(a + 4 * j + 4)));
            }
            __m512i isum = _mm512_add_epi32(acc0, acc1);
            facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum),
                                      _mm512_mul_ps(dw, _mm512_set1_ps(load_f32(m + 1))), facc[t]);
        }
    }
    UNROLL
    for (int t = 0; t < T; t++) _mm512_storeu_ps(y + t * ys, facc[t]);
}

#define Q8_PANEL_T(N)                                                                           \
    static void q8_0_panel_##N(int64_t nb, const uint8_t *pk, const uint8_t *act, size_t as,    \
                               const int32_t *meta, size_t ms, float *y, size_t ys) {           \
        q8_0_panel(N, nb, pk, act, as, meta, ms, y, ys);                                        \
    }
Q8_PANEL_T(1) Q8_PANEL_T(2) Q8_PANEL_T(3) Q8_PANEL_T(4)
Q8_PANEL_T(5) Q8_PANEL_T(6) Q8_PANEL_T(7) Q8_PANEL_T(8)

typedef void (*q8_panel_fn)(int64_t, const uint8_t *, const uint8_t *, size_t, const int32_t *, size_t,
                            float *, size_t);
static const q8_panel_fn q8_panels[9] = {NULL, q8_0_panel_1, q8_0_panel_2, q8_0_panel_3, q8_0_panel_4,
                                         q8_0_panel_5, q8_0_panel_6, q8_0_panel_7, q8_0_panel_8};

/* ------------------------------------------------------------------ Q4_K */

/* Panel super-block: 32 zmm raw nibble bytes (group g, dword j), 8 zmm
 * int32 scales, 8 zmm int16 (min, min) pairs, d, dmin. */
static void pack_q4_K(const uint8_t *w, size_t wrb, int64_t nb, uint8_t *pk) {
    const __m512i idx = row_offsets(wrb);
    for (int64_t b = 0; b < nb; b++, pk += Q4K_PANEL_BLOCK) {
        const uint8_t *base = w + b * sizeof(block_q4_K);
        UNROLL
        for (int j = 0; j < 32; j++) {
            __m512i v = _mm512_i32gather_epi32(idx, (const void *)(base + offsetof(block_q4_K, qs) + 4 * j), 1);
            _mm512_store_si512((__m512i *)(pk + 64 * j), v);
        }
        int32_t *sc = (int32_t *)(pk + 32 * 64), *mn = (int32_t *)(pk + 40 * 64);
        for (int r = 0; r < PANEL; r++) {
            const block_q4_K *blk = (const block_q4_K *)(base + r * wrb);
            for (int k = 0; k < 8; k++) {
                uint8_t s, m;
                quant_k4_scale_min(k, blk->scales, &s, &m);
                sc[16 * k + r] = s;
                mn[16 * k + r] = (int32_t)((uint32_t)m | ((uint32_t)m << 16));
            }
        }
        _mm512_store_ps((float *)(pk + 48 * 64), gather_f16(idx, base + offsetof(block_q4_K, d)));
        _mm512_store_ps((float *)(pk + 49 * 64), gather_f16(idx, base + offsetof(block_q4_K, dmin)));
    }
}

ALWAYS_INLINE void q4_K_panel(const int T, int64_t nb, const uint8_t *pk, const uint8_t *act, size_t as,
                              float *y, size_t ys) {
    const __m512i m4 = _mm512_set1_epi8(15);
    __m512 facc[8];
    UNROLL
    for (int t = 0; t < T; t++) facc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, pk += Q4K_PANEL_BLOCK) {
        const __m512i *raw = (const __m512i *)pk, *sc = raw + 32, *mn = raw + 40;
        __m512i isum[8];
        UNROLL
        for (int t = 0; t < T; t++) isum[t] = _mm512_setzero_si512();
        for (int k = 0; k < 8; k++) {
            __m512i w[8];
            UNROLL
            for (int j = 0; j < 8; j++) {
                __m512i r = _mm512_load_si512(raw + 8 * (k >> 1) + j);
                w[j] = (k & 1) ? _mm512_and_si512(_mm512_srli_epi16(r, 4), m4) : _mm512_and_si512(r, m4);
            }
            __m512i sck = _mm512_load_si512(sc + k);
            UNROLL
            for (int t = 0; t < T; t++) {
                const uint8_t *a = act + t * as + b * sizeof(block_q8_K) + offsetof(block_q8_K, qs) + 32 * k;
                __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
                UNROLL
                for (int j = 0; j < 8; j += 2) {
                    acc0 = _mm512_dpbusd_epi32(acc0, w[j], _mm512_set1_epi32(load_i32(a + 4 * j)));
                    acc1 = _mm512_dpbusd_epi32(acc1, w[j + 1], _mm512_set1_epi32(load_i32(a + 4 * j + 4)));
                }
                isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(_mm512_add_epi32(acc0, acc1), sck));
            }
        }
        __m512 dw = _mm512_load_ps((const float *)(raw + 48)), dmw = _mm512_load_ps((const float *)(raw + 49));
        UNROLL
        for (int t = 0; t < T; t++) {
            const uint8_t *ab = act + t * as + b * sizeof(block_q8_K);
            const uint8_t *bs = ab + offsetof(block_q8_K, bsums);
            __m512i msum = _mm512_setzero_si512();
            UNROLL
            for (int k = 0; k < 8; k++)
                msum = _mm512_dpwssd_epi32(msum, _mm512_load_si512(mn + k), _mm512_set1_epi32(load_i32(bs + 4 * k)));
            __m512 da = _mm512_set1_ps(load_f32(ab));
            facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(dw, da), facc[t]);
            facc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(dmw, da), facc[t]);
        }
    }
    UNROLL
    for (int t = 0; t < T; t++) _mm512_storeu_ps(y + t * ys, facc[t]);
}

#define Q4K_PANEL_T(N)                                                                          \
    static void q4_K_panel_##N(int64_t nb, const uint8_t *pk, const uint8_t *act, size_t as,    \
                               float *y, size_t ys) {                                           \
        q4_K_panel(N, nb, pk, act, as, y, ys);                                                  \
    }
Q4K_PANEL_T(1) Q4K_PANEL_T(2) Q4K_PANEL_T(3) Q4K_PANEL_T(4)
Q4K_PANEL_T(5) Q4K_PANEL_T(6) Q4K_PANEL_T(7) Q4K_PANEL_T(8)

typedef void (*q4k_panel_fn)(int64_t, const uint8_t *, const uint8_t *, size_t, float *, size_t);
static const q4k_panel_fn q4k_panels[9] = {NULL, q4_K_panel_1, q4_K_panel_2, q4_K_panel_3, q4_K_panel_4,
                                           q4_K_panel_5, q4_K_panel_6, q4_K_panel_7, q4_K_panel_8};

/* ------------------------------------------------------------------ Q6_K */

/* Panel super-block: 64 zmm of u = q + 32 (0..63) dwords in natural element
 * order (sub-block k of 16 elements = dwords 4k..4k+3), 8 zmm of int16
 * (scale 2i, scale 2i+1) pairs, d. isum = sum_k sc_k * dot(u, a)_k
 * - 32 * sum_k sc_k * bsum_k: the same integer as dot_q6_K's. */
static void pack_q6_K(const uint8_t *w, size_t wrb, int64_t nb, uint8_t *pk) {
    for (int64_t b = 0; b < nb; b++, pk += Q6K_PANEL_BLOCK) {
        uint32_t *u32 = (uint32_t *)pk;
        int32_t *scp = (int32_t *)(pk + 64 * 64);
        float *d = (float *)(pk + 72 * 64);
        for (int r = 0; r < PANEL; r++) {
            const block_q6_K *x = (const block_q6_K *)(w + r * wrb) + b;
            uint8_t u[256];
            for (int h = 0; h < 2; h++) {
                const uint8_t *ql = x->ql + 64 * h, *qh = x->qh + 32 * h;
                uint8_t *o = u + 128 * h;
                for (int l = 0; l < 32; l++) {
                    o[l] = (uint8_t)((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4));
                    o[l + 32] = (uint8_t)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4));
                    o[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                    o[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                }
            }
            for (int q = 0; q < 64; q++) memcpy(&u32[16 * q + r], u + 4 * q, 4);
            for (int i = 0; i < 8; i++)
                scp[16 * i + r] = (int32_t)((uint32_t)(uint16_t)(int16_t)x->scales[2 * i] |
                                            ((uint32_t)(uint16_t)(int16_t)x->scales[2 * i + 1] << 16));
            d[r] = quant_f16_to_f32(x->d);
        }
    }
}

ALWAYS_INLINE void q6_K_panel(const int T, int64_t nb, const uint8_t *pk, const uint8_t *act, size_t as,
                              float *y, size_t ys) {
    __m512 facc[8];
    UNROLL
    for (int t = 0; t < T; t++) facc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, pk += Q6K_PANEL_BLOCK) {
        const __m512i *uw = (const __m512i *)pk, *scp = uw + 64;
        __m512i isum[8];
        UNROLL
        for (int t = 0; t < T; t++) isum[t] = _mm512_setzero_si512();
        for (int k = 0; k < 16; k++) {
            __m512i w[4];
            UNROLL
            for (int j = 0; j < 4; j++) w[j] = _mm512_load_si512(uw + 4 * k + j);
            /* sub-block k's scale: word k & 1 of pair k >> 1, sign-extended */
            __m512i pair = _mm512_load_si512(scp + (k >> 1));
            __m512i sck = (k & 1) ? _mm512_srai_epi32(pair, 16) : _mm512_srai_epi32(_mm512_slli_epi32(pair, 16), 16);
            UNROLL
            for (int t = 0; t < T; t++) {
                const uint8_t *a = act + t * as + b * sizeof(block_q8_K) + offsetof(block_q8_K, qs) + 16 * k;
                __m512i acc0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(load_i32(a)));
                __m512i acc1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(load_i32(a + 4)));
                acc0 = _mm512_dpbusd_epi32(acc0, w[2], _mm512_set1_epi32(load_i32(a + 8)));
                acc1 = _mm512_dpbusd_epi32(acc1, w[3], _mm512_set1_epi32(load_i32(a + 12)));
                isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(_mm512_add_epi32(acc0, acc1), sck));
            }
        }
        __m512 dw = _mm512_load_ps((const float *)(uw + 72));
        UNROLL
        for (int t = 0; t < T; t++) {
            const uint8_t *ab = act + t * as + b * sizeof(block_q8_K);
            const uint8_t *bs = ab + offsetof(block_q8_K, bsums);
            __m512i csum = _mm512_setzero_si512();
            UNROLL
            for (int i = 0; i < 8; i++)
                csum = _mm512_dpwssd_epi32(csum, _mm512_load_si512(scp + i), _mm512_set1_epi32(load_i32(bs + 4 * i)));
            __m512i tot = _mm512_sub_epi32(isum[t], _mm512_slli_epi32(csum, 5));
            facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_mul_ps(dw, _mm512_set1_ps(load_f32(ab))), facc[t]);
        }
    }
    UNROLL
    for (int t = 0; t < T; t++) _mm512_storeu_ps(y + t * ys, facc[t]);
}

#define Q6K_PANEL_T(N)                                                                          \
    static void q6_K_panel_##N(int64_t nb, const uint8_t *pk, const uint8_t *act, size_t as,    \
                               float *y, size_t ys) {                                           \
        q6_K_panel(N, nb, pk, act, as, y, ys);                                                  \
    }
Q6K_PANEL_T(1) Q6K_PANEL_T(2) Q6K_PANEL_T(3) Q6K_PANEL_T(4)
Q6K_PANEL_T(5) Q6K_PANEL_T(6) Q6K_PANEL_T(7) Q6K_PANEL_T(8)

static const q4k_panel_fn q6k_panels[9] = {NULL, q6_K_panel_1, q6_K_panel_2, q6_K_panel_3, q6_K_panel_4,
                                           q6_K_panel_5, q6_K_panel_6, q6_K_panel_7, q6_K_panel_8};

/* ------------------------------------------------------- F32, F16, BF16 */

/* Float weights: FLOAT_DOT (quant_avx512.c) sums a row in two 16-lane
 * accumulators, acc0 over the even full 16-element chunks in order, acc1 over
 * the odd ones and then the zero-masked tail, and returns
 * _mm512_reduce_add_ps(acc0 + acc1). The two chains are independent, so they
 * may be run one after the other: the panel converts its 16 rows once (the
 * exact f32 values LOAD_F16 / LOAD_BF16 give) into FR-row micro-panels laid
 * out chunk by chunk, even chunks first, then odd ones, then the tail padded
 * with zeros, and an FR x FC register tile runs the even chain of FR * FC
 * (row, token) pairs, then the odd chain, with one accumulator per pair. Per
 * chunk a tile loads FR weight and FC activation vectors for FR * FC fmas,
 * and no weight is converted more than once per call: the conversion the
 * dot pays per product is paid once per panel for all tokens. Every pair
 * gets the dot's operations in the dot's order (a padded weight lane is 0,
 * as the dot's masked load gives, times a masked activation 0), hence its
 * bits, for any n_tokens and any row split. */
enum { FR = 4, FC = 6, FLOAT_MICRO = PANEL / FR };
_Static_assert(FR == 4 && FC <= 6, "store_tile_sums_4xC's tile shape");

ALWAYS_INLINE __m512 float_load(ember_dtype type, const uint8_t *row, int64_t i, __mmask16 m) {
    if (type == DT_F32) return _mm512_maskz_loadu_ps(m, (const float *)row + i);
    __m256i h = _mm256_maskz_loadu_epi16(m, row + 2 * i);
    if (type == DT_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* F16 weights (HALF) stay F16 in their group copy (below): the tile
 * converts each weight vector as it loads it (vcvtph2ps, exact, the value
 * LOAD_F16 gives), beside the FMAs (4 per 24) on this CPU, and the copy is
 * half the bytes of an f32 panel. A weight vector (row r, chain step j) is
 * at mp + r * rs + j * cs: f32 panel, rs = 16 elements and cs = FR * 16;
 * F16 group, rs = 32 bytes and cs = FR * 32. */
ALWAYS_INLINE __m512 panel_load(const int HALF, const uint8_t *p) {
    return HALF ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)) : _mm512_load_ps((const float *)p);
}
ALWAYS_INLINE __m512 panel_load_masked(const int HALF, const uint8_t *p, __mmask16 m) {
    return HALF ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)) : _mm512_maskz_loadu_ps(m, (const float *)p);
}

/* Micro-panel m of the packed panel: chunk slot j, row r at ((m * nch + j) * FR + r) * 16 elements.
 * Chunk by chunk over all 16 rows: 16 streams in flight, each prefetched a
 * few lines ahead, instead of one row at a time at one stream's pace. */
ALWAYS_INLINE void pack_float_t(ember_dtype type, const uint8_t *w, size_t wrb, int64_t n_in, uint8_t *pk) {
    const int PS = 4;
    const int64_t nfull = n_in / 16, ne = (nfull + 1) / 2, nch = float_chunks(n_in);
    const int es = type == DT_F32 ? 4 : 2, ahead = 8 * 64;
    for (int64_t k = 0; k < nfull; k++) {
        int64_t slot = (k & 1) ? ne + k / 2 : k / 2;
        UNROLL
        for (int row = 0; row < PANEL; row++) {
            const uint8_t *src = w + (size_t)row * wrb;
            if (((16 * k * es) & 63) == 0) _mm_prefetch((const char *)src + 16 * k * es + ahead, _MM_HINT_T0);
            uint8_t *mp = pk + ((size_t)(row / FR) * nch * FR + (size_t)slot * FR + (size_t)(row % FR)) * 16 * PS;
            _mm512_store_ps((float *)mp, float_load(type, src, 16 * k, 0xffff));
        }
    }
    if (nfull < nch)
        for (int row = 0; row < PANEL; row++) {
            uint8_t *mp = pk + ((size_t)(row / FR) * nch * FR + (size_t)nfull * FR + (size_t)(row % FR)) * 16 * PS;
            __mmask16 m = (__mmask16)((1u << (n_in - 16 * nfull)) - 1);
            _mm512_store_ps((float *)mp, float_load(type, w + (size_t)row * wrb, 16 * nfull, m));
        }
}

static void pack_float(ember_dtype type, const uint8_t *w, size_t wrb, int64_t n_in, uint8_t *pk) {
    if (type == DT_BF16) pack_float_t(DT_BF16, w, wrb, n_in, pk);
    else pack_float_t(DT_F32, w, wrb, n_in, pk);
}

/* count chunks of one chain for FR x C pairs: weights from mp (FR vectors
 * per chunk), activation chunks 32 floats apart from ap. */
ALWAYS_INLINE void float_chain(const int C, const int HALF, int64_t count, const uint8_t *mp, size_t rs, size_t cs,
                               const float *ap, size_t as, __m512 acc[FR][FC]) {
    for (int64_t j = 0; j < count; j++, mp += cs, ap += 32) {
        __m512 w[FR];
        UNROLL
        for (int r = 0; r < FR; r++) w[r] = panel_load(HALF, mp + rs * r);
        UNROLL
        for (int c = 0; c < C; c++) {
            __m512 av = _mm512_loadu_ps(ap + c * as);
            UNROLL
            for (int r = 0; r < FR; r++) acc[r][c] = _mm512_fmadd_ps(w[r], av, acc[r][c]);
        }
    }
}

/* One K block of one chain for one micro-tile: the FR x C accumulators come
 * from (or, first, start at zero in) st and go back there. */
ALWAYS_INLINE void float_segment(const int C, const int HALF, int64_t count, const uint8_t *mp, size_t rs,
                                 size_t cs, const float *ap, size_t as, __m512 *st, int first) {
    __m512 acc[FR][FC];
    UNROLL
    for (int r = 0; r < FR; r++)
        UNROLL
        for (int c = 0; c < C; c++) acc[r][c] = first ? _mm512_setzero_ps() : _mm512_load_ps((float *)&st[r * FC + c]);
    float_chain(C, HALF, count, mp, rs, cs, ap, as, acc);
    UNROLL
    for (int r = 0; r < FR; r++)
        UNROLL
        for (int c = 0; c < C; c++) _mm512_store_ps((float *)&st[r * FC + c], acc[r][c]);
}

/* The masked tail into the odd chain (tp: the tail's weights, or NULL), then
 * the dot's final sum. */
ALWAYS_INLINE void float_finish(const int C, const int HALF, int64_t n_in, const uint8_t *tp, size_t rs,
                                const float *a, size_t as, const __m512 *even, const __m512 *odd, float *y,
                                size_t ys) {
    const int64_t done = n_in / 16 * 16;
    __m512 acc[FR][FC];
    UNROLL
    for (int r = 0; r < FR; r++)
        UNROLL
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_load_ps((const float *)&odd[r * FC + c]);
    if (tp) {
        __mmask16 m = (__mmask16)((1u << (n_in - done)) - 1);
        UNROLL
        for (int c = 0; c < C; c++) {
            __m512 av = _mm512_maskz_loadu_ps(m, a + c * as + done);
            UNROLL
            for (int r = 0; r < FR; r++)
                acc[r][c] = _mm512_fmadd_ps(panel_load_masked(HALF, tp + rs * r, m), av, acc[r][c]);
        }
    }
    UNROLL
    for (int r = 0; r < FR; r++)
        UNROLL
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_add_ps(_mm512_load_ps((const float *)&even[r * FC + c]), acc[r][c]);
    store_tile_sums_4xC(C, acc, y, ys);
}

#define FLOAT_TILE_T(N, HALF, SUFFIX)                                                               \
    static void float_segment_##SUFFIX##N(int64_t count, const uint8_t *mp, size_t rs, size_t cs,     \
                                          const float *ap, size_t as, __m512 *st, int first) {      \
        float_segment(N, HALF, count, mp, rs, cs, ap, as, st, first);                               \
    }                                                                                               \
    static void float_finish_##SUFFIX##N(int64_t n_in, const uint8_t *tp, size_t rs, const float *a, \
                                         size_t as, const __m512 *even, const __m512 *odd, float *y, \
                                         size_t ys) {                                               \
        float_finish(N, HALF, n_in, tp, rs, a, as, even, odd, y, ys);                               \
    }
#define FLOAT_TILES(HALF, SUFFIX)                                                                   \
    FLOAT_TILE_T(1, HALF, SUFFIX) FLOAT_TILE_T(2, HALF, SUFFIX) FLOAT_TILE_T(3, HALF, SUFFIX)       \
    FLOAT_TILE_T(4, HALF, SUFFIX) FLOAT_TILE_T(5, HALF, SUFFIX) FLOAT_TILE_T(6, HALF, SUFFIX)
FLOAT_TILES(0, f)
FLOAT_TILES(1, h)

typedef void (*float_segment_fn)(int64_t, const uint8_t *, size_t, size_t, const float *, size_t, __m512 *, int);
typedef void (*float_finish_fn)(int64_t, const uint8_t *, size_t, const float *, size_t, const __m512 *,
                                const __m512 *, float *, size_t);
/* [HALF][C] */
static const float_segment_fn float_segments[2][FC + 1] = {
    {NULL, float_segment_f1, float_segment_f2, float_segment_f3, float_segment_f4, float_segment_f5, float_segment_f6},
    {NULL, float_segment_h1, float_segment_h2, float_segment_h3, float_segment_h4, float_segment_h5, float_segment_h6}};
static const float_finish_fn float_finishes[2][FC + 1] = {
    {NULL, float_finish_f1, float_finish_f2, float_finish_f3, float_finish_f4, float_finish_f5, float_finish_f6},
    {NULL, float_finish_h1, float_finish_h2, float_finish_h3, float_finish_h4, float_finish_h5, float_finish_h6}};

/* Chunk pairs per K block: a token tile's activations for one block (FC x
 * 2 * FLOAT_KPAIRS x 16 floats, 12 KB) stay in L1 while the four
 * micro-panels pass over them; only the weights come from L2. */
enum { FLOAT_KPAIRS = 32 };

/* Tokens per pass over a part's panels: a block's activations (at most
 * FLOAT_X_BYTES) stay in L3 while every panel of the part passes over
 * them (a panel reads them at the same rate per product whatever the block
 * size, so the block only has to fit in L3); the panels are packed again
 * for each block, so fewer, even blocks pack less: 512 tokens of 2048-wide
 * rows are one block, of 8192-wide rows four. */
enum { FLOAT_X_BYTES = 1 << 22, F16_X_BYTES = 1 << 24 };

/* Tokens per block: at most max_block (at least 4 tiles), the batch split
 * evenly so that no block is a sliver (each block packs the panels again). */
static int64_t float_token_block(int64_t n_tokens, int64_t max_block, int tile) {
    if (max_block < 4 * tile) max_block = 4 * tile;
    int64_t blocks = (n_tokens + max_block - 1) / max_block, block = (n_tokens + blocks - 1) / blocks;
    return (block + tile - 1) / tile * tile;
}

/* F16 groups: the tiles read a packed copy of g rows (FR-row micro-panels,
 * each the even chain's chunks then the odd chain's, a chunk the FR rows'
 * 16 halves side by side: a chain step reads one contiguous 128-byte run
 * instead of FR rows a row stride apart). Pipelined, the copy of the next
 * group is made in slices, one per token tile of the current group, each
 * spread over that tile's micro-panels and its source lines asked for a
 * tile ahead: the rows come from memory while FMAs run. The masked tail is
 * read from the rows themselves. */
typedef struct {
    const uint8_t *w; /* the group's first row */
    size_t wrb;
    int64_t nfull, ne, g;
    uint8_t *dst;
} f16_pack;

/* Copies 32-byte chunks [i0, i1) of the group (row-major: chunk i is row
 * i / nfull, chunk i % nfull) to their packed places. */
static void f16_pack_range(const f16_pack *p, int64_t i0, int64_t i1) {
    const size_t micro = (size_t)p->nfull * FR * 32;
    for (int64_t i = i0; i < i1;) {
        const int64_t row = i / p->nfull, end = (row + 1) * p->nfull < i1 ? (row + 1) * p->nfull : i1;
        const uint8_t *src = p->w + (size_t)row * p->wrb;
        uint8_t *mp = p->dst + (size_t)(row / FR) * micro + (size_t)(row % FR) * 32;
        for (int64_t k = i - row * p->nfull; i < end; i++, k++) {
            int64_t slot = (k & 1) ? p->ne + k / 2 : k / 2;
            _mm256_store_si256((__m256i *)(mp + (size_t)slot * FR * 32),
                               _mm256_loadu_si256((const __m256i *)(src + 32 * k)));
        }
    }
}

/* The source lines of chunks [i0, i1). */
static void f16_pack_prefetch(const f16_pack *p, int64_t i0, int64_t i1) {
    for (int64_t i = i0 & ~(int64_t)1; i < i1; i += 2)
        _mm_prefetch((const char *)p->w + (size_t)(i / p->nfull) * p->wrb + 32 * (size_t)(i % p->nfull), _MM_HINT_T0);
}

static f16_pack f16_group_at(const uint8_t *w, size_t wrb, int64_t n_in, int64_t o, int64_t oend, int64_t group,
                             uint8_t *dst) {
    const int64_t nfull = n_in / 16;
    return (f16_pack){w + (size_t)o * wrb, wrb, nfull, (nfull + 1) / 2, oend - o < group ? oend - o : group, dst};
}

static void float_panels(ember_dtype type, const uint8_t *w, size_t wrb, int64_t n_in, int64_t o0, int64_t o1,
                         const float *x, size_t xs, int64_t n_tokens, float *y, int64_t n_out, uint8_t *pk) {
    const int HALF = type == DT_F16;
    const float_segment_fn *segments = float_segments[HALF];
    const float_finish_fn *finishes = float_finishes[HALF];
    const int64_t nfull = n_in / 16, ne = (nfull + 1) / 2, no = nfull / 2;
    /* micro-panel stride, chain step (= the slot of a chunk) and row stride
     * in the packed panel (F32 / BF16) or group (F16) */
    const size_t micro = HALF ? (size_t)nfull * FR * 32 : (size_t)float_chunks(n_in) * FR * 16 * 4;
    const size_t chunk = HALF ? FR * 32 : FR * 16 * 4, rs = HALF ? 32 : 16 * 4;
    const int64_t group = HALF ? f16_group_rows(n_in) : PANEL;
    const int pipe = HALF && f16_pipelined(n_in);
    const size_t half_bytes = HALF ? f16_group_bytes(n_in) : 0; /* a pipelined group's buffer */
    const int64_t block = float_token_block(n_tokens, (HALF ? F16_X_BYTES : FLOAT_X_BYTES) / (n_in * (int64_t)sizeof(float)), FC);
    const int64_t oend = o0 + (o1 - o0) / PANEL * PANEL;
    _Alignas(64) __m512 st[F16_GROUP_MAX / FR][2][FR * FC];
    int cur = 0;             /* pipelined: the buffer the current group is in */
    int64_t packed_o = -1;   /* not pipelined: the group packed in pk */
    if (pipe && o0 < oend) {
        f16_pack first = f16_group_at(w, wrb, n_in, o0, oend, group, pk);
        f16_pack_range(&first, 0, first.g * nfull);
    }
    for (int64_t t0 = 0; t0 < n_tokens; t0 += block) {
        const int64_t t1 = t0 + block < n_tokens ? t0 + block : n_tokens, tiles = (t1 - t0 + FC - 1) / FC;
        for (int64_t o = o0; o < oend; o += group) {
            const int64_t g = oend - o < group ? oend - o : group, micros = g / FR;
            const uint8_t *panel = pk + (size_t)cur * half_bytes;
            /* Pipelined: the group after this one (the next rows, or the
             * first rows again for the next token block) unless it is this
             * one, packed into the other buffer during this group's tiles. */
            const int64_t on = o + g < oend ? o + g : o0;
            const int has_next = pipe && (o + g < oend || (t1 < n_tokens && on != o));
            const f16_pack next = has_next ? f16_group_at(w, wrb, n_in, on, oend, group, pk + (size_t)(cur ^ 1) * half_bytes)
                                           : (f16_pack){0};
            const int64_t pack_n = has_next ? next.g * nfull : 0, per = (pack_n + tiles - 1) / tiles;
            /* Otherwise the next rows (contiguous, in memory) come into L2 a
             * slice per token tile while this group computes: the pack then
             * reads cache, not DRAM at one row's pace. */
            const uint8_t *ahead = NULL;
            size_t ahead_bytes = 0;
            if (HALF && !pipe) {
                if (packed_o != o) {
                    f16_pack now = f16_group_at(w, wrb, n_in, o, oend, group, pk);
                    f16_pack_range(&now, 0, now.g * nfull);
                    packed_o = o;
                }
            } else if (!HALF) {
                pack_float(type, w + (size_t)o * wrb, wrb, n_in, pk);
            }
            if (!pipe && o + g < oend) {
                ahead = w + (size_t)(o + g) * wrb;
                ahead_bytes = (size_t)(oend - o - g < group ? oend - o - g : group) * wrb;
            }
            if (has_next) f16_pack_prefetch(&next, 0, per < pack_n ? per : pack_n);
            for (int64_t t = t0; t < t1; t += FC) {
                const int n = t1 - t < FC ? (int)(t1 - t) : FC;
                const int64_t ti = (t - t0) / FC;
                const float *a = x + t * xs;
                int64_t c0 = 0, c1 = 0; /* this tile's slice of the next group's copy */
                if (has_next) {
                    c0 = ti * per < pack_n ? ti * per : pack_n;
                    c1 = c0 + per < pack_n ? c0 + per : pack_n;
                    f16_pack_prefetch(&next, c1, c1 + per < pack_n ? c1 + per : pack_n);
                } else if (ahead) {
                    prefetch_panel_slice(ahead, ahead_bytes, tiles, ti);
                }
                for (int64_t k = 0; k == 0 || k < ne; k += FLOAT_KPAIRS) {
                    int64_t ce = ne - k < FLOAT_KPAIRS ? ne - k : FLOAT_KPAIRS;
                    int64_t co = no - k < FLOAT_KPAIRS ? (no > k ? no - k : 0) : FLOAT_KPAIRS;
                    for (int m = 0; m < micros; m++) {
                        if (c0 < c1) {
                            int64_t part = (c1 - c0 + micros - 1 - m) / (micros - m);
                            f16_pack_range(&next, c0, c0 + part);
                            c0 += part;
                        }
                        const uint8_t *even = panel + m * micro + k * chunk, *odd = panel + m * micro + (ne + k) * chunk;
                        segments[n](ce, even, rs, chunk, a + 32 * k, xs, st[m][0], k == 0);
                        segments[n](co, odd, rs, chunk, a + 32 * k + 16, xs, st[m][1], k == 0);
                    }
                }
                for (int m = 0; m < micros; m++) {
                    const uint8_t *tail = HALF ? w + (size_t)(o + m * FR) * wrb + 32 * nfull : pk + m * micro + nfull * chunk;
                    finishes[n](n_in, nfull < float_chunks(n_in) ? tail : NULL, HALF ? wrb : rs, a, xs, st[m][0],
                                st[m][1], y + t * n_out + o + m * FR, (size_t)n_out);
                }
            }
            if (has_next) cur ^= 1;
        }
    }
}

/* ------------------------------------------------------------------ driver */

void matmul_avx512_panels(ember_dtype type, const uint8_t *w, size_t wrb, int64_t n_in, int64_t o0,
                          int64_t o1, const uint8_t *act, size_t as, const int32_t *meta,
                          int64_t n_tokens, float *y, int64_t n_out, uint8_t *pk) {
    enum { TB = 8 };
    if (type == DT_Q8_0 || type == DT_IQ4_NL) {
        int64_t nb = n_in / 32;
        size_t ms = 2 * (size_t)nb;
        for (int64_t o = o0; o + PANEL <= o1; o += PANEL) {
            if (type == DT_Q8_0) pack_q8_0(w + (size_t)o * wrb, wrb, nb, pk);
            else quant_iq4_nl_pack_panel(w + (size_t)o * wrb, wrb, nb, pk);
            for (int64_t t = 0; t < n_tokens; t += TB) {
                int64_t n = n_tokens - t < TB ? n_tokens - t : TB;
                q8_panels[n](nb, pk, act + (size_t)t * as, as, meta + (size_t)t * ms, ms,
                             y + t * n_out + o, (size_t)n_out);
            }
        }
    } else if (type == DT_Q4_K || type == DT_Q6_K) {
        int64_t nb = n_in / 256;
        const q4k_panel_fn *fns = type == DT_Q4_K ? q4k_panels : q6k_panels;
        for (int64_t o = o0; o + PANEL <= o1; o += PANEL) {
            if (type == DT_Q4_K) pack_q4_K(w + (size_t)o * wrb, wrb, nb, pk);
            else pack_q6_K(w + (size_t)o * wrb, wrb, nb, pk);
            for (int64_t t = 0; t < n_tokens; t += TB) {
                int64_t n = n_tokens - t < TB ? n_tokens - t : TB;
                fns[n](nb, pk, act + (size_t)t * as, as, y + t * n_out + o, (size_t)n_out);
            }
        }
    } else if (type == DT_IQ4_XS) {
        quant_iq4_xs_panels(w, wrb, n_in, o0, o1, act, as, n_tokens, y, n_out, pk);
    } else if (type == DT_BF16 && quant_dot_act(DT_BF16) == DT_BF16) {
        matmul_bf16dp_panels(w, wrb, n_in, o0, o1, act, as, n_tokens, y, n_out, pk);
    } else if (type == DT_F32 || type == DT_F16 || type == DT_BF16) {
        float_panels(type, w, wrb, n_in, o0, o1, (const float *)act, as / sizeof(float), n_tokens, y, n_out, pk);
    }
}
