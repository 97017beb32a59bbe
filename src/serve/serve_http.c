/* serve_http.c - the HTTP server: libmicrohttpd daemon, routes, auth,
 * bodies, responses and SSE streaming (see serve.h).
 *
 * libmicrohttpd runs one thread per connection, so handlers may block:
 *  - every header-level decision (route, method, API key, declared body
 *    size) is taken on the handler's first call, before any body is read;
 *  - bodies accumulate up to max_body_bytes (a chunked upload that grows
 *    past it is discarded and answered 413 at the end);
 *  - a non-streaming generation waits in the handler for the scheduler,
 *    waking every 100 ms to check whether the client hung up (poll for
 *    POLLRDHUP on the connection's socket) and cancelling if so;
 *  - a streaming generation answers 200 at once with a content-reader
 *    callback that blocks (with the same 100 ms hang-up check) until the
 *    scheduler has new text, and frames it as OpenAI SSE:
 *    `data: {chunk}\n\n` ... `data: [DONE]\n\n`. When the client goes away
 *    libmicrohttpd frees the reader, which cancels the request.
 * Chat streams split thinking text into reasoning_content deltas: from the
 * start when the prompt opened <think>, or when the reply opens with it,
 * until </think> (a tag split across tokens is held back, never shown).
 * Streams that ask for logprobs keep the plain content deltas so each chunk's
 * logprobs stay aligned with its text. When the request offers tools, content
 * goes through a tool_filter (serve_tools.h): text that may begin a tool call
 * is held, and at the end the calls go out as delta.tool_calls chunks before
 * the finish chunk (finish_reason "tool_calls"). */
#define _GNU_SOURCE
#include "serve/serve.h"

#include <arpa/inet.h>
#include <microhttpd.h>
#include <poll.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/clock.h"
#include "core/log.h"
#include "engine/engine.h"
#include "model/model.h"
#include "serve/serve_api.h"
#include "serve/serve_chat.h"
#include "serve/serve_stats.h"
#include "serve/serve_metrics.h"
#include "serve/serve_sched.h"

struct server {
    serve_config cfg;
    model *m;
    engine *e;
    sched *s;
    serve_chat *chat;
    serve_metrics *metrics;
    struct MHD_Daemon *d;
    api_ctx api;
    char model_id[128];
    long created;
    int port;
    bool shut;
    atomic_int in_flight;    /* requests between their first handler call and completion */
};

typedef struct conn_state {
    char *body;
    size_t len, cap;
    bool too_big;
    int route;
} conn_state;

/* ---- responses ---- */

static enum MHD_Result send_buf(server *srv, struct MHD_Connection *c, const char *route, int status, char *body,
                                const char *ctype, int retry_after, const char *allow) {
    size_t len = body ? strlen(body) : 0;
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body ? body : (char *)"", body ? MHD_RESPMEM_MUST_FREE
                                                                                                  : MHD_RESPMEM_PERSISTENT);
    if (r == NULL) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", ctype);
    if (retry_after > 0) {
        char ra[16];
        snprintf(ra, sizeof ra, "%d", retry_after);
        MHD_add_response_header(r, "Retry-After", ra);
    }
    if (allow) MHD_add_response_header(r, "Allow", allow);
    if (status == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)status, r);
    MHD_destroy_response(r);
    serve_metrics_request(srv->metrics, route, status);
    return ret;
}

static enum MHD_Result send_json(server *srv, struct MHD_Connection *c, const char *route, int status, char *body) {
    return send_buf(srv, c, route, status, body, "application/json", 0, NULL);
}

static enum MHD_Result send_error(server *srv, struct MHD_Connection *c, const char *route, const api_error *e,
                                  const char *allow) {
    return send_buf(srv, c, route, e->status, api_error_json(e), "application/json", e->retry_after, allow);
}

static enum MHD_Result send_cjson(server *srv, struct MHD_Connection *c, const char *route, int status, cJSON *o) {
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return send_json(srv, c, route, status, s);
}

/* ---- helpers ---- */

static bool client_gone(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci == NULL) return false;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return false;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

static void make_id(char *out, size_t cap, const char *prefix) {
    static atomic_ullong counter;
    unsigned long long n = atomic_fetch_add(&counter, 1) + 1;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    unsigned long long x = ((unsigned long long)ts.tv_sec * 1000000007ULL) ^ (unsigned long long)ts.tv_nsec ^ (n << 40);
    x ^= x >> 31;
    x *= 0x9E3779B97F4A7C15ULL;
    x ^= x >> 29;
    snprintf(out, cap, "%s%016llx%06llx", prefix, x, n & 0xFFFFFF);
}

static const char *tenant_of(struct MHD_Connection *c) {
    const char *t = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-APC-Tenant");
    if (t == NULL || !t[0]) t = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Tenant-Id");
    return t && t[0] ? t : NULL;
}

static bool auth_ok(server *srv, struct MHD_Connection *c) {
    if (!srv->cfg.api_key[0]) return true;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Authorization");
    if (h == NULL || strncasecmp(h, "Bearer ", 7) != 0) return false;
    h += 7;
    while (*h == ' ') h++;
    size_t a = strlen(h), b = strlen(srv->cfg.api_key);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < a && i < b; i++) diff |= (unsigned char)(h[i] ^ srv->cfg.api_key[i]);
    return diff == 0;
}

/* ---- routes ---- */

enum {
    R_HEALTH = 0, R_MODELS, R_CHAT, R_COMPLETIONS, R_STATS, R_RESET, R_METRICS, R_COUNT_
};

static const struct {
    const char *path;
    const char *method;
    bool auth;
    const char *label;  /* metrics label */
} routes[] = {
    {"/health", "GET", false, "/health"},
    {"/v1/models", "GET", true, "/v1/models"},
    {"/v1/chat/completions", "POST", true, "/v1/chat/completions"},
    {"/v1/completions", "POST", true, "/v1/completions"},
    {"/v1/cache/stats", "GET", true, "/v1/cache/stats"},
    {"/v1/cache/reset", "POST", true, "/v1/cache/reset"},
    {"/metrics", "GET", true, "/metrics"},
    /* aliases */
    {"/cache/stats", "GET", true, "/v1/cache/stats"},
    {"/cache/reset", "POST", true, "/v1/cache/reset"},
    {"/v1/metrics", "GET", true, "/metrics"},
    {"/v1/health", "GET", false, "/health"},
};
static const int route_kind[] = {R_HEALTH, R_MODELS, R_CHAT,  R_COMPLETIONS, R_STATS, R_RESET,
                                 R_METRICS, R_STATS, R_RESET, R_METRICS,     R_HEALTH};
#define N_ROUTES (int)(sizeof routes / sizeof routes[0])

static int find_route(const char *url) {
    for (int i = 0; i < N_ROUTES; i++)
        if (strcmp(url, routes[i].path) == 0) return i;
    return -1;
}

static enum MHD_Result handle_models(server *srv, struct MHD_Connection *c) {
    cJSON *o = cJSON_CreateObject(), *data = cJSON_AddArrayToObject(o, "data"), *m = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON_AddStringToObject(m, "id", srv->model_id);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)srv->created);
    cJSON_AddStringToObject(m, "owned_by", "ember");
    cJSON_AddNumberToObject(m, "context_length", srv->api.n_ctx);
    cJSON_AddItemToArray(data, m);
    return send_cjson(srv, c, "/v1/models", 200, o);
}

static enum MHD_Result handle_stats(server *srv, struct MHD_Connection *c, bool reset) {
    const char *label = reset ? "/v1/cache/reset" : "/v1/cache/stats";
    const char *model = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "model");
    if (model && model[0] && strcmp(model, srv->model_id) != 0) {
        api_error e;
        api_fail(&e, 404, "invalid_request_error", "model", "model_not_found",
                 "The model '%.100s' does not exist; this server serves '%s'.", model, srv->model_id);
        return send_error(srv, c, label, &e, NULL);
    }
    apc *cache = engine_cache(srv->e);
    bool on = apc_get_tier(cache) != APC_TIER_NONE;
    if (!reset) {
        cJSON *o = serve_cache_stats_json(cache);
        if (o && on) { /* the scheduler's freshness gate (reference §14.1) */
            char why[160];
            cJSON_AddNumberToObject(o, "fresh_holds", (double)sched_fresh_holds(srv->s, why, sizeof why));
            cJSON_AddStringToObject(o, "fresh_last_hold_reason", why);
            if (apc_has_disk(cache))
                cJSON_AddNumberToObject(o, "disk_read_deadline_misses", (double)sched_disk_deadline_misses(srv->s));
        }
        return send_cjson(srv, c, label, 200, o);
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddBoolToObject(o, "enabled", on);
    if (on) {
        apc_reset(cache);
        cJSON_AddStringToObject(o, "status", "cleared");
        ember_log(EMBER_LOG_INFO, "APC reset: memory tiers cleared");
    }
    return send_cjson(srv, c, label, 200, o);
}

static enum MHD_Result handle_metrics(server *srv, struct MHD_Connection *c) {
    int running = 0, waiting = 0;
    sched_counts(srv->s, &running, &waiting);
    size_t len;
    char *text = serve_metrics_render(srv->metrics, engine_cache(srv->e), running, waiting, &len);
    return send_buf(srv, c, "/metrics", text ? 200 : 500, text, "text/plain; version=0.0.4; charset=utf-8", 0, NULL);
}

/* ---- generation ---- */

typedef struct stream_ctx {
    server *srv;
    struct MHD_Connection *conn;
    sreq *r;
    api_req q;
    sreq_cursor cur;
    char id[48];
    long created;
    char *out;
    size_t out_len, out_cap, out_off;
    int phase;           /* 0: role chunk, 1: tokens, 2: done */
    /* reasoning split (chat): 0 undecided (text may still open <think>),
     * 1 reasoning until </think>, 2 content */
    int think;
    char *pend;          /* text held back while deciding */
    size_t pend_len;
    tool_filter *tools;  /* requests with tools: content is parsed for calls */
    int n_calls;
} stream_ctx;

static void out_append(stream_ctx *st, const char *s, size_t n) {
    if (st->out_len + n + 1 > st->out_cap) {
        size_t cap = st->out_cap ? st->out_cap : 1024;
        while (cap < st->out_len + n + 1) cap *= 2;
        char *p = realloc(st->out, cap);
        if (p == NULL) return;
        st->out = p;
        st->out_cap = cap;
    }
    memcpy(st->out + st->out_len, s, n);
    st->out_len += n;
}

static void out_event(stream_ctx *st, char *json) {
    if (json == NULL) return;
    out_append(st, "data: ", 6);
    out_append(st, json, strlen(json));
    out_append(st, "\n\n", 2);
    free(json);
}

/* Longest suffix of s[0, n) that is a proper prefix of tag. */
static size_t tag_prefix_suffix(const char *s, size_t n, const char *tag) {
    size_t tl = strlen(tag);
    for (size_t k = tl - 1 < n ? tl - 1 : n; k > 0; k--)
        if (memcmp(s + n - k, tag, k) == 0) return k;
    return 0;
}

static void emit_split(stream_ctx *st, const char *text, size_t n, bool reasoning) {
    if (n == 0) return;
    char *t = !reasoning && st->tools ? tool_filter_push(st->tools, text, n, false, NULL) : strndup(text, n);
    if (t == NULL || t[0] == 0) {
        free(t);
        return;
    }
    out_event(st, api_chunk_json(&st->srv->api, &st->q, st->id, st->created, reasoning ? NULL : t,
                                 reasoning ? t : NULL, false, st->r, 0, 0, NULL, NULL, false));
    free(t);
}

/* The end of a stream with tools: held content, then the calls. */
static void emit_tool_calls(stream_ctx *st) {
    if (st->tools == NULL) return;
    tool_calls calls;
    char *t = tool_filter_push(st->tools, "", 0, true, &calls);
    if (t && t[0])
        out_event(st, api_chunk_json(&st->srv->api, &st->q, st->id, st->created, t, NULL, false, st->r, 0, 0, NULL,
                                     NULL, false));
    free(t);
    for (int i = 0; i < calls.n; i++) {
        out_event(st, api_tool_chunk_json(&st->srv->api, &st->q, st->id, st->created, i, &calls.v[i], true));
        out_event(st, api_tool_chunk_json(&st->srv->api, &st->q, st->id, st->created, i, &calls.v[i], false));
    }
    st->n_calls = calls.n;
    tool_calls_free(&calls);
}

/* Routes new chat text to reasoning_content or content; at_end flushes. */
static void route_text(stream_ctx *st, const char *text, size_t n, bool at_end) {
    char *p = realloc(st->pend, st->pend_len + n + 1);
    if (p == NULL) return;
    st->pend = p;
    memcpy(st->pend + st->pend_len, text, n);
    st->pend_len += n;
    st->pend[st->pend_len] = 0;
    for (;;) {
        if (st->think == 0) {
            size_t skip = 0;
            while (skip < st->pend_len && st->pend[skip] == '\n') skip++;
            size_t rest = st->pend_len - skip;
            if (rest >= 7 && memcmp(st->pend + skip, "<think>", 7) == 0) {
                st->think = 1;
                memmove(st->pend, st->pend + skip + 7, rest - 7 + 1);
                st->pend_len = rest - 7;
                continue;
            }
            /* still possibly "<think>" (after at most two newlines): wait */
            if (!at_end && skip <= 2 && memcmp(st->pend + skip, "<think>", rest < 7 ? rest : 7) == 0) return;
            st->think = 2;
        }
        if (st->think == 1) {
            char *close = memmem(st->pend, st->pend_len, "</think>", 8);
            if (close) {
                size_t a = (size_t)(close - st->pend);
                emit_split(st, st->pend, a, true);
                size_t b = a + 8;
                while (b < st->pend_len && st->pend[b] == '\n') b++;
                memmove(st->pend, st->pend + b, st->pend_len - b + 1);
                st->pend_len -= b;
                st->think = 2;
                continue;
            }
            size_t keep = at_end ? 0 : tag_prefix_suffix(st->pend, st->pend_len, "</think>");
            emit_split(st, st->pend, st->pend_len - keep, true);
            memmove(st->pend, st->pend + st->pend_len - keep, keep + 1);
            st->pend_len = keep;
            return;
        }
        emit_split(st, st->pend, st->pend_len, false);
        st->pend_len = 0;
        st->pend[0] = 0;
        return;
    }
}

/* Produces the next SSE events; returns false when the client is gone. */
static bool stream_refill(stream_ctx *st) {
    server *srv = st->srv;
    if (st->phase == 0) {
        if (st->q.chat)
            out_event(st, api_chunk_json(&srv->api, &st->q, st->id, st->created, "", NULL, true, st->r, 0, 0, NULL,
                                         NULL, false));
        st->think = st->q.thinking_open ? 1 : 0;
        st->phase = 1;
        return true;
    }
    sreq_delta d;
    bool got = sreq_next(st->r, &st->cur, 100, &d);
    if (!got) {
        sreq_delta_free(&d);
        return !client_gone(st->conn);
    }
    if (st->q.chat && !st->q.logprobs) {
        route_text(st, d.text, d.len, d.finish != SREQ_RUNNING);
    } else if (d.len > 0 || d.lp_to > d.lp_from) {
        char *t = st->tools ? tool_filter_push(st->tools, d.text, d.len, false, NULL) : NULL;
        out_event(st, api_chunk_json(&srv->api, &st->q, st->id, st->created, t ? t : d.text, NULL, false, st->r,
                                     d.lp_from, d.lp_to, NULL, NULL, false));
        free(t);
    }
    if (d.finish != SREQ_RUNNING) {
        sreq_usage u;
        sreq_usage_get(st->r, &u);
        if (d.finish == SREQ_FAILED || d.finish == SREQ_CANCELLED) {
            api_error e;
            api_fail(&e, 500, "server_error", NULL, NULL, "generation failed: %s",
                     u.error[0] ? u.error : api_finish_reason(d.finish));
            out_event(st, api_error_json(&e));
        } else {
            emit_tool_calls(st);
            const char *fin = st->n_calls > 0 && d.finish == SREQ_STOP ? "tool_calls" : api_finish_reason(d.finish);
            out_event(st, api_chunk_json(&srv->api, &st->q, st->id, st->created, NULL, NULL, false, st->r, 0, 0, fin,
                                         NULL, false));
            if (st->q.include_usage)
                out_event(st, api_chunk_json(&srv->api, &st->q, st->id, st->created, NULL, NULL, false, st->r, 0, 0,
                                             NULL, &u, true));
        }
        out_append(st, "data: [DONE]\n\n", 14);
        st->phase = 2;
    }
    sreq_delta_free(&d);
    return true;
}

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    stream_ctx *st = cls;
    while (st->out_off == st->out_len) {
        st->out_off = st->out_len = 0;
        if (st->phase == 2) return MHD_CONTENT_READER_END_OF_STREAM;
        if (!stream_refill(st)) {
            sreq_cancel(st->r);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
    }
    size_t n = st->out_len - st->out_off;
    if (n > max) n = max;
    memcpy(buf, st->out + st->out_off, n);
    st->out_off += n;
    return (ssize_t)n;
}

static void stream_free(void *cls) {
    stream_ctx *st = cls;
    sreq_cancel(st->r); /* no-op when finished */
    sreq_unref(st->r);
    api_req_free(&st->q);
    free(st->out);
    free(st->pend);
    tool_filter_free(st->tools);
    free(st);
}

static enum MHD_Result handle_generate(server *srv, struct MHD_Connection *c, bool chat, conn_state *cs) {
    const char *label = chat ? "/v1/chat/completions" : "/v1/completions";
    api_error e;
    api_req q;
    if (api_parse(&srv->api, chat, cs->body ? cs->body : "", cs->len, tenant_of(c), &q, &e) < 0)
        return send_error(srv, c, label, &e, NULL);
    bool stream = q.stream;
    sreq *r = NULL;
    ember_error err;
    sreq_params p = q.p;
    memset(&q.p, 0, sizeof q.p); /* moved into the scheduler */
    sched_status st = sched_submit(srv->s, &p, &r, &err);
    if (st != SCHED_OK) {
        api_req_free(&q);
        if (st == SCHED_FULL || st == SCHED_DRAINING) {
            api_fail(&e, 503, "server_error", NULL, st == SCHED_FULL ? "server_overloaded" : "server_shutting_down",
                     "%s; retry later", err.msg);
            e.retry_after = 1;
        } else if (st == SCHED_TOO_LONG) {
            api_fail(&e, 400, "invalid_request_error", chat ? "messages" : "prompt", "context_length_exceeded", "%s",
                     err.msg);
        } else {
            api_fail(&e, 400, "invalid_request_error", NULL, NULL, "%s", err.msg);
        }
        return send_error(srv, c, label, &e, NULL);
    }
    char id[48];
    make_id(id, sizeof id, chat ? "chatcmpl-" : "cmpl-");
    long created = (long)time(NULL);
    if (stream) {
        stream_ctx *sc = calloc(1, sizeof *sc);
        if (sc == NULL) {
            sreq_cancel(r);
            sreq_unref(r);
            api_req_free(&q);
            return MHD_NO;
        }
        sc->srv = srv;
        sc->conn = c;
        sc->r = r;
        sc->q = q;
        sc->created = created;
        snprintf(sc->id, sizeof sc->id, "%s", id);
        if (sc->q.tools != TOOL_SYNTAX_NONE && q.chat) {
            sc->tools = tool_filter_create(sc->q.tools, sc->q.tool_schema);
            if (sc->tools == NULL) {
                stream_free(sc);
                return MHD_NO;
            }
        }
        struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_reader, sc,
                                                                      stream_free);
        if (resp == NULL) {
            stream_free(sc);
            return MHD_NO;
        }
        MHD_add_response_header(resp, "Content-Type", "text/event-stream");
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        MHD_add_response_header(resp, "X-Accel-Buffering", "no");
        enum MHD_Result ret = MHD_queue_response(c, 200, resp);
        MHD_destroy_response(resp);
        serve_metrics_request(srv->metrics, label, 200);
        return ret;
    }
    /* Non-streaming: wait here, watching for a hang-up. */
    sreq_cursor cur = {0};
    char *text = NULL;
    size_t len = 0;
    sreq_finish fin = SREQ_RUNNING;
    int n_lp = 0;
    for (;;) {
        sreq_delta d;
        bool got = sreq_next(r, &cur, 100, &d);
        if (d.len) {
            char *nt = realloc(text, len + d.len + 1);
            if (nt) {
                memcpy(nt + len, d.text, d.len);
                len += d.len;
                nt[len] = 0;
                text = nt;
            }
        }
        n_lp = d.lp_to;
        fin = d.finish;
        sreq_delta_free(&d);
        if (fin != SREQ_RUNNING) break;
        if (!got && client_gone(c)) {
            sreq_cancel(r);
            sreq_unref(r);
            free(text);
            api_req_free(&q);
            serve_metrics_request(srv->metrics, label, 499);
            return MHD_NO;
        }
    }
    sreq_usage u;
    sreq_usage_get(r, &u);
    enum MHD_Result ret;
    if (fin == SREQ_FAILED || fin == SREQ_CANCELLED) {
        api_fail(&e, 500, "server_error", NULL, NULL, "generation failed: %s", u.error[0] ? u.error : "cancelled");
        ret = send_error(srv, c, label, &e, NULL);
    } else {
        ret = send_json(srv, c, label, 200,
                        api_response_json(&srv->api, &q, id, created, text ? text : "", r, n_lp, &u, fin));
    }
    free(text);
    sreq_unref(r);
    api_req_free(&q);
    return ret;
}

/* ---- the access handler ---- */

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    (void)version;
    server *srv = cls;
    conn_state *cs = *con_cls;
    api_error e;
    if (cs == NULL) {
        cs = calloc(1, sizeof *cs);
        if (cs == NULL) return MHD_NO;
        *con_cls = cs;
        atomic_fetch_add(&srv->in_flight, 1);
        int ri = find_route(url);
        cs->route = ri;
        if (ri < 0) {
            api_fail(&e, 404, "invalid_request_error", NULL, "not_found", "Invalid URL (%s %.200s)", method, url);
            return send_error(srv, c, "other", &e, NULL);
        }
        if (strcmp(method, routes[ri].method) != 0 && !(strcmp(method, "HEAD") == 0 && strcmp(routes[ri].method, "GET") == 0)) {
            api_fail(&e, 405, "invalid_request_error", NULL, "method_not_allowed",
                     "Method %s is not allowed on %s; use %s.", method, url, routes[ri].method);
            return send_error(srv, c, routes[ri].label, &e, routes[ri].method);
        }
        if (routes[ri].auth && !auth_ok(srv, c)) {
            api_fail(&e, 401, "invalid_request_error", NULL, "invalid_api_key",
                     "Incorrect API key provided. Send it as 'Authorization: Bearer KEY'.");
            return send_error(srv, c, routes[ri].label, &e, NULL);
        }
        const char *clen = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        if (clen && strtoull(clen, NULL, 10) > srv->cfg.max_body_bytes) {
            api_fail(&e, 413, "invalid_request_error", NULL, "request_too_large",
                     "The request body is larger than %zu bytes.", srv->cfg.max_body_bytes);
            return send_error(srv, c, routes[ri].label, &e, NULL);
        }
        return MHD_YES;
    }
    if (*upload_size > 0) {
        if (!cs->too_big) {
            if (cs->len + *upload_size > srv->cfg.max_body_bytes) {
                cs->too_big = true;
                free(cs->body);
                cs->body = NULL;
                cs->len = cs->cap = 0;
            } else {
                if (cs->len + *upload_size + 1 > cs->cap) {
                    size_t cap = cs->cap ? cs->cap : 4096;
                    while (cap < cs->len + *upload_size + 1) cap *= 2;
                    char *p = realloc(cs->body, cap);
                    if (p == NULL) return MHD_NO;
                    cs->body = p;
                    cs->cap = cap;
                }
                memcpy(cs->body + cs->len, upload, *upload_size);
                cs->len += *upload_size;
                cs->body[cs->len] = 0;
            }
        }
        *upload_size = 0;
        return MHD_YES;
    }
    int ri = cs->route;
    if (cs->too_big) {
        api_fail(&e, 413, "invalid_request_error", NULL, "request_too_large",
                 "The request body is larger than %zu bytes.", srv->cfg.max_body_bytes);
        return send_error(srv, c, routes[ri].label, &e, NULL);
    }
    switch (route_kind[ri]) {
    case R_HEALTH: {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "status", srv->shut ? "draining" : "ok");
        cJSON_AddStringToObject(o, "model", srv->model_id);
        return send_cjson(srv, c, "/health", srv->shut ? 503 : 200, o);
    }
    case R_MODELS: return handle_models(srv, c);
    case R_CHAT: return handle_generate(srv, c, true, cs);
    case R_COMPLETIONS: return handle_generate(srv, c, false, cs);
    case R_STATS: return handle_stats(srv, c, false);
    case R_RESET: return handle_stats(srv, c, true);
    case R_METRICS: return handle_metrics(srv, c);
    }
    return MHD_NO;
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    server *srv = cls;
    (void)c;
    (void)toe;
    conn_state *cs = *con_cls;
    if (cs) {
        free(cs->body);
        free(cs);
        atomic_fetch_sub(&srv->in_flight, 1);
    }
    *con_cls = NULL;
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = 0;
    ember_log(EMBER_LOG_DEBUG, "http: %s", line);
}

/* ---- lifetime ---- */

server *server_create(const char *model_path, const serve_config *cfg, ember_error *err) {
    server *srv = calloc(1, sizeof *srv);
    if (srv == NULL) {
        ember_fail(err, "server: out of memory");
        return NULL;
    }
    srv->cfg = *cfg;
    srv->created = (long)time(NULL);
    srv->m = model_load(model_path, err);
    if (srv->m == NULL) goto fail;
    const model_hparams *hp = model_get_hparams(srv->m);
    if (cfg->model_id[0]) snprintf(srv->model_id, sizeof srv->model_id, "%s", cfg->model_id);
    else {
        const char *base = strrchr(model_path, '/');
        base = base ? base + 1 : model_path;
        size_t n = strlen(base);
        if (n > 5 && strcmp(base + n - 5, ".gguf") == 0) n -= 5;
        snprintf(srv->model_id, sizeof srv->model_id, "%.*s", (int)n, base);
    }
    engine_config ec;
    serve_config_engine(cfg, &ec);
    ec.n_ctx = cfg->n_ctx > 0 ? cfg->n_ctx : (hp->n_ctx_train > 0 && hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096);
    srv->e = engine_create(srv->m, &ec, err);
    if (srv->e == NULL) goto fail;
    srv->chat = serve_chat_create(srv->m, err);
    srv->metrics = serve_metrics_create();
    if (srv->chat == NULL || srv->metrics == NULL) goto fail;
    sched_config sc = {cfg->n_threads, cfg->prefill_step, cfg->max_running, cfg->queue_size, cfg->fresh_wait_ms,
                       cfg->fresh_min,   cfg->disk_wait_ms};
    srv->s = sched_create(srv->e, &sc, srv->metrics, err);
    if (srv->s == NULL) goto fail;
    srv->api.tok = model_get_tokenizer(srv->m);
    srv->api.chat = srv->chat;
    srv->api.model_id = srv->model_id;
    srv->api.n_ctx = engine_n_ctx(srv->e);

    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL | MHD_USE_ITC |
                     MHD_USE_ERROR_LOG;
    if (strchr(cfg->host, ':')) {
        struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&ss;
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons((uint16_t)cfg->port);
        if (inet_pton(AF_INET6, cfg->host, &a6->sin6_addr) != 1) {
            ember_fail(err, "server.host: '%s' is not an IPv6 address", cfg->host);
            goto fail;
        }
        flags |= MHD_USE_IPv6;
    } else {
        struct sockaddr_in *a4 = (struct sockaddr_in *)&ss;
        a4->sin_family = AF_INET;
        a4->sin_port = htons((uint16_t)cfg->port);
        const char *h = strcmp(cfg->host, "localhost") == 0 ? "127.0.0.1" : cfg->host;
        if (inet_pton(AF_INET, h, &a4->sin_addr) != 1) {
            ember_fail(err, "server.host: '%s' is not an IPv4 address", cfg->host);
            goto fail;
        }
    }
    srv->d = MHD_start_daemon(flags, (uint16_t)cfg->port, NULL, NULL, on_request, srv, MHD_OPTION_SOCK_ADDR, &ss,
                              MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv, MHD_OPTION_CONNECTION_LIMIT,
                              (unsigned)cfg->connection_limit, MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)120,
                              MHD_OPTION_EXTERNAL_LOGGER, mhd_log, srv, MHD_OPTION_END);
    if (srv->d == NULL) {
        ember_fail(err, "cannot listen on %s:%d (address in use or not available)", cfg->host, cfg->port);
        goto fail;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(srv->d, MHD_DAEMON_INFO_BIND_PORT);
    srv->port = di ? di->port : cfg->port;
    ember_log(EMBER_LOG_INFO, "serving %s as '%s' (context %d, prefill step %d, up to %d running, queue %d)",
              model_path, srv->model_id, srv->api.n_ctx, cfg->prefill_step, cfg->max_running, cfg->queue_size);
    ember_log(EMBER_LOG_INFO, "listening on http://%s:%d", cfg->host, srv->port);
    return srv;
fail:
    server_free(srv);
    return NULL;
}

int server_port(const server *s) { return s->port; }

void server_shutdown(server *srv) {
    if (srv == NULL || srv->shut) return;
    srv->shut = true;
    if (srv->d) {
        MHD_socket fd = MHD_quiesce_daemon(srv->d);
        if (fd != MHD_INVALID_SOCKET) close(fd);
    }
    int running = 0, waiting = 0;
    if (srv->s) {
        sched_counts(srv->s, &running, &waiting);
        ember_log(EMBER_LOG_INFO, "shutting down: draining %d running and %d queued requests", running, waiting);
        sched_drain(srv->s);
    }
    /* Let the last responses (streams ending with [DONE]) leave before the
     * daemon closes every connection; 30 s at most. */
    for (int i = 0; srv->d && i < 3000 && atomic_load(&srv->in_flight) > 0; i++) {
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
    if (srv->d) {
        MHD_stop_daemon(srv->d);
        srv->d = NULL;
    }
    ember_log(EMBER_LOG_INFO, "stopped");
}

void server_free(server *srv) {
    if (srv == NULL) return;
    server_shutdown(srv);
    sched_free(srv->s);
    serve_chat_free(srv->chat);
    serve_metrics_free(srv->metrics);
    engine_free(srv->e);
    model_free(srv->m);
    free(srv);
}
