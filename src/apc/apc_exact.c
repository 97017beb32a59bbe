/* apc_exact.c - the exact tier: whole-state snapshots in an LRU.
 *
 * For a dense stack the whole per-sequence state at length n is the K and V
 * rows of positions [0, n) of every layer. A snapshot stores them layer by
 * layer (K rows, then V rows), contiguous, so restoring is one pass of row
 * copies into fresh pool blocks. Matching is by comparing token ids and the
 * salt; the LRU is a doubly-linked list from newest to oldest, bounded by
 * entry count and by bytes. An entry that a restore is reading is pinned; if
 * it is dropped meanwhile (eviction, reset) it is unlisted and freed by the
 * last unpin. */
#include <stdlib.h>
#include <string.h>

#include "apc/apc_internal.h"

size_t apc_snapshot_bytes(const apc_layout *lay, int64_t n) {
    return (size_t)n * lay->row_floats * sizeof(float) + (size_t)n * sizeof(int32_t);
}

apc_exact_entry *apc_exact_entry_new(const apc_layout *lay, const int32_t *tokens, int64_t n, uint64_t salt) {
    apc_exact_entry *e = calloc(1, sizeof *e);
    if (e == NULL) return NULL;
    e->tokens = malloc((size_t)n * sizeof(int32_t));
    e->data = malloc((size_t)n * lay->row_floats * sizeof(float) + 1);
    if (e->tokens == NULL || e->data == NULL) {
        apc_exact_entry_free(e);
        return NULL;
    }
    memcpy(e->tokens, tokens, (size_t)n * sizeof(int32_t));
    e->n = n;
    e->salt = salt;
    e->bytes = apc_snapshot_bytes(lay, n);
    return e;
}

void apc_exact_entry_free(apc_exact_entry *e) {
    if (e == NULL) return;
    free(e->tokens);
    free(e->data);
    free(e->state);
    free(e);
}

/* Copies positions [0, n) between the blocks of seq and a snapshot (out:
 * blocks -> data), layer by layer, K rows then V rows. */
static void copy_rows(kv_pool *pool, const apc_layout *lay, const kv_seq *seq, int64_t n, float *data, bool out) {
    float *p = data;
    for (int l = 0; l < lay->n_layer; l++) {
        for (int kv = 0; kv < 2; kv++) {
            int w = kv == 0 ? lay->k_width[l] : lay->v_width[l];
            if (w == 0) continue;
            for (int64_t pos = 0; pos < n; pos += KV_BLOCK_TOKENS) {
                int64_t rows = n - pos < KV_BLOCK_TOKENS ? n - pos : KV_BLOCK_TOKENS;
                int32_t b = seq->blocks[pos / KV_BLOCK_TOKENS];
                float *blk = kv == 0 ? kv_block_k(pool, b, l) : kv_block_v(pool, b, l);
                size_t bytes = (size_t)rows * (size_t)w * sizeof(float);
                if (out) memcpy(p, blk, bytes);
                else memcpy(blk, p, bytes);
                p += (size_t)rows * (size_t)w;
            }
        }
    }
}

void apc_snapshot_copy_out(kv_pool *pool, const apc_layout *lay, const kv_seq *seq, int64_t n, float *data) {
    copy_rows(pool, lay, seq, n, data, true);
}

void apc_snapshot_copy_in(kv_pool *pool, const apc_layout *lay, const float *data, int64_t n, const kv_seq *seq) {
    copy_rows(pool, lay, seq, n, (float *)data, false);
}

static void unlink_entry(apc_exact *ex, apc_exact_entry *e) {
    if (e->newer) e->newer->older = e->older;
    else ex->newest = e->older;
    if (e->older) e->older->newer = e->newer;
    else ex->oldest = e->newer;
    e->newer = e->older = NULL;
    e->listed = false;
    ex->count--;
    ex->bytes -= e->bytes;
}

static void push_newest(apc_exact *ex, apc_exact_entry *e) {
    e->older = ex->newest;
    e->newer = NULL;
    if (ex->newest) ex->newest->newer = e;
    else ex->oldest = e;
    ex->newest = e;
    e->listed = true;
    ex->count++;
    ex->bytes += e->bytes;
}

static void drop_entry(apc_exact *ex, apc_exact_entry *e) {
    unlink_entry(ex, e);
    if (e->pins == 0) apc_exact_entry_free(e);
}

apc_exact_entry *apc_exact_find_prefix(apc_exact *ex, const int32_t *tokens, int64_t max_len, uint64_t salt) {
    apc_exact_entry *best = NULL;
    for (apc_exact_entry *e = ex->newest; e; e = e->older) {
        if (e->salt != salt || e->n < 1 || e->n > max_len) continue;
        if (best && e->n <= best->n) continue;
        if (memcmp(e->tokens, tokens, (size_t)e->n * sizeof(int32_t)) == 0) best = e;
    }
    return best;
}

apc_exact_entry *apc_exact_find_same(apc_exact *ex, const int32_t *tokens, int64_t n, uint64_t salt) {
    for (apc_exact_entry *e = ex->newest; e; e = e->older)
        if (e->salt == salt && e->n == n && memcmp(e->tokens, tokens, (size_t)n * sizeof(int32_t)) == 0) return e;
    return NULL;
}

void apc_exact_touch(apc_exact *ex, apc_exact_entry *e) {
    if (!e->listed || ex->newest == e) return;
    unlink_entry(ex, e);
    push_newest(ex, e);
}

int apc_exact_insert(apc_exact *ex, apc_exact_entry *e) {
    push_newest(ex, e);
    int dropped = 0;
    while (ex->oldest != e && ((ex->max_entries > 0 && ex->count > ex->max_entries) || ex->bytes > ex->max_bytes)) {
        drop_entry(ex, ex->oldest);
        dropped++;
    }
    return dropped;
}

void apc_exact_unpin(apc_exact *ex, apc_exact_entry *e) {
    (void)ex;
    if (--e->pins == 0 && !e->listed) apc_exact_entry_free(e);
}

void apc_exact_clear(apc_exact *ex) {
    while (ex->newest) drop_entry(ex, ex->newest);
}
