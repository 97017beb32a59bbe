/* test_iq4.c - IQ4_NL and IQ4_XS weights on a real model file, without
 * llama.cpp: an F32 `ember mkmodel` llama is converted by `ember quantize`
 * (and made directly by `mkmodel --type`), then
 *  - every matrix is of the asked type and dequantizes to within IQ4's error
 *    of the float weights it came from;
 *  - on the file's own matrices, tensor_matmul (tiles, GEMV, ragged edges)
 *    is bit-identical to the single-row dot on every ISA, and the ISAs agree;
 *  - the model's logits are bit-identical across batch sizes and thread
 *    counts, and stay close to the F32 model's: closer than Q4_0's, the
 *    4-bit linear format IQ4 improves on.
 * The bytes themselves were checked against llama.cpp once (same quantizer
 * output, same dequantized values; see the issue note), which no test can
 * repeat without a llama.cpp build. */
#define _GNU_SOURCE
#include "test_util.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/threadpool.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "tensor/matmul.h"
#include "tensor/quant.h"

static char *tmp_dir;
static char f32_path[1024];

static const char *in_tmp(const char *name) {
    static char paths[4][1024];
    static int next;
    char *p = paths[next++ % 4];
    snprintf(p, sizeof paths[0], "%s/%s", tmp_dir, name);
    return p;
}

static int run_ember(const char *args) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' %s >/dev/null 2>&1", ember_binary(), args);
    return system(cmd);
}

static int setup(void **state) {
    (void)state;
    if (ember_binary() == NULL) return 0;
    tmp_dir = make_temp_dir();
    if (tmp_dir == NULL) return -1;
    snprintf(f32_path, sizeof f32_path, "%s", in_tmp("f32.gguf"));
    char args[2048];
    snprintf(args, sizeof args, "mkmodel --arch llama --preset small --type f32 --seed 5 --out '%s'", f32_path);
    return run_ember(args) == 0 ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    if (tmp_dir) remove_tree(tmp_dir);
    free(tmp_dir);
    return 0;
}

#define REQUIRE_BINARY()                                            \
    if (ember_binary() == NULL) {                                   \
        print_message("skipping: EMBER_BIN not set\n");            \
        skip();                                                     \
    }

/* `ember quantize` of the F32 model to `type` (once); returns the output path. */
static const char *quantized(const char *type) {
    const char *out = in_tmp(type);
    if (access(out, F_OK) == 0) return out;
    char args[2048];
    snprintf(args, sizeof args, "quantize '%s' '%s' --type %s", f32_path, out, type);
    if (run_ember(args) != 0) fail_msg("ember quantize --type %s failed", type);
    return out;
}

static bool is_matrix(const gguf_tensor *t) { return t->n_dims == 2; }

/* rms(dequant - float) / rms(float) over a whole tensor. */
static double tensor_rel_rmse(const gguf_tensor *q, const gguf_tensor *f) {
    int64_t n = q->ne[0], rows = q->ne[1];
    size_t rb = dtype_row_bytes((ember_dtype)q->type, n);
    float *row = malloc((size_t)n * sizeof *row);
    double e = 0, s = 0;
    for (int64_t r = 0; r < rows; r++) {
        quant_dequantize_row((ember_dtype)q->type, (const uint8_t *)q->data + (size_t)r * rb, row, n);
        const float *x = (const float *)f->data + r * n;
        for (int64_t i = 0; i < n; i++) {
            e += ((double)row[i] - x[i]) * ((double)row[i] - x[i]);
            s += (double)x[i] * x[i];
        }
    }
    free(row);
    return sqrt(e / s);
}

/* Every matrix converted, norms kept, values within IQ4's error. */
static void check_file(const char *path, ember_dtype type, uint32_t file_type) {
    ember_error err = {{0}};
    gguf_file *q = gguf_open(path, &err), *f = gguf_open(f32_path, &err);
    if (q == NULL || f == NULL) fail_msg("%s", err.msg);
    int64_t v;
    assert_true(gguf_get_int(q, "general.file_type", &v));
    assert_int_equal(v, file_type);
    int matrices = 0;
    for (int64_t i = 0; i < gguf_tensor_count(q); i++) {
        const gguf_tensor *t = gguf_tensor_at(q, i);
        const gguf_tensor *src = gguf_find_tensor(f, t->name);
        assert_non_null(src);
        if (!is_matrix(t)) {
            assert_int_equal(t->type, DT_F32);
            continue;
        }
        if (t->type != (uint32_t)type) fail_msg("%s: type %u, wanted %s", t->name, t->type, dtype_info_of(type)->name);
        /* 4.25-4.5 bits per weight: Q4_K's bound in test_quant (measured 0.07-0.09). */
        double e = tensor_rel_rmse(t, src);
        if (e > 0.12) fail_msg("%s %s: relative rmse %.4f > 0.12", dtype_info_of(type)->name, t->name, e);
        matrices++;
    }
    assert_int_equal(matrices, 4 * 7 + 2); /* 7 per layer, token_embd, output */
    gguf_close(q);
    gguf_close(f);
}

static void test_quantize_files(void **state) {
    (void)state;
    REQUIRE_BINARY();
    check_file(quantized("iq4_xs"), DT_IQ4_XS, 30);
    check_file(quantized("iq4_nl"), DT_IQ4_NL, 25);
    /* inspect names the type in the tensor table and loads the model. */
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd, "'%s' inspect '%s'", ember_binary(), quantized("iq4_xs"));
    assert_int_equal(run_capture(cmd, &out), 0);
    const char *row = strstr(out, "blk.0.ffn_down.weight ");
    const char *eol = row ? strchr(row, '\n') : NULL;
    const char *type = row ? strstr(row, " iq4_xs ") : NULL;
    if (type == NULL || (eol && type > eol) || strstr(out, "model: llama") == NULL)
        fail_msg("ember inspect output lacks the iq4_xs tensor row or the model line:\n%s", out);
    free(out);
    /* mkmodel --type writes the same values as quantizing its F32 output. */
    const char *direct = in_tmp("direct.gguf");
    char args[2048];
    snprintf(args, sizeof args, "mkmodel --arch llama --preset small --type iq4_xs --seed 5 --out '%s'", direct);
    assert_int_equal(run_ember(args), 0);
    ember_error err = {{0}};
    gguf_file *a = gguf_open(direct, &err), *b = gguf_open(quantized("iq4_xs"), &err);
    if (a == NULL || b == NULL) fail_msg("%s", err.msg);
    const gguf_tensor *ta = gguf_find_tensor(a, "blk.1.ffn_down.weight"), *tb = gguf_find_tensor(b, "blk.1.ffn_down.weight");
    assert_int_equal(ta->type, DT_IQ4_XS);
    assert_int_equal(ta->nbytes, tb->nbytes);
    assert_memory_equal(ta->data, tb->data, ta->nbytes);
    gguf_close(a);
    gguf_close(b);
}

/* y[t][o] of tensor_matmul equals quant_vec_dot bit for bit. */
static void check_matmul(const gguf_tensor *t, int64_t n_tokens, ember_pool *pool, float *y_out) {
    ember_dtype type = (ember_dtype)t->type, act = dtype_info_of(type)->dot_act;
    int64_t n_in = t->ne[0], n_out = t->ne[1];
    tensor_weight w = {.type = type, .n_in = n_in, .n_out = n_out,
                       .row_bytes = dtype_row_bytes(type, n_in), .data = t->data};
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    float *x = malloc((size_t)(n_tokens * n_in) * sizeof *x);
    for (int64_t i = 0; i < n_tokens * n_in; i++) x[i] = (float)test_rand(&rng) / 4294967296.0f * 4.0f - 2.0f;
    float *y = malloc((size_t)(n_tokens * n_out) * sizeof *y);
    matmul_scratch *s = matmul_scratch_create();
    assert_int_equal(tensor_matmul(pool, s, &w, x, n_tokens, y), 0);
    uint8_t *a = malloc(dtype_row_bytes(act, n_in));
    for (int64_t tok = 0; tok < n_tokens; tok++) {
        quant_quantize_row(act, x + tok * n_in, a, n_in);
        for (int64_t o = 0; o < n_out; o++) {
            float ref = quant_vec_dot(type, n_in, (const uint8_t *)t->data + (size_t)o * w.row_bytes, a);
            if (memcmp(&ref, &y[tok * n_out + o], 4) != 0)
                fail_msg("%s %s isa %s, %lld tokens: y[%lld][%lld] %.9g != dot %.9g", dtype_info_of(type)->name,
                         t->name, quant_isa_name(quant_get_isa()), (long long)n_tokens, (long long)tok,
                         (long long)o, y[tok * n_out + o], ref);
        }
    }
    if (y_out) memcpy(y_out, y, (size_t)(n_tokens * n_out) * sizeof *y);
    matmul_scratch_free(s);
    free(x), free(y), free(a);
}

static void test_matmul_on_file(void **state) {
    (void)state;
    REQUIRE_BINARY();
    const char *types[] = {"iq4_xs", "iq4_nl"};
    const char *names[] = {"blk.0.attn_k.weight", "blk.2.ffn_down.weight", "output.weight"};
    ember_pool *pool = ember_pool_create(2);
    quant_isa best = quant_best_isa();
    for (int k = 0; k < 2; k++) {
        ember_error err = {{0}};
        gguf_file *f = gguf_open(quantized(types[k]), &err);
        if (f == NULL) fail_msg("%s", err.msg);
        for (int n = 0; n < 3; n++) {
            const gguf_tensor *t = gguf_find_tensor(f, names[n]);
            assert_non_null(t);
            const int64_t n_tokens = 37; /* full 4x4 tiles, ragged rows and tokens */
            float *first = malloc((size_t)(n_tokens * t->ne[1]) * sizeof(float));
            float *y = malloc((size_t)(n_tokens * t->ne[1]) * sizeof(float));
            for (int isa = 0; isa <= (int)best; isa++) {
                assert_true(quant_set_isa((quant_isa)isa));
                check_matmul(t, n_tokens, pool, isa == 0 ? first : y);
                check_matmul(t, 1, pool, NULL);
                if (isa > 0 && memcmp(first, y, (size_t)(n_tokens * t->ne[1]) * sizeof(float)) != 0)
                    fail_msg("%s %s: %s differs from scalar", types[k], names[n], quant_isa_name((quant_isa)isa));
            }
            free(first), free(y);
        }
        gguf_close(f);
    }
    quant_set_isa(best);
    ember_pool_free(pool);
}

/* Logits of every position of `ids`, evaluated in chunks of `chunk`. */
static float *logits_of(const char *path, const int32_t *ids, int n, int chunk, int threads, int *V) {
    ember_error err = {{0}};
    model *m = model_load(path, &err);
    if (m == NULL) fail_msg("model_load(%s): %s", path, err.msg);
    kv_pool_config cfg;
    model_kv_config(m, 64, &cfg);
    kv_pool *kv = kv_pool_create(&cfg, &err);
    assert_non_null(kv);
    model_ctx *ctx = model_ctx_create(m, kv, threads, chunk, &err);
    assert_non_null(ctx);
    kv_seq seq;
    kv_seq_init(&seq);
    *V = model_get_hparams(m)->n_vocab;
    float *out = malloc((size_t)n * (size_t)*V * sizeof(float));
    for (int s = 0; s < n; s += chunk)
        if (model_eval_state(ctx, &seq, NULL, ids + s, n - s < chunk ? n - s : chunk, true, out + (size_t)s * *V,
                             &err) < 0)
            fail_msg("model_eval: %s", err.msg);
    kv_seq_release(kv, &seq);
    model_ctx_free(ctx);
    kv_pool_free(kv);
    model_free(m);
    return out;
}

static double logits_rel_rmse(const float *a, const float *ref, size_t n) {
    double e = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        e += ((double)a[i] - ref[i]) * ((double)a[i] - ref[i]);
        s += (double)ref[i] * ref[i];
    }
    return sqrt(e / s);
}

static void test_logits(void **state) {
    (void)state;
    REQUIRE_BINARY();
    enum { N = 48 };
    int32_t ids[N];
    uint64_t rng = 77;
    int V;
    float *f32 = logits_of(f32_path, (int32_t[]){1}, 1, 1, 1, &V);
    free(f32);
    test_random_tokens(&rng, ids, N, V);
    f32 = logits_of(f32_path, ids, N, 64, 2, &V);
    float *q4_0 = logits_of(quantized("q4_0"), ids, N, 64, 2, &V);
    double q4_0_err = logits_rel_rmse(q4_0, f32, (size_t)N * V);
    free(q4_0);
    const char *types[] = {"iq4_xs", "iq4_nl"};
    for (int k = 0; k < 2; k++) {
        const char *path = quantized(types[k]);
        float *whole = logits_of(path, ids, N, 64, 2, &V);
        /* Batch invariance on the real file: chunks of 1 and 7, 1 thread. */
        const int chunks[][2] = {{1, 2}, {7, 2}, {64, 1}};
        for (int c = 0; c < 3; c++) {
            float *part = logits_of(path, ids, N, chunks[c][0], chunks[c][1], &V);
            if (memcmp(whole, part, (size_t)N * V * sizeof(float)) != 0)
                fail_msg("%s: chunks of %d on %d threads differ from one batch", types[k], chunks[c][0], chunks[c][1]);
            free(part);
        }
        /* Random weights amplify any weight error through the layers: 4-bit
         * files land at 0.33-0.38 relative rmse from F32 here (Q8_0: 0.03);
         * a wrong table or nibble order gives > 1. */
        double e = logits_rel_rmse(whole, f32, (size_t)N * V);
        print_message("%s: logits relative rmse vs f32 %.4f (q4_0 %.4f)\n", types[k], e, q4_0_err);
        if (e > 0.5) fail_msg("%s: logits relative rmse vs f32 %.4f > 0.5", types[k], e);
        if (e > q4_0_err) fail_msg("%s: logits further from f32 (%.4f) than q4_0's (%.4f)", types[k], e, q4_0_err);
        free(whole);
    }
    free(f32);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_quantize_files),
        cmocka_unit_test(test_matmul_on_file),
        cmocka_unit_test(test_logits),
    };
    return test_run_group(tests, setup, teardown);
}
