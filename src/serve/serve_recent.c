/* serve_recent.c - a mutex-guarded ring of finished requests (serve_recent.h).
 *
 * The ring stores plain values (ids and counts, static strings for the
 * endpoint and finish reason), so adding an entry never allocates and a
 * reader copies under the lock and renders outside it. The routing facts
 * come from the cache's route at render time and are formatted exactly as
 * apc.c logs them at load, so the dashboard shows the line an operator would
 * grep for. */
#include "serve/serve_recent.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct serve_recent {
    pthread_mutex_t mu;
    serve_recent_entry *ring;
    int cap, next;
    uint64_t total;   /* entries ever added */
};

serve_recent *serve_recent_create(int capacity) {
    if (capacity < 1) capacity = 1;
    serve_recent *r = calloc(1, sizeof *r);
    if (r == NULL) return NULL;
    r->ring = calloc((size_t)capacity, sizeof *r->ring);
    if (r->ring == NULL) {
        free(r);
        return NULL;
    }
    r->cap = capacity;
    pthread_mutex_init(&r->mu, NULL);
    return r;
}

void serve_recent_free(serve_recent *r) {
    if (r == NULL) return;
    pthread_mutex_destroy(&r->mu);
    free(r->ring);
    free(r);
}

void serve_recent_add(serve_recent *r, const serve_recent_entry *e) {
    if (r == NULL) return;
    pthread_mutex_lock(&r->mu);
    r->ring[r->next] = *e;
    r->next = (r->next + 1) % r->cap;
    r->total++;
    pthread_mutex_unlock(&r->mu);
}

static void add_route(cJSON *o, apc *cache) {
    const apc_route *rt = apc_get_route(cache);
    char line[256];
    if (rt == NULL || rt->tier == APC_TIER_NONE)
        snprintf(line, sizeof line, "APC OFF for this model: %s", rt && rt->reason[0] ? rt->reason : "disabled");
    else
        snprintf(line, sizeof line, "APC tier: %s (layers: %d kv / %d rot / %d arr)", apc_tier_name(rt->tier),
                 rt->n_kv, rt->n_rot, rt->n_arr);
    cJSON_AddStringToObject(o, "tier", apc_tier_name(rt ? rt->tier : APC_TIER_NONE));
    cJSON_AddStringToObject(o, "route", line);
    cJSON_AddStringToObject(o, "route_reason", rt && rt->tier != APC_TIER_NONE ? rt->reason : "");
    cJSON_AddBoolToObject(o, "route_forced", rt && rt->forced);
}

cJSON *serve_recent_json(serve_recent *r, apc *cache, const char *model_id, int limit) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "model", model_id);
    add_route(o, cache);
    cJSON_AddNumberToObject(o, "tripwire", apc_ckpt_default_config().tripwire);
    const char *tier = apc_tier_name(apc_get_tier(cache));
    if (limit <= 0 || limit > r->cap) limit = r->cap;
    serve_recent_entry *copy = malloc((size_t)limit * sizeof *copy);
    int n = 0;
    uint64_t total;
    pthread_mutex_lock(&r->mu);
    total = r->total;
    int have = total < (uint64_t)r->cap ? (int)total : r->cap;
    for (int i = 0; i < have && n < limit && copy; i++) copy[n++] = r->ring[(r->next - 1 - i + 2 * r->cap) % r->cap];
    pthread_mutex_unlock(&r->mu);
    cJSON_AddNumberToObject(o, "requests_total", (double)total);
    cJSON *arr = cJSON_AddArrayToObject(o, "requests");
    for (int i = 0; i < n; i++) {
        const serve_recent_entry *e = &copy[i];
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "id", e->id);
        cJSON_AddStringToObject(j, "endpoint", e->endpoint ? e->endpoint : "");
        cJSON_AddNumberToObject(j, "time", e->time);
        cJSON_AddNumberToObject(j, "status", e->status);
        cJSON_AddStringToObject(j, "finish", e->finish ? e->finish : "");
        cJSON_AddBoolToObject(j, "stream", e->stream);
        cJSON_AddNumberToObject(j, "prompt_tokens", (double)e->prompt_tokens);
        cJSON_AddNumberToObject(j, "cached_tokens", (double)e->cached_tokens);
        cJSON_AddNumberToObject(j, "completion_tokens", e->completion_tokens);
        cJSON_AddNumberToObject(j, "ttft_s", e->ttft_s);
        cJSON_AddNumberToObject(j, "total_s", e->total_s);
        /* where each prompt token came from: the routed tier, or prefill */
        cJSON *by = cJSON_AddObjectToObject(j, "tokens_by_tier");
        if (e->cached_tokens > 0) cJSON_AddNumberToObject(by, tier, (double)e->cached_tokens);
        cJSON_AddNumberToObject(by, "prefill", (double)(e->prompt_tokens - e->cached_tokens));
        cJSON_AddItemToArray(arr, j);
    }
    free(copy);
    return o;
}
