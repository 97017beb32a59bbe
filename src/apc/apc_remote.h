/* apc_remote.h - the remote tier of the prompt cache: block chains, exact
 * snapshots and checkpoint skeletons shared between replicas through Redis
 * (internal to src/apc; apc.h holds its config and the URL check that
 * serve calls).
 *
 * Contract:
 *  - Keys. "ember:apc:<ns>:b:<key>": <ns> is the SSD tier's namespace (32
 *    hex digits: model fingerprint, cache format, kv format, layer mix,
 *    attention precision when not f32;
 *    apc_disk_namespace), <key> the block's chain key (32 hex digits; the
 *    tenant salt is inside the key). Only replicas of one model under one
 *    cache format ever meet; two tenants never share a key.
 *    Exact snapshots (exact tier): "ember:apc:<ns>:x:<exact key>", the SSD
 *    tier's exact key over (salt, token ids); and a sorted set
 *    "ember:apc:<ns>:l:<anchor>" of the lengths stored under the anchor,
 *    the exact key of the first 16 tokens, so a reader asks only for
 *    prefixes that exist (longest first). It expires with the values.
 *    Checkpoint skeletons (ckpt tier): "ember:apc:<ns>:k:<skeleton key>"
 *    (a record's tokens, kind and recurrent state), indexed the same way in
 *    "ember:apc:<ns>:m:<anchor>"; their K/V is the chain [0, p) as block
 *    values under salt ^ APC_DISK_CKPT_SALT, as on the SSD.
 *    Side entries (a drafter's sidecar, apc_side_store): "ember:apc:<ns>:
 *    s:<side key>" (the SSD tier's side key over the side salt and the
 *    token ids), lengths indexed in "ember:apc:<ns>:t:<anchor>" (the
 *    anchor under the side salt); entries shorter than the anchor stay
 *    local.
 *  - Values. One block (or one snapshot, one skeleton) per key,
 *    self-describing, every integer little-endian:
 *
 *      off  size  field
 *        0     8  magic "EMBRRMT1"
 *        8     4  version (1)
 *       12     4  kind (1: a block of a chain, 2: an exact snapshot,
 *                 3: a checkpoint skeleton, 4: a side entry)
 *       16    16  namespace
 *       32    16  key (= the Redis key's)
 *       48    16  parent key (zero for a chain's first block and snapshots)
 *       64     4  rows (16, or 1..15 for a partial tail block; a
 *                 snapshot's token count)
 *       68     4  zero
 *       72     8  payload length P
 *       80     8  checksum: XXH3-64 of bytes [0, 80), the token ids and
 *                 the payload
 *       88  4*rows token ids, int32
 *        .     P  payload: the block as a one-block shard file of the SSD
 *                 tier (apc_disk.h format, its own header, key chain and
 *                 checksum); a snapshot as an exact file of that format
 *                 (K/V rows and, on recurrent stacks, the state); a
 *                 skeleton as a skeleton file (tokens, kind, state); a
 *                 side entry as a side file (owner, rows, state)
 *
 *    A read checks all of it against what the request expects (namespace,
 *    key, parent, rows, tokens, length, both checksums, the key recomputed
 *    from parent, salt and tokens); any mismatch is counted (remote_corrupt),
 *    the key is deleted so that a replica can write it again, and the chain
 *    stops there: a miss, never an adoption.
 *  - Writes are asynchronous: a store copies the rows of the blocks the
 *    tier does not know to be remote into a bounded queue (bytes); when it
 *    is full the write is dropped and counted (remote_write_drops). One
 *    writer thread asks EXISTS for each key, sends SET NX EX <ttl> for the
 *    missing ones (pipelined), and remembers the keys it wrote or saw so a
 *    later store skips them without copying.
 *  - Reads (apc_remote_chain_count, apc_remote_load_blocks, _load_exact,
 *    _find_skeleton) run on the caller's thread - the engine's fetch
 *    threads - under the caller's deadline: pipelined EXISTS to find the
 *    longest present run, then GETs in windows (snapshots and skeletons:
 *    the stored lengths from the index, longest first); what was verified
 *    when time runs out is kept. A socket
 *    that times out is closed (its replies would be out of step).
 *  - Failure: breaker_failures consecutive errors or timeouts open a
 *    circuit breaker: reads and writes stop at once (writes are counted as
 *    drops) and a background thread PINGs every probe_ms until the server
 *    answers. The first opening logs one warning; nothing here fails a
 *    request.
 *  - Locking: one mutex guards the queue, the connection pool, the known
 *    keys, the breaker and the counters; no Redis call runs under it. */
#ifndef EMBER_APC_REMOTE_H
#define EMBER_APC_REMOTE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "apc/apc.h"
#include "apc/apc_disk.h"
#include "apc/apc_internal.h"
#include "apc/apc_key.h"

#define APC_REMOTE_VERSION 1u
#define APC_REMOTE_KIND_BLOCK 1u
#define APC_REMOTE_KIND_EXACT 2u
#define APC_REMOTE_KIND_SKEL 3u
#define APC_REMOTE_KIND_SIDE 4u
#define APC_REMOTE_ANCHOR_TOKENS 16 /* snapshots shorter than this stay local */
#define APC_REMOTE_ENVELOPE_BYTES 88u

/* Where the server is: redis://host[:port][/db] or unix:///path[?db=N]. */
typedef struct apc_remote_addr {
    char host[256];  /* "" for a unix socket */
    int port;
    char path[256];  /* unix socket path, else "" */
    int db;
} apc_remote_addr;

/* Parses url; -1 with err naming what is wrong. */
int apc_remote_parse_url(const char *url, apc_remote_addr *out, ember_error *err);

typedef struct apc_remote apc_remote;

typedef struct apc_remote_stats {
    uint64_t hits, hit_tokens, writes, errors, timeouts, corrupt, write_drops;
    bool breaker_open;
} apc_remote_stats;

/* Connects lazily: a server that is down at start-up only opens the
 * breaker. NULL with err when the URL is bad or memory runs out. lay and
 * pool are kept by reference. */
apc_remote *apc_remote_open(const apc_remote_config *cfg, const uint8_t ns[16], const apc_layout *lay,
                            apc_hash_kind hash, kv_pool *pool, ember_error *err);
/* Lets queued writes go (flush first to wait for them), stops the threads. */
void apc_remote_close(apc_remote *r);
/* Waits until the write queue is empty and no write is in progress. */
void apc_remote_flush(apc_remote *r);
void apc_remote_get_stats(apc_remote *r, apc_remote_stats *s);
void apc_remote_reset_counters(apc_remote *r);
/* Whether reads are worth trying now (the breaker is closed). */
bool apc_remote_up(apc_remote *r);

/* Reads, on a fetch thread, before deadline (ember_now() seconds).
 * How many of keys[0, n_keys) are present, consecutively from 0; when all
 * are, *tail_at gets the index of the first present of tail[0, n_tail)
 * (the caller lists partial-key candidates longest first), else -1. */
int64_t apc_remote_chain_count(apc_remote *r, const apc_key *keys, int64_t n_keys, const apc_key *tail, int n_tail,
                               int *tail_at, double deadline);
/* Fills want[i].dst for i = 0.. with verified values (want[0]'s parent is
 * parent); returns how many leading entries were loaded by the deadline. */
int64_t apc_remote_load_blocks(apc_remote *r, const apc_key *parent, uint64_t salt, const apc_disk_want *want,
                               int64_t n_want, double deadline);

/* Exact tier. Queues a copy of the snapshot (its state too) unless the
 * tier knows it is remote; snapshots of fewer than APC_REMOTE_ANCHOR_TOKENS
 * tokens stay local. */
void apc_remote_store_exact(apc_remote *r, const apc_exact_entry *e);
/* The longest verified snapshot in Redis that is a prefix of tokens with
 * min_len < n <= max_len under salt and at most max_bytes (state included);
 * NULL if none by the deadline. The entry is not listed. */
apc_exact_entry *apc_remote_load_exact(apc_remote *r, const int32_t *tokens, int64_t max_len, int64_t min_len,
                                       uint64_t salt, size_t max_bytes, double deadline);

/* Side entries (a drafter's sidecar; salt already the side salt, owner as
 * for apc_disk_store_side). store queues a copy (-1: not queued: shorter
 * than the anchor, or bad arguments; a full queue drops it, counted);
 * load returns the longest verified entry of n' in [p, n] tokens of this
 * owner and row width by the deadline (rows malloc'd, the state malloc'd
 * into *state_out when the owner has one), NULL if none; a value that
 * fails is counted (remote_corrupt), deleted, and the next shorter tried. */
int apc_remote_store_side(apc_remote *r, uint64_t salt, const apc_side_owner *owner, const int32_t *tokens,
                          int64_t n, const uint32_t *rows, size_t words, const void *state);
uint32_t *apc_remote_load_side(apc_remote *r, uint64_t salt, const apc_side_owner *owner, const int32_t *tokens,
                               int64_t p, int64_t n, size_t words, void **state_out, int64_t *n_out, double deadline);

/* Checkpoint tier. Queues the skeleton of a record of tokens[0, p) of
 * kind ckpt_kind under salt (its state copied now; lay->state_bytes, NULL
 * when 0) and the chain [0, p) of seq's blocks under salt ^
 * APC_DISK_CKPT_SALT, keyed with hash. */
void apc_remote_store_skeleton(apc_remote *r, const int32_t *tokens, int64_t p, uint64_t salt, int ckpt_kind,
                               const kv_seq *seq, const void *state, apc_hash_kind hash);
/* The deepest verified skeleton in Redis for tokens with min_p < p <=
 * max_p (a replay skeleton only at p == replay_at when replay_at >= 0): its
 * state into state_out, its kind into *kind_out; p, or 0 if none by the
 * deadline. The chain is read with apc_remote_load_blocks. */
int64_t apc_remote_find_skeleton(apc_remote *r, const int32_t *tokens, int64_t max_p, int64_t min_p, int64_t replay_at,
                                 uint64_t salt, void *state_out, int *kind_out, double deadline);

/* Queues the blocks [0, n_full) (+ a partial tail of tail_rows rows) of a
 * stored chain whose keys the tier does not know to be remote; rows are
 * copied out of seq's blocks now. keys has n_full (+1) entries. */
void apc_remote_store_chain(apc_remote *r, const apc_key *keys, int64_t n_full, int tail_rows, const int32_t *tokens,
                            uint64_t salt, const kv_seq *seq);

#endif
