/* serve_chat.h - turning an OpenAI messages array into the prompt text.
 *
 * Contract: serve_chat_render validates the messages (roles system, user,
 * assistant, tool, developer; content a string, null, or a list of
 * {type: "text", text} parts; assistant tool_calls) and renders them with a
 * generation prompt. Validation failures fill err and set *param to the
 * offending field ("messages[2].role"), so the HTTP layer can answer 400
 * with an OpenAI error body.
 *
 * TEMPORARY FALLBACK: until src/chat (the Jinja template engine) is built
 * into the library, rendering is plain ChatML regardless of the model's
 * template (<|im_start|>role\ncontent<|im_end|>\n ... <|im_start|>assistant\n).
 * Switching to chat.h changes only serve_chat.c. */
#ifndef EMBER_SERVE_CHAT_H
#define EMBER_SERVE_CHAT_H

#include <stdbool.h>

#include <cjson/cJSON.h>

#include "core/error.h"
#include "model/model.h"

typedef struct serve_chat serve_chat;

/* ---- API ---- */
serve_chat *serve_chat_create(const model *m, ember_error *err);
void serve_chat_free(serve_chat *c);
/* *out is malloc'd. *thinking_open: the prompt ends inside <think>. */
int serve_chat_render(const serve_chat *c, const cJSON *messages, const cJSON *tools, const cJSON *kwargs,
                      char **out, bool *thinking_open, char *param, size_t param_cap, ember_error *err);

#endif
