/* test_apc_disk.c - the SSD tier of the prompt cache, on real model files.
 *
 * Each scenario runs engines on a temporary root directory and compares
 * every warm result bit for bit (memcmp of the logits of every generated
 * step) with a cold run of the same request (ENGINE_CACHE_BYPASS):
 *  - warm restart on the block tier (read_mode direct and mmap) and the
 *    exact tier: an engine serves, is freed (its queue drains), a new one on
 *    the same directory adopts N-1 of a resend from disk, and turn 2 adopts
 *    turn 1's prompt + reply; a reset leaves the disk alone;
 *  - crash leftovers (temp files, a foreign name, a half-written shard,
 *    garbage under a valid name) are removed at start-up;
 *  - corruption after start-up (a flipped byte, a truncation, garbage):
 *    a counted miss, the bad file gone, the answer correct;
 *  - format isolation: another hash kind or namespace on one root adopts
 *    nothing; a renamed model file still hits; another model has another
 *    namespace;
 *  - the size cap: a workload larger than max_bytes stays under it, later
 *    segments of a chain go before its prefix, the newest chains still hit;
 *  - a vanished directory is recreated by the next write;
 *  - two tiers on one directory keep each other's temp files; a path that
 *    cannot be used fails the engine unless the tier is optional;
 *  - the file reader: a round trip and 600 mutated files through the parser.
 * stories260K throughout (5 layers, ~1.3 KB of K/V per token). */
/* Paths here are short temp paths; snprintf truncation cannot happen. */
#pragma GCC diagnostic ignored "-Wformat-truncation"
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "apc/apc_disk.h"
#include "core/log.h"
#include "engine/engine.h"
#include "serve/serve_stats.h"
#include "test_util.h"

#define STORIES "models/stories260K.gguf"
#define QWEN3 "reference/qwen3-f32.gguf"

typedef struct disk_opts {
    apc_force force;
    const char *root;
    uint64_t max_bytes;
    apc_disk_read mode;
    const char *ns;
    apc_hash_kind hash;
} disk_opts;

static engine *open_engine(const model *m, const disk_opts *o) {
    engine_config cfg = engine_default_config();
    cfg.n_threads = 1;
    cfg.prefill_step = 32;
    cfg.cache.force_tier = o->force;
    cfg.cache.hash = o->hash;
    cfg.cache.disk.path = o->root;
    cfg.cache.disk.max_bytes = o->max_bytes;
    cfg.cache.disk.read_mode = o->mode;
    cfg.cache.disk.namespace_override = o->ns;
    return test_open_engine(m, &cfg);
}

/* Runs warm (cache on), then cold; compares; returns the adopted count. */
static int64_t check(engine *e, const int32_t *prompt, int64_t n, int max_tokens, const char *what, apc_source *src) {
    engine_result warm, cold;
    test_generate(e, prompt, n, max_tokens, ENGINE_CACHE_ON, &warm);
    test_generate(e, prompt, n, max_tokens, ENGINE_CACHE_BYPASS, &cold);
    assert_warm_equals_cold(&cold, &warm, what);
    assert_int_equal(warm.cached_tokens + warm.prompt_forwarded, n);
    int64_t cached = warm.cached_tokens;
    if (src) *src = warm.cache_source;
    engine_result_free(&warm);
    engine_result_free(&cold);
    return cached;
}

static uint64_t rng_state = 0x243f6a8885a308d3ull;
static uint32_t rnd(void) { return test_rand(&rng_state); }
static void random_tokens(int32_t *t, int64_t n, int vocab) { test_random_tokens(&rng_state, t, n, vocab); }

/* The namespace directory of an engine. */
static void ns_dir(engine *e, const char *root, char *out, size_t cap) {
    apc_stats s = test_cache_stats(e);
    assert_true(s.disk_enabled);
    snprintf(out, cap, "%s/%s", root, s.disk_namespace);
}

/* Names in dir (sorted, up to max); returns the count. */
static int list_dir(const char *dir, char names[][64], int max, uint64_t *total_bytes) {
    DIR *d = opendir(dir);
    int n = 0;
    if (total_bytes) *total_bytes = 0;
    if (d == NULL) return 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.' && (de->d_name[1] == 0 || de->d_name[1] == '.')) continue;
        if (strcmp(de->d_name, ".lock") == 0) continue; /* the tier's lock, not a cache file */
        if (n < max && strlen(de->d_name) < 64) strcpy(names[n++], de->d_name);
        if (total_bytes) {
            char p[512];
            struct stat st;
            snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
            if (stat(p, &st) == 0) *total_bytes += (uint64_t)st.st_size;
        }
    }
    closedir(d);
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && strcmp(names[j - 1], names[j]) > 0; j--) {
            char t[64];
            strcpy(t, names[j]);
            strcpy(names[j], names[j - 1]);
            strcpy(names[j - 1], t);
        }
    return n;
}

static bool exists(const char *dir, const char *name) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    return access(p, F_OK) == 0;
}

static void write_file(const char *dir, const char *name, const void *data, size_t n) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    FILE *f = fopen(p, "wb");
    assert_non_null(f);
    if (n) assert_int_equal(fwrite(data, 1, n, f), n);
    fclose(f);
}

/* The model's layout, for parsing files in the tests. */
typedef struct test_layout {
    apc_layout lay;
    int k[64], v[64];
} test_layout;

static void layout_of(const model *m, test_layout *t) {
    kv_pool_config kc;
    model_kv_config(m, 1, &kc);
    memset(t, 0, sizeof *t);
    t->lay.n_layer = kc.n_layer;
    t->lay.k_width = t->k;
    t->lay.v_width = t->v;
    for (int l = 0; l < kc.n_layer; l++) {
        t->k[l] = kc.k_width[l];
        t->v[l] = kc.v_width[l];
        t->lay.row_floats += (size_t)kc.k_width[l] + (size_t)kc.v_width[l];
    }
}

static void expect_of(engine *e, const test_layout *tl, apc_hash_kind hash, apc_disk_expect *ex) {
    apc_stats s = test_cache_stats(e);
    for (int i = 0; i < 16; i++) {
        unsigned v;
        sscanf(s.disk_namespace + 2 * i, "%2x", &v);
        ex->ns[i] = (uint8_t)v;
    }
    ex->hash = hash;
    ex->layout = &tl->lay;
}

/* ---- warm restart ---- */

static void warm_restart(const char *path, apc_force force, apc_disk_read mode, const char *what) {
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    char *root = make_temp_dir();
    disk_opts o = {force, root, 0, mode, NULL, APC_HASH_SHA256};
    int32_t p1[70], p2[200];
    random_tokens(p1, 70, V);
    random_tokens(p2, 45, V);
    apc_source src;

    /* Before the restart: what a resend adopts from memory. */
    engine *e = open_engine(m, &o);
    assert_int_equal(check(e, p1, 70, 4, what, NULL), 0);
    assert_int_equal(check(e, p1, 70, 4, what, NULL), 69);
    engine_result t1;
    test_generate(e, p2, 45, 6, ENGINE_CACHE_ON, &t1); /* turn 1 of a conversation */
    int64_t n2 = 45;
    for (int i = 0; i < t1.n_tokens; i++) p2[n2++] = t1.tokens[i];
    engine_result_free(&t1);
    random_tokens(p2 + n2, 20, V); /* turn 2: the reply, then the next user message */
    n2 += 20;
    apc_flush(engine_cache(e));
    apc_stats s = test_cache_stats(e);
    assert_true(s.disk_writes > 0);
    assert_true(s.disk_files > 0);
    if (force == APC_FORCE_BLOCK) assert_true(s.disk_blocks_indexed > 0);
    else assert_true(s.disk_exact_indexed > 0);
    engine_free(e);

    /* After: the same adoption, from disk, bit-identical to cold. */
    e = open_engine(m, &o);
    s = test_cache_stats(e);
    assert_true(s.disk_files > 0);
    assert_int_equal(s.disk_hits, 0);
    assert_int_equal(check(e, p1, 70, 4, what, &src), 69);
    assert_int_equal(src, force == APC_FORCE_BLOCK ? APC_SOURCE_BLOCK : APC_SOURCE_EXACT);
    s = test_cache_stats(e);
    assert_true(s.disk_hits > 0);
    uint64_t hits = s.disk_hits;
    /* The restored prefix is in memory now: the next hit does not read disk. */
    assert_int_equal(check(e, p1, 70, 4, what, NULL), 69);
    assert_int_equal(test_cache_stats(e).disk_hits, hits);
    /* Turn 2 after the restart adopts turn 1's prompt + reply. */
    int64_t c2 = check(e, p2, n2, 4, what, NULL);
    if (c2 < 50) fail_msg("%s: turn 2 adopted %lld of %lld", what, (long long)c2, (long long)n2);
    /* A reset clears memory only: the resend comes from disk again. */
    apc_reset(engine_cache(e));
    assert_int_equal(check(e, p1, 70, 4, what, NULL), 69);
    s = test_cache_stats(e);
    assert_true(s.disk_hits > 0);
    assert_true(s.disk_files > 0);
    cJSON *j = serve_cache_stats_json(engine_cache(e));
    assert_non_null(cJSON_GetObjectItem(j, "disk_blocks_indexed"));
    assert_non_null(cJSON_GetObjectItem(j, "disk_corrupt"));
    assert_non_null(cJSON_GetObjectItem(j, "disk_write_drops"));
    cJSON_Delete(j);
    engine_free(e);
    remove_tree(root);
    free(root);
    model_free(m);
}

static void test_warm_restart_block(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    warm_restart(path, APC_FORCE_BLOCK, APC_DISK_READ_DIRECT, "block/direct");
    warm_restart(path, APC_FORCE_BLOCK, APC_DISK_READ_MMAP, "block/mmap");
}

static void test_warm_restart_exact(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    warm_restart(path, APC_FORCE_EXACT, APC_DISK_READ_DIRECT, "exact/direct");
    warm_restart(path, APC_FORCE_EXACT, APC_DISK_READ_MMAP, "exact/mmap");
}

/* ---- crash leftovers ---- */

static void test_crash_leftovers(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    char *root = make_temp_dir();
    disk_opts o = {APC_FORCE_BLOCK, root, 0, APC_DISK_READ_DIRECT, NULL, APC_HASH_SHA256};
    int32_t a[40], b[40];
    random_tokens(a, 40, V);
    random_tokens(b, 40, V);
    char dir[512], names[32][64];
    engine *e = open_engine(m, &o);
    ns_dir(e, root, dir, sizeof dir);
    engine_result r;
    test_generate(e, a, 40, 3, ENGINE_CACHE_ON, &r);
    engine_result_free(&r);
    apc_flush(engine_cache(e));
    int na = list_dir(dir, names, 32, NULL);
    assert_true(na >= 1);
    char a_first[64];
    strcpy(a_first, names[0]);
    test_generate(e, b, 40, 3, ENGINE_CACHE_ON, &r);
    engine_result_free(&r);
    engine_free(e);

    /* A crash mid-write leaves a temp file; a store that never got renamed
     * could leave a half file under a canonical name; plus junk. */
    size_t size;
    char p[600];
    snprintf(p, sizeof p, "%s/%s", dir, a_first);
    uint8_t *whole = read_whole_file(p, &size);
    assert_non_null(whole);
    write_file(dir, ".tmp-4242-7.apc", whole, size / 2);
    write_file(dir, "notes.txt", "hello", 5);
    write_file(dir, a_first, whole, size / 2); /* a's first shard, half written */
    uint8_t garbage[4096];
    for (size_t i = 0; i < sizeof garbage; i++) garbage[i] = (uint8_t)rnd();
    write_file(dir, "b-0123456789abcdef0123456789abcdef.apc", garbage, sizeof garbage);
    write_file(dir, "x-0123456789abcdef0123456789abcdef.apc", whole, size); /* valid file, wrong name */
    free(whole);

    e = open_engine(m, &o);
    assert_false(exists(dir, ".tmp-4242-7.apc"));
    assert_false(exists(dir, "notes.txt"));
    assert_false(exists(dir, a_first));
    assert_false(exists(dir, "b-0123456789abcdef0123456789abcdef.apc"));
    assert_false(exists(dir, "x-0123456789abcdef0123456789abcdef.apc"));
    /* b's files survived and serve; a is correct, whatever it adopts. */
    assert_int_equal(check(e, b, 40, 3, "b after crash", NULL), 39);
    check(e, a, 40, 3, "a after crash", NULL);
    assert_int_equal(test_cache_stats(e).disk_corrupt, 0);
    engine_free(e);
    remove_tree(root);
    free(root);
    model_free(m);
}

/* ---- corruption after start-up ---- */

typedef enum damage { FLIP, TRUNCATE, GARBAGE } damage;

static void corrupt_one(const model *m, damage how, apc_force force, const char *what) {
    int V = model_get_hparams(m)->n_vocab;
    char *root = make_temp_dir();
    disk_opts o = {force, root, 0, APC_DISK_READ_DIRECT, NULL, APC_HASH_SHA256};
    int32_t a[40];
    random_tokens(a, 40, V);
    char dir[512], names[32][64];
    engine *e = open_engine(m, &o);
    ns_dir(e, root, dir, sizeof dir);
    engine_result r;
    test_generate(e, a, 40, 3, ENGINE_CACHE_ON, &r);
    engine_result_free(&r);
    engine_free(e);

    e = open_engine(m, &o); /* indexed from the headers */
    int n = list_dir(dir, names, 32, NULL);
    assert_true(n >= 1);
    /* Damage the file the resend reads: the chain's first shard, or the
     * snapshot of N-1 tokens. */
    int damaged = 0;
    for (int i = 0; i < n; i++) {
        char p[600];
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        size_t size;
        uint8_t *buf = read_whole_file(p, &size);
        assert_non_null(buf);
        uint32_t first;
        uint64_t n_tok;
        memcpy(&first, buf + 72, 4);
        memcpy(&n_tok, buf + 88, 8);
        if (force == APC_FORCE_BLOCK ? first != 0 : n_tok != 39) {
            free(buf);
            names[i][0] = 0;
            continue;
        }
        damaged++;
        if (how == FLIP) {
            buf[size - 20] ^= 0x40;
            write_file(dir, names[i], buf, size);
        } else if (how == TRUNCATE) {
            assert_int_equal(truncate(p, (off_t)(size * 2 / 3)), 0);
        } else {
            for (size_t k = 0; k < size; k++) buf[k] = (uint8_t)rnd();
            write_file(dir, names[i], buf, size);
        }
        free(buf);
    }
    assert_int_equal(damaged, 1);
    engine_result warm, cold;
    test_generate(e, a, 40, 3, ENGINE_CACHE_ON, &warm);
    test_generate(e, a, 40, 3, ENGINE_CACHE_BYPASS, &cold);
    assert_warm_equals_cold(&cold, &warm, what);
    assert_int_equal(warm.cached_tokens, 0);
    engine_result_free(&warm);
    engine_result_free(&cold);
    apc_stats s = test_cache_stats(e);
    if (s.disk_corrupt < 1) fail_msg("%s: disk_corrupt = %llu", what, (unsigned long long)s.disk_corrupt);
    apc_flush(engine_cache(e));
    /* Each bad file is gone, or replaced by the resend's valid store. */
    test_layout tl;
    layout_of(m, &tl);
    apc_disk_expect ex;
    expect_of(e, &tl, APC_HASH_SHA256, &ex);
    for (int i = 0; i < n; i++) {
        if (names[i][0] == 0) continue;
        char p[600];
        snprintf(p, sizeof p, "%s/%s", dir, names[i]);
        size_t size;
        void *buf = read_whole_file(p, &size);
        if (buf == NULL) continue;
        apc_disk_header h;
        ember_error err;
        if (apc_disk_parse_image(buf, size, &ex, &h, &err) < 0) fail_msg("%s: %s still bad: %s", what, names[i], err.msg);
        apc_disk_header_free(&h);
        free(buf);
    }
    engine_free(e);
    remove_tree(root);
    free(root);
}

static void test_corruption(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    corrupt_one(m, FLIP, APC_FORCE_BLOCK, "block flip");
    corrupt_one(m, TRUNCATE, APC_FORCE_BLOCK, "block truncate");
    corrupt_one(m, GARBAGE, APC_FORCE_BLOCK, "block garbage");
    corrupt_one(m, FLIP, APC_FORCE_EXACT, "exact flip");
    corrupt_one(m, GARBAGE, APC_FORCE_EXACT, "exact garbage");
    model_free(m);
}

/* ---- isolation ---- */

static void test_isolation(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    char *root = make_temp_dir();
    int32_t a[50];
    random_tokens(a, 50, V);
    disk_opts o = {APC_FORCE_BLOCK, root, 0, APC_DISK_READ_DIRECT, NULL, APC_HASH_SHA256};
    engine *e = open_engine(m, &o);
    engine_result r;
    test_generate(e, a, 50, 3, ENGINE_CACHE_ON, &r);
    engine_result_free(&r);
    apc_stats s0 = test_cache_stats(e);
    engine_free(e);

    /* Another cache format (block keys hashed with XXH3) on the same root. */
    disk_opts ox = o;
    ox.hash = APC_HASH_XXH3;
    e = open_engine(m, &ox);
    apc_stats s = test_cache_stats(e);
    assert_string_not_equal(s.disk_namespace, s0.disk_namespace);
    assert_int_equal(s.disk_files, 0);
    assert_int_equal(check(e, a, 50, 3, "xxh3 namespace", NULL), 0);
    assert_int_equal(test_cache_stats(e).disk_hits, 0);
    engine_free(e);
    /* Another namespace name: nothing either. */
    disk_opts on = o;
    on.ns = "tenant-b";
    e = open_engine(m, &on);
    assert_int_equal(test_cache_stats(e).disk_files, 0);
    assert_int_equal(check(e, a, 50, 3, "named namespace", NULL), 0);
    engine_free(e);
    /* The exact tier shares the block tier's namespace but not its files:
     * it never reads a shard as a snapshot. */
    disk_opts oe = o;
    oe.force = APC_FORCE_EXACT;
    e = open_engine(m, &oe);
    assert_int_equal(check(e, a, 50, 3, "exact over shards", NULL), 0);
    engine_free(e);

    /* The same model under another file name: the same namespace, a hit. */
    char *tmp = make_temp_dir();
    char copy[512];
    snprintf(copy, sizeof copy, "%s/renamed-model.gguf", tmp);
    size_t size;
    void *bytes = read_whole_file(path, &size);
    assert_non_null(bytes);
    FILE *f = fopen(copy, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(bytes, 1, size, f), size);
    fclose(f);
    free(bytes);
    model *m2 = test_load_model(copy);
    e = open_engine(m2, &o);
    assert_string_equal(test_cache_stats(e).disk_namespace, s0.disk_namespace);
    assert_int_equal(check(e, a, 50, 3, "renamed model", NULL), 49);
    assert_true(test_cache_stats(e).disk_hits > 0);
    engine_free(e);
    model_free(m2);
    remove_tree(tmp);
    free(tmp);

    /* Another model: another namespace. */
    const char *qpath = fixture_path(QWEN3);
    if (qpath) {
        model *q = test_load_model(qpath);
        engine_config cfg = engine_default_config();
        cfg.n_threads = 1;
        cfg.num_blocks = 64;
        cfg.n_ctx = 512;
        cfg.cache.disk.path = root;
        e = test_open_engine(q, &cfg);
        s = test_cache_stats(e);
        assert_true(s.disk_enabled);
        assert_string_not_equal(s.disk_namespace, s0.disk_namespace);
        assert_int_equal(s.disk_files, 0);
        engine_free(e);
        model_free(q);
    }
    uint8_t fp1[16], fp2[16];
    engine_model_fingerprint(model_get_gguf(m), fp1);
    engine_model_fingerprint(model_get_gguf(m), fp2);
    assert_memory_equal(fp1, fp2, 16);
    remove_tree(root);
    free(root);
    model_free(m);
}

/* ---- size cap ---- */

static void test_cap(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    char *root = make_temp_dir();
    /* First, the size of one conversation's files. */
    disk_opts o = {APC_FORCE_BLOCK, root, 0, APC_DISK_READ_DIRECT, NULL, APC_HASH_SHA256};
    enum { N_PROMPTS = 12, LEN = 60 };
    int32_t p[N_PROMPTS][LEN];
    for (int i = 0; i < N_PROMPTS; i++) random_tokens(p[i], LEN, V);
    engine *e = open_engine(m, &o);
    char dir[512], names[128][64];
    ns_dir(e, root, dir, sizeof dir);
    engine_result r;
    test_generate(e, p[0], LEN, 8, ENGINE_CACHE_ON, &r);
    engine_result_free(&r);
    apc_flush(engine_cache(e));
    uint64_t one = test_cache_stats(e).disk_bytes;
    assert_true(one > 0);
    engine_free(e);
    remove_tree(root);
    mkdir(root, 0700);

    o.max_bytes = one * 4;
    e = open_engine(m, &o);
    for (int i = 0; i < N_PROMPTS; i++) {
        test_generate(e, p[i], LEN, 8, ENGINE_CACHE_ON, &r);
        engine_result_free(&r);
        apc_flush(engine_cache(e));
        uint64_t bytes;
        list_dir(dir, names, 128, &bytes);
        if (bytes > o.max_bytes)
            fail_msg("after %d: %llu bytes on disk, cap %llu", i, (unsigned long long)bytes,
                     (unsigned long long)o.max_bytes);
        assert_true(test_cache_stats(e).disk_bytes <= o.max_bytes);
    }
    apc_stats s = test_cache_stats(e);
    assert_true(s.disk_evictions > 0);
    assert_int_equal(s.disk_max_bytes, o.max_bytes);
    /* Every surviving later segment still has its parent on disk. */
    int n = list_dir(dir, names, 128, NULL);
    apc_key all[512];
    int n_all = 0;
    struct { apc_key parent; uint32_t first; } seg[128];
    int n_seg = 0;
    for (int i = 0; i < n; i++) {
        char fp[600];
        snprintf(fp, sizeof fp, "%s/%s", dir, names[i]);
        size_t size;
        uint8_t *buf = read_whole_file(fp, &size);
        assert_non_null(buf);
        assert_true(size > APC_DISK_HEADER_BYTES);
        uint32_t first, nb;
        memcpy(&first, buf + 72, 4);
        memcpy(&nb, buf + 76, 4);
        memcpy(seg[n_seg].parent.b, buf + 56, 16);
        seg[n_seg++].first = first;
        for (uint32_t k = 0; k < nb && n_all < 512; k++) memcpy(all[n_all++].b, buf + APC_DISK_HEADER_BYTES + 16 * k, 16);
        free(buf);
    }
    for (int i = 0; i < n_seg; i++) {
        if (seg[i].first == 0) continue;
        bool found = false;
        for (int k = 0; k < n_all && !found; k++) found = memcmp(all[k].b, seg[i].parent.b, 16) == 0;
        if (!found) fail_msg("a segment starting at block %u survived its parent", seg[i].first);
    }
    engine_free(e);

    /* After a restart the newest chains hit; the oldest is gone. */
    e = open_engine(m, &o);
    assert_int_equal(check(e, p[N_PROMPTS - 1], LEN, 8, "newest", NULL), LEN - 1);
    assert_int_equal(check(e, p[N_PROMPTS - 2], LEN, 8, "second newest", NULL), LEN - 1);
    assert_int_equal(check(e, p[0], LEN, 8, "oldest", NULL), 0);
    engine_free(e);
    remove_tree(root);
    free(root);
    model_free(m);
}

/* ---- a vanished directory ---- */

static void test_missing_dir(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    char *root = make_temp_dir();
    disk_opts o = {APC_FORCE_BLOCK, root, 0, APC_DISK_READ_DIRECT, NULL, APC_HASH_SHA256};
    int32_t a[40], b[40];
    random_tokens(a, 40, V);
    random_tokens(b, 40, V);
    engine *e = open_engine(m, &o);
    char dir[512], names[16][64];
    ns_dir(e, root, dir, sizeof dir);
    engine_result r;
    test_generate(e, a, 40, 3, ENGINE_CACHE_ON, &r);
    engine_result_free(&r);
    apc_flush(engine_cache(e));
    remove_tree(dir);
    ember_log_level lvl = ember_log_get_level();
    ember_log_set_level(EMBER_LOG_ERROR);
    test_generate(e, b, 40, 3, ENGINE_CACHE_ON, &r);
    engine_result_free(&r);
    apc_flush(engine_cache(e));
    ember_log_set_level(lvl);
    assert_true(list_dir(dir, names, 16, NULL) >= 1);
    engine_free(e);
    e = open_engine(m, &o);
    assert_int_equal(check(e, b, 40, 3, "after the directory came back", NULL), 39);
    assert_int_equal(check(e, a, 40, 3, "lost with the directory", NULL), 0);
    engine_free(e);
    remove_tree(root);
    free(root);
    model_free(m);
}

/* Two servers on one cache path (issue 18, item 5): a tier that opens while
 * another has the directory open keeps the temp files there (the other's
 * writes in flight), except an hour-old one; alone, it removes them all. */
static void write_old(const char *dir, const char *name, time_t age_s) {
    write_file(dir, name, "partial", 7);
    char p[600];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    struct timespec t[2] = {{time(NULL) - age_s, 0}, {time(NULL) - age_s, 0}};
    assert_int_equal(utimensat(AT_FDCWD, p, t, 0), 0);
}

static void test_shared_directory(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    char *root = make_temp_dir();
    disk_opts o = {APC_FORCE_BLOCK, root, 0, APC_DISK_READ_DIRECT, NULL, APC_HASH_SHA256};
    int32_t a[40];
    random_tokens(a, 40, V);
    engine *first = open_engine(m, &o);
    char dir[512], in_flight[64], stale[64];
    ns_dir(first, root, dir, sizeof dir);
    engine_result r;
    test_generate(first, a, 40, 3, ENGINE_CACHE_ON, &r);
    engine_result_free(&r);
    apc_flush(engine_cache(first));
    /* what the first server's writer has open right now, and one left by a
     * server that died an hour and a half ago */
    snprintf(in_flight, sizeof in_flight, ".tmp-%ld-99.apc", (long)getpid());
    write_old(dir, in_flight, 0);
    snprintf(stale, sizeof stale, ".tmp-%ld-98.apc", (long)getpid() + 1);
    write_old(dir, stale, 5400);

    engine *second = open_engine(m, &o);
    assert_true(exists(dir, in_flight));
    assert_false(exists(dir, stale));
    /* and the second serves what the first wrote */
    assert_int_equal(check(second, a, 40, 3, "second server on a shared directory", NULL), 39);
    engine_free(second);
    assert_true(exists(dir, in_flight)); /* the first still has it open */
    engine_free(first);

    /* Alone now: every temp file is a dead writer's. */
    engine *third = open_engine(m, &o);
    assert_false(exists(dir, in_flight));
    assert_int_equal(check(third, a, 40, 3, "after both stopped", NULL), 39);
    engine_free(third);
    remove_tree(root);
    free(root);
    model_free(m);
}

/* A disk path that cannot be used stops the engine's creation with a
 * message naming it, unless the tier is optional (issue 18, item 5). */
static void test_bad_path(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    char *root = make_temp_dir();
    write_file(root, "a-file", "x", 1);
    char bad[600];
    snprintf(bad, sizeof bad, "%s/a-file/apc", root); /* below a regular file: no directory can be made */
    engine_config cfg = engine_default_config();
    cfg.n_threads = 1;
    cfg.cache.disk.path = bad;
    ember_error err;
    engine *e = engine_create(m, &cfg, &err);
    assert_null(e);
    assert_non_null(strstr(err.msg, bad));
    assert_non_null(strstr(err.msg, "optional"));

    cfg.cache.disk.optional = true;
    ember_log_level lvl = ember_log_get_level();
    ember_log_set_level(EMBER_LOG_ERROR);
    e = engine_create(m, &cfg, &err);
    ember_log_set_level(lvl);
    assert_non_null(e);
    assert_false(test_cache_stats(e).disk_enabled);
    engine_free(e);
    remove_tree(root);
    free(root);
    model_free(m);
}

/* ---- the file reader ---- */

/* A valid image: a shard of nb blocks (last of last_rows) or a snapshot. */
static uint8_t *make_image(const apc_layout *lay, const uint8_t ns[16], uint32_t kind, uint32_t nb, uint32_t last_rows,
                           uint64_t n_exact, size_t *size) {
    apc_disk_header h;
    memset(&h, 0, sizeof h);
    h.kind = kind;
    h.salt = 77;
    uint64_t nt = kind == APC_DISK_KIND_SHARD ? (uint64_t)KV_BLOCK_TOKENS * (nb - 1) + last_rows : n_exact;
    int32_t *tok = malloc(nt * sizeof *tok);
    for (uint64_t i = 0; i < nt; i++) tok[i] = (int32_t)(rnd() % 1000);
    apc_key keys[64], zero;
    memset(&zero, 0, sizeof zero);
    if (kind == APC_DISK_KIND_SHARD) {
        apc_key parent = zero;
        for (uint32_t j = 0; j < nb; j++) {
            int rows = j + 1 < nb ? KV_BLOCK_TOKENS : (int)last_rows;
            keys[j] = rows == KV_BLOCK_TOKENS ? apc_block_key(APC_HASH_XXH3, &parent, h.salt, tok + 16 * j)
                                              : apc_partial_key(APC_HASH_XXH3, &parent, h.salt, tok + 16 * j, rows);
            parent = keys[j];
        }
        h.n_blocks = nb;
        h.last_rows = last_rows;
        h.keys = keys;
        h.content = keys[nb - 1];
    } else if (kind == APC_DISK_KIND_SKEL) {
        h.content = apc_disk_skel_key(h.salt, tok, (int64_t)nt);
        h.first_block = 2;
    } else {
        h.content = apc_disk_exact_key(h.salt, tok, (int64_t)nt);
    }
    h.n_tokens = nt;
    h.state_bytes = kind == APC_DISK_KIND_SHARD ? 0 : lay->state_bytes;
    uint64_t bytes = apc_disk_file_bytes(lay, kind, h.n_blocks, nt);
    uint8_t *img = malloc(bytes);
    apc_disk_write_header(img, ns, &h, lay);
    uint8_t *p = img + APC_DISK_HEADER_BYTES + 16 * (size_t)h.n_blocks;
    for (uint64_t i = 0; i < nt; i++) memcpy(p + 4 * i, &tok[i], 4);
    p += 4 * nt;
    uint64_t floats = kind == APC_DISK_KIND_SKEL ? 0 : nt * lay->row_floats;
    for (uint64_t i = 0; i < floats; i++) {
        float v = (float)(rnd() % 2000) / 1000.0f - 1.0f;
        memcpy(p + 4 * i, &v, 4);
    }
    for (uint64_t i = 0; i < h.state_bytes; i++) p[4 * floats + i] = (uint8_t)rnd();
    uint64_t sum = XXH3_64bits(img, bytes - 8);
    memcpy(img + bytes - 8, &sum, 8);
    free(tok);
    *size = bytes;
    return img;
}

static void test_reader_fuzz(void **state) {
    (void)state;
    int kw[3] = {8, 0, 4}, vw[3] = {8, 0, 12};
    apc_layout lay = {3, kw, vw, 32, 24, 0}; /* 24 bytes of recurrent state in exact files and skeletons */
    apc_disk_expect ex;
    for (int i = 0; i < 16; i++) ex.ns[i] = (uint8_t)(i * 7);
    ex.hash = APC_HASH_XXH3;
    ex.layout = &lay;
    size_t sizes[4];
    uint8_t *imgs[4] = {make_image(&lay, ex.ns, APC_DISK_KIND_SHARD, 3, 5, 0, &sizes[0]),
                        make_image(&lay, ex.ns, APC_DISK_KIND_SHARD, 2, 16, 0, &sizes[1]),
                        make_image(&lay, ex.ns, APC_DISK_KIND_EXACT, 0, 0, 37, &sizes[2]),
                        make_image(&lay, ex.ns, APC_DISK_KIND_SKEL, 0, 0, 29, &sizes[3])};
    apc_disk_header h;
    ember_error err;
    for (int k = 0; k < 4; k++) {
        if (apc_disk_parse_image(imgs[k], sizes[k], &ex, &h, &err) < 0) fail_msg("image %d: %s", k, err.msg);
        apc_disk_header_free(&h);
    }
    /* The wrong hash kind or namespace rejects a valid file. */
    ex.hash = APC_HASH_SHA256;
    assert_int_equal(apc_disk_parse_image(imgs[0], sizes[0], &ex, &h, &err), -1);
    ex.hash = APC_HASH_XXH3;
    ex.ns[0] ^= 1;
    assert_int_equal(apc_disk_parse_image(imgs[2], sizes[2], &ex, &h, &err), -1);
    ex.ns[0] ^= 1;
    /* Another state size (a model with another layer mix) rejects exact
     * files and skeletons. */
    lay.state_bytes = 16;
    assert_int_equal(apc_disk_parse_image(imgs[2], sizes[2], &ex, &h, &err), -1);
    assert_int_equal(apc_disk_parse_image(imgs[3], sizes[3], &ex, &h, &err), -1);
    lay.state_bytes = 24;

    int rejected = 0;
    for (int it = 0; it < 800; it++) {
        int k = it % 4;
        size_t size = sizes[k];
        uint8_t *m = malloc(size + 64);
        memcpy(m, imgs[k], size);
        int how = (int)(rnd() % 5);
        bool changed = true;
        if (how == 0) { /* flip bits */
            int flips = 1 + (int)(rnd() % 4);
            for (int f = 0; f < flips; f++) m[rnd() % size] ^= (uint8_t)(1u << (rnd() % 8));
            changed = memcmp(m, imgs[k], size) != 0;
        } else if (how == 1) { /* truncate */
            size = rnd() % size;
        } else if (how == 2) { /* extend */
            size_t extra = 1 + rnd() % 64;
            for (size_t i = 0; i < extra; i++) m[size + i] = (uint8_t)rnd();
            size += extra;
        } else if (how == 3) { /* a header field set to something else, header resealed */
            uint32_t off = 8 + 4 * (rnd() % 28);
            uint32_t v = rnd() % 3 == 0 ? 0xffffffffu : rnd() % 300;
            uint32_t old;
            memcpy(&old, m + off, 4);
            memcpy(m + off, &v, 4);
            changed = old != v;
            uint8_t nbb[4];
            memcpy(nbb, m + 76, 4);
            uint32_t nb;
            memcpy(&nb, nbb, 4);
            if (nb <= 64 && APC_DISK_HEADER_BYTES + 16 * (size_t)nb <= size) {
                XXH3_state_t *st = XXH3_createState();
                XXH3_64bits_reset(st);
                XXH3_64bits_update(st, m, APC_DISK_HEADER_SUM_AT);
                XXH3_64bits_update(st, m + APC_DISK_HEADER_BYTES, 16 * (size_t)nb);
                uint64_t sum = XXH3_64bits_digest(st);
                XXH3_freeState(st);
                memcpy(m + APC_DISK_HEADER_SUM_AT, &sum, 8);
            }
        } else { /* random bytes over a random range */
            size_t at = rnd() % size, len = 1 + rnd() % 32;
            for (size_t i = at; i < at + len && i < size; i++) m[i] = (uint8_t)rnd();
            changed = memcmp(m, imgs[k], size) != 0;
        }
        int rc = apc_disk_parse_image(m, size, &ex, &h, &err);
        if (rc == 0) {
            apc_disk_header_free(&h);
            if (changed && how != 3) fail_msg("mutation %d (kind %d) was accepted", it, how);
        } else {
            rejected++;
        }
        free(m);
    }
    assert_true(rejected > 600);
    for (int k = 0; k < 4; k++) free(imgs[k]);

    /* Names. */
    uint32_t kind;
    apc_key key;
    assert_true(apc_disk_parse_name("b-00112233445566778899aabbccddeeff.apc", &kind, &key));
    assert_int_equal(kind, APC_DISK_KIND_SHARD);
    assert_int_equal(key.b[15], 0xff);
    assert_false(apc_disk_parse_name("b-00112233445566778899AABBCCDDEEFF.apc", &kind, &key));
    assert_false(apc_disk_parse_name("q-00112233445566778899aabbccddeeff.apc", &kind, &key));
    assert_true(apc_disk_parse_name("k-00112233445566778899aabbccddeeff.apc", &kind, &key));
    assert_int_equal(kind, APC_DISK_KIND_SKEL);
    assert_false(apc_disk_parse_name(".tmp-1-2.apc", &kind, &key));
    assert_false(apc_disk_parse_name("b-00112233445566778899aabbccddeeff.apc.tmp", &kind, &key));
}

int main(void) {
    if (getenv("EMBER_LOG") == NULL) ember_log_set_level(EMBER_LOG_WARN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reader_fuzz),
        cmocka_unit_test(test_warm_restart_block),
        cmocka_unit_test(test_warm_restart_exact),
        cmocka_unit_test(test_crash_leftovers),
        cmocka_unit_test(test_corruption),
        cmocka_unit_test(test_isolation),
        cmocka_unit_test(test_cap),
        cmocka_unit_test(test_missing_dir),
        cmocka_unit_test(test_shared_directory),
        cmocka_unit_test(test_bad_path),
    };
    return test_run_group(tests, NULL, NULL);
}
