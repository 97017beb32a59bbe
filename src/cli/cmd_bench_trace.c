/* cmd_bench_trace.c - workloads for `ember bench` (bench.h): loading Mooncake
 * traces and ember session files, building prompts, the ideal hit rates,
 * and the synthetic generator (`ember bench gen`).
 *
 * A Mooncake block's tokens are a pure function of its hash id (a
 * splitmix64 stream seeded by the id), so two requests that share leading
 * ids share exactly that many leading tokens, whatever the server, and a
 * partial last block is a prefix of the full block with the same id. The
 * ideal hit rates walk the trace once in order: a request's hit is its
 * run of leading ids already present, in tokens, capped at N-1 (the last
 * prompt token is always forwarded); the LRU variant keeps at most
 * capacity/block_tokens ids, refreshed in prompt order. */
#define _GNU_SOURCE
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/bench.h"
#include "cli/cli_common.h"
#include "cli/cli_opts.h"

#define MOONCAKE_BLOCK 512

static uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* ---- prompts ---- */

static int32_t block_token(int64_t id, int j, int lo, int hi) {
    uint64_t x = splitmix64((uint64_t)id * 0x100000001B3ULL + (uint64_t)j);
    return (int32_t)(lo + (int)(x % (uint64_t)(hi - lo)));
}

int32_t *bench_prompt_tokens(const bench_req *r, const bench_opts *o, int *n) {
    int32_t *t = malloc((size_t)(r->input_tokens > 0 ? r->input_tokens : 1) * sizeof *t);
    if (t == NULL) return NULL;
    int B = o->block_tokens;
    for (int i = 0; i < r->input_tokens; i++) t[i] = block_token(r->blocks[i / B], i % B, o->vocab_lo, o->vocab_hi);
    *n = r->input_tokens;
    return t;
}

/* Text prompts: one word per token, from a fixed list, so a prefix of ids
 * is a prefix of text (tokenizers see the same bytes up to the divergence). */
static const char *const g_words[64] = {
    "apple", "river", "stone", "cloud", "green", "table", "light", "sound", "paper", "glass", "house", "field",
    "water", "night", "bread", "chair", "music", "train", "plant", "storm", "quiet", "metal", "sugar", "smile",
    "ocean", "forest", "window", "garden", "bridge", "silver", "candle", "rocket", "pencil", "island", "butter",
    "winter", "summer", "yellow", "purple", "orange", "button", "rabbit", "dragon", "castle", "planet", "mirror",
    "shadow", "thunder", "blanket", "lantern", "harbor", "meadow", "canyon", "pepper", "violin", "marble",
    "feather", "compass", "tunnel", "saddle", "cotton", "engine", "ladder", "kettle"};

char *bench_prompt_text(const bench_req *r, const bench_opts *o) {
    size_t cap = (size_t)r->input_tokens * 9 + 1, len = 0;
    char *s = malloc(cap);
    if (s == NULL) return NULL;
    int B = o->block_tokens;
    for (int i = 0; i < r->input_tokens; i++) {
        const char *w = g_words[block_token(r->blocks[i / B], i % B, 0, 64)];
        len += (size_t)snprintf(s + len, cap - len, "%s%s", i ? " " : "", w);
    }
    s[len] = 0;
    return s;
}

/* ---- loading ---- */

static int fail(char *err, size_t cap, const char *fmt, const char *path, int line, const char *what) {
    snprintf(err, cap, fmt, path, line, what);
    return -1;
}

static int add_req(bench_workload *w, int *cap) {
    if (w->n == *cap) {
        int nc = *cap ? *cap * 2 : 256;
        bench_req *p = realloc(w->reqs, (size_t)nc * sizeof *p);
        if (p == NULL) return -1;
        w->reqs = p;
        *cap = nc;
    }
    memset(&w->reqs[w->n], 0, sizeof w->reqs[0]);
    w->reqs[w->n].ideal_cached = w->reqs[w->n].lru_cached = -1;
    w->reqs[w->n].prompt_tokens = w->reqs[w->n].cached_tokens = -1;
    w->reqs[w->n].ttft_s = w->reqs[w->n].total_s = -1;
    return w->n++;
}

static int scale_output(long out_len, const bench_opts *o) {
    long m = out_len * o->block_tokens / MOONCAKE_BLOCK;
    if (m < 1) m = 1;
    if (o->max_output > 0 && m > o->max_output) m = o->max_output;
    return (int)m;
}

static int load_mooncake_line(bench_workload *w, int *cap, const cJSON *j, const bench_opts *o, const char *path,
                              int line, char *err, size_t ecap) {
    const cJSON *ts = cJSON_GetObjectItem(j, "timestamp"), *in = cJSON_GetObjectItem(j, "input_length"),
                *out = cJSON_GetObjectItem(j, "output_length"), *ids = cJSON_GetObjectItem(j, "hash_ids");
    if (!cJSON_IsNumber(in) || in->valuedouble < 1)
        return fail(err, ecap, "%s:%d: %s", path, line, "input_length must be a positive number");
    if (!cJSON_IsNumber(out) || out->valuedouble < 0)
        return fail(err, ecap, "%s:%d: %s", path, line, "output_length must be a number >= 0");
    if (!cJSON_IsArray(ids) || cJSON_GetArraySize(ids) == 0)
        return fail(err, ecap, "%s:%d: %s", path, line, "hash_ids must be a non-empty array of integers");
    long in_len = (long)in->valuedouble;
    int n_ids = cJSON_GetArraySize(ids);
    if ((in_len + MOONCAKE_BLOCK - 1) / MOONCAKE_BLOCK != n_ids)
        return fail(err, ecap, "%s:%d: %s", path, line,
                    "hash_ids must have one id per 512-token block of input_length");
    int k = add_req(w, cap);
    if (k < 0) return fail(err, ecap, "%s:%d: %s", path, line, "out of memory");
    bench_req *r = &w->reqs[k];
    r->t_s = cJSON_IsNumber(ts) ? ts->valuedouble / 1000.0 : 0;
    r->session = -1;
    r->turn = k;
    r->blocks = malloc((size_t)n_ids * sizeof *r->blocks);
    if (r->blocks == NULL) return fail(err, ecap, "%s:%d: %s", path, line, "out of memory");
    const cJSON *v;
    int i = 0;
    cJSON_ArrayForEach(v, ids) {
        if (!cJSON_IsNumber(v)) return fail(err, ecap, "%s:%d: %s", path, line, "hash_ids must hold integers");
        r->blocks[i++] = (int64_t)v->valuedouble;
    }
    r->n_blocks = n_ids;
    long full = in_len / MOONCAKE_BLOCK, rem = in_len % MOONCAKE_BLOCK;
    r->input_tokens = (int)(full * o->block_tokens + (rem * o->block_tokens + MOONCAKE_BLOCK - 1) / MOONCAKE_BLOCK);
    r->max_tokens = scale_output((long)out->valuedouble, o);
    return 0;
}

static int load_session_line(bench_workload *w, int *cap, cJSON *j, const bench_opts *o, const char *path, int line,
                             char *err, size_t ecap) {
    const cJSON *turns = cJSON_GetObjectItem(j, "turns"), *sys = cJSON_GetObjectItem(j, "system"),
                *t = cJSON_GetObjectItem(j, "t");
    if (!cJSON_IsArray(turns) || cJSON_GetArraySize(turns) == 0)
        return fail(err, ecap, "%s:%d: %s", path, line, "a session needs a non-empty \"turns\" array");
    if (sys && !cJSON_IsString(sys) && !cJSON_IsNull(sys))
        return fail(err, ecap, "%s:%d: %s", path, line, "\"system\" must be a string");
    const cJSON *turn;
    int k = 0, s = w->n_sessions;
    cJSON_ArrayForEach(turn, turns) {
        const cJSON *role = cJSON_GetObjectItem(turn, "role"), *content = cJSON_GetObjectItem(turn, "content"),
                    *mt = cJSON_GetObjectItem(turn, "max_tokens");
        if (!cJSON_IsString(content))
            return fail(err, ecap, "%s:%d: %s", path, line, "every turn needs a string \"content\"");
        if (role && (!cJSON_IsString(role) ||
                     (strcmp(role->valuestring, "user") != 0 && strcmp(role->valuestring, "tool") != 0)))
            return fail(err, ecap, "%s:%d: %s", path, line, "a turn's role is \"user\" or \"tool\"");
        int idx = add_req(w, cap);
        if (idx < 0) return fail(err, ecap, "%s:%d: %s", path, line, "out of memory");
        bench_req *r = &w->reqs[idx];
        r->session = s;
        r->turn = k++;
        r->t_s = cJSON_IsNumber(t) ? t->valuedouble / 1000.0 : 0;
        int m = cJSON_IsNumber(mt) && mt->valuedouble >= 1 ? (int)mt->valuedouble : 64;
        if (o->max_output > 0 && m > o->max_output) m = o->max_output;
        r->max_tokens = m;
    }
    cJSON_AddItemToArray(w->sessions, cJSON_Duplicate(j, true));
    w->n_sessions++;
    return 0;
}

int bench_load(const char *path, const bench_opts *o, bench_workload *w, char *err, size_t cap) {
    memset(w, 0, sizeof *w);
    w->block_tokens = o->block_tokens;
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        snprintf(err, cap, "cannot open the trace %s", path);
        return -1;
    }
    char *line = NULL;
    size_t lcap = 0;
    int lineno = 0, rcap = 0, rc = 0;
    bool decided = false;
    while (getline(&line, &lcap, f) >= 0) {
        lineno++;
        char *p = line;
        while (*p == ' ' || *p == '\t') p++;
        if (*p == '\n' || *p == 0 || *p == '#') continue;
        cJSON *j = cJSON_Parse(p);
        if (!cJSON_IsObject(j)) {
            cJSON_Delete(j);
            rc = fail(err, cap, "%s:%d: %s", path, lineno, "not a JSON object");
            break;
        }
        if (!decided) {
            w->kind = cJSON_GetObjectItem(j, "turns") ? BENCH_SESSIONS : BENCH_MOONCAKE;
            if (w->kind == BENCH_SESSIONS) w->sessions = cJSON_CreateArray();
            decided = true;
        }
        rc = w->kind == BENCH_MOONCAKE ? load_mooncake_line(w, &rcap, j, o, path, lineno, err, cap)
                                       : load_session_line(w, &rcap, j, o, path, lineno, err, cap);
        cJSON_Delete(j);
        if (rc < 0) break;
        if (o->limit > 0 && w->kind == BENCH_MOONCAKE && w->n >= o->limit) break;
        if (o->limit > 0 && w->kind == BENCH_SESSIONS && w->n >= o->limit) break;
    }
    free(line);
    fclose(f);
    if (rc == 0 && w->n == 0) rc = fail(err, cap, "%s:%d: %s", path, lineno, "the trace holds no requests");
    if (rc == 0 && w->kind == BENCH_SESSIONS) {
        w->session_first = malloc((size_t)w->n_sessions * sizeof(int));
        if (w->session_first == NULL) rc = fail(err, cap, "%s:%d: %s", path, lineno, "out of memory");
        for (int i = 0; rc == 0 && i < w->n; i++)
            if (w->reqs[i].turn == 0) w->session_first[w->reqs[i].session] = i;
    }
    /* trace time starts at the first request */
    if (rc == 0) {
        double t0 = w->reqs[0].t_s;
        for (int i = 0; i < w->n; i++) t0 = w->reqs[i].t_s < t0 ? w->reqs[i].t_s : t0;
        for (int i = 0; i < w->n; i++) w->reqs[i].t_s -= t0;
    }
    if (rc < 0) bench_workload_free(w);
    return rc;
}

void bench_workload_free(bench_workload *w) {
    for (int i = 0; i < w->n; i++) {
        free(w->reqs[i].blocks);
        free(w->reqs[i].reply);
    }
    free(w->reqs);
    free(w->session_first);
    cJSON_Delete(w->sessions);
    memset(w, 0, sizeof *w);
}

/* ---- ideal hit rates ---- */

/* An LRU set of ids: open addressing (linear probing with backward-shift
 * deletion) over a doubly linked recency list. cap 0: unbounded. */
typedef struct lru {
    int64_t *keys;
    int32_t *slot_node;       /* node index per table slot, -1 empty */
    int64_t *node_key;
    int32_t *prev, *next;
    int32_t head, tail, n, cap_nodes, free_top;
    int32_t *free_list;
    size_t mask;
    int64_t limit;            /* 0: unbounded */
} lru;

static size_t lru_hash(int64_t k) { return (size_t)splitmix64((uint64_t)k); }

static int lru_init(lru *l, int64_t limit, int64_t expect) {
    memset(l, 0, sizeof *l);
    l->limit = limit;
    int64_t nodes = limit > 0 ? limit : expect;
    if (nodes < 16) nodes = 16;
    size_t slots = 32;
    while (slots < (size_t)nodes * 2) slots <<= 1;
    l->mask = slots - 1;
    l->keys = malloc(slots * sizeof *l->keys);
    l->slot_node = malloc(slots * sizeof *l->slot_node);
    l->cap_nodes = (int32_t)nodes;
    l->node_key = malloc((size_t)nodes * sizeof *l->node_key);
    l->prev = malloc((size_t)nodes * sizeof *l->prev);
    l->next = malloc((size_t)nodes * sizeof *l->next);
    l->free_list = malloc((size_t)nodes * sizeof *l->free_list);
    if (!l->keys || !l->slot_node || !l->node_key || !l->prev || !l->next || !l->free_list) return -1;
    for (size_t i = 0; i < slots; i++) l->slot_node[i] = -1;
    for (int32_t i = 0; i < l->cap_nodes; i++) l->free_list[i] = l->cap_nodes - 1 - i;
    l->free_top = l->cap_nodes;
    l->head = l->tail = -1;
    return 0;
}

static void lru_free(lru *l) {
    free(l->keys);
    free(l->slot_node);
    free(l->node_key);
    free(l->prev);
    free(l->next);
    free(l->free_list);
}

static size_t lru_find(const lru *l, int64_t k) {
    size_t i = lru_hash(k) & l->mask;
    while (l->slot_node[i] >= 0 && l->keys[i] != k) i = (i + 1) & l->mask;
    return i;
}

static void list_unlink(lru *l, int32_t x) {
    if (l->prev[x] >= 0) l->next[l->prev[x]] = l->next[x];
    else l->head = l->next[x];
    if (l->next[x] >= 0) l->prev[l->next[x]] = l->prev[x];
    else l->tail = l->prev[x];
}

static void list_push_front(lru *l, int32_t x) {
    l->prev[x] = -1;
    l->next[x] = l->head;
    if (l->head >= 0) l->prev[l->head] = x;
    l->head = x;
    if (l->tail < 0) l->tail = x;
}

static void lru_remove_slot(lru *l, size_t i) {
    l->slot_node[i] = -1;
    size_t j = i;
    for (;;) {
        j = (j + 1) & l->mask;
        if (l->slot_node[j] < 0) return;
        size_t home = lru_hash(l->keys[j]) & l->mask;
        /* move j back to i when its home is not in (i, j] */
        bool between = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!between) {
            l->keys[i] = l->keys[j];
            l->slot_node[i] = l->slot_node[j];
            l->slot_node[j] = -1;
            i = j;
        }
    }
}

static bool lru_has(const lru *l, int64_t k) { return l->slot_node[lru_find(l, k)] >= 0; }

static int lru_grow(lru *l);

/* Inserts or refreshes k as most recent, evicting the least recent. */
static int lru_touch(lru *l, int64_t k) {
    size_t i = lru_find(l, k);
    if (l->slot_node[i] >= 0) {
        int32_t x = l->slot_node[i];
        list_unlink(l, x);
        list_push_front(l, x);
        return 0;
    }
    if (l->limit > 0 && l->n >= l->limit) {
        int32_t old = l->tail;
        list_unlink(l, old);
        lru_remove_slot(l, lru_find(l, l->node_key[old]));
        l->free_list[l->free_top++] = old;
        l->n--;
        i = lru_find(l, k);
    }
    if (l->free_top == 0) {
        if (lru_grow(l) < 0) return -1;
        i = lru_find(l, k);
    }
    int32_t x = l->free_list[--l->free_top];
    l->node_key[x] = k;
    l->keys[i] = k;
    l->slot_node[i] = x;
    list_push_front(l, x);
    l->n++;
    return 0;
}

/* Unbounded sets outgrow their first guess: rebuild twice as large. */
static int lru_grow(lru *l) {
    lru bigger;
    if (lru_init(&bigger, 0, (int64_t)l->cap_nodes * 2) < 0) return -1;
    for (int32_t x = l->tail; x >= 0; x = l->prev[x])
        if (lru_touch(&bigger, l->node_key[x]) < 0) return -1;
    bigger.limit = l->limit;
    lru_free(l);
    *l = bigger;
    return 0;
}

static int64_t hit_tokens(const bench_req *r, int lead, int B) {
    int64_t t = (int64_t)lead * B;
    if (t > r->input_tokens) t = r->input_tokens;
    if (t > r->input_tokens - 1) t = r->input_tokens - 1;
    return t < 0 ? 0 : t;
}

void bench_ideal(bench_workload *w, int64_t capacity_tokens) {
    if (w->kind != BENCH_MOONCAKE) return;
    int64_t total_blocks = 0;
    for (int i = 0; i < w->n; i++) total_blocks += w->reqs[i].n_blocks;
    lru all, bounded;
    int64_t cap_blocks = capacity_tokens > 0 ? capacity_tokens / w->block_tokens : 0;
    if (lru_init(&all, 0, total_blocks) < 0) return;
    bool with_lru = cap_blocks > 0 && lru_init(&bounded, cap_blocks, cap_blocks) == 0;
    for (int i = 0; i < w->n; i++) {
        bench_req *r = &w->reqs[i];
        int lead = 0;
        while (lead < r->n_blocks && lru_has(&all, r->blocks[lead])) lead++;
        r->ideal_cached = hit_tokens(r, lead, w->block_tokens);
        for (int b = 0; b < r->n_blocks; b++) lru_touch(&all, r->blocks[b]);
        if (with_lru) {
            lead = 0;
            while (lead < r->n_blocks && lru_has(&bounded, r->blocks[lead])) lead++;
            r->lru_cached = hit_tokens(r, lead, w->block_tokens);
            for (int b = 0; b < r->n_blocks; b++) lru_touch(&bounded, r->blocks[b]);
        }
    }
    lru_free(&all);
    if (with_lru) lru_free(&bounded);
}

int bench_skip(bench_workload *w, int k, char *err, size_t cap) {
    if (w->kind != BENCH_MOONCAKE) {
        snprintf(err, cap, "--from: only for Mooncake traces (a session's turns carry the replies before them)");
        return -1;
    }
    if (k >= w->n) {
        snprintf(err, cap, "--from %d: the trace has %d requests", k, w->n);
        return -1;
    }
    for (int i = 0; i < k; i++) free(w->reqs[i].blocks);
    memmove(w->reqs, w->reqs + k, (size_t)(w->n - k) * sizeof *w->reqs);
    w->n -= k;
    double t0 = w->reqs[0].t_s;
    for (int i = 0; i < w->n; i++) w->reqs[i].t_s -= t0;
    return 0;
}

/* ---- the generator ---- */

static double uniform(uint64_t *s) {
    *s = splitmix64(*s);
    return (double)(*s >> 11) / 9007199254740992.0;
}

enum { GEN_OUT, GEN_FORMAT, GEN_REQUESTS, GEN_AGENTS, GEN_GROUPS, GEN_SYS, GEN_TURN, GEN_TURNS, GEN_RATE, GEN_OUTLEN, GEN_SEED };

static const char *gen_formats(void) { return "mooncake, sessions"; }

static const cli_option gen_options[] = {
    {GEN_OUT, "--out", NULL, "FILE", "the workload to write (required)", NULL},
    {GEN_FORMAT, "--format", NULL, "F", "mooncake (default) or sessions", gen_formats},
    {GEN_REQUESTS, "--requests", NULL, "N", "requests (sessions: turns) in all (default 200)", NULL},
    {GEN_AGENTS, "--agents", NULL, "A", "concurrent sessions (default 8)", NULL},
    {GEN_GROUPS, "--groups", NULL, "G", "groups of agents sharing a system prompt (default 2)", NULL},
    {GEN_SYS, "--system-blocks", NULL, "S", "system prompt length in 512-token blocks (default 4)", NULL},
    {GEN_TURN, "--turn-blocks", NULL, "T", "at most T new blocks per turn (default 2)", NULL},
    {GEN_TURNS, "--turns", NULL, "K", "at most K turns per session (default 8)", NULL},
    {GEN_RATE, "--rate", NULL, "R", "Poisson arrivals, requests per second (default 4)", NULL},
    {GEN_OUTLEN, "--output-length", NULL, "L", "output lengths drawn around L tokens (default 128)", NULL},
    {GEN_SEED, "--seed", NULL, "S", "random seed (default 1)", NULL},
    {0, NULL, NULL, NULL, NULL, NULL},
};

const cli_command bench_gen_command = {
    "bench gen", bench_gen, "--out FILE [options]", "write a synthetic agent workload for ember bench",
    "A agents run sessions of up to K turns, each in one of G groups sharing a system prompt of S blocks, "
    "with 1..T new blocks per turn, arriving as a Poisson process of R requests/s. mooncake: one JSONL "
    "request per line with hash_ids (a turn's last, partial block changes when the next turn extends it); "
    "sessions: one session per line, every third turn a tool result (a tool loop).",
    gen_options, false, true,
};

static void gen_words(FILE *f, uint64_t *rng, int n) {
    for (int i = 0; i < n; i++) fprintf(f, "%s%s", i ? " " : "", g_words[(int)(uniform(rng) * 64) & 63]);
}

int bench_gen(int argc, char **argv) {
    const char *out = NULL, *format = "mooncake";
    long requests = 200, agents = 8, groups = 2, sys_blocks = 4, turn_blocks = 2, turns = 8, out_len = 128;
    double rate = 4.0;
    long long seed = 1;
    cli_args args;
    cli_args_init(&args, &bench_gen_command, argc, argv);
    for (int id; (id = cli_next(&args)) != CLI_END;) {
        const char *a = args.opt, *v = args.value;
        switch (id) {
        case GEN_OUT: out = v; break;
        case GEN_FORMAT: format = v; break;
        case GEN_REQUESTS: requests = cli_parse_long(a, v, 1, 100000000); break;
        case GEN_AGENTS: agents = cli_parse_long(a, v, 1, 1000000); break;
        case GEN_GROUPS: groups = cli_parse_long(a, v, 1, 1000000); break;
        case GEN_SYS: sys_blocks = cli_parse_long(a, v, 0, 10000); break;
        case GEN_TURN: turn_blocks = cli_parse_long(a, v, 1, 10000); break;
        case GEN_TURNS: turns = cli_parse_long(a, v, 1, 100000); break;
        case GEN_RATE: rate = cli_parse_double(a, v); break;
        case GEN_OUTLEN: out_len = cli_parse_long(a, v, 1, 1 << 20); break;
        case GEN_SEED: seed = cli_parse_long(a, v, 0, __LONG_MAX__); break;
        case CLI_ARG: return cli_usage_error(&bench_gen_command, "unexpected argument '%s'", v);
        }
    }
    if (args.status >= 0) return args.status;
    bool sessions = strcmp(format, "sessions") == 0;
    if (out == NULL) return cli_usage_error(&bench_gen_command, "--out FILE is required");
    if (!sessions && strcmp(format, "mooncake") != 0)
        return cli_usage_error(&bench_gen_command, "--format: '%s' is neither mooncake nor sessions", format);
    if (!(rate > 0)) return cli_usage_error(&bench_gen_command, "--rate must be above 0");
    FILE *f = fopen(out, "w");
    if (f == NULL) {
        fprintf(stderr, "ember: cannot write %s\n", out);
        return 1;
    }
    uint64_t rng = (uint64_t)seed * 0x9E3779B97F4A7C15ULL + 1;
    double t_ms = 0;
    if (sessions) {
        /* one line per session; requests counts turns */
        long emitted = 0, sid = 0;
        while (emitted < requests) {
            long k = 1 + (long)(uniform(&rng) * (double)turns);
            if (k > requests - emitted) k = requests - emitted;
            long g = (long)(uniform(&rng) * (double)groups);
            uint64_t grng = (uint64_t)(g + 1) * 0xD1B54A32D192ED03ULL;
            fprintf(f, "{\"id\":\"s%ld\",\"t\":%.1f,\"system\":\"You are agent group %ld. ", sid++, t_ms, g);
            gen_words(f, &grng, (int)(sys_blocks * 24));
            fprintf(f, "\",\"turns\":[");
            for (long j = 0; j < k; j++) {
                bool tool = j % 3 == 2;
                fprintf(f, "%s{\"role\":\"%s\",\"content\":\"", j ? "," : "", tool ? "tool" : "user");
                gen_words(f, &rng, 8 + (int)(uniform(&rng) * (double)(turn_blocks * 24)));
                fprintf(f, "\",\"max_tokens\":%ld}", out_len / 2 + (long)(uniform(&rng) * (double)out_len));
            }
            fprintf(f, "]}\n");
            emitted += k;
            t_ms += -log(1.0 - uniform(&rng)) / rate * 1000.0 * (double)k;
        }
    } else {
        typedef struct slot { int64_t *ids; int n, cap, left; bool partial; } slot;
        slot *slots = calloc((size_t)agents, sizeof *slots);
        int64_t next_id = 1;
        int64_t *group_ids = malloc((size_t)(groups * sys_blocks + 1) * sizeof *group_ids);
        if (slots == NULL || group_ids == NULL) {
            fclose(f);
            free(slots);
            free(group_ids);
            fprintf(stderr, "ember: out of memory\n");
            return 1;
        }
        for (long i = 0; i < groups * sys_blocks; i++) group_ids[i] = next_id++;
        for (long r = 0; r < requests; r++) {
            slot *s = &slots[(long)(uniform(&rng) * (double)agents) % agents];
            if (s->left == 0) {
                long g = (long)(uniform(&rng) * (double)groups) % groups;
                s->n = 0;
                s->partial = false;
                s->left = 1 + (int)(uniform(&rng) * (double)turns);
                for (long b = 0; b < sys_blocks; b++) {
                    if (s->n == s->cap) s->ids = realloc(s->ids, (size_t)(s->cap = s->cap * 2 + 16) * sizeof *s->ids);
                    s->ids[s->n++] = group_ids[g * sys_blocks + b];
                }
            }
            /* the last block was partial: the reply and the new turn extend it, so it changes */
            if (s->partial) s->n--;
            long add = 1 + (long)(uniform(&rng) * (double)turn_blocks);
            for (long b = 0; b < add; b++) {
                if (s->n == s->cap) s->ids = realloc(s->ids, (size_t)(s->cap = s->cap * 2 + 16) * sizeof *s->ids);
                s->ids[s->n++] = next_id++;
            }
            s->partial = true;
            s->left--;
            long in_len = (long)s->n * MOONCAKE_BLOCK - (long)(uniform(&rng) * 256);
            fprintf(f, "{\"timestamp\":%.0f,\"input_length\":%ld,\"output_length\":%ld,\"hash_ids\":[", t_ms, in_len,
                    out_len / 2 + (long)(uniform(&rng) * (double)out_len));
            for (int b = 0; b < s->n; b++) fprintf(f, "%s%lld", b ? "," : "", (long long)s->ids[b]);
            fprintf(f, "]}\n");
            t_ms += -log(1.0 - uniform(&rng)) / rate * 1000.0;
        }
        for (long i = 0; i < agents; i++) free(slots[i].ids);
        free(slots);
        free(group_ids);
    }
    int bad = ferror(f);
    bad |= fclose(f);
    if (bad) {
        fprintf(stderr, "ember: cannot write %s\n", out);
        return 1;
    }
    fprintf(stderr, "ember: wrote %s (%s, %ld requests)\n", out, format, requests);
    return 0;
}
