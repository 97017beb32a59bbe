/* attention_avx512.c - one query head of causal attention, AVX-512.
 *
 * Same contract and operation order as the scalar head in ops.c, widened to
 * 16 lanes: scores by FMA dot products (masked loads for head sizes that are
 * not a multiple of 16), an exp() evaluated by a degree-6 polynomial with
 * 2^n applied by vscalefps, and the value sum accumulated key by key in
 * registers. Every step depends only on this query's row, so the result is
 * the same whatever batch the row is in; decode and prefill share it.
 *
 * f16, q8_0 and q12h rows are decoded with vcvtph2ps and int -> f32
 * products (exact, the same values as kv_row_decode) right where the f32
 * kernel would load them: per key row in the one-head path, per tile of 16
 * K rows or 32 V rows in the multi-query path, which copies f32 tiles
 * anyway. K and V may differ in format (a q8_0 pool keeps K in q12h); each
 * instance has both fixed at compile time. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "tensor/attention_avx512_common.h"
#include "tensor/attention_impl.h"
#include "tensor/quant.h"
#include "tensor/quant_avx512_reduce.h"

/* Key or value j of a head as floats: in place for f32 rows, else decoded
 * into buf. */
static inline const float *row_at(const void *const *blocks, size_t stride, int64_t j, int offset, int n,
                                  kv_row_type type, float *buf) {
    const uint8_t *row = attention_row(blocks, stride, j);
    if (type == KV_ROW_F32) return (const float *)row + offset;
    decode_avx512(type, row, offset, n, buf);
    return buf;
}

/* Values [e, e + n) of an encoded row (n <= 16) in lanes [0, n), zeros in
 * the rest: the f32 kernel's masked load, on decoded values. */
static inline __attribute__((always_inline)) __m512 load16(const kv_row_type type, const uint8_t *row, int e, int n) {
    __mmask16 m = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    if (type == KV_ROW_F16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, row + 2 * (size_t)e));
    if (type == KV_ROW_Q8_0) {
        int in = e % KV_ROW_Q8_0_BLOCK;
        if (in + n <= KV_ROW_Q8_0_BLOCK) {
            const uint8_t *b = row + (size_t)(e / KV_ROW_Q8_0_BLOCK) * sizeof(block_q8_0);
            uint16_t h;
            memcpy(&h, b, 2);
            __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, b + 2 + in)));
            return _mm512_maskz_mul_ps(m, _mm512_set1_ps(_cvtsh_ss(h)), q);
        }
        float buf[16];
        kv_row_decode(type, row, e, n, buf);
        return _mm512_maskz_loadu_ps(m, buf);
    }
    if (type == KV_ROW_Q12H) {
        int in = e % KV_ROW_Q12H_BLOCK;
        if (in + n <= 16 || (in >= 16 && in + n <= KV_ROW_Q12H_BLOCK)) {
            const uint8_t *b = row + (size_t)(e / KV_ROW_Q12H_BLOCK) * sizeof(kv_block_q12h);
            uint16_t h;
            memcpy(&h, b, 2);
            return _mm512_maskz_mul_ps(m, _mm512_set1_ps(_cvtsh_ss(h)), _mm512_cvtepi32_ps(q12h_ints16(b, in, m)));
        }
        float buf[16];
        kv_row_decode(type, row, e, n, buf);
        return _mm512_maskz_loadu_ps(m, buf);
    }
    return _mm512_maskz_loadu_ps(m, row + 4 * (size_t)e);
}

/* One head, K/V rows of a type fixed at compile time (each instance has its
 * loads inlined). The operation order is dot_avx512's per key, then the
 * same softmax, then fma(p_j, v_j, acc) key by key per 16 lanes. */
static inline __attribute__((always_inline)) void head_typed(const attention_head_args *a, const kv_row_type k_type,
                                                             const kv_row_type v_type) {
    int64_t n = a->n_keys - a->first;
    float *s = a->scores;
    for (int64_t j = a->first; j < a->n_keys; j++) {
        const uint8_t *row = attention_row(a->k_blocks, a->k_stride, j);
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < a->d_k; i += 16) {
            int w = a->d_k - i < 16 ? a->d_k - i : 16;
            __mmask16 m = w == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << w) - 1);
            acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a->q + i), load16(k_type, row, a->k_offset + i, w), acc);
        }
        s[j - a->first] = _mm512_reduce_add_ps(acc) * a->scale;
    }
    softmax_scale(s, n); /* p_j = e_j * inv, as the multi-query path has them */

    /* out = sum_j p_j v_j, 8 registers (128 values) of the head at a time. */
    int d0 = 0;
    /* Full 128-wide slices: the same fma sequence with the accumulators
     * pinned in registers (a runtime register count keeps them in memory). */
    for (; d0 + 128 <= a->d_v; d0 += 128) {
        __m512 acc[8];
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t jj = a->first; jj < a->n_keys; jj++) {
            const uint8_t *row = attention_row(a->v_blocks, a->v_stride, jj);
            __m512 p = _mm512_set1_ps(s[jj - a->first]);
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++)
                acc[r] = _mm512_fmadd_ps(p, load16(v_type, row, a->v_offset + d0 + 16 * r, 16), acc[r]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++) _mm512_storeu_ps(a->out + d0 + 16 * r, acc[r]);
    }
    for (; d0 < a->d_v; d0 += 128) {
        int width = a->d_v - d0 < 128 ? a->d_v - d0 : 128;
        int nreg = (width + 15) / 16;
        int tail_w = width % 16 ? width % 16 : 16;
        __mmask16 tail = (__mmask16)(width % 16 ? (1u << (width % 16)) - 1 : 0xFFFF);
        __m512 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t jj = a->first; jj < a->n_keys; jj++) {
            const uint8_t *row = attention_row(a->v_blocks, a->v_stride, jj);
            __m512 p = _mm512_set1_ps(s[jj - a->first]);
            for (int r = 0; r < nreg; r++)
                acc[r] = _mm512_fmadd_ps(p, load16(v_type, row, a->v_offset + d0 + 16 * r, r == nreg - 1 ? tail_w : 16),
                                         acc[r]);
        }
        for (int r = 0; r < nreg; r++) {
            __mmask16 m = r == nreg - 1 ? tail : 0xFFFF;
            _mm512_mask_storeu_ps(a->out + d0 + 16 * r, m, acc[r]);
        }
    }
}

void attention_head_avx512(const attention_head_args *a) {
    if (a->k_type == KV_ROW_F16 && a->v_type == KV_ROW_F16) head_typed(a, KV_ROW_F16, KV_ROW_F16);
    else if (a->k_type == KV_ROW_Q12H && a->v_type == KV_ROW_Q8_0) head_typed(a, KV_ROW_Q12H, KV_ROW_Q8_0);
    else if (a->k_type == KV_ROW_F32 && a->v_type == KV_ROW_F32) head_typed(a, KV_ROW_F32, KV_ROW_F32);
    else attention_head_scalar(a); /* no pool pairs these */
}

/* ---------------------------------------------------------------------------
 * Several queries over the same kv head (the heads of a GQA group, several
 * rows of a prefill batch). Each query goes through exactly the operations of
 * attention_head_avx512 - per key the same fma chain over d_k then
 * _mm512_reduce_add_ps and * scale; the same max / exp / sum; per output lane
 * fma(p_j, v_j, acc) over keys in order with p_j = e_j * inv - so the bits
 * are those of one head at a time; only the loop nest differs: each key and
 * value row is loaded once for all queries. Fast path for d_k = d_v = 128
 * or 64 (Llama 3.2 1B), a shared first key, and up to 8 queries. */
enum { MQ = 8 };

/* Values of keys [j0, j1) (rows in vt) for NQ queries, 32 lanes per pass;
 * accumulators start at zero on the first chunk, else from out (exact). */
static inline __attribute__((always_inline)) void values_chunk(const int D, const int NQ, const attention_head_args *a,
                                                               const float (*vt)[128], int64_t first, int64_t j0,
                                                               int64_t j1) {
    int64_t lo = a[0].n_keys;
    for (int i = 1; i < NQ; i++) lo = a[i].n_keys < lo ? a[i].n_keys : lo;
    int64_t jl = lo < j1 ? (lo > j0 ? lo : j0) : j1; /* [j0, jl): visible to every query */
    for (int d0 = 0; d0 < D; d0 += 32) {
        __m512 acc[MQ][2];
#pragma GCC unroll 8
        for (int i = 0; i < NQ; i++) {
            if (j0 == first) {
                acc[i][0] = acc[i][1] = _mm512_setzero_ps();
            } else {
                acc[i][0] = _mm512_loadu_ps(a[i].out + d0);
                acc[i][1] = _mm512_loadu_ps(a[i].out + d0 + 16);
            }
        }
        int64_t jj = j0;
        for (; jj < jl; jj++) {
            __m512 v0 = _mm512_load_ps(vt[jj - j0] + d0), v1 = _mm512_load_ps(vt[jj - j0] + d0 + 16);
#pragma GCC unroll 8
            for (int i = 0; i < NQ; i++) {
                __m512 p = _mm512_set1_ps(a[i].scores[jj - first]);
                acc[i][0] = _mm512_fmadd_ps(p, v0, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(p, v1, acc[i][1]);
            }
        }
        for (; jj < j1; jj++) {
            __m512 v0 = _mm512_load_ps(vt[jj - j0] + d0), v1 = _mm512_load_ps(vt[jj - j0] + d0 + 16);
#pragma GCC unroll 8
            for (int i = 0; i < NQ; i++) {
                if (jj >= a[i].n_keys) continue;
                __m512 p = _mm512_set1_ps(a[i].scores[jj - first]);
                acc[i][0] = _mm512_fmadd_ps(p, v0, acc[i][0]);
                acc[i][1] = _mm512_fmadd_ps(p, v1, acc[i][1]);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < NQ; i++) {
            _mm512_storeu_ps(a[i].out + d0, acc[i][0]);
            _mm512_storeu_ps(a[i].out + d0 + 16, acc[i][1]);
        }
    }
}

#define VALUES_CHUNK(D, N)                                                                                   \
    static void values_chunk_##D##_##N(const attention_head_args *a, const float (*vt)[128], int64_t first,   \
                                       int64_t j0, int64_t j1) {                                             \
        values_chunk(D, N, a, vt, first, j0, j1);                                                            \
    }
#define VALUES_CHUNKS(D)                                                                                     \
    VALUES_CHUNK(D, 1) VALUES_CHUNK(D, 2) VALUES_CHUNK(D, 3) VALUES_CHUNK(D, 4)                              \
    VALUES_CHUNK(D, 5) VALUES_CHUNK(D, 6) VALUES_CHUNK(D, 7) VALUES_CHUNK(D, 8)                              \
    static void (*const values_chunk_fns_##D[MQ + 1])(const attention_head_args *, const float (*)[128],      \
                                                      int64_t, int64_t, int64_t) = {                         \
        NULL, values_chunk_##D##_1, values_chunk_##D##_2, values_chunk_##D##_3, values_chunk_##D##_4,         \
        values_chunk_##D##_5, values_chunk_##D##_6, values_chunk_##D##_7, values_chunk_##D##_8};
VALUES_CHUNKS(128)
VALUES_CHUNKS(64)

/* n queries over one kv head (d_k = d_v = D, shared first). K and V rows
 * are 4 KiB apart in the cache (all kv heads per row) and alias in L1/L2,
 * so tiles of them are copied together once and then serve every query:
 * the more queries, the fewer times K and V are streamed from memory. */
static inline __attribute__((always_inline)) void heads_multi(const int D, const attention_head_args *a, int n) {
    const int64_t first = a[0].first;
    int64_t lo = a[0].n_keys, hi = a[0].n_keys;
    for (int i = 1; i < n; i++) {
        lo = a[i].n_keys < lo ? a[i].n_keys : lo;
        hi = a[i].n_keys > hi ? a[i].n_keys : hi;
    }
    /* Scores, 16 keys at a time per query: 16 fma chains, then the 16
     * horizontal sums at once by a tree with _mm512_reduce_add_ps's order. */
    int64_t j = first;
    const kv_row_type k_type = a[0].k_type, v_type = a[0].v_type;
    const size_t k_head = value_byte(k_type, a[0].k_offset), v_head = value_byte(v_type, a[0].v_offset);
    const int k_head_bytes = (int)value_byte(k_type, D), v_head_bytes = (int)value_byte(v_type, D);
    float kt[16][128] __attribute__((aligned(64)));
    for (; j + 16 <= lo; j += 16) {
        for (int k = 0; k < 16; k++) {
            if (j + 16 + k < hi) {
                const char *nx = (const char *)attention_row(a[0].k_blocks, a[0].k_stride, j + 16 + k) + k_head;
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++)
                    if (64 * c < k_head_bytes) _mm_prefetch(nx + 64 * c, _MM_HINT_T0);
            }
            if (k_type == KV_ROW_F32) {
                const float *src = (const float *)attention_row(a[0].k_blocks, a[0].k_stride, j + k) + a[0].k_offset;
#pragma GCC unroll 8
                for (int c = 0; c < D / 16; c++) _mm512_store_ps(kt[k] + 16 * c, _mm512_loadu_ps(src + 16 * c));
            } else {
                decode_avx512(k_type, attention_row(a[0].k_blocks, a[0].k_stride, j + k), a[0].k_offset, D, kt[k]);
            }
        }
        for (int i = 0; i < n; i++) {
            __m512 qv[8], acc[16];
#pragma GCC unroll 8
            for (int c = 0; c < D / 16; c++) qv[c] = _mm512_loadu_ps(a[i].q + 16 * c);
#pragma GCC unroll 16
            for (int k = 0; k < 16; k++) {
                acc[k] = _mm512_setzero_ps();
#pragma GCC unroll 8
                for (int c = 0; c < D / 16; c++) acc[k] = _mm512_fmadd_ps(qv[c], _mm512_load_ps(kt[k] + 16 * c), acc[k]);
            }
            __m512 dots = reduce16_ps(acc);
            _mm512_storeu_ps(a[i].scores + (j - first), _mm512_mul_ps(dots, _mm512_set1_ps(a[i].scale)));
        }
    }
    /* The rest: one key row in registers against every query that sees it. */
    for (; j < hi; j++) {
        const float *k = row_at(a[0].k_blocks, a[0].k_stride, j, a[0].k_offset, D, k_type, kt[0]);
        __m512 kv[8];
#pragma GCC unroll 8
        for (int c = 0; c < D / 16; c++) kv[c] = _mm512_loadu_ps(k + 16 * c);
        for (int i = 0; i < n; i++) {
            if (j >= a[i].n_keys) continue;
            __m512 acc = _mm512_setzero_ps();
#pragma GCC unroll 8
            for (int c = 0; c < D / 16; c++) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a[i].q + 16 * c), kv[c], acc);
            a[i].scores[j - first] = _mm512_reduce_add_ps(acc) * a[i].scale;
        }
    }
    for (int i = 0; i < n; i++) softmax_scale(a[i].scores, a[i].n_keys - first);
    /* Values: chunks of VCHUNK key rows, every query group of 8 per chunk. */
    enum { VCHUNK = 32 };
    float vt[VCHUNK][128] __attribute__((aligned(64)));
    for (int64_t j0 = first; j0 < hi; j0 += VCHUNK) {
        int64_t j1 = j0 + VCHUNK < hi ? j0 + VCHUNK : hi;
        for (int64_t jj = j0; jj < j1; jj++) {
            if (jj + VCHUNK < hi) {
                const char *nx = (const char *)attention_row(a[0].v_blocks, a[0].v_stride, jj + VCHUNK) + v_head;
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++)
                    if (64 * c < v_head_bytes) _mm_prefetch(nx + 64 * c, _MM_HINT_T0);
            }
            if (v_type == KV_ROW_F32) {
                const float *src = (const float *)attention_row(a[0].v_blocks, a[0].v_stride, jj) + a[0].v_offset;
#pragma GCC unroll 8
                for (int c = 0; c < D / 16; c++) _mm512_store_ps(vt[jj - j0] + 16 * c, _mm512_loadu_ps(src + 16 * c));
            } else {
                decode_avx512(v_type, attention_row(a[0].v_blocks, a[0].v_stride, jj), a[0].v_offset, D, vt[jj - j0]);
            }
        }
        for (int s0 = 0; s0 < n; s0 += MQ) {
            int m = n - s0 < MQ ? n - s0 : MQ;
            /* queries that see none of this chunk keep their out as is */
            (D == 64 ? values_chunk_fns_64 : values_chunk_fns_128)[m](a + s0, (const float (*)[128])vt, first, j0, j1);
        }
    }
}

static void heads_multi_128(const attention_head_args *a, int n) { heads_multi(128, a, n); }
static void heads_multi_64(const attention_head_args *a, int n) { heads_multi(64, a, n); }

void attention_heads_avx512(const attention_head_args *a, int n) {
    int i = 0;
    while (i < n) {
        int m = 1;
        const int d = a[i].d_k;
        const bool multi = (d == 128 || d == 64) && a[i].d_v == d;
        if (multi)
            while (i + m < n && attention_same_kv(&a[i], &a[i + m])) m++;
        if (multi && d == 128)
            heads_multi_128(a + i, m);
        else if (multi)
            heads_multi_64(a + i, m);
        else
            attention_head_avx512(a + i);
        i += m;
    }
}
