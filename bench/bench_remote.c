/* bench_remote.c - the remote tier (Redis): a replica's TTFT from another
 * replica's KV vs cold prefill, and the hit rate of replicas sharing a
 * Redis vs one replica.
 *
 * Usage: bench_remote MODEL [--threads N] [--sizes 4096,16384] [--redis URL]
 *                           [--trace-model PATH] [--users 8] [--turns 4]
 *
 * Without --redis the bench starts its own redis-server on a unix socket in
 * a temporary directory (no persistence, no memory cap) and kills it at the
 * end. The cache.remote.* switches come from the APC_REMOTE_* variables
 * (serve_settings_apply_env_cache); the bench sets max_wait_ms to 60000
 * and the write queue to 16 GiB unless they are set, so that a 16k-token
 * chain is neither cut by the default read ceiling nor dropped.
 *
 * TTFT, for each prompt length P (random token ids, one generated token):
 *   cold    replica A, empty: full prefill; its stores go to Redis (the
 *           writes are flushed, then A is freed);
 *   remote  replica B, a new engine (empty pool), first serves a short
 *           unrelated prompt cold (so it has measured its prefill speed,
 *           from which the read deadline is derived), then the identical
 *           request: P-1 tokens come from Redis, one is forwarded.
 * Reported: both TTFTs and their ratio, the bytes fetched, the effective
 * fetch bandwidth (bytes over B's time in the cache), and whether B's
 * token and logits equal A's (they must).
 *
 * Trace (--trace-model): U users, each a conversation of T turns (a system
 * prompt shared by every user, then per turn a new message of 48-112
 * random tokens and 16 generated ones), replayed turn by turn across users
 * once on a single replica (no remote tier) and once on two replicas
 * sharing Redis with
 * each request sent to a random replica (no cache-aware routing); each
 * replica's writes land before the next request (a user's think time).
 * Reported: cached prompt tokens / prompt tokens for both, and their
 * ratio (the target: >= 90%). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/clock.h"
#include "core/log.h"
#include "engine/engine.h"
#include "serve/serve_settings.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static char redis_dir[] = "/var/tmp/ember-bench-remote-XXXXXX";
static pid_t redis_pid;

/* A redis-server of our own; its URL, or NULL. */
static const char *start_redis(char *url, size_t cap) {
    if (mkdtemp(redis_dir) == NULL) return NULL;
    char sock[200];
    snprintf(sock, sizeof sock, "%s/redis.sock", redis_dir);
    snprintf(url, cap, "unix://%s", sock);
    redis_pid = fork();
    if (redis_pid < 0) return NULL;
    if (redis_pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        if (freopen("/dev/null", "w", stdout) == NULL) _exit(126);
        execlp("redis-server", "redis-server", "--port", "0", "--unixsocket", sock, "--save", "", "--appendonly", "no",
               "--dir", redis_dir, (char *)NULL);
        _exit(127);
    }
    for (int i = 0; i < 100; i++) {
        if (access(sock, F_OK) == 0) return url;
        usleep(50 * 1000);
    }
    return NULL;
}

static void stop_redis(void) {
    if (redis_pid > 0) {
        kill(redis_pid, SIGKILL);
        waitpid(redis_pid, NULL, 0);
        redis_pid = 0;
        char cmd[200];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", redis_dir);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", redis_dir);
    }
}

static engine *open_replica(const model *m, int threads, const char *url, int n_ctx) {
    engine_config cfg = engine_default_config();
    ember_error err;
    cfg.cache.remote.max_wait_ms = 60000;
    cfg.cache.remote.queue_bytes = (size_t)16 << 30;
    /* The APC_* switches win over the bench's own choices above. */
    if (serve_settings_apply_env_cache(&cfg.cache, &err) < 0) {
        fprintf(stderr, "bench_remote: %s\n", err.msg);
        return NULL;
    }
    cfg.n_threads = threads;
    cfg.n_ctx = n_ctx;
    cfg.num_blocks = (int32_t)(n_ctx / KV_BLOCK_TOKENS + 16);
    cfg.cache.remote.url = url;
    engine *e = engine_create(m, &cfg, &err);
    if (e == NULL) fprintf(stderr, "engine_create: %s\n", err.msg);
    return e;
}

static int generate(engine *e, const int32_t *prompt, int64_t n, int max_tokens, engine_result *r) {
    engine_request q = engine_default_request();
    q.prompt = prompt;
    q.n_prompt = n;
    q.max_tokens = max_tokens;
    q.stop_at_eog = false;
    q.want_logits = true;
    ember_error err;
    if (engine_generate(e, &q, r, &err) < 0) {
        fprintf(stderr, "engine_generate: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static int bench_ttft(const model *m, int threads, const char *url, const char *sizes) {
    int V = model_get_hparams(m)->n_vocab;
    kv_pool_config kc;
    model_kv_config(m, 1, &kc);
    size_t row = 0;
    for (int l = 0; l < kc.n_layer; l++) row += (size_t)kc.k_width[l] + (size_t)kc.v_width[l];
    printf("%-7s %10s %10s %8s %10s %10s %9s %s\n", "tokens", "cold_ttft", "redis_ttft", "ratio", "fetched", "fetch_GB/s",
           "identical", "(B: cached, remote_hits, timeouts, corrupt)");
    for (const char *s = sizes; *s;) {
        int64_t n = strtoll(s, NULL, 10);
        const char *comma = strchr(s, ',');
        s = comma ? comma + 1 : s + strlen(s);
        if (n < 2) continue;
        int32_t *prompt = malloc((size_t)n * sizeof(int32_t));
        for (int64_t i = 0; i < n; i++) prompt[i] = (int32_t)(rnd() % (uint32_t)V);
        int n_ctx = (int)n + 64;
        engine *a = open_replica(m, threads, url, n_ctx);
        if (a == NULL) return 1;
        engine_result cold, warm, calib;
        if (generate(a, prompt, n, 1, &cold) < 0) return 1;
        apc_flush(engine_cache(a));
        engine_free(a);

        engine *b = open_replica(m, threads, url, n_ctx);
        if (b == NULL) return 1;
        int32_t other[512];
        for (int i = 0; i < 512; i++) other[i] = (int32_t)(rnd() % (uint32_t)V);
        if (generate(b, other, 512, 1, &calib) < 0) return 1; /* B measures its prefill speed */
        apc_flush(engine_cache(b));
        apc_stats before, after;
        apc_get_stats(engine_cache(b), &before);
        if (generate(b, prompt, n, 1, &warm) < 0) return 1;
        apc_get_stats(engine_cache(b), &after);
        bool same = warm.n_tokens == cold.n_tokens &&
                    memcmp(warm.tokens, cold.tokens, (size_t)cold.n_tokens * sizeof(int32_t)) == 0 &&
                    memcmp(warm.logits, cold.logits, (size_t)cold.n_tokens * (size_t)V * sizeof(float)) == 0;
        double fetched = (double)warm.cached_tokens * (double)row * sizeof(float);
        printf("%-7lld %9.3fs %9.3fs %7.1fx %8.1fMB %10.2f %9s (%lld, %llu, %llu, %llu)\n", (long long)n, cold.ttft_s,
               warm.ttft_s, warm.ttft_s > 0 ? cold.ttft_s / warm.ttft_s : 0, fetched / 1e6,
               warm.cache_s > 0 ? fetched / warm.cache_s / 1e9 : 0, same ? "yes" : "NO", (long long)warm.cached_tokens,
               (unsigned long long)(after.remote_hits - before.remote_hits),
               (unsigned long long)(after.remote_timeouts - before.remote_timeouts),
               (unsigned long long)(after.remote_corrupt - before.remote_corrupt));
        fflush(stdout);
        engine_free(b);
        engine_result_free(&cold);
        engine_result_free(&warm);
        engine_result_free(&calib);
        free(prompt);
        if (!same) return 1;
    }
    return 0;
}

/* ---- the multi-user trace ---- */

typedef struct conv {
    int32_t *tok;
    int64_t n;
} conv;

/* Replays the trace on n_rep replicas (a random one per request);
 * returns cached / prompt tokens. */
static double replay(const model *m, int threads, const char *url, int n_rep, int users, int turns, uint64_t seed) {
    int V = model_get_hparams(m)->n_vocab;
    int n_ctx = 256 + turns * (112 + 17) + 64;
    engine *rep[2] = {NULL, NULL};
    for (int r = 0; r < n_rep; r++) {
        rep[r] = open_replica(m, threads, url, n_ctx * users);
        if (rep[r] == NULL) return -1;
    }
    rng = seed;
    int32_t sys[256];
    for (int i = 0; i < 256; i++) sys[i] = (int32_t)(rnd() % (uint32_t)V);
    conv *cv = calloc((size_t)users, sizeof *cv);
    for (int u = 0; u < users; u++) {
        cv[u].tok = malloc((size_t)n_ctx * sizeof(int32_t));
        memcpy(cv[u].tok, sys, sizeof sys);
        cv[u].n = 256;
    }
    uint64_t route = seed ^ 0x5bd1e995u;
    int64_t cached = 0, total = 0;
    for (int t = 0; t < turns; t++)
        for (int u = 0; u < users; u++) {
            int msg = 48 + (int)(rnd() % 65);
            for (int i = 0; i < msg; i++) cv[u].tok[cv[u].n++] = (int32_t)(rnd() % (uint32_t)V);
            route ^= route << 13;
            route ^= route >> 7;
            route ^= route << 17;
            engine *e = rep[n_rep > 1 ? (int)(route % (uint64_t)n_rep) : 0];
            engine_result r;
            if (generate(e, cv[u].tok, cv[u].n, 16, &r) < 0) return -1;
            cached += r.cached_tokens;
            total += cv[u].n;
            for (int i = 0; i < r.n_tokens; i++) cv[u].tok[cv[u].n++] = r.tokens[i];
            engine_result_free(&r);
            apc_flush(engine_cache(e)); /* the user's think time: the writes land */
        }
    for (int u = 0; u < users; u++) free(cv[u].tok);
    free(cv);
    for (int r = 0; r < n_rep; r++) engine_free(rep[r]);
    return total > 0 ? (double)cached / (double)total : 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_remote MODEL [--threads N] [--sizes 4096,16384] [--redis URL] "
                        "[--trace-model PATH] [--users 8] [--turns 4]\n");
        return 2;
    }
    const char *path = argv[1];
    int threads = 0, users = 8, turns = 4;
    const char *sizes = "4096,16384";
    const char *url = NULL, *trace_model = NULL;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--threads") == 0) threads = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--sizes") == 0) sizes = argv[i + 1];
        else if (strcmp(argv[i], "--redis") == 0) url = argv[i + 1];
        else if (strcmp(argv[i], "--trace-model") == 0) trace_model = argv[i + 1];
        else if (strcmp(argv[i], "--users") == 0) users = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--turns") == 0) turns = atoi(argv[i + 1]);
    }
    char own[300];
    if (url == NULL && (url = start_redis(own, sizeof own)) == NULL) {
        fprintf(stderr, "bench_remote: could not start redis-server (scripts/install-deps.sh installs it)\n");
        return 1;
    }
    ember_log_set_level(EMBER_LOG_WARN);
    ember_error err;
    int rc = 0;
    if (sizes[0]) {
        model *m = model_load(path, &err);
        if (m == NULL) {
            fprintf(stderr, "%s\n", err.msg);
            stop_redis();
            return 1;
        }
        printf("TTFT, cold vs from Redis (%s)\n", path);
        rc = bench_ttft(m, threads, url, sizes);
        model_free(m);
    }
    if (rc == 0 && trace_model) {
        model *m = model_load(trace_model, &err);
        if (m == NULL) {
            fprintf(stderr, "%s\n", err.msg);
            stop_redis();
            return 1;
        }
        if (users < 1) users = 1;
        if (turns < 1) turns = 1;
        /* The single replica has no remote tier, so the two replicas
         * replay the same trace against an empty Redis. */
        double one = replay(m, threads, NULL, 1, users, turns, 0x1234567u);
        double two = replay(m, threads, url, 2, users, turns, 0x1234567u);
        printf("\ntrace (%s, %d users x %d turns): hit rate single replica %.3f, two replicas via Redis %.3f: "
               "%.1f%% of single\n",
               trace_model, users, turns, one, two, one > 0 ? 100.0 * two / one : 0);
        model_free(m);
    }
    stop_redis();
    return rc;
}
