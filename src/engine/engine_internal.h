/* engine_internal.h - what engine_req.c needs of the engine (engine.c).
 *
 * The predictor thread: one per engine, started on the first job, runs
 * render predictions (chat_turn_predict) in submission order so that no
 * forward pass waits on a template. A job is owned by its submitter; the
 * thread only writes its result and then sets done. engine__predict_cancel
 * returns once the thread no longer touches the job (it was removed from
 * the queue, or it finished). */
#ifndef EMBER_ENGINE_INTERNAL_H
#define EMBER_ENGINE_INTERNAL_H

#include <stdatomic.h>
#include <stdint.h>

#include "chat/chat_plan.h"
#include "engine/engine.h"

typedef struct engine_predict_job {
    chat_turn_predictor *predictor;
    int32_t *tokens;     /* (n) a copy of the sequence's tokens */
    int64_t n;
    int64_t result;      /* chat_turn_predict's answer */
    atomic_bool done;
    struct engine_predict_job *next_queued;  /* the engine's queue */
    struct engine_predict_job *next_pending; /* the request's own FIFO */
} engine_predict_job;

/* The fetch threads: the SSD tier's part of a lookup (apc_prefetch) runs
 * there, never on the engine thread. A job is shared by its request and
 * the thread (refs); whoever lets go last frees it, so a request never
 * waits for a read that hangs. */
typedef struct engine_fetch_job {
    apc *cache;
    spec_drafter *drafter; /* its sidecar's SSD mirror is read beside the target's; or NULL */
    int32_t *tokens;     /* (n) a copy of the prompt */
    int64_t n;
    uint64_t salt;
    atomic_bool done;
    atomic_int refs;
    struct engine_fetch_job *next_queued;
} engine_fetch_job;

void engine__fetch_submit(engine *e, engine_fetch_job *j); /* takes a reference for the thread */
void engine__fetch_unref(engine_fetch_job *j);

void engine__predict_submit(engine *e, engine_predict_job *j);
/* Runs a job on the calling thread (inline runners, no thread). */
void engine__predict_run(engine_predict_job *j);
void engine__predict_cancel(engine *e, engine_predict_job *j);
int engine__prefill_step(const engine *e);

#endif
