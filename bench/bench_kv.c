/* bench_kv.c - what each KV format costs in quality, memory and decode speed.
 *
 * Usage: bench_kv MODEL --text FILE [--window W] [--threads N] [--formats f32,f16,q8_0,f16@bf16]
 *                 [--decode-ctx 4096] [--decode-steps 8] [--decode-rounds 4] [--second-halves 1]
 *
 * Quality: the text is tokenized (with BOS) and cut into windows of W tokens
 * (default: the model's training context, at most the text). Each window is
 * forwarded once per format, 512 positions per batch, every position's
 * logits kept; against f32 KV (the reference) each format reports the mean
 * KL divergence KL(p_f32 || p_fmt) of the next-token distributions, the
 * top-1 agreement (argmax equal), and the perplexity of the text itself
 * (exp of the mean negative log-likelihood of each actual next token).
 * --second-halves 1 scores only the second half of each full window, as
 * llama-perplexity does (its KL and "same top" figures compare then). All
 * formats run side by side on the same chunk so only two chunks of logits
 * are alive at once (a 151936-word vocabulary makes them large).
 *
 * A format with "@bf16" (f16@bf16, f32@bf16), or "@int8", runs that pool with that
 * attention (ops.h attention_precision), scored against the same f32
 * reference: what the bf16 products cost, beside what the formats cost.
 *
 * kvarn (e.g. kvarn-k6v5, kvarn-k4v4-t0) is the real pool format
 * (kv_pool.h): groups sealed in place by position, attention reading the
 * records (attention_kvarn.c). Batches of 128 positions, as for every
 * format (a kvarn pool gives the same logits for any chunking).
 *
 * Memory: bytes per token of K and V over all layers (kv_format_token_bytes)
 * and tokens per GiB of pool; for kvarn also the bytes of pool a token of a
 * sealed group takes (kv_format_sealed_token_bytes: the blocks a sealed
 * group keeps, the rest given back).
 *
 * Speed: decode tokens/s at a context of --decode-ctx tokens. The sequence's
 * K/V rows are filled with random values (encoded in the format) instead of
 * prefilling 4k tokens, which would take minutes on two cores and measure
 * nothing more: a decode step's cost does not depend on the values. Then
 * rounds of --decode-steps single-token steps are timed, the formats taking
 * turns within each round, and each format's best round is reported (on a
 * shared machine the least disturbed round is the truest figure). Beside
 * it, one thread's attention time for one token over that context, all
 * layers (each layer's best of 5 tries, summed): the part of the step the
 * format changes, free of the matrix products' noise.
 *
 * llama.cpp beside it: --llama-perplexity PATH (a local llama-perplexity
 * binary; never part of ember) runs the same text in the same windows
 * through llama.cpp: a base with an f32 cache (no flash attention: its
 * flash attention takes no f32 K), then f16, q8_0 and q4_0 caches with flash
 * attention (a quantized V needs it), each scored against the base
 * (--kl-divergence, second halves of each window), and prints its mean KL,
 * "same top" and cache bytes per token. Compare them with a run of this
 * tool under --second-halves 1, which scores the same positions. Two
 * limits of those figures: llama-perplexity prints the mean KL with six
 * decimals, and it keeps the base's log-probabilities as 16-bit values,
 * so its own floor is near 1e-6 (single positions even score below zero). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/clock.h"
#include "core/rng.h"
#include "model/model.h"
#include "tensor/attention_kvarn.h"
#include "tensor/kvarn.h"
#include "tensor/ops.h"
#include "tokenizer/tokenizer.h"

#define MAX_FORMATS 6
/* 128 positions per batch (every format is batch-invariant: the chunk size
 * does not change the logits). */
#define CHUNK KVARN_GROUP

typedef struct fmt_run {
    kv_format fmt;
    attention_precision attention;
    kv_pool *pool;
    model_ctx *ctx;
    kv_seq seq;
    double kl, nll;
    int64_t top1, n_kl, n_nll;
} fmt_run;

static void *read_text(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) buf[n] = 0;
    *len = (size_t)n;
    return buf;
}

/* log-softmax of x (n) into out, in double. */
static void log_softmax(const float *x, int n, double *out) {
    double max = -INFINITY;
    for (int i = 0; i < n; i++) max = x[i] > max ? x[i] : max;
    double sum = 0;
    for (int i = 0; i < n; i++) sum += exp((double)x[i] - max);
    double lse = max + log(sum);
    for (int i = 0; i < n; i++) out[i] = (double)x[i] - lse;
}

static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* bytes a llama.cpp cache of type `type` takes per token over all layers */
static double llama_cache_bytes(const model_hparams *hp, const char *type) {
    double values = 2.0 * hp->n_layer * hp->n_head_kv * hp->d_k; /* K and V */
    if (strcmp(type, "f16") == 0) return values * 2;
    if (strcmp(type, "q8_0") == 0) return values * 34 / 32; /* 32 int8 + an f16 scale */
    if (strcmp(type, "q4_0") == 0) return values * 18 / 32; /* 32 nibbles + an f16 scale */
    return values * 4;
}

/* Runs llama-perplexity with `args` after the model, text and window;
 * returns its exit status, with its output lines scanned for the mean KL
 * and the "same top" share (NAN where absent). On failure the last line
 * it printed is left in `last` (it names what stopped it). */
static int llama_perplexity(const char *exe, const char *model_path, const char *text_path, int window, int threads,
                            const char *args, double *kl, double *same_top, char *last, size_t last_size) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' -m '%s' -f '%s' -c %d -b %d -t %d %s 2>&1", exe, model_path, text_path, window,
             window, threads, args);
    *kl = NAN;
    *same_top = NAN;
    last[0] = 0;
    FILE *p = popen(cmd, "r");
    if (p == NULL) return -1;
    char line[4096];
    while (fgets(line, sizeof line, p)) {
        if (strncmp(line, "Mean    KLD:", 12) == 0) *kl = atof(line + 12);
        else if (strncmp(line, "Same top p:", 11) == 0) *same_top = atof(line + 11);
        if (line[0] != '\n') {
            strncpy(last, line, last_size - 1);
            last[last_size - 1] = 0;
        }
    }
    size_t l = strlen(last);
    if (l && last[l - 1] == '\n') last[l - 1] = 0;
    return pclose(p);
}

static void llama_rows(const char *exe, const char *model_path, const char *text_path, int window, int threads,
                       const model_hparams *hp) {
    char base[] = "/tmp/bench_kv_base_XXXXXX", args[512], last[512];
    int fd = mkstemp(base);
    if (fd < 0) {
        fprintf(stderr, "bench_kv: cannot make a file for llama.cpp's base logits\n");
        return;
    }
    close(fd);
    double kl, top;
    snprintf(args, sizeof args, "-ctk f32 -ctv f32 --kl-divergence-base '%s'", base);
    printf("llama.cpp (%s), windows of %d, second halves scored against its f32-cache base:\n", exe, window);
    if (llama_perplexity(exe, model_path, text_path, window, threads, args, &kl, &top, last, sizeof last) != 0) {
        printf("  llama.cpp could not run this model: %s\n", last);
        unlink(base);
        return;
    }
    static const char *types[] = {"f16", "q8_0", "q4_0"};
    for (int i = 0; i < 3; i++) {
        snprintf(args, sizeof args, "-fa -ctk %s -ctv %s --kl-divergence-base '%s' --kl-divergence", types[i], types[i],
                 base);
        char name[32];
        snprintf(name, sizeof name, "llama.cpp %s", types[i]);
        if (llama_perplexity(exe, model_path, text_path, window, threads, args, &kl, &top, last, sizeof last) != 0 ||
            isnan(kl)) {
            printf("%-18s could not run: %s\n", name, last);
            continue;
        }
        printf("%-18s %12.6f %9.2f%% %12s %12.0f\n", name, kl, top, "-", llama_cache_bytes(hp, types[i]));
    }
    unlink(base);
}

static int open_run(const model *m, fmt_run *r, int32_t n_blocks, int threads, ember_error *err) {
    kv_pool_config kc;
    model_kv_config(m, n_blocks, &kc);
    kc.format = r->fmt;
    const char *why = NULL;
    kc.attention = model_attention_precision(m, r->fmt, r->attention, &why);
    if (why) return ember_fail(err, "bf16 attention is not available: %s", why);
    r->pool = kv_pool_create(&kc, err);
    if (r->pool == NULL) return -1;
    r->ctx = model_ctx_create(m, r->pool, threads, CHUNK, err);
    if (r->ctx == NULL) return -1;
    kv_seq_init(&r->seq);
    return 0;
}

static void close_run(fmt_run *r) {
    if (r->pool) kv_seq_release(r->pool, &r->seq);
    model_ctx_free(r->ctx);
    kv_pool_free(r->pool);
    r->pool = NULL;
    r->ctx = NULL;
}

/* A sequence of n_ctx positions of random K/V rows in r's format. */
static int fill_context(const model *m, fmt_run *r, int n_ctx, int spare, int threads, ember_error *err) {
    if (open_run(m, r, (n_ctx + spare) / KV_BLOCK_TOKENS + 2, threads, err) < 0) return -1;
    if (kv_seq_prepare_append(r->pool, &r->seq, n_ctx, err) < 0) return -1;
    kv_pool_config kc;
    model_kv_config(m, 1, &kc);
    int widest = 1;
    for (int l = 0; l < kc.n_layer; l++) {
        if (kc.k_width[l] > widest) widest = kc.k_width[l];
        if (kc.v_width[l] > widest) widest = kc.v_width[l];
    }
    float *row = malloc((size_t)widest * sizeof(float));
    if (row == NULL) return ember_fail(err, "out of memory");
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (int64_t p = 0; p < n_ctx; p++)
        for (int l = 0; l < kc.n_layer; l++)
            for (int kv = 0; kv < 2; kv++) {
                int w = kv == 0 ? kc.k_width[l] : kc.v_width[l];
                if (w == 0) continue;
                for (int i = 0; i < w; i++) {
                    s = s * 6364136223846793005ull + 1442695040888963407ull;
                    row[i] = (float)((s >> 40) & 0xFFFF) / 32768.0f - 1.0f;
                }
                kv_row_write(r->pool, r->seq.blocks[p / KV_BLOCK_TOKENS], l, kv, (int)(p % KV_BLOCK_TOKENS), row);
            }
    free(row);
    r->seq.n_tokens = n_ctx;
    /* kvarn: the groups a query at n_ctx - 1 reads as records are sealed. */
    int64_t sealed_end = kv_kvarn_sealed_end(r->fmt, n_ctx - 1);
    if (sealed_end > 1) {
        float *scratch = malloc(kv_kvarn_scratch_floats(r->pool) * sizeof(float));
        if (scratch == NULL) return ember_fail(err, "out of memory");
        for (int l = 0; l < kc.n_layer; l++)
            if (kc.k_width[l] > 0)
                for (int64_t g = 1; g < sealed_end; g++) kv_kvarn_seal_group(r->pool, &r->seq, l, g, scratch);
        free(scratch);
    }
    return 0;
}

/* Milliseconds one thread spends in attention for one query token over
 * r's whole context, all layers (the part of a decode step the format
 * changes; the matrix products stay the same). */
static double attention_ms(const model *m, fmt_run *r) {
    const model_hparams *hp = model_get_hparams(m);
    int32_t nb = r->seq.n_blocks;
    const void **kp = malloc((size_t)nb * sizeof(void *)), **vp = malloc((size_t)nb * sizeof(void *));
    float *q = calloc((size_t)hp->n_head * hp->d_k, sizeof(float));
    float *out = malloc((size_t)hp->n_head * hp->d_v * sizeof(float));
    int group = hp->n_head / hp->n_head_kv;
    float *scratch = malloc((size_t)group * (size_t)(r->seq.n_tokens + 1) * sizeof(float));
    for (int i = 0; i < hp->n_head * hp->d_k; i++) q[i] = 0.01f * (float)(i % 13);
    int64_t pos = r->seq.n_tokens - 1;
    kv_row_type type = kv_format_row_type(kv_pool_format(r->pool));
    kv_format fmt = kv_pool_format(r->pool);
    /* Each layer's best of a few tries, summed: a try is a few ms, short
     * enough to fall between the other processes' time slices on a shared
     * machine, where one 28-layer pass never does. */
    double ms = 0;
    for (int l = 0; l < hp->n_layer; l++) {
        if (kv_pool_row_bytes(r->pool, l, 0) == 0) continue;
        for (int32_t b = 0; b < nb; b++) {
            kp[b] = kv_block_k(r->pool, r->seq.blocks[b], l);
            vp[b] = kv_block_v(r->pool, r->seq.blocks[b], l);
        }
        attention_kvarn_format af = {fmt.k_bits, fmt.v_bits, fmt.tail, kv_pool_width(r->pool, l, 0),
                                     kv_pool_width(r->pool, l, 1), kv_pool_kvarn_layout(r->pool, l)};
        double best = -1;
        for (int attempt = 0; attempt < 5; attempt++) {
            double t0 = ember_now();
            for (int g = 0; g < hp->n_head_kv; g++)
                if (kv_format_is_kvarn(fmt))
                    op_attention_kvarn_rows(out, (size_t)hp->n_head * hp->d_v, q, (size_t)hp->n_head * hp->d_k, kp, vp,
                                            &af, &pos, 1, hp->n_head, hp->n_head_kv, hp->d_k, hp->d_v, 0.08f, 0,
                                            g * group, (g + 1) * group, scratch);
                else
                    op_attention_paged_rows(out, (size_t)hp->n_head * hp->d_v, q, (size_t)hp->n_head * hp->d_k, kp, vp,
                                            type, &pos, 1, hp->n_head, hp->n_head_kv, hp->d_k, hp->d_v, 0.08f, 0,
                                            g * group, (g + 1) * group, scratch);
            double t = (ember_now() - t0) * 1e3;
            if (best < 0 || t < best) best = t;
        }
        ms += best;
    }
    free(kp);
    free(vp);
    free(q);
    free(out);
    free(scratch);
    return ms;
}

/* Decode tokens/s of each format at a context of n_ctx tokens: rounds of
 * `steps` single-token steps, formats interleaved within each round, the
 * best round per format (the machine is shared: the fastest round is the
 * one least disturbed). Rounds start after one warm-up step at n_ctx and go
 * back to n_ctx + 1: with kvarn's default tail the step at 4096 seals a
 * group, and a sequence cut back below a sealed group would not be one the
 * pool can hold (one seal per 128 steps is a decode's real rate). */
static void decode_rates(const model *m, fmt_run *runs, int n_fmt, int n_ctx, int steps, int rounds, int threads,
                         double *rate, double *attn_ms) {
    ember_error err;
    fmt_run dec[MAX_FORMATS];
    memset(dec, 0, sizeof dec);
    float *logits = malloc((size_t)model_get_hparams(m)->n_vocab * sizeof(float));
    int32_t tok = 100 % model_get_hparams(m)->n_vocab;
    for (int f = 0; f < n_fmt; f++) {
        rate[f] = -1;
        attn_ms[f] = -1;
        dec[f].fmt = runs[f].fmt;
        dec[f].attention = runs[f].attention;
        if (fill_context(m, &dec[f], n_ctx, steps + 2, threads, &err) < 0 ||
            model_eval(dec[f].ctx, &dec[f].seq, &tok, 1, false, logits, &err) < 0) {
            fprintf(stderr, "bench_kv: decode at %d in %s: %s\n", n_ctx, kv_format_name(dec[f].fmt), err.msg);
            close_run(&dec[f]);
        }
    }
    for (int round = 0; round < rounds; round++)
        for (int f = 0; f < n_fmt; f++) {
            if (dec[f].ctx == NULL) continue;
            kv_seq_truncate(dec[f].pool, &dec[f].seq, n_ctx + 1);
            double t0 = ember_now();
            int i = 0;
            for (; i < steps; i++)
                if (model_eval(dec[f].ctx, &dec[f].seq, &tok, 1, false, logits, &err) < 0) break;
            double r = steps / (ember_now() - t0);
            if (i == steps && r > rate[f]) rate[f] = r;
            kv_seq_truncate(dec[f].pool, &dec[f].seq, n_ctx + 1);
            double ms = attention_ms(m, &dec[f]);
            if (attn_ms[f] < 0 || ms < attn_ms[f]) attn_ms[f] = ms;
        }
    for (int f = 0; f < n_fmt; f++) close_run(&dec[f]);
    free(logits);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_kv MODEL --text FILE [--window W] [--threads N] [--formats f32,f16,q8_0] "
                        "[--decode-ctx 4096] [--decode-steps 8] [--decode-rounds 4] [--second-halves 1] "
                        "[--llama-perplexity PATH]\n");
        return 2;
    }
    const char *path = argv[1], *text_path = NULL, *llama_exe = NULL;
    int threads = 2, window = 0, decode_ctx = 4096, decode_steps = 8, decode_rounds = 4, second_halves = 0;
    char formats_arg[128] = "f32,f16,q8_0";
    for (int i = 2; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--text") == 0) text_path = argv[i + 1];
        else if (strcmp(argv[i], "--threads") == 0) threads = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--window") == 0) window = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--decode-ctx") == 0) decode_ctx = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--decode-steps") == 0) decode_steps = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--decode-rounds") == 0) decode_rounds = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--second-halves") == 0) second_halves = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--llama-perplexity") == 0) llama_exe = argv[i + 1][0] ? argv[i + 1] : NULL;
        else if (strcmp(argv[i], "--formats") == 0) snprintf(formats_arg, sizeof formats_arg, "%s", argv[i + 1]);
        else {
            fprintf(stderr, "bench_kv: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (text_path == NULL) {
        fprintf(stderr, "bench_kv: --text FILE is required\n");
        return 2;
    }
    fmt_run runs[MAX_FORMATS];
    memset(runs, 0, sizeof runs);
    int n_fmt = 1; /* runs[0] is the f32 reference */
    runs[0].fmt = (kv_format){KV_FORMAT_F32};
    for (char *tok = strtok(formats_arg, ","); tok; tok = strtok(NULL, ",")) {
        kv_format f;
        if (n_fmt == MAX_FORMATS) break;
        char *at = strchr(tok, '@');
        attention_precision prec = ATTENTION_F32;
        if (at) {
            *at = 0;
            if (!attention_precision_parse(at + 1, &prec)) {
                fprintf(stderr, "bench_kv: unknown attention precision '%s' (f32, bf16, int8)\n", at + 1);
                return 2;
            }
        }
        if (kv_format_parse(tok, &f) < 0) {
            fprintf(stderr, "bench_kv: unknown format '%s' (%s)\n", tok, KV_FORMAT_CHOICES);
            return 2;
        }
        if (f.kind == KV_FORMAT_F32 && prec == ATTENTION_F32) continue;
        runs[n_fmt].attention = prec;
        runs[n_fmt++].fmt = f;
    }

    ember_error err;
    model *m = model_load(path, &err);
    if (m == NULL) {
        fprintf(stderr, "bench_kv: %s\n", err.msg);
        return 1;
    }
    const model_hparams *hp = model_get_hparams(m);
    int V = hp->n_vocab;
    size_t text_len;
    char *text = read_text(text_path, &text_len);
    int32_t *ids = NULL;
    size_t n_ids = 0;
    if (text == NULL || tokenizer_encode(model_get_tokenizer(m), text, text_len, true, false, &ids, &n_ids, &err) < 0) {
        fprintf(stderr, "bench_kv: %s: %s\n", text_path, text ? err.msg : "cannot read");
        return 1;
    }
    free(text);
    if (window <= 0) window = hp->n_ctx_train > 0 ? hp->n_ctx_train : 2048;
    if ((size_t)window > n_ids) window = (int)n_ids;

    printf("model %s: %s, %d layers, heads %d/%d of %d, vocab %d, %d threads\n", path, hp->arch_name, hp->n_layer,
           hp->n_head, hp->n_head_kv, hp->d_k, V, threads);
    printf("text %s: %zu tokens in windows of %d\n", text_path, n_ids, window);
    fflush(stdout);

    for (int f = 0; f < n_fmt; f++)
        if (open_run(m, &runs[f], window / KV_BLOCK_TOKENS + 2, threads, &err) < 0) {
            fprintf(stderr, "bench_kv: %s: %s\n", kv_format_name(runs[f].fmt), err.msg);
            return 1;
        }
    float *ref = malloc((size_t)CHUNK * V * sizeof(float)), *got = malloc((size_t)CHUNK * V * sizeof(float));
    double *lp_ref = malloc((size_t)V * sizeof(double)), *lp = malloc((size_t)V * sizeof(double));
    if (!ref || !got || !lp_ref || !lp) {
        fprintf(stderr, "bench_kv: out of memory for logits of %d positions\n", CHUNK);
        return 1;
    }
    double t_start = ember_now();
    for (size_t w0 = 0; w0 + 2 <= n_ids; w0 += (size_t)window) {
        int wn = n_ids - w0 < (size_t)window ? (int)(n_ids - w0) : window;
        for (int f = 0; f < n_fmt; f++) kv_seq_truncate(runs[f].pool, &runs[f].seq, 0);
        for (int c0 = 0; c0 < wn; c0 += CHUNK) {
            int cn = wn - c0 < CHUNK ? wn - c0 : CHUNK;
            const int32_t *chunk = ids + w0 + (size_t)c0;
            for (int f = 0; f < n_fmt; f++) {
                float *out = f == 0 ? ref : got;
                if (model_eval(runs[f].ctx, &runs[f].seq, chunk, cn, true, out, &err) < 0) {
                    fprintf(stderr, "bench_kv: %s\n", err.msg);
                    return 1;
                }
                for (int i = 0; i < cn; i++) {
                    const float *lr = ref + (size_t)i * V, *lg = out + (size_t)i * V;
                    bool has_next = c0 + i + 1 < wn;
                    if (second_halves && (wn < window || c0 + i < window / 2)) continue;
                    if (f == 0) {
                        if (has_next) {
                            log_softmax(lr, V, lp_ref);
                            runs[0].nll -= lp_ref[chunk[i + 1]];
                            runs[0].n_nll++;
                        }
                        continue;
                    }
                    log_softmax(lr, V, lp_ref);
                    log_softmax(lg, V, lp);
                    double kl = 0;
                    for (int v = 0; v < V; v++) kl += exp(lp_ref[v]) * (lp_ref[v] - lp[v]);
                    runs[f].kl += kl;
                    runs[f].n_kl++;
                    runs[f].top1 += argmax(lr, V) == argmax(lg, V);
                    if (has_next) {
                        runs[f].nll -= lp[chunk[i + 1]];
                        runs[f].n_nll++;
                    }
                }
            }
        }
    }
    printf("quality over %lld positions (%.0f s)\n", (long long)runs[0].n_nll, ember_now() - t_start);
    printf("%-18s %12s %10s %12s %12s %12s %14s %14s %12s\n", "format", "mean KL", "top-1", "perplexity",
           "bytes/token", "sealed B/tok", "tokens/GiB", "decode tok/s", "attn ms/tok");
    kv_pool_config kc;
    model_kv_config(m, 1, &kc);
    for (int f = 0; f < n_fmt; f++) close_run(&runs[f]);
    double rates[MAX_FORMATS], attn[MAX_FORMATS];
    decode_rates(m, runs, n_fmt, decode_ctx, decode_steps, decode_rounds < 1 ? 1 : decode_rounds, threads, rates,
                 attn);
    for (int f = 0; f < n_fmt; f++) {
        kc.format = runs[f].fmt;
        size_t bpt = kv_format_token_bytes(&kc), sealed = kv_format_sealed_token_bytes(&kc);
        char kl[32], top[32], speed[32], att[32];
        if (f == 0) {
            snprintf(kl, sizeof kl, "(reference)");
            snprintf(top, sizeof top, "-");
        } else {
            snprintf(kl, sizeof kl, "%.3g", runs[f].n_kl ? runs[f].kl / (double)runs[f].n_kl : 0.0);
            snprintf(top, sizeof top, "%.2f%%", runs[f].n_kl ? 100.0 * (double)runs[f].top1 / (double)runs[f].n_kl : 0.0);
        }
        if (rates[f] > 0) snprintf(speed, sizeof speed, "%.2f", rates[f]);
        else snprintf(speed, sizeof speed, "-");
        if (attn[f] > 0) snprintf(att, sizeof att, "%.1f", attn[f]);
        else snprintf(att, sizeof att, "-");
        char name[48];
        snprintf(name, sizeof name, "%s%s", kv_format_name(runs[f].fmt),
                 runs[f].attention == ATTENTION_BF16   ? " bf16-att"
                 : runs[f].attention == ATTENTION_INT8 ? " int8-att"
                                                       : "");
        printf("%-18s %12s %10s %12.4f %12zu %12zu %14.0f %14s %12s\n", name, kl, top,
               exp(runs[f].nll / (double)(runs[f].n_nll ? runs[f].n_nll : 1)), bpt, sealed,
               (double)(1u << 30) / (double)bpt, speed, att);
        fflush(stdout);
    }
    printf("decode: tokens/s of single-token steps at a context of %d tokens (best of %d rounds of %d steps, formats "
           "interleaved); attn: one thread's attention of one token over that context, all layers (best round)\n",
           decode_ctx, decode_rounds, decode_steps);
    if (llama_exe) llama_rows(llama_exe, path, text_path, window, threads, hp);
    free(ref);
    free(got);
    free(lp_ref);
    free(lp);
    free(ids);
    model_free(m);
    return 0;
}
