/* model.h - loading a GGUF model and running its forward pass.
 *
 * Contract:
 *  - model_load maps the file, reads hyperparameters and binds every weight
 *    in place (no copies except 1-D tensors stored in 16-bit types, which are
 *    widened to f32). An unknown architecture or a missing/misshaped tensor is
 *    an error naming it. The model is immutable after loading and may be
 *    shared by any number of contexts.
 *  - The per-sequence state is explicit: model_cache_stack() lists each
 *    layer's cache kind, and the K/V of attention layers lives in a kv_pool
 *    that the caller creates from model_kv_config(). Layers with recurrent
 *    state (ARR, LIST) keep it in a model_state (below), one per sequence.
 *    Sliding-window layers (ROT, gemma3) keep K/V for every position in the
 *    paged pool like KV layers; only attention masks by the window, so
 *    nothing is overwritten and a ROT layer's K/V can be cut at any block
 *    as long as the window's blocks are still held.
 *  - model_forward runs one batch: any tokens of any sequences at any
 *    positions, provided each sequence's block table already covers those
 *    positions (kv_seq_prepare_append). It writes K/V for every token and the
 *    logits of the tokens that asked for them; recurrent layers advance each
 *    row's model_state (batch->states). Every row is computed
 *    independently of the others (batch invariance, design.md §1): a token's
 *    logits are the same bits whatever else shares its batch.
 *  - model_eval is the single-sequence convenience: prepares the block
 *    table, forwards tokens [0, n) at positions seq->n_tokens.., and advances
 *    seq->n_tokens. */
#ifndef EMBER_MODEL_H
#define EMBER_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "core/error.h"
#include "core/threadpool.h"
#include "gguf/gguf.h"
#include "kv/kv_pool.h"
#include "model/cache_stack.h"
#include "tensor/ops.h"
#include "tokenizer/tokenizer.h"

typedef enum model_arch {
    ARCH_LLAMA = 0,
    ARCH_QWEN2 = 1,
    ARCH_QWEN3 = 2,
    ARCH_QWEN3MOE = 3,
    ARCH_GEMMA3 = 4,
    ARCH_QWEN35 = 5,
    ARCH_QWEN3NEXT = 6,
    ARCH_MAMBA2 = 7,
    ARCH_FALCON_H1 = 8,
} model_arch;

typedef struct model_hparams {
    model_arch arch;
    char arch_name[32];
    char name[128];          /* general.name */
    int n_vocab;
    int n_embd;
    int n_layer;
    int n_head;
    int n_head_kv;
    int d_k;                 /* key/query head size */
    int d_v;                 /* value head size */
    int n_ff;
    int n_ctx_train;         /* context length from metadata */
    int n_expert;            /* 0 for dense */
    int n_expert_used;
    int n_ff_exp;
    float rms_eps;
    rope_params rope;
    bool has_qk_norm;
    bool has_qkv_bias;
    bool tied_output;
    /* gemma3 */
    float embd_scale;        /* token embeddings are multiplied by this (1 except gemma3) */
    float attn_scale;        /* attention scale (1/sqrt(d_k) unless the arch says otherwise) */
    bool q_prescale;         /* multiply q by attn_scale after rope, attend with scale 1 (gemma3) */
    int n_swa;               /* sliding window of local layers (0: none) */
    int swa_period;          /* layer il is local iff il % swa_period < swa_period - 1 */
    rope_params rope_swa;    /* rope of the local layers */
    /* recurrent layers (qwen35/qwen3next gated delta net, mamba2, falcon-h1) */
    int ssm_d_conv;          /* conv kernel width */
    int ssm_d_inner;         /* value channels: n_v_heads * d_v (GDN), H * P (mamba2) */
    int ssm_d_state;         /* d_k = d_v (GDN), N (mamba2) */
    int ssm_n_group;         /* key heads (GDN), B/C groups (mamba2) */
    int ssm_dt_rank;         /* value heads (GDN), SSM heads (mamba2) */
    int full_attn_interval;  /* GDN hybrids: layer il is attention iff (il+1) % interval == 0 */
    int n_nextn;             /* MTP blocks stored after the trunk (not run; n_layer excludes them) */
    int n_ff_shexp;          /* shared expert width (qwen3next), 0 if none */
} model_hparams;

typedef struct model model;
typedef struct model_ctx model_ctx;
typedef struct model_state model_state;

typedef struct model_batch {
    int n_tokens;
    const int32_t *tokens;    /* (n_tokens) */
    const int64_t *pos;       /* (n_tokens) absolute positions */
    kv_seq *const *seqs;      /* (n_tokens) the block table of each token's sequence */
    const bool *want_logits;  /* (n_tokens), or NULL for "the last token only" */
    model_state *const *states; /* (n_tokens) or NULL for models without recurrent layers */
    float *hidden;            /* (tokens that want logits, n_embd): the output-normed rows the
                               * LM head reads (an MTP head's input), or NULL */
    bool hidden_all;          /* hidden gets every row (n_tokens, n_embd), not only the wanted */
} model_batch;

/* ---- Loading ---- */
model *model_load(const char *path, ember_error *err);
void model_free(model *m);

/* ---- Description ---- */
const model_hparams *model_get_hparams(const model *m);
const cache_layer *model_cache_stack(const model *m); /* (n_layer) */
const tokenizer *model_get_tokenizer(const model *m);
const gguf_file *model_get_gguf(const model *m);
/* The pool layout of this model (format f32; set cfg->format for another). */
void model_kv_config(const model *m, int32_t n_blocks, kv_pool_config *cfg);
/* The attention precision this model runs at on a pool of `format` when
 * `want` is asked (ops.h): bf16 or int8 only where op_attention_precision
 * allows it for the model's heads and the pool is not kvarn (its attention
 * has no such kernel); else f32, with *why (when not NULL) saying why the
 * request fell back (a static string; NULL when nothing fell back). Put
 * the result in kv_pool_config.attention: every context on that pool runs
 * at it. */
attention_precision model_attention_precision(const model *m, kv_format format, attention_precision want,
                                              const char **why);

/* ---- Running ---- */
/* n_threads <= 0: all CPUs. max_batch: the most tokens one forward may take. */
model_ctx *model_ctx_create(const model *m, kv_pool *pool, int n_threads, int max_batch, ember_error *err);
void model_ctx_free(model_ctx *ctx);
int model_ctx_max_batch(const model_ctx *ctx);
/* Where a forward pass spends its time, for benchmarks: while a profile is
 * set, each step of every forward on this context adds its wall time (ns)
 * to one class; NULL stops. The classes cover the pass end to end. */
typedef enum model_prof_class {
    MODEL_PROF_EMBED,     /* token embedding rows */
    MODEL_PROF_NORM,      /* rmsnorm of the residual (pre and post norms) */
    MODEL_PROF_QKV,       /* q, k, v projections */
    MODEL_PROF_QK_PREP,   /* biases, q/k norms, rope, K/V store */
    MODEL_PROF_ATTN,      /* attention over the cache (and its output gate) */
    MODEL_PROF_WO,        /* attention output projection */
    MODEL_PROF_RESID,     /* residual adds */
    MODEL_PROF_FFN_IN,    /* gate and up projections (MoE: router, experts, shared expert) */
    MODEL_PROF_ACT,       /* SwiGLU / GeGLU */
    MODEL_PROF_FFN_DOWN,  /* down projection */
    MODEL_PROF_MIXER,     /* recurrent mixers (gated delta net, mamba2) */
    MODEL_PROF_HEAD,      /* output norm and LM head */
    MODEL_PROF_N
} model_prof_class;
typedef struct model_profile {
    int64_t ns[MODEL_PROF_N];
} model_profile;
void model_ctx_set_profile(model_ctx *ctx, model_profile *profile);
/* The context's thread pool's counters (ember_pool_get_stats). */
void model_ctx_pool_stats(const model_ctx *ctx, ember_pool_stats *st);
const char *model_prof_class_name(model_prof_class cls);
/* logits: (number of tokens that want logits, n_vocab), in batch order. */
int model_forward(model_ctx *ctx, const model_batch *batch, float *logits, ember_error *err);
/* Single sequence: logits of every token if all_logits, else of the last.
 * KV-only models; models with recurrent state need model_eval_state. */
int model_eval(model_ctx *ctx, kv_seq *seq, const int32_t *tokens, int n, bool all_logits,
               float *logits, ember_error *err);
/* model_eval for any model: state is the sequence's recurrent state (may be
 * NULL when model_has_state() is false). */
int model_eval_state(model_ctx *ctx, kv_seq *seq, model_state *state, const int32_t *tokens, int n,
                     bool all_logits, float *logits, ember_error *err);
/* model_eval_state that also writes the hidden rows (model_batch.hidden) of
 * the rows it writes logits for; hidden may be NULL. */
int model_eval_hidden(model_ctx *ctx, kv_seq *seq, model_state *state, const int32_t *tokens, int n,
                      bool all_logits, float *logits, float *hidden, ember_error *err);

/* ---- MTP ("nextn") head ----
 *
 * Contract:
 *  - A qwen35/qwen3next file may store MTP blocks after the trunk
 *    (nextn_predict_layers); the trunk never runs them. model_has_mtp says
 *    whether the first one was bound.
 *  - The head drafts token p+1 from token x_p at position p and the target's
 *    hidden row h_{p-1} (model_batch.hidden of the trunk's row p-1; zeros
 *    at p = 0). Its own K/V live in a separate pool made from
 *    model_mtp_kv_config; model_mtp_ctx_create binds a context to it.
 *  - model_mtp_forward takes a batch like model_forward (tokens, positions,
 *    the MTP pool's sequences, want_logits; states ignored) plus h_prev
 *    (n_tokens, n_embd). It writes the MTP logits of the wanted rows and,
 *    when batch->hidden is set, the head's own normed output for those rows
 *    (fed back as h when drafting several tokens). Rows are independent as
 *    in the trunk (batch invariance). */
bool model_has_mtp(const model *m);
void model_mtp_kv_config(const model *m, int32_t n_blocks, kv_pool_config *cfg);
model_ctx *model_mtp_ctx_create(const model *m, kv_pool *mtp_pool, int n_threads, int max_batch, ember_error *err);
int model_mtp_forward(model_ctx *ctx, const model_batch *batch, const float *h_prev, float *logits, ember_error *err);
/* Single sequence: tokens [0, n) at positions seq->n_tokens.. of the MTP
 * pool, h_prev (n, n_embd); logits (and hidden, may be NULL) of every row.
 * logits NULL: the rows only write the head's K/V (no LM head). */
int model_mtp_eval(model_ctx *ctx, kv_seq *seq, const int32_t *tokens, int n, const float *h_prev, float *logits,
                   float *hidden, ember_error *err);

/* ---- Per-sequence recurrent state (ARR and LIST layers) ----
 *
 * Contract:
 *  - A model_state holds, for every ARR/LIST layer, the conv state (the last
 *    d_conv-1 inputs of the causal conv) and the recurrent state (SSM or
 *    delta-rule matrix) of ONE sequence, plus the number of tokens it has
 *    consumed (model_state_pos). It is fixed-size, independent of length.
 *    KV-only models have no state (model_has_state false); their batches may
 *    leave `states` NULL.
 *  - A state is valid only for the exact token prefix it consumed. The
 *    forward pass checks that a sequence's rows arrive at positions
 *    pos == model_state_pos(state), +1, ... in batch order (rows of one
 *    sequence in one batch must be in position order), updates the state
 *    token by token in that order and advances its position. Together with
 *    the K/V of the attention layers (kv_seq, which must hold the same
 *    positions [0, pos)), the state is the whole sequence state.
 *  - Token-by-token recurrence in a fixed order: the state after position p
 *    is the same bits however the prompt was chunked or threaded.
 *  - Snapshot/restore: model_state_bytes() bytes, a flat copy (header with
 *    the position, then the floats) that restores bit-exactly into any state
 *    of the same model file, also in another process on a little-endian
 *    machine. Snapshot at position N together with K/V blocks covering
 *    [0, N) is everything needed to resume at N.
 *  - A batch refused by validation (token id, KV block, state position)
 *    leaves every state untouched; after an out-of-memory failure in the
 *    middle of a pass a state is unspecified: reset or restore it. */
bool model_has_state(const model *m);
model_state *model_state_create(const model *m, ember_error *err); /* empty: position 0, zeros */
void model_state_free(model_state *s);
void model_state_reset(model_state *s);                          /* back to empty */
int64_t model_state_pos(const model_state *s);                   /* tokens consumed */
size_t model_state_bytes(const model *m);                        /* snapshot size */
void model_state_snapshot(const model_state *s, void *buf);      /* writes model_state_bytes() */
int model_state_restore(model_state *s, const void *buf, size_t n_bytes, ember_error *err);
void model_state_copy(model_state *dst, const model_state *src); /* same model */

#endif
