/* dtype.c - the table of element types (see dtype.h). Block sizes and the
 * activation format paired with each weight format follow GGUF/ggml. */
#include "tensor/dtype.h"

#include <strings.h>

static const dtype_info dtype_table[DT_COUNT] = {
    [DT_F32] = {"f32", 1, 4, DT_F32},
    [DT_F16] = {"f16", 1, 2, DT_F32},
    [DT_BF16] = {"bf16", 1, 2, DT_F32},
    [DT_Q4_0] = {"q4_0", 32, 18, DT_Q8_0},
    [DT_Q4_1] = {"q4_1", 32, 20, DT_Q8_1},
    [DT_Q5_0] = {"q5_0", 32, 22, DT_Q8_0},
    [DT_Q5_1] = {"q5_1", 32, 24, DT_Q8_1},
    [DT_Q8_0] = {"q8_0", 32, 34, DT_Q8_0},
    [DT_Q8_1] = {"q8_1", 32, 36, DT_Q8_1},
    [DT_Q2_K] = {"q2_K", 256, 84, DT_Q8_K},
    [DT_Q3_K] = {"q3_K", 256, 110, DT_Q8_K},
    [DT_Q4_K] = {"q4_K", 256, 144, DT_Q8_K},
    [DT_Q5_K] = {"q5_K", 256, 176, DT_Q8_K},
    [DT_Q6_K] = {"q6_K", 256, 210, DT_Q8_K},
    [DT_Q8_K] = {"q8_K", 256, 292, DT_Q8_K},
    [DT_IQ4_NL] = {"iq4_nl", 32, 18, DT_Q8_0},
    [DT_IQ4_XS] = {"iq4_xs", 256, 136, DT_Q8_K},
};

const dtype_info *dtype_info_of(uint32_t type_id) {
    if (type_id >= DT_COUNT) return NULL;
    const dtype_info *info = &dtype_table[type_id];
    return info->name ? info : NULL;
}

size_t dtype_row_bytes(ember_dtype type, int64_t n) {
    const dtype_info *info = dtype_info_of((uint32_t)type);
    if (info == NULL || n < 0 || n % info->block_elems != 0) return 0;
    return (size_t)(n / info->block_elems) * (size_t)info->block_bytes;
}

int dtype_from_name(const char *name) {
    for (int i = 0; i < DT_COUNT; i++)
        if (dtype_table[i].name && strcasecmp(dtype_table[i].name, name) == 0) return i;
    return -1;
}
