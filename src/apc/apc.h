/* apc.h - the automatic prompt cache of one model.
 *
 * Contract:
 *  - Routing. apc_route_stack() reads a model's cache-stack descriptor and
 *    picks the tier that can serve it (design.md §4): every layer `kv` ->
 *    block; `kv`/`rot`/`arr` mixes with something chain-backed and at least
 *    one `rot` or `arr` -> ckpt (rot layers must share one window geometry on
 *    the 16-token grid, else exact); any `list`, or only `arr` -> exact;
 *    an `other` layer or an empty stack -> none. apc_create logs the choice
 *    once: "APC tier: block (layers: 28 kv / 0 rot / 0 arr)" at info, or
 *    "APC OFF for this model: <reason>" at warning. EMBER_APC_FORCE_TIER=
 *    exact|block|off (read once, at creation) overrides it for A/B tests;
 *    block is only honoured on an all-kv stack.
 *  - Block tier. The kv_pool that holds live K/V is the cache: a full
 *    16-token block of a stored sequence is indexed by a chained key
 *    H(parent key, salt, 16 token ids), SHA-256 truncated to 128 bits or
 *    XXH3-128. A hit is verified against the stored tokens, parent key and
 *    salt. Indexed blocks whose refcount falls to 0 stay findable until the
 *    pool's LRU hands them out again (the evict hook unindexes them and
 *    counts an eviction). A lookup adopts blocks into the caller's empty
 *    sequence without copying and caps the result at N-1 tokens, so a
 *    resend of N tokens always forwards exactly one (when N is a multiple of
 *    16 the last adopted block is left shared and partial, and the pool
 *    copies it on the first append).
 *    ember addition: the partial tail block of a stored sequence (N % 16
 *    rows) is indexed too, under a key that also says how many rows it
 *    holds, so a resend forwards one token for every N, not only from the
 *    first full block on. An indexed block is never written again: its owner
 *    copies a partial one before appending (kv_seq_prepare_append).
 *  - Exact tier. Whole-state snapshots (for a dense stack: the K/V rows of
 *    positions [0, n) of every layer) adopted only as a verbatim prefix of
 *    length <= N-1 with the same salt, into fresh blocks. LRU bounded by
 *    exact_entries and exact_max_bytes.
 *  - Store points. The engine calls apc_store at three points of a request:
 *    PAUSE (prefill stopped at N-1; the exact tier snapshots there), PREFILL
 *    (the prompt's N tokens are in the sequence; the block tier indexes its
 *    full blocks) and RETIRE (prompt + reply at finish; block: index,
 *    exact: snapshot). A tier ignores the points it has no use for.
 *  - Salt. Every key and entry carries the request's 64-bit salt; requests
 *    with different salts share nothing.
 *  - The cache never fails a request (design.md invariant 3): lookups and
 *    stores return nothing on trouble; the problem is counted under a decline
 *    reason and logged once per reason.
 *  - Concurrency. One mutex per cache guards the index, the exact LRU, the
 *    counters and the kv_pool itself (which is not thread-safe), so every
 *    structural pool operation of a sequence goes through apc_seq_*. Copies
 *    (snapshots, restores) and hashing run outside the lock: an exact entry
 *    is pinned while it is read, and a generation counter, bumped by
 *    apc_reset, makes a restore that raced a reset discard its result.
 *    Forward passes read and write the blocks of their own sequences
 *    without the lock; a block that other sequences can see is never written.
 *  - Counters follow the reference §11.1 exactly; ember's additions are
 *    listed at apc_stats. apc_stats_json renders the object that
 *    GET /v1/cache/stats returns; apc_reset clears the memory tiers and the
 *    counters.
 *  - SSD tier (cfg.disk.path set; apc_disk.h has the format): block and
 *    exact stores are also written, asynchronously, under a namespace of the
 *    model fingerprint and the cache format; the lookup consults the disk
 *    after memory and the longest match wins; blocks read from disk are
 *    loaded into fresh pool blocks and indexed (the next hit is from
 *    memory), a snapshot read from disk joins the exact LRU. apc_reset
 *    leaves the disk alone; apc_free lets queued writes land first. */
#ifndef EMBER_APC_H
#define EMBER_APC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "core/error.h"
#include "gguf/gguf.h"
#include "kv/kv_pool.h"
#include "model/cache_stack.h"

typedef enum apc_tier {
    APC_TIER_NONE = 0,
    APC_TIER_BLOCK = 1,
    APC_TIER_CKPT = 2,   /* checkpoint records (apc_ckpt.h) */
    APC_TIER_EXACT = 3,
} apc_tier;

typedef enum apc_hash_kind {
    APC_HASH_SHA256 = 0, /* SHA-256 truncated to 128 bits (default) */
    APC_HASH_XXH3 = 1,   /* XXH3-128 */
} apc_hash_kind;

typedef enum apc_force {
    APC_FORCE_NONE = 0,  /* route from the stack (or EMBER_APC_FORCE_TIER) */
    APC_FORCE_OFF = 1,
    APC_FORCE_BLOCK = 2,
    APC_FORCE_EXACT = 3,
} apc_force;

typedef enum apc_source {
    APC_SOURCE_NONE = 0,
    APC_SOURCE_BLOCK = 1,
    APC_SOURCE_EXACT = 2,
    APC_SOURCE_CKPT = 3,   /* a checkpoint record (apc_ckpt.h) */
    APC_SOURCE_ANCHOR = 4, /* an exact-tier system-prompt anchor */
} apc_source;

typedef enum apc_store_point {
    APC_STORE_PAUSE = 0,   /* prefill paused at N-1 */
    APC_STORE_PREFILL = 1, /* the whole prompt is in the sequence */
    APC_STORE_RETIRE = 2,  /* request finished: prompt + reply */
} apc_store_point;

/* Why a lookup or store gave up; each is counted under "declines". */
typedef enum apc_decline {
    APC_DECLINE_POOL_EXHAUSTED = 0, /* no free block to restore a snapshot into */
    APC_DECLINE_ALLOC,              /* out of memory */
    APC_DECLINE_COLLISION,          /* key matched, tokens/parent/salt did not */
    APC_DECLINE_EXACT_BYTES,        /* one snapshot exceeds exact_max_bytes */
    APC_DECLINE_RACED_RESET,        /* a restore overlapped apc_reset */
    APC_DECLINE_SEQ_SHORT,          /* store asked for more tokens than the sequence holds */
    APC_DECLINE_COUNT_
} apc_decline;

typedef struct apc_route {
    apc_tier tier;
    int n_kv, n_rot, n_arr, n_list, n_other;
    bool forced;
    char reason[192];   /* OFF: why; exact instead of ckpt: why; else "" */
} apc_route;

/* The SSD tier (apc_disk.h). Strings are copied by apc_create. */
typedef enum apc_disk_read {
    APC_DISK_READ_DIRECT = 0, /* pread */
    APC_DISK_READ_MMAP = 1,
} apc_disk_read;

typedef struct apc_disk_config {
    const char *path;             /* root directory; NULL or "": no disk tier (default) */
    uint64_t max_bytes;           /* size cap of the namespace; 0: unbounded */
    int workers;                  /* writer threads; default 1 */
    apc_disk_read read_mode;
    const char *namespace_override; /* replaces the model fingerprint in the namespace */
    bool has_fingerprint;         /* engine_create fills these from the model file */
    uint8_t fingerprint[16];      /* apc_model_fingerprint */
    int queue_jobs;               /* bounded write queue: jobs (default 64) */
    size_t queue_bytes;           /* and bytes (default 1 GiB) */
    int backoff_ms;               /* writes off after ENOSPC/EIO (default 30000) */
} apc_disk_config;

/* The checkpoint tier and the exact-tier anchors (reference §7, §6.4).
 * apc_default_config() fills these from the EMBER_APC_* environment
 * (docs/cache-switches.md); after that they are plain per-cache values. */
typedef struct apc_ckpt_config {
    int interval;            /* EMBER_APC_CKPT_INTERVAL 4096: prefill checkpoint spacing, floored to the
                              * prefill unit, at least one unit; <= 0: terminal point only */
    bool replay;             /* EMBER_APC_CKPT_REPLAY 1: the N-1 replay checkpoint */
    int replay_min;          /* EMBER_APC_CKPT_REPLAY_MIN 1024: least N for a replay on arr layouts */
    bool turn;               /* EMBER_APC_CKPT_TURN 1: the turn checkpoint at the predicted boundary */
    bool sys;                /* EMBER_APC_CKPT_SYS 1: the system-prompt anchor (both tiers) */
    int sys_min;             /* EMBER_APC_CKPT_SYS_MIN 256: least anchor position */
    int tripwire;            /* EMBER_APC_CKPT_TRIPWIRE 5; <= 0 silences both warnings */
    int records;             /* EMBER_APC_CKPT_RECORDS 32 (at least 2) */
    int heavy;               /* EMBER_APC_CKPT_HEAVY 2: plain records per chain kept by strip-on-extend */
    size_t budget_bytes;     /* EMBER_APC_CKPT_BUDGET_MB 4096: record-owned bytes (recurrent states) */
    int decode_interval;     /* EMBER_APC_DECODE_CKPT 512: decode-time snapshot spacing; <= 0 off */
    int anchor_entries;      /* EMBER_APC_ANCHOR_ENTRIES 4: exact-tier anchor LRU (at least 1) */
    size_t anchor_budget_bytes; /* EMBER_APC_ANCHOR_BUDGET_MB 4096 */
} apc_ckpt_config;

/* Defaults overridden by the environment (read at every call). */
apc_ckpt_config apc_ckpt_default_config(void);

typedef struct apc_config {
    bool enabled;             /* false: tier none, stats {"enabled": false} */
    apc_hash_kind hash;
    int exact_entries;        /* default 4 */
    size_t exact_max_bytes;   /* default 4 GiB */
    apc_force force_tier;     /* APC_FORCE_NONE: EMBER_APC_FORCE_TIER, else routing */
    bool ckpt_enabled;        /* false: stacks that would go ckpt go exact */
    apc_disk_config disk;     /* off by default */
    apc_ckpt_config ckpt;     /* checkpoint tier and exact anchors */
} apc_config;

/* Counters. Stock (reference §11.1): block_size, num_blocks, pool_used,
 * lookups_hit, lookups_miss, matched_tokens, served_tokens, token_hit_rate,
 * evictions, stores, disk_hits, disk_writes, exact_hits, exact_stores; the
 * ckpt family (ckpt_stores, ckpt_hits, ckpt_matched_tokens, ckpt_declines,
 * ckpt_missed_adoptions, ckpt_skeleton_writes, sidecar_writes,
 * retire_fallback_full, ckpt_pool_evictions, ckpt_grid_truncate,
 * anchor_stores, anchor_hits) and the L0 fields (spec_prefix_*), all zero
 * until those tiers exist; enabled.
 * served_tokens also counts the rows of indexed partial tail blocks.
 * ember's additions: tier, hash, pool_free (blocks with refcount 0),
 * pool_referenced, pool_capacity_tokens, pool_bytes, exact_entries,
 * exact_max_entries, exact_bytes, exact_max_bytes, exact_evictions,
 * retire_stores (requests whose retirement stored something), generation
 * (bumped by reset), declines {reason: count}. */
typedef struct apc_stats {
    bool enabled;
    apc_tier tier;
    apc_hash_kind hash;
    int block_size;
    int32_t num_blocks;
    int32_t pool_used, pool_free, pool_referenced;
    size_t block_bytes;
    uint64_t lookups_hit, lookups_miss, matched_tokens, served_tokens;
    uint64_t evictions, stores, disk_hits, disk_writes, exact_hits, exact_stores;
    int exact_entries, exact_max_entries;
    size_t exact_bytes, exact_max_bytes;
    uint64_t exact_evictions, retire_stores, generation;
    uint64_t declines[APC_DECLINE_COUNT_];
    /* SSD tier (reference §11.1 names; only when disk_enabled): disk_hits
     * (+blocks per block restore, +1 per exact restore) and disk_writes
     * (+blocks per shard written, +1 per snapshot) above; ours:
     * disk_write_drops (queue full, back-off), disk_write_errors,
     * disk_corrupt (files that failed verification at read). */
    bool disk_enabled;
    uint64_t disk_bytes, disk_max_bytes, disk_evictions, disk_files, disk_blocks_indexed, disk_exact_indexed;
    uint64_t disk_write_drops, disk_write_errors, disk_corrupt;
    char disk_namespace[33];
    /* Checkpoint family (reference §11.1; live on ckpt-tier models, anchors
     * on exact-tier models). ckpt_declines by apc_ckpt_decline. ember's
     * additions: retire_fallback_suppressed (a retirement skipped because
     * the next-turn render diverged and this request's turn checkpoint
     * covers it), ckpt_records, ckpt_bytes, ckpt_armed, anchor_entries. */
    uint64_t ckpt_stores, ckpt_hits, ckpt_matched_tokens, ckpt_missed_adoptions, ckpt_pool_evictions;
    uint64_t ckpt_grid_truncate, ckpt_skeleton_writes, sidecar_writes, retire_fallback_full;
    uint64_t retire_fallback_suppressed, anchor_stores, anchor_hits, ckpt_armed;
    uint64_t ckpt_declines[16];
    int ckpt_records, anchor_entries;
    size_t ckpt_bytes;
} apc_stats;

typedef struct apc apc;

typedef struct apc_hit {
    int64_t n_tokens;    /* prompt tokens now in the sequence, <= N-1 */
    apc_source source;
} apc_hit;

/* ---- Routing (pure; no logging) ---- */
apc_route apc_route_stack(const cache_layer *stack, int n_layer, bool ckpt_enabled);
/* Applies a forced tier; block on a stack that is not all kv is refused
 * (route unchanged, reason says so). */
void apc_route_force(apc_route *r, apc_force force);
/* "exact"|"block"|"off" -> 0; NULL or "" -> APC_FORCE_NONE; else -1. */
int apc_parse_force(const char *s, apc_force *out);
const char *apc_tier_name(apc_tier t);
const char *apc_source_name(apc_source s);
const char *apc_decline_name(apc_decline d);

/* ---- Keys ---- */
/* The request salt for a tenant name (0 for no tenant). */
uint64_t apc_salt_for_tenant(const char *tenant, size_t len);

/* ---- Lifetime ---- */
apc_config apc_default_config(void);
/* A model's identity for the SSD tier's namespace: XXH3-128 over the file
 * size, the GGUF header (every key/value), the tensor table and a sample of
 * every tensor's data (its first, middle and last 64 bytes). No path. */
void apc_model_fingerprint(const gguf_file *f, uint8_t out[16]);
/* Waits until every queued disk write has landed (no-op without a disk). */
void apc_flush(apc *c);
/* The pool must outlive the cache; the cache installs the pool's evict hook.
 * layout gives the per-layer K/V widths (model_kv_config). */
apc *apc_create(kv_pool *pool, const kv_pool_config *layout, const cache_layer *stack,
                const apc_config *cfg, ember_error *err);
void apc_free(apc *c);
apc_tier apc_get_tier(const apc *c);
const apc_route *apc_get_route(const apc *c);

/* ---- Sequences (the pool, under the cache's lock) ---- */
int apc_seq_prepare_append(apc *c, kv_seq *seq, int64_t n_new, ember_error *err);
void apc_seq_truncate(apc *c, kv_seq *seq, int64_t n_tokens);
void apc_seq_release(apc *c, kv_seq *seq);

/* ---- Lookup and store ---- */
/* Fills the empty sequence with the longest cached prefix of tokens[0, n)
 * under salt, at most n-1 tokens. Never fails: a miss is {0, NONE}. */
apc_hit apc_lookup(apc *c, const int32_t *tokens, int64_t n, uint64_t salt, kv_seq *seq);
/* Stores tokens[0, n) whose K/V are positions [0, n) of seq. */
void apc_store(apc *c, apc_store_point point, const int32_t *tokens, int64_t n, uint64_t salt,
               const kv_seq *seq);
/* Whether retirement is worth one extra forward of the last generated token
 * so that the stored sequence covers the whole reply. n_kv: tokens with K/V. */
bool apc_retire_wants_last_token(const apc *c, int64_t n_kv);

/* ---- Recurrent state (ARR / LIST layers) ----
 * A stack with recurrent layers needs the sequence's model_state beside its
 * K/V: engine_create tells the cache which model that is. apc_lookup and
 * apc_store then refuse (miss, no store) on such a cache, and the _state
 * variants restore / snapshot the state together with the K/V: an exact
 * entry of n tokens is the K/V rows [0, n) plus the state at position n
 * (model_state_pos must be n at a store, or the store is declined). */
struct model;
struct model_state;
void apc_set_state_model(apc *c, const struct model *m);
apc_hit apc_lookup_state(apc *c, const int32_t *tokens, int64_t n, uint64_t salt, kv_seq *seq,
                         struct model_state *state);
void apc_store_state(apc *c, apc_store_point point, const int32_t *tokens, int64_t n, uint64_t salt,
                     const kv_seq *seq, const struct model_state *state);

/* Next-turn render prediction (src/chat): the length of the common prefix
 * of tokens[0, n) and the render of the conversation with this reply as
 * the assistant's message (no generation prompt); < 0: no prediction. */
typedef int64_t (*apc_predict_fn)(void *user, const int32_t *tokens, int64_t n);

/* ---- Stats and reset ---- */
void apc_get_stats(apc *c, apc_stats *out);
/* The GET /v1/cache/stats object (caller frees with cJSON_Delete). */
cJSON *apc_stats_json(apc *c);
/* Forgets every indexed block and exact entry and zeroes the counters.
 * Blocks that live sequences hold stay theirs. */
void apc_reset(apc *c);

#endif
