/* test_capacity.c - the prompt cache's default capacity (issue 16).
 *
 *  - The KV pool's size from memory is a pure function (serve_pool_size):
 *    checked against faked amounts of available memory, weights, shares and
 *    block sizes - the share of what is left after weights and margin,
 *    whole blocks, the floor of one context, the refusals and their
 *    messages, the start-up line.
 *  - A spawned `ember serve` at defaults logs that line with a pool sized
 *    from this machine's memory; a configured pool that cannot fit stops
 *    the start-up with the message (nothing allocated, nothing listening);
 *    a share outside (0, 1] is refused.
 *  - The SSD tier is on by default under the per-user cache directory (the
 *    test program's private XDG_CACHE_HOME, test_util.c): a prompt served
 *    before a restart is served from disk after it; --no-disk turns it off.
 *  - A disk path that cannot be used stops the start-up unless
 *    cache.disk.optional; at the per-user default it is a warning. */
#define _GNU_SOURCE
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "serve/serve_config.h"
#include "serve/serve_pool_size.h"
#include "http_client.h"
#include "test_util.h"

#define GIB (1ull << 30)
#define MIB (1ull << 20)

static char g_model[512];

/* ---- the arithmetic ---- */

static serve_pool_plan plan_of(uint64_t avail, uint64_t weights, double share, uint64_t bb, int32_t configured,
                               int32_t least, char *line, size_t cap) {
    serve_pool_inputs in = {avail, weights, share, bb, configured, least};
    serve_pool_plan p;
    ember_error err;
    if (serve_pool_size(&in, &p, line, cap, &err) < 0) fail_msg("serve_pool_size refused: %s", err.msg);
    return p;
}

static void test_pool_arithmetic(void **state) {
    (void)state;
    char line[512];
    /* 24 GiB available, 1 GiB of weights, 64 KiB blocks, half */
    uint64_t bb = 64 * 1024;
    serve_pool_plan p = plan_of(24 * GIB, 1 * GIB, 0.5, bb, 0, 257, line, sizeof line);
    uint64_t margin = 24 * GIB / 10;
    assert_int_equal(p.margin, margin);
    assert_int_equal(p.usable, 24 * GIB - 1 * GIB - margin);
    assert_int_equal(p.n_blocks, (int32_t)((p.usable / bb) / 2));
    assert_int_equal(p.pool_bytes, (uint64_t)p.n_blocks * bb);
    /* the start-up line: the figures of the issue, and the computation */
    char want[256];
    snprintf(want, sizeof want, "KV pool: %" PRId32 " blocks (%" PRIu64 " tokens, %.2f GiB) = %.1f%% of available memory",
             p.n_blocks, (uint64_t)p.n_blocks * 16, (double)p.pool_bytes / GIB, 100.0 * (double)p.pool_bytes / (24.0 * GIB));
    assert_non_null(strstr(line, want));
    assert_non_null(strstr(line, "cache.memory_share 0.5 x (24.00 GiB available - 1.00 GiB model weights - 2.40 GiB "
                                 "safety margin)"));

    /* share 1 takes every whole block that fits, share 1/4 half of share 1/2 */
    serve_pool_plan all = plan_of(24 * GIB, 1 * GIB, 1.0, bb, 0, 257, NULL, 0);
    assert_true(all.pool_bytes <= all.usable && all.usable - all.pool_bytes < bb);
    serve_pool_plan quarter = plan_of(24 * GIB, 1 * GIB, 0.25, bb, 0, 257, NULL, 0);
    assert_true(quarter.n_blocks == p.n_blocks / 2 || quarter.n_blocks == p.n_blocks / 2 - 1 ||
                quarter.n_blocks == (p.n_blocks + 1) / 2);
    /* more memory never gives a smaller pool; more weights never a larger one */
    int32_t prev = 0;
    for (uint64_t avail = 4 * GIB; avail < 512 * GIB; avail = avail * 3 / 2) {
        serve_pool_plan q = plan_of(avail, 1 * GIB, 0.5, 3 * MIB + 512, 0, 2, NULL, 0);
        assert_true(q.n_blocks >= prev);
        assert_true(q.pool_bytes <= (avail - 1 * GIB - q.margin) / 2 + 1);
        prev = q.n_blocks;
        serve_pool_plan heavier = plan_of(avail, 1 * GIB + 1 * GIB, 0.5, 3 * MIB + 512, 0, 2, NULL, 0);
        assert_true(heavier.n_blocks <= q.n_blocks);
    }
    /* a small machine: the margin is at least 512 MiB */
    serve_pool_plan small = plan_of(2 * GIB, 0, 0.5, bb, 0, 2, NULL, 0);
    assert_int_equal(small.margin, SERVE_POOL_MARGIN_MIN);
    /* the floor: a share too small for one context is raised to it, and says so */
    serve_pool_plan floor_ = plan_of(2 * GIB, 0, 0.001, bb, 0, 257, line, sizeof line);
    assert_int_equal(floor_.n_blocks, 257);
    assert_non_null(strstr(line, "raised to one full context"));
    /* configured: taken as given, the line says so */
    serve_pool_plan conf = plan_of(24 * GIB, 1 * GIB, 0.5, bb, 24576, 257, line, sizeof line);
    assert_int_equal(conf.n_blocks, 24576);
    assert_non_null(strstr(line, "KV pool: 24576 blocks (393216 tokens, 1.50 GiB) = 6.2% of available memory"));
    assert_non_null(strstr(line, "(cache.num_blocks;"));
}

/* kvarn: the same memory holds more tokens, and one context needs fewer
 * blocks: a sealed k6v5 group of the qwen3-0.6b shape keeps 3 of its 8
 * blocks (43,008 bytes a token against f16's 114,688), so a 4 GiB pool of
 * 2,340 blocks holds 37,440 tokens of f16 and about 2.6 times that of
 * kvarn-k6v5 (the fp16 sink, live group and 1,024-token tail included). */
static void test_pool_tokens_kvarn(void **state) {
    (void)state;
    int w[28];
    for (int l = 0; l < 28; l++) w[l] = 8 * 128;
    kv_pool_config f16 = {28, w, w, 1, {KV_FORMAT_F16, 0, 0, 0}, 128, 128};
    kv_pool_config kvarn = f16;
    assert_int_equal(kv_format_parse("kvarn-k6v5", &kvarn.format), 0);
    uint64_t bb = kv_format_token_bytes(&f16) * KV_BLOCK_TOKENS;
    assert_int_equal(kv_format_token_bytes(&kvarn) * KV_BLOCK_TOKENS, bb); /* blocks are blocks */
    assert_int_equal(kv_format_sealed_token_bytes(&kvarn), 43008);
    char line[1024];
    serve_pool_inputs a = {64 * GIB, 0, 0.5, bb, 2340, 2, &f16}, b = a;
    b.kv = &kvarn;
    serve_pool_plan pa, pb;
    ember_error err;
    assert_int_equal(serve_pool_size(&a, &pa, line, sizeof line, &err), 0);
    assert_non_null(strstr(line, "KV pool: 2340 blocks (37440 tokens, 4.00 GiB)"));
    assert_int_equal(serve_pool_size(&b, &pb, line, sizeof line, &err), 0);
    assert_int_equal(pb.n_blocks, pa.n_blocks);
    long long tokens = 0;
    assert_non_null(strstr(line, "KV pool: 2340 blocks ("));
    assert_int_equal(sscanf(strstr(line, "("), "(%lld tokens", &tokens), 1);
    print_message("4 GiB of qwen3-0.6b-shape pool: f16 37440 tokens, kvarn-k6v5 %lld\n", tokens);
    assert_int_equal(tokens, kv_format_capacity_tokens(&kvarn, 2340));
    assert_true(tokens > 37440 * 5 / 2);
    /* one 32k context: 2,049 blocks of f16, fewer of kvarn */
    assert_int_equal(kv_format_blocks_for_tokens(&f16, 32768), 2048);
    int64_t kb = kv_format_blocks_for_tokens(&kvarn, 32768);
    assert_true(kb < 2048 * 4 / 10);
    assert_true(kv_format_capacity_tokens(&kvarn, kb) >= 32768);
}

static void test_pool_refusals(void **state) {
    (void)state;
    serve_pool_plan p;
    ember_error err;
    /* a configured pool bigger than what memory can hold */
    serve_pool_inputs big = {8 * GIB, 2 * GIB, 0.5, 64 * 1024, 100000, 257};
    assert_int_equal(serve_pool_size(&big, &p, NULL, 0, &err), -1);
    assert_non_null(strstr(err.msg, "cache.num_blocks=100000 needs 6.10 GiB"));
    assert_non_null(strstr(err.msg, "8.00 GiB available - 2.00 GiB model weights - 0.80 GiB safety margin"));
    /* the largest configured pool that fits is accepted, one more block is not */
    big.configured = (int32_t)((8 * GIB - 2 * GIB - 8 * GIB / 10) / (64 * 1024));
    assert_int_equal(serve_pool_size(&big, &p, NULL, 0, &err), 0);
    big.configured++;
    assert_int_equal(serve_pool_size(&big, &p, NULL, 0, &err), -1);
    /* more blocks than the cache's index can address */
    serve_pool_inputs many = {UINT64_MAX / 2, 0, 0.5, 128, (int32_t)(SERVE_POOL_MAX_BLOCKS + 1), 2};
    assert_int_equal(serve_pool_size(&many, &p, NULL, 0, &err), -1);
    assert_non_null(strstr(err.msg, "at most"));
    /* a default pool of tiny blocks stops where its bookkeeping would cost more than it gives */
    many.configured = 0;
    char line[512];
    assert_int_equal(serve_pool_size(&many, &p, line, sizeof line, &err), 0);
    assert_int_equal(p.n_blocks, (int32_t)SERVE_POOL_DEFAULT_MAX_BLOCKS);
    assert_non_null(strstr(line, "at most 4194304 blocks"));
    /* no overflow at the extremes */
    serve_pool_inputs huge = {UINT64_MAX, 0, 0.5, UINT64_MAX / 2, INT32_MAX, 2};
    assert_int_equal(serve_pool_size(&huge, &p, NULL, 0, &err), -1);
    /* weights larger than memory: not even one context fits */
    serve_pool_inputs starved = {4 * GIB, 5 * GIB, 0.5, 64 * 1024, 0, 257};
    assert_int_equal(serve_pool_size(&starved, &p, NULL, 0, &err), -1);
    assert_non_null(strstr(err.msg, "not enough memory for the KV pool"));
    /* shares outside (0, 1] */
    serve_pool_inputs share = {8 * GIB, 0, 0, 64 * 1024, 0, 2};
    assert_int_equal(serve_pool_size(&share, &p, NULL, 0, &err), -1);
    assert_non_null(strstr(err.msg, "cache.memory_share"));
    share.share = 1.01;
    assert_int_equal(serve_pool_size(&share, &p, NULL, 0, &err), -1);
}

/* A line of /proc/meminfo in bytes (key with its colon). */
static uint64_t meminfo(const char *key) {
    FILE *f = fopen("/proc/meminfo", "r");
    assert_non_null(f);
    char text[256];
    unsigned long long kib = 0;
    bool found = false;
    while (!found && fgets(text, sizeof text, f))
        if (strncmp(text, key, strlen(key)) == 0) found = sscanf(text + strlen(key), "%llu", &kib) == 1;
    fclose(f);
    if (!found) fail_msg("no %s in /proc/meminfo", key);
    return (uint64_t)kib * 1024u;
}

static void test_mem_available(void **state) {
    (void)state;
    uint64_t got = 0;
    ember_error err;
    assert_int_equal(serve_mem_available(&got, &err), 0);
    assert_true(got > 0 && got <= meminfo("MemTotal:"));
}

/* ---- the server ---- */

/* Runs `ember serve MODEL ARGS` expecting it to stop before listening;
 * returns its stderr (malloc'd) and its exit status in *rc. */
static char *serve_fails(const char *env, const char *args, int *rc) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s timeout 20 '%s' serve '%s' --port 0 --threads 1 %s 2>&1", env, ember_binary(), g_model,
             args);
    char *out;
    *rc = run_capture(cmd, &out);
    return out;
}

static void test_impossible_pool_fails_at_start(void **state) {
    (void)state;
    int rc;
    char *out = serve_fails("", "--num-blocks 1000000000", &rc);
    assert_int_equal(rc, 1);
    assert_non_null(strstr(out, "cache.num_blocks=1000000000 needs"));
    assert_non_null(strstr(out, "lower cache.num_blocks"));
    assert_null(strstr(out, "listening"));
    assert_null(strstr(out, "APC enabled")); /* refused before the pool and cache exist */
    free(out);
    out = serve_fails("", "--memory-share 0", &rc);
    assert_int_equal(rc, 1);
    assert_non_null(strstr(out, "cache.memory_share"));
    free(out);
    out = serve_fails("APC_MEMORY_SHARE=1.5", "", &rc);
    assert_int_equal(rc, 1);
    assert_non_null(strstr(out, "cache.memory_share"));
    free(out);
}

/* Spawns a server (extra args NULL-terminated), returns its port; the log
 * goes to log_path, which must be a new file (the launcher reads it for the
 * port before the child can truncate an old one). */
static int spawn(char **extra, const char *log_path, pid_t *pid) {
    unlink(log_path);
    int port = http_spawn_ember(ember_binary(), g_model, extra, log_path, pid);
    if (port <= 0) {
        char *text = read_whole_file(log_path, NULL);
        fail_msg("ember serve did not start:\n%s", text ? text : "(no log)");
    }
    return port;
}

static void test_default_pool_from_memory(void **state) {
    (void)state;
    char *dir = make_temp_dir(), log[600];
    snprintf(log, sizeof log, "%s/serve.log", dir);
    char *extra[] = {(char *)"--no-disk", NULL};
    pid_t pid;
    uint64_t avail_before = meminfo("MemAvailable:");
    spawn(extra, log, &pid);
    uint64_t avail_after = meminfo("MemAvailable:");
    assert_int_equal(http_stop_server(&pid, 10000), 0);
    char *text = read_whole_file(log, NULL);
    const char *line = strstr(text, "KV pool: ");
    assert_non_null(line);
    long long blocks = 0, tokens = 0;
    double gib = 0, pct = 0;
    assert_int_equal(sscanf(line, "KV pool: %lld blocks (%lld tokens, %lf GiB) = %lf%% of available memory", &blocks,
                            &tokens, &gib, &pct),
                     4);
    assert_int_equal(tokens, blocks * 16);
    assert_non_null(strstr(line, "cache.memory_share 0.5 x ("));
    /* the default model's block is 32 KiB in the serving default KV format,
     * f16 (4 layers x 256 values x 2 bytes x 16 rows; 64 KiB in f32) */
    double expect_lo = 0.5 * ((double)(avail_before < avail_after ? avail_before : avail_after) * 0.9 - 4 * MIB) / 32768;
    double expect_hi = 0.5 * ((double)(avail_before > avail_after ? avail_before : avail_after) * 0.9) / 32768;
    /* memory moves while other programs run: 15% either way */
    if ((double)blocks < expect_lo * 0.85 || (double)blocks > expect_hi * 1.15)
        fail_msg("pool of %lld blocks, expected %.0f..%.0f from MemAvailable", blocks, expect_lo, expect_hi);
    /* far more than the old default of four contexts (1024 blocks) */
    assert_true(blocks > 4 * 4096 / 16);
    free(text);
    remove_tree(dir);
    free(dir);
}

/* One completion of token ids; returns cached_tokens. */
static long complete_ids(int port, int n, int seed) {
    char body[16384];
    int len = snprintf(body, sizeof body, "{\"prompt\":[");
    uint64_t s = (uint64_t)seed * 0x9E3779B97F4A7C15ull + 7;
    for (int i = 0; i < n; i++) len += snprintf(body + len, sizeof body - (size_t)len, "%s%u", i ? "," : "", 3 + test_rand(&s) % 280);
    snprintf(body + len, sizeof body - (size_t)len, "],\"max_tokens\":1,\"temperature\":0}");
    char *resp;
    int st = http_call(port, "POST", "/v1/completions", NULL, body, &resp);
    if (st != 200) fail_msg("completion: %d %s", st, resp);
    cJSON *j = cJSON_Parse(resp);
    assert_non_null(j);
    const cJSON *c = cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "prompt_tokens_details"),
                                         "cached_tokens");
    assert_true(cJSON_IsNumber(c));
    long cached = (long)c->valuedouble;
    cJSON_Delete(j);
    free(resp);
    return cached;
}

static void test_disk_on_by_default(void **state) {
    (void)state;
    char *dir = make_temp_dir(), log[600];
    snprintf(log, sizeof log, "%s/serve.log", dir);
    pid_t pid;
    int port = spawn(NULL, log, &pid);
    assert_int_equal(complete_ids(port, 300, 1), 0);
    assert_int_equal(http_stop_server(&pid, 10000), 0);
    char *text = read_whole_file(log, NULL);
    char where[600];
    snprintf(where, sizeof where, "APC disk tier at %s/ember/apc (ns=", test_cache_home());
    assert_non_null(strstr(text, where));
    free(text);
    /* a fresh process: the pool is empty, the prompt comes back from disk */
    port = spawn(NULL, log, &pid);
    assert_int_equal(complete_ids(port, 300, 1), 299); /* N-1: its blocks and partial tail, from disk */
    assert_int_equal(http_stop_server(&pid, 10000), 0);

    /* one switch turns it off: nothing read, nothing written */
    char *off[] = {(char *)"--no-disk", NULL};
    port = spawn(off, log, &pid);
    assert_int_equal(complete_ids(port, 300, 1), 0);
    assert_int_equal(complete_ids(port, 300, 2), 0);
    assert_int_equal(http_stop_server(&pid, 10000), 0);
    text = read_whole_file(log, NULL);
    assert_null(strstr(text, "APC disk tier at"));
    free(text);
    port = spawn(NULL, log, &pid);
    assert_int_equal(complete_ids(port, 300, 2), 0); /* the --no-disk server wrote nothing */
    assert_int_equal(http_stop_server(&pid, 10000), 0);
    remove_tree(dir);
    free(dir);
}

/* A model without K/V layers (mamba2: recurrent state only) keeps the
 * small pool of four contexts: its blocks would hold nothing, and millions
 * of them only slow the start and the stop. */
static void test_pool_without_kv_layers(void **state) {
    (void)state;
    char *dir = make_temp_dir(), gguf_path[600], log[700], cmd[1600], *out;
    snprintf(gguf_path, sizeof gguf_path, "%s/mamba2.gguf", dir);
    snprintf(cmd, sizeof cmd, "'%s' mkmodel --arch mamba2 --out '%s' 2>&1", ember_binary(), gguf_path);
    assert_int_equal(run_capture(cmd, &out), 0);
    free(out);
    snprintf(log, sizeof log, "%s/serve.log", dir);
    char *extra[] = {(char *)"--no-disk", NULL};
    pid_t pid;
    int port = http_spawn_ember(ember_binary(), gguf_path, extra, log, &pid);
    assert_true(port > 0);
    assert_int_equal(http_stop_server(&pid, 10000), 0);
    char *text = read_whole_file(log, NULL);
    assert_non_null(strstr(text, "blocks (four contexts; the model has no KV layers)"));
    free(text);
    remove_tree(dir);
    free(dir);
}

static void test_bad_disk_path(void **state) {
    (void)state;
    char *dir = make_temp_dir();
    char file[600], args[1400];
    snprintf(file, sizeof file, "%s/a-file", dir);
    FILE *f = fopen(file, "w");
    assert_non_null(f);
    fputs("x", f);
    fclose(f);
    /* a configured path below a regular file: refused at start */
    int rc;
    snprintf(args, sizeof args, "--disk-path '%s/apc'", file);
    char *out = serve_fails("", args, &rc);
    assert_int_equal(rc, 1);
    assert_non_null(strstr(out, "APC disk tier at"));
    assert_non_null(strstr(out, "cannot be used"));
    assert_non_null(strstr(out, "cache.disk.optional"));
    assert_null(strstr(out, "listening"));
    free(out);
    /* optional: a warning, and the server runs from memory */
    char log[700];
    snprintf(log, sizeof log, "%s/serve.log", dir);
    char path[700];
    snprintf(path, sizeof path, "%s/apc", file);
    char *optional[] = {(char *)"--disk-path", path, (char *)"--disk-optional", NULL};
    pid_t pid;
    spawn(optional, log, &pid);
    assert_int_equal(http_stop_server(&pid, 10000), 0);
    char *text = read_whole_file(log, NULL);
    assert_non_null(strstr(text, "APC disk tier disabled"));
    free(text);
    /* the per-user default nobody configured: a warning, not a failure */
    char *home = strdup(test_cache_home());
    setenv("XDG_CACHE_HOME", file, 1); /* the spawned server inherits it */
    spawn(NULL, log, &pid);
    setenv("XDG_CACHE_HOME", home, 1);
    free(home);
    assert_int_equal(http_stop_server(&pid, 10000), 0);
    text = read_whole_file(log, NULL);
    assert_non_null(strstr(text, "APC disk tier disabled"));
    assert_non_null(strstr(text, "listening on"));
    free(text);
    remove_tree(dir);
    free(dir);
}

static void test_disk_switch_in_settings(void **state) {
    (void)state;
    serve_config c;
    ember_error err;
    serve_config_defaults(&c);
    assert_true(c.disk_enabled);
    assert_false(c.disk_optional);
    assert_true(c.memory_share == SERVE_POOL_SHARE_DEFAULT);
    assert_string_equal(c.disk_path, "");
    assert_int_equal(serve_config_finish(&c, &err), 0);
    char want[600];
    snprintf(want, sizeof want, "%s/ember/apc", test_cache_home());
    assert_string_equal(c.disk_path, want);
    engine_config ec;
    serve_config_engine(&c, &ec);
    assert_string_equal(ec.cache.disk.path, want);
    assert_true(ec.cache.disk.optional); /* nobody chose that path */
    const char *off = "cache:\n  disk: false\n";
    assert_int_equal(serve_config_load_string(&c, off, strlen(off), "t.yaml", &err), 0);
    assert_false(c.disk_enabled);
    serve_config_engine(&c, &ec);
    assert_null(ec.cache.disk.path);
    const char *on = "cache:\n  disk:\n    enabled: true\n    path: /tmp/x\n";
    assert_int_equal(serve_config_load_string(&c, on, strlen(on), "t.yaml", &err), 0);
    serve_config_engine(&c, &ec);
    assert_string_equal(ec.cache.disk.path, "/tmp/x");
    assert_false(ec.cache.disk.optional); /* configured: must work */
}

static int setup(void **state) {
    (void)state;
    if (ember_binary() == NULL || build_dir() == NULL) return -1;
    snprintf(g_model, sizeof g_model, "%s/models/default.gguf", build_dir());
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pool_arithmetic),
        cmocka_unit_test(test_pool_refusals),
        cmocka_unit_test(test_pool_tokens_kvarn),
        cmocka_unit_test(test_mem_available),
        cmocka_unit_test(test_disk_switch_in_settings),
        cmocka_unit_test(test_impossible_pool_fails_at_start),
        cmocka_unit_test(test_default_pool_from_memory),
        cmocka_unit_test(test_disk_on_by_default),
        cmocka_unit_test(test_pool_without_kv_layers),
        cmocka_unit_test(test_bad_disk_path),
    };
    return test_run_group(tests, setup, NULL);
}
