/* engine_prefix.c - the prefix layer, L0 (see engine_prefix.h).
 *
 * Why a layer of its own. The prompt cache's pools (apc/) keep prompts for
 * every request, but only while the cache is on, and they keep what the
 * target needs: K/V (the block index, exact snapshots, checkpoint chains)
 * and recurrent state at their own restore points. A speculating request
 * needs more to resume warm: an MTP head reads the target's hidden row of
 * every position, which no pool keeps. L0 is the one layer that works with
 * the prompt cache off (cache.enabled false, or a model the cache cannot
 * route), which is where a speculating server otherwise prefills every
 * resend cold.
 *
 * How L0 and the pools divide the work:
 *
 *   what                          cache on (the pools keep the prompt)   cache off
 *   target K/V rows               pools (block index, exact, ckpt)       L0 (owned copies)
 *   recurrent state               pools, at their restore points         L0 (at n and n-1)
 *   MTP head K/V + hidden rows    sidecar (engine_spec.c), beside them   L0 (opaque drafter rows)
 *   draft model K/V + state       sidecar (engine_spec.c)                sidecar
 *
 * So with the cache on a speculating request stores nothing in L0: the
 * pools' post-prefill and retirement stores hold the target's side, the
 * drafter's sidecar holds the rest keyed beside them, and a second copy
 * would only halve what fits. The driver (engine_req.c) stores into L0
 * when the request stores but the cache will not keep its prompt (tier
 * none). Lookups compare both: the longer adoption wins (L0 on a tie), so
 * an L0 entry left from a cache-off period, or a request whose prompt the
 * pools dropped, is still used.
 *
 * Why copies, not references. The pool's blocks are the scheduler's to
 * reserve (it admits a request when the whole pool minus the reservations
 * has room, counting every unreferenced block as free); an L0 entry that
 * held pool blocks could starve admission. Entries therefore copy rows out
 * (layer by layer: K rows [0, n), then V rows, each kv_pool_row_bytes) and
 * a hit writes them into blocks the request allocates like any prefill.
 *
 * The drafter's part is opaque here: spec_export gives an MTP head's K/V
 * rows and the hidden rows it read, a fixed number of words a position,
 * and spec_import puts them back (or, when the head's pool is full,
 * recomputes the head from the hidden rows: the same bits). Recomputing
 * is not the default because the head's attention over a long prompt
 * costs about what one trunk layer does (3000 tokens, qwen35 small: 1.8 s
 * against a 0.1 s copy). A draft model's state is the sidecar's.
 *
 * Exactness: K/V rows are copied word for word, the recurrent state is a
 * snapshot taken at exactly the adopted position (model.h: the state after
 * p is the same bits however the prompt was chunked), and prefill resumes
 * on the grid, so a hit's logits equal a cold run's bit for bit. */
#include "engine/engine_prefix.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"

typedef struct prefix_entry {
    uint64_t salt;
    int64_t n;
    int32_t *ids;       /* (n) */
    uint8_t *kv;        /* rows of [0, n), layer by layer: K rows then V rows */
    void *state_n;      /* snapshot at n, or NULL */
    void *state_n1;     /* snapshot at n-1, or NULL */
    uint32_t *drafter;  /* (n, drafter_words), or NULL */
    size_t bytes;
    uint64_t used;      /* LRU clock */
} prefix_entry;

struct prefix_layer {
    prefix_config cfg;
    kv_pool *pool;
    apc *cache;
    int n_layer;
    size_t token_bytes;   /* K + V row bytes of one position, every layer */
    size_t state_bytes;   /* 0: no recurrent layers */
    size_t dw;            /* drafter words a position */
    pthread_mutex_t lock;
    prefix_entry **e;     /* (cfg.entries) */
    int n;
    size_t bytes;
    uint64_t clock;
    prefix_stats st;
};

/* ---- Lifetime ---- */

prefix_layer *prefix_layer_create(const prefix_config *cfg, const model *m, kv_pool *pool, apc *cache,
                                  ember_error *err) {
    prefix_layer *l = calloc(1, sizeof *l);
    if (l == NULL) {
        ember_fail(err, "out of memory for the prefix layer");
        return NULL;
    }
    l->cfg = *cfg;
    if (l->cfg.entries < 0) l->cfg.entries = 0;
    if (l->cfg.min_tokens < 1) l->cfg.min_tokens = 1;
    l->pool = pool;
    l->cache = cache;
    l->dw = cfg->drafter_words;
    l->state_bytes = model_has_state(m) ? model_state_bytes(m) : 0;
    kv_pool_config kc;
    model_kv_config(m, 1, &kc);
    l->n_layer = kc.n_layer;
    for (int i = 0; i < l->n_layer; i++) l->token_bytes += kv_pool_row_bytes(pool, i, 0) + kv_pool_row_bytes(pool, i, 1);
    pthread_mutex_init(&l->lock, NULL);
    if (l->cfg.entries > 0 && (l->e = calloc((size_t)l->cfg.entries, sizeof *l->e)) == NULL) {
        prefix_layer_free(l);
        ember_fail(err, "out of memory for the prefix layer");
        return NULL;
    }
    return l;
}

static void entry_free(prefix_entry *e) {
    if (e == NULL) return;
    free(e->ids);
    free(e->kv);
    free(e->state_n);
    free(e->state_n1);
    free(e->drafter);
    free(e);
}

static void drop(prefix_layer *l, int i) {
    l->bytes -= l->e[i]->bytes;
    entry_free(l->e[i]);
    l->e[i] = l->e[--l->n];
}

void prefix_layer_free(prefix_layer *l) {
    if (l == NULL) return;
    while (l->n > 0) drop(l, l->n - 1);
    free(l->e);
    pthread_mutex_destroy(&l->lock);
    free(l);
}

bool prefix_layer_on(const prefix_layer *l) { return l != NULL && l->cfg.entries > 0; }

/* ---- Lookup ---- */

/* What entry e gives a prompt of n tokens: its n under a strict prefix
 * (state at n), n-1 when it is the whole prompt (state at n-1), else 0. */
static int64_t adoptable(const prefix_layer *l, const prefix_entry *e, const int32_t *tokens, int64_t n,
                         uint64_t salt) {
    if (e->salt != salt || e->n > n || memcmp(e->ids, tokens, (size_t)e->n * sizeof(int32_t)) != 0) return 0;
    int64_t p = e->n;
    if (p == n) {
        if (l->state_bytes && e->state_n1 == NULL) return 0;
        p = n - 1;
    } else if (l->state_bytes && e->state_n == NULL) {
        return 0;
    }
    return p >= l->cfg.min_tokens ? p : 0;
}

static int best(const prefix_layer *l, const int32_t *tokens, int64_t n, uint64_t salt, int64_t *p_out) {
    int at = -1;
    int64_t bp = 0;
    for (int i = 0; i < l->n; i++) {
        int64_t p = adoptable(l, l->e[i], tokens, n, salt);
        if (p > bp) {
            bp = p;
            at = i;
        }
    }
    *p_out = bp;
    return at;
}

int64_t prefix_peek(prefix_layer *l, const int32_t *tokens, int64_t n, uint64_t salt) {
    if (!prefix_layer_on(l) || n < 2) return 0;
    pthread_mutex_lock(&l->lock);
    int64_t p;
    best(l, tokens, n, salt, &p);
    pthread_mutex_unlock(&l->lock);
    return p;
}

/* Writes rows [0, p) of an entry of e->n rows into seq's blocks. */
static void put_rows(prefix_layer *l, const prefix_entry *e, int64_t p, kv_seq *seq) {
    const uint8_t *src = e->kv;
    for (int layer = 0; layer < l->n_layer; layer++)
        for (int kv = 0; kv < 2; kv++) {
            size_t rb = kv_pool_row_bytes(l->pool, layer, kv);
            if (rb == 0) continue;
            for (int64_t r = 0; r < p; r += KV_BLOCK_TOKENS) {
                int64_t rows = p - r < KV_BLOCK_TOKENS ? p - r : KV_BLOCK_TOKENS;
                int32_t b = seq->blocks[r / KV_BLOCK_TOKENS];
                float *dst = kv ? kv_block_v(l->pool, b, layer) : kv_block_k(l->pool, b, layer);
                memcpy(dst, src + (size_t)r * rb, (size_t)rows * rb);
            }
            src += (size_t)e->n * rb;
        }
}

prefix_hit prefix_lookup(prefix_layer *l, const int32_t *tokens, int64_t n, uint64_t salt, kv_seq *seq,
                         model_state *state) {
    prefix_hit hit = {0, NULL};
    const size_t W = l->dw;
    if (!prefix_layer_on(l) || n < 2) return hit;
    pthread_mutex_lock(&l->lock);
    int64_t p;
    int at = best(l, tokens, n, salt, &p);
    if (at < 0) goto done;
    prefix_entry *e = l->e[at];
    ember_error err;
    if (e->drafter && (hit.drafter = malloc((size_t)p * W * sizeof(uint32_t))) == NULL) goto done;
    if (apc_seq_prepare_append(l->cache, seq, p, &err) < 0) goto miss;
    if (state && l->state_bytes) {
        const void *snap = p == e->n ? e->state_n : e->state_n1;
        if (model_state_restore(state, snap, l->state_bytes, &err) < 0) {
            apc_seq_release(l->cache, seq);
            goto miss;
        }
    }
    put_rows(l, e, p, seq);
    seq->n_tokens = p;
    if (hit.drafter) memcpy(hit.drafter, e->drafter, (size_t)p * W * sizeof(uint32_t));
    hit.n_tokens = p;
    e->used = ++l->clock;
    l->st.hits++;
    l->st.hit_tokens += (uint64_t)p;
    goto done;
miss:
    free(hit.drafter);
    hit.drafter = NULL;
done:
    pthread_mutex_unlock(&l->lock);
    return hit;
}

/* ---- Store ---- */

static void copy_rows(const prefix_layer *l, const kv_seq *seq, int64_t n, uint8_t *dst) {
    for (int layer = 0; layer < l->n_layer; layer++)
        for (int kv = 0; kv < 2; kv++) {
            size_t rb = kv_pool_row_bytes(l->pool, layer, kv);
            if (rb == 0) continue;
            for (int64_t r = 0; r < n; r += KV_BLOCK_TOKENS) {
                int64_t rows = n - r < KV_BLOCK_TOKENS ? n - r : KV_BLOCK_TOKENS;
                int32_t b = seq->blocks[r / KV_BLOCK_TOKENS];
                const float *src = kv ? kv_block_v(l->pool, b, layer) : kv_block_k(l->pool, b, layer);
                memcpy(dst + (size_t)r * rb, src, (size_t)rows * rb);
            }
            dst += (size_t)n * rb;
        }
}

void prefix_store(prefix_layer *l, const int32_t *tokens, int64_t n, uint64_t salt, const kv_seq *seq,
                  const void *state_n, const void *state_n1, const uint32_t *drafter) {
    if (!prefix_layer_on(l) || n < l->cfg.min_tokens || seq->n_tokens < n) return;
    const size_t W = l->dw;
    if (W == 0) drafter = NULL;
    size_t bytes = (size_t)n * (sizeof(int32_t) + l->token_bytes + (drafter ? W * sizeof(uint32_t) : 0)) +
                   (state_n ? l->state_bytes : 0) + (state_n1 ? l->state_bytes : 0);
    pthread_mutex_lock(&l->lock);
    if (bytes > l->cfg.max_bytes) {
        l->st.skips++;
        pthread_mutex_unlock(&l->lock);
        ember_log(EMBER_LOG_INFO, "L0 store skipped: entry %.1f MiB (%lld tokens) exceeds the budget %.1f MiB",
                  (double)bytes / (1024.0 * 1024.0), (long long)n, (double)l->cfg.max_bytes / (1024.0 * 1024.0));
        return;
    }
    for (int i = 0; i < l->n; i++) { /* the same key: replaced */
        prefix_entry *o = l->e[i];
        if (o->salt == salt && o->n == n && memcmp(o->ids, tokens, (size_t)n * sizeof(int32_t)) == 0) {
            drop(l, i);
            break;
        }
    }
    while (l->n > 0 && (l->n >= l->cfg.entries || l->bytes + bytes > l->cfg.max_bytes)) {
        int lru = 0;
        for (int i = 1; i < l->n; i++)
            if (l->e[i]->used < l->e[lru]->used) lru = i;
        drop(l, lru);
        l->st.evictions++;
    }
    prefix_entry *e = calloc(1, sizeof *e);
    if (e == NULL) goto done;
    e->ids = malloc((size_t)n * sizeof(int32_t));
    e->kv = malloc((size_t)n * l->token_bytes + 1);
    if (state_n) e->state_n = malloc(l->state_bytes);
    if (state_n1) e->state_n1 = malloc(l->state_bytes);
    if (drafter) e->drafter = malloc((size_t)n * W * sizeof(uint32_t));
    if (!e->ids || !e->kv || (state_n && !e->state_n) || (state_n1 && !e->state_n1) || (drafter && !e->drafter)) {
        entry_free(e);
        goto done;
    }
    memcpy(e->ids, tokens, (size_t)n * sizeof(int32_t));
    copy_rows(l, seq, n, e->kv);
    if (state_n) memcpy(e->state_n, state_n, l->state_bytes);
    if (state_n1) memcpy(e->state_n1, state_n1, l->state_bytes);
    if (drafter) memcpy(e->drafter, drafter, (size_t)n * W * sizeof(uint32_t));
    e->salt = salt;
    e->n = n;
    e->bytes = bytes;
    e->used = ++l->clock;
    l->e[l->n++] = e;
    l->bytes += bytes;
    l->st.stores++;
done:
    pthread_mutex_unlock(&l->lock);
}

/* ---- Stats and reset ---- */

prefix_stats prefix_get_stats(prefix_layer *l) {
    prefix_stats st;
    memset(&st, 0, sizeof st);
    if (l == NULL) return st;
    pthread_mutex_lock(&l->lock);
    st = l->st;
    st.entries = l->n;
    st.bytes = l->bytes;
    st.max_entries = l->cfg.entries;
    st.max_bytes = l->cfg.max_bytes;
    pthread_mutex_unlock(&l->lock);
    return st;
}

void prefix_clear(prefix_layer *l) {
    if (l == NULL) return;
    pthread_mutex_lock(&l->lock);
    while (l->n > 0) drop(l, l->n - 1);
    pthread_mutex_unlock(&l->lock);
}
