/* arch_gdn.c - the gated delta net mixer of qwen35 and qwen3next.
 *
 * For one token of one sequence (n_k key heads of d_k, n_v value heads of
 * d_v; value head h reads key head kh(h)):
 *   qkv = attn_qkv . xn,  z = attn_gate . xn
 *   beta_h = sigmoid(b_h),  g_h = A_h * softplus(a_h + dt_bias_h)
 *       qwen35: b = ssm_beta . xn, a = ssm_alpha . xn
 *       qwen3next: ssm_ba . xn, per key head [b of its r value heads | a ...]
 *   c = silu(conv(qkv))                     causal depthwise, no bias
 *   q, k = l2norm per key head of c's first two parts; q *= 1/sqrt(d_k)
 *   for value head h:  S_h = exp(g_h) S_h               (d_v x d_k)
 *                      u = beta_h (v_h - S_h k)
 *                      S_h += u k^T;   o_h = S_h q
 *   y_h = rmsnorm(o_h) * ssm_norm * silu(z_h);  out = ssm_out . y
 * kh(h) = h mod n_k for qwen35 (tiled value heads), h / (n_v / n_k) for
 * qwen3next (grouped).
 *
 * Batch invariance as in arch_mamba2.c: the recurrence runs token by token in
 * position order per sequence (no chunked parallel form), threads split
 * (sequence, value head) pairs. The per-token step of one head is
 * tensor/scan.h's (vectorized over d_k, the same bits on every ISA). */
#include <math.h>
#include <string.h>

#include "model/model_internal.h"
#include "tensor/scan.h"

static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

typedef struct gdn_task {
    model_ctx *c;
    const layer_weights *L;
    int n_rows;
} gdn_task;

/* r_ba[r] = [beta (n_v) | g (n_v)] from the raw projections in r_conv. */
static void task_beta_g(void *arg, int ith, int nth) {
    gdn_task *t = arg;
    model_ctx *c = t->c;
    const model_hparams *hp = &c->m->hp;
    const layer_weights *L = t->L;
    int n_v = hp->ssm_dt_rank, n_k = hp->ssm_n_group, rr = n_v / n_k, n = t->n_rows;
    bool next = hp->arch == ARCH_QWEN3NEXT;
    long r0, r1;
    ember_split_range(n, 1, ith, nth, &r0, &r1);
    for (long r = r0; r < r1; r++) {
        float *out = c->r_ba + (size_t)r * 2 * n_v;
        for (int h = 0; h < n_v; h++) {
            float b, a;
            if (next) {
                const float *ba = c->r_conv + (size_t)r * 2 * n_v;
                int kh = h / rr, j = h % rr;
                b = ba[kh * 2 * rr + j];
                a = ba[kh * 2 * rr + rr + j];
            } else {
                b = c->r_conv[(size_t)r * n_v + h];
                a = c->r_conv[(size_t)n * n_v + (size_t)r * n_v + h];
            }
            out[h] = 1.0f / (1.0f + expf(-b));
            out[n_v + h] = softplus(a + L->dt_bias[h]) * L->ssm_a[h];
        }
    }
}

/* l2-normalizes every q and k head of the conv output; scales q. */
static void task_qk_norm(void *arg, int ith, int nth) {
    gdn_task *t = arg;
    model_ctx *c = t->c;
    const model_hparams *hp = &c->m->hp;
    int n_k = hp->ssm_n_group, d_k = hp->ssm_d_state, W = ssm_conv_dim(hp);
    float q_scale = 1.0f / sqrtf((float)d_k);
    long r0, r1;
    ember_split_range(t->n_rows, 1, ith, nth, &r0, &r1);
    for (long r = r0; r < r1; r++) {
        for (int hh = 0; hh < 2 * n_k; hh++) {
            float *v = c->r_conv + (size_t)r * W + (size_t)hh * d_k;
            double sum = 0.0;
            for (int i = 0; i < d_k; i++) sum += (double)v[i] * v[i];
            float scale = 1.0f / fmaxf(sqrtf((float)sum), hp->rms_eps);
            for (int i = 0; i < d_k; i++) v[i] *= scale;
            if (hh < n_k)
                for (int i = 0; i < d_k; i++) v[i] *= q_scale;
        }
    }
}

/* Units are (sequence, value head); each walks its sequence's rows in order. */
static void task_delta(void *arg, int ith, int nth) {
    gdn_task *t = arg;
    model_ctx *c = t->c;
    const model_hparams *hp = &c->m->hp;
    int n_v = hp->ssm_dt_rank, n_k = hp->ssm_n_group, d_k = hp->ssm_d_state, DI = hp->ssm_d_inner, d_v = DI / n_v;
    int W = ssm_conv_dim(hp);
    bool next = hp->arch == ARCH_QWEN3NEXT;
    long u0, u1;
    ember_split_range((long)c->n_groups * n_v, 1, ith, nth, &u0, &u1);
    for (long u = u0; u < u1; u++) {
        int g = (int)(u / n_v), h = (int)(u % n_v);
        int kh = next ? h / (n_v / n_k) : h % n_k;
        float *S = c->grp_state[g]->data + t->L->ssm_off + (size_t)h * d_v * d_k;
        for (int k = c->grp_start[g]; k < c->grp_start[g + 1]; k++) {
            int r = c->grp_rows[k];
            const float *cv = c->r_conv + (size_t)r * W;
            const float *q = cv + (size_t)kh * d_k, *kk = cv + (size_t)n_k * d_k + (size_t)kh * d_k;
            const float *v = cv + 2 * (size_t)n_k * d_k + (size_t)h * d_v;
            float beta = c->r_ba[(size_t)r * 2 * n_v + h], decay = expf(c->r_ba[(size_t)r * 2 * n_v + n_v + h]);
            scan_delta_step(S, d_v, d_k, q, kk, v, beta, decay, c->r_y + (size_t)r * DI + (size_t)h * d_v);
        }
    }
}

/* y_h = rmsnorm(y_h) * ssm_norm * silu(z_h) per value head. */
static void task_out_gate(void *arg, int ith, int nth) {
    gdn_task *t = arg;
    model_ctx *c = t->c;
    const model_hparams *hp = &c->m->hp;
    int n_v = hp->ssm_dt_rank, DI = hp->ssm_d_inner, d_v = DI / n_v;
    long r0, r1;
    ember_split_range(t->n_rows, 1, ith, nth, &r0, &r1);
    for (long r = r0; r < r1; r++)
        for (int h = 0; h < n_v; h++) {
            float *y = c->r_y + (size_t)r * DI + (size_t)h * d_v;
            const float *z = c->r_z + (size_t)r * DI + (size_t)h * d_v;
            op_rmsnorm(y, y, t->L->ssm_norm, d_v, hp->rms_eps);
            for (int j = 0; j < d_v; j++) y[j] *= silu(z[j]);
        }
}

int gdn_mixer(model_ctx *c, const model_batch *b, int il, float *out, ember_error *err) {
    const model_hparams *hp = &c->m->hp;
    const layer_weights *L = &c->m->layers[il];
    int n = b->n_tokens, W = ssm_conv_dim(hp), n_v = hp->ssm_dt_rank;
    if (fwd_matmul(c, &L->ssm_in, c->xn, n, c->r_in, err) < 0) return -1;
    if (fwd_matmul(c, &L->ssm_z, c->xn, n, c->r_z, err) < 0) return -1;
    /* Raw beta/alpha projections go to r_conv, free until the conv. */
    if (fwd_matmul(c, &L->ssm_beta, c->xn, n, c->r_conv, err) < 0) return -1;
    if (L->ssm_alpha.data && fwd_matmul(c, &L->ssm_alpha, c->xn, n, c->r_conv + (size_t)n * n_v, err) < 0) return -1;
    gdn_task t = {c, L, n};
    ember_pool_run(c->threads, task_beta_g, &t);
    ssm_conv_rows(c, L, c->r_in, (size_t)W, 0, c->r_conv, W);
    ember_pool_run(c->threads, task_qk_norm, &t);
    ember_pool_run(c->threads, task_delta, &t);
    ember_pool_run(c->threads, task_out_gate, &t);
    return fwd_matmul(c, &L->ssm_out, c->r_y, n, out, err);
}
