/* test_cli.c - the `ember` command end to end, as a user runs it:
 * run (greedy text equals the golden continuation, also with an f16 KV
 * cache), logits (file equals the
 * in-process logits bit for bit, in each KV format), inspect (reports the cache stack),
 * tokenize (ids equal the golden prompt ids), and bad arguments (exit 2). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "model/model.h"
#include "tensor/dtype.h"
#include "test_util.h"

static const char *bin_or_skip(void) {
    const char *bin = ember_binary();
    if (bin == NULL) print_message("skipping: EMBER_BIN is not set (run under ctest)\n");
    return bin;
}

static void test_run_greedy_matches_golden(void **state) {
    (void)state;
    const char *bin = bin_or_skip();
    if (bin == NULL) skip();
    REQUIRE_FIXTURE(model_path, "models/stories260K.gguf");
    char cmd[2048], *out;
    snprintf(cmd, sizeof cmd, "%s run %s -p 'Once upon a time' -n 32 --threads 2 2>/dev/null", bin, model_path);
    assert_int_equal(run_capture(cmd, &out), 0);
    /* golden/greedy.jsonl, second line: the 32-token continuation of this prompt */
    assert_non_null(strstr(out, ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw"));
    free(out);
    /* an f16 KV cache tells the same story */
    snprintf(cmd, sizeof cmd, "%s run %s -p 'Once upon a time' -n 32 --threads 2 --kv-format f16 2>/dev/null", bin,
             model_path);
    assert_int_equal(run_capture(cmd, &out), 0);
    assert_non_null(strstr(out, ", there was a little girl named Lily. She loved to play outside in the park. One day, she saw"));
    free(out);
}

/* The file equals the in-process logits of a pool in the same KV format:
 * no flag means f32, and --kv-format picks each of the others. */
static void test_logits_file_matches_in_process(void **state) {
    (void)state;
    const char *bin = bin_or_skip();
    if (bin == NULL) skip();
    REQUIRE_FIXTURE(model_path, "models/stories260K.gguf");
    char *dir = make_temp_dir();
    const char *flags[] = {"", "--kv-format f16", "--kv-format q8_0"};
    const kv_format formats[] = {{KV_FORMAT_F32}, {KV_FORMAT_F16}, {KV_FORMAT_Q8_0}};
    float *first = NULL;
    for (int f = 0; f < 3; f++) {
        char out_path[512], cmd[2048], *out;
        snprintf(out_path, sizeof out_path, "%s/logits-%d.f32", dir, f);
        snprintf(cmd, sizeof cmd, "%s logits %s --tokens 1,403,407,261,378 %s --out %s 2>/dev/null", bin, model_path,
                 flags[f], out_path);
        assert_int_equal(run_capture(cmd, &out), 0);
        free(out);
        size_t size;
        float *file = read_whole_file(out_path, &size);
        assert_int_equal(size, 5 * 512 * sizeof(float));

        ember_error err;
        model *m = model_load(model_path, &err);
        kv_pool_config cfg;
        model_kv_config(m, 4, &cfg);
        cfg.format = formats[f];
        kv_pool *pool = kv_pool_create(&cfg, &err);
        model_ctx *ctx = model_ctx_create(m, pool, 1, 8, &err);
        kv_seq seq;
        kv_seq_init(&seq);
        float *mine = malloc(5 * 512 * sizeof(float));
        const int32_t ids[5] = {1, 403, 407, 261, 378};
        assert_int_equal(model_eval(ctx, &seq, ids, 5, true, mine, &err), 0);
        assert_memory_equal(file, mine, 5 * 512 * sizeof(float));
        /* another format gives other logits (the first position attends to itself alone: skip it) */
        if (first) assert_memory_not_equal(file + 512, first + 512, 4 * 512 * sizeof(float));
        kv_seq_release(pool, &seq);
        model_ctx_free(ctx);
        kv_pool_free(pool);
        model_free(m);
        free(mine);
        if (first == NULL) first = file;
        else free(file);
    }
    free(first);
    remove_tree(dir);
    free(dir);
}

static void test_inspect_and_tokenize(void **state) {
    (void)state;
    const char *bin = bin_or_skip();
    if (bin == NULL) skip();
    REQUIRE_FIXTURE(model_path, "reference/qwen3moe-f32.gguf");
    char cmd[2048], *out;
    snprintf(cmd, sizeof cmd, "%s inspect %s", bin, model_path);
    assert_int_equal(run_capture(cmd, &out), 0);
    assert_non_null(strstr(out, "cache stack summary: 3 kv / 0 rot / 0 arr / 0 list / 0 other"));
    assert_non_null(strstr(out, "experts: 4, 2 used per token"));
    assert_non_null(strstr(out, "blk.0.ffn_gate_exps.weight"));
    free(out);
    REQUIRE_FIXTURE(stories, "models/stories260K.gguf");
    snprintf(cmd, sizeof cmd, "%s tokenize %s -p 'Once upon a time'", bin, stories);
    assert_int_equal(run_capture(cmd, &out), 0);
    /* prompt_ids of the golden file's second line start with BOS */
    assert_true(strncmp(out, "1\n", 2) == 0);
    int lines = 0;
    for (char *p = out; *p; p++) lines += *p == '\n';
    assert_int_equal(lines, 5);
    free(out);
}

static void test_bad_arguments(void **state) {
    (void)state;
    const char *bin = bin_or_skip();
    if (bin == NULL) skip();
    char cmd[2048], *out;
    snprintf(cmd, sizeof cmd, "%s run 2>&1", bin);
    assert_int_equal(run_capture(cmd, &out), 2);
    free(out);
    snprintf(cmd, sizeof cmd, "%s frobnicate 2>&1", bin);
    assert_int_equal(run_capture(cmd, &out), 2);
    assert_non_null(strstr(out, "unknown command"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s run m.gguf -p hi --kv-format bf16 2>&1", bin);
    assert_int_equal(run_capture(cmd, &out), 2);
    assert_non_null(strstr(out, "--kv-format: expected one of f32|f16|q8_0|kvarn"));
    assert_non_null(strstr(out, "got 'bf16'"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s logits m.gguf --tokens 1 --out x --kv-format q4 2>&1", bin);
    assert_int_equal(run_capture(cmd, &out), 2);
    assert_non_null(strstr(out, "--kv-format: expected one of f32|f16|q8_0|kvarn"));
    assert_non_null(strstr(out, "got 'q4'"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s run /nonexistent.gguf -p hi 2>&1", bin);
    assert_int_equal(run_capture(cmd, &out), 1);
    assert_non_null(strstr(out, "cannot open"));
    free(out);
    char *dir = make_temp_dir();
    char junk[512];
    snprintf(junk, sizeof junk, "%s/junk.gguf", dir);
    FILE *fp = fopen(junk, "wb");
    fputs("this is not a model file\n", fp);
    fclose(fp);
    snprintf(cmd, sizeof cmd, "%s run %s -p hi 2>&1", bin, junk);
    assert_int_equal(run_capture(cmd, &out), 1);
    assert_non_null(strstr(out, "magic"));
    free(out);
    remove_tree(dir);
    free(dir);
}

/* ember quantize: matrices converted, norms kept, the copy loads and runs;
 * a bad type or a missing file is refused. */
static void test_quantize(void **state) {
    (void)state;
    const char *bin = bin_or_skip();
    if (bin == NULL) skip();
    REQUIRE_FIXTURE(model_path, "models/stories260K.gguf");
    char *dir = make_temp_dir(), copy[512], cmd[2048], *out;
    snprintf(copy, sizeof copy, "%s/q8.gguf", dir);
    snprintf(cmd, sizeof cmd, "%s quantize %s %s --type q8_0 2>&1", bin, model_path, copy);
    assert_int_equal(run_capture(cmd, &out), 0);
    assert_non_null(strstr(out, "converted to q8_0"));
    free(out);
    ember_error err;
    model *orig = model_load(model_path, &err), *q = model_load(copy, &err);
    assert_non_null(orig);
    assert_non_null(q);
    const gguf_file *fo = model_get_gguf(orig), *fq = model_get_gguf(q);
    assert_int_equal(gguf_tensor_count(fo), gguf_tensor_count(fq));
    int quantized = 0;
    for (int64_t i = 0; i < gguf_tensor_count(fq); i++) {
        const gguf_tensor *a = gguf_tensor_at(fo, i), *b = gguf_tensor_at(fq, i);
        assert_string_equal(a->name, b->name);
        assert_memory_equal(a->ne, b->ne, sizeof a->ne);
        if (a->n_dims >= 2) {
            /* rows that 32-element blocks do not divide fall back to f16 */
            assert_int_equal(b->type, a->ne[0] % 32 == 0 ? DT_Q8_0 : DT_F16);
            quantized += b->type == DT_Q8_0;
        } else {
            assert_int_equal(b->type, a->type);
            assert_memory_equal(a->data, b->data, a->nbytes);
        }
    }
    assert_true(quantized > 0);
    model_free(orig);
    model_free(q);
    /* it generates (Q8_0 keeps stories260K's greedy story) */
    snprintf(cmd, sizeof cmd, "%s run %s -p 'Once upon a time' -n 16 --threads 2 2>/dev/null", bin, copy);
    assert_int_equal(run_capture(cmd, &out), 0);
    assert_non_null(strstr(out, "there was a little girl"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s quantize %s %s/x.gguf --type q9_9 2>&1", bin, model_path, dir);
    assert_int_equal(run_capture(cmd, &out), 2);
    free(out);
    snprintf(cmd, sizeof cmd, "%s quantize %s/none.gguf %s/x.gguf --type q8_0 2>&1", bin, dir, dir);
    assert_int_equal(run_capture(cmd, &out), 1);
    free(out);
    remove_tree(dir);
    free(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_run_greedy_matches_golden),
        cmocka_unit_test(test_logits_file_matches_in_process),
        cmocka_unit_test(test_inspect_and_tokenize),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_quantize),
    };
    return test_run_group(tests, NULL, NULL);
}
