/* mkmodel.h - internals of `ember mkmodel`, shared by its source files.
 *
 * Contract: an architecture is a row of a table (mkmodel_arch.c) naming its
 * hyperparameter keys and listing its tensors symbolically (shapes in terms
 * of n_embd, n_ff, heads, ...). A preset fills a mk_config. The plan step
 * turns (arch, config, weight type) into concrete tensors with a storage
 * type and an initialisation rule; the weights step (mkmodel_weights.c)
 * streams each tensor's bytes into the GGUF writer. Adding an architecture
 * means adding one table row and, if it needs new dimension symbols or
 * hyperparameter keys, a case for each. */
#ifndef EMBER_CLI_MKMODEL_H
#define EMBER_CLI_MKMODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "core/error.h"
#include "core/threadpool.h"
#include "gguf/gguf.h"
#include "tensor/dtype.h"

typedef struct mk_config {
    int64_t n_vocab;
    int64_t n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff, n_ctx;
    int64_t n_expert, n_expert_used, n_ff_exp; /* MoE only */
    /* recurrent layers (qwen35 gated delta net, mamba2, falcon-h1) */
    int64_t ssm_d_conv, ssm_d_inner, ssm_d_state, ssm_n_group, ssm_dt_rank;
    int64_t n_swa;                             /* gemma3 sliding window */
    float rope_base, rms_eps;
    bool tied;                                 /* no output.weight: head reuses token_embd */
    int64_t n_nextn;                           /* MTP blocks after the trunk (qwen35 --mtp), 0: none */
} mk_config;

/* How a tensor's values are drawn. */
typedef enum mk_init {
    MK_INIT_MATRIX,  /* N(0, 1/sqrt(ne0)) */
    MK_INIT_HEAD,    /* N(0, 3/sqrt(n_embd)): output.weight, and token_embd when tied */
    MK_INIT_ONES,    /* norm weights: exactly 1 */
    MK_INIT_BIAS,    /* N(0, 0.1) */
    MK_INIT_SSM_A,   /* -U(1, 8): A = -exp(A_log), a stable decay */
    MK_INIT_SSM_D,   /* U(0.5, 1.5) */
    MK_INIT_DT_BIAS, /* U(-4, -2) */
} mk_init;

typedef enum mk_storage {
    MK_STORE_WEIGHT, /* the chosen --type (with the k-quant row fallback) */
    MK_STORE_F32,    /* 1-D tensors and routers stay f32 */
} mk_storage;

typedef struct mk_tensor {
    char name[64];
    uint32_t n_dims;
    int64_t ne[4];
    ember_dtype type;
    mk_init init;
} mk_tensor;

typedef struct mk_preset {
    const char *name;
    const char *only_arch; /* NULL: any arch; else the arch this preset implies */
    mk_config config;
    int64_t vocab_target;  /* pad the tokenizer up to this many tokens (0: as is) */
} mk_preset;

typedef struct mk_arch mk_arch;

const mk_arch *mk_arch_find(const char *name);
const char *mk_arch_name(const mk_arch *a);
/* Whether the arch ties its head to token_embd by default. */
bool mk_arch_tied(const mk_arch *a);
/* Space-separated list of the supported names, for usage messages. */
const char *mk_arch_names(void);
/* Whether the arch can carry an MTP ("nextn") block (--mtp). */
bool mk_arch_has_mtp(const mk_arch *a);

const mk_preset *mk_preset_find(const char *name);
const char *mk_preset_names(void);

/* Weight types accepted by --type, and llama.cpp's file_type for each. */
bool mk_weight_type_ok(ember_dtype t);
uint32_t mk_file_type(ember_dtype t);
/* The type a matrix with rows of ne0 elements gets when `want` is asked for:
 * K-quants need ne0 % 256 == 0 and fall back as llama-quantize does
 * (q2_K/q3_K/q4_K -> q5_0, q5_K -> q5_1, q6_K -> q8_0); 32-blocks need
 * ne0 % 32 == 0 and fall back to f16. */
ember_dtype mk_fallback_type(ember_dtype want, int64_t ne0);

/* Writes general.* (except the tokenizer) and <arch>.* keys. */
void mk_write_hparams(const mk_arch *a, const mk_config *c, const char *model_name, ember_dtype wtype,
                      uint64_t seed, gguf_writer *w);

/* The tensor list in file order; *out is malloc'd. Returns the count. */
int mk_plan_tensors(const mk_arch *a, const mk_config *c, ember_dtype wtype, mk_tensor **out, ember_error *err);

/* Adds every planned tensor to w with a fill callback drawing deterministic
 * weights from seed (independent of thread count and tensor order). The
 * returned context must outlive gguf_writer_write; free with
 * mk_weights_free. NULL on error. */
typedef struct mk_weights mk_weights;
mk_weights *mk_weights_add(gguf_writer *w, const mk_tensor *tensors, int n, const mk_config *c, uint64_t seed,
                           ember_pool *pool, ember_error *err);
/* Weight bytes of every tensor, and a hook called after each tensor's data
 * is produced (during gguf_writer_write) with the bytes done so far. */
typedef void (*mk_progress_fn)(void *user, uint64_t done_bytes, uint64_t total_bytes);
uint64_t mk_weights_bytes(const mk_weights *mw);
void mk_weights_set_progress(mk_weights *mw, mk_progress_fn fn, void *user);
void mk_weights_free(mk_weights *mw);

#endif
