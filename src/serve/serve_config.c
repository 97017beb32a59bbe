/* serve_config.c - defaults, ember.yaml (libyaml), environment (see
 * serve_config.h).
 *
 * The YAML file is first read into a small tree (mappings, sequences,
 * scalars, each with its line) by libyaml's event parser; anchors and
 * aliases are refused. A table of known keys then walks the tree: each entry
 * names the dotted key, its type and the field it sets, so the file, the
 * environment and the error messages share one description of every
 * setting. */
#include "serve/serve_config.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <yaml.h>

#include "core/log.h"

/* ---- the settings table ---- */

typedef enum { K_STR, K_INT, K_BOOL, K_SIZE, K_DOUBLE, K_HASH } key_type;

typedef struct key_desc {
    const char *path;     /* "server.port" */
    const char *env;      /* "EMBER_PORT" */
    key_type type;
    size_t off;           /* offset in serve_config */
    size_t cap;           /* K_STR: buffer size */
    long lo, hi;          /* K_INT range */
} key_desc;

#define F(field) offsetof(serve_config, field)
#define S(field) sizeof(((serve_config *)0)->field)
static const key_desc keys[] = {
    {"server.host", "EMBER_HOST", K_STR, F(host), S(host), 0, 0},
    {"server.port", "EMBER_PORT", K_INT, F(port), 0, 0, 65535},
    {"server.api_key", "EMBER_API_KEY", K_STR, F(api_key), S(api_key), 0, 0},
    {"server.model_id", "EMBER_MODEL_ID", K_STR, F(model_id), S(model_id), 0, 0},
    {"server.ctx", "EMBER_CTX", K_INT, F(n_ctx), 0, 0, 1 << 24},
    {"server.threads", "EMBER_THREADS", K_INT, F(n_threads), 0, 0, 1024},
    {"server.prefill_step", "EMBER_PREFILL_STEP", K_INT, F(prefill_step), 0, 1, 1 << 16},
    {"server.max_running", "EMBER_MAX_RUNNING", K_INT, F(max_running), 0, 1, 4096},
    {"server.queue_size", "EMBER_QUEUE_SIZE", K_INT, F(queue_size), 0, 0, 1 << 20},
    {"server.max_body_bytes", "EMBER_MAX_BODY_BYTES", K_SIZE, F(max_body_bytes), 0, 0, 0},
    {"server.connection_limit", "EMBER_CONNECTION_LIMIT", K_INT, F(connection_limit), 0, 1, 1 << 16},
    {"server.per_ip_connection_limit", "EMBER_PER_IP_CONNECTION_LIMIT", K_INT, F(per_ip_connection_limit), 0, 0, 1 << 16},
    {"server.read_timeout", "EMBER_READ_TIMEOUT", K_INT, F(read_timeout), 0, 1, 3600},
    {"server.idle_timeout", "EMBER_IDLE_TIMEOUT", K_INT, F(idle_timeout), 0, 1, 86400},
    {"server.http_threads", "EMBER_HTTP_THREADS", K_INT, F(http_threads), 0, 1, 64},
    {"cache.enabled", "APC_ENABLED", K_BOOL, F(cache_enabled), 0, 0, 0},
    {"cache.block_size", "APC_BLOCK_SIZE", K_INT, F(block_size), 0, 1, 1 << 16},
    {"cache.num_blocks", "APC_NUM_BLOCKS", K_INT, F(num_blocks), 0, 0, INT_MAX},
    {"cache.exact_entries", "APC_EXACT_CACHE_ENTRIES", K_INT, F(exact_entries), 0, 0, 1 << 20},
    {"cache.hash", "APC_HASH", K_HASH, F(hash_xxh3), 0, 0, 0},
    {"cache.fresh_wait_ms", "APC_FRESH_WAIT_MS", K_INT, F(fresh_wait_ms), 0, 0, 60000},
    {"cache.fresh_min", "APC_FRESH_MIN", K_INT, F(fresh_min), 0, 1, 1 << 24},
    {"cache.disk.path", "APC_DISK_PATH", K_STR, F(disk_path), S(disk_path), 0, 0},
    {"cache.disk.max_gb", "APC_DISK_MAX_GB", K_DOUBLE, F(disk_max_gb), 0, 0, 0},
    {"cache.disk.workers", "APC_DISK_WORKERS", K_INT, F(disk_workers), 0, 1, 256},
    {"cache.disk.read_mode", "APC_DISK_READ_MODE", K_STR, F(disk_read_mode), S(disk_read_mode), 0, 0},
    {"cache.disk.namespace", "APC_DISK_NAMESPACE", K_STR, F(disk_namespace), S(disk_namespace), 0, 0},
};
#undef F
#undef S
#define N_KEYS (sizeof keys / sizeof keys[0])

void serve_config_defaults(serve_config *c) {
    memset(c, 0, sizeof *c);
    snprintf(c->host, sizeof c->host, "127.0.0.1");
    c->port = 8080;
    c->prefill_step = 512;
    c->max_running = 32;
    c->queue_size = 64;
    c->max_body_bytes = (size_t)4 << 20;
    c->connection_limit = 1024;
    c->per_ip_connection_limit = 256;
    c->read_timeout = 30;
    c->idle_timeout = 60;
    c->http_threads = 2;
    c->cache_enabled = true;
    c->block_size = 16;
    c->exact_entries = 4;
    c->fresh_wait_ms = 500;
    c->fresh_min = 256;
    c->disk_workers = 1;
    snprintf(c->disk_read_mode, sizeof c->disk_read_mode, "direct");
}

/* 1, 0, or -1 when text is not a boolean. */
static int parse_bool(const char *text) {
    if (!strcasecmp(text, "1") || !strcasecmp(text, "true") || !strcasecmp(text, "yes") || !strcasecmp(text, "on"))
        return 1;
    if (!strcasecmp(text, "0") || !strcasecmp(text, "false") || !strcasecmp(text, "no") ||
        !strcasecmp(text, "off") || text[0] == 0)
        return 0;
    return -1;
}

/* Parses text as the key's type into the field. Returns 0, or -1 with a
 * message "expected ..., got '...'". */
static int set_value(serve_config *c, const key_desc *k, const char *text, char *why, size_t why_cap) {
    char *p = (char *)c + k->off;
    char *end = NULL;
    switch (k->type) {
    case K_STR:
        if (strlen(text) >= k->cap) {
            snprintf(why, why_cap, "longer than %zu bytes", k->cap - 1);
            return -1;
        }
        memcpy(p, text, strlen(text) + 1);
        return 0;
    case K_INT: {
        errno = 0;
        long v = strtol(text, &end, 10);
        if (errno || end == text || *end || v < k->lo || v > k->hi) {
            snprintf(why, why_cap, "expected an integer in [%ld, %ld], got '%s'", k->lo, k->hi, text);
            return -1;
        }
        *(int *)p = (int)v;
        return 0;
    }
    case K_SIZE: {
        errno = 0;
        unsigned long long v = strtoull(text, &end, 10);
        if (errno || end == text || *end || text[0] == '-') {
            snprintf(why, why_cap, "expected a byte count, got '%s'", text);
            return -1;
        }
        *(size_t *)p = (size_t)v;
        return 0;
    }
    case K_DOUBLE: {
        errno = 0;
        double v = strtod(text, &end);
        if (errno || end == text || *end || !isfinite(v) || v < 0) {
            snprintf(why, why_cap, "expected a non-negative number, got '%s'", text);
            return -1;
        }
        *(double *)p = v;
        return 0;
    }
    case K_BOOL:
        if (parse_bool(text) >= 0) {
            *(bool *)p = parse_bool(text) == 1;
            return 0;
        }
        snprintf(why, why_cap, "expected a boolean (true/false), got '%s'", text);
        return -1;
    case K_HASH:
        if (!strcasecmp(text, "sha256")) *(bool *)p = false;
        else if (!strcasecmp(text, "xxh3") || !strcasecmp(text, "fast")) *(bool *)p = true;
        else {
            snprintf(why, why_cap, "expected sha256, xxh3 or fast, got '%s'", text);
            return -1;
        }
        return 0;
    }
    return -1;
}

/* ---- a small YAML tree ---- */

typedef enum { Y_SCALAR, Y_MAP, Y_SEQ } ynode_kind;

typedef struct ynode {
    ynode_kind kind;
    int line;
    char *value;               /* scalar text */
    bool quoted;
    struct ynode **kids;       /* map: key, value, key, value...; seq: items */
    int n_kids, cap_kids;
} ynode;

static void ynode_free(ynode *n) {
    if (n == NULL) return;
    for (int i = 0; i < n->n_kids; i++) ynode_free(n->kids[i]);
    free(n->kids);
    free(n->value);
    free(n);
}

static int ynode_add(ynode *parent, ynode *kid) {
    if (parent->n_kids == parent->cap_kids) {
        int cap = parent->cap_kids ? parent->cap_kids * 2 : 8;
        ynode **k = realloc(parent->kids, (size_t)cap * sizeof *k);
        if (k == NULL) return -1;
        parent->kids = k;
        parent->cap_kids = cap;
    }
    parent->kids[parent->n_kids++] = kid;
    return 0;
}

/* Builds the tree of the first document (*out NULL for an empty one). */
static int yaml_tree(const char *text, size_t len, const char *name, ynode **out, ember_error *err) {
    yaml_parser_t parser;
    *out = NULL;
    if (!yaml_parser_initialize(&parser)) return ember_fail(err, "%s: cannot start the YAML parser", name);
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    ynode *stack[64];
    int depth = 0;
    ynode *root = NULL;
    bool done = false, failed = false;
    while (!done && !failed) {
        yaml_event_t ev;
        if (!yaml_parser_parse(&parser, &ev)) {
            ember_fail(err, "%s:%zu: malformed YAML: %s%s%s", name, parser.problem_mark.line + 1,
                       parser.problem ? parser.problem : "syntax error", parser.context ? " " : "",
                       parser.context ? parser.context : "");
            failed = true;
            break;
        }
        int line = (int)ev.start_mark.line + 1;
        ynode *n = NULL;
        switch (ev.type) {
        case YAML_SCALAR_EVENT:
        case YAML_MAPPING_START_EVENT:
        case YAML_SEQUENCE_START_EVENT:
            n = calloc(1, sizeof *n);
            if (n == NULL) {
                ember_fail(err, "%s: out of memory", name);
                failed = true;
                break;
            }
            n->line = line;
            if (ev.type == YAML_SCALAR_EVENT) {
                n->kind = Y_SCALAR;
                n->value = strndup((const char *)ev.data.scalar.value, ev.data.scalar.length);
                n->quoted = ev.data.scalar.style == YAML_SINGLE_QUOTED_SCALAR_STYLE ||
                            ev.data.scalar.style == YAML_DOUBLE_QUOTED_SCALAR_STYLE;
            } else {
                n->kind = ev.type == YAML_MAPPING_START_EVENT ? Y_MAP : Y_SEQ;
            }
            if (depth == 0) {
                if (root == NULL) root = n;
                else ynode_free(n);
            } else if (ynode_add(stack[depth - 1], n) < 0) {
                ynode_free(n);
                ember_fail(err, "%s: out of memory", name);
                failed = true;
                break;
            }
            if (n->kind != Y_SCALAR) {
                if (depth == 64) {
                    ember_fail(err, "%s:%d: nesting too deep", name, line);
                    failed = true;
                    break;
                }
                stack[depth++] = n;
            }
            break;
        case YAML_MAPPING_END_EVENT:
        case YAML_SEQUENCE_END_EVENT:
            if (depth > 0) depth--;
            break;
        case YAML_ALIAS_EVENT:
            ember_fail(err, "%s:%d: YAML aliases are not supported", name, line);
            failed = true;
            break;
        case YAML_DOCUMENT_END_EVENT:
        case YAML_STREAM_END_EVENT:
            done = true;
            break;
        default:
            break;
        }
        yaml_event_delete(&ev);
    }
    yaml_parser_delete(&parser);
    if (failed) {
        ynode_free(root);
        return -1;
    }
    *out = root;
    return 0;
}

static const key_desc *find_key(const char *path) {
    for (size_t i = 0; i < N_KEYS; i++)
        if (strcmp(keys[i].path, path) == 0) return &keys[i];
    return NULL;
}

static bool is_block(const char *path) {
    return !strcmp(path, "server") || !strcmp(path, "cache") || !strcmp(path, "cache.disk");
}

static const char *kind_name(ynode_kind k) { return k == Y_MAP ? "a mapping" : k == Y_SEQ ? "a list" : "a scalar"; }

static int apply_map(serve_config *c, const ynode *map, const char *prefix, const char *name, ember_error *err) {
    for (int i = 0; i + 1 < map->n_kids; i += 2) {
        const ynode *k = map->kids[i], *v = map->kids[i + 1];
        if (k->kind != Y_SCALAR)
            return ember_fail(err, "%s:%d: %s: keys must be plain names", name, k->line, prefix[0] ? prefix : "(top)");
        char path[256];
        snprintf(path, sizeof path, "%s%s%s", prefix, prefix[0] ? "." : "", k->value);
        if (is_block(path)) {
            /* disk: true|false is shorthand (reference §2.1). */
            if (!strcmp(path, "cache.disk") && v->kind == Y_SCALAR && v->value[0]) {
                int on = parse_bool(v->value);
                if (on < 0)
                    return ember_fail(err, "%s:%d: cache.disk: expected a mapping or a boolean, got '%s'", name,
                                      v->line, v->value);
                if (on) {
                    const char *home = getenv("HOME");
                    snprintf(c->disk_path, sizeof c->disk_path, "%s/.cache/ember/apc", home ? home : ".");
                } else {
                    c->disk_path[0] = 0;
                }
                continue;
            }
            if (v->kind == Y_SCALAR && v->value[0] == 0 && !v->quoted) continue; /* "server:" with nothing under */
            if (v->kind != Y_MAP)
                return ember_fail(err, "%s:%d: %s: expected a mapping, got %s", name, v->line, path, kind_name(v->kind));
            if (apply_map(c, v, path, name, err) < 0) return -1;
            continue;
        }
        const key_desc *d = find_key(path);
        if (d == NULL) {
            ember_log(EMBER_LOG_WARN, "%s:%d: unknown key '%s' ignored (check the spelling)", name, k->line, path);
            continue;
        }
        if (v->kind != Y_SCALAR)
            return ember_fail(err, "%s:%d: %s: expected a value, got %s", name, v->line, path, kind_name(v->kind));
        if (d->type != K_STR && v->quoted && d->type != K_HASH)
            return ember_fail(err, "%s:%d: %s: expected %s, got the string \"%s\"", name, v->line, path,
                              d->type == K_BOOL ? "a boolean" : "a number", v->value);
        char why[300];
        if (set_value(c, d, v->value, why, sizeof why) < 0)
            return ember_fail(err, "%s:%d: %s: %s", name, v->line, path, why);
    }
    return 0;
}

int serve_config_load_string(serve_config *c, const char *yaml, size_t len, const char *name, ember_error *err) {
    ynode *root;
    if (yaml_tree(yaml, len, name, &root, err) < 0) return -1;
    if (root == NULL) return 0; /* an empty file is an empty config */
    int rc = 0;
    if (root->kind == Y_SCALAR && root->value[0] == 0) rc = 0;
    else if (root->kind != Y_MAP)
        rc = ember_fail(err, "%s:%d: expected a mapping with server: and cache: blocks, got %s", name, root->line,
                        kind_name(root->kind));
    else
        rc = apply_map(c, root, "", name, err);
    ynode_free(root);
    return rc;
}

int serve_config_load_file(serve_config *c, const char *path, ember_error *err) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return ember_fail(err, "%s: %s", path, strerror(errno));
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (got == 0) break;
        if (len == cap) {
            char *nb = realloc(buf, cap * 2);
            if (nb == NULL) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf == NULL) return ember_fail(err, "%s: out of memory", path);
    int rc = serve_config_load_string(c, buf, len, path, err);
    free(buf);
    return rc;
}

int serve_config_apply_env(serve_config *c, ember_error *err) {
    for (size_t i = 0; i < N_KEYS; i++) {
        const char *v = getenv(keys[i].env);
        if (v == NULL) continue;
        char why[300];
        if (set_value(c, &keys[i], v, why, sizeof why) < 0)
            return ember_fail(err, "environment %s (%s): %s", keys[i].env, keys[i].path, why);
    }
    return 0;
}

int serve_config_validate(const serve_config *c, ember_error *err) {
    if (c->block_size != 16)
        return ember_fail(err, "cache.block_size: %d is not supported; ember's KV blocks hold 16 tokens", c->block_size);
    if (c->host[0] == 0) return ember_fail(err, "server.host: empty");
    if (c->max_body_bytes < 1024) return ember_fail(err, "server.max_body_bytes: at least 1024");
    if (strcmp(c->disk_read_mode, "direct") != 0 && strcmp(c->disk_read_mode, "mmap") != 0)
        return ember_fail(err, "cache.disk.read_mode: '%s' is not one of direct, mmap", c->disk_read_mode);
    if (c->disk_max_gb < 0) return ember_fail(err, "cache.disk.max_gb: must not be negative");
    return 0;
}
