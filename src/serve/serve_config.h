/* serve_config.h - the settings of `ember serve` and where they come from.
 *
 * Contract:
 *  - Precedence, lowest first: built-in defaults, the YAML file
 *    (--config ember.yaml), the environment, command-line flags. Each layer
 *    only overrides the keys it names.
 *  - The file has two top-level blocks, `server:` and `cache:` (reference
 *    §2.1 for the cache keys: enabled, block_size, num_blocks, exact_entries,
 *    hash, disk.{path,max_gb,workers,read_mode,namespace}; `disk` may also be
 *    a boolean). An unknown key is a loud warning naming it and its line; a
 *    malformed file or a value of the wrong type is an error naming the key
 *    and the line ("ember.yaml:7: server.port: expected an integer, got
 *    'abc'").
 *  - Environment: the cache keys under their APC_* names (APC_ENABLED,
 *    APC_BLOCK_SIZE, APC_NUM_BLOCKS, APC_EXACT_CACHE_ENTRIES, APC_HASH,
 *    APC_DISK_PATH, APC_DISK_MAX_GB, APC_DISK_WORKERS, APC_DISK_READ_MODE,
 *    APC_DISK_NAMESPACE); the server keys as EMBER_<KEY> (EMBER_HOST,
 *    EMBER_PORT, EMBER_API_KEY, EMBER_MODEL_ID, EMBER_CTX, EMBER_THREADS,
 *    EMBER_PREFILL_STEP, EMBER_MAX_RUNNING, EMBER_QUEUE_SIZE,
 *    EMBER_MAX_BODY_BYTES, EMBER_CONNECTION_LIMIT, EMBER_PER_IP_CONNECTION_LIMIT,
 *    EMBER_READ_TIMEOUT, EMBER_IDLE_TIMEOUT, EMBER_HTTP_THREADS). A malformed value is an
 *    error naming the variable.
 *  - The cache is on by default. The SSD tier is on when cache.disk.path is
 *    set (or `disk: true`, which picks ~/.cache/ember/apc); the server passes
 *    the disk keys to the cache's apc_disk_config. */
#ifndef EMBER_SERVE_CONFIG_H
#define EMBER_SERVE_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/error.h"

typedef struct serve_config {
    /* server: */
    char host[256];
    int port;                 /* 0: any free port (logged) */
    char api_key[256];        /* "": no authentication */
    char model_id[128];       /* "": the model file's base name */
    int n_ctx;                /* 0: min(training context, 4096) */
    int n_threads;            /* 0: all CPUs */
    int prefill_step;         /* grid chunk, default 512 */
    int max_running;          /* sequences decoded together, default 32 */
    int queue_size;           /* waiting requests before 503, default 64 */
    int fresh_wait_ms;        /* freshness gate hold ceiling, default 500; 0: off (reference §14.1) */
    int fresh_min;            /* least shared uncached tokens to hold a sibling, default 256 */
    size_t max_body_bytes;    /* larger bodies get 413, default 4 MiB */
    int connection_limit;     /* open HTTP connections before 503, default 1024 */
    int per_ip_connection_limit; /* open connections of one client address before 503; 0: none; default 256 */
    int read_timeout;         /* seconds to deliver a whole request (head + body) after connecting or the
                                 previous answer, default 30 */
    int idle_timeout;         /* seconds of silence before a connection is closed, default 60 */
    int http_threads;         /* event-loop threads of the HTTP layer, default 2 */
    /* cache: */
    bool cache_enabled;
    int block_size;           /* only 16 is supported */
    int32_t num_blocks;       /* KV pool = cache; 0: engine default */
    int exact_entries;
    bool hash_xxh3;           /* hash: sha256 (default) | xxh3 | fast (= xxh3) */
    char disk_path[512];
    double disk_max_gb;
    int disk_workers;
    char disk_read_mode[16];
    char disk_namespace[256];
} serve_config;

/* ---- API ---- */
void serve_config_defaults(serve_config *c);
/* Reads a YAML file over c. Unknown keys warn; errors name file:line: key. */
int serve_config_load_file(serve_config *c, const char *path, ember_error *err);
/* Same, from a string (tests); name labels messages. */
int serve_config_load_string(serve_config *c, const char *yaml, size_t len, const char *name, ember_error *err);
/* Applies APC_* and EMBER_* environment variables. */
int serve_config_apply_env(serve_config *c, ember_error *err);
/* Checks ranges after every layer is applied. */
int serve_config_validate(const serve_config *c, ember_error *err);

#endif
