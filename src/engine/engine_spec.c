/* engine_spec.c - the drafters (see engine_spec.h).
 *
 * Prompt lookup is a pure function of the tokens so far. A draft model is a
 * second, smaller model run greedily: its sequence lags the target's by one
 * token (it has forwarded all[0, n-1) when asked to draft after all[n-1]),
 * and a draft step forwards all[n-1], then each draft but the last, one row
 * at a time, taking the argmax as the next draft.
 *
 * Catching up after a verification: the draft's K/V of the tokens it saw
 * that the target committed stay; the rest is dropped (kv_seq_truncate).
 * A recurrent draft model cannot drop tokens from its state, so each round
 * snapshots the state before it drafts (at n-1) and restores it when the
 * round's drafts were not all kept; then it forwards what was committed.
 * Without a snapshot at or before what was kept (a drafter told to keep
 * none, as a test does to prove this path), it resets the state and
 * forwards the kept tokens again: slower, the same bits.
 *
 * The MTP head drafts from the target's own hidden states: the driver hands
 * it the hidden row of every committed position the target forwards
 * (spec_observe), and its K/V follow the target's positions one for one
 * (row p is token p with the hidden row of p-1). A draft step runs the
 * head at the newest committed token with the last observed hidden row,
 * then feeds each draft back with the head's own output as the hidden
 * row; those speculative rows are dropped afterwards (the committed row at
 * n-1 is computed again, to the same bits, when the target's row is
 * observed).
 *
 * Adaptive k: a round whose drafts were all accepted doubles k (up to the
 * configured k), one whose first draft was rejected halves it; at 0 the
 * request probes with one draft every SPEC_PROBE rounds, so a drafter that
 * keeps missing costs one draft row in SPEC_PROBE steps. A measurement of
 * the cost governor (below) that starts from nothing known (the drafter's
 * first, or the probe after a pause) starts its request at k = 1, and k
 * does not fall under 1 while it measures: a drafter that misses costs one
 * draft and one verified row per sample, instead of k halving from the
 * configured k (4 + 2 + 1), and one that hits still reaches that k by
 * doubling within the measurement.
 *
 * Acceptance alone does not say whether speculation pays: a draft model
 * that is as slow as the target (tiny models, where a step is overhead), or
 * a verification that costs more than the accepted tokens save, loses even
 * at high acceptance. So adaptive k also keeps a cost governor, one per
 * drafter (what one request learnt the next keeps). It measures the wall
 * time between two verified rounds of a request, per committed token, in
 * pairs: a speculative round, then a plain one (which emits what any round
 * would), so that both kinds decode at about the same position (attention
 * grows with it) and in the same weather on a shared machine; after
 * SPEC_SAMPLES pairs it compares the medians. A measurement is taken at the
 * start and every SPEC_REPLAIN speculative rounds. When speculative tokens
 * cost more than plain ones, speculation pauses and requests decode
 * plainly. Output never depends on k, so the governor, timing-dependent as
 * it is, cannot change a token; it only changes the speed and the counters.
 *
 * What a pause must not cost: while paused nothing drafts, so a draft model
 * falls behind and does no work at all (the MTP head, which reads hidden
 * rows only the target's forward produces, keeps them and computes its own
 * rows only when it drafts again). Measuring speculation again costs
 * something: a few losing rounds, plus the catch-up of whatever the draft
 * model missed, which is one batched forward but, on a tiny model, costs
 * about as much per row as the target's decode step. So a pause is not a
 * fixed number of rounds: the next measurement starts only once its
 * expected cost is at most SPEC_PROBE_SHARE of the plain time decoded
 * since the pause began. That cost is the extra the last measurement cost
 * beyond plain decoding plus the catch-up this request would need now (rows
 * missed times the measured seconds per catch-up row), doubled for each
 * measurement in a row that failed (up to 2^(SPEC_BACKOFF_MAX-1)). So
 * probing never costs more than that share of decoding; a drafter that can
 * never pay (a draft model as costly per row as the target) is measured
 * ever more rarely, mostly at the start of a request where the catch-up is
 * only the prompt; one whose acceptance merely dipped is measured again
 * soon. A catch-up of the prompt or of what a pause skipped is timed apart
 * from the round it falls in (a one-off, not a per-token cost); one after
 * rounds a request spent at k = 0 is not (that is what speculating cost). */
#include "engine/engine_spec.h"

#include "core/clock.h"
#include "engine/engine.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

enum { SPEC_PROBE = 8, SIDECAR_MAX = 64 };
/* The cost governor: a plain round every SPEC_REPLAIN speculative ones;
 * SPEC_SAMPLES speculative rounds before judging; a pause lasts at least
 * SPEC_PAUSE_MIN plain rounds, and until measuring again costs at most
 * SPEC_PROBE_SHARE of the plain time since the pause began. */
enum { SPEC_REPLAIN = 32, SPEC_SAMPLES = 3, SPEC_PAUSE_MIN = 64, SPEC_BACKOFF_MAX = 5 };
#define SPEC_PROBE_SHARE 0.01
/* Speculation goes on only while its tokens cost under this fraction of a
 * plain one: at par it gains nothing, and a measurement's noise would
 * otherwise keep a losing drafter going for SPEC_REPLAIN rounds. */
#define SPEC_KEEP_BELOW 0.97

/* The governor judges on the median of each kind's last SPEC_WINDOW
 * rounds: on a shared machine one round now and then loses its core for a
 * whole time slice, and a mean would take that for a cost. */
enum { SPEC_WINDOW = 5 };
typedef struct cost_window {
    double v[SPEC_WINDOW];
    int n, next;
} cost_window;

static void window_add(cost_window *w, double x) {
    w->v[w->next] = x;
    w->next = (w->next + 1) % SPEC_WINDOW;
    if (w->n < SPEC_WINDOW) w->n++;
}

static double window_median(const cost_window *w) {
    double v[SPEC_WINDOW];
    memcpy(v, w->v, sizeof v);
    for (int i = 1; i < w->n; i++)
        for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
            double t = v[j];
            v[j] = v[j - 1];
            v[j - 1] = t;
        }
    return v[w->n / 2];
}

/* One sidecar entry: the head's (or the draft model's) K/V rows [0, n)
 * (blocks of the drafter's pool, referenced) and the target hidden rows the
 * head read (or the draft model's recurrent state at n), for tokens ids. */
typedef struct sidecar_entry {
    uint64_t salt;
    int64_t n;
    int32_t *ids;            /* (n) */
    kv_seq seq;              /* head (draft model) blocks of [0, n) */
    float *hidden;           /* SPEC_MTP: (n, n_embd) target hidden row of each position */
    void *state;             /* SPEC_DRAFT, recurrent draft models: the state at n */
    size_t bytes;
    uint64_t used;           /* LRU clock */
} sidecar_entry;

struct spec_drafter {
    spec_config cfg;
    const model *target;
    int n_vocab;
    int n_embd;
    /* SPEC_DRAFT, SPEC_MTP */
    kv_pool *pool;           /* the draft model's (or MTP head's) K/V, all requests */
    model_ctx *ctx;
    int max_batch;
    pthread_mutex_t lock;    /* ctx is single-threaded; also guards the sidecar */
    /* SPEC_MTP sidecar */
    sidecar_entry *side[SIDECAR_MAX];
    int n_side;
    size_t side_bytes;
    uint64_t side_clock;
    int64_t side_writes, side_hits;
    /* the SSD mirror */
    apc *cache;              /* the target's prompt cache (its SSD tier), or NULL */
    int pool_layers;         /* layers of the head's (draft model's) pool */
    size_t side_words;       /* 32-bit words of one position in a side file: head K/V rows + hidden row
                              * (a draft model: its K/V rows) */
    apc_side_owner owner;    /* SPEC_DRAFT: the draft model's own namespace and state size */
    int64_t side_disk_writes, side_disk_loads;
    int64_t draft_rows;      /* SPEC_DRAFT: rows the draft model forwarded */
    bool no_snapshots;       /* tests: a recurrent draft model's rollbacks take the fallback */
    int64_t side_rows;       /* rows a sidecar restore saved it (or the head) */
    /* the cost governor (adaptive only): shared by the requests, which all
     * verify on the same target, so what one learnt the next one keeps;
     * under the lock (engine_generate may run requests on several threads) */
    cost_window spec_win, plain_win; /* seconds per committed token of recent rounds, catch-ups excluded */
    int since_plain;         /* speculative rounds since the last plain one */
    bool measuring;          /* pairing speculative and plain rounds, windows emptied first */
    bool paused;             /* requests decode plainly until probe_due() */
    int paused_rounds;       /* plain rounds since the pause began */
    int64_t measure_tokens;  /* tokens committed by speculative rounds since the last verdict */
    double measure_s;        /* and their seconds */
    double probe_s;          /* what the measurement that led to the pause cost beyond plain decoding */
    int failed;              /* measurements in a row that found speculation slower */
    int64_t pauses;          /* pauses so far */
    double catch_s;          /* seconds and rows of the drafter's one-off catch-ups */
    int64_t catch_rows;
    spec_governor_stats account; /* spec_governor_get_stats */
};

struct spec_seq {
    spec_stats stats;
    int k_now;               /* adaptive k; 0: probing */
    int idle_rounds;         /* rounds without a draft while k_now == 0 */
    double t_last;           /* cost governor: ember_now() at the previous verified round; 0: none yet */
    double round_catch_s;    /* the draft model's one-off catch-up in this round (seconds, rows) */
    int64_t round_catch_rows;
    bool catch_one_off;      /* the next catch-up is a one-off: the prompt, or what a pause skipped */
    int64_t pause_seen;      /* the drafter's pauses when this request last speculated */
    /* SPEC_DRAFT */
    kv_seq seq;              /* K/V of seen[0, seq.n_tokens) */
    model_state *state;      /* recurrent draft models; at seq.n_tokens */
    void *snap;              /* state at snap_pos, or NULL */
    int64_t snap_pos;        /* -1: no snapshot */
    int32_t *seen;           /* (cap) tokens the draft model forwarded */
    int64_t cap;
    float *logits;           /* (n_vocab) */
    /* SPEC_MTP */
    int64_t mtp_done;        /* head rows [0, mtp_done) hold committed positions */
    int64_t obs_done;        /* positions observed while paused: hidden rows in hist, tokens in seen,
                              * head rows still to compute (mtp_flush); <= mtp_done: none */
    float *h_last;           /* (n_embd) target hidden row of mtp_done - 1 (zeros at 0) */
    float *h_prev;           /* (max_batch, n_embd) the head's hidden inputs of a chunk */
    float *y;                /* (n_embd) the head's own output (fed back while drafting) */
    float *hist;             /* (hist_cap, n_embd) target hidden row of each observed position */
    int64_t hist_cap;
    bool faithful;           /* every head row came from a real hidden row */
    bool looked;             /* the sidecar was consulted (first observation / first draft) */
    int64_t side_pending;    /* SPEC_DRAFT: the post-prefill store of [0, side_pending) waits for the
                              * draft model to have seen those tokens (its first draft); 0: none */
    uint64_t salt;
};

const char *spec_kind_name(spec_kind kind) {
    switch (kind) {
    case SPEC_OFF: return "off";
    case SPEC_LOOKUP: return "lookup";
    case SPEC_DRAFT: return "draft";
    case SPEC_MTP: return "mtp";
    }
    return "?";
}

/* ---- Lifetime ---- */

static void side_drop(spec_drafter *d, int i);

spec_drafter *spec_drafter_create(const model *target, const spec_config *cfg, int32_t n_blocks, int n_threads,
                                  int max_batch, ember_error *err) {
    if (cfg->kind == SPEC_OFF || cfg->k < 1 || cfg->k > SPEC_MAX_K) {
        ember_fail(err, "speculative decoding needs a drafter and 1 <= k <= %d (got k = %d)", SPEC_MAX_K, cfg->k);
        return NULL;
    }
    const model_hparams *th = model_get_hparams(target);
    if (cfg->kind == SPEC_MTP && !model_has_mtp(target)) {
        ember_fail(err, "spec.mode mtp: %s has no MTP (nextn) head", th->name[0] ? th->name : th->arch_name);
        return NULL;
    }
    if (cfg->kind == SPEC_DRAFT) {
        if (cfg->draft == NULL) {
            ember_fail(err, "speculative decoding with a draft model needs the draft model");
            return NULL;
        }
        const model_hparams *dh = model_get_hparams(cfg->draft);
        if (dh->n_vocab != th->n_vocab) {
            ember_fail(err, "the draft model has %d tokens in its vocabulary, the target %d: they must be the same",
                       dh->n_vocab, th->n_vocab);
            return NULL;
        }
    }
    spec_drafter *d = calloc(1, sizeof *d);
    if (d == NULL) {
        ember_fail(err, "out of memory");
        return NULL;
    }
    d->cfg = *cfg;
    if (d->cfg.ngram_max < 1) d->cfg.ngram_max = 3;
    if (d->cfg.ngram_min < 1) d->cfg.ngram_min = 1;
    if (d->cfg.ngram_min > d->cfg.ngram_max) d->cfg.ngram_min = d->cfg.ngram_max;
    d->target = target;
    d->n_vocab = th->n_vocab;
    d->n_embd = th->n_embd;
    d->max_batch = max_batch > 0 ? max_batch : 512;
    pthread_mutex_init(&d->lock, NULL);
    if (cfg->kind == SPEC_DRAFT) {
        kv_pool_config pc;
        model_kv_config(cfg->draft, n_blocks, &pc);
        d->pool = kv_pool_create(&pc, err);
        if (d->pool) d->ctx = model_ctx_create(cfg->draft, d->pool, n_threads, d->max_batch, err);
        if (d->ctx == NULL) {
            ember_fail_prefix(err, "draft model");
            spec_drafter_free(d);
            return NULL;
        }
    }
    if (cfg->kind == SPEC_MTP) {
        kv_pool_config pc;
        model_mtp_kv_config(target, n_blocks, &pc);
        d->pool = kv_pool_create(&pc, err);
        d->pool_layers = pc.n_layer;
        if (d->pool) {
            for (int l = 0; l < pc.n_layer; l++)
                d->side_words += (kv_pool_row_bytes(d->pool, l, 0) + kv_pool_row_bytes(d->pool, l, 1)) / 4;
            d->side_words += (size_t)d->n_embd;
        }
        if (d->pool) d->ctx = model_mtp_ctx_create(target, d->pool, n_threads, d->max_batch, err);
        if (d->ctx == NULL) {
            ember_fail_prefix(err, "MTP head");
            spec_drafter_free(d);
            return NULL;
        }
    }
    return d;
}

void spec_drafter_free(spec_drafter *d) {
    if (d == NULL) return;
    while (d->n_side > 0) side_drop(d, d->n_side - 1);
    model_ctx_free(d->ctx);
    kv_pool_free(d->pool);
    pthread_mutex_destroy(&d->lock);
    free(d);
}

const spec_config *spec_drafter_config(const spec_drafter *d) { return &d->cfg; }

spec_seq *spec_seq_create(spec_drafter *d, uint64_t salt, ember_error *err) {
    spec_seq *s = calloc(1, sizeof *s);
    if (s == NULL) goto oom;
    s->salt = salt;
    s->faithful = true;
    s->k_now = d->cfg.k;
    s->snap_pos = -1;
    kv_seq_init(&s->seq);
    if (d->cfg.kind == SPEC_MTP) {
        s->logits = malloc((size_t)d->n_vocab * sizeof(float));
        s->h_last = calloc((size_t)d->n_embd, sizeof(float));
        s->h_prev = malloc((size_t)d->max_batch * (size_t)d->n_embd * sizeof(float));
        s->y = malloc((size_t)d->n_embd * sizeof(float));
        if (!s->logits || !s->h_last || !s->h_prev || !s->y) goto oom;
    }
    if (d->cfg.kind == SPEC_DRAFT) {
        s->logits = malloc((size_t)d->n_vocab * sizeof(float));
        if (s->logits == NULL) goto oom;
        if (model_has_state(d->cfg.draft)) {
            s->state = model_state_create(d->cfg.draft, err);
            s->snap = malloc(model_state_bytes(d->cfg.draft));
            if (s->state == NULL || s->snap == NULL) goto oom;
        }
    }
    return s;
oom:
    spec_seq_free(d, s);
    ember_fail(err, "out of memory for a draft sequence");
    return NULL;
}

void spec_seq_free(spec_drafter *d, spec_seq *s) {
    if (s == NULL) return;
    if (d->pool) {
        pthread_mutex_lock(&d->lock);
        kv_seq_release(d->pool, &s->seq);
        pthread_mutex_unlock(&d->lock);
    }
    model_state_free(s->state);
    free(s->snap);
    free(s->seen);
    free(s->logits);
    free(s->h_last);
    free(s->h_prev);
    free(s->y);
    free(s->hist);
    free(s);
}

/* ---- MTP sidecar ---- */

static void side_drop(spec_drafter *d, int i) {
    sidecar_entry *e = d->side[i];
    kv_seq_release(d->pool, &e->seq);
    d->side_bytes -= e->bytes;
    free(e->ids);
    free(e->hidden);
    free(e->state);
    free(e);
    d->side[i] = d->side[--d->n_side];
}

static void side_evict_lru(spec_drafter *d) {
    int lru = 0;
    for (int i = 1; i < d->n_side; i++)
        if (d->side[i]->used < d->side[lru]->used) lru = i;
    side_drop(d, lru);
}

/* Keeps the hidden row of position pos for the sidecar. */
static int hist_put(spec_drafter *d, spec_seq *s, int64_t pos, const float *row) {
    const size_t D = (size_t)d->n_embd;
    if (pos >= s->hist_cap) {
        int64_t cap = s->hist_cap ? s->hist_cap * 2 : 512;
        while (cap <= pos) cap *= 2;
        float *h = realloc(s->hist, (size_t)cap * D * sizeof(float));
        if (h == NULL) return -1;
        s->hist = h;
        s->hist_cap = cap;
    }
    if (row) memcpy(s->hist + (size_t)pos * D, row, D * sizeof(float));
    else memset(s->hist + (size_t)pos * D, 0, D * sizeof(float));
    return 0;
}

/* ---- The SSD mirror ----
 * A side file's row t (side_words words): every head layer's K row and V
 * row of position t, as the head's pool encodes them, then the target's
 * hidden row of t. */

static void side_rows_out(const spec_drafter *d, const sidecar_entry *e, uint32_t *out) {
    const size_t D = (size_t)d->n_embd;
    for (int64_t t = 0; t < e->n; t++) {
        uint32_t *row = out + (size_t)t * d->side_words;
        int32_t b = e->seq.blocks[t / KV_BLOCK_TOKENS];
        int r = (int)(t % KV_BLOCK_TOKENS);
        for (int l = 0; l < d->pool_layers; l++)
            for (int kv = 0; kv < 2; kv++) {
                size_t w = kv_pool_row_bytes(d->pool, l, kv) / 4;
                if (w == 0) continue;
                const float *src = kv ? kv_block_v(d->pool, b, l) : kv_block_k(d->pool, b, l);
                memcpy(row, src + (size_t)r * w, w * 4);
                row += w;
            }
        if (e->hidden) memcpy(row, e->hidden + (size_t)t * D, D * sizeof(float)); /* SPEC_MTP */
    }
}

/* The inverse for one position: the K/V of side row `row` into row t of
 * seq's blocks (allocated); returns where the row's hidden part starts. */
static const uint32_t *side_row_in(spec_drafter *d, const kv_seq *seq, int64_t t, const uint32_t *row) {
    int32_t b = seq->blocks[t / KV_BLOCK_TOKENS];
    int r = (int)(t % KV_BLOCK_TOKENS);
    for (int l = 0; l < d->pool_layers; l++)
        for (int kv = 0; kv < 2; kv++) {
            size_t w = kv_pool_row_bytes(d->pool, l, kv) / 4;
            if (w == 0) continue;
            float *dst = kv ? kv_block_v(d->pool, b, l) : kv_block_k(d->pool, b, l);
            memcpy(dst + (size_t)r * w, row, w * 4);
            row += w;
        }
    return row;
}

/* Whether the sidecar has a tier beyond memory: the cache's SSD tier, its
 * remote (Redis) tier, or both. */
static bool side_shared(const spec_drafter *d) {
    return d->cache && (apc_has_disk(d->cache) || apc_has_remote(d->cache));
}

/* Under the lock: the entry's side file (a draft model's: under its own
 * owner namespace, its state after the rows), queued for the SSD and remote
 * tiers. */
static void side_to_disk(spec_drafter *d, const sidecar_entry *e) {
    if (!side_shared(d)) return;
    const apc_side_owner *owner = d->cfg.kind == SPEC_DRAFT ? &d->owner : NULL;
    if (owner && owner->state_bytes && e->state == NULL) return;
    uint32_t *rows = malloc((size_t)e->n * d->side_words * sizeof(uint32_t));
    if (rows == NULL) return;
    side_rows_out(d, e, rows);
    if (apc_side_store(d->cache, e->salt, owner, e->ids, e->n, rows, d->side_words, e->state)) d->side_disk_writes++;
    free(rows);
}

/* A draft model's owner namespace (apc_side_owner): what its side files
 * must match verbatim to be adopted, beside the target's namespace that
 * the directory already names. */
static void draft_owner_ns(const spec_drafter *d, uint8_t ns[16]) {
    XXH3_state_t *st = XXH3_createState();
    memset(ns, 0, 16);
    if (st == NULL) return;
    uint8_t fp[16];
    engine_model_fingerprint(model_get_gguf(d->cfg.draft), fp);
    uint64_t v[4] = {1, kv_format_id(kv_pool_format(d->pool)), (uint64_t)d->pool_layers, d->owner.state_bytes};
    XXH3_128bits_reset(st);
    XXH3_128bits_update(st, "ember-draft-side", 16);
    XXH3_128bits_update(st, fp, sizeof fp);
    for (int i = 0; i < 4; i++) {
        uint8_t b[8];
        for (int j = 0; j < 8; j++) b[j] = (uint8_t)(v[i] >> (8 * j));
        XXH3_128bits_update(st, b, 8);
    }
    for (int l = 0; l < d->pool_layers; l++)
        for (int kv = 0; kv < 2; kv++) {
            uint8_t b[8];
            uint64_t w = kv_pool_row_bytes(d->pool, l, kv);
            for (int j = 0; j < 8; j++) b[j] = (uint8_t)(w >> (8 * j));
            XXH3_128bits_update(st, b, 8);
        }
    XXH128_hash_t h = XXH3_128bits_digest(st);
    XXH3_freeState(st);
    for (int i = 0; i < 8; i++) {
        ns[i] = (uint8_t)(h.low64 >> (8 * i));
        ns[8 + i] = (uint8_t)(h.high64 >> (8 * i));
    }
}

void spec_sidecar_attach(spec_drafter *d, apc *cache) {
    if (d->cfg.sidecar_memory_only) return;
    if (d->cfg.kind == SPEC_DRAFT) {
        /* Rows are copied word for word: not from a kvarn pool (sealed
         * groups), nor without a file to fingerprint. */
        if (kv_format_is_kvarn(kv_pool_format(d->pool)) || model_get_gguf(d->cfg.draft) == NULL) return;
        d->pool_layers = model_get_hparams(d->cfg.draft)->n_layer;
        d->side_words = 0;
        for (int l = 0; l < d->pool_layers; l++)
            d->side_words += (kv_pool_row_bytes(d->pool, l, 0) + kv_pool_row_bytes(d->pool, l, 1)) / 4;
        if (d->side_words == 0) return; /* a draft model without K/V: nothing of it is per position */
        d->owner.state_bytes = model_has_state(d->cfg.draft) ? model_state_bytes(d->cfg.draft) : 0;
        draft_owner_ns(d, d->owner.ns);
    }
    d->cache = cache;
}

/* Under the lock: a memory entry of n rows from a side file's rows. */
/* ---- Sidecar entries: making one ----
 * Every entry (the head's or a draft model's, stored from a request or read
 * from a side file) is made the same way: side_entry_new evicts older
 * entries until the budgets have room and allocates the empty entry;
 * side_entry_pin (rows a request already holds: its blocks, referenced) or
 * side_entry_reserve (rows to be copied in) gives it K/V blocks;
 * side_entry_add puts it in the LRU; side_entry_discard frees one that
 * never got there. */

/* Under the lock: room for `bytes` and an empty entry with ids (n), hidden
 * rows (n, n_embd) when `hidden`, and a state of sb bytes; NULL when out of
 * memory. */
static sidecar_entry *side_entry_new(spec_drafter *d, int64_t n, bool hidden, size_t sb, size_t bytes) {
    while (d->n_side > 0 && (d->n_side >= d->cfg.sidecar_entries || d->n_side >= SIDECAR_MAX ||
                             d->side_bytes + bytes > d->cfg.sidecar_bytes))
        side_evict_lru(d);
    sidecar_entry *e = calloc(1, sizeof *e);
    if (e == NULL) return NULL;
    kv_seq_init(&e->seq);
    e->ids = malloc((size_t)n * sizeof(int32_t));
    if (hidden) e->hidden = malloc((size_t)n * (size_t)d->n_embd * sizeof(float));
    if (sb) e->state = malloc(sb);
    if (e->ids == NULL || (hidden && e->hidden == NULL) || (sb && e->state == NULL)) {
        free(e->ids);
        free(e->hidden);
        free(e->state);
        free(e);
        return NULL;
    }
    return e;
}

static void side_entry_discard(spec_drafter *d, sidecar_entry *e) {
    kv_seq_release(d->pool, &e->seq);
    free(e->ids);
    free(e->hidden);
    free(e->state);
    free(e);
}

/* e references the blocks of src's rows [0, n). */
static bool side_entry_pin(spec_drafter *d, sidecar_entry *e, const kv_seq *src, int64_t n) {
    int32_t n_blocks = (int32_t)((n + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS);
    ember_error err;
    for (int32_t b = 0; b < n_blocks; b++)
        if (kv_seq_adopt_block(d->pool, &e->seq, src->blocks[b], &err) < 0) return false;
    kv_seq_truncate(d->pool, &e->seq, n);
    return true;
}

/* e holds blocks for n rows (to be copied in), older entries giving theirs
 * back when the pool is full. */
static bool side_entry_reserve(spec_drafter *d, sidecar_entry *e, int64_t n) {
    ember_error err;
    int rc = kv_seq_prepare_append(d->pool, &e->seq, n, &err);
    while (rc < 0 && d->n_side > 0) {
        side_evict_lru(d);
        rc = kv_seq_prepare_append(d->pool, &e->seq, n, &err);
    }
    return rc == 0;
}

static void side_entry_add(spec_drafter *d, sidecar_entry *e, uint64_t salt, const int32_t *ids, int64_t n,
                           size_t bytes) {
    memcpy(e->ids, ids, (size_t)n * sizeof(int32_t));
    e->salt = salt;
    e->n = n;
    e->bytes = bytes;
    e->used = ++d->side_clock;
    d->side[d->n_side++] = e;
    d->side_bytes += bytes;
}

static void side_from_rows(spec_drafter *d, uint64_t salt, const int32_t *tokens, int64_t n, const uint32_t *rows) {
    const size_t D = (size_t)d->n_embd;
    int32_t n_blocks = (int32_t)((n + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS);
    size_t bytes = (size_t)n * (D * sizeof(float) + sizeof(int32_t)) + (size_t)n_blocks * kv_pool_block_bytes(d->pool);
    if (bytes > d->cfg.sidecar_bytes) return;
    sidecar_entry *e = side_entry_new(d, n, true, 0, bytes);
    if (e == NULL) return;
    if (!side_entry_reserve(d, e, n)) {
        side_entry_discard(d, e);
        return;
    }
    for (int64_t t = 0; t < n; t++) {
        const uint32_t *row = side_row_in(d, &e->seq, t, rows + (size_t)t * d->side_words);
        memcpy(e->hidden + (size_t)t * D, row, D * sizeof(float));
    }
    e->seq.n_tokens = n;
    side_entry_add(d, e, salt, tokens, n, bytes);
    d->side_disk_loads++;
}

static void draft_side_prefetch(spec_drafter *d, const int32_t *tokens, int64_t n, uint64_t salt);

void spec_sidecar_prefetch(spec_drafter *d, const int32_t *tokens, int64_t p, int64_t n, uint64_t salt) {
    if (d && d->cfg.kind == SPEC_DRAFT && d->cfg.sidecar_entries > 0 && side_shared(d)) {
        draft_side_prefetch(d, tokens, n, salt);
        return;
    }
    if (d == NULL || d->cfg.kind != SPEC_MTP || d->cfg.sidecar_entries < 1 || d->cache == NULL ||
        !side_shared(d) || p < 1)
        return;
    pthread_mutex_lock(&d->lock);
    bool have = false;
    for (int i = 0; i < d->n_side && !have; i++) {
        const sidecar_entry *e = d->side[i];
        have = e->salt == salt && e->n >= p && memcmp(e->ids, tokens, (size_t)p * sizeof(int32_t)) == 0;
    }
    pthread_mutex_unlock(&d->lock);
    if (have) return;
    int64_t got_n = 0;
    uint32_t *rows = apc_side_load(d->cache, salt, NULL, tokens, p, n, d->side_words, NULL, &got_n);
    if (rows == NULL) return;
    pthread_mutex_lock(&d->lock);
    side_from_rows(d, salt, tokens, got_n, rows);
    pthread_mutex_unlock(&d->lock);
    free(rows);
}

static int remember(spec_seq *s, int64_t pos, int32_t token);

/* ---- The draft model's sidecar ----
 * The same LRU holds a draft model's K/V (blocks of its own pool: its own
 * namespace, never the target's cache) and, for a recurrent draft model,
 * its state at n. A KV-only draft model's entry serves any common prefix
 * (rows are causal); a recurrent one's only its exact length.
 * Mirrored like the head's (side_to_disk), but under the draft model's own
 * owner namespace (draft_owner_ns): the directory (or the Redis prefix)
 * names the target, the owner the second model, and only a reader with
 * both adopts an entry. Read back by draft_side_prefetch, on the fetch
 * path, into a memory entry that the first draft then adopts as usual. */

/* Under the lock: pins s's rows [0, n) (state: the draft state at n, or
 * NULL for KV-only draft models). */
static void draft_side_put(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t n, const void *state) {
    size_t sb = s->state ? model_state_bytes(d->cfg.draft) : 0;
    int32_t n_blocks = (int32_t)((n + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS);
    size_t bytes = (size_t)n * sizeof(int32_t) + (size_t)n_blocks * kv_pool_block_bytes(d->pool) + sb;
    if (n < 1 || bytes > d->cfg.sidecar_bytes || (sb && state == NULL)) return;
    for (int i = 0; i < d->n_side; i++) { /* the same key, or (KV-only) one this entry extends, is replaced */
        sidecar_entry *e = d->side[i];
        if (e->salt == s->salt && (e->n == n || (!sb && e->n < n)) &&
            memcmp(e->ids, all, (size_t)e->n * sizeof(int32_t)) == 0) {
            side_drop(d, i);
            i--;
        }
    }
    sidecar_entry *e = side_entry_new(d, n, false, sb, bytes);
    if (e == NULL) return;
    if (!side_entry_pin(d, e, &s->seq, n)) {
        side_entry_discard(d, e);
        return;
    }
    if (sb) memcpy(e->state, state, sb);
    side_entry_add(d, e, s->salt, all, n, bytes);
    d->side_writes++;
    side_to_disk(d, e); /* the SSD mirror: its rows copied now, written by the disk's writers */
}

/* Under the lock: what of all[0, n) s's draft model holds with a state to
 * match, stored. */
static void draft_side_store(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t n) {
    int64_t have = s->seq.n_tokens < n ? s->seq.n_tokens : n, keep = 0;
    while (keep < have && s->seen[keep] == all[keep]) keep++;
    if (s->state == NULL) {
        draft_side_put(d, s, all, keep, NULL);
        return;
    }
    if (s->seq.n_tokens == keep) { /* the live state stands at keep */
        void *snap = malloc(model_state_bytes(d->cfg.draft));
        if (snap == NULL) return;
        model_state_snapshot(s->state, snap);
        draft_side_put(d, s, all, keep, snap);
        free(snap);
    } else if (s->snap_pos > 0 && s->snap_pos <= keep) {
        draft_side_put(d, s, all, s->snap_pos, s->snap);
    }
}

/* Under the lock: the first draft of a request whose draft model holds
 * nothing adopts the longest usable entry for all[0, want). */
static void draft_side_restore(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t want) {
    int best = -1;
    int64_t best_n = 0;
    for (int i = 0; i < d->n_side; i++) {
        const sidecar_entry *e = d->side[i];
        if (e->salt != s->salt) continue;
        int64_t l = 0, lim = e->n < want ? e->n : want;
        while (l < lim && e->ids[l] == all[l]) l++;
        if (s->state && l != e->n) continue; /* a state stands at its own length only */
        if (l > best_n) {
            best_n = l;
            best = i;
        }
    }
    if (best < 0) return;
    sidecar_entry *e = d->side[best];
    ember_error err;
    int32_t n_blocks = (int32_t)((best_n + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS);
    for (int32_t b = 0; b < n_blocks; b++)
        if (kv_seq_adopt_block(d->pool, &s->seq, e->seq.blocks[b], &err) < 0) {
            kv_seq_release(d->pool, &s->seq);
            return;
        }
    kv_seq_truncate(d->pool, &s->seq, best_n);
    if (s->state && model_state_restore(s->state, e->state, model_state_bytes(d->cfg.draft), &err) < 0) {
        kv_seq_release(d->pool, &s->seq);
        model_state_reset(s->state);
        return;
    }
    for (int64_t p = 0; p < best_n; p++)
        if (remember(s, p, all[p]) < 0) {
            kv_seq_release(d->pool, &s->seq);
            if (s->state) model_state_reset(s->state);
            return;
        }
    e->used = ++d->side_clock;
    d->side_hits++;
    d->side_rows += best_n;
}

/* Under the lock: a memory entry of n rows (and the state) from a draft
 * model's side file. */
static void draft_side_from_rows(spec_drafter *d, uint64_t salt, const int32_t *tokens, int64_t n,
                                 const uint32_t *rows, const void *state) {
    size_t sb = d->owner.state_bytes;
    int32_t n_blocks = (int32_t)((n + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS);
    size_t bytes = (size_t)n * sizeof(int32_t) + (size_t)n_blocks * kv_pool_block_bytes(d->pool) + sb;
    if (n < 1 || bytes > d->cfg.sidecar_bytes || (sb && state == NULL)) return;
    sidecar_entry *e = side_entry_new(d, n, false, sb, bytes);
    if (e == NULL) return;
    if (!side_entry_reserve(d, e, n)) {
        side_entry_discard(d, e);
        return;
    }
    for (int64_t t = 0; t < n; t++) side_row_in(d, &e->seq, t, rows + (size_t)t * d->side_words);
    e->seq.n_tokens = n;
    if (sb) memcpy(e->state, state, sb);
    side_entry_add(d, e, salt, tokens, n, bytes);
    d->side_disk_loads++;
}

/* A miss of the draft model's memory sidecar for the prompt tokens[0, n)
 * (nothing there serves a longer prefix than the disk might): the longest
 * side file of this draft model that does, brought into memory, where the
 * request's first draft adopts it (draft_side_restore). Off the engine
 * thread; the disk read runs without the lock. */
static void draft_side_prefetch(spec_drafter *d, const int32_t *tokens, int64_t n, uint64_t salt) {
    if (n < 1) return;
    bool recurrent = d->owner.state_bytes > 0;
    int64_t best = 0;
    pthread_mutex_lock(&d->lock);
    for (int i = 0; i < d->n_side; i++) { /* what draft_side_restore would adopt */
        const sidecar_entry *e = d->side[i];
        if (e->salt != salt) continue;
        int64_t l = 0, lim = e->n < n ? e->n : n;
        while (l < lim && e->ids[l] == tokens[l]) l++;
        if (recurrent && l != e->n) continue;
        if (l > best) best = l;
    }
    pthread_mutex_unlock(&d->lock);
    if (best >= n) return;
    void *state = NULL;
    int64_t got_n = 0;
    uint32_t *rows = apc_side_load(d->cache, salt, &d->owner, tokens, best + 1, n, d->side_words, &state, &got_n);
    if (rows == NULL) return;
    pthread_mutex_lock(&d->lock);
    draft_side_from_rows(d, salt, tokens, got_n, rows, state);
    pthread_mutex_unlock(&d->lock);
    free(rows);
    free(state);
}

void spec_sidecar_store(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t n) {
    if (d->cfg.kind == SPEC_DRAFT && d->cfg.sidecar_entries > 0 && n > 0) {
        pthread_mutex_lock(&d->lock);
        if (s->seq.n_tokens == 0 && !s->looked) s->side_pending = n; /* post-prefill: at the first draft */
        else draft_side_store(d, s, all, n);
        pthread_mutex_unlock(&d->lock);
        return;
    }
    if (d->cfg.kind != SPEC_MTP || d->cfg.sidecar_entries < 1 || n < 1) return;
    pthread_mutex_lock(&d->lock);
    if (n > s->mtp_done) n = s->mtp_done;
    if (!s->faithful || n < 1 || s->hist == NULL) goto done;
    const size_t D = (size_t)d->n_embd;
    int32_t n_blocks = (int32_t)((n + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS);
    size_t bytes = (size_t)n * (D * sizeof(float) + sizeof(int32_t)) + (size_t)n_blocks * kv_pool_block_bytes(d->pool);
    if (bytes > d->cfg.sidecar_bytes) goto done;
    /* An entry this one extends (or equals) is replaced. */
    for (int i = 0; i < d->n_side; i++) {
        sidecar_entry *e = d->side[i];
        if (e->salt == s->salt && e->n <= n && memcmp(e->ids, all, (size_t)e->n * sizeof(int32_t)) == 0) {
            side_drop(d, i);
            i--;
        }
    }
    sidecar_entry *e = side_entry_new(d, n, true, 0, bytes);
    if (e == NULL) goto done;
    if (!side_entry_pin(d, e, &s->seq, n)) {
        side_entry_discard(d, e);
        goto done;
    }
    memcpy(e->hidden, s->hist, (size_t)n * D * sizeof(float));
    side_entry_add(d, e, s->salt, all, n, bytes);
    d->side_writes++;
    side_to_disk(d, e);
done:
    pthread_mutex_unlock(&d->lock);
}

/* The head state for exactly all[0, p0) from an entry that extends it, into
 * a request whose head holds nothing yet. Returns whether it was restored. */
static bool side_restore(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t p0) {
    const size_t D = (size_t)d->n_embd;
    for (int i = 0; i < d->n_side; i++) {
        sidecar_entry *e = d->side[i];
        if (e->salt != s->salt || e->n < p0 || memcmp(e->ids, all, (size_t)p0 * sizeof(int32_t)) != 0) continue;
        ember_error err;
        int32_t n_blocks = (int32_t)((p0 + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS);
        kv_seq_release(d->pool, &s->seq);
        for (int32_t b = 0; b < n_blocks; b++)
            if (kv_seq_adopt_block(d->pool, &s->seq, e->seq.blocks[b], &err) < 0) {
                kv_seq_release(d->pool, &s->seq);
                return false;
            }
        kv_seq_truncate(d->pool, &s->seq, p0);
        for (int64_t p = 0; p < p0; p++)
            if (hist_put(d, s, p, e->hidden + (size_t)p * D) < 0) {
                kv_seq_release(d->pool, &s->seq);
                return false;
            }
        memcpy(s->h_last, e->hidden + (size_t)(p0 - 1) * D, D * sizeof(float));
        s->mtp_done = p0;
        e->used = ++d->side_clock;
        d->side_hits++;
        d->side_rows += p0;
        return true;
    }
    return false;
}

spec_sidecar_stats spec_sidecar_get_stats(spec_drafter *d) {
    pthread_mutex_lock(&d->lock);
    spec_sidecar_stats st = {d->side_writes, d->side_hits, d->n_side, d->side_disk_writes, d->side_disk_loads,
                             d->side_rows, d->draft_rows, d->side_bytes};
    pthread_mutex_unlock(&d->lock);
    return st;
}

/* ---- Prompt lookup ---- */

/* The continuation of the most recent earlier occurrence of the last n
 * tokens of all[0, n_all), longest n first. */
static int lookup_draft(const spec_config *cfg, const int32_t *all, int64_t n_all, int k, int32_t *out) {
    for (int n = cfg->ngram_max; n >= cfg->ngram_min; n--) {
        if (n_all <= n) continue;
        const int32_t *tail = all + n_all - n;
        /* an occurrence at j must end before the tail starts */
        for (int64_t j = n_all - n - 1; j >= 0; j--) {
            if (all[j] != tail[0] || memcmp(all + j, tail, (size_t)n * sizeof(int32_t)) != 0) continue;
            int got = 0;
            for (int64_t i = j + n; i < n_all && got < k; i++) out[got++] = all[i];
            if (got > 0) return got;
        }
    }
    return 0;
}

/* ---- Draft model ---- */

static int remember(spec_seq *s, int64_t pos, int32_t token) {
    if (pos >= s->cap) {
        int64_t cap = s->cap ? s->cap * 2 : 1024;
        while (cap <= pos) cap *= 2;
        int32_t *seen = realloc(s->seen, (size_t)cap * sizeof(int32_t));
        if (seen == NULL) return -1;
        s->seen = seen;
        s->cap = cap;
    }
    s->seen[pos] = token;
    return 0;
}

/* Forwards tokens [0, n) at the draft sequence's end, no logits needed. */
static int draft_forward(spec_drafter *d, spec_seq *s, const int32_t *tokens, int64_t n) {
    ember_error err;
    for (int64_t done = 0; done < n;) {
        int64_t len = n - done < d->max_batch ? n - done : d->max_batch;
        for (int64_t i = 0; i < len; i++)
            if (remember(s, s->seq.n_tokens + i, tokens[done + i]) < 0) return -1;
        if (model_eval_state(d->ctx, &s->seq, s->state, tokens + done, (int)len, false, s->logits, &err) < 0) return -1;
        d->draft_rows += len;
        done += len;
    }
    return 0;
}

static int argmax_row(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* Brings the draft sequence to all[0, n-1): keeps what it saw that was
 * committed, restores or resets a recurrent state that went further. */
static int draft_catch_up(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t n) {
    int64_t want = n - 1;
    if (!s->looked && s->seq.n_tokens == 0 && d->cfg.sidecar_entries > 0) draft_side_restore(d, s, all, want);
    s->looked = true;
    /* Sidecar entries pin blocks of the draft pool: they give them back
     * before the draft model runs short (a draft step needs the rest of
     * the prompt, k rows and a copied partial block). */
    int64_t need = (want + SPEC_MAX_K + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS - s->seq.n_blocks + 1;
    while (d->n_side > 0 && kv_pool_n_free(d->pool) < need) side_evict_lru(d);
    int64_t have = s->seq.n_tokens, keep = 0;
    while (keep < have && keep < want && s->seen[keep] == all[keep]) keep++;
    if (keep < have) {
        if (s->state == NULL) {
            kv_seq_truncate(d->pool, &s->seq, keep);
        } else if (s->snap_pos >= 0 && s->snap_pos <= keep) {
            ember_error err;
            if (model_state_restore(s->state, s->snap, model_state_bytes(d->cfg.draft), &err) < 0) return -1;
            kv_seq_truncate(d->pool, &s->seq, s->snap_pos);
        } else { /* no snapshot at or before keep: start over, forward the kept tokens again */
            model_state_reset(s->state);
            kv_seq_release(d->pool, &s->seq);
            s->stats.replays++;
        }
    }
    int64_t from = s->seq.n_tokens;
    if (from < want) {
        double t0 = ember_now();
        if (draft_forward(d, s, all + from, want - from) < 0) return -1;
        /* The prompt, or what a pause skipped: a one-off the governor times
         * apart. Any other catch-up (the rounds a request spent at k = 0)
         * is part of what speculating costs. */
        if (s->catch_one_off || from == 0) {
            s->round_catch_s += ember_now() - t0;
            s->round_catch_rows += want - from;
        }
    }
    s->catch_one_off = false;
    if (s->state && !d->no_snapshots) {
        model_state_snapshot(s->state, s->snap);
        s->snap_pos = s->seq.n_tokens;
    }
    if (s->side_pending > 0 && s->seq.n_tokens >= s->side_pending) { /* the post-prefill store */
        draft_side_store(d, s, all, s->side_pending);
        s->side_pending = 0;
    }
    return 0;
}

static int model_draft(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t n, int k, int32_t *out) {
    if (draft_catch_up(d, s, all, n) < 0) return 0;
    int32_t x = all[n - 1];
    int got = 0;
    ember_error err;
    while (got < k) {
        if (remember(s, s->seq.n_tokens, x) < 0 ||
            model_eval_state(d->ctx, &s->seq, s->state, &x, 1, false, s->logits, &err) < 0)
            break;
        d->draft_rows++;
        x = argmax_row(s->logits, d->n_vocab);
        out[got++] = x;
    }
    return got;
}

/* ---- MTP head ---- */

/* Head rows for positions [p0, p0+n) of all: row p reads token p and the
 * target hidden row of p-1 (h_last for the first, then hidden's rows, or
 * zeros when hidden is NULL). Leaves h_last at the last input row's
 * successor: hidden's last row (or zeros). */
static int mtp_rows(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t p0, int64_t n, const float *hidden,
                    bool from_hist) {
    const size_t D = (size_t)d->n_embd;
    ember_error err;
    for (int64_t done = 0; done < n;) {
        int64_t len = n - done < d->max_batch ? n - done : d->max_batch;
        for (int64_t i = 0; i < len; i++) {
            int64_t at = done + i; /* the hidden row of p0 + at - 1 */
            const float *h = at == 0 ? s->h_last : hidden ? hidden + (size_t)(at - 1) * D : NULL;
            if (h) memcpy(s->h_prev + (size_t)i * D, h, D * sizeof(float));
            else memset(s->h_prev + (size_t)i * D, 0, D * sizeof(float));
        }
        if (model_mtp_eval(d->ctx, &s->seq, all + p0 + done, (int)len, s->h_prev, NULL, NULL, &err) < 0)
            return -1;
        done += len;
    }
    for (int64_t i = 0; i < n && !from_hist; i++) /* from_hist: hidden is hist's own rows */
        if (hist_put(d, s, p0 + i, hidden ? hidden + (size_t)i * D : NULL) < 0) return -1;
    if (hidden) memcpy(s->h_last, hidden + (size_t)(n - 1) * D, D * sizeof(float));
    else {
        memset(s->h_last, 0, D * sizeof(float));
        s->faithful = false; /* rows read zeros where the target's hidden rows were */
    }
    s->mtp_done = p0 + n;
    return 0;
}

/* The head starts over at the next observation (its pool had no room). */
static void mtp_start_over(spec_drafter *d, spec_seq *s) {
    kv_seq_release(d->pool, &s->seq);
    memset(s->h_last, 0, (size_t)d->n_embd * sizeof(float));
    s->mtp_done = 0;
    s->obs_done = 0;
    s->faithful = false;
}

/* Under the lock: the head's rows of the positions observed while
 * speculation was paused, in one batched pass over the kept hidden rows
 * (the same bits the eager pass computes: row p reads token p and the
 * hidden row of p-1, zeros where the target's row was never seen). */
static int mtp_flush(spec_drafter *d, spec_seq *s) {
    if (s->obs_done <= s->mtp_done) return 0;
    const int64_t p0 = s->mtp_done, n = s->obs_done - p0;
    kv_seq_truncate(d->pool, &s->seq, p0); /* the last draft's speculative rows */
    for (;;) {
        if (mtp_rows(d, s, s->seen, p0, n, s->hist + (size_t)p0 * (size_t)d->n_embd, true) == 0) return 0;
        kv_seq_truncate(d->pool, &s->seq, p0);
        if (d->n_side == 0) break;
        side_evict_lru(d); /* sidecar entries give their blocks back first */
    }
    mtp_start_over(d, s);
    return -1;
}

/* Under the lock, while the governor holds speculation paused: keeps the
 * hidden rows and tokens of all[p0, p0+n) (a gap before p0, never
 * forwarded here, as zero rows) for a later mtp_flush instead of running
 * the head now. Returns -1 when out of memory (then the caller runs it). */
static int mtp_keep(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t p0, int64_t n, const float *hidden) {
    const size_t D = (size_t)d->n_embd;
    int64_t from = s->obs_done > s->mtp_done ? s->obs_done : s->mtp_done;
    for (int64_t p = from; p < p0 + n; p++) {
        const float *row = p < p0 ? NULL : hidden + (size_t)(p - p0) * D;
        if (remember(s, p, all[p]) < 0 || hist_put(d, s, p, row) < 0) return -1;
        if (row == NULL) s->faithful = false; /* as the eager pass: zeros where the target's rows were */
        s->obs_done = p + 1;
    }
    return 0;
}

bool spec_drafter_wants_hidden(const spec_drafter *d) { return d->cfg.kind == SPEC_MTP; }

size_t spec_state_words(const spec_drafter *d) { return d->cfg.kind == SPEC_MTP ? d->side_words : 0; }

uint32_t *spec_export(spec_drafter *d, spec_seq *s, int64_t n) {
    if (d->cfg.kind != SPEC_MTP || n < 1) return NULL;
    pthread_mutex_lock(&d->lock);
    uint32_t *rows = NULL;
    mtp_flush(d, s);
    if (s->faithful && s->mtp_done >= n && s->hist_cap >= n && s->seq.n_tokens >= n &&
        (rows = malloc((size_t)n * d->side_words * sizeof(uint32_t))) != NULL) {
        sidecar_entry view; /* s's rows seen as an entry */
        memset(&view, 0, sizeof view);
        view.n = n;
        view.seq = s->seq;
        view.hidden = s->hist;
        side_rows_out(d, &view, rows);
    }
    pthread_mutex_unlock(&d->lock);
    return rows;
}

void spec_import(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t n, const uint32_t *rows) {
    if (d->cfg.kind != SPEC_MTP || n < 1) return;
    const size_t D = (size_t)d->n_embd;
    pthread_mutex_lock(&d->lock);
    if (s->mtp_done != 0 || s->seq.n_tokens != 0) {
        pthread_mutex_unlock(&d->lock);
        return;
    }
    ember_error err;
    int rc = kv_seq_prepare_append(d->pool, &s->seq, n, &err);
    while (rc < 0 && d->n_side > 0) { /* sidecar entries give their blocks back first */
        side_evict_lru(d);
        rc = kv_seq_prepare_append(d->pool, &s->seq, n, &err);
    }
    for (int64_t t = 0; rc == 0 && t < n; t++) {
        const uint32_t *row = side_row_in(d, &s->seq, t, rows + (size_t)t * d->side_words);
        if (hist_put(d, s, t, (const float *)row) < 0) rc = -1;
    }
    if (rc == 0) {
        s->seq.n_tokens = n;
        memcpy(s->h_last, s->hist + (size_t)(n - 1) * D, D * sizeof(float));
        s->mtp_done = n;
        s->looked = true;
        d->side_rows += n;
        pthread_mutex_unlock(&d->lock);
        return;
    }
    kv_seq_release(d->pool, &s->seq);
    pthread_mutex_unlock(&d->lock);
    /* No room for the rows: the head computes them from the hidden rows. */
    float *hidden = malloc((size_t)n * D * sizeof(float));
    if (hidden == NULL) return;
    for (int64_t t = 0; t < n; t++)
        memcpy(hidden + (size_t)t * D, rows + (size_t)t * d->side_words + (d->side_words - D), D * sizeof(float));
    spec_observe(d, s, all, 0, n, hidden);
    free(hidden);
}

void spec_observe(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t p0, int64_t n, const float *hidden) {
    if (d->cfg.kind != SPEC_MTP || n <= 0) return;
    pthread_mutex_lock(&d->lock);
    if (p0 < s->mtp_done || p0 < s->obs_done) { /* not expected: start over from p0's gap */
        kv_seq_release(d->pool, &s->seq);
        memset(s->h_last, 0, (size_t)d->n_embd * sizeof(float));
        s->mtp_done = 0;
        s->obs_done = 0;
    }
    kv_seq_truncate(d->pool, &s->seq, s->mtp_done); /* the last draft's speculative rows */
    /* First sight of a request whose target prefix came from the cache:
     * the sidecar may hold the head for exactly that prefix. */
    if (!s->looked && s->mtp_done == 0 && p0 > 0 && d->cfg.sidecar_entries > 0) side_restore(d, s, all, p0);
    s->looked = true;
    /* Paused: nothing drafts, so the head need not run yet (top comment). */
    if (d->cfg.adaptive && d->paused && mtp_keep(d, s, all, p0, n, hidden) == 0) {
        pthread_mutex_unlock(&d->lock);
        return;
    }
    int rc = mtp_flush(d, s);
    for (; rc == 0;) {
        if (s->mtp_done < p0) rc = mtp_rows(d, s, all, s->mtp_done, p0 - s->mtp_done, NULL, false);
        if (rc == 0) rc = mtp_rows(d, s, all, p0, n, hidden, false);
        if (rc == 0 || d->n_side == 0) break;
        /* the head's pool is full: sidecar entries give their blocks back first */
        kv_seq_truncate(d->pool, &s->seq, s->mtp_done);
        side_evict_lru(d);
        rc = 0;
    }
    if (rc < 0) mtp_start_over(d, s); /* pool full: the head starts over at the next observation */
    pthread_mutex_unlock(&d->lock);
}

static int mtp_draft(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t n, int k, int32_t *out) {
    int64_t behind = s->obs_done - s->mtp_done;
    double t0 = ember_now();
    if (mtp_flush(d, s) < 0) return 0;
    if (behind > 0) { /* what a pause skipped: a one-off the governor times apart */
        s->round_catch_s += ember_now() - t0;
        s->round_catch_rows += behind;
    }
    if (s->mtp_done != n - 1) return 0; /* the head has not seen the target's row of n-2 */
    ember_error err;
    kv_seq_truncate(d->pool, &s->seq, s->mtp_done);
    int32_t x = all[n - 1];
    const float *h = s->h_last;
    int got = 0;
    while (got < k) {
        if (model_mtp_eval(d->ctx, &s->seq, &x, 1, h, s->logits, s->y, &err) < 0) break;
        x = argmax_row(s->logits, d->n_vocab);
        out[got++] = x;
        h = s->y;
    }
    return got;
}

/* ---- Drafting ---- */

static int draft_any(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t n, int k, int32_t *out) {
    switch (d->cfg.kind) {
    case SPEC_LOOKUP: return lookup_draft(&d->cfg, all, n, k, out);
    case SPEC_DRAFT:
    case SPEC_MTP: {
        pthread_mutex_lock(&d->lock);
        int got = d->cfg.kind == SPEC_DRAFT ? model_draft(d, s, all, n, k, out) : mtp_draft(d, s, all, n, k, out);
        pthread_mutex_unlock(&d->lock);
        return got;
    }
    default: return 0;
    }
}

int spec_draft(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t n, int k, int32_t *out) {
    if (k > SPEC_MAX_K) k = SPEC_MAX_K;
    if (k < 1 || n < 1) return 0;
    int got = draft_any(d, s, all, n, k, out);
    if (s->stats.digest == 0) s->stats.digest = 14695981039346656037ull;
    for (int i = 0; i < got; i++) {
        uint64_t v[2] = {(uint64_t)(n + i), (uint64_t)(uint32_t)out[i]};
        for (int w = 0; w < 2; w++)
            for (int byte = 0; byte < 8; byte++) s->stats.digest = (s->stats.digest ^ ((v[w] >> (8 * byte)) & 0xff)) * 1099511628211ull;
    }
    return got;
}

/* Folds one round's wall time into the governor and decides whether the
 * next rounds speculate (see the top comment). */
static void govern(spec_drafter *d, spec_seq *s, int drafted, int accepted) {
    double now = ember_now(), t_prev = s->t_last, catch_s = s->round_catch_s;
    if (s->round_catch_rows > 0) {
        d->catch_s += catch_s;
        d->catch_rows += s->round_catch_rows;
        d->account.catch_s += catch_s;
        d->account.catch_rows += s->round_catch_rows;
    }
    s->t_last = now;
    s->round_catch_s = 0;
    s->round_catch_rows = 0;
    if (t_prev <= 0) return;
    double round_s = now - t_prev - catch_s;
    if (round_s < 0) round_s = 0;
    const int tokens = accepted + 1;
    if (drafted == 0) {
        d->account.plain_rounds++;
        if (d->paused) d->account.paused_rounds++;
    } else {
        d->account.spec_rounds++;
        d->account.spec_tokens += tokens;
        d->account.spec_s += round_s;
        if (d->plain_win.n > 0) d->account.spec_extra_s += round_s - tokens * window_median(&d->plain_win);
    }
    if (drafted == 0) {
        window_add(&d->plain_win, round_s / tokens);
        d->since_plain = 0;
        if (d->paused) d->paused_rounds++;
    } else {
        window_add(&d->spec_win, round_s / tokens);
        d->since_plain++;
        d->measure_tokens += tokens;
        d->measure_s += round_s;
    }
    if (d->measuring) {
        if (d->spec_win.n < SPEC_SAMPLES || d->plain_win.n < SPEC_SAMPLES) return;
        d->measuring = false;
    } else if (drafted == 0 || d->paused || d->spec_win.n < SPEC_SAMPLES || d->plain_win.n == 0) {
        return;
    }
    /* A verdict: at the end of a measurement, and between measurements after
     * every speculative round (its last rounds against the last plain ones),
     * so that a drafter whose acceptance drops stops at once. */
    double spec_cost = window_median(&d->spec_win), plain_cost = window_median(&d->plain_win);
    if (spec_cost > plain_cost * SPEC_KEEP_BELOW) {
        d->paused = true;
        d->paused_rounds = 0;
        d->probe_s = d->measure_s - plain_cost * (double)d->measure_tokens; /* what it cost beyond plain */
        if (d->probe_s < 0) d->probe_s = 0;
        if (d->failed < SPEC_BACKOFF_MAX) d->failed++;
        d->pauses++;
        d->account.pauses++;
        s->stats.paused++;
    } else {
        d->failed = 0;
    }
    d->measure_tokens = 0;
    d->measure_s = 0;
}

void spec_verified(spec_drafter *d, spec_seq *s, int drafted, int accepted) {
    if (drafted > 0) {
        s->stats.rounds++;
        s->stats.drafted += drafted;
        s->stats.accepted += accepted;
    }
    if (!d->cfg.adaptive) return;
    pthread_mutex_lock(&d->lock);
    govern(d, s, drafted, accepted);
    bool measuring = d->measuring;
    pthread_mutex_unlock(&d->lock);
    if (drafted == 0) {
        if (s->k_now == 0) s->idle_rounds++;
        return;
    }
    if (accepted == drafted) {
        s->k_now = s->k_now * 2 > d->cfg.k ? d->cfg.k : (s->k_now < 1 ? 1 : s->k_now * 2);
    } else if (accepted == 0) {
        /* A measurement keeps drafting (one token a round at least): at
         * k = 0 its speculative samples would come every SPEC_PROBE rounds,
         * and the rounds between would catch the drafter up for nothing. */
        s->k_now = s->k_now / 2 < 1 && measuring ? 1 : s->k_now / 2;
        s->idle_rounds = 0;
    }
}

/* Whether a paused governor measures speculation again now, in a request
 * whose committed tokens are all[0, n): once the plain time since the pause
 * began pays SPEC_PROBE_SHARE of the last measurement's extra plus the
 * catch-up this request's draft model would need. */
static bool probe_due(const spec_drafter *d, const spec_seq *s, int64_t n) {
    if (d->paused_rounds < SPEC_PAUSE_MIN) return false;
    double catch_up = 0;
    int64_t behind = d->cfg.kind == SPEC_DRAFT ? n - 1 - s->seq.n_tokens
                     : d->cfg.kind == SPEC_MTP   ? s->obs_done - s->mtp_done
                                                 : 0;
    /* Before any catch-up was timed, a row is taken to cost a plain round. */
    double row_s = d->catch_rows > 0 ? d->catch_s / (double)d->catch_rows
                   : d->plain_win.n > 0 ? window_median(&d->plain_win)
                                        : 0;
    if (behind > 0) catch_up = (double)behind * row_s;
    /* The plain time since the pause, as rounds times a plain round's median:
     * the rounds' own wall time counts every time slice other processes
     * took, which would let a busy machine buy probes it does not pay for. */
    double paused_s = d->plain_win.n > 0 ? d->paused_rounds * window_median(&d->plain_win) : 0;
    int doublings = d->failed > 1 ? d->failed - 1 : 0;
    return paused_s * SPEC_PROBE_SHARE >= (d->probe_s + catch_up) * (double)(1 << doublings);
}

/* A measurement: the windows emptied, then speculative rounds each
 * followed by a plain one, until each kind has SPEC_SAMPLES; a pair
 * decodes at about the same position, so the longer attention of a later
 * position does not pass for a cost of speculating. */
static void measure_afresh(spec_drafter *d) {
    memset(&d->spec_win, 0, sizeof d->spec_win);
    memset(&d->plain_win, 0, sizeof d->plain_win);
    d->measure_tokens = 0;
    d->measure_s = 0;
    d->since_plain = 0;
    d->measuring = true;
    d->account.measurements++;
}

static int next_k(spec_drafter *d, spec_seq *s, int64_t n) {
    if (s->pause_seen != d->pauses) { /* the draft model's next catch-up covers the pause */
        s->pause_seen = d->pauses;
        s->catch_one_off = true;
    }
    if (d->paused) {
        if (!probe_due(d, s, n)) return 0;
        d->paused = false;
        measure_afresh(d);
        s->k_now = 1; /* a drafter last found losing is probed at the smallest k */
    } else if (!d->measuring && (d->spec_win.n == 0 || d->since_plain >= SPEC_REPLAIN)) {
        if (d->spec_win.n == 0) s->k_now = 1; /* nothing known yet: the first probe too */
        measure_afresh(d); /* the first, then one every SPEC_REPLAIN speculative rounds */
    }
    if (d->measuring && d->since_plain > 0) return 0; /* the plain half of a pair */
    if (s->k_now > 0) return s->k_now;
    return s->idle_rounds >= SPEC_PROBE ? 1 : 0;
}

int spec_next_k(spec_drafter *d, spec_seq *s, int64_t n) {
    if (!d->cfg.adaptive) return d->cfg.k;
    pthread_mutex_lock(&d->lock);
    int k = next_k(d, s, n);
    pthread_mutex_unlock(&d->lock);
    return k;
}

spec_stats spec_seq_stats(const spec_seq *s) { return s->stats; }

spec_governor_stats spec_governor_get_stats(spec_drafter *d) {
    pthread_mutex_lock(&d->lock);
    spec_governor_stats st = d->account;
    st.plain_token_s = d->plain_win.n > 0 ? window_median(&d->plain_win) : 0;
    pthread_mutex_unlock(&d->lock);
    return st;
}

void spec_drafter_refuse_snapshots(spec_drafter *d, bool refuse) { d->no_snapshots = refuse; }

void spec_drafter_hold_paused(spec_drafter *d, bool paused) {
    pthread_mutex_lock(&d->lock);
    d->paused = paused;
    d->paused_rounds = 0;
    d->probe_s = 0;
    pthread_mutex_unlock(&d->lock);
}
