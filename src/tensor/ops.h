/* ops.h - the small per-row operations of a transformer forward pass.
 *
 * Contract: every function works on one row (or one token's heads) and its
 * result depends only on that row's inputs, never on batch size or thread
 * count, so a forward pass built from them is batch-invariant. Reductions
 * run in a fixed order. Plain C loops: these are a few percent of the work
 * next to the matrix products. */
#ifndef EMBER_TENSOR_OPS_H
#define EMBER_TENSOR_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "tensor/kv_rows.h"

typedef enum rope_mode {
    ROPE_NORM = 0, /* adjacent pairs (x[2i], x[2i+1]): llama */
    ROPE_NEOX = 1, /* halves (x[i], x[i + n_rot/2]): qwen, gemma */
} rope_mode;

/* Rotary embedding parameters for one model (or one layer kind). */
typedef struct rope_params {
    rope_mode mode;
    int n_rot;              /* rotated dims per head (<= head dim) */
    float freq_base;
    float freq_scale;       /* 1 / linear or YaRN scaling factor */
    float ext_factor;       /* YaRN: 0 disables the ramp */
    float attn_factor;      /* multiplies cos and sin */
    float beta_fast, beta_slow;
    int n_ctx_orig;         /* YaRN original context */
    const float *freq_factors; /* (n_rot/2) optional divisors (rope_freqs.weight) or NULL */
} rope_params;

/* y = x / sqrt(mean(x^2) + eps) * w ; w may be NULL (no scale). y may alias x. */
void op_rmsnorm(float *y, const float *x, const float *w, int n, float eps);
/* Rotates each of n_heads heads (head_dim apart) of x in place for position pos. */
void op_rope(float *x, int n_heads, int head_dim, int64_t pos, const rope_params *rp);
/* In-place softmax over n values. */
void op_softmax(float *x, int n);
/* y[i] = silu(gate[i]) * up[i]. */
void op_swiglu(float *y, const float *gate, const float *up, int n);
/* x += y */
void op_add(float *x, const float *y, int n);

/* The precision of attention's products. ATTENTION_F32 (the default):
 * f32 products and sums. ATTENTION_BF16 (opt-in): the query, K and V rows
 * and the softmax weights rounded to bf16 (round to nearest even) and
 * multiplied on vdpbf16ps, sums and softmax in f32: about twice the
 * product rate, at an accuracy cost docs/attention.md measures.
 * ATTENTION_INT8 (opt-in): the bf16 kernel's online softmax with both
 * products on int8 (vpdpbusd, twice vdpbf16ps' products): the query and
 * each key and value head quantized to signed bytes with one step per head
 * (max |x| / 127, round to nearest even); q.k exact in int32 times the two
 * steps; per block of 64 keys each weight times its value's step becomes a
 * byte on one step per query and block (max / 255), and the weighted
 * values are exact int32 sums times that step. All keep batch invariance;
 * the KV a model writes differs between them, so caches keep them apart
 * (kv_pool_attention). */
typedef enum attention_precision {
    ATTENTION_F32 = 0,
    ATTENTION_BF16 = 1,
    ATTENTION_INT8 = 2,
} attention_precision;

/* The arithmetic of the bf16 kernel, numbered: a cache written under one
 * version holds rows another version would not compute (each layer's K/V
 * come from the previous layer's attention), so the version enters the
 * cache namespaces of bf16 pools (apc_disk_namespace). 2: scores in log2
 * units with scale * log2(e) folded into the query, weights 2^(s - m) by a
 * degree-4 polynomial, m moved only when a score passes it by 8. */
enum { ATTENTION_BF16_VERSION = 2 };
/* The same for ATTENTION_INT8 (its softmax follows the bf16 version too,
 * which enters its namespaces beside this one). 1: the arithmetic above. */
enum { ATTENTION_INT8_VERSION = 1 };

/* The precision attention runs at when `want` is asked for heads of
 * (d_k, d_v) values: bf16 or int8 only where the ISA in use is AVX-512
 * (with VNNI) and the CPU has AVX512_BF16, and for heads of 64 or 128
 * values (d_k = d_v); else f32. Callers decide once per model and pass the
 * result to every call. */
attention_precision op_attention_precision(attention_precision want, int d_k, int d_v);
/* Why op_attention_precision(want, d_k, d_v) is f32 when want is bf16 or
 * int8 (a static string), or NULL when it is not. */
const char *op_attention_precision_fallback(attention_precision want, int d_k, int d_v);
/* "f32" / "bf16" / "int8", and back (false for anything else). */
const char *attention_precision_name(attention_precision p);
bool attention_precision_parse(const char *s, attention_precision *out);

/* The widest head (d_k, d_v) attention reads from f16, q8_0 or q12h rows:
 * they are decoded into stack buffers of this many floats. */
#define ATTENTION_MAX_HEAD 512

/* Causal attention of one query token over keys at positions [0, n_keys)
 * that live in 16-token blocks: key j is row j % 16 of k_blocks[j / 16],
 * V rows stored as `type` and K rows as kv_row_key_type(type) (kv_rows.h:
 * kv_row_bytes(type, width) bytes each), read in those formats (attention
 * on an encoded cache equals attention on its decoded values with the
 * query in their domain, kv_row_query, bit for bit: q8_0 pools keep K
 * rotated in q12h, and the query is rotated here).
 * q: (n_head, d_k); out: (n_head, d_v); K rows are (n_head_kv, d_k) wide,
 * V rows (n_head_kv, d_v). Query head h reads KV head h / (n_head/n_head_kv).
 * window > 0 masks keys with pos - key >= window (sliding window).
 * Only query heads [head_begin, head_end) are computed, so callers can
 * spread one token's heads over threads. scratch: n_keys floats. */
void op_attention_paged(float *out, const float *q, const void *const *k_blocks, const void *const *v_blocks,
                        kv_row_type type, int64_t n_keys, int64_t query_pos, int n_head, int n_head_kv, int d_k,
                        int d_v, float scale, int64_t window, int head_begin, int head_end, float *scratch);
/* op_attention_paged for n_rows query tokens of one sequence at once: row r
 * has q at q + r * q_stride, out at out + r * out_stride, position
 * query_pos[r] (keys [0, query_pos[r] + 1)). Each (row, head) gives the same
 * bits as op_attention_paged; heads that share a kv head and the rows are
 * computed together so each key and value row is loaded once for all of them.
 * scratch: n_rows * (head_end - head_begin) * (max query_pos + 1) floats;
 * the bf16 kernel takes up to 256 (row, head) pairs per call. */
void op_attention_paged_rows(float *out, size_t out_stride, const float *q, size_t q_stride,
                             const void *const *k_blocks, const void *const *v_blocks, kv_row_type type,
                             const int64_t *query_pos,
                             int n_rows, int n_head, int n_head_kv, int d_k, int d_v, float scale,
                             int64_t window, int head_begin, int head_end, float *scratch);
/* The bf16 kernel's K/V tiles (K transposed into key lanes, V into pairs
 * of keys, bf16; at int8 bytes, V in quads of keys), built once for a long
 * prefill instead of once per
 * call: a 16k-key prefill chunk makes 4 calls per kv head, each of which
 * would rebuild and reread every tile. kv head h's tiles lie at base + h *
 * head_bytes and cover keys [0, n_keys). A call given tiles computes the
 * same bits as without (op_attention_paged_rows_prec): it uses them where
 * the window starts at key 0 and its keys are covered, else builds its own. */
typedef struct attention_bf16_tiles {
    const void *base;
    size_t head_bytes;
    int64_t n_keys;
} attention_bf16_tiles;

/* op_attention_paged_rows at a precision (an op_attention_precision
 * result; ATTENTION_F32 is op_attention_paged_rows itself). At bf16 and
 * int8 the softmax runs online, block by block, and scratch is not used
 * (may be NULL); tiles (bf16 and int8 only, may be NULL) are prebuilt
 * tiles of these blocks at that precision. */
void op_attention_paged_rows_prec(float *out, size_t out_stride, const float *q, size_t q_stride,
                                  const void *const *k_blocks, const void *const *v_blocks, kv_row_type type,
                                  const int64_t *query_pos, int n_rows, int n_head, int n_head_kv, int d_k, int d_v,
                                  float scale, int64_t window, int head_begin, int head_end, float *scratch,
                                  attention_precision prec, const attention_bf16_tiles *tiles);
/* Bytes of one kv head's tiles at precision prec (bf16 or int8) for keys
 * [0, n_keys) (64-key blocks). */
size_t op_attention_bf16_tiles_bytes(attention_precision prec, int64_t n_keys, int d);
/* Builds kv head kv_head's tiles at precision prec of 64-key blocks
 * [block_begin, block_end) for keys [0, n_keys) into head_tiles (that
 * head's op_attention_bf16_tiles_bytes(prec, n_keys, d) bytes; rows of the
 * blocks given as to op_attention_paged_rows). Blocks are independent, so
 * threads may build disjoint ranges. False (nothing built) where attention
 * cannot run at prec for heads of d values (op_attention_precision). */
bool op_attention_bf16_tiles_build(attention_precision prec, void *head_tiles, const void *const *k_blocks,
                                   const void *const *v_blocks,
                                   kv_row_type type, int n_head_kv, int d, int kv_head, int64_t n_keys,
                                   int64_t block_begin, int64_t block_end);

#endif
