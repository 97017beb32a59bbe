/* mkmodel_weights.c - deterministic random weights for `ember mkmodel`.
 *
 * Design: every row of every tensor has its own random stream, seeded from
 * (global seed, tensor name, row index) through splitmix64. That makes the
 * bytes independent of how rows are split over threads and of the order in
 * which tensors are written, so the same seed gives a byte-identical file on
 * any machine and thread count. Normals come from the Box-Muller transform
 * (both outputs used). A row is generated in f32 and converted with
 * quant_quantize_row - the same rounding llama-quantize uses - directly into
 * the writer's buffer, one tensor at a time, so a multi-gigabyte model is
 * never in memory at once. */
#include "core/rng.h"
#include "cli/mkmodel.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/quant.h"


typedef struct mk_fill {
    mk_weights *owner;
    const mk_tensor *tensor;
    uint64_t tensor_seed;
    float std;           /* for normal inits */
    ember_pool *pool;
    /* Per call: */
    uint8_t *dst;
    int64_t n_rows;
    size_t row_bytes;
    int failed;
} mk_fill;

struct mk_weights {
    mk_fill *fills;
    int n;
    uint64_t total_bytes, done_bytes;
    mk_progress_fn progress;
    void *progress_user;
};

/* FNV-1a: a stable hash of the tensor name, so seeds follow names, not order. */
static uint64_t name_hash(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
    return h;
}

static void generate_row(const mk_fill *f, int64_t row, float *out, int64_t n) {
    uint64_t state = f->tensor_seed ^ (0xD1B54A32D192ED03ull * (uint64_t)(row + 1));
    rng_splitmix64(&state);
    switch (f->tensor->init) {
    case MK_INIT_ONES:
        for (int64_t i = 0; i < n; i++) out[i] = 1.0f;
        return;
    case MK_INIT_SSM_A:
    case MK_INIT_SSM_D:
    case MK_INIT_DT_BIAS: {
        float lo = f->tensor->init == MK_INIT_SSM_A ? -8.0f : f->tensor->init == MK_INIT_SSM_D ? 0.5f : -4.0f;
        float hi = f->tensor->init == MK_INIT_SSM_A ? -1.0f : f->tensor->init == MK_INIT_SSM_D ? 1.5f : -2.0f;
        for (int64_t i = 0; i < n; i++) out[i] = lo + (hi - lo) * (float)(rng_splitmix64(&state) >> 40) * 0x1.0p-24f;
        return;
    }
    case MK_INIT_MATRIX:
    case MK_INIT_HEAD:
    case MK_INIT_BIAS:
        /* Single precision: twice as fast as double and ample for weights. */
        for (int64_t i = 0; i < n; i += 2) {
            uint64_t bits = rng_splitmix64(&state);
            float u1 = ((float)(bits >> 40) + 0.5f) * 0x1.0p-24f; /* (0, 1): safe for log */
            float u2 = (float)(bits & 0xFFFFFF) * 0x1.0p-24f;
            float radius = sqrtf(-2.0f * logf(u1)) * f->std, angle = 6.2831853f * u2;
            out[i] = radius * cosf(angle);
            if (i + 1 < n) out[i + 1] = radius * sinf(angle);
        }
        return;
    }
}

static void fill_rows_task(void *ctx, int ith, int nth) {
    mk_fill *f = ctx;
    int64_t ne0 = f->tensor->ne[0];
    long begin, end;
    ember_split_range((long)f->n_rows, 1, ith, nth, &begin, &end);
    if (begin >= end) return;
    float *row = malloc((size_t)ne0 * sizeof *row);
    if (row == NULL) {
        __atomic_store_n(&f->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (long r = begin; r < end; r++) {
        generate_row(f, r, row, ne0);
        if (quant_quantize_row(f->tensor->type, row, f->dst + (size_t)r * f->row_bytes, ne0) != 0) {
            __atomic_store_n(&f->failed, 1, __ATOMIC_RELAXED);
            break;
        }
    }
    free(row);
}

static int fill_tensor(void *user, void *dst, uint64_t nbytes, ember_error *err) {
    mk_fill *f = user;
    const mk_tensor *t = f->tensor;
    f->dst = dst;
    f->n_rows = t->ne[1] * t->ne[2] * t->ne[3];
    f->row_bytes = dtype_row_bytes(t->type, t->ne[0]);
    f->failed = 0;
    if ((uint64_t)f->n_rows * f->row_bytes != nbytes)
        return ember_fail(err, "internal size mismatch (%llu rows of %zu bytes vs %llu)",
                          (unsigned long long)f->n_rows, f->row_bytes, (unsigned long long)nbytes);
    ember_pool_run(f->pool, fill_rows_task, f);
    if (f->failed) return ember_fail(err, "cannot produce %s data (no quantizer, or out of memory)",
                                     dtype_info_of(t->type)->name);
    mk_weights *mw = f->owner;
    mw->done_bytes += nbytes;
    if (mw->progress) mw->progress(mw->progress_user, mw->done_bytes, mw->total_bytes);
    return 0;
}

mk_weights *mk_weights_add(gguf_writer *w, const mk_tensor *tensors, int n, const mk_config *c, uint64_t seed,
                           ember_pool *pool, ember_error *err) {
    mk_weights *mw = calloc(1, sizeof *mw);
    if (mw == NULL || (mw->fills = calloc((size_t)(n ? n : 1), sizeof *mw->fills)) == NULL) {
        free(mw);
        ember_fail(err, "out of memory");
        return NULL;
    }
    mw->n = n;
    for (int i = 0; i < n; i++) {
        const mk_tensor *t = &tensors[i];
        mk_fill *f = &mw->fills[i];
        f->owner = mw;
        f->tensor = t;
        mw->total_bytes += (uint64_t)dtype_row_bytes(t->type, t->ne[0]) * (uint64_t)(t->ne[1] * t->ne[2] * t->ne[3]);
        uint64_t s = seed ^ name_hash(t->name);
        f->tensor_seed = rng_splitmix64(&s);
        f->pool = pool;
        switch (t->init) {
        case MK_INIT_MATRIX: f->std = 1.0f / sqrtf((float)t->ne[0]); break;
        case MK_INIT_HEAD: f->std = 3.0f / sqrtf((float)c->n_embd); break;
        case MK_INIT_BIAS: f->std = 0.1f; break;
        default: f->std = 0.0f; break;
        }
        if (gguf_writer_add_tensor_fill(w, t->name, t->type, t->n_dims, t->ne, fill_tensor, f, err) != 0) {
            mk_weights_free(mw);
            return NULL;
        }
    }
    return mw;
}

uint64_t mk_weights_bytes(const mk_weights *mw) { return mw->total_bytes; }

void mk_weights_set_progress(mk_weights *mw, mk_progress_fn fn, void *user) {
    mw->progress = fn;
    mw->progress_user = user;
}

void mk_weights_free(mk_weights *mw) {
    if (mw == NULL) return;
    free(mw->fills);
    free(mw);
}
