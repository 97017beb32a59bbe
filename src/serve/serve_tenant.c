/* serve_tenant.c - API keys, tenant salts and per-tenant counters (see
 * serve_tenant.h).
 *
 * The keys file holds SHA-256 hashes, so a leaked file (or a backup of it)
 * gives no key away; a presented key is hashed once and compared with every
 * entry with CRYPTO_memcmp, so how far a guess matches never shows in the
 * time of the answer. Salts are HMAC-SHA-256(secret, tenant NUL cache_salt):
 * the NUL keeps "ab"+"c" apart from "a"+"bc" (neither part may hold one),
 * and the secret makes the salt of a tenant unknowable from its name. The
 * secret file is created with O_EXCL: of two servers that start at once,
 * one writes it and the other reads what was written. */
#define _GNU_SOURCE
#include "serve/serve_tenant.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "core/log.h"

/* ---- keys ---- */

struct serve_keys {
    serve_key_entry *e;
    int n, cap;
};

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static bool parse_hex(const char *s, size_t n, unsigned char *out, size_t out_n) {
    if (n != out_n * 2) return false;
    for (size_t i = 0; i < out_n; i++) {
        int hi = hexval((unsigned char)s[2 * i]), lo = hexval((unsigned char)s[2 * i + 1]);
        if (hi < 0 || lo < 0) return false;
        out[i] = (unsigned char)(hi << 4 | lo);
    }
    return true;
}

static bool name_char(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-' || c == '@' || c == ':';
}

bool serve_tenant_name_ok(const char *name, size_t len) {
    if (name == NULL || len == 0 || len >= SERVE_TENANT_MAX) return false;
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)name[i] < 0x20 || name[i] == 0x7f) return false;
    return true;
}

/* The next whitespace-separated word of [*p, end) on one line. */
static bool next_word(const char **p, const char *end, const char **w, size_t *n) {
    while (*p < end && (**p == ' ' || **p == '\t')) (*p)++;
    if (*p >= end) return false;
    *w = *p;
    while (*p < end && **p != ' ' && **p != '\t') (*p)++;
    *n = (size_t)(*p - *w);
    return true;
}

int serve_keys_parse(const char *text, size_t len, const char *name, serve_keys **out, ember_error *err) {
    *out = NULL;
    serve_keys *k = calloc(1, sizeof *k);
    if (k == NULL) return ember_fail(err, "%s: out of memory", name);
    const char *p = text, *end = text + len;
    for (int line = 1; p < end; line++) {
        const char *eol = memchr(p, '\n', (size_t)(end - p));
        const char *le = eol ? eol : end;
        if (le > p && le[-1] == '\r') le--;
        for (const char *c = p; c < le; c++)
            if ((unsigned char)*c < 0x20 && *c != '\t') {
                serve_keys_free(k);
                return ember_fail(err, "%s:%d: control character 0x%02x (a keys file is text)", name, line,
                                  (unsigned char)*c);
            }
        const char *w, *q = p;
        size_t wn;
        if (next_word(&q, le, &w, &wn) && w[0] != '#') {
            serve_key_entry e;
            memset(&e, 0, sizeof e);
            if (!parse_hex(w, wn, e.hash, sizeof e.hash)) {
                serve_keys_free(k);
                return ember_fail(err, "%s:%d: expected the SHA-256 of a key (64 hex digits) first, got '%.*s'", name,
                                  line, (int)(wn > 80 ? 80 : wn), w);
            }
            if (!next_word(&q, le, &w, &wn)) {
                serve_keys_free(k);
                return ember_fail(err, "%s:%d: the tenant name is missing (line: HASH TENANT [admin])", name, line);
            }
            bool ok = wn < 65;
            for (size_t i = 0; ok && i < wn; i++) ok = name_char((unsigned char)w[i]);
            if (!ok) {
                serve_keys_free(k);
                return ember_fail(err, "%s:%d: tenant name '%.*s': use 1-64 letters, digits or . _ - @ :", name, line,
                                  (int)(wn > 80 ? 80 : wn), w);
            }
            memcpy(e.tenant, w, wn);
            if (next_word(&q, le, &w, &wn)) {
                if (wn != 5 || strncmp(w, "admin", 5) != 0) {
                    serve_keys_free(k);
                    return ember_fail(err, "%s:%d: expected 'admin' or nothing after the tenant, got '%.*s'", name,
                                      line, (int)(wn > 80 ? 80 : wn), w);
                }
                e.admin = true;
                if (next_word(&q, le, &w, &wn)) {
                    serve_keys_free(k);
                    return ember_fail(err, "%s:%d: unexpected '%.*s' at the end of the line", name, line,
                                      (int)(wn > 80 ? 80 : wn), w);
                }
            }
            for (int i = 0; i < k->n; i++)
                if (memcmp(k->e[i].hash, e.hash, sizeof e.hash) == 0) {
                    serve_keys_free(k);
                    return ember_fail(err, "%s:%d: the same key hash is listed twice", name, line);
                }
            if (k->n == k->cap) {
                int cap = k->cap ? k->cap * 2 : 16;
                serve_key_entry *ne = realloc(k->e, (size_t)cap * sizeof *ne);
                if (ne == NULL) {
                    serve_keys_free(k);
                    return ember_fail(err, "%s: out of memory", name);
                }
                k->e = ne;
                k->cap = cap;
            }
            k->e[k->n++] = e;
        }
        p = eol ? eol + 1 : end;
    }
    if (k->n == 0) {
        serve_keys_free(k);
        return ember_fail(err, "%s: no keys (lines: SHA256-HEX TENANT [admin])", name);
    }
    *out = k;
    return 0;
}

int serve_keys_load(const char *path, serve_keys **out, ember_error *err) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (f == NULL) return ember_fail(err, "server.api_keys_file: %s: %s", path, strerror(errno));
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t got = fread(buf + len, 1, cap - len, f);
        len += got;
        if (got == 0) break;
        if (len == cap) {
            char *nb = cap < (64u << 20) ? realloc(buf, cap * 2) : NULL;
            if (nb == NULL) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf == NULL) return ember_fail(err, "server.api_keys_file: %s: out of memory or too large", path);
    int rc = serve_keys_parse(buf, len, path, out, err);
    free(buf);
    return rc;
}

void serve_keys_free(serve_keys *k) {
    if (k == NULL) return;
    free(k->e);
    free(k);
}

int serve_keys_count(const serve_keys *k) { return k ? k->n : 0; }

const serve_key_entry *serve_keys_find(const serve_keys *k, const char *key, size_t len) {
    if (k == NULL || key == NULL) return NULL;
    unsigned char h[32];
    unsigned int hn = 0;
    if (!EVP_Digest(key, len, h, &hn, EVP_sha256(), NULL) || hn != sizeof h) return NULL;
    const serve_key_entry *found = NULL;
    for (int i = 0; i < k->n; i++) /* every entry is compared: the time does not tell which matched */
        if (CRYPTO_memcmp(h, k->e[i].hash, sizeof h) == 0) found = &k->e[i];
    return found;
}

/* ---- the secret ---- */

static int mkdirs(const char *path) {
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return -1;
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0700) < 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    return mkdir(buf, 0700) < 0 && errno != EEXIST ? -1 : 0;
}

static int read_secret(const char *path, unsigned char *secret, ember_error *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ember_fail(err, "tenant secret %s: %s", path, strerror(errno));
    char buf[130];
    ssize_t n = 0;
    /* a server that created it a moment ago may still be writing it */
    for (int tries = 0; tries < 50; tries++) {
        n = pread(fd, buf, sizeof buf - 1, 0);
        if (n >= 64) break;
        usleep(10000);
    }
    struct stat st;
    bool open_to_others = fstat(fd, &st) == 0 && (st.st_mode & 077) != 0;
    close(fd);
    if (n < 0) return ember_fail(err, "tenant secret %s: %s", path, strerror(errno));
    while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == '\r')) n--;
    if (!parse_hex(buf, (size_t)n, secret, SERVE_TENANT_SECRET_BYTES))
        return ember_fail(err, "tenant secret %s: expected 64 hex digits (delete the file to make a new one; "
                          "tenants' cached prefixes are then lost)", path);
    if (open_to_others)
        ember_log(EMBER_LOG_WARN, "tenant secret %s can be read by other users (chmod 600 it)", path);
    return 0;
}

int serve_tenant_secret_load(const char *path, unsigned char secret[SERVE_TENANT_SECRET_BYTES], bool *created,
                             ember_error *err) {
    *created = false;
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 && errno == ENOENT) {
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", path);
        char *slash = strrchr(dir, '/');
        if (slash && slash != dir) {
            *slash = 0;
            if (mkdirs(dir) < 0) return ember_fail(err, "tenant secret: cannot create %s: %s", dir, strerror(errno));
        }
        fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    }
    if (fd < 0) {
        if (errno == EEXIST) return read_secret(path, secret, err);
        return ember_fail(err, "tenant secret %s: %s", path, strerror(errno));
    }
    unsigned char raw[SERVE_TENANT_SECRET_BYTES];
    size_t got = 0;
    while (got < sizeof raw) {
        ssize_t r = getrandom(raw + got, sizeof raw - got, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            close(fd);
            unlink(path);
            return ember_fail(err, "tenant secret: no randomness: %s", strerror(errno));
        }
        got += (size_t)r;
    }
    char hex[2 * SERVE_TENANT_SECRET_BYTES + 2];
    for (size_t i = 0; i < sizeof raw; i++) snprintf(hex + 2 * i, 3, "%02x", raw[i]);
    hex[2 * sizeof raw] = '\n';
    bool ok = write(fd, hex, 2 * sizeof raw + 1) == (ssize_t)(2 * sizeof raw + 1) && fsync(fd) == 0;
    close(fd);
    if (!ok) {
        unlink(path);
        return ember_fail(err, "tenant secret %s: cannot write it", path);
    }
    memcpy(secret, raw, sizeof raw);
    *created = true;
    return 0;
}

uint64_t serve_tenant_salt(const unsigned char secret[SERVE_TENANT_SECRET_BYTES], const char *tenant,
                           const char *cache_salt) {
    size_t tl = tenant ? strlen(tenant) : 0, sl = cache_salt ? strlen(cache_salt) : 0;
    if (tl == 0 && sl == 0) return 0;
    unsigned char *msg = malloc(tl + sl + 1);
    if (msg == NULL) return 1;
    if (tl) memcpy(msg, tenant, tl);
    msg[tl] = 0;
    if (sl) memcpy(msg + tl + 1, cache_salt, sl);
    unsigned char mac[EVP_MAX_MD_SIZE];
    unsigned int mn = 0;
    uint64_t salt = 1;
    if (HMAC(EVP_sha256(), secret, SERVE_TENANT_SECRET_BYTES, msg, tl + sl + 1, mac, &mn) && mn >= 8) {
        memcpy(&salt, mac, 8);
        if (salt == 0) salt = 1;
    }
    free(msg);
    return salt;
}

/* ---- counters ---- */

#define STATS_MAX_TENANTS 4096

typedef struct tenant_row {
    char name[SERVE_TENANT_MAX];
    uint64_t requests, failed;
    int64_t prompt, cached, completion;
} tenant_row;

struct serve_tenant_stats {
    pthread_mutex_t lock;
    tenant_row *rows;
    int n, cap;
};

serve_tenant_stats *serve_tenant_stats_create(void) {
    serve_tenant_stats *s = calloc(1, sizeof *s);
    if (s) pthread_mutex_init(&s->lock, NULL);
    return s;
}

void serve_tenant_stats_free(serve_tenant_stats *s) {
    if (s == NULL) return;
    pthread_mutex_destroy(&s->lock);
    free(s->rows);
    free(s);
}

/* The row of name, added when missing (s->lock held); NULL: none. */
static tenant_row *row_of(serve_tenant_stats *s, const char *name, bool add) {
    for (int i = 0; i < s->n; i++)
        if (strcmp(s->rows[i].name, name) == 0) return &s->rows[i];
    if (!add) return NULL;
    if (s->n >= STATS_MAX_TENANTS && strcmp(name, "(other)") != 0) return row_of(s, "(other)", true);
    if (s->n == s->cap) {
        int cap = s->cap ? s->cap * 2 : 16;
        tenant_row *nr = realloc(s->rows, (size_t)cap * sizeof *nr);
        if (nr == NULL) return NULL;
        s->rows = nr;
        s->cap = cap;
    }
    tenant_row *r = &s->rows[s->n++];
    memset(r, 0, sizeof *r);
    snprintf(r->name, sizeof r->name, "%s", name);
    return r;
}

void serve_tenant_stats_add(serve_tenant_stats *s, const char *tenant, int64_t prompt_tokens, int64_t cached_tokens,
                            int64_t completion_tokens, bool failed) {
    if (s == NULL) return;
    pthread_mutex_lock(&s->lock);
    tenant_row *r = row_of(s, tenant && tenant[0] ? tenant : "(none)", true);
    if (r) {
        r->requests++;
        r->failed += failed;
        r->prompt += prompt_tokens;
        r->cached += cached_tokens;
        r->completion += completion_tokens;
    }
    pthread_mutex_unlock(&s->lock);
}

static cJSON *row_json(const tenant_row *r) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "requests", r ? (double)r->requests : 0);
    cJSON_AddNumberToObject(o, "failed_requests", r ? (double)r->failed : 0);
    cJSON_AddNumberToObject(o, "prompt_tokens", r ? (double)r->prompt : 0);
    cJSON_AddNumberToObject(o, "cached_tokens", r ? (double)r->cached : 0);
    cJSON_AddNumberToObject(o, "completion_tokens", r ? (double)r->completion : 0);
    cJSON_AddNumberToObject(o, "cached_ratio", r && r->prompt > 0 ? (double)r->cached / (double)r->prompt : 0);
    return o;
}

cJSON *serve_tenant_stats_one(serve_tenant_stats *s, const char *tenant) {
    pthread_mutex_lock(&s->lock);
    cJSON *o = row_json(row_of(s, tenant && tenant[0] ? tenant : "(none)", false));
    pthread_mutex_unlock(&s->lock);
    return o;
}

cJSON *serve_tenant_stats_all(serve_tenant_stats *s) {
    cJSON *o = cJSON_CreateObject();
    pthread_mutex_lock(&s->lock);
    for (int i = 0; i < s->n; i++) cJSON_AddItemToObject(o, s->rows[i].name, row_json(&s->rows[i]));
    pthread_mutex_unlock(&s->lock);
    return o;
}

void serve_tenant_stats_reset(serve_tenant_stats *s) {
    pthread_mutex_lock(&s->lock);
    s->n = 0;
    pthread_mutex_unlock(&s->lock);
}
