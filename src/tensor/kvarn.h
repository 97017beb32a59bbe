/* kvarn.h - the kvarn record codec: 128 consecutive K (or V) rows of one
 * layer quantized together to 2-8 bits a value.
 *
 * Contract:
 *  - A record holds KVARN_GROUP rows of `width` values (all kv heads of one
 *    layer, head_dim values per head). Encoding, in order:
 *      1. rotation: each head is cut into slices of kvarn_slice(head_dim)
 *         values (the largest power of two <= 128 that divides the head:
 *         128 for heads of 128 or 256, 8 for stories260K's heads of 8) and
 *         every slice is multiplied by the orthonormal Walsh-Hadamard
 *         matrix H / sqrt(S), which spreads outlier channels over the slice;
 *      2. normalisation along both axes: two rounds of dividing every
 *         column (channel) by its RMS over the 128 rows, then every row by
 *         its RMS over the channels; finally each row by its largest
 *         magnitude (clipped, below), so every value lies in [-1, 1]. The products of the
 *         column and of the row factors are kept as fp16 (`axes`), and the
 *         values are normalised with those rounded factors; the last row
 *         scale is clipped for few bits (1.71 RMS at 2 bits ... 3.92 at 8:
 *         the error-minimising range of a uniform quantiser on unit-variance
 *         values) and values beyond it are clamped;
 *      3. uniform codes of `bits` bits: code = round((x + 1) * (2^bits - 1) / 2),
 *         packed least significant bit first.
 *    Layout: codes (ceil(128 * width * bits / 8) bytes), then width column
 *    factors and 128 row factors (fp16), zero-padded to a multiple of 4.
 *  - Decoding inverts it: (code * 2 / (2^bits - 1) - 1) * row * column, then
 *    the same rotation (H / sqrt(S) is its own inverse).
 *  - Both are functions of the 128 rows alone and deterministic, so a
 *    record sealed by one request equals the record another request seals
 *    from the same rows (the cache's warm == cold invariant).
 *  - KVARN_LAYOUT_VERSION names this layout; anything that stores records
 *    (cache entries, files) must key on it with the widths and the tail. */
#ifndef EMBER_TENSOR_KVARN_H
#define EMBER_TENSOR_KVARN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVARN_LAYOUT_VERSION 2  /* 2: compact head-major records (1: records in the fp16 row slots) */
#define KVARN_GROUP 128      /* rows per record; also the fp16 sink's length */
#define KVARN_MIN_BITS 2
#define KVARN_MAX_BITS 8

/* ---- Layout ---- */
int kvarn_slice(int head_dim);                       /* 0 when head_dim is odd */
size_t kvarn_record_bytes(int width, int bits);

/* ---- The sealing rule (a KV pool of this format, kv_pool.h) ----
 * Group g (positions [128 g, 128 g + 128)) is read as a record by a query
 * at position p iff g >= 1 (group 0 is the fp16 sink) and
 * 128 (g + 1) + tail <= p: the newest `tail` tokens and the group being
 * filled stay fp16. A function of positions only. */
bool kvarn_group_sealed(int64_t g, int64_t p, int64_t tail);
/* The groups sealed for a query at p are [1, end); end >= 1. */
int64_t kvarn_sealed_end(int64_t p, int64_t tail);

/* ---- A sealed group in a pool: compact, head-major records ----
 * A pool block holds one layer's 16 K rows then 16 V rows in one run of
 * bytes, the layer's "region" of that block; a 128-token group spans the
 * regions of 8 blocks. A sealed group's K and V records of one layer are
 * laid out in the first regions of its blocks (kvarn_layout_plan):
 *   region 0 starts with a 64-byte header (KVARN_MARK in its first 4 bytes,
 *     bytes an fp16 row never holds: two negative NaNs with every mantissa
 *     bit set, then KVARN_LAYOUT_VERSION);
 *   then per kind (K, then V): the factors (kvarn_encode's: `width` column
 *     factors then 128 row factors, fp16), then one piece per kv head: that
 *     head's codes of the 128 tokens, token-major (token t's head values at
 *     t * head * bits / 8), so attention over one head streams one run of
 *     bytes. A piece starts on a 64-byte boundary; a piece too long for the
 *     rest of a region continues in the next one at a token boundary (a
 *     span). Bytes of the used regions outside the pieces are zero, so a
 *     sealed group is a function of its rows.
 * The regions after the used ones are not read once a group is sealed: the
 * pool gives their blocks back (kv_pool.h). */
#define KVARN_MARK 0xFFFFFFFFu
#define KVARN_MAX_KV_HEADS 64
#define KVARN_MAX_REGIONS (KVARN_GROUP / 16)

typedef struct kvarn_span {
    int16_t region;      /* 0 .. KVARN_MAX_REGIONS - 1 */
    int16_t t0, t1;      /* tokens [t0, t1) of the piece */
    uint32_t offset;     /* byte offset of token t0 in the region */
} kvarn_span;

typedef struct kvarn_layout {
    int width[2], head[2], bits[2], n_heads[2];  /* [0] = K, [1] = V */
    size_t region_bytes;
    int n_regions;                               /* regions the records use */
    kvarn_span factors[2];                       /* never split */
    int n_spans[2][KVARN_MAX_KV_HEADS];
    kvarn_span spans[2][KVARN_MAX_KV_HEADS][KVARN_MAX_REGIONS];
} kvarn_layout;

/* Plans the records of one layer (K rows of k_width values in heads of
 * k_head, V likewise; a width 0 has no record) in regions of region_bytes.
 * -1 when they need more than KVARN_MAX_REGIONS regions, a head is not a
 * multiple of 8 values, or there are more than KVARN_MAX_KV_HEADS heads. */
int kvarn_layout_plan(kvarn_layout *lay, int k_width, int v_width, int k_head, int v_head, int k_bits, int v_bits,
                      size_t region_bytes);
/* Bytes of one token's codes in one head piece. */
static inline size_t kvarn_head_token_bytes(const kvarn_layout *lay, int kv) {
    return (size_t)lay->head[kv] * (size_t)lay->bits[kv] / 8;
}
/* regions[r]: the start of region r of the group (r < lay->n_regions). */
void kvarn_layout_clear(const kvarn_layout *lay, uint8_t *const *regions);   /* zeroes, then the header */
void kvarn_record_to_regions(const kvarn_layout *lay, int kv, const void *record, uint8_t *const *regions);
void kvarn_regions_to_record(const kvarn_layout *lay, int kv, const uint8_t *const *regions, void *record);
bool kvarn_region0_sealed(const uint8_t *region0);
/* The factors of a sealed group: column factors (width), then 128 row factors. */
static inline const uint8_t *kvarn_factors_at(const kvarn_layout *lay, int kv, const uint8_t *const *regions) {
    return regions[lay->factors[kv].region] + lay->factors[kv].offset;
}
/* codes[t] = token t's codes of head h (128 pointers). */
void kvarn_head_codes(const kvarn_layout *lay, int kv, int h, const uint8_t *const *regions, const uint8_t **codes);

/* ---- Codec ---- */
/* In place: every slice of every head times H / sqrt(S); its own inverse. */
void kvarn_rotate(float *row, int width, int head_dim);
/* rows: (KVARN_GROUP, width) floats -> record (kvarn_record_bytes). */
void kvarn_encode(const float *rows, int width, int head_dim, int bits, void *record);
/* record -> rows (KVARN_GROUP, width). */
void kvarn_decode(const void *record, int width, int head_dim, int bits, float *rows);

#endif
