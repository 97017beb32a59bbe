/* test_matmul.c - tensor_matmul is bit-identical to quant_vec_dot row by row
 * for every type, batch size (every size 1..9 of the small-batch strips and
 * their edge, 13, 16, 17 around the chunked strips' limit, then 64, 70, 100
 * and 131 for tiles and panels, and for AVX2's strips over token blocks of
 * 64 with a shorter last chunk), thread count (1, 2) and
 * available ISA: the batch-invariance invariant the engine relies on. Float
 * rows also get lengths with a masked tail and several K blocks. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h"
#include "tensor/matmul.h"
#include "tensor/quant.h"

static uint64_t tm_rng = 0x2545f4914f6cdd1dull;
static float tm_uniform(void) {
    tm_rng ^= tm_rng << 13;
    tm_rng ^= tm_rng >> 7;
    tm_rng ^= tm_rng << 17;
    return (float)((tm_rng >> 40) / (double)(1 << 24)) * 2.0f - 1.0f;
}

static const ember_dtype tm_types[] = {DT_F32,  DT_F16,  DT_BF16, DT_Q4_0, DT_Q4_1,
                                       DT_Q5_0, DT_Q5_1, DT_Q8_0, DT_Q2_K, DT_Q3_K,
                                       DT_Q4_K, DT_Q5_K, DT_Q6_K, DT_IQ4_NL,
                                       DT_IQ4_XS};

static void check_type(ember_dtype type, int64_t n_in, ember_pool *pool, matmul_scratch *scratch) {
    const int64_t n_out = 37; /* ragged against every tile and strip height (4, 16, 8, 5, 3, 2) */
    const int64_t token_counts[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 64, 70, 100, 131};
    const int64_t max_tokens = 131;
    size_t row_bytes = dtype_row_bytes(type, n_in);
    uint8_t *wdata = malloc(row_bytes * n_out);
    float *row = malloc(n_in * sizeof(float));
    for (int64_t o = 0; o < n_out; o++) {
        for (int64_t i = 0; i < n_in; i++) row[i] = tm_uniform() * 0.05f;
        quant_quantize_row(type, row, wdata + o * row_bytes, n_in);
    }
    float *x = malloc(max_tokens * n_in * sizeof(float));
    for (int64_t i = 0; i < max_tokens * n_in; i++) x[i] = tm_uniform() * 2;
    tensor_weight w = {.type = type, .n_in = n_in, .n_out = n_out, .row_bytes = row_bytes, .data = wdata};

    /* Reference: each activation row converted alone, one dot per output. */
    ember_dtype act = quant_dot_act(type);
    size_t act_bytes = dtype_row_bytes(act, n_in);
    uint8_t *a = malloc(act_bytes);
    float *ref = malloc(max_tokens * n_out * sizeof(float));
    float *y = malloc(max_tokens * n_out * sizeof(float));
    for (int64_t t = 0; t < max_tokens; t++) {
        quant_quantize_row(act, x + t * n_in, a, n_in);
        for (int64_t o = 0; o < n_out; o++)
            ref[t * n_out + o] = quant_vec_dot(type, n_in, wdata + o * row_bytes, a);
    }
    for (size_t k = 0; k < sizeof token_counts / sizeof token_counts[0]; k++) {
        int64_t nt = token_counts[k];
        /* Offset the batch so tokens are compared in different tile slots. */
        int64_t first = (k % 2) ? max_tokens - nt : 0;
        memset(y, 0xff, nt * n_out * sizeof(float));
        assert_int_equal(tensor_matmul(pool, scratch, &w, x + first * n_in, nt, y), 0);
        if (memcmp(y, ref + first * n_out, nt * n_out * sizeof(float)) != 0) {
            for (int64_t i = 0; i < nt * n_out; i++)
                if (memcmp(&y[i], &ref[first * n_out + i], 4) != 0)
                    fail_msg("%s isa=%s%s threads=%d n_tokens=%lld: y[%lld][%lld] %.9g != dot %.9g",
                             dtype_info_of(type)->name, quant_isa_name(quant_get_isa()),
                             quant_avx512_bf16_in_use() ? "+bf16" : "",
                             ember_pool_size(pool), (long long)nt, (long long)(i / n_out),
                             (long long)(i % n_out), y[i], ref[first * n_out + i]);
        }
    }
    free(wdata), free(row), free(x), free(a), free(ref), free(y);
}

static void test_bit_identity(void **state) {
    (void)state;
    quant_isa best = quant_best_isa();
    matmul_scratch *scratch = matmul_scratch_create();
    /* AVX-512 runs twice where the CPU has AVX512_BF16: BF16 weights on
     * vdpbf16ps (the default there), then on the f32 kernels other CPUs use. */
    bool has_bf16 = quant_set_avx512_bf16(true);
    for (int threads = 1; threads <= 2; threads++) {
        ember_pool *pool = ember_pool_create(threads);
        for (int pass = 0; pass <= (int)best + has_bf16; pass++) {
            int isa = pass > (int)best ? (int)best : pass;
            assert_true(quant_set_isa((quant_isa)isa));
            assert_true(quant_set_avx512_bf16(has_bf16 && pass == isa));
            if (isa == QUANT_ISA_AVX512 && pass == isa)
                assert_int_equal(quant_dot_act(DT_BF16), has_bf16 ? DT_BF16 : DT_F32);
            for (size_t t = 0; t < sizeof tm_types / sizeof tm_types[0]; t++) {
                check_type(tm_types[t], 512, pool, scratch);
                /* float rows also end in a 16-chunk and a masked tail, and
                 * run over several K blocks of the AVX-512 float panels (an
                 * odd number of full chunks with a tail, an even one without) */
                if (dtype_info_of(tm_types[t])->block_elems == 1) {
                    check_type(tm_types[t], 512 + 16 + 9, pool, scratch);
                    check_type(tm_types[t], 2048 + 16 + 9, pool, scratch);
                    check_type(tm_types[t], 2048 + 32, pool, scratch);
                }
            }
        }
        ember_pool_free(pool);
    }
    quant_set_isa(best);
    quant_set_avx512_bf16(has_bf16);
    matmul_scratch_free(scratch);
}

/* One F16 shape against the single-row dot: n_out rows, the batch sizes in
 * nts (n_tokens of them at most). */
static void check_f16_shape(int64_t n_in, int64_t n_out, const int64_t *nts, int count, ember_pool *pool,
                            matmul_scratch *scratch) {
    int64_t max_tokens = 0;
    for (int k = 0; k < count; k++) max_tokens = nts[k] > max_tokens ? nts[k] : max_tokens;
    size_t rb = dtype_row_bytes(DT_F16, n_in);
    uint8_t *wd = malloc(rb * n_out);
    float *row = malloc(n_in * sizeof(float)), *x = malloc(max_tokens * n_in * sizeof(float));
    for (int64_t o = 0; o < n_out; o++) {
        for (int64_t i = 0; i < n_in; i++) row[i] = tm_uniform() * 0.05f;
        quant_quantize_row(DT_F16, row, wd + o * rb, n_in);
    }
    for (int64_t i = 0; i < max_tokens * n_in; i++) x[i] = tm_uniform() * 2;
    tensor_weight w = {.type = DT_F16, .n_in = n_in, .n_out = n_out, .row_bytes = rb, .data = wd};
    float *y = malloc(max_tokens * n_out * sizeof(float));
    for (int k = 0; k < count; k++) {
        memset(y, 0xff, nts[k] * n_out * sizeof(float));
        assert_int_equal(tensor_matmul(pool, scratch, &w, x, nts[k], y), 0);
        for (int64_t t = 0; t < nts[k]; t++)
            for (int64_t o = 0; o < n_out; o++) {
                float ref = quant_vec_dot(DT_F16, n_in, wd + o * rb, (const uint8_t *)(x + t * n_in));
                if (memcmp(&y[t * n_out + o], &ref, 4) != 0)
                    fail_msg("f16 n_in=%lld n_out=%lld threads=%d n_tokens=%lld: y[%lld][%lld] %.9g != dot %.9g",
                             (long long)n_in, (long long)n_out, ember_pool_size(pool), (long long)nts[k],
                             (long long)t, (long long)o, y[t * n_out + o], ref);
            }
    }
    free(wd), free(row), free(x), free(y);
}

/* The AVX-512 F16 panels work on groups of up to 64 rows (matmul_avx512.c):
 * enough rows for several full groups and a short one per thread's part,
 * rows where the next group is packed during the current one (537) and
 * where it is packed before it (2080: two copies do not fit the budget),
 * and a batch longer than one token block (2048-wide rows: the first group
 * packed again for the second block). */
static void test_f16_groups(void **state) {
    (void)state;
    if (quant_best_isa() < QUANT_ISA_AVX512) skip();
    matmul_scratch *scratch = matmul_scratch_create();
    const int64_t short_batches[] = {9, 100}, long_batch[] = {2100};
    for (int threads = 1; threads <= 2; threads++) {
        ember_pool *pool = ember_pool_create(threads);
        check_f16_shape(537, 16 * 16 * 5 + 7, short_batches, 2, pool, scratch);
        check_f16_shape(2080, 16 * 16 * 5 + 7, short_batches, 2, pool, scratch);
        check_f16_shape(2048, 16 * 9, long_batch, 1, pool, scratch);
        ember_pool_free(pool);
    }
    matmul_scratch_free(scratch);
}

/* Quantized results do not depend on the ISA at all (shared integer fold). */
static void test_isa_agreement(void **state) {
    (void)state;
    quant_isa best = quant_best_isa();
    const int64_t n_in = 256, n_out = 8, nt = 9;
    const ember_dtype types[] = {DT_Q8_0, DT_Q4_K, DT_Q6_K, DT_Q4_0, DT_IQ4_NL, DT_IQ4_XS};
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        size_t rb = dtype_row_bytes(types[k], n_in);
        uint8_t *wd = malloc(rb * n_out);
        float *row = malloc(n_in * sizeof(float)), *x = malloc(nt * n_in * sizeof(float));
        for (int64_t o = 0; o < n_out; o++) {
            for (int64_t i = 0; i < n_in; i++) row[i] = tm_uniform();
            quant_quantize_row(types[k], row, wd + o * rb, n_in);
        }
        for (int64_t i = 0; i < nt * n_in; i++) x[i] = tm_uniform();
        tensor_weight w = {.type = types[k], .n_in = n_in, .n_out = n_out, .row_bytes = rb, .data = wd};
        float y0[8 * 9], y1[8 * 9];
        matmul_scratch *s = matmul_scratch_create();
        quant_set_isa(QUANT_ISA_SCALAR);
        tensor_matmul(NULL, s, &w, x, nt, y0);
        quant_set_isa(best);
        tensor_matmul(NULL, s, &w, x, nt, y1);
        assert_memory_equal(y0, y1, sizeof y0);
        matmul_scratch_free(s);
        free(wd), free(row), free(x);
    }
}

/* The small-batch strips exist for the types decode and verification use
 * most, on both SIMD ISAs (otherwise test_bit_identity would prove nothing
 * about them), and never for more tokens than they are built for. */
static void test_strips_cover_types(void **state) {
    (void)state;
    const ember_dtype types[] = {DT_Q8_0, DT_Q4_0, DT_Q4_K, DT_Q6_K, DT_F16, DT_BF16, DT_F32};
    quant_isa best = quant_best_isa();
    for (int isa = QUANT_ISA_AVX2; isa <= (int)best; isa++) {
        assert_true(quant_set_isa((quant_isa)isa));
        for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
            for (int c = 1; c <= QUANT_STRIP_TOKENS; c++) {
                int rows = 0;
                /* a lone token may keep the GEMV dot where that is faster */
                if (quant_strip_kernel(types[k], c, &rows) == NULL && c > 1)
                    fail_msg("%s isa=%s: no strip for %d tokens", dtype_info_of(types[k])->name,
                             quant_isa_name((quant_isa)isa), c);
                if (c > 1) assert_in_range(rows, 1, 16);
            }
            int rows = 0;
            assert_null(quant_strip_kernel(types[k], QUANT_STRIP_TOKENS + 1, &rows));
        }
    }
    quant_set_isa(best);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bit_identity),
        cmocka_unit_test(test_f16_groups),
        cmocka_unit_test(test_strips_cover_types),
        cmocka_unit_test(test_isa_agreement),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
