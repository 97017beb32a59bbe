/* apc_disk.h - the SSD tier of the prompt cache (internal to src/apc, plus
 * the file parser that tests and the fuzz target call).
 *
 * Contract:
 *  - Directory. Files live in <path>/<namespace>/, the namespace being 32
 *    lowercase hex digits of XXH3-128 over (the tag "ember-apc-disk", the
 *    format version, the model fingerprint - engine_model_fingerprint, or the
 *    namespace_override string instead -, the block size, the KV format
 *    (kv_format_id: f32, f16, q8_0, kvarn with its widths, tail and layout
 *    version), the block-key hash kind, n_layer and
 *    every layer's K and V width, and the attention precision the rows were
 *    written under when it is not f32: kv_pool_attention). Two models, or
 *    one model under two cache or KV formats or attention precisions, never
 *    share a directory;
 *    a renamed model file keeps its namespace (no path enters it).
 *  - Names. b-<32 hex>.apc: a block shard, named by the key of its last
 *    block. x-<32 hex>.apc: an exact snapshot, named by its exact key
 *    XXH3-128("x", salt, token ids). k-<32 hex>.apc: a checkpoint skeleton,
 *    named XXH3-128("k", salt, token ids). s-<32 hex>.apc: a side entry
 *    (a drafter's sidecar, apc_side_store), named XXH3-128("s", side salt,
 *    token ids), the side salt being salt ^ APC_DISK_SIDE_SALT for the
 *    target's MTP head and salt ^ APC_DISK_DRAFT_SIDE_SALT ^ both halves of
 *    the draft model's owner namespace for a draft model (apc.c,
 *    side_salt). .lock: held (flock, shared) by
 *    every open tier. Anything else in the namespace directory (foreign
 *    names, files of format version 1) is deleted at start-up, and so are
 *    temp files .tmp-<pid>-<n>.apc when no other tier has the directory
 *    open (or when they are an hour old): two servers may share a path.
 *    A directory that cannot be created or written fails apc_disk_open.
 *  - What each file restores:
 *      shard     K/V rows of up to 256 consecutive blocks of one chain (the
 *                block tier's chains under the request salt; checkpoint
 *                chains under salt ^ APC_DISK_CKPT_SALT, so the two never
 *                satisfy each other's lookups);
 *      exact     the K/V rows [0, n) of every layer plus, on recurrent
 *                stacks, the model_state snapshot at n: the whole state;
 *      skeleton  a checkpoint record at p = n (reference §10.4): its token
 *                ids, its kind (boundary, anchor, replay, retire) and, on
 *                stacks with arr/list layers, the model_state snapshot at
 *                p. The K/V of its kv and rot layers are not inline: they
 *                are the ckpt-salted chain [0, p) in shards (whole blocks,
 *                plus a partial tail block of p % 16 rows under its
 *                partial key), written with the skeleton and shared by
 *                every skeleton of one conversation (dedup by name);
 *      side      an opaque blob of n rows of `row_floats` 32-bit words for
 *                the tokens [0, n), written and read by the drafter's
 *                sidecar (engine_spec.c); n_layer 1. The MTP head's: no
 *                state, owner zero. A draft model's (a second model, its
 *                own namespace inside the target's directory): owner = its
 *                16-byte namespace (engine_spec.c: XXH3-128 of the draft
 *                model's fingerprint, its pool's KV format, every layer's
 *                K/V row bytes and its state size), rows = its pool's K/V
 *                rows, and for a recurrent draft model its model_state
 *                snapshot at n after them. The reader checks owner, row
 *                width and state size against its drafter's and refuses
 *                (logs, leaves) a file that differs.
 *  - File format, version 2, every integer little-endian:
 *
 *      off  size  field
 *        0     8  magic "EMBRAPC1"
 *        8     4  version (2)
 *       12     4  kind: 1 block shard, 2 exact snapshot, 3 ckpt skeleton, 4 side
 *       16    16  namespace (must equal the directory's)
 *       32     8  salt (the request's; a ckpt shard: salt ^ CKPT_SALT)
 *       40    16  content key (= the file name)
 *       56    16  shard: key of the block before the first one (zero for a
 *                 chain start); side: the owner namespace (zero: the MTP
 *                 head; a draft model's namespace); else zero
 *       72     4  shard: chain index of the first block; skeleton: the
 *                 checkpoint kind (apc_ckpt_kind, 0..3); exact: 0
 *       76     4  shard: number of blocks nb (1..APC_DISK_MAX_BLOCKS); else 0
 *       80     4  shard: rows of the last block (1..16; < 16 is a partial
 *                 tail block under its partial key); else 0
 *       84     4  n_layer
 *       88     8  n_tokens (shard: 16 * (nb - 1) + last rows)
 *       96     8  row_floats: 32-bit words per position, sum over layers of
 *                 K row words + V row words (the KV format's encoded rows)
 *      104     8  created, ns since the epoch (informational)
 *      112     8  state bytes: exact and skeleton: the namespace's
 *                 model_state_bytes (0 on stacks without recurrent
 *                 layers); side: the owner's state size (0: the MTP head
 *                 and KV-only draft models; at most
 *                 APC_DISK_SIDE_MAX_STATE); shard: 0
 *      120     8  header checksum: XXH3-64 of bytes [0, 120) and the key table
 *      128 16*nb  shard: the key of every block (the last = content key)
 *        .  4*n   token ids, int32
 *        .        K/V payload (shard, exact; none in a skeleton), layer by
 *                 layer: K rows [0, n) (k_width words each) then V rows
 *                 [0, n), encoded in the namespace's KV format (kv_rows.h);
 *                 side: n rows of row_floats words (the owner's layout)
 *        .     s  the model_state snapshot (state bytes; model.h format; a
 *                 side file: the draft model's state at n)
 *        .     8  checksum: XXH3-64 of every byte before it
 *
 *    Start-up reads the fixed header and the key table only (the header
 *    checksum and the file size must agree); a read verifies everything:
 *    the whole-file checksum, the key chain recomputed from (parent, salt,
 *    tokens) with the cache's hash kind (the exact or skeleton key for
 *    those), and the tokens against the request's. A skeleton whose state
 *    does not restore (model_state_restore refuses it, or its position is
 *    not p) is treated like a checksum failure. A file that fails is
 *    counted (disk_corrupt), deleted, and the lookup is a miss (a skeleton
 *    restore then tries the next shorter skeleton). A skeleton whose chain
 *    is short on disk (a shard evicted or corrupt) is a plain miss.
 *  - Namespace isolation covers the layer mix: the namespace hash includes
 *    the cache stack (every layer's kind, window, keep) and the state size,
 *    so a model with another stack never opens these files.
 *  - Writes are asynchronous: a store copies the rows out (shards) or pins
 *    the snapshot (exact) and enqueues a job for `workers` threads; a bounded
 *    queue (jobs and bytes) makes a store wait a few ms at most, after which
 *    the write is dropped and counted. Each file is written to a temp name,
 *    fsynced, renamed, and the directory fsynced. ENOSPC/EIO stop writes for
 *    a back-off period (one warning); a vanished directory is recreated.
 *  - Size cap: after a write, files are deleted down to 90% of max_bytes:
 *    the oldest (last used) first, and of a chain the deepest segment first
 *    (a victim whose blocks are the parent of another file's first block
 *    yields to that file), so a partly evicted chain keeps its prefix.
 *  - Locking: one mutex inside apc_disk guards its index, queue and
 *    counters. The cache may call in while holding its own lock (order:
 *    cache lock, then disk lock); the disk never calls back into the cache
 *    while holding its lock. File reads run without either lock. */
#ifndef EMBER_APC_DISK_H
#define EMBER_APC_DISK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "apc/apc.h"
#include "apc/apc_internal.h"
#include "apc/apc_key.h"

#define APC_DISK_VERSION 2u
#define APC_DISK_KIND_SHARD 1u
#define APC_DISK_KIND_EXACT 2u
#define APC_DISK_KIND_SKEL 3u
#define APC_DISK_KIND_SIDE 4u
/* Side entries are written under salt ^ this, so they never answer a
 * lookup of the target's own files. */
#define APC_DISK_SIDE_SALT UINT64_C(0x005d1eca12b07e55)
/* A draft model's side entries: salt ^ this ^ both 64-bit halves of its
 * owner namespace, so two draft models (or one under two KV formats) never
 * see each other's entries, nor the MTP head's. */
#define APC_DISK_DRAFT_SIDE_SALT UINT64_C(0x00d7af75de5a1750)
/* The largest state a side file may carry (a reader bound, 4 GiB). */
#define APC_DISK_SIDE_MAX_STATE (UINT64_C(1) << 32)
#define APC_DISK_HEADER_BYTES 128u
#define APC_DISK_HEADER_SUM_AT 120u  /* the header checksum covers [0, 120) */
/* Checkpoint chains are written under salt ^ this (a fixed 56-bit constant). */
#define APC_DISK_CKPT_SALT UINT64_C(0x00c4e3b5a1f20d17)
#define APC_DISK_SEGMENT_BLOCKS 32   /* blocks per shard written (on a grid of chain positions) */
#define APC_DISK_MAX_BLOCKS 256      /* most blocks a shard may hold (reader limit) */

/* What a reader expects of a file: everything that a namespace implies. */
typedef struct apc_disk_expect {
    uint8_t ns[16];
    apc_hash_kind hash;
    const apc_layout *layout;
} apc_disk_expect;

/* The parsed fixed header and key table of one file. */
typedef struct apc_disk_header {
    uint32_t kind;
    uint64_t salt;
    apc_key content;
    apc_key parent;
    uint32_t first_block, n_blocks, last_rows; /* skeleton: first_block is the ckpt kind */
    uint64_t n_tokens;
    uint64_t created_ns;
    uint64_t state_bytes;   /* exact, skeleton: the state snapshot's bytes */
    uint64_t row_floats;    /* words per position (side files: the blob's row width) */
    uint64_t file_bytes;    /* the size the header implies */
    apc_key *keys;          /* (n_blocks) malloc'd; NULL for exact */
} apc_disk_header;

/* Bytes of a file of this kind and these dimensions (the state size is
 * lay->state_bytes for exact files and skeletons); 0 on overflow. */
uint64_t apc_disk_file_bytes(const apc_layout *lay, uint32_t kind, uint32_t n_blocks, uint64_t n_tokens);
/* The exact key of a snapshot of tokens[0, n) under salt. */
apc_key apc_disk_exact_key(uint64_t salt, const int32_t *tokens, int64_t n);
/* The name key of a side entry of tokens[0, n) under (already salted) salt. */
apc_key apc_disk_side_key(uint64_t salt, const int32_t *tokens, int64_t n);
/* The one-layer layout of a side file of rows of `words` words and a state
 * of state_bytes. */
apc_layout apc_disk_side_layout(int *width, size_t words, size_t state_bytes);
/* The name key of a checkpoint skeleton of tokens[0, n) under salt. */
apc_key apc_disk_skel_key(uint64_t salt, const int32_t *tokens, int64_t n);
/* "b-<hex>.apc" / "x-<hex>.apc" / "k-<hex>.apc" -> kind and key; false for
 * any other name. */
bool apc_disk_parse_name(const char *name, uint32_t *kind, apc_key *key);
void apc_disk_key_hex(const apc_key *k, char out[33]);

/* Verifies a whole in-memory file image (header, key chain, tokens,
 * checksum) without keeping the payload: the fuzz target and the tests.
 * 0 and *out filled (out->keys malloc'd, free with apc_disk_header_free),
 * or -1 with err saying what is wrong. */
int apc_disk_parse_image(const void *buf, size_t size, const apc_disk_expect *ex, apc_disk_header *out,
                         ember_error *err);
void apc_disk_header_free(apc_disk_header *h);

/* ---- Reading a file (apc_disk_format.c) ----
 * A source is read strictly in order, so that the checksum covers every
 * byte: from an fd (pread, direct mode) or from memory (mmap or an image). */
typedef struct apc_disk_src {
    int fd;                 /* >= 0: pread */
    const uint8_t *map;     /* else: bytes in memory */
    uint64_t size;          /* the file's real size */
    uint64_t pos;
    void *hash;             /* XXH3_state_t of bytes [0, pos) */
    uint8_t *scratch;       /* for skipped bytes (direct mode) */
    size_t scratch_cap;
} apc_disk_src;

/* Where the rows of piece j (16-row block j of a shard; all n rows of an
 * exact file as piece 0) of layer l, K (kv 0) or V (kv 1) go; NULL skips.
 * Layer -1 asks where the state snapshot goes (state bytes). */
typedef float *(*apc_disk_dst_fn)(void *user, int layer, int kv, uint32_t piece);

int apc_disk_src_init(apc_disk_src *s, int fd, const void *map, uint64_t size);
void apc_disk_src_free(apc_disk_src *s);
/* Fixed header and key table, checked against ex, the header checksum and
 * the real size. */
int apc_disk_read_header(apc_disk_src *s, const apc_disk_expect *ex, apc_disk_header *h, ember_error *err);
/* The rest: tokens into tokens_out (n_tokens, may be NULL: checked and
 * dropped), the key chain or exact/skeleton key recomputed from them, the
 * payload and the state through dst, and the trailing checksum. */
int apc_disk_read_body(apc_disk_src *s, const apc_disk_expect *ex, const apc_disk_header *h, int32_t *tokens_out,
                       apc_disk_dst_fn dst, void *user, ember_error *err);
/* The destination of an exact snapshot's payload: layer by layer K rows then
 * V rows of n positions into data (the exact tier's layout), the recurrent
 * state into state. For the SSD tier and the remote tier alike. */
typedef struct apc_disk_exact_dst {
    const apc_layout *lay;
    float *data;
    int64_t n;
    void *state;
} apc_disk_exact_dst;
float *apc_disk_exact_dst_fn(void *user, int layer, int kv, uint32_t piece); /* user: apc_disk_exact_dst */
/* Serializes the fixed header and key table (APC_DISK_HEADER_BYTES + 16*nb)
 * into out, the header checksum included (h->state_bytes is written as
 * given). */
void apc_disk_write_header(uint8_t *out, const uint8_t ns[16], const apc_disk_header *h, const apc_layout *lay);

/* ---- The tier ---- */
typedef struct apc_disk apc_disk;

typedef struct apc_disk_stats {
    /* exact_indexed counts exact snapshots and skeletons (both are
     * "exact-format" files, reference §10.1); skeletons_indexed the latter;
     * skeleton_writes: skeletons queued (ckpt_skeleton_writes). */
    uint64_t hits, writes, bytes, max_bytes, evictions, files, blocks_indexed, exact_indexed;
    uint64_t skeletons_indexed, skeleton_writes;
    uint64_t write_drops, write_errors, corrupt;
    uint64_t read_errors; /* reads that failed without proving the file bad (EIO, the test hook) */
    char ns_hex[33];
} apc_disk_stats;

/* The namespace of a cache format (see the contract). */
void apc_disk_namespace(const apc_disk_config *cfg, const apc_layout *lay, apc_hash_kind hash, uint8_t ns[16]);

/* Creates <path>/<ns>/, scans it (start-up repair, one log line) and starts
 * the writers. NULL with err on failure (the caller runs without a disk).
 * lay (kept by reference) must carry its final state_bytes and stack_sig:
 * on recurrent stacks the namespace includes the state size (given to
 * apc_create). */
/* Logs one line for each other KV format whose namespace (same model and
 * cache settings) holds files under cfg->path: a restart that switched the
 * format says why it finds nothing. */
void apc_disk_note_other_formats(const apc_disk_config *cfg, const apc_layout *lay, apc_hash_kind hash,
                                 kv_format own);
apc_disk *apc_disk_open(const apc_disk_config *cfg, const apc_layout *lay, apc_hash_kind hash, kv_pool *pool,
                        ember_error *err);
/* Waits for every queued write to land, stops the writers, frees. */
void apc_disk_close(apc_disk *d);
/* Waits until the queue is empty and no write is in progress. */
void apc_disk_flush(apc_disk *d);
void apc_disk_get_stats(apc_disk *d, apc_disk_stats *s);
/* Zeroes the cumulative counters (hits, writes, evictions, drops, corrupt). */
void apc_disk_reset_counters(apc_disk *d);

/* Block tier. How many of keys[start, n_keys) are on disk, consecutively,
 * from start; marks the files of keys[0, start + result) as used. */
int64_t apc_disk_chain_count(apc_disk *d, const apc_key *keys, int64_t start, int64_t n_keys);
bool apc_disk_has_block(apc_disk *d, const apc_key *key);

/* One block wanted from disk. */
typedef struct apc_disk_want {
    apc_key key;
    const int32_t *tokens;   /* the request's rows of this block */
    int rows;                /* 16, or the rows of a partial block */
    int32_t dst;             /* fresh pool block to fill */
} apc_disk_want;

/* Fills want[i].dst for i = 0.. from the files that hold them, verifying
 * each file (checksum, key chain, tokens, salt; want[0]'s parent must be
 * parent). Returns how many leading entries were loaded; a corrupt file is
 * counted, deleted and ends the load. Runs without the caller's lock; the
 * destination blocks must be private to the caller. */
int64_t apc_disk_load_blocks(apc_disk *d, const apc_key *parent, uint64_t salt, const apc_disk_want *want,
                             int64_t n_want);

/* Queues the blocks [0, n_full) (+ a partial tail of tail_rows rows when
 * tail_rows > 0) of a stored chain that the disk does not hold yet. keys
 * has n_full (+1) entries; the rows are copied out of seq's blocks now. */
void apc_disk_store_chain(apc_disk *d, const apc_key *keys, int64_t n_full, int tail_rows, const int32_t *tokens,
                          uint64_t salt, const kv_seq *seq);

/* Exact tier. */
bool apc_disk_has_exact(apc_disk *d, const apc_key *exact_key);
/* Called by a writer once it no longer reads a queued snapshot. */
typedef void (*apc_disk_release_fn)(void *owner, apc_exact_entry *e);
/* Queues a pinned snapshot (its state too: e->state_bytes must equal the
 * layout's state_bytes, else nothing is written); 0 if queued (release
 * runs later, on a writer thread, with no disk lock held), -1 if not (the
 * caller unpins). */
int apc_disk_store_exact(apc_disk *d, apc_exact_entry *e, apc_disk_release_fn release, void *owner);
/* Loads the longest snapshot on disk that is a prefix of tokens with
 * min_len < n <= max_len under salt and at most max_bytes big (state
 * included); NULL if none (a corrupt file is counted and deleted). The
 * entry is not listed; on recurrent stacks it carries its state. */
apc_exact_entry *apc_disk_load_exact(apc_disk *d, const int32_t *tokens, int64_t max_len, int64_t min_len,
                                     uint64_t salt, size_t max_bytes);

/* ---- Checkpoint skeletons (apc_disk_ckpt.c; reference §10.4-§10.5) ----
 * Queues the skeleton of a record of tokens[0, p) of kind ckpt_kind under
 * salt, and the ckpt-salted chain [0, p) of seq's blocks that the disk
 * does not hold yet (rows copied now; seq must hold [0, p)). state: the
 * record's snapshot (lay->state_bytes bytes; NULL when 0), copied now.
 * Returns whether the skeleton was queued (an existing one is only
 * touched). */
bool apc_disk_store_skeleton(apc_disk *d, const int32_t *tokens, int64_t p, uint64_t salt, int ckpt_kind,
                             const kv_seq *seq, const void *state);
/* Restart repair: the longest skeleton on disk for tokens[0, n) under salt
 * with min_p < p <= n - 1 (a replay skeleton only at p == n - 1 when
 * replay_gate), restored into the empty seq (fresh pool blocks filled from
 * the ckpt-salted shards) and state (may be NULL when state_bytes is 0).
 * Returns p, or 0 (seq and state untouched: empty / reset). Runs without
 * the cache's lock (takes it to allocate and adopt blocks); a corrupt
 * skeleton or shard is counted, deleted, and the next candidate tried. */
/* The parts apc_disk_restore_skeleton is built from: the longest verified
 * skeleton with min_p < p <= max_p that is a prefix of tokens (a replay
 * skeleton only at p == replay_at when replay_at >= 0), its state read into
 * state_out (state_bytes; may be NULL when 0) and its name into name_out;
 * 0 if none. Then: _used counts the hit and marks the file used; _bad
 * counts a skeleton whose state did not restore and deletes it. */
int64_t apc_disk_find_skeleton(apc_disk *d, const int32_t *tokens, int64_t max_p, int64_t min_p, int64_t replay_at,
                               uint64_t salt, void *state_out, apc_key *name_out, int *kind_out);
void apc_disk_skeleton_used(apc_disk *d, const apc_key *name);
void apc_disk_skeleton_bad(apc_disk *d, const apc_key *name, const char *why);
/* Restores the deepest skeleton in (min_p, n-1] into the empty seq and the
 * state (at 0); its position, 0 if none, and its checkpoint kind. */
int64_t apc_disk_restore_skeleton(apc *c, apc_disk *d, const int32_t *tokens, int64_t n, uint64_t salt, int64_t min_p,
                                  bool replay_gate, kv_seq *seq, model_state *state, int *kind_out);

/* Side entries (a drafter's sidecar; salt already the side salt, see
 * Names). owner: NULL or zero for the MTP head; a draft model's namespace
 * and state size. store copies rows (n * words words) and the state
 * (owner->state_bytes) into an asynchronous write; -1: not queued (exists,
 * queue full, out of memory). load returns the longest entry of n' in
 * [p, n] tokens whose tokens are tokens[0, n') and whose owner, row width
 * and state size are the caller's, malloc'd (n' * words words; the state
 * malloc'd into *state_out when it has one), *n_out = n'; NULL: none (a
 * corrupt file is counted and deleted, a foreign one logged and left).
 * Blocks on the disk. */
int apc_disk_store_side(apc_disk *d, uint64_t salt, const apc_side_owner *owner, const int32_t *tokens, int64_t n,
                        const uint32_t *rows, size_t words, const void *state);
uint32_t *apc_disk_load_side(apc_disk *d, uint64_t salt, const apc_side_owner *owner, const int32_t *tokens,
                             int64_t p, int64_t n, size_t words, void **state_out, int64_t *n_out);

#endif
