/* apc_ckpt.c - checkpoint records, the prefill schedule, decode-time
 * snapshots, ckpt retirement, exact-tier anchors and the per-request
 * protocol (see apc_ckpt.h).
 *
 * Design. ember keeps every position of every attention layer (kv and rot
 * alike) in the paged pool, so the only state that cannot be cut at an
 * arbitrary position is the recurrent state of arr layers. A checkpoint
 * record is therefore cheap: a reference on each block of the chain [0, p)
 * the storing sequence already holds (no copy; a partial last block is
 * copied by the pool when its owner appends, because the record's reference
 * makes it shared), plus a model_state snapshot on arr stacks. Records of
 * one conversation share their blocks through the refcounts, which is the
 * dedup the reference gets from its salted chain keys. A lookup adopts the
 * record's blocks into the new sequence (refcount only, under the lock) and
 * restores the state outside the lock from the pinned record.
 *
 * Where the reference and design.md differ, design.md wins:
 *  - restore points of recurrent state lie on the prefill grid or at N-1:
 *    interval, turn and anchor points are floored to the unit on arr
 *    layouts, exact-tier anchors of recurrent stacks too; the replay gate
 *    keeps replay records (N-1) for identical resends;
 *  - a lookup that only finds a record of exactly the query's length is not
 *    a missed adoption (the N-1 rule, not a fault);
 *  - when the pool runs dry, records are evicted (ckpt_pool_evictions)
 *    instead of declining the live request's allocation;
 *  - a ckpt retirement whose next-turn render diverges and that has no
 *    decode snapshot below the divergence skips the whole-sequence fallback
 *    when this request's turn checkpoint landed (retire_fallback_suppressed):
 *    that record already serves the next turn.
 *
 * The SSD tier (apc_disk.h), when the cache has one: a store asked to
 * (skeleton policy below) also queues the record's skeleton and its
 * ckpt-salted chain before the record is listed; a lookup first asks the
 * disk for a skeleton deeper than the best record in memory (design.md §2:
 * longest wins) and falls back to memory when the disk has none or its
 * restore fails. Skeleton policy (reference §7.2, §10.4): stacks without
 * arr layers write one for every store; arr stacks for the post-prefill,
 * retirement, anchor and replay stores and for cursor points at or after
 * the terminal (interval points would write a state that is superseded
 * minutes later). Unlike the reference, a skeleton records its kind, so a
 * replay skeleton on an arr stack is written and obeys the replay gate on
 * disk as in memory. Grid-truncated stores write none.
 *
 * Locking: the cache's mutex (apc__lock) guards records, anchors, counters
 * and the pool. Snapshots of states and of exact anchors are copied outside
 * it; a record or anchor being read is pinned. */
#include "apc/apc_ckpt.h"

#include <stdlib.h>
#include <string.h>

#include "apc/apc_disk.h"
#include "apc/apc_remote.h"
#include "apc/apc_internal.h"
#include "core/log.h"

/* ---- Configuration ---- */

/* Compiled-in defaults; the settings table (serve_settings.c) documents
 * them and lets the file, the environment and flags override them. */
apc_ckpt_config apc_ckpt_default_config(void) {
    apc_ckpt_config c;
    c.interval = 4096;
    c.replay = true;
    c.replay_min = 64;
    c.turn = true;
    c.sys = true;
    c.sys_min = 256;
    c.tripwire = 5;
    c.records = 32;
    c.heavy = 2;
    c.budget_bytes = (size_t)4096 << 20;
    c.decode_interval = 512;
    c.anchor_entries = 0; /* no count cap: anchor_budget_bytes sizes the LRU */
    c.anchor_budget_bytes = (size_t)4096 << 20;
    c.snapshot_interval = 64;
    c.snapshot_budget_bytes = (size_t)1024 << 20;
    return c;
}

static const char *decline_names[APC_CKPT_DECLINE_COUNT_] = {
    "layout", "buffered", "offset", "grid", "short_chain", "canon", "clone", "exception", "anchor_clone", "replay_gate",
};

const char *apc_ckpt_decline_name(apc_ckpt_decline d) {
    return (unsigned)d < APC_CKPT_DECLINE_COUNT_ ? decline_names[d] : "?";
}

const char *apc_ckpt_kind_name(apc_ckpt_kind k) {
    switch (k) {
    case APC_CKPT_BOUNDARY: return "boundary";
    case APC_CKPT_ANCHOR: return "anchor";
    case APC_CKPT_REPLAY: return "replay";
    case APC_CKPT_RETIRE: return "retire";
    }
    return "?";
}

/* ---- The prefill schedule ---- */

static int64_t floor_to(int64_t x, int64_t g) { return g > 0 ? x / g * g : x; }

/* Inserts (pos, kind) keeping out sorted; on a collision an anchor upgrades
 * the existing point, anything else keeps it. */
static void sched_add(apc_ckpt_point *out, int *n, int cap, int64_t pos, apc_ckpt_kind kind) {
    int i = 0;
    while (i < *n && out[i].pos < pos) i++;
    if (i < *n && out[i].pos == pos) {
        if (kind == APC_CKPT_ANCHOR) out[i].kind = APC_CKPT_ANCHOR;
        return;
    }
    if (*n >= cap) return;
    memmove(&out[i + 1], &out[i], (size_t)(*n - i) * sizeof *out);
    out[i].pos = pos;
    out[i].kind = kind;
    (*n)++;
}

int apc_ckpt_schedule(const apc_ckpt_sched_in *in, apc_ckpt_point *out, int cap, int64_t *bounds, int *n_bounds) {
    int n = 0;
    *n_bounds = 0;
    const apc_ckpt_config *cfg = &in->cfg;
    const int64_t unit = in->unit > 0 ? in->unit : KV_BLOCK_TOKENS;
    const int64_t N = in->n, restored = in->restored;
    const bool has_rot = in->window > 0;
    /* 1-2. Interval points on the grid, then the terminal. */
    int64_t terminal = floor_to(in->guard, unit);
    if (terminal > restored) {
        if (cfg->interval > 0) {
            int64_t iv = floor_to(cfg->interval, unit);
            if (iv < unit) iv = unit;
            for (int64_t p = (restored / iv + 1) * iv; p < terminal; p += iv) sched_add(out, &n, cap, p, APC_CKPT_BOUNDARY);
        }
        sched_add(out, &n, cap, terminal, APC_CKPT_BOUNDARY);
    }
    /* 3. The turn checkpoint. */
    if (cfg->turn && in->p_stable > 0) {
        int64_t need = (in->has_arr || !has_rot) ? unit : (unit < in->window ? unit : in->window);
        if (N - 1 >= need) {
            int64_t ps = in->p_stable < N - 1 ? in->p_stable : N - 1;
            int64_t g = floor_to(ps, unit);
            if (g > restored && g > 0) {
                sched_add(out, &n, cap, g, APC_CKPT_BOUNDARY);
                bounds[(*n_bounds)++] = g;
            }
            if (!in->has_arr && has_rot && ps % unit != 0 && ps > restored && ps >= in->window) {
                sched_add(out, &n, cap, ps, APC_CKPT_BOUNDARY);
                bounds[(*n_bounds)++] = ps;
            }
        }
    }
    /* 4. The system-prompt anchor. */
    if (cfg->sys && in->sys_lcp > 0) {
        /* The floor is sys_min alone: tying it to replay_min (the reference)
         * kept recurrent stacks from anchoring system prompts shorter than
         * the replay floor, which siblings share all the same. */
        int64_t fl = cfg->sys_min > KV_BLOCK_TOKENS ? cfg->sys_min : KV_BLOCK_TOKENS;
        if (N - 1 >= fl) {
            int64_t g = in->has_arr ? unit : KV_BLOCK_TOKENS;
            int64_t pos = floor_to(in->sys_lcp < N - 1 ? in->sys_lcp : N - 1, g);
            if (pos >= fl && pos > restored) sched_add(out, &n, cap, pos, APC_CKPT_ANCHOR);
        }
    }
    /* 5. The replay checkpoint at N-1. */
    if (cfg->replay && N - 1 >= 2 && N - 1 > restored && (!in->has_arr || N >= cfg->replay_min) &&
        (!has_rot || N - 1 >= in->window))
        sched_add(out, &n, cap, N - 1, APC_CKPT_REPLAY);
    return n;
}

/* ---- Records ---- */

typedef struct ck_rec {
    struct ck_rec *newer, *older;
    int32_t *tokens;
    int64_t p;
    uint64_t salt;
    apc_ckpt_kind kind;
    int32_t *blocks; /* (n_blocks) one reference each while listed */
    int32_t n_blocks;
    void *state;     /* arr stacks: model_state snapshot at p */
    size_t bytes;    /* record-owned: the state */
    int pins;
    bool listed;
} ck_rec;

struct apc_ckpt {
    apc *c;
    apc_ckpt_config cfg;
    apc_tier tier;
    bool has_arr;
    int window, keep;
    ck_rec *newest, *oldest;
    int count;
    size_t bytes;
    apc_exact anchors;
    /* counters (reference §11.1 ckpt family; zeroed by reset) */
    uint64_t stores, hits, matched, missed, pool_evictions, grid_truncate, fallback_full, fallback_suppressed;
    uint64_t anchor_stores, anchor_hits, armed;
    uint64_t declines[APC_CKPT_DECLINE_COUNT_];
    bool decline_logged[APC_CKPT_DECLINE_COUNT_];
    bool warned_zero, warned_missed;
};

apc_ckpt *apc_ckpt_create(apc *c, const cache_layer *stack, int n_layer, const apc_config *cfg) {
    apc_ckpt *k = calloc(1, sizeof *k);
    if (k == NULL) return NULL;
    k->c = c;
    k->cfg = cfg->ckpt;
    if (k->cfg.records < 2) k->cfg.records = 2;
    if (k->cfg.heavy < 1) k->cfg.heavy = 1;
    k->tier = apc_get_tier(c);
    for (int l = 0; l < n_layer; l++) {
        if (stack[l].kind == CACHE_KIND_ARR || stack[l].kind == CACHE_KIND_LIST) k->has_arr = true;
        if (stack[l].kind == CACHE_KIND_ROT && stack[l].window > k->window) {
            k->window = stack[l].window;
            k->keep = stack[l].keep;
        }
    }
    k->anchors.max_entries = k->cfg.anchor_entries;
    k->anchors.max_bytes = k->cfg.anchor_budget_bytes;
    return k;
}

static void rec_free(ck_rec *r) {
    free(r->tokens);
    free(r->blocks);
    free(r->state);
    free(r);
}

/* Under the lock: unlists r and drops its block references; the memory
 * goes with the last pin. */
static void rec_release(apc_ckpt *k, ck_rec *r) {
    if (r->newer) r->newer->older = r->older;
    else k->newest = r->older;
    if (r->older) r->older->newer = r->newer;
    else k->oldest = r->newer;
    r->newer = r->older = NULL;
    r->listed = false;
    k->count--;
    k->bytes -= r->bytes;
    kv_pool *pool = apc__pool(k->c);
    for (int32_t i = 0; i < r->n_blocks; i++) kv_block_unref(pool, r->blocks[i]);
    r->n_blocks = 0;
    if (r->pins == 0) rec_free(r);
}

static void rec_push_newest(apc_ckpt *k, ck_rec *r) {
    r->older = k->newest;
    r->newer = NULL;
    if (k->newest) k->newest->newer = r;
    else k->oldest = r;
    k->newest = r;
    r->listed = true;
    k->count++;
    k->bytes += r->bytes;
}

static void rec_touch(apc_ckpt *k, ck_rec *r) {
    if (!r->listed || k->newest == r) return;
    if (r->newer) r->newer->older = r->older;
    if (r->older) r->older->newer = r->newer;
    else k->oldest = r->newer;
    r->older = k->newest;
    r->newer = NULL;
    k->newest->newer = r;
    k->newest = r;
}

void apc_ckpt_free(apc_ckpt *k) {
    if (k == NULL) return;
    while (k->newest) rec_release(k, k->newest);
    apc_exact_clear(&k->anchors);
    free(k);
}

void apc_ckpt_reset_locked(apc_ckpt *k) {
    while (k->newest) rec_release(k, k->newest);
    apc_exact_clear(&k->anchors);
    k->stores = k->hits = k->matched = k->missed = k->pool_evictions = k->grid_truncate = 0;
    k->fallback_full = k->fallback_suppressed = k->anchor_stores = k->anchor_hits = k->armed = 0;
    memset(k->declines, 0, sizeof k->declines);
    memset(k->decline_logged, 0, sizeof k->decline_logged);
    k->warned_zero = k->warned_missed = false;
}

/* Under the lock. */
static void ck_decline(apc_ckpt *k, apc_ckpt_decline why, const char *detail) {
    k->declines[why]++;
    if (!k->decline_logged[why]) {
        k->decline_logged[why] = true;
        ember_log(EMBER_LOG_INFO, "APC ckpt store declined (%s): %s (logged once)", apc_ckpt_decline_name(why), detail);
    }
}

static void ck_decline_locked(apc_ckpt *k, apc_ckpt_decline why, const char *detail) {
    apc__lock(k->c);
    ck_decline(k, why, detail);
    apc__unlock(k->c);
}

/* The oldest record other than keep that is not an anchor, else the oldest
 * anchor other than keep. */
static ck_rec *lru_victim(apc_ckpt *k, const ck_rec *keep) {
    for (ck_rec *r = k->oldest; r; r = r->newer)
        if (r != keep && r->kind != APC_CKPT_ANCHOR) return r;
    for (ck_rec *r = k->oldest; r; r = r->newer)
        if (r != keep) return r;
    return NULL;
}

bool apc_ckpt_evict_one_locked(apc_ckpt *k) {
    ck_rec *v = k->oldest; /* plain LRU order: anchors get no protection here (reference §7.1) */
    if (v == NULL) return false;
    rec_release(k, v);
    k->pool_evictions++;
    ember_log(EMBER_LOG_DEBUG, "APC ckpt pool pressure: evicted 1 record for an allocation");
    return true;
}

static bool is_prefix_of(const ck_rec *a, const ck_rec *b) {
    return a->salt == b->salt && a->p < b->p && memcmp(a->tokens, b->tokens, (size_t)a->p * sizeof(int32_t)) == 0;
}

static int cmp_p_desc(const void *x, const void *y) {
    const ck_rec *a = *(ck_rec *const *)x, *b = *(ck_rec *const *)y;
    return a->p < b->p ? 1 : a->p > b->p ? -1 : 0;
}

/* Under the lock: reference §7.4. */
static void rec_insert(apc_ckpt *k, ck_rec *R) {
    /* 1. Same key: replace (an anchor's boundary successor stays an anchor). */
    for (ck_rec *r = k->newest; r; r = r->older) {
        if (r->salt == R->salt && r->p == R->p && memcmp(r->tokens, R->tokens, (size_t)R->p * sizeof(int32_t)) == 0) {
            if (r->kind == APC_CKPT_ANCHOR && R->kind == APC_CKPT_BOUNDARY) R->kind = APC_CKPT_ANCHOR;
            rec_release(k, r);
            break;
        }
    }
    /* 2. The chain: records that are prefixes of R. */
    ck_rec **chain = malloc((size_t)(k->count + 1) * sizeof *chain);
    int nc = 0;
    if (chain)
        for (ck_rec *r = k->newest; r; r = r->older)
            if (is_prefix_of(r, R)) chain[nc++] = r;
    /* 3. One replay and one anchor per chain; the first restorable boundary
     * of a fresh chain becomes its anchor. */
    bool has_plain = false;
    for (int i = 0; i < nc; i++)
        if (chain[i]->kind != APC_CKPT_REPLAY) has_plain = true;
    if (R->kind == APC_CKPT_BOUNDARY && !has_plain) R->kind = APC_CKPT_ANCHOR;
    if (R->kind == APC_CKPT_REPLAY || R->kind == APC_CKPT_ANCHOR) {
        for (int i = 0; i < nc; i++)
            if (chain[i]->kind == R->kind) {
                rec_release(k, chain[i]);
                chain[i] = NULL;
            }
    }
    /* 4. Strip-on-extend: heavy-1 plain records of the chain survive. */
    int np = 0;
    for (int i = 0; i < nc; i++)
        if (chain[i] && chain[i]->kind != APC_CKPT_REPLAY && chain[i]->kind != APC_CKPT_ANCHOR) chain[np++] = chain[i];
    if (np > 0) qsort(chain, (size_t)np, sizeof *chain, cmp_p_desc);
    for (int i = k->cfg.heavy - 1; i < np; i++) rec_release(k, chain[i]);
    free(chain);
    /* 5-6. Insert as newest; the record cap and the byte budget. */
    rec_push_newest(k, R);
    while (k->count > k->cfg.records) rec_release(k, lru_victim(k, R));
    while (k->bytes > k->cfg.budget_bytes && k->count > 1) rec_release(k, lru_victim(k, R));
}

/* Stores a record of tokens[0, p) from seq's blocks and, on arr stacks,
 * the live state (at p) or a snapshot buffer. Returns whether it landed. */
/* Where a record comes from: a store that writes its skeleton to the SSD
 * tier or not, or a skeleton read back from it (not counted as a store). */
typedef enum ck_origin { CK_MEMORY_ONLY = 0, CK_WITH_SKELETON = 1, CK_FROM_DISK = 2 } ck_origin;

static bool ck_store(apc_ckpt *k, apc_ckpt_kind kind, const int32_t *tokens, int64_t p, uint64_t salt,
                     const kv_seq *seq, const model_state *live, const void *snap, bool grid_truncate,
                     ck_origin origin) {
    bool skeleton = origin == CK_WITH_SKELETON;
    apc *c = k->c;
    size_t sb = apc__state_bytes(c);
    if (p < 2) {
        ck_decline_locked(k, APC_CKPT_DECLINE_LAYOUT, "a checkpoint needs at least two tokens");
        return false;
    }
    if (p > seq->n_tokens || (sb && snap == NULL && (live == NULL || apc__state_pos(c, live) != p))) {
        ck_decline_locked(k, APC_CKPT_DECLINE_OFFSET, "the sequence or its state is not at the checkpoint position");
        return false;
    }
    /* Sliding layers below the window keep the block grid (reference §7.1). */
    if (k->window > 0 && p < k->window && p % KV_BLOCK_TOKENS != 0) {
        int64_t b_full = p / KV_BLOCK_TOKENS * KV_BLOCK_TOKENS;
        if (grid_truncate && !k->has_arr && b_full >= 2) {
            p = b_full;
            skeleton = false; /* memory-only (reference §7.1) */
            apc__lock(c);
            k->grid_truncate++;
            apc__unlock(c);
            ember_log(EMBER_LOG_DEBUG, "APC ckpt store: terminal grid store at %lld", (long long)p);
        } else {
            ck_decline_locked(k, APC_CKPT_DECLINE_GRID, "sliding layers below the window, off the block grid");
            return false;
        }
    }
    if (!kv_seq_kvarn_check(apc__pool(c), seq, p)) {
        ck_decline_locked(k, APC_CKPT_DECLINE_OFFSET, "the sequence sealed kvarn groups past the checkpoint position");
        return false;
    }
    ck_rec *r = calloc(1, sizeof *r);
    int32_t nb = (int32_t)((p + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS);
    if (r) {
        r->tokens = malloc((size_t)p * sizeof(int32_t));
        r->blocks = malloc((size_t)nb * sizeof(int32_t));
        if (sb) r->state = malloc(sb);
    }
    if (r == NULL || r->tokens == NULL || r->blocks == NULL || (sb && r->state == NULL)) {
        if (r) rec_free(r);
        ck_decline_locked(k, sb ? APC_CKPT_DECLINE_CLONE : APC_CKPT_DECLINE_EXCEPTION, "out of memory for a record");
        return false;
    }
    memcpy(r->tokens, tokens, (size_t)p * sizeof(int32_t));
    if (sb) {
        if (snap) memcpy(r->state, snap, sb);
        else apc__state_snapshot(c, live, r->state);
    }
    r->p = p;
    r->salt = salt;
    r->kind = kind;
    r->bytes = sb;
    /* The skeleton and its chain, while r is still private to this call. */
    apc_disk *disk = apc__disk(c);
    if (skeleton && disk) apc_disk_store_skeleton(disk, tokens, p, salt, (int)kind, seq, r->state);
    apc_remote *remote = apc__remote(c);
    if (skeleton && remote) apc_remote_store_skeleton(remote, tokens, p, salt, (int)kind, seq, r->state, apc__hash(c));
    apc__lock(c);
    kv_pool *pool = apc__pool(c);
    for (int32_t i = 0; i < nb; i++) {
        r->blocks[i] = seq->blocks[i];
        kv_block_ref(pool, r->blocks[i]);
    }
    r->n_blocks = nb;
    rec_insert(k, r);
    if (origin != CK_FROM_DISK) k->stores++;
    apc__unlock(c);
    ember_log(EMBER_LOG_DEBUG, "APC ckpt store: tokens=%lld kind=%s main=%d states=%d", (long long)p,
              apc_ckpt_kind_name(kind), (int)nb, sb ? 1 : 0);
    return true;
}

/* Tripwire 2 (reference §11.5), under the lock. */
static void missed_adoption(apc_ckpt *k) {
    k->missed++;
    int T = k->cfg.tripwire;
    if (T > 0 && !k->warned_missed && k->missed >= (uint64_t)T && k->hits == 0) {
        k->warned_missed = true;
        ember_log(EMBER_LOG_WARN,
                  "APC ckpt tripwire: %llu lookups found a prefix-matching record and adopted nothing (zero hits) -- "
                  "stores and lookups are not intersecting (EMBER_APC_CKPT_TRIPWIRE=0 silences)",
                  (unsigned long long)k->missed);
    }
}

/* The longest restorable record for tokens[0, n): reference §7.5. */
static apc_hit ck_lookup(apc_ckpt *k, const int32_t *tokens, int64_t n, uint64_t salt, kv_seq *seq,
                         model_state *state) {
    apc_hit hit = {0, APC_SOURCE_NONE};
    apc *c = k->c;
    size_t sb = apc__state_bytes(c);
    if (n < 2 || (sb && state == NULL)) return hit;
    apc__lock(c);
    bool matched = false, gated = false;
    ck_rec *best = NULL;
    for (ck_rec *r = k->newest; r; r = r->older) {
        if (r->salt != salt || r->p > n || r->tokens[r->p - 1] != tokens[r->p - 1]) continue;
        if (memcmp(r->tokens, tokens, (size_t)r->p * sizeof(int32_t)) != 0) continue;
        if (r->p >= n) continue; /* the N-1 rule: never the whole query */
        matched = true;
        if (r->kind == APC_CKPT_REPLAY && k->has_arr && r->p != n - 1) {
            gated = true;
            continue;
        }
        if (best == NULL || r->p > best->p) best = r;
    }
    if (gated) ck_decline(k, APC_CKPT_DECLINE_REPLAY_GATE, "a replay record matched a longer query");
    if (best == NULL) {
        if (matched) missed_adoption(k);
        apc__unlock(c);
        return hit;
    }
    kv_pool *pool = apc__pool(c);
    ember_error err;
    bool ok = true;
    for (int32_t i = 0; i < best->n_blocks && ok; i++)
        if (kv_seq_adopt_block(pool, seq, best->blocks[i], &err) < 0) ok = false;
    if (!ok) {
        kv_seq_release(pool, seq);
        ck_decline(k, APC_CKPT_DECLINE_EXCEPTION, "out of memory growing a block table");
        missed_adoption(k);
        apc__unlock(c);
        return hit;
    }
    if (seq->n_tokens > best->p) kv_seq_truncate(pool, seq, best->p);
    if (!kv_seq_kvarn_check(pool, seq, best->p)) {
        kv_seq_release(pool, seq);
        ck_decline(k, APC_CKPT_DECLINE_OFFSET, "a record's kvarn groups are not those of its position");
        missed_adoption(k);
        apc__unlock(c);
        return hit;
    }
    best->pins++;
    rec_touch(k, best);
    apc__unlock(c);

    bool state_ok = true;
    if (sb) {
        state_ok = apc__state_restore(c, state, best->state, best->p);
    }
    int64_t p = best->p;
    apc__lock(c);
    if (--best->pins == 0 && !best->listed) rec_free(best);
    if (!state_ok) {
        kv_seq_release(pool, seq);
        ck_decline(k, APC_CKPT_DECLINE_CLONE, "a recurrent-state snapshot did not restore");
        missed_adoption(k);
    } else {
        k->hits++;
        k->matched += (uint64_t)p;
        apc__count_hit_locked(c, p);
        hit.n_tokens = p;
        hit.source = APC_SOURCE_CKPT;
    }
    apc__unlock(c);
    if (hit.n_tokens) ember_log(EMBER_LOG_DEBUG, "APC ckpt hit: prefix=%lld (pinned record)", (long long)p);
    return hit;
}

/* ---- Exact-tier anchors (reference §6.4) ---- */

void apc_ckpt_anchor_store(apc_ckpt *k, const int32_t *tokens, int64_t p, uint64_t salt, const kv_seq *seq,
                         const model_state *state) {
    apc *c = k->c;
    const apc_layout *lay = apc__layout(c);
    size_t sb = apc__state_bytes(c);
    if (p > seq->n_tokens || (sb && (state == NULL || apc__state_pos(c, state) != p))) {
        ck_decline_locked(k, APC_CKPT_DECLINE_OFFSET, "the sequence or its state is not at the anchor position");
        return;
    }
    if (!kv_seq_kvarn_check(apc__pool(c), seq, p)) {
        ck_decline_locked(k, APC_CKPT_DECLINE_OFFSET, "the sequence sealed kvarn groups past the anchor position");
        return;
    }
    apc_exact_entry *e = apc_exact_entry_new(lay, tokens, p, salt);
    if (e && sb) {
        e->state = malloc(sb);
        if (e->state == NULL) {
            apc_exact_entry_free(e);
            e = NULL;
        }
    }
    if (e == NULL) {
        ck_decline_locked(k, APC_CKPT_DECLINE_ANCHOR_CLONE, "out of memory for an anchor snapshot");
        return;
    }
    apc_snapshot_copy_out(apc__pool(c), lay, seq, p, e->data);
    if (sb) {
        apc__state_snapshot(c, state, e->state);
        e->state_bytes = sb;
        e->bytes += sb;
    }
    apc__lock(c);
    /* A re-store under the same key holds the same bits: refresh the old one. */
    apc_exact_entry *same = apc_exact_find_same(&k->anchors, tokens, p, salt);
    if (same) {
        apc_exact_touch(&k->anchors, same);
        apc_exact_entry_free(e);
    } else {
        apc_exact_insert(&k->anchors, e);
    }
    k->anchor_stores++;
    apc__unlock(c);
    ember_log(EMBER_LOG_DEBUG, "APC anchor store: tokens=%lld", (long long)p);
}

int64_t apc_ckpt_anchor_lookup(apc_ckpt *k, const int32_t *tokens, int64_t max_len, int64_t min, uint64_t salt,
                               kv_seq *seq, model_state *state) {
    apc *c = k->c;
    size_t sb = apc__state_bytes(c);
    if (sb && state == NULL) return 0;
    apc__lock(c);
    apc_exact_entry *e = apc_exact_find_prefix(&k->anchors, tokens, max_len, salt);
    if (e == NULL || e->n <= min) {
        apc__unlock(c);
        return 0;
    }
    kv_pool *pool = apc__pool(c);
    ember_error err;
    if (kv_seq_prepare_append(pool, seq, e->n, &err) < 0) {
        apc__unlock(c);
        return 0;
    }
    e->pins++;
    apc_exact_touch(&k->anchors, e);
    apc__unlock(c);
    apc_snapshot_copy_in(pool, apc__layout(c), e->data, e->n, seq);
    bool ok = kv_seq_kvarn_check(pool, seq, e->n);
    if (sb && ok) {
        ok = apc__state_restore(c, state, e->state, e->n);
    }
    int64_t got = e->n;
    apc__lock(c);
    apc_exact_unpin(&k->anchors, e);
    if (!ok) {
        kv_seq_release(pool, seq);
        ck_decline(k, APC_CKPT_DECLINE_ANCHOR_CLONE, "an anchor's state did not restore");
        got = 0;
    } else {
        seq->n_tokens = got;
        k->anchor_hits++;
        apc__count_hit_locked(c, got);
    }
    apc__unlock(c);
    if (got) ember_log(EMBER_LOG_DEBUG, "APC anchor hit: prefix=%lld", (long long)got);
    return got;
}

/* ---- Stats ---- */

void apc_ckpt_stats_locked(apc_ckpt *k, apc_stats *s) {
    s->ckpt_stores = k->stores;
    s->ckpt_hits = k->hits;
    s->ckpt_matched_tokens = k->matched;
    s->ckpt_missed_adoptions = k->missed;
    s->ckpt_pool_evictions = k->pool_evictions;
    s->ckpt_grid_truncate = k->grid_truncate;
    s->retire_fallback_full = k->fallback_full;
    s->retire_fallback_suppressed = k->fallback_suppressed;
    s->anchor_stores = k->anchor_stores;
    s->anchor_hits = k->anchor_hits;
    s->ckpt_armed = k->armed;
    for (int i = 0; i < APC_CKPT_DECLINE_COUNT_; i++) s->ckpt_declines[i] = k->declines[i];
    s->ckpt_records = k->count;
    s->ckpt_bytes = k->bytes;
    s->anchor_entries = k->anchors.count;
}

int64_t apc_ckpt_anchor_best_locked(apc_ckpt *k, const int32_t *tokens, int64_t max_len, uint64_t salt) {
    apc_exact_entry *a = apc_exact_find_prefix(&k->anchors, tokens, max_len, salt);
    return a ? a->n : 0;
}

/* ---- The exact tier's operations (apc_req.h) ----
 * Stock snapshots at N-1 and at retirement, plus the system-prompt anchor
 * (reference §6.4), which wins a lookup only when strictly longer. */

static apc_hit exact_lookup(apc_req *r, kv_seq *seq, model_state *state) {
    apc_hit hit = {0, APC_SOURCE_NONE};
    apc_ckpt *k = apc__ckpt(r->c);
    apc__lock(r->c);
    int64_t best = apc__exact_best_locked(r->c, r->prompt, r->N - 1, r->salt);
    int64_t anchor = apc_ckpt_anchor_best_locked(k, r->prompt, r->N - 1, r->salt);
    apc__unlock(r->c);
    if (anchor > best) {
        int64_t got = apc_ckpt_anchor_lookup(k, r->prompt, r->N - 1, best, r->salt, seq, state);
        if (got > 0) {
            hit.n_tokens = got;
            hit.source = APC_SOURCE_ANCHOR;
            return hit;
        }
    }
    return apc__lookup_exact(r->c, r->prompt, r->N, r->salt, seq, state);
}

/* The system-prompt anchor, on the grid for recurrent stacks (design.md §1). */
static void exact_plan(apc_req *r) {
    apc_ckpt *k = apc__ckpt(r->c);
    const apc_ckpt_config *cfg = &k->cfg;
    if (!cfg->sys || r->hints.anchor_pos <= 0) return;
    int64_t pos = r->hints.anchor_pos < r->N - 1 ? r->hints.anchor_pos : r->N - 1;
    if (k->has_arr && pos != r->N - 1) pos = floor_to(pos, r->unit);
    int64_t fl = cfg->sys_min > 2 ? cfg->sys_min : 2;
    if (pos >= fl && pos > r->restored) {
        r->anchor_at = pos;
        ember_log(EMBER_LOG_DEBUG, "APC anchor armed: pos=%lld guard=%lld", (long long)pos, (long long)(r->N - 1));
    }
}

static int64_t exact_next_stop(const apc_req *r, int64_t p) { return r->anchor_at > p ? r->anchor_at : INT64_MAX; }

static void exact_at(apc_req *r, const kv_seq *seq, const model_state *state) {
    int64_t p = seq->n_tokens;
    if (r->anchor_at > 0 && p == r->anchor_at) apc_ckpt_anchor_store(apc__ckpt(r->c), r->prompt, p, r->salt, seq, state);
    if (p == r->N - 1 && p > r->restored) apc__store_exact(r->c, APC_STORE_PAUSE, r->prompt, p, r->salt, seq, state);
}

static bool exact_wants_last(const apc_req *r, int64_t n_kv) {
    (void)r, (void)n_kv;
    return true; /* a snapshot of the whole reply serves the next turn */
}

static void exact_retire(apc_req *r, const int32_t *all, int64_t n, int64_t common, const kv_seq *seq,
                         const model_state *state) {
    (void)common;
    apc__store_exact(r->c, APC_STORE_RETIRE, all, n, r->salt, seq, state);
}

static int64_t exact_peek(apc *c, const int32_t *tokens, int64_t n, uint64_t salt) {
    int64_t best = apc__peek_exact(c, tokens, n, salt);
    apc__lock(c);
    int64_t anchor = apc_ckpt_anchor_best_locked(apc__ckpt(c), tokens, n - 1, salt);
    apc__unlock(c);
    return anchor > best ? anchor : best;
}

const apc_tier_ops apc_exact_ops = {
    .lookup = exact_lookup,
    .plan = exact_plan,
    .next_stop = exact_next_stop,
    .at = exact_at,
    .prefilled = apc__no_at,
    .decode = apc__no_decode,
    .predicted = apc__no_predicted,
    .retire_wants_last_token = exact_wants_last,
    .retire_wants_prediction = apc__no_prediction,
    .retire = exact_retire,
    .peek = exact_peek,
    .prefetch = apc__prefetch_exact,
    .serial = false,
};

/* ---- The checkpoint tier's operations (apc_req.h) ---- */

static apc_hit ckpt_lookup(apc_req *r, kv_seq *seq, model_state *state) {
    return ck_lookup(apc__ckpt(r->c), r->prompt, r->N, r->salt, seq, state);
}

/* The prefill schedule (reference §7.2) and the decode ring (§7.6). */
static void ckpt_plan(apc_req *r) {
    apc_ckpt *k = apc__ckpt(r->c);
    const apc_ckpt_config *cfg = &k->cfg;
    r->armed = true;
    apc_ckpt_sched_in in;
    memset(&in, 0, sizeof in);
    in.n = r->N;
    in.guard = r->N - 1;
    in.restored = r->restored;
    in.unit = r->unit;
    in.has_arr = k->has_arr;
    in.window = k->window;
    in.p_stable = r->hints.turn_pos;
    in.sys_lcp = r->hints.anchor_pos;
    in.cfg = *cfg;
    int64_t iv = cfg->interval > 0 ? floor_to(cfg->interval, r->unit) : 0;
    if (cfg->interval > 0 && iv < r->unit) iv = r->unit;
    int cap = (int)(iv > 0 ? r->N / iv : 0) + 6;
    r->sched = malloc((size_t)cap * sizeof *r->sched);
    if (r->sched) r->n_sched = apc_ckpt_schedule(&in, r->sched, cap, r->bounds, &r->n_bounds);
    /* decode-time snapshots need a render prediction */
    if (cfg->decode_interval > 0 && r->hints.predicts) {
        int64_t grid = r->unit;
        if (grid > cfg->decode_interval) grid = KV_BLOCK_TOKENS;
        r->ring_grid = (int)grid;
        r->ring_on = true;
        int64_t eff = cfg->decode_interval;
        if (r->N / 64 > eff) eff = r->N / 64;
        r->ring_next = (r->N + eff + grid - 1) / grid * grid;
    }
    apc__lock(r->c);
    k->armed++;
    int T = cfg->tripwire;
    if (T > 0 && !k->warned_zero && k->armed > (uint64_t)T && k->stores == 0) {
        k->warned_zero = true;
        ember_log(EMBER_LOG_WARN,
                  "APC ckpt tripwire: %llu requests armed with zero checkpoint stores -- the tier is not working for "
                  "this model/config and every request prefills cold (EMBER_APC_CKPT_TRIPWIRE=0 silences)",
                  (unsigned long long)k->armed);
    }
    apc__unlock(r->c);
}

static int64_t ckpt_next_stop(const apc_req *r, int64_t p) {
    for (int i = r->head; i < r->n_sched; i++)
        if (r->sched[i].pos > p) return r->sched[i].pos;
    return INT64_MAX;
}

static void ckpt_at(apc_req *r, const kv_seq *seq, const model_state *state) {
    int64_t p = seq->n_tokens;
    apc_ckpt *k = apc__ckpt(r->c);
    while (r->head < r->n_sched && r->sched[r->head].pos < p) r->head++; /* passed without a stop */
    if (r->head < r->n_sched && r->sched[r->head].pos == p) {
        apc_ckpt_point pt = r->sched[r->head++];
        bool skel = !k->has_arr || pt.kind == APC_CKPT_REPLAY || pt.kind == APC_CKPT_ANCHOR ||
                    p >= floor_to(r->N - 1, r->unit);
        if (ck_store(k, pt.kind, r->prompt, p, r->salt, seq, state, NULL, false, skel ? CK_WITH_SKELETON : CK_MEMORY_ONLY))
            for (int i = 0; i < r->n_bounds; i++)
                if (r->bounds[i] == p) r->bound_landed = true;
    }
}

static void ckpt_prefilled(apc_req *r, const kv_seq *seq, const model_state *state) {
    if (!r->armed) return;
    if (r->bound_landed) {
        ember_log(EMBER_LOG_DEBUG, "APC ckpt post-prefill store skipped: render-stable boundary landed");
        return;
    }
    if (r->N > r->restored)
        ck_store(apc__ckpt(r->c), APC_CKPT_BOUNDARY, r->prompt, r->N, r->salt, seq, state, NULL, false,
                 CK_WITH_SKELETON);
}

static void ring_drop(apc_req *r, int i) {
    free(r->snaps[i].state);
    memmove(&r->snaps[i], &r->snaps[i + 1], (size_t)(r->n_snaps - i - 1) * sizeof r->snaps[0]);
    r->n_snaps--;
}

/* Decode-time snapshots (reference §7.6). The snapshot is taken at the ring
 * point (the state is there only now) and kept unconfirmed until the
 * driver's render prediction for that point arrives (ckpt_predicted). */
static int64_t ckpt_decode(apc_req *r, const int32_t *all, const kv_seq *seq, const model_state *state) {
    (void)all;
    if (!r->ring_on || r->ring_frozen) return 0;
    int64_t p = seq->n_tokens;
    if (p < r->ring_next) return 0;
    apc_ckpt *k = apc__ckpt(r->c);
    if (k->window > 0 && p < k->window && p % KV_BLOCK_TOKENS != 0) return 0;
    int64_t eff = k->cfg.decode_interval;
    if (p / 64 > eff) eff = p / 64;
    int64_t g = r->ring_grid;
    r->ring_next = (p + eff + g - 1) / g * g;
    size_t sb = apc__state_bytes(r->c);
    void *buf = NULL;
    if (sb) {
        if (state == NULL || apc__state_pos(r->c, state) != p || (buf = malloc(sb)) == NULL) {
            r->ring_on = false; /* first strike disables the ring */
            return 0;
        }
        apc__state_snapshot(r->c, state, buf);
    }
    if (r->n_snaps == APC_RING_MAX) ring_drop(r, 0);
    r->snaps[r->n_snaps].p = p;
    r->snaps[r->n_snaps].state = buf;
    r->snaps[r->n_snaps].confirmed = false;
    r->n_snaps++;
    return p;
}

/* The prediction for the ring point p: confirm its snapshot, or, when the
 * next turn's render diverges before p, keep only the snapshots below the
 * divergence and stop the ring (later ones cannot serve the next turn). */
static void ckpt_predicted(apc_req *r, int64_t p, int64_t common) {
    int at = -1;
    for (int i = 0; i < r->n_snaps; i++)
        if (r->snaps[i].p == p) at = i;
    if (at < 0) return; /* dropped by an earlier freeze */
    if (common < 0) {
        ring_drop(r, at);
        return;
    }
    if (common + 64 < p) {
        for (int i = r->n_snaps - 1; i >= 0; i--)
            if (r->snaps[i].p > common) ring_drop(r, i);
        r->ring_frozen = true;
        ember_log(EMBER_LOG_DEBUG, "APC decode ckpt frozen: render diverges at %lld (live %lld)", (long long)common,
                  (long long)p);
        return;
    }
    r->snaps[at].confirmed = true;
    int confirmed = 0;
    for (int i = 0; i < r->n_snaps; i++) confirmed += r->snaps[i].confirmed;
    for (int i = 0; i < r->n_snaps && confirmed > 2; i++)
        if (r->snaps[i].confirmed) {
            ring_drop(r, i--);
            confirmed--;
        }
    ember_log(EMBER_LOG_DEBUG, "APC decode ckpt snapshot: p=%lld pred=%lld", (long long)p, (long long)common);
}

static bool ckpt_wants_last(const apc_req *r, int64_t n_kv) {
    (void)r, (void)n_kv;
    return false; /* the reference's offset rule stores len-1 */
}

static bool ckpt_wants_prediction(const apc_req *r) {
    (void)r;
    return true;
}

/* Retirement (reference §7.7), keyed where the next turn diverges. */
static void ckpt_retire(apc_req *r, const int32_t *all, int64_t n, int64_t common, const kv_seq *seq,
                        const model_state *state) {
    apc_ckpt *k = apc__ckpt(r->c);
    int64_t cap = common >= 0 && common < n ? common : n;
    /* 1. The whole sequence when the next turn replays it verbatim. */
    if (cap == n) {
        if (ck_store(k, APC_CKPT_RETIRE, all, n, r->salt, seq, state, NULL, true, CK_WITH_SKELETON)) return;
    }
    /* 2. The newest confirmed decode snapshot at or below the cap. */
    for (int i = r->n_snaps - 1; i >= 0; i--) {
        int64_t p = r->snaps[i].p;
        if (!r->snaps[i].confirmed || p < 2 || p > cap) continue;
        if (ck_store(k, APC_CKPT_RETIRE, all, p, r->salt, seq, NULL, r->snaps[i].state, false, CK_WITH_SKELETON)) {
            ember_log(EMBER_LOG_DEBUG, "APC retirement: decode ckpt stored at %lld", (long long)p);
            return;
        }
        break;
    }
    if (cap < n) {
        apc__lock(r->c);
        bool suppress = r->bound_landed;
        if (suppress) k->fallback_suppressed++;
        apc__unlock(r->c);
        if (suppress) return;
        /* 3. The full sequence under its verbatim key. */
        if (ck_store(k, APC_CKPT_RETIRE, all, n, r->salt, seq, state, NULL, true, CK_WITH_SKELETON)) {
            apc__lock(r->c);
            k->fallback_full++;
            apc__unlock(r->c);
            ember_log(EMBER_LOG_DEBUG, "APC retirement: full-sequence fallback stored at %lld", (long long)n);
        }
    }
}

/* Memory records only, no side effects (the admission gate). */
static int64_t ckpt_peek(apc *c, const int32_t *tokens, int64_t n, uint64_t salt) {
    apc_ckpt *k = apc__ckpt(c);
    int64_t best = 0;
    apc__lock(c);
    for (ck_rec *r = k->newest; r; r = r->older) {
        if (r->salt != salt || r->p >= n || r->p <= best) continue;
        if (r->kind == APC_CKPT_REPLAY && k->has_arr && r->p != n - 1) continue;
        if (memcmp(r->tokens, tokens, (size_t)r->p * sizeof(int32_t)) == 0) best = r->p;
    }
    apc__unlock(c);
    return best;
}

/* Restart repair (reference §10.5), off the engine thread: a skeleton on
 * disk deeper than memory's best record is restored into a private
 * sequence and a scratch state (which checks that its state restores at its
 * length) and becomes a record, which the lookup then adopts. */
static int64_t ckpt_prefetch(apc *c, const int32_t *tokens, int64_t n, uint64_t salt) {
    apc_ckpt *k = apc__ckpt(c);
    apc_disk *disk = apc__disk(c);
    int64_t mem = ckpt_peek(c, tokens, n, salt);
    size_t sb = apc__state_bytes(c);
    model_state *scratch = NULL;
    if (disk == NULL || n < 3 || (sb && (scratch = apc__state_scratch(c)) == NULL)) return mem;
    kv_seq seq;
    kv_seq_init(&seq);
    int kind = APC_CKPT_BOUNDARY;
    int64_t p = apc_disk_restore_skeleton(c, disk, tokens, n, salt, mem, k->has_arr, &seq, scratch, &kind);
    if (p > 0 && ck_store(k, (apc_ckpt_kind)kind, tokens, p, salt, &seq, scratch, NULL, false, CK_FROM_DISK)) {
        ember_log(EMBER_LOG_DEBUG, "APC ckpt disk skeleton restored: prefix=%lld", (long long)p);
        mem = p;
    }
    apc_seq_release(c, &seq);
    apc__state_drop(c, scratch);
    return mem;
}

bool apc__ckpt_load_chain(apc *c, const int32_t *tokens, int64_t p, uint64_t salt, kv_seq *seq, apc_chain_loader load,
                          void *ctx, bool *blocks_short) {
    const uint64_t csalt = salt ^ APC_DISK_CKPT_SALT;
    int64_t nf = p / KV_BLOCK_TOKENS;
    int tail = (int)(p % KV_BLOCK_TOKENS);
    int64_t total = nf + (tail ? 1 : 0);
    *blocks_short = false;
    apc_key *keys = malloc((size_t)total * sizeof *keys);
    apc_disk_want *want = malloc((size_t)total * sizeof *want);
    if (keys == NULL || want == NULL) {
        free(keys);
        free(want);
        return false;
    }
    static const apc_key zero;
    apc_hash_kind hash = apc__hash(c);
    apc_chain_keys(hash, tokens, nf, csalt, keys);
    if (tail) keys[nf] = apc_partial_key(hash, nf > 0 ? &keys[nf - 1] : &zero, csalt, tokens + nf * KV_BLOCK_TOKENS, tail);
    kv_pool *pool = apc__pool(c);
    int64_t got = 0;
    apc__lock(c);
    for (; got < total; got++) {
        int32_t b = kv_block_alloc(pool);
        if (b < 0) break;
        want[got].key = keys[got];
        want[got].tokens = tokens + got * KV_BLOCK_TOKENS;
        want[got].rows = got < nf ? KV_BLOCK_TOKENS : tail;
        want[got].dst = b;
    }
    apc__unlock(c);
    *blocks_short = got < total;
    int64_t loaded = got == total ? load(ctx, &zero, csalt, want, total) : 0;
    bool ok = loaded == total;
    apc__lock(c);
    for (int64_t i = 0; i < got; i++) {
        if (ok && kv_seq_adopt_block(pool, seq, want[i].dst, NULL) < 0) ok = false;
        kv_block_unref(pool, want[i].dst);
    }
    if (ok) {
        if (seq->n_tokens > p) kv_seq_truncate(pool, seq, p);
        ok = seq->n_tokens == p && kv_seq_kvarn_check(pool, seq, p);
    }
    if (!ok && seq->n_blocks > 0) kv_seq_release(pool, seq);
    apc__unlock(c);
    free(keys);
    free(want);
    return ok;
}

typedef struct remote_chain_ctx {
    apc_remote *remote;
    double deadline;
} remote_chain_ctx;

static int64_t remote_chain_load(void *ctx, const apc_key *parent, uint64_t salt, const apc_disk_want *want,
                                 int64_t n) {
    const remote_chain_ctx *r = ctx;
    return apc_remote_load_blocks(r->remote, parent, salt, want, n, r->deadline);
}

/* The same repair from Redis, after the disk's: the deepest skeleton there
 * beyond memory's best record whose state restores and whose chain is
 * whole becomes a record (a short chain, evicted or bad, tries the next
 * shorter skeleton), all under one deadline. */
int64_t apc__ckpt_prefetch_remote(apc *c, const int32_t *tokens, int64_t n, uint64_t salt) {
    apc_ckpt *k = apc__ckpt(c);
    apc_remote *remote = apc__remote(c);
    int64_t mem = ckpt_peek(c, tokens, n, salt);
    size_t sb = apc__state_bytes(c);
    if (remote == NULL || n < 3 || mem >= n - 1 || !apc_remote_up(remote)) return mem;
    model_state *scratch = NULL;
    void *buf = NULL;
    if (sb && ((scratch = apc__state_scratch(c)) == NULL || (buf = malloc(sb)) == NULL)) {
        apc__state_drop(c, scratch);
        return mem;
    }
    double deadline = apc__remote_deadline(c, n - mem);
    remote_chain_ctx rctx = {remote, deadline};
    bool short_of_blocks;
    for (int64_t max_p = n - 1; max_p > mem;) {
        int kind = APC_CKPT_BOUNDARY;
        int64_t p = apc_remote_find_skeleton(remote, tokens, max_p, mem, k->has_arr ? n - 1 : -1, salt, buf, &kind,
                                             deadline);
        if (p <= 0) break;
        max_p = p - 1;
        if (sb && !apc__state_restore(c, scratch, buf, p)) continue;
        kv_seq seq;
        kv_seq_init(&seq);
        bool stored = apc__ckpt_load_chain(c, tokens, p, salt, &seq, remote_chain_load, &rctx, &short_of_blocks) &&
                      ck_store(k, (apc_ckpt_kind)kind, tokens, p, salt, &seq, scratch, NULL, false, CK_FROM_DISK);
        apc_seq_release(c, &seq);
        if (stored) {
            ember_log(EMBER_LOG_DEBUG, "APC ckpt remote skeleton restored: prefix=%lld", (long long)p);
            mem = p;
            break;
        }
        if (sb) apc__state_reset(c, scratch);
    }
    free(buf);
    apc__state_drop(c, scratch);
    return mem;
}

const apc_tier_ops apc_ckpt_ops = {
    .lookup = ckpt_lookup,
    .plan = ckpt_plan,
    .next_stop = ckpt_next_stop,
    .at = ckpt_at,
    .prefilled = ckpt_prefilled,
    .decode = ckpt_decode,
    .predicted = ckpt_predicted,
    .retire_wants_last_token = ckpt_wants_last,
    .retire_wants_prediction = ckpt_wants_prediction,
    .retire = ckpt_retire,
    .peek = ckpt_peek,
    .prefetch = ckpt_prefetch,
    .serial = true,
};
