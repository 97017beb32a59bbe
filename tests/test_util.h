/* test_util.h - shared helpers for ember's cmocka tests.
 *
 * Fixtures live outside the repository (../shared/fixtures, read-only); a
 * test that needs one calls fixture_path(), which returns NULL when the file
 * is absent, and then skips with a message naming the missing path. */
#ifndef EMBER_TEST_UTIL_H
#define EMBER_TEST_UTIL_H

#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

/* Full path of a fixture under $EMBER_FIXTURES, or NULL (with a printed
 * "skipping: ... not found" note) when it does not exist. Static buffer
 * rotation: valid for the next 7 calls. */
const char *fixture_path(const char *relative);

/* Skips the current test when path is NULL. */
#define REQUIRE_FIXTURE(var, rel)          \
    const char *var = fixture_path(rel);   \
    if (var == NULL) {                     \
        skip();                            \
        return;                            \
    }

/* Reads a whole file into a malloc'd buffer; NULL on failure. */
void *read_whole_file(const char *path, size_t *size);

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

/* Fails the current test unless `warm` generated the same tokens as `cold`
 * with bit-identical logits at every step (design.md invariant 1). Both
 * results must have been produced with want_logits. */
struct engine_result;
struct engine;
/* One greedy request of max_tokens through engine_generate with the given
 * cache mode, keeping every step's logits; fails the test on error. */
void test_generate(struct engine *e, const int32_t *prompt, int64_t n, int max_tokens, int cache_mode,
                   struct engine_result *r);
void assert_warm_equals_cold(const struct engine_result *cold, const struct engine_result *warm, const char *what);

#endif
