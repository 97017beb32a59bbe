/* http_client.c - the loopback HTTP client and server launcher of the tests
 * and serving benchmarks (see http_client.h for the contract).
 *
 * Design: blocking sockets, one connection per request, reads to EOF. This is
 * all a test of `ember serve` needs and it keeps every function reentrant:
 * test_serve calls it from many threads at once, and an earlier copy that
 * split strings with strtok shared hidden state between them. A timeout on
 * the socket turns a stalled server into a failed request with a reason
 * instead of a test that hangs until CTest kills it.
 *
 * The launcher sets PR_SET_PDEATHSIG in the child before exec so that the
 * kernel kills the server when the test (more exactly: the spawning thread)
 * dies, however it dies. The child compares getppid() with the parent's pid
 * taken before fork: if the parent died before prctl ran, the signal would
 * never come, so the child exits instead of serving forever. */
#define _GNU_SOURCE
#include "http_client.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* ---- connections ---- */

int http_connect(int port, int timeout_s) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    if (timeout_s > 0) {
        struct timeval tv = {.tv_sec = timeout_s};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    }
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

bool http_send_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        p += w;
        n -= (size_t)w;
    }
    return true;
}

int http_send_request(int port, const char *method, const char *path, const char *extra_headers,
                      const char *body, size_t len, int timeout_s) {
    int fd = http_connect(port, timeout_s);
    if (fd < 0) return -1;
    size_t cap = strlen(method) + strlen(path) + (extra_headers ? strlen(extra_headers) : 0) + 256;
    char *head = malloc(cap);
    if (head == NULL) {
        close(fd);
        return -1;
    }
    int n = snprintf(head, cap, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n%s", method, path,
                     extra_headers ? extra_headers : "");
    if (body)
        n += snprintf(head + n, cap - (size_t)n, "Content-Type: application/json\r\nContent-Length: %zu\r\n", len);
    n += snprintf(head + n, cap - (size_t)n, "\r\n");
    bool ok = http_send_all(fd, head, (size_t)n) && (body == NULL || http_send_all(fd, body, len));
    free(head);
    if (!ok) {
        close(fd);
        return -1;
    }
    return fd;
}

/* ---- responses ---- */

char *http_read_all(int fd, size_t *n_out, bool *stalled) {
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    bool bad = false;
    for (;;) {
        if (n + 4096 > cap) {
            char *nb = realloc(buf, cap *= 2);
            if (nb == NULL) {
                bad = true;
                break;
            }
            buf = nb;
        }
        ssize_t r = recv(fd, buf + n, cap - n - 1, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r == 0) break;
        if (r < 0) {
            bad = true; /* EAGAIN: the receive timeout; else a reset */
            break;
        }
        n += (size_t)r;
    }
    buf[n] = 0;
    *n_out = n;
    if (stalled) *stalled = bad;
    return buf;
}

char *http_dechunk(const char *b, size_t n, size_t *out_n, bool *complete) {
    char *o = malloc(n + 1);
    size_t k = 0, i = 0;
    *complete = false;
    while (i < n) {
        char *end = NULL;
        unsigned long sz = strtoul(b + i, &end, 16);
        size_t after = (size_t)(end - b);
        if (end == b + i || after + 2 > n || end[0] != '\r' || end[1] != '\n') break;
        i = after + 2;
        if (sz == 0) {
            *complete = i + 2 <= n && b[i] == '\r' && b[i + 1] == '\n';
            break;
        }
        if (sz > n - i || n - i - sz < 2 || b[i + sz] != '\r' || b[i + sz + 1] != '\n') break;
        memcpy(o + k, b + i, sz);
        k += sz;
        i += sz + 2;
    }
    o[k] = 0;
    *out_n = k;
    return o;
}

void http_parse_response(const char *raw, size_t n, http_resp *out) {
    memset(out, 0, sizeof *out);
    const char *sep = strstr(raw, "\r\n\r\n");
    if (sep == NULL || sscanf(raw, "HTTP/1.%*d %d", &out->status) != 1) {
        out->status = -1;
        out->headers = strdup("");
        out->body = strdup("");
        return;
    }
    out->headers = strndup(raw, (size_t)(sep - raw));
    const char *b = sep + 4;
    size_t blen = n - (size_t)(b - raw);
    if (strcasestr(out->headers, "Transfer-Encoding: chunked")) {
        out->body = http_dechunk(b, blen, &out->len, &out->complete);
    } else {
        out->body = strndup(b, blen);
        out->len = blen;
        out->complete = true;
    }
}

void http_resp_free(http_resp *r) {
    free(r->headers);
    free(r->body);
    memset(r, 0, sizeof *r);
}

http_resp http_request(int port, const char *method, const char *path, const char *extra_headers,
                       const char *body, int timeout_s) {
    http_resp r;
    int fd = http_send_request(port, method, path, extra_headers, body, body ? strlen(body) : 0, timeout_s);
    if (fd < 0) {
        memset(&r, 0, sizeof r);
        r.status = -1;
        r.headers = strdup("");
        r.body = strdup("");
        return r;
    }
    size_t n;
    bool stalled;
    char *raw = http_read_all(fd, &n, &stalled);
    close(fd);
    http_parse_response(raw, n, &r);
    r.stalled = stalled;
    if (stalled) r.status = -1;
    free(raw);
    return r;
}

/* ---- servers ---- */

/* A sanitizer build runs the server several times slower (ThreadSanitizer
 * most), and a loaded CI machine slows it again: the start-up wait and the
 * drain's grace scale by this so that they keep the same real margin. */
#if defined(__SANITIZE_THREAD__)
#define SANITIZER_SLOWDOWN 4
#elif defined(__SANITIZE_ADDRESS__)
#define SANITIZER_SLOWDOWN 2
#else
#define SANITIZER_SLOWDOWN 1
#endif

static void sleep_ms(int ms) {
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {
    }
}

int http_spawn_server(char *const argv[], const char *log_path, int wait_s, pid_t *pid) {
    /* Empty the log before the child exists: otherwise the first poll below
     * can read a previous server's "listening on" line from a reused path
     * and hand back that server's port. */
    FILE *truncate_log = fopen(log_path, "w");
    if (truncate_log == NULL) {
        *pid = 0;
        return -1;
    }
    fclose(truncate_log);
    pid_t parent = getpid();
    *pid = fork();
    if (*pid < 0) {
        *pid = 0;
        return -1;
    }
    if (*pid == 0) {
        if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) _exit(126);
        if (freopen(log_path, "a", stderr) == NULL) _exit(127);
        execv(argv[0], argv);
        _exit(127);
    }
    const char *marker = "listening on http://127.0.0.1:";
    for (int waited = 0; waited < wait_s * 1000 * SANITIZER_SLOWDOWN; waited += 50) {
        FILE *f = fopen(log_path, "r");
        char line[512];
        while (f && fgets(line, sizeof line, f)) {
            const char *p = strstr(line, marker);
            if (p) {
                fclose(f);
                return atoi(p + strlen(marker));
            }
        }
        if (f) fclose(f);
        int st;
        if (waitpid(*pid, &st, WNOHANG) == *pid) {
            *pid = 0;
            return -1;
        }
        sleep_ms(50);
    }
    http_stop_server(pid, 0);
    return -1;
}

int http_call(int port, const char *method, const char *path, const char *extra_headers, const char *req_body,
              char **body) {
    http_resp r = http_request(port, method, path, extra_headers, req_body, 120);
    *body = strdup(r.body ? r.body : "");
    int status = r.status;
    http_resp_free(&r);
    return status;
}

int http_spawn_ember(const char *bin, const char *model_path, char *const extra[], const char *log_path, pid_t *pid) {
    char *argv[48];
    int a = 0;
    argv[a++] = (char *)bin;
    argv[a++] = (char *)"serve";
    argv[a++] = (char *)model_path;
    argv[a++] = (char *)"--port";
    argv[a++] = (char *)"0";
    argv[a++] = (char *)"--threads";
    argv[a++] = (char *)"2";
    for (int i = 0; extra && extra[i] && a < 47; i++) argv[a++] = extra[i];
    argv[a] = NULL;
    return http_spawn_server(argv, log_path, 30, pid);
}

int http_stop_server(pid_t *pid, int grace_ms) {
    if (*pid <= 0) return -1;
    int st = 0;
    if (grace_ms > 0 && kill(*pid, SIGTERM) == 0) {
        for (int waited = 0; waited <= grace_ms * SANITIZER_SLOWDOWN; waited += 50) {
            pid_t w = waitpid(*pid, &st, WNOHANG);
            if (w == *pid) {
                *pid = 0;
                return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
            }
            if (w < 0) {
                *pid = 0;
                return -1;
            }
            sleep_ms(50);
        }
    }
    kill(*pid, SIGKILL);
    waitpid(*pid, &st, 0);
    *pid = 0;
    return -1;
}
