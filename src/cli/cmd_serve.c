/* cmd_serve.c - `ember serve MODEL [--config ember.yaml] [settings]`.
 *
 * Settings are layered defaults < ember.yaml < environment < flags; every
 * flag is a row of the settings table (serve_settings.c), resolved here by
 * serve_resolve_settings, which `ember settings` shares. SIGINT and SIGTERM
 * are blocked in every thread and taken here with sigwait, so the drain runs
 * on the main thread, outside any signal handler: stop accepting, finish
 * in-flight requests, exit 0. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_opts.h"
#include "cli/commands.h"
#include "core/log.h"
#include "serve/serve.h"
#include "serve/serve_config.h"

enum { OPT_CONFIG };

static const cli_option serve_options[] = {
    {OPT_CONFIG, "--config", "-c", "FILE", "YAML config file with server: and cache: blocks", NULL},
    {0, NULL, NULL, NULL, NULL, NULL},
};

const cli_command cmd_serve_command = {
    "serve", cmd_serve, "MODEL [--config FILE] [settings]",
    "serve a model over an OpenAI-compatible HTTP API",
    "Runs until SIGINT or SIGTERM, then stops accepting, finishes the requests in flight and exits 0.",
    serve_options, true, false,
};

_Static_assert(OPT_CONFIG == 0, "serve_resolve_settings expects --config as id 0");

/* One --flag of the settings table, as written. */
typedef struct flag_use {
    const serve_setting *setting;
    const char *value;
    bool negated;
} flag_use;

int serve_resolve_settings(const cli_command *cmd, int argc, char **argv, serve_config *cfg, const char **model_path,
                           int (*on_option)(void *user, int id, const char *value), void *user) {
    /* The file comes before the environment and the flags whatever its
     * position on the line, so the flags are collected first. */
    const char *config_path = NULL;
    if (model_path) *model_path = NULL;
    flag_use *flags = calloc((size_t)argc, sizeof *flags);
    int n_flags = 0, rc = -1;
    if (flags == NULL) {
        fprintf(stderr, "ember: out of memory\n");
        return 1;
    }
    cli_args args;
    cli_args_init(&args, cmd, argc, argv);
    for (int id; (id = cli_next(&args)) != CLI_END;) {
        if (id == OPT_CONFIG) config_path = args.value;
        else if (id == CLI_SETTING) flags[n_flags++] = (flag_use){args.setting, args.value, args.negated};
        else if (id >= 0) {
            rc = on_option ? on_option(user, id, args.value) : 2;
            if (rc >= 0) goto done;
        } else if (model_path == NULL) {
            rc = cli_usage_error(cmd, "unexpected argument '%s'", args.value);
            goto done;
        } else if (*model_path) {
            rc = cli_usage_error(cmd, "one model only ('%s' and '%s')", *model_path, args.value);
            goto done;
        } else {
            *model_path = args.value;
        }
    }
    if (args.status >= 0) {
        rc = args.status;
        goto done;
    }
    serve_config_defaults(cfg);
    ember_error err;
    if ((config_path && serve_config_load_file(cfg, config_path, &err) < 0) || serve_config_apply_env(cfg, &err) < 0) {
        fprintf(stderr, "ember: %s\n", err.msg);
        rc = 1;
        goto done;
    }
    for (int i = 0; i < n_flags; i++)
        if (serve_settings_apply_flag(cfg, flags[i].setting, flags[i].value, flags[i].negated, &err) < 0) {
            fprintf(stderr, "ember %s: %s\n", cmd->name, err.msg);
            rc = 2;
            goto done;
        }
    if (serve_config_validate(cfg, &err) < 0 || serve_config_finish(cfg, &err) < 0) {
        fprintf(stderr, "ember: %s\n", err.msg);
        rc = 1;
    }
done:
    free(flags);
    return rc;
}

int cmd_serve(int argc, char **argv) {
    serve_config cfg;
    const char *model_path;
    int rc = serve_resolve_settings(&cmd_serve_command, argc, argv, &cfg, &model_path, NULL, NULL);
    if (rc >= 0) return rc;
    if (model_path == NULL) return cli_usage_error(&cmd_serve_command, "no model file");
    ember_error err;
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
