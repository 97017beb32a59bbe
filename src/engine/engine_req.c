/* engine_req.c - one request's driver (see engine_req.h).
 *
 * A request owns its kv_seq, its model_state (recurrent layers), its
 * apc_req and the tokens so far (prompt + reply). The runner asks for rows,
 * forwards them with other requests' rows, and reports back; the driver
 * keeps the order that invariant 1 needs (grid chunks, N-1 alone) and that
 * the cache protocol needs (lookup, stops, prefilled, decode, retire), so
 * neither runner can get it wrong.
 *
 * Retirement stores the tokens whose K/V exist: the prompt and every
 * generated token but the last (sampled, never forwarded). When the cache
 * says one more forward makes the stored sequence more useful, the driver
 * spends it (RETIRE), so that the next turn warm-starts past the whole
 * reply. A retirement on the checkpoint tier is keyed where the next turn's
 * render diverges; that prediction, like the decode ring's, is computed
 * off the engine thread (engine_internal.h) and delivered by
 * engine_req_poll, in the order asked. */
#include "engine/engine_req.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/clock.h"
#include "engine/engine_internal.h"

struct engine_req {
    engine *e;
    apc *cache;
    engine_req_phase phase;
    int step;
    int64_t N;
    int max_tokens;
    int64_t n_ctx;
    int64_t need_blocks;
    uint64_t salt;
    bool lookup;                 /* the request's cache mode looks up */
    bool stores;                 /* ... and stores (the drafter's sidecar follows it) */
    kv_seq seq;
    model_state *state;          /* recurrent layers; else NULL */
    apc_req *ar;
    int32_t *all;                /* (N + max_tokens + 1) prompt + reply */
    int n_gen;
    int64_t cached;
    apc_source source;
    int64_t forwarded;
    int64_t last_rows;           /* rows added by the last engine_req_add_rows */
    double cache_s;
    chat_turn_predictor *predictor;
    bool async;
    int disk_wait_ms;
    engine_fetch_job *fetch;     /* FETCH: shared with a fetch thread */
    double fetch_deadline;
    double rows_added_at;        /* PROMPT: when the chunk being forwarded was added */
    /* predictions in flight, oldest first; the last one may be the retirement's */
    engine_predict_job *pending_head, *pending_tail;
    engine_predict_job *retire_job;
    /* speculative decoding */
    spec_drafter *drafter;       /* borrowed, or NULL */
    spec_seq *spec;
    uint8_t *draft_marks;        /* borrowed, optional: SPEC_MARK_* per generated token */
    int32_t draft[SPEC_MAX_K];   /* the drafts of the current step */
    int n_draft;
    int64_t step_rows;           /* FIRST/DECODE/RETIRE rows decided by engine_req_step_rows */
    int64_t round_p0;            /* sequence length before the step's forward */
    bool round_decode;           /* the step was a DECODE step (not FIRST) */
    int rows_sampled;            /* logit rows of the step sampled so far */
    int round_matched;           /* of those, tokens equal to their draft */
    void *round_snap;            /* recurrent state at round_p0 (model_state_bytes), or NULL */
    bool round_snapped;
    const float *rows_hidden;    /* hidden rows of the step's first row in the runner's batch, or NULL */
    int n_embd;
    /* the prefix layer, L0 (engine_prefix.h) */
    prefix_layer *l0;            /* the engine's, when the request speculates; else NULL */
    bool l0_store;               /* the post-prefill snapshot goes to L0 (the pools will not keep it) */
    void *l0_state_n;            /* recurrent state at N (model_state_bytes), or NULL */
    void *l0_state_n1;           /* ... and at N-1 */
    bool l0_have_n1;
};

/* ---- Lifetime ---- */

engine_req *engine_req_create(engine *e, const engine_req_params *p, ember_error *err) {
    const model *m = engine_model(e);
    const int V = model_get_hparams(m)->n_vocab;
    const int64_t N = p->n_prompt;
    const int n_ctx = engine_n_ctx(e);
    if (N < 1 || p->prompt == NULL) {
        ember_fail(err, "the prompt has no tokens");
        return NULL;
    }
    if (N > n_ctx) {
        ember_fail(err, "This model's maximum context length is %d tokens. However, your prompt has %lld tokens.",
                   n_ctx, (long long)N);
        return NULL;
    }
    for (int64_t i = 0; i < N; i++)
        if (p->prompt[i] < 0 || p->prompt[i] >= V) {
            ember_fail(err, "prompt token %lld is %d, outside the vocabulary of %d", (long long)i, p->prompt[i], V);
            return NULL;
        }
    int max_tokens = p->max_tokens > 0 ? p->max_tokens : 0;
    int64_t longest = N + max_tokens < n_ctx ? N + max_tokens : n_ctx;
    int64_t need = (longest + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS + 1;
    int32_t pool_blocks = kv_pool_n_blocks(engine_pool(e));
    if (need > pool_blocks) {
        ember_fail(err,
                   "the request needs up to %lld KV blocks (%lld prompt + %d new tokens) but the pool has %d "
                   "(cache.num_blocks); lower max_tokens",
                   (long long)need, (long long)N, max_tokens, pool_blocks);
        return NULL;
    }
    engine_req *q = calloc(1, sizeof *q);
    if (q == NULL) {
        ember_fail(err, "out of memory for a request of %lld tokens", (long long)N);
        return NULL;
    }
    q->e = e;
    q->cache = engine_cache(e);
    q->phase = ENGINE_REQ_ADMITTED;
    q->step = p->prefill_step > 0 ? p->prefill_step : engine__prefill_step(e);
    q->N = N;
    q->max_tokens = max_tokens;
    q->n_ctx = n_ctx;
    q->need_blocks = need;
    q->salt = p->salt;
    q->predictor = p->plan.predictor;
    q->async = p->async;
    q->disk_wait_ms = p->disk_wait_ms > 0 ? p->disk_wait_ms : 1000;
    q->lookup = p->cache == ENGINE_CACHE_ON || p->cache == ENGINE_CACHE_LOOKUP;
    q->stores = p->cache == ENGINE_CACHE_ON || p->cache == ENGINE_CACHE_STORE;
    q->n_embd = model_get_hparams(m)->n_embd;
    kv_seq_init(&q->seq);
    q->all = malloc((size_t)(N + max_tokens + 1) * sizeof(int32_t));
    if (q->all == NULL) goto oom;
    q->draft_marks = p->draft_marks;
    if (p->drafter) {
        q->drafter = p->drafter;
        q->spec = spec_seq_create(p->drafter, p->salt, err);
        if (q->spec == NULL) goto fail;
        if (model_has_state(m) && (q->round_snap = malloc(model_state_bytes(m))) == NULL) goto oom;
        /* L0 keeps what the pools will not: with the cache on they hold the
         * prompt (and the sidecar the drafter), so only a tier-none cache
         * stores here (engine_prefix.c). */
        q->l0 = prefix_layer_on(engine_prefix(e)) ? engine_prefix(e) : NULL;
        q->l0_store = q->l0 && q->stores && apc_get_tier(q->cache) == APC_TIER_NONE;
        if (q->l0_store && model_has_state(m) &&
            ((q->l0_state_n = malloc(model_state_bytes(m))) == NULL ||
             (q->l0_state_n1 = malloc(model_state_bytes(m))) == NULL))
            goto oom;
    }
    memcpy(q->all, p->prompt, (size_t)N * sizeof(int32_t));
    if (model_has_state(m)) {
        q->state = model_state_create(m, err);
        if (q->state == NULL) goto fail;
    }
    apc_req_params ap;
    memset(&ap, 0, sizeof ap);
    ap.prompt = q->all;
    ap.n_prompt = N;
    ap.salt = p->salt;
    ap.prefill_step = q->step;
    ap.lookup = p->cache == ENGINE_CACHE_ON || p->cache == ENGINE_CACHE_LOOKUP;
    ap.store = p->cache == ENGINE_CACHE_ON || p->cache == ENGINE_CACHE_STORE;
    ap.hints.turn_pos = p->plan.turn_pos;
    ap.hints.anchor_pos = p->plan.anchor_pos;
    ap.hints.predicts = p->plan.predictor != NULL;
    q->ar = apc_req_create(q->cache, &ap); /* NULL (out of memory): the cache ignores the request */
    return q;
oom:
    ember_fail(err, "out of memory for a request of %lld tokens", (long long)N);
fail:
    engine_req_free(q);
    return NULL;
}

static void drop_pending(engine_req *q) {
    while (q->pending_head) {
        engine_predict_job *j = q->pending_head;
        q->pending_head = j->next_pending;
        engine__predict_cancel(q->e, j);
        free(j->tokens);
        free(j);
    }
    q->pending_tail = NULL;
    q->retire_job = NULL;
}

void engine_req_free(engine_req *q) {
    if (q == NULL) return;
    drop_pending(q);
    engine__fetch_unref(q->fetch); /* a read still running finishes on its own */
    apc_req_free(q->ar);
    if (q->spec) spec_seq_free(q->drafter, q->spec);
    free(q->round_snap);
    free(q->l0_state_n);
    free(q->l0_state_n1);
    model_state_free(q->state);
    apc_seq_release(q->cache, &q->seq);
    free(q->all);
    free(q);
}

/* ---- Admission ---- */

int64_t engine_req_need_blocks(const engine_req *q) { return q->need_blocks; }

bool engine_req_serial(const engine_req *q) { return apc_req_serial(q->ar); }

bool engine_req_fresh_hold(const engine_req *q, engine_req *const *earlier, int n, int fresh_min, char *reason,
                           size_t reason_cap) {
    if (fresh_min < 1 || q->ar == NULL || apc_req_serial(q->ar)) return false;
    int64_t shared = 0;
    bool passing = false; /* a progressive storer has not passed the shared prefix yet */
    for (int i = 0; i < n; i++) {
        const engine_req *o = earlier[i];
        if (o == q || o->phase > ENGINE_REQ_FIRST) continue; /* its prompt is stored */
        int64_t l = chat_token_common_prefix(q->all, q->N - 1, o->all, o->N);
        if (l > shared) shared = l;
        if (l >= fresh_min && apc_req_progressive(o->ar) && o->seq.n_tokens < l) passing = true;
    }
    if (shared < fresh_min) return false;
    int64_t covered = apc_peek(q->cache, q->all, q->N, q->salt);
    /* A progressive storer's prefix lands piece by piece: wait until it has
     * passed the whole shared part, not only until fresh_min are left. */
    if (shared - covered < fresh_min && !(passing && shared - covered >= KV_BLOCK_TOKENS)) return false;
    snprintf(reason, reason_cap, "shares %lld uncached prompt tokens with an earlier request (%lld cached)",
             (long long)(shared - covered), (long long)covered);
    return true;
}

/* The state at N-1 for L0 (an identical resend adopts N-1). */
static void l0_note_n1(engine_req *q) {
    if (q->l0_state_n1 && q->seq.n_tokens == q->N - 1) {
        model_state_snapshot(q->state, q->l0_state_n1);
        q->l0_have_n1 = true;
    }
}

static void to_prompt_phase(engine_req *q) {
    l0_note_n1(q);
    q->phase = q->seq.n_tokens < q->N - 1 ? ENGINE_REQ_PROMPT : ENGINE_REQ_FIRST;
}

void engine_req_fetch(engine_req *q) {
    assert(q->phase == ENGINE_REQ_ADMITTED);
    if (!q->lookup || !(apc_has_disk(q->cache) || apc_has_remote(q->cache)) || q->N < 2) return;
    if (!q->async) {
        double t = ember_now();
        int64_t p = apc_prefetch(q->cache, q->all, q->N, q->salt);
        if (q->stores || q->lookup) spec_sidecar_prefetch(q->drafter, q->all, p, q->N, q->salt);
        q->cache_s += ember_now() - t;
        return;
    }
    engine_fetch_job *j = calloc(1, sizeof *j);
    int32_t *copy = j ? malloc((size_t)q->N * sizeof(int32_t)) : NULL;
    if (copy == NULL) { /* no read: the lookup finds what memory holds */
        free(j);
        return;
    }
    memcpy(copy, q->all, (size_t)q->N * sizeof(int32_t));
    j->cache = q->cache;
    j->drafter = q->drafter;
    j->tokens = copy;
    j->n = q->N;
    j->salt = q->salt;
    atomic_init(&j->done, false);
    atomic_init(&j->refs, 1);
    q->fetch = j;
    /* The remote tier bounds its reads itself (a share of the cold prefill
     * cost); the wait covers them, plus a margin for the last copy. */
    int wait_ms = q->disk_wait_ms;
    int remote_ms = apc_fetch_wait_ms(q->cache, q->N);
    if (remote_ms > 0 && remote_ms + 100 > wait_ms) wait_ms = remote_ms + 100;
    q->fetch_deadline = ember_now() + wait_ms / 1000.0;
    q->phase = ENGINE_REQ_FETCH;
    engine__fetch_submit(q->e, j);
}

bool engine_req_fetch_ready(engine_req *q, bool *expired) {
    if (expired) *expired = false;
    if (q->phase != ENGINE_REQ_FETCH) return true;
    bool done = atomic_load(&q->fetch->done);
    if (!done && ember_now() < q->fetch_deadline) return false;
    if (expired) *expired = !done;
    engine__fetch_unref(q->fetch);
    q->fetch = NULL;
    q->phase = ENGINE_REQ_ADMITTED;
    return true;
}

apc_hit engine_req_lookup(engine_req *q) {
    assert(q->phase == ENGINE_REQ_ADMITTED); /* a FETCH leaves through engine_req_fetch_ready */
    double t = ember_now();
    apc_hit hit = {0, APC_SOURCE_NONE};
    /* L0 first; the pools when they hold more (memory only: the SSD and
     * remote tiers' reads have landed in it by now). */
    int64_t p0 = q->l0 && q->lookup ? prefix_peek(q->l0, q->all, q->N, q->salt) : 0;
    if (p0 > 0 && p0 >= apc_peek(q->cache, q->all, q->N, q->salt)) {
        prefix_hit ph = prefix_lookup(q->l0, q->all, q->N, q->salt, &q->seq, q->state);
        if (ph.n_tokens > 0) {
            apc_req_adopted(q->ar, &q->seq, ph.n_tokens);
            /* The MTP head gets its rows of the prefix back: the cold
             * run's bits, so the cold run's drafts. */
            if (ph.drafter) spec_import(q->drafter, q->spec, q->all, ph.n_tokens, ph.drafter);
            free(ph.drafter);
            hit.n_tokens = ph.n_tokens;
            hit.source = APC_SOURCE_PREFIX;
        }
    }
    if (hit.source == APC_SOURCE_NONE) hit = apc_req_lookup(q->ar, &q->seq, q->state);
    q->cache_s += ember_now() - t;
    q->cached = hit.n_tokens;
    q->source = hit.source;
    to_prompt_phase(q);
    return hit;
}

/* ---- Rows ---- */

engine_req_phase engine_req_get_phase(const engine_req *q) { return q->phase; }

int64_t engine_req_prompt_chunk(const engine_req *q, int64_t allow) {
    if (q->phase != ENGINE_REQ_PROMPT) return 0;
    int64_t p = q->seq.n_tokens, end = (p / q->step + 1) * q->step;
    if (end > q->N - 1) end = q->N - 1;
    int64_t stop = apc_req_next_stop(q->ar, p); /* a scheduled store */
    if (stop < end) end = stop;
    if (end - p > allow) end = (p + allow) / KV_BLOCK_TOKENS * KV_BLOCK_TOKENS;
    return end > p ? end - p : 0;
}

/* Committed tokens: the prompt and every generated token. */
static int64_t committed(const engine_req *q) { return q->N + q->n_gen; }

int64_t engine_req_step_rows(engine_req *q, int64_t allow) {
    int64_t pending = committed(q) - q->seq.n_tokens, rows = 0;
    q->n_draft = 0;
    switch (q->phase) {
    case ENGINE_REQ_FIRST: rows = 1; break;
    case ENGINE_REQ_RETIRE: rows = q->step_rows; break;
    case ENGINE_REQ_DECODE: {
        rows = pending;
        if (q->drafter == NULL || allow <= pending) break;
        /* Drafts stay inside the context and the reply's admitted length
         * (so inside the request's reserved blocks). */
        int64_t k = spec_next_k(q->drafter, q->spec, committed(q));
        if (k > allow - pending) k = allow - pending;
        if (k > q->n_ctx - committed(q)) k = q->n_ctx - committed(q);
        if (k > q->max_tokens - q->n_gen - 1) k = q->max_tokens - q->n_gen - 1;
        if (k > 0) q->n_draft = spec_draft(q->drafter, q->spec, q->all, committed(q), (int)k, q->draft);
        rows += q->n_draft;
        break;
    }
    default: assert(!"no step rows in this phase"); break;
    }
    if (rows > allow) {
        q->n_draft = 0;
        return 0;
    }
    q->step_rows = rows;
    return rows;
}

int engine_req_logit_rows(const engine_req *q) {
    if (q->phase == ENGINE_REQ_FIRST) return 1;
    if (q->phase == ENGINE_REQ_DECODE) return 1 + q->n_draft;
    return 0;
}

int engine_req_add_rows(engine_req *q, engine_batch *b, int64_t n, ember_error *err) {
    assert(q->phase == ENGINE_REQ_PROMPT || n == q->step_rows);
    assert(q->phase == ENGINE_REQ_PROMPT || q->phase == ENGINE_REQ_FIRST || q->phase == ENGINE_REQ_DECODE ||
           q->phase == ENGINE_REQ_RETIRE);
    assert(b->n + n <= b->cap);
    if (apc_seq_prepare_append(q->cache, &q->seq, n, err) < 0) return -1;
    int64_t p = q->seq.n_tokens, pending = committed(q) - p;
    q->round_snapped = false;
    if (q->phase == ENGINE_REQ_DECODE && q->n_draft > 0 && q->round_snap) {
        model_state_snapshot(q->state, q->round_snap);
        q->round_snapped = true;
    }
    for (int64_t j = 0; j < n; j++) {
        int i = b->n++;
        b->tok[i] = j < pending ? q->all[p + j] : q->draft[j - pending];
        b->pos[i] = p + j;
        b->seq[i] = &q->seq;
        b->want[i] = q->phase == ENGINE_REQ_FIRST || (q->phase == ENGINE_REQ_DECODE && j >= pending - 1);
        if (b->state) b->state[i] = q->state;
    }
    q->last_rows = n;
    q->rows_hidden = b->hidden ? b->hidden + (size_t)(b->n - n) * (size_t)q->n_embd : NULL;
    if (q->phase == ENGINE_REQ_PROMPT) q->rows_added_at = ember_now();
    return 0;
}

/* The MTP drafter reads the hidden rows of committed positions. */
static void observe(engine_req *q, int64_t p0, int64_t n) {
    if (q->drafter && q->rows_hidden && n > 0) spec_observe(q->drafter, q->spec, q->all, p0, n, q->rows_hidden);
}

static void submit_prediction(engine_req *q, int64_t n, bool for_retire) {
    engine_predict_job *j = calloc(1, sizeof *j);
    int32_t *copy = j ? malloc((size_t)n * sizeof(int32_t)) : NULL;
    if (j == NULL || copy == NULL) {
        /* No prediction is a valid answer (the cache stores less). */
        free(j);
        if (for_retire) {
            apc_req_retire(q->ar, q->all, q->seq.n_tokens, -1, &q->seq, q->state);
            q->phase = ENGINE_REQ_DONE;
        } else {
            apc_req_predicted(q->ar, n, -1);
        }
        return;
    }
    memcpy(copy, q->all, (size_t)n * sizeof(int32_t));
    j->predictor = q->predictor;
    j->tokens = copy;
    j->n = n;
    atomic_init(&j->done, false);
    if (q->pending_tail) q->pending_tail->next_pending = j;
    else q->pending_head = j;
    q->pending_tail = j;
    if (for_retire) q->retire_job = j;
    if (q->async) {
        engine__predict_submit(q->e, j);
    } else {
        engine__predict_run(j);
    }
}

/* Whether the drafter's sidecar stores for q: where L0 keeps the request
 * (the cache will not), an MTP head's rows are in L0 already
 * (engine_prefix.c). */
static bool sidecar_stores(const engine_req *q) {
    return q->drafter && q->stores && !(q->l0_store && spec_drafter_wants_hidden(q->drafter));
}

/* The retirement store, once every prediction it depends on has landed. */
static void retire_now(engine_req *q) {
    if (sidecar_stores(q)) spec_sidecar_store(q->drafter, q->spec, q->all, q->seq.n_tokens);
    if (q->predictor && apc_req_retire_wants_prediction(q->ar)) {
        submit_prediction(q, q->seq.n_tokens, true);
        q->phase = ENGINE_REQ_PREDICT;
        engine_req_poll(q);
        return;
    }
    double t = ember_now();
    apc_req_retire(q->ar, q->all, q->seq.n_tokens, -1, &q->seq, q->state);
    q->cache_s += ember_now() - t;
    q->phase = ENGINE_REQ_DONE;
}

void engine_req_forwarded(engine_req *q, int64_t n) {
    assert(n == q->last_rows);
    q->seq.n_tokens += n;
    q->forwarded += n;
    if (q->phase == ENGINE_REQ_PROMPT || q->phase == ENGINE_REQ_FIRST) observe(q, q->seq.n_tokens - n, n);
    double t = ember_now();
    switch (q->phase) {
    case ENGINE_REQ_PROMPT:
        /* What a cold prefill costs here: the remote tier's read deadline. */
        apc_note_prefill(q->cache, n, t - q->rows_added_at);
        apc_req_at(q->ar, &q->seq, q->state); /* also the N-1 pause */
        to_prompt_phase(q);
        break;
    case ENGINE_REQ_FIRST:
        apc_req_prefilled(q->ar, &q->seq, q->state);
        /* An identical resend's entry is the one it came from. */
        if (q->l0_store && !(q->source == APC_SOURCE_PREFIX && q->cached == q->N - 1)) {
            if (q->l0_state_n) model_state_snapshot(q->state, q->l0_state_n);
            uint32_t *drafter = spec_export(q->drafter, q->spec, q->N);
            prefix_store(q->l0, q->all, q->N, q->salt, &q->seq, q->l0_state_n, q->l0_have_n1 ? q->l0_state_n1 : NULL,
                         drafter);
            free(drafter);
        }
        if (sidecar_stores(q)) spec_sidecar_store(q->drafter, q->spec, q->all, q->seq.n_tokens);
        q->phase = ENGINE_REQ_SAMPLE;
        q->round_decode = false;
        q->round_p0 = q->seq.n_tokens - n;
        q->rows_sampled = 0;
        q->round_matched = 0;
        break;
    case ENGINE_REQ_DECODE:
        /* The cache sees the step once it is settled (engine_req_accept). */
        q->phase = ENGINE_REQ_SAMPLE;
        q->round_decode = true;
        q->round_p0 = q->seq.n_tokens - n;
        q->rows_sampled = 0;
        q->round_matched = 0;
        break;
    case ENGINE_REQ_RETIRE:
        q->cache_s += ember_now() - t;
        retire_now(q);
        return;
    default: assert(!"rows forwarded in a phase that has none"); break;
    }
    q->cache_s += ember_now() - t;
    engine_req_poll(q);
}

/* ---- Generation ---- */

/* Ends the step: keeps the K/V of the committed tokens but the newest,
 * drops the rest (rejected drafts), restores a recurrent state that ran
 * past them, then lets the cache see the step. SAMPLE -> DECODE. */
static void settle(engine_req *q) {
    assert(q->phase == ENGINE_REQ_SAMPLE);
    int64_t keep = committed(q) - 1;
    if (q->seq.n_tokens > keep) {
        if (q->state && q->round_snapped) {
            ember_error ignored;
            int rc = model_state_restore(q->state, q->round_snap, model_state_bytes(engine_model(q->e)), &ignored);
            assert(rc == 0); /* a snapshot of this very model */
            (void)rc;
            keep = q->round_p0;
        }
        assert(q->state == NULL || keep == q->round_p0 || keep == q->seq.n_tokens);
        apc_seq_truncate(q->cache, &q->seq, keep);
    }
    if (q->round_decode) observe(q, q->round_p0, q->seq.n_tokens - q->round_p0);
    if (q->drafter && q->round_decode) spec_verified(q->drafter, q->spec, q->n_draft, q->round_matched);
    q->n_draft = 0;
    q->phase = ENGINE_REQ_DECODE;
    /* A rolled-back recurrent step may have kept no new K/V (the cache's
     * decode points need the sequence past the prompt). */
    if (!q->round_decode || q->seq.n_tokens <= q->N) return;
    double t = ember_now();
    int64_t p = apc_req_decode(q->ar, q->all, &q->seq, q->state);
    if (p > 0 && q->predictor) submit_prediction(q, p, false);
    else if (p > 0) apc_req_predicted(q->ar, p, -1);
    q->cache_s += ember_now() - t;
}

void engine_req_accept(engine_req *q, int32_t token) {
    assert(q->phase == ENGINE_REQ_SAMPLE && q->n_gen < q->max_tokens);
    assert(q->rows_sampled < (q->round_decode ? 1 + q->n_draft : 1));
    q->all[q->N + q->n_gen++] = token;
    int row = q->rows_sampled++;
    if (q->draft_marks)
        q->draft_marks[q->n_gen - 1] = !q->round_decode || row >= q->n_draft ? SPEC_MARK_NONE
                                       : token == q->draft[row]               ? SPEC_MARK_ACCEPTED
                                                                              : SPEC_MARK_REJECTED;
    /* The next row was fed draft[row]: it is valid iff that is what came. */
    if (row < q->n_draft && token == q->draft[row]) {
        q->round_matched++;
        return;
    }
    settle(q);
}

bool engine_req_context_full(const engine_req *q) { return committed(q) - 1 >= q->n_ctx; }

void engine_req_finish(engine_req *q) {
    assert(q->phase == ENGINE_REQ_SAMPLE || q->phase == ENGINE_REQ_DECODE);
    if (q->phase == ENGINE_REQ_SAMPLE) settle(q);
    int64_t have = q->seq.n_tokens, total = committed(q);
    /* The K/V the retirement stores: every committed token but the newest
     * (forwarded again after a speculative rollback), and the newest too
     * when the cache wants it. */
    int64_t rows = total - 1 - have;
    if (total - 1 < q->n_ctx && apc_req_retire_wants_last_token(q->ar, total - 1)) rows++;
    if (rows > 0) {
        q->phase = ENGINE_REQ_RETIRE;
        q->step_rows = rows;
        return;
    }
    retire_now(q);
}

void engine_req_retire_row_failed(engine_req *q, bool state_intact) {
    assert(q->phase == ENGINE_REQ_RETIRE);
    apc_seq_truncate(q->cache, &q->seq, q->seq.n_tokens); /* blocks a failed pass allocated */
    if (state_intact || q->state == NULL) retire_now(q);
    else q->phase = ENGINE_REQ_DONE;
}

void engine_req_poll(engine_req *q) {
    while (q->pending_head && atomic_load(&q->pending_head->done)) {
        engine_predict_job *j = q->pending_head;
        q->pending_head = j->next_pending;
        if (q->pending_head == NULL) q->pending_tail = NULL;
        double t = ember_now();
        if (j == q->retire_job) {
            apc_req_retire(q->ar, q->all, j->n, j->result, &q->seq, q->state);
            q->retire_job = NULL;
            q->phase = ENGINE_REQ_DONE;
        } else {
            apc_req_predicted(q->ar, j->n, j->result);
        }
        q->cache_s += ember_now() - t;
        free(j->tokens);
        free(j);
    }
}

/* ---- Reading ---- */

const int32_t *engine_req_tokens(const engine_req *q) { return q->all; }
int engine_req_n_generated(const engine_req *q) { return q->n_gen; }
int64_t engine_req_n_kv(const engine_req *q) { return q->seq.n_tokens; }
int64_t engine_req_cached(const engine_req *q) { return q->cached; }
apc_source engine_req_cache_source(const engine_req *q) { return q->source; }
int64_t engine_req_forwarded_total(const engine_req *q) { return q->forwarded; }
double engine_req_cache_seconds(const engine_req *q) { return q->cache_s; }
spec_stats engine_req_spec_stats(const engine_req *q) {
    spec_stats none = {0, 0, 0, 0};
    return q->spec ? spec_seq_stats(q->spec) : none;
}

/* ---- Batches ---- */

int engine_batch_init(engine_batch *b, int cap, bool with_states) {
    memset(b, 0, sizeof *b);
    b->cap = cap;
    b->tok = malloc((size_t)cap * sizeof *b->tok);
    b->pos = malloc((size_t)cap * sizeof *b->pos);
    b->seq = malloc((size_t)cap * sizeof *b->seq);
    b->want = malloc((size_t)cap * sizeof *b->want);
    if (with_states) b->state = malloc((size_t)cap * sizeof *b->state);
    if (!b->tok || !b->pos || !b->seq || !b->want || (with_states && !b->state)) {
        engine_batch_free(b);
        return -1;
    }
    return 0;
}

int engine_batch_want_hidden(engine_batch *b, int n_embd) {
    b->hidden = malloc((size_t)b->cap * (size_t)n_embd * sizeof(float));
    return b->hidden ? 0 : -1;
}

model_batch engine_batch_model(const engine_batch *b) {
    model_batch mb = {b->n, b->tok, b->pos, b->seq, b->want, b->state, b->hidden, b->hidden != NULL};
    return mb;
}

void engine_batch_free(engine_batch *b) {
    free(b->hidden);
    free(b->tok);
    free(b->pos);
    free(b->seq);
    free(b->want);
    free(b->state);
    memset(b, 0, sizeof *b);
}
