/* test_ops.c - the per-row operations of src/tensor/ops.h.
 *
 * The multi-row attention kernel must give every (row, head) the same bits
 * as the single-row kernel (that is what keeps prefill and decode logits
 * identical), for the head sizes real models use - 64, 128, 256 and odd
 * small ones - with GQA groups, sliding windows and key counts that do and
 * do not fill whole 16-token blocks. Also: rmsnorm and rope against plain
 * formulas. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/ops.h"
#include "tensor/quant.h"
#include "test_util.h"

static float frand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((*s >> 40) & 0xFFFFFF) / 16777216.0f * 2.0f - 1.0f;
}

static void check_rows_equal_single(int n_head, int n_head_kv, int d, int n_keys, int n_rows, int64_t window) {
    uint64_t seed = (uint64_t)(n_head * 131 + d * 7 + n_keys);
    int n_blocks = (n_keys + 15) / 16;
    int k_row = n_head_kv * d;
    float **kb = malloc((size_t)n_blocks * sizeof *kb), **vb = malloc((size_t)n_blocks * sizeof *vb);
    for (int b = 0; b < n_blocks; b++) {
        kb[b] = malloc(16 * (size_t)k_row * sizeof(float));
        vb[b] = malloc(16 * (size_t)k_row * sizeof(float));
        for (int i = 0; i < 16 * k_row; i++) kb[b][i] = frand(&seed), vb[b][i] = frand(&seed);
    }
    int q_width = n_head * d;
    float *q = malloc((size_t)n_rows * q_width * sizeof(float));
    for (int i = 0; i < n_rows * q_width; i++) q[i] = frand(&seed) * 2.0f;
    int64_t *pos = malloc((size_t)n_rows * sizeof *pos);
    for (int r = 0; r < n_rows; r++) pos[r] = n_keys - n_rows + r; /* the last n_rows positions */
    float *fast = calloc((size_t)n_rows * q_width, sizeof(float));
    float *slow = calloc((size_t)n_rows * q_width, sizeof(float));
    float *scratch = malloc((size_t)n_rows * n_head * (n_keys + 1) * sizeof(float));
    float scale = 1.0f / sqrtf((float)d);
    int group = n_head / n_head_kv;
    /* at most 64 (row, head) pairs per multi-row call: one kv head's group at a time */
    for (int h0 = 0; h0 < n_head; h0 += group)
        for (int r0 = 0; r0 < n_rows; r0 += 64 / group) {
            int nr = n_rows - r0 < 64 / group ? n_rows - r0 : 64 / group;
            op_attention_paged_rows(fast + (size_t)r0 * q_width, (size_t)q_width, q + (size_t)r0 * q_width,
                                    (size_t)q_width, kb, vb, pos + r0, nr, n_head, n_head_kv, d, d, scale, window, h0,
                                    h0 + group, scratch);
        }
    for (int r = 0; r < n_rows; r++)
        op_attention_paged(slow + (size_t)r * q_width, q + (size_t)r * q_width, kb, vb, pos[r] + 1, pos[r], n_head,
                           n_head_kv, d, d, scale, window, 0, n_head, scratch);
    if (memcmp(fast, slow, (size_t)n_rows * q_width * sizeof(float)) != 0)
        fail_msg("attention rows differ from single rows: heads %d/%d, d %d, keys %d, rows %d, window %lld", n_head,
                 n_head_kv, d, n_keys, n_rows, (long long)window);
    for (int b = 0; b < n_blocks; b++) free(kb[b]), free(vb[b]);
    free(kb); free(vb); free(q); free(pos); free(fast); free(slow); free(scratch);
}

static void test_attention_rows_bit_identical(void **state) {
    (void)state;
    const quant_isa isas[] = {QUANT_ISA_SCALAR, QUANT_ISA_AVX2, QUANT_ISA_AVX512};
    quant_isa saved = quant_get_isa();
    int checked = 0;
    for (int i = 0; i < 3; i++) {
        if (!quant_set_isa(isas[i])) continue;
        check_rows_equal_single(16, 8, 128, 300, 40, 0);  /* qwen3-0.6b heads */
        check_rows_equal_single(4, 2, 64, 80, 17, 0);
        check_rows_equal_single(8, 1, 256, 33, 5, 0);     /* gemma-like MQA, d 256 */
        check_rows_equal_single(4, 1, 32, 100, 20, 24);   /* sliding window */
        check_rows_equal_single(8, 4, 8, 16, 16, 0);      /* stories260K head size */
        check_rows_equal_single(16, 8, 128, 1, 1, 0);
        checked++;
    }
    quant_set_isa(saved);
    assert_true(checked >= 1);
}

static void test_rmsnorm_and_rope(void **state) {
    (void)state;
    float x[64], y[64], w[64];
    double ss = 0;
    for (int i = 0; i < 64; i++) x[i] = (float)(i - 30) / 7.0f, w[i] = 1.0f + i / 100.0f, ss += (double)x[i] * x[i];
    op_rmsnorm(y, x, w, 64, 1e-6f);
    for (int i = 0; i < 64; i++) assert_true(fabs(y[i] - x[i] / sqrt(ss / 64 + 1e-6) * w[i]) < 1e-5);

    /* rope at position 0 is the identity; NORM rotates adjacent pairs, NEOX halves */
    rope_params rp = {ROPE_NORM, 8, 10000.0f, 1.0f, 0.0f, 1.0f, 32.0f, 1.0f, 4096, NULL};
    float v[8] = {1, 2, 3, 4, 5, 6, 7, 8}, orig[8];
    memcpy(orig, v, sizeof v);
    op_rope(v, 1, 8, 0, &rp);
    assert_memory_equal(v, orig, sizeof v);
    op_rope(v, 1, 8, 3, &rp);
    /* pair 0 (theta = 3 rad) of NORM mode is (v0, v1) */
    assert_true(fabs(v[0] - (1 * cosf(3) - 2 * sinf(3))) < 1e-5);
    assert_true(fabs(v[1] - (1 * sinf(3) + 2 * cosf(3))) < 1e-5);
    memcpy(v, orig, sizeof v);
    rp.mode = ROPE_NEOX;
    op_rope(v, 1, 8, 3, &rp);
    /* pair 0 of NEOX mode is (v0, v4) */
    assert_true(fabs(v[0] - (1 * cosf(3) - 5 * sinf(3))) < 1e-5);
    assert_true(fabs(v[4] - (1 * sinf(3) + 5 * cosf(3))) < 1e-5);
    /* linear scaling by 2 at position 6 equals no scaling at position 3 */
    float a[8], b[8];
    memcpy(a, orig, sizeof a);
    memcpy(b, orig, sizeof b);
    op_rope(a, 1, 8, 3, &rp);
    rp.freq_scale = 0.5f;
    op_rope(b, 1, 8, 6, &rp);
    for (int i = 0; i < 8; i++) assert_true(fabsf(a[i] - b[i]) < 1e-5f);
    /* YaRN keeps vector norms scaled by mscale only */
    rp.ext_factor = 1.0f;
    rp.freq_scale = 0.25f;
    float c[8];
    memcpy(c, orig, sizeof c);
    op_rope(c, 1, 8, 100, &rp);
    double n0 = 0, n1 = 0;
    for (int i = 0; i < 8; i++) n0 += orig[i] * orig[i], n1 += c[i] * c[i];
    double mscale = 1.0 + 0.1 * log(4.0);
    assert_true(fabs(sqrt(n1) - sqrt(n0) * mscale) < 1e-4 * sqrt(n0));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attention_rows_bit_identical),
        cmocka_unit_test(test_rmsnorm_and_rope),
    };
    return test_run_group(tests, NULL, NULL);
}
