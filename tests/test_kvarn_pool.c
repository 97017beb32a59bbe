/* test_kvarn_pool.c - kvarn as a KV pool format (issue 12).
 *
 * From the bottom up: the format's names and cache identity; a group
 * sealed in a pool holds exactly the record kvarn_encode makes of its fp16
 * rows, and the pool says which groups a prefix may hold; attention read
 * straight from the records equals attention over the decoded rows within
 * a stated bound; then through the engine: cold logits do not depend on
 * how the prompt is chunked (sealing follows positions), warm == cold
 * (memcmp) on the exact tier (dense) and the checkpoint tier (gemma3,
 * qwen35) with groups sealed inside the adopted prefix, the routing lines,
 * a restart between stock and kvarn formats that adopts nothing and says
 * so once, and the reference's bitrate-b scenario with kvarn widths through
 * `ember serve`. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "core/log.h"
#include "engine/engine.h"
#include "serve/serve_config.h"
#include "serve/serve_settings.h"
#include "tensor/attention_kvarn.h"
#include "tensor/kvarn.h"
#include "tensor/ops.h"
#include "http_client.h"
#include "test_util.h"

#define STORIES "models/stories260K.gguf"
#define GEMMA3 "reference/gemma3-f32.gguf"
#define QWEN35 "reference/qwen35-f32.gguf"
#define MAMBA2 "reference/mamba2-f32.gguf"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static kv_format parse(const char *text) {
    kv_format f;
    if (kv_format_parse(text, &f) < 0) fail_msg("'%s' does not parse", text);
    return f;
}

static float frand(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((rng_state >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

/* ---- the format ---- */

static void test_names_and_identity(void **state) {
    (void)state;
    kv_format d = parse("kvarn");
    assert_int_equal(d.kind, KV_FORMAT_KVARN);
    assert_int_equal(d.k_bits, 6);
    assert_int_equal(d.v_bits, 5);
    assert_int_equal(d.tail, 1024);
    assert_string_equal(kv_format_name(d), "kvarn-k6v5-t1024");
    kv_format a = parse("kvarn-k4v4-t0"), b = parse("kvarn:k4v4:t0"), c = parse("kvarn-t256");
    assert_string_equal(kv_format_name(a), "kvarn-k4v4-t0");
    assert_int_equal(kv_format_id(a), kv_format_id(b));
    assert_int_equal(c.k_bits, 6);
    assert_int_equal(c.tail, 256);
    /* Every part of the format names a different cache. */
    uint64_t ids[] = {kv_format_id(d), kv_format_id(a), kv_format_id(c), kv_format_id(parse("kvarn-k6v4")),
                      kv_format_id(parse("kvarn-k5v5")), kv_format_id(parse("f16")), kv_format_id(parse("q8_0")),
                      kv_format_id(parse("f32"))};
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++)
        for (size_t j = i + 1; j < sizeof ids / sizeof ids[0]; j++) assert_true(ids[i] != ids[j]);
    assert_true((kv_format_id(d) >> 16 & 0xFFFF) == KVARN_LAYOUT_VERSION);
    const char *bad[] = {"kvarn-k9v5", "kvarn-k1v5", "kvarn-k6", "kvarn-t", "kvarn-t-1", "kvarn-x", "kvarn-k6v5-k6v5",
                         "kvarnk6v5", "kvarn-t2000000", "q4_0"};
    kv_format f;
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        if (kv_format_parse(bad[i], &f) == 0) fail_msg("'%s' parsed", bad[i]);
    /* The rule: group 0 never, group g from 128 (g + 1) + tail on. */
    assert_false(kvarn_group_sealed(0, 100000, 0));
    assert_false(kvarn_group_sealed(1, 255, 0));
    assert_true(kvarn_group_sealed(1, 256, 0));
    assert_false(kvarn_group_sealed(1, 355, 100));
    assert_true(kvarn_group_sealed(1, 356, 100));
    for (int64_t p = 0; p < 2000; p++) {
        int64_t end = kvarn_sealed_end(p, 100), g = 1;
        while (kvarn_group_sealed(g, p, 100)) g++;
        assert_int_equal(end, g);
    }
}

/* ---- a pool of one layer ---- */

typedef struct pool_fixture {
    kv_pool *pool;
    kv_seq seq;
    int width, head;
    kv_format fmt;
    float *rows; /* (n, width) the values written */
    int64_t n;
} pool_fixture;

static void pool_open(pool_fixture *f, const char *fmt, int n_head_kv, int head, int64_t n) {
    memset(f, 0, sizeof *f);
    f->width = n_head_kv * head;
    f->head = head;
    f->fmt = parse(fmt);
    f->n = n;
    int w[1] = {f->width};
    kv_pool_config cfg = {1, w, w, (int32_t)(2 * (n / KV_BLOCK_TOKENS) + 4), f->fmt, head, head};
    ember_error err;
    f->pool = kv_pool_create(&cfg, &err);
    if (f->pool == NULL) fail_msg("%s", err.msg);
    kv_seq_init(&f->seq);
    assert_int_equal(kv_seq_prepare_append(f->pool, &f->seq, n, &err), 0);
    f->rows = malloc((size_t)n * (size_t)f->width * sizeof(float));
    assert_non_null(f->rows);
    for (int64_t p = 0; p < n; p++) {
        float *r = f->rows + (size_t)p * (size_t)f->width;
        /* K-like rows: a few large channels, a per-token scale */
        float tok = 0.5f + (float)(p % 7) * 0.25f;
        for (int i = 0; i < f->width; i++) r[i] = tok * frand() * (i % 13 == 3 ? 6.0f : 1.0f);
        int32_t b = f->seq.blocks[p / KV_BLOCK_TOKENS];
        kv_row_write(f->pool, b, 0, 0, (int)(p % KV_BLOCK_TOKENS), r);
        kv_row_write(f->pool, b, 0, 1, (int)(p % KV_BLOCK_TOKENS), r);
    }
    f->seq.n_tokens = n;
}

static void pool_close(pool_fixture *f) {
    kv_seq_release(f->pool, &f->seq);
    kv_pool_free(f->pool);
    free(f->rows);
}

static void seal(pool_fixture *f, int64_t g) {
    float *scratch = malloc(kv_kvarn_scratch_floats(f->pool) * sizeof(float));
    assert_non_null(scratch);
    kv_kvarn_seal_group(f->pool, &f->seq, 0, g, scratch);
    free(scratch);
}

/* The sealed group holds kvarn_encode's record of its fp16 rows, byte for
 * byte, and the marker tells which prefixes the pool may be adopted at. */
static void test_sealed_group_is_the_record(void **state) {
    (void)state;
    const int heads[][2] = {{4, 8}, {2, 128}, {1, 64}};
    for (int h = 0; h < 3; h++) {
        pool_fixture f;
        pool_open(&f, "kvarn-k6v5-t0", heads[h][0], heads[h][1], 3 * KVARN_GROUP);
        int W = f.width;
        float *half = malloc((size_t)KVARN_GROUP * (size_t)W * sizeof(float));
        for (int t = 0; t < KVARN_GROUP; t++) { /* K and V rows hold the same values */
            int64_t p = KVARN_GROUP + t;
            kv_row_read(f.pool, f.seq.blocks[p / KV_BLOCK_TOKENS], 0, 0, (int)(p % KV_BLOCK_TOKENS),
                        half + (size_t)t * (size_t)W);
        }
        /* before sealing: only prefixes where group 1 is fp16 pass */
        assert_true(kv_seq_kvarn_check(f.pool, &f.seq, 256));
        assert_false(kv_seq_kvarn_check(f.pool, &f.seq, 257));
        seal(&f, 1);
        assert_false(kv_seq_kvarn_check(f.pool, &f.seq, 256));
        assert_true(kv_seq_kvarn_check(f.pool, &f.seq, 257));
        assert_true(kv_seq_kvarn_check(f.pool, &f.seq, 384));
        assert_false(kv_seq_kvarn_check(f.pool, &f.seq, 385)); /* group 2 is due at 384 */
        const int bits[2] = {6, 5};
        for (int kv = 0; kv < 2; kv++) {
            size_t rb = kvarn_record_bytes(W, bits[kv]);
            uint8_t *want = malloc(rb), *got = malloc(rb);
            kvarn_encode(half, W, f.head, bits[kv], want);
            kv_kvarn_record_gather(f.pool, &f.seq, 0, kv, 1, got);
            assert_memory_equal(got, want, rb);
            free(want);
            free(got);
        }
        /* group 0 (the sink) and group 2 are still the fp16 rows */
        float back[256];
        kv_row_read(f.pool, f.seq.blocks[0], 0, 0, 5, back);
        for (int i = 0; i < W; i++)
            assert_true(fabsf(back[i] - f.rows[5 * (size_t)W + (size_t)i]) <= 1e-3f * fabsf(f.rows[5 * (size_t)W + (size_t)i]) + 1e-7f);
        free(half);
        pool_close(&f);
    }
}

/* Reference: the rows as the records decode (kvarn_decode) or as fp16,
 * in f32 blocks, through the f32 attention kernel. */
static void reference_attention(pool_fixture *f, int64_t sealed_end, const float *q, int64_t pos, int n_head,
                                int n_head_kv, float *out) {
    int W = f->width, nb = (int)((pos + KV_BLOCK_TOKENS) / KV_BLOCK_TOKENS);
    float *k = calloc((size_t)nb * KV_BLOCK_TOKENS * (size_t)W, sizeof(float));
    float *v = calloc((size_t)nb * KV_BLOCK_TOKENS * (size_t)W, sizeof(float));
    uint8_t *rec = malloc(kvarn_record_bytes(W, 8));
    for (int kv = 0; kv < 2; kv++) {
        float *dst = kv ? v : k;
        for (int64_t p = 0; p <= pos; p++)
            kv_row_read(f->pool, f->seq.blocks[p / KV_BLOCK_TOKENS], 0, kv, (int)(p % KV_BLOCK_TOKENS),
                        dst + (size_t)p * (size_t)W);
        for (int64_t g = 1; g < sealed_end; g++) {
            kv_kvarn_record_gather(f->pool, &f->seq, 0, kv, g, rec);
            kvarn_decode(rec, W, f->head, kv ? f->fmt.v_bits : f->fmt.k_bits, dst + (size_t)g * KVARN_GROUP * (size_t)W);
        }
    }
    const void **kb = malloc((size_t)nb * sizeof(void *)), **vb = malloc((size_t)nb * sizeof(void *));
    for (int i = 0; i < nb; i++) {
        kb[i] = k + (size_t)i * KV_BLOCK_TOKENS * (size_t)W;
        vb[i] = v + (size_t)i * KV_BLOCK_TOKENS * (size_t)W;
    }
    float *scratch = malloc((size_t)(pos + 1) * sizeof(float));
    op_attention_paged(out, q, kb, vb, KV_ROW_F32, pos + 1, pos, n_head, n_head_kv, f->head, f->head,
                       1.0f / sqrtf((float)f->head), 0, 0, n_head, scratch);
    free(scratch);
    free(kb);
    free(vb);
    free(rec);
    free(k);
    free(v);
}

/* Stated bound: |kernel - reference| <= 2e-5 * (1 + max |reference|) per
 * output; the two differ only in the order of f32 sums (rotated domain). */
static void test_attention_reads_records(void **state) {
    (void)state;
    const int shapes[][3] = {{4, 8, 2}, {2, 128, 2}, {1, 64, 4}}; /* kv heads, head size, query heads per kv head */
    const char *fmts[] = {"kvarn-k6v5-t0", "kvarn-k4v4-t0", "kvarn-k8v2-t0"};
    for (int s = 0; s < 3; s++) {
        pool_fixture f;
        pool_open(&f, fmts[s], shapes[s][0], shapes[s][1], 4 * KVARN_GROUP - 10);
        int n_head_kv = shapes[s][0], d = shapes[s][1], n_head = n_head_kv * shapes[s][2];
        float *q = malloc((size_t)n_head * (size_t)d * sizeof(float));
        float *out = malloc((size_t)n_head * (size_t)d * sizeof(float));
        float *ref = malloc((size_t)n_head * (size_t)d * sizeof(float));
        float *scratch = malloc((size_t)8 * (size_t)f.n * sizeof(float));
        const void **kb = malloc((size_t)f.seq.n_blocks * sizeof(void *)), **vb = malloc((size_t)f.seq.n_blocks * sizeof(void *));
        for (int i = 0; i < f.seq.n_blocks; i++) {
            kb[i] = kv_block_k(f.pool, f.seq.blocks[i], 0);
            vb[i] = kv_block_v(f.pool, f.seq.blocks[i], 0);
        }
        attention_kvarn_format af = {f.fmt.k_bits, f.fmt.v_bits, f.fmt.tail, f.width, f.width,
                                   kv_pool_kvarn_layout(f.pool, 0)};
        double worst = 0;
        const int64_t positions[] = {40, 200, 256, 300, 383, 384, 450, f.n - 1};
        for (size_t pi = 0; pi < sizeof positions / sizeof positions[0]; pi++) {
            int64_t pos = positions[pi], end = kvarn_sealed_end(pos, 0);
            for (int64_t g = 1; g < end; g++)
                if (!kv_seq_kvarn_check(f.pool, &f.seq, 128 * (g + 1) + 1)) seal(&f, g);
            for (int i = 0; i < n_head * d; i++) q[i] = frand() * 2.0f;
            op_attention_kvarn_rows(out, 0, q, 0, kb, vb, &af, &pos, 1, n_head, n_head_kv, d, d,
                                    1.0f / sqrtf((float)d), 0, 0, n_head, scratch);
            reference_attention(&f, end, q, pos, n_head, n_head_kv, ref);
            float m = 0;
            for (int i = 0; i < n_head * d; i++) m = fabsf(ref[i]) > m ? fabsf(ref[i]) : m;
            for (int i = 0; i < n_head * d; i++) {
                double e = fabs((double)out[i] - (double)ref[i]) / (1.0 + m);
                if (e > worst) worst = e;
                if (e > 2e-5)
                    fail_msg("%s heads %dx%d pos %lld: out[%d] %.9g vs decoded %.9g", fmts[s], n_head_kv, d,
                             (long long)pos, i, out[i], ref[i]);
            }
        }
        print_message("%s heads of %d: worst |kernel - decoded| / (1 + max) = %.3g\n", fmts[s], d, worst);
        free(kb);
        free(vb);
        free(scratch);
        free(q);
        free(out);
        free(ref);
        pool_close(&f);
    }
}

/* What every cache tier does with a sequence (exact snapshots, SSD files,
 * checkpoint chains): copy its blocks word for word into fresh ones. A
 * hole reads as zeros; the copy holds the compact records in its kept
 * blocks, passes the validity check, gives its spare blocks back on
 * compaction, and attention over it gives the same bits. */
static void test_copied_sequence_keeps_its_records(void **state) {
    (void)state;
    pool_fixture f;
    pool_open(&f, "kvarn-k6v5-t0", 2, 128, 3 * KVARN_GROUP + 5);
    seal(&f, 1);
    seal(&f, 2);
    int64_t n = f.n;
    assert_true(kv_seq_kvarn_check(f.pool, &f.seq, n));
    int32_t kept = kv_pool_kvarn_group_blocks(f.pool), holes = 0;
    assert_true(kept < 8);
    for (int32_t i = 0; i < f.seq.n_blocks; i++) holes += f.seq.blocks[i] == KV_BLOCK_HOLE;
    assert_int_equal(holes, 2 * (8 - kept));
    kv_seq copy;
    kv_seq_init(&copy);
    ember_error err;
    assert_int_equal(kv_seq_prepare_append(f.pool, &copy, n, &err), 0);
    for (int32_t i = 0; i < f.seq.n_blocks; i++) kv_block_copy(f.pool, copy.blocks[i], f.seq.blocks[i]);
    copy.n_tokens = n;
    assert_true(kv_seq_kvarn_check(f.pool, &copy, n));
    int32_t free_before = kv_pool_n_free(f.pool);
    kv_seq_kvarn_compact(f.pool, &copy);
    assert_int_equal(kv_pool_n_free(f.pool), free_before + holes);
    kv_seq_kvarn_compact(f.pool, &copy); /* idempotent */
    assert_int_equal(kv_pool_n_free(f.pool), free_before + holes);
    for (int32_t i = 0; i < copy.n_blocks; i++) assert_int_equal(copy.blocks[i] == KV_BLOCK_HOLE, f.seq.blocks[i] == KV_BLOCK_HOLE);
    const int n_head = 4, d = 128;
    float q[4 * 128], a[4 * 128], b[4 * 128];
    for (int i = 0; i < n_head * d; i++) q[i] = frand();
    float *scratch = malloc((size_t)8 * (size_t)(n + 1) * sizeof(float));
    const kv_seq *seqs[2] = {&f.seq, &copy};
    float *outs[2] = {a, b};
    for (int s = 0; s < 2; s++) {
        const void **kb = malloc((size_t)seqs[s]->n_blocks * sizeof(void *)), **vb = malloc((size_t)seqs[s]->n_blocks * sizeof(void *));
        for (int32_t i = 0; i < seqs[s]->n_blocks; i++) {
            kb[i] = kv_block_k(f.pool, seqs[s]->blocks[i], 0);
            vb[i] = kv_block_v(f.pool, seqs[s]->blocks[i], 0);
        }
        attention_kvarn_format af = {f.fmt.k_bits, f.fmt.v_bits, f.fmt.tail, f.width, f.width, kv_pool_kvarn_layout(f.pool, 0)};
        int64_t pos = n - 1;
        op_attention_kvarn_rows(outs[s], 0, q, 0, kb, vb, &af, &pos, 1, n_head, 2, d, d, 1.0f / sqrtf((float)d), 0, 0,
                                n_head, scratch);
        free(kb);
        free(vb);
    }
    assert_memory_equal(a, b, sizeof a);
    free(scratch);
    kv_seq_release(f.pool, &copy);
    pool_close(&f);
}

/* ---- capacity: sealed groups give their spare blocks back ---- */

/* Grows one sequence 16 tokens at a time in a pool of n_blocks until the
 * pool is exhausted; returns the tokens it reached. */
static int64_t grow_until_full(const model *m, const char *fmt, int32_t n_blocks, int32_t *held, int32_t *group_blocks) {
    kv_pool_config kc;
    model_kv_config(m, n_blocks, &kc);
    kc.format = parse(fmt);
    ember_error err;
    kv_pool *pool = kv_pool_create(&kc, &err);
    if (pool == NULL) fail_msg("%s", err.msg);
    model_ctx *ctx = model_ctx_create(m, pool, 2, KV_BLOCK_TOKENS, &err);
    assert_non_null(ctx);
    kv_seq seq;
    kv_seq_init(&seq);
    int V = model_get_hparams(m)->n_vocab;
    float *logits = malloc((size_t)V * sizeof(float));
    int32_t tok[KV_BLOCK_TOKENS];
    for (;;) {
        test_random_tokens(&rng_state, tok, KV_BLOCK_TOKENS, V);
        if (model_eval(ctx, &seq, tok, KV_BLOCK_TOKENS, false, logits, &err) < 0) break;
        assert_true(kv_seq_kvarn_check(pool, &seq, seq.n_tokens));
    }
    assert_non_null(strstr(err.msg, "pool exhausted"));
    int64_t n = seq.n_tokens;
    assert_int_equal(n, kv_format_capacity_tokens(&kc, n_blocks));
    *held = kv_pool_n_blocks(pool) - kv_pool_n_free(pool);
    *group_blocks = kv_pool_kvarn_group_blocks(pool);
    /* the table holds a hole for each given-back block, and nothing else */
    int32_t holes = 0;
    for (int32_t i = 0; i < seq.n_blocks; i++) holes += seq.blocks[i] == KV_BLOCK_HOLE;
    assert_int_equal(*held + holes, seq.n_blocks);
    free(logits);
    kv_seq_release(pool, &seq);
    assert_int_equal(kv_pool_n_free(pool), kv_pool_n_blocks(pool));
    model_ctx_free(ctx);
    kv_pool_free(pool);
    return n;
}

/* The same pool holds more tokens under kvarn: a sealed group keeps only
 * the blocks its records need (4 of 8 on stories260K at k6v5, whose 8-wide
 * heads pad; 3 of 8 on the qwen3 shape) and the sequence grows into the
 * rest, while every prefix stays one the rule allows. */
static void test_sealed_groups_give_blocks_back(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    const int32_t n_blocks = 96; /* 1,536 f16 tokens */
    int32_t held, gb;
    int64_t f16 = grow_until_full(m, "f16", n_blocks, &held, &gb);
    assert_int_equal(f16, (int64_t)n_blocks * KV_BLOCK_TOKENS);
    assert_int_equal(gb, 8);
    int64_t k6 = grow_until_full(m, "kvarn-k6v5-t0", n_blocks, &held, &gb);
    print_message("%d blocks: f16 %lld tokens, kvarn-k6v5-t0 %lld tokens (a sealed group keeps %d of 8 blocks)\n",
                  n_blocks, (long long)f16, (long long)k6, gb);
    assert_true(gb < 8);
    assert_true(k6 >= f16 * 8 / gb - 2 * KVARN_GROUP);
    int64_t k4 = grow_until_full(m, "kvarn-k4v4-t128", n_blocks, &held, &gb);
    print_message("%d blocks: kvarn-k4v4-t128 %lld tokens (%d of 8 blocks)\n", n_blocks, (long long)k4, gb);
    assert_true(k4 > f16);
    /* the qwen3-0.6b shape: 28 layers, 8 kv heads of 128 */
    int kw[28], vw[28];
    for (int l = 0; l < 28; l++) kw[l] = vw[l] = 8 * 128;
    kv_pool_config q = {28, kw, vw, 1, parse("kvarn-k6v5"), 128, 128};
    size_t sealed = kv_format_sealed_token_bytes(&q);
    print_message("qwen3-0.6b shape, kvarn-k6v5: %zu bytes per sealed token (f32 229,376)\n", sealed);
    assert_int_equal(kv_format_token_bytes(&q), 114688);
    assert_true(sealed * 5 <= 229376);
    model_free(m);
}

/* ---- through the engine ---- */

static engine *open_engine(const model *m, const char *fmt, int step, bool ckpt, const char *disk) {
    engine_config cfg = engine_default_config();
    cfg.n_threads = 2;
    cfg.prefill_step = step;
    cfg.n_ctx = 1024;
    cfg.kv_format = parse(fmt);
    cfg.cache.ckpt.interval = 64;
    cfg.cache.ckpt.replay_min = 48;
    cfg.cache.ckpt.sys_min = 32;
    cfg.cache.ckpt.decode_interval = 0;
    cfg.cache.disk.path = disk;
    if (ckpt) {
        cfg.cache.swa_block = false;
        cfg.cache.ckpt.snapshot_interval = 0;
    }
    return test_open_engine(m, &cfg);
}

/* Sealing follows positions, not batches: a prompt prefilled in chunks of
 * 32 (seal points between chunks or inside them, tail 100) and in one chunk
 * of 512 gives the same logits, bit for bit. */
static void test_chunking_does_not_matter(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    int32_t p[470];
    test_random_tokens(&rng_state, p, 470, V);
    engine_result a, b;
    engine *e = open_engine(m, "kvarn-k6v5-t100", 32, false, NULL);
    test_generate(e, p, 470, 6, ENGINE_CACHE_BYPASS, &a);
    engine_free(e);
    e = open_engine(m, "kvarn-k6v5-t100", 512, false, NULL);
    test_generate(e, p, 470, 6, ENGINE_CACHE_BYPASS, &b);
    engine_free(e);
    assert_warm_equals_cold(&a, &b, "kvarn chunks of 32 vs 512");
    /* and the records are in use: f16 gives other logits */
    engine_result c;
    e = open_engine(m, "f16", 32, false, NULL);
    test_generate(e, p, 470, 6, ENGINE_CACHE_BYPASS, &c);
    engine_free(e);
    assert_true(memcmp(a.logits, c.logits, (size_t)V * sizeof(float)) != 0);
    engine_result_free(&a);
    engine_result_free(&b);
    engine_result_free(&c);
    model_free(m);
}

/* Two sequences in one batch, each crossing its own sealing point (tail
 * 0: group 1 seals at 256, group 2 at 384): every row's logits equal those
 * of the same sequence forwarded alone, bit for bit. */
static void test_batch_of_two_sequences(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    ember_error err;
    kv_pool_config kc;
    model_kv_config(m, 128, &kc);
    kc.format = parse("kvarn-k6v5-t0");
    kv_pool *pool = kv_pool_create(&kc, &err);
    assert_non_null(pool);
    model_ctx *ctx = model_ctx_create(m, pool, 2, 256, &err);
    assert_non_null(ctx);
    int32_t a[400], b[300];
    test_random_tokens(&rng_state, a, 400, V);
    test_random_tokens(&rng_state, b, 300, V);
    /* alone */
    float *alone_a = malloc((size_t)150 * V * sizeof(float)), *alone_b = malloc((size_t)100 * V * sizeof(float));
    kv_seq s;
    kv_seq_init(&s);
    assert_int_equal(model_eval(ctx, &s, a, 250, false, NULL, &err), 0);
    assert_int_equal(model_eval(ctx, &s, a + 250, 150, true, alone_a, &err), 0);
    kv_seq_release(pool, &s);
    assert_int_equal(model_eval(ctx, &s, b, 200, false, NULL, &err), 0);
    assert_int_equal(model_eval(ctx, &s, b + 200, 100, true, alone_b, &err), 0);
    kv_seq_release(pool, &s);
    /* together: a [250, 400) and b [200, 300) interleaved in one batch */
    kv_seq sa, sb;
    kv_seq_init(&sa);
    kv_seq_init(&sb);
    assert_int_equal(model_eval(ctx, &sa, a, 250, false, NULL, &err), 0);
    assert_int_equal(model_eval(ctx, &sb, b, 200, false, NULL, &err), 0);
    assert_int_equal(kv_seq_prepare_append(pool, &sa, 150, &err), 0);
    assert_int_equal(kv_seq_prepare_append(pool, &sb, 100, &err), 0);
    int32_t tok[250];
    int64_t pos[250];
    kv_seq *seqs[250];
    bool want[250];
    int ia = 0, ib = 0, n = 0;
    while (ia < 150 || ib < 100) { /* two rows of a, one of b */
        for (int k = 0; k < 2 && ia < 150; k++, ia++, n++) {
            tok[n] = a[250 + ia];
            pos[n] = 250 + ia;
            seqs[n] = &sa;
            want[n] = true;
        }
        if (ib < 100) {
            tok[n] = b[200 + ib];
            pos[n] = 200 + ib;
            seqs[n] = &sb;
            want[n] = true;
            ib++;
            n++;
        }
    }
    float *together = malloc((size_t)n * V * sizeof(float));
    model_batch batch = {n, tok, pos, seqs, want, NULL, NULL, false};
    assert_int_equal(model_forward(ctx, &batch, together, &err), 0);
    for (int r = 0; r < n; r++) {
        const float *want_row = seqs[r] == &sa ? alone_a + (size_t)(pos[r] - 250) * V : alone_b + (size_t)(pos[r] - 200) * V;
        if (memcmp(together + (size_t)r * V, want_row, (size_t)V * sizeof(float)) != 0)
            fail_msg("row %d (%s at %lld) differs from the sequence alone", r, seqs[r] == &sa ? "a" : "b",
                     (long long)pos[r]);
    }
    sa.n_tokens = 400;
    sb.n_tokens = 300;
    assert_true(kv_seq_kvarn_check(pool, &sa, 400));
    assert_true(kv_seq_kvarn_check(pool, &sb, 300));
    kv_seq_release(pool, &sa);
    kv_seq_release(pool, &sb);
    free(together);
    free(alone_a);
    free(alone_b);
    model_ctx_free(ctx);
    kv_pool_free(pool);
    model_free(m);
}

static int64_t store_then_probe(engine *e, const int32_t *prompt, int64_t n, const char *what) {
    engine_result r, warm, cold;
    test_generate(e, prompt, n, 4, ENGINE_CACHE_ON, &r);
    engine_result_free(&r);
    test_generate(e, prompt, n, 4, ENGINE_CACHE_LOOKUP, &warm);
    test_generate(e, prompt, n, 4, ENGINE_CACHE_BYPASS, &cold);
    assert_warm_equals_cold(&cold, &warm, what);
    assert_int_equal(warm.cached_tokens + warm.prompt_forwarded, n);
    int64_t got = warm.cached_tokens;
    engine_result_free(&warm);
    engine_result_free(&cold);
    return got;
}

/* Dense + kvarn: the exact tier, warm == cold with sealed groups inside the
 * adopted prefix (tails 0 and 100: seal points on and off the chunk grid). */
static void test_warm_equals_cold_exact(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    const char *fmts[] = {"kvarn-k6v5-t0", "kvarn-k4v4-t100"};
    for (int f = 0; f < 2; f++) {
        engine *e = open_engine(m, fmts[f], 32, false, NULL);
        assert_int_equal(apc_get_tier(engine_cache(e)), APC_TIER_EXACT);
        int32_t a[460], b[460];
        test_random_tokens(&rng_state, a, 460, V);
        memcpy(b, a, sizeof b);
        test_random_tokens(&rng_state, b + 300, 160, V);
        char what[96];
        snprintf(what, sizeof what, "%s exact resend", fmts[f]);
        assert_int_equal(store_then_probe(e, a, 460, what), 459);
        snprintf(what, sizeof what, "%s exact second prompt", fmts[f]);
        assert_int_equal(store_then_probe(e, b, 460, what), 459);
        /* a longer prompt adopts a's entry and prefills across seal points */
        int32_t c[500];
        memcpy(c, a, sizeof a);
        test_random_tokens(&rng_state, c + 460, 40, V);
        engine_result warm, cold;
        test_generate(e, c, 500, 4, ENGINE_CACHE_LOOKUP, &warm);
        test_generate(e, c, 500, 4, ENGINE_CACHE_BYPASS, &cold);
        snprintf(what, sizeof what, "%s exact extension", fmts[f]);
        assert_warm_equals_cold(&cold, &warm, what);
        assert_true(warm.cached_tokens >= 400);
        engine_result_free(&warm);
        engine_result_free(&cold);
        assert_int_equal(test_cache_stats(e).declines[APC_DECLINE_KVARN_SEALS], 0);
        test_assert_no_block_leaks(e);
        engine_free(e);
    }
    model_free(m);
}

/* Checkpoint stacks keep ckpt, their kv layers in records. */
static void test_warm_equals_cold_ckpt(void **state) {
    (void)state;
    const char *models[] = {GEMMA3, QWEN35};
    for (int i = 0; i < 2; i++) {
        REQUIRE_FIXTURE(path, models[i]);
        model *m = test_load_model(path);
        int V = model_get_hparams(m)->n_vocab;
        engine *e = open_engine(m, "kvarn-k6v5-t0", 32, true, NULL);
        assert_int_equal(apc_get_tier(engine_cache(e)), APC_TIER_CKPT);
        int32_t p[420];
        test_random_tokens(&rng_state, p, 420, V);
        char what[128];
        snprintf(what, sizeof what, "kvarn ckpt %s", models[i]);
        int64_t got = store_then_probe(e, p, 420, what);
        if (got < 257) fail_msg("%s: adopted only %lld tokens (no sealed group inside)", what, (long long)got);
        assert_true(test_cache_stats(e).ckpt_hits >= 1);
        engine_free(e);
        /* the default routing (block with snapshots or sliding rows kept) stays ckpt under kvarn */
        e = open_engine(m, "kvarn-k6v5-t0", 32, false, NULL);
        assert_int_equal(apc_get_tier(engine_cache(e)), APC_TIER_CKPT);
        engine_free(e);
        model_free(m);
    }
}

/* Runs open_engine with stderr captured at INFO level; *log gets the text. */
static engine *open_logged(const model *m, const char *fmt, const char *disk, char **log) {
    test_log_capture cap;
    test_log_capture_begin(&cap);
    engine *e = open_engine(m, fmt, 32, false, disk);
    *log = test_log_capture_end(&cap);
    return e;
}

static void test_routing_lines(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    char *log;
    engine *e = open_logged(m, "kvarn-k6v5-t0", NULL, &log);
    if (strstr(log, "APC kvarn KV: 128-token records do not split into 16-token blocks; block tier -> exact\n") == NULL ||
        strstr(log, "APC tier: exact (layers: 5 kv / 0 rot / 0 arr; kv_format=kvarn-k6v5-t0 records); speculation off, L0 off\n") == NULL)
        fail_msg("dense routing lines missing:\n%s", log);
    free(log);
    engine_free(e);
    e = open_logged(m, "f16", NULL, &log);
    assert_non_null(strstr(log, "APC tier: block (layers: 5 kv / 0 rot / 0 arr); speculation off, L0 off\n"));
    assert_null(strstr(log, "kvarn"));
    free(log);
    engine_free(e);
    model_free(m);
    REQUIRE_FIXTURE(g3, GEMMA3);
    m = test_load_model(g3);
    e = open_logged(m, "kvarn-k6v5-t0", NULL, &log);
    if (strstr(log, "APC tier: ckpt (layers: ") == NULL || strstr(log, "kv_format=kvarn-k6v5-t0 records); speculation off, L0 off\n") == NULL)
        fail_msg("ckpt routing line missing:\n%s", log);
    free(log);
    engine_free(e);
    model_free(m);
    /* an exact stack (pure recurrent mamba2, no K/V rows) stays exact, no block -> exact line */
    REQUIRE_FIXTURE(m2, MAMBA2);
    m = test_load_model(m2);
    e = open_logged(m, "kvarn-k6v5-t0", NULL, &log);
    if (strstr(log, "APC tier: exact (layers: 0 kv / 0 rot / ") == NULL ||
        strstr(log, "kv_format=kvarn-k6v5-t0 records); speculation off, L0 off\n") == NULL || strstr(log, "block tier -> exact") != NULL)
        fail_msg("exact routing lines:\n%s", log);
    free(log);
    engine_free(e);
    model_free(m);
}

/* stock -> kvarn -> stock -> kvarn on one disk root: each switch adopts
 * nothing and logs the other namespace once; the same format again adopts
 * its own files bit-identically. */
static void test_restart_stock_and_kvarn(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, STORIES);
    model *m = test_load_model(path);
    int V = model_get_hparams(m)->n_vocab;
    char *root = make_temp_dir();
    int32_t p[300];
    test_random_tokens(&rng_state, p, 300, V);
    char *log;
    engine_result r, warm, cold;

    engine *e = open_logged(m, "f16", root, &log);
    free(log);
    test_generate(e, p, 300, 2, ENGINE_CACHE_ON, &r);
    engine_result_free(&r);
    apc_flush(engine_cache(e));
    assert_true(test_cache_stats(e).disk_writes >= 1);
    engine_free(e);

    e = open_logged(m, "kvarn-k6v5-t0", root, &log);
    const char *line = strstr(log, "written with kv_format=f16; this server stores kv_format=kvarn-k6v5-t0");
    if (line == NULL) fail_msg("no format line in: %s", log);
    assert_null(strstr(line + 1, "written with kv_format=f16"));
    free(log);
    test_generate(e, p, 300, 2, ENGINE_CACHE_ON, &r);
    assert_int_equal(r.cached_tokens, 0);
    assert_int_equal(test_cache_stats(e).disk_hits, 0);
    engine_result_free(&r);
    apc_flush(engine_cache(e));
    assert_true(test_cache_stats(e).disk_writes >= 1);
    engine_free(e);

    e = open_logged(m, "f16", root, &log);
    if (strstr(log, "written with kv_format=kvarn-k6v5-t0; this server stores kv_format=f16") == NULL)
        fail_msg("no kvarn line in: %s", log);
    free(log);
    test_generate(e, p, 300, 2, ENGINE_CACHE_LOOKUP, &warm);
    assert_int_equal(warm.cached_tokens, 299); /* its own f16 files */
    engine_result_free(&warm);
    engine_free(e);

    /* kvarn again: its exact snapshot from disk, warm == cold */
    e = open_logged(m, "kvarn-k6v5-t0", root, &log);
    free(log);
    test_generate(e, p, 300, 2, ENGINE_CACHE_LOOKUP, &warm);
    test_generate(e, p, 300, 2, ENGINE_CACHE_BYPASS, &cold);
    assert_warm_equals_cold(&cold, &warm, "kvarn after a restart");
    assert_int_equal(warm.cached_tokens, 299);
    assert_true(test_cache_stats(e).disk_hits >= 1);
    engine_result_free(&warm);
    engine_result_free(&cold);
    engine_free(e);

    remove_tree(root);
    free(root);
    model_free(m);
}

/* ---- the bitrate-b scenario, through the server ---- */


/* A counter that the request's retirement (after the reply) may still be
 * raising: polled for up to 10 s. */
static double stat_reaching(int port, const char *key, double at_least) {
    double v = 0;
    for (int i = 0; i < 200 && (v = test_cache_stat(port, key)) < at_least; i++) usleep(50 * 1000);
    return v;
}

/* Reference §16 bitrate-b with kvarn widths: a server at k6v5 warms a disk
 * root; a server at k4v4 on the same root has 0 disk hits and adopts < 64
 * tokens on its first request, stores, and adopts > 50% of the prefix on a
 * warm replay with the same answer. Tail 0, so the ~440-token prompt holds
 * sealed groups. */
static void test_bitrate_b_kvarn(void **state) {
    (void)state;
    if (ember_binary() == NULL) {
        print_message("skipping: EMBER_BIN is not set (run under ctest)\n");
        skip();
    }
    REQUIRE_FIXTURE(model_path, STORIES);
    char *root = make_temp_dir();
    char prompt[4096] = "";
    for (int i = 0; i < 12; i++) {
        char s[256];
        snprintf(s, sizeof s, "On day %d the little dog ran to the river, found a red ball and brought it home. ", i + 1);
        strcat(prompt, s);
    }
    char log[600];
    pid_t pid = 0;
    char *k6v5[] = {"--kv-format", "kvarn-k6v5-t0", "--disk-path", root, NULL};
    char *k4v4[] = {"--kv-format", "kvarn:k4v4:t0", "--disk-path", root, NULL};

    snprintf(log, sizeof log, "%s/a.log", root);
    int port = http_spawn_ember(ember_binary(), model_path, k6v5, log, &pid);
    assert_true(port > 0);
    test_completion a = test_complete(port, prompt);
    assert_true(a.prompt_tokens > 256);
    assert_true(stat_reaching(port, "exact_stores", 1) > 0);
    assert_int_equal(http_stop_server(&pid, 10000), 0);

    snprintf(log, sizeof log, "%s/b.log", root);
    port = http_spawn_ember(ember_binary(), model_path, k4v4, log, &pid);
    assert_true(port > 0);
    test_completion b1 = test_complete(port, prompt);
    assert_true(b1.cached < 64);
    assert_int_equal((int)test_cache_stat(port, "disk_hits"), 0);
    assert_true(stat_reaching(port, "exact_stores", 1) > 0);
    test_completion b2 = test_complete(port, prompt);
    if (b2.cached * 2 <= b2.prompt_tokens) fail_msg("warm replay adopted %d of %d", b2.cached, b2.prompt_tokens);
    assert_string_equal(b2.text, b1.text);
    assert_int_equal(http_stop_server(&pid, 10000), 0);
    char *text = read_whole_file(log, NULL);
    assert_non_null(text);
    const char *line = strstr(text, "written with kv_format=kvarn-k6v5-t0; this server stores kv_format=kvarn-k4v4-t0");
    if (line == NULL) fail_msg("no format line in the k4v4 server's log:\n%s", text);
    assert_null(strstr(line + 1, "written with kv_format=kvarn-k6v5-t0"));
    assert_non_null(strstr(text, "APC tier: exact (layers: 5 kv / 0 rot / 0 arr; kv_format=kvarn-k4v4-t0 records)"));
    free(text);
    print_message("bitrate-b kvarn: %d prompt tokens; k4v4 after k6v5: cached %d, replay %d\n", a.prompt_tokens,
                  b1.cached, b2.cached);
    free(a.text);
    free(b1.text);
    free(b2.text);
    remove_tree(root);
    free(root);
}

/* ---- the setting ---- */

static void test_setting(void **state) {
    (void)state;
    serve_config c;
    serve_config_defaults(&c);
    ember_error err;
    bool neg;
    const serve_setting *row = serve_setting_by_flag("kv-format", &neg);
    assert_non_null(row);
    assert_int_equal(serve_settings_apply_flag(&c, row, "kvarn:k6v5", false, &err), 0);
    assert_int_equal(serve_config_validate(&c, &err), 0);
    engine_config ec;
    serve_config_engine(&c, &ec);
    assert_string_equal(kv_format_name(ec.kv_format), "kvarn-k6v5-t1024");
    assert_int_equal(serve_settings_apply_flag(&c, row, "kvarn-k9v5", false, &err), 0);
    assert_int_equal(serve_config_validate(&c, &err), -1);
    if (strstr(err.msg, "cache.kv_format: expected") == NULL || strstr(err.msg, "got 'kvarn-k9v5'") == NULL)
        fail_msg("message: %s", err.msg);
    const char *yaml = "cache:\n  kv_format: kvarn-k4v4-t256\n";
    assert_int_equal(serve_config_load_string(&c, yaml, strlen(yaml), "t.yaml", &err), 0);
    assert_int_equal(serve_config_validate(&c, &err), 0);
    serve_config_engine(&c, &ec);
    assert_int_equal(ec.kv_format.tail, 256);
    assert_int_equal(ec.kv_format.k_bits, 4);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names_and_identity),
        cmocka_unit_test(test_sealed_group_is_the_record),
        cmocka_unit_test(test_attention_reads_records),
        cmocka_unit_test(test_sealed_groups_give_blocks_back),
        cmocka_unit_test(test_copied_sequence_keeps_its_records),
        cmocka_unit_test(test_setting),
        cmocka_unit_test(test_chunking_does_not_matter),
        cmocka_unit_test(test_batch_of_two_sequences),
        cmocka_unit_test(test_warm_equals_cold_exact),
        cmocka_unit_test(test_warm_equals_cold_ckpt),
        cmocka_unit_test(test_routing_lines),
        cmocka_unit_test(test_restart_stock_and_kvarn),
        cmocka_unit_test(test_bitrate_b_kvarn),
    };
    return test_run_group(tests, NULL, NULL);
}
