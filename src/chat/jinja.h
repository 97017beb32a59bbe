/* jinja.h - ember's Jinja-subset engine (internal to src/chat).
 *
 * Contract:
 *  - Values (jinja_value.c). jv is a small tagged value: undefined, none,
 *    bool, int, float, string, list, dict (insertion-ordered, string keys),
 *    callable. Strings, lists, dicts and callables are reference counted and
 *    immutable once shared, except namespace() dicts, which `set ns.x = v`
 *    mutates in place (that is their point). jv_retain/jv_release manage
 *    references; every function returning a jv returns a new reference.
 *    String literals of a parsed template are immortal (rc < 0, never
 *    counted), so one template can be rendered by several threads at once:
 *    rendering touches no other shared state.
 *  - Python semantics where templates can observe them: truthiness, str()
 *    (True/None, float repr, list/dict repr), equality across int/float/
 *    bool, json.dumps formatting (jv_to_json), code-point indexing of
 *    strings, str.isspace() whitespace.
 *  - Templates (jinja_parse.c). jinja_parse() turns a source into an AST;
 *    errors carry line and column. jinja_render() (jinja_eval.c) evaluates
 *    it against a dict of variables into a malloc'd string, within a step
 *    limit and a byte limit (jinja_limits). */
#ifndef EMBER_CHAT_JINJA_H
#define EMBER_CHAT_JINJA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/error.h"

/* ---- values ---- */

typedef enum {
    JV_UNDEF = 0, JV_NONE, JV_BOOL, JV_INT, JV_FLOAT, JV_STR, JV_LIST, JV_DICT, JV_FUNC
} jv_type;

typedef struct jstr { int rc; size_t len; char data[]; } jstr;
typedef struct jlist jlist;
typedef struct jdict jdict;
typedef struct jfunc jfunc;

typedef struct jv {
    jv_type t;
    union {
        bool b;
        int64_t i;
        double f;
        jstr *s;
        jlist *l;
        jdict *d;
        jfunc *fn;
    } u;
    const char *undef_name; /* static or AST-owned name, for error messages */
} jv;

/* depth: nesting levels of containers (1 for a flat one; recorded when an
 * item is added, so a namespace mutated later may exceed it by its own
 * depth). holds_ns: some item is, or holds, a namespace. A namespace never
 * holds a namespace (jinja_eval.c refuses it), and other containers do not
 * change once shared, so values form no cycles and nest at most about
 * 2 x JINJA_MAX_DEPTH deep: the recursive walks (release, repr, json,
 * equality) stay within the stack. */
struct jlist { int rc; bool is_tuple; size_t n, cap; jv *items; int depth; bool holds_ns; };
struct jdict { int rc; bool is_ns; size_t n, cap; jstr **keys; jv *vals; int depth; bool holds_ns; };
#define JINJA_MAX_DEPTH 1000

/* A callable: a builtin (fn set) or a macro (node set, evaluated by
 * jinja_eval.c). */
struct jinja_ctx;
struct jnode;
typedef struct jargs {
    size_t npos, nkw;
    jv *pos;
    const char **kw_names;
    jv *kw;
} jargs;
struct jfunc {
    int rc;
    const char *name;
    jv (*fn)(struct jinja_ctx *ctx, jv self, const jargs *args, void *data);
    void *data;
    const struct jnode *macro;
    jv bound;  /* bound receiver for methods (undefined when unbound) */
};

static inline jv jv_undef(void) { jv v = {0}; v.t = JV_UNDEF; return v; }
static inline jv jv_none(void) { jv v = {0}; v.t = JV_NONE; return v; }
static inline jv jv_bool(bool b) { jv v = {0}; v.t = JV_BOOL; v.u.b = b; return v; }
static inline jv jv_int(int64_t i) { jv v = {0}; v.t = JV_INT; v.u.i = i; return v; }
static inline jv jv_float(double f) { jv v = {0}; v.t = JV_FLOAT; v.u.f = f; return v; }

jv jv_str(const char *s, size_t len);
jv jv_cstr(const char *s);
jv jv_list(size_t cap);
jv jv_dict(size_t cap);
jv jv_func(const char *name, jv (*fn)(struct jinja_ctx *, jv, const jargs *, void *), void *data);

jv jv_retain(jv v);
void jv_release(jv v);

/* list / dict helpers; push/set take ownership of the value */
void jv_list_push(jv list, jv item);
void jv_dict_set(jv dict, const char *key, size_t klen, jv val);
/* Borrowed lookup; NULL when absent. */
const jv *jv_dict_get(jv dict, const char *key, size_t klen);

bool jv_truthy(jv v);
int jv_depth(jv v);        /* 0 for scalars */
bool jv_holds_ns(jv v);    /* v is or (transitively) holds a namespace() dict */
bool jv_equal(jv a, jv b);
const char *jv_type_name(jv v);

/* Python str(v) appended to a growing buffer. */
typedef struct jbuf { char *p; size_t n, cap; } jbuf;
void jbuf_put(jbuf *b, const char *s, size_t n);
void jbuf_puts(jbuf *b, const char *s);
void jbuf_putc(jbuf *b, char c);
void jv_str_into(jbuf *b, jv v);   /* str(); undefined -> "" */
void jv_repr_into(jbuf *b, jv v);  /* repr() */
jv jv_to_str(jv v);                /* str() as a new string value */
/* json.dumps(v, ensure_ascii, indent (<0: none), sort_keys); -1 with msg on
 * an unserialisable value (undefined, callable). */
int jv_to_json(jbuf *b, jv v, bool ensure_ascii, int indent, bool sort_keys, const char **msg);

void py_float_repr(char *out, size_t cap, double f);

/* UTF-8 helpers on strings */
size_t utf8_cp_count(const char *s, size_t len);
/* Byte offset of code point index cp (clamped to len). */
size_t utf8_cp_offset(const char *s, size_t len, size_t cp);
bool py_isspace_at(const char *s, size_t len, size_t at, size_t *clen);

/* ---- templates ---- */

typedef enum {
    /* statements */
    N_TEXT, N_OUTPUT, N_IF, N_FOR, N_SET, N_SET_BLOCK, N_MACRO, N_BREAK, N_CONTINUE, N_BLOCK,
    /* expressions */
    E_LIT, E_NAME, E_ATTR, E_ITEM, E_SLICE, E_CALL, E_FILTER, E_TEST, E_NOT, E_NEG, E_POS,
    E_BIN, E_AND, E_OR, E_COND, E_LIST, E_DICT
} jnode_kind;

typedef enum {
    OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_CONCAT,
    OP_EQ, OP_NE, OP_LT, OP_GT, OP_LE, OP_GE, OP_IN, OP_NOTIN
} jop;

/* One AST node. Field use by kind:
 *  N_TEXT: lit (string).   N_OUTPUT: a.
 *  N_IF: a cond, kids body, kids2 else.
 *  N_FOR: names targets, a iterable, b filter (or NULL), kids body, kids2 else.
 *  N_SET: name variable, op 0 = plain, 1 = attribute names[0], 2 = tuple names; b value.
 *  N_SET_BLOCK: name, kids body.   N_BLOCK (generation ... endgeneration): kids.
 *  N_MACRO: name, names params, kids2 defaults (NULL entries), kids body.
 *  E_LIT: lit.  E_NAME: name.  E_ATTR: a, name.  E_ITEM: a, b.
 *  E_SLICE: a, b start, c stop, d step (each may be NULL).
 *  E_CALL: a callee, kids positional, names + kids2 keyword.
 *  E_FILTER / E_TEST: name, a operand, kids / names + kids2 args; E_TEST op = negated.
 *  E_NOT/E_NEG/E_POS: a.  E_BIN: op, a, b.  E_AND/E_OR: a, b.
 *  E_COND: a cond, b then, c else (may be NULL).
 *  E_LIST: kids.  E_DICT: kids keys, kids2 values. */
typedef struct jnode {
    jnode_kind kind;
    int line, col;
    int op;
    char *name;
    jv lit;
    struct jnode *a, *b, *c, *d;
    struct jnode **kids;
    size_t nkids;
    struct jnode **kids2;
    size_t nkids2;
    char **names;
    size_t nnames;
} jnode;

typedef struct jinja_template jinja_template;
struct jinja_template {
    jnode *root; /* an N_BLOCK */
};

/* Bounds of one render, so that no template (they come with model files)
 * can loop forever or allocate without bound. A step is one statement or
 * expression evaluated. max_bytes bounds the output, any one string the
 * template builds, and the strings, lists and dicts it holds alive at once.
 * Exceeding either is an error that names the limit. */
typedef struct jinja_limits {
    int64_t max_steps;
    size_t max_bytes;
} jinja_limits;
#define JINJA_DEFAULT_MAX_STEPS 16000000
#define JINJA_DEFAULT_MAX_BYTES ((size_t)64 << 20)

jinja_template *jinja_parse(const char *source, ember_error *err);
void jinja_free(jinja_template *t);
/* vars: a dict value (borrowed). now: unix time for strftime_now. Renders
 * under the default limits. */
int jinja_render(const jinja_template *t, jv vars, int64_t now, char **out, ember_error *err);
int jinja_render_limited(const jinja_template *t, jv vars, int64_t now, const jinja_limits *lim, char **out,
                         ember_error *err);

/* The thread's render memory account (jinja_value.c; used by the evaluator). */
void jinja_budget_begin(size_t max_bytes);
bool jinja_budget_exceeded(void);
bool jinja_budget_too_deep(void); /* a value nested deeper than JINJA_MAX_DEPTH was built */
int64_t jinja_budget_take_work(void); /* builtin work units since the last call */
void jinja_budget_end(void);

#endif
