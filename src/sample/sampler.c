/* sampler.c - repetition penalty, greedy and stochastic token selection.
 *
 * Design: penalties edit the caller's logits directly (cheap, and the
 * caller owns that row anyway). Greedy is a single scan. The stochastic path
 * works on a candidate list (id, logit) kept in the sampler between calls so
 * a 150k-entry vocabulary allocates once. Filters follow llama.cpp's default
 * chain - top_k, top_p, min_p, then temperature, then the draw - because the
 * order matters: top_p renormalises over what top_k kept, and min_p's
 * threshold is relative to the best token, which no earlier filter removes.
 *
 * The softmax terms exp(logit - max) of a draw are computed once, kept in
 * a scratch array and read again by the cumulative scan (top_p and the
 * draw): the same values in the same order, with half the exp() calls on a
 * 150k vocabulary.
 *
 * Ordering is total (logit descending, then id ascending) so results never
 * depend on qsort's instability. top_k uses a bounded min-heap (O(n log k))
 * rather than a full sort; a full sort happens only when top_p needs the
 * whole vocabulary in order.
 *
 * Presence/frequency penalties need a count per generated token id: an
 * open-addressing hash table (linear probing, power-of-two capacity kept at
 * most half full) from id to count, so memory follows the number of
 * distinct generated tokens, not the vocabulary. Applying walks its slots.
 *
 * Randomness: xoshiro256** (public-domain algorithm by Blackman and Vigna),
 * state seeded by four outputs of splitmix64 so any 64-bit seed, including
 * 0, gives a well-mixed state. Uniform doubles take the top 53 bits. */
#include "core/rng.h"
#include "sample/sampler.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

typedef struct candidate {
    int32_t id;
    float logit;
} candidate;

struct sampler {
    sampler_params params;
    uint64_t rng[4];
    /* Penalty history: a ring of the last penalty_last_n accepted ids. */
    int32_t *history;
    int32_t history_cap, history_len, history_next;
    int32_t *history_scratch;
    candidate *cands;
    double *weights; /* (cands_cap) each candidate's exp() term, computed once per draw */
    int cands_cap;
    /* Generated-token counts (presence/frequency penalties): slots with id -1 are empty. */
    int32_t *gen_id, *gen_count;
    int32_t gen_cap, gen_used;
};

/* ---- random numbers ---- */

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t xoshiro_next(uint64_t s[4]) {
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

static double uniform01(uint64_t s[4]) { return (double)(xoshiro_next(s) >> 11) * 0x1.0p-53; }

static void seed_rng(sampler *s) {
    uint64_t sm = s->params.seed;
    for (int i = 0; i < 4; i++) s->rng[i] = rng_splitmix64(&sm);
}

/* ---- lifetime ---- */

sampler_params sampler_default_params(void) {
    return (sampler_params){.temperature = 0.8f,
                            .top_k = 40,
                            .top_p = 0.95f,
                            .min_p = 0.05f,
                            .repeat_penalty = 1.0f,
                            .penalty_last_n = 64,
                            .seed = 0,
                            .presence_penalty = 0.0f,
                            .frequency_penalty = 0.0f};
}

sampler *sampler_create(const sampler_params *params) {
    sampler *s = calloc(1, sizeof *s);
    if (s == NULL) return NULL;
    s->params = params ? *params : sampler_default_params();
    if (s->params.penalty_last_n > 0) {
        s->history_cap = s->params.penalty_last_n;
        s->history = malloc((size_t)s->history_cap * sizeof *s->history);
        s->history_scratch = malloc((size_t)s->history_cap * sizeof *s->history_scratch);
        if (s->history == NULL || s->history_scratch == NULL) {
            sampler_free(s);
            return NULL;
        }
    }
    seed_rng(s);
    return s;
}

void sampler_free(sampler *s) {
    if (s == NULL) return;
    free(s->history);
    free(s->history_scratch);
    free(s->cands);
    free(s->weights);
    free(s->gen_id);
    free(s->gen_count);
    free(s);
}

void sampler_reset(sampler *s) {
    s->history_len = 0;
    s->history_next = 0;
    for (int32_t i = 0; i < s->gen_cap; i++) s->gen_id[i] = -1;
    s->gen_used = 0;
    seed_rng(s);
}

void sampler_accept(sampler *s, int32_t id) {
    if (s->history_cap == 0) return;
    s->history[s->history_next] = id;
    s->history_next = (s->history_next + 1) % s->history_cap;
    if (s->history_len < s->history_cap) s->history_len++;
}

static uint32_t slot_of(int32_t id, int32_t cap) {
    return ((uint32_t)id * 2654435761u) & (uint32_t)(cap - 1);
}

static void gen_insert(int32_t *ids, int32_t *counts, int32_t cap, int32_t id, int32_t add) {
    uint32_t i = slot_of(id, cap);
    while (ids[i] != -1 && ids[i] != id) i = (i + 1) & (uint32_t)(cap - 1);
    if (ids[i] == -1) {
        ids[i] = id;
        counts[i] = 0;
    }
    counts[i] += add;
}

void sampler_accept_generated(sampler *s, int32_t id) {
    sampler_accept(s, id);
    if (id < 0 || (s->params.presence_penalty == 0.0f && s->params.frequency_penalty == 0.0f)) return;
    if (2 * (s->gen_used + 1) > s->gen_cap) {
        int32_t cap = s->gen_cap ? 2 * s->gen_cap : 64;
        int32_t *ids = malloc((size_t)cap * sizeof *ids), *counts = malloc((size_t)cap * sizeof *counts);
        if (ids == NULL || counts == NULL) { /* degrade: the token goes uncounted */
            free(ids);
            free(counts);
            return;
        }
        for (int32_t i = 0; i < cap; i++) ids[i] = -1;
        for (int32_t i = 0; i < s->gen_cap; i++)
            if (s->gen_id[i] != -1) gen_insert(ids, counts, cap, s->gen_id[i], s->gen_count[i]);
        free(s->gen_id);
        free(s->gen_count);
        s->gen_id = ids;
        s->gen_count = counts;
        s->gen_cap = cap;
    }
    uint32_t i = slot_of(id, s->gen_cap);
    while (s->gen_id[i] != -1 && s->gen_id[i] != id) i = (i + 1) & (uint32_t)(s->gen_cap - 1);
    if (s->gen_id[i] == -1) s->gen_used++;
    gen_insert(s->gen_id, s->gen_count, s->gen_cap, id, 1);
}

/* ---- penalties ---- */

/* OpenAI: logit[t] -= c(t) * frequency_penalty + (c(t) > 0) * presence_penalty. */
static void apply_openai_penalties(sampler *s, float *logits, int n_vocab) {
    const float pp = s->params.presence_penalty, fp = s->params.frequency_penalty;
    if ((pp == 0.0f && fp == 0.0f) || s->gen_used == 0) return;
    for (int32_t i = 0; i < s->gen_cap; i++) {
        int32_t id = s->gen_id[i];
        if (id < 0 || id >= n_vocab) continue;
        logits[id] -= (float)s->gen_count[i] * fp + pp;
    }
}

static int cmp_int32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static void apply_repeat_penalty(sampler *s, float *logits, int n_vocab) {
    float penalty = s->params.repeat_penalty;
    if (penalty == 1.0f || s->history_len == 0) return;
    /* Each distinct token is penalised once, however often it repeats. */
    memcpy(s->history_scratch, s->history, (size_t)s->history_len * sizeof *s->history);
    qsort(s->history_scratch, (size_t)s->history_len, sizeof *s->history_scratch, cmp_int32);
    for (int32_t i = 0; i < s->history_len; i++) {
        int32_t id = s->history_scratch[i];
        if (i > 0 && id == s->history_scratch[i - 1]) continue;
        if (id < 0 || id >= n_vocab) continue;
        if (logits[id] <= 0.0f) logits[id] *= penalty;
        else logits[id] /= penalty;
    }
}

/* ---- selection ---- */

static float clean(float logit) { return isnan(logit) ? -INFINITY : logit; }

/* True when a ranks before b: higher logit, or equal logit and lower id. */
static bool ranks_before(const candidate *a, const candidate *b) {
    return a->logit > b->logit || (a->logit == b->logit && a->id < b->id);
}

static int cmp_rank(const void *a, const void *b) {
    const candidate *x = a, *y = b;
    if (ranks_before(x, y)) return -1;
    if (ranks_before(y, x)) return 1;
    return 0;
}

static int32_t argmax(const float *logits, int n_vocab) {
    int32_t best = 0;
    float best_logit = clean(logits[0]);
    for (int i = 1; i < n_vocab; i++) {
        float l = clean(logits[i]);
        if (l > best_logit) { /* strict: the earlier (lower) id keeps ties */
            best_logit = l;
            best = i;
        }
    }
    return best;
}

/* Min-heap on rank: the root is the worst of the kept candidates. */
static void heap_sift_down(candidate *h, int n, int i) {
    for (;;) {
        int worst = i, l = 2 * i + 1, r = l + 1;
        if (l < n && ranks_before(&h[worst], &h[l])) worst = l;
        if (r < n && ranks_before(&h[worst], &h[r])) worst = r;
        if (worst == i) return;
        candidate t = h[i];
        h[i] = h[worst];
        h[worst] = t;
        i = worst;
    }
}

/* Leaves the k best of cands[0..n) sorted at the front; returns k. */
static int keep_top_k(candidate *cands, int n, int k) {
    for (int i = k / 2 - 1; i >= 0; i--) heap_sift_down(cands, k, i);
    for (int i = k; i < n; i++) {
        if (ranks_before(&cands[i], &cands[0])) {
            cands[0] = cands[i];
            heap_sift_down(cands, k, 0);
        }
    }
    qsort(cands, (size_t)k, sizeof *cands, cmp_rank);
    return k;
}

/* Keeps the shortest best-first prefix whose probability mass reaches p.
 * w: scratch for the n exp() terms, computed once for both scans. */
static int keep_top_p(candidate *cands, int n, float p, double *w) {
    double max = cands[0].logit, sum = 0;
    for (int i = 0; i < n; i++) {
        w[i] = exp((double)cands[i].logit - max);
        sum += w[i];
    }
    double cum = 0;
    for (int i = 0; i < n; i++) {
        cum += w[i] / sum;
        if (cum >= p) return i + 1;
    }
    return n;
}

/* Keeps tokens whose probability is at least min_p times the best one's,
 * i.e. logit >= max_logit + log(min_p). Preserves order. */
static int keep_min_p(candidate *cands, int n, float min_p) {
    float max = cands[0].logit;
    for (int i = 1; i < n; i++)
        if (cands[i].logit > max) max = cands[i].logit;
    float threshold = max + logf(min_p);
    int kept = 0;
    for (int i = 0; i < n; i++)
        if (cands[i].logit >= threshold) cands[kept++] = cands[i];
    return kept > 0 ? kept : 1;
}

int32_t sampler_sample(sampler *s, float *logits, int n_vocab) {
    if (n_vocab < 1) return -1;
    apply_repeat_penalty(s, logits, n_vocab);
    apply_openai_penalties(s, logits, n_vocab);
    const sampler_params *p = &s->params;
    if (!(p->temperature > 0.0f)) return argmax(logits, n_vocab);

    if (s->cands_cap < n_vocab) {
        candidate *grown = realloc(s->cands, (size_t)n_vocab * sizeof *grown);
        if (grown == NULL) return argmax(logits, n_vocab); /* degrade, never fail */
        s->cands = grown;
        double *w = realloc(s->weights, (size_t)n_vocab * sizeof *w);
        if (w == NULL) return argmax(logits, n_vocab);
        s->weights = w;
        s->cands_cap = n_vocab;
    }
    double *w = s->weights;
    candidate *c = s->cands;
    for (int i = 0; i < n_vocab; i++) c[i] = (candidate){i, clean(logits[i])};
    int n = n_vocab;
    bool sorted = false;
    if (p->top_k > 0 && p->top_k < n) {
        n = keep_top_k(c, n, p->top_k);
        sorted = true;
    }
    if (p->top_p < 1.0f) {
        if (!sorted) qsort(c, (size_t)n, sizeof *c, cmp_rank);
        n = keep_top_p(c, n, p->top_p, w);
    }
    if (p->min_p > 0.0f) n = keep_min_p(c, n, p->min_p);

    /* Softmax at the temperature, then invert the cumulative distribution.
     * Candidates are either rank-sorted or in id order: deterministic. */
    double max = c[0].logit;
    for (int i = 1; i < n; i++)
        if (c[i].logit > max) max = c[i].logit;
    if (isinf(max)) return argmax(logits, n_vocab); /* all -inf, or some +inf: no distribution */
    double inv_t = 1.0 / (double)p->temperature, sum = 0;
    for (int i = 0; i < n; i++) {
        w[i] = exp(((double)c[i].logit - max) * inv_t);
        sum += w[i];
    }
    double r = uniform01(s->rng) * sum, cum = 0;
    for (int i = 0; i < n; i++) {
        cum += w[i];
        if (r < cum) return c[i].id;
    }
    return c[n - 1].id;
}
