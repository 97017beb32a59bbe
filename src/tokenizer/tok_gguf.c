/* tok_gguf.c - the tokenizer.ggml.* keys: reading them into a tokenizer and
 * writing a tokenizer back out.
 *
 * Design: loading copies everything it needs (token texts, merges, the chat
 * template) so the GGUF may be closed right after. Missing keys take
 * llama.cpp's defaults (tok_alloc / tok_set_pre), and an id key whose value
 * is out of range is ignored rather than fatal, again as llama.cpp does, so
 * that a file behaves the same in both engines. The writer emits every key
 * explicitly (including add_bos/add_eos, whose defaults differ between
 * pre-tokenizers), which is what makes a round trip exact. */
#include "tokenizer/tok_internal.h"

#include <ctype.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct id_key {
    const char *key;
    size_t field; /* offsetof into tokenizer */
} id_key;

enum { N_PRIMARY_ID_KEYS = 13 };
#define ID_KEY(name, member) {"tokenizer.ggml." name, offsetof(tokenizer, member)}
static const id_key ID_KEYS[] = {
    ID_KEY("bos_token_id", bos),         ID_KEY("eos_token_id", eos),
    ID_KEY("eot_token_id", eot),         ID_KEY("eom_token_id", eom),
    ID_KEY("unknown_token_id", unk),     ID_KEY("seperator_token_id", sep),
    ID_KEY("padding_token_id", pad),     ID_KEY("fim_pre_token_id", fim_pre),
    ID_KEY("fim_suf_token_id", fim_suf), ID_KEY("fim_mid_token_id", fim_mid),
    ID_KEY("fim_pad_token_id", fim_pad), ID_KEY("fim_rep_token_id", fim_rep),
    ID_KEY("fim_sep_token_id", fim_sep),
    /* Older spellings of the fill-in-middle ids (read, never written). */
    ID_KEY("prefix_token_id", fim_pre),  ID_KEY("suffix_token_id", fim_suf),
    ID_KEY("middle_token_id", fim_mid),
};

static int32_t *id_field(tokenizer *t, size_t off) { return (int32_t *)((char *)t + off); }

/* llama.cpp marks every special token of Phi-3 models as eating the
 * whitespace to its right (except a few); it keys this on general.name. */
static void apply_name_rules(tokenizer *t, const gguf_file *f) {
    gguf_str name;
    if (!gguf_get_str(f, "general.name", &name)) return;
    char lower[256];
    size_t n = name.len < sizeof lower - 1 ? (size_t)name.len : sizeof lower - 1;
    for (size_t i = 0; i < n; i++) lower[i] = (char)tolower((unsigned char)name.ptr[i]);
    lower[n] = '\0';
    if (strstr(lower, "phi-3") == NULL && strstr(lower, "phi3") == NULL) return;
    for (int32_t i = 0; i < t->n_special; i++) t->tokens[t->special_ids[i]].attr |= TOK_ATTR_RSTRIP;
    int32_t id = tok_lookup(t, "</s>", 4);
    if (id >= 0) t->tokens[id].attr |= TOK_ATTR_RSTRIP;
    static const char *const keep[] = {"<unk>", "<s>", "<|endoftext|>"};
    for (size_t i = 0; i < 3; i++) {
        id = tok_lookup(t, keep[i], strlen(keep[i]));
        if (id >= 0) t->tokens[id].attr &= (uint8_t)~TOK_ATTR_RSTRIP;
    }
}

tokenizer *tokenizer_load_gguf(const gguf_file *f, ember_error *err) {
    gguf_str model_str;
    char model[32];
    if (!gguf_get_str(f, "tokenizer.ggml.model", &model_str)) {
        ember_fail(err, "tokenizer: key tokenizer.ggml.model missing");
        return NULL;
    }
    gguf_str_copy(model_str, model, sizeof model);
    tok_model kind;
    if (strcmp(model, "llama") == 0) {
        kind = TOK_MODEL_SPM;
    } else if (strcmp(model, "gpt2") == 0) {
        kind = TOK_MODEL_BPE;
    } else {
        ember_fail(err, "tokenizer: unsupported tokenizer model '%s' (supported: llama, gpt2)", model);
        return NULL;
    }

    gguf_value_type et;
    uint64_t n_tokens;
    int64_t tokens_idx = gguf_find_key(f, "tokenizer.ggml.tokens");
    if (tokens_idx < 0 || !gguf_kv_arr(f, tokens_idx, &et, &n_tokens) || et != GGUF_TYPE_STRING) {
        ember_fail(err, "tokenizer: tokenizer.ggml.tokens missing or not a string array");
        return NULL;
    }
    if (n_tokens == 0 || n_tokens > INT32_MAX / 2) {
        ember_fail(err, "tokenizer: tokenizer.ggml.tokens has %llu entries", (unsigned long long)n_tokens);
        return NULL;
    }
    tokenizer *t = tok_alloc(kind, (int32_t)n_tokens, err);
    if (t == NULL) return NULL;

    uint64_t n;
    int64_t scores_idx = gguf_find_key(f, "tokenizer.ggml.scores");
    if (scores_idx >= 0) {
        if (!gguf_kv_arr(f, scores_idx, &et, &n) || (et != GGUF_TYPE_FLOAT32 && et != GGUF_TYPE_FLOAT64) ||
            n != n_tokens) {
            ember_fail(err, "tokenizer: tokenizer.ggml.scores must be %llu floats",
                       (unsigned long long)n_tokens);
            goto fail;
        }
        t->has_scores = true;
    }
    int64_t types_idx = gguf_find_key(f, "tokenizer.ggml.token_type");
    if (types_idx >= 0) {
        if (!gguf_kv_arr(f, types_idx, &et, &n) || et == GGUF_TYPE_STRING || et == GGUF_TYPE_FLOAT32 ||
            et == GGUF_TYPE_FLOAT64 || n != n_tokens) {
            ember_fail(err, "tokenizer: tokenizer.ggml.token_type must be %llu integers",
                       (unsigned long long)n_tokens);
            goto fail;
        }
    }
    for (uint64_t i = 0; i < n_tokens; i++) {
        gguf_str s = gguf_arr_str(f, tokens_idx, i);
        int64_t type = types_idx >= 0 ? gguf_arr_int(f, types_idx, i) : TOK_TYPE_NORMAL;
        if (type < 0 || type > TOK_TYPE_BYTE) type = TOK_TYPE_UNDEFINED;
        float score = scores_idx >= 0 ? (float)gguf_arr_float(f, scores_idx, i) : 0.0f;
        if (tok_set_token(t, (int32_t)i, s.ptr, (size_t)s.len, (tok_type)type, score, err) != 0) goto fail;
    }
    if (tok_build_text_index(t, err) != 0) goto fail;

    bool flag;
    if (gguf_get_bool(f, "tokenizer.ggml.add_bos_token", &flag)) t->add_bos = flag, t->add_bos_set = true;
    if (gguf_get_bool(f, "tokenizer.ggml.add_eos_token", &flag)) t->add_eos = flag, t->add_eos_set = true;

    if (kind == TOK_MODEL_BPE) {
        gguf_str pre_str = {"", 0};
        char pre[48];
        gguf_get_str(f, "tokenizer.ggml.pre", &pre_str);
        gguf_str_copy(pre_str, pre, sizeof pre);
        if (tok_set_pre(t, pre, err) != 0) goto fail;
        int64_t merges_idx = gguf_find_key(f, "tokenizer.ggml.merges");
        if (merges_idx >= 0) {
            if (!gguf_kv_arr(f, merges_idx, &et, &n) || et != GGUF_TYPE_STRING) {
                ember_fail(err, "tokenizer: tokenizer.ggml.merges is not a string array");
                goto fail;
            }
            for (uint64_t i = 0; i < n; i++) {
                gguf_str m = gguf_arr_str(f, merges_idx, i);
                if (tok_add_merge_line(t, m.ptr, (size_t)m.len, err) != 0) goto fail;
            }
        }
    } else if (gguf_get_bool(f, "tokenizer.ggml.add_space_prefix", &flag)) {
        t->add_space_prefix = flag;
    }

    for (size_t i = 0; i < sizeof ID_KEYS / sizeof ID_KEYS[0]; i++) {
        int64_t v;
        if (gguf_get_int(f, ID_KEYS[i].key, &v) && v >= 0 && v < t->n_tokens)
            *id_field(t, ID_KEYS[i].field) = (int32_t)v;
    }

    gguf_str tmpl;
    if (gguf_get_str(f, "tokenizer.chat_template", &tmpl) &&
        tok_set_chat_template(t, tmpl.ptr, (size_t)tmpl.len, err) != 0)
        goto fail;

    if (tok_finalize(t, err) != 0) goto fail;
    apply_name_rules(t, f);
    return t;
fail:
    tokenizer_free(t);
    return NULL;
}

int tokenizer_write_gguf_keys(const tokenizer *t, gguf_writer *w, ember_error *err) {
    int32_t n = t->n_tokens;
    const char **strs = malloc((size_t)n * sizeof *strs);
    uint64_t *lens = malloc((size_t)n * sizeof *lens);
    int32_t *types = malloc((size_t)n * sizeof *types);
    float *scores = malloc((size_t)n * sizeof *scores);
    char **merge_strs = NULL;
    int rc = -1;
    if (strs == NULL || lens == NULL || types == NULL || scores == NULL) goto oom;

    gguf_writer_set_str(w, "tokenizer.ggml.model", t->model_name);
    if (t->model == TOK_MODEL_BPE) gguf_writer_set_str(w, "tokenizer.ggml.pre", t->pre_name);
    for (int32_t i = 0; i < n; i++) {
        strs[i] = tok_text(t, i);
        lens[i] = t->tokens[i].text_len;
        types[i] = t->tokens[i].type;
        scores[i] = t->tokens[i].score;
    }
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", strs, lens, (uint64_t)n);
    gguf_writer_set_arr(w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, types, (uint64_t)n);
    if (t->model == TOK_MODEL_SPM || t->has_scores)
        gguf_writer_set_arr(w, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, scores, (uint64_t)n);

    if (t->model == TOK_MODEL_BPE) {
        merge_strs = calloc((size_t)t->n_merges + 1, sizeof *merge_strs);
        if (merge_strs == NULL) goto oom;
        for (int32_t i = 0; i < t->n_merges; i++) {
            const tok_entry *l = &t->tokens[t->merges[i][0]], *r = &t->tokens[t->merges[i][1]];
            merge_strs[i] = malloc((size_t)l->text_len + r->text_len + 2);
            if (merge_strs[i] == NULL) goto oom;
            memcpy(merge_strs[i], t->arena + l->text_off, l->text_len);
            merge_strs[i][l->text_len] = ' ';
            memcpy(merge_strs[i] + l->text_len + 1, t->arena + r->text_off, r->text_len);
            merge_strs[i][l->text_len + 1 + r->text_len] = '\0';
        }
        gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", (const char *const *)merge_strs, NULL,
                                (uint64_t)t->n_merges);
    }

    for (size_t i = 0; i < N_PRIMARY_ID_KEYS; i++) {
        int32_t id = *id_field((tokenizer *)t, ID_KEYS[i].field);
        if (id >= 0) gguf_writer_set_u32(w, ID_KEYS[i].key, (uint32_t)id);
    }
    gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", tokenizer_add_bos(t));
    gguf_writer_set_bool(w, "tokenizer.ggml.add_eos_token", tokenizer_add_eos(t));
    if (t->model == TOK_MODEL_SPM)
        gguf_writer_set_bool(w, "tokenizer.ggml.add_space_prefix", t->add_space_prefix);
    if (t->chat_template != NULL) gguf_writer_set_str(w, "tokenizer.chat_template", t->chat_template);
    rc = 0;
    goto done;
oom:
    ember_fail(err, "tokenizer_write_gguf_keys: out of memory");
done:
    if (merge_strs != NULL)
        for (int32_t i = 0; i < t->n_merges; i++) free(merge_strs[i]);
    free(merge_strs);
    free(strs);
    free(lens);
    free(types);
    free(scores);
    return rc;
}
