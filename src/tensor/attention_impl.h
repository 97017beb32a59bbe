/* attention_impl.h - the per-head attention kernels behind op_attention_paged
 * (internal to src/tensor). One implementation per instruction set, chosen
 * with the same ISA as the quantized dot products (quant_get_isa). */
#ifndef EMBER_TENSOR_ATTENTION_IMPL_H
#define EMBER_TENSOR_ATTENTION_IMPL_H

#include <stdint.h>

typedef struct attention_head_args {
    float *out;               /* (d_v) */
    const float *q;           /* (d_k) */
    float *const *k_blocks;   /* key j: k_blocks[j/16] + (j%16)*k_row + k_offset */
    float *const *v_blocks;
    int64_t first, n_keys;    /* keys [first, n_keys) are visible */
    int k_row, v_row;         /* floats per K / V row (all kv heads) */
    int k_offset, v_offset;   /* this head's kv head within a row */
    int d_k, d_v;
    float scale;
    float *scores;            /* (n_keys - first) scratch */
} attention_head_args;

void attention_head_scalar(const attention_head_args *a);
void attention_head_avx512(const attention_head_args *a);
/* n heads; the same bits as attention_head_avx512 on each, faster when
 * neighbours share a kv head (same blocks and offsets). */
void attention_heads_avx512(const attention_head_args *a, int n);

#endif
