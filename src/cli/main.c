/* main.c - the `ember` command: dispatches to a subcommand by name. */
#include <stdio.h>
#include <string.h>

#include "cli/commands.h"

typedef struct subcommand {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *summary;
} subcommand;

static const subcommand subcommands[] = {
    {"serve", cmd_serve, "serve a model over an OpenAI-compatible HTTP API"},
    {"run", cmd_run, "generate text from a prompt"},
    {"logits", cmd_logits, "write float32 logits for every prompt position"},
    {"inspect", cmd_inspect, "show metadata, tensors, tokenizer and cache stack"},
    {"mkmodel", cmd_mkmodel, "write a random-weight GGUF model of any supported architecture"},
    {"tokenize", cmd_tokenize, "print token ids, one per line"},
};

static void usage(FILE *out) {
    fprintf(out, "usage: ember <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof subcommands / sizeof subcommands[0]; i++)
        fprintf(out, "  %-10s %s\n", subcommands[i].name, subcommands[i].summary);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        usage(stdout);
        return 0;
    }
    for (size_t i = 0; i < sizeof subcommands / sizeof subcommands[0]; i++)
        if (strcmp(argv[1], subcommands[i].name) == 0) return subcommands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "ember: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
