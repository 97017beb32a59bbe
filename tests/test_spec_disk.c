/* test_spec_disk.c - the draft model's sidecar on the SSD tier.
 *
 * An engine with an SSD root and a draft model stores its prompt; the draft
 * model's sidecar entries (its K/V rows of the prompt and, for a recurrent
 * draft model, its state there) are mirrored as side files of the draft
 * model's own owner namespace. A second engine on the same root (a
 * restart) reads the side file back on its first request, before the
 * memory sidecar has anything, so its draft model adopts the prompt instead
 * of forwarding it again:
 *   - the draft model forwards exactly the prompt's rows fewer than the
 *     cold run, its drafts are the cold run's (digest, acceptance), and the
 *     output is the plain engine's bit for bit;
 *   - with the mirror off (spec.sidecar_mirror false) the restarted draft
 *     model forwards every row again (and drafts the same);
 *   - a restart with another draft model of the same shape (llama256 q4_0
 *     instead of q8_0: same row widths, another fingerprint) adopts
 *     nothing of the old draft model's files, though they are there; nor
 *     does one whose target pool stores q8_0 instead of f32;
 * on a dense pair (llama-gqa drafted by llama256-q8_0) and a recurrent one
 * (qwen35 drafting itself: the state travels with the rows).
 *
 * Damaged side files (a flipped payload or state byte, a truncation,
 * garbage: damaged after the restart's start-up scan, so that the read
 * finds them) are refused: the parser names what is wrong, the read counts
 * them (disk_corrupt) and deletes them, and the request drafts from scratch
 * with the plain output. A sound file of another owner under the same name
 * (a forgery: owner field rewritten, both checksums recomputed) is refused
 * and left alone.
 *
 * Through the API: `ember serve --draft ... --disk-path` restarted on the
 * same root counts the side file it wrote (spec.sidecar_disk_writes,
 * ember_apc_sidecar_disk_writes_total) and the one the restart read
 * (spec.sidecar_disk_loads, ember_apc_sidecar_disk_loads_total) and answers
 * the same text and logprobs; --no-spec-sidecar-mirror reads none.
 *
 * The remote tier (a redis-server of the test's own, no SSD tier): a
 * second engine on the same Redis (a replica) restores the draft model's
 * sidecar (dense pair and recurrent pair) and the MTP head's (qwen35 MTP
 * fixture) that the first one stored: the same drafts, the plain output;
 * a value altered in Redis (SETRANGE) is refused (remote_corrupt), deleted,
 * and the replica drafts from scratch. */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include "apc/apc_disk.h"
#include "engine/engine.h"
#include "http_client.h"
#include "serve/serve_metrics.h"
#include "test_util.h"

typedef struct prompt_ids {
    int32_t ids[640];
    int n;
} prompt_ids;

static bool load_prompt(const char *name, prompt_ids *p) {
    p->n = test_load_prompt_ids(name, p->ids, 512);
    return p->n > 0;
}

static void generate(engine *e, const prompt_ids *p, engine_result *r) {
    engine_request req = engine_default_request();
    req.prompt = p->ids;
    req.n_prompt = p->n;
    req.max_tokens = 16;
    req.stop_at_eog = false;
    req.want_logits = true;
    ember_error err;
    if (engine_generate(e, &req, r, &err) < 0) fail_msg("engine_generate: %s", err.msg);
}

/* draft NULL: plain, no speculation; draft == m with mtp: the MTP head.
 * redis: the remote tier's URL, or NULL. */
static kv_format open_format; /* the next engines' KV format (zero: f32) */

static engine *open_any(const model *m, const model *draft, bool mtp, const char *dir, const char *redis, bool mirror) {
    engine_config cfg = engine_default_config();
    cfg.kv_format = open_format;
    cfg.n_threads = 2;
    cfg.n_ctx = 1024;
    cfg.cache.disk.path = dir;
    if (redis) {
        cfg.cache.remote.url = redis;
        cfg.cache.remote.min_wait_ms = 3000;
        cfg.cache.remote.max_wait_ms = 3000;
        cfg.cache.remote.timeout_ms = 1000;
        /* recurrent stacks share through their exact and ckpt tiers (block
         * chains with recurrent snapshots keep their records local) */
        cfg.cache.ckpt.snapshot_interval = 0;
    }
    if (draft) {
        cfg.spec.kind = mtp ? SPEC_MTP : SPEC_DRAFT;
        cfg.spec.draft = mtp ? NULL : draft;
        cfg.spec.k = 4;
        cfg.spec.adaptive = false;
        cfg.spec.sidecar_entries = 4;
        cfg.spec.sidecar_bytes = (size_t)64 << 20;
        cfg.spec.sidecar_memory_only = !mirror;
    }
    return test_open_engine(m, &cfg);
}

static engine *open_engine(const model *m, const model *draft, const char *dir, bool mirror) {
    return open_any(m, draft, false, dir, NULL, mirror);
}

/* ---- side files on disk ---- */

typedef struct side_files {
    char path[8][4096];
    char ns_hex[33];
    int n;
} side_files;

/* The s-*.apc files under root/<namespace>/. */
static void list_sides(const char *root, side_files *out) {
    memset(out, 0, sizeof *out);
    DIR *top = opendir(root);
    assert_non_null(top);
    struct dirent *de;
    while ((de = readdir(top)) != NULL) {
        if (strlen(de->d_name) != 32) continue;
        char sub[2048];
        snprintf(sub, sizeof sub, "%.1900s/%.64s", root, de->d_name);
        DIR *dir = opendir(sub);
        if (dir == NULL) continue;
        struct dirent *f;
        while ((f = readdir(dir)) != NULL)
            if (strncmp(f->d_name, "s-", 2) == 0 && out->n < 8) {
                snprintf(out->path[out->n++], sizeof out->path[0], "%s/%.256s", sub, f->d_name);
                snprintf(out->ns_hex, sizeof out->ns_hex, "%.32s", de->d_name);
            }
        closedir(dir);
    }
    closedir(top);
}

static void write_file(const char *path, const void *buf, size_t size) {
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, size, f), size);
    fclose(f);
}

static uint64_t get_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static void put_le64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* The parser's verdict on a side file image of the namespace ns_hex;
 * returns 0 (sound) or -1 with why. */
static int parse_side(const uint8_t *buf, size_t size, const char *ns_hex, char *why, size_t cap) {
    apc_disk_expect ex;
    memset(&ex, 0, sizeof ex);
    for (int i = 0; i < 16; i++) {
        unsigned v;
        sscanf(ns_hex + 2 * i, "%2x", &v);
        ex.ns[i] = (uint8_t)v;
    }
    int width[1];
    apc_layout lay = apc_disk_side_layout(width, 1, 0); /* side files carry their own */
    ex.layout = &lay;
    apc_disk_header h;
    ember_error err;
    int rc = apc_disk_parse_image(buf, size, &ex, &h, &err);
    if (rc == 0) apc_disk_header_free(&h);
    else snprintf(why, cap, "%.200s", err.msg);
    return rc;
}

typedef enum damage { FLIP_ROWS, FLIP_STATE, TRUNCATE, GARBAGE, FORGED_OWNER } damage;
static const char *damage_name[] = {"flipped row byte", "flipped state byte", "truncated", "garbage",
                                    "another owner (resealed)"};

static void damage_file(const char *path, const char *ns_hex, damage how) {
    size_t size;
    uint8_t *buf = read_whole_file(path, &size);
    assert_non_null(buf);
    char why[256] = "";
    assert_int_equal(parse_side(buf, size, ns_hex, why, sizeof why), 0); /* sound before */
    uint64_t n = get_le64(buf + 88), words = get_le64(buf + 96), state = get_le64(buf + 112);
    size_t rows_at = APC_DISK_HEADER_BYTES + 4 * (size_t)n;
    switch (how) {
    case FLIP_ROWS: buf[rows_at + (size_t)(n * words * 4) / 2] ^= 0x10; break;
    case FLIP_STATE:
        assert_true(state > 0);
        buf[size - 8 - (size_t)state / 3] ^= 0x01;
        break;
    case TRUNCATE: size -= 64; break;
    case GARBAGE:
        for (size_t i = 0; i < size; i++) buf[i] = (uint8_t)(i * 131 + 7);
        break;
    case FORGED_OWNER: {
        buf[56] ^= 0xff; /* the owner namespace, then both checksums made right again */
        put_le64(buf + APC_DISK_HEADER_SUM_AT, XXH3_64bits(buf, APC_DISK_HEADER_SUM_AT));
        put_le64(buf + size - 8, XXH3_64bits(buf, size - 8));
        break;
    }
    }
    int rc = parse_side(buf, size, ns_hex, why, sizeof why);
    if (how == FORGED_OWNER) {
        assert_int_equal(rc, 0); /* sound as a file: only its reader can tell it is not its own */
    } else {
        assert_int_equal(rc, -1);
        assert_true(why[0] != 0);
        print_message("  %s: the parser says \"%s\"\n", damage_name[how], why);
    }
    write_file(path, buf, size);
    free(buf);
}

static bool exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

/* ---- the restart ---- */

typedef struct pair {
    model *m, *dm, *other; /* other: another draft model of dm's shape, or NULL */
    prompt_ids p;
    engine_result want;    /* the plain engine's */
    engine_result cold;    /* the first speculating engine's */
    int64_t cold_rows;     /* rows its draft model forwarded */
} pair;

static bool pair_open(pair *pr, const char *target, const char *draft, const char *other) {
    memset(pr, 0, sizeof *pr);
    char rel[256], tpath[1024], dpath[1024];
    snprintf(rel, sizeof rel, "reference/%s.gguf", target);
    const char *tp = fixture_path(rel);
    if (tp == NULL || !load_prompt(target, &pr->p)) return false;
    snprintf(tpath, sizeof tpath, "%s", tp);
    snprintf(rel, sizeof rel, "reference/%s.gguf", draft);
    const char *dp = fixture_path(rel);
    if (dp == NULL) return false;
    snprintf(dpath, sizeof dpath, "%s", dp);
    pr->m = test_load_model(tpath);
    pr->dm = test_load_model(dpath);
    if (other) {
        snprintf(rel, sizeof rel, "reference/%s.gguf", other);
        const char *op = fixture_path(rel);
        if (op) pr->other = test_load_model(op);
    }
    engine *plain = open_engine(pr->m, NULL, NULL, false);
    generate(plain, &pr->p, &pr->want);
    engine_free(plain);
    return true;
}

static void pair_close(pair *pr) {
    engine_result_free(&pr->want);
    engine_result_free(&pr->cold);
    model_free(pr->m);
    model_free(pr->dm);
    model_free(pr->other);
}

/* A first engine on dir: the cold run, its side files written. */
static void cold_run(pair *pr, const char *dir, const char *what) {
    engine *a = open_engine(pr->m, pr->dm, dir, true);
    engine_result_free(&pr->cold);
    generate(a, &pr->p, &pr->cold);
    apc_flush(engine_cache(a));
    spec_sidecar_stats s = spec_sidecar_get_stats(engine_drafter(a));
    pr->cold_rows = s.draft_rows;
    assert_true(s.writes >= 1);
    assert_true(s.disk_writes >= 1);
    assert_int_equal(s.disk_loads, 0);
    assert_true(pr->cold.spec.drafted > 0);
    assert_warm_equals_cold(&pr->want, &pr->cold, what);
    engine_free(a);
}

static void restart(const char *target, const char *draft, const char *other) {
    pair pr;
    if (!pair_open(&pr, target, draft, other)) return;
    char *dir = make_temp_dir();
    char what[256];
    snprintf(what, sizeof what, "%s drafted by %s: cold", target, draft);
    cold_run(&pr, dir, what);
    side_files sf;
    list_sides(dir, &sf);
    assert_true(sf.n >= 1);

    /* the restart: the draft model's sidecar comes back from disk */
    engine *b = open_engine(pr.m, pr.dm, dir, true);
    engine_result warm;
    generate(b, &pr.p, &warm);
    spec_sidecar_stats sb = spec_sidecar_get_stats(engine_drafter(b));
    print_message("%s drafted by %s over a restart: %d side files; draft-model rows cold %lld, after the restart "
                  "%lld (%lld restored from %lld side file read); target %lld of %d tokens cached; digests cold "
                  "%016llx warm %016llx; accepted cold %lld of %lld, warm %lld of %lld\n",
                  target, draft, sf.n, (long long)pr.cold_rows, (long long)sb.draft_rows,
                  (long long)sb.restored_rows, (long long)sb.disk_loads, (long long)warm.cached_tokens, pr.p.n,
                  (unsigned long long)pr.cold.spec.digest, (unsigned long long)warm.spec.digest,
                  (long long)pr.cold.spec.accepted, (long long)pr.cold.spec.drafted, (long long)warm.spec.accepted,
                  (long long)warm.spec.drafted);
    snprintf(what, sizeof what, "%s drafted by %s: after the restart", target, draft);
    assert_warm_equals_cold(&pr.want, &warm, what);
    assert_true(warm.cached_tokens > 0);
    assert_int_equal(sb.disk_loads, 1);
    assert_int_equal(sb.hits, 1);
    assert_int_equal(sb.restored_rows, pr.p.n);
    assert_int_equal(sb.draft_rows, pr.cold_rows - pr.p.n);
    assert_true(warm.spec.digest == pr.cold.spec.digest);
    assert_int_equal(warm.spec.accepted, pr.cold.spec.accepted);
    engine_result_free(&warm);
    engine_free(b);

    /* the control: the mirror off, the draft model forwards every row */
    engine *c = open_engine(pr.m, pr.dm, dir, false);
    generate(c, &pr.p, &warm);
    spec_sidecar_stats sc = spec_sidecar_get_stats(engine_drafter(c));
    print_message("  mirror off: draft-model rows %lld, %lld restored, %lld side files read\n",
                  (long long)sc.draft_rows, (long long)sc.restored_rows, (long long)sc.disk_loads);
    snprintf(what, sizeof what, "%s drafted by %s: mirror off", target, draft);
    assert_warm_equals_cold(&pr.want, &warm, what);
    assert_true(warm.cached_tokens > 0);
    assert_int_equal(sc.disk_loads, 0);
    assert_int_equal(sc.disk_writes, 0);
    assert_int_equal(sc.hits, 0);
    assert_int_equal(sc.draft_rows, pr.cold_rows);
    assert_true(warm.spec.digest == pr.cold.spec.digest);
    engine_result_free(&warm);
    engine_free(c);

    /* another draft model on the same root: none of the old files */
    if (pr.other) {
        engine *d = open_engine(pr.m, pr.other, dir, true);
        generate(d, &pr.p, &warm);
        apc_flush(engine_cache(d));
        spec_sidecar_stats sd = spec_sidecar_get_stats(engine_drafter(d));
        side_files after;
        list_sides(dir, &after);
        print_message("  restarted with %s: %lld side files read, %lld rows restored, draft-model rows %lld; "
                      "side files %d before, %d after (its own)\n",
                      other, (long long)sd.disk_loads, (long long)sd.restored_rows, (long long)sd.draft_rows, sf.n,
                      after.n);
        snprintf(what, sizeof what, "%s drafted by %s after %s", target, other, draft);
        assert_warm_equals_cold(&pr.want, &warm, what);
        assert_int_equal(sd.disk_loads, 0);
        assert_int_equal(sd.hits, 0);
        assert_int_equal(sd.restored_rows, 0);
        assert_true(sd.disk_writes >= 1);
        assert_true(after.n > sf.n); /* the old files stay; this model writes under its own owner */
        engine_result_free(&warm);
        engine_free(d);

        /* the same draft model under another KV format of the target's
         * pool: another namespace, so none of the old files either */
        open_format = (kv_format){KV_FORMAT_Q8_0, 0, 0, 0};
        engine *plain = open_engine(pr.m, NULL, NULL, false);
        engine_result want_q8;
        generate(plain, &pr.p, &want_q8);
        engine_free(plain);
        engine *f = open_engine(pr.m, pr.dm, dir, true);
        generate(f, &pr.p, &warm);
        spec_sidecar_stats sf8 = spec_sidecar_get_stats(engine_drafter(f));
        print_message("  restarted with kv_format q8_0: %lld side files read, %lld rows restored, target %lld cached\n",
                      (long long)sf8.disk_loads, (long long)sf8.restored_rows, (long long)warm.cached_tokens);
        assert_warm_equals_cold(&want_q8, &warm, "kv_format q8_0 after f32");
        assert_int_equal(sf8.disk_loads, 0);
        assert_int_equal(sf8.hits, 0);
        assert_int_equal(warm.cached_tokens, 0);
        engine_result_free(&warm);
        engine_result_free(&want_q8);
        engine_free(f);
        open_format = (kv_format){KV_FORMAT_F32, 0, 0, 0};
    }
    remove_tree(dir);
    free(dir);
    pair_close(&pr);
}

static void test_draft_sidecar_restart(void **unused) {
    (void)unused;
    restart("llama-gqa-f32", "llama256-q8_0", "llama256-q4_0");
    restart("qwen35-f32", "qwen35-f32", NULL);
}

/* ---- damaged side files ---- */

static void refuse(pair *pr, damage how) {
    char *dir = make_temp_dir();
    char what[256];
    snprintf(what, sizeof what, "damage %s: cold", damage_name[how]);
    cold_run(pr, dir, what);
    side_files sf;
    list_sides(dir, &sf);
    assert_true(sf.n >= 1);
    engine *b = open_engine(pr->m, pr->dm, dir, true); /* its start-up scan has indexed the sound files */
    for (int i = 0; i < sf.n; i++) damage_file(sf.path[i], sf.ns_hex, how);
    apc_stats st;
    apc_get_stats(engine_cache(b), &st);
    uint64_t corrupt0 = st.disk_corrupt;
    engine_result warm;
    generate(b, &pr->p, &warm);
    spec_sidecar_stats sb = spec_sidecar_get_stats(engine_drafter(b));
    apc_get_stats(engine_cache(b), &st);
    uint64_t corrupt = st.disk_corrupt - corrupt0;
    print_message("  %s: %llu counted corrupt, %lld loaded, draft-model rows %lld (cold %lld)\n", damage_name[how],
                  (unsigned long long)corrupt, (long long)sb.disk_loads, (long long)sb.draft_rows,
                  (long long)pr->cold_rows);
    snprintf(what, sizeof what, "damage %s: after the restart", damage_name[how]);
    assert_warm_equals_cold(&pr->want, &warm, what);
    assert_int_equal(sb.disk_loads, 0);
    assert_int_equal(sb.hits, 0);
    assert_int_equal(sb.restored_rows, 0);
    assert_int_equal(sb.draft_rows, pr->cold_rows);
    assert_true(warm.spec.digest == pr->cold.spec.digest);
    engine_result_free(&warm);
    engine_free(b); /* its writes have landed */
    /* A corrupt file was deleted (and the store of the drafts computed
     * afresh may have written a sound one in its place); another owner's
     * file is not this reader's to delete. */
    int left = 0, sound = 0;
    for (int i = 0; i < sf.n; i++) {
        size_t size;
        uint8_t *buf = exists(sf.path[i]) ? read_whole_file(sf.path[i], &size) : NULL;
        char why[256];
        left += buf != NULL;
        sound += buf && parse_side(buf, size, sf.ns_hex, why, sizeof why) == 0;
        free(buf);
    }
    if (how == FORGED_OWNER) {
        assert_int_equal(corrupt, 0);
        assert_int_equal(left, sf.n);
    } else {
        assert_true(corrupt >= 1);
        assert_true(sound >= 1); /* the one the read refused, written again by the store of the drafts */
    }
    remove_tree(dir);
    free(dir);
}

static void test_damaged_side_files(void **unused) {
    (void)unused;
    pair pr;
    if (pair_open(&pr, "llama-gqa-f32", "llama256-q8_0", NULL)) {
        print_message("llama-gqa-f32 drafted by llama256-q8_0, damaged side files:\n");
        refuse(&pr, FLIP_ROWS);
        refuse(&pr, TRUNCATE);
        refuse(&pr, GARBAGE);
        refuse(&pr, FORGED_OWNER);
        pair_close(&pr);
    }
    if (pair_open(&pr, "qwen35-f32", "qwen35-f32", NULL)) {
        print_message("qwen35-f32 drafting itself, damaged side files:\n");
        refuse(&pr, FLIP_STATE);
        pair_close(&pr);
    }
}

/* ---- the remote tier ---- */

typedef struct redis_srv {
    char *dir;
    char sock[300];
    char url[320];
    pid_t pid;
} redis_srv;

/* A redis-server on dir/redis.sock, no persistence; false when there is
 * no redis-server to run. */
static bool redis_start(redis_srv *r) {
    if (system("command -v redis-server >/dev/null 2>&1") != 0) return false;
    r->dir = make_temp_dir();
    snprintf(r->sock, sizeof r->sock, "%.280s/redis.sock", r->dir);
    snprintf(r->url, sizeof r->url, "unix://%s", r->sock);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        char log[400];
        snprintf(log, sizeof log, "%.300s/redis.log", r->dir);
        if (freopen(log, "a", stdout) == NULL || freopen(log, "a", stderr) == NULL) _exit(126);
        const char *argv[] = {"redis-server", "--port", "0", "--unixsocket", r->sock, "--unixsocketperm", "700",
                              "--save", "", "--appendonly", "no", "--dir", r->dir, NULL};
        execvp("redis-server", (char *const *)argv);
        _exit(127);
    }
    r->pid = pid;
    for (int i = 0; i < 200; i++) {
        struct timeval tv = {1, 0};
        redisContext *c = redisConnectUnixWithTimeout(r->sock, tv);
        bool ok = false;
        if (c && !c->err) {
            redisReply *rep = redisCommand(c, "PING");
            ok = rep && rep->type == REDIS_REPLY_STATUS;
            if (rep) freeReplyObject(rep);
        }
        if (c) redisFree(c);
        if (ok) return true;
        usleep(50 * 1000);
    }
    fail_msg("redis-server did not come up on %s", r->sock);
    return false;
}

static void redis_stop(redis_srv *r) {
    if (r->pid > 0) {
        kill(r->pid, SIGKILL);
        waitpid(r->pid, NULL, 0);
    }
    remove_tree(r->dir);
    free(r->dir);
}

/* Alters one byte in the middle of every side value ("ember:apc:*:s:*");
 * returns how many. */
static int redis_damage_sides(const redis_srv *r) {
    struct timeval tv = {5, 0};
    redisContext *c = redisConnectUnixWithTimeout(r->sock, tv);
    assert_true(c && !c->err);
    redisReply *keys = redisCommand(c, "KEYS ember:apc:*:s:*");
    assert_non_null(keys);
    int n = 0;
    for (size_t i = 0; keys->type == REDIS_REPLY_ARRAY && i < keys->elements; i++) {
        const char *k = keys->element[i]->str;
        redisReply *len = redisCommand(c, "STRLEN %s", k);
        long long at = len && len->type == REDIS_REPLY_INTEGER ? len->integer / 2 : 100;
        if (len) freeReplyObject(len);
        redisReply *get = redisCommand(c, "GETRANGE %s %lld %lld", k, at, at);
        char b = get && get->type == REDIS_REPLY_STRING && get->len == 1 ? get->str[0] : 0;
        if (get) freeReplyObject(get);
        b ^= 0x20;
        redisReply *set = redisCommand(c, "SETRANGE %s %lld %b", k, at, &b, (size_t)1);
        if (set) freeReplyObject(set);
        n++;
    }
    freeReplyObject(keys);
    redisFree(c);
    return n;
}

/* target drafted by draft (mtp: its own MTP head) through Redis only: A
 * stores, replica B restores; then the values altered, replica C refuses
 * them. */
static void remote_pair(const redis_srv *rs, const char *target, const char *draft, bool mtp) {
    pair pr;
    if (!pair_open(&pr, target, draft, NULL)) return;
    engine *a = open_any(pr.m, pr.dm, mtp, NULL, rs->url, true);
    generate(a, &pr.p, &pr.cold);
    apc_flush(engine_cache(a));
    spec_sidecar_stats sa = spec_sidecar_get_stats(engine_drafter(a));
    pr.cold_rows = sa.draft_rows;
    assert_true(sa.disk_writes >= 1);
    assert_true(pr.cold.spec.drafted > 0);
    char what[256];
    snprintf(what, sizeof what, "%s drafted by %s%s through Redis: cold", target, draft, mtp ? " (MTP)" : "");
    assert_warm_equals_cold(&pr.want, &pr.cold, what);
    engine_free(a);

    engine *b = open_any(pr.m, pr.dm, mtp, NULL, rs->url, true); /* a replica */
    engine_result warm;
    generate(b, &pr.p, &warm);
    spec_sidecar_stats sb = spec_sidecar_get_stats(engine_drafter(b));
    apc_stats st;
    apc_get_stats(engine_cache(b), &st);
    print_message("%s drafted by %s%s through Redis: %lld entries queued by A; replica B read %lld back (%llu remote "
                  "hits, %lld rows restored, target %lld of %d cached); draft-model rows cold %lld, B %lld; digests "
                  "%016llx / %016llx\n",
                  target, draft, mtp ? " (MTP head)" : "", (long long)sa.disk_writes, (long long)sb.disk_loads,
                  (unsigned long long)st.remote_hits, (long long)sb.restored_rows, (long long)warm.cached_tokens,
                  pr.p.n, (long long)pr.cold_rows, (long long)sb.draft_rows, (unsigned long long)pr.cold.spec.digest,
                  (unsigned long long)warm.spec.digest);
    snprintf(what, sizeof what, "%s drafted by %s through Redis: replica", target, draft);
    assert_warm_equals_cold(&pr.want, &warm, what);
    assert_true(warm.cached_tokens > 0);
    assert_int_equal(sb.disk_loads, 1);
    assert_int_equal(sb.hits, 1);
    assert_true(warm.spec.digest == pr.cold.spec.digest);
    assert_int_equal(warm.spec.accepted, pr.cold.spec.accepted);
    if (!mtp) {
        assert_int_equal(sb.restored_rows, pr.p.n);
        assert_int_equal(sb.draft_rows, pr.cold_rows - pr.p.n);
    }
    engine_result_free(&warm);
    engine_free(b);

    int damaged = redis_damage_sides(rs);
    assert_true(damaged >= 1);
    engine *c = open_any(pr.m, pr.dm, mtp, NULL, rs->url, true);
    generate(c, &pr.p, &warm);
    spec_sidecar_stats sc = spec_sidecar_get_stats(engine_drafter(c));
    apc_get_stats(engine_cache(c), &st);
    print_message("  %d side values altered in Redis: replica C read %lld, %llu counted corrupt\n", damaged,
                  (long long)sc.disk_loads, (unsigned long long)st.remote_corrupt);
    snprintf(what, sizeof what, "%s drafted by %s through Redis: altered values", target, draft);
    assert_warm_equals_cold(&pr.want, &warm, what);
    assert_int_equal(sc.disk_loads, 0);
    assert_int_equal(sc.hits, 0);
    assert_true(st.remote_corrupt >= 1);
    if (!mtp) assert_int_equal(sc.draft_rows, pr.cold_rows); /* from scratch: the same drafts */
    if (mtp) assert_true(warm.spec.digest != pr.cold.spec.digest); /* a cold head drafts otherwise */
    else assert_true(warm.spec.digest == pr.cold.spec.digest);
    engine_result_free(&warm);
    engine_free(c);
    pair_close(&pr);
}

static void test_remote_sidecar(void **unused) {
    (void)unused;
    const char *pairs[][3] = {{"llama-gqa-f32", "llama256-q8_0", ""},
                              {"qwen35-f32", "qwen35-f32", ""},
                              {"qwen35-mtp-normjit-f32", "qwen35-mtp-normjit-f32", "mtp"}};
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        redis_srv rs;
        memset(&rs, 0, sizeof rs);
        if (!redis_start(&rs)) {
            print_message("skipping: no redis-server\n");
            skip();
        }
        remote_pair(&rs, pairs[i][0], pairs[i][1], pairs[i][2][0] != 0);
        redis_stop(&rs);
    }
}

/* ---- through the API ---- */

static double stat_num(const char *body, const char *obj, const char *key) {
    cJSON *j = cJSON_Parse(body);
    cJSON *o = obj ? cJSON_GetObjectItem(j, obj) : j;
    double v = cJSON_GetNumberValue(cJSON_GetObjectItem(o, key));
    cJSON_Delete(j);
    return v;
}

typedef struct api_run {
    char *choice;          /* choices[0]: text and logprobs */
    double disk_writes, disk_loads, restored_rows; /* /v1/cache/stats spec.sidecar_* */
    double m_writes, m_loads;                      /* /metrics ember_apc_sidecar_disk_*_total */
} api_run;

static void api_serve(const char *target, const char *draft, const char *root, bool mirror, api_run *out) {
    /* a log per run: the spawner reads it for the port before the child
     * truncates it, so a reused log would hand back the last run's port */
    static int run_no;
    char log[1200];
    snprintf(log, sizeof log, "%s/server-%d.log", root, run_no++);
    char draft_arg[1024], disk_arg[1024];
    snprintf(draft_arg, sizeof draft_arg, "%s", draft);
    snprintf(disk_arg, sizeof disk_arg, "%s/disk", root);
    char *const extra[] = {"--draft", draft_arg, "--disk-path", disk_arg, "--spec-k", "4", "--no-spec-adaptive",
                           mirror ? "--spec-sidecar-mirror" : "--no-spec-sidecar-mirror", NULL};
    pid_t pid;
    int port = http_spawn_ember(ember_binary(), target, extra, log, &pid);
    assert_true(port > 0);
    const char *body = "{\"prompt\": [1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, "
                       "29, 30, 31, 32, 33, 34, 35, 36, 37], \"max_tokens\": 12, \"temperature\": 0, "
                       "\"logprobs\": 2, \"ignore_eos\": true}";
    char *reply = NULL, *stats = NULL, *metrics = NULL;
    int code = http_call(port, "POST", "/v1/completions", NULL, body, &reply);
    if (code != 200) {
        char *text = read_whole_file(log, NULL);
        fail_msg("completion: HTTP %d %s; server log:\n%s", code, reply ? reply : "", text ? text : "(none)");
    }
    assert_int_equal(http_call(port, "GET", "/v1/cache/stats", NULL, NULL, &stats), 200);
    assert_int_equal(http_call(port, "GET", "/metrics", NULL, NULL, &metrics), 200);
    cJSON *j = cJSON_Parse(reply);
    out->choice = cJSON_PrintUnformatted(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0));
    cJSON_Delete(j);
    out->disk_writes = stat_num(stats, "spec", "sidecar_disk_writes");
    out->disk_loads = stat_num(stats, "spec", "sidecar_disk_loads");
    out->restored_rows = stat_num(stats, "spec", "sidecar_restored_rows");
    out->m_writes = serve_metrics_text_sum(metrics, "ember_apc_sidecar_disk_writes_total");
    out->m_loads = serve_metrics_text_sum(metrics, "ember_apc_sidecar_disk_loads_total");
    assert_int_equal(http_stop_server(&pid, 5000), 0); /* a clean stop lands the queued writes */
    free(reply);
    free(stats);
    free(metrics);
}

static void test_api_counters(void **unused) {
    (void)unused;
    if (ember_binary() == NULL) {
        print_message("skipping: EMBER_BIN is not set (run under ctest)\n");
        skip();
    }
    const char *tp = fixture_path("reference/llama-gqa-f32.gguf");
    if (tp == NULL) return;
    char target[1024];
    snprintf(target, sizeof target, "%s", tp);
    const char *dp = fixture_path("reference/llama256-q8_0.gguf");
    if (dp == NULL) return;
    char draft[1024];
    snprintf(draft, sizeof draft, "%s", dp);
    char *root = make_temp_dir();
    api_run cold, warm, off;
    api_serve(target, draft, root, true, &cold);
    api_serve(target, draft, root, true, &warm); /* the restart */
    api_serve(target, draft, root, false, &off);
    print_message("API: side files written %.0f (metrics %.0f); after the restart read %.0f (metrics %.0f), %.0f rows "
                  "restored; mirror off: read %.0f, written %.0f\n",
                  cold.disk_writes, cold.m_writes, warm.disk_loads, warm.m_loads, warm.restored_rows, off.disk_loads,
                  off.disk_writes);
    assert_true(cold.disk_writes >= 1);
    assert_true(cold.m_writes == cold.disk_writes);
    assert_true(cold.disk_loads == 0);
    assert_true(warm.disk_loads == 1);
    assert_true(warm.m_loads == 1);
    assert_true(warm.restored_rows > 0);
    assert_true(off.disk_loads == 0 && off.m_loads == 0 && off.disk_writes == 0);
    assert_string_equal(cold.choice, warm.choice);
    assert_string_equal(cold.choice, off.choice);
    free(cold.choice);
    free(warm.choice);
    free(off.choice);
    remove_tree(root);
    free(root);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_draft_sidecar_restart),
        cmocka_unit_test(test_damaged_side_files),
        cmocka_unit_test(test_api_counters),
        cmocka_unit_test(test_remote_sidecar),
    };
    return test_run_group(tests, NULL, NULL);
}
