/* model_internal.h - the model struct shared by the loader and the forward
 * passes. Not part of the public API (model.h). */
#ifndef EMBER_MODEL_INTERNAL_H
#define EMBER_MODEL_INTERNAL_H

#include "model/model.h"
#include "tensor/matmul.h"

/* What a layer runs in place of attention (design: forward.c reads a layer
 * as mixer + FFN; arch_*.c hold the mixers that are not attention). */
typedef enum layer_mixer {
    MIX_ATTN = 0,        /* attention over the paged KV (optionally windowed/gated) */
    MIX_GDN = 1,         /* gated delta net (qwen35, qwen3next), arch_gdn.c */
    MIX_MAMBA2 = 2,      /* mamba2 SSM, arch_mamba2.c */
    MIX_ATTN_MAMBA2 = 3, /* falcon-h1: attention + mamba2 on the same input, summed */
} layer_mixer;

typedef enum ffn_kind {
    FFN_NONE = 0,        /* mamba2 */
    FFN_SWIGLU = 1,      /* dense down(silu(gate) * up) */
    FFN_GEGLU = 2,       /* gemma3: down(gelu(gate) * up), ggml's fp16 GELU */
    FFN_MOE = 3,         /* routed experts (+ gated shared expert when shexp_up is bound) */
} ffn_kind;

typedef struct layer_weights {
    layer_mixer mixer;
    ffn_kind ffn;
    const rope_params *rope;     /* this layer's rope (hp.rope or hp.rope_swa) */
    int window;                  /* sliding window for attention, 0 = full causal */
    bool q_gated;                /* attn_q is [q, gate] per head; output *= sigmoid(gate) */
    const float *post_attn_norm; /* gemma3 sandwich norms (n_embd) or NULL */
    const float *post_ffn_norm;
    const float *attn_norm;      /* (n_embd) */
    tensor_weight wq;            /* {n_embd, n_head*d_k} */
    tensor_weight wk;            /* {n_embd, n_head_kv*d_k} */
    tensor_weight wv;            /* {n_embd, n_head_kv*d_v} */
    tensor_weight wo;            /* {n_head*d_v, n_embd} */
    const float *bq, *bk, *bv;   /* (n_head*d_k), (n_head_kv*d_k), (n_head_kv*d_v) or NULL */
    const float *q_norm;         /* (d_k) or NULL */
    const float *k_norm;         /* (d_k) or NULL */
    const float *ffn_norm;       /* (n_embd) */
    /* dense FFN */
    tensor_weight ffn_gate;      /* {n_embd, n_ff} */
    tensor_weight ffn_up;        /* {n_embd, n_ff} */
    tensor_weight ffn_down;      /* {n_ff, n_embd} */
    /* MoE FFN */
    tensor_weight router;        /* {n_embd, n_expert} */
    tensor_weight *exp_gate;     /* (n_expert) views of {n_embd, n_ff_exp, n_expert} */
    tensor_weight *exp_up;       /* (n_expert) */
    tensor_weight *exp_down;     /* (n_expert) views of {n_ff_exp, n_embd, n_expert} */
    /* shared expert (qwen3next) */
    tensor_weight shexp_gate, shexp_up, shexp_down; /* {n_embd, n_ff_shexp} x2, {n_ff_shexp, n_embd} */
    tensor_weight shexp_inp;     /* {n_embd, 1}: sigmoid(shexp_inp . x) scales the shared expert */
    /* recurrent mixers (MIX_GDN, MIX_MAMBA2, MIX_ATTN_MAMBA2) */
    tensor_weight ssm_in;        /* mamba2: {n_embd, [z | xBC | dt]}; GDN: attn_qkv {n_embd, conv_dim} */
    tensor_weight ssm_z;         /* GDN: attn_gate {n_embd, d_inner} */
    tensor_weight ssm_beta;      /* GDN qwen35: {n_embd, n_v}; qwen3next: ssm_ba {n_embd, 2 n_v} */
    tensor_weight ssm_alpha;     /* GDN qwen35: {n_embd, n_v}; unused for qwen3next */
    tensor_weight ssm_out;       /* {d_inner, n_embd} */
    const float *conv_w;         /* (conv_dim, d_conv): channel c's taps at c * d_conv */
    const float *conv_b;         /* (conv_dim) or NULL */
    const float *dt_bias;        /* (n heads) */
    const float *ssm_a;          /* (n heads), stored as -exp(A_log) */
    const float *ssm_d;          /* (n heads) mamba2 skip, NULL for GDN */
    const float *ssm_norm;       /* GDN: (d_v) per head; mamba2: (d_inner) grouped; may be NULL */
    size_t conv_off, ssm_off;    /* float offsets of this layer's conv / recurrent state in a model_state */
} layer_weights;

/* The MTP ("nextn") block stored after the trunk (qwen35/qwen3next): a
 * full-attention decoder block fed eh_proj [enorm(embd(x_p)) | hnorm(h_{p-1})],
 * where h is the target's output-normed hidden state. Its K/V live in a
 * pool of their own (one layer, model_mtp_kv_config). */
typedef struct mtp_weights {
    layer_weights block;         /* gated attention + FFN, pre-FFN norm post_attention_norm */
    tensor_weight eh_proj;       /* {2*n_embd, n_embd} */
    const float *enorm;          /* (n_embd) */
    const float *hnorm;          /* (n_embd) */
    const float *head_norm;      /* (n_embd) shared_head_norm, else output_norm */
    int kv_k_width[1], kv_v_width[1];
} mtp_weights;

struct model {
    gguf_file *file;
    model_hparams hp;
    tokenizer *tok;
    cache_layer *stack;          /* (n_layer) */
    int *kv_k_width;             /* (n_layer) */
    int *kv_v_width;             /* (n_layer) */
    tensor_weight tok_embd;      /* {n_embd, n_vocab} */
    const float *output_norm;    /* (n_embd) */
    tensor_weight output;        /* {n_embd, n_vocab}; tok_embd when tied */
    layer_weights *layers;       /* (n_layer) */
    mtp_weights *mtp;            /* the first MTP block, or NULL */
    float **owned;               /* widened 1-D tensors, freed with the model */
    int n_owned;
    size_t state_floats;         /* per-sequence recurrent state (model_state), 0 if none */
    bool has_attention;          /* some layer attends over the KV pool */
};

struct model_state {
    const model *m;
    int64_t pos;                 /* tokens consumed */
    float *data;                 /* (m->state_floats) */
};

/* conv_dim of a recurrent layer: channels that go through the causal conv. */
static inline int ssm_conv_dim(const model_hparams *hp) {
    return hp->ssm_d_inner + 2 * hp->ssm_n_group * hp->ssm_d_state;
}

/* ---- The context and the steps the architectures share (forward.c) ---- */

struct model_ctx {
    const model *m;
    kv_pool *pool;
    ember_pool *threads;
    matmul_scratch *mm;
    int max_batch;
    float *x;            /* (max_batch, n_embd) residual stream */
    float *xn;           /* (max_batch, n_embd) normalized input of a sublayer */
    float *q;            /* (max_batch, n_head * d_k) */
    float *qg;           /* (max_batch, n_head * 2 * d_k) gated-q projection, or NULL */
    float *k;            /* (max_batch, n_head_kv * d_k) */
    float *v;            /* (max_batch, n_head_kv * d_v) */
    float *attn;         /* (max_batch, n_head * d_v) */
    float *proj;         /* (max_batch, n_embd) sublayer output */
    float *proj2;        /* (max_batch, n_embd) second mixer output (falcon-h1), or NULL */
    float *mtp_cat;      /* (max_batch, 2 * n_embd) MTP input [enorm(e) | hnorm(h)], or NULL */
    bool is_mtp;         /* created by model_mtp_ctx_create: pool holds the MTP block's K/V */
    float *gate;         /* (max_batch, max(n_ff, n_ff_exp, n_ff_shexp)) */
    float *up;           /* (max_batch, max(n_ff, n_ff_exp, n_ff_shexp)) */
    float *router;       /* (max_batch, n_expert) */
    int *sel_expert;     /* (max_batch, n_expert_used) */
    float *sel_weight;   /* (max_batch, n_expert_used) */
    int *exp_rows;       /* (max_batch) rows routed to the current expert */
    int *exp_slot;       /* (max_batch) which of the row's k choices it is */
    float *exp_in;       /* (max_batch, n_embd) gathered rows */
    float *exp_out;      /* (max_batch * n_expert_used, n_embd) */
    /* recurrent mixers */
    float *r_in;         /* (max_batch, input projection width) */
    float *r_conv;       /* (max_batch, conv_dim) conv outputs */
    float *r_y;          /* (max_batch, d_inner) mixer outputs before ssm_out */
    float *r_z;          /* (max_batch, d_inner) GDN output gate */
    float *r_ba;         /* (max_batch, 2 * heads) GDN beta and decay */
    int n_groups;        /* sequences (distinct states) in the current chunk */
    int *grp_rows;       /* (max_batch) rows grouped by state, each group in batch order */
    int *grp_start;      /* (max_batch + 1) group g is grp_rows[grp_start[g] .. grp_start[g+1]) */
    model_state **grp_state; /* (max_batch) */
    model_profile *prof; /* model_ctx_set_profile, or NULL */
    int64_t prof_t;      /* ns at the last profile mark */
    /* attention scratch, one slice per thread */
    int n_threads;
    int64_t att_cap;     /* keys per thread slice */
    float *att_scores;   /* (n_threads, att_rows * group, att_cap) */
    int32_t ptr_cap;     /* blocks per thread slice */
    const void **k_ptrs; /* (n_threads, ptr_cap) encoded K rows of each block */
    const void **v_ptrs; /* (n_threads, ptr_cap) */
    /* attention runs the bf16 kernel, at ATTENTION_BF16 or ATTENTION_INT8
     * (the pool's precision, on heads and a format it takes; else
     * ATTENTION_F32): bigger units, no score scratch (forward.c) */
    attention_precision att_online;
    /* bf16/int8 prefill of a long batch: the layer's K/V tiles, built once
     * per layer (prepare_bf16_tiles) instead of once per unit of rows */
    uint8_t *att_tiles;          /* (n_head_kv, op_attention_bf16_tiles_bytes) */
    size_t att_tiles_cap;        /* bytes */
    /* kvarn pools (forward_kvarn passes): rows that attend in this pass, and
     * the scratch that seals a group */
    bool kvarn;
    uint8_t *att_skip;   /* (max_batch) 1: this row does not attend in this pass */
    int64_t *kvarn_phys; /* (max_batch) per batch row: groups [1, phys) of its sequence are sealed */
    float *kvarn_scratch;
};

/* y (n, w->n_out) = x (n, w->n_in) W^T; fails only for lack of memory. */
int fwd_matmul(model_ctx *c, const tensor_weight *w, const float *x, int n, float *y, ember_error *err);
/* dst[r] = rmsnorm(src[r]) * w over `width` for each of n_rows rows (dst may alias src). */
void fwd_rmsnorm_rows(model_ctx *c, float *dst, const float *src, const float *w, int n_rows, int width);

/* arch_gemma3.c: y[i] = gelu(gate[i]) * up[i] as ggml's CPU does it (GELU
 * looked up at the fp16-rounded input, result rounded to fp16). */
void gemma3_geglu(float *y, const float *gate, const float *up, int n);
/* arch_gdn.c: gated delta net mixer of layer il: c->xn rows -> out rows (n_embd). */
int gdn_mixer(model_ctx *c, const model_batch *b, int il, float *out, ember_error *err);
/* arch_mamba2.c: mamba2 mixer of layer il: c->xn rows -> out rows (n_embd). */
int mamba2_mixer(model_ctx *c, const model_batch *b, int il, float *out, ember_error *err);
/* Shared by the recurrent mixers (arch_mamba2.c): out = silu(conv + bias)
 * for channels [0, conv_dim) of `in` rows (row stride in_stride, first
 * channel at in_off), for every sequence of the chunk (grp_*), token by
 * token from its conv state, which is advanced; out: (n, conv_dim) rows. */
void ssm_conv_rows(model_ctx *c, const layer_weights *L, const float *in, size_t in_stride, size_t in_off,
                   float *out, int conv_dim);

#endif
