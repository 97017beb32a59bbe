/* test_tokenizer.c - tokenizer tests against llama.cpp's vocabulary corpora.
 *
 * The reference ids come from llama.cpp's models/ggml-vocab-*.gguf.inp/.out
 * pairs (produced by the Hugging Face tokenizers with
 * add_special_tokens=False). Every vocabulary whose GGUF is present and
 * whose algorithm ember supports must reproduce all cases; for the vocab
 * GGUFs missing from the fixtures, the HF tokenizer directories stand in
 * (llama3 for llama-bpe, qwen3 for qwen2). Also covered: decode(encode(x)),
 * the streaming detokenizer on multi-byte text, special-token parsing, the
 * built-in vocabulary and the GGUF export round trip. */
#define _GNU_SOURCE
#include "test_util.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"

/* ---- Corpus files ---- */

typedef struct corpus {
    char *inp_buf;
    char **texts;
    size_t *text_lens;
    int32_t **ids;
    size_t *n_ids;
    size_t n;
} corpus;

static void corpus_free(corpus *c) {
    for (size_t i = 0; i < c->n; i++) free(c->ids[i]);
    free(c->ids);
    free(c->n_ids);
    free(c->texts);
    free(c->text_lens);
    free(c->inp_buf);
    memset(c, 0, sizeof *c);
}

/* Loads <base>.inp and <base>.out; false when either is missing. */
static bool corpus_load(const char *inp_path, const char *out_path, corpus *c) {
    static const char sep[] = "\n__ggml_vocab_test__\n";
    memset(c, 0, sizeof *c);
    size_t inp_size, out_size;
    c->inp_buf = read_whole_file(inp_path, &inp_size);
    char *out_buf = read_whole_file(out_path, &out_size);
    if (c->inp_buf == NULL || out_buf == NULL) {
        free(out_buf);
        corpus_free(c);
        return false;
    }
    size_t cap = 0;
    for (char *p = c->inp_buf; (p = strstr(p, sep)) != NULL; p += sizeof sep - 1) cap++;
    c->texts = calloc(cap + 1, sizeof *c->texts);
    c->text_lens = calloc(cap + 1, sizeof *c->text_lens);
    c->ids = calloc(cap + 1, sizeof *c->ids);
    c->n_ids = calloc(cap + 1, sizeof *c->n_ids);
    char *p = c->inp_buf;
    for (size_t i = 0; i < cap; i++) {
        char *end = strstr(p, sep);
        c->texts[i] = p;
        c->text_lens[i] = (size_t)(end - p);
        *end = '\0';
        p = end + sizeof sep - 1;
    }
    char *line = out_buf;
    for (size_t i = 0; i < cap && line != NULL; i++) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = '\0';
        c->ids[i] = malloc(sizeof(int32_t) * (strlen(line) / 2 + 1));
        size_t k = 0;
        for (char *q = line, *e; *q; q = e) {
            long v = strtol(q, &e, 10);
            if (e == q) break;
            c->ids[i][k++] = (int32_t)v;
        }
        c->n_ids[i] = k;
        c->n = i + 1;
        line = nl ? nl + 1 : NULL;
    }
    free(out_buf);
    return c->n == cap;
}

static bool ids_equal(const int32_t *a, size_t na, const int32_t *b, size_t nb) {
    return na == nb && (na == 0 || memcmp(a, b, na * sizeof *a) == 0);
}

static void print_ids(const char *label, const int32_t *ids, size_t n) {
    print_message("    %s:", label);
    for (size_t i = 0; i < n; i++) print_message(" %d", ids[i]);
    print_message("\n");
}

/* Encodes every case; returns the number that match. Prints mismatches. */
static size_t run_corpus(const tokenizer *t, const char *name, const corpus *c, size_t *roundtrip_ok) {
    size_t pass = 0;
    *roundtrip_ok = 0;
    for (size_t i = 0; i < c->n; i++) {
        int32_t *ids = NULL;
        size_t n = 0;
        ember_error err = {{0}};
        assert_int_equal(tokenizer_encode(t, c->texts[i], c->text_lens[i], false, false, &ids, &n, &err), 0);
        if (ids_equal(ids, n, c->ids[i], c->n_ids[i])) {
            pass++;
        } else {
            print_message("  %s case %zu mismatch: \"%s\"\n", name, i, c->texts[i]);
            print_ids("expected", c->ids[i], c->n_ids[i]);
            print_ids("got     ", ids, n);
        }
        char *text = NULL;
        size_t len = 0;
        assert_int_equal(tokenizer_decode(t, ids, n, false, &text, &len, &err), 0);
        if (len == c->text_lens[i] && memcmp(text, c->texts[i], len) == 0) (*roundtrip_ok)++;
        free(text);
        free(ids);
    }
    return pass;
}

static tokenizer *load_gguf_tokenizer(const char *path, ember_error *err) {
    gguf_file *f = gguf_open(path, err);
    if (f == NULL) return NULL;
    tokenizer *t = tokenizer_load_gguf(f, err);
    gguf_close(f);
    return t;
}

/* ---- The vocabulary corpora ---- */

static int compare_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static void test_vocab_corpora(void **state) {
    (void)state;
    REQUIRE_FIXTURE(dir_path, "models/vocab");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", dir_path);
    DIR *d = opendir(dir);
    assert_non_null(d);
    char *names[128];
    size_t n_names = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL && n_names < 128) {
        size_t len = strlen(de->d_name);
        if (len > 9 && strcmp(de->d_name + len - 9, ".gguf.inp") == 0)
            names[n_names++] = strndup(de->d_name, len - 4); /* "...gguf" */
    }
    closedir(d);
    qsort(names, n_names, sizeof names[0], compare_str);

    int checked = 0;
    for (size_t v = 0; v < n_names; v++) {
        char gguf_path[1200], inp[1200], out[1200];
        snprintf(gguf_path, sizeof gguf_path, "%s/%s", dir, names[v]);
        snprintf(inp, sizeof inp, "%s/%s.inp", dir, names[v]);
        snprintf(out, sizeof out, "%s/%s.out", dir, names[v]);
        corpus c;
        if (!corpus_load(inp, out, &c)) {
            print_message("%-36s skipped: no .out\n", names[v]);
            free(names[v]);
            continue;
        }
        FILE *probe = fopen(gguf_path, "rb");
        if (probe == NULL) {
            print_message("%-36s skipped: GGUF not in fixtures\n", names[v]);
            corpus_free(&c);
            free(names[v]);
            continue;
        }
        fclose(probe);
        ember_error err = {{0}};
        tokenizer *t = load_gguf_tokenizer(gguf_path, &err);
        if (t == NULL) {
            /* Only "unsupported algorithm" may be skipped; anything else is a bug. */
            assert_non_null(strstr(err.msg, "unsupported"));
            print_message("%-36s skipped: %s\n", names[v], err.msg);
            corpus_free(&c);
            free(names[v]);
            continue;
        }
        size_t roundtrip = 0;
        size_t pass = run_corpus(t, names[v], &c, &roundtrip);
        print_message("%-36s %s/%s: %zu/%zu pass, decode round trip %zu/%zu\n", names[v],
                      tokenizer_model_name(t), tokenizer_pre_name(t), pass, c.n, roundtrip, c.n);
        assert_int_equal(pass, c.n);
        if (strcmp(tokenizer_model_name(t), "gpt2") == 0) assert_int_equal(roundtrip, c.n);
        checked++;
        tokenizer_free(t);
        corpus_free(&c);
        free(names[v]);
    }
    assert_true(checked > 0);
}

static void check_hf_dir(const char *tok_dir, const char *vocab_name, const char *expect_pre) {
    char rel_inp[256], rel_out[256];
    snprintf(rel_inp, sizeof rel_inp, "models/vocab/%s.inp", vocab_name);
    snprintf(rel_out, sizeof rel_out, "models/vocab/%s.out", vocab_name);
    REQUIRE_FIXTURE(dir, tok_dir);
    REQUIRE_FIXTURE(inp, rel_inp);
    REQUIRE_FIXTURE(out, rel_out);
    char dir_copy[1024];
    snprintf(dir_copy, sizeof dir_copy, "%s", dir);
    corpus c;
    assert_true(corpus_load(inp, out, &c));

    ember_error err = {{0}};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    tokenizer *t = tokenizer_load_hf_dir(dir_copy, NULL, &err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (t == NULL) fail_msg("load %s: %s", dir_copy, err.msg);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    assert_string_equal(tokenizer_pre_name(t), expect_pre);
    size_t roundtrip = 0;
    size_t pass = run_corpus(t, tok_dir, &c, &roundtrip);
    print_message("%-36s %s (%d tokens, loaded in %.3f s): %zu/%zu pass, decode round trip %zu/%zu\n",
                  tok_dir, vocab_name, tokenizer_n_vocab(t), secs, pass, c.n, roundtrip, c.n);
    assert_int_equal(pass, c.n);
    assert_int_equal(roundtrip, c.n);
    /* The load time is printed, not asserted: a timed check fails on a
     * loaded machine without anything being wrong (benchmarks measure). */
    tokenizer_free(t);
    corpus_free(&c);
}

static void test_hf_llama3(void **state) {
    (void)state;
    check_hf_dir("models/tokenizers/llama3", "ggml-vocab-llama-bpe.gguf", "llama-bpe");
}

static void test_hf_qwen3(void **state) {
    (void)state;
    check_hf_dir("models/tokenizers/qwen3", "ggml-vocab-qwen2.gguf", "qwen2");
}

/* ---- Streaming detokenizer ---- */

static bool valid_utf8(const char *s, size_t n) {
    const unsigned char *b = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        size_t need = b[i] < 0x80 ? 1 : (b[i] >= 0xC2 && b[i] <= 0xDF) ? 2
                    : (b[i] >= 0xE0 && b[i] <= 0xEF) ? 3 : (b[i] >= 0xF0 && b[i] <= 0xF4) ? 4 : 0;
        if (need == 0 || i + need > n) return false;
        for (size_t k = 1; k < need; k++)
            if ((b[i + k] & 0xC0) != 0x80) return false;
        i += need;
    }
    return true;
}

static const char MULTIBYTE_TEXT[] =
    "Hello \xF0\x9F\xA6\x99 llama! \xE4\xBD\xA0\xE5\xA5\xBD\xE4\xB8\x96\xE7\x95\x8C "
    "\xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x91\xA7 "
    "\xE1\x9E\x80\xE1\x9E\xB6\xE1\x9E\x9A \xF0\x9F\x98\x80\xF0\x9F\x98\x81 caf\xC3\xA9";

/* Streams the encoding of MULTIBYTE_TEXT; every chunk must be valid UTF-8
 * and the chunks must add up to the text. Returns how many tokens ended
 * inside a character (so the test is known to exercise the hold-back). */
static int stream_roundtrip(const tokenizer *t) {
    int32_t *ids = NULL;
    size_t n = 0;
    ember_error err = {{0}};
    assert_int_equal(tokenizer_encode(t, MULTIBYTE_TEXT, strlen(MULTIBYTE_TEXT), false, false, &ids, &n, &err), 0);
    tok_stream *s = tok_stream_create(t, false);
    assert_non_null(s);
    char joined[512];
    size_t total = 0;
    int partial = 0;
    for (size_t i = 0; i < n; i++) {
        char piece[64];
        int np = tokenizer_token_to_piece(t, ids[i], false, piece, sizeof piece);
        assert_true(np >= 0);
        if (!valid_utf8(piece, (size_t)np)) partial++;
        size_t len;
        const char *chunk = tok_stream_push(s, ids[i], &len);
        assert_non_null(chunk);
        assert_true(valid_utf8(chunk, len));
        assert_true(total + len < sizeof joined);
        memcpy(joined + total, chunk, len);
        total += len;
    }
    size_t len;
    const char *tail = tok_stream_flush(s, &len);
    assert_int_equal(len, 0);
    (void)tail;
    assert_int_equal(total, strlen(MULTIBYTE_TEXT));
    assert_memory_equal(joined, MULTIBYTE_TEXT, total);
    tok_stream_free(s);
    free(ids);
    return partial;
}

static void test_stream_utf8(void **state) {
    (void)state;
    ember_error err = {{0}};
    tokenizer *b = tokenizer_builtin_bytes(&err);
    assert_non_null(b);
    assert_true(stream_roundtrip(b) > 0); /* pure bytes: every multi-byte char is split */

    /* A lone continuation byte and a truncated sequence become U+FFFD. */
    tok_stream *s = tok_stream_create(b, false);
    size_t len;
    const char *out = tok_stream_push(s, 0x80, &len);
    assert_int_equal(len, 3);
    assert_memory_equal(out, "\xEF\xBF\xBD", 3);
    out = tok_stream_push(s, 0xE4, &len);
    assert_int_equal(len, 0);
    out = tok_stream_flush(s, &len);
    assert_int_equal(len, 3);
    assert_memory_equal(out, "\xEF\xBF\xBD", 3);
    tok_stream_free(s);
    tokenizer_free(b);

    const char *spm = fixture_path("models/vocab/ggml-vocab-llama-spm.gguf");
    if (spm != NULL) {
        tokenizer *t = load_gguf_tokenizer(spm, &err);
        assert_non_null(t);
        assert_true(stream_roundtrip(t) > 0); /* byte-fallback tokens */
        tokenizer_free(t);
    }
    const char *qwen = fixture_path("models/tokenizers/qwen3");
    if (qwen != NULL) {
        tokenizer *t = tokenizer_load_hf_dir(qwen, NULL, &err);
        assert_non_null(t);
        stream_roundtrip(t);
        tokenizer_free(t);
    }
}

/* ---- Special tokens ---- */

static bool contains(const int32_t *ids, size_t n, int32_t id) {
    for (size_t i = 0; i < n; i++)
        if (ids[i] == id) return true;
    return false;
}

static void test_special_tokens_qwen3(void **state) {
    (void)state;
    REQUIRE_FIXTURE(dir, "models/tokenizers/qwen3");
    ember_error err = {{0}};
    tokenizer *t = tokenizer_load_hf_dir(dir, NULL, &err);
    assert_non_null(t);
    assert_int_equal(tokenizer_n_vocab(t), 151669);
    int32_t im_start = tokenizer_find_token(t, "<|im_start|>", 12);
    int32_t im_end = tokenizer_find_token(t, "<|im_end|>", 10);
    int32_t think = tokenizer_find_token(t, "<think>", 7);
    assert_int_equal(im_start, 151644);
    assert_int_equal(im_end, 151645);
    assert_int_equal(think, 151667);
    assert_int_equal(tokenizer_token_type(t, im_start), TOK_TYPE_CONTROL);
    assert_int_equal(tokenizer_token_type(t, think), TOK_TYPE_USER_DEFINED);
    assert_int_equal(tokenizer_token_type(t, 151659), TOK_TYPE_CONTROL); /* <|fim_prefix|> looks special */
    assert_int_equal(tokenizer_eos(t), 151645);
    assert_int_equal(tokenizer_pad(t), 151643);
    assert_int_equal(tokenizer_eot(t), 151645);
    assert_true(tokenizer_is_eog(t, 151645));
    assert_true(tokenizer_is_eog(t, 151643));
    assert_false(tokenizer_is_eog(t, im_start));
    assert_false(tokenizer_add_bos(t));
    assert_non_null(tokenizer_chat_template(t));
    assert_non_null(strstr(tokenizer_chat_template(t), "<|im_start|>"));

    const char *text = "<|im_start|>user\nHi<think>x</think><|im_end|>";
    int32_t *ids;
    size_t n;
    assert_int_equal(tokenizer_encode(t, text, strlen(text), true, true, &ids, &n, &err), 0);
    assert_true(n >= 6);
    assert_int_equal(ids[0], im_start);
    assert_int_equal(ids[n - 1], im_end);
    assert_true(contains(ids, n, think));
    char *dec;
    size_t dec_len;
    assert_int_equal(tokenizer_decode(t, ids, n, true, &dec, &dec_len, &err), 0);
    assert_string_equal(dec, text);
    free(dec);
    assert_int_equal(tokenizer_decode(t, ids, n, false, &dec, &dec_len, &err), 0);
    assert_string_equal(dec, "user\nHi<think>x</think>"); /* CONTROL hidden, USER_DEFINED kept */
    free(dec);
    free(ids);

    /* Without parse_special, CONTROL texts are plain text; USER_DEFINED still split. */
    assert_int_equal(tokenizer_encode(t, text, strlen(text), false, false, &ids, &n, &err), 0);
    assert_false(contains(ids, n, im_start));
    assert_false(contains(ids, n, im_end));
    assert_true(contains(ids, n, think));
    free(ids);

    /* Pieces: raw bytes, negative size when the buffer is short. */
    char buf[4];
    int32_t hello = tokenizer_find_token(t, "\xC4\xA0" "Hello", 7);
    assert_true(hello >= 0);
    assert_int_equal(tokenizer_token_to_piece(t, hello, false, buf, sizeof buf), -6);
    char big[16];
    assert_int_equal(tokenizer_token_to_piece(t, hello, false, big, sizeof big), 6);
    assert_memory_equal(big, " Hello", 6);
    assert_int_equal(tokenizer_token_to_piece(t, im_end, false, big, sizeof big), 0);
    assert_int_equal(tokenizer_token_to_piece(t, im_end, true, big, sizeof big), 10);
    tokenizer_free(t);
}

static void test_spm_specials(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, "models/vocab/ggml-vocab-llama-spm.gguf");
    ember_error err = {{0}};
    tokenizer *t = load_gguf_tokenizer(path, &err);
    assert_non_null(t);
    assert_string_equal(tokenizer_model_name(t), "llama");
    assert_int_equal(tokenizer_bos(t), 1);
    assert_int_equal(tokenizer_eos(t), 2);
    assert_true(tokenizer_add_bos(t));
    int32_t *ids;
    size_t n;
    const char *text = "Hello world";
    assert_int_equal(tokenizer_encode(t, text, strlen(text), true, false, &ids, &n, &err), 0);
    assert_true(n >= 2);
    assert_int_equal(ids[0], 1);
    char *dec;
    size_t len;
    assert_int_equal(tokenizer_decode(t, ids, n, false, &dec, &len, &err), 0);
    assert_string_equal(dec, text); /* BOS hidden, prefix space stripped */
    free(dec);
    free(ids);
    /* "</s>" is CONTROL: only recognised with parse_special. */
    text = "a</s>b";
    assert_int_equal(tokenizer_encode(t, text, strlen(text), false, true, &ids, &n, &err), 0);
    assert_true(contains(ids, n, 2));
    free(ids);
    assert_int_equal(tokenizer_encode(t, text, strlen(text), false, false, &ids, &n, &err), 0);
    assert_false(contains(ids, n, 2));
    free(ids);
    /* Empty input gives no tokens, or just BOS. */
    assert_int_equal(tokenizer_encode(t, "", 0, false, false, &ids, &n, &err), 0);
    assert_int_equal(n, 0);
    free(ids);
    assert_int_equal(tokenizer_encode(t, "", 0, true, false, &ids, &n, &err), 0);
    assert_int_equal(n, 1);
    free(ids);
    tokenizer_free(t);
}

static void test_unsupported_model(void **state) {
    (void)state;
    REQUIRE_FIXTURE(path, "models/vocab/ggml-vocab-bert-bge.gguf");
    ember_error err = {{0}};
    assert_null(load_gguf_tokenizer(path, &err));
    assert_non_null(strstr(err.msg, "unsupported tokenizer model 'bert'"));
    assert_null(tokenizer_load_hf_dir("/nonexistent-dir", NULL, &err));
    assert_non_null(strstr(err.msg, "vocab.json"));
}

/* ---- Built-in vocabulary ---- */

static void test_builtin(void **state) {
    (void)state;
    ember_error err = {{0}};
    tokenizer *t = tokenizer_builtin_bytes(&err);
    assert_non_null(t);
    assert_string_equal(tokenizer_model_name(t), "gpt2");
    assert_string_equal(tokenizer_pre_name(t), "qwen2");
    int32_t nv = tokenizer_n_vocab(t);
    assert_int_equal(nv, 256 + 35 + 3);
    assert_int_equal(tokenizer_find_token(t, "a", 1), 'a');
    int32_t eot_id = tokenizer_find_token(t, "<|endoftext|>", 13);
    int32_t im_start = tokenizer_find_token(t, "<|im_start|>", 12);
    int32_t im_end = tokenizer_find_token(t, "<|im_end|>", 10);
    assert_int_equal(eot_id, nv - 3);
    assert_int_equal(im_start, nv - 2);
    assert_int_equal(im_end, nv - 1);
    assert_int_equal(tokenizer_eos(t), eot_id);
    assert_int_equal(tokenizer_pad(t), eot_id);
    assert_int_equal(tokenizer_eot(t), im_end);
    assert_true(tokenizer_is_eog(t, im_end));
    assert_true(tokenizer_is_eog(t, eot_id));
    assert_false(tokenizer_is_eog(t, im_start));
    assert_int_equal(tokenizer_token_type(t, im_start), TOK_TYPE_CONTROL);
    assert_non_null(strstr(tokenizer_chat_template(t), "<|im_start|>"));

    const char *text = "<|im_start|>user\nthe cat and the dog\xE2\x9C\x93<|im_end|>";
    int32_t *ids;
    size_t n;
    assert_int_equal(tokenizer_encode(t, text, strlen(text), false, true, &ids, &n, &err), 0);
    assert_int_equal(ids[0], im_start);
    assert_int_equal(ids[n - 1], im_end);
    assert_true(contains(ids, n, tokenizer_find_token(t, "\xC4\xA0" "the", 5)));
    assert_true(contains(ids, n, tokenizer_find_token(t, "\xC4\xA0" "and", 5)));
    char *dec;
    size_t len;
    assert_int_equal(tokenizer_decode(t, ids, n, true, &dec, &len, &err), 0);
    assert_string_equal(dec, text);
    free(dec);
    free(ids);
    /* Every byte value round-trips. */
    char all[256];
    for (int i = 0; i < 256; i++) all[i] = (char)i;
    assert_int_equal(tokenizer_encode(t, all, sizeof all, false, false, &ids, &n, &err), 0);
    assert_int_equal(tokenizer_decode(t, ids, n, false, &dec, &len, &err), 0);
    assert_int_equal(len, 256);
    assert_memory_equal(dec, all, 256);
    free(dec);
    free(ids);
    tokenizer_free(t);
}

/* ---- GGUF export round trip ---- */

static void check_roundtrip(tokenizer *t, const corpus *c) {
    ember_error err = {{0}};
    char *dir = make_temp_dir();
    assert_non_null(dir);
    char path[1200];
    snprintf(path, sizeof path, "%s/tok.gguf", dir);
    gguf_writer *w = gguf_writer_create();
    assert_non_null(w);
    gguf_writer_set_str(w, "general.architecture", "llama");
    if (tokenizer_write_gguf_keys(t, w, &err) != 0) fail_msg("write keys: %s", err.msg);
    if (gguf_writer_write(w, path, &err) != 0) fail_msg("write: %s", err.msg);
    gguf_writer_free(w);
    tokenizer *back = load_gguf_tokenizer(path, &err);
    if (back == NULL) fail_msg("reload: %s", err.msg);

    assert_int_equal(tokenizer_n_vocab(back), tokenizer_n_vocab(t));
    assert_string_equal(tokenizer_model_name(back), tokenizer_model_name(t));
    assert_string_equal(tokenizer_pre_name(back), tokenizer_pre_name(t));
    assert_int_equal(tokenizer_eos(back), tokenizer_eos(t));
    assert_int_equal(tokenizer_eot(back), tokenizer_eot(t));
    assert_int_equal(tokenizer_add_bos(back), tokenizer_add_bos(t));
    assert_int_equal(tokenizer_add_eos(back), tokenizer_add_eos(t));
    if (tokenizer_add_bos(t)) assert_int_equal(tokenizer_bos(back), tokenizer_bos(t));
    for (int32_t i = 0; i < tokenizer_n_vocab(t); i++) {
        size_t la, lb;
        const char *a = tokenizer_token_text(t, i, &la), *b = tokenizer_token_text(back, i, &lb);
        assert_int_equal(la, lb);
        assert_memory_equal(a, b, la);
        assert_int_equal(tokenizer_token_type(t, i), tokenizer_token_type(back, i));
        assert_int_equal(tokenizer_is_eog(t, i), tokenizer_is_eog(back, i));
    }
    const char *ta = tokenizer_chat_template(t), *tb = tokenizer_chat_template(back);
    assert_true((ta == NULL) == (tb == NULL));
    if (ta) assert_string_equal(ta, tb);
    for (size_t i = 0; c != NULL && i < c->n; i++) {
        for (int mode = 0; mode < 2; mode++) {
            int32_t *a, *b;
            size_t na, nb;
            assert_int_equal(tokenizer_encode(t, c->texts[i], c->text_lens[i], mode, mode, &a, &na, &err), 0);
            assert_int_equal(tokenizer_encode(back, c->texts[i], c->text_lens[i], mode, mode, &b, &nb, &err), 0);
            assert_true(ids_equal(a, na, b, nb));
            free(a);
            free(b);
        }
    }
    tokenizer_free(back);
    remove_tree(dir);
    free(dir);
}

static void test_gguf_roundtrip(void **state) {
    (void)state;
    ember_error err = {{0}};
    corpus c = {0};
    const char *inp = fixture_path("models/vocab/ggml-vocab-qwen2.gguf.inp");
    const char *out = fixture_path("models/vocab/ggml-vocab-qwen2.gguf.out");
    bool have_corpus = inp && out && corpus_load(inp, out, &c);

    tokenizer *t = tokenizer_builtin_bytes(&err);
    check_roundtrip(t, have_corpus ? &c : NULL);
    tokenizer_free(t);

    const char *qwen = fixture_path("models/tokenizers/qwen3");
    if (qwen != NULL) {
        t = tokenizer_load_hf_dir(qwen, NULL, &err);
        assert_non_null(t);
        check_roundtrip(t, have_corpus ? &c : NULL);
        tokenizer_free(t);
    }
    const char *spm = fixture_path("models/vocab/ggml-vocab-llama-spm.gguf");
    if (spm != NULL) {
        t = load_gguf_tokenizer(spm, &err);
        assert_non_null(t);
        check_roundtrip(t, have_corpus ? &c : NULL);
        tokenizer_free(t);
    }
    if (have_corpus) corpus_free(&c);
}

/* Every pre-tokenizer name family compiles, splits and round-trips text; an
 * unknown name is a clean load error. Uses the built-in vocabulary with the
 * pre key replaced. */
static void test_all_pretokenizers(void **state) {
    (void)state;
    static const char *const names[] = {
        "llama-bpe", "dbrx", "qwen2", "qwen35", "gpt-2", "starcoder", "falcon", "default",
        "deepseek-coder", "deepseek-llm", "deepseek-v3", "gpt-4o", "tekken", "chameleon",
        "no-such-pre"};
    const char *text = "Hello, World! It's 12345 caf\xC3\xA9s.\n\n  \tC\xE1\xBB\xAD" "a Vi\xE1\xBB\x87t "
                       "\xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\xA6\x99 HELLOworld don'T   end  ";
    ember_error err = {{0}};
    tokenizer *base = tokenizer_builtin_bytes(&err);
    assert_non_null(base);
    char *dir = make_temp_dir();
    char path[1200];
    snprintf(path, sizeof path, "%s/pre.gguf", dir);
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        gguf_writer *w = gguf_writer_create();
        assert_int_equal(tokenizer_write_gguf_keys(base, w, &err), 0);
        gguf_writer_set_str(w, "tokenizer.ggml.pre", names[i]);
        assert_int_equal(gguf_writer_write(w, path, &err), 0);
        gguf_writer_free(w);
        tokenizer *t = load_gguf_tokenizer(path, &err);
        if (strcmp(names[i], "no-such-pre") == 0) {
            assert_null(t);
            assert_non_null(strstr(err.msg, "unsupported pre-tokenizer 'no-such-pre'"));
            continue;
        }
        if (t == NULL) fail_msg("%s: %s", names[i], err.msg);
        int32_t *ids;
        size_t n;
        char *dec;
        size_t len;
        assert_int_equal(tokenizer_encode(t, text, strlen(text), false, false, &ids, &n, &err), 0);
        assert_int_equal(tokenizer_decode(t, ids, n, false, &dec, &len, &err), 0);
        assert_string_equal(dec, text);
        free(dec);
        free(ids);
        tokenizer_free(t);
    }
    remove_tree(dir);
    free(dir);
    tokenizer_free(base);
}

/* ---- llama.cpp's own tokenizations of the reference fixture prompts ---- */

/* Each reference/NAME.json records the prompt text and the ids llama.cpp
 * produced for it (add_special = true, parse_special = false) from
 * NAME.gguf's vocabulary, and the vocabulary texts of its greedy tokens. */
static void test_reference_prompts(void **state) {
    (void)state;
    REQUIRE_FIXTURE(dir_path, "reference");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", dir_path);
    DIR *d = opendir(dir);
    assert_non_null(d);
    struct dirent *de;
    int checked = 0;
    while ((de = readdir(d)) != NULL) {
        size_t len = strlen(de->d_name);
        if (len < 6 || strcmp(de->d_name + len - 5, ".json") != 0 || strcmp(de->d_name, "index.json") == 0)
            continue;
        char path[1400];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        char *text = read_whole_file(path, NULL);
        assert_non_null(text);
        cJSON *json = cJSON_Parse(text);
        free(text);
        assert_non_null(json);
        const cJSON *model = cJSON_GetObjectItem(json, "model_file");
        const cJSON *prompt = cJSON_GetObjectItem(json, "prompt");
        const cJSON *ptext = cJSON_GetObjectItem(prompt, "text");
        const cJSON *pids = cJSON_GetObjectItem(prompt, "ids");
        if (!cJSON_IsString(model) || !cJSON_IsString(ptext) || !cJSON_IsArray(pids)) {
            cJSON_Delete(json);
            continue;
        }
        snprintf(path, sizeof path, "%s/%s", dir, model->valuestring);
        ember_error err = {{0}};
        tokenizer *t = load_gguf_tokenizer(path, &err);
        if (t == NULL) fail_msg("%s: %s", path, err.msg);
        bool add_special = cJSON_IsTrue(cJSON_GetObjectItem(prompt, "add_special"));
        bool parse_special = cJSON_IsTrue(cJSON_GetObjectItem(prompt, "parse_special"));
        int32_t *ids;
        size_t n;
        assert_int_equal(tokenizer_encode(t, ptext->valuestring, strlen(ptext->valuestring), add_special,
                                          parse_special, &ids, &n, &err), 0);
        assert_int_equal(n, (size_t)cJSON_GetArraySize(pids));
        for (size_t i = 0; i < n; i++) assert_int_equal(ids[i], cJSON_GetArrayItem(pids, (int)i)->valueint);
        free(ids);
        const cJSON *greedy = cJSON_GetObjectItem(json, "greedy");
        const cJSON *gids = cJSON_GetObjectItem(greedy, "ids"), *pieces = cJSON_GetObjectItem(greedy, "pieces");
        for (int i = 0; i < cJSON_GetArraySize(pieces) && i < cJSON_GetArraySize(gids); i++) {
            const char *want = cJSON_GetArrayItem(pieces, i)->valuestring;
            size_t tl;
            const char *got = tokenizer_token_text(t, cJSON_GetArrayItem(gids, i)->valueint, &tl);
            assert_non_null(got);
            assert_string_equal(got, want);
        }
        tokenizer_free(t);
        cJSON_Delete(json);
        checked++;
    }
    closedir(d);
    print_message("reference prompts: %d fixtures tokenized exactly as llama.cpp did\n", checked);
    assert_true(checked > 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vocab_corpora),
        cmocka_unit_test(test_hf_llama3),
        cmocka_unit_test(test_hf_qwen3),
        cmocka_unit_test(test_stream_utf8),
        cmocka_unit_test(test_special_tokens_qwen3),
        cmocka_unit_test(test_spm_specials),
        cmocka_unit_test(test_unsupported_model),
        cmocka_unit_test(test_builtin),
        cmocka_unit_test(test_gguf_roundtrip),
        cmocka_unit_test(test_reference_prompts),
        cmocka_unit_test(test_all_pretokenizers),
    };
    return test_run_group(tests, NULL, NULL);
}
