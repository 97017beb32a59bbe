/* attention_kvarn_impl.h - the per-head kernels behind op_attention_kvarn_rows
 * (internal to src/tensor): a scalar one for every head size and an
 * AVX-512 one for heads that are multiples of 16, chosen with the same ISA
 * as the quantized dot products (quant_get_isa). Both compute the same
 * sums (attention_kvarn.c's comment) in orders fixed by the head size, so
 * each is deterministic and batch-invariant; they differ from each other
 * by rounding. */
#ifndef EMBER_TENSOR_ATTENTION_KVARN_IMPL_H
#define EMBER_TENSOR_ATTENTION_KVARN_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "tensor/attention_kvarn.h"

#define ATTENTION_KVARN_HEAD_CHUNK 8   /* query heads of one kv head handled together */
#define ATTENTION_KVARN_BLOCK_ROWS 16  /* rows per pool block */

static inline const uint8_t *attention_kvarn_row_at(const void *const *blocks, size_t stride, int64_t j) {
    return (const uint8_t *)blocks[j / ATTENTION_KVARN_BLOCK_ROWS] + (size_t)(j % ATTENTION_KVARN_BLOCK_ROWS) * stride;
}

/* A sealed group as the kernels read it: the factors and each token's codes
 * of one kv head (kvarn.h's pieces), for K or V. */
typedef struct attention_kvarn_sealed {
    const uint8_t *cols;                 /* the head's column factors (fp16) */
    const uint8_t *rows;                 /* the group's 128 row factors (fp16) */
    const uint8_t *codes[KVARN_GROUP];   /* token t's codes of the head */
} attention_kvarn_sealed;

static inline void attention_kvarn_sealed_at(attention_kvarn_sealed *s, const kvarn_layout *lay, int kv,
                                             const void *const *k_blocks, int64_t g, int kvh) {
    const uint8_t *regions[KVARN_MAX_REGIONS];
    for (int r = 0; r < lay->n_regions; r++) regions[r] = k_blocks[g * (KVARN_GROUP / ATTENTION_KVARN_BLOCK_ROWS) + r];
    const uint8_t *f = kvarn_factors_at(lay, kv, regions);
    s->cols = f + 2 * (size_t)kvh * (size_t)lay->head[kv];
    s->rows = f + 2 * (size_t)lay->width[kv];
    kvarn_head_codes(lay, kv, kvh, regions, s->codes);
}

/* Query heads [h0, h0 + nh) (nh <= ATTENTION_KVARN_HEAD_CHUNK, all reading
 * kv head kvh) of one row at position pos over keys [first, n_keys);
 * out and q are the row's (n_head, d) arrays; scores: nh * (n_keys - first). */
typedef void (*attention_kvarn_heads_fn)(float *out, const float *q, const void *const *k_blocks,
                                         const void *const *v_blocks, const attention_kvarn_format *f, int64_t pos,
                                         int64_t first, int64_t n_keys, int kvh, int h0, int nh, int d_k, int d_v,
                                         float scale, float *scores);
void attention_kvarn_heads_scalar(float *out, const float *q, const void *const *k_blocks, const void *const *v_blocks,
                                  const attention_kvarn_format *f, int64_t pos, int64_t first, int64_t n_keys,
                                  int kvh, int h0, int nh, int d_k, int d_v, float scale, float *scores);
void attention_kvarn_heads_avx512(float *out, const float *q, const void *const *k_blocks, const void *const *v_blocks,
                                  const attention_kvarn_format *f, int64_t pos, int64_t first, int64_t n_keys,
                                  int kvh, int h0, int nh, int d_k, int d_v, float scale, float *scores);

#endif
