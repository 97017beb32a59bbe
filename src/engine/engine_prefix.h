/* engine_prefix.h - the prefix layer (L0) of speculating engines.
 *
 * Contract (the design, and how L0 and the prompt cache's pools divide the
 * work, is the comment at the top of engine_prefix.c):
 *  - An in-memory LRU of post-prefill snapshots of speculative requests,
 *    keyed by (salt, the request's full prompt ids). An entry holds what a
 *    later request needs to resume at the end of that prompt and that the
 *    pools do not keep: the target's K/V rows (copies, as the pool encodes
 *    them), the recurrent state at n (and at n-1), and the drafter's own
 *    rows (an MTP head's K/V and the target's hidden rows it read: opaque
 *    here, spec_export / spec_import).
 *  - Lookup: the longest entry of the request's salt whose key is a strict
 *    prefix of the prompt (adopting the key's n tokens, state at n), or the
 *    whole prompt (an identical resend adopts n-1: the K/V rows cut there,
 *    the state at n-1); at least min_tokens, at most N-1 adopted.
 *  - Store: skipped (logged, counted) when one entry would exceed the byte
 *    budget; an entry with the same key is replaced; the least recently
 *    used entries go until the count and the bytes fit.
 *  - Works whatever the prompt cache's configuration (also cache.enabled
 *    false): rows are restored into blocks the request allocates through
 *    apc_seq_prepare_append, so the pool's accounting is unchanged.
 *  - Thread-safe (one mutex); restores never alias an entry's memory.
 *
 * The API, grouped by purpose, is at the end of this file. */
#ifndef EMBER_ENGINE_PREFIX_H
#define EMBER_ENGINE_PREFIX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "apc/apc.h"
#include "core/error.h"
#include "kv/kv_pool.h"
#include "model/model.h"

typedef struct prefix_config {
    int entries;        /* most entries; < 1: the layer is off */
    size_t max_bytes;   /* byte budget of every entry together */
    int min_tokens;     /* shortest prefix adopted (reference: 32) */
    size_t drafter_words; /* 32-bit words of drafter state a position (spec_state_words); 0: none */
} prefix_config;

typedef struct prefix_stats {
    uint64_t hits;        /* spec_prefix_hits */
    uint64_t hit_tokens;  /* spec_prefix_hit_tokens */
    uint64_t stores;      /* spec_prefix_stores */
    uint64_t skips;       /* stores skipped: one entry larger than the budget */
    uint64_t evictions;   /* entries dropped for room */
    int entries;
    size_t bytes;
    int max_entries;
    size_t max_bytes;
} prefix_stats;

/* What a hit restored beside the K/V rows and the state. */
typedef struct prefix_hit {
    int64_t n_tokens;     /* adopted: seq->n_tokens; 0: miss */
    uint32_t *drafter;    /* (n_tokens, drafter_words) the drafter's rows, malloc'd, or NULL */
} prefix_hit;

typedef struct prefix_layer prefix_layer;

/* ---- Lifetime ---- */
/* m: the target (its state size); pool: the target's K/V pool,
 * whose row encoding the entries copy; cache: the prompt cache through
 * which restored rows are allocated. All outlive the layer. NULL with err
 * set when out of memory; a config with entries < 1 gives a layer that
 * stores nothing. */
prefix_layer *prefix_layer_create(const prefix_config *cfg, const model *m, kv_pool *pool, apc *cache,
                                  ember_error *err);
void prefix_layer_free(prefix_layer *l);
bool prefix_layer_on(const prefix_layer *l);

/* ---- Lookup ---- */
/* How many tokens a lookup of tokens[0, n) under salt would adopt now
 * (0: none); touches no counter or LRU order. */
int64_t prefix_peek(prefix_layer *l, const int32_t *tokens, int64_t n, uint64_t salt);
/* Restores the best entry into the empty seq and state (NULL for models
 * without recurrent layers). A pool that cannot give the blocks is a miss. */
prefix_hit prefix_lookup(prefix_layer *l, const int32_t *tokens, int64_t n, uint64_t salt, kv_seq *seq,
                         model_state *state);

/* ---- Store ---- */
/* The post-prefill snapshot of tokens[0, n): seq holds their K/V, state_n
 * is the state snapshot at n and state_n1 at n-1 (NULL: none; both NULL
 * for models without recurrent layers), drafter the drafter's rows of
 * [0, n) (drafter_words a position; NULL: none). Copies everything. */
void prefix_store(prefix_layer *l, const int32_t *tokens, int64_t n, uint64_t salt, const kv_seq *seq,
                  const void *state_n, const void *state_n1, const uint32_t *drafter);

/* ---- Stats and reset ---- */
prefix_stats prefix_get_stats(prefix_layer *l);
void prefix_clear(prefix_layer *l); /* drops every entry; the counters stay */

#endif
