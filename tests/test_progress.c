/* test_progress.c - progress where work is long.
 *
 * Terminal-only output is checked on a real pseudo-terminal: util-linux's
 * `script` runs the command with a pty as its stdin/stdout/stderr, and the
 * same command through a pipe must print no progress at all.
 *  - `ember run` with a prompt spanning several prefill chunks (--batch 16)
 *    redraws "ember: prefill D/N tokens" with D growing, then clears it;
 *  - `ember mkmodel` of a preset over 8 MiB of weights (small, f32) shows
 *    "weights ... (P%)" up to 100%;
 *  - `ember serve` with an SSD tier logs the index rebuild at start-up, with
 *    the number of files it reads back. */
#define _GNU_SOURCE
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "http_client.h"
#include "test_util.h"

static bool have_script(void) {
    char *out;
    int rc = run_capture("script -qec true /dev/null >/dev/null 2>&1; echo $?", &out);
    bool ok = rc == 0 && strncmp(out, "0", 1) == 0;
    free(out);
    return ok;
}

/* Runs cmd on a pseudo-terminal; returns everything it wrote there. */
static void on_tty(const char *cmd, char **out) {
    char wrapped[4096];
    snprintf(wrapped, sizeof wrapped, "script -qec \"%s\" /dev/null", cmd);
    assert_int_equal(run_capture(wrapped, out), 0);
}

static void test_run_prefill_progress(void **state) {
    (void)state;
    if (!have_script() || build_dir() == NULL) {
        print_message("skipping: util-linux script or EMBER_BUILD_DIR missing\n");
        skip();
    }
    char cmd[2048], *out;
    const char *prompt =
        "the quick brown fox jumps over the lazy dog and then runs back again across the field to the river "
        "where it drinks some water and rests in the shade of a tall tree for the afternoon";
    snprintf(cmd, sizeof cmd, "%s run %s/models/default.gguf -p '%s' -n 2 --batch 16 --threads 2", ember_binary(),
             build_dir(), prompt);
    on_tty(cmd, &out);
    const char *first = strstr(out, "ember: prefill 16/");
    if (first == NULL) fail_msg("no prefill progress on the terminal:\n%s", out);
    assert_non_null(strstr(first + 1, "ember: prefill 32/"));
    assert_non_null(strstr(out, "\033[K")); /* the line is cleared before the reply */
    free(out);
    char piped[2200];
    snprintf(piped, sizeof piped, "%s 2>&1 | cat", cmd);
    assert_int_equal(run_capture(piped, &out), 0);
    assert_null(strstr(out, "ember: prefill 16/"));
    assert_non_null(strstr(out, "ember: prefill ")); /* the final throughput line stays */
    free(out);
}

static void test_mkmodel_progress(void **state) {
    (void)state;
    if (!have_script()) skip();
    char *dir = make_temp_dir(), cmd[2048], *out;
    snprintf(cmd, sizeof cmd, "%s mkmodel --arch qwen3 --preset small --type f32 --out %s/m.gguf", ember_binary(), dir);
    on_tty(cmd, &out);
    if (strstr(out, "ember mkmodel: weights") == NULL) fail_msg("no progress on the terminal:\n%s", out);
    assert_non_null(strstr(out, "(100%)"));
    free(out);
    char piped[2200];
    snprintf(piped, sizeof piped, "%s 2>&1 | cat", cmd);
    assert_int_equal(run_capture(piped, &out), 0);
    assert_null(strstr(out, "ember mkmodel: weights"));
    assert_non_null(strstr(out, "wrote "));
    free(out);
    remove_tree(dir);
    free(dir);
}

static void test_disk_rebuild_logged(void **state) {
    (void)state;
    if (build_dir() == NULL || ember_binary() == NULL) skip();
    char *dir = make_temp_dir(), cfg[600], log[600], model[700];
    snprintf(model, sizeof model, "%s/models/default.gguf", build_dir());
    snprintf(cfg, sizeof cfg, "%s/ember.yaml", dir);
    FILE *f = fopen(cfg, "w");
    fprintf(f, "cache:\n  disk:\n    path: %s/ssd\n", dir);
    fclose(f);
    char *extra[] = {(char *)"--config", cfg, NULL};
    pid_t srv_pid = 0;
    int srv_port;
    snprintf(log, sizeof log, "%s/first.log", dir);
    srv_port = http_spawn_ember(ember_binary(), model, extra, log, &srv_pid);
    assert_true(srv_port > 0);
    char *body;
    assert_int_equal(http_call(srv_port, "POST", "/v1/completions", NULL,
                               "{\"prompt\":\"a prompt long enough to fill a few blocks of sixteen tokens each, "
                               "so the SSD tier gets something to write\",\"max_tokens\":4}",
                               &body),
                     200);
    free(body);
    assert_int_equal(http_stop_server(&srv_pid, 10000), 0);
    char *text = read_whole_file(log, NULL);
    assert_null(strstr(text, "rebuilding the index")); /* an empty tier has nothing to read back */
    free(text);
    snprintf(log, sizeof log, "%s/second.log", dir);
    srv_port = http_spawn_ember(ember_binary(), model, extra, log, &srv_pid);
    assert_true(srv_port > 0);
    assert_int_equal(http_stop_server(&srv_pid, 10000), 0);
    text = read_whole_file(log, NULL);
    const char *line = strstr(text, "APC disk: rebuilding the index of ");
    if (line == NULL) fail_msg("no rebuild line in:\n%s", text);
    long files = 0;
    const char *from = strstr(line, " from ");
    assert_non_null(from);
    files = strtol(from + 6, NULL, 10);
    assert_true(files >= 1);
    free(text);
    remove_tree(dir);
    free(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_run_prefill_progress),
        cmocka_unit_test(test_mkmodel_progress),
        cmocka_unit_test(test_disk_rebuild_logged),
    };
    return test_run_group(tests, NULL, NULL);
}
