/* serve_kv_events.h - KV events for cache-aware routers: what the prompt
 * cache can find in memory, published over ZeroMQ in vLLM's wire format, so
 * that llm-d's KV-events indexer (llm-d-kv-cache-manager) can send each
 * request to the replica that already holds its prefix.
 *
 * Contract:
 *  - A publisher owns a PUB socket (an endpoint with '*', '::', ipc:// or
 *    inproc:// is bound, any other is connected to: the consumer binds) and,
 *    optionally, a ROUTER socket for replays. Each message is three frames:
 *    the topic, an 8-byte big-endian sequence number (0, 1, 2, ... without
 *    gaps) and a msgpack batch [timestamp, [events], data_parallel_rank 0].
 *  - Events: BlockStored for every full 16-token block that becomes findable
 *    in memory (consecutive blocks of one chain share one event: hashes,
 *    the parent of the first, their 16 token ids each), BlockRemoved for
 *    every such block evicted, AllBlocksCleared when the publisher starts,
 *    at a cache reset and at shutdown (kv_events_clear). A block hash is the
 *    first 8 bytes of ember's 128-bit chained key, big-endian; the partial
 *    tail blocks ember also indexes are not reported (vLLM reports full
 *    blocks only, and routers key 16-token chunks).
 *  - Blocks of every tenant are reported: a router's keys carry no salt, so
 *    it may send a tenant to a replica that holds another tenant's identical
 *    prefix, where the lookup misses (salts never share blocks); routing is
 *    a hint, never an adoption.
 *  - The cache's listener only appends to a bounded queue; encoding and
 *    sending run on the publisher's own thread, never on the engine thread.
 *    A full queue is dropped, counted, and replaced by one AllBlocksCleared,
 *    so a router forgets rather than believes stale blocks.
 *  - Replay: a request [identity, "", 8-byte start seq] on the ROUTER gets
 *    every buffered batch with seq >= start as [identity, "", seq, payload],
 *    then [identity, "", -1 as 8 bytes, ""]. The last buffer_steps batches
 *    are kept.
 *  - Thread-safe: the listener runs on any cache thread; the rest is called
 *    by the server. Detach (or free) the publisher before its cache is freed.
 *
 * API:
 *   lifetime   kv_events_create, kv_events_free
 *   the cache  kv_events_attach, kv_events_detach, kv_events_clear
 *   draining   kv_events_flush
 *   counters   kv_events_get_stats
 */
#ifndef EMBER_SERVE_KV_EVENTS_H
#define EMBER_SERVE_KV_EVENTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "apc/apc.h"
#include "core/error.h"

typedef struct kv_events kv_events;

typedef struct kv_events_config {
    const char *endpoint;        /* PUB address: a wildcard host binds, a named one connects */
    const char *replay_endpoint; /* ROUTER address (bound); NULL or "": no replay socket */
    const char *topic;           /* first frame of every message, e.g. "kv@pod-1@qwen3" */
    int buffer_steps;            /* batches kept for replay; <= 0: 10000 */
    int max_pending;             /* blocks queued before the queue overflows; <= 0: 100000 */
} kv_events_config;

typedef struct kv_events_stats {
    uint64_t batches;            /* messages published (the next sequence number) */
    uint64_t stored, removed, cleared; /* events published, by kind (blocks for stored/removed) */
    uint64_t dropped;            /* blocks lost to a full queue */
    uint64_t replays;            /* replay requests answered */
    uint64_t bytes;              /* payload bytes published (frames 3) */
} kv_events_stats;

/* The default topic of llm-d's convention: "kv@<host name>@<model>". */
void kv_events_default_topic(const char *model_id, char *out, size_t cap);

kv_events *kv_events_create(const kv_events_config *cfg, ember_error *err);
/* Sends what is queued (up to 2 s), then closes the sockets. */
void kv_events_free(kv_events *ev);

/* Starts reporting the cache's block changes (one cache at a time). */
void kv_events_attach(kv_events *ev, apc *c);
void kv_events_detach(kv_events *ev);
/* Queues an AllBlocksCleared. */
void kv_events_clear(kv_events *ev);
/* Waits up to timeout_ms until everything queued so far has been sent;
 * true when it was. */
bool kv_events_flush(kv_events *ev, int timeout_ms);

void kv_events_get_stats(kv_events *ev, kv_events_stats *out);

#endif
