/* serve_tenant.h - who a request is: API keys, tenants, the salt of a
 * tenant's cache entries, and per-tenant counters.
 *
 * Contract:
 *  - A keys file (server.api_keys_file) lists one key per line:
 *        <sha-256 of the key, 64 hex digits> <tenant> [admin]
 *    Blank lines and lines starting with '#' are skipped. A tenant name is
 *    1-64 bytes of letters, digits and . _ - @ : (no spaces, no control
 *    characters); the file holds hashes only, never keys. A malformed line,
 *    a duplicate hash or an empty file is an error naming the file and line.
 *    serve_keys_find hashes a presented key and compares it with every entry
 *    in constant time per entry.
 *  - A tenant name from a trusted proxy's header is checked by
 *    serve_tenant_name_ok: 1-128 bytes, no control character.
 *  - The tenant secret is 32 random bytes kept as 64 hex digits in a file
 *    of mode 0600 (created, with its directory, when missing; two servers
 *    starting at once agree on one). serve_tenant_salt mixes it with the
 *    tenant name and the request's cache_salt (HMAC-SHA-256, first 64 bits):
 *    nobody who lacks the secret can compute another tenant's salt, and a
 *    cache_salt only partitions further inside its own tenant. No tenant and
 *    no cache_salt is salt 0, the shared space.
 *  - serve_tenant_stats counts finished requests per tenant (requests,
 *    prompt, cached and completion tokens, failures); at most 4096 tenants
 *    are tracked, later ones are counted under "(other)". Thread-safe. */
#ifndef EMBER_SERVE_TENANT_H
#define EMBER_SERVE_TENANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "core/error.h"

#define SERVE_TENANT_MAX 128          /* longest tenant name, bytes, with room for the NUL */
#define SERVE_TENANT_SECRET_BYTES 32

typedef struct serve_keys serve_keys;
typedef struct serve_tenant_stats serve_tenant_stats;

typedef struct serve_key_entry {
    unsigned char hash[32];
    char tenant[SERVE_TENANT_MAX];
    bool admin;
} serve_key_entry;

/* ---- Keys ---- */
int serve_keys_load(const char *path, serve_keys **out, ember_error *err);
/* The same from text (tests); name labels messages. */
int serve_keys_parse(const char *text, size_t len, const char *name, serve_keys **out, ember_error *err);
void serve_keys_free(serve_keys *k);
int serve_keys_count(const serve_keys *k);
/* The entry whose hash is SHA-256(key[0, len)), or NULL. */
const serve_key_entry *serve_keys_find(const serve_keys *k, const char *key, size_t len);

/* ---- Tenants and salts ---- */
bool serve_tenant_name_ok(const char *name, size_t len);
/* Reads the secret at path, or creates it (and its directory) when missing. */
int serve_tenant_secret_load(const char *path, unsigned char secret[SERVE_TENANT_SECRET_BYTES], bool *created,
                             ember_error *err);
/* 0 when both tenant and cache_salt are empty (or NULL); never 0 otherwise. */
uint64_t serve_tenant_salt(const unsigned char secret[SERVE_TENANT_SECRET_BYTES], const char *tenant,
                           const char *cache_salt);

/* ---- Per-tenant counters ---- */
serve_tenant_stats *serve_tenant_stats_create(void);
void serve_tenant_stats_free(serve_tenant_stats *s);
void serve_tenant_stats_add(serve_tenant_stats *s, const char *tenant, int64_t prompt_tokens, int64_t cached_tokens,
                            int64_t completion_tokens, bool failed);
/* One tenant's counters as an object (zeros when it has none yet). */
cJSON *serve_tenant_stats_one(serve_tenant_stats *s, const char *tenant);
/* Every tenant: {name: {...}, ...}. */
cJSON *serve_tenant_stats_all(serve_tenant_stats *s);
void serve_tenant_stats_reset(serve_tenant_stats *s);

#endif
