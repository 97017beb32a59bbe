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

#include <stddef.h>
#include <stdint.h>

#define KVARN_LAYOUT_VERSION 1
#define KVARN_GROUP 128      /* rows per record; also the fp16 sink's length */
#define KVARN_MIN_BITS 2
#define KVARN_MAX_BITS 8

/* ---- Layout ---- */
int kvarn_slice(int head_dim);                       /* 0 when head_dim is odd */
size_t kvarn_record_bytes(int width, int bits);

/* ---- Codec ---- */
/* In place: every slice of every head times H / sqrt(S); its own inverse. */
void kvarn_rotate(float *row, int width, int head_dim);
/* rows: (KVARN_GROUP, width) floats -> record (kvarn_record_bytes). */
void kvarn_encode(const float *rows, int width, int head_dim, int bits, void *record);
/* record -> rows (KVARN_GROUP, width). */
void kvarn_decode(const void *record, int width, int head_dim, int bits, float *rows);

#endif
