/* test_serve_fleet.c - what a fleet operator expects of `ember serve`,
 * end to end over loopback (servers spawned from $EMBER_BIN on a tiny qwen3
 * made by `ember mkmodel`; tests/http_client.h).
 *
 * Covered: GET /ready (200 when serving, unauthenticated like /health;
 * 503 while loading, between server_open and server_load in-process, when
 * /health says "loading" and the model routes 503 model_loading; 503 while
 * draining); POST /tokenize and /detokenize in vLLM's shapes: the
 * ids of a text or a chat are exactly what a generation prefills (same
 * prompt_tokens, same greedy output when sent back as ids), round trips,
 * token_strs, and every bad input as an OpenAI error; /v1/models carries the
 * model fingerprint (stable across restarts, different for another model)
 * and the cache format, whose namespace is the SSD tier's directory and
 * changes with the block-key hash; the vllm:* families in /metrics agree
 * with ember's own counters and show a running request and its KV usage;
 * SIGTERM drains: /ready and new generations get 503 while a long stream
 * finishes with 200 and [DONE], the SSD writes land, the process exits 0;
 * server.drain_timeout cancels what is still running and exits 0 in time. */
#define _GNU_SOURCE
#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "http_client.h"
#include "serve/serve.h"
#include "serve/serve_config.h"
#include "serve/serve_metrics.h"
#include "test_util.h"

static char *g_dir;
static char g_model[512], g_model2[512];

typedef struct child {
    pid_t pid;
    int port;
    char log[600];
} child;

static void start(child *s, const char *name, const char *model_path, char *const extra[]) {
    snprintf(s->log, sizeof s->log, "%s/%s.log", g_dir, name);
    s->port = http_spawn_ember(ember_binary(), model_path, extra, s->log, &s->pid);
    if (s->port <= 0) {
        char *text = read_whole_file(s->log, NULL);
        fail_msg("server %s did not start:\n%s", name, text ? text : "");
    }
}

static int stop(child *s) { return http_stop_server(&s->pid, 10000); }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A call whose body must be JSON; returns it (the caller deletes it). */
static cJSON *call_json(int port, const char *method, const char *path, const char *headers, const char *body,
                        int want_status) {
    http_resp r = http_request(port, method, path, headers, body, 120);
    if (r.status != want_status) print_message("%s %s -> %d %s\n", method, path, r.status, r.body ? r.body : "");
    assert_int_equal(r.status, want_status);
    cJSON *j = cJSON_Parse(r.body);
    if (j == NULL) print_message("not JSON: %s\n", r.body);
    assert_non_null(j);
    http_resp_free(&r);
    return j;
}

static const cJSON *get(const cJSON *o, const char *name) { return cJSON_GetObjectItemCaseSensitive(o, name); }

static void expect_error(int port, const char *path, const char *body, int status, const char *param,
                         const char *code) {
    cJSON *j = call_json(port, "POST", path, NULL, body, status);
    const cJSON *e = get(j, "error");
    assert_non_null(e);
    assert_true(cJSON_IsString(get(e, "message")));
    if (param) assert_string_equal(get(e, "param")->valuestring, param);
    if (code) assert_string_equal(get(e, "code")->valuestring, code);
    cJSON_Delete(j);
}

/* ---- /ready ---- */

static void test_ready(void **state) {
    (void)state;
    child s;
    char *extra[] = {(char *)"--api-key", (char *)"k1", NULL};
    start(&s, "ready", g_model, extra);
    cJSON *j = call_json(s.port, "GET", "/ready", NULL, NULL, 200); /* no key needed, like /health */
    assert_string_equal(get(j, "status")->valuestring, "ready");
    assert_string_equal(get(j, "model")->valuestring, "tiny");
    cJSON_Delete(j);
    j = call_json(s.port, "GET", "/health", NULL, NULL, 200);
    assert_string_equal(get(j, "status")->valuestring, "ok");
    cJSON_Delete(j);
    /* the token routes are API routes: they need the key */
    http_resp r = http_request(s.port, "POST", "/tokenize", NULL, "{\"prompt\":\"a\"}", 60);
    assert_int_equal(r.status, 401);
    http_resp_free(&r);
    r = http_request(s.port, "POST", "/ready", NULL, "{}", 60);
    assert_int_equal(r.status, 405);
    http_resp_free(&r);
    assert_int_equal(stop(&s), 0);
}

/* In-process, between server_open and server_load: listening, not ready. */
static void test_ready_while_loading(void **state) {
    (void)state;
    serve_config cfg;
    serve_config_defaults(&cfg);
    cfg.port = 0;
    cfg.n_threads = 2;
    ember_error err;
    server *srv = server_open(g_model, &cfg, &err);
    if (srv == NULL) fail_msg("server_open: %s", err.msg);
    int port = server_port(srv);
    assert_true(port > 0);
    cJSON *j = call_json(port, "GET", "/ready", NULL, NULL, 503);
    assert_string_equal(get(j, "status")->valuestring, "loading");
    cJSON_Delete(j);
    j = call_json(port, "GET", "/health", NULL, NULL, 200); /* alive */
    assert_string_equal(get(j, "status")->valuestring, "loading");
    cJSON_Delete(j);
    http_resp r = http_request(port, "POST", "/v1/completions", NULL, "{\"prompt\":\"a\",\"max_tokens\":1}", 60);
    assert_int_equal(r.status, 503);
    assert_non_null(strstr(r.body, "model_loading"));
    assert_non_null(strstr(r.headers, "Retry-After: 1"));
    http_resp_free(&r);
    const char *model_routes[][2] = {{"GET", "/v1/models"}, {"GET", "/metrics"}, {"GET", "/v1/cache/stats"},
                                     {"POST", "/tokenize"}};
    for (int i = 0; i < 4; i++) {
        r = http_request(port, model_routes[i][0], model_routes[i][1], NULL, model_routes[i][0][0] == 'P' ? "{}" : NULL,
                         60);
        assert_int_equal(r.status, 503);
        http_resp_free(&r);
    }
    assert_int_equal(server_load(srv, &err), 0);
    j = call_json(port, "GET", "/ready", NULL, NULL, 200);
    assert_string_equal(get(j, "status")->valuestring, "ready");
    cJSON_Delete(j);
    j = call_json(port, "GET", "/health", NULL, NULL, 200);
    assert_string_equal(get(j, "status")->valuestring, "ok");
    cJSON_Delete(j);
    cJSON_Delete(call_json(port, "POST", "/v1/completions", NULL, "{\"prompt\":\"a\",\"max_tokens\":1}", 200));
    server_free(srv);
}

/* ---- /tokenize, /detokenize ---- */

static char *ids_json(const cJSON *arr) {
    char *s = cJSON_PrintUnformatted(arr);
    assert_non_null(s);
    return s;
}

static void test_tokenize_detokenize(void **state) {
    (void)state;
    child s;
    start(&s, "tok", g_model, NULL);
    const char *text = "Once upon a time, a small robot learned to sing.";
    char body[1024];
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"return_token_strs\":true,\"model\":\"tiny\"}", text);
    cJSON *t = call_json(s.port, "POST", "/tokenize", NULL, body, 200);
    const cJSON *tokens = get(t, "tokens");
    int n = cJSON_GetArraySize(tokens);
    assert_true(n > 5);
    assert_int_equal((int)get(t, "count")->valuedouble, n);
    assert_int_equal((int)get(t, "max_model_len")->valuedouble, 2048);
    assert_int_equal(cJSON_GetArraySize(get(t, "token_strs")), n);
    /* the same prompt as a generation: the same count, and sent back as ids
     * the same greedy continuation */
    snprintf(body, sizeof body, "{\"prompt\":\"%s\",\"max_tokens\":12,\"temperature\":0}", text);
    cJSON *a = call_json(s.port, "POST", "/v1/completions", NULL, body, 200);
    assert_int_equal((int)get(get(a, "usage"), "prompt_tokens")->valuedouble, n);
    char *ids = ids_json(tokens);
    char big[8192];
    snprintf(big, sizeof big, "{\"prompt\":%s,\"max_tokens\":12,\"temperature\":0}", ids);
    cJSON *b = call_json(s.port, "POST", "/v1/completions", NULL, big, 200);
    assert_string_equal(get(cJSON_GetArrayItem(get(a, "choices"), 0), "text")->valuestring,
                        get(cJSON_GetArrayItem(get(b, "choices"), 0), "text")->valuestring);
    cJSON_Delete(a);
    cJSON_Delete(b);
    /* round trip */
    snprintf(big, sizeof big, "{\"tokens\":%s}", ids);
    cJSON *d = call_json(s.port, "POST", "/detokenize", NULL, big, 200);
    assert_string_equal(get(d, "prompt")->valuestring, text);
    cJSON_Delete(d);
    free(ids);
    cJSON_Delete(t);
    /* a chat: the ids equal what a chat completion prefills */
    const char *msgs = "[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":\"Hi there\"}]";
    snprintf(body, sizeof body, "{\"messages\":%s}", msgs);
    t = call_json(s.port, "POST", "/tokenize", NULL, body, 200);
    assert_true(cJSON_IsNull(get(t, "token_strs")));
    snprintf(body, sizeof body, "{\"messages\":%s,\"max_tokens\":1}", msgs);
    cJSON *c = call_json(s.port, "POST", "/v1/chat/completions", NULL, body, 200);
    assert_int_equal((int)get(get(c, "usage"), "prompt_tokens")->valuedouble, (int)get(t, "count")->valuedouble);
    cJSON_Delete(c);
    cJSON_Delete(t);
    /* bad input */
    expect_error(s.port, "/tokenize", "{}", 400, "prompt", "missing_required_parameter");
    expect_error(s.port, "/tokenize", "{\"prompt\":\"a\",\"messages\":[]}", 400, "messages", "invalid_value");
    expect_error(s.port, "/tokenize", "{\"prompt\":7}", 400, "prompt", "invalid_type");
    expect_error(s.port, "/tokenize", "{\"prompt\":\"a\",\"add_special_tokens\":\"yes\"}", 400, "add_special_tokens",
                 "invalid_type");
    expect_error(s.port, "/tokenize", "{\"messages\":[]}", 400, "messages", "empty_array");
    expect_error(s.port, "/tokenize", "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"add_generation_prompt\":false}",
                 400, "add_generation_prompt", "unsupported_value");
    expect_error(s.port, "/tokenize", "{\"prompt\":\"a\",\"model\":\"other\"}", 404, "model", "model_not_found");
    expect_error(s.port, "/tokenize", "{\"prompt\":\"a\"", 400, NULL, "invalid_json");
    expect_error(s.port, "/tokenize", "{\"prompt\":\"a\\u0000b\"}", 400, "prompt", "invalid_value");
    expect_error(s.port, "/detokenize", "{}", 400, "tokens", "missing_required_parameter");
    expect_error(s.port, "/detokenize", "{\"tokens\":\"abc\"}", 400, "tokens", "invalid_type");
    expect_error(s.port, "/detokenize", "{\"tokens\":[1,-2]}", 400, "tokens", "invalid_value");
    expect_error(s.port, "/detokenize", "{\"tokens\":[1,100000]}", 400, "tokens", "invalid_value");
    expect_error(s.port, "/detokenize", "{\"tokens\":[1.5]}", 400, "tokens", "invalid_value");
    expect_error(s.port, "/detokenize", "[1,2]", 400, NULL, "invalid_type");
    assert_int_equal(stop(&s), 0);
}

/* ---- /v1/models: fingerprint and cache format ---- */

static void model_identity(int port, char fp[33], char ns[33], char tier[16]) {
    cJSON *j = call_json(port, "GET", "/v1/models", NULL, NULL, 200);
    const cJSON *m = cJSON_GetArrayItem(get(j, "data"), 0);
    const cJSON *f = get(m, "cache_format");
    assert_non_null(f);
    snprintf(fp, 33, "%s", get(m, "fingerprint")->valuestring);
    snprintf(ns, 33, "%s", get(f, "namespace")->valuestring);
    snprintf(tier, 16, "%s", get(f, "tier")->valuestring);
    assert_int_equal(strlen(fp), 32);
    assert_int_equal(strspn(fp, "0123456789abcdef"), 32);
    assert_int_equal(strlen(ns), 32);
    assert_int_equal((int)get(f, "block_size")->valuedouble, 16);
    assert_string_equal(get(f, "kv_dtype")->valuestring, "f32");
    assert_int_equal((int)get(m, "max_model_len")->valuedouble, (int)get(m, "context_length")->valuedouble);
    cJSON_Delete(j);
}

static void test_models_identity(void **state) {
    (void)state;
    char disk[600];
    snprintf(disk, sizeof disk, "%s/disk-id", g_dir);
    char fp1[33], ns1[33], tier[16], fp2[33], ns2[33], fp3[33], ns3[33], fp4[33], ns4[33];
    child s;
    char *extra[] = {(char *)"--disk-path", disk, NULL};
    start(&s, "id1", g_model, extra);
    model_identity(s.port, fp1, ns1, tier);
    assert_string_equal(tier, "block");
    /* the namespace is the SSD tier's directory */
    cJSON *st = call_json(s.port, "GET", "/v1/cache/stats", NULL, NULL, 200);
    assert_string_equal(get(st, "disk_namespace")->valuestring, ns1);
    cJSON_Delete(st);
    char dir[700];
    snprintf(dir, sizeof dir, "%s/%s", disk, ns1);
    DIR *dd = opendir(dir);
    assert_non_null(dd);
    closedir(dd);
    assert_int_equal(stop(&s), 0);
    /* a restart: the same identity */
    start(&s, "id2", g_model, NULL);
    model_identity(s.port, fp2, ns2, tier);
    assert_string_equal(fp1, fp2);
    assert_string_equal(ns1, ns2);
    assert_int_equal(stop(&s), 0);
    /* another block-key hash: same model, another format */
    char *xx[] = {(char *)"--hash", (char *)"xxh3", NULL};
    start(&s, "id3", g_model, xx);
    model_identity(s.port, fp3, ns3, tier);
    assert_string_equal(fp1, fp3);
    assert_string_not_equal(ns1, ns3);
    assert_int_equal(stop(&s), 0);
    /* another model (other weights, same shape): another fingerprint */
    start(&s, "id4", g_model2, NULL);
    model_identity(s.port, fp4, ns4, tier);
    assert_string_not_equal(fp1, fp4);
    assert_string_not_equal(ns1, ns4);
    assert_int_equal(stop(&s), 0);
}

/* ---- vLLM metric names ---- */

static double sample(const char *text, const char *name_and_labels) {
    const char *p = strstr(text, name_and_labels);
    if (p == NULL) fail_msg("no sample %s", name_and_labels);
    p += strlen(name_and_labels);
    assert_true(*p == ' ');
    return strtod(p + 1, NULL);
}

static char *metrics(int port) {
    http_resp r = http_request(port, "GET", "/metrics", NULL, NULL, 60);
    assert_int_equal(r.status, 200);
    char *t = strdup(r.body);
    http_resp_free(&r);
    return t;
}

static void test_vllm_metrics(void **state) {
    (void)state;
    child s;
    char *extra[] = {(char *)"--model-id", (char *)"fleet \"one\"", NULL};
    start(&s, "metrics", g_model, extra);
    const char *body = "{\"prompt\":\"The quick brown fox jumps over the lazy dog again and again\",\"max_tokens\":4,"
                       "\"temperature\":0}";
    for (int i = 0; i < 2; i++) cJSON_Delete(call_json(s.port, "POST", "/v1/completions", NULL, body, 200));
    char *m = metrics(s.port);
    const char *L = "{model_name=\"fleet \\\"one\\\"\"}";
    char name[256];
    snprintf(name, sizeof name, "vllm:prefix_cache_queries_total%s", L);
    double queries = sample(m, name);
    snprintf(name, sizeof name, "vllm:prefix_cache_hits_total%s", L);
    double hits = sample(m, name);
    assert_true(queries > 0);
    assert_true(hits > 0); /* the resend */
    assert_true(queries == serve_metrics_text_sum(m, "ember_prompt_tokens_total"));
    assert_true(hits == serve_metrics_text_sum(m, "ember_prompt_cached_tokens_total"));
    snprintf(name, sizeof name, "vllm:time_to_first_token_seconds_count%s", L);
    assert_true(sample(m, name) == 2);
    snprintf(name, sizeof name, "vllm:time_to_first_token_seconds_bucket{model_name=\"fleet \\\"one\\\"\",le=\"+Inf\"}");
    assert_true(sample(m, name) == 2);
    snprintf(name, sizeof name, "vllm:num_requests_running%s", L);
    assert_true(sample(m, name) == 0);
    snprintf(name, sizeof name, "vllm:kv_cache_usage_perc%s", L);
    assert_true(sample(m, name) == 0);
    free(m);
    /* a long stream in flight: running 1, some of the pool in use */
    const char *lng = "{\"prompt\":\"count\",\"max_tokens\":1500,\"ignore_eos\":true,\"stream\":true}";
    int fd = http_send_request(s.port, "POST", "/v1/completions", NULL, lng, strlen(lng), 120);
    assert_true(fd >= 0);
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    assert_int_equal(poll(&pf, 1, 10000), 1);
    /* the 200 head comes before admission, and admission before the first
     * block: wait until it runs with K/V in the pool */
    double running = 0, use = 0;
    for (int i = 0; i < 500 && (running != 1 || use <= 0); i++) {
        m = metrics(s.port);
        snprintf(name, sizeof name, "vllm:num_requests_running%s", L);
        running = sample(m, name);
        snprintf(name, sizeof name, "vllm:kv_cache_usage_perc%s", L);
        use = sample(m, name);
        if (running != 1 || use <= 0) {
            free(m);
            usleep(10000);
        }
    }
    assert_true(running == 1);
    assert_true(use > 0 && use <= 1);
    free(m);
    close(fd); /* cancels it */
    assert_int_equal(stop(&s), 0);
}

/* ---- SIGTERM ---- */

static int count_files(const char *dir) {
    DIR *d = opendir(dir);
    if (d == NULL) return 0;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) n += strncmp(e->d_name, "b-", 2) == 0;
    closedir(d);
    return n;
}

static void test_sigterm_drain(void **state) {
    (void)state;
    char disk[600];
    snprintf(disk, sizeof disk, "%s/disk-drain", g_dir);
    child s;
    /* a stream long enough to outlive the probes below, short enough to
     * finish well within the drain bound in a sanitizer build */
    char *extra[] = {(char *)"--ctx", (char *)"4096", (char *)"--disk-path", disk, (char *)"--drain-timeout",
                     (char *)"300", NULL};
    start(&s, "drain", g_model, extra);
    char fp[33], ns[33], tier[16];
    model_identity(s.port, fp, ns, tier);
    const char *body = "{\"prompt\":\"drain me\",\"max_tokens\":800,\"ignore_eos\":true,\"stream\":true}";
    int fd = http_send_request(s.port, "POST", "/v1/completions", NULL, body, strlen(body), 120);
    assert_true(fd >= 0);
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    assert_int_equal(poll(&pf, 1, 10000), 1);
    kill(s.pid, SIGTERM);
    /* draining: not ready, nothing new admitted, the stream still runs */
    int ready = 0;
    for (int i = 0; i < 200; i++) {
        http_resp r = http_request(s.port, "GET", "/ready", NULL, NULL, 10);
        ready = r.status;
        bool draining = r.status == 503 && r.body && strstr(r.body, "\"draining\"");
        http_resp_free(&r);
        if (draining) break;
        usleep(10000);
    }
    assert_int_equal(ready, 503);
    cJSON *j = call_json(s.port, "POST", "/v1/completions", NULL, "{\"prompt\":\"late\",\"max_tokens\":2}", 503);
    assert_string_equal(get(get(j, "error"), "code")->valuestring, "server_shutting_down");
    cJSON_Delete(j);
    j = call_json(s.port, "GET", "/health", NULL, NULL, 503); /* /health as before: draining */
    assert_string_equal(get(j, "status")->valuestring, "draining");
    cJSON_Delete(j);
    /* the stream finishes whole */
    size_t n;
    char *raw = http_read_all(fd, &n, NULL);
    close(fd);
    http_resp r;
    http_parse_response(raw, n, &r);
    free(raw);
    assert_int_equal(r.status, 200);
    if (strstr(r.body, "\"finish_reason\":\"length\"") == NULL) {
        char *text = read_whole_file(s.log, NULL);
        print_message("stream tail: %s\nserver log:\n%s\n", r.len > 400 ? r.body + r.len - 400 : r.body, text);
        free(text);
    }
    assert_non_null(strstr(r.body, "\"finish_reason\":\"length\""));
    assert_non_null(strstr(r.body, "data: [DONE]"));
    http_resp_free(&r);
    int st = 0;
    pid_t pid = s.pid;
    for (int i = 0; i < 400 && waitpid(pid, &st, WNOHANG) != pid; i++) usleep(50000);
    s.pid = 0;
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    char *text = read_whole_file(s.log, NULL);
    assert_non_null(strstr(text, "pending cache writes flushed"));
    free(text);
    /* the finished request's blocks are on disk */
    char dir[700];
    snprintf(dir, sizeof dir, "%s/%s", disk, ns);
    assert_true(count_files(dir) > 0);
}

static void test_drain_timeout(void **state) {
    (void)state;
    child s;
    char *extra[] = {(char *)"--ctx", (char *)"8192", (char *)"--drain-timeout", (char *)"1", NULL};
    start(&s, "drain-timeout", g_model, extra);
    const char *body = "{\"prompt\":\"never ends\",\"max_tokens\":7000,\"ignore_eos\":true,\"stream\":true}";
    int fd = http_send_request(s.port, "POST", "/v1/completions", NULL, body, strlen(body), 120);
    assert_true(fd >= 0);
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    assert_int_equal(poll(&pf, 1, 10000), 1);
    double t0 = now_s();
    kill(s.pid, SIGTERM);
    int st = 0;
    pid_t pid = s.pid;
    for (int i = 0; i < 400 && waitpid(pid, &st, WNOHANG) != pid; i++) usleep(25000);
    double took = now_s() - t0;
    s.pid = 0;
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
    assert_true(took < 8.0); /* 1 s of drain, then the cancel and the exit */
    size_t n;
    char *raw = http_read_all(fd, &n, NULL);
    close(fd);
    assert_non_null(strstr(raw, "200 OK"));
    free(raw);
    char *text = read_whole_file(s.log, NULL);
    assert_non_null(strstr(text, "server.drain_timeout=1 s; cancelled 1"));
    free(text);
}

static int setup(void **state) {
    (void)state;
    if (ember_binary() == NULL) return -1;
    g_dir = make_temp_dir();
    snprintf(g_model, sizeof g_model, "%s/tiny.gguf", g_dir);
    snprintf(g_model2, sizeof g_model2, "%s/other.gguf", g_dir);
    char cmd[1400];
    snprintf(cmd, sizeof cmd,
             "%s mkmodel --arch qwen3 --preset tiny --seed 3 --out %s >/dev/null 2>&1 && "
             "%s mkmodel --arch qwen3 --preset tiny --seed 4 --out %s >/dev/null 2>&1",
             ember_binary(), g_model, ember_binary(), g_model2);
    return system(cmd) == 0 ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    remove_tree(g_dir);
    free(g_dir);
    return 0;
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    if (ember_binary() == NULL) {
        print_message("skipping: EMBER_BIN is not set (run under ctest)\n");
        return TEST_SKIP_EXIT;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ready),
        cmocka_unit_test(test_ready_while_loading),
        cmocka_unit_test(test_tokenize_detokenize),
        cmocka_unit_test(test_models_identity),
        cmocka_unit_test(test_vllm_metrics),
        cmocka_unit_test(test_sigterm_drain),
        cmocka_unit_test(test_drain_timeout),
    };
    return test_run_group(tests, setup, teardown);
}
