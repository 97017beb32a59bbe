/* chat.c - conversations rendered through chat templates (see chat.h).
 *
 * Design: a chat_messages is a list value of message dicts converted from
 * cJSON once (key order kept), so rendering only builds the small variable
 * dict and walks the template. Two template capabilities are read off the
 * source at creation, the way llama.cpp probes them: whether the template
 * iterates tool-call arguments as a mapping (then string arguments are
 * decoded to objects at render time; invalid JSON becomes {}), and whether
 * it understands typed content parts (mentions a 'text' literal; else a
 * list of text parts is joined with "\n" into one string). The render
 * variables are those transformers passes: messages, tools (none when
 * absent), documents (none), add_generation_prompt, bos_token, eos_token,
 * enable_thinking only when the caller sets it, then the caller's extras.
 * Cache prediction (prompt-cache reference §8.2, §9) is plain re-rendering:
 * the next-turn render appends the reply as an assistant message; the
 * system anchor renders two probes that differ only in the first user
 * message and measures their common prefix in bytes. */
#include "chat/chat.h"

#include <stdlib.h>
#include <string.h>

#include "chat/jinja.h"

struct chat_template {
    jinja_template *tpl;
    char *source;
    bool object_arguments;
    bool typed_content;
};

struct chat_messages {
    jv list;
};

static const char CHATML_SOURCE[] =
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

/* ---- cJSON <-> values ---- */

static jv from_json(const cJSON *j) {
    if (j == NULL) return jv_undef();
    if (cJSON_IsNull(j)) return jv_none();
    if (cJSON_IsTrue(j)) return jv_bool(true);
    if (cJSON_IsFalse(j)) return jv_bool(false);
    if (cJSON_IsNumber(j)) {
        double d = j->valuedouble;
        if (d == (double)(int64_t)d && d > -9007199254740992.0 && d < 9007199254740992.0)
            return jv_int((int64_t)d);
        return jv_float(d);
    }
    if (cJSON_IsString(j)) return jv_cstr(j->valuestring ? j->valuestring : "");
    if (cJSON_IsArray(j)) {
        jv l = jv_list((size_t)cJSON_GetArraySize(j));
        const cJSON *it;
        cJSON_ArrayForEach(it, j) jv_list_push(l, from_json(it));
        return l;
    }
    if (cJSON_IsObject(j)) {
        jv d = jv_dict((size_t)cJSON_GetArraySize(j));
        const cJSON *it;
        cJSON_ArrayForEach(it, j) {
            const char *k = it->string ? it->string : "";
            jv_dict_set(d, k, strlen(k), from_json(it));
        }
        return d;
    }
    return jv_none();
}

static jv dict_copy(jv d) {
    jv r = jv_dict(d.u.d->n);
    for (size_t i = 0; i < d.u.d->n; i++)
        jv_dict_set(r, d.u.d->keys[i]->data, d.u.d->keys[i]->len, jv_retain(d.u.d->vals[i]));
    return r;
}

/* ---- templates ---- */

static chat_template *template_new(const char *source, ember_error *err) {
    jinja_template *t = jinja_parse(source, err);
    if (t == NULL) return NULL;
    chat_template *ct = calloc(1, sizeof *ct);
    if (ct == NULL) {
        jinja_free(t);
        ember_fail(err, "out of memory");
        return NULL;
    }
    ct->tpl = t;
    ct->source = strdup(source);
    if (ct->source == NULL) {
        jinja_free(t);
        free(ct);
        ember_fail(err, "out of memory");
        return NULL;
    }
    ct->object_arguments = strstr(source, "arguments|items") || strstr(source, "arguments | items") ||
                           strstr(source, "arguments.items()");
    ct->typed_content = strstr(source, "'text'") || strstr(source, "\"text\"");
    return ct;
}

/* ---- messages ---- */

static int validate_message(const cJSON *m, size_t index, jv *out, ember_error *err) {
    if (!cJSON_IsObject(m)) return ember_fail(err, "messages[%zu]: not an object", index);
    const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
    if (!cJSON_IsString(role)) return ember_fail(err, "messages[%zu].role: missing or not a string", index);
    const char *r = role->valuestring;
    bool developer = strcmp(r, "developer") == 0;
    if (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant") && strcmp(r, "tool") && !developer)
        return ember_fail(err, "messages[%zu].role: unknown role '%s'", index, r);
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
    if (content && !cJSON_IsNull(content) && !cJSON_IsString(content)) {
        if (!cJSON_IsArray(content))
            return ember_fail(err, "messages[%zu].content: must be a string, null or an array of parts", index);
        size_t k = 0;
        const cJSON *part;
        cJSON_ArrayForEach(part, content) {
            const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
            if (!cJSON_IsObject(part) || !cJSON_IsString(type))
                return ember_fail(err, "messages[%zu].content[%zu]: a part needs a string 'type'", index, k);
            if (strcmp(type->valuestring, "text") == 0 &&
                !cJSON_IsString(cJSON_GetObjectItemCaseSensitive(part, "text")))
                return ember_fail(err, "messages[%zu].content[%zu].text: missing or not a string", index, k);
            k++;
        }
    }
    const cJSON *calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
    if (calls && !cJSON_IsNull(calls)) {
        if (!cJSON_IsArray(calls)) return ember_fail(err, "messages[%zu].tool_calls: must be an array", index);
        size_t k = 0;
        const cJSON *call;
        cJSON_ArrayForEach(call, calls) {
            const cJSON *fn = cJSON_GetObjectItemCaseSensitive(call, "function");
            if (!cJSON_IsObject(call) || !cJSON_IsObject(fn))
                return ember_fail(err, "messages[%zu].tool_calls[%zu]: needs a 'function' object", index, k);
            if (!cJSON_IsString(cJSON_GetObjectItemCaseSensitive(fn, "name")))
                return ember_fail(err, "messages[%zu].tool_calls[%zu].function.name: missing or not a string",
                                  index, k);
            const cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
            if (args && !cJSON_IsString(args) && !cJSON_IsObject(args))
                return ember_fail(err,
                                  "messages[%zu].tool_calls[%zu].function.arguments: must be a JSON string or an object",
                                  index, k);
            k++;
        }
    }
    jv d = from_json(m);
    if (developer) jv_dict_set(d, "role", 4, jv_cstr("system"));
    const jv *c = jv_dict_get(d, "content", 7);
    if (c == NULL || c->t == JV_NONE) jv_dict_set(d, "content", 7, jv_cstr(""));
    *out = d;
    return 0;
}

/* A message as the template should see it (new reference). */
static jv prepare_message(const chat_template *t, jv m) {
    const jv *content = jv_dict_get(m, "content", 7);
    const jv *calls = jv_dict_get(m, "tool_calls", 10);
    bool flatten = !t->typed_content && content && content->t == JV_LIST;
    bool objargs = false;
    if (t->object_arguments && calls && calls->t == JV_LIST) {
        for (size_t i = 0; i < calls->u.l->n; i++) {
            const jv *fn = jv_dict_get(calls->u.l->items[i], "function", 8);
            const jv *args = fn ? jv_dict_get(*fn, "arguments", 9) : NULL;
            if (args && args->t == JV_STR) objargs = true;
        }
    }
    if (!flatten && !objargs) return jv_retain(m);
    jv r = dict_copy(m);
    if (flatten) {
        jbuf b = {0};
        jbuf_put(&b, "", 0);
        bool first = true;
        for (size_t i = 0; i < content->u.l->n; i++) {
            jv part = content->u.l->items[i];
            const jv *type = jv_dict_get(part, "type", 4);
            const jv *text = jv_dict_get(part, "text", 4);
            if (type && type->t == JV_STR && strcmp(type->u.s->data, "text") == 0 && text && text->t == JV_STR) {
                if (!first) jbuf_putc(&b, '\n');
                jbuf_put(&b, text->u.s->data, text->u.s->len);
                first = false;
            }
        }
        jv_dict_set(r, "content", 7, jv_str(b.p, b.n));
        free(b.p);
    }
    if (objargs) {
        jv nc = jv_list(calls->u.l->n);
        for (size_t i = 0; i < calls->u.l->n; i++) {
            jv call = calls->u.l->items[i];
            const jv *fn = jv_dict_get(call, "function", 8);
            const jv *args = fn ? jv_dict_get(*fn, "arguments", 9) : NULL;
            if (args == NULL || args->t != JV_STR) {
                jv_list_push(nc, jv_retain(call));
                continue;
            }
            cJSON *parsed = cJSON_Parse(args->u.s->data);
            jv obj = cJSON_IsObject(parsed) ? from_json(parsed) : jv_dict(0);
            cJSON_Delete(parsed);
            jv nfn = dict_copy(*fn);
            jv_dict_set(nfn, "arguments", 9, obj);
            jv ncall = dict_copy(call);
            jv_dict_set(ncall, "function", 8, nfn);
            jv_list_push(nc, ncall);
        }
        jv_dict_set(r, "tool_calls", 10, nc);
    }
    return r;
}

static int render_list(const chat_template *t, jv list, const cJSON *tools, const chat_render_opts *opts,
                       bool add_generation_prompt, char **out, ember_error *err) {
    chat_render_opts dflt = {.enable_thinking = -1};
    if (opts == NULL) opts = &dflt;
    jv msgs = jv_list(list.u.l->n);
    for (size_t i = 0; i < list.u.l->n; i++) jv_list_push(msgs, prepare_message(t, list.u.l->items[i]));
    jv vars = jv_dict(12);
    jv_dict_set(vars, "messages", 8, msgs);
    jv_dict_set(vars, "tools", 5, tools && !cJSON_IsNull(tools) ? from_json(tools) : jv_none());
    jv_dict_set(vars, "documents", 9, jv_none());
    jv_dict_set(vars, "add_generation_prompt", 21, jv_bool(add_generation_prompt));
    jv_dict_set(vars, "bos_token", 9, jv_cstr(opts->bos_token ? opts->bos_token : ""));
    jv_dict_set(vars, "eos_token", 9, jv_cstr(opts->eos_token ? opts->eos_token : ""));
    if (opts->enable_thinking >= 0) jv_dict_set(vars, "enable_thinking", 15, jv_bool(opts->enable_thinking != 0));
    if (cJSON_IsObject(opts->extra)) {
        const cJSON *it;
        cJSON_ArrayForEach(it, opts->extra) {
            if (it->string) jv_dict_set(vars, it->string, strlen(it->string), from_json(it));
        }
    }
    int rc = jinja_render(t->tpl, vars, opts->now, out, err);
    jv_release(vars);
    return rc;
}

static jv reply_value(const chat_reply *reply) {
    jv m = jv_dict(5);
    jv_dict_set(m, "role", 4, jv_cstr("assistant"));
    jv_dict_set(m, "content", 7, jv_cstr(reply && reply->content ? reply->content : ""));
    if (reply && reply->reasoning_content) {
        jv_dict_set(m, "reasoning_content", 17, jv_cstr(reply->reasoning_content));
        jv_dict_set(m, "reasoning", 9, jv_cstr(reply->reasoning_content));
    }
    if (reply && cJSON_IsArray(reply->tool_calls) && cJSON_GetArraySize(reply->tool_calls) > 0)
        jv_dict_set(m, "tool_calls", 10, from_json(reply->tool_calls));
    return m;
}

/* ---- API: templates ---- */

chat_template *chat_template_create(const char *source, ember_error *err) {
    if (source == NULL) {
        ember_fail(err, "no template source");
        return NULL;
    }
    return template_new(source, err);
}

chat_template *chat_template_chatml(void) { return template_new(CHATML_SOURCE, NULL); }

chat_template *chat_template_for_model(const char *gguf_template, bool *fell_back, ember_error *err) {
    if (fell_back) *fell_back = false;
    if (gguf_template == NULL || gguf_template[0] == '\0') {
        if (fell_back) *fell_back = true;
        ember_fail(err, "the model has no chat template; using ChatML");
        return chat_template_chatml();
    }
    chat_template *t = template_new(gguf_template, err);
    if (t) return t;
    if (fell_back) *fell_back = true;
    ember_fail_prefix(err, "cannot use the model's chat template, using ChatML");
    return chat_template_chatml();
}

void chat_template_free(chat_template *tpl) {
    if (tpl == NULL) return;
    jinja_free(tpl->tpl);
    free(tpl->source);
    free(tpl);
}

const char *chat_template_source(const chat_template *tpl) { return tpl ? tpl->source : NULL; }

/* ---- API: messages ---- */

chat_messages *chat_messages_create(void) {
    chat_messages *m = calloc(1, sizeof *m);
    if (m == NULL) return NULL;
    m->list = jv_list(8);
    return m;
}

chat_messages *chat_messages_from_json(const cJSON *messages, ember_error *err) {
    if (!cJSON_IsArray(messages)) {
        ember_fail(err, "messages: must be an array");
        return NULL;
    }
    chat_messages *m = chat_messages_create();
    if (m == NULL) {
        ember_fail(err, "out of memory");
        return NULL;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, messages) {
        if (chat_messages_append_json(m, it, err) != 0) {
            chat_messages_free(m);
            return NULL;
        }
    }
    return m;
}

chat_messages *chat_messages_clone(const chat_messages *msgs) {
    chat_messages *m = chat_messages_create();
    if (m == NULL) return NULL;
    for (size_t i = 0; i < msgs->list.u.l->n; i++) jv_list_push(m->list, jv_retain(msgs->list.u.l->items[i]));
    return m;
}

void chat_messages_free(chat_messages *msgs) {
    if (msgs == NULL) return;
    jv_release(msgs->list);
    free(msgs);
}

size_t chat_messages_count(const chat_messages *msgs) { return msgs ? msgs->list.u.l->n : 0; }

const char *chat_messages_role(const chat_messages *msgs, size_t i) {
    if (msgs == NULL || i >= msgs->list.u.l->n) return NULL;
    const jv *r = jv_dict_get(msgs->list.u.l->items[i], "role", 4);
    return r && r->t == JV_STR ? r->u.s->data : NULL;
}

int chat_messages_append_json(chat_messages *msgs, const cJSON *message, ember_error *err) {
    jv d;
    if (validate_message(message, msgs->list.u.l->n, &d, err) != 0) return -1;
    jv_list_push(msgs->list, d);
    return 0;
}

int chat_messages_append(chat_messages *msgs, const char *role, const char *content, ember_error *err) {
    cJSON *m = cJSON_CreateObject();
    if (m == NULL) return ember_fail(err, "out of memory");
    cJSON_AddStringToObject(m, "role", role ? role : "");
    if (content) cJSON_AddStringToObject(m, "content", content);
    int rc = chat_messages_append_json(msgs, m, err);
    cJSON_Delete(m);
    return rc;
}

int chat_messages_append_reply(chat_messages *msgs, const chat_reply *reply, ember_error *err) {
    (void)err;
    jv_list_push(msgs->list, reply_value(reply));
    return 0;
}

/* ---- API: rendering ---- */

int chat_render(const chat_template *tpl, const chat_messages *msgs, const cJSON *tools,
                const chat_render_opts *opts, char **out, ember_error *err) {
    *out = NULL;
    if (tpl == NULL || msgs == NULL) return ember_fail(err, "chat_render: no template or messages");
    return render_list(tpl, msgs->list, tools, opts, opts ? opts->add_generation_prompt : false, out, err);
}

int chat_predict_next_turn(const chat_template *tpl, const chat_messages *msgs, const cJSON *tools,
                           const chat_render_opts *opts, const chat_reply *reply, char **out,
                           ember_error *err) {
    *out = NULL;
    if (tpl == NULL || msgs == NULL) return ember_fail(err, "chat_predict_next_turn: no template or messages");
    jv list = jv_list(msgs->list.u.l->n + 1);
    for (size_t i = 0; i < msgs->list.u.l->n; i++) jv_list_push(list, jv_retain(msgs->list.u.l->items[i]));
    jv_list_push(list, reply_value(reply));
    int rc = render_list(tpl, list, tools, opts, false, out, err);
    jv_release(list);
    return rc;
}

int chat_render_stable(const chat_template *tpl, const chat_messages *msgs, const cJSON *tools,
                       const chat_render_opts *opts, char **out, ember_error *err) {
    *out = NULL;
    if (tpl == NULL || msgs == NULL) return ember_fail(err, "chat_render_stable: no template or messages");
    return render_list(tpl, msgs->list, tools, opts, false, out, err);
}

int chat_system_prefix_anchor(const chat_template *tpl, const chat_messages *msgs, const cJSON *tools,
                              const chat_render_opts *opts, size_t *offset, char **probe,
                              ember_error *err) {
    *offset = 0;
    if (probe) *probe = NULL;
    if (tpl == NULL || msgs == NULL) return ember_fail(err, "chat_system_prefix_anchor: no template or messages");
    size_t n = msgs->list.u.l->n, k = 0;
    while (k < n) {
        const char *r = chat_messages_role(msgs, k);
        if (r == NULL || strcmp(r, "system") != 0) break;
        k++;
    }
    if (k == 0 || k == n) return 0;
    char *text[2] = {NULL, NULL};
    for (int v = 0; v < 2; v++) {
        jv list = jv_list(k + 1);
        for (size_t i = 0; i < k; i++) jv_list_push(list, jv_retain(msgs->list.u.l->items[i]));
        jv u = jv_dict(2);
        jv_dict_set(u, "role", 4, jv_cstr("user"));
        jv_dict_set(u, "content", 7, jv_cstr(v == 0 ? "0" : "1"));
        jv_list_push(list, u);
        int rc = render_list(tpl, list, tools, opts, opts ? opts->add_generation_prompt : false, &text[v], err);
        jv_release(list);
        if (rc != 0) {
            free(text[0]);
            return -1;
        }
    }
    *offset = chat_common_prefix(text[0], text[1]);
    if (probe) *probe = text[0];
    else free(text[0]);
    free(text[1]);
    return 1;
}

/* ---- API: helpers ---- */

static char *dup_range(const char *s, size_t n) {
    char *r = malloc(n + 1);
    if (r == NULL) return NULL;
    memcpy(r, s, n);
    r[n] = '\0';
    return r;
}

int chat_split_reasoning(const char *text, bool thinking_open, char **reasoning, char **content) {
    *reasoning = NULL;
    *content = NULL;
    if (text == NULL) text = "";
    const char *close = strstr(text, "</think>");
    if (close == NULL) {
        if (thinking_open) {
            const char *a = text, *b = text + strlen(text);
            while (a < b && *a == '\n') a++;
            while (b > a && b[-1] == '\n') b--;
            *reasoning = dup_range(a, (size_t)(b - a));
            return *reasoning ? 0 : -1;
        }
        *content = dup_range(text, strlen(text));
        return *content ? 0 : -1;
    }
    const char *a = text, *b = close;
    const char *open = strstr(text, "<think>");
    if (open && open < close) a = open + 7;
    while (a < b && *a == '\n') a++;
    while (b > a && b[-1] == '\n') b--;
    *reasoning = dup_range(a, (size_t)(b - a));
    const char *c = close + 8;
    while (*c == '\n') c++;
    *content = dup_range(c, strlen(c));
    if (*reasoning == NULL || *content == NULL) {
        free(*reasoning);
        free(*content);
        *reasoning = *content = NULL;
        return -1;
    }
    return 0;
}

bool chat_prompt_opens_thinking(const char *rendered_prompt) {
    if (rendered_prompt == NULL) return false;
    const char *last_open = NULL, *last_close = NULL, *p = rendered_prompt;
    while ((p = strstr(p, "<think>")) != NULL) last_open = p++;
    p = rendered_prompt;
    while ((p = strstr(p, "</think>")) != NULL) last_close = p++;
    return last_open && (last_close == NULL || last_open > last_close);
}

size_t chat_common_prefix(const char *a, const char *b) {
    size_t i = 0;
    if (a == NULL || b == NULL) return 0;
    while (a[i] && a[i] == b[i]) i++;
    return i;
}
