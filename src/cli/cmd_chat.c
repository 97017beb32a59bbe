/* cmd_chat.c - `ember chat MODEL`: an interactive chat in the terminal.
 *
 * Each turn goes through the server's own request path, so what a user sees
 * here is what the API does: the conversation is kept as an OpenAI messages
 * array, and every turn is an OpenAI chat request body handed to api_parse
 * (serve_api.c: validation, the model's chat template or the ChatML
 * fallback, tokenization, the prompt cache's render positions). The parsed
 * request then runs through engine_generate with the cache on, in one place
 * (generate_reply), so the previous turns are found in the cache and only
 * the new suffix is prefilled; the status line after each reply shows it.
 *
 * Input: libedit's readline (editing, history) when stdin is a terminal and
 * ember was built with libedit; plain line reading otherwise, so scripted
 * turns can be piped in. Lines starting with '/' are commands: /reset,
 * /system TEXT, /save FILE, /load FILE, /help, /quit. Replies stream to
 * stdout; the status line is dim on a terminal. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#ifdef EMBER_HAVE_LIBEDIT
#include <editline/readline.h>
#endif

#include "cli/cli_common.h"
#include "cli/cli_opts.h"
#include "chat/chat.h"
#include "cli/commands.h"
#include "core/log.h"
#include "engine/engine.h"
#include "serve/serve_api.h"
#include "serve/serve_chat.h"

typedef struct chat_opts {
    const char *model_path;
    const char *system;
    int max_tokens;
    double temperature, top_p;
    long long seed;           /* < 0: none (the API draws one) */
    int threads, n_ctx;
} chat_opts;

typedef struct chat_session {
    chat_opts o;
    model *m;
    engine *eng;
    serve_chat *chat;
    api_ctx api;
    cJSON *messages;          /* the conversation, OpenAI shape; [0] may be the system message */
    bool color;               /* stdout is a terminal: dim the status line */
    bool interactive;         /* stdin is a terminal */
} chat_session;

enum { OPT_SYSTEM, OPT_N, OPT_TEMP, OPT_TOP_P, OPT_SEED, OPT_THREADS, OPT_CTX };

static const cli_option chat_options[] = {
    {OPT_SYSTEM, "--system", NULL, "TEXT", "the system prompt (change it later with /system TEXT)", NULL},
    {OPT_N, "--n-predict", "-n", "N", "most tokens per reply (default 512)", NULL},
    {OPT_TEMP, "--temp", NULL, "T", "sampling temperature; 0: greedy (default 0.7)", NULL},
    {OPT_TOP_P, "--top-p", NULL, "P", "nucleus sampling threshold (default 0.95)", NULL},
    {OPT_SEED, "--seed", NULL, "S", "sampling seed (default: a new one per reply)", NULL},
    {OPT_THREADS, "--threads", NULL, "K", "threads per forward pass (default: all CPUs)", NULL},
    {OPT_CTX, "--ctx", NULL, "N", "context in tokens (default: the training context, at most 4096)", NULL},
    {0, NULL, NULL, NULL, NULL, NULL},
};

const cli_command cmd_chat_command = {
    "chat", cmd_chat, "MODEL [options]", "chat in the terminal through the model's template, with the prompt cache",
    "Each turn is parsed as the server parses a chat request (template, tokenization, cache plan) and "
    "runs with the prompt cache on; after each streamed reply a status line shows prompt tokens, cached "
    "tokens and their tier, prefill and decode speed. In the chat: /reset, /system TEXT, /save FILE, "
    "/load FILE (an OpenAI messages array), /help, /quit. Line editing on a terminal; plain lines from a "
    "pipe.",
    chat_options, false, false,
};

/* ---- the conversation ---- */

static bool has_system(const chat_session *s) {
    const cJSON *first = cJSON_GetArrayItem(s->messages, 0);
    const cJSON *role = first ? cJSON_GetObjectItem(first, "role") : NULL;
    return cJSON_IsString(role) && strcmp(role->valuestring, "system") == 0;
}

static void add_message(cJSON *messages, const char *role, const char *content) {
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", role);
    cJSON_AddStringToObject(m, "content", content);
    cJSON_AddItemToArray(messages, m);
}

static void set_system(chat_session *s, const char *text) {
    if (has_system(s)) cJSON_DeleteItemFromArray(s->messages, 0);
    if (text == NULL || !text[0]) return;
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", "system");
    cJSON_AddStringToObject(m, "content", text);
    cJSON_InsertItemInArray(s->messages, 0, m);
}

/* Keeps the system message, drops the turns. */
static void reset_turns(chat_session *s) {
    int keep = has_system(s) ? 1 : 0;
    while (cJSON_GetArraySize(s->messages) > keep) cJSON_DeleteItemFromArray(s->messages, keep);
}

static int save_file(const chat_session *s, const char *path) {
    char *text = cJSON_Print(s->messages);
    FILE *f = text ? fopen(path, "w") : NULL;
    if (f == NULL) {
        fprintf(stderr, "ember: cannot write %s\n", path);
        free(text);
        return -1;
    }
    fputs(text, f);
    fputc('\n', f);
    int bad = ferror(f);
    bad |= fclose(f);
    free(text);
    if (bad) fprintf(stderr, "ember: cannot write %s\n", path);
    return bad ? -1 : 0;
}

/* Reads an OpenAI messages array (or {"messages": [...]}) and checks it the
 * way the server would before replacing the conversation. */
static int load_file(chat_session *s, const char *path) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = fopen(path, "r");
    if (f) {
        size_t cap = 0;
        ssize_t n = getdelim(&text, &cap, '\0', f);
        len = n > 0 ? (size_t)n : 0;
        bool more = fgetc(f) != EOF;
        fclose(f);
        if (n < 0) {
            free(text);
            text = NULL;
        } else if (more || (len > 0 && text[len - 1] == 0)) {
            fprintf(stderr, "ember: %s: holds a NUL byte (JSON text never does)\n", path);
            free(text);
            return -1;
        }
    }
    if (text == NULL) {
        fprintf(stderr, "ember: cannot read %s\n", path);
        return -1;
    }
    /* every string becomes a C string: an escaped U+0000 would cut it short */
    api_error ae;
    if (api_body_check(text, len, &ae) < 0) {
        fprintf(stderr, "ember: %s: %s%s%s\n", path, ae.param, ae.param[0] ? ": " : "", ae.message);
        free(text);
        return -1;
    }
    cJSON *j = cJSON_Parse(text);
    free(text);
    cJSON *msgs = cJSON_IsObject(j) ? cJSON_DetachItemFromObject(j, "messages") : NULL;
    if (msgs) {
        cJSON_Delete(j);
        j = msgs;
    }
    if (!cJSON_IsArray(j)) {
        fprintf(stderr, "ember: %s: not a JSON array of chat messages\n", path);
        cJSON_Delete(j);
        return -1;
    }
    char *rendered = NULL, param[96] = "messages";
    bool thinking;
    ember_error err;
    if (serve_chat_render(s->chat, j, NULL, NULL, &rendered, &thinking, param, sizeof param, &err) < 0) {
        fprintf(stderr, "ember: %s: %s: %s\n", path, param, err.msg);
        cJSON_Delete(j);
        return -1;
    }
    free(rendered);
    cJSON_Delete(s->messages);
    s->messages = j;
    return 0;
}

/* ---- one reply ---- */

typedef struct stream_out {
    tok_stream *ts;
    char *text;
    size_t len, cap;
} stream_out;

static bool on_token(void *user, int32_t token) {
    stream_out *so = user;
    size_t n;
    const char *piece = tok_stream_push(so->ts, token, &n);
    if (n == 0) return true;
    fwrite(piece, 1, n, stdout);
    fflush(stdout);
    if (so->len + n + 1 > so->cap) {
        size_t cap = so->cap ? so->cap * 2 : 1024;
        while (cap < so->len + n + 1) cap *= 2;
        char *p = realloc(so->text, cap);
        if (p == NULL) return false;
        so->text = p;
        so->cap = cap;
    }
    memcpy(so->text + so->len, piece, n);
    so->len += n;
    so->text[so->len] = 0;
    return true;
}

/* The request body the API would receive for the conversation as it is. */
static char *request_body(const chat_session *s) {
    cJSON *b = cJSON_CreateObject();
    cJSON_AddItemToObject(b, "messages", cJSON_Duplicate(s->messages, true));
    cJSON_AddNumberToObject(b, "max_tokens", s->o.max_tokens);
    cJSON_AddNumberToObject(b, "temperature", s->o.temperature);
    cJSON_AddNumberToObject(b, "top_p", s->o.top_p);
    if (s->o.seed >= 0) cJSON_AddNumberToObject(b, "seed", (double)s->o.seed);
    char *text = cJSON_PrintUnformatted(b);
    cJSON_Delete(b);
    return text;
}

/* Parses the conversation as the server does and generates the reply with
 * the prompt cache on. Returns 0 with the reply text in *reply (malloc'd). */
static int generate_reply(chat_session *s, char **reply, engine_result *res) {
    char *body = request_body(s);
    api_req q;
    api_error ae;
    if (body == NULL || api_parse(&s->api, true, body, strlen(body), NULL, &q, &ae) < 0) {
        fprintf(stderr, "ember: %s\n", body ? ae.message : "out of memory");
        free(body);
        return -1;
    }
    free(body);
    engine_request req = engine_default_request();
    req.prompt = q.p.prompt;
    req.n_prompt = q.p.n_prompt;
    req.max_tokens = q.p.max_tokens;
    req.sampling = q.p.sampling;
    req.salt = q.p.salt;
    req.cache = ENGINE_CACHE_ON;
    req.stop_at_eog = !q.p.ignore_eos;
    req.plan = q.p.plan; /* borrowed: api_req_free releases the predictor after the run */
    stream_out so = {tok_stream_create(model_get_tokenizer(s->m), false), NULL, 0, 0};
    req.on_token = on_token;
    req.user = &so;
    ember_error err;
    int rc = so.ts ? engine_generate(s->eng, &req, res, &err) : -1;
    if (rc == 0) {
        size_t n;
        const char *tail = tok_stream_flush(so.ts, &n);
        if (n) {
            fwrite(tail, 1, n, stdout);
            char *p = realloc(so.text, so.len + n + 1);
            if (p) {
                memcpy(p + so.len, tail, n);
                so.len += n;
                p[so.len] = 0;
                so.text = p;
            }
        }
        /* the next turn carries what the user saw, minus any reasoning */
        char *reasoning = NULL, *content = NULL;
        if (so.text && chat_split_reasoning(so.text, q.thinking_open, &reasoning, &content) == 0) {
            free(so.text);
            free(reasoning);
            so.text = content;
        }
        *reply = so.text ? so.text : strdup("");
    } else {
        fprintf(stderr, "\nember: %s\n", so.ts ? err.msg : "out of memory");
        free(so.text);
    }
    tok_stream_free(so.ts);
    api_req_free(&q);
    return rc;
}

static void print_status(const chat_session *s, const engine_result *r) {
    double decode_s = r->total_s - r->ttft_s;
    int64_t forwarded = r->n_prompt - r->cached_tokens;
    printf("%s[prompt %lld tokens | cached %lld (%s) | prefill %lld at %.1f tok/s | decode %d at %.1f tok/s]%s\n",
           s->color ? "\033[2m" : "", (long long)r->n_prompt, (long long)r->cached_tokens,
           r->cached_tokens > 0 ? apc_source_name(r->cache_source) : "none", (long long)forwarded,
           r->ttft_s > 0 ? forwarded / r->ttft_s : 0.0, r->n_tokens,
           r->n_tokens > 1 && decode_s > 0 ? (r->n_tokens - 1) / decode_s : 0.0, s->color ? "\033[0m" : "");
    fflush(stdout);
}

static void user_turn(chat_session *s, const char *text) {
    add_message(s->messages, "user", text);
    char *reply = NULL;
    engine_result res;
    memset(&res, 0, sizeof res);
    if (generate_reply(s, &reply, &res) < 0) {
        /* the turn failed (too long, say): forget it so the next one can work */
        cJSON_DeleteItemFromArray(s->messages, cJSON_GetArraySize(s->messages) - 1);
        engine_result_free(&res);
        return;
    }
    printf("\n");
    print_status(s, &res);
    add_message(s->messages, "assistant", reply);
    free(reply);
    engine_result_free(&res);
}

/* ---- input ---- */

static char *read_line(const chat_session *s) {
#ifdef EMBER_HAVE_LIBEDIT
    if (s->interactive) {
        char *line = readline("> ");
        if (line && line[0]) add_history(line);
        return line;
    }
#endif
    if (s->interactive) {
        fputs("> ", stdout);
        fflush(stdout);
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t n = getline(&line, &cap, stdin);
    if (n < 0) {
        free(line);
        return NULL;
    }
    while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = 0;
    return line;
}

/* Runs one command line; returns false on /quit. */
static bool command(chat_session *s, const char *line) {
    const char *arg = strchr(line, ' ');
    size_t cmd_len = arg ? (size_t)(arg - line) : strlen(line);
    while (arg && *arg == ' ') arg++;
#define IS(name) (cmd_len == strlen(name) && strncmp(line, name, cmd_len) == 0)
    if (IS("/quit") || IS("/exit")) return false;
    if (IS("/reset")) {
        reset_turns(s);
        printf("(conversation cleared%s)\n", has_system(s) ? "; the system prompt stays" : "");
    } else if (IS("/system")) {
        set_system(s, arg);
        printf("(system prompt %s)\n", arg && arg[0] ? "set" : "removed");
    } else if (IS("/save") && arg && arg[0]) {
        if (save_file(s, arg) == 0) printf("(saved %d messages to %s)\n", cJSON_GetArraySize(s->messages), arg);
    } else if (IS("/load") && arg && arg[0]) {
        if (load_file(s, arg) == 0) printf("(loaded %d messages from %s)\n", cJSON_GetArraySize(s->messages), arg);
    } else {
        if (!IS("/help")) printf("(unknown command %.*s)\n", (int)cmd_len, line);
        printf("commands: /reset (clear the turns), /system TEXT (set or, without TEXT, remove the system prompt),\n"
               "          /save FILE, /load FILE (the conversation as an OpenAI messages array), /quit\n");
    }
#undef IS
    fflush(stdout);
    return true;
}

/* ---- setup ---- */

/* Returns -1 when the options are good, else the exit status. */
static int parse_args(int argc, char **argv, chat_opts *o) {
    memset(o, 0, sizeof *o);
    o->max_tokens = 512;
    o->temperature = 0.7;
    o->top_p = 0.95;
    o->seed = -1;
    cli_args args;
    cli_args_init(&args, &cmd_chat_command, argc, argv);
    for (int id; (id = cli_next(&args)) != CLI_END;) {
        const char *a = args.opt, *val = args.value;
        switch (id) {
        case OPT_SYSTEM: o->system = val; break;
        case OPT_N: o->max_tokens = (int)cli_parse_long(a, val, 1, 1 << 24); break;
        case OPT_TEMP: o->temperature = cli_parse_double(a, val); break;
        case OPT_TOP_P: o->top_p = cli_parse_double(a, val); break;
        case OPT_SEED: o->seed = cli_parse_long(a, val, 0, 1L << 53); break;
        case OPT_THREADS: o->threads = (int)cli_parse_long(a, val, 1, 1024); break;
        case OPT_CTX: o->n_ctx = (int)cli_parse_long(a, val, 16, 1 << 24); break;
        case CLI_ARG:
            if (o->model_path)
                return cli_usage_error(&cmd_chat_command, "one model only ('%s' and '%s')", o->model_path, val);
            o->model_path = val;
            break;
        }
    }
    if (args.status >= 0) return args.status;
    if (o->model_path == NULL) return cli_usage_error(&cmd_chat_command, "no model file");
    return -1;
}

static int session_open(chat_session *s, ember_error *err) {
    s->m = model_load(s->o.model_path, err);
    if (s->m == NULL) return -1;
    const model_hparams *hp = model_get_hparams(s->m);
    engine_config cfg = engine_default_config();
    cfg.n_threads = s->o.threads;
    cfg.n_ctx = s->o.n_ctx > 0 ? s->o.n_ctx : (hp->n_ctx_train > 0 && hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096);
    s->eng = engine_create(s->m, &cfg, err);
    if (s->eng == NULL) return -1;
    s->chat = serve_chat_create(s->m, err);
    if (s->chat == NULL) return -1;
    s->api.tok = model_get_tokenizer(s->m);
    s->api.chat = s->chat;
    s->api.model_id = s->o.model_path;
    s->api.n_ctx = engine_n_ctx(s->eng);
    s->messages = cJSON_CreateArray();
    set_system(s, s->o.system);
    return 0;
}

static void session_close(chat_session *s) {
    cJSON_Delete(s->messages);
    serve_chat_free(s->chat);
    engine_free(s->eng);
    model_free(s->m);
}

int cmd_chat(int argc, char **argv) {
    chat_session s;
    memset(&s, 0, sizeof s);
    int st = parse_args(argc, argv, &s.o);
    if (st >= 0) return st;
    s.interactive = isatty(STDIN_FILENO);
    s.color = isatty(STDOUT_FILENO);
    /* load-time info lines would bury the prompt; warnings still show */
    if (ember_log_get_level() < EMBER_LOG_WARN && getenv("EMBER_LOG") == NULL) ember_log_set_level(EMBER_LOG_WARN);
    ember_error err;
    if (session_open(&s, &err) < 0) {
        fprintf(stderr, "ember: %s\n", err.msg);
        session_close(&s);
        return 1;
    }
    if (s.interactive)
        printf("ember chat: %s (context %d). /help lists the commands; Ctrl-D quits.\n", s.o.model_path,
               s.api.n_ctx);
    for (;;) {
        char *line = read_line(&s);
        if (line == NULL) break;
        bool go_on = true;
        if (line[0] == '/') go_on = command(&s, line);
        else if (line[0]) user_turn(&s, line);
        free(line);
        if (!go_on) break;
    }
    if (s.interactive) printf("\n");
    session_close(&s);
    return 0;
}
