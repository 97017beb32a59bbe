/* bench_load.c - load test of `ember serve` (make load-test; not in CI).
 *
 * Usage: bench_load [--ember PATH] --model PATH [--clients 32] [--seconds 60]
 *                   [--threads 2] [--num-blocks 512]
 *
 * Starts `ember serve MODEL --port 0` and runs `--clients` concurrent
 * clients over loopback, each sending streaming requests back to back for
 * `--seconds`: chat (half of them with stream_options.include_usage, some
 * with logprobs, stop strings or a tenant header) and completions, random
 * prompt lengths, max_tokens 1..96, greedy or sampled. Every 8th request
 * of a client hangs up after the first event (the server must cancel it and
 * free its memory); those count as "hung up", not as requests.
 *
 * Every response is checked: status 200 and text/event-stream; strict
 * chunked framing; only `data: ...\n\n` events, the last one [DONE]; every
 * other event a JSON object of the right `object` with the request's id and
 * model, no `error`; chat: the first delta carries the assistant role;
 * exactly one choice chunk has a finish_reason (stop or length), and when
 * usage was asked, one final chunk with empty choices and a usage whose
 * completion_tokens is in [1, max_tokens] (== max_tokens on "length"). A
 * socket stalled for 30 s, or a refused connection, is a failure too.
 *
 * Memory: the server's VmRSS (/proc/PID/status) is read after a warm-up
 * with the same load (until the prompt cache has evicted, i.e. the KV pool
 * has been cycled once, or 20 s) and again after the run once the server is
 * idle; the test passes when no request failed and RSS after is within 10%
 * of before. Exit status 0 = pass. */
#define _GNU_SOURCE
#include <libgen.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
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

static int g_port;
static pid_t g_pid;
static char g_log[PATH_MAX];

/* ---- HTTP (tests/http_client.h) ---- */

/* A socket stalled for this long fails the request. */
#define STALL_S 30

static int request(const char *method, const char *path, const char *headers, const char *body) {
    return http_send_request(g_port, method, path, headers, body, body ? strlen(body) : 0, STALL_S);
}

/* ---- one streaming request ---- */

typedef struct client {
    int id;
    unsigned seed;
    long ok, failed, hung_up, tokens;
    char first_error[512];
} client;

static atomic_bool g_stop;

static unsigned rnd(unsigned *s) {
    *s = *s * 1664525u + 1013904223u;
    return *s >> 8;
}

static void fail(client *c, const char *fmt, const char *detail) {
    c->failed++;
    if (c->first_error[0] == 0) snprintf(c->first_error, sizeof c->first_error, fmt, detail ? detail : "");
}

static const char *WORDS[] = {"river", "stone", "light", "paper", "quiet", "seven", "north", "glass", "cloud", "amber"};

/* Checks one SSE body; returns NULL when well-formed, else why. */
static const char *check_events(char *body, bool chat, bool usage, int max_tokens, long *tokens) {
    static __thread char why[160];
    char *p = body, *id = NULL;
    int n_ev = 0, n_finish = 0, n_usage = 0;
    bool done = false;
    const char *finish = NULL;
    const char *result = NULL;
    while (*p) {
        if (done) return "bytes after [DONE]";
        if (strncmp(p, "data: ", 6) != 0) return "an event that is not 'data: '";
        char *e = strstr(p, "\n\n");
        if (e == NULL) return "an unterminated event";
        *e = 0;
        char *payload = p + 6;
        p = e + 2;
        if (strcmp(payload, "[DONE]") == 0) {
            done = true;
            continue;
        }
        cJSON *j = cJSON_Parse(payload);
        if (!cJSON_IsObject(j)) {
            cJSON_Delete(j);
            return "an event that is not a JSON object";
        }
        const cJSON *obj = cJSON_GetObjectItem(j, "object"), *jid = cJSON_GetObjectItem(j, "id");
        const cJSON *model = cJSON_GetObjectItem(j, "model"), *choices = cJSON_GetObjectItem(j, "choices");
        if (cJSON_GetObjectItem(j, "error")) result = "an error event";
        else if (!cJSON_IsString(obj) || strcmp(obj->valuestring, chat ? "chat.completion.chunk" : "text_completion"))
            result = "a wrong 'object'";
        else if (!cJSON_IsString(jid) || (id && strcmp(id, jid->valuestring) != 0)) result = "ids differ";
        else if (!cJSON_IsString(model) || !cJSON_IsArray(choices)) result = "no model or choices";
        if (result) {
            cJSON_Delete(j);
            free(id);
            return result;
        }
        if (id == NULL) id = strdup(jid->valuestring);
        const cJSON *c0 = cJSON_GetArrayItem(choices, 0);
        if (c0 == NULL) {
            const cJSON *u = cJSON_GetObjectItem(j, "usage");
            const cJSON *ct = cJSON_GetObjectItem(u, "completion_tokens");
            if (!usage || !cJSON_IsNumber(ct)) result = "an empty choices chunk without usage";
            else if (n_finish != 1) result = "usage before the finish";
            else {
                int k = (int)ct->valuedouble;
                if (k < 1 || k > max_tokens || (finish && strcmp(finish, "length") == 0 && k != max_tokens)) {
                    snprintf(why, sizeof why, "usage.completion_tokens %d (max_tokens %d, finish %s)", k, max_tokens,
                             finish ? finish : "?");
                    result = why;
                }
                *tokens += k;
            }
            n_usage++;
        } else {
            if (n_finish) result = "a choice chunk after the finish";
            if (chat) {
                const cJSON *d = cJSON_GetObjectItem(c0, "delta");
                if (!cJSON_IsObject(d)) result = "no delta";
                else if (n_ev == 0) {
                    const cJSON *role = cJSON_GetObjectItem(d, "role");
                    if (!cJSON_IsString(role) || strcmp(role->valuestring, "assistant")) result = "no role first";
                }
            } else if (!cJSON_IsString(cJSON_GetObjectItem(c0, "text"))) {
                result = "no text";
            }
            const cJSON *f = cJSON_GetObjectItem(c0, "finish_reason");
            if (cJSON_IsString(f)) {
                n_finish++;
                finish = strcmp(f->valuestring, "stop") == 0 ? "stop" : strcmp(f->valuestring, "length") == 0 ? "length" : NULL;
                if (finish == NULL) result = "a finish_reason other than stop/length";
            } else if (!cJSON_IsNull(f)) {
                result = "finish_reason neither null nor a string";
            }
            if (usage && !cJSON_IsNull(cJSON_GetObjectItem(j, "usage"))) result = "usage not null in a choice chunk";
        }
        n_ev++;
        cJSON_Delete(j);
        if (result) {
            free(id);
            return result;
        }
    }
    free(id);
    if (!done) return "no [DONE]";
    if (n_finish != 1) return "not exactly one finish_reason";
    if (usage && n_usage != 1) return "not exactly one usage chunk";
    return NULL;
}

static void one_request(client *c, int nth) {
    unsigned *s = &c->seed;
    bool chat = rnd(s) % 3 != 0;
    bool usage = rnd(s) % 2 == 0;
    int max_tokens = 1 + (int)(rnd(s) % 96);
    int words = 1 + (int)(rnd(s) % 60);
    char prompt[1024] = "";
    for (int i = 0; i < words; i++) {
        strcat(prompt, WORDS[rnd(s) % 10]);
        strcat(prompt, " ");
    }
    char extra[256] = "";
    if (rnd(s) % 4 == 0) snprintf(extra, sizeof extra, ",\"stop\":[\"%s\"]", WORDS[rnd(s) % 10]);
    if (chat && rnd(s) % 5 == 0) strcat(extra, ",\"logprobs\":true,\"top_logprobs\":2");
    char body[2048];
    if (chat)
        snprintf(body, sizeof body,
                 "{\"messages\":[{\"role\":\"system\",\"content\":\"Client %d.\"},{\"role\":\"user\",\"content\":"
                 "\"%s\"}],\"max_tokens\":%d,\"temperature\":%s,\"seed\":%u,\"stream\":true%s%s}",
                 c->id % 4, prompt, max_tokens, rnd(s) % 2 ? "0" : "0.9", rnd(s) % 1000, extra,
                 usage ? ",\"stream_options\":{\"include_usage\":true}" : "");
    else
        snprintf(body, sizeof body,
                 "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":%s,\"stream\":true%s%s}", prompt, max_tokens,
                 rnd(s) % 2 ? "0" : "0.7", extra, usage ? ",\"stream_options\":{\"include_usage\":true}" : "");
    const char *hdr = rnd(s) % 3 == 0 ? "X-APC-Tenant: load-tenant\r\n" : NULL;
    int fd = request("POST", chat ? "/v1/chat/completions" : "/v1/completions", hdr, body);
    if (fd < 0) {
        fail(c, "cannot connect or send%s", NULL);
        return;
    }
    if (nth % 8 == 3) { /* hang up after the first bytes */
        char b[256];
        ssize_t got = recv(fd, b, sizeof b, 0);
        close(fd);
        if (got <= 0) fail(c, "no first bytes before the hang-up%s", NULL);
        else c->hung_up++;
        return;
    }
    size_t n;
    bool stalled;
    char *raw = http_read_all(fd, &n, &stalled);
    close(fd);
    if (stalled) {
        fail(c, "stalled or reset: %.200s", raw);
        free(raw);
        return;
    }
    int status = 0;
    char *sep = strstr(raw, "\r\n\r\n");
    if (sep == NULL || sscanf(raw, "HTTP/1.%*d %d", &status) != 1 || status != 200) {
        fail(c, "bad status: %.300s", raw);
        free(raw);
        return;
    }
    *sep = 0;
    if (!strcasestr(raw, "Content-Type: text/event-stream") || !strcasestr(raw, "Transfer-Encoding: chunked")) {
        fail(c, "bad headers: %.300s", raw);
        free(raw);
        return;
    }
    size_t bn;
    bool framed;
    char *events = http_dechunk(sep + 4, n - (size_t)(sep + 4 - raw), &bn, &framed);
    free(raw);
    if (!framed) {
        free(events);
        fail(c, "broken chunked framing%s", NULL);
        return;
    }
    char *copy = strdup(events);
    const char *why = check_events(events, chat, usage, max_tokens, &c->tokens);
    if (why) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s in: %.300s", why, copy);
        fail(c, "%s", msg);
    } else {
        c->ok++;
    }
    free(copy);
    free(events);
}

static void *client_main(void *arg) {
    client *c = arg;
    for (int nth = 0; !atomic_load(&g_stop); nth++) one_request(c, nth);
    return NULL;
}

/* ---- the server ---- */

static long vm_rss_kb(void) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)g_pid);
    FILE *f = fopen(path, "r");
    long kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "VmRSS:", 6) == 0) kb = atol(line + 6);
    if (f) fclose(f);
    return kb;
}

static double cache_stat(const char *key) {
    int fd = request("GET", "/v1/cache/stats", NULL, NULL);
    if (fd < 0) return -1;
    size_t n;
    bool stalled;
    char *raw = http_read_all(fd, &n, &stalled);
    close(fd);
    char *b = strstr(raw, "\r\n\r\n");
    cJSON *j = b ? cJSON_Parse(b + 4) : NULL;
    const cJSON *v = cJSON_GetObjectItem(j, key);
    double d = cJSON_IsNumber(v) ? v->valuedouble : -1;
    cJSON_Delete(j);
    free(raw);
    return d;
}

static int start_server(const char *ember, const char *model, int threads, int blocks) {
    snprintf(g_log, sizeof g_log, "/tmp/bench_load.%d.log", (int)getpid());
    char th[16], nb[16];
    snprintf(th, sizeof th, "%d", threads);
    snprintf(nb, sizeof nb, "%d", blocks);
    char *argv[] = {(char *)ember, (char *)"serve", (char *)model, (char *)"--port", (char *)"0", (char *)"--threads",
                    th, (char *)"--num-blocks", nb, (char *)"--max-running", (char *)"32", (char *)"--queue-size",
                    (char *)"64", NULL};
    g_port = http_spawn_server(argv, g_log, 30, &g_pid);
    if (g_port > 0) return 0;
    fprintf(stderr, "bench_load: the server did not start (log: %s)\n", g_log);
    return -1;
}

/* Runs the clients until `until` returns true or `seconds` pass. */
static void run_load(client *cl, int n, double seconds, bool until_evicted) {
    pthread_t *th = calloc((size_t)n, sizeof *th);
    atomic_store(&g_stop, false);
    for (int i = 0; i < n; i++) pthread_create(&th[i], NULL, client_main, &cl[i]);
    double t0 = now_s();
    while (now_s() - t0 < seconds) {
        usleep(250000);
        if (until_evicted && cache_stat("evictions") > 0) break;
    }
    atomic_store(&g_stop, true);
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
    free(th);
}

/* Waits until the server reports nothing running or queued. */
static void wait_idle(void) {
    for (int i = 0; i < 200; i++) {
        int fd = request("GET", "/metrics", NULL, NULL);
        size_t n;
        bool stalled;
        char *raw = fd >= 0 ? http_read_all(fd, &n, &stalled) : NULL;
        if (fd >= 0) close(fd);
        const char *r = raw ? strstr(raw, "\nember_requests_running ") : NULL;
        const char *w = raw ? strstr(raw, "\nember_requests_waiting ") : NULL;
        bool idle = r && atof(r + 24) == 0 && (w == NULL || atof(w + 24) == 0);
        free(raw);
        if (idle) break;
        usleep(50000);
    }
    usleep(500000);
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    char self[PATH_MAX], ember_default[PATH_MAX + 8];
    snprintf(self, sizeof self, "%s", argv[0]);
    snprintf(ember_default, sizeof ember_default, "%s/ember", dirname(self));
    const char *ember = ember_default, *model = NULL;
    int clients = 32, seconds = 60, threads = 2, blocks = 512;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (v && strcmp(a, "--ember") == 0) ember = v, i++;
        else if (v && strcmp(a, "--model") == 0) model = v, i++;
        else if (v && strcmp(a, "--clients") == 0) clients = atoi(v), i++;
        else if (v && strcmp(a, "--seconds") == 0) seconds = atoi(v), i++;
        else if (v && strcmp(a, "--threads") == 0) threads = atoi(v), i++;
        else if (v && strcmp(a, "--num-blocks") == 0) blocks = atoi(v), i++;
        else model = NULL, i = argc;
    }
    if (model == NULL || clients < 1 || clients > 256 || seconds < 1) {
        fprintf(stderr, "usage: bench_load [--ember PATH] --model PATH [--clients 32] [--seconds 60] [--threads 2] "
                        "[--num-blocks 512]\n");
        return 2;
    }
    if (start_server(ember, model, threads, blocks) < 0) return 1;
    long rss_start = vm_rss_kb();
    printf("ember serve %s on port %d (pid %d, %d blocks); RSS at start %ld KiB\n", model, g_port, (int)g_pid, blocks,
           rss_start);
    client *warm = calloc((size_t)clients, sizeof *warm), *cl = calloc((size_t)clients, sizeof *cl);
    for (int i = 0; i < clients; i++) {
        warm[i].id = cl[i].id = i;
        warm[i].seed = 1000u + (unsigned)i;
        cl[i].seed = 77u + (unsigned)i * 7919u;
    }
    double t0 = now_s();
    run_load(warm, clients, 20, true);
    wait_idle();
    long rss_before = vm_rss_kb();
    printf("warm-up: %.1f s, evictions %.0f; RSS before %ld KiB\n", now_s() - t0, cache_stat("evictions"), rss_before);
    fflush(stdout);
    t0 = now_s();
    run_load(cl, clients, seconds, false);
    double wall = now_s() - t0;
    wait_idle();
    long rss_after = vm_rss_kb();
    long ok = 0, failed = 0, hung = 0, tokens = 0;
    for (int i = 0; i < clients; i++) {
        ok += cl[i].ok;
        failed += cl[i].failed + warm[i].failed;
        hung += cl[i].hung_up;
        tokens += cl[i].tokens;
        if (cl[i].first_error[0]) fprintf(stderr, "client %d: %s\n", i, cl[i].first_error);
        if (warm[i].first_error[0]) fprintf(stderr, "client %d (warm-up): %s\n", i, warm[i].first_error);
    }
    double growth = rss_before > 0 ? 100.0 * (double)(rss_after - rss_before) / (double)rss_before : 0;
    bool alive = kill(g_pid, 0) == 0;
    printf("load: %d clients for %.1f s: %ld well-formed streams (%.1f/s), %ld failed, %ld hung up by the client; "
           "%ld completion tokens reported by usage chunks\n",
           clients, wall, ok, (double)ok / wall, failed, hung, tokens);
    printf("RSS: before %ld KiB, after %ld KiB (%+.1f%%); cache evictions %.0f; server %s\n", rss_before, rss_after,
           growth, cache_stat("evictions"), alive ? "alive" : "DEAD");
    bool clean_exit = http_stop_server(&g_pid, 60000) == 0;
    bool pass = failed == 0 && ok > 0 && alive && growth <= 10.0 && growth >= -10.0 && clean_exit;
    printf("server exit: %s; load test %s\n", clean_exit ? "0" : "abnormal", pass ? "PASSED" : "FAILED");
    if (pass) unlink(g_log);
    else fprintf(stderr, "server log kept: %s\n", g_log);
    free(warm);
    free(cl);
    return pass ? 0 : 1;
}
