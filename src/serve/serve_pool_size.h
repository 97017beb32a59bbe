/* serve_pool_size.h - how many KV blocks `ember serve` allocates.
 *
 * Contract:
 *  - The KV pool is the block tier of the prompt cache, so its size is the
 *    cache's capacity. cache.num_blocks (APC_NUM_BLOCKS, --num-blocks) > 0
 *    is taken as given; 0 (the default) sizes the pool from the machine:
 *
 *      usable = available - weights - margin
 *      margin = max(SERVE_POOL_MARGIN_MIN, SERVE_POOL_MARGIN_PERCENT% of available)
 *      pool   = cache.memory_share * usable, in whole blocks
 *
 *    where available is the memory the kernel says is available at start
 *    (MemAvailable of /proc/meminfo, bounded by what can still be committed
 *    under strict overcommit; free pages from sysconf when that file is
 *    missing) and weights the model file's size (its mapping is paged in
 *    as the model runs). The pool never drops below one full context plus
 *    a block (least_blocks), which a single request needs, and a default
 *    pool stops at SERVE_POOL_DEFAULT_MAX_BLOCKS.
 *  - A pool that cannot fit is refused before anything is allocated: a
 *    configured size above `usable`, or a machine whose usable memory
 *    cannot hold least_blocks. The error names the numbers and the setting
 *    to change.
 *  - The arithmetic is a pure function of its inputs (serve_pool_size), so
 *    it is tested against any amount of memory; serve_mem_available only
 *    feeds it. The start-up log line it writes reads
 *    `KV pool: N blocks (T tokens, X GiB) = Y% of available memory (...)`
 *    with the whole computation in the parentheses. */
#ifndef EMBER_SERVE_POOL_SIZE_H
#define EMBER_SERVE_POOL_SIZE_H

#include <stddef.h>
#include <stdint.h>

#include "core/error.h"

#define SERVE_POOL_SHARE_DEFAULT 0.5
#define SERVE_POOL_MARGIN_MIN (512ull << 20) /* 512 MiB */
#define SERVE_POOL_MARGIN_PERCENT 10
#define SERVE_POOL_MAX_BLOCKS (1ull << 30) /* the cache's block index addresses at most 2^30 blocks */
/* A default pool stops at 2^22 blocks (64M tokens): beyond that only a
 * model with tiny blocks gets there, and the per-block bookkeeping the pool
 * and the cache index set up at start (tens of bytes a block) would cost
 * more start-up time and memory than the cache could give back. */
#define SERVE_POOL_DEFAULT_MAX_BLOCKS (1ull << 22)

typedef struct serve_pool_inputs {
    uint64_t available;     /* bytes of memory available at start */
    uint64_t weights;       /* bytes of the model's weights */
    double share;           /* cache.memory_share, in (0, 1] */
    uint64_t block_bytes;   /* bytes of one KV block (all layers, K and V) */
    int32_t configured;     /* cache.num_blocks; 0: from memory */
    int32_t least_blocks;   /* the smallest pool that serves one full context */
    const struct kv_pool_config *kv; /* the pool's rows and format, or NULL: the tokens the
                                      * line reports (a kvarn pool counts sealed groups at
                                      * their kept blocks, kv_format_capacity_tokens) */
} serve_pool_inputs;

typedef struct serve_pool_plan {
    int32_t n_blocks;
    uint64_t pool_bytes;    /* n_blocks * block_bytes */
    uint64_t margin;        /* the safety margin */
    uint64_t usable;        /* available - weights - margin (0 when negative) */
} serve_pool_plan;

/* ---- API ---- */
/* The pool for `in`; -1 with a message naming the numbers when it cannot
 * fit. line (may be NULL) gets the start-up log line. */
int serve_pool_size(const serve_pool_inputs *in, serve_pool_plan *out, char *line, size_t line_cap,
                    ember_error *err);
/* Memory available to a new allocation: MemAvailable of /proc/meminfo
 * (under strict overcommit, vm.overcommit_memory = 2, at most CommitLimit -
 * Committed_AS), else free pages (sysconf). */
int serve_mem_available(uint64_t *bytes, ember_error *err);

#endif
