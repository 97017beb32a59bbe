/* test_disk_async.c - no request waits on the SSD tier but its own.
 *
 * The scheduler runs a request's disk reads on the engine's fetch threads
 * (engine_req.h); the lookup reads memory only. Against a warm SSD tier
 * (a block-tier model, a 600-token prompt stored, then a restart):
 *  - a FIFO where a shard is expected is refused (not a regular file),
 *    counted as corrupt, and the resend completes, equal to a cold run;
 *  - a read that hangs (the test hook blocks it) costs only its request:
 *    an unrelated request decodes to the end while the read is still
 *    blocked, and the resend proceeds cold after its deadline;
 *  - an injected read error is a counted miss that leaves the file alone.
 * Every answer equals the cold answer of the same prompt. */
#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/clock.h"
#include "engine/engine.h"
#include "serve/serve_sched.h"
#include "test_util.h"

#define N_PROMPT 600
#define N_OTHER 200

/* ---- the read hook: pass, block until released, or fail ---- */
enum { HOOK_PASS = 0, HOOK_BLOCK = 1, HOOK_FAIL = 2 };
static pthread_mutex_t hook_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hook_cond = PTHREAD_COND_INITIALIZER;
static int hook_mode, hook_blocked, hook_calls;
static bool hook_released;

static int read_hook(void *user, const char *path) {
    (void)user, (void)path;
    pthread_mutex_lock(&hook_lock);
    hook_calls++;
    int mode = hook_mode;
    if (mode == HOOK_BLOCK) {
        hook_blocked++;
        pthread_cond_broadcast(&hook_cond);
        while (!hook_released) pthread_cond_wait(&hook_cond, &hook_lock);
        hook_blocked--;
    }
    pthread_mutex_unlock(&hook_lock);
    return mode == HOOK_FAIL ? -1 : 0;
}

static void hook_set(int mode) {
    pthread_mutex_lock(&hook_lock);
    hook_mode = mode;
    hook_released = false;
    hook_calls = 0;
    pthread_mutex_unlock(&hook_lock);
}

static void hook_release_all(void) {
    pthread_mutex_lock(&hook_lock);
    hook_released = true;
    pthread_cond_broadcast(&hook_cond);
    while (hook_blocked > 0) pthread_cond_wait(&hook_cond, &hook_lock);
    pthread_mutex_unlock(&hook_lock);
}

static int hook_blocked_now(void) {
    pthread_mutex_lock(&hook_lock);
    int n = hook_blocked;
    pthread_mutex_unlock(&hook_lock);
    return n;
}

/* ---- a server without HTTP ---- */
typedef struct rig {
    model *m;
    char *dir;
    engine *e;
    sched *s;
    serve_metrics *metrics;
} rig;

static void rig_open(rig *g, bool cache, bool disk, int wait_ms) {
    engine_config cfg = engine_default_config();
    cfg.n_threads = 2;
    cfg.cache.enabled = cache;
    if (disk) {
        cfg.cache.disk.path = g->dir;
        cfg.cache.disk.read_hook = read_hook;
    }
    g->e = test_open_engine(g->m, &cfg);
    ember_error err;
    sched_config sc = {2, 512, 8, 64, 0, 256, wait_ms};
    g->metrics = serve_metrics_create();
    g->s = sched_create(g->e, &sc, g->metrics, &err);
    if (g->s == NULL) fail_msg("sched_create: %s", err.msg);
}

static void rig_close(rig *g) {
    sched_free(g->s);
    serve_metrics_free(g->metrics);
    engine_free(g->e);
    g->s = NULL;
    g->e = NULL;
}

static sreq *submit(rig *g, const int32_t *prompt, int64_t n, int max_tokens) {
    sreq_params p;
    memset(&p, 0, sizeof p);
    p.prompt = malloc((size_t)n * sizeof(int32_t));
    memcpy(p.prompt, prompt, (size_t)n * sizeof(int32_t));
    p.n_prompt = n;
    p.max_tokens = max_tokens;
    p.sampling = sampler_default_params();
    p.sampling.temperature = 0.0f;
    p.top_logprobs = -1;
    p.ignore_eos = true;
    sreq *r = NULL;
    ember_error err;
    if (sched_submit(g->s, &p, &r, &err) != SCHED_OK) fail_msg("submit: %s", err.msg);
    return r;
}

typedef struct result {
    char text[4096];
    int64_t cached;
    double gap_p99_ms; /* inter-token gaps seen by the reader */
} result;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Reads r to the end (at most 60 s), recording the gap between deltas;
 * drops the submitter's reference. */
static void collect(sreq *r, result *out) {
    sreq_cursor cur;
    memset(&cur, 0, sizeof cur);
    size_t len = 0;
    double gaps[512], last = 0, t0 = ember_now();
    int n_gaps = 0;
    for (;;) {
        sreq_delta d;
        sreq_next(r, &cur, 1000, &d);
        double now = ember_now();
        if (d.len) {
            if (last > 0 && n_gaps < 512) gaps[n_gaps++] = (now - last) * 1e3;
            last = now;
            if (len + d.len < sizeof out->text) {
                memcpy(out->text + len, d.text, d.len);
                len += d.len;
            }
        }
        sreq_finish f = d.finish;
        sreq_delta_free(&d);
        if (f != SREQ_RUNNING) break;
        if (now - t0 > 60) fail_msg("a request did not finish within 60 s");
    }
    out->text[len] = 0;
    sreq_usage u;
    sreq_usage_get(r, &u);
    assert_string_equal(u.error, "");
    out->cached = u.cached_tokens;
    sreq_unref(r);
    qsort(gaps, (size_t)n_gaps, sizeof gaps[0], cmp_double);
    out->gap_p99_ms = n_gaps ? gaps[(n_gaps * 99) / 100 < n_gaps ? (n_gaps * 99) / 100 : n_gaps - 1] : 0;
}

static apc_stats stats(rig *g) {
    apc_stats s;
    apc_get_stats(engine_cache(g->e), &s);
    return s;
}

/* Every regular file under dir (one level of namespaces) becomes a FIFO. */
static int fifo_everything(const char *dir) {
    int n = 0;
    DIR *d = opendir(dir);
    if (d == NULL) return 0;
    struct dirent *de;
    char path[4096];
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        struct stat st;
        if (lstat(path, &st) < 0) continue;
        if (S_ISDIR(st.st_mode)) {
            n += fifo_everything(path);
        } else if (S_ISREG(st.st_mode)) {
            unlink(path);
            if (mkfifo(path, 0644) == 0) n++;
        }
    }
    closedir(d);
    return n;
}

typedef struct world {
    rig g;
    int32_t prompt[N_PROMPT], other[N_OTHER];
    result cold, cold_other;
} world;

static int setup(void **state) {
    world *w = calloc(1, sizeof *w);
    char cmd[1024];
    w->g.dir = make_temp_dir();
    snprintf(cmd, sizeof cmd, "%s mkmodel --arch qwen3 --preset tiny --seed 13 --out %s/m.gguf >/dev/null 2>&1",
             ember_binary(), w->g.dir);
    if (system(cmd) != 0) return -1;
    snprintf(cmd, sizeof cmd, "%s/m.gguf", w->g.dir);
    ember_error err;
    w->g.m = model_load(cmd, &err);
    if (w->g.m == NULL) return -1;
    uint64_t rng = 99;
    int V = model_get_hparams(w->g.m)->n_vocab;
    test_random_tokens(&rng, w->prompt, N_PROMPT, V);
    test_random_tokens(&rng, w->other, N_OTHER, V);
    /* the cold answers */
    rig_open(&w->g, false, false, 1000);
    collect(submit(&w->g, w->prompt, N_PROMPT, 8), &w->cold);
    collect(submit(&w->g, w->other, N_OTHER, 48), &w->cold_other);
    rig_close(&w->g);
    *state = w;
    return 0;
}

static int teardown(void **state) {
    world *w = *state;
    if (w == NULL) return 0;
    model_free(w->g.m);
    remove_tree(w->g.dir);
    free(w->g.dir);
    free(w);
    return 0;
}

/* A fresh disk directory holding the prompt's blocks; the rig is reopened
 * on it (memory empty: a restart), reading through the hook. */
static void warm_disk(world *w, const char *sub, int wait_ms) {
    char *dir = malloc(4096);
    snprintf(dir, 4096, "%s/%s", w->g.dir, sub);
    mkdir(dir, 0755);
    char *saved = w->g.dir;
    w->g.dir = dir;
    hook_set(HOOK_PASS);
    rig_open(&w->g, true, true, wait_ms);
    result r;
    collect(submit(&w->g, w->prompt, N_PROMPT, 8), &r);
    assert_string_equal(r.text, w->cold.text);
    apc_flush(engine_cache(w->g.e));
    assert_true(stats(&w->g).disk_writes > 0);
    rig_close(&w->g);
    rig_open(&w->g, true, true, wait_ms);
    w->g.dir = saved;
    free(dir);
}

/* The resend's shards became FIFOs after the restart indexed them. */
static void test_fifo_is_refused(void **state) {
    world *w = *state;
    warm_disk(w, "fifo", 1000);
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/fifo", w->g.dir);
    assert_true(fifo_everything(dir) > 0);
    double t0 = ember_now();
    result r;
    collect(submit(&w->g, w->prompt, N_PROMPT, 8), &r);
    printf("FIFO shard: resend answered in %.2f s, cached %lld, disk_corrupt %llu\n", ember_now() - t0,
           (long long)r.cached, (unsigned long long)stats(&w->g).disk_corrupt);
    assert_string_equal(r.text, w->cold.text);
    assert_int_equal(r.cached, 0);
    assert_true(stats(&w->g).disk_corrupt >= 1);
    rig_close(&w->g);
}

/* A read that hangs holds up its own request only: an unrelated request
 * decodes to the end while it is blocked, at the pace it has alone; once
 * the read lands, the resend is warm. */
static void test_hung_read_stalls_nobody_else(void **state) {
    world *w = *state;
    warm_disk(w, "slow", 60000);
    result alone;
    collect(submit(&w->g, w->other, N_OTHER, 48), &alone);
    assert_string_equal(alone.text, w->cold_other.text);
    hook_set(HOOK_BLOCK);
    sreq *resend = submit(&w->g, w->prompt, N_PROMPT, 8);
    pthread_mutex_lock(&hook_lock); /* the resend's read is now stuck */
    while (hook_blocked == 0) pthread_cond_wait(&hook_cond, &hook_lock);
    pthread_mutex_unlock(&hook_lock);
    result other;
    collect(submit(&w->g, w->other, N_OTHER, 48), &other);
    int still_blocked = hook_blocked_now();
    hook_release_all();
    result r;
    collect(resend, &r);
    printf("hung read: the other request's p99 inter-token gap %.2f ms (alone %.2f ms), finished while the read "
           "was blocked: %s; the resend, once its read landed: cached %lld\n",
           other.gap_p99_ms, alone.gap_p99_ms, still_blocked ? "yes" : "no", (long long)r.cached);
    assert_int_equal(still_blocked, 1);
    assert_string_equal(other.text, w->cold_other.text);
    assert_string_equal(r.text, w->cold.text);
    assert_true(r.cached > 0);
    assert_int_equal(sched_disk_deadline_misses(w->g.s), 0);
    rig_close(&w->g);
}

/* A read that outlives its deadline: the request proceeds with what
 * memory holds (cold here), counted; the read finishes on its own. */
static void test_read_deadline(void **state) {
    world *w = *state;
    warm_disk(w, "deadline", 300);
    hook_set(HOOK_BLOCK);
    double t0 = ember_now();
    result r;
    collect(submit(&w->g, w->prompt, N_PROMPT, 8), &r);
    double took = ember_now() - t0;
    printf("read past its deadline (300 ms): answered in %.2f s, cached %lld, deadline misses %llu\n", took,
           (long long)r.cached, (unsigned long long)sched_disk_deadline_misses(w->g.s));
    assert_int_equal(hook_blocked_now(), 1);
    assert_string_equal(r.text, w->cold.text);
    assert_int_equal(r.cached, 0);
    assert_int_equal(sched_disk_deadline_misses(w->g.s), 1);
    hook_release_all(); /* the fetch thread must end before the engine */
    rig_close(&w->g);
}

/* An injected read error: a counted miss, the file stays. */
static void test_read_error_is_a_miss(void **state) {
    world *w = *state;
    warm_disk(w, "eio", 1000);
    hook_set(HOOK_FAIL);
    result r;
    collect(submit(&w->g, w->prompt, N_PROMPT, 8), &r);
    apc_stats s = stats(&w->g);
    printf("read error: cached %lld, disk_read_errors %llu, disk_corrupt %llu, files %llu\n", (long long)r.cached,
           (unsigned long long)s.disk_read_errors, (unsigned long long)s.disk_corrupt,
           (unsigned long long)s.disk_files);
    assert_string_equal(r.text, w->cold.text);
    assert_int_equal(r.cached, 0);
    assert_true(s.disk_read_errors >= 1);
    assert_int_equal(s.disk_corrupt, 0);
    assert_true(s.disk_files > 0);
    /* the disk is fine again: the next resend is warm from it */
    hook_set(HOOK_PASS);
    collect(submit(&w->g, w->prompt, N_PROMPT, 8), &r);
    assert_string_equal(r.text, w->cold.text);
    assert_true(r.cached > 0);
    rig_close(&w->g);
}

int main(void) {
    if (ember_binary() == NULL) {
        printf("skipping: EMBER_BIN is not set (run under ctest)\n");
        return 0;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fifo_is_refused),
        cmocka_unit_test(test_hung_read_stalls_nobody_else),
        cmocka_unit_test(test_read_deadline),
        cmocka_unit_test(test_read_error_is_a_miss),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
