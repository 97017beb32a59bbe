/* log.c - leveled logging (see log.h). The level is read lazily from the
 * environment once; a mutex keeps lines from different threads whole. */
#include "core/log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int log_level = -1;
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;

static ember_log_level level_from_env(void) {
    const char *v = getenv("EMBER_LOG");
    if (v == NULL) return EMBER_LOG_INFO;
    if (strcmp(v, "debug") == 0) return EMBER_LOG_DEBUG;
    if (strcmp(v, "warn") == 0) return EMBER_LOG_WARN;
    if (strcmp(v, "error") == 0) return EMBER_LOG_ERROR;
    if (strcmp(v, "silent") == 0) return EMBER_LOG_SILENT;
    return EMBER_LOG_INFO;
}

ember_log_level ember_log_get_level(void) {
    if (log_level < 0) log_level = level_from_env();
    return (ember_log_level)log_level;
}

void ember_log_set_level(ember_log_level level) { log_level = level; }

void ember_log(ember_log_level level, const char *fmt, ...) {
    if (level < ember_log_get_level()) return;
    static const char *names[] = {"debug", "info", "warn", "error"};
    va_list ap;
    va_start(ap, fmt);
    pthread_mutex_lock(&log_lock);
    fprintf(stderr, "ember %s: ", names[level]);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    pthread_mutex_unlock(&log_lock);
    va_end(ap);
}
