/* serve.h - `ember serve`: one GGUF model behind an OpenAI-compatible HTTP
 * API (libmicrohttpd, one thread per connection).
 *
 * Contract:
 *  - server_create loads the model, builds the engine bundle (KV pool +
 *    prompt cache, configured from serve_config), starts the scheduler's
 *    engine thread and the HTTP daemon on host:port (port 0: any free port,
 *    see server_port). It logs "listening on http://HOST:PORT" when ready.
 *  - Routes: GET /health (never authenticated), GET /v1/models,
 *    POST /v1/chat/completions, POST /v1/completions, GET /v1/cache/stats
 *    and /cache/stats (?model=ID), POST /v1/cache/reset and /cache/reset,
 *    GET /metrics and /v1/metrics (Prometheus text). With an API key every
 *    route but /health needs "Authorization: Bearer KEY" (401 otherwise).
 *    Unknown paths are 404, known paths with another method 405, bodies over
 *    server.max_body_bytes 413; every error has an OpenAI error body.
 *  - A client that disconnects cancels its request; the scheduler frees its
 *    sequence at the next iteration.
 *  - server_shutdown is the graceful drain: stop accepting connections,
 *    refuse new requests on open ones (503), finish every queued and running
 *    request, then stop the daemon. server_free implies it. */
#ifndef EMBER_SERVE_H
#define EMBER_SERVE_H

#include "core/error.h"
#include "serve/serve_config.h"

typedef struct server server;

/* ---- API ---- */
server *server_create(const char *model_path, const serve_config *cfg, ember_error *err);
int server_port(const server *s);
void server_shutdown(server *s);
void server_free(server *s);

#endif
