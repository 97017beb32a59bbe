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

/* The slots of one group (kvarn_slot_fn's context). */
typedef struct attention_kvarn_slots {
    const void *const *blocks;
    size_t stride;
    int64_t base;   /* first position of the group */
} attention_kvarn_slots;

uint8_t *attention_kvarn_slot_at(void *ctx, int t);
static inline const uint8_t *attention_kvarn_row_at(const void *const *blocks, size_t stride, int64_t j) {
    return (const uint8_t *)blocks[j / ATTENTION_KVARN_BLOCK_ROWS] + (size_t)(j % ATTENTION_KVARN_BLOCK_ROWS) * stride;
}
float attention_kvarn_row_factor(const uint8_t *slot, int width, int bits);

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
