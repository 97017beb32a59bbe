/* test_threadpool.c - the pool's contract (threadpool.h): every part of a
 * task runs exactly once with the task's nth, parts are claimed by whichever
 * thread runs (a stalled worker's share is taken by the others instead of
 * being waited for), each thread runs its own contiguous range of parts in
 * order before it takes the others' from their back, late workers never run a finished task's parts, and a
 * model forward gives the same bits with 1, 2 and 3 threads. Also the
 * pool's counters, and what a decode step asks of the pool: one task per
 * group of matmuls over one input (q/k/v, gate/up), attention, wo, down,
 * and the LM head, with the step's time accounted to the profile classes;
 * and the governor that has the caller work alone while workers stall;
 * and the thread slots that per-thread scratch is indexed by. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/clock.h"
#include "core/threadpool.h"
#include "model/model.h"
#include "test_util.h"

enum { MAX_PARTS_TESTED = 64 };

typedef struct count_task {
    atomic_int runs[MAX_PARTS_TESTED];
    atomic_int bad_nth;
    int nth;
    long *scratch; /* one slot per part: a part's own, never shared */
} count_task;

static void count_part(void *arg, int ith, int nth) {
    count_task *t = arg;
    if (nth != t->nth || ith < 0 || ith >= nth) {
        atomic_fetch_add(&t->bad_nth, 1);
        return;
    }
    atomic_fetch_add(&t->runs[ith], 1);
    /* Non-atomic per-part scratch: two overlapping calls with one ith would
     * race here (ASan/TSan builds) and break the sum check below. */
    for (int i = 0; i < 100; i++) t->scratch[ith] += i;
}

static void test_every_part_once(void **state) {
    (void)state;
    long scratch[MAX_PARTS_TESTED];
    for (int threads = 1; threads <= 4; threads++) {
        ember_pool *pool = ember_pool_create(threads);
        assert_non_null(pool);
        assert_int_equal(ember_pool_size(pool), threads);
        for (int iter = 0; iter < 300; iter++) {
            int parts = 1 + (iter * 7) % MAX_PARTS_TESTED;
            bool plain = iter % 5 == 0; /* ember_pool_run: nth = pool size */
            count_task t = {.nth = plain ? threads : parts, .scratch = scratch};
            memset(scratch, 0, sizeof scratch);
            if (plain) ember_pool_run(pool, count_part, &t);
            else ember_pool_run_parts(pool, count_part, &t, parts);
            assert_int_equal(atomic_load(&t.bad_nth), 0);
            for (int i = 0; i < MAX_PARTS_TESTED; i++) {
                assert_int_equal(atomic_load(&t.runs[i]), i < t.nth ? 1 : 0);
                assert_int_equal(scratch[i], i < t.nth ? 4950 : 0);
            }
        }
        ember_pool_free(pool);
    }
    /* NULL pool: the caller alone, every part in order. */
    count_task t = {.nth = 5, .scratch = scratch};
    memset(scratch, 0, sizeof scratch);
    ember_pool_run_parts(NULL, count_part, &t, 5);
    for (int i = 0; i < 5; i++) assert_int_equal(atomic_load(&t.runs[i]), 1);
}

/* ember_pool_thread_slot: per-thread scratch with one slot per thread is
 * private to the part running on it, however many parts a task has. Each
 * part marks its slot busy, works a while, and frees it: a slot outside
 * [0, size), or one already busy (two running parts sharing scratch), is
 * counted. The caller's slot is 0, and a caller that is itself another
 * pool's worker gets its own slot back after. */
typedef struct slot_task {
    atomic_int busy[8];
    atomic_int bad;
    atomic_int used[8];
    int size;
    ember_pool *inner; /* run a task on this pool from inside each part */
} slot_task;

static void slot_part(void *arg, int ith, int nth);

static void slot_inner_part(void *arg, int ith, int nth) {
    (void)ith;
    (void)nth;
    slot_task *t = arg;
    int slot = ember_pool_thread_slot();
    if (slot < 0 || slot >= t->size) atomic_fetch_add(&t->bad, 1);
}

static void slot_part(void *arg, int ith, int nth) {
    (void)ith;
    (void)nth;
    slot_task *t = arg;
    int slot = ember_pool_thread_slot();
    if (slot < 0 || slot >= t->size) {
        atomic_fetch_add(&t->bad, 1);
        return;
    }
    atomic_fetch_add(&t->used[slot], 1);
    if (atomic_exchange(&t->busy[slot], 1) != 0) atomic_fetch_add(&t->bad, 1);
    struct timespec ts = {0, 20000};
    nanosleep(&ts, NULL);
    if (t->inner) { /* a one-thread pool: the part runs it as the caller, slot 0 */
        slot_task inner = {.size = 1};
        ember_pool_run_parts(t->inner, slot_inner_part, &inner, 3);
        if (atomic_load(&inner.bad) != 0 || ember_pool_thread_slot() != slot) atomic_fetch_add(&t->bad, 1);
    }
    atomic_store(&t->busy[slot], 0);
}

static void test_thread_slots_private(void **state) {
    (void)state;
    for (int threads = 1; threads <= 4; threads++) {
        ember_pool *pool = ember_pool_create(threads);
        assert_non_null(pool);
        int total_used_workers = 0;
        for (int iter = 0; iter < 40; iter++) {
            slot_task t = {.size = threads, .inner = NULL};
            ember_pool *inner = iter % 4 == 0 ? ember_pool_create(1) : NULL;
            t.inner = inner;
            ember_pool_run_parts(pool, slot_part, &t, 1 + iter % 37);
            ember_pool_free(inner);
            assert_int_equal(atomic_load(&t.bad), 0);
            assert_int_equal(ember_pool_thread_slot(), 0);
            for (int s = 1; s < threads; s++) total_used_workers += atomic_load(&t.used[s]) > 0;
        }
        /* the workers did run parts, in their own slots */
        if (threads > 1) assert_true(total_used_workers > 0);
        ember_pool_free(pool);
    }
}

/* A worker that stalls inside a part (as a descheduled one does) must not
 * hold back the others: the caller takes every other part. The stalled part
 * waits until the caller has run all the rest, which never happens if parts
 * are assigned to threads instead of claimed; it gives up after 10 s and
 * the test fails. */
typedef struct stall_task {
    pthread_t caller;
    int parts;
    atomic_int caller_parts;
    atomic_int worker_parts;
    atomic_int timed_out;
} stall_task;

static void stall_part(void *arg, int ith, int nth) {
    (void)ith;
    (void)nth;
    stall_task *t = arg;
    if (pthread_equal(pthread_self(), t->caller)) {
        /* Slow enough that the worker wakes up and claims a part. */
        struct timespec ts = {0, 300000};
        nanosleep(&ts, NULL);
        atomic_fetch_add(&t->caller_parts, 1);
        return;
    }
    atomic_fetch_add(&t->worker_parts, 1);
    double deadline = ember_now() + 10.0;
    while (atomic_load(&t->caller_parts) + 1 < t->parts) {
        if (ember_now() > deadline) {
            atomic_store(&t->timed_out, 1);
            return;
        }
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
}

static void test_stalled_worker_share_is_taken(void **state) {
    (void)state;
    ember_pool *pool = ember_pool_create(2);
    assert_non_null(pool);
    int worker_rounds = 0;
    /* The worker may be too late to claim anything in a round (then the
     * caller ran every part, also right); keep going until it took one. */
    for (int round = 0; round < 200 && worker_rounds < 3; round++) {
        stall_task t = {.caller = pthread_self(), .parts = 8};
        ember_pool_run_parts(pool, stall_part, &t, t.parts);
        assert_int_equal(atomic_load(&t.timed_out), 0);
        assert_int_equal(atomic_load(&t.caller_parts) + atomic_load(&t.worker_parts), t.parts);
        if (atomic_load(&t.worker_parts) > 0) {
            assert_int_equal(atomic_load(&t.worker_parts), 1);
            worker_rounds++;
        }
        /* Let the worker fall asleep sometimes, so both wake paths run. */
        if (round % 2) {
            struct timespec ts = {0, 2000000};
            nanosleep(&ts, NULL);
        }
    }
    assert_true(worker_rounds > 0);
    ember_pool_free(pool);
}

/* Many tiny tasks back to back: a worker that wakes late must find its
 * generation gone and never run a part of a finished (or the next) task with
 * the wrong context. Each task checks its own context identity. */
typedef struct tiny_task {
    unsigned id;
    unsigned *expected_id;
    atomic_int *wrong;
    atomic_int runs;
} tiny_task;

static void tiny_part(void *arg, int ith, int nth) {
    (void)ith;
    (void)nth;
    tiny_task *t = arg;
    if (t->id != *t->expected_id) atomic_fetch_add(t->wrong, 1);
    atomic_fetch_add(&t->runs, 1);
}

static void test_back_to_back_tasks(void **state) {
    (void)state;
    ember_pool *pool = ember_pool_create(3);
    assert_non_null(pool);
    atomic_int wrong = 0;
    unsigned expected = 0;
    for (unsigned i = 0; i < 20000; i++) {
        tiny_task t = {.id = i, .expected_id = &expected, .wrong = &wrong};
        expected = i;
        ember_pool_run_parts(pool, tiny_part, &t, 1 + (int)(i % 5));
        assert_int_equal(atomic_load(&t.runs), 1 + (int)(i % 5));
        if (i % 4096 == 0) {
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
    }
    assert_int_equal(atomic_load(&wrong), 0);
    ember_pool_free(pool);
}

/* Each thread streams one contiguous run of parts: with 2 threads the
 * caller owns parts [0, n/2) and the worker [n/2, n); a thread claims its
 * own parts front to back, then takes what is left of the other's from the
 * back. So the parts a thread ran from its own range are home, home + 1,
 * ... in that order, and those it took from the other's range go down one
 * by one; a decode matmul's parts are consecutive row ranges, and this is
 * what keeps each thread's reads one stream (threadpool.c). */
enum { ORDER_PARTS = 32 };
typedef struct order_task {
    pthread_t caller;
    atomic_int next_slot;
    int thread_of[ORDER_PARTS]; /* 0 caller, 1 worker */
    int slot_of[ORDER_PARTS];   /* global run order */
} order_task;

static void order_part(void *arg, int ith, int nth) {
    (void)nth;
    order_task *t = arg;
    t->thread_of[ith] = pthread_equal(pthread_self(), t->caller) ? 0 : 1;
    t->slot_of[ith] = atomic_fetch_add(&t->next_slot, 1);
    struct timespec ts = {0, 50000}; /* long enough that the worker joins in */
    nanosleep(&ts, NULL);
}

static void test_parts_in_thread_ranges(void **state) {
    (void)state;
    ember_pool *pool = ember_pool_create(2);
    assert_non_null(pool);
    int rounds_shared = 0;
    for (int round = 0; round < 50 && rounds_shared < 5; round++) {
        order_task t = {.caller = pthread_self()};
        ember_pool_run_parts(pool, order_part, &t, ORDER_PARTS);
        int ran[2] = {0, 0};
        for (int th = 0; th < 2; th++) {
            int home0 = th * ORDER_PARTS / 2, home1 = (th + 1) * ORDER_PARTS / 2;
            int last_own = -1, last_taken = ORDER_PARTS; /* by run order */
            for (int slot = 0; slot < ORDER_PARTS; slot++) {
                int part = -1;
                for (int i = 0; i < ORDER_PARTS; i++)
                    if (t.slot_of[i] == slot && t.thread_of[i] == th) part = i;
                if (part < 0) continue;
                ran[th]++;
                if (part >= home0 && part < home1) {
                    assert_int_equal(part, last_own < 0 ? home0 : last_own + 1); /* own range: in order from its front */
                    last_own = part;
                } else {
                    assert_true(part < last_taken); /* the other's range: from its back, downwards */
                    if (last_taken < ORDER_PARTS) assert_int_equal(part, last_taken - 1);
                    last_taken = part;
                }
            }
        }
        assert_int_equal(ran[0] + ran[1], ORDER_PARTS);
        if (ran[0] > 0 && ran[1] > 0) rounds_shared++;
        if (round % 2) { /* let the worker fall asleep sometimes, so it starts late and finds its range taken */
            struct timespec ts = {0, 2000000};
            nanosleep(&ts, NULL);
        }
    }
    assert_true(rounds_shared > 0);
    ember_pool_free(pool);
}

/* The thread count changes who computes a row, never the row: the logits of
 * a prompt agree bit for bit with 1, 2 and 3 threads. */
static void test_forward_same_bits_any_thread_count(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, "models/stories260K.gguf");
    ember_error err;
    model *m = model_load(path, &err);
    assert_non_null(m);
    int n_vocab = model_get_hparams(m)->n_vocab;
    int32_t ids[40];
    for (int i = 0; i < 40; i++) ids[i] = 1 + (i * 37) % (n_vocab - 1);
    float *ref = malloc((size_t)n_vocab * sizeof(float)), *got = malloc((size_t)n_vocab * sizeof(float));
    for (int threads = 1; threads <= 3; threads++) {
        kv_pool_config cfg;
        model_kv_config(m, 8, &cfg);
        kv_pool *kp = kv_pool_create(&cfg, &err);
        assert_non_null(kp);
        model_ctx *ctx = model_ctx_create(m, kp, threads, 64, &err);
        assert_non_null(ctx);
        kv_seq seq;
        kv_seq_init(&seq);
        assert_true(model_eval(ctx, &seq, ids, 39, false, got, &err) >= 0);
        assert_true(model_eval(ctx, &seq, ids + 39, 1, false, got, &err) >= 0);
        if (threads == 1) memcpy(ref, got, (size_t)n_vocab * sizeof(float));
        else assert_memory_equal(ref, got, (size_t)n_vocab * sizeof(float));
        kv_seq_release(kp, &seq);
        model_ctx_free(ctx);
        kv_pool_free(kp);
    }
    free(ref);
    free(got);
    model_free(m);
}

static void test_stats_count_tasks(void **state) {
    (void)state;
    ember_pool *pool = ember_pool_create(2);
    assert_non_null(pool);
    long scratch[MAX_PARTS_TESTED];
    ember_pool_stats st;
    ember_pool_get_stats(pool, &st);
    assert_int_equal(st.tasks, 0);
    for (int i = 0; i < 10; i++) {
        count_task t = {.nth = 8, .scratch = scratch};
        ember_pool_run_parts(pool, count_part, &t, 8);
    }
    count_task one = {.nth = 1, .scratch = scratch};
    ember_pool_run_parts(pool, count_part, &one, 1); /* one part runs inline: no task */
    ember_pool_run_parts(NULL, count_part, &one, 1);
    ember_pool_get_stats(pool, &st);
    /* (a worker preempted long enough may send a few tasks to the caller alone) */
    assert_int_equal(st.tasks + st.solo_tasks, 10);
    assert_int_equal(st.parts, 8 * st.tasks);
    assert_true(st.caller_parts <= st.parts);
    assert_true(st.sleeps <= st.waits && st.waits <= 10);
    assert_true(st.wait_ns >= 0);
    ember_pool_free(pool);
}

/* The governor: a worker that stalls 3 ms in every part it takes (as one
 * preempted by another process does) makes the caller wait most of the
 * time; it then works alone (every part on the caller, none to the stalled
 * worker) and shares again once the alone period has passed. */
typedef struct slow_worker_task {
    pthread_t caller;
    atomic_int worker_parts, runs;
} slow_worker_task;

static void slow_worker_part(void *arg, int ith, int nth) {
    (void)ith;
    (void)nth;
    slow_worker_task *t = arg;
    atomic_fetch_add(&t->runs, 1);
    struct timespec ts = {0, pthread_equal(pthread_self(), t->caller) ? 200000 : 3000000};
    if (!pthread_equal(pthread_self(), t->caller)) atomic_fetch_add(&t->worker_parts, 1);
    nanosleep(&ts, NULL);
}

static void test_governor_works_alone_when_workers_stall(void **state) {
    (void)state;
    ember_pool *pool = ember_pool_create(2);
    assert_non_null(pool);
    ember_pool_stats st;
    double deadline = ember_now() + 10.0;
    do {
        slow_worker_task t = {.caller = pthread_self()};
        ember_pool_run_parts(pool, slow_worker_part, &t, 4);
        assert_int_equal(atomic_load(&t.runs), 4);
        ember_pool_get_stats(pool, &st);
    } while (st.solo_periods == 0 && ember_now() < deadline);
    assert_true(st.solo_periods >= 1);
    /* alone now: the next tasks give the worker nothing */
    uint64_t solo_before = st.solo_tasks;
    slow_worker_task alone = {.caller = pthread_self()};
    for (int i = 0; i < 5; i++) ember_pool_run_parts(pool, slow_worker_part, &alone, 4);
    assert_int_equal(atomic_load(&alone.runs), 20);
    assert_int_equal(atomic_load(&alone.worker_parts), 0);
    ember_pool_get_stats(pool, &st);
    assert_int_equal(st.solo_tasks - solo_before, 5);
    /* after the alone period (100 ms) tasks are shared again */
    struct timespec ts = {0, 150000000};
    nanosleep(&ts, NULL);
    uint64_t tasks_before = st.tasks;
    count_task t = {.nth = 8, .scratch = (long[MAX_PARTS_TESTED]){0}};
    ember_pool_run_parts(pool, count_part, &t, 8);
    ember_pool_get_stats(pool, &st);
    assert_int_equal(st.tasks, tasks_before + 1);
    ember_pool_free(pool);
}

/* A decode step of a dense model on 2 threads: 5 pool tasks per layer
 * (q/k/v as one, attention, wo, gate/up as one, down) and 1 for the LM
 * head; its profile classes add up to the step and cover the big steps. */
static void test_decode_step_tasks(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, "models/stories260K.gguf");
    ember_error err;
    model *m = model_load(path, &err);
    assert_non_null(m);
    const model_hparams *hp = model_get_hparams(m);
    int32_t ids[20];
    for (int i = 0; i < 20; i++) ids[i] = 1 + (i * 37) % (hp->n_vocab - 1);
    float *logits = malloc((size_t)hp->n_vocab * sizeof(float));
    kv_pool_config cfg;
    model_kv_config(m, 8, &cfg);
    kv_pool *kp = kv_pool_create(&cfg, &err);
    assert_non_null(kp);
    model_ctx *ctx = model_ctx_create(m, kp, 2, 64, &err);
    assert_non_null(ctx);
    kv_seq seq;
    kv_seq_init(&seq);
    assert_true(model_eval(ctx, &seq, ids, 19, false, logits, &err) >= 0);
    ember_pool_stats s0, s1;
    model_profile prof;
    memset(&prof, 0, sizeof prof);
    model_ctx_pool_stats(ctx, &s0);
    model_ctx_set_profile(ctx, &prof);
    double t0 = ember_now();
    assert_true(model_eval(ctx, &seq, ids + 19, 1, false, logits, &err) >= 0);
    int64_t wall = (int64_t)((ember_now() - t0) * 1e9) + 1000; /* clock rounding */
    model_ctx_set_profile(ctx, NULL);
    model_ctx_pool_stats(ctx, &s1);
    /* (on a loaded machine the governor may have run some of them alone) */
    assert_int_equal((s1.tasks - s0.tasks) + (s1.solo_tasks - s0.solo_tasks), 5 * hp->n_layer + 1);
    int64_t sum = 0;
    for (int k = 0; k < MODEL_PROF_N; k++) {
        assert_true(prof.ns[k] >= 0);
        sum += prof.ns[k];
    }
    assert_true(sum > 0 && sum <= wall);
    assert_true(prof.ns[MODEL_PROF_QKV] > 0 && prof.ns[MODEL_PROF_ATTN] > 0 && prof.ns[MODEL_PROF_FFN_IN] > 0 &&
                prof.ns[MODEL_PROF_HEAD] > 0);
    assert_string_equal(model_prof_class_name(MODEL_PROF_ATTN), "attention");
    kv_seq_release(kp, &seq);
    model_ctx_free(ctx);
    kv_pool_free(kp);
    free(logits);
    model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_part_once),
        cmocka_unit_test(test_stalled_worker_share_is_taken),
        cmocka_unit_test(test_back_to_back_tasks),
        cmocka_unit_test(test_parts_in_thread_ranges),
        cmocka_unit_test(test_thread_slots_private),
        cmocka_unit_test(test_forward_same_bits_any_thread_count),
        cmocka_unit_test(test_stats_count_tasks),
        cmocka_unit_test(test_decode_step_tasks),
        cmocka_unit_test(test_governor_works_alone_when_workers_stall),
    };
    return test_run_group(tests, NULL, NULL);
}
