/* quant_iq4.c - IQ4_NL / IQ4_XS: dequantization, the reference quantizer and
 * the portable dot products (see quant_iq4.h).
 *
 * Design:
 *  - One scale search serves both formats: for each 32 elements it tries
 *    the scale that maps the extreme value onto the table's end and 15
 *    neighbours (index offsets -7..7 of that end value), each time fitting the
 *    least-squares scale for the chosen indices under weights x^2, and keeps
 *    the best fit. IQ4_NL stores that scale as fp16; IQ4_XS stores the
 *    sub-block scales as 6-bit multiples of one super-scale d (chosen so the
 *    largest scale is -32 * d) and re-picks the indices for the rounded
 *    sub-block scale.
 *  - The scalar dots are the reference every SIMD kernel must match: the
 *    exact integer dot of a block (IQ4_XS: scaled per sub-block and summed
 *    as integers) folded once with quant_fold. */
#include "tensor/quant_iq4.h"

#include <emmintrin.h>
#include <math.h>
#include <string.h>

_Static_assert(sizeof(block_iq4_nl) == 18, "iq4_nl layout");
_Static_assert(sizeof(block_iq4_xs) == 136, "iq4_xs layout");

const int8_t quant_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

enum { SUB = 32, SUPER = 256, N_TRY = 7 };

/* Below this magnitude a sub-block is treated as zero. */
#define IQ4_ZERO_EPS 1e-15f

/* ---------------------------------------------------------- dequantize */

static void dequant_nl(const block_iq4_nl *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, y += SUB) {
        float d = quant_f16_to_f32(b[i].d);
        for (int j = 0; j < 16; j++) {
            y[j] = d * quant_iq4_values[b[i].qs[j] & 15];
            y[j + 16] = d * quant_iq4_values[b[i].qs[j] >> 4];
        }
    }
}

static void dequant_xs(const block_iq4_xs *b, float *y, int64_t nb) {
    for (int64_t i = 0; i < nb; i++) {
        float d = quant_f16_to_f32(b[i].d);
        for (int s = 0; s < SUPER / SUB; s++, y += SUB) {
            float dl = d * (float)quant_iq4_xs_scale(&b[i], s);
            const uint8_t *q = b[i].qs + 16 * s;
            for (int j = 0; j < 16; j++) {
                y[j] = dl * quant_iq4_values[q[j] & 15];
                y[j + 16] = dl * quant_iq4_values[q[j] >> 4];
            }
        }
    }
}

void quant_iq4_dequantize(ember_dtype type, const void *src, float *dst, int64_t n) {
    if (type == DT_IQ4_NL) dequant_nl(src, dst, n / SUB);
    else dequant_xs(src, dst, n / SUPER);
}

/* ------------------------------------------------------------ quantize */

/* Table entries nearest to v[j] = inv * x[j] for the 32 values of a
 * sub-block: index l[j] and value q[j] (ties toward the larger entry).
 * Four lanes at a time (SSE2, the x86-64 baseline): lo is the largest entry
 * <= v, hi the next one (clamped at the ends), and the pick is the float
 * comparison v - lo < hi - v a binary search would end with, so the indices
 * are those of ggml's reference quantizer. */
static void nearest(const float *x, float inv, uint8_t *l, float *q) {
    const int8_t *t = quant_iq4_values;
    const __m128 vinv = _mm_set1_ps(inv);
    for (int j = 0; j < SUB; j += 4) {
        __m128 v = _mm_mul_ps(_mm_loadu_ps(x + j), vinv);
        __m128 lo = _mm_set1_ps(t[0]), hi = _mm_set1_ps(t[1]);
        __m128i below = _mm_setzero_si128(); /* entries 1..14 that are <= v */
        for (int k = 1; k < 15; k++) {
            __m128 ge = _mm_cmpge_ps(v, _mm_set1_ps(t[k]));
            lo = _mm_or_ps(_mm_and_ps(ge, _mm_set1_ps(t[k])), _mm_andnot_ps(ge, lo));
            hi = _mm_or_ps(_mm_and_ps(ge, _mm_set1_ps(t[k + 1])), _mm_andnot_ps(ge, hi));
            below = _mm_sub_epi32(below, _mm_castps_si128(ge));
        }
        __m128 take_lo = _mm_cmplt_ps(_mm_sub_ps(v, lo), _mm_sub_ps(hi, v));
        /* index = below + 1, minus one where the lower entry wins */
        __m128i idx = _mm_add_epi32(_mm_add_epi32(below, _mm_set1_epi32(1)), _mm_castps_si128(take_lo));
        _mm_storeu_ps(q + j, _mm_or_ps(_mm_and_ps(take_lo, lo), _mm_andnot_ps(take_lo, hi)));
        int32_t lanes[4];
        _mm_storeu_si128((__m128i *)lanes, idx);
        for (int i = 0; i < 4; i++) l[j + i] = (uint8_t)lanes[i];
    }
}

/* Least-squares fit of 32 values to table entries under weights w: the
 * scale is sumqx / sumq2 for indices picked with inverse scale `inv`. The
 * sums run in element order, as the reference quantizer's do. */
static void fit(const float *x, const float *w, float inv, float *sumqx, float *sumq2) {
    uint8_t l[SUB];
    float q[SUB];
    nearest(x, inv, l, q);
    float qx = 0, q2 = 0;
    for (int j = 0; j < SUB; j++) {
        qx += w[j] * q[j] * x[j];
        q2 += w[j] * q[j] * q[j];
    }
    *sumqx = qx;
    *sumq2 = q2;
}

/* Best scale for 32 values (0 for an all-zero block). */
static float best_scale(const float *x) {
    float w[SUB], amax = 0, max = 0;
    for (int j = 0; j < SUB; j++) {
        w[j] = x[j] * x[j];
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    if (amax < IQ4_ZERO_EPS) return 0;
    const float first = quant_iq4_values[0];
    float sumqx, sumq2;
    /* First guess: the extreme value onto +127 (scale of the sign of max). */
    fit(x, w, 1.0f / (-max / first), &sumqx, &sumq2);
    float d = sumqx / sumq2, best = d * sumqx;
    for (int t = -N_TRY; t <= N_TRY; t++) {
        fit(x, w, (t + first) / max, &sumqx, &sumq2);
        if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    return d;
}

/* Indices of 32 values for scale d, packed in Q4_0 nibble order. */
static void pack_indices(const float *x, float d, uint8_t *qs) {
    uint8_t l[SUB];
    float q[SUB];
    nearest(x, d != 0 ? 1.0f / d : 0.0f, l, q);
    for (int j = 0; j < 16; j++) qs[j] = (uint8_t)(l[j] | (l[j + 16] << 4));
}

static void quant_nl(const float *x, block_iq4_nl *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += SUB) {
        float d = best_scale(x);
        b[i].d = quant_f32_to_f16(d);
        pack_indices(x, d, b[i].qs);
    }
}

static void quant_xs(const float *x, block_iq4_xs *b, int64_t nb) {
    for (int64_t i = 0; i < nb; i++, x += SUPER) {
        float scales[SUPER / SUB], max_scale = 0, amax_scale = 0;
        for (int s = 0; s < SUPER / SUB; s++) {
            scales[s] = best_scale(x + SUB * s);
            if (fabsf(scales[s]) > amax_scale) {
                amax_scale = fabsf(scales[s]);
                max_scale = scales[s];
            }
        }
        /* The largest scale becomes ls - 32 = -32, the end of the 6-bit range. */
        float d = -max_scale / 32;
        float inv = d != 0 ? 1.0f / d : 0.0f;
        memset(b[i].scales_l, 0, sizeof b[i].scales_l);
        uint16_t high = 0;
        b[i].d = quant_f32_to_f16(d);
        for (int s = 0; s < SUPER / SUB; s++) {
            int l = (int)nearbyintf(inv * scales[s]);
            l = l < -32 ? -32 : l > 31 ? 31 : l;
            pack_indices(x + SUB * s, d * (float)l, b[i].qs + 16 * s);
            int ls = l + 32;
            b[i].scales_l[s / 2] |= (uint8_t)((ls & 15) << (4 * (s % 2)));
            high |= (uint16_t)((ls >> 4) << (2 * s));
        }
        b[i].scales_h = high;
    }
}

void quant_iq4_quantize(ember_dtype type, const float *src, void *dst, int64_t n) {
    if (type == DT_IQ4_NL) quant_nl(src, dst, n / SUB);
    else quant_xs(src, dst, n / SUPER);
}

/* ---------------------------------------------------------------- dots */

static float dot_iq4_nl(int64_t n, const void *w, const void *a) {
    const block_iq4_nl *x = w;
    const block_q8_0 *y = a;
    float acc = 0;
    for (int64_t i = 0; i < n / SUB; i++) {
        int32_t isum = 0;
        for (int j = 0; j < 16; j++)
            isum += quant_iq4_values[x[i].qs[j] & 15] * y[i].qs[j] +
                    quant_iq4_values[x[i].qs[j] >> 4] * y[i].qs[j + 16];
        acc = quant_fold(acc, isum, quant_f16_to_f32(x[i].d), quant_f16_to_f32(y[i].d));
    }
    return acc;
}

static float dot_iq4_xs(int64_t n, const void *w, const void *a) {
    const block_iq4_xs *x = w;
    const block_q8_K *y = a;
    float acc = 0;
    for (int64_t i = 0; i < n / SUPER; i++) {
        int32_t isum = 0;
        for (int s = 0; s < SUPER / SUB; s++) {
            const uint8_t *q = x[i].qs + 16 * s;
            const int8_t *q8 = y[i].qs + SUB * s;
            int32_t part = 0;
            for (int j = 0; j < 16; j++)
                part += quant_iq4_values[q[j] & 15] * q8[j] + quant_iq4_values[q[j] >> 4] * q8[j + 16];
            isum += quant_iq4_xs_scale(&x[i], s) * part;
        }
        acc = quant_fold(acc, isum, quant_f16_to_f32(x[i].d), y[i].d);
    }
    return acc;
}

void quant_iq4_scalar_kernels(quant_dot_fn dots[DT_COUNT]) {
    dots[DT_IQ4_NL] = dot_iq4_nl;
    dots[DT_IQ4_XS] = dot_iq4_xs;
}
