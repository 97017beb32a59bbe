/* test_quant.c - quantized formats: fp16/bf16 scalars, block layouts,
 * round-trip error per type, and every ISA's dot against the scalar one and
 * against the dot of the dequantized values. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/quant.h"

static uint64_t tq_rng_state = 0x9e3779b97f4a7c15ull;
static float tq_uniform(void) { /* [-1, 1) */
    tq_rng_state ^= tq_rng_state << 13;
    tq_rng_state ^= tq_rng_state >> 7;
    tq_rng_state ^= tq_rng_state << 17;
    return (float)((tq_rng_state >> 40) / (double)(1 << 24)) * 2.0f - 1.0f;
}
/* Roughly Gaussian with occasional outliers, like real weights/activations. */
static float tq_sample(void) {
    float g = tq_uniform() + tq_uniform() + tq_uniform();
    if (tq_uniform() > 0.98f) g *= 4;
    return g;
}

typedef struct tq_case {
    ember_dtype type;
    double max_rel_rmse; /* bound on rms(dequant(quant(x)) - x) / rms(x) */
} tq_case;

static const tq_case tq_cases[] = {
    {DT_F32, 0},       {DT_F16, 5e-4},    {DT_BF16, 4e-3},   {DT_Q4_0, 0.19},
    {DT_Q4_1, 0.12},   {DT_Q5_0, 0.07},   {DT_Q5_1, 0.06},   {DT_Q8_0, 0.01},
    {DT_Q8_1, 0.01},   {DT_Q2_K, 0.42},   {DT_Q3_K, 0.27},   {DT_Q4_K, 0.12},
    {DT_Q5_K, 0.06},   {DT_Q6_K, 0.037},  {DT_Q8_K, 0.027},
    {DT_IQ4_NL, 0.12}, {DT_IQ4_XS, 0.12},
};
enum { TQ_NCASES = sizeof tq_cases / sizeof tq_cases[0] };

static const int64_t tq_lengths[] = {256, 768, 4096};

static void fill(float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) x[i] = tq_sample() * scale;
}

/* The row conversion under every ISA this CPU has gives the scalar's bits
 * on every exponent of f32 (overflow, the subnormal range, ties), signed
 * zeros, infinities and NaNs with payloads; odd lengths exercise the tail. */
static void test_f16_row_matches_scalar(void **state) {
    (void)state;
    enum { N = 1 << 16 };
    float *src = malloc(N * sizeof(float));
    uint16_t *got = malloc(N * sizeof(uint16_t));
    assert_non_null(src);
    assert_non_null(got);
    for (int i = 0; i < N; i++) {
        /* sweep the exponent and low mantissa bits; every 16th value a tie */
        uint32_t bits = ((uint32_t)(i & 0xff) << 23) | ((uint32_t)(i >> 8) << 5) | ((uint32_t)i & 0x1fu);
        if (i % 16 == 0) bits = (bits & ~0x1fffu) | 0x1000u;
        if (i % 7 == 0) bits |= 0x80000000u;
        memcpy(&src[i], &bits, 4);
    }
    const uint32_t specials[] = {0x7f800000u, 0xff800000u, 0x7fc00001u, 0x7f812345u, 0xffffe000u,
                                 0x00000001u, 0x80000000u, 0x477ff000u, 0x477fefffu, 0x33000000u, 0x33000001u};
    for (size_t k = 0; k < sizeof specials / sizeof specials[0]; k++) memcpy(&src[k * 101], &specials[k], 4);
    quant_isa best = quant_get_isa();
    for (int isa = QUANT_ISA_SCALAR; isa <= (int)best; isa++) {
        assert_true(quant_set_isa((quant_isa)isa));
        for (int64_t n = N - 5; n <= N; n += 5) {
            memset(got, 0xab, N * sizeof(uint16_t));
            quant_f32_to_f16_row(src, got, n);
            for (int64_t i = 0; i < n; i++)
                if (got[i] != quant_f32_to_f16(src[i]))
                    fail_msg("isa %d, value %lld (%a): row %#x, scalar %#x", isa, (long long)i, (double)src[i],
                             got[i], quant_f32_to_f16(src[i]));
            for (int64_t i = n; i < N; i++) assert_int_equal(got[i], 0xabab); /* nothing past n */
        }
    }
    quant_set_isa(best);
    free(src);
    free(got);
}

static void test_f16_scalars(void **state) {
    (void)state;
    assert_true(quant_f16_to_f32(0x3c00) == 1.0f);
    assert_true(quant_f16_to_f32(0xc000) == -2.0f);
    assert_true(quant_f16_to_f32(0x7bff) == 65504.0f);
    assert_true(quant_f16_to_f32(0x0001) == ldexpf(1, -24));
    assert_int_equal(quant_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(quant_f32_to_f16(65520.0f), 0x7c00);
    assert_int_equal(quant_f32_to_f16(ldexpf(1, -25)), 0);          /* tie to even: 0 */
    assert_int_equal(quant_f32_to_f16(ldexpf(1.5f, -25)), 0x0001);  /* above the tie */
    assert_int_equal(quant_f32_to_f16(1.0f + ldexpf(1, -11)), 0x3c00); /* tie to even */
    assert_int_equal(quant_f32_to_f16(1.0f + ldexpf(3, -11)), 0x3c02);
    /* Every finite half survives a round trip. */
    for (uint32_t h = 0; h < 65536; h++) {
        if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue; /* nan */
        assert_int_equal(quant_f32_to_f16(quant_f16_to_f32((uint16_t)h)), h);
    }
    /* Random floats: f32 -> f16 -> f32 error within half an ulp (relative 2^-11). */
    for (int i = 0; i < 100000; i++) {
        float f = tq_uniform() * ldexpf(1, (int)(tq_uniform() * 14));
        float back = quant_f16_to_f32(quant_f32_to_f16(f));
        assert_true(fabsf(back - f) <= fabsf(f) * ldexpf(1, -11) + ldexpf(1, -25));
    }
    assert_true(quant_bf16_to_f32(quant_f32_to_bf16(1.0f)) == 1.0f);
    assert_int_equal(quant_f32_to_bf16(1.0f + ldexpf(1, -8)), 0x3f80); /* tie to even */
    assert_int_equal(quant_f32_to_bf16(1.0f + ldexpf(3, -8)), 0x3f82);
}

/* Hand-built blocks pin the documented layouts. */
static void test_layouts(void **state) {
    (void)state;
    float y[256];
    block_q4_0 b4 = {.d = quant_f32_to_f16(0.5f)};
    b4.qs[0] = 0x93; /* x[0] = (3-8)*0.5, x[16] = (9-8)*0.5 */
    quant_dequantize_row(DT_Q4_0, &b4, y, 32);
    assert_true(y[0] == -2.5f && y[16] == 0.5f && y[1] == -4.0f);

    block_q5_0 b5 = {.d = quant_f32_to_f16(1.0f)};
    b5.qs[2] = 0x21;
    uint32_t qh = (1u << 2) | (1u << 18);
    memcpy(b5.qh, &qh, 4);
    quant_dequantize_row(DT_Q5_0, &b5, y, 32);
    assert_true(y[2] == 1.0f && y[18] == 2.0f && y[0] == -16.0f);

    block_q4_K k4;
    memset(&k4, 0, sizeof k4);
    k4.d = quant_f32_to_f16(1.0f);
    k4.dmin = quant_f32_to_f16(1.0f);
    k4.scales[5 + 4] = 0x31;     /* sub-block 5: scale low 1, min low 3 */
    k4.qs[32 * 2 + 7] = 0x50;    /* group 2 high nibble -> element 64*2+32+7 (sub-block 5) */
    quant_dequantize_row(DT_Q4_K, &k4, y, 256);
    assert_true(y[167] == 1.0f * 5 - 3.0f);
    assert_true(y[166] == -3.0f && y[0] == 0.0f);

    block_q6_K k6;
    memset(&k6, 0, sizeof k6);
    k6.d = quant_f32_to_f16(1.0f);
    for (int i = 0; i < 16; i++) k6.scales[i] = (int8_t)(i + 1);
    k6.ql[64 + 33] = 0x70;  /* half 1, element 128+96+1: high nibble of ql[64+32+1] */
    k6.qh[32 + 1] = 0xc0;   /* its high 2 bits = 3 -> q = 7 | 48 = 55 */
    quant_dequantize_row(DT_Q6_K, &k6, y, 256);
    assert_true(y[128 + 96 + 1] == 15.0f * (55 - 32)); /* scale index 8+0+6 -> 15 */
}

static double rel_rmse(const float *a, const float *b, int64_t n) {
    double e = 0, s = 0;
    for (int64_t i = 0; i < n; i++) {
        e += (double)(a[i] - b[i]) * (a[i] - b[i]);
        s += (double)b[i] * b[i];
    }
    return sqrt(e / (s > 0 ? s : 1));
}

static void test_roundtrip(void **state) {
    (void)state;
    for (int c = 0; c < TQ_NCASES; c++) {
        const tq_case *tc = &tq_cases[c];
        for (size_t li = 0; li < sizeof tq_lengths / sizeof tq_lengths[0]; li++) {
            int64_t n = tq_lengths[li];
            float *x = malloc(n * sizeof(float)), *back = malloc(n * sizeof(float));
            void *q = malloc(dtype_row_bytes(tc->type, n));
            fill(x, n, 0.02f);
            assert_int_equal(quant_quantize_row(tc->type, x, q, n), 0);
            quant_dequantize_row(tc->type, q, back, n);
            double err = rel_rmse(back, x, n);
            if (getenv("TQ_VERBOSE"))
                printf("%s n=%lld rel rmse %.5f\n", dtype_info_of(tc->type)->name, (long long)n, err);
            if (err > tc->max_rel_rmse && !getenv("TQ_VERBOSE"))
                fail_msg("%s n=%lld: relative rmse %.5f > %.5f", dtype_info_of(tc->type)->name,
                         (long long)n, err, tc->max_rel_rmse);
            /* Deterministic: quantizing again gives the same bytes. */
            void *q2 = malloc(dtype_row_bytes(tc->type, n));
            quant_quantize_row(tc->type, x, q2, n);
            assert_memory_equal(q, q2, dtype_row_bytes(tc->type, n));
            /* All-zero rows quantize to zeros without NaN. */
            memset(x, 0, n * sizeof(float));
            quant_quantize_row(tc->type, x, q, n);
            quant_dequantize_row(tc->type, q, back, n);
            for (int64_t i = 0; i < n; i++) assert_true(back[i] == 0.0f);
            free(x), free(back), free(q), free(q2);
        }
    }
}

/* Weight row and converted activation row of one type. */
typedef struct tq_rows {
    void *w, *a;
    float *wf, *af; /* dequantized, for the reference dot */
} tq_rows;

static tq_rows make_rows(ember_dtype type, int64_t n) {
    ember_dtype act = dtype_info_of(type)->dot_act;
    tq_rows r;
    float *x = malloc(n * sizeof(float));
    r.w = malloc(dtype_row_bytes(type, n));
    r.a = malloc(dtype_row_bytes(act, n));
    r.wf = malloc(n * sizeof(float));
    r.af = malloc(n * sizeof(float));
    fill(x, n, 0.05f);
    quant_quantize_row(type, x, r.w, n);
    quant_dequantize_row(type, r.w, r.wf, n);
    fill(x, n, 1.5f);
    quant_quantize_row(act, x, r.a, n);
    quant_dequantize_row(act, r.a, r.af, n);
    free(x);
    return r;
}

static void free_rows(tq_rows *r) { free(r->w), free(r->a), free(r->wf), free(r->af); }

static void test_dots(void **state) {
    (void)state;
    quant_isa best = quant_best_isa();
    printf("best ISA: %s\n", quant_isa_name(best));
    for (int c = 0; c < TQ_NCASES; c++) {
        ember_dtype type = tq_cases[c].type;
        for (size_t li = 0; li < sizeof tq_lengths / sizeof tq_lengths[0]; li++) {
            for (int rep = 0; rep < 4; rep++) {
                int64_t n = tq_lengths[li];
                tq_rows r = make_rows(type, n);
                double ref = 0, mag = 0;
                for (int64_t i = 0; i < n; i++) {
                    ref += (double)r.wf[i] * r.af[i];
                    mag += fabs((double)r.wf[i] * r.af[i]);
                }
                assert_true(quant_set_isa(QUANT_ISA_SCALAR));
                float scalar = quant_vec_dot(type, n, r.w, r.a);
                /* Against the dequantized dot: f32 rounding of scales only
                 * (Q8_1's s is an fp16 rounding of d*sum). */
                double tol = (type == DT_Q4_1 || type == DT_Q5_1 ? 2e-3 : 2e-5) * mag + 1e-6;
                if (fabs(scalar - ref) > tol)
                    fail_msg("%s n=%lld: scalar %.7g vs dequantized %.7g", dtype_info_of(type)->name,
                             (long long)n, scalar, ref);
                for (int isa = 1; isa <= (int)best; isa++) {
                    assert_true(quant_set_isa((quant_isa)isa));
                    float simd = quant_vec_dot(type, n, r.w, r.a);
                    bool is_float = type == DT_F32 || type == DT_F16 || type == DT_BF16;
                    ember_dtype act = quant_dot_act(type);
                    if (act != dtype_info_of(type)->dot_act) {
                        /* BF16 on vdpbf16ps: activations rounded to BF16;
                         * the scalar dot of the rounded values is the reference */
                        void *a2 = malloc(dtype_row_bytes(act, n));
                        float *af2 = malloc(n * sizeof(float));
                        quant_quantize_row(act, r.af, a2, n);
                        quant_dequantize_row(act, a2, af2, n);
                        simd = quant_vec_dot(type, n, r.w, a2);
                        assert_true(quant_set_isa(QUANT_ISA_SCALAR));
                        scalar = quant_vec_dot(type, n, r.w, af2);
                        assert_true(quant_set_isa((quant_isa)isa));
                        free(a2), free(af2);
                    }
                    if (is_float) {
                        if (fabs(simd - scalar) > 1e-6 * mag + 1e-7)
                            fail_msg("%s %s n=%lld: %.9g vs scalar %.9g", dtype_info_of(type)->name,
                                     quant_isa_name(isa), (long long)n, simd, scalar);
                    } else if (memcmp(&simd, &scalar, 4) != 0) {
                        /* quantized dots are exact integers + the shared fold */
                        fail_msg("%s %s n=%lld: %.9g differs from scalar %.9g",
                                 dtype_info_of(type)->name, quant_isa_name(isa), (long long)n, simd,
                                 scalar);
                    }
                }
                free_rows(&r);
            }
        }
    }
    quant_set_isa(best);
}

/* Extreme activations: values saturating the int8 range on every lane. */
static void test_dots_extreme(void **state) {
    (void)state;
    quant_isa best = quant_best_isa();
    const ember_dtype types[] = {DT_Q4_0, DT_Q4_1, DT_Q5_0, DT_Q5_1, DT_Q8_0,
                                 DT_Q2_K, DT_Q3_K, DT_Q4_K, DT_Q5_K, DT_Q6_K,
                                 DT_IQ4_NL, DT_IQ4_XS};
    int64_t n = 512;
    float *x = malloc(n * sizeof(float));
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        ember_dtype type = types[k], act = dtype_info_of(type)->dot_act;
        void *w = malloc(dtype_row_bytes(type, n)), *a = malloc(dtype_row_bytes(act, n));
        for (int64_t i = 0; i < n; i++) x[i] = (i % 3 == 0) ? 1.0f : -1.0f;
        quant_quantize_row(type, x, w, n);
        for (int64_t i = 0; i < n; i++) x[i] = (i % 2 == 0) ? -1.0f : 1.0f;
        x[5] = -1.0f;
        quant_quantize_row(act, x, a, n);
        quant_set_isa(QUANT_ISA_SCALAR);
        float scalar = quant_vec_dot(type, n, w, a);
        for (int isa = 1; isa <= (int)best; isa++) {
            quant_set_isa((quant_isa)isa);
            float simd = quant_vec_dot(type, n, w, a);
            if (memcmp(&simd, &scalar, 4) != 0)
                fail_msg("%s %s extreme: %.9g vs %.9g", dtype_info_of(type)->name,
                         quant_isa_name(isa), simd, scalar);
        }
        free(w), free(a);
    }
    free(x);
    quant_set_isa(best);
}

/* The AVX-512 f32 -> BF16 rounding (BF16 activations for vdpbf16ps, and
 * writing BF16 files) gives quant_f32_to_bf16's bytes: ties to even both
 * ways, carries into the exponent, infinities, NaNs made quiet, subnormals. */
static void test_bf16_rounding_isa(void **state) {
    (void)state;
    quant_isa best = quant_best_isa();
    const uint32_t special[] = {0x3f808000u, 0x3f818000u, 0x3f80ffffu, 0x3f7fffffu, 0x7f7fffffu, 0x7f800000u,
                                0xff800000u, 0x7f800001u, 0xffc00000u, 0x7fbfffffu, 0x00000001u, 0x80008000u,
                                0x00018000u, 0x00000000u, 0x80000000u, 0x477fe000u, 0xc0490fdbu};
    enum { N = 1000 + 7, NS = sizeof special / sizeof special[0] }; /* a scalar tail after the 16-wide part */
    float x[N];
    for (int i = 0; i < N; i++) {
        tq_uniform();
        uint32_t bits = i < NS ? special[i] : (uint32_t)(tq_rng_state >> 32);
        if (i >= NS && i % 3 == 0) bits = (bits & ~0xffffu) | 0x8000u; /* a tie */
        memcpy(&x[i], &bits, 4);
    }
    uint16_t ref[N], got[N];
    for (int i = 0; i < N; i++) ref[i] = quant_f32_to_bf16(x[i]);
    for (int isa = 0; isa <= (int)best; isa++) {
        assert_true(quant_set_isa((quant_isa)isa));
        memset(got, 0, sizeof got);
        assert_int_equal(quant_quantize_row(DT_BF16, x, got, N), 0);
        assert_memory_equal(got, ref, sizeof ref);
    }
    quant_set_isa(best);
}

static void test_activation_formats(void **state) {
    (void)state;
    float x[256];
    for (int i = 0; i < 256; i++) x[i] = (float)(i - 100) * 0.01f;
    block_q8_0 q8[8];
    quant_quantize_row(DT_Q8_0, x, q8, 256);
    float d = quant_f16_to_f32(q8[0].d);
    assert_true(fabsf(d - 1.0f / 127) < 1e-5f); /* max |x| in block 0 = 1.00 */
    assert_int_equal(q8[0].qs[0], -127);
    block_q8_1 q81[8];
    quant_quantize_row(DT_Q8_1, x, q81, 256);
    int sum = 0;
    for (int j = 0; j < 32; j++) sum += q81[1].qs[j];
    float s_expected = (float)sum * quant_f16_to_f32(q81[1].d); /* s uses the unrounded d */
    assert_true(fabsf(quant_f16_to_f32(q81[1].s) - s_expected) <= 2e-3f * fabsf(s_expected));
    block_q8_K qk;
    quant_quantize_row(DT_Q8_K, x, &qk, 256);
    assert_true(qk.d < 0); /* largest element (1.55) is positive: d = -max/127 */
    assert_int_equal(qk.qs[255], -127);
    for (int k = 0; k < 16; k++) {
        int s = 0;
        for (int j = 0; j < 16; j++) s += qk.qs[16 * k + j];
        assert_int_equal(qk.bsums[k], s);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f16_scalars),   cmocka_unit_test(test_f16_row_matches_scalar),   cmocka_unit_test(test_layouts),
        cmocka_unit_test(test_roundtrip),     cmocka_unit_test(test_activation_formats),
        cmocka_unit_test(test_bf16_rounding_isa),
        cmocka_unit_test(test_dots),          cmocka_unit_test(test_dots_extreme),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
