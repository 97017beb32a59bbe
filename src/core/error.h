/* error.h - how ember libraries report failure.
 *
 * Contract: a function that can fail returns -1 (or NULL) and, when the caller
 * passed a non-NULL ember_error, fills it with one line naming what went wrong
 * and where (a file offset, a field, a key). Libraries never print errors; the
 * command line and the server decide what to show. The message buffer is part
 * of the struct so that reporting an error never allocates. */
#ifndef EMBER_CORE_ERROR_H
#define EMBER_CORE_ERROR_H

#include <stddef.h>

typedef struct ember_error {
    char msg[512];
} ember_error;

/* Formats the message into err (if non-NULL) and returns -1, so that error
 * paths read `return ember_fail(err, "...", ...);`. */
int ember_fail(ember_error *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Prefixes an existing message with context ("loading x.gguf: ..."). */
int ember_fail_prefix(ember_error *err, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif
