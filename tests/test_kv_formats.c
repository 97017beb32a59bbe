/* test_kv_formats.c - the KV formats (f16, q8_0) through the whole cache.
 *
 * The invariant does not weaken with a quantized pool: for every format and
 * every tier (block and exact on stories260K; on the sliding-window gemma3
 * and the gated-delta-net qwen35 references both their default block tier
 * with state snapshots and the checkpoint tier) a warm request's logits are
 * bit-identical to a cold run's. Each check also asserts that the
 * warm run adopted something, so a cache that silently stores nothing fails.
 * Then: a quantized pool really changes the logits (a little), the pool
 * holds the bytes per token the format promises, q8_0 stays close to f32
 * KV on real text (stories260K, whose large attention logits made 8-bit K
 * lose 3.4 points of top-1 agreement) and refuses heads it cannot rotate,
 * and a server restarted
 * with another format adopts nothing from the SSD tier, logs why once, and
 * finds its own files again when restarted with its own format, also as
 * the reference's bitrate-b scenario through `ember serve`; and the setting
 * (cache.kv_format: default f16, environment, flag, file). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "core/log.h"
#include "engine/engine.h"
#include "kv/kv_pool.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"
#include "serve/serve_config.h"
#include "serve/serve_settings.h"
#include "http_client.h"
#include "test_util.h"

#define STORIES "models/stories260K.gguf"
#define GEMMA3 "reference/gemma3-f32.gguf"
#define QWEN35 "reference/qwen35-f32.gguf"

static const kv_format F16 = {KV_FORMAT_F16}, Q8_0 = {KV_FORMAT_Q8_0}, F32 = {KV_FORMAT_F32};

static uint64_t rng_state = 0x2545f4914f6cdd1dull;

static engine *open_engine(const model *m, kv_format fmt, apc_force force, const char *disk_root) {
    engine_config cfg = engine_default_config();
    cfg.n_threads = 2;
    cfg.prefill_step = 32;
    cfg.n_ctx = 1024;
    cfg.kv_format = fmt;
    cfg.cache.force_tier = force;
    cfg.cache.ckpt.interval = 64;
    cfg.cache.ckpt.replay_min = 48;
    cfg.cache.ckpt.sys_min = 32;
    cfg.cache.ckpt.decode_interval = 0;
    cfg.cache.disk.path = disk_root;
    return test_open_engine(m, &cfg);
}

/* Stores `prompt` (a request through the cache), then compares a
 * lookup-only warm run with a cold one; returns the tokens adopted. */
static int64_t store_then_probe(engine *e, const int32_t *prompt, int64_t n, const char *what) {
    engine_result r, warm, cold;
    test_generate(e, prompt, n, 4, ENGINE_CACHE_ON, &r);
    engine_result_free(&r);
    test_generate(e, prompt, n, 4, ENGINE_CACHE_LOOKUP, &warm);
    test_generate(e, prompt, n, 4, ENGINE_CACHE_BYPASS, &cold);
    assert_warm_equals_cold(&cold, &warm, what);
    assert_int_equal(warm.cached_tokens + warm.prompt_forwarded, n);
    int64_t got = warm.cached_tokens;
    engine_result_free(&warm);
    engine_result_free(&cold);
    return got;
}

/* ---- warm == cold, block and exact tiers ---- */

static void dense_tiers(kv_format fmt) {
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    const apc_force tiers[] = {APC_FORCE_BLOCK, APC_FORCE_EXACT};
    for (int t = 0; t < 2; t++) {
        engine *e = open_engine(m, fmt, tiers[t], NULL);
        char what[128];
        int32_t a[150], b[150];
        test_random_tokens(&rng_state, a, 150, V);
        memcpy(b, a, sizeof b);
        test_random_tokens(&rng_state, b + 77, 73, V); /* diverges inside a block */
        snprintf(what, sizeof what, "%s %s resend", kv_format_name(fmt), t ? "exact" : "block");
        assert_int_equal(store_then_probe(e, a, 150, what), 149);
        snprintf(what, sizeof what, "%s %s shared prefix", kv_format_name(fmt), t ? "exact" : "block");
        int64_t got = store_then_probe(e, b, 150, what);
        /* block: the 4 whole blocks of the common prefix; exact: b's own entry */
        assert_true(got >= 64);
        test_assert_no_block_leaks(e);
        engine_free(e);
    }
    model_free(m);
}

static void test_warm_equals_cold_f16(void **state) {
    (void)state;
    dense_tiers(F16);
}

static void test_warm_equals_cold_q8_0(void **state) {
    (void)state;
    dense_tiers(Q8_0);
}

/* ---- warm == cold, checkpoint tier ---- */

/* ckpt: the checkpoint tier (sliding windows not served by blocks, no
 * state snapshots in the block tier); else the default routing of these
 * stacks, the block tier with recurrent-state snapshots. */
static void hybrid_tiers(const char *rel, kv_format fmt, bool ckpt) {
    REQUIRE_FIXTURE(path, rel);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    engine_config cfg = engine_default_config();
    cfg.n_threads = 2;
    cfg.prefill_step = 32;
    cfg.n_ctx = 1024;
    cfg.kv_format = fmt;
    cfg.cache.ckpt.interval = 64;
    cfg.cache.ckpt.replay_min = 48;
    cfg.cache.ckpt.sys_min = 32;
    cfg.cache.ckpt.decode_interval = 0;
    if (ckpt) {
        cfg.cache.swa_block = false;
        cfg.cache.ckpt.snapshot_interval = 0;
    }
    engine *e = test_open_engine(m, &cfg);
    assert_int_equal(apc_get_tier(engine_cache(e)), ckpt ? APC_TIER_CKPT : APC_TIER_BLOCK);
    int32_t p[200];
    test_random_tokens(&rng_state, p, 200, V);
    char what[128];
    snprintf(what, sizeof what, "%s %s %s", kv_format_name(fmt), ckpt ? "ckpt" : "block", rel);
    int64_t got = store_then_probe(e, p, 200, what);
    if (got < 64) fail_msg("%s: adopted only %lld tokens", what, (long long)got);
    if (ckpt) assert_true(test_cache_stats(e).ckpt_hits >= 1);
    engine_free(e);
    model_free(m);
}

static void test_ckpt_tier_formats(void **state) {
    (void)state;
    for (int ckpt = 0; ckpt < 2; ckpt++) {
        hybrid_tiers(GEMMA3, F16, ckpt);
        hybrid_tiers(GEMMA3, Q8_0, ckpt);
        hybrid_tiers(QWEN35, F16, ckpt);
        hybrid_tiers(QWEN35, Q8_0, ckpt);
    }
}

/* ---- the format is in effect ---- */

static void test_format_changes_logits_a_little(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    int32_t p[100];
    test_random_tokens(&rng_state, p, 100, V);
    engine_result ref;
    engine *e = open_engine(m, F32, APC_FORCE_NONE, NULL);
    test_generate(e, p, 100, 8, ENGINE_CACHE_BYPASS, &ref);
    kv_pool_config kc;
    model_kv_config(m, 1, &kc);
    size_t f32_bytes = kv_format_token_bytes(&kc);
    engine_free(e);
    const kv_format fmts[] = {F16, Q8_0};
    const double bound[] = {0.05, 0.5};
    for (int f = 0; f < 2; f++) {
        e = open_engine(m, fmts[f], APC_FORCE_NONE, NULL);
        engine_result r;
        test_generate(e, p, 100, 8, ENGINE_CACHE_BYPASS, &r);
        /* the first step's logits: same prompt, the K/V rows differ */
        double max_diff = 0;
        for (int i = 0; i < V; i++) {
            double d = r.logits[i] - ref.logits[i];
            if (d < 0) d = -d;
            if (d > max_diff) max_diff = d;
        }
        print_message("%s: first-step logits max |diff| vs f32 KV %.3g\n", kv_format_name(fmts[f]), max_diff);
        assert_true(max_diff > 0);
        assert_true(max_diff < bound[f]);
        /* bytes per token: stories260K rows are 32 values (5 layers); q8_0
         * keeps K in q12h (50 bytes, padded to 52) and V in Q8_0 (34 -> 36) */
        kc.format = fmts[f];
        size_t want = fmts[f].kind == KV_FORMAT_F16 ? f32_bytes / 2 : 5 * (52 + 36);
        assert_int_equal(kv_format_token_bytes(&kc), want);
        assert_int_equal(kv_pool_block_bytes(engine_pool(e)), KV_BLOCK_TOKENS * want);
        engine_result_free(&r);
        engine_free(e);
    }
    engine_result_free(&ref);
    model_free(m);
}

/* q8_0 (K in q12h, V in Q8_0) against f32 KV on the first 1,024 tokens of
 * bench/data/kv_text.txt through stories260K, every position scored: mean
 * KL(p_f32 || p_q8_0) of the next-token distributions and top-1 agreement.
 * K in ggml's Q8_0, as q8_0 pools stored it before, measured KL 0.0045 and
 * 96.6% on the whole text (docs/kv-formats.md); q12h keys measure 3.5e-5
 * and 99.6% there. */
static void test_q8_0_close_to_f32_on_text(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    const char *src = getenv("EMBER_SOURCE_DIR");
    if (src == NULL) {
        print_message("skipping: EMBER_SOURCE_DIR is not set (run under ctest)\n");
        skip();
    }
    char text_path[1024];
    snprintf(text_path, sizeof text_path, "%s/bench/data/kv_text.txt", src);
    FILE *f = fopen(text_path, "rb");
    assert_non_null(f);
    char *text = malloc(1 << 16);
    size_t len = fread(text, 1, (1 << 16) - 1, f);
    fclose(f);
    model *m = test_load_model(path);
    ember_error err;
    int32_t *ids = NULL;
    size_t n_ids = 0;
    assert_int_equal(tokenizer_encode(model_get_tokenizer(m), text, len, true, false, &ids, &n_ids, &err), 0);
    free(text);
    enum { N = 1024, CHUNK = 128 };
    assert_true(n_ids >= N);
    int V = model_get_hparams(m)->n_vocab;
    const kv_format fmts[2] = {F32, Q8_0};
    float *logits[2];
    for (int k = 0; k < 2; k++) {
        kv_pool_config kc;
        model_kv_config(m, N / KV_BLOCK_TOKENS + 1, &kc);
        kc.format = fmts[k];
        kv_pool *pool = kv_pool_create(&kc, &err);
        assert_non_null(pool);
        model_ctx *ctx = model_ctx_create(m, pool, 2, CHUNK, &err);
        assert_non_null(ctx);
        kv_seq seq;
        kv_seq_init(&seq);
        logits[k] = malloc((size_t)N * V * sizeof(float));
        for (int c = 0; c < N; c += CHUNK)
            assert_int_equal(model_eval(ctx, &seq, ids + c, CHUNK, true, logits[k] + (size_t)c * V, &err), 0);
        kv_seq_release(pool, &seq);
        model_ctx_free(ctx);
        kv_pool_free(pool);
    }
    double kl = 0;
    int same_top = 0;
    for (int i = 0; i < N; i++) {
        const float *a = logits[0] + (size_t)i * V, *b = logits[1] + (size_t)i * V;
        double ma = -INFINITY, mb = -INFINITY, sa = 0, sb = 0;
        int ta = 0, tb = 0;
        for (int v = 0; v < V; v++) {
            if (a[v] > ma) ma = a[v], ta = v;
            if (b[v] > mb) mb = b[v], tb = v;
        }
        for (int v = 0; v < V; v++) sa += exp(a[v] - ma), sb += exp(b[v] - mb);
        for (int v = 0; v < V; v++) {
            double la = a[v] - ma - log(sa), lb = b[v] - mb - log(sb);
            kl += exp(la) * (la - lb);
        }
        same_top += ta == tb;
    }
    kl /= N;
    print_message("q8_0 vs f32 KV on %d tokens of text: mean KL %.3g, top-1 %.2f%%\n", N, kl, 100.0 * same_top / N);
    assert_true(kl > 0);
    assert_true(kl < 2e-4);
    assert_true(same_top >= N * 99 / 100);
    free(logits[0]);
    free(logits[1]);
    free(ids);
    model_free(m);
}

/* q8_0 rotates K in 8-value slices and the query per head, so it needs
 * heads of a multiple of 8; rows of 32 in heads of 4 are refused by name,
 * heads of 8 (stories260K's) and whole-row heads are taken. */
static void test_q8_0_head_sizes(void **state) {
    (void)state;
    const int widths[1] = {32};
    kv_pool_config kc = {1, widths, widths, 2, Q8_0, 4, 4};
    ember_error err;
    assert_null(kv_pool_create(&kc, &err));
    assert_non_null(strstr(err.msg, "heads of 4 values; q8_0 needs heads of a multiple of 8"));
    const int heads[2] = {8, 0};
    for (int i = 0; i < 2; i++) {
        kc.k_head = kc.v_head = heads[i];
        kv_pool *p = kv_pool_create(&kc, &err);
        assert_non_null(p);
        assert_int_equal(kv_pool_row_bytes(p, 0, 0), 52); /* K: one q12h block, padded */
        assert_int_equal(kv_pool_row_bytes(p, 0, 1), 36); /* V: one Q8_0 block, padded */
        kv_pool_free(p);
    }
}

/* ---- restart across formats ---- */

/* Runs open_engine with stderr captured at INFO level; *log gets the text. */
static engine *open_logged(const model *m, kv_format fmt, const char *root, char **log) {
    test_log_capture cap;
    test_log_capture_begin(&cap);
    engine *e = open_engine(m, fmt, APC_FORCE_NONE, root);
    *log = test_log_capture_end(&cap);
    return e;
}

/* Namespaces an older ember wrote stay foreign, and the start-up can still
 * name them: a format's id under each earlier layout differs from today's,
 * and q8_0's layout 1 (8-bit keys) is the plain kind number the previous
 * release hashed into its disk namespaces. */
static void test_format_ids_of_earlier_layouts(void **state) {
    (void)state;
    kv_format q8 = {KV_FORMAT_Q8_0, 0, 0, 0};
    assert_int_equal(kv_format_layout(q8), 2);
    assert_int_equal(kv_format_id_of_layout(q8, 1), (uint64_t)KV_FORMAT_Q8_0);
    assert_int_equal(kv_format_id_of_layout(q8, kv_format_layout(q8)), kv_format_id(q8));
    assert_true(kv_format_id_of_layout(q8, 1) != kv_format_id(q8));
    kv_format kvarn = {KV_FORMAT_KVARN, 6, 5, 1024};
    for (int layout = 1; layout < kv_format_layout(kvarn); layout++)
        assert_true(kv_format_id_of_layout(kvarn, layout) != kv_format_id(kvarn));
    assert_int_equal(kv_format_id_of_layout(kvarn, kv_format_layout(kvarn)), kv_format_id(kvarn));
    kv_format f16 = {KV_FORMAT_F16, 0, 0, 0}, f32 = {KV_FORMAT_F32, 0, 0, 0};
    assert_int_equal(kv_format_layout(f16), 1);
    assert_int_equal(kv_format_id(f32), 0); /* namespaces from before formats existed */
}

static void test_restart_across_formats(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    char *root = make_temp_dir();
    int32_t p[96];
    test_random_tokens(&rng_state, p, 96, V);
    char *log;

    /* f16 server: stores the prompt on disk. */
    engine *e = open_logged(m, F16, root, &log);
    assert_non_null(strstr(log, "kv_format=f16"));
    free(log);
    engine_result r;
    test_generate(e, p, 96, 2, ENGINE_CACHE_ON, &r);
    engine_result_free(&r);
    apc_flush(engine_cache(e));
    assert_true(test_cache_stats(e).disk_writes >= 1);
    char ns_f16[33];
    snprintf(ns_f16, sizeof ns_f16, "%s", test_cache_stats(e).disk_namespace);
    engine_free(e);

    /* q8_0 on the same root: its own namespace, nothing adopted, one line. */
    e = open_logged(m, Q8_0, root, &log);
    const char *line = strstr(log, "written with kv_format=f16; this server stores kv_format=q8_0");
    if (line == NULL) fail_msg("no format line in: %s", log);
    assert_null(strstr(line + 1, "written with kv_format=f16"));
    free(log);
    assert_string_not_equal(test_cache_stats(e).disk_namespace, ns_f16);
    engine_result warm, cold;
    test_generate(e, p, 96, 2, ENGINE_CACHE_ON, &warm);
    assert_int_equal(warm.cached_tokens, 0);
    apc_stats s = test_cache_stats(e);
    assert_int_equal(s.disk_hits, 0);
    engine_result_free(&warm);
    apc_flush(engine_cache(e));
    engine_free(e);

    /* f16 again: its files are there, adopted bit-identically. */
    e = open_logged(m, F16, root, &log);
    assert_non_null(strstr(log, "written with kv_format=q8_0; this server stores kv_format=f16"));
    free(log);
    test_generate(e, p, 96, 2, ENGINE_CACHE_LOOKUP, &warm);
    test_generate(e, p, 96, 2, ENGINE_CACHE_BYPASS, &cold);
    assert_warm_equals_cold(&cold, &warm, "f16 after a q8_0 restart");
    assert_int_equal(warm.cached_tokens, 95);
    assert_true(test_cache_stats(e).disk_hits >= 1);
    engine_result_free(&warm);
    engine_result_free(&cold);
    engine_free(e);

    /* f32 (the namespace of servers before formats existed) sees neither. */
    e = open_logged(m, F32, root, &log);
    assert_non_null(strstr(log, "written with kv_format=f16"));
    assert_non_null(strstr(log, "written with kv_format=q8_0"));
    free(log);
    test_generate(e, p, 96, 2, ENGINE_CACHE_LOOKUP, &warm);
    assert_int_equal(warm.cached_tokens, 0);
    assert_int_equal(test_cache_stats(e).disk_hits, 0);
    engine_result_free(&warm);
    engine_free(e);

    remove_tree(root);
    free(root);
    model_free(m);
}

/* ---- the bitrate-b scenario, through the server ---- */


/* The reference's bitrate-b phase (section 16) with ember's formats: a
 * server at f16 warms a disk root, a second server at q8_0 on the same root
 * has 0 disk hits and adopts < 64 tokens on its first request, stores, and
 * adopts > 50% of the prefix on a warm replay with the same answer; a third
 * at f16 again finds the first one's files. */
static void test_bitrate_b_scenario(void **state) {
    (void)state;
    if (ember_binary() == NULL) {
        print_message("skipping: EMBER_BIN is not set (run under ctest)\n");
        skip();
    }
    REQUIRE_FIXTURE(model_path, STORIES);
    char *root = make_temp_dir();
    char prompt[4096] = "";
    for (int i = 0; i < 12; i++) {
        char s[256];
        snprintf(s, sizeof s, "On day %d the little dog ran to the river, found a red ball and brought it home. ", i + 1);
        strcat(prompt, s);
    }
    char log[600];
    pid_t pid = 0;
    char *fmt_f16[] = {"--kv-format", "f16", "--disk-path", root, NULL};
    char *fmt_q8[] = {"--kv-format", "q8_0", "--disk-path", root, NULL};

    snprintf(log, sizeof log, "%s/a.log", root);
    int port = http_spawn_ember(ember_binary(), model_path, fmt_f16, log, &pid);
    assert_true(port > 0);
    test_completion a = test_complete(port, prompt);
    assert_true(a.prompt_tokens > 128);
    assert_int_equal(http_stop_server(&pid, 10000), 0);

    snprintf(log, sizeof log, "%s/b.log", root);
    port = http_spawn_ember(ember_binary(), model_path, fmt_q8, log, &pid);
    assert_true(port > 0);
    test_completion b1 = test_complete(port, prompt);
    assert_true(b1.cached < 64);
    assert_int_equal((int)test_cache_stat(port, "disk_hits"), 0);
    assert_true(test_cache_stat(port, "stores") > 0);
    test_completion b2 = test_complete(port, prompt);
    if (b2.cached * 2 <= b2.prompt_tokens) fail_msg("warm replay adopted %d of %d", b2.cached, b2.prompt_tokens);
    assert_string_equal(b2.text, b1.text);
    assert_int_equal(http_stop_server(&pid, 10000), 0);
    char *text = read_whole_file(log, NULL);
    assert_non_null(text);
    const char *line = strstr(text, "written with kv_format=f16; this server stores kv_format=q8_0");
    if (line == NULL) fail_msg("no format line in the q8_0 server's log:\n%s", text);
    assert_null(strstr(line + 1, "written with kv_format=f16"));
    free(text);

    snprintf(log, sizeof log, "%s/c.log", root);
    port = http_spawn_ember(ember_binary(), model_path, fmt_f16, log, &pid);
    assert_true(port > 0);
    test_completion c = test_complete(port, prompt);
    if (c.cached * 2 <= c.prompt_tokens) fail_msg("f16 restart adopted %d of %d", c.cached, c.prompt_tokens);
    assert_true(test_cache_stat(port, "disk_hits") > 0);
    assert_string_equal(c.text, a.text);
    assert_int_equal(http_stop_server(&pid, 10000), 0);
    print_message("bitrate-b: %d prompt tokens; q8_0 after f16: cached %d, replay %d; f16 again: cached %d\n",
                  a.prompt_tokens, b1.cached, b2.cached, c.cached);

    free(a.text);
    free(b1.text);
    free(b2.text);
    free(c.text);
    remove_tree(root);
    free(root);
}

/* ---- the setting ---- */

static void test_setting(void **state) {
    (void)state;
    serve_config c;
    serve_config_defaults(&c);
    engine_config ec;
    serve_config_engine(&c, &ec);
    assert_int_equal(ec.kv_format.kind, KV_FORMAT_F16); /* the serving default (docs/kv-formats.md) */
    ember_error err;
    setenv("EMBER_KV_FORMAT", "q8_0", 1);
    int rc = serve_config_apply_env(&c, &err);
    unsetenv("EMBER_KV_FORMAT");
    assert_int_equal(rc, 0);
    serve_config_engine(&c, &ec);
    assert_int_equal(ec.kv_format.kind, KV_FORMAT_Q8_0);
    bool neg;
    const serve_setting *row = serve_setting_by_flag("kv-format", &neg);
    assert_non_null(row);
    assert_int_equal(serve_settings_apply_flag(&c, row, "f32", false, &err), 0);
    serve_config_engine(&c, &ec);
    assert_int_equal(ec.kv_format.kind, KV_FORMAT_F32);
    assert_int_equal(serve_settings_apply_flag(&c, row, "q4_0", false, &err), 0);
    assert_int_equal(serve_config_validate(&c, &err), -1);
    if (strstr(err.msg, "cache.kv_format: expected f32|f16|q8_0|kvarn") == NULL || strstr(err.msg, "got 'q4_0'") == NULL)
        fail_msg("message: %s", err.msg);
    assert_int_equal(serve_settings_apply_flag(&c, row, "f32", false, &err), 0);
    const char *yaml = "cache:\n  kv_format: f16\n";
    assert_int_equal(serve_config_load_string(&c, yaml, strlen(yaml), "t.yaml", &err), 0);
    serve_config_engine(&c, &ec);
    assert_int_equal(ec.kv_format.kind, KV_FORMAT_F16);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_warm_equals_cold_f16),
        cmocka_unit_test(test_warm_equals_cold_q8_0),
        cmocka_unit_test(test_ckpt_tier_formats),
        cmocka_unit_test(test_format_changes_logits_a_little),
        cmocka_unit_test(test_q8_0_close_to_f32_on_text),
        cmocka_unit_test(test_q8_0_head_sizes),
        cmocka_unit_test(test_format_ids_of_earlier_layouts),
        cmocka_unit_test(test_restart_across_formats),
        cmocka_unit_test(test_setting),
        cmocka_unit_test(test_bitrate_b_scenario),
    };
    return test_run_group(tests, NULL, NULL);
}
