/* test_util.c - fixture lookup, the exit status CTest reads, and small
 * helpers shared by the tests.
 *
 * A missing fixture is counted where it is looked up (fixture_path), not in
 * REQUIRE_FIXTURE, because several tests look optional fixtures up directly
 * and run only the parts they can; such a partial run is reported as SKIPPED
 * as well. Under CI the lookup itself fails the test, so no path can miss
 * it. */
#define _GNU_SOURCE
#include "test_util.h"
#include "http_client.h"

#include "core/log.h"
#include "engine/engine.h"

#include <cjson/cJSON.h>

#include <ftw.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static int fixtures_missing;

/* ---- A private cache home ----
 * `ember serve` keeps its SSD tier under the per-user cache directory by
 * default ($XDG_CACHE_HOME/ember/apc). Before main, every test program
 * points XDG_CACHE_HOME at a fresh temporary directory of its own, removed
 * at exit, so no test reads or writes the real home, no two test programs
 * running at once share a disk cache, and every server a test spawns
 * inherits that. A test that wants its own tier passes --disk-path or
 * --no-disk. */
static char *g_cache_home;
static pid_t g_cache_home_owner;

static void remove_cache_home(void) {
    if (g_cache_home && getpid() == g_cache_home_owner) remove_tree(g_cache_home); /* not from a forked child */
    free(g_cache_home);
    g_cache_home = NULL;
}

__attribute__((constructor)) static void private_cache_home(void) {
    g_cache_home = make_temp_dir();
    if (g_cache_home == NULL) {
        /* Never fall back to the real home: no per-user disk tier then. */
        setenv("APC_DISK", "0", 1);
        return;
    }
    g_cache_home_owner = getpid();
    setenv("XDG_CACHE_HOME", g_cache_home, 1);
    atexit(remove_cache_home);
}

const char *test_cache_home(void) { return g_cache_home; }

static bool under_ci(void) {
    const char *ci = getenv("CI");
    return ci && ci[0] && strcmp(ci, "0") != 0 && strcasecmp(ci, "false") != 0;
}

const char *fixture_path(const char *relative) {
    static char bufs[8][1024];
    static int next;
    const char *root = getenv("EMBER_FIXTURES");
    if (root == NULL) root = "../shared/fixtures";
    char *buf = bufs[next++ % 8];
    snprintf(buf, sizeof bufs[0], "%s/%s", root, relative);
    if (access(buf, R_OK) != 0) {
        fixtures_missing++;
        if (under_ci()) fail_msg("fixture %s not found, and CI is set: every fixture must be present", buf);
        print_message("skipping: fixture %s not found (set EMBER_FIXTURES)\n", buf);
        return NULL;
    }
    return buf;
}

int test_fixtures_missing(void) { return fixtures_missing; }

int test_exit_status(int cmocka_failed) {
    if (cmocka_failed != 0) return 1;
    if (fixtures_missing > 0) {
        print_message("%d fixture lookup(s) found nothing: reporting SKIPPED (exit %d), not Passed\n",
                      fixtures_missing, TEST_SKIP_EXIT);
        return TEST_SKIP_EXIT;
    }
    return 0;
}

void *read_whole_file(const char *path, size_t *size) {
    FILE *fp = fopen(path, "rb");
    if (fp == NULL) return NULL;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    void *buf = malloc(n > 0 ? (size_t)n + 1 : 1);
    if (buf && n > 0 && fread(buf, 1, (size_t)n, fp) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(fp);
    if (buf) {
        ((char *)buf)[n > 0 ? n : 0] = '\0';
        if (size) *size = (size_t)(n > 0 ? n : 0);
    }
    return buf;
}

void test_log_capture_begin(test_log_capture *c) {
    snprintf(c->path, sizeof c->path, "/tmp/ember_test_logXXXXXX");
    int fd = mkstemp(c->path);
    assert_true(fd >= 0);
    fflush(stderr);
    c->saved_stderr = dup(2);
    assert_true(c->saved_stderr >= 0);
    dup2(fd, 2);
    close(fd);
    c->saved_level = (int)ember_log_get_level();
    ember_log_set_level(EMBER_LOG_INFO);
}

char *test_log_capture_end(test_log_capture *c) {
    ember_log_set_level((ember_log_level)c->saved_level);
    fflush(stderr);
    dup2(c->saved_stderr, 2);
    close(c->saved_stderr);
    char *text = read_whole_file(c->path, NULL);
    unlink(c->path);
    assert_non_null(text);
    return text;
}

char *make_temp_dir(void) {
    char tmpl[] = "/tmp/ember-test-XXXXXX";
    char *dir = mkdtemp(tmpl);
    return dir ? strdup(dir) : NULL;
}

static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st; (void)flag; (void)ftw;
    return remove(path);
}

void remove_tree(const char *path) {
    if (path) nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

int run_capture(const char *cmd, char **out) {
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    size_t got;
    while ((got = fread(buf + n, 1, cap - n - 1, p)) > 0) {
        n += got;
        if (n + 1 >= cap) buf = realloc(buf, cap *= 2);
    }
    buf[n] = '\0';
    int status = pclose(p);
    *out = buf;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

const char *ember_binary(void) { return getenv("EMBER_BIN"); }
const char *build_dir(void) { return getenv("EMBER_BUILD_DIR"); }

uint32_t test_rand(uint64_t *state) {
    uint64_t x = *state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *state = x;
    return (uint32_t)(x >> 16);
}

void test_random_tokens(uint64_t *state, int32_t *t, int64_t n, int vocab) {
    for (int64_t i = 0; i < n; i++) t[i] = (int32_t)(test_rand(state) % (uint32_t)vocab);
}

model *test_load_model(const char *path) {
    ember_error err;
    model *m = model_load(path, &err);
    if (m == NULL) fail_msg("model_load(%s): %s", path, err.msg);
    return m;
}

engine *test_open_engine(const model *m, const engine_config *cfg) {
    ember_error err;
    engine *e = engine_create(m, cfg, &err);
    if (e == NULL) fail_msg("engine_create: %s", err.msg);
    return e;
}

apc_stats test_cache_stats(engine *e) {
    apc_stats s;
    apc_get_stats(engine_cache(e), &s);
    return s;
}

void test_assert_no_block_leaks(engine *e) {
    kv_pool *p = engine_pool(e);
    for (int32_t b = 0; b < kv_pool_n_blocks(p); b++)
        if (kv_block_refcount(p, b) != 0) fail_msg("block %d still has refcount %d", b, kv_block_refcount(p, b));
}

void test_generate(engine *e, const int32_t *prompt, int64_t n, int max_tokens, int cache_mode, engine_result *r) {
    engine_request q = engine_default_request();
    q.prompt = prompt;
    q.n_prompt = n;
    q.max_tokens = max_tokens;
    q.cache = (engine_cache_mode)cache_mode;
    q.stop_at_eog = false;
    q.want_logits = true;
    ember_error err;
    if (engine_generate(e, &q, r, &err) < 0) fail_msg("engine_generate (n=%lld): %s", (long long)n, err.msg);
}

void assert_warm_equals_cold(const engine_result *cold, const engine_result *warm, const char *what) {
    if (cold->n_tokens != warm->n_tokens)
        fail_msg("%s: %d tokens cold, %d warm", what, cold->n_tokens, warm->n_tokens);
    if (memcmp(cold->tokens, warm->tokens, (size_t)cold->n_tokens * sizeof(int32_t)) != 0)
        fail_msg("%s: generated tokens differ (cached %lld)", what, (long long)warm->cached_tokens);
    for (int i = 0; i < cold->n_tokens; i++)
        if (memcmp(cold->logits + (size_t)i * cold->n_vocab, warm->logits + (size_t)i * warm->n_vocab,
                   (size_t)cold->n_vocab * sizeof(float)) != 0)
            fail_msg("%s: logits of step %d are not bit-identical (cached %lld)", what, i,
                     (long long)warm->cached_tokens);
}

cJSON *test_load_json(const char *path) {
    char *text = path ? read_whole_file(path, NULL) : NULL;
    if (text == NULL) fail_msg("missing %s", path ? path : "(no path)");
    cJSON *j = cJSON_Parse(text);
    free(text);
    if (j == NULL) fail_msg("%s is not JSON", path);
    return j;
}

int test_load_prompt_ids(const char *name, int32_t *ids, int cap) {
    char rel[256];
    snprintf(rel, sizeof rel, "reference/%s.json", name);
    const char *path = fixture_path(rel);
    if (path == NULL) return 0;
    cJSON *j = test_load_json(path);
    cJSON *arr = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "prompt"), "ids");
    int n = cJSON_GetArraySize(arr);
    if (n < 1 || n > cap) fail_msg("%s: %d prompt ids (1..%d expected)", path, n, cap);
    for (int i = 0; i < n; i++) ids[i] = cJSON_GetArrayItem(arr, i)->valueint;
    cJSON_Delete(j);
    return n;
}

test_completion test_complete(int port, const char *prompt) {
    char body[8192];
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":16,\"temperature\":0}", prompt);
    char *resp = NULL;
    int status = http_call(port, "POST", "/v1/completions", NULL, body, &resp);
    if (status != 200) fail_msg("completion: HTTP %d: %s", status, resp ? resp : "");
    cJSON *j = cJSON_Parse(resp);
    assert_non_null(j);
    test_completion c;
    cJSON *choice = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    cJSON *text = choice ? cJSON_GetObjectItem(choice, "text") : NULL;
    assert_true(cJSON_IsString(text));
    c.text = strdup(text->valuestring);
    cJSON *usage = cJSON_GetObjectItem(j, "usage");
    c.prompt_tokens = cJSON_GetObjectItem(usage, "prompt_tokens")->valueint;
    c.cached = cJSON_GetObjectItem(cJSON_GetObjectItem(usage, "prompt_tokens_details"), "cached_tokens")->valueint;
    cJSON_Delete(j);
    free(resp);
    return c;
}

double test_cache_stat(int port, const char *key) {
    char *resp = NULL;
    assert_int_equal(http_call(port, "GET", "/v1/cache/stats", NULL, NULL, &resp), 200);
    cJSON *j = cJSON_Parse(resp);
    assert_non_null(j);
    cJSON *v = cJSON_GetObjectItem(j, key);
    if (v == NULL) fail_msg("stats lack %s: %s", key, resp);
    double d = cJSON_IsString(v) ? 0 : v->valuedouble;
    cJSON_Delete(j);
    free(resp);
    return d;
}
