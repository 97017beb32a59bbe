/* serve_api.c - OpenAI request validation and response rendering (see
 * serve_api.h).
 *
 * Validation runs in the order OpenAI reports problems: the body must be
 * UTF-8 and JSON, an object; then the required field (messages / prompt);
 * then every optional field's type and range; then the rendered, tokenized
 * prompt against the context. Each failure names the field in `param`. */
#include "serve/serve_api.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "apc/apc.h"
#include "chat/chat.h"
#include "serve/serve_tenant.h"

int api_fail(api_error *e, int status, const char *type, const char *param, const char *code, const char *fmt, ...) {
    e->status = status;
    e->retry_after = 0;
    snprintf(e->type, sizeof e->type, "%s", type);
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    snprintf(e->code, sizeof e->code, "%s", code ? code : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return -1;
}

char *api_error_json(const api_error *e) {
    cJSON *root = cJSON_CreateObject(), *o = cJSON_CreateObject();
    cJSON_AddItemToObject(root, "error", o);
    cJSON_AddStringToObject(o, "message", e->message);
    cJSON_AddStringToObject(o, "type", e->type);
    if (e->param[0]) cJSON_AddStringToObject(o, "param", e->param);
    else cJSON_AddNullToObject(o, "param");
    if (e->code[0]) cJSON_AddStringToObject(o, "code", e->code);
    else cJSON_AddNullToObject(o, "code");
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}

/* Strict UTF-8 (no overlongs, no surrogates, <= U+10FFFF). */
bool api_utf8_valid(const char *str, size_t len) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0;
    while (i < len) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        int n;
        unsigned cp;
        if (c >= 0xC2 && c <= 0xDF) n = 1, cp = c & 0x1F;
        else if (c >= 0xE0 && c <= 0xEF) n = 2, cp = c & 0x0F;
        else if (c >= 0xF0 && c <= 0xF4) n = 3, cp = c & 0x07;
        else return false;
        for (int k = 1; k <= n; k++) {
            if (i + (size_t)k >= len || (s[i + k] & 0xC0) != 0x80) return false;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if ((n == 2 && cp < 0x800) || (n == 3 && cp < 0x10000) || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return false;
        i += (size_t)n + 1;
    }
    return true;
}

bool api_model_known(const api_ctx *ctx, const char *name) {
    if (ctx->n_model_names == 0) return strcmp(name, ctx->model_id) == 0;
    for (int i = 0; i < ctx->n_model_names; i++)
        if (strcmp(name, ctx->model_names[i]) == 0) return true;
    return false;
}

/* What cJSON lets through and the JSON grammar does not, found by one pass
 * over the raw body: a control character (the byte offset), and the
 * escape \u0000, which would silently cut a C string (the top-level key it
 * sits under). */
typedef struct json_scan {
    long ctrl_at;       /* -1: none */
    unsigned ctrl;
    bool nul;
    char nul_key[64];
} json_scan;

static void scan_json(const char *b, size_t len, json_scan *sc) {
    memset(sc, 0, sizeof *sc);
    sc->ctrl_at = -1;
    int depth = 0;
    bool in_str = false, top_obj = false, expect_key = false, is_key = false;
    size_t key_len = 0;
    char key[64] = "";
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)b[i];
        if (in_str) {
            if (c < 0x20) {
                sc->ctrl_at = (long)i;
                sc->ctrl = c;
                return;
            }
            if (c == '"') {
                in_str = false;
                if (is_key) {
                    key[key_len] = 0;
                    is_key = false;
                }
                continue;
            }
            if (c == '\\' && i + 1 < len) {
                if (!sc->nul && i + 5 < len && memcmp(b + i + 1, "u0000", 5) == 0) {
                    sc->nul = true;
                    snprintf(sc->nul_key, sizeof sc->nul_key, "%s", depth >= 1 && top_obj && !is_key ? key : "");
                }
                if (is_key && key_len + 2 < sizeof key) {
                    key[key_len++] = b[i];
                    key[key_len++] = b[i + 1];
                }
                i++;
                continue;
            }
            if (is_key && key_len + 1 < sizeof key) key[key_len++] = (char)c;
            continue;
        }
        if (c < 0x20 && c != '\t' && c != '\n' && c != '\r') {
            sc->ctrl_at = (long)i;
            sc->ctrl = c;
            return;
        }
        switch (c) {
        case '"':
            in_str = true;
            if (depth == 1 && top_obj && expect_key) {
                is_key = true;
                key_len = 0;
                expect_key = false;
            }
            break;
        case '{':
        case '[':
            if (depth == 0) {
                top_obj = c == '{';
                expect_key = top_obj;
            }
            depth++;
            break;
        case '}':
        case ']':
            depth--;
            break;
        case ',':
            if (depth == 1 && top_obj) expect_key = true;
            break;
        default:
            break;
        }
    }
}

int api_body_check(const char *body, size_t len, api_error *e) {
    if (!api_utf8_valid(body, len))
        return api_fail(e, 400, "invalid_request_error", NULL, "invalid_encoding", "The body is not valid UTF-8.");
    json_scan scan;
    scan_json(body, len, &scan);
    if (scan.ctrl_at >= 0)
        return api_fail(e, 400, "invalid_request_error", NULL, "invalid_json",
                        "control character U+%04X at byte %ld (JSON strings must escape it)", scan.ctrl,
                        scan.ctrl_at);
    if (scan.nul)
        return api_fail(e, 400, "invalid_request_error", scan.nul_key[0] ? scan.nul_key : NULL, "invalid_value",
                        "strings must not contain U+0000 (\\u0000)");
    return 0;
}

/* ---- field helpers ---- */

static const char *type_name(const cJSON *v) {
    if (cJSON_IsString(v)) return "a string";
    if (cJSON_IsNumber(v)) return "a number";
    if (cJSON_IsBool(v)) return "a boolean";
    if (cJSON_IsArray(v)) return "an array";
    if (cJSON_IsObject(v)) return "an object";
    if (cJSON_IsNull(v)) return "null";
    return "something else";
}

static int bad_type(api_error *e, const char *name, const char *want, const cJSON *v) {
    return api_fail(e, 400, "invalid_request_error", name, "invalid_type",
                    "Invalid type for '%s': expected %s, but got %s instead.", name, want, type_name(v));
}

/* Missing or null: 0 with *out untouched; an integer in [lo, hi]: 1. */
static int get_int(const cJSON *o, const char *name, long long lo, long long hi, long long *out, api_error *e) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (v == NULL || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || !isfinite(v->valuedouble))
        return bad_type(e, name, "an integer", v);
    double d = v->valuedouble;
    if (d < (double)lo)
        return api_fail(e, 400, "invalid_request_error", name, "integer_below_min_value",
                        "Invalid '%s': integer below minimum value. Expected a value >= %lld, but got %.0f instead.",
                        name, lo, d);
    /* (double)hi rounds LLONG_MAX up to 2^63, which no long long holds: a
     * value there would pass the check and overflow the cast below */
    if (d > (double)hi || d >= 0x1p63)
        return api_fail(e, 400, "invalid_request_error", name, "integer_above_max_value",
                        "Invalid '%s': integer above maximum value. Expected a value <= %lld, but got %.0f instead.",
                        name, hi, d);
    *out = (long long)d;
    return 1;
}

static int get_num(const cJSON *o, const char *name, double lo, double hi, double *out, api_error *e) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (v == NULL || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble)) return bad_type(e, name, "a number", v);
    if (v->valuedouble < lo || v->valuedouble > hi)
        return api_fail(e, 400, "invalid_request_error", name, v->valuedouble < lo ? "decimal_below_min_value"
                                                                                 : "decimal_above_max_value",
                        "Invalid '%s': expected a value in [%g, %g], but got %g instead.", name, lo, hi,
                        v->valuedouble);
    *out = v->valuedouble;
    return 1;
}

static int get_bool(const cJSON *o, const char *name, bool *out, api_error *e) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    if (v == NULL || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsBool(v)) return bad_type(e, name, "a boolean", v);
    *out = cJSON_IsTrue(v);
    return 1;
}

int api_encode(const api_ctx *ctx, const char *text, bool add_special, int32_t **ids, size_t *n, ember_error *err) {
    bool bos = add_special && tokenizer_add_bos(ctx->tok);
    /* A rendered template that already starts with the BOS text keeps one BOS. */
    if (bos) {
        size_t bl = 0;
        const char *bt = tokenizer_token_text(ctx->tok, tokenizer_bos(ctx->tok), &bl);
        if (bt && bl > 0 && strncmp(text, bt, bl) == 0) bos = false;
    }
    /* a rendered chat keeps its defused user text as text (tokenizer.h); a
     * prompt is valid UTF-8 and so holds no marks: the same as parsing it */
    return tokenizer_encode_rendered(ctx->tok, text, strlen(text), bos, ids, n, err);
}

static int tokenize(const api_ctx *ctx, const char *text, bool add_special, api_req *out, api_error *e) {
    ember_error err;
    int32_t *ids = NULL;
    size_t n = 0;
    if (api_encode(ctx, text, add_special, &ids, &n, &err) < 0)
        return api_fail(e, 400, "invalid_request_error", out->chat ? "messages" : "prompt", NULL,
                        "Cannot tokenize the prompt: %s", err.msg);
    out->p.prompt = ids;
    out->p.n_prompt = (int64_t)n;
    return 0;
}

static int parse_stop(const cJSON *body, api_req *out, api_error *e) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(body, "stop");
    if (v == NULL || cJSON_IsNull(v)) return 0;
    if (cJSON_IsString(v)) {
        if (v->valuestring[0]) out->p.stop[out->p.n_stop++] = strdup(v->valuestring);
        return 0;
    }
    if (!cJSON_IsArray(v)) return bad_type(e, "stop", "a string or an array of strings", v);
    if (cJSON_GetArraySize(v) > 4 && cJSON_GetArraySize(v) > SCHED_MAX_STOP)
        return api_fail(e, 400, "invalid_request_error", "stop", "array_above_max_length",
                        "Invalid 'stop': at most %d stop sequences are supported.", SCHED_MAX_STOP);
    const cJSON *s;
    int i = 0;
    cJSON_ArrayForEach(s, v) {
        char name[32];
        snprintf(name, sizeof name, "stop[%d]", i++);
        if (!cJSON_IsString(s)) return bad_type(e, name, "a string", s);
        if (s->valuestring[0] && out->p.n_stop < SCHED_MAX_STOP) out->p.stop[out->p.n_stop++] = strdup(s->valuestring);
    }
    return 0;
}

static uint64_t random_seed(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    static unsigned counter;
    uint64_t x = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 32) ^ ((uint64_t)__atomic_add_fetch(&counter, 1, 0) << 48);
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return x;
}

/* Validates tools and tool_choice; picks the reply's tool-call syntax. */
static int parse_tools(const api_ctx *ctx, const cJSON *body, const cJSON *tools, api_req *out, api_error *e) {
    int n = cJSON_IsArray(tools) ? cJSON_GetArraySize(tools) : 0, i = 0;
    const cJSON *t;
    if (n > 0) cJSON_ArrayForEach(t, tools) {
        char name[64];
        snprintf(name, sizeof name, "tools[%d]", i);
        if (!cJSON_IsObject(t)) return bad_type(e, name, "an object", t);
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(t, "type");
        if (type && (!cJSON_IsString(type) || strcmp(type->valuestring, "function") != 0)) {
            snprintf(name, sizeof name, "tools[%d].type", i);
            return api_fail(e, 400, "invalid_request_error", name, "invalid_value",
                            "Invalid value for '%s': only 'function' tools are supported.", name);
        }
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(t, "function");
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(f, "name");
        if (!cJSON_IsObject(f) || !cJSON_IsString(fn) || fn->valuestring[0] == 0) {
            snprintf(name, sizeof name, "tools[%d].function.name", i);
            return api_fail(e, 400, "invalid_request_error", name, "missing_required_parameter",
                            "Missing required parameter: '%s'.", name);
        }
        i++;
    }
    bool parse = n > 0;
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(body, "tool_choice");
    if (tc && !cJSON_IsNull(tc)) {
        if (cJSON_IsString(tc)) {
            const char *v = tc->valuestring;
            if (strcmp(v, "none") != 0 && strcmp(v, "auto") != 0 && strcmp(v, "required") != 0)
                return api_fail(e, 400, "invalid_request_error", "tool_choice", "invalid_value",
                                "Invalid value: '%.64s'. Supported values are: 'none', 'auto', and 'required'.", v);
            if (strcmp(v, "none") == 0) parse = false;
        } else if (cJSON_IsObject(tc)) {
            const cJSON *fn = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(tc, "function"), "name");
            if (!cJSON_IsString(fn))
                return api_fail(e, 400, "invalid_request_error", "tool_choice.function.name",
                                "missing_required_parameter", "Missing required parameter: 'tool_choice.function.name'.");
        } else {
            return bad_type(e, "tool_choice", "a string or an object", tc);
        }
        if (n == 0 && !(cJSON_IsString(tc) && strcmp(tc->valuestring, "none") == 0))
            return api_fail(e, 400, "invalid_request_error", "tool_choice", "invalid_value",
                            "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
                            "specified.");
    }
    if (parse) {
        out->tool_schema = cJSON_Duplicate(tools, true);
        if (out->tool_schema == NULL) return api_fail(e, 500, "server_error", NULL, NULL, "out of memory");
        out->tools = serve_chat_tool_syntax(ctx->chat);
    }
    return 0;
}

void api_req_free(api_req *r) {
    cJSON_Delete(r->tool_schema);
    free(r->p.prompt);
    for (int i = 0; i < r->p.n_stop; i++) free(r->p.stop[i]);
    chat_turn_predictor_free(r->p.plan.predictor);
    memset(r, 0, sizeof *r);
}

cJSON *api_parse_body(const api_ctx *ctx, const char *body_text, size_t len, api_error *e) {
    if (!api_utf8_valid(body_text, len)) {
        api_fail(e, 400, "invalid_request_error", NULL, "invalid_encoding", "The request body is not valid UTF-8.");
        return NULL;
    }
    json_scan scan;
    scan_json(body_text, len, &scan);
    if (scan.ctrl_at >= 0) {
        api_fail(e, 400, "invalid_request_error", NULL, "invalid_json",
                 "We could not parse the JSON body of your request: control character U+%04X at byte %ld "
                 "(JSON strings must escape it, e.g. \\n or \\u%04x).",
                 scan.ctrl, scan.ctrl_at, scan.ctrl);
        return NULL;
    }
    const char *end = NULL;
    cJSON *body = cJSON_ParseWithLengthOpts(body_text, len, &end, false);
    if (body != NULL && end != NULL) {
        while ((size_t)(end - body_text) < len && (*end == ' ' || *end == '\n' || *end == '\r' || *end == '\t')) end++;
        if ((size_t)(end - body_text) < len) {
            cJSON_Delete(body);
            body = NULL;
        }
    }
    if (body == NULL) {
        api_fail(e, 400, "invalid_request_error", NULL, "invalid_json",
                 "We could not parse the JSON body of your request. (HINT: This likely means you aren't using "
                 "your HTTP library correctly. The OpenAI API expects a JSON payload.)");
        return NULL;
    }
    const cJSON *model_field = cJSON_GetObjectItemCaseSensitive(body, "model");
    if (!cJSON_IsObject(body)) {
        api_fail(e, 400, "invalid_request_error", NULL, "invalid_type", "The request body must be a JSON object.");
    } else if (scan.nul) {
        const char *field = scan.nul_key[0] ? scan.nul_key : NULL;
        api_fail(e, 400, "invalid_request_error", field, "invalid_value",
                 "Invalid value%s%s%s: strings must not contain U+0000 (\\u0000).", field ? " for '" : "",
                 field ? field : "", field ? "'" : "");
    } else if (model_field && !cJSON_IsNull(model_field) && !cJSON_IsString(model_field)) {
        bad_type(e, "model", "a string", model_field);
    } else if (cJSON_IsString(model_field) && !api_model_known(ctx, model_field->valuestring)) {
        api_fail(e, 404, "invalid_request_error", "model", "model_not_found",
                 "The model '%.100s' does not exist; this server serves '%s'.", model_field->valuestring, ctx->model_id);
    } else {
        return body;
    }
    cJSON_Delete(body);
    return NULL;
}

int api_parse(const api_ctx *ctx, bool chat, const char *body_text, size_t len, const char *tenant, api_req *out,
              api_error *e) {
    memset(out, 0, sizeof *out);
    out->chat = chat;
    out->p.top_logprobs = -1;
    cJSON *body = api_parse_body(ctx, body_text, len, e);
    if (body == NULL) return -1;
    int rc = -1;
    char *text = NULL;
    /* ---- sampling ---- */
    sampler_params sp = sampler_default_params();
    sp.temperature = 1.0f;
    sp.top_p = 1.0f;
    sp.top_k = 0;
    sp.min_p = 0.0f;
    sp.repeat_penalty = 1.0f;
    double d;
    long long ll;
    int got;
    if ((got = get_num(body, "temperature", 0, 2, &d, e)) < 0) goto done;
    if (got) sp.temperature = (float)d;
    if ((got = get_num(body, "top_p", 0, 1, &d, e)) < 0) goto done;
    if (got) sp.top_p = (float)d;
    if ((got = get_int(body, "top_k", -1, 1 << 30, &ll, e)) < 0) goto done;
    if (got) sp.top_k = (int32_t)(ll < 0 ? 0 : ll);
    if ((got = get_num(body, "min_p", 0, 1, &d, e)) < 0) goto done;
    if (got) sp.min_p = (float)d;
    if ((got = get_num(body, "repetition_penalty", 0.01, 100, &d, e)) < 0) goto done;
    if (got) sp.repeat_penalty = (float)d;
    if ((got = get_num(body, "presence_penalty", -2, 2, &d, e)) < 0) goto done;
    if (got) sp.presence_penalty = (float)d;
    if ((got = get_num(body, "frequency_penalty", -2, 2, &d, e)) < 0) goto done;
    if (got) sp.frequency_penalty = (float)d;
    if ((got = get_int(body, "seed", -9223372036854775807LL, 9223372036854775807LL, &ll, e)) < 0) goto done;
    sp.seed = got ? (uint64_t)ll : random_seed();
    out->p.sampling = sp;
    if ((got = get_int(body, "n", 1, 1, &ll, e)) < 0) {
        snprintf(e->message, sizeof e->message, "Invalid 'n': only n = 1 is supported.");
        goto done;
    }
    if (get_bool(body, "stream", &out->stream, e) < 0) goto done;
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(body, "stream_options");
    if (so && !cJSON_IsNull(so)) {
        if (!cJSON_IsObject(so)) {
            bad_type(e, "stream_options", "an object", so);
            goto done;
        }
        if (get_bool(so, "include_usage", &out->include_usage, e) < 0) {
            snprintf(e->param, sizeof e->param, "stream_options.include_usage");
            goto done;
        }
    }
    if (get_bool(body, "ignore_eos", &out->p.ignore_eos, e) < 0) goto done;
    if (parse_stop(body, out, e) < 0) goto done;
    if (chat) {
        if (get_bool(body, "logprobs", &out->logprobs, e) < 0) goto done;
        if ((got = get_int(body, "top_logprobs", 0, SCHED_MAX_TOP_LOGPROBS, &ll, e)) < 0) goto done;
        out->top_logprobs = got ? (int)ll : 0;
        if (got && !out->logprobs) {
            api_fail(e, 400, "invalid_request_error", "top_logprobs", "invalid_value",
                     "Invalid 'top_logprobs': 'logprobs' must be true when 'top_logprobs' is set.");
            goto done;
        }
    } else {
        if ((got = get_int(body, "logprobs", 0, SCHED_MAX_TOP_LOGPROBS, &ll, e)) < 0) goto done;
        out->logprobs = got;
        out->top_logprobs = got ? (int)ll : 0;
        bool echo = false;
        if (get_bool(body, "echo", &echo, e) < 0) goto done;
        if (echo) {
            api_fail(e, 400, "invalid_request_error", "echo", "unsupported_value", "'echo' is not supported.");
            goto done;
        }
    }
    out->p.top_logprobs = out->logprobs ? out->top_logprobs : -1;
    /* ---- tenant ---- */
    const cJSON *salt = cJSON_GetObjectItemCaseSensitive(body, "cache_salt");
    if (salt && !cJSON_IsNull(salt) && !cJSON_IsString(salt)) {
        bad_type(e, "cache_salt", "a string", salt);
        goto done;
    }
    {
        static const unsigned char no_secret[SERVE_TENANT_SECRET_BYTES];
        const char *sub = salt && cJSON_IsString(salt) ? salt->valuestring : NULL;
        out->p.salt = serve_tenant_salt(ctx->tenant_secret ? ctx->tenant_secret : no_secret, tenant, sub);
        /* the scheduler's fairness goes by tenant; without one, by salt */
        out->p.tenant_id = tenant && tenant[0] ? apc_salt_for_tenant(tenant, strlen(tenant)) : out->p.salt;
    }
    /* ---- the prompt ---- */
    if (chat) {
        const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(body, "messages");
        if (msgs == NULL || cJSON_IsNull(msgs)) {
            api_fail(e, 400, "invalid_request_error", "messages", "missing_required_parameter",
                     "Missing required parameter: 'messages'.");
            goto done;
        }
        if (!cJSON_IsArray(msgs)) {
            bad_type(e, "messages", "an array", msgs);
            goto done;
        }
        if (cJSON_GetArraySize(msgs) == 0) {
            api_fail(e, 400, "invalid_request_error", "messages", "empty_array",
                     "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty "
                     "array instead.");
            goto done;
        }
        const cJSON *tools = cJSON_GetObjectItemCaseSensitive(body, "tools");
        if (tools && !cJSON_IsNull(tools) && !cJSON_IsArray(tools)) {
            bad_type(e, "tools", "an array", tools);
            goto done;
        }
        if (parse_tools(ctx, body, tools, out, e) < 0) goto done;
        const cJSON *kwargs = cJSON_GetObjectItemCaseSensitive(body, "chat_template_kwargs");
        if (kwargs && !cJSON_IsNull(kwargs) && !cJSON_IsObject(kwargs)) {
            bad_type(e, "chat_template_kwargs", "an object", kwargs);
            goto done;
        }
        ember_error err;
        char param[96] = "messages";
        if (serve_chat_render(ctx->chat, msgs, tools, kwargs, &text, &out->thinking_open, param, sizeof param, &err) <
            0) {
            api_fail(e, 400, "invalid_request_error", param,
                     strstr(err.msg, "Missing") ? "missing_required_parameter"
                     : strstr(err.msg, "Invalid value") ? "invalid_value"
                                                         : "invalid_type",
                     "%s", err.msg);
            goto done;
        }
        if (tokenize(ctx, text, true, out, e) < 0) goto done;
        /* The prompt cache's render positions (never an error). */
        serve_chat_cache_plan(ctx->chat, ctx->tok, msgs, tools, kwargs, out->p.prompt, out->p.n_prompt,
                              out->thinking_open, &out->p.plan);
    } else {
        const cJSON *pr = cJSON_GetObjectItemCaseSensitive(body, "prompt");
        if (pr == NULL || cJSON_IsNull(pr)) {
            api_fail(e, 400, "invalid_request_error", "prompt", "missing_required_parameter",
                     "Missing required parameter: 'prompt'.");
            goto done;
        }
        /* ["text"] and [[ids]] are one prompt in a list. */
        if (cJSON_IsArray(pr) && cJSON_GetArraySize(pr) == 1 &&
            (cJSON_IsString(pr->child) || cJSON_IsArray(pr->child)))
            pr = pr->child;
        if (cJSON_IsString(pr)) {
            if (tokenize(ctx, pr->valuestring, true, out, e) < 0) goto done;
        } else if (cJSON_IsArray(pr)) {
            int n = cJSON_GetArraySize(pr), i = 0;
            out->p.prompt = malloc((size_t)(n ? n : 1) * sizeof(int32_t));
            if (out->p.prompt == NULL) {
                api_fail(e, 500, "server_error", NULL, NULL, "out of memory");
                goto done;
            }
            const cJSON *t;
            cJSON_ArrayForEach(t, pr) {
                char name[32];
                snprintf(name, sizeof name, "prompt[%d]", i);
                if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble)) {
                    bad_type(e, name, "an integer token id", t);
                    goto done;
                }
                int32_t nv = tokenizer_n_vocab(ctx->tok);
                if (t->valuedouble < 0 || t->valuedouble >= nv) {
                    api_fail(e, 400, "invalid_request_error", name, "invalid_value",
                             "Invalid '%s': token id %.0f is outside the vocabulary [0, %d).", name, t->valuedouble,
                             nv);
                    goto done;
                }
                out->p.prompt[i++] = (int32_t)t->valuedouble;
            }
            out->p.n_prompt = n;
        } else {
            bad_type(e, "prompt", "a string or an array of token ids", pr);
            goto done;
        }
    }
    const char *pname = chat ? "messages" : "prompt";
    if (out->p.n_prompt == 0) {
        api_fail(e, 400, "invalid_request_error", pname, "empty_prompt", "The prompt is empty (0 tokens).");
        goto done;
    }
    if (out->p.n_prompt >= ctx->n_ctx) {
        api_fail(e, 400, "invalid_request_error", pname, "context_length_exceeded",
                 "This model's maximum context length is %d tokens. However, your %s resulted in %lld tokens. "
                 "Please reduce the length of the %s.",
                 ctx->n_ctx, chat ? "messages" : "prompt", (long long)out->p.n_prompt, pname);
        goto done;
    }
    /* ---- length ---- */
    /* Unbounded (missing or null): what is left of the context, within what
     * the KV pool can hold for one sequence (prompt + reply + 1 block). */
    long long mt = ctx->n_ctx - out->p.n_prompt;
    if (ctx->max_seq_tokens > 0 && ctx->max_seq_tokens - out->p.n_prompt < mt)
        mt = ctx->max_seq_tokens - out->p.n_prompt > 1 ? ctx->max_seq_tokens - out->p.n_prompt : 1;
    if (ctx->default_max_tokens > 0 && mt > ctx->default_max_tokens) mt = ctx->default_max_tokens;
    const char *mname = "max_tokens";
    if ((got = get_int(body, "max_tokens", 1, ctx->n_ctx, &ll, e)) < 0) goto done;
    if (got) mt = ll;
    if ((got = get_int(body, "max_completion_tokens", 1, ctx->n_ctx, &ll, e)) < 0) goto done;
    if (got) {
        mt = ll;
        mname = "max_completion_tokens";
    }
    (void)mname;
    if (mt > ctx->n_ctx - out->p.n_prompt) mt = ctx->n_ctx - out->p.n_prompt; /* finish_reason "length" at the end */
    out->p.max_tokens = (int)mt;
    rc = 0;
done:
    free(text);
    cJSON_Delete(body);
    if (rc < 0) api_req_free(out);
    return rc;
}

/* ---- responses ---- */

const char *api_finish_reason(sreq_finish f) {
    switch (f) {
    case SREQ_STOP: return "stop";
    case SREQ_LENGTH: return "length";
    case SREQ_CANCELLED: return "cancelled";
    default: return "error";
    }
}

/* A token's text as a JSON-safe string: invalid UTF-8 becomes U+FFFD. */
static char *safe_text(const char *p, int n) {
    char *o = malloc((size_t)n * 3 + 1);
    if (o == NULL) return NULL;
    size_t k = 0;
    int i = 0;
    while (i < n) {
        int l = 1;
        unsigned char c = (unsigned char)p[i];
        if (c >= 0xC2 && c <= 0xDF) l = 2;
        else if (c >= 0xE0 && c <= 0xEF) l = 3;
        else if (c >= 0xF0 && c <= 0xF4) l = 4;
        if (c < 0x80 || (i + l <= n && api_utf8_valid(p + i, (size_t)l) && c >= 0xC2)) {
            if (c == 0) {
                memcpy(o + k, "\xEF\xBF\xBD", 3);
                k += 3;
                i++;
                continue;
            }
            memcpy(o + k, p + i, (size_t)l);
            k += (size_t)l;
            i += l;
        } else {
            memcpy(o + k, "\xEF\xBF\xBD", 3);
            k += 3;
            i++;
        }
    }
    o[k] = 0;
    return o;
}

char *api_utf8_lossy(const char *p, size_t n) { return n > (size_t)INT32_MAX / 4 ? NULL : safe_text(p, (int)n); }

static cJSON *bytes_array(const char *p, int n) {
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber((unsigned char)p[i]));
    return a;
}

static void add_token_text(cJSON *o, const char *key, const char *p, int n) {
    char *s = safe_text(p, n);
    cJSON_AddStringToObject(o, key, s ? s : "");
    free(s);
}

static char *piece_of(const api_ctx *ctx, int32_t id, int *n) {
    int need = tokenizer_token_to_piece(ctx->tok, id, false, NULL, 0);
    int len = need < 0 ? -need : need;
    char *b = malloc((size_t)len + 1);
    if (b == NULL) {
        *n = 0;
        return NULL;
    }
    *n = len > 0 ? tokenizer_token_to_piece(ctx->tok, id, false, b, (size_t)len + 1) : 0;
    if (*n < 0) *n = 0;
    b[*n] = 0;
    return b;
}

static cJSON *chat_logprobs(const api_ctx *ctx, sreq *r, int from, int to) {
    cJSON *lp = cJSON_CreateObject(), *content = cJSON_CreateArray();
    cJSON_AddItemToObject(lp, "content", content);
    for (int i = from; i < to; i++) {
        const sreq_logprob *e = sreq_logprob_at(r, i);
        if (e == NULL) break;
        cJSON *t = cJSON_CreateObject();
        add_token_text(t, "token", e->piece ? e->piece : "", e->piece_len);
        cJSON_AddNumberToObject(t, "logprob", e->logprob);
        cJSON_AddItemToObject(t, "bytes", bytes_array(e->piece ? e->piece : "", e->piece_len));
        cJSON *tops = cJSON_CreateArray();
        for (int k = 0; k < e->n_top; k++) {
            int n;
            char *pc = piece_of(ctx, e->top_ids[k], &n);
            cJSON *x = cJSON_CreateObject();
            add_token_text(x, "token", pc ? pc : "", n);
            cJSON_AddNumberToObject(x, "logprob", e->top_lp[k]);
            cJSON_AddItemToObject(x, "bytes", bytes_array(pc ? pc : "", n));
            cJSON_AddItemToArray(tops, x);
            free(pc);
        }
        cJSON_AddItemToObject(t, "top_logprobs", tops);
        cJSON_AddItemToArray(content, t);
    }
    return lp;
}

static cJSON *completion_logprobs(const api_ctx *ctx, sreq *r, int from, int to, size_t offset0) {
    cJSON *lp = cJSON_CreateObject(), *tokens = cJSON_CreateArray(), *tlp = cJSON_CreateArray(),
          *top = cJSON_CreateArray(), *off = cJSON_CreateArray();
    size_t offset = offset0;
    for (int i = from; i < to; i++) {
        const sreq_logprob *e = sreq_logprob_at(r, i);
        if (e == NULL) break;
        char *s = safe_text(e->piece ? e->piece : "", e->piece_len);
        cJSON_AddItemToArray(tokens, cJSON_CreateString(s ? s : ""));
        free(s);
        cJSON_AddItemToArray(tlp, cJSON_CreateNumber(e->logprob));
        cJSON *m = cJSON_CreateObject();
        for (int k = 0; k < e->n_top; k++) {
            int n;
            char *pc = piece_of(ctx, e->top_ids[k], &n);
            char *ps = safe_text(pc ? pc : "", n);
            if (ps && !cJSON_HasObjectItem(m, ps)) cJSON_AddNumberToObject(m, ps, e->top_lp[k]);
            free(ps);
            free(pc);
        }
        cJSON_AddItemToArray(top, m);
        cJSON_AddItemToArray(off, cJSON_CreateNumber((double)offset));
        offset += (size_t)e->piece_len;
    }
    cJSON_AddItemToObject(lp, "tokens", tokens);
    cJSON_AddItemToObject(lp, "token_logprobs", tlp);
    cJSON_AddItemToObject(lp, "top_logprobs", top);
    cJSON_AddItemToObject(lp, "text_offset", off);
    return lp;
}

static cJSON *usage_json(const sreq_usage *u) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "prompt_tokens", (double)u->prompt_tokens);
    cJSON_AddNumberToObject(o, "completion_tokens", u->completion_tokens);
    cJSON_AddNumberToObject(o, "total_tokens", (double)(u->prompt_tokens + u->completion_tokens));
    cJSON *d = cJSON_CreateObject();
    cJSON_AddNumberToObject(d, "cached_tokens", (double)u->cached_tokens);
    cJSON_AddItemToObject(o, "prompt_tokens_details", d);
    return o;
}

static cJSON *envelope(const api_ctx *ctx, const char *id, long created, const char *object) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", id);
    cJSON_AddStringToObject(o, "object", object);
    cJSON_AddNumberToObject(o, "created", (double)created);
    cJSON_AddStringToObject(o, "model", ctx->model_id);
    cJSON_AddStringToObject(o, "system_fingerprint", "ember");
    return o;
}

char *api_response_json(const api_ctx *ctx, const api_req *q, const char *id, long created, const char *text,
                        sreq *r, int n_lp, const sreq_usage *u, sreq_finish f) {
    cJSON *o = envelope(ctx, id, created, q->chat ? "chat.completion" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(o, "choices"), *c = cJSON_CreateObject();
    cJSON_AddItemToArray(choices, c);
    cJSON_AddNumberToObject(c, "index", 0);
    bool tool_finish = false;
    if (q->chat) {
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "assistant");
        char *reasoning = NULL, *content = NULL;
        const char *said = text;
        if ((q->thinking_open || strstr(text, "</think>")) &&
            chat_split_reasoning(text, q->thinking_open, &reasoning, &content) == 0)
            said = content ? content : "";
        tool_calls calls = {0};
        char *rest = NULL;
        if (q->tools != TOOL_SYNTAX_NONE && tools_parse(q->tools, q->tool_schema, said, &rest, &calls) > 0) {
            if (rest) cJSON_AddStringToObject(m, "content", rest);
            else cJSON_AddNullToObject(m, "content");
            if (reasoning) cJSON_AddStringToObject(m, "reasoning_content", reasoning);
            cJSON_AddItemToObject(m, "tool_calls", tool_calls_json(&calls));
            if (f == SREQ_STOP) tool_finish = true;
        } else {
            cJSON_AddStringToObject(m, "content", said);
            if (reasoning) cJSON_AddStringToObject(m, "reasoning_content", reasoning);
        }
        tool_calls_free(&calls);
        free(rest);
        free(reasoning);
        free(content);
        cJSON_AddItemToObject(c, "message", m);
    } else {
        cJSON_AddStringToObject(c, "text", text);
    }
    if (q->logprobs) cJSON_AddItemToObject(c, "logprobs", q->chat ? chat_logprobs(ctx, r, 0, n_lp)
                                                                     : completion_logprobs(ctx, r, 0, n_lp, 0));
    else cJSON_AddNullToObject(c, "logprobs");
    cJSON_AddStringToObject(c, "finish_reason", tool_finish ? "tool_calls" : api_finish_reason(f));
    cJSON_AddItemToObject(o, "usage", usage_json(u));
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

char *api_chunk_json(const api_ctx *ctx, const api_req *q, const char *id, long created, const char *text,
                     const char *reasoning, bool role, sreq *r, int lp_from, int lp_to, const char *finish,
                     const sreq_usage *u, bool usage_only) {
    cJSON *o = envelope(ctx, id, created, q->chat ? "chat.completion.chunk" : "text_completion");
    cJSON *choices = cJSON_AddArrayToObject(o, "choices");
    if (!usage_only) {
        cJSON *c = cJSON_CreateObject();
        cJSON_AddItemToArray(choices, c);
        cJSON_AddNumberToObject(c, "index", 0);
        if (q->chat) {
            cJSON *d = cJSON_CreateObject();
            if (role) cJSON_AddStringToObject(d, "role", "assistant");
            if (reasoning) cJSON_AddStringToObject(d, "reasoning_content", reasoning);
            if (text) cJSON_AddStringToObject(d, "content", text);
            cJSON_AddItemToObject(c, "delta", d);
        } else {
            cJSON_AddStringToObject(c, "text", text ? text : "");
        }
        if (q->logprobs && lp_to > lp_from)
            cJSON_AddItemToObject(c, "logprobs", q->chat ? chat_logprobs(ctx, r, lp_from, lp_to)
                                                         : completion_logprobs(ctx, r, lp_from, lp_to, 0));
        else cJSON_AddNullToObject(c, "logprobs");
        if (finish) cJSON_AddStringToObject(c, "finish_reason", finish);
        else cJSON_AddNullToObject(c, "finish_reason");
    }
    if (q->include_usage) {
        if (usage_only && u) cJSON_AddItemToObject(o, "usage", usage_json(u));
        else cJSON_AddNullToObject(o, "usage");
    }
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

char *api_tool_chunk_json(const api_ctx *ctx, const api_req *q, const char *id, long created, int index,
                          const tool_call *call, bool head) {
    cJSON *o = envelope(ctx, id, created, "chat.completion.chunk");
    cJSON *choices = cJSON_AddArrayToObject(o, "choices"), *c = cJSON_CreateObject();
    cJSON_AddItemToArray(choices, c);
    cJSON_AddNumberToObject(c, "index", 0);
    cJSON *d = cJSON_CreateObject(), *arr = cJSON_CreateArray(), *tc = cJSON_CreateObject(), *fn = cJSON_CreateObject();
    cJSON_AddNumberToObject(tc, "index", index);
    if (head) {
        cJSON_AddStringToObject(tc, "id", call->id);
        cJSON_AddStringToObject(tc, "type", "function");
        cJSON_AddStringToObject(fn, "name", call->name);
        cJSON_AddStringToObject(fn, "arguments", "");
    } else {
        cJSON_AddStringToObject(fn, "arguments", call->arguments);
    }
    cJSON_AddItemToObject(tc, "function", fn);
    cJSON_AddItemToArray(arr, tc);
    cJSON_AddItemToObject(d, "tool_calls", arr);
    cJSON_AddItemToObject(c, "delta", d);
    cJSON_AddNullToObject(c, "logprobs");
    cJSON_AddNullToObject(c, "finish_reason");
    if (q->include_usage) cJSON_AddNullToObject(o, "usage");
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}
