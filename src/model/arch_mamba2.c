/* arch_mamba2.c - the mamba2 mixer (mamba2 layers, falcon-h1's SSM half) and
 * the causal conv shared with the gated delta net.
 *
 * For one token of one sequence (H heads of P channels, G groups of N):
 *   [z | xBC | dt] = ssm_in . xn
 *   xBC = silu(conv(xBC) + conv_bias)            conv over this and the
 *                                                last d_conv-1 tokens
 *   x (H x P), B (G x N), C (G x N) = split(xBC);  head h uses group h/(H/G)
 *   dt_h = softplus(dt_h + dt_bias_h),  dA = exp(dt_h * A_h)
 *   s_h[p][n] = s_h[p][n] * dA + B[n] * (x[p] * dt_h)
 *   y[p] = sum_n s_h[p][n] C[n] + D_h x[p]
 *   y = grouped_rmsnorm(y * silu(z)) * ssm_norm;  out = ssm_out . y
 *
 * Batch invariance: the input and output projections are row-wise matmuls;
 * the conv and the scan run token by token in position order for each
 * sequence (model_state), so every value depends on the token's prefix only,
 * never on how the prefix was split into chunks or threads. Threads split
 * conv channels or (sequence, head) pairs, never a sum. The scan step of one
 * head is tensor/scan.h's (vectorized over the state, the same bits on
 * every ISA). */
#include <math.h>
#include <string.h>

#include "model/model_internal.h"
#include "tensor/scan.h"

static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

typedef struct conv_task {
    model_ctx *c;
    const layer_weights *L;
    const float *in;
    size_t in_stride, in_off;
    float *out;
    int conv_dim;
} conv_task;

enum { MAX_CONV = 16 };

static void task_conv(void *arg, int ith, int nth) {
    conv_task *t = arg;
    model_ctx *c = t->c;
    int K = c->m->hp.ssm_d_conv, W = t->conv_dim;
    long c0, c1;
    ember_split_range(W, 16, ith, nth, &c0, &c1);
    for (int g = 0; g < c->n_groups; g++) {
        float *cs = c->grp_state[g]->data + t->L->conv_off; /* (K-1, W), oldest first */
        for (long ch = c0; ch < c1; ch++) {
            float win[MAX_CONV];
            for (int i = 0; i < K - 1; i++) win[i] = cs[(size_t)i * W + ch];
            const float *w = t->L->conv_w + (size_t)ch * K;
            for (int k = c->grp_start[g]; k < c->grp_start[g + 1]; k++) {
                int r = c->grp_rows[k];
                float x = t->in[(size_t)r * t->in_stride + t->in_off + ch];
                float sum = 0.0f;
                for (int i = 0; i < K - 1; i++) sum += win[i] * w[i];
                sum += x * w[K - 1];
                if (t->L->conv_b) sum += t->L->conv_b[ch];
                t->out[(size_t)r * W + ch] = silu(sum);
                for (int i = 0; i + 1 < K - 1; i++) win[i] = win[i + 1];
                win[K - 2] = x;
            }
            for (int i = 0; i < K - 1; i++) cs[(size_t)i * W + ch] = win[i];
        }
    }
}

void ssm_conv_rows(model_ctx *c, const layer_weights *L, const float *in, size_t in_stride, size_t in_off,
                   float *out, int conv_dim) {
    conv_task t = {c, L, in, in_stride, in_off, out, conv_dim};
    ember_pool_run(c->threads, task_conv, &t);
}

typedef struct m2_task {
    model_ctx *c;
    const layer_weights *L;
    int n_rows;
} m2_task;

/* Units are (sequence, head); each walks its sequence's rows in order. */
static void task_scan(void *arg, int ith, int nth) {
    m2_task *t = arg;
    model_ctx *c = t->c;
    const model_hparams *hp = &c->m->hp;
    const layer_weights *L = t->L;
    int H = hp->ssm_dt_rank, G = hp->ssm_n_group, N = hp->ssm_d_state, DI = hp->ssm_d_inner, P = DI / H;
    int W = ssm_conv_dim(hp);
    size_t in_w = (size_t)DI + (size_t)W + (size_t)H;
    long u0, u1;
    ember_split_range((long)c->n_groups * H, 1, ith, nth, &u0, &u1);
    for (long u = u0; u < u1; u++) {
        int g = (int)(u / H), h = (int)(u % H), gh = h / (H / G);
        float *s = c->grp_state[g]->data + L->ssm_off + (size_t)h * P * N;
        for (int k = c->grp_start[g]; k < c->grp_start[g + 1]; k++) {
            int r = c->grp_rows[k];
            const float *xbc = c->r_conv + (size_t)r * W;
            const float *x = xbc + (size_t)h * P, *B = xbc + DI + (size_t)gh * N, *C = xbc + DI + (size_t)G * N + (size_t)gh * N;
            float dt = softplus(c->r_in[(size_t)r * in_w + DI + W + h] + L->dt_bias[h]);
            float dA = expf(dt * L->ssm_a[h]);
            scan_ssd_step(s, P, N, x, B, C, dt, dA, L->ssm_d[h], c->r_y + (size_t)r * DI + (size_t)h * P);
        }
    }
}

/* y = grouped_rmsnorm(y * silu(z)) * ssm_norm, per row. */
static void task_gate_norm(void *arg, int ith, int nth) {
    m2_task *t = arg;
    model_ctx *c = t->c;
    const model_hparams *hp = &c->m->hp;
    int DI = hp->ssm_d_inner, G = hp->ssm_n_group, W = ssm_conv_dim(hp);
    size_t in_w = (size_t)DI + (size_t)W + (size_t)hp->ssm_dt_rank;
    long r0, r1;
    ember_split_range(t->n_rows, 1, ith, nth, &r0, &r1);
    for (long r = r0; r < r1; r++) {
        float *y = c->r_y + (size_t)r * DI;
        const float *z = c->r_in + (size_t)r * in_w;
        for (int i = 0; i < DI; i++) y[i] = silu(z[i]) * y[i];
        if (t->L->ssm_norm)
            for (int g = 0; g < G; g++)
                op_rmsnorm(y + (size_t)g * (DI / G), y + (size_t)g * (DI / G), t->L->ssm_norm + (size_t)g * (DI / G), DI / G,
                           hp->rms_eps);
    }
}

int mamba2_mixer(model_ctx *c, const model_batch *b, int il, float *out, ember_error *err) {
    const model_hparams *hp = &c->m->hp;
    const layer_weights *L = &c->m->layers[il];
    int n = b->n_tokens, DI = hp->ssm_d_inner, W = ssm_conv_dim(hp);
    size_t in_w = (size_t)DI + (size_t)W + (size_t)hp->ssm_dt_rank;
    if (fwd_matmul(c, &L->ssm_in, c->xn, n, c->r_in, err) < 0) return -1;
    ssm_conv_rows(c, L, c->r_in, in_w, (size_t)DI, c->r_conv, W);
    m2_task t = {c, L, n};
    ember_pool_run(c->threads, task_scan, &t);
    ember_pool_run(c->threads, task_gate_norm, &t);
    return fwd_matmul(c, &L->ssm_out, c->r_y, n, out, err);
}
