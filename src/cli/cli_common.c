/* cli_common.c - shared helpers of the ember subcommands (see cli_common.h). */
#include "cli/cli_common.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int cli_engine_open(cli_engine *e, const char *path, int n_threads, int n_ctx, int max_batch, kv_format kv_fmt) {
    memset(e, 0, sizeof *e);
    ember_error err;
    e->m = model_load(path, &err);
    if (e->m == NULL) {
        fprintf(stderr, "ember: %s\n", err.msg);
        return -1;
    }
    const model_hparams *hp = model_get_hparams(e->m);
    if (n_ctx <= 0) n_ctx = hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096;
    e->n_ctx = n_ctx;
    kv_pool_config cfg;
    /* +1 block: copy-on-write of a shared last block needs a spare. */
    model_kv_config(e->m, (n_ctx + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS + 1, &cfg);
    cfg.format = kv_fmt;
    e->pool = kv_pool_create(&cfg, &err);
    if (e->pool == NULL) goto fail;
    e->ctx = model_ctx_create(e->m, e->pool, n_threads, max_batch, &err);
    if (e->ctx == NULL) goto fail;
    kv_seq_init(&e->seq);
    return 0;
fail:
    fprintf(stderr, "ember: %s\n", err.msg);
    cli_engine_close(e);
    return -1;
}

void cli_engine_close(cli_engine *e) {
    if (e->pool) kv_seq_release(e->pool, &e->seq);
    model_ctx_free(e->ctx);
    kv_pool_free(e->pool);
    model_free(e->m);
    memset(e, 0, sizeof *e);
}

int32_t *cli_tokenize_prompt(const cli_engine *e, const char *text, int *n_out) {
    ember_error err;
    int32_t *ids = NULL;
    size_t n = 0;
    if (tokenizer_encode(model_get_tokenizer(e->m), text, strlen(text), true, false, &ids, &n, &err) < 0) {
        fprintf(stderr, "ember: tokenizing the prompt: %s\n", err.msg);
        return NULL;
    }
    *n_out = (int)n;
    return ids;
}

int32_t *cli_parse_token_list(const char *list, int *n_out) {
    size_t cap = 16, n = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    const char *p = list;
    while (ids && *p) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > INT32_MAX || (*end != ',' && *end != '\0')) {
            fprintf(stderr, "ember: --tokens: '%s' is not a comma-separated list of token ids\n", list);
            free(ids);
            return NULL;
        }
        if (n == cap) {
            int32_t *grown = realloc(ids, (cap *= 2) * sizeof *ids);
            if (grown == NULL) break;
            ids = grown;
        }
        ids[n++] = (int32_t)v;
        p = *end == ',' ? end + 1 : end;
    }
    *n_out = (int)n;
    return ids;
}

long cli_parse_long(const char *opt, const char *value, long min, long max) {
    char *end;
    errno = 0;
    long v = value ? strtol(value, &end, 10) : 0;
    if (value == NULL || end == value || *end || errno || v < min || v > max) {
        fprintf(stderr, "ember: %s expects an integer in [%ld, %ld], got '%s'\n", opt, min, max, value ? value : "");
        exit(2);
    }
    return v;
}

double cli_parse_double(const char *opt, const char *value) {
    char *end;
    errno = 0;
    double v = value ? strtod(value, &end) : 0;
    if (value == NULL || end == value || *end || errno) {
        fprintf(stderr, "ember: %s expects a number, got '%s'\n", opt, value ? value : "");
        exit(2);
    }
    return v;
}
