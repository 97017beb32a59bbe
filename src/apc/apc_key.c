/* apc_key.c - chained block keys (see apc_key.h) and the tenant salt.
 *
 * The message is packed byte by byte so the keys do not depend on the host's
 * byte order. SHA-256 goes through OpenSSL's one-shot SHA256(), which uses
 * the CPU's SHA extensions when present. */
#include "apc/apc_key.h"

#include <openssl/evp.h>
#include <openssl/sha.h>
#include <string.h>
#include <xxhash.h>

#define MSG_BYTES (16 + 8 + 4 * KV_BLOCK_TOKENS)



static apc_key digest_of(apc_hash_kind kind, const uint8_t *msg, size_t len) {
    apc_key k;
    if (kind == APC_HASH_XXH3) {
        XXH128_hash_t h = XXH3_128bits(msg, len);
        apc_put_u64(k.b, h.low64);
        apc_put_u64(k.b + 8, h.high64);
    } else {
        uint8_t digest[SHA256_DIGEST_LENGTH];
        SHA256(msg, len, digest);
        memcpy(k.b, digest, 16);
    }
    return k;
}

apc_key apc_block_key(apc_hash_kind kind, const apc_key *parent, uint64_t salt, const int32_t *tokens16) {
    uint8_t msg[MSG_BYTES];
    memcpy(msg, parent->b, 16);
    apc_put_u64(msg + 16, salt);
    for (int i = 0; i < KV_BLOCK_TOKENS; i++) apc_put_u32(msg + 24 + 4 * i, (uint32_t)tokens16[i]);
    return digest_of(kind, msg, sizeof msg);
}

apc_key apc_partial_key(apc_hash_kind kind, const apc_key *parent, uint64_t salt, const int32_t *tokens, int m) {
    uint8_t msg[MSG_BYTES + 4];
    memcpy(msg, parent->b, 16);
    apc_put_u64(msg + 16, salt);
    apc_put_u32(msg + 24, 0x80000000u | (uint32_t)m);
    for (int i = 0; i < m; i++) apc_put_u32(msg + 28 + 4 * i, (uint32_t)tokens[i]);
    return digest_of(kind, msg, 28 + 4 * (size_t)m);
}

void apc_chain_keys(apc_hash_kind kind, const int32_t *tokens, int64_t n_blocks, uint64_t salt, apc_key *keys) {
    apc_key parent;
    memset(&parent, 0, sizeof parent);
    for (int64_t i = 0; i < n_blocks; i++) {
        keys[i] = apc_block_key(kind, &parent, salt, tokens + i * KV_BLOCK_TOKENS);
        parent = keys[i];
    }
}

uint64_t apc_salt_for_tenant(const char *tenant, size_t len) {
    if (tenant == NULL || len == 0) return 0;
    /* SHA-256 of (u32 LE byte length, tenant bytes, u64 LE media hash = 0),
     * first 8 bytes little-endian; 0 is reserved for "no tenant". */
    uint8_t head[4], tail[8] = {0}, digest[EVP_MAX_MD_SIZE];
    unsigned int dlen = 0;
    apc_put_u32(head, (uint32_t)len);
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    if (md == NULL || EVP_DigestInit_ex(md, EVP_sha256(), NULL) != 1 || EVP_DigestUpdate(md, head, 4) != 1 ||
        EVP_DigestUpdate(md, tenant, len) != 1 || EVP_DigestUpdate(md, tail, 8) != 1 ||
        EVP_DigestFinal_ex(md, digest, &dlen) != 1 || dlen < 8) {
        /* Cannot hash: fall back to FNV-1a so tenants still never share. */
        uint64_t h = 1469598103934665603ull;
        for (size_t i = 0; i < len; i++) h = (h ^ (uint8_t)tenant[i]) * 1099511628211ull;
        EVP_MD_CTX_free(md);
        return h ? h : 1;
    }
    EVP_MD_CTX_free(md);
    uint64_t salt = 0;
    for (int i = 0; i < 8; i++) salt |= (uint64_t)digest[i] << (8 * i);
    return salt ? salt : 1;
}
