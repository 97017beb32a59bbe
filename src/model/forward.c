/* forward.c - the transformer forward pass for llama, qwen2, qwen3, qwen3moe.
 *
 * Read it top to bottom as one layer of a pre-norm transformer:
 *
 *   xn = rmsnorm(x) * attn_norm
 *   q, k, v = xn Wq, xn Wk, xn Wv   (+ biases; per-head rmsnorm for qwen3)
 *   rope(q, k); store k, v in the sequence's KV blocks at the token's position
 *   x += attention(q, all keys of that sequence up to the position) Wo
 *   xn = rmsnorm(x) * ffn_norm
 *   x += down(silu(xn Wgate) * xn Wup)          (dense)
 *   x += sum_k w_k down_k(silu(xn G_k) * xn U_k) (MoE: top-k of softmax(xn R))
 *
 * A batch is any set of (sequence, position, token) rows. Every step works
 * row by row with kernels that are batch-invariant (matmul.h, ops.h), so a
 * row's result does not depend on the rest of the batch; that is what lets
 * the prompt cache hand out K/V computed in another request and still be
 * bit-identical to a cold prefill. The KV for all rows of a layer is written
 * before any row's attention reads it, so rows of the same sequence in one
 * batch see each other causally. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h"
#include "model/model_internal.h"
#include "tensor/quant.h"

struct model_ctx {
    const model *m;
    kv_pool *pool;
    ember_pool *threads;
    matmul_scratch *mm;
    int max_batch;
    float *x;            /* (max_batch, n_embd) residual stream */
    float *xn;           /* (max_batch, n_embd) normalized input of a sublayer */
    float *q;            /* (max_batch, n_head * d_k) */
    float *k;            /* (max_batch, n_head_kv * d_k) */
    float *v;            /* (max_batch, n_head_kv * d_v) */
    float *attn;         /* (max_batch, n_head * d_v) */
    float *proj;         /* (max_batch, n_embd) sublayer output */
    float *gate;         /* (max_batch, max(n_ff, n_ff_exp)) */
    float *up;           /* (max_batch, max(n_ff, n_ff_exp)) */
    float *router;       /* (max_batch, n_expert) */
    int *sel_expert;     /* (max_batch, n_expert_used) */
    float *sel_weight;   /* (max_batch, n_expert_used) */
    int *exp_rows;       /* (max_batch) rows routed to the current expert */
    int *exp_slot;       /* (max_batch) which of the row's k choices it is */
    float *exp_in;       /* (max_batch, n_embd) gathered rows */
    float *exp_out;      /* (max_batch * n_expert_used, n_embd) */
    /* attention scratch, one slice per thread */
    int n_threads;
    int64_t att_cap;     /* keys per thread slice */
    float *att_scores;   /* (n_threads, att_cap) */
    int32_t ptr_cap;     /* blocks per thread slice */
    float **k_ptrs;      /* (n_threads, ptr_cap) */
    float **v_ptrs;      /* (n_threads, ptr_cap) */
};

static void *xcalloc(size_t n, size_t size, bool *ok) {
    void *p = calloc(n ? n : 1, size);
    if (p == NULL) *ok = false;
    return p;
}

model_ctx *model_ctx_create(const model *m, kv_pool *pool, int n_threads, int max_batch, ember_error *err) {
    const model_hparams *hp = &m->hp;
    if (max_batch < 1) max_batch = 1;
    model_ctx *c = calloc(1, sizeof *c);
    if (c == NULL) goto oom;
    c->m = m;
    c->pool = pool;
    c->max_batch = max_batch;
    c->threads = ember_pool_create(n_threads);
    c->mm = matmul_scratch_create();
    if (c->threads == NULL || c->mm == NULL) goto oom;
    c->n_threads = ember_pool_size(c->threads);
    size_t B = (size_t)max_batch;
    int ff = hp->n_ff > hp->n_ff_exp ? hp->n_ff : hp->n_ff_exp;
    int k_used = hp->n_expert_used > 0 ? hp->n_expert_used : 1;
    bool ok = true;
    c->x = xcalloc(B * hp->n_embd, sizeof(float), &ok);
    c->xn = xcalloc(B * hp->n_embd, sizeof(float), &ok);
    c->q = xcalloc(B * hp->n_head * hp->d_k, sizeof(float), &ok);
    c->k = xcalloc(B * hp->n_head_kv * hp->d_k, sizeof(float), &ok);
    c->v = xcalloc(B * hp->n_head_kv * hp->d_v, sizeof(float), &ok);
    c->attn = xcalloc(B * hp->n_head * hp->d_v, sizeof(float), &ok);
    c->proj = xcalloc(B * hp->n_embd, sizeof(float), &ok);
    c->gate = xcalloc(B * ff, sizeof(float), &ok);
    c->up = xcalloc(B * ff, sizeof(float), &ok);
    if (hp->n_expert > 0) {
        c->router = xcalloc(B * hp->n_expert, sizeof(float), &ok);
        c->sel_expert = xcalloc(B * k_used, sizeof(int), &ok);
        c->sel_weight = xcalloc(B * k_used, sizeof(float), &ok);
        c->exp_rows = xcalloc(B, sizeof(int), &ok);
        c->exp_slot = xcalloc(B, sizeof(int), &ok);
        c->exp_in = xcalloc(B * hp->n_embd, sizeof(float), &ok);
        c->exp_out = xcalloc(B * k_used * hp->n_embd, sizeof(float), &ok);
    }
    if (!ok) goto oom;
    return c;
oom:
    model_ctx_free(c);
    ember_fail(err, "out of memory creating a context for batches of %d tokens", max_batch);
    return NULL;
}

void model_ctx_free(model_ctx *c) {
    if (c == NULL) return;
    ember_pool_free(c->threads);
    matmul_scratch_free(c->mm);
    free(c->x); free(c->xn); free(c->q); free(c->k); free(c->v); free(c->attn); free(c->proj);
    free(c->gate); free(c->up); free(c->router); free(c->sel_expert); free(c->sel_weight);
    free(c->exp_rows); free(c->exp_slot); free(c->exp_in); free(c->exp_out);
    free(c->att_scores); free(c->k_ptrs); free(c->v_ptrs);
    free(c);
}

int model_ctx_max_batch(const model_ctx *c) { return c->max_batch; }

/* Rows per attention unit (task_attention). */
enum { ATT_ROWS = 4 };

/* Grows the per-thread attention scratch to hold n_keys keys. */
static int reserve_attention(model_ctx *c, int64_t n_keys, ember_error *err) {
    int32_t n_blocks = (int32_t)((n_keys + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS);
    if (n_keys > c->att_cap) {
        int64_t cap = n_keys + 1024;
        size_t slots = (size_t)ATT_ROWS * (size_t)(c->m->hp.n_head / c->m->hp.n_head_kv);
        float *s = realloc(c->att_scores, (size_t)c->n_threads * slots * (size_t)cap * sizeof(float));
        if (s == NULL) return ember_fail(err, "out of memory for attention over %lld keys", (long long)n_keys);
        c->att_scores = s;
        c->att_cap = cap;
    }
    if (n_blocks > c->ptr_cap) {
        int32_t cap = n_blocks + 64;
        float **kp = realloc(c->k_ptrs, (size_t)c->n_threads * (size_t)cap * sizeof(float *));
        if (kp) c->k_ptrs = kp;
        float **vp = realloc(c->v_ptrs, (size_t)c->n_threads * (size_t)cap * sizeof(float *));
        if (vp) c->v_ptrs = vp;
        if (kp == NULL || vp == NULL) return ember_fail(err, "out of memory for block pointers");
        c->ptr_cap = cap;
    }
    return 0;
}

/* ---- parallel steps; each task splits rows (or rows x heads) over threads ---- */

typedef struct layer_task {
    model_ctx *c;
    const model_batch *b;
    const layer_weights *L;
    int layer;
} layer_task;

/* Biases, per-head q/k norm, rope, and the store of k/v into the KV blocks. */
static void task_qk_prepare(void *arg, int ith, int nth) {
    layer_task *t = arg;
    model_ctx *c = t->c;
    const model_hparams *hp = &c->m->hp;
    const layer_weights *L = t->L;
    int q_dim = hp->n_head * hp->d_k, k_dim = hp->n_head_kv * hp->d_k, v_dim = hp->n_head_kv * hp->d_v;
    long r0, r1;
    ember_split_range(t->b->n_tokens, 1, ith, nth, &r0, &r1);
    for (long r = r0; r < r1; r++) {
        float *q = c->q + r * q_dim, *k = c->k + r * k_dim, *v = c->v + r * v_dim;
        if (L->bq) op_add(q, L->bq, q_dim);
        if (L->bk) op_add(k, L->bk, k_dim);
        if (L->bv) op_add(v, L->bv, v_dim);
        if (L->q_norm)
            for (int h = 0; h < hp->n_head; h++) op_rmsnorm(q + h * hp->d_k, q + h * hp->d_k, L->q_norm, hp->d_k, hp->rms_eps);
        if (L->k_norm)
            for (int h = 0; h < hp->n_head_kv; h++) op_rmsnorm(k + h * hp->d_k, k + h * hp->d_k, L->k_norm, hp->d_k, hp->rms_eps);
        int64_t pos = t->b->pos[r];
        op_rope(q, hp->n_head, hp->d_k, pos, &hp->rope);
        op_rope(k, hp->n_head_kv, hp->d_k, pos, &hp->rope);
        const kv_seq *seq = t->b->seqs[r];
        int32_t block = seq->blocks[pos / KV_BLOCK_TOKENS];
        int row = (int)(pos % KV_BLOCK_TOKENS);
        memcpy(kv_block_k(c->pool, block, t->layer) + (size_t)row * k_dim, k, (size_t)k_dim * sizeof(float));
        memcpy(kv_block_v(c->pool, block, t->layer) + (size_t)row * v_dim, v, (size_t)v_dim * sizeof(float));
    }
}

/* Units are (kv head, block of ATT_ROWS rows) in kv-head-major order: every
 * thread gets the same share of kv heads over all rows (balanced under the
 * causal mask), and one unit's 2 * ATT_ROWS queries (for GQA pairs) read
 * each key and value row once. Each query's arithmetic is independent of
 * the split (op_attention_paged_rows). */
static void task_attention(void *arg, int ith, int nth) {
    layer_task *t = arg;
    model_ctx *c = t->c;
    const model_hparams *hp = &c->m->hp;
    long n_rows = t->b->n_tokens;
    long row_blocks = (n_rows + ATT_ROWS - 1) / ATT_ROWS;
    int group = hp->n_head / hp->n_head_kv;
    long units = row_blocks * hp->n_head_kv, u0, u1;
    ember_split_range(units, 1, ith, nth, &u0, &u1);
    float **k_ptrs = c->k_ptrs + (size_t)ith * c->ptr_cap;
    float **v_ptrs = c->v_ptrs + (size_t)ith * c->ptr_cap;
    float *scores = c->att_scores + (size_t)ith * c->att_cap * ATT_ROWS * (size_t)group;
    const kv_seq *built = NULL;
    int32_t n_built = 0;
    float scale = 1.0f / sqrtf((float)hp->d_k);
    size_t q_stride = (size_t)hp->n_head * hp->d_k, out_stride = (size_t)hp->n_head * hp->d_v;
    for (long u = u0; u < u1; u++) {
        int g = (int)(u / row_blocks);
        long r0 = (u % row_blocks) * ATT_ROWS, r1 = r0 + ATT_ROWS < n_rows ? r0 + ATT_ROWS : n_rows;
        for (long r = r0; r < r1;) {
            const kv_seq *seq = t->b->seqs[r];
            long re = r + 1;
            int64_t n_keys = t->b->pos[r] + 1;
            while (re < r1 && t->b->seqs[re] == seq) {
                if (t->b->pos[re] + 1 > n_keys) n_keys = t->b->pos[re] + 1;
                re++;
            }
            int32_t need = (int32_t)((n_keys + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS);
            if (seq != built || need > n_built) {
                for (int32_t i = 0; i < need; i++) {
                    k_ptrs[i] = kv_block_k(c->pool, seq->blocks[i], t->layer);
                    v_ptrs[i] = kv_block_v(c->pool, seq->blocks[i], t->layer);
                }
                built = seq;
                n_built = need;
            }
            op_attention_paged_rows(c->attn + r * out_stride, out_stride, c->q + r * q_stride, q_stride, k_ptrs,
                                    v_ptrs, t->b->pos + r, (int)(re - r), hp->n_head, hp->n_head_kv, hp->d_k,
                                    hp->d_v, scale, 0, g * group, (g + 1) * group, scores);
            r = re;
        }
    }
}

typedef struct rows_task {
    model_ctx *c;
    int n_rows;
    const float *w;      /* norm weight */
    float *dst, *src;
    int width;
} rows_task;

static void task_rmsnorm(void *arg, int ith, int nth) {
    rows_task *t = arg;
    long r0, r1;
    ember_split_range(t->n_rows, 1, ith, nth, &r0, &r1);
    for (long r = r0; r < r1; r++)
        op_rmsnorm(t->dst + r * t->width, t->src + r * t->width, t->w, t->width, t->c->m->hp.rms_eps);
}

static void task_swiglu(void *arg, int ith, int nth) {
    rows_task *t = arg;
    long r0, r1;
    ember_split_range(t->n_rows, 1, ith, nth, &r0, &r1);
    for (long r = r0; r < r1; r++)
        op_swiglu(t->dst + r * t->width, t->dst + r * t->width, t->src + r * t->width, t->width);
}

static void rmsnorm_rows(model_ctx *c, float *dst, float *src, const float *w, int n_rows, int width) {
    rows_task t = {c, n_rows, w, dst, src, width};
    ember_pool_run(c->threads, task_rmsnorm, &t);
}

static void swiglu_rows(model_ctx *c, float *gate_inout, float *up, int n_rows, int width) {
    rows_task t = {c, n_rows, NULL, gate_inout, up, width};
    ember_pool_run(c->threads, task_swiglu, &t);
}

static int matmul(model_ctx *c, const tensor_weight *w, const float *x, int n, float *y, ember_error *err) {
    if (tensor_matmul(c->threads, c->mm, w, x, n, y) < 0) return ember_fail(err, "out of memory in matmul");
    return 0;
}

/* Top-k experts of one row: softmax over all experts, the k largest
 * probabilities (lower expert id first on ties), renormalized to sum 1. */
static void route_row(const float *logits, int n_expert, int k, int *sel, float *weight) {
    float probs[256];
    float maxv = -INFINITY;
    for (int e = 0; e < n_expert; e++) maxv = fmaxf(maxv, logits[e]);
    double sum = 0;
    for (int e = 0; e < n_expert; e++) {
        probs[e] = expf(logits[e] - maxv);
        sum += probs[e];
    }
    for (int e = 0; e < n_expert; e++) probs[e] = (float)(probs[e] / sum);
    bool taken[256] = {false};
    float wsum = 0;
    for (int i = 0; i < k; i++) {
        int best = -1;
        for (int e = 0; e < n_expert; e++)
            if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
        taken[best] = true;
        sel[i] = best;
        weight[i] = probs[best];
        wsum += probs[best];
    }
    for (int i = 0; i < k; i++) weight[i] /= wsum;
}

static int ffn_moe(model_ctx *c, const layer_weights *L, int n, ember_error *err) {
    const model_hparams *hp = &c->m->hp;
    int K = hp->n_expert_used, E = hp->n_expert, D = hp->n_embd, F = hp->n_ff_exp;
    if (matmul(c, &L->router, c->xn, n, c->router, err) < 0) return -1;
    for (int r = 0; r < n; r++)
        route_row(c->router + (size_t)r * E, E, K, c->sel_expert + (size_t)r * K, c->sel_weight + (size_t)r * K);
    for (int e = 0; e < E; e++) {
        int m = 0;
        for (int r = 0; r < n; r++)
            for (int s = 0; s < K; s++)
                if (c->sel_expert[r * K + s] == e) {
                    c->exp_rows[m] = r;
                    c->exp_slot[m] = s;
                    memcpy(c->exp_in + (size_t)m * D, c->xn + (size_t)r * D, (size_t)D * sizeof(float));
                    m++;
                }
        if (m == 0) continue;
        if (matmul(c, &L->exp_gate[e], c->exp_in, m, c->gate, err) < 0) return -1;
        if (matmul(c, &L->exp_up[e], c->exp_in, m, c->up, err) < 0) return -1;
        swiglu_rows(c, c->gate, c->up, m, F);
        if (matmul(c, &L->exp_down[e], c->gate, m, c->proj, err) < 0) return -1;
        for (int i = 0; i < m; i++)
            memcpy(c->exp_out + ((size_t)c->exp_rows[i] * K + c->exp_slot[i]) * D, c->proj + (size_t)i * D,
                   (size_t)D * sizeof(float));
    }
    /* Weighted sum in selection order, the same for every batch. */
    for (int r = 0; r < n; r++) {
        float *out = c->proj + (size_t)r * D;
        for (int s = 0; s < K; s++) {
            const float *eo = c->exp_out + ((size_t)r * K + s) * D;
            float w = c->sel_weight[r * K + s];
            if (s == 0)
                for (int d = 0; d < D; d++) out[d] = w * eo[d];
            else
                for (int d = 0; d < D; d++) out[d] += w * eo[d];
        }
    }
    return 0;
}

static int forward_chunk(model_ctx *c, const model_batch *b, float *logits, ember_error *err) {
    const model *m = c->m;
    const model_hparams *hp = &m->hp;
    int n = b->n_tokens, D = hp->n_embd;
    int64_t max_keys = 0;
    for (int r = 0; r < n; r++) {
        if (b->tokens[r] < 0 || b->tokens[r] >= hp->n_vocab)
            return ember_fail(err, "token id %d at batch row %d is outside the vocabulary (%d)", b->tokens[r], r, hp->n_vocab);
        const kv_seq *seq = b->seqs[r];
        if (b->pos[r] < 0 || b->pos[r] >= (int64_t)seq->n_blocks * KV_BLOCK_TOKENS)
            return ember_fail(err, "position %lld at batch row %d has no KV block (sequence has %d blocks)",
                              (long long)b->pos[r], r, seq->n_blocks);
        if (b->pos[r] + 1 > max_keys) max_keys = b->pos[r] + 1;
    }
    if (reserve_attention(c, max_keys, err) < 0) return -1;

    for (int r = 0; r < n; r++)
        quant_dequantize_row(m->tok_embd.type, (const uint8_t *)m->tok_embd.data + (size_t)b->tokens[r] * m->tok_embd.row_bytes,
                             c->x + (size_t)r * D, D);

    for (int il = 0; il < hp->n_layer; il++) {
        const layer_weights *L = &m->layers[il];
        layer_task lt = {c, b, L, il};
        rmsnorm_rows(c, c->xn, c->x, L->attn_norm, n, D);
        if (matmul(c, &L->wq, c->xn, n, c->q, err) < 0) return -1;
        if (matmul(c, &L->wk, c->xn, n, c->k, err) < 0) return -1;
        if (matmul(c, &L->wv, c->xn, n, c->v, err) < 0) return -1;
        ember_pool_run(c->threads, task_qk_prepare, &lt);
        ember_pool_run(c->threads, task_attention, &lt);
        if (matmul(c, &L->wo, c->attn, n, c->proj, err) < 0) return -1;
        for (int r = 0; r < n; r++) op_add(c->x + (size_t)r * D, c->proj + (size_t)r * D, D);

        rmsnorm_rows(c, c->xn, c->x, L->ffn_norm, n, D);
        if (hp->n_expert > 0) {
            if (ffn_moe(c, L, n, err) < 0) return -1;
        } else {
            if (matmul(c, &L->ffn_gate, c->xn, n, c->gate, err) < 0) return -1;
            if (matmul(c, &L->ffn_up, c->xn, n, c->up, err) < 0) return -1;
            swiglu_rows(c, c->gate, c->up, n, hp->n_ff);
            if (matmul(c, &L->ffn_down, c->gate, n, c->proj, err) < 0) return -1;
        }
        for (int r = 0; r < n; r++) op_add(c->x + (size_t)r * D, c->proj + (size_t)r * D, D);
    }

    /* Head: only the rows that asked for logits. */
    int n_out = 0;
    for (int r = 0; r < n; r++) {
        bool want = b->want_logits ? b->want_logits[r] : r == n - 1;
        if (!want) continue;
        memcpy(c->proj + (size_t)n_out * D, c->x + (size_t)r * D, (size_t)D * sizeof(float));
        n_out++;
    }
    if (n_out == 0) return 0;
    rmsnorm_rows(c, c->xn, c->proj, m->output_norm, n_out, D);
    return matmul(c, &m->output, c->xn, n_out, logits, err);
}

int model_forward(model_ctx *c, const model_batch *b, float *logits, ember_error *err) {
    int n_vocab = c->m->hp.n_vocab;
    for (int start = 0; start < b->n_tokens; start += c->max_batch) {
        int n = b->n_tokens - start < c->max_batch ? b->n_tokens - start : c->max_batch;
        bool *want = NULL;
        if (b->want_logits == NULL) {
            /* "last token only" refers to the whole batch, not each piece. */
            want = calloc((size_t)n, sizeof(bool));
            if (want == NULL) return ember_fail(err, "out of memory");
            if (start + n == b->n_tokens) want[n - 1] = true;
        }
        model_batch piece = {n, b->tokens + start, b->pos + start, b->seqs + start,
                             b->want_logits ? b->want_logits + start : want};
        int rc = forward_chunk(c, &piece, logits, err);
        int wanted = 0;
        for (int r = 0; r < n; r++) wanted += piece.want_logits[r];
        free(want);
        if (rc < 0) return -1;
        logits += (size_t)wanted * n_vocab;
    }
    return 0;
}

int model_eval(model_ctx *c, kv_seq *seq, const int32_t *tokens, int n, bool all_logits, float *logits,
               ember_error *err) {
    if (n <= 0) return 0;
    if (kv_seq_prepare_append(c->pool, seq, n, err) < 0) return -1;
    int64_t *pos = malloc((size_t)n * sizeof *pos);
    kv_seq **seqs = malloc((size_t)n * sizeof *seqs);
    bool *want = malloc((size_t)n * sizeof *want);
    int rc = -1;
    if (pos == NULL || seqs == NULL || want == NULL) {
        ember_fail(err, "out of memory");
        goto done;
    }
    for (int i = 0; i < n; i++) {
        pos[i] = seq->n_tokens + i;
        seqs[i] = seq;
        want[i] = all_logits || i == n - 1;
    }
    model_batch b = {n, tokens, pos, seqs, want};
    rc = model_forward(c, &b, logits, err);
    if (rc == 0) seq->n_tokens += n;
done:
    free(pos);
    free(seqs);
    free(want);
    return rc;
}
