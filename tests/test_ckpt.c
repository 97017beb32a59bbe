/* test_ckpt.c - the checkpoint tier (gemma3, qwen35, qwen3next) and the
 * exact tier with recurrent state (mamba2, falcon-h1), end to end.
 *
 * Every warm result is compared bit for bit (tokens and the logits of every
 * generated step, memcmp) with a cold run of the same request
 * (ENGINE_CACHE_BYPASS). The fixtures are tiny reference models (vocab 512);
 * intervals, the replay floor and the prefill step are scaled down so that
 * prompts of a few hundred tokens exercise every schedule point.
 *
 * Covered: the prefill schedule's worked examples (reference §7.2); per
 * family an identical resend (adopts N-1), a multi-turn conversation (each
 * turn re-prefills its new tokens, plus at most one grid unit on arr
 * stacks), parallel agents restoring from the system-prompt anchor, a branch
 * adopting an interval checkpoint, a pool under pressure (evictions counted,
 * no missed adoptions); the store/lookup intersection table (§16.5) on GDN
 * and SWA; retention (strip-on-extend, §16.4 C9); decode-time snapshots
 * serving a reply whose render diverges (thinking stripped); both tripwires
 * firing exactly once; the stats JSON. */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "apc/apc_ckpt.h"
#include "apc/apc_req.h"
#include "core/log.h"
#include "engine/engine.h"
#include "serve/serve_stats.h"
#include "test_util.h"

#define GEMMA3 "reference/gemma3-f32.gguf"
#define QWEN35 "reference/qwen35-f32.gguf"
#define QWEN3NEXT "reference/qwen3next-normjit-f32.gguf"
#define MAMBA2 "reference/mamba2-f32.gguf"
#define FALCONH1 "reference/falcon-h1-f32.gguf"

typedef struct family {
    const char *name, *path;
    apc_tier tier;
    bool arr;
} family;

static const family families[] = {
    {"gemma3", GEMMA3, APC_TIER_CKPT, false},
    {"qwen35", QWEN35, APC_TIER_CKPT, true},
    {"qwen3next", QWEN3NEXT, APC_TIER_CKPT, true},
    {"mamba2", MAMBA2, APC_TIER_EXACT, true},
    {"falcon-h1", FALCONH1, APC_TIER_EXACT, true},
};
#define N_FAMILIES (int)(sizeof families / sizeof families[0])

static uint64_t rng_state = 0x2545f4914f6cdd1dull;
static void random_tokens(int32_t *t, int64_t n, int vocab) { test_random_tokens(&rng_state, t, n, vocab); }

/* Small intervals for tiny models. */
static apc_ckpt_config test_ckpt_config(void) {
    apc_ckpt_config c = apc_ckpt_default_config();
    c.interval = 64;
    c.replay_min = 48;
    c.sys_min = 32;
    c.decode_interval = 0;
    c.tripwire = 5;
    c.snapshot_interval = 0; /* this file tests the ckpt and exact tiers (test_snap.c the block tier's snapshots) */
    return c;
}

static engine *open_engine(const model *m, int step, int32_t num_blocks, const apc_ckpt_config *ck) {
    engine_config cfg = engine_default_config();
    cfg.n_threads = 2;
    cfg.prefill_step = step;
    cfg.num_blocks = num_blocks;
    cfg.n_ctx = 1024;
    cfg.cache.ckpt = ck ? *ck : test_ckpt_config();
    cfg.cache.swa_block = false;
    return test_open_engine(m, &cfg);
}

static void close_engine(engine *e) {
    apc_reset(engine_cache(e)); /* records release their blocks */
    test_assert_no_block_leaks(e);
    engine_free(e);
}

typedef struct req_opts {
    int max_tokens;
    int64_t turn_pos, sys_pos;
    chat_predict_fn predict;
    void *user;
} req_opts;

static void run(engine *e, const int32_t *prompt, int64_t n, const req_opts *o, engine_cache_mode mode,
                engine_result *r) {
    engine_request q = engine_default_request();
    q.prompt = prompt;
    q.n_prompt = n;
    q.max_tokens = o->max_tokens;
    q.cache = mode;
    q.stop_at_eog = false;
    q.want_logits = true;
    q.plan.turn_pos = o->turn_pos;
    q.plan.anchor_pos = o->sys_pos;
    q.plan.predictor = o->predict ? chat_turn_predictor_from_fn(o->predict, o->user) : NULL;
    ember_error err;
    int rc = engine_generate(e, &q, r, &err);
    chat_turn_predictor_free(q.plan.predictor);
    if (rc < 0) fail_msg("engine_generate (n=%lld): %s", (long long)n, err.msg);
}

/* Cold (bypass) then warm; compares; returns the adopted prefix. When out
 * is given, the warm result is handed back (caller frees). */
static int64_t check(engine *e, const int32_t *prompt, int64_t n, const req_opts *o, const char *what,
                     engine_result *out) {
    engine_result cold, warm;
    run(e, prompt, n, o, ENGINE_CACHE_BYPASS, &cold);
    run(e, prompt, n, o, ENGINE_CACHE_ON, &warm);
    assert_warm_equals_cold(&cold, &warm, what);
    assert_int_equal(warm.cached_tokens + warm.prompt_forwarded, n);
    int64_t cached = warm.cached_tokens;
    engine_result_free(&cold);
    if (out) *out = warm;
    else engine_result_free(&warm);
    return cached;
}

static apc_stats stats(engine *e) {
    apc_stats s;
    apc_get_stats(engine_cache(e), &s);
    return s;
}

/* ---- the schedule (reference §7.2 worked examples, unit 2048) ---- */

static int sched(int64_t n, int64_t restored, bool arr, int window, int64_t p_stable, int64_t sys, apc_ckpt_point *pts,
                 int64_t *bounds, int *nb) {
    apc_ckpt_sched_in in;
    memset(&in, 0, sizeof in);
    in.n = n;
    in.guard = n;
    in.restored = restored;
    in.unit = 2048;
    in.has_arr = arr;
    in.window = window;
    in.p_stable = p_stable;
    in.sys_lcp = sys;
    in.cfg = apc_ckpt_default_config();
    in.cfg.interval = 4096;
    in.cfg.replay_min = 1024;
    in.cfg.sys_min = 256;
    return apc_ckpt_schedule(&in, pts, 64, bounds, nb);
}

static void expect(const apc_ckpt_point *pts, int n, const int64_t *pos, const apc_ckpt_kind *kind, int want) {
    if (n != want) fail_msg("schedule has %d points, expected %d", n, want);
    for (int i = 0; i < n; i++) {
        if (pts[i].pos != pos[i] || pts[i].kind != kind[i])
            fail_msg("point %d: (%lld, %s), expected (%lld, %s)", i, (long long)pts[i].pos,
                     apc_ckpt_kind_name(pts[i].kind), (long long)pos[i], apc_ckpt_kind_name(kind[i]));
    }
}

static void test_schedule(void **st) {
    (void)st;
    apc_ckpt_point p[64];
    int64_t b[2];
    int nb;
    const apc_ckpt_kind B = APC_CKPT_BOUNDARY, R = APC_CKPT_REPLAY, A = APC_CKPT_ANCHOR;
    expect(p, sched(1500, 0, true, 0, 0, 0, p, b, &nb), (int64_t[]){1499}, (apc_ckpt_kind[]){R}, 1);
    expect(p, sched(500, 0, true, 0, 0, 0, p, b, &nb), NULL, NULL, 0);
    expect(p, sched(5000, 0, true, 0, 0, 0, p, b, &nb), (int64_t[]){4096, 4999}, (apc_ckpt_kind[]){B, R}, 2);
    expect(p, sched(5000, 0, true, 0, 2100, 0, p, b, &nb), (int64_t[]){2048, 4096, 4999},
           (apc_ckpt_kind[]){B, B, R}, 3);
    assert_int_equal(nb, 1);
    assert_int_equal(b[0], 2048);
    expect(p, sched(5000, 0, false, 512, 2100, 0, p, b, &nb), (int64_t[]){2048, 2100, 4096, 4999},
           (apc_ckpt_kind[]){B, B, B, R}, 4);
    expect(p, sched(5000, 0, false, 4096, 2100, 0, p, b, &nb), (int64_t[]){2048, 4096, 4999},
           (apc_ckpt_kind[]){B, B, R}, 3);
    expect(p, sched(5000, 0, false, 512, 0, 2900, p, b, &nb), (int64_t[]){2896, 4096, 4999},
           (apc_ckpt_kind[]){A, B, R}, 3);
    expect(p, sched(5000, 0, true, 0, 0, 2900, p, b, &nb), (int64_t[]){2048, 4096, 4999},
           (apc_ckpt_kind[]){A, B, R}, 3);
    expect(p, sched(4097, 0, true, 0, 0, 0, p, b, &nb), (int64_t[]){4096}, (apc_ckpt_kind[]){B}, 1);
    /* The anchor floor is sys_min, not replay_min, on arr stacks too
     * (issue 17): a 700-token system prompt anchors at 640 on a 64 grid. */
    {
        apc_ckpt_sched_in in;
        memset(&in, 0, sizeof in);
        in.n = 2000;
        in.guard = 1999;
        in.unit = 64;
        in.has_arr = true;
        in.sys_lcp = 700;
        in.cfg = apc_ckpt_default_config();
        in.cfg.interval = 0;
        in.cfg.replay_min = 1024;
        in.cfg.sys_min = 256;
        int k = apc_ckpt_schedule(&in, p, 64, b, &nb);
        bool anchored = false;
        for (int i = 0; i < k; i++)
            if (p[i].kind == A && p[i].pos == 640) anchored = true;
        assert_true(anchored);
    }
    /* restored 8192: the first interval point is 12288 */
    int n = sched(27001, 8192, true, 0, 0, 0, p, b, &nb);
    assert_int_equal(p[0].pos, 12288);
    assert_int_equal(p[n - 2].pos, 26624);
    assert_int_equal(p[n - 1].pos, 27000);
}

/* ---- identical resend, per family ---- */

static void test_resend(void **st) {
    (void)st;
    for (int f = 0; f < N_FAMILIES; f++) {
        REQUIRE_FIXTURE(path, families[f].path);
        model *m = test_load_model(path);
        engine *e = open_engine(m, 32, 0, NULL);
        assert_int_equal(apc_get_tier(engine_cache(e)), families[f].tier);
        int32_t prompt[100];
        random_tokens(prompt, 100, model_get_hparams(m)->n_vocab);
        req_opts o = {4, 0, 0, NULL, NULL};
        static const int ns[] = {70, 96, 57};
        for (int i = 0; i < 3; i++) {
            char what[64];
            snprintf(what, sizeof what, "%s resend N=%d", families[f].name, ns[i]);
            apc_reset(engine_cache(e));
            engine_result first;
            run(e, prompt, ns[i], &o, ENGINE_CACHE_ON, &first);
            assert_int_equal(first.cached_tokens, 0);
            engine_result_free(&first);
            int64_t got = check(e, prompt, ns[i], &o, what, NULL);
            if (got != ns[i] - 1) fail_msg("%s: adopted %lld", what, (long long)got);
        }
        apc_stats s = stats(e);
        if (families[f].tier == APC_TIER_CKPT) {
            assert_true(s.ckpt_hits >= 1);
            assert_true(s.ckpt_stores >= 2);
        } else {
            assert_true(s.exact_hits >= 1);
        }
        assert_int_equal(s.ckpt_missed_adoptions, 0);
        close_engine(e);
        model_free(m);
    }
}

/* ---- a multi-turn conversation ---- */

static void test_multi_turn(void **st) {
    (void)st;
    for (int f = 0; f < N_FAMILIES; f++) {
        REQUIRE_FIXTURE(path, families[f].path);
        model *m = test_load_model(path);
        const int step = 32;
        engine *e = open_engine(m, step, 0, NULL);
        int V = model_get_hparams(m)->n_vocab;
        int32_t conv[1024];
        int64_t len = 40;
        random_tokens(conv, len, V);
        req_opts o = {6, 0, 0, NULL, NULL};
        for (int turn = 0; turn < 6; turn++) {
            char what[64];
            snprintf(what, sizeof what, "%s turn %d", families[f].name, turn + 1);
            engine_result warm;
            int64_t got = check(e, conv, len, &o, what, &warm);
            if (turn > 0) {
                int64_t fwd = warm.prompt_forwarded;
                int64_t allowed = 10 + 1 + (families[f].arr && families[f].tier == APC_TIER_CKPT ? step : 0);
                if (fwd > allowed)
                    fail_msg("%s: re-prefilled %lld tokens (cached %lld of %lld), allowed %lld", what, (long long)fwd,
                             (long long)got, (long long)len, (long long)allowed);
            }
            /* The client echoes the reply and adds a user turn of 10. */
            memcpy(conv + len, warm.tokens, (size_t)warm.n_tokens * sizeof(int32_t));
            len += warm.n_tokens;
            engine_result_free(&warm);
            random_tokens(conv + len, 10, V);
            len += 10;
        }
        assert_int_equal(stats(e).ckpt_missed_adoptions, 0);
        close_engine(e);
        model_free(m);
    }
}

/* ---- parallel agents sharing a system prompt ---- */

static void test_system_anchor(void **st) {
    (void)st;
    for (int f = 0; f < N_FAMILIES; f++) {
        REQUIRE_FIXTURE(path, families[f].path);
        model *m = test_load_model(path);
        apc_ckpt_config ck = test_ckpt_config();
        ck.interval = 0; /* only the anchor can serve a sibling */
        ck.replay_min = 64;
        engine *e = open_engine(m, 32, 0, &ck);
        int V = model_get_hparams(m)->n_vocab;
        int32_t p[200];
        const int sys = 100; /* anchor: 96 on the grid (arr), 96 on the block grid (rot) */
        random_tokens(p, sys, V);
        req_opts o = {3, 0, sys, NULL, NULL};
        for (int agent = 0; agent < 4; agent++) {
            char what[64];
            snprintf(what, sizeof what, "%s agent %d", families[f].name, agent);
            random_tokens(p + sys, 30 + agent, V);
            int64_t got = check(e, p, sys + 30 + agent, &o, what, NULL);
            int64_t want = agent == 0 ? 0 : 96;
            if (families[f].tier == APC_TIER_EXACT && !families[f].arr) want = agent == 0 ? 0 : sys;
            if (got != want) fail_msg("%s: adopted %lld, expected %lld", what, (long long)got, (long long)want);
        }
        apc_stats s = stats(e);
        if (families[f].tier == APC_TIER_EXACT) {
            assert_int_equal(s.anchor_hits, 3);
            assert_true(s.anchor_stores >= 1);
        } else {
            assert_int_equal(s.ckpt_hits, 3);
        }
        close_engine(e);
        model_free(m);
    }
}

/* ---- a branch adopts an interval checkpoint ---- */

static void test_branch(void **st) {
    (void)st;
    for (int f = 0; f < N_FAMILIES; f++) {
        if (families[f].tier != APC_TIER_CKPT) continue; /* exact: whole prefixes only */
        REQUIRE_FIXTURE(path, families[f].path);
        model *m = test_load_model(path);
        int V = model_get_hparams(m)->n_vocab;
        int32_t a[220], b[220];
        random_tokens(a, 220, V);
        req_opts o = {4, 0, 0, NULL, NULL};
        for (int heavy = 2; heavy <= 4; heavy += 2) {
            apc_ckpt_config ck = test_ckpt_config();
            ck.heavy = heavy;
            engine *e = open_engine(m, 32, 0, &ck);
            /* the trunk stores 64 (anchor), 128, 192 (terminal), 219
             * (replay), 220 (p = N), 223 (retirement) */
            assert_int_equal(check(e, a, 220, &o, "trunk", NULL), 0);
            memcpy(b, a, sizeof b);
            random_tokens(b + 150, 70, V);
            /* heavy 2: strip-on-extend kept the newest two plain records
             * (220, 223); the chain's anchor at 64 serves. heavy 4: 128. */
            int64_t want = heavy == 2 ? 64 : 128;
            int64_t got = check(e, b, 220, &o, "branch at 150", NULL);
            if (got != want)
                fail_msg("%s heavy %d: branch adopted %lld, expected %lld", families[f].name, heavy, (long long)got,
                         (long long)want);
            if (heavy == 4) {
                memcpy(b, a, sizeof b);
                random_tokens(b + 200, 20, V);
                got = check(e, b, 220, &o, "branch at 200", NULL);
                assert_int_equal(got, 192);
            }
            /* back to the trunk: its replay record still serves */
            got = check(e, a, 220, &o, "trunk again", NULL);
            assert_int_equal(got, 219);
            assert_int_equal(stats(e).ckpt_missed_adoptions, 0);
            close_engine(e);
        }
        model_free(m);
    }
}

/* ---- the pool under pressure ---- */

static void test_pool_pressure(void **st) {
    (void)st;
    for (int f = 0; f < N_FAMILIES; f++) {
        if (families[f].tier != APC_TIER_CKPT) continue;
        REQUIRE_FIXTURE(path, families[f].path);
        model *m = test_load_model(path);
        engine *e = open_engine(m, 32, 24, NULL); /* 384 tokens */
        int V = model_get_hparams(m)->n_vocab;
        int32_t p[8][130];
        req_opts o = {4, 0, 0, NULL, NULL};
        for (int i = 0; i < 8; i++) {
            random_tokens(p[i], 130, V);
            check(e, p[i], 130, &o, "pressure", NULL);
        }
        /* the newest conversation is still restorable */
        int64_t got = check(e, p[7], 130, &o, "newest again", NULL);
        assert_int_equal(got, 129);
        apc_stats s = stats(e);
        if (s.ckpt_pool_evictions == 0) fail_msg("%s: no pool evictions", families[f].name);
        assert_int_equal(s.ckpt_missed_adoptions, 0);
        close_engine(e);
        model_free(m);
    }
}

/* ---- §16.5 store/lookup intersection (scaled: unit 128, replay floor 64) ---- */

static int64_t fixed_pred(void *user, const int32_t *tokens, int64_t n) {
    (void)tokens;
    int64_t p = *(const int64_t *)user;
    return p < n ? p : n;
}

static void test_intersection(void **st) {
    (void)st;
    static const struct {
        const char *path;
        int n;
        int64_t resend, turn2;
    } rows[] = {
        {QWEN35, 40, 0, 0},  {QWEN35, 94, 93, 0},  {QWEN35, 313, 312, 256},
        {GEMMA3, 40, 39, 33}, {GEMMA3, 94, 93, 87}, {GEMMA3, 313, 312, 306},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        REQUIRE_FIXTURE(path, rows[i].path);
        model *m = test_load_model(path);
        apc_ckpt_config ck = test_ckpt_config();
        ck.interval = 4096;
        ck.replay_min = 64;
        engine *e = open_engine(m, 128, 0, &ck);
        int V = model_get_hparams(m)->n_vocab;
        int N = rows[i].n;
        int64_t p_stable = N - 7; /* a 7-token generation prompt */
        int32_t q[400];
        random_tokens(q, N, V);
        req_opts o = {6, p_stable, 0, fixed_pred, &p_stable};
        engine_result r;
        run(e, q, N, &o, ENGINE_CACHE_ON, &r);
        engine_result_free(&r);
        char what[80];
        int64_t got;
        /* turn 2 first: the resend's own stores (p = N, its retirement)
         * extend the chain and strip the turn record */
        int32_t t2[400];
        memcpy(t2, q, (size_t)p_stable * sizeof(int32_t));
        random_tokens(t2 + p_stable, 37, V);
        snprintf(what, sizeof what, "%s N=%d turn 2", strstr(rows[i].path, "qwen") ? "GDN" : "SWA", N);
        req_opts o2 = {3, 0, 0, NULL, NULL};
        got = check(e, t2, p_stable + 37, &o2, what, NULL);
        if (got != rows[i].turn2) fail_msg("%s adopted %lld, expected %lld", what, (long long)got, (long long)rows[i].turn2);
        snprintf(what, sizeof what, "%s N=%d resend", strstr(rows[i].path, "qwen") ? "GDN" : "SWA", N);
        got = check(e, q, N, &o, what, NULL);
        if (got != rows[i].resend) fail_msg("%s adopted %lld, expected %lld", what, (long long)got, (long long)rows[i].resend);
        close_engine(e);
        model_free(m);
    }
}

/* ---- decode-time snapshots: the reply's render diverges (thinking stripped) ---- */

typedef struct div_pred {
    int64_t n_prompt, keep; /* the render keeps the prompt and `keep` reply tokens */
} div_pred;

static int64_t diverging_pred(void *user, const int32_t *tokens, int64_t n) {
    (void)tokens;
    const div_pred *d = user;
    int64_t p = d->n_prompt + d->keep;
    return p < n ? p : n;
}

static void test_decode_snapshots(void **st) {
    (void)st;
    for (int f = 0; f < N_FAMILIES; f++) {
        if (families[f].tier != APC_TIER_CKPT) continue;
        REQUIRE_FIXTURE(path, families[f].path);
        model *m = test_load_model(path);
        apc_ckpt_config ck = test_ckpt_config();
        ck.decode_interval = 16;
        engine *e = open_engine(m, 16, 0, &ck);
        int V = model_get_hparams(m)->n_vocab;
        int32_t conv[300];
        const int N = 64;
        random_tokens(conv, N, V);
        /* The next render keeps 40 reply tokens, then diverges (the reply's
         * tail is re-serialized): decode snapshots land at 80, 96; the
         * retirement stores the one at 96 (<= cap 104). */
        div_pred d = {N, 40};
        req_opts o = {60, 0, 0, diverging_pred, &d};
        engine_result r;
        run(e, conv, N, &o, ENGINE_CACHE_ON, &r);
        memcpy(conv + N, r.tokens, 40 * sizeof(int32_t));
        engine_result_free(&r);
        random_tokens(conv + N + 40, 12, V);
        req_opts o2 = {3, 0, 0, NULL, NULL};
        int64_t got = check(e, conv, N + 40 + 12, &o2, "after diverging reply", NULL);
        if (got != 96) fail_msg("%s: adopted %lld, expected the decode snapshot at 96", families[f].name, (long long)got);
        apc_stats s = stats(e);
        assert_int_equal(s.retire_fallback_full, 0);
        close_engine(e);
        model_free(m);
    }
}

/* ---- retention: strip-on-extend (reference §16.4 C9), on a synthetic
 * kv/rot stack without a model ---- */

static void store_boundary(apc *c, const int32_t *tokens, int64_t p, kv_seq *seq) {
    ember_error err;
    /* the conversation grows in one sequence: records share its blocks */
    if (apc_seq_prepare_append(c, seq, p - seq->n_tokens, &err) < 0) fail_msg("prepare: %s", err.msg);
    seq->n_tokens = p;
    apc_req_params rp;
    memset(&rp, 0, sizeof rp);
    rp.prompt = tokens;
    rp.n_prompt = p;
    rp.prefill_step = 1024; /* no grid points below 1024 */
    rp.store = true;
    apc_req *r = apc_req_create(c, &rp);
    assert_non_null(r);
    apc_req_lookup(r, seq, NULL); /* stores only: plans the schedule */
    apc_req_prefilled(r, seq, NULL); /* the p = N boundary */
    apc_req_free(r);
}

static int64_t probe(apc *c, const int32_t *tokens, int64_t n) {
    apc_req_params rp;
    memset(&rp, 0, sizeof rp);
    rp.prompt = tokens;
    rp.n_prompt = n;
    rp.prefill_step = 1024;
    rp.lookup = true;
    apc_req *r = apc_req_create(c, &rp);
    kv_seq seq;
    kv_seq_init(&seq);
    apc_hit h = apc_req_lookup(r, &seq, NULL);
    assert_int_equal(seq.n_tokens, h.n_tokens);
    apc_seq_release(c, &seq);
    apc_req_free(r);
    return h.n_tokens;
}

static void test_strip_on_extend(void **st) {
    (void)st;
    int kw[3] = {4, 4, 4};
    kv_pool_config kc = {3, kw, kw, 64};
    ember_error err;
    kv_pool *pool = kv_pool_create(&kc, &err);
    assert_non_null(pool);
    cache_layer stack[3] = {{CACHE_KIND_KV, 0, 0}, {CACHE_KIND_ROT, 32, 0}, {CACHE_KIND_KV, 0, 0}};
    apc_config cfg = apc_default_config();
    cfg.ckpt = test_ckpt_config();
    cfg.swa_block = false;
    cfg.ckpt.replay = false;
    apc *c = apc_create(pool, &kc, stack, NULL, &cfg, &err);
    assert_non_null(c);
    assert_int_equal(apc_get_tier(c), APC_TIER_CKPT);
    int32_t a[120];
    random_tokens(a, 120, 512);
    kv_seq seq;
    kv_seq_init(&seq);
    for (int p = 32; p <= 80; p += 16) store_boundary(c, a, p, &seq);
    apc_seq_release(c, &seq);
    apc_stats s;
    apc_get_stats(c, &s);
    assert_int_equal(s.ckpt_stores, 4);
    assert_int_equal(s.ckpt_records, 3); /* 32 (anchor), 64, 80 */
    assert_int_equal(probe(c, a, 40), 32);
    assert_int_equal(probe(c, a, 50), 32);
    assert_int_equal(probe(c, a, 66), 64);
    assert_int_equal(probe(c, a, 100), 80);
    assert_int_equal(probe(c, a, 80), 64); /* never the whole query */
    /* records pin their chains: 5 blocks (80 tokens) are referenced */
    apc_get_stats(c, &s);
    assert_int_equal(s.pool_referenced, 5);
    /* the record cap evicts non-anchors first */
    apc_reset(c);
    apc_get_stats(c, &s);
    assert_int_equal(s.pool_referenced, 0);
    apc_free(c);
    kv_pool_free(pool);
}

/* Sliding layers below the window stay on the block grid (reference §16.4
 * C4/C5): an off-grid p = N store declines `grid`; retirement truncates to
 * the block grid (ckpt_grid_truncate). */
static void test_grid_truncate(void **st) {
    (void)st;
    int kw[2] = {4, 4};
    kv_pool_config kc = {2, kw, kw, 32};
    ember_error err;
    kv_pool *pool = kv_pool_create(&kc, &err);
    assert_non_null(pool);
    cache_layer stack[2] = {{CACHE_KIND_KV, 0, 0}, {CACHE_KIND_ROT, 32, 0}};
    apc_config cfg = apc_default_config();
    cfg.ckpt = test_ckpt_config();
    cfg.swa_block = false;
    apc *c = apc_create(pool, &kc, stack, NULL, &cfg, &err);
    assert_non_null(c);
    int32_t a[64];
    random_tokens(a, 64, 512);
    kv_seq seq;
    kv_seq_init(&seq);
    assert_int_equal(apc_seq_prepare_append(c, &seq, 20, &err), 0);
    seq.n_tokens = 20;
    apc_req_params rp;
    memset(&rp, 0, sizeof rp);
    rp.prompt = a;
    rp.n_prompt = 20;
    rp.prefill_step = 1024;
    rp.store = true;
    apc_req *r = apc_req_create(c, &rp);
    apc_req_lookup(r, &seq, NULL);
    apc_req_prefilled(r, &seq, NULL);
    apc_stats s;
    apc_get_stats(c, &s);
    assert_int_equal(s.ckpt_stores, 0);
    assert_int_equal(s.ckpt_declines[APC_CKPT_DECLINE_GRID], 1);
    apc_req_retire(r, a, 20, -1, &seq, NULL);
    apc_req_free(r);
    apc_seq_release(c, &seq);
    apc_get_stats(c, &s);
    assert_int_equal(s.ckpt_stores, 1);
    assert_int_equal(s.ckpt_grid_truncate, 1);
    assert_int_equal(s.exact_stores, 0);
    assert_int_equal(probe(c, a, 30), 16);
    apc_free(c);
    kv_pool_free(pool);
}

/* ---- tripwires ---- */

static char *capture_begin(int *saved, char *tmpl) {
    int fd = mkstemp(tmpl);
    assert_true(fd >= 0);
    fflush(stderr);
    *saved = dup(2);
    dup2(fd, 2);
    close(fd);
    return tmpl;
}

static char *capture_end(int saved, const char *tmpl) {
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    char *text = read_whole_file(tmpl, NULL);
    unlink(tmpl);
    return text;
}

static int count_of(const char *text, const char *needle) {
    int n = 0;
    for (const char *p = text; (p = strstr(p, needle)) != NULL; p++) n++;
    return n;
}

static void test_tripwires(void **st) {
    (void)st;
    REQUIRE_FIXTURE(path, QWEN35);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    apc_ckpt_config ck = test_ckpt_config();
    ck.replay_min = 64;
    engine *e = open_engine(m, 128, 0, &ck);
    char tmpl[] = "/tmp/ember_ckpt_logXXXXXX";
    char tmpl2[] = "/tmp/ember_ckpt_logXXXXXX";
    int saved;
    capture_begin(&saved, tmpl);
    ember_log_level lvl = ember_log_get_level();
    ember_log_set_level(EMBER_LOG_WARN);
    /* 1. Zero stores: one-token prompts arm and store nothing (p < 2). */
    int32_t one = 7;
    req_opts o = {1, 0, 0, NULL, NULL};
    for (int i = 0; i < 8; i++) {
        engine_result r;
        run(e, &one, 1, &o, ENGINE_CACHE_ON, &r);
        engine_result_free(&r);
    }
    char *text = capture_end(saved, tmpl);
    assert_non_null(text);
    assert_int_equal(count_of(text, "requests armed with zero checkpoint stores"), 1);
    free(text);
    apc_stats s = stats(e);
    assert_int_equal(s.ckpt_stores, 0);
    assert_true(s.ckpt_declines[APC_CKPT_DECLINE_LAYOUT] >= 6);

    /* 2. Missed adoptions: only an arr replay record matches, each query
     * longer than it (the replay gate); the queries store nothing. */
    apc_reset(engine_cache(e));
    int32_t a[100];
    random_tokens(a, 80, V);
    engine_result r;
    run(e, a, 80, &o, ENGINE_CACHE_ON, &r); /* replay at 79, p=N at 80 */
    engine_result_free(&r);
    capture_begin(&saved, tmpl2);
    for (int i = 0; i < 7; i++) {
        int32_t q[100];
        memcpy(q, a, 79 * sizeof(int32_t));
        q[79] = (a[79] + 1 + i) % V;
        random_tokens(q + 80, 10, V);
        run(e, q, 90, &o, ENGINE_CACHE_LOOKUP, &r); /* its own replay would supersede a's */
        assert_int_equal(r.cached_tokens, 0);
        engine_result_free(&r);
    }
    text = capture_end(saved, tmpl2);
    ember_log_set_level(lvl);
    assert_int_equal(count_of(text, "lookups found a prefix-matching record and adopted nothing"), 1);
    free(text);
    s = stats(e);
    assert_int_equal(s.ckpt_missed_adoptions, 7);
    assert_int_equal(s.ckpt_declines[APC_CKPT_DECLINE_REPLAY_GATE], 7);
    assert_int_equal(s.ckpt_hits, 0);
    /* the stats object carries them */
    cJSON *j = serve_cache_stats_json(engine_cache(e));
    assert_int_equal((int)cJSON_GetObjectItem(j, "ckpt_missed_adoptions")->valuedouble, 7);
    assert_int_equal((int)cJSON_GetObjectItem(cJSON_GetObjectItem(j, "ckpt_declines"), "replay_gate")->valuedouble, 7);
    cJSON_Delete(j);
    close_engine(e);
    model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_schedule),        cmocka_unit_test(test_resend),
        cmocka_unit_test(test_multi_turn),      cmocka_unit_test(test_system_anchor),
        cmocka_unit_test(test_branch),          cmocka_unit_test(test_pool_pressure),
        cmocka_unit_test(test_intersection),    cmocka_unit_test(test_decode_snapshots),
        cmocka_unit_test(test_strip_on_extend), cmocka_unit_test(test_grid_truncate),
        cmocka_unit_test(test_tripwires),
    };
    return test_run_group(tests, NULL, NULL);
}
