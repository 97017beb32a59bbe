/* cmd_bench_http.c - the HTTP side of `ember bench` (bench.h): one
 * blocking HTTP/1.1 connection per request (Connection: close), SSE
 * streaming read as it arrives so the first token is timed when its event
 * lands, chunked transfer decoded incrementally.
 *
 * What a server reports varies, so every event is read for all of: text
 * (choices[0].text, delta.content, delta.reasoning_content), usage
 * (prompt_tokens, completion_tokens, prompt_tokens_details.cached_tokens:
 * ember, vLLM, OpenAI) and llama-server's timings (cache_n, prompt_n). A
 * server that answers a streamed request with one JSON object is read the
 * same way. Only plain http:// URLs are supported. */
#define _GNU_SOURCE
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "cli/bench.h"

double bench_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct url_parts {
    char host[256], port[16], prefix[512];
} url_parts;

static int parse_url(const char *url, url_parts *u) {
    memset(u, 0, sizeof *u);
    if (strncmp(url, "http://", 7) != 0) return -1;
    const char *h = url + 7, *slash = strchr(h, '/');
    size_t hl = slash ? (size_t)(slash - h) : strlen(h);
    const char *colon = memchr(h, ':', hl);
    size_t name = colon ? (size_t)(colon - h) : hl;
    if (name == 0 || name >= sizeof u->host) return -1;
    memcpy(u->host, h, name);
    if (colon) snprintf(u->port, sizeof u->port, "%.*s", (int)(hl - name - 1), colon + 1);
    else snprintf(u->port, sizeof u->port, "80");
    if (slash) snprintf(u->prefix, sizeof u->prefix, "%s", slash);
    size_t pl = strlen(u->prefix);
    while (pl > 0 && u->prefix[pl - 1] == '/') u->prefix[--pl] = 0;
    return 0;
}

static int connect_url(const url_parts *u) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    if (getaddrinfo(u->host, u->port, &hints, &res) != 0) return -1;
    int fd = -1;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd >= 0 && connect(fd, a->ai_addr, a->ai_addrlen) < 0) {
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    return fd;
}

static int send_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int open_request(const bench_opts *o, const char *method, const char *path, const char *body) {
    url_parts u;
    if (parse_url(o->url, &u) < 0) return -2;
    int fd = connect_url(&u);
    if (fd < 0) return -1;
    char head[2048];
    size_t blen = body ? strlen(body) : 0;
    int n = snprintf(head, sizeof head,
                     "%s %s%s HTTP/1.1\r\nHost: %s:%s\r\nConnection: close\r\nAccept: %s\r\n", method, u.prefix, path,
                     u.host, u.port, body ? "text/event-stream" : "*/*");
    if (o->api_key && o->api_key[0])
        n += snprintf(head + n, sizeof head - (size_t)n, "Authorization: Bearer %s\r\n", o->api_key);
    if (body)
        n += snprintf(head + n, sizeof head - (size_t)n, "Content-Type: application/json\r\nContent-Length: %zu\r\n",
                      blen);
    n += snprintf(head + n, sizeof head - (size_t)n, "\r\n");
    if (send_all(fd, head, (size_t)n) < 0 || (body && send_all(fd, body, blen) < 0)) {
        close(fd);
        return -1;
    }
    return fd;
}

/* ---- a response read as it arrives ---- */

typedef struct reader {
    int fd;
    char *raw;               /* bytes received, not yet decoded */
    size_t raw_len, raw_cap;
    bool headers_done, chunked, eof;
    int status;
    long chunk_left;         /* chunked: bytes left in the current chunk; -1: expect a size line */
    char *body;              /* decoded body bytes, not yet consumed */
    size_t body_len, body_cap;
} reader;

static void append(char **buf, size_t *len, size_t *cap, const char *p, size_t n) {
    if (n == 0) return;
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : 4096;
        while (c < *len + n + 1) c *= 2;
        char *q = realloc(*buf, c);
        if (q == NULL) return;
        *buf = q;
        *cap = c;
    }
    memcpy(*buf + *len, p, n);
    *len += n;
    (*buf)[*len] = 0;
}

static void consume_raw(reader *rd, size_t n) {
    memmove(rd->raw, rd->raw + n, rd->raw_len - n);
    rd->raw_len -= n;
    rd->raw[rd->raw_len] = 0;
}

/* Moves decodable bytes from raw to body. */
static void decode(reader *rd) {
    if (!rd->headers_done) {
        char *sep = rd->raw ? strstr(rd->raw, "\r\n\r\n") : NULL;
        if (sep == NULL) return;
        *sep = 0;
        if (sscanf(rd->raw, "HTTP/1.%*d %d", &rd->status) != 1) rd->status = -1;
        rd->chunked = strcasestr(rd->raw, "Transfer-Encoding: chunked") != NULL;
        rd->chunk_left = -1;
        consume_raw(rd, (size_t)(sep - rd->raw) + 4);
        rd->headers_done = true;
    }
    if (!rd->chunked) {
        append(&rd->body, &rd->body_len, &rd->body_cap, rd->raw, rd->raw_len);
        rd->raw_len = 0;
        return;
    }
    /* chunk_left: > 0 data bytes to come, -1 a size line, -2 the CRLF after a chunk */
    for (;;) {
        if (rd->chunk_left == -1) {
            char *eol = rd->raw_len ? strstr(rd->raw, "\r\n") : NULL;
            if (eol == NULL) return;
            long size = strtol(rd->raw, NULL, 16);
            consume_raw(rd, (size_t)(eol - rd->raw) + 2);
            if (size <= 0) {
                rd->eof = true;
                return;
            }
            rd->chunk_left = size;
        }
        if (rd->chunk_left > 0) {
            size_t take = rd->raw_len < (size_t)rd->chunk_left ? rd->raw_len : (size_t)rd->chunk_left;
            append(&rd->body, &rd->body_len, &rd->body_cap, rd->raw, take);
            consume_raw(rd, take);
            rd->chunk_left -= (long)take;
            if (rd->chunk_left > 0) return;
            rd->chunk_left = -2;
        }
        if (rd->raw_len < 2) return;
        consume_raw(rd, 2);
        rd->chunk_left = -1;
    }
}

/* Reads more; false at the end of the response. */
static bool read_more(reader *rd) {
    if (rd->eof) return false;
    char buf[16384];
    ssize_t n = recv(rd->fd, buf, sizeof buf, 0);
    if (n <= 0) {
        rd->eof = true;
        return false;
    }
    append(&rd->raw, &rd->raw_len, &rd->raw_cap, buf, (size_t)n);
    decode(rd);
    return true;
}

static void reader_free(reader *rd) {
    if (rd->fd >= 0) close(rd->fd);
    free(rd->raw);
    free(rd->body);
}

/* ---- one event ---- */

typedef struct result_acc {
    bench_req *r;
    double t_start;
    char *text;
    size_t len, cap;
    int events_with_text;
} result_acc;

static double num_or(const cJSON *o, const char *k, double dflt) {
    const cJSON *v = cJSON_GetObjectItem(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : dflt;
}

static void take_event(result_acc *a, const cJSON *j) {
    bench_req *r = a->r;
    const cJSON *err = cJSON_GetObjectItem(j, "error");
    if (err) {
        const cJSON *m = cJSON_IsObject(err) ? cJSON_GetObjectItem(err, "message") : err;
        snprintf(r->error, sizeof r->error, "%s", cJSON_IsString(m) ? m->valuestring : "error event");
    }
    const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    if (ch) {
        const cJSON *t = cJSON_GetObjectItem(ch, "text"), *d = cJSON_GetObjectItem(ch, "delta"),
                    *m = cJSON_GetObjectItem(ch, "message");
        const cJSON *content = cJSON_IsString(t) ? t : NULL, *reasoning = NULL;
        if (d) {
            content = cJSON_GetObjectItem(d, "content");
            reasoning = cJSON_GetObjectItem(d, "reasoning_content");
        } else if (m) {
            content = cJSON_GetObjectItem(m, "content");
            reasoning = cJSON_GetObjectItem(m, "reasoning_content");
        }
        bool any = (cJSON_IsString(content) && content->valuestring[0]) ||
                   (cJSON_IsString(reasoning) && reasoning->valuestring[0]);
        if (any && r->ttft_s < 0) r->ttft_s = bench_now() - a->t_start;
        if (any) a->events_with_text++;
        if (cJSON_IsString(content)) append(&a->text, &a->len, &a->cap, content->valuestring, strlen(content->valuestring));
    }
    const cJSON *u = cJSON_GetObjectItem(j, "usage");
    if (cJSON_IsObject(u)) {
        r->prompt_tokens = (int64_t)num_or(u, "prompt_tokens", (double)r->prompt_tokens);
        r->completion_tokens = (int)num_or(u, "completion_tokens", r->completion_tokens);
        const cJSON *det = cJSON_GetObjectItem(u, "prompt_tokens_details");
        if (cJSON_IsObject(det)) r->cached_tokens = (int64_t)num_or(det, "cached_tokens", (double)r->cached_tokens);
    }
    const cJSON *tm = cJSON_GetObjectItem(j, "timings"); /* llama-server */
    if (cJSON_IsObject(tm)) {
        double cache_n = num_or(tm, "cache_n", -1), prompt_n = num_or(tm, "prompt_n", -1);
        if (cache_n >= 0) r->cached_tokens = (int64_t)cache_n;
        if (cache_n >= 0 && prompt_n >= 0 && r->prompt_tokens < 0) r->prompt_tokens = (int64_t)(cache_n + prompt_n);
        double pred = num_or(tm, "predicted_n", -1);
        if (pred >= 0 && r->completion_tokens <= 0) r->completion_tokens = (int)pred;
    }
}

/* Consumes complete SSE events ("\n\n"-separated) from the body. */
static bool take_sse(reader *rd, result_acc *a) {
    bool done = false;
    for (;;) {
        char *end = rd->body ? strstr(rd->body, "\n\n") : NULL;
        if (end == NULL) break;
        *end = 0;
        for (char *line = rd->body; line && *line;) {
            char *nl = strchr(line, '\n');
            if (nl) *nl = 0;
            if (strncmp(line, "data:", 5) == 0) {
                const char *p = line + 5;
                while (*p == ' ') p++;
                if (strncmp(p, "[DONE]", 6) == 0) done = true;
                else {
                    cJSON *j = cJSON_Parse(p);
                    if (j) take_event(a, j);
                    cJSON_Delete(j);
                }
            }
            line = nl ? nl + 1 : NULL;
        }
        size_t used = (size_t)(end - rd->body) + 2;
        memmove(rd->body, rd->body + used, rd->body_len - used + 1);
        rd->body_len -= used;
    }
    return done;
}

void bench_http_request(const bench_opts *o, const char *path, const char *body, double t0, bench_req *r) {
    result_acc a = {r, bench_now(), NULL, 0, 0, 0};
    r->start_s = a.t_start - t0;
    r->ttft_s = r->total_s = -1;
    r->status = 0;
    r->error[0] = 0;
    reader rd;
    memset(&rd, 0, sizeof rd);
    rd.fd = open_request(o, "POST", path, body);
    if (rd.fd < 0) {
        snprintf(r->error, sizeof r->error, "%s", rd.fd == -2 ? "bad --url (http://HOST:PORT)" : "cannot connect");
        r->total_s = bench_now() - a.t_start;
        return;
    }
    bool sse = false, done = false;
    while (!done && read_more(&rd)) {
        if (!rd.headers_done) continue;
        if (rd.status != 200) continue; /* read the whole error body */
        if (!sse && rd.body_len > 0) sse = strncmp(rd.body, "data:", 5) == 0 || strncmp(rd.body, ":", 1) == 0;
        if (sse) done = take_sse(&rd, &a);
    }
    r->status = rd.status;
    if (sse && !done) take_sse(&rd, &a);
    if (!sse && rd.body_len > 0) {
        cJSON *j = cJSON_Parse(rd.body);
        if (j) {
            if (rd.status == 200 && r->ttft_s < 0) r->ttft_s = bench_now() - a.t_start; /* unstreamed: the whole reply */
            take_event(&a, j);
        } else if (rd.status != 200) {
            snprintf(r->error, sizeof r->error, "HTTP %d: %.120s", rd.status, rd.body);
        }
        cJSON_Delete(j);
    }
    if (rd.status != 200 && !r->error[0]) snprintf(r->error, sizeof r->error, "HTTP %d", rd.status);
    if (r->completion_tokens <= 0) r->completion_tokens = a.events_with_text;
    r->total_s = bench_now() - a.t_start;
    free(r->reply);
    r->reply = a.text ? a.text : strdup("");
    reader_free(&rd);
}

char *bench_http_get(const bench_opts *o, const char *path, int *status) {
    reader rd;
    memset(&rd, 0, sizeof rd);
    *status = 0;
    rd.fd = open_request(o, "GET", path, NULL);
    if (rd.fd < 0) return NULL;
    while (read_more(&rd)) {
    }
    *status = rd.status;
    char *body = rd.body ? rd.body : strdup("");
    rd.body = NULL;
    reader_free(&rd);
    return body;
}
