/* serve_chat.c - messages -> prompt text (see serve_chat.h).
 *
 * TEMPORARY FALLBACK (until src/chat is in the library): a fixed ChatML
 * renderer. Tools are listed in a leading system block and assistant
 * tool_calls are written as <tool_call>{json}</tool_call>, the Qwen
 * convention, so conversations with tools at least render deterministically
 * (the prompt cache only needs determinism). */
#include "serve/serve_chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"

struct serve_chat {
    bool warned;
};

serve_chat *serve_chat_create(const model *m, ember_error *err) {
    serve_chat *c = calloc(1, sizeof *c);
    if (c == NULL) {
        ember_fail(err, "chat: out of memory");
        return NULL;
    }
    const char *tpl = tokenizer_chat_template(model_get_tokenizer(m));
    ember_log(EMBER_LOG_WARN, "chat template: %s; rendering ChatML (temporary fallback until src/chat lands)",
              tpl ? "the model's template is not interpreted yet" : "the model has none");
    return c;
}

void serve_chat_free(serve_chat *c) { free(c); }

typedef struct buf {
    char *p;
    size_t len, cap;
    bool oom;
} buf;

static void put(buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (p == NULL) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void puts_(buf *b, const char *s) { put(b, s, strlen(s)); }

static bool role_ok(const char *r) {
    static const char *roles[] = {"system", "user", "assistant", "tool", "developer"};
    for (size_t i = 0; i < sizeof roles / sizeof roles[0]; i++)
        if (strcmp(r, roles[i]) == 0) return true;
    return false;
}

int serve_chat_render(const serve_chat *c, const cJSON *messages, const cJSON *tools, const cJSON *kwargs,
                      char **out, bool *thinking_open, char *param, size_t param_cap, ember_error *err) {
    (void)c;
    (void)kwargs;
    *out = NULL;
    *thinking_open = false;
    buf b = {0};
    if (tools && cJSON_IsArray(tools) && cJSON_GetArraySize(tools) > 0) {
        char *tj = cJSON_PrintUnformatted(tools);
        puts_(&b, "<|im_start|>system\n# Tools\n<tools>\n");
        if (tj) puts_(&b, tj);
        puts_(&b, "\n</tools><|im_end|>\n");
        free(tj);
    }
    int i = 0;
    const cJSON *msg;
    cJSON_ArrayForEach(msg, messages) {
        if (!cJSON_IsObject(msg)) {
            snprintf(param, param_cap, "messages[%d]", i);
            ember_fail(err, "Invalid type for 'messages[%d]': expected an object.", i);
            goto fail;
        }
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(msg, "role");
        if (role == NULL) {
            snprintf(param, param_cap, "messages[%d].role", i);
            ember_fail(err, "Missing required parameter: 'messages[%d].role'.", i);
            goto fail;
        }
        if (!cJSON_IsString(role)) {
            snprintf(param, param_cap, "messages[%d].role", i);
            ember_fail(err, "Invalid type for 'messages[%d].role': expected a string.", i);
            goto fail;
        }
        if (!role_ok(role->valuestring)) {
            snprintf(param, param_cap, "messages[%d].role", i);
            ember_fail(err,
                       "Invalid value: '%.64s'. Supported values are: 'system', 'assistant', 'user', 'tool', and "
                       "'developer'.",
                       role->valuestring);
            goto fail;
        }
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(msg, "content");
        const cJSON *calls = cJSON_GetObjectItemCaseSensitive(msg, "tool_calls");
        bool is_asst = strcmp(role->valuestring, "assistant") == 0;
        if (content == NULL && !(is_asst && calls)) {
            snprintf(param, param_cap, "messages[%d].content", i);
            ember_fail(err, "Missing required parameter: 'messages[%d].content'.", i);
            goto fail;
        }
        const char *r = strcmp(role->valuestring, "developer") == 0 ? "system" : role->valuestring;
        puts_(&b, "<|im_start|>");
        puts_(&b, r);
        puts_(&b, "\n");
        if (content == NULL || cJSON_IsNull(content)) {
        } else if (cJSON_IsString(content)) {
            puts_(&b, content->valuestring);
        } else if (cJSON_IsArray(content)) {
            const cJSON *part;
            int j = 0;
            cJSON_ArrayForEach(part, content) {
                const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
                const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
                if (!cJSON_IsObject(part) || !cJSON_IsString(type) || strcmp(type->valuestring, "text") != 0 ||
                    !cJSON_IsString(text)) {
                    snprintf(param, param_cap, "messages[%d].content[%d]", i, j);
                    ember_fail(err, "Invalid content part 'messages[%d].content[%d]': only {\"type\": \"text\", "
                                    "\"text\": ...} parts are supported.",
                               i, j);
                    goto fail;
                }
                puts_(&b, text->valuestring);
                j++;
            }
        } else {
            snprintf(param, param_cap, "messages[%d].content", i);
            ember_fail(err, "Invalid type for 'messages[%d].content': expected a string, an array or null.", i);
            goto fail;
        }
        if (calls) {
            if (!is_asst || !cJSON_IsArray(calls)) {
                snprintf(param, param_cap, "messages[%d].tool_calls", i);
                ember_fail(err, "Invalid 'messages[%d].tool_calls': expected an array on an assistant message.", i);
                goto fail;
            }
            const cJSON *call;
            cJSON_ArrayForEach(call, calls) {
                const cJSON *fn = cJSON_GetObjectItemCaseSensitive(call, "function");
                char *fj = fn ? cJSON_PrintUnformatted(fn) : NULL;
                puts_(&b, "\n<tool_call>\n");
                if (fj) puts_(&b, fj);
                puts_(&b, "\n</tool_call>");
                free(fj);
            }
        }
        puts_(&b, "<|im_end|>\n");
        i++;
    }
    puts_(&b, "<|im_start|>assistant\n");
    if (b.oom) {
        ember_fail(err, "out of memory rendering the conversation");
        goto fail;
    }
    *out = b.p;
    return 0;
fail:
    free(b.p);
    return -1;
}
