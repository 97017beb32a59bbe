/* jinja_parse.c - lexer and parser of the Jinja subset (see jinja.h).
 *
 * Design: the source is first normalised the way Jinja2 does it (line
 * endings to \n, one trailing newline dropped), then split into a token
 * stream: TEXT runs, tag openers ({{ and {%, with their -/+ whitespace
 * signs), the expression tokens inside a tag (names, strings, numbers,
 * operators; string literals may contain "}}" or "%}"), and tag closers.
 * Comments vanish but keep their whitespace effects. A second pass applies
 * whitespace control to the TEXT runs exactly as Jinja2's lexer does with
 * trim_blocks and lstrip_blocks on (Hugging Face's settings): "-" strips
 * all whitespace on that side; otherwise a block or comment tag drops the
 * newline right after it and the spaces/tabs before it when only those
 * separate it from the start of its line. The parser is recursive descent
 * with Jinja2's precedence: conditional < or < and < not < comparison
 * (incl. in / not in) < + - < ~ < * / // % < ** < unary < postfix
 * (attribute, subscript, slice, call) followed by filters and tests. Every
 * node records its line and column for error messages. */
#include "chat/jinja.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum {
    T_TEXT, T_VAR_BEGIN, T_VAR_END, T_BLOCK_BEGIN, T_BLOCK_END,
    T_NAME, T_STRING, T_INT, T_FLOAT, T_OP, T_EOF
} ttype;

typedef struct {
    ttype t;
    size_t pos;       /* byte offset in the normalised source */
    size_t start, end; /* T_TEXT: range; T_NAME/T_OP: lexeme range */
    char sign;        /* tag openers/closers: '-', '+' or 0 */
    bool comment;     /* opener/closer of a comment (only used for whitespace) */
    char *str;        /* T_STRING: decoded value */
    size_t slen;
    int64_t ival;
    double fval;
} tok;

typedef struct {
    const char *src;
    size_t len;
    tok *toks;
    size_t ntoks, cap;
    size_t at;
    ember_error *err;
    bool failed;
    int depth; /* expression nesting, bounded so a hostile template cannot exhaust the stack */
} parser;

static void *xcalloc(size_t n, size_t sz) {
    void *p = calloc(n ? n : 1, sz);
    if (p == NULL) abort();
    return p;
}

static void line_col(const char *src, size_t pos, int *line, int *col) {
    int l = 1, c = 1;
    for (size_t i = 0; i < pos && src[i]; i++) {
        if (src[i] == '\n') { l++; c = 1; }
        else c++;
    }
    *line = l;
    *col = c;
}

static void perr(parser *p, size_t pos, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void perr(parser *p, size_t pos, const char *fmt, ...) {
    if (p->failed) return;
    p->failed = true;
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    int line, col;
    line_col(p->src, pos, &line, &col);
    ember_fail(p->err, "template syntax error at line %d, column %d: %s", line, col, msg);
}

static tok *push_tok(parser *p, ttype t, size_t pos) {
    if (p->ntoks == p->cap) {
        p->cap = p->cap ? p->cap * 2 : 256;
        p->toks = realloc(p->toks, p->cap * sizeof(tok));
        if (p->toks == NULL) abort();
    }
    tok *k = &p->toks[p->ntoks++];
    memset(k, 0, sizeof *k);
    k->t = t;
    k->pos = pos;
    return k;
}

/* ---- lexing ---- */

static void put_utf8(char *out, size_t *n, uint32_t cp) {
    if (cp < 0x80) out[(*n)++] = (char)cp;
    else if (cp < 0x800) {
        out[(*n)++] = (char)(0xc0 | (cp >> 6));
        out[(*n)++] = (char)(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
        out[(*n)++] = (char)(0xe0 | (cp >> 12));
        out[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[(*n)++] = (char)(0x80 | (cp & 0x3f));
    } else {
        out[(*n)++] = (char)(0xf0 | (cp >> 18));
        out[(*n)++] = (char)(0x80 | ((cp >> 12) & 0x3f));
        out[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[(*n)++] = (char)(0x80 | (cp & 0x3f));
    }
}

/* Lexes a string literal starting at src[i] (a quote); Python escapes. */
static size_t lex_string(parser *p, size_t i) {
    char q = p->src[i];
    size_t start = i++;
    char *out = xcalloc(p->len - start + 1, 1);
    size_t n = 0;
    while (i < p->len && p->src[i] != q) {
        char c = p->src[i];
        if (c == '\\' && i + 1 < p->len) {
            char e = p->src[i + 1];
            i += 2;
            switch (e) {
            case 'n': out[n++] = '\n'; break;
            case 't': out[n++] = '\t'; break;
            case 'r': out[n++] = '\r'; break;
            case '0': out[n++] = '\0'; break;
            case 'b': out[n++] = '\b'; break;
            case 'f': out[n++] = '\f'; break;
            case 'v': out[n++] = '\v'; break;
            case 'a': out[n++] = '\a'; break;
            case '\\': out[n++] = '\\'; break;
            case '\'': out[n++] = '\''; break;
            case '"': out[n++] = '"'; break;
            case '\n': break; /* line continuation */
            case 'x':
            case 'u':
            case 'U': {
                int digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
                uint32_t cp = 0;
                int d;
                for (d = 0; d < digits && i < p->len && isxdigit((unsigned char)p->src[i]); d++, i++) {
                    char h = p->src[i];
                    cp = cp * 16 + (uint32_t)(isdigit((unsigned char)h) ? h - '0' : (tolower((unsigned char)h) - 'a' + 10));
                }
                if (d != digits) {
                    free(out);
                    perr(p, i, "truncated \\%c escape in string literal", e);
                    return p->len;
                }
                put_utf8(out, &n, cp);
                break;
            }
            default: /* Python keeps unknown escapes verbatim */
                out[n++] = '\\';
                out[n++] = e;
                break;
            }
            continue;
        }
        out[n++] = c;
        i++;
    }
    if (i >= p->len) {
        free(out);
        perr(p, start, "unterminated string literal");
        return p->len;
    }
    tok *k = push_tok(p, T_STRING, start);
    k->str = out;
    k->slen = n;
    return i + 1;
}

static const char *const OPS[] = {
    "**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">", "=",
    "(", ")", "[", "]", "{", "}", ",", ".", ":", "|", NULL
};

/* Lexes the inside of a tag until its closer; returns the offset after it. */
#define MAX_TAG_TOKENS 4000

static size_t lex_tag(parser *p, size_t i, bool block, size_t open_pos) {
    char close0 = block ? '%' : '}';
    size_t first = p->ntoks;
    int depth = 0; /* bracket depth: a "}}" inside {...} literals still closes at depth 0 only */
    while (i < p->len) {
        char c = p->src[i];
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r') { i++; continue; }
        if (p->ntoks - first > MAX_TAG_TOKENS) {
            perr(p, open_pos, "tag too long (more than %d tokens)", MAX_TAG_TOKENS);
            return p->len;
        }
        /* closer: [-+]?%} or [-+]?}} */
        if ((c == '-' || c == '+') && i + 2 < p->len + 1 && p->src[i + 1] == close0 &&
            i + 2 < p->len && p->src[i + 2] == '}' && (block || depth == 0)) {
            tok *k = push_tok(p, block ? T_BLOCK_END : T_VAR_END, i);
            k->sign = c;
            return i + 3;
        }
        if (c == close0 && i + 1 < p->len && p->src[i + 1] == '}' && (block || depth == 0)) {
            push_tok(p, block ? T_BLOCK_END : T_VAR_END, i);
            return i + 2;
        }
        if (c == '\'' || c == '"') {
            i = lex_string(p, i);
            if (p->failed) return p->len;
            continue;
        }
        if (isdigit((unsigned char)c)) {
            size_t s = i;
            bool is_float = false;
            while (i < p->len && (isdigit((unsigned char)p->src[i]) || p->src[i] == '_')) i++;
            if (i + 1 < p->len && p->src[i] == '.' && isdigit((unsigned char)p->src[i + 1])) {
                is_float = true;
                i++;
                while (i < p->len && isdigit((unsigned char)p->src[i])) i++;
            }
            if (i < p->len && (p->src[i] == 'e' || p->src[i] == 'E')) {
                size_t j = i + 1;
                if (j < p->len && (p->src[j] == '+' || p->src[j] == '-')) j++;
                if (j < p->len && isdigit((unsigned char)p->src[j])) {
                    is_float = true;
                    i = j;
                    while (i < p->len && isdigit((unsigned char)p->src[i])) i++;
                }
            }
            char num[64];
            size_t n = 0;
            for (size_t j = s; j < i && n < sizeof num - 1; j++)
                if (p->src[j] != '_') num[n++] = p->src[j];
            num[n] = '\0';
            tok *k = push_tok(p, is_float ? T_FLOAT : T_INT, s);
            if (is_float) k->fval = strtod(num, NULL);
            else k->ival = strtoll(num, NULL, 10);
            continue;
        }
        if (isalpha((unsigned char)c) || c == '_') {
            size_t s = i;
            while (i < p->len && (isalnum((unsigned char)p->src[i]) || p->src[i] == '_')) i++;
            tok *k = push_tok(p, T_NAME, s);
            k->start = s;
            k->end = i;
            continue;
        }
        bool matched = false;
        for (int o = 0; OPS[o]; o++) {
            size_t n = strlen(OPS[o]);
            if (i + n <= p->len && memcmp(p->src + i, OPS[o], n) == 0) {
                tok *k = push_tok(p, T_OP, i);
                k->start = i;
                k->end = i + n;
                if (OPS[o][0] == '(' || OPS[o][0] == '[' || OPS[o][0] == '{') depth++;
                if (OPS[o][0] == ')' || OPS[o][0] == ']' || OPS[o][0] == '}') depth--;
                i += n;
                matched = true;
                break;
            }
        }
        if (!matched) {
            perr(p, i, "unexpected character '%c'", c);
            return p->len;
        }
    }
    perr(p, open_pos, "unterminated tag '%s'", block ? "{%" : "{{");
    return p->len;
}

static bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

static void lex(parser *p) {
    size_t i = 0, text_start = 0;
    while (i <= p->len) {
        const char *q = NULL;
        size_t k = i;
        while (k + 1 < p->len) {
            if (p->src[k] == '{' && (p->src[k + 1] == '{' || p->src[k + 1] == '%' || p->src[k + 1] == '#')) {
                q = p->src + k;
                break;
            }
            k++;
        }
        if (q == NULL) {
            tok *t = push_tok(p, T_TEXT, text_start);
            t->start = text_start;
            t->end = p->len;
            break;
        }
        tok *t = push_tok(p, T_TEXT, text_start);
        t->start = text_start;
        t->end = k;
        char kind = p->src[k + 1];
        char sign = (k + 2 < p->len && (p->src[k + 2] == '-' || p->src[k + 2] == '+')) ? p->src[k + 2] : 0;
        size_t body = k + 2 + (sign ? 1 : 0);
        if (kind == '#') {
            const char *e = strstr(p->src + body, "#}");
            if (e == NULL) {
                perr(p, k, "unterminated comment");
                return;
            }
            size_t epos = (size_t)(e - p->src);
            tok *o = push_tok(p, T_BLOCK_BEGIN, k);
            o->sign = sign;
            o->comment = true;
            tok *c = push_tok(p, T_BLOCK_END, epos);
            c->comment = true;
            c->sign = (epos > body && (p->src[epos - 1] == '-' || p->src[epos - 1] == '+')) ? p->src[epos - 1] : 0;
            i = text_start = epos + 2;
            continue;
        }
        bool block = kind == '%';
        tok *o = push_tok(p, block ? T_BLOCK_BEGIN : T_VAR_BEGIN, k);
        o->sign = sign;
        size_t after = lex_tag(p, body, block, k);
        if (p->failed) return;
        /* {% raw %} ... {% endraw %}: the body is text */
        if (block && p->ntoks >= 3 && p->toks[p->ntoks - 2].t == T_NAME &&
            p->toks[p->ntoks - 3].t == T_BLOCK_BEGIN &&
            p->toks[p->ntoks - 2].end - p->toks[p->ntoks - 2].start == 3 &&
            memcmp(p->src + p->toks[p->ntoks - 2].start, "raw", 3) == 0) {
            char endsign = p->toks[p->ntoks - 1].sign;
            p->ntoks -= 3; /* drop {% raw %} */
            size_t j = after, found = 0, close_end = 0;
            char lsign = 0;
            for (; j + 1 < p->len; j++) {
                if (p->src[j] == '{' && p->src[j + 1] == '%') {
                    size_t m = j + 2;
                    char s2 = 0;
                    if (m < p->len && (p->src[m] == '-' || p->src[m] == '+')) s2 = p->src[m++];
                    while (m < p->len && is_ws(p->src[m])) m++;
                    if (m + 6 <= p->len && memcmp(p->src + m, "endraw", 6) == 0) {
                        m += 6;
                        while (m < p->len && is_ws(p->src[m])) m++;
                        if (m < p->len && (p->src[m] == '-' || p->src[m] == '+')) m++;
                        if (m + 1 < p->len && p->src[m] == '%' && p->src[m + 1] == '}') {
                            found = j;
                            lsign = s2;
                            close_end = m + 2;
                            break;
                        }
                    }
                }
            }
            if (!close_end) {
                perr(p, k, "missing endraw");
                return;
            }
            /* emit as: previous TEXT, a comment-like tag pair around raw text */
            tok *b1 = push_tok(p, T_BLOCK_BEGIN, k);
            b1->sign = sign;
            b1->comment = true;
            tok *e1 = push_tok(p, T_BLOCK_END, k);
            e1->comment = true;
            e1->sign = endsign;
            tok *rt = push_tok(p, T_TEXT, after);
            rt->start = after;
            rt->end = found;
            tok *b2 = push_tok(p, T_BLOCK_BEGIN, found);
            b2->sign = lsign;
            b2->comment = true;
            tok *e2 = push_tok(p, T_BLOCK_END, found);
            e2->comment = true;
            e2->sign = p->src[close_end - 3] == '-' ? '-' : 0;
            i = text_start = close_end;
            continue;
        }
        i = text_start = after;
    }
    push_tok(p, T_EOF, p->len);
}

/* Whitespace control on TEXT tokens (trim_blocks + lstrip_blocks). */
static void apply_whitespace(parser *p) {
    for (size_t i = 0; i < p->ntoks; i++) {
        tok *t = &p->toks[i];
        if (t->t != T_TEXT) continue;
        size_t a = t->start, b = t->end;
        /* previous closer */
        if (i > 0) {
            tok *c = &p->toks[i - 1];
            if (c->t == T_VAR_END || c->t == T_BLOCK_END) {
                if (c->sign == '-') {
                    while (a < b && is_ws(p->src[a])) a++;
                } else if (c->t == T_BLOCK_END && c->sign != '+') {
                    if (a < b && p->src[a] == '\n') a++;
                }
            }
        }
        /* next opener */
        if (i + 1 < p->ntoks) {
            tok *o = &p->toks[i + 1];
            if (o->t == T_VAR_BEGIN || o->t == T_BLOCK_BEGIN) {
                if (o->sign == '-') {
                    while (b > a && is_ws(p->src[b - 1])) b--;
                } else if (o->t == T_BLOCK_BEGIN && o->sign != '+') {
                    size_t l = b;
                    while (l > a && p->src[l - 1] != '\n') l--;
                    bool line_starting = (l > a) || a == 0 || p->src[a - 1] == '\n';
                    if (line_starting) {
                        bool only_ws = true;
                        for (size_t j = l; j < b; j++)
                            if (p->src[j] != ' ' && p->src[j] != '\t') {
                                only_ws = false;
                                break;
                            }
                        /* Jinja2's whitespace_re is \s, which includes \n but
                         * none can occur after the last newline. */
                        if (only_ws) b = l;
                    }
                }
            }
        }
        if (b < a) b = a;
        t->start = a;
        t->end = b;
    }
}

/* ---- parsing ---- */

static tok *cur(parser *p) { return &p->toks[p->at]; }
static tok *peek(parser *p, size_t k) {
    size_t i = p->at + k;
    return i < p->ntoks ? &p->toks[i] : &p->toks[p->ntoks - 1];
}

static bool tok_is_name(parser *p, tok *t, const char *name) {
    size_t n = strlen(name);
    return t->t == T_NAME && t->end - t->start == n && memcmp(p->src + t->start, name, n) == 0;
}
static bool tok_is_op(parser *p, tok *t, const char *op) {
    size_t n = strlen(op);
    return t->t == T_OP && t->end - t->start == n && memcmp(p->src + t->start, op, n) == 0;
}
static bool accept_op(parser *p, const char *op) {
    if (tok_is_op(p, cur(p), op)) { p->at++; return true; }
    return false;
}
static bool accept_name(parser *p, const char *name) {
    if (tok_is_name(p, cur(p), name)) { p->at++; return true; }
    return false;
}
static const char *tok_desc(parser *p, tok *t, char *buf, size_t cap) {
    switch (t->t) {
    case T_NAME:
    case T_OP: snprintf(buf, cap, "'%.*s'", (int)(t->end - t->start), p->src + t->start); break;
    case T_STRING: snprintf(buf, cap, "string literal"); break;
    case T_INT:
    case T_FLOAT: snprintf(buf, cap, "number"); break;
    case T_VAR_END: snprintf(buf, cap, "end of print statement"); break;
    case T_BLOCK_END: snprintf(buf, cap, "end of statement block"); break;
    case T_EOF: snprintf(buf, cap, "end of template"); break;
    default: snprintf(buf, cap, "template data"); break;
    }
    return buf;
}
static void expect_op(parser *p, const char *op) {
    if (accept_op(p, op)) return;
    char d[64];
    perr(p, cur(p)->pos, "expected '%s', got %s", op, tok_desc(p, cur(p), d, sizeof d));
}
static char *tok_name(parser *p, tok *t) {
    size_t n = t->end - t->start;
    char *s = xcalloc(n + 1, 1);
    memcpy(s, p->src + t->start, n);
    return s;
}
static char *expect_name(parser *p) {
    tok *t = cur(p);
    if (t->t != T_NAME) {
        char d[64];
        perr(p, t->pos, "expected a name, got %s", tok_desc(p, t, d, sizeof d));
        return NULL;
    }
    p->at++;
    return tok_name(p, t);
}

static jnode *mk(parser *p, jnode_kind kind, size_t pos) {
    jnode *n = xcalloc(1, sizeof *n);
    n->kind = kind;
    line_col(p->src, pos, &n->line, &n->col);
    return n;
}

static void add_kid(jnode ***arr, size_t *n, jnode *k) {
    *arr = realloc(*arr, (*n + 1) * sizeof(jnode *));
    if (*arr == NULL) abort();
    (*arr)[(*n)++] = k;
}
static void add_name(char ***arr, size_t *n, char *s) {
    *arr = realloc(*arr, (*n + 1) * sizeof(char *));
    if (*arr == NULL) abort();
    (*arr)[(*n)++] = s;
}

static void node_free(jnode *n) {
    if (n == NULL) return;
    free(n->name);
    if (n->lit.t == JV_STR) free(n->lit.u.s); /* immortal: freed with the tree */
    else jv_release(n->lit);
    node_free(n->a);
    node_free(n->b);
    node_free(n->c);
    node_free(n->d);
    for (size_t i = 0; i < n->nkids; i++) node_free(n->kids[i]);
    for (size_t i = 0; i < n->nkids2; i++) node_free(n->kids2[i]);
    for (size_t i = 0; i < n->nnames; i++) free(n->names[i]);
    free(n->kids);
    free(n->kids2);
    free(n->names);
    free(n);
}

static jnode *parse_expr(parser *p);
static jnode *parse_or(parser *p);
static jnode *parse_unary(parser *p, bool with_filter);

/* Call arguments after '(' : positional and name=value. */
static void parse_call_args(parser *p, jnode *n) {
    while (!p->failed && !tok_is_op(p, cur(p), ")")) {
        if (n->nkids || n->nnames) {
            expect_op(p, ",");
            if (tok_is_op(p, cur(p), ")")) break;
        }
        if (cur(p)->t == T_NAME && tok_is_op(p, peek(p, 1), "=")) {
            add_name(&n->names, &n->nnames, tok_name(p, cur(p)));
            p->at += 2;
            add_kid(&n->kids2, &n->nkids2, parse_expr(p));
        } else {
            if (n->nnames) {
                perr(p, cur(p)->pos, "positional argument follows keyword argument");
                return;
            }
            add_kid(&n->kids, &n->nkids, parse_expr(p));
        }
    }
    expect_op(p, ")");
}

static jnode *parse_primary(parser *p) {
    tok *t = cur(p);
    if (p->failed) return NULL;
    if (t->t == T_NAME) {
        p->at++;
        jnode *n = mk(p, E_LIT, t->pos);
        if (tok_is_name(p, t, "true") || tok_is_name(p, t, "True")) n->lit = jv_bool(true);
        else if (tok_is_name(p, t, "false") || tok_is_name(p, t, "False")) n->lit = jv_bool(false);
        else if (tok_is_name(p, t, "none") || tok_is_name(p, t, "None")) n->lit = jv_none();
        else {
            n->kind = E_NAME;
            n->name = tok_name(p, t);
        }
        return n;
    }
    if (t->t == T_STRING) {
        /* adjacent literals concatenate */
        jbuf b = {0};
        jbuf_put(&b, "", 0);
        while (cur(p)->t == T_STRING) {
            jbuf_put(&b, cur(p)->str, cur(p)->slen);
            p->at++;
        }
        jnode *n = mk(p, E_LIT, t->pos);
        n->lit = jv_str(b.p, b.n);
        n->lit.u.s->rc = -1; /* shared by concurrent renders: never counted */
        free(b.p);
        return n;
    }
    if (t->t == T_INT || t->t == T_FLOAT) {
        p->at++;
        jnode *n = mk(p, E_LIT, t->pos);
        n->lit = t->t == T_INT ? jv_int(t->ival) : jv_float(t->fval);
        return n;
    }
    if (tok_is_op(p, t, "(")) {
        p->at++;
        if (accept_op(p, ")")) { /* empty tuple */
            jnode *n = mk(p, E_LIST, t->pos);
            n->op = 1;
            return n;
        }
        jnode *e = parse_expr(p);
        if (tok_is_op(p, cur(p), ",")) { /* tuple */
            jnode *n = mk(p, E_LIST, t->pos);
            n->op = 1;
            add_kid(&n->kids, &n->nkids, e);
            while (accept_op(p, ",")) {
                if (tok_is_op(p, cur(p), ")")) break;
                add_kid(&n->kids, &n->nkids, parse_expr(p));
                if (p->failed) break;
            }
            expect_op(p, ")");
            return n;
        }
        expect_op(p, ")");
        return e;
    }
    if (tok_is_op(p, t, "[")) {
        p->at++;
        jnode *n = mk(p, E_LIST, t->pos);
        while (!p->failed && !tok_is_op(p, cur(p), "]")) {
            if (n->nkids) {
                expect_op(p, ",");
                if (tok_is_op(p, cur(p), "]")) break;
            }
            add_kid(&n->kids, &n->nkids, parse_expr(p));
        }
        expect_op(p, "]");
        return n;
    }
    if (tok_is_op(p, t, "{")) {
        p->at++;
        jnode *n = mk(p, E_DICT, t->pos);
        while (!p->failed && !tok_is_op(p, cur(p), "}")) {
            if (n->nkids) {
                expect_op(p, ",");
                if (tok_is_op(p, cur(p), "}")) break;
            }
            add_kid(&n->kids, &n->nkids, parse_expr(p));
            expect_op(p, ":");
            add_kid(&n->kids2, &n->nkids2, parse_expr(p));
        }
        expect_op(p, "}");
        return n;
    }
    char d[64];
    perr(p, t->pos, "unexpected %s", tok_desc(p, t, d, sizeof d));
    return NULL;
}

static jnode *parse_postfix(parser *p, jnode *n) {
    while (!p->failed) {
        tok *t = cur(p);
        if (tok_is_op(p, t, ".")) {
            p->at++;
            tok *a = cur(p);
            if (a->t == T_INT) {
                p->at++;
                jnode *m = mk(p, E_ITEM, t->pos);
                m->a = n;
                m->b = mk(p, E_LIT, a->pos);
                m->b->lit = jv_int(a->ival);
                n = m;
                continue;
            }
            jnode *m = mk(p, E_ATTR, t->pos);
            m->a = n;
            m->name = expect_name(p);
            n = m;
        } else if (tok_is_op(p, t, "[")) {
            p->at++;
            jnode *start = NULL, *stop = NULL, *step = NULL;
            bool slice = false;
            if (!tok_is_op(p, cur(p), ":")) start = parse_expr(p);
            if (accept_op(p, ":")) {
                slice = true;
                if (!tok_is_op(p, cur(p), "]") && !tok_is_op(p, cur(p), ":")) stop = parse_expr(p);
                if (accept_op(p, ":") && !tok_is_op(p, cur(p), "]")) step = parse_expr(p);
            }
            expect_op(p, "]");
            jnode *m = mk(p, slice ? E_SLICE : E_ITEM, t->pos);
            m->a = n;
            if (slice) {
                m->b = start;
                m->c = stop;
                m->d = step;
            } else {
                m->b = start;
            }
            n = m;
        } else if (tok_is_op(p, t, "(")) {
            p->at++;
            jnode *m = mk(p, E_CALL, t->pos);
            if (n) { /* report calls at the callee */
                m->line = n->line;
                m->col = n->col;
            }
            m->a = n;
            parse_call_args(p, m);
            n = m;
        } else {
            break;
        }
    }
    return n;
}

static jnode *parse_filter_expr(parser *p, jnode *n) {
    while (!p->failed) {
        tok *t = cur(p);
        if (tok_is_op(p, t, "|")) {
            p->at++;
            jnode *f = mk(p, E_FILTER, cur(p)->pos);
            f->a = n;
            f->name = expect_name(p);
            /* dotted filter names are not supported; args in parens */
            if (accept_op(p, "(")) parse_call_args(p, f);
            n = f;
        } else if (tok_is_name(p, t, "is")) {
            p->at++;
            jnode *f = mk(p, E_TEST, t->pos);
            f->a = n;
            if (accept_name(p, "not")) f->op = 1;
            f->name = expect_name(p);
            if (p->failed) return f;
            tok *c = cur(p);
            if (accept_op(p, "(")) {
                parse_call_args(p, f);
            } else if ((c->t == T_NAME || c->t == T_STRING || c->t == T_INT || c->t == T_FLOAT ||
                        tok_is_op(p, c, "[") || tok_is_op(p, c, "{")) &&
                       !tok_is_name(p, c, "else") && !tok_is_name(p, c, "or") &&
                       !tok_is_name(p, c, "and") && !tok_is_name(p, c, "is") &&
                       !tok_is_name(p, c, "if") && !tok_is_name(p, c, "in") &&
                       !tok_is_name(p, c, "not")) {
                jnode *arg = parse_postfix(p, parse_primary(p));
                add_kid(&f->kids, &f->nkids, arg);
            }
            n = f;
        } else if (tok_is_op(p, t, "(")) {
            p->at++;
            jnode *m = mk(p, E_CALL, t->pos);
            m->a = n;
            parse_call_args(p, m);
            n = m;
        } else {
            break;
        }
    }
    return n;
}

static jnode *parse_unary(parser *p, bool with_filter) {
    tok *t = cur(p);
    jnode *n;
    if (tok_is_op(p, t, "-") || tok_is_op(p, t, "+")) {
        if (p->depth > 200) {
            perr(p, t->pos, "expression nested too deeply");
            return NULL;
        }
        p->depth++;
        p->at++;
        n = mk(p, tok_is_op(p, t, "-") ? E_NEG : E_POS, t->pos);
        n->a = parse_unary(p, false);
        p->depth--;
    } else {
        n = parse_primary(p);
    }
    n = parse_postfix(p, n);
    if (with_filter) n = parse_filter_expr(p, n);
    return n;
}

static jnode *bin(parser *p, jnode_kind kind, int op, jnode *a, jnode *b, size_t pos) {
    jnode *n = mk(p, kind, pos);
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static jnode *parse_pow(parser *p) {
    jnode *l = parse_unary(p, true);
    while (!p->failed && tok_is_op(p, cur(p), "**")) {
        size_t pos = cur(p)->pos;
        p->at++;
        l = bin(p, E_BIN, OP_POW, l, parse_unary(p, true), pos);
    }
    return l;
}

static jnode *parse_math2(parser *p) {
    jnode *l = parse_pow(p);
    while (!p->failed) {
        tok *t = cur(p);
        int op = tok_is_op(p, t, "*") ? OP_MUL : tok_is_op(p, t, "/") ? OP_DIV
               : tok_is_op(p, t, "//") ? OP_FLOORDIV : tok_is_op(p, t, "%") ? OP_MOD : -1;
        if (op < 0) break;
        p->at++;
        l = bin(p, E_BIN, op, l, parse_pow(p), t->pos);
    }
    return l;
}

static jnode *parse_concat(parser *p) {
    jnode *l = parse_math2(p);
    while (!p->failed && tok_is_op(p, cur(p), "~")) {
        size_t pos = cur(p)->pos;
        p->at++;
        l = bin(p, E_BIN, OP_CONCAT, l, parse_math2(p), pos);
    }
    return l;
}

static jnode *parse_math1(parser *p) {
    jnode *l = parse_concat(p);
    while (!p->failed) {
        tok *t = cur(p);
        int op = tok_is_op(p, t, "+") ? OP_ADD : tok_is_op(p, t, "-") ? OP_SUB : -1;
        if (op < 0) break;
        p->at++;
        l = bin(p, E_BIN, op, l, parse_concat(p), t->pos);
    }
    return l;
}

static jnode *parse_compare(parser *p) {
    jnode *l = parse_math1(p);
    /* Jinja2 chains comparisons (a < b < c); no chat template does, so a
     * chain is reported as unsupported rather than guessed at. */
    jnode *result = NULL;
    while (!p->failed) {
        tok *t = cur(p);
        int op = -1;
        if (tok_is_op(p, t, "==")) op = OP_EQ;
        else if (tok_is_op(p, t, "!=")) op = OP_NE;
        else if (tok_is_op(p, t, "<")) op = OP_LT;
        else if (tok_is_op(p, t, ">")) op = OP_GT;
        else if (tok_is_op(p, t, "<=")) op = OP_LE;
        else if (tok_is_op(p, t, ">=")) op = OP_GE;
        else if (tok_is_name(p, t, "in")) op = OP_IN;
        else if (tok_is_name(p, t, "not") && tok_is_name(p, peek(p, 1), "in")) op = OP_NOTIN;
        if (op < 0) break;
        p->at += op == OP_NOTIN ? 2 : 1;
        jnode *r = parse_math1(p);
        if (result == NULL) {
            result = bin(p, E_BIN, op, l, r, t->pos);
        } else {
            perr(p, t->pos, "chained comparisons are not supported");
            node_free(r);
            return result;
        }
        l = result;
    }
    return result ? result : l;
}

static jnode *parse_not(parser *p) {
    tok *t = cur(p);
    if (tok_is_name(p, t, "not")) {
        if (p->depth > 200) {
            perr(p, t->pos, "expression nested too deeply");
            return NULL;
        }
        p->depth++;
        p->at++;
        jnode *n = mk(p, E_NOT, t->pos);
        n->a = parse_not(p);
        p->depth--;
        return n;
    }
    return parse_compare(p);
}

static jnode *parse_and(parser *p) {
    jnode *l = parse_not(p);
    while (!p->failed && tok_is_name(p, cur(p), "and")) {
        size_t pos = cur(p)->pos;
        p->at++;
        l = bin(p, E_AND, 0, l, parse_not(p), pos);
    }
    return l;
}

static jnode *parse_or(parser *p) {
    jnode *l = parse_and(p);
    while (!p->failed && tok_is_name(p, cur(p), "or")) {
        size_t pos = cur(p)->pos;
        p->at++;
        l = bin(p, E_OR, 0, l, parse_and(p), pos);
    }
    return l;
}

static jnode *parse_expr(parser *p) {
    if (++p->depth > 200) {
        perr(p, cur(p)->pos, "expression nested too deeply");
        p->depth--;
        return NULL;
    }
    jnode *e = parse_or(p);
    while (!p->failed && tok_is_name(p, cur(p), "if")) {
        size_t pos = cur(p)->pos;
        p->at++;
        jnode *n = mk(p, E_COND, pos);
        n->b = e;
        n->a = parse_or(p);
        if (accept_name(p, "else")) n->c = parse_expr(p);
        e = n;
    }
    p->depth--;
    return e;
}

/* ---- statements ---- */

static void expect_block_end(parser *p) {
    tok *t = cur(p);
    if (t->t == T_BLOCK_END) { p->at++; return; }
    char d[64];
    perr(p, t->pos, "expected end of statement block, got %s", tok_desc(p, t, d, sizeof d));
}

/* Parses statements until a block tag whose keyword is in stops (NULL-
 * terminated); returns the index of that keyword (the token after the
 * keyword is current) or -1 at end of template. */
static int parse_body(parser *p, jnode *into, bool second, const char *const *stops, size_t open_pos,
                      const char *open_name);

static jnode *parse_statement(parser *p, tok *begin);

static void body_add(jnode *into, bool second, jnode *n) {
    if (n == NULL) return;
    if (second) add_kid(&into->kids2, &into->nkids2, n);
    else add_kid(&into->kids, &into->nkids, n);
}

static int parse_body(parser *p, jnode *into, bool second, const char *const *stops, size_t open_pos,
                      const char *open_name) {
    while (!p->failed) {
        tok *t = cur(p);
        if (t->t == T_EOF) {
            if (stops) {
                int last = 0;
                while (stops[last + 1]) last++;
                perr(p, open_pos, "unexpected end of template: '%s' was never closed (expected '%s')",
                     open_name, stops[last]);
            }
            return -1;
        }
        if (t->t == T_TEXT) {
            p->at++;
            if (t->end > t->start) {
                jnode *n = mk(p, N_TEXT, t->start);
                n->lit = jv_str(p->src + t->start, t->end - t->start);
                n->lit.u.s->rc = -1;
                body_add(into, second, n);
            }
            continue;
        }
        if (t->t == T_VAR_BEGIN) {
            p->at++;
            jnode *n = mk(p, N_OUTPUT, t->pos);
            n->a = parse_expr(p);
            if (!p->failed && cur(p)->t != T_VAR_END) {
                char d[64];
                perr(p, cur(p)->pos, "expected end of print statement, got %s", tok_desc(p, cur(p), d, sizeof d));
            }
            p->at++;
            body_add(into, second, n);
            continue;
        }
        if (t->t == T_BLOCK_BEGIN) {
            if (t->comment) { p->at += 2; continue; }
            tok *kw = peek(p, 1);
            if (stops) {
                for (int i = 0; stops[i]; i++)
                    if (tok_is_name(p, kw, stops[i])) {
                        p->at += 2;
                        return i;
                    }
            }
            static const char *const ends[] = {"endif", "endfor", "endmacro", "endset", "elif", "else",
                                               "endgeneration", "endraw", NULL};
            for (int i = 0; ends[i]; i++)
                if (tok_is_name(p, kw, ends[i])) {
                    if (stops) {
                        int last = 0;
                        while (stops[last + 1]) last++;
                        perr(p, kw->pos, "unexpected '%s' (expected '%s')", ends[i], stops[last]);
                    } else {
                        perr(p, kw->pos, "unexpected '%s'", ends[i]);
                    }
                    return -1;
                }
            p->at++;
            body_add(into, second, parse_statement(p, t));
            continue;
        }
        char d[64];
        perr(p, t->pos, "unexpected %s", tok_desc(p, t, d, sizeof d));
    }
    return -1;
}

static jnode *parse_if(parser *p, tok *begin, bool is_elif) {
    (void)is_elif;
    jnode *n = mk(p, N_IF, begin->pos);
    n->a = parse_expr(p);
    expect_block_end(p);
    static const char *const stops[] = {"elif", "else", "endif", NULL};
    int which = parse_body(p, n, false, stops, begin->pos, "if");
    if (p->failed) return n;
    if (which == 0) {
        jnode *e = parse_if(p, begin, true);
        add_kid(&n->kids2, &n->nkids2, e);
        return n; /* the nested if consumed endif */
    }
    if (which == 1) {
        expect_block_end(p);
        static const char *const stops2[] = {"endif", NULL};
        parse_body(p, n, true, stops2, begin->pos, "if");
    }
    expect_block_end(p);
    return n;
}

static jnode *parse_for(parser *p, tok *begin) {
    jnode *n = mk(p, N_FOR, begin->pos);
    bool paren = accept_op(p, "(");
    do {
        char *nm = expect_name(p);
        if (nm == NULL) return n;
        add_name(&n->names, &n->nnames, nm);
    } while (accept_op(p, ","));
    if (paren) expect_op(p, ")");
    if (!accept_name(p, "in")) {
        perr(p, cur(p)->pos, "expected 'in' in for loop");
        return n;
    }
    /* the iterable: an or-expression so that a trailing `if` is the loop filter */
    n->a = parse_or(p);
    if (accept_name(p, "if")) n->b = parse_expr(p);
    if (accept_name(p, "recursive")) {
        perr(p, cur(p)->pos, "recursive loops are not supported");
        return n;
    }
    expect_block_end(p);
    static const char *const stops[] = {"else", "endfor", NULL};
    int which = parse_body(p, n, false, stops, begin->pos, "for");
    if (p->failed) return n;
    if (which == 0) {
        expect_block_end(p);
        static const char *const stops2[] = {"endfor", NULL};
        parse_body(p, n, true, stops2, begin->pos, "for");
    }
    expect_block_end(p);
    return n;
}

static jnode *parse_set(parser *p, tok *begin) {
    jnode *n = mk(p, N_SET, begin->pos);
    n->name = expect_name(p);
    if (p->failed) return n;
    if (accept_op(p, ".")) {
        n->op = 1;
        char *attr = expect_name(p);
        if (attr) add_name(&n->names, &n->nnames, attr);
    } else if (tok_is_op(p, cur(p), ",")) {
        n->op = 2;
        add_name(&n->names, &n->nnames, n->name);
        n->name = NULL;
        while (accept_op(p, ",")) {
            char *nm = expect_name(p);
            if (nm == NULL) return n;
            add_name(&n->names, &n->nnames, nm);
        }
    } else if (cur(p)->t == T_BLOCK_END) {
        /* {% set x %}...{% endset %} */
        n->kind = N_SET_BLOCK;
        p->at++;
        static const char *const stops[] = {"endset", NULL};
        parse_body(p, n, false, stops, begin->pos, "set");
        expect_block_end(p);
        return n;
    }
    expect_op(p, "=");
    n->b = parse_expr(p);
    if (!p->failed && tok_is_op(p, cur(p), ",")) { /* set a = 1, 2 -> tuple */
        jnode *l = mk(p, E_LIST, cur(p)->pos);
        add_kid(&l->kids, &l->nkids, n->b);
        while (accept_op(p, ",")) add_kid(&l->kids, &l->nkids, parse_expr(p));
        n->b = l;
    }
    expect_block_end(p);
    return n;
}

static jnode *parse_macro(parser *p, tok *begin) {
    jnode *n = mk(p, N_MACRO, begin->pos);
    n->name = expect_name(p);
    expect_op(p, "(");
    while (!p->failed && !tok_is_op(p, cur(p), ")")) {
        if (n->nnames) expect_op(p, ",");
        char *nm = expect_name(p);
        if (nm == NULL) break;
        add_name(&n->names, &n->nnames, nm);
        add_kid(&n->kids2, &n->nkids2, accept_op(p, "=") ? parse_expr(p) : NULL);
    }
    expect_op(p, ")");
    expect_block_end(p);
    static const char *const stops[] = {"endmacro", NULL};
    parse_body(p, n, false, stops, begin->pos, "macro");
    if (!p->failed && cur(p)->t == T_NAME) p->at++; /* {% endmacro name %} */
    expect_block_end(p);
    return n;
}

static jnode *parse_statement_inner(parser *p, tok *begin);

static jnode *parse_statement(parser *p, tok *begin) {
    if (++p->depth > 200) {
        perr(p, begin->pos, "statements nested too deeply");
        return NULL;
    }
    jnode *n = parse_statement_inner(p, begin);
    p->depth--;
    return n;
}

static jnode *parse_statement_inner(parser *p, tok *begin) {
    tok *kw = cur(p);
    if (kw->t != T_NAME) {
        char d[64];
        perr(p, kw->pos, "expected a statement name, got %s", tok_desc(p, kw, d, sizeof d));
        return NULL;
    }
    p->at++;
    if (tok_is_name(p, kw, "if")) return parse_if(p, begin, false);
    if (tok_is_name(p, kw, "for")) return parse_for(p, begin);
    if (tok_is_name(p, kw, "set")) return parse_set(p, begin);
    if (tok_is_name(p, kw, "macro")) return parse_macro(p, begin);
    if (tok_is_name(p, kw, "break") || tok_is_name(p, kw, "continue")) {
        jnode *n = mk(p, tok_is_name(p, kw, "break") ? N_BREAK : N_CONTINUE, begin->pos);
        expect_block_end(p);
        return n;
    }
    if (tok_is_name(p, kw, "generation")) {
        /* transformers' AssistantTracker: renders its body unchanged */
        jnode *n = mk(p, N_BLOCK, begin->pos);
        expect_block_end(p);
        static const char *const stops[] = {"endgeneration", NULL};
        parse_body(p, n, false, stops, begin->pos, "generation");
        expect_block_end(p);
        return n;
    }
    char *nm = tok_name(p, kw);
    static const char *const known_ends[] = {"endif", "endfor", "endmacro", "endset", "elif", "else",
                                            "endgeneration", NULL};
    bool stray = false;
    for (int i = 0; known_ends[i]; i++)
        if (strcmp(nm, known_ends[i]) == 0) stray = true;
    if (stray) perr(p, kw->pos, "unexpected '%s'", nm);
    else perr(p, kw->pos, "unknown tag '%s'", nm);
    free(nm);
    return NULL;
}

/* ---- API ---- */

jinja_template *jinja_parse(const char *source, ember_error *err) {
    /* normalise newlines, drop one trailing newline (keep_trailing_newline=False) */
    size_t n = strlen(source);
    char *src = xcalloc(n + 1, 1);
    size_t m = 0;
    for (size_t i = 0; i < n; i++) {
        if (source[i] == '\r') {
            src[m++] = '\n';
            if (i + 1 < n && source[i + 1] == '\n') i++;
        } else {
            src[m++] = source[i];
        }
    }
    if (m > 0 && src[m - 1] == '\n') m--;
    src[m] = '\0';

    parser p = {.src = src, .len = m, .err = err};
    lex(&p);
    jnode *root = NULL;
    if (!p.failed) {
        apply_whitespace(&p);
        root = mk(&p, N_BLOCK, 0);
        parse_body(&p, root, false, NULL, 0, NULL);
    }
    for (size_t i = 0; i < p.ntoks; i++) free(p.toks[i].str);
    free(p.toks);
    free(src);
    if (p.failed) {
        node_free(root);
        return NULL;
    }
    jinja_template *t = xcalloc(1, sizeof *t);
    t->root = root;
    return t;
}

void jinja_free(jinja_template *t) {
    if (t == NULL) return;
    node_free(t->root);
    free(t);
}
