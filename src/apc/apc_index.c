/* apc_index.c - the block tier's key -> block table (see apc_internal.h).
 *
 * Open addressing with linear probing over block ids; a slot's home is the
 * low bits of the key's first 8 bytes (keys are uniformly distributed, being
 * cryptographic or XXH3 digests). The table has at least twice as many slots
 * as the pool has blocks, and a block is indexed at most once, so it is never
 * more than half full. Deletion shifts later entries of the probe run back
 * (no tombstones), so a lookup stops at the first empty slot.
 *
 * The index is the one place every block tier change passes through (a
 * store, a block loaded from disk, an LRU eviction, a reset), so the block
 * listener (apc_set_block_listener: KV events) is called from here and sees
 * each change exactly once. */
#include <stdlib.h>
#include <string.h>

#include "apc/apc_internal.h"

static void tell(const apc_index *ix, apc_block_change change, const apc_block_meta *m) {
    if (ix->listener == NULL) return;
    apc_block_event ev;
    memset(&ev, 0, sizeof ev);
    ev.change = change;
    if (m) {
        memcpy(ev.key, m->key.b, sizeof ev.key);
        memcpy(ev.parent, m->parent.b, sizeof ev.parent);
        ev.salt = m->salt;
        ev.tokens = m->tokens;
        ev.n_rows = m->n_rows;
    }
    ix->listener(ix->listener_user, &ev);
}

static uint32_t home_of(const apc_index *ix, const apc_key *k) {
    uint64_t h;
    memcpy(&h, k->b, sizeof h);
    return (uint32_t)(h & ix->mask);
}

int apc_index_init(apc_index *ix, int32_t n_blocks) {
    memset(ix, 0, sizeof *ix);
    uint32_t cap = 16;
    while (cap < 2u * (uint32_t)n_blocks) cap *= 2;
    ix->n_blocks = n_blocks;
    ix->mask = cap - 1;
    ix->meta = calloc((size_t)n_blocks, sizeof *ix->meta);
    ix->slots = malloc((size_t)cap * sizeof *ix->slots);
    if (ix->meta == NULL || ix->slots == NULL) {
        apc_index_free(ix);
        return -1;
    }
    memset(ix->slots, 0xff, (size_t)cap * sizeof *ix->slots);
    return 0;
}

void apc_index_free(apc_index *ix) {
    free(ix->meta);
    free(ix->slots);
    memset(ix, 0, sizeof *ix);
}

int32_t apc_index_find(const apc_index *ix, const apc_key *key) {
    for (uint32_t i = home_of(ix, key);; i = (i + 1) & ix->mask) {
        int32_t b = ix->slots[i];
        if (b < 0) return -1;
        if (apc_key_eq(&ix->meta[b].key, key)) return b;
    }
}

void apc_index_insert(apc_index *ix, int32_t block, const apc_key *key, const apc_key *parent, uint64_t salt,
                      const int32_t *tokens, int n_rows) {
    apc_block_meta *m = &ix->meta[block];
    m->key = *key;
    m->parent = *parent;
    m->salt = salt;
    memset(m->tokens, 0, sizeof m->tokens);
    memcpy(m->tokens, tokens, (size_t)n_rows * sizeof(int32_t));
    m->n_rows = n_rows;
    m->indexed = true;
    uint32_t i = home_of(ix, key);
    while (ix->slots[i] >= 0) i = (i + 1) & ix->mask;
    ix->slots[i] = block;
    ix->n_indexed++;
    tell(ix, APC_BLOCK_STORED, m);
}

void apc_index_remove(apc_index *ix, int32_t block) {
    apc_block_meta *m = &ix->meta[block];
    if (!m->indexed) return;
    tell(ix, APC_BLOCK_REMOVED, m);
    uint32_t i = home_of(ix, &m->key);
    while (ix->slots[i] != block) i = (i + 1) & ix->mask;
    ix->slots[i] = -1;
    /* Shift back every later member of the run that may live at i. */
    for (uint32_t j = (i + 1) & ix->mask; ix->slots[j] >= 0; j = (j + 1) & ix->mask) {
        uint32_t h = home_of(ix, &ix->meta[ix->slots[j]].key);
        /* The entry at j may move to i iff its home is not in (i, j] cyclically. */
        bool home_in_gap = i <= j ? (h > i && h <= j) : (h > i || h <= j);
        if (!home_in_gap) {
            ix->slots[i] = ix->slots[j];
            ix->slots[j] = -1;
            i = j;
        }
    }
    m->indexed = false;
    ix->n_indexed--;
}

void apc_index_clear(apc_index *ix) {
    memset(ix->slots, 0xff, ((size_t)ix->mask + 1) * sizeof *ix->slots);
    for (int32_t b = 0; b < ix->n_blocks; b++) ix->meta[b].indexed = false;
    ix->n_indexed = 0;
    tell(ix, APC_BLOCKS_CLEARED, NULL);
}
