/* bench.h - `ember bench`: replay a request trace against any
 * OpenAI-compatible server and measure what its prompt cache saves.
 *
 * Contract:
 *  - Workloads (cmd_bench_trace.c). A Mooncake trace is JSONL with
 *    timestamp (ms), input_length, output_length and hash_ids, one id per
 *    512-token block of the prompt, equal ids meaning equal prefixes. The
 *    replay scales blocks to block_tokens tokens and makes every block's
 *    content a function of its id, so equal ids give equal token prefixes:
 *    prompts go out as token-id arrays to /v1/completions (or, with
 *    text prompts, as words, for servers that take no ids). ember's session
 *    format is JSONL too, one chat session per line ({"id", "system",
 *    "turns": [{"role": "user"|"tool", "content", "max_tokens"}],
 *    "t": start ms}); its turns go to /v1/chat/completions in order, each
 *    carrying the server's previous replies. bench_gen writes synthetic
 *    workloads of both kinds (agents in groups sharing a system prompt,
 *    multi-turn sessions, tool loops).
 *  - Ideal hit rates (Mooncake traces only, where block identity is known):
 *    for every request the tokens of its leading blocks already seen, capped
 *    at N-1 as ember caps them, under an unbounded cache and under an LRU
 *    of capacity_tokens (blocks touched by each request, in trace order).
 *    --from K replays requests K.. with the ideal of the whole trace, so a
 *    run split by a server restart is judged against the same ideal.
 *  - The run (cmd_bench.c): N client threads, as fast as possible or on
 *    the trace's timestamps divided by a speed factor; every request is
 *    streamed (SSE, usage requested) to time its first token. Cached
 *    tokens come from usage.prompt_tokens_details.cached_tokens (ember,
 *    vLLM, OpenAI) or timings.cache_n (llama-server).
 *  - Output (cmd_bench_report.c): requests.csv and requests.jsonl (one row
 *    per request), summary.json, report.html (self-contained, inline SVG:
 *    TTFT over time, hit rate vs ideal, cached tokens per tier, TTFT vs
 *    prompt length), and the summary on stdout. Against ember the summary
 *    also has the server's own counters over the run (/metrics and
 *    /v1/cache/stats before and after). */
#ifndef EMBER_CLI_BENCH_H
#define EMBER_CLI_BENCH_H

#include <stdbool.h>
#include <stdint.h>

#include <cjson/cJSON.h>

typedef enum bench_kind { BENCH_MOONCAKE = 0, BENCH_SESSIONS = 1 } bench_kind;

/* One request of a workload, and after the run, what happened to it. */
typedef struct bench_req {
    /* workload */
    double t_s;               /* scheduled offset from the start (trace time) */
    int session, turn;        /* sessions: which and which turn; Mooncake: -1, index */
    int64_t *blocks;          /* Mooncake: hash ids */
    int n_blocks;
    int input_tokens;         /* Mooncake: scaled prompt length in tokens */
    int max_tokens;
    int64_t ideal_cached, lru_cached; /* Mooncake: ideal cached tokens; -1: not known */
    /* result */
    double start_s, ttft_s, total_s;  /* start offset from the run's start; -1: none */
    int64_t prompt_tokens, cached_tokens; /* -1: the server did not say */
    int completion_tokens;
    int status;               /* HTTP status; 0: no connection */
    char error[160];
    char *reply;              /* sessions: the assistant's text, for the next turn */
} bench_req;

typedef struct bench_workload {
    bench_kind kind;
    bench_req *reqs;
    int n;
    int n_sessions;
    int *session_first;       /* sessions: index of each session's first request (turns are consecutive) */
    cJSON *sessions;          /* sessions: the parsed lines (array) */
    int block_tokens;
} bench_workload;

typedef struct bench_opts {
    const char *trace, *url, *api_key, *model, *out_dir;
    int clients;
    bool timestamps;
    double speed;
    int block_tokens;         /* tokens per trace block (Mooncake 512) */
    int limit;                /* first N requests; 0: all */
    int from;                 /* replay from request K on; the ideal counts 0..K-1 as seen */
    int max_output;           /* cap on max_tokens; 0: none */
    bool text_prompts;        /* words instead of token ids */
    int vocab_lo, vocab_hi;   /* token ids drawn in [lo, hi) */
    int64_t capacity_tokens;  /* LRU capacity for the ideal; 0: the server's pool (ember) or none */
    bool progress;            /* a progress bar on stderr (default: when it is a terminal) */
    const char *title;
} bench_opts;

/* Server counters over the run (ember): deltas of /metrics and /v1/cache/stats. */
typedef struct bench_server {
    bool ember;
    double prompt_tokens, cached_tokens;        /* ember_prompt_tokens_total, ..._cached_... */
    cJSON *stats_before, *stats_after;          /* /v1/cache/stats */
    int64_t pool_capacity_tokens;
} bench_server;

/* ---- Workloads (cmd_bench_trace.c) ---- */
int bench_load(const char *path, const bench_opts *o, bench_workload *w, char *err, size_t cap);
void bench_workload_free(bench_workload *w);
/* The Mooncake prompt of r: token ids (malloc'd, *n) or text (malloc'd). */
int32_t *bench_prompt_tokens(const bench_req *r, const bench_opts *o, int *n);
char *bench_prompt_text(const bench_req *r, const bench_opts *o);
void bench_ideal(bench_workload *w, int64_t capacity_tokens);
/* Drops the first k requests of a Mooncake workload after bench_ideal, so
 * the rest keep the ideal of the whole trace (what a cache that survived
 * the first k could hit) and are replayed alone: the run after a restart. */
int bench_skip(bench_workload *w, int k, char *err, size_t cap);
int bench_gen(int argc, char **argv);
extern const struct cli_command bench_gen_command; /* `ember bench gen`: its options and help */

/* ---- HTTP (cmd_bench_http.c) ---- */
/* POSTs body to url+path with SSE streaming; fills r's timing and usage
 * fields, and r->reply with the generated text. t0: the run's start. */
void bench_http_request(const bench_opts *o, const char *path, const char *body, double t0, bench_req *r);
/* GET url+path; returns the body (malloc'd) or NULL; *status set. */
char *bench_http_get(const bench_opts *o, const char *path, int *status);
double bench_now(void);

/* ---- Report (cmd_bench_report.c) ---- */
int bench_write_outputs(const bench_opts *o, const bench_workload *w, const bench_server *srv, double wall_s,
                        char *err, size_t cap);

#endif
