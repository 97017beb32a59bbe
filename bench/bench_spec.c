/* bench_spec.c - what speculative decoding costs and buys.
 *
 * Usage:
 *   bench_spec verify MODEL [--ctx C] [--reps R] [--threads N]
 *   bench_spec decode TARGET [--draft D]... [--lookup] [--mtp] [--self] [--tokens T] [--k K] [--rounds R]
 *                    [--threads N] [--prompt TEXT]...
 *
 * verify: the cost of one forward of k+1 rows of a sequence at position C
 * (what verifying k drafts takes) relative to one decode row, k = 1, 2, 4,
 * 8, over R rounds. On a memory-bound decode the weights are read once for
 * all rows, so the ratio stays well below k+1.
 *
 * decode: greedy generation of T tokens from each prompt, per drafter (a
 * draft model per --draft, the target drafting itself, prompt lookup, the
 * MTP head) against plain decoding: R rounds, each of three fresh engines
 * (plain, fixed k = K, adaptive k with its cost governor starting empty)
 * that take turns prompt by prompt, so that a busy machine slows them
 * alike. Prints per kind the median and best decode tokens/s, the median
 * of the per-round ratios against the round's plain run (wall clock and
 * process CPU time), acceptance (accepted / drafted), tokens per drafted
 * step, draft-model rows per generated token and the governor's pauses,
 * and the load average. Every speculative run's tokens are checked against
 * plain (exit 1 if one differs: that would be a bug, not a measurement). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/clock.h"
#include "engine/engine.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return v[n / 2];
}

/* ---- verify cost ---- */

/* CPU time of the process: what the step cost, less the time other
 * processes held the cores (the sum over threads, spin-waits included). */
static double process_cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int bench_verify(const char *path, int ctx, int reps, int threads) {
    ember_error err;
    model *m = model_load(path, &err);
    if (m == NULL) {
        fprintf(stderr, "bench_spec: %s\n", err.msg);
        return 1;
    }
    const model_hparams *hp = model_get_hparams(m);
    kv_pool_config kc;
    model_kv_config(m, (ctx + 64) / KV_BLOCK_TOKENS + 2, &kc);
    kv_pool *pool = kv_pool_create(&kc, &err);
    model_ctx *c = pool ? model_ctx_create(m, pool, threads, 512, &err) : NULL;
    model_state *st = model_has_state(m) ? model_state_create(m, &err) : NULL;
    if (c == NULL) {
        fprintf(stderr, "bench_spec: %s\n", err.msg);
        return 1;
    }
    int32_t *tok = malloc((size_t)(ctx + 16) * sizeof(int32_t));
    for (int i = 0; i < ctx + 16; i++) tok[i] = 1 + (int32_t)((i * 7919u) % (unsigned)(hp->n_vocab - 1));
    float *logits = malloc((size_t)16 * hp->n_vocab * sizeof(float));
    kv_seq seq;
    kv_seq_init(&seq);
    if (model_eval_state(c, &seq, st, tok, ctx, false, logits, &err) < 0) {
        fprintf(stderr, "bench_spec: %s\n", err.msg);
        return 1;
    }
    void *snap = st ? malloc(model_state_bytes(m)) : NULL;
    if (st) model_state_snapshot(st, snap);
    printf("verify cost on %s at position %d (%d threads, %d rounds; the sizes take turns within a round so "
           "that a busy machine slows them alike; median and best):\n",
           hp->name[0] ? hp->name : path, ctx, threads, reps);
    enum { SIZES = 5 };
    const int rows[SIZES] = {1, 2, 3, 5, 9};
    double *t = malloc((size_t)reps * SIZES * sizeof(double)), *cpu = malloc((size_t)reps * SIZES * sizeof(double));
    for (int r = 0; r < reps; r++)
        for (int i = 0; i < SIZES; i++) {
            kv_seq_truncate(pool, &seq, ctx);
            if (st) model_state_restore(st, snap, model_state_bytes(m), &err);
            double t0 = ember_now(), c0 = process_cpu_s();
            if (model_eval_state(c, &seq, st, tok + ctx, rows[i], true, logits, &err) < 0) {
                fprintf(stderr, "bench_spec: %s\n", err.msg);
                return 1;
            }
            t[i * reps + r] = ember_now() - t0;
            cpu[i * reps + r] = process_cpu_s() - c0;
        }
    double base = 0, base_best = 0, base_cpu = 0;
    for (int i = 0; i < SIZES; i++) {
        double med = median(t + i * reps, reps), best = t[i * reps], cbest = cpu[i * reps];
        for (int r = 1; r < reps; r++) best = best < t[i * reps + r] ? best : t[i * reps + r];
        for (int r = 1; r < reps; r++) cbest = cbest < cpu[i * reps + r] ? cbest : cpu[i * reps + r];
        if (i == 0) base = med, base_best = best, base_cpu = cbest;
        printf("  k = %d (%d rows): median %8.2f ms = %.2fx one decode row; best %8.2f ms = %.2fx; cpu time %.2fx\n",
               rows[i] - 1, rows[i], med * 1e3, med / base, best * 1e3, best / base_best, cbest / base_cpu);
    }
    free(t);
    free(cpu);
    free(snap);
    free(tok);
    free(logits);
    kv_seq_release(pool, &seq);
    model_state_free(st);
    model_ctx_free(c);
    kv_pool_free(pool);
    model_free(m);
    return 0;
}

/* ---- decode ---- */

typedef struct run {
    double seconds;
    int64_t tokens, steps, drafted, accepted; /* steps: verification forwards that carried drafts */
    int64_t paused;                           /* times the cost governor paused speculation */
    int64_t draft_rows;                       /* rows the draft model forwarded */
    double cpu_s;                             /* process CPU time of the whole requests */
} run;

static int decode_threads = 2;

static engine *open_engine(const model *m, const spec_config *sc) {
    ember_error err;
    engine_config cfg = engine_default_config();
    cfg.n_threads = decode_threads;
    cfg.n_ctx = 2048;
    cfg.cache.force_tier = APC_FORCE_OFF; /* every run cold: measure decoding, not the cache */
    if (sc) cfg.spec = *sc;
    engine *e = engine_create(m, &cfg, &err);
    if (e == NULL) fprintf(stderr, "bench_spec: %s\n", err.msg);
    return e;
}

/* Greedy generation of n_tokens from prompt p on e, added to out; the
 * first run of a prompt sets want[p], every other must equal it. */
static int generate_one(engine *e, const model *m, const char *prompt, int p, int n_tokens, int32_t **want, run *out) {
    ember_error err;
    int32_t *ids = NULL;
    size_t n = 0;
    if (tokenizer_encode(model_get_tokenizer(m), prompt, strlen(prompt), true, false, &ids, &n, &err) < 0) {
        fprintf(stderr, "bench_spec: %s\n", err.msg);
        return -1;
    }
    engine_request req = engine_default_request();
    req.prompt = ids;
    req.n_prompt = (int64_t)n;
    req.max_tokens = n_tokens;
    req.stop_at_eog = false;
    engine_result r;
    double c0 = process_cpu_s();
    int grc = engine_generate(e, &req, &r, &err);
    out->cpu_s += process_cpu_s() - c0;
    free(ids);
    if (grc < 0) {
        fprintf(stderr, "bench_spec: %s\n", err.msg);
        return -1;
    }
    if (want[p] == NULL) {
        want[p] = malloc((size_t)n_tokens * sizeof(int32_t));
        memcpy(want[p], r.tokens, (size_t)r.n_tokens * sizeof(int32_t));
    } else if (memcmp(want[p], r.tokens, (size_t)r.n_tokens * sizeof(int32_t)) != 0) {
        fprintf(stderr, "bench_spec: speculative output differs from plain on prompt %d\n", p);
        engine_result_free(&r);
        return -1;
    }
    /* Decode only: from the first token (the prefill's) to the last; the
     * draft model's own prefill of the prompt falls in here, as it runs at
     * the first draft. */
    out->seconds += r.total_s - r.ttft_s;
    out->tokens += r.n_tokens - 1;
    out->steps += r.spec.rounds;
    out->drafted += r.spec.drafted;
    out->accepted += r.spec.accepted;
    out->paused += r.spec.paused;
    engine_result_free(&r);
    return 0;
}

static double tps(const run *r) { return r->tokens / r->seconds; }

/* One drafter against plain decoding. A round opens fresh engines (plain,
 * fixed k, adaptive: the adaptive one learns from nothing, its cost
 * governor included) and runs every prompt on each in turn, so that a busy
 * machine slows the three alike. Prints the median and best tok/s of each
 * and the median of the per-round ratios against the round's own plain
 * runs; acceptance and draft-model rows per generated token over all
 * rounds. */
static int compare(const model *m, spec_config sc, const char *name, char **prompts, int n_prompts, int n_tokens,
                   int32_t **want, int rounds) {
    enum { PLAIN, FIXED, ADAPTIVE, KINDS };
    double v[KINDS][16], ratio[KINDS][16], cpu_ratio[KINDS][16], best[KINDS] = {0};
    run total[KINDS];
    memset(total, 0, sizeof total);
    for (int r = 0; r < rounds; r++) {
        engine *e[KINDS];
        spec_config c[KINDS] = {sc, sc, sc};
        c[FIXED].adaptive = false;
        c[ADAPTIVE].adaptive = true;
        for (int kind = 0; kind < KINDS; kind++) e[kind] = open_engine(m, kind == PLAIN ? NULL : &c[kind]);
        run now[KINDS];
        memset(now, 0, sizeof now);
        int rc = e[PLAIN] && e[FIXED] && e[ADAPTIVE] ? 0 : -1;
        for (int p = 0; rc == 0 && p < n_prompts; p++)
            for (int kind = 0; rc == 0 && kind < KINDS; kind++)
                rc = generate_one(e[kind], m, prompts[p], p, n_tokens, want, &now[kind]);
        for (int kind = 0; kind < KINDS; kind++) {
            if (e[kind] && engine_drafter(e[kind])) now[kind].draft_rows = spec_sidecar_get_stats(engine_drafter(e[kind])).draft_rows;
            engine_free(e[kind]);
        }
        if (rc < 0) return -1;
        for (int kind = 0; kind < KINDS; kind++) {
            v[kind][r] = tps(&now[kind]);
            if (v[kind][r] > best[kind]) best[kind] = v[kind][r];
            ratio[kind][r] = v[kind][r] / v[PLAIN][r];
            cpu_ratio[kind][r] = now[PLAIN].cpu_s / now[kind].cpu_s;
            total[kind].drafted += now[kind].drafted;
            total[kind].accepted += now[kind].accepted;
            total[kind].steps += now[kind].steps;
            total[kind].tokens += now[kind].tokens;
            total[kind].paused += now[kind].paused;
            total[kind].draft_rows += now[kind].draft_rows;
        }
    }
    printf("%s\n  plain     %7.0f tok/s (best %7.0f)\n", name, median(v[PLAIN], rounds), best[PLAIN]);
    const char *label[KINDS] = {"", "fixed k", "adaptive"};
    for (int kind = FIXED; kind < KINDS; kind++) {
        const run *t = &total[kind];
        printf("  %-9s %7.0f tok/s (best %7.0f)  %5.2fx plain (median of rounds; best/best %5.2fx; cpu time %5.2fx)  "
               "acceptance %5.1f%% (%lld/%lld), %.2f tokens/step, draft rows/token %.2f",
               label[kind], median(v[kind], rounds), best[kind], median(ratio[kind], rounds), best[kind] / best[PLAIN],
               median(cpu_ratio[kind], rounds),
               t->drafted ? 100.0 * t->accepted / t->drafted : 0.0, (long long)t->accepted, (long long)t->drafted,
               t->steps ? (double)(t->accepted + t->steps) / (double)t->steps : 0.0,
               (double)t->draft_rows / (double)t->tokens);
        if (kind == ADAPTIVE) printf(", %lld pauses", (long long)t->paused);
        printf("\n");
    }
    fflush(stdout);
    return 0;
}

static double load_average(void) {
    double l = -1;
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (fscanf(f, "%lf", &l) != 1) l = -1;
        fclose(f);
    }
    return l;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: bench_spec verify MODEL [--ctx C] [--reps R] [--threads N]\n"
                        "       bench_spec decode TARGET [--draft D]... [--lookup] [--mtp] [--self] [--tokens T] "
                        "[--k K] [--rounds R] [--threads N] [--prompt TEXT]...\n");
        return 2;
    }
    if (!strcmp(argv[1], "verify")) {
        int ctx = 512, reps = 7, threads = 2;
        for (int i = 3; i < argc; i++) {
            if (!strcmp(argv[i], "--ctx") && i + 1 < argc) ctx = atoi(argv[++i]);
            else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
            else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        }
        return bench_verify(argv[2], ctx, reps, threads);
    }
    const char *drafts[8];
    char *prompts[16];
    int n_drafts = 0, n_prompts = 0, n_tokens = 128, k = 4, rounds = 5;
    bool lookup = false, mtp = false, self = false;
    for (int i = 3; i < argc; i++) {
        if (!strcmp(argv[i], "--draft") && i + 1 < argc && n_drafts < 8) drafts[n_drafts++] = argv[++i];
        else if (!strcmp(argv[i], "--prompt") && i + 1 < argc && n_prompts < 16) prompts[n_prompts++] = argv[++i];
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) n_tokens = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--k") && i + 1 < argc) k = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) decode_threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--lookup")) lookup = true;
        else if (!strcmp(argv[i], "--mtp")) mtp = true;
        else if (!strcmp(argv[i], "--self")) self = true;
    }
    if (rounds < 1) rounds = 1;
    if (rounds > 16) rounds = 16;
    static char *default_prompts[] = {"Once upon a time", "Lily and Tom went to the park.",
                                      "The cat sat on the mat. The cat sat on the mat. The cat"};
    if (n_prompts == 0) {
        for (int i = 0; i < 3; i++) prompts[i] = default_prompts[i];
        n_prompts = 3;
    }
    ember_error err;
    model *m = model_load(argv[2], &err);
    if (m == NULL) {
        fprintf(stderr, "bench_spec: %s\n", err.msg);
        return 1;
    }
    int32_t *want[16] = {0};
    printf("decode on %s: %d prompts x %d greedy tokens, %d threads, k = %d fixed and adaptive; %d rounds of plain, "
           "fixed, adaptive taking turns per prompt, fresh engines each round (load average %.2f)\n",
           argv[2], n_prompts, n_tokens, decode_threads, k, rounds, load_average());
    for (int d = 0; d <= n_drafts + 2; d++) {
        spec_config sc = {.k = k, .ngram_min = 1, .ngram_max = 3};
        char name[160];
        model *dm = NULL;
        if (d < n_drafts) {
            dm = model_load(drafts[d], &err);
            if (dm == NULL) {
                fprintf(stderr, "bench_spec: %s\n", err.msg);
                return 1;
            }
            sc.kind = SPEC_DRAFT;
            sc.draft = dm;
            const char *base = strrchr(drafts[d], '/');
            snprintf(name, sizeof name, "draft %s", base ? base + 1 : drafts[d]);
        } else if (d == n_drafts) {
            if (!self) continue;
            sc.kind = SPEC_DRAFT;
            sc.draft = m;
            snprintf(name, sizeof name, "self-draft");
        } else if (d == n_drafts + 1) {
            if (!lookup) continue;
            sc.kind = SPEC_LOOKUP;
            snprintf(name, sizeof name, "prompt lookup");
        } else {
            if (!mtp) continue;
            sc.kind = SPEC_MTP;
            snprintf(name, sizeof name, "MTP head");
        }
        int rc = compare(m, sc, name, prompts, n_prompts, n_tokens, want, rounds);
        model_free(dm);
        if (rc < 0) return 1;
    }
    printf("(load average %.2f at the end)\n", load_average());
    for (int p = 0; p < n_prompts; p++) free(want[p]);
    model_free(m);
    return 0;
}
