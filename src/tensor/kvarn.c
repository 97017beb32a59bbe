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

/* ---- Compact records in a pool's regions ---- */

enum { HEADER_BYTES = 64, PIECE_ALIGN = 64 };

static size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* Places `bytes` unsplittable bytes at the cursor (region, offset). */
static int place_whole(size_t region_bytes, int *region, size_t *offset, size_t bytes, kvarn_span *out) {
    size_t off = align_up(*offset, PIECE_ALIGN);
    if (off + bytes > region_bytes) {
        ++*region;
        off = 0;
    }
    if (*region >= KVARN_MAX_REGIONS || bytes > region_bytes) return -1;
    *out = (kvarn_span){(int16_t)*region, 0, KVARN_GROUP, (uint32_t)off};
    *offset = off + bytes;
    return 0;
}

/* Places 128 tokens of tok_bytes each, split at token boundaries where a
 * region ends. */
static int place_tokens(size_t region_bytes, int *region, size_t *offset, size_t tok_bytes, kvarn_span *spans,
                        int *n_spans) {
    int t = 0;
    *n_spans = 0;
    size_t off = align_up(*offset, PIECE_ALIGN);
    while (t < KVARN_GROUP) {
        size_t fit = off < region_bytes ? (region_bytes - off) / tok_bytes : 0;
        if (fit == 0) {
            ++*region;
            off = 0;
            if (*region >= KVARN_MAX_REGIONS || tok_bytes > region_bytes) return -1;
            continue;
        }
        int n = KVARN_GROUP - t < (int)fit ? KVARN_GROUP - t : (int)fit;
        spans[(*n_spans)++] = (kvarn_span){(int16_t)*region, (int16_t)t, (int16_t)(t + n), (uint32_t)off};
        t += n;
        off += (size_t)n * tok_bytes;
    }
    *offset = off;
    return 0;
}

int kvarn_layout_plan(kvarn_layout *lay, int k_width, int v_width, int k_head, int v_head, int k_bits, int v_bits,
                      size_t region_bytes) {
    memset(lay, 0, sizeof *lay);
    lay->width[0] = k_width;
    lay->width[1] = v_width;
    lay->head[0] = k_head > 0 ? k_head : k_width;
    lay->head[1] = v_head > 0 ? v_head : v_width;
    lay->bits[0] = k_bits;
    lay->bits[1] = v_bits;
    lay->region_bytes = region_bytes;
    if (k_width == 0 && v_width == 0) return 0;
    int region = 0;
    size_t offset = HEADER_BYTES;
    if (offset > region_bytes) return -1;
    for (int kv = 0; kv < 2; kv++) {
        int w = lay->width[kv], d = lay->head[kv];
        if (w == 0) continue;
        if (d % 8 != 0 || w % d != 0 || w / d > KVARN_MAX_KV_HEADS) return -1;
        lay->n_heads[kv] = w / d;
        if (place_whole(region_bytes, &region, &offset, 2 * ((size_t)w + KVARN_GROUP), &lay->factors[kv]) < 0)
            return -1;
        for (int h = 0; h < lay->n_heads[kv]; h++)
            if (place_tokens(region_bytes, &region, &offset, kvarn_head_token_bytes(lay, kv), lay->spans[kv][h],
                             &lay->n_spans[kv][h]) < 0)
                return -1;
    }
    lay->n_regions = region + 1;
    return 0;
}

void kvarn_layout_clear(const kvarn_layout *lay, uint8_t *const *regions) {
    for (int r = 0; r < lay->n_regions; r++) memset(regions[r], 0, lay->region_bytes);
    uint32_t head[2] = {KVARN_MARK, KVARN_LAYOUT_VERSION};
    memcpy(regions[0], head, sizeof head);
}

bool kvarn_region0_sealed(const uint8_t *region0) {
    uint32_t m;
    memcpy(&m, region0, 4);
    return m == KVARN_MARK;
}

void kvarn_head_codes(const kvarn_layout *lay, int kv, int h, const uint8_t *const *regions, const uint8_t **codes) {
    size_t tb = kvarn_head_token_bytes(lay, kv);
    for (int s = 0; s < lay->n_spans[kv][h]; s++) {
        const kvarn_span *sp = &lay->spans[kv][h][s];
        const uint8_t *base = regions[sp->region] + sp->offset;
        for (int t = sp->t0; t < sp->t1; t++) codes[t] = base + (size_t)(t - sp->t0) * tb;
    }
}

/* Copies between kvarn_encode's record and the pieces (out: record -> regions). */
static void record_pieces(const kvarn_layout *lay, int kv, uint8_t *record, uint8_t *const *regions, bool out) {
    int w = lay->width[kv], bits = lay->bits[kv];
    if (w == 0) return;
    size_t cb = code_bytes(w, bits), row_cb = (size_t)w * (size_t)bits / 8, tb = kvarn_head_token_bytes(lay, kv);
    uint8_t *f = regions[lay->factors[kv].region] + lay->factors[kv].offset;
    size_t fb = 2 * ((size_t)w + KVARN_GROUP);
    if (out) memcpy(f, record + cb, fb);
    else memcpy(record + cb, f, fb);
    const uint8_t *codes[KVARN_GROUP];
    for (int h = 0; h < lay->n_heads[kv]; h++) {
        kvarn_head_codes(lay, kv, h, (const uint8_t *const *)regions, codes);
        for (int t = 0; t < KVARN_GROUP; t++) {
            uint8_t *rec = record + (size_t)t * row_cb + (size_t)h * tb, *piece = (uint8_t *)codes[t];
            if (out) memcpy(piece, rec, tb);
            else memcpy(rec, piece, tb);
        }
    }
}

void kvarn_record_to_regions(const kvarn_layout *lay, int kv, const void *record, uint8_t *const *regions) {
    record_pieces(lay, kv, (uint8_t *)record, regions, true);
}

void kvarn_regions_to_record(const kvarn_layout *lay, int kv, const uint8_t *const *regions, void *record) {
    memset(record, 0, kvarn_record_bytes(lay->width[kv], lay->bits[kv]));
    record_pieces(lay, kv, record, (uint8_t *const *)regions, false);
}
