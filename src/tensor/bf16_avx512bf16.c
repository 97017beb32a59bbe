/* bf16_avx512bf16.c - BF16 weights times BF16-rounded activations with
 * vdpbf16ps (AVX512_BF16): the GEMV dot (decode), the small-batch strips and
 * the 16-row panels (prefill).
 *
 * Why the activations are rounded: vdpbf16ps multiplies 32 BF16 pairs into
 * 16 f32 lanes per instruction, twice the products of an f32 FMA, and it
 * needs both operands in BF16. The activation rows are rounded to BF16
 * (round to nearest even) once per call by matmul.c (quant_dot_act(DT_BF16)
 * says so on such CPUs), as llama.cpp does for BF16 weights; CPUs without
 * AVX512_BF16 keep the exact f32 dot of quant_avx512.c. A BF16 x BF16
 * product is exact in f32, so the only new rounding is the activations'.
 *
 * Bit-identity: every kernel gives a (row, token) pair the dot's operations
 * in the dot's order. The dot sums a row in 32-element chunks with two
 * accumulators, acc0 over the even full chunks in order, acc1 over the odd
 * ones and then the zero-masked tail, and returns
 * _mm512_reduce_add_ps(acc0 + acc1). The strips keep those two accumulators
 * per pair; the panels, like quant_avx512.c's float panels, pack 16 rows into
 * 4-row micro-panels laid out chunk by chunk (even chunks, then odd ones,
 * then the zero-padded tail) and run the even chain of a 4 x 6 tile of pairs,
 * then the odd chain, one accumulator per pair, so results do not depend on
 * n_tokens or on the thread split (test_matmul). */
#include <immintrin.h>
#include <string.h>

#include "tensor/quant.h"
#include "tensor/quant_avx512_reduce.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

enum { CHUNK = 32 }; /* BF16 elements per zmm */

ALWAYS_INLINE __m512 dp(__m512 acc, __m512i w, __m512i a) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)a);
}
ALWAYS_INLINE __m512i load_bf(const uint16_t *p) { return _mm512_loadu_si512((const void *)p); }
ALWAYS_INLINE __m512i load_bf_masked(__mmask32 m, const uint16_t *p) { return _mm512_maskz_loadu_epi16(m, p); }
ALWAYS_INLINE __mmask32 tail_mask(int64_t left) { return (__mmask32)((1ull << left) - 1); }

/* ------------------------------------------------------------------ dot */

static float dot_bf16dp(int64_t n, const void *w, const void *a) {
    const uint16_t *x = w, *y = a;
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 2 * CHUNK <= n; i += 2 * CHUNK) {
        acc0 = dp(acc0, load_bf(x + i), load_bf(y + i));
        acc1 = dp(acc1, load_bf(x + i + CHUNK), load_bf(y + i + CHUNK));
    }
    if (i + CHUNK <= n) {
        acc0 = dp(acc0, load_bf(x + i), load_bf(y + i));
        i += CHUNK;
    }
    if (i < n) {
        __mmask32 m = tail_mask(n - i);
        acc1 = dp(acc1, load_bf_masked(m, x + i), load_bf_masked(m, y + i));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* --------------------------------------------------------------- strips */

/* R rows x C tokens (R * C <= 8: two accumulators per pair), the dot's
 * chains per pair. Rows past `rows` repeat the last row and are not stored;
 * the next strip's rows are prefetched one strip ahead. */
ALWAYS_INLINE void strip_bf16dp(const int R, const int C, int64_t n, const void *w, size_t ws, int rows,
                                const void *act, size_t as, float *y, size_t ys) {
    const uint16_t *wr[8], *a = act;
    const size_t ahead = (size_t)R * ws, es = as / 2;
    UNROLL
    for (int r = 0; r < R; r++) wr[r] = (const uint16_t *)((const uint8_t *)w + (size_t)(r < rows ? r : rows - 1) * ws);
    __m512 acc0[8], acc1[8];
    UNROLL
    for (int p = 0; p < R * C; p++) acc0[p] = acc1[p] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 2 * CHUNK <= n; i += 2 * CHUNK) {
        UNROLL
        for (int r = 0; r < R; r++) {
            _mm_prefetch((const char *)(wr[r] + i) + ahead, _MM_HINT_T0);
            _mm_prefetch((const char *)(wr[r] + i) + ahead + 64, _MM_HINT_T0);
            __m512i w0 = load_bf(wr[r] + i), w1 = load_bf(wr[r] + i + CHUNK);
            UNROLL
            for (int c = 0; c < C; c++) {
                acc0[r * C + c] = dp(acc0[r * C + c], w0, load_bf(a + c * es + i));
                acc1[r * C + c] = dp(acc1[r * C + c], w1, load_bf(a + c * es + i + CHUNK));
            }
        }
    }
    if (i + CHUNK <= n) {
        UNROLL
        for (int r = 0; r < R; r++) {
            __m512i wv = load_bf(wr[r] + i);
            UNROLL
            for (int c = 0; c < C; c++) acc0[r * C + c] = dp(acc0[r * C + c], wv, load_bf(a + c * es + i));
        }
        i += CHUNK;
    }
    if (i < n) {
        __mmask32 m = tail_mask(n - i);
        UNROLL
        for (int r = 0; r < R; r++) {
            __m512i wv = load_bf_masked(m, wr[r] + i);
            UNROLL
            for (int c = 0; c < C; c++)
                acc1[r * C + c] = dp(acc1[r * C + c], wv, load_bf_masked(m, a + c * es + i));
        }
    }
    UNROLL
    for (int r = 0; r < R; r++)
        if (r < rows)
            UNROLL
            for (int c = 0; c < C; c++)
                y[c * ys + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[r * C + c], acc1[r * C + c]));
}

#define STRIP_H(C) ((C) == 1 ? 8 : (C) == 2 ? 4 : (C) <= 4 ? 2 : 1)
#define STRIP_FN(C)                                                                                  \
    static void strip_bf16dp_##C(int64_t n, const void *w, size_t ws, int rows, const void *a,       \
                                 size_t as, const int32_t *meta, float *y, size_t ys) {              \
        (void)meta;                                                                                  \
        strip_bf16dp(STRIP_H(C), C, n, w, ws, rows, a, as, y, ys);                                   \
    }
STRIP_FN(2) STRIP_FN(3) STRIP_FN(4) STRIP_FN(5) STRIP_FN(6) STRIP_FN(7) STRIP_FN(8)

/* --------------------------------------------------------------- panels */

enum { PANEL = 16, BR = 4, BC = 6, MICRO = PANEL / BR };
_Static_assert(BR == 4 && BC <= 6, "store_tile_sums_4xC's tile shape");

static int64_t chunks_of(int64_t n_in) { return (n_in + CHUNK - 1) / CHUNK; }

size_t matmul_bf16dp_panel_bytes(int64_t n_in) { return (size_t)chunks_of(n_in) * PANEL * 64; }

/* Micro-panel m: chunk slot j, row r at ((m * nch + j) * BR + r) * 32
 * elements; copied chunk by chunk over all 16 rows (16 streams in flight,
 * each prefetched a few lines ahead). */
static void pack_bf16(const uint8_t *w, size_t wrb, int64_t n_in, uint16_t *pk) {
    const int64_t nfull = n_in / CHUNK, ne = (nfull + 1) / 2, nch = chunks_of(n_in);
    const size_t ahead = 8 * 64;
    for (int64_t k = 0; k < nfull; k++) {
        int64_t slot = (k & 1) ? ne + k / 2 : k / 2;
        UNROLL
        for (int row = 0; row < PANEL; row++) {
            const uint8_t *src = w + (size_t)row * wrb + 64 * k;
            _mm_prefetch((const char *)src + ahead, _MM_HINT_T0);
            uint16_t *mp = pk + ((size_t)(row / BR) * nch + (size_t)slot) * BR * CHUNK + (size_t)(row % BR) * CHUNK;
            _mm512_store_si512((__m512i *)mp, _mm512_loadu_si512((const void *)src));
        }
    }
    if (nfull < nch)
        for (int row = 0; row < PANEL; row++) {
            uint16_t *mp = pk + ((size_t)(row / BR) * nch + (size_t)nfull) * BR * CHUNK + (size_t)(row % BR) * CHUNK;
            const uint16_t *src = (const uint16_t *)(w + (size_t)row * wrb) + CHUNK * nfull;
            _mm512_store_si512((__m512i *)mp, load_bf_masked(tail_mask(n_in - CHUNK * nfull), src));
        }
}

/* One K block of one chain for one micro-tile: count chunks, weights from
 * mp (BR chunks per step), activation chunks 64 elements apart from ap; the
 * BR x C accumulators come from (or, first, start at zero in) st and go
 * back there. */
ALWAYS_INLINE void segment(const int C, int64_t count, const uint16_t *mp, const uint16_t *ap, size_t as,
                           __m512 *st, int first) {
    __m512 acc[BR][BC];
    UNROLL
    for (int r = 0; r < BR; r++)
        UNROLL
        for (int c = 0; c < C; c++) acc[r][c] = first ? _mm512_setzero_ps() : _mm512_load_ps((float *)&st[r * BC + c]);
    for (int64_t j = 0; j < count; j++, mp += BR * CHUNK, ap += 2 * CHUNK) {
        __m512i wv[BR];
        UNROLL
        for (int r = 0; r < BR; r++) wv[r] = _mm512_load_si512((const void *)(mp + CHUNK * r));
        UNROLL
        for (int c = 0; c < C; c++) {
            __m512i av = load_bf(ap + c * as);
            UNROLL
            for (int r = 0; r < BR; r++) acc[r][c] = dp(acc[r][c], wv[r], av);
        }
    }
    UNROLL
    for (int r = 0; r < BR; r++)
        UNROLL
        for (int c = 0; c < C; c++) _mm512_store_ps((float *)&st[r * BC + c], acc[r][c]);
}

/* The masked tail into the odd chain (tp: the tail's weights, or NULL), then
 * the dot's final sum. */
ALWAYS_INLINE void finish(const int C, int64_t n_in, const uint16_t *tp, const uint16_t *a, size_t as,
                          const __m512 *even, const __m512 *odd, float *y, size_t ys) {
    const int64_t done = n_in / CHUNK * CHUNK;
    __m512 acc[BR][BC];
    UNROLL
    for (int r = 0; r < BR; r++)
        UNROLL
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_load_ps((const float *)&odd[r * BC + c]);
    if (tp) {
        __mmask32 m = tail_mask(n_in - done);
        UNROLL
        for (int c = 0; c < C; c++) {
            __m512i av = load_bf_masked(m, a + c * as + done);
            UNROLL
            for (int r = 0; r < BR; r++)
                acc[r][c] = dp(acc[r][c], _mm512_load_si512((const void *)(tp + CHUNK * r)), av);
        }
    }
    UNROLL
    for (int r = 0; r < BR; r++)
        UNROLL
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_add_ps(_mm512_load_ps((const float *)&even[r * BC + c]), acc[r][c]);
    store_tile_sums_4xC(C, acc, y, ys);
}

#define TILE_FN(N)                                                                                  \
    static void segment_##N(int64_t count, const uint16_t *mp, const uint16_t *ap, size_t as, __m512 *st, \
                            int first) {                                                            \
        segment(N, count, mp, ap, as, st, first);                                                   \
    }                                                                                               \
    static void finish_##N(int64_t n_in, const uint16_t *tp, const uint16_t *a, size_t as, const __m512 *even, \
                           const __m512 *odd, float *y, size_t ys) {                                \
        finish(N, n_in, tp, a, as, even, odd, y, ys);                                               \
    }
TILE_FN(1) TILE_FN(2) TILE_FN(3) TILE_FN(4) TILE_FN(5) TILE_FN(6)

typedef void (*segment_fn)(int64_t, const uint16_t *, const uint16_t *, size_t, __m512 *, int);
typedef void (*finish_fn)(int64_t, const uint16_t *, const uint16_t *, size_t, const __m512 *, const __m512 *,
                          float *, size_t);
static const segment_fn segments[BC + 1] = {NULL, segment_1, segment_2, segment_3, segment_4, segment_5, segment_6};
static const finish_fn finishes[BC + 1] = {NULL, finish_1, finish_2, finish_3, finish_4, finish_5, finish_6};

/* Chunk pairs per K block: a token tile's activations for one block (BC x
 * 2 * KPAIRS x 64 bytes, 24 KB) stay in L1 while the four micro-panels pass
 * over them. */
enum { KPAIRS = 32 };
/* Tokens per pass over a part's panels: their activations (at most X_BYTES)
 * stay in L3 while every panel of the part passes over them; the same
 * token counts as matmul_avx512.c's f32 rows. */
enum { X_BYTES = 1 << 21 };

void matmul_bf16dp_panels(const uint8_t *w, size_t wrb, int64_t n_in, int64_t o0, int64_t o1, const uint8_t *act,
                          size_t as_bytes, int64_t n_tokens, float *y, int64_t n_out, uint8_t *pk_bytes) {
    const int64_t nfull = n_in / CHUNK, ne = (nfull + 1) / 2, no = nfull / 2, nch = chunks_of(n_in);
    const size_t micro = (size_t)nch * BR * CHUNK, chunk = BR * CHUNK, as = as_bytes / 2;
    const uint16_t *x = (const uint16_t *)act;
    uint16_t *pk = (uint16_t *)pk_bytes;
    int64_t max_block = X_BYTES / (n_in * 2);
    if (max_block < 4 * BC) max_block = 4 * BC;
    /* the batch split evenly: no block is a sliver (each block packs the panels again) */
    int64_t blocks = (n_tokens + max_block - 1) / max_block, block = (n_tokens + blocks - 1) / blocks;
    block = (block + BC - 1) / BC * BC;
    _Alignas(64) __m512 st[MICRO][2][BR * BC];
    for (int64_t t0 = 0; t0 < n_tokens; t0 += block) {
        const int64_t t1 = t0 + block < n_tokens ? t0 + block : n_tokens, tiles = (t1 - t0 + BC - 1) / BC;
        const size_t panel_bytes = PANEL * wrb;
        for (int64_t o = o0; o + PANEL <= o1; o += PANEL) {
            pack_bf16(w + (size_t)o * wrb, wrb, n_in, pk);
            /* the next panel's rows come into L2 a slice per token tile */
            const uint8_t *next = o + 2 * PANEL <= o1 ? w + (size_t)(o + PANEL) * wrb : NULL;
            for (int64_t t = t0; t < t1; t += BC) {
                const int n = t1 - t < BC ? (int)(t1 - t) : BC;
                const uint16_t *a = x + t * as;
                if (next) prefetch_panel_slice(next, panel_bytes, tiles, (t - t0) / BC);
                for (int64_t k = 0; k == 0 || k < ne; k += KPAIRS) {
                    int64_t ce = ne - k < KPAIRS ? ne - k : KPAIRS;
                    int64_t co = no - k < KPAIRS ? (no > k ? no - k : 0) : KPAIRS;
                    for (int m = 0; m < MICRO; m++) {
                        const uint16_t *mp = pk + m * micro;
                        segments[n](ce, mp + k * chunk, a + 2 * CHUNK * k, as, st[m][0], k == 0);
                        segments[n](co, mp + (ne + k) * chunk, a + 2 * CHUNK * k + CHUNK, as, st[m][1], k == 0);
                    }
                }
                for (int m = 0; m < MICRO; m++)
                    finishes[n](n_in, nfull < nch ? pk + m * micro + nfull * chunk : NULL, a, as, st[m][0], st[m][1],
                                y + t * n_out + o + m * BR, (size_t)n_out);
            }
        }
    }
}

/* ------------------------------------------------------------- tables */

void quant_avx512bf16_kernels(quant_dot_fn dots[DT_COUNT], quant_tile_fn tiles[DT_COUNT],
                              quant_strip_fn strips[DT_COUNT][QUANT_STRIP_TOKENS + 1],
                              int heights[DT_COUNT][QUANT_STRIP_TOKENS + 1], ember_dtype acts[DT_COUNT]) {
    const quant_strip_fn f[QUANT_STRIP_TOKENS + 1] = {NULL, NULL, strip_bf16dp_2, strip_bf16dp_3, strip_bf16dp_4,
                                                      strip_bf16dp_5, strip_bf16dp_6, strip_bf16dp_7, strip_bf16dp_8};
    dots[DT_BF16] = dot_bf16dp;
    tiles[DT_BF16] = NULL; /* rows past the last panel use the dot */
    /* a lone token: the GEMV dot (one stream the prefetcher follows) */
    for (int c = 1; c <= QUANT_STRIP_TOKENS; c++) {
        strips[DT_BF16][c] = f[c];
        heights[DT_BF16][c] = STRIP_H(c);
    }
    acts[DT_BF16] = DT_BF16;
}
