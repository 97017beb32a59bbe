/* test_resend_default.c - an identical resend under the default cache
 * settings, on every family (issue 10, item 4).
 *
 * With the engine's and the cache's defaults (the cache reads no
 * environment), a request sent twice forwards exactly one prompt token the
 * second time once N >= cache.ckpt.replay_min's default (64), on every
 * tier: block (llama, qwen3, qwen3moe), ckpt (gemma3's sliding window,
 * qwen35's and qwen3next's gated delta net) and exact (mamba2, falcon-h1).
 * Below it a resend forwards at most N tokens, less than one prefill grid
 * step. Prompt lengths straddle the grid step (512) and the old replay gate
 * (1024), where qwen35 used to recompute 488 of 1000 tokens. Warm output is
 * bit-identical to cold (design.md invariant 1). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "apc/apc.h"
#include "engine/engine.h"
#include "model/model.h"
#include "test_util.h"

static const char *const FIXTURES[] = {
    "reference/llama-gqa-f32.gguf", "reference/qwen3-f32.gguf",  "reference/qwen3moe-f32.gguf",
    "reference/gemma3-f32.gguf",    "reference/qwen35-f32.gguf", "reference/qwen3next-normjit-f32.gguf",
    "reference/mamba2-f32.gguf",    "reference/falcon-h1-f32.gguf",
};

static void check_family(const char *rel) {
    const char *path = fixture_path(rel);
    if (path == NULL) return;
    ember_error err;
    model *m = model_load(path, &err);
    if (m == NULL) fail_msg("%s: %s", path, err.msg);
    engine_config cfg = engine_default_config();
    cfg.n_threads = 2;
    cfg.n_ctx = 1100;
    engine *e = engine_create(m, &cfg, &err);
    if (e == NULL) fail_msg("%s: %s", path, err.msg);
    static const int64_t ns[] = {40, 64, 600, 1000};
    int32_t *prompt = malloc(1000 * sizeof *prompt);
    uint64_t seed = 0x9e3779b97f4a7c15ull;
    test_random_tokens(&seed, prompt, 1000, model_get_hparams(m)->n_vocab);
    for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
        int64_t n = ns[i];
        apc_reset(engine_cache(e));
        engine_result cold, first, warm;
        memset(&cold, 0, sizeof cold);
        memset(&first, 0, sizeof first);
        memset(&warm, 0, sizeof warm);
        test_generate(e, prompt, n, 2, ENGINE_CACHE_BYPASS, &cold);
        test_generate(e, prompt, n, 2, ENGINE_CACHE_ON, &first);
        test_generate(e, prompt, n, 2, ENGINE_CACHE_ON, &warm);
        char what[160];
        snprintf(what, sizeof what, "%s resend N=%lld", rel, (long long)n);
        assert_warm_equals_cold(&cold, &warm, what);
        print_message("%-40s N=%5lld: resend forwarded %lld\n", rel, (long long)n, (long long)warm.prompt_forwarded);
        if (n >= 64 && warm.prompt_forwarded != 1)
            fail_msg("%s: forwarded %lld prompt tokens, want 1", what, (long long)warm.prompt_forwarded);
        if (warm.prompt_forwarded > n || warm.prompt_forwarded < 1) fail_msg("%s: forwarded %lld", what,
                                                                          (long long)warm.prompt_forwarded);
        engine_result_free(&cold);
        engine_result_free(&first);
        engine_result_free(&warm);
    }
    free(prompt);
    engine_free(e);
    model_free(m);
}

static void test_default_resend_every_family(void **state) {
    (void)state;
    REQUIRE_FIXTURE(index, "reference/index.json");
    for (size_t i = 0; i < sizeof FIXTURES / sizeof FIXTURES[0]; i++) check_family(FIXTURES[i]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_resend_every_family),
    };
    return test_run_group(tests, NULL, NULL);
}
