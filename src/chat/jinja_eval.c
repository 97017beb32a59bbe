/* jinja_eval.c - evaluation of a parsed template (see jinja.h).
 *
 * Design: a tree walk over the AST with a chain of scopes. The root scope
 * holds the render variables' overrides and top-level `set`s; every for-loop
 * iteration and every macro call gets a fresh child scope, so assignments
 * inside them do not leak out (Jinja2's rule, hence the namespace() idiom),
 * while reads fall through to enclosing scopes and then to the variables and
 * builtins. Macros see the root scope, not their caller's. Output goes to a
 * growing buffer; a macro call swaps in its own buffer and returns the text.
 * Errors stop evaluation: the first one is recorded with the line and column
 * of the node that raised it and every evaluator returns undefined after.
 * Undefined follows Jinja2's default Undefined: it prints as "", is falsy,
 * iterates as empty and has length 0, but reading an attribute or item of it
 * is an error. Attribute access on dicts prefers the methods get/items/keys/
 * values (Python getattr first), item access prefers keys. Filters, tests,
 * and the str/dict methods templates use are implemented with Python's
 * semantics; unknown ones are errors naming them. Every statement and
 * expression is one step; a render stops with an error past its step limit
 * or when the byte account of jinja_value.c overflows (jinja_limits), so a
 * template from a model file cannot hang or exhaust memory. */
#include "chat/jinja.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct scope {
    struct scope *parent;
    jv vars; /* dict */
} scope;

typedef struct jinja_ctx {
    ember_error *err;
    bool failed;
    int64_t now;
    jv globals;  /* render variables (borrowed) */
    scope *root;
    scope *cur;
    jbuf *out;
    int loopctl; /* 1 break, 2 continue */
    int depth;
    const jnode *call_node; /* the call being made, for builtins' errors */
    int64_t steps, max_steps;
    size_t max_bytes;
} jinja_ctx;

static void fail(jinja_ctx *c, const jnode *n, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void fail(jinja_ctx *c, const jnode *n, const char *fmt, ...) {
    if (c->failed) return;
    c->failed = true;
    char msg[420];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    ember_fail(c->err, "template error at line %d, column %d: %s", n ? n->line : 0, n ? n->col : 0, msg);
}

static jv eval(jinja_ctx *c, const jnode *n);
static void exec_body(jinja_ctx *c, jnode *const *kids, size_t n);

static jv str_of(const char *s, size_t n) { return jv_str(s, n); }

/* ---- scopes ---- */

static const jv *lookup(jinja_ctx *c, const char *name) {
    size_t n = strlen(name);
    for (scope *s = c->cur; s; s = s->parent) {
        const jv *v = jv_dict_get(s->vars, name, n);
        if (v) return v;
    }
    return jv_dict_get(c->globals, name, n);
}

static void assign(jinja_ctx *c, const char *name, jv v) {
    jv_dict_set(c->cur->vars, name, strlen(name), v);
}

/* ---- builtins ---- */

static const jv *arg_kw(const jargs *a, const char *name) {
    for (size_t i = 0; i < a->nkw; i++)
        if (strcmp(a->kw_names[i], name) == 0) return &a->kw[i];
    return NULL;
}

/* positional i or keyword name, else NULL */
static const jv *arg_at(const jargs *a, size_t i, const char *name) {
    if (i < a->npos) return &a->pos[i];
    return name ? arg_kw(a, name) : NULL;
}


static jv b_raise(jinja_ctx *c, jv self, const jargs *a, void *d) {
    (void)self;
    (void)d;
    jbuf b = {0};
    if (a->npos) jv_str_into(&b, a->pos[0]);
    fail(c, c->call_node, "raise_exception: %s", b.p ? b.p : "");
    free(b.p);
    return jv_undef();
}

static jv b_namespace(jinja_ctx *c, jv self, const jargs *a, void *d) {
    (void)self;
    (void)d;
    /* A namespace holding a namespace could be made to hold itself. */
    for (size_t i = 0; i < a->npos + a->nkw; i++)
        if (jv_holds_ns(i < a->npos ? a->pos[i] : a->kw[i - a->npos])) {
            fail(c, c->call_node, "namespace() cannot hold another namespace");
            return jv_undef();
        }
    jv ns = jv_dict(a->nkw);
    ns.u.d->is_ns = true;
    for (size_t i = 0; i < a->npos; i++) { /* namespace(dict) */
        if (a->pos[i].t == JV_DICT) {
            jdict *src = a->pos[i].u.d;
            for (size_t k = 0; k < src->n; k++)
                jv_dict_set(ns, src->keys[k]->data, src->keys[k]->len, jv_retain(src->vals[k]));
        }
    }
    for (size_t i = 0; i < a->nkw; i++)
        jv_dict_set(ns, a->kw_names[i], strlen(a->kw_names[i]), jv_retain(a->kw[i]));
    return ns;
}

static jv b_range(jinja_ctx *c, jv self, const jargs *a, void *d) {
    (void)self;
    (void)d;
    int64_t start = 0, stop = 0, step = 1;
    for (size_t i = 0; i < a->npos; i++)
        if (a->pos[i].t != JV_INT) {
            fail(c, c->call_node, "range() arguments must be integers");
            return jv_undef();
        }
    if (a->npos == 1) stop = a->pos[0].u.i;
    else if (a->npos >= 2) {
        start = a->pos[0].u.i;
        stop = a->pos[1].u.i;
        if (a->npos >= 3) step = a->pos[2].u.i;
    }
    if (step == 0) {
        fail(c, c->call_node, "range() arg 3 must not be zero");
        return jv_undef();
    }
    jv l = jv_list(0);
    for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
        if (l.u.l->n > 1000000) break;
        jv_list_push(l, jv_int(i));
        if (__builtin_add_overflow(i, step, &i)) break; /* past INT64_MAX: no further element */
    }
    return l;
}

static jv b_strftime_now(jinja_ctx *c, jv self, const jargs *a, void *d) {
    (void)self;
    (void)d;
    if (a->npos < 1 || a->pos[0].t != JV_STR) {
        fail(c, c->call_node, "strftime_now() takes a format string");
        return jv_undef();
    }
    time_t t = c->now ? (time_t)c->now : time(NULL);
    struct tm tm;
    localtime_r(&t, &tm);
    char buf[256];
    size_t n = strftime(buf, sizeof buf, a->pos[0].u.s->data, &tm);
    return str_of(buf, n);
}

static jv b_dict(jinja_ctx *c, jv self, const jargs *a, void *d) {
    (void)c;
    (void)self;
    (void)d;
    jv r = jv_dict(a->nkw);
    if (a->npos && a->pos[0].t == JV_DICT) {
        jdict *src = a->pos[0].u.d;
        for (size_t k = 0; k < src->n; k++)
            jv_dict_set(r, src->keys[k]->data, src->keys[k]->len, jv_retain(src->vals[k]));
    }
    for (size_t i = 0; i < a->nkw; i++) jv_dict_set(r, a->kw_names[i], strlen(a->kw_names[i]), jv_retain(a->kw[i]));
    return r;
}

static const struct {
    const char *name;
    jv (*fn)(jinja_ctx *, jv, const jargs *, void *);
} BUILTINS[] = {
    {"raise_exception", b_raise}, {"namespace", b_namespace}, {"range", b_range},
    {"strftime_now", b_strftime_now}, {"dict", b_dict}, {NULL, NULL}
};

/* ---- string helpers ---- */

static bool strip_set_has(const char *chars, size_t nchars, const char *s, size_t len, size_t at, size_t *clen) {
    if (chars == NULL) return py_isspace_at(s, len, at, clen);
    /* match one code point of s against the set */
    size_t n = 1;
    unsigned char ch = (unsigned char)s[at];
    n = ch < 0x80 ? 1 : (ch >> 5) == 6 ? 2 : (ch >> 4) == 14 ? 3 : 4;
    if (at + n > len) n = len - at;
    *clen = n;
    for (size_t i = 0; i + n <= nchars;) {
        unsigned char cc = (unsigned char)chars[i];
        size_t m = cc < 0x80 ? 1 : (cc >> 5) == 6 ? 2 : (cc >> 4) == 14 ? 3 : 4;
        if (m == n && memcmp(chars + i, s + at, n) == 0) return true;
        i += m;
    }
    return false;
}

static jv do_strip(jv s, const jv *chars, bool left, bool right) {
    const char *p = s.u.s->data;
    size_t len = s.u.s->len, a = 0, b = len, cl;
    const char *cs = NULL;
    size_t ncs = 0;
    if (chars && chars->t == JV_STR) {
        cs = chars->u.s->data;
        ncs = chars->u.s->len;
    }
    if (left)
        while (a < b && strip_set_has(cs, ncs, p, len, a, &cl)) a += cl;
    if (right)
        while (b > a) {
            size_t k = b - 1;
            while (k > a && ((unsigned char)p[k] & 0xc0) == 0x80) k--;
            if (!strip_set_has(cs, ncs, p, len, k, &cl)) break;
            b = k;
        }
    return str_of(p + a, b - a);
}

static jv str_lower_upper(jv s, bool upper) {
    jv r = str_of(s.u.s->data, s.u.s->len);
    for (size_t i = 0; i < r.u.s->len; i++) {
        char ch = r.u.s->data[i];
        if (upper && ch >= 'a' && ch <= 'z') r.u.s->data[i] = (char)(ch - 32);
        if (!upper && ch >= 'A' && ch <= 'Z') r.u.s->data[i] = (char)(ch + 32);
    }
    return r;
}

static jv str_replace(jv s, jv old, jv new_, int64_t count) {
    jbuf b = {0};
    jbuf_put(&b, "", 0);
    const char *p = s.u.s->data;
    size_t len = s.u.s->len, ol = old.u.s->len;
    size_t i = 0;
    int64_t done = 0;
    if (ol == 0) {
        /* Python inserts new between every character */
        for (size_t k = 0; k <= len;) {
            if (count < 0 || done < count) {
                jbuf_put(&b, new_.u.s->data, new_.u.s->len);
                done++;
            }
            if (k == len) break;
            unsigned char ch = (unsigned char)p[k];
            size_t m = ch < 0x80 ? 1 : (ch >> 5) == 6 ? 2 : (ch >> 4) == 14 ? 3 : 4;
            jbuf_put(&b, p + k, m);
            k += m;
        }
    } else {
        while (i < len) {
            if ((count < 0 || done < count) && i + ol <= len && memcmp(p + i, old.u.s->data, ol) == 0) {
                jbuf_put(&b, new_.u.s->data, new_.u.s->len);
                i += ol;
                done++;
            } else {
                jbuf_putc(&b, p[i++]);
            }
        }
    }
    jv r = str_of(b.p, b.n);
    free(b.p);
    return r;
}

static jv str_split(jinja_ctx *c, const jnode *n, jv s, const jv *sep, int64_t maxsplit) {
    jv l = jv_list(0);
    const char *p = s.u.s->data;
    size_t len = s.u.s->len;
    if (sep == NULL || sep->t == JV_NONE) {
        size_t i = 0, cl;
        int64_t splits = 0;
        while (i < len) {
            while (i < len && py_isspace_at(p, len, i, &cl)) i += cl;
            if (i >= len) break;
            if (maxsplit >= 0 && splits >= maxsplit) {
                size_t e = len;
                while (e > i) {
                    size_t k = e - 1;
                    while (k > i && ((unsigned char)p[k] & 0xc0) == 0x80) k--;
                    if (!py_isspace_at(p, len, k, &cl)) break;
                    e = k;
                }
                jv_list_push(l, str_of(p + i, e - i));
                break;
            }
            size_t st = i;
            while (i < len && !py_isspace_at(p, len, i, &cl)) i += cl;
            jv_list_push(l, str_of(p + st, i - st));
            splits++;
        }
        return l;
    }
    if (sep->t != JV_STR || sep->u.s->len == 0) {
        jv_release(l);
        fail(c, n, "split(): separator must be a non-empty string");
        return jv_undef();
    }
    size_t sl = sep->u.s->len, st = 0;
    int64_t splits = 0;
    for (size_t i = 0; i + sl <= len;) {
        if ((maxsplit < 0 || splits < maxsplit) && memcmp(p + i, sep->u.s->data, sl) == 0) {
            jv_list_push(l, str_of(p + st, i - st));
            i += sl;
            st = i;
            splits++;
        } else {
            i++;
        }
    }
    jv_list_push(l, str_of(p + st, len - st));
    return l;
}

static bool str_starts(jv s, jv pre, bool end) {
    if (pre.t == JV_LIST) {
        for (size_t i = 0; i < pre.u.l->n; i++)
            if (pre.u.l->items[i].t == JV_STR && str_starts(s, pre.u.l->items[i], end)) return true;
        return false;
    }
    if (pre.t != JV_STR || pre.u.s->len > s.u.s->len) return false;
    size_t off = end ? s.u.s->len - pre.u.s->len : 0;
    return memcmp(s.u.s->data + off, pre.u.s->data, pre.u.s->len) == 0;
}

static jv str_title(jv s, bool capitalize_only) {
    jv r = str_of(s.u.s->data, s.u.s->len);
    bool start = true;
    for (size_t i = 0; i < r.u.s->len; i++) {
        char ch = r.u.s->data[i];
        bool alpha = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z');
        if (capitalize_only) {
            if (i == 0 && ch >= 'a' && ch <= 'z') r.u.s->data[i] = (char)(ch - 32);
            else if (i > 0 && ch >= 'A' && ch <= 'Z') r.u.s->data[i] = (char)(ch + 32);
            continue;
        }
        if (alpha) {
            if (start && ch >= 'a' && ch <= 'z') r.u.s->data[i] = (char)(ch - 32);
            if (!start && ch >= 'A' && ch <= 'Z') r.u.s->data[i] = (char)(ch + 32);
            start = false;
        } else {
            start = !((unsigned char)ch & 0x80) ? true : start;
        }
    }
    return r;
}

/* ---- methods (bound callables) ---- */

typedef enum {
    M_STRIP, M_LSTRIP, M_RSTRIP, M_SPLIT, M_STARTSWITH, M_ENDSWITH, M_UPPER, M_LOWER, M_REPLACE,
    M_TITLE, M_CAPITALIZE, M_FIND, M_COUNT, M_FORMAT, M_JOIN,
    M_GET, M_ITEMS, M_KEYS, M_VALUES, M_LIST_INDEX
} method_id;

static const struct { const char *name; method_id id; int on; } METHODS[] = {
    {"strip", M_STRIP, JV_STR}, {"lstrip", M_LSTRIP, JV_STR}, {"rstrip", M_RSTRIP, JV_STR},
    {"split", M_SPLIT, JV_STR}, {"startswith", M_STARTSWITH, JV_STR}, {"endswith", M_ENDSWITH, JV_STR},
    {"upper", M_UPPER, JV_STR}, {"lower", M_LOWER, JV_STR}, {"replace", M_REPLACE, JV_STR},
    {"title", M_TITLE, JV_STR}, {"capitalize", M_CAPITALIZE, JV_STR}, {"find", M_FIND, JV_STR},
    {"count", M_COUNT, JV_STR}, {"join", M_JOIN, JV_STR},
    {"get", M_GET, JV_DICT}, {"items", M_ITEMS, JV_DICT}, {"keys", M_KEYS, JV_DICT},
    {"values", M_VALUES, JV_DICT}, {"index", M_LIST_INDEX, JV_LIST}, {NULL, 0, 0}
};

static jv dict_items(jv d) {
    jv l = jv_list(d.u.d->n);
    for (size_t i = 0; i < d.u.d->n; i++) {
        jv pair = jv_list(2);
        pair.u.l->is_tuple = true;
        jv_list_push(pair, str_of(d.u.d->keys[i]->data, d.u.d->keys[i]->len));
        jv_list_push(pair, jv_retain(d.u.d->vals[i]));
        jv_list_push(l, pair);
    }
    return l;
}

static jv call_method(jinja_ctx *c, jv self, const jargs *a, void *data) {
    method_id id = (method_id)(intptr_t)data;
    const jnode *n = c->call_node;
    const jv *a0 = arg_at(a, 0, NULL), *a1 = arg_at(a, 1, NULL);
    switch (id) {
    case M_STRIP: return do_strip(self, a0 && a0->t != JV_NONE ? a0 : NULL, true, true);
    case M_LSTRIP: return do_strip(self, a0 && a0->t != JV_NONE ? a0 : NULL, true, false);
    case M_RSTRIP: return do_strip(self, a0 && a0->t != JV_NONE ? a0 : NULL, false, true);
    case M_SPLIT: {
        const jv *sep = arg_at(a, 0, "sep"), *mx = arg_at(a, 1, "maxsplit");
        return str_split(c, n, self, sep, mx && mx->t == JV_INT ? mx->u.i : -1);
    }
    case M_STARTSWITH:
    case M_ENDSWITH:
        if (a0 == NULL || (a0->t != JV_STR && a0->t != JV_LIST)) {
            fail(c, n, "%s() argument must be str or a tuple of str", id == M_STARTSWITH ? "startswith" : "endswith");
            return jv_undef();
        }
        return jv_bool(str_starts(self, *a0, id == M_ENDSWITH));
    case M_UPPER: return str_lower_upper(self, true);
    case M_LOWER: return str_lower_upper(self, false);
    case M_TITLE: return str_title(self, false);
    case M_CAPITALIZE: return str_title(self, true);
    case M_REPLACE: {
        const jv *cnt = arg_at(a, 2, "count");
        if (a0 == NULL || a1 == NULL || a0->t != JV_STR || a1->t != JV_STR) {
            fail(c, n, "replace() arguments must be strings");
            return jv_undef();
        }
        return str_replace(self, *a0, *a1, cnt && cnt->t == JV_INT ? cnt->u.i : -1);
    }
    case M_FIND:
    case M_COUNT: {
        if (a0 == NULL || a0->t != JV_STR) {
            fail(c, n, "argument must be a string");
            return jv_undef();
        }
        const char *p = self.u.s->data;
        size_t len = self.u.s->len, sl = a0->u.s->len;
        int64_t cnt = 0;
        for (size_t i = 0; i + sl <= len;) {
            if (memcmp(p + i, a0->u.s->data, sl) == 0) {
                if (id == M_FIND) return jv_int((int64_t)utf8_cp_count(p, i));
                cnt++;
                i += sl ? sl : 1;
            } else {
                i++;
            }
        }
        return jv_int(id == M_FIND ? -1 : cnt);
    }
    case M_JOIN: {
        if (a0 == NULL || a0->t != JV_LIST) {
            fail(c, n, "join() argument must be a list");
            return jv_undef();
        }
        jbuf b = {0};
        jbuf_put(&b, "", 0);
        for (size_t i = 0; i < a0->u.l->n; i++) {
            if (i) jbuf_put(&b, self.u.s->data, self.u.s->len);
            jv_str_into(&b, a0->u.l->items[i]);
        }
        jv r = str_of(b.p, b.n);
        free(b.p);
        return r;
    }
    case M_GET: {
        if (a0 == NULL || a0->t != JV_STR) return a1 ? jv_retain(*a1) : jv_none();
        const jv *v = jv_dict_get(self, a0->u.s->data, a0->u.s->len);
        if (v) return jv_retain(*v);
        return a1 ? jv_retain(*a1) : jv_none();
    }
    case M_ITEMS: return dict_items(self);
    case M_KEYS:
    case M_VALUES: {
        jv l = jv_list(self.u.d->n);
        for (size_t i = 0; i < self.u.d->n; i++)
            jv_list_push(l, id == M_KEYS ? str_of(self.u.d->keys[i]->data, self.u.d->keys[i]->len)
                                         : jv_retain(self.u.d->vals[i]));
        return l;
    }
    case M_LIST_INDEX:
        for (size_t i = 0; a0 && i < self.u.l->n; i++)
            if (jv_equal(self.u.l->items[i], *a0)) return jv_int((int64_t)i);
        fail(c, n, "value is not in list");
        return jv_undef();
    case M_FORMAT: break;
    }
    fail(c, n, "unsupported method");
    return jv_undef();
}

static bool find_method(jv obj, const char *name, jv *out) {
    for (int i = 0; METHODS[i].name; i++) {
        if ((int)obj.t == METHODS[i].on && strcmp(METHODS[i].name, name) == 0) {
            *out = jv_func(METHODS[i].name, call_method, (void *)(intptr_t)METHODS[i].id);
            out->u.fn->bound = jv_retain(obj);
            return true;
        }
    }
    return false;
}

/* ---- attribute / item access ---- */

static jv undef_named(const char *name) {
    jv u = jv_undef();
    u.undef_name = name;
    return u;
}

static jv get_item(jinja_ctx *c, const jnode *n, jv obj, jv key) {
    switch (obj.t) {
    case JV_UNDEF:
        fail(c, n, "'%s' is undefined", obj.undef_name ? obj.undef_name : "value");
        return jv_undef();
    case JV_DICT:
        if (key.t == JV_STR) {
            const jv *v = jv_dict_get(obj, key.u.s->data, key.u.s->len);
            if (v) return jv_retain(*v);
            jv m;
            if (!obj.u.d->is_ns && find_method(obj, key.u.s->data, &m)) return m;
        }
        return jv_undef();
    case JV_LIST:
        if (key.t == JV_INT || key.t == JV_BOOL) {
            int64_t i = key.t == JV_INT ? key.u.i : key.u.b, len = (int64_t)obj.u.l->n;
            if (i < 0) i += len;
            if (i < 0 || i >= len) return jv_undef();
            return jv_retain(obj.u.l->items[i]);
        }
        if (key.t == JV_STR) {
            jv m;
            if (find_method(obj, key.u.s->data, &m)) return m;
        }
        return jv_undef();
    case JV_STR:
        if (key.t == JV_INT) {
            int64_t len = (int64_t)utf8_cp_count(obj.u.s->data, obj.u.s->len), i = key.u.i;
            if (i < 0) i += len;
            if (i < 0 || i >= len) return jv_undef();
            size_t a = utf8_cp_offset(obj.u.s->data, obj.u.s->len, (size_t)i);
            size_t b = utf8_cp_offset(obj.u.s->data, obj.u.s->len, (size_t)i + 1);
            return str_of(obj.u.s->data + a, b - a);
        }
        if (key.t == JV_STR) {
            jv m;
            if (find_method(obj, key.u.s->data, &m)) return m;
        }
        return jv_undef();
    default:
        return jv_undef();
    }
}

static jv get_attr(jinja_ctx *c, const jnode *n, jv obj, const char *name) {
    if (obj.t == JV_UNDEF) {
        fail(c, n, "'%s' is undefined", obj.undef_name ? obj.undef_name : "value");
        return jv_undef();
    }
    jv m;
    if (obj.t == JV_DICT && !obj.u.d->is_ns && find_method(obj, name, &m)) return m;
    if (obj.t == JV_DICT) {
        const jv *v = jv_dict_get(obj, name, strlen(name));
        return v ? jv_retain(*v) : undef_named(name);
    }
    if ((obj.t == JV_STR || obj.t == JV_LIST) && find_method(obj, name, &m)) return m;
    return undef_named(name);
}

static int64_t clamp_idx(int64_t i, int64_t len, bool neg_step) {
    if (i < 0) {
        i += len;
        if (i < 0) i = neg_step ? -1 : 0;
    } else if (i >= len) {
        i = neg_step ? len - 1 : len;
    }
    return i;
}

static jv do_slice(jinja_ctx *c, const jnode *n, jv obj, const jv *start, const jv *stop, const jv *step) {
    int64_t st = step && step->t == JV_INT ? step->u.i : 1;
    if (st == 0) {
        fail(c, n, "slice step cannot be zero");
        return jv_undef();
    }
    bool is_str = obj.t == JV_STR;
    if (!is_str && obj.t != JV_LIST) {
        fail(c, n, "'%s' object is not subscriptable", jv_type_name(obj));
        return jv_undef();
    }
    int64_t len = is_str ? (int64_t)utf8_cp_count(obj.u.s->data, obj.u.s->len) : (int64_t)obj.u.l->n;
    int64_t a, b;
    if (start && start->t == JV_INT) a = clamp_idx(start->u.i, len, st < 0);
    else a = st > 0 ? 0 : len - 1;
    if (stop && stop->t == JV_INT) b = clamp_idx(stop->u.i, len, st < 0);
    else b = st > 0 ? len : -1;
    if (is_str) {
        jbuf buf = {0};
        jbuf_put(&buf, "", 0);
        const char *p = obj.u.s->data;
        size_t plen = obj.u.s->len;
        if (st == 1 && a < b) {
            size_t x = utf8_cp_offset(p, plen, (size_t)a), y = utf8_cp_offset(p, plen, (size_t)b);
            jbuf_put(&buf, p + x, y - x);
        } else {
            for (int64_t i = a; st > 0 ? i < b : i > b;) {
                size_t x = utf8_cp_offset(p, plen, (size_t)i), y = utf8_cp_offset(p, plen, (size_t)i + 1);
                jbuf_put(&buf, p + x, y - x);
                if (__builtin_add_overflow(i, st, &i)) break;
            }
        }
        jv r = str_of(buf.p, buf.n);
        free(buf.p);
        return r;
    }
    jv l = jv_list(0);
    for (int64_t i = a; st > 0 ? i < b : i > b;) {
        jv_list_push(l, jv_retain(obj.u.l->items[i]));
        if (__builtin_add_overflow(i, st, &i)) break;
    }
    return l;
}

/* ---- iteration ---- */

/* A list to iterate over (new reference): lists as-is, dicts by key,
 * strings by character, undefined/none as empty (none is an error). */
static jv as_iterable(jinja_ctx *c, const jnode *n, jv v) {
    switch (v.t) {
    case JV_LIST: return jv_retain(v);
    case JV_UNDEF: return jv_list(0);
    case JV_DICT: {
        jv l = jv_list(v.u.d->n);
        for (size_t i = 0; i < v.u.d->n; i++)
            jv_list_push(l, str_of(v.u.d->keys[i]->data, v.u.d->keys[i]->len));
        return l;
    }
    case JV_STR: {
        jv l = jv_list(0);
        size_t len = v.u.s->len;
        for (size_t i = 0; i < len;) {
            size_t j = utf8_cp_offset(v.u.s->data + i, len - i, 1);
            jv_list_push(l, str_of(v.u.s->data + i, j));
            i += j;
        }
        return l;
    }
    default:
        fail(c, n, "'%s' object is not iterable", jv_type_name(v));
        return jv_undef();
    }
}

/* ---- arithmetic and comparison ---- */

static bool is_num(jv v) { return v.t == JV_INT || v.t == JV_FLOAT || v.t == JV_BOOL; }
static double fval(jv v) { return v.t == JV_FLOAT ? v.u.f : v.t == JV_INT ? (double)v.u.i : (double)v.u.b; }
static int64_t ival(jv v) { return v.t == JV_INT ? v.u.i : (int64_t)v.u.b; }

static int compare(jinja_ctx *c, const jnode *n, jv a, jv b, bool *ok) {
    *ok = true;
    if (is_num(a) && is_num(b)) {
        if (a.t != JV_FLOAT && b.t != JV_FLOAT) return ival(a) < ival(b) ? -1 : ival(a) > ival(b);
        double x = fval(a), y = fval(b);
        return x < y ? -1 : x > y;
    }
    if (a.t == JV_STR && b.t == JV_STR) {
        size_t m = a.u.s->len < b.u.s->len ? a.u.s->len : b.u.s->len;
        int r = memcmp(a.u.s->data, b.u.s->data, m);
        if (r) return r < 0 ? -1 : 1;
        return a.u.s->len < b.u.s->len ? -1 : a.u.s->len > b.u.s->len;
    }
    if (a.t == JV_LIST && b.t == JV_LIST) {
        size_t m = a.u.l->n < b.u.l->n ? a.u.l->n : b.u.l->n;
        for (size_t i = 0; i < m; i++) {
            if (jv_equal(a.u.l->items[i], b.u.l->items[i])) continue;
            return compare(c, n, a.u.l->items[i], b.u.l->items[i], ok);
        }
        return a.u.l->n < b.u.l->n ? -1 : a.u.l->n > b.u.l->n;
    }
    *ok = false;
    fail(c, n, "'<' not supported between instances of '%s' and '%s'", jv_type_name(a), jv_type_name(b));
    return 0;
}

static bool contains(jinja_ctx *c, const jnode *n, jv hay, jv needle) {
    switch (hay.t) {
    case JV_STR:
        if (needle.t != JV_STR) {
            fail(c, n, "'in <string>' requires string as left operand, not %s", jv_type_name(needle));
            return false;
        }
        if (needle.u.s->len == 0) return true;
        if (needle.u.s->len > hay.u.s->len) return false;
        for (size_t i = 0; i + needle.u.s->len <= hay.u.s->len; i++)
            if (memcmp(hay.u.s->data + i, needle.u.s->data, needle.u.s->len) == 0) return true;
        return false;
    case JV_LIST:
        for (size_t i = 0; i < hay.u.l->n; i++)
            if (jv_equal(hay.u.l->items[i], needle)) return true;
        return false;
    case JV_DICT:
        return needle.t == JV_STR && jv_dict_get(hay, needle.u.s->data, needle.u.s->len) != NULL;
    case JV_UNDEF:
        fail(c, n, "'%s' is undefined", hay.undef_name ? hay.undef_name : "value");
        return false;
    default:
        fail(c, n, "argument of type '%s' is not iterable", jv_type_name(hay));
        return false;
    }
}

static jv binop(jinja_ctx *c, const jnode *n, int op, jv a, jv b) {
    bool ok;
    switch (op) {
    case OP_EQ: return jv_bool(jv_equal(a, b));
    case OP_NE: return jv_bool(!jv_equal(a, b));
    case OP_LT: { int r = compare(c, n, a, b, &ok); return jv_bool(ok && r < 0); }
    case OP_GT: { int r = compare(c, n, a, b, &ok); return jv_bool(ok && r > 0); }
    case OP_LE: { int r = compare(c, n, a, b, &ok); return jv_bool(ok && r <= 0); }
    case OP_GE: { int r = compare(c, n, a, b, &ok); return jv_bool(ok && r >= 0); }
    case OP_IN: return jv_bool(contains(c, n, b, a));
    case OP_NOTIN: { bool r = contains(c, n, b, a); return jv_bool(!c->failed && !r); }
    case OP_CONCAT: {
        jbuf buf = {0};
        jbuf_put(&buf, "", 0);
        jv_str_into(&buf, a);
        jv_str_into(&buf, b);
        jv r = str_of(buf.p, buf.n);
        free(buf.p);
        return r;
    }
    default: break;
    }
    if (a.t == JV_UNDEF || b.t == JV_UNDEF) {
        jv u = a.t == JV_UNDEF ? a : b;
        fail(c, n, "'%s' is undefined", u.undef_name ? u.undef_name : "value");
        return jv_undef();
    }
    if (op == OP_ADD && a.t == JV_STR && b.t == JV_STR) {
        jv r = jv_str(NULL, 0);
        jv_release(r);
        jbuf buf = {0};
        jbuf_put(&buf, a.u.s->data, a.u.s->len);
        jbuf_put(&buf, b.u.s->data, b.u.s->len);
        r = str_of(buf.p, buf.n);
        free(buf.p);
        return r;
    }
    if (op == OP_ADD && a.t == JV_LIST && b.t == JV_LIST) {
        jv r = jv_list(a.u.l->n + b.u.l->n);
        for (size_t i = 0; i < a.u.l->n; i++) jv_list_push(r, jv_retain(a.u.l->items[i]));
        for (size_t i = 0; i < b.u.l->n; i++) jv_list_push(r, jv_retain(b.u.l->items[i]));
        return r;
    }
    if (op == OP_MUL && ((a.t == JV_STR && b.t == JV_INT) || (a.t == JV_INT && b.t == JV_STR))) {
        jv s = a.t == JV_STR ? a : b;
        int64_t k = a.t == JV_INT ? a.u.i : b.u.i;
        jbuf buf = {0};
        jbuf_put(&buf, "", 0);
        for (int64_t i = 0; i < k && i < 1000000; i++) jbuf_put(&buf, s.u.s->data, s.u.s->len);
        jv r = str_of(buf.p, buf.n);
        free(buf.p);
        return r;
    }
    if (!is_num(a) || !is_num(b)) {
        static const char *const sym[] = {"+", "-", "*", "/", "//", "%", "**"};
        fail(c, n, "unsupported operand type(s) for %s: '%s' and '%s'", op <= OP_POW ? sym[op] : "?",
             jv_type_name(a), jv_type_name(b));
        return jv_undef();
    }
    bool fl = a.t == JV_FLOAT || b.t == JV_FLOAT;
    switch (op) {
    case OP_ADD:
    case OP_SUB:
    case OP_MUL: {
        if (fl) {
            double x = fval(a), y = fval(b);
            return jv_float(op == OP_ADD ? x + y : op == OP_SUB ? x - y : x * y);
        }
        /* Python's ints are unbounded, ours are 64-bit: overflow is an error. */
        int64_t r;
        bool over = op == OP_ADD   ? __builtin_add_overflow(ival(a), ival(b), &r)
                    : op == OP_SUB ? __builtin_sub_overflow(ival(a), ival(b), &r)
                                   : __builtin_mul_overflow(ival(a), ival(b), &r);
        if (over) {
            fail(c, n, "integer overflow (ints are 64-bit here)");
            return jv_undef();
        }
        return jv_int(r);
    }
    case OP_DIV:
        if (fval(b) == 0.0) { fail(c, n, "division by zero"); return jv_undef(); }
        return jv_float(fval(a) / fval(b));
    case OP_FLOORDIV:
    case OP_MOD:
        if (fval(b) == 0.0) { fail(c, n, "integer division or modulo by zero"); return jv_undef(); }
        if (fl) {
            double q = floor(fval(a) / fval(b));
            return op == OP_FLOORDIV ? jv_float(q) : jv_float(fval(a) - q * fval(b));
        } else {
            int64_t x = ival(a), y = ival(b);
            if (x == INT64_MIN && y == -1) {
                fail(c, n, "integer overflow (ints are 64-bit here)");
                return jv_undef();
            }
            int64_t q = x / y, r = x % y;
            if (r != 0 && ((r < 0) != (y < 0))) { q--; r += y; }
            return op == OP_FLOORDIV ? jv_int(q) : jv_int(r);
        }
    case OP_POW:
        if (!fl && ival(b) >= 0) {
            int64_t r = 1;
            for (int64_t i = 0; i < ival(b) && i < 64; i++)
                if (__builtin_mul_overflow(r, ival(a), &r)) {
                    fail(c, n, "integer overflow (ints are 64-bit here)");
                    return jv_undef();
                }
            return jv_int(r);
        }
        return jv_float(pow(fval(a), fval(b)));
    default: break;
    }
    return jv_undef();
}

/* ---- calls ---- */

static jv call_macro(jinja_ctx *c, const jnode *call, const jnode *m, const jargs *a);

static jv call_value(jinja_ctx *c, const jnode *call, jv f, const jargs *a) {
    if (f.t != JV_FUNC) {
        if (f.t == JV_UNDEF) fail(c, call, "'%s' is undefined", f.undef_name ? f.undef_name : "value");
        else fail(c, call, "'%s' object is not callable", jv_type_name(f));
        return jv_undef();
    }
    if (f.u.fn->macro) return call_macro(c, call, f.u.fn->macro, a);
    const jnode *saved = c->call_node;
    c->call_node = call;
    jv r = f.u.fn->fn(c, f.u.fn->bound, a, f.u.fn->data);
    c->call_node = saved;
    return r;
}

static void eval_args(jinja_ctx *c, const jnode *n, jargs *a) {
    a->npos = n->nkids;
    a->nkw = n->nnames;
    a->pos = calloc(n->nkids + 1, sizeof(jv));
    a->kw = calloc(n->nnames + 1, sizeof(jv));
    a->kw_names = (const char **)n->names;
    if (a->pos == NULL || a->kw == NULL) abort();
    for (size_t i = 0; i < n->nkids; i++) a->pos[i] = eval(c, n->kids[i]);
    for (size_t i = 0; i < n->nnames; i++) a->kw[i] = eval(c, n->kids2[i]);
}

static void free_args(jargs *a) {
    for (size_t i = 0; i < a->npos; i++) jv_release(a->pos[i]);
    for (size_t i = 0; i < a->nkw; i++) jv_release(a->kw[i]);
    free(a->pos);
    free(a->kw);
}

static jv call_macro(jinja_ctx *c, const jnode *call, const jnode *m, const jargs *a) {
    if (c->depth > 200) {
        fail(c, call, "macro recursion too deep");
        return jv_undef();
    }
    scope s = {.parent = c->root, .vars = jv_dict(m->nnames)};
    if (a->npos > m->nnames) {
        jv_release(s.vars);
        fail(c, call, "macro '%s' takes not more than %zu argument(s)", m->name, m->nnames);
        return jv_undef();
    }
    scope *saved_cur = c->cur;
    c->cur = &s; /* defaults see earlier parameters */
    for (size_t i = 0; i < m->nnames; i++) {
        jv v = jv_undef();
        bool have = false;
        if (i < a->npos) {
            v = jv_retain(a->pos[i]);
            have = true;
        } else {
            const jv *kw = arg_kw(a, m->names[i]);
            if (kw) {
                v = jv_retain(*kw);
                have = true;
            }
        }
        if (!have && m->kids2[i]) v = eval(c, m->kids2[i]);
        if (!have && !m->kids2[i]) v = undef_named(m->names[i]);
        jv_dict_set(s.vars, m->names[i], strlen(m->names[i]), v);
    }
    for (size_t i = 0; i < a->nkw; i++) {
        bool known = false;
        for (size_t k = 0; k < m->nnames; k++)
            if (strcmp(a->kw_names[i], m->names[k]) == 0) known = true;
        if (!known) {
            c->cur = saved_cur;
            jv_release(s.vars);
            fail(c, call, "macro '%s' takes no keyword argument '%s'", m->name, a->kw_names[i]);
            return jv_undef();
        }
    }
    jbuf out = {0};
    jbuf_put(&out, "", 0);
    jbuf *saved_out = c->out;
    int saved_ctl = c->loopctl;
    c->out = &out;
    c->depth++;
    exec_body(c, m->kids, m->nkids);
    c->depth--;
    c->out = saved_out;
    c->cur = saved_cur;
    c->loopctl = saved_ctl;
    jv_release(s.vars);
    jv r = str_of(out.p, out.n);
    free(out.p);
    return r;
}

/* ---- filters ---- */

static jv apply_filter_named(jinja_ctx *c, const jnode *n, const char *name, jv v, const jargs *a);
static bool apply_test_named(jinja_ctx *c, const jnode *n, const char *name, jv v, const jargs *a);

static int64_t length_of(jv v) {
    switch (v.t) {
    case JV_STR: return (int64_t)utf8_cp_count(v.u.s->data, v.u.s->len);
    case JV_LIST: return (int64_t)v.u.l->n;
    case JV_DICT: return (int64_t)v.u.d->n;
    default: return 0;
    }
}

/* obj.attr for map/selectattr/join attribute=: dotted paths, ints as items */
static jv attr_path(jinja_ctx *c, const jnode *n, jv obj, jv attr) {
    if (attr.t == JV_INT) return get_item(c, n, obj, attr);
    if (attr.t != JV_STR) return jv_undef();
    jv curv = jv_retain(obj);
    const char *s = attr.u.s->data;
    size_t len = attr.u.s->len, st = 0;
    for (size_t i = 0; i <= len; i++) {
        if (i == len || s[i] == '.') {
            jv key = str_of(s + st, i - st);
            jv next = curv.t == JV_UNDEF ? jv_undef() : get_item(c, n, curv, key);
            jv_release(key);
            jv_release(curv);
            curv = next;
            st = i + 1;
        }
    }
    return curv;
}

static jv f_select_common(jinja_ctx *c, const jnode *n, jv v, const jargs *a, bool by_attr, bool keep) {
    jv it = as_iterable(c, n, v);
    if (c->failed) return jv_undef();
    jv out = jv_list(0);
    size_t first = by_attr ? 1 : 0;
    const char *test = NULL;
    if (a->npos > first && a->pos[first].t == JV_STR) test = a->pos[first].u.s->data;
    jargs targs = {0};
    if (a->npos > first + 1) {
        targs.npos = a->npos - first - 1;
        targs.pos = a->pos + first + 1;
    }
    for (size_t i = 0; i < it.u.l->n && !c->failed; i++) {
        jv item = it.u.l->items[i];
        jv subject = by_attr ? attr_path(c, n, item, a->npos ? a->pos[0] : jv_undef()) : jv_retain(item);
        bool r = test ? apply_test_named(c, n, test, subject, &targs) : jv_truthy(subject);
        jv_release(subject);
        if (r == keep) jv_list_push(out, jv_retain(item));
    }
    jv_release(it);
    return out;
}

static jv apply_filter_named(jinja_ctx *c, const jnode *n, const char *name, jv v, const jargs *a) {
    const jv *a0 = arg_at(a, 0, NULL);
    if (strcmp(name, "trim") == 0 || strcmp(name, "strip") == 0) {
        jv s = jv_to_str(v);
        jv r = do_strip(s, a0 && a0->t == JV_STR ? a0 : NULL, true, true);
        jv_release(s);
        return r;
    }
    if (strcmp(name, "length") == 0 || strcmp(name, "count") == 0) {
        if (v.t == JV_INT || v.t == JV_FLOAT || v.t == JV_BOOL || v.t == JV_NONE) {
            fail(c, n, "object of type '%s' has no len()", jv_type_name(v));
            return jv_undef();
        }
        return jv_int(length_of(v));
    }
    if (strcmp(name, "tojson") == 0) {
        const jv *ind = arg_at(a, 0, "indent"), *ea = arg_kw(a, "ensure_ascii"), *sk = arg_kw(a, "sort_keys");
        /* Past 1000 columns an indent only multiplies the output (and indent x level overflows). */
        int indent = ind && ind->t == JV_INT ? (int)(ind->u.i < -1 ? -1 : ind->u.i > 1000 ? 1000 : ind->u.i) : -1;
        jbuf b = {0};
        jbuf_put(&b, "", 0);
        const char *msg = NULL;
        if (jv_to_json(&b, v, ea && jv_truthy(*ea), indent, sk && jv_truthy(*sk), &msg) != 0) {
            free(b.p);
            fail(c, n, "tojson: %s", msg);
            return jv_undef();
        }
        jv r = str_of(b.p, b.n);
        free(b.p);
        return r;
    }
    if (strcmp(name, "string") == 0) {
        if (v.t == JV_UNDEF) return str_of("", 0);
        return jv_to_str(v);
    }
    if (strcmp(name, "safe") == 0 || strcmp(name, "e") == 0 || strcmp(name, "escape") == 0 ||
        strcmp(name, "list") == 0) {
        if (strcmp(name, "list") == 0) return as_iterable(c, n, v);
        if (strcmp(name, "safe") == 0) return jv_retain(v);
        /* autoescape is off in transformers; escape still escapes */
        jv s = jv_to_str(v);
        jbuf b = {0};
        jbuf_put(&b, "", 0);
        for (size_t i = 0; i < s.u.s->len; i++) {
            char ch = s.u.s->data[i];
            if (ch == '&') jbuf_puts(&b, "&amp;");
            else if (ch == '<') jbuf_puts(&b, "&lt;");
            else if (ch == '>') jbuf_puts(&b, "&gt;");
            else if (ch == '"') jbuf_puts(&b, "&#34;");
            else if (ch == '\'') jbuf_puts(&b, "&#39;");
            else jbuf_putc(&b, ch);
        }
        jv_release(s);
        jv r = str_of(b.p, b.n);
        free(b.p);
        return r;
    }
    if (strcmp(name, "lower") == 0 || strcmp(name, "upper") == 0 || strcmp(name, "capitalize") == 0 ||
        strcmp(name, "title") == 0) {
        jv s = jv_to_str(v);
        jv r = name[0] == 'l' ? str_lower_upper(s, false) : name[0] == 'u' ? str_lower_upper(s, true)
             : str_title(s, name[0] == 'c');
        jv_release(s);
        return r;
    }
    if (strcmp(name, "default") == 0 || strcmp(name, "d") == 0) {
        const jv *dv = arg_at(a, 0, "default_value"), *bo = arg_at(a, 1, "boolean");
        bool use = v.t == JV_UNDEF || (bo && jv_truthy(*bo) && !jv_truthy(v));
        if (use) return dv ? jv_retain(*dv) : str_of("", 0);
        return jv_retain(v);
    }
    if (strcmp(name, "join") == 0) {
        const jv *sep = arg_at(a, 0, "d"), *attr = arg_kw(a, "attribute");
        jv it = as_iterable(c, n, v);
        if (c->failed) return jv_undef();
        jbuf b = {0};
        jbuf_put(&b, "", 0);
        for (size_t i = 0; i < it.u.l->n; i++) {
            if (i && sep) jv_str_into(&b, *sep);
            jv item = attr ? attr_path(c, n, it.u.l->items[i], *attr) : jv_retain(it.u.l->items[i]);
            jv_str_into(&b, item);
            jv_release(item);
        }
        jv_release(it);
        jv r = str_of(b.p, b.n);
        free(b.p);
        return r;
    }
    if (strcmp(name, "first") == 0 || strcmp(name, "last") == 0) {
        jv it = as_iterable(c, n, v);
        if (c->failed) return jv_undef();
        jv r = jv_undef();
        if (it.u.l->n) r = jv_retain(it.u.l->items[name[0] == 'f' ? 0 : it.u.l->n - 1]);
        jv_release(it);
        return r;
    }
    if (strcmp(name, "reverse") == 0) {
        if (v.t == JV_STR) {
            jv m1 = jv_int(-1);
            jv r = do_slice(c, n, v, NULL, NULL, &m1);
            return r;
        }
        jv it = as_iterable(c, n, v);
        if (c->failed) return jv_undef();
        jv r = jv_list(it.u.l->n);
        for (size_t i = it.u.l->n; i > 0; i--) jv_list_push(r, jv_retain(it.u.l->items[i - 1]));
        jv_release(it);
        return r;
    }
    if (strcmp(name, "map") == 0) {
        const jv *attr = arg_kw(a, "attribute"), *dflt = arg_kw(a, "default");
        jv it = as_iterable(c, n, v);
        if (c->failed) return jv_undef();
        jv r = jv_list(it.u.l->n);
        for (size_t i = 0; i < it.u.l->n && !c->failed; i++) {
            jv item = it.u.l->items[i];
            if (attr) {
                jv x = attr_path(c, n, item, *attr);
                if (x.t == JV_UNDEF && dflt) {
                    jv_release(x);
                    x = jv_retain(*dflt);
                }
                jv_list_push(r, x);
            } else if (a->npos && a->pos[0].t == JV_STR) {
                jargs rest = {.npos = a->npos - 1, .pos = a->pos + 1, .nkw = a->nkw, .kw = a->kw,
                              .kw_names = a->kw_names};
                jv_list_push(r, apply_filter_named(c, n, a->pos[0].u.s->data, item, &rest));
            } else {
                jv_list_push(r, jv_retain(item));
            }
        }
        jv_release(it);
        return r;
    }
    if (strcmp(name, "selectattr") == 0) return f_select_common(c, n, v, a, true, true);
    if (strcmp(name, "rejectattr") == 0) return f_select_common(c, n, v, a, true, false);
    if (strcmp(name, "select") == 0) return f_select_common(c, n, v, a, false, true);
    if (strcmp(name, "reject") == 0) return f_select_common(c, n, v, a, false, false);
    if (strcmp(name, "items") == 0) {
        if (v.t == JV_UNDEF) return jv_list(0);
        if (v.t != JV_DICT) {
            fail(c, n, "items filter: can only get item pairs from a mapping, not '%s'", jv_type_name(v));
            return jv_undef();
        }
        return dict_items(v);
    }
    if (strcmp(name, "dictsort") == 0) {
        if (v.t != JV_DICT) {
            fail(c, n, "dictsort: argument must be a mapping");
            return jv_undef();
        }
        jv r = dict_items(v);
        jlist *l = r.u.l;
        for (size_t i = 1; i < l->n; i++) /* insertion sort by key (case-insensitive default) */
            for (size_t j = i; j > 0; j--) {
                jv ka = str_lower_upper(l->items[j - 1].u.l->items[0], false);
                jv kb = str_lower_upper(l->items[j].u.l->items[0], false);
                bool ok;
                int cmp = compare(c, n, ka, kb, &ok);
                jv_release(ka);
                jv_release(kb);
                if (cmp <= 0) break;
                jv t = l->items[j];
                l->items[j] = l->items[j - 1];
                l->items[j - 1] = t;
            }
        return r;
    }
    if (strcmp(name, "replace") == 0) {
        const jv *a1 = arg_at(a, 1, "new"), *cnt = arg_at(a, 2, "count");
        if (a0 == NULL || a1 == NULL) {
            fail(c, n, "replace filter needs two arguments");
            return jv_undef();
        }
        jv s = jv_to_str(v), o = jv_to_str(*a0), nw = jv_to_str(*a1);
        jv r = str_replace(s, o, nw, cnt && cnt->t == JV_INT ? cnt->u.i : -1);
        jv_release(s);
        jv_release(o);
        jv_release(nw);
        return r;
    }
    if (strcmp(name, "int") == 0) {
        if (v.t == JV_INT) return v;
        /* Outside int64 (or NaN) the conversion fails: the filter's default. */
        if (v.t == JV_FLOAT && v.u.f > -0x1p63 && v.u.f < 0x1p63) return jv_int((int64_t)v.u.f);
        if (v.t == JV_FLOAT) return a0 ? jv_retain(*a0) : jv_int(0);
        if (v.t == JV_BOOL) return jv_int(v.u.b);
        if (v.t == JV_STR) {
            char *end;
            long long x = strtoll(v.u.s->data, &end, 10);
            if (end != v.u.s->data) return jv_int(x);
        }
        return a0 ? jv_retain(*a0) : jv_int(0);
    }
    if (strcmp(name, "float") == 0) {
        if (is_num(v)) return jv_float(fval(v));
        if (v.t == JV_STR) return jv_float(strtod(v.u.s->data, NULL));
        return jv_float(0.0);
    }
    if (strcmp(name, "abs") == 0) {
        if (v.t == JV_INT && v.u.i == INT64_MIN) {
            fail(c, n, "integer overflow (ints are 64-bit here)");
            return jv_undef();
        }
        if (v.t == JV_INT) return jv_int(v.u.i < 0 ? -v.u.i : v.u.i);
        if (v.t == JV_FLOAT) return jv_float(fabs(v.u.f));
    }
    if (strcmp(name, "unique") == 0 || strcmp(name, "sum") == 0 || strcmp(name, "min") == 0 ||
        strcmp(name, "max") == 0) {
        jv it = as_iterable(c, n, v);
        if (c->failed) return jv_undef();
        jv r;
        if (name[0] == 'u') {
            r = jv_list(0);
            for (size_t i = 0; i < it.u.l->n; i++) {
                bool seen = false;
                for (size_t k = 0; k < r.u.l->n; k++)
                    if (jv_equal(r.u.l->items[k], it.u.l->items[i])) seen = true;
                if (!seen) jv_list_push(r, jv_retain(it.u.l->items[i]));
            }
        } else if (name[0] == 's') {
            r = jv_int(0);
            for (size_t i = 0; i < it.u.l->n && !c->failed; i++) {
                jv t = binop(c, n, OP_ADD, r, it.u.l->items[i]);
                jv_release(r);
                r = t;
            }
        } else {
            r = jv_undef();
            for (size_t i = 0; i < it.u.l->n && !c->failed; i++) {
                bool ok;
                if (r.t == JV_UNDEF) { r = jv_retain(it.u.l->items[i]); continue; }
                int cmp = compare(c, n, it.u.l->items[i], r, &ok);
                if (ok && ((name[1] == 'i' && cmp < 0) || (name[1] == 'a' && cmp > 0))) {
                    jv_release(r);
                    r = jv_retain(it.u.l->items[i]);
                }
            }
        }
        jv_release(it);
        return r;
    }
    if (strcmp(name, "indent") == 0) {
        const jv *w = arg_at(a, 0, "width"), *first = arg_at(a, 1, "first"), *blank = arg_at(a, 2, "blank");
        jv s = jv_to_str(v);
        jbuf pad = {0};
        jbuf_put(&pad, "", 0);
        if (w && w->t == JV_STR) jbuf_put(&pad, w->u.s->data, w->u.s->len);
        else
            for (int64_t i = 0; i < (w && w->t == JV_INT ? w->u.i : 4) && i < 1000000; i++) jbuf_putc(&pad, ' ');
        jbuf b = {0};
        jbuf_put(&b, "", 0);
        const char *p = s.u.s->data;
        size_t len = s.u.s->len, st = 0;
        bool firstline = true;
        for (size_t i = 0; i <= len; i++) {
            if (i == len || p[i] == '\n') {
                bool empty = i == st;
                bool do_pad = firstline ? (first && jv_truthy(*first)) : (!empty || (blank && jv_truthy(*blank)));
                if (do_pad) jbuf_put(&b, pad.p, pad.n);
                jbuf_put(&b, p + st, i - st);
                if (i < len) jbuf_putc(&b, '\n');
                st = i + 1;
                firstline = false;
            }
        }
        jv r = str_of(b.p, b.n);
        free(b.p);
        free(pad.p);
        jv_release(s);
        return r;
    }
    fail(c, n, "unknown filter '%s'", name);
    return jv_undef();
}

/* ---- tests ---- */

static bool apply_test_named(jinja_ctx *c, const jnode *n, const char *name, jv v, const jargs *a) {
    const jv *a0 = arg_at(a, 0, NULL);
    if (strcmp(name, "defined") == 0) return v.t != JV_UNDEF;
    if (strcmp(name, "undefined") == 0) return v.t == JV_UNDEF;
    if (strcmp(name, "none") == 0) return v.t == JV_NONE;
    if (strcmp(name, "string") == 0) return v.t == JV_STR;
    if (strcmp(name, "mapping") == 0) return v.t == JV_DICT;
    if (strcmp(name, "iterable") == 0) return v.t == JV_STR || v.t == JV_LIST || v.t == JV_DICT || v.t == JV_UNDEF;
    if (strcmp(name, "sequence") == 0) return v.t == JV_STR || v.t == JV_LIST || v.t == JV_DICT;
    if (strcmp(name, "number") == 0) return v.t == JV_INT || v.t == JV_FLOAT || v.t == JV_BOOL;
    if (strcmp(name, "integer") == 0) return v.t == JV_INT;
    if (strcmp(name, "float") == 0) return v.t == JV_FLOAT;
    if (strcmp(name, "boolean") == 0) return v.t == JV_BOOL;
    if (strcmp(name, "true") == 0) return v.t == JV_BOOL && v.u.b;
    if (strcmp(name, "false") == 0) return v.t == JV_BOOL && !v.u.b;
    if (strcmp(name, "callable") == 0) return v.t == JV_FUNC;
    if (strcmp(name, "equalto") == 0 || strcmp(name, "eq") == 0 || strcmp(name, "==") == 0 ||
        strcmp(name, "sameas") == 0)
        return a0 && jv_equal(v, *a0);
    if (strcmp(name, "ne") == 0 || strcmp(name, "!=") == 0) return !(a0 && jv_equal(v, *a0));
    if (strcmp(name, "in") == 0) return a0 && contains(c, n, *a0, v);
    if (strcmp(name, "lower") == 0 || strcmp(name, "upper") == 0) {
        if (v.t != JV_STR) return false;
        jv t = str_lower_upper(v, name[0] == 'u');
        bool r = jv_equal(t, v);
        jv_release(t);
        return r;
    }
    if (strcmp(name, "even") == 0 || strcmp(name, "odd") == 0) {
        if (v.t != JV_INT) return false;
        return (v.u.i % 2 == 0) == (name[0] == 'e');
    }
    if (strcmp(name, "divisibleby") == 0) return v.t == JV_INT && a0 && a0->t == JV_INT && a0->u.i && v.u.i % a0->u.i == 0;
    if (strcmp(name, "gt") == 0 || strcmp(name, "lt") == 0 || strcmp(name, "ge") == 0 || strcmp(name, "le") == 0) {
        if (a0 == NULL) return false;
        bool ok;
        int cmp = compare(c, n, v, *a0, &ok);
        if (!ok) return false;
        return name[0] == 'g' ? (name[1] == 't' ? cmp > 0 : cmp >= 0) : (name[1] == 't' ? cmp < 0 : cmp <= 0);
    }
    fail(c, n, "unknown test '%s'", name);
    return false;
}

/* ---- expressions ---- */

/* Counts one evaluation step and checks both limits; false once failed. */
static bool step(jinja_ctx *c, const jnode *n) {
    if (c->failed) return false;
    c->steps += 1 + jinja_budget_take_work();
    if (c->steps > c->max_steps) {
        fail(c, n, "the template exceeded its step limit (%lld evaluation steps)", (long long)c->max_steps);
        return false;
    }
    if (jinja_budget_exceeded()) {
        fail(c, n, "the template exceeded its size limit (%zu bytes of output or values)", c->max_bytes);
        return false;
    }
    if (jinja_budget_too_deep()) {
        fail(c, n, "the template nested values more than %d levels deep", JINJA_MAX_DEPTH);
        return false;
    }
    return true;
}

static jv eval(jinja_ctx *c, const jnode *n) {
    if (n == NULL || !step(c, n)) return jv_undef();
    switch (n->kind) {
    case E_LIT: return jv_retain(n->lit);
    case E_NAME: {
        const jv *v = lookup(c, n->name);
        if (v) return jv_retain(*v);
        for (int i = 0; BUILTINS[i].name; i++)
            if (strcmp(BUILTINS[i].name, n->name) == 0) return jv_func(BUILTINS[i].name, BUILTINS[i].fn, NULL);
        return undef_named(n->name);
    }
    case E_ATTR: {
        jv o = eval(c, n->a);
        if (c->failed) { jv_release(o); return jv_undef(); }
        jv r = get_attr(c, n, o, n->name);
        jv_release(o);
        return r;
    }
    case E_ITEM: {
        jv o = eval(c, n->a);
        jv k = eval(c, n->b);
        jv r = c->failed ? jv_undef() : get_item(c, n, o, k);
        jv_release(o);
        jv_release(k);
        return r;
    }
    case E_SLICE: {
        jv o = eval(c, n->a);
        jv s = eval(c, n->b), e = eval(c, n->c), st = eval(c, n->d);
        jv r = jv_undef();
        if (!c->failed) {
            if (o.t == JV_UNDEF) fail(c, n, "'%s' is undefined", o.undef_name ? o.undef_name : "value");
            else r = do_slice(c, n, o, n->b ? &s : NULL, n->c ? &e : NULL, n->d ? &st : NULL);
        }
        jv_release(o);
        jv_release(s);
        jv_release(e);
        jv_release(st);
        return r;
    }
    case E_CALL: {
        jv f = eval(c, n->a);
        jargs a = {0};
        eval_args(c, n, &a);
        jv r = c->failed ? jv_undef() : call_value(c, n, f, &a);
        free_args(&a);
        jv_release(f);
        return r;
    }
    case E_FILTER: {
        jv v = eval(c, n->a);
        jargs a = {0};
        eval_args(c, n, &a);
        jv r = c->failed ? jv_undef() : apply_filter_named(c, n, n->name, v, &a);
        free_args(&a);
        jv_release(v);
        return r;
    }
    case E_TEST: {
        /* `x is defined` must not fail on an undefined attribute chain
         * end, but Jinja2 still fails on attribute access of undefined */
        jv v = eval(c, n->a);
        jargs a = {0};
        eval_args(c, n, &a);
        bool r = c->failed ? false : apply_test_named(c, n, n->name, v, &a);
        free_args(&a);
        jv_release(v);
        if (c->failed) return jv_undef();
        return jv_bool(n->op ? !r : r);
    }
    case E_NOT: {
        jv v = eval(c, n->a);
        bool r = !jv_truthy(v);
        jv_release(v);
        return jv_bool(r);
    }
    case E_NEG:
    case E_POS: {
        jv v = eval(c, n->a);
        if (c->failed) { jv_release(v); return jv_undef(); }
        if (v.t == JV_INT && n->kind == E_NEG && v.u.i == INT64_MIN) {
            fail(c, n, "integer overflow (ints are 64-bit here)");
            return jv_undef();
        }
        if (v.t == JV_INT) return jv_int(n->kind == E_NEG ? -v.u.i : v.u.i);
        if (v.t == JV_FLOAT) return jv_float(n->kind == E_NEG ? -v.u.f : v.u.f);
        if (v.t == JV_BOOL) return jv_int(n->kind == E_NEG ? -(int64_t)v.u.b : v.u.b);
        fail(c, n, "bad operand type for unary %c: '%s'", n->kind == E_NEG ? '-' : '+', jv_type_name(v));
        jv_release(v);
        return jv_undef();
    }
    case E_BIN: {
        jv a = eval(c, n->a);
        jv b = eval(c, n->b);
        jv r = c->failed ? jv_undef() : binop(c, n, n->op, a, b);
        jv_release(a);
        jv_release(b);
        return r;
    }
    case E_AND:
    case E_OR: {
        jv a = eval(c, n->a);
        bool t = jv_truthy(a);
        if ((n->kind == E_AND && !t) || (n->kind == E_OR && t)) return a;
        jv_release(a);
        return eval(c, n->b);
    }
    case E_COND: {
        jv cond = eval(c, n->a);
        bool t = jv_truthy(cond);
        jv_release(cond);
        if (t) return eval(c, n->b);
        if (n->c) return eval(c, n->c);
        return jv_undef();
    }
    case E_LIST: {
        jv l = jv_list(n->nkids);
        l.u.l->is_tuple = n->op == 1;
        for (size_t i = 0; i < n->nkids; i++) jv_list_push(l, eval(c, n->kids[i]));
        return l;
    }
    case E_DICT: {
        jv d = jv_dict(n->nkids);
        for (size_t i = 0; i < n->nkids; i++) {
            jv k = eval(c, n->kids[i]);
            jv v = eval(c, n->kids2[i]);
            if (k.t != JV_STR) {
                if (!c->failed) fail(c, n, "dict keys must be strings");
                jv_release(k);
                jv_release(v);
                continue;
            }
            jv_dict_set(d, k.u.s->data, k.u.s->len, v);
            jv_release(k);
        }
        return d;
    }
    default:
        fail(c, n, "not an expression");
        return jv_undef();
    }
}

/* ---- statements ---- */

static void assign_targets(jinja_ctx *c, const jnode *n, char *const *names, size_t nnames, jv v) {
    if (nnames == 1) {
        assign(c, names[0], jv_retain(v));
        return;
    }
    jv it = as_iterable(c, n, v);
    if (c->failed) return;
    if (it.u.l->n != nnames) {
        fail(c, n, "cannot unpack %zu values into %zu names", it.u.l->n, nnames);
        jv_release(it);
        return;
    }
    for (size_t i = 0; i < nnames; i++) assign(c, names[i], jv_retain(it.u.l->items[i]));
    jv_release(it);
}

static void exec_for(jinja_ctx *c, const jnode *n) {
    jv src = eval(c, n->a);
    if (c->failed) { jv_release(src); return; }
    jv it = as_iterable(c, n->a, src);
    jv_release(src);
    if (c->failed) return;
    /* the loop filter runs first so that loop.length and friends count
     * only the items that pass it */
    if (n->b) {
        jv kept = jv_list(it.u.l->n);
        for (size_t i = 0; i < it.u.l->n && !c->failed; i++) {
            scope s = {.parent = c->cur, .vars = jv_dict(2)};
            c->cur = &s;
            assign_targets(c, n, n->names, n->nnames, it.u.l->items[i]);
            jv ok = eval(c, n->b);
            c->cur = s.parent;
            jv_release(s.vars);
            if (jv_truthy(ok)) jv_list_push(kept, jv_retain(it.u.l->items[i]));
            jv_release(ok);
        }
        jv_release(it);
        it = kept;
        if (c->failed) { jv_release(it); return; }
    }
    size_t len = it.u.l->n;
    if (len == 0) {
        exec_body(c, n->kids2, n->nkids2);
        jv_release(it);
        return;
    }
    for (size_t i = 0; i < len && step(c, n); i++) {
        scope s = {.parent = c->cur, .vars = jv_dict(4)};
        c->cur = &s;
        jv loop = jv_dict(12);
        jv_dict_set(loop, "index0", 6, jv_int((int64_t)i));
        jv_dict_set(loop, "index", 5, jv_int((int64_t)i + 1));
        jv_dict_set(loop, "revindex0", 9, jv_int((int64_t)(len - 1 - i)));
        jv_dict_set(loop, "revindex", 8, jv_int((int64_t)(len - i)));
        jv_dict_set(loop, "first", 5, jv_bool(i == 0));
        jv_dict_set(loop, "last", 4, jv_bool(i == len - 1));
        jv_dict_set(loop, "length", 6, jv_int((int64_t)len));
        jv_dict_set(loop, "depth", 5, jv_int(1));
        jv_dict_set(loop, "depth0", 6, jv_int(0));
        if (i > 0) jv_dict_set(loop, "previtem", 8, jv_retain(it.u.l->items[i - 1]));
        if (i + 1 < len) jv_dict_set(loop, "nextitem", 8, jv_retain(it.u.l->items[i + 1]));
        assign(c, "loop", loop);
        assign_targets(c, n, n->names, n->nnames, it.u.l->items[i]);
        exec_body(c, n->kids, n->nkids);
        c->cur = s.parent;
        jv_release(s.vars);
        if (c->loopctl == 1) { c->loopctl = 0; break; }
        c->loopctl = 0;
    }
    jv_release(it);
}

static void exec_node(jinja_ctx *c, const jnode *n) {
    if (!step(c, n)) return;
    switch (n->kind) {
    case N_TEXT: jbuf_put(c->out, n->lit.u.s->data, n->lit.u.s->len); return;
    case N_OUTPUT: {
        jv v = eval(c, n->a);
        if (!c->failed) jv_str_into(c->out, v);
        jv_release(v);
        return;
    }
    case N_IF: {
        jv cond = eval(c, n->a);
        bool t = jv_truthy(cond);
        jv_release(cond);
        if (c->failed) return;
        if (t) exec_body(c, n->kids, n->nkids);
        else exec_body(c, n->kids2, n->nkids2);
        return;
    }
    case N_FOR: exec_for(c, n); return;
    case N_SET: {
        jv v = eval(c, n->b);
        if (c->failed) { jv_release(v); return; }
        if (n->op == 0) {
            assign(c, n->name, v);
        } else if (n->op == 1) {
            const jv *ns = lookup(c, n->name);
            if (ns == NULL || ns->t != JV_DICT || !ns->u.d->is_ns) {
                jv_release(v);
                fail(c, n, "can only assign attributes of a namespace ('%s' is not one)", n->name);
                return;
            }
            if (jv_holds_ns(v)) { /* it could then hold itself: a cycle */
                jv_release(v);
                fail(c, n, "a namespace cannot hold another namespace ('%s.%s')", n->name, n->names[0]);
                return;
            }
            jv_dict_set(*ns, n->names[0], strlen(n->names[0]), v);
        } else {
            assign_targets(c, n, n->names, n->nnames, v);
            jv_release(v);
        }
        return;
    }
    case N_SET_BLOCK: {
        jbuf out = {0};
        jbuf_put(&out, "", 0);
        jbuf *saved = c->out;
        c->out = &out;
        exec_body(c, n->kids, n->nkids);
        c->out = saved;
        assign(c, n->name, str_of(out.p, out.n));
        free(out.p);
        return;
    }
    case N_MACRO: {
        jv f = jv_func(n->name, NULL, NULL);
        f.u.fn->macro = n;
        assign(c, n->name, f);
        return;
    }
    case N_BREAK: c->loopctl = 1; return;
    case N_CONTINUE: c->loopctl = 2; return;
    case N_BLOCK: exec_body(c, n->kids, n->nkids); return;
    default: fail(c, n, "not a statement"); return;
    }
}

static void exec_body(jinja_ctx *c, jnode *const *kids, size_t n) {
    for (size_t i = 0; i < n && !c->failed && !c->loopctl; i++) exec_node(c, kids[i]);
}

int jinja_render(const jinja_template *t, jv vars, int64_t now, char **out, ember_error *err) {
    const jinja_limits lim = {JINJA_DEFAULT_MAX_STEPS, JINJA_DEFAULT_MAX_BYTES};
    return jinja_render_limited(t, vars, now, &lim, out, err);
}

int jinja_render_limited(const jinja_template *t, jv vars, int64_t now, const jinja_limits *lim, char **out,
                         ember_error *err) {
    jbuf buf = {0};
    jbuf_put(&buf, "", 0);
    jinja_budget_begin(lim->max_bytes);
    scope root = {.parent = NULL, .vars = jv_dict(8)};
    jinja_ctx c = {.err = err, .now = now, .globals = vars, .root = &root, .cur = &root, .out = &buf,
                   .max_steps = lim->max_steps, .max_bytes = lim->max_bytes};
    exec_body(&c, t->root->kids, t->root->nkids);
    /* The last statement may have crossed the byte limit after its step. */
    if (!c.failed && jinja_budget_exceeded())
        fail(&c, NULL, "the template exceeded its size limit (%zu bytes of output or values)", lim->max_bytes);
    if (!c.failed && jinja_budget_too_deep())
        fail(&c, NULL, "the template nested values more than %d levels deep", JINJA_MAX_DEPTH);
    jv_release(root.vars);
    jinja_budget_end();
    if (c.failed) {
        free(buf.p);
        *out = NULL;
        return -1;
    }
    *out = buf.p;
    return 0;
}
