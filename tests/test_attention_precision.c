/* test_attention_precision.c - the opt-in bf16 and int8 attention
 * precisions through the engine (server.attention_precision; kernels in
 * test_ops). int8 (bf16 with q.k on bytes) is held to everything bf16 is
 * below: warm == cold, prebuilt tiles, the 3% bound, its own namespace.
 *
 * On an `ember mkmodel` qwen3 with heads of 128 values (preset heads128,
 * q8_0 weights, f16 KV) where the CPU has AVX512_BF16:
 *  - warm == cold at bf16: a prompt prefilled in 32-token grid chunks and
 *    decoded, then adopted from the block tier, gives bit-identical logits
 *    (decode and prefill run the same bf16 arithmetic); and prefilled in
 *    one 200-row batch, on tiles built once per layer, the same bits as in
 *    32-row chunks;
 *  - bf16 changes the logits, by at most 3% of the largest |logit| (max
 *    |diff| over every step's logits against the f32 run; measured 0.207
 *    against logits up to 12.9, 1.6%), and picks the same greedy tokens;
 *  - the SSD tier keeps the precisions apart: a cache written at bf16 is
 *    not adopted at f32 (0 disk hits, its own namespace, one log line
 *    naming the other precision's files), and is adopted again at bf16;
 *  - the f32 namespace is the one of before the setting (f32 adds nothing
 *    to the hash: the namespace of an engine that never asked equals an
 *    engine that asked for f32).
 * Without AVX512_BF16 the engine falls back to f32 and says why
 * (engine_attention_fallback), which is what is checked there. And the
 * setting: server.attention_precision, default f32, from the environment,
 * a flag and a file, anything but f32|bf16|int8 refused naming the key. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/log.h"
#include "engine/engine.h"
#include "kv/kv_pool.h"
#include "model/model.h"
#include "serve/serve_config.h"
#include "serve/serve_settings.h"
#include "test_util.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static char *model_dir;
static char model_path[512];

static int setup(void **state) {
    (void)state;
    model_dir = make_temp_dir();
    snprintf(model_path, sizeof model_path, "%s/h128.gguf", model_dir);
    char cmd[2048];
    snprintf(cmd, sizeof cmd,
             "'%s' mkmodel --arch qwen3 --preset heads128 --type q8_0 --seed 7 --out '%s' >/dev/null 2>&1",
             ember_binary(), model_path);
    return system(cmd) == 0 ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    remove_tree(model_dir);
    free(model_dir);
    return 0;
}

/* The configuration every engine here shares; the precision stays the default. */
static engine_config base_config(const char *disk_root) {
    engine_config cfg = engine_default_config();
    cfg.n_threads = 2;
    cfg.prefill_step = 32;
    cfg.n_ctx = 1024;
    cfg.kv_format = (kv_format){KV_FORMAT_F16};
    cfg.cache.disk.path = disk_root;
    return cfg;
}

static engine *open_engine(const model *m, attention_precision prec, apc_force force, const char *disk_root) {
    engine_config cfg = base_config(disk_root);
    cfg.attention = prec;
    cfg.cache.force_tier = force;
    return test_open_engine(m, &cfg);
}

/* Opens an engine with its log (INFO and up) captured into *log. */
static engine *open_logged(const model *m, attention_precision prec, const char *root, char **log) {
    test_log_capture cap;
    test_log_capture_begin(&cap);
    engine *e = open_engine(m, prec, APC_FORCE_NONE, root);
    *log = test_log_capture_end(&cap);
    return e;
}

static bool bf16_here(const model *m) {
    const model_hparams *hp = model_get_hparams(m);
    return model_attention_precision(m, (kv_format){KV_FORMAT_F16}, ATTENTION_BF16, NULL) == ATTENTION_BF16 &&
           hp->d_k == 128;
}

/* The model, where this CPU runs bf16 attention on it; the test is skipped
 * elsewhere (the fallback has its own test). */
static model *bf16_model_or_skip(void) {
    model *m = test_load_model(model_path);
    if (!bf16_here(m)) {
        model_free(m);
        skip();
    }
    return m;
}

static void test_fallback_says_why(void **state) {
    (void)state;
    model *m = test_load_model(model_path);
    engine *e = open_engine(m, ATTENTION_BF16, APC_FORCE_NONE, NULL);
    if (bf16_here(m)) {
        assert_int_equal(engine_attention_precision(e), ATTENTION_BF16);
        assert_null(engine_attention_fallback(e));
        assert_string_equal(test_cache_stats(e).attention_precision, "bf16");
    } else {
        assert_int_equal(engine_attention_precision(e), ATTENTION_F32);
        assert_non_null(engine_attention_fallback(e));
    }
    engine_free(e);
    /* kvarn pools have no bf16 kernel */
    kv_format kvarn;
    assert_int_equal(kv_format_parse("kvarn", &kvarn), 0);
    const char *why = NULL;
    assert_int_equal(model_attention_precision(m, kvarn, ATTENTION_BF16, &why), ATTENTION_F32);
    assert_non_null(why);
    model_free(m);
}

static void check_warm_equals_cold(model *m, attention_precision prec) {
    const char *name = attention_precision_name(prec);
    char what[64];
    int V = model_get_hparams(m)->n_vocab;
    engine *e = open_engine(m, prec, APC_FORCE_BLOCK, NULL);
    assert_int_equal(engine_attention_precision(e), prec);
    int32_t p[200];
    test_random_tokens(&rng_state, p, 200, V);
    engine_result stored, warm, cold;
    test_generate(e, p, 200, 6, ENGINE_CACHE_ON, &stored);
    test_generate(e, p, 200, 6, ENGINE_CACHE_LOOKUP, &warm);
    test_generate(e, p, 200, 6, ENGINE_CACHE_BYPASS, &cold);
    assert_true(warm.cached_tokens >= 192);
    snprintf(what, sizeof what, "%s attention, block tier", name);
    assert_warm_equals_cold(&cold, &warm, what);
    snprintf(what, sizeof what, "%s attention, the storing run", name);
    assert_warm_equals_cold(&cold, &stored, what);
    /* against f32 attention: other logits, close */
    engine *f = open_engine(m, ATTENTION_F32, APC_FORCE_BLOCK, NULL);
    engine_result ref;
    test_generate(f, p, 200, 6, ENGINE_CACHE_BYPASS, &ref);
    assert_int_equal(ref.n_tokens, cold.n_tokens);
    double max_diff = 0, max_abs = 0;
    for (size_t i = 0; i < (size_t)cold.n_tokens * (size_t)V; i++) {
        double d = fabs((double)cold.logits[i] - (double)ref.logits[i]);
        if (d > max_diff) max_diff = d;
        if (fabs((double)ref.logits[i]) > max_abs) max_abs = fabs((double)ref.logits[i]);
    }
    print_message("%s vs f32 attention: max |logit diff| %.3g over %d steps (max |logit| %.3g)\n", name, max_diff,
                  cold.n_tokens, max_abs);
    assert_true(max_diff > 0);
    assert_true(max_diff < 0.03 * max_abs);
    for (int i = 0; i < cold.n_tokens; i++) assert_int_equal(cold.tokens[i], ref.tokens[i]);
    engine_result_free(&ref);
    engine_free(f);
    engine_result_free(&stored);
    engine_result_free(&warm);
    engine_result_free(&cold);
    test_assert_no_block_leaks(e);
    engine_free(e);
}

static void test_warm_equals_cold_bf16(void **state) {
    (void)state;
    model *m = bf16_model_or_skip();
    check_warm_equals_cold(m, ATTENTION_BF16);
    check_warm_equals_cold(m, ATTENTION_INT8);
    model_free(m);
}

/* A prompt prefilled in one batch of 200 rows, longer than a unit of the
 * bf16 kernel (128 rows of a GQA pair here), runs on tiles built once per
 * layer (forward.c prepare_bf16_tiles); in 32-row chunks each unit builds
 * its own. The logits are bit-identical, then and on every decode step. */
static void test_prebuilt_tiles_same_bits(void **state) {
    (void)state;
    model *m = bf16_model_or_skip();
    int32_t p[200];
    test_random_tokens(&rng_state, p, 200, model_get_hparams(m)->n_vocab);
    const attention_precision precs[] = {ATTENTION_BF16, ATTENTION_INT8};
    for (int i = 0; i < 2; i++) {
        engine_config cfg = base_config(NULL);
        cfg.attention = precs[i];
        cfg.prefill_step = 256;
        engine *whole = test_open_engine(m, &cfg);
        engine *chunked = open_engine(m, precs[i], APC_FORCE_NONE, NULL);
        engine_result a, b;
        test_generate(whole, p, 200, 6, ENGINE_CACHE_BYPASS, &a);
        test_generate(chunked, p, 200, 6, ENGINE_CACHE_BYPASS, &b);
        char what[96];
        snprintf(what, sizeof what, "%s attention, one 200-row batch on prebuilt tiles against 32-row chunks",
                 attention_precision_name(precs[i]));
        assert_warm_equals_cold(&b, &a, what);
        engine_result_free(&a);
        engine_result_free(&b);
        engine_free(whole);
        engine_free(chunked);
    }
    model_free(m);
}

/* An engine at prec on a root holding bf16 files: one log line names them,
 * the prompt p finds none of its tokens there. ns gets its namespace. */
static void open_adopting_none(model *m, attention_precision prec, const char *root, const int32_t *p, int n,
                               char ns[33]) {
    char *log;
    engine *e = open_logged(m, prec, root, &log);
    if (strstr(log, "written under attention precision bf16") == NULL) fail_msg("no precision line in: %s", log);
    free(log);
    snprintf(ns, 33, "%s", test_cache_stats(e).disk_namespace);
    engine_result warm;
    test_generate(e, p, n, 2, ENGINE_CACHE_LOOKUP, &warm);
    assert_int_equal(warm.cached_tokens, 0);
    assert_int_equal(test_cache_stats(e).disk_hits, 0);
    engine_result_free(&warm);
    engine_free(e);
}

static void test_disk_keeps_precisions_apart(void **state) {
    (void)state;
    model *m = bf16_model_or_skip();
    int V = model_get_hparams(m)->n_vocab;
    char *root = make_temp_dir();
    int32_t p[96];
    test_random_tokens(&rng_state, p, 96, V);
    char *log;
    engine_result r, warm, cold;

    /* the f32 namespace is the one an engine that never asked gets */
    engine_config plain = base_config(root);
    engine *e = test_open_engine(m, &plain);
    char ns_plain[33];
    snprintf(ns_plain, sizeof ns_plain, "%s", test_cache_stats(e).disk_namespace);
    engine_free(e);

    /* bf16: stores the prompt on disk, in a namespace of its own */
    e = open_logged(m, ATTENTION_BF16, root, &log);
    free(log);
    test_generate(e, p, 96, 2, ENGINE_CACHE_ON, &r);
    engine_result_free(&r);
    apc_flush(engine_cache(e));
    assert_true(test_cache_stats(e).disk_writes >= 1);
    char ns_bf16[33];
    snprintf(ns_bf16, sizeof ns_bf16, "%s", test_cache_stats(e).disk_namespace);
    assert_string_not_equal(ns_bf16, ns_plain);
    engine_free(e);

    /* f32 on the same root: adopts nothing, says why once */
    char ns[33];
    open_adopting_none(m, ATTENTION_F32, root, p, 96, ns);
    assert_string_equal(ns, ns_plain);

    /* int8: a namespace of its own too; the bf16 files are not adopted */
    open_adopting_none(m, ATTENTION_INT8, root, p, 96, ns);
    assert_string_not_equal(ns, ns_plain);
    assert_string_not_equal(ns, ns_bf16);

    /* bf16 again: its files are adopted, bit-identically */
    e = open_logged(m, ATTENTION_BF16, root, &log);
    free(log);
    test_generate(e, p, 96, 2, ENGINE_CACHE_LOOKUP, &warm);
    test_generate(e, p, 96, 2, ENGINE_CACHE_BYPASS, &cold);
    assert_int_equal(warm.cached_tokens, 95);
    assert_true(test_cache_stats(e).disk_hits >= 1);
    assert_warm_equals_cold(&cold, &warm, "bf16 attention after an f32 restart");
    engine_result_free(&warm);
    engine_result_free(&cold);
    engine_free(e);

    remove_tree(root);
    free(root);
    model_free(m);
}

static void test_setting(void **state) {
    (void)state;
    serve_config c;
    serve_config_defaults(&c);
    engine_config ec;
    serve_config_engine(&c, &ec);
    assert_int_equal(ec.attention, ATTENTION_F32);
    ember_error err;
    setenv("EMBER_ATTENTION_PRECISION", "bf16", 1);
    int rc = serve_config_apply_env(&c, &err);
    unsetenv("EMBER_ATTENTION_PRECISION");
    assert_int_equal(rc, 0);
    serve_config_engine(&c, &ec);
    assert_int_equal(ec.attention, ATTENTION_BF16);
    bool neg;
    const serve_setting *row = serve_setting_by_flag("attention-precision", &neg);
    assert_non_null(row);
    assert_int_equal(serve_settings_apply_flag(&c, row, "f32", false, &err), 0);
    serve_config_engine(&c, &ec);
    assert_int_equal(ec.attention, ATTENTION_F32);
    assert_int_equal(serve_settings_apply_flag(&c, row, "fp8", false, &err), -1);
    if (strstr(err.msg, "attention") == NULL || strstr(err.msg, "fp8") == NULL) fail_msg("message: %s", err.msg);
    const char *yaml = "server:\n  attention_precision: bf16\n";
    assert_int_equal(serve_config_load_string(&c, yaml, strlen(yaml), "t.yaml", &err), 0);
    serve_config_engine(&c, &ec);
    assert_int_equal(ec.attention, ATTENTION_BF16);
    assert_int_equal(serve_settings_apply_flag(&c, row, "int8", false, &err), 0);
    serve_config_engine(&c, &ec);
    assert_int_equal(ec.attention, ATTENTION_INT8);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fallback_says_why),
        cmocka_unit_test(test_warm_equals_cold_bf16),
        cmocka_unit_test(test_prebuilt_tiles_same_bits),
        cmocka_unit_test(test_disk_keeps_precisions_apart),
        cmocka_unit_test(test_setting),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
