/* apc_route.c - which tier serves a cache stack (design.md §4).
 *
 * The decision is a pure function of the per-layer kinds so that the whole
 * table can be unit-tested with synthetic stacks. It goes, first match wins:
 *
 *   empty stack, or any `other` layer       -> none (nothing can split it)
 *   every layer `kv`                        -> block
 *   any `list` layer                        -> exact
 *   no `kv` and no `rot` (pure recurrent)   -> exact (nothing chain-backed)
 *   otherwise (`rot` and/or `arr` mixed in) -> ckpt, provided every `rot`
 *       layer shares one (window, keep) with window > 0 and both on the
 *       16-token grid, and the checkpoint tier is switched on; else exact.
 *
 * Logging is left to apc_create, which logs the outcome once per model.
 *
 * apc_route_pool_rows (the last section) then routes by what the pool
 * really holds (issue 17): ember's pool keeps every row of a sliding layer
 * (the window is a mask), so those K/V are as cuttable as a kv layer's; and
 * with recurrent snapshots riding on the block chain (apc_snap.c), arr and
 * list layers can be cut at every snapshot point. Such stacks go block. It
 * is a separate pass so that the table above stays the reference's. */
#include <stdio.h>
#include <string.h>

#include "apc/apc.h"

const char *apc_tier_name(apc_tier t) {
    switch (t) {
    case APC_TIER_BLOCK: return "block";
    case APC_TIER_CKPT: return "ckpt";
    case APC_TIER_EXACT: return "exact";
    default: return "none";
    }
}

const char *apc_source_name(apc_source s) {
    switch (s) {
    case APC_SOURCE_BLOCK: return "block";
    case APC_SOURCE_EXACT: return "exact";
    case APC_SOURCE_CKPT: return "ckpt";
    case APC_SOURCE_ANCHOR: return "anchor";
    case APC_SOURCE_PREFIX: return "prefix";
    default: return "none";
    }
}

apc_route apc_route_stack(const cache_layer *stack, int n_layer, bool ckpt_enabled) {
    apc_route r;
    memset(&r, 0, sizeof r);
    r.tier = APC_TIER_NONE;
    int first_other = -1, rot_window = 0, rot_keep = 0;
    bool rot_mixed = false;
    for (int i = 0; i < n_layer; i++) {
        switch (stack[i].kind) {
        case CACHE_KIND_KV: r.n_kv++; break;
        case CACHE_KIND_ROT:
            if (r.n_rot == 0) {
                rot_window = stack[i].window;
                rot_keep = stack[i].keep;
            } else if (stack[i].window != rot_window || stack[i].keep != rot_keep) {
                rot_mixed = true;
            }
            r.n_rot++;
            break;
        case CACHE_KIND_ARR: r.n_arr++; break;
        case CACHE_KIND_LIST: r.n_list++; break;
        default:
            r.n_other++;
            if (first_other < 0) first_other = i;
            break;
        }
    }
    if (n_layer <= 0) {
        snprintf(r.reason, sizeof r.reason, "the model declares no cache layers");
        return r;
    }
    if (r.n_other > 0) {
        snprintf(r.reason, sizeof r.reason,
                 "no tier serves its cache stack (%d layer(s) of kind 'other', first at layer %d) -- "
                 "every request prefills cold",
                 r.n_other, first_other);
        return r;
    }
    if (r.n_kv == n_layer) {
        r.tier = APC_TIER_BLOCK;
        return r;
    }
    if (r.n_list > 0 || (r.n_kv == 0 && r.n_rot == 0)) {
        r.tier = APC_TIER_EXACT;
        return r;
    }
    /* A checkpoint-tier candidate: kv/rot/arr with at least one rot or arr. */
    r.tier = APC_TIER_EXACT;
    if (!ckpt_enabled) {
        snprintf(r.reason, sizeof r.reason, "checkpoint tier switched off");
        return r;
    }
    if (r.n_rot > 0) {
        if (rot_mixed) {
            snprintf(r.reason, sizeof r.reason, "APC rotating: mixed window geometries; staying exact");
            return r;
        }
        if (rot_window <= 0 || rot_window % KV_BLOCK_TOKENS != 0 || rot_keep % KV_BLOCK_TOKENS != 0) {
            snprintf(r.reason, sizeof r.reason,
                     "APC rotating: window %d / keep %d not on the %d-token block grid; staying exact", rot_window,
                     rot_keep, KV_BLOCK_TOKENS);
            return r;
        }
    }
    r.tier = APC_TIER_CKPT;
    return r;
}

/* ---- Routing by what the pool holds (issue 17) ---- */

void apc_route_pool_rows(apc_route *r, bool swa_rows_kept, bool snapshots) {
    r->snapshots = false;
    if (r->tier != APC_TIER_CKPT && r->tier != APC_TIER_EXACT) return;
    if (r->n_other > 0) return;
    if (r->n_rot > 0 && !swa_rows_kept) return;
    bool recurrent = r->n_arr + r->n_list > 0;
    if (recurrent && !snapshots) return;
    r->tier = APC_TIER_BLOCK;
    r->snapshots = recurrent;
    r->reason[0] = '\0';
}

/* ---- Routing by the KV format (issue 12) ---- */

void apc_route_kv_format(apc_route *r, bool records) {
    r->records = records;
    if (!records || r->tier != APC_TIER_BLOCK) return;
    /* A 16-token block of a kvarn pool is not a unit of its own: a sealed
     * group's record spans 8 blocks, and which groups are sealed depends on
     * the length of the sequence that holds them. Whole-state snapshots keep
     * the representation of their length. */
    r->tier = APC_TIER_EXACT;
    r->snapshots = false;
    r->forced = false;
    snprintf(r->reason, sizeof r->reason,
             "APC kvarn KV: 128-token records do not split into 16-token blocks; block tier -> exact");
}

void apc_route_force(apc_route *r, apc_force force) {
    switch (force) {
    case APC_FORCE_OFF:
        r->tier = APC_TIER_NONE;
        r->forced = true;
        r->snapshots = false;
        snprintf(r->reason, sizeof r->reason, "forced off (cache.force_tier: off)");
        break;
    case APC_FORCE_BLOCK:
        if ((r->n_kv > 0 && r->n_rot + r->n_arr + r->n_list + r->n_other == 0) || r->tier == APC_TIER_BLOCK) {
            r->tier = APC_TIER_BLOCK;
            r->forced = true;
            r->reason[0] = '\0';
        } else {
            snprintf(r->reason, sizeof r->reason, "cache.force_tier block ignored: not every layer is kv");
        }
        break;
    case APC_FORCE_EXACT:
        if (r->n_other == 0 && r->n_kv + r->n_rot + r->n_arr + r->n_list > 0) {
            r->tier = APC_TIER_EXACT;
            r->forced = true;
            r->snapshots = false;
            r->reason[0] = '\0';
        } else {
            snprintf(r->reason, sizeof r->reason, "cache.force_tier exact ignored: the stack cannot be snapshotted");
        }
        break;
    default: break;
    }
}

int apc_parse_force(const char *s, apc_force *out) {
    if (s == NULL || s[0] == '\0') *out = APC_FORCE_NONE;
    else if (strcmp(s, "off") == 0) *out = APC_FORCE_OFF;
    else if (strcmp(s, "block") == 0) *out = APC_FORCE_BLOCK;
    else if (strcmp(s, "exact") == 0) *out = APC_FORCE_EXACT;
    else return -1;
    return 0;
}
