/* engine.c - one model, its pool and cache, and the synchronous runner
 * (see engine.h).
 *
 * engine_generate is a scheduler of one: it drives a single request through
 * the same driver the server's scheduler uses (engine_req.h), forwarding
 * each chunk the driver asks for and sampling each step. The order of a
 * request (lookup, grid chunks, N-1 alone, decode, retirement) therefore
 * lives in one place, engine_req.c, for both runners.
 *
 * Model contexts (scratch buffers, a thread pool) are not shareable, so the
 * engine keeps a small stack of idle ones; a concurrent call creates
 * another. On a ckpt-tier cache the prompt phase of concurrent calls runs
 * one at a time (prefill_lock), as the scheduler's serial head does.
 *
 * The predictor thread (engine_internal.h) runs render predictions for
 * requests that ask for them asynchronously (the server's): one thread per
 * engine, started on the first job, so a template render never holds up a
 * forward pass. */
#include "engine/engine.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "engine/engine_req.h"

#include "core/clock.h"
#include "core/log.h"

#define ENGINE_MAX_IDLE_CTX 64
#define ENGINE_FETCH_THREADS 2 /* one read that hangs must not hold up the others */

struct engine {
    const model *m;
    engine_config cfg;
    kv_pool *pool;
    const char *attention_fallback; /* model_attention_precision's why, or NULL */
    apc *cache;
    spec_drafter *drafter;          /* speculative decoding, or NULL */
    prefix_layer *prefix;           /* L0 of a speculating engine, or NULL */
    int n_vocab;
    pthread_mutex_t ctx_lock;
    model_ctx *idle[ENGINE_MAX_IDLE_CTX];
    int n_idle;
    bool stateful;                  /* recurrent layers: a model_state per request */
    pthread_mutex_t prefill_lock;   /* ckpt tier: one prompt prefill at a time */
    /* the predictor thread */
    pthread_mutex_t predict_lock;
    pthread_cond_t predict_wake, predict_idle;
    engine_predict_job *predict_head, *predict_tail, *predicting;
    bool predict_started, predict_stop;
    pthread_t predict_thread;
    /* the fetch threads (SSD reads) */
    pthread_mutex_t fetch_lock;
    pthread_cond_t fetch_wake;
    engine_fetch_job *fetch_head, *fetch_tail;
    int n_fetch_threads;
    bool fetch_stop;
    pthread_t fetch_threads[ENGINE_FETCH_THREADS];
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

bool engine_has_kv(const model *m) {
    kv_pool_config kc;
    model_kv_config(m, 1, &kc);
    for (int l = 0; l < kc.n_layer; l++)
        if (kc.k_width[l] + kc.v_width[l] > 0) return true;
    return false;
}

size_t engine_block_bytes(const model *m, kv_format fmt) {
    kv_pool_config kc;
    model_kv_config(m, 1, &kc);
    kc.format = fmt;
    size_t row = kv_format_token_bytes(&kc);
    return (row ? row : 4) * KV_BLOCK_TOKENS;
}

static size_t config_block_bytes(const kv_pool_config *kc) {
    size_t row = 0;
    for (int l = 0; l < kc->n_layer; l++) row += (size_t)kc->k_width[l] + (size_t)kc->v_width[l];
    return row * KV_BLOCK_TOKENS * sizeof(float);
}

size_t engine_blocks_bytes(const model *m, kv_format fmt, const spec_config *spec) {
    size_t bytes = engine_block_bytes(m, fmt);
    kv_pool_config kc;
    if (spec && spec->kind == SPEC_DRAFT && spec->draft) {
        model_kv_config(spec->draft, 1, &kc);
        bytes += config_block_bytes(&kc);
    }
    if (spec && spec->kind == SPEC_MTP) {
        model_mtp_kv_config(m, 1, &kc);
        bytes += config_block_bytes(&kc);
    }
    return bytes;
}

int32_t engine_default_blocks(const model *m, int n_ctx) {
    size_t block_bytes = engine_block_bytes(m, (kv_format){KV_FORMAT_F32});
    int64_t want = 4 * (((int64_t)n_ctx + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS);
    int64_t most = (int64_t)(((size_t)2 << 30) / block_bytes);
    if (want > most) want = most;
    if (want < 64) want = 64;
    return (int32_t)want;
}

static model_state *state_create(const void *owner, ember_error *err) { return model_state_create(owner, err); }

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
    pthread_mutex_init(&e->predict_lock, NULL);
    pthread_cond_init(&e->predict_wake, NULL);
    pthread_cond_init(&e->predict_idle, NULL);
    pthread_mutex_init(&e->fetch_lock, NULL);
    pthread_cond_init(&e->fetch_wake, NULL);
    e->m = m;
    e->stateful = model_has_state(m);
    e->cfg = cfg;
    e->n_vocab = hp->n_vocab;
    kv_pool_config kc;
    model_kv_config(m, cfg.num_blocks, &kc);
    kc.format = cfg.kv_format;
    kc.attention = model_attention_precision(m, kc.format, cfg.attention, &e->attention_fallback);
    if (e->attention_fallback)
        ember_log(EMBER_LOG_WARN, "attention precision bf16 asked for, f32 used: %s", e->attention_fallback);
    e->pool = kv_pool_create(&kc, err);
    if (e->pool == NULL) goto fail;
    ember_log(EMBER_LOG_DEBUG, "KV pool: %d blocks of %d tokens (%lld tokens, %.1f MiB, kv_format=%s, %zu bytes/token)",
              cfg.num_blocks, KV_BLOCK_TOKENS, (long long)cfg.num_blocks * KV_BLOCK_TOKENS,
              (double)cfg.num_blocks * (double)kv_pool_block_bytes(e->pool) / (1024.0 * 1024.0),
              kv_format_name(kc.format), kv_format_token_bytes(&kc));
    /* The SSD and remote tiers' namespace starts from the model file's fingerprint. */
    bool shared_tier = (cfg.cache.disk.path && cfg.cache.disk.path[0]) || (cfg.cache.remote.url && cfg.cache.remote.url[0]);
    if (shared_tier && !cfg.cache.disk.has_fingerprint && model_get_gguf(m)) {
        engine_model_fingerprint(model_get_gguf(m), cfg.cache.disk.fingerprint);
        cfg.cache.disk.has_fingerprint = true;
    }
    apc_state_ops state_ops = {0, model_state_pos, model_state_snapshot, model_state_restore, model_state_reset,
                               state_create, model_state_free, m};
    if (e->stateful) state_ops.bytes = model_state_bytes(m);
    /* The routing line also says whether speculation and L0 are on. */
    char note[192];
    /* L0 copies a pool's rows word for word; kvarn's sealed records are not
     * copied that way yet, so L0 stays off on a kvarn pool (said below). */
    bool kvarn = kv_format_is_kvarn(cfg.kv_format);
    bool l0 = cfg.spec.kind != SPEC_OFF && cfg.spec.prefix_entries > 0 && !kvarn;
    if (cfg.spec.kind == SPEC_OFF)
        snprintf(note, sizeof note, "speculation off, L0 off");
    else if (l0)
        snprintf(note, sizeof note, "speculation %s (k=%d), L0 on (%d entries, %.0f MiB, min %d tokens)",
                 spec_kind_name(cfg.spec.kind), cfg.spec.k, cfg.spec.prefix_entries,
                 (double)cfg.spec.prefix_bytes / (1024.0 * 1024.0), cfg.spec.prefix_min);
    else
        snprintf(note, sizeof note, "speculation %s (k=%d), L0 off%s", spec_kind_name(cfg.spec.kind), cfg.spec.k,
                 kvarn && cfg.spec.prefix_entries > 0 ? " (kvarn pool)" : "");
    cfg.cache.route_note = note;
    e->cache = apc_create(e->pool, &kc, model_cache_stack(m), &state_ops, &cfg.cache, err);
    cfg.cache.route_note = NULL;
    e->cfg.cache.route_note = NULL;
    if (e->cache == NULL) goto fail;
    if (cfg.spec.kind != SPEC_OFF && kv_format_is_kvarn(cfg.kv_format)) {
        /* Rejected drafts truncate the sequence, which a sealed group cannot
         * undo (its fp16 rows are gone). */
        ember_fail(err, "KV format %s: speculative decoding is not supported with kvarn KV (spec mode %s)",
                   kv_format_name(cfg.kv_format), spec_kind_name(cfg.spec.kind));
        goto fail;
    }
    if (cfg.spec.kind != SPEC_OFF) {
        e->drafter = spec_drafter_create(m, &cfg.spec, cfg.num_blocks, cfg.n_threads, cfg.prefill_step, err);
        if (e->drafter == NULL) goto fail;
        spec_sidecar_attach(e->drafter, e->cache); /* the sidecar's SSD mirror */
        ember_log(EMBER_LOG_INFO, "speculative decoding: %s drafter, k = %d%s", spec_kind_name(cfg.spec.kind),
                  cfg.spec.k, cfg.spec.adaptive ? " (adaptive)" : "");
    }
    if (l0) {
        prefix_config pc = {cfg.spec.prefix_entries, cfg.spec.prefix_bytes, cfg.spec.prefix_min,
                            spec_state_words(e->drafter)};
        e->prefix = prefix_layer_create(&pc, m, e->pool, e->cache, err);
        if (e->prefix == NULL) goto fail;
    }
    return e;
fail:
    engine_free(e);
    return NULL;
}

void engine_free(engine *e) {
    if (e == NULL) return;
    if (e->predict_started) {
        pthread_mutex_lock(&e->predict_lock);
        e->predict_stop = true;
        pthread_cond_broadcast(&e->predict_wake);
        pthread_mutex_unlock(&e->predict_lock);
        pthread_join(e->predict_thread, NULL);
    }
    if (e->n_fetch_threads > 0) {
        pthread_mutex_lock(&e->fetch_lock);
        e->fetch_stop = true;
        pthread_cond_broadcast(&e->fetch_wake);
        pthread_mutex_unlock(&e->fetch_lock);
        for (int i = 0; i < e->n_fetch_threads; i++) pthread_join(e->fetch_threads[i], NULL);
    }
    while (e->fetch_head) { /* queued, never started: the thread's reference */
        engine_fetch_job *j = e->fetch_head;
        e->fetch_head = j->next_queued;
        engine__fetch_unref(j);
    }
    for (int i = 0; i < e->n_idle; i++) model_ctx_free(e->idle[i]);
    prefix_layer_free(e->prefix);
    spec_drafter_free(e->drafter);
    apc_free(e->cache);
    kv_pool_free(e->pool);
    pthread_mutex_destroy(&e->ctx_lock);
    pthread_mutex_destroy(&e->prefill_lock);
    pthread_mutex_destroy(&e->predict_lock);
    pthread_cond_destroy(&e->predict_wake);
    pthread_cond_destroy(&e->predict_idle);
    pthread_mutex_destroy(&e->fetch_lock);
    pthread_cond_destroy(&e->fetch_wake);
    free(e);
}

apc *engine_cache(engine *e) { return e->cache; }
kv_pool *engine_pool(engine *e) { return e->pool; }
attention_precision engine_attention_precision(const engine *e) { return kv_pool_attention(e->pool); }
const char *engine_attention_fallback(const engine *e) { return e->attention_fallback; }
const model *engine_model(const engine *e) { return e->m; }
int engine_n_ctx(const engine *e) { return e->cfg.n_ctx; }
spec_drafter *engine_drafter(engine *e) { return e->drafter; }
prefix_layer *engine_prefix(engine *e) { return e->prefix; }
int engine__prefill_step(const engine *e) { return e->cfg.prefill_step; }

/* ---- The predictor thread ---- */

void engine__predict_run(engine_predict_job *j) {
    j->result = chat_turn_predict(j->predictor, j->tokens, j->n);
    atomic_store(&j->done, true);
}

static void *predict_main(void *arg) {
    engine *e = arg;
    pthread_mutex_lock(&e->predict_lock);
    for (;;) {
        while (e->predict_head == NULL && !e->predict_stop) pthread_cond_wait(&e->predict_wake, &e->predict_lock);
        if (e->predict_head == NULL) break;
        engine_predict_job *j = e->predict_head;
        e->predict_head = j->next_queued;
        if (e->predict_head == NULL) e->predict_tail = NULL;
        e->predicting = j;
        pthread_mutex_unlock(&e->predict_lock);
        engine__predict_run(j);
        pthread_mutex_lock(&e->predict_lock);
        e->predicting = NULL;
        pthread_cond_broadcast(&e->predict_idle);
    }
    pthread_mutex_unlock(&e->predict_lock);
    return NULL;
}

void engine__predict_submit(engine *e, engine_predict_job *j) {
    pthread_mutex_lock(&e->predict_lock);
    if (!e->predict_started) {
        e->predict_started = pthread_create(&e->predict_thread, NULL, predict_main, e) == 0;
        if (!e->predict_started) {
            /* No thread: answer inline rather than never. */
            pthread_mutex_unlock(&e->predict_lock);
            engine__predict_run(j);
            return;
        }
    }
    j->next_queued = NULL;
    if (e->predict_tail) e->predict_tail->next_queued = j;
    else e->predict_head = j;
    e->predict_tail = j;
    pthread_cond_signal(&e->predict_wake);
    pthread_mutex_unlock(&e->predict_lock);
}

/* ---- The fetch threads ---- */

void engine__fetch_unref(engine_fetch_job *j) {
    if (j && atomic_fetch_sub(&j->refs, 1) == 1) {
        free(j->tokens);
        free(j);
    }
}

/* The thread's part of a job: the reads, then its reference. */
static void fetch_run(engine_fetch_job *j) {
    int64_t p = apc_prefetch(j->cache, j->tokens, j->n, j->salt);
    spec_sidecar_prefetch(j->drafter, j->tokens, p, j->n, j->salt); /* the drafter beside the target */
    atomic_store(&j->done, true);
    engine__fetch_unref(j);
}

static void *fetch_main(void *arg) {
    engine *e = arg;
    pthread_mutex_lock(&e->fetch_lock);
    for (;;) {
        while (e->fetch_head == NULL && !e->fetch_stop) pthread_cond_wait(&e->fetch_wake, &e->fetch_lock);
        if (e->fetch_head == NULL) break;
        engine_fetch_job *j = e->fetch_head;
        e->fetch_head = j->next_queued;
        if (e->fetch_head == NULL) e->fetch_tail = NULL;
        pthread_mutex_unlock(&e->fetch_lock);
        fetch_run(j);
        pthread_mutex_lock(&e->fetch_lock);
    }
    pthread_mutex_unlock(&e->fetch_lock);
    return NULL;
}

void engine__fetch_submit(engine *e, engine_fetch_job *j) {
    atomic_fetch_add(&j->refs, 1);
    pthread_mutex_lock(&e->fetch_lock);
    while (e->n_fetch_threads < ENGINE_FETCH_THREADS &&
           pthread_create(&e->fetch_threads[e->n_fetch_threads], NULL, fetch_main, e) == 0)
        e->n_fetch_threads++;
    if (e->n_fetch_threads == 0) { /* no thread: read inline rather than never */
        pthread_mutex_unlock(&e->fetch_lock);
        fetch_run(j);
        return;
    }
    j->next_queued = NULL;
    if (e->fetch_tail) e->fetch_tail->next_queued = j;
    else e->fetch_head = j;
    e->fetch_tail = j;
    pthread_cond_signal(&e->fetch_wake);
    pthread_mutex_unlock(&e->fetch_lock);
}

void engine__predict_cancel(engine *e, engine_predict_job *j) {
    if (atomic_load(&j->done)) return;
    pthread_mutex_lock(&e->predict_lock);
    engine_predict_job **pp = &e->predict_head, *prev = NULL;
    while (*pp && *pp != j) {
        prev = *pp;
        pp = &(*pp)->next_queued;
    }
    if (*pp == j) { /* still queued: unlink it */
        *pp = j->next_queued;
        if (e->predict_tail == j) e->predict_tail = prev;
    } else {
        while (e->predicting == j) pthread_cond_wait(&e->predict_idle, &e->predict_lock);
    }
    pthread_mutex_unlock(&e->predict_lock);
}

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

/* Forwards the rows the driver added; logits of the wanted row. */
static int forward_rows(model_ctx *ctx, engine_batch *b, float *logits, ember_error *err) {
    model_batch mb = engine_batch_model(b);
    int rc = model_forward(ctx, &mb, logits, err);
    b->n = 0;
    return rc;
}

int engine_generate(engine *e, const engine_request *req, engine_result *out, ember_error *err) {
    memset(out, 0, sizeof *out);
    const int V = e->n_vocab, step = e->cfg.prefill_step;
    const int max_tokens = req->max_tokens > 0 ? req->max_tokens : 0;
    engine_req_params rp;
    memset(&rp, 0, sizeof rp);
    rp.prompt = req->prompt;
    rp.n_prompt = req->n_prompt;
    rp.max_tokens = max_tokens;
    rp.salt = req->salt;
    rp.cache = req->cache;
    rp.prefill_step = step;
    rp.plan = req->plan;
    rp.async = false; /* a scheduler of one stalls nobody */
    rp.drafter = e->drafter;
    rp.draft_marks = req->draft_marks;
    engine_req *q = engine_req_create(e, &rp, err);
    if (q == NULL) return -1;
    const int64_t N = req->n_prompt;
    double t0 = ember_now();
    bool prefill_locked = false;
    int rc = -1;
    model_ctx *ctx = NULL;
    engine_batch b;
    memset(&b, 0, sizeof b);
    sampler *smp = sampler_create(&req->sampling);
    float *logits = malloc((size_t)(1 + SPEC_MAX_K) * (size_t)V * sizeof(float)); /* a step's logit rows */
    float *logits_scratch = malloc((size_t)V * sizeof(float));
    out->tokens = malloc((size_t)(max_tokens ? max_tokens : 1) * sizeof(int32_t));
    if (req->want_logits) out->logits = malloc((size_t)(max_tokens ? max_tokens : 1) * (size_t)V * sizeof(float));
    if (smp == NULL || logits == NULL || logits_scratch == NULL || out->tokens == NULL || (req->want_logits && out->logits == NULL) ||
        engine_batch_init(&b, step, e->stateful) < 0 ||
        (e->drafter && spec_drafter_wants_hidden(e->drafter) && engine_batch_want_hidden(&b, model_get_hparams(e->m)->n_embd) < 0)) {
        ember_fail(err, "out of memory for a request of %lld tokens", (long long)N);
        goto done;
    }
    ctx = ctx_borrow(e, err);
    if (ctx == NULL) goto done;
    for (int64_t i = 0; i < N; i++) sampler_accept(smp, req->prompt[i]);
    if (engine_req_serial(q)) {
        pthread_mutex_lock(&e->prefill_lock);
        prefill_locked = true;
    }

    engine_req_fetch(q); /* the SSD and remote tiers' reads, inline */
    apc_hit hit = engine_req_lookup(q);
    out->cached_tokens = hit.n_tokens;
    out->cache_source = hit.source;
    /* The prompt on the grid, then its last token alone. */
    int64_t prefilled = hit.n_tokens;
    if (req->on_prefill) req->on_prefill(req->user, prefilled, N);
    for (int64_t len; (len = engine_req_prompt_chunk(q, INT64_MAX)) > 0;) {
        if (engine_req_add_rows(q, &b, len, err) < 0 || forward_rows(ctx, &b, logits, err) < 0) goto done;
        engine_req_forwarded(q, len);
        prefilled += len;
        if (req->on_prefill) req->on_prefill(req->user, prefilled, N);
    }
    if (engine_req_add_rows(q, &b, engine_req_step_rows(q, 1), err) < 0 || forward_rows(ctx, &b, logits, err) < 0)
        goto done;
    engine_req_forwarded(q, 1);
    out->ttft_s = ember_now() - t0;
    out->prompt_forwarded = engine_req_forwarded_total(q);
    if (prefill_locked) {
        pthread_mutex_unlock(&e->prefill_lock);
        prefill_locked = false;
    }

    /* Decode: sample the step's logit rows in order (one, or more while
     * the drafts hold), then forward the next step. */
    out->finish = ENGINE_FINISH_LENGTH;
    const tokenizer *tok = model_get_tokenizer(e->m);
    int row = 0;
    while (max_tokens > 0) {
        if (engine_req_get_phase(q) == ENGINE_REQ_DECODE) {
            int64_t rows = engine_req_step_rows(q, step);
            if (engine_req_add_rows(q, &b, rows, err) < 0 || forward_rows(ctx, &b, logits, err) < 0) goto done;
            engine_req_forwarded(q, rows);
            row = 0;
        }
        const float *lr = logits + (size_t)row++ * V;
        int i = out->n_tokens;
        if (out->logits) memcpy(out->logits + (size_t)i * V, lr, (size_t)V * sizeof(float));
        memcpy(logits_scratch, lr, (size_t)V * sizeof(float)); /* the sampler may change its row */
        int32_t next = sampler_sample(smp, logits_scratch, V);
        sampler_accept_generated(smp, next);
        out->tokens[out->n_tokens++] = next;
        engine_req_accept(q, next);
        if (req->on_token && !req->on_token(req->user, next)) {
            out->finish = ENGINE_FINISH_STOPPED;
            break;
        }
        if (req->stop_at_eog && tok != NULL && tokenizer_is_eog(tok, next)) {
            out->finish = ENGINE_FINISH_EOG;
            break;
        }
        if (out->n_tokens == max_tokens) break;
        if (engine_req_context_full(q)) {
            out->finish = ENGINE_FINISH_CTX;
            break;
        }
    }

    /* Retirement (the extra forward is a cost of the store). */
    {
        engine_req_finish(q);
        if (engine_req_get_phase(q) == ENGINE_REQ_RETIRE) {
            double tc = ember_now();
            ember_error ignored;
            /* Best effort: without the extra token the store is one shorter. */
            int64_t rows = engine_req_step_rows(q, step);
            if (rows == 0 || engine_req_add_rows(q, &b, rows, &ignored) < 0) {
                engine_req_retire_row_failed(q, true);
            } else if (forward_rows(ctx, &b, logits, &ignored) < 0) {
                engine_req_retire_row_failed(q, false);
            } else {
                engine_req_forwarded(q, rows);
            }
            out->cache_s += ember_now() - tc;
        }
        engine_req_poll(q); /* inline predictions have landed */
    }
    out->cache_s += engine_req_cache_seconds(q);
    out->n_vocab = V;
    out->n_prompt = N;
    out->forwarded = engine_req_forwarded_total(q);
    out->spec = engine_req_spec_stats(q);
    out->total_s = ember_now() - t0;
    rc = 0;
done:
    if (prefill_locked) pthread_mutex_unlock(&e->prefill_lock);
    engine_req_free(q);
    if (ctx) ctx_return(e, ctx);
    engine_batch_free(&b);
    sampler_free(smp);
    free(logits);
    free(logits_scratch);
    if (rc < 0) engine_result_free(out);
    return rc;
}
