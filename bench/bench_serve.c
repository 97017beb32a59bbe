/* bench_serve.c - serving throughput and latency of `ember serve`.
 *
 * Usage: bench_serve [--ember PATH] [--model PATH] [--threads 2] [--tokens 256]
 *                    [--streams 1,4,16] [--stream-runs 5] [--long 3584]
 *                    [--reps 10] [--port P]
 *
 * Starts `ember serve MODEL --port 0 --ctx 4096` (unless --port names a
 * running server), then over loopback HTTP:
 *  1. Aggregate decode tokens/s with 1, 4 and 16 concurrent streams: each
 *     stream is a streaming /v1/completions request (16-token prompt of its
 *     own, `--tokens` new tokens, ignore_eos, greedy, logprobs 0 so that
 *     every chunk names its tokens). Every token is timestamped on arrival;
 *     the figure is the decoded tokens (all but each stream's first) over
 *     the decode span (the first stream's first token to the last stream's
 *     last token). The whole-run rate (all tokens / wall time from the
 *     first request sent, prefill and HTTP included) is printed next to it. Each figure is the
 *     median of `--stream-runs` runs, with the range of the runs.
 *  2. TTFT under a long prefill: client A sends a `--long`-token prompt
 *     (max_tokens 1); as soon as the server has admitted it (20 ms later),
 *     client B sends a 16-token streaming prompt and times its first token.
 *     p50/p99 over `--reps` runs, each with a fresh cache salt so nothing is
 *     a cache hit; B alone (no long prefill) and A's own time for reference.
 *     The scheduler interleaves prefill chunks (512 tokens) with decode, so
 *     B waits for about one chunk, not the whole prompt.
 * Prompts are token-id arrays, so lengths are exact. */
#define _GNU_SOURCE
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "http_client.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double p) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    int i = (int)(p * (n - 1) + 0.5);
    return v[i < 0 ? 0 : i >= n ? n - 1 : i];
}

/* ---- HTTP ---- */

static int g_port;

static int post(const char *path, const char *body) {
    return http_send_request(g_port, "POST", path, NULL, body, strlen(body), 0);
}

/* A streaming request: timestamps of every token (counted from the
 * logprobs token lists of the SSE chunks). */
typedef struct stream_run {
    char *body;
    double t_send;
    double *t_tok;
    int n_tok, cap_tok;
    int status;   /* 0 ok, -1 failed */
} stream_run;

static void add_tokens(stream_run *r, const char *ev, size_t n, double t) {
    if (n >= 6 && strncmp(ev, "[DONE]", 6) == 0) return;
    cJSON *j = cJSON_ParseWithLength(ev, n);
    if (j == NULL) {
        r->status = -1;
        return;
    }
    if (cJSON_GetObjectItem(j, "error")) r->status = -1;
    const cJSON *toks = cJSON_GetObjectItem(
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "logprobs"), "tokens");
    int k = cJSON_GetArraySize(toks);
    for (int i = 0; i < k; i++) {
        if (r->n_tok == r->cap_tok) {
            r->cap_tok = r->cap_tok ? 2 * r->cap_tok : 256;
            r->t_tok = realloc(r->t_tok, (size_t)r->cap_tok * sizeof *r->t_tok);
        }
        r->t_tok[r->n_tok++] = t;
    }
    cJSON_Delete(j);
}

/* Reads the response, timestamping SSE events as they arrive. Chunked
 * framing is skipped by looking for "data: " ... "\n\n" in the raw bytes
 * (chunk-size lines never contain "data: "). */
static void *stream_main(void *arg) {
    stream_run *r = arg;
    r->t_send = now_s();
    int fd = post("/v1/completions", r->body);
    if (fd < 0) {
        r->status = -1;
        return NULL;
    }
    size_t cap = 1 << 16, len = 0, scan = 0;
    char *buf = malloc(cap);
    bool ok_status = false;
    for (;;) {
        if (len + 4096 > cap) buf = realloc(buf, cap *= 2);
        ssize_t got = recv(fd, buf + len, cap - len - 1, 0);
        if (got <= 0) break;
        double t = now_s();
        len += (size_t)got;
        buf[len] = 0;
        if (!ok_status && len > 12) ok_status = strncmp(buf + 9, "200", 3) == 0;
        for (;;) {
            char *d = strstr(buf + scan, "data: ");
            if (d == NULL) break;
            char *e = strstr(d, "\n\n");
            if (e == NULL) break;
            add_tokens(r, d + 6, (size_t)(e - d - 6), t);
            scan = (size_t)(e + 2 - buf);
        }
    }
    close(fd);
    if (!ok_status || strstr(buf, "data: [DONE]") == NULL) r->status = -1;
    free(buf);
    return NULL;
}

/* Non-streaming request; returns the seconds it took, or -1. */
static double post_wait(const char *body) {
    double t0 = now_s();
    int fd = post("/v1/completions", body);
    if (fd < 0) return -1;
    char buf[8192];
    size_t len = 0;
    ssize_t got;
    while ((got = recv(fd, buf + len, sizeof buf - 1 - len, 0)) > 0) {
        len += (size_t)got;
        if (len >= sizeof buf - 1) len = 16; /* keep the status line */
    }
    buf[len] = 0;
    close(fd);
    return strncmp(buf + 9, "200", 3) == 0 ? now_s() - t0 : -1;
}

/* A completions body with an n-token id prompt drawn from seed. */
static char *prompt_body(int n, unsigned seed, int max_tokens, bool stream, const char *salt) {
    size_t cap = (size_t)n * 5 + 512;
    char *b = malloc(cap);
    size_t k = (size_t)snprintf(b, cap, "{\"prompt\":[");
    for (int i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        k += (size_t)snprintf(b + k, cap - k, "%s%u", i ? "," : "", 32 + (seed >> 16) % 200);
    }
    snprintf(b + k, cap - k,
             "],\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,\"stream\":%s,\"logprobs\":0,"
             "\"cache_salt\":\"%s\"}",
             max_tokens, stream ? "true" : "false", salt);
    return b;
}

/* ---- the server ---- */

static pid_t g_pid;
static char g_log[PATH_MAX];

static int start_server(const char *ember, const char *model, int threads) {
    snprintf(g_log, sizeof g_log, "/tmp/bench_serve.%d.log", (int)getpid());
    char th[16];
    snprintf(th, sizeof th, "%d", threads);
    char *argv[] = {(char *)ember, (char *)"serve", (char *)model, (char *)"--port", (char *)"0", (char *)"--ctx",
                    (char *)"4096", (char *)"--threads", th, (char *)"--max-running", (char *)"32", NULL};
    g_port = http_spawn_server(argv, g_log, 30, &g_pid);
    if (g_port > 0) return 0;
    fprintf(stderr, "bench_serve: the server did not start (log: %s)\n", g_log);
    return -1;
}

static void stop_server(void) {
    if (g_pid <= 0) return;
    http_stop_server(&g_pid, 60000);
    unlink(g_log);
}

/* ---- benchmarks ---- */

static int g_fail;

/* One run of c concurrent streams: the steady aggregate rate and the
 * whole-run rate (tokens / wall time). */
static void streams_once(int c, int tokens, int run, double *steady_out, double *whole_out) {
    stream_run *runs = calloc((size_t)c, sizeof *runs);
    pthread_t *th = calloc((size_t)c, sizeof *th);
    char salt[64];
    for (int i = 0; i < c; i++) {
        snprintf(salt, sizeof salt, "streams-%d-%d-%d", run, c, i);
        runs[i].body = prompt_body(16, (unsigned)(run * 1000 + c * 100 + i), tokens, true, salt);
    }
    double t0 = now_s();
    for (int i = 0; i < c; i++) pthread_create(&th[i], NULL, stream_main, &runs[i]);
    for (int i = 0; i < c; i++) pthread_join(th[i], NULL);
    double wall = now_s() - t0;
    double start = 1e300, end = 0;
    long total = 0, decoded = 0;
    for (int i = 0; i < c; i++) {
        if (runs[i].status < 0 || runs[i].n_tok != tokens) {
            fprintf(stderr, "stream %d of %d failed (%d of %d tokens)\n", i, c, runs[i].n_tok, tokens);
            g_fail++;
            continue;
        }
        if (runs[i].t_tok[0] < start) start = runs[i].t_tok[0];
        if (runs[i].t_tok[runs[i].n_tok - 1] > end) end = runs[i].t_tok[runs[i].n_tok - 1];
        total += runs[i].n_tok;
        decoded += runs[i].n_tok - 1;
    }
    *steady_out = end > start ? (double)decoded / (end - start) : 0;
    *whole_out = (double)total / wall;
    for (int i = 0; i < c; i++) {
        free(runs[i].body);
        free(runs[i].t_tok);
    }
    free(runs);
    free(th);
}

/* The median of `runs` runs (the machine is shared: single runs are noisy). */
static void bench_streams(int c, int tokens, int runs, bool print) {
    static int run;
    double steady[16], whole[16];
    if (runs > 16) runs = 16;
    for (int i = 0; i < runs; i++) streams_once(c, tokens, ++run, &steady[i], &whole[i]);
    if (!print) return;
    double sm = pct(steady, runs, 0.5), wm = pct(whole, runs, 0.5);
    printf("  %2d stream%s  decode %8.1f tok/s aggregate (%6.1f per stream; runs %.1f..%.1f)   whole run %8.1f tok/s\n",
           c, c == 1 ? " " : "s", sm, sm / c, steady[0], steady[runs - 1], wm);
}

typedef struct long_arg {
    char *body;
    double secs;
} long_arg;

static void *long_main(void *arg) {
    long_arg *a = arg;
    a->secs = post_wait(a->body);
    return NULL;
}

/* TTFT of a 16-token streaming prompt, with or without a long prefill
 * in flight. Returns seconds, or -1. */
static double ttft_once(int long_n, int rep, double *long_secs) {
    char salt[64];
    long_arg la = {0};
    pthread_t th;
    if (long_n > 0) {
        snprintf(salt, sizeof salt, "long-%d-%d", rep, (int)getpid());
        la.body = prompt_body(long_n, (unsigned)rep * 7919u + 1, 1, false, salt);
        pthread_create(&th, NULL, long_main, &la);
        usleep(20000); /* A is admitted and its prefill under way */
    }
    snprintf(salt, sizeof salt, "short-%d-%d-%d", rep, long_n, (int)getpid());
    stream_run b = {.body = prompt_body(16, (unsigned)rep * 31u + 7, 1, true, salt)};
    stream_main(&b);
    double t = b.status == 0 && b.n_tok > 0 ? b.t_tok[0] - b.t_send : -1;
    if (long_n > 0) {
        pthread_join(th, NULL);
        *long_secs = la.secs;
        free(la.body);
    }
    free(b.body);
    free(b.t_tok);
    return t;
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    char self[PATH_MAX], ember_default[PATH_MAX + 8];
    snprintf(self, sizeof self, "%s", argv[0]);
    snprintf(ember_default, sizeof ember_default, "%s/ember", dirname(self));
    const char *ember = ember_default, *model = NULL, *streams = "1,4,16";
    int threads = 2, tokens = 256, long_n = 3584, reps = 10, stream_runs = 5;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v && strcmp(a, "--ember") == 0) ember = v, i++;
        else if (v && strcmp(a, "--model") == 0) model = v, i++;
        else if (v && strcmp(a, "--threads") == 0) threads = atoi(v), i++;
        else if (v && strcmp(a, "--tokens") == 0) tokens = atoi(v), i++;
        else if (v && strcmp(a, "--streams") == 0) streams = v, i++;
        else if (v && strcmp(a, "--long") == 0) long_n = atoi(v), i++;
        else if (v && strcmp(a, "--reps") == 0) reps = atoi(v), i++;
        else if (v && strcmp(a, "--stream-runs") == 0) stream_runs = atoi(v), i++;
        else if (v && strcmp(a, "--port") == 0) g_port = atoi(v), i++;
        else {
            fprintf(stderr,
                    "usage: bench_serve [--ember PATH] [--model PATH] [--threads 2] [--tokens 256] [--streams 1,4,16]\n"
                    "                   [--stream-runs 5] [--long 3584] [--reps 10] [--port P]\n");
            return 2;
        }
    }
    if (tokens < 2 || reps < 1 || stream_runs < 1 || long_n < 16 || long_n > 4000) {
        fprintf(stderr, "bench_serve: --tokens >= 2, --reps >= 1, --stream-runs >= 1, 16 <= --long <= 4000\n");
        return 2;
    }
    if (g_port == 0) {
        if (model == NULL) {
            fprintf(stderr, "bench_serve: --model PATH (or --port of a running server) is required\n");
            return 2;
        }
        if (start_server(ember, model, threads) < 0) return 1;
        printf("ember serve %s (threads %d, context 4096) on port %d\n", model, threads, g_port);
    }
    /* warm-up */
    bench_streams(1, 8, 1, false);
    printf("aggregate decode throughput (%d new tokens per stream, 16-token prompts, median of %d runs):\n", tokens,
           stream_runs);
    char list[128];
    snprintf(list, sizeof list, "%s", streams);
    for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
        int c = atoi(tok);
        if (c >= 1 && c <= 64) bench_streams(c, tokens, stream_runs, true);
    }
    printf("TTFT of a 16-token request (%d runs each):\n", reps);
    double *alone = calloc((size_t)reps, sizeof *alone), *during = calloc((size_t)reps, sizeof *during);
    double *longs = calloc((size_t)reps, sizeof *longs);
    for (int r = 0; r < reps; r++) {
        double ignored;
        alone[r] = ttft_once(0, r, &ignored);
        during[r] = ttft_once(long_n, r, &longs[r]);
        if (alone[r] < 0 || during[r] < 0 || longs[r] < 0) g_fail++;
    }
    printf("  alone                         p50 %7.1f ms   p99 %7.1f ms\n", 1e3 * pct(alone, reps, 0.5),
           1e3 * pct(alone, reps, 0.99));
    printf("  during a %4d-token prefill   p50 %7.1f ms   p99 %7.1f ms   (the long request itself: p50 %.2f s)\n",
           long_n, 1e3 * pct(during, reps, 0.5), 1e3 * pct(during, reps, 0.99), pct(longs, reps, 0.5));
    free(alone);
    free(during);
    free(longs);
    stop_server();
    if (g_fail) fprintf(stderr, "bench_serve: %d failed request(s)\n", g_fail);
    return g_fail ? 1 : 0;
}
