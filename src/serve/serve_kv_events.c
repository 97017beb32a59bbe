/* serve_kv_events.c - the KV-event publisher (see serve_kv_events.h).
 *
 * Wire format, matched against these sources (read for facts only):
 *  - vLLM vllm/distributed/kv_events.py at commit b4e69e0af33f (the
 *    ZmqEventPublisher: topic, 8-byte big-endian sequence from 0, msgpack
 *    payload; the ROUTER replay protocol with its -1 end marker; "*", "::",
 *    ipc:// and inproc:// endpoints bind, others connect) and
 *    examples/online_serving/kv_events_subscriber.py at commit 0ef0f42653bc
 *    (msgspec structs with array_like=True and tag=True: a batch is the
 *    array [ts, events], an event the array [tag, fields...]; BlockStored
 *    = block_hashes, parent_block_hash, token_ids, block_size, lora_id,
 *    medium; BlockRemoved = block_hashes, medium; AllBlocksCleared = no
 *    field). Later vLLM appends data_parallel_rank to the batch, which we
 *    send as 0.
 *  - llm-d-kv-cache-manager pkg/kvcache/kvevents (pool.go, events.go,
 *    zmq_subscriber.go) at commit a378f5b38f62 (after v0.4.0): the consumer
 *    splits the topic "kv@<pod>@<model>", decodes the positional arrays
 *    above, accepts hashes as unsigned integers, recomputes its own keys
 *    from token_ids in 16-token chunks chained from the parent's, and maps
 *    medium (lower-cased) to a device tier ("cpu" weighs 0.8 by default).
 *    Newer vLLM (vllm-project/vllm#42892) sends events as maps keyed by
 *    field name; llm-d reads both since llm-d-kv-cache#661, so the
 *    positional form is the one every consumer of the last year reads.
 *
 * Design:
 *  - The cache's listener runs under the cache's lock on the engine thread
 *    (or a fetch or HTTP thread): it copies a block's key, parent and tokens
 *    into a queue under our own short mutex and, when the queue was empty,
 *    wakes the publisher through an eventfd. Nothing else happens there.
 *  - The publisher thread polls the eventfd and the replay socket together
 *    (zmq_poll takes both), so a batch leaves as soon as it is queued and a
 *    replay is answered while the PUB side is idle. It takes the whole queue,
 *    folds runs of chained stores into one BlockStored and runs of removals
 *    into one BlockRemoved, encodes one batch with msgpack-c, sends it and
 *    keeps the bytes in a ring of buffer_steps batches for replays.
 *  - Both sockets are touched by the publisher thread only (ZeroMQ sockets
 *    are not thread-safe).
 *  - Hash: the first 8 bytes of the 128-bit key, big-endian, as an unsigned
 *    integer (routers take 64 bits; old consumers reject byte strings).
 *  - medium is "CPU": ember's memory tier is host memory. */
#define _GNU_SOURCE
#include "serve/serve_kv_events.h"

#include <errno.h>
#include <msgpack.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "core/log.h"

#define KVE_BLOCK 16
#define KVE_MEDIUM "CPU"
#define KVE_PUB_HWM 100000
#define KVE_MAX_BATCH 4096 /* records per message */

typedef enum rec_kind { REC_STORED, REC_REMOVED, REC_CLEARED } rec_kind;

typedef struct rec {
    rec_kind kind;
    bool has_parent;
    uint64_t hash, parent;
    int32_t tokens[KVE_BLOCK];
} rec;

typedef struct replay_slot {
    uint64_t seq;
    void *payload;
    size_t len;
} replay_slot;

struct kv_events {
    void *ctx, *pub, *router;
    int wake_fd;
    char *topic;
    size_t topic_len;
    pthread_t thread;
    bool thread_started;
    /* lock guards the queue, the counters and the flags */
    pthread_mutex_t lock;
    pthread_cond_t progress;  /* the publisher finished a round */
    rec *queue;
    size_t n_queue, cap_queue, max_pending;
    bool overflowed;          /* the queue was dropped: next batch opens with a clear */
    bool overflow_logged;
    bool stop;
    uint64_t n_accepted, n_sent; /* records queued / records the thread is done with */
    kv_events_stats stats;
    apc *cache;
    /* the thread's own */
    replay_slot *ring;
    size_t ring_cap, ring_head, ring_n;
};

void kv_events_default_topic(const char *model_id, char *out, size_t cap) {
    char host[256];
    if (gethostname(host, sizeof host) != 0 || host[0] == 0) snprintf(host, sizeof host, "ember");
    host[sizeof host - 1] = 0;
    snprintf(out, cap, "kv@%s@%s", host, model_id);
}

static uint64_t hash_of(const uint8_t key[16]) {
    uint64_t h = 0;
    for (int i = 0; i < 8; i++) h = h << 8 | key[i];
    return h;
}

static bool is_zero_key(const uint8_t key[16]) {
    for (int i = 0; i < 16; i++)
        if (key[i]) return false;
    return true;
}

static void put_be64(uint8_t out[8], uint64_t v) {
    for (int i = 7; i >= 0; i--, v >>= 8) out[i] = (uint8_t)v;
}

/* ---- the queue (any thread) ---- */

static void wake(kv_events *ev) {
    uint64_t one = 1;
    ssize_t w = write(ev->wake_fd, &one, sizeof one);
    (void)w; /* a full counter still wakes the reader */
}

/* Under ev->lock. */
static void enqueue_locked(kv_events *ev, const rec *r) {
    bool was_empty = ev->n_queue == 0;
    if (ev->n_queue == ev->max_pending) {
        /* The router would miss these blocks: make it forget instead. */
        ev->stats.dropped += ev->n_queue;
        ev->n_sent += ev->n_queue;
        ev->n_queue = 0;
        ev->overflowed = true;
        if (!ev->overflow_logged) {
            ev->overflow_logged = true;
            ember_log(EMBER_LOG_WARN, "KV events: the queue of %zu blocks overflowed (the publisher thread fell "
                      "behind the cache); sent AllBlocksCleared instead (logged once)", ev->max_pending);
        }
    }
    if (ev->n_queue == ev->cap_queue) {
        size_t cap = ev->cap_queue ? ev->cap_queue * 2 : 256;
        if (cap > ev->max_pending) cap = ev->max_pending;
        rec *q = realloc(ev->queue, cap * sizeof *q);
        if (q == NULL) { /* out of memory: the same as an overflow */
            ev->stats.dropped += ev->n_queue + 1;
            ev->n_sent += ev->n_queue;
            ev->n_queue = 0;
            ev->overflowed = true;
            ev->n_accepted++;
            ev->n_sent++;
            if (was_empty) wake(ev);
            return;
        }
        ev->queue = q;
        ev->cap_queue = cap;
    }
    ev->queue[ev->n_queue++] = *r;
    ev->n_accepted++;
    if (was_empty) wake(ev);
}

static void on_block(void *user, const apc_block_event *be) {
    kv_events *ev = user;
    rec r;
    memset(&r, 0, sizeof r);
    switch (be->change) {
    case APC_BLOCK_STORED:
    case APC_BLOCK_REMOVED:
        if (be->n_rows != KVE_BLOCK) return; /* partial tails are ember's own */
        r.kind = be->change == APC_BLOCK_STORED ? REC_STORED : REC_REMOVED;
        r.hash = hash_of(be->key);
        r.has_parent = !is_zero_key(be->parent);
        r.parent = r.has_parent ? hash_of(be->parent) : 0;
        if (r.kind == REC_STORED) memcpy(r.tokens, be->tokens, sizeof r.tokens);
        break;
    case APC_BLOCKS_CLEARED: r.kind = REC_CLEARED; break;
    default: return;
    }
    pthread_mutex_lock(&ev->lock);
    enqueue_locked(ev, &r);
    pthread_mutex_unlock(&ev->lock);
}

void kv_events_clear(kv_events *ev) {
    rec r;
    memset(&r, 0, sizeof r);
    r.kind = REC_CLEARED;
    pthread_mutex_lock(&ev->lock);
    enqueue_locked(ev, &r);
    pthread_mutex_unlock(&ev->lock);
}

void kv_events_attach(kv_events *ev, apc *c) {
    pthread_mutex_lock(&ev->lock);
    ev->cache = c;
    pthread_mutex_unlock(&ev->lock);
    apc_set_block_listener(c, on_block, ev);
}

void kv_events_detach(kv_events *ev) {
    pthread_mutex_lock(&ev->lock);
    apc *c = ev->cache;
    ev->cache = NULL;
    pthread_mutex_unlock(&ev->lock);
    if (c) apc_set_block_listener(c, NULL, NULL);
}

bool kv_events_flush(kv_events *ev, int timeout_ms) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&ev->lock);
    uint64_t want = ev->n_accepted;
    while (ev->n_sent < want && ev->thread_started) {
        if (pthread_cond_timedwait(&ev->progress, &ev->lock, &until) == ETIMEDOUT) break;
    }
    bool done = ev->n_sent >= want;
    pthread_mutex_unlock(&ev->lock);
    return done;
}

void kv_events_get_stats(kv_events *ev, kv_events_stats *out) {
    pthread_mutex_lock(&ev->lock);
    *out = ev->stats;
    pthread_mutex_unlock(&ev->lock);
}

/* ---- encoding (publisher thread) ---- */

static void pack_text(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

/* How many records from i on fold into one event. */
static size_t run_length(const rec *q, size_t i, size_t n) {
    size_t j = i + 1;
    if (q[i].kind == REC_STORED)
        while (j < n && q[j].kind == REC_STORED && q[j].has_parent && q[j].parent == q[j - 1].hash) j++;
    else if (q[i].kind == REC_REMOVED)
        while (j < n && q[j].kind == REC_REMOVED) j++;
    return j;
}

/* One batch of records [0, n) (a leading clear when cleared_first) into sb;
 * counts events into st. */
static void encode_batch(const rec *q, size_t n, bool cleared_first, msgpack_sbuffer *sb, kv_events_stats *st) {
    size_t n_events = cleared_first ? 1 : 0;
    for (size_t i = 0; i < n; i = run_length(q, i, n)) n_events++;
    msgpack_packer pk;
    msgpack_packer_init(&pk, sb, msgpack_sbuffer_write);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9);
    msgpack_pack_array(&pk, n_events);
    if (cleared_first) {
        msgpack_pack_array(&pk, 1);
        pack_text(&pk, "AllBlocksCleared");
        st->cleared++;
    }
    for (size_t i = 0; i < n;) {
        size_t j = run_length(q, i, n);
        switch (q[i].kind) {
        case REC_STORED:
            msgpack_pack_array(&pk, 7);
            pack_text(&pk, "BlockStored");
            msgpack_pack_array(&pk, j - i);
            for (size_t k = i; k < j; k++) msgpack_pack_uint64(&pk, q[k].hash);
            if (q[i].has_parent) msgpack_pack_uint64(&pk, q[i].parent);
            else msgpack_pack_nil(&pk);
            msgpack_pack_array(&pk, (j - i) * KVE_BLOCK);
            for (size_t k = i; k < j; k++)
                for (int t = 0; t < KVE_BLOCK; t++) msgpack_pack_int32(&pk, q[k].tokens[t]);
            msgpack_pack_int(&pk, KVE_BLOCK);
            msgpack_pack_nil(&pk); /* lora_id */
            pack_text(&pk, KVE_MEDIUM);
            st->stored += j - i;
            break;
        case REC_REMOVED:
            msgpack_pack_array(&pk, 3);
            pack_text(&pk, "BlockRemoved");
            msgpack_pack_array(&pk, j - i);
            for (size_t k = i; k < j; k++) msgpack_pack_uint64(&pk, q[k].hash);
            pack_text(&pk, KVE_MEDIUM);
            st->removed += j - i;
            break;
        case REC_CLEARED:
            msgpack_pack_array(&pk, 1);
            pack_text(&pk, "AllBlocksCleared");
            st->cleared++;
            break;
        }
        i = j;
    }
    msgpack_pack_int(&pk, 0); /* data_parallel_rank */
}

/* ---- the publisher thread ---- */

static void ring_push(kv_events *ev, uint64_t seq, const char *data, size_t len) {
    void *copy = malloc(len ? len : 1);
    if (copy == NULL) return; /* a replay will not have it */
    memcpy(copy, data, len);
    size_t slot = (ev->ring_head + ev->ring_n) % ev->ring_cap;
    if (ev->ring_n == ev->ring_cap) {
        free(ev->ring[ev->ring_head].payload);
        slot = ev->ring_head;
        ev->ring_head = (ev->ring_head + 1) % ev->ring_cap;
    } else {
        ev->ring_n++;
    }
    ev->ring[slot] = (replay_slot){seq, copy, len};
}

/* One message of n frames. A PUB socket never blocks: past its high-water
 * mark a subscriber misses the message and asks for a replay. */
static void send_frames(void *sock, const void *const *parts, const size_t *lens, int n) {
    for (int i = 0; i < n; i++) zmq_send(sock, parts[i], lens[i], i + 1 < n ? ZMQ_SNDMORE : 0);
}

static void publish(kv_events *ev, const rec *q, size_t n, bool cleared_first) {
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    kv_events_stats st;
    memset(&st, 0, sizeof st);
    encode_batch(q, n, cleared_first, &sb, &st);
    pthread_mutex_lock(&ev->lock);
    uint64_t seq = ev->stats.batches++;
    ev->stats.bytes += sb.size;
    ev->stats.stored += st.stored;
    ev->stats.removed += st.removed;
    ev->stats.cleared += st.cleared;
    pthread_mutex_unlock(&ev->lock);
    uint8_t seq_be[8];
    put_be64(seq_be, seq);
    const void *parts[3] = {ev->topic, seq_be, sb.data};
    size_t lens[3] = {ev->topic_len, 8, sb.size};
    send_frames(ev->pub, parts, lens, 3);
    ring_push(ev, seq, sb.data, sb.size);
    msgpack_sbuffer_destroy(&sb);
}

/* Receives one whole message of at most max frames (the rest discarded);
 * returns the frame count. */
static int recv_message(void *sock, zmq_msg_t *frames, int max) {
    int n = 0;
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            return n;
        }
        bool more = zmq_msg_more(&m);
        if (n < max) frames[n] = m;
        else zmq_msg_close(&m);
        n++;
        if (!more) return n;
    }
}

static void serve_replay(kv_events *ev) {
    zmq_msg_t f[3];
    int n = recv_message(ev->router, f, 3);
    int kept = n < 3 ? n : 3;
    if (n == 3 && zmq_msg_size(&f[2]) == 8) {
        const uint8_t *b = zmq_msg_data(&f[2]);
        uint64_t start = 0;
        for (int i = 0; i < 8; i++) start = start << 8 | b[i];
        const void *id = zmq_msg_data(&f[0]);
        size_t id_len = zmq_msg_size(&f[0]);
        for (size_t k = 0; k < ev->ring_n; k++) {
            const replay_slot *s = &ev->ring[(ev->ring_head + k) % ev->ring_cap];
            if (s->seq < start) continue;
            uint8_t seq_be[8];
            put_be64(seq_be, s->seq);
            const void *parts[4] = {id, "", seq_be, s->payload};
            size_t lens[4] = {id_len, 0, 8, s->len};
            send_frames(ev->router, parts, lens, 4);
        }
        uint8_t end[8];
        memset(end, 0xff, sizeof end); /* -1, the end marker */
        const void *parts[4] = {id, "", end, ""};
        size_t lens[4] = {id_len, 0, 8, 0};
        send_frames(ev->router, parts, lens, 4);
        pthread_mutex_lock(&ev->lock);
        ev->stats.replays++;
        pthread_mutex_unlock(&ev->lock);
    }
    for (int i = 0; i < kept; i++) zmq_msg_close(&f[i]);
}

static void *publisher_main(void *arg) {
    kv_events *ev = arg;
    rec *batch = malloc(KVE_MAX_BATCH * sizeof *batch);
    for (;;) {
        zmq_pollitem_t items[2] = {{NULL, ev->wake_fd, ZMQ_POLLIN, 0}, {ev->router, 0, ZMQ_POLLIN, 0}};
        int rc = zmq_poll(items, ev->router ? 2 : 1, 1000);
        if (rc < 0 && zmq_errno() != EINTR) {
            ember_log(EMBER_LOG_WARN, "KV events: the publisher stops: %s", zmq_strerror(zmq_errno()));
            break;
        }
        if (items[0].revents & ZMQ_POLLIN) {
            uint64_t v;
            ssize_t r = read(ev->wake_fd, &v, sizeof v);
            (void)r;
        }
        if (ev->router && (items[1].revents & ZMQ_POLLIN)) serve_replay(ev);
        /* Everything queued, in batches of at most KVE_MAX_BATCH records. */
        for (;;) {
            pthread_mutex_lock(&ev->lock);
            size_t n = ev->n_queue < KVE_MAX_BATCH ? ev->n_queue : KVE_MAX_BATCH;
            bool cleared_first = ev->overflowed;
            ev->overflowed = false;
            if (batch == NULL) { /* out of memory: nothing can be sent */
                ev->stats.dropped += ev->n_queue;
                n = 0;
                ev->n_sent += ev->n_queue;
                ev->n_queue = 0;
                cleared_first = false;
            }
            if (n) {
                memcpy(batch, ev->queue, n * sizeof *batch);
                memmove(ev->queue, ev->queue + n, (ev->n_queue - n) * sizeof *ev->queue);
                ev->n_queue -= n;
            }
            pthread_mutex_unlock(&ev->lock);
            if (n == 0 && !cleared_first) break;
            publish(ev, batch, n, cleared_first);
            pthread_mutex_lock(&ev->lock);
            ev->n_sent += n;
            pthread_cond_broadcast(&ev->progress);
            pthread_mutex_unlock(&ev->lock);
        }
        pthread_mutex_lock(&ev->lock);
        bool stop = ev->stop && ev->n_queue == 0;
        pthread_cond_broadcast(&ev->progress);
        pthread_mutex_unlock(&ev->lock);
        if (stop) break;
    }
    free(batch);
    return NULL;
}

/* ---- lifetime ---- */

/* vLLM's rule: a wildcard address or a local transport is ours to bind;
 * any other address is a consumer's, to connect to. */
static bool binds(const char *endpoint) {
    return strchr(endpoint, '*') || strstr(endpoint, "::") || strncmp(endpoint, "ipc://", 6) == 0 ||
           strncmp(endpoint, "inproc://", 9) == 0;
}

kv_events *kv_events_create(const kv_events_config *cfg, ember_error *err) {
    if (cfg->endpoint == NULL || cfg->endpoint[0] == 0) {
        ember_fail(err, "KV events: no endpoint");
        return NULL;
    }
    kv_events *ev = calloc(1, sizeof *ev);
    if (ev == NULL) {
        ember_fail(err, "KV events: out of memory");
        return NULL;
    }
    ev->wake_fd = -1;
    pthread_mutex_init(&ev->lock, NULL);
    pthread_cond_init(&ev->progress, NULL);
    ev->max_pending = cfg->max_pending > 0 ? (size_t)cfg->max_pending : 100000;
    ev->ring_cap = cfg->buffer_steps > 0 ? (size_t)cfg->buffer_steps : 10000;
    ev->topic = strdup(cfg->topic ? cfg->topic : "");
    ev->topic_len = ev->topic ? strlen(ev->topic) : 0;
    ev->ring = calloc(ev->ring_cap, sizeof *ev->ring);
    ev->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    ev->ctx = zmq_ctx_new();
    if (ev->topic == NULL || ev->ring == NULL || ev->wake_fd < 0 || ev->ctx == NULL) {
        ember_fail(err, "KV events: out of memory or descriptors");
        goto fail;
    }
    ev->pub = zmq_socket(ev->ctx, ZMQ_PUB);
    if (ev->pub == NULL) {
        ember_fail(err, "KV events: cannot create a ZeroMQ PUB socket: %s", zmq_strerror(zmq_errno()));
        goto fail;
    }
    int hwm = KVE_PUB_HWM, linger = 1000;
    zmq_setsockopt(ev->pub, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(ev->pub, ZMQ_LINGER, &linger, sizeof linger);
    bool bind_pub = binds(cfg->endpoint);
    if ((bind_pub ? zmq_bind(ev->pub, cfg->endpoint) : zmq_connect(ev->pub, cfg->endpoint)) != 0) {
        ember_fail(err, "server.kv_events.endpoint: cannot %s '%s': %s", bind_pub ? "bind" : "connect to",
                   cfg->endpoint, zmq_strerror(zmq_errno()));
        goto fail;
    }
    if (cfg->replay_endpoint && cfg->replay_endpoint[0]) {
        ev->router = zmq_socket(ev->ctx, ZMQ_ROUTER);
        int zero = 0;
        if (ev->router) zmq_setsockopt(ev->router, ZMQ_LINGER, &zero, sizeof zero);
        if (ev->router == NULL || zmq_bind(ev->router, cfg->replay_endpoint) != 0) {
            ember_fail(err, "server.kv_events.replay_endpoint: cannot bind '%s': %s", cfg->replay_endpoint,
                       zmq_strerror(zmq_errno()));
            goto fail;
        }
    }
    ev->thread_started = pthread_create(&ev->thread, NULL, publisher_main, ev) == 0;
    if (!ev->thread_started) {
        ember_fail(err, "KV events: cannot start the publisher thread");
        goto fail;
    }
    ember_log(EMBER_LOG_INFO, "KV events: publishing on %s (%s) as topic '%s'%s%s", cfg->endpoint,
              bind_pub ? "bound" : "connected", ev->topic, ev->router ? ", replays on " : "",
              ev->router ? cfg->replay_endpoint : "");
    return ev;
fail:
    kv_events_free(ev);
    return NULL;
}

void kv_events_free(kv_events *ev) {
    if (ev == NULL) return;
    kv_events_detach(ev);
    if (ev->thread_started) {
        kv_events_flush(ev, 2000);
        pthread_mutex_lock(&ev->lock);
        ev->stop = true;
        ev->n_sent += ev->n_queue; /* whatever the flush left is dropped */
        ev->n_queue = 0;
        pthread_mutex_unlock(&ev->lock);
        wake(ev);
        pthread_join(ev->thread, NULL);
    }
    if (ev->router) zmq_close(ev->router);
    if (ev->pub) zmq_close(ev->pub);
    if (ev->ctx) zmq_ctx_term(ev->ctx);
    if (ev->wake_fd >= 0) close(ev->wake_fd);
    for (size_t k = 0; ev->ring && k < ev->ring_n; k++) free(ev->ring[(ev->ring_head + k) % ev->ring_cap].payload);
    free(ev->ring);
    free(ev->queue);
    free(ev->topic);
    pthread_mutex_destroy(&ev->lock);
    pthread_cond_destroy(&ev->progress);
    free(ev);
}
