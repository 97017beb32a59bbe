/* cmd_logits.c - `ember logits MODEL (--tokens 1,2,3 | -p TEXT) --out FILE`.
 *
 * Writes float32 little-endian logits for every prompt position, row-major
 * (n_pos, n_vocab): the format of the llama.cpp reference fixtures, so the
 * two engines can be compared byte for byte. The whole prompt goes through
 * model_eval in one call; batch invariance makes the chunking irrelevant. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_common.h"
#include "cli/commands.h"

static int usage(void) {
    fprintf(stderr, "usage: ember logits MODEL (--tokens 1,2,3 | -p TEXT) --out FILE [--threads K] [--batch B]\n");
    return 2;
}

int cmd_logits(int argc, char **argv) {
    const char *model_path = NULL, *prompt = NULL, *token_list = NULL, *out_path = NULL;
    int threads = 0, batch = 512;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "-p") == 0 && val) { prompt = val; i++; }
        else if (strcmp(a, "--tokens") == 0 && val) { token_list = val; i++; }
        else if (strcmp(a, "--out") == 0 && val) { out_path = val; i++; }
        else if (strcmp(a, "--threads") == 0) { threads = (int)cli_parse_long(a, val, 1, 1024); i++; }
        else if (strcmp(a, "--batch") == 0) { batch = (int)cli_parse_long(a, val, 1, 1 << 16); i++; }
        else if (a[0] != '-' && model_path == NULL) model_path = a;
        else return usage();
    }
    if (model_path == NULL || out_path == NULL || (prompt == NULL) == (token_list == NULL)) return usage();

    cli_engine e;
    if (cli_engine_open(&e, model_path, threads, 0, batch) < 0) return 1;
    int n = 0;
    int32_t *ids = token_list ? cli_parse_token_list(token_list, &n) : cli_tokenize_prompt(&e, prompt, &n);
    int rc = 1;
    if (ids == NULL || n == 0) {
        if (ids) fprintf(stderr, "ember: the prompt has no tokens\n");
        goto done;
    }
    if (n > e.n_ctx) {
        cli_engine_close(&e);
        if (cli_engine_open(&e, model_path, threads, n, batch) < 0) goto done;
    }
    int n_vocab = model_get_hparams(e.m)->n_vocab;
    float *logits = malloc((size_t)n * (size_t)n_vocab * sizeof(float));
    ember_error err;
    if (logits == NULL || model_eval(e.ctx, &e.seq, ids, n, true, logits, &err) < 0) {
        fprintf(stderr, "ember: %s\n", logits ? err.msg : "out of memory");
        free(logits);
        goto done;
    }
    FILE *fp = fopen(out_path, "wb");
    if (fp == NULL || fwrite(logits, sizeof(float), (size_t)n * n_vocab, fp) != (size_t)n * n_vocab || fclose(fp) != 0) {
        fprintf(stderr, "ember: cannot write %s\n", out_path);
    } else {
        fprintf(stderr, "ember: wrote %d x %d logits to %s\n", n, n_vocab, out_path);
        rc = 0;
    }
    free(logits);
done:
    free(ids);
    cli_engine_close(&e);
    return rc;
}
