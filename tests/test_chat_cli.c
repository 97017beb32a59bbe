/* test_chat_cli.c - `ember chat` driven by scripted stdin.
 *
 * The model is the build's random-weight qwen3 `small` (ember mkmodel, with
 * a chat template). Each test pipes turns and commands into `ember chat
 * --temp 0` and reads the status lines it prints after every reply:
 *  - the second turn of a conversation finds the first in the prompt cache
 *    (cached > 0, from the block tier), and its prompt is longer;
 *  - the first turn's prompt has exactly the token count the server reports
 *    for the same messages (the chat goes through the server's request
 *    parser and template);
 *  - /save writes the conversation as an OpenAI messages array, /load reads
 *    it back (the next turn is warm again), /reset keeps the system prompt,
 *    /system changes the prefix (the next turn is cold);
 *  - a bad /load file is reported by name and the chat goes on; bad
 *    arguments exit 2. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "http_client.h"
#include "test_util.h"

typedef struct status_line {
    long long prompt, cached;
    char source[16];
} status_line;

static char g_model[1024];

static int setup(void **state) {
    (void)state;
    const char *bd = build_dir();
    if (bd == NULL || ember_binary() == NULL) return -1;
    snprintf(g_model, sizeof g_model, "%s/models/default.gguf", bd);
    return 0;
}

/* Pipes script into ember chat; returns the status lines (up to max). */
static int run_chat(const char *dir, const char *script, status_line *out, int max, char **stdout_text) {
    char in[600], cmd[2400];
    snprintf(in, sizeof in, "%s/script.txt", dir);
    FILE *f = fopen(in, "w");
    assert_non_null(f);
    fputs(script, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "%s chat %s --temp 0 -n 12 --threads 2 < %s 2>&1", ember_binary(), g_model, in);
    char *text;
    assert_int_equal(run_capture(cmd, &text), 0);
    int n = 0;
    for (const char *p = strstr(text, "[prompt "); p && n < max; p = strstr(p + 1, "[prompt ")) {
        status_line *s = &out[n];
        if (sscanf(p, "[prompt %lld tokens | cached %lld (%15[a-z])", &s->prompt, &s->cached, s->source) == 3) n++;
    }
    *stdout_text = text;
    return n;
}

static void test_second_turn_is_warm(void **state) {
    (void)state;
    char *dir = make_temp_dir(), *out;
    status_line st[4];
    int n = run_chat(dir, "Hello there, how are you today?\nTell me more about it.\n", st, 4, &out);
    assert_int_equal(n, 2);
    assert_int_equal(st[0].cached, 0);
    assert_string_equal(st[0].source, "none");
    assert_true(st[1].prompt > st[0].prompt);
    /* at least the whole first prompt but its last token comes from the cache */
    assert_true(st[1].cached >= st[0].prompt - 1);
    assert_string_equal(st[1].source, "block");
    free(out);

    /* the same first turn through the server: the same prompt, token for token */
    char log[700];
    snprintf(log, sizeof log, "%s/serve.log", dir);
    pid_t srv_pid = 0;
    int srv_port;
    srv_port = http_spawn_ember(ember_binary(), g_model, NULL, log, &srv_pid);
    assert_true(srv_port > 0);
    char *resp;
    int code = http_call(srv_port, "POST", "/v1/chat/completions", NULL,
                         "{\"messages\":[{\"role\":\"user\",\"content\":\"Hello there, how are you today?\"}],"
                         "\"max_tokens\":1}",
                         &resp);
    assert_int_equal(code, 200);
    cJSON *j = cJSON_Parse(resp);
    assert_non_null(j);
    const cJSON *pt = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "prompt_tokens");
    assert_true(cJSON_IsNumber(pt));
    assert_int_equal((long long)pt->valuedouble, st[0].prompt);
    cJSON_Delete(j);
    free(resp);
    assert_int_equal(http_stop_server(&srv_pid, 10000), 0);
    remove_tree(dir);
    free(dir);
}

static void test_commands(void **state) {
    (void)state;
    char *dir = make_temp_dir(), script[4096], save[700], bad[700], *out;
    snprintf(save, sizeof save, "%s/conv.json", dir);
    snprintf(bad, sizeof bad, "%s/bad.json", dir);
    FILE *f = fopen(bad, "w");
    fputs("[{\"role\": \"wizard\", \"content\": \"hi\"}]\n", f);
    fclose(f);
    snprintf(script, sizeof script,
             "/system You are a helpful assistant.\n"
             "First question about the weather?\n"      /* 0: cold */
             "/save %s\n"
             "/reset\n"
             "Something unrelated entirely.\n"           /* 1: system prompt + new question */
             "/load %s\n"
             "/load %s/missing.json\n"
             "/load %s\n"
             "And a follow-up question?\n"               /* 2: the loaded conversation, warm */
             "/system A different system prompt now.\n"
             "And a follow-up question?\n"               /* 3: a new prefix: cold */
             "/quit\n"
             "Never sent.\n",
             save, bad, dir, save);
    status_line st[6];
    int n = run_chat(dir, script, st, 6, &out);
    assert_int_equal(n, 4);
    assert_int_equal(st[0].cached, 0);
    /* after /reset the system prompt stays, so its tokens are found again */
    assert_true(st[1].cached > 0);
    assert_true(st[1].cached < st[0].prompt);
    /* the reloaded conversation is the one stored after turn 0 */
    assert_true(st[2].prompt > st[0].prompt);
    assert_true(st[2].cached >= st[0].prompt - 1);
    /* a different system prompt changes the first tokens after the template's head */
    assert_true(st[3].cached < st[1].cached);
    assert_non_null(strstr(out, "bad.json: messages[0].role"));
    assert_non_null(strstr(out, "cannot read"));
    assert_non_null(strstr(out, "missing.json"));
    assert_null(strstr(out, "Never sent"));

    char *saved = read_whole_file(save, NULL);
    assert_non_null(saved);
    cJSON *j = cJSON_Parse(saved);
    assert_true(cJSON_IsArray(j));
    assert_int_equal(cJSON_GetArraySize(j), 3);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetArrayItem(j, 0), "role")->valuestring, "system");
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetArrayItem(j, 1), "content")->valuestring,
                        "First question about the weather?");
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetArrayItem(j, 2), "role")->valuestring, "assistant");
    cJSON_Delete(j);
    free(saved);
    free(out);
    remove_tree(dir);
    free(dir);
}

static void test_bad_arguments(void **state) {
    (void)state;
    char cmd[1200], *out;
    snprintf(cmd, sizeof cmd, "%s chat 2>&1 </dev/null", ember_binary());
    assert_int_equal(run_capture(cmd, &out), 2);
    assert_non_null(strstr(out, "ember chat"));
    free(out);
    snprintf(cmd, sizeof cmd, "%s chat /nonexistent.gguf 2>&1 </dev/null", ember_binary());
    assert_int_equal(run_capture(cmd, &out), 1);
    assert_non_null(strstr(out, "nonexistent.gguf"));
    free(out);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_second_turn_is_warm),
        cmocka_unit_test(test_commands),
        cmocka_unit_test(test_bad_arguments),
    };
    int rc = test_run_group(tests, setup, NULL);
    return build_dir() == NULL ? 1 : rc;
}
