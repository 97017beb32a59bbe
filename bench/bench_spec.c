/* bench_spec.c - what speculative decoding costs and buys.
 *
 * Usage:
 *   bench_spec verify MODEL [--ctx C] [--reps R] [--threads N]
 *   bench_spec decode TARGET [--draft D]... [--lookup] [--mtp] [--self] [--tokens T] [--k K] [--rounds R]
 *                    [--threads N] [--prompt TEXT]... [--no-fixed]
 *   bench_spec warm TARGET [--draft D]... [--mtp] [--tokens T] [--k K] [--prompt-len P] [--threads N]
 *                  [--prompt SEED]...
 *
 * verify: the cost of one forward of k+1 rows of a sequence at position C
 * (what verifying k drafts takes) relative to one decode row, k = 1, 2, 4,
 * 8, over R rounds. On a memory-bound decode the weights are read once for
 * all rows, so the ratio stays well below k+1.
 *
 * decode: greedy generation of T tokens from each prompt, per drafter (a
 * draft model per --draft, the target drafting itself, prompt lookup, the
 * MTP head) against plain decoding, as a long-running server sees it: one
 * engine per mode (plain, fixed k = K, adaptive k with its cost governor)
 * for the whole run, a first unmeasured pass in which the governor learns,
 * then R rounds in which every prompt runs on each engine in turn (the
 * order turning round by round), so that a busy machine slows them alike.
 * Apart from that, per round, a fresh plain and a fresh adaptive engine's
 * first request (the governor learning from nothing, a draft model
 * prefilling the prompt). Prints per kind the median tok/s, the median and
 * spread (min..max) of the per-round ratios against the round's plain run
 * (wall clock and process CPU time), the ratio of the fastest rounds,
 * acceptance (accepted / drafted), tokens per drafted step, draft-model
 * rows per generated token, and the governor's own account of where
 * speculation's time went (speculative rounds beyond plain, one-off
 * catch-ups), with the load average. Every speculative run's tokens are
 * checked against plain (exit 1 if one differs: that would be a bug, not a
 * measurement).
 *
 * warm: per decoded position, the acceptance of a cold request (which
 * stores the target's prefix and the drafter's sidecar entry) and of the
 * same prompt warm, on an engine with the sidecar and on one without, at a
 * fixed k; prompts of P tokens (each seed continued by the target's own
 * greedy text); with the times to the first, second and last token, the
 * draft model's rows and the rows the sidecar restored. */
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
static bool skip_fixed = false; /* --no-fixed: plain and adaptive only (quicker) */

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

static void spread(const double *v, int n, double *lo, double *hi) {
    *lo = *hi = v[0];
    for (int i = 1; i < n; i++) {
        if (v[i] < *lo) *lo = v[i];
        if (v[i] > *hi) *hi = v[i];
    }
}

/* "0.97x (0.93..1.02)": the median of per-round ratios and their spread. */
static void print_ratio(const char *what, double *v, int n) {
    double lo, hi;
    spread(v, n, &lo, &hi);
    printf("%s %5.2fx (%.2f..%.2f)", what, median(v, n), lo, hi);
}

/* The cost governor's account between two readings, against the plain
 * decoding time of the same requests: where speculation's cost went. */
static void print_account(const spec_governor_stats *a, const spec_governor_stats *b, double plain_s) {
    printf("governor: %lld measurements, %lld pauses, %lld speculative rounds (%.1f ms, %+.1f%% of plain beyond "
           "plain), one-off catch-ups %lld rows (%.1f%% of plain), %lld plain rounds (%lld paused)",
           (long long)(b->measurements - a->measurements), (long long)(b->pauses - a->pauses),
           (long long)(b->spec_rounds - a->spec_rounds), (b->spec_s - a->spec_s) * 1e3,
           100.0 * (b->spec_extra_s - a->spec_extra_s) / plain_s, (long long)(b->catch_rows - a->catch_rows),
           100.0 * (b->catch_s - a->catch_s) / plain_s, (long long)(b->plain_rounds - a->plain_rounds),
           (long long)(b->paused_rounds - a->paused_rounds));
}

enum { MAX_ROUNDS = 64 };

/* One drafter against plain decoding, the way a long-running server sees
 * it: one engine per mode (plain, fixed k, adaptive) for the whole run,
 * whose adaptive governor learns in an unmeasured first pass and keeps
 * what it learnt; then R rounds in which every prompt runs on each engine
 * in turn, so that a busy machine slows the three alike. Apart from that,
 * what a fresh engine's first request costs (the governor learning from
 * nothing, a draft model prefilling the prompt): per round, a fresh plain
 * and a fresh adaptive engine run one prompt each. Prints per kind the
 * median tok/s, the median and spread (min..max) of the per-round ratios
 * against the round's plain run, in wall and in process CPU time,
 * acceptance, draft-model rows per generated token and the governor's
 * account. */
static int compare(const model *m, spec_config sc, const char *name, char **prompts, int n_prompts, int n_tokens,
                   int32_t **want, int rounds) {
    enum { PLAIN, FIXED, ADAPTIVE, KINDS };
    double v[KINDS][MAX_ROUNDS], ratio[KINDS][MAX_ROUNDS], cpu_ratio[KINDS][MAX_ROUNDS];
    double first_ratio[MAX_ROUNDS], first_cpu[MAX_ROUNDS], plain_s = 0, first_plain_s = 0;
    double best_s[KINDS][16]; /* per prompt, the fastest round: preemption only ever adds time */
    for (int kind = 0; kind < KINDS; kind++)
        for (int p = 0; p < 16; p++) best_s[kind][p] = 1e30;
    run total[KINDS], first_total;
    memset(total, 0, sizeof total);
    memset(&first_total, 0, sizeof first_total);
    spec_governor_stats first_a, first_b;
    memset(&first_a, 0, sizeof first_a);
    memset(&first_b, 0, sizeof first_b);
    engine *e[KINDS];
    spec_config c[KINDS] = {sc, sc, sc};
    c[FIXED].adaptive = false;
    c[ADAPTIVE].adaptive = true;
    for (int kind = 0; kind < KINDS; kind++) e[kind] = open_engine(m, kind == PLAIN ? NULL : &c[kind]);
    int rc = e[PLAIN] && e[FIXED] && e[ADAPTIVE] ? 0 : -1;
    run warm;
    memset(&warm, 0, sizeof warm);
    for (int p = 0; rc == 0 && p < n_prompts; p++) /* the first pass: the adaptive governor learns */
        for (int kind = 0; rc == 0 && kind < KINDS; kind++) rc = generate_one(e[kind], m, prompts[p], p, n_tokens, want, &warm);
    spec_governor_stats acc0 = rc == 0 ? spec_governor_get_stats(engine_drafter(e[ADAPTIVE])) : first_a;
    int64_t rows0[KINDS] = {0};
    for (int kind = FIXED; rc == 0 && kind < KINDS; kind++) rows0[kind] = spec_sidecar_get_stats(engine_drafter(e[kind])).draft_rows;
    for (int r = 0; rc == 0 && r < rounds; r++) {
        run now[KINDS];
        memset(now, 0, sizeof now);
        /* The order of the kinds turns round by round: a run slows the one
         * after it (caches, a draft pool's threads winding down), and the
         * same kind must not always pay for that. */
        for (int p = 0; rc == 0 && p < n_prompts; p++)
            for (int i = 0; rc == 0 && i < KINDS; i++) {
                int kind = (r + i) % KINDS;
                if (kind == FIXED && skip_fixed) continue;
                double before = now[kind].seconds;
                rc = generate_one(e[kind], m, prompts[p], p, n_tokens, want, &now[kind]);
                if (now[kind].seconds - before < best_s[kind][p]) best_s[kind][p] = now[kind].seconds - before;
            }
        if (skip_fixed) now[FIXED] = now[PLAIN];
        /* A fresh engine's first request, plain and adaptive in turn. */
        engine *fp = rc == 0 ? open_engine(m, NULL) : NULL, *fa = fp ? open_engine(m, &c[ADAPTIVE]) : NULL;
        run first[2];
        memset(first, 0, sizeof first);
        if (fa == NULL) rc = -1;
        for (int i = 0; rc == 0 && i < 2; i++) { /* plain first in even rounds, adaptive first in odd ones */
            int which = (r + i) % 2;
            rc = generate_one(which ? fa : fp, m, prompts[r % n_prompts], r % n_prompts, n_tokens, want, &first[which]);
        }
        if (rc == 0) {
            spec_governor_stats g = spec_governor_get_stats(engine_drafter(fa));
            first_b.measurements += g.measurements, first_b.pauses += g.pauses;
            first_b.spec_rounds += g.spec_rounds, first_b.spec_s += g.spec_s, first_b.spec_extra_s += g.spec_extra_s;
            first_b.catch_rows += g.catch_rows, first_b.catch_s += g.catch_s;
            first_b.plain_rounds += g.plain_rounds, first_b.paused_rounds += g.paused_rounds;
            first_total.drafted += first[1].drafted, first_total.accepted += first[1].accepted;
            first_total.tokens += first[1].tokens;
            first_total.draft_rows += spec_sidecar_get_stats(engine_drafter(fa)).draft_rows;
            first_ratio[r] = tps(&first[1]) / tps(&first[0]);
            first_cpu[r] = first[0].cpu_s / first[1].cpu_s;
            first_plain_s += first[0].seconds;
        }
        engine_free(fp);
        engine_free(fa);
        if (rc < 0) break;
        for (int kind = 0; kind < KINDS; kind++) {
            v[kind][r] = tps(&now[kind]);
            ratio[kind][r] = v[kind][r] / v[PLAIN][r];
            cpu_ratio[kind][r] = now[PLAIN].cpu_s / now[kind].cpu_s;
            total[kind].drafted += now[kind].drafted;
            total[kind].accepted += now[kind].accepted;
            total[kind].steps += now[kind].steps;
            total[kind].tokens += now[kind].tokens;
            total[kind].paused += now[kind].paused;
        }
        plain_s += now[PLAIN].seconds;
    }
    spec_governor_stats acc1 = rc == 0 ? spec_governor_get_stats(engine_drafter(e[ADAPTIVE])) : acc0;
    for (int kind = FIXED; rc == 0 && kind < KINDS; kind++)
        total[kind].draft_rows = spec_sidecar_get_stats(engine_drafter(e[kind])).draft_rows - rows0[kind];
    for (int kind = 0; kind < KINDS; kind++) engine_free(e[kind]);
    if (rc < 0) return -1;
    double best_sum[KINDS] = {0};
    for (int kind = 0; kind < KINDS; kind++)
        for (int p = 0; p < n_prompts; p++) best_sum[kind] += best_s[kind][p];
    if (skip_fixed) best_sum[FIXED] = best_sum[PLAIN];
    printf("%s\n  plain     %7.0f tok/s\n", name, median(v[PLAIN], rounds));
    const char *label[KINDS] = {"", "fixed k", "adaptive"};
    for (int kind = FIXED; kind < KINDS; kind++) {
        const run *t = &total[kind];
        printf("  %-9s %7.0f tok/s ", label[kind], median(v[kind], rounds));
        print_ratio("", ratio[kind], rounds);
        print_ratio(" plain; cpu time", cpu_ratio[kind], rounds);
        printf("; best/best %5.2fx", best_sum[PLAIN] / best_sum[kind]);
        printf("; acceptance %5.1f%% (%lld/%lld), %.2f tokens/step, draft rows/token %.2f\n",
               t->drafted ? 100.0 * t->accepted / t->drafted : 0.0, (long long)t->accepted, (long long)t->drafted,
               t->steps ? (double)(t->accepted + t->steps) / (double)t->steps : 0.0,
               (double)t->draft_rows / (double)t->tokens);
    }
    printf("            ");
    print_account(&acc0, &acc1, plain_s);
    printf("\n  first request of a fresh adaptive engine:");
    print_ratio("", first_ratio, rounds);
    print_ratio(" plain; cpu time", first_cpu, rounds);
    printf("; acceptance %5.1f%% (%lld/%lld), draft rows/token %.2f\n            ",
           first_total.drafted ? 100.0 * first_total.accepted / first_total.drafted : 0.0,
           (long long)first_total.accepted, (long long)first_total.drafted,
           (double)first_total.draft_rows / (double)first_total.tokens);
    print_account(&first_a, &first_b, first_plain_s);
    printf("\n");
    fflush(stdout);
    return 0;
}

/* ---- warm: per-position acceptance with and without the sidecar ---- */

enum { WARM_MAX_PROMPTS = 16 };

/* One request's trace: what each generated token was (SPEC_MARK_*), when
 * it came, the draft model's rows, what the cache and sidecar gave. */
typedef struct trace {
    int n;
    uint8_t *marks;          /* (n) */
    double *at;              /* (n) seconds from the request's start to each token */
    double t0;
    int32_t *tokens;         /* (n) */
    int64_t cached;          /* prompt tokens from the cache */
    int64_t draft_rows;      /* rows the draft model forwarded */
    int64_t restored;        /* drafter rows the sidecar restored */
    uint64_t digest;
} trace;

static bool trace_token(void *user, int32_t token) {
    trace *t = user;
    (void)token;
    t->at[t->n++] = ember_now() - t->t0;
    return true;
}

static int traced(engine *e, const int32_t *ids, int n, int n_tokens, engine_cache_mode mode, trace *t) {
    memset(t, 0, sizeof *t);
    t->marks = calloc((size_t)n_tokens, 1);
    t->at = calloc((size_t)n_tokens, sizeof(double));
    engine_request req = engine_default_request();
    req.prompt = ids;
    req.n_prompt = n;
    req.max_tokens = n_tokens;
    req.stop_at_eog = false;
    req.cache = mode;
    req.draft_marks = t->marks;
    req.on_token = trace_token;
    req.user = t;
    spec_drafter *d = engine_drafter(e);
    spec_sidecar_stats s0, s1;
    memset(&s0, 0, sizeof s0);
    if (d) s0 = spec_sidecar_get_stats(d);
    s1 = s0;
    engine_result r;
    ember_error err;
    t->t0 = ember_now();
    if (engine_generate(e, &req, &r, &err) < 0) {
        fprintf(stderr, "bench_spec: %s\n", err.msg);
        return -1;
    }
    if (d) s1 = spec_sidecar_get_stats(d);
    t->tokens = r.tokens;
    r.tokens = NULL;
    t->cached = r.cached_tokens;
    t->draft_rows = s1.draft_rows - s0.draft_rows;
    t->restored = s1.restored_rows - s0.restored_rows;
    t->digest = r.spec.digest;
    engine_result_free(&r);
    return 0;
}

static void trace_free(trace *t) {
    free(t->marks);
    free(t->at);
    free(t->tokens);
}

/* Accepted and judged drafts at generated positions [from, to) (1-based)
 * over n traces. */
static void count_marks(const trace *t, int n, int from, int to, int *acc, int *judged) {
    *acc = *judged = 0;
    for (int i = 0; i < n; i++)
        for (int p = from; p < to && p <= t[i].n; p++) {
            uint8_t m = t[i].marks[p - 1];
            *acc += m == SPEC_MARK_ACCEPTED;
            *judged += m != SPEC_MARK_NONE;
        }
}

static double trace_median(const trace *t, int n, double (*f)(const trace *)) {
    double v[WARM_MAX_PROMPTS];
    for (int i = 0; i < n; i++) v[i] = f(&t[i]);
    return median(v, n);
}
static double ttft_of(const trace *t) { return t->at[0]; }
static double second_of(const trace *t) { return t->n > 1 ? t->at[1] : t->at[0]; }
static double last_of(const trace *t) { return t->at[t->n - 1]; }
static double rows_of(const trace *t) { return (double)t->draft_rows; }
static double cached_of(const trace *t) { return (double)t->cached; }
static double restored_of(const trace *t) { return (double)t->restored; }

/* Prompts of n_ids tokens: each seed text (or a token of its own when the
 * model has no tokenizer) continued by the model's own greedy text, so a
 * drafter that predicts the model drafts as well as it can. */
static int32_t *make_prompt(engine *plain, const model *m, const char *seed, int p, int n_ids) {
    int32_t *ids = malloc((size_t)n_ids * sizeof(int32_t));
    int32_t *enc = NULL;
    size_t n = 0;
    ember_error err;
    const tokenizer *tk = model_get_tokenizer(m);
    if (tk == NULL || tokenizer_encode(tk, seed, strlen(seed), true, false, &enc, &n, &err) < 0 || n == 0) {
        free(enc);
        enc = malloc(sizeof(int32_t));
        enc[0] = 1 + p;
        n = 1;
    }
    if ((int)n > n_ids) n = (size_t)n_ids;
    memcpy(ids, enc, n * sizeof(int32_t));
    free(enc);
    if ((int)n < n_ids) {
        engine_request req = engine_default_request();
        req.prompt = ids;
        req.n_prompt = (int64_t)n;
        req.max_tokens = n_ids - (int)n;
        req.stop_at_eog = false;
        req.cache = ENGINE_CACHE_BYPASS;
        engine_result r;
        if (engine_generate(plain, &req, &r, &err) < 0) {
            fprintf(stderr, "bench_spec: %s\n", err.msg);
            free(ids);
            return NULL;
        }
        memcpy(ids + n, r.tokens, (size_t)r.n_tokens * sizeof(int32_t));
        engine_result_free(&r);
    }
    return ids;
}

/* A cold request per prompt (it stores the target's prefix and, with the
 * sidecar, the drafter's), then the same prompt warm, on an engine with
 * the sidecar and on one without; per generated position the acceptance
 * of the cold run and of both warm runs, then the times and the draft
 * model's rows. Fixed k: adaptive k would let the governor's timing decide
 * where drafts are made. Every run's tokens must equal plain's. */
static int bench_warm(const model *m, spec_config sc, const char *name, char **seeds, int n_prompts, int n_ids,
                      int n_tokens) {
    enum { COLD, WARM_SIDE, WARM_NONE, RUNS };
    trace t[RUNS][WARM_MAX_PROMPTS], cold_none[WARM_MAX_PROMPTS];
    engine_config pc = engine_default_config();
    pc.n_threads = decode_threads;
    pc.n_ctx = 2048;
    pc.cache.force_tier = APC_FORCE_OFF;
    ember_error err;
    engine *plain = engine_create(m, &pc, &err);
    if (plain == NULL) {
        fprintf(stderr, "bench_spec: %s\n", err.msg);
        return -1;
    }
    int32_t *prompt[WARM_MAX_PROMPTS];
    trace want[WARM_MAX_PROMPTS];
    int rc = 0;
    for (int p = 0; p < n_prompts; p++) {
        prompt[p] = make_prompt(plain, m, seeds[p], p, n_ids);
        if (prompt[p] == NULL || traced(plain, prompt[p], n_ids, n_tokens, ENGINE_CACHE_BYPASS, &want[p]) < 0) return -1;
    }
    engine_free(plain);
    for (int with = 1; with >= 0 && rc == 0; with--) {
        engine_config cfg = engine_default_config();
        cfg.n_threads = decode_threads;
        cfg.n_ctx = 2048;
        cfg.spec = sc;
        cfg.spec.adaptive = false;
        cfg.spec.sidecar_entries = with ? 16 : 0;
        cfg.spec.sidecar_bytes = (size_t)256 << 20;
        cfg.spec.prefix_entries = 0; /* the pools and the sidecar only: L0 would restore the drafter too */
        engine *e = engine_create(m, &cfg, &err);
        if (e == NULL) {
            fprintf(stderr, "bench_spec: %s\n", err.msg);
            return -1;
        }
        for (int p = 0; p < n_prompts && rc == 0; p++) {
            trace *cold = with ? &t[COLD][p] : &cold_none[p];
            rc = traced(e, prompt[p], n_ids, n_tokens, ENGINE_CACHE_STORE, cold);
            if (rc == 0) rc = traced(e, prompt[p], n_ids, n_tokens, ENGINE_CACHE_LOOKUP, &t[with ? WARM_SIDE : WARM_NONE][p]);
            for (int k = 0; rc == 0 && k < 2; k++) {
                const trace *x = k ? &t[with ? WARM_SIDE : WARM_NONE][p] : cold;
                if (memcmp(x->tokens, want[p].tokens, (size_t)n_tokens * sizeof(int32_t)) != 0) {
                    fprintf(stderr, "bench_spec: speculative output differs from plain on prompt %d\n", p);
                    rc = -1;
                }
            }
        }
        engine_free(e);
    }
    if (rc < 0) return -1;
    bool same_cold = true;
    for (int p = 0; p < n_prompts; p++)
        same_cold = same_cold && memcmp(t[COLD][p].marks, cold_none[p].marks, (size_t)n_tokens) == 0;
    printf("%s: %d prompts of %d tokens, %d greedy tokens, k = %d fixed; cold (stores), then warm with the sidecar, "
           "warm without it (the cold runs on both engines %s)\n",
           name, n_prompts, n_ids, n_tokens, sc.k, same_cold ? "drafted alike" : "DIFFER");
    printf("  position      cold        warm, sidecar   warm, no sidecar   (accepted/judged drafts over the prompts; "
           "position 1 is the prefill's token)\n");
    const char *label[RUNS] = {"cold", "warm, sidecar", "warm, no sidecar"};
    for (int from = 1; from <= n_tokens;) {
        int to = from < 17 ? from + 1 : from * 2 - 1; /* 1..16 one by one, then 17-32, 33-64, ... */
        if (from == 17) to = 33;
        if (to > n_tokens + 1) to = n_tokens + 1;
        char pos[32];
        if (to == from + 1) snprintf(pos, sizeof pos, "%d", from);
        else snprintf(pos, sizeof pos, "%d-%d", from, to - 1);
        printf("  %-9s", pos);
        for (int w = 0; w < RUNS; w++) {
            int acc, judged;
            count_marks(t[w], n_prompts, from, to, &acc, &judged);
            char cell[32];
            if (judged) snprintf(cell, sizeof cell, "%d/%d %3.0f%%", acc, judged, 100.0 * acc / judged);
            else snprintf(cell, sizeof cell, "-");
            printf("  %-16s", cell);
        }
        printf("\n");
        from = to;
    }
    for (int w = 0; w < RUNS; w++) {
        int acc, judged;
        count_marks(t[w], n_prompts, 1, n_tokens + 1, &acc, &judged);
        bool same_drafts = true;
        for (int p = 0; p < n_prompts; p++) same_drafts = same_drafts && t[w][p].digest == t[COLD][p].digest;
        printf("  %-17s acceptance %5.1f%%; medians: cached %4.0f tokens, sidecar restored %4.0f rows, draft-model "
               "rows %5.0f, time to token 1 %7.2f ms, to token 2 %7.2f ms, to token %d %7.2f ms; drafts %s the cold run's\n",
               label[w], judged ? 100.0 * acc / judged : 0.0, trace_median(t[w], n_prompts, cached_of),
               trace_median(t[w], n_prompts, restored_of), trace_median(t[w], n_prompts, rows_of),
               trace_median(t[w], n_prompts, ttft_of) * 1e3, trace_median(t[w], n_prompts, second_of) * 1e3,
               n_tokens, trace_median(t[w], n_prompts, last_of) * 1e3, same_drafts ? "equal" : "differ from");
    }
    for (int p = 0; p < n_prompts; p++) {
        for (int w = 0; w < RUNS; w++) trace_free(&t[w][p]);
        trace_free(&cold_none[p]);
        trace_free(&want[p]);
        free(prompt[p]);
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
                        "[--k K] [--rounds R] [--threads N] [--prompt TEXT]... [--no-fixed]\n"
                        "       bench_spec warm TARGET [--draft D]... [--mtp] [--tokens T] [--k K] [--prompt-len P] "
                        "[--threads N] [--prompt SEED]...\n");
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
    bool warm_mode = !strcmp(argv[1], "warm");
    int prompt_len = 256;
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
        else if (!strcmp(argv[i], "--no-fixed")) skip_fixed = true;
        else if (!strcmp(argv[i], "--prompt-len") && i + 1 < argc) prompt_len = atoi(argv[++i]);
    }
    if (rounds < 1) rounds = 1;
    if (rounds > MAX_ROUNDS) rounds = MAX_ROUNDS;
    static char *default_prompts[] = {"Once upon a time", "Lily and Tom went to the park.",
                                      "The cat sat on the mat. The cat sat on the mat. The cat"};
    static char *warm_seeds[] = {"Once upon a time", "Lily and Tom went to the park.", "The little dog was sad.",
                                 "Sam had a red ball.", "One day, a bird flew into the garden.",
                                 "Mia wanted to bake a cake.", "The sun was hot and the sky was blue.",
                                 "Ben found a box under his bed."};
    if (n_prompts == 0 && warm_mode) {
        for (int i = 0; i < 8; i++) prompts[i] = warm_seeds[i];
        n_prompts = 8;
    } else if (n_prompts == 0) {
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
    if (warm_mode) {
        printf("warm on %s, %d threads (load average %.2f)\n", argv[2], decode_threads, load_average());
        if (prompt_len < 2 || prompt_len + n_tokens > 2048 || n_prompts > WARM_MAX_PROMPTS) {
            fprintf(stderr, "bench_spec: warm needs 2 <= --prompt-len and prompt + tokens <= 2048\n");
            return 2;
        }
    } else {
    printf("decode on %s: %d prompts x %d greedy tokens, %d threads, k = %d fixed and adaptive; %d rounds of plain, "
           "fixed, adaptive taking turns per prompt on one engine each (after a first, unmeasured pass), then a fresh plain "
           "and adaptive engine's first request (load average %.2f)\n",
           argv[2], n_prompts, n_tokens, decode_threads, k, rounds, load_average());
    }
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
        int rc = warm_mode ? bench_warm(m, sc, name, prompts, n_prompts, prompt_len, n_tokens)
                           : compare(m, sc, name, prompts, n_prompts, n_tokens, want, rounds);
        model_free(dm);
        if (rc < 0) return 1;
    }
    printf("(load average %.2f at the end)\n", load_average());
    for (int p = 0; p < n_prompts; p++) free(want[p]);
    model_free(m);
    return 0;
}
