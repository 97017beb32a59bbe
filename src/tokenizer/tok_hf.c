/* tok_hf.c - tokenizers that do not come from a GGUF: Hugging Face style
 * byte-level BPE directories, and ember's built-in byte vocabulary.
 *
 * Design: an HF directory is turned into exactly what convert_hf_to_gguf.py
 * would have stored, so that exporting it with tokenizer_write_gguf_keys
 * gives a file llama.cpp treats like a converted model: ids missing from the
 * vocabulary become "[PAD<id>]" UNUSED tokens, added tokens marked special
 * (or that look special, e.g. <|...|>) become CONTROL and the others
 * USER_DEFINED, and the bos/eos/pad/unk ids come from tokenizer_config.json
 * with config.json as a fallback. JSON is parsed with cJSON; the vocabulary
 * and merges go straight into the hash tables, so a 151k-token directory
 * loads in a few tens of milliseconds. */
#include "tokenizer/tok_internal.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ---- Files ---- */

static char *read_file(const char *dir, const char *name, size_t *size) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "rb");
    if (fp == NULL) return NULL;
    char *buf = NULL;
    if (fseek(fp, 0, SEEK_END) == 0) {
        long n = ftell(fp);
        if (n >= 0 && fseek(fp, 0, SEEK_SET) == 0) {
            buf = malloc((size_t)n + 1);
            if (buf != NULL && fread(buf, 1, (size_t)n, fp) != (size_t)n) {
                free(buf);
                buf = NULL;
            }
            if (buf != NULL) {
                buf[n] = '\0';
                if (size) *size = (size_t)n;
            }
        }
    }
    fclose(fp);
    return buf;
}

static bool file_exists(const char *dir, const char *name) {
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static cJSON *read_json(const char *dir, const char *name, bool *present, ember_error *err) {
    size_t size = 0;
    char *text = read_file(dir, name, &size);
    *present = text != NULL;
    if (text == NULL) return NULL;
    cJSON *json = cJSON_ParseWithLength(text, size);
    free(text);
    if (json == NULL) ember_fail(err, "tokenizer: %s/%s is not valid JSON", dir, name);
    return json;
}

/* ---- Added tokens ---- */

typedef struct added_token {
    int32_t id;
    const char *content;
    bool special, lstrip, rstrip;
} added_token;

typedef struct added_list {
    added_token *v;
    size_t n, cap;
} added_list;

static bool json_flag(const cJSON *obj, const char *key) {
    return cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(obj, key));
}

/* Later sources override earlier entries for the same id. */
static int added_put(added_list *l, added_token a) {
    for (size_t i = 0; i < l->n; i++)
        if (l->v[i].id == a.id) {
            l->v[i] = a;
            return 0;
        }
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 32;
        added_token *grown = realloc(l->v, cap * sizeof *grown);
        if (grown == NULL) return -1;
        l->v = grown;
        l->cap = cap;
    }
    l->v[l->n++] = a;
    return 0;
}

static int added_from_object(added_list *l, const cJSON *o, int32_t id) {
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(o, "content");
    if (!cJSON_IsString(content) || id < 0) return 0;
    added_token a = {id, content->valuestring, json_flag(o, "special"), json_flag(o, "lstrip"),
                     json_flag(o, "rstrip")};
    return added_put(l, a);
}

/* added_tokens.json is either {"text": id, ...} or a list of token objects. */
static int collect_added_tokens_json(added_list *l, const cJSON *json) {
    const cJSON *item;
    cJSON_ArrayForEach(item, json) {
        if (cJSON_IsNumber(item) && item->string != NULL) {
            added_token a = {(int32_t)item->valuedouble, item->string, false, false, false};
            if (added_put(l, a) != 0) return -1;
        } else if (cJSON_IsObject(item)) {
            const cJSON *id = cJSON_GetObjectItemCaseSensitive(item, "id");
            if (cJSON_IsNumber(id) && added_from_object(l, item, (int32_t)id->valuedouble) != 0) return -1;
        }
    }
    return 0;
}

/* The names convert_hf_to_gguf.py treats as special even when not flagged. */
static bool looks_special(const char *s) {
    size_t n = strlen(s);
    static const char *const exact[] = {"<pad>", "<mask>", "<2mass>", "[@BOS@]"};
    for (size_t i = 0; i < 4; i++)
        if (strcmp(s, exact[i]) == 0) return true;
    struct { const char *pre, *suf; } wrap[] = {
        {"<|", "|>"}, {"<\xEF\xBD\x9C", "\xEF\xBD\x9C>"}, {"<start_of_", ">"}, {"<end_of_", ">"}};
    for (size_t i = 0; i < 4; i++) {
        size_t lp = strlen(wrap[i].pre), ls = strlen(wrap[i].suf);
        if (n >= lp + ls && memcmp(s, wrap[i].pre, lp) == 0 && memcmp(s + n - ls, wrap[i].suf, ls) == 0)
            return true;
    }
    return false;
}

/* A special token in tokenizer_config.json: "text" or {"content": "text"}. */
static int32_t config_token_id(const tokenizer *t, const cJSON *config, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(config, key);
    if (cJSON_IsObject(v)) v = cJSON_GetObjectItemCaseSensitive(v, "content");
    if (!cJSON_IsString(v)) return -1;
    return tok_lookup(t, v->valuestring, strlen(v->valuestring));
}

static int32_t config_int_id(const cJSON *config, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(config, key);
    if (cJSON_IsArray(v)) v = cJSON_GetArrayItem(v, 0);
    return cJSON_IsNumber(v) ? (int32_t)v->valuedouble : -1;
}

static int load_merges(tokenizer *t, char *text, ember_error *err) {
    char *line = text;
    bool first = true;
    while (line != NULL && *line != '\0') {
        char *nl = strchr(line, '\n');
        size_t len = nl ? (size_t)(nl - line) : strlen(line);
        if (len > 0 && line[len - 1] == '\r') len--;
        bool header = first && len >= 8 && memcmp(line, "#version", 8) == 0;
        if (!header && len > 0 && tok_add_merge_line(t, line, len, err) != 0) return -1;
        first = false;
        line = nl ? nl + 1 : NULL;
    }
    return 0;
}

tokenizer *tokenizer_load_hf_dir(const char *dir, const char *pre_name, ember_error *err) {
    const char *vocab_name, *merges_name;
    if (file_exists(dir, "vocab.json") && file_exists(dir, "merges.txt")) {
        vocab_name = "vocab.json", merges_name = "merges.txt";
    } else if (file_exists(dir, "encoder.json") && file_exists(dir, "vocab.bpe")) {
        vocab_name = "encoder.json", merges_name = "vocab.bpe";
    } else {
        ember_fail(err, "tokenizer: %s has neither vocab.json+merges.txt nor encoder.json+vocab.bpe", dir);
        return NULL;
    }
    tokenizer *t = NULL;
    cJSON *vocab = NULL, *added_json = NULL, *config = NULL, *model_config = NULL;
    char *merges_text = NULL;
    added_list added = {0};
    bool present;

    vocab = read_json(dir, vocab_name, &present, err);
    if (vocab == NULL || !cJSON_IsObject(vocab)) {
        if (vocab != NULL) ember_fail(err, "tokenizer: %s/%s is not a JSON object", dir, vocab_name);
        goto fail;
    }
    added_json = read_json(dir, "added_tokens.json", &present, err);
    if (present && added_json == NULL) goto fail;
    config = read_json(dir, "tokenizer_config.json", &present, err);
    if (present && config == NULL) goto fail;
    model_config = read_json(dir, "config.json", &present, err);
    if (present && model_config == NULL) goto fail;

    if (added_json != NULL && collect_added_tokens_json(&added, added_json) != 0) goto oom;
    const cJSON *decoder = cJSON_GetObjectItemCaseSensitive(config, "added_tokens_decoder");
    const cJSON *item;
    cJSON_ArrayForEach(item, decoder) {
        if (item->string != NULL && added_from_object(&added, item, (int32_t)atol(item->string)) != 0)
            goto oom;
    }

    int32_t max_id = -1;
    cJSON_ArrayForEach(item, vocab) {
        if (!cJSON_IsNumber(item) || item->valuedouble < 0 || item->valuedouble > INT32_MAX / 2) {
            ember_fail(err, "tokenizer: %s/%s: bad id for '%s'", dir, vocab_name,
                       item->string ? item->string : "?");
            goto fail;
        }
        if ((int32_t)item->valuedouble > max_id) max_id = (int32_t)item->valuedouble;
    }
    for (size_t i = 0; i < added.n; i++)
        if (added.v[i].id > max_id) max_id = added.v[i].id;
    if (max_id < 0 || max_id >= INT32_MAX / 2) {
        ember_fail(err, "tokenizer: %s/%s holds no tokens", dir, vocab_name);
        goto fail;
    }

    t = tok_alloc(TOK_MODEL_BPE, max_id + 1, err);
    if (t == NULL) goto fail;
    /* The HF files say explicitly which specials exist; no numeric defaults. */
    t->bos = t->eos = -1;
    bool *filled = calloc((size_t)max_id + 1, 1);
    if (filled == NULL) goto oom;
    cJSON_ArrayForEach(item, vocab) {
        int32_t id = (int32_t)item->valuedouble;
        if (tok_set_token(t, id, item->string, strlen(item->string), TOK_TYPE_NORMAL, 0.0f, err) != 0) {
            free(filled);
            goto fail;
        }
        filled[id] = true;
    }
    for (size_t i = 0; i < added.n; i++) {
        const added_token *a = &added.v[i];
        tok_type type = a->special || looks_special(a->content) ? TOK_TYPE_CONTROL : TOK_TYPE_USER_DEFINED;
        if (tok_set_token(t, a->id, a->content, strlen(a->content), type, 0.0f, err) != 0) {
            free(filled);
            goto fail;
        }
        t->tokens[a->id].attr = (uint8_t)((a->lstrip ? TOK_ATTR_LSTRIP : 0) | (a->rstrip ? TOK_ATTR_RSTRIP : 0));
        filled[a->id] = true;
    }
    for (int32_t id = 0; id <= max_id; id++) {
        if (filled[id]) continue;
        char pad[32];
        int n = snprintf(pad, sizeof pad, "[PAD%d]", id);
        if (tok_set_token(t, id, pad, (size_t)n, TOK_TYPE_UNUSED, 0.0f, err) != 0) {
            free(filled);
            goto fail;
        }
    }
    free(filled);
    if (tok_build_text_index(t, err) != 0) goto fail;

    const char *pre = pre_name;
    if (pre == NULL) {
        const cJSON *cls = cJSON_GetObjectItemCaseSensitive(config, "tokenizer_class");
        if (cJSON_IsString(cls) && strncmp(cls->valuestring, "Qwen2", 5) == 0)
            pre = "qwen2";
        else if (strcmp(vocab_name, "encoder.json") == 0 && max_id >= 100000)
            pre = "llama-bpe";
        else
            pre = "gpt-2";
    }
    if (tok_set_pre(t, pre, err) != 0) goto fail;

    size_t merges_size = 0;
    merges_text = read_file(dir, merges_name, &merges_size);
    if (merges_text == NULL) {
        ember_fail(err, "tokenizer: cannot read %s/%s", dir, merges_name);
        goto fail;
    }
    if (load_merges(t, merges_text, err) != 0) goto fail;

    t->bos = config_token_id(t, config, "bos_token");
    t->eos = config_token_id(t, config, "eos_token");
    t->pad = config_token_id(t, config, "pad_token");
    t->unk = config_token_id(t, config, "unk_token");
    if (t->bos < 0) t->bos = config_int_id(model_config, "bos_token_id");
    if (t->eos < 0) t->eos = config_int_id(model_config, "eos_token_id");
    const cJSON *flag = cJSON_GetObjectItemCaseSensitive(config, "add_bos_token");
    if (cJSON_IsBool(flag)) t->add_bos = cJSON_IsTrue(flag), t->add_bos_set = true;
    flag = cJSON_GetObjectItemCaseSensitive(config, "add_eos_token");
    if (cJSON_IsBool(flag)) t->add_eos = cJSON_IsTrue(flag), t->add_eos_set = true;

    const cJSON *tmpl = cJSON_GetObjectItemCaseSensitive(config, "chat_template");
    if (cJSON_IsArray(tmpl)) { /* named templates: take "default" */
        const cJSON *named = NULL, *entry;
        cJSON_ArrayForEach(entry, tmpl) {
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(entry, "name");
            if (cJSON_IsString(name) && strcmp(name->valuestring, "default") == 0)
                named = cJSON_GetObjectItemCaseSensitive(entry, "template");
        }
        tmpl = named;
    }
    if (cJSON_IsString(tmpl) &&
        tok_set_chat_template(t, tmpl->valuestring, strlen(tmpl->valuestring), err) != 0)
        goto fail;

    if (tok_finalize(t, err) != 0) goto fail;
    goto done;
oom:
    ember_fail(err, "tokenizer: out of memory loading %s", dir);
fail:
    tokenizer_free(t);
    t = NULL;
done:
    free(added.v);
    free(merges_text);
    cJSON_Delete(vocab);
    cJSON_Delete(added_json);
    cJSON_Delete(config);
    cJSON_Delete(model_config);
    return t;
}

/* ---- Built-in byte vocabulary ---- */

/* A few of the most frequent English pairs, in byte-mapped form ("\xC4\xA0"
 * is the mapped space); each result becomes a token after the 256 bytes. */
static const char *const BUILTIN_MERGES[] = {
    "\xC4\xA0 t", "\xC4\xA0 a", "h e", "i n", "r e", "o n", "\xC4\xA0t he", "e r",
    "\xC4\xA0 s", "a t", "\xC4\xA0 w", "\xC4\xA0 o", "e n", "\xC4\xA0 c", "i t", "i s",
    "a n", "o r", "e s", "\xC4\xA0 b", "e d", "\xC4\xA0 f", "in g", "\xC4\xA0 p",
    "o u", "\xC4\xA0" "a n", "a l", "a r", "\xC4\xA0t o", "\xC4\xA0 m", "\xC4\xA0o f",
    "\xC4\xA0 in", "\xC4\xA0 d", "\xC4\xA0 h", "\xC4\xA0" "an d",
};

static const char CHATML_TEMPLATE[] =
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

tokenizer *tokenizer_builtin_bytes(ember_error *err) {
    enum { N_MERGES = sizeof BUILTIN_MERGES / sizeof BUILTIN_MERGES[0] };
    static const char *const specials[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
    int32_t n_tokens = 256 + N_MERGES + 3;
    tokenizer *t = tok_alloc(TOK_MODEL_BPE, n_tokens, err);
    if (t == NULL) return NULL;
    for (int b = 0; b < 256; b++) {
        char buf[4];
        int n = tok_utf8_put(tok_byte_to_codepoint((uint8_t)b), buf);
        if (tok_set_token(t, b, buf, (size_t)n, TOK_TYPE_NORMAL, 0.0f, err) != 0) goto fail;
    }
    for (int i = 0; i < N_MERGES; i++) {
        char joined[32];
        size_t n = 0;
        for (const char *p = BUILTIN_MERGES[i]; *p; p++)
            if (*p != ' ') joined[n++] = *p;
        if (tok_set_token(t, 256 + i, joined, n, TOK_TYPE_NORMAL, 0.0f, err) != 0) goto fail;
    }
    for (int i = 0; i < 3; i++)
        if (tok_set_token(t, 256 + N_MERGES + i, specials[i], strlen(specials[i]), TOK_TYPE_CONTROL,
                          0.0f, err) != 0)
            goto fail;
    if (tok_build_text_index(t, err) != 0 || tok_set_pre(t, "qwen2", err) != 0) goto fail;
    for (int i = 0; i < N_MERGES; i++)
        if (tok_add_merge_line(t, BUILTIN_MERGES[i], strlen(BUILTIN_MERGES[i]), err) != 0) goto fail;
    int32_t endoftext = 256 + N_MERGES, im_end = 256 + N_MERGES + 2;
    /* bos is set (but not added) so that llama.cpp does not fall back to its
     * numeric default of 11 for a BPE vocabulary without one. */
    t->bos = t->eos = t->pad = endoftext;
    t->eot = im_end;
    t->add_bos = t->add_eos = false;
    t->add_bos_set = t->add_eos_set = true;
    if (tok_set_chat_template(t, CHATML_TEMPLATE, strlen(CHATML_TEMPLATE), err) != 0) goto fail;
    if (tok_finalize(t, err) != 0) goto fail;
    return t;
fail:
    tokenizer_free(t);
    return NULL;
}
