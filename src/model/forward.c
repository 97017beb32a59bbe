/* forward.c - the forward pass: llama, qwen2, qwen3, qwen3moe, and the layer
 * skeleton of gemma3, qwen35, qwen3next, mamba2 and falcon-h1, whose
 * non-attention mixers live in arch_gdn.c and arch_mamba2.c.
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
 * bit-identical to a cold prefill. K/V rows are encoded in the pool's format
 * (f32, f16, q8_0) as they are stored, from that row's values alone, and
 * attention reads them encoded, so the invariant holds in every format. The KV for all rows of a layer is written
 * before any row's attention reads it, so rows of the same sequence in one
 * batch see each other causally. A kvarn pool also seals 128-token groups
 * into records at positions fixed by the format (kvarn_attention): rows
 * attend in passes so that each sees the groups its position seals.
 *
 * Per layer (forward_chunk): x += [post_attn_norm] mixer(rmsnorm(x)), where
 * the mixer is attention (optionally sliding-window, or with a sigmoid output
 * gate), a gated delta net, mamba2, or attention + mamba2 summed (falcon-h1);
 * then, unless the model has no FFN, x += [post_ffn_norm] ffn(rmsnorm(x)).
 * Recurrent mixers consume each sequence's rows token by token in position
 * order from that sequence's model_state.
 *
 * Threads meet at a barrier after every pool task, and a decode step is
 * little else: projections that read the same input go out as one task
 * (q/k/v, gate/up), attention is cut into more parts than threads, and the
 * row-wise steps of a lone row run on the caller. With a profile set
 * (model_ctx_set_profile) each step's wall time is added to its class. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/threadpool.h"
#include "model/model_internal.h"
#include "tensor/attention_kvarn.h"
#include "tensor/quant.h"

/* struct model_ctx lives in model_internal.h (the arch_*.c mixers use it). */

/* Zeroed and 64-byte aligned: the batch GEMMs read float activations
 * (x, xn, attn...) a whole 64-byte vector at a time, and from calloc's
 * 16-byte alignment every such load spans two cache lines (the F16 panels
 * lost up to a fifth of their speed to it: docs/engine-bench.md). */
static void *xcalloc(size_t n, size_t size, bool *ok) {
    size_t bytes = (n ? n : 1) * size;
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes) != 0) p = NULL;
    if (p == NULL) *ok = false;
    else memset(p, 0, bytes);
    return p;
}

model_ctx *model_ctx_create(const model *m, kv_pool *pool, int n_threads, int max_batch, ember_error *err) {
    const model_hparams *hp = &m->hp;
    if (max_batch < 1) max_batch = 1;
    if (kv_format_row_type(kv_pool_format(pool)) != KV_ROW_F32 &&
        (hp->d_k > ATTENTION_MAX_HEAD || hp->d_v > ATTENTION_MAX_HEAD)) {
        ember_fail(err, "KV format %s: heads of %d/%d values are wider than the %d the attention kernels decode",
                   kv_format_name(kv_pool_format(pool)), hp->d_k, hp->d_v, ATTENTION_MAX_HEAD);
        return NULL;
    }
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
    if (hp->n_ff_shexp > ff) ff = hp->n_ff_shexp;
    int k_used = hp->n_expert_used > 0 ? hp->n_expert_used : 1;
    bool ok = true, gated = false, recurrent = m->state_floats > 0;
    for (int il = 0; il < hp->n_layer; il++) gated |= m->layers[il].q_gated;
    gated |= m->mtp != NULL;
    c->x = xcalloc(B * hp->n_embd, sizeof(float), &ok);
    c->xn = xcalloc(B * hp->n_embd, sizeof(float), &ok);
    c->q = xcalloc(B * hp->n_head * hp->d_k, sizeof(float), &ok);
    if (gated) c->qg = xcalloc(B * 2 * hp->n_head * hp->d_k, sizeof(float), &ok);
    if (hp->arch == ARCH_FALCON_H1) c->proj2 = xcalloc(B * hp->n_embd, sizeof(float), &ok);
    if (m->mtp) c->mtp_cat = xcalloc(B * 2 * hp->n_embd, sizeof(float), &ok);
    if (recurrent) {
        size_t conv_dim = (size_t)ssm_conv_dim(hp), heads = (size_t)hp->ssm_dt_rank;
        size_t in_w = conv_dim + (size_t)hp->ssm_d_inner + heads; /* mamba2 [z|xBC|dt]; GDN needs conv_dim */
        c->r_in = xcalloc(B * in_w, sizeof(float), &ok);
        c->r_conv = xcalloc(B * conv_dim, sizeof(float), &ok);
        c->r_y = xcalloc(B * hp->ssm_d_inner, sizeof(float), &ok);
        c->r_z = xcalloc(B * hp->ssm_d_inner, sizeof(float), &ok);
        c->r_ba = xcalloc(B * 2 * heads, sizeof(float), &ok);
        c->grp_rows = xcalloc(B, sizeof(int), &ok);
        c->grp_start = xcalloc(B + 1, sizeof(int), &ok);
        c->grp_state = xcalloc(B, sizeof(model_state *), &ok);
    }
    c->k = xcalloc(B * hp->n_head_kv * hp->d_k, sizeof(float), &ok);
    c->v = xcalloc(B * hp->n_head_kv * hp->d_v, sizeof(float), &ok);
    c->attn = xcalloc(B * hp->n_head * hp->d_v, sizeof(float), &ok);
    c->proj = xcalloc(B * hp->n_embd, sizeof(float), &ok);
    c->kvarn = kv_format_is_kvarn(kv_pool_format(pool));
    c->att_online = c->kvarn ? ATTENTION_F32 : op_attention_precision(kv_pool_attention(pool), hp->d_k, hp->d_v);
    if (c->kvarn) {
        c->att_skip = xcalloc(B, 1, &ok);
        c->kvarn_phys = xcalloc(B, sizeof(int64_t), &ok);
        c->kvarn_scratch = xcalloc(kv_kvarn_scratch_floats(pool), sizeof(float), &ok);
    }
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
    free(c->att_scores); free(c->k_ptrs); free(c->v_ptrs); free(c->att_tiles);
    free(c->att_skip); free(c->kvarn_phys); free(c->kvarn_scratch);
    free(c->qg); free(c->proj2); free(c->mtp_cat); free(c->r_in); free(c->r_conv); free(c->r_y); free(c->r_z); free(c->r_ba);
    free(c->grp_rows); free(c->grp_start); free(c->grp_state);
    free(c);
}

int model_ctx_max_batch(const model_ctx *c) { return c->max_batch; }

/* ---- profile marks: each adds the time since the previous mark to a class ---- */

static int64_t prof_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void prof_mark(model_ctx *c, model_prof_class cls) {
    if (c->prof == NULL) return;
    int64_t t = prof_now();
    c->prof->ns[cls] += t - c->prof_t;
    c->prof_t = t;
}

void model_ctx_set_profile(model_ctx *c, model_profile *profile) {
    c->prof = profile;
    c->prof_t = prof_now();
}

void model_ctx_pool_stats(const model_ctx *c, ember_pool_stats *st) { ember_pool_get_stats(c->threads, st); }

const char *model_prof_class_name(model_prof_class cls) {
    static const char *const names[MODEL_PROF_N] = {"embed", "rmsnorm",  "q/k/v",    "qk prep+rope", "attention", "wo",
                                                    "residual", "gate/up", "swiglu", "down",         "mixer",     "head"};
    return (unsigned)cls < MODEL_PROF_N ? names[cls] : "?";
}

/* Rows per attention unit (task_attention), and the most parts per thread
 * an attention task is split into (attention_parts). */
enum { ATT_ROWS = 16, ATT_PARTS_PER_THREAD = 16, ATT_MAX_PAIRS = 256 };

/* Rows per unit: ATT_ROWS, or at bf16 precision as many as fill one
 * op_attention_paged_rows call (256 (row, head) pairs): the bf16 kernel
 * builds each K/V tile once per call, and at 16k keys a call of 64 pairs
 * streamed the whole K/V of its kv head from memory for every 64 queries
 * (bench_attention: 201 -> 273 GFLOP/s from 64 to 256 pairs). Bits do not
 * depend on it (batch invariance). */
static long att_rows(const model_ctx *c) {
    if (c->att_online == ATTENTION_F32) return ATT_ROWS;
    long rows = ATT_MAX_PAIRS / (c->m->hp.n_head / c->m->hp.n_head_kv);
    return rows > ATT_ROWS ? rows : ATT_ROWS;
}

/* Grows the attention scratch to hold n_keys keys: per thread (the part
 * running on it takes its slot, ember_pool_thread_slot) a slice of scores
 * for att_rows rows of a GQA group (none at bf16, whose kernel keeps no
 * scores) and a block pointer table. */
static int reserve_attention(model_ctx *c, int64_t n_keys, ember_error *err) {
    int32_t n_blocks = (int32_t)((n_keys + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS);
    if (n_keys > c->att_cap) {
        int64_t cap = n_keys + 1024;
        if (c->att_online == ATTENTION_F32) {
            size_t slots = (size_t)att_rows(c) * (size_t)(c->m->hp.n_head / c->m->hp.n_head_kv);
            float *s = realloc(c->att_scores, (size_t)c->n_threads * slots * (size_t)cap * sizeof(float));
            if (s == NULL) return ember_fail(err, "out of memory for attention over %lld keys", (long long)n_keys);
            c->att_scores = s;
        }
        c->att_cap = cap;
    }
    if (n_blocks > c->ptr_cap) {
        int32_t cap = n_blocks + 64;
        size_t tables = (size_t)c->n_threads;
        const void **kp = realloc(c->k_ptrs, tables * (size_t)cap * sizeof(void *));
        if (kp) c->k_ptrs = kp;
        const void **vp = realloc(c->v_ptrs, tables * (size_t)cap * sizeof(void *));
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
    attention_bf16_tiles tiles; /* task_attention: the layer's prebuilt bf16 tiles (prepare_bf16_tiles); base NULL: none */
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
        if (L->q_gated) /* [q | gate] per head: gather the queries */
            for (int h = 0; h < hp->n_head; h++)
                memcpy(q + h * hp->d_k, c->qg + (size_t)r * 2 * q_dim + (size_t)h * 2 * hp->d_k, (size_t)hp->d_k * sizeof(float));
        if (L->bq) op_add(q, L->bq, q_dim);
        if (L->bk) op_add(k, L->bk, k_dim);
        if (L->bv) op_add(v, L->bv, v_dim);
        if (L->q_norm)
            for (int h = 0; h < hp->n_head; h++) op_rmsnorm(q + h * hp->d_k, q + h * hp->d_k, L->q_norm, hp->d_k, hp->rms_eps);
        if (L->k_norm)
            for (int h = 0; h < hp->n_head_kv; h++) op_rmsnorm(k + h * hp->d_k, k + h * hp->d_k, L->k_norm, hp->d_k, hp->rms_eps);
        int64_t pos = t->b->pos[r];
        op_rope(q, hp->n_head, hp->d_k, pos, L->rope);
        op_rope(k, hp->n_head_kv, hp->d_k, pos, L->rope);
        if (hp->q_prescale)
            for (int i = 0; i < q_dim; i++) q[i] *= hp->attn_scale;
        const kv_seq *seq = t->b->seqs[r];
        int32_t block = seq->blocks[pos / KV_BLOCK_TOKENS];
        int row = (int)(pos % KV_BLOCK_TOKENS);
        kv_row_write(c->pool, block, t->layer, 0, row, k);
        kv_row_write(c->pool, block, t->layer, 1, row, v);
    }
}

/* Units are (kv head, block of att_rows rows) in kv-head-major order: every
 * part gets the same share of kv heads over all rows (balanced under the
 * causal mask), and one unit's 2 * att_rows queries (for GQA pairs) read
 * each key and value row once (streaming K/V was the bottleneck). Each
 * query's arithmetic is independent of the split (op_attention_paged_rows),
 * at the pool's attention precision (kv_pool_attention: decode and prefill
 * alike, so bf16 attention keeps warm == cold).
 * A part uses the score slice and pointer tables of the thread running it
 * (unit_rows * group * att_cap floats: unit_rows <= att_rows). */
static void task_attention(void *arg, int ith, int nth) {
    layer_task *t = arg;
    model_ctx *c = t->c;
    const model_hparams *hp = &c->m->hp;
    long n_rows = t->b->n_tokens;
    const long rows_per_unit = att_rows(c);
    long row_blocks = (n_rows + rows_per_unit - 1) / rows_per_unit;
    long unit_rows = n_rows < rows_per_unit ? n_rows : rows_per_unit;
    int group = hp->n_head / hp->n_head_kv;
    long units = row_blocks * hp->n_head_kv, u0, u1;
    ember_split_range(units, 1, ith, nth, &u0, &u1);
    const size_t slot = (size_t)ember_pool_thread_slot();
    const void **k_ptrs = c->k_ptrs + slot * c->ptr_cap;
    const void **v_ptrs = c->v_ptrs + slot * c->ptr_cap;
    kv_row_type type = kv_format_row_type(kv_pool_format(c->pool));
    float *scores = c->att_online != ATTENTION_F32 ? NULL : c->att_scores + slot * c->att_cap * (size_t)unit_rows * (size_t)group;
    const kv_seq *built = NULL;
    int32_t n_built = 0;
    float scale = hp->q_prescale ? 1.0f : hp->attn_scale;
    size_t q_stride = (size_t)hp->n_head * hp->d_k, out_stride = (size_t)hp->n_head * hp->d_v;
    kv_format fmt = kv_pool_format(c->pool);
    attention_kvarn_format kf = {fmt.k_bits, fmt.v_bits, fmt.tail, kv_pool_width(c->pool, t->layer, 0),
                                 kv_pool_width(c->pool, t->layer, 1), kv_pool_kvarn_layout(c->pool, t->layer)};
    for (long u = u0; u < u1; u++) {
        int g = (int)(u / row_blocks);
        long r0 = (u % row_blocks) * rows_per_unit, r1 = r0 + rows_per_unit < n_rows ? r0 + rows_per_unit : n_rows;
        for (long r = r0; r < r1;) {
            if (c->kvarn && c->att_skip[r]) {
                r++;
                continue;
            }
            const kv_seq *seq = t->b->seqs[r];
            long re = r + 1;
            int64_t n_keys = t->b->pos[r] + 1;
            while (re < r1 && t->b->seqs[re] == seq && !(c->kvarn && c->att_skip[re])) {
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
            if (c->kvarn)
                op_attention_kvarn_rows(c->attn + r * out_stride, out_stride, c->q + r * q_stride, q_stride, k_ptrs,
                                        v_ptrs, &kf, t->b->pos + r, (int)(re - r), hp->n_head, hp->n_head_kv,
                                        hp->d_k, hp->d_v, scale, t->L->window, g * group, (g + 1) * group, scores);
            else
                op_attention_paged_rows_prec(c->attn + r * out_stride, out_stride, c->q + r * q_stride, q_stride,
                                             k_ptrs, v_ptrs, type, t->b->pos + r, (int)(re - r), hp->n_head,
                                             hp->n_head_kv, hp->d_k, hp->d_v, scale, t->L->window, g * group,
                                             (g + 1) * group, scores, kv_pool_attention(c->pool),
                                             t->tiles.base ? &t->tiles : NULL);
            r = re;
        }
    }
}

/* Parts of an attention task. One per thread used to be the rule, but a
 * decode step has only n_head_kv units: with a worker descheduled, the
 * caller finished its half and slept until the worker ran again. Up to
 * ATT_PARTS_PER_THREAD parts per thread let the running thread take the
 * rest. Prefill gets them too (scratch is per thread, not per part): with
 * two parts of a 16k prefill, the faster of this VM's two cores (~300
 * against ~240 GFLOP/s with both busy) idled while the slower finished its
 * half. */
static int attention_parts(const model_ctx *c, int n_rows) {
    if (c->n_threads == 1) return 1;
    const long rows_per_unit = att_rows(c);
    long units = (n_rows + rows_per_unit - 1) / rows_per_unit * c->m->hp.n_head_kv;
    long parts = (long)c->n_threads * ATT_PARTS_PER_THREAD;
    if (parts > units) parts = units;
    return parts > (long)c->n_threads ? (int)parts : c->n_threads;
}

static void run_attention(model_ctx *c, layer_task *lt) {
    ember_pool_run_parts(c->threads, task_attention, lt, attention_parts(c, lt->b->n_tokens));
}

/* The most bytes of prebuilt bf16 tiles (32k keys of 8 kv heads of 128). */
#define ATT_TILES_MAX_BYTES ((size_t)128 << 20)

/* Builds parts of t->tiles: units are (kv head, 64-key block), head-major. */
static void task_bf16_tiles(void *arg, int ith, int nth) {
    layer_task *t = arg;
    model_ctx *c = t->c;
    const model_hparams *hp = &c->m->hp;
    int64_t n_keys = t->tiles.n_keys, blocks = (n_keys + 63) / 64, u0, u1;
    ember_split_range(blocks * hp->n_head_kv, 1, ith, nth, &u0, &u1);
    kv_row_type type = kv_format_row_type(kv_pool_format(c->pool));
    /* the caller's pointer tables, filled by prepare_bf16_tiles */
    while (u0 < u1) {
        int h = (int)(u0 / blocks);
        int64_t b0 = u0 % blocks, b1 = b0 + (u1 - u0) < blocks ? b0 + (u1 - u0) : blocks;
        op_attention_bf16_tiles_build(c->att_online, c->att_tiles + (size_t)h * t->tiles.head_bytes, (const void *const *)c->k_ptrs,
                                      (const void *const *)c->v_ptrs, type, hp->n_head_kv, hp->d_k, h, n_keys, b0, b1);
        u0 += b1 - b0;
    }
}

/* At bf16 and int8, a batch of one sequence long enough that each kv head's keys
 * are read by several units (att_rows rows each) gets the layer's tiles
 * built once, in parallel, before its attention (into lt->tiles): at 16k keys and chunks of
 * 512 rows each unit rebuilt every tile from rows scattered over the pool,
 * 4 times per kv head per chunk. Bits do not change (ops.h). Layers with
 * a sliding window, batches of several sequences and tiles over
 * ATT_TILES_MAX_BYTES build per unit as before. */
static void prepare_bf16_tiles(model_ctx *c, layer_task *lt) {
    const model_hparams *hp = &c->m->hp;
    const model_batch *b = lt->b;
    if (c->att_online == ATTENTION_F32 || lt->L->window > 0 || b->n_tokens <= att_rows(c)) return;
    int64_t n_keys = 0;
    for (int r = 0; r < b->n_tokens; r++) {
        if (b->seqs[r] != b->seqs[0]) return;
        if (b->pos[r] + 1 > n_keys) n_keys = b->pos[r] + 1;
    }
    size_t head_bytes = op_attention_bf16_tiles_bytes(c->att_online, n_keys, hp->d_k), bytes = head_bytes * (size_t)hp->n_head_kv;
    if (bytes > ATT_TILES_MAX_BYTES) return;
    if (bytes > c->att_tiles_cap) {
        /* 64-byte aligned: the kernel loads the tiles as aligned vectors */
        void *p = NULL;
        if (posix_memalign(&p, 64, bytes) != 0) return; /* no memory: build per unit */
        free(c->att_tiles);
        c->att_tiles = p;
        c->att_tiles_cap = bytes;
    }
    const kv_seq *seq = b->seqs[0];
    int32_t need = (int32_t)((n_keys + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS);
    for (int32_t i = 0; i < need; i++) {
        c->k_ptrs[i] = kv_block_k(c->pool, seq->blocks[i], lt->layer);
        c->v_ptrs[i] = kv_block_v(c->pool, seq->blocks[i], lt->layer);
    }
    lt->tiles = (attention_bf16_tiles){c->att_tiles, head_bytes, n_keys};
    int64_t units = (n_keys + 63) / 64 * hp->n_head_kv;
    int parts = c->n_threads * ATT_PARTS_PER_THREAD;
    ember_pool_run_parts(c->threads, task_bf16_tiles, lt, units < parts ? (int)units : parts);
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

/* Row-wise tasks: a single row (decode) runs on the caller, which is
 * cheaper than waking the pool for a split with nothing to share. */
static void run_rows(model_ctx *c, ember_task_fn fn, void *ctx, int n_rows) {
    if (n_rows < 2) fn(ctx, 0, 1);
    else ember_pool_run(c->threads, fn, ctx);
}

static void rmsnorm_rows(model_ctx *c, float *dst, float *src, const float *w, int n_rows, int width) {
    rows_task t = {c, n_rows, w, dst, src, width};
    run_rows(c, task_rmsnorm, &t, n_rows);
}

static void swiglu_rows(model_ctx *c, float *gate_inout, float *up, int n_rows, int width) {
    rows_task t = {c, n_rows, NULL, gate_inout, up, width};
    run_rows(c, task_swiglu, &t, n_rows);
}

static int matmul(model_ctx *c, const tensor_weight *w, const float *x, int n, float *y, ember_error *err) {
    if (tensor_matmul(c->threads, c->mm, w, x, n, y) < 0) return ember_fail(err, "out of memory in matmul");
    return 0;
}

/* Weights over the same input in one pool task where they allow it
 * (tensor_matmul_group): one barrier instead of one per weight. */
static int matmul_group(model_ctx *c, const tensor_weight *const *ws, int n_w, const float *x, int n,
                        float *const *ys, ember_error *err) {
    if (tensor_matmul_group(c->threads, c->mm, ws, n_w, x, n, ys) < 0) return ember_fail(err, "out of memory in matmul");
    return 0;
}

int fwd_matmul(model_ctx *c, const tensor_weight *w, const float *x, int n, float *y, ember_error *err) {
    return matmul(c, w, x, n, y, err);
}

void fwd_rmsnorm_rows(model_ctx *c, float *dst, const float *src, const float *w, int n_rows, int width) {
    rmsnorm_rows(c, dst, (float *)src, w, n_rows, width);
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

/* Attention output gate (qwen35/qwen3next): attn *= sigmoid(gate). */
static void task_attn_gate(void *arg, int ith, int nth) {
    layer_task *t = arg;
    const model_hparams *hp = &t->c->m->hp;
    int q_dim = hp->n_head * hp->d_k;
    long r0, r1;
    ember_split_range(t->b->n_tokens, 1, ith, nth, &r0, &r1);
    for (long r = r0; r < r1; r++) {
        float *o = t->c->attn + r * (size_t)hp->n_head * hp->d_v;
        const float *qg = t->c->qg + r * 2 * (size_t)q_dim;
        for (int h = 0; h < hp->n_head; h++)
            for (int d = 0; d < hp->d_v; d++) o[h * hp->d_v + d] *= 1.0f / (1.0f + expf(-qg[h * 2 * hp->d_k + hp->d_k + d]));
    }
}

/* Attention over a kvarn pool, in passes: a row attends once its
 * sequence's pool holds exactly the sealed groups the rule gives its
 * position (kv_pool.h); between passes the next group of each sequence that
 * still has rows waiting is sealed on this layer. A chunk that crosses no
 * sealing point (nearly all) takes one pass. Rows of a sequence come in
 * position order, so the groups sealed before the chunk are those of its
 * first row's predecessor. */
static void kvarn_attention(model_ctx *c, const model_batch *b, layer_task *lt) {
    enum { ATTEND = 0, WAIT = 1, DONE = 2 };
    kv_format f = kv_pool_format(c->pool);
    int n = b->n_tokens;
    for (int r = 0; r < n; r++) {
        int k = 0; /* the sequence's first row */
        while (b->seqs[k] != b->seqs[r]) k++;
        c->kvarn_phys[r] = k < r ? c->kvarn_phys[k] : kv_kvarn_sealed_end(f, b->pos[r] - 1);
        c->att_skip[r] = WAIT;
    }
    for (;;) {
        bool ready = false, waiting = false;
        for (int r = 0; r < n; r++) {
            if (c->att_skip[r] == DONE) continue;
            c->att_skip[r] = kv_kvarn_sealed_end(f, b->pos[r]) == c->kvarn_phys[r] ? ATTEND : WAIT;
            ready |= c->att_skip[r] == ATTEND;
            waiting |= c->att_skip[r] == WAIT;
        }
        if (ready) run_attention(c, lt);
        if (!waiting) break;
        for (int r = 0; r < n; r++)
            if (c->att_skip[r] == ATTEND) c->att_skip[r] = DONE;
        /* Seal the next group of each sequence with rows still waiting, once. */
        for (int r = 0; r < n; r++) {
            if (c->att_skip[r] != WAIT) continue;
            int k = 0;
            while (!(b->seqs[k] == b->seqs[r] && c->att_skip[k] == WAIT)) k++;
            if (k < r) continue;
            int64_t g = c->kvarn_phys[r];
            kv_kvarn_seal_group(c->pool, b->seqs[r], lt->layer, g, c->kvarn_scratch);
            for (int j = 0; j < n; j++)
                if (b->seqs[j] == b->seqs[r]) c->kvarn_phys[j] = g + 1;
        }
    }
    memset(c->att_skip, ATTEND, (size_t)n);
}

/* Attention sublayer L whose K/V are layer il of the pool: c->xn rows ->
 * out rows. Writes this layer's K/V for every row before any row attends. */
static int fwd_attention(model_ctx *c, const model_batch *b, const layer_weights *L, int il, float *out,
                         ember_error *err) {
    int n = b->n_tokens;
    layer_task lt = {c, b, L, il};
    const tensor_weight *qkv[3] = {&L->wq, &L->wk, &L->wv};
    float *qkv_out[3] = {L->q_gated ? c->qg : c->q, c->k, c->v};
    if (matmul_group(c, qkv, 3, c->xn, n, qkv_out, err) < 0) return -1;
    prof_mark(c, MODEL_PROF_QKV);
    run_rows(c, task_qk_prepare, &lt, n);
    prof_mark(c, MODEL_PROF_QK_PREP);
    if (c->kvarn) kvarn_attention(c, b, &lt);
    else {
        prepare_bf16_tiles(c, &lt);
        run_attention(c, &lt);
    }
    if (L->q_gated) run_rows(c, task_attn_gate, &lt, n);
    prof_mark(c, MODEL_PROF_ATTN);
    int rc = matmul(c, &L->wo, c->attn, n, out, err);
    prof_mark(c, MODEL_PROF_WO);
    return rc;
}

static void task_geglu(void *arg, int ith, int nth) {
    rows_task *t = arg;
    long r0, r1;
    ember_split_range(t->n_rows, 1, ith, nth, &r0, &r1);
    for (long r = r0; r < r1; r++)
        gemma3_geglu(t->dst + r * t->width, t->dst + r * t->width, t->src + r * t->width, t->width);
}

/* FFN sublayer of layer L: c->xn rows -> c->proj rows. */
static int fwd_ffn(model_ctx *c, const layer_weights *L, int n, ember_error *err) {
    const model_hparams *hp = &c->m->hp;
    int D = hp->n_embd;
    if (L->ffn == FFN_MOE) {
        if (ffn_moe(c, L, n, err) < 0) return -1;
        prof_mark(c, MODEL_PROF_FFN_IN);
        if (L->shexp_up.data == NULL) return 0;
        /* Shared expert, scaled by sigmoid(shexp_inp . x): into exp_in, then added. */
        if (matmul(c, &L->shexp_gate, c->xn, n, c->gate, err) < 0) return -1;
        if (matmul(c, &L->shexp_up, c->xn, n, c->up, err) < 0) return -1;
        swiglu_rows(c, c->gate, c->up, n, hp->n_ff_shexp);
        if (matmul(c, &L->shexp_down, c->gate, n, c->exp_in, err) < 0) return -1;
        if (matmul(c, &L->shexp_inp, c->xn, n, c->router, err) < 0) return -1;
        for (int r = 0; r < n; r++) {
            float g = 1.0f / (1.0f + expf(-c->router[r]));
            float *o = c->proj + (size_t)r * D;
            const float *se = c->exp_in + (size_t)r * D;
            for (int d = 0; d < D; d++) o[d] += se[d] * g;
        }
        prof_mark(c, MODEL_PROF_FFN_IN);
        return 0;
    }
    const tensor_weight *gate_up[2] = {&L->ffn_gate, &L->ffn_up};
    float *gate_up_out[2] = {c->gate, c->up};
    if (matmul_group(c, gate_up, 2, c->xn, n, gate_up_out, err) < 0) return -1;
    prof_mark(c, MODEL_PROF_FFN_IN);
    if (L->ffn == FFN_GEGLU) {
        rows_task t = {c, n, NULL, c->gate, c->up, hp->n_ff};
        run_rows(c, task_geglu, &t, n);
    } else {
        swiglu_rows(c, c->gate, c->up, n, hp->n_ff);
    }
    prof_mark(c, MODEL_PROF_ACT);
    int rc = matmul(c, &L->ffn_down, c->gate, n, c->proj, err);
    prof_mark(c, MODEL_PROF_FFN_DOWN);
    return rc;
}

/* Groups the rows of a chunk by recurrent state and checks that each
 * sequence's rows continue its state in position order. */
static int group_states(model_ctx *c, const model_batch *b, ember_error *err) {
    int n = b->n_tokens;
    if (b->states == NULL) return ember_fail(err, "%s has recurrent layers: the batch needs per-row states", c->m->hp.arch_name);
    c->n_groups = 0;
    int *count = c->grp_start + 1; /* counts first, then prefix sums */
    for (int r = 0; r < n; r++) {
        model_state *st = b->states[r];
        if (st == NULL || st->m != c->m) return ember_fail(err, "batch row %d has no state of this model", r);
        int g = 0;
        while (g < c->n_groups && c->grp_state[g] != st) g++;
        if (g == c->n_groups) {
            c->grp_state[c->n_groups++] = st;
            count[g] = 0;
        }
        if (b->pos[r] != st->pos + count[g])
            return ember_fail(err, "batch row %d is at position %lld but its sequence's recurrent state expects %lld",
                              r, (long long)b->pos[r], (long long)(st->pos + count[g]));
        count[g]++;
    }
    c->grp_start[0] = 0;
    for (int g = 0; g < c->n_groups; g++) c->grp_start[g + 1] += c->grp_start[g];
    for (int g = 0; g < c->n_groups; g++) {
        int k = c->grp_start[g];
        for (int r = 0; r < n; r++)
            if (b->states[r] == c->grp_state[g]) c->grp_rows[k++] = r;
    }
    return 0;
}

/* Refuses a chunk whose tokens or positions the model or the pool cannot
 * take, before anything is written; returns the most keys a row attends. */
static int check_rows(model_ctx *c, const model_batch *b, int64_t *max_keys, ember_error *err) {
    const model_hparams *hp = &c->m->hp;
    *max_keys = 0;
    for (int r = 0; r < b->n_tokens; r++) {
        if (b->tokens[r] < 0 || b->tokens[r] >= hp->n_vocab)
            return ember_fail(err, "token id %d at batch row %d is outside the vocabulary (%d)", b->tokens[r], r, hp->n_vocab);
        const kv_seq *seq = b->seqs[r];
        if (b->pos[r] < 0 || b->pos[r] >= (int64_t)seq->n_blocks * KV_BLOCK_TOKENS)
            return ember_fail(err, "position %lld at batch row %d has no KV block (sequence has %d blocks)",
                              (long long)b->pos[r], r, seq->n_blocks);
        if (b->pos[r] + 1 > *max_keys) *max_keys = b->pos[r] + 1;
    }
    return 0;
}

/* dst rows (n, n_embd) = the token embeddings of the chunk's tokens. */
static void embed_rows(model_ctx *c, const model_batch *b, float *dst) {
    const model *m = c->m;
    int D = m->hp.n_embd;
    for (int r = 0; r < b->n_tokens; r++) {
        float *x = dst + (size_t)r * D;
        quant_dequantize_row(m->tok_embd.type, (const uint8_t *)m->tok_embd.data + (size_t)b->tokens[r] * m->tok_embd.row_bytes, x, D);
        if (m->hp.embd_scale != 1.0f)
            for (int d = 0; d < D; d++) x[d] *= m->hp.embd_scale;
    }
}

/* One block on the residual rows c->x: x += [post norm] mixer(rmsnorm(x)),
 * then x += [post norm] ffn(rmsnorm(x)). il is the block's KV layer in the
 * pool and, for recurrent mixers, its index in m->layers. */
static int forward_layer(model_ctx *c, const model_batch *b, const layer_weights *L, int il, ember_error *err) {
    int n = b->n_tokens, D = c->m->hp.n_embd;
    rmsnorm_rows(c, c->xn, c->x, L->attn_norm, n, D);
    prof_mark(c, MODEL_PROF_NORM);
    int rc = 0;
    switch (L->mixer) {
    case MIX_ATTN: rc = fwd_attention(c, b, L, il, c->proj, err); break;
    case MIX_GDN: rc = gdn_mixer(c, b, il, c->proj, err); break;
    case MIX_MAMBA2: rc = mamba2_mixer(c, b, il, c->proj, err); break;
    case MIX_ATTN_MAMBA2:
        /* falcon-h1: x += attn(xn) + mamba2(xn) */
        rc = fwd_attention(c, b, L, il, c->proj, err);
        if (rc == 0) rc = mamba2_mixer(c, b, il, c->proj2, err);
        if (rc == 0)
            for (int r = 0; r < n; r++) op_add(c->proj + (size_t)r * D, c->proj2 + (size_t)r * D, D);
        break;
    }
    prof_mark(c, MODEL_PROF_MIXER); /* recurrent mixers; attention marked its own steps */
    if (rc < 0) return -1;
    if (L->post_attn_norm) rmsnorm_rows(c, c->proj, c->proj, L->post_attn_norm, n, D);
    prof_mark(c, MODEL_PROF_NORM);
    for (int r = 0; r < n; r++) op_add(c->x + (size_t)r * D, c->proj + (size_t)r * D, D);
    prof_mark(c, MODEL_PROF_RESID);
    if (L->ffn == FFN_NONE) return 0;

    rmsnorm_rows(c, c->xn, c->x, L->ffn_norm, n, D);
    prof_mark(c, MODEL_PROF_NORM);
    if (fwd_ffn(c, L, n, err) < 0) return -1;
    if (L->post_ffn_norm) rmsnorm_rows(c, c->proj, c->proj, L->post_ffn_norm, n, D);
    prof_mark(c, MODEL_PROF_NORM);
    for (int r = 0; r < n; r++) op_add(c->x + (size_t)r * D, c->proj + (size_t)r * D, D);
    prof_mark(c, MODEL_PROF_RESID);
    return 0;
}

/* The head on the rows that asked for logits: rmsnorm(x) * norm (copied to
 * b->hidden when set), then the LM head. */
static int head_rows(model_ctx *c, const model_batch *b, const float *norm, float *logits, ember_error *err) {
    const model *m = c->m;
    int n = b->n_tokens, D = m->hp.n_embd, n_out = 0;
    if (b->hidden && b->hidden_all) {
        /* every row normed (row by row, so the same bits as below), then
         * the wanted ones gathered for the LM head */
        rmsnorm_rows(c, c->xn, c->x, norm, n, D);
        memcpy(b->hidden, c->xn, (size_t)n * D * sizeof(float));
        for (int r = 0; r < n; r++) {
            bool want = b->want_logits ? b->want_logits[r] : r == n - 1;
            if (want) memcpy(c->proj + (size_t)n_out++ * D, c->xn + (size_t)r * D, (size_t)D * sizeof(float));
        }
        return n_out ? matmul(c, &m->output, c->proj, n_out, logits, err) : 0;
    }
    for (int r = 0; r < n; r++) {
        bool want = b->want_logits ? b->want_logits[r] : r == n - 1;
        if (!want) continue;
        memcpy(c->proj + (size_t)n_out * D, c->x + (size_t)r * D, (size_t)D * sizeof(float));
        n_out++;
    }
    if (n_out == 0) return 0;
    rmsnorm_rows(c, c->xn, c->proj, norm, n_out, D);
    if (b->hidden) memcpy(b->hidden, c->xn, (size_t)n_out * D * sizeof(float));
    return matmul(c, &m->output, c->xn, n_out, logits, err);
}

static int forward_chunk(model_ctx *c, const model_batch *b, float *logits, ember_error *err) {
    const model *m = c->m;
    int64_t max_keys;
    if (check_rows(c, b, &max_keys, err) < 0) return -1;
    if (m->has_attention && reserve_attention(c, max_keys, err) < 0) return -1;
    if (m->state_floats > 0 && group_states(c, b, err) < 0) return -1;
    if (c->prof) c->prof_t = prof_now();
    embed_rows(c, b, c->x);
    prof_mark(c, MODEL_PROF_EMBED);
    for (int il = 0; il < m->hp.n_layer; il++)
        if (forward_layer(c, b, &m->layers[il], il, err) < 0) return -1;
    if (m->state_floats > 0)
        for (int g = 0; g < c->n_groups; g++) c->grp_state[g]->pos += c->grp_start[g + 1] - c->grp_start[g];
    int rc = head_rows(c, b, m->output_norm, logits, err);
    prof_mark(c, MODEL_PROF_HEAD);
    return rc;
}

/* The MTP block on one chunk: x = eh_proj [enorm(embd(x_p)) | hnorm(h_prev)],
 * then the block and the head with the head norm. */
static int mtp_chunk(model_ctx *c, const model_batch *b, const float *h_prev, float *logits, ember_error *err) {
    const model *m = c->m;
    const mtp_weights *w = m->mtp;
    int n = b->n_tokens, D = m->hp.n_embd;
    int64_t max_keys;
    if (check_rows(c, b, &max_keys, err) < 0) return -1;
    if (reserve_attention(c, max_keys, err) < 0) return -1;
    embed_rows(c, b, c->proj);
    for (int r = 0; r < n; r++) {
        float *cat = c->mtp_cat + (size_t)r * 2 * D;
        op_rmsnorm(cat, c->proj + (size_t)r * D, w->enorm, D, m->hp.rms_eps);
        op_rmsnorm(cat + D, h_prev + (size_t)r * D, w->hnorm, D, m->hp.rms_eps);
    }
    if (matmul(c, &w->eh_proj, c->mtp_cat, n, c->x, err) < 0) return -1;
    if (forward_layer(c, b, &w->block, 0, err) < 0) return -1;
    return head_rows(c, b, w->head_norm, logits, err);
}

/* Runs a batch in chunks of max_batch rows (trunk, or the MTP block when
 * h_prev is set), advancing logits and hidden past each chunk's wanted rows. */
static int forward_pieces(model_ctx *c, const model_batch *b, const float *h_prev, float *logits, ember_error *err) {
    int n_vocab = c->m->hp.n_vocab, D = c->m->hp.n_embd;
    float *hidden = b->hidden;
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
                             b->want_logits ? b->want_logits + start : want, b->states ? b->states + start : NULL,
                             hidden, b->hidden_all};
        int rc = h_prev ? mtp_chunk(c, &piece, h_prev + (size_t)start * D, logits, err)
                        : forward_chunk(c, &piece, logits, err);
        int wanted = 0;
        for (int r = 0; r < n; r++) wanted += piece.want_logits[r];
        free(want);
        if (rc < 0) return -1;
        logits += (size_t)wanted * n_vocab;
        if (hidden) hidden += (size_t)(b->hidden_all ? n : wanted) * D;
    }
    return 0;
}

int model_forward(model_ctx *c, const model_batch *b, float *logits, ember_error *err) {
    if (c->is_mtp) return ember_fail(err, "model_forward on a context made for the MTP head");
    return forward_pieces(c, b, NULL, logits, err);
}

model_ctx *model_mtp_ctx_create(const model *m, kv_pool *mtp_pool, int n_threads, int max_batch, ember_error *err) {
    if (m->mtp == NULL) {
        ember_fail(err, "%s has no MTP (nextn) head", m->hp.name[0] ? m->hp.name : m->hp.arch_name);
        return NULL;
    }
    model_ctx *c = model_ctx_create(m, mtp_pool, n_threads, max_batch, err);
    if (c) c->is_mtp = true;
    return c;
}

int model_mtp_forward(model_ctx *c, const model_batch *b, const float *h_prev, float *logits, ember_error *err) {
    if (!c->is_mtp) return ember_fail(err, "model_mtp_forward needs a context from model_mtp_ctx_create");
    if (h_prev == NULL) return ember_fail(err, "model_mtp_forward needs the target's hidden rows");
    return forward_pieces(c, b, h_prev, logits, err);
}

int model_eval(model_ctx *c, kv_seq *seq, const int32_t *tokens, int n, bool all_logits, float *logits,
               ember_error *err) {
    return model_eval_state(c, seq, NULL, tokens, n, all_logits, logits, err);
}

int model_eval_state(model_ctx *c, kv_seq *seq, model_state *state, const int32_t *tokens, int n, bool all_logits,
                     float *logits, ember_error *err) {
    return model_eval_hidden(c, seq, state, tokens, n, all_logits, logits, NULL, err);
}

/* model_eval_hidden and model_mtp_eval: one sequence's rows at positions
 * seq->n_tokens.., through the trunk or (h_prev set) the MTP head. */
static int eval_rows(model_ctx *c, kv_seq *seq, model_state *state, const int32_t *tokens, int n, bool all_logits,
                     const float *h_prev, float *logits, float *hidden, ember_error *err) {
    if (n <= 0) return 0;
    if (kv_seq_prepare_append(c->pool, seq, n, err) < 0) return -1;
    int64_t *pos = malloc((size_t)n * sizeof *pos);
    kv_seq **seqs = malloc((size_t)n * sizeof *seqs);
    bool *want = malloc((size_t)n * sizeof *want);
    model_state **states = state ? malloc((size_t)n * sizeof *states) : NULL;
    int rc = -1;
    if (pos == NULL || seqs == NULL || want == NULL || (state && states == NULL)) {
        ember_fail(err, "out of memory");
        goto done;
    }
    for (int i = 0; i < n; i++) {
        pos[i] = seq->n_tokens + i;
        seqs[i] = seq;
        want[i] = logits && (all_logits || i == n - 1);
        if (states) states[i] = state;
    }
    model_batch b = {n, tokens, pos, seqs, want, states, hidden, false};
    rc = h_prev ? model_mtp_forward(c, &b, h_prev, logits, err) : model_forward(c, &b, logits, err);
    if (rc == 0) seq->n_tokens += n;
done:
    free(pos);
    free(seqs);
    free(want);
    free(states);
    return rc;
}

int model_eval_hidden(model_ctx *c, kv_seq *seq, model_state *state, const int32_t *tokens, int n, bool all_logits,
                      float *logits, float *hidden, ember_error *err) {
    return eval_rows(c, seq, state, tokens, n, all_logits, NULL, logits, hidden, err);
}

int model_mtp_eval(model_ctx *c, kv_seq *seq, const int32_t *tokens, int n, const float *h_prev, float *logits,
                   float *hidden, ember_error *err) {
    if (h_prev == NULL) return ember_fail(err, "model_mtp_eval needs the target's hidden rows");
    return eval_rows(c, seq, NULL, tokens, n, true, h_prev, logits, hidden, err);
}
