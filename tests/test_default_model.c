/* test_default_model.c - the model a new user meets first.
 *
 * models/stories260K.gguf is shipped in the repository as the default of
 * `make run` and `make generate`. This test proves what the README shows:
 *  - the shipped file is the one its SHA256SUMS names, and byte for byte the
 *    fixture copy (whose checksum is published in the fixtures' SHA256SUMS);
 *  - `ember run` on it writes the golden greedy continuation (English);
 *  - `ember serve` on it answers /v1/completions with that text, and a second
 *    identical request reports N-1 cached prompt tokens and the same text;
 *  - /v1/chat/completions works through the ChatML fallback template (the
 *    model has none), answering 200 with a chat.completion. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <openssl/evp.h>

#include "http_client.h"
#include "test_util.h"

static const char *shipped_model(char *buf, size_t cap) {
    const char *src = getenv("EMBER_SOURCE_DIR");
    if (src == NULL) return NULL;
    snprintf(buf, cap, "%s/models/stories260K.gguf", src);
    return buf;
}

static void sha256_hex(const void *data, size_t n, char out[65]) {
    unsigned char md[32];
    unsigned int len = 0;
    EVP_Digest(data, n, md, &len, EVP_sha256(), NULL);
    for (int i = 0; i < 32; i++) sprintf(out + 2 * i, "%02x", md[i]);
}

/* The checksum that `sums` (sha256sum output) lists for a file named name. */
static int sum_for(const char *sums, const char *name, char out[65]) {
    for (const char *p = sums; p && *p;) {
        const char *eol = strchr(p, '\n');
        size_t n = eol ? (size_t)(eol - p) : strlen(p);
        const char *sp = memchr(p, ' ', n);
        if (sp && sp - p == 64) {
            const char *f = sp;
            while (f < p + n && (*f == ' ' || *f == '*')) f++;
            if (strncmp(f, "./", 2) == 0) f += 2;
            if ((size_t)(p + n - f) == strlen(name) && strncmp(f, name, strlen(name)) == 0) {
                memcpy(out, p, 64);
                out[64] = 0;
                return 0;
            }
        }
        p = eol ? eol + 1 : NULL;
    }
    return -1;
}

/* The golden greedy text of `prompt` from golden/greedy.jsonl (malloc'd). */
static char *golden_text(const char *golden_path, const char *prompt) {
    char *all = read_whole_file(golden_path, NULL);
    assert_non_null(all);
    char *found = NULL;
    for (char *line = strtok(all, "\n"); line && !found; line = strtok(NULL, "\n")) {
        cJSON *j = cJSON_Parse(line);
        if (j == NULL) continue;
        const cJSON *m = cJSON_GetObjectItem(j, "model"), *p = cJSON_GetObjectItem(j, "prompt"),
                    *t = cJSON_GetObjectItem(j, "text");
        if (cJSON_IsString(m) && strcmp(m->valuestring, "stories260K.gguf") == 0 && cJSON_IsString(p) &&
            strcmp(p->valuestring, prompt) == 0 && cJSON_IsString(t))
            found = strdup(t->valuestring);
        cJSON_Delete(j);
    }
    free(all);
    assert_non_null(found);
    return found;
}

static void test_shipped_file_is_the_published_one(void **state) {
    (void)state;
    char path[1024];
    if (shipped_model(path, sizeof path) == NULL) {
        print_message("skipping: EMBER_SOURCE_DIR is not set (run under ctest)\n");
        skip();
    }
    size_t n;
    void *bytes = read_whole_file(path, &n);
    assert_non_null(bytes);
    char got[65], listed[65], sums_path[1100];
    sha256_hex(bytes, n, got);
    snprintf(sums_path, sizeof sums_path, "%s/models/SHA256SUMS", getenv("EMBER_SOURCE_DIR"));
    char *sums = read_whole_file(sums_path, NULL);
    assert_non_null(sums);
    assert_int_equal(sum_for(sums, "stories260K.gguf", listed), 0);
    assert_string_equal(got, listed);
    free(sums);
    REQUIRE_FIXTURE(fix_sums_path, "models/SHA256SUMS");
    char *fix_sums = read_whole_file(fix_sums_path, NULL);
    assert_int_equal(sum_for(fix_sums, "stories260K.gguf", listed), 0);
    assert_string_equal(got, listed);
    free(fix_sums);
    free(bytes);
}

static void test_run_writes_english(void **state) {
    (void)state;
    char path[1024];
    const char *bin = ember_binary();
    if (shipped_model(path, sizeof path) == NULL || bin == NULL) skip();
    REQUIRE_FIXTURE(golden, "models/golden/greedy.jsonl");
    char *want = golden_text(golden, "Once upon a time");
    char cmd[2300], *out;
    snprintf(cmd, sizeof cmd, "%s run %s -p 'Once upon a time' -n 32 --threads 2 2>/dev/null", bin, path);
    assert_int_equal(run_capture(cmd, &out), 0);
    if (strstr(out, want) == NULL) fail_msg("ember run wrote '%s', golden is '%s'", out, want);
    free(out);
    free(want);
}

static cJSON *post(int port, const char *path, const char *body) {
    char *resp;
    int status = http_call(port, "POST", path, NULL, body, &resp);
    if (status != 200) fail_msg("POST %s: %d %s", path, status, resp);
    cJSON *j = cJSON_Parse(resp);
    free(resp);
    assert_non_null(j);
    return j;
}

static double usage_of(const cJSON *j, const char *key) {
    const cJSON *u = cJSON_GetObjectItem(j, "usage");
    if (strcmp(key, "cached_tokens") == 0) u = cJSON_GetObjectItem(u, "prompt_tokens_details");
    const cJSON *v = cJSON_GetObjectItem(u, key);
    assert_true(cJSON_IsNumber(v));
    return v->valuedouble;
}

static void test_serve_english_then_warm(void **state) {
    (void)state;
    char path[1024];
    if (shipped_model(path, sizeof path) == NULL || ember_binary() == NULL) skip();
    REQUIRE_FIXTURE(golden, "models/golden/greedy.jsonl");
    char *want = golden_text(golden, "Once upon a time");
    char *dir = make_temp_dir(), log[600];
    snprintf(log, sizeof log, "%s/serve.log", dir);
    pid_t srv_pid = 0;
    int srv_port;
    srv_port = http_spawn_ember(ember_binary(), path, NULL, log, &srv_pid);
    assert_true(srv_port > 0);
    const char *body = "{\"prompt\":\"Once upon a time\",\"max_tokens\":32,\"temperature\":0}";
    cJSON *cold = post(srv_port, "/v1/completions", body);
    cJSON *warm = post(srv_port, "/v1/completions", body);
    const char *t1 = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(cold, "choices"), 0), "text")->valuestring;
    const char *t2 = cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(warm, "choices"), 0), "text")->valuestring;
    /* the API's text has no BOS-induced leading space; the golden text does */
    if (strstr(want, t1) == NULL) fail_msg("served '%s', golden '%s'", t1, want);
    assert_string_equal(t1, t2);
    double n = usage_of(cold, "prompt_tokens");
    assert_true(n >= 2);
    assert_true(usage_of(cold, "cached_tokens") == 0);
    assert_true(usage_of(warm, "cached_tokens") == n - 1);
    cJSON_Delete(cold);
    cJSON_Delete(warm);
    /* no template in the file: chat goes through the ChatML fallback */
    cJSON *chat = post(srv_port, "/v1/chat/completions",
                       "{\"messages\":[{\"role\":\"user\",\"content\":\"Tell me a story.\"}],\"max_tokens\":8}");
    assert_string_equal(cJSON_GetObjectItem(chat, "object")->valuestring, "chat.completion");
    assert_true(usage_of(chat, "completion_tokens") >= 1);
    cJSON_Delete(chat);
    assert_int_equal(http_stop_server(&srv_pid, 10000), 0);
    char *logtext = read_whole_file(log, NULL);
    assert_non_null(strstr(logtext, "no chat template"));
    free(logtext);
    remove_tree(dir);
    free(dir);
    free(want);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shipped_file_is_the_published_one),
        cmocka_unit_test(test_run_writes_english),
        cmocka_unit_test(test_serve_english_then_warm),
    };
    return test_run_group(tests, NULL, NULL);
}
