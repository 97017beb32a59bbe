/* mkmodel_arch.c - the architecture and preset tables of `ember mkmodel`.
 *
 * Design: each architecture is data - a list of tensor rules whose shapes
 * are written with dimension symbols (n_embd, n_q = n_head * head_dim, ...)
 * plus a few flags selecting optional hyperparameter keys. Tensor names,
 * shapes and keys follow what llama.cpp loads for the arch (see
 * engine-reference.md C.1-C.4). The per-layer order matches llama.cpp's
 * converter output (norm, q, k, v, output, q/k norms, ffn norm, ffn), which
 * keeps files easy to compare with the reference fixtures. Hybrids whose
 * layers differ (qwen35: gated delta net, every `attn_interval`-th layer
 * attention) have a second rule list for the attention layers. To add an
 * architecture: dimension symbols, a rule list and a row in `archs`, plus any
 * keys in mk_write_hparams. */
#include "cli/mkmodel.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- dimension symbols ---- */

typedef enum mk_dim {
    DIM_NONE = 0, /* terminates a shape */
    DIM_EMBD,
    DIM_VOCAB,
    DIM_Q,        /* n_head * head_dim */
    DIM_KV,       /* n_head_kv * head_dim */
    DIM_FF,
    DIM_HEAD,     /* head_dim (QK-norm weights) */
    DIM_EXPERT,
    DIM_FF_EXP,
    DIM_Q2,       /* 2 * n_head * head_dim: gated attention's [q | gate] */
    DIM_ONE,
    DIM_DCONV,    /* ssm conv kernel */
    DIM_INNER,    /* ssm d_inner (value channels) */
    DIM_CONV,     /* d_inner + 2 * groups * state: conv channels */
    DIM_SSM_IN,   /* mamba2 in_proj: [z | xBC | dt] */
    DIM_SSM_HEADS,
    DIM_GDN_DV,   /* d_inner / heads: GDN value head size */
    DIM_NORM_GRP, /* d_inner / groups: mamba2 grouped norm */
    DIM_GROUPS,
    DIM_EMBD2,    /* 2 * n_embd: the MTP block's eh_proj input [embedding | hidden] */
} mk_dim;

static int64_t dim_value(mk_dim d, const mk_config *c) {
    switch (d) {
    case DIM_EMBD: return c->n_embd;
    case DIM_VOCAB: return c->n_vocab;
    case DIM_Q: return c->n_head * c->head_dim;
    case DIM_KV: return c->n_head_kv * c->head_dim;
    case DIM_FF: return c->n_ff;
    case DIM_HEAD: return c->head_dim;
    case DIM_EXPERT: return c->n_expert;
    case DIM_FF_EXP: return c->n_ff_exp;
    case DIM_Q2: return 2 * c->n_head * c->head_dim;
    case DIM_ONE: return 1;
    case DIM_DCONV: return c->ssm_d_conv;
    case DIM_INNER: return c->ssm_d_inner;
    case DIM_CONV: return c->ssm_d_inner + 2 * c->ssm_n_group * c->ssm_d_state;
    case DIM_SSM_IN: return 2 * c->ssm_d_inner + 2 * c->ssm_n_group * c->ssm_d_state + c->ssm_dt_rank;
    case DIM_SSM_HEADS: return c->ssm_dt_rank;
    case DIM_GDN_DV: return c->ssm_dt_rank ? c->ssm_d_inner / c->ssm_dt_rank : 0;
    case DIM_NORM_GRP: return c->ssm_n_group ? c->ssm_d_inner / c->ssm_n_group : 0;
    case DIM_GROUPS: return c->ssm_n_group;
    case DIM_EMBD2: return 2 * c->n_embd;
    case DIM_NONE: break;
    }
    return 1;
}

/* ---- tensor rules ---- */

enum {
    RULE_EMBEDDING = 1 << 0, /* token_embd: head-like init when the head is tied to it */
    RULE_OUTPUT = 1 << 1,    /* output.weight: absent when tied */
};

typedef struct mk_rule {
    const char *name; /* printf pattern with one %d for per-layer tensors */
    mk_dim shape[3];
    mk_storage storage;
    mk_init init;
    unsigned flags;
} mk_rule;

#define MATRIX(n, a, b) {n, {a, b, DIM_NONE}, MK_STORE_WEIGHT, MK_INIT_MATRIX, 0}
#define EXPERTS(n, a, b) {n, {a, b, DIM_EXPERT}, MK_STORE_WEIGHT, MK_INIT_MATRIX, 0}
#define NORM(n, a) {n, {a, DIM_NONE, DIM_NONE}, MK_STORE_F32, MK_INIT_ONES, 0}
#define BIAS(n, a) {n, {a, DIM_NONE, DIM_NONE}, MK_STORE_F32, MK_INIT_BIAS, 0}
#define VEC(n, a, init) {n, {a, DIM_NONE, DIM_NONE}, MK_STORE_F32, init, 0}
#define F32_2D(n, a, b, init) {n, {a, b, DIM_NONE}, MK_STORE_F32, init, 0}
#define RULES_END {NULL, {DIM_NONE, DIM_NONE, DIM_NONE}, MK_STORE_F32, MK_INIT_ONES, 0}

static const mk_rule rules_embedding[] = {
    {"token_embd.weight", {DIM_EMBD, DIM_VOCAB, DIM_NONE}, MK_STORE_WEIGHT, MK_INIT_MATRIX, RULE_EMBEDDING},
    RULES_END,
};
static const mk_rule rules_head[] = {
    NORM("output_norm.weight", DIM_EMBD),
    {"output.weight", {DIM_EMBD, DIM_VOCAB, DIM_NONE}, MK_STORE_WEIGHT, MK_INIT_HEAD, RULE_OUTPUT},
    RULES_END,
};

static const mk_rule layer_llama[] = {
    NORM("blk.%d.attn_norm.weight", DIM_EMBD),
    MATRIX("blk.%d.attn_q.weight", DIM_EMBD, DIM_Q),
    MATRIX("blk.%d.attn_k.weight", DIM_EMBD, DIM_KV),
    MATRIX("blk.%d.attn_v.weight", DIM_EMBD, DIM_KV),
    MATRIX("blk.%d.attn_output.weight", DIM_Q, DIM_EMBD),
    NORM("blk.%d.ffn_norm.weight", DIM_EMBD),
    MATRIX("blk.%d.ffn_gate.weight", DIM_EMBD, DIM_FF),
    MATRIX("blk.%d.ffn_down.weight", DIM_FF, DIM_EMBD),
    MATRIX("blk.%d.ffn_up.weight", DIM_EMBD, DIM_FF),
    RULES_END,
};

static const mk_rule layer_qwen2[] = {
    NORM("blk.%d.attn_norm.weight", DIM_EMBD),
    MATRIX("blk.%d.attn_q.weight", DIM_EMBD, DIM_Q),
    BIAS("blk.%d.attn_q.bias", DIM_Q),
    MATRIX("blk.%d.attn_k.weight", DIM_EMBD, DIM_KV),
    BIAS("blk.%d.attn_k.bias", DIM_KV),
    MATRIX("blk.%d.attn_v.weight", DIM_EMBD, DIM_KV),
    BIAS("blk.%d.attn_v.bias", DIM_KV),
    MATRIX("blk.%d.attn_output.weight", DIM_Q, DIM_EMBD),
    NORM("blk.%d.ffn_norm.weight", DIM_EMBD),
    MATRIX("blk.%d.ffn_gate.weight", DIM_EMBD, DIM_FF),
    MATRIX("blk.%d.ffn_down.weight", DIM_FF, DIM_EMBD),
    MATRIX("blk.%d.ffn_up.weight", DIM_EMBD, DIM_FF),
    RULES_END,
};

static const mk_rule layer_qwen3[] = {
    NORM("blk.%d.attn_norm.weight", DIM_EMBD),
    MATRIX("blk.%d.attn_q.weight", DIM_EMBD, DIM_Q),
    MATRIX("blk.%d.attn_k.weight", DIM_EMBD, DIM_KV),
    MATRIX("blk.%d.attn_v.weight", DIM_EMBD, DIM_KV),
    MATRIX("blk.%d.attn_output.weight", DIM_Q, DIM_EMBD),
    NORM("blk.%d.attn_k_norm.weight", DIM_HEAD),
    NORM("blk.%d.attn_q_norm.weight", DIM_HEAD),
    NORM("blk.%d.ffn_norm.weight", DIM_EMBD),
    MATRIX("blk.%d.ffn_gate.weight", DIM_EMBD, DIM_FF),
    MATRIX("blk.%d.ffn_down.weight", DIM_FF, DIM_EMBD),
    MATRIX("blk.%d.ffn_up.weight", DIM_EMBD, DIM_FF),
    RULES_END,
};

static const mk_rule layer_qwen3moe[] = {
    NORM("blk.%d.attn_norm.weight", DIM_EMBD),
    MATRIX("blk.%d.attn_q.weight", DIM_EMBD, DIM_Q),
    MATRIX("blk.%d.attn_k.weight", DIM_EMBD, DIM_KV),
    MATRIX("blk.%d.attn_v.weight", DIM_EMBD, DIM_KV),
    MATRIX("blk.%d.attn_output.weight", DIM_Q, DIM_EMBD),
    NORM("blk.%d.attn_k_norm.weight", DIM_HEAD),
    NORM("blk.%d.attn_q_norm.weight", DIM_HEAD),
    NORM("blk.%d.ffn_norm.weight", DIM_EMBD),
    /* The router stays f32, as llama-quantize leaves it. */
    {"blk.%d.ffn_gate_inp.weight", {DIM_EMBD, DIM_EXPERT, DIM_NONE}, MK_STORE_F32, MK_INIT_MATRIX, 0},
    EXPERTS("blk.%d.ffn_gate_exps.weight", DIM_EMBD, DIM_FF_EXP),
    EXPERTS("blk.%d.ffn_down_exps.weight", DIM_FF_EXP, DIM_EMBD),
    EXPERTS("blk.%d.ffn_up_exps.weight", DIM_EMBD, DIM_FF_EXP),
    RULES_END,
};

static const mk_rule layer_gemma3[] = {
    NORM("blk.%d.attn_norm.weight", DIM_EMBD),
    MATRIX("blk.%d.attn_q.weight", DIM_EMBD, DIM_Q),
    MATRIX("blk.%d.attn_k.weight", DIM_EMBD, DIM_KV),
    MATRIX("blk.%d.attn_v.weight", DIM_EMBD, DIM_KV),
    MATRIX("blk.%d.attn_output.weight", DIM_Q, DIM_EMBD),
    NORM("blk.%d.post_attention_norm.weight", DIM_EMBD),
    NORM("blk.%d.attn_k_norm.weight", DIM_HEAD),
    NORM("blk.%d.attn_q_norm.weight", DIM_HEAD),
    NORM("blk.%d.ffn_norm.weight", DIM_EMBD),
    MATRIX("blk.%d.ffn_gate.weight", DIM_EMBD, DIM_FF),
    MATRIX("blk.%d.ffn_down.weight", DIM_FF, DIM_EMBD),
    MATRIX("blk.%d.ffn_up.weight", DIM_EMBD, DIM_FF),
    NORM("blk.%d.post_ffw_norm.weight", DIM_EMBD),
    RULES_END,
};

/* qwen35: gated delta net layers ... */
static const mk_rule layer_qwen35_gdn[] = {
    NORM("blk.%d.attn_norm.weight", DIM_EMBD),
    NORM("blk.%d.post_attention_norm.weight", DIM_EMBD),
    MATRIX("blk.%d.attn_qkv.weight", DIM_EMBD, DIM_CONV),
    MATRIX("blk.%d.attn_gate.weight", DIM_EMBD, DIM_INNER),
    F32_2D("blk.%d.ssm_conv1d.weight", DIM_DCONV, DIM_CONV, MK_INIT_MATRIX),
    VEC("blk.%d.ssm_dt.bias", DIM_SSM_HEADS, MK_INIT_DT_BIAS),
    VEC("blk.%d.ssm_a", DIM_SSM_HEADS, MK_INIT_SSM_A),
    MATRIX("blk.%d.ssm_beta.weight", DIM_EMBD, DIM_SSM_HEADS),
    MATRIX("blk.%d.ssm_alpha.weight", DIM_EMBD, DIM_SSM_HEADS),
    NORM("blk.%d.ssm_norm.weight", DIM_GDN_DV),
    MATRIX("blk.%d.ssm_out.weight", DIM_INNER, DIM_EMBD),
    MATRIX("blk.%d.ffn_gate.weight", DIM_EMBD, DIM_FF),
    MATRIX("blk.%d.ffn_down.weight", DIM_FF, DIM_EMBD),
    MATRIX("blk.%d.ffn_up.weight", DIM_EMBD, DIM_FF),
    RULES_END,
};

/* ... and gated attention layers (q and its sigmoid gate interleaved per head). */
static const mk_rule layer_qwen35_attn[] = {
    NORM("blk.%d.attn_norm.weight", DIM_EMBD),
    NORM("blk.%d.post_attention_norm.weight", DIM_EMBD),
    MATRIX("blk.%d.attn_q.weight", DIM_EMBD, DIM_Q2),
    MATRIX("blk.%d.attn_k.weight", DIM_EMBD, DIM_KV),
    MATRIX("blk.%d.attn_v.weight", DIM_EMBD, DIM_KV),
    MATRIX("blk.%d.attn_output.weight", DIM_Q, DIM_EMBD),
    NORM("blk.%d.attn_q_norm.weight", DIM_HEAD),
    NORM("blk.%d.attn_k_norm.weight", DIM_HEAD),
    MATRIX("blk.%d.ffn_gate.weight", DIM_EMBD, DIM_FF),
    MATRIX("blk.%d.ffn_down.weight", DIM_FF, DIM_EMBD),
    MATRIX("blk.%d.ffn_up.weight", DIM_EMBD, DIM_FF),
    RULES_END,
};

/* The MTP ("nextn") block after a qwen35 trunk: a gated-attention layer
 * (layer_qwen35_attn) plus these, as llama.cpp's converter writes them
 * (no embed_tokens / shared_head_head: the block reuses the model's). */
static const mk_rule layer_qwen35_nextn[] = {
    MATRIX("blk.%d.nextn.eh_proj.weight", DIM_EMBD2, DIM_EMBD),
    NORM("blk.%d.nextn.enorm.weight", DIM_EMBD),
    NORM("blk.%d.nextn.hnorm.weight", DIM_EMBD),
    NORM("blk.%d.nextn.shared_head_norm.weight", DIM_EMBD),
    RULES_END,
};

#define MAMBA2_MIXER                                                      \
    MATRIX("blk.%d.ssm_in.weight", DIM_EMBD, DIM_SSM_IN),                 \
    F32_2D("blk.%d.ssm_conv1d.weight", DIM_DCONV, DIM_CONV, MK_INIT_MATRIX), \
    BIAS("blk.%d.ssm_conv1d.bias", DIM_CONV),                             \
    VEC("blk.%d.ssm_dt.bias", DIM_SSM_HEADS, MK_INIT_DT_BIAS),            \
    F32_2D("blk.%d.ssm_a", DIM_ONE, DIM_SSM_HEADS, MK_INIT_SSM_A),        \
    F32_2D("blk.%d.ssm_d", DIM_ONE, DIM_SSM_HEADS, MK_INIT_SSM_D),        \
    F32_2D("blk.%d.ssm_norm.weight", DIM_NORM_GRP, DIM_GROUPS, MK_INIT_ONES), \
    MATRIX("blk.%d.ssm_out.weight", DIM_INNER, DIM_EMBD)

static const mk_rule layer_mamba2[] = {
    NORM("blk.%d.attn_norm.weight", DIM_EMBD),
    MAMBA2_MIXER,
    RULES_END,
};

/* falcon-h1: attention and mamba2 side by side; ffn_norm has no .weight
 * suffix in converted files. */
static const mk_rule layer_falcon_h1[] = {
    MAMBA2_MIXER,
    MATRIX("blk.%d.attn_q.weight", DIM_EMBD, DIM_Q),
    MATRIX("blk.%d.attn_k.weight", DIM_EMBD, DIM_KV),
    MATRIX("blk.%d.attn_v.weight", DIM_EMBD, DIM_KV),
    MATRIX("blk.%d.attn_output.weight", DIM_Q, DIM_EMBD),
    NORM("blk.%d.attn_norm.weight", DIM_EMBD),
    NORM("blk.%d.ffn_norm", DIM_EMBD),
    MATRIX("blk.%d.ffn_gate.weight", DIM_EMBD, DIM_FF),
    MATRIX("blk.%d.ffn_down.weight", DIM_FF, DIM_EMBD),
    MATRIX("blk.%d.ffn_up.weight", DIM_EMBD, DIM_FF),
    RULES_END,
};

/* ---- architectures ---- */

enum {
    HP_MOE = 1 << 0,       /* expert_count, expert_used_count, expert_feed_forward_length */
    HP_ROPE_DIMS = 1 << 1, /* rope.dimension_count (llama's converter writes it) */
    HP_SSM = 1 << 2,       /* ssm.* keys */
    HP_NO_ATTN = 1 << 3,   /* mamba2: head counts 0, no rope, no FFN */
    HP_SWA = 1 << 4,       /* gemma3: attention.sliding_window (+ pattern) */
    HP_GDN = 1 << 5,       /* qwen35: full_attention_interval, partial IMROPE */
};

struct mk_arch {
    const char *name;
    const mk_rule *layer;
    const mk_rule *layer_attn; /* hybrids: layers il with (il + 1) % attn_interval == 0, else NULL */
    int attn_interval;
    unsigned hparams;
    bool tied;          /* default: head shares token_embd */
    float rope_base;    /* defaults used by the generic presets */
    float rms_eps;
};

static const mk_arch archs[] = {
    {"llama", layer_llama, NULL, 0, HP_ROPE_DIMS, false, 10000.0f, 1e-5f},
    {"qwen2", layer_qwen2, NULL, 0, 0, true, 1000000.0f, 1e-6f},
    {"qwen3", layer_qwen3, NULL, 0, 0, true, 1000000.0f, 1e-6f},
    {"qwen3moe", layer_qwen3moe, NULL, 0, HP_MOE, false, 1000000.0f, 1e-6f},
    {"gemma3", layer_gemma3, NULL, 0, HP_SWA, true, 1000000.0f, 1e-6f},
    {"qwen35", layer_qwen35_gdn, layer_qwen35_attn, 2, HP_SSM | HP_GDN, true, 10000000.0f, 1e-6f},
    {"mamba2", layer_mamba2, NULL, 0, HP_SSM | HP_NO_ATTN, true, 10000.0f, 1e-5f},
    {"falcon-h1", layer_falcon_h1, NULL, 0, HP_SSM, false, 1e11f, 1e-5f},
};

const mk_arch *mk_arch_find(const char *name) {
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++)
        if (strcmp(archs[i].name, name) == 0) return &archs[i];
    return NULL;
}

const char *mk_arch_name(const mk_arch *a) { return a->name; }
bool mk_arch_tied(const mk_arch *a) { return a->tied; }
bool mk_arch_has_mtp(const mk_arch *a) { return (a->hparams & HP_GDN) != 0; }
const char *mk_arch_names(void) { return "llama qwen2 qwen3 qwen3moe gemma3 qwen35 mamba2 falcon-h1"; }

/* ---- presets ----
 * Rope base and eps of 0 mean "the arch's default"; tied comes from the arch.
 * n_vocab is filled from the tokenizer at run time. */
static const mk_preset presets[] = {
    /* For tests: every dimension small, GQA 4/2, MoE 4 experts top-2. */
    {"tiny", NULL,
     {.n_embd = 64, .n_layer = 2, .n_head = 4, .n_head_kv = 2, .head_dim = 16, .n_ff = 128, .n_ctx = 2048,
      .n_expert = 4, .n_expert_used = 2, .n_ff_exp = 64, .ssm_d_conv = 4, .ssm_d_inner = 64, .ssm_d_state = 16,
      .ssm_n_group = 2, .ssm_dt_rank = 4, .n_swa = 32},
     0},
    /* The built-in default model: rows are multiples of 256 so every
     * K-quant applies without fallback. */
    {"small", NULL,
     {.n_embd = 256, .n_layer = 4, .n_head = 8, .n_head_kv = 4, .head_dim = 32, .n_ff = 768, .n_ctx = 4096,
      .n_expert = 8, .n_expert_used = 2, .n_ff_exp = 256, .ssm_d_conv = 4, .ssm_d_inner = 256, .ssm_d_state = 32,
      .ssm_n_group = 2, .ssm_dt_rank = 8, .n_swa = 128},
     0},
    /* For tests of the attention kernels real models use: small, but with
     * heads of 128 values (Qwen3's), GQA 4/2. */
    {"heads128", NULL,
     {.n_embd = 256, .n_layer = 2, .n_head = 4, .n_head_kv = 2, .head_dim = 128, .n_ff = 512, .n_ctx = 4096,
      .n_expert = 4, .n_expert_used = 2, .n_ff_exp = 128, .ssm_d_conv = 4, .ssm_d_inner = 256, .ssm_d_state = 32,
      .ssm_n_group = 2, .ssm_dt_rank = 8, .n_swa = 64},
     0},
    /* Qwen3-0.6B's shapes and vocabulary size, with random weights. */
    {"qwen3-0.6b", "qwen3",
     {.n_embd = 1024, .n_layer = 28, .n_head = 16, .n_head_kv = 8, .head_dim = 128, .n_ff = 3072,
      .n_ctx = 40960, .rope_base = 1000000.0f, .rms_eps = 1e-6f, .tied = true},
     151936},
    /* Llama-3.2-1B's shapes and vocabulary size (tied head), random weights:
     * the llama-arch row of the engine benchmark, which llama.cpp also runs.
     * The byte-level tokenizer is padded up to the vocabulary size. */
    {"llama-3.2-1b", "llama",
     {.n_embd = 2048, .n_layer = 16, .n_head = 32, .n_head_kv = 8, .head_dim = 64, .n_ff = 8192,
      .n_ctx = 131072, .rope_base = 500000.0f, .rms_eps = 1e-5f, .tied = true},
     128256},
};

const mk_preset *mk_preset_find(const char *name) {
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
        if (strcmp(presets[i].name, name) == 0) return &presets[i];
    return NULL;
}

const char *mk_preset_names(void) { return "tiny small heads128 qwen3-0.6b llama-3.2-1b"; }

/* ---- weight types ---- */

bool mk_weight_type_ok(ember_dtype t) {
    switch (t) {
    case DT_F32: case DT_F16: case DT_BF16: case DT_Q8_0: case DT_Q4_0: case DT_Q4_1: case DT_Q5_0:
    case DT_Q5_1: case DT_Q2_K: case DT_Q3_K: case DT_Q4_K: case DT_Q5_K: case DT_Q6_K:
    case DT_IQ4_NL: case DT_IQ4_XS:
        return true;
    default:
        return false;
    }
}

uint32_t mk_file_type(ember_dtype t) {
    /* llama_ftype ids; uniform K-quant files are closest to the _S mixes. */
    switch (t) {
    case DT_F32: return 0;
    case DT_F16: return 1;
    case DT_Q4_0: return 2;
    case DT_Q4_1: return 3;
    case DT_Q8_0: return 7;
    case DT_Q5_0: return 8;
    case DT_Q5_1: return 9;
    case DT_Q2_K: return 10;
    case DT_Q3_K: return 11;
    case DT_Q4_K: return 14;
    case DT_Q5_K: return 16;
    case DT_Q6_K: return 18;
    case DT_IQ4_NL: return 25;
    case DT_IQ4_XS: return 30;
    case DT_BF16: return 32;
    default: return 0;
    }
}

ember_dtype mk_fallback_type(ember_dtype want, int64_t ne0) {
    const dtype_info *info = dtype_info_of(want);
    if (info == NULL || ne0 % info->block_elems == 0) return want;
    ember_dtype next;
    switch (want) {
    case DT_Q2_K: case DT_Q3_K: case DT_Q4_K: next = DT_Q5_0; break;
    case DT_Q5_K: next = DT_Q5_1; break;
    case DT_Q6_K: next = DT_Q8_0; break;
    case DT_IQ4_XS: next = DT_IQ4_NL; break; /* as llama-quantize substitutes */
    default: next = DT_F16; break;
    }
    return mk_fallback_type(next, ne0);
}

/* ---- keys ---- */

void mk_write_hparams(const mk_arch *a, const mk_config *c, const char *model_name, ember_dtype wtype,
                      uint64_t seed, gguf_writer *w) {
    char key[128], text[160];
    gguf_writer_set_str(w, "general.architecture", a->name);
    gguf_writer_set_str(w, "general.name", model_name);
    snprintf(text, sizeof text, "random weights from ember mkmodel, seed %llu", (unsigned long long)seed);
    gguf_writer_set_str(w, "general.description", text);
    gguf_writer_set_u32(w, "general.file_type", mk_file_type(wtype));
    gguf_writer_set_u32(w, "general.quantization_version", 2);
#define SET_U32(suffix, v)                                      \
    do {                                                        \
        snprintf(key, sizeof key, "%s." suffix, a->name);       \
        gguf_writer_set_u32(w, key, (uint32_t)(v));             \
    } while (0)
#define SET_F32(suffix, v)                                      \
    do {                                                        \
        snprintf(key, sizeof key, "%s." suffix, a->name);       \
        gguf_writer_set_f32(w, key, (v));                       \
    } while (0)
    SET_U32("context_length", c->n_ctx);
    SET_U32("embedding_length", c->n_embd);
    SET_U32("block_count", c->n_layer + c->n_nextn);
    if (c->n_nextn > 0) SET_U32("nextn_predict_layers", c->n_nextn);
    SET_U32("feed_forward_length", (a->hparams & HP_NO_ATTN) ? 0 : c->n_ff);
    if (a->hparams & HP_SSM) {
        SET_U32("ssm.conv_kernel", c->ssm_d_conv);
        SET_U32("ssm.inner_size", c->ssm_d_inner);
        SET_U32("ssm.state_size", c->ssm_d_state);
        SET_U32("ssm.time_step_rank", c->ssm_dt_rank);
        SET_U32("ssm.group_count", c->ssm_n_group);
    }
    if (a->hparams & HP_NO_ATTN) {
        SET_U32("attention.head_count", 0);
        SET_F32("attention.layer_norm_rms_epsilon", c->rms_eps > 0 ? c->rms_eps : a->rms_eps);
        return;
    }
    if (a->hparams & HP_SWA) {
        /* llama.cpp's default period is 6; smaller models get a period that
         * still has one global layer. */
        SET_U32("attention.sliding_window", c->n_swa);
        if (c->n_layer < 6) SET_U32("attention.sliding_window_pattern", c->n_layer);
    }
    if (a->hparams & HP_GDN) {
        SET_U32("full_attention_interval", a->attn_interval);
        /* partial rotary over a quarter of the head, all of it on the t/h/w streams */
        int32_t rot = (int32_t)(c->head_dim / 4 < 2 ? 2 : c->head_dim / 4), pairs = rot / 2;
        int32_t sections[4] = {(pairs + 2) / 3, (pairs + 1) / 3, pairs / 3, 0};
        SET_U32("rope.dimension_count", rot);
        snprintf(key, sizeof key, "%s.rope.dimension_sections", a->name);
        gguf_writer_set_arr(w, key, GGUF_TYPE_INT32, sections, 4);
    }
    if (a->hparams & HP_MOE) {
        SET_U32("expert_feed_forward_length", c->n_ff_exp);
        SET_U32("expert_count", c->n_expert);
        SET_U32("expert_used_count", c->n_expert_used);
    }
    SET_U32("attention.head_count", c->n_head);
    SET_U32("attention.head_count_kv", c->n_head_kv);
    SET_U32("attention.key_length", c->head_dim);
    SET_U32("attention.value_length", c->head_dim);
    if (a->hparams & HP_ROPE_DIMS) SET_U32("rope.dimension_count", c->head_dim);
    SET_F32("rope.freq_base", c->rope_base > 0 ? c->rope_base : a->rope_base);
    SET_F32("attention.layer_norm_rms_epsilon", c->rms_eps > 0 ? c->rms_eps : a->rms_eps);
#undef SET_U32
#undef SET_F32
}

/* ---- tensor plan ---- */

static int plan_rule(const mk_rule *r, int layer, const mk_config *c, ember_dtype wtype, mk_tensor *t,
                     ember_error *err) {
    memset(t, 0, sizeof *t);
    if (layer >= 0) snprintf(t->name, sizeof t->name, r->name, layer);
    else snprintf(t->name, sizeof t->name, "%s", r->name);
    for (int d = 0; d < 4; d++) t->ne[d] = 1;
    for (int d = 0; d < 3 && r->shape[d] != DIM_NONE; d++) {
        t->ne[d] = dim_value(r->shape[d], c);
        if (t->ne[d] < 1) return ember_fail(err, "tensor '%s': dimension %d is %lld", t->name, d, (long long)t->ne[d]);
        t->n_dims = (uint32_t)d + 1;
    }
    t->init = r->init;
    if ((r->flags & RULE_EMBEDDING) && c->tied) t->init = MK_INIT_HEAD;
    t->type = r->storage == MK_STORE_F32 ? DT_F32 : mk_fallback_type(wtype, t->ne[0]);
    return 0;
}

int mk_plan_tensors(const mk_arch *a, const mk_config *c, ember_dtype wtype, mk_tensor **out, ember_error *err) {
    int per_layer = 0, per_attn = 0;
    while (a->layer[per_layer].name) per_layer++;
    while (a->layer_attn && a->layer_attn[per_attn].name) per_attn++;
    if (per_attn > per_layer) per_layer = per_attn;
    int per_nextn = 0;
    while (layer_qwen35_nextn[per_nextn].name) per_nextn++;
    int cap = 4 + per_layer * (int)c->n_layer + (per_attn + per_nextn) * (int)c->n_nextn;
    mk_tensor *ts = calloc((size_t)cap, sizeof *ts);
    if (ts == NULL) return ember_fail(err, "out of memory");
    int n = 0;
    for (const mk_rule *r = rules_embedding; r->name; r++)
        if (plan_rule(r, -1, c, wtype, &ts[n++], err) < 0) goto fail;
    for (int l = 0; l < c->n_layer; l++) {
        const mk_rule *rules = a->layer_attn && (l + 1) % a->attn_interval == 0 ? a->layer_attn : a->layer;
        for (const mk_rule *r = rules; r->name; r++)
            if (plan_rule(r, l, c, wtype, &ts[n++], err) < 0) goto fail;
    }
    for (int l = (int)c->n_layer; l < c->n_layer + c->n_nextn; l++) {
        for (const mk_rule *r = a->layer_attn; r->name; r++)
            if (plan_rule(r, l, c, wtype, &ts[n++], err) < 0) goto fail;
        for (const mk_rule *r = layer_qwen35_nextn; r->name; r++)
            if (plan_rule(r, l, c, wtype, &ts[n++], err) < 0) goto fail;
    }
    for (const mk_rule *r = rules_head; r->name; r++) {
        if ((r->flags & RULE_OUTPUT) && c->tied) continue;
        if (plan_rule(r, -1, c, wtype, &ts[n++], err) < 0) goto fail;
    }
    *out = ts;
    return n;
fail:
    free(ts);
    return -1;
}
