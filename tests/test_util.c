/* test_util.c - fixture lookup and small file helpers for tests. */
#define _GNU_SOURCE
#include "test_util.h"

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

const char *fixture_path(const char *relative) {
    static char bufs[8][1024];
    static int next;
    const char *root = getenv("EMBER_FIXTURES");
    if (root == NULL) root = "../shared/fixtures";
    char *buf = bufs[next++ % 8];
    snprintf(buf, sizeof bufs[0], "%s/%s", root, relative);
    if (access(buf, R_OK) != 0) {
        print_message("skipping: fixture %s not found (set EMBER_FIXTURES)\n", buf);
        return NULL;
    }
    return buf;
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

const char *ember_binary(void) { return getenv("EMBER_BIN"); }
const char *build_dir(void) { return getenv("EMBER_BUILD_DIR"); }
