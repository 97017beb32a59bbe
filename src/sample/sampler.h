/* sampler.h - choosing the next token from a row of logits.
 *
 * Contract: a sampler owns its settings, a seeded random generator and the
 * history of accepted tokens. sampler_sample applies, in llama.cpp's order,
 * the repetition penalty (over the last penalty_last_n accepted tokens, each
 * distinct token once: positive logits divided by the penalty, negative ones
 * multiplied), then the presence/frequency penalties (below), then either
 * greedy argmax (temperature <= 0; the lowest id
 * wins ties) or top_k -> top_p -> min_p -> temperature -> a random draw.
 * The logits row is modified in place (penalties). The same seed, settings
 * and sequence of calls give the same tokens on every machine: the generator
 * is ember's own (xoshiro256** seeded through splitmix64), not libc's.
 * sampler_sample does not record the token; call sampler_accept for tokens
 * that become part of the context (prompt tokens too, if they should count
 * for the penalty).
 *
 * OpenAI's presence and frequency penalties apply over the GENERATED tokens
 * only, recorded with sampler_accept_generated (which also feeds the
 * repetition history): before selection, every token t generated c(t) > 0
 * times gets logit[t] -= c(t) * frequency_penalty + presence_penalty.
 * Both default to 0 (off); negative values favour repetition. */
#ifndef EMBER_SAMPLE_SAMPLER_H
#define EMBER_SAMPLE_SAMPLER_H

#include <stdint.h>

typedef struct sampler_params {
    float temperature;      /* <= 0: greedy */
    int32_t top_k;          /* <= 0 or >= n_vocab: off */
    float top_p;            /* >= 1: off */
    float min_p;            /* <= 0: off; keep p >= min_p * p_max */
    float repeat_penalty;   /* 1: off */
    int32_t penalty_last_n; /* <= 0: off */
    uint64_t seed;
    float presence_penalty;  /* 0: off; OpenAI range [-2, 2] */
    float frequency_penalty; /* 0: off; OpenAI range [-2, 2] */
} sampler_params;

typedef struct sampler sampler;

/* llama.cpp's defaults: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05,
 * repeat_penalty 1.0 (off), penalty_last_n 64; seed 0. */
sampler_params sampler_default_params(void);

/* NULL params means the defaults. Returns NULL when out of memory. */
sampler *sampler_create(const sampler_params *params);
void sampler_free(sampler *s);

/* Picks a token id in [0, n_vocab); -1 when n_vocab < 1. NaN logits count
 * as -infinity. */
int32_t sampler_sample(sampler *s, float *logits, int n_vocab);

/* Records a token in the penalty history. */
void sampler_accept(sampler *s, int32_t id);

/* Records a generated token: the penalty history, and the counts that the
 * presence and frequency penalties apply to. */
void sampler_accept_generated(sampler *s, int32_t id);

/* Forgets the history and the generated counts, restarts the generator
 * from the seed. */
void sampler_reset(sampler *s);

#endif
