/* test_snap.c - reuse inside a prompt on sliding-window, hybrid and
 * recurrent stacks (issue 17): the block tier over rot layers whose rows the
 * pool keeps, and over arr/list layers with recurrent-state snapshots on the
 * block chain (apc_snap.c).
 *
 * Per family (dense qwen3, gemma3, qwen35, mamba2, falcon-h1; the tiny
 * reference fixtures, vocab 512):
 *  - branch: A+B, then A+C (A 800 tokens, B and C 200): A+C computes at most
 *    |C| + one snapshot interval (16 on stacks without recurrent layers),
 *    with intervals 64 and 128;
 *  - siblings: four agents sharing a 300-token system prompt, two turns each,
 *    interleaved (all turn 1s, then all turn 2s); turn 1 of agents 2-4
 *    computes at most its own message + one interval, turn 2 at most the
 *    new message + one interval;
 *  - decode snapshots: a follow-up that keeps part of a long reply resumes
 *    at the last interval point of the reply below the cut.
 * The tokens computed are read twice: the request's prompt_forwarded and the
 * cache's matched_tokens counter (N minus what the lookup adopted). Every
 * warm result is compared with a cold run (ENGINE_CACHE_BYPASS) by memcmp of
 * the tokens and every step's logits (assert_warm_equals_cold).
 * Also: the routing pass (apc_route_pool_rows), snapshots evicted with their
 * blocks when the pool runs dry and by the byte budget, and the switches
 * that send these stacks back to the checkpoint and exact tiers. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "apc/apc.h"
#include "engine/engine.h"
#include "model/model.h"
#include "test_util.h"

typedef struct family {
    const char *name, *path;
    bool recurrent; /* arr or list layers: snapshots, slack = one interval */
} family;

static const family families[] = {
    {"qwen3", "reference/qwen3-f32.gguf", false},
    {"gemma3", "reference/gemma3-f32.gguf", false},
    {"qwen35", "reference/qwen35-f32.gguf", true},
    {"mamba2", "reference/mamba2-f32.gguf", true},
    {"falcon-h1", "reference/falcon-h1-f32.gguf", true},
};
#define N_FAMILIES (int)(sizeof families / sizeof families[0])

static uint64_t rng_state = 0x5eed5eed1234ull;

static engine *open_engine(const model *m, int interval, int32_t num_blocks) {
    engine_config cfg = engine_default_config();
    cfg.n_threads = 2;
    cfg.n_ctx = 2048;
    cfg.num_blocks = num_blocks;
    cfg.cache.ckpt.snapshot_interval = interval;
    return test_open_engine(m, &cfg);
}

static void close_engine(engine *e) {
    apc_reset(engine_cache(e));
    test_assert_no_block_leaks(e);
    engine_free(e);
}

static uint64_t matched(engine *e) {
    apc_stats s;
    apc_get_stats(engine_cache(e), &s);
    return s.matched_tokens;
}

/* Cold (bypass) then warm; the warm run must equal the cold one bit for
 * bit. Returns the tokens the warm run computed, checked against the
 * cache's counter; the warm result goes to *out when given. */
static int64_t computed(engine *e, const int32_t *prompt, int64_t n, int max_tokens, int64_t anchor, const char *what,
                        engine_result *out) {
    engine_result cold, warm;
    test_generate(e, prompt, n, max_tokens, ENGINE_CACHE_BYPASS, &cold);
    uint64_t before = matched(e);
    engine_request q = engine_default_request();
    q.prompt = prompt;
    q.n_prompt = n;
    q.max_tokens = max_tokens;
    q.cache = ENGINE_CACHE_ON;
    q.stop_at_eog = false;
    q.want_logits = true;
    q.plan.anchor_pos = anchor;
    ember_error err;
    if (engine_generate(e, &q, &warm, &err) < 0) fail_msg("%s: %s", what, err.msg);
    assert_warm_equals_cold(&cold, &warm, what);
    int64_t fwd = warm.prompt_forwarded;
    int64_t from_stats = n - (int64_t)(matched(e) - before);
    if (fwd != from_stats)
        fail_msg("%s: forwarded %lld but the cache's counters say %lld", what, (long long)fwd, (long long)from_stats);
    engine_result_free(&cold);
    if (out) *out = warm;
    else engine_result_free(&warm);
    return fwd;
}

static void within(const char *what, int64_t got, int64_t ideal, int64_t slack) {
    print_message("%-34s computed %4lld, ideal %4lld (+%lld allowed)\n", what, (long long)got, (long long)ideal,
                  (long long)slack);
    if (got > ideal + slack)
        fail_msg("%s: computed %lld prompt tokens, ideal %lld + %lld", what, (long long)got, (long long)ideal,
                 (long long)slack);
}

/* ---- branch: A+B, then A+C ---- */

static void branch_case(const family *f, int interval) {
    REQUIRE_FIXTURE(path, f->path);
    model *m = test_load_model(path);
    engine *e = open_engine(m, interval, 0);
    apc_tier tier = apc_get_tier(engine_cache(e));
    assert_int_equal(tier, APC_TIER_BLOCK);
    const int V = model_get_hparams(m)->n_vocab, A = 800, B = 200;
    int32_t *ab = malloc((A + B) * sizeof *ab), *ac = malloc((A + B) * sizeof *ac);
    test_random_tokens(&rng_state, ab, A + B, V);
    memcpy(ac, ab, A * sizeof *ac);
    test_random_tokens(&rng_state, ac + A, B, V);
    char what[96];
    snprintf(what, sizeof what, "%s branch A+B (interval %d)", f->name, interval);
    within(what, computed(e, ab, A + B, 4, 0, what, NULL), A + B, 0);
    snprintf(what, sizeof what, "%s branch A+C (interval %d)", f->name, interval);
    int64_t slack = f->recurrent ? interval : KV_BLOCK_TOKENS;
    within(what, computed(e, ac, A + B, 4, 0, what, NULL), B, slack);
    apc_stats s;
    apc_get_stats(engine_cache(e), &s);
    if (f->recurrent) {
        assert_int_equal(s.snap_interval, interval);
        assert_true(s.snap_hits >= 1);
        assert_true(s.snap_stores >= (uint64_t)(A / interval));
        assert_int_equal((int64_t)s.snap_bytes, (int64_t)s.snap_entries * (int64_t)model_state_bytes(m));
    } else {
        assert_int_equal(s.snap_entries, 0);
    }
    free(ab);
    free(ac);
    close_engine(e);
    model_free(m);
}

static void test_branch_64(void **st) {
    (void)st;
    for (int f = 0; f < N_FAMILIES; f++) branch_case(&families[f], 64);
}

static void test_branch_128(void **st) {
    (void)st;
    for (int f = 0; f < N_FAMILIES; f++)
        if (families[f].recurrent) branch_case(&families[f], 128);
}

/* ---- four agents, one system prompt, two turns each ---- */

static void test_siblings(void **st) {
    (void)st;
    enum { AGENTS = 4, SYS = 300, OWN = 40, REPLY = 8, NEXT = 20 };
    const int interval = 64;
    for (int fi = 0; fi < N_FAMILIES; fi++) {
        const family *f = &families[fi];
        REQUIRE_FIXTURE(path, f->path);
        model *m = test_load_model(path);
        engine *e = open_engine(m, interval, 0);
        const int V = model_get_hparams(m)->n_vocab;
        const int64_t slack = f->recurrent ? interval : KV_BLOCK_TOKENS;
        int32_t conv[AGENTS][SYS + OWN + REPLY + NEXT];
        int64_t len[AGENTS];
        test_random_tokens(&rng_state, conv[0], SYS, V);
        char what[96];
        for (int a = 0; a < AGENTS; a++) {
            memcpy(conv[a], conv[0], SYS * sizeof(int32_t));
            test_random_tokens(&rng_state, conv[a] + SYS, OWN, V);
            len[a] = SYS + OWN;
            snprintf(what, sizeof what, "%s agent %d turn 1", f->name, a + 1);
            engine_result r;
            int64_t got = computed(e, conv[a], len[a], REPLY, SYS, what, &r);
            within(what, got, a == 0 ? SYS + OWN : OWN, a == 0 ? 0 : slack);
            memcpy(conv[a] + len[a], r.tokens, REPLY * sizeof(int32_t)); /* the client echoes the reply */
            len[a] += REPLY;
            engine_result_free(&r);
        }
        for (int a = 0; a < AGENTS; a++) {
            test_random_tokens(&rng_state, conv[a] + len[a], NEXT, V);
            len[a] += NEXT;
            snprintf(what, sizeof what, "%s agent %d turn 2", f->name, a + 1);
            within(what, computed(e, conv[a], len[a], REPLY, SYS, what, NULL), NEXT, slack);
        }
        close_engine(e);
        model_free(m);
    }
}

/* ---- decode-time snapshots ---- */

/* A follow-up that keeps only part of a long reply (the client edited or cut
 * it) resumes from the snapshot decode took at the last interval point below
 * the cut, not from the prompt. */
static void test_decode_snapshots(void **st) {
    (void)st;
    enum { P = 100, GEN = 200, KEEP = 150, NEW = 20 };
    for (int fi = 0; fi < N_FAMILIES; fi++) {
        const family *f = &families[fi];
        if (!f->recurrent) continue;
        REQUIRE_FIXTURE(path, f->path);
        model *m = test_load_model(path);
        engine *e = open_engine(m, 64, 0);
        const int V = model_get_hparams(m)->n_vocab;
        int32_t t[P + GEN + NEW];
        test_random_tokens(&rng_state, t, P, V);
        char what[96];
        snprintf(what, sizeof what, "%s long reply", f->name);
        engine_result r;
        computed(e, t, P, GEN, 0, what, &r);
        memcpy(t + P, r.tokens, KEEP * sizeof(int32_t));
        engine_result_free(&r);
        test_random_tokens(&rng_state, t + P + KEEP, NEW, V);
        snprintf(what, sizeof what, "%s reply cut at %d", f->name, KEEP);
        /* shared: P + KEEP = 250; the decode snapshot at 192 serves it */
        int64_t got = computed(e, t, P + KEEP + NEW, 4, 0, what, NULL);
        within(what, got, NEW, 64);
        assert_int_equal(got, P + KEEP + NEW - 192);
        close_engine(e);
        model_free(m);
    }
}

/* ---- routing ---- */

static apc_route routed(int kv, int rot, int arr, int list, bool swa_rows, bool snaps) {
    apc_route r;
    memset(&r, 0, sizeof r);
    cache_layer layers[16];
    int n = 0;
    for (int i = 0; i < kv; i++) layers[n++] = (cache_layer){CACHE_KIND_KV, 0, 0};
    for (int i = 0; i < rot; i++) layers[n++] = (cache_layer){CACHE_KIND_ROT, 32, 0};
    for (int i = 0; i < arr; i++) layers[n++] = (cache_layer){CACHE_KIND_ARR, 0, 0};
    for (int i = 0; i < list; i++) layers[n++] = (cache_layer){CACHE_KIND_LIST, 0, 0};
    r = apc_route_stack(layers, n, true);
    apc_route_pool_rows(&r, swa_rows, snaps);
    return r;
}

static void test_route_pool_rows(void **st) {
    (void)st;
    /* sliding window: block while the pool keeps its rows, else ckpt */
    assert_int_equal(routed(1, 5, 0, 0, true, true).tier, APC_TIER_BLOCK);
    assert_false(routed(1, 5, 0, 0, true, true).snapshots);
    assert_int_equal(routed(1, 5, 0, 0, false, true).tier, APC_TIER_CKPT);
    /* recurrent: block with snapshots, else ckpt (hybrid) or exact */
    apc_route r = routed(1, 0, 3, 0, true, true);
    assert_int_equal(r.tier, APC_TIER_BLOCK);
    assert_true(r.snapshots);
    assert_int_equal(routed(1, 0, 3, 0, true, false).tier, APC_TIER_CKPT);
    assert_int_equal(routed(0, 0, 4, 0, true, true).tier, APC_TIER_BLOCK);
    assert_int_equal(routed(0, 0, 4, 0, true, false).tier, APC_TIER_EXACT);
    assert_int_equal(routed(0, 0, 0, 4, true, true).tier, APC_TIER_BLOCK);
    assert_int_equal(routed(0, 0, 0, 4, true, false).tier, APC_TIER_EXACT);
    /* rot + arr needs both */
    assert_int_equal(routed(1, 2, 2, 0, false, true).tier, APC_TIER_CKPT);
    assert_int_equal(routed(1, 2, 2, 0, true, true).tier, APC_TIER_BLOCK);
    /* dense stays block without snapshots; force exact takes them away */
    assert_false(routed(4, 0, 0, 0, true, true).snapshots);
    r = routed(0, 0, 4, 0, true, true);
    apc_route_force(&r, APC_FORCE_EXACT);
    assert_int_equal(r.tier, APC_TIER_EXACT);
    assert_false(r.snapshots);
}

/* The switches send each family back to its old tier, on real models. */
static void test_switches_off(void **st) {
    (void)st;
    static const struct {
        const char *path;
        apc_tier off;
    } rows[] = {
        {"reference/gemma3-f32.gguf", APC_TIER_CKPT},
        {"reference/qwen35-f32.gguf", APC_TIER_CKPT},
        {"reference/mamba2-f32.gguf", APC_TIER_EXACT},
        {"reference/falcon-h1-f32.gguf", APC_TIER_EXACT},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        REQUIRE_FIXTURE(path, rows[i].path);
        model *m = test_load_model(path);
        engine_config cfg = engine_default_config();
        cfg.n_threads = 1;
        cfg.n_ctx = 256;
        cfg.cache.ckpt.snapshot_interval = 0;
        cfg.cache.swa_block = false;
        engine *e = test_open_engine(m, &cfg);
        assert_int_equal(apc_get_tier(engine_cache(e)), rows[i].off);
        engine_free(e);
        model_free(m);
    }
}

/* ---- eviction ---- */

/* A pool too small for every conversation: blocks are handed out again and
 * their snapshots go with them; later lookups still equal cold runs. */
static void test_snapshots_evicted_with_blocks(void **st) {
    (void)st;
    REQUIRE_FIXTURE(path, "reference/mamba2-f32.gguf");
    model *m = test_load_model(path);
    engine *e = open_engine(m, 64, 80); /* 80 blocks: 1,280 tokens */
    const int V = model_get_hparams(m)->n_vocab;
    int32_t p[600];
    for (int i = 0; i < 6; i++) {
        test_random_tokens(&rng_state, p, 600, V);
        char what[64];
        snprintf(what, sizeof what, "mamba2 pressure %d", i);
        computed(e, p, 600, 2, 0, what, NULL);
        /* the resend still adopts N-1 */
        within(what, computed(e, p, 600, 2, 0, what, NULL), 1, 0);
    }
    apc_stats s;
    apc_get_stats(engine_cache(e), &s);
    print_message("snapshots: stores %llu, evictions %llu, entries %d, block evictions %llu\n",
                  (unsigned long long)s.snap_stores, (unsigned long long)s.snap_evictions, s.snap_entries,
                  (unsigned long long)s.evictions);
    assert_true(s.evictions > 0);
    assert_true(s.snap_evictions > 0);
    assert_true(s.snap_entries <= s.pool_used); /* a snapshot only on an indexed block */
    assert_int_equal((int64_t)s.snap_stores - (int64_t)s.snap_evictions, s.snap_entries);
    close_engine(e);
    model_free(m);
}

/* The byte budget keeps at most budget / bytes snapshots, newest first. */
static void test_snapshot_budget(void **st) {
    (void)st;
    REQUIRE_FIXTURE(path, "reference/qwen35-f32.gguf");
    model *m = test_load_model(path);
    engine_config cfg = engine_default_config();
    cfg.n_threads = 2;
    cfg.n_ctx = 1024;
    cfg.cache.ckpt.snapshot_interval = 64;
    cfg.cache.ckpt.snapshot_budget_bytes = 3 * model_state_bytes(m);
    engine *e = test_open_engine(m, &cfg);
    const int V = model_get_hparams(m)->n_vocab;
    int32_t p[700];
    test_random_tokens(&rng_state, p, 700, V);
    computed(e, p, 700, 2, 0, "qwen35 budget first", NULL);
    apc_stats s;
    apc_get_stats(engine_cache(e), &s);
    assert_int_equal(s.snap_entries, 3);
    assert_true(s.snap_evictions >= 8); /* 10 interval points, N-1, N, retirement */
    /* the newest survive: a resend still adopts N-1 */
    within("qwen35 budget resend", computed(e, p, 700, 2, 0, "qwen35 budget resend", NULL), 1, 0);
    close_engine(e);
    model_free(m);
}

/* ---- the exact tier by bytes ---- */

/* Six agents, two turns each, interleaved, on the exact tier (mamba2 with
 * snapshots off): every agent's turn 2 resumes from its own retirement
 * snapshot. A count cap of 4 (the old default) evicted the first agents'
 * entries before their second turn; the byte budget keeps them all. */
static void test_exact_agents_by_bytes(void **st) {
    (void)st;
    enum { AGENTS = 6, SYS = 100, OWN = 30, REPLY = 4, NEXT = 10 };
    REQUIRE_FIXTURE(path, "reference/mamba2-f32.gguf");
    model *m = test_load_model(path);
    engine_config cfg = engine_default_config();
    cfg.n_threads = 2;
    cfg.n_ctx = 512;
    cfg.cache.ckpt.snapshot_interval = 0;
    engine *e = test_open_engine(m, &cfg);
    assert_int_equal(apc_get_tier(engine_cache(e)), APC_TIER_EXACT);
    const int V = model_get_hparams(m)->n_vocab;
    int32_t conv[AGENTS][SYS + OWN + REPLY + NEXT];
    int64_t len[AGENTS];
    test_random_tokens(&rng_state, conv[0], SYS, V);
    char what[64];
    for (int a = 0; a < AGENTS; a++) {
        memcpy(conv[a], conv[0], SYS * sizeof(int32_t));
        test_random_tokens(&rng_state, conv[a] + SYS, OWN, V);
        len[a] = SYS + OWN;
        snprintf(what, sizeof what, "exact agent %d turn 1", a + 1);
        engine_result r;
        computed(e, conv[a], len[a], REPLY, 0, what, &r);
        memcpy(conv[a] + len[a], r.tokens, REPLY * sizeof(int32_t));
        len[a] += REPLY;
        engine_result_free(&r);
    }
    for (int a = 0; a < AGENTS; a++) {
        test_random_tokens(&rng_state, conv[a] + len[a], NEXT, V);
        len[a] += NEXT;
        snprintf(what, sizeof what, "exact agent %d turn 2", a + 1);
        within(what, computed(e, conv[a], len[a], REPLY, 0, what, NULL), NEXT, 0);
    }
    apc_stats s;
    apc_get_stats(engine_cache(e), &s);
    assert_int_equal(s.exact_max_entries, 0);
    assert_true(s.exact_entries > 4);
    close_engine(e);
    model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_route_pool_rows),
        cmocka_unit_test(test_switches_off),
        cmocka_unit_test(test_branch_64),
        cmocka_unit_test(test_branch_128),
        cmocka_unit_test(test_siblings),
        cmocka_unit_test(test_decode_snapshots),
        cmocka_unit_test(test_snapshots_evicted_with_blocks),
        cmocka_unit_test(test_snapshot_budget),
        cmocka_unit_test(test_exact_agents_by_bytes),
    };
    return test_run_group(tests, NULL, NULL);
}
