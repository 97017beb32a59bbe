/* engine_cache.c - one request's prompt-cache protocol (see engine_cache.h).
 *
 * A thin dispatcher: with an apc_req (exact and ckpt tiers) every call goes
 * to the per-request protocol; without one (block tier, or no request
 * object) to the three store points of apc_store_state, which also serve
 * KV-only stacks (the state is NULL there). */
#include "engine/engine_cache.h"

#include <string.h>

void ecache_begin(ecache *ec, apc *cache, const ecache_params *p) {
    memset(ec, 0, sizeof *ec);
    ec->cache = cache;
    ec->prompt = p->prompt;
    ec->N = p->n_prompt;
    ec->salt = p->salt;
    ec->lookup = p->lookup;
    ec->store = p->store;
    if (!p->lookup && !p->store) return;
    apc_req_params ap;
    memset(&ap, 0, sizeof ap);
    ap.prompt = p->prompt;
    ap.n_prompt = p->n_prompt;
    ap.salt = p->salt;
    ap.prefill_step = p->prefill_step;
    ap.lookup = p->lookup;
    ap.store = p->store;
    ap.turn_pos = p->turn_pos;
    ap.anchor_pos = p->anchor_pos;
    ap.predict = p->predict;
    ap.predict_user = p->predict_user;
    ec->ar = apc_req_begin(cache, &ap);
}

bool ecache_serial(const ecache *ec) { return ec->ar != NULL && apc_prefill_serial(ec->cache); }

apc_hit ecache_lookup(ecache *ec, kv_seq *seq, model_state *state) {
    apc_hit hit = {0, APC_SOURCE_NONE};
    if (ec->lookup)
        hit = ec->ar ? apc_req_lookup(ec->ar, seq, state)
                     : apc_lookup_state(ec->cache, ec->prompt, ec->N, ec->salt, seq, state);
    ec->cached = hit.n_tokens;
    if (ec->ar) apc_req_arm(ec->ar, ec->cached);
    return hit;
}

int64_t ecache_next_stop(const ecache *ec, int64_t p) { return apc_req_next_stop(ec->ar, p); }

void ecache_at(ecache *ec, const kv_seq *seq, const model_state *state) {
    if (ec->ar) {
        apc_req_at(ec->ar, seq, state);
        return;
    }
    int64_t p = seq->n_tokens;
    if (ec->store && p == ec->N - 1 && p > ec->cached)
        apc_store_state(ec->cache, APC_STORE_PAUSE, ec->prompt, p, ec->salt, seq, state);
}

void ecache_prefilled(ecache *ec, const kv_seq *seq, const model_state *state) {
    if (!ec->store) return;
    if (ec->ar) apc_req_prefilled(ec->ar, seq, state);
    else apc_store_state(ec->cache, APC_STORE_PREFILL, ec->prompt, ec->N, ec->salt, seq, state);
}

void ecache_decode(ecache *ec, const int32_t *all, const kv_seq *seq, const model_state *state) {
    if (ec->ar && ec->store) apc_req_decode(ec->ar, all, seq, state);
}

static bool retires(const ecache *ec) { return ec->store && apc_get_tier(ec->cache) != APC_TIER_NONE; }

bool ecache_retire_wants_last_token(const ecache *ec, int64_t have) {
    if (!retires(ec)) return false;
    return ec->ar ? apc_req_retire_wants_last_token(ec->ar, have) : apc_retire_wants_last_token(ec->cache, have);
}

void ecache_retire(ecache *ec, const int32_t *all, int64_t n, const kv_seq *seq, const model_state *state) {
    if (!retires(ec)) return;
    if (ec->ar) apc_req_retire(ec->ar, all, n, seq, state);
    else apc_store_state(ec->cache, APC_STORE_RETIRE, all, n, ec->salt, seq, state);
}

void ecache_end(ecache *ec) {
    apc_req_end(ec->ar);
    ec->ar = NULL;
}
