/* apc_snap.c - the block tier over recurrent layers: model-state snapshots
 * that ride on the block chain (issue 17).
 *
 * Why. A recurrent layer (arr: mamba2, gated delta net; list: falcon-h1's
 * attention + mamba) cannot be cut at an arbitrary position, so those stacks
 * used to go to the exact tier (whole prefixes only) or the checkpoint tier
 * (a few records per chain, on a 512-token grid). A branch or a sibling
 * agent then adopted at best the last grid point. Yet a state snapshot is
 * small next to the K/V of the tokens between two snapshots, and the block
 * tier already names every prefix by content (its chained keys). So here a
 * snapshot is attached to the indexed pool block whose last row it follows:
 *   - every `interval` tokens along prefill and decode (absolute positions,
 *     a multiple of 16, so the block is full), at the system-prompt end and
 *     the turn boundary the chat layer predicts, at N-1 (identical resend),
 *     after the prompt (N) and at retirement (prompt + reply); the last
 *     ones usually end inside a block, where the block tier's indexed
 *     partial tail (keyed with its row count) carries the snapshot;
 *   - the snapshot belongs to the block's index entry: when the pool hands
 *     the block out again its snapshot goes too (apc_snaps_evict from the
 *     evict hook), so a snapshot never outlives the K/V it continues; a
 *     byte budget drops the least recently used snapshots first;
 *   - a lookup walks the chain as the block tier does and adopts up to the
 *     deepest block (full, or a partial tail) that carries a snapshot, at
 *     most N-1 tokens, then restores the state from it. Different prompts
 *     that share a prefix share its blocks and its snapshots.
 * Invariant 1 (warm == cold): a snapshot is the state after exactly the
 * tokens of its chain. The recurrences run token by token in position order
 * per sequence (arch_mamba2.c, arch_gdn.c) and every kernel is
 * batch-invariant (test_model's batch-invariance checks on every
 * architecture), so the state a cold run holds at any position it passes is
 * the state a storing run snapshotted there, however either split its
 * prefill into chunks; the tests compare warm and cold logits with memcmp.
 * Prefill stops at the snapshot points (apc_req_next_stop), so chunks there
 * are `interval` tokens long on prompts that are not yet cached.
 *
 * Cost. One snapshot is apc_state_ops.bytes (model_state_bytes); the keys
 * of a request's chain are computed once and extended as it grows (the
 * apc_req keeps them), so the stops cost one block-store pass each. The
 * state is copied in and out under the cache's lock (a memcpy). */
#include <stdlib.h>
#include <string.h>

#include "apc/apc_disk.h"
#include "apc/apc_internal.h"
#include "core/log.h"

/* ---- The table ---- */

int apc_snaps_init(apc_snaps *s, int32_t n_blocks, size_t each, size_t max_bytes, int interval) {
    memset(s, 0, sizeof *s);
    s->newest = s->oldest = -1;
    s->state = calloc((size_t)n_blocks, sizeof *s->state);
    s->newer = malloc((size_t)n_blocks * sizeof *s->newer);
    s->older = malloc((size_t)n_blocks * sizeof *s->older);
    if (s->state == NULL || s->newer == NULL || s->older == NULL) {
        apc_snaps_free(s);
        return -1;
    }
    s->n_blocks = n_blocks;
    s->each = each;
    s->max_bytes = max_bytes;
    /* interval points must end full blocks */
    s->interval = interval < KV_BLOCK_TOKENS ? KV_BLOCK_TOKENS : interval / KV_BLOCK_TOKENS * KV_BLOCK_TOKENS;
    return 0;
}

static void snap_unlink(apc_snaps *s, int32_t b) {
    if (s->newer[b] >= 0) s->older[s->newer[b]] = s->older[b];
    else s->newest = s->older[b];
    if (s->older[b] >= 0) s->newer[s->older[b]] = s->newer[b];
    else s->oldest = s->newer[b];
}

static void snap_push_newest(apc_snaps *s, int32_t b) {
    s->newer[b] = -1;
    s->older[b] = s->newest;
    if (s->newest >= 0) s->newer[s->newest] = b;
    else s->oldest = b;
    s->newest = b;
}

static void snap_drop(apc_snaps *s, int32_t b) {
    snap_unlink(s, b);
    free(s->state[b]);
    s->state[b] = NULL;
    s->count--;
    s->bytes -= s->each;
}

void apc_snaps_clear(apc_snaps *s) {
    if (s->state == NULL) return; /* never initialised: the tier has no snapshots */
    while (s->oldest >= 0) snap_drop(s, s->oldest);
}

void apc_snaps_free(apc_snaps *s) {
    apc_snaps_clear(s);
    free(s->state);
    free(s->newer);
    free(s->older);
    memset(s, 0, sizeof *s);
    s->newest = s->oldest = -1;
}

void apc_snaps_evict(apc_snaps *s, int32_t block) {
    if (s->state == NULL || block < 0 || block >= s->n_blocks || s->state[block] == NULL) return;
    snap_drop(s, block);
    s->evictions++;
}

/* Takes buf unless the block has a snapshot already (same prefix, same
 * state); the budget then drops the oldest others. */
static bool snap_attach(apc_snaps *s, int32_t b, void *buf) {
    if (s->state[b]) {
        snap_unlink(s, b);
        snap_push_newest(s, b);
        return false;
    }
    s->state[b] = buf;
    snap_push_newest(s, b);
    s->count++;
    s->bytes += s->each;
    s->stores++;
    while (s->bytes > s->max_bytes && s->oldest >= 0 && s->oldest != b) {
        snap_drop(s, s->oldest);
        s->evictions++;
    }
    return true;
}

/* ---- Keys ---- */

/* The chain keys of tokens' first n_blocks full blocks, with room for one
 * more. The request's own array (prompt, then its reply) is keyed
 * incrementally; anything else gets a fresh array in *own. */
static apc_key *chain_keys(apc_req *r, const int32_t *tokens, int64_t n_blocks, apc_key **own) {
    *own = NULL;
    apc_hash_kind h = apc__hash(r->c);
    if (tokens != r->prompt) {
        *own = malloc((size_t)(n_blocks + 1) * sizeof **own);
        if (*own) apc_chain_keys(h, tokens, n_blocks, r->salt, *own);
        return *own;
    }
    if (n_blocks + 1 > r->cap_keys) {
        int64_t cap = r->cap_keys * 2 > n_blocks + 1 ? r->cap_keys * 2 : n_blocks + 1;
        if (cap < 64) cap = 64;
        apc_key *k = realloc(r->keys, (size_t)cap * sizeof *k);
        if (k == NULL) return NULL;
        r->keys = k;
        r->cap_keys = cap;
    }
    apc_key zero;
    memset(&zero, 0, sizeof zero);
    for (int64_t i = r->n_keys; i < n_blocks; i++)
        r->keys[i] = apc_block_key(h, i > 0 ? &r->keys[i - 1] : &zero, r->salt, tokens + i * KV_BLOCK_TOKENS);
    if (n_blocks > r->n_keys) r->n_keys = n_blocks;
    return r->keys;
}

/* ---- The chain walk ---- */

/* Under the lock: whether block b holds these rows as parent's child. */
static bool meta_matches(const apc_index *ix, int32_t b, const apc_key *parent, uint64_t salt, const int32_t *tokens,
                         int rows) {
    const apc_block_meta *m = &ix->meta[b];
    return m->indexed && m->n_rows == rows && m->salt == salt && apc_key_eq(&m->parent, parent) &&
           memcmp(m->tokens, tokens, (size_t)rows * sizeof(int32_t)) == 0;
}

/* Under the lock: the deepest position p <= n-1 of tokens' chain whose
 * block carries a snapshot; chain[] receives the block ids of [0, p) (the
 * last one possibly partial), *n_chain their count. 0 when none. */
static int64_t walk_locked(apc *c, const apc_key *keys, const int32_t *tokens, int64_t n, uint64_t salt,
                           int32_t *chain, int32_t *n_chain) {
    apc_index *ix = apc__index(c);
    apc_snaps *s = apc__snaps(c);
    apc_key zero;
    memset(&zero, 0, sizeof zero);
    const int64_t nb = (n - 1) / KV_BLOCK_TOKENS;
    int64_t matched = 0, best = 0;
    for (; matched < nb; matched++) {
        int32_t b = apc_index_find(ix, &keys[matched]);
        if (b < 0 || !meta_matches(ix, b, matched > 0 ? &keys[matched - 1] : &zero, salt,
                                   tokens + matched * KV_BLOCK_TOKENS, KV_BLOCK_TOKENS))
            break;
        chain[matched] = b;
        if (s->state[b]) best = matched + 1;
    }
    int64_t rest = (n - 1) - matched * KV_BLOCK_TOKENS;
    if (rest >= 1) {
        const apc_key *parent = matched > 0 ? &keys[matched - 1] : &zero;
        const int32_t *t = tokens + matched * KV_BLOCK_TOKENS;
        for (int m = rest < KV_BLOCK_TOKENS ? (int)rest : KV_BLOCK_TOKENS - 1; m >= 1; m--) {
            apc_key k = apc_partial_key(apc__hash(c), parent, salt, t, m);
            int32_t b = apc_index_find(ix, &k);
            if (b >= 0 && s->state[b] && meta_matches(ix, b, parent, salt, t, m)) {
                chain[matched] = b;
                *n_chain = (int32_t)matched + 1;
                return matched * KV_BLOCK_TOKENS + m;
            }
        }
    }
    *n_chain = (int32_t)best;
    return best * KV_BLOCK_TOKENS;
}

/* ---- Stores ---- */

/* Attaches buf (the state at p) to the indexed block that ends at p, whose
 * key is last. Frees buf when it is not kept. */
static void attach_at(apc *c, const apc_key *last, int64_t p, uint64_t salt, void *buf) {
    const int rows = (int)(p % KV_BLOCK_TOKENS);
    bool kept = false;
    int32_t b;
    apc__lock(c);
    apc_index *ix = apc__index(c);
    b = apc_index_find(ix, last);
    if (b >= 0 && ix->meta[b].indexed && ix->meta[b].n_rows == (rows ? rows : KV_BLOCK_TOKENS) &&
        ix->meta[b].salt == salt)
        kept = snap_attach(apc__snaps(c), b, buf);
    apc__unlock(c);
    ember_log(EMBER_LOG_DEBUG, "APC snapshot store: p=%lld block=%d %s", (long long)p, (int)b,
              kept ? "kept" : "not kept");
    if (!kept) free(buf);
}

/* Indexes tokens[0, p) from seq and attaches the state (standing at p) to
 * the block that ends at p; a state elsewhere stores the blocks only.
 * mirror: also queue a skeleton (tokens, state, ckpt-salted chain) to the
 * SSD tier, which a restart's prefetch turns back into blocks and a
 * snapshot (snap_prefetch). */
static void snap_store(apc_req *r, apc_store_point point, const int32_t *tokens, int64_t p, const kv_seq *seq,
                       const model_state *state, bool mirror) {
    apc *c = r->c;
    if (p < 1 || p > seq->n_tokens) return;
    const int64_t nb = p / KV_BLOCK_TOKENS;
    apc_key *own;
    apc_key *keys = chain_keys(r, tokens, nb, &own);
    if (keys == NULL) return; /* out of memory: nothing stored, nothing wrong */
    /* The store writes the partial tail's key into keys[nb], which may hold
     * the request's cached full key of that block: put it back after. */
    apc_key full_nb = keys[nb];
    apc__store_blocks_keyed(c, point, tokens, p, r->salt, seq, keys);
    apc_key last = p % KV_BLOCK_TOKENS ? keys[nb] : keys[nb - 1];
    keys[nb] = full_nb;
    size_t sb = apc__state_bytes(c);
    void *buf = NULL;
    if (state && apc__state_pos(c, state) == p && (buf = malloc(sb)) != NULL) {
        apc__state_snapshot(c, state, buf);
        apc_disk *disk = apc__disk(c);
        if (mirror && disk && p >= 2) apc_disk_store_skeleton(disk, tokens, p, r->salt, APC_CKPT_BOUNDARY, seq, buf);
        attach_at(c, &last, p, r->salt, buf);
    }
    free(own);
}

/* ---- The tier's operations (apc_req.h) ---- */

static apc_hit snap_lookup(apc_req *r, kv_seq *seq, model_state *state) {
    apc_hit hit = {0, APC_SOURCE_NONE};
    apc *c = r->c;
    const int64_t n = r->N;
    if (n < 2 || state == NULL || apc__state_pos(c, state) != 0) return hit;
    apc_key *own;
    apc_key *keys = chain_keys(r, r->prompt, (n - 1) / KV_BLOCK_TOKENS, &own);
    int32_t *chain = malloc((size_t)((n - 1) / KV_BLOCK_TOKENS + 1) * sizeof *chain);
    if (keys == NULL || chain == NULL) {
        free(chain);
        free(own);
        return hit;
    }
    apc__lock(c);
    int32_t n_chain = 0;
    int64_t p = walk_locked(c, keys, r->prompt, n, r->salt, chain, &n_chain);
    kv_pool *pool = apc__pool(c);
    bool ok = p > 0;
    for (int32_t i = 0; i < n_chain && ok; i++)
        if (kv_seq_adopt_block(pool, seq, chain[i], NULL) < 0) ok = false;
    if (ok) {
        kv_seq_truncate(pool, seq, p); /* a partial last block stays shared; copied on append */
        apc_snaps *s = apc__snaps(c);
        int32_t b = chain[n_chain - 1];
        ok = apc__state_restore(c, state, s->state[b], p);
        if (ok) {
            snap_unlink(s, b);
            snap_push_newest(s, b);
            s->hits++;
        }
    }
    if (ok) {
        apc__count_hit_locked(c, p);
        hit.n_tokens = p;
        hit.source = APC_SOURCE_BLOCK;
    } else {
        kv_seq_release(pool, seq);
        apc__count_miss_locked(c);
    }
    apc__unlock(c);
    free(chain);
    free(own);
    if (hit.n_tokens) ember_log(EMBER_LOG_DEBUG, "APC snapshot hit: prefix=%lld", (long long)p);
    return hit;
}

static int64_t snap_peek(apc *c, const int32_t *tokens, int64_t n, uint64_t salt) {
    const int64_t nb = (n - 1) / KV_BLOCK_TOKENS;
    apc_key *keys = malloc((size_t)(nb + 1) * sizeof *keys);
    int32_t *chain = malloc((size_t)(nb + 1) * sizeof *chain);
    int64_t p = 0;
    if (keys && chain) {
        apc_chain_keys(apc__hash(c), tokens, nb, salt, keys);
        int32_t n_chain;
        apc__lock(c);
        p = walk_locked(c, keys, tokens, n, salt, chain, &n_chain);
        apc__unlock(c);
    }
    free(keys);
    free(chain);
    return p;
}

/* Restart repair, off the engine thread: a skeleton on disk deeper than
 * memory's best snapshot is read into a private sequence and a scratch
 * state (apc_disk_restore_skeleton verifies both), its blocks are indexed
 * under the request's salt and its state attached, then the sequence is let
 * go: the blocks stay findable and the lookup adopts them. */
static int64_t snap_prefetch(apc *c, const int32_t *tokens, int64_t n, uint64_t salt) {
    int64_t mem = snap_peek(c, tokens, n, salt);
    apc_disk *disk = apc__disk(c);
    model_state *scratch = NULL;
    if (disk == NULL || n < 3 || (scratch = apc__state_scratch(c)) == NULL) return mem;
    kv_seq seq;
    kv_seq_init(&seq);
    int kind;
    int64_t p = apc_disk_restore_skeleton(c, disk, tokens, n, salt, mem, false, &seq, scratch, &kind);
    apc_key *keys = p > 0 ? malloc((size_t)(p / KV_BLOCK_TOKENS + 1) * sizeof *keys) : NULL;
    void *buf = keys ? malloc(apc__state_bytes(c)) : NULL;
    if (buf) {
        apc_chain_keys(apc__hash(c), tokens, p / KV_BLOCK_TOKENS, salt, keys);
        apc__store_blocks_keyed(c, APC_STORE_PAUSE, tokens, p, salt, &seq, keys);
        apc__state_snapshot(c, scratch, buf);
        attach_at(c, p % KV_BLOCK_TOKENS ? &keys[p / KV_BLOCK_TOKENS] : &keys[p / KV_BLOCK_TOKENS - 1], p, salt, buf);
        ember_log(EMBER_LOG_DEBUG, "APC snapshot restored from disk: prefix=%lld", (long long)p);
    }
    free(keys);
    apc_seq_release(c, &seq);
    apc__state_drop(c, scratch);
    return snap_peek(c, tokens, n, salt);
}

static void snap_plan(apc_req *r) {
    r->snap_hint[0] = r->hints.anchor_pos;
    r->snap_hint[1] = r->hints.turn_pos;
    const int64_t iv = apc__snaps(r->c)->interval;
    r->ring_next = (r->N / iv + 1) * iv; /* the first decode snapshot point */
}

static int64_t snap_next_stop(const apc_req *r, int64_t p) {
    const int64_t iv = apc__snaps(r->c)->interval;
    int64_t next = (p / iv + 1) * iv;
    for (int i = 0; i < 2; i++)
        if (r->snap_hint[i] > p && r->snap_hint[i] < next) next = r->snap_hint[i];
    return next;
}

static void snap_at(apc_req *r, const kv_seq *seq, const model_state *state) {
    const int64_t p = seq->n_tokens, iv = apc__snaps(r->c)->interval;
    if (p % iv == 0 || p == r->snap_hint[0] || p == r->snap_hint[1] || p == r->N - 1)
        snap_store(r, APC_STORE_PREFILL, r->prompt, p, seq, state, p % iv != 0 || p == r->N - 1);
}

static void snap_prefilled(apc_req *r, const kv_seq *seq, const model_state *state) {
    snap_store(r, APC_STORE_PREFILL, r->prompt, r->N, seq, state, true);
}

/* A speculative step may commit several tokens at once and jump over an
 * interval point: the snapshot is then taken where the step landed (exact
 * there too), the first position at or past the point. */
static int64_t snap_decode(apc_req *r, const int32_t *all, const kv_seq *seq, const model_state *state) {
    const int64_t p = seq->n_tokens, iv = apc__snaps(r->c)->interval;
    if (p >= r->ring_next) {
        snap_store(r, APC_STORE_PREFILL, all, p, seq, state, false);
        r->ring_next = (p / iv + 1) * iv;
    }
    return 0; /* snapshots need no render prediction: the chain says where they apply */
}

static bool snap_wants_last(const apc_req *r, int64_t n_kv) {
    (void)r, (void)n_kv;
    return true; /* the state after the whole reply serves the next turn */
}

static void snap_retire(apc_req *r, const int32_t *all, int64_t n, int64_t common, const kv_seq *seq,
                        const model_state *state) {
    (void)common;
    snap_store(r, APC_STORE_RETIRE, all, n, seq, state, true);
}

const apc_tier_ops apc_snap_ops = {
    .lookup = snap_lookup,
    .plan = snap_plan,
    .next_stop = snap_next_stop,
    .at = snap_at,
    .prefilled = snap_prefilled,
    .decode = snap_decode,
    .predicted = apc__no_predicted,
    .retire_wants_last_token = snap_wants_last,
    .retire_wants_prediction = apc__no_prediction,
    .retire = snap_retire,
    .peek = snap_peek,
    .prefetch = snap_prefetch,
    .serial = false,
    .progressive = true,
};
