/* threadpool.c - worker threads for data-parallel kernels (see threadpool.h).
 *
 * Why it is built this way: the cores are often shared (other processes, other
 * servers, a noisy CI box). A pool that hands part i to thread i and then
 * waits for every thread stalls the whole forward pass whenever one worker is
 * descheduled: 16-stream serving fell from 8,198 to 1,205 tokens/s on a loaded
 * machine. So:
 *
 *  - Parts are claimed, not assigned. A task is nth parts, dealt out as
 *    contiguous ranges, one per thread (parts [t*nth/n, (t+1)*nth/n) to
 *    thread t, the caller being thread 0); a thread claims the parts of its
 *    own range from the front, in order, and when it has none left takes
 *    parts from the back of the others' ranges. A worker that is not
 *    running when the task is published simply claims nothing, and the
 *    threads that do run take its share. Which thread computes a part never
 *    changes how the part is computed, so results stay bit-identical
 *    (kernels split over output features, never a reduction).
 *  - Why ranges and not one shared counter: a decode matmul is a stream of
 *    weight rows from memory, and its parts are consecutive row ranges. With
 *    one counter the threads took parts 0, 1, 2, ... in turn, so each
 *    thread's next part began where the other's had ended: every part
 *    started cold (the strip kernels prefetch the next rows of their own
 *    stream, which then belonged to the other thread), and a matrix
 *    could not be cut into many parts without many cold starts. With
 *    ranges each thread streams one contiguous run of rows, and parts can
 *    be small enough to balance the end of a task finely.
 *  - The task is complete when all parts are done, not when every worker has
 *    checked in: a late worker finds the word at a newer generation and goes
 *    back to waiting.
 *  - Waiting is bounded spinning, then a futex sleep, on both sides. Workers
 *    spin a little between tasks (a decode step issues hundreds of small
 *    tasks, and a futex wake-up costs microseconds), then sleep; the caller,
 *    waiting for the last parts, spins briefly and then sleeps, which leaves
 *    its core idle so the kernel can run (or migrate there) the descheduled
 *    worker that holds the part it waits for, instead of the two threads
 *    burning each other's slices.
 *
 *  - When sharing stops paying, the caller works alone for a while. A
 *    worker that shares its core with another busy process is preempted in
 *    the middle of parts, and the caller then waits for it, asleep, for up
 *    to a scheduler slice; with hundreds of small tasks per decode step that
 *    made a busy loop on one core cost more than giving the step to one
 *    thread. So the caller measures, over windows of GOV_WINDOW_NS, the time
 *    it waited for workers' parts; past a third of the window it runs the
 *    next GOV_SOLO_NS of tasks alone (every part inline, in order), which
 *    lets the workers sleep and their cores go to whoever wants them, then
 *    shares again and measures anew. On a quiet machine the caller waits
 *    for at most the tail of one part per task, far below the threshold.
 *    Parts run alone are the same parts (same nth), so results are
 *    unchanged.
 *
 * Each thread's range word packs (generation:32 | front:16 | back:16),
 * parts [front, back) unclaimed: the owner claims front (front + 1), a
 * thief back - 1 (back - 1), each by compare-and-swap of the whole word,
 * so a part is claimed once and a thread still holding a word of an older
 * generation claims nothing. The task's fn/ctx/parts are written before
 * the words are published (release) and read only by a thread whose
 * compare-and-swap claimed a part of that generation (acquire); the caller
 * rewrites them only after every part of the previous task is done, so a
 * claimed part always sees its own task. */
#include "core/threadpool.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* Spin budgets, in nanoseconds. Workers between tasks: the gap between the
 * small tasks of one decode step; a worker woken late costs little, since
 * the running threads start on the parts at once. The caller waiting for
 * stragglers: about one small part, after which a straggler is more likely
 * descheduled than busy. Short spins matter on a shared machine: a thread
 * that spins away its slice is the one preempted in the middle of a part. */
#if defined(__SANITIZE_THREAD__)
/* Under ThreadSanitizer every atomic load is a call into the runtime: a long
 * spin starves the threads doing the work (make test-tsan timed out). */
enum { WORKER_SPIN_NS = 2000, CALLER_SPIN_NS = 1000 };
#else
enum { WORKER_SPIN_NS = 50000, CALLER_SPIN_NS = 20000 };
#endif

enum { MAX_PARTS = 0xffff };

/* The sharing governor: a window over which the caller's waits are summed,
 * and how long it then works alone when they passed a third of it. */
#define GOV_WINDOW_NS 10000000LL
#define GOV_SOLO_NS 100000000LL

struct ember_pool {
    int n_threads;              /* including the caller */
    pthread_t *workers;         /* (n_threads - 1) */
    _Atomic uint64_t *ranges;   /* per thread, RANGE_STRIDE words apart: generation:32 | front:16 | back:16 */
    atomic_uint generation;     /* futex word the idle workers sleep on */
    atomic_uint done;           /* parts of the current task finished; futex word of the caller */
    atomic_int sleepers;        /* workers asleep (or about to be) on `generation` */
    atomic_int caller_waiting;  /* the caller is asleep (or about to be) on `done` */
    atomic_bool stop;
    ember_task_fn fn;
    void *ctx;
    unsigned parts;             /* of the current task */
    /* counters for ember_pool_get_stats, written by the caller only, a
     * cache line away from the words the workers spin on */
    char pad[64];
    uint64_t stat_tasks, stat_parts, stat_caller_parts, stat_waits, stat_sleeps, stat_solo_tasks, stat_solo_periods;
    int64_t stat_wait_ns;
    /* the sharing governor, caller only */
    int64_t gov_start, gov_wait_ns, solo_until;
};

/* The slot of the thread running the current part (ember_pool_thread_slot):
 * the caller's is 0 while it runs a task, worker i's is i. */
static _Thread_local int thread_slot;

typedef struct worker_arg {
    ember_pool *pool;
    int index; /* 1.. (the caller is 0) */
} worker_arg;

enum { RANGE_STRIDE = 8 }; /* words between two threads' ranges: a cache line each */

static void futex_wait(atomic_uint *word, unsigned expected) {
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_all(atomic_uint *word) {
    syscall(SYS_futex, (unsigned *)word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline unsigned range_gen(uint64_t w) { return (unsigned)(w >> 32); }
static inline unsigned range_front(uint64_t w) { return (unsigned)(w >> 16) & 0xffffu; }
static inline unsigned range_back(uint64_t w) { return (unsigned)w & 0xffffu; }

static inline _Atomic uint64_t *range_of(ember_pool *pool, int thread) {
    return &pool->ranges[(size_t)thread * RANGE_STRIDE];
}

/* Claims parts of range `r` of generation `gen`, from the front (the
 * owner) or the back (a thief), and runs them until none is left; returns
 * how many it ran. */
static unsigned run_range(ember_pool *pool, _Atomic uint64_t *r, unsigned gen, bool from_front) {
    uint64_t w = atomic_load_explicit(r, memory_order_acquire);
    for (unsigned ran = 0;; ran++) {
        if (range_gen(w) != gen || range_front(w) >= range_back(w)) return ran;
        uint64_t next = from_front ? w + (1u << 16) : w - 1;
        if (!atomic_compare_exchange_weak_explicit(r, &w, next, memory_order_acq_rel, memory_order_acquire))
            continue;
        unsigned part = from_front ? range_front(w) : range_back(w) - 1, parts = pool->parts;
        pool->fn(pool->ctx, (int)part, (int)parts);
        /* seq_cst pairs with the caller's store of caller_waiting then load of done. */
        unsigned finished = atomic_fetch_add(&pool->done, 1) + 1;
        if (finished == parts && atomic_load(&pool->caller_waiting)) futex_wake_all(&pool->done);
        w = atomic_load_explicit(r, memory_order_acquire);
    }
}

/* Thread `self`'s share of generation `gen`: its own range, then what is
 * left of the others'; returns how many parts it ran. */
static unsigned run_parts(ember_pool *pool, unsigned gen, int self) {
    unsigned ran = run_range(pool, range_of(pool, self), gen, true);
    for (int k = 1; k < pool->n_threads; k++)
        ran += run_range(pool, range_of(pool, (self + k) % pool->n_threads), gen, false);
    return ran;
}

static void *worker_main(void *arg) {
    worker_arg *wa = arg;
    ember_pool *pool = wa->pool;
    int self = wa->index;
    free(wa);
    thread_slot = self;
    unsigned seen = 0;
    for (;;) {
        unsigned gen = atomic_load_explicit(&pool->generation, memory_order_acquire);
        if (gen == seen && !atomic_load_explicit(&pool->stop, memory_order_relaxed)) {
            int64_t deadline = now_ns() + WORKER_SPIN_NS;
            for (int i = 1;; i++) {
                cpu_relax();
                gen = atomic_load_explicit(&pool->generation, memory_order_acquire);
                if (gen != seen || atomic_load_explicit(&pool->stop, memory_order_relaxed)) break;
                if ((i & 63) == 0 && now_ns() > deadline) {
                    atomic_fetch_add(&pool->sleepers, 1);
                    /* seq_cst pairs with the caller's store of generation then
                     * load of sleepers: one of the two sees the other. */
                    while ((gen = atomic_load(&pool->generation)) == seen && !atomic_load(&pool->stop))
                        futex_wait(&pool->generation, seen);
                    atomic_fetch_sub(&pool->sleepers, 1);
                    break;
                }
            }
        }
        if (atomic_load(&pool->stop)) return NULL;
        seen = gen;
        run_parts(pool, gen, self);
    }
}

ember_pool *ember_pool_create(int n_threads) {
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    if (n_threads > MAX_PARTS) n_threads = MAX_PARTS;
    ember_pool *pool = calloc(1, sizeof *pool);
    if (pool == NULL) return NULL;
    pool->n_threads = n_threads;
    pool->workers = calloc((size_t)n_threads, sizeof(pthread_t));
    pool->ranges = aligned_alloc(64, (size_t)n_threads * RANGE_STRIDE * sizeof(uint64_t));
    if (pool->workers == NULL || pool->ranges == NULL) {
        free(pool->workers);
        free((void *)pool->ranges);
        free(pool);
        return NULL;
    }
    for (int t = 0; t < n_threads; t++) atomic_init(range_of(pool, t), 0);
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (wa == NULL) {
            pool->n_threads = i;
            break;
        }
        wa->pool = pool;
        wa->index = i;
        if (pthread_create(&pool->workers[i - 1], NULL, worker_main, wa) != 0) {
            free(wa);
            pool->n_threads = i;
            break;
        }
    }
    return pool;
}

void ember_pool_free(ember_pool *pool) {
    if (pool == NULL) return;
    atomic_store(&pool->stop, true);
    atomic_fetch_add(&pool->generation, 1);
    futex_wake_all(&pool->generation);
    for (int i = 1; i < pool->n_threads; i++) pthread_join(pool->workers[i - 1], NULL);
    free(pool->workers);
    free((void *)pool->ranges);
    free(pool);
}

int ember_pool_size(const ember_pool *pool) { return pool ? pool->n_threads : 1; }

/* The governor, at the start of a task: closes a window that has run its
 * length (alone for GOV_SOLO_NS when the caller waited for over a third of
 * it) and says whether this task runs alone. */
static bool work_alone(ember_pool *pool) {
    int64_t t = now_ns();
    if (t < pool->solo_until) return true;
    if (t - pool->gov_start < GOV_WINDOW_NS) return false;
    bool alone = pool->gov_wait_ns * 3 > t - pool->gov_start;
    if (alone) {
        pool->solo_until = t + GOV_SOLO_NS;
        pool->stat_solo_periods++;
    }
    pool->gov_start = t;
    pool->gov_wait_ns = 0;
    return alone;
}

/* ember_pool_run_parts, the caller in slot 0. */
static void run_parts_as_caller(ember_pool *pool, ember_task_fn fn, void *ctx, int n_parts) {
    if (n_parts < 1) n_parts = 1;
    if (n_parts > MAX_PARTS) n_parts = MAX_PARTS;
    if (pool == NULL || pool->n_threads == 1 || n_parts == 1) {
        for (int i = 0; i < n_parts; i++) fn(ctx, i, n_parts);
        return;
    }
    if (work_alone(pool)) {
        pool->stat_solo_tasks++;
        for (int i = 0; i < n_parts; i++) fn(ctx, i, n_parts);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    pool->parts = (unsigned)n_parts;
    atomic_store_explicit(&pool->done, 0, memory_order_relaxed);
    unsigned gen = atomic_load_explicit(&pool->generation, memory_order_relaxed) + 1;
    for (int t = 0; t < pool->n_threads; t++) {
        uint64_t front = (uint64_t)n_parts * (uint64_t)t / (uint64_t)pool->n_threads;
        uint64_t back = (uint64_t)n_parts * (uint64_t)(t + 1) / (uint64_t)pool->n_threads;
        atomic_store_explicit(range_of(pool, t), (uint64_t)gen << 32 | front << 16 | back, memory_order_release);
    }
    atomic_store(&pool->generation, gen);
    if (atomic_load(&pool->sleepers) > 0) futex_wake_all(&pool->generation);
    pool->stat_tasks++;
    pool->stat_parts += (unsigned)n_parts;
    pool->stat_caller_parts += run_parts(pool, gen, 0);

    unsigned parts = (unsigned)n_parts, done = atomic_load_explicit(&pool->done, memory_order_acquire);
    if (done == parts) return;
    int64_t start = now_ns(), deadline = start + CALLER_SPIN_NS;
    pool->stat_waits++;
    for (int i = 1; (done = atomic_load_explicit(&pool->done, memory_order_acquire)) != parts; i++) {
        cpu_relax();
        if ((i & 63) == 0 && now_ns() > deadline) break;
    }
    if (done != parts) {
        pool->stat_sleeps++;
        atomic_store(&pool->caller_waiting, 1);
        while ((done = atomic_load(&pool->done)) != parts) futex_wait(&pool->done, done);
        atomic_store(&pool->caller_waiting, 0);
    }
    int64_t waited = now_ns() - start;
    pool->stat_wait_ns += waited;
    pool->gov_wait_ns += waited;
}

/* The caller may be another pool's worker: its own slot is put back after. */
void ember_pool_run_parts(ember_pool *pool, ember_task_fn fn, void *ctx, int n_parts) {
    int outer_slot = thread_slot;
    thread_slot = 0;
    run_parts_as_caller(pool, fn, ctx, n_parts);
    thread_slot = outer_slot;
}

int ember_pool_thread_slot(void) { return thread_slot; }

void ember_pool_get_stats(const ember_pool *pool, ember_pool_stats *st) {
    *st = (ember_pool_stats){0};
    if (pool == NULL) return;
    st->tasks = pool->stat_tasks;
    st->parts = pool->stat_parts;
    st->caller_parts = pool->stat_caller_parts;
    st->waits = pool->stat_waits;
    st->sleeps = pool->stat_sleeps;
    st->wait_ns = pool->stat_wait_ns;
    st->solo_tasks = pool->stat_solo_tasks;
    st->solo_periods = pool->stat_solo_periods;
}

void ember_pool_run(ember_pool *pool, ember_task_fn fn, void *ctx) {
    ember_pool_run_parts(pool, fn, ctx, ember_pool_size(pool));
}

void ember_split_range(long n, long granule, int ith, int nth, long *begin, long *end) {
    if (granule < 1) granule = 1;
    long units = (n + granule - 1) / granule;
    long per = units / nth, extra = units % nth;
    long u0 = ith * per + (ith < extra ? ith : extra);
    long u1 = u0 + per + (ith < extra ? 1 : 0);
    *begin = u0 * granule < n ? u0 * granule : n;
    *end = u1 * granule < n ? u1 * granule : n;
}
