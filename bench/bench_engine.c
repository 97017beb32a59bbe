/* bench_engine.c - prefill and decode throughput of the engine, beside llama.cpp.
 *
 * Usage: bench_engine MODEL [--threads 2] [--reps 3] [--prefill 512,2048] [--decode 128]
 *                     [--kv f16] [--chunk 0] [--then-decode 0] [--clock wall|cpu]
 *                     [--llama-bench PATH] [--busy-core C] [--rounds 3] [--label NAME]
 *                     [--attention f32|bf16|int8|both] [--isa scalar|avx2|avx512] [--warmup 0]
 *
 * For each prefill length P: a fresh sequence forwards P tokens in one batch
 * (as llama-bench's pp test does), or in grid chunks of --chunk tokens (as
 * the engine prefills, 512 by default there). Decode: after a 16-token
 * prompt, D single-token steps (llama-bench's tg test). --then-decode N also
 * times N decode steps after each prefill (row "decode@P": decode at P
 * tokens of context, without a second long prefill). K/V rows are stored as
 * --kv says (f16 by default, as `ember serve` stores them). --clock cpu
 * times by the process's CPU clock instead of the wall: with --threads 1
 * that is the figure a quiet machine would show, whatever else runs on a
 * shared one (with more threads it also counts the pool's spinning). Each
 * figure is the median of --reps runs with the spread (min..max).
 *
 * --attention bf16 (or int8) runs attention at that precision (ops.h; falls
 * back to f32 where the CPU or model cannot, and says so); `both` keeps a second
 * pool at bf16 and, for every test, alternates f32 and bf16 runs rep by
 * rep, printing a bf16 row under each f32 row with bf16/f32 in the ratio
 * column, so both precisions are measured side by side under the same load.
 *
 * --warmup N runs N untimed prefills of 512 tokens (or the longest test,
 * if shorter) before the tests: the first prefills of a process run
 * slower (2 threads, 512 tokens, eight in a row: 427, 543, 576, 593, 550,
 * 575, 593 tok/s) while pages of the weights, the pool and the buffers
 * come in, so a ratio against 512 taken from the first runs flatters the
 * other side.
 *
 * --isa runs the kernels of that instruction set (as on a CPU that has
 * nothing better; the CPU must have it): the AVX2 paths measured here.
 *
 * --llama-bench PATH runs that llama-bench on the same file in the same run
 * (flash attention off and on, the faster counts, as the targets
 * say) and prints its figure and ember / llama.cpp. The machine is shared, so
 * only figures measured side by side mean anything. A file llama.cpp cannot
 * load (its build may not know the architecture) gets no ratio, and the
 * output says so.
 *
 * --busy-core C adds the contention rows: a child process spins pinned to
 * core C while the first prefill length and the decode test run again, for
 * ember and llama.cpp alike, alternating quiet and loaded runs for --rounds
 * rounds (llama.cpp with flash attention off in these pairs: one setting is
 * enough for a fraction). Each row gives the loaded/quiet fraction kept
 * (median over rounds) for both, so a noisy machine shifts both runs of a
 * pair the same way. */
#define _GNU_SOURCE
#include <sched.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/clock.h"
#include "model/model.h"
#include "tensor/dtype.h"
#include "tensor/quant.h"

enum { MAX_TESTS = 8 };

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static bool cpu_clock;

static double now(void) {
    if (!cpu_clock) return ember_now();
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return v[n / 2];
}

typedef struct bench {
    model *m;
    model_ctx *ctx;
    kv_pool *pool;
    model_state *state; /* recurrent models (mamba2, qwen35...), else NULL */
    int32_t *ids;
    float *logits;
    model_ctx *ctx_bf16; /* --attention both: a second context on a bf16 pool */
    kv_pool *pool_bf16;
    int chunk;       /* prefill in grid chunks of this many tokens; 0: one batch */
    int then_decode; /* decode steps timed after each prefill (decode@P) */
    double after;    /* their tokens/s, from the last prefill */
    ember_error err;
} bench;

/* Tokens/s of one prefill of n tokens, or of n decode steps after a 16-token prompt. */
static double ember_once_on(bench *b, model_ctx *ctx, kv_pool *pool, int n, bool decode) {
    kv_seq seq;
    kv_seq_init(&seq);
    double t0, t1;
    int rc = 0;
    if (b->state) model_state_reset(b->state);
    if (decode) {
        rc = model_eval_state(ctx, &seq, b->state, b->ids, 16, false, b->logits, &b->err);
        t0 = now();
        for (int i = 0; i < n && rc >= 0; i++)
            rc = model_eval_state(ctx, &seq, b->state, b->ids + 16 + i, 1, false, b->logits, &b->err);
        t1 = now();
    } else {
        int step = b->chunk > 0 ? b->chunk : n;
        t0 = now();
        for (int i = 0; i < n && rc >= 0; i += step)
            rc = model_eval_state(ctx, &seq, b->state, b->ids + i, n - i < step ? n - i : step, false, b->logits,
                                  &b->err);
        t1 = now();
        if (b->then_decode > 0 && rc >= 0) {
            double d0 = now();
            for (int i = 0; i < b->then_decode && rc >= 0; i++)
                rc = model_eval_state(ctx, &seq, b->state, b->ids + n + i, 1, false, b->logits, &b->err);
            b->after = b->then_decode / (now() - d0);
        }
    }
    kv_seq_release(pool, &seq);
    if (rc < 0) {
        fprintf(stderr, "bench_engine: %s\n", b->err.msg);
        exit(1);
    }
    return n / (t1 - t0);
}

static double ember_once(bench *b, int n, bool decode) { return ember_once_on(b, b->ctx, b->pool, n, decode); }

/* llama-bench on the same file: fills rate[i] for prompts[i] (and rate[n_prompts]
 * for the decode test) with the fastest over the flash-attention settings fa
 * ("0,1": off and on). Returns the
 * number of figures found (0: llama.cpp could not run this file). */
static int llama_run(const char *exe, const char *model_path, const char *fa, int threads, int reps,
                     const int *prompts, int n_prompts, int decode_n, double *rate) {
    char cmd[4096], list[256] = "";
    for (int i = 0; i < n_prompts; i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d", i ? "," : "", prompts[i]);
    int len = snprintf(cmd, sizeof cmd, "'%s' -m '%s' -t %d -r %d -fa %s -o csv", exe, model_path, threads, reps, fa);
    if (n_prompts > 0) len += snprintf(cmd + len, sizeof cmd - (size_t)len, " -p %s", list);
    else len += snprintf(cmd + len, sizeof cmd - (size_t)len, " -p 0");
    snprintf(cmd + len, sizeof cmd - (size_t)len, " -n %d 2>/dev/null", decode_n);
    for (int i = 0; i <= n_prompts; i++) rate[i] = 0;
    FILE *p = popen(cmd, "r");
    if (p == NULL) return 0;
    char line[8192];
    int col_p = -1, col_g = -1, col_ts = -1, found = 0;
    while (fgets(line, sizeof line, p)) {
        char *fields[64];
        int nf = 0;
        for (char *tok = strtok(line, ",\n"); tok && nf < 64; tok = strtok(NULL, ",\n")) {
            if (*tok == '"') tok++;
            size_t l = strlen(tok);
            if (l && tok[l - 1] == '"') tok[l - 1] = 0;
            fields[nf++] = tok;
        }
        if (col_ts < 0) {
            for (int i = 0; i < nf; i++) {
                if (strcmp(fields[i], "n_prompt") == 0) col_p = i;
                if (strcmp(fields[i], "n_gen") == 0) col_g = i;
                if (strcmp(fields[i], "avg_ts") == 0) col_ts = i;
            }
            continue;
        }
        if (col_p >= nf || col_g >= nf || col_ts >= nf || col_p < 0 || col_g < 0) continue;
        int np = atoi(fields[col_p]), ng = atoi(fields[col_g]);
        double ts = atof(fields[col_ts]);
        for (int i = 0; i < n_prompts; i++)
            if (ng == 0 && np == prompts[i] && ts > rate[i]) rate[i] = ts, found++;
        if (np == 0 && ng == decode_n && ts > rate[n_prompts]) rate[n_prompts] = ts, found++;
    }
    pclose(p);
    return found;
}

/* A child spinning on `core` until killed. */
static pid_t busy_start(int core) {
    pid_t pid = fork();
    if (pid == 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(core, &set);
        sched_setaffinity(0, sizeof set, &set);
        volatile unsigned long spin = 0;
        for (;;) spin++;
    }
    usleep(20000); /* let it settle on its core */
    return pid;
}

static void busy_stop(pid_t pid) {
    if (pid <= 0) return;
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_engine MODEL [--threads N] [--reps R] [--prefill 512,2048] [--decode 128]\n"
                        "                    [--llama-bench PATH] [--busy-core C] [--rounds R] [--label NAME]\n"
                        "                    [--attention f32|bf16|int8|both] [--warmup N]\n");
        return 2;
    }
    const char *path = argv[1], *llama_bench = NULL, *label = NULL;
    int threads = 2, reps = 3, decode_n = 128, busy_core = -1, rounds = 3, chunk = 0, then_decode = 0, warmup = 0;
    int prefill[MAX_TESTS] = {512, 2048}, n_prefill = 2;
    kv_format kv_fmt = {KV_FORMAT_F16};
    attention_precision attention = ATTENTION_F32;
    bool both = false;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--threads") == 0) threads = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--chunk") == 0) chunk = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--then-decode") == 0) then_decode = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--clock") == 0) cpu_clock = strcmp(argv[i + 1], "cpu") == 0;
        else if (strcmp(argv[i], "--kv") == 0) {
            if (kv_format_parse(argv[i + 1], &kv_fmt) < 0) {
                fprintf(stderr, "bench_engine: --kv %s is not one of %s\n", argv[i + 1], KV_FORMAT_CHOICES);
                return 2;
            }
        }
        else if (strcmp(argv[i], "--attention") == 0) {
            both = strcmp(argv[i + 1], "both") == 0;
            if (!both && !attention_precision_parse(argv[i + 1], &attention)) {
                fprintf(stderr, "bench_engine: --attention %s is not f32, bf16, int8 or both\n", argv[i + 1]);
                return 2;
            }
        }
        else if (strcmp(argv[i], "--reps") == 0) reps = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--decode") == 0) decode_n = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--llama-bench") == 0) llama_bench = *argv[i + 1] ? argv[i + 1] : NULL;
        else if (strcmp(argv[i], "--busy-core") == 0) busy_core = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--rounds") == 0) rounds = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--warmup") == 0) warmup = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--label") == 0) label = argv[i + 1];
        else if (strcmp(argv[i], "--isa") == 0) {
            quant_isa isa;
            if (!quant_isa_parse(argv[i + 1], &isa) || !quant_set_isa(isa)) {
                fprintf(stderr, "bench_engine: --isa %s is not scalar, avx2 or avx512, or this CPU lacks it\n", argv[i + 1]);
                return 2;
            }
        }
        else if (strcmp(argv[i], "--prefill") == 0) {
            n_prefill = 0;
            for (char *tok = strtok(argv[i + 1], ","); tok && n_prefill < MAX_TESTS - 1; tok = strtok(NULL, ","))
                if (atoi(tok) > 0) prefill[n_prefill++] = atoi(tok);
        } else {
            fprintf(stderr, "bench_engine: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (reps < 1) reps = 1;
    if (rounds < 1) rounds = 1;
    if (decode_n < 1) decode_n = 1;
    bench b = {0};
    b.m = model_load(path, &b.err);
    if (b.m == NULL) {
        fprintf(stderr, "bench_engine: %s\n", b.err.msg);
        return 1;
    }
    const model_hparams *hp = model_get_hparams(b.m);
    int max_p = decode_n + 16;
    for (int i = 0; i < n_prefill; i++)
        if (prefill[i] + then_decode > max_p) max_p = prefill[i] + then_decode;
    kv_pool_config cfg;
    model_kv_config(b.m, max_p / KV_BLOCK_TOKENS + 2, &cfg);
    cfg.format = kv_fmt;
    b.chunk = chunk;
    b.then_decode = then_decode;
    const char *why = NULL;
    cfg.attention = model_attention_precision(b.m, kv_fmt, both ? ATTENTION_BF16 : attention, &why);
    if (why) {
        printf("attention: %s asked for, f32 runs: %s\n", both ? "bf16" : attention_precision_name(attention), why);
        both = false;
    }
    int max_batch = chunk > 0 && chunk < max_p ? chunk : max_p;
    if (both) {
        b.pool_bf16 = kv_pool_create(&cfg, &b.err);
        b.ctx_bf16 = b.pool_bf16 ? model_ctx_create(b.m, b.pool_bf16, threads, max_batch, &b.err) : NULL;
        if (b.ctx_bf16 == NULL || model_has_state(b.m)) {
            fprintf(stderr, "bench_engine: --attention both: %s\n",
                    b.ctx_bf16 ? "not for models with recurrent state" : b.err.msg);
            return 1;
        }
        cfg.attention = ATTENTION_F32;
    }
    b.pool = kv_pool_create(&cfg, &b.err);
    b.ctx = b.pool ? model_ctx_create(b.m, b.pool, threads, max_batch, &b.err) : NULL;
    if (b.ctx && model_has_state(b.m)) b.state = model_state_create(b.m, &b.err);
    if (b.ctx == NULL || (model_has_state(b.m) && b.state == NULL)) {
        fprintf(stderr, "bench_engine: %s\n", b.err.msg);
        return 1;
    }
    b.ids = malloc((size_t)max_p * sizeof *b.ids);
    b.logits = malloc((size_t)hp->n_vocab * sizeof(float));
    for (int i = 0; i < max_p; i++) b.ids[i] = (int32_t)((i * 7919 + 13) % (hp->n_vocab - 300)) + 256;

    /* The dominant weight type names the row. */
    const char *wtype = "f32";
    const gguf_file *f = model_get_gguf(b.m);
    const gguf_tensor *probe = gguf_find_tensor(f, "blk.0.ffn_gate.weight");
    if (probe == NULL) probe = gguf_find_tensor(f, "blk.0.attn_q.weight");
    if (probe == NULL) probe = gguf_find_tensor(f, "blk.0.ssm_in.weight");
    if (probe) wtype = dtype_info_of(probe->type)->name;

    printf("model %s: %s, %d layers, n_embd %d, weights %s, KV %s, %d threads, %d reps, prefill %s%s, attention %s, isa %s\n",
           label ? label : path, hp->arch_name, hp->n_layer, hp->n_embd, wtype, kv_format_name(kv_fmt), threads, reps,
           chunk > 0 ? "in chunks" : "in one batch", cpu_clock ? ", tokens per CPU second" : "",
           both ? "f32 and bf16 alternating" : attention_precision_name(kv_pool_attention(b.pool)),
           quant_isa_name(quant_get_isa()));
    double ref[MAX_TESTS] = {0};
    int have_ref = 0;
    if (llama_bench) {
        have_ref = llama_run(llama_bench, path, "0,1", threads, reps, prefill, n_prefill, decode_n, ref);
        if (have_ref == 0)
            printf("llama.cpp (%s) could not run this file (its build may not know arch %s): no ratio\n", llama_bench,
                   hp->arch_name);
    }
    printf("%-16s %12s %22s %12s %8s\n", "test", "tok/s (med)", "spread (min..max)", "llama.cpp", "ratio");
    double *rates = malloc((size_t)(reps > rounds ? reps : rounds) * sizeof(double));
    double *after = malloc((size_t)reps * sizeof(double));
    double *rates_bf16 = malloc((size_t)reps * sizeof(double)), *after_bf16 = malloc((size_t)reps * sizeof(double));
    if (both) { /* the weights' pages come in before either precision is timed */
        ember_once(&b, 16, false);
        ember_once_on(&b, b.ctx_bf16, b.pool_bf16, 16, false);
    }
    int warm_n = 0; /* --warmup: 512 tokens, or the longest prefill asked for if shorter */
    for (int i = 0; i < n_prefill; i++) warm_n = prefill[i] > warm_n ? prefill[i] : warm_n;
    if (warm_n > 512 || warm_n == 0) warm_n = 512 < max_p ? 512 : max_p;
    for (int w = 0; w < warmup; w++) {
        ember_once(&b, warm_n, false);
        if (both) ember_once_on(&b, b.ctx_bf16, b.pool_bf16, warm_n, false);
    }
    for (int t = 0; t < n_prefill + 1; t++) {
        bool is_decode = t == n_prefill;
        int n = is_decode ? decode_n : prefill[t];
        for (int r = 0; r < reps; r++) {
            rates[r] = ember_once(&b, n, is_decode);
            after[r] = b.after;
            if (both) {
                rates_bf16[r] = ember_once_on(&b, b.ctx_bf16, b.pool_bf16, n, is_decode);
                after_bf16[r] = b.after;
            }
        }
        double med = median(rates, reps);
        char name[32], spread[48];
        snprintf(name, sizeof name, "%s%d", is_decode ? "decode " : "prefill ", n);
        snprintf(spread, sizeof spread, "%.1f..%.1f", rates[0], rates[reps - 1]);
        if (ref[t] > 0) printf("%-16s %12.1f %22s %12.1f %7.2fx\n", name, med, spread, ref[t], med / ref[t]);
        else printf("%-16s %12.1f %22s %12s %8s\n", name, med, spread, "-", "-");
        if (!is_decode && then_decode > 0) {
            double amed = median(after, reps);
            snprintf(name, sizeof name, "decode@%d", n);
            snprintf(spread, sizeof spread, "%.1f..%.1f", after[0], after[reps - 1]);
            printf("%-16s %12.1f %22s %12s %8s\n", name, amed, spread, "-", "-");
        }
        if (both) { /* the bf16 row: bf16 / f32 in the ratio column */
            double bmed = median(rates_bf16, reps);
            snprintf(name, sizeof name, "%s%d bf16", is_decode ? "decode " : "prefill ", n);
            snprintf(spread, sizeof spread, "%.1f..%.1f", rates_bf16[0], rates_bf16[reps - 1]);
            printf("%-16s %12.1f %22s %12s %7.2fx\n", name, bmed, spread, "(vs f32)", bmed / med);
            if (!is_decode && then_decode > 0) {
                double amed = median(after, reps), bamed = median(after_bf16, reps);
                snprintf(name, sizeof name, "decode@%d bf16", n);
                snprintf(spread, sizeof spread, "%.1f..%.1f", after_bf16[0], after_bf16[reps - 1]);
                printf("%-16s %12.1f %22s %12s %7.2fx\n", name, bamed, spread, "(vs f32)", bamed / amed);
            }
        }
        fflush(stdout);
    }
    free(after);
    free(rates_bf16);
    free(after_bf16);

    if (busy_core >= 0) {
        /* Pairs of (quiet, loaded) runs, alternating; fractions kept per round. */
        int pp = prefill[0] < 512 ? prefill[0] : 512;
        double keep[2][2][16]; /* [ember|llama][prefill|decode][round] */
        int n_rounds = rounds > 16 ? 16 : rounds;
        bool llama_ok = llama_bench && have_ref > 0;
        for (int r = 0; r < n_rounds; r++) {
            double q_pp = ember_once(&b, pp, false), q_tg = ember_once(&b, decode_n, true);
            pid_t busy = busy_start(busy_core);
            double l_pp = ember_once(&b, pp, false), l_tg = ember_once(&b, decode_n, true);
            busy_stop(busy);
            keep[0][0][r] = l_pp / q_pp;
            keep[0][1][r] = l_tg / q_tg;
            printf("contention round %d: ember   prefill %d %.1f -> %.1f, decode %d %.1f -> %.1f tok/s\n", r + 1, pp,
                   q_pp, l_pp, decode_n, q_tg, l_tg);
            if (llama_ok) {
                double q[2], l[2];
                llama_run(llama_bench, path, "0", threads, 1, &pp, 1, decode_n, q);
                busy = busy_start(busy_core);
                llama_run(llama_bench, path, "0", threads, 1, &pp, 1, decode_n, l);
                busy_stop(busy);
                keep[1][0][r] = q[0] > 0 ? l[0] / q[0] : 0;
                keep[1][1][r] = q[1] > 0 ? l[1] / q[1] : 0;
                printf("contention round %d: llama.cpp prefill %d %.1f -> %.1f, decode %d %.1f -> %.1f tok/s\n", r + 1,
                       pp, q[0], l[0], decode_n, q[1], l[1]);
            }
            fflush(stdout);
        }
        for (int k = 0; k < 2; k++) {
            char name[48];
            snprintf(name, sizeof name, "busy core %d %s%d", busy_core, k ? "tg" : "pp", k ? decode_n : pp);
            double e = median(keep[0][k], n_rounds);
            if (llama_ok) {
                double l = median(keep[1][k], n_rounds);
                printf("%-22s ember keeps %5.1f%%  llama.cpp keeps %5.1f%%  ratio %.2fx\n", name, 100 * e, 100 * l,
                       l > 0 ? e / l : 0);
            } else {
                printf("%-22s ember keeps %5.1f%%  llama.cpp -\n", name, 100 * e);
            }
        }
    }
    free(rates);
    free(b.ids);
    free(b.logits);
    model_state_free(b.state);
    model_ctx_free(b.ctx);
    kv_pool_free(b.pool);
    model_ctx_free(b.ctx_bf16);
    kv_pool_free(b.pool_bf16);
    model_free(b.m);
    return 0;
}
