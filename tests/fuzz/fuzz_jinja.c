/* fuzz_jinja.c - libFuzzer target for the Jinja-subset template engine.
 *
 * The input is a template source (chat templates come inside model files,
 * so they are outside input). jinja_parse either builds an AST or fails with
 * a message carrying a line and column; a parsed template is rendered with
 * the variables a chat render passes (messages with a system prompt, user
 * turns, an assistant turn with tool calls and a tool result; tools;
 * add_generation_prompt; bos/eos tokens) under small limits (20,000 steps,
 * 1 MiB), so that a template that loops or allocates without bound stops
 * with an error quickly, as it does under the default limits in service.
 * A failed render must carry a message, a successful one stays within the
 * byte limit. Seeds (tests/fuzz/jinja/corpus) are the real chat templates
 * of tests/data/chat/vectors plus small templates using each construct. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat/jinja.h"
#include "fuzz_target.h"

#define FUZZ_MAX_STEPS 20000
#define FUZZ_MAX_BYTES ((size_t)1 << 20)

static jv msg(const char *role, const char *content) {
    jv m = jv_dict(4);
    jv_dict_set(m, "role", 4, jv_cstr(role));
    jv_dict_set(m, "content", 7, jv_cstr(content));
    return m;
}

static jv g_vars;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    jv msgs = jv_list(8);
    jv_list_push(msgs, msg("system", "You are a helpful assistant."));
    jv_list_push(msgs, msg("user", "What is the weather in Paris?"));
    jv call = jv_dict(3);
    jv_dict_set(call, "type", 4, jv_cstr("function"));
    jv fn = jv_dict(2);
    jv_dict_set(fn, "name", 4, jv_cstr("get_weather"));
    jv args = jv_dict(1);
    jv_dict_set(args, "city", 4, jv_cstr("Paris"));
    jv_dict_set(fn, "arguments", 9, args);
    jv_dict_set(call, "function", 8, fn);
    jv calls = jv_list(1);
    jv_list_push(calls, call);
    jv asst = msg("assistant", "");
    jv_dict_set(asst, "tool_calls", 10, calls);
    jv_list_push(msgs, asst);
    jv tool = msg("tool", "{\"temp\": 21}");
    jv_dict_set(tool, "tool_call_id", 12, jv_cstr("call_1"));
    jv_list_push(msgs, tool);
    jv_list_push(msgs, msg("assistant", "<think>\nwarm\n</think>\n\nIt is 21 degrees."));
    jv_list_push(msgs, msg("user", "Thanks! \xC3\xA9\xE2\x82\xAC"));
    jv tools = jv_list(1);
    jv t = jv_dict(2);
    jv_dict_set(t, "type", 4, jv_cstr("function"));
    jv tf = jv_dict(3);
    jv_dict_set(tf, "name", 4, jv_cstr("get_weather"));
    jv_dict_set(tf, "description", 11, jv_cstr("Weather of a city"));
    jv params = jv_dict(2);
    jv_dict_set(params, "type", 4, jv_cstr("object"));
    jv_dict_set(tf, "parameters", 10, params);
    jv_dict_set(t, "function", 8, tf);
    jv_list_push(tools, t);
    g_vars = jv_dict(8);
    jv_dict_set(g_vars, "messages", 8, msgs);
    jv_dict_set(g_vars, "tools", 5, tools);
    jv_dict_set(g_vars, "add_generation_prompt", 21, jv_bool(true));
    jv_dict_set(g_vars, "bos_token", 9, jv_cstr("<s>"));
    jv_dict_set(g_vars, "eos_token", 9, jv_cstr("</s>"));
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 65536) return 0;
    char *src = malloc(size + 1);
    memcpy(src, data, size);
    src[size] = '\0';
    ember_error err;
    err.msg[0] = '\0';
    jinja_template *t = jinja_parse(src, &err);
    if (t == NULL) {
        if (strstr(err.msg, "line ") == NULL) abort(); /* parse errors carry a position */
        free(src);
        return 0;
    }
    const jinja_limits lim = {FUZZ_MAX_STEPS, FUZZ_MAX_BYTES};
    char *out = NULL;
    err.msg[0] = '\0';
    if (jinja_render_limited(t, g_vars, 1700000000, &lim, &out, &err) < 0) {
        if (out != NULL || err.msg[0] == '\0') abort();
    } else if (out == NULL || strlen(out) >= FUZZ_MAX_BYTES) {
        abort();
    }
    free(out);
    jinja_free(t);
    free(src);
    return 0;
}
