/* serve_stats.c - the prompt cache's counters as GET /v1/cache/stats.
 *
 * The field names are the reference's (§11.1) where it has them, in its
 * order, then ember's additions; apc.h documents each counter. The cache
 * itself builds no JSON: this file is the one place that names the fields
 * on the wire (serve_metrics.c names the Prometheus series). */
#include "serve/serve_stats.h"

#include "apc/apc_ckpt.h"

static void add_ckpt_family(const apc_stats *s, cJSON *o) {
    cJSON_AddNumberToObject(o, "ckpt_stores", (double)s->ckpt_stores);
    cJSON_AddNumberToObject(o, "ckpt_hits", (double)s->ckpt_hits);
    cJSON_AddNumberToObject(o, "ckpt_matched_tokens", (double)s->ckpt_matched_tokens);
    cJSON *d = cJSON_CreateObject();
    for (int i = 0; i < APC_CKPT_DECLINE_COUNT_; i++)
        if (s->ckpt_declines[i])
            cJSON_AddNumberToObject(d, apc_ckpt_decline_name((apc_ckpt_decline)i), (double)s->ckpt_declines[i]);
    cJSON_AddItemToObject(o, "ckpt_declines", d);
    cJSON_AddNumberToObject(o, "ckpt_missed_adoptions", (double)s->ckpt_missed_adoptions);
    cJSON_AddNumberToObject(o, "ckpt_skeleton_writes", (double)s->ckpt_skeleton_writes);
    cJSON_AddNumberToObject(o, "sidecar_writes", (double)s->sidecar_writes);
    cJSON_AddNumberToObject(o, "retire_fallback_full", (double)s->retire_fallback_full);
    cJSON_AddNumberToObject(o, "retire_fallback_suppressed", (double)s->retire_fallback_suppressed);
    cJSON_AddNumberToObject(o, "ckpt_pool_evictions", (double)s->ckpt_pool_evictions);
    cJSON_AddNumberToObject(o, "ckpt_grid_truncate", (double)s->ckpt_grid_truncate);
    cJSON_AddNumberToObject(o, "anchor_stores", (double)s->anchor_stores);
    cJSON_AddNumberToObject(o, "anchor_hits", (double)s->anchor_hits);
    cJSON_AddNumberToObject(o, "ckpt_records", s->ckpt_records);
    cJSON_AddNumberToObject(o, "ckpt_bytes", (double)s->ckpt_bytes);
    cJSON_AddNumberToObject(o, "ckpt_armed", (double)s->ckpt_armed);
    cJSON_AddNumberToObject(o, "anchor_entries", s->anchor_entries);
}

cJSON *serve_cache_stats_json(apc *c) {
    apc_stats s;
    apc_get_stats(c, &s);
    cJSON *o = cJSON_CreateObject();
    if (o == NULL) return NULL;
    if (!s.enabled) {
        cJSON_AddBoolToObject(o, "enabled", false);
        return o;
    }
    /* stock */
    cJSON_AddNumberToObject(o, "block_size", s.block_size);
    cJSON_AddNumberToObject(o, "num_blocks", s.num_blocks);
    cJSON_AddNumberToObject(o, "pool_used", s.pool_used);
    cJSON_AddNumberToObject(o, "lookups_hit", (double)s.lookups_hit);
    cJSON_AddNumberToObject(o, "lookups_miss", (double)s.lookups_miss);
    cJSON_AddNumberToObject(o, "matched_tokens", (double)s.matched_tokens);
    cJSON_AddNumberToObject(o, "served_tokens", (double)s.served_tokens);
    double denom = (double)s.matched_tokens + (double)s.served_tokens;
    cJSON_AddNumberToObject(o, "token_hit_rate", denom > 0 ? (double)s.matched_tokens / denom : 0.0);
    cJSON_AddNumberToObject(o, "evictions", (double)s.evictions);
    cJSON_AddNumberToObject(o, "stores", (double)s.stores);
    cJSON_AddNumberToObject(o, "disk_hits", (double)s.disk_hits);
    cJSON_AddNumberToObject(o, "disk_writes", (double)s.disk_writes);
    cJSON_AddNumberToObject(o, "exact_hits", (double)s.exact_hits);
    cJSON_AddNumberToObject(o, "exact_stores", (double)s.exact_stores);
    /* checkpoint family and anchors (apc_ckpt.c); L0 (the engine's): serve_stats_add_prefix */
    add_ckpt_family(&s, o);
    /* ember */
    cJSON_AddStringToObject(o, "tier", apc_tier_name(s.tier));
    cJSON_AddStringToObject(o, "hash", s.hash == APC_HASH_XXH3 ? "xxh3" : "sha256");
    cJSON_AddNumberToObject(o, "pool_free", s.pool_free);
    cJSON_AddNumberToObject(o, "pool_referenced", s.pool_referenced);
    cJSON_AddNumberToObject(o, "pool_capacity_tokens", (double)s.num_blocks * s.block_size);
    cJSON_AddNumberToObject(o, "pool_bytes", (double)s.num_blocks * (double)s.block_bytes);
    cJSON_AddStringToObject(o, "kv_format", s.kv_format);
    cJSON_AddStringToObject(o, "attention_precision", s.attention_precision);
    cJSON_AddNumberToObject(o, "exact_entries", s.exact_entries);
    cJSON_AddNumberToObject(o, "exact_max_entries", s.exact_max_entries);
    cJSON_AddNumberToObject(o, "exact_bytes", (double)s.exact_bytes);
    cJSON_AddNumberToObject(o, "exact_max_bytes", (double)s.exact_max_bytes);
    cJSON_AddNumberToObject(o, "exact_evictions", (double)s.exact_evictions);
    cJSON_AddNumberToObject(o, "retire_stores", (double)s.retire_stores);
    /* recurrent-state snapshots on block chains (apc_snap.c) */
    cJSON_AddNumberToObject(o, "snap_interval", s.snap_interval);
    cJSON_AddNumberToObject(o, "snap_stores", (double)s.snap_stores);
    cJSON_AddNumberToObject(o, "snap_hits", (double)s.snap_hits);
    cJSON_AddNumberToObject(o, "snap_evictions", (double)s.snap_evictions);
    cJSON_AddNumberToObject(o, "snap_entries", s.snap_entries);
    cJSON_AddNumberToObject(o, "snap_bytes", (double)s.snap_bytes);
    cJSON_AddNumberToObject(o, "snap_max_bytes", (double)s.snap_max_bytes);
    cJSON_AddNumberToObject(o, "generation", (double)s.generation);
    cJSON *d = cJSON_CreateObject();
    for (int i = 0; i < APC_DECLINE_COUNT_; i++)
        if (s.declines[i]) cJSON_AddNumberToObject(d, apc_decline_name((apc_decline)i), (double)s.declines[i]);
    cJSON_AddItemToObject(o, "declines", d);
    if (s.disk_enabled) {
        cJSON_AddNumberToObject(o, "disk_bytes", (double)s.disk_bytes);
        cJSON_AddNumberToObject(o, "disk_max_bytes", (double)s.disk_max_bytes);
        cJSON_AddNumberToObject(o, "disk_evictions", (double)s.disk_evictions);
        cJSON_AddNumberToObject(o, "disk_files", (double)s.disk_files);
        cJSON_AddNumberToObject(o, "disk_blocks_indexed", (double)s.disk_blocks_indexed);
        cJSON_AddNumberToObject(o, "disk_exact_indexed", (double)s.disk_exact_indexed);
        cJSON_AddNumberToObject(o, "disk_write_drops", (double)s.disk_write_drops);
        cJSON_AddNumberToObject(o, "disk_write_errors", (double)s.disk_write_errors);
        cJSON_AddNumberToObject(o, "disk_corrupt", (double)s.disk_corrupt);
        cJSON_AddNumberToObject(o, "disk_read_errors", (double)s.disk_read_errors);
        cJSON_AddStringToObject(o, "disk_namespace", s.disk_namespace);
    }
    if (s.remote_enabled) {
        cJSON_AddNumberToObject(o, "remote_hits", (double)s.remote_hits);
        cJSON_AddNumberToObject(o, "remote_hit_tokens", (double)s.remote_hit_tokens);
        cJSON_AddNumberToObject(o, "remote_writes", (double)s.remote_writes);
        cJSON_AddNumberToObject(o, "remote_errors", (double)s.remote_errors);
        cJSON_AddNumberToObject(o, "remote_timeouts", (double)s.remote_timeouts);
        cJSON_AddNumberToObject(o, "remote_corrupt", (double)s.remote_corrupt);
        cJSON_AddNumberToObject(o, "remote_write_drops", (double)s.remote_write_drops);
        cJSON_AddBoolToObject(o, "remote_breaker_open", s.remote_breaker_open);
    }
    cJSON_AddBoolToObject(o, "enabled", true);
    return o;
}


void serve_stats_add_prefix(cJSON *o, const prefix_stats *st) {
    const struct {
        const char *name;
        double v;
    } f[] = {
        {"spec_prefix_hits", (double)st->hits},
        {"spec_prefix_hit_tokens", (double)st->hit_tokens},
        {"spec_prefix_stores", (double)st->stores},
        {"spec_prefix_skips", (double)st->skips},
        {"spec_prefix_evictions", (double)st->evictions},
        {"spec_prefix_entries", (double)st->entries},
        {"spec_prefix_bytes", (double)st->bytes},
        {"spec_prefix_max_entries", (double)st->max_entries},
        {"spec_prefix_max_bytes", (double)st->max_bytes},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        cJSON_DeleteItemFromObject(o, f[i].name);
        cJSON_AddNumberToObject(o, f[i].name, f[i].v);
    }
}
