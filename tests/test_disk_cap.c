/* test_disk_cap.c - the default size cap of the SSD tier (issue 10, item 8).
 *
 * The cap is a pure function of the free space (tested at the edges: zero,
 * below and above the ceiling, no overflow at 2^64-1); the free space is
 * statvfs of the cache path or, before the path exists, of its nearest
 * existing parent; cache.disk.max_gb keeps its meaning when given (> 0: GB,
 * 0: unbounded) and unset means the default. A spawned `ember serve` with a
 * disk path logs how its cap was chosen, and the cache's own start-up line
 * shows the same cap instead of "unbounded". */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "serve/serve_config.h"
#include "serve/serve_disk_cap.h"
#include "http_client.h"
#include "test_util.h"

static void test_cap_function(void **state) {
    (void)state;
    assert_int_equal(serve_disk_cap_default(0), 0);
    assert_int_equal(serve_disk_cap_default(100), 25);
    assert_int_equal(serve_disk_cap_default(7), 1); /* 25% of 7 bytes, rounded down */
    assert_int_equal(serve_disk_cap_default(40000000000ull), 10000000000ull);
    assert_int_equal(serve_disk_cap_default(199000000000ull), 49750000000ull);
    assert_int_equal(serve_disk_cap_default(200000000000ull), SERVE_DISK_CAP_CEILING);
    assert_int_equal(serve_disk_cap_default(4000000000000ull), SERVE_DISK_CAP_CEILING);
    assert_int_equal(serve_disk_cap_default(UINT64_MAX), SERVE_DISK_CAP_CEILING);
    /* Monotonic: more free space never gives a smaller cap. */
    uint64_t prev = 0;
    for (uint64_t f = 1; f < (1ull << 40); f = f * 3 + 1) {
        uint64_t c = serve_disk_cap_default(f);
        assert_true(c >= prev);
        assert_true(c <= f / 4 + 1);
        prev = c;
    }
}

/* Free bytes as statvfs reports them right now. */
static uint64_t statvfs_free(const char *path) {
    struct statvfs v;
    assert_int_equal(statvfs(path, &v), 0);
    return (uint64_t)v.f_bavail * v.f_frsize;
}

/* Other processes write to the same disk: equal within 1% or 256 MB. */
static void assert_close(uint64_t a, uint64_t b) {
    uint64_t d = a > b ? a - b : b - a, tol = (a > b ? a : b) / 100;
    if (tol < (256ull << 20)) tol = 256ull << 20;
    if (d > tol) fail_msg("%llu and %llu differ by %llu", (unsigned long long)a, (unsigned long long)b,
                          (unsigned long long)d);
}

static void test_free_space_and_resolve(void **state) {
    (void)state;
    char *dir = make_temp_dir();
    char deep[600];
    snprintf(deep, sizeof deep, "%s/not/created/yet", dir);
    uint64_t f = 0;
    ember_error err;
    assert_int_equal(serve_disk_free_bytes(deep, &f, &err), 0);
    assert_true(f > 0);
    assert_close(f, statvfs_free(dir));

    char why[256];
    assert_int_equal(serve_disk_cap_resolve(2.5, deep, why, sizeof why), 2500000000ull);
    assert_string_equal(why, "cap=2.50 GB (cache.disk.max_gb)");
    assert_int_equal(serve_disk_cap_resolve(0, deep, why, sizeof why), 0);
    assert_non_null(strstr(why, "cap=unbounded"));
    uint64_t cap = serve_disk_cap_resolve(SERVE_DISK_CAP_AUTO, deep, why, sizeof why);
    assert_close(cap, serve_disk_cap_default(statvfs_free(dir)));
    assert_true(cap > 0 && cap <= SERVE_DISK_CAP_CEILING);
    assert_non_null(strstr(why, "% of "));
    assert_non_null(strstr(why, " free, at most 50 GB"));
    remove_tree(dir);
    free(dir);
}

static void test_config_keeps_meanings(void **state) {
    (void)state;
    serve_config c;
    ember_error err;
    serve_config_defaults(&c);
    assert_true(c.disk_max_gb == SERVE_DISK_CAP_AUTO);
    assert_int_equal(serve_config_validate(&c, &err), 0);
    const char *zero = "cache:\n  disk:\n    path: /tmp/x\n    max_gb: 0\n";
    assert_int_equal(serve_config_load_string(&c, zero, strlen(zero), "t.yaml", &err), 0);
    assert_true(c.disk_max_gb == 0);
    const char *autos = "cache:\n  disk:\n    max_gb: auto\n";
    assert_int_equal(serve_config_load_string(&c, autos, strlen(autos), "t.yaml", &err), 0);
    assert_true(c.disk_max_gb == SERVE_DISK_CAP_AUTO);
    const char *gb = "cache:\n  disk:\n    max_gb: 2.5\n";
    assert_int_equal(serve_config_load_string(&c, gb, strlen(gb), "t.yaml", &err), 0);
    assert_true(c.disk_max_gb == 2.5);
    const char *neg = "cache:\n  disk:\n    max_gb: -2\n";
    assert_int_equal(serve_config_load_string(&c, neg, strlen(neg), "t.yaml", &err), -1);
    assert_non_null(strstr(err.msg, "max_gb"));
    assert_non_null(strstr(err.msg, "or auto"));
    /* The settings table shows the default as the word. */
    serve_config_defaults(&c);
    const serve_setting *row = serve_setting_by_key("cache.disk.max_gb");
    assert_non_null(row);
    assert_string_equal(row->def, "auto");
    char shown[32];
    serve_setting_format(&c, row, shown, sizeof shown);
    assert_string_equal(shown, "auto");
    /* What the engine gets: the measured cap, never "unbounded" by default. */
    snprintf(c.disk_path, sizeof c.disk_path, "/tmp");
    engine_config ec;
    serve_config_engine(&c, &ec);
    assert_true(ec.cache.disk.max_bytes > 0 && ec.cache.disk.max_bytes <= SERVE_DISK_CAP_CEILING);
    c.disk_max_gb = 0;
    serve_config_engine(&c, &ec);
    assert_int_equal(ec.cache.disk.max_bytes, 0);
}

/* Starts ember serve with a disk path, waits for it to listen, returns its
 * log (malloc'd) after stopping it. */
static char *serve_log(const char *model_path, const char *cfg, const char *dir, const char *max_gb_env) {
    static int run;
    char log[600];
    snprintf(log, sizeof log, "%s/serve-%d.log", dir, run++);
    const char *bin = ember_binary();
    /* the child inherits the variable; the test's own environment is restored */
    const char *had = getenv("APC_DISK_MAX_GB");
    char *saved = had ? strdup(had) : NULL;
    if (max_gb_env) setenv("APC_DISK_MAX_GB", max_gb_env, 1);
    else unsetenv("APC_DISK_MAX_GB");
    char *argv[] = {(char *)bin, (char *)"serve", (char *)model_path, (char *)"--port", (char *)"0",
                    (char *)"--threads", (char *)"1", (char *)"--config", (char *)cfg, NULL};
    pid_t pid;
    int port = http_spawn_server(argv, log, 30, &pid);
    if (saved) setenv("APC_DISK_MAX_GB", saved, 1);
    else unsetenv("APC_DISK_MAX_GB");
    free(saved);
    if (port <= 0) {
        char *text = read_whole_file(log, NULL);
        fail_msg("ember serve did not listen: %s", text ? text : "");
    }
    http_stop_server(&pid, 20000);
    char *text = read_whole_file(log, NULL);
    assert_true(text && strstr(text, "listening on"));
    return text;
}

static void test_server_logs_cap(void **state) {
    (void)state;
    const char *bin = ember_binary();
    if (bin == NULL) {
        print_message("skipping: EMBER_BIN is not set (run under ctest)\n");
        skip();
    }
    char *dir = make_temp_dir();
    char model_path[600], cfg[600], cmd[2048];
    snprintf(model_path, sizeof model_path, "%s/tiny.gguf", dir);
    snprintf(cmd, sizeof cmd, "%s mkmodel --arch qwen3 --preset tiny --out %s >/dev/null 2>&1", bin, model_path);
    assert_int_equal(system(cmd), 0);
    snprintf(cfg, sizeof cfg, "%s/ember.yaml", dir);
    FILE *f = fopen(cfg, "w");
    assert_non_null(f);
    fprintf(f, "cache:\n  disk:\n    path: %s/apc\n", dir);
    fclose(f);

    char *text = serve_log(model_path, cfg, dir, NULL);
    const char *line = strstr(text, "APC disk tier size cap=");
    if (line == NULL) fail_msg("no cap line in: %s", text);
    double gb = atof(line + strlen("APC disk tier size cap="));
    assert_non_null(strstr(line, "(25% of "));
    assert_true(gb > 0 && gb <= 50.0);
    /* The cache's own line carries the same cap (in GiB), not "unbounded". */
    const char *apc_line = strstr(text, "APC disk tier at ");
    assert_non_null(apc_line);
    const char *capg = strstr(apc_line, "cap=");
    assert_non_null(capg);
    double gib = atof(capg + 4);
    assert_true(gib > 0);
    assert_true(gib * 1.073741824 > gb * 0.99 && gib * 1.073741824 < gb * 1.01);
    free(text);

    text = serve_log(model_path, cfg, dir, "0");
    assert_non_null(strstr(text, "APC disk tier size cap=unbounded"));
    assert_non_null(strstr(text, "cap=unbounded, "));
    free(text);
    remove_tree(dir);
    free(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cap_function),
        cmocka_unit_test(test_free_space_and_resolve),
        cmocka_unit_test(test_config_keeps_meanings),
        cmocka_unit_test(test_server_logs_cap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
