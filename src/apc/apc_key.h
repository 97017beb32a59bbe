/* apc_key.h - content keys of the block tier (internal to src/apc).
 *
 * A block key is 128 bits: the first 16 bytes of SHA-256, or XXH3-128, over
 * the 88-byte message (parent key 16 bytes, salt u64 little-endian, the
 * block's 16 token ids as int32 little-endian). The first block's parent is
 * the all-zero key. A partial block (m < 16 rows, the tail of a stored
 * sequence) has its own key over (parent, salt, u32 0x80000000 | m, its m
 * tokens): the marker can never be a token id, so a partial key never equals
 * a full one. Keys are content addresses: the same tokens under the
 * same salt give the same key in every process. */
#ifndef EMBER_APC_KEY_H
#define EMBER_APC_KEY_H

#include <stdbool.h>
#include <stdint.h>

#include "apc/apc.h"

typedef struct apc_key {
    uint8_t b[16];
} apc_key;

static inline bool apc_key_eq(const apc_key *a, const apc_key *b) {
    const uint64_t *x = (const uint64_t *)(const void *)a->b, *y = (const uint64_t *)(const void *)b->b;
    return x[0] == y[0] && x[1] == y[1];
}

/* The key of one block from its parent's key. */
apc_key apc_block_key(apc_hash_kind kind, const apc_key *parent, uint64_t salt, const int32_t *tokens16);

/* The key of the first m (1..15) rows of a block. */
apc_key apc_partial_key(apc_hash_kind kind, const apc_key *parent, uint64_t salt, const int32_t *tokens, int m);

/* keys[i] for blocks 0..n_blocks-1 of tokens (chained from the zero key). */
void apc_chain_keys(apc_hash_kind kind, const int32_t *tokens, int64_t n_blocks, uint64_t salt, apc_key *keys);

/* ---- Little-endian fields (keys, disk files and remote values share them) ---- */
static inline void apc_put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void apc_put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint32_t apc_get_u32(const uint8_t *p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static inline uint64_t apc_get_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

#endif
