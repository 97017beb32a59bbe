/* cmd_bench.c - `ember bench TRACE --url URL ...` and `ember bench gen`.
 *
 * Replays a workload (bench.h) with N client threads. Mooncake requests are
 * independent: clients take the next one in trace order (waiting for its
 * timestamp / speed when --timestamps is on). A session's turns depend on
 * the previous replies, so a client takes a whole session and plays its
 * turns in order. Before and after the run the server is probed: an ember
 * server answers /v1/cache/stats with pool_capacity_tokens (the default
 * LRU capacity of the ideal) and /metrics with its prompt token counters,
 * whose difference over the run is the server's own hit rate, reported
 * next to the one measured from the responses. A progress bar is drawn on
 * stderr when it is a terminal. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli/bench.h"
#include "cli/cli_common.h"
#include "cli/cli_opts.h"
#include "cli/commands.h"
#include "serve/serve_metrics.h"

enum {
    OPT_URL, OPT_KEY, OPT_MODEL, OPT_OUT, OPT_TITLE, OPT_CLIENTS, OPT_TIMESTAMPS, OPT_SPEED, OPT_BLOCK, OPT_LIMIT,
    OPT_MAX_OUTPUT, OPT_TEXT, OPT_VOCAB, OPT_CAPACITY, OPT_PROGRESS, OPT_NO_PROGRESS, OPT_FROM
};

static const cli_option bench_options[] = {
    {OPT_URL, "--url", NULL, "URL", "the OpenAI-compatible server (default http://127.0.0.1:8080)", NULL},
    {OPT_KEY, "--api-key", NULL, "KEY", "sent as Authorization: Bearer KEY", NULL},
    {OPT_MODEL, "--model", NULL, "NAME", "the request's model (default: the server's first in /v1/models)", NULL},
    {OPT_OUT, "--out", NULL, "DIR", "where the results go (default bench-out)", NULL},
    {OPT_TITLE, "--title", NULL, "TEXT", "the report's heading", NULL},
    {OPT_CLIENTS, "--clients", NULL, "N", "concurrent clients (default 1)", NULL},
    {OPT_TIMESTAMPS, "--timestamps", NULL, NULL, "send each request at its trace time / speed (default: at once)", NULL},
    {OPT_SPEED, "--speed", NULL, "F", "replay speed factor for --timestamps (default 1)", NULL},
    {OPT_BLOCK, "--block-tokens", NULL, "B", "tokens per 512-token trace block (default 512)", NULL},
    {OPT_LIMIT, "--limit", NULL, "N", "replay the first N requests only", NULL},
    {OPT_FROM, "--from", NULL, "K", "replay from request K on (0-based); the ideal still counts requests 0..K-1 as "
     "seen (Mooncake): the second half of a run across a server restart", NULL},
    {OPT_MAX_OUTPUT, "--max-output", NULL, "N", "cap on each request's max_tokens", NULL},
    {OPT_TEXT, "--text", NULL, NULL, "send Mooncake prompts as words instead of token ids", NULL},
    {OPT_VOCAB, "--vocab", NULL, "LO:HI", "token ids drawn in [LO, HI) (default 3:256)", NULL},
    {OPT_CAPACITY, "--capacity-tokens", NULL, "N", "LRU capacity of the ideal (default: the ember server's pool)",
     NULL},
    {OPT_PROGRESS, "--progress", NULL, NULL, "draw a progress bar on stderr (default: when it is a terminal)", NULL},
    {OPT_NO_PROGRESS, "--no-progress", NULL, NULL, "no progress bar", NULL},
    {0, NULL, NULL, NULL, NULL, NULL},
};

const cli_command cmd_bench_command = {
    "bench", cmd_bench, "TRACE.jsonl [options] | gen --out FILE [options]",
    "replay a request trace against an OpenAI-compatible server; HTML report",
    "TRACE is a Mooncake trace (JSONL: timestamp, input_length, output_length, hash_ids of 512-token "
    "blocks; --block-tokens scales a block) or an ember sessions file ({\"system\", \"turns\": [...]} per "
    "line). Writes DIR/requests.csv, requests.jsonl, summary.json and report.html and prints the summary: "
    "token hit rate measured and ideal (unbounded, and an LRU of the server's capacity), TTFT p50/p90/p99, "
    "throughput. `ember bench gen --help` describes the synthetic workload generator.",
    bench_options, false, false,
};

typedef struct run_state {
    const bench_opts *o;
    bench_workload *w;
    double t0;
    atomic_int next;          /* next request (Mooncake) or session */
    atomic_int done;
    pthread_mutex_t mu;       /* progress sums */
    int64_t sum_prompt, sum_cached;
    int errors;
    const char *model;
} run_state;

static void sleep_until(double t) {
    double d = t - bench_now();
    if (d <= 0) return;
    struct timespec ts = {(time_t)d, (long)((d - (double)(time_t)d) * 1e9)};
    nanosleep(&ts, NULL);
}

static void add_common(cJSON *b, const run_state *st, int max_tokens) {
    cJSON_AddStringToObject(b, "model", st->model);
    cJSON_AddNumberToObject(b, "max_tokens", max_tokens);
    cJSON_AddNumberToObject(b, "temperature", 0);
    cJSON_AddBoolToObject(b, "ignore_eos", true); /* the trace says how long the reply is */
    cJSON_AddBoolToObject(b, "stream", true);
    cJSON *so = cJSON_AddObjectToObject(b, "stream_options");
    cJSON_AddBoolToObject(so, "include_usage", true);
}

static void finished(run_state *st, const bench_req *r) {
    pthread_mutex_lock(&st->mu);
    if (r->prompt_tokens > 0 && r->cached_tokens >= 0) {
        st->sum_prompt += r->prompt_tokens;
        st->sum_cached += r->cached_tokens;
    }
    if (r->error[0]) st->errors++;
    pthread_mutex_unlock(&st->mu);
    atomic_fetch_add(&st->done, 1);
}

static void run_mooncake(run_state *st, int i) {
    bench_req *r = &st->w->reqs[i];
    const bench_opts *o = st->o;
    if (o->timestamps) sleep_until(st->t0 + r->t_s / o->speed);
    cJSON *b = cJSON_CreateObject();
    if (o->text_prompts) {
        char *text = bench_prompt_text(r, o);
        cJSON_AddStringToObject(b, "prompt", text ? text : "");
        free(text);
    } else {
        int n = 0;
        int32_t *ids = bench_prompt_tokens(r, o, &n);
        cJSON_AddItemToObject(b, "prompt", cJSON_CreateIntArray(ids, n));
        free(ids);
    }
    add_common(b, st, r->max_tokens);
    char *body = cJSON_PrintUnformatted(b);
    cJSON_Delete(b);
    bench_http_request(o, "/v1/completions", body, st->t0, r);
    free(body);
    free(r->reply); /* completions need no history */
    r->reply = NULL;
    finished(st, r);
}

/* A session's turns in order, each with the replies the server gave. */
static void run_session(run_state *st, int s) {
    const cJSON *sess = cJSON_GetArrayItem(st->w->sessions, s);
    const cJSON *sys = cJSON_GetObjectItem(sess, "system"), *turns = cJSON_GetObjectItem(sess, "turns");
    int first = st->w->session_first[s];
    if (st->o->timestamps) sleep_until(st->t0 + st->w->reqs[first].t_s / st->o->speed);
    cJSON *msgs = cJSON_CreateArray();
    if (cJSON_IsString(sys) && sys->valuestring[0]) {
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "system");
        cJSON_AddStringToObject(m, "content", sys->valuestring);
        cJSON_AddItemToArray(msgs, m);
    }
    for (int k = 0; first + k < st->w->n && st->w->reqs[first + k].session == s; k++) {
        bench_req *r = &st->w->reqs[first + k];
        const cJSON *turn = cJSON_GetArrayItem(turns, k), *role = cJSON_GetObjectItem(turn, "role");
        const char *content = cJSON_GetObjectItem(turn, "content")->valuestring;
        bool tool = cJSON_IsString(role) && strcmp(role->valuestring, "tool") == 0;
        /* a tool result goes in as a user turn: every server takes that, tool_calls or not */
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "user");
        if (tool) {
            size_t n = strlen(content) + 16;
            char *t = malloc(n);
            snprintf(t, n, "[tool result] %s", content);
            cJSON_AddStringToObject(m, "content", t);
            free(t);
        } else {
            cJSON_AddStringToObject(m, "content", content);
        }
        cJSON_AddItemToArray(msgs, m);
        cJSON *b = cJSON_CreateObject();
        cJSON_AddItemToObject(b, "messages", cJSON_Duplicate(msgs, true));
        add_common(b, st, r->max_tokens);
        char *body = cJSON_PrintUnformatted(b);
        cJSON_Delete(b);
        bench_http_request(st->o, "/v1/chat/completions", body, st->t0, r);
        free(body);
        cJSON *a = cJSON_CreateObject();
        cJSON_AddStringToObject(a, "role", "assistant");
        cJSON_AddStringToObject(a, "content", r->reply ? r->reply : "");
        cJSON_AddItemToArray(msgs, a);
        finished(st, r);
    }
    cJSON_Delete(msgs);
}

static void *client(void *arg) {
    run_state *st = arg;
    int units = st->w->kind == BENCH_MOONCAKE ? st->w->n : st->w->n_sessions;
    for (;;) {
        int i = atomic_fetch_add(&st->next, 1);
        if (i >= units) return NULL;
        if (st->w->kind == BENCH_MOONCAKE) run_mooncake(st, i);
        else run_session(st, i);
    }
}

static void draw_progress(run_state *st, bool last) {
    int done = atomic_load(&st->done), n = st->w->n, width = 30;
    pthread_mutex_lock(&st->mu);
    double hit = st->sum_prompt ? (double)st->sum_cached / (double)st->sum_prompt : 0;
    int errors = st->errors;
    pthread_mutex_unlock(&st->mu);
    int fill = n ? done * width / n : width;
    char bar[64];
    for (int i = 0; i < width; i++) bar[i] = i < fill ? '#' : '.';
    bar[width] = 0;
    fprintf(stderr, "\r[%s] %d/%d requests  hit %5.1f%%  %d errors  %.1f s%s", bar, done, n, 100 * hit, errors,
            bench_now() - st->t0, last ? "\n" : "");
    fflush(stderr);
}

/* ember's counters now: prompt and cached tokens, and the stats object. */
static bool probe_ember(const bench_opts *o, double *prompt, double *cached, cJSON **stats) {
    int st = 0;
    char *body = bench_http_get(o, "/v1/cache/stats", &st);
    cJSON *j = st == 200 && body ? cJSON_Parse(body) : NULL;
    free(body);
    if (j == NULL || cJSON_GetObjectItem(j, "pool_capacity_tokens") == NULL) {
        cJSON_Delete(j);
        return false;
    }
    *stats = j;
    body = bench_http_get(o, "/metrics", &st);
    bool ok = st == 200 && body;
    if (ok) {
        *prompt = serve_metrics_text_sum(body, "ember_prompt_tokens_total");
        *cached = serve_metrics_text_sum(body, "ember_prompt_cached_tokens_total");
    }
    free(body);
    return ok;
}

static char *first_model_id(const bench_opts *o) {
    int st = 0;
    char *body = bench_http_get(o, "/v1/models", &st);
    cJSON *j = st == 200 && body ? cJSON_Parse(body) : NULL;
    free(body);
    const cJSON *id = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "data"), 0), "id");
    char *out = strdup(cJSON_IsString(id) ? id->valuestring : "default");
    cJSON_Delete(j);
    return out;
}

static int parse_vocab(const char *v, bench_opts *o) {
    if (v == NULL) return -1;
    const char *colon = strchr(v, ':');
    char *end;
    long lo = colon ? strtol(v, &end, 10) : 3, hi = strtol(colon ? colon + 1 : v, &end, 10);
    if (*end || lo < 0 || hi <= lo) return -1;
    o->vocab_lo = (int)lo;
    o->vocab_hi = (int)hi;
    return 0;
}

int cmd_bench(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "gen") == 0) return bench_gen(argc - 1, argv + 1);
    bench_opts o;
    memset(&o, 0, sizeof o);
    o.url = "http://127.0.0.1:8080";
    o.out_dir = "bench-out";
    o.clients = 1;
    o.speed = 1.0;
    o.block_tokens = 512;
    o.vocab_lo = 3;
    o.vocab_hi = 256;
    o.progress = isatty(STDERR_FILENO);
    cli_args args;
    cli_args_init(&args, &cmd_bench_command, argc, argv);
    for (int id; (id = cli_next(&args)) != CLI_END;) {
        const char *a = args.opt, *v = args.value;
        switch (id) {
        case OPT_URL: o.url = v; break;
        case OPT_KEY: o.api_key = v; break;
        case OPT_MODEL: o.model = v; break;
        case OPT_OUT: o.out_dir = v; break;
        case OPT_TITLE: o.title = v; break;
        case OPT_CLIENTS: o.clients = (int)cli_parse_long(a, v, 1, 4096); break;
        case OPT_TIMESTAMPS: o.timestamps = true; break;
        case OPT_SPEED: o.speed = cli_parse_double(a, v); break;
        case OPT_BLOCK: o.block_tokens = (int)cli_parse_long(a, v, 1, 1 << 20); break;
        case OPT_LIMIT: o.limit = (int)cli_parse_long(a, v, 1, 1 << 30); break;
        case OPT_FROM: o.from = (int)cli_parse_long(a, v, 0, 1 << 30); break;
        case OPT_MAX_OUTPUT: o.max_output = (int)cli_parse_long(a, v, 1, 1 << 24); break;
        case OPT_TEXT: o.text_prompts = true; break;
        case OPT_VOCAB:
            if (parse_vocab(v, &o) < 0) return cli_usage_error(&cmd_bench_command, "--vocab: expected LO:HI or HI");
            break;
        case OPT_CAPACITY: o.capacity_tokens = cli_parse_long(a, v, 1, __LONG_MAX__); break;
        case OPT_PROGRESS: o.progress = true; break;
        case OPT_NO_PROGRESS: o.progress = false; break;
        case CLI_ARG:
            if (o.trace) return cli_usage_error(&cmd_bench_command, "one trace only ('%s' and '%s')", o.trace, v);
            o.trace = v;
            break;
        }
    }
    if (args.status >= 0) return args.status;
    if (o.trace == NULL) return cli_usage_error(&cmd_bench_command, "no trace file");
    if (!(o.speed > 0)) return cli_usage_error(&cmd_bench_command, "--speed must be above 0");

    bench_workload w;
    char err[512];
    if (bench_load(o.trace, &o, &w, err, sizeof err) < 0) {
        fprintf(stderr, "ember: %s\n", err);
        return 1;
    }
    bench_server srv;
    memset(&srv, 0, sizeof srv);
    double p0 = 0, c0 = 0, p1 = 0, c1 = 0;
    srv.ember = probe_ember(&o, &p0, &c0, &srv.stats_before);
    if (srv.ember) {
        const cJSON *cap = cJSON_GetObjectItem(srv.stats_before, "pool_capacity_tokens");
        srv.pool_capacity_tokens = cJSON_IsNumber(cap) ? (int64_t)cap->valuedouble : 0;
        if (o.capacity_tokens == 0) o.capacity_tokens = srv.pool_capacity_tokens;
    }
    bench_ideal(&w, o.capacity_tokens);
    if (o.from > 0 && bench_skip(&w, o.from, err, sizeof err) < 0) {
        fprintf(stderr, "ember: %s\n", err);
        cJSON_Delete(srv.stats_before);
        bench_workload_free(&w);
        return 1;
    }
    char *model_name = o.model ? strdup(o.model) : first_model_id(&o);

    run_state st;
    memset(&st, 0, sizeof st);
    st.o = &o;
    st.w = &w;
    st.model = model_name;
    pthread_mutex_init(&st.mu, NULL);
    fprintf(stderr, "ember bench: %d requests (%s%s) against %s, %d client%s%s\n", w.n,
            w.kind == BENCH_MOONCAKE ? "Mooncake trace" : "sessions", w.kind == BENCH_SESSIONS ? "" : "",
            o.url, o.clients, o.clients == 1 ? "" : "s", o.timestamps ? ", on the trace's timestamps" : "");
    st.t0 = bench_now();
    pthread_t *th = calloc((size_t)o.clients, sizeof *th);
    int started = 0;
    for (int i = 0; th && i < o.clients; i++)
        if (pthread_create(&th[i], NULL, client, &st) == 0) started++;
    if (started == 0) client(&st);
    while (o.progress && atomic_load(&st.done) < w.n) {
        draw_progress(&st, false);
        struct timespec ts = {0, 200 * 1000000L};
        nanosleep(&ts, NULL);
    }
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    double wall = bench_now() - st.t0;
    if (o.progress) draw_progress(&st, true);
    free(th);
    if (srv.ember && probe_ember(&o, &p1, &c1, &srv.stats_after)) {
        srv.prompt_tokens = p1 - p0;
        srv.cached_tokens = c1 - c0;
    } else {
        srv.ember = false;
    }
    int rc = bench_write_outputs(&o, &w, &srv, wall, err, sizeof err);
    if (rc < 0) fprintf(stderr, "ember: %s\n", err);
    /* failed requests are data, but a run where none succeeded measured nothing */
    if (rc == 0 && st.errors == w.n) {
        fprintf(stderr, "ember: every request failed (first: %s)\n", w.reqs[0].error);
        rc = -1;
    }
    pthread_mutex_destroy(&st.mu);
    cJSON_Delete(srv.stats_before);
    cJSON_Delete(srv.stats_after);
    free(model_name);
    bench_workload_free(&w);
    return rc < 0 ? 1 : 0;
}
