/* quant.c - quantized formats: fp16/bf16 scalars, dequantization, the
 * reference quantizers, the portable (scalar) dot products and the run-time
 * choice of instruction set.
 *
 * Design:
 *  - The quantizers reproduce the algorithms of ggml's reference quantizers
 *    (block max / scale search, and for K-quants the iterative scale and min
 *    searches), written from the published format facts. They are plain
 *    scalar code: a weight file is written once, and activations are
 *    quantized by the same function whatever the ISA, so quantized
 *    activations never depend on the instruction set.
 *  - Every dot follows the determinism model of quant.h: the exact integer
 *    dot of a block, folded into the f32 sum with quant_fold*. The SIMD files
 *    only compute those integers faster, so all ISAs agree bit for bit on
 *    quantized types. Plain float types (f32/f16/bf16) are summed in SIMD
 *    lanes and are deterministic per ISA only; BF16 weights on AVX-512 CPUs
 *    with AVX512_BF16 take activations rounded to BF16 (quant_dot_act), the
 *    one activation format that depends on the CPU.
 *  - Kernel tables are filled once (first use or quant_set_isa); entries an
 *    ISA does not provide fall back to the scalar kernels here. */
#include "tensor/quant.h"
#include "tensor/quant_iq4.h"

#include <cpuid.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

_Static_assert(sizeof(block_q4_0) == 18, "q4_0 layout");
_Static_assert(sizeof(block_q4_1) == 20, "q4_1 layout");
_Static_assert(sizeof(block_q5_0) == 22, "q5_0 layout");
_Static_assert(sizeof(block_q5_1) == 24, "q5_1 layout");
_Static_assert(sizeof(block_q8_0) == 34, "q8_0 layout");
_Static_assert(sizeof(block_q8_1) == 36, "q8_1 layout");
_Static_assert(sizeof(block_q2_K) == 84, "q2_K layout");
_Static_assert(sizeof(block_q3_K) == 110, "q3_K layout");
_Static_assert(sizeof(block_q4_K) == 144, "q4_K layout");
_Static_assert(sizeof(block_q5_K) == 176, "q5_K layout");
_Static_assert(sizeof(block_q6_K) == 210, "q6_K layout");
_Static_assert(sizeof(block_q8_K) == 292, "q8_K layout");

enum { QK = 32, QKK = 256 };

/* ---------------------------------------------------------------- scalars */

float quant_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13); /* inf / nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        int shift = 0;
        while (!(mant & 0x400)) {
            mant <<= 1;
            shift++;
        }
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t quant_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) /* inf or nan (keep nan quiet and non-zero) */
        return (uint16_t)(sign | 0x7c00 | (absx > 0x7f800000u ? 0x200 | ((absx >> 13) & 0x3ff) : 0));
    if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00); /* rounds to >= 65520: inf */
    if (absx < 0x38800000u) {                                  /* below 2^-14: subnormal */
        if (absx < 0x33000000u) return sign;                   /* < 2^-25 rounds to 0 */
        uint32_t mant = (absx & 0x7fffff) | 0x800000;
        int shift = 126 - (int)(absx >> 23); /* 14..24 */
        uint32_t q = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (q & 1))) q++;
        return (uint16_t)(sign | q);
    }
    uint32_t q = ((absx - 0x38000000u) >> 13); /* rebias exponent 127 -> 15 */
    uint32_t rem = absx & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (q & 1))) q++;
    return (uint16_t)(sign | q);
}

void quant_f32_to_f16_row(const float *src, uint16_t *dst, int64_t n) {
    if (quant_get_isa() != QUANT_ISA_SCALAR) { /* both vector ISAs imply F16C (quant_best_isa) */
        quant_avx2_f32_to_f16_row(src, dst, n);
        return;
    }
    for (int64_t i = 0; i < n; i++) dst[i] = quant_f32_to_f16(src[i]);
}

float quant_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t quant_f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* quiet nan */
    x += 0x7fff + ((x >> 16) & 1);                                        /* nearest even */
    return (uint16_t)(x >> 16);
}

static inline float f16(uint16_t h) { return quant_f16_to_f32(h); }

/* Round half to even, as ggml's nearest_int (valid for |v| < 2^22). */
static inline int nearest_int(float v) {
    float r = v + 12582912.f;
    int32_t i;
    memcpy(&i, &r, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* roundf (half away from zero) without the libm call, exact for |v| < 2^31. */
/* Round to nearest, ties to even, without libm: adding and subtracting
 * 1.5 * 2^23 leaves the rounded integer for |v| < 2^22 (activations are
 * |v| <= 127 here). This matches the x86 path of ggml's activation
 * quantizer, so our Q8 activations equal llama.cpp's bit for bit. */
static inline int round_nearest_even(float v) {
    const float magic = 12582912.0f;
    float r = (v + magic) - magic;
    return (int)r;
}

static inline int round_half_away(float v) {
    int i = (int)v;
    float frac = v - (float)i; /* exact */
    if (frac >= 0.5f) i++;
    else if (frac <= -0.5f) i--;
    return i;
}

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* ------------------------------------------------------------ dequantize */

static void dequant_q4_0(const block_q4_0 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        float d = f16(b[i].d);
        for (int j = 0; j < 16; j++) {
            y[j] = d * ((b[i].qs[j] & 15) - 8);
            y[j + 16] = d * ((b[i].qs[j] >> 4) - 8);
        }
    }
}

static void dequant_q4_1(const block_q4_1 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        float d = f16(b[i].d), m = f16(b[i].m);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (b[i].qs[j] & 15) + m;
            y[j + 16] = d * (b[i].qs[j] >> 4) + m;
        }
    }
}

static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static void dequant_q5_0(const block_q5_0 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        float d = f16(b[i].d);
        uint32_t qh = load_u32(b[i].qh);
        for (int j = 0; j < 16; j++) {
            int lo = (b[i].qs[j] & 15) | (int)(((qh >> j) & 1) << 4);
            int hi = (b[i].qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            y[j] = d * (lo - 16);
            y[j + 16] = d * (hi - 16);
        }
    }
}

static void dequant_q5_1(const block_q5_1 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        float d = f16(b[i].d), m = f16(b[i].m);
        uint32_t qh = load_u32(b[i].qh);
        for (int j = 0; j < 16; j++) {
            int lo = (b[i].qs[j] & 15) | (int)(((qh >> j) & 1) << 4);
            int hi = (b[i].qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            y[j] = d * lo + m;
            y[j + 16] = d * hi + m;
        }
    }
}

static void dequant_q8_0(const block_q8_0 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        float d = f16(b[i].d);
        for (int j = 0; j < QK; j++) y[j] = d * b[i].qs[j];
    }
}

static void dequant_q8_1(const block_q8_1 *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QK) {
        float d = f16(b[i].d);
        for (int j = 0; j < QK; j++) y[j] = d * b[i].qs[j];
    }
}

/* Q2_K / Q3_K share the element order: half h, bit pair s, byte l. */
static void dequant_q2_K(const block_q2_K *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        float d = f16(b[i].d), dmin = f16(b[i].dmin);
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int half16 = 0; half16 < 2; half16++) {
                    uint8_t sc = b[i].scales[8 * h + 2 * s + half16];
                    float dl = d * (sc & 15), ml = dmin * (sc >> 4);
                    for (int l = 0; l < 16; l++) {
                        int q = (b[i].qs[32 * h + 16 * half16 + l] >> (2 * s)) & 3;
                        *y++ = dl * q - ml;
                    }
                }
    }
}

static void dequant_q3_K(const block_q3_K *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        float d = f16(b[i].d);
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int half16 = 0; half16 < 2; half16++) {
                    float dl = d * quant_q3k_scale(8 * h + 2 * s + half16, b[i].scales);
                    for (int l = 16 * half16; l < 16 * half16 + 16; l++) {
                        int q = (b[i].qs[32 * h + l] >> (2 * s)) & 3;
                        if (!(b[i].hmask[l] & (1 << (4 * h + s)))) q -= 4;
                        *y++ = dl * q;
                    }
                }
    }
}

static void dequant_q4_K(const block_q4_K *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        float d = f16(b[i].d), dmin = f16(b[i].dmin);
        for (int g = 0; g < 4; g++) {
            uint8_t sc, m;
            quant_k4_scale_min(2 * g, b[i].scales, &sc, &m);
            float d1 = d * sc, m1 = dmin * m;
            quant_k4_scale_min(2 * g + 1, b[i].scales, &sc, &m);
            float d2 = d * sc, m2 = dmin * m;
            const uint8_t *q = b[i].qs + 32 * g;
            for (int l = 0; l < 32; l++) *y++ = d1 * (q[l] & 15) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (q[l] >> 4) - m2;
        }
    }
}

static void dequant_q5_K(const block_q5_K *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        float d = f16(b[i].d), dmin = f16(b[i].dmin);
        for (int g = 0; g < 4; g++) {
            uint8_t sc, m;
            quant_k4_scale_min(2 * g, b[i].scales, &sc, &m);
            float d1 = d * sc, m1 = dmin * m;
            quant_k4_scale_min(2 * g + 1, b[i].scales, &sc, &m);
            float d2 = d * sc, m2 = dmin * m;
            const uint8_t *q = b[i].qs + 32 * g;
            for (int l = 0; l < 32; l++)
                *y++ = d1 * ((q[l] & 15) + (((b[i].qh[l] >> (2 * g)) & 1) << 4)) - m1;
            for (int l = 0; l < 32; l++)
                *y++ = d2 * ((q[l] >> 4) + (((b[i].qh[l] >> (2 * g + 1)) & 1) << 4)) - m2;
        }
    }
}

static void dequant_q6_K(const block_q6_K *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QKK) {
        float d = f16(b[i].d);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b[i].ql + 64 * h, *qh = b[i].qh + 32 * h;
            const int8_t *sc = b[i].scales + 8 * h;
            float *yh = y + 128 * h;
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = ((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                yh[l] = d * sc[is] * q1;
                yh[l + 32] = d * sc[is + 2] * q2;
                yh[l + 64] = d * sc[is + 4] * q3;
                yh[l + 96] = d * sc[is + 6] * q4;
            }
        }
    }
}

static void dequant_q8_K(const block_q8_K *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += QKK)
        for (int j = 0; j < QKK; j++) y[j] = b[i].d * b[i].qs[j];
}

void quant_dequantize_row(ember_dtype type, const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    switch (type) {
    case DT_F32: memcpy(dst, src, (size_t)n * 4); break;
    case DT_F16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            dst[i] = quant_f16_to_f32(h);
        }
        break;
    case DT_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * i, 2);
            dst[i] = quant_bf16_to_f32(h);
        }
        break;
    case DT_Q4_0: dequant_q4_0(src, dst, n / QK); break;
    case DT_Q4_1: dequant_q4_1(src, dst, n / QK); break;
    case DT_Q5_0: dequant_q5_0(src, dst, n / QK); break;
    case DT_Q5_1: dequant_q5_1(src, dst, n / QK); break;
    case DT_Q8_0: dequant_q8_0(src, dst, n / QK); break;
    case DT_Q8_1: dequant_q8_1(src, dst, n / QK); break;
    case DT_Q2_K: dequant_q2_K(src, dst, n / QKK); break;
    case DT_Q3_K: dequant_q3_K(src, dst, n / QKK); break;
    case DT_Q4_K: dequant_q4_K(src, dst, n / QKK); break;
    case DT_Q5_K: dequant_q5_K(src, dst, n / QKK); break;
    case DT_Q6_K: dequant_q6_K(src, dst, n / QKK); break;
    case DT_Q8_K: dequant_q8_K(src, dst, n / QKK); break;
    case DT_IQ4_NL: case DT_IQ4_XS: quant_iq4_dequantize(type, src, dst, n); break;
    default: memset(dst, 0, (size_t)n * sizeof(float)); break;
    }
}

/* -------------------------------------------------------------- quantize */

static void quant_q4_0(const float *x, block_q4_0 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK) {
        float amax = 0, max = 0; /* the element of largest magnitude, with its sign */
        for (int j = 0; j < QK; j++)
            if (fabsf(x[j]) > amax) amax = fabsf(x[j]), max = x[j];
        float d = max / -8, id = d ? 1.0f / d : 0.0f;
        b[i].d = quant_f32_to_f16(d);
        for (int j = 0; j < 16; j++) {
            int lo = (int8_t)(x[j] * id + 8.5f), hi = (int8_t)(x[j + 16] * id + 8.5f);
            lo = lo > 15 ? 15 : lo;
            hi = hi > 15 ? 15 : hi;
            b[i].qs[j] = (uint8_t)(lo | (hi << 4));
        }
    }
}

static void quant_q4_1(const float *x, block_q4_1 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK) {
        float min = INFINITY, max = -INFINITY;
        for (int j = 0; j < QK; j++) {
            if (x[j] < min) min = x[j];
            if (x[j] > max) max = x[j];
        }
        float d = (max - min) / 15, id = d ? 1.0f / d : 0.0f;
        b[i].d = quant_f32_to_f16(d);
        b[i].m = quant_f32_to_f16(min);
        for (int j = 0; j < 16; j++) {
            int lo = (int8_t)((x[j] - min) * id + 0.5f), hi = (int8_t)((x[j + 16] - min) * id + 0.5f);
            lo = lo > 15 ? 15 : lo;
            hi = hi > 15 ? 15 : hi;
            b[i].qs[j] = (uint8_t)(lo | (hi << 4));
        }
    }
}

static void quant_q5_0(const float *x, block_q5_0 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK) {
        float amax = 0, max = 0;
        for (int j = 0; j < QK; j++)
            if (fabsf(x[j]) > amax) amax = fabsf(x[j]), max = x[j];
        float d = max / -16, id = d ? 1.0f / d : 0.0f;
        b[i].d = quant_f32_to_f16(d);
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {
            int lo = (int8_t)(x[j] * id + 16.5f), hi = (int8_t)(x[j + 16] * id + 16.5f);
            lo = lo > 31 ? 31 : lo;
            hi = hi > 31 ? 31 : hi;
            b[i].qs[j] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
            qh |= ((uint32_t)(lo >> 4) << j) | ((uint32_t)(hi >> 4) << (j + 16));
        }
        memcpy(b[i].qh, &qh, 4);
    }
}

static void quant_q5_1(const float *x, block_q5_1 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK) {
        float min = INFINITY, max = -INFINITY;
        for (int j = 0; j < QK; j++) {
            if (x[j] < min) min = x[j];
            if (x[j] > max) max = x[j];
        }
        float d = (max - min) / 31, id = d ? 1.0f / d : 0.0f;
        b[i].d = quant_f32_to_f16(d);
        b[i].m = quant_f32_to_f16(min);
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {
            int lo = (int8_t)((x[j] - min) * id + 0.5f), hi = (int8_t)((x[j + 16] - min) * id + 0.5f);
            lo = lo > 31 ? 31 : lo;
            hi = hi > 31 ? 31 : hi;
            b[i].qs[j] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
            qh |= ((uint32_t)(lo >> 4) << j) | ((uint32_t)(hi >> 4) << (j + 16));
        }
        memcpy(b[i].qh, &qh, 4);
    }
}

/* Q8_0 / Q8_1 activations: d = max|x| / 127, q = round(x / d) (half away from 0). */
static void quant_q8_0(const float *x, block_q8_0 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK) {
        float amax = 0;
        for (int j = 0; j < QK; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        float d = amax / 127, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        b[i].d = quant_f32_to_f16(d);
        for (int j = 0; j < QK; j++) b[i].qs[j] = (int8_t)round_nearest_even(x[j] * id);
    }
}

static void quant_q8_1(const float *x, block_q8_1 *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QK) {
        float amax = 0;
        for (int j = 0; j < QK; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
        float d = amax / 127, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        b[i].d = quant_f32_to_f16(d);
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            b[i].qs[j] = (int8_t)round_nearest_even(x[j] * id);
            sum += b[i].qs[j];
        }
        b[i].s = quant_f32_to_f16((float)sum * d);
    }
}

/* Q8_K activations: scale from the signed largest element, bsums of 16. */
static void quant_q8_K(const float *x, block_q8_K *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += QKK) {
        float amax = 0, max = 0;
        for (int j = 0; j < QKK; j++)
            if (fabsf(x[j]) > amax) amax = fabsf(x[j]), max = x[j];
        if (amax == 0) {
            memset(&b[i], 0, sizeof b[i]);
            continue;
        }
        float iscale = -127.f / max;
        for (int j = 0; j < QKK; j++) {
            int v = nearest_int(iscale * x[j]);
            b[i].qs[j] = (int8_t)(v > 127 ? 127 : v);
        }
        for (int k = 0; k < 16; k++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += b[i].qs[16 * k + j];
            b[i].bsums[k] = (int16_t)s;
        }
        b[i].d = 1 / iscale;
    }
}

/* K-quant scale searches. These mirror ggml's reference behaviour so that
 * ember-written files have llama-quantize-like quality. */

/* Symmetric levels -nmax..nmax-1: a weighted least-squares scale refined over
 * 18 nearby trial inverse scales (rmse_type 1: weights x^2). */
static float make_qx_quants(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]), max = x[i];
    if (amax < 1e-30f) {
        memset(L, 0, (size_t)n);
        return 0;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + nmax);
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            int l = clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1);
            float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++)
                L[i] = (int8_t)(nmax + clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* Q3_K's per-sub-block search: start from the max, then move single levels
 * while the weighted (x^2) fit improves, up to 5 passes. */
static float make_q3_quants(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) amax = fabsf(x[i]), max = x[i];
    if (amax < 1e-30f) {
        memset(L, 0, (size_t)n);
        return 0;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)l;
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int itry = 0; itry < 5; itry++) {
        int n_changed = 0;
        for (int i = 0; i < n; i++) {
            float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                int new_l = clampi(nearest_int(x[i] * sl2 / slx), -nmax, nmax - 1);
                if (new_l != L[i]) {
                    slx += w * x[i] * new_l;
                    sl2 += w * new_l * new_l;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed++;
                    }
                }
            }
        }
        if (!n_changed) break;
    }
    for (int i = 0; i < n; i++) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0 ? sumlx / suml2 : 0.0f;
}

/* Asymmetric levels 0..nmax with a min (x ~ scale*L - the_min): weighted least
 * squares of (scale, min) over nstep+1 trial inverse scales; min is kept <= 0
 * in x terms (so the stored min is >= 0). use_mad: weight |error| instead of
 * error^2. */
static float make_qkx2_quants(int n, int nmax, const float *x, const float *weights, uint8_t *L,
                              float *the_min, uint8_t *Laux, float rmin, float rdelta, int nstep,
                              bool use_mad) {
    float min = x[0], max = x[0], sum_w = weights[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        sum_w += weights[i];
        sum_x += weights[i] * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        memset(L, 0, (size_t)n);
        *the_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min), scale = 1 / iscale;
    float best_mad = 0;
    for (int i = 0; i < n; i++) {
        int l = clampi(nearest_int(iscale * (x[i] - min)), 0, nmax);
        L[i] = (uint8_t)l;
        float diff = scale * l + min - x[i];
        diff = use_mad ? fabsf(diff) : diff * diff;
        best_mad += weights[i] * diff;
    }
    if (nstep < 1) {
        *the_min = -min;
        return scale;
    }
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            int l = clampi(nearest_int(iscale * (x[i] - min)), 0, nmax);
            Laux[i] = (uint8_t)l;
            float w = weights[i];
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float mad = 0;
            for (int i = 0; i < n; i++) {
                float diff = this_scale * Laux[i] + this_min - x[i];
                diff = use_mad ? fabsf(diff) : diff * diff;
                mad += weights[i] * diff;
            }
            if (mad < best_mad) {
                memcpy(L, Laux, (size_t)n);
                best_mad = mad;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
}

static void quant_q2_K(const float *x, block_q2_K *b, int64_t nb) {
    uint8_t L[QKK], Laux[16];
    float weights[16], mins[16], scales[16];
    for (int64_t i = 0; i < nb; i++, x += QKK) {
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < 16; j++) {
            for (int l = 0; l < 16; l++) weights[l] = fabsf(x[16 * j + l]);
            scales[j] = make_qkx2_quants(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], Laux,
                                         -0.5f, 0.1f, 15, true);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        if (max_scale > 0) {
            float iscale = 15 / max_scale;
            for (int j = 0; j < 16; j++) b[i].scales[j] = (uint8_t)nearest_int(iscale * scales[j]);
            b[i].d = quant_f32_to_f16(max_scale / 15);
        } else {
            memset(b[i].scales, 0, 16);
            b[i].d = 0;
        }
        if (max_min > 0) {
            float iscale = 15 / max_min;
            for (int j = 0; j < 16; j++) b[i].scales[j] |= (uint8_t)(nearest_int(iscale * mins[j]) << 4);
            b[i].dmin = quant_f32_to_f16(max_min / 15);
        } else {
            b[i].dmin = 0;
        }
        float d_all = f16(b[i].d), dmin_all = f16(b[i].dmin);
        for (int j = 0; j < 16; j++) {
            float d = d_all * (b[i].scales[j] & 15);
            if (!d) continue;
            float dm = dmin_all * (b[i].scales[j] >> 4);
            for (int l = 0; l < 16; l++)
                L[16 * j + l] = (uint8_t)clampi(nearest_int((x[16 * j + l] + dm) / d), 0, 3);
        }
        for (int j = 0; j < QKK; j += 128)
            for (int l = 0; l < 32; l++)
                b[i].qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) |
                                               (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
    }
}

static void quant_q3_K(const float *x, block_q3_K *b, int64_t nb) {
    int8_t L[QKK];
    float scales[16];
    for (int64_t i = 0; i < nb; i++, x += QKK) {
        float max_scale = 0, amax = 0;
        for (int j = 0; j < 16; j++) {
            scales[j] = make_q3_quants(16, 4, x + 16 * j, L + 16 * j);
            if (fabsf(scales[j]) > amax) amax = fabsf(scales[j]), max_scale = scales[j];
        }
        memset(b[i].scales, 0, 12);
        if (max_scale) {
            float iscale = -32.f / max_scale;
            for (int j = 0; j < 16; j++) {
                int l = clampi(nearest_int(iscale * scales[j]), -32, 31) + 32;
                if (j < 8) b[i].scales[j] = (uint8_t)(l & 0xF);
                else b[i].scales[j - 8] |= (uint8_t)((l & 0xF) << 4);
                b[i].scales[8 + j % 4] |= (uint8_t)((l >> 4) << (2 * (j / 4)));
            }
            b[i].d = quant_f32_to_f16(1 / iscale);
        } else {
            b[i].d = 0;
        }
        float d_all = f16(b[i].d);
        for (int j = 0; j < 16; j++) {
            float d = d_all * quant_q3k_scale(j, b[i].scales);
            if (!d) continue;
            for (int l = 0; l < 16; l++)
                L[16 * j + l] = (int8_t)(clampi(nearest_int(x[16 * j + l] / d), -4, 3) + 4);
        }
        memset(b[i].hmask, 0, 32);
        int m = 0;
        uint8_t hm = 1;
        for (int j = 0; j < QKK; j++) {
            if (L[j] > 3) {
                b[i].hmask[m] |= hm;
                L[j] = (int8_t)(L[j] - 4);
            }
            if (++m == 32) {
                m = 0;
                hm = (uint8_t)(hm << 1);
            }
        }
        for (int j = 0; j < QKK; j += 128)
            for (int l = 0; l < 32; l++)
                b[i].qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) |
                                               (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
    }
}

/* Q4_K and Q5_K: 8 sub-blocks of 32, weights av|x| + |x|, 6-bit scales/mins. */
static void quant_k_scales_mins(const float *x, int nmax, float rmin, int nstep, uint8_t *L,
                                uint8_t packed[12], uint16_t *d_out, uint16_t *dmin_out) {
    uint8_t Laux[32];
    float weights[32], mins[8], scales[8];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += x[32 * j + l] * x[32 * j + l];
        float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++) weights[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = make_qkx2_quants(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux,
                                     rmin, 0.1f, nstep, false);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    memset(packed, 0, 12);
    for (int j = 0; j < 8; j++) {
        int ls = nearest_int(inv_scale * scales[j]), lm = nearest_int(inv_min * mins[j]);
        ls = ls > 63 ? 63 : ls;
        lm = lm > 63 ? 63 : lm;
        if (j < 4) {
            packed[j] = (uint8_t)ls;
            packed[j + 4] = (uint8_t)lm;
        } else {
            packed[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            packed[j - 4] |= (uint8_t)((ls >> 4) << 6);
            packed[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    *d_out = quant_f32_to_f16(max_scale / 63.f);
    *dmin_out = quant_f32_to_f16(max_min / 63.f);
    float d_all = f16(*d_out), dmin_all = f16(*dmin_out);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        quant_k4_scale_min(j, packed, &sc, &m);
        float d = d_all * sc;
        if (!d) continue;
        float dm = dmin_all * m;
        for (int l = 0; l < 32; l++)
            L[32 * j + l] = (uint8_t)clampi(nearest_int((x[32 * j + l] + dm) / d), 0, nmax);
    }
}

static void quant_q4_K(const float *x, block_q4_K *b, int64_t nb) {
    uint8_t L[QKK];
    for (int64_t i = 0; i < nb; i++, x += QKK) {
        quant_k_scales_mins(x, 15, -1.f, 20, L, b[i].scales, &b[i].d, &b[i].dmin);
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++)
                b[i].qs[32 * g + l] = (uint8_t)(L[64 * g + l] | (L[64 * g + 32 + l] << 4));
    }
}

static void quant_q5_K(const float *x, block_q5_K *b, int64_t nb) {
    uint8_t L[QKK];
    for (int64_t i = 0; i < nb; i++, x += QKK) {
        quant_k_scales_mins(x, 31, -0.5f, 15, L, b[i].scales, &b[i].d, &b[i].dmin);
        memset(b[i].qh, 0, 32);
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++) {
                int lo = L[64 * g + l], hi = L[64 * g + 32 + l];
                b[i].qh[l] |= (uint8_t)(((lo >> 4) << (2 * g)) | ((hi >> 4) << (2 * g + 1)));
                b[i].qs[32 * g + l] = (uint8_t)((lo & 15) | ((hi & 15) << 4));
            }
    }
}

static void quant_q6_K(const float *x, block_q6_K *b, int64_t nb) {
    int8_t L[QKK];
    float scales[16];
    for (int64_t i = 0; i < nb; i++, x += QKK) {
        float max_scale = 0, amax = 0;
        for (int j = 0; j < 16; j++) {
            scales[j] = make_qx_quants(16, 32, x + 16 * j, L + 16 * j);
            if (fabsf(scales[j]) > amax) amax = fabsf(scales[j]), max_scale = scales[j];
        }
        if (amax < 1e-30f) {
            memset(&b[i], 0, sizeof b[i]);
            continue;
        }
        float iscale = -128.f / max_scale;
        b[i].d = quant_f32_to_f16(1 / iscale);
        for (int j = 0; j < 16; j++) {
            int v = nearest_int(iscale * scales[j]);
            b[i].scales[j] = (int8_t)(v > 127 ? 127 : v);
        }
        float d_all = f16(b[i].d);
        for (int j = 0; j < 16; j++) {
            float d = d_all * b[i].scales[j];
            if (!d) continue;
            for (int l = 0; l < 16; l++)
                L[16 * j + l] = (int8_t)(clampi(nearest_int(x[16 * j + l] / d), -32, 31) + 32);
        }
        for (int h = 0; h < 2; h++) {
            const int8_t *Lh = L + 128 * h;
            uint8_t *ql = b[i].ql + 64 * h, *qh = b[i].qh + 32 * h;
            for (int l = 0; l < 32; l++) {
                int q1 = Lh[l], q2 = Lh[l + 32], q3 = Lh[l + 64], q4 = Lh[l + 96];
                ql[l] = (uint8_t)((q1 & 15) | ((q3 & 15) << 4));
                ql[l + 32] = (uint8_t)((q2 & 15) | ((q4 & 15) << 4));
                qh[l] = (uint8_t)((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
            }
        }
    }
}

int quant_quantize_row(ember_dtype type, const float *src, void *dst, int64_t n) {
    uint8_t *p = dst;
    switch (type) {
    case DT_F32: memcpy(dst, src, (size_t)n * 4); return 0;
    case DT_F16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = quant_f32_to_f16(src[i]);
            memcpy(p + 2 * i, &h, 2);
        }
        return 0;
    case DT_BF16:
        if (quant_get_isa() == QUANT_ISA_AVX512) {
            quant_avx512_bf16(src, dst, n);
            return 0;
        }
        for (int64_t i = 0; i < n; i++) {
            uint16_t h = quant_f32_to_bf16(src[i]);
            memcpy(p + 2 * i, &h, 2);
        }
        return 0;
    case DT_Q4_0: quant_q4_0(src, dst, n / QK); return 0;
    case DT_Q4_1: quant_q4_1(src, dst, n / QK); return 0;
    case DT_Q5_0: quant_q5_0(src, dst, n / QK); return 0;
    case DT_Q5_1: quant_q5_1(src, dst, n / QK); return 0;
    case DT_Q8_0:
        if (quant_get_isa() == QUANT_ISA_AVX512) quant_avx512_q8_0(src, dst, n / QK);
        else quant_q8_0(src, dst, n / QK);
        return 0;
    case DT_Q8_1: quant_q8_1(src, dst, n / QK); return 0;
    case DT_Q2_K: quant_q2_K(src, dst, n / QKK); return 0;
    case DT_Q3_K: quant_q3_K(src, dst, n / QKK); return 0;
    case DT_Q4_K: quant_q4_K(src, dst, n / QKK); return 0;
    case DT_Q5_K: quant_q5_K(src, dst, n / QKK); return 0;
    case DT_Q6_K: quant_q6_K(src, dst, n / QKK); return 0;
    case DT_Q8_K:
        if (quant_get_isa() == QUANT_ISA_AVX512) quant_avx512_q8_K(src, dst, n / QKK);
        else quant_q8_K(src, dst, n / QKK);
        return 0;
    case DT_IQ4_NL: case DT_IQ4_XS: quant_iq4_quantize(type, src, dst, n); return 0;
    default: return -1;
    }
}

/* ------------------------------------------------------------ scalar dots */

static float dot_f32(int64_t n, const void *w, const void *a) {
    const float *x = w, *y = a;
    float sum = 0;
    for (int64_t i = 0; i < n; i++) sum = __builtin_fmaf(x[i], y[i], sum);
    return sum;
}

static float dot_f16(int64_t n, const void *w, const void *a) {
    const uint8_t *x = w;
    const float *y = a;
    float sum = 0;
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, x + 2 * i, 2);
        sum = __builtin_fmaf(quant_f16_to_f32(h), y[i], sum);
    }
    return sum;
}

static float dot_bf16(int64_t n, const void *w, const void *a) {
    const uint8_t *x = w;
    const float *y = a;
    float sum = 0;
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, x + 2 * i, 2);
        sum = __builtin_fmaf(quant_bf16_to_f32(h), y[i], sum);
    }
    return sum;
}

static float dot_q4_0(int64_t n, const void *w, const void *a) {
    const block_q4_0 *x = w;
    const block_q8_0 *y = a;
    float acc = 0;
    for (int64_t i = 0; i < n / QK; i++) {
        int32_t isum = 0;
        for (int j = 0; j < 16; j++)
            isum += ((x[i].qs[j] & 15) - 8) * y[i].qs[j] + ((x[i].qs[j] >> 4) - 8) * y[i].qs[j + 16];
        acc = quant_fold(acc, isum, f16(x[i].d), f16(y[i].d));
    }
    return acc;
}

static float dot_q4_1(int64_t n, const void *w, const void *a) {
    const block_q4_1 *x = w;
    const block_q8_1 *y = a;
    float acc = 0;
    for (int64_t i = 0; i < n / QK; i++) {
        int32_t isum = 0;
        for (int j = 0; j < 16; j++)
            isum += (x[i].qs[j] & 15) * y[i].qs[j] + (x[i].qs[j] >> 4) * y[i].qs[j + 16];
        acc = quant_fold_q8_1(acc, isum, f16(x[i].d), f16(x[i].m), f16(y[i].d), f16(y[i].s));
    }
    return acc;
}

static float dot_q5_0(int64_t n, const void *w, const void *a) {
    const block_q5_0 *x = w;
    const block_q8_0 *y = a;
    float acc = 0;
    for (int64_t i = 0; i < n / QK; i++) {
        uint32_t qh = load_u32(x[i].qh);
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) {
            int lo = ((x[i].qs[j] & 15) | (int)(((qh >> j) & 1) << 4)) - 16;
            int hi = ((x[i].qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4)) - 16;
            isum += lo * y[i].qs[j] + hi * y[i].qs[j + 16];
        }
        acc = quant_fold(acc, isum, f16(x[i].d), f16(y[i].d));
    }
    return acc;
}

static float dot_q5_1(int64_t n, const void *w, const void *a) {
    const block_q5_1 *x = w;
    const block_q8_1 *y = a;
    float acc = 0;
    for (int64_t i = 0; i < n / QK; i++) {
        uint32_t qh = load_u32(x[i].qh);
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) {
            int lo = (x[i].qs[j] & 15) | (int)(((qh >> j) & 1) << 4);
            int hi = (x[i].qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
            isum += lo * y[i].qs[j] + hi * y[i].qs[j + 16];
        }
        acc = quant_fold_q8_1(acc, isum, f16(x[i].d), f16(x[i].m), f16(y[i].d), f16(y[i].s));
    }
    return acc;
}

static float dot_q8_0(int64_t n, const void *w, const void *a) {
    const block_q8_0 *x = w;
    const block_q8_0 *y = a;
    float acc = 0;
    for (int64_t i = 0; i < n / QK; i++) {
        int32_t isum = 0;
        for (int j = 0; j < QK; j++) isum += x[i].qs[j] * y[i].qs[j];
        acc = quant_fold(acc, isum, f16(x[i].d), f16(y[i].d));
    }
    return acc;
}

static float dot_q8_1(int64_t n, const void *w, const void *a) {
    const block_q8_1 *x = w;
    const block_q8_1 *y = a;
    float acc = 0;
    for (int64_t i = 0; i < n / QK; i++) {
        int32_t isum = 0;
        for (int j = 0; j < QK; j++) isum += x[i].qs[j] * y[i].qs[j];
        acc = quant_fold(acc, isum, f16(x[i].d), f16(y[i].d));
    }
    return acc;
}

static float dot_q2_K(int64_t n, const void *w, const void *a) {
    const block_q2_K *x = w;
    const block_q8_K *y = a;
    float acc = 0;
    for (int64_t i = 0; i < n / QKK; i++) {
        int32_t isum = 0, msum = 0;
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int half16 = 0; half16 < 2; half16++) {
                    int sub = 8 * h + 2 * s + half16, part = 0;
                    const int8_t *q8 = y[i].qs + 16 * sub;
                    for (int l = 0; l < 16; l++)
                        part += ((x[i].qs[32 * h + 16 * half16 + l] >> (2 * s)) & 3) * q8[l];
                    isum += (x[i].scales[sub] & 15) * part;
                    msum += (x[i].scales[sub] >> 4) * y[i].bsums[sub];
                }
        acc = quant_fold_min(acc, isum, msum, f16(x[i].d), f16(x[i].dmin), y[i].d);
    }
    return acc;
}

static float dot_q3_K(int64_t n, const void *w, const void *a) {
    const block_q3_K *x = w;
    const block_q8_K *y = a;
    float acc = 0;
    for (int64_t i = 0; i < n / QKK; i++) {
        int32_t isum = 0;
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++)
                for (int half16 = 0; half16 < 2; half16++) {
                    int sub = 8 * h + 2 * s + half16, part = 0;
                    const int8_t *q8 = y[i].qs + 16 * sub;
                    for (int l = 0; l < 16; l++) {
                        int idx = 16 * half16 + l;
                        int q = (x[i].qs[32 * h + idx] >> (2 * s)) & 3;
                        if (!(x[i].hmask[idx] & (1 << (4 * h + s)))) q -= 4;
                        part += q * q8[l];
                    }
                    isum += quant_q3k_scale(sub, x[i].scales) * part;
                }
        acc = quant_fold(acc, isum, f16(x[i].d), y[i].d);
    }
    return acc;
}

static float dot_q4_K(int64_t n, const void *w, const void *a) {
    const block_q4_K *x = w;
    const block_q8_K *y = a;
    float acc = 0;
    for (int64_t i = 0; i < n / QKK; i++) {
        int32_t isum = 0, msum = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            quant_k4_scale_min(j, x[i].scales, &sc, &m);
            const uint8_t *q = x[i].qs + 32 * (j / 2);
            const int8_t *q8 = y[i].qs + 32 * j;
            int part = 0;
            for (int l = 0; l < 32; l++) part += ((j & 1) ? (q[l] >> 4) : (q[l] & 15)) * q8[l];
            isum += sc * part;
            msum += m * (y[i].bsums[2 * j] + y[i].bsums[2 * j + 1]);
        }
        acc = quant_fold_min(acc, isum, msum, f16(x[i].d), f16(x[i].dmin), y[i].d);
    }
    return acc;
}

static float dot_q5_K(int64_t n, const void *w, const void *a) {
    const block_q5_K *x = w;
    const block_q8_K *y = a;
    float acc = 0;
    for (int64_t i = 0; i < n / QKK; i++) {
        int32_t isum = 0, msum = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            quant_k4_scale_min(j, x[i].scales, &sc, &m);
            const uint8_t *q = x[i].qs + 32 * (j / 2);
            const int8_t *q8 = y[i].qs + 32 * j;
            int part = 0;
            for (int l = 0; l < 32; l++) {
                int v = ((j & 1) ? (q[l] >> 4) : (q[l] & 15)) + (((x[i].qh[l] >> j) & 1) << 4);
                part += v * q8[l];
            }
            isum += sc * part;
            msum += m * (y[i].bsums[2 * j] + y[i].bsums[2 * j + 1]);
        }
        acc = quant_fold_min(acc, isum, msum, f16(x[i].d), f16(x[i].dmin), y[i].d);
    }
    return acc;
}

static float dot_q6_K(int64_t n, const void *w, const void *a) {
    const block_q6_K *x = w;
    const block_q8_K *y = a;
    float acc = 0;
    for (int64_t i = 0; i < n / QKK; i++) {
        int32_t isum = 0;
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = x[i].ql + 64 * h, *qh = x[i].qh + 32 * h;
            const int8_t *q8 = y[i].qs + 128 * h;
            int part[8] = {0};
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                part[is + 0] += (((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32) * q8[l];
                part[is + 2] += (((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32) * q8[l + 32];
                part[is + 4] += (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32) * q8[l + 64];
                part[is + 6] += (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32) * q8[l + 96];
            }
            for (int k = 0; k < 8; k++) isum += x[i].scales[8 * h + k] * part[k];
        }
        acc = quant_fold(acc, isum, f16(x[i].d), y[i].d);
    }
    return acc;
}

static float dot_q8_K(int64_t n, const void *w, const void *a) {
    const block_q8_K *x = w;
    const block_q8_K *y = a;
    float acc = 0;
    for (int64_t i = 0; i < n / QKK; i++) {
        int32_t isum = 0;
        for (int j = 0; j < QKK; j++) isum += x[i].qs[j] * y[i].qs[j];
        acc = quant_fold(acc, isum, x[i].d, y[i].d);
    }
    return acc;
}

static const quant_dot_fn scalar_dots[DT_COUNT] = {
    [DT_F32] = dot_f32,   [DT_F16] = dot_f16,   [DT_BF16] = dot_bf16, [DT_Q4_0] = dot_q4_0,
    [DT_Q4_1] = dot_q4_1, [DT_Q5_0] = dot_q5_0, [DT_Q5_1] = dot_q5_1, [DT_Q8_0] = dot_q8_0,
    [DT_Q8_1] = dot_q8_1, [DT_Q2_K] = dot_q2_K, [DT_Q3_K] = dot_q3_K, [DT_Q4_K] = dot_q4_K,
    [DT_Q5_K] = dot_q5_K, [DT_Q6_K] = dot_q6_K, [DT_Q8_K] = dot_q8_K,
};

/* ------------------------------------------------------------ dispatch */

typedef struct kernel_table {
    ember_dtype acts[DT_COUNT]; /* activation format of each weight type's dot */
    quant_dot_fn dots[DT_COUNT];
    quant_tile_fn tiles[DT_COUNT];
    int tile_rows, tile_cols;
    quant_strip_fn strips[DT_COUNT][QUANT_STRIP_TOKENS + 1];
    int strip_rows[DT_COUNT][QUANT_STRIP_TOKENS + 1];
} kernel_table;

/* tables[QUANT_ISA_*], and TABLE_AVX512_BF16: the AVX-512 table with BF16
 * weights on vdpbf16ps (bf16_avx512bf16.c), used in place of the AVX-512 one
 * where the CPU has AVX512_BF16 (quant_set_avx512_bf16). */
enum { TABLE_AVX512_BF16 = 3, N_TABLES = 4 };
static kernel_table tables[N_TABLES];
static atomic_int current_isa = -1; /* -1: not chosen yet */
static atomic_int bf16_dp = -1;     /* -1: not chosen yet, else use TABLE_AVX512_BF16 */
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static void build_tables(void) {
    for (int ti = 0; ti < N_TABLES; ti++) {
        int isa = ti == TABLE_AVX512_BF16 ? QUANT_ISA_AVX512 : ti;
        kernel_table *t = &tables[ti];
        memset(t, 0, sizeof *t);
        for (int ty = 0; ty < DT_COUNT; ty++) {
            const dtype_info *info = dtype_info_of((uint32_t)ty);
            t->acts[ty] = info ? info->dot_act : DT_F32;
        }
        if (isa == QUANT_ISA_AVX2) {
            quant_avx2_kernels(t->dots);
            quant_avx2_strips(t->strips, t->strip_rows);
        }
        if (isa == QUANT_ISA_AVX512) {
            quant_avx512_kernels(t->dots, t->tiles, &t->tile_rows, &t->tile_cols);
            quant_avx512_strips(t->strips, t->strip_rows);
        }
        quant_dot_fn iq4_scalar[DT_COUNT] = {0};
        quant_iq4_scalar_kernels(iq4_scalar);
        for (int ty = 0; ty < DT_COUNT; ty++)
            if (!t->dots[ty]) t->dots[ty] = iq4_scalar[ty];
        if (isa == QUANT_ISA_AVX2) quant_iq4_avx2_kernels(t->dots, t->strips, t->strip_rows);
        if (isa == QUANT_ISA_AVX512)
            quant_iq4_avx512_kernels(t->dots, t->tiles, t->tile_rows, t->tile_cols);
        if (ti == TABLE_AVX512_BF16) quant_avx512bf16_kernels(t->dots, t->tiles, t->strips, t->strip_rows, t->acts);
        for (int ty = 0; ty < DT_COUNT; ty++)
            if (!t->dots[ty]) t->dots[ty] = scalar_dots[ty];
    }
}

/* AVX512_BF16 (vdpbf16ps): cpuid leaf 7, sub-leaf 1, EAX bit 5. */
/* Probed once: cpuid traps to the hypervisor in a VM (~15 us each here),
 * and op_attention_precision asks on every attention call. */
bool quant_cpu_has_avx512_bf16(void) {
    static atomic_int known = -1;
    int has = atomic_load_explicit(&known, memory_order_relaxed);
    if (has < 0) {
        unsigned a, b, c, d;
        has = __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5));
        atomic_store_explicit(&known, has, memory_order_relaxed);
    }
    return has;
}

/* F16C from cpuid leaf 1: clang before 15 has no "f16c" for __builtin_cpu_supports. */
static bool cpu_has_f16c(void) {
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
}

quant_isa quant_best_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return QUANT_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        cpu_has_f16c())
        return QUANT_ISA_AVX2;
    return QUANT_ISA_SCALAR;
}

/* vdpbf16ps for BF16 weights wherever the CPU has it, unless a test said otherwise. */
static void choose_bf16_dp(void) {
    int unset = -1;
    atomic_compare_exchange_strong(&bf16_dp, &unset, quant_best_isa() == QUANT_ISA_AVX512 && quant_cpu_has_avx512_bf16());
}

quant_isa quant_get_isa(void) {
    int isa = atomic_load(&current_isa);
    if (isa < 0) {
        pthread_once(&tables_once, build_tables);
        choose_bf16_dp();
        isa = (int)quant_best_isa();
        atomic_store(&current_isa, isa);
    }
    return (quant_isa)isa;
}

static const kernel_table *table_in_use(void) {
    quant_isa isa = quant_get_isa();
    return &tables[isa == QUANT_ISA_AVX512 && atomic_load(&bf16_dp) > 0 ? TABLE_AVX512_BF16 : (int)isa];
}

bool quant_set_avx512_bf16(bool on) {
    if (on && !(quant_best_isa() == QUANT_ISA_AVX512 && quant_cpu_has_avx512_bf16())) return false;
    quant_get_isa();
    atomic_store(&bf16_dp, on ? 1 : 0);
    return true;
}

bool quant_avx512_bf16_in_use(void) { return table_in_use() == &tables[TABLE_AVX512_BF16]; }

ember_dtype quant_dot_act(ember_dtype type) {
    if ((unsigned)type >= DT_COUNT) return DT_F32;
    return table_in_use()->acts[type];
}

bool quant_set_isa(quant_isa isa) {
    if ((int)isa < 0 || isa > quant_best_isa()) return false;
    pthread_once(&tables_once, build_tables);
    choose_bf16_dp();
    atomic_store(&current_isa, (int)isa);
    return true;
}

const char *quant_isa_name(quant_isa isa) {
    switch (isa) {
    case QUANT_ISA_SCALAR: return "scalar";
    case QUANT_ISA_AVX2: return "avx2";
    case QUANT_ISA_AVX512: return "avx512-vnni";
    }
    return "?";
}

bool quant_isa_parse(const char *name, quant_isa *isa) {
    if (!strcmp(name, "scalar")) *isa = QUANT_ISA_SCALAR;
    else if (!strcmp(name, "avx2")) *isa = QUANT_ISA_AVX2;
    else if (!strcmp(name, "avx512") || !strcmp(name, quant_isa_name(QUANT_ISA_AVX512))) *isa = QUANT_ISA_AVX512;
    else return false;
    return true;
}

quant_dot_fn quant_dot_kernel(ember_dtype type) {
    if ((unsigned)type >= DT_COUNT) return NULL;
    return table_in_use()->dots[type];
}

quant_tile_fn quant_tile_kernel(ember_dtype type, int *rows, int *cols) {
    if ((unsigned)type >= DT_COUNT) return NULL;
    const kernel_table *t = table_in_use();
    *rows = t->tile_rows;
    *cols = t->tile_cols;
    return t->tiles[type];
}

quant_strip_fn quant_strip_kernel(ember_dtype type, int n_tokens, int *rows) {
    if ((unsigned)type >= DT_COUNT || n_tokens < 1 || n_tokens > QUANT_STRIP_TOKENS) return NULL;
    const kernel_table *t = table_in_use();
    *rows = t->strip_rows[type][n_tokens];
    return t->strips[type][n_tokens];
}

float quant_vec_dot(ember_dtype type, int64_t n, const void *w_row, const void *act_row) {
    quant_dot_fn fn = quant_dot_kernel(type);
    return fn ? fn(n, w_row, act_row) : 0.0f;
}
