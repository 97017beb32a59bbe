/* main.c - the `ember` command: dispatches to a subcommand by name, and
 * answers --help, --version and --man itself.
 *
 * The list of subcommands below is the only one: dispatch, `ember --help`
 * and the man page (`ember --man`, built into ember.1 at build time) all
 * walk it, and each entry's option table (cli_opts.h) supplies its help.
 * The settings table (serve_settings.c) supplies the SETTINGS section. */
#include <stdio.h>
#include <string.h>

#include "cli/cli_opts.h"
#include "cli/commands.h"
#include "ember_version.h"

static const cli_command *const commands[] = {
    &cmd_serve_command,   &cmd_run_command,      &cmd_logits_command,   &cmd_inspect_command,
    &cmd_tokenize_command, &cmd_mkmodel_command, &cmd_settings_command,
    &cmd_chat_command,    &cmd_bench_command,    &cmd_quantize_command,
};
#define N_COMMANDS (sizeof commands / sizeof commands[0])

static void usage(FILE *out) {
    fprintf(out, "usage: ember <command> [options]\n"
                 "       ember help <command> | --help | --version | --man\n\ncommands:\n");
    for (size_t i = 0; i < N_COMMANDS; i++)
        if (!commands[i]->hidden) fprintf(out, "  %-10s %s\n", commands[i]->name, commands[i]->summary);
    fprintf(out, "\n`ember <command> --help` lists a command's options; `man ember` has them all.\n");
}

static void print_version(void) {
    if (EMBER_GIT_DESCRIBE[0]) printf("ember %s (git %s)\n", EMBER_VERSION, EMBER_GIT_DESCRIBE);
    else printf("ember %s\n", EMBER_VERSION);
}

static void write_man(FILE *out) {
    fprintf(out,
            ".\\\" ember.1 - written by `ember --man` from ember's option and settings tables; do not edit.\n"
            ".TH EMBER 1 \"\" \"ember %s\" \"User Commands\"\n"
            ".SH NAME\n"
            "ember \\- LLM inference server with a tiered, architecture\\-aware prompt cache\n"
            ".SH SYNOPSIS\n"
            ".B ember\n\\fICOMMAND\\fR [\\fIoptions\\fR]\n.br\n"
            ".B ember help\n\\fICOMMAND\\fR\n.br\n"
            ".B ember\n\\fB\\-\\-help\\fR | \\fB\\-\\-version\\fR | \\fB\\-\\-man\\fR\n"
            ".SH DESCRIPTION\n"
            ".B ember\n"
            "loads GGUF models, serves them over an OpenAI\\-compatible HTTP API and keeps a tiered prompt cache, so "
            "that a request whose prefix was seen before skips that prefill.\n"
            "Every command takes \\fB\\-h\\fR or \\fB\\-\\-help\\fR.\n"
            ".SH COMMANDS\n",
            EMBER_VERSION);
    for (size_t i = 0; i < N_COMMANDS; i++)
        if (!commands[i]->hidden) cli_write_troff(out, commands[i]);
    fputs(".SH SETTINGS\n", out);
    serve_settings_write_troff(out);
    fputs(".SH ENVIRONMENT\n"
          "Every variable listed under\n.B SETTINGS\n(read by \\fBember serve\\fR and \\fBember settings\\fR), and:\n"
          ".TP\n.B EMBER_LOG\nlog level: debug, info (default), warn, error or silent.\n"
          ".TP\n.B EMBER_FIXTURES\nwhere \\fBember\\ mkmodel \\-\\-preset qwen3\\-0.6b\\fR looks for the Qwen3 "
          "tokenizer (default ../shared/fixtures).\n"
          ".SH EXIT STATUS\n"
          "0 on success (and after \\fB\\-\\-help\\fR), 1 when the work failed (a file that cannot be read, a bad "
          "config file or environment value), 2 on bad usage (an unknown option, a missing or malformed "
          "value).\n"
          ".SH FILES\n"
          ".TP\n.I ember.yaml\nthe config file given to \\fBember serve \\-\\-config\\fR; "
          "\\fBember settings\\fR prints one with every value in effect.\n"
          ".TP\n.I ~/.cache/ember/apc\nthe SSD tier's root when the config file says \\fBdisk: true\\fR.\n",
          out);
}

static const cli_command *find_command(const char *name) {
    for (size_t i = 0; i < N_COMMANDS; i++)
        if (strcmp(name, commands[i]->name) == 0) return commands[i];
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *a = argv[1];
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
        usage(stdout);
        return 0;
    }
    if (strcmp(a, "--version") == 0 || strcmp(a, "-V") == 0) {
        print_version();
        return 0;
    }
    if (strcmp(a, "--man") == 0) {
        if (argc > 3 || (argc == 3 && argv[2][0] == '-')) {
            fprintf(stderr, "usage: ember --man [FILE]\n");
            return 2;
        }
        FILE *out = argc == 3 ? fopen(argv[2], "w") : stdout;
        if (out == NULL) {
            fprintf(stderr, "ember: cannot write %s\n", argv[2]);
            return 1;
        }
        write_man(out);
        if (argc == 3 && fclose(out) != 0) {
            fprintf(stderr, "ember: cannot write %s\n", argv[2]);
            return 1;
        }
        return 0;
    }
    if (strcmp(a, "help") == 0) {
        if (argc == 2) {
            usage(stdout);
            return 0;
        }
        const cli_command *cmd = find_command(argv[2]);
        if (cmd == NULL) {
            fprintf(stderr, "ember: unknown command '%s'\n", argv[2]);
            usage(stderr);
            return 2;
        }
        cli_print_help(stdout, cmd);
        return 0;
    }
    const cli_command *cmd = find_command(a);
    if (cmd) return cmd->run(argc - 1, argv + 1);
    if (a[0] == '-') fprintf(stderr, "ember: unknown option '%s'\n", a);
    else fprintf(stderr, "ember: unknown command '%s'\n", a);
    usage(stderr);
    return 2;
}
