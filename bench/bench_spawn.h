/* bench_spawn.h - starting `ember serve` for the serving benchmarks.
 *
 * Both bench_serve and bench_load run the server as a child on port 0 and
 * learn the port from its "listening on" log line; this is that one
 * routine. Header-only because the benchmarks are single-file programs. */
#ifndef EMBER_BENCH_SPAWN_H
#define EMBER_BENCH_SPAWN_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

/* Forks argv (argv[0] is the ember binary) with stderr to log_path, then
 * waits up to 30 s for the port it listens on. Returns the port, or -1 when
 * the server exited or never said where it listens. *pid gets the child. */
static int bench_spawn_server(char *const argv[], const char *log_path, pid_t *pid) {
    *pid = fork();
    if (*pid == 0) {
        if (freopen(log_path, "w", stderr) == NULL) _exit(127);
        execv(argv[0], argv);
        _exit(127);
    }
    const char *marker = "listening on http://127.0.0.1:";
    for (int i = 0; i < 600; i++) {
        FILE *f = fopen(log_path, "r");
        char line[512];
        while (f && fgets(line, sizeof line, f)) {
            const char *p = strstr(line, marker);
            if (p) {
                fclose(f);
                return atoi(p + strlen(marker));
            }
        }
        if (f) fclose(f);
        int st;
        if (waitpid(*pid, &st, WNOHANG) == *pid) break;
        usleep(50000);
    }
    return -1;
}

#endif
