/* cmd_logits.c - `ember logits MODEL (--tokens 1,2,3 | -p TEXT) --out FILE`.
 *
 * Writes float32 little-endian logits for every prompt position, row-major
 * (n_pos, n_vocab): the format of the llama.cpp reference fixtures, so the
 * two engines can be compared byte for byte. The whole prompt goes through
 * model_eval_state in one call; batch invariance makes the chunking
 * irrelevant. Models with recurrent layers (mamba2, the gated-delta-net and
 * falcon-h1 hybrids) carry the sequence's model_state in every row of that
 * batch; KV-only models pass none. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_common.h"
#include "cli/cli_opts.h"
#include "cli/commands.h"

enum { OPT_PROMPT, OPT_TOKENS, OPT_OUT, OPT_THREADS, OPT_BATCH, OPT_MTP, OPT_KV_FORMAT };

static const cli_option logits_options[] = {
    {OPT_TOKENS, "--tokens", NULL, "1,2,3", "the prompt as comma-separated token ids", NULL},
    {OPT_PROMPT, "--prompt", "-p", "TEXT", "the prompt as text (tokenized with BOS when the vocabulary adds it)", NULL},
    {OPT_OUT, "--out", "-o", "FILE", "output file (required)", NULL},
    {OPT_THREADS, "--threads", NULL, "K", "threads per forward pass (default: all CPUs)", NULL},
    {OPT_BATCH, "--batch", NULL, "B", "largest forward batch (default 512)", NULL},
    {OPT_MTP, "--mtp", NULL, NULL, "write the MTP (nextn) head's draft logits instead of the trunk's", NULL},
    {OPT_KV_FORMAT, "--kv-format", NULL, KV_FORMAT_CHOICES,
     "how the KV cache stores K/V rows (default f32, so the logits compare with the reference fixtures)", NULL},
    {0, NULL, NULL, NULL, NULL, NULL},
};

const cli_command cmd_logits_command = {
    "logits", cmd_logits, "MODEL (--tokens 1,2,3 | -p TEXT) --out FILE [options]",
    "write float32 logits for every prompt position",
    "The file holds n_positions x n_vocab little-endian floats, row-major: the layout of the llama.cpp "
    "reference fixtures.",
    logits_options, false, false,
};

/* The MTP head over the prompt with its own pool; h_prev (n, n_embd) is the
 * trunk's hidden rows shifted down by one. */
static int cli_mtp_logits(const cli_engine *e, int threads, const int32_t *ids, int n, const float *h_prev,
                          float *logits, ember_error *err) {
    kv_pool_config cfg;
    model_mtp_kv_config(e->m, (n + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS, &cfg);
    kv_pool *pool = kv_pool_create(&cfg, err);
    if (pool == NULL) return -1;
    model_ctx *ctx = model_mtp_ctx_create(e->m, pool, threads, model_ctx_max_batch(e->ctx), err);
    int rc = -1;
    if (ctx) {
        kv_seq seq;
        kv_seq_init(&seq);
        rc = model_mtp_eval(ctx, &seq, ids, n, h_prev, logits, NULL, err);
        kv_seq_release(pool, &seq);
    }
    model_ctx_free(ctx);
    kv_pool_free(pool);
    return rc;
}

int cmd_logits(int argc, char **argv) {
    const char *model_path = NULL, *prompt = NULL, *token_list = NULL, *out_path = NULL;
    int threads = 0, batch = 512;
    bool mtp = false;
    kv_format kv_fmt = {KV_FORMAT_F32};
    cli_args args;
    cli_args_init(&args, &cmd_logits_command, argc, argv);
    for (int id; (id = cli_next(&args)) != CLI_END;) {
        switch (id) {
        case OPT_PROMPT: prompt = args.value; break;
        case OPT_TOKENS: token_list = args.value; break;
        case OPT_OUT: out_path = args.value; break;
        case OPT_THREADS: threads = (int)cli_parse_long(args.opt, args.value, 1, 1024); break;
        case OPT_BATCH: batch = (int)cli_parse_long(args.opt, args.value, 1, 1 << 16); break;
        case OPT_MTP: mtp = true; break;
        case OPT_KV_FORMAT:
            if (kv_format_parse(args.value, &kv_fmt) < 0)
                return cli_usage_error(&cmd_logits_command, "--kv-format: expected one of %s, got '%s'",
                                       KV_FORMAT_CHOICES, args.value);
            break;
        case CLI_ARG:
            if (model_path)
                return cli_usage_error(&cmd_logits_command, "one model only ('%s' and '%s')", model_path, args.value);
            model_path = args.value;
            break;
        }
    }
    if (args.status >= 0) return args.status;
    if (model_path == NULL) return cli_usage_error(&cmd_logits_command, "no model file");
    if (out_path == NULL) return cli_usage_error(&cmd_logits_command, "no output file (--out FILE)");
    if ((prompt == NULL) == (token_list == NULL))
        return cli_usage_error(&cmd_logits_command, "give the prompt as exactly one of --tokens and -p");

    cli_engine e;
    if (cli_engine_open(&e, model_path, threads, 0, batch, kv_fmt) < 0) return 1;
    int n = 0;
    int32_t *ids = token_list ? cli_parse_token_list(token_list, &n) : cli_tokenize_prompt(&e, prompt, &n);
    int rc = 1;
    if (ids == NULL || n == 0) {
        if (ids) fprintf(stderr, "ember: the prompt has no tokens\n");
        goto done;
    }
    if (n > e.n_ctx) {
        cli_engine_close(&e);
        if (cli_engine_open(&e, model_path, threads, n, batch, kv_fmt) < 0) goto done;
    }
    int n_vocab = model_get_hparams(e.m)->n_vocab;
    ember_error err;
    model_state *seq_state = NULL;
    if (model_has_state(e.m) && (seq_state = model_state_create(e.m, &err)) == NULL) {
        fprintf(stderr, "ember: %s\n", err.msg);
        goto done;
    }
    if (mtp && !model_has_mtp(e.m)) {
        fprintf(stderr, "ember: %s has no MTP (nextn) head\n", model_path);
        model_state_free(seq_state);
        goto done;
    }
    float *logits = malloc((size_t)n * (size_t)n_vocab * sizeof(float));
    int D = model_get_hparams(e.m)->n_embd;
    float *hidden = mtp ? calloc((size_t)(n + 1) * D, sizeof(float)) : NULL; /* row 0: the zeros before p = 0 */
    int eval_rc = logits == NULL || (mtp && hidden == NULL)
                      ? ember_fail(&err, "out of memory")
                      : model_eval_hidden(e.ctx, &e.seq, seq_state, ids, n, true, logits, hidden ? hidden + D : NULL, &err);
    model_state_free(seq_state);
    if (eval_rc == 0 && mtp) eval_rc = cli_mtp_logits(&e, threads, ids, n, hidden, logits, &err);
    free(hidden);
    if (eval_rc < 0) {
        fprintf(stderr, "ember: %s\n", err.msg);
        free(logits);
        goto done;
    }
    FILE *fp = fopen(out_path, "wb");
    if (fp == NULL || fwrite(logits, sizeof(float), (size_t)n * n_vocab, fp) != (size_t)n * n_vocab || fclose(fp) != 0) {
        fprintf(stderr, "ember: cannot write %s\n", out_path);
    } else {
        fprintf(stderr, "ember: wrote %d x %d %slogits to %s\n", n, n_vocab, mtp ? "MTP " : "", out_path);
        rc = 0;
    }
    free(logits);
done:
    free(ids);
    cli_engine_close(&e);
    return rc;
}
