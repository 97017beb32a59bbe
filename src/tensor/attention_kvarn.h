/* attention_kvarn.h - causal attention over a kvarn KV pool (kv_pool.h):
 * fp16 rows (the sink, the live group, the tail) and sealed 128-token
 * records (tensor/kvarn.h), read in place.
 *
 * Contract:
 *  - The same interface as op_attention_paged_rows (ops.h), for K/V rows
 *    stored as f16 of k_width / v_width values, with the groups that
 *    kvarn_group_sealed(g, query_pos[r], tail) names read as compact records
 *    in the regions of their first blocks (kvarn.h, fmt->layout; k_blocks[i]
 *    is block i's region, its K rows first; the entries of a sealed group's
 *    other blocks are not read and may be NULL). The caller makes the pool
 *    hold exactly that for every row it passes.
 *  - A record is never decoded to rows: the query is rotated once per head
 *    (the record's Hadamard is orthonormal, so q.k = Hq.Hk), scores are
 *    dot products with the codes times the column and row factors, and the
 *    values of a sealed group are summed in the rotated domain and rotated
 *    back once per group.
 *  - Deterministic and batch-invariant: a row's result depends only on its
 *    query, its position and the pool, never on the other rows or heads.
 *    It differs from attention over kvarn_decode's rows by rounding only
 *    (the order of the sums differs); test_kvarn bounds it.
 *  - head_begin..head_end must lie in one kv head's group (the forward pass
 *    calls it per kv head); scratch: min(8, head_end - head_begin) * (the
 *    largest query position + 1) floats. */
#ifndef EMBER_TENSOR_ATTENTION_KVARN_H
#define EMBER_TENSOR_ATTENTION_KVARN_H

#include <stddef.h>
#include <stdint.h>

#include "tensor/kvarn.h"

typedef struct attention_kvarn_format {
    int k_bits, v_bits;
    int64_t tail;
    int k_width, v_width;   /* values per K / V row, all kv heads */
    const kvarn_layout *layout; /* where a sealed group's records lie (kv_pool_kvarn_layout) */
} attention_kvarn_format;

/* ---- Attention ---- */
void op_attention_kvarn_rows(float *out, size_t out_stride, const float *q, size_t q_stride,
                             const void *const *k_blocks, const void *const *v_blocks,
                             const attention_kvarn_format *fmt, const int64_t *query_pos, int n_rows, int n_head,
                             int n_head_kv, int d_k, int d_v, float scale, int64_t window, int head_begin,
                             int head_end, float *scratch);

#endif
