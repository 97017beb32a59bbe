/* serve_disk_cap.h - the default size cap of the prompt cache's SSD tier.
 *
 * Contract:
 *  - cache.disk.max_gb (APC_DISK_MAX_GB, --disk-max-gb) decides: > 0 is
 *    that many GB (10^9 bytes), 0 is unbounded (the reference server's
 *    meaning), and `auto` (SERVE_DISK_CAP_AUTO, the settings table's
 *    default) is computed here at start-up:
 *    SERVE_DISK_CAP_PERCENT of the space free on the cache's filesystem, at
 *    most SERVE_DISK_CAP_CEILING bytes. The cache directory may not exist
 *    yet: the free space is that of its nearest existing parent.
 *  - The computation is a pure function of the free bytes, so it is tested
 *    without a small filesystem; statvfs only feeds it.
 *  - The cap is handed to the cache as apc_disk_config.max_bytes; the SSD
 *    tier evicts oldest files to 90% of it after a write. */
#ifndef EMBER_SERVE_DISK_CAP_H
#define EMBER_SERVE_DISK_CAP_H

#include <stddef.h>
#include <stdint.h>

#include "core/error.h"

#define SERVE_DISK_CAP_AUTO (-1.0)
#define SERVE_DISK_CAP_PERCENT 25
#define SERVE_DISK_CAP_CEILING 50000000000ull /* 50 GB */

/* ---- API ---- */
/* SERVE_DISK_CAP_PERCENT of free_bytes, at most the ceiling. */
uint64_t serve_disk_cap_default(uint64_t free_bytes);
/* Bytes an unprivileged user may still write on path's filesystem (or its
 * nearest existing parent's). */
int serve_disk_free_bytes(const char *path, uint64_t *free_bytes, ember_error *err);
/* The cap for cache.disk.max_gb = max_gb at path (0: unbounded), and in
 * `why` (cap bytes) how it was chosen, for the start-up log line. */
uint64_t serve_disk_cap_resolve(double max_gb, const char *path, char *why, size_t why_cap);

#endif
