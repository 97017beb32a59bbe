/* attention_kvarn_avx512.c - attention over a kvarn pool with AVX-512 (see
 * attention_kvarn_impl.h), for heads whose sizes are multiples of 16.
 *
 * The same sums as the scalar kernel, 16 lanes at a time: fp16 rows are
 * converted with vcvtph2ps; a sealed row's codes are first unpacked to
 * bytes (one unaligned 64-bit load, shift and mask per code), then widened
 * to floats and mapped to unit values u = code * step - 1 with one FMA.
 * Each head keeps one vector accumulator per score and reduces it with a
 * fixed tree, so the result depends only on the head size. */
#include <immintrin.h>
#include <stdbool.h>
#include <string.h>

#include "tensor/attention_kvarn_impl.h"
#include "tensor/kvarn.h"
#include "tensor/ops.h"

enum { HEAD_CHUNK = ATTENTION_KVARN_HEAD_CHUNK };

/* Codes of columns [c0, c0 + n) of a sealed slot, one byte each. The 8-byte
 * window never leaves the slot: its codes take at most 7/8 of the 2-byte
 * values' room below 8 bits, and 8-bit codes are copied. */
static void unpack_codes(const uint8_t *slot, int c0, int n, int bits, uint8_t *out) {
    if (bits == 8) {
        memcpy(out, slot + c0, (size_t)n);
        return;
    }
    uint64_t mask = (1u << bits) - 1u, off = (uint64_t)c0 * (uint64_t)bits;
    for (int i = 0; i < n; i++, off += (uint64_t)bits) {
        uint64_t w;
        memcpy(&w, slot + (off >> 3), 8);
        out[i] = (uint8_t)(w >> (off & 7) & mask);
    }
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

void attention_kvarn_heads_avx512(float *out, const float *q, const void *const *k_blocks, const void *const *v_blocks,
                                  const attention_kvarn_format *f, int64_t pos, int64_t first, int64_t n_keys,
                                  int kvh, int h0, int nh, int d_k, int d_v, float scale, float *scores) {
    _Alignas(64) float qr[HEAD_CHUNK][ATTENTION_MAX_HEAD], qc[HEAD_CHUNK][ATTENTION_MAX_HEAD];
    _Alignas(64) float col[ATTENTION_MAX_HEAD], acc[HEAD_CHUNK][ATTENTION_MAX_HEAD];
    _Alignas(64) uint8_t codes[ATTENTION_MAX_HEAD + 16];
    size_t k_stride = 2 * (size_t)f->k_width, v_stride = 2 * (size_t)f->v_width;
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 k_step = _mm512_set1_ps(2.0f / (float)((1 << f->k_bits) - 1));
    const __m512 v_step = _mm512_set1_ps(2.0f / (float)((1 << f->v_bits) - 1));
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
            for (int i = 0; i < nh; i++)
                for (int c = 0; c < d_k; c += 16)
                    _mm512_store_ps(qc[i] + c, _mm512_mul_ps(_mm512_load_ps(qr[i] + c), _mm512_load_ps(col + c)));
        }
        for (int64_t j = j0; j < j1; j++) {
            const uint8_t *row = attention_kvarn_row_at(k_blocks, k_stride, j);
            __m512 sum[HEAD_CHUNK];
            for (int i = 0; i < nh; i++) sum[i] = _mm512_setzero_ps();
            float rf = 1.0f;
            if (sealed) {
                unpack_codes(row, kvh * d_k, d_k, f->k_bits, codes);
                rf = attention_kvarn_row_factor(row, f->k_width, f->k_bits);
                for (int c = 0; c < d_k; c += 16) {
                    __m512 u = unit16(codes + c, k_step, one);
                    for (int i = 0; i < nh; i++) sum[i] = _mm512_fmadd_ps(_mm512_load_ps(qc[i] + c), u, sum[i]);
                }
            } else {
                const uint8_t *k = row + 2 * (size_t)kvh * (size_t)d_k;
                for (int c = 0; c < d_k; c += 16) {
                    __m512 kv = f16x16(k + 2 * (size_t)c);
                    for (int i = 0; i < nh; i++)
                        sum[i] = _mm512_fmadd_ps(_mm512_loadu_ps(q + (size_t)(h0 + i) * (size_t)d_k + c), kv, sum[i]);
                }
            }
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
        float *dst[HEAD_CHUNK];
        for (int i = 0; i < nh; i++) {
            dst[i] = sealed ? acc[i] : out + (size_t)(h0 + i) * (size_t)d_v;
            if (sealed) memset(acc[i], 0, (size_t)d_v * sizeof(float));
        }
        for (int64_t j = j0; j < j1; j++) {
            const uint8_t *row = attention_kvarn_row_at(v_blocks, v_stride, j);
            float w[HEAD_CHUNK];
            for (int i = 0; i < nh; i++) w[i] = scores[(size_t)i * (size_t)n + (size_t)(j - first)];
            if (sealed) {
                unpack_codes(row, kvh * d_v, d_v, f->v_bits, codes);
                float rf = attention_kvarn_row_factor(row, f->v_width, f->v_bits);
                for (int i = 0; i < nh; i++) w[i] *= rf;
                for (int c = 0; c < d_v; c += 16) {
                    __m512 u = unit16(codes + c, v_step, one);
                    for (int i = 0; i < nh; i++)
                        _mm512_storeu_ps(dst[i] + c, _mm512_fmadd_ps(_mm512_set1_ps(w[i]), u, _mm512_loadu_ps(dst[i] + c)));
                }
            } else {
                const uint8_t *v = row + 2 * (size_t)kvh * (size_t)d_v;
                for (int c = 0; c < d_v; c += 16) {
                    __m512 vv = f16x16(v + 2 * (size_t)c);
                    for (int i = 0; i < nh; i++)
                        _mm512_storeu_ps(dst[i] + c, _mm512_fmadd_ps(_mm512_set1_ps(w[i]), vv, _mm512_loadu_ps(dst[i] + c)));
                }
            }
        }
        if (sealed) {
            attention_kvarn_slots s = {v_blocks, v_stride, g * KVARN_GROUP};
            kvarn_slot_columns(f->v_width, f->v_bits, v_stride, attention_kvarn_slot_at, &s, kvh * d_v, d_v, col);
            for (int i = 0; i < nh; i++) {
                float *o = out + (size_t)(h0 + i) * (size_t)d_v;
                for (int c = 0; c < d_v; c += 16)
                    _mm512_store_ps(acc[i] + c, _mm512_mul_ps(_mm512_load_ps(acc[i] + c), _mm512_load_ps(col + c)));
                kvarn_rotate(acc[i], d_v, d_v);
                for (int c = 0; c < d_v; c += 16)
                    _mm512_storeu_ps(o + c, _mm512_add_ps(_mm512_loadu_ps(o + c), _mm512_load_ps(acc[i] + c)));
            }
        }
    }
}
