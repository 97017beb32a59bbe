/* serve_config.h - the settings of `ember serve` and where they come from.
 *
 * Contract:
 *  - Every setting is a row of the table in serve_settings.c (key, variable,
 *    flag, type, default, help); this struct holds their values.
 *    Precedence, lowest first: the table's defaults, the YAML file
 *    (--config ember.yaml), the environment, command-line flags. Each layer
 *    only overrides the keys it names. docs/cache-switches.md lists them all.
 *  - The file has two top-level blocks, `server:` and `cache:` (with
 *    `cache.disk`, `cache.remote`, `cache.ckpt` and `cache.anchor` below it; `disk` may also
 *    be a boolean). An unknown key is a loud warning naming it and its line;
 *    a malformed file or a value of the wrong type is an error naming the key
 *    and the line ("ember.yaml:7: server.port: expected an integer, got
 *    'abc'").
 *  - The cache is on by default, and so is its SSD tier: under
 *    cache.disk.path, by default the per-user directory
 *    (serve_user_cache_dir() + "/apc"), with the automatic size cap
 *    (serve_disk_cap.h); cache.disk.enabled: false (`disk: false`,
 *    --no-disk, APC_DISK=0) turns it off. A tier that cannot open stops
 *    the start-up when its path was configured, unless cache.disk.optional;
 *    at the default path it is a warning. serve_config_engine turns the
 *    whole struct into an engine_config. */
#ifndef EMBER_SERVE_CONFIG_H
#define EMBER_SERVE_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "apc/apc.h"
#include "core/error.h"
#include "engine/engine.h"
#include "serve/serve_settings.h"

typedef struct serve_config {
    /* server: */
    char host[256];
    int port;                 /* 0: any free port (logged) */
    char api_key[256];        /* "": no authentication */
    char api_keys_file[512];  /* "": no keys file (serve_tenant.h) */
    bool trusted_tenant_header; /* tenant headers are set by a trusted proxy */
    char tenant_secret_file[512]; /* "": beside cache.disk.path, else the per-user cache directory */
    int default_max_tokens;   /* reply length without max_tokens; 0: the rest of the context */
    char model_id[128];       /* "": the model file's base name */
    int n_ctx;                /* 0: min(training context, 4096) */
    int n_threads;            /* 0: all CPUs */
    int prefill_step;         /* grid chunk, default 512 */
    char attention_precision[8]; /* "f32" | "bf16" | "int8" (ops.h attention_precision) */
    int max_running;          /* sequences decoded together, default 32 */
    int queue_size;           /* waiting requests before 503, default 64 */
    int fresh_wait_ms;        /* freshness gate hold ceiling, default 500; 0: off (reference §14.1) */
    int fresh_min;            /* least shared uncached tokens to hold a sibling, default 256 */
    int disk_wait_ms;         /* longest wait of a request for its SSD reads, default 1000 */
    size_t max_body_bytes;    /* larger bodies get 413, default 4 MiB */
    int connection_limit;     /* open HTTP connections before 503, default 1024 */
    int per_ip_connection_limit; /* open connections of one client address before 503; 0: none; default 256 */
    int read_timeout;         /* seconds to deliver a whole request (head + body) after connecting or the
                                 previous answer, default 30 */
    int idle_timeout;         /* seconds of silence before a connection is closed, default 60 */
    int http_threads;         /* event-loop threads of the HTTP layer, default 2 */
    char draft[512];          /* draft model path, or empty */
    /* speculative decoding */
    char spec_mode[16];       /* auto|off|lookup|draft|mtp */
    int spec_k;
    bool spec_adaptive;
    int spec_ngram_max;
    int spec_sidecar_entries;
    size_t spec_sidecar_bytes;
    bool spec_sidecar_mirror; /* the sidecar's SSD / remote mirror */
    int spec_prefix_entries;  /* L0 (engine_prefix.h) */
    size_t spec_prefix_bytes;
    int spec_prefix_min;
    int drain_timeout;        /* seconds a shutdown waits for running requests, default 30 */
    char kv_events_endpoint[256];        /* ZeroMQ PUB address of KV events; "": off (serve_kv_events.h) */
    char kv_events_replay_endpoint[256]; /* ROUTER address for replays; "": none */
    char kv_events_topic[256];           /* "": kv@<host>@<model id> */
    int kv_events_buffer_steps;          /* batches kept for replays, default 10000 */
    /* chat: */
    bool parse_special_in_content; /* control-token text in messages becomes control tokens */
    /* cache: */
    int block_size;           /* only 16 is supported */
    int32_t num_blocks;       /* KV pool = cache; 0: memory_share of available memory (serve_pool_size.h) */
    double memory_share;      /* share of available memory (after weights and margin) for the pool, (0, 1] */
    apc_config cache;         /* enabled, hash, exact entries, forced tier, ckpt and anchors;
                               * its disk part comes from the disk_* fields below */
    bool disk_enabled;        /* the SSD tier (default on) */
    bool disk_optional;       /* a disk tier that cannot open is a warning, not a start-up error */
    char disk_path[512];      /* "": the per-user directory (serve_user_cache_dir() + "/apc") */
    double disk_max_gb;       /* GB; 0: unbounded; -1 ("auto", the default): serve_disk_cap.h */
    int disk_workers;
    char disk_read_mode[16];
    char kv_format[32];       /* KV_FORMAT_CHOICES */
    char disk_namespace[256];
    char remote_url[512];     /* "": no remote tier; the rest of cache.remote is in cache.remote */
    unsigned char source[SERVE_SETTINGS_MAX]; /* setting_source of each row of the table */
} serve_config;

/* ---- API ---- */
/* The table's defaults (serve_settings_defaults). */
void serve_config_defaults(serve_config *c);
/* Reads a YAML file over c. Unknown keys warn; errors name file:line: key. */
int serve_config_load_file(serve_config *c, const char *path, ember_error *err);
/* Same, from a string (tests); name labels messages. */
int serve_config_load_string(serve_config *c, const char *yaml, size_t len, const char *name, ember_error *err);
/* Applies every variable of the table (serve_settings_apply_env). */
int serve_config_apply_env(serve_config *c, ember_error *err);
/* Checks what no single row can check, after every layer is applied. */
int serve_config_validate(const serve_config *c, ember_error *err);
/* Fills in what depends on the environment once every layer is applied:
 * an empty cache.disk.path becomes the per-user directory + "/apc" (its
 * source stays "default"). -1 when that path does not fit. */
int serve_config_finish(serve_config *c, ember_error *err);
/* The engine's configuration: threads, prefill step, pool, cache and disk
 * (disk strings point into c; no disk tier while cache.disk.path is empty,
 * i.e. before serve_config_finish). n_ctx is copied as is (0: caller
 * decides); num_blocks too (0: the server sizes it, serve_pool_size.h). */
void serve_config_engine(const serve_config *c, engine_config *ec);
/* The drafter spec.mode asks for (auto: draft when server.draft is set). */
spec_kind serve_config_spec_kind(const serve_config *c);

/* ---- Paths ---- */
/* The per-user directory ember keeps its files under: $XDG_CACHE_HOME/ember,
 * else $HOME/.cache/ember, else ./.ember-cache. Not created here. Writes at
 * most cap bytes; returns -1 when the path does not fit. */
int serve_user_cache_dir(char *out, size_t cap);

#endif
