/* tok_decode.c - token ids back to text.
 *
 * Design: a token's piece is computed from its stored text and type alone.
 * Byte-level BPE texts are sequences of byte-mapped code points, each of
 * which stands for exactly one raw byte, so a piece is never longer than the
 * stored text; SentencePiece texts shrink too (U+2581 -> ' ', "<0xAB>" -> one
 * byte). That bound lets every renderer write into a buffer sized by
 * text_len without a measuring pass.
 *
 * A piece may end in the middle of a UTF-8 character (byte tokens, or BPE
 * tokens that cut a multi-byte character). tok_stream therefore keeps up to
 * three trailing bytes of an unfinished character back until the next token
 * completes it, and replaces bytes that can never form a valid character
 * with U+FFFD, so everything it returns is valid UTF-8. */
#include "tokenizer/tok_internal.h"

#include <stdlib.h>
#include <string.h>

static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

/* Writes the piece of id into dst, which has room for text_len bytes (at
 * least 1); returns its length. */
static size_t render_piece(const tokenizer *t, int32_t id, bool render_special, char *dst) {
    const tok_entry *e = &t->tokens[id];
    const char *text = tok_text(t, id);
    switch (e->type) {
    case TOK_TYPE_CONTROL:
    case TOK_TYPE_UNKNOWN:
    case TOK_TYPE_UNUSED:
        if (!render_special) return 0;
        memcpy(dst, text, e->text_len);
        return e->text_len;
    case TOK_TYPE_USER_DEFINED:
        memcpy(dst, text, e->text_len);
        return e->text_len;
    case TOK_TYPE_BYTE:
        if (e->text_len == 6 && text[0] == '<' && text[1] == '0' && text[2] == 'x' &&
            text[5] == '>' && hex_digit(text[3]) >= 0 && hex_digit(text[4]) >= 0) {
            dst[0] = (char)(hex_digit(text[3]) * 16 + hex_digit(text[4]));
            return 1;
        }
        break;
    default:
        break;
    }
    size_t n = 0;
    if (t->model == TOK_MODEL_SPM) {
        for (size_t i = 0; i < e->text_len;) {
            if (i + 3 <= e->text_len && memcmp(text + i, "\xE2\x96\x81", 3) == 0) {
                dst[n++] = ' ';
                i += 3;
            } else {
                dst[n++] = text[i++];
            }
        }
        return n;
    }
    for (size_t i = 0; i < e->text_len;) {
        int32_t cp;
        int len = tok_utf8_get((const unsigned char *)text + i, e->text_len - i, &cp);
        int byte = cp >= 0 ? tok_codepoint_to_byte((uint32_t)cp) : -1;
        if (byte >= 0) {
            dst[n++] = (char)byte;
        } else {
            /* Not a byte-mapped character (e.g. raw text in a NORMAL added
             * token): pass it through unchanged. */
            memcpy(dst + n, text + i, (size_t)len);
            n += (size_t)len;
        }
        i += (size_t)len;
    }
    return n;
}

int tokenizer_token_to_piece(const tokenizer *t, int32_t id, bool render_special, char *buf,
                             size_t cap) {
    if (id < 0 || id >= t->n_tokens) return 0;
    size_t room = t->tokens[id].text_len ? t->tokens[id].text_len : 1;
    if (cap >= room) return (int)render_piece(t, id, render_special, buf);
    char small[256];
    char *tmp = room <= sizeof small ? small : malloc(room);
    if (tmp == NULL) return -(int)room;
    size_t n = render_piece(t, id, render_special, tmp);
    if (n > 0 && n <= cap) memcpy(buf, tmp, n); /* buf may be NULL with cap 0 (a size query) */
    if (tmp != small) free(tmp);
    return n <= cap ? (int)n : -(int)n;
}

/* Drops the space that SPM encoding prepends to the first text fragment. */
static bool strips_leading_space(const tokenizer *t) {
    return t->model == TOK_MODEL_SPM && t->add_space_prefix;
}

int tokenizer_decode(const tokenizer *t, const int32_t *ids, size_t n_ids, bool render_special,
                     char **text, size_t *len, ember_error *err) {
    size_t cap = 1;
    for (size_t i = 0; i < n_ids; i++)
        if (ids[i] >= 0 && ids[i] < t->n_tokens) cap += t->tokens[ids[i]].text_len + 1;
    char *out = malloc(cap);
    if (out == NULL) return ember_fail(err, "tokenizer_decode: out of memory");
    size_t n = 0;
    bool at_start = strips_leading_space(t);
    for (size_t i = 0; i < n_ids; i++) {
        if (ids[i] < 0 || ids[i] >= t->n_tokens) continue;
        size_t piece = render_piece(t, ids[i], render_special, out + n);
        if (piece == 0) continue;
        if (at_start && out[n] == ' ') {
            memmove(out + n, out + n + 1, piece - 1);
            piece--;
        }
        at_start = false;
        n += piece;
    }
    out[n] = '\0';
    *text = out;
    if (len) *len = n;
    return 0;
}

/* ---- Streaming ---- */

struct tok_stream {
    const tokenizer *t;
    bool render_special;
    bool at_start;
    unsigned char pending[4];
    size_t n_pending;
    char *buf; /* pending bytes + the new piece, then the output */
    size_t buf_cap;
    char *out;
    size_t out_cap;
};

tok_stream *tok_stream_create(const tokenizer *t, bool render_special) {
    tok_stream *s = calloc(1, sizeof *s);
    if (s == NULL) return NULL;
    s->t = t;
    s->render_special = render_special;
    s->at_start = strips_leading_space(t);
    return s;
}

void tok_stream_free(tok_stream *s) {
    if (s == NULL) return;
    free(s->buf);
    free(s->out);
    free(s);
}

static bool grow(char **p, size_t *cap, size_t need) {
    if (need <= *cap) return true;
    size_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    char *grown = realloc(*p, c);
    if (grown == NULL) return false;
    *p = grown;
    *cap = c;
    return true;
}

/* Expected length of the sequence a lead byte starts, 0 if it cannot lead. */
static size_t utf8_expected(unsigned char c) {
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) return 2;
    if (c >= 0xE0 && c <= 0xEF) return 3;
    if (c >= 0xF0 && c <= 0xF4) return 4;
    return 0;
}

/* Whether bytes[0..n) (n shorter than the full sequence) can still become a
 * valid character. */
static bool utf8_viable_prefix(const unsigned char *b, size_t n) {
    for (size_t i = 1; i < n; i++) {
        unsigned char lo = 0x80, hi = 0xBF;
        if (i == 1) {
            if (b[0] == 0xE0) lo = 0xA0;
            if (b[0] == 0xED) hi = 0x9F;
            if (b[0] == 0xF0) lo = 0x90;
            if (b[0] == 0xF4) hi = 0x8F;
        }
        if (b[i] < lo || b[i] > hi) return false;
    }
    return true;
}

/* Moves the valid part of s->buf[0..n) to s->out, keeping an unfinished
 * tail in s->pending (unless final, where it becomes U+FFFD). */
static const char *emit(tok_stream *s, size_t n, bool final, size_t *len) {
    const unsigned char *b = (const unsigned char *)s->buf;
    /* Worst case every byte becomes a 3-byte U+FFFD. */
    if (!grow(&s->out, &s->out_cap, 3 * n + 1)) {
        *len = 0;
        return NULL;
    }
    size_t o = 0, i = 0;
    s->n_pending = 0;
    while (i < n) {
        size_t need = utf8_expected(b[i]);
        if (need == 0) {
            memcpy(s->out + o, "\xEF\xBF\xBD", 3), o += 3, i++;
            continue;
        }
        if (i + need > n) {
            if (utf8_viable_prefix(b + i, n - i)) {
                if (final) {
                    memcpy(s->out + o, "\xEF\xBF\xBD", 3), o += 3;
                } else {
                    memcpy(s->pending, b + i, n - i);
                    s->n_pending = n - i;
                }
                break;
            }
            memcpy(s->out + o, "\xEF\xBF\xBD", 3), o += 3, i++;
            continue;
        }
        int32_t cp;
        int got = tok_utf8_get(b + i, need, &cp);
        if (cp < 0) {
            memcpy(s->out + o, "\xEF\xBF\xBD", 3), o += 3, i++;
            continue;
        }
        memcpy(s->out + o, b + i, (size_t)got);
        o += (size_t)got;
        i += (size_t)got;
    }
    s->out[o] = '\0';
    *len = o;
    return s->out;
}

const char *tok_stream_push(tok_stream *s, int32_t id, size_t *len) {
    const tokenizer *t = s->t;
    size_t room = (id >= 0 && id < t->n_tokens) ? t->tokens[id].text_len + 1 : 1;
    if (!grow(&s->buf, &s->buf_cap, s->n_pending + room)) {
        *len = 0;
        return NULL;
    }
    memcpy(s->buf, s->pending, s->n_pending);
    size_t n = s->n_pending;
    if (id >= 0 && id < t->n_tokens) {
        size_t piece = render_piece(t, id, s->render_special, s->buf + n);
        if (piece > 0 && s->at_start) {
            if (s->buf[n] == ' ') memmove(s->buf + n, s->buf + n + 1, --piece);
            s->at_start = false;
        }
        n += piece;
    }
    return emit(s, n, false, len);
}

const char *tok_stream_flush(tok_stream *s, size_t *len) {
    if (!grow(&s->buf, &s->buf_cap, s->n_pending + 1)) {
        *len = 0;
        return NULL;
    }
    memcpy(s->buf, s->pending, s->n_pending);
    const char *r = emit(s, s->n_pending, true, len);
    s->n_pending = 0;
    s->at_start = strips_leading_space(s->t);
    return r;
}
