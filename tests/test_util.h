/* test_util.h - shared helpers for ember's cmocka tests.
 *
 * Fixtures live outside the repository (../shared/fixtures, read-only); a
 * test that needs one calls fixture_path() (or REQUIRE_FIXTURE), which
 * returns NULL when the file is absent and counts the miss. A test program
 * ends with `return test_run_group(tests, setup, teardown);`, which turns the
 * cmocka result into the exit status CTest reads:
 *   - a failed test (or setup): 1, FAILED;
 *   - otherwise, when any fixture was missing: TEST_SKIP_EXIT (77), which
 *     CTest shows as SKIPPED (SKIP_RETURN_CODE), even when other tests of
 *     the program ran and passed: a program that could not run all of its
 *     checks must not look like one that did;
 *   - otherwise 0, Passed.
 * When the environment variable CI is set (and not "0" or "false"), a
 * missing fixture fails the test that asked for it instead: CI must run
 * everything.
 *
 * API:
 *   fixtures and exit status  fixture_path, REQUIRE_FIXTURE, test_fixtures_missing,
 *                             test_exit_status, test_run_group
 *   files and processes       test_cache_home, read_whole_file, test_log_capture_begin/end,
 *                             make_temp_dir, remove_tree,
 *                             ember_binary, build_dir
 *   random inputs             test_rand, test_random_tokens
 *   models and engines        test_load_model, test_open_engine,
 *                             test_assert_no_block_leaks, test_cache_stats,
 *                             test_generate, assert_warm_equals_cold
 * The HTTP client and server launcher are in http_client.h. */
#ifndef EMBER_TEST_UTIL_H
#define EMBER_TEST_UTIL_H

#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include "apc/apc.h" /* apc_stats */

/* The exit status that CTest reads as "skipped" (SKIP_RETURN_CODE). */
#define TEST_SKIP_EXIT 77

/* Full path of a fixture under $EMBER_FIXTURES, or NULL (with a printed
 * "skipping: ... not found" note, and the miss counted) when it does not
 * exist; under CI the current test fails instead. Static buffer rotation:
 * valid for the next 7 calls. Call it from the test's own thread. */
const char *fixture_path(const char *relative);

/* Skips the current test when the fixture is missing (fails it under CI). */
#define REQUIRE_FIXTURE(var, rel)          \
    const char *var = fixture_path(rel);   \
    if (var == NULL) {                     \
        skip();                            \
        return;                            \
    }

/* How many fixture lookups found nothing so far. */
int test_fixtures_missing(void);

/* The exit status for a cmocka result (the number of failed tests): see the
 * header comment. */
int test_exit_status(int cmocka_failed);

/* Runs a cmocka group and returns the exit status for main. */
#define test_run_group(tests, setup, teardown) test_exit_status(cmocka_run_group_tests(tests, setup, teardown))

/* Reads a whole file into a malloc'd buffer; NULL on failure. */
void *read_whole_file(const char *path, size_t *size);
/* stderr goes to a temporary file and the log level is INFO from
 * test_log_capture_begin to test_log_capture_end, which restores both and
 * returns what was written (malloc'd; fails the test if it cannot). */
typedef struct test_log_capture {
    char path[64];
    int saved_stderr; /* dup of fd 2 */
    int saved_level;  /* ember_log_level */
} test_log_capture;
void test_log_capture_begin(test_log_capture *c);
char *test_log_capture_end(test_log_capture *c);
/* A whole file parsed as JSON; fails the current test when the file is
 * missing or not JSON. The caller frees it with cJSON_Delete. */
struct cJSON;
struct cJSON *test_load_json(const char *path);
/* The prompt ids of a reference fixture (reference/NAME.json, prompt.ids)
 * into ids; their count, or 0 when the fixture is absent (the caller
 * skips). Fails the test on a file with none or more than cap. */
int test_load_prompt_ids(const char *name, int32_t *ids, int cap);

/* A greedy 16-token /v1/completions of prompt on a test server: the text
 * (malloc'd), prompt tokens and cached tokens; fails the test on an error. */
typedef struct test_completion {
    char *text;
    int prompt_tokens, cached;
} test_completion;
test_completion test_complete(int port, const char *prompt);
/* One numeric field of the server's /v1/cache/stats (0 for a string). */
double test_cache_stat(int port, const char *key);

/* The test program's private XDG_CACHE_HOME (set before main, removed at
 * exit; see test_util.c), or NULL when none could be made (then APC_DISK=0
 * keeps spawned servers off the disk). */
const char *test_cache_home(void);

/* A fresh temporary directory (removed by the caller with remove_tree). */
char *make_temp_dir(void);
void remove_tree(const char *path);

/* Runs a shell command; returns its exit status (-1: killed) and its stdout
 * in *out (malloc'd). */
int run_capture(const char *cmd, char **out);

/* Path of the ember binary and of the build directory (from the environment
 * set by CTest), or NULL. */
const char *ember_binary(void);
const char *build_dir(void);

/* A deterministic stream for tests (xorshift64 over *state; never 0). */
uint32_t test_rand(uint64_t *state);
/* n token ids in [0, vocab) drawn from *state. */
void test_random_tokens(uint64_t *state, int32_t *t, int64_t n, int vocab);

struct engine_result;
struct engine;
struct engine_config;
struct model;

/* Loads a model file; fails the current test with the loader's message. */
struct model *test_load_model(const char *path);

/* engine_create(m, cfg); fails the current test with its message. Each test
 * builds its own config from engine_default_config(). */
struct engine *test_open_engine(const struct model *m, const struct engine_config *cfg);

/* Fails the current test when any KV block of the engine's pool is still
 * referenced (call after releasing every request and cache record). */
void test_assert_no_block_leaks(struct engine *e);

/* The engine's cache counters (apc_get_stats), by value. */
apc_stats test_cache_stats(struct engine *e);

/* One greedy request of max_tokens through engine_generate with the given
 * cache mode, keeping every step's logits; fails the test on error. */
void test_generate(struct engine *e, const int32_t *prompt, int64_t n, int max_tokens, int cache_mode,
                   struct engine_result *r);
/* Fails the current test unless `warm` generated the same tokens as `cold`
 * with bit-identical logits at every step (design.md invariant 1). Both
 * results must have been produced with want_logits. */
void assert_warm_equals_cold(const struct engine_result *cold, const struct engine_result *warm, const char *what);

#endif
