/* apc_ckpt.h - the checkpoint tier and the per-request cache protocol for
 * stacks with recurrent or sliding-window layers (design.md §4-§5,
 * prompt-cache reference §6.4, §7).
 *
 * Contract:
 *  - A checkpoint record at position p is (tokens [0, p), salt, kind) plus
 *    what restores the whole sequence state at p: one reference on each pool
 *    block covering [0, p) (kv and rot layers: ember keeps every position of
 *    a sliding layer in the paged pool, so the chain also pins each window),
 *    and, on stacks with arr layers, a model_state snapshot at p. Records
 *    dedup through the pool: two records of one conversation share blocks.
 *  - Kinds: boundary (grid interval points, the turn checkpoint, p = N),
 *    anchor (system-prompt end; the first boundary of a fresh chain is
 *    promoted), replay (N-1), retire (end of a request).
 *  - Retention (reference §7.4): one replay and one anchor per chain,
 *    strip-on-extend keeps `heavy` plain records per chain, then a record
 *    cap and a byte budget over snapshot bytes evict least recently used
 *    non-anchors first. When the pool runs dry (apc_seq_prepare_append)
 *    records are evicted, least recently used first, and counted as
 *    ckpt_pool_evictions.
 *  - Lookup adopts only a record whose tokens are a verbatim prefix of the
 *    query, p <= N-1, same salt; on arr layouts a replay record adopts only
 *    for the identical resend (p == N-1; the replay gate). A record that
 *    matched but could not be adopted is a missed adoption.
 *  - The cache never fails a request: every problem is a counted decline.
 *
 * A request drives this tier through apc_req (apc_req.h); the tier's
 * operations (apc_ckpt_ops) plan the prefill stops, store at them, take
 * decode-time snapshots and retire (reference §7.2-§7.7). */
#ifndef EMBER_APC_CKPT_H
#define EMBER_APC_CKPT_H

#include <stdbool.h>
#include <stdint.h>

#include "apc/apc.h"

typedef enum apc_ckpt_kind {
    APC_CKPT_BOUNDARY = 0,
    APC_CKPT_ANCHOR = 1,
    APC_CKPT_REPLAY = 2,
    APC_CKPT_RETIRE = 3,
} apc_ckpt_kind;

/* ckpt_declines reasons (reference §11.1 names). */
typedef enum apc_ckpt_decline {
    APC_CKPT_DECLINE_LAYOUT = 0,  /* p < 2, or the tier cannot store */
    APC_CKPT_DECLINE_BUFFERED,    /* (reference only; never in ember) */
    APC_CKPT_DECLINE_OFFSET,      /* the sequence / state is not at p */
    APC_CKPT_DECLINE_GRID,        /* sliding layers below the window, off the block grid */
    APC_CKPT_DECLINE_SHORT_CHAIN, /* the pool cannot hold the chain */
    APC_CKPT_DECLINE_CANON,       /* (reference only) */
    APC_CKPT_DECLINE_CLONE,       /* a state snapshot could not be made or restored */
    APC_CKPT_DECLINE_EXCEPTION,   /* out of memory for a record */
    APC_CKPT_DECLINE_ANCHOR_CLONE,/* an exact anchor snapshot could not be made */
    APC_CKPT_DECLINE_REPLAY_GATE, /* a replay record matched a longer query (arr) */
    APC_CKPT_DECLINE_COUNT_
} apc_ckpt_decline;

const char *apc_ckpt_decline_name(apc_ckpt_decline d);
const char *apc_ckpt_kind_name(apc_ckpt_kind k);

/* ---- The prefill schedule (reference §7.2), pure ---- */
typedef struct apc_ckpt_point {
    int64_t pos;
    apc_ckpt_kind kind;
} apc_ckpt_point;

typedef struct apc_ckpt_sched_in {
    int64_t n;          /* prompt tokens */
    int64_t guard;      /* last position prefill reaches before the final token (N-1) */
    int64_t restored;   /* adopted prefix */
    int unit;           /* prefill grid step (lcm with the block size) */
    bool has_arr;       /* arr (or list) layers */
    int window;         /* largest sliding window, 0 if none */
    int64_t p_stable;   /* turn boundary; <= 0: none */
    int64_t sys_lcp;    /* system-prompt end; <= 0: none */
    apc_ckpt_config cfg;
} apc_ckpt_sched_in;

/* Writes the sorted points (at most cap) and returns their count; bounds
 * (at most 2) receive the turn positions ("p_stable bounds"). */
int apc_ckpt_schedule(const apc_ckpt_sched_in *in, apc_ckpt_point *out, int cap, int64_t *bounds, int *n_bounds);

#endif
