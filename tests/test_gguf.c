/* test_gguf.c - GGUF reader and writer.
 *
 * Three kinds of check: round trips through the writer (every value type,
 * several tensor types, borrowed and filled payloads, custom alignment),
 * the real fixtures (known offsets from the sidecars, and a byte-exact
 * rewrite of llama.cpp-written files), and hostile input: hand-built images
 * with one defect each, every truncation of a small valid file, and a
 * deterministic mutation fuzz. Hostile images are always copied into an
 * allocation of exactly their size so ASan catches any read past the end. */
#define _GNU_SOURCE
#include "test_util.h"

#include <dirent.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf/gguf.h"
#include "tensor/dtype.h"

/* ------------------------------------------------------------------ */
/* Hand-built images                                                   */
/* ------------------------------------------------------------------ */

typedef struct image {
    uint8_t *p;
    size_t len, cap;
} image;

static void put(image *im, const void *src, size_t n) {
    if (im->len + n > im->cap) {
        im->cap = (im->len + n) * 2 + 64;
        im->p = realloc(im->p, im->cap);
        assert_non_null(im->p);
    }
    if (n) memcpy(im->p + im->len, src, n);
    im->len += n;
}
static void put_u8(image *im, uint8_t v) { put(im, &v, 1); }
static void put_u32(image *im, uint32_t v) { put(im, &v, 4); }
static void put_u64(image *im, uint64_t v) { put(im, &v, 8); }
static void put_str(image *im, const char *s) {
    put_u64(im, strlen(s));
    put(im, s, strlen(s));
}
static void put_header(image *im, uint32_t version, int64_t n_tensors, int64_t n_kv) {
    put(im, "GGUF", 4);
    put_u32(im, version);
    put_u64(im, (uint64_t)n_tensors);
    put_u64(im, (uint64_t)n_kv);
}
static void put_kv_u32(image *im, const char *key, uint32_t v) {
    put_str(im, key);
    put_u32(im, GGUF_TYPE_UINT32);
    put_u32(im, v);
}
static void put_tensor_info(image *im, const char *name, uint32_t n_dims, const int64_t *ne, uint32_t type,
                            uint64_t offset) {
    put_str(im, name);
    put_u32(im, n_dims);
    put(im, ne, 8 * (size_t)n_dims);
    put_u32(im, type);
    put_u64(im, offset);
}
static void put_pad(image *im, size_t alignment) {
    while (im->len % alignment) put_u8(im, 0);
}
static void put_filler(image *im, size_t n) {
    for (size_t i = 0; i < n; i++) put_u8(im, (uint8_t)i);
}

/* Opens a copy of the first `size` bytes in an exactly-sized allocation. */
static gguf_file *open_copy(const void *data, size_t size, ember_error *err, void **copy_out) {
    void *copy = malloc(size ? size : 1);
    assert_non_null(copy);
    memcpy(copy, data, size);
    *copy_out = copy;
    return gguf_open_memory(copy, size, err);
}

/* Asserts the image is rejected with a message containing every needle. */
static void expect_reject(const image *im, const char *needle1, const char *needle2) {
    ember_error err = {{0}};
    void *copy;
    gguf_file *f = open_copy(im->p, im->len, &err, &copy);
    if (f != NULL) {
        gguf_close(f);
        free(copy);
        fail_msg("image was accepted; expected an error containing '%s'", needle1);
    }
    if (strstr(err.msg, needle1) == NULL || (needle2 && strstr(err.msg, needle2) == NULL))
        fail_msg("error '%s' does not mention '%s'%s%s", err.msg, needle1, needle2 ? " and " : "",
                 needle2 ? needle2 : "");
    free(copy);
}

/* A valid two-tensor file: 2 keys, an f32 [8] and a q8_0 [32, 2]. */
static void build_small_valid(image *im) {
    put_header(im, 3, 2, 2);
    put_kv_u32(im, "general.alignment", 32);
    put_str(im, "general.name");
    put_u32(im, GGUF_TYPE_STRING);
    put_str(im, "tiny");
    int64_t ne_a[1] = {8}, ne_b[2] = {32, 2};
    put_tensor_info(im, "a", 1, ne_a, DT_F32, 0);
    put_tensor_info(im, "b", 2, ne_b, DT_Q8_0, 32);
    put_pad(im, 32);
    put_filler(im, 32);      /* a: 32 bytes */
    put_filler(im, 2 * 34);  /* b: 68 bytes */
    put_pad(im, 32);
}

static void test_small_valid_image_opens(void **state) {
    (void)state;
    image im = {0};
    build_small_valid(&im);
    ember_error err = {{0}};
    void *copy;
    gguf_file *f = open_copy(im.p, im.len, &err, &copy);
    if (f == NULL) fail_msg("%s", err.msg);
    assert_int_equal(gguf_tensor_count(f), 2);
    assert_int_equal(gguf_find_tensor(f, "b")->nbytes, 68);
    assert_int_equal(gguf_data_offset(f) % 32, 0);
    gguf_close(f);
    free(copy);
    free(im.p);
}

/* ------------------------------------------------------------------ */
/* Writer round trips                                                  */
/* ------------------------------------------------------------------ */

static char *temp_file(char **dir_out, const char *name) {
    char *dir = make_temp_dir();
    assert_non_null(dir);
    char *path = malloc(strlen(dir) + strlen(name) + 2);
    sprintf(path, "%s/%s", dir, name);
    *dir_out = dir;
    return path;
}

/* An image holding one scalar of every non-array type, for copy_kv. */
static void build_all_scalars(image *im) {
    put_header(im, 3, 0, 12);
    put_str(im, "s.u8"); put_u32(im, GGUF_TYPE_UINT8); put_u8(im, 200);
    put_str(im, "s.i8"); put_u32(im, GGUF_TYPE_INT8); put_u8(im, (uint8_t)(int8_t)-100);
    put_str(im, "s.u16"); put_u32(im, GGUF_TYPE_UINT16); { uint16_t v = 60000; put(im, &v, 2); }
    put_str(im, "s.i16"); put_u32(im, GGUF_TYPE_INT16); { int16_t v = -30000; put(im, &v, 2); }
    put_str(im, "s.u32"); put_u32(im, GGUF_TYPE_UINT32); put_u32(im, 4000000000u);
    put_str(im, "s.i32"); put_u32(im, GGUF_TYPE_INT32); { int32_t v = -2000000000; put(im, &v, 4); }
    put_str(im, "s.f32"); put_u32(im, GGUF_TYPE_FLOAT32); { float v = 1.5f; put(im, &v, 4); }
    put_str(im, "s.bool"); put_u32(im, GGUF_TYPE_BOOL); put_u8(im, 1);
    put_str(im, "s.str"); put_u32(im, GGUF_TYPE_STRING); put_str(im, "hello");
    put_str(im, "s.u64"); put_u32(im, GGUF_TYPE_UINT64); put_u64(im, 1ull << 40);
    put_str(im, "s.i64"); put_u32(im, GGUF_TYPE_INT64); put_u64(im, (uint64_t)(int64_t)-(1ll << 40));
    put_str(im, "s.f64"); put_u32(im, GGUF_TYPE_FLOAT64); { double v = 3.25; put(im, &v, 8); }
}

static void check_all_scalars(const gguf_file *f) {
    int64_t iv;
    double fv;
    bool bv;
    gguf_str s;
    static const struct { const char *key; gguf_value_type type; int64_t value; } ints[] = {
        {"s.u8", GGUF_TYPE_UINT8, 200},          {"s.i8", GGUF_TYPE_INT8, -100},
        {"s.u16", GGUF_TYPE_UINT16, 60000},      {"s.i16", GGUF_TYPE_INT16, -30000},
        {"s.u32", GGUF_TYPE_UINT32, 4000000000}, {"s.i32", GGUF_TYPE_INT32, -2000000000},
        {"s.u64", GGUF_TYPE_UINT64, 1ll << 40},  {"s.i64", GGUF_TYPE_INT64, -(1ll << 40)},
    };
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        int64_t idx = gguf_find_key(f, ints[i].key);
        assert_true(idx >= 0);
        assert_int_equal(gguf_kv_type(f, idx), ints[i].type);
        assert_true(gguf_get_int(f, ints[i].key, &iv));
        assert_int_equal(iv, ints[i].value);
        assert_false(gguf_get_float(f, ints[i].key, &fv));
    }
    assert_true(gguf_get_float(f, "s.f32", &fv));
    assert_true(fv == 1.5);
    assert_int_equal(gguf_kv_type(f, gguf_find_key(f, "s.f32")), GGUF_TYPE_FLOAT32);
    assert_true(gguf_get_float(f, "s.f64", &fv));
    assert_true(fv == 3.25);
    assert_int_equal(gguf_kv_type(f, gguf_find_key(f, "s.f64")), GGUF_TYPE_FLOAT64);
    assert_true(gguf_get_bool(f, "s.bool", &bv));
    assert_true(bv);
    assert_false(gguf_get_int(f, "s.bool", &iv));
    assert_true(gguf_get_str(f, "s.str", &s));
    assert_true(gguf_str_eq(s, "hello"));
    assert_false(gguf_get_int(f, "s.str", &iv));
}

typedef struct fill_ctx {
    int calls;
    uint8_t seed;
    bool fail;
} fill_ctx;

static int fill_pattern(void *user, void *dst, uint64_t nbytes, ember_error *err) {
    fill_ctx *ctx = user;
    ctx->calls++;
    if (ctx->fail) return ember_fail(err, "synthetic failure");
    for (uint64_t i = 0; i < nbytes; i++) ((uint8_t *)dst)[i] = (uint8_t)(i * 7 + ctx->seed);
    return 0;
}

static void test_writer_round_trip(void **state) {
    (void)state;
    /* Source of the scalar types the writer has no direct setter for. */
    image scalars = {0};
    build_all_scalars(&scalars);
    ember_error err = {{0}};
    gguf_file *src = gguf_open_memory(scalars.p, scalars.len, &err);
    if (src == NULL) fail_msg("%s", err.msg);
    check_all_scalars(src);

    gguf_writer *w = gguf_writer_create();
    assert_non_null(w);
    for (int64_t i = 0; i < gguf_kv_count(src); i++) gguf_writer_copy_kv(w, src, i);
    gguf_writer_set_u32(w, "d.u32", 7);
    gguf_writer_set_i32(w, "d.i32", -7);
    gguf_writer_set_u64(w, "d.u64", 1ull << 50);
    gguf_writer_set_f32(w, "d.f32", 0.25f);
    gguf_writer_set_bool(w, "d.bool", false);
    gguf_writer_set_str(w, "d.str", "first");
    gguf_writer_set_str(w, "d.str", "replaced"); /* replaces, keeps position */
    gguf_writer_set_str(w, "d.empty", "");

    /* Arrays of every fixed-size element type, 3 elements each. */
    uint8_t a_u8[3] = {1, 2, 255};
    int8_t a_i8[3] = {-1, 0, 127};
    uint16_t a_u16[3] = {1, 2, 65535};
    int16_t a_i16[3] = {-32768, 0, 5};
    uint32_t a_u32[3] = {0, 1, 4294967295u};
    int32_t a_i32[3] = {-5, 6, -7};
    float a_f32[3] = {0.5f, -1.0f, 1e30f};
    uint8_t a_bool[3] = {1, 0, 1};
    uint64_t a_u64[3] = {1, 1ull << 63, 3};
    int64_t a_i64[3] = {-1, 1ll << 62, 0};
    double a_f64[3] = {1e-300, -2.5, 0};
    static const struct { const char *key; gguf_value_type type; } arrays[] = {
        {"a.u8", GGUF_TYPE_UINT8},   {"a.i8", GGUF_TYPE_INT8},   {"a.u16", GGUF_TYPE_UINT16},
        {"a.i16", GGUF_TYPE_INT16},  {"a.u32", GGUF_TYPE_UINT32}, {"a.i32", GGUF_TYPE_INT32},
        {"a.f32", GGUF_TYPE_FLOAT32}, {"a.bool", GGUF_TYPE_BOOL}, {"a.u64", GGUF_TYPE_UINT64},
        {"a.i64", GGUF_TYPE_INT64},  {"a.f64", GGUF_TYPE_FLOAT64},
    };
    const void *array_data[] = {a_u8, a_i8, a_u16, a_i16, a_u32, a_i32, a_f32, a_bool, a_u64, a_i64, a_f64};
    for (size_t i = 0; i < 11; i++) gguf_writer_set_arr(w, arrays[i].key, arrays[i].type, array_data[i], 3);
    gguf_writer_set_arr(w, "a.empty", GGUF_TYPE_INT32, NULL, 0);
    const char *strs[3] = {"alpha", "", "gamma delta"};
    gguf_writer_set_arr_str(w, "a.str", strs, NULL, 3);
    const char *binary[2] = {"a\0b", "xyz"};
    uint64_t lens[2] = {3, 2};
    gguf_writer_set_arr_str(w, "a.str_lens", binary, lens, 2);

    /* Tensors of several types, borrowed and filled, up to 4 dims. */
    float t_f32[64 * 3];
    for (int i = 0; i < 64 * 3; i++) t_f32[i] = (float)i - 10.0f;
    uint8_t t_q8[2 * 34];
    for (int i = 0; i < 2 * 34; i++) t_q8[i] = (uint8_t)(i * 3);
    int64_t ne_f32[2] = {64, 3}, ne_f16[2] = {32, 5}, ne_q8[2] = {64, 1}, ne_q4k[3] = {256, 1, 2},
            ne_bf16[4] = {2, 3, 2, 2};
    fill_ctx fa = {0, 11, false}, fb = {0, 99, false};
    assert_int_equal(gguf_writer_add_tensor(w, "t.f32", DT_F32, 2, ne_f32, t_f32, &err), 0);
    assert_int_equal(gguf_writer_add_tensor_fill(w, "t.f16", DT_F16, 2, ne_f16, fill_pattern, &fa, &err), 0);
    assert_int_equal(gguf_writer_add_tensor(w, "t.q8_0", DT_Q8_0, 2, ne_q8, t_q8, &err), 0);
    assert_int_equal(gguf_writer_add_tensor_fill(w, "t.q4_k", DT_Q4_K, 3, ne_q4k, fill_pattern, &fb, &err), 0);
    assert_int_equal(gguf_writer_add_tensor_fill(w, "t.bf16", DT_BF16, 4, ne_bf16, fill_pattern, &fa, &err), 0);

    char *dir;
    char *path = temp_file(&dir, "round.gguf");
    if (gguf_writer_write(w, path, &err) != 0) fail_msg("%s", err.msg);
    assert_int_equal(fa.calls, 2);
    assert_int_equal(fb.calls, 1);
    gguf_writer_free(w);
    gguf_close(src);
    free(scalars.p);

    char tmp_path[4096];
    snprintf(tmp_path, sizeof tmp_path, "%s.tmp", path);
    assert_int_not_equal(access(tmp_path, F_OK), 0);

    gguf_file *f = gguf_open(path, &err);
    if (f == NULL) fail_msg("%s", err.msg);
    assert_int_equal(gguf_version(f), 3);
    assert_int_equal(gguf_alignment(f), 32);
    assert_int_equal(gguf_kv_count(f), 12 + 7 + 11 + 3);
    check_all_scalars(f);
    /* Keys keep their insertion order; the replaced one kept its slot. */
    assert_string_equal(gguf_kv_key(f, 0), "s.u8");
    assert_string_equal(gguf_kv_key(f, 17), "d.str");
    int64_t iv;
    double fv;
    bool bv;
    gguf_str s;
    assert_true(gguf_get_int(f, "d.u32", &iv) && iv == 7);
    assert_int_equal(gguf_kv_type(f, gguf_find_key(f, "d.u32")), GGUF_TYPE_UINT32);
    assert_true(gguf_get_int(f, "d.i32", &iv) && iv == -7);
    assert_int_equal(gguf_kv_type(f, gguf_find_key(f, "d.i32")), GGUF_TYPE_INT32);
    assert_true(gguf_get_int(f, "d.u64", &iv) && iv == (1ll << 50));
    assert_true(gguf_get_float(f, "d.f32", &fv) && fv == 0.25);
    assert_true(gguf_get_bool(f, "d.bool", &bv) && !bv);
    assert_true(gguf_get_str(f, "d.str", &s) && gguf_str_eq(s, "replaced"));
    assert_true(gguf_get_str(f, "d.empty", &s) && s.len == 0);

    for (size_t i = 0; i < 11; i++) {
        gguf_value_type et;
        uint64_t count;
        assert_true(gguf_get_arr(f, arrays[i].key, &et, &count));
        assert_int_equal(et, arrays[i].type);
        assert_int_equal(count, 3);
        int64_t idx = gguf_find_key(f, arrays[i].key);
        assert_memory_equal(gguf_arr_data(f, idx), array_data[i], 3 * gguf_type_size(et));
    }
    int64_t idx = gguf_find_key(f, "a.i16");
    assert_int_equal(gguf_arr_int(f, idx, 0), -32768);
    idx = gguf_find_key(f, "a.u32");
    assert_int_equal(gguf_arr_int(f, idx, 2), 4294967295ll);
    idx = gguf_find_key(f, "a.bool");
    assert_int_equal(gguf_arr_int(f, idx, 1), 0);
    idx = gguf_find_key(f, "a.f64");
    assert_true(gguf_arr_float(f, idx, 1) == -2.5);
    idx = gguf_find_key(f, "a.f32");
    assert_true(gguf_arr_float(f, idx, 2) == 1e30f);
    gguf_value_type et;
    uint64_t count;
    assert_true(gguf_get_arr(f, "a.empty", &et, &count) && et == GGUF_TYPE_INT32 && count == 0);
    assert_true(gguf_get_arr(f, "a.str", &et, &count) && et == GGUF_TYPE_STRING && count == 3);
    idx = gguf_find_key(f, "a.str");
    assert_null(gguf_arr_data(f, idx));
    for (int i = 0; i < 3; i++) assert_true(gguf_str_eq(gguf_arr_str(f, idx, (uint64_t)i), strs[i]));
    idx = gguf_find_key(f, "a.str_lens");
    s = gguf_arr_str(f, idx, 0);
    assert_int_equal(s.len, 3);
    assert_memory_equal(s.ptr, "a\0b", 3);
    assert_true(gguf_str_eq(gguf_arr_str(f, idx, 1), "xy"));

    /* Tensors: order, shapes, types, offsets as a padded running sum, bytes. */
    assert_int_equal(gguf_tensor_count(f), 5);
    static const char *names[5] = {"t.f32", "t.f16", "t.q8_0", "t.q4_k", "t.bf16"};
    static const uint64_t sizes[5] = {64 * 3 * 4, 32 * 5 * 2, 2 * 34, 2 * 144, 24 * 2};
    uint64_t expect_offset = 0;
    for (int i = 0; i < 5; i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        assert_string_equal(t->name, names[i]);
        assert_int_equal(t->nbytes, sizes[i]);
        assert_int_equal(t->offset, expect_offset);
        expect_offset += (sizes[i] + 31) / 32 * 32;
    }
    assert_int_equal(gguf_data_offset(f) + expect_offset, gguf_file_size(f));
    const gguf_tensor *t = gguf_find_tensor(f, "t.f32");
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->ne[0], 64);
    assert_int_equal(t->ne[1], 3);
    assert_int_equal(t->ne[2], 1);
    assert_int_equal(t->type, DT_F32);
    assert_memory_equal(t->data, t_f32, sizeof t_f32);
    t = gguf_find_tensor(f, "t.q8_0");
    assert_memory_equal(t->data, t_q8, sizeof t_q8);
    t = gguf_find_tensor(f, "t.q4_k");
    assert_int_equal(t->n_dims, 3);
    assert_int_equal(t->ne[2], 2);
    assert_int_equal(t->type, DT_Q4_K);
    for (uint64_t i = 0; i < t->nbytes; i++) assert_int_equal(((const uint8_t *)t->data)[i], (uint8_t)(i * 7 + 99));
    t = gguf_find_tensor(f, "t.bf16");
    assert_int_equal(t->n_dims, 4);
    assert_int_equal(t->ne[3], 2);
    for (uint64_t i = 0; i < t->nbytes; i++) assert_int_equal(((const uint8_t *)t->data)[i], (uint8_t)(i * 7 + 11));
    gguf_close(f);

    remove_tree(dir);
    free(dir);
    free(path);
}

static void test_writer_custom_alignment(void **state) {
    (void)state;
    gguf_writer *w = gguf_writer_create();
    gguf_writer_set_u32(w, "general.alignment", 256);
    float data[40] = {0};
    int64_t ne[1] = {40};
    ember_error err = {{0}};
    assert_int_equal(gguf_writer_add_tensor(w, "x", DT_F32, 1, ne, data, &err), 0);
    assert_int_equal(gguf_writer_add_tensor(w, "y", DT_F32, 1, ne, data, &err), 0);
    char *dir;
    char *path = temp_file(&dir, "align.gguf");
    if (gguf_writer_write(w, path, &err) != 0) fail_msg("%s", err.msg);
    gguf_writer_free(w);
    gguf_file *f = gguf_open(path, &err);
    if (f == NULL) fail_msg("%s", err.msg);
    assert_int_equal(gguf_alignment(f), 256);
    assert_int_equal(gguf_data_offset(f) % 256, 0);
    assert_int_equal(gguf_find_tensor(f, "y")->offset, 256);
    assert_int_equal(gguf_file_size(f), gguf_data_offset(f) + 512);
    gguf_close(f);
    remove_tree(dir);
    free(dir);
    free(path);
}

static void test_writer_no_tensors(void **state) {
    (void)state;
    gguf_writer *w = gguf_writer_create();
    gguf_writer_set_str(w, "general.architecture", "llama");
    char *dir;
    char *path = temp_file(&dir, "empty.gguf");
    ember_error err = {{0}};
    if (gguf_writer_write(w, path, &err) != 0) fail_msg("%s", err.msg);
    gguf_writer_free(w);
    size_t size;
    void *bytes = read_whole_file(path, &size);
    /* 24 header + key (8 + 20) + type 4 + value (8 + 5), no padding. */
    assert_int_equal(size, 24 + 28 + 4 + 13);
    free(bytes);
    gguf_file *f = gguf_open(path, &err);
    if (f == NULL) fail_msg("%s", err.msg);
    assert_int_equal(gguf_tensor_count(f), 0);
    gguf_close(f);
    remove_tree(dir);
    free(dir);
    free(path);
}

static void test_writer_rejects_bad_input(void **state) {
    (void)state;
    gguf_writer *w = gguf_writer_create();
    ember_error err = {{0}};
    float data[512] = {0};
    int64_t ne[5] = {32, 2, 1, 1, 1};
    assert_int_equal(gguf_writer_add_tensor(w, "a", DT_F32, 2, ne, data, &err), 0);
    assert_int_equal(gguf_writer_add_tensor(w, "a", DT_F32, 2, ne, data, &err), -1);
    assert_non_null(strstr(err.msg, "twice"));
    assert_int_equal(gguf_writer_add_tensor(w, "b", DT_F32, 0, ne, data, &err), -1);
    assert_non_null(strstr(err.msg, "n_dims"));
    assert_int_equal(gguf_writer_add_tensor(w, "b", DT_F32, 5, ne, data, &err), -1);
    assert_non_null(strstr(err.msg, "n_dims"));
    int64_t odd[1] = {48};
    assert_int_equal(gguf_writer_add_tensor(w, "b", DT_Q4_K, 1, odd, data, &err), -1);
    assert_non_null(strstr(err.msg, "multiple"));
    assert_int_equal(gguf_writer_add_tensor(w, "b", 4, 1, odd, data, &err), -1);
    assert_non_null(strstr(err.msg, "not supported"));
    int64_t neg[1] = {-3};
    assert_int_equal(gguf_writer_add_tensor(w, "b", DT_F32, 1, neg, data, &err), -1);
    assert_non_null(strstr(err.msg, "out of range"));
    char long_name[80];
    memset(long_name, 'x', sizeof long_name - 1);
    long_name[79] = '\0';
    assert_int_equal(gguf_writer_add_tensor(w, long_name, DT_F32, 1, ne, data, &err), -1);
    assert_non_null(strstr(err.msg, "length"));

    char *dir;
    char *path = temp_file(&dir, "bad.gguf");
    gguf_writer_set_u32(w, "general.alignment", 48);
    assert_int_equal(gguf_writer_write(w, path, &err), -1);
    assert_non_null(strstr(err.msg, "power of two"));
    assert_int_not_equal(access(path, F_OK), 0);
    gguf_writer_set_u32(w, "general.alignment", 64);

    /* A failing fill leaves neither the file nor the temporary behind. */
    fill_ctx failing = {0, 0, true};
    assert_int_equal(gguf_writer_add_tensor_fill(w, "c", DT_F32, 1, ne, fill_pattern, &failing, &err), 0);
    assert_int_equal(gguf_writer_write(w, path, &err), -1);
    assert_non_null(strstr(err.msg, "synthetic failure"));
    assert_non_null(strstr(err.msg, "'c'"));
    assert_int_not_equal(access(path, F_OK), 0);
    char tmp_path[4096];
    snprintf(tmp_path, sizeof tmp_path, "%s.tmp", path);
    assert_int_not_equal(access(tmp_path, F_OK), 0);
    gguf_writer_free(w);

    /* Unwritable destination. */
    w = gguf_writer_create();
    assert_int_equal(gguf_writer_write(w, "/nonexistent-dir/x.gguf", &err), -1);
    assert_non_null(strstr(err.msg, "nonexistent-dir"));
    gguf_writer_free(w);
    remove_tree(dir);
    free(dir);
    free(path);
}

/* ------------------------------------------------------------------ */
/* Fixtures                                                            */
/* ------------------------------------------------------------------ */

typedef struct known_tensor {
    const char *name;
    uint32_t type;
    uint64_t offset, nbytes;
} known_tensor;

typedef struct known_file {
    const char *path;
    uint64_t data_offset;
    int64_t n_tensors, n_kv;
    uint64_t file_size;
    const char *arch;
    known_tensor tensors[3];
} known_file;

/* Values from the sidecars (reference/NAME.json: gguf.data_offset, gguf.tensors). */
static const known_file known_files[] = {
    {"reference/qwen3-f32.gguf", 14208, 46, 23, 3428736, "qwen3",
     {{"token_embd.weight", DT_F32, 0, 262144},
      {"blk.2.attn_norm.weight", DT_F32, 1838080, 512},
      {"output_norm.weight", DT_F32, 3414016, 512}}},
    {"reference/llama256-q4_k_m.gguf", 12704, 21, 22, 904864, "llama",
     {{"output.weight", DT_Q6_K, 0, 107520},
      {"blk.0.ffn_norm.weight", DT_F32, 441344, 1024},
      {"blk.1.ffn_up.weight", DT_Q4_K, 818432, 73728}}},
    {"reference/qwen3moe-f32.gguf", 14080, 39, 26, 4088576, "qwen3moe",
     {{"token_embd.weight", DT_F32, 0, 262144},
      {"blk.1.attn_q_norm.weight", DT_F32, 1839360, 256},
      {"output.weight", DT_F32, 3812352, 262144}}},
    {"reference/gemma3-f32.gguf", 17184, 94, 26, 5606176, "gemma3",
     {{"token_embd.weight", DT_F32, 0, 262144},
      {"blk.3.attn_q_norm.weight", DT_F32, 2761472, 256},
      {"output.weight", DT_F32, 5326848, 262144}}},
};

static void test_fixture_known_values(void **state) {
    (void)state;
    int checked = 0;
    for (size_t i = 0; i < sizeof known_files / sizeof known_files[0]; i++) {
        const known_file *k = &known_files[i];
        const char *path = fixture_path(k->path);
        if (path == NULL) continue;
        ember_error err = {{0}};
        gguf_file *f = gguf_open(path, &err);
        if (f == NULL) fail_msg("%s", err.msg);
        assert_int_equal(gguf_version(f), 3);
        assert_int_equal(gguf_alignment(f), 32);
        assert_int_equal(gguf_data_offset(f), k->data_offset);
        assert_int_equal(gguf_tensor_count(f), k->n_tensors);
        assert_int_equal(gguf_kv_count(f), k->n_kv);
        assert_int_equal(gguf_file_size(f), k->file_size);
        gguf_str arch;
        assert_true(gguf_get_str(f, "general.architecture", &arch));
        assert_true(gguf_str_eq(arch, k->arch));
        gguf_value_type et;
        uint64_t count;
        assert_true(gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &count));
        assert_int_equal(et, GGUF_TYPE_STRING);
        assert_int_equal(count, 512);
        assert_true(gguf_str_eq(gguf_arr_str(f, gguf_find_key(f, "tokenizer.ggml.tokens"), 1), "<s>"));
        for (int j = 0; j < 3; j++) {
            const gguf_tensor *t = gguf_find_tensor(f, k->tensors[j].name);
            assert_non_null(t);
            assert_int_equal(t->type, k->tensors[j].type);
            assert_int_equal(t->offset, k->tensors[j].offset);
            assert_int_equal(t->nbytes, k->tensors[j].nbytes);
        }
        gguf_close(f);
        checked++;
    }
    if (checked == 0) skip();
}

/* Opens every .gguf in a fixture directory; returns how many. */
static int open_all_in(const char *rel_dir, bool expect_no_tensors) {
    const char *dir_path = fixture_path(rel_dir);
    if (dir_path == NULL) return 0;
    char dir_copy[1024];
    snprintf(dir_copy, sizeof dir_copy, "%s", dir_path);
    DIR *d = opendir(dir_copy);
    assert_non_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 5, ".gguf") != 0) continue;
        char path[2048];
        snprintf(path, sizeof path, "%s/%s", dir_copy, e->d_name);
        ember_error err = {{0}};
        gguf_file *f = gguf_open(path, &err);
        if (f == NULL) fail_msg("%s", err.msg);
        if (expect_no_tensors) {
            assert_int_equal(gguf_tensor_count(f), 0);
            gguf_value_type et;
            uint64_t count;
            assert_true(gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &count));
            assert_true(count > 1000);
        }
        gguf_close(f);
        n++;
    }
    closedir(d);
    return n;
}

static void test_fixture_all_open(void **state) {
    (void)state;
    int n = open_all_in("reference", false) + open_all_in("models", false) + open_all_in("models/vocab", true);
    if (n == 0) skip();
    assert_true(n >= 30);
}

static void test_fixture_stories(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, "models/stories260K.gguf");
    ember_error err = {{0}};
    gguf_file *f = gguf_open(path, &err);
    if (f == NULL) fail_msg("%s", err.msg);
    assert_int_equal(gguf_tensor_count(f), 48);
    assert_int_equal(gguf_kv_count(f), 19);
    int64_t v;
    assert_true(gguf_get_int(f, "llama.embedding_length", &v));
    assert_int_equal(v, 64);
    const gguf_tensor *t = gguf_find_tensor(f, "token_embd.weight");
    assert_non_null(t);
    assert_int_equal(t->ne[0], 64);
    assert_int_equal(t->ne[1], 512);
    gguf_close(f);
}

/* Rewrites a llama.cpp-written file through the writer: the result must be
 * byte-identical, which pins down layout, padding and value encoding. */
static void rewrite_identical(const char *rel) {
    const char *path = fixture_path(rel);
    if (path == NULL) return;
    ember_error err = {{0}};
    gguf_file *f = gguf_open(path, &err);
    if (f == NULL) fail_msg("%s", err.msg);
    gguf_writer *w = gguf_writer_create();
    for (int64_t i = 0; i < gguf_kv_count(f); i++) gguf_writer_copy_kv(w, f, i);
    for (int64_t i = 0; i < gguf_tensor_count(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        if (gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data, &err) != 0)
            fail_msg("%s", err.msg);
    }
    char *dir;
    char *out = temp_file(&dir, "rewrite.gguf");
    if (gguf_writer_write(w, out, &err) != 0) fail_msg("%s", err.msg);
    gguf_writer_free(w);
    size_t a_size, b_size;
    void *a = read_whole_file(path, &a_size), *b = read_whole_file(out, &b_size);
    assert_non_null(a);
    assert_non_null(b);
    if (a_size != b_size) fail_msg("%s: rewrite is %zu bytes, original %zu", rel, b_size, a_size);
    if (memcmp(a, b, a_size) != 0) {
        size_t at = 0;
        while (((uint8_t *)a)[at] == ((uint8_t *)b)[at]) at++;
        fail_msg("%s: rewrite differs at byte %zu", rel, at);
    }
    free(a);
    free(b);
    gguf_close(f);
    remove_tree(dir);
    free(dir);
    free(out);
}

static void test_fixture_rewrite_identical(void **state) {
    (void)state;
    if (fixture_path("reference/qwen3-f32.gguf") == NULL) skip();
    rewrite_identical("reference/qwen3-f32.gguf");
    rewrite_identical("reference/llama256-q4_k_m.gguf");
    rewrite_identical("models/stories260K.gguf");
    rewrite_identical("models/vocab/ggml-vocab-gpt-2.gguf");
}

/* ------------------------------------------------------------------ */
/* Malformed files                                                     */
/* ------------------------------------------------------------------ */

static void test_truncated_everywhere(void **state) {
    (void)state;
    image im = {0};
    build_small_valid(&im);
    /* The last tensor's trailing padding is optional; any cut before the
     * end of its data must fail, any cut inside the padding must not. */
    size_t data_end = im.len - (32 - 100 % 32);
    for (size_t cut = 0; cut < im.len; cut++) {
        ember_error err = {{0}};
        void *copy;
        gguf_file *f = open_copy(im.p, cut, &err, &copy);
        if (cut >= data_end) {
            if (f == NULL) fail_msg("cut at %zu inside the final padding was rejected: %s", cut, err.msg);
            gguf_close(f);
            free(copy);
            continue;
        }
        if (f != NULL) fail_msg("truncation at %zu of %zu bytes was accepted", cut, im.len);
        if (strstr(err.msg, "offset") == NULL) fail_msg("truncation at %zu: message lacks 'offset': %s", cut, err.msg);
        free(copy);
    }
    free(im.p);
}

static void test_bad_magic(void **state) {
    (void)state;
    image im = {0};
    build_small_valid(&im);
    im.p[0] = 'X';
    expect_reject(&im, "magic", "offset 0");
    free(im.p);
}

static void test_bad_versions(void **state) {
    (void)state;
    image im = {0};
    build_small_valid(&im);
    uint32_t v = 1;
    memcpy(im.p + 4, &v, 4);
    expect_reject(&im, "version", "v1");
    v = 99;
    memcpy(im.p + 4, &v, 4);
    expect_reject(&im, "version", "99");
    free(im.p);
}

static void test_absurd_counts(void **state) {
    (void)state;
    image im = {0};
    put_header(&im, 3, 1ll << 40, 0);
    expect_reject(&im, "tensor count", "absurd");
    im.len = 0;
    put_header(&im, 3, -1, 0);
    expect_reject(&im, "tensor count", "absurd");
    im.len = 0;
    put_header(&im, 3, 0, 1ll << 50);
    expect_reject(&im, "metadata count", "absurd");
    im.len = 0;
    put_header(&im, 3, 0, 1000); /* plausible number, far too small a file */
    put_kv_u32(&im, "a", 1);
    expect_reject(&im, "metadata count", "absurd");
    free(im.p);
}

static void test_absurd_string_length(void **state) {
    (void)state;
    image im = {0};
    put_header(&im, 3, 0, 1);
    put_u64(&im, 1ull << 62); /* key length */
    put(&im, "abcdefgh", 8);
    expect_reject(&im, "string length", "key 0 name");
    im.len = 0;
    put_header(&im, 3, 0, 1);
    put_str(&im, "k");
    put_u32(&im, GGUF_TYPE_STRING);
    put_u64(&im, UINT64_MAX);
    put(&im, "abcdefgh", 8);
    expect_reject(&im, "string length", "'k'");
    free(im.p);
}

static void test_absurd_array_length(void **state) {
    (void)state;
    image im = {0};
    put_header(&im, 3, 0, 1);
    put_str(&im, "arr");
    put_u32(&im, GGUF_TYPE_ARRAY);
    put_u32(&im, GGUF_TYPE_UINT32);
    put_u64(&im, 1ull << 61);
    put_filler(&im, 16);
    expect_reject(&im, "absurd array count", "'arr'");
    im.len = 0;
    put_header(&im, 3, 0, 1);
    put_str(&im, "sarr");
    put_u32(&im, GGUF_TYPE_ARRAY);
    put_u32(&im, GGUF_TYPE_STRING);
    put_u64(&im, UINT64_MAX);
    put_filler(&im, 16);
    expect_reject(&im, "absurd string array count", "'sarr'");
    free(im.p);
}

static void test_nested_array(void **state) {
    (void)state;
    image im = {0};
    put_header(&im, 3, 0, 1);
    put_str(&im, "nest");
    put_u32(&im, GGUF_TYPE_ARRAY);
    put_u32(&im, GGUF_TYPE_ARRAY);
    put_u64(&im, 1);
    put_u32(&im, GGUF_TYPE_UINT8);
    put_u64(&im, 0);
    expect_reject(&im, "nested arrays", "'nest'");
    free(im.p);
}

static void test_unknown_value_type(void **state) {
    (void)state;
    image im = {0};
    put_header(&im, 3, 0, 1);
    put_str(&im, "k");
    put_u32(&im, 13);
    put_u32(&im, 0);
    expect_reject(&im, "unknown value type 13", "'k'");
    im.len = 0;
    put_header(&im, 3, 0, 1);
    put_str(&im, "k2");
    put_u32(&im, GGUF_TYPE_ARRAY);
    put_u32(&im, 77);
    put_u64(&im, 0);
    expect_reject(&im, "invalid array element type 77", "'k2'");
    free(im.p);
}

static void test_bad_bool(void **state) {
    (void)state;
    image im = {0};
    put_header(&im, 3, 0, 1);
    put_str(&im, "flag");
    put_u32(&im, GGUF_TYPE_BOOL);
    put_u8(&im, 2);
    expect_reject(&im, "bool value 2", "'flag'");
    im.len = 0;
    put_header(&im, 3, 0, 1);
    put_str(&im, "flags");
    put_u32(&im, GGUF_TYPE_ARRAY);
    put_u32(&im, GGUF_TYPE_BOOL);
    put_u64(&im, 3);
    put_u8(&im, 1);
    put_u8(&im, 0);
    put_u8(&im, 9);
    expect_reject(&im, "bool value 9", "element 2");
    free(im.p);
}

static void test_duplicate_key(void **state) {
    (void)state;
    image im = {0};
    put_header(&im, 3, 0, 2);
    put_kv_u32(&im, "same.key", 1);
    put_kv_u32(&im, "same.key", 2);
    expect_reject(&im, "'same.key' appears twice", "offset");
    im.len = 0;
    put_header(&im, 3, 0, 1);
    put_str(&im, "");
    put_u32(&im, GGUF_TYPE_UINT8);
    put_u8(&im, 0);
    expect_reject(&im, "empty key", "offset");
    free(im.p);
}

/* One-tensor file with the given info fields; data section of data_bytes. */
static void build_one_tensor(image *im, uint32_t n_dims, const int64_t *ne, uint32_t type, uint64_t offset,
                             size_t data_bytes) {
    put_header(im, 3, 1, 0);
    put_tensor_info(im, "w", n_dims, ne, type, offset);
    put_pad(im, 32);
    put_filler(im, data_bytes);
}

static void test_duplicate_tensor_name(void **state) {
    (void)state;
    image im = {0};
    int64_t ne[1] = {8};
    put_header(&im, 3, 2, 0);
    put_tensor_info(&im, "dup", 1, ne, DT_F32, 0);
    put_tensor_info(&im, "dup", 1, ne, DT_F32, 32);
    put_pad(&im, 32);
    put_filler(&im, 64);
    expect_reject(&im, "'dup' appears twice", "offset");
    free(im.p);
}

static void test_bad_n_dims(void **state) {
    (void)state;
    image im = {0};
    int64_t ne[5] = {8, 1, 1, 1, 1};
    build_one_tensor(&im, 0, ne, DT_F32, 0, 32);
    expect_reject(&im, "n_dims 0", "'w'");
    im.len = 0;
    build_one_tensor(&im, 5, ne, DT_F32, 0, 32);
    expect_reject(&im, "n_dims 5", "'w'");
    free(im.p);
}

static void test_negative_dim(void **state) {
    (void)state;
    image im = {0};
    int64_t ne[2] = {8, -4};
    build_one_tensor(&im, 2, ne, DT_F32, 0, 32);
    expect_reject(&im, "dim 1 = -4", "out of range");
    im.len = 0;
    int64_t zero[1] = {0};
    build_one_tensor(&im, 1, zero, DT_F32, 0, 32);
    expect_reject(&im, "dim 0 = 0", "out of range");
    im.len = 0;
    int64_t huge[4] = {1ll << 40, 1ll << 40, 1ll << 40, 1};
    build_one_tensor(&im, 4, huge, DT_F32, 0, 32);
    expect_reject(&im, "overflows", "'w'");
    free(im.p);
}

static void test_unknown_tensor_type(void **state) {
    (void)state;
    image im = {0};
    int64_t ne[1] = {32};
    build_one_tensor(&im, 1, ne, 99, 0, 128);
    expect_reject(&im, "tensor type 99", "not supported");
    im.len = 0;
    build_one_tensor(&im, 1, ne, 4, 0, 128); /* retired Q4_2 */
    expect_reject(&im, "tensor type 4", "not supported");
    free(im.p);
}

static void test_row_not_multiple_of_block(void **state) {
    (void)state;
    image im = {0};
    int64_t ne[2] = {100, 2};
    build_one_tensor(&im, 2, ne, DT_Q4_K, 0, 1024);
    expect_reject(&im, "row length 100", "q4_K block");
    free(im.p);
}

static void test_misaligned_offset(void **state) {
    (void)state;
    image im = {0};
    int64_t ne[1] = {8};
    build_one_tensor(&im, 1, ne, DT_F32, 16, 64);
    expect_reject(&im, "offset 16", "alignment");
    free(im.p);
}

static void test_tensor_past_eof(void **state) {
    (void)state;
    image im = {0};
    int64_t ne[1] = {64};
    build_one_tensor(&im, 1, ne, DT_F32, 0, 200); /* needs 256 */
    expect_reject(&im, "past the end", "'w'");
    im.len = 0;
    build_one_tensor(&im, 1, ne, DT_F32, 1ull << 62, 256); /* offset far away */
    expect_reject(&im, "past the end", "'w'");
    free(im.p);
}

static void test_overlapping_tensors(void **state) {
    (void)state;
    image im = {0};
    int64_t ne[1] = {16}; /* 64 bytes */
    put_header(&im, 3, 2, 0);
    put_tensor_info(&im, "first", 1, ne, DT_F32, 0);
    put_tensor_info(&im, "second", 1, ne, DT_F32, 32);
    put_pad(&im, 32);
    put_filler(&im, 128);
    expect_reject(&im, "overlap", "'first'");
    free(im.p);
}

static void test_bad_alignment_key(void **state) {
    (void)state;
    image im = {0};
    put_header(&im, 3, 0, 1);
    put_kv_u32(&im, "general.alignment", 48);
    expect_reject(&im, "general.alignment", "power of two");
    im.len = 0;
    put_header(&im, 3, 0, 1);
    put_kv_u32(&im, "general.alignment", 0);
    expect_reject(&im, "general.alignment", "power of two");
    im.len = 0;
    put_header(&im, 3, 0, 1);
    put_str(&im, "general.alignment");
    put_u32(&im, GGUF_TYPE_STRING);
    put_str(&im, "32");
    expect_reject(&im, "general.alignment", "u32");
    free(im.p);
}

static void test_long_tensor_name(void **state) {
    (void)state;
    image im = {0};
    char name[100];
    memset(name, 'n', 99);
    name[99] = '\0';
    int64_t ne[1] = {8};
    put_header(&im, 3, 1, 0);
    put_tensor_info(&im, name, 1, ne, DT_F32, 0);
    put_pad(&im, 32);
    put_filler(&im, 32);
    expect_reject(&im, "name length 99", "offset");
    free(im.p);
}

/* ------------------------------------------------------------------ */
/* Fuzz                                                                */
/* ------------------------------------------------------------------ */

static uint64_t fuzz_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Touches everything an opened file exposes so ASan sees any bad pointer. */
static unsigned walk_file(const gguf_file *f) {
    unsigned acc = 0;
    for (int64_t i = 0; i < gguf_kv_count(f); i++) {
        acc += (unsigned)strlen(gguf_kv_key(f, i));
        int64_t iv;
        double fv;
        gguf_str s;
        gguf_value_type et;
        uint64_t count;
        if (gguf_kv_int(f, i, &iv)) acc += (unsigned)iv;
        if (gguf_kv_float(f, i, &fv)) acc += (unsigned)(fv == fv);
        if (gguf_kv_str(f, i, &s) && s.len) acc += (unsigned char)s.ptr[s.len - 1];
        if (gguf_kv_arr(f, i, &et, &count)) {
            for (uint64_t e = 0; e < count; e++) {
                if (et == GGUF_TYPE_STRING) {
                    gguf_str es = gguf_arr_str(f, i, e);
                    if (es.len) acc += (unsigned char)es.ptr[es.len - 1];
                } else if (et == GGUF_TYPE_FLOAT32 || et == GGUF_TYPE_FLOAT64) {
                    acc += (unsigned)(gguf_arr_float(f, i, e) == 0);
                } else {
                    acc += (unsigned)gguf_arr_int(f, i, e);
                }
            }
        }
    }
    for (int64_t i = 0; i < gguf_tensor_count(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        const uint8_t *d = t->data;
        acc += d[0] + d[t->nbytes - 1] + (unsigned)strlen(t->name);
    }
    return acc;
}

static void test_fuzz_mutations(void **state) {
    (void)state;
    /* Seed file: the small valid image plus a string array and a bool array,
     * so mutations reach every parser branch. */
    image im = {0};
    put_header(&im, 3, 2, 4);
    put_kv_u32(&im, "general.alignment", 32);
    put_str(&im, "names");
    put_u32(&im, GGUF_TYPE_ARRAY);
    put_u32(&im, GGUF_TYPE_STRING);
    put_u64(&im, 3);
    put_str(&im, "x");
    put_str(&im, "yy");
    put_str(&im, "");
    put_str(&im, "flags");
    put_u32(&im, GGUF_TYPE_ARRAY);
    put_u32(&im, GGUF_TYPE_BOOL);
    put_u64(&im, 2);
    put_u8(&im, 0);
    put_u8(&im, 1);
    put_str(&im, "f");
    put_u32(&im, GGUF_TYPE_FLOAT64);
    { double v = 2.0; put(&im, &v, 8); }
    int64_t ne_a[1] = {8}, ne_b[2] = {32, 2};
    put_tensor_info(&im, "a", 1, ne_a, DT_F32, 0);
    put_tensor_info(&im, "b", 2, ne_b, DT_Q8_0, 32);
    put_pad(&im, 32);
    put_filler(&im, 32 + 68);
    put_pad(&im, 32);
    {
        ember_error err = {{0}};
        void *copy;
        gguf_file *f = open_copy(im.p, im.len, &err, &copy);
        if (f == NULL) fail_msg("fuzz seed does not open: %s", err.msg);
        gguf_close(f);
        free(copy);
    }

    uint64_t rng = 20240601;
    int accepted = 0, rejected = 0;
    unsigned sink = 0;
    for (int iter = 0; iter < 2000; iter++) {
        size_t len = im.len;
        uint8_t *buf = malloc(len + 64);
        memcpy(buf, im.p, len);
        int n_mut = 1 + (int)(fuzz_next(&rng) % 4);
        for (int m = 0; m < n_mut; m++) {
            uint64_t r = fuzz_next(&rng);
            size_t at = len ? (size_t)(fuzz_next(&rng) % len) : 0;
            switch (r % 5) {
            case 0: /* flip one bit */
                if (len) buf[at] ^= (uint8_t)(1u << ((r >> 8) % 8));
                break;
            case 1: /* overwrite a byte with an interesting value */
                if (len) {
                    static const uint8_t values[] = {0, 1, 2, 0x7f, 0x80, 0xff, 12, 13, 9, 8};
                    buf[at] = values[(r >> 8) % sizeof values];
                }
                break;
            case 2: /* truncate */
                len = at;
                break;
            case 3: /* insert a random byte */
                if (len < im.len + 63) {
                    memmove(buf + at + 1, buf + at, len - at);
                    buf[at] = (uint8_t)(r >> 16);
                    len++;
                }
                break;
            case 4: /* delete a byte */
                if (len) {
                    memmove(buf + at, buf + at + 1, len - at - 1);
                    len--;
                }
                break;
            }
        }
        ember_error err = {{0}};
        void *copy;
        gguf_file *f = open_copy(buf, len, &err, &copy);
        if (f) {
            sink += walk_file(f);
            gguf_close(f);
            accepted++;
        } else {
            assert_true(err.msg[0] != '\0');
            rejected++;
        }
        free(copy);
        free(buf);
    }
    print_message("fuzz: %d accepted, %d rejected (checksum %u)\n", accepted, rejected, sink);
    assert_int_equal(accepted + rejected, 2000);
    assert_true(rejected > 0);
    free(im.p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_small_valid_image_opens),
        cmocka_unit_test(test_writer_round_trip),
        cmocka_unit_test(test_writer_custom_alignment),
        cmocka_unit_test(test_writer_no_tensors),
        cmocka_unit_test(test_writer_rejects_bad_input),
        cmocka_unit_test(test_fixture_known_values),
        cmocka_unit_test(test_fixture_all_open),
        cmocka_unit_test(test_fixture_stories),
        cmocka_unit_test(test_fixture_rewrite_identical),
        cmocka_unit_test(test_truncated_everywhere),
        cmocka_unit_test(test_bad_magic),
        cmocka_unit_test(test_bad_versions),
        cmocka_unit_test(test_absurd_counts),
        cmocka_unit_test(test_absurd_string_length),
        cmocka_unit_test(test_absurd_array_length),
        cmocka_unit_test(test_nested_array),
        cmocka_unit_test(test_unknown_value_type),
        cmocka_unit_test(test_bad_bool),
        cmocka_unit_test(test_duplicate_key),
        cmocka_unit_test(test_duplicate_tensor_name),
        cmocka_unit_test(test_bad_n_dims),
        cmocka_unit_test(test_negative_dim),
        cmocka_unit_test(test_unknown_tensor_type),
        cmocka_unit_test(test_row_not_multiple_of_block),
        cmocka_unit_test(test_misaligned_offset),
        cmocka_unit_test(test_tensor_past_eof),
        cmocka_unit_test(test_overlapping_tensors),
        cmocka_unit_test(test_bad_alignment_key),
        cmocka_unit_test(test_long_tensor_name),
        cmocka_unit_test(test_fuzz_mutations),
    };
    return test_run_group(tests, NULL, NULL);
}
