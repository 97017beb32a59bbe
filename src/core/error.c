/* error.c - formatting of ember_error messages (see error.h). */
#include "core/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int ember_fail(ember_error *err, const char *fmt, ...) {
    if (err == NULL) return -1;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    return -1;
}

int ember_fail_prefix(ember_error *err, const char *fmt, ...) {
    if (err == NULL) return -1;
    char prefix[256], old[sizeof err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, err->msg, sizeof old);
    /* Truncation is acceptable: the message stays NUL-terminated. */
    size_t n = strnlen(prefix, sizeof prefix);
    memcpy(err->msg, prefix, n);
    size_t at = n;
    if (at + 2 < sizeof err->msg) {
        err->msg[at++] = ':';
        err->msg[at++] = ' ';
    }
    size_t rest = strnlen(old, sizeof old);
    if (rest > sizeof err->msg - 1 - at) rest = sizeof err->msg - 1 - at;
    memcpy(err->msg + at, old, rest);
    err->msg[at + rest] = '\0';
    return -1;
}
