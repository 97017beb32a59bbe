/* tok_internal.h - the tokenizer struct and helpers shared by the files of
 * src/tokenizer/. Not part of the public API.
 *
 * Loaders fill a tokenizer through the tok_builder-style helpers below
 * (tok_alloc, tok_set_token, tok_add_merge, tok_finalize); tok_finalize
 * derives everything that is computed rather than stored (byte tokens, the
 * special-token list, the end-of-generation set, default ids) so that every
 * loader ends in the same state. */
#ifndef EMBER_TOK_INTERNAL_H
#define EMBER_TOK_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "tokenizer/tokenizer.h"

typedef enum tok_model { TOK_MODEL_SPM, TOK_MODEL_BPE } tok_model;

/* Attribute bits beyond the stored type (set by HF added-token flags or by
 * llama.cpp-compatible name rules). */
enum { TOK_ATTR_LSTRIP = 1, TOK_ATTR_RSTRIP = 2 };

typedef struct tok_entry {
    uint32_t text_off; /* into tokenizer.arena, NUL-terminated there */
    uint32_t text_len;
    float score;
    uint8_t type;  /* tok_type */
    uint8_t attr;  /* TOK_ATTR_* */
    uint8_t is_eog;
} tok_entry;

typedef struct tok_merge_slot {
    uint64_t key;    /* (left << 32) | right; TOK_EMPTY_KEY when free */
    int32_t rank;
    int32_t result;  /* id of left+right, -1 if that text is not a token */
} tok_merge_slot;

#define TOK_EMPTY_KEY UINT64_MAX
#define TOK_MAX_REGEX 8

struct tokenizer {
    tok_model model;
    char model_name[16];
    char pre_name[48];

    /* Vocabulary. */
    int32_t n_tokens;
    tok_entry *tokens;
    char *arena;
    size_t arena_len, arena_cap;
    bool has_scores;

    /* text -> id, open addressing; slot holds id or -1. */
    int32_t *text_slots;
    uint32_t text_mask;

    /* BPE merges: ranks in insertion order, and the (left,right) hash. */
    int32_t (*merges)[2];
    int32_t n_merges, merges_cap;
    tok_merge_slot *merge_slots;
    uint32_t merge_mask;

    /* Per raw byte: SPM <0xXX> token or BPE byte-mapped single-char token. */
    int32_t byte_token[256];

    /* Pre-tokenizer (BPE only). */
    pcre2_code *regex[TOK_MAX_REGEX];
    int n_regex;
    bool ignore_merges;

    /* Special ids (-1 when absent). */
    int32_t bos, eos, eot, eom, unk, pad, sep;
    int32_t fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep;
    bool add_bos, add_eos, add_space_prefix;
    /* Whether add_bos/add_eos were given explicitly (else defaulted). */
    bool add_bos_set, add_eos_set;

    /* Tokens split out of raw text before the model runs, longest first. */
    int32_t *special_ids;
    int32_t n_special;

    char *chat_template;
};

/* ---- Construction (tok_vocab.c) ---- */
tokenizer *tok_alloc(tok_model model, int32_t n_tokens, ember_error *err);
/* Copies text into the arena. Returns -1 on allocation failure. */
int tok_set_token(tokenizer *t, int32_t id, const char *text, size_t len, tok_type type,
                  float score, ember_error *err);
/* Builds the text->id table; call once all tokens are set. */
int tok_build_text_index(tokenizer *t, ember_error *err);
/* Adds a merge "left right" by texts (both sides must be tokens; merges
 * naming unknown texts are skipped). Needs the text index. */
int tok_add_merge(tokenizer *t, const char *left, size_t left_len, const char *right,
                  size_t right_len, ember_error *err);
/* Splits "left right" at the first space after index 0 and adds it. */
int tok_add_merge_line(tokenizer *t, const char *line, size_t len, ember_error *err);
/* Selects the pre-tokenizer by name, compiles its regexes, sets
 * ignore_merges and the default add_bos. */
int tok_set_pre(tokenizer *t, const char *pre_name, ember_error *err);
/* Derives byte tokens, default ids, forced CONTROL texts, eot inference, the
 * end-of-generation set and the special list. */
int tok_finalize(tokenizer *t, ember_error *err);
int tok_set_chat_template(tokenizer *t, const char *text, size_t len, ember_error *err);

int32_t tok_lookup(const tokenizer *t, const char *text, size_t len);
const tok_merge_slot *tok_find_merge(const tokenizer *t, int32_t left, int32_t right);

static inline const char *tok_text(const tokenizer *t, int32_t id) {
    return t->arena + t->tokens[id].text_off;
}

/* ---- Byte-level mapping (tok_vocab.c) ---- */
/* Code point that GPT-2's byte encoder assigns to byte b. */
uint32_t tok_byte_to_codepoint(uint8_t b);
/* Inverse: the byte for code point cp, or -1 when cp is not in the table. */
int tok_codepoint_to_byte(uint32_t cp);
/* Writes cp as UTF-8 into out (4 bytes room); returns its length. */
int tok_utf8_put(uint32_t cp, char *out);
/* Decodes one code point at s (n bytes left). Returns the sequence length
 * (>= 1) and sets *cp; malformed input yields length 1 and *cp = -1. */
int tok_utf8_get(const unsigned char *s, size_t n, int32_t *cp);

/* ---- Pre-tokenizer (tok_pretok.c) ---- */
typedef struct tok_span {
    size_t start, len;
} tok_span;

/* Splits text into pieces with t's regex list. *pieces is malloc'd. */
int tok_pretokenize(const tokenizer *t, const char *text, size_t len, tok_span **pieces,
                    size_t *n_pieces, ember_error *err);
bool tok_pre_known(const char *pre_name);

#endif
