/* threadpool.h - a fixed set of worker threads that run one task together.
 *
 * Contract: ember_pool_run(pool, fn, ctx) calls fn(ctx, ith, nth) exactly
 * once for every ith in [0, nth), nth = ember_pool_size(pool), and returns
 * when all calls have returned. Any thread, the caller included, may run any
 * ith, and one thread may run several (one after the other): parts are
 * claimed by whoever is running, so a descheduled worker's share is taken by
 * the others. Each thread is dealt a contiguous range of parts (the caller
 * the first) and claims it in order before it takes the rest of the
 * others' ranges from their end, so consecutive parts mostly run on one
 * thread one after the other. Two calls with the same ith never overlap,
 * so per-ith scratch (sized by ember_pool_size) stays private. Work is
 * split by the task (kernels split over output features, never over a
 * reduction, so results do not depend on nth or on which thread ran a
 * part).
 * ember_pool_run_parts does the same with a chosen nth: more, smaller parts
 * balance better when the cores are shared. Waiting spins briefly, then
 * sleeps; when the caller spends over a third of its time waiting for
 * workers (a worker preempted by another process), it runs the tasks of the
 * next 100 ms alone, the same parts in order. One pool serves one caller at a time; concurrent callers must use
 * their own pools. */
#ifndef EMBER_CORE_THREADPOOL_H
#define EMBER_CORE_THREADPOOL_H

#include <stdint.h>

typedef struct ember_pool ember_pool;
typedef void (*ember_task_fn)(void *ctx, int ith, int nth);

/* Lifetime. n_threads <= 0 means "all online CPUs". */
ember_pool *ember_pool_create(int n_threads);
void ember_pool_free(ember_pool *pool);

/* Running work. A NULL pool runs the task on the caller alone (nth = 1). */
void ember_pool_run(ember_pool *pool, ember_task_fn fn, void *ctx);
/* nth = n_parts (1..65535); per-ith scratch must then have n_parts slots. */
void ember_pool_run_parts(ember_pool *pool, ember_task_fn fn, void *ctx, int n_parts);
int ember_pool_size(const ember_pool *pool);
/* Inside a task: the slot in [0, ember_pool_size) of the thread running
 * this part (the caller 0). One thread runs one part at a time, so scratch
 * with one slot per thread, indexed by it, is private to the part however
 * many parts the task has. */
int ember_pool_thread_slot(void);

/* What the pool did since it was created, for benchmarks: tasks handed to
 * the workers (a NULL pool, one thread or one part runs inline and is not
 * counted), their parts and how many the caller ran itself, how often the
 * caller had to wait for workers' parts after running out of its own, how
 * often that wait went to sleep, and the time spent waiting; and how often
 * the caller chose to work alone because waiting for workers cost more than
 * sharing gave (solo_periods), with the tasks it ran alone then (not counted
 * in tasks). Read by the caller between tasks. */
typedef struct ember_pool_stats {
    uint64_t tasks, parts, caller_parts, waits, sleeps, solo_tasks, solo_periods;
    int64_t wait_ns;
} ember_pool_stats;
void ember_pool_get_stats(const ember_pool *pool, ember_pool_stats *st);

/* Splits [0, n) into nth nearly equal ranges, rounded to multiples of
 * `granule`, and returns thread ith's range in *begin, *end. */
void ember_split_range(long n, long granule, int ith, int nth, long *begin, long *end);

#endif
