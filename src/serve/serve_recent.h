/* serve_recent.h - the last requests the server finished, for the dashboard.
 *
 * Contract: a fixed-size ring (oldest overwritten) of finished generations,
 * filled by the HTTP layer from each request's usage (sreq_usage), so it
 * needs nothing from the scheduler or the cache beyond what the response
 * already reports. Every call is thread-safe (one mutex). The cached tokens
 * of a request are attributed to the cache's routed tier (block, ckpt or
 * exact); whether an SSD read supplied them is not known per request and is
 * visible only in the tier's disk_hits counter.
 *
 * serve_recent_json renders GET /v1/cache/recent: the server's identity and
 * routing ({model, tier, route (the "APC tier: ..." log line, or the "APC
 * OFF ..." one), route_reason, tripwire (EMBER_APC_CKPT_TRIPWIRE, the
 * threshold of the two checkpoint warnings)}) and `requests`, newest first,
 * at most `limit`. */
#ifndef EMBER_SERVE_RECENT_H
#define EMBER_SERVE_RECENT_H

#include <stdbool.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "apc/apc.h"

typedef struct serve_recent serve_recent;

typedef struct serve_recent_entry {
    char id[48];
    const char *endpoint;     /* a static string: "chat" or "completions" */
    double time;              /* unix seconds at the finish */
    int status;               /* HTTP status sent (200, 500) */
    const char *finish;       /* a static string: api_finish_reason */
    bool stream;
    int64_t prompt_tokens, cached_tokens;
    int completion_tokens;
    double ttft_s, total_s;
} serve_recent_entry;

/* ---- API ---- */
serve_recent *serve_recent_create(int capacity);
void serve_recent_free(serve_recent *r);
void serve_recent_add(serve_recent *r, const serve_recent_entry *e);
cJSON *serve_recent_json(serve_recent *r, apc *cache, const char *model_id, int limit);

#endif
