/* engine_spec.h - drafters for speculative decoding.
 *
 * A drafter proposes the next few tokens of a request cheaply; the target
 * model verifies them in one batched forward (engine_req.h), and the output
 * is the target's, token for token and bit for bit: a draft only decides
 * how many target rows one forward computes, never what they compute.
 *
 * Contract:
 *  - spec_drafter is engine-wide. Its kinds:
 *      SPEC_LOOKUP  prompt lookup: the continuation of the most recent
 *                   earlier occurrence of the text's last n-gram (n from
 *                   ngram_max down to ngram_min) among the prompt and the
 *                   reply so far. No model, no state.
 *      SPEC_DRAFT   a second model with the target's vocabulary, greedy,
 *                   with K/V in a pool of its own (its own namespace: it
 *                   never touches the target's pool or cache) and, for
 *                   recurrent draft models, a model_state per request.
 *      SPEC_MTP     the target's own MTP ("nextn") head (model.h), fed the
 *                   target's hidden row of the last committed position.
 *  - spec_seq is one request's drafter state. spec_draft(d, s, all, n, ...)
 *    proposes up to k tokens to follow all[0, n), where all[n-1] is the
 *    newest committed token (sampled, not yet forwarded by the target). It
 *    may return fewer (0: no proposal); it never fails a request: a draft
 *    pool that is full or a forward that fails means no draft.
 *  - Drafts may be wrong; the drafter catches up on what was committed at
 *    its next call (drops what it guessed wrong, forwards what it missed).
 *  - spec_draft on one drafter may be called from several threads: calls
 *    that run a model are serialised on the drafter's lock.
 *  - Adaptive k (spec_next_k, spec_verified) keeps a cost governor per
 *    drafter that pauses speculation while it costs more than plain
 *    decoding (engine_spec.c says how it measures and when it tries
 *    again). It decides timing only, never a token; while it is paused
 *    nothing drafts and a draft model or MTP head does no work (they catch
 *    up in one batch when it speculates again).
 *  - Drafters hold no pointer into a request; the request frees its
 *    spec_seq before the drafter is freed.
 *  - The MTP head's sidecar (reference §13.2): the head's K/V and the
 *    target hidden rows it read, kept beside the prompt cache so that a
 *    request whose target prefix came from the cache does not draft with a
 *    cold head. spec_sidecar_store saves a request's head state (only when
 *    every row it holds was computed from real hidden rows); the first
 *    spec_observe of a request whose target starts at p0 > 0 looks for an
 *    entry of the same salt whose tokens extend the request's first p0 and
 *    adopts exactly p0 rows. Entries pin blocks of the head's own pool, live
 *    in their own LRU (entry count and byte budget) and are mirrored to the
 *    SSD tier (below). Exactness: a restored head holds the same bits a
 *    cold run computes for those positions, so its drafts, and therefore
 *    the acceptance, are the cold run's.
 *  - The same sidecar for a draft model (a second model: its entries pin
 *    blocks of its own pool, its own namespace): its K/V of a prompt and,
 *    for a recurrent draft model, its state there. Stored
 *    after its first catch-up over the prompt (post-prefill) and at
 *    retirement; the first draft of a request adopts the longest entry of
 *    its salt that shares a prefix with it (a recurrent draft model: an
 *    entry that is a prefix, its exact length), so the draft model skips
 *    that prefill. Same bits as computing them: same drafts. Its entries
 *    are mirrored to the SSD tier too, as side files of their own owner
 *    namespace (XXH3-128 of the draft model's fingerprint, its pool's KV
 *    format, its layers' row sizes and its state size) under a salt derived
 *    from it, the state after the rows: a restart with another draft model
 *    (or format) adopts none of them. spec_sidecar_prefetch reads one when
 *    memory holds nothing as long for the prompt. */
#ifndef EMBER_ENGINE_SPEC_H
#define EMBER_ENGINE_SPEC_H

#include <stdbool.h>
#include <stdint.h>

#include "apc/apc.h"
#include "core/error.h"
#include "model/model.h"

typedef enum spec_kind {
    SPEC_OFF = 0,
    SPEC_LOOKUP = 1,
    SPEC_DRAFT = 2,
    SPEC_MTP = 3,
} spec_kind;

typedef struct spec_config {
    spec_kind kind;
    int k;                   /* most tokens drafted per step (1..SPEC_MAX_K) */
    bool adaptive;           /* shrink k while drafts are rejected, grow it while accepted */
    int ngram_min, ngram_max;/* SPEC_LOOKUP: n-gram lengths tried, longest first */
    const model *draft;      /* SPEC_DRAFT: borrowed, outlives the drafter */
    int sidecar_entries;     /* SPEC_MTP, SPEC_DRAFT: sidecar LRU entries (0: no sidecar) */
    size_t sidecar_bytes;    /* and their byte budget (hidden rows or draft states + pinned blocks) */
    bool sidecar_memory_only;/* no SSD mirror of the sidecar (default: mirrored where the cache has a disk) */
    int prefix_entries;      /* the prefix layer, L0 (engine_prefix.h): entries; 0: off */
    size_t prefix_bytes;     /* its byte budget */
    int prefix_min;          /* shortest prefix it adopts */
} spec_config;

enum { SPEC_MAX_K = 16 };

typedef struct spec_drafter spec_drafter;
typedef struct spec_seq spec_seq;

/* Per generated token (engine_request.draft_marks): whether a draft
 * proposed it and whether the target kept that draft. A token after a
 * rejection in the same round was never judged: SPEC_MARK_NONE. */
enum { SPEC_MARK_NONE = 0, SPEC_MARK_REJECTED = 1, SPEC_MARK_ACCEPTED = 2 };

/* Per-request acceptance counters (for stats and the bench). */
typedef struct spec_stats {
    int64_t rounds;          /* verification forwards that carried drafts */
    int64_t drafted;         /* tokens proposed */
    int64_t accepted;        /* of those, equal to what the target emitted */
    int64_t paused;          /* adaptive: times the cost governor paused speculation */
    int64_t replays;         /* recurrent draft model: rollbacks with no snapshot to return to, which
                              * reset its state and forwarded the kept tokens again */
    uint64_t digest;         /* FNV-1a over every (position, draft) proposed: two runs
                              * drafted the same tokens at the same places iff equal */
} spec_stats;

/* ---- Lifetime ---- */
/* target: the model the drafts are verified by (vocabulary and, for
 * SPEC_MTP, the head). n_blocks sizes a draft model's or MTP head's pool. */
spec_drafter *spec_drafter_create(const model *target, const spec_config *cfg, int32_t n_blocks, int n_threads,
                                  int max_batch, ember_error *err);
void spec_drafter_free(spec_drafter *d);
const spec_config *spec_drafter_config(const spec_drafter *d);
const char *spec_kind_name(spec_kind kind);

/* salt: the request's tenant salt (sidecar entries never cross tenants). */
spec_seq *spec_seq_create(spec_drafter *d, uint64_t salt, ember_error *err);
void spec_seq_free(spec_drafter *d, spec_seq *s);

/* ---- Drafting ---- */
/* Up to k (<= SPEC_MAX_K) tokens to follow all[0, n) into out; returns how
 * many. SPEC_MTP drafts only when it has observed all[0, n-1). */
int spec_draft(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t n, int k, int32_t *out);
/* SPEC_MTP: whether the drafter reads the target's hidden rows. */
bool spec_drafter_wants_hidden(const spec_drafter *d);
/* The target forwarded the committed tokens all[p0, p0+n) with hidden rows
 * hidden (n, n_embd): the MTP head takes them in (its own K/V of those
 * positions). A gap (positions the target never forwarded here, such as a
 * cached prefix) is filled with zero hidden rows: the head drafts, less
 * well, until the sidecar restores its K/V. No-op for other drafters. */
void spec_observe(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t p0, int64_t n, const float *hidden);
/* The target verified a round: `drafted` proposed, `accepted` of them
 * emitted. Updates the counters, the adaptive k and its cost governor
 * (the wall time since the previous call: call it once per round). */
void spec_verified(spec_drafter *d, spec_seq *s, int drafted, int accepted);
/* The drafter's own state of a prompt as opaque rows, for the prefix
 * layer (engine_prefix.h): SPEC_MTP only, spec_state_words words a
 * position (the head's K/V rows as its pool encodes them, then the
 * target's hidden row it read); 0 for other drafters. spec_export copies
 * s's rows [0, n) (malloc'd; NULL unless the head is faithful and holds
 * them); spec_import puts them into a request whose head holds nothing
 * yet, and when the head's pool has no room, computes the head's rows
 * from the hidden rows instead (the same bits either way). */
size_t spec_state_words(const spec_drafter *d);
uint32_t *spec_export(spec_drafter *d, spec_seq *s, int64_t n);
void spec_import(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t n, const uint32_t *rows);
/* SPEC_MTP: saves s's head state over all[0, n) (clamped to the rows it
 * has observed) in the sidecar; no-op when the head was not faithful. */
void spec_sidecar_store(spec_drafter *d, spec_seq *s, const int32_t *all, int64_t n);
/* The SSD mirror (reference §13.2): every sidecar entry is also written to
 * cache's SSD tier (apc_side_store: the target's namespace, a sidecar
 * salt; a draft model's under its own owner namespace), and
 * spec_sidecar_prefetch, run where the driver reads the disk (off the
 * engine thread), brings the entry for a prompt whose target prefix memory
 * now holds (p tokens of tokens[0, n); a draft model: the longest prefix
 * of tokens[0, n) memory lacks) back into memory when memory has none, so
 * a restart restores target and drafter together. The cache's remote
 * (Redis) tier, when it has one, gets the same entries, so a replica
 * restores them too. No-op without a disk or remote tier, a sidecar, or
 * with sidecar_memory_only. */
void spec_sidecar_attach(spec_drafter *d, apc *cache);
void spec_sidecar_prefetch(spec_drafter *d, const int32_t *tokens, int64_t p, int64_t n, uint64_t salt);
/* Sidecar counters: entries stored, requests whose head was restored. */
typedef struct spec_sidecar_stats {
    int64_t writes, hits, entries;
    int64_t disk_writes, disk_loads; /* entries queued to / brought back from the SSD (or remote) tier */
    int64_t restored_rows;           /* drafter rows restores adopted instead of computing */
    int64_t draft_rows;              /* SPEC_DRAFT: rows the draft model forwarded */
    size_t bytes;
} spec_sidecar_stats;
spec_sidecar_stats spec_sidecar_get_stats(spec_drafter *d);
/* The k the next round of a request whose committed tokens are all[0, n)
 * should ask for (adaptive, or the configured k). Adaptive: 0 while the
 * cost governor holds speculation paused; the call that ends a pause
 * starts measuring it again. */
int spec_next_k(spec_drafter *d, spec_seq *s, int64_t n);
spec_stats spec_seq_stats(const spec_seq *s);
/* The cost governor's own account (adaptive k; all zeros otherwise), over
 * every request of the drafter: where speculation's cost went. */
typedef struct spec_governor_stats {
    int64_t measurements;    /* measurements begun: the first, the re-checks, the probes after a pause */
    int64_t pauses;          /* verdicts that paused speculation */
    int64_t spec_rounds;     /* verified rounds that carried drafts */
    int64_t spec_tokens;     /* tokens those rounds committed */
    double spec_s;           /* their wall time, one-off catch-ups left out */
    double spec_extra_s;     /* of that, beyond the same tokens at the plain median of the time */
    int64_t plain_rounds;    /* rounds without drafts (paused, k = 0, plain halves of a pair) */
    int64_t paused_rounds;   /* of those, rounds while paused */
    int64_t catch_rows;      /* one-off catch-ups: the prompt, or what a pause skipped (rows, seconds) */
    double catch_s;
    double plain_token_s;    /* the current median plain round per token (0: none yet) */
} spec_governor_stats;
spec_governor_stats spec_governor_get_stats(spec_drafter *d);

/* ---- Testing ---- */
/* A recurrent draft model keeps no snapshot of its state, so each rollback
 * takes the fallback: reset, forward the kept tokens again (slower; the
 * same state bits, so the same drafts). Tests prove that path exact. */
void spec_drafter_refuse_snapshots(spec_drafter *d, bool refuse);
/* Puts an adaptive drafter's cost governor into (or out of) its paused
 * state, as a measurement that found speculation slower does: nothing
 * drafts until the governor measures again, and the MTP head only keeps
 * the hidden rows it is handed (tests compare that lazy path with the
 * eager one, bit for bit). */
void spec_drafter_hold_paused(spec_drafter *d, bool paused);

#endif
