/* cmd_run.c - `ember run MODEL -p TEXT [-n N] [--temp T] [--seed S] ...`.
 *
 * Streams the continuation of a prompt to stdout and reports prefill and
 * decode throughput on stderr. The request goes through engine_generate, the
 * same runner the server uses, so the prompt follows the engine's schedule
 * (design.md §1: grid-aligned prefill chunks, the last prompt token forwarded
 * alone). One request has nothing to reuse, so it bypasses the cache. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "engine/engine.h"

static int usage(void) {
    fprintf(stderr,
            "usage: ember run MODEL -p TEXT [-n N] [--temp T] [--seed S] [--threads K]\n"
            "                 [--top-k K] [--top-p P] [--min-p P] [--repeat-penalty R] [--ctx N] [--batch B]\n");
    return 2;
}

static bool print_token(void *user, int32_t token) {
    size_t len;
    const char *text = tok_stream_push(user, token, &len);
    fwrite(text, 1, len, stdout);
    fflush(stdout);
    return true;
}

int cmd_run(int argc, char **argv) {
    const char *model_path = NULL, *prompt = NULL;
    int n_predict = 128, threads = 0, n_ctx = 0, batch = 512;
    engine_request req = engine_default_request();
    req.sampling = sampler_default_params();
    req.sampling.temperature = 0.0f; /* greedy unless asked otherwise: reproducible by default */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "-p") == 0 && val) { prompt = val; i++; }
        else if (strcmp(a, "-n") == 0) { n_predict = (int)cli_parse_long(a, val, 0, 1 << 24); i++; }
        else if (strcmp(a, "--temp") == 0) { req.sampling.temperature = (float)cli_parse_double(a, val); i++; }
        else if (strcmp(a, "--seed") == 0) { req.sampling.seed = (uint64_t)cli_parse_long(a, val, 0, __LONG_MAX__); i++; }
        else if (strcmp(a, "--threads") == 0) { threads = (int)cli_parse_long(a, val, 1, 1024); i++; }
        else if (strcmp(a, "--top-k") == 0) { req.sampling.top_k = (int32_t)cli_parse_long(a, val, 0, 1 << 30); i++; }
        else if (strcmp(a, "--top-p") == 0) { req.sampling.top_p = (float)cli_parse_double(a, val); i++; }
        else if (strcmp(a, "--min-p") == 0) { req.sampling.min_p = (float)cli_parse_double(a, val); i++; }
        else if (strcmp(a, "--repeat-penalty") == 0) { req.sampling.repeat_penalty = (float)cli_parse_double(a, val); i++; }
        else if (strcmp(a, "--ctx") == 0) { n_ctx = (int)cli_parse_long(a, val, 16, 1 << 24); i++; }
        else if (strcmp(a, "--batch") == 0) { batch = (int)cli_parse_long(a, val, 1, 1 << 16); i++; }
        else if (a[0] != '-' && model_path == NULL) model_path = a;
        else return usage();
    }
    if (model_path == NULL || prompt == NULL) return usage();

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
    req.on_token = print_token;
    req.user = stream;
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
