/* cmd_run.c - `ember run MODEL -p TEXT [-n N] [--temp T] [--seed S] ...`.
 *
 * Streams the continuation of a prompt to stdout and reports prefill and
 * decode throughput on stderr. The request goes through engine_generate, the
 * same runner the server uses, so the prompt follows the engine's schedule
 * (design.md §1: grid-aligned prefill chunks, the last prompt token forwarded
 * alone). One request has nothing to reuse, so it bypasses the cache. A
 * prompt longer than one prefill chunk shows its progress on stderr when
 * that is a terminal. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli_common.h"
#include "cli/cli_opts.h"
#include "cli/commands.h"
#include "engine/engine.h"

enum { OPT_PROMPT, OPT_N, OPT_TEMP, OPT_SEED, OPT_THREADS, OPT_TOP_K, OPT_TOP_P, OPT_MIN_P, OPT_REPEAT, OPT_CTX, OPT_BATCH, OPT_KV_FORMAT };

static const cli_option run_options[] = {
    {OPT_PROMPT, "--prompt", "-p", "TEXT", "the prompt (required)", NULL},
    {OPT_N, "--n-predict", "-n", "N", "tokens to generate (default 128)", NULL},
    {OPT_TEMP, "--temp", NULL, "T", "sampling temperature; 0: greedy (default 0)", NULL},
    {OPT_SEED, "--seed", NULL, "S", "sampling seed", NULL},
    {OPT_THREADS, "--threads", NULL, "K", "threads per forward pass (default: all CPUs)", NULL},
    {OPT_TOP_K, "--top-k", NULL, "K", "keep the K most likely tokens; 0: all", NULL},
    {OPT_TOP_P, "--top-p", NULL, "P", "nucleus sampling threshold", NULL},
    {OPT_MIN_P, "--min-p", NULL, "P", "drop tokens below P times the most likely one", NULL},
    {OPT_REPEAT, "--repeat-penalty", NULL, "R", "penalty of tokens already seen", NULL},
    {OPT_CTX, "--ctx", NULL, "N", "context in tokens (default: prompt + N, at most the training context)", NULL},
    {OPT_BATCH, "--batch", NULL, "B", "prefill chunk in tokens (default 512)", NULL},
    {OPT_KV_FORMAT, "--kv-format", NULL, KV_FORMAT_CHOICES, "how the KV cache stores K/V rows (default f32)", NULL},
    {0, NULL, NULL, NULL, NULL, NULL},
};

const cli_command cmd_run_command = {
    "run", cmd_run, "MODEL -p TEXT [options]", "generate text from a prompt",
    "Streams the continuation to stdout and reports prefill and decode speed on stderr.\n"
    "The request goes through the engine the server uses, with the cache bypassed. On a terminal, a prompt "
    "longer than one prefill chunk shows its progress.",
    run_options, false, false,
};

typedef struct run_out {
    tok_stream *stream;
    bool progress;       /* stderr is a terminal and the prompt spans several chunks */
    bool drawn;
} run_out;

static bool print_token(void *user, int32_t token) {
    run_out *o = user;
    size_t len;
    const char *text = tok_stream_push(o->stream, token, &len);
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    return true;
}

/* One self-overwriting line on the terminal while a long prompt prefills. */
static void show_prefill(void *user, int64_t done, int64_t n_prompt) {
    run_out *o = user;
    if (!o->progress) return;
    if (done >= n_prompt - 1) {
        if (o->drawn) fputs("\r\033[K", stderr);
        o->drawn = false;
        return;
    }
    fprintf(stderr, "\rember: prefill %lld/%lld tokens (%d%%)", (long long)done, (long long)n_prompt,
            (int)(100 * done / n_prompt));
    fflush(stderr);
    o->drawn = true;
}

int cmd_run(int argc, char **argv) {
    const char *model_path = NULL, *prompt = NULL;
    int n_predict = 128, threads = 0, n_ctx = 0, batch = 512;
    kv_format kv_fmt = {KV_FORMAT_F32};
    engine_request req = engine_default_request();
    req.sampling = sampler_default_params();
    req.sampling.temperature = 0.0f; /* greedy unless asked otherwise: reproducible by default */
    cli_args args;
    cli_args_init(&args, &cmd_run_command, argc, argv);
    for (int id; (id = cli_next(&args)) != CLI_END;) {
        const char *a = args.opt, *val = args.value;
        switch (id) {
        case OPT_PROMPT: prompt = val; break;
        case OPT_N: n_predict = (int)cli_parse_long(a, val, 0, 1 << 24); break;
        case OPT_TEMP: req.sampling.temperature = (float)cli_parse_double(a, val); break;
        case OPT_SEED: req.sampling.seed = (uint64_t)cli_parse_long(a, val, 0, __LONG_MAX__); break;
        case OPT_THREADS: threads = (int)cli_parse_long(a, val, 1, 1024); break;
        case OPT_TOP_K: req.sampling.top_k = (int32_t)cli_parse_long(a, val, 0, 1 << 30); break;
        case OPT_TOP_P: req.sampling.top_p = (float)cli_parse_double(a, val); break;
        case OPT_MIN_P: req.sampling.min_p = (float)cli_parse_double(a, val); break;
        case OPT_REPEAT: req.sampling.repeat_penalty = (float)cli_parse_double(a, val); break;
        case OPT_CTX: n_ctx = (int)cli_parse_long(a, val, 16, 1 << 24); break;
        case OPT_BATCH: batch = (int)cli_parse_long(a, val, 1, 1 << 16); break;
        case OPT_KV_FORMAT:
            if (kv_format_parse(val, &kv_fmt) < 0)
                return cli_usage_error(&cmd_run_command, "--kv-format: expected one of %s, got '%s'", KV_FORMAT_CHOICES,
                                       val);
            break;
        case CLI_ARG:
            if (model_path) return cli_usage_error(&cmd_run_command, "one model only ('%s' and '%s')", model_path, val);
            model_path = val;
            break;
        }
    }
    if (args.status >= 0) return args.status;
    if (model_path == NULL) return cli_usage_error(&cmd_run_command, "no model file");
    if (prompt == NULL) return cli_usage_error(&cmd_run_command, "no prompt (-p TEXT)");

    ember_error err;
    model *m = model_load(model_path, &err);
    if (m == NULL) {
        fprintf(stderr, "ember: %s\n", err.msg);
        return 1;
    }
    const model_hparams *hp = model_get_hparams(m);
    const tokenizer *tok = model_get_tokenizer(m);
    int32_t *ids = NULL;
    size_t n_prompt = 0;
    engine *eng = NULL;
    tok_stream *stream = NULL;
    run_out out = {0};
    engine_result res;
    memset(&res, 0, sizeof res);
    int rc = 1;
    if (tokenizer_encode(tok, prompt, strlen(prompt), true, false, &ids, &n_prompt, &err) < 0) goto fail;
    if (n_prompt == 0) {
        fprintf(stderr, "ember: the prompt has no tokens\n");
        goto done;
    }
    if (n_ctx <= 0) n_ctx = (int)n_prompt + n_predict;
    if (n_ctx > hp->n_ctx_train) n_ctx = hp->n_ctx_train;
    engine_config cfg = engine_default_config();
    cfg.n_threads = threads;
    cfg.prefill_step = batch;
    cfg.n_ctx = n_ctx;
    cfg.num_blocks = (n_ctx + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS + 1;
    cfg.kv_format = kv_fmt;
    eng = engine_create(m, &cfg, &err);
    stream = tok_stream_create(tok, false);
    if (eng == NULL) goto fail;
    if (stream == NULL) {
        fprintf(stderr, "ember: out of memory\n");
        goto done;
    }
    req.prompt = ids;
    req.n_prompt = (int64_t)n_prompt;
    req.max_tokens = n_predict;
    req.cache = ENGINE_CACHE_BYPASS;
    req.stop_at_eog = true;
    out.stream = stream;
    out.progress = isatty(STDERR_FILENO) && n_prompt > (size_t)batch;
    req.on_token = print_token;
    req.on_prefill = show_prefill;
    req.user = &out;
    if (engine_generate(eng, &req, &res, &err) < 0) goto fail;
    size_t len;
    const char *tail = tok_stream_flush(stream, &len);
    fwrite(tail, 1, len, stdout);
    printf("\n");
    double decode_s = res.total_s - res.ttft_s;
    fprintf(stderr, "ember: prefill %lld tokens in %.3f s (%.1f tok/s); decode %d tokens in %.3f s (%.1f tok/s)\n",
            (long long)n_prompt, res.ttft_s, n_prompt / res.ttft_s, res.n_tokens, decode_s,
            res.n_tokens > 1 && decode_s > 0 ? (res.n_tokens - 1) / decode_s : 0.0);
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "ember: %s\n", err.msg);
done:
    engine_result_free(&res);
    tok_stream_free(stream);
    engine_free(eng);
    free(ids);
    model_free(m);
    return rc;
}
