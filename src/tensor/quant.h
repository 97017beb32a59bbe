/* quant.h - quantized formats: conversion to and from f32, and dot products.
 *
 * Contract:
 *  - quant_dequantize_row / quant_quantize_row convert n elements (a multiple
 *    of the type's block) between f32 and a storage type. Quantizers exist for
 *    every weight type in dtype.h and for the activation formats Q8_0, Q8_1
 *    and Q8_K; they follow the reference rounding of ggml so files written by
 *    ember load in llama.cpp with the same values.
 *  - quant_vec_dot(type, n, w, a) is the dot product of one weight row of
 *    `type` with one activation row already converted to quant_dot_act(type):
 *    dtype_info_of(type)->dot_act (f32 for f32/f16/bf16 weights), except BF16
 *    weights on AVX-512 CPUs with AVX512_BF16, whose activations are rounded
 *    to BF16 for vdpbf16ps (bf16_avx512bf16.c). Integer products inside a
 *    block, f32 accumulation across blocks.
 *  - The instruction set is chosen once, at first use, from cpuid (AVX-512
 *    with VNNI, else AVX2, else scalar); quant_set_isa forces one, for tests
 *    that compare each SIMD path with the scalar reference. For a fixed ISA
 *    results are deterministic and do not depend on how many rows are
 *    computed together (matmul.h relies on this for batch invariance). */
#ifndef EMBER_TENSOR_QUANT_H
#define EMBER_TENSOR_QUANT_H

#include <stdbool.h>
#include <stdint.h>

#include "tensor/dtype.h"

typedef enum quant_isa {
    QUANT_ISA_SCALAR = 0,
    QUANT_ISA_AVX2 = 1,
    QUANT_ISA_AVX512 = 2, /* AVX-512 F/BW/VL, with VNNI dots where present */
} quant_isa;

/* Conversion. quantize returns -1 for a type without a quantizer. */
void quant_dequantize_row(ember_dtype type, const void *src, float *dst, int64_t n);
int quant_quantize_row(ember_dtype type, const float *src, void *dst, int64_t n);

/* Dot products with the current ISA. */
float quant_vec_dot(ember_dtype type, int64_t n, const void *w_row, const void *act_row);

/* Instruction-set selection. */
quant_isa quant_best_isa(void);            /* what this CPU supports */
quant_isa quant_get_isa(void);             /* what is in use */
bool quant_set_isa(quant_isa isa);         /* false if the CPU lacks it */
const char *quant_isa_name(quant_isa isa);
/* "scalar", "avx2", "avx512" (or quant_isa_name's "avx512-vnni") into *isa;
 * false for any other name. */
bool quant_isa_parse(const char *name, quant_isa *isa);
/* The activation format the dot of `type` takes with the ISA in use. */
ember_dtype quant_dot_act(ember_dtype type);
/* BF16 weights on vdpbf16ps when the ISA in use is AVX-512: on by default
 * where the CPU has AVX512_BF16; off gives the exact f32 kernels other CPUs
 * use (tests cover both). false if the CPU lacks it. */
bool quant_set_avx512_bf16(bool on);
bool quant_avx512_bf16_in_use(void);
/* Whether the CPU has AVX512_BF16 at all (also for bf16 attention, which
 * quant_set_avx512_bf16 does not switch). */
bool quant_cpu_has_avx512_bf16(void);

/* fp16 / bf16 scalars (IEEE binary16 round-to-nearest-even; bf16 = top half of f32). */
float quant_f16_to_f32(uint16_t h);
uint16_t quant_f32_to_f16(float f);
/* n values at once, the same bits as quant_f32_to_f16 on each (F16C's
 * vcvtps2ph rounds to nearest even too) where the ISA in use has it. */
void quant_f32_to_f16_row(const float *src, uint16_t *dst, int64_t n);
float quant_bf16_to_f32(uint16_t h);
uint16_t quant_f32_to_bf16(float f);

/* ------------------------------------------------------------------------
 * Internal to src/tensor (quant*.c, matmul*.c): block layouts, the float
 * accumulation formulas every ISA shares, and the kernel tables.
 *
 * Determinism model: inside a block every ISA computes the exact integer
 * dot (integer sums do not depend on order), then folds it into the f32
 * accumulator with the one formula below (explicit fmaf, so no compiler
 * contraction choice can differ). Blocks are folded in order. Hence a dot
 * gives the same bits on every ISA and in every kernel shape (GEMV, tiles).
 * ------------------------------------------------------------------------ */
#include <stddef.h>

/* 32-element legacy blocks. d, m, s are fp16 bits. Elements j and j+16 share
 * byte qs[j] (low nibble, high nibble). */
typedef struct { uint16_t d; uint8_t qs[16]; } block_q4_0;                   /* 18 B */
typedef struct { uint16_t d, m; uint8_t qs[16]; } block_q4_1;                /* 20 B */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } block_q5_0;    /* 22 B: qh bit i = bit 4 of element i */
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } block_q5_1; /* 24 B */
typedef struct { uint16_t d; int8_t qs[32]; } block_q8_0;                    /* 34 B */
typedef struct { uint16_t d, s; int8_t qs[32]; } block_q8_1;                 /* 36 B: s = d * sum(qs) */

/* 256-element K-quant super-blocks (layouts: engine-reference.md B.3). */
typedef struct {
    uint8_t scales[16]; /* per 16-element sub-block: low nibble scale, high nibble min */
    uint8_t qs[64];     /* 2-bit values, 4 per byte (element 32s+l of a half in bits 2s) */
    uint16_t d, dmin;   /* fp16 super-scales */
} block_q2_K;           /* 84 B */
typedef struct {
    uint8_t hmask[32];  /* high bit of each 3-bit value (set = no -4 offset) */
    uint8_t qs[64];     /* low 2 bits, as in Q2_K */
    uint8_t scales[12]; /* sixteen 6-bit signed scales (offset 32), packed */
    uint16_t d;
} block_q3_K;           /* 110 B */
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12]; /* eight 6-bit (scale, min) pairs, packed */
    uint8_t qs[128];    /* group g: low nibbles = sub-block 2g, high = 2g+1 */
} block_q4_K;           /* 144 B */
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[32];     /* fifth bit: element 64g+l bit 2g, 64g+32+l bit 2g+1 of qh[l] */
    uint8_t qs[128];
} block_q5_K;           /* 176 B */
typedef struct {
    uint8_t ql[128];    /* low 4 bits */
    uint8_t qh[64];     /* high 2 bits */
    int8_t scales[16];  /* per 16-element sub-block */
    uint16_t d;
} block_q6_K;           /* 210 B */
typedef struct {
    float d;            /* may be negative (scale from the signed max) */
    int8_t qs[256];
    int16_t bsums[16];  /* sum of each run of 16 qs */
} block_q8_K;           /* 292 B */

/* The shared fold of one block's integer dot into the accumulator. */
static inline float quant_fold(float acc, int32_t isum, float dw, float da) {
    return __builtin_fmaf((float)isum, dw * da, acc);
}
/* Blocks with an additive min term whose integer part is `msum` (K-quants). */
static inline float quant_fold_min(float acc, int32_t isum, int32_t msum, float dw, float dminw,
                                   float da) {
    acc = __builtin_fmaf((float)isum, dw * da, acc);
    return __builtin_fmaf(-(float)msum, dminw * da, acc);
}
/* Q4_1/Q5_1 x Q8_1: the min times the activation block sum s. */
static inline float quant_fold_q8_1(float acc, int32_t isum, float dw, float mw, float da,
                                    float sa) {
    acc = __builtin_fmaf((float)isum, dw * da, acc);
    return __builtin_fmaf(mw, sa, acc);
}

/* K-quant 6-bit (scale, min) of sub-block j (Q4_K, Q5_K). */
static inline void quant_k4_scale_min(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 15) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}
/* Q3_K signed scale of sub-block i (-32..31). */
static inline int quant_q3k_scale(int i, const uint8_t *s) {
    int low = i < 8 ? (s[i] & 15) : (s[i - 8] >> 4);
    int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (low | (high << 4)) - 32;
}

typedef float (*quant_dot_fn)(int64_t n, const void *w_row, const void *act_row);
/* A tile computes y[c * y_stride + r] = quant_vec_dot(type, n, w + r*w_stride,
 * a + c*a_stride) for r < rows, c < cols, bit for bit. */
typedef void (*quant_tile_fn)(int64_t n, const void *w, size_t w_stride, const void *a,
                              size_t a_stride, float *y, size_t y_stride);

/* A small-batch strip computes y[c * y_stride + r] = quant_vec_dot(type, n,
 * w + r*w_stride, a + c*a_stride) for r < rows (at most the strip's height),
 * c < its token count, bit for bit, loading each weight block once for all
 * tokens (matmul.c uses strips for batches of 1..QUANT_STRIP_TOKENS, and
 * in chunks for larger ones where the ISA has no tiles). meta:
 * for weights dotted with Q8_0 activations, per token (2 * n/32 int32 each,
 * tokens contiguous) and block {-128 * sum(qs), f32 bits of d}, as
 * matmul_avx512_panels takes it; other types ignore it. */
enum { QUANT_STRIP_TOKENS = 8 };
typedef void (*quant_strip_fn)(int64_t n, const void *w, size_t w_stride, int rows, const void *a,
                               size_t a_stride, const int32_t *meta, float *y, size_t y_stride);

/* The dot kernel of the ISA in use (never NULL for a type with a dot). */
quant_dot_fn quant_dot_kernel(ember_dtype type);
/* The register-blocked tile of the ISA in use, or NULL; *rows x *cols is its shape. */
quant_tile_fn quant_tile_kernel(ember_dtype type, int *rows, int *cols);

/* The strip of the ISA in use for n_tokens (1..QUANT_STRIP_TOKENS), or NULL;
 * *rows is its height. */
quant_strip_fn quant_strip_kernel(ember_dtype type, int n_tokens, int *rows);

/* Per-ISA tables (NULL entries fall back to the scalar kernel). */
void quant_avx2_kernels(quant_dot_fn dots[DT_COUNT]);
void quant_avx2_f32_to_f16_row(const float *src, uint16_t *dst, int64_t n); /* F16C */
void quant_avx512_kernels(quant_dot_fn dots[DT_COUNT], quant_tile_fn tiles[DT_COUNT],
                          int *tile_rows, int *tile_cols);
void quant_avx2_strips(quant_strip_fn strips[DT_COUNT][QUANT_STRIP_TOKENS + 1],
                       int heights[DT_COUNT][QUANT_STRIP_TOKENS + 1]);
void quant_avx512_strips(quant_strip_fn strips[DT_COUNT][QUANT_STRIP_TOKENS + 1],
                         int heights[DT_COUNT][QUANT_STRIP_TOKENS + 1]);

/* AVX-512 activation quantizers, byte-identical to the scalar ones
 * (quant_quantize_row uses them when the ISA in use is AVX-512). */
void quant_avx512_q8_0(const float *x, void *dst, int64_t nb);
void quant_avx512_q8_K(const float *x, void *dst, int64_t nb);
/* AVX-512 f32 -> BF16 rounding, byte-identical to quant_f32_to_bf16. */
void quant_avx512_bf16(const float *x, void *dst, int64_t n);

/* bf16_avx512bf16.c (AVX512_BF16): BF16 weights with BF16 activations; the
 * kernels fill the TABLE_AVX512_BF16 entries for DT_BF16 (acts: DT_BF16),
 * the panels work as matmul_avx512_panels does for the other types. */
void quant_avx512bf16_kernels(quant_dot_fn dots[DT_COUNT], quant_tile_fn tiles[DT_COUNT],
                              quant_strip_fn strips[DT_COUNT][QUANT_STRIP_TOKENS + 1],
                              int heights[DT_COUNT][QUANT_STRIP_TOKENS + 1], ember_dtype acts[DT_COUNT]);
size_t matmul_bf16dp_panel_bytes(int64_t n_in);
void matmul_bf16dp_panels(const uint8_t *w, size_t wrb, int64_t n_in, int64_t o0, int64_t o1, const uint8_t *act,
                          size_t as, int64_t n_tokens, float *y, int64_t n_out, uint8_t *pk);

/* matmul_avx512.c: 16-row panel GEMM (AVX-512 VNNI) for Q8_0, Q4_K, Q6_K, IQ4_NL, IQ4_XS,
 * and (AVX-512F) for F32, F16 and BF16 weights, whose act is x itself (f32),
 * or for BF16 the BF16 rows of matmul_bf16dp_panels (quant_dot_act).
 * panel_bytes: scratch one thread needs for a packed panel (0: type not
 * handled). panels computes rows [o0, o1) rounded down to whole panels of 16
 * (the caller does the rest) for all n_tokens, bit-identical to
 * quant_vec_dot. act: converted activations, `as` bytes per token; meta (Q8_0
 * and IQ4_NL only): per token and block {-128 * sum(qs), f32 scale bits}; pk: the
 * panel scratch, 64-byte aligned. */
size_t matmul_avx512_panel_bytes(ember_dtype type, int64_t n_in);
void matmul_avx512_panels(ember_dtype type, const uint8_t *w, size_t wrb, int64_t n_in, int64_t o0,
                          int64_t o1, const uint8_t *act, size_t as, const int32_t *meta,
                          int64_t n_tokens, float *y, int64_t n_out, uint8_t *pk);

#endif
