/* test_apc_disk_state.c - the SSD tier for stacks with recurrent or sliding
 * layers: exact snapshots carrying a model_state (mamba2, falcon-h1) and
 * checkpoint skeletons (gemma3, qwen35), across a restart.
 *
 * Every warm result is compared bit for bit (tokens, memcmp of the logits of
 * every generated step) with a cold run (ENGINE_CACHE_BYPASS). Adoption is
 * probed with ENGINE_CACHE_LOOKUP (a warm request that stores nothing), so
 * the same probes can be asked of memory before a restart and of the disk
 * after it:
 *  - warm restart, exact tier with state: a resend adopts N-1 from disk;
 *  - warm restart, ckpt tier: a resend adopts the same checkpoint as before
 *    (the replay point N-1), a branch the same deeper record (p = N), a
 *    second turn its turn-1 checkpoint; ckpt_skeleton_writes counts;
 *  - corruption: a flipped byte in a skeleton, a truncated skeleton, a
 *    flipped byte in a ckpt shard, a flipped byte in the state of an exact
 *    file: each a counted miss (disk_corrupt), the file gone, the answer
 *    identical to cold;
 *  - format isolation: two models with another layer mix under one root and
 *    one namespace string get different directories and adopt nothing of
 *    each other's.
 * The fixtures are tiny reference models; one thread, prefill step 32. */
/* Paths here are short temp paths; snprintf truncation cannot happen. */
#pragma GCC diagnostic ignored "-Wformat-truncation"
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "apc/apc_ckpt.h"
#include "apc/apc_disk.h"
#include "core/log.h"
#include "engine/engine.h"
#include "test_util.h"

#define GEMMA3 "reference/gemma3-f32.gguf"
#define QWEN35 "reference/qwen35-f32.gguf"
#define MAMBA2 "reference/mamba2-f32.gguf"
#define FALCONH1 "reference/falcon-h1-f32.gguf"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static void random_tokens(int32_t *t, int64_t n, int vocab) { test_random_tokens(&rng_state, t, n, vocab); }

static engine *open_engine(const model *m, const char *root, const char *ns) {
    engine_config cfg = engine_default_config();
    cfg.n_threads = 1;
    cfg.prefill_step = 32;
    cfg.n_ctx = 1024;
    cfg.cache.ckpt.interval = 64;
    cfg.cache.ckpt.replay_min = 48;
    cfg.cache.ckpt.sys_min = 32;
    cfg.cache.ckpt.decode_interval = 0;
    cfg.cache.ckpt.snapshot_interval = 0; /* the ckpt and exact tiers' disk state */
    cfg.cache.swa_block = false;
    cfg.cache.disk.path = root;
    cfg.cache.disk.namespace_override = ns;
    return test_open_engine(m, &cfg);
}

/* A lookup-only warm run compared with cold; returns the adopted prefix. */
static int64_t probe(engine *e, const int32_t *prompt, int64_t n, const char *what, apc_source *src) {
    engine_result warm, cold;
    test_generate(e, prompt, n, 3, ENGINE_CACHE_LOOKUP, &warm);
    test_generate(e, prompt, n, 3, ENGINE_CACHE_BYPASS, &cold);
    assert_warm_equals_cold(&cold, &warm, what);
    assert_int_equal(warm.cached_tokens + warm.prompt_forwarded, n);
    int64_t got = warm.cached_tokens;
    if (src) *src = warm.cache_source;
    engine_result_free(&warm);
    engine_result_free(&cold);
    return got;
}

static void ns_dir(engine *e, const char *root, char *out, size_t cap) {
    apc_stats s = test_cache_stats(e);
    assert_true(s.disk_enabled);
    snprintf(out, cap, "%s/%s", root, s.disk_namespace);
}

static bool exists(const char *dir, const char *name) {
    char p[600];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    struct stat st;
    return stat(p, &st) == 0;
}

/* The name of the file of this kind prefix ('b', 'x', 'k') whose header says
 * n_tokens tokens (any count when n < 0; for shards: the chain's first). */
static bool find_file(const char *dir, char kind, int64_t n, char *out) {
    DIR *d = opendir(dir);
    if (d == NULL) return false;
    struct dirent *de;
    bool found = false;
    while (!found && (de = readdir(d)) != NULL) {
        if (de->d_name[0] != kind || de->d_name[1] != '-') continue;
        char p[600];
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        size_t size;
        uint8_t *buf = read_whole_file(p, &size);
        if (buf == NULL || size < APC_DISK_HEADER_BYTES) {
            free(buf);
            continue;
        }
        uint32_t first;
        uint64_t nt;
        memcpy(&first, buf + 72, 4);
        memcpy(&nt, buf + 88, 8);
        free(buf);
        if (kind == 'b' ? first == 0 : (n < 0 || (int64_t)nt == n)) {
            snprintf(out, 64, "%s", de->d_name);
            found = true;
        }
    }
    closedir(d);
    return found;
}

static void flip_byte(const char *dir, const char *name, long from_end) {
    char p[600];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    size_t size;
    uint8_t *buf = read_whole_file(p, &size);
    assert_non_null(buf);
    buf[size - (size_t)from_end] ^= 0x20;
    FILE *f = fopen(p, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, size, f), size);
    fclose(f);
    free(buf);
}

/* ---- exact tier with state ---- */

static void exact_restart(const char *rel, const char *what) {
    REQUIRE_FIXTURE(path, rel);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    char *root = make_temp_dir();
    int32_t p1[70];
    random_tokens(p1, 70, V);
    apc_source src;

    engine *e = open_engine(m, root, NULL);
    assert_int_equal(apc_get_tier(engine_cache(e)), APC_TIER_EXACT);
    engine_result r;
    test_generate(e, p1, 70, 3, ENGINE_CACHE_ON, &r);
    assert_int_equal(r.cached_tokens, 0);
    engine_result_free(&r);
    assert_int_equal(probe(e, p1, 70, what, &src), 69);
    apc_flush(engine_cache(e));
    apc_stats s = test_cache_stats(e);
    assert_true(s.disk_enabled);
    assert_true(s.disk_exact_indexed >= 1);
    char dir[512], name[64];
    ns_dir(e, root, dir, sizeof dir);
    engine_free(e);

    /* After the restart: N-1 from disk, state included, bit-identical. */
    e = open_engine(m, root, NULL);
    assert_int_equal(test_cache_stats(e).disk_hits, 0);
    assert_int_equal(probe(e, p1, 70, what, &src), 69);
    assert_int_equal(src, APC_SOURCE_EXACT);
    s = test_cache_stats(e);
    assert_true(s.disk_hits >= 1);
    assert_int_equal(s.exact_hits, 1);
    engine_free(e);

    /* A flipped byte in the state (the file's last bytes before the
     * checksum): a counted miss, the file deleted. */
    assert_true(find_file(dir, 'x', 69, name));
    flip_byte(dir, name, 12);
    e = open_engine(m, root, NULL);
    assert_int_equal(probe(e, p1, 70, what, NULL), 0);
    s = test_cache_stats(e);
    assert_int_equal(s.disk_corrupt, 1);
    assert_false(exists(dir, name));
    engine_free(e);
    remove_tree(root);
    free(root);
    model_free(m);
}

static void test_exact_state_mamba2(void **st) {
    (void)st;
    exact_restart(MAMBA2, "mamba2");
}

static void test_exact_state_falcon_h1(void **st) {
    (void)st;
    exact_restart(FALCONH1, "falcon-h1");
}

/* ---- checkpoint skeletons ---- */

static void ckpt_restart(const char *rel, const char *what, bool arr) {
    REQUIRE_FIXTURE(path, rel);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    char *root = make_temp_dir();
    int32_t p1[70], branch[90], conv[200];
    random_tokens(p1, 70, V);
    memcpy(branch, p1, sizeof p1);
    random_tokens(branch + 70, 20, V);
    random_tokens(conv, 45, V);
    apc_source src;

    engine *e = open_engine(m, root, NULL);
    assert_int_equal(apc_get_tier(engine_cache(e)), APC_TIER_CKPT);
    engine_result r;
    test_generate(e, p1, 70, 3, ENGINE_CACHE_ON, &r);
    assert_int_equal(r.cached_tokens, 0);
    engine_result_free(&r);
    /* A conversation: turn 1, then turn 2 = turn 1 + reply + a user turn. */
    test_generate(e, conv, 45, 5, ENGINE_CACHE_ON, &r);
    int64_t n2 = 45;
    for (int i = 0; i < r.n_tokens; i++) conv[n2++] = r.tokens[i];
    engine_result_free(&r);
    random_tokens(conv + n2, 12, V);
    n2 += 12;
    /* What memory adopts. */
    int64_t mem_resend = probe(e, p1, 70, what, &src);
    assert_int_equal(mem_resend, 69);
    assert_int_equal(src, APC_SOURCE_CKPT);
    int64_t mem_branch = probe(e, branch, 90, what, NULL);
    int64_t mem_turn2 = probe(e, conv, n2, what, NULL);
    assert_true(mem_branch >= 64);
    assert_true(mem_turn2 >= 32);
    apc_flush(engine_cache(e));
    apc_stats s = test_cache_stats(e);
    assert_true(s.disk_enabled);
    assert_true(s.ckpt_skeleton_writes >= 3);
    assert_true(s.disk_blocks_indexed > 0);
    assert_true(s.disk_exact_indexed >= s.ckpt_skeleton_writes);
    char dir[512], name[64];
    ns_dir(e, root, dir, sizeof dir);
    engine_free(e);

    /* After the restart: the same checkpoints, from disk, bit-identical. */
    e = open_engine(m, root, NULL);
    s = test_cache_stats(e);
    assert_int_equal(s.disk_hits, 0);
    assert_true(s.disk_exact_indexed >= 3);
    if (probe(e, p1, 70, what, &src) != mem_resend) fail_msg("%s: resend adopted another checkpoint", what);
    assert_int_equal(src, APC_SOURCE_CKPT);
    s = test_cache_stats(e);
    assert_int_equal(s.ckpt_hits, 1);
    assert_int_equal(s.ckpt_matched_tokens, 69);
    assert_true(s.disk_hits >= 2); /* the skeleton and its chain's blocks */
    int64_t got = probe(e, branch, 90, what, NULL);
    if (got != mem_branch) fail_msg("%s: branch adopted %lld, %lld before", what, (long long)got, (long long)mem_branch);
    got = probe(e, conv, n2, what, NULL);
    if (got != mem_turn2) fail_msg("%s: turn 2 adopted %lld, %lld before", what, (long long)got, (long long)mem_turn2);
    assert_int_equal(test_cache_stats(e).disk_corrupt, 0);
    engine_free(e);

    /* A flipped byte in the resend's skeleton: counted, deleted; the resend
     * falls back to a shorter skeleton, still bit-identical. */
    assert_true(find_file(dir, 'k', 69, name));
    flip_byte(dir, name, arr ? 12 : 20);
    e = open_engine(m, root, NULL);
    got = probe(e, p1, 70, what, NULL);
    assert_true(got < 69);
    s = test_cache_stats(e);
    assert_int_equal(s.disk_corrupt, 1);
    assert_false(exists(dir, name));
    engine_free(e);

    /* A truncated skeleton: removed at start-up (its header no longer
     * matches its size). */
    assert_true(find_file(dir, 'k', 70, name));
    char p[600];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    struct stat stt;
    assert_int_equal(stat(p, &stt), 0);
    assert_int_equal(truncate(p, stt.st_size - 5), 0);
    e = open_engine(m, root, NULL);
    assert_false(exists(dir, name));
    probe(e, branch, 90, what, NULL);
    engine_free(e);

    /* A flipped byte in the chain's first shard: every skeleton of p1
     * misses (counted), the shard is gone. */
    assert_true(find_file(dir, 'b', -1, name));
    flip_byte(dir, name, 20);
    e = open_engine(m, root, NULL);
    assert_int_equal(probe(e, p1, 70, what, NULL), 0);
    s = test_cache_stats(e);
    assert_true(s.disk_corrupt >= 1);
    assert_int_equal(s.ckpt_hits, 0);
    assert_false(exists(dir, name));
    engine_free(e);
    remove_tree(root);
    free(root);
    model_free(m);
}

static void test_ckpt_skeleton_gemma3(void **st) {
    (void)st;
    ckpt_restart(GEMMA3, "gemma3", false);
}

static void test_ckpt_skeleton_qwen35(void **st) {
    (void)st;
    ckpt_restart(QWEN35, "qwen35", true);
}

/* ---- isolation by layer mix ---- */

static void isolate(const char *rel_a, const char *rel_b) {
    REQUIRE_FIXTURE(pa, rel_a);
    REQUIRE_FIXTURE(pb, rel_b);
    model *a = test_load_model(pa), *b = test_load_model(pb);
    char *root = make_temp_dir();
    int Va = model_get_hparams(a)->n_vocab, Vb = model_get_hparams(b)->n_vocab;
    int V = Va < Vb ? Va : Vb;
    int32_t p1[70];
    random_tokens(p1, 70, V);
    /* One namespace string for both: only the layer mix tells them apart. */
    engine *e = open_engine(a, root, "shared");
    engine_result r;
    test_generate(e, p1, 70, 3, ENGINE_CACHE_ON, &r);
    engine_result_free(&r);
    apc_flush(engine_cache(e));
    apc_stats sa = test_cache_stats(e);
    assert_true(sa.disk_files > 0);
    engine_free(e);
    e = open_engine(b, root, "shared");
    apc_stats sb = test_cache_stats(e);
    assert_true(sb.disk_enabled);
    assert_true(strcmp(sa.disk_namespace, sb.disk_namespace) != 0);
    assert_int_equal(sb.disk_files, 0);
    assert_int_equal(probe(e, p1, 70, "other layer mix", NULL), 0);
    engine_free(e);
    remove_tree(root);
    free(root);
    model_free(a);
    model_free(b);
}

static void test_isolation(void **st) {
    (void)st;
    isolate(QWEN35, GEMMA3);
    isolate(MAMBA2, FALCONH1);
}

int main(void) {
    if (getenv("EMBER_LOG") == NULL) ember_log_set_level(EMBER_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exact_state_mamba2),   cmocka_unit_test(test_exact_state_falcon_h1),
        cmocka_unit_test(test_ckpt_skeleton_gemma3), cmocka_unit_test(test_ckpt_skeleton_qwen35),
        cmocka_unit_test(test_isolation),
    };
    return test_run_group(tests, NULL, NULL);
}
