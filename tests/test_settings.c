/* test_settings.c - the settings table and the command line around it:
 * every default parses and agrees with the library's compiled-in defaults;
 * the cache reads no environment (a real model routes the same with
 * EMBER_APC_FORCE_TIER set until the caller applies it); precedence
 * defaults < file < environment < flags for keys of five types, in process
 * and through `ember settings`; a bad value names the setting and its
 * source in each layer; every subcommand's --help exits 0 and lists its
 * flags, and an unknown flag exits 2; --version; docs/cache-switches.md is
 * what the table generates; `cmake --install` into a temporary prefix
 * installs a binary that runs and a man page that renders cleanly. */
#define _GNU_SOURCE
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine/engine.h"
#include "serve/serve_config.h"
#include "serve/serve_settings.h"
#include "test_util.h"

static const char *bin_or_skip(void) {
    const char *bin = ember_binary();
    if (bin == NULL) print_message("skipping: EMBER_BIN is not set (run under ctest)\n");
    return bin;
}

static const serve_setting *row(const char *key) {
    const serve_setting *s = serve_setting_by_key(key);
    if (s == NULL) fail_msg("no setting %s", key);
    return s;
}

static setting_source source_of(const serve_config *c, const char *key) {
    return (setting_source)c->source[serve_setting_index(row(key))];
}

/* Every row is complete, unique in key, variable and flag, and its default
 * parses; the defaults the table documents are the ones the engine and the
 * cache have compiled in. */
static void test_table_defaults_agree_with_library(void **state) {
    (void)state;
    size_t n;
    const serve_setting *t = serve_settings(&n);
    assert_true(n > 30 && n <= SERVE_SETTINGS_MAX);
    for (size_t i = 0; i < n; i++) {
        assert_non_null(t[i].key);
        assert_non_null(t[i].env);
        assert_non_null(t[i].flag);
        assert_true(t[i].help && strlen(t[i].help) > 8);
        for (size_t j = 0; j < i; j++) {
            if (!strcmp(t[i].key, t[j].key) || !strcmp(t[i].env, t[j].env) || !strcmp(t[i].flag, t[j].flag))
                fail_msg("rows %s and %s share a name", t[j].key, t[i].key);
        }
        serve_config c;
        serve_config_defaults(&c);
        char why[300];
        if (serve_setting_set(&c, &t[i], t[i].def, SETTING_FROM_DEFAULT, why, sizeof why) < 0)
            fail_msg("%s: default '%s': %s", t[i].key, t[i].def, why);
    }
    serve_config c;
    serve_config_defaults(&c);
    engine_config from_table, lib = engine_default_config();
    serve_config_engine(&c, &from_table);
    const apc_config *a = &from_table.cache, *b = &lib.cache;
    assert_int_equal(from_table.n_threads, lib.n_threads);
    assert_int_equal(from_table.prefill_step, lib.prefill_step);
    assert_int_equal(from_table.num_blocks, lib.num_blocks);
    assert_int_equal(a->enabled, b->enabled);
    assert_int_equal(a->hash, b->hash);
    assert_int_equal(a->exact_entries, b->exact_entries);
    assert_int_equal(a->force_tier, b->force_tier);
    assert_int_equal(a->ckpt.interval, b->ckpt.interval);
    assert_int_equal(a->ckpt.replay, b->ckpt.replay);
    assert_int_equal(a->ckpt.replay_min, b->ckpt.replay_min);
    assert_int_equal(a->ckpt.turn, b->ckpt.turn);
    assert_int_equal(a->ckpt.sys, b->ckpt.sys);
    assert_int_equal(a->ckpt.sys_min, b->ckpt.sys_min);
    assert_int_equal(a->ckpt.tripwire, b->ckpt.tripwire);
    assert_int_equal(a->ckpt.records, b->ckpt.records);
    assert_int_equal(a->ckpt.heavy, b->ckpt.heavy);
    assert_int_equal(a->ckpt.budget_bytes, b->ckpt.budget_bytes);
    assert_int_equal(a->ckpt.decode_interval, b->ckpt.decode_interval);
    assert_int_equal(a->ckpt.anchor_entries, b->ckpt.anchor_entries);
    assert_int_equal(a->ckpt.anchor_budget_bytes, b->ckpt.anchor_budget_bytes);
    assert_int_equal(a->exact_max_bytes, b->exact_max_bytes);
    assert_int_equal(a->swa_block, b->swa_block);
    assert_int_equal(a->ckpt.snapshot_interval, b->ckpt.snapshot_interval);
    assert_int_equal(a->ckpt.snapshot_budget_bytes, b->ckpt.snapshot_budget_bytes);
    assert_null(a->disk.path);
    assert_null(a->remote.url);
    assert_int_equal(a->remote.ttl_s, b->remote.ttl_s);
    assert_int_equal(a->remote.queue_bytes, b->remote.queue_bytes);
    assert_true(a->remote.deadline_fraction == b->remote.deadline_fraction);
    assert_int_equal(a->remote.min_wait_ms, b->remote.min_wait_ms);
    assert_int_equal(a->remote.max_wait_ms, b->remote.max_wait_ms);
    assert_int_equal(a->remote.prefill_tps, b->remote.prefill_tps);
    assert_int_equal(a->remote.timeout_ms, b->remote.timeout_ms);
    assert_int_equal(a->remote.breaker_failures, b->remote.breaker_failures);
    assert_int_equal(a->remote.probe_ms, b->remote.probe_ms);
    for (size_t i = 0; i < n; i++) assert_int_equal(c.source[i], SETTING_FROM_DEFAULT);
}

/* The cache's defaults ignore the environment; a real model keeps its
 * routed tier with EMBER_APC_FORCE_TIER set until the caller applies the
 * environment through the table. */
static void test_cache_reads_no_environment(void **state) {
    (void)state;
    setenv("EMBER_APC_CKPT_INTERVAL", "64", 1);
    setenv("EMBER_APC_FORCE_TIER", "exact", 1);
    apc_config plain = apc_default_config();
    assert_int_equal(plain.ckpt.interval, 4096);
    assert_int_equal(plain.force_tier, APC_FORCE_NONE);
    ember_error err;
    assert_int_equal(serve_settings_apply_env_cache(&plain, &err), 0);
    assert_int_equal(plain.ckpt.interval, 64);
    assert_int_equal(plain.force_tier, APC_FORCE_EXACT);

    const char *dir = build_dir();
    char path[1024];
    snprintf(path, sizeof path, "%s/models/default.gguf", dir ? dir : ".");
    model *m = dir ? model_load(path, &err) : NULL;
    if (m == NULL) {
        unsetenv("EMBER_APC_CKPT_INTERVAL");
        unsetenv("EMBER_APC_FORCE_TIER");
        fail_msg("the built-in default model %s does not load", path);
    }
    engine_config cfg = engine_default_config();
    cfg.n_ctx = 256;
    engine *e = engine_create(m, &cfg, &err);
    assert_non_null(e);
    assert_int_equal(apc_get_tier(engine_cache(e)), APC_TIER_BLOCK); /* dense qwen3: block, env not read */
    engine_free(e);
    assert_int_equal(serve_settings_apply_env_cache(&cfg.cache, &err), 0);
    e = engine_create(m, &cfg, &err);
    assert_non_null(e);
    assert_int_equal(apc_get_tier(engine_cache(e)), APC_TIER_EXACT);
    engine_free(e);
    model_free(m);
    unsetenv("EMBER_APC_CKPT_INTERVAL");
    unsetenv("EMBER_APC_FORCE_TIER");
}

/* Each layer overrides only what it names: an int, a string, a boolean, an
 * enum and a MiB size, walked through defaults, file, environment, flags. */
static void test_precedence_in_process(void **state) {
    (void)state;
    serve_config c;
    serve_config_defaults(&c);
    ember_error err;
    const char *yaml = "server:\n  port: 9000\n  model_id: from-file\ncache:\n  hash: xxh3\n"
                       "  disk:\n    path: /from/file\n  ckpt:\n    replay: false\n    budget_mb: 100\n";
    assert_int_equal(serve_config_load_string(&c, yaml, strlen(yaml), "test.yaml", &err), 0);
    assert_int_equal(c.port, 9000);
    assert_string_equal(c.disk_path, "/from/file");
    assert_false(c.cache.ckpt.replay);
    assert_int_equal(c.cache.hash, APC_HASH_XXH3);
    assert_int_equal(c.cache.ckpt.budget_bytes, (size_t)100 << 20);
    assert_int_equal(source_of(&c, "server.port"), SETTING_FROM_FILE);
    assert_int_equal(source_of(&c, "server.threads"), SETTING_FROM_DEFAULT);

    setenv("EMBER_PORT", "9001", 1);
    setenv("APC_DISK_PATH", "/from/env", 1);
    setenv("EMBER_APC_CKPT_REPLAY", "on", 1);
    int rc = serve_config_apply_env(&c, &err);
    unsetenv("EMBER_PORT");
    unsetenv("APC_DISK_PATH");
    unsetenv("EMBER_APC_CKPT_REPLAY");
    assert_int_equal(rc, 0);
    assert_int_equal(c.port, 9001);
    assert_string_equal(c.disk_path, "/from/env");
    assert_true(c.cache.ckpt.replay);
    assert_int_equal(c.cache.hash, APC_HASH_XXH3);            /* file, untouched */
    assert_string_equal(c.model_id, "from-file");
    assert_int_equal(source_of(&c, "server.port"), SETTING_FROM_ENV);
    assert_int_equal(source_of(&c, "cache.hash"), SETTING_FROM_FILE);

    bool neg;
    assert_int_equal(serve_settings_apply_flag(&c, serve_setting_by_flag("port", &neg), "9002", false, &err), 0);
    const serve_setting *replay = serve_setting_by_flag("no-ckpt-replay", &neg);
    assert_ptr_equal(replay, row("cache.ckpt.replay"));
    assert_true(neg);
    assert_int_equal(serve_settings_apply_flag(&c, replay, NULL, true, &err), 0);
    assert_int_equal(serve_settings_apply_flag(&c, serve_setting_by_flag("disk-path", &neg), "/from/flag", false, &err), 0);
    assert_int_equal(c.port, 9002);
    assert_false(c.cache.ckpt.replay);
    assert_string_equal(c.disk_path, "/from/flag");
    assert_int_equal(c.cache.ckpt.budget_bytes, (size_t)100 << 20); /* file, untouched */
    assert_int_equal(source_of(&c, "cache.ckpt.replay"), SETTING_FROM_FLAG);
    assert_int_equal(source_of(&c, "cache.ckpt.budget_mb"), SETTING_FROM_FILE);

    engine_config ec;
    serve_config_engine(&c, &ec);
    assert_false(ec.cache.ckpt.replay);
    assert_int_equal(ec.cache.hash, APC_HASH_XXH3);
    assert_string_equal(ec.cache.disk.path, "/from/flag");
    assert_int_equal(ec.cache.ckpt.budget_bytes, (size_t)100 << 20);
}

static char *write_temp(const char *dir, const char *name, const char *text) {
    char *path = malloc(1024);
    snprintf(path, 1024, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    return path;
}

/* The same through the binary: `ember settings` prints each value and its
 * source, and its output is a config file that gives the same values. */
static void test_precedence_through_binary(void **state) {
    (void)state;
    const char *bin = bin_or_skip();
    if (bin == NULL) skip();
    char *dir = make_temp_dir();
    char *yaml = write_temp(dir, "ember.yaml",
                            "server:\n  port: 9000\ncache:\n  hash: xxh3\n  disk:\n    path: /from/file\n"
                            "  ckpt:\n    replay: false\n    budget_mb: 100\n");
    char cmd[4096], *out;
    snprintf(cmd, sizeof cmd,
             "EMBER_PORT=9001 APC_DISK_PATH=/from/env EMBER_APC_CKPT_REPLAY=1 %s settings --port 9002 --config %s",
             bin, yaml);
    assert_int_equal(run_capture(cmd, &out), 0);
    static const char *want[] = {
        "  port: 9002  # flag --port\n",           "  hash: xxh3  # file\n",
        "    path: \"/from/env\"  # environment APC_DISK_PATH\n",
        "    replay: true  # environment EMBER_APC_CKPT_REPLAY\n",
        "    budget_mb: 100  # file\n",            "  threads: 0  # default\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (strstr(out, want[i]) == NULL) fail_msg("missing '%s' in:\n%s", want[i], out);
    char *saved = write_temp(dir, "saved.yaml", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s settings --config %s", bin, saved);
    assert_int_equal(run_capture(cmd, &out), 0);
    static const char *again[] = {"  port: 9002  # file\n", "    path: \"/from/env\"  # file\n",
                                  "    replay: true  # file\n", "  hash: xxh3  # file\n"};
    for (size_t i = 0; i < sizeof again / sizeof again[0]; i++)
        if (strstr(out, again[i]) == NULL) fail_msg("missing '%s' in:\n%s", again[i], out);
    free(out);
    free(saved);
    free(yaml);
    remove_tree(dir);
    free(dir);
}

/* A bad value names the setting and where it came from, in every layer. */
static void test_bad_value_names_key_and_source(void **state) {
    (void)state;
    serve_config c;
    serve_config_defaults(&c);
    ember_error err;
    const char *yaml = "cache:\n  ckpt:\n    records: 1\n";
    assert_int_equal(serve_config_load_string(&c, yaml, strlen(yaml), "bad.yaml", &err), -1);
    assert_non_null(strstr(err.msg, "bad.yaml:3: cache.ckpt.records"));
    assert_non_null(strstr(err.msg, "[2, 1048576]"));
    yaml = "cache:\n  force_tier: sideways\n";
    assert_int_equal(serve_config_load_string(&c, yaml, strlen(yaml), "bad.yaml", &err), -1);
    assert_non_null(strstr(err.msg, "bad.yaml:2: cache.force_tier"));

    setenv("EMBER_APC_CKPT_TURN", "maybe", 1);
    assert_int_equal(serve_config_apply_env(&c, &err), -1);
    assert_non_null(strstr(err.msg, "environment EMBER_APC_CKPT_TURN (cache.ckpt.turn)"));
    apc_config cache = apc_default_config();
    assert_int_equal(serve_settings_apply_env_cache(&cache, &err), -1);
    assert_non_null(strstr(err.msg, "EMBER_APC_CKPT_TURN"));
    unsetenv("EMBER_APC_CKPT_TURN");

    assert_int_equal(serve_settings_apply_flag(&c, row("server.max_running"), "lots", false, &err), -1);
    assert_non_null(strstr(err.msg, "flag --max-running (server.max_running)"));
    assert_int_equal(serve_settings_apply_flag(&c, row("cache.disk.read_mode"), "tape", false, &err), -1);
    assert_non_null(strstr(err.msg, "flag --disk-read-mode (cache.disk.read_mode): expected one of direct|mmap"));

    const char *bin = bin_or_skip();
    if (bin == NULL) return;
    char cmd[2048], *out;
    snprintf(cmd, sizeof cmd, "EMBER_APC_DECODE_CKPT=often %s serve /nonexistent.gguf 2>&1", bin);
    assert_int_equal(run_capture(cmd, &out), 1);
    assert_non_null(strstr(out, "environment EMBER_APC_DECODE_CKPT (cache.ckpt.decode_interval)"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s serve /nonexistent.gguf --ckpt-sys-min -3 2>&1", bin);
    assert_int_equal(run_capture(cmd, &out), 2);
    assert_non_null(strstr(out, "flag --ckpt-sys-min (cache.ckpt.sys_min)"));
    free(out);
}

/* Every subcommand: --help and -h exit 0 on stdout with its usage and every
 * flag, each listed flag parses (FLAG VALUE --help still exits 0), and an
 * unknown flag exits 2 naming it. */
static void test_every_command_has_help(void **state) {
    (void)state;
    const char *bin = bin_or_skip();
    if (bin == NULL) skip();
    static const struct {
        const char *name;
        const char *flags[16];
    } cmds[] = {
        {"serve", {"--config", "-c"}},
        {"run", {"-p", "--prompt", "-n", "--n-predict", "--temp", "--seed", "--threads", "--top-k", "--top-p",
                 "--min-p", "--repeat-penalty", "--ctx", "--batch"}},
        {"logits", {"--tokens", "-p", "--prompt", "--out", "-o", "--threads", "--batch"}},
        {"inspect", {NULL}},
        {"tokenize", {"-p", "--prompt", "--special", "--no-bos"}},
        {"mkmodel", {"--arch", "--preset", "--type", "--vocab", "--tokenizer-dir", "--out", "-o", "--seed", "--threads"}},
        {"settings", {"--config", "--markdown", "--out"}},
    };
    char cmd[2048], *out, *top;
    snprintf(cmd, sizeof cmd, "%s --help", bin);
    assert_int_equal(run_capture(cmd, &top), 0);
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        char want[64];
        snprintf(want, sizeof want, "  %s ", cmds[i].name);
        if (strstr(top, want) == NULL) fail_msg("ember --help does not list %s:\n%s", cmds[i].name, top);
        const char *forms[] = {"%s %s --help", "%s %s -h", "%s help %s"};
        char *first = NULL;
        for (int f = 0; f < 3; f++) {
            snprintf(cmd, sizeof cmd, forms[f], bin, cmds[i].name);
            strcat(cmd, " 2>/dev/null");
            if (run_capture(cmd, &out) != 0) fail_msg("'%s' does not exit 0", cmd);
            if (first == NULL) first = out;
            else {
                assert_string_equal(out, first);
                free(out);
            }
        }
        snprintf(want, sizeof want, "usage: ember %s", cmds[i].name);
        if (strstr(first, want) == NULL) fail_msg("%s --help has no usage line:\n%s", cmds[i].name, first);
        for (int k = 0; cmds[i].flags[k]; k++) {
            char flag[64];
            snprintf(flag, sizeof flag, "%s ", cmds[i].flags[k]);
            char flag_comma[64];
            snprintf(flag_comma, sizeof flag_comma, "%s,", cmds[i].flags[k]);
            if (strstr(first, flag) == NULL && strstr(first, flag_comma) == NULL)
                fail_msg("%s --help does not mention %s:\n%s", cmds[i].name, cmds[i].flags[k], first);
            /* a flag with a value takes the 32; a switch leaves it as an argument, or stands alone */
            snprintf(cmd, sizeof cmd, "%s %s %s 32 --help >/dev/null 2>&1", bin, cmds[i].name, cmds[i].flags[k]);
            int with_value = run_capture(cmd, &out);
            free(out);
            snprintf(cmd, sizeof cmd, "%s %s %s --help >/dev/null 2>&1", bin, cmds[i].name, cmds[i].flags[k]);
            int alone = run_capture(cmd, &out);
            free(out);
            if (with_value != 0 && alone != 0) fail_msg("%s %s is not accepted", cmds[i].name, cmds[i].flags[k]);
        }
        if (!strcmp(cmds[i].name, "serve") || !strcmp(cmds[i].name, "settings")) {
            size_t n;
            const serve_setting *t = serve_settings(&n);
            for (size_t k = 0; k < n; k++) {
                char flag[80];
                snprintf(flag, sizeof flag, t[k].type == SETTING_BOOL ? "--[no-]%s " : "--%s ", t[k].flag);
                if (strstr(first, flag) == NULL || strstr(first, t[k].env) == NULL || strstr(first, t[k].key) == NULL)
                    fail_msg("%s --help lacks %s (%s, %s)", cmds[i].name, flag, t[k].key, t[k].env);
            }
        }
        free(first);
        snprintf(cmd, sizeof cmd, "%s %s --frobnicate 2>&1", bin, cmds[i].name);
        assert_int_equal(run_capture(cmd, &out), 2);
        if (strstr(out, "unknown option '--frobnicate'") == NULL || strstr(out, "usage: ember") == NULL)
            fail_msg("%s: unclear unknown-option message:\n%s", cmds[i].name, out);
        free(out);
    }
    free(top);
    /* inspect --help no longer opens a file named --help */
    snprintf(cmd, sizeof cmd, "%s inspect --help 2>&1", bin);
    assert_int_equal(run_capture(cmd, &out), 0);
    assert_null(strstr(out, "cannot open"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s --frobnicate 2>&1", bin);
    assert_int_equal(run_capture(cmd, &out), 2);
    assert_non_null(strstr(out, "unknown option '--frobnicate'"));
    free(out);
}

/* --version prints the CMake project version (and git describe when built
 * from a repository). */
static void test_version(void **state) {
    (void)state;
    const char *bin = bin_or_skip();
    const char *src = getenv("EMBER_SOURCE_DIR");
    if (bin == NULL || src == NULL) skip();
    char path[1024];
    snprintf(path, sizeof path, "%s/CMakeLists.txt", src);
    char *lists = read_whole_file(path, NULL);
    assert_non_null(lists);
    const char *v = strstr(lists, "project(ember VERSION ");
    assert_non_null(v);
    v += strlen("project(ember VERSION ");
    char want[64] = "ember ";
    size_t len = strcspn(v, " )");
    memcpy(want + 6, v, len);
    want[6 + len] = '\0';
    char cmd[1200], *out;
    snprintf(cmd, sizeof cmd, "%s --version", bin);
    assert_int_equal(run_capture(cmd, &out), 0);
    if (strncmp(out, want, strlen(want)) != 0) fail_msg("'%s' does not start with '%s'", out, want);
    assert_true(isdigit((unsigned char)want[6]));
    free(out);
    free(lists);
}

/* docs/cache-switches.md is exactly what the table generates (run `make
 * docs` after changing the table). */
static void test_doc_is_fresh(void **state) {
    (void)state;
    const char *src = getenv("EMBER_SOURCE_DIR");
    if (src == NULL) {
        print_message("skipping: EMBER_SOURCE_DIR is not set (run under ctest)\n");
        skip();
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/docs/cache-switches.md", src);
    char *committed = read_whole_file(path, NULL);
    assert_non_null(committed);
    char *generated = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&generated, &len);
    serve_settings_write_markdown(mem);
    fclose(mem);
    if (strcmp(committed, generated) != 0) {
        size_t i = 0, line = 1;
        while (committed[i] && committed[i] == generated[i]) line += committed[i++] == '\n';
        fail_msg("%s differs from the settings table from line %zu on; run `make docs`", path, line);
    }
    const char *bin = ember_binary();
    if (bin) {
        char cmd[1200], *out;
        snprintf(cmd, sizeof cmd, "%s settings --markdown", bin);
        assert_int_equal(run_capture(cmd, &out), 0);
        assert_string_equal(out, generated);
        free(out);
    }
    /* every variable of the old switch list is still a row */
    static const char *names[] = {"EMBER_APC_FORCE_TIER", "EMBER_APC_CKPT_INTERVAL", "EMBER_APC_CKPT_REPLAY",
                                  "EMBER_APC_CKPT_REPLAY_MIN", "EMBER_APC_CKPT_TURN", "EMBER_APC_CKPT_SYS",
                                  "EMBER_APC_CKPT_SYS_MIN", "EMBER_APC_CKPT_TRIPWIRE", "EMBER_APC_CKPT_RECORDS",
                                  "EMBER_APC_CKPT_HEAVY", "EMBER_APC_CKPT_BUDGET_MB", "EMBER_APC_DECODE_CKPT",
                                  "EMBER_APC_ANCHOR_ENTRIES", "EMBER_APC_ANCHOR_BUDGET_MB", "APC_ENABLED",
                                  "APC_NUM_BLOCKS", "APC_DISK_PATH", "EMBER_PORT", "EMBER_CONNECTION_LIMIT"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char cell[64];
        snprintf(cell, sizeof cell, "`%s`", names[i]);
        if (strstr(generated, cell) == NULL) fail_msg("%s is not in the table", names[i]);
    }
    free(generated);
    free(committed);
}

/* cmake --install into a temporary prefix: bin/ember runs, and
 * share/man/man1/ember.1 renders without a troff warning and documents the
 * commands and the settings. */
static void test_install(void **state) {
    (void)state;
    const char *cmake = getenv("EMBER_CMAKE"), *build = build_dir();
    if (cmake == NULL || build == NULL) {
        print_message("skipping: EMBER_CMAKE / EMBER_BUILD_DIR not set (run under ctest)\n");
        skip();
    }
    char *prefix = make_temp_dir();
    char cmd[4096], *out;
    snprintf(cmd, sizeof cmd, "'%s' --install '%s' --prefix '%s' 2>&1", cmake, build, prefix);
    if (run_capture(cmd, &out) != 0) fail_msg("%s failed:\n%s", cmd, out);
    free(out);
    char exe[1024], man[1024];
    snprintf(exe, sizeof exe, "%s/bin/ember", prefix);
    snprintf(man, sizeof man, "%s/share/man/man1/ember.1", prefix);
    assert_int_equal(access(exe, X_OK), 0);
    struct stat st;
    assert_int_equal(stat(man, &st), 0);
    assert_true(st.st_size > 4096);
    snprintf(cmd, sizeof cmd, "'%s' --version", exe);
    assert_int_equal(run_capture(cmd, &out), 0);
    assert_true(strncmp(out, "ember ", 6) == 0);
    free(out);

    if (system("command -v groff >/dev/null 2>&1") != 0)
        fail_msg("groff is missing: install groff-base (scripts/install-deps.sh)");
    snprintf(cmd, sizeof cmd, "groff -man -Tutf8 -ww -z '%s' 2>&1", man);
    assert_int_equal(run_capture(cmd, &out), 0);
    if (out[0]) fail_msg("troff warnings in ember.1:\n%s", out);
    free(out);
    if (system("command -v man >/dev/null 2>&1") == 0)
        snprintf(cmd, sizeof cmd, "MANWIDTH=100 man -P cat -l '%s' 2>&1", man);
    else
        snprintf(cmd, sizeof cmd, "groff -man -Tutf8 '%s' 2>&1", man);
    assert_int_equal(run_capture(cmd, &out), 0);
    static const char *want[] = {"SYNOPSIS", "COMMANDS", "SETTINGS", "ENVIRONMENT", "EXIT STATUS", "ember serve",
                                 "ember mkmodel", "--no-ckpt-replay", "cache.ckpt.interval", "EMBER_APC_CKPT_INTERVAL",
                                 "--repeat-penalty"};
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (strstr(out, want[i]) == NULL) fail_msg("the rendered man page lacks '%s'", want[i]);
    free(out);
    remove_tree(prefix);
    free(prefix);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_table_defaults_agree_with_library),
        cmocka_unit_test(test_cache_reads_no_environment),
        cmocka_unit_test(test_precedence_in_process),
        cmocka_unit_test(test_precedence_through_binary),
        cmocka_unit_test(test_bad_value_names_key_and_source),
        cmocka_unit_test(test_every_command_has_help),
        cmocka_unit_test(test_version),
        cmocka_unit_test(test_doc_is_fresh),
        cmocka_unit_test(test_install),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
