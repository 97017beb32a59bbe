/* tok_vocab.c - the vocabulary tables shared by every tokenizer source.
 *
 * Design: token texts live in one growing arena (NUL-terminated copies, so a
 * tokenizer never points into a GGUF mapping that may be closed). Lookups go
 * through two open-addressing hash tables sized to a power of two at twice
 * the entry count: text -> id (FNV-1a over the bytes) and (left id, right
 * id) -> merge rank and result id (splitmix64 over the packed pair). Both are
 * built once at load time, which keeps a 151k-token / 151k-merge vocabulary
 * well under a second and makes each BPE step an O(1) probe.
 *
 * tok_finalize applies, in one place, the rules llama.cpp applies after
 * reading the keys: default special ids, forced CONTROL type for well-known
 * end-of-turn texts, inference of eot and fill-in-middle ids from their
 * texts, the end-of-generation set, and the list of tokens that are split out
 * of raw text before the model runs (longest text first). */
#define _GNU_SOURCE /* qsort_r */
#include "tokenizer/tok_internal.h"

#include <stdlib.h>
#include <string.h>

/* ---- UTF-8 and the GPT-2 byte table ---- */

/* The 68 unprintable bytes are 0x00-0x20, 0x7F-0xA0 and 0xAD; numbered in
 * increasing order from U+0100 they occupy three contiguous runs, so both
 * directions have a closed form (no shared table to initialise). */
uint32_t tok_byte_to_codepoint(uint8_t b) {
    if (b <= 0x20) return 0x100u + b;
    if (b >= 0x7F && b <= 0xA0) return 0x121u + (uint32_t)(b - 0x7F);
    if (b == 0xAD) return 0x143u;
    return b; /* printable: maps to itself */
}

int tok_codepoint_to_byte(uint32_t cp) {
    if (cp <= 0xFF) {
        bool printable = (cp >= 0x21 && cp <= 0x7E) || (cp >= 0xA1 && cp <= 0xAC) || cp >= 0xAE;
        return printable ? (int)cp : -1;
    }
    if (cp <= 0x120) return (int)(cp - 0x100);
    if (cp <= 0x142) return (int)(0x7F + (cp - 0x121));
    if (cp == 0x143) return 0xAD;
    return -1;
}

int tok_utf8_put(uint32_t cp, char *out) {
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | (cp >> 6));
        o[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

int tok_utf8_get(const unsigned char *s, size_t n, int32_t *cp) {
    unsigned char c = s[0];
    int len;
    uint32_t v;
    if (c < 0x80) {
        *cp = c;
        return 1;
    } else if (c >= 0xC2 && c <= 0xDF) {
        len = 2, v = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3, v = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4, v = c & 0x07;
    } else {
        *cp = -1;
        return 1;
    }
    if ((size_t)len > n) {
        *cp = -1;
        return 1;
    }
    for (int i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) {
            *cp = -1;
            return 1;
        }
        v = (v << 6) | (s[i] & 0x3F);
    }
    /* Reject overlong forms, surrogates and values past U+10FFFF. */
    if ((len == 3 && v < 0x800) || (len == 4 && (v < 0x10000 || v > 0x10FFFF)) ||
        (v >= 0xD800 && v <= 0xDFFF)) {
        *cp = -1;
        return 1;
    }
    *cp = (int32_t)v;
    return len;
}

/* ---- Hashing ---- */

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h ^ (h >> 29);
}

static uint64_t hash_pair(uint64_t key) {
    key += 0x9E3779B97F4A7C15ull;
    key = (key ^ (key >> 30)) * 0xBF58476D1CE4E5B9ull;
    key = (key ^ (key >> 27)) * 0x94D049BB133111EBull;
    return key ^ (key >> 31);
}

static uint32_t table_size_for(size_t n) {
    uint32_t size = 16;
    while (size < 2 * n) size <<= 1;
    return size;
}

/* ---- Construction ---- */

tokenizer *tok_alloc(tok_model model, int32_t n_tokens, ember_error *err) {
    if (n_tokens <= 0 || n_tokens > (1 << 30)) {
        ember_fail(err, "tokenizer: invalid vocabulary size %d", n_tokens);
        return NULL;
    }
    tokenizer *t = calloc(1, sizeof *t);
    if (t == NULL) goto oom;
    t->model = model;
    strcpy(t->model_name, model == TOK_MODEL_SPM ? "llama" : "gpt2");
    t->n_tokens = n_tokens;
    t->tokens = calloc((size_t)n_tokens, sizeof *t->tokens);
    t->arena_cap = (size_t)n_tokens * 8 + 64;
    t->arena = malloc(t->arena_cap);
    if (t->tokens == NULL || t->arena == NULL) goto oom;
    t->arena[0] = '\0'; /* offset 0: the empty text of unset tokens */
    t->arena_len = 1;
    /* llama.cpp's defaults when the keys are absent (dropped by tok_finalize
     * if out of range). */
    if (model == TOK_MODEL_SPM) {
        t->bos = 1, t->eos = 2, t->unk = 0;
        t->add_bos = true;
        t->add_space_prefix = true;
    } else {
        t->bos = 11, t->eos = 11, t->unk = -1;
    }
    t->eot = t->eom = t->pad = t->sep = -1;
    t->fim_pre = t->fim_suf = t->fim_mid = t->fim_pad = t->fim_rep = t->fim_sep = -1;
    return t;
oom:
    tokenizer_free(t);
    ember_fail(err, "tokenizer: out of memory for %d tokens", n_tokens);
    return NULL;
}

int tok_set_token(tokenizer *t, int32_t id, const char *text, size_t len, tok_type type,
                  float score, ember_error *err) {
    if (id < 0 || id >= t->n_tokens) return ember_fail(err, "tokenizer: token id %d out of range", id);
    if (len > UINT32_MAX / 2) return ember_fail(err, "tokenizer: token %d text too long", id);
    if (t->arena_len + len + 1 > t->arena_cap) {
        size_t cap = t->arena_cap;
        while (t->arena_len + len + 1 > cap) cap *= 2;
        if (cap > UINT32_MAX) return ember_fail(err, "tokenizer: vocabulary text exceeds 4 GiB");
        char *grown = realloc(t->arena, cap);
        if (grown == NULL) return ember_fail(err, "tokenizer: out of memory");
        t->arena = grown;
        t->arena_cap = cap;
    }
    tok_entry *e = &t->tokens[id];
    e->text_off = (uint32_t)t->arena_len;
    e->text_len = (uint32_t)len;
    memcpy(t->arena + t->arena_len, text, len);
    t->arena[t->arena_len + len] = '\0';
    t->arena_len += len + 1;
    e->type = (uint8_t)type;
    e->score = score;
    return 0;
}

int tok_build_text_index(tokenizer *t, ember_error *err) {
    uint32_t size = table_size_for((size_t)t->n_tokens);
    free(t->text_slots);
    t->text_slots = malloc((size_t)size * sizeof *t->text_slots);
    if (t->text_slots == NULL) return ember_fail(err, "tokenizer: out of memory for text index");
    memset(t->text_slots, 0xFF, (size_t)size * sizeof *t->text_slots);
    t->text_mask = size - 1;
    for (int32_t id = 0; id < t->n_tokens; id++) {
        const tok_entry *e = &t->tokens[id];
        const char *text = t->arena + e->text_off;
        uint32_t slot = (uint32_t)hash_bytes(text, e->text_len) & t->text_mask;
        for (;;) {
            int32_t other = t->text_slots[slot];
            if (other < 0) {
                t->text_slots[slot] = id;
                break;
            }
            const tok_entry *o = &t->tokens[other];
            if (o->text_len == e->text_len && memcmp(t->arena + o->text_off, text, e->text_len) == 0) {
                /* Duplicate text: the later id wins, as in llama.cpp. */
                t->text_slots[slot] = id;
                break;
            }
            slot = (slot + 1) & t->text_mask;
        }
    }
    return 0;
}

int32_t tok_lookup(const tokenizer *t, const char *text, size_t len) {
    if (t->text_slots == NULL) return -1;
    uint32_t slot = (uint32_t)hash_bytes(text, len) & t->text_mask;
    for (;;) {
        int32_t id = t->text_slots[slot];
        if (id < 0) return -1;
        const tok_entry *e = &t->tokens[id];
        if (e->text_len == len && memcmp(t->arena + e->text_off, text, len) == 0) return id;
        slot = (slot + 1) & t->text_mask;
    }
}

static int merge_table_grow(tokenizer *t, ember_error *err) {
    uint32_t size = table_size_for((size_t)t->merges_cap);
    tok_merge_slot *slots = malloc((size_t)size * sizeof *slots);
    if (slots == NULL) return ember_fail(err, "tokenizer: out of memory for merges");
    for (uint32_t i = 0; i < size; i++) slots[i].key = TOK_EMPTY_KEY;
    uint32_t mask = size - 1;
    if (t->merge_slots != NULL) {
        for (uint32_t i = 0; i <= t->merge_mask; i++) {
            if (t->merge_slots[i].key == TOK_EMPTY_KEY) continue;
            uint32_t s = (uint32_t)hash_pair(t->merge_slots[i].key) & mask;
            while (slots[s].key != TOK_EMPTY_KEY) s = (s + 1) & mask;
            slots[s] = t->merge_slots[i];
        }
    }
    free(t->merge_slots);
    t->merge_slots = slots;
    t->merge_mask = mask;
    return 0;
}

int tok_add_merge(tokenizer *t, const char *left, size_t left_len, const char *right,
                  size_t right_len, ember_error *err) {
    int32_t l = tok_lookup(t, left, left_len);
    int32_t r = tok_lookup(t, right, right_len);
    if (l < 0 || r < 0) return 0; /* cannot apply to token ids; ignore like an absent pair */
    uint64_t key = ((uint64_t)(uint32_t)l << 32) | (uint32_t)r;
    if (t->n_merges == t->merges_cap) {
        int32_t cap = t->merges_cap ? t->merges_cap * 2 : 1024;
        void *grown = realloc(t->merges, (size_t)cap * sizeof *t->merges);
        if (grown == NULL) return ember_fail(err, "tokenizer: out of memory for merges");
        t->merges = grown;
        t->merges_cap = cap;
        if (merge_table_grow(t, err) != 0) return -1;
    }
    uint32_t s = (uint32_t)hash_pair(key) & t->merge_mask;
    while (t->merge_slots[s].key != TOK_EMPTY_KEY) {
        if (t->merge_slots[s].key == key) return 0; /* duplicate: the first (best) rank stays */
        s = (s + 1) & t->merge_mask;
    }
    char small[256];
    char *joined = left_len + right_len <= sizeof small ? small : malloc(left_len + right_len);
    if (joined == NULL) return ember_fail(err, "tokenizer: out of memory");
    memcpy(joined, left, left_len);
    memcpy(joined + left_len, right, right_len);
    int32_t result = tok_lookup(t, joined, left_len + right_len);
    if (joined != small) free(joined);
    t->merge_slots[s].key = key;
    t->merge_slots[s].rank = t->n_merges;
    t->merge_slots[s].result = result;
    t->merges[t->n_merges][0] = l;
    t->merges[t->n_merges][1] = r;
    t->n_merges++;
    return 0;
}

int tok_add_merge_line(tokenizer *t, const char *line, size_t len, ember_error *err) {
    /* The separator is the first space after the first byte, so that a left
     * side consisting of a space (only in non-byte-mapped vocabularies) works. */
    const char *sep = len > 1 ? memchr(line + 1, ' ', len - 1) : NULL;
    if (sep == NULL) return 0;
    size_t left_len = (size_t)(sep - line);
    return tok_add_merge(t, line, left_len, sep + 1, len - left_len - 1, err);
}

const tok_merge_slot *tok_find_merge(const tokenizer *t, int32_t left, int32_t right) {
    if (t->merge_slots == NULL) return NULL;
    uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
    uint32_t s = (uint32_t)hash_pair(key) & t->merge_mask;
    for (;;) {
        const tok_merge_slot *slot = &t->merge_slots[s];
        if (slot->key == key) return slot;
        if (slot->key == TOK_EMPTY_KEY) return NULL;
        s = (s + 1) & t->merge_mask;
    }
}

int tok_set_chat_template(tokenizer *t, const char *text, size_t len, ember_error *err) {
    free(t->chat_template);
    t->chat_template = malloc(len + 1);
    if (t->chat_template == NULL) return ember_fail(err, "tokenizer: out of memory");
    memcpy(t->chat_template, text, len);
    t->chat_template[len] = '\0';
    return 0;
}

/* ---- Finalisation ---- */

static int32_t find_cstr(const tokenizer *t, const char *s) {
    return tok_lookup(t, s, strlen(s));
}

static void force_control(tokenizer *t, int32_t id) {
    if (id >= 0 && t->tokens[id].type != TOK_TYPE_CONTROL) t->tokens[id].type = TOK_TYPE_CONTROL;
}

/* Sets *slot from the first listed text present, forcing it to CONTROL, when
 * the id was not given by the file (llama.cpp infers these the same way). */
static void infer_special(tokenizer *t, int32_t *slot, const char *const *texts) {
    if (*slot >= 0) return;
    for (; *texts != NULL; texts++) {
        int32_t id = find_cstr(t, *texts);
        if (id >= 0) {
            *slot = id;
            force_control(t, id);
            return;
        }
    }
}

static int compare_special(const void *a, const void *b, void *ctx) {
    const tokenizer *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint32_t lx = t->tokens[x].text_len, ly = t->tokens[y].text_len;
    if (lx != ly) return lx > ly ? -1 : 1;
    return x < y ? -1 : x > y;
}

int tok_finalize(tokenizer *t, ember_error *err) {
    int32_t *ids[] = {&t->bos, &t->eos, &t->eot, &t->eom, &t->unk, &t->pad, &t->sep,
                      &t->fim_pre, &t->fim_suf, &t->fim_mid, &t->fim_pad, &t->fim_rep, &t->fim_sep};
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++)
        if (*ids[i] >= t->n_tokens || *ids[i] < 0) *ids[i] = -1;

    for (int b = 0; b < 256; b++) {
        char buf[8];
        int32_t id;
        if (t->model == TOK_MODEL_SPM) {
            static const char hex[] = "0123456789ABCDEF";
            char name[7] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>', 0};
            id = find_cstr(t, name);
            if (id < 0 && b < 0x80) {
                buf[0] = (char)b;
                id = tok_lookup(t, buf, 1);
            }
        } else {
            int n = tok_utf8_put(tok_byte_to_codepoint((uint8_t)b), buf);
            id = tok_lookup(t, buf, (size_t)n);
        }
        t->byte_token[b] = id;
    }

    static const char *const eot_texts[] = {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>",
        "_<EOT>", "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>",
        "<end_of_utterance>", NULL};
    static const char *const eom_texts[] = {"<|eom_id|>", NULL};
    static const char *const fim_pre_texts[] = {"<|fim_prefix|>", "<fim-prefix>",
                                                "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "begin\xEF\xBD\x9C>",
                                                "<PRE>", "\xE2\x96\x81<PRE>", NULL};
    static const char *const fim_suf_texts[] = {"<|fim_suffix|>", "<fim-suffix>",
                                                "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "hole\xEF\xBD\x9C>",
                                                "<SUF>", "\xE2\x96\x81<SUF>", NULL};
    static const char *const fim_mid_texts[] = {"<|fim_middle|>", "<fim-middle>",
                                                "<\xEF\xBD\x9C" "fim\xE2\x96\x81" "end\xEF\xBD\x9C>",
                                                "<MID>", "\xE2\x96\x81<MID>", NULL};
    static const char *const fim_pad_texts[] = {"<|fim_pad|>", "<fim-pad>", "<PAD>", NULL};
    static const char *const fim_rep_texts[] = {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
                                                "<REPO>", "<reponame>", NULL};
    static const char *const fim_sep_texts[] = {"<|file_sep|>", "<|file_separator|>",
                                                "<fim-sep>", "<SEP>", NULL};
    infer_special(t, &t->eot, eot_texts);
    infer_special(t, &t->eom, eom_texts);
    infer_special(t, &t->fim_pre, fim_pre_texts);
    infer_special(t, &t->fim_suf, fim_suf_texts);
    infer_special(t, &t->fim_mid, fim_mid_texts);
    infer_special(t, &t->fim_pad, fim_pad_texts);
    infer_special(t, &t->fim_rep, fim_rep_texts);
    infer_special(t, &t->fim_sep, fim_sep_texts);

    /* End of generation: the configured ids plus every well-known
     * end-of-turn text, which is also forced to CONTROL. */
    static const char *const eog_texts[] = {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
        "<|calls|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>",
        "<|end_of_text|>", "<end_of_utterance>", NULL};
    for (int32_t i = 0; i < t->n_tokens; i++) t->tokens[i].is_eog = 0;
    for (const char *const *p = eog_texts; *p != NULL; p++) {
        int32_t id = find_cstr(t, *p);
        if (id >= 0) {
            force_control(t, id);
            t->tokens[id].is_eog = 1;
        }
    }
    int32_t eog_ids[] = {t->eos, t->eot, t->eom, t->fim_pad, t->fim_rep, t->fim_sep};
    for (size_t i = 0; i < sizeof eog_ids / sizeof eog_ids[0]; i++)
        if (eog_ids[i] >= 0) t->tokens[eog_ids[i]].is_eog = 1;

    free(t->special_ids);
    t->special_ids = NULL;
    t->n_special = 0;
    int32_t n = 0;
    for (int32_t i = 0; i < t->n_tokens; i++) {
        uint8_t ty = t->tokens[i].type;
        if ((ty == TOK_TYPE_CONTROL || ty == TOK_TYPE_USER_DEFINED || ty == TOK_TYPE_UNKNOWN) &&
            t->tokens[i].text_len > 0)
            n++;
    }
    if (n > 0) {
        t->special_ids = malloc((size_t)n * sizeof *t->special_ids);
        if (t->special_ids == NULL) return ember_fail(err, "tokenizer: out of memory");
        for (int32_t i = 0; i < t->n_tokens; i++) {
            uint8_t ty = t->tokens[i].type;
            if ((ty == TOK_TYPE_CONTROL || ty == TOK_TYPE_USER_DEFINED || ty == TOK_TYPE_UNKNOWN) &&
                t->tokens[i].text_len > 0)
                t->special_ids[t->n_special++] = i;
        }
        qsort_r(t->special_ids, (size_t)n, sizeof *t->special_ids, compare_special, t);
    }
    return 0;
}

void tokenizer_free(tokenizer *t) {
    if (t == NULL) return;
    for (int i = 0; i < t->n_regex; i++) pcre2_code_free(t->regex[i]);
    free(t->tokens);
    free(t->arena);
    free(t->text_slots);
    free(t->merges);
    free(t->merge_slots);
    free(t->special_ids);
    free(t->chat_template);
    free(t);
}

/* ---- Accessors ---- */

int32_t tokenizer_n_vocab(const tokenizer *t) { return t->n_tokens; }
int32_t tokenizer_bos(const tokenizer *t) { return t->bos; }
int32_t tokenizer_eos(const tokenizer *t) { return t->eos; }
int32_t tokenizer_eot(const tokenizer *t) { return t->eot; }
int32_t tokenizer_pad(const tokenizer *t) { return t->pad; }
int32_t tokenizer_unk(const tokenizer *t) { return t->unk; }
bool tokenizer_add_bos(const tokenizer *t) { return t->add_bos && t->bos >= 0; }
bool tokenizer_add_eos(const tokenizer *t) { return t->add_eos && t->eos >= 0; }
const char *tokenizer_model_name(const tokenizer *t) { return t->model_name; }
const char *tokenizer_pre_name(const tokenizer *t) { return t->pre_name; }
const char *tokenizer_chat_template(const tokenizer *t) { return t->chat_template; }

bool tokenizer_is_eog(const tokenizer *t, int32_t id) {
    return id >= 0 && id < t->n_tokens && t->tokens[id].is_eog;
}

const char *tokenizer_token_text(const tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->n_tokens) return NULL;
    if (len) *len = t->tokens[id].text_len;
    return tok_text(t, id);
}

tok_type tokenizer_token_type(const tokenizer *t, int32_t id) {
    if (id < 0 || id >= t->n_tokens) return TOK_TYPE_UNDEFINED;
    return (tok_type)t->tokens[id].type;
}

int32_t tokenizer_find_token(const tokenizer *t, const char *text, size_t len) {
    return tok_lookup(t, text, len);
}
