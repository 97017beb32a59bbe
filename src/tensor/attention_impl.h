/* attention_impl.h - the per-head attention kernels behind op_attention_paged
 * (internal to src/tensor). One implementation per instruction set, chosen
 * with the same ISA as the quantized dot products (quant_get_isa).
 *
 * K and V rows are read in their storage format (kv_rows.h): f32 rows are
 * used in place; f16, q8_0 and q12h rows are decoded one row (or one tile
 * of rows) at a time into registers or a small buffer, never the whole
 * context. Decoding is exact, so every kernel computes on the decoded
 * values with the f32 kernel's operation order. `q` is already in the
 * domain of the decoded keys (kv_row_query: rotated for q12h keys). */
#ifndef EMBER_TENSOR_ATTENTION_IMPL_H
#define EMBER_TENSOR_ATTENTION_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tensor/kv_rows.h"
#include "tensor/quant.h" /* block_q8_0 (value_byte) */
#include "tensor/ops.h"

typedef struct attention_head_args {
    float *out;               /* (d_v) */
    const float *q;           /* (d_k) */
    const void *const *k_blocks; /* key j: row j%16 of k_blocks[j/16], k_stride bytes per row */
    const void *const *v_blocks;
    int64_t first, n_keys;    /* keys [first, n_keys) are visible */
    size_t k_stride, v_stride; /* bytes per K / V row (all kv heads) */
    int k_offset, v_offset;   /* this head's first value within a row */
    int d_k, d_v;
    kv_row_type k_type, v_type; /* storage formats of K and V rows (kv_row_key_type) */
    float scale;
    float *scores;            /* (n_keys - first) scratch */
    /* bf16 kernel only: this kv head's prebuilt tiles for keys
     * [0, bf16_tiled_keys) (attention_bf16_tiles_build_avx512bf16), or NULL:
     * the kernel builds its own */
    const void *bf16_tiles;
    int64_t bf16_tiled_keys;
    bool int8;                /* bf16 kernel: both products on int8 (ATTENTION_INT8) */
} attention_head_args;

/* The encoded row of key (or value) j. */
static inline const uint8_t *attention_row(const void *const *blocks, size_t stride, int64_t j) {
    return (const uint8_t *)blocks[j / 16] + (size_t)(j % 16) * stride;
}

/* Whether pairs a and b read the same keys and values (one kv head, the
 * same rows from the same first key, heads of the same size): the
 * multi-query kernels take such neighbours together. */
static inline bool attention_same_kv(const attention_head_args *a, const attention_head_args *b) {
    return a->d_k == b->d_k && a->d_v == b->d_v && a->k_blocks == b->k_blocks && a->v_blocks == b->v_blocks &&
           a->k_offset == b->k_offset && a->v_offset == b->v_offset && a->k_stride == b->k_stride &&
           a->v_stride == b->v_stride && a->k_type == b->k_type && a->v_type == b->v_type && a->first == b->first &&
           a->bf16_tiles == b->bf16_tiles && a->int8 == b->int8;
}

/* Where value `offset` of a row starts, in bytes (offset on a q8_0 block
 * boundary), for prefetching. */
static inline size_t value_byte(kv_row_type type, int offset) {
    switch (type) {
    case KV_ROW_F16: return 2 * (size_t)offset;
    case KV_ROW_Q8_0: return (size_t)(offset / KV_ROW_Q8_0_BLOCK) * sizeof(block_q8_0);
    case KV_ROW_Q12H: return (size_t)(offset / KV_ROW_Q12H_BLOCK) * sizeof(kv_block_q12h);
    default: return 4 * (size_t)offset;
    }
}

void attention_head_scalar(const attention_head_args *a);
void attention_head_avx512(const attention_head_args *a);
/* n heads; the same bits as attention_head_avx512 on each, faster when
 * neighbours share a kv head (same blocks and offsets). */
void attention_heads_avx512(const attention_head_args *a, int n);
/* AVX2 (attention_avx2.c): the same contract, 8 lanes. */
void attention_head_avx2(const attention_head_args *a);
void attention_heads_avx2(const attention_head_args *a, int n);
/* ATTENTION_BF16 and ATTENTION_INT8 (attention_avx512bf16.c, only where
 * the CPU has AVX512_BF16; int8 when the pairs' int8 is set): the
 * same grouping as attention_heads_avx512, heads of 64 or 128 values
 * (d_k = d_v); bf16 (and int8) products, so other bits than the f32
 * kernels, but a query's bits still depend on its own inputs alone. */
void attention_heads_avx512bf16(const attention_head_args *a, int n);
/* Bytes of the bf16 kernel's tiles of one 64-key block, heads of d values:
 * two K tiles of d vectors, a V tile of 32 pairs x 8 vectors, 64 bytes each. */
#define ATTENTION_BF16_TILE_BYTES(d) ((size_t)(2 * (d) + 32 * 8) * 64)
/* At ATTENTION_INT8: four K tiles of 16 keys (d/4 vectors of bytes and
 * one of steps each), a V tile of 16 quads of keys (d/16 vectors of bytes
 * each) and 4 vectors of the keys' steps. */
#define ATTENTION_INT8_TILE_BYTES(d) ((size_t)(4 * ((d) / 4 + 1) + 16 * ((d) / 16) + 4) * 64)

/* The bf16 kernel's K and V tiles of 64-key blocks [block_begin, block_end)
 * of the kv head a describes (k_blocks, strides, offsets, types, d_k = d_v
 * of 64 or 128, int8), for keys [0, a->n_keys) (rows from there on
 * zero), into tiles: ATTENTION_BF16_TILE_BYTES(d) bytes per block
 * (ATTENTION_INT8_TILE_BYTES(d) with int8), block b at b * that. The
 * same values the kernel builds per call. */
void attention_bf16_tiles_build_avx512bf16(void *tiles, const attention_head_args *a, int64_t block_begin,
                                           int64_t block_end);

#endif
