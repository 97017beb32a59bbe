/* test_spec_prefix.c - the prefix layer (L0) of speculating engines.
 *
 * With the prompt cache off (cache.enabled false: the only layer left), a
 * speculating engine keeps each prompt's post-prefill snapshot in L0:
 *   - an identical resend adopts N-1 tokens (K/V rows cut there, the state
 *     at N-1), a prompt that extends a stored one adopts all of it (state at
 *     n); both give the plain engine's tokens and logits bit for bit
 *     (memcmp), on the MTP hybrid fixture (gated delta net + attention,
 *     the head teacher-forced from the stored hidden rows: its drafts, and
 *     so its acceptance, equal the cold run's, digest for digest), on a
 *     dense llama, a sliding-window gemma3 and a recurrent-only mamba2
 *     with prompt lookup;
 *   - counters: spec_prefix_hits / hit_tokens / stores add up;
 *   - an entry larger than the byte budget is skipped and counted, and the
 *     resend then runs cold;
 *   - with the cache on, L0 stores nothing: the pools hold the prompt.
 * Through the API: `ember serve --no-cache --spec lookup` counts L0 hits in
 * /v1/cache/stats and /metrics, and its routing line says speculation and
 * L0 are on.
 *
 * The MTP sidecar's SSD mirror: an engine with the SSD tier stores the
 * target's prompt and the head's sidecar; a second engine on the same
 * directory (a restart) restores both, so its head drafts exactly what the
 * cold run drafted (digest and acceptance equal); with the sidecar off the
 * restarted head starts cold and drafts differently.
 *
 * The draft model's sidecar (in memory): a resend's draft model adopts its
 * K/V (and, recurrent, its state) of the prompt instead of prefilling it:
 * the same drafts (digest), the same output, fewer draft-model rows. On a
 * dense pair (llama-gqa drafted by llama256-q8_0) and a recurrent one
 * (qwen35 drafting itself). */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "http_client.h"
#include "serve/serve_metrics.h"
#include "test_util.h"

typedef struct prompt_ids {
    int32_t ids[640];
    int n;
} prompt_ids;

static bool load_prompt(const char *name, prompt_ids *p) {
    p->n = test_load_prompt_ids(name, p->ids, 512);
    return p->n > 0;
}

enum { GEN = 16 };

static void generate(engine *e, const prompt_ids *p, engine_result *r) {
    engine_request req = engine_default_request();
    req.prompt = p->ids;
    req.n_prompt = p->n;
    req.max_tokens = GEN;
    req.stop_at_eog = false;
    req.want_logits = true;
    ember_error err;
    if (engine_generate(e, &req, r, &err) < 0) fail_msg("engine_generate: %s", err.msg);
}

static engine *open_engine(const model *m, spec_kind kind, bool cache_on, size_t prefix_bytes) {
    engine_config cfg = engine_default_config();
    cfg.n_threads = 2;
    cfg.n_ctx = 1024;
    cfg.cache.enabled = cache_on;
    cfg.spec.kind = kind;
    cfg.spec.k = 4;
    cfg.spec.adaptive = false;
    cfg.spec.prefix_entries = 4;
    cfg.spec.prefix_bytes = prefix_bytes;
    cfg.spec.prefix_min = 8;
    cfg.spec.sidecar_entries = 4;
    cfg.spec.sidecar_bytes = (size_t)64 << 20;
    return test_open_engine(m, &cfg);
}

/* p2 = p + the reply of a cold run + a few more tokens of the prompt. */
static void extend(const prompt_ids *p, const engine_result *r, prompt_ids *p2) {
    *p2 = *p;
    for (int i = 0; i < r->n_tokens; i++) p2->ids[p2->n++] = r->tokens[i];
    for (int i = 0; i < 5; i++) p2->ids[p2->n++] = p->ids[1 + i];
}

/* full: also the byte-budget skip and the cache-on division (the others only
 * prove L0 itself on more cache kinds, and keep the ASan run short). */
static void check_model(const char *name, spec_kind kind, bool full) {
    char rel[256];
    snprintf(rel, sizeof rel, "reference/%s.gguf", name);
    const char *path = fixture_path(rel);
    prompt_ids p, p2;
    if (path == NULL || !load_prompt(name, &p)) return;
    model *m = test_load_model(path);
    /* what a plain engine (no speculation, no cache) gives */
    engine *plain = open_engine(m, SPEC_OFF, false, 0);
    engine_result want, want2;
    generate(plain, &p, &want);
    extend(&p, &want, &p2);
    generate(plain, &p2, &want2);
    engine_free(plain);

    engine *e = open_engine(m, kind, false, (size_t)256 << 20);
    assert_int_equal(apc_get_tier(engine_cache(e)), APC_TIER_NONE);
    engine_result cold, resend, longer;
    generate(e, &p, &cold);
    prefix_stats st = prefix_get_stats(engine_prefix(e));
    assert_int_equal(st.stores, 1);
    assert_int_equal(st.hits, 0);
    assert_int_equal(cold.cached_tokens, 0);
    generate(e, &p, &resend);
    generate(e, &p2, &longer);
    st = prefix_get_stats(engine_prefix(e));
    char what[160];
    snprintf(what, sizeof what, "%s L0 cold", name);
    assert_warm_equals_cold(&want, &cold, what);
    snprintf(what, sizeof what, "%s L0 identical resend", name);
    assert_warm_equals_cold(&want, &resend, what);
    snprintf(what, sizeof what, "%s L0 extended prompt", name);
    assert_warm_equals_cold(&want2, &longer, what);
    assert_int_equal(resend.cached_tokens, p.n - 1);
    assert_int_equal(resend.cache_source, APC_SOURCE_PREFIX);
    assert_int_equal(resend.prompt_forwarded, 1);
    assert_int_equal(longer.cached_tokens, p.n);
    assert_int_equal(longer.cache_source, APC_SOURCE_PREFIX);
    assert_int_equal(st.hits, 2);
    assert_int_equal(st.hit_tokens, (uint64_t)(p.n - 1 + p.n));
    assert_int_equal(st.stores, 2); /* p (the resend found its own entry) and p2 */
    assert_int_equal(st.entries, 2);
    /* The drafter sees the prefix it would have seen cold: same drafts. */
    if (kind == SPEC_MTP) {
        assert_true(resend.spec.digest == cold.spec.digest);
        /* L0 holds the hidden rows: the sidecar keeps nothing of its own */
        assert_int_equal(spec_sidecar_get_stats(engine_drafter(e)).writes, 0);
    }
    assert_int_equal(resend.spec.accepted, cold.spec.accepted);
    print_message("%s: L0 resend adopts %lld of %d, extension %lld of %d; %d entries, %zu bytes; accepted cold %lld "
                  "resend %lld of %lld drafts; TTFT cold %.2f ms, resend %.2f ms, cold extension (plain) %.2f ms, "
                  "L0 extension %.2f ms\n",
                  name, (long long)resend.cached_tokens, p.n, (long long)longer.cached_tokens, p2.n, st.entries, st.bytes,
                  (long long)cold.spec.accepted, (long long)resend.spec.accepted, (long long)resend.spec.drafted,
                  cold.ttft_s * 1e3, resend.ttft_s * 1e3, want2.ttft_s * 1e3, longer.ttft_s * 1e3);
    test_assert_no_block_leaks(e);
    engine_result_free(&cold);
    engine_result_free(&resend);
    engine_result_free(&longer);
    engine_free(e);
    if (!full) goto done;

    /* A budget smaller than one entry: skipped, counted, the resend is cold. */
    e = open_engine(m, kind, false, 4096);
    generate(e, &p, &cold);
    generate(e, &p, &resend);
    st = prefix_get_stats(engine_prefix(e));
    assert_int_equal(st.stores, 0);
    assert_int_equal(st.skips, 2);
    assert_int_equal(st.hits, 0);
    assert_int_equal(resend.cached_tokens, 0);
    assert_warm_equals_cold(&want, &resend, "L0 over budget: cold");
    engine_result_free(&cold);
    engine_result_free(&resend);
    engine_free(e);

    /* With the cache on the pools keep the prompt: L0 stores nothing. */
    e = open_engine(m, kind, true, (size_t)256 << 20);
    generate(e, &p, &cold);
    generate(e, &p, &resend);
    st = prefix_get_stats(engine_prefix(e));
    assert_int_equal(st.stores, 0);
    assert_true(resend.cached_tokens > 0);
    assert_true(resend.cache_source != APC_SOURCE_PREFIX);
    if (kind == SPEC_MTP) { /* ... and the sidecar the head beside them */
        spec_sidecar_stats side = spec_sidecar_get_stats(engine_drafter(e));
        assert_true(side.writes >= 1);
        assert_int_equal(side.hits, 1);
        assert_true(resend.spec.digest == cold.spec.digest);
    }
    assert_warm_equals_cold(&want, &resend, "cache on: pools");
    engine_result_free(&cold);
    engine_result_free(&resend);
    engine_free(e);
done:
    engine_result_free(&want);
    engine_result_free(&want2);
    model_free(m);
}

static void test_l0_cache_off(void **unused) {
    (void)unused;
    check_model("qwen35-mtp-normjit-f32", SPEC_MTP, true);
    check_model("llama-gqa-f32", SPEC_LOOKUP, true);
    check_model("gemma3-f32", SPEC_LOOKUP, false);  /* sliding-window layers */
    check_model("mamba2-f32", SPEC_LOOKUP, false);  /* recurrent only: no K/V rows at all */
}

/* The LRU keeps at most `entries`, the least recently used goes first. */
static void test_l0_lru(void **unused) {
    (void)unused;
    const char *path = fixture_path("reference/llama-gqa-f32.gguf");
    prompt_ids p;
    if (path == NULL || !load_prompt("llama-gqa-f32", &p)) return;
    model *m = test_load_model(path);
    engine_config cfg = engine_default_config();
    cfg.n_threads = 2;
    cfg.n_ctx = 1024;
    cfg.cache.enabled = false;
    cfg.spec.kind = SPEC_LOOKUP;
    cfg.spec.k = 4;
    cfg.spec.prefix_entries = 2;
    cfg.spec.prefix_bytes = (size_t)64 << 20;
    cfg.spec.prefix_min = 8;
    engine *e = test_open_engine(m, &cfg);
    prompt_ids q[3];
    engine_result r;
    for (int i = 0; i < 3; i++) { /* three prompts that differ in their first token */
        q[i] = p;
        q[i].ids[1] = (p.ids[1] + 1 + i) % model_get_hparams(m)->n_vocab;
        generate(e, &q[i], &r);
        engine_result_free(&r);
    }
    prefix_stats st = prefix_get_stats(engine_prefix(e));
    assert_int_equal(st.stores, 3);
    assert_int_equal(st.entries, 2);
    assert_int_equal(st.evictions, 1);
    assert_int_equal(prefix_peek(engine_prefix(e), q[0].ids, q[0].n, 0), 0); /* the oldest went */
    assert_int_equal(prefix_peek(engine_prefix(e), q[2].ids, q[2].n, 0), q[2].n - 1);
    assert_int_equal(prefix_peek(engine_prefix(e), q[2].ids, q[2].n, 7), 0); /* another tenant's salt */
    prefix_clear(engine_prefix(e));
    assert_int_equal(prefix_get_stats(engine_prefix(e)).entries, 0);
    engine_free(e);
    model_free(m);
}

static double json_num(const char *body, const char *key) {
    cJSON *j = cJSON_Parse(body);
    double v = cJSON_GetNumberValue(cJSON_GetObjectItem(j, key));
    cJSON_Delete(j);
    return v;
}

static void test_l0_api(void **unused) {
    (void)unused;
    if (ember_binary() == NULL) {
        print_message("skipping: EMBER_BIN is not set (run under ctest)\n");
        skip();
    }
    const char *fp = fixture_path("reference/llama-gqa-f32.gguf");
    if (fp == NULL) return;
    char path[1024], log[1200];
    snprintf(path, sizeof path, "%s", fp);
    char *dir = make_temp_dir();
    snprintf(log, sizeof log, "%s/server.log", dir);
    char *const extra[] = {"--no-cache", "--spec", "lookup", "--spec-prefix-min", "8", NULL};
    pid_t pid;
    int port = http_spawn_ember(ember_binary(), path, extra, log, &pid);
    assert_true(port > 0);
    const char *body = "{\"prompt\": [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28], "
                       "\"max_tokens\": 8, \"temperature\": 0, \"logprobs\": 2, \"ignore_eos\": true}";
    char *a = NULL, *b = NULL, *stats = NULL, *metrics = NULL;
    assert_int_equal(http_call(port, "POST", "/v1/completions", NULL, body, &a), 200);
    assert_int_equal(http_call(port, "POST", "/v1/completions", NULL, body, &b), 200);
    cJSON *ja = cJSON_Parse(a), *jb = cJSON_Parse(b);
    char *ca = cJSON_PrintUnformatted(cJSON_GetArrayItem(cJSON_GetObjectItem(ja, "choices"), 0));
    char *cb = cJSON_PrintUnformatted(cJSON_GetArrayItem(cJSON_GetObjectItem(jb, "choices"), 0));
    assert_string_equal(ca, cb); /* text and logprobs, warm from L0 */
    assert_int_equal(http_call(port, "GET", "/v1/cache/stats", NULL, NULL, &stats), 200);
    assert_int_equal(json_num(stats, "spec_prefix_stores"), 1);
    assert_int_equal(json_num(stats, "spec_prefix_hits"), 1);
    assert_int_equal(json_num(stats, "spec_prefix_hit_tokens"), 18);
    assert_int_equal(http_call(port, "GET", "/metrics", NULL, NULL, &metrics), 200);
    assert_int_equal((int)serve_metrics_text_sum(metrics, "ember_apc_spec_prefix_hits_total"), 1);
    assert_int_equal((int)serve_metrics_text_sum(metrics, "ember_apc_spec_prefix_hit_tokens_total"), 18);
    assert_int_equal((int)serve_metrics_text_sum(metrics, "ember_apc_spec_prefix_stores_total"), 1);
    assert_int_equal(json_num(stats, "spec_prefix_entries"), 1);
    char *reset = NULL, *after = NULL; /* a cache reset empties L0 too, the counters stay */
    assert_int_equal(http_call(port, "POST", "/v1/cache/reset", NULL, "{}", &reset), 200);
    assert_int_equal(http_call(port, "GET", "/v1/cache/stats", NULL, NULL, &after), 200);
    assert_int_equal(json_num(after, "spec_prefix_entries"), 0);
    assert_int_equal(json_num(after, "spec_prefix_hits"), 1);
    free(reset);
    free(after);
    assert_int_equal(http_stop_server(&pid, 5000), 0);
    char *text = read_whole_file(log, NULL);
    assert_non_null(text);
    assert_non_null(strstr(text, "APC OFF for this model"));
    assert_non_null(strstr(text, "speculation lookup (k=4), L0 on (4 entries"));
    free(text);
    free(ca);
    free(cb);
    cJSON_Delete(ja);
    cJSON_Delete(jb);
    free(a);
    free(b);
    free(stats);
    free(metrics);
    remove_tree(dir);
    free(dir);
}

static engine *open_disk(const model *m, const char *dir, int sidecar_entries) {
    engine_config cfg = engine_default_config();
    cfg.n_threads = 2;
    cfg.n_ctx = 1024;
    cfg.cache.disk.path = dir;
    cfg.spec.kind = SPEC_MTP;
    cfg.spec.k = 4;
    cfg.spec.adaptive = false;
    cfg.spec.sidecar_entries = sidecar_entries;
    cfg.spec.sidecar_bytes = (size_t)64 << 20;
    return test_open_engine(m, &cfg);
}

static void test_sidecar_ssd_restart(void **unused) {
    (void)unused;
    const char *fp = fixture_path("reference/qwen35-mtp-normjit-f32.gguf");
    prompt_ids p;
    if (fp == NULL || !load_prompt("qwen35-mtp-normjit-f32", &p)) return;
    model *m = test_load_model(fp);
    engine *plain = open_engine(m, SPEC_OFF, false, 0);
    engine_result want;
    generate(plain, &p, &want);
    engine_free(plain);
    char *dir = make_temp_dir();

    engine *a = open_disk(m, dir, 4);
    engine_result cold;
    generate(a, &p, &cold);
    apc_flush(engine_cache(a));
    spec_sidecar_stats sa = spec_sidecar_get_stats(engine_drafter(a));
    assert_true(sa.disk_writes >= 1);
    engine_free(a);

    engine *b = open_disk(m, dir, 4); /* the restart */
    engine_result warm;
    generate(b, &p, &warm);
    spec_sidecar_stats sb = spec_sidecar_get_stats(engine_drafter(b));
    print_message("sidecar over a restart: target %lld of %d tokens from the SSD tier; %lld sidecar files written, "
                  "%lld read back, %lld head restores; digests cold %016llx warm %016llx, accepted %lld / %lld\n",
                  (long long)warm.cached_tokens, p.n, (long long)sa.disk_writes, (long long)sb.disk_loads,
                  (long long)sb.hits, (unsigned long long)cold.spec.digest, (unsigned long long)warm.spec.digest,
                  (long long)cold.spec.accepted, (long long)warm.spec.accepted);
    assert_warm_equals_cold(&want, &cold, "sidecar SSD: cold");
    assert_warm_equals_cold(&want, &warm, "sidecar SSD: after the restart");
    assert_true(warm.cached_tokens > 0);
    assert_int_equal(sb.disk_loads, 1);
    assert_int_equal(sb.hits, 1);
    assert_true(cold.spec.drafted > 0);
    assert_true(warm.spec.digest == cold.spec.digest);
    assert_int_equal(warm.spec.accepted, cold.spec.accepted);
    engine_result_free(&warm);
    engine_free(b);

    engine *c = open_disk(m, dir, 0); /* restarted without the sidecar: a cold head */
    generate(c, &p, &warm);
    assert_true(warm.cached_tokens > 0);
    assert_warm_equals_cold(&want, &warm, "no sidecar after the restart");
    assert_true(warm.spec.digest != cold.spec.digest);
    engine_result_free(&warm);
    engine_free(c);

    engine_result_free(&cold);
    engine_result_free(&want);
    remove_tree(dir);
    free(dir);
    model_free(m);
}

static void draft_sidecar(const char *target, const char *draft) {
    char rel[256];
    snprintf(rel, sizeof rel, "reference/%s.gguf", target);
    const char *tp = fixture_path(rel);
    prompt_ids p;
    if (tp == NULL || !load_prompt(target, &p)) return;
    char tpath[1024];
    snprintf(tpath, sizeof tpath, "%s", tp);
    snprintf(rel, sizeof rel, "reference/%s.gguf", draft);
    const char *dp = fixture_path(rel);
    if (dp == NULL) return;
    model *m = test_load_model(tpath), *dm = test_load_model(dp);
    engine *plain = open_engine(m, SPEC_OFF, true, 0);
    engine_result want;
    generate(plain, &p, &want);
    engine_free(plain);
    engine_config cfg = engine_default_config();
    cfg.n_threads = 2;
    cfg.n_ctx = 1024;
    cfg.spec.kind = SPEC_DRAFT;
    cfg.spec.draft = dm;
    cfg.spec.k = 4;
    cfg.spec.adaptive = false;
    cfg.spec.sidecar_entries = 4;
    cfg.spec.sidecar_bytes = (size_t)64 << 20;
    engine *e = test_open_engine(m, &cfg);
    engine_result cold, warm;
    generate(e, &p, &cold);
    spec_sidecar_stats s0 = spec_sidecar_get_stats(engine_drafter(e));
    generate(e, &p, &warm);
    spec_sidecar_stats s1 = spec_sidecar_get_stats(engine_drafter(e));
    int64_t cold_rows = s0.draft_rows, warm_rows = s1.draft_rows - s0.draft_rows;
    print_message("%s drafted by %s: draft-model rows cold %lld, resend %lld (%lld restored from the sidecar); "
                  "%lld writes; accepted %lld / %lld of %lld\n",
                  target, draft, (long long)cold_rows, (long long)warm_rows, (long long)s1.restored_rows,
                  (long long)s1.writes, (long long)cold.spec.accepted, (long long)warm.spec.accepted,
                  (long long)warm.spec.drafted);
    char what[160];
    snprintf(what, sizeof what, "%s draft sidecar: cold", target);
    assert_warm_equals_cold(&want, &cold, what);
    snprintf(what, sizeof what, "%s draft sidecar: resend", target);
    assert_warm_equals_cold(&want, &warm, what);
    assert_true(s0.writes >= 1);
    assert_int_equal(s0.hits, 0);
    assert_int_equal(s1.hits, 1);
    assert_int_equal(s1.restored_rows, p.n);
    assert_true(warm.spec.digest == cold.spec.digest);
    assert_int_equal(warm.spec.accepted, cold.spec.accepted);
    assert_int_equal(warm_rows, cold_rows - p.n);
    engine_result_free(&cold);
    engine_result_free(&warm);
    engine_result_free(&want);
    engine_free(e);
    model_free(m);
    model_free(dm);
}

static void test_draft_sidecar(void **unused) {
    (void)unused;
    draft_sidecar("llama-gqa-f32", "llama256-q8_0");
    draft_sidecar("qwen35-f32", "qwen35-f32");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_l0_cache_off),
        cmocka_unit_test(test_l0_lru),
        cmocka_unit_test(test_l0_api),
        cmocka_unit_test(test_sidecar_ssd_restart),
        cmocka_unit_test(test_draft_sidecar),
    };
    return test_run_group(tests, NULL, NULL);
}
