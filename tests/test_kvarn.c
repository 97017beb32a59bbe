/* test_kvarn.c - the kvarn record codec (src/tensor/kvarn.h).
 *
 * The rotation is orthonormal and its own inverse for every power-of-two
 * slice, including stories260K's 8-wide heads; the slice picked for a head
 * is the largest power of two <= 128 dividing it; a record is a function of
 * its rows (same bytes twice) of the stated size; and rows with outlier
 * channels and uneven token magnitudes (what K rows look like) come back
 * within a relative RMS error that shrinks with every extra bit. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/kvarn.h"
#include "test_util.h"

static float frand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((*s >> 40) & 0xFFFFFF) / 16777216.0f * 2.0f - 1.0f;
}

/* 128 rows of K-like data: channel 3 of each head is an outlier (x20),
 * token magnitudes vary 10x. */
static float *k_like(int width, int head_dim, uint64_t *seed) {
    float *x = malloc((size_t)KVARN_GROUP * width * sizeof(float));
    for (int t = 0; t < KVARN_GROUP; t++) {
        float tok = 0.3f + 2.7f * (float)((t * 37) % 11) / 10.0f;
        for (int j = 0; j < width; j++) {
            float v = frand(seed) * tok;
            if (j % head_dim == 3) v = v * 20.0f + 5.0f;
            x[(size_t)t * width + j] = v;
        }
    }
    return x;
}

static void test_slices(void **state) {
    (void)state;
    assert_int_equal(kvarn_slice(8), 8);
    assert_int_equal(kvarn_slice(64), 64);
    assert_int_equal(kvarn_slice(128), 128);
    assert_int_equal(kvarn_slice(256), 128);
    assert_int_equal(kvarn_slice(80), 16);
    assert_int_equal(kvarn_slice(7), 0);
}

static void test_rotation_orthonormal(void **state) {
    (void)state;
    const int dims[] = {8, 64, 128, 256, 80};
    uint64_t seed = 7;
    for (int d = 0; d < 5; d++) {
        int width = 2 * dims[d];
        float *x = malloc((size_t)width * sizeof(float)), *y = malloc((size_t)width * sizeof(float));
        double n0 = 0, n1 = 0, back = 0;
        for (int j = 0; j < width; j++) x[j] = y[j] = frand(&seed), n0 += (double)x[j] * x[j];
        kvarn_rotate(y, width, dims[d]);
        for (int j = 0; j < width; j++) n1 += (double)y[j] * y[j];
        assert_true(fabs(n1 - n0) < 1e-5 * n0);
        assert_true(memcmp(x, y, (size_t)width * sizeof(float)) != 0);
        kvarn_rotate(y, width, dims[d]);
        for (int j = 0; j < width; j++) back = fmax(back, fabs((double)y[j] - x[j]));
        if (back > 1e-6) fail_msg("head %d: rotating twice is off by %g", dims[d], back);
        free(x);
        free(y);
    }
}

static double rel_rms(const float *a, const float *b, size_t n) {
    double e = 0, s = 0;
    for (size_t i = 0; i < n; i++) e += ((double)a[i] - b[i]) * ((double)a[i] - b[i]), s += (double)a[i] * a[i];
    return sqrt(e / s);
}

static void test_round_trip(void **state) {
    (void)state;
    /* stories260K (4 heads of 8) and the qwen3-0.6b shape (8 heads of 128) */
    const int widths[] = {32, 1024}, heads[] = {8, 128};
    /* stated bound per width, 2..8 bits */
    const double bound[7] = {0.45, 0.22, 0.11, 0.055, 0.028, 0.014, 0.007};
    uint64_t seed = 99;
    for (int c = 0; c < 2; c++) {
        int w = widths[c];
        float *x = k_like(w, heads[c], &seed);
        float *y = malloc((size_t)KVARN_GROUP * w * sizeof(float));
        double prev = 1e9;
        for (int bits = KVARN_MIN_BITS; bits <= KVARN_MAX_BITS; bits++) {
            size_t nb = kvarn_record_bytes(w, bits);
            assert_int_equal(nb % 4, 0);
            assert_true(nb >= ((size_t)KVARN_GROUP * w * bits + 7) / 8 + 2 * (size_t)(w + KVARN_GROUP));
            uint8_t *r1 = malloc(nb), *r2 = malloc(nb);
            kvarn_encode(x, w, heads[c], bits, r1);
            kvarn_encode(x, w, heads[c], bits, r2);
            assert_memory_equal(r1, r2, nb);
            kvarn_decode(r1, w, heads[c], bits, y);
            double e = rel_rms(x, y, (size_t)KVARN_GROUP * w);
            print_message("width %d (heads of %d), %d bits: relative RMS error %.4f\n", w, heads[c], bits, e);
            if (e > bound[bits - KVARN_MIN_BITS]) fail_msg("%d bits: error %g > %g", bits, e, bound[bits - 2]);
            assert_true(e < prev);
            prev = e;
            free(r1);
            free(r2);
        }
        free(x);
        free(y);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_slices),
        cmocka_unit_test(test_rotation_orthonormal),
        cmocka_unit_test(test_round_trip),
    };
    return test_run_group(tests, NULL, NULL);
}
