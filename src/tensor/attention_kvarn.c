/* attention_kvarn.c - attention over a kvarn pool (see attention_kvarn.h).
 *
 * One call handles the query heads of one kv head for each row, up to
 * HEAD_CHUNK heads at a time, so every key's codes are unpacked once for all
 * the heads that read them (GQA pairs on qwen3). Keys are walked group by
 * group, in position order:
 *
 *   fp16 group:   score = q . k          out += p v
 *   sealed group: score = row_t * sum_i (Hq)_i col_i u_ti
 *                 acc   += p_t row_t u_t  (per column, rotated domain)
 *                 out  += H (acc * col)   once per group
 *
 * where u = code * 2 / (2^bits - 1) - 1 is the unit value of a code and H
 * the per-slice orthonormal Walsh-Hadamard rotation (its own inverse).
 * Every sum runs in a fixed order that depends only on the row's position
 * and the pool, which is what the cache's warm == cold invariant needs. */
#include "tensor/attention_kvarn.h"

#include <string.h>

#include "tensor/attention_kvarn_impl.h"
#include "tensor/kvarn.h"
#include "tensor/ops.h"
#include "tensor/quant.h"

#define row_at attention_kvarn_row_at
enum { HEAD_CHUNK = ATTENTION_KVARN_HEAD_CHUNK };

static float dot(const float *a, const float *b, int n) {
    float acc[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[i + k] * b[i + k];
    float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static void f16_values(const uint8_t *row, int c0, int n, float *dst) {
    for (int i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, row + 2 * (size_t)(c0 + i), 2);
        dst[i] = quant_f16_to_f32(h);
    }
}

/* Unit values of the n codes packed from `codes`. */
static void unit_values(const uint8_t *codes, int n, int bits, float step, float *dst) {
    unsigned mask = (1u << bits) - 1u;
    if (bits == 8) {
        for (int i = 0; i < n; i++) dst[i] = (float)codes[i] * step - 1.0f;
        return;
    }
    uint64_t off = 0;
    for (int i = 0; i < n; i++, off += (uint64_t)bits) {
        unsigned w = (unsigned)codes[off >> 3];
        if ((off & 7) + (uint64_t)bits > 8) w |= (unsigned)codes[(off >> 3) + 1] << 8; /* never past the token */
        dst[i] = (float)(w >> (off & 7) & mask) * step - 1.0f;
    }
}

static void f16_factors(const uint8_t *src, int n, float *dst) { f16_values(src, 0, n, dst); }

static uint16_t row_factor(const uint8_t *rows, int t) {
    uint16_t h;
    memcpy(&h, rows + 2 * (size_t)t, 2);
    return h;
}

/* Heads [h0, h0 + nh) of one row over keys [first, n_keys). */
void attention_kvarn_heads_scalar(float *out, const float *q, const void *const *k_blocks, const void *const *v_blocks,
                      const attention_kvarn_format *f, int64_t pos, int64_t first, int64_t n_keys, int kvh, int h0,
                      int nh, int d_k, int d_v, float scale, float *scores) {
    float qr[HEAD_CHUNK][ATTENTION_MAX_HEAD], qc[HEAD_CHUNK][ATTENTION_MAX_HEAD];
    float col[ATTENTION_MAX_HEAD], buf[ATTENTION_MAX_HEAD], acc[HEAD_CHUNK][ATTENTION_MAX_HEAD];
    attention_kvarn_sealed sealed;
    size_t k_stride = 2 * (size_t)f->k_width, v_stride = 2 * (size_t)f->v_width;
    float k_step = 2.0f / (float)((1 << f->k_bits) - 1), v_step = 2.0f / (float)((1 << f->v_bits) - 1);
    int64_t n = n_keys - first;
    for (int i = 0; i < nh; i++) {
        memcpy(qr[i], q + (size_t)(h0 + i) * (size_t)d_k, (size_t)d_k * sizeof(float));
        kvarn_rotate(qr[i], d_k, d_k);
    }
    int64_t g_first = first / KVARN_GROUP, g_last = (n_keys - 1) / KVARN_GROUP;
    /* Scores. */
    for (int64_t g = g_first; g <= g_last; g++) {
        int64_t j0 = g * KVARN_GROUP > first ? g * KVARN_GROUP : first;
        int64_t j1 = (g + 1) * KVARN_GROUP < n_keys ? (g + 1) * KVARN_GROUP : n_keys;
        if (kvarn_group_sealed(g, pos, f->tail)) {
            attention_kvarn_sealed_at(&sealed, f->layout, 0, k_blocks, g, kvh);
            f16_factors(sealed.cols, d_k, col);
            for (int i = 0; i < nh; i++)
                for (int c = 0; c < d_k; c++) qc[i][c] = qr[i][c] * col[c];
            for (int64_t j = j0; j < j1; j++) {
                int t = (int)(j - g * KVARN_GROUP);
                unit_values(sealed.codes[t], d_k, f->k_bits, k_step, buf);
                float rf = quant_f16_to_f32(row_factor(sealed.rows, t));
                for (int i = 0; i < nh; i++) scores[(size_t)i * (size_t)n + (size_t)(j - first)] = rf * dot(qc[i], buf, d_k) * scale;
            }
        } else {
            for (int64_t j = j0; j < j1; j++) {
                f16_values(row_at(k_blocks, k_stride, j), kvh * d_k, d_k, buf);
                for (int i = 0; i < nh; i++)
                    scores[(size_t)i * (size_t)n + (size_t)(j - first)] =
                        dot(q + (size_t)(h0 + i) * (size_t)d_k, buf, d_k) * scale;
            }
        }
    }
    for (int i = 0; i < nh; i++) {
        op_softmax(scores + (size_t)i * (size_t)n, (int)n);
        memset(out + (size_t)(h0 + i) * (size_t)d_v, 0, (size_t)d_v * sizeof(float));
    }
    /* Values. */
    for (int64_t g = g_first; g <= g_last; g++) {
        int64_t j0 = g * KVARN_GROUP > first ? g * KVARN_GROUP : first;
        int64_t j1 = (g + 1) * KVARN_GROUP < n_keys ? (g + 1) * KVARN_GROUP : n_keys;
        if (kvarn_group_sealed(g, pos, f->tail)) {
            for (int i = 0; i < nh; i++) memset(acc[i], 0, (size_t)d_v * sizeof(float));
            attention_kvarn_sealed_at(&sealed, f->layout, 1, k_blocks, g, kvh);
            for (int64_t j = j0; j < j1; j++) {
                int t = (int)(j - g * KVARN_GROUP);
                unit_values(sealed.codes[t], d_v, f->v_bits, v_step, buf);
                float rf = quant_f16_to_f32(row_factor(sealed.rows, t));
                for (int i = 0; i < nh; i++) {
                    float w = scores[(size_t)i * (size_t)n + (size_t)(j - first)] * rf;
                    for (int c = 0; c < d_v; c++) acc[i][c] += w * buf[c];
                }
            }
            f16_factors(sealed.cols, d_v, col);
            for (int i = 0; i < nh; i++) {
                float *o = out + (size_t)(h0 + i) * (size_t)d_v;
                for (int c = 0; c < d_v; c++) acc[i][c] *= col[c];
                kvarn_rotate(acc[i], d_v, d_v);
                for (int c = 0; c < d_v; c++) o[c] += acc[i][c];
            }
        } else {
            for (int64_t j = j0; j < j1; j++) {
                f16_values(row_at(v_blocks, v_stride, j), kvh * d_v, d_v, buf);
                for (int i = 0; i < nh; i++) {
                    float p = scores[(size_t)i * (size_t)n + (size_t)(j - first)];
                    float *o = out + (size_t)(h0 + i) * (size_t)d_v;
                    for (int c = 0; c < d_v; c++) o[c] += p * buf[c];
                }
            }
        }
    }
}

void op_attention_kvarn_rows(float *out, size_t out_stride, const float *q, size_t q_stride,
                             const void *const *k_blocks, const void *const *v_blocks,
                             const attention_kvarn_format *fmt, const int64_t *query_pos, int n_rows, int n_head,
                             int n_head_kv, int d_k, int d_v, float scale, int64_t window, int head_begin,
                             int head_end, float *scratch) {
    int group = n_head / n_head_kv;
    attention_kvarn_heads_fn heads = attention_kvarn_heads_scalar;
    if (quant_get_isa() == QUANT_ISA_AVX512 && d_k % 16 == 0 && d_v % 16 == 0) heads = attention_kvarn_heads_avx512;
    for (int r = 0; r < n_rows; r++) {
        int64_t pos = query_pos[r], first = 0;
        if (window > 0 && pos - window + 1 > 0) first = pos - window + 1;
        for (int h0 = head_begin; h0 < head_end; h0 += HEAD_CHUNK) {
            int nh = head_end - h0 < HEAD_CHUNK ? head_end - h0 : HEAD_CHUNK;
            /* Heads of a chunk share a kv head when the caller keeps to one group. */
            for (int i = 0; i < nh;) {
                int kvh = (h0 + i) / group, same = 1;
                while (i + same < nh && (h0 + i + same) / group == kvh) same++;
                heads(out + (size_t)r * out_stride, q + (size_t)r * q_stride, k_blocks, v_blocks, fmt, pos, first,
                          pos + 1, kvh, h0 + i, same, d_k, d_v, scale, scratch);
                i += same;
            }
        }
    }
}
