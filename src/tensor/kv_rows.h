/* kv_rows.h - how one K or V row is stored in the KV cache: f32, f16 or q8_0.
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
 *  - Encoding and decoding are functions of the row alone (no state, no
 *    neighbour), so a row written by one request is the row another request
 *    would have written: the cache's warm == cold invariant holds per format.
 *  - Decoding is exact arithmetic: f16 -> f32 is exact and a q8_0 value is
 *    one f32 product d * q, so any code that decodes (scalar or SIMD) gets the
 *    same bits; attention over an encoded row therefore equals attention over
 *    the decoded values, bit for bit. */
#ifndef EMBER_TENSOR_KV_ROWS_H
#define EMBER_TENSOR_KV_ROWS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum kv_row_type {
    KV_ROW_F32 = 0,
    KV_ROW_F16 = 1,
    KV_ROW_Q8_0 = 2,
} kv_row_type;

#define KV_ROW_Q8_0_BLOCK 32

/* ---- Sizes ---- */
bool kv_row_supported(kv_row_type type, int width);
size_t kv_row_bytes(kv_row_type type, int width);      /* 0 when width is 0 */
const char *kv_row_type_name(kv_row_type type);         /* "f32", "f16", "q8_0" */

/* ---- Conversion ---- */
void kv_row_encode(kv_row_type type, const float *src, void *dst, int width);
/* Values [offset, offset + n) of an encoded row into dst. */
void kv_row_decode(kv_row_type type, const void *row, int offset, int n, float *dst);

#endif
