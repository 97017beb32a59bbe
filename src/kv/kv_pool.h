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
 *  - Rows are stored in the pool's KV format (kv_format, chosen per server):
 *    f32, f16 or q8_0 (tensor/kv_rows.h). A row of `width` values takes
 *    kv_pool_row_bytes bytes, a multiple of 4, so the prompt cache copies
 *    rows as 32-bit words whatever the format (kv_block_k/v hand out word
 *    pointers; only f32 words are floats). kv_row_write encodes, attention
 *    reads the encoded rows directly (ops.h).
 *  - kvarn (KV_FORMAT_KVARN, docs/kv-formats.md) stores rows as f16 and
 *    seals every 128-token group g >= 1 into a kvarn record (tensor/kvarn.h)
 *    once a query at position 128 (g + 1) + tail reads it: from that query
 *    on, the group is read as the record, before it as fp16 rows. The rule
 *    is a function of absolute positions only, so the representation a query
 *    sees never depends on batching or on where a prefix came from.
 *    Sealing (kv_kvarn_seal_group, layer by layer) writes the group's
 *    records compactly and head-major (tensor/kvarn.h) into the first
 *    kv_pool_kvarn_group_blocks blocks of the group (3 of 8 on the qwen3
 *    shape at k6v5), each layer in its own bytes of those blocks, with a
 *    marker that kv_seq_kvarn_check reads back: a prefix adopted from any
 *    tier must hold exactly the groups the rule seals at its length. Once
 *    the last layer is sealed the group's other blocks are given back: the
 *    table entry becomes KV_BLOCK_HOLE and the block is unreferenced.
 *    kv_seq_prepare_append copies a shared block before a group it belongs
 *    to is sealed, and gives back the spare blocks of sealed groups a
 *    prefix adopted from a cache tier brought along (kv_seq_kvarn_compact).
 *  - Why records live in the group's own blocks and not in an arena of
 *    their own: the block stays the pool's one unit of memory, so its
 *    contract is unchanged - refcounts, the evict hook, admission counted in
 *    blocks, copy-on-write - and every cache tier keeps copying a
 *    sequence's blocks word for word (exact snapshots, SSD files, checkpoint
 *    chains): a sealed group's records travel inside its kept blocks, and a
 *    hole reads as a read-only block of zeros (writing one faults), which a
 *    restore writes back as a block that compaction gives back again. An
 *    arena would need its own refcounts, eviction and admission, and a
 *    second path through every snapshot, file and chain. The price is
 *    rounding to whole blocks per group (3 blocks hold 2.82 blocks' worth
 *    of k6v5 records on the qwen3 shape) and holes in block tables, which
 *    kv_block_ref/unref/copy and kv_block_k/v accept.
 *  - Not thread-safe: the scheduler owns the pool. */
#ifndef EMBER_KV_POOL_H
#define EMBER_KV_POOL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/error.h"
#include "tensor/kv_rows.h"
#include "tensor/kvarn.h"
#include "tensor/ops.h"

#define KV_BLOCK_TOKENS 16
/* A block table entry of a sealed kvarn group's given-back block. */
#define KV_BLOCK_HOLE (-1)

typedef struct kv_pool kv_pool;

/* How K/V rows are stored. f32 is exact; f16 halves and q8_0 (8.5 bits a
 * value) nearly quarters the bytes per token, at a small error (measured
 * by bench/bench_kv). kind 0 is f32, so a zeroed config means f32. */
typedef enum kv_format_kind {
    KV_FORMAT_F32 = 0,
    KV_FORMAT_F16 = 1,
    KV_FORMAT_Q8_0 = 2,
    KV_FORMAT_KVARN = 3,
} kv_format_kind;

typedef struct kv_format {
    kv_format_kind kind;
    int k_bits, v_bits;  /* kvarn: record widths, 2..8 */
    int tail;            /* kvarn: tokens kept as fp16 rows after the last sealed group */
} kv_format;

#define KV_FORMAT_CHOICES "f32|f16|q8_0|kvarn[-k<K>v<V>][-t<TAIL>]"
#define KV_KVARN_DEFAULT_K_BITS 6
#define KV_KVARN_DEFAULT_V_BITS 5
#define KV_KVARN_DEFAULT_TAIL 1024

typedef struct kv_pool_config {
    int n_layer;
    const int *k_width;  /* (n_layer) values per K row: n_head_kv * d_k; 0 = no KV */
    const int *v_width;  /* (n_layer) values per V row */
    int32_t n_blocks;
    kv_format format;    /* zero: f32 */
    int k_head, v_head;  /* values per head of a K / V row (kvarn rotates per head); 0 = the whole row */
    /* The attention precision the rows are written under (ops.h; zero:
     * f32), as op_attention_precision resolved it: layer l's rows depend on
     * layer l-1's attention, so it is part of what the rows mean, and the
     * cache's namespaces carry it (apc_disk.h). */
    attention_precision attention;
} kv_pool_config;

/* Called when an indexed block is about to be reused for something else. */
typedef void (*kv_evict_fn)(void *owner, int32_t block);

typedef struct kv_seq {
    int32_t *blocks;     /* (cap) block ids, table[i] covers positions [16i, 16i+16) */
    int32_t n_blocks;
    int32_t cap;
    int64_t n_tokens;    /* positions [0, n_tokens) hold valid K/V */
} kv_seq;

/* ---- KV formats ---- */
/* "f32", "f16", "q8_0", or "kvarn" with optional "-k<K>v<V>" (2..8 bits
 * each) and "-t<TAIL>" (tokens, 0..1048576); ':' also separates. -1: none of these. */
int kv_format_parse(const char *text, kv_format *out);
/* "f32", "f16", "q8_0", "kvarn-k6v5-t1024" (a per-thread buffer for kvarn,
 * valid until the fourth next call in the thread). */
const char *kv_format_name(kv_format f);
bool kv_format_is_kvarn(kv_format f);
/* The type of the pool's V rows; K rows are kv_row_key_type of it (q8_0
 * pools keep K in q12h, rotated: kv_rows.h). */
kv_row_type kv_format_row_type(kv_format f);
/* A number that names the format in cache keys and disk namespaces; 0 for
 * f32 (the namespaces written before formats existed); q8_0's holds its
 * layout version (K rows in q12h); kvarn's holds its widths, tail and
 * KVARN_LAYOUT_VERSION. */
uint64_t kv_format_id(kv_format f);
/* The layout version f's rows have today (1 for f32 and f16, which never
 * changed), and the id f had under an earlier layout version: what an older
 * server wrote, so a start-up can say it found such files and adopts none. */
int kv_format_layout(kv_format f);
uint64_t kv_format_id_of_layout(kv_format f, int layout);
/* Why cfg's rows cannot be stored in cfg->format, or 0 (q8_0 needs widths
 * that are multiples of 32 and heads of a multiple of 8). */
int kv_format_check(const kv_pool_config *cfg, ember_error *err);
/* Bytes one token's K and V take in the pool, all layers: the unit for
 * sizing a pool from a memory budget. */
size_t kv_format_token_bytes(const kv_pool_config *cfg);
/* kvarn: bytes per token of the sealed records alone (codes and factors). */
size_t kv_format_record_token_bytes(const kv_pool_config *cfg);
/* Bytes of pool a token of a sealed group takes (the blocks the group
 * keeps, over its 128 tokens); kv_format_token_bytes outside kvarn. */
size_t kv_format_sealed_token_bytes(const kv_pool_config *cfg);
/* The longest sequence a pool of n_blocks holds in this format: every
 * group the rule seals at its length keeps only its sealed blocks. */
int64_t kv_format_capacity_tokens(const kv_pool_config *cfg, int64_t n_blocks);
/* The blocks a sequence growing to n tokens holds at most (the inverse). */
int64_t kv_format_blocks_for_tokens(const kv_pool_config *cfg, int64_t n);

/* ---- kvarn groups ---- */
/* Does a query at position p read group g as a record? */
bool kv_kvarn_sealed(kv_format f, int64_t g, int64_t p);
/* Groups sealed for a query at p: [1, n) (0 when none). */
int64_t kv_kvarn_sealed_end(kv_format f, int64_t p);
/* Seals group g of layer `layer` in place (its 128 rows must be written and
 * its blocks owned by the sequence alone: kv_seq_prepare_append sees to
 * that). scratch: kv_kvarn_scratch_floats(pool) floats. */
void kv_kvarn_seal_group(kv_pool *pool, kv_seq *seq, int layer, int64_t g, float *scratch);
size_t kv_kvarn_scratch_floats(const kv_pool *pool);
/* True when the first n positions of seq hold exactly what the rule gives a
 * sequence of length n (groups sealed for a query at n - 1, the rest fp16),
 * judged from the records' markers; always true outside kvarn. */
bool kv_seq_kvarn_check(const kv_pool *pool, const kv_seq *seq, int64_t n);
/* The contiguous record (kvarn_encode's layout) of a sealed group; for tests. */
void kv_kvarn_record_gather(const kv_pool *pool, const kv_seq *seq, int layer, int kv, int64_t g, void *record);
/* Gives back the spare blocks of every sealed group of seq that still holds
 * them (a prefix adopted from a cache tier comes with all 8); idempotent.
 * kv_seq_prepare_append calls it. */
void kv_seq_kvarn_compact(kv_pool *pool, kv_seq *seq);
/* kv_format_capacity_tokens for this pool's format and rows. */
int64_t kv_pool_capacity_tokens(const kv_pool *pool, int64_t n_blocks);
/* Blocks a sealed group keeps (8 outside kvarn). */
int32_t kv_pool_kvarn_group_blocks(const kv_pool *pool);
/* Where a sealed group's records lie in layer `layer`'s regions (NULL outside kvarn). */
const kvarn_layout *kv_pool_kvarn_layout(const kv_pool *pool, int layer);
int kv_pool_head(const kv_pool *pool, int kv);      /* values per head, kv 0 = K */
int kv_pool_width(const kv_pool *pool, int layer, int kv);

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
/* Layer `layer`'s 16 K (V) rows of a block, kv_pool_row_bytes apart, as
 * 32-bit words (floats only in f32). */
float *kv_block_k(const kv_pool *pool, int32_t block, int layer);
float *kv_block_v(const kv_pool *pool, int32_t block, int layer);
/* Encodes / decodes row `row` (0..15) of a block; kv 0 = K, 1 = V. */
void kv_row_write(kv_pool *pool, int32_t block, int layer, int kv, int row, const float *src);
void kv_row_read(const kv_pool *pool, int32_t block, int layer, int kv, int row, float *dst);

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
size_t kv_pool_row_bytes(const kv_pool *pool, int layer, int kv); /* kv 0 = K, 1 = V */
kv_format kv_pool_format(const kv_pool *pool);
attention_precision kv_pool_attention(const kv_pool *pool);
uint64_t kv_pool_evictions(const kv_pool *pool);

#endif
