/* serve_pool_size.c - the KV pool's size from the machine (see
 * serve_pool_size.h).
 *
 * Why a share of available memory: the pool is the cache, and a cache of a
 * few contexts forgets a conversation before its next turn arrives (in
 * multi-turn traffic a turn's predecessor is often a hundred requests
 * back), while memory left idle serves nobody. So the default takes half
 * of what is available at start, after the model's weights and a margin for
 * everything else (scratch buffers, the HTTP layer, the disk tier's read
 * buffers, the rest of the machine). Half, not all: the pool's pages are
 * only touched as the cache fills (kv_pool maps large pools lazily), so a
 * second server started next to this one still sees most of the memory as
 * available; half each keeps two default servers inside the machine, and
 * cache.memory_share = 1/N does so for N.
 *
 * The margin is a tenth of the available memory, at least 512 MiB: enough
 * for the per-request scratch of the models ember serves on a CPU, and
 * small enough not to matter on a large machine. */
#include "serve/serve_pool_size.h"

#include <errno.h>
#include <stdbool.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "kv/kv_pool.h"

static double gib(uint64_t bytes) { return (double)bytes / (double)(1ull << 30); }

int serve_pool_size(const serve_pool_inputs *in, serve_pool_plan *out, char *line, size_t line_cap,
                    ember_error *err) {
    memset(out, 0, sizeof *out);
    if (in->block_bytes == 0) return ember_fail(err, "KV pool: the model has no KV block size");
    if (!(in->share > 0 && in->share <= 1))
        return ember_fail(err, "cache.memory_share: %g is not in (0, 1]", in->share);
    uint64_t margin = in->available / 100 * SERVE_POOL_MARGIN_PERCENT + in->available % 100 * SERVE_POOL_MARGIN_PERCENT / 100;
    if (margin < SERVE_POOL_MARGIN_MIN) margin = SERVE_POOL_MARGIN_MIN;
    uint64_t taken = in->weights + margin;
    uint64_t usable = in->available > taken ? in->available - taken : 0;
    out->margin = margin;
    out->usable = usable;
    int32_t least = in->least_blocks > 1 ? in->least_blocks : 1;
    uint64_t blocks;
    if (in->configured > 0) {
        blocks = (uint64_t)in->configured;
        if (blocks > SERVE_POOL_MAX_BLOCKS)
            return ember_fail(err, "cache.num_blocks=%" PRId32 ": at most %llu blocks", in->configured,
                              (unsigned long long)SERVE_POOL_MAX_BLOCKS);
        /* Checked in blocks, so no product can overflow. */
        if (blocks > usable / in->block_bytes)
            return ember_fail(err,
                              "cache.num_blocks=%" PRId32 " needs %.2f GiB for the KV pool (%" PRIu64
                              " bytes a block), but only %.2f GiB of memory can hold it (%.2f GiB available - "
                              "%.2f GiB model weights - %.2f GiB safety margin); lower cache.num_blocks "
                              "(--num-blocks), or set it to 0 to size the pool from memory",
                              in->configured, (double)blocks * (double)in->block_bytes / (double)(1ull << 30),
                              in->block_bytes, gib(usable), gib(in->available), gib(in->weights), gib(margin));
    } else {
        /* Whole blocks of share * usable; the share is applied to the
         * block count so that share 1 is exactly usable. */
        uint64_t fit = usable / in->block_bytes;
        blocks = (uint64_t)((double)fit * in->share);
        if (blocks > fit) blocks = fit;
        if ((uint64_t)least > fit)
            return ember_fail(err,
                              "not enough memory for the KV pool: one context needs %" PRId32
                              " blocks (%.2f GiB), and %.2f GiB available - %.2f GiB model weights - %.2f GiB "
                              "safety margin leaves %.2f GiB; free memory, lower server.ctx, or set "
                              "cache.num_blocks",
                              least, (double)least * (double)in->block_bytes / (double)(1ull << 30),
                              gib(in->available), gib(in->weights), gib(margin), gib(usable));
        if (blocks < (uint64_t)least) blocks = (uint64_t)least;
        if (blocks > SERVE_POOL_DEFAULT_MAX_BLOCKS) blocks = SERVE_POOL_DEFAULT_MAX_BLOCKS;
    }
    out->n_blocks = (int32_t)blocks;
    out->pool_bytes = blocks * in->block_bytes;
    if (line) {
        double pct = in->available ? 100.0 * (double)out->pool_bytes / (double)in->available : 0.0;
        int n = snprintf(line, line_cap, "KV pool: %" PRId32 " blocks (%" PRIu64 " tokens, %.2f GiB) = %.1f%% of available memory ",
                         out->n_blocks,
                         in->kv ? (uint64_t)kv_format_capacity_tokens(in->kv, (int64_t)blocks) : blocks * KV_BLOCK_TOKENS,
                         gib(out->pool_bytes), pct);
        if (n < 0 || (size_t)n >= line_cap) return 0;
        if (in->configured > 0)
            snprintf(line + n, line_cap - (size_t)n,
                     "(cache.num_blocks; %.2f GiB available - %.2f GiB model weights - %.2f GiB safety margin "
                     "= %.2f GiB would fit)",
                     gib(in->available), gib(in->weights), gib(margin), gib(usable));
        else
            snprintf(line + n, line_cap - (size_t)n,
                     "(cache.memory_share %g x (%.2f GiB available - %.2f GiB model weights - %.2f GiB safety "
                     "margin)%s; cache.num_blocks overrides)",
                     in->share, gib(in->available), gib(in->weights), gib(margin),
                     blocks == (uint64_t)least && (uint64_t)((double)(usable / in->block_bytes) * in->share) < blocks
                         ? ", raised to one full context"
                     : blocks == SERVE_POOL_DEFAULT_MAX_BLOCKS ? ", at most 4194304 blocks"
                                                              : "");
    }
    return 0;
}

/* vm.overcommit_memory = 2 (strict accounting): a mapping is refused once
 * the committed total passes CommitLimit, whether its pages are touched or
 * not, so what can still be committed bounds the pool too. */
static bool strict_overcommit(void) {
    FILE *f = fopen("/proc/sys/vm/overcommit_memory", "r");
    int mode = 0;
    if (f) {
        if (fscanf(f, "%d", &mode) != 1) mode = 0;
        fclose(f);
    }
    return mode == 2;
}

int serve_mem_available(uint64_t *bytes, ember_error *err) {
    FILE *f = fopen("/proc/meminfo", "r");
    int open_errno = f ? 0 : errno;
    if (f) {
        char text[256];
        unsigned long long kib, avail = 0, limit = 0, committed = 0;
        bool have_avail = false, have_limit = false, have_committed = false;
        while (fgets(text, sizeof text, f)) {
            if (sscanf(text, "MemAvailable: %llu kB", &kib) == 1) avail = kib, have_avail = true;
            else if (sscanf(text, "CommitLimit: %llu kB", &kib) == 1) limit = kib, have_limit = true;
            else if (sscanf(text, "Committed_AS: %llu kB", &kib) == 1) committed = kib, have_committed = true;
        }
        fclose(f);
        if (have_avail) {
            if (have_limit && have_committed && strict_overcommit()) {
                unsigned long long room = limit > committed ? limit - committed : 0;
                if (room < avail) avail = room;
            }
            *bytes = (uint64_t)avail * 1024u;
            return 0;
        }
    }
    /* Older kernels: free pages only (page cache not counted, so smaller). */
    long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) {
        *bytes = (uint64_t)pages * (uint64_t)page;
        return 0;
    }
    return ember_fail(err, "cannot tell how much memory is available (/proc/meminfo: %s)",
                      open_errno ? strerror(open_errno) : "no MemAvailable line");
}
