/* serve_sched.c - the continuous-batching scheduler (see serve_sched.h).
 *
 * A request moves through four states on the engine thread:
 *
 *   queued --admit+lookup--> PROMPT ... FIRST --> SAMPLE <-> DECODE
 *   --(finish)--> [RETIRE: one more row] --> [PREDICT] --> DONE (engine_req.h)
 *
 * One iteration forwards at most two batches: the prefill batch (grid
 * chunks of several requests, at most `step` tokens) and the decode batch
 * (one row per DECODE or RETIRE request). The first decode row of a request
 * is its last prompt token, so "the last prompt token is forwarded alone"
 * holds in the sense that matters: it is one row whose result does not
 * depend on the other rows. Admission reserves the worst case of every
 * running request in the pool (ceil(min(N + max_tokens, n_ctx) / 16) + 1
 * blocks, the +1 for a copy-on-write of a shared partial block), so an
 * append never finds the pool exhausted: unreferenced cached blocks are
 * always reclaimable.
 *
 * Output crosses to HTTP threads through the request's lock: released text
 * (final; stop strings already cut), the published logprob entries (an
 * array of pointers, each entry immutable once published), the finish
 * reason and the usage.
 *
 * Models with recurrent layers (model_has_state: qwen35 / qwen3next hybrids,
 * mamba2, falcon-h1) give every request its own model_state, created at
 * admission and freed when the request completes (finish, cancel, failure);
 * every batch row carries its request's state (model_batch.states), prefill
 * chunks and decode rows alike, and a sequence's rows are always in position
 * order; the cache restores and snapshots the state with the K/V.
 *
 * Every request is driven through engine_req.h, as engine_generate drives
 * its one: the driver is created at submission (it validates the prompt),
 * the lookup runs at admission, except on a ckpt-tier cache, where prompts
 * prefill one at a time: the oldest request whose prompt phase is not done
 * (the serial head) looks up when it becomes the head (so it sees what the
 * previous prompt stored: the system-prompt anchor of a sibling), prefills
 * alone, and hands over after its PREFILL store; the others wait, their
 * decode rows (if any) unaffected. A finished request whose retirement
 * waits on a render prediction (PREDICT) holds its blocks until the
 * predictor thread answers; the loop polls it each iteration. */
#define _GNU_SOURCE
#include "serve/serve_sched.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/clock.h"
#include "core/log.h"
#include "engine/engine_req.h"

typedef enum { ST_QUEUED = 0, ST_RUNNING, ST_DONE } sreq_state;

/* A request that does not fit the pool lets at most this many later ones
 * in ahead of it; then nothing behind it is admitted until it fits. */
#define SCHED_MAX_OVERTAKEN 16
/* Tenants whose last turn is remembered; a forgotten one ranks as new. */
#define SCHED_TENANT_TURNS 64

struct sreq {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    atomic_int refs;
    atomic_bool cancel;
    sreq_params p;
    engine_req *q;               /* the driver: sequence, state, cache protocol */
    int64_t need_blocks;
    int overtaken;               /* later requests admitted while this one did not fit (under s->lock) */
    double t_arrive, t_first, t_last, t_held;
    struct sreq *next;           /* queue link */
    /* engine thread only */
    sreq_state state;
    sampler *smp;
    tok_stream *ts;
    int n_gen;
    int64_t cached;
    char *hold;                  /* generated text not released yet */
    size_t hold_len, hold_cap;
    int lp_unpublished;          /* entries [n_lp_pub, n_lp) wait for text */
    sreq_finish fin;             /* decided, not yet published */
    /* shared, under lock */
    char *text;
    size_t len, cap;
    sreq_logprob **lps;
    int n_lp, n_lp_pub, cap_lp;
    bool first;
    sreq_finish finish;
    sreq_usage usage;
};

struct sched {
    engine *e;
    const model *m;
    const tokenizer *tok;
    apc *cache;
    serve_metrics *metrics;
    model_ctx *ctx;
    sched_config cfg;
    int n_ctx, n_vocab, max_batch;
    int32_t pool_blocks;
    bool stateful;               /* model_has_state: per-request model_state */
    uint64_t fresh_holds;        /* under lock */
    uint64_t disk_deadline_misses; /* under lock */
    char fresh_reason[160];
    /* queue, under lock */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    sreq *q_head, *q_tail;
    int q_len, n_running_pub;
    /* fairness: when each recently admitted tenant last got a turn */
    struct {
        uint64_t tenant, stamp;
    } turns[SCHED_TENANT_TURNS];
    uint64_t admissions;
    bool draining;
    /* engine thread */
    pthread_t thread;
    bool started;
    sreq **running;
    int n_running;
    int64_t reserved;
    engine_batch batch;          /* (max_batch) rows of one forward */
    sreq **b_req;                /* (max_batch) the request of each decode step */
    int64_t *b_rows;             /* (max_batch) rows each of them added */
    int logit_rows_cap;          /* rows s->logits holds */
    int64_t forwarded;           /* rows forwarded this iteration */
    float *logits;               /* (logit_rows_cap, n_vocab): a step's logit rows */
    float *scratch;              /* (n_vocab) */
};

/* ---- requests ---- */

static void sreq_free(sreq *r) {
    engine_req_free(r->q);
    chat_turn_predictor_free(r->p.plan.predictor);
    free(r->p.prompt);
    for (int i = 0; i < r->p.n_stop; i++) free(r->p.stop[i]);
    sampler_free(r->smp);
    tok_stream_free(r->ts);
    free(r->hold);
    free(r->text);
    for (int i = 0; i < r->n_lp; i++) {
        free(r->lps[i]->piece);
        free(r->lps[i]);
    }
    free(r->lps);
    pthread_mutex_destroy(&r->lock);
    pthread_cond_destroy(&r->cond);
    free(r);
}

void sreq_unref(sreq *r) {
    if (r && atomic_fetch_sub(&r->refs, 1) == 1) sreq_free(r);
}

void sreq_cancel(sreq *r) {
    if (r == NULL) return;
    atomic_store(&r->cancel, true);
}

static int grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *np = realloc(*p, c * elem);
    if (np == NULL) return -1;
    *p = np;
    *cap = c;
    return 0;
}

bool sreq_next(sreq *r, sreq_cursor *cur, int timeout_ms, sreq_delta *d) {
    memset(d, 0, sizeof *d);
    pthread_mutex_lock(&r->lock);
    bool fresh = r->len > cur->text || r->n_lp_pub > cur->logprobs || r->first != cur->saw_first ||
                 r->finish != SREQ_RUNNING;
    if (!fresh && timeout_ms > 0) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += timeout_ms / 1000;
        ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&r->cond, &r->lock, &ts);
    }
    size_t n = r->len - cur->text;
    d->text = malloc(n + 1);
    if (d->text) {
        memcpy(d->text, r->text ? r->text + cur->text : "", n);
        d->text[n] = 0;
        d->len = n;
        cur->text = r->len;
    }
    d->lp_from = cur->logprobs;
    d->lp_to = r->n_lp_pub;
    cur->logprobs = r->n_lp_pub;
    bool first_changed = r->first != cur->saw_first;
    d->first = r->first;
    cur->saw_first = r->first;
    d->finish = r->finish;
    pthread_mutex_unlock(&r->lock);
    return d->len > 0 || d->lp_to > d->lp_from || d->finish != SREQ_RUNNING || first_changed;
}

void sreq_delta_free(sreq_delta *d) {
    free(d->text);
    memset(d, 0, sizeof *d);
}

const sreq_logprob *sreq_logprob_at(sreq *r, int i) {
    pthread_mutex_lock(&r->lock);
    const sreq_logprob *lp = i >= 0 && i < r->n_lp_pub ? r->lps[i] : NULL;
    pthread_mutex_unlock(&r->lock);
    return lp;
}

void sreq_usage_get(sreq *r, sreq_usage *u) {
    pthread_mutex_lock(&r->lock);
    *u = r->usage;
    pthread_mutex_unlock(&r->lock);
}

/* ---- output (engine thread) ---- */

/* Moves hold[0, n) to the shared text, with the waiting logprob entries. */
static void release(sreq *r, size_t n) {
    pthread_mutex_lock(&r->lock);
    if (n > 0) {
        size_t cap = r->cap;
        if (grow((void **)&r->text, &cap, r->len + n + 1, 1) == 0) {
            r->cap = cap;
            memcpy(r->text + r->len, r->hold, n);
            r->len += n;
            r->text[r->len] = 0;
        }
        r->n_lp_pub = r->n_lp;
    }
    pthread_mutex_unlock(&r->lock);
    if (r->hold_len > n) memmove(r->hold, r->hold + n, r->hold_len - n);
    r->hold_len -= n;
    pthread_cond_broadcast(&r->cond);
}

/* Appends generated text and applies the stop strings. Returns true when a
 * stop string matched (the text before it is released, the rest dropped). */
static bool push_text(sreq *r, const char *s, size_t n) {
    size_t cap = r->hold_cap;
    if (n > 0) {
        if (grow((void **)&r->hold, &cap, r->hold_len + n + 1, 1) < 0) return false;
        r->hold_cap = cap;
        memcpy(r->hold + r->hold_len, s, n);
        r->hold_len += n;
    }
    if (r->p.n_stop == 0) {
        release(r, r->hold_len);
        return false;
    }
    size_t best = (size_t)-1;
    for (int i = 0; i < r->p.n_stop; i++) {
        size_t sl = strlen(r->p.stop[i]);
        if (sl == 0 || sl > r->hold_len) continue;
        const char *hit = memmem(r->hold, r->hold_len, r->p.stop[i], sl);
        if (hit && (size_t)(hit - r->hold) < best) best = (size_t)(hit - r->hold);
    }
    if (best != (size_t)-1) {
        release(r, best);
        r->hold_len = 0;
        return true;
    }
    /* Hold back the longest suffix that is a proper prefix of a stop string. */
    size_t keep = 0;
    for (int i = 0; i < r->p.n_stop; i++) {
        size_t sl = strlen(r->p.stop[i]);
        if (sl == 0) continue;
        for (size_t k = sl - 1 < r->hold_len ? sl - 1 : r->hold_len; k > keep; k--)
            if (memcmp(r->hold + r->hold_len - k, r->p.stop[i], k) == 0) {
                keep = k;
                break;
            }
    }
    release(r, r->hold_len - keep);
    return false;
}

static void compute_logprobs(sched *s, sreq *r, const float *row, int32_t token) {
    const int V = s->n_vocab;
    sreq_logprob *lp = calloc(1, sizeof *lp);
    if (lp == NULL) return;
    float mx = -INFINITY;
    for (int i = 0; i < V; i++)
        if (row[i] > mx) mx = row[i];
    double sum = 0;
    for (int i = 0; i < V; i++) sum += exp((double)row[i] - mx);
    double lse = mx + log(sum);
    lp->token = token;
    lp->logprob = (float)(row[token] - lse);
    int k = r->p.top_logprobs > SCHED_MAX_TOP_LOGPROBS ? SCHED_MAX_TOP_LOGPROBS : r->p.top_logprobs;
    if (k > V) k = V;
    for (int i = 0; i < V; i++) {
        /* insertion into a sorted top-k (ties: lower id first) */
        int j = lp->n_top;
        if (j == k && (k == 0 || row[i] <= row[lp->top_ids[k - 1]])) continue;
        if (j == k) j--;
        while (j > 0 && row[lp->top_ids[j - 1]] < row[i]) {
            lp->top_ids[j] = lp->top_ids[j - 1];
            j--;
        }
        lp->top_ids[j] = i;
        if (lp->n_top < k) lp->n_top++;
    }
    for (int i = 0; i < lp->n_top; i++) lp->top_lp[i] = (float)(row[lp->top_ids[i]] - lse);
    int need = tokenizer_token_to_piece(s->tok, token, false, NULL, 0);
    int plen = need < 0 ? -need : need;
    lp->piece = malloc((size_t)plen + 1);
    if (lp->piece) {
        lp->piece_len = plen > 0 ? tokenizer_token_to_piece(s->tok, token, false, lp->piece, (size_t)plen + 1) : 0;
        if (lp->piece_len < 0) lp->piece_len = 0;
        lp->piece[lp->piece_len] = 0;
    }
    pthread_mutex_lock(&r->lock);
    size_t cap = (size_t)r->cap_lp;
    if (grow((void **)&r->lps, &cap, (size_t)r->n_lp + 1, sizeof *r->lps) == 0) {
        r->cap_lp = (int)cap;
        r->lps[r->n_lp++] = lp;
        lp = NULL;
    }
    pthread_mutex_unlock(&r->lock);
    if (lp) {
        free(lp->piece);
        free(lp);
    }
}

static const char *finish_name(sreq_finish f) {
    switch (f) {
    case SREQ_STOP: return "stop";
    case SREQ_LENGTH: return "length";
    case SREQ_CANCELLED: return "cancelled";
    case SREQ_FAILED: return "error";
    default: return "running";
    }
}

/* Publishes the finish. The engine's reference is dropped by compact() (or
 * by the caller for a request that never ran), so the request stays valid
 * for the rest of the iteration. */
static void complete(sched *s, sreq *r, sreq_finish f, const char *error) {
    if (r->q) {
        spec_stats st = engine_req_spec_stats(r->q);
        serve_metrics_spec(s->metrics, st.rounds, st.drafted, st.accepted);
    }
    engine_req_free(r->q); /* its blocks go back; nothing more is stored */
    r->q = NULL;
    double now = ember_now();
    pthread_mutex_lock(&r->lock);
    r->n_lp_pub = r->n_lp;
    r->finish = f;
    r->usage.prompt_tokens = r->p.n_prompt;
    r->usage.cached_tokens = r->cached;
    r->usage.completion_tokens = r->n_gen;
    r->usage.ttft_s = r->t_first > 0 ? r->t_first - r->t_arrive : 0;
    r->usage.total_s = now - r->t_arrive;
    if (error) snprintf(r->usage.error, sizeof r->usage.error, "%s", error);
    pthread_mutex_unlock(&r->lock);
    pthread_cond_broadcast(&r->cond);
    if (f != SREQ_CANCELLED && f != SREQ_FAILED) {
        serve_metrics_tokens(s->metrics, r->p.n_prompt, r->cached, r->n_gen);
        serve_metrics_observe(s->metrics, HIST_REQUEST_SECONDS, now - r->t_arrive);
    }
    serve_metrics_finish(s->metrics, finish_name(f));
    s->reserved -= r->need_blocks;
    r->state = ST_DONE;
}

/* The generation ended with f: flush text, then retire (possibly after one
 * more decode row, or once the predictor thread answered) and complete. */
static void finish_generation(sched *s, sreq *r, sreq_finish f, bool stop_matched) {
    if (!stop_matched) {
        size_t n = 0;
        const char *t = tok_stream_flush(r->ts, &n);
        if (push_text(r, t, n)) f = SREQ_STOP;
        else release(r, r->hold_len);
    }
    r->fin = f;
    engine_req_finish(r->q);
    if (engine_req_get_phase(r->q) == ENGINE_REQ_DONE) complete(s, r, f, NULL);
}

/* ---- the engine thread ---- */

/* Admitted, not looked up yet (serial: until it becomes the head; or its
 * SSD reads are still running). */
static bool awaits_lookup(const sreq *r) { return engine_req_get_phase(r->q) <= ENGINE_REQ_FETCH; }

/* The lookup, once the request's SSD reads are in (or their deadline
 * passed); false while they are still running. */
static bool lookup_when_ready(sched *s, sreq *r) {
    bool expired = false;
    if (!engine_req_fetch_ready(r->q, &expired)) return false;
    if (expired) {
        pthread_mutex_lock(&s->lock);
        s->disk_deadline_misses++;
        pthread_mutex_unlock(&s->lock);
        ember_log(EMBER_LOG_DEBUG, "APC disk: reads missed their deadline (%d ms); looking up memory only",
                  s->cfg.disk_wait_ms);
    }
    apc_hit hit = engine_req_lookup(r->q);
    r->cached = hit.n_tokens;
    return true;
}

static void admit(sched *s, sreq *r) {
    r->t_first = 0;
    serve_metrics_observe(s->metrics, HIST_QUEUE_SECONDS, ember_now() - r->t_arrive);
    r->state = ST_RUNNING;
    r->cached = 0;
    s->running[s->n_running++] = r;
    engine_req_fetch(r->q);
    if (!engine_req_serial(r->q)) lookup_when_ready(s, r);
}

/* Whether r's prompt phase is over (its PREFILL store ran). */
static bool prompt_done(const sreq *r) { return r->q == NULL || engine_req_get_phase(r->q) > ENGINE_REQ_FIRST; }

/* The oldest request in its prompt phase on a serial (ckpt-tier) cache. */
static sreq *serial_head(sched *s) {
    for (int i = 0; i < s->n_running; i++) {
        sreq *r = s->running[i];
        if (r->state != ST_DONE && !prompt_done(r) && engine_req_serial(r->q)) return r;
    }
    return NULL;
}

static void fail_batch(sched *s, sreq **reqs, int n, const char *msg) {
    for (int i = 0; i < n; i++)
        if (reqs[i]->state != ST_DONE) complete(s, reqs[i], SREQ_FAILED, msg);
}

/* One prefill batch of at most `step` tokens. The oldest prefilling request
 * is guaranteed a quarter of it (so it always progresses); the others, the
 * shortest first, take what they need of the rest; the oldest then takes
 * what is left. A short request that arrives while a long prompt prefills
 * thus waits about one batch, not the whole prompt. */
static void prefill_step(sched *s) {
    const int step = s->cfg.prefill_step;
    int nreq = 0;
    ember_error err;
    sreq *members[64];
    int64_t lens[64], full[64];
    sreq *head = serial_head(s);
    if (head && awaits_lookup(head)) lookup_when_ready(s, head);
    for (int i = 0; i < s->n_running; i++) { /* reads that landed since */
        sreq *r = s->running[i];
        if (r->state == ST_RUNNING && awaits_lookup(r) && !engine_req_serial(r->q)) lookup_when_ready(s, r);
    }
    for (int i = 0; i < s->n_running && nreq < 64; i++) {
        sreq *r = s->running[i];
        if (r->state != ST_RUNNING) continue;
        if (engine_req_serial(r->q) && r != head) continue;
        int64_t l = engine_req_prompt_chunk(r->q, INT64_MAX);
        if (l <= 0) continue;
        members[nreq] = r;
        full[nreq] = l;
        lens[nreq++] = 0;
    }
    if (nreq == 0) return;
    int64_t budget = step, guarantee = step / 4 > KV_BLOCK_TOKENS ? step / 4 : KV_BLOCK_TOKENS;
    lens[0] = engine_req_prompt_chunk(members[0]->q, guarantee < budget ? guarantee : budget);
    budget -= lens[0];
    for (int done = 1; done < nreq && budget > 0; done++) {
        int best = -1; /* the shortest not yet served (ties: the older) */
        for (int i = 1; i < nreq; i++)
            if (lens[i] == 0 && full[i] > 0 && (best < 0 || full[i] < full[best])) best = i;
        if (best < 0) break;
        lens[best] = engine_req_prompt_chunk(members[best]->q, budget);
        full[best] = 0; /* served */
        budget -= lens[best];
    }
    if (budget > 0) {
        int64_t l = engine_req_prompt_chunk(members[0]->q, lens[0] + budget);
        budget -= l - lens[0];
        lens[0] = l;
    }
    int k = 0;
    engine_batch *b = &s->batch;
    b->n = 0;
    for (int i = 0; i < nreq; i++) {
        sreq *r = members[i];
        if (lens[i] <= 0) continue;
        if (engine_req_add_rows(r->q, b, lens[i], &err) < 0) {
            complete(s, r, SREQ_FAILED, err.msg);
            continue;
        }
        members[k] = r;
        lens[k++] = lens[i];
    }
    nreq = k;
    if (b->n == 0) return;
    model_batch mb = engine_batch_model(b);
    s->forwarded += b->n;
    b->n = 0;
    if (model_forward(s->ctx, &mb, s->logits, &err) < 0) {
        ember_log(EMBER_LOG_ERROR, "prefill forward failed: %s", err.msg);
        fail_batch(s, members, nreq, err.msg);
        return;
    }
    for (int i = 0; i < nreq; i++) engine_req_forwarded(members[i]->q, lens[i]);
}

/* One generated token of r: sample, publish, decide whether it ends. */
static void take_token(sched *s, sreq *r, float *row) {
    int32_t next;
    if (r->p.top_logprobs >= 0) {
        /* logprobs of the raw logits; the sampler may modify its row */
        memcpy(s->scratch, row, (size_t)s->n_vocab * sizeof(float));
        next = sampler_sample(r->smp, s->scratch, s->n_vocab);
        compute_logprobs(s, r, row, next);
    } else {
        next = sampler_sample(r->smp, row, s->n_vocab);
    }
    sampler_accept_generated(r->smp, next);
    engine_req_accept(r->q, next);
    r->n_gen++;
    if (!r->p.ignore_eos && tokenizer_is_eog(s->tok, next)) {
        finish_generation(s, r, SREQ_STOP, false);
        return;
    }
    size_t tl = 0;
    const char *t = tok_stream_push(r->ts, next, &tl);
    if (push_text(r, t, tl)) {
        finish_generation(s, r, SREQ_STOP, true);
        return;
    }
    if (r->n_gen == 1) {
        pthread_mutex_lock(&r->lock);
        r->first = true;
        pthread_mutex_unlock(&r->lock);
        pthread_cond_broadcast(&r->cond);
    }
    if (r->n_gen >= r->p.max_tokens || engine_req_n_kv(r->q) >= s->n_ctx) finish_generation(s, r, SREQ_LENGTH, false);
}

static void decode_step(sched *s) {
    int n = 0, n_logit_rows = 0;
    ember_error err;
    engine_batch *b = &s->batch;
    b->n = 0;
    for (int i = 0; i < s->n_running; i++) {
        sreq *r = s->running[i];
        if (r->state != ST_RUNNING) continue;
        engine_req_phase ph = engine_req_get_phase(r->q);
        if (ph != ENGINE_REQ_FIRST && ph != ENGINE_REQ_DECODE && ph != ENGINE_REQ_RETIRE) continue;
        /* Drafts only where the logits buffer has room for their rows. */
        int64_t allow = b->cap - b->n, logit_room = (int64_t)s->logit_rows_cap - n_logit_rows;
        if (ph == ENGINE_REQ_DECODE && allow > logit_room) allow = logit_room;
        int64_t rows = engine_req_step_rows(r->q, allow);
        if (rows == 0) continue; /* no room this step */
        s->b_rows[n] = rows;
        if (engine_req_add_rows(r->q, b, rows, &err) < 0) {
            if (ph == ENGINE_REQ_RETIRE) { /* best effort: store one shorter (the state was not advanced) */
                engine_req_retire_row_failed(r->q, true);
                if (engine_req_get_phase(r->q) == ENGINE_REQ_DONE) complete(s, r, r->fin, NULL);
            } else {
                complete(s, r, SREQ_FAILED, err.msg);
            }
            continue;
        }
        n_logit_rows += engine_req_logit_rows(r->q);
        s->b_req[n++] = r;
    }
    if (n == 0) return;
    model_batch mb = engine_batch_model(b);
    s->forwarded += b->n;
    b->n = 0;
    if (model_forward(s->ctx, &mb, s->logits, &err) < 0) {
        ember_log(EMBER_LOG_ERROR, "decode forward failed: %s", err.msg);
        fail_batch(s, s->b_req, n, err.msg);
        return;
    }
    double now = ember_now();
    int k = 0;
    for (int i = 0; i < n; i++) {
        sreq *r = s->b_req[i];
        engine_req_phase ph = engine_req_get_phase(r->q);
        int rows_of_r = engine_req_logit_rows(r->q);
        engine_req_forwarded(r->q, s->b_rows[i]);
        if (ph == ENGINE_REQ_RETIRE) {
            if (engine_req_get_phase(r->q) == ENGINE_REQ_DONE) complete(s, r, r->fin, NULL);
            continue;
        }
        /* One token per logit row while the drafts hold (engine_req.h). */
        int base = k;
        k += rows_of_r;
        for (int j = 0; j < rows_of_r && r->state == ST_RUNNING && engine_req_get_phase(r->q) == ENGINE_REQ_SAMPLE; j++) {
            float *row = s->logits + (size_t)(base + j) * s->n_vocab;
            if (ph == ENGINE_REQ_FIRST) {
                r->t_first = now;
                serve_metrics_observe(s->metrics, HIST_TTFT_SECONDS, now - r->t_arrive);
            } else {
                serve_metrics_observe(s->metrics, HIST_TPOT_SECONDS, now - r->t_last);
            }
            r->t_last = now;
            take_token(s, r, row);
        }
    }
}

/* Retirements waiting on the predictor thread. */
static void poll_predictions(sched *s) {
    for (int i = 0; i < s->n_running; i++) {
        sreq *r = s->running[i];
        if (r->state != ST_RUNNING) continue;
        engine_req_poll(r->q);
        if (engine_req_get_phase(r->q) == ENGINE_REQ_DONE) complete(s, r, r->fin, NULL);
    }
}

/* The freshness gate for the queue head r (under s->lock): hold it while a
 * request in its prompt phase, or one admitted this round, is about to
 * store a prefix they share. Bounded by fresh_wait_ms per request. */
static bool fresh_hold(sched *s, sreq *r, sreq **admitted, int n_adm, double now) {
    if (s->cfg.fresh_wait_ms <= 0 || atomic_load(&r->cancel)) return false;
    if (r->t_held > 0 && (now - r->t_held) * 1000.0 >= s->cfg.fresh_wait_ms) {
        ember_log(EMBER_LOG_DEBUG, "APC fresh gate: hold ceiling (%d ms) reached; admitted cold",
                  s->cfg.fresh_wait_ms);
        return false;
    }
    engine_req *earlier[512];
    int n = 0;
    for (int i = 0; i < s->n_running && n < 512; i++)
        if (s->running[i]->state == ST_RUNNING && s->running[i]->q) earlier[n++] = s->running[i]->q;
    for (int i = 0; i < n_adm && n < 512; i++) earlier[n++] = admitted[i]->q;
    char why[160];
    if (!engine_req_fresh_hold(r->q, earlier, n, s->cfg.fresh_min, why, sizeof why)) return false;
    if (r->t_held == 0) {
        r->t_held = now;
        s->fresh_holds++;
        snprintf(s->fresh_reason, sizeof s->fresh_reason, "%s", why);
        ember_log(EMBER_LOG_DEBUG, "APC fresh gate: holding a request: %s", why);
    }
    return true;
}

/* ---- admission order (under s->lock) ---- */

/* When tenant last had a request admitted (0: not lately). */
static uint64_t last_turn(const sched *s, uint64_t tenant) {
    for (int i = 0; i < SCHED_TENANT_TURNS; i++)
        if (s->turns[i].stamp && s->turns[i].tenant == tenant) return s->turns[i].stamp;
    return 0;
}

static void note_turn(sched *s, uint64_t tenant) {
    int slot = 0;
    for (int i = 0; i < SCHED_TENANT_TURNS; i++) {
        if (s->turns[i].stamp && s->turns[i].tenant == tenant) {
            slot = i;
            break;
        }
        if (s->turns[i].stamp < s->turns[slot].stamp) slot = i; /* else the oldest turn is forgotten */
    }
    s->turns[slot].tenant = tenant;
    s->turns[slot].stamp = ++s->admissions;
}

/* The queued request to admit next, or NULL (*prev: the one before it).
 * A cancelled request comes out at once (to be completed). Among those
 * that fit the pool, the tenant whose last turn is oldest goes first, in
 * arrival order within a tenant, so one tenant's burst cannot push
 * another's requests to the back. A request that does not fit is skipped,
 * so it cannot block smaller ones behind it, but only
 * SCHED_MAX_OVERTAKEN times: after that nothing queued behind it is
 * admitted until the running requests leave it room. */
static sreq *pick_next(sched *s, sreq **prev_out) {
    sreq *best = NULL, *best_prev = NULL, *prev = NULL;
    uint64_t best_turn = UINT64_MAX;
    for (sreq *r = s->q_head; r; prev = r, r = r->next) {
        if (atomic_load(&r->cancel)) {
            best = r;
            best_prev = prev;
            break;
        }
        if (s->reserved + r->need_blocks > s->pool_blocks) {
            if (r->overtaken >= SCHED_MAX_OVERTAKEN) break;
            continue;
        }
        uint64_t turn = last_turn(s, r->p.tenant_id);
        if (turn < best_turn) {
            best = r;
            best_prev = prev;
            best_turn = turn;
        }
    }
    *prev_out = best_prev;
    return best;
}

/* r is admitted: every request queued before it that does not fit was
 * overtaken once more. */
static void count_overtaken(sched *s, const sreq *r) {
    for (sreq *q = s->q_head; q && q != r; q = q->next)
        if (s->reserved + q->need_blocks > s->pool_blocks) q->overtaken++;
}

static void unlink_queued(sched *s, sreq *r, sreq *prev) {
    if (prev) prev->next = r->next;
    else s->q_head = r->next;
    if (s->q_tail == r) s->q_tail = prev;
    s->q_len--;
    r->next = NULL;
}

/* Removes finished requests from the running list, keeping order. */
static void compact(sched *s) {
    int j = 0;
    for (int i = 0; i < s->n_running; i++) {
        if (s->running[i]->state != ST_DONE) s->running[j++] = s->running[i];
        else sreq_unref(s->running[i]);
    }
    s->n_running = j;
}

static void *engine_main(void *arg) {
    sched *s = arg;
    for (;;) {
        /* Cancellations first: their blocks go back before admission. */
        for (int i = 0; i < s->n_running; i++) {
            sreq *r = s->running[i];
            if (atomic_load(&r->cancel)) complete(s, r, SREQ_CANCELLED, NULL);
        }
        compact(s);
        pthread_mutex_lock(&s->lock);
        s->n_running_pub = s->n_running;
        while (s->n_running == 0 && s->q_head == NULL && !s->draining) pthread_cond_wait(&s->wake, &s->lock);
        if (s->n_running == 0 && s->q_head == NULL && s->draining) {
            s->n_running_pub = 0;
            pthread_mutex_unlock(&s->lock);
            break;
        }
        sreq *admitted[256];
        int n_adm = 0;
        bool held = false;
        double now = ember_now();
        while (s->q_head && s->n_running + n_adm < s->cfg.max_running && n_adm < 256) {
            sreq *prev = NULL, *r = pick_next(s, &prev);
            if (r == NULL) break;
            if (!atomic_load(&r->cancel) && fresh_hold(s, r, admitted, n_adm, now)) {
                held = true;
                break;
            }
            bool cancelled = atomic_load(&r->cancel);
            if (!cancelled) count_overtaken(s, r);
            unlink_queued(s, r, prev);
            if (cancelled) {
                pthread_mutex_unlock(&s->lock);
                s->reserved += r->need_blocks; /* complete() gives it back */
                complete(s, r, SREQ_CANCELLED, NULL);
                sreq_unref(r);
                pthread_mutex_lock(&s->lock);
                continue;
            }
            note_turn(s, r->p.tenant_id);
            s->reserved += r->need_blocks;
            admitted[n_adm++] = r;
        }
        s->n_running_pub = s->n_running + n_adm;
        pthread_mutex_unlock(&s->lock);
        for (int i = 0; i < n_adm; i++) admit(s, admitted[i]);
        s->forwarded = 0;
        poll_predictions(s);
        compact(s);
        prefill_step(s);
        compact(s);
        decode_step(s);
        compact(s);
        pthread_mutex_lock(&s->lock);
        s->n_running_pub = s->n_running;
        /* Nothing to forward (retirements waiting on the predictor thread,
         * a held request): sleep a little instead of spinning. */
        if (s->forwarded == 0 && (s->n_running > 0 || held) && !s->draining) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&s->wake, &s->lock, &ts);
        }
        pthread_mutex_unlock(&s->lock);
    }
    return NULL;
}

/* ---- API ---- */

sched *sched_create(engine *e, const sched_config *cfg, serve_metrics *metrics, ember_error *err) {
    sched *s = calloc(1, sizeof *s);
    if (s == NULL) {
        ember_fail(err, "scheduler: out of memory");
        return NULL;
    }
    s->e = e;
    s->m = engine_model(e);
    s->tok = model_get_tokenizer(s->m);
    s->cache = engine_cache(e);
    s->metrics = metrics;
    s->cfg = *cfg;
    if (s->cfg.prefill_step < 1) s->cfg.prefill_step = 512;
    if (s->cfg.max_running < 1) s->cfg.max_running = 1;
    s->n_ctx = engine_n_ctx(e);
    s->n_vocab = model_get_hparams(s->m)->n_vocab;
    s->pool_blocks = kv_pool_n_blocks(engine_pool(e));
    s->stateful = model_has_state(s->m);
    s->max_batch = s->cfg.prefill_step > s->cfg.max_running ? s->cfg.prefill_step : s->cfg.max_running;
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->wake, NULL);
    s->running = calloc((size_t)s->cfg.max_running, sizeof *s->running);
    s->b_req = malloc((size_t)s->max_batch * sizeof *s->b_req);
    s->b_rows = malloc((size_t)s->max_batch * sizeof *s->b_rows);
    /* With a drafter every running request may verify up to k drafts. */
    const spec_drafter *drafter = engine_drafter(e);
    s->logit_rows_cap = s->cfg.max_running * (drafter ? 1 + spec_drafter_config(drafter)->k : 1);
    s->logits = malloc((size_t)s->logit_rows_cap * (size_t)s->n_vocab * sizeof(float));
    s->scratch = malloc((size_t)s->n_vocab * sizeof(float));
    if (!s->running || !s->b_req || !s->b_rows || !s->logits || !s->scratch ||
        engine_batch_init(&s->batch, s->max_batch, s->stateful) < 0 ||
        (drafter && spec_drafter_wants_hidden(drafter) &&
         engine_batch_want_hidden(&s->batch, model_get_hparams(s->m)->n_embd) < 0)) {
        ember_fail(err, "scheduler: out of memory for batches of %d", s->max_batch);
        sched_free(s);
        return NULL;
    }
    s->ctx = model_ctx_create(s->m, engine_pool(e), s->cfg.n_threads, s->max_batch, err);
    if (s->ctx == NULL) {
        sched_free(s);
        return NULL;
    }
    if (pthread_create(&s->thread, NULL, engine_main, s) != 0) {
        ember_fail(err, "scheduler: cannot start the engine thread");
        sched_free(s);
        return NULL;
    }
    s->started = true;
    return s;
}

void sched_drain(sched *s) {
    if (s == NULL || !s->started) return;
    pthread_mutex_lock(&s->lock);
    s->draining = true;
    pthread_cond_broadcast(&s->wake);
    pthread_mutex_unlock(&s->lock);
    pthread_join(s->thread, NULL);
    s->started = false;
}

void sched_free(sched *s) {
    if (s == NULL) return;
    sched_drain(s);
    model_ctx_free(s->ctx);
    free(s->running);
    engine_batch_free(&s->batch);
    free(s->b_req);
    free(s->b_rows);
    free(s->logits);
    free(s->scratch);
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->wake);
    free(s);
}

int sched_n_ctx(const sched *s) { return s->n_ctx; }

void sched_counts(sched *s, int *running, int *waiting) {
    pthread_mutex_lock(&s->lock);
    *running = s->n_running_pub;
    *waiting = s->q_len;
    pthread_mutex_unlock(&s->lock);
}

uint64_t sched_fresh_holds(sched *s, char *reason, size_t reason_cap) {
    pthread_mutex_lock(&s->lock);
    uint64_t n = s->fresh_holds;
    if (reason && reason_cap) snprintf(reason, reason_cap, "%s", s->fresh_reason);
    pthread_mutex_unlock(&s->lock);
    return n;
}

uint64_t sched_disk_deadline_misses(sched *s) {
    pthread_mutex_lock(&s->lock);
    uint64_t n = s->disk_deadline_misses;
    pthread_mutex_unlock(&s->lock);
    return n;
}

static void params_free(sreq_params *p) {
    free(p->prompt);
    p->prompt = NULL;
    chat_turn_predictor_free(p->plan.predictor);
    p->plan.predictor = NULL;
    for (int i = 0; i < p->n_stop; i++) free(p->stop[i]);
    p->n_stop = 0;
}

sched_status sched_submit(sched *s, sreq_params *p, sreq **out, ember_error *err) {
    *out = NULL;
    if (p->max_tokens < 1) p->max_tokens = 1;
    engine_req_params ep;
    memset(&ep, 0, sizeof ep);
    ep.prompt = p->prompt;
    ep.n_prompt = p->n_prompt;
    ep.max_tokens = p->max_tokens;
    ep.salt = p->salt;
    ep.cache = ENGINE_CACHE_ON;
    ep.prefill_step = s->cfg.prefill_step;
    ep.plan = p->plan;
    ep.async = true;
    ep.drafter = engine_drafter(s->e);
    ep.disk_wait_ms = s->cfg.disk_wait_ms;
    engine_req *q = engine_req_create(s->e, &ep, err);
    if (q == NULL) {
        bool too_long = p->n_prompt > s->n_ctx || strstr(err->msg, "KV blocks") != NULL;
        params_free(p);
        return too_long ? SCHED_TOO_LONG : SCHED_ERROR;
    }
    sreq *r = calloc(1, sizeof *r);
    if (r == NULL) {
        engine_req_free(q);
        params_free(p);
        ember_fail(err, "out of memory");
        return SCHED_ERROR;
    }
    pthread_mutex_init(&r->lock, NULL);
    pthread_cond_init(&r->cond, NULL);
    atomic_init(&r->refs, 2);
    atomic_init(&r->cancel, false);
    r->p = *p;
    memset(p, 0, sizeof *p);
    r->q = q;
    r->need_blocks = engine_req_need_blocks(q);
    r->t_arrive = ember_now();
    r->smp = sampler_create(&r->p.sampling);
    r->ts = tok_stream_create(s->tok, false);
    if (r->smp == NULL || r->ts == NULL) {
        sreq_free(r);
        ember_fail(err, "out of memory");
        return SCHED_ERROR;
    }
    for (int64_t i = 0; i < r->p.n_prompt; i++) sampler_accept(r->smp, r->p.prompt[i]);
    pthread_mutex_lock(&s->lock);
    sched_status st = SCHED_OK;
    if (s->draining) st = SCHED_DRAINING;
    else if (s->q_len >= s->cfg.queue_size && s->cfg.queue_size >= 0 &&
             !(s->q_len == 0 && s->n_running_pub < s->cfg.max_running))
        st = SCHED_FULL;
    if (st == SCHED_OK) {
        if (s->q_tail) s->q_tail->next = r;
        else s->q_head = r;
        s->q_tail = r;
        s->q_len++;
        pthread_cond_broadcast(&s->wake);
    }
    pthread_mutex_unlock(&s->lock);
    if (st != SCHED_OK) {
        ember_fail(err, st == SCHED_DRAINING ? "the server is shutting down" : "the request queue is full");
        sreq_free(r);
        return st;
    }
    *out = r;
    return SCHED_OK;
}
