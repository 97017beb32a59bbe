/* rng.h - the one seed mixer ember uses everywhere it needs reproducible
 * randomness (model generation, sampling): SplitMix64, which turns any
 * 64-bit counter into well-spread 64-bit outputs. */
#ifndef EMBER_CORE_RNG_H
#define EMBER_CORE_RNG_H

#include <stdint.h>

/* Advances *state and returns the next output. */
static inline uint64_t rng_splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

#endif
