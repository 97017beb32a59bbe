/* test_kv.c - the paged KV pool: refcounts, the LRU free queue with its
 * evict hook, copy-on-write of a shared partial block, truncation; the
 * blocks' rows start on cache lines. */
#include <stdint.h>
#include <string.h>

#include "kv/kv_pool.h"
#include "test_util.h"

static kv_pool *make_pool(int n_blocks) {
    static const int k_width[2] = {4, 0}, v_width[2] = {4, 0};
    kv_pool_config cfg = {2, k_width, v_width, n_blocks};
    ember_error err;
    kv_pool *p = kv_pool_create(&cfg, &err);
    assert_non_null(p);
    return p;
}

static int evicted[64], n_evicted;
static void record_eviction(void *owner, int32_t block) {
    (void)owner;
    evicted[n_evicted++] = block;
}

static void test_alloc_ref_unref(void **state) {
    (void)state;
    kv_pool *p = make_pool(3);
    assert_int_equal(kv_pool_n_free(p), 3);
    int32_t a = kv_block_alloc(p), b = kv_block_alloc(p), c = kv_block_alloc(p);
    assert_true(a >= 0 && b >= 0 && c >= 0);
    assert_int_equal(kv_block_alloc(p), -1);
    kv_block_ref(p, a);
    assert_int_equal(kv_block_refcount(p, a), 2);
    kv_block_unref(p, a);
    assert_int_equal(kv_pool_n_free(p), 0);
    kv_block_unref(p, a);
    assert_int_equal(kv_pool_n_free(p), 1);
    assert_int_equal(kv_block_alloc(p), a);
    kv_pool_free(p);
}

static void test_lru_eviction_of_indexed_blocks(void **state) {
    (void)state;
    kv_pool *p = make_pool(3);
    n_evicted = 0;
    kv_pool_set_evict_hook(p, record_eviction, NULL);
    int32_t a = kv_block_alloc(p), b = kv_block_alloc(p), c = kv_block_alloc(p);
    kv_block_set_indexed(p, a, true);
    kv_block_set_indexed(p, b, true);
    kv_block_unref(p, b); /* freed first: least recently used */
    kv_block_unref(p, a);
    /* a cached block taken back while free leaves the queue */
    kv_block_ref(p, a);
    assert_int_equal(kv_block_refcount(p, a), 1);
    assert_int_equal(kv_pool_n_free(p), 1);
    kv_block_unref(p, a);
    assert_int_equal(kv_block_alloc(p), b);
    assert_int_equal(n_evicted, 1);
    assert_int_equal(evicted[0], b);
    assert_false(kv_block_is_indexed(p, b));
    assert_int_equal(kv_block_alloc(p), a);
    assert_int_equal(n_evicted, 2);
    assert_int_equal(kv_pool_evictions(p), 2);
    (void)c;
    kv_pool_free(p);
}

static void test_copy_on_write_of_shared_partial_block(void **state) {
    (void)state;
    kv_pool *p = make_pool(8);
    ember_error err;
    kv_seq s1, s2;
    kv_seq_init(&s1);
    kv_seq_init(&s2);
    assert_int_equal(kv_seq_prepare_append(p, &s1, 20, &err), 0);
    s1.n_tokens = 20;
    assert_int_equal(s1.n_blocks, 2);
    float *k = kv_block_k(p, s1.blocks[1], 0);
    k[3 * 4] = 42.0f; /* position 19 */
    /* s2 shares both blocks, as an adopted prefix would */
    assert_int_equal(kv_seq_adopt_block(p, &s2, s1.blocks[0], &err), 0);
    assert_int_equal(kv_seq_adopt_block(p, &s2, s1.blocks[1], &err), 0);
    kv_seq_truncate(p, &s2, 19);
    assert_int_equal(kv_block_refcount(p, s1.blocks[1]), 2);
    assert_int_equal(kv_seq_prepare_append(p, &s2, 1, &err), 0);
    assert_int_not_equal(s2.blocks[1], s1.blocks[1]);
    assert_int_equal(s2.blocks[0], s1.blocks[0]);
    assert_int_equal(kv_block_refcount(p, s1.blocks[1]), 1);
    /* the copy holds the shared rows */
    assert_true(kv_block_k(p, s2.blocks[1], 0)[3 * 4] == 42.0f);
    kv_block_k(p, s2.blocks[1], 0)[3 * 4] = 7.0f;
    assert_true(k[3 * 4] == 42.0f);
    kv_seq_release(p, &s1);
    kv_seq_release(p, &s2);
    assert_int_equal(kv_pool_n_free(p), 8);
    kv_pool_free(p);
}

static void test_exhaustion_is_an_error(void **state) {
    (void)state;
    kv_pool *p = make_pool(2);
    ember_error err;
    kv_seq s;
    kv_seq_init(&s);
    assert_int_equal(kv_seq_prepare_append(p, &s, 33, &err), -1);
    assert_non_null(strstr(err.msg, "exhausted"));
    kv_seq_release(p, &s);
    assert_int_equal(kv_pool_n_free(p), 2);
    kv_pool_free(p);
}

/* Rows start on cache lines in small (heap) pools as in large (mapped)
 * ones: a row's kv-head slice then covers only the lines of its bytes
 * (a 16-byte offset added a line to every slice, unprefetched, and made
 * f16 decode attention 2.6x slower). f16, f32 and q8_0 layouts of a
 * qwen3-0.6b-like layer (8 kv heads of 128). */
static void test_rows_on_cache_lines(void **state) {
    (void)state;
    static const int k_width[2] = {1024, 1024}, v_width[2] = {1024, 1024};
    const char *formats[] = {"f32", "f16", "q8_0"};
    for (int f = 0; f < 3; f++) {
        kv_pool_config cfg = {2, k_width, v_width, 4};
        assert_int_equal(kv_format_parse(formats[f], &cfg.format), 0);
        ember_error err;
        kv_pool *p = kv_pool_create(&cfg, &err);
        assert_non_null(p);
        for (int32_t b = 0; b < 4; b++)
            for (int l = 0; l < 2; l++) {
                assert_int_equal((uintptr_t)kv_block_k(p, b, l) % 64, 0);
                assert_int_equal((uintptr_t)kv_block_v(p, b, l) % 64, 0);
            }
        kv_pool_free(p);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alloc_ref_unref),
        cmocka_unit_test(test_lru_eviction_of_indexed_blocks),
        cmocka_unit_test(test_copy_on_write_of_shared_partial_block),
        cmocka_unit_test(test_exhaustion_is_an_error),
        cmocka_unit_test(test_rows_on_cache_lines),
    };
    return test_run_group(tests, NULL, NULL);
}
