/* quant.h - quantized formats: conversion to and from f32, and dot products.
 *
 * Contract:
 *  - quant_dequantize_row / quant_quantize_row convert n elements (a multiple
 *    of the type's block) between f32 and a storage type. Quantizers exist for
 *    every weight type in dtype.h and for the activation formats Q8_0, Q8_1
 *    and Q8_K; they follow the reference rounding of ggml so files written by
 *    ember load in llama.cpp with the same values.
 *  - quant_vec_dot(type, n, w, a) is the dot product of one weight row of
 *    `type` with one activation row already converted to
 *    dtype_info_of(type)->dot_act (f32 for f32/f16/bf16 weights). Integer
 *    products inside a block, f32 accumulation across blocks.
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

/* fp16 / bf16 scalars (IEEE binary16 round-to-nearest-even; bf16 = top half of f32). */
float quant_f16_to_f32(uint16_t h);
uint16_t quant_f32_to_f16(float f);
float quant_bf16_to_f32(uint16_t h);
uint16_t quant_f32_to_bf16(float f);

#endif
