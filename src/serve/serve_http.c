/* serve_http.c - the HTTP server: libmicrohttpd daemon, routes, auth,
 * bodies, connection limits, responses and SSE streaming (see serve.h).
 *
 * libmicrohttpd runs as an event loop (epoll, a small pool of threads), so
 * an open connection costs a socket and a little memory, never a thread,
 * and no handler may block:
 *  - every header-level decision (route, method, API key, declared body
 *    size, connection limits) is taken on the handler's first call, before
 *    any body is read;
 *  - limits: each open connection is recorded (MHD's connection
 *    notifications); a request that arrives while more than
 *    connection_limit connections are open, or more than
 *    per_ip_connection_limit from its address, is answered 503 with
 *    Retry-After and closed. libmicrohttpd's own limits sit a margin above
 *    ours, so the margin is answered 503 and only a flood beyond it is
 *    closed at accept. A client must deliver each whole request within
 *    read_timeout of connecting or of its previous answer (a slowloris
 *    trickle, or a kept-alive connection left unused, is cut by shutting
 *    its socket down); idle_timeout closes connections silent for longer
 *    (a client that stops reading a response);
 *  - bodies accumulate up to max_body_bytes (a chunked upload that grows
 *    past it is discarded and answered 413 at the end);
 *  - a generation is a `gen` shared by the connection and one pump thread.
 *    The scheduler has no wake-up hook, so the pump polls every live
 *    generation each millisecond (sreq_next without waiting), keeps the new
 *    output in the gen, and resumes the connection that waits for it: a
 *    stream on any new output, a non-streaming request when it finishes.
 *    The connection side takes the output in the access handler or the
 *    content reader and suspends itself (MHD_suspend_connection) when
 *    there is nothing yet, so a waiting request holds no thread;
 *  - streams answer 200 at once with a content reader framing OpenAI SSE:
 *    `data: {chunk}\n\n` ... `data: [DONE]\n\n`;
 *  - a client that half-closes (shutdown(SHUT_WR)) after its request still
 *    gets its answer: a FIN cannot tell a half-close from a close, so only
 *    a failed write counts as gone. To find a closed client early the pump
 *    watches suspended connections for a FIN, and then writes a probe every
 *    second: an SSE comment on streams; on a non-streaming request the
 *    answer turns into a chunked 200 whose body is whitespace until the JSON
 *    (JSON allows leading whitespace; a generation failure after that point
 *    is an error object under the 200). A probe that fails closes the
 *    connection, which cancels the request.
 * Auth happens on the handler's first call too: the bearer key gives the
 * request's principal (admin or not, and its tenant when a keys file is
 * used, serve_tenant.h); routes that span tenants refuse non-admin keys
 * before any body is read.
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
#include <errno.h>
#include <microhttpd.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core/clock.h"
#include "core/log.h"
#include "engine/engine.h"
#include "kv/kv_pool.h"
#include "model/model.h"
#include "serve/serve_api.h"
#include "serve/serve_chat.h"
#include "serve/serve_dashboard.h"
#include "serve/serve_kv_events.h"
#include "serve/serve_stats.h"
#include "serve/serve_metrics.h"
#include "serve/serve_pool_size.h"
#include "serve/serve_recent.h"
#include "serve/serve_sched.h"
#include "serve/serve_tokenize.h"
#include "serve/serve_tenant.h"

/* libmicrohttpd's own limits sit this far above ours, so that requests over
 * our limits can still be answered 503 before a flood is cut at accept. */
#define LIMIT_MARGIN 64
/* Seconds between probes of a client that sent a FIN. */
#define PROBE_INTERVAL 1.0

/* One open TCP connection (libmicrohttpd's socket context), for the limits. */
typedef struct conn_rec {
    struct conn_rec *prev, *next;
    int fd;
    struct sockaddr_storage addr;
    double t_wait;  /* since when it waits for a request: connected, or the last one completed */
    bool read_done; /* a whole request arrived: read_timeout does not apply until it completes */
} conn_rec;

typedef struct gen gen;

struct server {
    serve_config cfg;
    model *m;
    model *draft_m;             /* speculative decoding: the draft model, or NULL */
    engine *e;
    sched *s;
    serve_chat *chat;
    serve_metrics *metrics;
    serve_recent *recent;    /* the dashboard's last finished requests */
    kv_events *kv_events;    /* NULL: server.kv_events.endpoint is empty */
    serve_keys *keys;        /* server.api_keys_file, or NULL */
    serve_tenant_stats *tenant_stats;
    unsigned char secret[SERVE_TENANT_SECRET_BYTES]; /* mixed into every tenant salt */
    struct MHD_Daemon *d;
    api_ctx api;
    char model_id[128];
    char file_name[2][256];  /* the model file's name without and with .gguf */
    const char *model_names[3];
    long created;
    int port;
    atomic_bool shut;        /* set by server_shutdown, read by /health on connection threads */
    atomic_bool loaded;      /* server_load finished: the model routes may run (GET /ready) */
    char *model_path;
    char fingerprint[33];    /* engine_model_fingerprint, hex */
    char cache_ns[33];       /* the cache format's namespace (apc_namespace_hex) */
    atomic_int in_flight;    /* requests between their first handler call and completion */
    /* lock guards the connection records, the generations and the pump */
    pthread_mutex_t lock;
    pthread_cond_t pump_wake;
    pthread_t pump;
    bool lock_ready, pump_started, pump_stop;
    conn_rec *conns;
    int n_conns;
    gen *gens;
    double t_deadlines;      /* last read_timeout sweep */
};

/* A generation shared by its connection and the pump (fields under
 * srv->lock, but cur, which only the pump touches). */
struct gen {
    gen *prev, *next;
    bool listed;
    struct MHD_Connection *conn;
    int fd;
    sreq *r;
    bool stream;
    sreq_cursor cur;
    char *text;              /* output taken from the scheduler, not yet consumed */
    size_t len, cap;
    int lp_from, lp_to;
    bool fresh;
    sreq_finish finish;
    bool suspended;
    bool hup;                /* the client sent a FIN (half-closed, or gone) */
    bool probe_due;
    double t_check, t_out;   /* last FIN check, last output handed to the connection */
};

typedef struct stream_ctx stream_ctx;

/* Who sent a request, decided from its headers on the handler's first call. */
typedef struct principal {
    bool admin;                      /* may read global stats and metrics, and reset */
    char tenant[SERVE_TENANT_MAX];   /* "": none (salt from cache_salt alone) */
} principal;

typedef struct conn_state {
    principal who;
    char *body;
    size_t len, cap;
    bool too_big;
    int route;
    stream_ctx *wait;        /* a non-streaming generation this connection waits for */
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
    if (status == 503) MHD_add_response_header(r, "Connection", "close"); /* frees the slot */
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

/* Whether the peer sent a FIN (or reset): a half-close looks the same. */
static bool peer_hup(int fd) {
    struct pollfd p = {.fd = fd, .events = POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return false;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

static int conn_fd(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
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

/* What the tenant headers of a request hold. */
typedef struct header_scan {
    int n;
    const char *bad;   /* the name of a header with a control character */
    const char *value;
    size_t len;
} header_scan;

static enum MHD_Result scan_tenant_header(void *cls, enum MHD_ValueKind kind, const char *key, size_t key_size,
                                          const char *value, size_t value_size) {
    (void)kind;
    (void)key_size;
    header_scan *h = cls;
    const char *name = strcasecmp(key, "X-APC-Tenant") == 0 ? "X-APC-Tenant"
                       : strcasecmp(key, "X-Tenant-Id") == 0 ? "X-Tenant-Id"
                                                             : NULL;
    if (name == NULL) return MHD_YES;
    h->n++;
    if (value == NULL) value = "", value_size = 0;
    if (!h->bad && value_size > 0 && !serve_tenant_name_ok(value, value_size)) h->bad = name;
    h->value = value;
    h->len = value_size;
    return MHD_YES;
}

/* The request's tenant into out (SERVE_TENANT_MAX bytes). The tenant
 * headers (X-APC-Tenant, X-Tenant-Id) are checked for control characters
 * (an embedded NUL would cut the name short); with
 * server.trusted_tenant_header the one value present becomes the tenant
 * (more than one is refused: a proxy that appends instead of replacing must
 * not let the client's own header through), otherwise they are ignored and
 * the tenant stays the API key's. -1 with e filled on a bad header. */
static int tenant_of(server *srv, struct MHD_Connection *c, const principal *who, char *out, api_error *e) {
    snprintf(out, SERVE_TENANT_MAX, "%s", who->tenant);
    header_scan h = {0};
    MHD_get_connection_values_n(c, MHD_HEADER_KIND, scan_tenant_header, &h);
    if (h.bad)
        return api_fail(e, 400, "invalid_request_error", h.bad, "invalid_value",
                        "Invalid value for header '%s': control characters are not allowed (and at most %d bytes).",
                        h.bad, SERVE_TENANT_MAX - 1);
    if (!srv->cfg.trusted_tenant_header || h.n == 0) return 0;
    if (h.n > 1)
        return api_fail(e, 400, "invalid_request_error", "X-APC-Tenant", "invalid_value",
                        "A request may carry one tenant header (X-APC-Tenant or X-Tenant-Id); this one has %d.", h.n);
    if (h.len > 0) snprintf(out, SERVE_TENANT_MAX, "%.*s", (int)h.len, h.value);
    return 0;
}

/* Whether the request's key is valid; fills who. Without a keys file the
 * one server.api_key (or none) admits everyone as admin, as before. */
static bool authenticate(server *srv, struct MHD_Connection *c, principal *who) {
    memset(who, 0, sizeof *who);
    const char *h = NULL;
    size_t hn = 0;
    if (MHD_lookup_connection_value_n(c, MHD_HEADER_KIND, "Authorization", 13, &h, &hn) != MHD_YES) h = NULL;
    const char *key = NULL;
    size_t kn = 0;
    if (h && hn >= 7 && strncasecmp(h, "Bearer ", 7) == 0) {
        key = h + 7;
        kn = hn - 7;
        while (kn > 0 && *key == ' ') key++, kn--;
    }
    if (srv->keys) {
        const serve_key_entry *k = key ? serve_keys_find(srv->keys, key, kn) : NULL;
        if (k) {
            who->admin = k->admin;
            snprintf(who->tenant, sizeof who->tenant, "%s", k->tenant);
            return true;
        }
    } else if (!srv->cfg.api_key[0]) {
        who->admin = true;
        return true;
    }
    if (!srv->cfg.api_key[0] || key == NULL) return false;
    size_t b = strlen(srv->cfg.api_key);
    unsigned diff = (unsigned)(kn ^ b);
    for (size_t i = 0; i < kn && i < b; i++) diff |= (unsigned char)(key[i] ^ srv->cfg.api_key[i]);
    who->admin = diff == 0;
    return diff == 0;
}

/* ---- routes ---- */

enum {
    R_HEALTH = 0, R_MODELS, R_CHAT, R_COMPLETIONS, R_STATS, R_RESET, R_METRICS, R_DASHBOARD, R_RECENT,
    R_READY, R_TOKENIZE, R_DETOKENIZE, R_COUNT_
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
    /* the dashboard page holds no data (its data routes need the key) */
    {"/", "GET", false, "/dashboard"},
    {"/dashboard", "GET", false, "/dashboard"},
    {"/v1/cache/recent", "GET", true, "/v1/cache/recent"},
    /* for a fleet: readiness probes (unauthenticated, like /health), and vLLM's token routes */
    {"/ready", "GET", false, "/ready"},
    {"/tokenize", "POST", true, "/tokenize"},
    {"/detokenize", "POST", true, "/detokenize"},
};
static const int route_kind[] = {R_HEALTH, R_MODELS, R_CHAT,  R_COMPLETIONS, R_STATS,     R_RESET,    R_METRICS,
                                 R_STATS,  R_RESET,  R_METRICS, R_HEALTH,    R_DASHBOARD, R_DASHBOARD, R_RECENT,
                                 R_READY,  R_TOKENIZE, R_DETOKENIZE};
_Static_assert(sizeof route_kind / sizeof route_kind[0] == sizeof routes / sizeof routes[0], "one kind per route");
#define N_ROUTES (int)(sizeof routes / sizeof routes[0])

/* With a keys file, what spans tenants needs an admin key: the global
 * metrics, the recent requests of everyone, and clearing the cache. */
static bool admin_only(int kind) { return kind == R_RESET || kind == R_METRICS || kind == R_RECENT; }

static int find_route(const char *url) {
    for (int i = 0; i < N_ROUTES; i++)
        if (strcmp(url, routes[i].path) == 0) return i;
    return -1;
}

/* What a fleet needs to know which replicas can share KV: the model file's
 * fingerprint and the cache format (tier, block size, KV dtype, block-key
 * hash, and the namespace they hash to, which is the SSD tier's directory). */
static void add_model_identity(server *srv, cJSON *m) {
    apc *cache = engine_cache(srv->e);
    apc_stats st;
    apc_get_stats(cache, &st);
    cJSON_AddStringToObject(m, "fingerprint", srv->fingerprint);
    cJSON *f = cJSON_AddObjectToObject(m, "cache_format");
    cJSON_AddStringToObject(f, "namespace", srv->cache_ns);
    cJSON_AddStringToObject(f, "tier", apc_tier_name(st.tier));
    cJSON_AddNumberToObject(f, "block_size", KV_BLOCK_TOKENS);
    cJSON_AddStringToObject(f, "kv_dtype", "f32");
    cJSON_AddStringToObject(f, "hash", st.hash == APC_HASH_XXH3 ? "xxh3" : "sha256");
}

/* What /health and /ready say the server is doing. */
static const char *server_phase(server *srv) {
    return atomic_load(&srv->shut) ? "draining" : atomic_load(&srv->loaded) ? "ok" : "loading";
}

/* Routes that need the model, refused with 503 until server_load is done. */
static bool needs_model(int kind) { return kind != R_HEALTH && kind != R_READY && kind != R_DASHBOARD; }

/* GET /ready: 200 once the model is loaded, 503 while loading or draining. */
static enum MHD_Result handle_ready(server *srv, struct MHD_Connection *c) {
    const char *phase = server_phase(srv);
    bool ready = strcmp(phase, "ok") == 0;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "status", ready ? "ready" : phase);
    cJSON_AddStringToObject(o, "model", srv->model_id);
    return send_cjson(srv, c, "/ready", ready ? 200 : 503, o);
}

/* POST /tokenize and /detokenize (serve_tokenize.h). */
static enum MHD_Result handle_tokens(server *srv, struct MHD_Connection *c, bool detok, conn_state *cs) {
    const char *label = detok ? "/detokenize" : "/tokenize";
    api_error e;
    const char *body = cs->body ? cs->body : "";
    cJSON *o = detok ? api_detokenize(&srv->api, body, cs->len, &e) : api_tokenize(&srv->api, body, cs->len, &e);
    if (o == NULL) return send_error(srv, c, label, &e, NULL);
    return send_cjson(srv, c, label, 200, o);
}

static enum MHD_Result handle_models(server *srv, struct MHD_Connection *c) {
    cJSON *o = cJSON_CreateObject(), *data = cJSON_AddArrayToObject(o, "data"), *m = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "object", "list");
    cJSON_AddStringToObject(m, "id", srv->model_id);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", (double)srv->created);
    cJSON_AddStringToObject(m, "owned_by", "ember");
    cJSON_AddNumberToObject(m, "context_length", srv->api.n_ctx);
    cJSON_AddNumberToObject(m, "max_model_len", srv->api.n_ctx); /* vLLM's name */
    add_model_identity(srv, m);
    cJSON_AddItemToArray(data, m);
    return send_cjson(srv, c, "/v1/models", 200, o);
}

static enum MHD_Result handle_stats(server *srv, struct MHD_Connection *c, bool reset, const principal *who) {
    const char *label = reset ? "/v1/cache/reset" : "/v1/cache/stats";
    const char *model_arg = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "model");
    if (model_arg && model_arg[0] && !api_model_known(&srv->api, model_arg)) {
        api_error e;
        api_fail(&e, 404, "invalid_request_error", "model", "model_not_found",
                 "The model '%.100s' does not exist; this server serves '%s'.", model_arg, srv->model_id);
        return send_error(srv, c, label, &e, NULL);
    }
    apc *cache = engine_cache(srv->e);
    bool on = apc_get_tier(cache) != APC_TIER_NONE;
    if (!reset && !who->admin) { /* a tenant sees its own counters, nothing shared */
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "tenant", who->tenant);
        cJSON_AddItemToObject(o, "usage", serve_tenant_stats_one(srv->tenant_stats, who->tenant));
        return send_cjson(srv, c, label, 200, o);
    }
    if (!reset) {
        cJSON *o = serve_cache_stats_json(cache);
        if (o) cJSON_AddItemToObject(o, "tenants", serve_tenant_stats_all(srv->tenant_stats));
        if (o && engine_attention_fallback(srv->e)) /* bf16 asked for, f32 run: why */
            cJSON_AddStringToObject(o, "attention_precision_fallback", engine_attention_fallback(srv->e));
        if (o && on) { /* the scheduler's freshness gate (reference §14.1) */
            char why[160];
            cJSON_AddNumberToObject(o, "fresh_holds", (double)sched_fresh_holds(srv->s, why, sizeof why));
            cJSON_AddStringToObject(o, "fresh_last_hold_reason", why);
            if (apc_has_disk(cache))
                cJSON_AddNumberToObject(o, "disk_read_deadline_misses", (double)sched_disk_deadline_misses(srv->s));
        }
        if (o && engine_prefix(srv->e)) { /* L0 works with the cache off too */
            prefix_stats ps = prefix_get_stats(engine_prefix(srv->e));
            serve_stats_add_prefix(o, &ps);
        }
        if (o) { /* speculative decoding */
            const spec_drafter *d = engine_drafter(srv->e);
            int64_t rounds, drafted, accepted;
            serve_metrics_spec_totals(srv->metrics, &rounds, &drafted, &accepted);
            cJSON *sp = cJSON_AddObjectToObject(o, "spec");
            cJSON_AddStringToObject(sp, "mode", spec_kind_name(d ? spec_drafter_config(d)->kind : SPEC_OFF));
            cJSON_AddNumberToObject(sp, "k", d ? spec_drafter_config(d)->k : 0);
            cJSON_AddNumberToObject(sp, "steps", (double)rounds);
            cJSON_AddNumberToObject(sp, "drafted", (double)drafted);
            cJSON_AddNumberToObject(sp, "accepted", (double)accepted);
            cJSON_AddNumberToObject(sp, "acceptance", drafted ? (double)accepted / (double)drafted : 0.0);
            if (d && (spec_drafter_config(d)->kind == SPEC_MTP || spec_drafter_config(d)->kind == SPEC_DRAFT)) {
                spec_sidecar_stats side = spec_sidecar_get_stats(engine_drafter(srv->e));
                cJSON_ReplaceItemInObject(o, "sidecar_writes", cJSON_CreateNumber((double)side.writes));
                cJSON_AddNumberToObject(sp, "sidecar_hits", (double)side.hits);
                cJSON_AddNumberToObject(sp, "sidecar_entries", (double)side.entries);
                cJSON_AddNumberToObject(sp, "sidecar_bytes", (double)side.bytes);
                cJSON_AddNumberToObject(sp, "sidecar_restored_rows", (double)side.restored_rows);
                cJSON_AddNumberToObject(sp, "sidecar_disk_writes", (double)side.disk_writes);
                cJSON_AddNumberToObject(sp, "sidecar_disk_loads", (double)side.disk_loads);
            }
        }
        return send_cjson(srv, c, label, 200, o);
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddBoolToObject(o, "enabled", on);
    prefix_clear(engine_prefix(srv->e)); /* every L0 entry goes with the pools (reference §11.2) */
    if (on) {
        apc_reset(cache);
        cJSON_AddStringToObject(o, "status", "cleared");
        ember_log(EMBER_LOG_INFO, "APC reset: memory tiers cleared");
    }
    return send_cjson(srv, c, label, 200, o);
}

static enum MHD_Result handle_metrics(server *srv, struct MHD_Connection *c) {
    int running = 0, waiting = 0;
    if (engine_prefix(srv->e)) {
        prefix_stats ps = prefix_get_stats(engine_prefix(srv->e));
        serve_metrics_set_prefix(srv->metrics, &ps);
    }
    if (engine_drafter(srv->e)) {
        spec_sidecar_stats side = spec_sidecar_get_stats(engine_drafter(srv->e));
        serve_metrics_set_sidecar(srv->metrics, side.writes, side.hits, side.disk_writes, side.disk_loads);
    }
    sched_counts(srv->s, &running, &waiting);
    size_t len;
    char *text = serve_metrics_render(srv->metrics, engine_cache(srv->e), running, waiting, &len);
    if (text && srv->kv_events) {
        kv_events_stats st;
        kv_events_get_stats(srv->kv_events, &st);
        text = serve_metrics_append_kv_events(text, &len, &st);
    }
    return send_buf(srv, c, "/metrics", text ? 200 : 500, text, "text/plain; version=0.0.4; charset=utf-8", 0, NULL);
}

static enum MHD_Result handle_recent(server *srv, struct MHD_Connection *c) {
    const char *lim = MHD_lookup_connection_value(c, MHD_GET_ARGUMENT_KIND, "limit");
    int limit = lim ? atoi(lim) : 0;
    return send_cjson(srv, c, "/v1/cache/recent", 200,
                      serve_recent_json(srv->recent, engine_cache(srv->e), srv->model_id, limit));
}

static enum MHD_Result handle_dashboard(server *srv, struct MHD_Connection *c) {
    struct MHD_Response *r = MHD_create_response_from_buffer(serve_dashboard_html_len, (void *)serve_dashboard_html,
                                                             MHD_RESPMEM_PERSISTENT);
    if (r == NULL) return MHD_NO;
    MHD_add_response_header(r, "Content-Type", "text/html; charset=utf-8");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    /* everything the page needs is inline; it only talks to this server */
    MHD_add_response_header(r, "Content-Security-Policy",
                            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                            "connect-src 'self'; img-src data:");
    enum MHD_Result ret = MHD_queue_response(c, 200, r);
    MHD_destroy_response(r);
    serve_metrics_request(srv->metrics, "/dashboard", 200);
    return ret;
}

/* One finished generation into the dashboard's ring. */
static void note_recent(server *srv, const char *tenant, const char *id, bool chat, bool stream, int status,
                        sreq_finish fin, const sreq_usage *u) {
    serve_tenant_stats_add(srv->tenant_stats, tenant, u->prompt_tokens, u->cached_tokens, u->completion_tokens,
                           status != 200);
    serve_recent_entry e;
    memset(&e, 0, sizeof e);
    snprintf(e.id, sizeof e.id, "%s", id);
    e.endpoint = chat ? "chat" : "completions";
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    e.time = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
    e.status = status;
    e.finish = api_finish_reason(fin);
    e.stream = stream;
    e.prompt_tokens = u->prompt_tokens;
    e.cached_tokens = u->cached_tokens;
    e.completion_tokens = u->completion_tokens;
    e.ttft_s = u->ttft_s;
    e.total_s = u->total_s;
    serve_recent_add(srv->recent, &e);
}

/* ---- generation ---- */

struct stream_ctx {
    server *srv;
    char tenant[SERVE_TENANT_MAX];
    gen g;
    sreq *r;
    api_req q;
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
    /* non-streaming: the whole reply */
    char *acc;
    size_t acc_len;
    int n_lp;
    sreq_finish fin;
};

/* ---- generations and the pump ---- */

static void gen_list(server *srv, gen *g) {
    pthread_mutex_lock(&srv->lock);
    g->next = srv->gens;
    g->prev = NULL;
    if (srv->gens) srv->gens->prev = g;
    srv->gens = g;
    g->listed = true;
    g->t_out = g->t_check = ember_now();
    pthread_cond_signal(&srv->pump_wake);
    pthread_mutex_unlock(&srv->lock);
}

static void gen_unlist(server *srv, gen *g) {
    pthread_mutex_lock(&srv->lock);
    if (g->listed) {
        if (g->prev) g->prev->next = g->next;
        else srv->gens = g->next;
        if (g->next) g->next->prev = g->prev;
        g->listed = false;
    }
    pthread_mutex_unlock(&srv->lock);
    free(g->text);
    g->text = NULL;
}

typedef enum { TAKE_OUTPUT, TAKE_PROBE, TAKE_SUSPENDED, TAKE_STOPPED } take_result;

/* Called from the connection's handler or content reader: moves the
 * pending output into d, or asks for a probe write, or suspends the
 * connection until the pump has something (never after shutdown began,
 * since libmicrohttpd cannot stop with suspended connections). */
static take_result gen_take(server *srv, gen *g, sreq_delta *d) {
    memset(d, 0, sizeof *d);
    take_result t;
    pthread_mutex_lock(&srv->lock);
    if (g->fresh) {
        d->text = g->text;
        d->len = g->len;
        g->text = NULL;
        g->len = g->cap = 0;
        d->lp_from = g->lp_from;
        d->lp_to = g->lp_to;
        g->lp_from = g->lp_to;
        d->finish = g->finish;
        g->fresh = false;
        g->t_out = ember_now();
        t = TAKE_OUTPUT;
    } else if (g->probe_due) {
        g->probe_due = false;
        g->t_out = ember_now();
        t = TAKE_PROBE;
    } else if (srv->pump_stop) {
        t = TAKE_STOPPED;
    } else {
        g->suspended = true;
        MHD_suspend_connection(g->conn);
        t = TAKE_SUSPENDED;
    }
    pthread_mutex_unlock(&srv->lock);
    if (t == TAKE_OUTPUT && d->text == NULL) d->text = calloc(1, 1);
    return t;
}

/* One generation's turn in the pump (srv->lock held). */
static void pump_gen(gen *g, double now) {
    if (g->finish == SREQ_RUNNING) {
        sreq_delta d;
        if (sreq_next(g->r, &g->cur, 0, &d)) {
            if (d.len > 0) {
                if (g->len + d.len + 1 > g->cap) {
                    size_t cap = g->cap ? g->cap : 256;
                    while (cap < g->len + d.len + 1) cap *= 2;
                    char *p = realloc(g->text, cap);
                    if (p) {
                        g->text = p;
                        g->cap = cap;
                    }
                }
                if (g->len + d.len + 1 <= g->cap) {
                    memcpy(g->text + g->len, d.text, d.len);
                    g->len += d.len;
                    g->text[g->len] = 0;
                }
            }
            g->lp_to = d.lp_to;
            g->finish = d.finish;
            g->fresh = true;
        }
        sreq_delta_free(&d);
    }
    if (!g->suspended) return;
    if (!g->hup && now - g->t_check >= 0.1) {
        g->t_check = now;
        g->hup = peer_hup(g->fd);
    }
    bool wake = g->stream ? g->fresh : g->finish != SREQ_RUNNING;
    if (!wake && g->hup && now - g->t_out >= PROBE_INTERVAL) wake = g->probe_due = true;
    if (wake) {
        g->suspended = false;
        MHD_resume_connection(g->conn);
    }
}

/* Cuts connections that have not delivered a whole request within
 * read_timeout of connecting (srv->lock held). shutdown() makes
 * libmicrohttpd see the end of the stream and close; the record, and so
 * the descriptor, stays valid until its close notification, which takes
 * the same lock. */
static void enforce_read_timeout(server *srv, double now) {
    for (conn_rec *r = srv->conns; r; r = r->next) {
        if (r->read_done || now - r->t_wait < srv->cfg.read_timeout) continue;
        r->read_done = true;
        shutdown(r->fd, SHUT_RDWR);
        ember_log(EMBER_LOG_DEBUG, "http: closed a connection that sent no whole request in %d s",
                  srv->cfg.read_timeout);
    }
}

static void *pump_main(void *arg) {
    server *srv = arg;
    pthread_mutex_lock(&srv->lock);
    while (!srv->pump_stop) {
        double now = ember_now();
        for (gen *g = srv->gens; g; g = g->next) pump_gen(g, now);
        if (now - srv->t_deadlines >= 0.1) {
            srv->t_deadlines = now;
            enforce_read_timeout(srv, now);
        }
        if (srv->gens) {
            pthread_mutex_unlock(&srv->lock);
            struct timespec ts = {0, 1000000L};
            nanosleep(&ts, NULL);
            pthread_mutex_lock(&srv->lock);
        } else {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 100 * 1000000L;
            if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&srv->pump_wake, &srv->lock, &ts);
        }
    }
    /* Shutdown: no connection may stay suspended. */
    for (gen *g = srv->gens; g; g = g->next)
        if (g->suspended) {
            g->suspended = false;
            MHD_resume_connection(g->conn);
        }
    pthread_mutex_unlock(&srv->lock);
    return NULL;
}

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

/* Turns one delta of a stream into SSE events. */
static void stream_events(stream_ctx *st, const sreq_delta *d) {
    server *srv = st->srv;
    if (st->q.chat && !st->q.logprobs) {
        route_text(st, d->text, d->len, d->finish != SREQ_RUNNING);
    } else if (d->len > 0 || d->lp_to > d->lp_from) {
        char *t = st->tools ? tool_filter_push(st->tools, d->text, d->len, false, NULL) : NULL;
        out_event(st, api_chunk_json(&srv->api, &st->q, st->id, st->created, t ? t : d->text, NULL, false, st->r,
                                     d->lp_from, d->lp_to, NULL, NULL, false));
        free(t);
    }
    if (d->finish != SREQ_RUNNING) {
        sreq_usage u;
        sreq_usage_get(st->r, &u);
        bool failed = d->finish == SREQ_FAILED || d->finish == SREQ_CANCELLED;
        note_recent(srv, st->tenant, st->id, st->q.chat, true, failed ? 500 : 200, d->finish, &u);
        if (d->finish == SREQ_FAILED || d->finish == SREQ_CANCELLED) {
            api_error e;
            api_fail(&e, 500, "server_error", NULL, NULL, "generation failed: %s",
                     u.error[0] ? u.error : api_finish_reason(d->finish));
            out_event(st, api_error_json(&e));
        } else {
            emit_tool_calls(st);
            const char *fin = st->n_calls > 0 && d->finish == SREQ_STOP ? "tool_calls" : api_finish_reason(d->finish);
            out_event(st, api_chunk_json(&srv->api, &st->q, st->id, st->created, NULL, NULL, false, st->r, 0, 0, fin,
                                         NULL, false));
            if (st->q.include_usage)
                out_event(st, api_chunk_json(&srv->api, &st->q, st->id, st->created, NULL, NULL, false, st->r, 0, 0,
                                             NULL, &u, true));
        }
        out_append(st, "data: [DONE]\n\n", 14);
        st->phase = 2;
    }
}

/* Appends a delta to a non-streaming reply; true when it finished. */
static bool whole_add(stream_ctx *st, const sreq_delta *d) {
    if (d->len) {
        char *nt = realloc(st->acc, st->acc_len + d->len + 1);
        if (nt) {
            memcpy(nt + st->acc_len, d->text, d->len);
            st->acc_len += d->len;
            nt[st->acc_len] = 0;
            st->acc = nt;
        }
    }
    st->n_lp = d->lp_to;
    st->fin = d->finish;
    return st->fin != SREQ_RUNNING;
}

/* The body of a finished non-streaming request: the response object, or an
 * error object with its status. */
static char *whole_body(stream_ctx *st, int *status) {
    sreq_usage u;
    sreq_usage_get(st->r, &u);
    bool failed = st->fin == SREQ_FAILED || st->fin == SREQ_CANCELLED;
    note_recent(st->srv, st->tenant, st->id, st->q.chat, false, failed ? 500 : 200, st->fin, &u);
    if (st->fin == SREQ_FAILED || st->fin == SREQ_CANCELLED) {
        api_error e;
        api_fail(&e, 500, "server_error", NULL, NULL, "generation failed: %s", u.error[0] ? u.error : "cancelled");
        *status = e.status;
        return api_error_json(&e);
    }
    *status = 200;
    return api_response_json(&st->srv->api, &st->q, st->id, st->created, st->acc ? st->acc : "", st->r, st->n_lp, &u,
                             st->fin);
}

/* Fills the output buffer; returns 0 when it holds something, else what the
 * content reader returns: 0 (suspended), end of stream, or error. */
static ssize_t stream_fill(stream_ctx *st) {
    server *srv = st->srv;
    while (st->out_off == st->out_len) {
        st->out_off = st->out_len = 0;
        if (st->phase == 2) return MHD_CONTENT_READER_END_OF_STREAM;
        if (st->phase == 0) {
            if (st->q.chat && st->q.stream)
                out_event(st, api_chunk_json(&srv->api, &st->q, st->id, st->created, "", NULL, true, st->r, 0, 0,
                                             NULL, NULL, false));
            st->think = st->q.thinking_open ? 1 : 0;
            st->phase = 1;
            continue;
        }
        sreq_delta d;
        take_result t = gen_take(srv, &st->g, &d);
        if (t == TAKE_SUSPENDED) return 0;
        if (t == TAKE_STOPPED) return MHD_CONTENT_READER_END_WITH_ERROR;
        if (t == TAKE_PROBE) {
            /* SSE comment / JSON leading whitespace: a write that finds a gone client */
            if (st->q.stream) out_append(st, ": keep-alive\n\n", 14);
            else out_append(st, " ", 1);
            continue;
        }
        if (!st->q.stream) {
            if (whole_add(st, &d)) {
                int status;
                char *body = whole_body(st, &status);
                if (body) out_append(st, body, strlen(body));
                free(body);
                st->phase = 2;
            }
        } else {
            stream_events(st, &d);
        }
        sreq_delta_free(&d);
    }
    return 1;
}

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    stream_ctx *st = cls;
    ssize_t r = stream_fill(st);
    if (r <= 0) return r;
    size_t n = st->out_len - st->out_off;
    if (n > max) n = max;
    memcpy(buf, st->out + st->out_off, n);
    st->out_off += n;
    return (ssize_t)n;
}

static void stream_free(void *cls) {
    stream_ctx *st = cls;
    gen_unlist(st->srv, &st->g);
    sreq_cancel(st->r); /* no-op when finished */
    sreq_unref(st->r);
    api_req_free(&st->q);
    free(st->out);
    free(st->pend);
    free(st->acc);
    tool_filter_free(st->tools);
    free(st);
}

static enum MHD_Result queue_reader(server *srv, struct MHD_Connection *c, const char *label, stream_ctx *sc) {
    struct MHD_Response *resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_reader, sc,
                                                                  stream_free);
    if (resp == NULL) {
        stream_free(sc);
        return MHD_NO;
    }
    if (sc->q.stream) {
        MHD_add_response_header(resp, "Content-Type", "text/event-stream");
        MHD_add_response_header(resp, "Cache-Control", "no-cache");
        MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    } else {
        MHD_add_response_header(resp, "Content-Type", "application/json");
    }
    enum MHD_Result ret = MHD_queue_response(c, 200, resp);
    MHD_destroy_response(resp);
    serve_metrics_request(srv->metrics, label, 200);
    return ret;
}

/* A resumed non-streaming request: answer when finished, switch to a
 * probing chunked answer when the client sent a FIN, else wait again. */
static enum MHD_Result generate_resumed(server *srv, struct MHD_Connection *c, const char *label, conn_state *cs) {
    stream_ctx *st = cs->wait;
    for (;;) {
        sreq_delta d;
        take_result t = gen_take(srv, &st->g, &d);
        if (t == TAKE_SUSPENDED) return MHD_YES;
        if (t == TAKE_STOPPED) {
            cs->wait = NULL;
            stream_free(st);
            return MHD_NO;
        }
        if (t == TAKE_PROBE) {
            cs->wait = NULL;
            out_append(st, " ", 1);
            return queue_reader(srv, c, label, st);
        }
        bool done = whole_add(st, &d);
        sreq_delta_free(&d);
        if (done) break;
    }
    cs->wait = NULL;
    int status;
    char *body = whole_body(st, &status);
    stream_free(st);
    return send_json(srv, c, label, status, body);
}

static enum MHD_Result handle_generate(server *srv, struct MHD_Connection *c, bool chat, conn_state *cs) {
    const char *label = chat ? "/v1/chat/completions" : "/v1/completions";
    if (cs->wait) return generate_resumed(srv, c, label, cs);
    api_error e;
    api_req q;
    char tenant[SERVE_TENANT_MAX];
    if (tenant_of(srv, c, &cs->who, tenant, &e) < 0 ||
        api_parse(&srv->api, chat, cs->body ? cs->body : "", cs->len, tenant, &q, &e) < 0)
        return send_error(srv, c, label, &e, NULL);
    sreq *r = NULL;
    ember_error err;
    /* A drain admits nothing new (the scheduler itself refuses only once
     * the running requests are done); q keeps its parameters then. */
    sched_status st = SCHED_DRAINING;
    if (atomic_load(&srv->shut)) {
        ember_fail(&err, "the server is shutting down");
    } else {
        sreq_params p = q.p;
        memset(&q.p, 0, sizeof q.p); /* moved into the scheduler */
        st = sched_submit(srv->s, &p, &r, &err);
    }
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
    stream_ctx *sc = calloc(1, sizeof *sc);
    if (sc == NULL) {
        sreq_cancel(r);
        sreq_unref(r);
        api_req_free(&q);
        return MHD_NO;
    }
    sc->srv = srv;
    snprintf(sc->tenant, sizeof sc->tenant, "%s", tenant);
    sc->r = r;
    sc->q = q;
    sc->created = (long)time(NULL);
    make_id(sc->id, sizeof sc->id, chat ? "chatcmpl-" : "cmpl-");
    sc->g.conn = c;
    sc->g.fd = conn_fd(c);
    sc->g.r = r;
    sc->g.stream = q.stream;
    if (q.stream && sc->q.tools != TOOL_SYNTAX_NONE && q.chat) {
        sc->tools = tool_filter_create(sc->q.tools, sc->q.tool_schema);
        if (sc->tools == NULL) {
            stream_free(sc);
            return MHD_NO;
        }
    }
    gen_list(srv, &sc->g);
    if (q.stream) return queue_reader(srv, c, label, sc);
    /* Non-streaming: the connection waits suspended; the pump resumes it. */
    cs->wait = sc;
    return generate_resumed(srv, c, label, cs);
}

/* ---- the access handler ---- */

static bool same_address(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
    if (a->ss_family != b->ss_family) return false;
    if (a->ss_family == AF_INET)
        return ((const struct sockaddr_in *)a)->sin_addr.s_addr == ((const struct sockaddr_in *)b)->sin_addr.s_addr;
    if (a->ss_family == AF_INET6)
        return memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr, &((const struct sockaddr_in6 *)b)->sin6_addr,
                      sizeof(struct in6_addr)) == 0;
    return false;
}

static conn_rec *rec_of(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

/* done: a whole request arrived; else one completed and the connection
 * (kept alive) waits for the next, which read_timeout bounds again. */
static void mark_read(server *srv, struct MHD_Connection *c, bool done) {
    conn_rec *rec = rec_of(c);
    if (rec == NULL) return;
    pthread_mutex_lock(&srv->lock);
    rec->read_done = done;
    if (!done) rec->t_wait = ember_now();
    pthread_mutex_unlock(&srv->lock);
}

/* Over connection_limit open connections, or per_ip_connection_limit from
 * this connection's address: fills e (503, Retry-After). */
static bool over_limits(server *srv, struct MHD_Connection *c, api_error *e) {
    conn_rec *rec = rec_of(c);
    if (rec == NULL) return false;
    int open, same = 0;
    pthread_mutex_lock(&srv->lock);
    open = srv->n_conns;
    if (srv->cfg.per_ip_connection_limit > 0)
        for (conn_rec *r = srv->conns; r; r = r->next) same += same_address(&r->addr, &rec->addr);
    pthread_mutex_unlock(&srv->lock);
    if (open > srv->cfg.connection_limit) {
        api_fail(e, 503, "server_error", NULL, "too_many_connections",
                 "The server has %d open connections (limit %d); retry later.", open, srv->cfg.connection_limit);
    } else if (srv->cfg.per_ip_connection_limit > 0 && same > srv->cfg.per_ip_connection_limit) {
        api_fail(e, 503, "server_error", NULL, "too_many_connections",
                 "Your address has %d open connections (limit %d); close some and retry later.", same,
                 srv->cfg.per_ip_connection_limit);
    } else {
        return false;
    }
    e->retry_after = 1;
    return true;
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
    server *srv = cls;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        conn_rec *rec = calloc(1, sizeof *rec);
        *socket_context = rec;
        if (rec == NULL) return;
        rec->fd = conn_fd(c);
        rec->t_wait = ember_now();
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
        if (ci && ci->client_addr) {
            size_t n = ci->client_addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6)
                                                              : sizeof(struct sockaddr_in);
            memcpy(&rec->addr, ci->client_addr, n);
        }
        pthread_mutex_lock(&srv->lock);
        rec->next = srv->conns;
        if (srv->conns) srv->conns->prev = rec;
        srv->conns = rec;
        srv->n_conns++;
        pthread_mutex_unlock(&srv->lock);
        return;
    }
    conn_rec *rec = *socket_context;
    if (rec == NULL) return;
    pthread_mutex_lock(&srv->lock);
    if (rec->prev) rec->prev->next = rec->next;
    else srv->conns = rec->next;
    if (rec->next) rec->next->prev = rec->prev;
    srv->n_conns--;
    pthread_mutex_unlock(&srv->lock);
    free(rec);
    *socket_context = NULL;
}

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
        const char *label = ri < 0 ? "other" : routes[ri].label;
        const char *allow = NULL;
        if (over_limits(srv, c, &e)) {
            /* answered first: a refused client costs nothing more */
        } else if (ri < 0) {
            api_fail(&e, 404, "invalid_request_error", NULL, "not_found", "Invalid URL (%s %.200s)", method, url);
        } else if (strcmp(method, routes[ri].method) != 0 &&
                   !(strcmp(method, "HEAD") == 0 && strcmp(routes[ri].method, "GET") == 0)) {
            api_fail(&e, 405, "invalid_request_error", NULL, "method_not_allowed",
                     "Method %s is not allowed on %s; use %s.", method, url, routes[ri].method);
            allow = routes[ri].method;
        } else if (routes[ri].auth && !authenticate(srv, c, &cs->who)) {
            api_fail(&e, 401, "invalid_request_error", NULL, "invalid_api_key",
                     "Incorrect API key provided. Send it as 'Authorization: Bearer KEY'.");
        } else if (routes[ri].auth && !cs->who.admin && admin_only(route_kind[ri])) {
            api_fail(&e, 403, "invalid_request_error", NULL, "admin_key_required",
                     "%s %s needs an admin key (the keys file marks them 'admin').", method, url);
        } else if (needs_model(route_kind[ri]) && !atomic_load(&srv->loaded)) {
            api_fail(&e, 503, "server_error", NULL, "model_loading", "The model is still loading; retry later.");
            e.retry_after = 1;
        } else {
            const char *clen = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
            if (clen == NULL || strtoull(clen, NULL, 10) <= srv->cfg.max_body_bytes) return MHD_YES;
            api_fail(&e, 413, "invalid_request_error", NULL, "request_too_large",
                     "The request body is larger than %zu bytes.", srv->cfg.max_body_bytes);
        }
        mark_read(srv, c, true);
        return send_error(srv, c, label, &e, allow);
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
    if (cs->wait == NULL) mark_read(srv, c, true);
    if (cs->too_big) {
        api_fail(&e, 413, "invalid_request_error", NULL, "request_too_large",
                 "The request body is larger than %zu bytes.", srv->cfg.max_body_bytes);
        return send_error(srv, c, routes[ri].label, &e, NULL);
    }
    switch (route_kind[ri]) {
    case R_HEALTH: {
        cJSON *o = cJSON_CreateObject();
        bool shut = atomic_load(&srv->shut);
        cJSON_AddStringToObject(o, "status", server_phase(srv));
        cJSON_AddStringToObject(o, "model", srv->model_id);
        return send_cjson(srv, c, "/health", shut ? 503 : 200, o);
    }
    case R_MODELS: return handle_models(srv, c);
    case R_CHAT: return handle_generate(srv, c, true, cs);
    case R_COMPLETIONS: return handle_generate(srv, c, false, cs);
    case R_STATS: return handle_stats(srv, c, false, &cs->who);
    case R_RESET: return handle_stats(srv, c, true, &cs->who);
    case R_METRICS: return handle_metrics(srv, c);
    case R_DASHBOARD: return handle_dashboard(srv, c);
    case R_RECENT: return handle_recent(srv, c);
    case R_READY: return handle_ready(srv, c);
    case R_TOKENIZE: return handle_tokens(srv, c, false, cs);
    case R_DETOKENIZE: return handle_tokens(srv, c, true, cs);
    }
    return MHD_NO;
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    server *srv = cls;
    (void)toe;
    mark_read(srv, c, false);
    conn_state *cs = *con_cls;
    if (cs) {
        if (cs->wait) { /* a waiting non-streaming request whose client is gone */
            serve_metrics_request(srv->metrics, routes[cs->route].label, 499);
            stream_free(cs->wait);
        }
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

/* The tenant secret: server.tenant_secret_file, else `tenant-secret` beside
 * the disk tier's root (which `disk: true` puts in the per-user cache
 * directory), else in that directory. A keys file makes it mandatory;
 * without one a secret that cannot be kept is a warning and a secret for
 * this run only (tenants' disk entries then miss after a restart). */
static int load_secret(server *srv, const serve_config *cfg, ember_error *err) {
    char path[4096];
    if (cfg->tenant_secret_file[0]) {
        snprintf(path, sizeof path, "%s", cfg->tenant_secret_file);
    } else if (cfg->disk_path[0]) {
        char dir[600];
        snprintf(dir, sizeof dir, "%s", cfg->disk_path);
        size_t n = strlen(dir);
        while (n > 1 && dir[n - 1] == '/') dir[--n] = 0;
        char *slash = strrchr(dir, '/');
        if (slash == NULL) snprintf(dir, sizeof dir, ".");
        else if (slash == dir) dir[1] = 0;
        else *slash = 0;
        snprintf(path, sizeof path, "%s/tenant-secret", dir);
    } else {
        char dir[3900];
        if (serve_user_cache_dir(dir, sizeof dir) < 0)
            return ember_fail(err, "the per-user cache directory's path is too long");
        snprintf(path, sizeof path, "%s/tenant-secret", dir);
    }
    bool created = false;
    ember_error why;
    if (serve_tenant_secret_load(path, srv->secret, &created, &why) == 0) {
        if (created) ember_log(EMBER_LOG_INFO, "tenant secret: created %s", path);
        return 0;
    }
    if (srv->keys || cfg->tenant_secret_file[0]) return ember_fail(err, "%s", why.msg);
    ember_log(EMBER_LOG_WARN, "%s; tenant salts hold for this run only", why.msg);
    if (getrandom(srv->secret, sizeof srv->secret, 0) != (ssize_t)sizeof srv->secret)
        return ember_fail(err, "tenant secret: no randomness");
    return 0;
}

/* The KV pool's size (serve_pool_size.h), decided and logged before the
 * engine allocates it, so a pool that cannot fit stops the start-up. */
static int size_pool(const model *m, const serve_config *cfg, engine_config *ec, ember_error *err) {
    const gguf_file *f = model_get_gguf(m);
    if (!engine_has_kv(m)) {
        /* Recurrent layers only: the pool holds no K/V, its blocks only
         * count positions; the cache's capacity is the exact tier's. */
        if (cfg->num_blocks <= 0) ec->num_blocks = engine_default_blocks(m, ec->n_ctx);
        ember_log(EMBER_LOG_INFO, "KV pool: %d blocks (%s; the model has no KV layers)", ec->num_blocks,
                  cfg->num_blocks > 0 ? "cache.num_blocks" : "four contexts");
        return 0;
    }
    /* A draft model's (or an MTP head's) pool has as many blocks as the
     * target's: its blocks and weights count too. */
    const gguf_file *df = ec->spec.kind == SPEC_DRAFT && ec->spec.draft ? model_get_gguf(ec->spec.draft) : NULL;
    /* kvarn: a sealed group keeps only the blocks of its records, so one
     * context needs fewer blocks and the same blocks hold more tokens. */
    kv_pool_config kc;
    model_kv_config(m, 1, &kc);
    kc.format = ec->kv_format;
    serve_pool_inputs in = {0, (f ? gguf_file_size(f) : 0) + (df ? gguf_file_size(df) : 0), cfg->memory_share,
                            engine_blocks_bytes(m, ec->kv_format, &ec->spec), cfg->num_blocks,
                            (int32_t)kv_format_blocks_for_tokens(&kc, ec->n_ctx) + 1, &kc};
    ember_error merr;
    if (serve_mem_available(&in.available, &merr) < 0) {
        if (cfg->num_blocks > 0) return 0; /* as configured, unchecked */
        ec->num_blocks = engine_default_blocks(m, ec->n_ctx);
        ember_log(EMBER_LOG_WARN, "KV pool: %d blocks (four contexts): %s", ec->num_blocks, merr.msg);
        return 0;
    }
    serve_pool_plan plan;
    char line[512];
    if (serve_pool_size(&in, &plan, line, sizeof line, err) < 0) return -1;
    ec->num_blocks = plan.n_blocks;
    ember_log(EMBER_LOG_INFO, "%s", line);
    return 0;
}

/* The KV-event publisher (server.kv_events.*), attached to the cache after
 * announcing that this replica holds nothing yet. */
static kv_events *open_kv_events(const serve_config *cfg, const char *model_id, apc *cache, ember_error *err) {
    char topic[512];
    if (cfg->kv_events_topic[0]) snprintf(topic, sizeof topic, "%s", cfg->kv_events_topic);
    else kv_events_default_topic(model_id, topic, sizeof topic);
    kv_events_config kc = {cfg->kv_events_endpoint, cfg->kv_events_replay_endpoint, topic,
                           cfg->kv_events_buffer_steps, 0};
    kv_events *ev = kv_events_create(&kc, err);
    if (ev == NULL) return NULL;
    kv_events_clear(ev);
    kv_events_attach(ev, cache);
    return ev;
}

server *server_open(const char *model_path, const serve_config *cfg, ember_error *err) {
    server *srv = calloc(1, sizeof *srv);
    if (srv == NULL) {
        ember_fail(err, "server: out of memory");
        return NULL;
    }
    srv->cfg = *cfg;
    srv->created = (long)time(NULL);
    pthread_mutex_init(&srv->lock, NULL);
    pthread_cond_init(&srv->pump_wake, NULL);
    srv->lock_ready = true;
    srv->model_path = strdup(model_path);
    srv->metrics = serve_metrics_create();
    srv->recent = serve_recent_create(64);
    if (srv->model_path == NULL || srv->metrics == NULL || srv->recent == NULL) {
        ember_fail(err, "server: out of memory");
        goto fail;
    }
    {
        const char *base = strrchr(model_path, '/');
        base = base ? base + 1 : model_path;
        size_t n = strlen(base);
        if (n > 5 && strcmp(base + n - 5, ".gguf") == 0) n -= 5;
        snprintf(srv->file_name[0], sizeof srv->file_name[0], "%.*s", (int)n, base);
        snprintf(srv->file_name[1], sizeof srv->file_name[1], "%.*s.gguf", (int)n, base);
        snprintf(srv->model_id, sizeof srv->model_id, "%.127s", cfg->model_id[0] ? cfg->model_id : srv->file_name[0]);
    }
    serve_metrics_set_model_name(srv->metrics, srv->model_id);
    srv->tenant_stats = serve_tenant_stats_create();
    if (srv->tenant_stats == NULL) {
        ember_fail(err, "server: out of memory");
        goto fail;
    }
    /* keys and the secret are checked before listening: a mistake in them
     * stops the server at once, not after the model loaded */
    if (cfg->api_keys_file[0]) {
        if (serve_keys_load(cfg->api_keys_file, &srv->keys, err) < 0) goto fail;
        ember_log(EMBER_LOG_INFO, "API keys: %d from %s; tenants come from keys%s", serve_keys_count(srv->keys),
                  cfg->api_keys_file, cfg->trusted_tenant_header ? ", or from a trusted proxy's tenant header" : "");
    }
    if (load_secret(srv, cfg, err) < 0) goto fail;
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof ss);
    unsigned flags = MHD_USE_EPOLL_INTERNAL_THREAD | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
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
    /* libmicrohttpd splits its connection limit evenly between its threads,
     * while a thread keeps whatever it accepts; so each thread's share is
     * the whole limit plus the margin, and our own count enforces the limit.
     * Every connection is a descriptor: raise the soft limit when the hard
     * one allows, and shrink the backstop (and say so) when it does not. */
    unsigned hard_limit = ((unsigned)cfg->connection_limit + LIMIT_MARGIN) * (unsigned)cfg->http_threads;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < (rlim_t)hard_limit + 256) {
        rlim_t want = (rlim_t)hard_limit + 256;
        rl.rlim_cur = rl.rlim_max == RLIM_INFINITY || rl.rlim_max > want ? want : rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
        getrlimit(RLIMIT_NOFILE, &rl);
        if (rl.rlim_cur < want) {
            hard_limit = rl.rlim_cur > 512 ? (unsigned)rl.rlim_cur - 256 : 256;
            if (hard_limit < (unsigned)cfg->connection_limit + LIMIT_MARGIN)
                ember_log(EMBER_LOG_WARN, "open files limited to %llu: fewer than server.connection_limit %d "
                          "connections may be accepted", (unsigned long long)rl.rlim_cur, cfg->connection_limit);
        }
    }
    pthread_mutex_lock(&srv->lock);
    srv->pump_started = pthread_create(&srv->pump, NULL, pump_main, srv) == 0;
    pthread_mutex_unlock(&srv->lock);
    if (!srv->pump_started) {
        ember_fail(err, "server: cannot start a thread");
        goto fail;
    }
    unsigned per_ip = cfg->per_ip_connection_limit > 0 ? (unsigned)cfg->per_ip_connection_limit + LIMIT_MARGIN : 0;
    srv->d = MHD_start_daemon(flags, (uint16_t)cfg->port, NULL, NULL, on_request, srv, MHD_OPTION_SOCK_ADDR, &ss,
                              MHD_OPTION_NOTIFY_COMPLETED, on_completed, srv, MHD_OPTION_NOTIFY_CONNECTION,
                              on_connection, srv, MHD_OPTION_CONNECTION_LIMIT, hard_limit,
                              MHD_OPTION_PER_IP_CONNECTION_LIMIT, per_ip, MHD_OPTION_CONNECTION_TIMEOUT,
                              (unsigned)cfg->idle_timeout, MHD_OPTION_THREAD_POOL_SIZE, (unsigned)cfg->http_threads,
                              MHD_OPTION_EXTERNAL_LOGGER, mhd_log, srv, MHD_OPTION_END);
    if (srv->d == NULL) {
        ember_fail(err, "cannot listen on %s:%d (address in use or not available)", cfg->host, cfg->port);
        goto fail;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(srv->d, MHD_DAEMON_INFO_BIND_PORT);
    srv->port = di ? di->port : cfg->port;
    ember_log(EMBER_LOG_INFO, "http: accepting connections on port %d while the model loads", srv->port);
    return srv;
fail:
    server_free(srv);
    return NULL;
}

int server_load(server *srv, ember_error *err) {
    const serve_config *cfg = &srv->cfg;
    const char *model_path = srv->model_path;
    srv->m = model_load(model_path, err);
    if (srv->m == NULL) return -1;
    const model_hparams *hp = model_get_hparams(srv->m);
    engine_config ec;
    serve_config_engine(cfg, &ec);
    if (ec.spec.kind == SPEC_DRAFT) {
        srv->draft_m = model_load(cfg->draft, err);
        if (srv->draft_m == NULL) {
            ember_fail_prefix(err, "draft model");
            return -1;
        }
        ec.spec.draft = srv->draft_m;
    }
    ec.n_ctx = cfg->n_ctx > 0 ? cfg->n_ctx : (hp->n_ctx_train > 0 && hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096);
    if (size_pool(srv->m, cfg, &ec, err) < 0) return -1;
    srv->e = engine_create(srv->m, &ec, err);
    if (srv->e == NULL) return -1;
    srv->chat = serve_chat_create(srv->m, err);
    if (srv->chat == NULL) return -1;
    serve_chat_set_parse_special_in_content(srv->chat, cfg->parse_special_in_content);
    sched_config sc = {cfg->n_threads, cfg->prefill_step, cfg->max_running, cfg->queue_size, cfg->fresh_wait_ms,
                       cfg->fresh_min,   cfg->disk_wait_ms};
    srv->s = sched_create(srv->e, &sc, srv->metrics, err);
    if (srv->s == NULL) return -1;
    if (cfg->kv_events_endpoint[0] &&
        (srv->kv_events = open_kv_events(cfg, srv->model_id, engine_cache(srv->e), err)) == NULL)
        return -1;
    srv->api.tok = model_get_tokenizer(srv->m);
    srv->api.chat = srv->chat;
    srv->api.model_id = srv->model_id;
    srv->model_names[0] = srv->model_id;
    srv->model_names[1] = srv->file_name[0];
    srv->model_names[2] = srv->file_name[1];
    srv->api.model_names = srv->model_names;
    srv->api.n_model_names = 3;
    srv->api.n_ctx = engine_n_ctx(srv->e);
    srv->api.max_seq_tokens = (int64_t)(kv_pool_n_blocks(engine_pool(srv->e)) - 1) * KV_BLOCK_TOKENS;
    if (kv_format_is_kvarn(kv_pool_format(engine_pool(srv->e)))) {
        /* Sealed groups give blocks back, but only after the chunk that
         * seals them took its blocks: leave room for one prefill chunk. */
        int64_t room = kv_pool_n_blocks(engine_pool(srv->e)) - 1 -
                       (cfg->prefill_step > 0 ? cfg->prefill_step : 512) / KV_BLOCK_TOKENS;
        int64_t most = room > 0 ? kv_pool_capacity_tokens(engine_pool(srv->e), room) : 0;
        if (most > srv->api.max_seq_tokens) srv->api.max_seq_tokens = most;
    }
    srv->api.default_max_tokens = cfg->default_max_tokens;
    srv->api.tenant_secret = srv->secret;
    {
        uint8_t fp[16];
        memset(fp, 0, sizeof fp);
        if (model_get_gguf(srv->m)) engine_model_fingerprint(model_get_gguf(srv->m), fp);
        for (int i = 0; i < 16; i++) snprintf(srv->fingerprint + 2 * i, 3, "%02x", fp[i]);
        apc_namespace_hex(engine_cache(srv->e), fp, cfg->disk_namespace, srv->cache_ns);
    }

    ember_log(EMBER_LOG_INFO, "serving %s as '%s' (context %d, prefill step %d, up to %d running, queue %d)",
              model_path, srv->model_id, srv->api.n_ctx, cfg->prefill_step, cfg->max_running, cfg->queue_size);
    ember_log(EMBER_LOG_INFO, "http: %d event-loop threads, up to %d connections (%d per address), read timeout "
              "%d s, idle timeout %d s", cfg->http_threads, cfg->connection_limit, cfg->per_ip_connection_limit,
              cfg->read_timeout, cfg->idle_timeout);
    atomic_store(&srv->loaded, true); /* publishes everything above to the HTTP threads */
    ember_log(EMBER_LOG_INFO, "listening on http://%s:%d", cfg->host, srv->port);
    return 0;
}

server *server_create(const char *model_path, const serve_config *cfg, ember_error *err) {
    server *srv = server_open(model_path, cfg, err);
    if (srv && server_load(srv, err) < 0) {
        server_free(srv);
        return NULL;
    }
    return srv;
}

int server_port(const server *s) { return s->port; }

/* Cancels every queued and running generation (srv->lock taken here). */
static int cancel_all(server *srv) {
    int n = 0;
    pthread_mutex_lock(&srv->lock);
    for (gen *g = srv->gens; g; g = g->next, n++) sreq_cancel(g->r);
    pthread_mutex_unlock(&srv->lock);
    return n;
}

/* The drain's first half: new generations are already refused (srv->shut);
 * queued and running ones get server.drain_timeout seconds to finish, then
 * whatever is left is cancelled; the engine thread stops after them. */
static void drain_requests(server *srv) {
    if (srv->s == NULL) return;
    int running = 0, waiting = 0;
    sched_counts(srv->s, &running, &waiting);
    ember_log(EMBER_LOG_INFO, "shutting down: draining %d running and %d queued requests (at most %d s)", running,
              waiting, srv->cfg.drain_timeout);
    double t0 = ember_now();
    while (running + waiting > 0 && ember_now() - t0 < srv->cfg.drain_timeout) {
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
        sched_counts(srv->s, &running, &waiting);
    }
    if (running + waiting > 0)
        ember_log(EMBER_LOG_WARN, "shutting down: %d requests still running after server.drain_timeout=%d s; "
                  "cancelled %d", running + waiting, srv->cfg.drain_timeout, cancel_all(srv));
    sched_drain(srv->s);
}

void server_shutdown(server *srv) {
    if (srv == NULL || atomic_exchange(&srv->shut, true)) return;
    /* /ready answers 503 from here on; the listener stays open so that
     * probes and late clients get an answer (503) instead of a refused
     * connection while the running requests finish. */
    drain_requests(srv);
    if (srv->d) {
        MHD_socket fd = MHD_quiesce_daemon(srv->d);
        if (fd != MHD_INVALID_SOCKET) close(fd);
    }
    /* Let the last responses (streams ending with [DONE]) leave before the
     * daemon closes every connection; 30 s at most. */
    for (int i = 0; srv->d && i < 3000 && atomic_load(&srv->in_flight) > 0; i++) {
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
    /* libmicrohttpd cannot stop with suspended connections: the pump
     * resumes them all as it exits, and none suspends again. */
    if (srv->pump_started) {
        pthread_mutex_lock(&srv->lock);
        srv->pump_stop = true;
        pthread_cond_signal(&srv->pump_wake);
        pthread_mutex_unlock(&srv->lock);
        pthread_join(srv->pump, NULL);
        srv->pump_started = false;
    }
    if (srv->d) {
        MHD_stop_daemon(srv->d);
        srv->d = NULL;
    }
    /* Pending SSD writes land before the process exits. */
    if (srv->e && apc_has_disk(engine_cache(srv->e))) {
        apc_flush(engine_cache(srv->e));
        ember_log(EMBER_LOG_INFO, "shutting down: pending cache writes flushed");
    }
    if (srv->kv_events) { /* routers forget this replica */
        kv_events_detach(srv->kv_events);
        kv_events_clear(srv->kv_events);
        kv_events_free(srv->kv_events);
        srv->kv_events = NULL;
    }
    ember_log(EMBER_LOG_INFO, "stopped");
}

void server_free(server *srv) {
    if (srv == NULL) return;
    server_shutdown(srv);
    kv_events_free(srv->kv_events); /* a server that failed to start */
    sched_free(srv->s);
    serve_chat_free(srv->chat);
    serve_metrics_free(srv->metrics);
    serve_recent_free(srv->recent);
    serve_keys_free(srv->keys);
    serve_tenant_stats_free(srv->tenant_stats);
    engine_free(srv->e);
    model_free(srv->m);
    model_free(srv->draft_m);
    free(srv->model_path);
    if (srv->lock_ready) {
        pthread_mutex_destroy(&srv->lock);
        pthread_cond_destroy(&srv->pump_wake);
    }
    free(srv);
}
