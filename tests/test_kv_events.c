/* test_kv_events.c - KV events (serve_kv_events.h) as a router sees them.
 *
 * A subscriber in this process (libzmq SUB, plus a DEALER for replays)
 * reads what ember publishes and decodes it with msgpack-c's own unpacker,
 * checking the wire format field by field: three frames (topic, 8-byte
 * big-endian sequence, payload), the batch [float ts, [events], 0], events
 * as positional arrays [tag, fields...] with vLLM's field counts and types.
 * The subscriber follows vLLM's example consumer: a gap in the sequence
 * numbers (the publisher sends before a SUB's subscription has arrived, or
 * the subscriber was away) is filled from the replay socket, and the
 * batches it hands to the tests are exactly 0, 1, 2, ... in order.
 *
 * On an engine in-process (a tiny qwen3 made by `ember mkmodel`): every
 * stored block carries the 16 token ids of its place in prompt + reply,
 * chained by parent hashes from a nil parent; a second prompt sharing two
 * blocks chains its new blocks onto them and restores none; a small pool
 * removes blocks, and what the events say is findable agrees with what the
 * cache finds (apc_peek); a reset is an AllBlocksCleared; missed batches
 * come back from the replay buffer, which keeps only buffer_steps; a queue
 * that overflows turns into a counted drop and a clear. End to
 * end, `ember serve --kv-events-endpoint` publishes the same for an HTTP
 * request sent as token ids, under the topic kv@<host>@<model>, a clear at
 * start, at POST /v1/cache/reset and at SIGTERM. */
#define _GNU_SOURCE
#include <msgpack.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.h>

#include "engine/engine.h"
#include "http_client.h"
#include "serve/serve_kv_events.h"
#include "serve/serve_metrics.h"
#include "test_util.h"

static char *g_dir;
static char g_model[512];

/* ---- decoded events ---- */

enum { EV_STORED, EV_REMOVED, EV_CLEARED };

typedef struct tev {
    int kind;
    uint64_t *hashes;
    int n_hashes;
    bool has_parent;
    uint64_t parent;
    int32_t *tokens;
    int n_tokens;
} tev;

typedef struct tbatch {
    uint64_t seq;
    tev *ev;
    int n_ev;
} tbatch;

static void tbatch_free(tbatch *b) {
    for (int i = 0; i < b->n_ev; i++) {
        free(b->ev[i].hashes);
        free(b->ev[i].tokens);
    }
    free(b->ev);
    memset(b, 0, sizeof *b);
}

static bool is_str(const msgpack_object *o, const char *s) {
    return o->type == MSGPACK_OBJECT_STR && o->via.str.size == strlen(s) && memcmp(o->via.str.ptr, s, o->via.str.size) == 0;
}

static uint64_t *uint_array(const msgpack_object *o, int *n) {
    assert_int_equal(o->type, MSGPACK_OBJECT_ARRAY);
    *n = (int)o->via.array.size;
    uint64_t *v = calloc((size_t)*n + 1, sizeof *v);
    for (int i = 0; i < *n; i++) {
        assert_int_equal(o->via.array.ptr[i].type, MSGPACK_OBJECT_POSITIVE_INTEGER);
        v[i] = o->via.array.ptr[i].via.u64;
    }
    return v;
}

/* Decodes a payload strictly (fails the test on any deviation). */
static void decode_batch(const void *data, size_t len, uint64_t seq, tbatch *out) {
    memset(out, 0, sizeof *out);
    out->seq = seq;
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    assert_int_equal(msgpack_unpack_next(&u, data, len, &off), MSGPACK_UNPACK_SUCCESS);
    assert_int_equal(off, len); /* one object, nothing after it */
    const msgpack_object *b = &u.data;
    assert_int_equal(b->type, MSGPACK_OBJECT_ARRAY);
    assert_int_equal(b->via.array.size, 3);
    const msgpack_object *ts = &b->via.array.ptr[0], *evs = &b->via.array.ptr[1], *dp = &b->via.array.ptr[2];
    assert_true(ts->type == MSGPACK_OBJECT_FLOAT64);
    assert_true(ts->via.f64 > 1.6e9); /* seconds since the epoch */
    assert_int_equal(dp->type, MSGPACK_OBJECT_POSITIVE_INTEGER);
    assert_int_equal(dp->via.u64, 0);
    assert_int_equal(evs->type, MSGPACK_OBJECT_ARRAY);
    out->n_ev = (int)evs->via.array.size;
    out->ev = calloc((size_t)out->n_ev + 1, sizeof *out->ev);
    for (int i = 0; i < out->n_ev; i++) {
        const msgpack_object *e = &evs->via.array.ptr[i];
        tev *t = &out->ev[i];
        assert_int_equal(e->type, MSGPACK_OBJECT_ARRAY);
        assert_true(e->via.array.size >= 1);
        const msgpack_object *f = e->via.array.ptr;
        if (is_str(&f[0], "BlockStored")) {
            t->kind = EV_STORED;
            assert_int_equal(e->via.array.size, 7);
            t->hashes = uint_array(&f[1], &t->n_hashes);
            assert_true(t->n_hashes >= 1);
            if (f[2].type == MSGPACK_OBJECT_NIL) {
                t->has_parent = false;
            } else {
                assert_int_equal(f[2].type, MSGPACK_OBJECT_POSITIVE_INTEGER);
                t->has_parent = true;
                t->parent = f[2].via.u64;
            }
            int n;
            uint64_t *tok = uint_array(&f[3], &n);
            t->n_tokens = n;
            t->tokens = calloc((size_t)n + 1, sizeof *t->tokens);
            for (int k = 0; k < n; k++) t->tokens[k] = (int32_t)tok[k];
            free(tok);
            assert_int_equal(f[4].type, MSGPACK_OBJECT_POSITIVE_INTEGER);
            assert_int_equal(f[4].via.u64, 16);                  /* block_size */
            assert_int_equal(t->n_tokens, 16 * t->n_hashes);      /* 16 token ids per block */
            assert_int_equal(f[5].type, MSGPACK_OBJECT_NIL);      /* lora_id */
            assert_true(is_str(&f[6], "CPU"));                    /* medium */
        } else if (is_str(&f[0], "BlockRemoved")) {
            t->kind = EV_REMOVED;
            assert_int_equal(e->via.array.size, 3);
            t->hashes = uint_array(&f[1], &t->n_hashes);
            assert_true(t->n_hashes >= 1);
            assert_true(is_str(&f[2], "CPU"));
        } else {
            assert_true(is_str(&f[0], "AllBlocksCleared"));
            assert_int_equal(e->via.array.size, 1);
            t->kind = EV_CLEARED;
        }
    }
    msgpack_unpacked_destroy(&u);
}

/* ---- the subscriber ---- */

typedef struct sub {
    void *ctx, *sub, *replay;
    char topic[256];          /* the topic every message must carry ("" = learn it from the first) */
    uint64_t next;            /* the next sequence number owed to the test */
    tbatch *got;              /* batches 0 .. next-1 */
    int n_got, cap_got;
    int replays;              /* replay requests made */
} sub;

static uint64_t be64(const void *p) {
    const uint8_t *b = p;
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = v << 8 | b[i];
    return v;
}

static void sub_open(sub *s, const char *endpoint, bool bind, const char *replay_endpoint, const char *topic) {
    memset(s, 0, sizeof *s);
    s->ctx = zmq_ctx_new();
    s->sub = zmq_socket(s->ctx, ZMQ_SUB);
    assert_non_null(s->sub);
    assert_int_equal(bind ? zmq_bind(s->sub, endpoint) : zmq_connect(s->sub, endpoint), 0);
    assert_int_equal(zmq_setsockopt(s->sub, ZMQ_SUBSCRIBE, "kv@", 3), 0);
    if (replay_endpoint) {
        s->replay = zmq_socket(s->ctx, ZMQ_DEALER);
        assert_int_equal(zmq_connect(s->replay, replay_endpoint), 0);
    }
    snprintf(s->topic, sizeof s->topic, "%s", topic ? topic : "");
}

static void sub_close(sub *s) {
    int zero = 0;
    if (s->sub) zmq_setsockopt(s->sub, ZMQ_LINGER, &zero, sizeof zero), zmq_close(s->sub);
    if (s->replay) zmq_setsockopt(s->replay, ZMQ_LINGER, &zero, sizeof zero), zmq_close(s->replay);
    zmq_ctx_term(s->ctx);
    for (int i = 0; i < s->n_got; i++) tbatch_free(&s->got[i]);
    free(s->got);
    memset(s, 0, sizeof *s);
}

static void take(sub *s, uint64_t seq, const void *payload, size_t len) {
    if (seq != s->next) return; /* a duplicate, or beyond a gap the caller fills first */
    if (s->n_got == s->cap_got) {
        s->cap_got = s->cap_got ? s->cap_got * 2 : 64;
        s->got = realloc(s->got, (size_t)s->cap_got * sizeof *s->got);
    }
    decode_batch(payload, len, seq, &s->got[s->n_got++]);
    s->next++;
}

/* Asks for every batch from s->next on; returns how many came back (those
 * in order from s->next are taken). */
static int sub_replay(sub *s) {
    assert_non_null(s->replay);
    s->replays++;
    uint8_t start[8];
    for (int i = 0; i < 8; i++) start[i] = (uint8_t)(s->next >> (56 - 8 * i));
    assert_int_equal(zmq_send(s->replay, "", 0, ZMQ_SNDMORE), 0);
    assert_int_equal(zmq_send(s->replay, start, 8, 0), 8);
    int n = 0;
    for (;;) {
        zmq_pollitem_t it = {s->replay, 0, ZMQ_POLLIN, 0};
        assert_int_equal(zmq_poll(&it, 1, 5000), 1);
        zmq_msg_t f[3];
        for (int i = 0; i < 3; i++) {
            zmq_msg_init(&f[i]);
            assert_true(zmq_msg_recv(&f[i], s->replay, 0) >= 0);
            assert_int_equal(zmq_msg_more(&f[i]), i < 2);
        }
        assert_int_equal(zmq_msg_size(&f[0]), 0);
        assert_int_equal(zmq_msg_size(&f[1]), 8);
        uint64_t seq = be64(zmq_msg_data(&f[1]));
        bool end = seq == UINT64_MAX;
        if (end) assert_int_equal(zmq_msg_size(&f[2]), 0);
        else {
            take(s, seq, zmq_msg_data(&f[2]), zmq_msg_size(&f[2]));
            n++;
        }
        for (int i = 0; i < 3; i++) zmq_msg_close(&f[i]);
        if (end) return n;
    }
}

/* Reads live messages for up to wait_ms (returns at the first one); a
 * gap is filled by a replay. Returns whether anything new arrived. */
static bool sub_poll(sub *s, int wait_ms) {
    zmq_pollitem_t it = {s->sub, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, wait_ms) != 1) return false;
    zmq_msg_t f[3];
    for (int i = 0; i < 3; i++) {
        zmq_msg_init(&f[i]);
        assert_true(zmq_msg_recv(&f[i], s->sub, 0) >= 0);
        assert_int_equal(zmq_msg_more(&f[i]), i < 2); /* exactly three frames */
    }
    char topic[256];
    size_t tl = zmq_msg_size(&f[0]);
    assert_true(tl < sizeof topic);
    memcpy(topic, zmq_msg_data(&f[0]), tl);
    topic[tl] = 0;
    if (s->topic[0] == 0) snprintf(s->topic, sizeof s->topic, "%s", topic);
    assert_string_equal(topic, s->topic);
    assert_int_equal(zmq_msg_size(&f[1]), 8);
    uint64_t seq = be64(zmq_msg_data(&f[1]));
    uint64_t before = s->next;
    if (seq > s->next && s->replay) sub_replay(s);
    take(s, seq, zmq_msg_data(&f[2]), zmq_msg_size(&f[2]));
    for (int i = 0; i < 3; i++) zmq_msg_close(&f[i]);
    return s->next > before;
}

/* Until the test holds batches 0 .. n-1 (timeout: fail). */
static void sub_until(sub *s, uint64_t n) {
    for (int i = 0; i < 200 && s->next < n; i++)
        if (!sub_poll(s, 50) && s->next < n && s->replay) sub_replay(s);
    if (s->next < n) fail_msg("got batches up to %llu of %llu", (unsigned long long)s->next, (unsigned long long)n);
}

/* ---- what the events say is findable ---- */

typedef struct blk {
    uint64_t hash, parent;
    bool has_parent, live;
    int32_t tokens[16];
} blk;

typedef struct view {
    blk *b;
    int n, cap;
    int stored, removed, cleared;
} view;

static blk *view_find(view *v, uint64_t h) {
    for (int i = v->n - 1; i >= 0; i--)
        if (v->b[i].hash == h) return &v->b[i];
    return NULL;
}

/* Applies batches [from, s->n_got); a removal must name a live block. */
static void view_apply(view *v, const sub *s, int from) {
    for (int i = from; i < s->n_got; i++)
        for (int j = 0; j < s->got[i].n_ev; j++) {
            const tev *e = &s->got[i].ev[j];
            if (e->kind == EV_CLEARED) {
                v->cleared++;
                for (int k = 0; k < v->n; k++) v->b[k].live = false;
                continue;
            }
            for (int k = 0; k < e->n_hashes; k++) {
                if (e->kind == EV_REMOVED) {
                    blk *b = view_find(v, e->hashes[k]);
                    assert_non_null(b);
                    assert_true(b->live);
                    b->live = false;
                    v->removed++;
                    continue;
                }
                blk *b = view_find(v, e->hashes[k]);
                if (b && b->live) fail_msg("block %016llx stored twice", (unsigned long long)e->hashes[k]);
                if (v->n == v->cap) {
                    v->cap = v->cap ? v->cap * 2 : 64;
                    v->b = realloc(v->b, (size_t)v->cap * sizeof *v->b);
                }
                b = &v->b[v->n++];
                b->hash = e->hashes[k];
                /* within one event, each block's parent is the one before it */
                b->has_parent = k > 0 || e->has_parent;
                b->parent = k > 0 ? e->hashes[k - 1] : e->parent;
                b->live = true;
                memcpy(b->tokens, e->tokens + 16 * k, sizeof b->tokens);
                v->stored++;
            }
        }
}

/* The stored block holding tokens[16k, 16k+16) of this sequence, found by
 * walking the parent chain from a nil parent; NULL when the chain stops. */
static blk *chain_block(view *v, const int32_t *tokens, int k) {
    blk *prev = NULL;
    for (int i = 0; i <= k; i++) {
        blk *found = NULL;
        for (int j = v->n - 1; j >= 0 && !found; j--) {
            blk *b = &v->b[j];
            bool parent_ok = prev ? b->has_parent && b->parent == prev->hash : !b->has_parent;
            if (parent_ok && memcmp(b->tokens, tokens + 16 * i, sizeof b->tokens) == 0) found = b;
        }
        if (found == NULL) return NULL;
        prev = found;
    }
    return prev;
}

/* ---- an engine with a publisher ---- */

static model *g_m;

typedef struct rig {
    engine *e;
    kv_events *ev;
    sub s;
    char ep[600], rep[600];
} rig;

static void rig_open_q(rig *r, const char *name, int32_t num_blocks, int buffer_steps, int max_pending) {
    memset(r, 0, sizeof *r);
    engine_config cfg = engine_default_config();
    cfg.n_threads = 2;
    cfg.num_blocks = num_blocks;
    r->e = test_open_engine(g_m, &cfg);
    snprintf(r->rep, sizeof r->rep, "ipc://%s/%s.replay", g_dir, name);
    /* Like llm-d's indexer: the subscriber binds (any free port) and the
     * publisher, given an address without a wildcard, connects to it. */
    sub_open(&r->s, "tcp://127.0.0.1:*", true, r->rep, "kv@test-pod@tiny");
    size_t len = sizeof r->ep;
    assert_int_equal(zmq_getsockopt(r->s.sub, ZMQ_LAST_ENDPOINT, r->ep, &len), 0);
    kv_events_config kc = {r->ep, r->rep, "kv@test-pod@tiny", buffer_steps, max_pending};
    ember_error err;
    r->ev = kv_events_create(&kc, &err);
    if (r->ev == NULL) fail_msg("kv_events_create: %s", err.msg);
    kv_events_clear(r->ev);
    /* The start's clear leaves as its own batch 0 before any request runs:
     * a publisher thread scheduled late would otherwise fold it into the
     * first stores' batch (seen on a loaded 2-core box). */
    assert_true(kv_events_flush(r->ev, 5000));
    kv_events_attach(r->ev, engine_cache(r->e));
}

static void rig_open(rig *r, const char *name, int32_t num_blocks, int buffer_steps) {
    rig_open_q(r, name, num_blocks, buffer_steps, 0);
}

static void rig_close(rig *r) {
    kv_events_free(r->ev);
    sub_close(&r->s);
    engine_free(r->e);
}

/* Everything published so far, in the subscriber's hands. */
static void rig_sync(rig *r) {
    assert_true(kv_events_flush(r->ev, 5000));
    kv_events_stats st;
    kv_events_get_stats(r->ev, &st);
    sub_until(&r->s, st.batches);
}

/* prompt ++ reply of a greedy request (all: malloc'd, *n_all tokens). */
static int32_t *run(engine *e, const int32_t *prompt, int n, int max_tokens, int *n_all) {
    engine_result res;
    test_generate(e, prompt, n, max_tokens, ENGINE_CACHE_ON, &res);
    int32_t *all = malloc(((size_t)n + (size_t)res.n_tokens) * sizeof *all);
    memcpy(all, prompt, (size_t)n * sizeof *all);
    memcpy(all + n, res.tokens, (size_t)res.n_tokens * sizeof *all);
    *n_all = n + res.n_tokens;
    engine_result_free(&res);
    return all;
}

/* ---- tests ---- */

static void test_stored_chain_and_shared_prefix(void **state) {
    (void)state;
    rig r;
    rig_open(&r, "chain", 0, 0);
    uint64_t rng = 7;
    int32_t p1[40];
    test_random_tokens(&rng, p1, 40, 200);
    int n1;
    int32_t *all1 = run(r.e, p1, 40, 9, &n1); /* 49 tokens: 3 full blocks at most */
    rig_sync(&r);
    /* batch 0 is the clear sent at start */
    assert_true(r.s.n_got >= 2);
    assert_int_equal(r.s.got[0].n_ev, 1);
    assert_int_equal(r.s.got[0].ev[0].kind, EV_CLEARED);
    for (int i = 0; i < r.s.n_got; i++) assert_int_equal(r.s.got[i].seq, (uint64_t)i);
    view v = {0};
    view_apply(&v, &r.s, 0);
    /* every prompt block is stored, chained from a nil parent, with its tokens */
    for (int k = 0; k < 40 / 16; k++) assert_non_null(chain_block(&v, p1, k));
    /* and every stored block is a block of prompt + reply at its chain position */
    for (int i = 0; i < v.n; i++) {
        int depth = 0;
        for (blk *b = &v.b[i]; b->has_parent; b = view_find(&v, b->parent)) depth++;
        assert_true(16 * (depth + 1) <= n1);
        assert_memory_equal(v.b[i].tokens, all1 + 16 * depth, sizeof v.b[i].tokens);
    }
    int stored_before = v.stored;
    assert_int_equal(v.removed, 0);

    /* A second prompt sharing the first two blocks: its new blocks chain
     * onto block 1 of the first, and the shared ones are not stored again. */
    int32_t p2[56];
    memcpy(p2, p1, 32 * sizeof *p2);
    test_random_tokens(&rng, p2 + 32, 24, 200);
    p2[32] = (p1[32] + 1) % 200; /* diverges right after the shared blocks */
    int from = r.s.n_got, n2;
    int32_t *all2 = run(r.e, p2, 56, 4, &n2);
    rig_sync(&r);
    view_apply(&v, &r.s, from);
    assert_true(v.stored > stored_before);
    blk *shared = chain_block(&v, p1, 1);
    blk *third = chain_block(&v, p2, 2);
    assert_non_null(shared);
    assert_non_null(third);
    assert_true(third->has_parent);
    assert_int_equal(third->parent, shared->hash);
    for (int i = from; i < r.s.n_got; i++) /* the shared blocks never reappear */
        for (int j = 0; j < r.s.got[i].n_ev; j++)
            for (int k = 0; k < r.s.got[i].ev[j].n_hashes; k++) {
                assert_true(r.s.got[i].ev[j].hashes[k] != chain_block(&v, p1, 0)->hash);
                assert_true(r.s.got[i].ev[j].hashes[k] != shared->hash);
            }
    /* no replay was needed for what this subscriber saw, or it filled the
     * slow-joiner gap; either way the sequence has no hole */
    kv_events_stats st;
    kv_events_get_stats(r.ev, &st);
    assert_int_equal(st.batches, (uint64_t)r.s.n_got);
    assert_int_equal(st.stored, (uint64_t)v.stored);
    free(all1);
    free(all2);
    free(v.b);
    rig_close(&r);
}

static void test_removals_under_small_pool(void **state) {
    (void)state;
    rig r;
    rig_open(&r, "small", 24, 0);
    uint64_t rng = 99;
    enum { N = 10, LEN = 64 };
    int32_t prompts[N][LEN];
    for (int i = 0; i < N; i++) {
        test_random_tokens(&rng, prompts[i], LEN, 200);
        int n;
        free(run(r.e, prompts[i], LEN, 3, &n));
    }
    rig_sync(&r);
    view v = {0};
    view_apply(&v, &r.s, 0);
    apc_stats as;
    apc_get_stats(engine_cache(r.e), &as);
    assert_true(as.evictions > 0);
    assert_true(v.removed > 0);
    int live = 0;
    for (int i = 0; i < v.n; i++) live += v.b[i].live;
    assert_true(live <= 24);
    /* what the events call findable is what the cache finds */
    for (int i = 0; i < N; i++) {
        int64_t found = apc_peek(engine_cache(r.e), prompts[i], LEN, 0);
        int full = (int)(found / 16);
        for (int k = 0; k < full; k++) {
            blk *b = chain_block(&v, prompts[i], k);
            assert_non_null(b);
            assert_true(b->live);
        }
        if (found < LEN - 1) { /* the chain stops at block `full` */
            blk *b = chain_block(&v, prompts[i], full);
            assert_true(b == NULL || !b->live);
        }
    }
    free(v.b);
    rig_close(&r);
}

static void test_clear_on_reset(void **state) {
    (void)state;
    rig r;
    rig_open(&r, "reset", 0, 0);
    uint64_t rng = 5;
    int32_t p[48];
    test_random_tokens(&rng, p, 48, 200);
    int n;
    free(run(r.e, p, 48, 2, &n));
    rig_sync(&r);
    view v = {0};
    view_apply(&v, &r.s, 0);
    blk *b0 = chain_block(&v, p, 0);
    assert_non_null(b0);
    uint64_t h0 = b0->hash;
    int from = r.s.n_got;
    apc_reset(engine_cache(r.e));
    rig_sync(&r);
    assert_int_equal(r.s.n_got, from + 1);
    assert_int_equal(r.s.got[from].n_ev, 1);
    assert_int_equal(r.s.got[from].ev[0].kind, EV_CLEARED);
    view_apply(&v, &r.s, from);
    for (int i = 0; i < v.n; i++) assert_false(v.b[i].live);
    /* the same prompt again: the same content addresses are stored anew */
    from = r.s.n_got;
    free(run(r.e, p, 48, 2, &n));
    rig_sync(&r);
    view_apply(&v, &r.s, from);
    blk *again = chain_block(&v, p, 0);
    assert_non_null(again);
    assert_true(again->live);
    assert_int_equal(again->hash, h0);
    free(v.b);
    rig_close(&r);
}

static void test_replay_of_missed_batches(void **state) {
    (void)state;
    rig r;
    rig_open(&r, "replay", 0, 4);
    uint64_t rng = 11;
    int32_t p[40];
    int n;
    for (int i = 0; i < 6; i++) { /* at least one batch each: the flush sends it */
        test_random_tokens(&rng, p, 40, 200);
        free(run(r.e, p, 40, 2, &n));
        kv_events_flush(r.ev, 5000);
    }
    kv_events_stats st;
    kv_events_get_stats(r.ev, &st);
    assert_true(st.batches > 4);
    /* A subscriber that saw nothing asks from 0: only the last 4 remain. */
    r.s.next = 0;
    int got = sub_replay(&r.s);
    assert_int_equal(got, 4);
    assert_int_equal(r.s.n_got, 0); /* batch 0 is gone, so none of them is next */
    r.s.next = st.batches - 4;
    got = sub_replay(&r.s);
    assert_int_equal(got, 4);
    assert_int_equal(r.s.next, st.batches);
    for (int i = 0; i < r.s.n_got; i++) assert_int_equal(r.s.got[i].seq, st.batches - 4 + (uint64_t)i);
    /* Asking past the end gets only the end marker. */
    got = sub_replay(&r.s);
    assert_int_equal(got, 0);
    /* Live messages continue after the replayed ones without a hole: drain
     * whatever the SUB socket holds, then one more request. */
    while (sub_poll(&r.s, 100)) {
    }
    free(run(r.e, p, 40, 2, &n)); /* stores nothing new: the same prompt */
    test_random_tokens(&rng, p, 40, 200);
    free(run(r.e, p, 40, 2, &n));
    rig_sync(&r);
    kv_events_get_stats(r.ev, &st);
    assert_int_equal(r.s.next, st.batches);
    assert_int_equal(st.replays, (uint64_t)r.s.replays);
    rig_close(&r);
}

/* A queue that overflows is dropped and replaced by one AllBlocksCleared:
 * with room for one block, a store of twenty (reported in one burst under
 * the cache's lock) cannot be queued whole unless the publisher thread
 * drains every record before the next arrives. On a loaded machine it
 * sometimes does, so the test stores new prompts until one overflows
 * (at most 8; one is almost always enough). */
static void test_queue_overflow_clears(void **state) {
    (void)state;
    rig r;
    rig_open_q(&r, "overflow", 0, 0, 1);
    rig_sync(&r);
    int from = r.s.n_got;
    uint64_t rng = 21;
    int32_t p[330];
    kv_events_stats st;
    int stores = 0;
    do {
        test_random_tokens(&rng, p, 330, 200);
        int n;
        free(run(r.e, p, 330, 1, &n));
        stores++;
        rig_sync(&r);
        kv_events_get_stats(r.ev, &st);
    } while (st.dropped == 0 && stores < 8);
    if (stores > 1) print_message("overflow after %d stores of 20 blocks\n", stores);
    assert_true(st.dropped > 0);
    assert_true(st.stored + st.dropped >= 20 * (uint64_t)stores);
    assert_true(st.stored < 20 * (uint64_t)stores);
    bool clear_seen = false; /* after the start's */
    for (int i = from; i < r.s.n_got; i++)
        for (int j = 0; j < r.s.got[i].n_ev; j++) clear_seen |= r.s.got[i].ev[j].kind == EV_CLEARED;
    assert_true(clear_seen);
    rig_close(&r);
}

/* ember serve --kv-events-endpoint: a request sent as token ids, reset, SIGTERM. */
static void test_server_events(void **state) {
    (void)state;
    char ep[600], rep[600], log[600];
    snprintf(ep, sizeof ep, "ipc://%s/server.pub", g_dir);
    snprintf(rep, sizeof rep, "ipc://%s/server.replay", g_dir);
    snprintf(log, sizeof log, "%s/server.log", g_dir);
    char *extra[] = {(char *)"--kv-events-endpoint", ep, (char *)"--kv-events-replay-endpoint", rep, NULL};
    pid_t pid;
    int port = http_spawn_ember(ember_binary(), g_model, extra, log, &pid);
    assert_true(port > 0);
    sub s;
    sub_open(&s, ep, false, rep, NULL);
    int32_t prompt[40];
    char body[1024];
    int off = snprintf(body, sizeof body, "{\"prompt\":[");
    for (int i = 0; i < 40; i++) {
        prompt[i] = 3 + 5 * i;
        off += snprintf(body + off, sizeof body - (size_t)off, "%s%d", i ? "," : "", prompt[i]);
    }
    snprintf(body + off, sizeof body - (size_t)off, "],\"max_tokens\":2,\"temperature\":0}");
    char *resp = NULL;
    assert_int_equal(http_call(port, "POST", "/v1/completions", NULL, body, &resp), 200);
    free(resp);
    /* wait for the prompt's two full blocks */
    view v = {0};
    int from = 0;
    for (int i = 0; i < 100 && chain_block(&v, prompt, 1) == NULL; i++) {
        if (!sub_poll(&s, 50)) sub_replay(&s);
        view_apply(&v, &s, from);
        from = s.n_got;
    }
    assert_non_null(chain_block(&v, prompt, 1));
    assert_int_equal(s.got[0].ev[0].kind, EV_CLEARED); /* the start */
    int cleared = v.cleared;
    assert_int_equal(http_call(port, "POST", "/v1/cache/reset", NULL, "{}", &resp), 200);
    free(resp);
    for (int i = 0; i < 100 && v.cleared == cleared; i++) {
        if (!sub_poll(&s, 50)) sub_replay(&s);
        view_apply(&v, &s, from);
        from = s.n_got;
    }
    assert_int_equal(v.cleared, cleared + 1);
    /* the publisher's counters in /metrics */
    http_resp mr = http_request(port, "GET", "/metrics", NULL, NULL, 60);
    assert_int_equal(mr.status, 200);
    assert_true(serve_metrics_text_sum(mr.body, "ember_kv_events_batches_total") >= (double)s.n_got);
    assert_true(serve_metrics_text_sum(mr.body, "ember_kv_events_blocks_stored_total") >= 2);
    assert_true(serve_metrics_text_sum(mr.body, "ember_kv_events_cleared_total") == 2);
    assert_true(serve_metrics_text_sum(mr.body, "ember_kv_events_bytes_total") > 16 * 2);
    http_resp_free(&mr);
    /* SIGTERM: the last message clears this replica */
    kill(pid, SIGTERM);
    for (int i = 0; i < 100 && v.cleared == cleared + 1; i++) {
        sub_poll(&s, 50);
        view_apply(&v, &s, from);
        from = s.n_got;
    }
    assert_int_equal(v.cleared, cleared + 2);
    /* the default topic (learned from the live messages): kv@<host>@<model id> */
    assert_int_equal(strncmp(s.topic, "kv@", 3), 0);
    assert_true(strlen(s.topic) > 8 && strcmp(s.topic + strlen(s.topic) - 5, "@tiny") == 0);
    const tbatch *last = &s.got[s.n_got - 1];
    assert_int_equal(last->ev[last->n_ev - 1].kind, EV_CLEARED);
    assert_int_equal(http_stop_server(&pid, 10000), 0);
    free(v.b);
    sub_close(&s);
}

static void test_bad_endpoint_fails_start(void **state) {
    (void)state;
    char log[600];
    snprintf(log, sizeof log, "%s/bad.log", g_dir);
    char *extra[] = {(char *)"--kv-events-endpoint", (char *)"nonsense://x", NULL};
    pid_t pid;
    assert_true(http_spawn_ember(ember_binary(), g_model, extra, log, &pid) < 0);
    char *text = read_whole_file(log, NULL);
    assert_non_null(text);
    assert_non_null(strstr(text, "server.kv_events.endpoint"));
    free(text);
}

static int setup(void **state) {
    (void)state;
    if (ember_binary() == NULL) return -1;
    g_dir = make_temp_dir();
    snprintf(g_model, sizeof g_model, "%s/tiny.gguf", g_dir);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s mkmodel --arch qwen3 --preset tiny --seed 3 --out %s >/dev/null 2>&1",
             ember_binary(), g_model);
    if (system(cmd) != 0) return -1;
    g_m = test_load_model(g_model);
    return g_m ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    model_free(g_m);
    remove_tree(g_dir);
    free(g_dir);
    return 0;
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    if (ember_binary() == NULL) {
        print_message("skipping: EMBER_BIN is not set (run under ctest)\n");
        return TEST_SKIP_EXIT;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stored_chain_and_shared_prefix),
        cmocka_unit_test(test_removals_under_small_pool),
        cmocka_unit_test(test_clear_on_reset),
        cmocka_unit_test(test_replay_of_missed_batches),
        cmocka_unit_test(test_queue_overflow_clears),
        cmocka_unit_test(test_server_events),
        cmocka_unit_test(test_bad_endpoint_fails_start),
    };
    return test_run_group(tests, setup, teardown);
}
