/* test_remote.c - the remote tier on a real Redis (issue 13, part 1).
 *
 * Each test starts its own redis-server on a unix socket in a temporary
 * directory, without persistence (--save '' --appendonly no), killed at
 * the end (and by PR_SET_PDEATHSIG if the test dies). Two engines on one
 * model file are two replicas: A computes and stores, B (a fresh engine:
 * an empty pool) looks up. Every warm result is compared bit for bit
 * (memcmp of every step's logits) with a cold run of the same request:
 *  - B adopts N-1 of a prompt A computed, the partial tail block included,
 *    and writes none of the blocks A wrote (EXISTS before SET);
 *  - tenants (salts) and formats (hash kind, namespace) never cross;
 *  - a value altered with SETRANGE, or replaced by garbage, is a counted
 *    miss (remote_corrupt), deleted, and the chain stops before it;
 *  - holes (DEL of some keys, as an allkeys-lru eviction leaves them): the
 *    longest verified prefix is adopted; under a real maxmemory with
 *    allkeys-lru every answer stays right and nothing is adopted beyond
 *    what survived;
 *  - redis stopped (SIGSTOP) or killed (SIGKILL) between a request's
 *    EXISTS and its GETs: the request is right, its reads end within the
 *    deadline, the breaker opens after the configured failures and closes
 *    once the server answers again (restarted, for the kill); stopped in
 *    the middle of a chain, the blocks verified by the deadline are kept;
 *  - the exact tier (mamba2, recurrent state): B adopts A's N-1 snapshot,
 *    another tenant nothing, an altered snapshot is a counted miss;
 *  - the checkpoint tier (qwen35): B restores A's skeletons and their
 *    checkpoint-salted chains: N-1 for the resend, for a longer prompt
 *    what A's own memory adopts; another tenant nothing;
 *  - two `ember serve` processes: B's chat completion caches N-1 from
 *    Redis, its logprobs equal A's cold ones, and the remote_* counters
 *    show in /v1/cache/stats and /metrics.
 * And without a server: the URLs the tier accepts, and a bad one named by
 * the config check. stories260K unless said (a llama: block tier). */
#pragma GCC diagnostic ignored "-Wformat-truncation"
#include <cJSON.h>
#include <errno.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "apc/apc.h"
#include "core/clock.h"
#include "engine/engine.h"
#include "model/model.h"
#include "serve/serve_config.h"
#include "serve/serve_metrics.h"
#include "http_client.h"
#include "test_util.h"

#define STORIES "models/stories260K.gguf"
#define N_PROMPT 600 /* 37 full blocks and a tail of 8 */

/* ---- a redis-server of the test's own ---- */

typedef struct redis_srv {
    char *dir;
    char sock[300];
    char url[320];
    pid_t pid;
} redis_srv;

static bool have_redis_server(void) {
    int rc = system("command -v redis-server >/dev/null 2>&1");
    return rc == 0;
}

/* Starts redis-server on dir/redis.sock (extra: more "--name value" args). */
static void redis_start(redis_srv *r, const char *const *extra) {
    if (r->dir == NULL) r->dir = make_temp_dir();
    assert_non_null(r->dir);
    snprintf(r->sock, sizeof r->sock, "%s/redis.sock", r->dir);
    snprintf(r->url, sizeof r->url, "unix://%s", r->sock);
    unlink(r->sock);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        char log[400];
        snprintf(log, sizeof log, "%s/redis.log", r->dir);
        if (freopen(log, "a", stdout) == NULL || freopen(log, "a", stderr) == NULL) _exit(126);
        const char *argv[32] = {"redis-server", "--port", "0", "--unixsocket", r->sock, "--unixsocketperm", "700",
                                "--save", "", "--appendonly", "no", "--dir", r->dir};
        int n = 13;
        for (int i = 0; extra && extra[i] && n < 31; i++) argv[n++] = extra[i];
        argv[n] = NULL;
        execvp("redis-server", (char *const *)argv);
        _exit(127);
    }
    r->pid = pid;
    for (int i = 0; i < 200; i++) {
        struct timeval tv = {1, 0};
        redisContext *c = redisConnectUnixWithTimeout(r->sock, tv);
        if (c && !c->err) {
            redisReply *rep = redisCommand(c, "PING");
            bool ok = rep && rep->type == REDIS_REPLY_STATUS;
            if (rep) freeReplyObject(rep);
            redisFree(c);
            if (ok) return;
        } else if (c) {
            redisFree(c);
        }
        usleep(50 * 1000);
    }
    fail_msg("redis-server did not come up on %s (see %s/redis.log)", r->sock, r->dir);
}

static void redis_kill(redis_srv *r) {
    if (r->pid > 0) {
        kill(r->pid, SIGCONT);
        kill(r->pid, SIGKILL);
        waitpid(r->pid, NULL, 0);
        r->pid = 0;
    }
}

static void redis_stop_all(redis_srv *r) {
    redis_kill(r);
    if (r->dir) remove_tree(r->dir);
    free(r->dir);
    r->dir = NULL;
}

static redisContext *redis_client(const redis_srv *r) {
    struct timeval tv = {5, 0};
    redisContext *c = redisConnectUnixWithTimeout(r->sock, tv);
    assert_non_null(c);
    assert_int_equal(c->err, 0);
    return c;
}

/* The Redis key of the block whose tokens are tokens[0, rows) (values
 * carry rows at offset 64 and the token ids from offset 88). */
static bool find_block_key(redisContext *c, const int32_t *tokens, int rows, char *out, size_t cap) {
    redisReply *keys = redisCommand(c, "KEYS ember:apc:*");
    assert_non_null(keys);
    bool found = false;
    for (size_t i = 0; i < keys->elements && !found; i++) {
        redisReply *v = redisCommand(c, "GET %s", keys->element[i]->str);
        if (v && v->type == REDIS_REPLY_STRING && v->len >= 88 + 4 * (size_t)rows) {
            const uint8_t *p = (const uint8_t *)v->str;
            uint32_t vr = (uint32_t)p[64] | (uint32_t)p[65] << 8 | (uint32_t)p[66] << 16 | (uint32_t)p[67] << 24;
            if (vr == (uint32_t)rows && memcmp(p + 88, tokens, 4 * (size_t)rows) == 0) {
                snprintf(out, cap, "%s", keys->element[i]->str);
                found = true;
            }
        }
        if (v) freeReplyObject(v);
    }
    freeReplyObject(keys);
    return found;
}

/* The tokens of tokens[0, n) a lookup can adopt from the values in Redis:
 * the run of blocks present from block 0 (and the partial tail when all
 * are), at most n-1. */
static int64_t surviving_prefix(redisContext *c, const int32_t *tokens, int64_t n) {
    redisReply *keys = redisCommand(c, "KEYS ember:apc:*");
    assert_non_null(keys);
    size_t nv = keys->elements;
    redisReply **vals = calloc(nv ? nv : 1, sizeof *vals);
    for (size_t i = 0; i < nv; i++) vals[i] = redisCommand(c, "GET %s", keys->element[i]->str);
    int64_t got = 0;
    for (int64_t b = 0; b * 16 < n; b++) {
        int rows = (b + 1) * 16 <= n ? 16 : (int)(n - b * 16);
        bool found = false;
        for (size_t i = 0; i < nv && !found; i++) {
            const redisReply *v = vals[i];
            if (v == NULL || v->type != REDIS_REPLY_STRING || v->len < 88 + 4 * (size_t)rows) continue;
            const uint8_t *p = (const uint8_t *)v->str;
            found = p[64] == rows && memcmp(p + 88, tokens + b * 16, 4 * (size_t)rows) == 0;
        }
        if (!found) break;
        got += rows;
    }
    for (size_t i = 0; i < nv; i++)
        if (vals[i]) freeReplyObject(vals[i]);
    free(vals);
    freeReplyObject(keys);
    return got > n - 1 ? n - 1 : got;
}

static long long redis_int(redisContext *c, const char *fmt, const char *arg) {
    redisReply *rep = redisCommand(c, fmt, arg);
    assert_non_null(rep);
    long long v = rep->type == REDIS_REPLY_INTEGER ? rep->integer : -1;
    freeReplyObject(rep);
    return v;
}

/* ---- replicas ---- */

typedef struct replica_opts {
    const char *url;
    apc_hash_kind hash;
    const char *ns;
    int wait_ms;          /* fixed read deadline (min = max); 0: 2000 */
    int breaker_failures; /* 0: 3 */
    size_t window_bytes;  /* 0: the tier's default */
} replica_opts;

/* The read hook: what to do to redis before the first window of GETs. */
enum { HOOK_NONE = 0, HOOK_STOP = 1, HOOK_KILL = 2 };
static int hook_action;
static redis_srv *hook_redis;
static int hook_fired;
static int hook_windows; /* act before this many windows of GETs have gone by (0: the first) */

static void read_hook(void *user, int stage) {
    (void)user;
    if (stage != 1 || hook_action == HOOK_NONE || hook_redis == NULL || hook_redis->pid <= 0) return;
    if (hook_windows > 0) {
        hook_windows--;
        return;
    }
    if (hook_action == HOOK_STOP) {
        kill(hook_redis->pid, SIGSTOP);
    } else {
        kill(hook_redis->pid, SIGKILL);
        waitpid(hook_redis->pid, NULL, 0);
        hook_redis->pid = 0;
    }
    hook_action = HOOK_NONE;
    hook_fired++;
}

static engine *open_replica(const model *m, const replica_opts *o) {
    engine_config cfg = engine_default_config();
    cfg.n_threads = 1;
    cfg.prefill_step = 32;
    cfg.cache.hash = o->hash;
    cfg.cache.disk.namespace_override = o->ns;
    cfg.cache.remote.url = o->url;
    int wait = o->wait_ms > 0 ? o->wait_ms : 2000;
    cfg.cache.remote.min_wait_ms = wait;
    cfg.cache.remote.max_wait_ms = wait;
    cfg.cache.remote.timeout_ms = 300;
    cfg.cache.remote.probe_ms = 100;
    cfg.cache.remote.breaker_failures = o->breaker_failures > 0 ? o->breaker_failures : 3;
    cfg.cache.remote.read_hook = read_hook;
    cfg.cache.remote.window_bytes = o->window_bytes;
    /* Recurrent stacks on their exact and ckpt tiers (block chains with
     * recurrent snapshots keep their records local). */
    cfg.cache.ckpt.snapshot_interval = 0;
    return test_open_engine(m, &cfg);
}

static void generate(engine *e, const int32_t *prompt, int64_t n, int max_tokens, engine_cache_mode mode,
                     uint64_t salt, engine_result *r) {
    engine_request q = engine_default_request();
    q.prompt = prompt;
    q.n_prompt = n;
    q.max_tokens = max_tokens;
    q.cache = mode;
    q.salt = salt;
    q.stop_at_eog = false;
    q.want_logits = true;
    ember_error err;
    if (engine_generate(e, &q, r, &err) < 0) fail_msg("engine_generate: %s", err.msg);
}

/* Warm (cache on) against cold (bypass) on e; returns the adopted count. */
static int64_t check(engine *e, const int32_t *prompt, int64_t n, uint64_t salt, const char *what) {
    engine_result warm, cold;
    generate(e, prompt, n, 6, ENGINE_CACHE_ON, salt, &warm);
    generate(e, prompt, n, 6, ENGINE_CACHE_BYPASS, salt, &cold);
    assert_warm_equals_cold(&cold, &warm, what);
    assert_int_equal(warm.cached_tokens + warm.prompt_forwarded, n);
    int64_t cached = warm.cached_tokens;
    engine_result_free(&warm);
    engine_result_free(&cold);
    return cached;
}

/* A computes and stores the prompt; its writes have landed on return. */
static void compute_on(engine *a, const int32_t *prompt, int64_t n, uint64_t salt) {
    engine_result r;
    generate(a, prompt, n, 6, ENGINE_CACHE_ON, salt, &r);
    engine_result_free(&r);
    apc_flush(engine_cache(a));
}

/* The reads a request's fetch path makes (apc_prefetch, what the driver
 * runs on its fetch threads), timed; nothing may be adopted. */
static double timed_prefetch(engine *e, const int32_t *prompt, int64_t n, uint64_t salt) {
    double t0 = ember_now();
    int64_t held = apc_prefetch(engine_cache(e), prompt, n, salt);
    double dt = ember_now() - t0;
    assert_int_equal(held, 0);
    return dt;
}

static uint64_t rng_state = 0x8f1bbcdcca62c1d6ull;

typedef struct fixture {
    model *m;
    redis_srv redis;
    int32_t prompt[N_PROMPT];
    int vocab;
} fixture;

static int setup(void **state) {
    const char *path = fixture_path(STORIES);
    if (path == NULL) return 0; /* each test skips */
    fixture *f = calloc(1, sizeof *f);
    ember_error err;
    f->m = model_load(path, &err);
    if (f->m == NULL) {
        print_message("%s: %s\n", path, err.msg);
        free(f);
        return -1;
    }
    f->vocab = model_get_hparams(f->m)->n_vocab;
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    if (f) {
        model_free(f->m);
        free(f);
    }
    return 0;
}

/* Starts the test: a model, a fresh redis, a fresh prompt. NULL: skipped. */
static fixture *begin(void **state, const char *const *redis_args) {
    fixture *f = *state;
    if (f == NULL) {
        skip();
        return NULL;
    }
    if (!have_redis_server()) {
        if (getenv("CI") && strcmp(getenv("CI"), "0") != 0) fail_msg("redis-server is not installed (scripts/install-deps.sh)");
        print_message("skipping: redis-server is not installed\n");
        skip();
        return NULL;
    }
    memset(&f->redis, 0, sizeof f->redis);
    redis_start(&f->redis, redis_args);
    test_random_tokens(&rng_state, f->prompt, N_PROMPT, f->vocab);
    hook_action = HOOK_NONE;
    hook_redis = &f->redis;
    hook_fired = 0;
    hook_windows = 0;
    return f;
}

static void end(fixture *f) {
    hook_redis = NULL;
    redis_stop_all(&f->redis);
}

/* After every test, also a failed one: its redis and directory go. */
static int end_test(void **state) {
    fixture *f = *state;
    if (f && f->redis.dir) end(f);
    return 0;
}

/* ---- tests ---- */

static void test_replica_adopts_what_another_computed(void **state) {
    fixture *f = begin(state, NULL);
    if (f == NULL) return;
    replica_opts o = {f->redis.url, APC_HASH_SHA256, NULL, 0, 0};
    engine *a = open_replica(f->m, &o);
    compute_on(a, f->prompt, N_PROMPT, 0);
    apc_stats sa = test_cache_stats(a);
    assert_true(sa.remote_enabled);
    assert_true(sa.remote_writes >= N_PROMPT / 16 + 1); /* 37 blocks and the tail, then the reply's */
    assert_int_equal(sa.remote_errors, 0);

    engine *b = open_replica(f->m, &o);
    int64_t cached = check(b, f->prompt, N_PROMPT, 0, "replica B from Redis");
    assert_int_equal(cached, N_PROMPT - 1);
    apc_flush(engine_cache(b));
    apc_stats sb = test_cache_stats(b);
    assert_int_equal(sb.remote_hits, N_PROMPT / 16 + 1);
    assert_int_equal(sb.remote_hit_tokens, N_PROMPT);
    assert_int_equal(sb.remote_corrupt, 0);
    /* B's stores met A's values (same tokens, same reply): nothing written twice. */
    assert_int_equal(sb.remote_writes, 0);
    /* A resend on B is served from memory. */
    assert_int_equal(check(b, f->prompt, N_PROMPT, 0, "replica B resend"), N_PROMPT - 1);
    assert_int_equal(test_cache_stats(b).remote_hits, sb.remote_hits);
    /* A longer prompt on a third replica: the stored prefix, then cold. */
    engine *c = open_replica(f->m, &o);
    int32_t longer[N_PROMPT + 40];
    memcpy(longer, f->prompt, sizeof f->prompt);
    test_random_tokens(&rng_state, longer + N_PROMPT, 40, f->vocab);
    int64_t got = check(c, longer, N_PROMPT + 40, 0, "replica C, longer prompt");
    assert_true(got >= N_PROMPT / 16 * 16);
    engine_free(a);
    engine_free(b);
    engine_free(c);
    end(f);
}

static void test_tenants_and_formats_never_cross(void **state) {
    fixture *f = begin(state, NULL);
    if (f == NULL) return;
    const uint64_t alice = apc_salt_for_tenant("alice", 5), bob = apc_salt_for_tenant("bob", 3);
    replica_opts o = {f->redis.url, APC_HASH_SHA256, NULL, 0, 0};
    engine *a = open_replica(f->m, &o);
    compute_on(a, f->prompt, N_PROMPT, alice);
    engine *b = open_replica(f->m, &o);
    assert_int_equal(check(b, f->prompt, N_PROMPT, bob, "another tenant"), 0);
    assert_int_equal(check(b, f->prompt, N_PROMPT, 0, "no tenant"), 0);
    assert_int_equal(test_cache_stats(b).remote_hits, 0);
    assert_int_equal(check(b, f->prompt, N_PROMPT, alice, "the same tenant"), N_PROMPT - 1);
    /* Another hash kind, another namespace: other keys altogether. */
    replica_opts ox = {f->redis.url, APC_HASH_XXH3, NULL, 0, 0};
    engine *x = open_replica(f->m, &ox);
    assert_int_equal(check(x, f->prompt, N_PROMPT, alice, "another hash kind"), 0);
    replica_opts on = {f->redis.url, APC_HASH_SHA256, "another-format", 0, 0};
    engine *y = open_replica(f->m, &on);
    assert_int_equal(check(y, f->prompt, N_PROMPT, alice, "another namespace"), 0);
    assert_int_equal(test_cache_stats(x).remote_hits + test_cache_stats(y).remote_hits, 0);
    assert_int_equal(test_cache_stats(x).remote_corrupt + test_cache_stats(y).remote_corrupt +
                         test_cache_stats(b).remote_corrupt,
                     0);
    engine_free(a);
    engine_free(b);
    engine_free(x);
    engine_free(y);
    end(f);
}

static void test_altered_values_are_counted_misses(void **state) {
    fixture *f = begin(state, NULL);
    if (f == NULL) return;
    replica_opts o = {f->redis.url, APC_HASH_SHA256, NULL, 0, 0};
    engine *a = open_replica(f->m, &o);
    compute_on(a, f->prompt, N_PROMPT, 0);
    redisContext *rc = redis_client(&f->redis);
    char key[200];
    /* One byte of block 10's K/V payload. */
    assert_true(find_block_key(rc, f->prompt + 10 * 16, 16, key, sizeof key));
    redisReply *rep = redisCommand(rc, "SETRANGE %s %d %s", key, 88 + 64 + 128 + 16 + 64 + 200, "\x7f\x7f");
    assert_non_null(rep);
    freeReplyObject(rep);
    engine *b = open_replica(f->m, &o);
    assert_int_equal(check(b, f->prompt, N_PROMPT, 0, "after SETRANGE on block 10"), 10 * 16);
    assert_int_equal(test_cache_stats(b).remote_corrupt, 1);
    /* The bad value was deleted, so B's own store wrote block 10 again. */
    apc_flush(engine_cache(b));
    assert_int_equal(redis_int(rc, "EXISTS %s", key), 1);
    engine *d = open_replica(f->m, &o);
    assert_int_equal(check(d, f->prompt, N_PROMPT, 0, "block 10 rewritten by B"), N_PROMPT - 1);
    assert_int_equal(test_cache_stats(d).remote_corrupt, 0);
    engine_free(d);
    /* A second prompt whose first value is garbage: nothing adopted. */
    int32_t other[300];
    test_random_tokens(&rng_state, other, 300, f->vocab);
    compute_on(a, other, 300, 0);
    assert_true(find_block_key(rc, other, 16, key, sizeof key));
    rep = redisCommand(rc, "SET %s %s", key, "not a cache value");
    freeReplyObject(rep);
    engine *c = open_replica(f->m, &o);
    assert_int_equal(check(c, other, 300, 0, "garbage in block 0"), 0);
    assert_int_equal(test_cache_stats(c).remote_corrupt, 1);
    /* The token ids of block 3 of the first prompt, with the checksum left alone. */
    assert_true(find_block_key(rc, f->prompt + 3 * 16, 16, key, sizeof key));
    rep = redisCommand(rc, "SETRANGE %s %d %s", key, 88, "\x01\x00\x00\x00");
    freeReplyObject(rep);
    assert_int_equal(check(c, f->prompt, N_PROMPT, 0, "other tokens in block 3"), 3 * 16);
    assert_int_equal(test_cache_stats(c).remote_corrupt, 2);
    redisFree(rc);
    engine_free(a);
    engine_free(b);
    engine_free(c);
    end(f);
}

static void test_holes_keep_the_verified_prefix(void **state) {
    fixture *f = begin(state, NULL);
    if (f == NULL) return;
    replica_opts o = {f->redis.url, APC_HASH_SHA256, NULL, 0, 0};
    engine *a = open_replica(f->m, &o);
    compute_on(a, f->prompt, N_PROMPT, 0);
    redisContext *rc = redis_client(&f->redis);
    char key[200];
    assert_true(find_block_key(rc, f->prompt + 20 * 16, 16, key, sizeof key));
    assert_int_equal(redis_int(rc, "DEL %s", key), 1);
    engine *b = open_replica(f->m, &o);
    assert_int_equal(check(b, f->prompt, N_PROMPT, 0, "hole at block 20"), 20 * 16);
    assert_true(find_block_key(rc, f->prompt + 5 * 16, 16, key, sizeof key));
    assert_int_equal(redis_int(rc, "DEL %s", key), 1);
    engine *c = open_replica(f->m, &o);
    assert_int_equal(check(c, f->prompt, N_PROMPT, 0, "hole at block 5"), 5 * 16);
    assert_int_equal(test_cache_stats(b).remote_corrupt + test_cache_stats(c).remote_corrupt, 0);
    redisFree(rc);
    engine_free(a);
    engine_free(b);
    engine_free(c);
    end(f);
}

/* A Redis too small for the workload, evicting with allkeys-lru: each
 * chain keeps some prefix or none, every answer is right. */
static void test_full_redis_evicts_and_answers_stay_right(void **state) {
    static const char *const args[] = {"--maxmemory", "3mb", "--maxmemory-policy", "allkeys-lru", NULL};
    fixture *f = begin(state, args);
    if (f == NULL) return;
    replica_opts o = {f->redis.url, APC_HASH_SHA256, NULL, 0, 0};
    engine *a = open_replica(f->m, &o);
    enum { K = 6 };
    static int32_t prompts[K][N_PROMPT];
    for (int k = 0; k < K; k++) {
        test_random_tokens(&rng_state, prompts[k], N_PROMPT, f->vocab);
        compute_on(a, prompts[k], N_PROMPT, 0);
    }
    redisContext *rc = redis_client(&f->redis);
    redisReply *info = redisCommand(rc, "INFO stats");
    assert_non_null(info);
    const char *ev = strstr(info->str, "evicted_keys:");
    assert_non_null(ev);
    long evicted = strtol(ev + 13, NULL, 10);
    freeReplyObject(info);
    redisFree(rc);
    print_message("allkeys-lru evicted %ld values\n", evicted);
    assert_true(evicted > 0);
    engine *b = open_replica(f->m, &o);
    int64_t total = 0;
    for (int k = K - 1; k >= 0; k--) {
        /* What survived of this chain, read from Redis just before B reads
         * (B's writer is idle). */
        apc_flush(engine_cache(b));
        rc = redis_client(&f->redis);
        int64_t expect = surviving_prefix(rc, prompts[k], N_PROMPT);
        redisFree(rc);
        char what[64];
        snprintf(what, sizeof what, "prompt %d after evictions", k);
        int64_t got = check(b, prompts[k], N_PROMPT, 0, what);
        /* Reads evict too near maxmemory (replies fill output buffers),
         * so B may find less than the scan saw, never more. */
        assert_true(got <= expect);
        assert_true(got == N_PROMPT - 1 || got % 16 == 0);
        total += got;
    }
    print_message("adopted %lld of %d tokens\n", (long long)total, K * N_PROMPT);
    assert_int_equal(test_cache_stats(b).remote_corrupt, 0);
    engine_free(a);
    engine_free(b);
    end(f);
}

#define DEADLINE_MS 300

static void test_stopped_redis_mid_request(void **state) {
    fixture *f = begin(state, NULL);
    if (f == NULL) return;
    replica_opts o = {f->redis.url, APC_HASH_SHA256, NULL, DEADLINE_MS, 2};
    engine *a = open_replica(f->m, &o);
    compute_on(a, f->prompt, N_PROMPT, 0);
    engine *b = open_replica(f->m, &o);
    /* B's reads (the fetch path of a request: apc_prefetch), redis stopped
     * between their EXISTS and their GETs: back by the deadline, empty. */
    hook_action = HOOK_STOP;
    double read_s = timed_prefetch(b, f->prompt, N_PROMPT, 0);
    assert_int_equal(hook_fired, 1);
    print_message("stopped mid-request: reads ended after %.3f s (deadline %d ms)\n", read_s, DEADLINE_MS);
    assert_true(read_s < DEADLINE_MS / 1000.0 + 0.25);
    assert_true(test_cache_stats(b).remote_timeouts >= 1);
    /* The request itself (its reads time out again) is right. */
    assert_int_equal(check(b, f->prompt, N_PROMPT, 0, "redis stopped"), 0);
    /* Two failures in a row: the breaker is open. */
    apc_flush(engine_cache(b));
    assert_true(test_cache_stats(b).remote_breaker_open);
    /* With the breaker open, reads cost nothing and requests are right. */
    int32_t other[200];
    test_random_tokens(&rng_state, other, 200, f->vocab);
    read_s = timed_prefetch(b, other, 200, 0);
    print_message("breaker open: reads ended after %.4f s\n", read_s);
    assert_true(read_s < 0.05);
    assert_int_equal(check(b, other, 200, 0, "breaker open"), 0);
    /* The server answers again: the probe closes the breaker. */
    kill(f->redis.pid, SIGCONT);
    double t0 = ember_now();
    while (test_cache_stats(b).remote_breaker_open && ember_now() - t0 < 5) usleep(20 * 1000);
    assert_false(test_cache_stats(b).remote_breaker_open);
    engine *c = open_replica(f->m, &o);
    assert_int_equal(check(c, f->prompt, N_PROMPT, 0, "after SIGCONT"), N_PROMPT - 1);
    engine_free(a);
    engine_free(b);
    engine_free(c);
    end(f);
}

/* The deadline passes in the middle of a chain (redis stopped after ten
 * one-value windows): the ten verified blocks are kept and adopted. */
static void test_deadline_keeps_the_verified_prefix(void **state) {
    fixture *f = begin(state, NULL);
    if (f == NULL) return;
    replica_opts o = {f->redis.url, APC_HASH_SHA256, NULL, DEADLINE_MS, 5, 1};
    engine *a = open_replica(f->m, &o);
    compute_on(a, f->prompt, N_PROMPT, 0);
    engine *b = open_replica(f->m, &o);
    hook_action = HOOK_STOP;
    hook_windows = 10;
    double t0 = ember_now();
    int64_t held = apc_prefetch(engine_cache(b), f->prompt, N_PROMPT, 0);
    double read_s = ember_now() - t0;
    assert_int_equal(hook_fired, 1);
    print_message("deadline mid-chain: %lld tokens verified in %.3f s (deadline %d ms)\n", (long long)held, read_s,
                  DEADLINE_MS);
    assert_int_equal(held, 10 * 16);
    assert_true(read_s < DEADLINE_MS / 1000.0 + 0.25);
    apc_stats s = test_cache_stats(b);
    assert_int_equal(s.remote_hits, 10);
    assert_true(s.remote_timeouts >= 1);
    kill(f->redis.pid, SIGCONT);
    /* The request adopts them from memory, and is right. */
    assert_true(check(b, f->prompt, N_PROMPT, 0, "after a deadline mid-chain") >= 10 * 16);
    engine_free(a);
    engine_free(b);
    end(f);
}

static void test_killed_redis_mid_request(void **state) {
    fixture *f = begin(state, NULL);
    if (f == NULL) return;
    replica_opts o = {f->redis.url, APC_HASH_SHA256, NULL, DEADLINE_MS, 2};
    engine *a = open_replica(f->m, &o);
    compute_on(a, f->prompt, N_PROMPT, 0);
    engine *b = open_replica(f->m, &o);
    hook_action = HOOK_KILL;
    double read_s = timed_prefetch(b, f->prompt, N_PROMPT, 0);
    assert_int_equal(hook_fired, 1);
    print_message("killed mid-request: reads ended after %.3f s\n", read_s);
    assert_true(read_s < DEADLINE_MS / 1000.0 + 0.25);
    assert_int_equal(check(b, f->prompt, N_PROMPT, 0, "redis killed"), 0);
    apc_flush(engine_cache(b));
    apc_stats s = test_cache_stats(b);
    assert_true(s.remote_errors >= 1);
    assert_true(s.remote_breaker_open);
    /* Restarted (empty): the probe closes the breaker, A's next store lands. */
    redis_start(&f->redis, NULL);
    double t0 = ember_now();
    while ((test_cache_stats(b).remote_breaker_open || test_cache_stats(a).remote_breaker_open) && ember_now() - t0 < 5)
        usleep(20 * 1000);
    assert_false(test_cache_stats(b).remote_breaker_open);
    int32_t other[300];
    test_random_tokens(&rng_state, other, 300, f->vocab);
    engine *a2 = open_replica(f->m, &o);
    compute_on(a2, other, 300, 0);
    assert_int_equal(check(b, other, 300, 0, "after the restart"), 299);
    engine_free(a);
    engine_free(a2);
    engine_free(b);
    end(f);
}

/* The exact tier (mamba2: recurrent state, whole snapshots): B adopts the
 * N-1 snapshot A stored, state included; another tenant finds nothing; an
 * altered snapshot is a counted miss. */
static void test_exact_snapshot_from_another_replica(void **state) {
    fixture *f = begin(state, NULL);
    if (f == NULL) return;
    const char *path = fixture_path("reference/mamba2-f32.gguf");
    if (path == NULL) {
        end(f);
        skip();
        return;
    }
    ember_error err;
    model *m = model_load(path, &err);
    if (m == NULL) fail_msg("%s: %s", path, err.msg);
    enum { N = 300 };
    int32_t prompt[N];
    test_random_tokens(&rng_state, prompt, N, model_get_hparams(m)->n_vocab);
    replica_opts o = {f->redis.url, APC_HASH_SHA256, NULL, 0, 0};
    engine *a = open_replica(m, &o);
    assert_int_equal(apc_get_tier(engine_cache(a)), APC_TIER_EXACT);
    compute_on(a, prompt, N, 0);
    assert_true(test_cache_stats(a).remote_writes >= 1);
    engine *b = open_replica(m, &o);
    assert_int_equal(check(b, prompt, N, apc_salt_for_tenant("other", 5), "exact, another tenant"), 0);
    assert_int_equal(test_cache_stats(b).remote_hits, 0);
    engine *c = open_replica(m, &o);
    assert_int_equal(check(c, prompt, N, 0, "exact snapshot from Redis"), N - 1);
    apc_stats sc = test_cache_stats(c);
    assert_int_equal(sc.remote_hits, 1);
    assert_int_equal(sc.remote_hit_tokens, N - 1);
    /* An altered snapshot (one byte of its state or K/V, near the end). */
    redisContext *rc = redis_client(&f->redis);
    redisReply *keys = redisCommand(rc, "KEYS ember:apc:*:x:*");
    assert_non_null(keys);
    bool altered = false;
    for (size_t i = 0; i < keys->elements; i++) {
        redisReply *len = redisCommand(rc, "STRLEN %s", keys->element[i]->str);
        redisReply *v = redisCommand(rc, "GETRANGE %s 64 67", keys->element[i]->str);
        bool is_n1 = v && v->type == REDIS_REPLY_STRING && v->len == 4 &&
                     ((uint32_t)(uint8_t)v->str[0] | (uint32_t)(uint8_t)v->str[1] << 8) == N - 1;
        if (is_n1) {
            redisReply *w = redisCommand(rc, "SETRANGE %s %lld %s", keys->element[i]->str, len->integer - 100, "\x55");
            freeReplyObject(w);
            altered = true;
        }
        freeReplyObject(len);
        freeReplyObject(v);
    }
    freeReplyObject(keys);
    redisFree(rc);
    assert_true(altered);
    engine *d = open_replica(m, &o);
    assert_int_equal(check(d, prompt, N, 0, "altered snapshot"), 0);
    assert_int_equal(test_cache_stats(d).remote_corrupt, 1);
    engine_free(a);
    engine_free(b);
    engine_free(c);
    engine_free(d);
    model_free(m);
    end(f);
}

/* The checkpoint tier (qwen35: gated delta net, recurrent state): B
 * restores A's skeletons with their checkpoint-salted chains from Redis:
 * the replay record for the identical resend (N-1), the deepest other
 * record for a longer prompt, as A's own memory would. */
static void test_ckpt_skeleton_from_another_replica(void **state) {
    fixture *f = begin(state, NULL);
    if (f == NULL) return;
    const char *path = fixture_path("reference/qwen35-f32.gguf");
    if (path == NULL) {
        end(f);
        skip();
        return;
    }
    ember_error err;
    model *m = model_load(path, &err);
    if (m == NULL) fail_msg("%s: %s", path, err.msg);
    enum { N = 600, MORE = 40 };
    int32_t prompt[N + MORE];
    test_random_tokens(&rng_state, prompt, N + MORE, model_get_hparams(m)->n_vocab);
    replica_opts o = {f->redis.url, APC_HASH_SHA256, NULL, 0, 0};
    engine *a = open_replica(m, &o);
    assert_int_equal(apc_get_tier(engine_cache(a)), APC_TIER_CKPT);
    compute_on(a, prompt, N, 0);
    apc_stats sa = test_cache_stats(a);
    assert_true(sa.ckpt_stores >= 1);
    assert_true(sa.remote_writes >= N / 16);
    /* What A's memory adopts for the longer prompt (records only, no store). */
    engine_result mem;
    generate(a, prompt, N + MORE, 2, ENGINE_CACHE_LOOKUP, 0, &mem);
    int64_t mem_longer = mem.cached_tokens;
    engine_result_free(&mem);
    assert_true(mem_longer > 0);

    engine *b = open_replica(m, &o);
    assert_int_equal(check(b, prompt, N, 0, "ckpt replay skeleton from Redis"), N - 1);
    apc_stats sb = test_cache_stats(b);
    assert_true(sb.remote_hits >= 1);
    assert_int_equal(sb.remote_corrupt, 0);
    engine *c = open_replica(m, &o);
    assert_int_equal(check(c, prompt, N + MORE, 0, "ckpt skeleton, longer prompt"), mem_longer);
    engine *d = open_replica(m, &o);
    assert_int_equal(check(d, prompt, N, apc_salt_for_tenant("other", 5), "ckpt, another tenant"), 0);
    assert_int_equal(test_cache_stats(d).remote_hits, 0);
    engine_free(a);
    engine_free(b);
    engine_free(c);
    engine_free(d);
    model_free(m);
    end(f);
}

/* ---- two servers ---- */

static cJSON *post_json(int port, const char *path, const char *body) {
    char *out = NULL;
    int st = http_call(port, "POST", path, NULL, body, &out);
    if (st != 200) fail_msg("POST %s: %d %s", path, st, out ? out : "");
    cJSON *j = cJSON_Parse(out);
    free(out);
    assert_non_null(j);
    return j;
}

static cJSON *get_json(int port, const char *path) {
    char *out = NULL;
    assert_int_equal(http_call(port, "GET", path, NULL, NULL, &out), 200);
    cJSON *j = cJSON_Parse(out);
    free(out);
    assert_non_null(j);
    return j;
}

static double num(const cJSON *o, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (!cJSON_IsNumber(v)) fail_msg("missing number %s", name);
    return v->valuedouble;
}

/* A TCP port nobody listens on right now. */
static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port;
}

/* Over TCP this time (redis://127.0.0.1:PORT/1: a free port, database 1). */
static void test_two_servers_share_through_redis(void **state) {
    int port = free_port();
    assert_true(port > 0);
    char port_text[16];
    snprintf(port_text, sizeof port_text, "%d", port);
    const char *const args[] = {"--port", port_text, "--bind", "127.0.0.1", NULL};
    fixture *f = begin(state, args);
    if (f == NULL) return;
    snprintf(f->redis.url, sizeof f->redis.url, "redis://127.0.0.1:%d/1", port);
    const char *bin = ember_binary();
    if (bin == NULL) {
        skip();
        end(f);
        return;
    }
    /* No SSD tier: the two would share the per-user directory, and B must
     * find A's KV in Redis. */
    char *extra[] = {"--remote-url", f->redis.url, "--ctx", "2048", "--no-disk", NULL};
    char log_a[400], log_b[400];
    snprintf(log_a, sizeof log_a, "%s/a.log", f->redis.dir);
    snprintf(log_b, sizeof log_b, "%s/b.log", f->redis.dir);
    pid_t pa = 0, pb = 0;
    int port_a = http_spawn_ember(bin, fixture_path(STORIES), extra, log_a, &pa);
    int port_b = http_spawn_ember(bin, fixture_path(STORIES), extra, log_b, &pb);
    assert_true(port_a > 0 && port_b > 0);
    char body[4096];
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"user\",\"content\":\"%s\"}],\"max_tokens\":8,\"temperature\":0,"
             "\"logprobs\":true,\"top_logprobs\":2}",
             "Once upon a time there was a little girl named Lily who loved to play in the park with her "
             "friends. One day she found a big red ball under a tree and she was very happy. She ran to "
             "her mom and said: look what I found! Her mom smiled and said they could play with it "
             "together after lunch, and so they did, all afternoon, until the sun went down.");
    cJSON *ra = post_json(port_a, "/v1/chat/completions", body);
    const cJSON *usage = cJSON_GetObjectItemCaseSensitive(ra, "usage");
    int n = (int)num(usage, "prompt_tokens");
    assert_true(n > 64);
    /* A's writes land asynchronously: wait until they stop. */
    double t0 = ember_now(), last = -1;
    int stable = 0;
    while (ember_now() - t0 < 10 && stable < 3) {
        cJSON *st = get_json(port_a, "/v1/cache/stats");
        double w = num(st, "remote_writes");
        cJSON_Delete(st);
        stable = w >= n / 16 && w == last ? stable + 1 : 0;
        last = w;
        usleep(100 * 1000);
    }
    cJSON *rb = post_json(port_b, "/v1/chat/completions", body);
    int cached = (int)num(cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(rb, "usage"),
                                                            "prompt_tokens_details"),
                          "cached_tokens");
    assert_int_equal(cached, n - 1);
    char *la = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(
        cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(ra, "choices"), 0), "logprobs"));
    char *lb = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(
        cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(rb, "choices"), 0), "logprobs"));
    assert_string_equal(la, lb); /* bit-identical logits print identically */
    free(la);
    free(lb);
    cJSON *sb = get_json(port_b, "/v1/cache/stats");
    assert_true(num(sb, "remote_hits") >= n / 16);
    assert_true(num(sb, "remote_hit_tokens") >= n - 1);
    assert_int_equal((int)num(sb, "remote_corrupt"), 0);
    assert_int_equal((int)num(sb, "remote_errors"), 0);
    assert_non_null(cJSON_GetObjectItemCaseSensitive(sb, "remote_timeouts"));
    assert_non_null(cJSON_GetObjectItemCaseSensitive(sb, "remote_write_drops"));
    assert_non_null(cJSON_GetObjectItemCaseSensitive(sb, "remote_writes"));
    cJSON_Delete(sb);
    char *metrics = NULL;
    assert_int_equal(http_call(port_b, "GET", "/metrics", NULL, NULL, &metrics), 200);
    assert_true(serve_metrics_text_sum(metrics, "ember_apc_remote_hits_total") >= n / 16);
    assert_true(serve_metrics_text_sum(metrics, "ember_apc_remote_hit_tokens_total") >= n - 1);
    assert_non_null(strstr(metrics, "ember_apc_remote_write_drops_total"));
    free(metrics);
    cJSON_Delete(ra);
    cJSON_Delete(rb);
    /* The values went to database 1, over TCP. */
    redisContext *rc = redis_client(&f->redis);
    redisReply *rep = redisCommand(rc, "SELECT 1");
    freeReplyObject(rep);
    rep = redisCommand(rc, "DBSIZE");
    assert_true(rep && rep->type == REDIS_REPLY_INTEGER && rep->integer >= n / 16);
    freeReplyObject(rep);
    rep = redisCommand(rc, "SELECT 0");
    freeReplyObject(rep);
    rep = redisCommand(rc, "DBSIZE");
    assert_true(rep && rep->type == REDIS_REPLY_INTEGER && rep->integer == 0);
    freeReplyObject(rep);
    redisFree(rc);
    assert_int_equal(http_stop_server(&pa, 5000), 0);
    assert_int_equal(http_stop_server(&pb, 5000), 0);
    end(f);
}

/* URLs: what the tier accepts, and a bad one named at start-up. */
static void test_remote_urls(void **state) {
    (void)state;
    ember_error err;
    static const char *const good[] = {"redis://127.0.0.1", "redis://cache.local:6380", "redis://[::1]:6379/2",
                                       "redis://h:1/15", "unix:///run/redis/redis.sock", "unix:///tmp/r.sock?db=3"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
        if (apc_remote_check_url(good[i], &err) < 0) fail_msg("%s refused: %s", good[i], err.msg);
    static const char *const bad[] = {"",  "http://h:6379",      "redis://",         "redis://h:0",
                                      "redis://h:99999", "redis://h:6379/x", "redis://u:p@h", "unix://relative.sock",
                                      "unix:///s?db=-1", "redis:/h", "redis://[::1", "redis://[::1]x"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        if (apc_remote_check_url(bad[i], &err) == 0) fail_msg("'%s' accepted", bad[i]);
        assert_true(strlen(err.msg) > 0);
    }
    serve_config c;
    serve_config_defaults(&c);
    snprintf(c.remote_url, sizeof c.remote_url, "%s", "redis://h:notaport");
    assert_int_equal(serve_config_validate(&c, &err), -1);
    assert_non_null(strstr(err.msg, "cache.remote.url"));
    assert_non_null(strstr(err.msg, "bad port"));
    serve_config_defaults(&c);
    c.cache.remote.min_wait_ms = 9000;
    assert_int_equal(serve_config_validate(&c, &err), -1);
    assert_non_null(strstr(err.msg, "cache.remote.min_wait_ms"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_remote_urls, end_test),
        cmocka_unit_test_teardown(test_replica_adopts_what_another_computed, end_test),
        cmocka_unit_test_teardown(test_tenants_and_formats_never_cross, end_test),
        cmocka_unit_test_teardown(test_altered_values_are_counted_misses, end_test),
        cmocka_unit_test_teardown(test_holes_keep_the_verified_prefix, end_test),
        cmocka_unit_test_teardown(test_full_redis_evicts_and_answers_stay_right, end_test),
        cmocka_unit_test_teardown(test_stopped_redis_mid_request, end_test),
        cmocka_unit_test_teardown(test_deadline_keeps_the_verified_prefix, end_test),
        cmocka_unit_test_teardown(test_killed_redis_mid_request, end_test),
        cmocka_unit_test_teardown(test_exact_snapshot_from_another_replica, end_test),
        cmocka_unit_test_teardown(test_ckpt_skeleton_from_another_replica, end_test),
        cmocka_unit_test_teardown(test_two_servers_share_through_redis, end_test),
    };
    return test_run_group(tests, setup, teardown);
}
