/* apc_ckpt.h - the checkpoint tier and the per-request cache protocol for
 * stacks with recurrent or sliding-window layers (design.md §4-§5,
 * prompt-cache reference §6.4, §7).
 *
 * Contract:
 *  - A checkpoint record at position p is (tokens [0, p), salt, kind) plus
 *    what restores the whole sequence state at p: one reference on each pool
 *    block covering [0, p) (kv and rot layers: ember keeps every position of
 *    a sliding layer in the paged pool, so the chain also pins each window),
 *    and, on stacks with arr layers, a model_state snapshot at p. Records
 *    dedup through the pool: two records of one conversation share blocks.
 *  - Kinds: boundary (grid interval points, the turn checkpoint, p = N),
 *    anchor (system-prompt end; the first boundary of a fresh chain is
 *    promoted), replay (N-1), retire (end of a request).
 *  - Retention (reference §7.4): one replay and one anchor per chain,
 *    strip-on-extend keeps `heavy` plain records per chain, then a record
 *    cap and a byte budget over snapshot bytes evict least recently used
 *    non-anchors first. When the pool runs dry (apc_seq_prepare_append)
 *    records are evicted, least recently used first, and counted as
 *    ckpt_pool_evictions.
 *  - Lookup adopts only a record whose tokens are a verbatim prefix of the
 *    query, p <= N-1, same salt; on arr layouts a replay record adopts only
 *    for the identical resend (p == N-1; the replay gate). A record that
 *    matched but could not be adopted is a missed adoption.
 *  - The cache never fails a request: every problem is a counted decline.
 *
 * The per-request protocol (apc_req) is how a runner (engine_generate, the
 * server's scheduler) drives the ckpt and exact tiers:
 *
 *     r = apc_req_begin(cache, &params)       NULL: use apc_lookup/apc_store
 *     hit = apc_req_lookup(r, seq, state)      longest restorable prefix
 *     apc_req_arm(r, hit.n_tokens)             the prefill schedule
 *     prefill: chunks end at min(grid end, N-1, apc_req_next_stop(r, p));
 *              after each chunk apc_req_at(r, seq, state)
 *     last prompt token alone, then apc_req_prefilled(r, seq, state)
 *     decode: after each forward apc_req_decode(r, all, seq, state)
 *     finish: apc_req_retire(r, all, n, seq, state); apc_req_end(r)
 *
 * Stores read the live sequence (seq->n_tokens == p) and, for recurrent
 * stacks, the live state (model_state_pos == p): a mismatch is declined
 * (`offset`). Calls for one request come from one thread. */
#ifndef EMBER_APC_CKPT_H
#define EMBER_APC_CKPT_H

#include <stdbool.h>
#include <stdint.h>

#include "apc/apc.h"
#include "model/model.h"

typedef enum apc_ckpt_kind {
    APC_CKPT_BOUNDARY = 0,
    APC_CKPT_ANCHOR = 1,
    APC_CKPT_REPLAY = 2,
    APC_CKPT_RETIRE = 3,
} apc_ckpt_kind;

/* ckpt_declines reasons (reference §11.1 names). */
typedef enum apc_ckpt_decline {
    APC_CKPT_DECLINE_LAYOUT = 0,  /* p < 2, or the tier cannot store */
    APC_CKPT_DECLINE_BUFFERED,    /* (reference only; never in ember) */
    APC_CKPT_DECLINE_OFFSET,      /* the sequence / state is not at p */
    APC_CKPT_DECLINE_GRID,        /* sliding layers below the window, off the block grid */
    APC_CKPT_DECLINE_SHORT_CHAIN, /* the pool cannot hold the chain */
    APC_CKPT_DECLINE_CANON,       /* (reference only) */
    APC_CKPT_DECLINE_CLONE,       /* a state snapshot could not be made or restored */
    APC_CKPT_DECLINE_EXCEPTION,   /* out of memory for a record */
    APC_CKPT_DECLINE_ANCHOR_CLONE,/* an exact anchor snapshot could not be made */
    APC_CKPT_DECLINE_REPLAY_GATE, /* a replay record matched a longer query (arr) */
    APC_CKPT_DECLINE_COUNT_
} apc_ckpt_decline;

const char *apc_ckpt_decline_name(apc_ckpt_decline d);
const char *apc_ckpt_kind_name(apc_ckpt_kind k);

/* ---- The prefill schedule (reference §7.2), pure ---- */
typedef struct apc_ckpt_point {
    int64_t pos;
    apc_ckpt_kind kind;
} apc_ckpt_point;

typedef struct apc_ckpt_sched_in {
    int64_t n;          /* prompt tokens */
    int64_t guard;      /* last position prefill reaches before the final token (N-1) */
    int64_t restored;   /* adopted prefix */
    int unit;           /* prefill grid step (lcm with the block size) */
    bool has_arr;       /* arr (or list) layers */
    int window;         /* largest sliding window, 0 if none */
    int64_t p_stable;   /* turn boundary; <= 0: none */
    int64_t sys_lcp;    /* system-prompt end; <= 0: none */
    apc_ckpt_config cfg;
} apc_ckpt_sched_in;

/* Writes the sorted points (at most cap) and returns their count; bounds
 * (at most 2) receive the turn positions ("p_stable bounds"). */
int apc_ckpt_schedule(const apc_ckpt_sched_in *in, apc_ckpt_point *out, int cap, int64_t *bounds, int *n_bounds);

/* ---- Per request ---- */
typedef struct apc_req_params {
    const int32_t *prompt;    /* must outlive the apc_req */
    int64_t n_prompt;
    uint64_t salt;
    int prefill_step;         /* the runner's grid step */
    bool lookup, store;       /* engine_cache_mode */
    int64_t turn_pos;         /* predicted next-turn boundary (p_stable, reference §9.2); <= 0: none */
    int64_t anchor_pos;       /* system-prompt end (reference §9.3); <= 0: none */
    apc_predict_fn predict;   /* next-turn render prediction: decode checkpoints, retire keying */
    void *predict_user;
} apc_req_params;

typedef struct apc_req apc_req;

/* NULL when the cache's tier needs no request object (block, none) or
 * out of memory; the runner then uses apc_lookup/apc_store. */
apc_req *apc_req_begin(apc *c, const apc_req_params *p);
apc_hit apc_req_lookup(apc_req *r, kv_seq *seq, model_state *state);
void apc_req_arm(apc_req *r, int64_t restored);
/* The next position > p where prefill must stop; INT64_MAX if none. */
int64_t apc_req_next_stop(const apc_req *r, int64_t p);
/* Prefill stands at seq->n_tokens (< N): stores scheduled there. */
void apc_req_at(apc_req *r, const kv_seq *seq, const model_state *state);
/* All N prompt tokens are in: the post-prefill store. */
void apc_req_prefilled(apc_req *r, const kv_seq *seq, const model_state *state);
/* A generated token was forwarded: all[0, seq->n_tokens) is the sequence. */
void apc_req_decode(apc_req *r, const int32_t *all, const kv_seq *seq, const model_state *state);
/* Whether one more forward of the last generated token is worth it. */
bool apc_req_retire_wants_last_token(const apc_req *r, int64_t n_kv);
void apc_req_retire(apc_req *r, const int32_t *all, int64_t n, const kv_seq *seq, const model_state *state);
void apc_req_end(apc_req *r);
/* Whether prompts on this cache prefill one request at a time (ckpt tier). */
bool apc_prefill_serial(const apc *c);

#endif
