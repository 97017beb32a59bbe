/* serve_metrics.h - the server's counters and latency histograms, rendered
 * in the Prometheus text format (0.0.4) for GET /metrics.
 *
 * Contract: every observe/count call is thread-safe (one mutex); the render
 * appends every prompt-cache counter of apc_get_stats as ember_apc_*
 * series, with _total on counters, base units (seconds, bytes), HELP and
 * TYPE lines for every family, so the output passes `promtool check
 * metrics`. */
#ifndef EMBER_SERVE_METRICS_H
#define EMBER_SERVE_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "apc/apc.h"
#include "engine/engine_prefix.h"
#include "serve/serve_kv_events.h"

typedef struct serve_metrics serve_metrics;

typedef enum serve_hist {
    HIST_REQUEST_SECONDS = 0,  /* arrival to last byte of a generation */
    HIST_TTFT_SECONDS,         /* arrival to the first generated token */
    HIST_TPOT_SECONDS,         /* time between consecutive generated tokens */
    HIST_QUEUE_SECONDS,        /* arrival to admission */
    HIST_COUNT_
} serve_hist;

/* ---- API ---- */
serve_metrics *serve_metrics_create(void);
void serve_metrics_free(serve_metrics *m);
void serve_metrics_observe(serve_metrics *m, serve_hist h, double seconds);
/* One finished HTTP request on a route ("/v1/chat/completions", or "other")
 * with its status. */
void serve_metrics_request(serve_metrics *m, const char *route, int status);
/* Tokens of one finished generation. */
void serve_metrics_tokens(serve_metrics *m, int64_t prompt, int64_t cached, int64_t completion);
void serve_metrics_finish(serve_metrics *m, const char *reason);
/* Speculative decoding of one finished request: verification steps that
 * carried drafts, tokens drafted, drafts the target emitted. */
void serve_metrics_spec(serve_metrics *m, int64_t rounds, int64_t drafted, int64_t accepted);
/* The prefix layer's (L0) counters as of now (read before a render). */
void serve_metrics_set_prefix(serve_metrics *m, const prefix_stats *st);
/* The drafter's sidecar counters as of now (read before a render). */
void serve_metrics_set_sidecar(serve_metrics *m, int64_t writes, int64_t hits, int64_t disk_writes,
                               int64_t disk_loads);
/* The totals so far (for /v1/cache/stats). */
void serve_metrics_spec_totals(serve_metrics *m, int64_t *rounds, int64_t *drafted, int64_t *accepted);
/* The model_name label of the vLLM-compatible families (copied; default ""). */
void serve_metrics_set_model_name(serve_metrics *m, const char *name);
/* Renders everything (gauges passed in) into a malloc'd NUL-terminated buffer:
 * ember's families, then vLLM's names for the same measurements
 * (vllm:num_requests_running, vllm:num_requests_waiting,
 * vllm:kv_cache_usage_perc, vllm:prefix_cache_queries_total,
 * vllm:prefix_cache_hits_total, vllm:time_to_first_token_seconds), each
 * labelled model_name, so dashboards and autoscalers built for vLLM work. */
char *serve_metrics_render(serve_metrics *m, apc *cache, int running, int waiting, size_t *len);

/* The KV-event publisher's counters as ember_kv_events_* families, appended
 * to text (realloc'd; *len updated). NULL when out of memory (text freed). */
char *serve_metrics_append_kv_events(char *text, size_t *len, const kv_events_stats *st);

/* ---- Reading exposition text (clients: ember bench, tests) ---- */
/* The sum of every sample of the family `name` in Prometheus text. */
double serve_metrics_text_sum(const char *text, const char *name);

#endif
