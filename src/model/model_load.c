/* model_load.c - from a GGUF file to a bound, validated model.
 *
 * Loading is table-free on purpose: the architectures we run share one
 * tensor naming scheme, and the differences (QK-norm, Q/K/V biases, MoE FFN,
 * rope mode) are flags in model_hparams read from the architecture name and
 * the presence of tensors. Each layer gets a mixer (attention, gated delta
 * net, mamba2, or attention + mamba2) and an FFN kind (layer_weights), and
 * the cache stack follows from them: attention layers KV (ROT when
 * windowed), recurrent layers ARR, falcon-h1's double layers LIST. Every
 * tensor is checked against the shape the hyperparameters imply, so a
 * forward pass never indexes past a weight. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"
#include "tensor/quant.h"

static const struct {
    const char *name;
    model_arch arch;
} known_archs[] = {
    {"llama", ARCH_LLAMA},
    {"qwen2", ARCH_QWEN2},
    {"qwen3", ARCH_QWEN3},
    {"qwen3moe", ARCH_QWEN3MOE},
    {"gemma3", ARCH_GEMMA3},
    {"qwen35", ARCH_QWEN35},
    {"qwen3next", ARCH_QWEN3NEXT},
    {"mamba2", ARCH_MAMBA2},
    {"falcon-h1", ARCH_FALCON_H1},
};

static bool is_gdn_arch(model_arch a) { return a == ARCH_QWEN35 || a == ARCH_QWEN3NEXT; }

static bool get_arch_int(const gguf_file *f, const char *arch, const char *suffix, int64_t *out) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return gguf_get_int(f, key, out);
}

static bool get_arch_float(const gguf_file *f, const char *arch, const char *suffix, double *out) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return gguf_get_float(f, key, out);
}

static int require_arch_int(const gguf_file *f, const char *arch, const char *suffix, int *out, ember_error *err) {
    int64_t v;
    if (!get_arch_int(f, arch, suffix, &v))
        return ember_fail(err, "missing or non-integer metadata key '%s.%s'", arch, suffix);
    if (v < 0 || v > (1 << 30)) return ember_fail(err, "metadata key '%s.%s' = %lld is out of range", arch, suffix, (long long)v);
    *out = (int)v;
    return 0;
}

static int read_hparams(model *m, ember_error *err) {
    const gguf_file *f = m->file;
    model_hparams *hp = &m->hp;
    gguf_str s;
    if (!gguf_get_str(f, "general.architecture", &s)) return ember_fail(err, "missing key 'general.architecture'");
    gguf_str_copy(s, hp->arch_name, sizeof hp->arch_name);
    bool found = false;
    for (size_t i = 0; i < sizeof known_archs / sizeof known_archs[0]; i++)
        if (strcmp(hp->arch_name, known_archs[i].name) == 0) {
            hp->arch = known_archs[i].arch;
            found = true;
        }
    if (!found) return ember_fail(err, "architecture '%s' is not supported", hp->arch_name);
    if (gguf_get_str(f, "general.name", &s)) gguf_str_copy(s, hp->name, sizeof hp->name);
    const char *a = hp->arch_name;
    bool attn = hp->arch != ARCH_MAMBA2;
    int64_t v;
    if (require_arch_int(f, a, "embedding_length", &hp->n_embd, err) < 0) return -1;
    if (require_arch_int(f, a, "block_count", &hp->n_layer, err) < 0) return -1;
    /* MTP ("nextn") blocks are stored after the trunk; the trunk runs without them. */
    if (get_arch_int(f, a, "nextn_predict_layers", &v) && v > 0 && v < hp->n_layer) {
        hp->n_nextn = (int)v;
        hp->n_layer -= hp->n_nextn;
    }
    double d;
    if (!get_arch_float(f, a, "attention.layer_norm_rms_epsilon", &d))
        return ember_fail(err, "missing key '%s.attention.layer_norm_rms_epsilon'", a);
    hp->rms_eps = (float)d;
    hp->embd_scale = 1.0f;
    hp->n_ctx_train = 2048;
    if (get_arch_int(f, a, "context_length", &v)) hp->n_ctx_train = (int)v;
    hp->n_ff = 0;
    if (get_arch_int(f, a, "feed_forward_length", &v)) hp->n_ff = (int)v;
    if (hp->arch == ARCH_MAMBA2 || hp->arch == ARCH_FALCON_H1 || is_gdn_arch(hp->arch)) {
        if (require_arch_int(f, a, "ssm.conv_kernel", &hp->ssm_d_conv, err) < 0) return -1;
        if (require_arch_int(f, a, "ssm.inner_size", &hp->ssm_d_inner, err) < 0) return -1;
        if (require_arch_int(f, a, "ssm.state_size", &hp->ssm_d_state, err) < 0) return -1;
        if (require_arch_int(f, a, "ssm.time_step_rank", &hp->ssm_dt_rank, err) < 0) return -1;
        if (require_arch_int(f, a, "ssm.group_count", &hp->ssm_n_group, err) < 0) return -1;
        if (hp->ssm_d_conv < 2 || hp->ssm_d_conv > 16 || hp->ssm_d_inner < 1 || hp->ssm_d_state < 1 || hp->ssm_dt_rank < 1 ||
            hp->ssm_n_group < 1 || hp->ssm_d_inner % hp->ssm_dt_rank != 0 || hp->ssm_dt_rank % hp->ssm_n_group != 0)
            return ember_fail(err, "inconsistent ssm shape: conv %d, inner %d, state %d, heads %d, groups %d",
                              hp->ssm_d_conv, hp->ssm_d_inner, hp->ssm_d_state, hp->ssm_dt_rank, hp->ssm_n_group);
    }
    if (is_gdn_arch(hp->arch)) {
        hp->full_attn_interval = 4;
        if (get_arch_int(f, a, "full_attention_interval", &v)) hp->full_attn_interval = (int)v;
        if (hp->full_attn_interval < 1) return ember_fail(err, "full_attention_interval %d", hp->full_attn_interval);
    }
    if (!attn) {
        hp->n_head = hp->n_head_kv = hp->d_k = hp->d_v = 0;
        return 0;
    }
    if (require_arch_int(f, a, "attention.head_count", &hp->n_head, err) < 0) return -1;
    hp->n_head_kv = hp->n_head;
    if (get_arch_int(f, a, "attention.head_count_kv", &v)) hp->n_head_kv = (int)v;
    if (hp->n_embd < 1 || hp->n_layer < 1 || hp->n_head < 1 || hp->n_head_kv < 1 || hp->n_head % hp->n_head_kv != 0)
        return ember_fail(err, "inconsistent attention shape: n_embd %d, n_layer %d, n_head %d, n_head_kv %d",
                          hp->n_embd, hp->n_layer, hp->n_head, hp->n_head_kv);
    hp->d_k = hp->n_embd / hp->n_head;
    if (get_arch_int(f, a, "attention.key_length", &v)) hp->d_k = (int)v;
    hp->d_v = hp->d_k;
    if (get_arch_int(f, a, "attention.value_length", &v)) hp->d_v = (int)v;
    hp->attn_scale = 1.0f / sqrtf((float)hp->d_k);

    rope_params *rp = &hp->rope;
    rp->mode = hp->arch == ARCH_LLAMA ? ROPE_NORM : ROPE_NEOX;
    rp->n_rot = hp->d_k;
    if (get_arch_int(f, a, "rope.dimension_count", &v)) rp->n_rot = (int)v;
    if (rp->n_rot < 2 || rp->n_rot > hp->d_k || rp->n_rot % 2 != 0)
        return ember_fail(err, "rope.dimension_count %d does not fit head size %d", rp->n_rot, hp->d_k);
    rp->freq_base = 10000.0f;
    if (get_arch_float(f, a, "rope.freq_base", &d)) rp->freq_base = (float)d;
    rp->freq_scale = 1.0f;
    rp->attn_factor = 1.0f;
    rp->ext_factor = 0.0f;
    rp->beta_fast = 32.0f;
    rp->beta_slow = 1.0f;
    rp->n_ctx_orig = hp->n_ctx_train;
    char scaling[32] = "linear";
    char key[160];
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    if (gguf_get_str(f, key, &s)) gguf_str_copy(s, scaling, sizeof scaling);
    double factor = 0;
    if (get_arch_float(f, a, "rope.scaling.factor", &factor) || get_arch_float(f, a, "rope.scale_linear", &factor)) {
        if (factor > 0) rp->freq_scale = (float)(1.0 / factor);
    }
    if (strcmp(scaling, "none") == 0) {
        rp->freq_scale = 1.0f;
    } else if (strcmp(scaling, "yarn") == 0) {
        rp->ext_factor = 1.0f;
        if (get_arch_int(f, a, "rope.scaling.original_context_length", &v)) rp->n_ctx_orig = (int)v;
        if (get_arch_float(f, a, "rope.scaling.yarn_ext_factor", &d) && d >= 0) rp->ext_factor = (float)d;
        if (get_arch_float(f, a, "rope.scaling.yarn_attn_factor", &d)) rp->attn_factor = (float)d;
        if (get_arch_float(f, a, "rope.scaling.yarn_beta_fast", &d)) rp->beta_fast = (float)d;
        if (get_arch_float(f, a, "rope.scaling.yarn_beta_slow", &d)) rp->beta_slow = (float)d;
    } else if (strcmp(scaling, "linear") != 0) {
        return ember_fail(err, "rope scaling type '%s' is not supported", scaling);
    }
    if (hp->arch == ARCH_LLAMA && rp->n_rot != hp->d_k)
        return ember_fail(err, "llama requires rope.dimension_count (%d) == head size (%d)", rp->n_rot, hp->d_k);
    if (hp->arch == ARCH_QWEN35) {
        /* IMROPE: for text every pair of the t/h/w streams sees the token
         * position, which is NEOX; a pair on the 4th stream would see 0. */
        snprintf(key, sizeof key, "%s.rope.dimension_sections", a);
        int64_t sec[4] = {0, 0, 0, 0}, idx = gguf_find_key(f, key);
        gguf_value_type et;
        uint64_t cnt = 0;
        if (idx >= 0 && gguf_kv_arr(f, idx, &et, &cnt))
            for (uint64_t i = 0; i < cnt && i < 4; i++) sec[i] = gguf_arr_int(f, idx, i);
        int64_t total = sec[0] + sec[1] + sec[2] + sec[3];
        for (int i = 0; i < rp->n_rot / 2 && total > 0; i++) {
            int64_t k = i % total;
            bool t = k % 3 == 0 && k < 3 * sec[0], h = k % 3 == 1 && k < 3 * sec[1], w = k % 3 == 2 && k < 3 * sec[2];
            if (!t && !h && !w)
                return ember_fail(err, "rope.dimension_sections put rotary pair %d on the extra stream (not supported)", i);
        }
    }
    if (hp->arch == ARCH_GEMMA3) {
        /* Local layers: base rope.freq_base_swa (default 10000), no scaling;
         * global layers: the file's rope. Q is scaled before attention. */
        hp->n_swa = 0;
        if (get_arch_int(f, a, "attention.sliding_window", &v)) hp->n_swa = (int)v;
        hp->swa_period = 6;
        if (get_arch_int(f, a, "attention.sliding_window_pattern", &v) && v > 0) hp->swa_period = (int)v;
        hp->rope_swa = *rp;
        hp->rope_swa.freq_base = 10000.0f;
        if (get_arch_float(f, a, "rope.freq_base_swa", &d)) hp->rope_swa.freq_base = (float)d;
        hp->rope_swa.freq_scale = 1.0f;
        hp->rope_swa.ext_factor = 0.0f;
        hp->rope_swa.attn_factor = 1.0f;
        hp->embd_scale = sqrtf((float)hp->n_embd);
        hp->q_prescale = true;
        if (hp->n_layer == 62) hp->attn_scale = 1.0f / sqrtf((float)(hp->n_embd / hp->n_head)); /* 27B */
    }

    if (hp->arch == ARCH_QWEN3MOE || hp->arch == ARCH_QWEN3NEXT) {
        if (require_arch_int(f, a, "expert_count", &hp->n_expert, err) < 0) return -1;
        if (require_arch_int(f, a, "expert_used_count", &hp->n_expert_used, err) < 0) return -1;
        if (hp->n_expert < 1 || hp->n_expert > 256 || hp->n_expert_used < 1 || hp->n_expert_used > hp->n_expert)
            return ember_fail(err, "bad expert counts: %d used of %d", hp->n_expert_used, hp->n_expert);
        hp->n_ff_exp = hp->n_ff / hp->n_expert_used;
        if (get_arch_int(f, a, "expert_feed_forward_length", &v)) hp->n_ff_exp = (int)v;
        if (hp->arch == ARCH_QWEN3NEXT) {
            hp->n_ff_shexp = hp->n_ff;
            if (get_arch_int(f, a, "expert_shared_feed_forward_length", &v)) hp->n_ff_shexp = (int)v;
        }
    }
    return 0;
}

/* Binds a matrix {n_in, n_out} (or one expert of a 3-D tensor). */
static int bind_matrix(model *m, const char *name, int64_t n_in, int64_t n_out, bool optional,
                       tensor_weight *w, ember_error *err) {
    const gguf_tensor *t = gguf_find_tensor(m->file, name);
    memset(w, 0, sizeof *w);
    if (t == NULL) return optional ? 0 : ember_fail(err, "missing tensor '%s'", name);
    if (t->ne[0] != n_in || t->ne[1] != n_out || t->ne[2] != 1 || t->ne[3] != 1)
        return ember_fail(err, "tensor '%s' has shape {%lld, %lld, %lld}, expected {%lld, %lld}", name,
                          (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)n_in,
                          (long long)n_out);
    w->type = (ember_dtype)t->type;
    w->n_in = n_in;
    w->n_out = n_out;
    w->row_bytes = dtype_row_bytes(w->type, n_in);
    w->data = t->data;
    return 0;
}

static int bind_experts(model *m, const char *name, int64_t n_in, int64_t n_out, int n_expert,
                        tensor_weight **out, ember_error *err) {
    const gguf_tensor *t = gguf_find_tensor(m->file, name);
    if (t == NULL) return ember_fail(err, "missing tensor '%s'", name);
    if (t->ne[0] != n_in || t->ne[1] != n_out || t->ne[2] != n_expert || t->ne[3] != 1)
        return ember_fail(err, "tensor '%s' has shape {%lld, %lld, %lld}, expected {%lld, %lld, %d}", name,
                          (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)n_in,
                          (long long)n_out, n_expert);
    tensor_weight *ws = calloc((size_t)n_expert, sizeof *ws);
    if (ws == NULL) return ember_fail(err, "out of memory");
    size_t row_bytes = dtype_row_bytes((ember_dtype)t->type, n_in);
    for (int e = 0; e < n_expert; e++) {
        ws[e].type = (ember_dtype)t->type;
        ws[e].n_in = n_in;
        ws[e].n_out = n_out;
        ws[e].row_bytes = row_bytes;
        ws[e].data = (const uint8_t *)t->data + (size_t)e * (size_t)n_out * row_bytes;
    }
    *out = ws;
    return 0;
}

/* Binds an f32 array of ne0 x ne1 elements (ggml shape {ne0, ne1}),
 * widening 16-bit storage. A vector (ne1 == 1) may also be stored {1, ne0}. */
static int bind_array(model *m, const char *name, int64_t ne0, int64_t ne1, bool optional, const float **out,
                      ember_error *err) {
    const gguf_tensor *t = gguf_find_tensor(m->file, name);
    *out = NULL;
    if (t == NULL) return optional ? 0 : ember_fail(err, "missing tensor '%s'", name);
    bool shape_ok = t->ne[0] == ne0 && t->ne[1] == ne1;
    if (ne1 == 1 && t->ne[0] == 1 && t->ne[1] == ne0) shape_ok = true;
    if (!shape_ok || t->ne[2] != 1 || t->ne[3] != 1)
        return ember_fail(err, "tensor '%s' has shape {%lld, %lld}, expected {%lld, %lld}", name, (long long)t->ne[0],
                          (long long)t->ne[1], (long long)ne0, (long long)ne1);
    int64_t n = ne0 * ne1;
    if (t->type == DT_F32 && ((uintptr_t)t->data % sizeof(float)) == 0) {
        *out = t->data;
        return 0;
    }
    if (t->type != DT_F32 && t->type != DT_F16 && t->type != DT_BF16)
        return ember_fail(err, "tensor '%s' must be f32, f16 or bf16", name);
    float *buf = malloc((size_t)n * sizeof(float));
    float **owned = realloc(m->owned, (size_t)(m->n_owned + 1) * sizeof *owned);
    if (buf == NULL || owned == NULL) {
        free(buf);
        if (owned) m->owned = owned;
        return ember_fail(err, "out of memory");
    }
    m->owned = owned;
    m->owned[m->n_owned++] = buf;
    if (t->type == DT_F32) memcpy(buf, t->data, (size_t)n * sizeof(float));
    else quant_dequantize_row((ember_dtype)t->type, t->data, buf, n);
    *out = buf;
    return 0;
}

/* Binds a 1-D tensor of n elements as f32, widening 16-bit storage. */
static int bind_vector(model *m, const char *name, int64_t n, bool optional, const float **out, ember_error *err) {
    return bind_array(m, name, n, 1, optional, out, err);
}

#define TNAME(suffix) (snprintf(name, sizeof name, "blk.%d.%s", il, suffix), name)

static int bind_attention(model *m, int il, layer_weights *L, ember_error *err) {
    const model_hparams *hp = &m->hp;
    char name[96];
    int64_t q_dim = (int64_t)hp->n_head * hp->d_k, k_dim = (int64_t)hp->n_head_kv * hp->d_k;
    int64_t v_dim = (int64_t)hp->n_head_kv * hp->d_v, o_dim = (int64_t)hp->n_head * hp->d_v;
    if (L->q_gated && hp->d_v != hp->d_k) return ember_fail(err, "gated attention needs d_v == d_k");
    if (bind_matrix(m, TNAME("attn_q.weight"), hp->n_embd, L->q_gated ? 2 * q_dim : q_dim, false, &L->wq, err) < 0) return -1;
    if (bind_matrix(m, TNAME("attn_k.weight"), hp->n_embd, k_dim, false, &L->wk, err) < 0) return -1;
    if (bind_matrix(m, TNAME("attn_v.weight"), hp->n_embd, v_dim, false, &L->wv, err) < 0) return -1;
    if (bind_matrix(m, TNAME("attn_output.weight"), o_dim, hp->n_embd, false, &L->wo, err) < 0) return -1;
    if (bind_vector(m, TNAME("attn_q.bias"), q_dim, true, &L->bq, err) < 0) return -1;
    if (bind_vector(m, TNAME("attn_k.bias"), k_dim, true, &L->bk, err) < 0) return -1;
    if (bind_vector(m, TNAME("attn_v.bias"), v_dim, true, &L->bv, err) < 0) return -1;
    if (bind_vector(m, TNAME("attn_q_norm.weight"), hp->d_k, true, &L->q_norm, err) < 0) return -1;
    if (bind_vector(m, TNAME("attn_k_norm.weight"), hp->d_k, true, &L->k_norm, err) < 0) return -1;
    if (hp->has_qk_norm && (L->q_norm == NULL || L->k_norm == NULL))
        return ember_fail(err, "layer %d: %s needs attn_q_norm and attn_k_norm", il, hp->arch_name);
    return 0;
}

static int bind_ffn(model *m, int il, layer_weights *L, ember_error *err) {
    const model_hparams *hp = &m->hp;
    char name[96];
    if (L->ffn == FFN_MOE) {
        int E = hp->n_expert, F = hp->n_ff_exp;
        if (bind_matrix(m, TNAME("ffn_gate_inp.weight"), hp->n_embd, E, false, &L->router, err) < 0) return -1;
        if (gguf_find_tensor(m->file, TNAME("ffn_gate_up_exps.weight"))) {
            /* fused {n_embd, 2 F, E}: per expert, rows [0, F) gate, [F, 2F) up */
            if (bind_experts(m, name, hp->n_embd, 2 * (int64_t)F, E, &L->exp_gate, err) < 0) return -1;
            L->exp_up = calloc((size_t)E, sizeof *L->exp_up);
            if (L->exp_up == NULL) return ember_fail(err, "out of memory");
            for (int e = 0; e < E; e++) {
                L->exp_gate[e].n_out = F;
                L->exp_up[e] = L->exp_gate[e];
                L->exp_up[e].data = (const uint8_t *)L->exp_gate[e].data + (size_t)F * L->exp_gate[e].row_bytes;
            }
        } else {
            if (bind_experts(m, TNAME("ffn_gate_exps.weight"), hp->n_embd, F, E, &L->exp_gate, err) < 0) return -1;
            if (bind_experts(m, TNAME("ffn_up_exps.weight"), hp->n_embd, F, E, &L->exp_up, err) < 0) return -1;
        }
        if (bind_experts(m, TNAME("ffn_down_exps.weight"), F, hp->n_embd, E, &L->exp_down, err) < 0) return -1;
        if (hp->n_ff_shexp > 0) {
            int64_t S = hp->n_ff_shexp;
            if (bind_matrix(m, TNAME("ffn_gate_inp_shexp.weight"), hp->n_embd, 1, false, &L->shexp_inp, err) < 0) return -1;
            if (bind_matrix(m, TNAME("ffn_gate_shexp.weight"), hp->n_embd, S, false, &L->shexp_gate, err) < 0) return -1;
            if (bind_matrix(m, TNAME("ffn_up_shexp.weight"), hp->n_embd, S, false, &L->shexp_up, err) < 0) return -1;
            if (bind_matrix(m, TNAME("ffn_down_shexp.weight"), S, hp->n_embd, false, &L->shexp_down, err) < 0) return -1;
        }
        return 0;
    }
    if (hp->n_ff < 1) return ember_fail(err, "missing key '%s.feed_forward_length'", hp->arch_name);
    if (bind_matrix(m, TNAME("ffn_gate.weight"), hp->n_embd, hp->n_ff, false, &L->ffn_gate, err) < 0) return -1;
    if (bind_matrix(m, TNAME("ffn_up.weight"), hp->n_embd, hp->n_ff, false, &L->ffn_up, err) < 0) return -1;
    if (bind_matrix(m, TNAME("ffn_down.weight"), hp->n_ff, hp->n_embd, false, &L->ffn_down, err) < 0) return -1;
    return 0;
}

/* Gated delta net (qwen35 / qwen3next); conv and delta-rule state sizes. */
static int bind_gdn(model *m, int il, layer_weights *L, ember_error *err) {
    const model_hparams *hp = &m->hp;
    char name[96];
    int64_t conv_dim = ssm_conv_dim(hp), n_v = hp->ssm_dt_rank, d_v = hp->ssm_d_inner / hp->ssm_dt_rank;
    if (gguf_find_tensor(m->file, TNAME("attn_qkv.weight")) == NULL)
        return ember_fail(err, "layer %d: only GDN files with attn_qkv/attn_gate are supported (legacy fused ssm_in is not)", il);
    if (bind_matrix(m, TNAME("attn_qkv.weight"), hp->n_embd, conv_dim, false, &L->ssm_in, err) < 0) return -1;
    if (bind_matrix(m, TNAME("attn_gate.weight"), hp->n_embd, hp->ssm_d_inner, false, &L->ssm_z, err) < 0) return -1;
    if (hp->arch == ARCH_QWEN3NEXT) {
        if (bind_matrix(m, TNAME("ssm_ba.weight"), hp->n_embd, 2 * n_v, false, &L->ssm_beta, err) < 0) return -1;
    } else {
        if (bind_matrix(m, TNAME("ssm_beta.weight"), hp->n_embd, n_v, false, &L->ssm_beta, err) < 0) return -1;
        if (bind_matrix(m, TNAME("ssm_alpha.weight"), hp->n_embd, n_v, false, &L->ssm_alpha, err) < 0) return -1;
    }
    if (bind_array(m, TNAME("ssm_conv1d.weight"), hp->ssm_d_conv, conv_dim, false, &L->conv_w, err) < 0) return -1;
    if (bind_vector(m, TNAME("ssm_conv1d.bias"), conv_dim, true, &L->conv_b, err) < 0) return -1;
    if (bind_vector(m, TNAME("ssm_dt.bias"), n_v, false, &L->dt_bias, err) < 0) return -1;
    if (bind_vector(m, TNAME("ssm_a"), n_v, false, &L->ssm_a, err) < 0) return -1;
    if (bind_vector(m, TNAME("ssm_norm.weight"), d_v, false, &L->ssm_norm, err) < 0) return -1;
    if (bind_matrix(m, TNAME("ssm_out.weight"), hp->ssm_d_inner, hp->n_embd, false, &L->ssm_out, err) < 0) return -1;
    L->conv_off = m->state_floats;
    m->state_floats += (size_t)(hp->ssm_d_conv - 1) * (size_t)conv_dim;
    L->ssm_off = m->state_floats;
    m->state_floats += (size_t)n_v * (size_t)hp->ssm_d_state * (size_t)d_v;
    return 0;
}

/* Mamba2 mixer (mamba2, falcon-h1). */
static int bind_mamba2(model *m, int il, layer_weights *L, ember_error *err) {
    const model_hparams *hp = &m->hp;
    char name[96];
    int64_t conv_dim = ssm_conv_dim(hp), H = hp->ssm_dt_rank, G = hp->ssm_n_group;
    int64_t in_dim = hp->ssm_d_inner + conv_dim + H;
    if (bind_matrix(m, TNAME("ssm_in.weight"), hp->n_embd, in_dim, false, &L->ssm_in, err) < 0) return -1;
    if (bind_array(m, TNAME("ssm_conv1d.weight"), hp->ssm_d_conv, conv_dim, false, &L->conv_w, err) < 0) return -1;
    if (bind_vector(m, TNAME("ssm_conv1d.bias"), conv_dim, true, &L->conv_b, err) < 0) return -1;
    if (bind_vector(m, TNAME("ssm_dt.bias"), H, false, &L->dt_bias, err) < 0) return -1;
    if (bind_vector(m, TNAME("ssm_a"), H, false, &L->ssm_a, err) < 0) return -1;
    if (bind_vector(m, TNAME("ssm_d"), H, false, &L->ssm_d, err) < 0) return -1;
    if (bind_array(m, TNAME("ssm_norm.weight"), hp->ssm_d_inner / G, G, hp->arch == ARCH_FALCON_H1, &L->ssm_norm, err) < 0)
        return -1;
    if (bind_matrix(m, TNAME("ssm_out.weight"), hp->ssm_d_inner, hp->n_embd, false, &L->ssm_out, err) < 0) return -1;
    if (hp->ssm_d_inner % G != 0) return ember_fail(err, "ssm.inner_size %d is not a multiple of %lld groups", hp->ssm_d_inner, (long long)G);
    L->conv_off = m->state_floats;
    m->state_floats += (size_t)(hp->ssm_d_conv - 1) * (size_t)conv_dim;
    L->ssm_off = m->state_floats;
    m->state_floats += (size_t)hp->ssm_d_inner * (size_t)hp->ssm_d_state;
    return 0;
}

/* Decides the layer's mixer, FFN, rope and window, binds its tensors and
 * sets its cache kind and KV widths. */
static int bind_layer(model *m, int il, ember_error *err) {
    model_hparams *hp = &m->hp;
    layer_weights *L = &m->layers[il];
    cache_layer *cl = &m->stack[il];
    char name[96];
    L->mixer = MIX_ATTN;
    L->ffn = hp->n_expert > 0 ? FFN_MOE : FFN_SWIGLU;
    L->rope = &hp->rope;
    const char *ffn_norm = "ffn_norm.weight";
    switch (hp->arch) {
    case ARCH_GEMMA3:
        L->ffn = FFN_GEGLU;
        if (hp->n_swa > 0 && il % hp->swa_period < hp->swa_period - 1) {
            L->window = hp->n_swa;
            L->rope = &hp->rope_swa;
        }
        if (bind_vector(m, TNAME("post_attention_norm.weight"), hp->n_embd, false, &L->post_attn_norm, err) < 0) return -1;
        if (bind_vector(m, TNAME("post_ffw_norm.weight"), hp->n_embd, false, &L->post_ffn_norm, err) < 0) return -1;
        break;
    case ARCH_QWEN35:
    case ARCH_QWEN3NEXT:
        if ((il + 1) % hp->full_attn_interval != 0) L->mixer = MIX_GDN;
        else L->q_gated = true;
        ffn_norm = "post_attention_norm.weight"; /* the pre-FFN norm, despite its name */
        break;
    case ARCH_MAMBA2:
        L->mixer = MIX_MAMBA2;
        L->ffn = FFN_NONE;
        break;
    case ARCH_FALCON_H1:
        L->mixer = MIX_ATTN_MAMBA2;
        if (gguf_find_tensor(m->file, TNAME("ffn_norm.weight")) == NULL) ffn_norm = "ffn_norm"; /* converter quirk */
        break;
    default:
        break;
    }
    if (bind_vector(m, TNAME("attn_norm.weight"), hp->n_embd, false, &L->attn_norm, err) < 0) return -1;
    if (L->mixer == MIX_ATTN || L->mixer == MIX_ATTN_MAMBA2) {
        if (bind_attention(m, il, L, err) < 0) return -1;
        m->kv_k_width[il] = hp->n_head_kv * hp->d_k;
        m->kv_v_width[il] = hp->n_head_kv * hp->d_v;
        m->has_attention = true;
    }
    if (L->mixer == MIX_GDN && bind_gdn(m, il, L, err) < 0) return -1;
    if ((L->mixer == MIX_MAMBA2 || L->mixer == MIX_ATTN_MAMBA2) && bind_mamba2(m, il, L, err) < 0) return -1;
    if (L->ffn != FFN_NONE) {
        if (bind_vector(m, TNAME(ffn_norm), hp->n_embd, false, &L->ffn_norm, err) < 0) return -1;
        if (bind_ffn(m, il, L, err) < 0) return -1;
    }
    cl->kind = L->mixer == MIX_ATTN ? (L->window > 0 ? CACHE_KIND_ROT : CACHE_KIND_KV)
             : L->mixer == MIX_ATTN_MAMBA2 ? CACHE_KIND_LIST : CACHE_KIND_ARR;
    cl->window = L->window;
    return 0;
}
/* The first MTP block (blk.n_layer): a full-attention qwen35 decoder block
 * whatever full_attention_interval says, plus the nextn projections. A file
 * without nextn.eh_proj has no usable head and loads without one. */
static int bind_mtp(model *m, ember_error *err) {
    model_hparams *hp = &m->hp;
    int il = hp->n_layer;
    char name[96];
    if (hp->n_nextn < 1 || !is_gdn_arch(hp->arch) || gguf_find_tensor(m->file, TNAME("nextn.eh_proj.weight")) == NULL)
        return 0;
    mtp_weights *w = calloc(1, sizeof *w);
    if (w == NULL) return ember_fail(err, "out of memory");
    m->mtp = w;
    layer_weights *L = &w->block;
    L->mixer = MIX_ATTN;
    L->ffn = hp->n_expert > 0 ? FFN_MOE : FFN_SWIGLU;
    L->rope = &hp->rope;
    L->q_gated = true;
    if (bind_vector(m, TNAME("attn_norm.weight"), hp->n_embd, false, &L->attn_norm, err) < 0) return -1;
    if (bind_attention(m, il, L, err) < 0) return -1;
    if (bind_vector(m, TNAME("post_attention_norm.weight"), hp->n_embd, false, &L->ffn_norm, err) < 0) return -1;
    if (bind_ffn(m, il, L, err) < 0) return -1;
    if (bind_matrix(m, TNAME("nextn.eh_proj.weight"), 2 * (int64_t)hp->n_embd, hp->n_embd, false, &w->eh_proj, err) < 0)
        return -1;
    if (bind_vector(m, TNAME("nextn.enorm.weight"), hp->n_embd, false, &w->enorm, err) < 0) return -1;
    if (bind_vector(m, TNAME("nextn.hnorm.weight"), hp->n_embd, false, &w->hnorm, err) < 0) return -1;
    if (bind_vector(m, TNAME("nextn.shared_head_norm.weight"), hp->n_embd, true, &w->head_norm, err) < 0) return -1;
    if (w->head_norm == NULL) w->head_norm = m->output_norm;
    if (gguf_find_tensor(m->file, TNAME("nextn.embed_tokens.weight")) ||
        gguf_find_tensor(m->file, TNAME("nextn.shared_head_head.weight")))
        return ember_fail(err, "blk.%d: MTP blocks with their own embed_tokens/shared_head_head are not supported", il);
    w->kv_k_width[0] = hp->n_head_kv * hp->d_k;
    w->kv_v_width[0] = hp->n_head_kv * hp->d_v;
    return 0;
}
#undef TNAME

static int bind_model(model *m, ember_error *err) {
    model_hparams *hp = &m->hp;
    hp->has_qk_norm = hp->arch == ARCH_QWEN3 || hp->arch == ARCH_QWEN3MOE || hp->arch == ARCH_GEMMA3 || is_gdn_arch(hp->arch);
    const gguf_tensor *emb = gguf_find_tensor(m->file, "token_embd.weight");
    if (emb == NULL) return ember_fail(err, "missing tensor 'token_embd.weight'");
    hp->n_vocab = (int)emb->ne[1];
    if (bind_matrix(m, "token_embd.weight", hp->n_embd, hp->n_vocab, false, &m->tok_embd, err) < 0) return -1;
    if (bind_vector(m, "output_norm.weight", hp->n_embd, false, &m->output_norm, err) < 0) return -1;
    if (bind_matrix(m, "output.weight", hp->n_embd, hp->n_vocab, true, &m->output, err) < 0) return -1;
    hp->tied_output = m->output.data == NULL;
    if (hp->tied_output) m->output = m->tok_embd;
    /* Llama 3.1-style long-context factors divide each pair's frequency; they
     * apply to the model's main rope (not to gemma3's local-layer rope). */
    if (bind_vector(m, "rope_freqs.weight", hp->rope.n_rot / 2, true, &hp->rope.freq_factors, err) < 0) return -1;
    m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers);
    m->stack = calloc((size_t)hp->n_layer, sizeof *m->stack);
    m->kv_k_width = calloc((size_t)hp->n_layer, sizeof(int));
    m->kv_v_width = calloc((size_t)hp->n_layer, sizeof(int));
    if (!m->layers || !m->stack || !m->kv_k_width || !m->kv_v_width) return ember_fail(err, "out of memory");
    for (int il = 0; il < hp->n_layer; il++)
        if (bind_layer(m, il, err) < 0) return -1;
    hp->has_qkv_bias = m->layers[0].bq != NULL;
    return bind_mtp(m, err);
}

model *model_load(const char *path, ember_error *err) {
    model *m = calloc(1, sizeof *m);
    if (m == NULL) {
        ember_fail(err, "out of memory");
        return NULL;
    }
    m->file = gguf_open(path, err);
    if (m->file == NULL) {
        free(m);
        return NULL;
    }
    if (read_hparams(m, err) < 0 || bind_model(m, err) < 0) goto fail;
    m->tok = tokenizer_load_gguf(m->file, err);
    if (m->tok == NULL) goto fail;
    return m;
fail:
    ember_fail_prefix(err, "%s", path);
    model_free(m);
    return NULL;
}

void model_free(model *m) {
    if (m == NULL) return;
    if (m->layers) {
        for (int il = 0; il < m->hp.n_layer; il++) {
            free(m->layers[il].exp_gate);
            free(m->layers[il].exp_up);
            free(m->layers[il].exp_down);
        }
    }
    free(m->layers);
    if (m->mtp) {
        free(m->mtp->block.exp_gate);
        free(m->mtp->block.exp_up);
        free(m->mtp->block.exp_down);
        free(m->mtp);
    }
    free(m->stack);
    free(m->kv_k_width);
    free(m->kv_v_width);
    for (int i = 0; i < m->n_owned; i++) free(m->owned[i]);
    free(m->owned);
    tokenizer_free(m->tok);
    gguf_close(m->file);
    free(m);
}

const model_hparams *model_get_hparams(const model *m) { return &m->hp; }
const cache_layer *model_cache_stack(const model *m) { return m->stack; }
const tokenizer *model_get_tokenizer(const model *m) { return m->tok; }
const gguf_file *model_get_gguf(const model *m) { return m->file; }

bool model_has_mtp(const model *m) { return m->mtp != NULL; }

void model_mtp_kv_config(const model *m, int32_t n_blocks, kv_pool_config *cfg) {
    cfg->n_layer = 1;
    cfg->k_width = m->mtp ? m->mtp->kv_k_width : NULL;
    cfg->v_width = m->mtp ? m->mtp->kv_v_width : NULL;
    cfg->n_blocks = n_blocks;
    cfg->format = (kv_format){KV_FORMAT_F32};
    cfg->k_head = m->hp.d_k;
    cfg->v_head = m->hp.d_v;
    cfg->attention = ATTENTION_F32;
}

void model_kv_config(const model *m, int32_t n_blocks, kv_pool_config *cfg) {
    cfg->n_layer = m->hp.n_layer;
    cfg->k_width = m->kv_k_width;
    cfg->v_width = m->kv_v_width;
    cfg->n_blocks = n_blocks;
    cfg->format = (kv_format){KV_FORMAT_F32};
    cfg->k_head = m->hp.d_k;
    cfg->v_head = m->hp.d_v;
    cfg->attention = ATTENTION_F32;
}

attention_precision model_attention_precision(const model *m, kv_format format, attention_precision want,
                                              const char **why) {
    const char *fallback = op_attention_precision_fallback(want, m->hp.d_k, m->hp.d_v);
    if (fallback == NULL && want != ATTENTION_F32 && kv_format_is_kvarn(format))
        fallback = want == ATTENTION_INT8 ? "kvarn pools have no int8 attention kernel"
                                          : "kvarn pools have no bf16 attention kernel";
    if (why) *why = fallback;
    return fallback == NULL ? want : ATTENTION_F32;
}
