/* apc_req.h - one request's way through the prompt cache.
 *
 * Every tier is driven through this one object, created per request by the
 * request driver (src/engine/engine_req.c, its only caller). It dispatches
 * once, through the tier's operations table (apc_internal.h), so a runner
 * never asks which tier it talks to.
 *
 * States, and the function that makes each transition:
 *
 *     NEW ----apc_req_lookup----> PREFILL ----apc_req_prefilled----> DECODE
 *                                  | apc_req_at                        | apc_req_decode
 *                                  | (stays)                           | apc_req_predicted (stays)
 *                                                                      |
 *                        RETIRED <----------apc_req_retire-------------+
 *
 *     apc_req_free ends the object from any state (a cancelled or failed
 *     request stores nothing more).
 *
 * Invariants (assert in debug builds):
 *   NEW      a request that looks up hands apc_req_lookup an empty
 *            sequence and a state (recurrent stacks) at position 0.
 *   PREFILL  restored <= seq->n_tokens <= N-1; the runner's prefill chunks
 *            end at min(grid end, N-1, apc_req_next_stop(r, p)) and it calls
 *            apc_req_at after each, so every scheduled stop is visited.
 *   DECODE   seq->n_tokens >= N: the whole prompt has K/V (the last prompt
 *            token was forwarded alone, as the first decode row).
 *   RETIRED  nothing but apc_req_free.
 *
 * Stores read the live sequence and, on recurrent stacks, the live state,
 * which must stand at the store's position (else the store is declined and
 * counted, never wrong). A request that neither looks up nor stores (cache
 * bypass) still walks the states; its calls do nothing.
 *
 * Render prediction (where the next turn's render diverges from this
 * conversation's tokens) is an input here, never a callback: it costs a
 * template render and a re-tokenisation, so the driver computes it off the
 * engine thread. The checkpoint tier asks for one at decode snapshot
 * points (apc_req_decode returns the position) and at retirement
 * (apc_req_retire_wants_prediction); the driver hands the answers back
 * with apc_req_predicted and apc_req_retire.
 *
 * A NULL apc_req (out of memory at creation) is a request the cache
 * ignores: every call accepts it and does nothing. One request's calls come
 * from one thread. */
#ifndef EMBER_APC_REQ_H
#define EMBER_APC_REQ_H

#include <stdbool.h>
#include <stdint.h>

#include "apc/apc.h"
#include "kv/kv_pool.h"

typedef enum apc_req_state {
    APC_REQ_NEW = 0,
    APC_REQ_PREFILL = 1,
    APC_REQ_DECODE = 2,
    APC_REQ_RETIRED = 3,
} apc_req_state;

/* What the chat template tells the cache about a request; only decides
 * where to store, never what a lookup adopts (design.md invariant 2). */
typedef struct apc_hints {
    int64_t turn_pos;   /* predicted next-turn boundary (p_stable, reference §9.2); <= 0: none */
    int64_t anchor_pos; /* end of the system prompt (reference §9.3); <= 0: none */
    bool predicts;      /* the driver can answer next-turn render predictions */
} apc_hints;

typedef struct apc_req_params {
    const int32_t *prompt; /* must outlive the apc_req */
    int64_t n_prompt;
    uint64_t salt;
    int prefill_step;      /* the runner's grid step */
    bool lookup, store;    /* the request's cache mode */
    apc_hints hints;
} apc_req_params;

typedef struct apc_req apc_req;

/* ---- Lifetime ---- */
apc_req *apc_req_create(apc *c, const apc_req_params *p);
void apc_req_free(apc_req *r);
apc_req_state apc_req_get_state(const apc_req *r);
/* Whether prompts on this cache prefill one request at a time (ckpt tier:
 * a batched prefill takes no checkpoints), from the lookup to prefilled. */
bool apc_req_serial(const apc_req *r);
/* Whether prefill stores what it passes as it goes (the block tier over
 * recurrent layers), so a sibling waiting for a shared prefix can start as
 * soon as the storing request has passed it. */
bool apc_req_progressive(const apc_req *r);

/* ---- Prompt phase ---- */
/* NEW -> PREFILL: fills the empty sequence (and state) with the longest
 * cached prefix, at most N-1 tokens, and plans the prefill's stops. */
apc_hit apc_req_lookup(apc_req *r, kv_seq *seq, model_state *state);
/* NEW -> PREFILL without a lookup: the sequence (and state) already hold
 * a prefix of n tokens (0 < n <= N-1) that came from outside the cache
 * (the engine's prefix layer); plans the prefill's stops from there. */
void apc_req_adopted(apc_req *r, const kv_seq *seq, int64_t n);
/* The next position > p where prefill must stop; INT64_MAX if none. */
int64_t apc_req_next_stop(const apc_req *r, int64_t p);
/* Prefill stands at seq->n_tokens (< N): the stores scheduled there. */
void apc_req_at(apc_req *r, const kv_seq *seq, const model_state *state);
/* PREFILL -> DECODE: all N prompt tokens have K/V; the post-prefill store. */
void apc_req_prefilled(apc_req *r, const kv_seq *seq, const model_state *state);

/* ---- Decode ---- */
/* A generated token was forwarded; all[0, seq->n_tokens) is the sequence.
 * Returns a position p > 0 when the cache wants the render prediction of
 * all[0, p) (answer with apc_req_predicted), else 0. */
int64_t apc_req_decode(apc_req *r, const int32_t *all, const kv_seq *seq, const model_state *state);
/* The prediction asked for at p: the common prefix of all[0, p) and the
 * next turn's render, < 0 for none. Answers arrive in the order asked. */
void apc_req_predicted(apc_req *r, int64_t p, int64_t common);

/* ---- Retirement ---- */
/* Whether one more forward of the last generated token is worth it, so the
 * stored sequence covers the whole reply. n_kv: tokens with K/V. */
bool apc_req_retire_wants_last_token(const apc_req *r, int64_t n_kv);
/* Whether apc_req_retire needs the render prediction of all[0, n). */
bool apc_req_retire_wants_prediction(const apc_req *r);
/* DECODE -> RETIRED: stores all[0, n) (n <= seq->n_tokens), keyed where
 * the next turn will diverge (common: the prediction, < 0 for none). */
void apc_req_retire(apc_req *r, const int32_t *all, int64_t n, int64_t common, const kv_seq *seq,
                    const model_state *state);

#endif
