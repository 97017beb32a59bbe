/* log.h - leveled logging to stderr.
 *
 * Contract: one line per call, prefixed with the level. The threshold comes
 * from EMBER_LOG (debug|info|warn|error, default info) or ember_log_set_level.
 * Logging is for events an operator wants to see (the cache tier chosen for a
 * model, pool sizes); errors that a caller must handle travel as ember_error. */
#ifndef EMBER_CORE_LOG_H
#define EMBER_CORE_LOG_H

typedef enum ember_log_level {
    EMBER_LOG_DEBUG = 0,
    EMBER_LOG_INFO = 1,
    EMBER_LOG_WARN = 2,
    EMBER_LOG_ERROR = 3,
    EMBER_LOG_SILENT = 4,
} ember_log_level;

void ember_log(ember_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
void ember_log_set_level(ember_log_level level);
ember_log_level ember_log_get_level(void);

#endif
