/* serve_chat.c - messages -> prompt text (see serve_chat.h).
 *
 * The model's own template (tokenizer.chat_template) is parsed once by
 * src/chat; a missing or unparseable one falls back to ChatML with a
 * warning at load. Before rendering, the messages are checked here with
 * OpenAI's error conventions (param names like messages[2].role), because
 * chat_messages_from_json is lenient where the API is strict (a user
 * message without content).
 *
 * The cache plan re-renders the validated messages without a generation
 * prompt (and with the "0" probe) and tokenizes those renders exactly as
 * serve_api.c tokenizes the prompt (one BOS unless the render starts with
 * it; special tokens parsed), so positions are common-prefix lengths in the
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
        ember_log(EMBER_LOG_WARN, "chat template: %s; rendering ChatML instead",
                  why.msg[0] ? why.msg : "the model has none");
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
    chat_messages *msgs = chat_messages_from_json(messages, err);
    if (msgs == NULL) {
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
    if (rc < 0) {
        snprintf(param, param_cap, "messages");
        ember_fail_prefix(err, "the chat template failed: ");
        return -1;
    }
    *thinking_open = chat_prompt_opens_thinking(*out);
    return 0;
}

/* ---- the cache plan ---- */

static int encode_like_prompt(const tokenizer *tok, const char *text, int32_t **ids, size_t *n) {
    ember_error err;
    bool bos = tokenizer_add_bos(tok);
    if (bos) {
        size_t bl = 0;
        const char *bt = tokenizer_token_text(tok, tokenizer_bos(tok), &bl);
        if (bt && bl > 0 && strncmp(text, bt, bl) == 0) bos = false;
    }
    return tokenizer_encode(tok, text, strlen(text), bos, true, ids, n, &err);
}

static int64_t common_prefix(const int32_t *a, int64_t na, const int32_t *b, int64_t nb) {
    int64_t i = 0;
    while (i < na && i < nb && a[i] == b[i]) i++;
    return i;
}

/* Common prefix of text's tokens with ids[0, n); -1 when it cannot tokenize. */
static int64_t text_prefix(const tokenizer *tok, const char *text, const int32_t *ids, int64_t n) {
    int32_t *t = NULL;
    size_t k = 0;
    if (encode_like_prompt(tok, text, &t, &k) < 0) return -1;
    int64_t l = common_prefix(t, (int64_t)k, ids, n);
    free(t);
    return l;
}

typedef struct predictor {
    const chat_template *tpl;
    const tokenizer *tok;
    chat_messages *msgs;
    cJSON *tools, *kwargs;
    char *bos, *eos;
    chat_render_opts opts;
    int64_t n_prompt;
    bool thinking_open;
} predictor;

void serve_chat_predictor_free(void *user) {
    predictor *p = user;
    if (p == NULL) return;
    chat_messages_free(p->msgs);
    cJSON_Delete(p->tools);
    cJSON_Delete(p->kwargs);
    free(p->bos);
    free(p->eos);
    free(p);
}

static char *decode_reply(const tokenizer *tok, const int32_t *ids, int64_t n) {
    tok_stream *s = tok_stream_create(tok, false);
    size_t cap = 256, len = 0, k;
    char *out = malloc(cap);
    if (s == NULL || out == NULL) {
        tok_stream_free(s);
        free(out);
        return NULL;
    }
    for (int64_t i = 0; i <= n; i++) {
        const char *piece = i < n ? tok_stream_push(s, ids[i], &k) : tok_stream_flush(s, &k);
        if (len + k + 1 > cap) {
            while (len + k + 1 > cap) cap *= 2;
            char *o = realloc(out, cap);
            if (o == NULL) {
                free(out);
                tok_stream_free(s);
                return NULL;
            }
            out = o;
        }
        memcpy(out + len, piece, k);
        len += k;
    }
    out[len] = 0;
    tok_stream_free(s);
    return out;
}

int64_t serve_chat_predict(void *user, const int32_t *tokens, int64_t n) {
    predictor *p = user;
    if (p == NULL || n < p->n_prompt) return -1;
    char *text = decode_reply(p->tok, tokens + p->n_prompt, n - p->n_prompt);
    if (text == NULL) return -1;
    char *reasoning = NULL, *content = NULL, *out = NULL;
    int64_t got = -1;
    if (chat_split_reasoning(text, p->thinking_open, &reasoning, &content) == 0) {
        chat_reply r = {content ? content : "", reasoning, NULL};
        ember_error err;
        if (chat_predict_next_turn(p->tpl, p->msgs, p->tools, &p->opts, &r, &out, &err) == 0)
            got = text_prefix(p->tok, out, tokens, n);
    }
    free(out);
    free(reasoning);
    free(content);
    free(text);
    return got;
}

void serve_chat_cache_plan(const serve_chat *c, const tokenizer *tok, const cJSON *messages, const cJSON *tools,
                           const cJSON *kwargs, const int32_t *prompt, int64_t n_prompt, bool thinking_open,
                           serve_chat_plan *out) {
    memset(out, 0, sizeof *out);
    ember_error err;
    predictor *p = calloc(1, sizeof *p);
    if (p == NULL) return;
    p->msgs = chat_messages_from_json(messages, &err);
    p->tools = tools && cJSON_IsArray(tools) && cJSON_GetArraySize(tools) > 0 ? cJSON_Duplicate(tools, 1) : NULL;
    p->kwargs = kwargs && cJSON_IsObject(kwargs) ? cJSON_Duplicate(kwargs, 1) : NULL;
    p->bos = c->bos ? strdup(c->bos) : NULL;
    p->eos = c->eos ? strdup(c->eos) : NULL;
    if (p->msgs == NULL || (c->bos && !p->bos) || (c->eos && !p->eos)) {
        serve_chat_predictor_free(p);
        return;
    }
    p->tpl = c->tpl;
    p->tok = tok;
    p->n_prompt = n_prompt;
    p->thinking_open = thinking_open;
    p->opts.add_generation_prompt = false;
    p->opts.enable_thinking = -1;
    p->opts.bos_token = p->bos;
    p->opts.eos_token = p->eos;
    p->opts.extra = p->kwargs;
    char *text = NULL;
    if (chat_render_stable(c->tpl, p->msgs, p->tools, &p->opts, &text, &err) == 0) {
        int64_t l = text_prefix(tok, text, prompt, n_prompt);
        if (l > 0) out->turn_pos = l;
    }
    free(text);
    size_t off = 0;
    char *probe = NULL;
    if (chat_system_prefix_anchor(c->tpl, p->msgs, p->tools, &p->opts, &off, &probe, &err) == 1 && probe) {
        int64_t l = text_prefix(tok, probe, prompt, n_prompt);
        if (l > 0) out->anchor_pos = l;
    }
    free(probe);
    out->predict = serve_chat_predict;
    out->predictor = p;
}
