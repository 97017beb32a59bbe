/* cli_opts.h - option tables for the ember subcommands.
 *
 * Contract:
 *  - Each subcommand describes itself once, as a cli_command: name,
 *    synopsis, summary, options (each with its value's name and a one-line
 *    help). That description drives parsing, `ember CMD --help`, `ember
 *    --help` and the man page; nothing else lists a command's options.
 *  - cli_next walks argv like getopt: it returns an option's id, or
 *    CLI_ARG for a positional argument, or CLI_SETTING for a flag of the
 *    settings table (commands with `settings` set), or CLI_END. Options take
 *    their value as the next argument or after '=' (--port=0). -h/--help
 *    prints the help on stdout and ends with status 0; an unknown option or a
 *    missing value prints "ember CMD: ..." with the usage line on stderr and
 *    ends with status 2. After CLI_END, status is -1 when parsing succeeded.
 *  - "--" ends the options: every later argument is positional. */
#ifndef EMBER_CLI_OPTS_H
#define EMBER_CLI_OPTS_H

#include <stdbool.h>
#include <stdio.h>

#include "serve/serve_settings.h"

typedef struct cli_option {
    int id;                        /* returned by cli_next; >= 0 */
    const char *name;              /* "--temp" */
    const char *alias;             /* "-p", or NULL */
    const char *metavar;           /* the value's name; NULL: a switch without a value */
    const char *help;              /* one line */
    const char *(*values)(void);   /* optional: the accepted values, shown after the help */
} cli_option;

typedef struct cli_command {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *synopsis;          /* after "ember NAME ": "MODEL -p TEXT [options]" */
    const char *summary;           /* one line, for `ember --help` */
    const char *description;       /* a paragraph for --help and the man page, or NULL */
    const cli_option *options;     /* ends with an entry whose name is NULL */
    bool settings;                 /* also takes the flags of the settings table */
    bool hidden;                   /* not listed by `ember --help` */
} cli_command;

enum { CLI_END = -1, CLI_ARG = -2, CLI_SETTING = -3 };

typedef struct cli_args {
    const cli_command *cmd;
    int argc;
    char **argv;
    int next;                      /* index of the next argv entry */
    bool options_done;             /* after "--" */
    const char *value;             /* option's value; CLI_ARG: the argument */
    const char *opt;               /* the option as written (for messages) */
    const serve_setting *setting;  /* CLI_SETTING */
    bool negated;                  /* CLI_SETTING: --no-FLAG */
    int status;                    /* after CLI_END: -1 ok, 0 help shown, 2 usage error */
} cli_args;

/* ---- Parsing ---- */
/* argv[0] is the command's name. */
void cli_args_init(cli_args *a, const cli_command *cmd, int argc, char **argv);
int cli_next(cli_args *a);
/* "ember CMD: <message>" and the usage line on stderr; returns 2. */
int cli_usage_error(const cli_command *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* ---- Help ---- */
void cli_print_usage(FILE *out, const cli_command *cmd);
void cli_print_help(FILE *out, const cli_command *cmd);
/* The command's part of the man page (troff, one .SS). */
void cli_write_troff(FILE *out, const cli_command *cmd);

#endif
