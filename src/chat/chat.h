/* chat.h - rendering OpenAI-style conversations through a model's chat template.
 *
 * Contract:
 *  - Templates. chat_template_create() parses a Hugging Face Jinja chat
 *    template (the GGUF key tokenizer.chat_template) once with ember's own
 *    Jinja-subset engine; a template it cannot parse is an error naming the
 *    line and column. Parsing follows Hugging Face transformers'
 *    apply_chat_template: trim_blocks and lstrip_blocks on, a single
 *    trailing newline of the source dropped, `tojson` is Python's
 *    json.dumps(ensure_ascii=False) (separators ", " / ": ", or "," / ": "
 *    with indent), break/continue allowed, raise_exception(msg) and
 *    strftime_now(fmt) defined. chat_template_for_model() is the loading
 *    helper: it parses the GGUF's template and, when that is missing or
 *    unparseable, returns the built-in ChatML template and sets *fell_back
 *    (the caller logs the warning; the reason is in err). A template is
 *    immutable after creation and may be rendered from several threads at
 *    once; a chat_messages (and its clones, which share values with it)
 *    belongs to one thread at a time: build one per thread from the JSON.
 *  - Messages. chat_messages holds a conversation as template values. It is
 *    built from an OpenAI "messages" JSON array (roles system, user,
 *    assistant, tool; content a string, null or a list of {type, text}
 *    parts; assistant tool_calls [{id, type, function{name, arguments}}] with
 *    arguments a JSON string or an object; reasoning_content; tool_call_id,
 *    name) or appended one at a time. Normalisation: a null or missing
 *    content becomes "" (every supported template either needs a string or
 *    treats "" like none). Other fields are passed through unchanged, in
 *    their original key order. Roles are checked; unknown roles are errors.
 *  - Rendering. chat_render() renders messages + tools (the OpenAI "tools"
 *    array, passed through as values; NULL renders `tools` as none) with the
 *    options below. Templates that iterate tool-call arguments as a mapping
 *    (`arguments|items`, `arguments.items()`) get string arguments decoded
 *    to objects first (invalid JSON becomes {}), as llama.cpp does.
 *    Template errors (raise_exception, type errors, undefined attribute of
 *    an undefined value) come back as errors with line and column.
 *  - Render prediction for the prompt cache (prompt-cache reference §8.2,
 *    §9). chat_predict_next_turn() renders the conversation with the
 *    assistant reply appended as history and no generation prompt: the text
 *    the client's next request will start with. Retirement keys on the
 *    longest common prefix of that text's tokens with the live sequence.
 *    chat_render_stable() renders the request's own messages without
 *    generation prompt (p_stable). chat_system_prefix_anchor() renders the
 *    leading system messages followed by a user message "0" and by "1" and
 *    reports the byte offset where the two renders diverge (the shared
 *    system prefix, including the user-turn header every sibling shares).
 *  - Memory. Every char ** output is malloc'd and owned by the caller.
 *    Errors are returned through ember_error, never printed. */
#ifndef EMBER_CHAT_CHAT_H
#define EMBER_CHAT_CHAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "core/error.h"

typedef struct chat_template chat_template;
typedef struct chat_messages chat_messages;

typedef struct chat_render_opts {
    bool add_generation_prompt;
    /* -1: `enable_thinking` undefined in the template (transformers'
     * default when the caller passes nothing), 0: false, 1: true. */
    int enable_thinking;
    const char *bos_token;  /* token texts; NULL renders as "" */
    const char *eos_token;
    /* Unix time used by strftime_now (local time zone); 0 = now. */
    int64_t now;
    /* Extra template variables (chat_template_kwargs), a JSON object or
     * NULL; its keys override the ones above. */
    const cJSON *extra;
} chat_render_opts;

/* The assistant reply appended by chat_predict_next_turn(). Any field may
 * be NULL. tool_calls is an OpenAI tool_calls array. */
typedef struct chat_reply {
    const char *content;
    const char *reasoning_content;
    const cJSON *tool_calls;
} chat_reply;

/* ---- templates ---- */

chat_template *chat_template_create(const char *source, ember_error *err);
/* The built-in ChatML template (<|im_start|>role\ncontent<|im_end|>\n). */
chat_template *chat_template_chatml(void);
/* Parses gguf_template; on NULL/empty or a parse error returns ChatML,
 * sets *fell_back = true and (when err is non-NULL) says why in err. Never
 * returns NULL except on allocation failure. */
chat_template *chat_template_for_model(const char *gguf_template, bool *fell_back,
                                       ember_error *err);
void chat_template_free(chat_template *tpl);
const char *chat_template_source(const chat_template *tpl);

/* ---- messages ---- */

chat_messages *chat_messages_create(void);
/* From an OpenAI messages array; NULL with err on a malformed message. */
chat_messages *chat_messages_from_json(const cJSON *messages, ember_error *err);
chat_messages *chat_messages_clone(const chat_messages *msgs);
void chat_messages_free(chat_messages *msgs);
size_t chat_messages_count(const chat_messages *msgs);
/* The role of message i ("system", "user", ...), or NULL. */
const char *chat_messages_role(const chat_messages *msgs, size_t i);
/* Appends one message given as a JSON object (validated as above). */
int chat_messages_append_json(chat_messages *msgs, const cJSON *message, ember_error *err);
/* Appends {role, content}. */
int chat_messages_append(chat_messages *msgs, const char *role, const char *content,
                         ember_error *err);
/* Appends an assistant message built from reply. */
int chat_messages_append_reply(chat_messages *msgs, const chat_reply *reply, ember_error *err);

/* ---- rendering ---- */

int chat_render(const chat_template *tpl, const chat_messages *msgs, const cJSON *tools,
                const chat_render_opts *opts, char **out, ember_error *err);

/* ---- render prediction (prompt cache) ---- */

/* msgs + reply as the next turn's history, add_generation_prompt = false. */
int chat_predict_next_turn(const chat_template *tpl, const chat_messages *msgs,
                           const cJSON *tools, const chat_render_opts *opts,
                           const chat_reply *reply, char **out, ember_error *err);
/* msgs with add_generation_prompt = false (§9.2 p_stable). */
int chat_render_stable(const chat_template *tpl, const chat_messages *msgs, const cJSON *tools,
                       const chat_render_opts *opts, char **out, ember_error *err);
/* §9.3: returns 1 and sets *offset (bytes) and *probe (the render with user
 * "0", caller frees; probe may be NULL) when msgs starts with >= 1 system
 * message followed by >= 1 other message; 0 when not applicable; -1 on a
 * render error. */
int chat_system_prefix_anchor(const chat_template *tpl, const chat_messages *msgs,
                              const cJSON *tools, const chat_render_opts *opts,
                              size_t *offset, char **probe, ember_error *err);

/* Splits generated text into reasoning and content at "</think>" (an
 * opening "<think>" before it is dropped). With no "</think>": when
 * thinking_open (the prompt ended inside an open think block) the whole
 * text is reasoning, else it is all content. Outputs are malloc'd; a part
 * that is absent comes back NULL. */
int chat_split_reasoning(const char *text, bool thinking_open, char **reasoning,
                         char **content);
/* True when the rendered prompt ends inside an open "<think>" block. */
bool chat_prompt_opens_thinking(const char *rendered_prompt);
/* Length in bytes of the longest common prefix of a and b. */
size_t chat_common_prefix(const char *a, const char *b);

#endif
