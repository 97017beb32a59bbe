/* cli_common.h - what several subcommands share: option parsing helpers and
 * an "engine" bundle (model + KV pool + context) for one sequence. */
#ifndef EMBER_CLI_COMMON_H
#define EMBER_CLI_COMMON_H

#include <stdbool.h>
#include <stdint.h>

#include "kv/kv_pool.h"
#include "model/model.h"

typedef struct cli_engine {
    model *m;
    kv_pool *pool;
    model_ctx *ctx;
    kv_seq seq;
    int n_ctx;       /* positions the pool can hold for this one sequence */
} cli_engine;

/* Loads path and sizes the pool for n_ctx positions (0: min(train ctx, 4096)). */
/* The pool stores K/V in kv_fmt (zero: f32). */
int cli_engine_open(cli_engine *e, const char *path, int n_threads, int n_ctx, int max_batch, kv_format kv_fmt);
void cli_engine_close(cli_engine *e);

/* Prompt tokens from -p TEXT (with BOS when the vocabulary adds it) or from
 * a comma-separated --tokens list. Returns a malloc'd array or NULL. */
int32_t *cli_tokenize_prompt(const cli_engine *e, const char *text, int *n_out);
int32_t *cli_parse_token_list(const char *list, int *n_out);

/* Strict number parsing for option values; exit(2) with a message on junk. */
long cli_parse_long(const char *opt, const char *value, long min, long max);
double cli_parse_double(const char *opt, const char *value);

#endif
