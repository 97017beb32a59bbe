/* cmd_settings.c - `ember settings [--config FILE] [settings] [--markdown]`.
 *
 * Without --markdown: resolves the settings exactly as `ember serve` would
 * (same resolver, same precedence) and prints them as a YAML config file,
 * each value followed by a comment naming where it came from, so a user can
 * see why the server runs with a value and save the output as ember.yaml.
 * With --markdown: prints docs/cache-switches.md, the table rendered for the
 * repository (`make docs` writes it; test_settings compares it). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/commands.h"

enum { OPT_CONFIG, OPT_MARKDOWN, OPT_OUT };

static const cli_option settings_options[] = {
    {OPT_CONFIG, "--config", "-c", "FILE", "YAML config file, as for ember serve", NULL},
    {OPT_MARKDOWN, "--markdown", NULL, NULL, "print the settings reference (docs/cache-switches.md) instead", NULL},
    {OPT_OUT, "--out", "-o", "FILE", "write to FILE instead of stdout", NULL},
    {0, NULL, NULL, NULL, NULL, NULL},
};

const cli_command cmd_settings_command = {
    "settings", cmd_settings, "[--config FILE] [settings] [--markdown] [--out FILE]",
    "print the settings ember serve would run with, and where each comes from",
    "The output is a valid config file; each value's comment names its source (default, file, environment "
    "or flag).",
    settings_options, true, false,
};

typedef struct settings_opts {
    bool markdown;
    const char *out;
} settings_opts;

static int on_option(void *user, int id, const char *value) {
    settings_opts *o = user;
    if (id == OPT_MARKDOWN) o->markdown = true;
    else if (id == OPT_OUT) o->out = value;
    return -1;
}

static void put_yaml_string(FILE *out, const char *s) {
    fputc('"', out);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') fputc('\\', out);
        fputc(*s, out);
    }
    fputc('"', out);
}

/* Nested YAML from the dotted keys, in table order (a block's keys are
 * contiguous in the table). */
static void write_yaml(FILE *out, const serve_config *cfg) {
    size_t n;
    const serve_setting *t = serve_settings(&n);
    fprintf(out, "# ember settings: %s\n", serve_settings_precedence);
    char open_blocks[4][32] = {{0}};
    int n_open = 0;
    for (size_t i = 0; i < n; i++) {
        const serve_setting *s = &t[i];
        char parts[4][32];
        int n_parts = 0;
        for (const char *p = s->key; *p && n_parts < 4;) {
            const char *dot = strchr(p, '.');
            size_t len = dot ? (size_t)(dot - p) : strlen(p);
            snprintf(parts[n_parts++], sizeof parts[0], "%.*s", (int)len, p);
            p += len + (dot != NULL);
        }
        int same = 0;
        while (same < n_open && same < n_parts - 1 && strcmp(open_blocks[same], parts[same]) == 0) same++;
        for (int d = same; d < n_parts - 1; d++) {
            fprintf(out, "%*s%s:\n", 2 * d, "", parts[d]);
            snprintf(open_blocks[d], sizeof open_blocks[d], "%s", parts[d]);
        }
        n_open = n_parts - 1;
        char value[600];
        serve_setting_format(cfg, s, value, sizeof value);
        setting_source src = (setting_source)cfg->source[serve_setting_index(s)];
        char from[128];
        if (src == SETTING_FROM_ENV) snprintf(from, sizeof from, "environment %s", s->env);
        else if (src == SETTING_FROM_FLAG)
            snprintf(from, sizeof from, "flag --%s%s", s->type == SETTING_BOOL ? "[no-]" : "", s->flag);
        else snprintf(from, sizeof from, "%s", setting_source_name(src));
        int indent = 2 * (n_parts - 1);
        if (s->secret && value[0]) {
            fprintf(out, "%*s# %s: (set, not shown)  # %s\n", indent, "", parts[n_parts - 1], from);
            continue;
        }
        fprintf(out, "%*s%s: ", indent, "", parts[n_parts - 1]);
        if (s->type == SETTING_STR || s->type == SETTING_FORCE) put_yaml_string(out, value);
        else fputs(value, out);
        fprintf(out, "  # %s\n", from);
    }
}

int cmd_settings(int argc, char **argv) {
    settings_opts o = {false, NULL};
    serve_config cfg;
    int rc = serve_resolve_settings(&cmd_settings_command, argc, argv, &cfg, NULL, on_option, &o);
    if (rc >= 0) return rc;
    FILE *out = o.out ? fopen(o.out, "w") : stdout;
    if (out == NULL) {
        fprintf(stderr, "ember settings: cannot write %s\n", o.out);
        return 1;
    }
    if (o.markdown) serve_settings_write_markdown(out);
    else write_yaml(out, &cfg);
    if (o.out && fclose(out) != 0) {
        fprintf(stderr, "ember settings: cannot write %s\n", o.out);
        return 1;
    }
    return 0;
}
