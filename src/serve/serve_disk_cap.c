/* serve_disk_cap.c - the SSD tier's default size cap (see serve_disk_cap.h).
 *
 * Why a quarter of the free space, at most 50 GB: the cache is rebuilt from
 * nothing by serving, so it must never be what fills a disk (a full disk
 * stops logs, model downloads and everything else on the machine, while the
 * cache itself only backs off). A quarter of what is free at start-up
 * leaves three quarters to everything else, also when several servers
 * start one after another on the same disk (each takes a quarter of what
 * the previous ones left: 4 servers together stay under 69% of the free
 * space). The 50 GB ceiling is the per-model size the reference server
 * scaffolds for its disk tier; beyond it a big disk gains little (tens of
 * thousands of prompts of a 7B model) and a restart's index scan grows. */
#include "serve/serve_disk_cap.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/statvfs.h>

uint64_t serve_disk_cap_default(uint64_t free_bytes) {
    uint64_t cap = free_bytes / 100 * SERVE_DISK_CAP_PERCENT + free_bytes % 100 * SERVE_DISK_CAP_PERCENT / 100;
    return cap < SERVE_DISK_CAP_CEILING ? cap : SERVE_DISK_CAP_CEILING;
}

int serve_disk_free_bytes(const char *path, uint64_t *free_bytes, ember_error *err) {
    char probe[4096];
    snprintf(probe, sizeof probe, "%s", path && path[0] ? path : ".");
    for (;;) {
        struct statvfs vfs;
        if (statvfs(probe, &vfs) == 0) {
            *free_bytes = (uint64_t)vfs.f_bavail * (uint64_t)vfs.f_frsize;
            return 0;
        }
        if (errno != ENOENT && errno != ENOTDIR)
            return ember_fail(err, "cannot read the free space of %s: %s", probe, strerror(errno));
        /* Not created yet: climb to the parent that exists. */
        char *slash = strrchr(probe, '/');
        if (slash == NULL) snprintf(probe, sizeof probe, ".");
        else if (slash == probe) probe[1] = '\0';
        else *slash = '\0';
    }
}

static void fmt_gb(char *out, size_t cap, uint64_t bytes) { snprintf(out, cap, "%.2f GB", (double)bytes / 1e9); }

uint64_t serve_disk_cap_resolve(double max_gb, const char *path, char *why, size_t why_cap) {
    char a[32], b[32];
    if (max_gb > 0) {
        uint64_t cap = (uint64_t)(max_gb * 1e9);
        fmt_gb(a, sizeof a, cap);
        snprintf(why, why_cap, "cap=%s (cache.disk.max_gb)", a);
        return cap;
    }
    if (max_gb == 0) {
        snprintf(why, why_cap, "cap=unbounded (cache.disk.max_gb: 0)");
        return 0;
    }
    uint64_t free_bytes = 0;
    ember_error err;
    if (serve_disk_free_bytes(path, &free_bytes, &err) < 0) {
        /* Without a measure, only the ceiling bounds it. */
        fmt_gb(a, sizeof a, SERVE_DISK_CAP_CEILING);
        snprintf(why, why_cap, "cap=%s (the ceiling: %s)", a, err.msg);
        return SERVE_DISK_CAP_CEILING;
    }
    uint64_t cap = serve_disk_cap_default(free_bytes);
    fmt_gb(a, sizeof a, cap);
    fmt_gb(b, sizeof b, free_bytes);
    snprintf(why, why_cap, "cap=%s (%d%% of %s free, at most %.0f GB; cache.disk.max_gb overrides)", a,
             SERVE_DISK_CAP_PERCENT, b, SERVE_DISK_CAP_CEILING / 1e9);
    return cap;
}
