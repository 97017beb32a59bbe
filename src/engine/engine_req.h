/* engine_req.h - one request's driver over the model and the prompt cache.
 *
 * The one place that knows how a request moves: admission, the lookup,
 * prefill chunks on the grid that also stop where the cache wants a store,
 * the last prompt token forwarded alone, decode, the retirement's extra
 * forward and store. engine_generate (a scheduler of one) and the server's
 * scheduler (serve_sched.c, many requests per forward) both drive requests
 * through it, so a test of one is a test of the other. Batching stays with
 * the runner: the driver says what rows a request wants next, writes them
 * into the runner's batch, and is told when they were forwarded.
 *
 * Phases, and the function that moves a request between them:
 *
 *   ADMITTED --engine_req_fetch--> FETCH (SSD and Redis reads, off the engine thread)
 *   ADMITTED | FETCH --engine_req_lookup--> PROMPT --engine_req_forwarded--> FIRST
 *   (PROMPT while prompt[0, N-1) is not all in; FIRST is one row: prompt[N-1])
 *   FIRST --engine_req_forwarded--> SAMPLE (the runner samples from the logits)
 *   SAMPLE --engine_req_accept--> DECODE --engine_req_forwarded--> SAMPLE
 *          (or stays SAMPLE: speculation, below)
 *   SAMPLE | DECODE --engine_req_finish--> RETIRE (rows without logits)
 *                              |  PREDICT (waiting for a render prediction)
 *                              |  DONE
 *   RETIRE --engine_req_forwarded--> PREDICT | DONE
 *   PREDICT --engine_req_poll--> DONE
 *
 * Speculative decoding (params.drafter): a DECODE step's rows are the
 * committed tokens the sequence lacks (one, or more after a rollback) and
 * then up to k drafts; every row from the newest committed token on wants
 * logits. After the forward the runner samples row after row: a sampled
 * token equal to the draft the next row was fed keeps the request in
 * SAMPLE with that next row valid (engine_req_accept); the first that
 * differs, or the last row, settles the round: the sequence keeps the K/V
 * of the committed tokens but the newest, the rest is dropped, and a
 * recurrent state that ran past them is restored from the snapshot taken
 * before the round (its committed tokens are forwarded again next step,
 * batched with the new drafts). Each emitted token is sampled from the
 * target's own row at its position, and rows are batch-invariant, so the
 * output (tokens and logits) is the same bits as without speculation.
 *
 * Invariants: the sequence holds exactly the tokens forwarded; PROMPT rows
 * end at min(grid end, N-1, the cache's next stop); the last prompt token
 * is always one row of its own (its result does not depend on the others);
 * every cache call goes through apc_req (apc_req.h) in its order.
 *
 * Disk reads never run on the engine thread either: a lookup reads memory
 * only, and engine_req_fetch first brings what the SSD tier and the remote
 * tier (Redis) hold for the prompt into memory (apc_prefetch) on the
 * engine's fetch threads; the remote reads stop at their own deadline, a
 * share of what a cold prefill of the missing tokens costs (measured from
 * this engine's prompt chunks, apc_note_prefill). The
 * request waits in FETCH, without rows, until the reads land or its
 * deadline passes; then it looks up what was verified by then. A read that
 * hangs costs that request its disk hit, never another request anything.
 *
 * Render predictions (chat_plan.h) run off the engine thread on the
 * engine's predictor thread when the request was created with
 * async_predict; engine_req_poll delivers the answers in order. Without it
 * (engine_generate) they run inline: a scheduler of one stalls nobody.
 *
 * One request's calls come from one thread (the runner's); the predictor
 * thread only reads the tokens copied for it. */
#ifndef EMBER_ENGINE_REQ_H
#define EMBER_ENGINE_REQ_H

#include <stdbool.h>
#include <stdint.h>

#include "apc/apc_req.h"
#include "chat/chat_plan.h"
#include "engine/engine.h"
#include "engine/engine_spec.h"

typedef enum engine_req_phase {
    ENGINE_REQ_ADMITTED = 0,
    ENGINE_REQ_FETCH,         /* the SSD tier's reads run on a fetch thread */
    ENGINE_REQ_PROMPT,
    ENGINE_REQ_FIRST,
    ENGINE_REQ_SAMPLE,
    ENGINE_REQ_DECODE,
    ENGINE_REQ_RETIRE,
    ENGINE_REQ_PREDICT,
    ENGINE_REQ_DONE,
} engine_req_phase;

typedef struct engine_req_params {
    const int32_t *prompt;   /* copied */
    int64_t n_prompt;
    int max_tokens;          /* >= 0; with the prompt, clipped to the context for the admission */
    uint64_t salt;
    engine_cache_mode cache;
    int prefill_step;        /* the runner's grid step (chunks never cross k*step) */
    chat_cache_plan plan;    /* borrowed: its predictor must outlive the request */
    bool async;              /* predictions and disk reads on the engine's threads
                              * (the server); else inline (engine_generate) */
    int disk_wait_ms;        /* async: longest wait for the SSD reads; <= 0: 1000 (the
                              * remote tier's read deadline extends it when longer) */
    spec_drafter *drafter;   /* borrowed; NULL: no speculation */
    uint8_t *draft_marks;    /* borrowed, optional (max_tokens): SPEC_MARK_* per generated token */
} engine_req_params;

/* The arrays of one forward (model_batch), filled by engine_req_add_rows. */
typedef struct engine_batch {
    int n, cap;
    int32_t *tok;            /* (cap) */
    int64_t *pos;            /* (cap) */
    kv_seq **seq;            /* (cap) */
    bool *want;              /* (cap) */
    model_state **state;     /* (cap) when the model has recurrent state, else NULL */
    float *hidden;           /* (cap, n_embd) every row's hidden state when the drafter
                              * reads them (spec_drafter_wants_hidden), else NULL */
} engine_batch;

typedef struct engine_req engine_req;

/* ---- Lifetime ---- */
/* Validates the prompt against the vocabulary, the context and the pool
 * (err names the problem); allocates nothing in the pool. */
engine_req *engine_req_create(engine *e, const engine_req_params *p, ember_error *err);
/* Releases the sequence's blocks; stores nothing more. */
void engine_req_free(engine_req *q);

/* ---- Admission ---- */
/* Worst-case pool blocks: the prompt plus max_tokens (clipped to the
 * context), plus one for a copy-on-write of a shared partial block. */
int64_t engine_req_need_blocks(const engine_req *q);
/* The prompt phase of requests on this cache runs one at a time (ckpt tier). */
bool engine_req_serial(const engine_req *q);
/* Whether admitting q now would prefill cold a prefix that an earlier
 * request (earlier[0, n), still in its prompt phase or admitted with q)
 * is about to store: they share at least fresh_min tokens the cache does
 * not hold yet (reference §14.1). reason gets why. */
bool engine_req_fresh_hold(const engine_req *q, engine_req *const *earlier, int n, int fresh_min, char *reason,
                           size_t reason_cap);
/* ADMITTED -> FETCH when the cache has an SSD or remote tier and the request looks
 * up (async: the reads start on a fetch thread; inline: they are done on
 * return, and the request stays ADMITTED). */
void engine_req_fetch(engine_req *q);
/* Whether the lookup may run now: not in FETCH, or its reads landed, or
 * their deadline passed (*expired says which; the reads go on and whatever
 * they bring serves later requests). */
bool engine_req_fetch_ready(engine_req *q, bool *expired);
/* ADMITTED -> PROMPT or FIRST: the cache lookup (a request in FETCH gets
 * back to ADMITTED through engine_req_fetch_ready). */
apc_hit engine_req_lookup(engine_req *q);

/* ---- Rows ---- */
engine_req_phase engine_req_get_phase(const engine_req *q);
/* PROMPT: the length of the next prompt chunk when it may take at most
 * allow tokens (0: none fit); it never crosses a multiple of the request's
 * prefill_step and is cut on a block boundary when shortened. */
int64_t engine_req_prompt_chunk(const engine_req *q, int64_t allow);
/* FIRST, DECODE, RETIRE: the rows the next step adds when at most allow
 * fit (0: they do not fit now). DECODE asks the drafter here. */
int64_t engine_req_step_rows(engine_req *q, int64_t allow);
/* Rows of the last step that want logits (FIRST 1, DECODE 1 + drafts,
 * PROMPT and RETIRE 0), in batch order. */
int engine_req_logit_rows(const engine_req *q);
/* Appends n rows (PROMPT: n prompt tokens; FIRST, DECODE, RETIRE: the
 * engine_req_step_rows answer) to the batch, after making room in the pool. */
int engine_req_add_rows(engine_req *q, engine_batch *b, int64_t n, ember_error *err);
/* The rows added last were forwarded: advances the sequence and makes the
 * cache's stores at that point. */
void engine_req_forwarded(engine_req *q, int64_t n);

/* ---- Generation (SAMPLE) ---- */
/* The token sampled from the next unsampled logit row; SAMPLE -> DECODE,
 * or stays SAMPLE while it equals the draft the following row was fed. */
void engine_req_accept(engine_req *q, int32_t token);
/* Whether the committed tokens fill the context (the newest could not be
 * forwarded). */
bool engine_req_context_full(const engine_req *q);
/* The generation ended after n_generated tokens (the last one sampled, not
 * forwarded): SAMPLE | DECODE -> RETIRE, PREDICT or DONE. */
void engine_req_finish(engine_req *q);
/* RETIRE: its row could not be forwarded; retire one shorter (when the
 * recurrent state was not touched by a failed pass) or store nothing. */
void engine_req_retire_row_failed(engine_req *q, bool state_intact);
/* Delivers landed predictions (PREDICT -> DONE when the retirement's did). */
void engine_req_poll(engine_req *q);

/* ---- Reading ---- */
const int32_t *engine_req_tokens(const engine_req *q);   /* prompt + generated */
int engine_req_n_generated(const engine_req *q);
int64_t engine_req_n_kv(const engine_req *q);            /* tokens with K/V */
int64_t engine_req_cached(const engine_req *q);          /* adopted at the lookup */
apc_source engine_req_cache_source(const engine_req *q);
int64_t engine_req_forwarded_total(const engine_req *q); /* every row forwarded */
double engine_req_cache_seconds(const engine_req *q);    /* inside the cache's calls */
spec_stats engine_req_spec_stats(const engine_req *q);   /* zeros without a drafter */

/* ---- Batches ---- */
int engine_batch_init(engine_batch *b, int cap, bool with_states);
/* Adds the hidden rows an MTP drafter reads (n_embd floats a row). */
int engine_batch_want_hidden(engine_batch *b, int n_embd);
/* The model_batch of b's rows (hidden_all when b carries hidden rows). */
model_batch engine_batch_model(const engine_batch *b);
void engine_batch_free(engine_batch *b);

#endif
