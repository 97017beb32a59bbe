/* cache_stack.h - what kind of per-sequence state each layer keeps.
 *
 * Contract: every model describes its layers with one cache_layer each, in
 * layer order. The prompt cache routes on this descriptor alone (design.md
 * §4) and never looks at architecture names:
 *   KV    paged K/V that grows with the sequence; can be cut at any block;
 *   ROT   sliding-window K/V (window, sink `keep`); cut only while intact;
 *   ARR   fixed-size recurrent state (conv + SSM / gated-delta); snapshot only;
 *   LIST  several of the above inside one layer (attention + mamba);
 *   OTHER state no tier can split (e.g. a sparse-attention indexer). */
#ifndef EMBER_MODEL_CACHE_STACK_H
#define EMBER_MODEL_CACHE_STACK_H

typedef enum cache_kind {
    CACHE_KIND_KV = 0,
    CACHE_KIND_ROT = 1,
    CACHE_KIND_ARR = 2,
    CACHE_KIND_LIST = 3,
    CACHE_KIND_OTHER = 4,
} cache_kind;

typedef struct cache_layer {
    cache_kind kind;
    int window;   /* ROT: sliding window in tokens; else 0 */
    int keep;     /* ROT: sink tokens always kept; else 0 */
} cache_layer;

static inline const char *cache_kind_name(cache_kind k) {
    static const char *names[] = {"kv", "rot", "arr", "list", "other"};
    return (unsigned)k <= CACHE_KIND_OTHER ? names[k] : "?";
}

#endif
