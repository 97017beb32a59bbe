/* matmul.h - weight matrix times activations, the engine's hot loop.
 *
 * Contract: y[t][o] = dot(W row o, x[t]) for t < n_tokens, o < n_out, where W
 * is stored as n_out rows of n_in elements of W->type (ggml's {n_in, n_out}).
 * The activations are converted once per call to the weight type's dot
 * format. Work is split over output features only, and every y[t][o] is the
 * same bits as quant_vec_dot(W->type, n_in, row o, converted x[t]): results
 * never depend on n_tokens, on which other tokens share the batch, or on the
 * number of threads (design.md, invariant 1). Batches of up to 8 tokens
 * (decode, speculative verification; up to 16 for some types) stream the
 * weights once through small-batch strips; larger ones use tiled or panel
 * kernels that reuse each weight block across many tokens. */
#ifndef EMBER_TENSOR_MATMUL_H
#define EMBER_TENSOR_MATMUL_H

#include <stddef.h>
#include <stdint.h>

#include "core/threadpool.h"
#include "tensor/dtype.h"

typedef struct tensor_weight {
    ember_dtype type;
    int64_t n_in;       /* elements per row (ne0) */
    int64_t n_out;      /* rows (ne1) */
    size_t row_bytes;   /* bytes per row */
    const void *data;   /* (n_out, row_bytes), usually in the mmapped file */
} tensor_weight;

/* Scratch space reused across calls so the hot path never allocates. */
typedef struct matmul_scratch matmul_scratch;
matmul_scratch *matmul_scratch_create(void);
void matmul_scratch_free(matmul_scratch *s);

/* y: (n_tokens, n_out) row-major; x: (n_tokens, n_in) row-major.
 * Returns -1 only if scratch memory cannot be allocated. */
int tensor_matmul(ember_pool *pool, matmul_scratch *scratch, const tensor_weight *w,
                  const float *x, int64_t n_tokens, float *y);

/* tensor_matmul of n_w weights over the same x (ys[k] = x ws[k]), the same
 * bits; weights of one type and width whose batch takes the strip or tile
 * kernels (decode, small batches) run as one task, one barrier for all
 * (q/k/v, gate/up); others go one call each. */
enum { TENSOR_MATMUL_GROUP_MAX = 4 };
int tensor_matmul_group(ember_pool *pool, matmul_scratch *scratch, const tensor_weight *const *ws, int n_w,
                        const float *x, int64_t n_tokens, float *const *ys);

#endif
