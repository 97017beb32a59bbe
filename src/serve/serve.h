/* serve.h - `ember serve`: one GGUF model behind an OpenAI-compatible HTTP
 * API (libmicrohttpd as an epoll event loop on server.http_threads threads;
 * a connection costs no thread, a waiting request is suspended).
 *
 * Contract:
 *  - server_create starts the HTTP daemon on host:port (port 0: any free
 *    port, see server_port), then loads the model, builds the engine bundle
 *    (KV pool + prompt cache, configured from serve_config) and starts the
 *    scheduler's engine thread (server_open + server_load). It logs
 *    "listening on http://HOST:PORT" when ready.
 *  - Routes: GET /health (never authenticated), GET /v1/models,
 *    POST /v1/chat/completions, POST /v1/completions, GET /v1/cache/stats
 *    and /cache/stats (?model=ID), POST /v1/cache/reset and /cache/reset,
 *    GET /metrics and /v1/metrics (Prometheus text), GET /v1/cache/recent
 *    (the last finished requests, serve_recent.h), GET / and /dashboard (the
 *    live cache dashboard, a static page compiled in: serve_dashboard.h),
 *    GET /ready (never authenticated: 200 when serving, 503 loading or draining),
 *    POST /tokenize and /detokenize (vLLM's shapes, serve_tokenize.h).
 *    /v1/models carries the model fingerprint and the cache format; /metrics
 *    also has vLLM's metric names (serve_metrics.h).
 *  - With server.kv_events.endpoint set, the cache's block changes are
 *    published as vLLM KV events (serve_kv_events.h), starting and ending
 *    with AllBlocksCleared.
 *    With an API key every route but /health and the dashboard page needs
 *    "Authorization: Bearer KEY" (401 otherwise); the page holds no data and
 *    asks for the key before it polls. With server.api_keys_file a key also
 *    names the request's tenant (serve_tenant.h); a key without the admin
 *    role sees only its tenant's usage in /v1/cache/stats and gets 403
 *    (admin_key_required) on /metrics, /v1/cache/recent and resets.
 *    Tenant headers count only with server.trusted_tenant_header
 *    (docs/security.md).
 *    Unknown paths are 404, known paths with another method 405, bodies over
 *    server.max_body_bytes 413; every error has an OpenAI error body.
 *  - Connections: past server.connection_limit open connections, or
 *    server.per_ip_connection_limit from one address, a request is answered
 *    503 (code too_many_connections) with Retry-After and its connection
 *    closed; a connection that has not delivered a whole request within
 *    server.read_timeout seconds of connecting or of its previous answer is
 *    closed, and one silent for server.idle_timeout seconds too.
 *  - A client that disconnects cancels its request; the scheduler frees its
 *    sequence at the next iteration. A half-close (shutdown of the
 *    client's write side) is not a disconnect: the answer is delivered, and
 *    a client is gone only when a write to it fails (a client that sent a
 *    FIN is probed every second while its request waits).
 *  - server_shutdown is the graceful drain: /ready turns 503 and new
 *    generations are refused (503 server_shutting_down) while the listener
 *    stays open; queued and running requests get server.drain_timeout
 *    seconds to finish, then the rest is cancelled; the last responses
 *    leave, the daemon stops, pending SSD writes are flushed and the KV-event
 *    publisher sends its final AllBlocksCleared. server_free implies it. */
#ifndef EMBER_SERVE_H
#define EMBER_SERVE_H

#include "core/error.h"
#include "serve/serve_config.h"

typedef struct server server;

/* ---- API ---- */
server *server_create(const char *model_path, const serve_config *cfg, ember_error *err);
/* server_create in two halves, for orchestrators that probe a server while
 * it loads: server_open listens at once (logging "http: accepting
 * connections on port N while the model loads"); until server_load is done,
 * /health answers 200 {"status": "loading"}, /ready 503 {"status":
 * "loading"}, the dashboard page is served and every other route is 503
 * model_loading with Retry-After. server_load loads the model and logs
 * "listening on ..."; after it fails the server can only be freed. */
server *server_open(const char *model_path, const serve_config *cfg, ember_error *err);
int server_load(server *s, ember_error *err);
int server_port(const server *s);
void server_shutdown(server *s);
void server_free(server *s);

#endif
