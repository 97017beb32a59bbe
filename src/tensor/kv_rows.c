/* kv_rows.c - encoding and decoding of KV rows (see kv_rows.h).
 *
 * q8_0 reuses the weight quantizer (quant_quantize_row), so a V row holds
 * exactly what a Q8_0 tensor row of the same values would; the fp16 scale is
 * what the decoder multiplies by, not the f32 amax/127 it came from.
 *
 * q12h (K rows of q8_0 pools) spends 12 bits per value because K's error
 * reaches the logits multiplied by the query: on stories260K 8-bit K cost
 * 3.6 points of top-1 agreement with f32 KV whatever the block size (blocks
 * of 2 values still lost 2.4); rotated 12-bit K loses no more than f16 K
 * would (99.69% either way beside Q8_0 V; docs/kv-formats.md). The 8-value
 * Hadamard spreads a row's few large channels (the slow RoPE pairs) over
 * their slice before the block's absmax sets the step. The 12-bit integer
 * is stored as an int8 high part and a 4-bit low part so decoders widen
 * each with one instruction. The scalar decoder here is the reference; the
 * AVX-512 attention kernel decodes the same way with vector instructions
 * (exact conversions, one product). */
#include "tensor/kv_rows.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#include "tensor/quant.h"

bool kv_row_supported(kv_row_type type, int width) {
    if (width < 0) return false;
    switch (type) {
    case KV_ROW_F32:
    case KV_ROW_F16: return true;
    case KV_ROW_Q8_0: return width % KV_ROW_Q8_0_BLOCK == 0;
    case KV_ROW_Q12H: return width % KV_ROW_Q12H_BLOCK == 0;
    }
    return false;
}

size_t kv_row_bytes(kv_row_type type, int width) {
    size_t raw = 0;
    switch (type) {
    case KV_ROW_F32: raw = (size_t)width * 4; break;
    case KV_ROW_F16: raw = (size_t)width * 2; break;
    case KV_ROW_Q8_0: raw = (size_t)(width / KV_ROW_Q8_0_BLOCK) * sizeof(block_q8_0); break;
    case KV_ROW_Q12H: raw = (size_t)(width / KV_ROW_Q12H_BLOCK) * sizeof(kv_block_q12h); break;
    }
    return (raw + 3) & ~(size_t)3;
}

const char *kv_row_type_name(kv_row_type type) {
    switch (type) {
    case KV_ROW_F32: return "f32";
    case KV_ROW_F16: return "f16";
    case KV_ROW_Q8_0: return "q8_0";
    case KV_ROW_Q12H: return "q12h";
    }
    return "?";
}

kv_row_type kv_row_key_type(kv_row_type type) { return type == KV_ROW_Q8_0 ? KV_ROW_Q12H : type; }

bool kv_row_rotated(kv_row_type type) { return type == KV_ROW_Q12H; }

/* x = H x for one slice of KV_ROW_Q12H_SLICE values (butterflies, +-1). */
static void hadamard8(float *x) {
    for (int len = 1; len < KV_ROW_Q12H_SLICE; len <<= 1)
        for (int i = 0; i < KV_ROW_Q12H_SLICE; i += 2 * len)
            for (int j = i; j < i + len; j++) {
                float a = x[j], b = x[j + len];
                x[j] = a + b;
                x[j + len] = a - b;
            }
}

void kv_row_query(kv_row_type type, const float *q, float *dst, int n) {
    memcpy(dst, q, (size_t)n * sizeof(float));
    if (!kv_row_rotated(type)) return;
    for (int s = 0; s + KV_ROW_Q12H_SLICE <= n; s += KV_ROW_Q12H_SLICE) {
        hadamard8(dst + s);
        for (int i = s; i < s + KV_ROW_Q12H_SLICE; i++) dst[i] *= 1.0f / KV_ROW_Q12H_SLICE; /* exact */
    }
}

static void encode_q12h(const float *src, kv_block_q12h *blocks, int width) {
    for (int b0 = 0; b0 < width; b0 += KV_ROW_Q12H_BLOCK) {
        float x[KV_ROW_Q12H_BLOCK];
        memcpy(x, src + b0, sizeof x);
        for (int s = 0; s < KV_ROW_Q12H_BLOCK; s += KV_ROW_Q12H_SLICE) hadamard8(x + s);
        float amax = 0.0f;
        for (int i = 0; i < KV_ROW_Q12H_BLOCK; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        /* The integers are rounded against the fp16 scale the decoder uses,
         * rounded up so the largest still fits in 12 bits: at 12 bits the
         * scale's own rounding (2^-11) would otherwise cost a step. */
        uint16_t h = quant_f32_to_f16(amax / 2047.0f);
        if (quant_f16_to_f32(h) < amax / 2047.0f) h++; /* positive and finite: the next binary16 up */
        float d = quant_f16_to_f32(h), id = d > 0.0f ? 1.0f / d : 0.0f;
        kv_block_q12h *blk = blocks + b0 / KV_ROW_Q12H_BLOCK;
        blk->d = h;
        memset(blk->lo, 0, sizeof blk->lo);
        for (int i = 0; i < KV_ROW_Q12H_BLOCK; i++) {
            float r = roundf(x[i] * id);
            int q = r > 2047.0f ? 2047 : r < -2047.0f ? -2047 : (int)r;
            unsigned u = (unsigned)(q + 2048); /* 1..4095: lo is its low nibble, hi the rest - 128 */
            blk->hi[i] = (int8_t)((int)(u >> 4) - 128);
            blk->lo[i % 16] |= (uint8_t)((u & 15u) << (4 * (i / 16)));
        }
    }
}

void kv_row_encode(kv_row_type type, const float *src, void *dst, int width) {
    size_t bytes = kv_row_bytes(type, width), raw = 0;
    switch (type) {
    case KV_ROW_F32: memcpy(dst, src, (size_t)width * sizeof(float)); return;
    case KV_ROW_F16:
        quant_f32_to_f16_row(src, dst, width); /* rows start 4-byte aligned (kv_row_bytes) */
        raw = (size_t)width * 2;
        break;
    case KV_ROW_Q8_0:
        raw = (size_t)(width / KV_ROW_Q8_0_BLOCK) * sizeof(block_q8_0);
        quant_quantize_row(DT_Q8_0, src, dst, width);
        break;
    case KV_ROW_Q12H:
        raw = (size_t)(width / KV_ROW_Q12H_BLOCK) * sizeof(kv_block_q12h);
        encode_q12h(src, dst, width);
        break;
    }
    if (raw < bytes) memset((uint8_t *)dst + raw, 0, bytes - raw);
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
    case KV_ROW_Q12H:
        for (int i = 0; i < n; i++) {
            int e = offset + i, j = e % KV_ROW_Q12H_BLOCK;
            const uint8_t *b = p + (size_t)(e / KV_ROW_Q12H_BLOCK) * sizeof(kv_block_q12h);
            uint16_t d;
            memcpy(&d, b + offsetof(kv_block_q12h, d), 2);
            int hi = (int8_t)b[offsetof(kv_block_q12h, hi) + j];
            int lo = (b[offsetof(kv_block_q12h, lo) + j % 16] >> (4 * (j / 16))) & 15;
            dst[i] = quant_f16_to_f32(d) * (float)(16 * hi + lo);
        }
        return;
    }
}
