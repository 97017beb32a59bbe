/* serve_api.h - the OpenAI request and response shapes.
 *
 * Contract:
 *  - api_parse turns a request body of /v1/chat/completions or
 *    /v1/completions into scheduler parameters, or into an api_error with
 *    the HTTP status, type, param and code OpenAI would send: malformed
 *    JSON, invalid UTF-8, wrong types, missing or empty fields, unknown
 *    roles, out-of-range sampling values, a prompt longer than the context.
 *    Sampling defaults are OpenAI's (temperature 1, top_p 1), plus top_k and
 *    min_p off; a missing seed draws one.
 *  - The body is strict JSON: a raw control character (U+0000-U+001F)
 *    inside a string, or any control character other than the four JSON
 *    whitespace bytes outside one, is invalid_json; a string holding U+0000
 *    (written \u0000) anywhere is 400 invalid_value naming the top-level
 *    field, since every string ember takes is a C string.
 *  - `model`, when present and not null, must be one of ctx->model_names
 *    (the served name, the model file's name with and without .gguf):
 *    otherwise 404 model_not_found. api_model_known checks a name.
 *  - max_tokens / max_completion_tokens missing or null mean
 *    ctx->default_max_tokens (0: "up to the context"), within the room left
 *    in the context and what the KV pool can hold for one request, so such
 *    a request is never refused for the pool and never waits for more than
 *    the whole pool.
 *  - The salt of the request's cache entries is serve_tenant_salt of the
 *    tenant (the caller's: its API key's, or a trusted proxy's header) and
 *    the body's cache_salt, so a cache_salt partitions only inside its
 *    tenant. No tenant and no cache_salt: salt 0.
 *  - Responses are rendered with cJSON: whole objects (chat.completion,
 *    text_completion), SSE chunk objects (chat.completion.chunk and streamed
 *    text_completion), the usage object with
 *    prompt_tokens_details.cached_tokens, logprobs in the chat shape
 *    ({content: [{token, logprob, bytes, top_logprobs}]}) or the legacy
 *    completions shape, and error bodies {"error": {message, type, param,
 *    code}}. Token texts that are not valid UTF-8 by themselves are shown
 *    with U+FFFD; their exact bytes are in "bytes".
 *  - Tools: a chat request with a non-empty `tools` array (each entry
 *    {type: "function", function: {name, ...}}) and a tool_choice other
 *    than "none" has its reply parsed for tool calls in the template's
 *    syntax (serve_tools.h): message.tool_calls, content null when nothing
 *    else was said, finish_reason "tool_calls"; streamed as OpenAI
 *    delta.tool_calls chunks (a head {index, id, type, function{name,
 *    arguments: ""}}, then the arguments). tool_choice is validated, not
 *    enforced (generation is not constrained). */
#ifndef EMBER_SERVE_API_H
#define EMBER_SERVE_API_H

#include <stdbool.h>
#include <stddef.h>

#include "serve/serve_chat.h"
#include "serve/serve_sched.h"
#include "tokenizer/tokenizer.h"

typedef struct api_error {
    int status;
    char type[40];
    char param[96];      /* "" renders null */
    char code[48];       /* "" renders null */
    char message[600];
    int retry_after;     /* > 0: a Retry-After header */
} api_error;

typedef struct api_ctx {
    const tokenizer *tok;
    const serve_chat *chat;
    const char *model_id;                /* the served name, shown in responses */
    const char *const *model_names;      /* every name a request may ask for */
    int n_model_names;
    int n_ctx;
    int64_t max_seq_tokens;              /* longest sequence the KV pool holds for one request; 0: no bound */
    int default_max_tokens;              /* reply length without max_tokens; 0: the rest of the context */
    const unsigned char *tenant_secret;  /* SERVE_TENANT_SECRET_BYTES mixed into salts; NULL: zeros */
} api_ctx;

typedef struct api_req {
    bool chat;
    bool stream, include_usage;
    bool logprobs;       /* chat: logprobs; completions: logprobs != null */
    int top_logprobs;
    bool thinking_open;
    tool_syntax tools;   /* NONE: replies are not parsed for tool calls */
    cJSON *tool_schema;  /* the request's tools array (owned) */
    sreq_params p;
} api_req;

/* ---- API ---- */
int api_fail(api_error *e, int status, const char *type, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));
char *api_error_json(const api_error *e);
bool api_utf8_valid(const char *s, size_t len);
/* A malloc'd, NUL-terminated copy of n bytes in which every invalid UTF-8
 * sequence and every NUL is U+FFFD (JSON-safe); NULL when out of memory. */
char *api_utf8_lossy(const char *p, size_t n);
bool api_model_known(const api_ctx *ctx, const char *name);
/* The checks api_parse makes before cJSON sees a body, for JSON from other
 * sources (a chat file): UTF-8, no raw control characters, no U+0000. */
int api_body_check(const char *body, size_t len, api_error *e);

/* A request body: valid UTF-8, strict JSON (see above), an object, no
 * U+0000 in any string, and a `model`, when present and not null, that this
 * server serves. NULL with e filled otherwise; the caller frees the object. */
cJSON *api_parse_body(const api_ctx *ctx, const char *body, size_t len, api_error *e);
/* text to token ids the way a request's prompt is tokenized: add_special
 * puts BOS first unless the text already starts with the BOS token's text
 * (a rendered chat template). *ids is malloc'd. 0 or -1 with err. */
int api_encode(const api_ctx *ctx, const char *text, bool add_special, int32_t **ids, size_t *n, ember_error *err);
int api_parse(const api_ctx *ctx, bool chat, const char *body, size_t len, const char *tenant, api_req *out,
              api_error *e);
void api_req_free(api_req *r);

const char *api_finish_reason(sreq_finish f);
/* The whole response object. Chat text is split at </think> into
 * reasoning_content and content (chat_split_reasoning) when the prompt
 * opened a think block or the text closes one. */
char *api_response_json(const api_ctx *ctx, const api_req *q, const char *id, long created, const char *text,
                        sreq *r, int n_lp, const sreq_usage *u, sreq_finish f);
/* One SSE chunk object: text (may be NULL), the role delta for the first chat
 * chunk, logprob entries [lp_from, lp_to), a finish reason (NULL: null), and
 * when usage_only the final {choices: [], usage} chunk. */
char *api_chunk_json(const api_ctx *ctx, const api_req *q, const char *id, long created, const char *text,
                     const char *reasoning, bool role, sreq *r, int lp_from, int lp_to, const char *finish,
                     const sreq_usage *u, bool usage_only);
/* A delta.tool_calls chunk for call `index`: the head (id, type, name, empty
 * arguments) or the arguments. */
char *api_tool_chunk_json(const api_ctx *ctx, const api_req *q, const char *id, long created, int index,
                          const tool_call *call, bool head);

#endif
