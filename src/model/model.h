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
 *    that the caller creates from model_kv_config().
 *  - model_forward runs one batch: any tokens of any sequences at any
 *    positions, provided each sequence's block table already covers those
 *    positions (kv_seq_prepare_append). It writes K/V for every token and the
 *    logits of the tokens that asked for them. Every row is computed
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
} model_hparams;

typedef struct model model;
typedef struct model_ctx model_ctx;

typedef struct model_batch {
    int n_tokens;
    const int32_t *tokens;    /* (n_tokens) */
    const int64_t *pos;       /* (n_tokens) absolute positions */
    kv_seq *const *seqs;      /* (n_tokens) the block table of each token's sequence */
    const bool *want_logits;  /* (n_tokens), or NULL for "the last token only" */
} model_batch;

/* ---- Loading ---- */
model *model_load(const char *path, ember_error *err);
void model_free(model *m);

/* ---- Description ---- */
const model_hparams *model_get_hparams(const model *m);
const cache_layer *model_cache_stack(const model *m); /* (n_layer) */
const tokenizer *model_get_tokenizer(const model *m);
const gguf_file *model_get_gguf(const model *m);
/* Fills k/v widths (arrays of n_layer ints owned by the model) for a pool. */
void model_kv_config(const model *m, int32_t n_blocks, kv_pool_config *cfg);

/* ---- Running ---- */
/* n_threads <= 0: all CPUs. max_batch: the most tokens one forward may take. */
model_ctx *model_ctx_create(const model *m, kv_pool *pool, int n_threads, int max_batch, ember_error *err);
void model_ctx_free(model_ctx *ctx);
int model_ctx_max_batch(const model_ctx *ctx);
/* logits: (number of tokens that want logits, n_vocab), in batch order. */
int model_forward(model_ctx *ctx, const model_batch *batch, float *logits, ember_error *err);
/* Single sequence: logits of every token if all_logits, else of the last. */
int model_eval(model_ctx *ctx, kv_seq *seq, const int32_t *tokens, int n, bool all_logits,
               float *logits, ember_error *err);

#endif
