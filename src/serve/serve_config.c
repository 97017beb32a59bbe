/* serve_config.c - ember.yaml (libyaml) over the settings table, and the
 * step from serve_config to engine_config (see serve_config.h).
 *
 * The YAML file is first read into a small tree (mappings, sequences,
 * scalars, each with its line) by libyaml's event parser; anchors and
 * aliases are refused. The tree is then walked against the settings table
 * (serve_settings.c): a dotted path that some key starts with is a block, a
 * path that is a key is a value parsed by the table's setter, anything else
 * is an unknown key. So the file, the environment, the flags and the error
 * messages share one description of every setting. */
#include "serve/serve_config.h"
#include "serve/serve_disk_cap.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <yaml.h>

#include "core/log.h"

void serve_config_defaults(serve_config *c) { serve_settings_defaults(c); }

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
                /* "\0" is a valid YAML escape; every setting is a C string */
                if (memchr(ev.data.scalar.value, 0, ev.data.scalar.length) != NULL) {
                    free(n);
                    ember_fail(err, "%s:%d: a value holds U+0000 (\\0), which no setting may contain", name, line);
                    failed = true;
                    break;
                }
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

/* A block is a path that some key continues: "cache" of "cache.disk.path". */
static bool is_block(const char *path) {
    size_t n, len = strlen(path);
    const serve_setting *t = serve_settings(&n);
    for (size_t i = 0; i < n; i++)
        if (strncmp(t[i].key, path, len) == 0 && t[i].key[len] == '.') return true;
    return false;
}

int serve_user_cache_dir(char *out, size_t cap) {
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    int n;
    if (xdg && xdg[0] == '/')
        n = snprintf(out, cap, "%s/ember", xdg);
    else if (home && home[0])
        n = snprintf(out, cap, "%s/.cache/ember", home);
    else
        n = snprintf(out, cap, "./.ember-cache");
    return n < 0 || (size_t)n >= cap ? -1 : 0;
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
            /* disk: true|false is shorthand (reference §2.1) for
             * cache.disk.enabled; the path stays the per-user default or
             * whatever an earlier line set. */
            if (!strcmp(path, "cache.disk") && v->kind == Y_SCALAR && v->value[0]) {
                int on = serve_settings_parse_bool(v->value);
                if (on < 0)
                    return ember_fail(err, "%s:%d: cache.disk: expected a mapping or a boolean, got '%s'", name,
                                      v->line, v->value);
                char why[300];
                if (serve_setting_set(c, serve_setting_by_key("cache.disk.enabled"), on ? "true" : "false",
                                      SETTING_FROM_FILE, why, sizeof why) < 0)
                    return ember_fail(err, "%s:%d: cache.disk: %s", name, v->line, why);
                continue;
            }
            if (v->kind == Y_SCALAR && v->value[0] == 0 && !v->quoted) continue; /* "server:" with nothing under */
            if (v->kind != Y_MAP)
                return ember_fail(err, "%s:%d: %s: expected a mapping, got %s", name, v->line, path, kind_name(v->kind));
            if (apply_map(c, v, path, name, err) < 0) return -1;
            continue;
        }
        const serve_setting *d = serve_setting_by_key(path);
        if (d == NULL) {
            ember_log(EMBER_LOG_WARN, "%s:%d: unknown key '%s' ignored (check the spelling)", name, k->line, path);
            continue;
        }
        if (v->kind != Y_SCALAR)
            return ember_fail(err, "%s:%d: %s: expected a value, got %s", name, v->line, path, kind_name(v->kind));
        bool textual = d->type == SETTING_STR || d->type == SETTING_HASH || d->type == SETTING_FORCE;
        if (!textual && v->quoted)
            return ember_fail(err, "%s:%d: %s: expected %s, got the string \"%s\"", name, v->line, path,
                              d->type == SETTING_BOOL ? "a boolean" : "a number", v->value);
        char why[300];
        if (serve_setting_set(c, d, v->value, SETTING_FROM_FILE, why, sizeof why) < 0)
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

int serve_config_apply_env(serve_config *c, ember_error *err) { return serve_settings_apply_env(c, err); }

int serve_config_validate(const serve_config *c, ember_error *err) {
    if (c->block_size != 16)
        return ember_fail(err, "cache.block_size: %d is not supported; ember's KV blocks hold 16 tokens", c->block_size);
    if (c->host[0] == 0) return ember_fail(err, "server.host: empty");
    kv_format kvf;
    if (kv_format_parse(c->kv_format, &kvf) < 0)
        return ember_fail(err, "cache.kv_format: expected %s (K and V 2..8 bits, TAIL 0..1048576), got '%s'",
                          KV_FORMAT_CHOICES, c->kv_format);
    if (kv_format_is_kvarn(kvf) && serve_config_spec_kind(c) != SPEC_OFF)
        return ember_fail(err, "cache.kv_format %s: speculative decoding (server.spec_mode) does not combine with kvarn",
                          c->kv_format);
    if (c->max_body_bytes < 1024) return ember_fail(err, "server.max_body_bytes: at least 1024");
    if (serve_config_spec_kind(c) == SPEC_DRAFT && c->draft[0] == 0)
        return ember_fail(err, "spec.mode: draft needs a draft model (server.draft, --draft GGUF)");
    if (!(c->memory_share > 0 && c->memory_share <= 1))
        return ember_fail(err, "cache.memory_share: %g is not in (0, 1] (the share of available memory for the KV pool)",
                          c->memory_share);
    if (c->remote_url[0]) {
        if (apc_remote_check_url(c->remote_url, err) < 0) return ember_fail_prefix(err, "cache.remote.url: ");
    }
    if (c->cache.remote.min_wait_ms > c->cache.remote.max_wait_ms)
        return ember_fail(err, "cache.remote.min_wait_ms (%d) is above cache.remote.max_wait_ms (%d)",
                          c->cache.remote.min_wait_ms, c->cache.remote.max_wait_ms);
    return 0;
}

int serve_config_finish(serve_config *c, ember_error *err) {
    if (c->disk_path[0]) return 0;
    char base[sizeof c->disk_path];
    if (serve_user_cache_dir(base, sizeof base - 4) < 0 ||
        snprintf(c->disk_path, sizeof c->disk_path, "%s/apc", base) >= (int)sizeof c->disk_path) {
        c->disk_path[0] = 0;
        return ember_fail(err, "cache.disk.path: the per-user cache directory's path is too long; set cache.disk.path "
                          "or turn the tier off (cache.disk.enabled: false)");
    }
    return 0;
}

spec_kind serve_config_spec_kind(const serve_config *c) {
    if (!strcmp(c->spec_mode, "lookup")) return SPEC_LOOKUP;
    if (!strcmp(c->spec_mode, "draft")) return SPEC_DRAFT;
    if (!strcmp(c->spec_mode, "mtp")) return SPEC_MTP;
    if (!strcmp(c->spec_mode, "auto") && c->draft[0]) return SPEC_DRAFT;
    return SPEC_OFF;
}

void serve_config_engine(const serve_config *c, engine_config *ec) {
    *ec = engine_default_config();
    ec->n_threads = c->n_threads;
    ec->prefill_step = c->prefill_step;
    if (!attention_precision_parse(c->attention_precision, &ec->attention)) ec->attention = ATTENTION_F32;
    ec->n_ctx = c->n_ctx;
    ec->num_blocks = c->num_blocks;
    ec->spec.kind = serve_config_spec_kind(c);
    ec->spec.k = c->spec_k;
    ec->spec.adaptive = c->spec_adaptive;
    ec->spec.ngram_max = c->spec_ngram_max;
    ec->spec.ngram_min = 1;
    ec->spec.sidecar_entries = c->spec_sidecar_entries;
    ec->spec.sidecar_bytes = c->spec_sidecar_bytes;
    ec->spec.sidecar_memory_only = !c->spec_sidecar_mirror;
    ec->spec.prefix_entries = c->spec_prefix_entries;
    ec->spec.prefix_bytes = c->spec_prefix_bytes;
    ec->spec.prefix_min = c->spec_prefix_min;
    if (kv_format_parse(c->kv_format, &ec->kv_format) < 0) ec->kv_format = (kv_format){KV_FORMAT_F32};
    apc_disk_config disk = ec->cache.disk;
    ec->cache = c->cache;
    ec->cache.disk = disk;
    if (!c->cache.enabled) ec->cache.force_tier = APC_FORCE_OFF;
    ec->cache.remote.url = c->remote_url[0] ? c->remote_url : NULL;
    if (c->disk_enabled && c->disk_path[0]) {
        ec->cache.disk.path = c->disk_path;
        /* Nobody chose the default path: if it cannot open, say so and serve
         * from memory. A path the operator wrote must work unless they said
         * the tier is optional. */
        setting_source src = (setting_source)c->source[serve_setting_index(serve_setting_by_key("cache.disk.path"))];
        ec->cache.disk.optional = c->disk_optional || src == SETTING_FROM_DEFAULT;
        char why[256];
        ec->cache.disk.max_bytes = serve_disk_cap_resolve(c->disk_max_gb, c->disk_path, why, sizeof why);
        ember_log(EMBER_LOG_INFO, "APC disk tier size %s", why);
        ec->cache.disk.workers = c->disk_workers;
        ec->cache.disk.read_mode = strcmp(c->disk_read_mode, "mmap") == 0 ? APC_DISK_READ_MMAP : APC_DISK_READ_DIRECT;
        ec->cache.disk.namespace_override = c->disk_namespace[0] ? c->disk_namespace : NULL;
    }
}
