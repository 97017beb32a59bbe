/* bench_scenarios.c - prompt tokens computed per reuse scenario, beside the
 * ideal, on the `small` model of each family (issue 17).
 *
 * Usage: bench_scenarios [--model PATH]... [--threads N] [--interval T]
 *                        [--step S] [--llama-url http://127.0.0.1:PORT]
 *   With no --model, every family's `small` model in build/bench-models
 *   (qwen3 gemma3 qwen35 mamba2 falcon-h1; `make bench-scenarios` makes
 *   them). --interval overrides cache.ckpt.snapshot_interval (0: the
 *   checkpoint / exact tiers of before); --step sets the prefill step (512).
 *   The EMBER_APC_* switches apply.
 *
 * Scenarios (token-id prompts drawn from a fixed seed, greedy replies):
 *   resend    one 1,000-token prompt, then the same again;
 *   chat      6 turns: a 300-token first message, then each turn appends
 *             the 16-token reply and a 200-token message;
 *   agents    4 agents x 2 turns on one 1,500-token system prompt: own
 *             100-token message, then the reply and another 100 tokens;
 *             all turn 1s, then all turn 2s (interleaved); ember gets the
 *             system prompt's end as the hint its chat layer computes for
 *             a system message (token-id requests to llama-server have none);
 *   branch    A+B, then A+C (A 800, B and C 200 tokens);
 *   restart   one 1,000-token prompt with the SSD tier on, a new engine on
 *             the same directory (a restart), the same prompt again.
 * Each scenario starts on a fresh engine. "computed" is the sum over the
 * scenario's measured requests (every request but the first) of the prompt
 * tokens the server forwarded (engine_result.prompt_forwarded); "ideal" sums,
 * per request, N minus the longest prefix the server has seen before
 * (earlier prompts and their replies), at least 1; "bound" adds one snapshot
 * interval per request on stacks with recurrent layers, 16 on the others.
 *
 * --llama-url sends the same requests to a running llama-server (POST
 * /completion with token-id prompts, n_predict, temperature 0,
 * cache_prompt) and reads timings.prompt_n, so the table has both servers
 * side by side. Its own replies continue its conversations. The restart
 * scenario cannot restart a remote server and shows "-". Only loopback
 * addresses (the HTTP client of tests/http_client.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "apc/apc.h"
#include "core/log.h"
#include "engine/engine.h"
#include "http_client.h"
#include "model/cache_stack.h"
#include "model/model.h"
#include "serve/serve_settings.h"

#include <cjson/cJSON.h>

enum { REPLY = 16, MAX_SEEN = 64, MAX_TOK = 4096 };

typedef struct opts {
    int threads, interval, step;
    int llama_port; /* 0: none */
} opts;

/* ---- tokens ---- */

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static void random_tokens(int32_t *t, int n, int vocab) {
    for (int i = 0; i < n; i++) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        /* skip the first few ids (specials in most vocabularies) */
        t[i] = 16 + (int32_t)((rng >> 24) % (uint64_t)(vocab - 16));
    }
}

/* What one server has seen: prompts and their replies. */
typedef struct seen {
    int32_t *seq[MAX_SEEN];
    int n[MAX_SEEN];
    int count;
} seen;

static void seen_add(seen *s, const int32_t *t, int n) {
    if (s->count == MAX_SEEN) return;
    s->seq[s->count] = malloc((size_t)n * sizeof(int32_t));
    memcpy(s->seq[s->count], t, (size_t)n * sizeof(int32_t));
    s->n[s->count++] = n;
}

static void seen_free(seen *s) {
    for (int i = 0; i < s->count; i++) free(s->seq[i]);
    s->count = 0;
}

static int ideal_of(const seen *s, const int32_t *t, int n) {
    int best = 0;
    for (int i = 0; i < s->count; i++) {
        int l = 0;
        while (l < n && l < s->n[i] && s->seq[i][l] == t[l]) l++;
        if (l > best) best = l;
    }
    return n - best < 1 ? 1 : n - best;
}

/* ---- the two servers ---- */

typedef struct server {
    engine *e;               /* ember */
    int port;                /* llama-server */
    int64_t computed;        /* this scenario's measured requests */
    int32_t reply[REPLY];
    int n_reply;
    bool failed;
} server;

/* One greedy request; its reply goes to s->reply. anchor: the system
 * prompt's end as ember's chat layer would hint it (0: none; llama-server
 * has no such hint). */
static void ask_hinted(server *s, const int32_t *prompt, int n, bool measured, int64_t anchor) {
    s->n_reply = 0;
    if (s->failed) return;
    if (s->e) {
        engine_request q = engine_default_request();
        q.prompt = prompt;
        q.n_prompt = n;
        q.max_tokens = REPLY;
        q.stop_at_eog = false;
        q.plan.anchor_pos = anchor;
        engine_result r;
        ember_error err;
        if (engine_generate(s->e, &q, &r, &err) < 0) {
            fprintf(stderr, "bench_scenarios: %s\n", err.msg);
            s->failed = true;
            return;
        }
        if (measured) s->computed += r.prompt_forwarded;
        s->n_reply = r.n_tokens;
        memcpy(s->reply, r.tokens, (size_t)r.n_tokens * sizeof(int32_t));
        engine_result_free(&r);
        return;
    }
    cJSON *b = cJSON_CreateObject(), *ids = cJSON_AddArrayToObject(b, "prompt");
    for (int i = 0; i < n; i++) cJSON_AddItemToArray(ids, cJSON_CreateNumber(prompt[i]));
    cJSON_AddNumberToObject(b, "n_predict", REPLY);
    cJSON_AddNumberToObject(b, "temperature", 0);
    cJSON_AddBoolToObject(b, "cache_prompt", true);
    cJSON_AddBoolToObject(b, "return_tokens", true);
    cJSON_AddBoolToObject(b, "ignore_eos", true);
    char *body = cJSON_PrintUnformatted(b), *out = NULL;
    cJSON_Delete(b);
    int st = http_call(s->port, "POST", "/completion", NULL, body, &out);
    free(body);
    cJSON *r = st == 200 ? cJSON_Parse(out) : NULL;
    cJSON *pn = cJSON_GetObjectItem(cJSON_GetObjectItem(r, "timings"), "prompt_n");
    if (!cJSON_IsNumber(pn)) {
        fprintf(stderr, "bench_scenarios: llama-server answered %d without timings.prompt_n\n", st);
        s->failed = true;
    } else {
        if (measured) s->computed += (int64_t)pn->valuedouble;
        cJSON *t;
        cJSON_ArrayForEach(t, cJSON_GetObjectItem(r, "tokens")) {
            if (s->n_reply < REPLY && cJSON_IsNumber(t)) s->reply[s->n_reply++] = (int32_t)t->valuedouble;
        }
    }
    cJSON_Delete(r);
    free(out);
}

static void ask(server *s, const int32_t *prompt, int n, bool measured) { ask_hinted(s, prompt, n, measured, 0); }

/* ---- scenarios ---- */

typedef struct row {
    int64_t ember, llama, ideal, bound;
} row;

typedef struct ctx {
    const model *m;
    const char *path;
    const opts *o;
    int vocab;
    int64_t slack;           /* per measured request */
    engine_config cfg;
} ctx;

static engine *fresh_engine(const ctx *x, const char *disk_dir) {
    engine_config cfg = x->cfg;
    if (disk_dir) {
        cfg.cache.disk.path = disk_dir;
        cfg.cache.disk.max_bytes = 0;
    }
    ember_error err;
    engine *e = engine_create(x->m, &cfg, &err);
    if (e == NULL) fprintf(stderr, "bench_scenarios: %s\n", err.msg);
    return e;
}

/* A conversation script: per request, the prompt is the previous request's
 * prompt (of the same thread) + that request's reply + `add` new tokens, or
 * a fresh prefix. Run once per server so each continues with its own reply. */
typedef struct step {
    int thread;      /* conversation id */
    int base;        /* -1: continue the thread; >= 0: copy this many tokens of `shared` */
    int add;         /* new tokens (drawn once per script, the same for both servers) */
    bool measured;
    int anchor;      /* ember's system-prompt hint (a chat request's system message end); 0: none */
} step;

static void run_script(const ctx *x, server *s, const step *steps, int n_steps, int32_t *const *adds,
                       const int32_t *shared, seen *sn, row *rw, bool is_ember) {
    static int32_t thread_tok[8][MAX_TOK];
    static int thread_n[8];
    memset(thread_n, 0, sizeof thread_n);
    for (int i = 0; i < n_steps; i++) {
        const step *st = &steps[i];
        int32_t *t = thread_tok[st->thread];
        int *n = &thread_n[st->thread];
        if (st->base >= 0) {
            memcpy(t, shared, (size_t)st->base * sizeof(int32_t));
            *n = st->base;
        }
        memcpy(t + *n, adds[i], (size_t)st->add * sizeof(int32_t));
        *n += st->add;
        if (is_ember && st->measured) {
            rw->ideal += ideal_of(sn, t, *n);
            rw->bound += ideal_of(sn, t, *n) + x->slack;
        }
        ask_hinted(s, t, *n, st->measured, st->anchor);
        if (is_ember) seen_add(sn, t, *n);
        /* the reply continues this thread */
        memcpy(t + *n, s->reply, (size_t)s->n_reply * sizeof(int32_t));
        *n += s->n_reply;
        if (is_ember) seen_add(sn, t, *n);
    }
}

static row scenario(const ctx *x, const step *steps, int n_steps, int shared_n) {
    row rw = {0, -1, 0, 0};
    int32_t *shared = malloc((size_t)(shared_n > 0 ? shared_n : 1) * sizeof(int32_t));
    random_tokens(shared, shared_n, x->vocab);
    int32_t *adds[32];
    for (int i = 0; i < n_steps; i++) {
        adds[i] = malloc((size_t)steps[i].add * sizeof(int32_t));
        random_tokens(adds[i], steps[i].add, x->vocab);
    }
    seen sn = {0};
    server em = {0};
    em.e = fresh_engine(x, NULL);
    if (em.e) {
        run_script(x, &em, steps, n_steps, adds, shared, &sn, &rw, true);
        rw.ember = em.failed ? -1 : em.computed;
        engine_free(em.e);
    }
    if (x->o->llama_port) {
        server ll = {0};
        ll.port = x->o->llama_port;
        seen dummy = {0};
        run_script(x, &ll, steps, n_steps, adds, shared, &dummy, &rw, false);
        rw.llama = ll.failed ? -1 : ll.computed;
    }
    seen_free(&sn);
    for (int i = 0; i < n_steps; i++) free(adds[i]);
    free(shared);
    return rw;
}

static row sc_resend(const ctx *x) {
    row rw = {0, -1, 0, 0};
    int32_t p[1000];
    random_tokens(p, 1000, x->vocab);
    for (int k = 0; k < 2; k++) {
        if (k == 1 && !x->o->llama_port) break;
        server sv = {0};
        if (k == 0) sv.e = fresh_engine(x, NULL);
        else sv.port = x->o->llama_port;
        if (k == 0 && sv.e == NULL) continue;
        ask(&sv, p, 1000, false);
        ask(&sv, p, 1000, true);
        if (k == 0) {
            rw.ember = sv.failed ? -1 : sv.computed;
            engine_free(sv.e);
        } else {
            rw.llama = sv.failed ? -1 : sv.computed;
        }
    }
    rw.ideal = 1;
    rw.bound = 1; /* N-1 is stored on every tier */
    return rw;
}

static row sc_chat(const ctx *x) {
    step s[6];
    for (int t = 0; t < 6; t++) s[t] = (step){0, t == 0 ? 0 : -1, t == 0 ? 300 : 200, t > 0, 0};
    return scenario(x, s, 6, 0);
}

static row sc_agents(const ctx *x) {
    step s[8];
    /* the shared 1,500 tokens are a system message: ember's chat layer hints its end */
    for (int a = 0; a < 4; a++) s[a] = (step){a, 1500, 100, a > 0, 1500};
    for (int a = 0; a < 4; a++) s[4 + a] = (step){a, -1, 100, true, 1500};
    return scenario(x, s, 8, 1500);
}

static row sc_branch(const ctx *x) {
    step s[] = {{0, 800, 200, false, 0}, {1, 800, 200, true, 0}};
    return scenario(x, s, 2, 800);
}

static row sc_restart(const ctx *x) {
    row rw = {-1, -1, 1, 1};
    char tmpl[] = "/tmp/ember-scenarios-XXXXXX";
    char *dir = mkdtemp(tmpl);
    if (dir == NULL) return rw;
    int32_t p[1000];
    random_tokens(p, 1000, x->vocab);
    server sv = {0};
    sv.e = fresh_engine(x, dir);
    if (sv.e) {
        ask(&sv, p, 1000, false);
        engine_free(sv.e); /* lets queued disk writes land */
        sv.e = fresh_engine(x, dir);
        if (sv.e) {
            ask(&sv, p, 1000, true);
            rw.ember = sv.failed ? -1 : sv.computed;
            engine_free(sv.e);
        }
    }
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) fprintf(stderr, "bench_scenarios: could not remove %s\n", dir);
    return rw;
}

static double cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* What the stops cost: a cold 3,000-token prompt with the cache storing
 * (prefill stops at every snapshot point) against the same prompt with the
 * cache bypassed (chunks of the whole prefill step), best of five each. */
static void prefill_cost(const ctx *x) {
    enum { N = 3000 };
    static int32_t p[N];
    engine *e = fresh_engine(x, NULL);
    if (e == NULL) return;
    double best[2] = {1e30, 1e30}, cpu[2] = {1e30, 1e30};
    size_t snap_bytes = 0;
    int snaps = 0;
    for (int rep = 0; rep < 5; rep++) {
        random_tokens(p, N, x->vocab);
        for (int k = 0; k < 2; k++) {
            engine_request q = engine_default_request();
            q.prompt = p;
            q.n_prompt = N;
            q.max_tokens = 1;
            q.cache = k == 0 ? ENGINE_CACHE_STORE : ENGINE_CACHE_BYPASS;
            engine_result r;
            ember_error err;
            double c0 = cpu_seconds();
            if (engine_generate(e, &q, &r, &err) < 0) {
                fprintf(stderr, "bench_scenarios: %s\n", err.msg);
                engine_free(e);
                return;
            }
            double c1 = cpu_seconds() - c0;
            if (c1 < cpu[k]) cpu[k] = c1;
            if (r.ttft_s < best[k]) best[k] = r.ttft_s;
            engine_result_free(&r);
        }
        apc_stats st;
        apc_get_stats(engine_cache(e), &st);
        snap_bytes = st.snap_bytes;
        snaps = st.snap_entries;
        apc_reset(engine_cache(e));
    }
    printf("\nprefill of %d cold tokens, best of 5: %.3f s wall / %.3f s CPU storing (stops at every snapshot "
           "point), %.3f s / %.3f s bypassed (%+.1f%% wall, %+.1f%% CPU); %d snapshots kept, %.2f MiB (%.0f bytes per prompt token; the K/V pool holds %.0f bytes per "
           "token)\n",
           N, best[0], cpu[0], best[1], cpu[1], 100.0 * (best[0] - best[1]) / best[1],
           100.0 * (cpu[0] - cpu[1]) / cpu[1], snaps, (double)snap_bytes / (1 << 20),
           (double)snap_bytes / N, (double)kv_pool_block_bytes(engine_pool(e)) / KV_BLOCK_TOKENS);
    engine_free(e);
}

/* ---- one model ---- */

static void print_row(const char *scenario, const char *family, const row *r, bool llama) {
    char l[32] = "-";
    if (llama && r->llama >= 0) snprintf(l, sizeof l, "%lld", (long long)r->llama);
    printf("| %s | %s | %lld | %s | %lld | %lld | %s |\n", scenario, family, (long long)r->ember, l,
           (long long)r->ideal, (long long)r->bound, r->ember >= 0 && r->ember <= r->bound ? "ok" : "OVER");
    fflush(stdout);
}

static int bench_model(const char *path, const opts *o) {
    ember_error err;
    model *m = model_load(path, &err);
    if (m == NULL) {
        fprintf(stderr, "bench_scenarios: %s: %s (make bench-scenarios generates the small models)\n", path, err.msg);
        return 1;
    }
    const model_hparams *hp = model_get_hparams(m);
    ctx x;
    memset(&x, 0, sizeof x);
    x.m = m;
    x.path = path;
    x.o = o;
    x.vocab = hp->n_vocab;
    x.cfg = engine_default_config();
    x.cfg.n_threads = o->threads;
    x.cfg.n_ctx = 4096;
    if (o->step > 0) x.cfg.prefill_step = o->step;
    if (serve_settings_apply_env_cache(&x.cfg.cache, &err) < 0) {
        fprintf(stderr, "bench_scenarios: %s\n", err.msg);
        model_free(m);
        return 1;
    }
    if (o->interval >= 0) x.cfg.cache.ckpt.snapshot_interval = o->interval;
    const cache_layer *stack = model_cache_stack(m);
    bool recurrent = false;
    for (int l = 0; l < hp->n_layer; l++)
        if (stack[l].kind == CACHE_KIND_ARR || stack[l].kind == CACHE_KIND_LIST) recurrent = true;
    engine *probe = fresh_engine(&x, NULL);
    if (probe == NULL) {
        model_free(m);
        return 1;
    }
    const apc_route *rt = apc_get_route(engine_cache(probe));
    int iv = x.cfg.cache.ckpt.snapshot_interval;
    /* one snapshot interval per request where snapshots serve; the old
     * tiers' grid unit (the prefill step) otherwise */
    x.slack = recurrent ? (rt->snapshots ? iv : engine_default_config().prefill_step) : KV_BLOCK_TOKENS;
    printf("\n### %s (%s): tier %s%s, slack %lld per request\n\n", path, hp->arch_name,
           apc_tier_name(rt->tier), rt->snapshots ? " + recurrent snapshots" : "", (long long)x.slack);
    engine_free(probe);
    printf("| scenario | family | ember computed | llama-server computed | ideal | bound | ember vs bound |\n");
    printf("|---|---|---:|---:|---:|---:|:---:|\n");
    const bool llama = o->llama_port > 0;
    row r;
    rng = 0x9e3779b97f4a7c15ull ^ (uint64_t)hp->n_vocab;
    r = sc_resend(&x);
    print_row("identical resend (1,000)", hp->arch_name, &r, llama);
    r = sc_chat(&x);
    print_row("6-turn chat (turns 2-6)", hp->arch_name, &r, llama);
    r = sc_agents(&x);
    print_row("4 agents x 2 turns, 1,500 shared (all but agent 1 turn 1)", hp->arch_name, &r, llama);
    r = sc_branch(&x);
    print_row("branch A+B then A+C (A+C)", hp->arch_name, &r, llama);
    r = sc_restart(&x);
    print_row("restart (SSD tier), resend", hp->arch_name, &r, false);
    prefill_cost(&x);
    model_free(m);
    return 0;
}

static int parse_loopback_port(const char *url) {
    const char *p = url;
    if (strncmp(p, "http://", 7) == 0) p += 7;
    const char *hosts[] = {"127.0.0.1:", "localhost:"};
    for (int i = 0; i < 2; i++)
        if (strncmp(p, hosts[i], strlen(hosts[i])) == 0) {
            int port = atoi(p + strlen(hosts[i]));
            return port > 0 && port < 65536 ? port : -1;
        }
    return -1;
}

int main(int argc, char **argv) {
    opts o = {2, -1, 0, 0};
    const char *models[16];
    int n_models = 0;
    for (int i = 1; i < argc; i++) {
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            printf("usage: bench_scenarios [--model PATH]... [--threads N] [--interval T] [--step S] "
                   "[--llama-url http://127.0.0.1:PORT]\n");
            return 0;
        }
        if (val == NULL) {
            fprintf(stderr, "bench_scenarios: %s needs a value\n", argv[i]);
            return 2;
        }
        if (strcmp(argv[i], "--model") == 0) {
            if (n_models < 16) models[n_models++] = val;
        } else if (strcmp(argv[i], "--threads") == 0) {
            o.threads = atoi(val);
        } else if (strcmp(argv[i], "--step") == 0) {
            o.step = atoi(val);
        } else if (strcmp(argv[i], "--interval") == 0) {
            o.interval = atoi(val);
        } else if (strcmp(argv[i], "--llama-url") == 0) {
            o.llama_port = parse_loopback_port(val);
            if (o.llama_port < 0) {
                fprintf(stderr, "bench_scenarios: --llama-url must be http://127.0.0.1:PORT or http://localhost:PORT\n");
                return 2;
            }
        } else {
            fprintf(stderr, "bench_scenarios: unknown option %s\n", argv[i]);
            return 2;
        }
        i++;
    }
    if (o.threads < 1 || o.interval < -1) {
        fprintf(stderr, "bench_scenarios: --threads must be positive and --interval >= 0\n");
        return 2;
    }
    static const char *defaults[] = {
        "build/bench-models/qwen3-small-q8_0.gguf", "build/bench-models/gemma3-small-q8_0.gguf",
        "build/bench-models/qwen35-small-q8_0.gguf", "build/bench-models/mamba2-small-q8_0.gguf",
        "build/bench-models/falcon-h1-small-q8_0.gguf"};
    if (n_models == 0)
        for (size_t i = 0; i < sizeof defaults / sizeof defaults[0]; i++) models[n_models++] = defaults[i];
    if (getenv("EMBER_LOG") == NULL) ember_log_set_level(EMBER_LOG_WARN);
    if (o.llama_port)
        printf("llama-server at 127.0.0.1:%d: the same requests (one model file at a time: start it on the model "
               "being measured)\n",
               o.llama_port);
    int rc = 0;
    for (int i = 0; i < n_models; i++)
        if (bench_model(models[i], &o)) rc = 1;
    return rc;
}
