/* jinja_value.c - the value type of the Jinja engine (see jinja.h).
 *
 * Design: a jv is passed by value; heap parts (string, list, dict,
 * callable) carry a reference count and are freed when it drops to zero.
 * Dicts are small arrays searched linearly: chat messages and tool schemas
 * have a handful of keys, and insertion order must be kept anyway (Python
 * dicts and json.dumps preserve it). Formatting follows CPython: str() of
 * bools and None, repr() of floats (shortest round-trip digits, exponent
 * form outside 1e-4 <= |x| < 1e16), repr() of containers, and json.dumps
 * with its default separators. Allocation failure aborts: a renderer that
 * cannot allocate a few bytes has nothing sensible to return.
 *
 * Memory budget of a render: while jinja_render runs on a thread, a
 * thread-local account holds the bytes of the strings, lists and dicts that
 * are alive (charged at allocation and growth, credited when freed), and no
 * jbuf may grow past the same limit (a buffer that would is left as it was).
 * Either event raises a flag that the evaluator turns into an error at its
 * next step, so a template cannot allocate without bound (values built
 * outside a render, such as the caller's variables, are not charged). The
 * same account counts units of work done inside builtins (bytes copied /256,
 * items pushed, comparisons), which the evaluator adds to its step count:
 * a loop over an expensive builtin reaches the step limit too. */
#include "chat/jinja.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (p == NULL) abort();
    return p;
}

static void *xrealloc(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (q == NULL) abort();
    return q;
}

/* ---- the render's memory budget ---- */

static _Thread_local struct {
    bool on, over, too_deep;
    size_t max;
    int64_t live; /* may dip below zero when a render frees a value made before it */
    int64_t work; /* units of builtin work since the evaluator last took them */
} budget;

void jinja_budget_begin(size_t max_bytes) {
    budget.on = true;
    budget.over = false;
    budget.too_deep = false;
    budget.max = max_bytes;
    budget.live = 0;
    budget.work = 0;
}

int64_t jinja_budget_take_work(void) {
    int64_t w = budget.work;
    budget.work = 0;
    return w;
}

bool jinja_budget_exceeded(void) { return budget.on && budget.over; }

bool jinja_budget_too_deep(void) { return budget.on && budget.too_deep; }

void jinja_budget_end(void) { budget.on = false; }

static void charge(int64_t bytes) {
    if (!budget.on) return;
    budget.live += bytes;
    if (budget.live > 0 && (uint64_t)budget.live > budget.max) budget.over = true;
}

/* ---- buffers ---- */

void jbuf_put(jbuf *b, const char *s, size_t n) {
    budget.work += 1 + (int64_t)(n >> 8);
    if (b->n + n + 1 > b->cap) {
        if (budget.on && b->n + n + 1 > budget.max) {
            budget.over = true;
            if (b->p == NULL) { /* callers may read the buffer after any put */
                b->p = xmalloc(64);
                b->cap = 64;
                b->p[0] = '\0';
            }
            return;
        }
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1) cap *= 2;
        b->p = xrealloc(b->p, cap);
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}

void jbuf_puts(jbuf *b, const char *s) { jbuf_put(b, s, strlen(s)); }
void jbuf_putc(jbuf *b, char c) { jbuf_put(b, &c, 1); }

/* ---- construction and references ---- */

jv jv_str(const char *s, size_t len) {
    jstr *p = xmalloc(sizeof *p + len + 1);
    charge((int64_t)len);
    budget.work += 1 + (int64_t)(len >> 8);
    p->rc = 1;
    p->len = len;
    if (len) memcpy(p->data, s, len);
    p->data[len] = '\0';
    jv v = {0};
    v.t = JV_STR;
    v.u.s = p;
    return v;
}

jv jv_cstr(const char *s) { return jv_str(s, strlen(s)); }

jv jv_list(size_t cap) {
    jlist *l = xmalloc(sizeof *l);
    l->rc = 1;
    l->is_tuple = false;
    l->n = 0;
    l->cap = cap;
    l->items = cap ? xmalloc(cap * sizeof(jv)) : NULL;
    l->depth = 1;
    l->holds_ns = false;
    charge((int64_t)(cap * sizeof(jv)));
    jv v = {0};
    v.t = JV_LIST;
    v.u.l = l;
    return v;
}

#define DICT_SLOT_BYTES (sizeof(jstr *) + sizeof(jv))

jv jv_dict(size_t cap) {
    jdict *d = xmalloc(sizeof *d);
    d->rc = 1;
    d->is_ns = false;
    d->n = 0;
    d->cap = cap;
    d->keys = cap ? xmalloc(cap * sizeof(jstr *)) : NULL;
    d->vals = cap ? xmalloc(cap * sizeof(jv)) : NULL;
    d->depth = 1;
    d->holds_ns = false;
    charge((int64_t)(cap * DICT_SLOT_BYTES));
    jv v = {0};
    v.t = JV_DICT;
    v.u.d = d;
    return v;
}

jv jv_func(const char *name, jv (*fn)(struct jinja_ctx *, jv, const jargs *, void *), void *data) {
    jfunc *f = xmalloc(sizeof *f);
    memset(f, 0, sizeof *f);
    f->rc = 1;
    f->name = name;
    f->fn = fn;
    f->data = data;
    f->bound = jv_undef();
    jv v = {0};
    v.t = JV_FUNC;
    v.u.fn = f;
    return v;
}

jv jv_retain(jv v) {
    switch (v.t) {
    case JV_STR:
        if (v.u.s->rc >= 0) v.u.s->rc++; /* rc < 0: an immortal template literal */
        break;
    case JV_LIST: v.u.l->rc++; break;
    case JV_DICT: v.u.d->rc++; break;
    case JV_FUNC: v.u.fn->rc++; break;
    default: break;
    }
    return v;
}

void jv_release(jv v) {
    switch (v.t) {
    case JV_STR:
        if (v.u.s->rc >= 0 && --v.u.s->rc == 0) {
            charge(-(int64_t)v.u.s->len);
            free(v.u.s);
        }
        break;
    case JV_LIST:
        if (--v.u.l->rc == 0) {
            for (size_t i = 0; i < v.u.l->n; i++) jv_release(v.u.l->items[i]);
            charge(-(int64_t)(v.u.l->cap * sizeof(jv)));
            free(v.u.l->items);
            free(v.u.l);
        }
        break;
    case JV_DICT:
        if (--v.u.d->rc == 0) {
            for (size_t i = 0; i < v.u.d->n; i++) {
                charge(-(int64_t)v.u.d->keys[i]->len);
                free(v.u.d->keys[i]);
                jv_release(v.u.d->vals[i]);
            }
            charge(-(int64_t)(v.u.d->cap * DICT_SLOT_BYTES));
            free(v.u.d->keys);
            free(v.u.d->vals);
            free(v.u.d);
        }
        break;
    case JV_FUNC:
        if (--v.u.fn->rc == 0) {
            jv_release(v.u.fn->bound);
            free(v.u.fn);
        }
        break;
    default: break;
    }
}

int jv_depth(jv v) {
    switch (v.t) {
    case JV_LIST: return v.u.l->depth;
    case JV_DICT: return v.u.d->depth;
    case JV_FUNC: return jv_depth(v.u.fn->bound); /* a bound method holds its receiver */
    default: return 0;
    }
}

bool jv_holds_ns(jv v) {
    switch (v.t) {
    case JV_LIST: return v.u.l->holds_ns;
    case JV_DICT: return v.u.d->is_ns || v.u.d->holds_ns;
    case JV_FUNC: return jv_holds_ns(v.u.fn->bound);
    default: return false;
    }
}

/* Records a new item's nesting in its container's depth and holds_ns. */
static void note_item(int *depth, bool *holds_ns, jv item) {
    int d = jv_depth(item) + 1;
    if (d > *depth) *depth = d;
    if (jv_holds_ns(item)) *holds_ns = true;
    if (budget.on && *depth > JINJA_MAX_DEPTH) budget.too_deep = true;
}

void jv_list_push(jv list, jv item) {
    budget.work++;
    jlist *l = list.u.l;
    if (l->n == l->cap) {
        charge((int64_t)((l->cap ? l->cap : 4) * sizeof(jv)));
        l->cap = l->cap ? l->cap * 2 : 4;
        l->items = xrealloc(l->items, l->cap * sizeof(jv));
    }
    note_item(&l->depth, &l->holds_ns, item);
    l->items[l->n++] = item;
}

static jstr *jstr_new(const char *s, size_t len) {
    jstr *p = xmalloc(sizeof *p + len + 1);
    p->rc = 1;
    p->len = len;
    memcpy(p->data, s, len);
    p->data[len] = '\0';
    return p;
}

void jv_dict_set(jv dict, const char *key, size_t klen, jv val) {
    budget.work++;
    jdict *d = dict.u.d;
    for (size_t i = 0; i < d->n; i++) {
        if (d->keys[i]->len == klen && memcmp(d->keys[i]->data, key, klen) == 0) {
            jv_release(d->vals[i]);
            note_item(&d->depth, &d->holds_ns, val);
            d->vals[i] = val;
            return;
        }
    }
    if (d->n == d->cap) {
        charge((int64_t)((d->cap ? d->cap : 4) * DICT_SLOT_BYTES));
        d->cap = d->cap ? d->cap * 2 : 4;
        d->keys = xrealloc(d->keys, d->cap * sizeof(jstr *));
        d->vals = xrealloc(d->vals, d->cap * sizeof(jv));
    }
    d->keys[d->n] = jstr_new(key, klen);
    charge((int64_t)klen);
    note_item(&d->depth, &d->holds_ns, val);
    d->vals[d->n] = val;
    d->n++;
}

const jv *jv_dict_get(jv dict, const char *key, size_t klen) {
    if (dict.t != JV_DICT) return NULL;
    jdict *d = dict.u.d;
    for (size_t i = 0; i < d->n; i++)
        if (d->keys[i]->len == klen && memcmp(d->keys[i]->data, key, klen) == 0)
            return &d->vals[i];
    return NULL;
}

/* ---- predicates ---- */

bool jv_truthy(jv v) {
    switch (v.t) {
    case JV_UNDEF:
    case JV_NONE: return false;
    case JV_BOOL: return v.u.b;
    case JV_INT: return v.u.i != 0;
    case JV_FLOAT: return v.u.f != 0.0;
    case JV_STR: return v.u.s->len != 0;
    case JV_LIST: return v.u.l->n != 0;
    case JV_DICT: return v.u.d->n != 0;
    case JV_FUNC: return true;
    }
    return false;
}

static bool is_num(jv v) { return v.t == JV_INT || v.t == JV_FLOAT || v.t == JV_BOOL; }
static double num_f(jv v) {
    return v.t == JV_FLOAT ? v.u.f : v.t == JV_INT ? (double)v.u.i : (double)v.u.b;
}

bool jv_equal(jv a, jv b) {
    budget.work++;
    if (is_num(a) && is_num(b)) {
        if (a.t != JV_FLOAT && b.t != JV_FLOAT) {
            int64_t x = a.t == JV_INT ? a.u.i : a.u.b, y = b.t == JV_INT ? b.u.i : b.u.b;
            return x == y;
        }
        return num_f(a) == num_f(b);
    }
    if (a.t != b.t) return false;
    switch (a.t) {
    case JV_UNDEF:
    case JV_NONE: return true;
    case JV_STR: return a.u.s->len == b.u.s->len && memcmp(a.u.s->data, b.u.s->data, a.u.s->len) == 0;
    case JV_LIST:
        if (a.u.l->n != b.u.l->n) return false;
        for (size_t i = 0; i < a.u.l->n; i++)
            if (!jv_equal(a.u.l->items[i], b.u.l->items[i])) return false;
        return true;
    case JV_DICT:
        if (a.u.d == b.u.d) return true;
        if (a.u.d->n != b.u.d->n) return false;
        for (size_t i = 0; i < a.u.d->n; i++) {
            const jv *o = jv_dict_get(b, a.u.d->keys[i]->data, a.u.d->keys[i]->len);
            if (o == NULL || !jv_equal(a.u.d->vals[i], *o)) return false;
        }
        return true;
    case JV_FUNC: return a.u.fn == b.u.fn;
    default: return false;
    }
}

const char *jv_type_name(jv v) {
    switch (v.t) {
    case JV_UNDEF: return "undefined";
    case JV_NONE: return "NoneType";
    case JV_BOOL: return "bool";
    case JV_INT: return "int";
    case JV_FLOAT: return "float";
    case JV_STR: return "str";
    case JV_LIST: return "list";
    case JV_DICT: return v.u.d->is_ns ? "Namespace" : "dict";
    case JV_FUNC: return "function";
    }
    return "?";
}

/* ---- UTF-8 ---- */

static size_t utf8_len_at(const char *s, size_t len, size_t at) {
    unsigned char c = (unsigned char)s[at];
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (at + n > len) n = len - at;
    return n;
}

static uint32_t utf8_decode_at(const char *s, size_t len, size_t at, size_t *n) {
    const unsigned char *p = (const unsigned char *)s + at;
    *n = utf8_len_at(s, len, at);
    switch (*n) {
    case 2: return ((uint32_t)(p[0] & 0x1f) << 6) | (p[1] & 0x3f);
    case 3: return ((uint32_t)(p[0] & 0x0f) << 12) | ((uint32_t)(p[1] & 0x3f) << 6) | (p[2] & 0x3f);
    case 4:
        return ((uint32_t)(p[0] & 0x07) << 18) | ((uint32_t)(p[1] & 0x3f) << 12) |
               ((uint32_t)(p[2] & 0x3f) << 6) | (p[3] & 0x3f);
    default: return p[0];
    }
}

size_t utf8_cp_count(const char *s, size_t len) {
    size_t n = 0;
    for (size_t i = 0; i < len; i += utf8_len_at(s, len, i)) n++;
    return n;
}

size_t utf8_cp_offset(const char *s, size_t len, size_t cp) {
    size_t i = 0;
    while (cp > 0 && i < len) {
        i += utf8_len_at(s, len, i);
        cp--;
    }
    return i;
}

bool py_isspace_at(const char *s, size_t len, size_t at, size_t *clen) {
    uint32_t c = utf8_decode_at(s, len, at, clen);
    if (c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f)) return true;
    return c == 0x85 || c == 0xa0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200a) ||
           c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

/* ---- formatting ---- */

void py_float_repr(char *out, size_t cap, double f) {
    if (isnan(f)) { snprintf(out, cap, "nan"); return; }
    if (isinf(f)) { snprintf(out, cap, f < 0 ? "-inf" : "inf"); return; }
    if (f == 0.0) { snprintf(out, cap, signbit(f) ? "-0.0" : "0.0"); return; }
    /* shortest digits that round-trip */
    char tmp[40];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, f);
        if (strtod(tmp, NULL) == f) break;
    }
    /* tmp: [-]d[.ddd]e[+-]XX */
    char digits[32];
    size_t nd = 0;
    const char *p = tmp;
    bool neg = false;
    if (*p == '-') { neg = true; p++; }
    for (; *p && *p != 'e'; p++)
        if (*p != '.') digits[nd++] = *p;
    digits[nd] = '\0';
    int exp10 = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') digits[--nd] = '\0';
    jbuf b = {0};
    if (neg) jbuf_putc(&b, '-');
    if (exp10 < -4 || exp10 >= 16) {
        jbuf_putc(&b, digits[0]);
        if (nd > 1) {
            jbuf_putc(&b, '.');
            jbuf_put(&b, digits + 1, nd - 1);
        }
        char e[16];
        snprintf(e, sizeof e, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
        jbuf_puts(&b, e);
    } else if (exp10 < 0) {
        jbuf_puts(&b, "0.");
        for (int i = 0; i < -exp10 - 1; i++) jbuf_putc(&b, '0');
        jbuf_put(&b, digits, nd);
    } else {
        size_t intd = (size_t)exp10 + 1;
        for (size_t i = 0; i < intd; i++) jbuf_putc(&b, i < nd ? digits[i] : '0');
        jbuf_putc(&b, '.');
        if (nd > intd) jbuf_put(&b, digits + intd, nd - intd);
        else jbuf_putc(&b, '0');
    }
    snprintf(out, cap, "%s", b.p);
    free(b.p);
}

static void repr_str(jbuf *b, const char *s, size_t len) {
    /* Python picks single quotes unless the string has ' and no ". */
    bool has_sq = memchr(s, '\'', len) != NULL, has_dq = memchr(s, '"', len) != NULL;
    char q = (has_sq && !has_dq) ? '"' : '\'';
    jbuf_putc(b, q);
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == (unsigned char)q || c == '\\') { jbuf_putc(b, '\\'); jbuf_putc(b, (char)c); }
        else if (c == '\n') jbuf_puts(b, "\\n");
        else if (c == '\r') jbuf_puts(b, "\\r");
        else if (c == '\t') jbuf_puts(b, "\\t");
        else if (c < 0x20 || c == 0x7f) {
            char e[8];
            snprintf(e, sizeof e, "\\x%02x", c);
            jbuf_puts(b, e);
        } else jbuf_putc(b, (char)c);
    }
    jbuf_putc(b, q);
}

void jv_repr_into(jbuf *b, jv v) {
    switch (v.t) {
    case JV_STR: repr_str(b, v.u.s->data, v.u.s->len); break;
    case JV_LIST:
        jbuf_putc(b, v.u.l->is_tuple ? '(' : '[');
        for (size_t i = 0; i < v.u.l->n; i++) {
            if (i) jbuf_puts(b, ", ");
            jv_repr_into(b, v.u.l->items[i]);
        }
        if (v.u.l->is_tuple && v.u.l->n == 1) jbuf_putc(b, ',');
        jbuf_putc(b, v.u.l->is_tuple ? ')' : ']');
        break;
    case JV_DICT:
        if (v.u.d->is_ns) { jbuf_puts(b, "<Namespace>"); break; }
        jbuf_putc(b, '{');
        for (size_t i = 0; i < v.u.d->n; i++) {
            if (i) jbuf_puts(b, ", ");
            repr_str(b, v.u.d->keys[i]->data, v.u.d->keys[i]->len);
            jbuf_puts(b, ": ");
            jv_repr_into(b, v.u.d->vals[i]);
        }
        jbuf_putc(b, '}');
        break;
    case JV_UNDEF: break;
    default: jv_str_into(b, v); break;
    }
}

void jv_str_into(jbuf *b, jv v) {
    char tmp[64];
    switch (v.t) {
    case JV_UNDEF: break;
    case JV_NONE: jbuf_puts(b, "None"); break;
    case JV_BOOL: jbuf_puts(b, v.u.b ? "True" : "False"); break;
    case JV_INT:
        snprintf(tmp, sizeof tmp, "%lld", (long long)v.u.i);
        jbuf_puts(b, tmp);
        break;
    case JV_FLOAT:
        py_float_repr(tmp, sizeof tmp, v.u.f);
        jbuf_puts(b, tmp);
        break;
    case JV_STR: jbuf_put(b, v.u.s->data, v.u.s->len); break;
    case JV_FUNC:
        jbuf_puts(b, "<function ");
        jbuf_puts(b, v.u.fn->name ? v.u.fn->name : "?");
        jbuf_puts(b, ">");
        break;
    default: jv_repr_into(b, v); break;
    }
}

jv jv_to_str(jv v) {
    if (v.t == JV_STR) return jv_retain(v);
    jbuf b = {0};
    jv_str_into(&b, v);
    jv r = jv_str(b.p ? b.p : "", b.n);
    free(b.p);
    return r;
}

/* ---- JSON (Python json.dumps) ---- */

static void json_str(jbuf *b, const char *s, size_t len, bool ensure_ascii) {
    jbuf_putc(b, '"');
    for (size_t i = 0; i < len;) {
        unsigned char c = (unsigned char)s[i];
        char e[16];
        if (c == '"') { jbuf_puts(b, "\\\""); i++; }
        else if (c == '\\') { jbuf_puts(b, "\\\\"); i++; }
        else if (c == '\n') { jbuf_puts(b, "\\n"); i++; }
        else if (c == '\r') { jbuf_puts(b, "\\r"); i++; }
        else if (c == '\t') { jbuf_puts(b, "\\t"); i++; }
        else if (c == '\b') { jbuf_puts(b, "\\b"); i++; }
        else if (c == '\f') { jbuf_puts(b, "\\f"); i++; }
        else if (c < 0x20) {
            snprintf(e, sizeof e, "\\u%04x", c);
            jbuf_puts(b, e);
            i++;
        } else if (c >= 0x80 && ensure_ascii) {
            size_t n;
            uint32_t cp = utf8_decode_at(s, len, i, &n);
            if (cp >= 0x10000) {
                cp -= 0x10000;
                snprintf(e, sizeof e, "\\u%04x\\u%04x", 0xd800 + (cp >> 10), 0xdc00 + (cp & 0x3ff));
            } else {
                snprintf(e, sizeof e, "\\u%04x", cp);
            }
            jbuf_puts(b, e);
            i += n;
        } else { jbuf_putc(b, (char)c); i++; }
    }
    jbuf_putc(b, '"');
}

static void json_nl(jbuf *b, int indent, int level) {
    jbuf_putc(b, '\n');
    for (int i = 0; i < indent * level; i++) jbuf_putc(b, ' ');
}

static int key_cmp(const void *a, const void *b) {
    const jstr *x = *(jstr *const *)a, *y = *(jstr *const *)b;
    size_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->data, y->data, n);
    return c ? c : (x->len < y->len ? -1 : x->len > y->len);
}

static int json_rec(jbuf *b, jv v, bool ea, int indent, bool sort, int level, const char **msg) {
    char tmp[64];
    switch (v.t) {
    case JV_NONE: jbuf_puts(b, "null"); return 0;
    case JV_BOOL: jbuf_puts(b, v.u.b ? "true" : "false"); return 0;
    case JV_INT:
        snprintf(tmp, sizeof tmp, "%lld", (long long)v.u.i);
        jbuf_puts(b, tmp);
        return 0;
    case JV_FLOAT:
        if (isnan(v.u.f)) jbuf_puts(b, "NaN");
        else if (isinf(v.u.f)) jbuf_puts(b, v.u.f < 0 ? "-Infinity" : "Infinity");
        else {
            py_float_repr(tmp, sizeof tmp, v.u.f);
            jbuf_puts(b, tmp);
        }
        return 0;
    case JV_STR: json_str(b, v.u.s->data, v.u.s->len, ea); return 0;
    case JV_LIST:
        if (v.u.l->n == 0) { jbuf_puts(b, "[]"); return 0; }
        jbuf_putc(b, '[');
        for (size_t i = 0; i < v.u.l->n; i++) {
            if (i) jbuf_puts(b, indent >= 0 ? "," : ", ");
            if (indent >= 0) json_nl(b, indent, level + 1);
            if (json_rec(b, v.u.l->items[i], ea, indent, sort, level + 1, msg)) return -1;
        }
        if (indent >= 0) json_nl(b, indent, level);
        jbuf_putc(b, ']');
        return 0;
    case JV_DICT: {
        jdict *d = v.u.d;
        if (d->n == 0) { jbuf_puts(b, "{}"); return 0; }
        size_t *order = malloc(d->n * sizeof(size_t));
        if (order == NULL) abort();
        for (size_t i = 0; i < d->n; i++) order[i] = i;
        if (sort) {
            /* stable selection by key */
            for (size_t i = 0; i < d->n; i++)
                for (size_t j = i + 1; j < d->n; j++) {
                    const jstr *ki = d->keys[order[i]], *kj = d->keys[order[j]];
                    if (key_cmp(&kj, &ki) < 0) {
                        size_t t = order[i];
                        order[i] = order[j];
                        order[j] = t;
                    }
                }
        }
        jbuf_putc(b, '{');
        for (size_t k = 0; k < d->n; k++) {
            size_t i = order[k];
            if (k) jbuf_puts(b, indent >= 0 ? "," : ", ");
            if (indent >= 0) json_nl(b, indent, level + 1);
            json_str(b, d->keys[i]->data, d->keys[i]->len, ea);
            jbuf_puts(b, ": ");
            if (json_rec(b, d->vals[i], ea, indent, sort, level + 1, msg)) {
                free(order);
                return -1;
            }
        }
        free(order);
        if (indent >= 0) json_nl(b, indent, level);
        jbuf_putc(b, '}');
        return 0;
    }
    case JV_UNDEF: *msg = "Object of type Undefined is not JSON serializable"; return -1;
    case JV_FUNC: *msg = "Object of type function is not JSON serializable"; return -1;
    }
    return -1;
}

int jv_to_json(jbuf *b, jv v, bool ensure_ascii, int indent, bool sort_keys, const char **msg) {
    return json_rec(b, v, ensure_ascii, indent, sort_keys, 0, msg);
}
