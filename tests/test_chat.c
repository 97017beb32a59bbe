/* test_chat.c - the chat-template engine and the chat rendering API.
 *
 * The vector tests render every case of tests/data/chat/vectors/ (one JSON file per template)
 * (produced by tools/gen_chat_vectors.py with Python's Jinja2 configured like
 * Hugging Face transformers) and compare byte for byte; cases where Jinja2
 * raised must fail here too, with raise_exception's message when the
 * template raised it. The remaining tests cover error reporting, the render
 * limits (steps, bytes), the message API and the prompt-cache render
 * predictions. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "test_util.h"

#include "chat/chat.h"
#include "chat/jinja.h"

static char g_data_dir[1024];

static const char *data_dir(void) {
    if (g_data_dir[0] == '\0') {
        snprintf(g_data_dir, sizeof g_data_dir, "%s", __FILE__);
        char *slash = strrchr(g_data_dir, '/');
        if (slash) *slash = '\0';
        else snprintf(g_data_dir, sizeof g_data_dir, ".");
        strncat(g_data_dir, "/data/chat", sizeof g_data_dir - strlen(g_data_dir) - 1);
    }
    return g_data_dir;
}

static char *load_text(const char *rel) {
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", data_dir(), rel);
    size_t n = 0;
    char *buf = read_whole_file(path, &n);
    if (buf == NULL) return NULL;
    char *s = malloc(n + 1);
    memcpy(s, buf, n);
    s[n] = '\0';
    free(buf);
    return s;
}

static void report_diff(const char *name, const char *want, const char *got) {
    size_t i = chat_common_prefix(want, got);
    size_t from = i > 40 ? i - 40 : 0;
    fprintf(stderr, "MISMATCH %s at byte %zu\n  want: ...%.80s\n  got:  ...%.80s\n", name, i,
            want + from, got ? got + from : "(null)");
}

/* ---- vectors ---- */

static int run_template_vectors(const char *tname, int *n_cases) {
    char rel[256];
    snprintf(rel, sizeof rel, "templates/%s.jinja", tname);
    char *source = load_text(rel);
    snprintf(rel, sizeof rel, "vectors/%s.json", tname);
    char *vec = load_text(rel);
    assert_non_null(source);
    assert_non_null(vec);
    ember_error err = {{0}};
    chat_template *tpl = chat_template_create(source, &err);
    if (tpl == NULL) fprintf(stderr, "%s: %s\n", tname, err.msg);
    assert_non_null(tpl);
    cJSON *cases = cJSON_Parse(vec);
    assert_non_null(cases);
    int failures = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, cases) {
        const char *name = cJSON_GetObjectItem(c, "name")->valuestring;
        chat_render_opts o = {0};
        o.add_generation_prompt = cJSON_IsTrue(cJSON_GetObjectItem(c, "add_generation_prompt"));
        const cJSON *think = cJSON_GetObjectItem(c, "enable_thinking");
        o.enable_thinking = think ? cJSON_IsTrue(think) : -1;
        o.bos_token = cJSON_GetObjectItem(c, "bos_token")->valuestring;
        o.eos_token = cJSON_GetObjectItem(c, "eos_token")->valuestring;
        o.now = (int64_t)cJSON_GetObjectItem(c, "now")->valuedouble;
        const cJSON *tools = cJSON_GetObjectItem(c, "tools");
        chat_messages *msgs = chat_messages_from_json(cJSON_GetObjectItem(c, "messages"), &err);
        if (msgs == NULL) {
            fprintf(stderr, "%s/%s: messages rejected: %s\n", tname, name, err.msg);
            failures++;
            continue;
        }
        char *out = NULL;
        int rc = chat_render(tpl, msgs, cJSON_IsNull(tools) ? NULL : tools, &o, &out, &err);
        const cJSON *want = cJSON_GetObjectItem(c, "expected");
        const cJSON *want_err = cJSON_GetObjectItem(c, "error");
        char full[512];
        snprintf(full, sizeof full, "%s/%s", tname, name);
        if (want) {
            if (rc != 0) {
                fprintf(stderr, "%s: unexpected error: %s\n", full, err.msg);
                failures++;
            } else if (strcmp(out, want->valuestring) != 0) {
                report_diff(full, want->valuestring, out);
                failures++;
            }
        } else {
            if (rc == 0) {
                fprintf(stderr, "%s: expected an error (%s), rendered instead\n", full, want_err->valuestring);
                failures++;
            } else if (strchr(want_err->valuestring, ':') == NULL && strstr(err.msg, want_err->valuestring) == NULL) {
                /* a raise_exception message must come through */
                fprintf(stderr, "%s: error '%s' lacks '%s'\n", full, err.msg, want_err->valuestring);
                failures++;
            }
        }
        free(out);
        chat_messages_free(msgs);
        (*n_cases)++;
    }
    cJSON_Delete(cases);
    chat_template_free(tpl);
    free(source);
    free(vec);
    return failures;
}

static const char *const TEMPLATES[] = {
    "chatml", "qwen3", "qwen3.5", "llama3.1", "llama3.2", "gemma3", "mistral-v0.3", "mistral-v7", NULL
};

static void test_template_vectors(void **state) {
    (void)state;
    int failures = 0;
    for (int i = 0; TEMPLATES[i]; i++) {
        int n = 0;
        int f = run_template_vectors(TEMPLATES[i], &n);
        fprintf(stderr, "  %-13s %3d vectors, %d mismatches\n", TEMPLATES[i], n, f);
        failures += f;
    }
    assert_int_equal(failures, 0);
}

/* engine micro-cases rendered by Jinja2 */
static void test_micro_vectors(void **state) {
    (void)state;
    char *vec = load_text("vectors/micro.json");
    assert_non_null(vec);
    cJSON *cases = cJSON_Parse(vec);
    assert_non_null(cases);
    int failures = 0, n = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, cases) {
        const char *name = cJSON_GetObjectItem(c, "name")->valuestring;
        const char *src = cJSON_GetObjectItem(c, "template")->valuestring;
        ember_error err = {{0}};
        chat_template *tpl = chat_template_create(src, &err);
        const cJSON *want = cJSON_GetObjectItem(c, "expected");
        n++;
        if (tpl == NULL) {
            fprintf(stderr, "micro/%s: parse error: %s\n", name, err.msg);
            failures++;
            continue;
        }
        /* the variables go in as extras; messages is unused */
        chat_messages *msgs = chat_messages_create();
        chat_render_opts o = {.enable_thinking = -1, .extra = cJSON_GetObjectItem(c, "vars"),
                              .now = (int64_t)cJSON_GetObjectItem(c, "now")->valuedouble};
        char *out = NULL;
        int rc = chat_render(tpl, msgs, NULL, &o, &out, &err);
        if (want) {
            if (rc != 0) {
                fprintf(stderr, "micro/%s: unexpected error: %s\n", name, err.msg);
                failures++;
            } else if (strcmp(out, want->valuestring) != 0) {
                char full[128];
                snprintf(full, sizeof full, "micro/%s", name);
                report_diff(full, want->valuestring, out);
                failures++;
            }
        } else if (rc == 0) {
            fprintf(stderr, "micro/%s: expected an error, got '%s'\n", name, out);
            failures++;
        }
        free(out);
        chat_messages_free(msgs);
        chat_template_free(tpl);
    }
    fprintf(stderr, "  micro         %3d vectors, %d mismatches\n", n, failures);
    cJSON_Delete(cases);
    free(vec);
    assert_int_equal(failures, 0);
}

/* ---- engine unit tests ---- */

static char *render_src(const char *src, const char *vars_json, ember_error *err) {
    chat_template *tpl = chat_template_create(src, err);
    if (tpl == NULL) return NULL;
    cJSON *vars = vars_json ? cJSON_Parse(vars_json) : NULL;
    chat_messages *msgs = chat_messages_create();
    chat_render_opts o = {.enable_thinking = -1, .extra = vars};
    char *out = NULL;
    chat_render(tpl, msgs, NULL, &o, &out, err);
    chat_messages_free(msgs);
    cJSON_Delete(vars);
    chat_template_free(tpl);
    return out;
}

static void expect_parse_error(const char *src, const char *needle, int line) {
    ember_error err = {{0}};
    chat_template *tpl = chat_template_create(src, &err);
    if (tpl) fprintf(stderr, "parsed unexpectedly: %s\n", src);
    assert_null(tpl);
    if (strstr(err.msg, needle) == NULL) fprintf(stderr, "message '%s' lacks '%s'\n", err.msg, needle);
    assert_non_null(strstr(err.msg, needle));
    char want[32];
    snprintf(want, sizeof want, "line %d,", line);
    if (strstr(err.msg, want) == NULL) fprintf(stderr, "message '%s' lacks '%s'\n", err.msg, want);
    assert_non_null(strstr(err.msg, want));
}

static void test_parse_errors(void **state) {
    (void)state;
    expect_parse_error("abc {{ x ", "unterminated tag '{{'", 1);
    expect_parse_error("a\nb\n{% if x ", "unterminated tag '{%'", 3);
    expect_parse_error("a\n{% if x %}yes", "'if' was never closed (expected 'endif')", 2);
    expect_parse_error("{% for x in y %}{% endif %}", "expected 'endfor'", 1);
    expect_parse_error("\n\n{% endfor %}", "unexpected 'endfor'", 3);
    expect_parse_error("{% frobnicate %}", "unknown tag 'frobnicate'", 1);
    expect_parse_error("{{ 'abc }}", "unterminated string", 1);
    expect_parse_error("{# never closed", "unterminated comment", 1);
    expect_parse_error("{{ a + }}", "unexpected end of print statement", 1);
    expect_parse_error("x\n  {{ (1, 2] }}", "expected ')'", 2);
    expect_parse_error("{{ a b }}", "expected end of print statement", 1);
    expect_parse_error("{{ x ? y }}", "unexpected character '?'", 1);
}

static void expect_render_error(const char *src, const char *vars, const char *needle) {
    ember_error err = {{0}};
    char *out = render_src(src, vars, &err);
    if (out) fprintf(stderr, "rendered unexpectedly: %s -> %s\n", src, out);
    assert_null(out);
    if (strstr(err.msg, needle) == NULL) fprintf(stderr, "message '%s' lacks '%s'\n", err.msg, needle);
    assert_non_null(strstr(err.msg, needle));
}

static void test_render_errors(void **state) {
    (void)state;
    expect_render_error("{{ x | frobnicate }}", "{\"x\": 1}", "unknown filter 'frobnicate'");
    expect_render_error("{{ x is frobnicated }}", "{\"x\": 1}", "unknown test 'frobnicated'");
    expect_render_error("a\n\n  {{ raise_exception('Roles must alternate') }}", NULL,
                        "line 3, column 6: raise_exception: Roles must alternate");
    expect_render_error("{{ nope.attr }}", NULL, "'nope' is undefined");
    expect_render_error("{{ 'a' + 1 }}", NULL, "unsupported operand");
    expect_render_error("{% set d = {} %}{% set d.x = 1 %}", NULL, "namespace");
    expect_render_error("{{ 5 | tojson(indent=1) }}{{ nope | tojson }}", NULL, "not JSON serializable");
    expect_render_error("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", NULL, "takes not more than");
    expect_render_error("{{ 1 < 'a' }}", NULL, "not supported between");
    expect_render_error("{% for x in 5 %}{% endfor %}", NULL, "not iterable");
    expect_render_error("{{ nope() }}", NULL, "'nope' is undefined");
}

/* Renders src with no variables under explicit limits. */
static int render_limited(const char *src, int64_t max_steps, size_t max_bytes, char **out, ember_error *err) {
    jinja_template *t = jinja_parse(src, err);
    assert_non_null(t);
    jv vars = jv_dict(0);
    const jinja_limits lim = {max_steps, max_bytes};
    int rc = jinja_render_limited(t, vars, 0, &lim, out, err);
    jv_release(vars);
    jinja_free(t);
    return rc;
}

/* A template cannot loop forever or allocate without bound: the step limit
 * and the byte limit stop it with an error that names the limit, under the
 * defaults (through chat_render) and under explicit small limits, while a
 * template inside the limits renders exactly. */
static void test_render_limits(void **state) {
    (void)state;
    /* 10^12 iterations of an empty body. */
    expect_render_error("{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}", NULL,
                        "step limit");
    /* An expensive builtin in a loop that prints nothing. */
    expect_render_error("{% set l = range(1000000) %}{% for i in l %}{% if l|join == 'x' %}{% endif %}{% endfor %}",
                        NULL, "step limit");
    /* A string doubled 64 times (2^65 bytes). */
    expect_render_error("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s | length }}",
                        NULL, "size limit");
    /* A list doubled the same way: its copies count both as work and as
     * bytes, so whichever limit is tighter stops it. */
    const char *lists = "{% set ns = namespace(l=[1, 2]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}"
                        "{% endfor %}{{ ns.l | length }}";
    expect_render_error(lists, NULL, "the template exceeded its");
    ember_error err = {{0}};
    char *out = NULL;
    assert_int_equal(render_limited(lists, INT64_MAX, 1 << 20, &out, &err), -1);
    assert_non_null(strstr(err.msg, "size limit (1048576 bytes"));
    assert_int_equal(render_limited(lists, 100000, SIZE_MAX, &out, &err), -1);
    assert_non_null(strstr(err.msg, "step limit (100000 evaluation steps)"));
    /* A gigabyte of output, 1 MB per statement. */
    expect_render_error("{% set s = ('x' * 1000) * 1000 %}{% for i in range(1000) %}{{ s }}{% endfor %}", NULL,
                        "size limit");

    const char *loop = "{% for i in range(100) %}{{ i % 10 }}{% endfor %}";
    assert_int_equal(render_limited(loop, 50, 1 << 20, &out, &err), -1);
    assert_null(out);
    assert_non_null(strstr(err.msg, "step limit (50 evaluation steps)"));
    assert_int_equal(render_limited(loop, 100000, 1 << 20, &out, &err), 0);
    assert_int_equal(strlen(out), 100);
    assert_memory_equal(out, "0123456789", 10);
    free(out);
    /* 5000 bytes of output from a 5000-byte string: 4096 bytes do not fit,
     * 16384 do (the render's own scopes count too). */
    const char *big = "{{ 'x' * 5000 }}";
    assert_int_equal(render_limited(big, 100000, 4096, &out, &err), -1);
    assert_null(out);
    assert_non_null(strstr(err.msg, "size limit (4096 bytes"));
    assert_int_equal(render_limited(big, 100000, 16384, &out, &err), 0);
    assert_int_equal(strlen(out), 5000);
    free(out);
    /* The account is per render: a failed render leaves the next one free. */
    out = render_src("{{ 'ok' }}", NULL, &err);
    assert_non_null(out);
    assert_string_equal(out, "ok");
    free(out);
}

/* Found by fuzz_jinja (tests/fuzz/jinja/crash-3e39..., replayed by
 * fuzz_replay_jinja) and its neighbours: 64-bit integer overflow was
 * undefined behaviour, a namespace could hold itself (endless recursion in
 * tojson, a leaked cycle), and a value nested a million levels deep
 * overflowed the stack when released. Each is now an error or Python's
 * answer. */
static void test_render_hostile(void **state) {
    (void)state;
    expect_render_error("{% set x %}inner {{ 9223372036854775807 + 1 }}{% endset %}[{{ x }}]", NULL,
                        "integer overflow");
    expect_render_error("{{ -9223372036854775807 - 2 }}", NULL, "integer overflow");
    expect_render_error("{{ 4611686018427387904 * 2 }}", NULL, "integer overflow");
    expect_render_error("{{ 3 ** 41 }}", NULL, "integer overflow");
    expect_render_error("{{ -(-9223372036854775807 - 1) }}", NULL, "integer overflow");
    expect_render_error("{{ (-9223372036854775807 - 1) // -1 }}", NULL, "integer overflow");
    expect_render_error("{{ (-9223372036854775807 - 1) | abs }}", NULL, "integer overflow");
    expect_render_error("{% set ns = namespace(a=1) %}{% set ns.me = ns %}{{ ns | tojson }}", NULL,
                        "a namespace cannot hold another namespace ('ns.me')");
    expect_render_error("{% set ns = namespace(a=1) %}{% set d = {'n': [ns]} %}{% set ns.f = d.items %}", NULL,
                        "cannot hold another namespace");
    expect_render_error("{% set a = namespace(v=0) %}{% set b = namespace(v=[a]) %}", NULL,
                        "namespace() cannot hold another namespace");
    expect_render_error("{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}"
                        "{% endfor %}{{ ns.l | length }}",
                        NULL, "nested values more than 1000 levels deep");
    /* What stays legal answers as Python does. */
    ember_error err = {{0}};
    char *out = render_src("{{ 2 ** 62 }}|{{ 1e300 | int }}|{{ range(9223372036854775800, 9223372036854775807, 5) "
                           "| list }}|{{ [1, 2, 3][1::9223372036854775807] }}|{{ 'abc'[-1::-9223372036854775807] }}"
                           "|{% set ns = namespace(l=[]) %}{% for i in range(900) %}{% set ns.l = [ns.l] %}"
                           "{% endfor %}{{ ns.l | length }}|{% set d = {'k': [1]} %}{% set ns.d = d %}{{ ns.d.k }}",
                           NULL, &err);
    if (out == NULL) fail_msg("%s", err.msg);
    assert_string_equal(out, "4611686018427387904|0|[9223372036854775800, 9223372036854775805]|[2]|c|1|[1]");
    free(out);
}

static void test_engine_features(void **state) {
    (void)state;
    ember_error err = {{0}};
    char *out = render_src("{% generation %}a{{ 1 }}{% endgeneration %}b", NULL, &err);
    assert_string_equal(out, "a1b");
    free(out);
    /* CRLF source and the dropped trailing newline */
    out = render_src("{% if true %}\r\nx\r\n{% endif %}\r\n", NULL, &err);
    assert_string_equal(out, "x\n");
    free(out);
    /* deep recursion stops with an error instead of overflowing */
    expect_render_error("{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}", NULL, "too deep");
    /* floats formatted like Python */
    char buf[64];
    py_float_repr(buf, sizeof buf, 1e16);
    assert_string_equal(buf, "1e+16");
    py_float_repr(buf, sizeof buf, 123456789012345.6);
    assert_string_equal(buf, "123456789012345.6");
    py_float_repr(buf, sizeof buf, 0.0001);
    assert_string_equal(buf, "0.0001");
    py_float_repr(buf, sizeof buf, -2.5e-7);
    assert_string_equal(buf, "-2.5e-07");
    /* strftime_now at a fixed time in UTC */
    setenv("TZ", "UTC", 1);
    tzset();
    chat_template *tpl = chat_template_create("{{ strftime_now('%d %b %Y') }}", &err);
    chat_messages *msgs = chat_messages_create();
    chat_render_opts o = {.enable_thinking = -1, .now = 1700000000};
    assert_int_equal(chat_render(tpl, msgs, NULL, &o, &out, &err), 0);
    assert_string_equal(out, "14 Nov 2023");
    free(out);
    chat_messages_free(msgs);
    chat_template_free(tpl);
}

/* Every prefix of every real template parses or fails cleanly, and what
 * parses renders or fails cleanly (run under ASan in the sanitizer build);
 * hostile nesting is refused instead of exhausting the stack. */
static void test_truncated_templates(void **state) {
    (void)state;
    cJSON *j = cJSON_Parse("[{\"role\": \"system\", \"content\": \"s\"}, {\"role\": \"user\", \"content\": \"u\"}]");
    ember_error err = {{0}};
    chat_messages *m = chat_messages_from_json(j, &err);
    chat_render_opts o = {.add_generation_prompt = true, .enable_thinking = -1};
    int parsed = 0, total = 0;
    for (int i = 0; TEMPLATES[i]; i++) {
        char rel[128];
        snprintf(rel, sizeof rel, "templates/%s.jinja", TEMPLATES[i]);
        char *src = load_text(rel);
        assert_non_null(src);
        size_t len = strlen(src);
        for (size_t cut = 0; cut <= len; cut += 7) {
            char save = src[cut];
            src[cut] = '\0';
            chat_template *t = chat_template_create(src, &err);
            total++;
            if (t) {
                parsed++;
                char *out = NULL;
                if (chat_render(t, m, NULL, &o, &out, &err) == 0) free(out);
                chat_template_free(t);
            } else {
                assert_non_null(strstr(err.msg, "line "));
            }
            src[cut] = save;
        }
        free(src);
    }
    fprintf(stderr, "  %d prefixes, %d parsed\n", total, parsed);
    chat_messages_free(m);
    cJSON_Delete(j);

    char *deep = malloc(200000);
    /* 1000 nested parentheses: under the token limit, over the depth limit */
    memcpy(deep, "{{ ", 3);
    memset(deep + 3, '(', 1000);
    deep[1003] = 'x';
    memset(deep + 1004, ')', 1000);
    strcpy(deep + 2004, " }}");
    assert_null(chat_template_create(deep, &err));
    assert_non_null(strstr(err.msg, "too deeply"));
    /* 5000 nested if blocks */
    for (size_t i = 0; i < 5000; i++) memcpy(deep + i * 10, "{% if x %}", 10);
    deep[50000] = '\0';
    assert_null(chat_template_create(deep, &err));
    assert_non_null(strstr(err.msg, "too deeply"));
    /* a 50000-long attribute chain: a left-deep tree the evaluator would
     * recurse through; refused by the per-tag token limit */
    memcpy(deep, "{{ x", 4);
    for (size_t i = 0; i < 50000; i++) memcpy(deep + 4 + i * 2, ".a", 2);
    strcpy(deep + 4 + 100000, " }}");
    assert_null(chat_template_create(deep, &err));
    assert_non_null(strstr(err.msg, "too long"));
    free(deep);
}

static chat_template *load_template(const char *name);

/* One parsed template rendered from several threads at once. */
typedef struct {
    const chat_template *t;
    chat_messages *m; /* each thread owns its messages */
    const char *want;
    int bad;
} mt_job;

static void *mt_worker(void *arg) {
    mt_job *j = arg;
    chat_render_opts o = {.add_generation_prompt = true, .enable_thinking = -1};
    for (int i = 0; i < 200; i++) {
        char *out = NULL;
        ember_error err = {{0}};
        if (chat_render(j->t, j->m, NULL, &o, &out, &err) != 0 || strcmp(out, j->want) != 0) j->bad++;
        free(out);
    }
    return NULL;
}

static void test_concurrent_render(void **state) {
    (void)state;
    chat_template *t = load_template("qwen3.5");
    ember_error err = {{0}};
    cJSON *j = cJSON_Parse("[{\"role\": \"system\", \"content\": \"s\"}, {\"role\": \"user\", \"content\": \"u\"},"
                           "{\"role\": \"assistant\", \"content\": \"a\"}, {\"role\": \"user\", \"content\": \"v\"}]");
    chat_messages *m = chat_messages_from_json(j, &err);
    chat_render_opts o = {.add_generation_prompt = true, .enable_thinking = -1};
    char *want = NULL;
    assert_int_equal(chat_render(t, m, NULL, &o, &want, &err), 0);
    pthread_t th[4];
    mt_job jobs[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (mt_job){.t = t, .m = chat_messages_from_json(j, &err), .want = want};
        pthread_create(&th[i], NULL, mt_worker, &jobs[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(jobs[i].bad, 0);
        chat_messages_free(jobs[i].m);
    }
    free(want);
    chat_messages_free(m);
    cJSON_Delete(j);
    chat_template_free(t);
}

/* ---- message API ---- */

static void test_messages_api(void **state) {
    (void)state;
    ember_error err = {{0}};
    cJSON *bad = cJSON_Parse("[{\"role\": \"wizard\", \"content\": \"x\"}]");
    assert_null(chat_messages_from_json(bad, &err));
    assert_non_null(strstr(err.msg, "unknown role 'wizard'"));
    cJSON_Delete(bad);
    bad = cJSON_Parse("[{\"role\": \"user\", \"content\": 5}]");
    assert_null(chat_messages_from_json(bad, &err));
    assert_non_null(strstr(err.msg, "messages[0].content"));
    cJSON_Delete(bad);
    bad = cJSON_Parse("[{\"role\": \"assistant\", \"tool_calls\": [{\"function\": {\"arguments\": \"{}\"}}]}]");
    assert_null(chat_messages_from_json(bad, &err));
    assert_non_null(strstr(err.msg, "function.name"));
    cJSON_Delete(bad);
    assert_null(chat_messages_from_json(NULL, &err));

    /* null content -> "", developer -> system, text parts flattened for a
     * template without typed-content support */
    cJSON *j = cJSON_Parse("[{\"role\": \"developer\", \"content\": \"sys\"},"
                           "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"a\"},"
                           "{\"type\": \"text\", \"text\": \"b\"}]},"
                           "{\"role\": \"assistant\", \"content\": null}]");
    chat_messages *m = chat_messages_from_json(j, &err);
    assert_non_null(m);
    assert_int_equal(chat_messages_count(m), 3);
    assert_string_equal(chat_messages_role(m, 0), "system");
    chat_template *tpl = chat_template_chatml();
    char *out = NULL;
    chat_render_opts o = {.add_generation_prompt = true, .enable_thinking = -1};
    assert_int_equal(chat_render(tpl, m, NULL, &o, &out, &err), 0);
    assert_string_equal(out, "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\na\nb<|im_end|>\n"
                             "<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n");
    free(out);
    assert_int_equal(chat_messages_append(m, "user", "more", &err), 0);
    chat_messages *c = chat_messages_clone(m);
    assert_int_equal(chat_messages_count(c), 4);
    chat_messages_free(c);
    chat_messages_free(m);
    chat_template_free(tpl);
    cJSON_Delete(j);
}

static void test_fallback(void **state) {
    (void)state;
    ember_error err = {{0}};
    bool fell = false;
    chat_template *t = chat_template_for_model("{% if %}", &fell, &err);
    assert_non_null(t);
    assert_true(fell);
    assert_non_null(strstr(err.msg, "ChatML"));
    assert_non_null(strstr(err.msg, "line 1"));
    assert_non_null(strstr(chat_template_source(t), "<|im_start|>"));
    chat_template_free(t);
    t = chat_template_for_model(NULL, &fell, &err);
    assert_true(fell);
    chat_template_free(t);
    t = chat_template_for_model("{{ messages[0].content }}", &fell, &err);
    assert_false(fell);
    chat_template_free(t);
}

/* string tool-call arguments reach a mapping-iterating template as objects */
static void test_object_arguments(void **state) {
    (void)state;
    ember_error err = {{0}};
    chat_template *t = chat_template_create(
        "{% for m in messages %}{% for c in m.tool_calls %}"
        "{% for k, v in c.function.arguments|items %}{{ k }}={{ v }};{% endfor %}"
        "{% endfor %}{% endfor %}", &err);
    cJSON *j = cJSON_Parse("[{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": ["
                           "{\"id\": \"1\", \"type\": \"function\", \"function\": {\"name\": \"f\","
                           " \"arguments\": \"{\\\"a\\\": 1, \\\"b\\\": \\\"x\\\"}\"}},"
                           "{\"id\": \"2\", \"type\": \"function\", \"function\": {\"name\": \"g\","
                           " \"arguments\": \"not json\"}}]}]");
    chat_messages *m = chat_messages_from_json(j, &err);
    char *out = NULL;
    assert_int_equal(chat_render(t, m, NULL, NULL, &out, &err), 0);
    assert_string_equal(out, "a=1;b=x;");
    free(out);
    chat_messages_free(m);
    cJSON_Delete(j);
    chat_template_free(t);
}

/* ---- render prediction (prompt-cache reference §8.2, §9) ---- */

static chat_template *load_template(const char *name) {
    char rel[128];
    snprintf(rel, sizeof rel, "templates/%s.jinja", name);
    char *src = load_text(rel);
    assert_non_null(src);
    ember_error err = {{0}};
    chat_template *t = chat_template_create(src, &err);
    free(src);
    assert_non_null(t);
    return t;
}

static void test_predict_next_turn(void **state) {
    (void)state;
    ember_error err = {{0}};
    cJSON *j = cJSON_Parse("[{\"role\": \"system\", \"content\": \"Be brief.\"},"
                           "{\"role\": \"user\", \"content\": \"Hi\"}]");
    chat_messages *m = chat_messages_from_json(j, &err);
    chat_render_opts o = {.add_generation_prompt = true, .enable_thinking = -1};

    /* ChatML: the prediction extends prompt + reply exactly */
    chat_template *t = chat_template_chatml();
    char *prompt = NULL, *pred = NULL;
    assert_int_equal(chat_render(t, m, NULL, &o, &prompt, &err), 0);
    chat_reply r = {.content = "Hello!"};
    assert_int_equal(chat_predict_next_turn(t, m, NULL, &o, &r, &pred, &err), 0);
    char live[512];
    snprintf(live, sizeof live, "%s%s<|im_end|>", prompt, "Hello!");
    assert_int_equal(chat_common_prefix(live, pred), strlen(live));
    assert_string_equal(pred, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                              "<|im_start|>assistant\nHello!<|im_end|>\n");
    free(prompt);
    free(pred);
    chat_template_free(t);

    /* Qwen3: the live sequence holds <think>...</think> which the template
     * keeps for the last turn; with reasoning split out the render matches */
    t = load_template("qwen3");
    assert_int_equal(chat_render(t, m, NULL, &o, &prompt, &err), 0);
    const char *gen = "<think>\nGreet back.\n</think>\n\nHello!";
    char *reasoning = NULL, *content = NULL;
    assert_int_equal(chat_split_reasoning(gen, chat_prompt_opens_thinking(prompt), &reasoning, &content), 0);
    assert_string_equal(reasoning, "Greet back.");
    assert_string_equal(content, "Hello!");
    chat_reply r2 = {.content = content, .reasoning_content = reasoning};
    assert_int_equal(chat_predict_next_turn(t, m, NULL, &o, &r2, &pred, &err), 0);
    snprintf(live, sizeof live, "%s%s<|im_end|>", prompt, gen);
    assert_int_equal(chat_common_prefix(live, pred), strlen(live));
    free(pred);
    free(prompt);
    free(reasoning);
    free(content);

    /* Qwen3.5 opens the think block in the prompt; the next turn with a
     * following user message drops the reasoning: LCP stops right after the
     * assistant header (the documented strip-mode divergence) */
    chat_template_free(t);
    t = load_template("qwen3.5");
    assert_int_equal(chat_render(t, m, NULL, &o, &prompt, &err), 0);
    assert_true(chat_prompt_opens_thinking(prompt));
    assert_int_equal(chat_split_reasoning("Plan.\n</think>\n\nHey!", true, &reasoning, &content), 0);
    assert_string_equal(reasoning, "Plan.");
    assert_string_equal(content, "Hey!");
    chat_reply r3 = {.content = content, .reasoning_content = reasoning};
    assert_int_equal(chat_predict_next_turn(t, m, NULL, &o, &r3, &pred, &err), 0);
    snprintf(live, sizeof live, "%sPlan.\n</think>\n\nHey!<|im_end|>", prompt);
    assert_int_equal(chat_common_prefix(live, pred), strlen(live));
    chat_messages *m2 = chat_messages_clone(m);
    chat_messages_append_reply(m2, &r3, &err);
    chat_messages_append(m2, "user", "Again", &err);
    char *next = NULL;
    assert_int_equal(chat_render(t, m2, NULL, &o, &next, &err), 0);
    size_t header = strlen(prompt) - strlen("<think>\n");
    assert_int_equal(chat_common_prefix(next, live), header);
    free(next);
    chat_messages_free(m2);
    free(pred);
    free(prompt);
    free(reasoning);
    free(content);

    /* thinking text without a close marker while the prompt left the block
     * open is all reasoning */
    assert_int_equal(chat_split_reasoning("still thinking", true, &reasoning, &content), 0);
    assert_string_equal(reasoning, "still thinking");
    assert_null(content);
    free(reasoning);
    assert_int_equal(chat_split_reasoning("plain", false, &reasoning, &content), 0);
    assert_null(reasoning);
    assert_string_equal(content, "plain");
    free(content);

    /* p_stable: no generation prompt */
    char *stable = NULL;
    assert_int_equal(chat_render_stable(t, m, NULL, &o, &stable, &err), 0);
    assert_null(strstr(stable, "<|im_start|>assistant"));
    free(stable);

    /* tool calls in the reply re-render through the template */
    cJSON *calls = cJSON_Parse("[{\"id\": \"c1\", \"type\": \"function\", \"function\": "
                               "{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}}]");
    chat_reply r4 = {.content = "", .tool_calls = calls};
    assert_int_equal(chat_predict_next_turn(t, m, NULL, &o, &r4, &pred, &err), 0);
    assert_non_null(strstr(pred, "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>"));
    free(pred);
    cJSON_Delete(calls);

    chat_template_free(t);
    chat_messages_free(m);
    cJSON_Delete(j);
}

static void test_system_anchor(void **state) {
    (void)state;
    ember_error err = {{0}};
    cJSON *j = cJSON_Parse("[{\"role\": \"system\", \"content\": \"You are terse.\"},"
                           "{\"role\": \"user\", \"content\": \"Question one\"}]");
    chat_messages *m = chat_messages_from_json(j, &err);
    chat_render_opts o = {.add_generation_prompt = true, .enable_thinking = -1, .bos_token = "<bos>"};
    size_t off = 0;
    char *probe = NULL;

    chat_template *t = chat_template_chatml();
    assert_int_equal(chat_system_prefix_anchor(t, m, NULL, &o, &off, &probe, &err), 1);
    const char *want = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n";
    assert_int_equal(off, strlen(want));
    assert_memory_equal(probe, want, off);
    free(probe);
    chat_template_free(t);

    /* Gemma folds the system prompt into the first user turn; both probes
     * fold identically */
    t = load_template("gemma3");
    assert_int_equal(chat_system_prefix_anchor(t, m, NULL, &o, &off, &probe, &err), 1);
    want = "<bos><start_of_turn>user\nYou are terse.\n\n";
    assert_int_equal(off, strlen(want));
    assert_memory_equal(probe, want, off);
    free(probe);

    /* not applicable without a leading system message or without a follower */
    cJSON *j2 = cJSON_Parse("[{\"role\": \"user\", \"content\": \"x\"}]");
    chat_messages *m2 = chat_messages_from_json(j2, &err);
    assert_int_equal(chat_system_prefix_anchor(t, m2, NULL, &o, &off, &probe, &err), 0);
    chat_messages_free(m2);
    cJSON_Delete(j2);
    j2 = cJSON_Parse("[{\"role\": \"system\", \"content\": \"x\"}]");
    m2 = chat_messages_from_json(j2, &err);
    assert_int_equal(chat_system_prefix_anchor(t, m2, NULL, &o, &off, NULL, &err), 0);
    chat_messages_free(m2);
    cJSON_Delete(j2);
    chat_template_free(t);

    chat_messages_free(m);
    cJSON_Delete(j);
}

int main(void) {
    setenv("TZ", "UTC", 1);
    tzset();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_template_vectors),
        cmocka_unit_test(test_micro_vectors),
        cmocka_unit_test(test_parse_errors),
        cmocka_unit_test(test_render_errors),
        cmocka_unit_test(test_render_limits),
        cmocka_unit_test(test_render_hostile),
        cmocka_unit_test(test_engine_features),
        cmocka_unit_test(test_truncated_templates),
        cmocka_unit_test(test_concurrent_render),
        cmocka_unit_test(test_messages_api),
        cmocka_unit_test(test_fallback),
        cmocka_unit_test(test_object_arguments),
        cmocka_unit_test(test_predict_next_turn),
        cmocka_unit_test(test_system_anchor),
    };
    return test_run_group(tests, NULL, NULL);
}
