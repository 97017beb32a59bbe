/* serve_metrics.c - counters, histograms and the Prometheus text rendering
 * (see serve_metrics.h).
 *
 * Histograms use fixed bucket bounds chosen for CPU inference (a token takes
 * milliseconds, a long prefill seconds). Requests are counted per (route,
 * status) in a small open table; routes are the fixed API paths, so the
 * label set stays bounded whatever URLs clients send ("other" catches the
 * rest).
 *
 * The vllm:* families repeat measurements ember already keeps under vLLM's
 * names and meanings (vllm/v1/metrics/loggers.py, read for the names): KV
 * usage is the fraction of pool blocks that live sequences reference (vLLM
 * counts cached-but-free blocks as free too), prefix-cache queries and hits
 * are prompt tokens and prompt tokens adopted from the cache. Counters carry
 * _total as prometheus_client exposes them. */
#include "serve/serve_metrics.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const double bounds_latency[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                        0.5,   1,      2.5,   5,    10,    30,   60, 120};
#define N_BOUNDS (sizeof bounds_latency / sizeof bounds_latency[0])

typedef struct hist {
    uint64_t buckets[N_BOUNDS]; /* non-cumulative */
    uint64_t count;
    double sum;
} hist;

#define MAX_ROUTE_ROWS 64
typedef struct route_row {
    char route[40];
    int status;
    uint64_t n;
} route_row;

#define MAX_FINISH 8
struct serve_metrics {
    pthread_mutex_t lock;
    hist h[HIST_COUNT_];
    route_row rows[MAX_ROUTE_ROWS];
    int n_rows;
    uint64_t prompt_tokens, cached_tokens, completion_tokens, generations;
    uint64_t spec_rounds, spec_drafted, spec_accepted;
    int64_t sidecar_writes, sidecar_hits, sidecar_disk_writes, sidecar_disk_loads;
    prefix_stats prefix;            /* L0, as of the last serve_metrics_set_prefix */
    char finish_name[MAX_FINISH][16];
    uint64_t finish_n[MAX_FINISH];
    int n_finish;
    char model_name[128];
};

static const struct {
    const char *name, *help;
} hist_desc[HIST_COUNT_] = {
    {"ember_request_duration_seconds", "Time from arrival to the end of a generation request."},
    {"ember_time_to_first_token_seconds", "Time from arrival to the first generated token."},
    {"ember_time_per_output_token_seconds", "Time between consecutive generated tokens of a request."},
    {"ember_queue_wait_seconds", "Time from arrival to admission by the scheduler."},
};

serve_metrics *serve_metrics_create(void) {
    serve_metrics *m = calloc(1, sizeof *m);
    if (m) pthread_mutex_init(&m->lock, NULL);
    return m;
}

void serve_metrics_free(serve_metrics *m) {
    if (m == NULL) return;
    pthread_mutex_destroy(&m->lock);
    free(m);
}

void serve_metrics_set_model_name(serve_metrics *m, const char *name) {
    if (m == NULL) return;
    pthread_mutex_lock(&m->lock);
    snprintf(m->model_name, sizeof m->model_name, "%s", name ? name : "");
    pthread_mutex_unlock(&m->lock);
}

void serve_metrics_observe(serve_metrics *m, serve_hist which, double s) {
    if (m == NULL || which < 0 || which >= HIST_COUNT_) return;
    if (!(s >= 0)) s = 0;
    pthread_mutex_lock(&m->lock);
    hist *h = &m->h[which];
    size_t b = 0;
    while (b < N_BOUNDS && s > bounds_latency[b]) b++;
    if (b < N_BOUNDS) h->buckets[b]++;
    h->count++;
    h->sum += s;
    pthread_mutex_unlock(&m->lock);
}

void serve_metrics_request(serve_metrics *m, const char *route, int status) {
    if (m == NULL) return;
    pthread_mutex_lock(&m->lock);
    int i;
    for (i = 0; i < m->n_rows; i++)
        if (m->rows[i].status == status && strcmp(m->rows[i].route, route) == 0) break;
    if (i == m->n_rows && m->n_rows < MAX_ROUTE_ROWS) {
        snprintf(m->rows[i].route, sizeof m->rows[i].route, "%s", route);
        m->rows[i].status = status;
        m->n_rows++;
    }
    if (i < m->n_rows) m->rows[i].n++;
    pthread_mutex_unlock(&m->lock);
}

void serve_metrics_spec(serve_metrics *m, int64_t rounds, int64_t drafted, int64_t accepted) {
    if (m == NULL) return;
    pthread_mutex_lock(&m->lock);
    m->spec_rounds += (uint64_t)rounds;
    m->spec_drafted += (uint64_t)drafted;
    m->spec_accepted += (uint64_t)accepted;
    pthread_mutex_unlock(&m->lock);
}

void serve_metrics_set_prefix(serve_metrics *m, const prefix_stats *st) {
    pthread_mutex_lock(&m->lock);
    m->prefix = *st;
    pthread_mutex_unlock(&m->lock);
}

void serve_metrics_set_sidecar(serve_metrics *m, int64_t writes, int64_t hits, int64_t disk_writes,
                               int64_t disk_loads) {
    pthread_mutex_lock(&m->lock);
    m->sidecar_writes = writes;
    m->sidecar_hits = hits;
    m->sidecar_disk_writes = disk_writes;
    m->sidecar_disk_loads = disk_loads;
    pthread_mutex_unlock(&m->lock);
}

void serve_metrics_spec_totals(serve_metrics *m, int64_t *rounds, int64_t *drafted, int64_t *accepted) {
    pthread_mutex_lock(&m->lock);
    *rounds = (int64_t)m->spec_rounds;
    *drafted = (int64_t)m->spec_drafted;
    *accepted = (int64_t)m->spec_accepted;
    pthread_mutex_unlock(&m->lock);
}

void serve_metrics_tokens(serve_metrics *m, int64_t prompt, int64_t cached, int64_t completion) {
    if (m == NULL) return;
    pthread_mutex_lock(&m->lock);
    m->prompt_tokens += (uint64_t)prompt;
    m->cached_tokens += (uint64_t)cached;
    m->completion_tokens += (uint64_t)completion;
    m->generations++;
    pthread_mutex_unlock(&m->lock);
}

void serve_metrics_finish(serve_metrics *m, const char *reason) {
    if (m == NULL) return;
    pthread_mutex_lock(&m->lock);
    int i;
    for (i = 0; i < m->n_finish; i++)
        if (strcmp(m->finish_name[i], reason) == 0) break;
    if (i == m->n_finish && m->n_finish < MAX_FINISH) {
        snprintf(m->finish_name[i], sizeof m->finish_name[i], "%s", reason);
        m->n_finish++;
    }
    if (i < m->n_finish) m->finish_n[i]++;
    pthread_mutex_unlock(&m->lock);
}

/* ---- rendering ---- */

typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;

__attribute__((format(printf, 2, 3))) static void out(sbuf *b, const char *fmt, ...) {
    if (b->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = 1;
            return;
        }
        if ((size_t)n < b->cap - b->len) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap * 2 + (size_t)n;
        char *np = realloc(b->p, cap);
        if (np == NULL) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
}

static void family(sbuf *b, const char *name, const char *type, const char *help) {
    out(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void counter(sbuf *b, const char *name, const char *help, double v) {
    family(b, name, "counter", help);
    out(b, "%s %.17g\n", name, v);
}

static void gauge(sbuf *b, const char *name, const char *help, double v) {
    family(b, name, "gauge", help);
    out(b, "%s %.17g\n", name, v);
}

/* A label value with \\, " and newline escaped (the exposition format). */
static void label_value(const char *in, char *out, size_t cap) {
    size_t k = 0;
    for (; *in && k + 3 < cap; in++) {
        if (*in == '\\' || *in == '"') out[k++] = '\\', out[k++] = *in;
        else if (*in == '\n') out[k++] = '\\', out[k++] = 'n';
        else out[k++] = *in;
    }
    out[k] = 0;
}

/* vLLM's families (see the file comment). */
static void render_vllm(sbuf *b, const char *model_label, int running, int waiting, const apc_stats *s,
                        uint64_t prompt_tokens, uint64_t cached_tokens, const hist *ttft) {
    char lbl[320];
    snprintf(lbl, sizeof lbl, "model_name=\"%s\"", model_label);
    family(b, "vllm:num_requests_running", "gauge", "Number of requests in model execution batches.");
    out(b, "vllm:num_requests_running{%s} %d\n", lbl, running);
    family(b, "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.");
    out(b, "vllm:num_requests_waiting{%s} %d\n", lbl, waiting);
    family(b, "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.");
    out(b, "vllm:kv_cache_usage_perc{%s} %.17g\n", lbl,
        s->num_blocks > 0 ? (double)s->pool_referenced / (double)s->num_blocks : 0.0);
    family(b, "vllm:prefix_cache_queries_total", "counter", "Prefix cache queries, in terms of number of queried tokens.");
    out(b, "vllm:prefix_cache_queries_total{%s} %llu\n", lbl, (unsigned long long)prompt_tokens);
    family(b, "vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.");
    out(b, "vllm:prefix_cache_hits_total{%s} %llu\n", lbl, (unsigned long long)cached_tokens);
    family(b, "vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.");
    uint64_t cum = 0;
    for (size_t i = 0; i < N_BOUNDS; i++) {
        cum += ttft->buckets[i];
        out(b, "vllm:time_to_first_token_seconds_bucket{%s,le=\"%g\"} %llu\n", lbl, bounds_latency[i],
            (unsigned long long)cum);
    }
    out(b, "vllm:time_to_first_token_seconds_bucket{%s,le=\"+Inf\"} %llu\n", lbl, (unsigned long long)ttft->count);
    out(b, "vllm:time_to_first_token_seconds_sum{%s} %.17g\nvllm:time_to_first_token_seconds_count{%s} %llu\n", lbl,
        ttft->sum, lbl, (unsigned long long)ttft->count);
}

char *serve_metrics_render(serve_metrics *m, apc *cache, int running, int waiting, size_t *len) {
    sbuf b = {malloc(8192), 0, 8192, 0};
    if (b.p == NULL) return NULL;
    b.p[0] = 0;
    pthread_mutex_lock(&m->lock);
    char model_label[300];
    label_value(m->model_name, model_label, sizeof model_label);
    uint64_t prompt_tokens = m->prompt_tokens, cached_tokens = m->cached_tokens;
    hist ttft = m->h[HIST_TTFT_SECONDS];
    family(&b, "ember_http_requests_total", "counter", "HTTP requests answered, by route and status code.");
    for (int i = 0; i < m->n_rows; i++)
        out(&b, "ember_http_requests_total{route=\"%s\",code=\"%d\"} %llu\n", m->rows[i].route, m->rows[i].status,
            (unsigned long long)m->rows[i].n);
    counter(&b, "ember_generations_total", "Generation requests that finished.", (double)m->generations);
    family(&b, "ember_generation_finish_total", "counter", "Finished generations by finish reason.");
    for (int i = 0; i < m->n_finish; i++)
        out(&b, "ember_generation_finish_total{reason=\"%s\"} %llu\n", m->finish_name[i],
            (unsigned long long)m->finish_n[i]);
    counter(&b, "ember_prompt_tokens_total", "Prompt tokens of finished generations.", (double)m->prompt_tokens);
    counter(&b, "ember_prompt_cached_tokens_total", "Prompt tokens adopted from the prompt cache.",
            (double)m->cached_tokens);
    counter(&b, "ember_completion_tokens_total", "Generated tokens.", (double)m->completion_tokens);
    counter(&b, "ember_spec_steps_total", "Verification forwards that carried draft tokens.", (double)m->spec_rounds);
    counter(&b, "ember_spec_draft_tokens_total", "Tokens proposed by the drafter.", (double)m->spec_drafted);
    counter(&b, "ember_spec_accepted_tokens_total", "Drafted tokens the target emitted.", (double)m->spec_accepted);
    counter(&b, "ember_apc_sidecar_writes_total",
            "Drafter sidecar stores (the MTP head's K/V and hidden rows, or the draft model's K/V and state).",
            (double)m->sidecar_writes);
    counter(&b, "ember_apc_sidecar_hits_total", "Requests whose drafter was restored from the sidecar.",
            (double)m->sidecar_hits);
    counter(&b, "ember_apc_sidecar_disk_writes_total", "Drafter sidecar entries queued to the SSD tier (side files).",
            (double)m->sidecar_disk_writes);
    counter(&b, "ember_apc_sidecar_disk_loads_total", "Drafter sidecar entries read back from the SSD tier.",
            (double)m->sidecar_disk_loads);
    /* L0 works with the prompt cache off: always rendered. */
    counter(&b, "ember_apc_spec_prefix_hits_total", "L0 prefix-layer hits.", (double)m->prefix.hits);
    counter(&b, "ember_apc_spec_prefix_hit_tokens_total", "Tokens adopted from the L0 prefix layer.",
            (double)m->prefix.hit_tokens);
    counter(&b, "ember_apc_spec_prefix_stores_total", "L0 prefix-layer stores.", (double)m->prefix.stores);
    counter(&b, "ember_apc_spec_prefix_skips_total", "L0 stores skipped: one entry larger than the byte budget.",
            (double)m->prefix.skips);
    gauge(&b, "ember_apc_spec_prefix_entries", "L0 entries held.", m->prefix.entries);
    gauge(&b, "ember_apc_spec_prefix_bytes", "Bytes of the L0 entries.", (double)m->prefix.bytes);
    for (int h = 0; h < HIST_COUNT_; h++) {
        const hist *hh = &m->h[h];
        family(&b, hist_desc[h].name, "histogram", hist_desc[h].help);
        uint64_t cum = 0;
        for (size_t i = 0; i < N_BOUNDS; i++) {
            cum += hh->buckets[i];
            out(&b, "%s_bucket{le=\"%g\"} %llu\n", hist_desc[h].name, bounds_latency[i], (unsigned long long)cum);
        }
        out(&b, "%s_bucket{le=\"+Inf\"} %llu\n", hist_desc[h].name, (unsigned long long)hh->count);
        out(&b, "%s_sum %.17g\n%s_count %llu\n", hist_desc[h].name, hh->sum, hist_desc[h].name,
            (unsigned long long)hh->count);
    }
    pthread_mutex_unlock(&m->lock);
    gauge(&b, "ember_requests_running", "Requests admitted by the scheduler (prefilling or decoding).", running);
    gauge(&b, "ember_requests_waiting", "Requests queued for admission.", waiting);

    apc_stats s;
    memset(&s, 0, sizeof s);
    if (cache) apc_get_stats(cache, &s);
    gauge(&b, "ember_apc_enabled", "1 when the prompt cache serves this model.", s.enabled && s.tier != APC_TIER_NONE);
    family(&b, "ember_apc_tier_info", "gauge", "The prompt-cache tier routed for this model.");
    out(&b, "ember_apc_tier_info{tier=\"%s\",hash=\"%s\"} 1\n", apc_tier_name(s.tier),
        s.hash == APC_HASH_XXH3 ? "xxh3" : "sha256");
    gauge(&b, "ember_apc_block_size_tokens", "Tokens per KV block.", s.block_size);
    gauge(&b, "ember_apc_num_blocks", "Blocks in the KV pool.", s.num_blocks);
    gauge(&b, "ember_apc_pool_used_blocks", "Blocks holding an indexed prefix.", s.pool_used);
    gauge(&b, "ember_apc_pool_free_blocks", "Blocks with no reference (cached or empty).", s.pool_free);
    gauge(&b, "ember_apc_pool_referenced_blocks", "Blocks referenced by live sequences.", s.pool_referenced);
    gauge(&b, "ember_apc_pool_bytes", "Bytes of the KV pool.", (double)s.block_bytes * (double)s.num_blocks);
    counter(&b, "ember_apc_lookups_hit_total", "Cache lookups that adopted something.", (double)s.lookups_hit);
    counter(&b, "ember_apc_lookups_miss_total", "Block-chain walks that matched nothing.", (double)s.lookups_miss);
    counter(&b, "ember_apc_matched_tokens_total", "Prompt tokens adopted from the cache.", (double)s.matched_tokens);
    counter(&b, "ember_apc_served_tokens_total", "Tokens written into newly indexed blocks.", (double)s.served_tokens);
    gauge(&b, "ember_apc_token_hit_rate", "matched / (matched + served).",
          s.matched_tokens + s.served_tokens
              ? (double)s.matched_tokens / (double)(s.matched_tokens + s.served_tokens)
              : 0.0);
    counter(&b, "ember_apc_evictions_total", "Indexed blocks reclaimed by the pool's LRU.", (double)s.evictions);
    counter(&b, "ember_apc_stores_total", "Blocks newly indexed.", (double)s.stores);
    counter(&b, "ember_apc_disk_hits_total", "SSD tier hits.", (double)s.disk_hits);
    counter(&b, "ember_apc_disk_writes_total", "SSD tier writes.", (double)s.disk_writes);
    if (s.remote_enabled) {
        counter(&b, "ember_apc_remote_hits_total", "Values (blocks) read from Redis, verified and adopted into memory.",
                (double)s.remote_hits);
        counter(&b, "ember_apc_remote_hit_tokens_total", "Tokens of the values read from Redis.",
                (double)s.remote_hit_tokens);
        counter(&b, "ember_apc_remote_writes_total", "Values written to Redis.", (double)s.remote_writes);
        counter(&b, "ember_apc_remote_errors_total", "Failed Redis commands and connections.", (double)s.remote_errors);
        counter(&b, "ember_apc_remote_timeouts_total", "Redis reads or writes that ran out of time.",
                (double)s.remote_timeouts);
        counter(&b, "ember_apc_remote_corrupt_total", "Redis values that failed verification (deleted).",
                (double)s.remote_corrupt);
        counter(&b, "ember_apc_remote_write_drops_total", "Values not written to Redis (queue full, breaker open).",
                (double)s.remote_write_drops);
        gauge(&b, "ember_apc_remote_breaker_open", "1 while the remote tier's circuit breaker is open.",
              s.remote_breaker_open ? 1 : 0);
    }
    counter(&b, "ember_apc_exact_hits_total", "Exact-tier snapshot hits.", (double)s.exact_hits);
    counter(&b, "ember_apc_exact_stores_total", "Exact-tier snapshots stored.", (double)s.exact_stores);
    gauge(&b, "ember_apc_exact_entries", "Exact-tier snapshots held.", s.exact_entries);
    gauge(&b, "ember_apc_exact_max_entries", "Exact-tier capacity in entries.", s.exact_max_entries);
    gauge(&b, "ember_apc_exact_bytes", "Bytes of exact-tier snapshots.", (double)s.exact_bytes);
    gauge(&b, "ember_apc_exact_max_bytes", "Exact-tier capacity in bytes.", (double)s.exact_max_bytes);
    counter(&b, "ember_apc_exact_evictions_total", "Exact-tier snapshots evicted.", (double)s.exact_evictions);
    counter(&b, "ember_apc_snap_stores_total", "Recurrent-state snapshots stored on block chains.",
            (double)s.snap_stores);
    counter(&b, "ember_apc_snap_hits_total", "Lookups that restored a recurrent-state snapshot.", (double)s.snap_hits);
    counter(&b, "ember_apc_snap_evictions_total", "Snapshots dropped with their block or over the byte budget.",
            (double)s.snap_evictions);
    gauge(&b, "ember_apc_snap_entries", "Recurrent-state snapshots held.", s.snap_entries);
    gauge(&b, "ember_apc_snap_bytes", "Bytes of recurrent-state snapshots.", (double)s.snap_bytes);
    counter(&b, "ember_apc_retire_stores_total", "Requests whose retirement stored something.",
            (double)s.retire_stores);
    gauge(&b, "ember_apc_generation", "Cache generation (bumped by each reset).", (double)s.generation);
    family(&b, "ember_apc_declines_total", "counter", "Lookups or stores the cache gave up, by reason.");
    for (int d = 0; d < APC_DECLINE_COUNT_; d++)
        out(&b, "ember_apc_declines_total{reason=\"%s\"} %llu\n", apc_decline_name((apc_decline)d),
            (unsigned long long)s.declines[d]);
    /* The checkpoint family of the reference exists as zero until those
     * tiers are built, like in the stats JSON. */
    static const char *zero_counters[][2] = {
        {"ember_apc_ckpt_stores_total", "Checkpoint stores."},
        {"ember_apc_ckpt_hits_total", "Checkpoint hits."},
        {"ember_apc_ckpt_matched_tokens_total", "Tokens adopted from checkpoints."},
        {"ember_apc_ckpt_missed_adoptions_total", "Lookups that found a record and adopted nothing."},
        {"ember_apc_ckpt_skeleton_writes_total", "Checkpoint skeletons written to disk."},
        {"ember_apc_retire_fallback_full_total", "Full-sequence retirement fallbacks."},
        {"ember_apc_ckpt_pool_evictions_total", "Checkpoint records evicted for chain stores."},
        {"ember_apc_ckpt_grid_truncate_total", "Grid-truncated terminal stores."},
        {"ember_apc_anchor_stores_total", "Exact-tier anchor stores."},
        {"ember_apc_anchor_hits_total", "Exact-tier anchor hits."},
    };
    for (size_t i = 0; i < sizeof zero_counters / sizeof zero_counters[0]; i++)
        counter(&b, zero_counters[i][0], zero_counters[i][1], 0);
    render_vllm(&b, model_label, running, waiting, &s, prompt_tokens, cached_tokens, &ttft);
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    if (len) *len = b.len;
    return b.p;
}

char *serve_metrics_append_kv_events(char *text, size_t *len, const kv_events_stats *st) {
    sbuf b = {text, *len, *len + 1, 0};
    counter(&b, "ember_kv_events_batches_total", "KV-event messages published (the next sequence number).",
            (double)st->batches);
    counter(&b, "ember_kv_events_blocks_stored_total", "Blocks reported by BlockStored events.", (double)st->stored);
    counter(&b, "ember_kv_events_blocks_removed_total", "Blocks reported by BlockRemoved events.", (double)st->removed);
    counter(&b, "ember_kv_events_cleared_total", "AllBlocksCleared events published.", (double)st->cleared);
    counter(&b, "ember_kv_events_dropped_total", "Blocks lost to a full event queue (replaced by a clear).",
            (double)st->dropped);
    counter(&b, "ember_kv_events_replays_total", "Replay requests answered.", (double)st->replays);
    counter(&b, "ember_kv_events_bytes_total", "Payload bytes of the published KV-event messages.", (double)st->bytes);
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    *len = b.len;
    return b.p;
}

double serve_metrics_text_sum(const char *text, const char *name) {
    double s = 0;
    size_t n = strlen(name);
    for (const char *p = text; p && *p;) {
        const char *eol = strchr(p, '\n');
        if (strncmp(p, name, n) == 0 && (p[n] == ' ' || p[n] == '{')) {
            const char *sp = p + (eol ? (size_t)(eol - p) : strlen(p));
            while (sp > p && sp[-1] != ' ') sp--; /* the value is the last field */
            s += strtod(sp, NULL);
        }
        p = eol ? eol + 1 : NULL;
    }
    return s;
}
