/* threadpool.c - worker threads for data-parallel kernels (see threadpool.h).
 *
 * A task is published by bumping `generation`; each worker remembers the last
 * generation it ran. Workers spin on the counter for a short while (cheap
 * wake-up during a forward pass), then block on `wake`. Completion is a
 * countdown in `pending`, which the caller spins on. */
#include "core/threadpool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

#if defined(__SANITIZE_THREAD__)
/* Under ThreadSanitizer every atomic load is a call into the runtime: a long
 * spin starves the threads doing the work (make test-tsan timed out). */
enum { SPIN_ITERATIONS = 500 };
#else
enum { SPIN_ITERATIONS = 200000 };
#endif

struct ember_pool {
    int n_threads;              /* including the caller */
    pthread_t *workers;         /* (n_threads - 1) */
    pthread_mutex_t lock;
    pthread_cond_t wake;
    atomic_uint generation;
    atomic_int pending;
    atomic_int sleepers;
    atomic_bool stop;
    ember_task_fn fn;
    void *ctx;
};

typedef struct worker_arg {
    ember_pool *pool;
    int ith;
} worker_arg;

static void *worker_main(void *arg) {
    worker_arg *wa = arg;
    ember_pool *pool = wa->pool;
    int ith = wa->ith;
    free(wa);
    unsigned seen = 0;
    for (;;) {
        unsigned gen;
        int spins = 0;
        while ((gen = atomic_load_explicit(&pool->generation, memory_order_acquire)) == seen &&
               !atomic_load(&pool->stop)) {
            if (++spins < SPIN_ITERATIONS) continue;
            pthread_mutex_lock(&pool->lock);
            atomic_fetch_add(&pool->sleepers, 1);
            while (atomic_load(&pool->generation) == seen && !atomic_load(&pool->stop))
                pthread_cond_wait(&pool->wake, &pool->lock);
            atomic_fetch_sub(&pool->sleepers, 1);
            pthread_mutex_unlock(&pool->lock);
            spins = 0;
        }
        if (atomic_load(&pool->stop)) return NULL;
        seen = gen;
        pool->fn(pool->ctx, ith, pool->n_threads);
        atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_release);
    }
}

ember_pool *ember_pool_create(int n_threads) {
    if (n_threads <= 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = n > 0 ? (int)n : 1;
    }
    ember_pool *pool = calloc(1, sizeof *pool);
    if (pool == NULL) return NULL;
    pool->n_threads = n_threads;
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pool->workers = calloc((size_t)n_threads, sizeof(pthread_t));
    if (pool->workers == NULL) {
        free(pool);
        return NULL;
    }
    for (int i = 1; i < n_threads; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (wa == NULL) {
            pool->n_threads = i;
            break;
        }
        wa->pool = pool;
        wa->ith = i;
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
    pthread_mutex_lock(&pool->lock);
    atomic_store(&pool->stop, true);
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 1; i < pool->n_threads; i++) pthread_join(pool->workers[i - 1], NULL);
    pthread_mutex_destroy(&pool->lock);
    pthread_cond_destroy(&pool->wake);
    free(pool->workers);
    free(pool);
}

int ember_pool_size(const ember_pool *pool) { return pool ? pool->n_threads : 1; }

void ember_pool_run(ember_pool *pool, ember_task_fn fn, void *ctx) {
    if (pool == NULL || pool->n_threads == 1) {
        fn(ctx, 0, 1);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    atomic_store(&pool->pending, pool->n_threads - 1);
    atomic_fetch_add_explicit(&pool->generation, 1, memory_order_release);
    if (atomic_load(&pool->sleepers) > 0) {
        pthread_mutex_lock(&pool->lock);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->lock);
    }
    fn(ctx, 0, pool->n_threads);
    while (atomic_load_explicit(&pool->pending, memory_order_acquire) > 0) sched_yield();
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
