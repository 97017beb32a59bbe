/* kv_pool.h - paged KV memory: one pool of fixed 16-token blocks.
 *
 * Contract:
 *  - A block holds the K and V rows of KV_BLOCK_TOKENS consecutive positions
 *    for every attention layer of the model (layers without a KV cache have
 *    width 0). Blocks are refcounted; kv_block_alloc hands out a block with
 *    refcount 1, kv_block_unref drops a reference.
 *  - A block whose refcount reaches 0 goes to the tail of the free queue. It
 *    keeps its contents, so an owner that indexed it (the prompt cache) can
 *    take it back with kv_block_ref while it is still there. Allocation takes
 *    the head of the queue (least recently freed); if that block was indexed,
 *    the pool first calls the evict hook so the owner forgets it. This is the
 *    whole mechanism of "unreferenced cached blocks stay findable until LRU
 *    eviction reclaims them" (design.md §5).
 *  - A sequence's block table (kv_seq) maps position p to block
 *    table[p / 16], row p % 16. Before a forward pass writes positions
 *    [n_tokens, n_tokens + n), kv_seq_prepare_append makes sure those rows
 *    live in blocks the sequence owns alone: a shared partial last block is
 *    copied first (copy-on-write), new blocks are allocated.
 *  - Not thread-safe: the scheduler owns the pool. */
#ifndef EMBER_KV_POOL_H
#define EMBER_KV_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/error.h"

#define KV_BLOCK_TOKENS 16

typedef struct kv_pool kv_pool;

typedef struct kv_pool_config {
    int n_layer;
    const int *k_width;  /* (n_layer) floats per K row: n_head_kv * d_k; 0 = no KV */
    const int *v_width;  /* (n_layer) floats per V row */
    int32_t n_blocks;
} kv_pool_config;

/* Called when an indexed block is about to be reused for something else. */
typedef void (*kv_evict_fn)(void *owner, int32_t block);

typedef struct kv_seq {
    int32_t *blocks;     /* (cap) block ids, table[i] covers positions [16i, 16i+16) */
    int32_t n_blocks;
    int32_t cap;
    int64_t n_tokens;    /* positions [0, n_tokens) hold valid K/V */
} kv_seq;

/* ---- Pool lifetime ---- */
kv_pool *kv_pool_create(const kv_pool_config *cfg, ember_error *err);
void kv_pool_free(kv_pool *pool);
void kv_pool_set_evict_hook(kv_pool *pool, kv_evict_fn fn, void *owner);

/* ---- Blocks ---- */
int32_t kv_block_alloc(kv_pool *pool);             /* -1 when every block is referenced */
void kv_block_ref(kv_pool *pool, int32_t block);   /* also takes a free block back */
void kv_block_unref(kv_pool *pool, int32_t block);
int32_t kv_block_refcount(const kv_pool *pool, int32_t block);
void kv_block_set_indexed(kv_pool *pool, int32_t block, bool indexed);
bool kv_block_is_indexed(const kv_pool *pool, int32_t block);
void kv_block_copy(kv_pool *pool, int32_t dst, int32_t src);
float *kv_block_k(const kv_pool *pool, int32_t block, int layer); /* (16, k_width[layer]) */
float *kv_block_v(const kv_pool *pool, int32_t block, int layer); /* (16, v_width[layer]) */

/* ---- Sequences ---- */
void kv_seq_init(kv_seq *seq);
int kv_seq_prepare_append(kv_pool *pool, kv_seq *seq, int64_t n_new, ember_error *err);
void kv_seq_release(kv_pool *pool, kv_seq *seq);   /* unrefs every block, empties the table */
/* Appends an existing block (refcount taken) covering the next 16 positions. */
int kv_seq_adopt_block(kv_pool *pool, kv_seq *seq, int32_t block, ember_error *err);
/* Drops positions >= n_tokens (blocks wholly past the end are unreferenced). */
void kv_seq_truncate(kv_pool *pool, kv_seq *seq, int64_t n_tokens);

/* ---- Statistics ---- */
int32_t kv_pool_n_blocks(const kv_pool *pool);
int32_t kv_pool_n_free(const kv_pool *pool);        /* refcount 0 (includes indexed) */
size_t kv_pool_block_bytes(const kv_pool *pool);
uint64_t kv_pool_evictions(const kv_pool *pool);

#endif
