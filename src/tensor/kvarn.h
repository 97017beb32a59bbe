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

#define KVARN_LAYOUT_VERSION 1
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

/* ---- A sealed group in the rows of a pool ----
 * A group's record is stored in the 128 row slots its fp16 rows took
 * (slot_bytes each, the f16 row size, >= 2 * width): token t's codes in
 * bytes [0, width * bits / 8) of slot t, its row factor (fp16) right after,
 * then the marker (0xFFFF, an fp16 NaN no stored value has) in slot 0; the
 * width column factors (fp16) fill the bytes after that in slots 0, 1, ...
 * kvarn_slots_fit says whether a width fits (a multiple of 8, at least 8). */
bool kvarn_slots_fit(int width, size_t slot_bytes);
/* slot(t) gives the address of slot t (0..127). */
typedef uint8_t *(*kvarn_slot_fn)(void *ctx, int t);
void kvarn_record_to_slots(const void *record, int width, int bits, size_t slot_bytes, kvarn_slot_fn slot, void *ctx);
void kvarn_slots_to_record(int width, int bits, size_t slot_bytes, kvarn_slot_fn slot, void *ctx, void *record);
bool kvarn_slot0_sealed(const uint8_t *slot0, int width, int bits);
/* Byte offset of the row factor in a slot (= the codes' bytes). */
size_t kvarn_slot_codes_bytes(int width, int bits);
/* Column factors c0 .. c0 + n - 1 of a sealed group, as floats. */
void kvarn_slot_columns(int width, int bits, size_t slot_bytes, kvarn_slot_fn slot, void *ctx, int c0, int n,
                        float *out);

/* ---- Codec ---- */
/* In place: every slice of every head times H / sqrt(S); its own inverse. */
void kvarn_rotate(float *row, int width, int head_dim);
/* rows: (KVARN_GROUP, width) floats -> record (kvarn_record_bytes). */
void kvarn_encode(const float *rows, int width, int head_dim, int bits, void *record);
/* record -> rows (KVARN_GROUP, width). */
void kvarn_decode(const void *record, int width, int head_dim, int bits, float *rows);

#endif
