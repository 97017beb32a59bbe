/* apc_disk.c - the SSD tier: index, write queue and writers, reads, cap.
 *
 * State, all under d->lock:
 *  - files: one record per canonical file in the namespace directory (kind,
 *    name key, chain position, keys, bytes, last use). Start-up fills it from
 *    headers; writers add to it; eviction, corruption and a vanished
 *    directory remove from it.
 *  - blocks: block key -> (file, index in file), or PENDING while a queued
 *    write will provide it (so two stores of one chain write it once).
 *    exact: exact or skeleton key -> file, or PENDING (the two key kinds
 *    are tagged differently, so they share one map).
 *  - the queue: jobs with their bytes already laid out (shards: header,
 *    keys, tokens and a private copy of the rows; snapshots: header and
 *    tokens, the rows being the pinned entry's). A store reserves room
 *    before it copies anything, waiting at most ENQUEUE_WAIT_MS.
 * Writers take a job, write it without the lock (temp name, fsync, rename,
 * directory fsync), then commit it to the index and evict down to the low
 * watermark. Readers look a key up under the lock, then open and verify the
 * file without it; a file evicted meanwhile is either still readable
 * through the open descriptor or gone (a plain miss).
 *
 * Sharing a directory: every open tier holds a shared flock on <ns>/.lock
 * for its lifetime. Start-up takes it exclusively without waiting first:
 * only a tier that got it (no other server has the directory open) deletes
 * temp files, which may otherwise be another live server's writes in
 * flight; with company, only temp files older than APC_DISK_TEMP_STALE_S
 * go (left by a server that died while the others kept running).
 *
 * Checkpoint skeletons (reference §10.4) are exact-format files without
 * K/V: tokens, kind and state. Their K/V are ckpt-salted block shards
 * written by the same store, so a skeleton restore is a skeleton read plus
 * a chain load (apc_disk_ckpt.c drives it; apc_disk_find_skeleton here). */
#include "apc/apc_disk.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>

#include "core/clock.h"
#include "core/log.h"
#include "tensor/kvarn.h"

#define PENDING (-1)
#define ABSENT INT64_MIN
#define ENQUEUE_WAIT_MS 20

/* ---- A growable hash map from 128-bit keys to int64 ---- */

typedef struct kslot {
    apc_key key;
    int64_t val; /* ABSENT: empty slot */
} kslot;

typedef struct keymap {
    kslot *s;
    uint64_t mask; /* capacity - 1 */
    uint64_t count;
} keymap;

static uint64_t home(const keymap *m, const apc_key *k) {
    uint64_t h;
    memcpy(&h, k->b + 8, 8);
    return h & m->mask;
}

static int km_init(keymap *m, uint64_t cap) {
    m->s = malloc(cap * sizeof *m->s);
    if (m->s == NULL) return -1;
    for (uint64_t i = 0; i < cap; i++) m->s[i].val = ABSENT;
    m->mask = cap - 1;
    m->count = 0;
    return 0;
}

static int64_t km_slot(const keymap *m, const apc_key *k) {
    for (uint64_t i = home(m, k);; i = (i + 1) & m->mask) {
        if (m->s[i].val == ABSENT) return -1;
        if (apc_key_eq(&m->s[i].key, k)) return (int64_t)i;
    }
}

static int64_t km_get(const keymap *m, const apc_key *k) {
    int64_t i = km_slot(m, k);
    return i < 0 ? ABSENT : m->s[i].val;
}

static int km_put(keymap *m, const apc_key *k, int64_t val) {
    int64_t at = km_slot(m, k);
    if (at >= 0) {
        m->s[at].val = val;
        return 0;
    }
    if ((m->count + 1) * 2 > m->mask + 1) {
        keymap bigger;
        if (km_init(&bigger, (m->mask + 1) * 2) < 0) return -1;
        for (uint64_t i = 0; i <= m->mask; i++)
            if (m->s[i].val != ABSENT) {
                uint64_t j = home(&bigger, &m->s[i].key);
                while (bigger.s[j].val != ABSENT) j = (j + 1) & bigger.mask;
                bigger.s[j] = m->s[i];
            }
        bigger.count = m->count;
        free(m->s);
        *m = bigger;
    }
    uint64_t i = home(m, k);
    while (m->s[i].val != ABSENT) i = (i + 1) & m->mask;
    m->s[i].key = *k;
    m->s[i].val = val;
    m->count++;
    return 0;
}

static void km_del(keymap *m, const apc_key *k) {
    int64_t at = km_slot(m, k);
    if (at < 0) return;
    uint64_t i = (uint64_t)at;
    m->s[i].val = ABSENT;
    for (uint64_t j = (i + 1) & m->mask; m->s[j].val != ABSENT; j = (j + 1) & m->mask) {
        uint64_t h = home(m, &m->s[j].key);
        bool stays = i <= j ? (h > i && h <= j) : (h > i || h <= j);
        if (!stays) {
            m->s[i] = m->s[j];
            m->s[j].val = ABSENT;
            i = j;
        }
    }
    m->count--;
}

/* ---- Records, jobs, the tier ---- */

typedef struct file_rec {
    bool live;
    uint32_t kind;
    apc_key name;
    apc_key parent;
    uint64_t salt;
    uint32_t first_block, n_blocks, last_rows;
    uint64_t n_tokens;
    uint64_t bytes;
    uint64_t last_used;
    apc_key *keys; /* (n_blocks) */
} file_rec;

typedef struct job {
    struct job *next;
    apc_disk_header hdr; /* hdr.keys owned */
    uint8_t *head;       /* header, keys, tokens */
    size_t head_bytes;
    const float *payload;
    size_t payload_bytes;
    const void *state;   /* after the payload (exact: the entry's; skeleton: own_state) */
    size_t state_bytes;
    void *own_state;
    float *own;          /* shard rows */
    apc_exact_entry *entry;
    apc_disk_release_fn release;
    void *owner;
    size_t reserved;     /* queue bytes held */
} job;

#define APC_DISK_LOCK_NAME ".lock"
#define APC_DISK_TEMP_STALE_S 3600 /* no write takes an hour: its writer is gone */

struct apc_disk {
    pthread_mutex_t lock;
    int lock_fd;         /* <dir>/.lock, flock shared while open; -1 before */
    pthread_cond_t cv_work, cv_space, cv_idle;
    char *dir;
    uint8_t ns[16];
    char ns_hex[33];
    const apc_layout *lay;
    apc_disk_expect ex;
    kv_pool *pool;
    apc_disk_read mode;
    uint64_t max_bytes;
    int queue_jobs;
    size_t queue_bytes;
    int backoff_ms;

    file_rec *files;
    int32_t n_files, cap_files;
    keymap blocks, exact;
    uint64_t bytes, live_files, blocks_indexed, exact_indexed, skels_indexed;

    job *head, *tail;
    int q_jobs;
    size_t q_bytes;
    int busy;
    bool stop;
    pthread_t *threads;
    int n_threads;
    uint64_t tmp_seq;
    uint64_t backoff_until;
    bool backoff_warned, error_warned;
    bool read_error_warned;  /* an unreadable file is logged once per tier */

    uint64_t hits, writes, evictions, write_drops, write_errors, corrupt, skel_writes, read_errors;
    int (*read_hook)(void *user, const char *path); /* apc_disk_config.read_hook */
    void *read_hook_user;
};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000ull + (uint64_t)ts.tv_nsec / 1000000ull;
}

static char kind_char(uint32_t kind) {
    return kind == APC_DISK_KIND_SHARD ? 'b' : kind == APC_DISK_KIND_SKEL ? 'k' : kind == APC_DISK_KIND_SIDE ? 's' : 'x';
}

static void file_path(const apc_disk *d, uint32_t kind, const apc_key *name, char *out, size_t cap) {
    char hex[33];
    apc_disk_key_hex(name, hex);
    snprintf(out, cap, "%s/%c-%s.apc", d->dir, kind_char(kind), hex);
}

static int mkdir_p(const char *path) {
    char *p = strdup(path);
    if (p == NULL) return -1;
    for (char *s = p + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(p, 0755) < 0 && errno != EEXIST) {
            free(p);
            return -1;
        }
        *s = '/';
    }
    int rc = mkdir(p, 0755) < 0 && errno != EEXIST ? -1 : 0;
    free(p);
    return rc;
}

/* ---- Index (under the lock) ---- */

static int32_t add_file(apc_disk *d, const apc_disk_header *h, uint64_t bytes, uint64_t last_used) {
    int32_t id = -1;
    for (int32_t i = 0; i < d->n_files; i++)
        if (!d->files[i].live) {
            id = i;
            break;
        }
    if (id < 0) {
        if (d->n_files == d->cap_files) {
            int32_t cap = d->cap_files ? 2 * d->cap_files : 64;
            file_rec *f = realloc(d->files, (size_t)cap * sizeof *f);
            if (f == NULL) return -1;
            d->files = f;
            d->cap_files = cap;
        }
        id = d->n_files++;
    }
    file_rec *r = &d->files[id];
    memset(r, 0, sizeof *r);
    if (h->n_blocks) {
        r->keys = malloc((size_t)h->n_blocks * sizeof *r->keys);
        if (r->keys == NULL) return -1;
        memcpy(r->keys, h->keys, (size_t)h->n_blocks * sizeof *r->keys);
    }
    r->live = true;
    r->kind = h->kind;
    r->name = h->content;
    r->parent = h->parent;
    r->salt = h->salt;
    r->first_block = h->first_block;
    r->n_blocks = h->n_blocks;
    r->last_rows = h->last_rows;
    r->n_tokens = h->n_tokens;
    r->bytes = bytes;
    r->last_used = last_used;
    d->bytes += bytes;
    d->live_files++;
    if (r->kind == APC_DISK_KIND_SHARD) {
        for (uint32_t j = 0; j < r->n_blocks; j++) {
            int64_t v = km_get(&d->blocks, &r->keys[j]);
            if (v != ABSENT && v != PENDING) continue; /* another file holds it */
            if (km_put(&d->blocks, &r->keys[j], ((int64_t)id << 16) | j) == 0) d->blocks_indexed++;
        }
    } else {
        int64_t v = km_get(&d->exact, &r->name);
        if ((v == ABSENT || v == PENDING) && km_put(&d->exact, &r->name, id) == 0) {
            if (r->kind != APC_DISK_KIND_SIDE) d->exact_indexed++; /* sides are the drafter's */
            if (r->kind == APC_DISK_KIND_SKEL) d->skels_indexed++;
        }
    }
    return id;
}

/* Forgets a file; unlinks it too when asked. */
static void drop_file(apc_disk *d, int32_t id, bool unlink_it) {
    file_rec *r = &d->files[id];
    if (!r->live) return;
    if (unlink_it) {
        char path[4096];
        file_path(d, r->kind, &r->name, path, sizeof path);
        unlink(path);
    }
    if (r->kind == APC_DISK_KIND_SHARD) {
        for (uint32_t j = 0; j < r->n_blocks; j++) {
            int64_t v = km_get(&d->blocks, &r->keys[j]);
            if (v >= 0 && (v >> 16) == id) {
                km_del(&d->blocks, &r->keys[j]);
                d->blocks_indexed--;
            }
        }
    } else if (km_get(&d->exact, &r->name) == id) {
        km_del(&d->exact, &r->name);
        if (r->kind != APC_DISK_KIND_SIDE) d->exact_indexed--;
        if (r->kind == APC_DISK_KIND_SKEL) d->skels_indexed--;
    }
    d->bytes -= r->bytes;
    d->live_files--;
    free(r->keys);
    memset(r, 0, sizeof *r);
}

/* The directory vanished: forget every file (pending marks stay). */
static void forget_all(apc_disk *d) {
    for (int32_t i = 0; i < d->n_files; i++) drop_file(d, i, false);
}

static bool older(const file_rec *a, const file_rec *b) {
    if (a->last_used != b->last_used) return a->last_used < b->last_used;
    return a->first_block > b->first_block;
}

/* Down to 90% of the cap: the oldest file, or the deepest file chained
 * after it, first. */
static void evict(apc_disk *d) {
    if (d->max_bytes == 0 || d->bytes <= d->max_bytes) return;
    uint64_t target = d->max_bytes / 10 * 9;
    while (d->bytes > target && d->live_files > 0) {
        int32_t v = -1;
        for (int32_t i = 0; i < d->n_files; i++)
            if (d->files[i].live && (v < 0 || older(&d->files[i], &d->files[v]))) v = i;
        for (int depth = 0; depth < 1 << 20; depth++) {
            int32_t child = -1;
            for (int32_t i = 0; i < d->n_files; i++) {
                const file_rec *g = &d->files[i];
                if (!g->live || g->kind != APC_DISK_KIND_SHARD || g->first_block == 0 || i == v) continue;
                int64_t p = km_get(&d->blocks, &g->parent);
                if (p < 0 || (p >> 16) != v) continue;
                if (child < 0 || older(g, &d->files[child])) child = i;
            }
            if (child < 0) break;
            v = child;
        }
        drop_file(d, v, true);
        d->evictions++;
    }
}

static void touch(apc_disk *d, int32_t id, uint64_t t) {
    if (id >= 0 && id < d->n_files && d->files[id].live && d->files[id].last_used < t) d->files[id].last_used = t;
}

/* ---- Namespace, start-up ---- */

void apc_disk_namespace(const apc_disk_config *cfg, const apc_layout *lay, apc_hash_kind hash, uint8_t ns[16]) {
    XXH3_state_t *st = XXH3_createState();
    memset(ns, 0, 16);
    if (st == NULL) return;
    XXH3_128bits_reset(st);
    uint8_t b[8];
#define FEED_U64(v)                                               \
    do {                                                          \
        uint64_t v_ = (uint64_t)(v);                              \
        for (int i_ = 0; i_ < 8; i_++) b[i_] = (uint8_t)(v_ >> (8 * i_)); \
        XXH3_128bits_update(st, b, 8);                            \
    } while (0)
    XXH3_128bits_update(st, "ember-apc-disk", 14);
    FEED_U64(APC_DISK_VERSION);
    if (cfg->namespace_override && cfg->namespace_override[0]) {
        FEED_U64(1);
        FEED_U64(strlen(cfg->namespace_override));
        XXH3_128bits_update(st, cfg->namespace_override, strlen(cfg->namespace_override));
    } else {
        FEED_U64(2);
        XXH3_128bits_update(st, cfg->fingerprint, 16);
    }
    FEED_U64(KV_BLOCK_TOKENS);
    FEED_U64(lay->kv_format_id); /* KV format: 0 = f32, so older f32 namespaces stay readable */
    FEED_U64(hash);
    FEED_U64(lay->n_layer);
    /* Values per row, not words: with the format id they name the rows, and
     * a server can compute the namespace it would have under another format
     * (apc_disk_note_other_formats). For f32 both are the same. */
    for (int l = 0; l < lay->n_layer; l++) {
        FEED_U64(lay->k_values ? lay->k_values[l] : lay->k_width[l]);
        FEED_U64(lay->v_values ? lay->v_values[l] : lay->v_width[l]);
    }
    FEED_U64(lay->state_bytes); /* the layer mix: recurrent state and the stack */
    FEED_U64(lay->stack_sig);
    /* K/V written under bf16 attention are other rows than under f32 (each
     * layer's input went through the previous layer's attention); f32 adds
     * nothing, so its namespaces are those of before the setting existed. */
    if (lay->attention != ATTENTION_F32) {
        XXH3_128bits_update(st, "attention", 9);
        FEED_U64(lay->attention);
        /* the kernel's version (the first fed none): files of another
         * version's arithmetic are not this server's rows */
        if (lay->attention == ATTENTION_BF16) FEED_U64(ATTENTION_BF16_VERSION);
        if (lay->attention == ATTENTION_INT8) { /* its weights and values are the bf16 kernel's */
            FEED_U64(ATTENTION_INT8_VERSION);
            FEED_U64(ATTENTION_BF16_VERSION);
        }
    }
#undef FEED_U64
    XXH128_hash_t h = XXH3_128bits_digest(st);
    XXH3_freeState(st);
    for (int i = 0; i < 8; i++) {
        ns[i] = (uint8_t)(h.low64 >> (8 * i));
        ns[8 + i] = (uint8_t)(h.high64 >> (8 * i));
    }
}

static long count_entries(const char *dir_path);

/* The formats another server may have written with: the stock ones, and
 * kvarn at every width with the usual tails (namespaces are hashes, so only
 * formats tried here can be named). */
static int other_formats(kv_format *out, int cap) {
    static const int tails[] = {0, 128, 256, 512, 1024, 2048, 4096};
    int n = 0;
    out[n++] = (kv_format){KV_FORMAT_F32, 0, 0, 0};
    out[n++] = (kv_format){KV_FORMAT_F16, 0, 0, 0};
    out[n++] = (kv_format){KV_FORMAT_Q8_0, 0, 0, 0};
    for (int k = KVARN_MIN_BITS; k <= KVARN_MAX_BITS; k++)
        for (int v = KVARN_MIN_BITS; v <= KVARN_MAX_BITS; v++)
            for (size_t t = 0; t < sizeof tails / sizeof tails[0] && n < cap; t++)
                out[n++] = (kv_format){KV_FORMAT_KVARN, k, v, tails[t]};
    return n;
}

/* How many files the directory of probe's namespace holds (<= 0: none). */
static long namespace_files(const apc_disk_config *cfg, const apc_layout *probe, apc_hash_kind hash) {
    uint8_t ns[16];
    apc_disk_namespace(cfg, probe, hash, ns);
    apc_key k;
    memcpy(k.b, ns, 16);
    char hex[33], path[4096];
    apc_disk_key_hex(&k, hex);
    snprintf(path, sizeof path, "%s/%s", cfg->path, hex);
    return count_entries(path);
}

void apc_disk_note_other_formats(const apc_disk_config *cfg, const apc_layout *lay, apc_hash_kind hash,
                                 kv_format own) {
    kv_format others[8 + 7 * 7 * 7];
    int n = other_formats(others, (int)(sizeof others / sizeof others[0]));
    uint64_t own_id = kv_format_id(own);
    for (int i = 0; i < n; i++) {
        kv_format other = others[i];
        /* every layout the format has had: a q8_0 or kvarn namespace an older
         * server wrote is as foreign as another format's */
        for (int layout = kv_format_layout(other); layout >= 1; layout--) {
            uint64_t id = kv_format_id_of_layout(other, layout);
            if (id == own_id) continue;
            apc_layout probe = *lay;
            probe.kv_format_id = id;
            long files = namespace_files(cfg, &probe, hash);
            if (files <= 0) continue;
            char layout_note[64] = "";
            if (layout != kv_format_layout(other))
                snprintf(layout_note, sizeof layout_note, " (its layout %d, from an older ember)", layout);
            ember_log(EMBER_LOG_INFO,
                      "APC disk: %s holds %ld cache files of this model written with kv_format=%s%s; this server "
                      "stores kv_format=%s in namespace of its own and adopts none of them",
                      cfg->path, files, kv_format_name(other), layout_note, kv_format_name(own));
        }
    }
    /* the same format under the other attention precisions */
    static const attention_precision precisions[] = {ATTENTION_F32, ATTENTION_BF16, ATTENTION_INT8};
    for (size_t i = 0; i < sizeof precisions / sizeof precisions[0]; i++) {
        if (precisions[i] == (attention_precision)lay->attention) continue;
        apc_layout probe = *lay;
        probe.attention = precisions[i];
        long files = namespace_files(cfg, &probe, hash);
        if (files > 0)
            ember_log(EMBER_LOG_INFO,
                      "APC disk: %s holds %ld cache files of this model written under attention precision %s; this "
                      "server runs %s attention, stores in a namespace of its own and adopts none of them",
                      cfg->path, files, attention_precision_name(precisions[i]),
                      attention_precision_name((attention_precision)lay->attention));
    }
}

/* Reads and checks one file's header; fills h (keys malloc'd). */
static int read_file_header(apc_disk *d, int fd, apc_disk_header *h, uint64_t *size, ember_error *err) {
    struct stat st;
    if (fstat(fd, &st) < 0) return ember_fail(err, "stat: %s", strerror(errno));
    *size = (uint64_t)st.st_size;
    apc_disk_src s;
    if (apc_disk_src_init(&s, fd, NULL, *size) < 0) return ember_fail(err, "out of memory");
    int rc = apc_disk_read_header(&s, &d->ex, h, err);
    apc_disk_src_free(&s);
    return rc;
}

/* Directory entries under dir (a cheap first pass, so the rebuild can say
 * how far along it is). */
static long count_entries(const char *dir_path) {
    DIR *dir = opendir(dir_path);
    if (dir == NULL) return 0;
    long n = 0;
    struct dirent *de;
    while ((de = readdir(dir)) != NULL)
        n += strcmp(de->d_name, ".") != 0 && strcmp(de->d_name, "..") != 0 && strcmp(de->d_name, APC_DISK_LOCK_NAME) != 0;
    closedir(dir);
    return n;
}

/* alone: no other tier has the directory open, so every temp file is a
 * dead writer's. */
static void scan(apc_disk *d, bool alone) {
    long total = count_entries(d->dir), seen = 0;
    if (total > 0) ember_log(EMBER_LOG_INFO, "APC disk: rebuilding the index of %s from %ld files", d->dir, total);
    DIR *dir = opendir(d->dir);
    if (dir == NULL) return;
    int n_temp = 0, n_unknown = 0, n_bad = 0, n_kept = 0;
    time_t now = time(NULL);
    struct dirent *de;
    char path[4096];
    double last_report = ember_now();
    while ((de = readdir(dir)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
        /* a large tier takes a while to read back: say so every second */
        if (++seen % 64 == 0 && ember_now() - last_report >= 1.0) {
            last_report = ember_now();
            ember_log(EMBER_LOG_INFO, "APC disk: index rebuild %ld of %ld files (%.0f%%), %.1f MiB indexed", seen,
                      total > seen ? total : seen, 100.0 * (double)seen / (double)(total > seen ? total : seen),
                      (double)d->bytes / (1024.0 * 1024.0));
        }
        snprintf(path, sizeof path, "%s/%s", d->dir, de->d_name);
        struct stat st;
        if (lstat(path, &st) < 0 || !S_ISREG(st.st_mode)) continue;
        uint32_t kind;
        apc_key name;
        if (!apc_disk_parse_name(de->d_name, &kind, &name)) {
            if (strcmp(de->d_name, APC_DISK_LOCK_NAME) == 0) continue;
            if (strncmp(de->d_name, ".tmp-", 5) == 0) {
                if (!alone && now - st.st_mtim.tv_sec < APC_DISK_TEMP_STALE_S) {
                    n_kept++; /* another live server's write in flight */
                    continue;
                }
                n_temp++;
            } else {
                n_unknown++;
            }
            unlink(path);
            continue;
        }
        int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        apc_disk_header h;
        uint64_t size = 0;
        ember_error err;
        bool ok = fd >= 0 && read_file_header(d, fd, &h, &size, &err) == 0;
        if (fd >= 0) close(fd);
        if (ok && (h.kind != kind || !apc_key_eq(&h.content, &name))) {
            apc_disk_header_free(&h);
            ok = false;
        }
        if (!ok) {
            n_bad++;
            unlink(path);
            continue;
        }
        uint64_t mt = (uint64_t)st.st_mtim.tv_sec * 1000000000ull + (uint64_t)st.st_mtim.tv_nsec;
        if (add_file(d, &h, size, mt) < 0) unlink(path);
        apc_disk_header_free(&h);
    }
    closedir(dir);
    uint64_t shards = 0, exact = 0, skels = 0, sides = 0;
    for (int32_t i = 0; i < d->n_files; i++)
        if (d->files[i].live) {
            if (d->files[i].kind == APC_DISK_KIND_SHARD) shards++;
            else if (d->files[i].kind == APC_DISK_KIND_SKEL) skels++;
            else if (d->files[i].kind == APC_DISK_KIND_SIDE) sides++;
            else exact++;
        }
    ember_log(EMBER_LOG_INFO,
              "APC disk tier at %s: found %llu shards (%llu blocks), %llu exact, %llu skeletons, %llu side, %.1f MiB; "
              "removed %d temp, %d unknown, %d bad%s",
              d->dir, (unsigned long long)shards, (unsigned long long)d->blocks_indexed, (unsigned long long)exact,
              (unsigned long long)skels, (unsigned long long)sides, (double)d->bytes / (1024.0 * 1024.0), n_temp,
              n_unknown, n_bad,
              alone ? "" : "; another server shares this directory, its temp files are kept");
    if (n_kept) ember_log(EMBER_LOG_DEBUG, "APC disk: kept %d temp files of the other servers", n_kept);
}

/* ---- Writers ---- */

static int write_all(int fd, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n > 0) {
        ssize_t w = write(fd, b, n > ((size_t)1 << 30) ? (size_t)1 << 30 : n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            if (w == 0) errno = EIO;
            return -1;
        }
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Writes one job's file. 0, or -1 with errno. */
static int write_job(apc_disk *d, job *j, uint64_t seq) {
    char tmp[4096], final[4096];
    snprintf(tmp, sizeof tmp, "%s/.tmp-%ld-%llu.apc", d->dir, (long)getpid(), (unsigned long long)seq);
    file_path(d, j->hdr.kind, &j->hdr.content, final, sizeof final);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno == ENOENT) {
        /* The directory vanished: recreate it, forget what it held. */
        pthread_mutex_lock(&d->lock);
        forget_all(d);
        pthread_mutex_unlock(&d->lock);
        ember_log(EMBER_LOG_WARN, "APC disk: %s vanished; recreated it", d->dir);
        if (mkdir_p(d->dir) < 0) return -1;
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    }
    if (fd < 0) return -1;
    XXH3_state_t *st = XXH3_createState();
    if (st == NULL) {
        close(fd);
        unlink(tmp);
        errno = ENOMEM;
        return -1;
    }
    XXH3_64bits_reset(st);
    XXH3_64bits_update(st, j->head, j->head_bytes);
    XXH3_64bits_update(st, j->payload, j->payload_bytes);
    if (j->state_bytes) XXH3_64bits_update(st, j->state, j->state_bytes);
    uint64_t sum = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    uint8_t trailer[8];
    for (int i = 0; i < 8; i++) trailer[i] = (uint8_t)(sum >> (8 * i));
    int rc = write_all(fd, j->head, j->head_bytes);
    if (rc == 0) rc = write_all(fd, j->payload, j->payload_bytes);
    if (rc == 0 && j->state_bytes) rc = write_all(fd, j->state, j->state_bytes);
    if (rc == 0) rc = write_all(fd, trailer, 8);
    if (rc == 0) rc = fsync(fd);
    int saved = errno;
    if (close(fd) < 0 && rc == 0) {
        rc = -1;
        saved = errno;
    }
    if (rc == 0 && rename(tmp, final) < 0) {
        rc = -1;
        saved = errno;
    }
    if (rc < 0) {
        unlink(tmp);
        errno = saved;
        return -1;
    }
    int dfd = open(d->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    return 0;
}

/* Under the lock: clears a job's pending marks that no file took. */
static void unmark(apc_disk *d, const job *j) {
    if (j->hdr.kind == APC_DISK_KIND_SHARD) {
        for (uint32_t i = 0; i < j->hdr.n_blocks; i++)
            if (km_get(&d->blocks, &j->hdr.keys[i]) == PENDING) km_del(&d->blocks, &j->hdr.keys[i]);
    } else if (km_get(&d->exact, &j->hdr.content) == PENDING) {
        km_del(&d->exact, &j->hdr.content);
    }
}

static void job_free(job *j) {
    if (j == NULL) return;
    apc_disk_header_free(&j->hdr);
    free(j->head);
    free(j->own);
    free(j->own_state);
    free(j);
}

static void *writer_main(void *arg) {
    apc_disk *d = arg;
    for (;;) {
        pthread_mutex_lock(&d->lock);
        while (d->head == NULL && !d->stop) pthread_cond_wait(&d->cv_work, &d->lock);
        if (d->head == NULL) {
            pthread_mutex_unlock(&d->lock);
            break;
        }
        job *j = d->head;
        d->head = j->next;
        if (d->head == NULL) d->tail = NULL;
        d->busy++;
        uint64_t seq = d->tmp_seq++;
        bool off = d->backoff_until > mono_ms();
        pthread_mutex_unlock(&d->lock);

        int rc = -1, e = 0;
        if (!off) {
            rc = write_job(d, j, seq);
            e = errno;
        }
        if (j->release) j->release(j->owner, j->entry);

        pthread_mutex_lock(&d->lock);
        if (rc == 0) {
            /* A file of that name may already be indexed (a store raced a
             * read that deleted it); the new one replaces it. */
            for (int32_t i = 0; i < d->n_files; i++)
                if (d->files[i].live && d->files[i].kind == j->hdr.kind && apc_key_eq(&d->files[i].name, &j->hdr.content))
                    drop_file(d, i, false);
            unmark(d, j);
            add_file(d, &j->hdr, j->head_bytes + j->payload_bytes + j->state_bytes + 8, now_ns());
            d->writes += j->hdr.kind == APC_DISK_KIND_SHARD ? j->hdr.n_blocks : 1;
            evict(d);
        } else {
            unmark(d, j);
            if (off) {
                d->write_drops++;
            } else {
                d->write_errors++;
                if (e == ENOSPC || e == EIO || e == EDQUOT) {
                    d->backoff_until = mono_ms() + (uint64_t)d->backoff_ms;
                    if (!d->backoff_warned)
                        ember_log(EMBER_LOG_WARN, "APC disk: write failed (%s); disk writes off for %d ms, memory tiers continue",
                                  strerror(e), d->backoff_ms);
                    d->backoff_warned = true;
                } else if (!d->error_warned) {
                    d->error_warned = true;
                    ember_log(EMBER_LOG_WARN, "APC disk: write to %s failed: %s (logged once)", d->dir, strerror(e));
                }
            }
        }
        if (rc == 0) d->backoff_warned = false;
        d->q_jobs--;
        d->q_bytes -= j->reserved;
        d->busy--;
        pthread_cond_broadcast(&d->cv_space);
        pthread_cond_broadcast(&d->cv_idle);
        pthread_mutex_unlock(&d->lock);
        job_free(j);
    }
    return NULL;
}

/* Under the lock: waits up to ENQUEUE_WAIT_MS for room for one job of
 * bytes; reserves it. false: the write is to be dropped. */
static bool reserve(apc_disk *d, size_t bytes) {
    if (d->backoff_until > mono_ms() || d->stop) return false;
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_nsec += ENQUEUE_WAIT_MS * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    while (d->q_jobs >= d->queue_jobs || (d->q_bytes > 0 && d->q_bytes + bytes > d->queue_bytes)) {
        if (pthread_cond_timedwait(&d->cv_space, &d->lock, &dl) != 0) break;
    }
    if (d->q_jobs >= d->queue_jobs || (d->q_bytes > 0 && d->q_bytes + bytes > d->queue_bytes)) return false;
    d->q_jobs++;
    d->q_bytes += bytes;
    return true;
}

static void unreserve(apc_disk *d, size_t bytes) {
    d->q_jobs--;
    d->q_bytes -= bytes;
    pthread_cond_broadcast(&d->cv_space);
    pthread_cond_broadcast(&d->cv_idle);
}

static void push(apc_disk *d, job *j) {
    j->next = NULL;
    if (d->tail) d->tail->next = j;
    else d->head = j;
    d->tail = j;
    pthread_cond_signal(&d->cv_work);
}

/* ---- Lifetime ---- */

apc_disk *apc_disk_open(const apc_disk_config *cfg, const apc_layout *lay, apc_hash_kind hash, kv_pool *pool,
                        ember_error *err) {
    apc_disk *d = calloc(1, sizeof *d);
    if (d == NULL) {
        ember_fail(err, "out of memory");
        return NULL;
    }
    d->lock_fd = -1;
    pthread_mutex_init(&d->lock, NULL);
    pthread_cond_init(&d->cv_work, NULL);
    pthread_cond_init(&d->cv_space, NULL);
    pthread_cond_init(&d->cv_idle, NULL);
    apc_disk_namespace(cfg, lay, hash, d->ns);
    apc_key nk;
    memcpy(nk.b, d->ns, 16);
    apc_disk_key_hex(&nk, d->ns_hex);
    d->lay = lay;
    memcpy(d->ex.ns, d->ns, 16);
    d->ex.hash = hash;
    d->ex.layout = lay;
    d->pool = pool;
    d->mode = cfg->read_mode;
    d->read_hook = cfg->read_hook;
    d->read_hook_user = cfg->read_hook_user;
    d->max_bytes = cfg->max_bytes;
    d->queue_jobs = cfg->queue_jobs > 0 ? cfg->queue_jobs : 64;
    d->queue_bytes = cfg->queue_bytes > 0 ? cfg->queue_bytes : (size_t)1 << 30;
    d->backoff_ms = cfg->backoff_ms > 0 ? cfg->backoff_ms : 30000;
    size_t len = strlen(cfg->path) + 1 + 32 + 1;
    d->dir = malloc(len);
    if (d->dir == NULL || km_init(&d->blocks, 1024) < 0 || km_init(&d->exact, 64) < 0) {
        ember_fail(err, "out of memory");
        goto fail;
    }
    snprintf(d->dir, len, "%s/%s", cfg->path, d->ns_hex);
    if (mkdir_p(d->dir) < 0) {
        ember_fail(err, "cannot create %s: %s", d->dir, strerror(errno));
        goto fail;
    }
    {
        /* Creating the lock file is also the check that the directory
         * takes writes, before any request relies on it. */
        char lock_path[4096];
        snprintf(lock_path, sizeof lock_path, "%s/" APC_DISK_LOCK_NAME, d->dir);
        d->lock_fd = open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
        if (d->lock_fd < 0) {
            ember_fail(err, "cannot write in %s: %s", d->dir, strerror(errno));
            goto fail;
        }
        bool alone = flock(d->lock_fd, LOCK_EX | LOCK_NB) == 0;
        scan(d, alone);
        /* Shared from here on (no writer runs yet, so the moment between
         * the two locks exposes no temp file of ours). */
        while (flock(d->lock_fd, LOCK_SH) < 0 && errno == EINTR) {
        }
    }
    evict(d);
    d->n_threads = cfg->workers > 0 ? cfg->workers : 1;
    d->threads = calloc((size_t)d->n_threads, sizeof *d->threads);
    if (d->threads == NULL) {
        ember_fail(err, "out of memory");
        goto fail;
    }
    for (int i = 0; i < d->n_threads; i++)
        if (pthread_create(&d->threads[i], NULL, writer_main, d) != 0) {
            d->n_threads = i;
            ember_fail(err, "cannot start a disk writer thread");
            goto fail;
        }
    return d;
fail:
    apc_disk_close(d);
    return NULL;
}

void apc_disk_close(apc_disk *d) {
    if (d == NULL) return;
    pthread_mutex_lock(&d->lock);
    d->stop = true;
    pthread_cond_broadcast(&d->cv_work);
    pthread_mutex_unlock(&d->lock);
    for (int i = 0; i < d->n_threads; i++) pthread_join(d->threads[i], NULL);
    free(d->threads);
    for (int32_t i = 0; i < d->n_files; i++) free(d->files[i].keys);
    free(d->files);
    free(d->blocks.s);
    free(d->exact.s);
    free(d->dir);
    if (d->lock_fd >= 0) close(d->lock_fd); /* releases the flock */
    pthread_mutex_destroy(&d->lock);
    pthread_cond_destroy(&d->cv_work);
    pthread_cond_destroy(&d->cv_space);
    pthread_cond_destroy(&d->cv_idle);
    free(d);
}

void apc_disk_flush(apc_disk *d) {
    pthread_mutex_lock(&d->lock);
    while (d->q_jobs > 0 || d->busy > 0) pthread_cond_wait(&d->cv_idle, &d->lock);
    pthread_mutex_unlock(&d->lock);
}

void apc_disk_get_stats(apc_disk *d, apc_disk_stats *s) {
    pthread_mutex_lock(&d->lock);
    s->hits = d->hits;
    s->writes = d->writes;
    s->bytes = d->bytes;
    s->max_bytes = d->max_bytes;
    s->evictions = d->evictions;
    s->files = d->live_files;
    s->blocks_indexed = d->blocks_indexed;
    s->exact_indexed = d->exact_indexed;
    s->skeletons_indexed = d->skels_indexed;
    s->skeleton_writes = d->skel_writes;
    s->write_drops = d->write_drops;
    s->write_errors = d->write_errors;
    s->corrupt = d->corrupt;
    s->read_errors = d->read_errors;
    memcpy(s->ns_hex, d->ns_hex, sizeof s->ns_hex);
    pthread_mutex_unlock(&d->lock);
}

void apc_disk_reset_counters(apc_disk *d) {
    pthread_mutex_lock(&d->lock);
    d->hits = d->writes = d->evictions = d->write_drops = d->write_errors = d->corrupt = d->skel_writes = d->read_errors = 0;
    pthread_mutex_unlock(&d->lock);
}

/* ---- Block tier ---- */

int64_t apc_disk_chain_count(apc_disk *d, const apc_key *keys, int64_t start, int64_t n_keys) {
    int64_t count = 0;
    uint64_t t = now_ns();
    pthread_mutex_lock(&d->lock);
    for (int64_t i = 0; i < n_keys; i++) {
        int64_t v = km_get(&d->blocks, &keys[i]);
        if (v < 0) {
            if (i >= start) break;
            continue;
        }
        if (i >= start) count++;
        touch(d, (int32_t)(v >> 16), t);
    }
    pthread_mutex_unlock(&d->lock);
    return count;
}

bool apc_disk_has_block(apc_disk *d, const apc_key *key) {
    pthread_mutex_lock(&d->lock);
    bool has = km_get(&d->blocks, key) >= 0;
    pthread_mutex_unlock(&d->lock);
    return has;
}

/* Opens a file for reading in the configured mode. */
typedef struct open_file {
    int fd;
    void *map;
    uint64_t size;
    apc_disk_src src;
} open_file;

/* Never blocks on what is not a regular file: O_NONBLOCK makes opening a
 * FIFO return at once (a FIFO or device would otherwise hang the reader),
 * O_NOFOLLOW refuses a symlink, and fstat refuses anything but a regular
 * file (errno EFTYPE_REFUSED, and the caller counts and removes it). The
 * test hook (apc_disk_config.read_hook) runs first and can delay or fail
 * the read like a slow or dying disk. */
#define EFTYPE_REFUSED EMEDIUMTYPE
static int open_for_read(apc_disk *d, const char *path, open_file *of) {
    memset(of, 0, sizeof *of);
    of->fd = -1;
    if (d->read_hook && d->read_hook(d->read_hook_user, path) < 0) {
        errno = EIO; /* read_failed counts it */
        return -1;
    }
    of->fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (of->fd < 0) {
        if (errno == ELOOP) errno = EFTYPE_REFUSED;
        return -1;
    }
    struct stat st;
    if (fstat(of->fd, &st) < 0) {
        close(of->fd);
        return -1;
    }
    if (!S_ISREG(st.st_mode)) {
        close(of->fd);
        errno = EFTYPE_REFUSED;
        return -1;
    }
    of->size = (uint64_t)st.st_size;
    if (d->mode == APC_DISK_READ_MMAP && of->size > 0) {
        of->map = mmap(NULL, (size_t)of->size, PROT_READ, MAP_PRIVATE, of->fd, 0);
        if (of->map == MAP_FAILED) of->map = NULL;
        else madvise(of->map, (size_t)of->size, MADV_SEQUENTIAL | MADV_WILLNEED);
    }
    if (apc_disk_src_init(&of->src, of->map ? -1 : of->fd, of->map, of->size) < 0) {
        if (of->map) munmap(of->map, (size_t)of->size);
        close(of->fd);
        return -1;
    }
    if (of->map == NULL && of->size > 0) {
        posix_fadvise(of->fd, 0, 0, POSIX_FADV_SEQUENTIAL);
        posix_fadvise(of->fd, 0, 0, POSIX_FADV_WILLNEED);
    }
    return 0;
}

static void close_read(open_file *of, bool touch_mtime) {
    if (touch_mtime) futimens(of->fd, NULL);
    apc_disk_src_free(&of->src);
    if (of->map) munmap(of->map, (size_t)of->size);
    close(of->fd);
}

/* Under no lock: the file failed verification. */
static void corrupt_file(apc_disk *d, uint32_t kind, const apc_key *name, const char *why) {
    pthread_mutex_lock(&d->lock);
    d->corrupt++;
    bool found = false;
    for (int32_t i = 0; i < d->n_files; i++)
        if (d->files[i].live && d->files[i].kind == kind && apc_key_eq(&d->files[i].name, name)) {
            drop_file(d, i, true);
            found = true;
        }
    pthread_mutex_unlock(&d->lock);
    if (!found) {
        char path[4096];
        file_path(d, kind, name, path, sizeof path);
        unlink(path);
    }
    char hex[33];
    apc_disk_key_hex(name, hex);
    ember_log(EMBER_LOG_WARN, "APC disk: %c-%s.apc is corrupt (%s); deleted, counted as a miss",
              kind_char(kind), hex, why);
}

static void vanished(apc_disk *d, uint32_t kind, const apc_key *name) {
    pthread_mutex_lock(&d->lock);
    for (int32_t i = 0; i < d->n_files; i++)
        if (d->files[i].live && d->files[i].kind == kind && apc_key_eq(&d->files[i].name, name)) drop_file(d, i, false);
    pthread_mutex_unlock(&d->lock);
}

/* open_for_read failed: a file that is gone is forgotten, one that is not
 * a regular file is refused like a corrupt one; any other error (EACCES,
 * EIO, a hook's injected failure) is a miss that leaves the file alone (the
 * operator may fix it), counted in read_errors and logged the first time,
 * so a tier that silently stopped serving shows up. */
static void read_failed(apc_disk *d, uint32_t kind, const apc_key *name) {
    int e = errno;
    if (e == ENOENT) {
        vanished(d, kind, name);
        return;
    }
    if (e == EFTYPE_REFUSED) {
        corrupt_file(d, kind, name, "not a regular file");
        return;
    }
    pthread_mutex_lock(&d->lock);
    bool first = !d->read_error_warned;
    d->read_error_warned = true;
    d->read_errors++;
    pthread_mutex_unlock(&d->lock);
    if (first) {
        char path[4096];
        file_path(d, kind, name, path, sizeof path);
        ember_log(EMBER_LOG_WARN, "APC disk: cannot read %s: %s; counted as a miss (disk_read_errors), logged once",
                  path, strerror(e));
    }
}

typedef struct block_dst {
    kv_pool *pool;
    const apc_disk_want *want; /* want[0] is piece first */
    uint32_t first, count;
} block_dst;

static float *block_dst_fn(void *user, int layer, int kv, uint32_t piece) {
    block_dst *b = user;
    if (piece < b->first || piece >= b->first + b->count) return NULL;
    int32_t blk = b->want[piece - b->first].dst;
    return kv == 0 ? kv_block_k(b->pool, blk, layer) : kv_block_v(b->pool, blk, layer);
}

int64_t apc_disk_load_blocks(apc_disk *d, const apc_key *parent, uint64_t salt, const apc_disk_want *want,
                             int64_t n_want) {
    int64_t i = 0;
    char path[4096];
    /* Start reading every file of the chain now: the kernel fetches the
     * later files while the first ones are verified and copied. */
    int32_t last = -1;
    for (int64_t k = 0; k < n_want; k++) {
        pthread_mutex_lock(&d->lock);
        int64_t v = km_get(&d->blocks, &want[k].key);
        file_rec rec;
        if (v >= 0) rec = d->files[v >> 16];
        pthread_mutex_unlock(&d->lock);
        if (v < 0) break;
        if ((int32_t)(v >> 16) == last) continue;
        last = (int32_t)(v >> 16);
        file_path(d, rec.kind, &rec.name, path, sizeof path);
        int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
        struct stat st;
        if (fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) posix_fadvise(fd, 0, 0, POSIX_FADV_WILLNEED);
        if (fd >= 0) close(fd);
    }
    while (i < n_want) {
        pthread_mutex_lock(&d->lock);
        int64_t v = km_get(&d->blocks, &want[i].key);
        if (v < 0) {
            pthread_mutex_unlock(&d->lock);
            break;
        }
        file_rec rec = d->files[v >> 16];
        uint32_t idx = (uint32_t)(v & 0xffff);
        pthread_mutex_unlock(&d->lock);
        file_path(d, rec.kind, &rec.name, path, sizeof path);
        open_file of;
        if (open_for_read(d, path, &of) < 0) {
            read_failed(d, rec.kind, &rec.name);
            break;
        }
        apc_disk_header h;
        ember_error err;
        if (apc_disk_read_header(&of.src, &d->ex, &h, &err) < 0) {
            close_read(&of, false);
            corrupt_file(d, rec.kind, &rec.name, err.msg);
            break;
        }
        /* The run of wanted blocks that this file holds from idx on. */
        uint32_t run = 0;
        const apc_key *expect_parent = i > 0 ? &want[i - 1].key : parent;
        const apc_key *file_parent = idx > 0 && idx < h.n_blocks ? &h.keys[idx - 1] : &h.parent;
        if (h.kind == APC_DISK_KIND_SHARD && h.salt == salt && idx < h.n_blocks &&
            apc_key_eq(file_parent, expect_parent) && apc_key_eq(&h.content, &rec.name)) {
            while (idx + run < h.n_blocks && i + run < n_want && apc_key_eq(&h.keys[idx + run], &want[i + run].key)) {
                int rows = idx + run + 1 < h.n_blocks ? KV_BLOCK_TOKENS : (int)h.last_rows;
                if (rows != want[i + run].rows) break;
                run++;
            }
        }
        if (run == 0) {
            apc_disk_header_free(&h);
            close_read(&of, false);
            break;
        }
        int32_t *tok = malloc((size_t)h.n_tokens * sizeof(int32_t));
        bool oom = tok == NULL;
        block_dst bd = {d->pool, want + i, idx, run};
        int rc = tok ? apc_disk_read_body(&of.src, &d->ex, &h, tok, block_dst_fn, &bd, &err) : -1;
        bool tokens_ok = rc == 0;
        for (uint32_t r = 0; tokens_ok && r < run; r++)
            tokens_ok = memcmp(tok + (size_t)(idx + r) * KV_BLOCK_TOKENS, want[i + r].tokens,
                               (size_t)want[i + r].rows * sizeof(int32_t)) == 0;
        free(tok);
        apc_disk_header_free(&h);
        close_read(&of, rc == 0);
        if (rc < 0) {
            if (!oom) corrupt_file(d, rec.kind, &rec.name, err.msg);
            break;
        }
        if (!tokens_ok) break; /* a key collision: not ours */
        pthread_mutex_lock(&d->lock);
        d->hits += run;
        touch(d, (int32_t)(v >> 16), now_ns());
        pthread_mutex_unlock(&d->lock);
        i += run;
    }
    return i;
}

void apc_disk_store_chain(apc_disk *d, const apc_key *keys, int64_t n_full, int tail_rows, const int32_t *tokens,
                          uint64_t salt, const kv_seq *seq) {
    int64_t total = n_full + (tail_rows > 0 ? 1 : 0);
    if (total == 0) return;
    pthread_mutex_lock(&d->lock);
    int64_t i0 = 0;
    uint64_t t = now_ns();
    for (; i0 < total; i0++) {
        int64_t v = km_get(&d->blocks, &keys[i0]);
        if (v == ABSENT) break;
        if (v >= 0) touch(d, (int32_t)(v >> 16), t);
    }
    pthread_mutex_unlock(&d->lock);
    const apc_layout *lay = d->lay;
    static const apc_key zero;
    for (int64_t s = i0; s < total;) {
        int64_t e = (s / APC_DISK_SEGMENT_BLOCKS + 1) * APC_DISK_SEGMENT_BLOCKS;
        if (e > total) e = total;
        uint32_t nb = (uint32_t)(e - s);
        int last_rows = e == total && tail_rows > 0 ? tail_rows : KV_BLOCK_TOKENS;
        uint64_t nt = (uint64_t)KV_BLOCK_TOKENS * (nb - 1) + (uint64_t)last_rows;
        size_t payload = (size_t)nt * lay->row_floats * sizeof(float);
        size_t head_bytes = APC_DISK_HEADER_BYTES + 16 * (size_t)nb + 4 * (size_t)nt;
        pthread_mutex_lock(&d->lock);
        bool ok = reserve(d, payload + head_bytes);
        if (ok) {
            for (int64_t k = s; k < e; k++)
                if (km_get(&d->blocks, &keys[k]) == ABSENT) km_put(&d->blocks, &keys[k], PENDING);
        } else {
            d->write_drops++;
        }
        pthread_mutex_unlock(&d->lock);
        if (!ok) return; /* later segments would have no parent on disk */
        job *j = calloc(1, sizeof *j);
        if (j) {
            j->head = malloc(head_bytes);
            j->own = malloc(payload + 1);
            j->hdr.keys = malloc((size_t)nb * sizeof(apc_key));
        }
        if (j == NULL || j->head == NULL || j->own == NULL || j->hdr.keys == NULL) {
            pthread_mutex_lock(&d->lock);
            if (j) {
                j->hdr.kind = APC_DISK_KIND_SHARD;
                j->hdr.n_blocks = j->hdr.keys ? nb : 0;
                if (j->hdr.keys) memcpy(j->hdr.keys, keys + s, (size_t)nb * sizeof(apc_key));
                unmark(d, j);
            }
            unreserve(d, payload + head_bytes);
            d->write_drops++;
            pthread_mutex_unlock(&d->lock);
            job_free(j);
            return;
        }
        j->reserved = payload + head_bytes;
        j->hdr.kind = APC_DISK_KIND_SHARD;
        j->hdr.salt = salt;
        j->hdr.content = keys[e - 1];
        j->hdr.parent = s > 0 ? keys[s - 1] : zero;
        j->hdr.first_block = (uint32_t)s;
        j->hdr.n_blocks = nb;
        j->hdr.last_rows = (uint32_t)last_rows;
        j->hdr.n_tokens = nt;
        j->hdr.created_ns = t;
        memcpy(j->hdr.keys, keys + s, (size_t)nb * sizeof(apc_key));
        apc_disk_write_header(j->head, d->ns, &j->hdr, lay);
        uint8_t *tp = j->head + APC_DISK_HEADER_BYTES + 16 * (size_t)nb;
        for (uint64_t r = 0; r < nt; r++) {
            uint32_t tv = (uint32_t)tokens[(size_t)s * KV_BLOCK_TOKENS + r];
            for (int b = 0; b < 4; b++) tp[4 * r + (uint64_t)b] = (uint8_t)(tv >> (8 * b));
        }
        /* Rows, layer by layer: K of every block, then V. */
        float *p = j->own;
        for (int l = 0; l < lay->n_layer; l++)
            for (int kv = 0; kv < 2; kv++) {
                int w = kv == 0 ? lay->k_width[l] : lay->v_width[l];
                if (w == 0) continue;
                for (int64_t k = s; k < e; k++) {
                    int rows = k + 1 < e ? KV_BLOCK_TOKENS : last_rows;
                    int32_t b = seq->blocks[k];
                    const float *src = kv == 0 ? kv_block_k(d->pool, b, l) : kv_block_v(d->pool, b, l);
                    memcpy(p, src, (size_t)rows * (size_t)w * sizeof(float));
                    p += (size_t)rows * (size_t)w;
                }
            }
        j->head_bytes = head_bytes;
        j->payload = j->own;
        j->payload_bytes = payload;
        pthread_mutex_lock(&d->lock);
        push(d, j);
        pthread_mutex_unlock(&d->lock);
        s = e;
    }
}

/* ---- Exact tier ---- */

bool apc_disk_has_exact(apc_disk *d, const apc_key *exact_key) {
    pthread_mutex_lock(&d->lock);
    bool has = km_get(&d->exact, exact_key) != ABSENT;
    pthread_mutex_unlock(&d->lock);
    return has;
}

int apc_disk_store_exact(apc_disk *d, apc_exact_entry *e, apc_disk_release_fn release, void *owner) {
    apc_key key = apc_disk_exact_key(e->salt, e->tokens, e->n);
    size_t payload = (size_t)e->n * d->lay->row_floats * sizeof(float);
    size_t head_bytes = APC_DISK_HEADER_BYTES + 4 * (size_t)e->n;
    size_t sb = d->lay->state_bytes;
    if ((sb && (e->state == NULL || e->state_bytes != sb)) || (!sb && e->state)) return -1;
    payload += sb; /* for the queue's reservation */
    pthread_mutex_lock(&d->lock);
    int64_t v = km_get(&d->exact, &key);
    if (v != ABSENT) {
        if (v >= 0) touch(d, (int32_t)v, now_ns());
        pthread_mutex_unlock(&d->lock);
        return -1;
    }
    if (!reserve(d, payload + head_bytes)) {
        d->write_drops++;
        pthread_mutex_unlock(&d->lock);
        return -1;
    }
    km_put(&d->exact, &key, PENDING);
    pthread_mutex_unlock(&d->lock);
    job *j = calloc(1, sizeof *j);
    if (j) j->head = malloc(head_bytes);
    if (j == NULL || j->head == NULL) {
        pthread_mutex_lock(&d->lock);
        if (km_get(&d->exact, &key) == PENDING) km_del(&d->exact, &key);
        unreserve(d, payload + head_bytes);
        d->write_drops++;
        pthread_mutex_unlock(&d->lock);
        job_free(j);
        return -1;
    }
    j->reserved = payload + head_bytes;
    j->hdr.kind = APC_DISK_KIND_EXACT;
    j->hdr.salt = e->salt;
    j->hdr.content = key;
    j->hdr.n_tokens = (uint64_t)e->n;
    j->hdr.created_ns = now_ns();
    j->hdr.state_bytes = sb;
    apc_disk_write_header(j->head, d->ns, &j->hdr, d->lay);
    uint8_t *tp = j->head + APC_DISK_HEADER_BYTES;
    for (int64_t r = 0; r < e->n; r++)
        for (int b = 0; b < 4; b++) tp[4 * r + b] = (uint8_t)((uint32_t)e->tokens[r] >> (8 * b));
    j->head_bytes = head_bytes;
    j->payload = e->data;
    j->payload_bytes = payload - sb;
    j->state = e->state;
    j->state_bytes = sb;
    j->entry = e;
    j->release = release;
    j->owner = owner;
    pthread_mutex_lock(&d->lock);
    push(d, j);
    pthread_mutex_unlock(&d->lock);
    return 0;
}

float *apc_disk_exact_dst_fn(void *user, int layer, int kv, uint32_t piece) {
    apc_disk_exact_dst *x = user;
    (void)piece;
    if (layer < 0) return x->state;
    size_t off = 0;
    for (int l = 0; l < layer; l++) off += (size_t)(x->lay->k_width[l] + x->lay->v_width[l]) * (size_t)x->n;
    if (kv == 1) off += (size_t)x->lay->k_width[layer] * (size_t)x->n;
    return x->data + off;
}

typedef struct cand {
    apc_key name;
    int64_t n;
    int kind; /* the file's first_block: for skeletons, the checkpoint kind */
} cand;

static int cand_cmp(const void *a, const void *b) {
    const cand *x = a, *y = b;
    return x->n < y->n ? 1 : x->n > y->n ? -1 : 0;
}

/* The live files of one kind under salt whose length n has lo <= n <= hi,
 * longest first (malloc'd; *nc their count), or NULL when out of memory. A
 * reader tries them in order, so the longest usable file wins. */
static cand *list_candidates(apc_disk *d, uint32_t kind, uint64_t salt, int64_t lo, int64_t hi, int *nc) {
    pthread_mutex_lock(&d->lock);
    cand *c = malloc((size_t)(d->n_files ? d->n_files : 1) * sizeof *c);
    *nc = 0;
    for (int32_t i = 0; c && i < d->n_files; i++) {
        const file_rec *r = &d->files[i];
        if (!r->live || r->kind != kind || r->salt != salt) continue;
        if ((int64_t)r->n_tokens < lo || (int64_t)r->n_tokens > hi) continue;
        c[*nc].name = r->name;
        c[*nc].n = (int64_t)r->n_tokens;
        c[*nc].kind = (int)r->first_block;
        (*nc)++;
    }
    pthread_mutex_unlock(&d->lock);
    if (c) qsort(c, (size_t)*nc, sizeof *c, cand_cmp);
    return c;
}

apc_exact_entry *apc_disk_load_exact(apc_disk *d, const int32_t *tokens, int64_t max_len, int64_t min_len,
                                     uint64_t salt, size_t max_bytes) {
    int nc;
    cand *c = list_candidates(d, APC_DISK_KIND_EXACT, salt, min_len + 1, max_len, &nc);
    if (c == NULL) return NULL;
    apc_exact_entry *got = NULL;
    char path[4096];
    for (int k = 0; k < nc && got == NULL; k++) {
        if (apc_snapshot_bytes(d->lay, c[k].n) + d->lay->state_bytes > max_bytes) continue;
        apc_key want = apc_disk_exact_key(salt, tokens, c[k].n);
        if (!apc_key_eq(&want, &c[k].name)) continue;
        file_path(d, APC_DISK_KIND_EXACT, &c[k].name, path, sizeof path);
        open_file of;
        if (open_for_read(d, path, &of) < 0) {
            read_failed(d, APC_DISK_KIND_EXACT, &c[k].name);
            continue;
        }
        apc_disk_header h;
        ember_error err;
        apc_exact_entry *e = NULL;
        int32_t *tok = NULL;
        int rc = apc_disk_read_header(&of.src, &d->ex, &h, &err);
        if (rc == 0) {
            if (h.kind != APC_DISK_KIND_EXACT || (int64_t)h.n_tokens != c[k].n || h.salt != salt ||
                !apc_key_eq(&h.content, &c[k].name)) {
                rc = -1;
                snprintf(err.msg, sizeof err.msg, "header does not match its name");
            }
        }
        if (rc == 0) {
            e = apc_exact_entry_new(d->lay, tokens, c[k].n, salt);
            tok = malloc((size_t)c[k].n * sizeof(int32_t));
            size_t sb = d->lay->state_bytes;
            if (e && sb) {
                e->state = malloc(sb);
                e->state_bytes = sb;
                e->bytes += sb;
            }
            if (e == NULL || tok == NULL || (sb && e->state == NULL)) {
                apc_exact_entry_free(e);
                free(tok);
                apc_disk_header_free(&h);
                close_read(&of, false);
                break; /* out of memory: not the file's fault */
            }
            apc_disk_exact_dst x = {d->lay, e->data, c[k].n, e->state};
            rc = apc_disk_read_body(&of.src, &d->ex, &h, tok, apc_disk_exact_dst_fn, &x, &err);
            apc_disk_header_free(&h);
        }
        close_read(&of, rc == 0);
        if (rc < 0) {
            apc_exact_entry_free(e);
            free(tok);
            corrupt_file(d, APC_DISK_KIND_EXACT, &c[k].name, err.msg);
            continue;
        }
        bool same = memcmp(tok, tokens, (size_t)c[k].n * sizeof(int32_t)) == 0;
        free(tok);
        if (!same) {
            apc_exact_entry_free(e);
            continue;
        }
        got = e;
        pthread_mutex_lock(&d->lock);
        d->hits++;
        int64_t v = km_get(&d->exact, &c[k].name);
        if (v >= 0) touch(d, (int32_t)v, now_ns());
        pthread_mutex_unlock(&d->lock);
    }
    free(c);
    return got;
}

/* ---- Side entries (a drafter's sidecar) ---- */

int apc_disk_store_side(apc_disk *d, uint64_t salt, const apc_side_owner *owner, const int32_t *tokens, int64_t n,
                        const uint32_t *rows, size_t words, const void *state) {
    size_t sb = owner ? owner->state_bytes : 0;
    if (n < 1 || words < 1 || sb > APC_DISK_SIDE_MAX_STATE || (sb && state == NULL)) return -1;
    int width[1];
    apc_layout lay = apc_disk_side_layout(width, words, sb);
    apc_key key = apc_disk_side_key(salt, tokens, n);
    size_t payload = (size_t)n * words * sizeof(float);
    size_t head_bytes = APC_DISK_HEADER_BYTES + 4 * (size_t)n;
    pthread_mutex_lock(&d->lock);
    int64_t v = km_get(&d->exact, &key);
    if (v != ABSENT) {
        if (v >= 0) touch(d, (int32_t)v, now_ns());
        pthread_mutex_unlock(&d->lock);
        return -1;
    }
    if (!reserve(d, payload + sb + head_bytes)) {
        d->write_drops++;
        pthread_mutex_unlock(&d->lock);
        return -1;
    }
    km_put(&d->exact, &key, PENDING);
    pthread_mutex_unlock(&d->lock);
    job *j = calloc(1, sizeof *j);
    if (j) {
        j->head = malloc(head_bytes);
        j->own = malloc(payload);
        if (sb) j->own_state = malloc(sb);
    }
    if (j == NULL || j->head == NULL || j->own == NULL || (sb && j->own_state == NULL)) {
        pthread_mutex_lock(&d->lock);
        if (km_get(&d->exact, &key) == PENDING) km_del(&d->exact, &key);
        unreserve(d, payload + sb + head_bytes);
        d->write_drops++;
        pthread_mutex_unlock(&d->lock);
        job_free(j);
        return -1;
    }
    memcpy(j->own, rows, payload);
    j->reserved = payload + sb + head_bytes;
    j->hdr.kind = APC_DISK_KIND_SIDE;
    j->hdr.salt = salt;
    j->hdr.content = key;
    if (owner) memcpy(j->hdr.parent.b, owner->ns, 16);
    j->hdr.n_tokens = (uint64_t)n;
    j->hdr.created_ns = now_ns();
    j->hdr.state_bytes = sb;
    apc_disk_write_header(j->head, d->ns, &j->hdr, &lay);
    uint8_t *tp = j->head + APC_DISK_HEADER_BYTES;
    for (int64_t r = 0; r < n; r++) apc_put_u32(tp + 4 * r, (uint32_t)tokens[r]);
    j->head_bytes = head_bytes;
    j->payload = j->own;
    j->payload_bytes = payload;
    if (sb) {
        memcpy(j->own_state, state, sb);
        j->state = j->own_state;
        j->state_bytes = sb;
    }
    pthread_mutex_lock(&d->lock);
    push(d, j);
    pthread_mutex_unlock(&d->lock);
    return 0;
}

/* Logs a side file that is sound but not this drafter's (another owner,
 * row width or state size under the same salt and tokens: a forgery or a
 * hash collision, never a store of this drafter): refused, left alone. */
static void side_refused(apc_disk *d, const apc_key *name, const char *why) {
    char hex[33];
    apc_disk_key_hex(name, hex);
    ember_log(EMBER_LOG_WARN, "APC disk: s-%s.apc in %s refused: %s; counted as a miss", hex, d->dir, why);
}

uint32_t *apc_disk_load_side(apc_disk *d, uint64_t salt, const apc_side_owner *owner, const int32_t *tokens,
                             int64_t p, int64_t n, size_t words, void **state_out, int64_t *n_out) {
    static const apc_side_owner none;
    if (owner == NULL) owner = &none;
    size_t sb = owner->state_bytes;
    if (state_out) *state_out = NULL;
    if ((sb && state_out == NULL) || sb > APC_DISK_SIDE_MAX_STATE) return NULL;
    int nc;
    cand *c = list_candidates(d, APC_DISK_KIND_SIDE, salt, p, n, &nc);
    if (c == NULL) return NULL;
    int width[1];
    apc_layout lay = apc_disk_side_layout(width, words, sb);
    apc_disk_expect ex = d->ex;
    ex.layout = &lay;
    uint32_t *got = NULL;
    char path[4096];
    for (int k = 0; k < nc && got == NULL; k++) {
        apc_key want = apc_disk_side_key(salt, tokens, c[k].n);
        if (!apc_key_eq(&want, &c[k].name)) continue;
        file_path(d, APC_DISK_KIND_SIDE, &c[k].name, path, sizeof path);
        open_file of;
        if (open_for_read(d, path, &of) < 0) {
            read_failed(d, APC_DISK_KIND_SIDE, &c[k].name);
            continue;
        }
        apc_disk_header h;
        ember_error err;
        int rc = apc_disk_read_header(&of.src, &ex, &h, &err);
        if (rc == 0 && (h.kind != APC_DISK_KIND_SIDE || (int64_t)h.n_tokens != c[k].n || h.salt != salt ||
                        !apc_key_eq(&h.content, &c[k].name))) {
            apc_disk_header_free(&h);
            rc = -1;
            snprintf(err.msg, sizeof err.msg, "header does not match its name");
        }
        const char *foreign = NULL;
        if (rc == 0 && memcmp(h.parent.b, owner->ns, 16) != 0) foreign = "written by another drafter (owner namespace)";
        else if (rc == 0 && h.row_floats != words) foreign = "rows of another width";
        else if (rc == 0 && h.state_bytes != sb) foreign = "a state of another size";
        if (foreign) {
            char why[160];
            snprintf(why, sizeof why, "%s: %llu words a row and %llu state bytes, this drafter reads %zu and %zu",
                     foreign, (unsigned long long)h.row_floats, (unsigned long long)h.state_bytes, words, sb);
            apc_disk_header_free(&h);
            close_read(&of, false);
            side_refused(d, &c[k].name, why);
            continue;
        }
        uint32_t *rows = NULL;
        int32_t *tok = NULL;
        void *state = NULL;
        if (rc == 0) {
            rows = malloc((size_t)c[k].n * words * sizeof(uint32_t));
            tok = malloc((size_t)c[k].n * sizeof(int32_t));
            if (sb) state = malloc(sb);
            if (rows == NULL || tok == NULL || (sb && state == NULL)) {
                free(rows);
                free(tok);
                free(state);
                apc_disk_header_free(&h);
                close_read(&of, false);
                break;
            }
            apc_disk_exact_dst x = {&lay, (float *)rows, c[k].n, state};
            rc = apc_disk_read_body(&of.src, &ex, &h, tok, apc_disk_exact_dst_fn, &x, &err);
            apc_disk_header_free(&h);
        }
        close_read(&of, rc == 0);
        if (rc < 0) {
            free(rows);
            free(tok);
            free(state);
            corrupt_file(d, APC_DISK_KIND_SIDE, &c[k].name, err.msg);
            continue;
        }
        bool same = memcmp(tok, tokens, (size_t)c[k].n * sizeof(int32_t)) == 0;
        free(tok);
        if (!same) {
            free(rows);
            free(state);
            continue;
        }
        got = rows;
        if (state_out) *state_out = state;
        *n_out = c[k].n;
        pthread_mutex_lock(&d->lock);
        d->hits++;
        int64_t v = km_get(&d->exact, &c[k].name);
        if (v >= 0) touch(d, (int32_t)v, now_ns());
        pthread_mutex_unlock(&d->lock);
    }
    free(c);
    return got;
}

/* ---- Checkpoint skeletons ---- */

bool apc_disk_store_skeleton(apc_disk *d, const int32_t *tokens, int64_t p, uint64_t salt, int ckpt_kind,
                             const kv_seq *seq, const void *state) {
    size_t sb = d->lay->state_bytes;
    if (p < 2 || p > seq->n_tokens || ckpt_kind < 0 || ckpt_kind > 3 || (sb && state == NULL)) return false;
    /* The chain [0, p) under the ckpt salt, then the skeleton. */
    const uint64_t csalt = salt ^ APC_DISK_CKPT_SALT;
    int64_t nf = p / KV_BLOCK_TOKENS;
    int tail = (int)(p % KV_BLOCK_TOKENS);
    int64_t total = nf + (tail ? 1 : 0);
    apc_key *keys = malloc((size_t)total * sizeof *keys);
    if (keys == NULL) {
        pthread_mutex_lock(&d->lock);
        d->write_drops++;
        pthread_mutex_unlock(&d->lock);
        return false;
    }
    static const apc_key zero;
    apc_chain_keys(d->ex.hash, tokens, nf, csalt, keys);
    if (tail) keys[nf] = apc_partial_key(d->ex.hash, nf > 0 ? &keys[nf - 1] : &zero, csalt, tokens + nf * KV_BLOCK_TOKENS, tail);
    if (d->lay->row_floats > 0) apc_disk_store_chain(d, keys, nf, tail, tokens, csalt, seq);
    apc_key key = apc_disk_skel_key(salt, tokens, p);
    size_t head_bytes = APC_DISK_HEADER_BYTES + 4 * (size_t)p;
    pthread_mutex_lock(&d->lock);
    /* A skeleton whose chain did not make it (a dropped write) is useless. */
    bool chain_ok = true;
    for (int64_t i = 0; i < total && chain_ok && d->lay->row_floats > 0; i++)
        chain_ok = km_get(&d->blocks, &keys[i]) != ABSENT;
    free(keys);
    int64_t v = km_get(&d->exact, &key);
    if (!chain_ok || v != ABSENT) {
        if (v >= 0) touch(d, (int32_t)v, now_ns());
        pthread_mutex_unlock(&d->lock);
        return false;
    }
    if (!reserve(d, head_bytes + sb)) {
        d->write_drops++;
        pthread_mutex_unlock(&d->lock);
        return false;
    }
    km_put(&d->exact, &key, PENDING);
    pthread_mutex_unlock(&d->lock);
    job *j = calloc(1, sizeof *j);
    if (j) {
        j->head = malloc(head_bytes);
        if (sb) j->own_state = malloc(sb);
    }
    if (j == NULL || j->head == NULL || (sb && j->own_state == NULL)) {
        pthread_mutex_lock(&d->lock);
        if (km_get(&d->exact, &key) == PENDING) km_del(&d->exact, &key);
        unreserve(d, head_bytes + sb);
        d->write_drops++;
        pthread_mutex_unlock(&d->lock);
        job_free(j);
        return false;
    }
    if (sb) memcpy(j->own_state, state, sb);
    j->reserved = head_bytes + sb;
    j->hdr.kind = APC_DISK_KIND_SKEL;
    j->hdr.salt = salt;
    j->hdr.content = key;
    j->hdr.first_block = (uint32_t)ckpt_kind;
    j->hdr.n_tokens = (uint64_t)p;
    j->hdr.created_ns = now_ns();
    j->hdr.state_bytes = sb;
    apc_disk_write_header(j->head, d->ns, &j->hdr, d->lay);
    uint8_t *tp = j->head + APC_DISK_HEADER_BYTES;
    for (int64_t r = 0; r < p; r++)
        for (int b = 0; b < 4; b++) tp[4 * r + b] = (uint8_t)((uint32_t)tokens[r] >> (8 * b));
    j->head_bytes = head_bytes;
    j->state = j->own_state;
    j->state_bytes = sb;
    pthread_mutex_lock(&d->lock);
    d->skel_writes++;
    push(d, j);
    pthread_mutex_unlock(&d->lock);
    return true;
}

typedef struct skel_dst {
    void *state;
} skel_dst;

static float *skel_dst_fn(void *user, int layer, int kv, uint32_t piece) {
    (void)kv;
    (void)piece;
    return layer < 0 ? ((skel_dst *)user)->state : NULL;
}

int64_t apc_disk_find_skeleton(apc_disk *d, const int32_t *tokens, int64_t max_p, int64_t min_p, int64_t replay_at,
                               uint64_t salt, void *state_out, apc_key *name_out, int *kind_out) {
    int nc;
    cand *c = list_candidates(d, APC_DISK_KIND_SKEL, salt, min_p + 1, max_p, &nc);
    if (c == NULL) return 0;
    int64_t got = 0;
    char path[4096];
    int32_t *tok = NULL;
    for (int k = 0; k < nc && got == 0; k++) {
        if (c[k].kind == 2 /* APC_CKPT_REPLAY */ && replay_at >= 0 && c[k].n != replay_at) continue;
        apc_key want = apc_disk_skel_key(salt, tokens, c[k].n);
        if (!apc_key_eq(&want, &c[k].name)) continue;
        file_path(d, APC_DISK_KIND_SKEL, &c[k].name, path, sizeof path);
        open_file of;
        if (open_for_read(d, path, &of) < 0) {
            read_failed(d, APC_DISK_KIND_SKEL, &c[k].name);
            continue;
        }
        apc_disk_header h;
        ember_error err;
        int rc = apc_disk_read_header(&of.src, &d->ex, &h, &err);
        if (rc == 0 && (h.kind != APC_DISK_KIND_SKEL || (int64_t)h.n_tokens != c[k].n || h.salt != salt ||
                        !apc_key_eq(&h.content, &c[k].name))) {
            rc = -1;
            snprintf(err.msg, sizeof err.msg, "header does not match its name");
        }
        if (rc == 0) {
            free(tok);
            tok = malloc((size_t)c[k].n * sizeof(int32_t));
            if (tok == NULL) {
                close_read(&of, false);
                break; /* out of memory: not the file's fault */
            }
            skel_dst sd = {state_out};
            rc = apc_disk_read_body(&of.src, &d->ex, &h, tok, skel_dst_fn, &sd, &err);
        }
        close_read(&of, rc == 0);
        if (rc < 0) {
            corrupt_file(d, APC_DISK_KIND_SKEL, &c[k].name, err.msg);
            continue;
        }
        if (memcmp(tok, tokens, (size_t)c[k].n * sizeof(int32_t)) != 0) continue;
        got = c[k].n;
        *name_out = c[k].name;
        if (kind_out) *kind_out = c[k].kind;
    }
    free(tok);
    free(c);
    return got;
}

void apc_disk_skeleton_used(apc_disk *d, const apc_key *name) {
    pthread_mutex_lock(&d->lock);
    d->hits++;
    int64_t v = km_get(&d->exact, name);
    if (v >= 0) touch(d, (int32_t)v, now_ns());
    pthread_mutex_unlock(&d->lock);
}

void apc_disk_skeleton_bad(apc_disk *d, const apc_key *name, const char *why) {
    corrupt_file(d, APC_DISK_KIND_SKEL, name, why);
}
