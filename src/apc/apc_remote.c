/* apc_remote.c - the remote tier: block chains in Redis (see apc_remote.h).
 *
 * Why these choices:
 *  - A block's chain key is a content address (apc_key.h) and the namespace
 *    is the SSD tier's, so two replicas of one model under one cache format
 *    compute the same Redis keys for the same tokens and tenant, and
 *    anything else computes different ones. Nothing per-process (a hash
 *    seed, a path) enters a key.
 *  - Redis is a shared, evicting, restartable store that another program
 *    may write: nothing read from it is trusted. The value repeats what the
 *    key promises (namespace, key, parent, tokens) and is checksummed; its
 *    payload is the SSD tier's own one-block shard, so apc_disk_format.c's
 *    reader verifies it a second time (its checksum, the key recomputed
 *    from parent, salt and tokens) while copying rows into the pool.
 *  - One value per block: an eviction (allkeys-lru) or a bad value cuts a
 *    chain at one block and the verified prefix before it still serves.
 *  - Reads are bounded by the caller's deadline, which the cache derives
 *    from what a cold prefill of the missing tokens would cost: fetching
 *    is only worth it while it is cheaper than recomputing. Every socket
 *    wait is set to the time left; a connection that timed out is closed,
 *    since its pending replies would answer the next command.
 *  - A server that is down or hangs must cost requests nothing after the
 *    first few: consecutive failures open a breaker that turns reads and
 *    writes into immediate no-ops, and a probe thread PINGs until it
 *    answers. One warning the first time, counters always.
 *  - Writes never block a request: a store copies the rows (the blocks may
 *    be reused after it returns) into a queue bounded in bytes, or drops
 *    and counts them. The writer asks EXISTS first (another replica may
 *    have written the block), then SET NX EX, so values are written once
 *    and expire after the TTL. Keys written or seen are remembered for half
 *    the TTL, so a repeated store does not even copy them. */
#include "apc/apc_remote.h"

#include <errno.h>
#include <hiredis/hiredis.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <xxhash.h>

#include "core/clock.h"
#include "core/log.h"

static const uint8_t MAGIC[8] = {'E', 'M', 'B', 'R', 'R', 'M', 'T', '1'};

#define POOL_CONNS 4                     /* idle connections kept */
#define KNOWN_CAP (1u << 16)             /* remembered keys (a power of two) */
#define WINDOW_BYTES ((size_t)64 << 20)  /* values in flight per pipelined window */


/* ---- URL ---- */

int apc_remote_parse_url(const char *url, apc_remote_addr *out, ember_error *err) {
    memset(out, 0, sizeof *out);
    out->port = 6379;
    if (url == NULL || url[0] == 0) return ember_fail(err, "empty Redis URL");
    if (strncmp(url, "unix://", 7) == 0) {
        const char *p = url + 7;
        const char *q = strchr(p, '?');
        size_t n = q ? (size_t)(q - p) : strlen(p);
        if (n == 0 || p[0] != '/') return ember_fail(err, "'%s': a unix socket URL is unix:///absolute/path", url);
        if (n >= sizeof out->path) return ember_fail(err, "'%s': socket path too long", url);
        memcpy(out->path, p, n);
        if (q) {
            char *end;
            if (strncmp(q, "?db=", 4) != 0) return ember_fail(err, "'%s': the only option is ?db=N", url);
            long db = strtol(q + 4, &end, 10);
            if (end == q + 4 || *end || db < 0 || db > 1000000) return ember_fail(err, "'%s': bad database number", url);
            out->db = (int)db;
        }
        return 0;
    }
    if (strncmp(url, "redis://", 8) != 0)
        return ember_fail(err, "'%s': expected redis://host[:port][/db] or unix:///path", url);
    const char *p = url + 8;
    if (strchr(p, '@')) return ember_fail(err, "'%s': credentials in the URL are not supported", url);
    const char *slash = strchr(p, '/');
    const char *hend = slash ? slash : p + strlen(p);
    const char *colon = NULL, *h0 = p, *h1;
    if (p[0] == '[') { /* an IPv6 literal: [addr]:port */
        const char *close = memchr(p, ']', (size_t)(hend - p));
        if (close == NULL) return ember_fail(err, "'%s': unclosed [ in the host", url);
        h0 = p + 1;
        h1 = close;
        if (close + 1 < hend) {
            if (close[1] != ':') return ember_fail(err, "'%s': expected :port after ]", url);
            colon = close + 1;
        }
    } else {
        for (const char *c = p; c < hend; c++)
            if (*c == ':') colon = c;
        h1 = colon ? colon : hend;
    }
    size_t hn = (size_t)(h1 - h0);
    if (hn == 0) return ember_fail(err, "'%s': no host", url);
    if (hn >= sizeof out->host) return ember_fail(err, "'%s': host name too long", url);
    memcpy(out->host, h0, hn);
    char *end;
    if (colon) {
        long port = strtol(colon + 1, &end, 10);
        if (end != hend || port < 1 || port > 65535) return ember_fail(err, "'%s': bad port", url);
        out->port = (int)port;
    }
    if (slash && slash[1]) {
        long db = strtol(slash + 1, &end, 10);
        if (*end || db < 0 || db > 1000000) return ember_fail(err, "'%s': bad database number", url);
        out->db = (int)db;
    }
    return 0;
}

int apc_remote_check_url(const char *url, ember_error *err) {
    apc_remote_addr a;
    return apc_remote_parse_url(url, &a, err);
}

/* ---- The tier ---- */

typedef struct rblock {
    char kind;       /* 'b' a block, 'x' an exact snapshot, 'k' a checkpoint skeleton */
    char index_kind; /* x, k: the sorted set of lengths under the anchor ('l', 'm') */
    int64_t n;       /* x, k: tokens of the record, entered in that index */
    apc_key anchor;
    apc_key key;
    uint8_t *val;  /* the value; its two checksums are filled in by the writer */
    size_t len;
    size_t payload_at, payload_len;
} rblock;

typedef struct rjob {
    struct rjob *next;
    rblock *b;
    int n;
    size_t bytes;
} rjob;

typedef struct known_slot {
    apc_key key;
    uint64_t at_ms;  /* 0: empty */
} known_slot;

struct apc_remote {
    pthread_mutex_t lock;
    pthread_cond_t cv_work, cv_idle, cv_probe;
    apc_remote_addr addr;
    apc_remote_config cfg;
    uint8_t ns[16];
    char ns_hex[33];
    apc_disk_expect ex;
    const apc_layout *lay;
    kv_pool *pool;
    redisContext *idle[POOL_CONNS];
    int n_idle;
    known_slot *known;
    uint32_t n_known;
    rjob *head, *tail;
    size_t q_bytes;
    bool busy, stop;
    pthread_t writer, prober;
    bool writer_on, prober_on;
    int fails;
    bool open, warned;
    uint64_t hits, hit_tokens, writes, errors, timeouts, corrupt, write_drops;
};

static uint64_t now_ms(void) { return (uint64_t)(ember_now() * 1000.0); }

static struct timeval tv_of(double seconds) {
    if (seconds < 0.001) seconds = 0.001;
    struct timeval tv;
    tv.tv_sec = (time_t)seconds;
    tv.tv_usec = (suseconds_t)((seconds - (double)tv.tv_sec) * 1e6);
    return tv;
}

/* "ember:apc:<ns>:<kind>:<key>": b a block, x an exact snapshot, k a
 * checkpoint skeleton; l and m the indexes of their lengths under one
 * anchor. */
static void key_name_of(const apc_remote *r, char kind, const apc_key *k, char out[96]) {
    char hex[33];
    apc_disk_key_hex(k, hex);
    snprintf(out, 96, "ember:apc:%s:%c:%s", r->ns_hex, kind, hex);
}

static void key_name(const apc_remote *r, const apc_key *k, char out[96]) { key_name_of(r, 'b', k, out); }

/* ---- SIGPIPE ----
 * hiredis writes with write(2): a server that died mid-exchange would raise
 * SIGPIPE, whose default action ends the process. The library cannot own the
 * process's signal dispositions, so each exchange blocks SIGPIPE in its own
 * thread and consumes one that it raised itself. */
typedef struct pipe_guard {
    sigset_t old;
    bool pending_before;
} pipe_guard;

static void guard_on(pipe_guard *g) {
    sigset_t set, pend;
    sigemptyset(&set);
    sigaddset(&set, SIGPIPE);
    sigemptyset(&pend);
    sigpending(&pend);
    g->pending_before = sigismember(&pend, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &set, &g->old);
}

static void guard_off(pipe_guard *g) {
    if (!g->pending_before) {
        sigset_t set, pend;
        sigemptyset(&set);
        sigaddset(&set, SIGPIPE);
        sigemptyset(&pend);
        sigpending(&pend);
        if (sigismember(&pend, SIGPIPE) == 1) {
            struct timespec zero = {0, 0};
            sigtimedwait(&set, NULL, &zero);
        }
    }
    pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}

/* ---- Known keys: present on the server as far as we know ---- */

static uint32_t known_home(const apc_key *k) {
    uint32_t h;
    memcpy(&h, k->b, sizeof h);
    return h & (KNOWN_CAP - 1);
}

/* Under the lock. */
static bool known_has(apc_remote *r, const apc_key *k, uint64_t now) {
    uint64_t fresh = (uint64_t)(r->cfg.ttl_s > 0 ? r->cfg.ttl_s : 1) * 500;
    for (uint32_t i = known_home(k), n = 0; n < KNOWN_CAP; i = (i + 1) & (KNOWN_CAP - 1), n++) {
        known_slot *s = &r->known[i];
        if (s->at_ms == 0) return false;
        if (apc_key_eq(&s->key, k)) return now - s->at_ms < fresh;
    }
    return false;
}

/* Under the lock. A full table starts over (it is only a shortcut). */
static void known_add(apc_remote *r, const apc_key *k, uint64_t now) {
    if (r->n_known >= KNOWN_CAP / 2) {
        memset(r->known, 0, KNOWN_CAP * sizeof *r->known);
        r->n_known = 0;
    }
    for (uint32_t i = known_home(k);; i = (i + 1) & (KNOWN_CAP - 1)) {
        known_slot *s = &r->known[i];
        if (s->at_ms == 0) {
            s->key = *k;
            s->at_ms = now ? now : 1;
            r->n_known++;
            return;
        }
        if (apc_key_eq(&s->key, k)) {
            s->at_ms = now ? now : 1;
            return;
        }
    }
}

/* Under the lock: forget a key (deleted as corrupt, or found missing). */
static void known_forget(apc_remote *r, const apc_key *k) {
    for (uint32_t i = known_home(k), n = 0; n < KNOWN_CAP; i = (i + 1) & (KNOWN_CAP - 1), n++) {
        known_slot *s = &r->known[i];
        if (s->at_ms == 0) return;
        if (apc_key_eq(&s->key, k)) {
            s->at_ms = 1; /* stale, keeps the probe chain intact */
            return;
        }
    }
}

/* ---- Connections and the breaker ---- */

static redisContext *dial(const apc_remote_addr *a, double seconds) {
    struct timeval tv = tv_of(seconds);
    redisContext *c = a->path[0] ? redisConnectUnixWithTimeout(a->path, tv) : redisConnectWithTimeout(a->host, a->port, tv);
    if (c == NULL) return NULL;
    if (c->err) {
        redisFree(c);
        return NULL;
    }
    redisSetTimeout(c, tv);
    if (a->db != 0) {
        redisReply *rep = redisCommand(c, "SELECT %d", a->db);
        bool ok = rep && rep->type == REDIS_REPLY_STATUS;
        if (rep) freeReplyObject(rep);
        if (!ok) {
            redisFree(c);
            return NULL;
        }
    }
    return c;
}

/* A connection whose socket waits are bounded by the time left; *pooled
 * says whether it was idle in the pool (it may predate a server restart). */
static redisContext *conn_get(apc_remote *r, double deadline, bool *pooled) {
    *pooled = false;
    double left = deadline - ember_now();
    if (left <= 0) return NULL;
    pthread_mutex_lock(&r->lock);
    redisContext *c = r->n_idle > 0 ? r->idle[--r->n_idle] : NULL;
    pthread_mutex_unlock(&r->lock);
    if (c == NULL) {
        c = dial(&r->addr, left);
    } else {
        *pooled = true;
        redisSetTimeout(c, tv_of(left));
    }
    return c;
}

static void conn_put(apc_remote *r, redisContext *c) {
    if (c == NULL) return;
    if (c->err == 0) {
        pthread_mutex_lock(&r->lock);
        if (r->n_idle < POOL_CONNS) {
            r->idle[r->n_idle++] = c;
            c = NULL;
        }
        pthread_mutex_unlock(&r->lock);
    }
    if (c) redisFree(c);
}

static void note_ok(apc_remote *r) {
    pthread_mutex_lock(&r->lock);
    r->fails = 0;
    pthread_mutex_unlock(&r->lock);
}

/* A failed exchange: counted; enough of them in a row open the breaker. */
static void note_fail(apc_remote *r, bool timed_out, const char *why) {
    pthread_mutex_lock(&r->lock);
    if (timed_out) r->timeouts++;
    else r->errors++;
    r->fails++;
    if (!r->open && r->fails >= (r->cfg.breaker_failures > 0 ? r->cfg.breaker_failures : 1)) {
        r->open = true;
        if (!r->warned) {
            r->warned = true;
            ember_log(EMBER_LOG_WARN,
                      "APC remote tier: Redis is not answering (%s); requests continue without it and a probe "
                      "retries every %d ms (logged once)",
                      why, r->cfg.probe_ms);
        }
        pthread_cond_broadcast(&r->cv_probe);
    }
    pthread_mutex_unlock(&r->lock);
}

/* Whether a failed context failed by running out of time. */
static bool timed_out(const redisContext *c, double deadline) {
    if (ember_now() >= deadline - 0.002) return true;
    return c && c->err == REDIS_ERR_IO &&
           (strstr(c->errstr, "temporarily unavailable") || strstr(c->errstr, "timed out"));
}

static void fail_conn(apc_remote *r, redisContext *c, double deadline, const char *what) {
    char why[160];
    snprintf(why, sizeof why, "%s: %s", what, c ? c->errstr : "cannot connect");
    note_fail(r, c ? timed_out(c, deadline) : ember_now() >= deadline - 0.002, why);
    if (c) redisFree(c);
}

static void block_sigpipe(void);

static void *probe_main(void *arg) {
    apc_remote *r = arg;
    block_sigpipe();
    pthread_mutex_lock(&r->lock);
    while (!r->stop) {
        if (!r->open) {
            pthread_cond_wait(&r->cv_probe, &r->lock);
            continue;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        int ms = r->cfg.probe_ms > 0 ? r->cfg.probe_ms : 1000;
        ts.tv_sec += ms / 1000;
        ts.tv_nsec += (long)(ms % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&r->cv_probe, &r->lock, &ts);
        if (r->stop || !r->open) continue;
        pthread_mutex_unlock(&r->lock);
        double wait = (r->cfg.timeout_ms > 0 ? r->cfg.timeout_ms : 1000) / 1000.0;
        redisContext *c = dial(&r->addr, wait);
        bool ok = false;
        if (c) {
            redisReply *rep = redisCommand(c, "PING");
            ok = rep && rep->type == REDIS_REPLY_STATUS;
            if (rep) freeReplyObject(rep);
        }
        pthread_mutex_lock(&r->lock);
        if (ok) {
            r->open = false;
            r->fails = 0;
            /* Pooled connections predate the outage. */
            for (int i = 0; i < r->n_idle; i++) redisFree(r->idle[i]);
            r->n_idle = 0;
            pthread_mutex_unlock(&r->lock);
            ember_log(EMBER_LOG_INFO, "APC remote tier: Redis answers again");
            conn_put(r, c);
            pthread_mutex_lock(&r->lock);
        } else if (c) {
            redisFree(c);
        }
    }
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

bool apc_remote_up(apc_remote *r) {
    pthread_mutex_lock(&r->lock);
    bool up = !r->open;
    pthread_mutex_unlock(&r->lock);
    return up;
}

/* ---- Values ---- */

static size_t value_bytes(const apc_layout *lay, int rows, size_t *payload_len) {
    size_t p = (size_t)apc_disk_file_bytes(lay, APC_DISK_KIND_SHARD, 1, (uint64_t)rows);
    *payload_len = p;
    return APC_REMOTE_ENVELOPE_BYTES + 4 * (size_t)rows + p;
}

/* Both checksums: the inner shard's, then the envelope's over everything. */
static void seal(rblock *b) {
    uint8_t *pl = b->val + b->payload_at;
    apc_put_u64(pl + b->payload_len - 8, XXH3_64bits(pl, b->payload_len - 8));
    XXH3_state_t *st = XXH3_createState();
    if (st == NULL) return; /* the value then fails verification: a counted miss, never wrong */
    XXH3_64bits_reset(st);
    XXH3_64bits_update(st, b->val, 80);
    XXH3_64bits_update(st, b->val + APC_REMOTE_ENVELOPE_BYTES, b->len - APC_REMOTE_ENVELOPE_BYTES);
    apc_put_u64(b->val + 80, XXH3_64bits_digest(st));
    XXH3_freeState(st);
}

typedef struct one_dst {
    kv_pool *pool;
    int32_t block;
} one_dst;

static float *one_dst_fn(void *user, int layer, int kv, uint32_t piece) {
    one_dst *d = user;
    if (piece != 0) return NULL;
    return kv == 0 ? kv_block_k(d->pool, d->block, layer) : kv_block_v(d->pool, d->block, layer);
}

/* Checks a value against what the request expects and copies its rows
 * into w->dst. NULL when it is the block asked for, else why not. */
/* The envelope of a value: what the key promises, the length, the
 * checksum, the tokens. NULL when it holds, else why not. */
static const char *check_envelope(const apc_remote *r, const uint8_t *v, size_t len, uint32_t kind,
                                  const apc_key *key, const apc_key *parent, const int32_t *tokens, size_t rows) {
    if (len < APC_REMOTE_ENVELOPE_BYTES + 4 * rows) return "short value";
    if (memcmp(v, MAGIC, 8) != 0) return "bad magic";
    if (apc_get_u32(v + 8) != APC_REMOTE_VERSION) return "another version";
    if (apc_get_u32(v + 12) != kind) return "another kind";
    if (memcmp(v + 16, r->ns, 16) != 0) return "another namespace";
    if (memcmp(v + 32, key->b, 16) != 0) return "another key";
    if (memcmp(v + 48, parent->b, 16) != 0) return "another parent";
    if (apc_get_u32(v + 64) != (uint32_t)rows || apc_get_u32(v + 68) != 0) return "another row count";
    uint64_t pl = apc_get_u64(v + 72);
    if (pl != len - APC_REMOTE_ENVELOPE_BYTES - 4 * rows) return "payload length does not match the value";
    XXH3_state_t *st = XXH3_createState();
    if (st == NULL) return "out of memory";
    XXH3_64bits_reset(st);
    XXH3_64bits_update(st, v, 80);
    XXH3_64bits_update(st, v + APC_REMOTE_ENVELOPE_BYTES, len - APC_REMOTE_ENVELOPE_BYTES);
    uint64_t sum = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    if (sum != apc_get_u64(v + 80)) return "checksum mismatch";
    for (size_t i = 0; i < rows; i++)
        if ((int32_t)apc_get_u32(v + APC_REMOTE_ENVELOPE_BYTES + 4 * i) != tokens[i]) return "other tokens";
    return NULL;
}

static const char *verify(apc_remote *r, const uint8_t *v, size_t len, const apc_key *parent, uint64_t salt,
                          const apc_disk_want *w, ember_error *err) {
    size_t rows = (size_t)w->rows;
    const char *why = check_envelope(r, v, len, APC_REMOTE_KIND_BLOCK, &w->key, parent, w->tokens, rows);
    if (why) return why;
    uint64_t pl = apc_get_u64(v + 72);
    /* The payload: the SSD tier's one-block shard, verified by its reader. */
    const uint8_t *payload = v + APC_REMOTE_ENVELOPE_BYTES + 4 * rows;
    apc_disk_src src;
    if (apc_disk_src_init(&src, -1, payload, pl) < 0) return "out of memory";
    apc_disk_header h;
    const char *bad = NULL;
    if (apc_disk_read_header(&src, &r->ex, &h, err) < 0) {
        apc_disk_src_free(&src);
        return err->msg;
    }
    if (h.kind != APC_DISK_KIND_SHARD || h.n_blocks != 1 || h.salt != salt || !apc_key_eq(&h.content, &w->key) ||
        !apc_key_eq(&h.parent, parent) || h.last_rows != (uint32_t)rows) {
        bad = "payload describes another block";
    } else {
        int32_t tok[KV_BLOCK_TOKENS];
        one_dst d = {r->pool, w->dst};
        if (apc_disk_read_body(&src, &r->ex, &h, tok, one_dst_fn, &d, err) < 0) bad = err->msg;
        else if (memcmp(tok, w->tokens, rows * sizeof(int32_t)) != 0) bad = "payload holds other tokens";
    }
    apc_disk_header_free(&h);
    apc_disk_src_free(&src);
    return bad;
}

/* ---- Reads ---- */

static int64_t chain_count(apc_remote *r, const apc_key *keys, int64_t n_keys, const apc_key *tail, int n_tail,
                           int *tail_at, double deadline) {
    *tail_at = -1;
    int64_t total = n_keys + n_tail;
    if (total == 0 || !apc_remote_up(r)) return 0;
    bool pooled;
    redisContext *c = conn_get(r, deadline, &pooled);
    if (c == NULL) {
        fail_conn(r, NULL, deadline, "connect");
        return 0;
    }
    if (r->cfg.read_hook) r->cfg.read_hook(r->cfg.read_hook_user, 0);
retry:;
    char name[96];
    for (int64_t i = 0; i < total; i++) {
        key_name(r, i < n_keys ? &keys[i] : &tail[i - n_keys], name);
        const char *argv[2] = {"EXISTS", name};
        size_t argl[2] = {6, strlen(name)};
        redisAppendCommandArgv(c, 2, argv, argl);
    }
    int64_t run = 0;
    bool broken = false, all = true;
    for (int64_t i = 0; i < total; i++) {
        redisReply *rep = NULL;
        if (redisGetReply(c, (void **)&rep) != REDIS_OK || rep == NULL) {
            broken = true;
            break;
        }
        bool present = rep->type == REDIS_REPLY_INTEGER && rep->integer == 1;
        freeReplyObject(rep);
        if (i < n_keys) {
            if (all && present) run++;
            else all = false;
        } else if (all && present && *tail_at < 0) {
            *tail_at = (int)(i - n_keys);
        }
    }
    if (broken && pooled && !timed_out(c, deadline)) {
        /* An idle connection the server dropped (a restart): one fresh try. */
        redisFree(c);
        pooled = false;
        run = 0;
        *tail_at = -1;
        c = dial(&r->addr, deadline - ember_now());
        if (c == NULL) {
            fail_conn(r, NULL, deadline, "connect");
            return 0;
        }
        goto retry;
    }
    if (broken) {
        fail_conn(r, c, deadline, "EXISTS");
        *tail_at = -1;
        return 0;
    }
    note_ok(r);
    conn_put(r, c);
    return run;
}

static int64_t load_blocks(apc_remote *r, const apc_key *parent, uint64_t salt, const apc_disk_want *want,
                           int64_t n_want, double deadline) {
    if (n_want == 0 || !apc_remote_up(r)) return 0;
    bool pooled;
    redisContext *c = conn_get(r, deadline, &pooled);
    if (c == NULL) {
        fail_conn(r, NULL, deadline, "connect");
        return 0;
    }
    size_t pl, one = value_bytes(r->lay, KV_BLOCK_TOKENS, &pl);
    size_t wb = r->cfg.window_bytes ? r->cfg.window_bytes : WINDOW_BYTES;
    int64_t window = (int64_t)(wb / (one ? one : 1));
    if (window < 1) window = 1;
    int64_t loaded = 0;
    bool stop = false;
    char name[96];
    while (loaded < n_want && !stop) {
        if (ember_now() >= deadline) {
            pthread_mutex_lock(&r->lock);
            r->timeouts++;
            pthread_mutex_unlock(&r->lock);
            break;
        }
        if (r->cfg.read_hook) r->cfg.read_hook(r->cfg.read_hook_user, 1);
        redisSetTimeout(c, tv_of(deadline - ember_now()));
        int64_t w0 = loaded, w1 = loaded + window < n_want ? loaded + window : n_want;
        for (int64_t i = w0; i < w1; i++) {
            key_name(r, &want[i].key, name);
            const char *argv[2] = {"GET", name};
            size_t argl[2] = {3, strlen(name)};
            redisAppendCommandArgv(c, 2, argv, argl);
        }
        int64_t bad_at = -1;
        for (int64_t i = w0; i < w1; i++) {
            redisReply *rep = NULL;
            if (redisGetReply(c, (void **)&rep) != REDIS_OK || rep == NULL) {
                fail_conn(r, c, deadline, "GET");
                return loaded;
            }
            if (!stop) {
                if (rep->type != REDIS_REPLY_STRING) {
                    stop = true; /* evicted or expired since EXISTS: the chain ends here */
                } else {
                    ember_error err;
                    const char *why = verify(r, (const uint8_t *)rep->str, (size_t)rep->len,
                                             i > 0 ? &want[i - 1].key : parent, salt, &want[i], &err);
                    if (why) {
                        char hex[33];
                        apc_disk_key_hex(&want[i].key, hex);
                        ember_log(EMBER_LOG_WARN, "APC remote: value %s rejected (%s); deleted, counted as a miss",
                                  hex, why);
                        pthread_mutex_lock(&r->lock);
                        r->corrupt++;
                        known_forget(r, &want[i].key);
                        pthread_mutex_unlock(&r->lock);
                        bad_at = i;
                        stop = true;
                    } else {
                        loaded++;
                        pthread_mutex_lock(&r->lock);
                        r->hits++;
                        r->hit_tokens += (uint64_t)want[i].rows;
                        known_add(r, &want[i].key, now_ms());
                        pthread_mutex_unlock(&r->lock);
                    }
                }
            }
            freeReplyObject(rep);
        }
        if (bad_at >= 0) {
            /* A replica writes it again once it is gone (writes skip what exists). */
            key_name(r, &want[bad_at].key, name);
            redisReply *rep = redisCommand(c, "DEL %s", name);
            if (rep == NULL) {
                fail_conn(r, c, deadline, "DEL");
                return loaded;
            }
            freeReplyObject(rep);
        }
    }
    note_ok(r);
    conn_put(r, c);
    return loaded;
}

int64_t apc_remote_chain_count(apc_remote *r, const apc_key *keys, int64_t n_keys, const apc_key *tail, int n_tail,
                               int *tail_at, double deadline) {
    pipe_guard g;
    guard_on(&g);
    int64_t n = chain_count(r, keys, n_keys, tail, n_tail, tail_at, deadline);
    guard_off(&g);
    return n;
}

int64_t apc_remote_load_blocks(apc_remote *r, const apc_key *parent, uint64_t salt, const apc_disk_want *want,
                               int64_t n_want, double deadline) {
    pipe_guard g;
    guard_on(&g);
    int64_t n = load_blocks(r, parent, salt, want, n_want, deadline);
    guard_off(&g);
    return n;
}

/* ---- Writes ---- */

static void job_free(rjob *j) {
    if (j == NULL) return;
    for (int i = 0; i < j->n; i++) free(j->b[i].val);
    free(j->b);
    free(j);
}

/* Sends one job: EXISTS for every block, SET NX EX for the missing ones. */
static void write_job(apc_remote *r, rjob *j) {
    if (!apc_remote_up(r)) {
        pthread_mutex_lock(&r->lock);
        r->write_drops += (uint64_t)j->n;
        pthread_mutex_unlock(&r->lock);
        return;
    }
    double deadline = ember_now() + (r->cfg.timeout_ms > 0 ? r->cfg.timeout_ms : 1000) / 1000.0;
    bool pooled;
    redisContext *c = conn_get(r, deadline, &pooled);
    if (c == NULL) {
        fail_conn(r, NULL, deadline, "connect");
        pthread_mutex_lock(&r->lock);
        r->write_drops += (uint64_t)j->n;
        pthread_mutex_unlock(&r->lock);
        return;
    }
    char name[96];
    bool exists_done = false;
    bool *missing = calloc((size_t)j->n, sizeof *missing);
    if (missing == NULL) {
        conn_put(r, c);
        return;
    }
retry:
    for (int i = 0; i < j->n; i++) {
        key_name_of(r, j->b[i].kind, &j->b[i].key, name);
        const char *argv[2] = {"EXISTS", name};
        size_t argl[2] = {6, strlen(name)};
        redisAppendCommandArgv(c, 2, argv, argl);
    }
    for (int i = 0; i < j->n; i++) {
        redisReply *rep = NULL;
        if (redisGetReply(c, (void **)&rep) != REDIS_OK || rep == NULL) {
            if (pooled && !timed_out(c, deadline)) {
                /* An idle connection the server dropped (a restart): one fresh try. */
                redisFree(c);
                pooled = false;
                c = dial(&r->addr, deadline - ember_now());
                if (c) goto retry;
            }
            goto broken;
        }
        missing[i] = rep->type == REDIS_REPLY_INTEGER && rep->integer == 0;
        freeReplyObject(rep);
    }
    exists_done = true;
    char ttl[24];
    snprintf(ttl, sizeof ttl, "%d", r->cfg.ttl_s > 0 ? r->cfg.ttl_s : 86400);
    for (int i0 = 0; i0 < j->n;) {
        /* A window of SETs: each waits for the socket at most timeout_ms. */
        redisSetTimeout(c, tv_of((r->cfg.timeout_ms > 0 ? r->cfg.timeout_ms : 1000) / 1000.0));
        size_t bytes = 0;
        int i1 = i0;
        for (; i1 < j->n && (i1 == i0 || bytes < WINDOW_BYTES); i1++) {
            if (!missing[i1]) continue;
            seal(&j->b[i1]);
            key_name_of(r, j->b[i1].kind, &j->b[i1].key, name);
            const char *argv[6] = {"SET", name, (const char *)j->b[i1].val, "NX", "EX", ttl};
            size_t argl[6] = {3, strlen(name), j->b[i1].len, 2, 2, strlen(ttl)};
            redisAppendCommandArgv(c, 6, argv, argl);
            bytes += j->b[i1].len;
            if (j->b[i1].index_kind) {
                /* The anchor's index of snapshot lengths, so a reader knows
                 * which prefixes to ask for (it expires with the values). */
                char idx[96], len[24];
                key_name_of(r, j->b[i1].index_kind, &j->b[i1].anchor, idx);
                snprintf(len, sizeof len, "%lld", (long long)j->b[i1].n);
                const char *za[4] = {"ZADD", idx, len, len};
                size_t zl[4] = {4, strlen(idx), strlen(len), strlen(len)};
                redisAppendCommandArgv(c, 4, za, zl);
                const char *ex[3] = {"EXPIRE", idx, ttl};
                size_t el[3] = {6, strlen(idx), strlen(ttl)};
                redisAppendCommandArgv(c, 3, ex, el);
            }
        }
        for (int i = i0; i < i1; i++) {
            if (!missing[i]) continue;
            redisReply *rep = NULL;
            if (redisGetReply(c, (void **)&rep) != REDIS_OK || rep == NULL) goto broken;
            bool stored = rep->type == REDIS_REPLY_STATUS;
            bool raced = rep->type == REDIS_REPLY_NIL; /* another replica was first */
            freeReplyObject(rep);
            for (int extra = j->b[i].index_kind ? 2 : 0; extra > 0; extra--) { /* ZADD, EXPIRE */
                if (redisGetReply(c, (void **)&rep) != REDIS_OK || rep == NULL) goto broken;
                freeReplyObject(rep);
            }
            pthread_mutex_lock(&r->lock);
            if (stored) r->writes++;
            else if (!raced) r->errors++; /* OOM under maxmemory noeviction, and the like */
            pthread_mutex_unlock(&r->lock);
            if (stored || raced) missing[i] = false; /* on the server now */
        }
        i0 = i1;
    }
    pthread_mutex_lock(&r->lock);
    uint64_t t = now_ms();
    for (int i = 0; i < j->n; i++)
        if (!missing[i]) known_add(r, &j->b[i].key, t);
    pthread_mutex_unlock(&r->lock);
    free(missing);
    note_ok(r);
    conn_put(r, c);
    return;
broken: {
    /* What did not reach the server is dropped (a replica rewrites it later). */
    uint64_t lost = 0;
    for (int i = 0; i < j->n; i++) lost += !exists_done || missing[i];
    pthread_mutex_lock(&r->lock);
    r->write_drops += lost;
    pthread_mutex_unlock(&r->lock);
    free(missing);
    fail_conn(r, c, deadline, c ? "write" : "connect");
}
}

/* The tier's own threads never take SIGPIPE (see pipe_guard). */
static void block_sigpipe(void) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
}

static void *writer_main(void *arg) {
    apc_remote *r = arg;
    block_sigpipe();
    pthread_mutex_lock(&r->lock);
    for (;;) {
        while (r->head == NULL && !r->stop) pthread_cond_wait(&r->cv_work, &r->lock);
        if (r->head == NULL) break;
        rjob *j = r->head;
        r->head = j->next;
        if (r->head == NULL) r->tail = NULL;
        r->busy = true;
        pthread_mutex_unlock(&r->lock);
        write_job(r, j);
        pthread_mutex_lock(&r->lock);
        r->q_bytes -= j->bytes;
        job_free(j);
        r->busy = false;
        pthread_cond_broadcast(&r->cv_idle);
    }
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

void apc_remote_store_chain(apc_remote *r, const apc_key *keys, int64_t n_full, int tail_rows, const int32_t *tokens,
                            uint64_t salt, const kv_seq *seq) {
    int64_t total = n_full + (tail_rows > 0 ? 1 : 0);
    if (total == 0) return;
    const apc_layout *lay = r->lay;
    uint64_t t = now_ms();
    int64_t *pick = malloc((size_t)total * sizeof *pick);
    if (pick == NULL) return;
    int n = 0;
    size_t bytes = 0;
    uint64_t dropped = 0;
    pthread_mutex_lock(&r->lock);
    bool up = !r->open;
    for (int64_t i = 0; i < total; i++) {
        if (known_has(r, &keys[i], t)) continue;
        if (!up) {
            dropped++;
            continue;
        }
        size_t pl;
        size_t vb = value_bytes(lay, i < n_full ? KV_BLOCK_TOKENS : tail_rows, &pl);
        if (r->q_bytes + bytes + vb > r->cfg.queue_bytes) {
            dropped += (uint64_t)(total - i); /* the rest of the chain: its prefix goes first */
            break;
        }
        bytes += vb;
        pick[n++] = i;
    }
    r->write_drops += dropped;
    r->q_bytes += bytes; /* reserved now, released by the writer */
    pthread_mutex_unlock(&r->lock);
    if (n == 0) {
        free(pick);
        return;
    }
    rjob *j = calloc(1, sizeof *j);
    if (j) j->b = calloc((size_t)n, sizeof *j->b);
    if (j == NULL || j->b == NULL) goto oom;
    static const apc_key zero;
    for (int k = 0; k < n; k++) {
        int64_t i = pick[k];
        int rows = i < n_full ? KV_BLOCK_TOKENS : tail_rows;
        rblock *b = &j->b[k];
        b->kind = 'b';
        b->key = keys[i];
        b->len = value_bytes(lay, rows, &b->payload_len);
        b->payload_at = APC_REMOTE_ENVELOPE_BYTES + 4 * (size_t)rows;
        b->val = malloc(b->len);
        if (b->val == NULL) goto oom;
        j->n = k + 1;
        const apc_key *parent = i > 0 ? &keys[i - 1] : &zero;
        const int32_t *tok = tokens + i * KV_BLOCK_TOKENS;
        uint8_t *v = b->val;
        memset(v, 0, APC_REMOTE_ENVELOPE_BYTES);
        memcpy(v, MAGIC, 8);
        apc_put_u32(v + 8, APC_REMOTE_VERSION);
        apc_put_u32(v + 12, APC_REMOTE_KIND_BLOCK);
        memcpy(v + 16, r->ns, 16);
        memcpy(v + 32, b->key.b, 16);
        memcpy(v + 48, parent->b, 16);
        apc_put_u32(v + 64, (uint32_t)rows);
        apc_put_u64(v + 72, b->payload_len);
        for (int q = 0; q < rows; q++) apc_put_u32(v + APC_REMOTE_ENVELOPE_BYTES + 4 * q, (uint32_t)tok[q]);
        /* The payload: a one-block shard of the SSD format. */
        uint8_t *p = v + b->payload_at;
        apc_disk_header h;
        memset(&h, 0, sizeof h);
        h.kind = APC_DISK_KIND_SHARD;
        h.salt = salt;
        h.content = b->key;
        h.parent = *parent;
        h.first_block = (uint32_t)i;
        h.n_blocks = 1;
        h.last_rows = (uint32_t)rows;
        h.n_tokens = (uint64_t)rows;
        h.keys = &b->key;
        apc_disk_write_header(p, r->ns, &h, lay);
        p += APC_DISK_HEADER_BYTES + 16;
        for (int q = 0; q < rows; q++) apc_put_u32(p + 4 * q, (uint32_t)tok[q]);
        p += 4 * (size_t)rows;
        int32_t blk = seq->blocks[i];
        for (int l = 0; l < lay->n_layer; l++) {
            size_t kb = (size_t)rows * (size_t)lay->k_width[l] * sizeof(float);
            size_t vbts = (size_t)rows * (size_t)lay->v_width[l] * sizeof(float);
            if (kb) memcpy(p, kv_block_k(r->pool, blk, l), kb);
            p += kb;
            if (vbts) memcpy(p, kv_block_v(r->pool, blk, l), vbts);
            p += vbts;
        }
    }
    j->bytes = bytes;
    free(pick);
    pthread_mutex_lock(&r->lock);
    if (r->tail) r->tail->next = j;
    else r->head = j;
    r->tail = j;
    pthread_cond_signal(&r->cv_work);
    pthread_mutex_unlock(&r->lock);
    return;
oom:
    free(pick);
    job_free(j);
    pthread_mutex_lock(&r->lock);
    r->q_bytes -= bytes;
    r->write_drops += (uint64_t)n;
    pthread_mutex_unlock(&r->lock);
}

/* ---- Exact snapshots ---- */

/* The anchor a snapshot's length is indexed under: the exact key of its
 * first APC_REMOTE_ANCHOR_TOKENS tokens (salt inside). */
static apc_key anchor_of(uint64_t salt, const int32_t *tokens) {
    return apc_disk_exact_key(salt, tokens, APC_REMOTE_ANCHOR_TOKENS);
}

/* A whole record as one value (an exact snapshot, 'x', or a checkpoint
 * skeleton, 'k'): the envelope, then a file of the SSD format of hdr_kind
 * holding tokens[0, n), data (K/V rows; none for a skeleton) and the state.
 * Indexed by length under the anchor in the sorted set of idx_kind. */
static void queue_record(apc_remote *r, const apc_layout *lay, char kind, char idx_kind, uint32_t hdr_kind,
                         uint32_t env_kind, const apc_key *key, const int32_t *tokens, int64_t n, uint64_t salt,
                         uint32_t first_block, const uint8_t *owner, const float *data, const void *state) {
    size_t sb = lay->state_bytes;
    uint64_t file = apc_disk_file_bytes(lay, hdr_kind, 0, (uint64_t)n);
    if (file == 0) return;
    size_t len = APC_REMOTE_ENVELOPE_BYTES + 4 * (size_t)n + (size_t)file;
    uint64_t t = now_ms();
    pthread_mutex_lock(&r->lock);
    bool skip = known_has(r, key, t);
    bool drop = !skip && (r->open || r->q_bytes + len > r->cfg.queue_bytes);
    if (drop) r->write_drops++;
    if (!skip && !drop) r->q_bytes += len;
    pthread_mutex_unlock(&r->lock);
    if (skip || drop) return;
    rjob *j = calloc(1, sizeof *j);
    if (j) j->b = calloc(1, sizeof *j->b);
    uint8_t *v = j && j->b ? malloc(len) : NULL;
    if (v == NULL) {
        if (j) free(j->b);
        free(j);
        pthread_mutex_lock(&r->lock);
        r->q_bytes -= len;
        r->write_drops++;
        pthread_mutex_unlock(&r->lock);
        return;
    }
    static const apc_key zero;
    rblock *b = j->b;
    j->n = 1;
    j->bytes = len;
    b->kind = kind;
    b->index_kind = idx_kind;
    b->n = n;
    b->anchor = anchor_of(salt, tokens);
    b->key = *key;
    b->val = v;
    b->len = len;
    b->payload_at = APC_REMOTE_ENVELOPE_BYTES + 4 * (size_t)n;
    b->payload_len = (size_t)file;
    memset(v, 0, APC_REMOTE_ENVELOPE_BYTES);
    memcpy(v, MAGIC, 8);
    apc_put_u32(v + 8, APC_REMOTE_VERSION);
    apc_put_u32(v + 12, env_kind);
    memcpy(v + 16, r->ns, 16);
    memcpy(v + 32, key->b, 16);
    memcpy(v + 48, zero.b, 16);
    apc_put_u32(v + 64, (uint32_t)n);
    apc_put_u64(v + 72, b->payload_len);
    for (int64_t q = 0; q < n; q++) apc_put_u32(v + APC_REMOTE_ENVELOPE_BYTES + 4 * q, (uint32_t)tokens[q]);
    uint8_t *p = v + b->payload_at;
    apc_disk_header h;
    memset(&h, 0, sizeof h);
    h.kind = hdr_kind;
    h.salt = salt;
    h.content = *key;
    h.first_block = first_block;
    h.n_tokens = (uint64_t)n;
    h.state_bytes = sb;
    if (owner) memcpy(h.parent.b, owner, 16); /* a side entry's owner namespace */
    apc_disk_write_header(p, r->ns, &h, lay);
    p += APC_DISK_HEADER_BYTES;
    for (int64_t q = 0; q < n; q++) apc_put_u32(p + 4 * q, (uint32_t)tokens[q]);
    p += 4 * (size_t)n;
    if (data) {
        size_t db = (size_t)n * lay->row_floats * sizeof(float);
        memcpy(p, data, db);
        p += db;
    }
    if (sb) memcpy(p, state, sb);
    pthread_mutex_lock(&r->lock);
    if (r->tail) r->tail->next = j;
    else r->head = j;
    r->tail = j;
    pthread_cond_signal(&r->cv_work);
    pthread_mutex_unlock(&r->lock);
}

void apc_remote_store_exact(apc_remote *r, const apc_exact_entry *e) {
    if (e->n < APC_REMOTE_ANCHOR_TOKENS || e->n > INT32_MAX) return;
    size_t sb = r->lay->state_bytes;
    if ((sb && (e->state == NULL || e->state_bytes != sb)) || (!sb && e->state)) return;
    apc_key key = apc_disk_exact_key(e->salt, e->tokens, e->n);
    queue_record(r, r->lay, 'x', 'l', APC_DISK_KIND_EXACT, APC_REMOTE_KIND_EXACT, &key, e->tokens, e->n, e->salt, 0,
                 NULL, e->data, e->state);
}

void apc_remote_store_skeleton(apc_remote *r, const int32_t *tokens, int64_t p, uint64_t salt, int ckpt_kind,
                               const kv_seq *seq, const void *state, apc_hash_kind hash) {
    if (p < APC_REMOTE_ANCHOR_TOKENS || p > INT32_MAX || ckpt_kind < 0 || ckpt_kind > 3) return;
    if (r->lay->state_bytes && state == NULL) return;
    /* The chain first (its K/V), under the checkpoint salt, so that a reader
     * who finds the skeleton most likely finds its chain. */
    const uint64_t csalt = salt ^ APC_DISK_CKPT_SALT;
    int64_t nf = p / KV_BLOCK_TOKENS;
    int tail = (int)(p % KV_BLOCK_TOKENS);
    apc_key *keys = malloc((size_t)(nf + 1) * sizeof *keys);
    if (keys == NULL) return;
    static const apc_key zero;
    apc_chain_keys(hash, tokens, nf, csalt, keys);
    if (tail) keys[nf] = apc_partial_key(hash, nf > 0 ? &keys[nf - 1] : &zero, csalt, tokens + nf * KV_BLOCK_TOKENS, tail);
    apc_remote_store_chain(r, keys, nf, tail, tokens, csalt, seq);
    free(keys);
    apc_key key = apc_disk_skel_key(salt, tokens, p);
    queue_record(r, r->lay, 'k', 'm', APC_DISK_KIND_SKEL, APC_REMOTE_KIND_SKEL, &key, tokens, p, salt,
                 (uint32_t)ckpt_kind, NULL, NULL, state);
}

/* ---- Side entries (a drafter's sidecar) ----
 * As on the SSD tier: a side file (its owner namespace at the parent field,
 * its rows, its state) inside an envelope of kind side, under "s:<side
 * key>", its lengths indexed under the anchor in "t:<anchor>". */

int apc_remote_store_side(apc_remote *r, uint64_t salt, const apc_side_owner *owner, const int32_t *tokens,
                          int64_t n, const uint32_t *rows, size_t words, const void *state) {
    size_t sb = owner ? owner->state_bytes : 0;
    if (n < APC_REMOTE_ANCHOR_TOKENS || n > INT32_MAX || words < 1 || sb > APC_DISK_SIDE_MAX_STATE ||
        (sb && state == NULL))
        return -1;
    int width[1];
    apc_layout lay = apc_disk_side_layout(width, words, sb);
    apc_key key = apc_disk_side_key(salt, tokens, n);
    queue_record(r, &lay, 's', 't', APC_DISK_KIND_SIDE, APC_REMOTE_KIND_SIDE, &key, tokens, n, salt, 0,
                 owner ? owner->ns : NULL, (const float *)rows, state);
    return 0;
}

/* A value that should be the side entry of tokens[0, n) under salt of this
 * owner and row width: its rows and state into rows_out / state_out; NULL
 * when it is, else why not. */
static const char *parse_side(apc_remote *r, const uint8_t *v, size_t len, const int32_t *tokens, int64_t n,
                              uint64_t salt, const apc_side_owner *owner, size_t words, uint32_t *rows_out,
                              void *state_out) {
    static const apc_key zero;
    apc_key key = apc_disk_side_key(salt, tokens, n);
    const char *why = check_envelope(r, v, len, APC_REMOTE_KIND_SIDE, &key, &zero, tokens, (size_t)n);
    if (why) return why;
    int32_t *tok = malloc((size_t)n * sizeof(int32_t));
    if (tok == NULL) return "out of memory";
    apc_disk_src src;
    ember_error err;
    const uint8_t *payload = v + APC_REMOTE_ENVELOPE_BYTES + 4 * (size_t)n;
    if (apc_disk_src_init(&src, -1, payload, apc_get_u64(v + 72)) < 0) {
        free(tok);
        return "out of memory";
    }
    int width[1];
    apc_layout lay = apc_disk_side_layout(width, words, owner->state_bytes);
    apc_disk_expect ex = r->ex;
    ex.layout = &lay;
    apc_disk_header h;
    if (apc_disk_read_header(&src, &ex, &h, &err) < 0) {
        why = "payload header rejected";
    } else {
        if (h.kind != APC_DISK_KIND_SIDE || (int64_t)h.n_tokens != n || h.salt != salt || !apc_key_eq(&h.content, &key)) {
            why = "payload describes another side entry";
        } else if (memcmp(h.parent.b, owner->ns, 16) != 0 || h.row_floats != words ||
                   h.state_bytes != owner->state_bytes) {
            why = "payload written by another drafter (owner, row width or state size)";
        } else {
            apc_disk_exact_dst x = {&lay, (float *)rows_out, n, state_out};
            if (apc_disk_read_body(&src, &ex, &h, tok, apc_disk_exact_dst_fn, &x, &err) < 0) why = "payload rejected";
            else if (memcmp(tok, tokens, (size_t)n * sizeof(int32_t)) != 0) why = "payload holds other tokens";
        }
        apc_disk_header_free(&h);
    }
    apc_disk_src_free(&src);
    free(tok);
    return why;
}

/* A whole-entry value (snapshot, skeleton, side entry) that failed its
 * checks: said once, counted as corrupt, forgotten and deleted, so the next
 * reader misses instead of tripping on it again. */
static void reject_entry(apc_remote *r, redisContext *c, const apc_key *key, const char *name, const char *what,
                         int64_t tokens, const char *why) {
    ember_log(EMBER_LOG_WARN, "APC remote: %s of %lld tokens rejected (%s); deleted, counted as a miss", what,
              (long long)tokens, why);
    pthread_mutex_lock(&r->lock);
    r->corrupt++;
    known_forget(r, key);
    pthread_mutex_unlock(&r->lock);
    redisReply *d = redisCommand(c, "DEL %s", name);
    if (d) freeReplyObject(d);
}

/* The end of a whole-entry read: a connection that failed (a DEL of a
 * rejected value is its last command) is dropped, a sound one goes back. */
static void finish_entry_read(apc_remote *r, redisContext *c, double deadline) {
    if (c->err) {
        fail_conn(r, c, deadline, "DEL");
        return;
    }
    note_ok(r);
    conn_put(r, c);
}

static uint32_t *load_side(apc_remote *r, uint64_t salt, const apc_side_owner *owner, const int32_t *tokens,
                           int64_t p, int64_t n, size_t words, void **state_out, int64_t *n_out, double deadline) {
    if (p < APC_REMOTE_ANCHOR_TOKENS) p = APC_REMOTE_ANCHOR_TOKENS;
    if (n < p || !apc_remote_up(r)) return NULL;
    bool pooled;
    redisContext *c = conn_get(r, deadline, &pooled);
    if (c == NULL) {
        fail_conn(r, NULL, deadline, "connect");
        return NULL;
    }
    char idx[96], lo[24], hi[24];
    apc_key anchor = anchor_of(salt, tokens);
    key_name_of(r, 't', &anchor, idx);
    snprintf(lo, sizeof lo, "%lld", (long long)p);
    snprintf(hi, sizeof hi, "%lld", (long long)n);
    redisReply *lens = redisCommand(c, "ZREVRANGEBYSCORE %s %s %s", idx, hi, lo);
    if (lens == NULL) {
        fail_conn(r, c, deadline, "ZREVRANGEBYSCORE");
        return NULL;
    }
    size_t sb = owner->state_bytes;
    uint32_t *got = NULL;
    for (size_t k = 0; lens->type == REDIS_REPLY_ARRAY && k < lens->elements && got == NULL; k++) {
        const redisReply *el = lens->element[k];
        int64_t m = el->type == REDIS_REPLY_STRING ? strtoll(el->str, NULL, 10) : 0;
        if (m < p || m > n) continue;
        if (ember_now() >= deadline) {
            pthread_mutex_lock(&r->lock);
            r->timeouts++;
            pthread_mutex_unlock(&r->lock);
            break;
        }
        redisSetTimeout(c, tv_of(deadline - ember_now()));
        apc_key key = apc_disk_side_key(salt, tokens, m);
        char name[96];
        key_name_of(r, 's', &key, name);
        redisReply *v = redisCommand(c, "GET %s", name);
        if (v == NULL) {
            freeReplyObject(lens);
            fail_conn(r, c, deadline, "GET");
            return NULL;
        }
        uint32_t *rows = v->type == REDIS_REPLY_STRING ? malloc((size_t)m * words * sizeof(uint32_t)) : NULL;
        void *state = rows && sb ? malloc(sb) : NULL;
        if (rows && (!sb || state)) {
            const char *why = parse_side(r, (const uint8_t *)v->str, (size_t)v->len, tokens, m, salt, owner, words,
                                         rows, state);
            if (why == NULL) {
                got = rows;
                *state_out = state;
                *n_out = m;
                rows = NULL;
                state = NULL;
                pthread_mutex_lock(&r->lock);
                r->hits++;
                known_add(r, &key, now_ms());
                pthread_mutex_unlock(&r->lock);
            } else {
                reject_entry(r, c, &key, name, "side entry", m, why);
            }
        }
        free(rows);
        free(state);
        freeReplyObject(v);
    }
    freeReplyObject(lens);
    finish_entry_read(r, c, deadline);
    return got;
}

uint32_t *apc_remote_load_side(apc_remote *r, uint64_t salt, const apc_side_owner *owner, const int32_t *tokens,
                               int64_t p, int64_t n, size_t words, void **state_out, int64_t *n_out, double deadline) {
    static const apc_side_owner none;
    void *state = NULL;
    pipe_guard g;
    guard_on(&g);
    uint32_t *rows = load_side(r, salt, owner ? owner : &none, tokens, p, n, words, &state, n_out, deadline);
    guard_off(&g);
    if (state_out) *state_out = state;
    else free(state);
    return rows;
}


/* A value that should be the snapshot of tokens[0, n) under salt, read
 * into a new entry; NULL with *why when it is not. */
static apc_exact_entry *parse_exact(apc_remote *r, const uint8_t *v, size_t len, const int32_t *tokens, int64_t n,
                                    uint64_t salt, const char **why) {
    static const apc_key zero;
    apc_key key = apc_disk_exact_key(salt, tokens, n);
    *why = check_envelope(r, v, len, APC_REMOTE_KIND_EXACT, &key, &zero, tokens, (size_t)n);
    if (*why) return NULL;
    const apc_layout *lay = r->lay;
    size_t sb = lay->state_bytes;
    apc_exact_entry *e = apc_exact_entry_new(lay, tokens, n, salt);
    int32_t *tok = malloc((size_t)n * sizeof(int32_t));
    if (e && sb) {
        e->state = malloc(sb);
        e->state_bytes = sb;
        e->bytes += sb;
    }
    if (e == NULL || tok == NULL || (sb && e->state == NULL)) {
        apc_exact_entry_free(e);
        free(tok);
        *why = NULL; /* out of memory: not the value's fault */
        return NULL;
    }
    apc_disk_src src;
    ember_error err;
    const uint8_t *payload = v + APC_REMOTE_ENVELOPE_BYTES + 4 * (size_t)n;
    bool ok = false;
    if (apc_disk_src_init(&src, -1, payload, apc_get_u64(v + 72)) == 0) {
        apc_disk_header h;
        if (apc_disk_read_header(&src, &r->ex, &h, &err) < 0) {
            *why = "payload header rejected";
        } else {
            if (h.kind != APC_DISK_KIND_EXACT || (int64_t)h.n_tokens != n || h.salt != salt ||
                !apc_key_eq(&h.content, &key)) {
                *why = "payload describes another snapshot";
            } else {
                apc_disk_exact_dst x = {lay, e->data, n, e->state};
                if (apc_disk_read_body(&src, &r->ex, &h, tok, apc_disk_exact_dst_fn, &x, &err) < 0) *why = "payload rejected";
                else if (memcmp(tok, tokens, (size_t)n * sizeof(int32_t)) != 0) *why = "payload holds other tokens";
                else ok = true;
            }
            apc_disk_header_free(&h);
        }
        apc_disk_src_free(&src);
    }
    free(tok);
    if (!ok) {
        apc_exact_entry_free(e);
        return NULL;
    }
    return e;
}

static apc_exact_entry *load_exact(apc_remote *r, const int32_t *tokens, int64_t max_len, int64_t min_len,
                                   uint64_t salt, size_t max_bytes, double deadline) {
    if (max_len < APC_REMOTE_ANCHOR_TOKENS || max_len <= min_len || !apc_remote_up(r)) return NULL;
    bool pooled;
    redisContext *c = conn_get(r, deadline, &pooled);
    if (c == NULL) {
        fail_conn(r, NULL, deadline, "connect");
        return NULL;
    }
    if (r->cfg.read_hook) r->cfg.read_hook(r->cfg.read_hook_user, 0);
    char idx[96], lo[24], hi[24];
    apc_key anchor = anchor_of(salt, tokens);
    key_name_of(r, 'l', &anchor, idx);
    snprintf(lo, sizeof lo, "(%lld", (long long)min_len);
    snprintf(hi, sizeof hi, "%lld", (long long)max_len);
    redisReply *lens = redisCommand(c, "ZREVRANGEBYSCORE %s %s %s", idx, hi, lo);
    if (lens == NULL) {
        fail_conn(r, c, deadline, "ZREVRANGEBYSCORE");
        return NULL;
    }
    apc_exact_entry *got = NULL;
    for (size_t k = 0; lens->type == REDIS_REPLY_ARRAY && k < lens->elements && got == NULL; k++) {
        const redisReply *el = lens->element[k];
        int64_t n = el->type == REDIS_REPLY_STRING ? strtoll(el->str, NULL, 10) : 0;
        if (n <= min_len || n > max_len) continue;
        if (apc_snapshot_bytes(r->lay, n) + r->lay->state_bytes > max_bytes) continue;
        if (ember_now() >= deadline) {
            pthread_mutex_lock(&r->lock);
            r->timeouts++;
            pthread_mutex_unlock(&r->lock);
            break;
        }
        if (r->cfg.read_hook) r->cfg.read_hook(r->cfg.read_hook_user, 1);
        redisSetTimeout(c, tv_of(deadline - ember_now()));
        apc_key key = apc_disk_exact_key(salt, tokens, n);
        char name[96];
        key_name_of(r, 'x', &key, name);
        redisReply *v = redisCommand(c, "GET %s", name);
        if (v == NULL) {
            freeReplyObject(lens);
            fail_conn(r, c, deadline, "GET");
            return NULL;
        }
        if (v->type == REDIS_REPLY_STRING) {
            const char *why = NULL;
            got = parse_exact(r, (const uint8_t *)v->str, (size_t)v->len, tokens, n, salt, &why);
            if (got) {
                pthread_mutex_lock(&r->lock);
                r->hits++;
                r->hit_tokens += (uint64_t)n;
                known_add(r, &key, now_ms());
                pthread_mutex_unlock(&r->lock);
            } else if (why) {
                reject_entry(r, c, &key, name, "snapshot", n, why);
            }
        }
        freeReplyObject(v);
    }
    freeReplyObject(lens);
    finish_entry_read(r, c, deadline);
    return got;
}

apc_exact_entry *apc_remote_load_exact(apc_remote *r, const int32_t *tokens, int64_t max_len, int64_t min_len,
                                       uint64_t salt, size_t max_bytes, double deadline) {
    pipe_guard g;
    guard_on(&g);
    apc_exact_entry *e = load_exact(r, tokens, max_len, min_len, salt, max_bytes, deadline);
    guard_off(&g);
    return e;
}

/* A value that should be the skeleton of tokens[0, p) under salt: its
 * state into state_out and its checkpoint kind; NULL when it is, else why
 * not. */
static const char *parse_skeleton(apc_remote *r, const uint8_t *v, size_t len, const int32_t *tokens, int64_t p,
                                  uint64_t salt, void *state_out, int *kind_out) {
    static const apc_key zero;
    apc_key key = apc_disk_skel_key(salt, tokens, p);
    const char *why = check_envelope(r, v, len, APC_REMOTE_KIND_SKEL, &key, &zero, tokens, (size_t)p);
    if (why) return why;
    int32_t *tok = malloc((size_t)p * sizeof(int32_t));
    if (tok == NULL) return "out of memory";
    apc_disk_src src;
    ember_error err;
    const uint8_t *payload = v + APC_REMOTE_ENVELOPE_BYTES + 4 * (size_t)p;
    if (apc_disk_src_init(&src, -1, payload, apc_get_u64(v + 72)) < 0) {
        free(tok);
        return "out of memory";
    }
    apc_disk_header h;
    if (apc_disk_read_header(&src, &r->ex, &h, &err) < 0) {
        why = "payload header rejected";
    } else {
        if (h.kind != APC_DISK_KIND_SKEL || (int64_t)h.n_tokens != p || h.salt != salt || !apc_key_eq(&h.content, &key)) {
            why = "payload describes another skeleton";
        } else {
            apc_disk_exact_dst x = {r->lay, NULL, p, state_out};
            if (apc_disk_read_body(&src, &r->ex, &h, tok, apc_disk_exact_dst_fn, &x, &err) < 0) why = "payload rejected";
            else if (memcmp(tok, tokens, (size_t)p * sizeof(int32_t)) != 0) why = "payload holds other tokens";
            else *kind_out = (int)h.first_block;
        }
        apc_disk_header_free(&h);
    }
    apc_disk_src_free(&src);
    free(tok);
    return why;
}

static int64_t find_skeleton(apc_remote *r, const int32_t *tokens, int64_t max_p, int64_t min_p, int64_t replay_at,
                             uint64_t salt, void *state_out, int *kind_out, double deadline) {
    if (max_p < APC_REMOTE_ANCHOR_TOKENS || max_p <= min_p || !apc_remote_up(r)) return 0;
    bool pooled;
    redisContext *c = conn_get(r, deadline, &pooled);
    if (c == NULL) {
        fail_conn(r, NULL, deadline, "connect");
        return 0;
    }
    if (r->cfg.read_hook) r->cfg.read_hook(r->cfg.read_hook_user, 0);
    char idx[96], lo[24], hi[24];
    apc_key anchor = anchor_of(salt, tokens);
    key_name_of(r, 'm', &anchor, idx);
    snprintf(lo, sizeof lo, "(%lld", (long long)min_p);
    snprintf(hi, sizeof hi, "%lld", (long long)max_p);
    redisReply *lens = redisCommand(c, "ZREVRANGEBYSCORE %s %s %s", idx, hi, lo);
    if (lens == NULL) {
        fail_conn(r, c, deadline, "ZREVRANGEBYSCORE");
        return 0;
    }
    int64_t got = 0;
    for (size_t k = 0; lens->type == REDIS_REPLY_ARRAY && k < lens->elements && got == 0; k++) {
        const redisReply *el = lens->element[k];
        int64_t p = el->type == REDIS_REPLY_STRING ? strtoll(el->str, NULL, 10) : 0;
        if (p <= min_p || p > max_p) continue;
        if (ember_now() >= deadline) {
            pthread_mutex_lock(&r->lock);
            r->timeouts++;
            pthread_mutex_unlock(&r->lock);
            break;
        }
        if (r->cfg.read_hook) r->cfg.read_hook(r->cfg.read_hook_user, 1);
        redisSetTimeout(c, tv_of(deadline - ember_now()));
        apc_key key = apc_disk_skel_key(salt, tokens, p);
        char name[96];
        key_name_of(r, 'k', &key, name);
        redisReply *v = redisCommand(c, "GET %s", name);
        if (v == NULL) {
            freeReplyObject(lens);
            fail_conn(r, c, deadline, "GET");
            return 0;
        }
        if (v->type == REDIS_REPLY_STRING) {
            int kind = -1;
            const char *why = parse_skeleton(r, (const uint8_t *)v->str, (size_t)v->len, tokens, p, salt, state_out, &kind);
            if (why == NULL) {
                /* A replay skeleton serves only the identical resend (the caller's gate). */
                if (!(kind == APC_CKPT_REPLAY && replay_at >= 0 && p != replay_at)) {
                    got = p;
                    *kind_out = kind;
                    pthread_mutex_lock(&r->lock);
                    r->hits++;
                    r->hit_tokens += (uint64_t)p;
                    known_add(r, &key, now_ms());
                    pthread_mutex_unlock(&r->lock);
                }
            } else if (strcmp(why, "out of memory") != 0) {
                reject_entry(r, c, &key, name, "skeleton", p, why);
            }
        }
        freeReplyObject(v);
    }
    freeReplyObject(lens);
    finish_entry_read(r, c, deadline);
    return got;
}

int64_t apc_remote_find_skeleton(apc_remote *r, const int32_t *tokens, int64_t max_p, int64_t min_p, int64_t replay_at,
                                 uint64_t salt, void *state_out, int *kind_out, double deadline) {
    pipe_guard g;
    guard_on(&g);
    int64_t p = find_skeleton(r, tokens, max_p, min_p, replay_at, salt, state_out, kind_out, deadline);
    guard_off(&g);
    return p;
}

/* ---- Lifetime ---- */

apc_remote *apc_remote_open(const apc_remote_config *cfg, const uint8_t ns[16], const apc_layout *lay,
                            apc_hash_kind hash, kv_pool *pool, ember_error *err) {
    apc_remote *r = calloc(1, sizeof *r);
    if (r == NULL) {
        ember_fail(err, "out of memory");
        return NULL;
    }
    if (apc_remote_parse_url(cfg->url, &r->addr, err) < 0) {
        free(r);
        return NULL;
    }
    r->known = calloc(KNOWN_CAP, sizeof *r->known);
    if (r->known == NULL) {
        free(r);
        ember_fail(err, "out of memory");
        return NULL;
    }
    r->cfg = *cfg;
    r->cfg.url = NULL;
    memcpy(r->ns, ns, 16);
    char hex[33];
    apc_key nk;
    memcpy(nk.b, ns, 16);
    apc_disk_key_hex(&nk, hex);
    memcpy(r->ns_hex, hex, sizeof r->ns_hex);
    memcpy(r->ex.ns, ns, 16);
    r->ex.hash = hash;
    r->ex.layout = lay;
    r->lay = lay;
    r->pool = pool;
    pthread_mutex_init(&r->lock, NULL);
    pthread_cond_init(&r->cv_work, NULL);
    pthread_cond_init(&r->cv_idle, NULL);
    pthread_cond_init(&r->cv_probe, NULL);
    r->writer_on = pthread_create(&r->writer, NULL, writer_main, r) == 0;
    r->prober_on = pthread_create(&r->prober, NULL, probe_main, r) == 0;
    if (!r->writer_on || !r->prober_on) {
        apc_remote_close(r);
        ember_fail(err, "cannot start the remote tier's threads");
        return NULL;
    }
    return r;
}

void apc_remote_flush(apc_remote *r) {
    if (r == NULL) return;
    pthread_mutex_lock(&r->lock);
    while (r->head || r->busy) pthread_cond_wait(&r->cv_idle, &r->lock);
    pthread_mutex_unlock(&r->lock);
}

void apc_remote_close(apc_remote *r) {
    if (r == NULL) return;
    pthread_mutex_lock(&r->lock);
    r->stop = true;
    pthread_cond_broadcast(&r->cv_work);
    pthread_cond_broadcast(&r->cv_probe);
    pthread_mutex_unlock(&r->lock);
    if (r->writer_on) pthread_join(r->writer, NULL); /* it drains the queue first */
    if (r->prober_on) pthread_join(r->prober, NULL);
    while (r->head) {
        rjob *j = r->head;
        r->head = j->next;
        job_free(j);
    }
    for (int i = 0; i < r->n_idle; i++) redisFree(r->idle[i]);
    free(r->known);
    pthread_mutex_destroy(&r->lock);
    pthread_cond_destroy(&r->cv_work);
    pthread_cond_destroy(&r->cv_idle);
    pthread_cond_destroy(&r->cv_probe);
    free(r);
}

void apc_remote_get_stats(apc_remote *r, apc_remote_stats *s) {
    pthread_mutex_lock(&r->lock);
    s->hits = r->hits;
    s->hit_tokens = r->hit_tokens;
    s->writes = r->writes;
    s->errors = r->errors;
    s->timeouts = r->timeouts;
    s->corrupt = r->corrupt;
    s->write_drops = r->write_drops;
    s->breaker_open = r->open;
    pthread_mutex_unlock(&r->lock);
}

void apc_remote_reset_counters(apc_remote *r) {
    pthread_mutex_lock(&r->lock);
    r->hits = r->hit_tokens = r->writes = r->errors = r->timeouts = r->corrupt = r->write_drops = 0;
    pthread_mutex_unlock(&r->lock);
}
