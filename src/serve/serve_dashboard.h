/* serve_dashboard.h - the live cache dashboard page served at GET / and
 * /dashboard.
 *
 * Contract: the bytes of src/serve/dashboard.html, turned into a C array at
 * build time (cmake/embed_file.cmake), so the binary needs no file at run
 * time and the page no network: plain JavaScript and inline SVG that poll
 * /v1/cache/stats, /metrics and /v1/cache/recent on the same server, sending
 * the API key (asked for on the page, or given as #key=KEY in the URL) as
 * "Authorization: Bearer KEY". */
#ifndef EMBER_SERVE_DASHBOARD_H
#define EMBER_SERVE_DASHBOARD_H

#include <stddef.h>

/* ---- Data ---- */
extern const unsigned char serve_dashboard_html[];
extern const size_t serve_dashboard_html_len;

#endif
