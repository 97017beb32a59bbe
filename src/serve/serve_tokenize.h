/* serve_tokenize.h - POST /tokenize and POST /detokenize in vLLM's shapes.
 *
 * Contract:
 *  - /tokenize takes either {"prompt": text, "add_special_tokens": true}
 *    or {"messages": [...], "tools", "chat_template_kwargs",
 *    "add_generation_prompt": true, "add_special_tokens": true} (plus an
 *    optional "model" and "return_token_strs": false) and answers
 *    {"count", "max_model_len", "tokens", "token_strs"}: the ids are exactly
 *    the prompt a completion or chat request with the same text or messages
 *    would prefill (the same template, the same BOS rule), so a router can
 *    compute the prefix it will ask for. token_strs are the vocabulary's
 *    token texts, or null.
 *    Unlike vLLM, add_special_tokens defaults to true for messages too,
 *    because that is what ember's chat requests do (a template that writes
 *    the BOS text keeps one BOS either way); add_generation_prompt false and
 *    continue_final_message true are refused (400 unsupported_value): chat
 *    requests always render with the generation prompt.
 *  - /detokenize takes {"tokens": [ids]} and answers {"prompt": text}, special
 *    tokens rendered, invalid UTF-8 as U+FFFD.
 *  - Bad input is an api_error (400, or 404 for an unknown model), the same
 *    checks as the generation routes (serve_api.h). */
#ifndef EMBER_SERVE_TOKENIZE_H
#define EMBER_SERVE_TOKENIZE_H

#include <stddef.h>

#include <cjson/cJSON.h>

#include "serve/serve_api.h"

/* ---- API ---- */
/* The response object, or NULL with e filled. */
cJSON *api_tokenize(const api_ctx *ctx, const char *body, size_t len, api_error *e);
cJSON *api_detokenize(const api_ctx *ctx, const char *body, size_t len, api_error *e);

#endif
