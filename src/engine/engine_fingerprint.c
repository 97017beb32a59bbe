/* engine_fingerprint.c - the model fingerprint that names the SSD tier's namespace.
 *
 * It must change whenever the weights could, and never because of a path:
 * the XXH3-128 over the file size, the GGUF version and alignment, every
 * key/value of the header (names, types, scalars, strings, arrays), the
 * tensor table (name, dims, type, offset, size) and, per tensor, 64 bytes at
 * its start, middle and end. That touches three pages per tensor, so a
 * multi-gigabyte file is fingerprinted in milliseconds, and two files that
 * differ only in their weights (mkmodel with another seed) still differ in
 * every sample. */
#include <string.h>
#include <xxhash.h>

#include "engine/engine.h"

static void feed(XXH3_state_t *st, const void *p, size_t n) { XXH3_128bits_update(st, p, n); }

static void feed_u64(XXH3_state_t *st, uint64_t v) {
    uint8_t b[8];
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(v >> (8 * i));
    feed(st, b, 8);
}

static void feed_str(XXH3_state_t *st, const char *p, uint64_t len) {
    feed_u64(st, len);
    if (len) feed(st, p, (size_t)len);
}

void engine_model_fingerprint(const gguf_file *f, uint8_t out[16]) {
    memset(out, 0, 16);
    XXH3_state_t *st = XXH3_createState();
    if (st == NULL) return;
    XXH3_128bits_reset(st);
    feed_str(st, "ember-model-fp-1", 16);
    feed_u64(st, gguf_file_size(f));
    feed_u64(st, gguf_version(f));
    feed_u64(st, gguf_alignment(f));
    feed_u64(st, gguf_data_offset(f));
    int64_t n_kv = gguf_kv_count(f);
    feed_u64(st, (uint64_t)n_kv);
    for (int64_t i = 0; i < n_kv; i++) {
        const char *key = gguf_kv_key(f, i);
        feed_str(st, key, strlen(key));
        gguf_value_type t = gguf_kv_type(f, i);
        feed_u64(st, (uint64_t)t);
        int64_t iv;
        double dv;
        bool bv;
        gguf_str sv;
        if (t == GGUF_TYPE_ARRAY) {
            gguf_value_type et;
            uint64_t count;
            if (!gguf_kv_arr(f, i, &et, &count)) continue;
            feed_u64(st, (uint64_t)et);
            feed_u64(st, count);
            if (et == GGUF_TYPE_STRING) {
                for (uint64_t j = 0; j < count; j++) {
                    gguf_str e = gguf_arr_str(f, i, j);
                    feed_str(st, e.ptr, e.len);
                }
            } else {
                const void *data = gguf_arr_data(f, i);
                size_t es = gguf_type_size(et);
                if (data && es) feed(st, data, (size_t)count * es);
            }
        } else if (t == GGUF_TYPE_STRING && gguf_kv_str(f, i, &sv)) {
            feed_str(st, sv.ptr, sv.len);
        } else if ((t == GGUF_TYPE_FLOAT32 || t == GGUF_TYPE_FLOAT64) && gguf_kv_float(f, i, &dv)) {
            uint64_t bits;
            memcpy(&bits, &dv, 8);
            feed_u64(st, bits);
        } else if (t == GGUF_TYPE_BOOL && gguf_kv_bool(f, i, &bv)) {
            feed_u64(st, bv);
        } else if (gguf_kv_int(f, i, &iv)) {
            feed_u64(st, (uint64_t)iv);
        }
    }
    int64_t n_t = gguf_tensor_count(f);
    feed_u64(st, (uint64_t)n_t);
    for (int64_t i = 0; i < n_t; i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        feed_str(st, t->name, strlen(t->name));
        feed_u64(st, t->n_dims);
        for (int d = 0; d < 4; d++) feed_u64(st, (uint64_t)t->ne[d]);
        feed_u64(st, t->type);
        feed_u64(st, t->offset);
        feed_u64(st, t->nbytes);
        if (t->data == NULL || t->nbytes == 0) continue;
        const uint8_t *p = t->data;
        uint64_t take = t->nbytes < 64 ? t->nbytes : 64;
        feed(st, p, (size_t)take);
        feed(st, p + (t->nbytes - take) / 2, (size_t)take);
        feed(st, p + t->nbytes - take, (size_t)take);
    }
    XXH128_hash_t h = XXH3_128bits_digest(st);
    XXH3_freeState(st);
    for (int i = 0; i < 8; i++) {
        out[i] = (uint8_t)(h.low64 >> (8 * i));
        out[8 + i] = (uint8_t)(h.high64 >> (8 * i));
    }
}
