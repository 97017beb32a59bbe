/* serve_tools.h - tool calls in model output -> OpenAI tool_calls.
 *
 * Contract:
 *  - The syntax follows the chat template the server renders with
 *    (tool_syntax_for_template):
 *      HERMES   Qwen3 / Qwen3.5 / ChatML: <tool_call>...</tool_call> blocks
 *               holding either {"name": N, "arguments": {...}} (Qwen3,
 *               Hermes) or <function=N><parameter=P>\nV\n</parameter>...
 *               </function> (Qwen3.5, Qwen3-Coder); templates that name no
 *               syntax (ChatML fallback, Gemma 3) get this one too;
 *      LLAMA3   Llama 3.x: the reply is {"name": N, "parameters": {...}}
 *               (optionally after <|python_tag|>; several separated by ';');
 *      MISTRAL  [TOOL_CALLS] [{"name": N, "arguments": {...}, "id"?}, ...],
 *               the marker optional at the start of the reply (it is a
 *               control token that detokenizes to nothing).
 *  - A reply is split at its trigger: the first "<tool_call>" (HERMES),
 *    "<|python_tag|>" (LLAMA3) or "[TOOL_CALLS]" (MISTRAL) anywhere, or a
 *    first non-blank character '{' (LLAMA3) / '[' (MISTRAL). The text after
 *    it (the tail) is parsed into calls. With no call found, the content is
 *    the reply unchanged (malformed calls stay visible as text). With calls,
 *    the content is the text before the trigger with trailing blanks
 *    trimmed, plus any text of the tail that was not a call (each piece
 *    trimmed, joined by '\n'); NULL when that is empty.
 *  - Arguments are always a JSON text: an arguments object printed
 *    compactly, a string argument as given; Qwen3.5 parameters become an
 *    object whose values are JSON when they parse as JSON and the tool's
 *    schema does not declare the parameter a string, else strings.
 *  - Ids: "call_" + 24 alphanumerics; MISTRAL uses 9 alphanumerics (its
 *    template refuses other ids on the next turn) or the model's own id.
 *  - Streaming (tool_filter): content before the trigger is released as it
 *    arrives, except a suffix that could still become the trigger and
 *    trailing blanks; after the trigger everything is held until the end,
 *    where the tail is parsed exactly as tools_parse does. The content
 *    released over a stream, concatenated, equals tools_parse's content
 *    ("" for NULL), and the calls are the same (ids aside). */
#ifndef EMBER_SERVE_TOOLS_H
#define EMBER_SERVE_TOOLS_H

#include <stdbool.h>
#include <stddef.h>

#include <cjson/cJSON.h>

typedef enum tool_syntax {
    TOOL_SYNTAX_NONE = 0, /* no parsing (no tools in the request, tool_choice "none") */
    TOOL_SYNTAX_HERMES = 1,
    TOOL_SYNTAX_LLAMA3 = 2,
    TOOL_SYNTAX_MISTRAL = 3,
} tool_syntax;

typedef struct tool_call {
    char *id;
    char *name;
    char *arguments; /* JSON text */
} tool_call;

typedef struct tool_calls {
    tool_call *v;
    int n, cap;
} tool_calls;

typedef struct tool_filter tool_filter;

/* ---- API ---- */
tool_syntax tool_syntax_for_template(const char *template_source);
const char *tool_syntax_name(tool_syntax s);

void tool_calls_free(tool_calls *c);
/* The OpenAI message.tool_calls array [{id, type, function{name, arguments}}]. */
cJSON *tool_calls_json(const tool_calls *c);

/* Whole reply. tools: the request's OpenAI tools array (schemas), may be
 * NULL. Fills *content (malloc'd or NULL) and calls (zeroed first); returns
 * the number of calls, or -1 when out of memory. */
int tools_parse(tool_syntax syn, const cJSON *tools, const char *text, char **content, tool_calls *calls);

/* Streaming. tools is borrowed and must outlive the filter. */
tool_filter *tool_filter_create(tool_syntax syn, const cJSON *tools);
void tool_filter_free(tool_filter *f);
/* Feeds content text; returns the content releasable now (malloc'd, maybe
 * ""; NULL when out of memory). With at_end the rest is released and the
 * calls (zeroed first) are filled. */
char *tool_filter_push(tool_filter *f, const char *text, size_t n, bool at_end, tool_calls *calls);

#endif
