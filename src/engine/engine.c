/* engine.c - the synchronous request runner (see engine.h).
 *
 * A request owns one kv_seq for its lifetime. The cache fills it first
 * (apc_lookup); the engine then appends on the grid, always through the
 * cache's apc_seq_* calls because the pool is shared with other requests
 * and with the cache's own bookkeeping. The three store points are called
 * unconditionally; each tier keeps the ones it uses:
 *
 *     lookup -> [p, N-1) grid chunks -> PAUSE(N-1) -> token N-1 alone
 *            -> PREFILL(N) -> decode ... -> RETIRE(prompt + reply)
 *
 * Retirement stores the tokens whose K/V exist: the prompt and every
 * generated token but the last (it was sampled, never forwarded). When one
 * more forward makes the stored sequence more useful (the exact tier: always;
 * the block tier: when it completes a block) the engine spends it, so that the
 * next turn of the conversation warm-starts past the whole reply.
 *
 * The calls to the cache go through engine_cache.h (the same protocol the
 * server's scheduler drives): ckpt- and exact-tier caches get a per-request
 * apc_req (apc_ckpt.h), so the prefill loop also stops where it schedules a
 * checkpoint, decode reports each step, retirement goes through it. Models with recurrent layers carry
 * a model_state per request in every batch row (model_batch.states); it is
 * restored by the lookup together with the K/V and read by the stores.
 *
 * Model contexts (scratch buffers, a thread pool) are not shareable, so the
 * engine keeps a small stack of idle ones; a concurrent call creates another. */
#include "engine/engine.h"

#include <pthread.h>

#include "engine/engine_cache.h"
#include <stdlib.h>
#include <string.h>

#include "core/clock.h"
#include "core/log.h"

#define ENGINE_MAX_IDLE_CTX 64

struct engine {
    const model *m;
    engine_config cfg;
    kv_pool *pool;
    apc *cache;
    int n_vocab;
    pthread_mutex_t ctx_lock;
    model_ctx *idle[ENGINE_MAX_IDLE_CTX];
    int n_idle;
    bool stateful;                  /* recurrent layers: a model_state per request */
    pthread_mutex_t prefill_lock;   /* ckpt tier: one prompt prefill at a time */
};

engine_config engine_default_config(void) {
    engine_config c;
    memset(&c, 0, sizeof c);
    c.n_threads = 0;
    c.prefill_step = 512;
    c.num_blocks = 0;
    c.n_ctx = 0;
    c.cache = apc_default_config();
    return c;
}

engine_request engine_default_request(void) {
    engine_request r;
    memset(&r, 0, sizeof r);
    r.max_tokens = 16;
    r.sampling = sampler_default_params();
    r.sampling.temperature = 0.0f;
    r.cache = ENGINE_CACHE_ON;
    r.stop_at_eog = true;
    return r;
}

int32_t engine_default_blocks(const model *m, int n_ctx) {
    kv_pool_config kc;
    model_kv_config(m, 1, &kc);
    size_t row = 0;
    for (int l = 0; l < kc.n_layer; l++) row += (size_t)kc.k_width[l] + (size_t)kc.v_width[l];
    size_t block_bytes = (row ? row : 1) * KV_BLOCK_TOKENS * sizeof(float);
    int64_t want = 4 * (((int64_t)n_ctx + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS);
    int64_t most = (int64_t)(((size_t)2 << 30) / block_bytes);
    if (want > most) want = most;
    if (want < 64) want = 64;
    return (int32_t)want;
}

engine *engine_create(const model *m, const engine_config *cfg_in, ember_error *err) {
    engine_config cfg = cfg_in ? *cfg_in : engine_default_config();
    const model_hparams *hp = model_get_hparams(m);
    if (cfg.prefill_step < 1) cfg.prefill_step = 512;
    if (cfg.n_ctx <= 0) cfg.n_ctx = hp->n_ctx_train > 0 ? hp->n_ctx_train : 2048;
    if (cfg.num_blocks <= 0) cfg.num_blocks = engine_default_blocks(m, cfg.n_ctx);
    engine *e = calloc(1, sizeof *e);
    if (e == NULL) {
        ember_fail(err, "engine: out of memory");
        return NULL;
    }
    pthread_mutex_init(&e->ctx_lock, NULL);
    pthread_mutex_init(&e->prefill_lock, NULL);
    e->m = m;
    e->stateful = model_has_state(m);
    e->cfg = cfg;
    e->n_vocab = hp->n_vocab;
    kv_pool_config kc;
    model_kv_config(m, cfg.num_blocks, &kc);
    e->pool = kv_pool_create(&kc, err);
    if (e->pool == NULL) goto fail;
    ember_log(EMBER_LOG_INFO, "KV pool: %d blocks of %d tokens (%lld tokens, %.1f MiB)", cfg.num_blocks,
              KV_BLOCK_TOKENS, (long long)cfg.num_blocks * KV_BLOCK_TOKENS,
              (double)cfg.num_blocks * (double)kv_pool_block_bytes(e->pool) / (1024.0 * 1024.0));
    /* The SSD tier's namespace starts from the model file's fingerprint. */
    if (cfg.cache.disk.path && cfg.cache.disk.path[0] && !cfg.cache.disk.has_fingerprint && model_get_gguf(m)) {
        apc_model_fingerprint(model_get_gguf(m), cfg.cache.disk.fingerprint);
        cfg.cache.disk.has_fingerprint = true;
    }
    e->cache = apc_create(e->pool, &kc, model_cache_stack(m), &cfg.cache, err);
    if (e->cache == NULL) goto fail;
    apc_set_state_model(e->cache, m);
    return e;
fail:
    engine_free(e);
    return NULL;
}

void engine_free(engine *e) {
    if (e == NULL) return;
    for (int i = 0; i < e->n_idle; i++) model_ctx_free(e->idle[i]);
    apc_free(e->cache);
    kv_pool_free(e->pool);
    pthread_mutex_destroy(&e->ctx_lock);
    pthread_mutex_destroy(&e->prefill_lock);
    free(e);
}

apc *engine_cache(engine *e) { return e->cache; }
kv_pool *engine_pool(engine *e) { return e->pool; }
const model *engine_model(const engine *e) { return e->m; }
int engine_n_ctx(const engine *e) { return e->cfg.n_ctx; }

static model_ctx *ctx_borrow(engine *e, ember_error *err) {
    pthread_mutex_lock(&e->ctx_lock);
    model_ctx *c = e->n_idle > 0 ? e->idle[--e->n_idle] : NULL;
    pthread_mutex_unlock(&e->ctx_lock);
    if (c == NULL) c = model_ctx_create(e->m, e->pool, e->cfg.n_threads, e->cfg.prefill_step, err);
    return c;
}

static void ctx_return(engine *e, model_ctx *c) {
    pthread_mutex_lock(&e->ctx_lock);
    if (e->n_idle < ENGINE_MAX_IDLE_CTX) {
        e->idle[e->n_idle++] = c;
        c = NULL;
    }
    pthread_mutex_unlock(&e->ctx_lock);
    model_ctx_free(c);
}

void engine_result_free(engine_result *r) {
    if (r == NULL) return;
    free(r->tokens);
    free(r->logits);
    memset(r, 0, sizeof *r);
}

/* Per-request scratch for building batches. */
typedef struct run_state {
    engine *e;
    model_ctx *ctx;
    kv_seq seq;
    int64_t *pos;
    kv_seq **seqs;
    bool *want;
    float *logits;   /* (n_vocab) */
    int64_t forwarded;
    model_state *state;   /* recurrent layers; else NULL */
    model_state **states; /* (prefill_step) rows' states, or NULL */
} run_state;

/* Forwards tokens[0, n) at the sequence's next positions; logits of the
 * last one if want_last. n <= prefill_step. */
static int forward(run_state *rs, const int32_t *tokens, int n, bool want_last, ember_error *err) {
    if (apc_seq_prepare_append(rs->e->cache, &rs->seq, n, err) < 0) return -1;
    for (int i = 0; i < n; i++) {
        rs->pos[i] = rs->seq.n_tokens + i;
        rs->seqs[i] = &rs->seq;
        rs->want[i] = want_last && i == n - 1;
        if (rs->states) rs->states[i] = rs->state;
    }
    model_batch b = {n, tokens, rs->pos, rs->seqs, rs->want, rs->states};
    if (model_forward(rs->ctx, &b, rs->logits, err) < 0) return -1;
    rs->seq.n_tokens += n;
    rs->forwarded += n;
    return 0;
}

int engine_generate(engine *e, const engine_request *req, engine_result *out, ember_error *err) {
    memset(out, 0, sizeof *out);
    const int64_t N = req->n_prompt;
    const int V = e->n_vocab, step = e->cfg.prefill_step;
    const int max_tokens = req->max_tokens > 0 ? req->max_tokens : 0;
    if (N < 1 || req->prompt == NULL) return ember_fail(err, "the prompt has no tokens");
    if (N > e->cfg.n_ctx)
        return ember_fail(err, "the prompt has %lld tokens; the context holds %d", (long long)N, e->cfg.n_ctx);
    for (int64_t i = 0; i < N; i++)
        if (req->prompt[i] < 0 || req->prompt[i] >= V)
            return ember_fail(err, "prompt token %lld is %d, outside the vocabulary of %d", (long long)i,
                              req->prompt[i], V);
    /* Admission: the longest this request can get, plus one block for a
     * copy-on-write, must fit in the pool. */
    int64_t longest = N + max_tokens < e->cfg.n_ctx ? N + max_tokens : e->cfg.n_ctx;
    int64_t need = (longest + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS + 1;
    if (need > kv_pool_n_blocks(e->pool))
        return ember_fail(err,
                          "the request needs up to %lld KV blocks (%lld prompt + %d new tokens) but the pool has "
                          "%d (num_blocks)",
                          (long long)need, (long long)N, max_tokens, kv_pool_n_blocks(e->pool));

    double t0 = ember_now();
    ecache ec;
    memset(&ec, 0, sizeof ec);
    bool prefill_locked = false;
    run_state rs;
    memset(&rs, 0, sizeof rs);
    rs.e = e;
    kv_seq_init(&rs.seq);
    sampler *smp = sampler_create(&req->sampling);
    int32_t *all = malloc((size_t)(N + max_tokens + 1) * sizeof(int32_t)); /* prompt + reply */
    rs.pos = malloc((size_t)step * sizeof *rs.pos);
    rs.seqs = malloc((size_t)step * sizeof *rs.seqs);
    rs.want = malloc((size_t)step * sizeof *rs.want);
    rs.logits = malloc((size_t)V * sizeof(float));
    if (e->stateful) {
        rs.state = model_state_create(e->m, NULL);
        rs.states = malloc((size_t)step * sizeof *rs.states);
    }
    out->tokens = malloc((size_t)(max_tokens ? max_tokens : 1) * sizeof(int32_t));
    if (req->want_logits) out->logits = malloc((size_t)(max_tokens ? max_tokens : 1) * (size_t)V * sizeof(float));
    int rc = -1;
    if (smp == NULL || all == NULL || !rs.pos || !rs.seqs || !rs.want || !rs.logits || !out->tokens ||
        (req->want_logits && out->logits == NULL) || (e->stateful && (rs.state == NULL || rs.states == NULL))) {
        ember_fail(err, "out of memory for a request of %lld tokens", (long long)N);
        goto done;
    }
    rs.ctx = ctx_borrow(e, err);
    if (rs.ctx == NULL) goto done;
    memcpy(all, req->prompt, (size_t)N * sizeof(int32_t));
    for (int64_t i = 0; i < N; i++) sampler_accept(smp, req->prompt[i]);
    const bool lookup = req->cache == ENGINE_CACHE_ON || req->cache == ENGINE_CACHE_LOOKUP;
    const bool store = req->cache == ENGINE_CACHE_ON || req->cache == ENGINE_CACHE_STORE;
    {
        ecache_params ep;
        memset(&ep, 0, sizeof ep);
        ep.prompt = req->prompt;
        ep.n_prompt = N;
        ep.salt = req->salt;
        ep.prefill_step = step;
        ep.lookup = lookup;
        ep.store = store;
        ep.turn_pos = req->ckpt_turn_pos;
        ep.anchor_pos = req->sys_prefix_pos;
        ep.predict = req->next_turn_predict;
        ep.predict_user = req->next_turn_user;
        ecache_begin(&ec, e->cache, &ep);
    }
    if (ecache_serial(&ec)) {
        pthread_mutex_lock(&e->prefill_lock);
        prefill_locked = true;
    }

    /* 1. Lookup. */
    {
        double tc = ember_now();
        apc_hit hit = ecache_lookup(&ec, &rs.seq, rs.state);
        if (lookup) out->cache_s += ember_now() - tc;
        out->cached_tokens = hit.n_tokens;
        out->cache_source = hit.source;
    }
    /* 2. Prefill [cached, N-1) on the grid (stopping at scheduled
     * checkpoints; the PAUSE store at N-1). */
    while (rs.seq.n_tokens < N - 1) {
        int64_t p = rs.seq.n_tokens;
        int64_t end = (p / step + 1) * step;
        if (end > N - 1) end = N - 1;
        int64_t stop = ecache_next_stop(&ec, p);
        if (stop < end) end = stop;
        if (forward(&rs, req->prompt + p, (int)(end - p), false, err) < 0) goto done;
        double tc = ember_now();
        ecache_at(&ec, &rs.seq, rs.state);
        out->cache_s += ember_now() - tc;
    }
    /* 3. The last prompt token alone; then the post-prefill store. */
    if (forward(&rs, req->prompt + N - 1, 1, true, err) < 0) goto done;
    out->ttft_s = ember_now() - t0;
    out->prompt_forwarded = rs.forwarded;
    {
        double tc = ember_now();
        ecache_prefilled(&ec, &rs.seq, rs.state);
        out->cache_s += ember_now() - tc;
    }
    if (prefill_locked) {
        pthread_mutex_unlock(&e->prefill_lock);
        prefill_locked = false;
    }

    /* 4. Decode. */
    out->finish = ENGINE_FINISH_LENGTH;
    const tokenizer *tok = model_get_tokenizer(e->m);
    for (int i = 0; i < max_tokens; i++) {
        if (out->logits) memcpy(out->logits + (size_t)i * V, rs.logits, (size_t)V * sizeof(float));
        int32_t next = sampler_sample(smp, rs.logits, V);
        sampler_accept_generated(smp, next);
        out->tokens[out->n_tokens++] = next;
        all[N + i] = next;
        if (req->on_token && !req->on_token(req->user, next)) {
            out->finish = ENGINE_FINISH_STOPPED;
            break;
        }
        if (req->stop_at_eog && tok != NULL && tokenizer_is_eog(tok, next)) {
            out->finish = ENGINE_FINISH_EOG;
            break;
        }
        if (i + 1 == max_tokens) break;
        if (rs.seq.n_tokens >= e->cfg.n_ctx) {
            out->finish = ENGINE_FINISH_CTX;
            break;
        }
        if (forward(&rs, &next, 1, true, err) < 0) goto done;
        ecache_decode(&ec, all, &rs.seq, rs.state);
    }

    /* 5. Retirement. */
    if (store && apc_get_tier(e->cache) != APC_TIER_NONE) {
        double tc = ember_now(); /* the extra forward is a cost of the store */
        int64_t have = rs.seq.n_tokens, total = N + out->n_tokens;
        bool state_ok = true;
        if (have == total - 1 && have < e->cfg.n_ctx && ecache_retire_wants_last_token(&ec, have)) {
            ember_error ignored;
            /* Best effort: without the extra token the store is one shorter
             * (a recurrent state that failed mid-pass is not stored). */
            if (forward(&rs, &all[total - 1], 1, false, &ignored) < 0) {
                apc_seq_truncate(e->cache, &rs.seq, have);
                state_ok = rs.state == NULL;
            }
        }
        if (state_ok) ecache_retire(&ec, all, rs.seq.n_tokens, &rs.seq, rs.state);
        out->cache_s += ember_now() - tc;
    }
    out->n_vocab = V;
    out->n_prompt = N;
    out->forwarded = rs.forwarded;
    out->total_s = ember_now() - t0;
    rc = 0;
done:
    if (prefill_locked) pthread_mutex_unlock(&e->prefill_lock);
    ecache_end(&ec);
    model_state_free(rs.state);
    free(rs.states);
    apc_seq_release(e->cache, &rs.seq);
    if (rs.ctx) ctx_return(e, rs.ctx);
    sampler_free(smp);
    free(all);
    free(rs.pos);
    free(rs.seqs);
    free(rs.want);
    free(rs.logits);
    if (rc < 0) engine_result_free(out);
    return rc;
}
