/* attention_kvarn_avx512.c - attention over a kvarn pool with AVX-512 (see
 * attention_kvarn_impl.h), for heads whose sizes are multiples of 16.
 *
 * The same sums as the scalar kernel, 16 lanes at a time: fp16 rows are
 * converted with vcvtph2ps; 16 codes of a sealed row are two 64-bit loads,
 * shifted per lane and narrowed (unit16_packed), widened to floats and
 * mapped to unit values u = code * step - 1 with one FMA.
 * Each head keeps one vector accumulator per score and reduces it with a
 * fixed tree, so the result depends only on the head size. */
#include <immintrin.h>
#include <stdbool.h>
#include <string.h>

#include "tensor/attention_kvarn_impl.h"
#include "tensor/kvarn.h"
#include "tensor/ops.h"

enum { HEAD_CHUNK = ATTENTION_KVARN_HEAD_CHUNK };

enum { PREFETCH_AHEAD = 32 };

/* The cache lines of the next rows' slice this head reads (at most 256 bytes). */
static inline void prefetch_slice(const uint8_t *p) {
    for (int b = 0; b < 256; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* Unit values of 16 codes packed from p (16 * bits bits, bits < 8): two
 * 64-bit words, each broadcast and shifted per lane, narrowed to 32 bits.
 * No byte is stored, so nothing waits on a store. */
static inline __m512 unit16_packed(const uint8_t *p, int bits, __m512i shifts, __m512i mask, __m512 step, __m512 one) {
    uint64_t w0, w1;
    memcpy(&w0, p, 8);
    memcpy(&w1, p + bits, 8);
    __m512i a = _mm512_and_si512(_mm512_srlv_epi64(_mm512_set1_epi64((long long)w0), shifts), mask);
    __m512i b = _mm512_and_si512(_mm512_srlv_epi64(_mm512_set1_epi64((long long)w1), shifts), mask);
    __m512i c = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi64_epi32(a)), _mm512_cvtepi64_epi32(b), 1);
    return _mm512_fmsub_ps(_mm512_cvtepi32_ps(c), step, one);
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

/* The kernel for nh heads; inlined with nh a constant (1, 2, 4, 8) so the
 * per-head accumulators stay in registers. Scores: key-major, the columns
 * inner. Values: 16 columns at a time, the keys of a group inner, so each
 * head's 16-lane sum lives in one register for the whole group. */
static inline __attribute__((always_inline)) void heads_nh(float *out, const float *q, const void *const *k_blocks,
                                                           const void *const *v_blocks, const attention_kvarn_format *f,
                                                           int64_t pos, int64_t first, int64_t n_keys, int kvh, int h0,
                                                           const int nh, int d_k, int d_v, float scale, float *scores) {
    _Alignas(64) float qr[HEAD_CHUNK][ATTENTION_MAX_HEAD], qc[HEAD_CHUNK][ATTENTION_MAX_HEAD];
    _Alignas(64) float col[ATTENTION_MAX_HEAD];
    float rfs[KVARN_GROUP];
    size_t k_stride = 2 * (size_t)f->k_width, v_stride = 2 * (size_t)f->v_width;
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 k_step = _mm512_set1_ps(2.0f / (float)((1 << f->k_bits) - 1));
    const __m512 v_step = _mm512_set1_ps(2.0f / (float)((1 << f->v_bits) - 1));
    const __m512i k_shifts = _mm512_setr_epi64(0, f->k_bits, 2 * f->k_bits, 3 * f->k_bits, 4 * f->k_bits,
                                               5 * f->k_bits, 6 * f->k_bits, 7 * f->k_bits);
    const __m512i v_shifts = _mm512_setr_epi64(0, f->v_bits, 2 * f->v_bits, 3 * f->v_bits, 4 * f->v_bits,
                                               5 * f->v_bits, 6 * f->v_bits, 7 * f->v_bits);
    const __m512i k_mask = _mm512_set1_epi64((1 << f->k_bits) - 1), v_mask = _mm512_set1_epi64((1 << f->v_bits) - 1);
    size_t v_off = (size_t)kvh * (size_t)d_v * (size_t)f->v_bits / 8;
    int64_t n = n_keys - first;
    for (int i = 0; i < nh; i++) rotate_copy(qr[i], q + (size_t)(h0 + i) * (size_t)d_k, d_k);
    int64_t g_first = first / KVARN_GROUP, g_last = (n_keys - 1) / KVARN_GROUP;
    for (int64_t g = g_first; g <= g_last; g++) {
        int64_t j0 = g * KVARN_GROUP > first ? g * KVARN_GROUP : first;
        int64_t j1 = (g + 1) * KVARN_GROUP < n_keys ? (g + 1) * KVARN_GROUP : n_keys;
        bool sealed = kvarn_group_sealed(g, pos, f->tail);
        if (sealed) {
            attention_kvarn_slots s = {k_blocks, k_stride, g * KVARN_GROUP};
            kvarn_slot_columns(f->k_width, f->k_bits, k_stride, attention_kvarn_slot_at, &s, kvh * d_k, d_k, col);
#pragma GCC unroll 8
            for (int i = 0; i < nh; i++)
                for (int c = 0; c < d_k; c += 16)
                    _mm512_store_ps(qc[i] + c, _mm512_mul_ps(_mm512_load_ps(qr[i] + c), _mm512_load_ps(col + c)));
        }
        size_t k_off = sealed ? (size_t)kvh * (size_t)d_k * (size_t)f->k_bits / 8 : 2 * (size_t)kvh * (size_t)d_k;
        for (int64_t j = j0; j < j1; j++) {
            const uint8_t *row = attention_kvarn_row_at(k_blocks, k_stride, j);
            /* Rows are 2 width bytes apart and a head reads a thin slice of
             * each: too sparse for the hardware prefetchers, so ask ahead. */
            if (j + PREFETCH_AHEAD < j1) prefetch_slice(attention_kvarn_row_at(k_blocks, k_stride, j + PREFETCH_AHEAD) + k_off);
            __m512 sum[HEAD_CHUNK];
#pragma GCC unroll 8
            for (int i = 0; i < nh; i++) sum[i] = _mm512_setzero_ps();
            float rf = 1.0f;
            if (sealed) {
                rf = attention_kvarn_row_factor(row, f->k_width, f->k_bits);
                const uint8_t *kc = row + k_off;
                for (int c = 0; c < d_k; c += 16) {
                    __m512 u = f->k_bits == 8 ? unit16(kc + c, k_step, one)
                                              : unit16_packed(kc + (size_t)c * (size_t)f->k_bits / 8, f->k_bits, k_shifts,
                                                              k_mask, k_step, one);
#pragma GCC unroll 8
                    for (int i = 0; i < nh; i++) sum[i] = _mm512_fmadd_ps(_mm512_load_ps(qc[i] + c), u, sum[i]);
                }
            } else {
                const uint8_t *k = row + 2 * (size_t)kvh * (size_t)d_k;
                for (int c = 0; c < d_k; c += 16) {
                    __m512 kv = f16x16(k + 2 * (size_t)c);
#pragma GCC unroll 8
                    for (int i = 0; i < nh; i++)
                        sum[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)(h0 + i) * (size_t)d_k + c), kv, sum[i]);
                }
            }
#pragma GCC unroll 8
            for (int i = 0; i < nh; i++)
                scores[(size_t)i * (size_t)n + (size_t)(j - first)] = rf * _mm512_reduce_add_ps(sum[i]) * scale;
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
        if (sealed) {
            /* codes and row factors of the group's keys, once */
            for (int64_t j = j0; j < j1; j++) {
                const uint8_t *row = attention_kvarn_row_at(v_blocks, v_stride, j);
                prefetch_slice(row + v_off); /* read below, 16 columns at a time */
                rfs[j - j0] = attention_kvarn_row_factor(row, f->v_width, f->v_bits);
            }
            attention_kvarn_slots s = {v_blocks, v_stride, g * KVARN_GROUP};
            kvarn_slot_columns(f->v_width, f->v_bits, v_stride, attention_kvarn_slot_at, &s, kvh * d_v, d_v, col);
        }
        for (int c = 0; c < d_v; c += 16) {
            __m512 acc[HEAD_CHUNK];
#pragma GCC unroll 8
            for (int i = 0; i < nh; i++) acc[i] = _mm512_setzero_ps();
            for (int64_t j = j0; j < j1; j++) {
                __m512 v;
                float rf = 1.0f;
                if (sealed) {
                    const uint8_t *vc = attention_kvarn_row_at(v_blocks, v_stride, j) + v_off;
                    v = f->v_bits == 8 ? unit16(vc + c, v_step, one)
                                       : unit16_packed(vc + (size_t)c * (size_t)f->v_bits / 8, f->v_bits, v_shifts,
                                                       v_mask, v_step, one);
                    rf = rfs[j - j0];
                } else {
                    v = f16x16(attention_kvarn_row_at(v_blocks, v_stride, j) + 2 * ((size_t)kvh * (size_t)d_v + (size_t)c));
                }
#pragma GCC unroll 8
                for (int i = 0; i < nh; i++)
                    acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(scores[(size_t)i * (size_t)n + (size_t)(j - first)] * rf), v, acc[i]);
            }
            if (sealed) {
#pragma GCC unroll 8
                for (int i = 0; i < nh; i++) _mm512_store_ps(qc[i] + c, _mm512_mul_ps(acc[i], _mm512_load_ps(col + c)));
            } else {
#pragma GCC unroll 8
                for (int i = 0; i < nh; i++) {
                    float *o = out + (size_t)(h0 + i) * (size_t)d_v + c;
                    _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), acc[i]));
                }
            }
        }
        if (sealed)
            for (int i = 0; i < nh; i++) { /* qc[i] holds the group's rotated sum now */
                float *o = out + (size_t)(h0 + i) * (size_t)d_v;
                kvarn_rotate(qc[i], d_v, d_v);
                for (int c = 0; c < d_v; c += 16)
                    _mm512_storeu_ps(o + c, _mm512_add_ps(_mm512_loadu_ps(o + c), _mm512_load_ps(qc[i] + c)));
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
