/* tok_encode.c - text to token ids.
 *
 * Design: encoding runs in two stages, as in llama.cpp.
 *   1. Special-token partitioning: the text becomes a list of fragments, each
 *      either raw text or one special id. Special tokens are tried longest
 *      text first, and each splits every still-raw fragment at all of its
 *      occurrences, so a longer token always wins over a shorter one it
 *      contains. CONTROL/UNKNOWN tokens take part only with parse_special;
 *      USER_DEFINED ones always do (Hugging Face added-token behaviour).
 *   2. Each raw fragment is encoded on its own by the model algorithm:
 *      - byte-level BPE: regex pre-tokenization, then per piece one symbol
 *        per byte (its byte-mapped token), merged greedily by lowest merge
 *        rank, leftmost on ties;
 *      - SentencePiece BPE: spaces become U+2581 (plus one leading space for
 *        the first fragment and after a special when add_space_prefix), one
 *        symbol per UTF-8 character, merged greedily by highest token score,
 *        leftmost on ties; leftover characters use <0xXX> byte tokens.
 * Both merge loops share one binary heap of candidate pairs with lazy
 * invalidation: merges only ever grow a left symbol and empty its right one,
 * so a stale candidate is recognised by its sides no longer matching what
 * was recorded when it was pushed. Merge ranks come from the (left id,
 * right id) hash, so a step costs one probe instead of string building. */
#define _GNU_SOURCE /* memmem */
#include "tokenizer/tok_internal.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

/* ---- Growable id vector ---- */

typedef struct id_vec {
    int32_t *v;
    size_t n, cap;
    bool failed;
} id_vec;

static void vec_push(id_vec *o, int32_t id) {
    if (o->n == o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 64;
        int32_t *grown = realloc(o->v, cap * sizeof *grown);
        if (grown == NULL) {
            o->failed = true;
            return;
        }
        o->v = grown;
        o->cap = cap;
    }
    o->v[o->n++] = id;
}

/* ---- Candidate heap (smallest key first, then leftmost) ---- */

typedef struct pair_cand {
    double key;      /* BPE: merge rank; SPM: minus the token score */
    int32_t left, right;
    int32_t check_a; /* BPE: left id;  SPM: combined byte length */
    int32_t check_b; /* BPE: right id; SPM: unused */
    int32_t result;  /* BPE: merged id; SPM: merged id */
} pair_cand;

typedef struct cand_heap {
    pair_cand *v;
    size_t n, cap;
    bool failed;
} cand_heap;

static bool cand_before(const pair_cand *a, const pair_cand *b) {
    return a->key < b->key || (a->key == b->key && a->left < b->left);
}

static void heap_push(cand_heap *h, pair_cand c) {
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 64;
        pair_cand *grown = realloc(h->v, cap * sizeof *grown);
        if (grown == NULL) {
            h->failed = true;
            return;
        }
        h->v = grown;
        h->cap = cap;
    }
    size_t i = h->n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!cand_before(&c, &h->v[parent])) break;
        h->v[i] = h->v[parent];
        i = parent;
    }
    h->v[i] = c;
}

static pair_cand heap_pop(cand_heap *h) {
    pair_cand top = h->v[0];
    pair_cand last = h->v[--h->n];
    size_t i = 0;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= h->n) break;
        if (child + 1 < h->n && cand_before(&h->v[child + 1], &h->v[child])) child++;
        if (!cand_before(&h->v[child], &last)) break;
        h->v[i] = h->v[child];
        i = child;
    }
    if (h->n > 0) h->v[i] = last;
    return top;
}

/* ---- Symbols of one word ---- */

typedef struct symbol {
    int32_t prev, next;
    size_t start, len; /* bytes of the word; len 0 = merged away */
    int32_t id;        /* BPE: current token id or -1 */
} symbol;

typedef struct work {
    symbol *sym;
    size_t sym_cap;
    cand_heap heap;
    char *scratch;
    size_t scratch_cap;
    bool failed;
} work;

static bool reserve_symbols(work *w, size_t n) {
    if (n <= w->sym_cap) return true;
    symbol *grown = realloc(w->sym, n * sizeof *grown);
    if (grown == NULL) return false;
    w->sym = grown;
    w->sym_cap = n;
    return true;
}

static char *reserve_scratch(work *w, size_t n) {
    if (n > w->scratch_cap) {
        char *grown = realloc(w->scratch, n);
        if (grown == NULL) return NULL;
        w->scratch = grown;
        w->scratch_cap = n;
    }
    return w->scratch;
}

/* ---- Byte-level BPE ---- */

static void bpe_try_pair(const tokenizer *t, work *w, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    int32_t a = w->sym[left].id, b = w->sym[right].id;
    if (a < 0 || b < 0) return;
    const tok_merge_slot *m = tok_find_merge(t, a, b);
    if (m == NULL) return;
    pair_cand c = {(double)m->rank, left, right, a, b, m->result};
    heap_push(&w->heap, c);
}

static void bpe_emit_bytes(const tokenizer *t, const unsigned char *bytes, size_t n, id_vec *out) {
    for (size_t i = 0; i < n; i++)
        if (t->byte_token[bytes[i]] >= 0) vec_push(out, t->byte_token[bytes[i]]);
}

static void bpe_word(const tokenizer *t, work *w, const unsigned char *word, size_t n, id_vec *out) {
    if (t->ignore_merges) {
        /* Whole-word shortcut: the byte-mapped word itself is a token. */
        char *mapped = reserve_scratch(w, 2 * n);
        if (mapped == NULL) {
            w->failed = true;
            return;
        }
        size_t m = 0;
        for (size_t i = 0; i < n; i++) m += (size_t)tok_utf8_put(tok_byte_to_codepoint(word[i]), mapped + m);
        int32_t id = tok_lookup(t, mapped, m);
        if (id >= 0) {
            vec_push(out, id);
            return;
        }
    }
    if (!reserve_symbols(w, n)) {
        w->failed = true;
        return;
    }
    for (size_t i = 0; i < n; i++) {
        w->sym[i] = (symbol){(int32_t)i - 1, i + 1 < n ? (int32_t)i + 1 : -1, i, 1,
                             t->byte_token[word[i]]};
    }
    w->heap.n = 0;
    for (size_t i = 1; i < n; i++) bpe_try_pair(t, w, (int32_t)i - 1, (int32_t)i);
    while (w->heap.n > 0) {
        pair_cand c = heap_pop(&w->heap);
        symbol *l = &w->sym[c.left], *r = &w->sym[c.right];
        /* Stale if either side was merged since the pair was recorded. */
        if (l->len == 0 || r->len == 0 || l->next != c.right || l->id != c.check_a ||
            r->id != c.check_b)
            continue;
        l->len += r->len;
        l->id = c.result;
        r->len = 0;
        l->next = r->next;
        if (r->next >= 0) w->sym[r->next].prev = c.left;
        bpe_try_pair(t, w, l->prev, c.left);
        bpe_try_pair(t, w, c.left, l->next);
    }
    if (w->heap.failed) w->failed = true;
    for (int32_t i = 0; i >= 0; i = w->sym[i].next) {
        const symbol *s = &w->sym[i];
        if (s->id >= 0)
            vec_push(out, s->id);
        else
            bpe_emit_bytes(t, word + s->start, s->len, out);
    }
}

static int bpe_fragment(const tokenizer *t, work *w, const char *text, size_t len, id_vec *out,
                        ember_error *err) {
    tok_span *pieces = NULL;
    size_t n_pieces = 0;
    if (tok_pretokenize(t, text, len, &pieces, &n_pieces, err) != 0) return -1;
    for (size_t i = 0; i < n_pieces && !w->failed; i++)
        bpe_word(t, w, (const unsigned char *)text + pieces[i].start, pieces[i].len, out);
    free(pieces);
    return 0;
}

/* ---- SentencePiece BPE ---- */

static void spm_try_pair(const tokenizer *t, work *w, const char *text, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    const symbol *l = &w->sym[left], *r = &w->sym[right];
    int32_t id = tok_lookup(t, text + l->start, l->len + r->len);
    if (id < 0) return;
    pair_cand c = {-(double)t->tokens[id].score, left, right, (int32_t)(l->len + r->len), 0, id};
    heap_push(&w->heap, c);
}

static void spm_fragment(const tokenizer *t, work *w, const char *raw, size_t raw_len,
                         bool space_prefix, id_vec *out) {
    /* Escape: optional leading space, then every ' ' becomes U+2581. */
    size_t spaces = space_prefix ? 1 : 0;
    for (size_t i = 0; i < raw_len; i++) spaces += raw[i] == ' ';
    size_t n = raw_len + (space_prefix ? 1 : 0) + 2 * spaces;
    char *text = reserve_scratch(w, n + 1);
    if (text == NULL) {
        w->failed = true;
        return;
    }
    size_t m = 0;
    if (space_prefix) memcpy(text + m, "\xE2\x96\x81", 3), m += 3;
    for (size_t i = 0; i < raw_len; i++) {
        if (raw[i] == ' ')
            memcpy(text + m, "\xE2\x96\x81", 3), m += 3;
        else
            text[m++] = raw[i];
    }
    if (m == 0) return;

    if (!reserve_symbols(w, m)) {
        w->failed = true;
        return;
    }
    size_t n_sym = 0;
    for (size_t off = 0; off < m;) {
        int32_t cp;
        size_t len = (size_t)tok_utf8_get((const unsigned char *)text + off, m - off, &cp);
        if (cp < 0) {
            /* Like llama.cpp, take the length the lead byte announces. */
            unsigned char c = (unsigned char)text[off];
            len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
            if (len > m - off) len = m - off;
        }
        w->sym[n_sym] = (symbol){(int32_t)n_sym - 1, -1, off, len, -1};
        if (n_sym > 0) w->sym[n_sym - 1].next = (int32_t)n_sym;
        n_sym++;
        off += len;
    }
    w->heap.n = 0;
    for (size_t i = 1; i < n_sym; i++) spm_try_pair(t, w, text, (int32_t)i - 1, (int32_t)i);
    while (w->heap.n > 0) {
        pair_cand c = heap_pop(&w->heap);
        symbol *l = &w->sym[c.left], *r = &w->sym[c.right];
        if (l->len == 0 || r->len == 0 || (int32_t)(l->len + r->len) != c.check_a) continue;
        l->len += r->len;
        r->len = 0;
        l->next = r->next;
        if (r->next >= 0) w->sym[r->next].prev = c.left;
        spm_try_pair(t, w, text, l->prev, c.left);
        spm_try_pair(t, w, text, c.left, l->next);
    }
    if (w->heap.failed) w->failed = true;
    for (int32_t i = 0; i >= 0; i = w->sym[i].next) {
        const symbol *s = &w->sym[i];
        int32_t id = tok_lookup(t, text + s->start, s->len);
        if (id >= 0) {
            vec_push(out, id);
            continue;
        }
        /* Every merge produced a token, so only single characters get here. */
        for (size_t b = 0; b < s->len; b++) {
            int32_t byte_id = t->byte_token[(unsigned char)text[s->start + b]];
            if (byte_id < 0) byte_id = t->unk;
            if (byte_id >= 0) vec_push(out, byte_id);
        }
    }
}

/* ---- Special-token partitioning ---- */

typedef struct fragment {
    size_t start, len;
    int32_t id; /* -1: raw text */
} fragment;

typedef struct frag_list {
    fragment *v;
    size_t n, cap;
} frag_list;

static int frag_push(frag_list *l, size_t start, size_t len, int32_t id) {
    if (id < 0 && len == 0) return 0;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 16;
        fragment *grown = realloc(l->v, cap * sizeof *grown);
        if (grown == NULL) return -1;
        l->v = grown;
        l->cap = cap;
    }
    l->v[l->n++] = (fragment){start, len, id};
    return 0;
}

static bool token_in_raw(const char *text, const frag_list *l, const char *tok, size_t tok_len) {
    for (size_t i = 0; i < l->n; i++)
        if (l->v[i].id < 0 && l->v[i].len >= tok_len &&
            memmem(text + l->v[i].start, l->v[i].len, tok, tok_len) != NULL)
            return true;
    return false;
}

static int partition(const tokenizer *t, const char *text, size_t len, bool parse_special,
                     frag_list *frags) {
    frag_list next = {0};
    if (frag_push(frags, 0, len, -1) != 0) return -1;
    for (int32_t k = 0; k < t->n_special; k++) {
        int32_t id = t->special_ids[k];
        const tok_entry *e = &t->tokens[id];
        if (!parse_special && (e->type == TOK_TYPE_CONTROL || e->type == TOK_TYPE_UNKNOWN)) continue;
        const char *tok = tok_text(t, id);
        if (!token_in_raw(text, frags, tok, e->text_len)) continue;
        next.n = 0;
        for (size_t i = 0; i < frags->n; i++) {
            fragment f = frags->v[i];
            if (f.id >= 0) {
                if (frag_push(&next, f.start, f.len, f.id) != 0) goto oom;
                continue;
            }
            size_t pos = f.start, end = f.start + f.len;
            while (pos < end) {
                const char *hit = memmem(text + pos, end - pos, tok, e->text_len);
                if (hit == NULL) break;
                size_t at = (size_t)(hit - text);
                size_t left_end = at;
                if (e->attr & TOK_ATTR_LSTRIP)
                    while (left_end > pos && isspace((unsigned char)text[left_end - 1])) left_end--;
                if (frag_push(&next, pos, left_end - pos, -1) != 0 ||
                    frag_push(&next, at, e->text_len, id) != 0)
                    goto oom;
                pos = at + e->text_len;
                if (e->attr & TOK_ATTR_RSTRIP)
                    while (pos < end && isspace((unsigned char)text[pos])) pos++;
            }
            if (frag_push(&next, pos, end - pos, -1) != 0) goto oom;
        }
        frag_list swap = *frags;
        *frags = next;
        next = swap;
    }
    free(next.v);
    return 0;
oom:
    free(next.v);
    return -1;
}

/* ---- Defusing control-token text ---- */

/* Whether some CONTROL/UNKNOWN token text could match at, inside or across
 * the edges of s: a marker byte is then put between each pair of bytes of
 * every occurrence, before s when it starts with a proper suffix of a
 * token's text, and after it when it ends with a proper prefix (so two
 * strings that meet in a render cannot complete a token either). */
/* A token whose text a user must not produce: one that parse_special
 * governs, at least two bytes long (one byte cannot be split). */
static bool defusable(const tokenizer *t, int32_t id) {
    const tok_entry *e = &t->tokens[id];
    return (e->type == TOK_TYPE_CONTROL || e->type == TOK_TYPE_UNKNOWN) && e->text_len >= 2;
}

char *tokenizer_defuse_specials(const tokenizer *t, const char *s, size_t len, size_t *out_len) {
    bool *brk = calloc(len + 1, sizeof *brk);
    if (brk == NULL) return NULL;
    size_t n_marks = 0;
    /* One pass over s: only bytes that start some token text are tried. */
    bool starts[256] = {false};
    for (int32_t k = 0; k < t->n_special; k++) {
        int32_t id = t->special_ids[k];
        if (!defusable(t, id)) continue;
        const char *tok = tok_text(t, id);
        size_t m = t->tokens[id].text_len;
        starts[(unsigned char)tok[0]] = true;
        for (size_t q = 1; q < m && q <= len; q++) {
            if (memcmp(s, tok + m - q, q) == 0) brk[0] = true;
            if (memcmp(s + len - q, tok, q) == 0) brk[len] = true;
        }
    }
    for (size_t at = 0; at + 1 < len; at++) {
        if (!starts[(unsigned char)s[at]]) continue;
        for (int32_t k = 0; k < t->n_special; k++) {
            int32_t id = t->special_ids[k];
            size_t m = t->tokens[id].text_len;
            if (m > len - at || !defusable(t, id)) continue;
            const char *tok = tok_text(t, id);
            if (tok[0] != s[at] || memcmp(s + at, tok, m) != 0) continue;
            for (size_t i = at + 1; i < at + m; i++) brk[i] = true;
        }
    }
    for (size_t i = 0; i <= len; i++) n_marks += brk[i];
    char *out = malloc(len + n_marks + 1);
    if (out != NULL) {
        size_t o = 0;
        for (size_t i = 0; i < len; i++) {
            if (brk[i]) out[o++] = (char)TOKENIZER_DEFUSE_MARK;
            out[o++] = s[i];
        }
        if (brk[len]) out[o++] = (char)TOKENIZER_DEFUSE_MARK;
        out[o] = 0;
        *out_len = o;
    }
    free(brk);
    return out;
}

/* ---- Entry points ---- */

static int encode(const tokenizer *t, const char *text, size_t len, bool add_special, bool parse_special,
                  bool strip_marks, int32_t **ids, size_t *n_ids, ember_error *err) {
    id_vec out = {0};
    char *clean = NULL;
    frag_list frags = {0};
    work w = {0};
    int rc = -1;
    *ids = NULL;
    *n_ids = 0;
    if (text == NULL && len > 0) return ember_fail(err, "tokenizer_encode: NULL text");

    if (add_special && t->add_bos && t->bos >= 0) vec_push(&out, t->bos);
    if (len > 0 && partition(t, text, len, parse_special, &frags) != 0) {
        ember_fail(err, "tokenizer_encode: out of memory");
        goto done;
    }
    bool prev_special = true; /* SPM: the first fragment gets the space prefix */
    for (size_t i = 0; i < frags.n && !w.failed && !out.failed; i++) {
        fragment f = frags.v[i];
        if (f.id >= 0) {
            vec_push(&out, f.id);
            prev_special = true;
            continue;
        }
        const char *piece = text + f.start;
        size_t piece_len = f.len;
        if (strip_marks && memchr(piece, TOKENIZER_DEFUSE_MARK, piece_len) != NULL) {
            char *c = realloc(clean, piece_len);
            if (c == NULL) {
                ember_fail(err, "tokenizer_encode: out of memory");
                goto done;
            }
            clean = c;
            size_t k = 0;
            for (size_t j = 0; j < piece_len; j++)
                if ((unsigned char)piece[j] != TOKENIZER_DEFUSE_MARK) clean[k++] = piece[j];
            if (k == 0) continue;
            piece = clean;
            piece_len = k;
        }
        if (t->model == TOK_MODEL_BPE) {
            if (bpe_fragment(t, &w, piece, piece_len, &out, err) != 0) goto done;
        } else {
            spm_fragment(t, &w, piece, piece_len, t->add_space_prefix && prev_special, &out);
        }
        prev_special = false;
    }
    if (add_special && t->add_eos && t->eos >= 0) vec_push(&out, t->eos);
    if (w.failed || out.failed) {
        ember_fail(err, "tokenizer_encode: out of memory");
        goto done;
    }
    if (out.v == NULL) {
        out.v = malloc(sizeof *out.v); /* callers may free unconditionally */
        if (out.v == NULL) {
            ember_fail(err, "tokenizer_encode: out of memory");
            goto done;
        }
    }
    *ids = out.v;
    *n_ids = out.n;
    out.v = NULL;
    rc = 0;
done:
    free(clean);
    free(out.v);
    free(frags.v);
    free(w.sym);
    free(w.heap.v);
    free(w.scratch);
    return rc;
}

int tokenizer_encode(const tokenizer *t, const char *text, size_t len, bool add_special, bool parse_special,
                     int32_t **ids, size_t *n_ids, ember_error *err) {
    return encode(t, text, len, add_special, parse_special, false, ids, n_ids, err);
}

int tokenizer_encode_rendered(const tokenizer *t, const char *text, size_t len, bool add_special, int32_t **ids,
                              size_t *n_ids, ember_error *err) {
    return encode(t, text, len, add_special, true, true, ids, n_ids, err);
}
