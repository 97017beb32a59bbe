/* cmd_tokenize.c - `ember tokenize MODEL -p TEXT`: ids, one per line.
 * Only the tokenizer is needed, so the model's weights are not bound. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/commands.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

int cmd_tokenize(int argc, char **argv) {
    const char *model_path = NULL, *prompt = NULL;
    bool parse_special = false, add_special = true;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-p") == 0 && i + 1 < argc) prompt = argv[++i];
        else if (strcmp(argv[i], "--special") == 0) parse_special = true;
        else if (strcmp(argv[i], "--no-bos") == 0) add_special = false;
        else if (argv[i][0] != '-' && model_path == NULL) model_path = argv[i];
        else model_path = NULL, prompt = NULL, i = argc;
    }
    if (model_path == NULL || prompt == NULL) {
        fprintf(stderr, "usage: ember tokenize MODEL -p TEXT [--special] [--no-bos]\n");
        return 2;
    }
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
