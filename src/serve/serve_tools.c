/* serve_tools.c - parsing tool calls out of model replies (see
 * serve_tools.h).
 *
 * One trigger search serves both the whole-reply parser and the streaming
 * filter, and both hand the tail (the text from the trigger on) to the same
 * per-syntax tail parser, which is what makes a streamed reply end up with
 * the same content and calls as the whole one. The tail parsers never
 * trust the model: every JSON value is parsed with cJSON and checked for a
 * non-empty string name; a tail that does not parse yields no calls and
 * the reply stays plain text. */
#define _GNU_SOURCE
#include "serve/serve_tools.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- small strings ---- */

typedef struct sbuf {
    char *p;
    size_t n, cap;
    bool oom;
} sbuf;

static void sb_add(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->n + n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (p == NULL) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

/* The buffer's string (never NULL unless out of memory). */
static char *sb_take(sbuf *b) {
    if (b->oom) {
        free(b->p);
        return NULL;
    }
    if (b->p == NULL) return strdup("");
    return b->p;
}

static bool blank(char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

static size_t rtrim_len(const char *s, size_t n) {
    while (n > 0 && blank(s[n - 1])) n--;
    return n;
}

static const char *find(const char *s, size_t n, const char *needle) {
    return memmem(s, n, needle, strlen(needle));
}

static bool starts(const char *s, size_t n, const char *prefix) {
    size_t k = strlen(prefix);
    return n >= k && memcmp(s, prefix, k) == 0;
}

/* ---- syntax ---- */

tool_syntax tool_syntax_for_template(const char *src) {
    if (src == NULL) return TOOL_SYNTAX_HERMES;
    if (strstr(src, "<tool_call>")) return TOOL_SYNTAX_HERMES;
    if (strstr(src, "[TOOL_CALLS]") || strstr(src, "[INST]")) return TOOL_SYNTAX_MISTRAL;
    if (strstr(src, "<|python_tag|>") || (strstr(src, "<|start_header_id|>") && strstr(src, "\"parameters\"")))
        return TOOL_SYNTAX_LLAMA3;
    return TOOL_SYNTAX_HERMES;
}

const char *tool_syntax_name(tool_syntax s) {
    switch (s) {
    case TOOL_SYNTAX_HERMES: return "hermes";
    case TOOL_SYNTAX_LLAMA3: return "llama3";
    case TOOL_SYNTAX_MISTRAL: return "mistral";
    default: return "none";
    }
}

static const char *anywhere_trigger(tool_syntax syn) {
    switch (syn) {
    case TOOL_SYNTAX_HERMES: return "<tool_call>";
    case TOOL_SYNTAX_LLAMA3: return "<|python_tag|>";
    case TOOL_SYNTAX_MISTRAL: return "[TOOL_CALLS]";
    default: return NULL;
    }
}

static char start_trigger(tool_syntax syn) {
    return syn == TOOL_SYNTAX_LLAMA3 ? '{' : syn == TOOL_SYNTAX_MISTRAL ? '[' : 0;
}

/* Offset of the trigger in s[0, n), or -1. start_ok: s begins the reply. */
static long find_trigger(tool_syntax syn, const char *s, size_t n, bool start_ok) {
    long t = -1;
    const char *any = anywhere_trigger(syn);
    const char *hit = any ? find(s, n, any) : NULL;
    if (hit) t = (long)(hit - s);
    char sc = start_trigger(syn);
    if (start_ok && sc) {
        size_t p = 0;
        while (p < n && blank(s[p])) p++;
        if (p < n && s[p] == sc && (t < 0 || (long)p < t)) t = (long)p;
    }
    return t;
}

/* ---- calls ---- */

void tool_calls_free(tool_calls *c) {
    for (int i = 0; i < c->n; i++) {
        free(c->v[i].id);
        free(c->v[i].name);
        free(c->v[i].arguments);
    }
    free(c->v);
    memset(c, 0, sizeof *c);
}

cJSON *tool_calls_json(const tool_calls *c) {
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; i < c->n; i++) {
        cJSON *o = cJSON_CreateObject(), *f = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "id", c->v[i].id);
        cJSON_AddStringToObject(o, "type", "function");
        cJSON_AddStringToObject(f, "name", c->v[i].name);
        cJSON_AddStringToObject(f, "arguments", c->v[i].arguments);
        cJSON_AddItemToObject(o, "function", f);
        cJSON_AddItemToArray(a, o);
    }
    return a;
}

static void make_id(char *out, int len) {
    static const char al[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    static atomic_ullong counter;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)ts.tv_nsec ^ (atomic_fetch_add(&counter, 1) * 0x9E3779B97F4A7C15ULL);
    for (int i = 0; i < len; i++) {
        x ^= x >> 30;
        x *= 0xBF58476D1CE4E5B9ULL;
        x ^= x >> 27;
        x *= 0x94D049BB133111EBULL;
        x ^= x >> 31;
        out[i] = al[x % 62];
    }
    out[len] = 0;
}

static bool alnum9(const char *s) {
    if (strlen(s) != 9) return false;
    for (int i = 0; i < 9; i++)
        if (!((s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= '0' && s[i] <= '9'))) return false;
    return true;
}

/* Takes name and arguments (malloc'd) over. */
static int add_call(tool_calls *c, tool_syntax syn, char *name, char *args, const char *model_id) {
    if (c->n == c->cap) {
        int cap = c->cap ? c->cap * 2 : 4;
        tool_call *v = realloc(c->v, (size_t)cap * sizeof *v);
        if (v == NULL) {
            free(name);
            free(args);
            return -1;
        }
        c->v = v;
        c->cap = cap;
    }
    char id[40];
    if (syn == TOOL_SYNTAX_MISTRAL) {
        if (model_id && alnum9(model_id)) snprintf(id, sizeof id, "%s", model_id);
        else make_id(id, 9);
    } else {
        memcpy(id, "call_", 5);
        make_id(id + 5, 24);
    }
    tool_call *t = &c->v[c->n];
    t->id = strdup(id);
    t->name = name;
    t->arguments = args;
    if (t->id == NULL || name == NULL || args == NULL) {
        free(t->id);
        free(name);
        free(args);
        return -1;
    }
    c->n++;
    return 0;
}

/* {"name": N, "arguments"|"parameters": {...}|"..."[, "id"]} -> a call. */
static int add_json_call(tool_calls *c, tool_syntax syn, const cJSON *o) {
    if (!cJSON_IsObject(o)) return -1;
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(o, "name");
    if (!cJSON_IsString(name) || name->valuestring[0] == 0) return -1;
    const cJSON *args = cJSON_GetObjectItemCaseSensitive(o, "arguments");
    if (args == NULL) args = cJSON_GetObjectItemCaseSensitive(o, "parameters");
    char *a;
    if (args == NULL || cJSON_IsNull(args)) a = strdup("{}");
    else if (cJSON_IsString(args)) a = strdup(args->valuestring);
    else if (cJSON_IsObject(args)) a = cJSON_PrintUnformatted(args);
    else return -1;
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(o, "id");
    return add_call(c, syn, strdup(name->valuestring), a, cJSON_IsString(id) ? id->valuestring : NULL);
}

/* Whether the request's schema declares tool `fn`'s parameter `p` a string. */
static bool param_is_string(const cJSON *tools, const char *fn, const char *p) {
    const cJSON *t;
    cJSON_ArrayForEach(t, tools) {
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(t, "function");
        const cJSON *n = cJSON_GetObjectItemCaseSensitive(f, "name");
        if (!cJSON_IsString(n) || strcmp(n->valuestring, fn) != 0) continue;
        const cJSON *props = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(f, "parameters"),
                                                              "properties");
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(props, p), "type");
        if (cJSON_IsString(type)) return strcmp(type->valuestring, "string") == 0;
        return false;
    }
    return false;
}

/* <function=N>(<parameter=P>\nV\n</parameter>)*</function> -> a call. */
static int add_xml_call(tool_calls *c, tool_syntax syn, const cJSON *tools, const char *s, size_t n) {
    if (!starts(s, n, "<function=")) return -1;
    const char *p = s + 10, *e = s + n;
    const char *gt = memchr(p, '>', (size_t)(e - p));
    if (gt == NULL || gt == p) return -1;
    char *name = strndup(p, (size_t)(gt - p));
    cJSON *obj = cJSON_CreateObject();
    if (name == NULL || obj == NULL) goto fail;
    p = gt + 1;
    for (;;) {
        while (p < e && blank(*p)) p++;
        if (p == e) break; /* lenient: a missing </function> at the end */
        if (starts(p, (size_t)(e - p), "</function>")) {
            p += 11;
            while (p < e && blank(*p)) p++;
            if (p != e) goto fail;
            break;
        }
        if (!starts(p, (size_t)(e - p), "<parameter=")) goto fail;
        p += 11;
        gt = memchr(p, '>', (size_t)(e - p));
        if (gt == NULL || gt == p) goto fail;
        char *pname = strndup(p, (size_t)(gt - p));
        const char *v = gt + 1;
        const char *ve = find(v, (size_t)(e - v), "</parameter>");
        if (pname == NULL || ve == NULL) {
            free(pname);
            goto fail;
        }
        p = ve + 12;
        if (v < ve && *v == '\n') v++;
        if (ve > v && ve[-1] == '\n') ve--;
        cJSON *val = NULL;
        if (!(tools && param_is_string(tools, name, pname))) {
            const char *end = NULL;
            val = cJSON_ParseWithLengthOpts(v, (size_t)(ve - v), &end, false);
            if (val && end != ve) {
                cJSON_Delete(val);
                val = NULL;
            }
        }
        if (val == NULL) {
            char *str = strndup(v, (size_t)(ve - v));
            val = str ? cJSON_CreateString(str) : NULL;
            free(str);
        }
        if (val == NULL || cJSON_GetObjectItemCaseSensitive(obj, pname)) {
            cJSON_Delete(val);
            free(pname);
            goto fail;
        }
        cJSON_AddItemToObject(obj, pname, val);
        free(pname);
    }
    char *args = cJSON_PrintUnformatted(obj);
    cJSON_Delete(obj);
    return add_call(c, syn, name, args, NULL);
fail:
    free(name);
    cJSON_Delete(obj);
    return -1;
}

/* One JSON value at s[0, n): *used gets its length. */
static cJSON *json_at(const char *s, size_t n, size_t *used) {
    const char *end = NULL;
    cJSON *v = cJSON_ParseWithLengthOpts(s, n, &end, false);
    if (v == NULL || end == NULL) {
        cJSON_Delete(v);
        return NULL;
    }
    *used = (size_t)(end - s);
    return v;
}

static void residue_add(sbuf *r, const char *s, size_t n) {
    while (n > 0 && blank(*s)) s++, n--;
    n = rtrim_len(s, n);
    if (n == 0) return;
    if (r->n) sb_add(r, "\n", 1);
    sb_add(r, s, n);
}

/* Calls of the tail s[0, n) into c; text that is no call goes to residue.
 * Returns -1 when the tail does not parse as a whole (LLAMA3/MISTRAL). */
static int parse_tail(tool_syntax syn, const cJSON *tools, const char *s, size_t n, tool_calls *c, sbuf *residue) {
    const char *e = s + n;
    if (syn == TOOL_SYNTAX_HERMES) {
        const char *p = s;
        for (;;) {
            const char *a = find(p, (size_t)(e - p), "<tool_call>");
            if (a == NULL) {
                residue_add(residue, p, (size_t)(e - p));
                return 0;
            }
            residue_add(residue, p, (size_t)(a - p));
            const char *in = a + 11;
            const char *b = find(in, (size_t)(e - in), "</tool_call>");
            const char *in_end = b ? b : e, *next = b ? b + 12 : e;
            const char *i0 = in, *i1 = in_end;
            while (i0 < i1 && blank(*i0)) i0++;
            i1 = i0 + rtrim_len(i0, (size_t)(i1 - i0));
            int rc = -1;
            if (i0 < i1 && *i0 == '{') {
                size_t used = 0;
                cJSON *v = json_at(i0, (size_t)(i1 - i0), &used);
                if (v && i0 + used == i1) rc = add_json_call(c, syn, v);
                cJSON_Delete(v);
            } else if (i0 < i1) {
                rc = add_xml_call(c, syn, tools, i0, (size_t)(i1 - i0));
            }
            if (rc < 0) residue_add(residue, a, (size_t)(next - a));
            p = next;
        }
    }
    const char *p = s;
    const char *tag = anywhere_trigger(syn);
    if (starts(p, n, tag)) p += strlen(tag);
    while (p < e && blank(*p)) p++;
    if (syn == TOOL_SYNTAX_MISTRAL && p < e && *p == '[') {
        size_t used = 0;
        cJSON *arr = json_at(p, (size_t)(e - p), &used);
        if (!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) == 0) {
            cJSON_Delete(arr);
            return -1;
        }
        const cJSON *o;
        cJSON_ArrayForEach(o, arr) {
            if (add_json_call(c, syn, o) < 0) {
                cJSON_Delete(arr);
                return -1;
            }
        }
        cJSON_Delete(arr);
        residue_add(residue, p + used, (size_t)(e - p - used));
        return 0;
    }
    /* LLAMA3, or MISTRAL objects without the list: {..} [;,] {..} ... */
    int got = 0;
    for (;;) {
        while (p < e && (blank(*p) || *p == ';' || (got && *p == ','))) p++;
        if (p == e) break;
        if (*p != '{') return -1;
        size_t used = 0;
        cJSON *v = json_at(p, (size_t)(e - p), &used);
        int rc = v ? add_json_call(c, syn, v) : -1;
        cJSON_Delete(v);
        if (rc < 0) return -1;
        got++;
        p += used;
    }
    return got > 0 ? 0 : -1;
}

/* Parses the tail; on any failure the calls are dropped. Returns the count. */
static int tail_calls(tool_syntax syn, const cJSON *tools, const char *s, size_t n, tool_calls *c, sbuf *residue) {
    if (parse_tail(syn, tools, s, n, c, residue) < 0 || c->n == 0) {
        tool_calls_free(c);
        residue->n = 0;
        if (residue->p) residue->p[0] = 0;
        return 0;
    }
    return c->n;
}

int tools_parse(tool_syntax syn, const cJSON *tools, const char *text, char **content, tool_calls *calls) {
    memset(calls, 0, sizeof *calls);
    *content = NULL;
    size_t n = strlen(text);
    long t = syn == TOOL_SYNTAX_NONE ? -1 : find_trigger(syn, text, n, true);
    sbuf residue = {0};
    if (t < 0 || tail_calls(syn, tools, text + t, n - (size_t)t, calls, &residue) == 0) {
        free(residue.p);
        *content = strdup(text);
        return *content ? 0 : -1;
    }
    sbuf out = {0};
    size_t pre = rtrim_len(text, (size_t)t);
    sb_add(&out, text, pre);
    if (pre && residue.n) sb_add(&out, "\n", 1);
    if (residue.n) sb_add(&out, residue.p, residue.n);
    free(residue.p);
    if (out.oom) {
        free(out.p);
        tool_calls_free(calls);
        return -1;
    }
    if (out.n == 0) {
        free(out.p);
        out.p = NULL;
    }
    *content = out.p; /* NULL when empty */
    return calls->n;
}

/* ---- streaming ---- */

struct tool_filter {
    tool_syntax syn;
    const cJSON *tools;
    sbuf pend;          /* held text; after the trigger: the tail */
    bool released;      /* some content went out */
    bool triggered;
    char *dropped;      /* blanks between the released text and the trigger */
};

tool_filter *tool_filter_create(tool_syntax syn, const cJSON *tools) {
    tool_filter *f = calloc(1, sizeof *f);
    if (f == NULL) return NULL;
    f->syn = syn;
    f->tools = tools;
    return f;
}

void tool_filter_free(tool_filter *f) {
    if (f == NULL) return;
    free(f->pend.p);
    free(f->dropped);
    free(f);
}

/* Longest suffix of s[0, n) that is a proper prefix of tag. */
static size_t partial_suffix(const char *s, size_t n, const char *tag) {
    if (tag == NULL) return 0;
    size_t tl = strlen(tag);
    for (size_t k = tl - 1 < n ? tl - 1 : n; k > 0; k--)
        if (memcmp(s + n - k, tag, k) == 0) return k;
    return 0;
}

char *tool_filter_push(tool_filter *f, const char *text, size_t n, bool at_end, tool_calls *calls) {
    if (at_end) memset(calls, 0, sizeof *calls);
    sb_add(&f->pend, text, n);
    if (f->pend.oom) return NULL;
    sbuf out = {0};
    const char *s = f->pend.p ? f->pend.p : "";
    size_t len = f->pend.n;
    if (!f->triggered && f->syn != TOOL_SYNTAX_NONE) {
        long t = find_trigger(f->syn, s, len, !f->released);
        if (t >= 0) {
            size_t pre = rtrim_len(s, (size_t)t);
            sb_add(&out, s, pre);
            f->dropped = strndup(s + pre, (size_t)t - pre);
            memmove(f->pend.p, s + t, len - (size_t)t + 1);
            f->pend.n = len - (size_t)t;
            f->triggered = true;
            s = f->pend.p;
            len = f->pend.n;
        }
    }
    if (!f->triggered) {
        size_t keep = 0;
        if (!at_end && f->syn != TOOL_SYNTAX_NONE) {
            keep = partial_suffix(s, len, anywhere_trigger(f->syn));
            while (keep < len && blank(s[len - keep - 1])) keep++;
        }
        sb_add(&out, s, len - keep);
        if (len > keep) memmove(f->pend.p, s + len - keep, keep + 1);
        f->pend.n = keep;
    } else if (at_end) {
        sbuf residue = {0};
        if (tail_calls(f->syn, f->tools, s, len, calls, &residue) == 0) {
            if (f->dropped) sb_add(&out, f->dropped, strlen(f->dropped));
            sb_add(&out, s, len);
        } else if (residue.n) {
            if (f->released || out.n) sb_add(&out, "\n", 1);
            sb_add(&out, residue.p, residue.n);
        }
        free(residue.p);
        f->pend.n = 0;
    }
    char *r = sb_take(&out);
    if (r && r[0]) f->released = true;
    if (r == NULL && at_end) tool_calls_free(calls);
    return r;
}
