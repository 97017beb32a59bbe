/* bench_disk.c - restore from the SSD tier vs cold prefill.
 *
 * Usage: bench_disk MODEL [--threads N] [--sizes 1024,4096] [--dir DIR] [--mode direct|mmap]
 *                         [--tier block|exact]
 *
 * For each prompt length P (random token ids, one generated token):
 *   cold   the request on an engine whose cache and disk are empty: full
 *          prefill; its stores go to disk (the engine is then freed, which
 *          lets the queued writes land);
 *   disk   a new engine on the same directory, its page cache for the
 *          namespace dropped (posix_fadvise DONTNEED), sends the identical
 *          request: P-1 tokens come from disk, one is forwarded.
 * Reported: TTFT of both and their ratio, bytes restored (K/V rows of P-1
 * tokens), and the effective read bandwidth (restored bytes over the time
 * the lookup took) next to what `dd` reads from the same files after the
 * same cache drop (BENCH_DISK_HOT=1 keeps the page cache, to see the CPU
 * side of a restore alone). Meant for a Qwen3-0.6B-shape Q8_0 model from
 * `ember mkmodel --arch qwen3 --preset qwen3-0.6b --type q8_0`. */
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "core/clock.h"
#include "core/log.h"
#include "engine/engine.h"
#include "serve/serve_settings.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static engine *open_engine(const model *m, int threads, const char *dir, apc_disk_read mode, apc_force tier,
                           int n_ctx) {
    engine_config cfg = engine_default_config();
    ember_error err;
    /* The EMBER_APC_* switches first: what the bench sets below wins. */
    if (serve_settings_apply_env_cache(&cfg.cache, &err) < 0) {
        fprintf(stderr, "bench_disk: %s\n", err.msg);
        return NULL;
    }
    cfg.n_threads = threads;
    cfg.n_ctx = n_ctx;
    cfg.num_blocks = (int32_t)(n_ctx / KV_BLOCK_TOKENS + 8);
    cfg.cache.force_tier = tier;
    cfg.cache.disk.path = dir;
    cfg.cache.disk.read_mode = mode;
    cfg.cache.exact_max_bytes = (size_t)64 << 30;
    engine *e = engine_create(m, &cfg, &err);
    if (e == NULL) fprintf(stderr, "engine_create: %s\n", err.msg);
    return e;
}

static int generate(engine *e, const int32_t *prompt, int64_t n, engine_result *r) {
    engine_request q = engine_default_request();
    q.prompt = prompt;
    q.n_prompt = n;
    q.max_tokens = 1;
    q.stop_at_eog = false;
    ember_error err;
    if (engine_generate(e, &q, r, &err) < 0) {
        fprintf(stderr, "engine_generate: %s\n", err.msg);
        return -1;
    }
    return 0;
}

/* Drops the page cache of every file in dir; returns their total size. */
static uint64_t drop_cache(const char *dir) {
    DIR *d = opendir(dir);
    uint64_t total = 0;
    if (d == NULL) return 0;
    struct dirent *de;
    char p[4096];
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.') continue;
        snprintf(p, sizeof p, "%s/%s", dir, de->d_name);
        int fd = open(p, O_RDONLY);
        if (fd < 0) continue;
        struct stat st;
        if (fstat(fd, &st) == 0) total += (uint64_t)st.st_size;
        fdatasync(fd);
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        close(fd);
    }
    closedir(d);
    return total;
}

/* dd over every file in dir (after a cache drop): bytes per second. */
static double dd_bandwidth(const char *dir) {
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "for f in %s/*.apc; do dd if=\"$f\" of=/dev/null bs=8M 2>/dev/null; done", dir);
    uint64_t bytes = drop_cache(dir);
    double t0 = ember_now();
    if (system(cmd) != 0) return 0;
    double dt = ember_now() - t0;
    return dt > 0 ? (double)bytes / dt : 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_disk MODEL [--threads N] [--sizes 1024,4096] [--dir DIR] [--mode direct|mmap] "
                        "[--tier block|exact]\n");
        return 2;
    }
    const char *path = argv[1];
    int threads = 0;
    const char *sizes = "1024,4096";
    const char *root = NULL;
    apc_disk_read mode = APC_DISK_READ_DIRECT;
    apc_force tier = APC_FORCE_BLOCK;
    bool hot = getenv("BENCH_DISK_HOT") != NULL; /* keep the page cache: the CPU side of a restore */
    for (int i = 2; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--threads") == 0) threads = atoi(argv[i + 1]);
        else if (strcmp(argv[i], "--sizes") == 0) sizes = argv[i + 1];
        else if (strcmp(argv[i], "--dir") == 0) root = argv[i + 1];
        else if (strcmp(argv[i], "--mode") == 0) mode = strcmp(argv[i + 1], "mmap") == 0 ? APC_DISK_READ_MMAP : APC_DISK_READ_DIRECT;
        else if (strcmp(argv[i], "--tier") == 0) tier = strcmp(argv[i + 1], "exact") == 0 ? APC_FORCE_EXACT : APC_FORCE_BLOCK;
    }
    char tmpl[] = "/var/tmp/ember-bench-disk-XXXXXX";
    if (root == NULL) root = mkdtemp(tmpl);
    if (root == NULL) return 1;
    ember_log_set_level(EMBER_LOG_WARN);
    ember_error err;
    model *m = model_load(path, &err);
    if (m == NULL) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    int V = model_get_hparams(m)->n_vocab;
    printf("%-7s %-6s %10s %10s %8s %10s %10s %10s %8s\n", "tokens", "tier", "cold_ttft", "disk_ttft", "ratio",
           "restored", "read_GB/s", "dd_GB/s", "read/dd");
    for (const char *s = sizes; *s;) {
        int64_t n = strtoll(s, NULL, 10);
        const char *comma = strchr(s, ',');
        s = comma ? comma + 1 : s + strlen(s);
        if (n < 2) continue;
        char sub[4200];
        snprintf(sub, sizeof sub, "%s/n%lld", root, (long long)n);
        mkdir(sub, 0755);
        int32_t *prompt = malloc((size_t)n * sizeof(int32_t));
        for (int64_t i = 0; i < n; i++) prompt[i] = (int32_t)(rnd() % (uint32_t)V);
        int n_ctx = (int)n + 64;

        engine *e = open_engine(m, threads, sub, mode, tier, n_ctx);
        if (e == NULL) return 1;
        engine_result cold, warm;
        if (generate(e, prompt, n, &cold) < 0) return 1;
        apc_stats st;
        apc_get_stats(engine_cache(e), &st);
        char nsdir[4400];
        snprintf(nsdir, sizeof nsdir, "%s/%s", sub, st.disk_namespace);
        engine_free(e); /* the queued writes land */

        drop_cache(nsdir);
        e = open_engine(m, threads, sub, mode, tier, n_ctx);
        if (e == NULL) return 1;
        if (!hot) drop_cache(nsdir);
        struct timespec c0, c1;
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
        if (generate(e, prompt, n, &warm) < 0) return 1;
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
        double cpu = (double)(c1.tv_sec - c0.tv_sec) + 1e-9 * (double)(c1.tv_nsec - c0.tv_nsec);
        apc_get_stats(engine_cache(e), &st);
        kv_pool_config kc;
        model_kv_config(m, 1, &kc);
        size_t row = 0;
        for (int l = 0; l < kc.n_layer; l++) row += (size_t)kc.k_width[l] + (size_t)kc.v_width[l];
        double restored = (double)warm.cached_tokens * (double)row * sizeof(float);
        /* The lookup is the first part of cache_s; the stores after it find
         * everything already indexed, so cache_s bounds the read time. */
        double read_bw = warm.cache_s > 0 ? restored / warm.cache_s : 0;
        engine_free(e);
        double dd = dd_bandwidth(nsdir);
        printf("%-7lld %-6s %9.3fs %9.3fs %7.1fx %8.1fMB %10.2f %10.2f %8.2f   (cached %lld, disk_hits %llu, "
               "lookup+stores %.3fs, warm request cpu %.3fs)\n",
               (long long)n, tier == APC_FORCE_EXACT ? "exact" : "block", cold.ttft_s, warm.ttft_s,
               warm.ttft_s > 0 ? cold.ttft_s / warm.ttft_s : 0, restored / 1e6, read_bw / 1e9, dd / 1e9,
               dd > 0 ? read_bw / dd : 0, (long long)warm.cached_tokens, (unsigned long long)st.disk_hits,
               warm.cache_s, cpu);
        fflush(stdout);
        engine_result_free(&cold);
        engine_result_free(&warm);
        free(prompt);
    }
    model_free(m);
    if (root == tmpl) {
        char cmd[200];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmpl);
        if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", tmpl);
    }
    return 0;
}
