/* http_client.h - a loopback HTTP/1.1 client and an `ember serve` launcher,
 * shared by the tests (test_serve) and the serving benchmarks (bench_serve,
 * bench_load).
 *
 * Contract:
 * - Every request is one connection with "Connection: close"; a response is
 *   read until the server closes it. Nothing here keeps global state, so any
 *   number of threads may use it at once (no strtok, no static buffers).
 * - A connection may carry a send/receive timeout: a server that stalls makes
 *   the read end with `stalled` set instead of hanging the caller.
 * - Chunked bodies are decoded strictly: the decoded prefix is always
 *   returned, `complete` says whether the framing was intact up to the final
 *   zero-length chunk.
 * - A spawned server dies with the thread that spawned it (PR_SET_PDEATHSIG,
 *   SIGKILL): a test killed by its timeout or by SIGKILL leaves no server
 *   behind. Spawn from the thread that lives as long as the server (main).
 *
 * API:
 *   connections  http_connect, http_send_all, http_send_request
 *   responses    http_read_all, http_dechunk, http_parse_response, http_resp_free
 *   one call     http_request, http_call
 *   servers      http_spawn_server, http_spawn_ember, http_stop_server
 */
#ifndef EMBER_HTTP_CLIENT_H
#define EMBER_HTTP_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

/* A parsed response. status is -1 when nothing parseable came back (no
 * connection, a stall, or no header block). body is NUL-terminated. */
typedef struct http_resp {
    int status;
    char *headers;     /* the status line and headers, without the blank line */
    char *body;        /* de-chunked when Transfer-Encoding: chunked */
    size_t len;
    bool stalled;      /* the receive timeout expired or the read failed */
    bool complete;     /* chunked framing intact to the end (true when not chunked) */
} http_resp;

/* A TCP connection to 127.0.0.1:port with send and receive timeouts of
 * timeout_s seconds (0: none); -1 when it cannot connect. */
int http_connect(int port, int timeout_s);

/* Writes all n bytes (MSG_NOSIGNAL); false when the peer is gone. */
bool http_send_all(int fd, const char *p, size_t n);

/* Connects and sends "METHOD path HTTP/1.1" with Host and Connection: close,
 * the extra header lines (each ending in \r\n, or NULL), and when body is
 * not NULL a JSON Content-Type, Content-Length and the len bytes of body.
 * Returns the connected socket to read the response from, or -1. */
int http_send_request(int port, const char *method, const char *path, const char *extra_headers,
                      const char *body, size_t len, int timeout_s);

/* Reads until the peer closes the connection. The result is malloc'd and
 * NUL-terminated; *stalled is set when the read ended on a timeout or an
 * error rather than an orderly close (stalled may be NULL). */
char *http_read_all(int fd, size_t *n, bool *stalled);

/* Decodes a chunked body of n bytes: a malloc'd, NUL-terminated copy of the
 * data (*out_n bytes) decoded up to the end or the first framing error;
 * *complete is true only when every chunk was well formed and the final
 * zero-length chunk with its CRLF was there. */
char *http_dechunk(const char *b, size_t n, size_t *out_n, bool *complete);

/* Splits raw response bytes into status, headers and body (de-chunked). */
void http_parse_response(const char *raw, size_t n, http_resp *out);
void http_resp_free(http_resp *r);

/* One request, read and parsed. timeout_s bounds each send and each wait for
 * bytes (0: none). status is -1 when the connection failed. */
http_resp http_request(int port, const char *method, const char *path, const char *extra_headers,
                       const char *body, int timeout_s);

/* http_request, reduced to the status (-1: no connection) and a malloc'd
 * copy of the body ("" when none) in *body, with a 120 s timeout. */
int http_call(int port, const char *method, const char *path, const char *extra_headers, const char *req_body,
              char **body);

/* Starts argv (argv[0] is the ember binary, argv[1] "serve", with --port 0)
 * with stderr written to log_path, and waits up to wait_s seconds for its
 * "listening on http://127.0.0.1:PORT" line. Returns the port, or -1 when
 * the server exited or never said where it listens (the child is then
 * reaped or killed). *pid gets the child (0 after a failure). The child gets
 * PR_SET_PDEATHSIG(SIGKILL): it is killed when the calling thread ends. */
int http_spawn_server(char *const argv[], const char *log_path, int wait_s, pid_t *pid);

/* http_spawn_server of `BIN serve MODEL --port 0 --threads 2 EXTRA...`
 * (extra: NULL-terminated, or NULL), waiting up to 30 s. Returns the port or -1. */
int http_spawn_ember(const char *bin, const char *model_path, char *const extra[], const char *log_path, pid_t *pid);

/* SIGTERM, then up to grace_ms for the server to exit, then SIGKILL.
 * Returns its exit status (128 + signal when a signal ended it), or -1 when
 * it had to be killed or *pid was not a running child; *pid becomes 0. */
int http_stop_server(pid_t *pid, int grace_ms);

#endif
