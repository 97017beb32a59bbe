/* engine.h - one model, its KV pool and prompt cache, and a synchronous
 * runner for single requests.
 *
 * Contract:
 *  - engine_create binds a loaded model (which must outlive the engine) to a
 *    paged KV pool of num_blocks blocks (logged with its capacity) and a
 *    prompt cache routed from the model's cache stack (apc.h).
 *  - engine_generate runs one request to completion, in the order of
 *    design.md §2 and invariant 1:
 *      1. cache lookup: the longest cached prefix (block or exact tier),
 *         at most N-1 tokens, is adopted into the request's sequence;
 *      2. the rest of the prompt up to N-1 is prefilled in chunks on the
 *         fixed grid of absolute positions (chunk k covers
 *         [k*step, (k+1)*step)); the cursor then pauses at N-1, where the
 *         exact tier takes its snapshot;
 *      3. the last prompt token is forwarded alone (its logits pick the
 *         first token), then the post-prefill store runs;
 *      4. decode, one token per step, greedy or sampled;
 *      5. at finish, the retirement store of prompt + reply.
 *    The request moves through the one driver (engine_req.h) that the
 *    server's scheduler uses too: prefill also stops where the cache
 *    schedules a store (grid points, the turn boundary, the system-prompt
 *    anchor, N-1), decode takes snapshots, retirement follows reference
 *    §7.7; on a ckpt-tier model the prompt phase of concurrent calls runs
 *    one at a time.
 *    Models with recurrent layers (model_has_state) get a model_state per
 *    request, restored and stored with the K/V.
 *    Because every kernel is batch-invariant and the chunk grid is fixed,
 *    the logits of every generated step are bit-identical whether the
 *    prefix came from the cache or not, and whether or not the engine
 *    speculates (cfg.spec: drafts verified in one forward; engine_req.h).
 *  - engine_generate may be called from several threads at once: each call
 *    borrows its own model context; the pool and the cache are shared under
 *    the cache's lock. A request that cannot fit in the pool at all fails at
 *    admission with a clear error; the cache itself never fails a request.
 *  - Results are owned by the caller: engine_result_free. */
#ifndef EMBER_ENGINE_H
#define EMBER_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "apc/apc.h"
#include "chat/chat_plan.h"
#include "core/error.h"
#include "engine/engine_prefix.h"
#include "engine/engine_spec.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "sample/sampler.h"

typedef struct engine engine;

typedef struct engine_config {
    int n_threads;        /* threads per forward pass; <= 0: all CPUs */
    int prefill_step;     /* grid step and largest forward batch; default 512 */
    int32_t num_blocks;   /* KV pool size; 0: default (see engine_default_blocks) */
    int n_ctx;            /* largest sequence; 0: the model's training context */
    kv_format kv_format;  /* how the pool stores K/V rows; zero: f32 */
    /* attention's products (ops.h); zero: f32. bf16 or int8 where the CPU
     * and the model allow it (model_attention_precision), else f32 and
     * engine_attention_fallback says why. */
    attention_precision attention;
    apc_config cache;
    spec_config spec;     /* speculative decoding (engine_spec.h); kind SPEC_OFF: none */
} engine_config;

typedef enum engine_cache_mode {
    ENGINE_CACHE_ON = 0,     /* lookup and store */
    ENGINE_CACHE_BYPASS = 1, /* neither: a cold request that leaves no trace */
    ENGINE_CACHE_STORE = 2,  /* store only: a cold request that feeds the cache */
    ENGINE_CACHE_LOOKUP = 3, /* lookup only: a warm request that stores nothing */
} engine_cache_mode;

typedef enum engine_finish {
    ENGINE_FINISH_LENGTH = 0, /* max_tokens reached */
    ENGINE_FINISH_EOG = 1,    /* end-of-generation token */
    ENGINE_FINISH_CTX = 2,    /* the context is full */
    ENGINE_FINISH_STOPPED = 3,/* the token callback asked to stop */
} engine_finish;

/* Streaming: called with each generated token; return false to stop. */
typedef bool (*engine_token_fn)(void *user, int32_t token);
/* Prefill progress: prompt positions now in the sequence (cached ones
 * included) out of n_prompt, after the cache lookup and after each chunk. */
typedef void (*engine_progress_fn)(void *user, int64_t done, int64_t n_prompt);

typedef struct engine_request {
    const int32_t *prompt;
    int64_t n_prompt;
    int max_tokens;
    sampler_params sampling;  /* temperature <= 0: greedy */
    uint64_t salt;            /* tenant salt (apc_salt_for_tenant); 0: none */
    engine_cache_mode cache;
    bool stop_at_eog;         /* finish on the tokenizer's end-of-generation ids */
    bool want_logits;         /* keep the logits of every generated step */
    engine_token_fn on_token;
    engine_progress_fn on_prefill; /* optional; gets `user` too */
    void *user;
    /* What the chat template tells the cache (chat_plan.h; all zero for a
     * plain prompt). Only decides where the cache stores, never what a
     * lookup adopts. The predictor is borrowed. */
    chat_cache_plan plan;
    /* Optional (max_tokens): per generated token, what speculation made of
     * it (SPEC_MARK_*: not drafted, its draft rejected, its draft accepted),
     * for per-position acceptance (bench_spec warm). */
    uint8_t *draft_marks;
} engine_request;

typedef struct engine_result {
    int32_t *tokens;          /* (n_tokens) generated ids */
    int n_tokens;
    float *logits;            /* (n_tokens, n_vocab) raw logits that chose each token, if asked */
    int n_vocab;
    int64_t n_prompt;
    int64_t cached_tokens;    /* prompt tokens adopted from the cache */
    int64_t prompt_forwarded; /* n_prompt - cached_tokens */
    int64_t forwarded;        /* every token forwarded (prompt suffix, decode, retirement) */
    apc_source cache_source;
    engine_finish finish;
    double ttft_s;            /* request start to the first token's logits */
    double total_s;
    double cache_s;           /* time inside the cache's lookup and stores */
    spec_stats spec;          /* speculative decoding: rounds, drafted, accepted */
} engine_result;

/* ---- Lifetime ---- */
engine_config engine_default_config(void);
/* The default pool: four full contexts, at least 64 blocks, at most 2 GiB
 * (the CLI's and the tests'; `ember serve` sizes its pool from memory,
 * serve_pool_size.h). */
int32_t engine_default_blocks(const model *m, int n_ctx);
/* Bytes of one KV block of m (16 tokens, every layer's K and V) in KV
 * format fmt (kv_format_token_bytes). */
size_t engine_block_bytes(const model *m, kv_format fmt);
/* Bytes one block of num_blocks costs across every pool the engine makes
 * with that count: the target's in fmt, and the draft model's or the MTP
 * head's (f32) when spec speculates with one. */
size_t engine_blocks_bytes(const model *m, kv_format fmt, const spec_config *spec);
/* Whether any layer of m keeps K/V in the pool (false: recurrent only). */
bool engine_has_kv(const model *m);
engine *engine_create(const model *m, const engine_config *cfg, ember_error *err);
void engine_free(engine *e);

/* A model's identity for the SSD tier's namespace: XXH3-128 over the file
 * size, the GGUF header (every key/value), the tensor table and a sample of
 * every tensor's data (its first, middle and last 64 bytes). No path. */
void engine_model_fingerprint(const gguf_file *f, uint8_t out[16]);

/* ---- Parts ---- */
apc *engine_cache(engine *e);
kv_pool *engine_pool(engine *e);
/* The attention precision the engine runs at (kv_pool_attention), and why
 * a request for bf16 fell back to f32 (NULL when nothing fell back). */
attention_precision engine_attention_precision(const engine *e);
const char *engine_attention_fallback(const engine *e);
const model *engine_model(const engine *e);
int engine_n_ctx(const engine *e);
spec_drafter *engine_drafter(engine *e);   /* NULL without speculative decoding */
/* The prefix layer, L0 (engine_prefix.h): speculating engines with
 * spec.prefix_entries > 0, whatever the cache's configuration; else NULL. */
prefix_layer *engine_prefix(engine *e);

/* ---- Running ---- */
engine_request engine_default_request(void);
int engine_generate(engine *e, const engine_request *req, engine_result *out, ember_error *err);
void engine_result_free(engine_result *r);

#endif
