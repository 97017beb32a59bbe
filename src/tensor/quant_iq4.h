/* quant_iq4.h - the two 4-bit non-linear formats IQ4_NL and IQ4_XS (internal
 * to src/tensor; quant.c routes its public entry points here).
 *
 * Contract:
 *  - Both formats store 4-bit indices into one fixed 16-entry int8 table
 *    (quant_iq4_values, -127..113, denser near zero). IQ4_NL: 32-element
 *    blocks with one fp16 scale, dots against Q8_0. IQ4_XS: 256-element
 *    super-blocks with an fp16 scale d and eight 6-bit sub-block scales
 *    ls (value = d * (ls - 32) * table[q]), dots against Q8_K. Within each
 *    32 elements the nibble order is Q4_0's (byte j: elements j and j+16).
 *  - Dots follow quant.h's determinism model: IQ4_NL folds one integer per
 *    32-block (quant_fold with the two block scales), IQ4_XS folds one per
 *    super-block, sum over sub-blocks of (ls - 32) * integer dot, with d and
 *    the Q8_K scale. Every ISA computes the same integers, so dots and tiles
 *    agree bit for bit with the scalar kernels.
 *  - The quantizer searches each 32-element scale the way ggml's reference
 *    quantizer does without an importance matrix (weights x^2, 15 trial
 *    scales around the extreme value), so ember's files are of llama.cpp's
 *    quality and load there with the same values. */
#ifndef EMBER_TENSOR_QUANT_IQ4_H
#define EMBER_TENSOR_QUANT_IQ4_H

#include <stddef.h>
#include <stdint.h>

#include "tensor/quant.h"

typedef struct { uint16_t d; uint8_t qs[16]; } block_iq4_nl; /* 18 B */
typedef struct {
    uint16_t d;          /* fp16 super-scale */
    uint16_t scales_h;   /* bits 2i, 2i+1: high 2 bits of sub-block i's scale */
    uint8_t scales_l[4]; /* sub-block 2k in the low nibble of byte k, 2k+1 in the high */
    uint8_t qs[128];     /* sub-block i: bytes 16i..16i+15, Q4_0 nibble order */
} block_iq4_xs;          /* 136 B */

/* The non-linear table shared by both formats. */
extern const int8_t quant_iq4_values[16];

/* Sub-block i's 6-bit scale of an IQ4_XS block, minus its offset 32 (-32..31). */
static inline int quant_iq4_xs_scale(const block_iq4_xs *b, int i) {
    int low = (b->scales_l[i / 2] >> (4 * (i % 2))) & 15;
    int high = (b->scales_h >> (2 * i)) & 3;
    return (low | (high << 4)) - 32;
}

/* quant.c hands these types over (n a multiple of the block). */
void quant_iq4_dequantize(ember_dtype type, const void *src, float *dst, int64_t n);
void quant_iq4_quantize(ember_dtype type, const float *src, void *dst, int64_t n);

/* Kernel tables: each fills its entries for DT_IQ4_NL and DT_IQ4_XS. The
 * AVX-512 tiles are registered only for the 4 x 4 shape they are built for. */
void quant_iq4_scalar_kernels(quant_dot_fn dots[DT_COUNT]);
void quant_iq4_avx2_kernels(quant_dot_fn dots[DT_COUNT], quant_strip_fn strips[DT_COUNT][QUANT_STRIP_TOKENS + 1],
                            int heights[DT_COUNT][QUANT_STRIP_TOKENS + 1]);
void quant_iq4_avx512_kernels(quant_dot_fn dots[DT_COUNT], quant_tile_fn tiles[DT_COUNT],
                              int tile_rows, int tile_cols);

/* Row panels for matmul_avx512.c (16 rows; see its header comment).
 * IQ4_NL packs into the Q8_0 panel layout (IQ4_NL_PANEL_BLOCK bytes per
 * block) and runs on the Q8_0 panel kernel; IQ4_XS has its own panel:
 * quant_iq4_xs_panels computes rows [o0, o1) rounded down to whole panels,
 * bit-identical to quant_vec_dot. */
enum { IQ4_NL_PANEL_BLOCK = 8 * 64 + 64 };
void quant_iq4_nl_pack_panel(const uint8_t *w, size_t wrb, int64_t nb, uint8_t *pk);
size_t quant_iq4_xs_panel_bytes(int64_t n_in);
void quant_iq4_xs_panels(const uint8_t *w, size_t wrb, int64_t n_in, int64_t o0, int64_t o1, const uint8_t *act,
                         size_t as, int64_t n_tokens, float *y, int64_t n_out, uint8_t *pk);

#endif
