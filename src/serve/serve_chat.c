/* serve_chat.c - messages -> prompt text (see serve_chat.h).
 *
 * The model's own template (tokenizer.chat_template) is parsed once by
 * src/chat; a missing or unparseable one falls back to ChatML with a
 * warning at load. Before rendering, the messages are checked here with
 * OpenAI's error conventions (param names like messages[2].role), because
 * chat_messages_from_json is lenient where the API is strict (a user
 * message without content).
 *
 * Every string of the request (message fields, content parts, tool calls,
 * tools, template kwargs) is defused before rendering (tokenizer.h:
 * tokenizer_defuse_specials), so text a user wrote never becomes a control
 * token and cannot open or close a turn; the render is tokenized with
 * tokenizer_encode_rendered. chat.parse_special_in_content turns that off.
 *
 * The cache plan re-renders the validated messages (defused the same way)
 * without a generation prompt (and with the "0" probe) and tokenizes those
 * renders exactly as serve_api.c tokenizes the prompt (one BOS unless the
 * render starts with it; the template's special tokens parsed), so positions are common-prefix lengths in the
 * prompt's own tokens. The predictor keeps its own copies of the messages,
 * tools, kwargs and token texts: it runs on the scheduler's thread, after
 * the HTTP request's JSON is gone. */
#include "serve/serve_chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat/chat.h"
#include "core/log.h"
#include "tokenizer/tokenizer.h"

struct serve_chat {
    chat_template *tpl;
    const tokenizer *tok;
    bool parse_special_in_content; /* the old, unsafe behaviour: no defusing */
    char *bos, *eos;
    tool_syntax tools;
};

static char *token_text(const tokenizer *t, int32_t id) {
    size_t n = 0;
    const char *s = id >= 0 ? tokenizer_token_text(t, id, &n) : NULL;
    return s ? strndup(s, n) : NULL;
}

serve_chat *serve_chat_create(const model *m, ember_error *err) {
    serve_chat *c = calloc(1, sizeof *c);
    if (c == NULL) {
        ember_fail(err, "chat: out of memory");
        return NULL;
    }
    const tokenizer *tok = model_get_tokenizer(m);
    c->tok = tok;
    bool fell_back = false;
    ember_error why;
    why.msg[0] = 0;
    c->tpl = chat_template_for_model(tokenizer_chat_template(tok), &fell_back, &why);
    if (c->tpl == NULL) {
        ember_fail(err, "chat: out of memory for the template");
        free(c);
        return NULL;
    }
    if (fell_back)
        ember_log(EMBER_LOG_WARN, "chat template: %s", why.msg[0] ? why.msg : "the model has none; using ChatML");
    else
        ember_log(EMBER_LOG_INFO, "chat template: the model's own (%zu bytes)",
                  strlen(chat_template_source(c->tpl)));
    c->tools = tool_syntax_for_template(chat_template_source(c->tpl));
    ember_log(EMBER_LOG_INFO, "tool calls in replies are parsed as %s", tool_syntax_name(c->tools));
    c->bos = token_text(tok, tokenizer_bos(tok));
    c->eos = token_text(tok, tokenizer_eos(tok));
    return c;
}

void serve_chat_free(serve_chat *c) {
    if (c == NULL) return;
    chat_template_free(c->tpl);
    free(c->bos);
    free(c->eos);
    free(c);
}

tool_syntax serve_chat_tool_syntax(const serve_chat *c) { return c->tools; }

void serve_chat_set_parse_special_in_content(serve_chat *c, bool on) { c->parse_special_in_content = on; }

/* A defused deep copy of j (NULL stays NULL); *failed on out of memory. */
static cJSON *defused_copy(const serve_chat *c, const cJSON *j, bool *failed) {
    if (j == NULL) return NULL;
    cJSON *d = cJSON_Duplicate(j, true);
    if (d == NULL || chat_json_defuse(c->tok, d) < 0) {
        cJSON_Delete(d);
        *failed = true;
        return NULL;
    }
    return d;
}

static bool role_ok(const char *r) {
    static const char *roles[] = {"system", "user", "assistant", "tool", "developer"};
    for (size_t i = 0; i < sizeof roles / sizeof roles[0]; i++)
        if (strcmp(r, roles[i]) == 0) return true;
    return false;
}

int serve_chat_render(const serve_chat *c, const cJSON *messages, const cJSON *tools, const cJSON *kwargs,
                      char **out, bool *thinking_open, char *param, size_t param_cap, ember_error *err) {
    *out = NULL;
    *thinking_open = false;
    int i = 0;
    const cJSON *msg;
    cJSON_ArrayForEach(msg, messages) {
        if (!cJSON_IsObject(msg)) {
            snprintf(param, param_cap, "messages[%d]", i);
            return ember_fail(err, "Invalid type for 'messages[%d]': expected an object.", i);
        }
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(msg, "role");
        if (role == NULL) {
            snprintf(param, param_cap, "messages[%d].role", i);
            return ember_fail(err, "Missing required parameter: 'messages[%d].role'.", i);
        }
        if (!cJSON_IsString(role)) {
            snprintf(param, param_cap, "messages[%d].role", i);
            return ember_fail(err, "Invalid type for 'messages[%d].role': expected a string.", i);
        }
        if (!role_ok(role->valuestring)) {
            snprintf(param, param_cap, "messages[%d].role", i);
            return ember_fail(err,
                              "Invalid value: '%.64s'. Supported values are: 'system', 'assistant', 'user', 'tool', "
                              "and 'developer'.",
                              role->valuestring);
        }
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(msg, "content");
        const cJSON *calls = cJSON_GetObjectItemCaseSensitive(msg, "tool_calls");
        bool is_asst = strcmp(role->valuestring, "assistant") == 0;
        if ((content == NULL || cJSON_IsNull(content)) && !is_asst) {
            snprintf(param, param_cap, "messages[%d].content", i);
            return ember_fail(err, "Missing required parameter: 'messages[%d].content'.", i);
        }
        if (content && !cJSON_IsNull(content) && !cJSON_IsString(content)) {
            if (!cJSON_IsArray(content)) {
                snprintf(param, param_cap, "messages[%d].content", i);
                return ember_fail(err, "Invalid type for 'messages[%d].content': expected a string, an array or null.",
                                  i);
            }
            const cJSON *part;
            int j = 0;
            cJSON_ArrayForEach(part, content) {
                const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
                const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
                if (!cJSON_IsObject(part) || !cJSON_IsString(type) || strcmp(type->valuestring, "text") != 0 ||
                    !cJSON_IsString(text)) {
                    snprintf(param, param_cap, "messages[%d].content[%d]", i, j);
                    return ember_fail(err,
                                      "Invalid content part 'messages[%d].content[%d]': only {\"type\": \"text\", "
                                      "\"text\": ...} parts are supported.",
                                      i, j);
                }
                j++;
            }
        }
        if (calls && !cJSON_IsNull(calls) && (!is_asst || !cJSON_IsArray(calls))) {
            snprintf(param, param_cap, "messages[%d].tool_calls", i);
            return ember_fail(err, "Invalid 'messages[%d].tool_calls': expected an array on an assistant message.", i);
        }
        i++;
    }
    /* user text is defused; only the template's markup stays live */
    cJSON *own_msgs = NULL, *own_tools = NULL, *own_kwargs = NULL;
    if (!c->parse_special_in_content) {
        bool failed = false;
        own_msgs = defused_copy(c, messages, &failed);
        own_tools = defused_copy(c, tools, &failed);
        own_kwargs = defused_copy(c, kwargs, &failed);
        if (failed) {
            cJSON_Delete(own_msgs);
            cJSON_Delete(own_tools);
            cJSON_Delete(own_kwargs);
            snprintf(param, param_cap, "messages");
            return ember_fail(err, "out of memory");
        }
        messages = own_msgs;
        tools = own_tools;
        kwargs = own_kwargs;
    }
    chat_messages *msgs = chat_messages_from_json(messages, err);
    if (msgs == NULL) {
        cJSON_Delete(own_msgs);
        cJSON_Delete(own_tools);
        cJSON_Delete(own_kwargs);
        snprintf(param, param_cap, "messages");
        return -1;
    }
    chat_render_opts opts;
    memset(&opts, 0, sizeof opts);
    opts.add_generation_prompt = true;
    opts.enable_thinking = -1;
    opts.bos_token = c->bos;
    opts.eos_token = c->eos;
    opts.extra = kwargs && cJSON_IsObject(kwargs) ? kwargs : NULL;
    const cJSON *t = tools && cJSON_IsArray(tools) && cJSON_GetArraySize(tools) > 0 ? tools : NULL;
    int rc = chat_render(c->tpl, msgs, t, &opts, out, err);
    chat_messages_free(msgs);
    cJSON_Delete(own_msgs);
    cJSON_Delete(own_tools);
    cJSON_Delete(own_kwargs);
    if (rc < 0) {
        snprintf(param, param_cap, "messages");
        ember_fail_prefix(err, "the chat template failed: ");
        return -1;
    }
    *thinking_open = chat_prompt_opens_thinking(*out);
    return 0;
}

/* ---- the cache plan (src/chat/chat_plan.c) ---- */

void serve_chat_cache_plan(const serve_chat *c, const tokenizer *tok, const cJSON *messages, const cJSON *tools,
                           const cJSON *kwargs, const int32_t *prompt, int64_t n_prompt, bool thinking_open,
                           chat_cache_plan *out) {
    memset(out, 0, sizeof *out);
    ember_error err;
    cJSON *own_msgs = NULL, *own_tools = NULL, *own_kwargs = NULL;
    if (!c->parse_special_in_content) { /* rendered as serve_chat_render rendered the prompt */
        bool failed = false;
        own_msgs = defused_copy(c, messages, &failed);
        own_tools = defused_copy(c, tools, &failed);
        own_kwargs = defused_copy(c, kwargs, &failed);
        messages = own_msgs;
        tools = own_tools;
        kwargs = own_kwargs;
        if (failed) goto done;
    }
    chat_messages *msgs = chat_messages_from_json(messages, &err);
    if (msgs == NULL) goto done;
    chat_plan_params p;
    memset(&p, 0, sizeof p);
    p.tpl = c->tpl;
    p.tok = tok;
    p.messages = msgs;
    p.tools = tools;
    p.kwargs = kwargs;
    p.bos = c->bos;
    p.eos = c->eos;
    p.prompt = prompt;
    p.n_prompt = n_prompt;
    p.thinking_open = thinking_open;
    p.defuse_replies = !c->parse_special_in_content;
    chat_cache_plan_make(&p, out);
    chat_messages_free(msgs);
done:
    cJSON_Delete(own_msgs);
    cJSON_Delete(own_tools);
    cJSON_Delete(own_kwargs);
}
