/* kvarn.c - the kvarn record codec (see kvarn.h).
 *
 * Why these steps: K rows carry a few outlier channels (rope pairs, biased
 * heads) and per-token magnitudes vary; a plain per-block scale spends the
 * codes on the outliers. The Hadamard rotation spreads each outlier over
 * its slice; the column factors even out channels that are large in every
 * token, the row factors tokens that are large in every channel; after two
 * alternating rounds the values are near unit variance in both directions,
 * and the last per-row max scaling uses the full code range. The factors
 * cost (128 + width) fp16 values per record, a few percent of the codes.
 *
 * Everything runs in f32 in a fixed order (no reductions whose order
 * depends on anything but the record), so a record is a function of its
 * rows. */
#include "tensor/kvarn.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/quant.h"

int kvarn_slice(int head_dim) {
    if (head_dim <= 0 || head_dim % 2) return 0;
    int s = 1;
    while (s < KVARN_GROUP && head_dim % (2 * s) == 0) s *= 2;
    return s;
}

static size_t code_bytes(int width, int bits) { return ((size_t)KVARN_GROUP * (size_t)width * (size_t)bits + 7) / 8; }

size_t kvarn_record_bytes(int width, int bits) {
    size_t raw = code_bytes(width, bits) + 2 * ((size_t)width + KVARN_GROUP);
    return (raw + 3) & ~(size_t)3;
}

void kvarn_rotate(float *row, int width, int head_dim) {
    int S = kvarn_slice(head_dim);
    if (S < 2) return;
    float norm = 1.0f / sqrtf((float)S);
    for (int o = 0; o + S <= width; o += S) {
        float *x = row + o;
        for (int h = 1; h < S; h *= 2)
            for (int i = 0; i < S; i += 2 * h)
                for (int j = i; j < i + h; j++) {
                    float a = x[j], b = x[j + h];
                    x[j] = a + b;
                    x[j + h] = a - b;
                }
        for (int j = 0; j < S; j++) x[j] *= norm;
    }
}

/* fp16 round trip of a positive factor; 0 and non-finite become 1. */
static float factor16(float f) {
    if (!(f > 0.0f) || !isfinite(f)) return 1.0f;
    float r = quant_f16_to_f32(quant_f32_to_f16(f));
    return r > 0.0f && isfinite(r) ? r : 1.0f;
}

void kvarn_encode(const float *rows, int width, int head_dim, int bits, void *record) {
    const int T = KVARN_GROUP;
    float *x = malloc((size_t)T * (size_t)width * sizeof(float));
    float *col = malloc((size_t)width * sizeof(float));
    float row_f[KVARN_GROUP];
    uint8_t *out = record;
    size_t rec_bytes = kvarn_record_bytes(width, bits);
    if (x == NULL || col == NULL) { /* nothing sensible to store: an all-zero record decodes to zeros */
        free(x);
        free(col);
        memset(out, 0, rec_bytes);
        return;
    }
    memcpy(x, rows, (size_t)T * (size_t)width * sizeof(float));
    for (int t = 0; t < T; t++) kvarn_rotate(x + (size_t)t * width, width, head_dim);
    for (int j = 0; j < width; j++) col[j] = 1.0f;
    for (int t = 0; t < T; t++) row_f[t] = 1.0f;
    for (int round = 0; round < 2; round++) {
        for (int j = 0; j < width; j++) {
            float ss = 0;
            for (int t = 0; t < T; t++) ss += x[(size_t)t * width + j] * x[(size_t)t * width + j];
            float r = sqrtf(ss / (float)T);
            if (r > 0.0f && isfinite(r)) {
                col[j] *= r;
                for (int t = 0; t < T; t++) x[(size_t)t * width + j] /= r;
            }
        }
        for (int t = 0; t < T; t++) {
            float ss = 0, *xt = x + (size_t)t * width;
            for (int j = 0; j < width; j++) ss += xt[j] * xt[j];
            float r = sqrtf(ss / (float)width);
            if (r > 0.0f && isfinite(r)) {
                row_f[t] *= r;
                for (int j = 0; j < width; j++) xt[j] /= r;
            }
        }
    }
    /* The code range: each row's largest magnitude, clipped at the point
     * that minimises the error of a uniform quantiser of this many levels on
     * unit-variance values (the rows are at RMS 1 now): few bits spend
     * their levels on the bulk and clamp the rare tail. */
    static const float clip[KVARN_MAX_BITS + 1] = {0, 0, 1.71f, 2.15f, 2.55f, 2.94f, 3.29f, 3.61f, 3.92f};
    for (int t = 0; t < T; t++) {
        float m = 0, *xt = x + (size_t)t * width;
        for (int j = 0; j < width; j++) m = fabsf(xt[j]) > m ? fabsf(xt[j]) : m;
        if (m > clip[bits]) m = clip[bits];
        if (m > 0.0f && isfinite(m)) row_f[t] *= m;
    }
    /* The stored (fp16) factors are the ones the codes are relative to. */
    uint8_t *axes = out + code_bytes(width, bits);
    for (int j = 0; j < width; j++) {
        col[j] = factor16(col[j]);
        uint16_t h = quant_f32_to_f16(col[j]);
        memcpy(axes + 2 * (size_t)j, &h, 2);
    }
    for (int t = 0; t < T; t++) {
        row_f[t] = factor16(row_f[t]);
        uint16_t h = quant_f32_to_f16(row_f[t]);
        memcpy(axes + 2 * ((size_t)width + (size_t)t), &h, 2);
    }
    memset(out, 0, code_bytes(width, bits));
    const float L = (float)((1 << bits) - 1);
    uint64_t bit = 0;
    memcpy(x, rows, (size_t)T * (size_t)width * sizeof(float));
    for (int t = 0; t < T; t++) {
        float *xt = x + (size_t)t * width;
        kvarn_rotate(xt, width, head_dim);
        for (int j = 0; j < width; j++, bit += (uint64_t)bits) {
            float v = xt[j] / (row_f[t] * col[j]);
            v = v < -1.0f ? -1.0f : v > 1.0f ? 1.0f : v;
            if (v != v) v = 0.0f;
            uint32_t code = (uint32_t)floorf((v + 1.0f) * L * 0.5f + 0.5f);
            for (int b = 0; b < bits; b++)
                if (code >> b & 1u) out[(bit + (uint64_t)b) / 8] |= (uint8_t)(1u << ((bit + (uint64_t)b) % 8));
        }
    }
    size_t used = code_bytes(width, bits) + 2 * ((size_t)width + KVARN_GROUP);
    if (used < rec_bytes) memset(out + used, 0, rec_bytes - used);
    free(x);
    free(col);
}

void kvarn_decode(const void *record, int width, int head_dim, int bits, float *rows) {
    const uint8_t *in = record;
    const uint8_t *axes = in + code_bytes(width, bits);
    const float step = 2.0f / (float)((1 << bits) - 1);
    uint64_t bit = 0;
    for (int t = 0; t < KVARN_GROUP; t++) {
        uint16_t h;
        memcpy(&h, axes + 2 * ((size_t)width + (size_t)t), 2);
        float rf = quant_f16_to_f32(h);
        float *xt = rows + (size_t)t * width;
        for (int j = 0; j < width; j++, bit += (uint64_t)bits) {
            uint32_t code = 0;
            for (int b = 0; b < bits; b++) code |= (uint32_t)(in[(bit + (uint64_t)b) / 8] >> ((bit + (uint64_t)b) % 8) & 1u) << b;
            memcpy(&h, axes + 2 * (size_t)j, 2);
            xt[j] = ((float)code * step - 1.0f) * (rf * quant_f16_to_f32(h));
        }
        kvarn_rotate(xt, width, head_dim);
    }
}

/* ---- The sealing rule ---- */

bool kvarn_group_sealed(int64_t g, int64_t p, int64_t tail) {
    return g >= 1 && (int64_t)KVARN_GROUP * (g + 1) + tail <= p;
}

int64_t kvarn_sealed_end(int64_t p, int64_t tail) {
    int64_t room = p - tail;
    if (room < 2 * KVARN_GROUP) return 1;
    return room / KVARN_GROUP; /* g + 1 <= room / 128 for every sealed g */
}

/* ---- Records in row slots ---- */

size_t kvarn_slot_codes_bytes(int width, int bits) { return (size_t)width * (size_t)bits / 8; }

/* Column factors per slot: the bytes after codes, row factor and marker. */
static size_t columns_per_slot(int width, int bits, size_t slot_bytes) {
    size_t used = kvarn_slot_codes_bytes(width, bits) + 4;
    return used < slot_bytes ? (slot_bytes - used) / 2 : 0;
}

bool kvarn_slots_fit(int width, size_t slot_bytes) {
    if (width < 8 || width % 8 != 0) return false;
    size_t per = columns_per_slot(width, KVARN_MAX_BITS, slot_bytes);
    return per > 0 && ((size_t)width + per - 1) / per <= KVARN_GROUP;
}

static const uint16_t SEAL_MARK = 0xFFFF;

void kvarn_record_to_slots(const void *record, int width, int bits, size_t slot_bytes, kvarn_slot_fn slot, void *ctx) {
    const uint8_t *in = record;
    size_t cb = kvarn_slot_codes_bytes(width, bits), per = columns_per_slot(width, bits, slot_bytes);
    const uint8_t *cols = in + code_bytes(width, bits), *rows = cols + 2 * (size_t)width;
    for (int t = 0; t < KVARN_GROUP; t++) {
        uint8_t *s = slot(ctx, t);
        memcpy(s, in + (size_t)t * cb, cb);
        memcpy(s + cb, rows + 2 * (size_t)t, 2);
        uint16_t mark = t == 0 ? SEAL_MARK : 0;
        memcpy(s + cb + 2, &mark, 2);
        size_t c0 = (size_t)t * per;
        size_t n = c0 < (size_t)width ? ((size_t)width - c0 < per ? (size_t)width - c0 : per) : 0;
        memset(s + cb + 4, 0, slot_bytes - cb - 4);
        if (n) memcpy(s + cb + 4, cols + 2 * c0, 2 * n);
    }
}

void kvarn_slots_to_record(int width, int bits, size_t slot_bytes, kvarn_slot_fn slot, void *ctx, void *record) {
    uint8_t *out = record;
    size_t cb = kvarn_slot_codes_bytes(width, bits), per = columns_per_slot(width, bits, slot_bytes);
    uint8_t *cols = out + code_bytes(width, bits), *rows = cols + 2 * (size_t)width;
    memset(out, 0, kvarn_record_bytes(width, bits));
    for (int t = 0; t < KVARN_GROUP; t++) {
        const uint8_t *s = slot(ctx, t);
        memcpy(out + (size_t)t * cb, s, cb);
        memcpy(rows + 2 * (size_t)t, s + cb, 2);
        size_t c0 = (size_t)t * per;
        size_t n = c0 < (size_t)width ? ((size_t)width - c0 < per ? (size_t)width - c0 : per) : 0;
        if (n) memcpy(cols + 2 * c0, s + cb + 4, 2 * n);
    }
}

bool kvarn_slot0_sealed(const uint8_t *slot0, int width, int bits) {
    uint16_t m;
    memcpy(&m, slot0 + kvarn_slot_codes_bytes(width, bits) + 2, 2);
    return m == SEAL_MARK;
}

void kvarn_slot_columns(int width, int bits, size_t slot_bytes, kvarn_slot_fn slot, void *ctx, int c0, int n,
                        float *out) {
    size_t cb = kvarn_slot_codes_bytes(width, bits), per = columns_per_slot(width, bits, slot_bytes);
    for (int i = 0; i < n; i++) {
        size_t c = (size_t)(c0 + i);
        const uint8_t *s = slot(ctx, (int)(c / per));
        uint16_t h;
        memcpy(&h, s + cb + 4 + 2 * (c % per), 2);
        out[i] = quant_f16_to_f32(h);
    }
}
