/* test_mkmodel.c - `ember mkmodel` end to end: runs the built binary (path
 * from EMBER_BIN) to make tiny models of every architecture and weight type,
 * then reads them back with the GGUF reader and checks keys, shapes, types,
 * weight statistics, the tokenizer, determinism across seeds and thread
 * counts, and the exit status of bad command lines. */
#define _GNU_SOURCE
#include "test_util.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "gguf/gguf.h"
#include "tensor/dtype.h"
#include "tensor/quant.h"
#include "tokenizer/tokenizer.h"

static char *tmp_dir;

static int setup(void **state) {
    (void)state;
    tmp_dir = make_temp_dir();
    return tmp_dir ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    remove_tree(tmp_dir);
    free(tmp_dir);
    return 0;
}

/* Runs `ember mkmodel ARGS`; returns the exit status and leaves stderr in
 * err_out (may be NULL). Skips the test when the binary is unknown. */
static int run_mkmodel(const char *args, char *err_out, size_t err_cap) {
    const char *bin = ember_binary();
    if (bin == NULL) {
        print_message("skipping: EMBER_BIN not set\n");
        return -100;
    }
    char err_path[1024], cmd[4096];
    snprintf(err_path, sizeof err_path, "%s/stderr.txt", tmp_dir);
    snprintf(cmd, sizeof cmd, "'%s' mkmodel %s >/dev/null 2>'%s'", bin, args, err_path);
    int status = system(cmd);
    if (err_out) {
        size_t n = 0;
        char *text = read_whole_file(err_path, &n);
        snprintf(err_out, err_cap, "%s", text ? text : "");
        free(text);
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

#define RUN_OK(args)                                                         \
    do {                                                                     \
        char err_text_[2048];                                                \
        int rc_ = run_mkmodel(args, err_text_, sizeof err_text_);            \
        if (rc_ == -100) {                                                   \
            skip();                                                          \
            return;                                                          \
        }                                                                    \
        if (rc_ != 0) fail_msg("mkmodel %s: exit %d: %s", args, rc_, err_text_); \
    } while (0)

static char *out_path(const char *name) {
    static char buf[4][1024];
    static int next;
    char *p = buf[next++ % 4];
    snprintf(p, sizeof buf[0], "%s/%s", tmp_dir, name);
    return p;
}

static int64_t get_int(const gguf_file *f, const char *key) {
    int64_t v = -1;
    if (!gguf_get_int(f, key, &v)) fail_msg("key %s missing or not an integer", key);
    return v;
}

static int64_t get_arch_int(const gguf_file *f, const char *arch, const char *suffix) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    return get_int(f, key);
}

static void expect_tensor(const gguf_file *f, const char *name, uint32_t type, int64_t ne0, int64_t ne1,
                          int64_t ne2) {
    const gguf_tensor *t = gguf_find_tensor(f, name);
    if (t == NULL) fail_msg("tensor %s missing", name);
    if (t->type != type)
        fail_msg("tensor %s: type %s, expected %s", name, dtype_info_of(t->type)->name, dtype_info_of(type)->name);
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != ne2)
        fail_msg("tensor %s: shape {%lld, %lld, %lld}, expected {%lld, %lld, %lld}", name, (long long)t->ne[0],
                 (long long)t->ne[1], (long long)t->ne[2], (long long)ne0, (long long)ne1, (long long)ne2);
    uint32_t want_dims = ne2 > 1 ? 3 : ne1 > 1 ? 2 : 1;
    assert_int_equal(t->n_dims, want_dims);
}

/* The type mkmodel should choose for a matrix with ne0-element rows. */
static uint32_t expected_type(int want, int64_t ne0) {
    const dtype_info *info = dtype_info_of((uint32_t)want);
    if (ne0 % info->block_elems == 0) return (uint32_t)want;
    switch (want) {
    case DT_Q2_K: case DT_Q3_K: case DT_Q4_K: return expected_type(DT_Q5_0, ne0);
    case DT_Q5_K: return expected_type(DT_Q5_1, ne0);
    case DT_Q6_K: return expected_type(DT_Q8_0, ne0);
    case DT_IQ4_XS: return expected_type(DT_IQ4_NL, ne0);
    default: return DT_F16;
    }
}

static const char *all_types[] = {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0",
                                  "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl",
                                  "iq4_xs"};
static const char *all_archs[] = {"llama", "qwen2", "qwen3", "qwen3moe"};

/* Tiny preset: n_embd 64, 2 layers, 4/2 heads of 16, FFN 128, 4 experts top-2 (64 wide). */
static void check_tiny(const gguf_file *f, const char *arch, int type) {
    gguf_str s;
    assert_true(gguf_get_str(f, "general.architecture", &s));
    assert_true(gguf_str_eq(s, arch));
    assert_true(gguf_get_str(f, "general.name", &s));
    assert_int_equal(get_int(f, "general.quantization_version"), 2);
    assert_int_equal(get_arch_int(f, arch, "embedding_length"), 64);
    assert_int_equal(get_arch_int(f, arch, "block_count"), 2);
    assert_int_equal(get_arch_int(f, arch, "feed_forward_length"), 128);
    assert_int_equal(get_arch_int(f, arch, "attention.head_count"), 4);
    assert_int_equal(get_arch_int(f, arch, "attention.head_count_kv"), 2);
    assert_int_equal(get_arch_int(f, arch, "attention.key_length"), 16);
    assert_int_equal(get_arch_int(f, arch, "attention.value_length"), 16);
    assert_true(get_arch_int(f, arch, "context_length") > 0);
    double v;
    char key[128];
    snprintf(key, sizeof key, "%s.rope.freq_base", arch);
    assert_true(gguf_get_float(f, key, &v) && v > 0);
    snprintf(key, sizeof key, "%s.attention.layer_norm_rms_epsilon", arch);
    assert_true(gguf_get_float(f, key, &v) && v > 0 && v < 1e-4);

    gguf_value_type et;
    uint64_t n_vocab;
    assert_true(gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &n_vocab));
    assert_int_equal(et, GGUF_TYPE_STRING);
    bool moe = strcmp(arch, "qwen3moe") == 0;
    bool qk_norm = strncmp(arch, "qwen3", 5) == 0;
    bool tied = strcmp(arch, "qwen2") == 0 || strcmp(arch, "qwen3") == 0;
    uint32_t t64 = expected_type(type, 64), t128 = expected_type(type, 128);
    expect_tensor(f, "token_embd.weight", t64, 64, (int64_t)n_vocab, 1);
    expect_tensor(f, "output_norm.weight", DT_F32, 64, 1, 1);
    if (tied) assert_null(gguf_find_tensor(f, "output.weight"));
    else expect_tensor(f, "output.weight", t64, 64, (int64_t)n_vocab, 1);
    for (int l = 0; l < 2; l++) {
        char name[64];
#define T(suffix) (snprintf(name, sizeof name, "blk.%d." suffix, l), name)
        expect_tensor(f, T("attn_norm.weight"), DT_F32, 64, 1, 1);
        expect_tensor(f, T("attn_q.weight"), t64, 64, 64, 1);
        expect_tensor(f, T("attn_k.weight"), t64, 64, 32, 1);
        expect_tensor(f, T("attn_v.weight"), t64, 64, 32, 1);
        expect_tensor(f, T("attn_output.weight"), t64, 64, 64, 1);
        expect_tensor(f, T("ffn_norm.weight"), DT_F32, 64, 1, 1);
        if (qk_norm) {
            expect_tensor(f, T("attn_q_norm.weight"), DT_F32, 16, 1, 1);
            expect_tensor(f, T("attn_k_norm.weight"), DT_F32, 16, 1, 1);
        } else {
            assert_null(gguf_find_tensor(f, T("attn_q_norm.weight")));
        }
        if (strcmp(arch, "qwen2") == 0) {
            expect_tensor(f, T("attn_q.bias"), DT_F32, 64, 1, 1);
            expect_tensor(f, T("attn_k.bias"), DT_F32, 32, 1, 1);
            expect_tensor(f, T("attn_v.bias"), DT_F32, 32, 1, 1);
        } else {
            assert_null(gguf_find_tensor(f, T("attn_q.bias")));
        }
        if (moe) {
            expect_tensor(f, T("ffn_gate_inp.weight"), DT_F32, 64, 4, 1);
            expect_tensor(f, T("ffn_gate_exps.weight"), t64, 64, 64, 4);
            expect_tensor(f, T("ffn_up_exps.weight"), t64, 64, 64, 4);
            expect_tensor(f, T("ffn_down_exps.weight"), t64, 64, 64, 4);
            assert_null(gguf_find_tensor(f, T("ffn_gate.weight")));
        } else {
            expect_tensor(f, T("ffn_gate.weight"), t64, 64, 128, 1);
            expect_tensor(f, T("ffn_up.weight"), t64, 64, 128, 1);
            expect_tensor(f, T("ffn_down.weight"), t128, 128, 64, 1);
        }
#undef T
    }
    if (moe) {
        assert_int_equal(get_arch_int(f, arch, "expert_count"), 4);
        assert_int_equal(get_arch_int(f, arch, "expert_used_count"), 2);
        assert_int_equal(get_arch_int(f, arch, "expert_feed_forward_length"), 64);
    }
    assert_null(gguf_find_tensor(f, "blk.2.attn_norm.weight"));
}

static void test_every_arch_and_type(void **state) {
    (void)state;
    for (size_t a = 0; a < sizeof all_archs / sizeof all_archs[0]; a++) {
        for (size_t t = 0; t < sizeof all_types / sizeof all_types[0]; t++) {
            char args[1024];
            const char *path = out_path("m.gguf");
            snprintf(args, sizeof args, "--arch %s --preset tiny --type %s --seed 3 --out '%s'", all_archs[a],
                     all_types[t], path);
            RUN_OK(args);
            ember_error err = {{0}};
            gguf_file *f = gguf_open(path, &err);
            if (f == NULL) fail_msg("%s %s: %s", all_archs[a], all_types[t], err.msg);
            check_tiny(f, all_archs[a], dtype_from_name(all_types[t]));
            gguf_close(f);
        }
    }
}

/* Sample mean and standard deviation of a tensor's values. */
static void tensor_stats(const gguf_tensor *t, double *mean, double *std) {
    int64_t n = t->ne[0], rows = t->ne[1] * t->ne[2] * t->ne[3];
    size_t row_bytes = dtype_row_bytes((ember_dtype)t->type, n);
    float *row = malloc((size_t)n * sizeof *row);
    double sum = 0, sum2 = 0;
    for (int64_t r = 0; r < rows; r++) {
        quant_dequantize_row((ember_dtype)t->type, (const uint8_t *)t->data + (size_t)r * row_bytes, row, n);
        for (int64_t i = 0; i < n; i++) {
            sum += row[i];
            sum2 += (double)row[i] * row[i];
        }
    }
    free(row);
    double count = (double)(n * rows);
    *mean = sum / count;
    *std = sqrt(sum2 / count - *mean * *mean);
}

static void test_weight_statistics(void **state) {
    (void)state;
    const char *path = out_path("stats.gguf");
    char args[1024];
    snprintf(args, sizeof args, "--arch qwen3 --preset small --type f32 --out '%s'", path);
    RUN_OK(args);
    ember_error err = {{0}};
    gguf_file *f = gguf_open(path, &err);
    if (f == NULL) fail_msg("%s", err.msg);
    double mean, std;
    /* Matrices N(0, 1/sqrt(ne0)). */
    tensor_stats(gguf_find_tensor(f, "blk.1.attn_q.weight"), &mean, &std);
    assert_true(fabs(mean) < 0.01 && fabs(std - 1.0 / 16.0) < 0.003);
    tensor_stats(gguf_find_tensor(f, "blk.0.ffn_down.weight"), &mean, &std);
    assert_true(fabs(mean) < 0.01 && fabs(std - 1.0 / sqrt(768.0)) < 0.002);
    /* Tied embedding: the head's N(0, 3/sqrt(n_embd)). */
    tensor_stats(gguf_find_tensor(f, "token_embd.weight"), &mean, &std);
    assert_true(fabs(mean) < 0.02 && fabs(std - 3.0 / 16.0) < 0.01);
    /* Norms exactly 1. */
    const gguf_tensor *norm = gguf_find_tensor(f, "blk.3.attn_q_norm.weight");
    for (int64_t i = 0; i < norm->ne[0]; i++) assert_true(((const float *)norm->data)[i] == 1.0f);
    gguf_close(f);
}

static void test_small_kquant_no_fallback(void **state) {
    (void)state;
    const char *path = out_path("small-q4k.gguf");
    char args[1024];
    snprintf(args, sizeof args, "--arch qwen3 --preset small --type q4_k --out '%s'", path);
    RUN_OK(args);
    ember_error err = {{0}};
    gguf_file *f = gguf_open(path, &err);
    if (f == NULL) fail_msg("%s", err.msg);
    expect_tensor(f, "blk.0.attn_q.weight", DT_Q4_K, 256, 256, 1);
    expect_tensor(f, "blk.0.attn_k.weight", DT_Q4_K, 256, 128, 1);
    expect_tensor(f, "blk.0.ffn_down.weight", DT_Q4_K, 768, 256, 1);
    expect_tensor(f, "blk.3.ffn_up.weight", DT_Q4_K, 256, 768, 1);
    expect_tensor(f, "blk.0.attn_q_norm.weight", DT_F32, 32, 1, 1);
    assert_int_equal(get_int(f, "general.file_type"), 14);
    assert_int_equal(get_int(f, "qwen3.context_length"), 4096);
    assert_int_equal(get_int(f, "qwen3.block_count"), 4);
    assert_int_equal(get_int(f, "qwen3.attention.head_count"), 8);
    assert_int_equal(get_int(f, "qwen3.attention.head_count_kv"), 4);
    /* Dequantized q4_K weights keep the intended spread. */
    double mean, std;
    tensor_stats(gguf_find_tensor(f, "blk.2.attn_v.weight"), &mean, &std);
    assert_true(fabs(mean) < 0.01 && fabs(std - 1.0 / 16.0) < 0.01);
    gguf_close(f);

    snprintf(args, sizeof args, "--arch qwen3moe --preset small --type q6_k --out '%s'", path);
    RUN_OK(args);
    f = gguf_open(path, &err);
    if (f == NULL) fail_msg("%s", err.msg);
    expect_tensor(f, "blk.0.ffn_down_exps.weight", DT_Q6_K, 256, 256, 8);
    expect_tensor(f, "blk.0.ffn_gate_inp.weight", DT_F32, 256, 8, 1);
    assert_int_equal(get_int(f, "qwen3moe.expert_used_count"), 2);
    gguf_close(f);
}

static void test_builtin_tokenizer_round_trip(void **state) {
    (void)state;
    const char *path = out_path("tok.gguf");
    char args[1024];
    snprintf(args, sizeof args, "--arch llama --preset tiny --out '%s'", path);
    RUN_OK(args);
    ember_error err = {{0}};
    gguf_file *f = gguf_open(path, &err);
    if (f == NULL) fail_msg("%s", err.msg);
    tokenizer *tok = tokenizer_load_gguf(f, &err);
    if (tok == NULL) fail_msg("%s", err.msg);
    gguf_value_type et;
    uint64_t n_vocab;
    assert_true(gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &n_vocab));
    assert_int_equal(tokenizer_n_vocab(tok), (int32_t)n_vocab);
    assert_int_equal(gguf_find_tensor(f, "token_embd.weight")->ne[1], (int64_t)n_vocab);
    int32_t *ids;
    size_t n_ids;
    const char *text = "Hello, world!";
    assert_int_equal(tokenizer_encode(tok, text, strlen(text), false, false, &ids, &n_ids, &err), 0);
    assert_true(n_ids > 0);
    char *back;
    size_t back_len;
    assert_int_equal(tokenizer_decode(tok, ids, n_ids, false, &back, &back_len, &err), 0);
    assert_string_equal(back, text);
    assert_non_null(tokenizer_chat_template(tok));
    free(ids);
    free(back);
    tokenizer_free(tok);
    gguf_close(f);
}

static void test_vocab_import(void **state) {
    (void)state;
    REQUIRE_FIXTURE(vocab, "models/stories260K.gguf");
    char vocab_copy[1024];
    snprintf(vocab_copy, sizeof vocab_copy, "%s", vocab);
    const char *path = out_path("vocab.gguf");
    char args[2048];
    snprintf(args, sizeof args, "--arch llama --preset tiny --type q8_0 --vocab '%s' --out '%s'", vocab_copy, path);
    RUN_OK(args);
    ember_error err = {{0}};
    gguf_file *f = gguf_open(path, &err);
    if (f == NULL) fail_msg("%s", err.msg);
    gguf_file *src = gguf_open(vocab_copy, &err);
    if (src == NULL) fail_msg("%s", err.msg);
    gguf_str s;
    assert_true(gguf_get_str(f, "tokenizer.ggml.model", &s) && gguf_str_eq(s, "llama"));
    assert_int_equal(gguf_find_tensor(f, "token_embd.weight")->ne[1], 512);
    /* Every tokenizer.* key of the source is there with the same value bytes. */
    int copied = 0;
    for (int64_t i = 0; i < gguf_kv_count(src); i++) {
        const char *key = gguf_kv_key(src, i);
        if (strncmp(key, "tokenizer.", 10) != 0) continue;
        int64_t j = gguf_find_key(f, key);
        assert_true(j >= 0);
        assert_int_equal(gguf_kv_type(f, j), gguf_kv_type(src, i));
        copied++;
    }
    assert_true(copied >= 5);
    int64_t idx = gguf_find_key(f, "tokenizer.ggml.scores");
    assert_true(gguf_arr_float(f, idx, 300) == gguf_arr_float(src, gguf_find_key(src, "tokenizer.ggml.scores"), 300));
    gguf_close(src);
    gguf_close(f);
}

static bool files_equal(const char *a, const char *b) {
    size_t na, nb;
    void *pa = read_whole_file(a, &na), *pb = read_whole_file(b, &nb);
    bool same = pa && pb && na == nb && memcmp(pa, pb, na) == 0;
    free(pa);
    free(pb);
    return same;
}

static void test_determinism(void **state) {
    (void)state;
    const char *a = out_path("a.gguf"), *b = out_path("b.gguf"), *c = out_path("c.gguf");
    char args[1024];
    snprintf(args, sizeof args, "--arch qwen3moe --preset tiny --type q4_k --seed 7 --out '%s'", a);
    RUN_OK(args);
    snprintf(args, sizeof args, "--arch qwen3moe --preset tiny --type q4_k --seed 7 --threads 1 --out '%s'", b);
    RUN_OK(args);
    assert_true(files_equal(a, b));
    snprintf(args, sizeof args, "--arch qwen3moe --preset tiny --type q4_k --seed 8 --out '%s'", c);
    RUN_OK(args);
    assert_false(files_equal(a, c));
    size_t na, nc;
    free(read_whole_file(a, &na));
    free(read_whole_file(c, &nc));
    assert_int_equal(na, nc); /* only the values differ */
}

static void test_bad_arguments(void **state) {
    (void)state;
    static const char *bad[] = {
        "",
        "--out /tmp/x.gguf",                                 /* no arch */
        "--arch gpt5 --out /tmp/x.gguf",                     /* unknown arch */
        "--arch llama --preset huge --out /tmp/x.gguf",      /* unknown preset */
        "--arch llama --type q8_k --out /tmp/x.gguf",        /* activation-only type */
        "--arch llama --type int4 --out /tmp/x.gguf",        /* unknown type */
        "--arch llama",                                      /* no --out */
        "--arch llama --seed abc --out /tmp/x.gguf",         /* bad seed */
        "--arch llama --seed -1 --out /tmp/x.gguf",          /* negative seed */
        "--arch llama --out",                                /* missing value */
        "--arch llama --frobnicate --out /tmp/x.gguf",       /* unknown option */
        "--arch llama --preset qwen3-0.6b --out /tmp/x.gguf", /* preset of another arch */
        "--arch qwen3 --preset llama-3.2-1b --out /tmp/x.gguf", /* likewise */
        "--arch llama --vocab a.gguf --tokenizer-dir d --out /tmp/x.gguf",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char err_text[4096];
        int rc = run_mkmodel(bad[i], err_text, sizeof err_text);
        if (rc == -100) {
            skip();
            return;
        }
        if (rc != 2) fail_msg("'%s': exit %d, expected 2", bad[i], rc);
        if (strstr(err_text, "ember mkmodel:") == NULL || strstr(err_text, "usage:") == NULL)
            fail_msg("'%s': no message and usage on stderr: %s", bad[i], err_text);
    }
    /* Failures after parsing exit 1 with a message naming the problem. */
    char err_text[4096];
    assert_int_equal(run_mkmodel("--arch llama --out /nonexistent-dir/x.gguf", err_text, sizeof err_text), 1);
    assert_non_null(strstr(err_text, "nonexistent-dir"));
    assert_int_equal(run_mkmodel("--arch llama --vocab /nonexistent.gguf --out /tmp/x.gguf", err_text,
                                 sizeof err_text), 1);
    assert_non_null(strstr(err_text, "nonexistent.gguf"));
    /* --help is not an error. */
    assert_int_equal(run_mkmodel("--help", NULL, 0), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_arch_and_type),
        cmocka_unit_test(test_weight_statistics),
        cmocka_unit_test(test_small_kquant_no_fallback),
        cmocka_unit_test(test_builtin_tokenizer_round_trip),
        cmocka_unit_test(test_vocab_import),
        cmocka_unit_test(test_determinism),
        cmocka_unit_test(test_bad_arguments),
    };
    return test_run_group(tests, setup, teardown);
}
