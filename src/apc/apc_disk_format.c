/* apc_disk_format.c - the SSD tier's file format: names, header, reader.
 *
 * Nothing on disk is trusted (design.md invariant 4). Every field is packed
 * byte by byte in little-endian order and read back the same way; sizes are
 * computed with overflow checks before anything is allocated; the reader
 * consumes a file strictly front to back through one streaming XXH3-64
 * state, so the trailing checksum covers every byte before it whatever the
 * read mode. Beyond the checksum, content is checked against what it claims
 * to be: a shard's key chain is recomputed from its parent, salt and tokens
 * with the cache's hash kind, an exact file's or a checkpoint skeleton's
 * key (tagged "x" / "k") from its salt and tokens. The state size of exact
 * files and skeletons must be the namespace's (a file of a model with
 * another layer mix can only be a forgery: its namespace differs).
 * A file that passes is exactly what a store of those tokens wrote (or a
 * deliberate forgery of both checksum and keys, which the request's own
 * token comparison still bounds to the right tokens). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "apc/apc_disk.h"

static const uint8_t MAGIC[8] = {'E', 'M', 'B', 'R', 'A', 'P', 'C', '1'};


uint64_t apc_disk_file_bytes(const apc_layout *lay, uint32_t kind, uint32_t n_blocks, uint64_t n_tokens) {
    const uint64_t lim = UINT64_C(1) << 62;
    if (n_tokens > (UINT64_C(1) << 40) || lay->row_floats > (UINT64_C(1) << 30)) return 0;
    uint64_t payload = kind == APC_DISK_KIND_SKEL ? 0 : n_tokens * (uint64_t)lay->row_floats;
    uint64_t state = kind == APC_DISK_KIND_SHARD ? 0 : (uint64_t)lay->state_bytes;
    if (payload > lim / 4 || state > (UINT64_C(1) << 40)) return 0;
    return APC_DISK_HEADER_BYTES + 16 * (uint64_t)n_blocks + 4 * n_tokens + 4 * payload + state + 8;
}

static apc_key tagged_key(char tag, uint64_t salt, const int32_t *tokens, int64_t n) {
    XXH3_state_t *st = XXH3_createState();
    uint8_t head[9] = {(uint8_t)tag};
    apc_put_u64(head + 1, salt);
    apc_key k;
    memset(&k, 0, sizeof k);
    if (st == NULL) return k;
    XXH3_128bits_reset(st);
    XXH3_128bits_update(st, head, sizeof head);
    uint8_t buf[1024];
    for (int64_t i = 0; i < n;) {
        int m = 0;
        for (; m < 256 && i < n; m++, i++) apc_put_u32(buf + 4 * m, (uint32_t)tokens[i]);
        XXH3_128bits_update(st, buf, 4 * (size_t)m);
    }
    XXH128_hash_t h = XXH3_128bits_digest(st);
    XXH3_freeState(st);
    apc_put_u64(k.b, h.low64);
    apc_put_u64(k.b + 8, h.high64);
    return k;
}

apc_key apc_disk_exact_key(uint64_t salt, const int32_t *tokens, int64_t n) { return tagged_key('x', salt, tokens, n); }
apc_key apc_disk_skel_key(uint64_t salt, const int32_t *tokens, int64_t n) { return tagged_key('k', salt, tokens, n); }
apc_key apc_disk_side_key(uint64_t salt, const int32_t *tokens, int64_t n) { return tagged_key('s', salt, tokens, n); }

apc_layout apc_disk_side_layout(int *width, size_t words, size_t state_bytes) {
    static int zero[1];
    apc_layout lay;
    memset(&lay, 0, sizeof lay);
    width[0] = (int)words;
    lay.n_layer = 1;
    lay.k_width = width;
    lay.v_width = zero;
    lay.row_floats = words;
    lay.state_bytes = state_bytes;
    return lay;
}

void apc_disk_key_hex(const apc_key *k, char out[33]) {
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++) {
        out[2 * i] = hex[k->b[i] >> 4];
        out[2 * i + 1] = hex[k->b[i] & 15];
    }
    out[32] = 0;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

bool apc_disk_parse_name(const char *name, uint32_t *kind, apc_key *key) {
    if (strlen(name) != 2 + 32 + 4 || name[1] != '-' || strcmp(name + 34, ".apc") != 0) return false;
    if (name[0] == 'b') *kind = APC_DISK_KIND_SHARD;
    else if (name[0] == 'x') *kind = APC_DISK_KIND_EXACT;
    else if (name[0] == 'k') *kind = APC_DISK_KIND_SKEL;
    else if (name[0] == 's') *kind = APC_DISK_KIND_SIDE;
    else return false;
    for (int i = 0; i < 16; i++) {
        int hi = hexval(name[2 + 2 * i]), lo = hexval(name[3 + 2 * i]);
        if (hi < 0 || lo < 0) return false;
        key->b[i] = (uint8_t)(hi << 4 | lo);
    }
    return true;
}

void apc_disk_write_header(uint8_t *out, const uint8_t ns[16], const apc_disk_header *h, const apc_layout *lay) {
    memset(out, 0, APC_DISK_HEADER_BYTES);
    memcpy(out, MAGIC, 8);
    apc_put_u32(out + 8, APC_DISK_VERSION);
    apc_put_u32(out + 12, h->kind);
    memcpy(out + 16, ns, 16);
    apc_put_u64(out + 32, h->salt);
    memcpy(out + 40, h->content.b, 16);
    memcpy(out + 56, h->parent.b, 16);
    apc_put_u32(out + 72, h->first_block);
    apc_put_u32(out + 76, h->n_blocks);
    apc_put_u32(out + 80, h->last_rows);
    apc_put_u32(out + 84, (uint32_t)lay->n_layer);
    apc_put_u64(out + 88, h->n_tokens);
    apc_put_u64(out + 96, (uint64_t)lay->row_floats);
    apc_put_u64(out + 104, h->created_ns);
    apc_put_u64(out + 112, h->state_bytes);
    for (uint32_t i = 0; i < h->n_blocks; i++) memcpy(out + APC_DISK_HEADER_BYTES + 16 * (size_t)i, h->keys[i].b, 16);
    XXH3_state_t *st = XXH3_createState();
    uint64_t sum = 0;
    if (st) {
        XXH3_64bits_reset(st);
        XXH3_64bits_update(st, out, APC_DISK_HEADER_SUM_AT);
        XXH3_64bits_update(st, out + APC_DISK_HEADER_BYTES, 16 * (size_t)h->n_blocks);
        sum = XXH3_64bits_digest(st);
        XXH3_freeState(st);
    }
    apc_put_u64(out + APC_DISK_HEADER_SUM_AT, sum);
}

/* ---- Source ---- */

int apc_disk_src_init(apc_disk_src *s, int fd, const void *map, uint64_t size) {
    memset(s, 0, sizeof *s);
    s->fd = fd;
    s->map = map ? map : (fd < 0 ? (const uint8_t *)"" : NULL);
    s->size = size;
    s->hash = XXH3_createState();
    if (s->hash == NULL) return -1;
    XXH3_64bits_reset(s->hash);
    return 0;
}

void apc_disk_src_free(apc_disk_src *s) {
    if (s->hash) XXH3_freeState(s->hash);
    free(s->scratch);
    s->hash = NULL;
    s->scratch = NULL;
}

/* Reads len bytes at pos into dst (NULL: skip), hashing them. */
static int src_read(apc_disk_src *s, void *dst, uint64_t len, ember_error *err) {
    if (len > s->size || s->pos > s->size - len)
        return ember_fail(err, "file ends at %llu, wanted %llu bytes at %llu", (unsigned long long)s->size,
                          (unsigned long long)len, (unsigned long long)s->pos);
    if (s->map) {
        const uint8_t *p = s->map + s->pos;
        XXH3_64bits_update(s->hash, p, (size_t)len);
        if (dst) memcpy(dst, p, (size_t)len);
        s->pos += len;
        return 0;
    }
    const size_t chunk = (size_t)8 << 20;
    while (len > 0) {
        size_t n = len < chunk ? (size_t)len : chunk;
        uint8_t *to = dst;
        if (to == NULL) {
            if (s->scratch_cap < n) {
                size_t cap = n;
                uint8_t *b = realloc(s->scratch, cap);
                if (b == NULL) return ember_fail(err, "out of memory reading a file");
                s->scratch = b;
                s->scratch_cap = cap;
            }
            to = s->scratch;
        }
        size_t got = 0;
        while (got < n) {
            ssize_t r = pread(s->fd, to + got, n - got, (off_t)(s->pos + got));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0)
                return ember_fail(err, "read failed at %llu: %s", (unsigned long long)(s->pos + got),
                                  r < 0 ? strerror(errno) : "unexpected end of file");
            got += (size_t)r;
        }
        XXH3_64bits_update(s->hash, to, n);
        s->pos += n;
        len -= n;
        if (dst) dst = (uint8_t *)dst + n;
    }
    return 0;
}

/* ---- Header ---- */

int apc_disk_read_header(apc_disk_src *s, const apc_disk_expect *ex, apc_disk_header *h, ember_error *err) {
    memset(h, 0, sizeof *h);
    uint8_t b[APC_DISK_HEADER_BYTES];
    if (src_read(s, b, sizeof b, err) < 0) return ember_fail_prefix(err, "header: ");
    if (memcmp(b, MAGIC, 8) != 0) return ember_fail(err, "bad magic");
    if (apc_get_u32(b + 8) != APC_DISK_VERSION) return ember_fail(err, "version %u, expected %u", apc_get_u32(b + 8), APC_DISK_VERSION);
    h->kind = apc_get_u32(b + 12);
    if (h->kind != APC_DISK_KIND_SHARD && h->kind != APC_DISK_KIND_EXACT && h->kind != APC_DISK_KIND_SKEL &&
        h->kind != APC_DISK_KIND_SIDE)
        return ember_fail(err, "unknown kind %u", h->kind);
    if (memcmp(b + 16, ex->ns, 16) != 0) return ember_fail(err, "another namespace");
    h->salt = apc_get_u64(b + 32);
    memcpy(h->content.b, b + 40, 16);
    memcpy(h->parent.b, b + 56, 16);
    h->first_block = apc_get_u32(b + 72);
    h->n_blocks = apc_get_u32(b + 76);
    h->last_rows = apc_get_u32(b + 80);
    uint32_t n_layer = apc_get_u32(b + 84);
    h->n_tokens = apc_get_u64(b + 88);
    uint64_t row_floats = apc_get_u64(b + 96);
    h->created_ns = apc_get_u64(b + 104);
    h->state_bytes = apc_get_u64(b + 112);
    uint64_t want_sum = apc_get_u64(b + APC_DISK_HEADER_SUM_AT);
    h->row_floats = row_floats;
    /* A side file carries its own row width and state size (its reader
     * checks both against its drafter's): one layer. */
    int side_width[1];
    apc_layout side_lay;
    const apc_layout *lay = ex->layout;
    if (h->kind == APC_DISK_KIND_SIDE) {
        if (n_layer != 1 || row_floats < 1 || row_floats > (UINT64_C(1) << 24))
            return ember_fail(err, "side file of %u layers / %llu words per row", n_layer, (unsigned long long)row_floats);
        if (h->state_bytes > APC_DISK_SIDE_MAX_STATE)
            return ember_fail(err, "side file with a state of %llu bytes", (unsigned long long)h->state_bytes);
        side_lay = apc_disk_side_layout(side_width, (size_t)row_floats, (size_t)h->state_bytes);
        lay = &side_lay;
    } else if (n_layer != (uint32_t)ex->layout->n_layer || row_floats != (uint64_t)ex->layout->row_floats)
        return ember_fail(err, "layout %u layers / %llu floats per row, expected %d / %zu", n_layer,
                          (unsigned long long)row_floats, ex->layout->n_layer, ex->layout->row_floats);
    static const uint8_t zero[16];
    uint64_t want_state = h->kind == APC_DISK_KIND_SHARD ? 0 : (uint64_t)lay->state_bytes;
    if (h->state_bytes != want_state)
        return ember_fail(err, "state of %llu bytes, expected %llu", (unsigned long long)h->state_bytes,
                          (unsigned long long)want_state);
    if (h->kind == APC_DISK_KIND_SHARD) {
        if (h->n_blocks < 1 || h->n_blocks > APC_DISK_MAX_BLOCKS) return ember_fail(err, "%u blocks", h->n_blocks);
        if (h->last_rows < 1 || h->last_rows > KV_BLOCK_TOKENS) return ember_fail(err, "last block of %u rows", h->last_rows);
        if (h->first_block > (1u << 26)) return ember_fail(err, "first block %u", h->first_block);
        if (h->n_tokens != (uint64_t)KV_BLOCK_TOKENS * (h->n_blocks - 1) + h->last_rows)
            return ember_fail(err, "%llu tokens in %u blocks", (unsigned long long)h->n_tokens, h->n_blocks);
        if ((h->first_block == 0) != (memcmp(h->parent.b, zero, 16) == 0))
            return ember_fail(err, "parent key does not fit first block %u", h->first_block);
    } else {
        uint32_t max_first = h->kind == APC_DISK_KIND_SKEL ? 3 : 0; /* skeleton: the ckpt kind */
        /* a side file's parent field is its owner (zero: the target's own head) */
        bool parent_free = h->kind == APC_DISK_KIND_SIDE;
        if (h->n_blocks != 0 || h->last_rows != 0 || h->first_block > max_first ||
            (!parent_free && memcmp(h->parent.b, zero, 16) != 0))
            return ember_fail(err, "exact file with block fields");
        uint64_t least = h->kind == APC_DISK_KIND_SKEL ? 2 : 1;
        if (h->n_tokens < least || h->n_tokens > (UINT64_C(1) << 31)) return ember_fail(err, "%llu tokens", (unsigned long long)h->n_tokens);
    }
    h->file_bytes = apc_disk_file_bytes(lay, h->kind, h->n_blocks, h->n_tokens);
    if (h->file_bytes == 0 || h->file_bytes != s->size)
        return ember_fail(err, "file is %llu bytes, its header says %llu", (unsigned long long)s->size,
                          (unsigned long long)h->file_bytes);
    if (h->n_blocks) {
        h->keys = malloc((size_t)h->n_blocks * sizeof *h->keys);
        if (h->keys == NULL) return ember_fail(err, "out of memory");
        if (src_read(s, h->keys, 16 * (uint64_t)h->n_blocks, err) < 0) goto bad;
        if (!apc_key_eq(&h->keys[h->n_blocks - 1], &h->content)) {
            ember_fail(err, "last block key is not the content key");
            goto bad;
        }
    }
    XXH3_state_t *st = XXH3_createState();
    if (st == NULL) {
        ember_fail(err, "out of memory");
        goto bad;
    }
    XXH3_64bits_reset(st);
    XXH3_64bits_update(st, b, APC_DISK_HEADER_SUM_AT);
    if (h->n_blocks) XXH3_64bits_update(st, h->keys, 16 * (size_t)h->n_blocks);
    uint64_t sum = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    if (sum != want_sum) {
        ember_fail(err, "header checksum mismatch");
        goto bad;
    }
    return 0;
bad:
    apc_disk_header_free(h);
    return -1;
}

void apc_disk_header_free(apc_disk_header *h) {
    free(h->keys);
    h->keys = NULL;
}

/* ---- Body ---- */

int apc_disk_read_body(apc_disk_src *s, const apc_disk_expect *ex, const apc_disk_header *h, int32_t *tokens_out,
                       apc_disk_dst_fn dst, void *user, ember_error *err) {
    const apc_layout *lay = ex->layout;
    int side_width[1];
    apc_layout side_lay;
    if (h->kind == APC_DISK_KIND_SIDE) { /* its own row width and state (read_header checked them) */
        side_lay = apc_disk_side_layout(side_width, (size_t)h->row_floats, (size_t)h->state_bytes);
        lay = &side_lay;
    }
    uint64_t n = h->n_tokens;
    uint8_t *raw = malloc((size_t)n * 4);
    if (raw == NULL) return ember_fail(err, "out of memory for %llu tokens", (unsigned long long)n);
    int32_t *tok = tokens_out ? tokens_out : malloc((size_t)n * sizeof(int32_t));
    int rc = -1;
    if (tok == NULL) {
        ember_fail(err, "out of memory for %llu tokens", (unsigned long long)n);
        goto done;
    }
    if (src_read(s, raw, 4 * n, err) < 0) goto done;
    for (uint64_t i = 0; i < n; i++) tok[i] = (int32_t)apc_get_u32(raw + 4 * i);
    if (h->kind == APC_DISK_KIND_SHARD) {
        apc_key parent = h->parent;
        for (uint32_t j = 0; j < h->n_blocks; j++) {
            int rows = j + 1 < h->n_blocks ? KV_BLOCK_TOKENS : (int)h->last_rows;
            const int32_t *t = tok + (size_t)j * KV_BLOCK_TOKENS;
            apc_key k = rows == KV_BLOCK_TOKENS ? apc_block_key(ex->hash, &parent, h->salt, t)
                                                : apc_partial_key(ex->hash, &parent, h->salt, t, rows);
            if (!apc_key_eq(&k, &h->keys[j])) {
                ember_fail(err, "block %u: key does not match its tokens", j);
                goto done;
            }
            parent = k;
        }
    } else {
        apc_key k = h->kind == APC_DISK_KIND_SKEL   ? apc_disk_skel_key(h->salt, tok, (int64_t)n)
                    : h->kind == APC_DISK_KIND_SIDE ? apc_disk_side_key(h->salt, tok, (int64_t)n)
                                                    : apc_disk_exact_key(h->salt, tok, (int64_t)n);
        if (!apc_key_eq(&k, &h->content)) {
            ember_fail(err, "%s key does not match the tokens",
                       h->kind == APC_DISK_KIND_SKEL ? "skeleton" : h->kind == APC_DISK_KIND_SIDE ? "side" : "exact");
            goto done;
        }
    }
    uint32_t pieces = h->kind == APC_DISK_KIND_SHARD ? h->n_blocks : 1;
    for (int l = 0; l < lay->n_layer && h->kind != APC_DISK_KIND_SKEL; l++) {
        for (int kv = 0; kv < 2; kv++) {
            uint64_t w = (uint64_t)(kv == 0 ? lay->k_width[l] : lay->v_width[l]);
            if (w == 0) continue;
            for (uint32_t j = 0; j < pieces; j++) {
                uint64_t rows = h->kind == APC_DISK_KIND_SHARD
                                    ? (j + 1 < pieces ? KV_BLOCK_TOKENS : h->last_rows)
                                    : n;
                float *d = dst ? dst(user, l, kv, j) : NULL;
                if (src_read(s, d, rows * w * 4, err) < 0) goto done;
            }
        }
    }
    if (h->state_bytes > 0) {
        void *d = dst ? dst(user, -1, 0, 0) : NULL;
        if (src_read(s, d, h->state_bytes, err) < 0) goto done;
    }
    uint64_t sum = XXH3_64bits_digest(s->hash);
    uint8_t trailer[8];
    if (s->pos + 8 != s->size) {
        ember_fail(err, "payload ends at %llu of %llu", (unsigned long long)s->pos, (unsigned long long)s->size);
        goto done;
    }
    if (s->map) memcpy(trailer, s->map + s->pos, 8);
    else if (pread(s->fd, trailer, 8, (off_t)s->pos) != 8) {
        ember_fail(err, "cannot read the checksum");
        goto done;
    }
    if (apc_get_u64(trailer) != sum) {
        ember_fail(err, "checksum mismatch");
        goto done;
    }
    rc = 0;
done:
    free(raw);
    if (tok != tokens_out) free(tok);
    return rc;
}

int apc_disk_parse_image(const void *buf, size_t size, const apc_disk_expect *ex, apc_disk_header *out,
                         ember_error *err) {
    apc_disk_src s;
    if (apc_disk_src_init(&s, -1, buf, size) < 0) return ember_fail(err, "out of memory");
    int rc = apc_disk_read_header(&s, ex, out, err);
    if (rc == 0) {
        rc = apc_disk_read_body(&s, ex, out, NULL, NULL, NULL, err);
        if (rc < 0) apc_disk_header_free(out);
    }
    apc_disk_src_free(&s);
    return rc;
}
