/* kv_rows.h - how one K or V row is stored in the KV cache: f32, f16, q8_0
 * or q12h (the K rows of a q8_0 pool).
 *
 * Contract:
 *  - A row of `width` values (all kv heads of one position) is encoded in
 *    kv_row_bytes(type, width) bytes, a multiple of 4 so rows stay 32-bit
 *    aligned inside a block and the cache can copy rows as 32-bit words.
 *      f32   width floats, as is
 *      f16   width IEEE binary16 values (round to nearest even)
 *      q8_0  width / 32 blocks of (fp16 scale d, 32 int8 q), value = d * q,
 *            d = max|x| / 127 (ggml's Q8_0 rounding); width must be a
 *            multiple of 32 (kv_row_supported says so); the row is padded
 *            with zero bytes to a multiple of 4
 *      q12h  the row is first rotated: every 8-value slice x becomes H x,
 *            H the 8x8 Walsh-Hadamard matrix of +-1 entries (unnormalised,
 *            so H^T H = 8 I); then width / 32 blocks of (fp16 scale d,
 *            32 int8 hi, 16 bytes of 4-bit lo), value j = d * (16 hi_j +
 *            lo_j), a 12-bit integer in [-2047, 2047], d = max|Hx| / 2047;
 *            width a multiple of 32
 *  - A pool of row type T stores V rows as T and K rows as
 *    kv_row_key_type(T): q8_0 pools keep K in q12h (K's errors move the
 *    softmax logits; 8 bits were too coarse for them, see
 *    docs/kv-formats.md), every other type stores K and V alike.
 *  - Decoding a q12h row gives the *rotated* values. q.k = (H q / 8).(H k),
 *    so attention over q12h keys dots them with kv_row_query(q): the
 *    query rotated by the same H and scaled by 1/8 (exact). Heads must
 *    start and end on 8-value slices (head sizes a multiple of 8).
 *  - Encoding and decoding are functions of the row alone (no state, no
 *    neighbour), so a row written by one request is the row another request
 *    would have written: the cache's warm == cold invariant holds per format.
 *  - Decoding is exact arithmetic: f16 -> f32 is exact, and a q8_0 or q12h
 *    value is one f32 product d * q of the fp16 scale and an integer, so
 *    any code that decodes (scalar or SIMD) gets the same bits; attention
 *    over an encoded row therefore equals attention over the decoded values
 *    (with the query in kv_row_query's domain), bit for bit. */
#ifndef EMBER_TENSOR_KV_ROWS_H
#define EMBER_TENSOR_KV_ROWS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum kv_row_type {
    KV_ROW_F32 = 0,
    KV_ROW_F16 = 1,
    KV_ROW_Q8_0 = 2,
    KV_ROW_Q12H = 3,
} kv_row_type;

#define KV_ROW_Q8_0_BLOCK 32
#define KV_ROW_Q12H_BLOCK 32
/* q12h's rotation slice: heads of a q8_0 pool must be a multiple of it. */
#define KV_ROW_Q12H_SLICE 8

/* One q12h block: 32 values in 50 bytes. Value j is
 * d * (16 * hi[j] + (lo[j % 16] >> (4 * (j / 16)) & 15)): byte i of lo holds
 * the low 4 bits of value i and, in its high nibble, of value i + 16, so a
 * decoder widens 16 bytes and masks or shifts them for either half. */
typedef struct {
    uint16_t d;
    int8_t hi[32];
    uint8_t lo[16];
} kv_block_q12h;
/* The SIMD decoders read hi at byte 2 and lo at byte 34 of a block. */
_Static_assert(sizeof(kv_block_q12h) == 50 && offsetof(kv_block_q12h, hi) == 2 && offsetof(kv_block_q12h, lo) == 34,
               "q12h block layout");

/* ---- Sizes ---- */
bool kv_row_supported(kv_row_type type, int width);
size_t kv_row_bytes(kv_row_type type, int width);      /* 0 when width is 0 */
const char *kv_row_type_name(kv_row_type type);         /* "f32", "f16", "q8_0", "q12h" */

/* ---- K and V of one pool ---- */
kv_row_type kv_row_key_type(kv_row_type type);          /* q8_0 -> q12h, else type */
/* Whether decoded rows of `type` are rotated (attention rotates the query). */
bool kv_row_rotated(kv_row_type type);
/* The query of one or more heads (n values, heads on 8-value slices) in the
 * domain of decoded K rows of `type`: H q / 8 per slice for q12h, a copy
 * otherwise. dst may not alias q. */
void kv_row_query(kv_row_type type, const float *q, float *dst, int n);

/* ---- Conversion ---- */
void kv_row_encode(kv_row_type type, const float *src, void *dst, int width);
/* Values [offset, offset + n) of an encoded row into dst. */
void kv_row_decode(kv_row_type type, const void *row, int offset, int n, float *dst);

#endif
