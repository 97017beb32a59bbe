/* kv_pool.c - the refcounted block pool and block tables (see kv_pool.h).
 *
 * Memory is one allocation of n_blocks * block_bytes. A large pool (the
 * server's default is a share of the machine's memory) is an anonymous
 * mapping: its pages are zero and cost nothing until a block is first
 * written, so start-up takes no longer for 10 GiB than for 10 MiB, and the
 * free queue hands out low block ids first, so the touched part grows with
 * use. Small pools stay on the heap, where the sanitizers see their
 * bounds. Inside a block, layer
 * l's K rows start at layer_offset[l] and its V rows right after them, so a
 * block is self-contained: copying it (copy-on-write) is one memcpy and the
 * disk tier writes it as one record. Rows are encoded (kv_rows.h) with a
 * byte size that is a multiple of 4, so every offset is word-aligned.
 *
 * kvarn pools also map one read-only block of zeros: what a block table's
 * KV_BLOCK_HOLE (a sealed group's given-back block) reads as.
 *
 * The free queue is an intrusive doubly-linked list over block ids in the
 * order blocks became free; allocation pops the head (the least recently
 * freed). A block taken back by kv_block_ref is unlinked from the middle in
 * O(1). */
#include "kv/kv_pool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "tensor/kvarn.h"

#define KV_POOL_MAP_BYTES ((size_t)256 << 20) /* pools above 256 MiB are mapped */

struct kv_pool {
    int n_layer;
    int32_t n_blocks;
    kv_format format;
    attention_precision attention;
    size_t block_bytes;      /* all layers */
    size_t *layer_offset;    /* (n_layer) byte offset of layer l's K rows within a block */
    int *k_width;            /* (n_layer) values per row */
    int *v_width;            /* (n_layer) */
    size_t *k_bytes;         /* (n_layer) bytes per encoded row */
    size_t *v_bytes;         /* (n_layer) */
    int k_head, v_head;      /* values per head (kvarn's rotation) */
    kvarn_layout *kvarn;     /* (n_layer) kvarn: where a sealed group's records lie in its regions */
    int kvarn_regions;       /* kvarn: the most regions (blocks) a sealed group uses in any layer */
    int kvarn_last_layer;    /* kvarn: the last layer with K/V rows: sealing it completes a group */
    uint8_t *hole;           /* kvarn: block_bytes of zeros, read-only, read for KV_BLOCK_HOLE */
    size_t hole_bytes;
    uint8_t *data;           /* (n_blocks, block_bytes) */
    size_t data_bytes;
    bool data_mapped;        /* data is an mmap of data_bytes, not heap */
    int32_t *refcount;       /* (n_blocks) */
    bool *indexed;           /* (n_blocks) an owner can find this block by content */
    int32_t *prev, *next;    /* (n_blocks) free queue links; -1 ends */
    bool *in_queue;          /* (n_blocks) */
    int32_t head, tail;
    int32_t n_free;
    uint64_t evictions;
    kv_evict_fn evict_fn;
    void *evict_owner;
};

static void queue_push_tail(kv_pool *p, int32_t b) {
    p->prev[b] = p->tail;
    p->next[b] = -1;
    if (p->tail >= 0) p->next[p->tail] = b;
    else p->head = b;
    p->tail = b;
    p->in_queue[b] = true;
    p->n_free++;
}

static void queue_unlink(kv_pool *p, int32_t b) {
    if (p->prev[b] >= 0) p->next[p->prev[b]] = p->next[b];
    else p->head = p->next[b];
    if (p->next[b] >= 0) p->prev[p->next[b]] = p->prev[b];
    else p->tail = p->prev[b];
    p->in_queue[b] = false;
    p->n_free--;
}

/* "-k6v5" / "-t1024" pieces after "kvarn"; ':' separates as well as '-'. */
static int parse_kvarn(const char *p, kv_format *out) {
    kv_format f = {KV_FORMAT_KVARN, KV_KVARN_DEFAULT_K_BITS, KV_KVARN_DEFAULT_V_BITS, KV_KVARN_DEFAULT_TAIL};
    bool widths = false, tail = false;
    while (*p) {
        if (*p != '-' && *p != ':') return -1;
        p++;
        char *end;
        if (*p == 'k' && !widths) {
            long k = strtol(p + 1, &end, 10);
            if (end == p + 1 || *end != 'v') return -1;
            const char *vp = end + 1;
            long v = strtol(vp, &end, 10);
            if (end == vp || k < KVARN_MIN_BITS || k > KVARN_MAX_BITS || v < KVARN_MIN_BITS || v > KVARN_MAX_BITS)
                return -1;
            f.k_bits = (int)k;
            f.v_bits = (int)v;
            widths = true;
        } else if (*p == 't' && !tail) {
            long t = strtol(p + 1, &end, 10);
            if (end == p + 1 || t < 0 || t > (1L << 20)) return -1;
            f.tail = (int)t;
            tail = true;
        } else {
            return -1;
        }
        p = end;
    }
    *out = f;
    return 0;
}

int kv_format_parse(const char *text, kv_format *out) {
    static const struct { const char *name; kv_format_kind kind; } names[] = {
        {"f32", KV_FORMAT_F32}, {"f16", KV_FORMAT_F16}, {"q8_0", KV_FORMAT_Q8_0}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(text, names[i].name) == 0) {
            *out = (kv_format){names[i].kind, 0, 0, 0};
            return 0;
        }
    if (strncmp(text, "kvarn", 5) == 0) return parse_kvarn(text + 5, out);
    return -1;
}

bool kv_format_is_kvarn(kv_format f) { return f.kind == KV_FORMAT_KVARN; }

const char *kv_format_name(kv_format f) {
    if (f.kind != KV_FORMAT_KVARN) return kv_row_type_name(kv_format_row_type(f));
    /* A few buffers per thread: callers print two names in one message. */
    static _Thread_local char names[4][40];
    static _Thread_local int next;
    char *b = names[next++ & 3];
    snprintf(b, sizeof names[0], "kvarn-k%dv%d-t%d", f.k_bits, f.v_bits, f.tail);
    return b;
}

kv_row_type kv_format_row_type(kv_format f) {
    switch (f.kind) {
    case KV_FORMAT_F16:
    case KV_FORMAT_KVARN: return KV_ROW_F16;
    case KV_FORMAT_Q8_0: return KV_ROW_Q8_0;
    default: return KV_ROW_F32;
    }
}

/* q8_0's layout: 1 (id 2, never written) kept K in ggml Q8_0 like V; 2 keeps
 * K in q12h (kv_rows.h), so namespaces of the first are not adopted. */
#define KV_Q8_0_LAYOUT_VERSION 2

int kv_format_layout(kv_format f) {
    if (f.kind == KV_FORMAT_Q8_0) return KV_Q8_0_LAYOUT_VERSION;
    if (f.kind == KV_FORMAT_KVARN) return KVARN_LAYOUT_VERSION;
    return 1;
}

uint64_t kv_format_id_of_layout(kv_format f, int layout) {
    if (f.kind == KV_FORMAT_Q8_0) /* layout 1 had no version field */
        return layout <= 1 ? (uint64_t)f.kind : (uint64_t)f.kind | (uint64_t)layout << 16;
    if (f.kind != KV_FORMAT_KVARN) return (uint64_t)f.kind;
    return (uint64_t)f.kind | (uint64_t)f.k_bits << 8 | (uint64_t)f.v_bits << 12 | (uint64_t)layout << 16 |
           (uint64_t)(uint32_t)f.tail << 32;
}

uint64_t kv_format_id(kv_format f) { return kv_format_id_of_layout(f, kv_format_layout(f)); }

int kv_format_check(const kv_pool_config *cfg, ember_error *err) {
    kv_format f = cfg->format;
    if (f.kind != KV_FORMAT_F32 && f.kind != KV_FORMAT_F16 && f.kind != KV_FORMAT_Q8_0 && f.kind != KV_FORMAT_KVARN)
        return ember_fail(err, "KV format: unknown kind %d", (int)f.kind);
    kv_row_type t = kv_format_row_type(f);
    if (f.kind == KV_FORMAT_KVARN) {
        if (f.k_bits < KVARN_MIN_BITS || f.k_bits > KVARN_MAX_BITS || f.v_bits < KVARN_MIN_BITS ||
            f.v_bits > KVARN_MAX_BITS || f.tail < 0)
            return ember_fail(err, "KV format kvarn: widths k%dv%d tail %d out of range (2..8 bits, tail >= 0)",
                              f.k_bits, f.v_bits, f.tail);
        kvarn_layout *lay = malloc(sizeof *lay);
        if (lay == NULL) return ember_fail(err, "KV format %s: out of memory", kv_format_name(f));
        for (int l = 0; l < cfg->n_layer; l++) {
            int kw = cfg->k_width[l], vw = cfg->v_width[l];
            int kh = cfg->k_head > 0 ? cfg->k_head : kw, vh = cfg->v_head > 0 ? cfg->v_head : vw;
            size_t region = (size_t)KV_BLOCK_TOKENS * (kv_row_bytes(t, kw) + kv_row_bytes(t, vw));
            bool ok = (kw == 0 || kvarn_slice(kh) >= 2) && (vw == 0 || kvarn_slice(vh) >= 2) &&
                      kvarn_layout_plan(lay, kw, vw, kh, vh, f.k_bits, f.v_bits, region) == 0;
            if (!ok) {
                free(lay);
                return ember_fail(err,
                                  "KV format %s: layer %d has K/V rows of %d/%d values in heads of %d/%d; kvarn "
                                  "needs heads of a multiple of 8 values, at most %d per row",
                                  kv_format_name(f), l, kw, vw, kh, vh, KVARN_MAX_KV_HEADS);
            }
        }
        free(lay);
        return 0;
    }
    kv_row_type kt = kv_row_key_type(t);
    for (int l = 0; l < cfg->n_layer; l++)
        if (!kv_row_supported(kt, cfg->k_width[l]) || !kv_row_supported(t, cfg->v_width[l]))
            return ember_fail(err, "KV format %s: layer %d has K/V rows of %d/%d values; %s needs multiples of %d",
                              kv_format_name(f), l, cfg->k_width[l], cfg->v_width[l], kv_format_name(f),
                              KV_ROW_Q8_0_BLOCK);
    /* rotated K: the query is rotated per head, so slices may not straddle heads */
    if (kv_row_rotated(kt) && cfg->k_head % KV_ROW_Q12H_SLICE != 0)
        return ember_fail(err, "KV format %s: heads of %d values; %s needs heads of a multiple of %d",
                          kv_format_name(f), cfg->k_head, kv_format_name(f), KV_ROW_Q12H_SLICE);
    return 0;
}

size_t kv_format_token_bytes(const kv_pool_config *cfg) {
    kv_row_type t = kv_format_row_type(cfg->format), kt = kv_row_key_type(t);
    size_t bytes = 0;
    for (int l = 0; l < cfg->n_layer; l++) bytes += kv_row_bytes(kt, cfg->k_width[l]) + kv_row_bytes(t, cfg->v_width[l]);
    return bytes;
}

size_t kv_format_record_token_bytes(const kv_pool_config *cfg) {
    if (cfg->format.kind != KV_FORMAT_KVARN) return kv_format_token_bytes(cfg);
    size_t bytes = 0;
    for (int l = 0; l < cfg->n_layer; l++) {
        if (cfg->k_width[l]) bytes += kvarn_record_bytes(cfg->k_width[l], cfg->format.k_bits);
        if (cfg->v_width[l]) bytes += kvarn_record_bytes(cfg->v_width[l], cfg->format.v_bits);
    }
    return bytes / KVARN_GROUP;
}

/* Blocks a sealed group keeps: the most regions any layer's records need. */
static int kvarn_group_blocks_of(const kv_pool_config *cfg) {
    kv_row_type t = kv_format_row_type(cfg->format);
    kvarn_layout *lay = malloc(sizeof *lay);
    int most = KVARN_GROUP / KV_BLOCK_TOKENS;
    if (lay == NULL) return most;
    int used = 0;
    for (int l = 0; l < cfg->n_layer; l++) {
        int kw = cfg->k_width[l], vw = cfg->v_width[l];
        size_t region = (size_t)KV_BLOCK_TOKENS * (kv_row_bytes(t, kw) + kv_row_bytes(t, vw));
        if (kvarn_layout_plan(lay, kw, vw, cfg->k_head > 0 ? cfg->k_head : kw, cfg->v_head > 0 ? cfg->v_head : vw,
                              cfg->format.k_bits, cfg->format.v_bits, region) < 0) {
            used = most;
            break;
        }
        if (lay->n_regions > used) used = lay->n_regions;
    }
    free(lay);
    return used > 0 ? used : most;
}

size_t kv_format_sealed_token_bytes(const kv_pool_config *cfg) {
    size_t row = kv_format_token_bytes(cfg);
    if (cfg->format.kind != KV_FORMAT_KVARN) return row;
    return row * KV_BLOCK_TOKENS * (size_t)kvarn_group_blocks_of(cfg) / KVARN_GROUP;
}

int64_t kv_format_blocks_for_tokens(const kv_pool_config *cfg, int64_t n) {
    int64_t nbs = (n + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS;
    if (cfg->format.kind != KV_FORMAT_KVARN) return nbs;
    const int64_t spare = KVARN_GROUP / KV_BLOCK_TOKENS - kvarn_group_blocks_of(cfg);
    int64_t most = 0; /* the peak, as kv_format_capacity_tokens counts it */
    for (int64_t nb = 1; nb <= nbs; nb++) {
        int64_t held = nb - (kvarn_sealed_end((nb - 1) * KV_BLOCK_TOKENS - 1, cfg->format.tail) - 1) * spare;
        if (held > most) most = held;
    }
    return most;
}

static int64_t capacity_tokens(kv_format f, int group_blocks, int64_t n_blocks) {
    /* group_blocks 0: no layer stores records (a stack without plain-KV
     * layers), so nothing is given back and a block is a block. */
    if (f.kind != KV_FORMAT_KVARN || group_blocks < 1) return n_blocks * KV_BLOCK_TOKENS;
    const int64_t spare = KVARN_GROUP / KV_BLOCK_TOKENS - group_blocks;
    /* A sequence's nb-th block is taken when position 16 (nb - 1) is
     * written, before that position's query seals anything: it then holds
     * nb blocks less the spare ones of the groups sealed at the previous
     * position. A sequence grows through every length, so the first block
     * that does not fit ends it. */
    int64_t best = 0;
    for (int64_t nb = 1;; nb++) {
        int64_t sealed = kvarn_sealed_end((nb - 1) * KV_BLOCK_TOKENS - 1, f.tail) - 1;
        if (nb - sealed * spare > n_blocks) break;
        best = nb * KV_BLOCK_TOKENS;
    }
    return best;
}

int64_t kv_format_capacity_tokens(const kv_pool_config *cfg, int64_t n_blocks) {
    return capacity_tokens(cfg->format, cfg->format.kind == KV_FORMAT_KVARN ? kvarn_group_blocks_of(cfg) : 0, n_blocks);
}

int64_t kv_pool_capacity_tokens(const kv_pool *p, int64_t n_blocks) {
    return capacity_tokens(p->format, p->kvarn_regions, n_blocks);
}

kv_pool *kv_pool_create(const kv_pool_config *cfg, ember_error *err) {
    if (cfg->n_blocks < 1 || cfg->n_layer < 1) {
        ember_fail(err, "kv pool: needs at least one block and one layer (got %d blocks, %d layers)",
                   cfg->n_blocks, cfg->n_layer);
        return NULL;
    }
    if (kv_format_check(cfg, err) < 0) return NULL;
    kv_pool *p = calloc(1, sizeof *p);
    if (p == NULL) goto oom;
    p->n_layer = cfg->n_layer;
    p->n_blocks = cfg->n_blocks;
    p->format = cfg->format;
    p->attention = cfg->attention;
    p->k_head = cfg->k_head;
    p->v_head = cfg->v_head;
    p->layer_offset = calloc((size_t)cfg->n_layer, sizeof(size_t));
    p->k_width = calloc((size_t)cfg->n_layer, sizeof(int));
    p->v_width = calloc((size_t)cfg->n_layer, sizeof(int));
    p->k_bytes = calloc((size_t)cfg->n_layer, sizeof(size_t));
    p->v_bytes = calloc((size_t)cfg->n_layer, sizeof(size_t));
    if (!p->layer_offset || !p->k_width || !p->v_width || !p->k_bytes || !p->v_bytes) goto oom;
    kv_row_type t = kv_format_row_type(cfg->format);
    size_t off = 0;
    for (int l = 0; l < cfg->n_layer; l++) {
        p->k_width[l] = cfg->k_width[l];
        p->v_width[l] = cfg->v_width[l];
        p->k_bytes[l] = kv_row_bytes(kv_row_key_type(t), cfg->k_width[l]);
        p->v_bytes[l] = kv_row_bytes(t, cfg->v_width[l]);
        p->layer_offset[l] = off;
        off += (size_t)KV_BLOCK_TOKENS * (p->k_bytes[l] + p->v_bytes[l]);
    }
    p->block_bytes = off ? off : 4;
    if (cfg->format.kind == KV_FORMAT_KVARN) {
        p->kvarn = calloc((size_t)cfg->n_layer, sizeof *p->kvarn);
        if (p->kvarn == NULL) goto oom;
        for (int l = 0; l < cfg->n_layer; l++) {
            /* kv_format_check planned every layer already */
            kvarn_layout_plan(&p->kvarn[l], p->k_width[l], p->v_width[l], p->k_head, p->v_head, cfg->format.k_bits,
                              cfg->format.v_bits, (size_t)KV_BLOCK_TOKENS * (p->k_bytes[l] + p->v_bytes[l]));
            if (p->kvarn[l].n_regions > p->kvarn_regions) p->kvarn_regions = p->kvarn[l].n_regions;
            if (p->kvarn[l].n_regions > 0) p->kvarn_last_layer = l;
        }
        /* Readers that copy a sequence's blocks word for word (snapshots,
         * disk files) read a hole as zeros; a write into one faults. */
        p->hole_bytes = p->block_bytes;
        void *m = mmap(NULL, p->hole_bytes, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) goto oom;
        p->hole = m;
    }
    size_t nb = (size_t)cfg->n_blocks;
    if (p->block_bytes > SIZE_MAX / nb) goto oom;
    /* 64 bytes past the last block: the AVX-512 kvarn kernel loads 16
     * bytes for 10-14 bytes of codes (attention_kvarn_avx512.c). */
    p->data_bytes = nb * p->block_bytes + 64;
    if (p->data_bytes > KV_POOL_MAP_BYTES) {
        void *m = mmap(NULL, p->data_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m != MAP_FAILED) {
            p->data = m;
            p->data_mapped = true;
        }
    } else {
        /* Page-aligned like the mapped pools: calloc's 16-byte offset put
         * every row's kv-head slice across one more cache line than it
         * covers, a line the attention kernels' per-slice prefetch did not
         * reach (f16 decode attention ran 2.6x slower: docs/engine-bench.md). */
        void *d = NULL;
        if (posix_memalign(&d, 4096, p->data_bytes) == 0) {
            memset(d, 0, p->data_bytes);
            p->data = d;
        }
    }
    p->refcount = calloc(nb, sizeof(int32_t));
    p->indexed = calloc(nb, sizeof(bool));
    p->prev = malloc(nb * sizeof(int32_t));
    p->next = malloc(nb * sizeof(int32_t));
    p->in_queue = calloc(nb, sizeof(bool));
    if (!p->data || !p->refcount || !p->indexed || !p->prev || !p->next || !p->in_queue) goto oom;
    p->head = p->tail = -1;
    for (int32_t b = 0; b < cfg->n_blocks; b++) queue_push_tail(p, b);
    return p;
oom:
    kv_pool_free(p);
    ember_fail(err, "kv pool: out of memory for %d blocks", cfg->n_blocks);
    return NULL;
}

void kv_pool_free(kv_pool *p) {
    if (p == NULL) return;
    free(p->layer_offset);
    free(p->kvarn);
    if (p->hole) munmap(p->hole, p->hole_bytes);
    free(p->k_width);
    free(p->v_width);
    free(p->k_bytes);
    free(p->v_bytes);
    if (p->data_mapped) munmap(p->data, p->data_bytes);
    else free(p->data);
    free(p->refcount);
    free(p->indexed);
    free(p->prev);
    free(p->next);
    free(p->in_queue);
    free(p);
}

void kv_pool_set_evict_hook(kv_pool *p, kv_evict_fn fn, void *owner) {
    p->evict_fn = fn;
    p->evict_owner = owner;
}

int32_t kv_block_alloc(kv_pool *p) {
    int32_t b = p->head;
    if (b < 0) return -1;
    queue_unlink(p, b);
    if (p->indexed[b]) {
        p->indexed[b] = false;
        p->evictions++;
        if (p->evict_fn) p->evict_fn(p->evict_owner, b);
    }
    p->refcount[b] = 1;
    return b;
}

void kv_block_ref(kv_pool *p, int32_t b) {
    if (b < 0) return;
    if (p->refcount[b]++ == 0 && p->in_queue[b]) queue_unlink(p, b);
}

void kv_block_unref(kv_pool *p, int32_t b) {
    if (b < 0 || p->refcount[b] <= 0) return;
    if (--p->refcount[b] == 0) queue_push_tail(p, b);
}

int32_t kv_block_refcount(const kv_pool *p, int32_t b) { return b < 0 ? 0 : p->refcount[b]; }
void kv_block_set_indexed(kv_pool *p, int32_t b, bool indexed) {
    if (b >= 0) p->indexed[b] = indexed;
}
bool kv_block_is_indexed(const kv_pool *p, int32_t b) { return b >= 0 && p->indexed[b]; }

/* A block's bytes; a hole reads as the pool's zero block. */
static uint8_t *block_data(const kv_pool *p, int32_t b) {
    return b < 0 ? p->hole : p->data + (size_t)b * p->block_bytes;
}

void kv_block_copy(kv_pool *p, int32_t dst, int32_t src) {
    if (dst < 0) return;
    memcpy(p->data + (size_t)dst * p->block_bytes, block_data(p, src), p->block_bytes);
}

float *kv_block_k(const kv_pool *p, int32_t b, int layer) {
    return (float *)(void *)(block_data(p, b) + p->layer_offset[layer]);
}

float *kv_block_v(const kv_pool *p, int32_t b, int layer) {
    return (float *)(void *)(block_data(p, b) + p->layer_offset[layer] + (size_t)KV_BLOCK_TOKENS * p->k_bytes[layer]);
}

static uint8_t *row_at(const kv_pool *p, int32_t b, int layer, int kv, int row) {
    uint8_t *base = (uint8_t *)(kv == 0 ? kv_block_k(p, b, layer) : kv_block_v(p, b, layer));
    return base + (size_t)row * (kv == 0 ? p->k_bytes[layer] : p->v_bytes[layer]);
}

void kv_row_write(kv_pool *p, int32_t b, int layer, int kv, int row, const float *src) {
    kv_row_type t = kv_format_row_type(p->format);
    kv_row_encode(kv == 0 ? kv_row_key_type(t) : t, src, row_at(p, b, layer, kv, row),
                  kv == 0 ? p->k_width[layer] : p->v_width[layer]);
}

void kv_row_read(const kv_pool *p, int32_t b, int layer, int kv, int row, float *dst) {
    kv_row_type t = kv_format_row_type(p->format);
    kv_row_decode(kv == 0 ? kv_row_key_type(t) : t, row_at(p, b, layer, kv, row), 0,
                  kv == 0 ? p->k_width[layer] : p->v_width[layer], dst);
}

void kv_seq_init(kv_seq *seq) { memset(seq, 0, sizeof *seq); }

/* kvarn: the groups that queries at [from, to) will seal are rewritten in
 * place, so the sequence must own their blocks alone: a block shared with
 * another sequence, a checkpoint record or the index is copied first, and
 * the others keep reading the fp16 rows. */
static int kvarn_own_sealing_groups(kv_pool *p, kv_seq *seq, int64_t from, int64_t to, ember_error *err) {
    if (p->format.kind != KV_FORMAT_KVARN || to <= from) return 0;
    int64_t g0 = kvarn_sealed_end(from - 1, p->format.tail), g1 = kvarn_sealed_end(to - 1, p->format.tail);
    const int32_t per_group = KVARN_GROUP / KV_BLOCK_TOKENS;
    for (int64_t g = g0; g < g1; g++)
        for (int32_t i = (int32_t)g * per_group; i < (int32_t)(g + 1) * per_group && i < seq->n_blocks; i++) {
            int32_t b = seq->blocks[i];
            if (b < 0 || (p->refcount[b] <= 1 && !p->indexed[b])) continue;
            int32_t fresh = kv_block_alloc(p);
            if (fresh < 0)
                return ember_fail(err, "kv: pool exhausted (%d blocks) copying a shared block before sealing it",
                                  p->n_blocks);
            kv_block_copy(p, fresh, b);
            kv_block_unref(p, b);
            seq->blocks[i] = fresh;
        }
    return 0;
}

static int seq_reserve_table(kv_seq *seq, int32_t n, ember_error *err) {
    if (n <= seq->cap) return 0;
    int32_t cap = seq->cap ? seq->cap : 16;
    while (cap < n) cap *= 2;
    int32_t *t = realloc(seq->blocks, (size_t)cap * sizeof(int32_t));
    if (t == NULL) return ember_fail(err, "kv: out of memory for a block table of %d entries", cap);
    seq->blocks = t;
    seq->cap = cap;
    return 0;
}

int kv_seq_prepare_append(kv_pool *p, kv_seq *seq, int64_t n_new, ember_error *err) {
    kv_seq_kvarn_compact(p, seq); /* a prefix adopted from a cache tier comes with every block */
    int64_t end = seq->n_tokens + n_new;
    int32_t need = (int32_t)((end + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS);
    if (seq_reserve_table(seq, need, err) < 0) return -1;
    /* A partial last block shared with another sequence is copied before we
     * write into it. */
    if (seq->n_tokens % KV_BLOCK_TOKENS != 0 && n_new > 0) {
        int32_t last = seq->blocks[seq->n_blocks - 1];
        if (p->refcount[last] > 1 || p->indexed[last]) {
            int32_t fresh = kv_block_alloc(p);
            if (fresh < 0) return ember_fail(err, "kv: pool exhausted (%d blocks) copying a shared block", p->n_blocks);
            kv_block_copy(p, fresh, last);
            kv_block_unref(p, last);
            seq->blocks[seq->n_blocks - 1] = fresh;
        }
    }
    int32_t had = seq->n_blocks;
    while (seq->n_blocks < need) {
        int32_t b = kv_block_alloc(p);
        if (b < 0) {
            /* Leave the sequence as it was. */
            while (seq->n_blocks > had) kv_block_unref(p, seq->blocks[--seq->n_blocks]);
            return ember_fail(err, "kv: pool exhausted: all %d blocks (%d tokens) are in use", p->n_blocks,
                              p->n_blocks * KV_BLOCK_TOKENS);
        }
        seq->blocks[seq->n_blocks++] = b;
    }
    return kvarn_own_sealing_groups(p, seq, seq->n_tokens, end, err);
}

int kv_seq_adopt_block(kv_pool *p, kv_seq *seq, int32_t block, ember_error *err) {
    if (seq->n_tokens != (int64_t)seq->n_blocks * KV_BLOCK_TOKENS)
        return ember_fail(err, "kv: can only adopt a block at a block boundary (sequence has %lld tokens)",
                          (long long)seq->n_tokens);
    if (seq_reserve_table(seq, seq->n_blocks + 1, err) < 0) return -1;
    kv_block_ref(p, block);
    seq->blocks[seq->n_blocks++] = block;
    seq->n_tokens += KV_BLOCK_TOKENS;
    return 0;
}

void kv_seq_truncate(kv_pool *p, kv_seq *seq, int64_t n_tokens) {
    if (n_tokens > seq->n_tokens) return;
    int32_t keep = (int32_t)((n_tokens + KV_BLOCK_TOKENS - 1) / KV_BLOCK_TOKENS);
    /* Release from the tail so the deepest blocks are the first to be evicted. */
    while (seq->n_blocks > keep) kv_block_unref(p, seq->blocks[--seq->n_blocks]);
    seq->n_tokens = n_tokens;
}

void kv_seq_release(kv_pool *p, kv_seq *seq) {
    kv_seq_truncate(p, seq, 0);
    free(seq->blocks);
    kv_seq_init(seq);
}

int32_t kv_pool_n_blocks(const kv_pool *p) { return p->n_blocks; }
int32_t kv_pool_n_free(const kv_pool *p) { return p->n_free; }
size_t kv_pool_block_bytes(const kv_pool *p) { return p->block_bytes; }
size_t kv_pool_row_bytes(const kv_pool *p, int layer, int kv) { return kv == 0 ? p->k_bytes[layer] : p->v_bytes[layer]; }
kv_format kv_pool_format(const kv_pool *p) { return p->format; }
attention_precision kv_pool_attention(const kv_pool *p) { return p->attention; }
uint64_t kv_pool_evictions(const kv_pool *p) { return p->evictions; }

/* ---- kvarn groups ---- */

bool kv_kvarn_sealed(kv_format f, int64_t g, int64_t p) {
    return f.kind == KV_FORMAT_KVARN && kvarn_group_sealed(g, p, f.tail);
}

int64_t kv_kvarn_sealed_end(kv_format f, int64_t p) {
    return f.kind == KV_FORMAT_KVARN ? kvarn_sealed_end(p, f.tail) : 1;
}

/* The regions of group g in layer `layer` (kvarn.h): the layer's bytes of
 * the group's blocks, the first lay->n_regions of them. */
static void group_regions(const kv_pool *p, const kv_seq *seq, int layer, int64_t g, uint8_t **regions) {
    const int32_t per_group = KVARN_GROUP / KV_BLOCK_TOKENS;
    for (int r = 0; r < p->kvarn[layer].n_regions; r++)
        regions[r] = (uint8_t *)kv_block_k(p, seq->blocks[g * per_group + r], layer);
}

/* Group g is sealed in every layer: the blocks after its first
 * kvarn_regions hold nothing that is read any more. */
static void release_spare(kv_pool *p, kv_seq *seq, int64_t g) {
    const int32_t per_group = KVARN_GROUP / KV_BLOCK_TOKENS;
    for (int32_t i = (int32_t)g * per_group + p->kvarn_regions; i < (int32_t)(g + 1) * per_group && i < seq->n_blocks;
         i++) {
        kv_block_unref(p, seq->blocks[i]);
        seq->blocks[i] = KV_BLOCK_HOLE;
    }
}

/* Is group g of seq sealed (its marker, in the first layer with rows)? */
static bool group_marked(const kv_pool *p, const kv_seq *seq, int64_t g) {
    int32_t bi = (int32_t)(g * (KVARN_GROUP / KV_BLOCK_TOKENS));
    if (bi >= seq->n_blocks || seq->blocks[bi] < 0) return false;
    for (int l = 0; l < p->n_layer; l++)
        if (p->kvarn[l].n_regions > 0) return kvarn_region0_sealed((const uint8_t *)kv_block_k(p, seq->blocks[bi], l));
    return false;
}

void kv_seq_kvarn_compact(kv_pool *p, kv_seq *seq) {
    if (p->format.kind != KV_FORMAT_KVARN || seq->n_tokens <= 0) return;
    const int32_t per_group = KVARN_GROUP / KV_BLOCK_TOKENS;
    int64_t end = kvarn_sealed_end(seq->n_tokens - 1, p->format.tail);
    for (int64_t g = 1; g < end; g++) {
        int32_t spare = (int32_t)g * per_group + p->kvarn_regions;
        if (spare < seq->n_blocks && seq->blocks[spare] >= 0 && group_marked(p, seq, g)) release_spare(p, seq, g);
    }
}

int32_t kv_pool_kvarn_group_blocks(const kv_pool *p) {
    return p->format.kind == KV_FORMAT_KVARN ? p->kvarn_regions : KVARN_GROUP / KV_BLOCK_TOKENS;
}

size_t kv_kvarn_scratch_floats(const kv_pool *p) {
    size_t rows = 0, w = 0;
    for (int l = 0; l < p->n_layer; l++) {
        size_t both = (size_t)p->k_width[l] + (size_t)p->v_width[l];
        if (both > rows) rows = both;
        if ((size_t)p->k_width[l] > w) w = (size_t)p->k_width[l];
        if ((size_t)p->v_width[l] > w) w = (size_t)p->v_width[l];
    }
    /* 128 decoded K and V rows, then one record (at most 8 bits a value plus factors). */
    return (size_t)KVARN_GROUP * rows + ((size_t)KVARN_GROUP * w + 2 * (w + KVARN_GROUP) + 8) / sizeof(float) + 1;
}

void kv_kvarn_seal_group(kv_pool *p, kv_seq *seq, int layer, int64_t g, float *scratch) {
    const kvarn_layout *lay = &p->kvarn[layer];
    if (lay->n_regions == 0) return;
    /* Every row of the group is read before the regions are overwritten:
     * they hold both K and V rows of the group's first tokens. */
    float *rows[2] = {scratch, scratch + (size_t)KVARN_GROUP * (size_t)p->k_width[layer]};
    void *record = rows[1] + (size_t)KVARN_GROUP * (size_t)p->v_width[layer];
    for (int kv = 0; kv < 2; kv++) {
        int w = kv == 0 ? p->k_width[layer] : p->v_width[layer];
        for (int t = 0; w && t < KVARN_GROUP; t++) {
            int64_t pos = g * KVARN_GROUP + t;
            kv_row_decode(KV_ROW_F16, row_at(p, seq->blocks[pos / KV_BLOCK_TOKENS], layer, kv, (int)(pos % KV_BLOCK_TOKENS)),
                          0, w, rows[kv] + (size_t)t * (size_t)w);
        }
    }
    uint8_t *regions[KVARN_MAX_REGIONS];
    group_regions(p, seq, layer, g, regions);
    kvarn_layout_clear(lay, regions);
    for (int kv = 0; kv < 2; kv++) {
        if (lay->width[kv] == 0) continue;
        kvarn_encode(rows[kv], lay->width[kv], lay->head[kv], lay->bits[kv], record);
        kvarn_record_to_regions(lay, kv, record, regions);
    }
    if (layer == p->kvarn_last_layer) release_spare(p, seq, g);
}

void kv_kvarn_record_gather(const kv_pool *p, const kv_seq *seq, int layer, int kv, int64_t g, void *record) {
    uint8_t *regions[KVARN_MAX_REGIONS];
    group_regions(p, seq, layer, g, regions);
    kvarn_regions_to_record(&p->kvarn[layer], kv, (const uint8_t *const *)regions, record);
}

const kvarn_layout *kv_pool_kvarn_layout(const kv_pool *p, int layer) { return p->kvarn ? &p->kvarn[layer] : NULL; }

bool kv_seq_kvarn_check(const kv_pool *p, const kv_seq *seq, int64_t n) {
    if (p->format.kind != KV_FORMAT_KVARN || n <= 0) return true;
    /* Sealing writes every layer alike: the first layer with K rows tells. */
    int layer = -1;
    for (int l = 0; l < p->n_layer && layer < 0; l++)
        if (p->k_width[l] > 0) layer = l;
    if (layer < 0) return true;
    for (int64_t g = 1; g * KVARN_GROUP < n; g++) {
        int32_t bi = (int32_t)(g * (KVARN_GROUP / KV_BLOCK_TOKENS));
        if (bi >= seq->n_blocks || seq->blocks[bi] < 0) return false;
        const uint8_t *region0 = (const uint8_t *)kv_block_k(p, seq->blocks[bi], layer);
        if (kvarn_region0_sealed(region0) != kvarn_group_sealed(g, n - 1, p->format.tail)) return false;
    }
    return true;
}

int kv_pool_head(const kv_pool *p, int kv) { return kv == 0 ? p->k_head : p->v_head; }
int kv_pool_width(const kv_pool *p, int layer, int kv) { return kv == 0 ? p->k_width[layer] : p->v_width[layer]; }
