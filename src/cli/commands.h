/* commands.h - the subcommands of the `ember` program.
 *
 * Each subcommand lives in its own cmd_<name>.c with its option table (a
 * cli_command, cli_opts.h), receives argv starting at its own name
 * (argv[0] == "run"), prints its own usage on bad arguments and returns the
 * process exit status (0 ok, 1 failure, 2 usage error). main.c lists them
 * for dispatch, `ember --help` and the man page. */
#ifndef EMBER_CLI_COMMANDS_H
#define EMBER_CLI_COMMANDS_H

#include "cli/cli_opts.h"
#include "serve/serve_config.h"

/* ---- Commands ---- */
int cmd_run(int argc, char **argv);
int cmd_logits(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_mkmodel(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_settings(int argc, char **argv);
int cmd_chat(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_quantize(int argc, char **argv);

/* ---- Their option tables ---- */
extern const cli_command cmd_run_command;
extern const cli_command cmd_logits_command;
extern const cli_command cmd_inspect_command;
extern const cli_command cmd_mkmodel_command;
extern const cli_command cmd_tokenize_command;
extern const cli_command cmd_serve_command;
extern const cli_command cmd_settings_command;
extern const cli_command cmd_chat_command;
extern const cli_command cmd_bench_command;
extern const cli_command cmd_quantize_command;

/* ---- Shared by serve and settings ---- */
/* Resolves defaults < --config FILE < environment < flags into cfg. The
 * command's table must give --config the id 0; other options go to
 * on_option (NULL: none expected); positional arguments go to *model_path
 * (NULL: none allowed). Returns -1 when resolved, else the exit status
 * (0 after --help, 1 bad file or environment, 2 bad usage or flag). */
int serve_resolve_settings(const cli_command *cmd, int argc, char **argv, serve_config *cfg, const char **model_path,
                           int (*on_option)(void *user, int id, const char *value), void *user);

#endif
