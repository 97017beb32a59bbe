/* test_apc.c - the prompt cache on synthetic stacks and pools.
 *
 *  - routing: every row of design.md §4 and the reference's R1/R2 table,
 *    mixed and off-grid window geometries, an unsplittable kind, forcing;
 *  - keys: deterministic, chained, salted, SHA-256 and XXH3 differ;
 *  - the index: insert/find/remove against a brute-force model;
 *  - block tier: store and adopt, the N-1 cap with copy-on-write of the
 *    shared last block, salts, LRU eviction counted, refcounts back to 0;
 *  - exact tier: verbatim prefixes only, LRU by count and bytes, restore
 *    copies the rows back;
 *  - counters, the stats JSON, reset.
 * A "sequence" here is filled by hand: row values encode (token, position),
 * standing in for a forward pass. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "apc/apc.h"
#include "apc/apc_internal.h"
#include "apc/apc_key.h"
#include "apc/apc_req.h"
#include "serve/serve_stats.h"
#include "core/log.h"
#include "test_util.h"

/* ---- routing ---- */

static apc_route route_of(const char *spec, bool ckpt) {
    /* spec: one letter per layer: k kv, r rot32/0, R rot8, w rot64, a arr, l list, o other */
    cache_layer layers[32];
    int n = 0;
    for (const char *p = spec; *p; p++, n++) {
        cache_layer L = {CACHE_KIND_KV, 0, 0};
        switch (*p) {
        case 'r': L.kind = CACHE_KIND_ROT; L.window = 32; break;
        case 'R': L.kind = CACHE_KIND_ROT; L.window = 8; break;
        case 'w': L.kind = CACHE_KIND_ROT; L.window = 64; break;
        case 'a': L.kind = CACHE_KIND_ARR; break;
        case 'l': L.kind = CACHE_KIND_LIST; break;
        case 'o': L.kind = CACHE_KIND_OTHER; break;
        default: break;
        }
        layers[n] = L;
    }
    return apc_route_stack(layers, n, ckpt);
}

static void test_routing_table(void **state) {
    (void)state;
    struct { const char *spec; apc_tier tier; } rows[] = {
        {"kkkk", APC_TIER_BLOCK},   /* dense / MoE */
        {"kaaka", APC_TIER_CKPT},   /* GDN hybrid */
        {"krrkr", APC_TIER_CKPT},   /* sliding window + global */
        {"rrrr", APC_TIER_CKPT},    /* all sliding (chain-backed) */
        {"kraa", APC_TIER_CKPT},    /* kv + rot + arr */
        {"aaaa", APC_TIER_EXACT},   /* pure recurrent */
        {"ll", APC_TIER_EXACT},     /* CacheList per layer (falcon-h1) */
        {"kl", APC_TIER_EXACT},     /* a list anywhere */
        {"kkRk", APC_TIER_EXACT},   /* window 8: off the 16-token grid */
        {"krwk", APC_TIER_EXACT},   /* mixed window geometries */
        {"kko", APC_TIER_NONE},     /* unsplittable kind */
        {"alo", APC_TIER_NONE},
        {"", APC_TIER_NONE},        /* empty stack */
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        apc_route r = route_of(rows[i].spec, true);
        if (r.tier != rows[i].tier)
            fail_msg("stack '%s': tier %s, expected %s", rows[i].spec, apc_tier_name(r.tier), apc_tier_name(rows[i].tier));
    }
    apc_route r = route_of("kaaka", true);
    assert_int_equal(r.n_kv, 2);
    assert_int_equal(r.n_arr, 3);
    assert_int_equal(r.n_rot, 0);
    /* Checkpoint tier switched off: the hybrids go exact. */
    assert_int_equal(route_of("kaaka", false).tier, APC_TIER_EXACT);
    assert_int_equal(route_of("krrkr", false).tier, APC_TIER_EXACT);
    assert_int_equal(route_of("kkkk", false).tier, APC_TIER_BLOCK);
    /* Reasons name the problem. */
    assert_non_null(strstr(route_of("krwk", true).reason, "mixed window geometries"));
    assert_non_null(strstr(route_of("kkRk", true).reason, "block grid"));
    assert_non_null(strstr(route_of("kko", true).reason, "other"));
}

static void test_routing_force(void **state) {
    (void)state;
    apc_force f;
    assert_int_equal(apc_parse_force("exact", &f), 0);
    assert_int_equal(f, APC_FORCE_EXACT);
    assert_int_equal(apc_parse_force("block", &f), 0);
    assert_int_equal(f, APC_FORCE_BLOCK);
    assert_int_equal(apc_parse_force("off", &f), 0);
    assert_int_equal(f, APC_FORCE_OFF);
    assert_int_equal(apc_parse_force(NULL, &f), 0);
    assert_int_equal(f, APC_FORCE_NONE);
    assert_int_equal(apc_parse_force("ckpt", &f), -1);

    apc_route r = route_of("kkkk", true);
    apc_route_force(&r, APC_FORCE_EXACT);
    assert_int_equal(r.tier, APC_TIER_EXACT);
    assert_true(r.forced);
    r = route_of("kkkk", true);
    apc_route_force(&r, APC_FORCE_OFF);
    assert_int_equal(r.tier, APC_TIER_NONE);
    r = route_of("kaaka", true);
    apc_route_force(&r, APC_FORCE_BLOCK); /* refused: not all kv */
    assert_int_equal(r.tier, APC_TIER_CKPT);
    assert_false(r.forced);
    r = route_of("kko", true);
    apc_route_force(&r, APC_FORCE_EXACT); /* refused: cannot snapshot 'other' */
    assert_int_equal(r.tier, APC_TIER_NONE);
}

/* ---- keys ---- */

static void test_keys(void **state) {
    (void)state;
    int32_t t[48];
    for (int i = 0; i < 48; i++) t[i] = i * 7 + 1;
    apc_key a[3], b[3], x[3], s[3];
    apc_chain_keys(APC_HASH_SHA256, t, 3, 0, a);
    apc_chain_keys(APC_HASH_SHA256, t, 3, 0, b);
    apc_chain_keys(APC_HASH_XXH3, t, 3, 0, x);
    apc_chain_keys(APC_HASH_SHA256, t, 3, 42, s);
    for (int i = 0; i < 3; i++) {
        assert_true(apc_key_eq(&a[i], &b[i]));
        assert_false(apc_key_eq(&a[i], &x[i]));
        assert_false(apc_key_eq(&a[i], &s[i]));
    }
    assert_false(apc_key_eq(&a[0], &a[1]));
    /* Chained: a change in block 0 changes every later key. */
    t[3]++;
    apc_chain_keys(APC_HASH_SHA256, t, 3, 0, b);
    for (int i = 0; i < 3; i++) assert_false(apc_key_eq(&a[i], &b[i]));
    /* Known answer: the first block under salt 0 with all-zero tokens is
     * SHA-256 of 88 zero bytes, truncated to 16 bytes. */
    int32_t zeros[16] = {0};
    apc_key zero;
    memset(&zero, 0, sizeof zero);
    apc_key k = apc_block_key(APC_HASH_SHA256, &zero, 0, zeros);
    static const uint8_t want[16] = {0x10, 0xee, 0xf2, 0x85, 0xde, 0xef, 0x7a, 0x4b,
                                     0x7c, 0x82, 0xb2, 0x2a, 0xa5, 0x35, 0x89, 0xb7};
    assert_memory_equal(k.b, want, 16);
    assert_int_equal(apc_salt_for_tenant(NULL, 0), 0);
    assert_true(apc_salt_for_tenant("acme", 4) != apc_salt_for_tenant("acme2", 5));
    assert_true(apc_salt_for_tenant("acme", 4) == apc_salt_for_tenant("acme", 4));
}

/* ---- index ---- */

static void test_index_against_model(void **state) {
    (void)state;
    enum { NB = 200 };
    apc_index ix;
    assert_int_equal(apc_index_init(&ix, NB), 0);
    apc_key keys[NB];
    bool in[NB] = {false};
    uint64_t rng = 12345;
    for (int b = 0; b < NB; b++) {
        for (int j = 0; j < 16; j++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            keys[b].b[j] = (uint8_t)(rng >> 56);
        }
        /* Crowd the low bits so probe runs are long. */
        keys[b].b[0] &= 0x07;
        keys[b].b[1] = keys[b].b[2] = 0;
    }
    int32_t tokens[16] = {0};
    apc_key zero;
    memset(&zero, 0, sizeof zero);
    for (int step = 0; step < 20000; step++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        int b = (int)((rng >> 33) % NB);
        if (in[b]) apc_index_remove(&ix, b);
        else apc_index_insert(&ix, b, &keys[b], &zero, 0, tokens, 16);
        in[b] = !in[b];
        if (step % 97 == 0) {
            int count = 0;
            for (int c = 0; c < NB; c++) {
                assert_int_equal(apc_index_find(&ix, &keys[c]), in[c] ? c : -1);
                count += in[c];
            }
            assert_int_equal(ix.n_indexed, count);
        }
    }
    apc_index_clear(&ix);
    for (int c = 0; c < NB; c++) assert_int_equal(apc_index_find(&ix, &keys[c]), -1);
    apc_index_free(&ix);
}

/* ---- a synthetic cache ---- */

static const int k_width[2] = {4, 2}, v_width[2] = {4, 2};

typedef struct fixture {
    kv_pool *pool;
    apc *cache;
    kv_pool_config cfg;
} fixture;

static void fx_open(fixture *f, int32_t n_blocks, apc_force force, int exact_entries, size_t exact_bytes) {
    f->cfg = (kv_pool_config){2, k_width, v_width, n_blocks};
    ember_error err;
    f->pool = kv_pool_create(&f->cfg, &err);
    assert_non_null(f->pool);
    static const cache_layer stack[2] = {{CACHE_KIND_KV, 0, 0}, {CACHE_KIND_KV, 0, 0}};
    apc_config ac = apc_default_config();
    ac.force_tier = force;
    ac.exact_entries = exact_entries;
    if (exact_bytes) ac.exact_max_bytes = exact_bytes;
    f->cache = apc_create(f->pool, &f->cfg, stack, NULL, &ac, &err);
    assert_non_null(f->cache);
}

static void fx_close(fixture *f) {
    apc_free(f->cache);
    for (int32_t b = 0; b < kv_pool_n_blocks(f->pool); b++) assert_int_equal(kv_block_refcount(f->pool, b), 0);
    kv_pool_free(f->pool);
}

static float row_value(int32_t token, int64_t pos, int layer, int kv, int j) {
    return (float)(token * 1000 + pos) + 0.25f * (float)layer + 0.125f * (float)kv + 0.01f * (float)j;
}

/* Appends tokens[from, to) to seq as a forward pass would. */
static void fake_forward(fixture *f, kv_seq *seq, const int32_t *tokens, int64_t to) {
    int64_t from = seq->n_tokens;
    ember_error err;
    assert_int_equal(apc_seq_prepare_append(f->cache, seq, to - from, &err), 0);
    for (int64_t p = from; p < to; p++) {
        int32_t b = seq->blocks[p / KV_BLOCK_TOKENS];
        int r = (int)(p % KV_BLOCK_TOKENS);
        for (int l = 0; l < 2; l++) {
            for (int j = 0; j < k_width[l]; j++) kv_block_k(f->pool, b, l)[r * k_width[l] + j] = row_value(tokens[p], p, l, 0, j);
            for (int j = 0; j < v_width[l]; j++) kv_block_v(f->pool, b, l)[r * v_width[l] + j] = row_value(tokens[p], p, l, 1, j);
        }
    }
    seq->n_tokens = to;
}

/* Every row of seq equals what a cold forward of tokens would write. */
static void check_rows(fixture *f, const kv_seq *seq, const int32_t *tokens) {
    for (int64_t p = 0; p < seq->n_tokens; p++) {
        int32_t b = seq->blocks[p / KV_BLOCK_TOKENS];
        int r = (int)(p % KV_BLOCK_TOKENS);
        for (int l = 0; l < 2; l++) {
            for (int j = 0; j < k_width[l]; j++)
                if (kv_block_k(f->pool, b, l)[r * k_width[l] + j] != row_value(tokens[p], p, l, 0, j))
                    fail_msg("K row %lld layer %d differs", (long long)p, l);
            for (int j = 0; j < v_width[l]; j++)
                if (kv_block_v(f->pool, b, l)[r * v_width[l] + j] != row_value(tokens[p], p, l, 1, j))
                    fail_msg("V row %lld layer %d differs", (long long)p, l);
        }
    }
}

static apc_req *req_open(fixture *f, const int32_t *tokens, int64_t n, uint64_t salt, bool lookup, bool store) {
    apc_req_params p;
    memset(&p, 0, sizeof p);
    p.prompt = tokens;
    p.n_prompt = n;
    p.salt = salt;
    p.prefill_step = 512;
    p.lookup = lookup;
    p.store = store;
    apc_req *r = apc_req_create(f->cache, &p);
    assert_non_null(r);
    return r;
}

/* A lookup only (the request stores nothing). */
static apc_hit lookup_into(fixture *f, const int32_t *tokens, int64_t n, uint64_t salt, kv_seq *seq) {
    apc_req *r = req_open(f, tokens, n, salt, true, false);
    apc_hit hit = apc_req_lookup(r, seq, NULL);
    apc_req_free(r);
    return hit;
}

/* One request through the protocol: lookup, forward to N-1 (the pause
 * store), the last token, the post-prefill store. */
static int64_t request(fixture *f, const int32_t *tokens, int64_t n, uint64_t salt) {
    kv_seq seq;
    kv_seq_init(&seq);
    apc_req *r = req_open(f, tokens, n, salt, true, true);
    apc_hit hit = apc_req_lookup(r, &seq, NULL);
    assert_int_equal(apc_req_get_state(r), APC_REQ_PREFILL);
    assert_true(hit.n_tokens <= n - 1 || n == 0);
    assert_int_equal(seq.n_tokens, hit.n_tokens);
    check_rows(f, &seq, tokens);
    fake_forward(f, &seq, tokens, n - 1);
    apc_req_at(r, &seq, NULL);
    fake_forward(f, &seq, tokens, n);
    apc_req_prefilled(r, &seq, NULL);
    assert_int_equal(apc_req_get_state(r), APC_REQ_DECODE);
    check_rows(f, &seq, tokens);
    apc_req_free(r);
    apc_seq_release(f->cache, &seq);
    return hit.n_tokens;
}

static void fill_tokens(int32_t *t, int n, uint32_t seed) {
    for (int i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        t[i] = (int32_t)((seed >> 16) % 500);
    }
}

static void test_block_resend_cap(void **state) {
    (void)state;
    fixture f;
    fx_open(&f, 64, APC_FORCE_NONE, 4, 0);
    assert_int_equal(apc_get_tier(f.cache), APC_TIER_BLOCK);
    int32_t t[200];
    fill_tokens(t, 200, 7);
    for (int n = 1; n <= 100; n++) {
        apc_reset(f.cache);
        assert_int_equal(request(&f, t, n, 0), 0);
        int64_t warm = request(&f, t, n, 0);
        /* full blocks and the partial tail: everything but the last token */
        assert_int_equal(warm, n - 1);
    }
    /* The shared last block was copied, not written: a third resend of a
     * multiple of 16 still adopts clean rows. */
    apc_reset(f.cache);
    request(&f, t, 48, 0);
    assert_int_equal(request(&f, t, 48, 0), 47);
    assert_int_equal(request(&f, t, 48, 0), 47);
    fx_close(&f);
}

static void test_block_prefix_branch_salt(void **state) {
    (void)state;
    fixture f;
    fx_open(&f, 64, APC_FORCE_NONE, 4, 0);
    int32_t a[100], b[100];
    fill_tokens(a, 100, 1);
    memcpy(b, a, sizeof b);
    b[40] = (b[40] + 1) % 500; /* diverges inside block 2 */
    assert_int_equal(request(&f, a, 100, 0), 0);
    assert_int_equal(request(&f, b, 100, 0), 32);
    /* b's own blocks 2.. and its tail were stored on its branch */
    assert_int_equal(request(&f, b, 100, 0), 99);
    assert_int_equal(request(&f, a, 100, 0), 99);
    /* a prefix ending inside a stored full block gets the blocks before it */
    assert_int_equal(request(&f, a, 70, 0), 64);
    /* another salt sees nothing */
    assert_int_equal(request(&f, a, 100, 99), 0);
    assert_int_equal(request(&f, a, 100, 99), 99);
    apc_stats s;
    apc_get_stats(f.cache, &s);
    assert_int_equal(s.lookups_miss, 2);
    assert_int_equal(s.lookups_hit, 5);
    assert_int_equal(s.matched_tokens, 32 + 99 * 3 + 64);
    /* a: 6 full + tail; b: 4 full + tail; a[0:70): tail; salted a: 6 + tail */
    assert_int_equal(s.stores, 7 + 5 + 1 + 7);
    assert_int_equal(s.served_tokens, 100 + 68 + 6 + 100);
    fx_close(&f);
}

static void test_block_eviction(void **state) {
    (void)state;
    fixture f;
    fx_open(&f, 8, APC_FORCE_NONE, 4, 0);
    int32_t t[5][64];
    for (int i = 0; i < 5; i++) fill_tokens(t[i], 64, 100 + i);
    for (int round = 0; round < 3; round++)
        for (int i = 0; i < 5; i++) request(&f, t[i], 64, 0);
    apc_stats s;
    apc_get_stats(f.cache, &s);
    assert_true(s.evictions > 0);
    assert_true(s.pool_used <= 8);
    /* The most recent prompt is still there. */
    assert_int_equal(request(&f, t[4], 64, 0), 63);
    cJSON *j = serve_cache_stats_json(f.cache);
    assert_non_null(j);
    assert_true(cJSON_GetObjectItem(j, "evictions")->valuedouble > 0);
    cJSON_Delete(j);
    fx_close(&f);
}

static void test_exact_tier(void **state) {
    (void)state;
    fixture f;
    fx_open(&f, 64, APC_FORCE_EXACT, 2, 0);
    assert_int_equal(apc_get_tier(f.cache), APC_TIER_EXACT);
    int32_t a[70], b[70], c[70];
    fill_tokens(a, 70, 3);
    memcpy(b, a, sizeof b);
    b[60] = (b[60] + 1) % 500;
    fill_tokens(c, 70, 4);
    assert_int_equal(request(&f, a, 50, 0), 0);
    assert_int_equal(request(&f, a, 50, 0), 49);   /* identical resend: the N-1 snapshot */
    assert_int_equal(request(&f, a, 70, 0), 49);   /* extends it verbatim */
    assert_int_equal(request(&f, b, 70, 0), 49);   /* a's 69 is not a prefix of b; a's 49 is */
    /* The hit refreshed a49, so b69 pushed out a69 (exact_entries = 2). */
    assert_int_equal(request(&f, a, 50, 0), 49);
    assert_int_equal(request(&f, a, 70, 0), 49);    /* a69 is gone */
    assert_int_equal(request(&f, a, 70, 0), 69);    /* stored again just now */
    assert_int_equal(request(&f, a, 70, 7), 0);    /* salted: nothing */
    assert_int_equal(request(&f, c, 70, 0), 0);
    apc_stats s;
    apc_get_stats(f.cache, &s);
    assert_int_equal(s.exact_hits, 6);
    assert_int_equal(s.lookups_hit, 6);
    assert_int_equal(s.lookups_miss, 0);            /* exact misses are not counted */
    assert_int_equal(s.matched_tokens, 49 * 5 + 69);
    assert_int_equal(s.exact_entries, 2);
    assert_int_equal(s.exact_evictions, 4);
    assert_int_equal(s.stores, 0);
    apc_reset(f.cache);
    apc_get_stats(f.cache, &s);
    assert_int_equal(s.exact_entries, 0);
    assert_int_equal(s.exact_bytes, 0);
    assert_int_equal(s.exact_hits, 0);
    assert_int_equal(s.generation, 1);
    assert_int_equal(request(&f, b, 70, 0), 0);
    fx_close(&f);
}

static void test_exact_bytes(void **state) {
    (void)state;
    fixture f;
    /* 12 floats + 1 token id per position: 52 bytes; room for 100 positions. */
    fx_open(&f, 64, APC_FORCE_EXACT, 8, 5200);
    int32_t a[120], b[120];
    fill_tokens(a, 120, 5);
    fill_tokens(b, 120, 6);
    request(&f, a, 60, 0);
    request(&f, b, 60, 0);           /* 59 + 59 > 100 positions: a's entry goes */
    assert_int_equal(request(&f, a, 60, 0), 0);
    assert_int_equal(request(&f, a, 60, 0), 59);
    request(&f, a, 120, 0);          /* 119 positions: over the budget, declined */
    apc_stats s;
    apc_get_stats(f.cache, &s);
    assert_int_equal(s.declines[APC_DECLINE_EXACT_BYTES], 1);
    assert_true(s.exact_bytes <= 5200);
    cJSON *j = serve_cache_stats_json(f.cache);
    assert_int_equal((int)cJSON_GetObjectItem(cJSON_GetObjectItem(j, "declines"), "exact_bytes")->valuedouble, 1);
    cJSON_Delete(j);
    fx_close(&f);
}

static void test_stats_json_fields(void **state) {
    (void)state;
    fixture f;
    fx_open(&f, 16, APC_FORCE_NONE, 4, 0);
    int32_t t[40];
    fill_tokens(t, 40, 9);
    request(&f, t, 40, 0);
    request(&f, t, 40, 0);
    cJSON *j = serve_cache_stats_json(f.cache);
    static const char *fields[] = {
        "block_size", "num_blocks", "pool_used", "lookups_hit", "lookups_miss", "matched_tokens",
        "served_tokens", "token_hit_rate", "evictions", "stores", "disk_hits", "disk_writes", "exact_hits",
        "exact_stores", "ckpt_stores", "ckpt_hits", "ckpt_matched_tokens", "ckpt_declines",
        "ckpt_missed_adoptions", "ckpt_skeleton_writes", "sidecar_writes", "retire_fallback_full",
        "ckpt_pool_evictions", "ckpt_grid_truncate", "anchor_stores", "anchor_hits", "enabled", "tier",
        "pool_free", "pool_capacity_tokens", "declines"};
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        if (cJSON_GetObjectItem(j, fields[i]) == NULL) fail_msg("stats lack %s", fields[i]);
    assert_true(cJSON_IsTrue(cJSON_GetObjectItem(j, "enabled")));
    assert_int_equal((int)cJSON_GetObjectItem(j, "block_size")->valuedouble, 16);
    assert_int_equal((int)cJSON_GetObjectItem(j, "num_blocks")->valuedouble, 16);
    assert_int_equal((int)cJSON_GetObjectItem(j, "pool_used")->valuedouble, 3); /* 2 full + the tail */
    assert_int_equal((int)cJSON_GetObjectItem(j, "matched_tokens")->valuedouble, 39);
    assert_int_equal((int)cJSON_GetObjectItem(j, "served_tokens")->valuedouble, 40);
    assert_true(cJSON_GetObjectItem(j, "token_hit_rate")->valuedouble == 39.0 / 79.0);
    assert_string_equal(cJSON_GetObjectItem(j, "tier")->valuestring, "block");
    assert_string_equal(cJSON_GetObjectItem(j, "kv_format")->valuestring, "f32"); /* the fixture's pool */
    cJSON_Delete(j);
    fx_close(&f);

    fx_open(&f, 16, APC_FORCE_OFF, 4, 0);
    assert_int_equal(request(&f, t, 40, 0), 0);
    assert_int_equal(request(&f, t, 40, 0), 0);
    j = serve_cache_stats_json(f.cache);
    char *text = cJSON_PrintUnformatted(j);
    assert_string_equal(text, "{\"enabled\":false}");
    free(text);
    cJSON_Delete(j);
    fx_close(&f);
}

static void test_reset_keeps_live_blocks(void **state) {
    (void)state;
    fixture f;
    fx_open(&f, 16, APC_FORCE_NONE, 4, 0);
    int32_t t[40];
    fill_tokens(t, 40, 11);
    request(&f, t, 40, 0);
    kv_seq seq;
    kv_seq_init(&seq);
    assert_int_equal(lookup_into(&f, t, 40, 0, &seq).n_tokens, 39);
    apc_reset(f.cache);
    /* The adopted blocks stay the sequence's, with their rows. */
    check_rows(&f, &seq, t);
    fake_forward(&f, &seq, t, 40);
    check_rows(&f, &seq, t);
    apc_seq_release(f.cache, &seq);
    apc_stats s;
    apc_get_stats(f.cache, &s);
    assert_int_equal(s.pool_used, 0);
    assert_int_equal(s.lookups_hit, 0);
    assert_int_equal(request(&f, t, 40, 0), 0);
    fx_close(&f);
}

int main(void) {
    ember_log_set_level(EMBER_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_routing_table),
        cmocka_unit_test(test_routing_force),
        cmocka_unit_test(test_keys),
        cmocka_unit_test(test_index_against_model),
        cmocka_unit_test(test_block_resend_cap),
        cmocka_unit_test(test_block_prefix_branch_salt),
        cmocka_unit_test(test_block_eviction),
        cmocka_unit_test(test_exact_tier),
        cmocka_unit_test(test_exact_bytes),
        cmocka_unit_test(test_stats_json_fields),
        cmocka_unit_test(test_reset_keeps_live_blocks),
    };
    return test_run_group(tests, NULL, NULL);
}
