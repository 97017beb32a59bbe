/* gguf.h - reading and writing GGUF model files.
 *
 * Contract (reader): gguf_open maps the file read-only and validates all of
 * it before returning - header, every key/value (types, lengths, nesting),
 * every tensor info (name, rank, dims, type, offset alignment, bounds,
 * overlaps). A bad file is an error whose message names the byte offset and
 * the field; nothing is read past the end of the mapping afterwards. Strings
 * and tensor data point into the mapping and live until gguf_close. Files
 * that end before the data section (vocab-only files, 0 tensors) are valid.
 *
 * Contract (writer): collects metadata and tensor descriptions, then writes a
 * GGUF v3 file in one pass. Tensor payloads are either borrowed pointers
 * (valid until gguf_writer_write returns) or produced on demand by a
 * callback, so a multi-gigabyte model never needs to be in memory at once. */
#ifndef EMBER_GGUF_H
#define EMBER_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/error.h"

typedef enum gguf_value_type {
    GGUF_TYPE_UINT8 = 0,
    GGUF_TYPE_INT8 = 1,
    GGUF_TYPE_UINT16 = 2,
    GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4,
    GGUF_TYPE_INT32 = 5,
    GGUF_TYPE_FLOAT32 = 6,
    GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8,
    GGUF_TYPE_ARRAY = 9,
    GGUF_TYPE_UINT64 = 10,
    GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
    GGUF_TYPE_COUNT = 13,
} gguf_value_type;

typedef struct gguf_file gguf_file;

/* A borrowed string: not NUL-terminated, points into the mapping. */
typedef struct gguf_str {
    const char *ptr;
    uint64_t len;
} gguf_str;

typedef struct gguf_tensor {
    const char *name;    /* NUL-terminated copy */
    uint32_t n_dims;
    int64_t ne[4];       /* dims, fastest first; unused dims are 1 */
    uint32_t type;       /* ember_dtype / ggml type id */
    uint64_t offset;     /* relative to the data section */
    uint64_t nbytes;
    const void *data;    /* into the mapping */
} gguf_tensor;

/* ---- Reader: lifetime ---- */
gguf_file *gguf_open(const char *path, ember_error *err);
/* Parses an in-memory image (borrowed, must outlive the handle): for fuzzing. */
gguf_file *gguf_open_memory(const void *data, size_t size, ember_error *err);
void gguf_close(gguf_file *f);

/* ---- Reader: header ---- */
uint32_t gguf_version(const gguf_file *f);
uint32_t gguf_alignment(const gguf_file *f);
uint64_t gguf_data_offset(const gguf_file *f);
uint64_t gguf_file_size(const gguf_file *f);

/* ---- Reader: metadata ----
 * Keys are addressed by index (0..gguf_kv_count-1) or found by name (-1 when
 * absent). Scalar getters accept any width of the same family and return
 * false when the key is absent or of another family. */
int64_t gguf_kv_count(const gguf_file *f);
int64_t gguf_find_key(const gguf_file *f, const char *key);
const char *gguf_kv_key(const gguf_file *f, int64_t idx);
gguf_value_type gguf_kv_type(const gguf_file *f, int64_t idx);

bool gguf_get_int(const gguf_file *f, const char *key, int64_t *out);     /* any integer */
bool gguf_get_float(const gguf_file *f, const char *key, double *out);    /* f32/f64 */
bool gguf_get_bool(const gguf_file *f, const char *key, bool *out);
bool gguf_get_str(const gguf_file *f, const char *key, gguf_str *out);
/* Scalar access by index, for listing all metadata. */
bool gguf_kv_int(const gguf_file *f, int64_t idx, int64_t *out);
bool gguf_kv_float(const gguf_file *f, int64_t idx, double *out);
bool gguf_kv_str(const gguf_file *f, int64_t idx, gguf_str *out);
bool gguf_kv_bool(const gguf_file *f, int64_t idx, bool *out);

/* Arrays: element type and count; elements by position. */
bool gguf_get_arr(const gguf_file *f, const char *key, gguf_value_type *elem_type, uint64_t *count);
bool gguf_kv_arr(const gguf_file *f, int64_t idx, gguf_value_type *elem_type, uint64_t *count);
int64_t gguf_arr_int(const gguf_file *f, int64_t idx, uint64_t i);   /* integer/bool element */
double gguf_arr_float(const gguf_file *f, int64_t idx, uint64_t i);  /* float element */
gguf_str gguf_arr_str(const gguf_file *f, int64_t idx, uint64_t i);  /* string element */
/* Raw element storage for fixed-size element types (NULL for strings). */
const void *gguf_arr_data(const gguf_file *f, int64_t idx);

/* ---- Reader: tensors ---- */
int64_t gguf_tensor_count(const gguf_file *f);
const gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i);
const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name);

/* ---- Helpers ---- */
const char *gguf_type_name(gguf_value_type t);
size_t gguf_type_size(gguf_value_type t); /* 0 for string/array */
/* Copies a gguf_str into buf as a C string (truncating); returns buf. */
char *gguf_str_copy(gguf_str s, char *buf, size_t cap);
bool gguf_str_eq(gguf_str s, const char *cstr);

/* ---- Writer ---- */
typedef struct gguf_writer gguf_writer;
/* Produces tensor bytes on demand: fill dst (nbytes) and return 0, or -1. */
typedef int (*gguf_fill_fn)(void *user, void *dst, uint64_t nbytes, ember_error *err);

gguf_writer *gguf_writer_create(void);
void gguf_writer_free(gguf_writer *w);

/* Setting a key that exists replaces its value. Strings are copied. */
void gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v);
void gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v);
void gguf_writer_set_u64(gguf_writer *w, const char *key, uint64_t v);
void gguf_writer_set_f32(gguf_writer *w, const char *key, float v);
void gguf_writer_set_bool(gguf_writer *w, const char *key, bool v);
void gguf_writer_set_str(gguf_writer *w, const char *key, const char *v);
/* Array of fixed-size elements (copied). */
void gguf_writer_set_arr(gguf_writer *w, const char *key, gguf_value_type elem_type,
                         const void *data, uint64_t count);
/* Array of strings (copied); lens may be NULL for NUL-terminated strings. */
void gguf_writer_set_arr_str(gguf_writer *w, const char *key, const char *const *strs,
                             const uint64_t *lens, uint64_t count);
/* Copies key idx of an open file, whatever its type (for --vocab import). */
void gguf_writer_copy_kv(gguf_writer *w, const gguf_file *src, int64_t idx);

/* Tensors, written in the order added. data is borrowed until write. */
int gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                           const int64_t *ne, const void *data, ember_error *err);
int gguf_writer_add_tensor_fill(gguf_writer *w, const char *name, uint32_t type,
                                uint32_t n_dims, const int64_t *ne, gguf_fill_fn fill,
                                void *user, ember_error *err);
/* Writes to path via a temporary file and rename. */
int gguf_writer_write(gguf_writer *w, const char *path, ember_error *err);

#endif
