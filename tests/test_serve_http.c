/* test_serve_http.c - the HTTP layer of `ember serve` under hostile and
 * careless clients, end to end over loopback.
 *
 * Servers are spawned from $EMBER_BIN on a model made by `ember mkmodel`
 * (port 0; the port is read from the "listening on" log line; each child
 * dies with the test through PR_SET_PDEATHSIG): http_spawn_server of
 * tests/http_client.h. Loopback has a whole /8, so the "attackers" bind their sockets to 127.0.1.x / 127.0.2.x and the
 * well-behaved client stays on 127.0.0.1: per-address and global limits
 * are told apart. The client here is small and thread-free: one blocking
 * socket per request with a poll deadline, the response parsed with
 * memmem/strtol (no strtok), chunked bodies decoded.
 *
 * Covered: 1,000 idle or trickling sockets while a normal request and a
 * stream complete within a second; 503 + Retry-After past the per-address
 * and the global connection limits, and recovery once read_timeout cuts
 * the idle sockets; a half-closed client (shutdown(SHUT_WR)) gets its whole
 * answer, streaming or not, also when it waits long enough to be probed;
 * a client that closes a waiting non-streaming request gets it cancelled;
 * unknown model names (404 model_not_found) and the accepted ones; raw
 * control characters (invalid_json) and U+0000 in every kind of string
 * (invalid_value, naming the field) and in tenant headers; max_tokens null
 * on a small context and a small KV pool with concurrent requests: every
 * one finishes with "length" at the room the pool allows. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "http_client.h"
#include "test_util.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- a small HTTP client ---- */

typedef struct hresp {
    int status;
    char *head;   /* status line and headers */
    char *body;   /* chunked bodies decoded */
    size_t len;
} hresp;

static void hresp_free(hresp *r) {
    free(r->head);
    free(r->body);
    memset(r, 0, sizeof *r);
}

/* A connected socket from src (an address on loopback, NULL: any), or -1. */
static int dial(const char *src, int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    if (src) {
        struct sockaddr_in b = {.sin_family = AF_INET};
        inet_pton(AF_INET, src, &b.sin_addr);
        if (bind(fd, (struct sockaddr *)&b, sizeof b) < 0) {
            close(fd);
            return -1;
        }
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static void put(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0) return;
        p += w;
        n -= (size_t)w;
    }
}

static void put_request(int fd, const char *method, const char *path, const char *headers, const char *body) {
    char head[2048];
    size_t len = body ? strlen(body) : 0;
    int n = snprintf(head, sizeof head, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s", method, path,
                     headers ? headers : "");
    if (body) n += snprintf(head + n, sizeof head - (size_t)n, "Content-Type: application/json\r\nContent-Length: %zu\r\n", len);
    n += snprintf(head + n, sizeof head - (size_t)n, "\r\n");
    put(fd, head, (size_t)n);
    if (body) put(fd, body, len);
}

/* Reads until the peer closes or timeout_s passes; *timed_out tells which. */
static char *slurp(int fd, double timeout_s, size_t *len, bool *timed_out) {
    size_t cap = 65536, n = 0;
    char *buf = malloc(cap);
    double end = now_s() + timeout_s;
    *timed_out = false;
    for (;;) {
        int left = (int)((end - now_s()) * 1000);
        if (left <= 0) {
            *timed_out = true;
            break;
        }
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, left) <= 0) continue;
        if (n + 4096 > cap) buf = realloc(buf, cap *= 2);
        ssize_t r = recv(fd, buf + n, cap - n - 1, 0);
        if (r <= 0) break;
        n += (size_t)r;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

static void parse(const char *raw, size_t n, hresp *out) {
    memset(out, 0, sizeof *out);
    out->status = -1;
    const char *sep = memmem(raw, n, "\r\n\r\n", 4);
    if (sep == NULL || n < 12 || strncmp(raw, "HTTP/1.", 7) != 0) {
        out->head = strdup("");
        out->body = strdup("");
        return;
    }
    out->status = (int)strtol(raw + 9, NULL, 10);
    out->head = strndup(raw, (size_t)(sep - raw));
    const char *b = sep + 4, *end = raw + n;
    if (strcasestr(out->head, "Transfer-Encoding: chunked")) {
        char *o = malloc((size_t)(end - b) + 1);
        size_t k = 0;
        const char *p = b;
        while (p < end) {
            char *after;
            unsigned long sz = strtoul(p, &after, 16);
            const char *eol = memmem(after, (size_t)(end - after), "\r\n", 2);
            if (eol == NULL || sz == 0 || eol + 2 + sz > end) break;
            memcpy(o + k, eol + 2, sz);
            k += sz;
            p = eol + 2 + sz + 2;
        }
        o[k] = 0;
        out->body = o;
        out->len = k;
    } else {
        out->len = (size_t)(end - b);
        out->body = strndup(b, out->len);
    }
}

/* One request from src; status -1 when nothing parseable came back in time. */
static hresp request_from(const char *src, int port, const char *method, const char *path, const char *headers,
                          const char *body, double timeout_s) {
    hresp r;
    int fd = dial(src, port);
    if (fd < 0) {
        memset(&r, 0, sizeof r);
        r.status = -1;
        r.head = strdup("");
        r.body = strdup("");
        return r;
    }
    put_request(fd, method, path, headers, body);
    size_t n;
    bool to;
    char *raw = slurp(fd, timeout_s, &n, &to);
    close(fd);
    parse(raw, n, &r);
    free(raw);
    return r;
}

static hresp post(int port, const char *path, const char *headers, const char *body) {
    return request_from(NULL, port, "POST", path, headers, body, 60);
}

static const char *header_value(const hresp *r, const char *name, char *out, size_t cap) {
    char key[128];
    snprintf(key, sizeof key, "\r\n%s:", name);
    const char *p = strcasestr(r->head, key);
    if (p == NULL) return NULL;
    p += strlen(key);
    while (*p == ' ') p++;
    size_t n = strcspn(p, "\r\n");
    if (n >= cap) n = cap - 1;
    memcpy(out, p, n);
    out[n] = 0;
    return out;
}

/* Fails unless r is an OpenAI error with this status, code and param
 * (param NULL: null). */
static void expect_error(const hresp *r, int status, const char *code, const char *param) {
    if (r->status != status) print_message("got %d %s\n", r->status, r->body);
    assert_int_equal(r->status, status);
    cJSON *j = cJSON_Parse(r->body);
    assert_non_null(j);
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(j, "error");
    assert_true(cJSON_IsObject(e));
    assert_true(cJSON_IsString(cJSON_GetObjectItemCaseSensitive(e, "message")));
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(e, "code"), *p = cJSON_GetObjectItemCaseSensitive(e, "param");
    assert_true(cJSON_IsString(c));
    assert_string_equal(c->valuestring, code);
    if (param) {
        if (!cJSON_IsString(p)) print_message("param missing in %s\n", r->body);
        assert_true(cJSON_IsString(p));
        assert_string_equal(p->valuestring, param);
    } else {
        assert_true(cJSON_IsNull(p));
    }
    cJSON_Delete(j);
}

/* ---- servers ---- */

typedef struct srv {
    pid_t pid;
    int port;
    char log[512];
} srv;

static char *g_dir;
static char g_model[512];
static srv g_wide;   /* default limits */
static srv g_narrow; /* small limits, short read timeout, one running request */

static int spawn(srv *s, const char *name, const char *yaml, char *const extra[]) {
    char cfg[512];
    snprintf(cfg, sizeof cfg, "%s/%s.yaml", g_dir, name);
    FILE *f = fopen(cfg, "w");
    if (f == NULL) return -1;
    fputs(yaml, f);
    fclose(f);
    snprintf(s->log, sizeof s->log, "%s/%s.log", g_dir, name);
    char *args[32];
    int a = 0;
    args[a++] = (char *)"--config";
    args[a++] = cfg;
    for (int i = 0; extra && extra[i] && a < 31; i++) args[a++] = extra[i];
    args[a] = NULL;
    s->port = http_spawn_ember(ember_binary(), g_model, args, s->log, &s->pid);
    return s->port > 0 ? 0 : -1;
}

static int stop(srv *s) { return http_stop_server(&s->pid, 20000); }

static bool g_setup_failed;

static int setup(void **state) {
    (void)state;
    if (ember_binary() == NULL) goto fail;
    /* 1,000 client sockets and their peers need descriptors */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < 4096) {
        rl.rlim_cur = rl.rlim_max < 4096 ? rl.rlim_max : 4096;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    g_dir = make_temp_dir();
    snprintf(g_model, sizeof g_model, "%s/tiny.gguf", g_dir);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s mkmodel --arch qwen3 --preset tiny --seed 5 --out %s >/dev/null 2>&1",
             ember_binary(), g_model);
    if (system(cmd) != 0) goto fail;
    if (spawn(&g_wide, "wide", "server:\n  ctx: 32768\n", NULL) < 0) goto fail;
    if (spawn(&g_narrow, "narrow",
              "server:\n  model_id: served-name\n  connection_limit: 40\n  per_ip_connection_limit: 8\n"
              "  read_timeout: 2\n  idle_timeout: 30\n  max_running: 1\n  queue_size: 8\n  ctx: 32768\n",
              NULL) < 0)
        goto fail;
    return 0;
fail:
    g_setup_failed = true;
    return -1;
}

static int teardown(void **state) {
    (void)state;
    stop(&g_wide);
    stop(&g_narrow);
    if (g_dir) remove_tree(g_dir);
    free(g_dir);
    return 0;
}

/* ---- slow sockets ---- */

typedef struct sock_set {
    int *fd;
    int n;
} sock_set;

/* n sockets spread over addresses prefix.1, prefix.2, ... per_addr each;
 * every third sends the start of a request head and nothing more. */
static void open_slow(sock_set *s, int port, const char *prefix, int n, int per_addr) {
    s->fd = malloc((size_t)n * sizeof *s->fd);
    s->n = 0;
    for (int i = 0; i < n; i++) {
        char src[32];
        snprintf(src, sizeof src, "%s.%d", prefix, 1 + i / per_addr);
        int fd = dial(src, port);
        if (fd < 0) fail_msg("cannot open slow socket %d from %s: %s", i, src, strerror(errno));
        if (i % 3 == 1) put(fd, "POST /v1/completions HTTP/1.1\r\nHo", 33);
        s->fd[s->n++] = fd;
    }
}

static void close_slow(sock_set *s) {
    for (int i = 0; i < s->n; i++) close(s->fd[i]);
    free(s->fd);
    s->fd = NULL;
    s->n = 0;
}

static const char *SMALL = "{\"prompt\":\"Once upon a time\",\"max_tokens\":4}";

static void test_idle_sockets_do_not_lock_out(void **state) {
    (void)state;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < 1100) {
        print_message("skipping: 1000 sockets need RLIMIT_NOFILE >= 1100 (hard limit %llu)\n",
                      (unsigned long long)rl.rlim_max);
        skip();
    }
    sock_set s;
    open_slow(&s, g_wide.port, "127.0.1", 1000, 50);
    usleep(300000); /* let the server take them all */
    double t0 = now_s();
    hresp r = request_from("127.0.0.1", g_wide.port, "POST", "/v1/completions", NULL, SMALL, 5);
    double dt = now_s() - t0;
    print_message("normal request with 1000 slow sockets open: %.3f s, status %d\n", dt, r.status);
    assert_int_equal(r.status, 200);
    assert_true(dt < 1.0);
    hresp_free(&r);
    t0 = now_s();
    r = request_from("127.0.0.1", g_wide.port, "POST", "/v1/chat/completions", NULL,
                     "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":6,\"stream\":true}", 5);
    dt = now_s() - t0;
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "data: [DONE]"));
    assert_true(dt < 1.0);
    hresp_free(&r);
    r = request_from("127.0.0.1", g_wide.port, "GET", "/health", NULL, NULL, 5);
    assert_int_equal(r.status, 200);
    hresp_free(&r);
    close_slow(&s);
}

static void expect_503(const hresp *r) {
    expect_error(r, 503, "too_many_connections", NULL);
    char v[32];
    assert_non_null(header_value(r, "Retry-After", v, sizeof v));
    assert_true(atoi(v) >= 1);
}

/* Polls until a request from 127.0.0.1 succeeds; returns the seconds it took. */
static double wait_served(int port, double limit_s) {
    double t0 = now_s();
    while (now_s() - t0 < limit_s) {
        hresp r = request_from("127.0.0.1", port, "GET", "/health", NULL, NULL, 2);
        int st = r.status;
        hresp_free(&r);
        if (st == 200) return now_s() - t0;
        usleep(100000);
    }
    return -1;
}

static void test_limits_answer_503(void **state) {
    (void)state;
    int port = g_narrow.port;
    /* per address: 8 idle from 127.0.0.2, the ninth is refused, others are not */
    sock_set s = {malloc(8 * sizeof(int)), 0};
    for (int i = 0; i < 8; i++) s.fd[s.n++] = dial("127.0.0.2", port);
    usleep(200000);
    double t0 = now_s();
    hresp r = request_from("127.0.0.2", port, "POST", "/v1/completions", NULL, SMALL, 5);
    assert_true(now_s() - t0 < 1.0);
    expect_503(&r);
    hresp_free(&r);
    r = request_from("127.0.0.1", port, "POST", "/v1/completions", NULL, SMALL, 5);
    assert_int_equal(r.status, 200);
    hresp_free(&r);
    close_slow(&s);
    assert_true(wait_served(port, 5) >= 0);
    /* globally: 40 open from ten addresses, the next client is refused at once */
    open_slow(&s, port, "127.0.2", 40, 4);
    usleep(200000);
    t0 = now_s();
    r = request_from("127.0.0.1", port, "POST", "/v1/completions", NULL, SMALL, 5);
    assert_true(now_s() - t0 < 1.0);
    expect_503(&r);
    hresp_free(&r);
    /* read_timeout (2 s) cuts the sockets that never sent a whole request:
     * the server serves again while their clients still hold them */
    double took = wait_served(port, 15);
    print_message("served again %.1f s after the limit was reached (read_timeout 2 s)\n", took);
    assert_true(took >= 0);
    /* Serving again needs only some of them cut; the server's timeout sweep
     * reaches the rest within moments (seconds on a loaded machine): give
     * every socket until a common deadline. */
    int closed = 0;
    double deadline = now_s() + 15;
    for (int i = 0; i < s.n; i++) {
        char b[64];
        struct pollfd p = {.fd = s.fd[i], .events = POLLIN};
        int wait_ms = (int)((deadline - now_s()) * 1000);
        if (poll(&p, 1, wait_ms > 0 ? wait_ms : 0) == 1 && recv(s.fd[i], b, sizeof b, MSG_DONTWAIT) <= 0) closed++;
    }
    print_message("%d of %d slow sockets closed by the server\n", closed, s.n);
    assert_int_equal(closed, s.n);
    close_slow(&s);
}

/* A trickle of one byte every 300 ms keeps a connection active, but
 * read_timeout still ends it; and it bounds the wait for the next request
 * on a kept-alive connection. */
static void test_trickled_header_is_cut(void **state) {
    (void)state;
    int fd = dial("127.0.0.3", g_narrow.port);
    assert_true(fd >= 0);
    const char *head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Padding: aaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    double t0 = now_s();
    bool cut = false;
    for (size_t i = 0; i < strlen(head) && now_s() - t0 < 20; i++) {
        if (send(fd, head + i, 1, MSG_NOSIGNAL) < 0) {
            cut = true;
            break;
        }
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 300) == 1) {
            char b[256];
            if (recv(fd, b, sizeof b, 0) <= 0) {
                cut = true;
                break;
            }
        }
    }
    double dt = now_s() - t0;
    print_message("trickling client cut after %.1f s\n", dt);
    assert_true(cut);
    assert_true(dt >= 1.5 && dt < 12); /* read_timeout 2 s, with slack for a loaded machine */
    close(fd);
    /* a kept-alive connection is bounded the same way after its answer */
    fd = dial("127.0.0.3", g_narrow.port);
    const char *req = "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
    put(fd, req, strlen(req));
    char buf[4096];
    size_t n = 0;
    const char *sep = NULL;
    long clen = -1;
    t0 = now_s();
    while (now_s() - t0 < 5) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 100) != 1) continue;
        ssize_t r = recv(fd, buf + n, sizeof buf - 1 - n, 0);
        if (r <= 0) break;
        n += (size_t)r;
        buf[n] = 0;
        sep = strstr(buf, "\r\n\r\n");
        const char *cl = strcasestr(buf, "Content-Length:");
        if (sep && cl) clen = strtol(cl + 15, NULL, 10);
        if (sep && clen >= 0 && n >= (size_t)(sep + 4 - buf) + (size_t)clen) break;
    }
    assert_non_null(sep);
    assert_int_equal(strncmp(buf, "HTTP/1.1 200", 12), 0);
    t0 = now_s();
    struct pollfd p = {.fd = fd, .events = POLLIN};
    assert_int_equal(poll(&p, 1, 12000), 1);
    assert_true(recv(fd, buf, sizeof buf, 0) <= 0);
    dt = now_s() - t0;
    print_message("unused kept-alive connection closed %.1f s after its answer\n", dt);
    assert_true(dt >= 1.5 && dt < 12);
    close(fd);
}

/* ---- half-close ---- */

/* Sends the request, shuts the write side, reads the whole answer. */
static hresp half_closed(int port, const char *path, const char *body, double timeout_s) {
    int fd = dial(NULL, port);
    put_request(fd, "POST", path, NULL, body);
    shutdown(fd, SHUT_WR);
    size_t n;
    bool to;
    char *raw = slurp(fd, timeout_s, &n, &to);
    close(fd);
    hresp r;
    parse(raw, n, &r);
    free(raw);
    return r;
}

static double metric(int port, const char *name) {
    hresp r = request_from(NULL, port, "GET", "/metrics", NULL, NULL, 5);
    const char *p = strstr(r.body, name);
    double v = p ? atof(p + strlen(name)) : -1;
    hresp_free(&r);
    return v;
}

/* Holds the narrow server's only running slot with a stream nobody reads. */
static int hold_slot(int port) {
    int fd = dial("127.0.0.4", port);
    put_request(fd, "POST", "/v1/completions", NULL,
                "{\"prompt\":\"hold\",\"max_tokens\":30000,\"ignore_eos\":true,\"stream\":true}");
    for (int i = 0; i < 200 && metric(port, "\nember_requests_running ") < 1; i++) usleep(20000);
    return fd;
}

static void test_half_close_gets_answer(void **state) {
    (void)state;
    int port = g_wide.port;
    hresp r = half_closed(port, "/v1/completions", "{\"prompt\":\"Once upon\",\"max_tokens\":300,\"ignore_eos\":true}", 30);
    assert_int_equal(r.status, 200);
    cJSON *j = cJSON_Parse(r.body);
    assert_non_null(j);
    assert_int_equal((int)cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "completion_tokens")->valuedouble, 300);
    cJSON_Delete(j);
    hresp_free(&r);
    r = half_closed(port, "/v1/chat/completions",
                    "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":200,\"ignore_eos\":true,"
                    "\"stream\":true,\"stream_options\":{\"include_usage\":true}}",
                    30);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"completion_tokens\":200"));
    assert_non_null(strstr(r.body, "data: [DONE]\n\n"));
    hresp_free(&r);
    /* Waiting more than a second behind another request: the server probes
     * the half-closed client and still delivers the answer (non-streaming:
     * JSON after leading whitespace; streaming: SSE comments before the
     * events). */
    int hold = hold_slot(g_narrow.port);
    int fd = dial(NULL, g_narrow.port);
    put_request(fd, "POST", "/v1/completions", NULL, "{\"prompt\":\"queued\",\"max_tokens\":5,\"ignore_eos\":true}");
    shutdown(fd, SHUT_WR);
    int sfd = dial(NULL, g_narrow.port);
    put_request(sfd, "POST", "/v1/completions", NULL,
                "{\"prompt\":\"queued\",\"max_tokens\":5,\"ignore_eos\":true,\"stream\":true}");
    shutdown(sfd, SHUT_WR);
    usleep(2500000);
    close(hold); /* frees the slot: the queued requests run */
    size_t n;
    bool to;
    char *raw = slurp(fd, 30, &n, &to);
    close(fd);
    parse(raw, n, &r);
    free(raw);
    assert_int_equal(r.status, 200);
    assert_true(r.len > 0 && r.body[0] == ' ');
    j = cJSON_Parse(r.body);
    if (j == NULL) print_message("not JSON: %s\n", r.body);
    assert_non_null(j);
    assert_int_equal((int)cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "completion_tokens")->valuedouble, 5);
    cJSON_Delete(j);
    hresp_free(&r);
    raw = slurp(sfd, 30, &n, &to);
    close(sfd);
    parse(raw, n, &r);
    free(raw);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, ": keep-alive\n\n"));
    assert_non_null(strstr(r.body, "data: [DONE]\n\n"));
    hresp_free(&r);
}

/* A client that closes (not half-closes) a waiting non-streaming request is
 * found by the probe and its request cancelled. */
static void test_closed_client_is_cancelled(void **state) {
    (void)state;
    int port = g_narrow.port;
    double before = metric(port, "ember_generation_finish_total{reason=\"cancelled\"} ");
    int hold = hold_slot(port);
    int fd = dial(NULL, port);
    put_request(fd, "POST", "/v1/completions", NULL, "{\"prompt\":\"gone\",\"max_tokens\":20000,\"ignore_eos\":true}");
    usleep(300000);
    close(fd);
    usleep(300000);
    close(hold);
    double after = before;
    for (int i = 0; i < 100; i++) {
        after = metric(port, "ember_generation_finish_total{reason=\"cancelled\"} ");
        if (after >= before + 2 && metric(port, "\nember_requests_running ") == 0) break;
        usleep(100000);
    }
    assert_true(after >= before + 2); /* the hold and the closed request */
    assert_true(metric(port, "\nember_requests_running ") == 0);
}

/* ---- API edges ---- */

static void test_model_names(void **state) {
    (void)state;
    /* wide: served as the file name */
    const char *ok_wide[] = {"tiny", "tiny.gguf"};
    for (int i = 0; i < 2; i++) {
        char body[256];
        snprintf(body, sizeof body, "{\"model\":\"%s\",\"prompt\":\"a\",\"max_tokens\":2}", ok_wide[i]);
        hresp r = post(g_wide.port, "/v1/completions", NULL, body);
        assert_int_equal(r.status, 200);
        hresp_free(&r);
    }
    /* narrow: served as model_id, the file name still answers */
    const char *ok_narrow[] = {"served-name", "tiny", "tiny.gguf"};
    for (int i = 0; i < 3; i++) {
        char body[256];
        snprintf(body, sizeof body, "{\"model\":\"%s\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"}],\"max_tokens\":2}",
                 ok_narrow[i]);
        hresp r = post(g_narrow.port, "/v1/chat/completions", NULL, body);
        assert_int_equal(r.status, 200);
        cJSON *j = cJSON_Parse(r.body);
        assert_string_equal(cJSON_GetObjectItem(j, "model")->valuestring, "served-name");
        cJSON_Delete(j);
        hresp_free(&r);
    }
    const char *bad[] = {"gpt-4o", "", "tiny.gguf.gguf", "TINY", "served-name "};
    for (int i = 0; i < 5; i++) {
        char body[256];
        snprintf(body, sizeof body, "{\"model\":\"%s\",\"prompt\":\"a\",\"max_tokens\":2}", bad[i]);
        hresp r = post(g_narrow.port, "/v1/completions", NULL, body);
        expect_error(&r, 404, "model_not_found", "model");
        hresp_free(&r);
    }
    hresp r = request_from(NULL, g_narrow.port, "GET", "/v1/cache/stats?model=tiny.gguf", NULL, NULL, 5);
    assert_int_equal(r.status, 200);
    hresp_free(&r);
    r = request_from(NULL, g_narrow.port, "GET", "/v1/cache/stats?model=other", NULL, NULL, 5);
    expect_error(&r, 404, "model_not_found", "model");
    hresp_free(&r);
}

static void test_control_characters(void **state) {
    (void)state;
    int port = g_wide.port;
    /* raw control characters in strings: invalid JSON (cJSON would take them) */
    const char *raw[] = {
        "{\"prompt\":\"a\tb\",\"max_tokens\":2}",
        "{\"prompt\":\"a\nb\",\"max_tokens\":2}",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"a\x01z\"}],\"max_tokens\":2}",
        "{\"prompt\":\"a\",\"stop\":\"\x1f\",\"max_tokens\":2}",
        "{\"prompt\":\"a\",\"max_tokens\":2}\x02",
        "{\"prompt\":\x0b\"a\",\"max_tokens\":2}",
    };
    for (int i = 0; i < 6; i++) {
        hresp r = post(port, i == 2 ? "/v1/chat/completions" : "/v1/completions", NULL, raw[i]);
        expect_error(&r, 400, "invalid_json", NULL);
        hresp_free(&r);
    }
    /* the same characters escaped are fine */
    hresp r = post(port, "/v1/chat/completions", NULL,
                   "{\"messages\":[{\"role\":\"user\",\"content\":\"a\\tb\\nc\\u0001d\\\\u0000\"}],\"max_tokens\":2}");
    assert_int_equal(r.status, 200);
    hresp_free(&r);
    /* U+0000 wherever a string enters */
    struct {
        const char *path, *body, *param;
    } nul[] = {
        {"/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"a\\u0000b\"}],\"max_tokens\":2}",
         "messages"},
        {"/v1/chat/completions", "{\"messages\":[{\"role\":\"us\\u0000er\",\"content\":\"a\"}],\"max_tokens\":2}",
         "messages"},
        {"/v1/completions", "{\"prompt\":\"\\u0000\",\"max_tokens\":2}", "prompt"},
        {"/v1/completions", "{\"prompt\":[\"x\\u0000\"],\"max_tokens\":2}", "prompt"},
        {"/v1/completions", "{\"prompt\":\"a\",\"stop\":[\"x\",\"\\u0000\"],\"max_tokens\":2}", "stop"},
        {"/v1/completions", "{\"prompt\":\"a\",\"cache_salt\":\"t\\u0000\",\"max_tokens\":2}", "cache_salt"},
        {"/v1/completions", "{\"model\":\"tiny\\u0000x\",\"prompt\":\"a\",\"max_tokens\":2}", "model"},
        {"/v1/completions", "{\"prompt\":\"a\",\"user\":{\"id\":\"\\u0000\"},\"max_tokens\":2}", "user"},
    };
    for (size_t i = 0; i < sizeof nul / sizeof nul[0]; i++) {
        r = post(port, nul[i].path, NULL, nul[i].body);
        expect_error(&r, 400, "invalid_value", nul[i].param);
        hresp_free(&r);
    }
    /* tenant headers: a control character is refused, a plain value works */
    r = post(port, "/v1/completions", "X-APC-Tenant: a\x01z\r\n", SMALL);
    expect_error(&r, 400, "invalid_value", "X-APC-Tenant");
    hresp_free(&r);
    r = post(port, "/v1/completions", "X-Tenant-Id: t\x1b\r\n", SMALL);
    expect_error(&r, 400, "invalid_value", "X-Tenant-Id");
    hresp_free(&r);
    r = post(port, "/v1/completions", "X-APC-Tenant: team-a\r\n", SMALL);
    assert_int_equal(r.status, 200);
    hresp_free(&r);
}

typedef struct null_job {
    int port;
    const char *body;
    hresp r;
    double secs;
} null_job;

static void *null_worker(void *arg) {
    null_job *j = arg;
    double t0 = now_s();
    j->r = request_from(NULL, j->port, "POST", "/v1/completions", NULL, j->body, 120);
    j->secs = now_s() - t0;
    return NULL;
}

/* max_tokens null on a 256-token context whose KV pool holds 12 blocks
 * (192 tokens, 176 for one sequence): six at once all finish, each with
 * "length" at the room the pool leaves. */
static void test_max_tokens_null_under_load(void **state) {
    (void)state;
    srv small = {0};
    char *extra[] = {(char *)"--ctx", (char *)"256", (char *)"--num-blocks", (char *)"12", NULL};
    assert_int_equal(spawn(&small, "small", "server:\n  max_running: 4\n", extra), 0);
    enum { N = 6 };
    null_job jobs[N];
    pthread_t th[N];
    const char *bodies[] = {"{\"prompt\":\"Once upon a time\",\"max_tokens\":null,\"ignore_eos\":true}",
                            "{\"prompt\":\"Once upon a time\",\"max_completion_tokens\":null,\"ignore_eos\":true}",
                            "{\"prompt\":\"Once upon a time\",\"ignore_eos\":true,\"stream\":true}"};
    for (int i = 0; i < N; i++) {
        jobs[i] = (null_job){.port = small.port, .body = bodies[i % 3]};
        pthread_create(&th[i], NULL, null_worker, &jobs[i]);
    }
    for (int i = 0; i < N; i++) pthread_join(th[i], NULL);
    hresp p = post(small.port, "/v1/completions", NULL, "{\"prompt\":\"Once upon a time\",\"max_tokens\":1}");
    cJSON *pj = cJSON_Parse(p.body);
    assert_non_null(pj);
    int n_prompt = (int)cJSON_GetObjectItem(cJSON_GetObjectItem(pj, "usage"), "prompt_tokens")->valuedouble;
    cJSON_Delete(pj);
    hresp_free(&p);
    for (int i = 0; i < N; i++) {
        print_message("max_tokens null #%d: status %d in %.2f s\n", i, jobs[i].r.status, jobs[i].secs);
        if (jobs[i].r.status != 200) print_message("%s\n", jobs[i].r.body);
        assert_int_equal(jobs[i].r.status, 200);
        if (i % 3 == 2) {
            assert_non_null(strstr(jobs[i].r.body, "\"finish_reason\":\"length\""));
            assert_non_null(strstr(jobs[i].r.body, "data: [DONE]"));
        } else {
            cJSON *j = cJSON_Parse(jobs[i].r.body);
            assert_non_null(j);
            const cJSON *c0 = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
            assert_string_equal(cJSON_GetObjectItem(c0, "finish_reason")->valuestring, "length");
            int got = (int)cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "completion_tokens")->valuedouble;
            assert_int_equal(got, (12 - 1) * 16 - n_prompt);
            cJSON_Delete(j);
        }
        hresp_free(&jobs[i].r);
    }
    assert_int_equal(stop(&small), 0);
}

static void test_servers_exit_cleanly(void **state) {
    (void)state;
    assert_int_equal(stop(&g_wide), 0);
    assert_int_equal(stop(&g_narrow), 0);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_idle_sockets_do_not_lock_out),
        cmocka_unit_test(test_limits_answer_503),
        cmocka_unit_test(test_trickled_header_is_cut),
        cmocka_unit_test(test_half_close_gets_answer),
        cmocka_unit_test(test_closed_client_is_cancelled),
        cmocka_unit_test(test_model_names),
        cmocka_unit_test(test_control_characters),
        cmocka_unit_test(test_max_tokens_null_under_load),
        cmocka_unit_test(test_servers_exit_cleanly),
    };
    if (getenv("TEST_SERVE_FILTER")) cmocka_set_test_filter(getenv("TEST_SERVE_FILTER"));
    if (ember_binary() == NULL) {
        print_message("EMBER_BIN is not set\n");
        return 1;
    }
    int rc = cmocka_run_group_tests(tests, setup, teardown);
    return rc != 0 || g_setup_failed ? 1 : 0;
}
