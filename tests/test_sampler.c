/* test_sampler.c - token selection: greedy, filters, penalties, seeding and
 * the shape of the sampled distribution. Every test is deterministic: the
 * sampler's generator is seeded, and random logits come from a local
 * splitmix64 so results do not depend on libc's rand(). */
#include "test_util.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "sample/sampler.h"

static uint64_t mix(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void random_logits(float *logits, int n, uint64_t seed) {
    for (int i = 0; i < n; i++) logits[i] = (float)((double)(mix(&seed) >> 11) * 0x1.0p-53 * 8.0 - 4.0);
}

static int32_t reference_argmax(const float *logits, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}

static sampler_params plain(float temperature, uint64_t seed) {
    sampler_params p = {.temperature = temperature, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f,
                        .repeat_penalty = 1.0f, .penalty_last_n = 0, .seed = seed};
    return p;
}

static void test_greedy_is_argmax(void **state) {
    (void)state;
    sampler_params p = plain(0.0f, 1);
    sampler *s = sampler_create(&p);
    assert_non_null(s);
    float logits[1000];
    for (uint64_t trial = 0; trial < 50; trial++) {
        random_logits(logits, 1000, trial);
        assert_int_equal(sampler_sample(s, logits, 1000), reference_argmax(logits, 1000));
    }
    /* Ties go to the lowest id; NaN never wins. */
    float tied[5] = {1.0f, 3.0f, NAN, 3.0f, 2.0f};
    assert_int_equal(sampler_sample(s, tied, 5), 1);
    float nan_first[3] = {NAN, -5.0f, -7.0f};
    assert_int_equal(sampler_sample(s, nan_first, 3), 1);
    assert_int_equal(sampler_sample(s, tied, 0), -1);
    sampler_free(s);
}

static void test_seeded_reproducibility(void **state) {
    (void)state;
    float base[300], logits[300];
    random_logits(base, 300, 77);
    sampler_params p = sampler_default_params();
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.temperature = 1.5f;
    p.seed = 1234;
    sampler *a = sampler_create(&p), *b = sampler_create(&p);
    p.seed = 1235;
    sampler *c = sampler_create(&p);
    int32_t first[200];
    int differs = 0;
    for (int i = 0; i < 200; i++) {
        memcpy(logits, base, sizeof base);
        int32_t ta = sampler_sample(a, logits, 300);
        memcpy(logits, base, sizeof base);
        int32_t tb = sampler_sample(b, logits, 300);
        memcpy(logits, base, sizeof base);
        int32_t tc = sampler_sample(c, logits, 300);
        assert_int_equal(ta, tb);
        assert_true(ta >= 0 && ta < 300);
        differs += ta != tc;
        first[i] = ta;
    }
    assert_true(differs > 100);
    /* Reset restarts the generator: the same sequence again. */
    sampler_reset(a);
    for (int i = 0; i < 200; i++) {
        memcpy(logits, base, sizeof base);
        assert_int_equal(sampler_sample(a, logits, 300), first[i]);
    }
    sampler_free(a);
    sampler_free(b);
    sampler_free(c);
}

static void test_top_k_one_is_greedy(void **state) {
    (void)state;
    float logits[500];
    for (uint64_t trial = 0; trial < 100; trial++) {
        sampler_params p = plain(1.0f, trial);
        p.top_k = 1;
        sampler *s = sampler_create(&p);
        random_logits(logits, 500, trial + 1000);
        int32_t expect = reference_argmax(logits, 500);
        assert_int_equal(sampler_sample(s, logits, 500), expect);
        sampler_free(s);
    }
}

static void test_top_p_tiny_is_greedy(void **state) {
    (void)state;
    float logits[500];
    for (uint64_t trial = 0; trial < 100; trial++) {
        sampler_params p = plain(2.0f, trial);
        p.top_p = 1e-6f;
        sampler *s = sampler_create(&p);
        random_logits(logits, 500, trial + 2000);
        int32_t expect = reference_argmax(logits, 500);
        assert_int_equal(sampler_sample(s, logits, 500), expect);
        sampler_free(s);
    }
}

/* Counts how often each of n tokens is drawn over `draws` samples. */
static void histogram(sampler *s, const float *base, int n, int draws, int *counts) {
    float logits[16];
    memset(counts, 0, (size_t)n * sizeof *counts);
    for (int i = 0; i < draws; i++) {
        memcpy(logits, base, (size_t)n * sizeof *logits);
        int32_t t = sampler_sample(s, logits, n);
        assert_true(t >= 0 && t < n);
        counts[t]++;
    }
}

static void test_min_p_filters(void **state) {
    (void)state;
    /* p = 0.5, 0.3, 0.15, 0.05; min_p 0.2 keeps p >= 0.1: tokens 0..2. */
    float base[4] = {logf(0.5f), logf(0.3f), logf(0.15f), logf(0.05f)};
    sampler_params p = plain(1.0f, 9);
    p.min_p = 0.2f;
    sampler *s = sampler_create(&p);
    int counts[4];
    histogram(s, base, 4, 4000, counts);
    assert_int_equal(counts[3], 0);
    for (int i = 0; i < 3; i++) assert_true(counts[i] > 100);
    sampler_free(s);
    /* min_p 0.7 keeps only p >= 0.35: token 0. */
    p.min_p = 0.7f;
    s = sampler_create(&p);
    histogram(s, base, 4, 500, counts);
    assert_int_equal(counts[0], 500);
    sampler_free(s);
}

static void test_top_k_and_top_p_limit_support(void **state) {
    (void)state;
    float base[6] = {3.0f, 2.5f, 2.0f, 1.0f, 0.5f, 0.0f};
    sampler_params p = plain(1.0f, 5);
    p.top_k = 2;
    sampler *s = sampler_create(&p);
    int counts[6];
    histogram(s, base, 6, 3000, counts);
    assert_true(counts[0] > 0 && counts[1] > 0);
    for (int i = 2; i < 6; i++) assert_int_equal(counts[i], 0);
    sampler_free(s);
    /* Softmax masses: 0.4718, 0.2862, 0.1736, ...; top_p 0.7 needs the first two. */
    p = plain(1.0f, 6);
    p.top_p = 0.7f;
    s = sampler_create(&p);
    histogram(s, base, 6, 3000, counts);
    assert_true(counts[0] > 0 && counts[1] > 0);
    for (int i = 2; i < 6; i++) assert_int_equal(counts[i], 0);
    sampler_free(s);
}

static void test_repetition_penalty(void **state) {
    (void)state;
    sampler_params p = plain(0.0f, 1);
    p.repeat_penalty = 1.5f;
    p.penalty_last_n = 3;
    sampler *s = sampler_create(&p);
    /* Positive logit divided: 2.0 -> 1.333 falls below 1.9. */
    float pos[3] = {2.0f, 1.9f, -1.0f};
    sampler_accept(s, 0);
    sampler_accept(s, 0); /* repeated tokens are penalised once */
    assert_int_equal(sampler_sample(s, pos, 3), 1);
    assert_true(fabsf(pos[0] - 2.0f / 1.5f) < 1e-6f);
    /* Negative logit multiplied: -1.0 -> -1.5 falls below -1.2. */
    float neg[3] = {-1.0f, -1.2f, -3.0f};
    assert_int_equal(sampler_sample(s, neg, 3), 1);
    assert_true(fabsf(neg[0] + 1.5f) < 1e-6f);
    /* Out-of-range ids in the history are ignored. */
    sampler_accept(s, 99);
    float big[3] = {2.0f, 1.9f, 0.0f};
    assert_int_equal(sampler_sample(s, big, 3), 1);
    /* The window is the last 3 accepted tokens: push token 0 out. */
    sampler_accept(s, 2);
    sampler_accept(s, 2);
    float again[3] = {2.0f, 1.9f, 0.5f};
    assert_int_equal(sampler_sample(s, again, 3), 0);
    assert_true(again[2] == 0.5f / 1.5f);
    /* Reset forgets the history. */
    sampler_accept(s, 0);
    sampler_reset(s);
    float fresh[3] = {2.0f, 1.9f, 0.5f};
    assert_int_equal(sampler_sample(s, fresh, 3), 0);
    assert_true(fresh[0] == 2.0f);
    sampler_free(s);

    /* Penalty 1 or window 0 changes nothing. */
    p.repeat_penalty = 1.0f;
    s = sampler_create(&p);
    sampler_accept(s, 0);
    float same[2] = {2.0f, 1.9f};
    assert_int_equal(sampler_sample(s, same, 2), 0);
    sampler_free(s);
}

/* Pearson chi-square of observed counts against expected probabilities. */
static double chi_square(const int *counts, const double *probs, int n, int draws) {
    double chi = 0;
    for (int i = 0; i < n; i++) {
        double e = probs[i] * draws;
        chi += (counts[i] - e) * (counts[i] - e) / e;
    }
    return chi;
}

/* OpenAI presence/frequency penalties: generated tokens only, exact
 * arithmetic (powers of two), greedy affected, negative values, reset,
 * many distinct tokens (the count table grows). */
static void test_presence_frequency_penalties(void **state) {
    (void)state;
    sampler_params p = plain(0.0f, 1);
    p.frequency_penalty = 0.125f;
    sampler *s = sampler_create(&p);
    for (int i = 0; i < 10; i++) sampler_accept(s, 0); /* prompt tokens: not counted */
    float row[4] = {1.0f, 0.75f, 0.5f, -1.0f};
    float l[4];
    memcpy(l, row, sizeof l);
    assert_int_equal(sampler_sample(s, l, 4), 0);
    assert_true(l[0] == 1.0f);
    sampler_accept_generated(s, 0);
    memcpy(l, row, sizeof l);
    assert_int_equal(sampler_sample(s, l, 4), 0);
    assert_true(l[0] == 0.875f && l[1] == 0.75f);
    sampler_accept_generated(s, 0);
    sampler_accept_generated(s, 0);
    memcpy(l, row, sizeof l);
    assert_int_equal(sampler_sample(s, l, 4), 1); /* 1 - 3/8 = 0.625 < 0.75 */
    assert_true(l[0] == 0.625f);
    sampler_reset(s);
    memcpy(l, row, sizeof l);
    assert_int_equal(sampler_sample(s, l, 4), 0);
    assert_true(l[0] == 1.0f);
    sampler_free(s);

    /* presence: once, however often the token came */
    p = plain(0.0f, 1);
    p.presence_penalty = 0.5f;
    s = sampler_create(&p);
    for (int i = 0; i < 5; i++) sampler_accept_generated(s, 0);
    sampler_accept_generated(s, 2);
    memcpy(l, row, sizeof l);
    assert_int_equal(sampler_sample(s, l, 4), 1);
    assert_true(l[0] == 0.5f && l[1] == 0.75f && l[2] == 0.0f && l[3] == -1.0f);
    sampler_free(s);

    /* both, and negative values pull a token up */
    p = plain(0.0f, 1);
    p.presence_penalty = -1.0f;
    p.frequency_penalty = -0.25f;
    s = sampler_create(&p);
    sampler_accept_generated(s, 3);
    sampler_accept_generated(s, 3);
    memcpy(l, row, sizeof l);
    assert_int_equal(sampler_sample(s, l, 4), 0);
    assert_true(l[3] == 0.5f); /* -1 + 2 * 0.25 + 1 */
    sampler_accept_generated(s, 3);
    sampler_accept_generated(s, 3);
    memcpy(l, row, sizeof l);
    assert_int_equal(sampler_sample(s, l, 4), 0); /* -1 + 4 * 0.25 + 1 = 1.0 ties token 0: the lower id wins */
    assert_true(l[3] == 1.0f);
    sampler_accept_generated(s, 3);
    memcpy(l, row, sizeof l);
    assert_int_equal(sampler_sample(s, l, 4), 3);
    sampler_free(s);

    /* defaults are off; many distinct tokens, each counted */
    assert_true(sampler_default_params().presence_penalty == 0.0f);
    assert_true(sampler_default_params().frequency_penalty == 0.0f);
    enum { V = 5000 };
    p = plain(0.0f, 1);
    p.frequency_penalty = 1.0f;
    s = sampler_create(&p);
    for (int t = 0; t < V; t += 2) sampler_accept_generated(s, t);
    for (int t = 0; t < V; t += 4) sampler_accept_generated(s, t);
    float *big = malloc(V * sizeof *big);
    for (int t = 0; t < V; t++) big[t] = 0.0f;
    sampler_sample(s, big, V);
    for (int t = 0; t < V; t++) assert_true(big[t] == (t % 4 == 0 ? -2.0f : t % 2 == 0 ? -1.0f : 0.0f));
    free(big);
    sampler_free(s);
}

static void test_distribution(void **state) {
    (void)state;
    /* 3 degrees of freedom: P(chi2 > 16.27) = 0.001. */
    const double probs[4] = {0.1, 0.2, 0.3, 0.4};
    float base[4];
    for (int i = 0; i < 4; i++) base[i] = (float)log(probs[i]) + 7.0f; /* shift-invariant */
    sampler_params p = plain(1.0f, 42);
    sampler *s = sampler_create(&p);
    int counts[4];
    histogram(s, base, 4, 20000, counts);
    double chi = chi_square(counts, probs, 4, 20000);
    print_message("T=1 counts %d %d %d %d chi2 %.2f\n", counts[0], counts[1], counts[2], counts[3], chi);
    assert_true(chi < 16.27);
    sampler_free(s);

    /* Temperature 0.5 squares the probabilities before renormalising. */
    double sq[4], total = 0;
    for (int i = 0; i < 4; i++) total += sq[i] = probs[i] * probs[i];
    for (int i = 0; i < 4; i++) sq[i] /= total;
    p = plain(0.5f, 43);
    s = sampler_create(&p);
    histogram(s, base, 4, 20000, counts);
    chi = chi_square(counts, sq, 4, 20000);
    print_message("T=0.5 counts %d %d %d %d chi2 %.2f\n", counts[0], counts[1], counts[2], counts[3], chi);
    assert_true(chi < 16.27);
    sampler_free(s);
}

static void test_large_vocab_defaults(void **state) {
    (void)state;
    /* Default chain on a Qwen-sized vocabulary: always a valid id, and with
     * one dominant logit always that id. */
    enum { N = 151936 };
    float *logits = malloc(N * sizeof *logits);
    sampler *s = sampler_create(NULL);
    for (int trial = 0; trial < 20; trial++) {
        random_logits(logits, N, (uint64_t)trial);
        int32_t t = sampler_sample(s, logits, N);
        assert_true(t >= 0 && t < N);
        sampler_accept(s, t);
    }
    for (int i = 0; i < N; i++) logits[i] = 0.0f;
    logits[123456] = 50.0f;
    assert_int_equal(sampler_sample(s, logits, N), 123456);
    sampler_free(s);
    free(logits);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_is_argmax),
        cmocka_unit_test(test_seeded_reproducibility),
        cmocka_unit_test(test_top_k_one_is_greedy),
        cmocka_unit_test(test_top_p_tiny_is_greedy),
        cmocka_unit_test(test_min_p_filters),
        cmocka_unit_test(test_top_k_and_top_p_limit_support),
        cmocka_unit_test(test_repetition_penalty),
        cmocka_unit_test(test_presence_frequency_penalties),
        cmocka_unit_test(test_distribution),
        cmocka_unit_test(test_large_vocab_defaults),
    };
    return test_run_group(tests, NULL, NULL);
}
