/* apc_req.c - one request's cache protocol: the state machine of
 * apc_req.h, one dispatch through the tier's operations, and the two
 * tables that need nothing of their own (none, block).
 *
 * Why one object. Before it, a runner asked "is there a per-request
 * object?" and then the object asked "which tier am I?" at every call; the
 * sequencing lived in two runners. Now the state machine below is the only
 * place that knows the order of the calls (and asserts it), each tier's
 * table says what that tier does at each point, and the request driver in
 * src/engine is the only caller.
 *
 * What the tables do at each point (apc_ckpt.c holds exact and ckpt):
 *
 *     point        none   block                 exact                      ckpt
 *     lookup       -      block chain (+disk)   snapshot or anchor (+disk) record (+disk skeleton)
 *     plan         -      -                     arm the anchor             schedule stops, decode ring
 *     at p         -      -                     anchor; N-1 snapshot       scheduled records
 *     prefilled    -      index prompt blocks   -                          the p = N record
 *     decode       -      -                     -                          ring snapshots
 *     retire       -      index prompt+reply    snapshot prompt+reply      reference §7.7
 *
 * The block tier over recurrent layers (apc_snap.c) is the block column plus
 * state snapshots on the chain: stops every snapshot interval, at the hints
 * and at N-1; decode snapshots at interval points; retirement with the state.
 *
 * The flags lookup/store (a request's cache mode) are applied here, once,
 * so no table checks them. */
#include "apc/apc_req.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "apc/apc_internal.h"

static int64_t lcm64(int64_t a, int64_t b) {
    int64_t x = a, y = b;
    while (y) {
        int64_t t = x % y;
        x = y;
        y = t;
    }
    return a / x * b;
}

/* ---- Lifetime ---- */

apc_req *apc_req_create(apc *c, const apc_req_params *p) {
    apc_req *r = calloc(1, sizeof *r);
    if (r == NULL) return NULL;
    r->c = c;
    r->ops = apc__tier_ops(c);
    r->state = APC_REQ_NEW;
    r->prompt = p->prompt;
    r->N = p->n_prompt;
    r->salt = p->salt;
    r->unit = (int)lcm64(p->prefill_step > 0 ? p->prefill_step : KV_BLOCK_TOKENS, KV_BLOCK_TOKENS);
    r->lookup = p->lookup;
    r->store = p->store;
    r->hints = p->hints;
    return r;
}

void apc_req_free(apc_req *r) {
    if (r == NULL) return;
    for (int i = 0; i < r->n_snaps; i++) free(r->snaps[i].state);
    free(r->sched);
    free(r->keys);
    free(r);
}

bool apc_req_progressive(const apc_req *r) { return r != NULL && r->store && r->ops->progressive; }

apc_req_state apc_req_get_state(const apc_req *r) { return r ? r->state : APC_REQ_NEW; }

bool apc_req_serial(const apc_req *r) { return r != NULL && (r->lookup || r->store) && r->ops->serial; }

/* ---- Prompt phase ---- */

apc_hit apc_req_lookup(apc_req *r, kv_seq *seq, model_state *state) {
    apc_hit hit = {0, APC_SOURCE_NONE};
    if (r == NULL) return hit;
    assert(r->state == APC_REQ_NEW);
    if (r->lookup && r->N >= 1) {
        assert(seq->n_tokens == 0 && seq->n_blocks == 0);
        hit = r->ops->lookup(r, seq, state);
        assert(hit.n_tokens <= r->N - 1 || hit.n_tokens == 0);
        assert(seq->n_tokens == hit.n_tokens);
    }
    r->restored = hit.n_tokens;
    r->state = APC_REQ_PREFILL;
    if (r->store) r->ops->plan(r);
    return hit;
}

void apc_req_adopted(apc_req *r, const kv_seq *seq, int64_t n) {
    if (r == NULL) return;
    assert(r->state == APC_REQ_NEW);
    assert(n >= 1 && n <= r->N - 1 && seq->n_tokens == n);
    (void)seq;
    r->restored = n;
    r->state = APC_REQ_PREFILL;
    if (r->store) r->ops->plan(r);
}

int64_t apc_req_next_stop(const apc_req *r, int64_t p) {
    if (r == NULL || !r->store) return INT64_MAX;
    assert(r->state == APC_REQ_PREFILL);
    return r->ops->next_stop(r, p);
}

void apc_req_at(apc_req *r, const kv_seq *seq, const model_state *state) {
    if (r == NULL) return;
    assert(r->state == APC_REQ_PREFILL);
    assert(seq->n_tokens >= r->restored && seq->n_tokens < r->N);
    if (r->store) r->ops->at(r, seq, state);
}

void apc_req_prefilled(apc_req *r, const kv_seq *seq, const model_state *state) {
    if (r == NULL) return;
    assert(r->state == APC_REQ_PREFILL);
    assert(seq->n_tokens >= r->N);
    r->state = APC_REQ_DECODE;
    if (r->store) r->ops->prefilled(r, seq, state);
}

/* ---- Decode ---- */

int64_t apc_req_decode(apc_req *r, const int32_t *all, const kv_seq *seq, const model_state *state) {
    if (r == NULL) return 0;
    assert(r->state == APC_REQ_DECODE);
    assert(seq->n_tokens > r->N);
    return r->store ? r->ops->decode(r, all, seq, state) : 0;
}

void apc_req_predicted(apc_req *r, int64_t p, int64_t common) {
    if (r == NULL) return;
    assert(r->state == APC_REQ_DECODE);
    if (r->store) r->ops->predicted(r, p, common);
}

/* ---- Retirement ---- */

bool apc_req_retire_wants_last_token(const apc_req *r, int64_t n_kv) {
    if (r == NULL || !r->store) return false;
    assert(r->state == APC_REQ_DECODE);
    return r->ops->retire_wants_last_token(r, n_kv);
}

bool apc_req_retire_wants_prediction(const apc_req *r) {
    if (r == NULL || !r->store || !r->hints.predicts) return false;
    return r->ops->retire_wants_prediction(r);
}

void apc_req_retire(apc_req *r, const int32_t *all, int64_t n, int64_t common, const kv_seq *seq,
                    const model_state *state) {
    if (r == NULL) return;
    assert(r->state == APC_REQ_DECODE);
    assert(n <= seq->n_tokens);
    r->state = APC_REQ_RETIRED;
    if (r->store && n >= 1) r->ops->retire(r, all, n, common, seq, state);
}

/* ---- The shared no-op pieces ---- */

apc_hit apc__no_lookup(apc_req *r, kv_seq *seq, model_state *state) {
    (void)r, (void)seq, (void)state;
    apc_hit none = {0, APC_SOURCE_NONE};
    return none;
}
void apc__no_plan(apc_req *r) { (void)r; }
int64_t apc__no_stop(const apc_req *r, int64_t p) {
    (void)r, (void)p;
    return INT64_MAX;
}
void apc__no_at(apc_req *r, const kv_seq *seq, const model_state *state) { (void)r, (void)seq, (void)state; }
int64_t apc__no_decode(apc_req *r, const int32_t *all, const kv_seq *seq, const model_state *state) {
    (void)r, (void)all, (void)seq, (void)state;
    return 0;
}
void apc__no_predicted(apc_req *r, int64_t p, int64_t common) { (void)r, (void)p, (void)common; }
bool apc__no_prediction(const apc_req *r) {
    (void)r;
    return false;
}

/* ---- none: the cache is off for this model ---- */

static bool none_wants_last(const apc_req *r, int64_t n_kv) {
    (void)r, (void)n_kv;
    return false;
}
static void none_retire(apc_req *r, const int32_t *all, int64_t n, int64_t common, const kv_seq *seq,
                        const model_state *state) {
    (void)r, (void)all, (void)n, (void)common, (void)seq, (void)state;
}
static int64_t none_peek(apc *c, const int32_t *tokens, int64_t n, uint64_t salt) {
    (void)c, (void)tokens, (void)n, (void)salt;
    return 0;
}

const apc_tier_ops apc_none_ops = {
    .lookup = apc__no_lookup,
    .plan = apc__no_plan,
    .next_stop = apc__no_stop,
    .at = apc__no_at,
    .prefilled = apc__no_at,
    .decode = apc__no_decode,
    .predicted = apc__no_predicted,
    .retire_wants_last_token = none_wants_last,
    .retire_wants_prediction = apc__no_prediction,
    .retire = none_retire,
    .peek = none_peek,
    .prefetch = none_peek,
    .serial = false,
};

/* ---- block: the pool is the cache ---- */

static apc_hit block_lookup(apc_req *r, kv_seq *seq, model_state *state) {
    (void)state;
    return apc__lookup_blocks(r->c, r->prompt, r->N, r->salt, seq);
}

static void block_prefilled(apc_req *r, const kv_seq *seq, const model_state *state) {
    (void)state;
    apc__store_blocks(r->c, APC_STORE_PREFILL, r->prompt, r->N, r->salt, seq);
}

/* One more forward pays when it completes a block. */
static bool block_wants_last(const apc_req *r, int64_t n_kv) {
    (void)r;
    return (n_kv + 1) % KV_BLOCK_TOKENS == 0;
}

static void block_retire(apc_req *r, const int32_t *all, int64_t n, int64_t common, const kv_seq *seq,
                         const model_state *state) {
    (void)common, (void)state;
    apc__store_blocks(r->c, APC_STORE_RETIRE, all, n, r->salt, seq);
}

const apc_tier_ops apc_block_ops = {
    .lookup = block_lookup,
    .plan = apc__no_plan,
    .next_stop = apc__no_stop,
    .at = apc__no_at,
    .prefilled = block_prefilled,
    .decode = apc__no_decode,
    .predicted = apc__no_predicted,
    .retire_wants_last_token = block_wants_last,
    .retire_wants_prediction = apc__no_prediction,
    .retire = block_retire,
    .peek = apc__peek_blocks,
    .prefetch = apc__prefetch_blocks,
    .serial = false,
};
