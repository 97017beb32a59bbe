/* fuzz_tokenizer.c - libFuzzer target for the tokenizers.
 *
 * The first input byte picks a vocabulary and the encode options, the rest
 * is the text. Vocabularies, loaded once from the fixtures
 * ($EMBER_FIXTURES, default ../shared/fixtures):
 *   SPM  models/stories260K.gguf (SentencePiece BPE with byte fallback);
 *   BPE  models/tokenizers/qwen3 (byte-level BPE, qwen2 pre-tokenizer, 151k
 *        tokens, a Hugging Face directory).
 * Properties checked on every input:
 *  - encode either succeeds with ids inside the vocabulary or fails with a
 *    message; valid UTF-8 always encodes;
 *  - round trip: without special-token parsing and without BOS/EOS,
 *    decode(encode(text)) == text byte for byte wherever the tokenizer
 *    guarantees it: byte-level BPE for any text it encodes (every byte has a
 *    token), SPM for valid UTF-8 that does not itself contain U+2581 (SPM
 *    stores spaces as U+2581, so a literal one comes back as a space);
 *  - the streaming detokenizer emits valid UTF-8 only, and exactly
 *    tokenizer_decode's text whenever that text is valid UTF-8.
 * A failed property aborts, which libFuzzer reports as a crash. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"
#include "fuzz_target.h"

static tokenizer *g_tok[2]; /* 0: SPM, 1: BPE */

static const char *fixtures(void) {
    const char *root = getenv("EMBER_FIXTURES");
    return root ? root : "../shared/fixtures";
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    ember_log_set_level(EMBER_LOG_ERROR);
    char path[4096];
    ember_error err;
    snprintf(path, sizeof path, "%s/models/stories260K.gguf", fixtures());
    gguf_file *f = gguf_open(path, &err);
    if (f) {
        g_tok[0] = tokenizer_load_gguf(f, &err);
        gguf_close(f);
    }
    snprintf(path, sizeof path, "%s/models/tokenizers/qwen3", fixtures());
    if (g_tok[0]) g_tok[1] = tokenizer_load_hf_dir(path, NULL, &err);
    if (g_tok[0] == NULL || g_tok[1] == NULL) {
        fprintf(stderr, "fuzz_tokenizer: skipping: cannot load the fixture vocabularies: %s\n", err.msg);
        exit(77);
    }
    return 0;
}

static bool utf8_valid(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (len == 0 || i + len > n) return false;
        uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1f : len == 3 ? c & 0x0f : c & 0x07;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return false;
            cp = cp << 6 | (s[i + k] & 0x3f);
        }
        if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff)) ||
            (cp >= 0xd800 && cp <= 0xdfff))
            return false;
        i += len;
    }
    return true;
}

static bool contains(const char *s, size_t n, const char *needle) {
    size_t k = strlen(needle);
    for (size_t i = 0; i + k <= n; i++)
        if (memcmp(s + i, needle, k) == 0) return true;
    return false;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1 || size > 4096) return 0;
    const tokenizer *t = g_tok[data[0] & 1];
    bool spm = (data[0] & 1) == 0;
    bool add_special = data[0] & 2, parse_special = data[0] & 4;
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    bool valid = utf8_valid((const unsigned char *)text, len);

    ember_error err;
    err.msg[0] = '\0';
    int32_t *ids = NULL;
    size_t n = 0;
    if (tokenizer_encode(t, text, len, add_special, parse_special, &ids, &n, &err) < 0) {
        free(ids);
        if (valid || err.msg[0] == '\0') abort(); /* valid UTF-8 always encodes; a failure says why */
        return 0;
    }
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= tokenizer_n_vocab(t)) abort();

    char *back = NULL;
    size_t back_len = 0;
    if (tokenizer_decode(t, ids, n, false, &back, &back_len, &err) < 0) abort();
    bool round_trip = !add_special && !parse_special && (spm ? valid && !contains(text, len, "\xE2\x96\x81") : true);
    if (round_trip && (back_len != len || memcmp(back, text, len) != 0)) abort();

    tok_stream *s = tok_stream_create(t, false);
    if (s == NULL) abort();
    char *streamed = malloc(4 * (back_len + 16) + 64);
    size_t at = 0, piece_len;
    for (size_t i = 0; i <= n; i++) {
        const char *piece = i < n ? tok_stream_push(s, ids[i], &piece_len) : tok_stream_flush(s, &piece_len);
        if (!utf8_valid((const unsigned char *)piece, piece_len)) abort();
        /* U+FFFD (3 bytes) may replace each malformed byte */
        if (at + piece_len > 4 * (back_len + 16) + 64) abort();
        memcpy(streamed + at, piece, piece_len);
        at += piece_len;
    }
    if (utf8_valid((const unsigned char *)back, back_len) && (at != back_len || memcmp(streamed, back, at) != 0))
        abort();
    tok_stream_free(s);
    free(streamed);
    free(back);
    free(ids);
    return 0;
}
