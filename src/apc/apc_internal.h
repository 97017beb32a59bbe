/* apc_internal.h - the pieces of the prompt cache, shared by src/apc files.
 *
 *  apc_index  the block tier's table from key to pool block, plus what each
 *             indexed block was stored under (key, parent key, salt,
 *             tokens) so that a hit can be verified;
 *  apc_exact  the exact tier's LRU of whole-state snapshots, and the copies
 *             between a sequence's blocks and a snapshot.
 * Neither locks: the cache (apc.c) calls them under its mutex. */
#ifndef EMBER_APC_INTERNAL_H
#define EMBER_APC_INTERNAL_H

#include "apc/apc.h"
#include "apc/apc_key.h"

/* ---- Block index ---- */
typedef struct apc_block_meta {
    apc_key key;
    apc_key parent;
    uint64_t salt;
    int32_t tokens[KV_BLOCK_TOKENS]; /* rows [0, n_rows) */
    int n_rows;                      /* 16, or 1..15 for a sequence's partial tail */
    bool indexed;
} apc_block_meta;

typedef struct apc_index {
    int32_t n_blocks;
    apc_block_meta *meta;   /* (n_blocks) by pool block id */
    int32_t *slots;         /* open addressing, linear probing; -1 = empty */
    uint32_t mask;          /* slots - 1 (a power of two >= 2 * n_blocks) */
    int32_t n_indexed;
} apc_index;

int apc_index_init(apc_index *ix, int32_t n_blocks);
void apc_index_free(apc_index *ix);
int32_t apc_index_find(const apc_index *ix, const apc_key *key);
/* The key must not be present and the block not indexed. */
void apc_index_insert(apc_index *ix, int32_t block, const apc_key *key, const apc_key *parent, uint64_t salt,
                      const int32_t *tokens, int n_rows);
void apc_index_remove(apc_index *ix, int32_t block);
void apc_index_clear(apc_index *ix);

/* ---- Exact snapshots ---- */
typedef struct apc_layout {
    int n_layer;
    int *k_width;   /* (n_layer) floats per K row */
    int *v_width;   /* (n_layer) */
    size_t row_floats; /* sum over layers of k_width + v_width */
    /* For the SSD tier's namespace and file sizes (0 when unknown/none): */
    size_t state_bytes;  /* model_state_bytes of recurrent stacks, else 0 */
    uint64_t stack_sig;  /* XXH3-64 of every layer's (kind, window, keep) */
} apc_layout;

typedef struct apc_exact_entry {
    struct apc_exact_entry *newer, *older;
    int32_t *tokens;   /* (n) */
    int64_t n;
    uint64_t salt;
    float *data;       /* per layer: K rows [0, n) then V rows [0, n) */
    size_t bytes;      /* data + tokens */
    int pins;          /* readers copying out of data right now */
    bool listed;       /* in the LRU; an unlisted entry dies with its last pin */
    void *state;       /* recurrent stacks: model_state snapshot at n (counted in bytes); else NULL */
    size_t state_bytes;
} apc_exact_entry;

typedef struct apc_exact {
    apc_exact_entry *newest, *oldest;
    int count;
    size_t bytes;
    int max_entries;
    size_t max_bytes;
} apc_exact;

size_t apc_snapshot_bytes(const apc_layout *lay, int64_t n);
/* NULL when out of memory; tokens and data allocated, not filled. */
apc_exact_entry *apc_exact_entry_new(const apc_layout *lay, const int32_t *tokens, int64_t n, uint64_t salt);
void apc_exact_entry_free(apc_exact_entry *e);
void apc_snapshot_copy_out(kv_pool *pool, const apc_layout *lay, const kv_seq *seq, int64_t n, float *data);
void apc_snapshot_copy_in(kv_pool *pool, const apc_layout *lay, const float *data, int64_t n, const kv_seq *seq);

/* Longest entry with this salt that is a prefix of tokens and has
 * 0 < n <= max_len; NULL if none. */
apc_exact_entry *apc_exact_find_prefix(apc_exact *ex, const int32_t *tokens, int64_t max_len, uint64_t salt);
apc_exact_entry *apc_exact_find_same(apc_exact *ex, const int32_t *tokens, int64_t n, uint64_t salt);
void apc_exact_touch(apc_exact *ex, apc_exact_entry *e);
/* Inserts as newest, then drops the oldest entries (never the new one)
 * while over max_entries or max_bytes. Returns how many were dropped. */
int apc_exact_insert(apc_exact *ex, apc_exact_entry *e);
/* Drops one pin; frees the entry when it is unlisted and unpinned. */
void apc_exact_unpin(apc_exact *ex, apc_exact_entry *e);
void apc_exact_clear(apc_exact *ex);

/* ---- Checkpoint tier (apc_ckpt.c) ----
 * The cache (apc.c) owns one apc_ckpt per cache and calls these; the
 * ones named _locked run under the cache's mutex. */
typedef struct apc_ckpt apc_ckpt;
struct cJSON;
apc_ckpt *apc_ckpt_create(apc *c, const cache_layer *stack, int n_layer, const apc_config *cfg);
void apc_ckpt_free(apc_ckpt *k);
void apc_ckpt_reset_locked(apc_ckpt *k);
/* Evicts the least recently used record (non-anchors first); false when
 * there is none. For a pool that ran dry. */
bool apc_ckpt_evict_one_locked(apc_ckpt *k);
void apc_ckpt_stats_locked(apc_ckpt *k, apc_stats *s);
void apc_ckpt_stats_json(const apc_stats *s, struct cJSON *o);
/* Exact-tier anchors: longest anchor that is a prefix of tokens with
 * min < length <= max_len (restored into seq/state), or 0. */
int64_t apc_ckpt_anchor_lookup(apc_ckpt *k, const int32_t *tokens, int64_t max_len, int64_t min, uint64_t salt,
                               kv_seq *seq, struct model_state *state);

/* What apc_ckpt.c needs of the cache (apc.c). */
void apc__lock(apc *c);
void apc__unlock(apc *c);
kv_pool *apc__pool(apc *c);
const apc_layout *apc__layout(apc *c);
apc_ckpt *apc__ckpt(apc *c);
const struct model *apc__state_model(apc *c); /* NULL: no recurrent layers */
size_t apc__state_bytes(apc *c);
/* The SSD tier (NULL: none); apc_disk.h. */
struct apc_disk *apc__disk(apc *c);
apc_hash_kind apc__hash(apc *c);
/* Under the lock: a lookup adopted n tokens (lookups_hit, matched_tokens). */
void apc__count_hit_locked(apc *c, int64_t n);
/* Under the lock: the longest restorable exact entry, 0 if none. */
int64_t apc__exact_best_locked(apc *c, const int32_t *tokens, int64_t max_len, uint64_t salt);

#endif
