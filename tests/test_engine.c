/* test_engine.c - the prompt cache end to end, on real model files.
 *
 * Every warm result is compared bit for bit (memcmp of the logits of every
 * generated step, and the tokens) with a cold run of the same request
 * (ENGINE_CACHE_BYPASS: no lookup, no store), under both the block tier and
 * the exact tier (forced on the dense model, as EMBER_APC_FORCE_TIER=exact
 * would). Covered: the routing log line; identical resends for N = 1..80 and
 * N in {16, 32, 48, 1024, 2048} forwarding exactly one token; a shared
 * system prompt; branch, regenerate, and divergence inside a block;
 * retirement (turn 2 adopts turn 1's prompt + reply); tenancy; eviction with
 * an 8-block pool; 8 threads against one cache; a randomized trace; a pool
 * too small for the request. stories260K for most, qwen3-f32 (context 4096)
 * for the long prompts. */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/log.h"
#include "engine/engine.h"
#include "test_util.h"

#define STORIES "models/stories260K.gguf"
#define QWEN3 "reference/qwen3-f32.gguf"

static engine *open_engine(const model *m, apc_force force, int32_t num_blocks, int step, int threads) {
    engine_config cfg = engine_default_config();
    cfg.n_threads = threads;
    cfg.prefill_step = step;
    cfg.num_blocks = num_blocks;
    cfg.cache.force_tier = force;
    return test_open_engine(m, &cfg);
}

static void close_engine(engine *e) {
    test_assert_no_block_leaks(e);
    engine_free(e);
}

typedef struct req_opts {
    int max_tokens;
    uint64_t salt;
    float temperature;
    uint64_t seed;
} req_opts;

static void run(engine *e, const int32_t *prompt, int64_t n, const req_opts *o, engine_cache_mode mode,
                engine_result *r) {
    engine_request q = engine_default_request();
    q.prompt = prompt;
    q.n_prompt = n;
    q.max_tokens = o->max_tokens;
    q.salt = o->salt;
    q.sampling.temperature = o->temperature;
    q.sampling.seed = o->seed;
    q.cache = mode;
    q.stop_at_eog = false;
    q.want_logits = true;
    ember_error err;
    if (engine_generate(e, &q, r, &err) < 0) fail_msg("engine_generate (n=%lld): %s", (long long)n, err.msg);
}

/* Runs the request cold, then through the cache; compares; returns the
 * number of prompt tokens the cached run adopted. */
static int64_t check(engine *e, const int32_t *prompt, int64_t n, const req_opts *o, const char *what) {
    engine_result cold, warm;
    run(e, prompt, n, o, ENGINE_CACHE_BYPASS, &cold);
    run(e, prompt, n, o, ENGINE_CACHE_ON, &warm);
    assert_warm_equals_cold(&cold, &warm, what);
    assert_int_equal(warm.cached_tokens + warm.prompt_forwarded, n);
    assert_int_equal(cold.cached_tokens, 0);
    int64_t cached = warm.cached_tokens;
    engine_result_free(&cold);
    engine_result_free(&warm);
    return cached;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) { return test_rand(&rng_state); }
static void random_tokens(int32_t *t, int64_t n, int vocab) { test_random_tokens(&rng_state, t, n, vocab); }

static const apc_force tiers[2] = {APC_FORCE_BLOCK, APC_FORCE_EXACT};
static const char *tier_names[2] = {"block", "exact"};

/* ---- routing log ---- */

static void test_routing_log(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    test_log_capture cap;
    test_log_capture_begin(&cap);
    engine *e = open_engine(m, APC_FORCE_NONE, 0, 64, 1);
    engine_free(e);
    e = open_engine(m, APC_FORCE_OFF, 0, 64, 1);
    engine_free(e);
    char *text = test_log_capture_end(&cap);
    /* the line also says whether speculation and L0 are on */
    if (strstr(text, "ember info: APC tier: block (layers: 5 kv / 0 rot / 0 arr); speculation off, L0 off\n") == NULL)
        fail_msg("no routing line in: %s", text);
    if (strstr(text, "ember warn: APC OFF for this model: ") == NULL) fail_msg("no OFF line in: %s", text);
    assert_non_null(strstr(text, "num_blocks="));
    free(text);
    model_free(m);
}

/* ---- identical resend ---- */

static void resend_one(engine *e, const int32_t *prompt, int64_t n, const char *tier) {
    char what[96];
    snprintf(what, sizeof what, "%s resend N=%lld", tier, (long long)n);
    req_opts o = {3, 0, 0, 0};
    apc_reset(engine_cache(e));
    engine_result cold, first, warm;
    run(e, prompt, n, &o, ENGINE_CACHE_BYPASS, &cold);
    run(e, prompt, n, &o, ENGINE_CACHE_ON, &first);
    run(e, prompt, n, &o, ENGINE_CACHE_ON, &warm);
    assert_warm_equals_cold(&cold, &first, what);
    assert_warm_equals_cold(&cold, &warm, what);
    assert_int_equal(first.cached_tokens, 0);
    if (warm.prompt_forwarded != 1)
        fail_msg("%s: forwarded %lld prompt tokens (cached %lld)", what, (long long)warm.prompt_forwarded,
                 (long long)warm.cached_tokens);
    assert_int_equal(warm.cached_tokens, n - 1);
    engine_result_free(&cold);
    engine_result_free(&first);
    engine_result_free(&warm);
}

static void test_resend_1_to_80(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int32_t prompt[80];
    random_tokens(prompt, 80, model_get_hparams(m)->n_vocab);
    for (int t = 0; t < 2; t++) {
        engine *e = open_engine(m, tiers[t], 0, 32, 2);
        for (int n = 1; n <= 80; n++) {
            if (n == 1) {
                /* Nothing can be adopted from one token; it is forwarded. */
                req_opts o = {3, 0, 0, 0};
                assert_int_equal(check(e, prompt, 1, &o, "N=1"), 0);
                continue;
            }
            resend_one(e, prompt, n, tier_names[t]);
        }
        close_engine(e);
    }
    model_free(m);
}

static void test_resend_long(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, QWEN3);
    model *m = test_load_model(path);
    static const int ns[] = {16, 32, 48, 1024, 2048};
    int32_t *prompt = malloc(2048 * sizeof(int32_t));
    random_tokens(prompt, 2048, model_get_hparams(m)->n_vocab);
    for (int t = 0; t < 2; t++) {
        engine *e = open_engine(m, tiers[t], 0, 256, 2);
        for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) resend_one(e, prompt, ns[i], tier_names[t]);
        close_engine(e);
    }
    free(prompt);
    model_free(m);
}

/* ---- shared system prompt, branches ---- */

static void test_shared_system_prompt(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    engine *e = open_engine(m, APC_FORCE_NONE, 0, 32, 2);
    assert_int_equal(apc_get_tier(engine_cache(e)), APC_TIER_BLOCK);
    int32_t prompt[120];
    random_tokens(prompt, 45, V); /* the system prompt */
    req_opts o = {4, 0, 0, 0};
    for (int i = 0; i < 6; i++) {
        int user = 5 + (int)(rnd() % 40);
        random_tokens(prompt + 45, user, V);
        int64_t cached = check(e, prompt, 45 + user, &o, "shared system prompt");
        assert_int_equal(cached % KV_BLOCK_TOKENS, 0);
        if (i > 0) assert_true(cached >= 32);
    }
    apc_stats s;
    apc_get_stats(engine_cache(e), &s);
    assert_true(s.lookups_hit >= 5);
    assert_true(s.stores > 0);
    close_engine(e);
    model_free(m);
}

static void test_branch_regenerate_diverge(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    for (int t = 0; t < 2; t++) {
        engine *e = open_engine(m, tiers[t], 0, 32, 2);
        int32_t a[100], b[100];
        random_tokens(a, 100, V);
        req_opts o = {6, 0, 0, 0};
        assert_int_equal(check(e, a, 100, &o, "first"), 0);
        /* Regenerate: the same prompt, sampled with other seeds. */
        for (uint64_t seed = 1; seed <= 3; seed++) {
            req_opts s = {6, 0, 0.9f, seed};
            assert_int_equal(check(e, a, 100, &s, "regenerate"), 99);
        }
        /* Branch mid-sequence: the first 60 tokens, then something else. */
        memcpy(b, a, sizeof b);
        random_tokens(b + 60, 40, V);
        int64_t got = check(e, b, 100, &o, "branch");
        if (t == 0) assert_int_equal(got, 48);
        else assert_int_equal(got, 0); /* exact: a's 99 is not a prefix of b */
        /* Diverge inside a block: one token changed at 40. */
        memcpy(b, a, sizeof b);
        b[40] = (b[40] + 1) % V;
        got = check(e, b, 100, &o, "diverge in block");
        if (t == 0) assert_int_equal(got, 32);
        /* Shorter prefix of a: block adopts its full blocks; exact has
         * only longer entries. */
        got = check(e, a, 70, &o, "prefix of a stored prompt");
        if (t == 0) assert_int_equal(got, 64);
        close_engine(e);
    }
    model_free(m);
}

/* ---- retirement ---- */

static void test_retirement(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    for (int t = 0; t < 2; t++) {
        for (int gen = 10; gen <= 27; gen += 17) { /* 37+27 = 64: reply ends on a block boundary */
            engine *e = open_engine(m, tiers[t], 0, 32, 2);
            int32_t conv[200];
            random_tokens(conv, 37, V);
            req_opts o = {gen, 0, 0, 0};
            engine_result r1;
            run(e, conv, 37, &o, ENGINE_CACHE_ON, &r1);
            assert_int_equal(r1.n_tokens, gen);
            memcpy(conv + 37, r1.tokens, (size_t)gen * sizeof(int32_t));
            engine_result_free(&r1);
            int64_t len1 = 37 + gen;
            random_tokens(conv + len1, 11, V); /* the next user turn */
            req_opts o2 = {5, 0, 0, 0};
            int64_t cached = check(e, conv, len1 + 11, &o2, "turn 2");
            int64_t floor_len1 = len1 / KV_BLOCK_TOKENS * KV_BLOCK_TOKENS;
            if (cached < floor_len1)
                fail_msg("%s: turn 2 adopted %lld < %lld (turn 1 = %lld tokens)", tier_names[t], (long long)cached,
                         (long long)floor_len1, (long long)len1);
            if (t == 1) assert_int_equal(cached, len1);
            apc_stats s;
            apc_get_stats(engine_cache(e), &s);
            assert_true(s.retire_stores >= 1);
            close_engine(e);
        }
    }
    model_free(m);
}

/* ---- tenancy ---- */

static void test_tenancy(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    uint64_t s1 = apc_salt_for_tenant("alice", 5), s2 = apc_salt_for_tenant("bob", 3);
    for (int t = 0; t < 2; t++) {
        engine *e = open_engine(m, tiers[t], 0, 32, 2);
        int32_t p[70];
        random_tokens(p, 70, V);
        req_opts a = {3, s1, 0, 0}, b = {3, s2, 0, 0}, none = {3, 0, 0, 0};
        assert_int_equal(check(e, p, 70, &a, "alice cold"), 0);
        assert_int_equal(check(e, p, 70, &b, "bob after alice"), 0);
        assert_int_equal(check(e, p, 70, &a, "alice again"), 69);
        assert_int_equal(check(e, p, 70, &b, "bob again"), 69);
        assert_int_equal(check(e, p, 70, &none, "no tenant"), 0);
        close_engine(e);
    }
    model_free(m);
}

/* ---- eviction ---- */

static void test_eviction_tiny_pool(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    engine *e = open_engine(m, APC_FORCE_BLOCK, 8, 32, 2);
    int32_t base[4][100];
    for (int i = 0; i < 4; i++) random_tokens(base[i], 100, V);
    int64_t adopted = 0;
    for (int step = 0; step < 80; step++) {
        int32_t p[100];
        int which = (int)(rnd() % 4);
        int n = 2 + (int)(rnd() % 98);
        memcpy(p, base[which], sizeof p);
        if (rnd() % 3 == 0) p[rnd() % (uint32_t)n] = (int32_t)(rnd() % (uint32_t)V);
        req_opts o = {1 + (int)(rnd() % 8), 0, 0, 0};
        if (n + o.max_tokens > 7 * KV_BLOCK_TOKENS) n = 7 * KV_BLOCK_TOKENS - o.max_tokens;
        adopted += check(e, p, n, &o, "tiny pool trace");
    }
    apc_stats s;
    apc_get_stats(engine_cache(e), &s);
    assert_true(s.evictions > 0);
    assert_true(adopted > 0);
    assert_true(s.pool_used <= 8);
    /* Too big for the pool: a clear error at admission. */
    int32_t big[200];
    random_tokens(big, 200, V);
    engine_request q = engine_default_request();
    q.prompt = big;
    q.n_prompt = 200;
    q.max_tokens = 4;
    engine_result r;
    ember_error err;
    assert_int_equal(engine_generate(e, &q, &r, &err), -1);
    assert_non_null(strstr(err.msg, "num_blocks"));
    close_engine(e);
    model_free(m);
}

/* ---- concurrency ---- */

#define CONC_THREADS 8
#define CONC_PROMPTS 12
#define CONC_ROUNDS 6

typedef struct conc_shared {
    engine *e;
    int32_t prompts[CONC_PROMPTS][96];
    int lens[CONC_PROMPTS];
    engine_result cold[CONC_PROMPTS];
    int failures;
    int64_t adopted;
    pthread_mutex_t lock;
} conc_shared;

typedef struct conc_arg {
    conc_shared *sh;
    int id;
} conc_arg;

static void *conc_worker(void *p) {
    conc_arg *a = p;
    conc_shared *sh = a->sh;
    for (int r = 0; r < CONC_ROUNDS; r++) {
        int i = (a->id * 5 + r * 7) % CONC_PROMPTS;
        engine_request q = engine_default_request();
        q.prompt = sh->prompts[i];
        q.n_prompt = sh->lens[i];
        q.max_tokens = 4;
        q.stop_at_eog = false;
        q.want_logits = true;
        engine_result w;
        ember_error err;
        int bad = 0;
        if (engine_generate(sh->e, &q, &w, &err) < 0) {
            bad = 1;
        } else {
            const engine_result *c = &sh->cold[i];
            if (w.n_tokens != c->n_tokens ||
                memcmp(w.logits, c->logits, (size_t)c->n_tokens * (size_t)c->n_vocab * sizeof(float)) != 0)
                bad = 1;
        }
        pthread_mutex_lock(&sh->lock);
        sh->failures += bad;
        if (!bad) sh->adopted += w.cached_tokens;
        pthread_mutex_unlock(&sh->lock);
        if (!bad) engine_result_free(&w);
    }
    return NULL;
}

static void test_concurrency(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    for (int t = 0; t < 2; t++) {
        conc_shared *sh = calloc(1, sizeof *sh);
        pthread_mutex_init(&sh->lock, NULL);
        sh->e = open_engine(m, tiers[t], 256, 32, 1);
        int32_t common[96];
        random_tokens(common, 96, V);
        for (int i = 0; i < CONC_PROMPTS; i++) {
            /* Overlapping: a shared head of 20..60 tokens, then a private tail. */
            memcpy(sh->prompts[i], common, sizeof common);
            int head = 20 + (i % 5) * 10;
            sh->lens[i] = head + 10 + (i % 4) * 9;
            random_tokens(sh->prompts[i] + head, 96 - head, V);
            if (i % 3 == 2) memcpy(sh->prompts[i], sh->prompts[i - 1], sizeof common); /* exact repeats */
            req_opts o = {4, 0, 0, 0};
            run(sh->e, sh->prompts[i], sh->lens[i], &o, ENGINE_CACHE_BYPASS, &sh->cold[i]);
        }
        pthread_t th[CONC_THREADS];
        conc_arg args[CONC_THREADS];
        for (int k = 0; k < CONC_THREADS; k++) {
            args[k] = (conc_arg){sh, k};
            pthread_create(&th[k], NULL, conc_worker, &args[k]);
        }
        for (int k = 0; k < CONC_THREADS; k++) pthread_join(th[k], NULL);
        if (sh->failures) fail_msg("%s: %d concurrent requests failed or differed from cold", tier_names[t], sh->failures);
        assert_true(sh->adopted > 0);
        apc_stats s;
        apc_get_stats(engine_cache(sh->e), &s);
        assert_true(s.lookups_hit > 0);
        assert_int_equal(s.pool_referenced, 0);
        close_engine(sh->e);
        for (int i = 0; i < CONC_PROMPTS; i++) engine_result_free(&sh->cold[i]);
        pthread_mutex_destroy(&sh->lock);
        free(sh);
    }
    model_free(m);
}

/* ---- randomized property test ---- */

static void test_random_traces(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    for (int t = 0; t < 2; t++) {
        for (int trace = 0; trace < 3; trace++) {
            rng_state = 0x1234567ull + (uint64_t)trace * 7919u + (uint64_t)t;
            int32_t nblocks = trace == 2 ? 12 : 0; /* one trace under pool pressure */
            engine *e = open_engine(m, tiers[t], nblocks, 16 + 16 * trace, 2);
            int32_t hist[8][180];
            int hist_len[8] = {0};
            int n_hist = 0;
            for (int step = 0; step < 40; step++) {
                int32_t p[180];
                int n;
                uint32_t op = n_hist ? rnd() % 5 : 0;
                int h = n_hist ? (int)(rnd() % (uint32_t)n_hist) : 0;
                if (op == 0) { /* fresh prompt */
                    n = 1 + (int)(rnd() % 90);
                    random_tokens(p, n, V);
                } else if (op == 1) { /* resend */
                    n = hist_len[h];
                    memcpy(p, hist[h], (size_t)n * sizeof(int32_t));
                } else if (op == 2) { /* prefix */
                    n = 1 + (int)(rnd() % (uint32_t)hist_len[h]);
                    memcpy(p, hist[h], (size_t)n * sizeof(int32_t));
                } else if (op == 3) { /* branch */
                    int keep = (int)(rnd() % (uint32_t)hist_len[h]);
                    n = keep + 1 + (int)(rnd() % 40);
                    memcpy(p, hist[h], (size_t)keep * sizeof(int32_t));
                    random_tokens(p + keep, n - keep, V);
                } else { /* the next turn: an earlier prompt + reply + a new user turn */
                    n = hist_len[h] + 7;
                    memcpy(p, hist[h], (size_t)hist_len[h] * sizeof(int32_t));
                    random_tokens(p + hist_len[h], 7, V);
                }
                req_opts o = {1 + (int)(rnd() % 6), 0, rnd() % 4 == 0 ? 0.8f : 0.0f, rnd()};
                if (nblocks && n + o.max_tokens > (nblocks - 2) * KV_BLOCK_TOKENS)
                    n = (nblocks - 2) * KV_BLOCK_TOKENS - o.max_tokens;
                if (n + o.max_tokens + 20 > 180) n = 180 - o.max_tokens - 20;
                engine_result cold, warm;
                run(e, p, n, &o, ENGINE_CACHE_BYPASS, &cold);
                run(e, p, n, &o, ENGINE_CACHE_ON, &warm);
                assert_warm_equals_cold(&cold, &warm, "random trace");
                /* Remember prompt + reply for later steps. */
                int slot = n_hist < 8 ? n_hist++ : (int)(rnd() % 8);
                memcpy(hist[slot], p, (size_t)n * sizeof(int32_t));
                memcpy(hist[slot] + n, warm.tokens, (size_t)warm.n_tokens * sizeof(int32_t));
                hist_len[slot] = n + warm.n_tokens;
                engine_result_free(&cold);
                engine_result_free(&warm);
            }
            apc_stats s;
            apc_get_stats(engine_cache(e), &s);
            assert_true(s.lookups_hit > 0);
            close_engine(e);
        }
    }
    model_free(m);
}

int main(void) {
    if (getenv("EMBER_LOG") == NULL) ember_log_set_level(EMBER_LOG_WARN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_routing_log),
        cmocka_unit_test(test_resend_1_to_80),
        cmocka_unit_test(test_resend_long),
        cmocka_unit_test(test_shared_system_prompt),
        cmocka_unit_test(test_branch_regenerate_diverge),
        cmocka_unit_test(test_retirement),
        cmocka_unit_test(test_tenancy),
        cmocka_unit_test(test_eviction_tiny_pool),
        cmocka_unit_test(test_concurrency),
        cmocka_unit_test(test_random_traces),
    };
    return test_run_group(tests, NULL, NULL);
}
