/* chat_plan.h - what a chat template tells the prompt cache about one
 * request (prompt-cache reference §8.2, §9).
 *
 * Contract:
 *  - chat_cache_plan_make renders the request's messages again, without a
 *    generation prompt (the turn boundary, p_stable) and with the
 *    system-prefix probe (the anchor), tokenizes each render the way the
 *    prompt was tokenized (chat_encode_prompt) and reports each as the
 *    length of its common prefix with the prompt's tokens. It also returns
 *    a next-turn predictor that owns copies of everything it needs.
 *  - chat_turn_predict(p, tokens, n): tokens[0, n) is the prompt followed by
 *    the reply so far; the reply is decoded, split into reasoning and
 *    content, appended as the assistant's message, the conversation
 *    rendered without a generation prompt and tokenized as the prompt was;
 *    the result is the common prefix with tokens[0, n), or -1 when there is
 *    no prediction. It costs a template render and a tokenisation of the
 *    whole conversation, so the request driver runs it off the engine thread.
 *    A predictor is used by one thread at a time.
 *  - Nothing here fails a request: what cannot be derived stays 0 / NULL,
 *    and the cache then stores less. Positions only decide where the cache
 *    stores, never what a lookup adopts. */
#ifndef EMBER_CHAT_PLAN_H
#define EMBER_CHAT_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "chat/chat.h"
#include "tokenizer/tokenizer.h"

typedef struct chat_turn_predictor chat_turn_predictor;

typedef struct chat_plan_params {
    const chat_template *tpl;  /* must outlive the predictor */
    const tokenizer *tok;      /* must outlive the predictor */
    const chat_messages *messages; /* the request's; copied */
    const cJSON *tools;        /* or NULL; copied */
    const cJSON *kwargs;       /* chat_template_kwargs or NULL; copied */
    const char *bos, *eos;     /* token texts for the template; copied */
    const int32_t *prompt;     /* the prompt's tokens */
    int64_t n_prompt;
    bool thinking_open;        /* the prompt ends inside <think> */
    bool defuse_replies;       /* the reply is defused like the request's strings (tokenizer.h) */
} chat_plan_params;

typedef struct chat_cache_plan {
    int64_t turn_pos;                 /* 0: none */
    int64_t anchor_pos;               /* 0: none */
    chat_turn_predictor *predictor;   /* NULL: none; chat_turn_predictor_free */
} chat_cache_plan;

/* ---- Plan ---- */
void chat_cache_plan_make(const chat_plan_params *p, chat_cache_plan *out);

/* ---- Prediction ---- */
int64_t chat_turn_predict(chat_turn_predictor *p, const int32_t *tokens, int64_t n);
void chat_turn_predictor_free(chat_turn_predictor *p);
/* A predictor whose answer is fn(user, tokens, n): for tests and
 * benchmarks that model a template's behaviour; user is borrowed. */
typedef int64_t (*chat_predict_fn)(void *user, const int32_t *tokens, int64_t n);
chat_turn_predictor *chat_turn_predictor_from_fn(chat_predict_fn fn, void *user);

/* ---- Tokens ---- */
/* The length of the longest common prefix of a[0, na) and b[0, nb). */
int64_t chat_token_common_prefix(const int32_t *a, int64_t na, const int32_t *b, int64_t nb);

/* ---- Tokenizing like the prompt ---- */
/* One BOS unless the text starts with it (when the tokenizer adds one),
 * special tokens parsed, defused text kept as text
 * (tokenizer_encode_rendered); *ids malloc'd. */
int chat_encode_prompt(const tokenizer *tok, const char *text, int32_t **ids, size_t *n);
/* Defuses every string of the JSON tree j and its siblings in place
 * (tokenizer_defuse_specials): values and object keys (a tool's parameter
 * names reach the render too), except values under the key "role", which
 * the API checks against a fixed list. What a request sends is defused this
 * way before it is rendered. -1: out of memory. */
int chat_json_defuse(const tokenizer *tok, cJSON *j);

#endif
