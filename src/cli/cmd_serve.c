/* cmd_serve.c - `ember serve MODEL [--host H] [--port P] [--config ember.yaml]
 * [--api-key KEY] ...`.
 *
 * Settings are layered defaults < ember.yaml < environment < flags
 * (serve_config.h). SIGINT and SIGTERM are blocked in every thread and
 * taken here with sigwait, so the drain runs on the main thread, outside
 * any signal handler: stop accepting, finish in-flight requests, exit 0. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "core/log.h"
#include "serve/serve.h"
#include "serve/serve_config.h"

static int usage(void) {
    fprintf(stderr,
            "usage: ember serve MODEL [--host 127.0.0.1] [--port 8080] [--config ember.yaml] [--api-key KEY]\n"
            "                   [--model-id NAME] [--ctx N] [--threads K] [--prefill-step N] [--max-running N]\n"
            "                   [--queue-size N] [--num-blocks N] [--no-cache]\n"
            "  settings: defaults < ember.yaml (server:, cache:) < APC_* / EMBER_* environment < flags\n");
    return 2;
}

int cmd_serve(int argc, char **argv) {
    const char *model_path = NULL, *config_path = NULL;
    /* The config file is applied before the flags, so find it first. */
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], "--config") == 0) config_path = argv[i + 1];
    serve_config cfg;
    serve_config_defaults(&cfg);
    ember_error err;
    if (config_path && serve_config_load_file(&cfg, config_path, &err) < 0) {
        fprintf(stderr, "ember: %s\n", err.msg);
        return 1;
    }
    if (serve_config_apply_env(&cfg, &err) < 0) {
        fprintf(stderr, "ember: %s\n", err.msg);
        return 1;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
            usage();
            return 0;
        }
        if (a[0] != '-') {
            if (model_path) return usage();
            model_path = a;
            continue;
        }
        if (strcmp(a, "--no-cache") == 0) {
            cfg.cache_enabled = false;
            continue;
        }
        if (val == NULL) return usage();
        i++;
        if (strcmp(a, "--config") == 0) continue;
        else if (strcmp(a, "--host") == 0) snprintf(cfg.host, sizeof cfg.host, "%s", val);
        else if (strcmp(a, "--port") == 0) cfg.port = (int)cli_parse_long(a, val, 0, 65535);
        else if (strcmp(a, "--api-key") == 0) snprintf(cfg.api_key, sizeof cfg.api_key, "%s", val);
        else if (strcmp(a, "--model-id") == 0) snprintf(cfg.model_id, sizeof cfg.model_id, "%s", val);
        else if (strcmp(a, "--ctx") == 0) cfg.n_ctx = (int)cli_parse_long(a, val, 16, 1 << 24);
        else if (strcmp(a, "--threads") == 0) cfg.n_threads = (int)cli_parse_long(a, val, 1, 1024);
        else if (strcmp(a, "--prefill-step") == 0) cfg.prefill_step = (int)cli_parse_long(a, val, 1, 1 << 16);
        else if (strcmp(a, "--max-running") == 0) cfg.max_running = (int)cli_parse_long(a, val, 1, 4096);
        else if (strcmp(a, "--queue-size") == 0) cfg.queue_size = (int)cli_parse_long(a, val, 0, 1 << 20);
        else if (strcmp(a, "--num-blocks") == 0) cfg.num_blocks = (int32_t)cli_parse_long(a, val, 0, 1 << 30);
        else return usage();
    }
    if (model_path == NULL) return usage();
    if (serve_config_validate(&cfg, &err) < 0) {
        fprintf(stderr, "ember: %s\n", err.msg);
        return 1;
    }
    /* Every thread created from here on inherits the blocked signals. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
    server *srv = server_create(model_path, &cfg, &err);
    if (srv == NULL) {
        fprintf(stderr, "ember: %s\n", err.msg);
        return 1;
    }
    int sig = 0;
    sigwait(&sigs, &sig);
    ember_log(EMBER_LOG_INFO, "received %s", sig == SIGINT ? "SIGINT" : "SIGTERM");
    server_free(srv);
    return 0;
}
