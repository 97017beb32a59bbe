/* gguf_reader.c - validating GGUF reader over a read-only mapping.
 *
 * Design: the whole header (metadata and tensor infos) is parsed once, up
 * front, by a bounds-checked cursor; every read names the field it is reading
 * so a failure message can say "offset 1234: tensor 7 ('blk.0.attn_q.weight')
 * dims: ...". After gguf_open succeeds, all accessors are plain lookups into
 * arrays built during the parse, and no accessor can read outside the file:
 * string arrays keep a table of element offsets, fixed-size arrays were
 * checked against the remaining bytes, tensors against the data section.
 *
 * Limits that are not in the format but protect the process: at most 1M
 * keys, 1M tensors and arrays no longer than the file; anything beyond is an
 * "absurd count" error rather than an allocation attempt. */
#include "gguf/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "tensor/dtype.h"

enum { GGUF_MAX_KV = 1 << 20, GGUF_MAX_TENSORS = 1 << 20, GGUF_MAX_NAME = 64 };

typedef struct gguf_kv {
    gguf_str key;
    gguf_value_type type;
    gguf_value_type elem_type; /* arrays only */
    uint64_t count;            /* arrays only */
    const uint8_t *value;      /* scalar value or first array element */
    uint64_t *str_offsets;     /* string arrays: (count) offsets of each element's length field */
    char *key_cstr;            /* NUL-terminated copy of key */
} gguf_kv;

struct gguf_file {
    const uint8_t *base;
    size_t size;
    bool mapped;
    uint32_t version;
    uint32_t alignment;
    uint64_t data_offset;
    int64_t n_kv;
    gguf_kv *kvs;           /* (n_kv) */
    int64_t n_tensors;
    gguf_tensor *tensors;   /* (n_tensors) */
};

typedef struct cursor {
    const uint8_t *base;
    size_t size;
    size_t pos;
    ember_error *err;
} cursor;

static int need(cursor *c, uint64_t n, const char *field) {
    if (n > c->size || c->pos > c->size - n)
        return ember_fail(c->err, "offset %zu: %s: needs %llu bytes but the file ends at %zu",
                          c->pos, field, (unsigned long long)n, c->size);
    return 0;
}

static int read_bytes(cursor *c, void *dst, size_t n, const char *field) {
    if (need(c, n, field) < 0) return -1;
    memcpy(dst, c->base + c->pos, n);
    c->pos += n;
    return 0;
}

static int read_u32(cursor *c, uint32_t *v, const char *field) { return read_bytes(c, v, 4, field); }
static int read_u64(cursor *c, uint64_t *v, const char *field) { return read_bytes(c, v, 8, field); }

static int read_str(cursor *c, gguf_str *s, const char *field) {
    uint64_t len;
    size_t at = c->pos;
    if (read_u64(c, &len, field) < 0) return -1;
    if (need(c, len, field) < 0)
        return ember_fail(c->err, "offset %zu: %s: string length %llu runs past the end of the file (%zu bytes)",
                          at, field, (unsigned long long)len, c->size);
    s->ptr = (const char *)c->base + c->pos;
    s->len = len;
    c->pos += len;
    return 0;
}

size_t gguf_type_size(gguf_value_type t) {
    static const size_t sizes[GGUF_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return (unsigned)t < GGUF_TYPE_COUNT ? sizes[t] : 0;
}

const char *gguf_type_name(gguf_value_type t) {
    static const char *names[GGUF_TYPE_COUNT] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32",
                                                 "bool", "str", "arr", "u64", "i64", "f64"};
    return (unsigned)t < GGUF_TYPE_COUNT ? names[t] : "?";
}

char *gguf_str_copy(gguf_str s, char *buf, size_t cap) {
    if (cap == 0) return buf;
    size_t n = s.len < cap - 1 ? (size_t)s.len : cap - 1;
    memcpy(buf, s.ptr, n);
    buf[n] = '\0';
    return buf;
}

bool gguf_str_eq(gguf_str s, const char *cstr) {
    size_t n = strlen(cstr);
    return s.len == n && memcmp(s.ptr, cstr, n) == 0;
}

/* Parses one value of type t (not an array) at the cursor, checking bounds. */
static int skip_scalar(cursor *c, gguf_value_type t, const char *field) {
    if (t == GGUF_TYPE_STRING) {
        gguf_str s;
        return read_str(c, &s, field);
    }
    size_t sz = gguf_type_size(t);
    if (need(c, sz, field) < 0) return -1;
    if (t == GGUF_TYPE_BOOL && c->base[c->pos] > 1)
        return ember_fail(c->err, "offset %zu: %s: bool value %u is not 0 or 1", c->pos, field,
                          c->base[c->pos]);
    c->pos += sz;
    return 0;
}

static int parse_kv(gguf_file *f, cursor *c, int64_t i) {
    gguf_kv *kv = &f->kvs[i];
    char field[160];
    size_t at = c->pos;
    snprintf(field, sizeof field, "key %lld name", (long long)i);
    if (read_str(c, &kv->key, field) < 0) return -1;
    if (kv->key.len == 0) return ember_fail(c->err, "offset %zu: key %lld: empty key name", at, (long long)i);
    kv->key_cstr = malloc(kv->key.len + 1);
    if (kv->key_cstr == NULL) return ember_fail(c->err, "out of memory");
    gguf_str_copy(kv->key, kv->key_cstr, kv->key.len + 1);
    for (int64_t j = 0; j < i; j++)
        if (f->kvs[j].key.len == kv->key.len && memcmp(f->kvs[j].key.ptr, kv->key.ptr, kv->key.len) == 0)
            return ember_fail(c->err, "offset %zu: key '%s' appears twice", at, kv->key_cstr);

    snprintf(field, sizeof field, "key '%.100s' type", kv->key_cstr);
    uint32_t type;
    at = c->pos;
    if (read_u32(c, &type, field) < 0) return -1;
    if (type >= GGUF_TYPE_COUNT)
        return ember_fail(c->err, "offset %zu: key '%s': unknown value type %u", at, kv->key_cstr, type);
    kv->type = (gguf_value_type)type;
    snprintf(field, sizeof field, "key '%.100s' value", kv->key_cstr);
    if (kv->type != GGUF_TYPE_ARRAY) {
        kv->value = c->base + c->pos;
        return skip_scalar(c, kv->type, field);
    }

    uint32_t elem;
    at = c->pos;
    if (read_u32(c, &elem, field) < 0) return -1;
    if (elem >= GGUF_TYPE_COUNT || elem == GGUF_TYPE_ARRAY)
        return ember_fail(c->err, "offset %zu: key '%s': invalid array element type %u%s", at,
                          kv->key_cstr, elem, elem == GGUF_TYPE_ARRAY ? " (nested arrays are not allowed)" : "");
    kv->elem_type = (gguf_value_type)elem;
    at = c->pos;
    if (read_u64(c, &kv->count, field) < 0) return -1;
    size_t remaining = c->size - c->pos;
    if (kv->elem_type == GGUF_TYPE_STRING) {
        if (kv->count > remaining / 8)
            return ember_fail(c->err, "offset %zu: key '%s': absurd string array count %llu for %zu remaining bytes",
                              at, kv->key_cstr, (unsigned long long)kv->count, remaining);
        kv->value = c->base + c->pos;
        kv->str_offsets = malloc((kv->count ? kv->count : 1) * sizeof(uint64_t));
        if (kv->str_offsets == NULL) return ember_fail(c->err, "out of memory");
        for (uint64_t e = 0; e < kv->count; e++) {
            kv->str_offsets[e] = c->pos;
            snprintf(field, sizeof field, "key '%.100s' element %llu", kv->key_cstr, (unsigned long long)e);
            gguf_str s;
            if (read_str(c, &s, field) < 0) return -1;
        }
        return 0;
    }
    size_t esz = gguf_type_size(kv->elem_type);
    if (kv->count > remaining / esz)
        return ember_fail(c->err, "offset %zu: key '%s': absurd array count %llu of %s for %zu remaining bytes",
                          at, kv->key_cstr, (unsigned long long)kv->count, gguf_type_name(kv->elem_type), remaining);
    kv->value = c->base + c->pos;
    if (kv->elem_type == GGUF_TYPE_BOOL)
        for (uint64_t e = 0; e < kv->count; e++)
            if (kv->value[e] > 1)
                return ember_fail(c->err, "offset %zu: key '%s' element %llu: bool value %u is not 0 or 1",
                                  c->pos + e, kv->key_cstr, (unsigned long long)e, kv->value[e]);
    c->pos += kv->count * esz;
    return 0;
}

static int parse_tensor_info(gguf_file *f, cursor *c, int64_t i) {
    gguf_tensor *t = &f->tensors[i];
    char field[160];
    size_t at = c->pos;
    gguf_str name;
    snprintf(field, sizeof field, "tensor %lld name", (long long)i);
    if (read_str(c, &name, field) < 0) return -1;
    if (name.len == 0 || name.len >= GGUF_MAX_NAME)
        return ember_fail(c->err, "offset %zu: tensor %lld: name length %llu is not in 1..%d", at,
                          (long long)i, (unsigned long long)name.len, GGUF_MAX_NAME - 1);
    char *copy = malloc(name.len + 1);
    if (copy == NULL) return ember_fail(c->err, "out of memory");
    gguf_str_copy(name, copy, name.len + 1);
    t->name = copy;
    for (int64_t j = 0; j < i; j++)
        if (strcmp(f->tensors[j].name, copy) == 0)
            return ember_fail(c->err, "offset %zu: tensor name '%s' appears twice", at, copy);

    snprintf(field, sizeof field, "tensor '%s' n_dims", copy);
    at = c->pos;
    if (read_u32(c, &t->n_dims, field) < 0) return -1;
    if (t->n_dims < 1 || t->n_dims > 4)
        return ember_fail(c->err, "offset %zu: tensor '%s': n_dims %u is not in 1..4", at, copy, t->n_dims);
    uint64_t n_elems = 1;
    for (int d = 0; d < 4; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < t->n_dims; d++) {
        snprintf(field, sizeof field, "tensor '%s' dim %u", copy, d);
        at = c->pos;
        if (read_bytes(c, &t->ne[d], 8, field) < 0) return -1;
        if (t->ne[d] < 1 || t->ne[d] > ((int64_t)1 << 40))
            return ember_fail(c->err, "offset %zu: tensor '%s': dim %u = %lld is out of range", at, copy, d,
                              (long long)t->ne[d]);
        if (n_elems > (UINT64_MAX >> 2) / (uint64_t)t->ne[d])
            return ember_fail(c->err, "offset %zu: tensor '%s': element count overflows", at, copy);
        n_elems *= (uint64_t)t->ne[d];
    }
    snprintf(field, sizeof field, "tensor '%s' type", copy);
    at = c->pos;
    if (read_u32(c, &t->type, field) < 0) return -1;
    const dtype_info *info = dtype_info_of(t->type);
    if (info == NULL)
        return ember_fail(c->err, "offset %zu: tensor '%s': tensor type %u is not supported", at, copy, t->type);
    if (t->ne[0] % info->block_elems != 0)
        return ember_fail(c->err, "offset %zu: tensor '%s': row length %lld is not a multiple of the %s block (%d)",
                          at, copy, (long long)t->ne[0], info->name, info->block_elems);
    t->nbytes = n_elems / (uint64_t)info->block_elems * (uint64_t)info->block_bytes;
    snprintf(field, sizeof field, "tensor '%s' offset", copy);
    if (read_u64(c, &t->offset, field) < 0) return -1;
    return 0;
}

static int cmp_tensor_offset(const void *a, const void *b) {
    const gguf_tensor *x = *(const gguf_tensor *const *)a, *y = *(const gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static int check_tensor_layout(gguf_file *f, ember_error *err) {
    if (f->n_tensors == 0) return 0;
    if (f->data_offset > f->size)
        return ember_fail(err, "offset %zu: data section would start at %llu, past the end of the file",
                          f->size, (unsigned long long)f->data_offset);
    uint64_t data_size = f->size - f->data_offset;
    gguf_tensor **order = malloc((size_t)f->n_tensors * sizeof *order);
    if (order == NULL) return ember_fail(err, "out of memory");
    for (int64_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        order[i] = t;
        if (t->offset % f->alignment != 0) {
            free(order);
            return ember_fail(err, "tensor '%s': data offset %llu is not a multiple of the alignment %u", t->name,
                              (unsigned long long)t->offset, f->alignment);
        }
        if (t->offset > data_size || t->nbytes > data_size - t->offset) {
            free(order);
            return ember_fail(err, "tensor '%s': data [%llu, %llu) runs past the end of the file (data section is %llu bytes at offset %llu)",
                              t->name, (unsigned long long)t->offset, (unsigned long long)(t->offset + t->nbytes),
                              (unsigned long long)data_size, (unsigned long long)f->data_offset);
        }
        t->data = f->base + f->data_offset + t->offset;
    }
    qsort(order, (size_t)f->n_tensors, sizeof *order, cmp_tensor_offset);
    for (int64_t i = 1; i < f->n_tensors; i++) {
        if (order[i - 1]->offset + order[i - 1]->nbytes > order[i]->offset) {
            int rc = ember_fail(err, "tensors '%s' [%llu, %llu) and '%s' [%llu, ...) overlap", order[i - 1]->name,
                                (unsigned long long)order[i - 1]->offset,
                                (unsigned long long)(order[i - 1]->offset + order[i - 1]->nbytes), order[i]->name,
                                (unsigned long long)order[i]->offset);
            free(order);
            return rc;
        }
    }
    free(order);
    return 0;
}

static int parse(gguf_file *f, ember_error *err) {
    cursor c = {f->base, f->size, 0, err};
    char magic[4];
    if (read_bytes(&c, magic, 4, "magic") < 0) return -1;
    if (memcmp(magic, "GGUF", 4) != 0)
        return ember_fail(err, "offset 0: magic: expected 'GGUF', found %02x %02x %02x %02x (not a GGUF file)",
                          (unsigned char)magic[0], (unsigned char)magic[1], (unsigned char)magic[2],
                          (unsigned char)magic[3]);
    if (read_u32(&c, &f->version, "version") < 0) return -1;
    if (f->version == 1) return ember_fail(err, "offset 4: version: GGUF v1 is not supported (v2 and v3 are)");
    if (f->version != 2 && f->version != 3)
        return ember_fail(err, "offset 4: version: %u is not a supported GGUF version (2 or 3; big-endian files are not supported)",
                          f->version);
    int64_t n_tensors, n_kv;
    if (read_bytes(&c, &n_tensors, 8, "tensor count") < 0) return -1;
    if (read_bytes(&c, &n_kv, 8, "metadata count") < 0) return -1;
    if (n_tensors < 0 || n_tensors > GGUF_MAX_TENSORS || (uint64_t)n_tensors > f->size / 24)
        return ember_fail(err, "offset 8: tensor count: absurd value %lld for a %zu-byte file", (long long)n_tensors, f->size);
    if (n_kv < 0 || n_kv > GGUF_MAX_KV || (uint64_t)n_kv > f->size / 13)
        return ember_fail(err, "offset 16: metadata count: absurd value %lld for a %zu-byte file", (long long)n_kv, f->size);
    f->kvs = calloc((size_t)(n_kv ? n_kv : 1), sizeof *f->kvs);
    f->tensors = calloc((size_t)(n_tensors ? n_tensors : 1), sizeof *f->tensors);
    if (f->kvs == NULL || f->tensors == NULL) return ember_fail(err, "out of memory");
    for (int64_t i = 0; i < n_kv; i++) {
        f->n_kv = i + 1;
        if (parse_kv(f, &c, i) < 0) return -1;
    }
    f->alignment = 32;
    int64_t ai = gguf_find_key(f, "general.alignment");
    if (ai >= 0) {
        int64_t a;
        if (f->kvs[ai].type != GGUF_TYPE_UINT32 || !gguf_kv_int(f, ai, &a) || a <= 0 || (a & (a - 1)) != 0)
            return ember_fail(err, "key 'general.alignment': must be a u32 power of two");
        f->alignment = (uint32_t)a;
    }
    for (int64_t i = 0; i < n_tensors; i++) {
        f->n_tensors = i + 1;
        if (parse_tensor_info(f, &c, i) < 0) return -1;
    }
    f->data_offset = ((uint64_t)c.pos + f->alignment - 1) / f->alignment * f->alignment;
    return check_tensor_layout(f, err);
}

static gguf_file *open_image(const void *data, size_t size, bool mapped, ember_error *err) {
    gguf_file *f = calloc(1, sizeof *f);
    if (f == NULL) {
        if (mapped) munmap((void *)data, size);
        ember_fail(err, "out of memory");
        return NULL;
    }
    f->base = data;
    f->size = size;
    f->mapped = mapped;
    if (parse(f, err) < 0) {
        gguf_close(f);
        return NULL;
    }
    return f;
}

gguf_file *gguf_open_memory(const void *data, size_t size, ember_error *err) {
    return open_image(data, size, false, err);
}

gguf_file *gguf_open(const char *path, ember_error *err) {
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        ember_fail(err, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
        ember_fail(err, "%s: not a regular file", path);
        close(fd);
        return NULL;
    }
    if (st.st_size == 0) {
        ember_fail(err, "%s: offset 0: magic: the file is empty", path);
        close(fd);
        return NULL;
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) {
        ember_fail(err, "%s: mmap failed: %s", path, strerror(errno));
        return NULL;
    }
    gguf_file *f = open_image(map, (size_t)st.st_size, true, err);
    if (f == NULL) ember_fail_prefix(err, "%s", path);
    return f;
}

void gguf_close(gguf_file *f) {
    if (f == NULL) return;
    for (int64_t i = 0; i < f->n_kv; i++) {
        free(f->kvs[i].str_offsets);
        free(f->kvs[i].key_cstr);
    }
    for (int64_t i = 0; i < f->n_tensors; i++) free((void *)f->tensors[i].name);
    free(f->kvs);
    free(f->tensors);
    if (f->mapped) munmap((void *)f->base, f->size);
    free(f);
}

uint32_t gguf_version(const gguf_file *f) { return f->version; }
uint32_t gguf_alignment(const gguf_file *f) { return f->alignment; }
uint64_t gguf_data_offset(const gguf_file *f) { return f->data_offset; }
uint64_t gguf_file_size(const gguf_file *f) { return f->size; }
int64_t gguf_kv_count(const gguf_file *f) { return f->n_kv; }

int64_t gguf_find_key(const gguf_file *f, const char *key) {
    for (int64_t i = 0; i < f->n_kv; i++)
        if (f->kvs[i].key_cstr && strcmp(f->kvs[i].key_cstr, key) == 0) return i;
    return -1;
}

const char *gguf_kv_key(const gguf_file *f, int64_t idx) { return f->kvs[idx].key_cstr; }
gguf_value_type gguf_kv_type(const gguf_file *f, int64_t idx) { return f->kvs[idx].type; }

/* Reads one fixed-size element of type t at p as an integer; false if t is not integral. */
static bool load_int(gguf_value_type t, const uint8_t *p, int64_t *out) {
    switch (t) {
    case GGUF_TYPE_UINT8: *out = p[0]; return true;
    case GGUF_TYPE_INT8: *out = (int8_t)p[0]; return true;
    case GGUF_TYPE_BOOL: *out = p[0]; return true;
    case GGUF_TYPE_UINT16: { uint16_t v; memcpy(&v, p, 2); *out = v; return true; }
    case GGUF_TYPE_INT16: { int16_t v; memcpy(&v, p, 2); *out = v; return true; }
    case GGUF_TYPE_UINT32: { uint32_t v; memcpy(&v, p, 4); *out = v; return true; }
    case GGUF_TYPE_INT32: { int32_t v; memcpy(&v, p, 4); *out = v; return true; }
    case GGUF_TYPE_UINT64: { uint64_t v; memcpy(&v, p, 8); *out = (int64_t)v; return true; }
    case GGUF_TYPE_INT64: { int64_t v; memcpy(&v, p, 8); *out = v; return true; }
    default: return false;
    }
}

static bool load_float(gguf_value_type t, const uint8_t *p, double *out) {
    if (t == GGUF_TYPE_FLOAT32) { float v; memcpy(&v, p, 4); *out = v; return true; }
    if (t == GGUF_TYPE_FLOAT64) { double v; memcpy(&v, p, 8); *out = v; return true; }
    return false;
}

static gguf_str load_str(const uint8_t *p) {
    gguf_str s;
    memcpy(&s.len, p, 8);
    s.ptr = (const char *)p + 8;
    return s;
}

bool gguf_kv_int(const gguf_file *f, int64_t idx, int64_t *out) {
    if (idx < 0 || idx >= f->n_kv || f->kvs[idx].type == GGUF_TYPE_BOOL) return false;
    return load_int(f->kvs[idx].type, f->kvs[idx].value, out);
}

bool gguf_kv_float(const gguf_file *f, int64_t idx, double *out) {
    if (idx < 0 || idx >= f->n_kv) return false;
    return load_float(f->kvs[idx].type, f->kvs[idx].value, out);
}

bool gguf_kv_str(const gguf_file *f, int64_t idx, gguf_str *out) {
    if (idx < 0 || idx >= f->n_kv || f->kvs[idx].type != GGUF_TYPE_STRING) return false;
    *out = load_str(f->kvs[idx].value);
    return true;
}

bool gguf_get_int(const gguf_file *f, const char *key, int64_t *out) { return gguf_kv_int(f, gguf_find_key(f, key), out); }
bool gguf_get_float(const gguf_file *f, const char *key, double *out) { return gguf_kv_float(f, gguf_find_key(f, key), out); }
bool gguf_get_str(const gguf_file *f, const char *key, gguf_str *out) { return gguf_kv_str(f, gguf_find_key(f, key), out); }

bool gguf_kv_bool(const gguf_file *f, int64_t idx, bool *out) {
    if (idx < 0 || idx >= f->n_kv || f->kvs[idx].type != GGUF_TYPE_BOOL) return false;
    *out = f->kvs[idx].value[0] != 0;
    return true;
}

bool gguf_get_bool(const gguf_file *f, const char *key, bool *out) { return gguf_kv_bool(f, gguf_find_key(f, key), out); }

bool gguf_kv_arr(const gguf_file *f, int64_t idx, gguf_value_type *elem_type, uint64_t *count) {
    if (idx < 0 || idx >= f->n_kv || f->kvs[idx].type != GGUF_TYPE_ARRAY) return false;
    if (elem_type) *elem_type = f->kvs[idx].elem_type;
    if (count) *count = f->kvs[idx].count;
    return true;
}

bool gguf_get_arr(const gguf_file *f, const char *key, gguf_value_type *elem_type, uint64_t *count) {
    return gguf_kv_arr(f, gguf_find_key(f, key), elem_type, count);
}

int64_t gguf_arr_int(const gguf_file *f, int64_t idx, uint64_t i) {
    const gguf_kv *kv = &f->kvs[idx];
    int64_t v = 0;
    if (i < kv->count && kv->elem_type != GGUF_TYPE_STRING)
        load_int(kv->elem_type, kv->value + i * gguf_type_size(kv->elem_type), &v);
    return v;
}

double gguf_arr_float(const gguf_file *f, int64_t idx, uint64_t i) {
    const gguf_kv *kv = &f->kvs[idx];
    double v = 0;
    if (i < kv->count && kv->elem_type != GGUF_TYPE_STRING)
        load_float(kv->elem_type, kv->value + i * gguf_type_size(kv->elem_type), &v);
    return v;
}

gguf_str gguf_arr_str(const gguf_file *f, int64_t idx, uint64_t i) {
    const gguf_kv *kv = &f->kvs[idx];
    if (i >= kv->count || kv->elem_type != GGUF_TYPE_STRING) return (gguf_str){"", 0};
    return load_str(f->base + kv->str_offsets[i]);
}

const void *gguf_arr_data(const gguf_file *f, int64_t idx) {
    const gguf_kv *kv = &f->kvs[idx];
    return kv->elem_type == GGUF_TYPE_STRING ? NULL : kv->value;
}

int64_t gguf_tensor_count(const gguf_file *f) { return f->n_tensors; }
const gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i) { return &f->tensors[i]; }

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name) {
    for (int64_t i = 0; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
    return NULL;
}
