/* gguf_writer.c - builds a GGUF v3 file from metadata and tensor descriptions.
 *
 * Design: every key/value is serialized into its final byte form (type tag,
 * then payload) at the moment it is set, so writing the header is a plain
 * concatenation and copy_kv needs no knowledge of the value beyond its bytes.
 * Setters return void (as declared in gguf.h); an allocation failure or an
 * invalid argument is remembered in the writer and reported by
 * gguf_writer_write, so callers check once.
 *
 * Tensors are laid out in the order added. Each offset is the running sum of
 * the previous payloads, each padded with zeros to the alignment (32, or the
 * u32 power of two in general.alignment) - the layout llama.cpp requires.
 * Payloads are either borrowed (copied out at write time) or produced by a
 * fill callback into one reusable buffer sized for the largest tensor, so a
 * model bigger than memory can be written one tensor at a time.
 *
 * The file appears atomically: bytes go to "<path>.tmp", which is fsynced
 * and renamed over path only when everything succeeded; on any failure the
 * temporary file is removed and path is untouched. */
#include "gguf/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tensor/dtype.h"

enum { GGUF_WRITER_MAX_NAME = 64, GGUF_DEFAULT_ALIGNMENT = 32, WRITE_BUFFER_BYTES = 1 << 20 };

typedef struct writer_kv {
    char *key;
    gguf_value_type type;
    uint8_t *value;      /* serialized payload after the type tag */
    size_t value_len;
} writer_kv;

typedef struct writer_tensor {
    char *name;
    uint32_t type;
    uint32_t n_dims;
    int64_t ne[4];
    uint64_t nbytes;
    uint64_t offset;     /* assigned at write time */
    const void *data;    /* borrowed, or NULL when fill is used */
    gguf_fill_fn fill;
    void *user;
} writer_tensor;

struct gguf_writer {
    writer_kv *kvs;
    size_t n_kv, cap_kv;
    writer_tensor *tensors;
    size_t n_tensors, cap_tensors;
    /* First deferred problem from a void setter; reported by write. */
    char deferred_error[256];
};

/* ---- growable byte buffer used to serialize values ---- */

typedef struct bytebuf {
    uint8_t *data;
    size_t len, cap;
    bool oom;
} bytebuf;

static void buf_put(bytebuf *b, const void *src, size_t n) {
    if (b->oom) return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->len + n) cap *= 2;
        uint8_t *grown = realloc(b->data, cap);
        if (grown == NULL) {
            b->oom = true;
            return;
        }
        b->data = grown;
        b->cap = cap;
    }
    if (n) memcpy(b->data + b->len, src, n);
    b->len += n;
}

static void buf_put_u32(bytebuf *b, uint32_t v) { buf_put(b, &v, 4); }
static void buf_put_u64(bytebuf *b, uint64_t v) { buf_put(b, &v, 8); }
static void buf_put_str(bytebuf *b, const char *s, uint64_t len) {
    buf_put_u64(b, len);
    buf_put(b, s, (size_t)len);
}

/* ---- lifetime ---- */

gguf_writer *gguf_writer_create(void) { return calloc(1, sizeof(gguf_writer)); }

void gguf_writer_free(gguf_writer *w) {
    if (w == NULL) return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kvs[i].key);
        free(w->kvs[i].value);
    }
    for (size_t i = 0; i < w->n_tensors; i++) free(w->tensors[i].name);
    free(w->kvs);
    free(w->tensors);
    free(w);
}

static void defer_error(gguf_writer *w, const char *fmt, const char *arg) {
    if (w->deferred_error[0] == '\0') snprintf(w->deferred_error, sizeof w->deferred_error, fmt, arg);
}

/* ---- metadata ---- */

/* Stores key = (type, serialized payload); takes ownership of payload. A key
 * that is already present keeps its position and gets the new value. */
static void set_serialized(gguf_writer *w, const char *key, gguf_value_type type, bytebuf *payload) {
    if (payload->oom) {
        free(payload->data);
        defer_error(w, "out of memory setting key '%.200s'", key);
        return;
    }
    if (key == NULL || key[0] == '\0') {
        free(payload->data);
        defer_error(w, "%sempty metadata key name", "");
        return;
    }
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kvs[i].key, key) == 0) {
            free(w->kvs[i].value);
            w->kvs[i].type = type;
            w->kvs[i].value = payload->data;
            w->kvs[i].value_len = payload->len;
            return;
        }
    }
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? w->cap_kv * 2 : 32;
        writer_kv *grown = realloc(w->kvs, cap * sizeof *grown);
        if (grown == NULL) {
            free(payload->data);
            defer_error(w, "out of memory setting key '%.200s'", key);
            return;
        }
        w->kvs = grown;
        w->cap_kv = cap;
    }
    char *key_copy = strdup(key);
    if (key_copy == NULL) {
        free(payload->data);
        defer_error(w, "out of memory setting key '%.200s'", key);
        return;
    }
    w->kvs[w->n_kv++] = (writer_kv){key_copy, type, payload->data, payload->len};
}

static void set_scalar(gguf_writer *w, const char *key, gguf_value_type type, const void *v, size_t size) {
    bytebuf b = {0};
    buf_put(&b, v, size);
    set_serialized(w, key, type, &b);
}

void gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v) { set_scalar(w, key, GGUF_TYPE_UINT32, &v, 4); }
void gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v) { set_scalar(w, key, GGUF_TYPE_INT32, &v, 4); }
void gguf_writer_set_u64(gguf_writer *w, const char *key, uint64_t v) { set_scalar(w, key, GGUF_TYPE_UINT64, &v, 8); }
void gguf_writer_set_f32(gguf_writer *w, const char *key, float v) { set_scalar(w, key, GGUF_TYPE_FLOAT32, &v, 4); }

void gguf_writer_set_bool(gguf_writer *w, const char *key, bool v) {
    uint8_t byte = v ? 1 : 0;
    set_scalar(w, key, GGUF_TYPE_BOOL, &byte, 1);
}

void gguf_writer_set_str(gguf_writer *w, const char *key, const char *v) {
    bytebuf b = {0};
    buf_put_str(&b, v ? v : "", v ? strlen(v) : 0);
    set_serialized(w, key, GGUF_TYPE_STRING, &b);
}

void gguf_writer_set_arr(gguf_writer *w, const char *key, gguf_value_type elem_type, const void *data,
                         uint64_t count) {
    size_t esz = gguf_type_size(elem_type);
    if (esz == 0) {
        defer_error(w, "key '%.200s': gguf_writer_set_arr needs a fixed-size element type", key ? key : "");
        return;
    }
    if (elem_type == GGUF_TYPE_BOOL)
        for (uint64_t i = 0; i < count; i++)
            if (((const uint8_t *)data)[i] > 1) {
                defer_error(w, "key '%.200s': bool array element is not 0 or 1", key ? key : "");
                return;
            }
    bytebuf b = {0};
    buf_put_u32(&b, (uint32_t)elem_type);
    buf_put_u64(&b, count);
    if (count > SIZE_MAX / esz) b.oom = true;
    else buf_put(&b, data, (size_t)(count * esz));
    set_serialized(w, key, GGUF_TYPE_ARRAY, &b);
}

void gguf_writer_set_arr_str(gguf_writer *w, const char *key, const char *const *strs, const uint64_t *lens,
                             uint64_t count) {
    bytebuf b = {0};
    buf_put_u32(&b, GGUF_TYPE_STRING);
    buf_put_u64(&b, count);
    for (uint64_t i = 0; i < count; i++) buf_put_str(&b, strs[i], lens ? lens[i] : strlen(strs[i]));
    set_serialized(w, key, GGUF_TYPE_ARRAY, &b);
}

void gguf_writer_copy_kv(gguf_writer *w, const gguf_file *src, int64_t idx) {
    if (idx < 0 || idx >= gguf_kv_count(src)) {
        defer_error(w, "%scopy_kv: key index out of range", "");
        return;
    }
    const char *key = gguf_kv_key(src, idx);
    gguf_value_type type = gguf_kv_type(src, idx);
    bytebuf b = {0};
    if (type == GGUF_TYPE_STRING) {
        gguf_str s;
        gguf_kv_str(src, idx, &s);
        buf_put_str(&b, s.ptr, s.len);
    } else if (type == GGUF_TYPE_ARRAY) {
        gguf_value_type elem;
        uint64_t count;
        gguf_kv_arr(src, idx, &elem, &count);
        buf_put_u32(&b, (uint32_t)elem);
        buf_put_u64(&b, count);
        if (elem == GGUF_TYPE_STRING) {
            for (uint64_t i = 0; i < count; i++) {
                gguf_str s = gguf_arr_str(src, idx, i);
                buf_put_str(&b, s.ptr, s.len);
            }
        } else {
            /* The reader checked count * size against the file, so this fits. */
            buf_put(&b, gguf_arr_data(src, idx), (size_t)(count * gguf_type_size(elem)));
        }
    } else {
        /* Scalars: reconstruct the raw bytes through the typed getters. */
        size_t size = gguf_type_size(type);
        int64_t iv = 0;
        double fv = 0;
        bool bv = false;
        uint8_t raw[8] = {0};
        if (type == GGUF_TYPE_FLOAT32) {
            gguf_kv_float(src, idx, &fv);
            float f = (float)fv;
            memcpy(raw, &f, 4);
        } else if (type == GGUF_TYPE_FLOAT64) {
            gguf_kv_float(src, idx, &fv);
            memcpy(raw, &fv, 8);
        } else if (type == GGUF_TYPE_BOOL) {
            gguf_get_bool(src, key, &bv);
            raw[0] = bv ? 1 : 0;
        } else {
            /* Little-endian host: the low `size` bytes of the value are its encoding. */
            gguf_kv_int(src, idx, &iv);
            memcpy(raw, &iv, size);
        }
        buf_put(&b, raw, size);
    }
    set_serialized(w, key, type, &b);
}

/* ---- tensors ---- */

static int add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims, const int64_t *ne,
                      const void *data, gguf_fill_fn fill, void *user, ember_error *err) {
    size_t name_len = name ? strlen(name) : 0;
    if (name_len == 0 || name_len >= GGUF_WRITER_MAX_NAME)
        return ember_fail(err, "tensor name '%s': length %zu is not in 1..%d", name ? name : "", name_len,
                          GGUF_WRITER_MAX_NAME - 1);
    for (size_t i = 0; i < w->n_tensors; i++)
        if (strcmp(w->tensors[i].name, name) == 0) return ember_fail(err, "tensor '%s' added twice", name);
    if (n_dims < 1 || n_dims > 4) return ember_fail(err, "tensor '%s': n_dims %u is not in 1..4", name, n_dims);
    const dtype_info *info = dtype_info_of(type);
    if (info == NULL) return ember_fail(err, "tensor '%s': tensor type %u is not supported", name, type);
    writer_tensor t = {.type = type, .n_dims = n_dims, .data = data, .fill = fill, .user = user};
    uint64_t n_elems = 1;
    for (int d = 0; d < 4; d++) t.ne[d] = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (ne[d] < 1 || ne[d] > ((int64_t)1 << 40))
            return ember_fail(err, "tensor '%s': dim %u = %lld is out of range", name, d, (long long)ne[d]);
        if (n_elems > (UINT64_MAX >> 2) / (uint64_t)ne[d])
            return ember_fail(err, "tensor '%s': element count overflows", name);
        t.ne[d] = ne[d];
        n_elems *= (uint64_t)ne[d];
    }
    if (t.ne[0] % info->block_elems != 0)
        return ember_fail(err, "tensor '%s': row length %lld is not a multiple of the %s block (%d)", name,
                          (long long)t.ne[0], info->name, info->block_elems);
    t.nbytes = n_elems / (uint64_t)info->block_elems * (uint64_t)info->block_bytes;
    if (w->n_tensors == w->cap_tensors) {
        size_t cap = w->cap_tensors ? w->cap_tensors * 2 : 64;
        writer_tensor *grown = realloc(w->tensors, cap * sizeof *grown);
        if (grown == NULL) return ember_fail(err, "out of memory adding tensor '%s'", name);
        w->tensors = grown;
        w->cap_tensors = cap;
    }
    t.name = strdup(name);
    if (t.name == NULL) return ember_fail(err, "out of memory adding tensor '%s'", name);
    w->tensors[w->n_tensors++] = t;
    return 0;
}

int gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims, const int64_t *ne,
                           const void *data, ember_error *err) {
    if (data == NULL) return ember_fail(err, "tensor '%s': no data", name ? name : "");
    return add_tensor(w, name, type, n_dims, ne, data, NULL, NULL, err);
}

int gguf_writer_add_tensor_fill(gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                                const int64_t *ne, gguf_fill_fn fill, void *user, ember_error *err) {
    if (fill == NULL) return ember_fail(err, "tensor '%s': no fill callback", name ? name : "");
    return add_tensor(w, name, type, n_dims, ne, NULL, fill, user, err);
}

/* ---- output ---- */

/* Buffered sequential writer over a file descriptor; remembers the position
 * so that padding can be computed and errors can name the offset. */
typedef struct out_stream {
    int fd;
    uint8_t *buf;
    size_t len;
    uint64_t pos;
    const char *path;
    ember_error *err;
} out_stream;

static int write_all(out_stream *o, const uint8_t *p, size_t n) {
    while (n > 0) {
        ssize_t k = write(o->fd, p, n);
        if (k < 0) {
            if (errno == EINTR) continue;
            return ember_fail(o->err, "%s: write failed at offset %llu: %s", o->path,
                              (unsigned long long)(o->pos - o->len), strerror(errno));
        }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static int out_flush(out_stream *o) {
    if (o->len == 0) return 0;
    int rc = write_all(o, o->buf, o->len);
    o->len = 0;
    return rc;
}

static int out_put(out_stream *o, const void *src, uint64_t n) {
    const uint8_t *p = src;
    if (n >= WRITE_BUFFER_BYTES) { /* big payloads bypass the buffer */
        if (out_flush(o) < 0) return -1;
        o->pos += n;
        return write_all(o, p, (size_t)n);
    }
    if (o->len + n > WRITE_BUFFER_BYTES && out_flush(o) < 0) return -1;
    memcpy(o->buf + o->len, p, (size_t)n);
    o->len += (size_t)n;
    o->pos += n;
    return 0;
}

static int out_pad(out_stream *o, uint32_t alignment) {
    static const uint8_t zeros[256];
    uint64_t pad = (alignment - o->pos % alignment) % alignment;
    while (pad > 0) {
        uint64_t n = pad < sizeof zeros ? pad : sizeof zeros;
        if (out_put(o, zeros, n) < 0) return -1;
        pad -= n;
    }
    return 0;
}

static int resolve_alignment(const gguf_writer *w, uint32_t *alignment, ember_error *err) {
    *alignment = GGUF_DEFAULT_ALIGNMENT;
    for (size_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->kvs[i].key, "general.alignment") != 0) continue;
        uint32_t a = 0;
        if (w->kvs[i].type == GGUF_TYPE_UINT32) memcpy(&a, w->kvs[i].value, 4);
        if (w->kvs[i].type != GGUF_TYPE_UINT32 || a == 0 || (a & (a - 1)) != 0)
            return ember_fail(err, "key 'general.alignment': must be a u32 power of two");
        *alignment = a;
    }
    return 0;
}

static int write_contents(gguf_writer *w, out_stream *o, uint32_t alignment) {
    static const char magic[4] = {'G', 'G', 'U', 'F'};
    uint32_t version = 3;
    int64_t n_tensors = (int64_t)w->n_tensors, n_kv = (int64_t)w->n_kv;
    if (out_put(o, magic, 4) < 0 || out_put(o, &version, 4) < 0 || out_put(o, &n_tensors, 8) < 0 ||
        out_put(o, &n_kv, 8) < 0)
        return -1;
    for (size_t i = 0; i < w->n_kv; i++) {
        const writer_kv *kv = &w->kvs[i];
        uint64_t key_len = strlen(kv->key);
        uint32_t type = (uint32_t)kv->type;
        if (out_put(o, &key_len, 8) < 0 || out_put(o, kv->key, key_len) < 0 || out_put(o, &type, 4) < 0 ||
            out_put(o, kv->value, kv->value_len) < 0)
            return -1;
    }
    for (size_t i = 0; i < w->n_tensors; i++) {
        const writer_tensor *t = &w->tensors[i];
        uint64_t name_len = strlen(t->name);
        if (out_put(o, &name_len, 8) < 0 || out_put(o, t->name, name_len) < 0 || out_put(o, &t->n_dims, 4) < 0 ||
            out_put(o, t->ne, 8 * (uint64_t)t->n_dims) < 0 || out_put(o, &t->type, 4) < 0 ||
            out_put(o, &t->offset, 8) < 0)
            return -1;
    }
    if (w->n_tensors == 0) return out_flush(o); /* vocab-only files end after the header */
    if (out_pad(o, alignment) < 0) return -1;

    /* One scratch buffer, sized for the largest filled tensor, serves every fill. */
    uint64_t scratch_bytes = 0;
    for (size_t i = 0; i < w->n_tensors; i++)
        if (w->tensors[i].fill && w->tensors[i].nbytes > scratch_bytes) scratch_bytes = w->tensors[i].nbytes;
    uint8_t *scratch = NULL;
    if (scratch_bytes > 0) {
        if (scratch_bytes > SIZE_MAX || (scratch = malloc((size_t)scratch_bytes)) == NULL)
            return ember_fail(o->err, "out of memory: a %llu-byte buffer for tensor data",
                              (unsigned long long)scratch_bytes);
    }
    int rc = 0;
    for (size_t i = 0; i < w->n_tensors && rc == 0; i++) {
        const writer_tensor *t = &w->tensors[i];
        const void *payload = t->data;
        if (t->fill) {
            /* Zeroed first so a careless callback still yields a deterministic file. */
            memset(scratch, 0, (size_t)t->nbytes);
            if (t->fill(t->user, scratch, t->nbytes, o->err) < 0) {
                rc = ember_fail_prefix(o->err, "tensor '%s'", t->name);
                break;
            }
            payload = scratch;
        }
        rc = out_put(o, payload, t->nbytes);
        if (rc == 0) rc = out_pad(o, alignment);
    }
    free(scratch);
    if (rc == 0) rc = out_flush(o);
    return rc;
}

/* Makes the rename durable; failure here is not worth failing the write. */
static void sync_parent_dir(const char *path) {
    char *copy = strdup(path);
    if (copy == NULL) return;
    int dfd = open(dirname(copy), O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    free(copy);
}

int gguf_writer_write(gguf_writer *w, const char *path, ember_error *err) {
    if (w->deferred_error[0]) return ember_fail(err, "%s: %s", path, w->deferred_error);
    uint32_t alignment;
    if (resolve_alignment(w, &alignment, err) < 0) return ember_fail_prefix(err, "%s", path);
    uint64_t offset = 0;
    for (size_t i = 0; i < w->n_tensors; i++) {
        w->tensors[i].offset = offset;
        offset += (w->tensors[i].nbytes + alignment - 1) / alignment * alignment;
    }

    size_t path_len = strlen(path);
    char *tmp_path = malloc(path_len + 5);
    uint8_t *buf = malloc(WRITE_BUFFER_BYTES);
    if (tmp_path == NULL || buf == NULL) {
        free(tmp_path);
        free(buf);
        return ember_fail(err, "%s: out of memory", path);
    }
    memcpy(tmp_path, path, path_len);
    memcpy(tmp_path + path_len, ".tmp", 5);

    int fd = open(tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        int rc = ember_fail(err, "%s: cannot create: %s", tmp_path, strerror(errno));
        free(tmp_path);
        free(buf);
        return rc;
    }
    out_stream o = {fd, buf, 0, 0, tmp_path, err};
    int rc = write_contents(w, &o, alignment);
    if (rc == 0 && fsync(fd) < 0) rc = ember_fail(err, "%s: fsync failed: %s", tmp_path, strerror(errno));
    if (close(fd) < 0 && rc == 0) rc = ember_fail(err, "%s: close failed: %s", tmp_path, strerror(errno));
    if (rc == 0 && rename(tmp_path, path) < 0)
        rc = ember_fail(err, "%s: cannot rename %s over it: %s", path, tmp_path, strerror(errno));
    if (rc < 0) unlink(tmp_path);
    else sync_parent_dir(path);
    free(tmp_path);
    free(buf);
    return rc;
}
