/* serve_settings.c - the one table of ember's settings, and everything that
 * reads it (see serve_settings.h).
 *
 * Design: a setting is data, not code. Each row names the field it writes
 * by (home struct, offset) and its syntax by a type; one typed setter
 * (serve_setting_set) serves the file, the environment and the flags, so a
 * value means the same thing wherever it is written and its error message
 * has one shape. Defaults are rows too, written as text and applied through
 * the same setter, so the default a user reads in --help, the man page or
 * docs/cache-switches.md is the default the program runs with; test_settings
 * checks that the cache's own compiled-in defaults (apc_default_config) agree
 * with the table. The writers at the end render the table for people:
 * markdown for the repository, troff for the man page, plain text for
 * --help. */
#include "serve/serve_settings.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "serve/serve_config.h"

_Static_assert(sizeof(int32_t) == sizeof(int), "num_blocks is written as an int");

#define SRV(field) SETTING_IN_SERVER, offsetof(serve_config, field), sizeof(((serve_config *)0)->field)
#define APC(field) SETTING_IN_CACHE, offsetof(apc_config, field), 0

/* key, env, flag, type, default, lo, hi, choices, metavar, help, detail, secret, home+field */
static const serve_setting table[] = {
    /* ---- server ---- */
    {"server.host", "EMBER_HOST", "host", SETTING_STR, "127.0.0.1", 0, 0, NULL, "ADDR",
     "address to listen on (IPv4, IPv6 or localhost)", NULL, false, SRV(host)},
    {"server.port", "EMBER_PORT", "port", SETTING_INT, "8080", 0, 65535, NULL, NULL,
     "TCP port; 0 picks a free one (logged)", NULL, false, SRV(port)},
    {"server.api_key", "EMBER_API_KEY", "api-key", SETTING_STR, "", 0, 0, NULL, "KEY",
     "bearer token every request must carry; empty: no authentication", NULL, true, SRV(api_key)},
    {"server.api_keys_file", "EMBER_API_KEYS_FILE", "api-keys-file", SETTING_STR, "", 0, 0, NULL, "FILE",
     "file of API keys: one `SHA256-HEX TENANT [admin]` per line; a request's tenant is its key's",
     "Lines hold `printf %s KEY | sha256sum` of each key, never the key. With this file, "
     "`/v1/cache/stats` shows a tenant its own counters (admin keys: everything, with `tenants`), and "
     "`/metrics`, `/v1/cache/recent` and `POST /v1/cache/reset` need an admin key. `server.api_key` stays "
     "valid as an admin key without a tenant.",
     false, SRV(api_keys_file)},
    {"server.trusted_tenant_header", "EMBER_TRUSTED_TENANT_HEADER", "trusted-tenant-header", SETTING_BOOL, "false", 0,
     0, NULL, NULL, "take the tenant from X-APC-Tenant / X-Tenant-Id (set by a trusted proxy)",
     "Off: those headers are ignored and the tenant comes from the API key. On: the header wins over the key's "
     "tenant, and a request carrying more than one tenant header is refused (400).",
     false, SRV(trusted_tenant_header)},
    {"server.tenant_secret_file", "EMBER_TENANT_SECRET_FILE", "tenant-secret-file", SETTING_STR, "", 0, 0, NULL,
     "FILE", "the secret mixed into every tenant's cache salt; created (mode 0600) when missing",
     "Empty: `tenant-secret` beside `cache.disk.path` when that is set, else in the per-user cache directory "
     "(`$XDG_CACHE_HOME/ember`, `~/.cache/ember`). Servers sharing a disk tier must share this file.",
     false, SRV(tenant_secret_file)},
    {"server.default_max_tokens", "EMBER_DEFAULT_MAX_TOKENS", "default-max-tokens", SETTING_INT, "4096", 0, 1 << 24,
     NULL, NULL, "reply length of a request that sets no max_tokens; 0: the rest of the context",
     "Admission reserves KV blocks for prompt + max_tokens, so an unbounded default would let a few requests "
     "reserve the whole pool.",
     false, SRV(default_max_tokens)},
    {"server.model_id", "EMBER_MODEL_ID", "model-id", SETTING_STR, "", 0, 0, NULL, "NAME",
     "model name in the API; empty: the model file's base name", NULL, false, SRV(model_id)},
    {"server.ctx", "EMBER_CTX", "ctx", SETTING_INT, "0", 0, 1 << 24, NULL, NULL,
     "largest sequence in tokens; 0: min(training context, 4096)", NULL, false, SRV(n_ctx)},
    {"server.threads", "EMBER_THREADS", "threads", SETTING_INT, "0", 0, 1024, NULL, NULL,
     "threads per forward pass; 0: all CPUs", NULL, false, SRV(n_threads)},
    {"server.prefill_step", "EMBER_PREFILL_STEP", "prefill-step", SETTING_INT, "512", 1, 1 << 16, NULL, NULL,
     "prefill chunk in tokens: the grid of absolute positions and the largest forward batch", NULL, false,
     SRV(prefill_step)},
    {"server.attention_precision", "EMBER_ATTENTION_PRECISION", "attention-precision", SETTING_STR, "f32", 0, 0,
     "f32|bf16|int8", NULL,
     "precision of attention's products: f32, bf16 or int8 (faster long prompts, less exact)",
     "bf16 rounds the query, K and V and the softmax weights to bf16 and multiplies them with vdpbf16ps (f32 sums "
     "and softmax): 1.6x the f32 prefill rate at 16k tokens on the qwen3-0.6b shape, about f16 KV's accuracy "
     "cost again, and slower decode. int8 runs both products on signed bytes (one step per query, key and "
     "value head; the softmax weights as bytes per block of 64 keys; vpdpbusd): 1.35x bf16's attention rate, "
     "about q8_0 KV's accuracy cost; figures in docs/attention.md. "
     "Both need AVX512_BF16 and heads of 64 or 128 values and no kvarn pool; elsewhere f32 runs and "
     "/v1/cache/stats says why (`attention_precision_fallback`). Warm equals cold under each; the SSD and "
     "remote namespaces of each precision differ, so one never adopts another's rows.",
     false, SRV(attention_precision)},
    {"server.max_running", "EMBER_MAX_RUNNING", "max-running", SETTING_INT, "32", 1, 4096, NULL, NULL,
     "sequences decoded together", NULL, false, SRV(max_running)},
    {"server.queue_size", "EMBER_QUEUE_SIZE", "queue-size", SETTING_INT, "64", 0, 1 << 20, NULL, NULL,
     "requests that may wait; more get 503", NULL, false, SRV(queue_size)},
    {"server.max_body_bytes", "EMBER_MAX_BODY_BYTES", "max-body-bytes", SETTING_BYTES, "4194304", 0, 0, NULL, NULL,
     "largest request body (at least 1024); larger ones get 413", NULL, false, SRV(max_body_bytes)},
    {"server.connection_limit", "EMBER_CONNECTION_LIMIT", "connection-limit", SETTING_INT, "1024", 1, 1 << 16, NULL,
     NULL, "open HTTP connections before new requests get 503 with Retry-After", NULL, false, SRV(connection_limit)},
    {"server.per_ip_connection_limit", "EMBER_PER_IP_CONNECTION_LIMIT", "per-ip-connection-limit", SETTING_INT, "256",
     0, 1 << 16, NULL, NULL, "open connections of one client address before 503; 0: no limit", NULL, false,
     SRV(per_ip_connection_limit)},
    {"server.read_timeout", "EMBER_READ_TIMEOUT", "read-timeout", SETTING_INT, "30", 1, 3600, NULL, "SECONDS",
     "seconds a client has to deliver a whole request (head and body) after connecting or after its previous answer",
     "A connection that trickles its header or sits idle is closed when this passes.", false, SRV(read_timeout)},
    {"server.idle_timeout", "EMBER_IDLE_TIMEOUT", "idle-timeout", SETTING_INT, "60", 1, 86400, NULL, "SECONDS",
     "seconds of silence before a connection is closed", NULL, false, SRV(idle_timeout)},
    {"server.http_threads", "EMBER_HTTP_THREADS", "http-threads", SETTING_INT, "2", 1, 64, NULL, NULL,
     "event-loop threads of the HTTP layer (libmicrohttpd, epoll)", NULL, false, SRV(http_threads)},
    {"server.drain_timeout", "EMBER_DRAIN_TIMEOUT", "drain-timeout", SETTING_INT, "30", 0, 86400, NULL, "SECONDS",
     "on SIGTERM, longest wait for running and queued requests to finish before they are cancelled",
     "The drain: GET /ready answers 503, new generations get 503, running ones finish, pending SSD writes land, "
     "then the process exits 0.",
     false, SRV(drain_timeout)},
    {"server.kv_events.endpoint", "EMBER_KV_EVENTS_ENDPOINT", "kv-events-endpoint", SETTING_STR, "", 0, 0, NULL,
     "ADDR", "ZeroMQ address to publish vLLM-format KV events on; empty: off",
     "For cache-aware routers (llm-d's KV-events indexer): BlockStored / BlockRemoved for every 16-token block "
     "that becomes findable or stops being findable in memory, AllBlocksCleared at start, reset and shutdown. "
     "An address with `*` (`tcp://*:5557`), `ipc://` or `inproc://` is bound; any other (`tcp://router:5557`) is "
     "connected to. Format and sources: src/serve/serve_kv_events.c.",
     false, SRV(kv_events_endpoint)},
    {"server.kv_events.replay_endpoint", "EMBER_KV_EVENTS_REPLAY_ENDPOINT", "kv-events-replay-endpoint", SETTING_STR,
     "", 0, 0, NULL, "ADDR", "ZeroMQ ROUTER address (bound) where a subscriber asks for batches it missed; empty: none",
     NULL, false, SRV(kv_events_replay_endpoint)},
    {"server.kv_events.topic", "EMBER_KV_EVENTS_TOPIC", "kv-events-topic", SETTING_STR, "", 0, 0, NULL, "TOPIC",
     "topic frame of every KV-event message; empty: kv@<host name>@<model id>", NULL, false, SRV(kv_events_topic)},
    {"server.kv_events.buffer_steps", "EMBER_KV_EVENTS_BUFFER_STEPS", "kv-events-buffer-steps", SETTING_INT, "10000",
     1, 1 << 24, NULL, NULL, "KV-event batches kept for replays", NULL, false, SRV(kv_events_buffer_steps)},

    {"server.draft", "EMBER_SPEC_DRAFT", "draft", SETTING_STR, "", 0, 0, NULL, "GGUF",
     "draft model for speculative decoding (its vocabulary must be the target's); empty: none",
     "With `spec.mode` auto, a draft model turns speculation on. Its K/V live in a pool of their own, as large as "
     "the target's in blocks.", false, SRV(draft)},

    /* ---- speculative decoding ---- */
    {"spec.mode", "EMBER_SPEC_MODE", "spec", SETTING_STR, "auto", 0, 0, "auto|off|lookup|draft|mtp", NULL,
     "drafter: auto (draft when server.draft is set, else off), off, lookup (prompt n-grams), draft, mtp",
     "Whatever drafts, the output is the target's, bit for bit (tokens, logprobs, seeded samples): a draft only "
     "decides how many rows one verification forward computes.", false, SRV(spec_mode)},
    {"spec.k", "EMBER_SPEC_K", "spec-k", SETTING_INT, "4", 1, 16, NULL, NULL,
     "most tokens drafted per decode step", NULL, false, SRV(spec_k)},
    {"spec.adaptive", "EMBER_SPEC_ADAPTIVE", "spec-adaptive", SETTING_BOOL, "true", 0, 0, NULL, NULL,
     "halve k after a step whose first draft was rejected, double it after one whose drafts all held",
     "At k = 0 a request probes with one draft every 8 steps, so a drafter that keeps missing costs one extra "
     "row in 8 steps. A cost governor also times speculative steps, each beside a plain one (first, then every 32 "
     "speculative steps), and pauses speculation whenever a speculated token costs more than a plain one; while "
     "paused nothing drafts (a draft model or MTP head does no work), and it measures again only once 1% of the "
     "plain time since the pause pays for that measurement and the drafter's catch-up (less often each time it "
     "fails). Timing only: it never changes a token.", false, SRV(spec_adaptive)},
    {"spec.sidecar_entries", "EMBER_SPEC_SIDECAR_ENTRIES", "spec-sidecar-entries", SETTING_INT, "12", 0, 64, NULL,
     NULL, "drafter sidecar: entries kept (the MTP head's K/V and hidden rows, or the draft model's K/V and state, "
     "per stored prompt); 0: none",
     "A warm request whose target prefix came from the prompt cache restores the head for exactly that prefix, "
     "so it drafts what a cold run drafts (`sidecar_writes`, `spec.sidecar_hits` in /v1/cache/stats). The head's "
     "entries are mirrored to the SSD tier (side files under a sidecar salt in the model's namespace), so a "
     "restart restores target and head together. A draft model's entries spare it the prompt's prefill, and are "
     "mirrored too (`spec.sidecar_mirror`).", false,
     SRV(spec_sidecar_entries)},
    {"spec.sidecar_mb", "EMBER_SPEC_SIDECAR_MB", "spec-sidecar-mb", SETTING_MIB, "512", 1, 1 << 20, NULL, NULL,
     "drafter sidecar: byte budget; an entry larger than it is not stored", NULL, false, SRV(spec_sidecar_bytes)},
    {"spec.ngram_max", "EMBER_SPEC_NGRAM_MAX", "spec-ngram-max", SETTING_INT, "3", 1, 16, NULL, NULL,
     "prompt lookup: longest n-gram matched (tried first)", NULL, false, SRV(spec_ngram_max)},
    {"spec.prefix_entries", "EMBER_SPEC_PREFIX_ENTRIES", "spec-prefix-entries", SETTING_INT, "4", 0, 1024, NULL, NULL,
     "prefix layer (L0) of a speculating server: post-prefill snapshots kept; 0: off",
     "L0 works with the prompt cache off (`cache.enabled: false`): it keeps the target's K/V rows, recurrent state "
     "and, for an MTP head, the hidden rows of a prompt, and a later prompt that extends it (or repeats it) resumes "
     "there, bit-identical to a cold run. With the cache on the pools and the drafter sidecar hold all of that, so "
     "L0 stores nothing (`spec_prefix_hits`, `spec_prefix_hit_tokens`, `spec_prefix_stores` in /v1/cache/stats).",
     false, SRV(spec_prefix_entries)},
    {"spec.prefix_mb", "EMBER_SPEC_PREFIX_MB", "spec-prefix-mb", SETTING_MIB, "2048", 1, 1 << 24, NULL, NULL,
     "prefix layer (L0): byte budget of all entries; an entry larger than it is skipped (logged)", NULL, false,
     SRV(spec_prefix_bytes)},
    {"spec.prefix_min", "EMBER_SPEC_PREFIX_MIN", "spec-prefix-min", SETTING_INT, "32", 1, 1 << 20, NULL, NULL,
     "prefix layer (L0): shortest prefix adopted, in tokens", NULL, false, SRV(spec_prefix_min)},
    {"spec.sidecar_mirror", "EMBER_SPEC_SIDECAR_MIRROR", "spec-sidecar-mirror", SETTING_BOOL, "true", 0, 0, NULL,
     NULL, "mirror the drafter sidecar to the SSD tier and the remote tier (those configured); false: memory only",
     "A draft model's side files carry its K/V rows (and a recurrent draft model's state) under a namespace of its "
     "own: its fingerprint, KV format and shape. A restart (or a replica, through Redis) with another draft model "
     "adopts none of them (`spec.sidecar_disk_writes`, `spec.sidecar_disk_loads` in /v1/cache/stats, "
     "`ember_apc_sidecar_disk_writes_total`, `ember_apc_sidecar_disk_loads_total` in /metrics: entries written to "
     "and read back from either tier).",
     false, SRV(spec_sidecar_mirror)},
    /* ---- chat ---- */
    {"chat.parse_special_in_content", "EMBER_CHAT_PARSE_SPECIAL_IN_CONTENT", "parse-special-in-content", SETTING_BOOL,
     "false", 0, 0, NULL, NULL, "let control-token text inside message content become control tokens (unsafe)",
     "Off: only the chat template's own markup becomes special tokens; `<|im_end|>` typed by a user stays text, "
     "so a user cannot forge a system or assistant turn. On: the old behaviour.",
     false, SRV(parse_special_in_content)},

    /* ---- cache ---- */
    {"cache.enabled", "APC_ENABLED", "cache", SETTING_BOOL, "true", 0, 0, NULL, NULL,
     "the prompt cache; --no-cache turns it off (tier none)", NULL, false, APC(enabled)},
    {"cache.block_size", "APC_BLOCK_SIZE", "block-size", SETTING_INT, "16", 1, 1 << 16, NULL, NULL,
     "tokens per KV block; only 16 is supported", NULL, false, SRV(block_size)},
    {"cache.num_blocks", "APC_NUM_BLOCKS", "num-blocks", SETTING_INT, "0", 0, INT_MAX, NULL, NULL,
     "KV pool size in blocks (the pool is the block tier); 0: cache.memory_share of the memory available at start",
     "0 sizes the pool as `cache.memory_share x (available - model weights - margin)`, the margin being 10% of "
     "the available memory and at least 512 MiB, and logs the arithmetic (`KV pool: N blocks (T tokens, X GiB) = "
     "Y% of available memory (...)`). A configured size that does not fit in that memory stops the start-up with "
     "a message. See src/serve/serve_pool_size.c.",
     false, SRV(num_blocks)},
    {"cache.memory_share", "APC_MEMORY_SHARE", "memory-share", SETTING_DOUBLE, "0.5", 0, 0, NULL, "X",
     "share (0, 1] of the available memory, after weights and margin, that a default KV pool takes",
     "Pool pages are touched only as the cache fills, so servers started together all see the memory as free: "
     "for N servers on one machine give each 1/N.",
     false, SRV(memory_share)},
    {"cache.kv_format", "EMBER_KV_FORMAT", "kv-format", SETTING_STR, "f16", 0, 0, NULL, "FORMAT",
     "how the KV pool stores K/V rows: f32, f16, q8_0, or kvarn[-k<K>v<V>][-t<TAIL>] (default kvarn-k6v5-t1024)",
     "f16 halves the bytes per token of f32; q8_0 stores V as ggml's Q8_0 (34 bytes per 32 values) and K as 12-bit "
     "integers after an 8-value Hadamard rotation (50 bytes per 32), so the same pool (the block tier) holds 2x or "
     "3x the tokens; measured quality and speed per format: `make bench-kv` (docs/kv-formats.md). "
     "kvarn seals every 128-token group behind an fp16 sink (the first 128 tokens) and an fp16 tail of TAIL tokens "
     "into a record of K bits per K value and V bits per V value (2..8 each; ':' also separates, e.g. kvarn:k6v5); "
     "a dense model then uses the exact tier instead of the block tier, which the routing line says. "
     "The format (with kvarn's widths, tail and layout version) enters the SSD namespace: a server restarted with "
     "another format adopts none of the old files and logs that once. kvarn does not combine with speculative "
     "decoding.",
     false, SRV(kv_format)},
    {"cache.exact_entries", "APC_EXACT_CACHE_ENTRIES", "exact-entries", SETTING_INT, "0", 0, 1 << 20, NULL, NULL,
     "count cap on the exact tier's whole-state snapshots; 0: none, `cache.exact_budget_mb` sizes the tier",
     "Sized by bytes so that interleaved agents do not evict each other's retirement snapshots; the newest entry "
     "always survives.",
     false, APC(exact_entries)},
    {"cache.exact_budget_mb", "APC_EXACT_BUDGET_MB", "exact-budget-mb", SETTING_MIB, "4096", 0, 1 << 24, NULL, NULL,
     "byte budget (MiB) of the exact tier's snapshots, least recently used first; 0 turns that tier off", NULL, false,
     APC(exact_max_bytes)},
    {"cache.hash", "APC_HASH", "hash", SETTING_HASH, "sha256", 0, 0, NULL, NULL,
     "block key hash: sha256 (truncated to 128 bits) or xxh3 (fast)", NULL, false, APC(hash)},
    {"cache.fresh_wait_ms", "APC_FRESH_WAIT_MS", "fresh-wait-ms", SETTING_INT, "500", 0, 60000, NULL, "MS",
     "freshness gate: longest a queued request waits for a sibling's store of their shared prefix; 0: off",
     "A request that shares at least `cache.fresh_min` uncached prompt tokens with a request still in its "
     "prompt phase waits for that request's store instead of prefilling the prefix cold (reference section 14.1); "
     "`fresh_holds` and `fresh_last_hold_reason` in /v1/cache/stats.",
     false, SRV(fresh_wait_ms)},
    {"cache.fresh_min", "APC_FRESH_MIN", "fresh-min", SETTING_INT, "256", 1, 1 << 24, NULL, NULL,
     "freshness gate: least shared uncached prompt tokens that make a request wait", NULL, false, SRV(fresh_min)},
    {"cache.force_tier", "EMBER_APC_FORCE_TIER", "force-tier", SETTING_FORCE, "", 0, 0, NULL, NULL,
     "override the routed tier: exact, block or off (A/B tests); empty: routing decides",
     "`block` only on an all-`kv` stack; `exact` on any stack without `other` layers.", false, APC(force_tier)},

    /* ---- cache.disk ---- */
    {"cache.disk.enabled", "APC_DISK", "disk", SETTING_BOOL, "true", 0, 0, NULL, NULL,
     "the SSD tier: evicted memory blocks stay findable on disk and across restarts; --no-disk turns it off",
     "In the file, `disk: true` / `disk: false` is the same switch.", false, SRV(disk_enabled)},
    {"cache.disk.path", "APC_DISK_PATH", "disk-path", SETTING_STR, "", 0, 0, NULL, "DIR",
     "root of the SSD tier; empty: the per-user directory, $XDG_CACHE_HOME/ember/apc or ~/.cache/ember/apc",
     "A configured path that cannot be created or written stops the start-up with a message, unless "
     "`cache.disk.optional`; at the per-user default it is a warning and the server runs from memory.",
     false, SRV(disk_path)},
    {"cache.disk.optional", "APC_DISK_OPTIONAL", "disk-optional", SETTING_BOOL, "false", 0, 0, NULL, NULL,
     "a configured disk tier that cannot open is a warning (serve from memory) instead of a start-up error", NULL,
     false, SRV(disk_optional)},
    {"cache.disk.max_gb", "APC_DISK_MAX_GB", "disk-max-gb", SETTING_DOUBLE, "auto", 0, 0, "auto", "GB",
     "size cap of the namespace in GB (10^9 bytes); 0: unbounded; auto: 25% of the free space, at most 50 GB",
     "Over the cap, files go oldest first down to 90% of it. `auto` measures the space free on the cache's "
     "filesystem at start-up (statvfs) and logs the choice (`APC disk tier size cap=... (25% of ... free)`); "
     "see src/serve/serve_disk_cap.c for why.",
     false, SRV(disk_max_gb)},
    {"cache.disk.read_wait_ms", "APC_DISK_READ_WAIT_MS", "disk-read-wait-ms", SETTING_INT, "1000", 1, 600000, NULL,
     "MS", "longest a request waits for its SSD reads before it looks up what memory holds",
     "Reads run on fetch threads, never on the engine thread; a read past its deadline finishes on its own and "
     "serves later requests (`disk_read_deadline_misses` in /v1/cache/stats).",
     false, SRV(disk_wait_ms)},
    {"cache.disk.workers", "APC_DISK_WORKERS", "disk-workers", SETTING_INT, "1", 1, 256, NULL, NULL,
     "disk writer threads", NULL, false, SRV(disk_workers)},
    {"cache.disk.read_mode", "APC_DISK_READ_MODE", "disk-read-mode", SETTING_STR, "direct", 0, 0, "direct|mmap", NULL,
     "how cache files are read: direct (pread) or mmap", NULL, false, SRV(disk_read_mode)},
    {"cache.disk.namespace", "APC_DISK_NAMESPACE", "disk-namespace", SETTING_STR, "", 0, 0, NULL, "NAME",
     "directory under the root; empty: derived from the model fingerprint and cache format", NULL, false,
     SRV(disk_namespace)},

    /* ---- cache.remote: block chains shared between replicas through Redis ---- */
    {"cache.remote.url", "APC_REMOTE_URL", "remote-url", SETTING_STR, "", 0, 0, NULL, "URL",
     "Redis server of the remote tier: redis://host[:port][/db] or unix:///path[?db=N]; empty: no remote tier",
     "Replicas of one model under one cache format (the SSD tier's namespace) share cached prefixes there; keys "
     "carry the namespace and the chain key (tenant salt inside), values are self-describing and checksummed, a "
     "bad one is a counted miss (`remote_corrupt`). Block chains (block tier), whole snapshots (exact tier) and "
     "checkpoint skeletons with their chains (ckpt tier); not recurrent-state snapshots on block chains "
     "(`cache.ckpt.snapshot_interval` > 0 on recurrent stacks), which stay local. "
     "Counters `remote_*` in /v1/cache/stats and /metrics.",
     false, SRV(remote_url)},
    {"cache.remote.ttl_s", "APC_REMOTE_TTL", "remote-ttl", SETTING_INT, "86400", 1, INT_MAX, NULL, "SECONDS",
     "expiry of every value written to Redis", NULL, false, APC(remote.ttl_s)},
    {"cache.remote.queue_mb", "APC_REMOTE_QUEUE_MB", "remote-queue-mb", SETTING_MIB, "1024", 1, 1 << 20, NULL, NULL,
     "bytes (MiB) of block copies waiting to be written; beyond it writes are dropped (`remote_write_drops`)",
     NULL, false, APC(remote.queue_bytes)},
    {"cache.remote.deadline_fraction", "APC_REMOTE_DEADLINE_FRACTION", "remote-deadline-fraction", SETTING_DOUBLE,
     "0.5", 0, 0, NULL, NULL,
     "share of a cold prefill's estimated time that a request's Redis reads may take",
     "The estimate is the seconds per token this engine measured on its prompt chunks (before the first one: "
     "`cache.remote.prefill_tps`), times the tokens memory and disk do not hold; clamped to "
     "[`cache.remote.min_wait_ms`, `cache.remote.max_wait_ms`]. When it passes, the verified prefix is kept "
     "(`remote_timeouts`).",
     false, APC(remote.deadline_fraction)},
    {"cache.remote.min_wait_ms", "APC_REMOTE_MIN_WAIT_MS", "remote-min-wait-ms", SETTING_INT, "20", 1, 600000, NULL,
     "MS", "floor of a request's Redis read deadline", NULL, false, APC(remote.min_wait_ms)},
    {"cache.remote.max_wait_ms", "APC_REMOTE_MAX_WAIT_MS", "remote-max-wait-ms", SETTING_INT, "5000", 1, 600000,
     NULL, "MS", "ceiling of a request's Redis read deadline", NULL, false, APC(remote.max_wait_ms)},
    {"cache.remote.prefill_tps", "APC_REMOTE_PREFILL_TPS", "remote-prefill-tps", SETTING_INT, "500", 1, INT_MAX,
     NULL, NULL, "cold prefill tokens per second assumed until the engine has measured one", NULL, false,
     APC(remote.prefill_tps)},
    {"cache.remote.timeout_ms", "APC_REMOTE_TIMEOUT_MS", "remote-timeout-ms", SETTING_INT, "1000", 1, 600000, NULL,
     "MS", "socket timeout of writes and of the breaker's probes", NULL, false, APC(remote.timeout_ms)},
    {"cache.remote.breaker_failures", "APC_REMOTE_BREAKER_FAILURES", "remote-breaker-failures", SETTING_INT, "3", 1,
     1 << 20, NULL, NULL, "consecutive Redis errors or timeouts that open the circuit breaker",
     "While it is open, reads and writes are skipped at once (writes count as drops) and a background probe "
     "PINGs every `cache.remote.probe_ms`; the first opening logs one warning.",
     false, APC(remote.breaker_failures)},
    {"cache.remote.probe_ms", "APC_REMOTE_PROBE_MS", "remote-probe-ms", SETTING_INT, "1000", 1, 600000, NULL, "MS",
     "interval of the breaker's background probe", NULL, false, APC(remote.probe_ms)},

    /* ---- cache.ckpt: the checkpoint tier (hybrid and sliding-window stacks) ---- */
    {"cache.ckpt.interval", "EMBER_APC_CKPT_INTERVAL", "ckpt-interval", SETTING_INT, "4096", 0, INT_MAX, NULL, NULL,
     "spacing of the prefill interval checkpoints in tokens; 0: only the terminal point",
     "Floored to a multiple of the prefill unit (lcm of the prefill step and 16) and never below one unit. "
     "The terminal point is the last unit boundary before N-1.",
     false, APC(ckpt.interval)},
    {"cache.ckpt.replay", "EMBER_APC_CKPT_REPLAY", "ckpt-replay", SETTING_BOOL, "true", 0, 0, NULL, NULL,
     "the replay checkpoint at N-1",
     "Off: identical resends adopt at most the terminal point.", false, APC(ckpt.replay)},
    {"cache.ckpt.replay_min", "EMBER_APC_CKPT_REPLAY_MIN", "ckpt-replay-min", SETTING_INT, "64", 0, INT_MAX, NULL,
     NULL, "least prompt length N for a replay checkpoint on stacks with arr layers",
     "A replay record on an `arr` stack adopts only for the "
     "identical resend (the replay gate). Why 64 (bytes per record vs tokens saved): docs/ckpt-replay.md.",
     false, APC(ckpt.replay_min)},
    {"cache.ckpt.turn", "EMBER_APC_CKPT_TURN", "ckpt-turn", SETTING_BOOL, "true", 0, 0, NULL, NULL,
     "the turn checkpoint at the predicted next-turn boundary",
     "Off: the post-prefill store at N always runs.", false, APC(ckpt.turn)},
    {"cache.ckpt.sys", "EMBER_APC_CKPT_SYS", "ckpt-sys", SETTING_BOOL, "true", 0, 0, NULL, NULL,
     "the system-prompt anchor, on the ckpt and exact tiers", NULL, false, APC(ckpt.sys)},
    {"cache.ckpt.sys_min", "EMBER_APC_CKPT_SYS_MIN", "ckpt-sys-min", SETTING_INT, "256", 0, INT_MAX, NULL, NULL,
     "least system-prompt anchor position",
     "ckpt: also at least 16 (no longer tied to `cache.ckpt.replay_min`); exact: at least 2.", false,
     APC(ckpt.sys_min)},
    {"cache.ckpt.tripwire", "EMBER_APC_CKPT_TRIPWIRE", "ckpt-tripwire", SETTING_INT, "5", 0, INT_MAX, NULL, NULL,
     "threshold of the two one-time checkpoint warnings; 0 silences both",
     "The warnings: more than T armed requests with zero checkpoint stores; T lookups that matched a record and "
     "adopted nothing while there are no hits. A cache reset re-arms them.",
     false, APC(ckpt.tripwire)},
    {"cache.ckpt.records", "EMBER_APC_CKPT_RECORDS", "ckpt-records", SETTING_INT, "32", 2, 1 << 20, NULL, NULL,
     "checkpoint record cap",
     "Over it, the least recently used non-anchor goes first, then the least recently used anchor; the record "
     "being inserted always survives.",
     false, APC(ckpt.records)},
    {"cache.ckpt.heavy", "EMBER_APC_CKPT_HEAVY", "ckpt-heavy", SETTING_INT, "2", 1, 1 << 20, NULL, NULL,
     "plain records per chain that survive strip-on-extend, counting the one being inserted", NULL, false,
     APC(ckpt.heavy)},
    {"cache.ckpt.budget_mb", "EMBER_APC_CKPT_BUDGET_MB", "ckpt-budget-mb", SETTING_MIB, "4096", 0, 1 << 24, NULL,
     NULL, "byte budget (MiB) of record-owned payload (recurrent-state snapshots)",
     "Chain blocks belong to the KV pool and are not counted; when the pool runs dry, records are evicted oldest "
     "first (`ckpt_pool_evictions`).",
     false, APC(ckpt.budget_bytes)},
    {"cache.ckpt.decode_interval", "EMBER_APC_DECODE_CKPT", "decode-ckpt", SETTING_INT, "512", 0, INT_MAX, NULL, NULL,
     "decode-time snapshot interval in generated tokens; 0: off",
     "Widens to length/64 on long sequences; the newest two are kept, frozen when the predicted render diverges. "
     "Needs a render prediction (a chat request's predictor, `chat_plan.h`, computed on the engine's predictor "
     "thread).",
     false, APC(ckpt.decode_interval)},

    {"cache.ckpt.snapshot_interval", "EMBER_APC_SNAPSHOT_INTERVAL", "snapshot-interval", SETTING_INT, "64", 0,
     1 << 20, NULL, NULL,
     "recurrent-state snapshot spacing in tokens on the block chain (a multiple of 16); 0: off",
     "On: stacks with `arr` or `list` layers (mamba2, falcon-h1, qwen35) route to the block tier and keep a state "
     "snapshot every this many tokens along prefill and decode, plus at the system-prompt end, the turn boundary, "
     "N-1, N and retirement, each pinned to the block it follows and evicted with it; prompts that share a prefix "
     "share its snapshots. Prefill stops at each point. Off: those stacks use the checkpoint or exact tier. "
     "Why 64: docs/snapshots.md.",
     false, APC(ckpt.snapshot_interval)},
    {"cache.ckpt.snapshot_budget_mb", "EMBER_APC_SNAPSHOT_BUDGET_MB", "snapshot-budget-mb", SETTING_MIB, "1024", 0,
     1 << 24, NULL, NULL, "byte budget (MiB) of the recurrent-state snapshots on block chains; least recently used go first",
     NULL, false, APC(ckpt.snapshot_budget_bytes)},
    {"cache.swa_block", "EMBER_APC_SWA_BLOCK", "swa-block", SETTING_BOOL, "true", 0, 0, NULL, NULL,
     "serve sliding-window stacks (gemma3) from the block tier: the pool keeps every row of a sliding layer",
     "The window is a mask over the paged pool, so out-of-window K/V stay in their blocks anyway and are exact for "
     "any request sharing the prefix. false: the checkpoint tier, as a pool that trims out-of-window rows would "
     "need. Memory cost: docs/snapshots.md.",
     false, APC(swa_block)},

    /* ---- cache.anchor: the exact tier's system-prompt anchors ---- */
    {"cache.anchor.entries", "EMBER_APC_ANCHOR_ENTRIES", "anchor-entries", SETTING_INT, "0", 0, 1 << 20, NULL, NULL,
     "count cap of the exact-tier anchor LRU; 0: none, `cache.anchor.budget_mb` sizes it",
     "Separate from the exact snapshots, so sibling churn cannot evict the system prompt.", false,
     APC(ckpt.anchor_entries)},
    {"cache.anchor.budget_mb", "EMBER_APC_ANCHOR_BUDGET_MB", "anchor-budget-mb", SETTING_MIB, "4096", 0, 1 << 24,
     NULL, NULL, "byte budget (MiB) of the exact-tier anchor LRU; the newest anchor always survives", NULL, false,
     APC(ckpt.anchor_budget_bytes)},
};
#undef SRV
#undef APC
#define N_SETTINGS (sizeof table / sizeof table[0])
_Static_assert(N_SETTINGS <= SERVE_SETTINGS_MAX, "raise SERVE_SETTINGS_MAX");

const char serve_settings_precedence[] = "defaults < config file (--config) < environment < flags";

/* ---- The table ---- */

const serve_setting *serve_settings(size_t *n) {
    *n = N_SETTINGS;
    return table;
}

const serve_setting *serve_setting_by_key(const char *key) {
    for (size_t i = 0; i < N_SETTINGS; i++)
        if (strcmp(table[i].key, key) == 0) return &table[i];
    return NULL;
}

const serve_setting *serve_setting_by_flag(const char *name, bool *negated) {
    *negated = false;
    for (size_t i = 0; i < N_SETTINGS; i++)
        if (strcmp(table[i].flag, name) == 0) return &table[i];
    if (strncmp(name, "no-", 3) == 0)
        for (size_t i = 0; i < N_SETTINGS; i++)
            if (table[i].type == SETTING_BOOL && strcmp(table[i].flag, name + 3) == 0) {
                *negated = true;
                return &table[i];
            }
    return NULL;
}

size_t serve_setting_index(const serve_setting *s) { return (size_t)(s - table); }

const char *serve_setting_metavar(const serve_setting *s) {
    if (s->metavar) return s->metavar;
    switch (s->type) {
    case SETTING_STR: return s->choices ? s->choices : "TEXT";
    case SETTING_INT: return "N";
    case SETTING_BOOL: return "BOOL";
    case SETTING_BYTES: return "BYTES";
    case SETTING_DOUBLE: return "X";
    case SETTING_MIB: return "MB";
    case SETTING_HASH: return "sha256|xxh3";
    case SETTING_FORCE: return "exact|block|off";
    }
    return "VALUE";
}

const char *setting_source_name(setting_source src) {
    static const char *names[] = {"default", "file", "environment", "flag"};
    return (unsigned)src < 4 ? names[src] : "?";
}

/* ---- Applying values ---- */

static void *field_of(serve_config *c, apc_config *cache, const serve_setting *s) {
    return s->home == SETTING_IN_CACHE ? (char *)cache + s->off : (char *)c + s->off;
}

int serve_settings_parse_bool(const char *text) {
    if (!strcasecmp(text, "1") || !strcasecmp(text, "true") || !strcasecmp(text, "yes") || !strcasecmp(text, "on"))
        return 1;
    if (!strcasecmp(text, "0") || !strcasecmp(text, "false") || !strcasecmp(text, "no") ||
        !strcasecmp(text, "off") || text[0] == 0)
        return 0;
    return -1;
}

/* True when text is one of the '|'-separated words of choices. */
static bool is_choice(const char *choices, const char *text) {
    size_t len = strlen(text);
    for (const char *p = choices; *p;) {
        const char *bar = strchr(p, '|');
        size_t n = bar ? (size_t)(bar - p) : strlen(p);
        if (n == len && strncmp(p, text, n) == 0) return true;
        p += n + (bar != NULL);
    }
    return false;
}

/* Parses text as the setting's type into p. */
static int parse_into(const serve_setting *s, void *p, const char *text, char *why, size_t why_cap) {
    char *end = NULL;
    switch (s->type) {
    case SETTING_STR:
        if (s->choices && !is_choice(s->choices, text)) {
            snprintf(why, why_cap, "expected one of %s, got '%s'", s->choices, text);
            return -1;
        }
        if (strlen(text) >= s->cap) {
            snprintf(why, why_cap, "longer than %zu bytes", s->cap - 1);
            return -1;
        }
        memcpy(p, text, strlen(text) + 1);
        return 0;
    case SETTING_INT:
    case SETTING_MIB: {
        errno = 0;
        long v = strtol(text, &end, 10);
        if (errno || end == text || *end || v < s->lo || v > s->hi) {
            snprintf(why, why_cap, "expected an integer in [%ld, %ld], got '%s'", s->lo, s->hi, text);
            return -1;
        }
        if (s->type == SETTING_INT) *(int *)p = (int)v;
        else *(size_t *)p = (size_t)v << 20;
        return 0;
    }
    case SETTING_BYTES: {
        errno = 0;
        unsigned long long v = strtoull(text, &end, 10);
        if (errno || end == text || *end || text[0] == '-' || v > SIZE_MAX) {
            snprintf(why, why_cap, "expected a byte count, got '%s'", text);
            return -1;
        }
        *(size_t *)p = (size_t)v;
        return 0;
    }
    case SETTING_DOUBLE: {
        if (s->choices && is_choice(s->choices, text)) { /* the automatic value */
            *(double *)p = -1.0;
            return 0;
        }
        errno = 0;
        double v = strtod(text, &end);
        if (errno || end == text || *end || !isfinite(v) || v < 0) {
            snprintf(why, why_cap, "expected a non-negative number%s%s, got '%s'", s->choices ? " or " : "",
                     s->choices ? s->choices : "", text);
            return -1;
        }
        *(double *)p = v;
        return 0;
    }
    case SETTING_BOOL: {
        int b = serve_settings_parse_bool(text);
        if (b < 0) {
            snprintf(why, why_cap, "expected a boolean (true/false), got '%s'", text);
            return -1;
        }
        *(bool *)p = b == 1;
        return 0;
    }
    case SETTING_HASH:
        if (!strcasecmp(text, "sha256")) *(apc_hash_kind *)p = APC_HASH_SHA256;
        else if (!strcasecmp(text, "xxh3") || !strcasecmp(text, "fast")) *(apc_hash_kind *)p = APC_HASH_XXH3;
        else {
            snprintf(why, why_cap, "expected sha256, xxh3 or fast, got '%s'", text);
            return -1;
        }
        return 0;
    case SETTING_FORCE: {
        apc_force f;
        if (apc_parse_force(text, &f) < 0) {
            snprintf(why, why_cap, "expected exact, block or off, got '%s'", text);
            return -1;
        }
        *(apc_force *)p = f;
        return 0;
    }
    }
    snprintf(why, why_cap, "unknown setting type");
    return -1;
}

int serve_setting_set(serve_config *c, const serve_setting *s, const char *text, setting_source src, char *why,
                      size_t why_cap) {
    if (parse_into(s, field_of(c, &c->cache, s), text, why, why_cap) < 0) return -1;
    c->source[serve_setting_index(s)] = (unsigned char)src;
    return 0;
}

void serve_settings_defaults(serve_config *c) {
    memset(c, 0, sizeof *c);
    /* Fields no row covers (byte caps of the exact tier, disk queue) keep
     * the cache's own defaults. */
    c->cache = apc_default_config();
    char why[256];
    for (size_t i = 0; i < N_SETTINGS; i++) {
        int rc = serve_setting_set(c, &table[i], table[i].def, SETTING_FROM_DEFAULT, why, sizeof why);
        (void)rc; /* every default parses: test_settings checks each row */
    }
}

int serve_settings_apply_env(serve_config *c, ember_error *err) {
    for (size_t i = 0; i < N_SETTINGS; i++) {
        const char *v = getenv(table[i].env);
        if (v == NULL) continue;
        char why[300];
        if (serve_setting_set(c, &table[i], v, SETTING_FROM_ENV, why, sizeof why) < 0)
            return ember_fail(err, "environment %s (%s): %s", table[i].env, table[i].key, why);
    }
    return 0;
}

int serve_settings_apply_flag(serve_config *c, const serve_setting *s, const char *value, bool negated,
                              ember_error *err) {
    char why[300];
    const char *text = value ? value : negated ? "false" : "true";
    if (negated && value)
        return ember_fail(err, "flag --no-%s (%s): takes no value, got '%s'", s->flag, s->key, value);
    if (serve_setting_set(c, s, text, SETTING_FROM_FLAG, why, sizeof why) < 0)
        return ember_fail(err, "flag --%s (%s): %s", s->flag, s->key, why);
    return 0;
}

int serve_settings_apply_env_cache(apc_config *cache, ember_error *err) {
    for (size_t i = 0; i < N_SETTINGS; i++) {
        if (table[i].home != SETTING_IN_CACHE) continue;
        const char *v = getenv(table[i].env);
        if (v == NULL) continue;
        char why[300];
        if (parse_into(&table[i], (char *)cache + table[i].off, v, why, sizeof why) < 0)
            return ember_fail(err, "environment %s (%s): %s", table[i].env, table[i].key, why);
    }
    return 0;
}

/* ---- Showing them ---- */

void serve_setting_format(const serve_config *c, const serve_setting *s, char *buf, size_t cap) {
    const void *p = field_of((serve_config *)c, (apc_config *)&c->cache, s);
    switch (s->type) {
    case SETTING_STR:
        if (s->secret && ((const char *)p)[0]) snprintf(buf, cap, "(set)");
        else snprintf(buf, cap, "%s", (const char *)p);
        return;
    case SETTING_INT: snprintf(buf, cap, "%d", *(const int *)p); return;
    case SETTING_BOOL: snprintf(buf, cap, "%s", *(const bool *)p ? "true" : "false"); return;
    case SETTING_BYTES: snprintf(buf, cap, "%zu", *(const size_t *)p); return;
    case SETTING_DOUBLE:
        if (s->choices && *(const double *)p < 0) snprintf(buf, cap, "%s", s->choices);
        else snprintf(buf, cap, "%g", *(const double *)p);
        return;
    case SETTING_MIB: snprintf(buf, cap, "%zu", *(const size_t *)p >> 20); return;
    case SETTING_HASH: snprintf(buf, cap, "%s", *(const apc_hash_kind *)p == APC_HASH_XXH3 ? "xxh3" : "sha256"); return;
    case SETTING_FORCE: {
        apc_force f = *(const apc_force *)p;
        snprintf(buf, cap, "%s", f == APC_FORCE_EXACT ? "exact" : f == APC_FORCE_BLOCK ? "block" : f == APC_FORCE_OFF ? "off" : "");
        return;
    }
    }
    snprintf(buf, cap, "?");
}

/* What a value may be, in words. */
static void describe_values(const serve_setting *s, char *buf, size_t cap) {
    switch (s->type) {
    case SETTING_STR:
        if (s->choices) snprintf(buf, cap, "one of %s", s->choices);
        else snprintf(buf, cap, "text (at most %zu bytes)", s->cap - 1);
        return;
    case SETTING_INT: snprintf(buf, cap, "integer %ld..%ld", s->lo, s->hi); return;
    case SETTING_BOOL: snprintf(buf, cap, "boolean"); return;
    case SETTING_BYTES: snprintf(buf, cap, "bytes"); return;
    case SETTING_DOUBLE: snprintf(buf, cap, "number >= 0%s%s", s->choices ? " or " : "", s->choices ? s->choices : ""); return;
    case SETTING_MIB: snprintf(buf, cap, "MiB %ld..%ld", s->lo, s->hi); return;
    case SETTING_HASH: snprintf(buf, cap, "sha256, xxh3 or fast"); return;
    case SETTING_FORCE: snprintf(buf, cap, "exact, block, off or empty"); return;
    }
    buf[0] = 0;
}

/* Writes s without backticks (plain text and troff have no code spans). */
static void put_plain(FILE *out, const char *s) {
    for (; *s; s++)
        if (*s != '`') fputc(*s, out);
}

/* A markdown table cell: '|' escaped. */
static void put_cell(FILE *out, const char *s) {
    for (; *s; s++) {
        if (*s == '|') fputc('\\', out);
        fputc(*s, out);
    }
}

static const char *section_of(const serve_setting *s) {
    if (strncmp(s->key, "server.", 7) == 0) return "server";
    if (strncmp(s->key, "spec.", 5) == 0) return "spec";
    if (strncmp(s->key, "chat.", 5) == 0) return "chat";
    if (strncmp(s->key, "cache.disk.", 11) == 0) return "cache.disk";
    if (strncmp(s->key, "cache.ckpt.", 11) == 0) return "cache.ckpt";
    if (strncmp(s->key, "cache.anchor.", 13) == 0) return "cache.anchor";
    return "cache";
}

static const char *section_title(const char *section) {
    if (!strcmp(section, "server")) return "the HTTP server and the engine";
    if (!strcmp(section, "chat")) return "chat rendering";
    if (!strcmp(section, "cache.disk")) return "the SSD tier";
    if (!strcmp(section, "spec")) return "speculative decoding";
    if (!strcmp(section, "cache.ckpt")) return "the checkpoint tier (hybrid and sliding-window stacks)";
    if (!strcmp(section, "cache.anchor")) return "the exact tier's system-prompt anchors";
    return "the prompt cache";
}

void serve_settings_write_markdown(FILE *out) {
    fputs("# Settings and prompt-cache switches\n"
          "\n"
          "<!-- Generated by `ember settings --markdown` from the table in src/serve/serve_settings.c.\n"
          "     Do not edit: change the table and run `make docs`; test_settings fails while this\n"
          "     file differs from the table. -->\n"
          "\n"
          "Every setting of `ember serve` has a key in the config file (YAML, `--config ember.yaml`),\n"
          "an environment variable and a flag. Precedence, lowest first:\n"
          "\n"
          "    defaults < config file < environment < flags\n"
          "\n"
          "Each layer overrides only the settings it names. A value that does not parse or is out of\n"
          "range stops the server with a message naming the setting and where it came from\n"
          "(`ember.yaml:3: server.port: ...`, `environment EMBER_PORT (server.port): ...`,\n"
          "`flag --port (server.port): ...`); an unknown key in the file is a warning naming its line.\n"
          "Booleans accept `1/true/yes/on` and `0/false/no/off/\"\"`; a boolean flag takes no value\n"
          "(`--ckpt-replay`, `--no-ckpt-replay`) or `--flag=false`. `ember settings` prints the values\n"
          "in effect and where each came from.\n"
          "\n"
          "The prompt cache reads no environment itself: `ember serve` resolves these settings once at\n"
          "start-up and hands them to each cache, so changing the environment later has no effect on a\n"
          "loaded model. Programs that create an engine in-process (tests, benchmarks) apply the cache's\n"
          "variables with `serve_settings_apply_env_cache(&engine_config.cache, &err)`.\n",
          out);
    const char *current = NULL;
    for (size_t i = 0; i < N_SETTINGS; i++) {
        const serve_setting *s = &table[i];
        const char *section = section_of(s);
        if (current == NULL || strcmp(current, section) != 0) {
            current = section;
            fprintf(out, "\n## `%s`: %s\n\n", section, section_title(section));
            fputs("| key | environment | flag | default | values | effect |\n|---|---|---|---|---|---|\n", out);
        }
        char values[128];
        describe_values(s, values, sizeof values);
        fprintf(out, "| `%s` | `%s` | `--%s`%s%s%s | ", s->key, s->env, s->flag, s->type == SETTING_BOOL ? ", `--no-" : "",
                s->type == SETTING_BOOL ? s->flag : "", s->type == SETTING_BOOL ? "`" : "");
        if (s->def[0]) {
            fputc('`', out);
            put_cell(out, s->def);
            fputc('`', out);
        } else {
            fputs("(empty)", out);
        }
        fputs(" | ", out);
        put_cell(out, values);
        fputs(" | ", out);
        put_cell(out, s->help);
        fputc('.', out);
        if (s->detail) {
            fputc(' ', out);
            put_cell(out, s->detail);
        }
        fputs(" |\n", out);
    }
}

/* troff text: backslashes and dashes escaped, no backticks, and a line may
 * not start with a control character. */
void serve_settings_troff_text(FILE *out, const char *s) {
    bool line_start = true;
    for (; *s; s++) {
        if (*s == '`') continue;
        if (line_start && (*s == '.' || *s == '\'')) fputs("\\&", out);
        line_start = *s == '\n';
        if (*s == '\\') fputs("\\e", out);
        else if (*s == '-') fputs("\\-", out);
        else fputc(*s, out);
    }
}

void serve_settings_write_troff(FILE *out) {
    fputs("Every setting of\n.B ember serve\nhas a key in the config file (YAML, \\fB\\-\\-config\\fR FILE), "
          "an environment variable and a flag.\nPrecedence, lowest first: defaults < config file < environment < "
          "flags; each layer overrides only the settings it names.\n"
          "A value that does not parse or is out of range is an error naming the setting and its source.\n"
          "Booleans accept 1/true/yes/on and 0/false/no/off; a boolean flag takes no value "
          "(\\fB\\-\\-ckpt\\-replay\\fR, \\fB\\-\\-no\\-ckpt\\-replay\\fR).\n",
          out);
    const char *current = NULL;
    for (size_t i = 0; i < N_SETTINGS; i++) {
        const serve_setting *s = &table[i];
        const char *section = section_of(s);
        if (current == NULL || strcmp(current, section) != 0) {
            current = section;
            fprintf(out, ".SS %s: %s\n", section, section_title(section));
        }
        fputs(".TP\n\\fB\\-\\-", out);
        serve_settings_troff_text(out, s->flag);
        if (s->type == SETTING_BOOL) {
            fputs("\\fR, \\fB\\-\\-no\\-", out);
            serve_settings_troff_text(out, s->flag);
            fputs("\\fR\n", out);
        } else {
            fputs("\\fR \\fI", out);
            serve_settings_troff_text(out, serve_setting_metavar(s));
            fputs("\\fR\n", out);
        }
        serve_settings_troff_text(out, s->help);
        fputs(".\n", out);
        if (s->detail) {
            serve_settings_troff_text(out, s->detail);
            fputc('\n', out);
        }
        char values[128];
        describe_values(s, values, sizeof values);
        fputs(".br\nKey \\fB", out);
        serve_settings_troff_text(out, s->key);
        fputs("\\fR, environment \\fB", out);
        serve_settings_troff_text(out, s->env);
        fputs("\\fR, default ", out);
        serve_settings_troff_text(out, s->def[0] ? s->def : "empty");
        fputs("; ", out);
        serve_settings_troff_text(out, values);
        fputs(".\n", out);
    }
}

void serve_settings_write_help(FILE *out) {
    for (size_t i = 0; i < N_SETTINGS; i++) {
        const serve_setting *s = &table[i];
        char opt[96];
        if (s->type == SETTING_BOOL) snprintf(opt, sizeof opt, "--[no-]%s", s->flag);
        else snprintf(opt, sizeof opt, "--%s %s", s->flag, serve_setting_metavar(s));
        fprintf(out, "  %-28s ", opt);
        put_plain(out, s->help);
        fprintf(out, "\n  %-28s [%s; %s, $%s]\n", "", s->def[0] ? s->def : "empty", s->key, s->env);
    }
}
