/* serve_sched.h - continuous batching: one engine thread serves every
 * request of the server.
 *
 * Contract:
 *  - The scheduler's thread is the only one that runs forward passes or
 *    touches sequences; it owns the model context, and (through the engine
 *    bundle) the KV pool and the prompt cache. HTTP threads only submit,
 *    read results and cancel.
 *  - sched_submit validates the request against the context and the pool
 *    and queues it; a full queue or a draining server is refused at once
 *    (SCHED_FULL / SCHED_DRAINING: the HTTP layer answers 503).
 *  - Each iteration of the engine thread: drop cancelled requests (their
 *    blocks return to the pool, nothing is stored); admit queued requests
 *    while the running set has room and the pool can hold their worst
 *    case (prompt + max_tokens + 1 block), running the prompt-cache lookup
 *    at admission. Admission order: among the queued requests that fit,
 *    the tenant (sreq_params.tenant_id) whose last admission is oldest
 *    goes first, arrival order within a tenant (round-robin across
 *    tenants); a request that does not fit is passed over, so it never
 *    blocks smaller ones behind it, but at most 16 times: then nothing
 *    behind it is admitted until it fits (no starvation); forward one prefill batch of at most `step` tokens
 *    (chunks never cross a grid point k*step and end on a block boundary
 *    or at N-1; the oldest prefilling request is guaranteed a quarter of
 *    the batch, the others take the rest shortest first, so a short
 *    request arriving during a long prefill waits about one batch, not the
 *    whole prompt); then one batched decode step over every decoding sequence in a
 *    single model_forward. Every request moves through the one driver
 *    (engine_req.h) that engine_generate uses too: lookup, prefill chunks that
 *    also stop at the cache's scheduled checkpoints (turn boundary,
 *    system-prompt anchor, interval points, N-1), PAUSE store at N-1, the
 *    last prompt token forwarded alone (as the request's first decode row),
 *    PREFILL store, decode-time snapshots, RETIRE store of prompt + reply
 *    keyed on the predicted next-turn render (with the extra forward of the
 *    last token when the cache wants it), all before the request is
 *    reported finished, so that a client that sends its next turn after the
 *    reply sees the stored prefix. On a ckpt-tier cache the prompt phase
 *    (lookup through the PREFILL store) runs one request at a time, in
 *    admission order, while decode rows of the others still batch.
 *  - The SSD tier's reads for a request run on the engine's fetch threads
 *    from its admission; it takes no rows until they land or disk_wait_ms
 *    passes, then looks up what memory holds. Others keep decoding.
 *  - Freshness gate: a queued request that shares at least fresh_min
 *    uncached prompt tokens with a request still in its prompt phase (or
 *    admitted before it in the same round) waits, up to fresh_wait_ms, for
 *    that request's store instead of prefilling the prefix cold; the queue
 *    keeps its order behind it.
 *  - Rows are batch-invariant (model.h), so a request's greedy output does
 *    not depend on its neighbours.
 *  - Output: text is detokenized as UTF-8 (incomplete characters held back)
 *    and checked against the stop strings across token boundaries; text
 *    that could still become a stop string is held back, a matched stop
 *    string is never emitted, and the generation ends there.
 *  - Requests are reference counted: the submitter holds one reference, the
 *    engine another while the request is queued or running. */
#ifndef EMBER_SERVE_SCHED_H
#define EMBER_SERVE_SCHED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/error.h"
#include "engine/engine.h"
#include "sample/sampler.h"
#include "serve/serve_metrics.h"

#define SCHED_MAX_TOP_LOGPROBS 20
#define SCHED_MAX_STOP 16

typedef struct sched sched;
typedef struct sreq sreq;

typedef struct sched_config {
    int n_threads;
    int prefill_step;
    int max_running;
    int queue_size;
    int fresh_wait_ms;        /* freshness gate: longest hold of a sibling; <= 0: gate off */
    int fresh_min;            /* ... when it shares at least this many uncached tokens */
    int disk_wait_ms;         /* longest wait of a request for its SSD reads; <= 0: 1000 */
} sched_config;

typedef struct sreq_params {
    int32_t *prompt;          /* taken over by sched_submit (freed with the request) */
    int64_t n_prompt;
    int max_tokens;           /* >= 1; clipped to the context */
    sampler_params sampling;
    uint64_t salt;
    uint64_t tenant_id;       /* fairness: requests are admitted round-robin across tenant ids */
    char *stop[SCHED_MAX_STOP]; /* taken over */
    int n_stop;
    int top_logprobs;         /* -1: no logprobs; 0..20: logprobs with that many alternatives */
    bool ignore_eos;
    /* What the chat template tells the cache (chat requests; all zero
     * otherwise); the predictor is taken over. Predictions run on the
     * engine's predictor thread, never on the engine thread. */
    chat_cache_plan plan;
} sreq_params;

typedef enum sched_status {
    SCHED_OK = 0,
    SCHED_FULL = 1,
    SCHED_DRAINING = 2,
    SCHED_TOO_LONG = 3,       /* prompt cannot fit the context or the pool */
    SCHED_ERROR = 4,
} sched_status;

typedef enum sreq_finish {
    SREQ_RUNNING = 0,
    SREQ_STOP = 1,      /* end-of-generation token or a stop string */
    SREQ_LENGTH = 2,    /* max_tokens or the context */
    SREQ_CANCELLED = 3,
    SREQ_FAILED = 4,
} sreq_finish;

/* One generated token with its log-probability (raw logits). */
typedef struct sreq_logprob {
    int32_t token;
    char *piece;              /* raw bytes of the token (may be partial UTF-8) */
    int piece_len;
    float logprob;
    int n_top;
    int32_t top_ids[SCHED_MAX_TOP_LOGPROBS];
    float top_lp[SCHED_MAX_TOP_LOGPROBS];
} sreq_logprob;

/* What a reader has taken so far. */
typedef struct sreq_cursor {
    size_t text;
    int logprobs;
    bool saw_first;
} sreq_cursor;

/* A snapshot of new output since a cursor. */
typedef struct sreq_delta {
    char *text;               /* malloc'd, NUL-terminated (may be "") */
    size_t len;
    int lp_from, lp_to;       /* new logprob entries [from, to) (sreq_logprob_at) */
    bool first;               /* the first generated token has been produced */
    sreq_finish finish;       /* != RUNNING: no more output will come */
} sreq_delta;

typedef struct sreq_usage {
    int64_t prompt_tokens, cached_tokens;
    int completion_tokens;
    double ttft_s, total_s;
    char error[256];
} sreq_usage;

/* ---- API ---- */
sched *sched_create(engine *e, const sched_config *cfg, serve_metrics *metrics, ember_error *err);
/* Stops accepting, finishes every queued and running request, joins. */
void sched_drain(sched *s);
void sched_free(sched *s);
int sched_n_ctx(const sched *s);
void sched_counts(sched *s, int *running, int *waiting);
/* The freshness gate (reference §14.1): requests that entered the held
 * state, and why the last one did (copied into reason). */
uint64_t sched_fresh_holds(sched *s, char *reason, size_t reason_cap);
/* Requests whose SSD reads missed their deadline (they looked up without). */
uint64_t sched_disk_deadline_misses(sched *s);

sched_status sched_submit(sched *s, sreq_params *p, sreq **out, ember_error *err);
/* Waits up to timeout_ms for output past cur (or the finish); fills d and
 * advances cur. Returns true when d carries anything new. */
bool sreq_next(sreq *r, sreq_cursor *cur, int timeout_ms, sreq_delta *d);
void sreq_delta_free(sreq_delta *d);
/* Valid for entries [0, lp_to) of a delta until sreq_unref. */
const sreq_logprob *sreq_logprob_at(sreq *r, int i);
void sreq_usage_get(sreq *r, sreq_usage *u);
void sreq_cancel(sreq *r);
void sreq_unref(sreq *r);

#endif
