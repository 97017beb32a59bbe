/* chat_plan.c - the prompt cache's render positions and next-turn
 * prediction for one chat request (see chat_plan.h).
 *
 * Positions are common-prefix lengths in the prompt's own tokens: every
 * render is tokenized exactly as the prompt was (chat_encode_prompt), so a
 * template quirk that changes tokens (a BOS in the text, a special token)
 * shifts both sides alike. The predictor keeps its own copies of the
 * messages, tools, kwargs and token texts: it runs later, on another
 * thread, after the HTTP request's JSON is gone. */
#include "chat/chat_plan.h"

#include <stdlib.h>
#include <string.h>

int chat_encode_prompt(const tokenizer *tok, const char *text, int32_t **ids, size_t *n) {
    ember_error err;
    bool bos = tokenizer_add_bos(tok);
    if (bos) {
        size_t bl = 0;
        const char *bt = tokenizer_token_text(tok, tokenizer_bos(tok), &bl);
        if (bt && bl > 0 && strncmp(text, bt, bl) == 0) bos = false;
    }
    return tokenizer_encode_rendered(tok, text, strlen(text), bos, ids, n, &err);
}

int chat_json_defuse(const tokenizer *tok, cJSON *j) {
    for (cJSON *it = j; it; it = it->next) {
        if (it->string && !(it->type & cJSON_StringIsConst)) {
            size_t n;
            char *d = tokenizer_defuse_specials(tok, it->string, strlen(it->string), &n);
            if (d == NULL) return -1;
            free(it->string);
            it->string = d;
        }
        if (cJSON_IsString(it) && it->valuestring && !(it->string && strcmp(it->string, "role") == 0)) {
            size_t n;
            char *d = tokenizer_defuse_specials(tok, it->valuestring, strlen(it->valuestring), &n);
            if (d == NULL) return -1;
            free(it->valuestring);
            it->valuestring = d;
        }
        if (it->child && chat_json_defuse(tok, it->child) < 0) return -1;
    }
    return 0;
}

int64_t chat_token_common_prefix(const int32_t *a, int64_t na, const int32_t *b, int64_t nb) {
    int64_t i = 0;
    while (i < na && i < nb && a[i] == b[i]) i++;
    return i;
}

/* Common prefix of text's tokens with ids[0, n); -1 when it cannot tokenize. */
static int64_t text_prefix(const tokenizer *tok, const char *text, const int32_t *ids, int64_t n) {
    int32_t *t = NULL;
    size_t k = 0;
    if (chat_encode_prompt(tok, text, &t, &k) < 0) return -1;
    int64_t l = chat_token_common_prefix(t, (int64_t)k, ids, n);
    free(t);
    return l;
}

struct chat_turn_predictor {
    const chat_template *tpl;
    const tokenizer *tok;
    chat_messages *msgs;
    cJSON *tools, *kwargs;
    char *bos, *eos;
    chat_render_opts opts;
    int64_t n_prompt;
    bool thinking_open;
    bool defuse;        /* the reply's strings are defused as the request's were */
    chat_predict_fn fn; /* chat_turn_predictor_from_fn */
    void *fn_user;
};

chat_turn_predictor *chat_turn_predictor_from_fn(chat_predict_fn fn, void *user) {
    chat_turn_predictor *p = calloc(1, sizeof *p);
    if (p == NULL) return NULL;
    p->fn = fn;
    p->fn_user = user;
    return p;
}

void chat_turn_predictor_free(chat_turn_predictor *p) {
    if (p == NULL) return;
    chat_messages_free(p->msgs);
    cJSON_Delete(p->tools);
    cJSON_Delete(p->kwargs);
    free(p->bos);
    free(p->eos);
    free(p);
}

static char *decode_reply(const tokenizer *tok, const int32_t *ids, int64_t n) {
    tok_stream *s = tok_stream_create(tok, false);
    size_t cap = 256, len = 0, k;
    char *out = malloc(cap);
    if (s == NULL || out == NULL) {
        tok_stream_free(s);
        free(out);
        return NULL;
    }
    for (int64_t i = 0; i <= n; i++) {
        const char *piece = i < n ? tok_stream_push(s, ids[i], &k) : tok_stream_flush(s, &k);
        if (len + k + 1 > cap) {
            while (len + k + 1 > cap) cap *= 2;
            char *o = realloc(out, cap);
            if (o == NULL) {
                free(out);
                tok_stream_free(s);
                return NULL;
            }
            out = o;
        }
        memcpy(out + len, piece, k);
        len += k;
    }
    out[len] = 0;
    tok_stream_free(s);
    return out;
}

int64_t chat_turn_predict(chat_turn_predictor *p, const int32_t *tokens, int64_t n) {
    if (p && p->fn) return p->fn(p->fn_user, tokens, n);
    if (p == NULL || n < p->n_prompt) return -1;
    char *text = decode_reply(p->tok, tokens + p->n_prompt, n - p->n_prompt);
    if (text == NULL) return -1;
    char *reasoning = NULL, *content = NULL, *out = NULL;
    int64_t got = -1;
    bool split = chat_split_reasoning(text, p->thinking_open, &reasoning, &content) == 0;
    if (split && p->defuse) { /* the client sends the reply back as a message, which gets defused */
        size_t n_d;
        char *dc = content ? tokenizer_defuse_specials(p->tok, content, strlen(content), &n_d) : NULL;
        char *dr = reasoning ? tokenizer_defuse_specials(p->tok, reasoning, strlen(reasoning), &n_d) : NULL;
        split = (content == NULL || dc != NULL) && (reasoning == NULL || dr != NULL);
        free(content);
        free(reasoning);
        content = dc;
        reasoning = dr;
    }
    if (split) {
        chat_reply r = {content ? content : "", reasoning, NULL};
        ember_error err;
        if (chat_predict_next_turn(p->tpl, p->msgs, p->tools, &p->opts, &r, &out, &err) == 0)
            got = text_prefix(p->tok, out, tokens, n);
    }
    free(out);
    free(reasoning);
    free(content);
    free(text);
    return got;
}

void chat_cache_plan_make(const chat_plan_params *in, chat_cache_plan *out) {
    memset(out, 0, sizeof *out);
    ember_error err;
    const tokenizer *tok = in->tok;
    const int32_t *prompt = in->prompt;
    int64_t n_prompt = in->n_prompt;
    chat_turn_predictor *p = calloc(1, sizeof *p);
    if (p == NULL) return;
    const cJSON *tools = in->tools, *kwargs = in->kwargs;
    p->msgs = chat_messages_clone(in->messages);
    p->tools = tools && cJSON_IsArray(tools) && cJSON_GetArraySize(tools) > 0 ? cJSON_Duplicate(tools, 1) : NULL;
    p->kwargs = kwargs && cJSON_IsObject(kwargs) ? cJSON_Duplicate(kwargs, 1) : NULL;
    p->bos = in->bos ? strdup(in->bos) : NULL;
    p->eos = in->eos ? strdup(in->eos) : NULL;
    if (p->msgs == NULL || (in->bos && !p->bos) || (in->eos && !p->eos)) {
        chat_turn_predictor_free(p);
        return;
    }
    p->tpl = in->tpl;
    p->tok = tok;
    p->n_prompt = n_prompt;
    p->thinking_open = in->thinking_open;
    p->defuse = in->defuse_replies;
    p->opts.add_generation_prompt = false;
    p->opts.enable_thinking = -1;
    p->opts.bos_token = p->bos;
    p->opts.eos_token = p->eos;
    p->opts.extra = p->kwargs;
    char *text = NULL;
    if (chat_render_stable(p->tpl, p->msgs, p->tools, &p->opts, &text, &err) == 0) {
        int64_t l = text_prefix(tok, text, prompt, n_prompt);
        if (l > 0) out->turn_pos = l;
    }
    free(text);
    size_t off = 0;
    char *probe = NULL;
    if (chat_system_prefix_anchor(p->tpl, p->msgs, p->tools, &p->opts, &off, &probe, &err) == 1 && probe) {
        int64_t l = text_prefix(tok, probe, prompt, n_prompt);
        if (l > 0) out->anchor_pos = l;
    }
    free(probe);
    out->predictor = p;
}
