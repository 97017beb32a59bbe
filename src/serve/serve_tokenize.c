/* serve_tokenize.c - vLLM's /tokenize and /detokenize (see serve_tokenize.h).
 *
 * Shapes matched against vLLM's vllm/entrypoints/openai/protocol.py
 * (TokenizeCompletionRequest, TokenizeChatRequest, TokenizeResponse with
 * count, max_model_len, tokens, token_strs; DetokenizeRequest with tokens;
 * DetokenizeResponse with prompt), read for the field names only.
 *
 * Both routes reuse the generation path's pieces rather than their own:
 * the strict body reader and model check (api_parse_body), the chat
 * template renderer (serve_chat_render) and the prompt encoder with its BOS
 * rule (api_encode), so "the tokens of this prompt" can never differ from
 * what a generation request prefills. */
#include "serve/serve_tokenize.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* An optional boolean field; -1 with e on a wrong type. */
static int opt_bool(const cJSON *body, const char *name, bool *out, api_error *e) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(body, name);
    if (v == NULL || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsBool(v))
        return api_fail(e, 400, "invalid_request_error", name, "invalid_type",
                        "Invalid type for '%s': expected a boolean.", name);
    *out = cJSON_IsTrue(v);
    return 0;
}

/* The chat text of messages (with tools and chat_template_kwargs), malloc'd. */
static char *render_messages(const api_ctx *ctx, const cJSON *body, const cJSON *msgs, api_error *e) {
    if (!cJSON_IsArray(msgs) || cJSON_GetArraySize(msgs) == 0) {
        api_fail(e, 400, "invalid_request_error", "messages", cJSON_IsArray(msgs) ? "empty_array" : "invalid_type",
                 "Invalid 'messages': expected a non-empty array.");
        return NULL;
    }
    bool gen_prompt = true, cont = false;
    if (opt_bool(body, "add_generation_prompt", &gen_prompt, e) < 0 ||
        opt_bool(body, "continue_final_message", &cont, e) < 0)
        return NULL;
    if (!gen_prompt || cont) {
        api_fail(e, 400, "invalid_request_error", gen_prompt ? "continue_final_message" : "add_generation_prompt",
                 "unsupported_value",
                 "Only add_generation_prompt=true and continue_final_message=false are supported: ember's chat "
                 "requests always render with the generation prompt.");
        return NULL;
    }
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(body, "tools");
    const cJSON *kwargs = cJSON_GetObjectItemCaseSensitive(body, "chat_template_kwargs");
    if (tools && !cJSON_IsNull(tools) && !cJSON_IsArray(tools)) {
        api_fail(e, 400, "invalid_request_error", "tools", "invalid_type", "Invalid type for 'tools': expected an array.");
        return NULL;
    }
    if (kwargs && !cJSON_IsNull(kwargs) && !cJSON_IsObject(kwargs)) {
        api_fail(e, 400, "invalid_request_error", "chat_template_kwargs", "invalid_type",
                 "Invalid type for 'chat_template_kwargs': expected an object.");
        return NULL;
    }
    char *text = NULL, param[96] = "messages";
    bool thinking_open = false;
    ember_error err;
    if (serve_chat_render(ctx->chat, msgs, cJSON_IsArray(tools) ? tools : NULL, cJSON_IsObject(kwargs) ? kwargs : NULL,
                          &text, &thinking_open, param, sizeof param, &err) < 0) {
        api_fail(e, 400, "invalid_request_error", param, strstr(err.msg, "Missing") ? "missing_required_parameter"
                                                                                    : "invalid_value",
                 "%s", err.msg);
        return NULL;
    }
    return text;
}

cJSON *api_tokenize(const api_ctx *ctx, const char *body_text, size_t len, api_error *e) {
    cJSON *body = api_parse_body(ctx, body_text, len, e);
    if (body == NULL) return NULL;
    cJSON *out = NULL;
    char *text = NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(body, "prompt");
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(body, "messages");
    bool has_prompt = prompt && !cJSON_IsNull(prompt), has_msgs = msgs && !cJSON_IsNull(msgs);
    bool add_special = true, token_strs = false;
    if (opt_bool(body, "add_special_tokens", &add_special, e) < 0 || opt_bool(body, "return_token_strs", &token_strs, e) < 0)
        goto done;
    if (has_prompt == has_msgs) {
        api_fail(e, 400, "invalid_request_error", has_prompt ? "messages" : "prompt",
                 has_prompt ? "invalid_value" : "missing_required_parameter",
                 "Send either 'prompt' (text) or 'messages' (a chat), not %s.", has_prompt ? "both" : "neither");
        goto done;
    }
    if (has_prompt) {
        if (!cJSON_IsString(prompt)) {
            api_fail(e, 400, "invalid_request_error", "prompt", "invalid_type",
                     "Invalid type for 'prompt': expected a string.");
            goto done;
        }
        text = strdup(prompt->valuestring);
    } else {
        text = render_messages(ctx, body, msgs, e);
        if (text == NULL) goto done;
    }
    ember_error err;
    if (text == NULL || api_encode(ctx, text, add_special, &ids, &n, &err) < 0) {
        api_fail(e, 400, "invalid_request_error", has_prompt ? "prompt" : "messages", NULL, "Cannot tokenize: %s",
                 text ? err.msg : "out of memory");
        goto done;
    }
    out = cJSON_CreateObject();
    cJSON_AddNumberToObject(out, "count", (double)n);
    cJSON_AddNumberToObject(out, "max_model_len", ctx->n_ctx);
    cJSON *arr = cJSON_AddArrayToObject(out, "tokens");
    for (size_t i = 0; i < n; i++) cJSON_AddItemToArray(arr, cJSON_CreateNumber(ids[i]));
    if (token_strs) {
        cJSON *strs = cJSON_AddArrayToObject(out, "token_strs");
        for (size_t i = 0; i < n; i++) {
            size_t tl = 0;
            const char *t = tokenizer_token_text(ctx->tok, ids[i], &tl);
            char *safe = api_utf8_lossy(t ? t : "", t ? tl : 0);
            cJSON_AddItemToArray(strs, cJSON_CreateString(safe ? safe : ""));
            free(safe);
        }
    } else {
        cJSON_AddNullToObject(out, "token_strs");
    }
done:
    free(ids);
    free(text);
    cJSON_Delete(body);
    return out;
}

cJSON *api_detokenize(const api_ctx *ctx, const char *body_text, size_t len, api_error *e) {
    cJSON *body = api_parse_body(ctx, body_text, len, e);
    if (body == NULL) return NULL;
    cJSON *out = NULL;
    int32_t *ids = NULL;
    char *text = NULL;
    const cJSON *toks = cJSON_GetObjectItemCaseSensitive(body, "tokens");
    if (toks == NULL || cJSON_IsNull(toks)) {
        api_fail(e, 400, "invalid_request_error", "tokens", "missing_required_parameter",
                 "Missing required parameter: 'tokens'.");
        goto done;
    }
    if (!cJSON_IsArray(toks)) {
        api_fail(e, 400, "invalid_request_error", "tokens", "invalid_type",
                 "Invalid type for 'tokens': expected an array of token ids.");
        goto done;
    }
    int n = cJSON_GetArraySize(toks), i = 0;
    ids = malloc((size_t)(n ? n : 1) * sizeof *ids);
    if (ids == NULL) {
        api_fail(e, 500, "server_error", NULL, NULL, "out of memory");
        goto done;
    }
    int32_t nv = tokenizer_n_vocab(ctx->tok);
    const cJSON *t;
    cJSON_ArrayForEach(t, toks) {
        if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
            t->valuedouble >= nv) {
            api_fail(e, 400, "invalid_request_error", "tokens", "invalid_value",
                     "Invalid 'tokens[%d]': expected a token id in [0, %d).", i, nv);
            goto done;
        }
        ids[i++] = (int32_t)t->valuedouble;
    }
    size_t tl = 0;
    ember_error err;
    if (tokenizer_decode(ctx->tok, ids, (size_t)n, true, &text, &tl, &err) < 0) {
        api_fail(e, 400, "invalid_request_error", "tokens", NULL, "Cannot detokenize: %s", err.msg);
        goto done;
    }
    char *safe = api_utf8_lossy(text, tl);
    if (safe == NULL) {
        api_fail(e, 500, "server_error", NULL, NULL, "out of memory");
        goto done;
    }
    out = cJSON_CreateObject();
    cJSON_AddStringToObject(out, "prompt", safe);
    free(safe);
done:
    free(text);
    free(ids);
    cJSON_Delete(body);
    return out;
}
