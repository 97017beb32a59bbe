/* apc_disk_ckpt.c - restart repair: a checkpoint restored from its skeleton
 * and its ckpt-salted block shards (reference §10.5, design.md §2).
 *
 * A skeleton (apc_disk.h) holds a record's token ids, kind and recurrent
 * state; the K/V of its kv and rot layers are the chain [0, p) in block
 * shards under salt ^ APC_DISK_CKPT_SALT. Restoring one:
 *   1. the longest skeleton deeper than what memory offers, read and fully
 *      verified (checksum, key, tokens) with its state;
 *   2. the state restored into the request's model_state and checked to
 *      stand at p; a state that does not restore marks the skeleton bad
 *      (counted, deleted);
 *   3. fresh pool blocks for [0, p) allocated under the cache's lock, filled
 *      from the shards without it (they are private), then adopted into the
 *      request's sequence; a short chain (evicted, corrupt) is a miss and the
 *      next shorter skeleton is tried.
 * The restored blocks are not re-indexed and no record is re-created: the
 * request's own checkpoint stores recreate records in memory (reference
 * §10.5 leaves every later lookup on the disk path; ours is served by those
 * records once the request has run).
 *
 * Locking: the disk's functions take the disk lock themselves; this file
 * takes the cache's lock only around pool operations and never holds it
 * while reading files. */
#include <stdlib.h>
#include <string.h>

#include "apc/apc_ckpt.h"
#include "apc/apc_disk.h"
#include "apc/apc_internal.h"
#include "core/log.h"

typedef struct disk_chain_ctx {
    apc_disk *disk;
    bool no_rows;            /* a stack without K/V rows (pure recurrent) writes no shards: its
                              * blocks only carry the chain, so there is nothing to read */
    int64_t loaded;          /* what the last load filled, for the miss line */
} disk_chain_ctx;

static int64_t disk_chain_load(void *ctx, const apc_key *parent, uint64_t salt, const struct apc_disk_want *want,
                               int64_t n) {
    disk_chain_ctx *dc = ctx;
    dc->loaded = dc->no_rows ? n : apc_disk_load_blocks(dc->disk, parent, salt, want, n);
    return dc->loaded;
}

/* Fills seq with the ckpt chain [0, p) from disk; false: seq stays empty. */
static bool load_chain(apc *c, apc_disk *d, const int32_t *tokens, int64_t p, uint64_t salt, kv_seq *seq) {
    disk_chain_ctx dc = {d, apc__layout(c)->row_floats == 0, 0};
    bool short_of_blocks;
    bool ok = apc__ckpt_load_chain(c, tokens, p, salt, seq, disk_chain_load, &dc, &short_of_blocks);
    int64_t total = (p + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS;
    if (short_of_blocks)
        ember_log(EMBER_LOG_DEBUG, "APC ckpt disk miss: no free pool blocks for a %lld-token chain", (long long)p);
    else if (dc.loaded < total)
        ember_log(EMBER_LOG_DEBUG, "APC ckpt disk miss: main chain %lld/%lld", (long long)dc.loaded, (long long)total);
    return ok;
}

int64_t apc_disk_restore_skeleton(apc *c, apc_disk *d, const int32_t *tokens, int64_t n, uint64_t salt, int64_t min_p,
                                  bool replay_gate, kv_seq *seq, model_state *state, int *kind_out) {
    const apc_layout *lay = apc__layout(c);
    size_t sb = lay->state_bytes;
    if (n < 3 || min_p >= n - 1 || seq->n_tokens != 0 || seq->n_blocks != 0 || (sb && state == NULL)) return 0;
    void *buf = NULL;
    if (sb && (buf = malloc(sb)) == NULL) return 0;
    int64_t max_p = n - 1, got = 0;
    while (max_p > min_p && got == 0) {
        apc_key name;
        int64_t p = apc_disk_find_skeleton(d, tokens, max_p, min_p, replay_gate ? n - 1 : -1, salt, buf, &name, kind_out);
        if (p <= 0) break;
        max_p = p - 1;
        if (sb) {
            if (!apc__state_restore(c, state, buf, p)) {
                apc_disk_skeleton_bad(d, &name, "its state does not restore at its length");
                continue;
            }
        }
        if (!load_chain(c, d, tokens, p, salt, seq)) {
            if (sb) apc__state_reset(c, state);
            continue;
        }
        apc_disk_skeleton_used(d, &name);
        got = p;
    }
    free(buf);
    return got;
}
