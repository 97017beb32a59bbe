/* serve_stats.h - the prompt cache's counters as the JSON object of
 * GET /v1/cache/stats.
 *
 * Contract: serve_cache_stats_json(c) takes one consistent snapshot of the
 * cache's counters (apc_get_stats) and returns a new object the caller
 * frees with cJSON_Delete; NULL only when out of memory. A cache whose
 * tier is none renders as {"enabled": false}.
 *
 * serve_stats_add_prefix adds the prefix layer's (L0, engine_prefix.h)
 * fields, spec_prefix_*: L0 is the engine's, not the cache's, and works
 * with the cache off, so they go into either object. */
#ifndef EMBER_SERVE_STATS_H
#define EMBER_SERVE_STATS_H

#include <cjson/cJSON.h>

#include "apc/apc.h"
#include "engine/engine_prefix.h"

cJSON *serve_cache_stats_json(apc *c);
void serve_stats_add_prefix(cJSON *o, const prefix_stats *st);

#endif
