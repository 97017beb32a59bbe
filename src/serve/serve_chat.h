/* serve_chat.h - turning an OpenAI messages array into the prompt text.
 *
 * Contract: serve_chat_render validates the messages (roles system, user,
 * assistant, tool, developer; content a string, null, or a list of
 * {type: "text", text} parts; assistant tool_calls) and renders them with a
 * generation prompt. Validation failures fill err and set *param to the
 * offending field ("messages[2].role"), so the HTTP layer can answer 400
 * with an OpenAI error body.
 *
 * Rendering goes through the model's own chat template (src/chat); a
 * template that is missing or cannot be parsed falls back to ChatML with a
 * warning at load. chat_template_kwargs (a JSON object) become extra
 * template variables (enable_thinking, ...).
 *
 * serve_chat_cache_plan derives the prompt cache's render positions and
 * the next-turn predictor of a chat request with the server's template
 * (src/chat/chat_plan.h has what they are).
 *
 * serve_chat_tool_syntax says how the template's model writes tool calls
 * (serve_tools.h), for parsing replies to requests that offer tools. */
#ifndef EMBER_SERVE_CHAT_H
#define EMBER_SERVE_CHAT_H

#include <stdbool.h>

#include <cjson/cJSON.h>

#include "chat/chat_plan.h"
#include "core/error.h"
#include "model/model.h"
#include "serve/serve_tools.h"
#include "tokenizer/tokenizer.h"

typedef struct serve_chat serve_chat;

/* ---- API ---- */
serve_chat *serve_chat_create(const model *m, ember_error *err);
void serve_chat_free(serve_chat *c);
tool_syntax serve_chat_tool_syntax(const serve_chat *c);
/* On: control-token text in messages becomes control tokens (the unsafe
 * behaviour before defusing; chat.parse_special_in_content). Default off. */
void serve_chat_set_parse_special_in_content(serve_chat *c, bool on);
/* *out is malloc'd. *thinking_open: the prompt ends inside <think>. */
int serve_chat_render(const serve_chat *c, const cJSON *messages, const cJSON *tools, const cJSON *kwargs,
                      char **out, bool *thinking_open, char *param, size_t param_cap, ember_error *err);

/* The cache plan of a chat request (chat_plan.h); never fails: what it
 * cannot derive stays 0 / NULL. */
void serve_chat_cache_plan(const serve_chat *c, const tokenizer *tok, const cJSON *messages, const cJSON *tools,
                           const cJSON *kwargs, const int32_t *prompt, int64_t n_prompt, bool thinking_open,
                           chat_cache_plan *out);

#endif
