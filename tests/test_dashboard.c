/* test_dashboard.c - the live cache dashboard in a real browser.
 *
 * Starts `ember serve` on the shipped default model with an API key, sends a
 * few requests (a prompt, the same prompt again so the cache hits, a
 * streamed one), then has headless Chromium load GET /dashboard:
 *  - without the key the page shows its lock form and renders no value;
 *  - with the key (#key=... in the URL) every number the page renders equals
 *    the server's /v1/cache/stats, /metrics and /v1/cache/recent as the test
 *    reads them itself: each shown value carries its raw form in a
 *    data-value attribute, read from the DOM Chromium dumps after a virtual
 *    time budget;
 *  - a screenshot is kept as an artifact: $EMBER_BUILD_DIR/dashboard.png.
 * GET / serves the same page, and /v1/cache/recent needs the key.
 *
 * Without Chromium (chromium, chromium-browser or $EMBER_CHROMIUM) the test
 * exits 77, which CTest reports as skipped, unless CI is set: CI installs it
 * through scripts/install-deps.sh, so there its absence is a failure. */
#define _GNU_SOURCE
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "serve/serve_metrics.h"
#include "http_client.h"
#include "test_util.h"

static char g_chromium[512];
static char *g_dir;
static char g_model[1024];
static pid_t g_pid;
static int g_port;
static char g_log[600];
static bool g_setup_failed; /* cmocka exits 0 after a failed group setup */

static bool find_chromium(void) {
    const char *env = getenv("EMBER_CHROMIUM");
    if (env && access(env, X_OK) == 0) {
        snprintf(g_chromium, sizeof g_chromium, "%s", env);
        return true;
    }
    const char *names[] = {"chromium", "chromium-browser", "google-chrome"};
    const char *path = getenv("PATH");
    if (path == NULL) return false;
    for (size_t n = 0; n < sizeof names / sizeof names[0]; n++) {
        char *dirs = strdup(path);
        for (char *d = strtok(dirs, ":"); d; d = strtok(NULL, ":")) {
            snprintf(g_chromium, sizeof g_chromium, "%s/%s", d, names[n]);
            if (access(g_chromium, X_OK) == 0) {
                free(dirs);
                return true;
            }
        }
        free(dirs);
    }
    return false;
}

/* Runs headless Chromium on url; mode "--dump-dom" returns the DOM. */
static char *chromium(const char *url, const char *mode) {
    char cmd[2048], *out;
    snprintf(cmd, sizeof cmd,
             "'%s' --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run "
             "--user-data-dir=%s/chromium-profile --window-size=1280,1100 --virtual-time-budget=4000 %s '%s' "
             "2>%s/chromium.log",
             g_chromium, g_dir, mode, url, g_dir);
    int rc = run_capture(cmd, &out);
    if (rc != 0) {
        char log[600];
        snprintf(log, sizeof log, "%s/chromium.log", g_dir);
        char *text = read_whole_file(log, NULL);
        print_message("chromium exited %d:\n%s\n", rc, text ? text : "");
        free(text);
    }
    assert_int_equal(rc, 0);
    return out;
}

/* The data-value attribute of the element whose id is `id` (malloc'd), or NULL. */
static char *dom_value(const char *dom, const char *id) {
    char pat[96];
    snprintf(pat, sizeof pat, " id=\"%s\"", id);
    const char *at = strstr(dom, pat);
    if (at == NULL) return NULL;
    const char *open = at;
    while (open > dom && *open != '<') open--;
    const char *close = strchr(at, '>');
    const char *dv = strstr(open, "data-value=\"");
    if (dv == NULL || close == NULL || dv > close) return NULL;
    dv += strlen("data-value=\"");
    const char *end = strchr(dv, '"');
    return end ? strndup(dv, (size_t)(end - dv)) : NULL;
}

static void page_has_number(const char *dom, const char *id, double want) {
    char *v = dom_value(dom, id);
    if (v == NULL) fail_msg("the page has no value for #%s", id);
    char *end;
    double got = strtod(v, &end);
    if (end == v || *end != 0 || got != want) fail_msg("#%s renders '%s', the server says %.17g", id, v, want);
    free(v);
}

static void page_has_string(const char *dom, const char *id, const char *want) {
    char *v = dom_value(dom, id);
    if (v == NULL) fail_msg("the page has no value for #%s", id);
    if (strcmp(v, want) != 0) fail_msg("#%s renders '%s', the server says '%s'", id, v, want);
    free(v);
}

static cJSON *get_json(const char *path) {
    char *body;
    int st = http_call(g_port, "GET", path, "Authorization: Bearer sekrit\r\n", NULL, &body);
    if (st != 200) fail_msg("GET %s: %d %s", path, st, body);
    cJSON *j = cJSON_Parse(body);
    free(body);
    assert_non_null(j);
    return j;
}

static double jnum(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItem(o, key);
    if (!cJSON_IsNumber(v)) fail_msg("no number '%s' in the JSON", key);
    return v->valuedouble;
}

static int setup_server(void);
static int setup(void **state) {
    (void)state;
    int rc = setup_server();
    g_setup_failed = rc < 0;
    return rc;
}

static int setup_server(void) {
    const char *src = getenv("EMBER_SOURCE_DIR");
    if (src == NULL || ember_binary() == NULL) return -1;
    snprintf(g_model, sizeof g_model, "%s/models/stories260K.gguf", src);
    g_dir = make_temp_dir();
    snprintf(g_log, sizeof g_log, "%s/serve.log", g_dir);
    char *extra[] = {(char *)"--api-key", (char *)"sekrit", NULL};
    g_port = http_spawn_ember(ember_binary(), g_model, extra, g_log, &g_pid);
    if (g_port <= 0) return -1;
    const char *bodies[] = {
        "{\"prompt\":\"Once upon a time, there was a little girl named Lily. She loved\",\"max_tokens\":16}",
        "{\"prompt\":\"Once upon a time, there was a little girl named Lily. She loved\",\"max_tokens\":16}",
        "{\"prompt\":\"Tom had a big red ball.\",\"max_tokens\":8,\"stream\":true}",
    };
    for (size_t i = 0; i < 3; i++) {
        char *resp;
        int st = http_call(g_port, "POST", "/v1/completions", "Authorization: Bearer sekrit\r\n", bodies[i], &resp);
        free(resp);
        if (st != 200) return -1;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    http_stop_server(&g_pid, 10000);
    remove_tree(g_dir);
    free(g_dir);
    return 0;
}

static void test_page_is_served_and_data_needs_the_key(void **state) {
    (void)state;
    char *a, *b;
    assert_int_equal(http_call(g_port, "GET", "/", NULL, NULL, &a), 200);
    assert_int_equal(http_call(g_port, "GET", "/dashboard", NULL, NULL, &b), 200);
    assert_string_equal(a, b);
    assert_non_null(strstr(a, "/v1/cache/stats"));
    /* nothing is loaded from elsewhere: no external script, style, image or fetch */
    assert_null(strstr(a, "src="));
    assert_null(strstr(a, "href="));
    assert_null(strstr(a, "<link"));
    assert_null(strstr(a, "fetch(\"http"));
    free(a);
    free(b);
    assert_int_equal(http_call(g_port, "GET", "/v1/cache/recent", NULL, NULL, &a), 401);
    free(a);
}

static void test_locked_without_key(void **state) {
    (void)state;
    char url[256];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/dashboard", g_port);
    char *dom = chromium(url, "--dump-dom");
    page_has_string(dom, "status", "locked");
    page_has_string(dom, "tokens-saved", "");
    page_has_string(dom, "pool-free", "");
    assert_non_null(strstr(dom, "<section id=\"lock\" class=\"\">"));
    free(dom);
}

static void test_rendered_values_equal_the_server(void **state) {
    (void)state;
    char url[256];
    snprintf(url, sizeof url, "http://127.0.0.1:%d/dashboard#key=sekrit", g_port);
    char *dom = chromium(url, "--dump-dom");
    cJSON *stats = get_json("/v1/cache/stats"), *recent = get_json("/v1/cache/recent");
    char *metrics;
    assert_int_equal(http_call(g_port, "GET", "/metrics", "Authorization: Bearer sekrit\r\n", NULL, &metrics), 200);

    page_has_string(dom, "status", "live");
    page_has_string(dom, "model", "stories260K");
    page_has_string(dom, "tier", cJSON_GetObjectItem(stats, "tier")->valuestring);
    page_has_string(dom, "route", cJSON_GetObjectItem(recent, "route")->valuestring);
    /* the route line is the one the server logged at load */
    char *log = read_whole_file(g_log, NULL);
    assert_non_null(strstr(log, cJSON_GetObjectItem(recent, "route")->valuestring));
    free(log);
    const struct { const char *id, *key; } pairs[] = {
        {"hit-rate", "token_hit_rate"}, {"tokens-saved", "matched_tokens"}, {"tokens-served", "served_tokens"},
        {"lookups-hit", "lookups_hit"}, {"lookups-miss", "lookups_miss"}, {"stores", "stores"},
        {"evictions", "evictions"}, {"pool-total", "num_blocks"}, {"pool-free", "pool_free"},
        {"pool-referenced", "pool_referenced"}, {"pool-cached", "pool_used"}, {"exact-entries", "exact_entries"},
        {"exact-hits", "exact_hits"}, {"ckpt-records", "ckpt_records"}, {"ckpt-bytes", "ckpt_bytes"},
        {"ckpt-hits", "ckpt_hits"}, {"ckpt-stores", "ckpt_stores"}, {"disk-hits", "disk_hits"},
    };
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) page_has_number(dom, pairs[i].id, jnum(stats, pairs[i].key));
    /* these requests did hit: the page must show a real rate, not zeros */
    assert_true(jnum(stats, "matched_tokens") > 0);
    /* the SSD tier is on by default (under the test's private cache home) */
    page_has_number(dom, "ssd", jnum(stats, "disk_bytes"));
    assert_true(jnum(stats, "disk_bytes") > 0);
    page_has_string(dom, "tripwire-zero-stores", "0");
    page_has_string(dom, "tripwire-missed", "0");

    page_has_number(dom, "m-generations", serve_metrics_text_sum(metrics, "ember_generations_total"));
    page_has_number(dom, "m-prompt", serve_metrics_text_sum(metrics, "ember_prompt_tokens_total"));
    page_has_number(dom, "m-cached", serve_metrics_text_sum(metrics, "ember_prompt_cached_tokens_total"));
    page_has_number(dom, "m-completion", serve_metrics_text_sum(metrics, "ember_completion_tokens_total"));
    assert_true(serve_metrics_text_sum(metrics, "ember_generations_total") == 3);

    /* recent requests: same ids, same order, same token counts */
    const cJSON *reqs = cJSON_GetObjectItem(recent, "requests");
    assert_int_equal(cJSON_GetArraySize(reqs), 3);
    page_has_number(dom, "recent", 3);
    const char *row = dom;
    const cJSON *q;
    int hits = 0;
    cJSON_ArrayForEach(q, reqs) {
        char pat[128];
        snprintf(pat, sizeof pat, "data-id=\"%s\" data-prompt=\"%.0f\" data-cached=\"%.0f\"",
                 cJSON_GetObjectItem(q, "id")->valuestring, jnum(q, "prompt_tokens"), jnum(q, "cached_tokens"));
        const char *at = strstr(row, pat);
        if (at == NULL) fail_msg("no row %s after the previous one in the page", pat);
        row = at;
        hits += jnum(q, "cached_tokens") > 0;
    }
    assert_int_equal(hits, 1); /* the resend */
    cJSON_Delete(stats);
    cJSON_Delete(recent);
    free(metrics);
    free(dom);

    /* the screenshot artifact */
    const char *bd = build_dir();
    char shot[700], mode[800];
    snprintf(shot, sizeof shot, "%s/dashboard.png", bd ? bd : g_dir);
    unlink(shot);
    snprintf(mode, sizeof mode, "--hide-scrollbars --screenshot=%s", shot);
    free(chromium(url, mode));
    size_t n;
    unsigned char *png = read_whole_file(shot, &n);
    assert_non_null(png);
    assert_true(n > 10000);
    assert_memory_equal(png, "\x89PNG\r\n\x1a\n", 8);
    free(png);
    print_message("screenshot: %s\n", shot);
}

int main(void) {
    if (!find_chromium()) {
        if (getenv("CI")) {
            fprintf(stderr, "test_dashboard: chromium is not installed (scripts/install-deps.sh installs it)\n");
            return 1;
        }
        printf("skipping: chromium not found (install it with scripts/install-deps.sh, or set EMBER_CHROMIUM)\n");
        return TEST_SKIP_EXIT;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_page_is_served_and_data_needs_the_key),
        cmocka_unit_test(test_locked_without_key),
        cmocka_unit_test(test_rendered_values_equal_the_server),
    };
    int rc = test_run_group(tests, setup, teardown);
    return g_setup_failed ? 1 : rc;
}
