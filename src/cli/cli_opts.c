/* cli_opts.c - option tables: parsing, --help and the man page's command
 * sections (see cli_opts.h).
 *
 * Design: a command's options are data (cli_command), so the parser, the
 * help text and the man page cannot disagree about them. cli_next is an
 * iterator rather than a callback or a struct filler: each command keeps
 * its own switch over option ids and its own variables, and the table only
 * knows names, value names and help. Commands that take settings (serve)
 * see the settings table's flags through the same iterator. */
#include "cli/cli_opts.h"

#include <ctype.h>
#include <stdarg.h>
#include <string.h>

void cli_args_init(cli_args *a, const cli_command *cmd, int argc, char **argv) {
    memset(a, 0, sizeof *a);
    a->cmd = cmd;
    a->argc = argc;
    a->argv = argv;
    a->next = 1;
    a->status = -1;
}

void cli_print_usage(FILE *out, const cli_command *cmd) {
    fprintf(out, "usage: ember %s %s\n", cmd->name, cmd->synopsis);
}

int cli_usage_error(const cli_command *cmd, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "ember %s: ", cmd->name);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\n");
    cli_print_usage(stderr, cmd);
    fprintf(stderr, "(ember %s --help lists the options)\n", cmd->name);
    return 2;
}

/* "--port=0": the name part matches when it is followed by '=' or ends. */
static bool name_matches(const char *name, const char *arg, const char **inline_value) {
    size_t n = strlen(name);
    if (strncmp(arg, name, n) != 0) return false;
    if (arg[n] == '\0') {
        *inline_value = NULL;
        return true;
    }
    if (arg[n] == '=' && name[1] == '-') {
        *inline_value = arg + n + 1;
        return true;
    }
    return false;
}

static int end_with(cli_args *a, int status) {
    a->status = status;
    a->next = a->argc;
    return CLI_END;
}

int cli_next(cli_args *a) {
    if (a->next >= a->argc) return CLI_END;
    const char *arg = a->argv[a->next++];
    a->opt = arg;
    a->value = NULL;
    a->setting = NULL;
    a->negated = false;
    if (a->options_done || arg[0] != '-' || arg[1] == '\0') {
        a->value = arg;
        return CLI_ARG;
    }
    if (strcmp(arg, "--") == 0) {
        a->options_done = true;
        return cli_next(a);
    }
    if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
        cli_print_help(stdout, a->cmd);
        return end_with(a, 0);
    }
    const char *inline_value = NULL;
    for (const cli_option *o = a->cmd->options; o && o->name; o++) {
        if (!name_matches(o->name, arg, &inline_value) && !(o->alias && name_matches(o->alias, arg, &inline_value)))
            continue;
        if (o->metavar == NULL) {
            if (inline_value) return end_with(a, cli_usage_error(a->cmd, "option '%s' takes no value", o->name));
            return o->id;
        }
        if (inline_value) a->value = inline_value;
        else if (a->next < a->argc) a->value = a->argv[a->next++];
        else return end_with(a, cli_usage_error(a->cmd, "option '%s' needs a value (%s)", arg, o->metavar));
        return o->id;
    }
    if (a->cmd->settings && arg[1] == '-') {
        char name[128];
        const char *eq = strchr(arg, '=');
        size_t len = eq ? (size_t)(eq - arg - 2) : strlen(arg + 2);
        if (len < sizeof name) {
            memcpy(name, arg + 2, len);
            name[len] = '\0';
            const serve_setting *s = serve_setting_by_flag(name, &a->negated);
            if (s) {
                a->setting = s;
                if (eq) a->value = eq + 1;
                else if (s->type != SETTING_BOOL) {
                    if (a->next >= a->argc)
                        return end_with(a, cli_usage_error(a->cmd, "option '%s' needs a value (%s)", arg,
                                                           serve_setting_metavar(s)));
                    a->value = a->argv[a->next++];
                }
                return CLI_SETTING;
            }
        }
    }
    return end_with(a, cli_usage_error(a->cmd, "unknown option '%s'", arg));
}

/* Words of text, wrapped at width columns; an explicit newline breaks too. */
static void put_wrapped(FILE *out, const char *text, int width) {
    int col = 0;
    for (const char *p = text; *p;) {
        if (*p == '\n' || *p == ' ') {
            if (*p == '\n') {
                fputc('\n', out);
                col = 0;
            }
            p++;
            continue;
        }
        size_t len = strcspn(p, " \n");
        if (col > 0 && col + 1 + (int)len > width) {
            fputc('\n', out);
            col = 0;
        } else if (col > 0) {
            fputc(' ', out);
            col++;
        }
        fwrite(p, 1, len, out);
        col += (int)len;
        p += len;
    }
    if (col > 0) fputc('\n', out);
}

void cli_print_help(FILE *out, const cli_command *cmd) {
    cli_print_usage(out, cmd);
    fprintf(out, "\n%c%s.\n", toupper((unsigned char)cmd->summary[0]), cmd->summary + 1);
    if (cmd->description) put_wrapped(out, cmd->description, 78);
    fprintf(out, "\noptions:\n");
    for (const cli_option *o = cmd->options; o && o->name; o++) {
        char left[96];
        snprintf(left, sizeof left, "%s%s%s%s%s", o->alias ? o->alias : "", o->alias ? ", " : "", o->name,
                 o->metavar ? " " : "", o->metavar ? o->metavar : "");
        fprintf(out, "  %-28s %s\n", left, o->help);
        if (o->values) fprintf(out, "  %-28s one of: %s\n", "", o->values());
    }
    fprintf(out, "  %-28s %s\n", "-h, --help", "show this help and exit");
    if (cmd->settings) {
        fprintf(out, "\nsettings, each also a config-file key and an environment variable (below it, with its\n"
                     "default); precedence: %s:\n",
                serve_settings_precedence);
        serve_settings_write_help(out);
    }
}

void cli_write_troff(FILE *out, const cli_command *cmd) {
    fprintf(out, ".SS %s\n.B ember %s\n", cmd->name, cmd->name);
    serve_settings_troff_text(out, cmd->synopsis);
    fputs("\n.PP\n", out);
    fputc(toupper((unsigned char)cmd->summary[0]), out);
    serve_settings_troff_text(out, cmd->summary + 1);
    fputs(".\n", out);
    if (cmd->description) {
        serve_settings_troff_text(out, cmd->description);
        fputc('\n', out);
    }
    for (const cli_option *o = cmd->options; o && o->name; o++) {
        fputs(".TP\n", out);
        if (o->alias) {
            fputs("\\fB", out);
            serve_settings_troff_text(out, o->alias);
            fputs("\\fR, ", out);
        }
        fputs("\\fB", out);
        serve_settings_troff_text(out, o->name);
        fputs("\\fR", out);
        if (o->metavar) {
            fputs(" \\fI", out);
            serve_settings_troff_text(out, o->metavar);
            fputs("\\fR", out);
        }
        fputc('\n', out);
        serve_settings_troff_text(out, o->help);
        fputs(".\n", out);
        if (o->values) {
            fputs("One of: ", out);
            serve_settings_troff_text(out, o->values());
            fputs(".\n", out);
        }
    }
    if (cmd->settings) fputs(".PP\nAlso takes the flag of every setting (see\n.BR SETTINGS ).\n", out);
}
