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

/* Path of the ember binary and of the build directory (from the environment
 * set by CTest), or NULL. */
const char *ember_binary(void);
const char *build_dir(void);

#endif
