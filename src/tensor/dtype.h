/* dtype.h - the element types a tensor can have, with GGUF's (ggml's) ids.
 *
 * Contract: the numeric values are the ids stored in GGUF tensor infos, so a
 * file's type field converts directly. A quantized type packs `block_elems`
 * elements into `block_bytes` bytes; a row of n elements (n a multiple of
 * block_elems) takes n / block_elems * block_bytes bytes. dtype_info returns
 * NULL for ids ember cannot compute with (retired formats, IQ formats other
 * than IQ4_NL / IQ4_XS). */
#ifndef EMBER_TENSOR_DTYPE_H
#define EMBER_TENSOR_DTYPE_H

#include <stddef.h>
#include <stdint.h>

typedef enum ember_dtype {
    DT_F32 = 0,
    DT_F16 = 1,
    DT_Q4_0 = 2,
    DT_Q4_1 = 3,
    DT_Q5_0 = 6,
    DT_Q5_1 = 7,
    DT_Q8_0 = 8,
    DT_Q8_1 = 9,
    DT_Q2_K = 10,
    DT_Q3_K = 11,
    DT_Q4_K = 12,
    DT_Q5_K = 13,
    DT_Q6_K = 14,
    DT_Q8_K = 15,
    DT_IQ4_NL = 20,
    DT_IQ4_XS = 23,
    DT_BF16 = 30,
    DT_COUNT = 31,
} ember_dtype;

typedef struct dtype_info {
    const char *name;    /* as ggml prints it: "f32", "q4_K", ... */
    int block_elems;     /* elements per block (1 for plain floats) */
    int block_bytes;     /* bytes per block */
    ember_dtype dot_act; /* format the activations are quantized to for dots */
} dtype_info;

/* Table lookup. NULL when the id is unknown or unsupported. */
const dtype_info *dtype_info_of(uint32_t type_id);
/* Bytes of one row of n elements; 0 if n is not a multiple of the block. */
size_t dtype_row_bytes(ember_dtype type, int64_t n);
/* Parses "q8_0", "Q4_K", "f16", ... (case-insensitive); -1 if unknown. */
int dtype_from_name(const char *name);

#endif
