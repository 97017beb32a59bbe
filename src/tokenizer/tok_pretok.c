/* tok_pretok.c - regex pre-tokenization for byte-level BPE.
 *
 * Design: each tokenizer.ggml.pre name maps to an ordered list of regexes.
 * The text starts as one piece; every regex in turn re-splits every current
 * piece into its matches and the gaps between them (nothing is dropped: the
 * Hugging Face "Isolated" split), so later regexes never see across an
 * earlier boundary. Each piece is matched as its own subject, which is what
 * keeps lookaheads such as \s+(?!\S) from peeking into the next piece.
 *
 * The regexes are compiled with PCRE2 in UTF + UCP mode, so \p{L}, \p{N},
 * \s and friends use real Unicode properties, as the Hugging Face tokenizers
 * that produced the reference outputs do. Case-insensitive contractions are
 * spelled as explicit [sS] classes (like llama.cpp) rather than (?i:...),
 * which in UCP mode would also fold exotic characters such as U+017F.
 * $ means end of subject only (DOLLAR_ENDONLY, as in Rust's regex), and
 * invalid UTF-8 is tolerated: such bytes never match and stay in the gaps. */
#include "tokenizer/tok_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CONTRACTIONS "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
#define GPT2_SPLIT "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
#define LLAMA3_SPLIT                                                                       \
    CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*" \
                 "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define QWEN2_SPLIT                                                                    \
    CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*" \
                 "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define QWEN35_SPLIT                                                                  \
    CONTRACTIONS "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}"                        \
                 "| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define UPPER_CLASS "[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]"
#define LOWER_CLASS "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]"
#define GPT4O_SPLIT                                                                     \
    "[^\\r\\n\\p{L}\\p{N}]?" UPPER_CLASS "*" LOWER_CLASS "+" CONTRACTIONS "?"             \
    "|[^\\r\\n\\p{L}\\p{N}]?" UPPER_CLASS "+" LOWER_CLASS "*" CONTRACTIONS "?"            \
    "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define TEKKEN_SPLIT                                                                     \
    "[^\\r\\n\\p{L}\\p{N}]?" UPPER_CLASS "*" LOWER_CLASS "+"                              \
    "|[^\\r\\n\\p{L}\\p{N}]?" UPPER_CLASS "+" LOWER_CLASS "*"                             \
    "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
/* CJK ideographs (U+4E00..9FA5), U+0800..4E00 and Hangul, as DeepSeek lists them. */
#define DEEPSEEK_CJK "[\\x{4E00}-\\x{9FA5}\\x{800}-\\x{4E00}\\x{AC00}-\\x{D7FF}]+"
/* The cased letters of Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee,
 * Glagolitic, Coptic, Deseret, Osage, Old Hungarian, Warang Citi and Adlam,
 * as enumerated by DeepSeek LLM's tokenizer. */
#define DEEPSEEK_LLM_LETTERS                                                               \
    "A-Za-z\\x{B5}\\x{C0}-\\x{D6}\\x{D8}-\\x{F6}\\x{F8}-\\x{1BA}\\x{1BC}-\\x{1BF}"           \
    "\\x{1C4}-\\x{293}\\x{295}-\\x{2AF}\\x{370}-\\x{373}\\x{376}\\x{377}\\x{37B}-\\x{37D}"   \
    "\\x{37F}\\x{386}\\x{388}-\\x{38A}\\x{38C}\\x{38E}-\\x{3A1}\\x{3A3}-\\x{3F5}"            \
    "\\x{3F7}-\\x{481}\\x{48A}-\\x{52F}\\x{531}-\\x{556}\\x{10A0}-\\x{10C5}"                \
    "\\x{13A0}-\\x{13F5}\\x{13F8}-\\x{13FD}\\x{1C90}-\\x{1CBA}\\x{1CBD}-\\x{1CBF}"          \
    "\\x{1D00}-\\x{1D2B}\\x{1D6B}-\\x{1D77}\\x{1D79}-\\x{1D9A}\\x{1E00}-\\x{1F15}"          \
    "\\x{1F18}-\\x{1F1D}\\x{1F20}-\\x{1F45}\\x{1F48}-\\x{1F4D}\\x{1F50}-\\x{1F57}"          \
    "\\x{1F59}\\x{1F5B}\\x{1F5D}\\x{1F5F}-\\x{1F7D}\\x{1F80}-\\x{1FB4}\\x{1FB6}-\\x{1FBC}"  \
    "\\x{1FBE}\\x{1FC2}-\\x{1FC4}\\x{1FC6}-\\x{1FCC}\\x{1FD0}-\\x{1FD3}\\x{1FD6}-\\x{1FDB}" \
    "\\x{1FE0}-\\x{1FEC}\\x{1FF2}-\\x{1FF4}\\x{1FF6}-\\x{1FFC}\\x{2102}\\x{2107}"           \
    "\\x{210A}-\\x{2113}\\x{2115}\\x{2119}-\\x{211D}\\x{2124}\\x{2126}\\x{2128}"            \
    "\\x{212A}-\\x{212D}\\x{212F}-\\x{2134}\\x{2139}\\x{213C}-\\x{213F}\\x{2145}-\\x{2149}" \
    "\\x{214E}\\x{2183}\\x{2184}\\x{2C00}-\\x{2C7B}\\x{2C7E}-\\x{2CE4}\\x{2CEB}-\\x{2CEE}"  \
    "\\x{2CF2}\\x{2CF3}\\x{A640}-\\x{A66D}\\x{A680}-\\x{A69B}\\x{A722}-\\x{A76F}"           \
    "\\x{A771}-\\x{A787}\\x{A78B}-\\x{A78E}\\x{AB70}-\\x{ABBF}\\x{FB00}-\\x{FB06}"          \
    "\\x{FB13}-\\x{FB17}\\x{FF21}-\\x{FF3A}\\x{FF41}-\\x{FF5A}\\x{10400}-\\x{1044F}"        \
    "\\x{104B0}-\\x{104D3}\\x{104D8}-\\x{104FB}\\x{10C80}-\\x{10CB2}\\x{10CC0}-\\x{10CF2}"  \
    "\\x{118A0}-\\x{118DF}\\x{1E900}-\\x{1E943}"
#define DEEPSEEK_LLM_PUNCT "!-/:-~\\x{FF01}-\\x{FF0F}\\x{FF1A}-\\x{FF5E}\\x{2018}-\\x{201F}\\x{3000}-\\x{3002}"

typedef struct pre_spec {
    const char *const *names;
    const char *regex[TOK_MAX_REGEX];
    bool ignore_merges;
    bool add_bos;
} pre_spec;

#define NAMES(...) (const char *const[]){__VA_ARGS__, NULL}

static const pre_spec PRE_SPECS[] = {
    {NAMES("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
           "lfm2", "jina-v5-nano"),
     {LLAMA3_SPLIT}, true, true},
    {NAMES("dbrx", "smaug-bpe", "glm4", "chatglm-bpe"), {LLAMA3_SPLIT}, false, false},
    {NAMES("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
           "solar-open", "grok-2"),
     {QWEN2_SPLIT}, false, false},
    {NAMES("qwen35"), {QWEN35_SPLIT}, false, false},
    {NAMES("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
           "a.x-4.0", "mellum", "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion",
           "granite-docling"),
     {GPT2_SPLIT}, false, false},
    {NAMES("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
           "mellum2"),
     {"\\p{N}", GPT2_SPLIT}, false, false},
    {NAMES("falcon"), {"[\\p{P}\\$\\+<=>\\^~\\|`]+", GPT2_SPLIT, "[0-9][0-9][0-9]"}, false, false},
    {NAMES("default", ""),
     {"[\\p{P}\\$\\+<=>\\^~\\|]+", GPT2_SPLIT, "\\p{N}+", "[0-9][0-9][0-9]"}, false, false},
    {NAMES("deepseek-coder"),
     {"[\\r\\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", DEEPSEEK_CJK, "\\p{N}"}, false, false},
    {NAMES("deepseek-llm"),
     {"[\\r\\n]", "\\s?[" DEEPSEEK_LLM_LETTERS "]+", "\\s?[" DEEPSEEK_LLM_PUNCT "]+", "\\s+$",
      DEEPSEEK_CJK, "\\p{N}+"},
     false, false},
    {NAMES("deepseek-v3", "hunyuan-dense", "joyai-llm"),
     {"\\p{N}{1,3}", "[\\x{4E00}-\\x{9FA5}\\x{3040}-\\x{309F}\\x{30A0}-\\x{30FF}]+",
      "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
      "| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
     false, false},
    {NAMES("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), {GPT4O_SPLIT}, false, false},
    {NAMES("tekken"), {TEKKEN_SPLIT}, true, true},
    {NAMES("chameleon"),
     {"<sentinel:[0-9]+>", "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", "([\\t\\n]|    |  )", "\\p{N}",
      "[\\p{P}!-/:-@\\[-`{-~]", GPT2_SPLIT},
     false, true},
};

static const pre_spec *find_spec(const char *pre_name) {
    for (size_t i = 0; i < sizeof PRE_SPECS / sizeof PRE_SPECS[0]; i++)
        for (const char *const *n = PRE_SPECS[i].names; *n != NULL; n++)
            if (strcmp(*n, pre_name) == 0) return &PRE_SPECS[i];
    return NULL;
}

bool tok_pre_known(const char *pre_name) { return find_spec(pre_name) != NULL; }

int tok_set_pre(tokenizer *t, const char *pre_name, ember_error *err) {
    const pre_spec *spec = find_spec(pre_name);
    if (spec == NULL) return ember_fail(err, "tokenizer: unsupported pre-tokenizer '%s'", pre_name);
    snprintf(t->pre_name, sizeof t->pre_name, "%s", pre_name[0] ? pre_name : "default");
    for (int i = 0; i < t->n_regex; i++) pcre2_code_free(t->regex[i]);
    t->n_regex = 0;
    for (int i = 0; i < TOK_MAX_REGEX && spec->regex[i] != NULL; i++) {
        int code;
        PCRE2_SIZE offset;
        pcre2_code *re = pcre2_compile((PCRE2_SPTR)spec->regex[i], PCRE2_ZERO_TERMINATED,
                                       PCRE2_UTF | PCRE2_UCP | PCRE2_DOLLAR_ENDONLY |
                                           PCRE2_MATCH_INVALID_UTF,
                                       &code, &offset, NULL);
        if (re == NULL) {
            char msg[160];
            pcre2_get_error_message(code, (PCRE2_UCHAR *)msg, sizeof msg);
            return ember_fail(err, "tokenizer: pre-tokenizer '%s' regex %d at %zu: %s", pre_name,
                              i, (size_t)offset, msg);
        }
        (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* optional speed-up */
        t->regex[t->n_regex++] = re;
    }
    t->ignore_merges = spec->ignore_merges;
    if (!t->add_bos_set) t->add_bos = spec->add_bos;
    return 0;
}

typedef struct span_list {
    tok_span *v;
    size_t n, cap;
} span_list;

static int span_push(span_list *l, size_t start, size_t len) {
    if (len == 0) return 0;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        tok_span *grown = realloc(l->v, cap * sizeof *grown);
        if (grown == NULL) return -1;
        l->v = grown;
        l->cap = cap;
    }
    l->v[l->n].start = start;
    l->v[l->n].len = len;
    l->n++;
    return 0;
}

/* Length of the character at s, for stepping over an empty match. */
static size_t char_len(const char *s, size_t left) {
    int32_t cp;
    return (size_t)tok_utf8_get((const unsigned char *)s, left, &cp);
}

static int split_piece(const pcre2_code *re, pcre2_match_data *md, const char *text,
                       tok_span piece, span_list *out, ember_error *err) {
    PCRE2_SPTR subject = (PCRE2_SPTR)(text + piece.start);
    size_t pos = 0, gap_start = 0;
    while (pos < piece.len) {
        int rc = pcre2_match(re, subject, piece.len, pos, 0, md, NULL);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
            rc = pcre2_match(re, subject, piece.len, pos, PCRE2_NO_JIT, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            char msg[160];
            pcre2_get_error_message(rc, (PCRE2_UCHAR *)msg, sizeof msg);
            return ember_fail(err, "tokenizer: regex match failed: %s", msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t m_start = ov[0], m_end = ov[1];
        if (m_end == m_start) { /* empty match: step one character */
            pos = m_start + char_len(text + piece.start + m_start, piece.len - m_start);
            continue;
        }
        if (span_push(out, piece.start + gap_start, m_start - gap_start) != 0 ||
            span_push(out, piece.start + m_start, m_end - m_start) != 0)
            return ember_fail(err, "tokenizer: out of memory");
        gap_start = pos = m_end;
    }
    if (span_push(out, piece.start + gap_start, piece.len - gap_start) != 0)
        return ember_fail(err, "tokenizer: out of memory");
    return 0;
}

int tok_pretokenize(const tokenizer *t, const char *text, size_t len, tok_span **pieces,
                    size_t *n_pieces, ember_error *err) {
    span_list cur = {0}, next = {0};
    pcre2_match_data *md = NULL;
    if (span_push(&cur, 0, len) != 0) goto oom;
    md = pcre2_match_data_create(4, NULL);
    if (md == NULL) goto oom;
    for (int r = 0; r < t->n_regex; r++) {
        next.n = 0;
        for (size_t i = 0; i < cur.n; i++)
            if (split_piece(t->regex[r], md, text, cur.v[i], &next, err) != 0) goto fail;
        span_list swap = cur;
        cur = next;
        next = swap;
    }
    pcre2_match_data_free(md);
    free(next.v);
    *pieces = cur.v;
    *n_pieces = cur.n;
    return 0;
oom:
    ember_fail(err, "tokenizer: out of memory");
fail:
    pcre2_match_data_free(md);
    free(cur.v);
    free(next.v);
    return -1;
}
