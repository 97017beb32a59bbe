/* cmd_tokenize.c - `ember tokenize MODEL -p TEXT`: ids, one per line.
 * Only the tokenizer is needed, so the model's weights are not bound. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_opts.h"
#include "cli/commands.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

enum { OPT_PROMPT, OPT_SPECIAL, OPT_NO_BOS };

static const cli_option tokenize_options[] = {
    {OPT_PROMPT, "--prompt", "-p", "TEXT", "the text to tokenize (required)", NULL},
    {OPT_SPECIAL, "--special", NULL, NULL, "parse special tokens written in the text (<|im_start|>)", NULL},
    {OPT_NO_BOS, "--no-bos", NULL, NULL, "do not add the BOS token the vocabulary asks for", NULL},
    {0, NULL, NULL, NULL, NULL, NULL},
};

const cli_command cmd_tokenize_command = {
    "tokenize", cmd_tokenize, "MODEL -p TEXT [--special] [--no-bos]", "print token ids, one per line",
    "Reads only the tokenizer of the GGUF file; the weights are not loaded.", tokenize_options, false, false,
};

int cmd_tokenize(int argc, char **argv) {
    const char *model_path = NULL, *prompt = NULL;
    bool parse_special = false, add_special = true;
    cli_args args;
    cli_args_init(&args, &cmd_tokenize_command, argc, argv);
    for (int id; (id = cli_next(&args)) != CLI_END;) {
        switch (id) {
        case OPT_PROMPT: prompt = args.value; break;
        case OPT_SPECIAL: parse_special = true; break;
        case OPT_NO_BOS: add_special = false; break;
        case CLI_ARG:
            if (model_path)
                return cli_usage_error(&cmd_tokenize_command, "one model only ('%s' and '%s')", model_path, args.value);
            model_path = args.value;
            break;
        }
    }
    if (args.status >= 0) return args.status;
    if (model_path == NULL) return cli_usage_error(&cmd_tokenize_command, "no model file");
    if (prompt == NULL) return cli_usage_error(&cmd_tokenize_command, "no text (-p TEXT)");
    ember_error err;
    gguf_file *f = gguf_open(model_path, &err);
    tokenizer *t = f ? tokenizer_load_gguf(f, &err) : NULL;
    if (t == NULL) {
        fprintf(stderr, "ember: %s\n", err.msg);
        gguf_close(f);
        return 1;
    }
    int32_t *ids = NULL;
    size_t n = 0;
    int rc = 0;
    if (tokenizer_encode(t, prompt, strlen(prompt), add_special, parse_special, &ids, &n, &err) < 0) {
        fprintf(stderr, "ember: %s\n", err.msg);
        rc = 1;
    }
    for (size_t i = 0; i < n; i++) printf("%d\n", ids[i]);
    free(ids);
    tokenizer_free(t);
    gguf_close(f);
    return rc;
}
