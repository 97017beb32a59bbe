/* serve_settings.h - the one table of ember's settings.
 *
 * Contract:
 *  - Every setting is one row: its config-file key ("cache.ckpt.interval"),
 *    its environment variable (EMBER_APC_CKPT_INTERVAL), its flag
 *    (--ckpt-interval), its type and bounds, its default (as text), a
 *    one-line help and the field of serve_config it writes. The config file
 *    (serve_config.c), the environment, the flags, `ember --help`, the man
 *    page and docs/cache-switches.md all read this table; nothing else
 *    describes a setting.
 *  - Precedence, lowest first: the defaults of the table, the YAML file
 *    (--config), the environment, the flags. Each layer only overrides the
 *    settings it names; serve_config remembers which layer set each one.
 *  - A value that does not parse or is out of range is an error naming the
 *    setting and where it came from ("environment EMBER_PORT (server.port):
 *    expected an integer in [0, 65535], got 'abc'"). Nothing here exits or
 *    prints an error.
 *  - The prompt cache (src/apc) reads no environment: its switches are rows
 *    whose field lies inside serve_config.cache (an apc_config). In-process
 *    users of the engine (tests, benches) that want the EMBER_APC_* and
 *    APC_* variables call serve_settings_apply_env_cache on their config.
 *
 * Adding a setting: add the field (to serve_config, or to apc_config when
 * the cache owns it) and one row to the table in serve_settings.c, then
 * regenerate the doc (`make docs`); test_settings fails until the doc
 * matches. */
#ifndef EMBER_SERVE_SETTINGS_H
#define EMBER_SERVE_SETTINGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "apc/apc.h"
#include "core/error.h"

typedef enum setting_type {
    SETTING_STR,     /* text into a char buffer; `choices` restricts it when set */
    SETTING_INT,     /* int in [lo, hi] */
    SETTING_BOOL,    /* 1/true/yes/on, 0/false/no/off/"" */
    SETTING_BYTES,   /* size_t byte count */
    SETTING_DOUBLE,  /* non-negative number */
    SETTING_MIB,     /* size_t bytes, written in MiB within [lo, hi] */
    SETTING_HASH,    /* apc_hash_kind: sha256 | xxh3 | fast (= xxh3) */
    SETTING_FORCE,   /* apc_force: exact | block | off | "" (routing decides) */
} setting_type;

/* Which struct a row's field lives in. */
typedef enum setting_home {
    SETTING_IN_SERVER, /* serve_config */
    SETTING_IN_CACHE,  /* serve_config.cache, an apc_config */
} setting_home;

/* Where the current value of a setting came from, lowest first. */
typedef enum setting_source {
    SETTING_FROM_DEFAULT = 0,
    SETTING_FROM_FILE,
    SETTING_FROM_ENV,
    SETTING_FROM_FLAG,
} setting_source;

typedef struct serve_setting {
    const char *key;      /* config-file key, dotted: "server.port" */
    const char *env;      /* environment variable: "EMBER_PORT" */
    const char *flag;     /* flag without dashes: "port" (--port; booleans also --no-port) */
    setting_type type;
    const char *def;      /* default, in the syntax of a value */
    long lo, hi;          /* SETTING_INT, SETTING_MIB bounds */
    const char *choices;  /* SETTING_STR: "direct|mmap", or NULL for any text; SETTING_DOUBLE: a word
                           * ("auto") that stands for the automatic value, stored as -1 */
    const char *metavar;  /* the value's name in --help, or NULL for one from the type */
    const char *help;     /* one line */
    const char *detail;   /* more for the doc and the man page, or NULL */
    bool secret;          /* never shown (api_key) */
    setting_home home;
    size_t off, cap;      /* field offset in its home; cap: SETTING_STR buffer size */
} serve_setting;

/* The largest number of rows the table may hold (serve_config keeps one
 * source per row). */
#define SERVE_SETTINGS_MAX 96

struct serve_config;

/* ---- The table ---- */
const serve_setting *serve_settings(size_t *n);
const serve_setting *serve_setting_by_key(const char *key);
/* name without dashes; *negated set for "no-<flag>" of a boolean. */
const serve_setting *serve_setting_by_flag(const char *name, bool *negated);
size_t serve_setting_index(const serve_setting *s);
/* The value's name in help: metavar, or one from the type ("N", "TEXT"). */
const char *serve_setting_metavar(const serve_setting *s);
const char *setting_source_name(setting_source src);

/* ---- Applying values ---- */
/* 1 for 1/true/yes/on, 0 for 0/false/no/off/"", -1 for anything else. */
int serve_settings_parse_bool(const char *text);
/* Parses text into the setting's field of c and records src. -1 with
 * "expected ..., got '...'" in why (no key or source: the caller adds them). */
int serve_setting_set(struct serve_config *c, const serve_setting *s, const char *text, setting_source src, char *why,
                      size_t why_cap);
/* Every row's default; the rest of serve_config zero. */
void serve_settings_defaults(struct serve_config *c);
/* Every variable of the table that is set. Errors name the variable and the key. */
int serve_settings_apply_env(struct serve_config *c, ember_error *err);
/* One flag (value NULL: a boolean switch, true unless negated). */
int serve_settings_apply_flag(struct serve_config *c, const serve_setting *s, const char *value, bool negated,
                              ember_error *err);
/* The cache's rows only, from the environment, onto an apc_config (for
 * in-process engines: tests and benches). */
int serve_settings_apply_env_cache(apc_config *cache, ember_error *err);

/* ---- Showing them ---- */
/* The current value as text ("(set)" for a secret that is set). */
void serve_setting_format(const struct serve_config *c, const serve_setting *s, char *buf, size_t cap);
/* docs/cache-switches.md, exactly. */
void serve_settings_write_markdown(FILE *out);
/* The SETTINGS section of the man page (troff), without its .SH line. */
void serve_settings_write_troff(FILE *out);
/* One entry per row for --help, indented two spaces. */
void serve_settings_write_help(FILE *out);
/* Text for troff: backslashes and dashes escaped, backticks dropped, no
 * control character at the start of a line. */
void serve_settings_troff_text(FILE *out, const char *text);
/* The precedence rule, one sentence, for help texts. */
extern const char serve_settings_precedence[];

#endif
