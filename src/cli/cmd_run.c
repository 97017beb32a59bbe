/* cmd_run.c - `ember run MODEL -p TEXT [-n N] [--temp T] [--seed S] ...`.
 *
 * Streams the continuation of a prompt to stdout and reports prefill and
 * decode throughput on stderr. The prompt follows the engine's schedule
 * (design.md §1): tokens [0, N-1) are prefilled in chunks on a fixed grid of
 * absolute positions, and the last prompt token is forwarded alone as the
 * first decode step, so that a later warm start from any cache tier sees the
 * same computation as this cold one. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_common.h"
#include "cli/commands.h"
#include "core/clock.h"
#include "sample/sampler.h"

static int usage(void) {
    fprintf(stderr,
            "usage: ember run MODEL -p TEXT [-n N] [--temp T] [--seed S] [--threads K]\n"
            "                 [--top-k K] [--top-p P] [--min-p P] [--repeat-penalty R] [--ctx N] [--batch B]\n");
    return 2;
}

int cmd_run(int argc, char **argv) {
    const char *model_path = NULL, *prompt = NULL;
    int n_predict = 128, threads = 0, n_ctx = 0, batch = 512;
    sampler_params sp = sampler_default_params();
    sp.temperature = 0.0f; /* greedy unless asked otherwise: reproducible by default */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "-p") == 0 && val) { prompt = val; i++; }
        else if (strcmp(a, "-n") == 0) { n_predict = (int)cli_parse_long(a, val, 0, 1 << 24); i++; }
        else if (strcmp(a, "--temp") == 0) { sp.temperature = (float)cli_parse_double(a, val); i++; }
        else if (strcmp(a, "--seed") == 0) { sp.seed = (uint64_t)cli_parse_long(a, val, 0, __LONG_MAX__); i++; }
        else if (strcmp(a, "--threads") == 0) { threads = (int)cli_parse_long(a, val, 1, 1024); i++; }
        else if (strcmp(a, "--top-k") == 0) { sp.top_k = (int32_t)cli_parse_long(a, val, 0, 1 << 30); i++; }
        else if (strcmp(a, "--top-p") == 0) { sp.top_p = (float)cli_parse_double(a, val); i++; }
        else if (strcmp(a, "--min-p") == 0) { sp.min_p = (float)cli_parse_double(a, val); i++; }
        else if (strcmp(a, "--repeat-penalty") == 0) { sp.repeat_penalty = (float)cli_parse_double(a, val); i++; }
        else if (strcmp(a, "--ctx") == 0) { n_ctx = (int)cli_parse_long(a, val, 16, 1 << 24); i++; }
        else if (strcmp(a, "--batch") == 0) { batch = (int)cli_parse_long(a, val, 1, 1 << 16); i++; }
        else if (a[0] != '-' && model_path == NULL) model_path = a;
        else return usage();
    }
    if (model_path == NULL || prompt == NULL) return usage();

    cli_engine e;
    if (cli_engine_open(&e, model_path, threads, n_ctx, batch) < 0) return 1;
    int n_prompt = 0;
    int32_t *ids = cli_tokenize_prompt(&e, prompt, &n_prompt);
    sampler *smp = sampler_create(&sp);
    const tokenizer *tok = model_get_tokenizer(e.m);
    tok_stream *stream = tok_stream_create(tok, false);
    int n_vocab = model_get_hparams(e.m)->n_vocab;
    float *logits = malloc((size_t)n_vocab * sizeof(float));
    int rc = 1;
    ember_error err;
    if (ids == NULL || smp == NULL || stream == NULL || logits == NULL) goto done;
    if (n_prompt == 0) {
        fprintf(stderr, "ember: the prompt has no tokens\n");
        goto done;
    }
    if (n_prompt + n_predict > e.n_ctx) {
        fprintf(stderr, "ember: prompt (%d tokens) + %d new tokens exceed the context of %d (use --ctx)\n", n_prompt,
                n_predict, e.n_ctx);
        goto done;
    }
    for (int i = 0; i < n_prompt; i++) sampler_accept(smp, ids[i]);

    double t0 = ember_now();
    /* Grid chunks over [0, N-1): chunk k covers [k*batch, (k+1)*batch). */
    for (int start = 0; start < n_prompt - 1; start += batch) {
        int n = n_prompt - 1 - start < batch ? n_prompt - 1 - start : batch;
        if (model_eval(e.ctx, &e.seq, ids + start, n, false, logits, &err) < 0) goto fail;
    }
    if (model_eval(e.ctx, &e.seq, ids + n_prompt - 1, 1, false, logits, &err) < 0) goto fail;
    double t1 = ember_now();

    int n_generated = 0;
    for (; n_generated < n_predict; n_generated++) {
        int32_t next = sampler_sample(smp, logits, n_vocab);
        sampler_accept(smp, next);
        if (tokenizer_is_eog(tok, next)) break;
        size_t len;
        const char *text = tok_stream_push(stream, next, &len);
        fwrite(text, 1, len, stdout);
        fflush(stdout);
        if (n_generated + 1 == n_predict) {
            n_generated++;
            break;
        }
        if (model_eval(e.ctx, &e.seq, &next, 1, false, logits, &err) < 0) goto fail;
    }
    size_t len;
    const char *tail = tok_stream_flush(stream, &len);
    fwrite(tail, 1, len, stdout);
    printf("\n");
    double t2 = ember_now();
    fprintf(stderr, "ember: prefill %d tokens in %.3f s (%.1f tok/s); decode %d tokens in %.3f s (%.1f tok/s)\n",
            n_prompt, t1 - t0, n_prompt / (t1 - t0), n_generated, t2 - t1,
            n_generated > 0 ? n_generated / (t2 - t1) : 0.0);
    rc = 0;
    goto done;
fail:
    fprintf(stderr, "ember: %s\n", err.msg);
done:
    free(logits);
    tok_stream_free(stream);
    sampler_free(smp);
    free(ids);
    cli_engine_close(&e);
    return rc;
}
