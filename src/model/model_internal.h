/* model_internal.h - the model struct shared by the loader and the forward
 * passes. Not part of the public API (model.h). */
#ifndef EMBER_MODEL_INTERNAL_H
#define EMBER_MODEL_INTERNAL_H

#include "model/model.h"
#include "tensor/matmul.h"

typedef struct layer_weights {
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
} layer_weights;

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
    float **owned;               /* widened 1-D tensors, freed with the model */
    int n_owned;
};

#endif
