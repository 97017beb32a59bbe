/* quant_strip_table.h - one macro for the ISA files' strip tables, internal
 * to src/tensor (quant_avx2_strip.h, quant_avx512.c).
 *
 * Contract: QUANT_STRIPS_OF(NAME, H, FN) instantiates FN(NAME, H, C), a
 * quant_strip_fn named strip_NAME_C, for chunks of C = 1..QUANT_STRIP_TOKENS
 * tokens, and defines set_strips_NAME(fns, heights), which fills one type's
 * row of quant.c's strip table: fns[C] = strip_NAME_C, heights[C] = H(C),
 * the weight rows a strip of C tokens computes. The macro holds no ISA code,
 * so both ISAs' files share it. */
#ifndef EMBER_TENSOR_QUANT_STRIP_TABLE_H
#define EMBER_TENSOR_QUANT_STRIP_TABLE_H

#include "tensor/quant.h"

#define QUANT_STRIPS_OF(NAME, H, FN)                                                               \
    FN(NAME, H, 1) FN(NAME, H, 2) FN(NAME, H, 3) FN(NAME, H, 4)                                    \
    FN(NAME, H, 5) FN(NAME, H, 6) FN(NAME, H, 7) FN(NAME, H, 8)                                    \
    static void set_strips_##NAME(quant_strip_fn *fns, int *heights) {                             \
        const quant_strip_fn f[QUANT_STRIP_TOKENS] = {strip_##NAME##_1, strip_##NAME##_2, strip_##NAME##_3, \
                                                      strip_##NAME##_4, strip_##NAME##_5, strip_##NAME##_6, \
                                                      strip_##NAME##_7, strip_##NAME##_8};         \
        for (int c = 1; c <= QUANT_STRIP_TOKENS; c++) {                                            \
            fns[c] = f[c - 1];                                                                     \
            heights[c] = H(c);                                                                     \
        }                                                                                          \
    }

#endif
