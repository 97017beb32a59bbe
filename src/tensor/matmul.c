/* matmul.c - weight matrix times activations (see matmul.h).
 *
 * Design:
 *  1. Activations are converted once per call to the weight's dot format
 *    (Q8_0 / Q8_1 / Q8_K, or BF16 for BF16 weights on vdpbf16ps:
 *    quant_dot_act; other float weights use x as is). The conversion is split
 *    over threads by activation block: blocks are independent, so the result
 *    does not depend on the split.
 *  2. Output features are split in multiples of the kernel's row height,
 *    into several parts per thread that the running threads claim (a
 *    descheduled one leaves one small part behind). Weights that read the
 *    same x (q/k/v, gate/up) can share one task (tensor_matmul_group): the
 *    same parts, one barrier. Small batches (decode,
 *    speculative verification: up to QUANT_STRIP_TOKENS tokens, or up to
 *    STRIP_MAX_TOKENS in chunks for the 16-lane kernels) use the ISA's strips
 *    (quant_strip_kernel): each weight block is loaded once for every token,
 *    so the batch costs one pass over the weights plus the products. Where a
 *    type has no strip for a lone token, n_tokens == 1 is a GEMV of
 *    quant_vec_dot rows. Larger batches use the AVX-512 panels (Q8_0, Q4_K,
 *    Q6_K, IQ4_NL, IQ4_XS, and F32 / F16 / BF16 weights converted once per
 *    panel to f32) or the register-blocked tile (rows x tokens, quant_tile_kernel)
 *    for full tiles, the ragged edges the plain dot; tiles are grouped so a
 *    few weight rows stay in L1 while all token tiles pass over them. A
 *    panel is packed into one of pool-size scratch slots, the lowest free
 *    one, so a thread keeps refilling a slot its cache already holds. An
 *    ISA with neither panels nor tiles (AVX2) runs larger batches on its
 *    strips too, in blocks of tokens that stay in L2 (strip_pass).
 *  3. Bit-identity: quant.h's determinism model makes a tile and a single
 *    dot perform the same integer work and the same float fold per
 *    (row, token), so y never depends on n_tokens, the batch or nth. */
#include "tensor/matmul.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/quant.h"

typedef struct scratch_buf {
    void *p;         /* 64-byte aligned */
    size_t capacity; /* bytes */
} scratch_buf;

struct matmul_scratch {
    scratch_buf act;  /* converted activations */
    scratch_buf meta; /* per activation block metadata for the panel GEMM */
    scratch_buf pack; /* one packed weight panel per thread (pack_slot_take) */
};

matmul_scratch *matmul_scratch_create(void) { return calloc(1, sizeof(matmul_scratch)); }

void matmul_scratch_free(matmul_scratch *s) {
    if (!s) return;
    free(s->act.p);
    free(s->meta.p);
    free(s->pack.p);
    free(s);
}

static int scratch_reserve(scratch_buf *s, size_t bytes) {
    if (bytes <= s->capacity) return 0;
    void *p = NULL;
    size_t cap = bytes + bytes / 4;
    cap = (cap + 63) & ~(size_t)63;
    if (posix_memalign(&p, 64, cap) != 0) return -1;
    free(s->p);
    s->p = p;
    s->capacity = cap;
    return 0;
}

typedef struct matmul_task {
    const tensor_weight *w;
    const float *x;
    float *y;
    int64_t n_tokens;
    ember_dtype act_type;
    int act_block;          /* elements per activation block */
    size_t act_block_bytes; /* bytes per activation block */
    const uint8_t *act;     /* converted activations (or x itself) */
    size_t act_row_bytes;
    quant_dot_fn dot;
    quant_tile_fn tile;
    int tile_rows, tile_cols;
    quant_strip_fn strip;   /* small batches: one pass over the weights, or NULL */
    quant_strip_fn strip_rest; /* the last, shorter token chunk */
    int strip_tokens;       /* tokens per chunk of strip */
    bool strip_blocks;      /* no batch kernels (AVX2): blocks of STRIP_BLOCK_TOKENS, own heights */
    int strip_rows, strip_rest_rows; /* heights of strip and strip_rest */
    int32_t *meta;          /* panel GEMM: per (token, block) {-128 * sum(qs), f32 d}; or NULL */
    uint8_t *pack;          /* panel GEMM: one packed panel per running thread, or NULL */
    size_t pack_bytes;      /* per slot */
    _Atomic unsigned *pack_busy; /* bit s: slot s is in use by a running part */
} matmul_task;

enum { PANEL_ROWS = 16, PANEL_MIN_TOKENS = 8 };

/* Q8_0 activation blocks [b0, b0 + count) of one row: the panel metadata. */
static void q8_0_meta(const uint8_t *act, int32_t *meta, int64_t count) {
    for (int64_t b = 0; b < count; b++, act += sizeof(block_q8_0)) {
        const block_q8_0 *blk = (const block_q8_0 *)act;
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) sum += blk->qs[j];
        float d = quant_f16_to_f32(blk->d);
        meta[2 * b] = -128 * sum;
        memcpy(&meta[2 * b + 1], &d, sizeof d);
    }
}

static void convert_task(void *ctx, int ith, int nth) {
    const matmul_task *t = ctx;
    int64_t blocks_per_row = t->w->n_in / t->act_block;
    long begin, end;
    ember_split_range((long)(blocks_per_row * t->n_tokens), 1, ith, nth, &begin, &end);
    uint8_t *act = (uint8_t *)t->act;
    for (long b = begin; b < end;) {
        int64_t row = b / blocks_per_row, col = b % blocks_per_row;
        int64_t count = blocks_per_row - col;
        if (count > end - b) count = end - b;
        quant_quantize_row(t->act_type, t->x + row * t->w->n_in + col * t->act_block,
                           act + row * t->act_row_bytes + col * t->act_block_bytes,
                           count * t->act_block);
        if (t->meta)
            q8_0_meta(act + row * t->act_row_bytes + col * t->act_block_bytes,
                      t->meta + 2 * (row * blocks_per_row + col), count);
        b += (long)count;
    }
}

/* Rows [o0, o1) of every token with plain dots. */
static void dots_range(const matmul_task *t, int64_t o0, int64_t o1, int64_t t0, int64_t t1) {
    const uint8_t *wd = t->w->data;
    int64_t n_in = t->w->n_in, n_out = t->w->n_out;
    for (int64_t o = o0; o < o1; o++) {
        const uint8_t *row = wd + (size_t)o * t->w->row_bytes;
        for (int64_t tok = t0; tok < t1; tok++)
            t->y[tok * n_out + o] = t->dot(n_in, row, t->act + (size_t)tok * t->act_row_bytes);
    }
}

enum { ROW_GROUP_TILES = 4 }; /* weight tiles kept hot while the tokens pass */

/* Strips for batches of up to STRIP_MAX_TOKENS (decode, speculative
 * verification): one kernel when it fits QUANT_STRIP_TOKENS, else full
 * chunks plus a shorter last one, where both kernels have the same height
 * (the 16-lane kernels; the others change height with the token count and
 * stop at QUANT_STRIP_TOKENS). Beyond that the panels and tiles, which pack
 * or reuse each weight block for more tokens, cost less; an ISA with
 * neither (AVX2) runs every batch over QUANT_STRIP_TOKENS on strips, in blocks of
 * STRIP_BLOCK_TOKENS tokens, chunks of STRIP_WIDE_TOKENS: one dot per (row,
 * token) loaded the row's blocks and the token's again for each product
 * and reduced every block alone. */
enum { STRIP_MAX_TOKENS = 16, STRIP_BLOCK_TOKENS = 64, STRIP_WIDE_TOKENS = 4 };

/* Rows [begin, end) over tokens [tok0, tok1) in chunks of strip_tokens,
 * strips of height R: strip for full chunks, strip_rest for a shorter one
 * (the same height when both occur in one pass). Each chunk passes over a
 * strip's rows while they are in L1. */
static void strip_pass(const matmul_task *t, int R, int64_t begin, int64_t end, int64_t tok0, int64_t tok1) {
    const int C = t->strip_tokens;
    const int64_t n_in = t->w->n_in, n_out = t->w->n_out;
    const size_t meta_stride = 2 * (size_t)(n_in / 32);
    for (int64_t o = begin; o < end; o += R) {
        const uint8_t *wrow = (const uint8_t *)t->w->data + (size_t)o * t->w->row_bytes;
        int rows = end - o < R ? (int)(end - o) : R;
        if (o + R < end) {
            size_t ahead = (size_t)(end - o - R < R ? end - o - R : R) * t->w->row_bytes;
            for (size_t b = 0; b < ahead; b += 64) __builtin_prefetch(wrow + (size_t)R * t->w->row_bytes + b, 0, 2);
        }
        for (int64_t tok = tok0; tok < tok1; tok += C) {
            quant_strip_fn fn = tok1 - tok < C ? t->strip_rest : t->strip;
            fn(n_in, wrow, t->w->row_bytes, rows, t->act + (size_t)tok * t->act_row_bytes, t->act_row_bytes,
               t->meta ? t->meta + (size_t)tok * meta_stride : NULL, t->y + tok * n_out + o, (size_t)n_out);
        }
    }
}

static long compute_granule(const matmul_task *t) {
    return t->strip ? t->strip_rows : t->pack ? PANEL_ROWS : t->tile ? t->tile_rows : 4;
}

/* Output rows go out in several parts per thread, claimed by whichever
 * thread is running (threadpool.h): a thread slowed or descheduled by another
 * process then holds back one small part, not half of the matrix. Small
 * batches (the strips: a pass over the weights from memory) get parts of at
 * most PART_STREAM_BYTES of weights: the pool deals each thread a contiguous
 * range of parts, so small parts do not break its stream, and the threads
 * then finish within a small part of each other (the LM head of a 0.6B
 * model, 165 MB, was 16 parts of 10 MB: one thread often read alone for
 * the last of them). */
enum { PARTS_PER_THREAD = 8 };
#define PART_STREAM_BYTES (256u << 10)
static int matmul_parts(const ember_pool *pool, const matmul_task *t, long granule) {
    int threads = ember_pool_size(pool);
    int64_t n_out = t->w->n_out;
    int64_t units = (n_out + granule - 1) / granule, parts = (int64_t)threads * PARTS_PER_THREAD;
    if (threads == 1) return 1;
    if (t->strip) {
        int64_t by_bytes = (int64_t)((size_t)n_out * t->w->row_bytes / PART_STREAM_BYTES);
        if (by_bytes > parts) parts = by_bytes;
        if (parts > 0xffff) parts = 0xffff;
    }
    return (int)(parts < units ? parts : units > 0 ? units : 1);
}

/* Packed panels go to one of pool-size slots, the lowest free one: at most
 * that many parts run at once, and a thread that runs parts one after another
 * keeps refilling the same slot, which stays in its cache (a slot per part,
 * 8 per thread, would be written cold each time: the float panels of a
 * 8192-wide row are 512 KB). Which slot a part uses never changes its bits. */
enum { PACK_SLOTS_MAX = 32 }; /* a larger pool waits for a free slot */
static int pack_slot_take(_Atomic unsigned *busy) {
    unsigned cur = atomic_load(busy);
    for (;;) {
        if (~cur == 0) {
            cur = atomic_load(busy);
            continue;
        }
        int slot = __builtin_ctz(~cur);
        if (atomic_compare_exchange_weak(busy, &cur, cur | (1u << slot))) return slot;
    }
}

static void compute_task(void *ctx, int ith, int nth) {
    const matmul_task *t = ctx;
    int64_t n_out = t->w->n_out, n_in = t->w->n_in;
    long begin, end;
    ember_split_range((long)n_out, compute_granule(t), ith, nth, &begin, &end);
    if (begin >= end) return;
    if (t->strip) {
        if (!t->strip_blocks) { /* one pass over the weights from memory */
            strip_pass(t, t->strip_rows, begin, end, 0, t->n_tokens);
            return;
        }
        /* Blocks of tokens whose activations stay in L2 while the part's rows
         * pass; the chunk past the last full one has its own height. */
        int64_t full_end = t->n_tokens / t->strip_tokens * t->strip_tokens;
        for (int64_t t0 = 0; t0 < t->n_tokens; t0 += STRIP_BLOCK_TOKENS) {
            int64_t t1 = t0 + STRIP_BLOCK_TOKENS < t->n_tokens ? t0 + STRIP_BLOCK_TOKENS : t->n_tokens;
            int64_t f1 = t1 < full_end ? t1 : full_end;
            if (t0 < f1) strip_pass(t, t->strip_rows, begin, end, t0, f1);
            if (f1 < t1 && t->strip_rest == NULL) dots_range(t, begin, end, f1 > t0 ? f1 : t0, t1);
            else if (f1 < t1) strip_pass(t, t->strip_rest_rows, begin, end, f1 > t0 ? f1 : t0, t1);
        }
        return;
    }
    if (t->pack) {
        int slot = pack_slot_take(t->pack_busy);
        matmul_avx512_panels(t->w->type, t->w->data, t->w->row_bytes, n_in, begin, end, t->act,
                             t->act_row_bytes, t->meta, t->n_tokens, t->y, n_out,
                             t->pack + (size_t)slot * t->pack_bytes);
        atomic_fetch_and(t->pack_busy, ~(1u << slot));
        begin += (end - begin) / PANEL_ROWS * PANEL_ROWS;
        if (begin >= end) return;
    }
    if (t->n_tokens == 1 || !t->tile) {
        dots_range(t, begin, end, 0, t->n_tokens);
        return;
    }
    const int R = t->tile_rows, C = t->tile_cols;
    const uint8_t *wd = t->w->data;
    size_t wrb = t->w->row_bytes;
    int64_t full_rows_end = begin + (end - begin) / R * R;
    int64_t full_tok_end = t->n_tokens / C * C;
    for (int64_t g = begin; g < full_rows_end; g += (int64_t)R * ROW_GROUP_TILES) {
        int64_t g_end = g + (int64_t)R * ROW_GROUP_TILES;
        if (g_end > full_rows_end) g_end = full_rows_end;
        for (int64_t tok = 0; tok < full_tok_end; tok += C)
            for (int64_t o = g; o < g_end; o += R)
                t->tile(n_in, wd + (size_t)o * wrb, wrb, t->act + (size_t)tok * t->act_row_bytes,
                        t->act_row_bytes, t->y + tok * n_out + o, (size_t)n_out);
        if (full_tok_end < t->n_tokens) dots_range(t, g, g_end, full_tok_end, t->n_tokens);
    }
    if (full_rows_end < end) dots_range(t, full_rows_end, end, 0, t->n_tokens);
}

static void choose_strips(matmul_task *t) {
    t->strip = t->strip_rest = NULL;
    t->strip_tokens = QUANT_STRIP_TOKENS;
    t->strip_blocks = false;
    if (t->n_tokens <= QUANT_STRIP_TOKENS) {
        t->strip = t->strip_rest = quant_strip_kernel(t->w->type, (int)t->n_tokens, &t->strip_rows);
        t->strip_rest_rows = t->strip_rows;
        return;
    }
    /* Where the ISA has no tiles or panels (AVX2), anything over
     * QUANT_STRIP_TOKENS goes in blocks, whose last chunk has its own
     * height (the chunked single pass needs equal heights, which AVX2's
     * strips never have). */
    bool batch_kernels = t->tile != NULL || quant_get_isa() == QUANT_ISA_AVX512;
    if (t->n_tokens > STRIP_MAX_TOKENS && batch_kernels) return;
    bool wide = !batch_kernels;
    int C = wide ? STRIP_WIDE_TOKENS : QUANT_STRIP_TOKENS;
    int rows = 0, rest_rows = 0, rest = (int)(t->n_tokens % C);
    quant_strip_fn full = quant_strip_kernel(t->w->type, C, &rows);
    quant_strip_fn last = rest ? quant_strip_kernel(t->w->type, rest, &rest_rows) : full;
    /* wide: a last chunk without a strip (a lone float token) takes dots */
    if (full == NULL || (!wide && (last == NULL || (rest && rest_rows != rows)))) return;
    t->strip = full;
    t->strip_rest = last;
    t->strip_blocks = wide;
    t->strip_tokens = C;
    t->strip_rows = rows;
    t->strip_rest_rows = rest ? rest_rows : rows;
}

/* Everything before the compute task: kernels, scratch, and (when
 * `convert`) the activations converted into scratch. pack_busy is the
 * panel slots' word, owned by the caller for as long as the task runs.
 * Returns 1 with *out ready, 0 when there is nothing to compute, -1 out of
 * memory. */
static int matmul_prepare(ember_pool *pool, matmul_scratch *scratch, const tensor_weight *w, const float *x,
                          int64_t n_tokens, float *y, bool convert, _Atomic unsigned *pack_busy, matmul_task *out) {
    const dtype_info *info = dtype_info_of((uint32_t)w->type);
    if (!info || n_tokens <= 0) return 0;
    matmul_task t = {
        .w = w, .x = x, .y = y, .n_tokens = n_tokens, .act_type = quant_dot_act(w->type),
        .dot = quant_dot_kernel(w->type),
    };
    t.tile = quant_tile_kernel(w->type, &t.tile_rows, &t.tile_cols);
    choose_strips(&t);
    size_t pb = quant_get_isa() == QUANT_ISA_AVX512 && n_tokens >= PANEL_MIN_TOKENS && !t.strip
                    ? matmul_avx512_panel_bytes(w->type, w->n_in)
                    : 0;
    if (pb > 0) {
        int slots = ember_pool_size(pool);
        if (slots > PACK_SLOTS_MAX) slots = PACK_SLOTS_MAX;
        if (scratch_reserve(&scratch->pack, pb * (size_t)slots) != 0) return -1;
        t.pack = scratch->pack.p;
        t.pack_bytes = pb;
        t.pack_busy = pack_busy;
        atomic_store(pack_busy, 0);
    }
    if (t.act_type == DT_F32) {
        t.act = (const uint8_t *)x;
        t.act_row_bytes = (size_t)w->n_in * sizeof(float);
    } else {
        const dtype_info *ai = dtype_info_of((uint32_t)t.act_type);
        t.act_block = ai->block_elems;
        t.act_block_bytes = (size_t)ai->block_bytes;
        t.act_row_bytes = dtype_row_bytes(t.act_type, w->n_in);
        if (scratch_reserve(&scratch->act, t.act_row_bytes * (size_t)n_tokens) != 0) return -1;
        t.act = scratch->act.p;
        /* Panel and strip kernels over Q8_0 activations start from their block sums. */
        if ((pb > 0 && (w->type == DT_Q8_0 || w->type == DT_IQ4_NL)) || (t.strip && t.act_type == DT_Q8_0)) {
            size_t mb = (size_t)(w->n_in / 32) * (size_t)n_tokens * 2 * sizeof(int32_t);
            if (scratch_reserve(&scratch->meta, mb) != 0) return -1;
            t.meta = scratch->meta.p;
        }
        /* A few rows convert faster than a dispatch and barrier cost. */
        if (convert && n_tokens < 4) convert_task(&t, 0, 1);
        else if (convert) ember_pool_run(pool, convert_task, &t);
    }
    *out = t;
    return 1;
}

int tensor_matmul(ember_pool *pool, matmul_scratch *scratch, const tensor_weight *w,
                  const float *x, int64_t n_tokens, float *y) {
    matmul_task t;
    _Atomic unsigned pack_busy = 0;
    int rc = matmul_prepare(pool, scratch, w, x, n_tokens, y, true, &pack_busy, &t);
    if (rc <= 0) return rc;
    ember_pool_run_parts(pool, compute_task, &t, matmul_parts(pool, &t, compute_granule(&t)));
    return 0;
}

/* Several weights over the same x: the parts of all of them in one task
 * (global part ith belongs to the weight whose range holds it), so the
 * threads meet at one barrier instead of one per weight. Each weight is
 * split into exactly the parts tensor_matmul would give it. */
typedef struct matmul_group_task {
    matmul_task t[TENSOR_MATMUL_GROUP_MAX];
    int first_part[TENSOR_MATMUL_GROUP_MAX + 1];
    int n;
} matmul_group_task;

static void group_task(void *ctx, int ith, int nth) {
    (void)nth;
    const matmul_group_task *g = ctx;
    int k = 0;
    while (ith >= g->first_part[k + 1]) k++;
    compute_task((void *)&g->t[k], ith - g->first_part[k], g->first_part[k + 1] - g->first_part[k]);
}

int tensor_matmul_group(ember_pool *pool, matmul_scratch *scratch, const tensor_weight *const *ws, int n_w,
                        const float *x, int64_t n_tokens, float *const *ys) {
    bool fuse = n_w <= TENSOR_MATMUL_GROUP_MAX;
    for (int k = 1; k < n_w && fuse; k++) fuse = ws[k]->type == ws[0]->type && ws[k]->n_in == ws[0]->n_in;
    matmul_group_task g;
    _Atomic unsigned pack_busy = 0; /* the panel slots, shared by all the weights' parts */
    /* the activations are converted once, for the first weight; the others
     * share its buffers (same type and width: the same conversion) */
    for (int k = 0; k < n_w && fuse; k++) {
        int rc = matmul_prepare(pool, scratch, ws[k], x, n_tokens, ys[k], k == 0, &pack_busy, &g.t[k]);
        if (rc < 0) return -1;
        fuse = rc > 0;
    }
    /* A later weight may have grown the panel scratch: every weight packs
     * into the final buffer (same type and width: the same slot size), and
     * a running part takes any free slot whichever weight it belongs to. */
    for (int k = 0; k < n_w && fuse; k++)
        if (g.t[k].pack) g.t[k].pack = scratch->pack.p;
    if (!fuse) {
        for (int k = 0; k < n_w; k++)
            if (tensor_matmul(pool, scratch, ws[k], x, n_tokens, ys[k]) < 0) return -1;
        return 0;
    }
    g.n = n_w;
    g.first_part[0] = 0;
    for (int k = 0; k < n_w; k++)
        g.first_part[k + 1] = g.first_part[k] + matmul_parts(pool, &g.t[k], compute_granule(&g.t[k]));
    if (g.first_part[n_w] > 0xffff) { /* more parts than one task holds (weights of many GB): one call each */
        for (int k = 0; k < n_w; k++)
            if (tensor_matmul(pool, scratch, ws[k], x, n_tokens, ys[k]) < 0) return -1;
        return 0;
    }
    ember_pool_run_parts(pool, group_task, &g, g.first_part[n_w]);
    return 0;
}
