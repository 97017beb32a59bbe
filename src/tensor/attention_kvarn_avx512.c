/* attention_kvarn_avx512.c - attention over a kvarn pool with AVX-512 (see
 * attention_kvarn_impl.h), for heads whose sizes are multiples of 16.
 *
 * The same sums as the scalar kernel, 16 lanes at a time: fp16 rows are
 * converted with vcvtph2ps; 16 codes of a sealed row are one masked load,
 * picked per lane with vpshufb, shifted and masked (unit16_packed),
 * widened to floats and mapped to unit values u = code * step - 1 with one
 * FMA. A sealed group's codes of one head are contiguous (kvarn.h), so
 * the loads stream.
 * Each head keeps one vector accumulator per score and reduces it with a
 * fixed tree, so the result depends only on the head size. */
#include <immintrin.h>
#include <stdbool.h>
#include <string.h>

#include "tensor/attention_kvarn_impl.h"
#include "tensor/kvarn.h"
#include "tensor/ops.h"

enum { HEAD_CHUNK = ATTENTION_KVARN_HEAD_CHUNK };

/* Unit values of 16 codes packed from p (16 * bits bits, bits < 8): 16
 * bytes are loaded once (the codes' 2 * bits bytes and a few after them,
 * which stay inside the pool: kv_pool.h pads its memory), each lane picks
 * the two bytes its code lies in (vpshufb), shifts and masks them, and
 * u = code * step - 1 is one FMA. */
static inline __m512 unit16_packed(const uint8_t *p, int bits, __m512i pick, __m512i shifts, __m512i mask, __m512 step,
                                   __m512 one) {
    (void)bits;
    __m128i raw = _mm_loadu_si128((const __m128i *)p);
    __m512i w = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(raw), pick);
    __m512i c = _mm512_and_si512(_mm512_srlv_epi32(w, shifts), mask);
    return _mm512_fmsub_ps(_mm512_cvtepi32_ps(c), step, one);
}

/* Per lane i of unit16_packed: the bytes holding code i, and its shift. */
static void packed_tables(int bits, __m512i *pick, __m512i *shifts) {
    _Alignas(64) int32_t pk[16], sh[16];
    for (int i = 0; i < 16; i++) {
        int b0 = i * bits / 8, b1 = b0 + 1 < 16 ? b0 + 1 : 0x80;
        pk[i] = (int32_t)((uint32_t)b0 | (uint32_t)b1 << 8 | 0x80u << 16 | 0x80u << 24);
        sh[i] = i * bits % 8;
    }
    *pick = _mm512_load_si512(pk);
    *shifts = _mm512_load_si512(sh);
}

enum { PREFETCH_AHEAD = 16, CODES_AHEAD = 32 };

/* The cache lines of bytes [p, p + n) (n <= 256). */
static inline void prefetch_slice(const uint8_t *p, int n) {
    for (int b = 0; b < n; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

static inline __m512 unit16(const uint8_t *codes, __m512 step, __m512 one) {
    __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes)));
    return _mm512_fmsub_ps(c, step, one);
}

static inline __m512 f16x16(const uint8_t *row) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)row));
}

static void rotate_copy(float *dst, const float *src, int d) {
    memcpy(dst, src, (size_t)d * sizeof(float));
    kvarn_rotate(dst, d, d);
}

/* Values of one group over columns [c, c + 16 cw) for nh heads: each
 * head's sum over the group's keys (p_j row_j u_j for a sealed group, p_j v_j
 * for fp16 rows) in registers; a sealed group's sum times its column
 * factors goes to qc (rotated back by the caller), an fp16 group's adds to
 * out. */
static inline __attribute__((always_inline)) void
value_strip(float (*qc)[ATTENTION_MAX_HEAD], const int cw, int c, bool sealed, const attention_kvarn_sealed *sd, int t0,
            const float *rfs, const float *scores, int64_t n, int64_t s0, int64_t nk, const void *const *v_blocks,
            size_t v_stride, int64_t j0, int kvh, int d_v, int bits, __m512i pick, __m512i shifts, __m512i mask,
            __m512 step, __m512 one, const int nh, const float *col, float *out, int h0) {
    __m512 acc[HEAD_CHUNK][8];
#pragma GCC unroll 8
    for (int i = 0; i < nh; i++)
#pragma GCC unroll 8
        for (int k = 0; k < cw; k++) acc[i][k] = _mm512_setzero_ps();
    for (int64_t j = 0; j < nk; j++) {
        __m512 v[8];
        if (sealed) {
            const uint8_t *vc = sd->codes[t0 + j] + (size_t)c * (size_t)bits / 8;
            if (c == 0 && t0 + j + CODES_AHEAD < KVARN_GROUP)
                prefetch_slice(sd->codes[t0 + j + CODES_AHEAD], d_v * bits / 8);
#pragma GCC unroll 8
            for (int k = 0; k < cw; k++)
                v[k] = bits == 8 ? unit16(vc + 16 * k, step, one)
                                 : unit16_packed(vc + 2 * (size_t)bits * (size_t)k, bits, pick, shifts, mask, step, one);
        } else {
            const uint8_t *row = attention_kvarn_row_at(v_blocks, v_stride, j0 + j) + 2 * ((size_t)kvh * (size_t)d_v + (size_t)c);
            if (j + PREFETCH_AHEAD < nk)
                prefetch_slice(attention_kvarn_row_at(v_blocks, v_stride, j0 + j + PREFETCH_AHEAD) +
                                   2 * ((size_t)kvh * (size_t)d_v + (size_t)c),
                               32 * cw);
#pragma GCC unroll 8
            for (int k = 0; k < cw; k++) v[k] = f16x16(row + 32 * (size_t)k);
        }
#pragma GCC unroll 8
        for (int i = 0; i < nh; i++) {
            __m512 w = _mm512_set1_ps(scores[(size_t)i * (size_t)n + (size_t)(s0 + j)] * rfs[j]);
#pragma GCC unroll 8
            for (int k = 0; k < cw; k++) acc[i][k] = _mm512_fmadd_ps(w, v[k], acc[i][k]);
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < nh; i++)
#pragma GCC unroll 8
        for (int k = 0; k < cw; k++) {
            int cc = c + 16 * k;
            if (sealed) {
                _mm512_store_ps(qc[i] + cc, _mm512_mul_ps(acc[i][k], _mm512_load_ps(col + cc)));
            } else {
                float *o = out + (size_t)(h0 + i) * (size_t)d_v + cc;
                _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), acc[i][k]));
            }
        }
}

/* The kernel for nh heads; inlined with nh a constant (1, 2, 4, 8) so the
 * per-head accumulators stay in registers. Scores: key-major, the columns
 * inner. Values: 16 columns at a time, the keys of a group inner, so each
 * head's 16-lane sum lives in one register for the whole group. A sealed
 * group's codes of one head are one contiguous run (kvarn.h), read in
 * order. */
static inline __attribute__((always_inline)) void heads_nh(float *out, const float *q, const void *const *k_blocks,
                                                           const void *const *v_blocks, const attention_kvarn_format *f,
                                                           int64_t pos, int64_t first, int64_t n_keys, int kvh, int h0,
                                                           const int nh, int d_k, int d_v, float scale, float *scores) {
    _Alignas(64) float qr[HEAD_CHUNK][ATTENTION_MAX_HEAD], qc[HEAD_CHUNK][ATTENTION_MAX_HEAD];
    _Alignas(64) float col[ATTENTION_MAX_HEAD];
    _Alignas(64) float kt[16][ATTENTION_MAX_HEAD];
    attention_kvarn_sealed sd;
    size_t k_stride = 2 * (size_t)f->k_width, v_stride = 2 * (size_t)f->v_width;
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 k_step = _mm512_set1_ps(2.0f / (float)((1 << f->k_bits) - 1));
    const __m512 v_step = _mm512_set1_ps(2.0f / (float)((1 << f->v_bits) - 1));
    __m512i k_pick, k_shifts, v_pick, v_shifts;
    packed_tables(f->k_bits, &k_pick, &k_shifts);
    packed_tables(f->v_bits, &v_pick, &v_shifts);
    const __m512i k_mask = _mm512_set1_epi32((1 << f->k_bits) - 1), v_mask = _mm512_set1_epi32((1 << f->v_bits) - 1);
    int64_t n = n_keys - first;
    for (int i = 0; i < nh; i++) rotate_copy(qr[i], q + (size_t)(h0 + i) * (size_t)d_k, d_k);
    int64_t g_first = first / KVARN_GROUP, g_last = (n_keys - 1) / KVARN_GROUP;
    for (int64_t g = g_first; g <= g_last; g++) {
        int64_t j0 = g * KVARN_GROUP > first ? g * KVARN_GROUP : first;
        int64_t j1 = (g + 1) * KVARN_GROUP < n_keys ? (g + 1) * KVARN_GROUP : n_keys;
        if (kvarn_group_sealed(g, pos, f->tail)) {
            attention_kvarn_sealed_at(&sd, f->layout, 0, k_blocks, g, kvh);
            for (int64_t j = j0; j < j1 && j < j0 + CODES_AHEAD; j++)
                prefetch_slice(sd.codes[j - g * KVARN_GROUP], d_k * f->k_bits / 8);
            for (int c = 0; c < d_k; c += 16) _mm512_store_ps(col + c, f16x16(sd.cols + 2 * (size_t)c));
#pragma GCC unroll 8
            for (int i = 0; i < nh; i++)
                for (int c = 0; c < d_k; c += 16)
                    _mm512_store_ps(qc[i] + c, _mm512_mul_ps(_mm512_load_ps(qr[i] + c), _mm512_load_ps(col + c)));
            for (int64_t j = j0; j < j1; j++) {
                int t = (int)(j - g * KVARN_GROUP);
                const uint8_t *kc = sd.codes[t];
                /* A piece is a few KiB spread over 4 KiB pages, where the
                 * hardware streams restart: ask for the codes ahead. */
                if (t + CODES_AHEAD < KVARN_GROUP) prefetch_slice(sd.codes[t + CODES_AHEAD], d_k * f->k_bits / 8);
                uint16_t h;
                memcpy(&h, sd.rows + 2 * (size_t)t, 2);
                float rf = _cvtsh_ss(h);
                __m512 sum[HEAD_CHUNK];
#pragma GCC unroll 8
                for (int i = 0; i < nh; i++) sum[i] = _mm512_setzero_ps();
                for (int c = 0; c < d_k; c += 16) {
                    __m512 u = f->k_bits == 8 ? unit16(kc + c, k_step, one)
                                              : unit16_packed(kc + (size_t)c * (size_t)f->k_bits / 8, f->k_bits, k_pick,
                                                              k_shifts, k_mask, k_step, one);
#pragma GCC unroll 8
                    for (int i = 0; i < nh; i++) sum[i] = _mm512_fmadd_ps(_mm512_load_ps(qc[i] + c), u, sum[i]);
                }
#pragma GCC unroll 8
                for (int i = 0; i < nh; i++)
                    scores[(size_t)i * (size_t)n + (size_t)(j - first)] = rf * _mm512_reduce_add_ps(sum[i]) * scale;
            }
        } else {
            /* Tiles of 16 keys: their slices are converted together first
             * (many loads in flight: fp16 rows are 2 width bytes apart, too
             * sparse for the hardware prefetchers), then each key's dot
             * product is the same fma chain as for one key. */
            for (int64_t jt = j0; jt < j1; jt += 16) {
                int m = j1 - jt < 16 ? (int)(j1 - jt) : 16;
                for (int k = 0; k < m; k++) {
                    const uint8_t *row = attention_kvarn_row_at(k_blocks, k_stride, jt + k) + 2 * (size_t)kvh * (size_t)d_k;
                    if (jt + k + 16 < n_keys)
                        prefetch_slice(attention_kvarn_row_at(k_blocks, k_stride, jt + k + 16) + 2 * (size_t)kvh * (size_t)d_k,
                                       2 * d_k);
                    for (int c = 0; c < d_k; c += 16) _mm512_store_ps(kt[k] + c, f16x16(row + 2 * (size_t)c));
                }
                for (int k = 0; k < m; k++) {
                    __m512 sum[HEAD_CHUNK];
#pragma GCC unroll 8
                    for (int i = 0; i < nh; i++) sum[i] = _mm512_setzero_ps();
                    for (int c = 0; c < d_k; c += 16) {
                        __m512 kv = _mm512_load_ps(kt[k] + c);
#pragma GCC unroll 8
                        for (int i = 0; i < nh; i++)
                            sum[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)(h0 + i) * (size_t)d_k + c), kv, sum[i]);
                    }
#pragma GCC unroll 8
                    for (int i = 0; i < nh; i++)
                        scores[(size_t)i * (size_t)n + (size_t)(jt + k - first)] = 1.0f * _mm512_reduce_add_ps(sum[i]) * scale;
                }
            }
        }
    }
    for (int i = 0; i < nh; i++) {
        op_softmax(scores + (size_t)i * (size_t)n, (int)n);
        memset(out + (size_t)(h0 + i) * (size_t)d_v, 0, (size_t)d_v * sizeof(float));
    }
    for (int64_t g = g_first; g <= g_last; g++) {
        int64_t j0 = g * KVARN_GROUP > first ? g * KVARN_GROUP : first;
        int64_t j1 = (g + 1) * KVARN_GROUP < n_keys ? (g + 1) * KVARN_GROUP : n_keys;
        bool sealed = kvarn_group_sealed(g, pos, f->tail);
        int t0 = (int)(j0 - g * KVARN_GROUP);
        float rfs[KVARN_GROUP];
        if (sealed) {
            attention_kvarn_sealed_at(&sd, f->layout, 1, k_blocks, g, kvh);
            for (int64_t j = j0; j < j1 && j < j0 + CODES_AHEAD; j++)
                prefetch_slice(sd.codes[j - g * KVARN_GROUP], d_v * f->v_bits / 8);
            for (int64_t j = j0; j < j1; j++) {
                uint16_t h;
                memcpy(&h, sd.rows + 2 * (size_t)(j - g * KVARN_GROUP), 2);
                rfs[j - j0] = _cvtsh_ss(h);
            }
            for (int c = 0; c < d_v; c += 16) _mm512_store_ps(col + c, f16x16(sd.cols + 2 * (size_t)c));
        } else {
            for (int64_t j = j0; j < j1; j++) rfs[j - j0] = 1.0f;
        }
        /* Columns in strips of up to 8 vectors (4 when 4 or more heads
         * share the registers; a strip's fp16 values are whole cache
         * lines), the keys of the group inner; each lane's sum runs over the
         * keys in order whatever the strip width. */
        int c = 0;
        if (nh <= 2)
            for (; c + 128 <= d_v; c += 128)
                value_strip(qc, 8, c, sealed, &sd, t0, rfs, scores, n, j0 - first, j1 - j0, v_blocks, v_stride, j0, kvh,
                            d_v, f->v_bits, v_pick, v_shifts, v_mask, v_step, one, nh, col, out, h0);
        for (; c + 64 <= d_v; c += 64) value_strip(qc, 4, c, sealed, &sd, t0, rfs, scores, n, j0 - first, j1 - j0, v_blocks,
                                                   v_stride, j0, kvh, d_v, f->v_bits, v_pick, v_shifts, v_mask, v_step,
                                                   one, nh, col, out, h0);
        for (; c < d_v; c += 16) value_strip(qc, 1, c, sealed, &sd, t0, rfs, scores, n, j0 - first, j1 - j0, v_blocks,
                                             v_stride, j0, kvh, d_v, f->v_bits, v_pick, v_shifts, v_mask, v_step, one,
                                             nh, col, out, h0);
        if (sealed)
            for (int i = 0; i < nh; i++) { /* qc[i] holds the group's rotated sum now */
                float *o = out + (size_t)(h0 + i) * (size_t)d_v;
                kvarn_rotate(qc[i], d_v, d_v);
                for (int cc = 0; cc < d_v; cc += 16)
                    _mm512_storeu_ps(o + cc, _mm512_add_ps(_mm512_loadu_ps(o + cc), _mm512_load_ps(qc[i] + cc)));
            }
    }
}

void attention_kvarn_heads_avx512(float *out, const float *q, const void *const *k_blocks, const void *const *v_blocks,
                                  const attention_kvarn_format *f, int64_t pos, int64_t first, int64_t n_keys,
                                  int kvh, int h0, int nh, int d_k, int d_v, float scale, float *scores) {
    switch (nh) {
    case 1: heads_nh(out, q, k_blocks, v_blocks, f, pos, first, n_keys, kvh, h0, 1, d_k, d_v, scale, scores); return;
    case 2: heads_nh(out, q, k_blocks, v_blocks, f, pos, first, n_keys, kvh, h0, 2, d_k, d_v, scale, scores); return;
    case 4: heads_nh(out, q, k_blocks, v_blocks, f, pos, first, n_keys, kvh, h0, 4, d_k, d_v, scale, scores); return;
    default:
        for (int i = 0; i < nh; i++)
            heads_nh(out, q, k_blocks, v_blocks, f, pos, first, n_keys, kvh, h0 + i, 1, d_k, d_v, scale,
                     scores + (size_t)i * (size_t)(n_keys - first));
        return;
    }
}
