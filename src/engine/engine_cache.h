/* engine_cache.h - the prompt-cache protocol of one request, shared by the
 * synchronous runner (engine_generate) and the server's scheduler.
 *
 * Design. The cache has three ways of being driven: the block tier (and a
 * cache that is off) through apc_lookup_state / apc_store_state at the
 * PAUSE, PREFILL and RETIRE points, and the exact and ckpt tiers through the
 * per-request apc_req protocol (apc_ckpt.h), which adds scheduled prefill
 * stops, decode-time snapshots and its own retirement. A runner should not
 * care which: it creates an ecache for the request and calls, in order,
 *
 *     ec = ecache_begin(cache, &params)          (never NULL-fatal)
 *     hit = ecache_lookup(ec, seq, state)        admission (under the serial
 *                                                gate when ecache_serial)
 *     prefill chunks end at min(grid end, N-1, ecache_next_stop(ec, p));
 *         after each chunk ecache_at(ec, seq, state)   (PAUSE at N-1 too)
 *     last prompt token alone; ecache_prefilled(ec, seq, state)
 *     each forwarded generated token: ecache_decode(ec, all, seq, state)
 *     at the finish: if ecache_retire_wants_last_token(ec, have) forward the
 *         last generated token; ecache_retire(ec, all, n, seq, state)
 *     ecache_end(ec)
 *
 * Every call is a no-op when the request does not look up / store (the
 * engine_cache_mode) or the tier is none. The cache never fails a request:
 * these calls have no error path. One request's calls come from one thread.
 * ecache_serial says whether prompts on this cache must prefill one request
 * at a time (ckpt tier): from the lookup through ecache_prefilled. */
#ifndef EMBER_ENGINE_CACHE_H
#define EMBER_ENGINE_CACHE_H

#include <stdbool.h>
#include <stdint.h>

#include "apc/apc.h"
#include "apc/apc_ckpt.h"
#include "kv/kv_pool.h"
#include "model/model.h"

typedef struct ecache_params {
    const int32_t *prompt;     /* must outlive the ecache */
    int64_t n_prompt;
    uint64_t salt;
    int prefill_step;
    bool lookup, store;
    int64_t turn_pos;          /* engine_request.ckpt_turn_pos */
    int64_t anchor_pos;        /* engine_request.sys_prefix_pos */
    apc_predict_fn predict;
    void *predict_user;
} ecache_params;

typedef struct ecache {
    apc *cache;
    apc_req *ar;               /* exact / ckpt tiers; NULL: block-tier calls */
    const int32_t *prompt;
    int64_t N;
    uint64_t salt;
    bool lookup, store;
    int64_t cached;            /* adopted at the lookup */
} ecache;

void ecache_begin(ecache *ec, apc *cache, const ecache_params *p);
bool ecache_serial(const ecache *ec);
apc_hit ecache_lookup(ecache *ec, kv_seq *seq, model_state *state);
int64_t ecache_next_stop(const ecache *ec, int64_t p);
void ecache_at(ecache *ec, const kv_seq *seq, const model_state *state);
void ecache_prefilled(ecache *ec, const kv_seq *seq, const model_state *state);
void ecache_decode(ecache *ec, const int32_t *all, const kv_seq *seq, const model_state *state);
bool ecache_retire_wants_last_token(const ecache *ec, int64_t have);
void ecache_retire(ecache *ec, const int32_t *all, int64_t n, const kv_seq *seq, const model_state *state);
void ecache_end(ecache *ec);

#endif
