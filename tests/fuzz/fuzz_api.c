/* fuzz_api.c - libFuzzer target for the request parser of
 * /v1/chat/completions and /v1/completions (api_parse, serve_api.h).
 *
 * The first input byte picks the endpoint (bit 0: chat) and whether a tenant
 * header is present (bit 1); the rest is the request body, exactly as the
 * HTTP layer hands it over. api_parse runs the whole path a request takes
 * before it is queued: UTF-8 and JSON validation, every field's type and
 * range, the chat template render of the messages and tools, tokenization,
 * the context-length check and the prompt-cache plan. Checked: a rejection
 * has a 4xx status (5xx only for out of memory), a message, and renders as
 * a JSON error body that parses back; an accepted request has a prompt of
 * 1..n_ctx-1 in-vocabulary tokens and 1 <= max_tokens <= n_ctx - prompt,
 * its cache plan's positions lie inside the prompt, and the next-turn
 * predictor it carries runs on the prompt without harm. The
 * model (for its tokenizer and chat template) is $EMBER_FUZZ_MODEL, default
 * build/models/default.gguf (qwen3 shape, ChatML template). */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat/chat_plan.h"
#include "core/log.h"
#include "model/model.h"
#include "serve/serve_api.h"
#include "serve/serve_chat.h"
#include "fuzz_target.h"

static model *g_model;
static serve_chat *g_chat;
static api_ctx g_ctx;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    ember_log_set_level(EMBER_LOG_ERROR);
    const char *path = getenv("EMBER_FUZZ_MODEL");
    if (path == NULL) path = "build/models/default.gguf";
    ember_error err;
    g_model = model_load(path, &err);
    if (g_model) g_chat = serve_chat_create(g_model, &err);
    if (g_chat == NULL) {
        fprintf(stderr, "fuzz_api: cannot load %s (set EMBER_FUZZ_MODEL): %s\n", path, err.msg);
        exit(1);
    }
    g_ctx.tok = model_get_tokenizer(g_model);
    g_ctx.chat = g_chat;
    g_ctx.model_id = "fuzz";
    g_ctx.n_ctx = 2048;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    bool chat = data[0] & 1;
    const char *tenant = (data[0] & 2) ? "tenant-a" : NULL;
    api_req q;
    api_error e;
    memset(&e, 0, sizeof e);
    if (api_parse(&g_ctx, chat, (const char *)data + 1, size - 1, tenant, &q, &e) < 0) {
        if (e.status < 400 || e.status > 599 || e.message[0] == '\0') abort();
        if (e.status >= 500 && strstr(e.message, "out of memory") == NULL) abort();
        char *json = api_error_json(&e);
        cJSON *back = json ? cJSON_Parse(json) : NULL;
        if (back == NULL || !cJSON_IsObject(cJSON_GetObjectItem(back, "error"))) abort();
        cJSON_Delete(back);
        free(json);
        api_req_free(&q);
        return 0;
    }
    const int32_t n_vocab = tokenizer_n_vocab(g_ctx.tok);
    if (q.p.n_prompt < 1 || q.p.n_prompt >= g_ctx.n_ctx) abort();
    for (int64_t i = 0; i < q.p.n_prompt; i++)
        if (q.p.prompt[i] < 0 || q.p.prompt[i] >= n_vocab) abort();
    if (q.p.max_tokens < 1 || q.p.max_tokens > g_ctx.n_ctx - q.p.n_prompt) abort();
    const chat_cache_plan *plan = &q.p.plan;
    if (plan->turn_pos < 0 || plan->turn_pos > q.p.n_prompt || plan->anchor_pos < 0 || plan->anchor_pos > q.p.n_prompt)
        abort();
    if (plan->predictor) {
        int64_t lcp = chat_turn_predict(plan->predictor, q.p.prompt, q.p.n_prompt);
        if (lcp < -1 || lcp > q.p.n_prompt) abort(); /* -1: no prediction */
    }
    api_req_free(&q);
    return 0;
}
