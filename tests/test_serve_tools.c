/* test_serve_tools.c - the tool-call parser of the server (serve_tools.h)
 * on fixed replies in every supported syntax: calls, content around them,
 * malformed calls left as text, ids, argument typing from the schema, and
 * the streaming filter fed in every split (one byte at a time, and cut at
 * every offset into two pieces) giving the whole parser's content and calls.
 * Also the syntax picked for each committed chat template, and the API's
 * rendering of calls (message.tool_calls, finish_reason, delta chunks). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "serve/serve_api.h"
#include "serve/serve_tools.h"
#include "test_util.h"

typedef struct expect_call {
    const char *name;
    const char *arguments;
} expect_call;

/* Streams text in pieces cut at `cuts` (sorted offsets, -1 ends) and checks
 * the result against content/calls. */
static void check_stream(tool_syntax syn, const cJSON *tools, const char *text, const int *cuts, const char *content,
                         const expect_call *calls, int n_calls) {
    tool_filter *f = tool_filter_create(syn, tools);
    assert_non_null(f);
    size_t n = strlen(text), at = 0;
    char got[4096] = "";
    tool_calls tc;
    for (int i = 0;; i++) {
        size_t to = cuts[i] < 0 ? n : (size_t)cuts[i];
        if (to > n) to = n;
        bool end = cuts[i] < 0;
        char *out = tool_filter_push(f, text + at, to - at, end, &tc);
        assert_non_null(out);
        strncat(got, out, sizeof got - strlen(got) - 1);
        free(out);
        at = to;
        if (end) break;
    }
    if (strcmp(got, content ? content : "") != 0)
        print_message("stream of [%s]: content [%s], want [%s]\n", text, got, content ? content : "");
    assert_string_equal(got, content ? content : "");
    assert_int_equal(tc.n, n_calls);
    for (int i = 0; i < n_calls; i++) {
        assert_string_equal(tc.v[i].name, calls[i].name);
        assert_string_equal(tc.v[i].arguments, calls[i].arguments);
    }
    tool_calls_free(&tc);
    tool_filter_free(f);
}

/* Whole parse, then the stream byte by byte and cut at every offset. */
static void check(tool_syntax syn, const cJSON *tools, const char *text, const char *content,
                  const expect_call *calls, int n_calls) {
    char *c = NULL;
    tool_calls tc;
    int n = tools_parse(syn, tools, text, &c, &tc);
    if (n != n_calls) print_message("parse of [%s]: %d calls, want %d\n", text, n, n_calls);
    assert_int_equal(n, n_calls);
    if (content == NULL) assert_null(c);
    else {
        assert_non_null(c);
        assert_string_equal(c, content);
    }
    for (int i = 0; i < n_calls; i++) {
        assert_string_equal(tc.v[i].name, calls[i].name);
        assert_string_equal(tc.v[i].arguments, calls[i].arguments);
        assert_true(strlen(tc.v[i].id) > 0);
    }
    tool_calls_free(&tc);
    free(c);
    size_t len = strlen(text);
    int *bytes = malloc((len + 1) * sizeof *bytes);
    for (size_t i = 0; i < len; i++) bytes[i] = (int)i + 1;
    bytes[len] = -1;
    check_stream(syn, tools, text, bytes, content, calls, n_calls);
    free(bytes);
    for (size_t k = 0; k <= len; k++) {
        int cuts[2] = {(int)k, -1};
        check_stream(syn, tools, text, cuts, content, calls, n_calls);
    }
}

static void test_hermes_json(void **state) {
    (void)state;
    expect_call one[] = {{"get_weather", "{\"city\":\"Paris\",\"days\":2}"}};
    check(TOOL_SYNTAX_HERMES, NULL,
          "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>",
          NULL, one, 1);
    /* content before, two calls, a string argument kept as given */
    expect_call two[] = {{"a", "{\"x\":1}"}, {"b", "{\"y\": [1, 2]}"}};
    check(TOOL_SYNTAX_HERMES, NULL,
          "Let me check.\n\n<tool_call>\n{\"name\":\"a\",\"arguments\":{\"x\":1}}\n</tool_call>\n<tool_call>\n"
          "{\"name\":\"b\",\"arguments\":\"{\\\"y\\\": [1, 2]}\"}\n</tool_call>",
          "Let me check.", two, 2);
    /* no arguments at all */
    expect_call none[] = {{"ping", "{}"}};
    check(TOOL_SYNTAX_HERMES, NULL, "<tool_call>{\"name\":\"ping\"}</tool_call>\n", NULL, none, 1);
    /* plain replies, a lone '<', a tag-like word: untouched */
    check(TOOL_SYNTAX_HERMES, NULL, "Hello there.  ", "Hello there.  ", NULL, 0);
    check(TOOL_SYNTAX_HERMES, NULL, "a < b and <tool> is not <tool_call", "a < b and <tool> is not <tool_call",
          NULL, 0);
    check(TOOL_SYNTAX_HERMES, NULL, "", "", NULL, 0);
    check(TOOL_SYNTAX_HERMES, NULL, "\n\n", "\n\n", NULL, 0);
    /* malformed: bad JSON, no name, truncated -> the reply stays text */
    const char *bad[] = {
        "x <tool_call>{\"name\": \"f\", \"arguments\": {</tool_call>",
        "<tool_call>{\"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": \"\"}</tool_call>",
        "<tool_call>{\"name\": \"f\", \"arguments\": 3}</tool_call>",
        "<tool_call>\n{\"name\": \"get_weather\", \"argum",
        "<tool_call></tool_call>",
        "<tool_call>{\"name\":\"f\"} trailing</tool_call>",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) check(TOOL_SYNTAX_HERMES, NULL, bad[i], bad[i], NULL, 0);
    /* one good call, one bad block and text after: the rest becomes content */
    expect_call g[] = {{"f", "{}"}};
    check(TOOL_SYNTAX_HERMES, NULL, "Sure.\n<tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call>\n"
                                    "<tool_call>{oops}</tool_call>\nDone.",
          "Sure.\n<tool_call>{oops}</tool_call>\nDone.", g, 1);
    /* UTF-8 and escapes survive */
    expect_call u[] = {{"say", "{\"text\":\"h\xC3\xA9llo \\\"q\\\"\"}"}};
    check(TOOL_SYNTAX_HERMES, NULL, "<tool_call>{\"name\":\"say\",\"arguments\":{\"text\":\"h\xC3\xA9llo \\\"q\\\"\"}}"
                                    "</tool_call>",
          NULL, u, 1);
}

static void test_hermes_xml(void **state) {
    (void)state;
    cJSON *tools = cJSON_Parse(
        "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\","
        "\"properties\":{\"city\":{\"type\":\"string\"},\"zip\":{\"type\":\"string\"},\"days\":{\"type\":\"integer\"}}}}}]");
    expect_call one[] = {{"get_weather", "{\"city\":\"Paris\",\"zip\":\"75001\",\"days\":3}"}};
    const char *q35 = "I will look it up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                      "<parameter=zip>\n75001\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
    check(TOOL_SYNTAX_HERMES, tools, q35, "I will look it up.", one, 1);
    /* without a schema, "75001" parses as a number */
    expect_call untyped[] = {{"get_weather", "{\"city\":\"Paris\",\"zip\":75001,\"days\":3}"}};
    check(TOOL_SYNTAX_HERMES, NULL, q35, "I will look it up.", untyped, 1);
    /* multi-line values, objects, two calls */
    expect_call two[] = {{"write", "{\"path\":\"a.txt\",\"body\":\"line 1\\nline 2\"}"},
                         {"cfg", "{\"opts\":{\"a\":[1,2]},\"flag\":true}"}};
    check(TOOL_SYNTAX_HERMES, NULL,
          "<tool_call>\n<function=write>\n<parameter=path>\na.txt\n</parameter>\n<parameter=body>\nline 1\nline 2\n"
          "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=cfg>\n<parameter=opts>\n{\"a\": [1, 2]}\n"
          "</parameter>\n<parameter=flag>\ntrue\n</parameter>\n</function>\n</tool_call>",
          NULL, two, 2);
    /* malformed XML stays text */
    const char *bad[] = {
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",
        "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n</function>"
        "\n</tool_call>",
        "<tool_call>\n<function=f>\ngarbage\n</function>\n</tool_call>",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) check(TOOL_SYNTAX_HERMES, tools, bad[i], bad[i], NULL, 0);
    cJSON_Delete(tools);
}

static void test_llama3(void **state) {
    (void)state;
    expect_call one[] = {{"get_weather", "{\"city\":\"Paris\"}"}};
    check(TOOL_SYNTAX_LLAMA3, NULL, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", NULL, one, 1);
    check(TOOL_SYNTAX_LLAMA3, NULL, "\n <|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
          NULL, one, 1);
    expect_call two[] = {{"a", "{}"}, {"b", "{\"k\":null}"}};
    check(TOOL_SYNTAX_LLAMA3, NULL, "{\"name\":\"a\",\"parameters\":{}}; {\"name\":\"b\",\"arguments\":{\"k\":null}}",
          NULL, two, 2);
    /* text first: '{' later is no trigger; a JSON answer without a name is content */
    check(TOOL_SYNTAX_LLAMA3, NULL, "The set {1, 2} is small.", "The set {1, 2} is small.", NULL, 0);
    check(TOOL_SYNTAX_LLAMA3, NULL, "{\"answer\": 42}", "{\"answer\": 42}", NULL, 0);
    check(TOOL_SYNTAX_LLAMA3, NULL, "{\"name\": \"f\", \"parameters\": {}} and more",
          "{\"name\": \"f\", \"parameters\": {}} and more", NULL, 0);
    check(TOOL_SYNTAX_LLAMA3, NULL, "<|python_tag|>brave_search.call(query=\"x\")",
          "<|python_tag|>brave_search.call(query=\"x\")", NULL, 0);
    check(TOOL_SYNTAX_LLAMA3, NULL, "{\"name\": \"f\", \"param", "{\"name\": \"f\", \"param", NULL, 0);
}

static void test_mistral(void **state) {
    (void)state;
    expect_call two[] = {{"get_weather", "{\"city\":\"Paris\"}"}, {"get_time", "{\"tz\":\"CET\"}"}};
    const char *v3 = "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": \"abc123XYZ\"}, "
                     "{\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}]";
    check(TOOL_SYNTAX_MISTRAL, NULL, v3, NULL, two, 2);
    /* the marker is a control token: often absent from the detokenized text */
    check(TOOL_SYNTAX_MISTRAL, NULL, v3 + 12, NULL, two, 2);
    /* the model's 9-character id is kept, others get a fresh 9-character one */
    char *c = NULL;
    tool_calls tc;
    assert_int_equal(tools_parse(TOOL_SYNTAX_MISTRAL, NULL, v3, &c, &tc), 2);
    assert_string_equal(tc.v[0].id, "abc123XYZ");
    assert_int_equal((int)strlen(tc.v[1].id), 9);
    cJSON *j = tool_calls_json(&tc);
    char *s = cJSON_PrintUnformatted(j);
    assert_non_null(strstr(s, "{\"id\":\"abc123XYZ\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
                              "\"arguments\":\"{\\\"city\\\":\\\"Paris\\\"}\"}}"));
    free(s);
    cJSON_Delete(j);
    tool_calls_free(&tc);
    free(c);
    /* text before the marker */
    expect_call one[] = {{"f", "{}"}};
    check(TOOL_SYNTAX_MISTRAL, NULL, "Checking. [TOOL_CALLS][{\"name\":\"f\",\"arguments\":{}}]", "Checking.", one, 1);
    /* plain or malformed */
    check(TOOL_SYNTAX_MISTRAL, NULL, "[1, 2] are numbers", "[1, 2] are numbers", NULL, 0);
    check(TOOL_SYNTAX_MISTRAL, NULL, "[TOOL_CALLS] []", "[TOOL_CALLS] []", NULL, 0);
    check(TOOL_SYNTAX_MISTRAL, NULL, "[TOOL_CALLS] [{\"name\": \"f\", \"arg", "[TOOL_CALLS] [{\"name\": \"f\", \"arg",
          NULL, 0);
    check(TOOL_SYNTAX_MISTRAL, NULL, "Just text [ok]", "Just text [ok]", NULL, 0);
}

static void test_ids_and_none(void **state) {
    (void)state;
    char *c = NULL;
    tool_calls tc;
    const char *t = "<tool_call>{\"name\":\"f\"}</tool_call><tool_call>{\"name\":\"g\"}</tool_call>";
    assert_int_equal(tools_parse(TOOL_SYNTAX_HERMES, NULL, t, &c, &tc), 2);
    assert_null(c);
    for (int i = 0; i < 2; i++) {
        assert_int_equal((int)strlen(tc.v[i].id), 29);
        assert_memory_equal(tc.v[i].id, "call_", 5);
    }
    assert_string_not_equal(tc.v[0].id, tc.v[1].id);
    tool_calls_free(&tc);
    /* NONE never parses */
    assert_int_equal(tools_parse(TOOL_SYNTAX_NONE, NULL, t, &c, &tc), 0);
    assert_string_equal(c, t);
    free(c);
    tool_calls_free(&tc);
}

static void test_syntax_for_templates(void **state) {
    (void)state;
    static const struct {
        const char *file;
        tool_syntax want;
    } cases[] = {
        {"qwen3.jinja", TOOL_SYNTAX_HERMES},        {"qwen3.5.jinja", TOOL_SYNTAX_HERMES},
        {"chatml.jinja", TOOL_SYNTAX_HERMES},       {"gemma3.jinja", TOOL_SYNTAX_HERMES},
        {"llama3.1.jinja", TOOL_SYNTAX_LLAMA3},     {"llama3.2.jinja", TOOL_SYNTAX_LLAMA3},
        {"mistral-v0.3.jinja", TOOL_SYNTAX_MISTRAL}, {"mistral-v7.jinja", TOOL_SYNTAX_MISTRAL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char dir[512], path[1024];
        snprintf(dir, sizeof dir, "%s", __FILE__);
        char *slash = strrchr(dir, '/');
        if (slash) *slash = 0;
        else snprintf(dir, sizeof dir, ".");
        snprintf(path, sizeof path, "%s/data/chat/templates/%s", dir, cases[i].file);
        char *src = read_whole_file(path, NULL);
        if (src == NULL) print_message("cannot read %s\n", path);
        assert_non_null(src);
        if (tool_syntax_for_template(src) != cases[i].want)
            print_message("%s: %s\n", cases[i].file, tool_syntax_name(tool_syntax_for_template(src)));
        assert_int_equal(tool_syntax_for_template(src), cases[i].want);
        free(src);
    }
    assert_int_equal(tool_syntax_for_template(NULL), TOOL_SYNTAX_HERMES);
}

static void test_api_rendering(void **state) {
    (void)state;
    api_ctx ctx = {.model_id = "m"};
    api_req q;
    memset(&q, 0, sizeof q);
    q.chat = true;
    q.tools = TOOL_SYNTAX_HERMES;
    sreq_usage u;
    memset(&u, 0, sizeof u);
    const char *reply = "<think>\nweather first\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                        "{\"city\": \"Paris\"}}\n</tool_call>";
    char *s = api_response_json(&ctx, &q, "chatcmpl-1", 1, reply, NULL, 0, &u, SREQ_STOP);
    cJSON *j = cJSON_Parse(s);
    assert_non_null(j);
    cJSON *c0 = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    assert_string_equal(cJSON_GetObjectItem(c0, "finish_reason")->valuestring, "tool_calls");
    cJSON *m = cJSON_GetObjectItem(c0, "message");
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(m, "content")));
    assert_string_equal(cJSON_GetObjectItem(m, "reasoning_content")->valuestring, "weather first");
    cJSON *call = cJSON_GetArrayItem(cJSON_GetObjectItem(m, "tool_calls"), 0);
    assert_string_equal(cJSON_GetObjectItem(call, "type")->valuestring, "function");
    cJSON *fn = cJSON_GetObjectItem(call, "function");
    assert_string_equal(cJSON_GetObjectItem(fn, "name")->valuestring, "get_weather");
    assert_string_equal(cJSON_GetObjectItem(fn, "arguments")->valuestring, "{\"city\":\"Paris\"}");
    cJSON_Delete(j);
    free(s);
    /* cut by max_tokens: the reason stays "length"; without tools nothing is parsed */
    s = api_response_json(&ctx, &q, "chatcmpl-1", 1, reply, NULL, 0, &u, SREQ_LENGTH);
    assert_non_null(strstr(s, "\"finish_reason\":\"length\""));
    assert_non_null(strstr(s, "\"tool_calls\":["));
    free(s);
    q.tools = TOOL_SYNTAX_NONE;
    s = api_response_json(&ctx, &q, "chatcmpl-1", 1, "<tool_call>{\"name\":\"f\"}</tool_call>", NULL, 0, &u,
                          SREQ_STOP);
    assert_null(strstr(s, "\"tool_calls\""));
    assert_non_null(strstr(s, "\"finish_reason\":\"stop\""));
    free(s);
    /* streamed chunks */
    tool_call tc = {"call_abc", "get_weather", "{\"city\":\"Paris\"}"};
    s = api_tool_chunk_json(&ctx, &q, "chatcmpl-1", 1, 2, &tc, true);
    assert_non_null(strstr(s, "\"delta\":{\"tool_calls\":[{\"index\":2,\"id\":\"call_abc\",\"type\":\"function\","
                              "\"function\":{\"name\":\"get_weather\",\"arguments\":\"\"}}]}"));
    free(s);
    s = api_tool_chunk_json(&ctx, &q, "chatcmpl-1", 1, 2, &tc, false);
    assert_non_null(strstr(s, "\"delta\":{\"tool_calls\":[{\"index\":2,\"function\":{\"arguments\":"
                              "\"{\\\"city\\\":\\\"Paris\\\"}\"}}]}"));
    assert_non_null(strstr(s, "\"object\":\"chat.completion.chunk\""));
    free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hermes_json), cmocka_unit_test(test_hermes_xml),    cmocka_unit_test(test_llama3),
        cmocka_unit_test(test_mistral),     cmocka_unit_test(test_ids_and_none), cmocka_unit_test(test_syntax_for_templates),
        cmocka_unit_test(test_api_rendering),
    };
    return test_run_group(tests, NULL, NULL);
}
