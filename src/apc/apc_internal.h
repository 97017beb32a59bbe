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
#include "apc/apc_ckpt.h"
#include "apc/apc_key.h"
#include "apc/apc_req.h"

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
    apc_block_listener listener; /* told of every insert, remove and clear; NULL: none */
    void *listener_user;
} apc_index;

/* Every insert, remove and clear is reported to ix->listener (apc.h). */
int apc_index_init(apc_index *ix, int32_t n_blocks);
void apc_index_free(apc_index *ix);
int32_t apc_index_find(const apc_index *ix, const apc_key *key);
/* The key must not be present and the block not indexed. */
void apc_index_insert(apc_index *ix, int32_t block, const apc_key *key, const apc_key *parent, uint64_t salt,
                      const int32_t *tokens, int n_rows);
void apc_index_remove(apc_index *ix, int32_t block);
void apc_index_clear(apc_index *ix);

/* ---- Exact snapshots ---- */
/* Rows are counted in 32-bit words as the pool stores them (kv_pool.h):
 * floats in f32, packed f16 or q8_0 rows otherwise; the cache only copies
 * them. */
typedef struct apc_layout {
    int n_layer;
    int *k_width;   /* (n_layer) words per K row */
    int *v_width;   /* (n_layer) */
    size_t row_floats; /* words per position: sum over layers of k_width + v_width */
    /* For the SSD tier's namespace and file sizes (0 when unknown/none): */
    size_t state_bytes;  /* model_state_bytes of recurrent stacks, else 0 */
    uint64_t stack_sig;  /* XXH3-64 of every layer's (kind, window, keep) */
    /* The KV format (kv_pool.h), for the namespace: */
    uint64_t kv_format_id; /* kv_format_id of the pool's format; 0 = f32 */
    int *k_values, *v_values; /* (n_layer) values per K / V row; NULL: k_width / v_width (f32) */
    /* The attention precision the rows were written under (kv_pool_attention);
     * enters the namespace only when not f32, so f32 namespaces are unchanged. */
    int attention;
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
 * while over max_bytes or, when max_entries > 0, over max_entries.
 * Returns how many were dropped. */
int apc_exact_insert(apc_exact *ex, apc_exact_entry *e);
/* Drops one pin; frees the entry when it is unlisted and unpinned. */
void apc_exact_unpin(apc_exact *ex, apc_exact_entry *e);
void apc_exact_clear(apc_exact *ex);

/* ---- Recurrent-state snapshots on block chains (apc_snap.c) ----
 * One optional snapshot per indexed pool block: the model state after the
 * block's last row (16 rows, or n_rows of an indexed partial tail). It is
 * owned by the block's index entry: dropped when the pool evicts the block
 * (evict hook), on reset, and, least recently used first, when the bytes
 * kept pass max_bytes. Under the cache's lock. */
typedef struct apc_snaps {
    int32_t n_blocks;
    void **state;            /* (n_blocks) or NULL entries */
    int32_t *newer, *older;  /* (n_blocks) LRU links over blocks with a snapshot; -1 ends */
    int32_t newest, oldest;
    int count;
    size_t each, bytes, max_bytes;
    int interval;
    uint64_t stores, hits, evictions;
} apc_snaps;

int apc_snaps_init(apc_snaps *s, int32_t n_blocks, size_t each, size_t max_bytes, int interval);
void apc_snaps_free(apc_snaps *s);
/* Drops every snapshot (reset); counters stay for the caller to zero. */
void apc_snaps_clear(apc_snaps *s);
/* The pool hands block out again: its snapshot goes with it (counted). */
void apc_snaps_evict(apc_snaps *s, int32_t block);

/* ---- Checkpoint tier (apc_ckpt.c) ----
 * The cache (apc.c) owns one apc_ckpt per cache and calls these; the
 * ones named _locked run under the cache's mutex. */
typedef struct apc_ckpt apc_ckpt;
apc_ckpt *apc_ckpt_create(apc *c, const cache_layer *stack, int n_layer, const apc_config *cfg);
void apc_ckpt_free(apc_ckpt *k);
void apc_ckpt_reset_locked(apc_ckpt *k);
/* Evicts the least recently used record (non-anchors first); false when
 * there is none. For a pool that ran dry. */
bool apc_ckpt_evict_one_locked(apc_ckpt *k);
void apc_ckpt_stats_locked(apc_ckpt *k, apc_stats *s);
/* Exact-tier anchors: longest anchor that is a prefix of tokens with
 * min < length <= max_len (restored into seq/state), or 0. */
int64_t apc_ckpt_anchor_lookup(apc_ckpt *k, const int32_t *tokens, int64_t max_len, int64_t min, uint64_t salt,
                               kv_seq *seq, model_state *state);

/* ---- One request (apc_req.c) and the tier operations ----
 * apc_req.c owns the state machine and dispatches every call once, through
 * the tier's table; each table is complete (no NULL entries). */
typedef struct apc_ring_snap {
    int64_t p;
    void *state;    /* recurrent stacks: the state at p; else NULL */
    bool confirmed; /* its render prediction arrived and agreed */
} apc_ring_snap;

#define APC_RING_MAX 4 /* two confirmed snapshots plus predictions in flight */

struct apc_req {
    apc *c;
    const struct apc_tier_ops *ops;
    apc_req_state state;
    const int32_t *prompt;
    int64_t N;
    uint64_t salt;
    int unit;          /* lcm(prefill step, block): restore points of recurrent state lie on it */
    bool lookup, store;
    apc_hints hints;
    int64_t restored;  /* adopted at the lookup */
    /* ckpt: the prefill schedule */
    bool armed;
    apc_ckpt_point *sched;
    int n_sched, head;
    int64_t bounds[2];
    int n_bounds;
    bool bound_landed;
    /* exact: the system-prompt anchor armed at this position (0: none) */
    int64_t anchor_at;
    /* ckpt: decode-time snapshots */
    bool ring_on, ring_frozen;
    int64_t ring_next;
    int ring_grid;
    apc_ring_snap snaps[APC_RING_MAX];
    int n_snaps;
    /* block tier with recurrent snapshots (apc_snap.c): the chain keys of
     * prompt's full blocks computed so far (prompt is the driver's whole
     * token array, so decode and retirement extend them), and the two
     * hinted stops (system-prompt end, turn boundary) */
    struct apc_key *keys;
    int64_t n_keys, cap_keys;
    int64_t snap_hint[2];
};

typedef struct apc_tier_ops {
    apc_hit (*lookup)(apc_req *r, kv_seq *seq, model_state *state);
    void (*plan)(apc_req *r); /* after the lookup: stops, anchor, decode ring */
    int64_t (*next_stop)(const apc_req *r, int64_t p);
    void (*at)(apc_req *r, const kv_seq *seq, const model_state *state);
    void (*prefilled)(apc_req *r, const kv_seq *seq, const model_state *state);
    int64_t (*decode)(apc_req *r, const int32_t *all, const kv_seq *seq, const model_state *state);
    void (*predicted)(apc_req *r, int64_t p, int64_t common);
    bool (*retire_wants_last_token)(const apc_req *r, int64_t n_kv);
    bool (*retire_wants_prediction)(const apc_req *r);
    void (*retire)(apc_req *r, const int32_t *all, int64_t n, int64_t common, const kv_seq *seq,
                   const model_state *state);
    int64_t (*peek)(apc *c, const int32_t *tokens, int64_t n, uint64_t salt);
    int64_t (*prefetch)(apc *c, const int32_t *tokens, int64_t n, uint64_t salt); /* the disk part of a lookup */
    bool serial; /* prompts prefill one request at a time */
    bool progressive; /* prefill stores as it passes its stops (a sibling can adopt before it ends) */
} apc_tier_ops;

extern const apc_tier_ops apc_none_ops, apc_block_ops, apc_exact_ops, apc_ckpt_ops, apc_snap_ops;
/* The table of the cache's routed tier (apc.c). */
const apc_tier_ops *apc__tier_ops(apc *c);

/* The no-op pieces tables share (apc_req.c). */
apc_hit apc__no_lookup(apc_req *r, kv_seq *seq, model_state *state);
void apc__no_plan(apc_req *r);
int64_t apc__no_stop(const apc_req *r, int64_t p);
void apc__no_at(apc_req *r, const kv_seq *seq, const model_state *state);
int64_t apc__no_decode(apc_req *r, const int32_t *all, const kv_seq *seq, const model_state *state);
void apc__no_predicted(apc_req *r, int64_t p, int64_t common);
bool apc__no_prediction(const apc_req *r);

/* Where a stock store comes from (retire_stores counts RETIRE). */
typedef enum apc_store_point {
    APC_STORE_PAUSE = 0,   /* prefill paused at N-1 */
    APC_STORE_PREFILL = 1, /* the whole prompt is in the sequence */
    APC_STORE_RETIRE = 2,  /* request finished: prompt + reply */
} apc_store_point;

/* The stock tiers (apc.c). */
apc_hit apc__lookup_blocks(apc *c, const int32_t *tokens, int64_t n, uint64_t salt, kv_seq *seq);
void apc__store_blocks(apc *c, apc_store_point point, const int32_t *tokens, int64_t n, uint64_t salt,
                       const kv_seq *seq);
/* The same with the chain keys of the n / 16 full blocks given; keys has
 * room for one more (the partial tail's key is written there). */
void apc__store_blocks_keyed(apc *c, apc_store_point point, const int32_t *tokens, int64_t n, uint64_t salt,
                             const kv_seq *seq, apc_key *keys);
int64_t apc__peek_blocks(apc *c, const int32_t *tokens, int64_t n, uint64_t salt);
int64_t apc__prefetch_blocks(apc *c, const int32_t *tokens, int64_t n, uint64_t salt);
int64_t apc__prefetch_exact(apc *c, const int32_t *tokens, int64_t n, uint64_t salt);
apc_hit apc__lookup_exact(apc *c, const int32_t *tokens, int64_t n, uint64_t salt, kv_seq *seq,
                          model_state *state);
void apc__store_exact(apc *c, apc_store_point point, const int32_t *tokens, int64_t n, uint64_t salt,
                      const kv_seq *seq, const model_state *state);
int64_t apc__peek_exact(apc *c, const int32_t *tokens, int64_t n, uint64_t salt);
/* Exact-tier anchors (apc_ckpt.c). */
void apc_ckpt_anchor_store(apc_ckpt *k, const int32_t *tokens, int64_t p, uint64_t salt, const kv_seq *seq,
                           const model_state *state);
int64_t apc_ckpt_anchor_best_locked(apc_ckpt *k, const int32_t *tokens, int64_t max_len, uint64_t salt);
/* A checkpoint chain read back from a lower tier (apc_ckpt.c): load fills
 * want[0, n) (keys, token spans, rows, destination pool blocks) from the
 * SSD or Redis and returns how many, in order, it filled.
 * apc__ckpt_load_chain fills the empty seq with the chain [0, p) through
 * it (fresh pool blocks, private until adopted); false: seq stays empty,
 * *blocks_short says whether the pool had no blocks for it. */
struct apc_disk_want;
typedef int64_t (*apc_chain_loader)(void *ctx, const apc_key *parent, uint64_t salt, const struct apc_disk_want *want,
                                    int64_t n);
bool apc__ckpt_load_chain(apc *c, const int32_t *tokens, int64_t p, uint64_t salt, kv_seq *seq, apc_chain_loader load,
                          void *ctx, bool *blocks_short);

/* What the tiers need of the cache (apc.c). */
void apc__lock(apc *c);
void apc__unlock(apc *c);
kv_pool *apc__pool(apc *c);
const apc_layout *apc__layout(apc *c);
apc_ckpt *apc__ckpt(apc *c);
apc_index *apc__index(apc *c);
apc_snaps *apc__snaps(apc *c);
/* Under the lock: a lookup found nothing (lookups_miss). */
void apc__count_miss_locked(apc *c);
size_t apc__state_bytes(apc *c); /* 0: no recurrent layers */
/* The recurrent state through the creator's operations. */
int64_t apc__state_pos(apc *c, const model_state *s);
void apc__state_snapshot(apc *c, const model_state *s, void *out);
/* Restores buf into s and checks it stands at pos; on failure s is reset. */
bool apc__state_restore(apc *c, model_state *s, const void *buf, int64_t pos);
void apc__state_reset(apc *c, model_state *s);
/* A scratch state at position 0 (NULL: out of memory), and its end. */
model_state *apc__state_scratch(apc *c);
void apc__state_drop(apc *c, model_state *s);
/* The SSD tier (NULL: none); apc_disk.h. */
struct apc_disk *apc__disk(apc *c);
/* The remote tier (NULL: none); apc_remote.h. The deadline (ember_now()
 * seconds) of a remote read of `missing` tokens: a share of what their cold
 * prefill would cost. */
struct apc_remote *apc__remote(apc *c);
double apc__remote_deadline(apc *c, int64_t missing);
/* The checkpoint tier's part of apc_prefetch on the remote tier
 * (apc_ckpt.c): a skeleton deeper than memory's best record, its state
 * and its chain, read from Redis, become a record. */
int64_t apc__ckpt_prefetch_remote(apc *c, const int32_t *tokens, int64_t n, uint64_t salt);
apc_hash_kind apc__hash(apc *c);
/* Under the lock: a lookup adopted n tokens (lookups_hit, matched_tokens). */
void apc__count_hit_locked(apc *c, int64_t n);
/* Under the lock: the longest restorable exact entry, 0 if none. */
int64_t apc__exact_best_locked(apc *c, const int32_t *tokens, int64_t max_len, uint64_t salt);

#endif
