/* apc.c - the prompt cache of one model: lookup, stores, counters, reset.
 *
 * The cache sits beside a kv_pool and owns its structural operations: it
 * installs the pool's evict hook (an indexed block being handed out again is
 * unindexed and counted) and wraps the sequence calls that allocate or free
 * blocks, all under one mutex. Everything that costs time proportional to a
 * prompt runs outside that mutex:
 *   - keys are hashed before the lock is taken;
 *   - a snapshot is copied out of blocks the storing sequence holds;
 *   - a restore pins its entry, allocates fresh blocks under the lock, copies
 *     without it, and on relocking checks the generation: if apc_reset ran in
 *     between, the restore is discarded (counted) and the request runs cold.
 * Block adoption is only refcounting, so it happens under the lock in one go.
 *
 * Failures never propagate: each becomes a counted decline, logged once per
 * reason at warning, and the request proceeds as if nothing were cached.
 *
 * The SSD tier (apc_disk.c), when configured, sits behind both tiers:
 *   - block lookup: the memory walk first; the chain continues on disk from
 *     where memory stopped; fresh blocks are allocated under the lock, filled
 *     from the files without it (they are private until indexed), then
 *     indexed and adopted; a partial tail block comes from memory or disk,
 *     whichever is longer;
 *   - block store: after indexing, the blocks the disk lacks are copied out
 *     of the storing sequence (which holds them) into a write job;
 *   - exact lookup: a snapshot on disk longer than the best one in memory is
 *     read into a new entry and joins the LRU, then restores as usual;
 *   - exact store: the new entry is pinned for the writer and unpinned by
 *     the writer's release callback.
 *
 * Recurrent stacks (apc_state_ops given to apc_create): an exact entry also
 * carries the state snapshot at its length, and lookups/stores without a
 * state refuse. The disk stores and restores that state with the entry; its
 * namespace includes the state size and the cache stack.
 * Checkpoint records (ckpt tier) go to disk as skeletons plus ckpt-salted
 * shards (apc_ckpt.c stores them, apc_disk_ckpt.c restores them).
 * The checkpoint tier and the exact-tier anchors live in apc_ckpt.c; this
 * file hands them the lock, the pool and the counters (apc_internal.h).
 *
 * The contract, tier by tier (apc.h is the index of the API):
 *
 *  - Routing. apc_route_stack() reads a model's cache-stack descriptor and
 *    picks the tier that can serve it (design.md §4): every layer `kv` ->
 *    block; `kv`/`rot`/`arr` mixes with something chain-backed and at least
 *    one `rot` or `arr` -> ckpt (rot layers must share one window geometry on
 *    the 16-token grid, else exact); any `list`, or only `arr` -> exact;
 *    an `other` layer or an empty stack -> none. apc_create logs the choice
 *    once: "APC tier: block (layers: 28 kv / 0 rot / 0 arr)" at info, or
 *    "APC OFF for this model: <reason>" at warning. cfg.force_tier
 *    (exact|block|off; EMBER_APC_FORCE_TIER in the settings table) overrides it for A/B tests;
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
 *    listed at apc_stats (serve renders them as GET /v1/cache/stats);
 *    apc_reset clears the memory tiers and the counters.
 *  - SSD tier (cfg.disk.path set; apc_disk.h has the format): block and
 *    exact stores are also written, asynchronously, under a namespace of the
 *    model fingerprint and the cache format; the lookup consults the disk
 *    after memory and the longest match wins; blocks read from disk are
 *    loaded into fresh pool blocks and indexed (the next hit is from
 *    memory), a snapshot read from disk joins the exact LRU. apc_reset
 *    leaves the disk alone; apc_free lets queued writes land first.
 *  - Remote tier (cfg.remote.url set; apc_remote.h has the format): block
 *    chains, exact snapshots and checkpoint skeletons (apc_ckpt.c). Stores also go to Redis, asynchronously;
 *    apc_prefetch, after the disk, continues the chain from Redis into
 *    fresh pool blocks (or reads a longer snapshot into the exact LRU)
 *    under a deadline of a share of what a cold prefill of the missing
 *    tokens costs (apc_note_prefill measures it), and indexes what
 *    verified, so the request's lookup finds it in memory.
 *
 * Store points. The tiers store at three points of a request: PAUSE
 * (prefill stopped at N-1; the exact tier snapshots there), PREFILL (the
 * prompt is in; the block tier indexes its blocks) and RETIRE (prompt +
 * reply at finish). apc_req.c says which tier uses which. */
#include "apc/apc.h"

#include <pthread.h>
#include <xxhash.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "apc/apc_ckpt.h"
#include "apc/apc_disk.h"
#include "apc/apc_internal.h"
#include "apc/apc_remote.h"
#include "core/clock.h"
#include "core/log.h"

struct apc {
    pthread_mutex_t lock;
    kv_pool *pool;
    apc_config cfg;
    apc_route route;
    apc_layout layout;
    apc_index index;
    apc_exact exact;
    apc_disk *disk;         /* NULL: no SSD tier */
    apc_remote *remote;     /* NULL: no remote tier */
    double prefill_spt;     /* measured cold prefill seconds per token (EWMA); 0: none yet */
    const apc_tier_ops *ops; /* the routed tier's (apc_req.c, apc_ckpt.c) */
    uint64_t generation;
    /* counters (reference §11.1 + ours); zeroed by reset */
    uint64_t lookups_hit, lookups_miss, matched_tokens, served_tokens;
    uint64_t evictions, stores, exact_hits, exact_stores, exact_evictions, retire_stores;
    uint64_t declines[APC_DECLINE_COUNT_];
    bool decline_logged[APC_DECLINE_COUNT_];
    /* checkpoint tier, exact anchors, recurrent state */
    apc_ckpt *ckpt;
    apc_state_ops state;   /* state.bytes == 0: no recurrent layers */
    size_t state_bytes;
    apc_snaps snaps;       /* block tier over recurrent layers (route.snapshots) */
};

void apc__lock(apc *c) { pthread_mutex_lock(&c->lock); }
void apc__unlock(apc *c) { pthread_mutex_unlock(&c->lock); }
kv_pool *apc__pool(apc *c) { return c->pool; }
const apc_layout *apc__layout(apc *c) { return &c->layout; }
apc_ckpt *apc__ckpt(apc *c) { return c->ckpt; }
apc_index *apc__index(apc *c) { return &c->index; }
apc_snaps *apc__snaps(apc *c) { return &c->snaps; }
void apc__count_miss_locked(apc *c) { c->lookups_miss++; }
size_t apc__state_bytes(apc *c) { return c->state_bytes; }
const apc_tier_ops *apc__tier_ops(apc *c) { return c->ops; }
int64_t apc__state_pos(apc *c, const model_state *s) { return c->state.pos(s); }
void apc__state_snapshot(apc *c, const model_state *s, void *out) { c->state.snapshot(s, out); }
void apc__state_reset(apc *c, model_state *s) { c->state.reset(s); }
model_state *apc__state_scratch(apc *c) {
    ember_error err;
    return c->state.create ? c->state.create(c->state.owner, &err) : NULL;
}
void apc__state_drop(apc *c, model_state *s) {
    if (s) c->state.destroy(s);
}
bool apc__state_restore(apc *c, model_state *s, const void *buf, int64_t pos) {
    ember_error err;
    if (c->state.restore(s, buf, c->state_bytes, &err) == 0 && c->state.pos(s) == pos) return true;
    c->state.reset(s);
    return false;
}
struct apc_disk *apc__disk(apc *c) { return c->disk; }
struct apc_remote *apc__remote(apc *c) { return c->remote; }
apc_hash_kind apc__hash(apc *c) { return c->cfg.hash; }
void apc__count_hit_locked(apc *c, int64_t n) {
    c->lookups_hit++;
    c->matched_tokens += (uint64_t)n;
}

static int open_disk(apc *c, const apc_disk_config *dc, ember_error *err);
static void open_remote(apc *c, const apc_config *cfg);

static const char *decline_names[APC_DECLINE_COUNT_] = {
    "pool_exhausted", "alloc", "collision", "exact_bytes", "raced_reset", "seq_short", "kvarn_seals",
};

const char *apc_decline_name(apc_decline d) {
    return (unsigned)d < APC_DECLINE_COUNT_ ? decline_names[d] : "?";
}

/* Under the lock. */
static void decline(apc *c, apc_decline why, const char *detail) {
    c->declines[why]++;
    if (!c->decline_logged[why]) {
        c->decline_logged[why] = true;
        ember_log(EMBER_LOG_WARN, "APC %s: %s; the request continues without it (logged once)",
                  apc_decline_name(why), detail);
    }
}

static void decline_locked(apc *c, apc_decline why, const char *detail) {
    pthread_mutex_lock(&c->lock);
    decline(c, why, detail);
    pthread_mutex_unlock(&c->lock);
}

/* The pool is reusing an indexed block: forget it. Called from
 * kv_block_alloc, which only ever runs under our lock. */
static void on_evict(void *owner, int32_t block) {
    apc *c = owner;
    apc_index_remove(&c->index, block);
    apc_snaps_evict(&c->snaps, block);
    c->evictions++;
}

apc_config apc_default_config(void) {
    apc_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.enabled = true;
    cfg.hash = APC_HASH_SHA256;
    cfg.exact_entries = 0; /* no count cap: exact_max_bytes sizes the tier */
    cfg.exact_max_bytes = (size_t)4 << 30;
    cfg.force_tier = APC_FORCE_NONE;
    cfg.ckpt_enabled = true;
    cfg.swa_block = true;
    cfg.disk.workers = 1;
    cfg.disk.read_mode = APC_DISK_READ_DIRECT;
    cfg.disk.queue_jobs = 64;
    cfg.disk.queue_bytes = (size_t)1 << 30;
    cfg.disk.backoff_ms = 30000;
    cfg.remote.ttl_s = 86400;
    cfg.remote.queue_bytes = (size_t)1 << 30;
    cfg.remote.deadline_fraction = 0.5;
    cfg.remote.min_wait_ms = 20;
    cfg.remote.max_wait_ms = 5000;
    cfg.remote.prefill_tps = 500;
    cfg.remote.timeout_ms = 1000;
    cfg.remote.breaker_failures = 3;
    cfg.remote.probe_ms = 1000;
    cfg.ckpt = apc_ckpt_default_config();
    return cfg;
}

static void log_route(const apc *c, const char *note) {
    const apc_route *r = &c->route;
    const char *sep = note && note[0] ? "; " : "";
    if (note == NULL) note = "";
    if (r->tier == APC_TIER_NONE) {
        ember_log(EMBER_LOG_WARN, "APC OFF for this model: %s%s%s", r->reason, sep, note);
        return;
    }
    if (r->reason[0]) ember_log(EMBER_LOG_INFO, "%s", r->reason);
    if (r->records)
        ember_log(EMBER_LOG_INFO, "APC tier: %s (layers: %d kv / %d rot / %d arr; kv_format=%s records)%s%s",
                  apc_tier_name(r->tier), r->n_kv, r->n_rot, r->n_arr, kv_format_name(kv_pool_format(c->pool)), sep,
                  note);
    else
        ember_log(EMBER_LOG_INFO, "APC tier: %s (layers: %d kv / %d rot / %d arr)%s%s", apc_tier_name(r->tier), r->n_kv,
                  r->n_rot, r->n_arr, sep, note);
    if (r->forced) ember_log(EMBER_LOG_INFO, "APC tier forced by cache.force_tier (EMBER_APC_FORCE_TIER, --force-tier)");
    if (r->snapshots)
        ember_log(EMBER_LOG_INFO,
                  "APC recurrent-state snapshots on the block chain every %d tokens (%zu bytes each, budget %.0f MiB)",
                  c->cfg.ckpt.snapshot_interval, c->state_bytes,
                  (double)c->cfg.ckpt.snapshot_budget_bytes / (1024.0 * 1024.0));
    else if (r->tier == APC_TIER_BLOCK && r->n_rot > 0)
        ember_log(EMBER_LOG_INFO, "APC sliding-window layers served by the block tier: the pool keeps every row "
                                  "(cache.swa_block: false goes back to checkpoints)");
    size_t bb = kv_pool_block_bytes(c->pool);
    int32_t nb = kv_pool_n_blocks(c->pool);
    ember_log(EMBER_LOG_INFO,
              "APC enabled (block_size=%d, num_blocks=%d: %lld tokens, %.1f MiB; hash=%s; exact budget %.0f MiB%s)",
              KV_BLOCK_TOKENS, nb, (long long)kv_pool_capacity_tokens(c->pool, nb), (double)nb * (double)bb / (1024.0 * 1024.0),
              c->cfg.hash == APC_HASH_XXH3 ? "xxh3" : "sha256", (double)c->cfg.exact_max_bytes / (1024.0 * 1024.0),
              c->cfg.exact_entries > 0 ? ", capped by count" : "");
}

apc *apc_create(kv_pool *pool, const kv_pool_config *layout, const cache_layer *stack, const apc_state_ops *state,
                const apc_config *cfg_in, ember_error *err) {
    apc_config cfg = cfg_in ? *cfg_in : apc_default_config();
    if (cfg.exact_entries < 0) cfg.exact_entries = 0;
    apc *c = calloc(1, sizeof *c);
    if (c == NULL) {
        ember_fail(err, "prompt cache: out of memory");
        return NULL;
    }
    pthread_mutex_init(&c->lock, NULL);
    c->pool = pool;
    c->cfg = cfg;
    c->layout.n_layer = layout->n_layer;
    c->layout.k_width = malloc((size_t)layout->n_layer * sizeof(int));
    c->layout.v_width = malloc((size_t)layout->n_layer * sizeof(int));
    c->layout.k_values = malloc((size_t)layout->n_layer * sizeof(int));
    c->layout.v_values = malloc((size_t)layout->n_layer * sizeof(int));
    if (c->layout.k_width == NULL || c->layout.v_width == NULL || c->layout.k_values == NULL ||
        c->layout.v_values == NULL ||
        apc_index_init(&c->index, kv_pool_n_blocks(pool)) < 0) {
        apc_free(c);
        ember_fail(err, "prompt cache: out of memory for an index of %d blocks", kv_pool_n_blocks(pool));
        return NULL;
    }
    /* Rows are copied as the pool stores them: 32-bit words of its format. */
    for (int l = 0; l < layout->n_layer; l++) {
        c->layout.k_width[l] = (int)(kv_pool_row_bytes(pool, l, 0) / 4);
        c->layout.v_width[l] = (int)(kv_pool_row_bytes(pool, l, 1) / 4);
        c->layout.row_floats += (size_t)c->layout.k_width[l] + (size_t)c->layout.v_width[l];
        c->layout.k_values[l] = layout->k_width[l];
        c->layout.v_values[l] = layout->v_width[l];
    }
    c->layout.kv_format_id = kv_format_id(kv_pool_format(pool));
    c->layout.attention = (int)kv_pool_attention(pool);
    c->exact.max_entries = cfg.exact_entries;
    c->exact.max_bytes = cfg.exact_max_bytes;
    if (state && state->bytes > 0) {
        c->state = *state;
        c->state_bytes = state->bytes;
        c->layout.state_bytes = state->bytes;
    }

    c->route = apc_route_stack(stack, layout->n_layer, cfg.ckpt_enabled);
    bool records = kv_format_is_kvarn(kv_pool_format(pool));
    if (!records)
        apc_route_pool_rows(&c->route, cfg.swa_block, cfg.ckpt.snapshot_interval > 0 && c->state_bytes > 0);
    if (cfg.force_tier != APC_FORCE_NONE) apc_route_force(&c->route, cfg.force_tier);
    apc_route_kv_format(&c->route, records);
    if (!cfg.enabled) {
        c->route.tier = APC_TIER_NONE;
        snprintf(c->route.reason, sizeof c->route.reason, "the prompt cache is disabled by configuration");
    }
    if (c->route.tier == APC_TIER_EXACT && cfg.exact_max_bytes == 0) {
        c->route.tier = APC_TIER_NONE;
        snprintf(c->route.reason, sizeof c->route.reason, "exact tier with a byte budget of 0");
    }
    log_route(c, cfg.route_note);
    c->cfg.route_note = NULL; /* borrowed for the log line only */
    switch (c->route.tier) {
    case APC_TIER_BLOCK: c->ops = c->route.snapshots ? &apc_snap_ops : &apc_block_ops; break;
    case APC_TIER_EXACT: c->ops = &apc_exact_ops; break;
    case APC_TIER_CKPT: c->ops = &apc_ckpt_ops; break;
    default: c->ops = &apc_none_ops; break;
    }
    if (c->route.snapshots &&
        apc_snaps_init(&c->snaps, kv_pool_n_blocks(pool), c->state_bytes, cfg.ckpt.snapshot_budget_bytes,
                       cfg.ckpt.snapshot_interval) < 0) {
        apc_free(c);
        ember_fail(err, "prompt cache: out of memory for the snapshot table of %d blocks", kv_pool_n_blocks(pool));
        return NULL;
    }
    kv_pool_set_evict_hook(pool, on_evict, c);
    c->ckpt = apc_ckpt_create(c, stack, layout->n_layer, &cfg);
    if (c->ckpt == NULL) {
        apc_free(c);
        ember_fail(err, "prompt cache: out of memory for the checkpoint tier");
        return NULL;
    }
    /* The layer mix enters the disk namespace. */
    {
        XXH3_state_t *st = XXH3_createState();
        if (st) {
            XXH3_64bits_reset(st);
            for (int l = 0; l < layout->n_layer; l++) {
                int32_t v[3] = {(int32_t)stack[l].kind, stack[l].window, stack[l].keep};
                XXH3_64bits_update(st, v, sizeof v);
            }
            c->layout.stack_sig = XXH3_64bits_digest(st);
            XXH3_freeState(st);
        }
    }
    if (cfg.disk.path && cfg.disk.path[0] && c->route.tier != APC_TIER_NONE && open_disk(c, &cfg.disk, err) < 0) {
        apc_free(c);
        return NULL;
    }
    if (cfg.remote.url && cfg.remote.url[0] && c->route.tier != APC_TIER_NONE) open_remote(c, &cfg);
    /* The strings were the caller's; nothing reads them after creation. */
    c->cfg.disk.path = NULL;
    c->cfg.disk.namespace_override = NULL;
    c->cfg.remote.url = NULL;
    return c;
}

/* A tier that cannot open fails the cache's creation unless the caller
 * said it is optional: an operator who configured a disk path must not
 * find out from one easy-to-miss line that the server runs without it. */
static int open_disk(apc *c, const apc_disk_config *dc, ember_error *err) {
    if (!dc->has_fingerprint && !(dc->namespace_override && dc->namespace_override[0])) {
        if (!dc->optional)
            return ember_fail(err, "APC disk tier at %s: no model fingerprint and no namespace given", dc->path);
        ember_log(EMBER_LOG_WARN, "APC disk tier disabled: no model fingerprint and no namespace given");
        return 0;
    }
    ember_error derr;
    c->disk = apc_disk_open(dc, &c->layout, c->cfg.hash, c->pool, &derr);
    if (c->disk == NULL) {
        if (!dc->optional)
            return ember_fail(err,
                              "APC disk tier at %s cannot be used: %s (fix cache.disk.path, turn the tier off with "
                              "cache.disk.enabled: false / --no-disk, or set cache.disk.optional: true to run without "
                              "it)",
                              dc->path, derr.msg);
        ember_log(EMBER_LOG_WARN, "APC disk tier disabled (init failed; cache.disk.optional): %s", derr.msg);
        return 0;
    }
    apc_disk_stats ds;
    apc_disk_get_stats(c->disk, &ds);
    char cap[48];
    if (dc->max_bytes) snprintf(cap, sizeof cap, "%.2f GiB", (double)dc->max_bytes / (1u << 30));
    else snprintf(cap, sizeof cap, "unbounded");
    ember_log(EMBER_LOG_INFO, "APC disk tier at %s (ns=%s, cap=%s, read_mode=%s, workers=%d, kv_format=%s)", dc->path,
              ds.ns_hex, cap, dc->read_mode == APC_DISK_READ_MMAP ? "mmap" : "direct", dc->workers > 0 ? dc->workers : 1,
              kv_format_name(kv_pool_format(c->pool)));
    apc_disk_note_other_formats(dc, &c->layout, c->cfg.hash, kv_pool_format(c->pool));
    return 0;
}

/* The remote tier shares the SSD tier's namespace, so only replicas of one
 * model under one cache format meet; it serves block chains (block tier),
 * whole snapshots (exact tier) and checkpoint skeletons with their chains
 * (ckpt tier). */
static void open_remote(apc *c, const apc_config *cfg) {
    if (c->route.snapshots) {
        /* A plain chain restores nothing there without its state (apc_snap.c
         * mirrors skeletons to the SSD tier only). */
        ember_log(EMBER_LOG_WARN, "APC remote tier disabled: recurrent-state snapshots on block chains stay local");
        return;
    }
    const apc_disk_config *dc = &cfg->disk;
    if (!dc->has_fingerprint && !(dc->namespace_override && dc->namespace_override[0])) {
        ember_log(EMBER_LOG_WARN, "APC remote tier disabled: no model fingerprint and no namespace given");
        return;
    }
    uint8_t ns[16];
    apc_disk_namespace(dc, &c->layout, c->cfg.hash, ns);
    ember_error rerr;
    c->remote = apc_remote_open(&cfg->remote, ns, &c->layout, c->cfg.hash, c->pool, &rerr);
    if (c->remote == NULL) {
        ember_log(EMBER_LOG_WARN, "APC remote tier disabled: %s", rerr.msg);
        return;
    }
    char hex[33];
    apc_key nk;
    memcpy(nk.b, ns, 16);
    apc_disk_key_hex(&nk, hex);
    ember_log(EMBER_LOG_INFO, "APC remote tier at %s (ns=%s, ttl=%d s, deadline=%.2f of a cold prefill)",
              cfg->remote.url, hex, cfg->remote.ttl_s, cfg->remote.deadline_fraction);
}

void apc_free(apc *c) {
    if (c == NULL) return;
    /* Queued remote writes go out before the pool they were copied from goes. */
    apc_remote_close(c->remote);
    c->remote = NULL;
    /* Queued writes land first; their release callbacks need the cache. */
    apc_disk_close(c->disk);
    c->disk = NULL;
    apc_ckpt_free(c->ckpt); /* releases the records' blocks */
    c->ckpt = NULL;
    if (c->pool) {
        /* Leave no indexed blocks behind in a pool that outlives us. */
        for (int32_t b = 0; b < c->index.n_blocks; b++)
            if (c->index.meta[b].indexed) kv_block_set_indexed(c->pool, b, false);
        kv_pool_set_evict_hook(c->pool, NULL, NULL);
    }
    apc_exact_clear(&c->exact);
    apc_snaps_free(&c->snaps);
    apc_index_free(&c->index);
    free(c->layout.k_width);
    free(c->layout.v_width);
    free(c->layout.k_values);
    free(c->layout.v_values);
    pthread_mutex_destroy(&c->lock);
    free(c);
}

apc_tier apc_get_tier(const apc *c) { return c->route.tier; }

const apc_route *apc_get_route(const apc *c) { return &c->route; }

void apc_namespace_hex(const apc *c, const uint8_t fingerprint[16], const char *namespace_override, char out[33]) {
    apc_disk_config dc = c->cfg.disk;
    memcpy(dc.fingerprint, fingerprint, sizeof dc.fingerprint);
    dc.has_fingerprint = true;
    dc.namespace_override = namespace_override;
    apc_key ns;
    apc_disk_namespace(&dc, &c->layout, c->cfg.hash, ns.b);
    apc_disk_key_hex(&ns, out);
}

/* ---- Sequences ---- */

int apc_seq_prepare_append(apc *c, kv_seq *seq, int64_t n_new, ember_error *err) {
    pthread_mutex_lock(&c->lock);
    int rc = kv_seq_prepare_append(c->pool, seq, n_new, err);
    /* A dry pool gives back the blocks of checkpoint records, oldest first. */
    while (rc < 0 && c->ckpt && apc_ckpt_evict_one_locked(c->ckpt)) rc = kv_seq_prepare_append(c->pool, seq, n_new, err);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

void apc_seq_truncate(apc *c, kv_seq *seq, int64_t n_tokens) {
    pthread_mutex_lock(&c->lock);
    kv_seq_truncate(c->pool, seq, n_tokens);
    pthread_mutex_unlock(&c->lock);
}

void apc_seq_release(apc *c, kv_seq *seq) {
    pthread_mutex_lock(&c->lock);
    kv_seq_release(c->pool, seq);
    pthread_mutex_unlock(&c->lock);
}

/* ---- Lookup ---- */

/* Under the lock: whether block b holds exactly these rows as the child of
 * parent under salt. */
static bool block_matches(const apc *c, int32_t b, const apc_key *parent, uint64_t salt, const int32_t *tokens,
                          int n_rows) {
    const apc_block_meta *m = &c->index.meta[b];
    return m->n_rows == n_rows && m->salt == salt && apc_key_eq(&m->parent, parent) &&
           memcmp(m->tokens, tokens, (size_t)n_rows * sizeof(int32_t)) == 0;
}

/* The chain walk: memory, then (with_disk) the disk where memory stopped.
 * count: a lookup's counters (a prefetch counts nothing but disk hits). */
static apc_hit lookup_blocks(apc *c, const int32_t *tokens, int64_t n, uint64_t salt, kv_seq *seq, bool with_disk,
                             bool count) {
    apc_hit hit = {0, APC_SOURCE_NONE};
    apc_disk *disk = with_disk ? c->disk : NULL;
    int64_t n_blocks = n / KV_BLOCK_TOKENS;
    apc_key *keys = NULL;
    if (n_blocks > 0) {
        keys = malloc((size_t)n_blocks * sizeof *keys);
        if (keys == NULL) {
            decline_locked(c, APC_DECLINE_ALLOC, "out of memory for the lookup's keys");
            return hit;
        }
        apc_chain_keys(c->cfg.hash, tokens, n_blocks, salt, keys);
    }
    apc_key zero;
    memset(&zero, 0, sizeof zero);
    pthread_mutex_lock(&c->lock);
    int64_t matched = 0;
    for (int64_t i = 0; i < n_blocks; i++) {
        int32_t b = apc_index_find(&c->index, &keys[i]);
        if (b < 0) break;
        if (!block_matches(c, b, i > 0 ? &keys[i - 1] : &zero, salt, tokens + i * KV_BLOCK_TOKENS, KV_BLOCK_TOKENS)) {
            decline(c, APC_DECLINE_COLLISION, "a block key matched but its tokens, parent or salt did not");
            break;
        }
        if (kv_seq_adopt_block(c->pool, seq, b, NULL) < 0) {
            decline(c, APC_DECLINE_ALLOC, "out of memory growing a block table");
            break;
        }
        matched++;
    }
    /* The disk continues the chain where memory stopped. */
    int64_t from_disk = 0;
    if (disk && (size_t)seq->n_blocks == (size_t)matched)
        from_disk = apc_disk_chain_count(disk, keys, matched, n_blocks);
    /* A partial tail block after the full ones: the longest one whose rows
     * are all in the query, of which at most n-1 tokens in all are used;
     * from memory (pinned now), or from disk when that one is longer. */
    int64_t full = matched + from_disk;
    int64_t rest = n - full * KV_BLOCK_TOKENS;
    int32_t mem_tail = -1;
    int tail_rows = 0;
    bool disk_tail = false;
    apc_key tail_key;
    if (rest >= 2) {
        const apc_key *parent = full > 0 ? &keys[full - 1] : &zero;
        const int32_t *t = tokens + full * KV_BLOCK_TOKENS;
        for (int m = rest < KV_BLOCK_TOKENS ? (int)rest : KV_BLOCK_TOKENS - 1; m >= 1; m--) {
            apc_key k = apc_partial_key(c->cfg.hash, parent, salt, t, m);
            int32_t b = apc_index_find(&c->index, &k);
            if (b >= 0) {
                if (!block_matches(c, b, parent, salt, t, m)) {
                    decline(c, APC_DECLINE_COLLISION, "a block key matched but its tokens, parent or salt did not");
                    break;
                }
                kv_block_ref(c->pool, b);
                mem_tail = b;
                tail_rows = m;
                break;
            }
            if (disk && apc_disk_has_block(disk, &k)) {
                disk_tail = true;
                tail_key = k;
                tail_rows = m;
                break;
            }
        }
    }
    /* Fresh blocks for what the disk provides. */
    int64_t n_want = from_disk + (disk_tail ? 1 : 0);
    apc_disk_want *want = NULL;
    int64_t n_fresh = 0;
    if (n_want > 0) {
        want = malloc((size_t)n_want * sizeof *want);
        if (want == NULL) {
            decline(c, APC_DECLINE_ALLOC, "out of memory for a disk restore");
            n_want = 0;
        }
        for (; n_fresh < n_want; n_fresh++) {
            int32_t b = kv_block_alloc(c->pool);
            if (b < 0) break;
            apc_disk_want *w = &want[n_fresh];
            bool is_tail = n_fresh == from_disk;
            w->key = is_tail ? tail_key : keys[matched + n_fresh];
            w->tokens = tokens + (matched + n_fresh) * KV_BLOCK_TOKENS;
            w->rows = is_tail ? tail_rows : KV_BLOCK_TOKENS;
            w->dst = b;
        }
        if (n_fresh < n_want) decline(c, APC_DECLINE_POOL_EXHAUSTED, "no free block to restore disk blocks into");
    }
    int64_t loaded = 0;
    if (n_fresh > 0) {
        pthread_mutex_unlock(&c->lock);
        loaded = apc_disk_load_blocks(disk, matched > 0 ? &keys[matched - 1] : &zero, salt, want, n_fresh);
        pthread_mutex_lock(&c->lock);
    }
    bool grew = true; /* the sequence is still contiguous */
    for (int64_t j = 0; j < n_fresh; j++) {
        int32_t b = want[j].dst;
        if (j < loaded && grew) {
            const apc_key *parent = matched + j > 0 ? (j == 0 ? &keys[matched - 1] : &want[j - 1].key) : &zero;
            if (apc_index_find(&c->index, &want[j].key) < 0 && !kv_block_is_indexed(c->pool, b)) {
                apc_index_insert(&c->index, b, &want[j].key, parent, salt, want[j].tokens, want[j].rows);
                kv_block_set_indexed(c->pool, b, true);
            }
            if (kv_seq_adopt_block(c->pool, seq, b, NULL) < 0) {
                decline(c, APC_DECLINE_ALLOC, "out of memory growing a block table");
                grew = false;
            }
        }
        kv_block_unref(c->pool, b);
    }
    int64_t got_full = matched + (loaded < from_disk ? loaded : from_disk);
    int64_t adopted = got_full * KV_BLOCK_TOKENS;
    int64_t got_blocks = got_full;
    if (grew && disk_tail && loaded == n_want && n_want == from_disk + 1) {
        adopted += tail_rows;
        got_blocks++;
    }
    if (mem_tail >= 0) {
        if (grew && got_full == full && kv_seq_adopt_block(c->pool, seq, mem_tail, NULL) == 0) {
            adopted += tail_rows;
            got_blocks++;
        }
        kv_block_unref(c->pool, mem_tail);
    }
    if (!grew) {
        /* Whatever did not make it into the table stays cold. */
        adopted = (int64_t)seq->n_blocks * KV_BLOCK_TOKENS < adopted ? (int64_t)seq->n_blocks * KV_BLOCK_TOKENS
                                                                     : adopted;
    }
    if (got_blocks == 0 || adopted == 0) {
        if (seq->n_blocks > 0) kv_seq_release(c->pool, seq);
        if (count) c->lookups_miss++;
    } else {
        if (adopted > n - 1) adopted = n - 1;
        /* A last block left partial stays shared; the pool copies it on append. */
        seq->n_tokens = (int64_t)seq->n_blocks * KV_BLOCK_TOKENS;
        if (seq->n_tokens > adopted) kv_seq_truncate(c->pool, seq, adopted);
        if (count) {
            c->lookups_hit++;
            c->matched_tokens += (uint64_t)adopted;
        }
        hit.n_tokens = adopted;
        hit.source = APC_SOURCE_BLOCK;
    }
    pthread_mutex_unlock(&c->lock);
    free(want);
    free(keys);
    return hit;
}

apc_hit apc__lookup_blocks(apc *c, const int32_t *tokens, int64_t n, uint64_t salt, kv_seq *seq) {
    return lookup_blocks(c, tokens, n, salt, seq, false, true);
}

/* The walk into a private sequence: what the disk adds is loaded into
 * fresh pool blocks and indexed; the sequence is then let go, so the
 * blocks stay findable (unreferenced, in the pool's LRU). */
int64_t apc__prefetch_blocks(apc *c, const int32_t *tokens, int64_t n, uint64_t salt) {
    kv_seq seq;
    kv_seq_init(&seq);
    apc_hit hit = lookup_blocks(c, tokens, n, salt, &seq, true, false);
    apc_seq_release(c, &seq);
    return hit.n_tokens;
}

/* A snapshot on disk longer than memory's best joins the LRU. */
static void promote_from_disk(apc *c, const int32_t *tokens, int64_t n, uint64_t salt) {
    pthread_mutex_lock(&c->lock);
    int64_t have = apc__exact_best_locked(c, tokens, n - 1, salt);
    pthread_mutex_unlock(&c->lock);
    apc_exact_entry *e = apc_disk_load_exact(c->disk, tokens, n - 1, have, salt, c->cfg.exact_max_bytes);
    if (e == NULL) return;
    pthread_mutex_lock(&c->lock);
    apc_exact_entry *same = apc_exact_find_same(&c->exact, e->tokens, e->n, salt);
    if (same) {
        apc_exact_touch(&c->exact, same);
        apc_exact_entry_free(e);
    } else {
        c->exact_evictions += (uint64_t)apc_exact_insert(&c->exact, e);
    }
    pthread_mutex_unlock(&c->lock);
}

static apc_hit lookup_exact(apc *c, const int32_t *tokens, int64_t n, uint64_t salt, kv_seq *seq,
                            model_state *state) {
    apc_hit hit = {0, APC_SOURCE_NONE};
    if (c->state_bytes && state == NULL) return hit;
    pthread_mutex_lock(&c->lock);
    apc_exact_entry *e = apc_exact_find_prefix(&c->exact, tokens, n - 1, salt);
    /* On a recurrent stack only entries with their state restore. */
    while (e && c->state_bytes && e->state == NULL) e = apc_exact_find_prefix(&c->exact, tokens, e->n - 1, salt);
    if (e == NULL) {
        pthread_mutex_unlock(&c->lock);
        return hit;
    }
    ember_error err;
    if (kv_seq_prepare_append(c->pool, seq, e->n, &err) < 0) {
        decline(c, APC_DECLINE_POOL_EXHAUSTED, err.msg);
        pthread_mutex_unlock(&c->lock);
        return hit;
    }
    e->pins++;
    apc_exact_touch(&c->exact, e);
    uint64_t gen = c->generation;
    pthread_mutex_unlock(&c->lock);

    apc_snapshot_copy_in(c->pool, &c->layout, e->data, e->n, seq);
    int64_t got = e->n;
    bool seals_ok = kv_seq_kvarn_check(c->pool, seq, got);
    bool state_ok = true;
    if (c->state_bytes && seals_ok) state_ok = apc__state_restore(c, state, e->state, got);

    pthread_mutex_lock(&c->lock);
    apc_exact_unpin(&c->exact, e);
    if (!seals_ok) {
        kv_seq_release(c->pool, seq);
        decline(c, APC_DECLINE_KVARN_SEALS, "an exact snapshot's kvarn records are not those of its length");
    } else if (!state_ok) {
        kv_seq_release(c->pool, seq);
        decline(c, APC_DECLINE_ALLOC, "a recurrent-state snapshot did not restore");
    } else if (gen != c->generation) {
        kv_seq_release(c->pool, seq);
        if (state && c->state_bytes) apc__state_reset(c, state);
        decline(c, APC_DECLINE_RACED_RESET, "a snapshot restore overlapped a cache reset");
    } else {
        seq->n_tokens = got;
        c->exact_hits++;
        c->lookups_hit++;
        c->matched_tokens += (uint64_t)got;
        hit.n_tokens = got;
        hit.source = APC_SOURCE_EXACT;
    }
    pthread_mutex_unlock(&c->lock);
    return hit;
}

int64_t apc__exact_best_locked(apc *c, const int32_t *tokens, int64_t max_len, uint64_t salt) {
    apc_exact_entry *e = apc_exact_find_prefix(&c->exact, tokens, max_len, salt);
    while (e && c->state_bytes && e->state == NULL) e = apc_exact_find_prefix(&c->exact, tokens, e->n - 1, salt);
    return e ? e->n : 0;
}

/* The exact tier's stock lookup: a lookup needs an empty sequence and, on
 * recurrent stacks, a state at position 0. */
apc_hit apc__lookup_exact(apc *c, const int32_t *tokens, int64_t n, uint64_t salt, kv_seq *seq, model_state *state) {
    apc_hit none = {0, APC_SOURCE_NONE};
    if (n < 2 || (c->state_bytes && (state == NULL || apc__state_pos(c, state) != 0))) return none;
    return lookup_exact(c, tokens, n, salt, seq, state);
}

int64_t apc__prefetch_exact(apc *c, const int32_t *tokens, int64_t n, uint64_t salt) {
    if (n < 2) return 0;
    promote_from_disk(c, tokens, n, salt);
    return apc__peek_exact(c, tokens, n, salt);
}

bool apc_has_disk(const apc *c) { return c->disk != NULL; }

/* The salt a side entry is written under (apc_disk.h: Names). */
static uint64_t side_salt(uint64_t salt, const apc_side_owner *owner) {
    static const uint8_t zero[16];
    if (owner == NULL || memcmp(owner->ns, zero, 16) == 0) return salt ^ APC_DISK_SIDE_SALT;
    return salt ^ APC_DISK_DRAFT_SIDE_SALT ^ apc_get_u64(owner->ns) ^ apc_get_u64(owner->ns + 8);
}

bool apc_side_store(apc *c, uint64_t salt, const apc_side_owner *owner, const int32_t *tokens, int64_t n,
                    const uint32_t *rows, size_t words, const void *state) {
    uint64_t ss = side_salt(salt, owner);
    bool queued = c->disk && apc_disk_store_side(c->disk, ss, owner, tokens, n, rows, words, state) == 0;
    if (c->remote) queued = apc_remote_store_side(c->remote, ss, owner, tokens, n, rows, words, state) == 0 || queued;
    return queued;
}

uint32_t *apc_side_load(apc *c, uint64_t salt, const apc_side_owner *owner, const int32_t *tokens, int64_t p,
                        int64_t n, size_t words, void **state_out, int64_t *n_out) {
    if (state_out) *state_out = NULL;
    if (p < 1 || p > n) return NULL;
    uint64_t ss = side_salt(salt, owner);
    uint32_t *rows = c->disk ? apc_disk_load_side(c->disk, ss, owner, tokens, p, n, words, state_out, n_out) : NULL;
    if (rows == NULL && c->remote) /* under the deadline of reading what a prefill of n would cost */
        rows = apc_remote_load_side(c->remote, ss, owner, tokens, p, n, words, state_out, n_out,
                                    apc__remote_deadline(c, n));
    return rows;
}
bool apc_has_remote(const apc *c) { return c->remote != NULL; }

void apc_note_prefill(apc *c, int64_t rows, double seconds) {
    if (c == NULL || rows < KV_BLOCK_TOKENS || seconds <= 0) return;
    double spt = seconds / (double)rows;
    pthread_mutex_lock(&c->lock);
    c->prefill_spt = c->prefill_spt > 0 ? 0.75 * c->prefill_spt + 0.25 * spt : spt;
    pthread_mutex_unlock(&c->lock);
}

/* The deadline of a remote read of n missing tokens: a share of what
 * prefilling them cold would cost, so fetching never costs more than
 * computing. */
static int remote_wait_ms(apc *c, int64_t n) {
    const apc_remote_config *rc = &c->cfg.remote;
    pthread_mutex_lock(&c->lock);
    double spt = c->prefill_spt;
    pthread_mutex_unlock(&c->lock);
    if (spt <= 0) spt = 1.0 / (rc->prefill_tps > 0 ? rc->prefill_tps : 500);
    double ms = rc->deadline_fraction * (double)n * spt * 1000.0;
    if (ms < rc->min_wait_ms) ms = rc->min_wait_ms;
    if (ms > rc->max_wait_ms) ms = rc->max_wait_ms;
    return (int)ms;
}

int apc_fetch_wait_ms(apc *c, int64_t n) { return c->remote ? remote_wait_ms(c, n) : 0; }

double apc__remote_deadline(apc *c, int64_t missing) { return ember_now() + remote_wait_ms(c, missing) / 1000.0; }

/* The remote tier continues the chain where memory (after the disk's
 * prefetch) stops: what memory holds is pinned in a private sequence, the
 * present run is found with one pipelined EXISTS, fresh blocks are filled
 * from verified values without the lock, then indexed and let go, so the
 * request's lookup finds them in memory. Returns the tokens memory holds
 * for the prompt (at most n-1). */
static int64_t prefetch_remote(apc *c, const int32_t *tokens, int64_t n, uint64_t salt) {
    int64_t n_blocks = n / KV_BLOCK_TOKENS;
    int64_t rest = n - n_blocks * KV_BLOCK_TOKENS;
    apc_key *keys = malloc((size_t)(n_blocks + KV_BLOCK_TOKENS) * sizeof *keys);
    if (keys == NULL) return 0;
    apc_chain_keys(c->cfg.hash, tokens, n_blocks, salt, keys);
    apc_key zero;
    memset(&zero, 0, sizeof zero);
    kv_seq seq;
    kv_seq_init(&seq);
    pthread_mutex_lock(&c->lock);
    int64_t matched = 0;
    while (matched < n_blocks) {
        int32_t b = apc_index_find(&c->index, &keys[matched]);
        if (b < 0 || !block_matches(c, b, matched > 0 ? &keys[matched - 1] : &zero, salt,
                                    tokens + matched * KV_BLOCK_TOKENS, KV_BLOCK_TOKENS) ||
            kv_seq_adopt_block(c->pool, &seq, b, NULL) < 0)
            break;
        matched++;
    }
    /* Tail candidates (partial keys, longest first) after the full chain,
     * longer than a tail memory holds already. */
    apc_key *tails = keys + n_blocks;
    int tail_rows[KV_BLOCK_TOKENS];
    int n_tail = 0, mem_tail = 0;
    if (rest >= 2) {
        const apc_key *parent = n_blocks > 0 ? &keys[n_blocks - 1] : &zero;
        const int32_t *t = tokens + n_blocks * KV_BLOCK_TOKENS;
        for (int m = (int)rest < KV_BLOCK_TOKENS ? (int)rest : KV_BLOCK_TOKENS - 1; m >= 1; m--) {
            apc_key k = apc_partial_key(c->cfg.hash, parent, salt, t, m);
            if (matched == n_blocks && apc_index_find(&c->index, &k) >= 0) {
                mem_tail = m;
                break;
            }
            tails[n_tail] = k;
            tail_rows[n_tail++] = m;
        }
    }
    pthread_mutex_unlock(&c->lock);
    int64_t held = matched * KV_BLOCK_TOKENS + mem_tail;
    int64_t loaded = 0;
    apc_disk_want *want = NULL;
    int64_t n_fresh = 0;
    if (held < n - 1 && apc_remote_up(c->remote)) {
        double deadline = ember_now() + remote_wait_ms(c, n - held) / 1000.0;
        int tail_at = -1;
        int64_t run = apc_remote_chain_count(c->remote, keys + matched, n_blocks - matched, tails, n_tail, &tail_at,
                                             deadline);
        bool with_tail = run == n_blocks - matched && tail_at >= 0;
        int64_t n_want = run + (with_tail ? 1 : 0);
        want = n_want > 0 ? malloc((size_t)n_want * sizeof *want) : NULL;
        if (want) {
            pthread_mutex_lock(&c->lock);
            for (; n_fresh < n_want; n_fresh++) {
                int32_t b = kv_block_alloc(c->pool);
                if (b < 0) break;
                apc_disk_want *w = &want[n_fresh];
                bool is_tail = n_fresh == run;
                w->key = is_tail ? tails[tail_at] : keys[matched + n_fresh];
                w->tokens = tokens + (matched + n_fresh) * KV_BLOCK_TOKENS;
                w->rows = is_tail ? tail_rows[tail_at] : KV_BLOCK_TOKENS;
                w->dst = b;
            }
            if (n_fresh < n_want) decline(c, APC_DECLINE_POOL_EXHAUSTED, "no free block to restore remote blocks into");
            pthread_mutex_unlock(&c->lock);
            loaded = apc_remote_load_blocks(c->remote, matched > 0 ? &keys[matched - 1] : &zero, salt, want, n_fresh,
                                            deadline);
        }
    }
    pthread_mutex_lock(&c->lock);
    for (int64_t j = 0; j < n_fresh; j++) {
        int32_t b = want[j].dst;
        if (j < loaded && apc_index_find(&c->index, &want[j].key) < 0) {
            const apc_key *parent = j > 0 ? &want[j - 1].key : matched > 0 ? &keys[matched - 1] : &zero;
            apc_index_insert(&c->index, b, &want[j].key, parent, salt, want[j].tokens, want[j].rows);
            kv_block_set_indexed(c->pool, b, true);
        }
        kv_block_unref(c->pool, b);
    }
    kv_seq_release(c->pool, &seq);
    pthread_mutex_unlock(&c->lock);
    int64_t got = held;
    for (int64_t j = 0; j < loaded; j++) got += want[j].rows;
    free(want);
    free(keys);
    return got > n - 1 ? n - 1 : got;
}

/* A snapshot in Redis longer than memory's best (after the disk's) joins
 * the exact LRU, where the request's lookup finds it. */
static int64_t prefetch_remote_exact(apc *c, const int32_t *tokens, int64_t n, uint64_t salt) {
    pthread_mutex_lock(&c->lock);
    int64_t have = apc__exact_best_locked(c, tokens, n - 1, salt);
    pthread_mutex_unlock(&c->lock);
    if (have < n - 1 && apc_remote_up(c->remote)) {
        double deadline = ember_now() + remote_wait_ms(c, n - have) / 1000.0;
        apc_exact_entry *e =
            apc_remote_load_exact(c->remote, tokens, n - 1, have, salt, c->cfg.exact_max_bytes, deadline);
        if (e) {
            pthread_mutex_lock(&c->lock);
            apc_exact_entry *same = apc_exact_find_same(&c->exact, e->tokens, e->n, salt);
            if (same) {
                apc_exact_touch(&c->exact, same);
                apc_exact_entry_free(e);
            } else {
                c->exact_evictions += (uint64_t)apc_exact_insert(&c->exact, e);
            }
            pthread_mutex_unlock(&c->lock);
        }
    }
    return apc__peek_exact(c, tokens, n, salt);
}

int64_t apc_prefetch(apc *c, const int32_t *tokens, int64_t n, uint64_t salt) {
    if (n < 2) return 0;
    int64_t got = c->disk ? c->ops->prefetch(c, tokens, n, salt) : 0;
    if (c->remote) {
        switch (c->route.tier) {
        case APC_TIER_BLOCK: got = prefetch_remote(c, tokens, n, salt); break;
        case APC_TIER_EXACT: got = prefetch_remote_exact(c, tokens, n, salt); break;
        case APC_TIER_CKPT: got = apc__ckpt_prefetch_remote(c, tokens, n, salt); break;
        default: break;
        }
    }
    return got;
}

int64_t apc__peek_exact(apc *c, const int32_t *tokens, int64_t n, uint64_t salt) {
    pthread_mutex_lock(&c->lock);
    int64_t best = apc__exact_best_locked(c, tokens, n - 1, salt);
    pthread_mutex_unlock(&c->lock);
    return best;
}

/* Walks the chain in memory only: no adoption, no counter. */
int64_t apc__peek_blocks(apc *c, const int32_t *tokens, int64_t n, uint64_t salt) {
    int64_t n_blocks = n / KV_BLOCK_TOKENS;
    if (n_blocks == 0) return 0;
    apc_key *keys = malloc((size_t)n_blocks * sizeof *keys);
    if (keys == NULL) return 0;
    apc_chain_keys(c->cfg.hash, tokens, n_blocks, salt, keys);
    apc_key zero;
    memset(&zero, 0, sizeof zero);
    int64_t matched = 0;
    pthread_mutex_lock(&c->lock);
    while (matched < n_blocks) {
        int32_t b = apc_index_find(&c->index, &keys[matched]);
        if (b < 0 || !block_matches(c, b, matched > 0 ? &keys[matched - 1] : &zero, salt,
                                    tokens + matched * KV_BLOCK_TOKENS, KV_BLOCK_TOKENS))
            break;
        matched++;
    }
    pthread_mutex_unlock(&c->lock);
    free(keys);
    int64_t got = matched * KV_BLOCK_TOKENS;
    return got > n - 1 ? n - 1 : got;
}

int64_t apc_peek(apc *c, const int32_t *tokens, int64_t n, uint64_t salt) {
    return n >= 2 ? c->ops->peek(c, tokens, n, salt) : 0;
}

/* ---- Store ---- */

/* A store asking for more than the sequence holds is a caller's slip:
 * counted, never stored. */
static bool store_fits(apc *c, int64_t n, const kv_seq *seq) {
    if (n <= seq->n_tokens) return true;
    decline_locked(c, APC_DECLINE_SEQ_SHORT, "a store asked for more tokens than the sequence holds");
    return false;
}

void apc__store_blocks(apc *c, apc_store_point point, const int32_t *tokens, int64_t n, uint64_t salt,
                       const kv_seq *seq) {
    if (n < 1 || !store_fits(c, n, seq)) return;
    int64_t n_blocks = n / KV_BLOCK_TOKENS;
    apc_key *keys = malloc((size_t)(n_blocks + 1) * sizeof *keys);
    if (keys == NULL) {
        decline_locked(c, APC_DECLINE_ALLOC, "out of memory for the store's keys");
        return;
    }
    apc_chain_keys(c->cfg.hash, tokens, n_blocks, salt, keys);
    apc__store_blocks_keyed(c, point, tokens, n, salt, seq, keys);
    free(keys);
}

void apc__store_blocks_keyed(apc *c, apc_store_point point, const int32_t *tokens, int64_t n, uint64_t salt,
                             const kv_seq *seq, apc_key *keys) {
    if (n < 1 || !store_fits(c, n, seq)) return;
    int64_t n_blocks = n / KV_BLOCK_TOKENS;
    int tail = (int)(n % KV_BLOCK_TOKENS);
    apc_key zero;
    memset(&zero, 0, sizeof zero);
    const apc_key *tail_parent = n_blocks > 0 ? &keys[n_blocks - 1] : &zero;
    if (tail) keys[n_blocks] = apc_partial_key(c->cfg.hash, tail_parent, salt, tokens + n_blocks * KV_BLOCK_TOKENS, tail);
    uint64_t added = 0, added_tokens = 0;
    pthread_mutex_lock(&c->lock);
    for (int64_t i = 0; i < n_blocks + (tail ? 1 : 0); i++) {
        int32_t b = seq->blocks[i];
        int rows = i < n_blocks ? KV_BLOCK_TOKENS : tail;
        if (kv_block_is_indexed(c->pool, b)) continue;          /* adopted, or stored before */
        if (apc_index_find(&c->index, &keys[i]) >= 0) continue; /* same content in another block */
        /* Indexing a live partial block makes its owner copy it on the next
         * append; do that only while a block is free for the copy. */
        if (rows < KV_BLOCK_TOKENS && point == APC_STORE_PREFILL && kv_pool_n_free(c->pool) < 1) continue;
        apc_index_insert(&c->index, b, &keys[i], i > 0 ? &keys[i - 1] : &zero, salt, tokens + i * KV_BLOCK_TOKENS,
                         rows);
        kv_block_set_indexed(c->pool, b, true);
        added++;
        added_tokens += (uint64_t)rows;
    }
    c->stores += added;
    c->served_tokens += added_tokens;
    if (point == APC_STORE_RETIRE && added > 0) c->retire_stores++;
    pthread_mutex_unlock(&c->lock);
    /* With recurrent snapshots a plain chain on disk restores nothing without
     * its state: those stacks mirror skeletons (apc_snap.c) instead. */
    if (c->disk && !c->route.snapshots) apc_disk_store_chain(c->disk, keys, n_blocks, tail, tokens, salt, seq);
    /* The same holds for the remote tier (snapshot stacks keep their
     * records local for now). */
    if (c->remote && !c->route.snapshots) apc_remote_store_chain(c->remote, keys, n_blocks, tail, tokens, salt, seq);
}

/* A disk writer is done with a snapshot it had pinned. */
static void exact_written(void *owner, apc_exact_entry *e) {
    apc *c = owner;
    pthread_mutex_lock(&c->lock);
    apc_exact_unpin(&c->exact, e);
    pthread_mutex_unlock(&c->lock);
}

void apc__store_exact(apc *c, apc_store_point point, const int32_t *tokens, int64_t n, uint64_t salt,
                      const kv_seq *seq, const model_state *state) {
    if (n < 1 || (c->state_bytes && state == NULL) || !store_fits(c, n, seq)) return;
    if (c->state_bytes && (state == NULL || apc__state_pos(c, state) != n)) {
        if (state) decline_locked(c, APC_DECLINE_SEQ_SHORT, "a store's recurrent state is not at its length");
        return;
    }
    if (apc_snapshot_bytes(&c->layout, n) + c->state_bytes > c->cfg.exact_max_bytes) {
        decline_locked(c, APC_DECLINE_EXACT_BYTES, "a snapshot is larger than exact_max_bytes");
        return;
    }
    pthread_mutex_lock(&c->lock);
    apc_exact_entry *same = apc_exact_find_same(&c->exact, tokens, n, salt);
    if (same) apc_exact_touch(&c->exact, same);
    pthread_mutex_unlock(&c->lock);
    if (same) return;

    if (!kv_seq_kvarn_check(c->pool, seq, n)) {
        decline_locked(c, APC_DECLINE_KVARN_SEALS, "the sequence sealed kvarn groups past the stored length");
        return;
    }
    apc_exact_entry *e = apc_exact_entry_new(&c->layout, tokens, n, salt);
    if (e == NULL) {
        decline_locked(c, APC_DECLINE_ALLOC, "out of memory for an exact snapshot");
        return;
    }
    apc_snapshot_copy_out(c->pool, &c->layout, seq, n, e->data);
    if (c->state_bytes) {
        e->state = malloc(c->state_bytes);
        if (e->state == NULL) {
            apc_exact_entry_free(e);
            decline_locked(c, APC_DECLINE_ALLOC, "out of memory for a recurrent-state snapshot");
            return;
        }
        apc__state_snapshot(c, state, e->state);
        e->state_bytes = c->state_bytes;
        e->bytes += c->state_bytes;
    }

    pthread_mutex_lock(&c->lock);
    same = apc_exact_find_same(&c->exact, tokens, n, salt);
    if (same) {
        apc_exact_touch(&c->exact, same);
        apc_exact_entry_free(e);
        e = NULL;
    } else {
        c->exact_evictions += (uint64_t)apc_exact_insert(&c->exact, e);
        c->exact_stores++;
        if (point == APC_STORE_RETIRE) c->retire_stores++;
        int pins = (c->disk ? 1 : 0) + (c->remote ? 1 : 0);
        if (pins) {
            e->pins += pins; /* the writers read e->data; each pin is released by exact_written */
        } else {
            e = NULL;
        }
    }
    pthread_mutex_unlock(&c->lock);
    if (e && c->remote) {
        apc_remote_store_exact(c->remote, e); /* copies the snapshot */
        exact_written(c, e);
    }
    if (e && c->disk && apc_disk_store_exact(c->disk, e, exact_written, c) < 0) exact_written(c, e);
}

/* ---- Stats and reset ---- */

void apc_get_stats(apc *c, apc_stats *s) {
    memset(s, 0, sizeof *s);
    pthread_mutex_lock(&c->lock);
    s->enabled = c->route.tier != APC_TIER_NONE;
    s->tier = c->route.tier;
    s->hash = c->cfg.hash;
    s->block_size = KV_BLOCK_TOKENS;
    s->num_blocks = kv_pool_n_blocks(c->pool);
    s->pool_used = c->index.n_indexed;
    s->pool_free = kv_pool_n_free(c->pool);
    s->pool_referenced = s->num_blocks - s->pool_free;
    s->block_bytes = kv_pool_block_bytes(c->pool);
    snprintf(s->kv_format, sizeof s->kv_format, "%s", kv_format_name(kv_pool_format(c->pool)));
    snprintf(s->attention_precision, sizeof s->attention_precision, "%s",
             attention_precision_name(kv_pool_attention(c->pool)));
    s->lookups_hit = c->lookups_hit;
    s->lookups_miss = c->lookups_miss;
    s->matched_tokens = c->matched_tokens;
    s->served_tokens = c->served_tokens;
    s->evictions = c->evictions;
    s->stores = c->stores;
    s->exact_hits = c->exact_hits;
    s->exact_stores = c->exact_stores;
    s->exact_entries = c->exact.count;
    s->exact_max_entries = c->exact.max_entries;
    s->exact_bytes = c->exact.bytes;
    s->exact_max_bytes = c->exact.max_bytes;
    s->exact_evictions = c->exact_evictions;
    s->retire_stores = c->retire_stores;
    s->generation = c->generation;
    memcpy(s->declines, c->declines, sizeof s->declines);
    if (c->ckpt) apc_ckpt_stats_locked(c->ckpt, s);
    s->snap_stores = c->snaps.stores;
    s->snap_hits = c->snaps.hits;
    s->snap_evictions = c->snaps.evictions;
    s->snap_entries = c->snaps.count;
    s->snap_interval = c->route.snapshots ? c->snaps.interval : 0;
    s->snap_bytes = c->snaps.bytes;
    s->snap_max_bytes = c->snaps.max_bytes;
    pthread_mutex_unlock(&c->lock);
    if (c->disk) {
        apc_disk_stats ds;
        apc_disk_get_stats(c->disk, &ds);
        s->disk_enabled = true;
        s->disk_hits = ds.hits;
        s->disk_writes = ds.writes;
        s->disk_bytes = ds.bytes;
        s->disk_max_bytes = ds.max_bytes;
        s->disk_evictions = ds.evictions;
        s->disk_files = ds.files;
        s->disk_blocks_indexed = ds.blocks_indexed;
        s->disk_exact_indexed = ds.exact_indexed;
        s->disk_write_drops = ds.write_drops;
        s->disk_write_errors = ds.write_errors;
        s->disk_corrupt = ds.corrupt;
        s->disk_read_errors = ds.read_errors;
        s->ckpt_skeleton_writes = ds.skeleton_writes;
        memcpy(s->disk_namespace, ds.ns_hex, sizeof s->disk_namespace);
    }
    if (c->remote) {
        apc_remote_stats rs;
        apc_remote_get_stats(c->remote, &rs);
        s->remote_enabled = true;
        s->remote_breaker_open = rs.breaker_open;
        s->remote_hits = rs.hits;
        s->remote_hit_tokens = rs.hit_tokens;
        s->remote_writes = rs.writes;
        s->remote_errors = rs.errors;
        s->remote_timeouts = rs.timeouts;
        s->remote_corrupt = rs.corrupt;
        s->remote_write_drops = rs.write_drops;
    }
}

void apc_set_block_listener(apc *c, apc_block_listener fn, void *user) {
    pthread_mutex_lock(&c->lock);
    c->index.listener = fn;
    c->index.listener_user = fn ? user : NULL;
    pthread_mutex_unlock(&c->lock);
}

void apc_flush(apc *c) {
    if (c && c->disk) apc_disk_flush(c->disk);
    if (c && c->remote) apc_remote_flush(c->remote);
}

void apc_reset(apc *c) {
    pthread_mutex_lock(&c->lock);
    for (int32_t b = 0; b < c->index.n_blocks; b++)
        if (c->index.meta[b].indexed) kv_block_set_indexed(c->pool, b, false);
    apc_index_clear(&c->index);
    apc_exact_clear(&c->exact);
    c->lookups_hit = c->lookups_miss = c->matched_tokens = c->served_tokens = 0;
    c->evictions = c->stores = c->exact_hits = c->exact_stores = c->exact_evictions = c->retire_stores = 0;
    memset(c->declines, 0, sizeof c->declines);
    memset(c->decline_logged, 0, sizeof c->decline_logged);
    if (c->ckpt) apc_ckpt_reset_locked(c->ckpt);
    apc_snaps_clear(&c->snaps);
    c->snaps.stores = c->snaps.hits = c->snaps.evictions = 0;
    c->generation++;
    pthread_mutex_unlock(&c->lock);
    /* The disk keeps its files; only its cumulative counters restart. */
    if (c->disk) apc_disk_reset_counters(c->disk);
    if (c->remote) apc_remote_reset_counters(c->remote);
}
