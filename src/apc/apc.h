/* apc.h - the automatic prompt cache of one model: what it offers.
 *
 * Contract (the design, tier by tier, is the essay at the top of apc.c):
 *  - apc_create routes the model's cache stack to one tier (block, ckpt,
 *    exact or none; design.md §4) and logs the choice once.
 *  - One request drives the cache through one protocol object, apc_req
 *    (apc_req.h), whatever the tier; nothing else looks up or stores.
 *  - The cache never fails a request: trouble is a counted decline.
 *  - Thread-safe: one mutex per cache guards its indexes, counters and the
 *    kv_pool, so every structural pool operation of a live sequence goes
 *    through apc_seq_*.
 *  - The cache knows the model only through the cache-stack descriptor, the
 *    pool layout and the recurrent-state operations given to apc_create; it
 *    reads no environment and builds no JSON (serve renders apc_stats).
 *
 * The API, grouped by purpose, is at the end of this file. */
#ifndef EMBER_APC_H
#define EMBER_APC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/error.h"
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
    APC_FORCE_NONE = 0,  /* route from the stack */
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
    APC_SOURCE_PREFIX = 5, /* the engine's prefix layer, L0 (engine_prefix.h), not a tier of this cache */
} apc_source;

/* Why a lookup or store gave up; each is counted under "declines". */
typedef enum apc_decline {
    APC_DECLINE_POOL_EXHAUSTED = 0, /* no free block to restore a snapshot into */
    APC_DECLINE_ALLOC,              /* out of memory */
    APC_DECLINE_COLLISION,          /* key matched, tokens/parent/salt did not */
    APC_DECLINE_EXACT_BYTES,        /* one snapshot exceeds exact_max_bytes */
    APC_DECLINE_RACED_RESET,        /* a restore overlapped apc_reset */
    APC_DECLINE_SEQ_SHORT,          /* store asked for more tokens than the sequence holds */
    APC_DECLINE_KVARN_SEALS,        /* kvarn: sealed groups are not those of the length (kv_seq_kvarn_check) */
    APC_DECLINE_COUNT_
} apc_decline;

typedef struct apc_route {
    apc_tier tier;
    int n_kv, n_rot, n_arr, n_list, n_other;
    bool forced;
    bool snapshots;     /* block tier over arr/list layers: recurrent-state snapshots on the chain */
    bool records;       /* the pool holds kvarn records (apc_route_kv_format) */
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
    bool has_fingerprint;         /* the creator fills these from the model file */
    uint8_t fingerprint[16];      /* engine_model_fingerprint */
    int queue_jobs;               /* bounded write queue: jobs (default 64) */
    size_t queue_bytes;           /* and bytes (default 1 GiB) */
    int backoff_ms;               /* writes off after ENOSPC/EIO (default 30000) */
    bool optional;                /* a tier that cannot open is a warning; else apc_create fails */
    /* Tests only: called before every file read, off the engine thread;
     * may block (a slow disk) or return < 0 (a read error). */
    int (*read_hook)(void *user, const char *path);
    void *read_hook_user;
} apc_disk_config;

/* The remote tier (apc_remote.h): block chains shared between replicas
 * through Redis. The url string is copied by apc_create. */
typedef struct apc_remote_config {
    const char *url;          /* redis://host[:port][/db] or unix:///path; NULL or "": no remote tier */
    int ttl_s;                /* expiry of every value written (default 86400) */
    size_t queue_bytes;       /* bounded write queue (default 1 GiB); over it writes are dropped and counted */
    double deadline_fraction; /* a read may take this share of a cold prefill's estimated time (default 0.5) */
    int min_wait_ms;          /* floor of a read's deadline (default 20) */
    int max_wait_ms;          /* ceiling of a read's deadline (default 5000) */
    int prefill_tps;          /* cold prefill tokens/s assumed until one is measured (default 500) */
    int timeout_ms;           /* writes, connects of the writer, probes (default 1000) */
    int breaker_failures;     /* consecutive failures that open the breaker (default 3) */
    int probe_ms;             /* PING interval while the breaker is open (default 1000) */
    /* Tests only: called on the reading thread before the EXISTS pipeline
     * (stage 0) and before each window of GETs (stage 1), so a test can
     * stop or kill the server in the middle of a request's reads. */
    void (*read_hook)(void *user, int stage);
    void *read_hook_user;
    size_t window_bytes;      /* tests only: values in flight per pipelined window; 0: 64 MiB */
} apc_remote_config;

/* Whether url is a remote-tier URL ember can use; -1 with err saying why not. */
int apc_remote_check_url(const char *url, ember_error *err);

/* The checkpoint tier and the exact-tier anchors (reference §7, §6.4).
 * Plain per-cache values; the names are their environment variables in the
 * settings table (serve_settings.c, docs/cache-switches.md). */
typedef struct apc_ckpt_config {
    int interval;            /* EMBER_APC_CKPT_INTERVAL 4096: prefill checkpoint spacing, floored to the
                              * prefill unit, at least one unit; <= 0: terminal point only */
    bool replay;             /* EMBER_APC_CKPT_REPLAY 1: the N-1 replay checkpoint */
    int replay_min;          /* EMBER_APC_CKPT_REPLAY_MIN 64: least N for a replay on arr layouts */
    bool turn;               /* EMBER_APC_CKPT_TURN 1: the turn checkpoint at the predicted boundary */
    bool sys;                /* EMBER_APC_CKPT_SYS 1: the system-prompt anchor (both tiers) */
    int sys_min;             /* EMBER_APC_CKPT_SYS_MIN 256: least anchor position */
    int tripwire;            /* EMBER_APC_CKPT_TRIPWIRE 5; <= 0 silences both warnings */
    int records;             /* EMBER_APC_CKPT_RECORDS 32 (at least 2) */
    int heavy;               /* EMBER_APC_CKPT_HEAVY 2: plain records per chain kept by strip-on-extend */
    size_t budget_bytes;     /* EMBER_APC_CKPT_BUDGET_MB 4096: record-owned bytes (recurrent states) */
    int decode_interval;     /* EMBER_APC_DECODE_CKPT 512: decode-time snapshot spacing; <= 0 off */
    int anchor_entries;      /* EMBER_APC_ANCHOR_ENTRIES 0: count cap of the exact-tier anchor LRU; 0: none */
    size_t anchor_budget_bytes; /* EMBER_APC_ANCHOR_BUDGET_MB 4096 */
    /* Recurrent-state snapshots pinned to block chains (apc_snap.c): */
    int snapshot_interval;   /* EMBER_APC_SNAPSHOT_INTERVAL 64: a snapshot every this many tokens (a
                              * multiple of 16) along prefill and decode; arr/list stacks then route to
                              * the block tier; 0: off (the ckpt / exact routing) */
    size_t snapshot_budget_bytes; /* EMBER_APC_SNAPSHOT_BUDGET_MB 1024: bytes of snapshots kept, LRU */
} apc_ckpt_config;

/* Compiled-in defaults (the cache reads no environment). */
apc_ckpt_config apc_ckpt_default_config(void);

typedef struct apc_config {
    bool enabled;             /* false: tier none, stats {"enabled": false} */
    apc_hash_kind hash;
    int exact_entries;        /* count cap of the exact LRU; 0 (default): none, the bytes decide */
    size_t exact_max_bytes;   /* default 4 GiB; 0 turns the exact tier off */
    apc_force force_tier;     /* APC_FORCE_NONE: routing decides */
    bool ckpt_enabled;        /* false: stacks that would go ckpt go exact */
    bool swa_block;           /* sliding-window stacks whose pool keeps every row go block (default
                               * true); false: the checkpoint tier, as if out-of-window rows were trimmed */
    apc_disk_config disk;     /* off by default */
    apc_remote_config remote; /* off by default */
    apc_ckpt_config ckpt;     /* checkpoint tier and exact anchors */
    const char *route_note;   /* appended to the routing log line (the engine: speculation and L0);
                               * read by apc_create only; NULL: none */
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
    char kv_format[32];      /* the pool's KV format (kv_format_name) */
    char attention_precision[8]; /* the pool's attention precision (attention_precision_name) */
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
    uint64_t disk_read_errors; /* reads that failed without proving the file bad */
    char disk_namespace[33];
    /* Remote tier (only when remote_enabled): remote_hits (values read,
     * verified and brought into memory: blocks), remote_hit_tokens (their
     * tokens), remote_writes (values written), remote_errors (failed
     * commands and connections), remote_timeouts (reads or writes that ran
     * out of time), remote_corrupt (values that failed verification;
     * deleted), remote_write_drops (values not written: queue full,
     * breaker open), remote_breaker_open. */
    bool remote_enabled, remote_breaker_open;
    uint64_t remote_hits, remote_hit_tokens, remote_writes, remote_errors, remote_timeouts, remote_corrupt;
    uint64_t remote_write_drops;
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
    /* Recurrent-state snapshots on block chains (block tier over arr/list
     * layers): stores, hits (lookups that restored one), evictions (with
     * their block, or over the byte budget), entries and bytes kept. */
    uint64_t snap_stores, snap_hits, snap_evictions;
    int snap_entries, snap_interval;
    size_t snap_bytes, snap_max_bytes;
} apc_stats;

typedef struct apc apc;

typedef struct apc_hit {
    int64_t n_tokens;    /* prompt tokens now in the sequence, <= N-1 */
    apc_source source;
} apc_hit;

/* Recurrent state (arr and list layers) through the model's operations:
 * the cache snapshots a request's state beside its K/V and restores both.
 * The state is opaque here; bytes == 0 means the stack has none. */
typedef struct model_state model_state;
typedef struct apc_state_ops {
    size_t bytes;                                  /* one snapshot */
    int64_t (*pos)(const model_state *s);          /* tokens consumed */
    void (*snapshot)(const model_state *s, void *out);
    int (*restore)(model_state *s, const void *buf, size_t n, ember_error *err);
    void (*reset)(model_state *s);                 /* back to empty */
    /* A scratch state, for checking that a snapshot read from disk restores. */
    model_state *(*create)(const void *owner, ember_error *err);
    void (*destroy)(model_state *s);
    const void *owner;                             /* create's argument (the model) */
} apc_state_ops;

/* ---- Routing (pure; no logging) ---- */
apc_route apc_route_stack(const cache_layer *stack, int n_layer, bool ckpt_enabled);
/* Routing by what the pool really holds (apc_route.c, issue 17): a stack
 * routed ckpt or exact goes block when every non-kv layer can be cut at a
 * block: rot layers when the pool keeps their out-of-window rows
 * (swa_rows_kept), arr/list layers when recurrent snapshots ride on the
 * block chain (snapshots). Sets r->snapshots. Call before apc_route_force. */
void apc_route_pool_rows(apc_route *r, bool swa_rows_kept, bool snapshots);
/* Applies a forced tier; block on a stack that is not all kv is refused
 * (route unchanged, reason says so). */
void apc_route_force(apc_route *r, apc_force force);
/* Routing by the KV format: a pool of kvarn records (records) cannot be cut
 * into 16-token blocks, so a stack routed block goes exact (logged with the
 * reason); ckpt and exact stay. Call after apc_route_force; under kvarn
 * apc_route_pool_rows is not called. */
void apc_route_kv_format(apc_route *r, bool records);
/* "exact"|"block"|"off" -> 0; NULL or "" -> APC_FORCE_NONE; else -1. */
int apc_parse_force(const char *s, apc_force *out);
const char *apc_tier_name(apc_tier t);
const char *apc_source_name(apc_source s);
const char *apc_decline_name(apc_decline d);

/* ---- Keys ---- */
/* The request salt for a tenant name (0 for no tenant). */
uint64_t apc_salt_for_tenant(const char *tenant, size_t len);

/* ---- Lifetime ---- */
/* The compiled-in defaults (docs/cache-switches.md); no environment. */
apc_config apc_default_config(void);
/* The pool must outlive the cache; the cache installs the pool's evict hook.
 * layout gives the per-layer K/V widths in values (model_kv_config); the
 * cache copies rows as the pool encodes them (kv_pool_row_bytes, the pool's
 * kv_format) and keys the SSD namespace on that format. state is NULL or
 * bytes == 0 for stacks without recurrent layers. cfg->disk.fingerprint
 * (the caller computes it from the model file) names the SSD namespace. */
apc *apc_create(kv_pool *pool, const kv_pool_config *layout, const cache_layer *stack, const apc_state_ops *state,
                const apc_config *cfg, ember_error *err);
void apc_free(apc *c);
/* Waits until every queued disk and remote write has landed (no-op
 * without those tiers). */
void apc_flush(apc *c);
apc_tier apc_get_tier(const apc *c);
/* The SSD tier's namespace (apc_disk.h) of this cache's format for a model
 * fingerprint, or for namespace_override when it is not empty: 32 lowercase
 * hex digits. Caches with equal namespaces can share stored KV; nothing
 * else can. Computed whether or not a disk tier is open. */
void apc_namespace_hex(const apc *c, const uint8_t fingerprint[16], const char *namespace_override, char out[33]);
const apc_route *apc_get_route(const apc *c);

/* ---- Sequences (the pool, under the cache's lock) ---- */
int apc_seq_prepare_append(apc *c, kv_seq *seq, int64_t n_new, ember_error *err);
void apc_seq_truncate(apc *c, kv_seq *seq, int64_t n_tokens);
void apc_seq_release(apc *c, kv_seq *seq);

/* ---- One request: apc_req.h ---- */

/* ---- The SSD tier, off the engine thread ---- */
/* Lookups read memory only. apc_prefetch does the disk part of a lookup of
 * tokens[0, n) under salt: whatever the SSD tier holds beyond memory's
 * longest match (a block chain's continuation, a longer snapshot, a deeper
 * checkpoint skeleton) is verified and brought into memory, where the
 * request's lookup then finds it. Thread-safe, touches no live sequence,
 * may block on the disk: the request driver runs it on its fetch threads
 * with a deadline. Returns the tokens memory now holds for the prompt
 * (at most n-1). A cache without a disk or remote tier returns 0 at once. */
bool apc_has_disk(const apc *c);
int64_t apc_prefetch(apc *c, const int32_t *tokens, int64_t n, uint64_t salt);

/* ---- Side entries: a drafter's sidecar on the SSD tier ----
 * Opaque rows (words 32-bit words per token) of a drafter's state for
 * tokens[0, n), in this cache's SSD namespace under salt ^ a sidecar salt
 * (apc_disk.h: side files), so a restart restores target and drafter
 * together; they never answer the cache's own lookups. owner NULL: the
 * target's own MTP head. A draft model (a second model) passes its own
 * namespace (its fingerprint, KV format and shape, hashed by the caller)
 * and state size: its entries live under a salt of their own derived from
 * it, carry the state after the rows, and are read back only by the same
 * owner. The remote tier mirrors them the same way (entries of at least
 * APC_REMOTE_ANCHOR_TOKENS tokens; apc_remote.h). Without a disk or
 * remote tier both do nothing. apc_side_store copies and queues the writes
 * (false: none queued); apc_side_load (blocks on the disk, then on Redis
 * under the fetch deadline: fetch threads only) returns the longest entry
 * of n' in [p, n] tokens matching tokens[0, n'] (the disk's first),
 * malloc'd, *n_out = n' (and its state malloc'd into *state_out when owner
 * has one); NULL: none. */
typedef struct apc_side_owner {
    uint8_t ns[16];          /* the drafter's namespace; zero: the target's MTP head */
    size_t state_bytes;      /* a state snapshot stored after the rows; 0: none */
} apc_side_owner;
bool apc_side_store(apc *c, uint64_t salt, const apc_side_owner *owner, const int32_t *tokens, int64_t n,
                    const uint32_t *rows, size_t words, const void *state);
uint32_t *apc_side_load(apc *c, uint64_t salt, const apc_side_owner *owner, const int32_t *tokens, int64_t p,
                        int64_t n, size_t words, void **state_out, int64_t *n_out);

/* ---- The remote tier, on the same fetch path ----
 * apc_prefetch also reads the remote tier where memory and disk stop, under
 * a deadline of deadline_fraction of what a cold prefill of the missing
 * tokens would cost (clamped to [min_wait_ms, max_wait_ms]); the cost per
 * token is what apc_note_prefill measured, or 1/prefill_tps before that.
 * apc_fetch_wait_ms says how long the prefetch of an n-token prompt may
 * take at most, so the driver waits for it; 0 without a remote tier. */
bool apc_has_remote(const apc *c);
int apc_fetch_wait_ms(apc *c, int64_t n);
/* A prefill chunk of rows tokens took seconds (the driver reports). */
void apc_note_prefill(apc *c, int64_t rows, double seconds);

/* ---- Peeking (the admission gate) ---- */
/* How many tokens of tokens[0, n) a lookup under salt would find in memory
 * now, at most n-1; touches no refcount, LRU order or counter. */
int64_t apc_peek(apc *c, const int32_t *tokens, int64_t n, uint64_t salt);

/* ---- Block events (what KV-event publishers report; serve_kv_events.h) ---- */
/* Every change of what the block tier can find in memory: a block indexed
 * (a store, or a block brought in from disk), an indexed block evicted by
 * the pool's LRU, and the whole index forgotten by apc_reset. The listener
 * runs under the cache's lock on the thread that made the change (the
 * engine thread, a fetch thread, an HTTP thread for a reset): it must be
 * quick, must not block and must not call the cache. tokens is valid during
 * the call only. */
typedef enum apc_block_change {
    APC_BLOCK_STORED = 0,
    APC_BLOCK_REMOVED = 1,
    APC_BLOCKS_CLEARED = 2, /* key, parent, tokens unset */
} apc_block_change;

typedef struct apc_block_event {
    apc_block_change change;
    uint8_t key[16];        /* the block's chained content key */
    uint8_t parent[16];     /* its parent's key; all zero for a chain's first block */
    uint64_t salt;          /* the tenant salt the key was made under */
    const int32_t *tokens;  /* the block's rows */
    int n_rows;             /* 16, or 1..15 for the indexed partial tail of a sequence */
} apc_block_event;

typedef void (*apc_block_listener)(void *user, const apc_block_event *ev);
/* One listener per cache; NULL removes it. */
void apc_set_block_listener(apc *c, apc_block_listener fn, void *user);

/* ---- Stats and reset ---- */
void apc_get_stats(apc *c, apc_stats *out);
/* Forgets every indexed block and exact entry and zeroes the counters.
 * Blocks that live sequences hold stay theirs. */
void apc_reset(apc *c);

#endif
