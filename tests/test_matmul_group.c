/* test_matmul_group.c - tensor_matmul_group (several weights over one input
 * in one pool task, as the forward pass runs q/k/v and gate/up) gives every
 * output the same bits as tensor_matmul on each weight alone, for every
 * type, batch sizes on both sides of the fused path (strips for small
 * batches, panels beyond), 1 to 3 threads and every available ISA; weights
 * of different types or widths fall back to one call each and agree too. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "core/threadpool.h"
#include "tensor/matmul.h"
#include "tensor/quant.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static float uniform(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) / (double)(1 << 24)) * 2.0f - 1.0f;
}

static tensor_weight make_weight(ember_dtype type, int64_t n_in, int64_t n_out) {
    size_t row_bytes = dtype_row_bytes(type, n_in);
    uint8_t *data = malloc(row_bytes * (size_t)n_out);
    float *row = malloc((size_t)n_in * sizeof(float));
    for (int64_t o = 0; o < n_out; o++) {
        for (int64_t i = 0; i < n_in; i++) row[i] = uniform() * 0.05f;
        quant_quantize_row(type, row, data + (size_t)o * row_bytes, n_in);
    }
    free(row);
    return (tensor_weight){.type = type, .n_in = n_in, .n_out = n_out, .row_bytes = row_bytes, .data = data};
}

/* ws[k] over the same x, grouped and one by one: the same bytes. */
static void check_group(const tensor_weight *ws, int n_w, ember_pool *pool, matmul_scratch *scratch) {
    const int64_t token_counts[] = {1, 2, 5, 8, 9, 40};
    int64_t n_in = ws[0].n_in;
    float *x = malloc(40 * (size_t)n_in * sizeof(float));
    for (int64_t i = 0; i < 40 * n_in; i++) x[i] = uniform() * 2;
    for (size_t c = 0; c < sizeof token_counts / sizeof token_counts[0]; c++) {
        int64_t nt = token_counts[c];
        const tensor_weight *wp[TENSOR_MATMUL_GROUP_MAX];
        float *grouped[TENSOR_MATMUL_GROUP_MAX], *alone[TENSOR_MATMUL_GROUP_MAX];
        for (int k = 0; k < n_w; k++) {
            wp[k] = &ws[k];
            grouped[k] = malloc((size_t)nt * (size_t)ws[k].n_out * sizeof(float));
            alone[k] = malloc((size_t)nt * (size_t)ws[k].n_out * sizeof(float));
            memset(grouped[k], 0xff, (size_t)nt * (size_t)ws[k].n_out * sizeof(float));
            assert_int_equal(tensor_matmul(pool, scratch, &ws[k], x, nt, alone[k]), 0);
        }
        assert_int_equal(tensor_matmul_group(pool, scratch, wp, n_w, x, nt, grouped), 0);
        for (int k = 0; k < n_w; k++) {
            if (memcmp(grouped[k], alone[k], (size_t)nt * (size_t)ws[k].n_out * sizeof(float)) != 0)
                fail_msg("%s weight %d of %d, isa %s, %d threads, %lld tokens: grouped differs from alone",
                         dtype_info_of(ws[k].type)->name, k, n_w, quant_isa_name(quant_get_isa()),
                         ember_pool_size(pool), (long long)nt);
            free(grouped[k]);
            free(alone[k]);
        }
    }
    free(x);
}

static void test_group_equals_single(void **state) {
    (void)state;
    const ember_dtype types[] = {DT_F32, DT_F16, DT_BF16, DT_Q4_0, DT_Q8_0, DT_Q4_K, DT_Q6_K, DT_IQ4_XS};
    quant_isa best = quant_best_isa();
    matmul_scratch *scratch = matmul_scratch_create();
    for (int threads = 1; threads <= 3; threads++) {
        ember_pool *pool = ember_pool_create(threads);
        for (int isa = 0; isa <= (int)best; isa++) {
            assert_true(quant_set_isa((quant_isa)isa));
            for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
                /* q/k/v-like: a wide one and two narrow ones, ragged heights */
                tensor_weight w[3] = {make_weight(types[t], 256, 96), make_weight(types[t], 256, 37),
                                      make_weight(types[t], 256, 37)};
                check_group(w, 3, pool, scratch);
                check_group(w, 1, pool, scratch);
                for (int k = 0; k < 3; k++) free((void *)w[k].data);
            }
            /* mixed types (a Q4_K_M-style v projection): one call each */
            tensor_weight mixed[2] = {make_weight(DT_Q4_K, 256, 40), make_weight(DT_Q6_K, 256, 24)};
            check_group(mixed, 2, pool, scratch);
            for (int k = 0; k < 2; k++) free((void *)mixed[k].data);
        }
        ember_pool_free(pool);
    }
    quant_set_isa(best);
    matmul_scratch_free(scratch);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_group_equals_single),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
