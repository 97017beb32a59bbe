/* kv_rows.c - encoding and decoding of KV rows (see kv_rows.h).
 *
 * q8_0 reuses the weight quantizer (quant_quantize_row), so a KV row holds
 * exactly what a Q8_0 tensor row of the same values would; the fp16 scale is
 * what the decoder multiplies by, not the f32 amax/127 it came from. The
 * scalar decoder here is the reference; the AVX-512 attention kernel decodes
 * the same way with vector instructions (exact conversions, one product). */
#include "tensor/kv_rows.h"

#include <string.h>

#include "tensor/quant.h"

bool kv_row_supported(kv_row_type type, int width) {
    if (width < 0) return false;
    switch (type) {
    case KV_ROW_F32:
    case KV_ROW_F16: return true;
    case KV_ROW_Q8_0: return width % KV_ROW_Q8_0_BLOCK == 0;
    }
    return false;
}

size_t kv_row_bytes(kv_row_type type, int width) {
    size_t raw = 0;
    switch (type) {
    case KV_ROW_F32: raw = (size_t)width * 4; break;
    case KV_ROW_F16: raw = (size_t)width * 2; break;
    case KV_ROW_Q8_0: raw = (size_t)(width / KV_ROW_Q8_0_BLOCK) * sizeof(block_q8_0); break;
    }
    return (raw + 3) & ~(size_t)3;
}

const char *kv_row_type_name(kv_row_type type) {
    switch (type) {
    case KV_ROW_F32: return "f32";
    case KV_ROW_F16: return "f16";
    case KV_ROW_Q8_0: return "q8_0";
    }
    return "?";
}

void kv_row_encode(kv_row_type type, const float *src, void *dst, int width) {
    size_t bytes = kv_row_bytes(type, width);
    switch (type) {
    case KV_ROW_F32: memcpy(dst, src, (size_t)width * sizeof(float)); return;
    case KV_ROW_F16: {
        uint8_t *p = dst;
        for (int i = 0; i < width; i++) {
            uint16_t h = quant_f32_to_f16(src[i]);
            memcpy(p + 2 * (size_t)i, &h, 2);
        }
        if ((size_t)width * 2 < bytes) memset(p + (size_t)width * 2, 0, bytes - (size_t)width * 2);
        return;
    }
    case KV_ROW_Q8_0: {
        size_t raw = (size_t)(width / KV_ROW_Q8_0_BLOCK) * sizeof(block_q8_0);
        quant_quantize_row(DT_Q8_0, src, dst, width);
        if (raw < bytes) memset((uint8_t *)dst + raw, 0, bytes - raw);
        return;
    }
    }
}

void kv_row_decode(kv_row_type type, const void *row, int offset, int n, float *dst) {
    const uint8_t *p = row;
    switch (type) {
    case KV_ROW_F32: memcpy(dst, p + 4 * (size_t)offset, (size_t)n * sizeof(float)); return;
    case KV_ROW_F16:
        for (int i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * (size_t)(offset + i), 2);
            dst[i] = quant_f16_to_f32(h);
        }
        return;
    case KV_ROW_Q8_0:
        for (int i = 0; i < n; i++) {
            int e = offset + i;
            const uint8_t *b = p + (size_t)(e / KV_ROW_Q8_0_BLOCK) * sizeof(block_q8_0);
            uint16_t d;
            memcpy(&d, b, 2);
            dst[i] = quant_f16_to_f32(d) * (float)(int8_t)b[2 + e % KV_ROW_Q8_0_BLOCK];
        }
        return;
    }
}
