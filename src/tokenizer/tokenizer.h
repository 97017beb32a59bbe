/* tokenizer.h - text <-> token ids for the vocabularies ember runs.
 *
 * Contract: a tokenizer is built once (from a GGUF's tokenizer.* keys, from a
 * Hugging Face style byte-level BPE directory, or ember's built-in byte
 * vocabulary) and is read-only afterwards, so one instance may be shared by
 * any number of threads that encode or decode concurrently. Two algorithms
 * are implemented: byte-level BPE (`gpt2`, with the regex pre-tokenizer named
 * by tokenizer.ggml.pre) and SentencePiece-style score-driven BPE (`llama`,
 * with byte fallback). Encoding reproduces llama.cpp / Hugging Face output id
 * for id. Decoding returns raw bytes per token (a token may end inside a
 * UTF-8 sequence); tok_stream reassembles them into valid UTF-8 text.
 * Failures are reported through ember_error, never printed. */
#ifndef EMBER_TOKENIZER_H
#define EMBER_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/error.h"
#include "gguf/gguf.h"

typedef struct tokenizer tokenizer;
typedef struct tok_stream tok_stream;

/* Token types as stored in tokenizer.ggml.token_type. */
typedef enum tok_type {
    TOK_TYPE_UNDEFINED = 0,
    TOK_TYPE_NORMAL = 1,
    TOK_TYPE_UNKNOWN = 2,
    TOK_TYPE_CONTROL = 3,
    TOK_TYPE_USER_DEFINED = 4,
    TOK_TYPE_UNUSED = 5,
    TOK_TYPE_BYTE = 6,
} tok_type;

/* ---- Creation and destruction ---- */

/* From the tokenizer.ggml.* keys of an open GGUF. The file may be closed
 * afterwards: everything needed is copied. Unsupported models (bert, t5, ...)
 * and unknown pre-tokenizer names are errors. */
tokenizer *tokenizer_load_gguf(const gguf_file *f, ember_error *err);

/* From a Hugging Face byte-level BPE directory: vocab.json + merges.txt or
 * encoder.json + vocab.bpe, plus optional added_tokens.json,
 * tokenizer_config.json (added/special tokens, bos/eos, add_bos_token,
 * chat_template) and config.json (bos_token_id/eos_token_id fallback).
 * pre_name names the pre-tokenizer (e.g. "qwen2", "llama-bpe"); NULL guesses
 * it: tokenizer_class Qwen2* -> qwen2, a tiktoken-style encoder.json with
 * >= 100k tokens -> llama-bpe, otherwise gpt-2. */
tokenizer *tokenizer_load_hf_dir(const char *dir, const char *pre_name, ember_error *err);

/* ember's built-in vocabulary: byte-level BPE (model gpt2, pre qwen2) whose
 * ids 0..255 are the 256 bytes, followed by a small fixed set of English
 * merges, then the ChatML specials <|endoftext|> (eos, pad), <|im_start|>
 * and <|im_end|> (eot) as CONTROL tokens, with a ChatML chat template. */
tokenizer *tokenizer_builtin_bytes(ember_error *err);

void tokenizer_free(tokenizer *t);

/* ---- Encoding ----
 * add_special: prepend BOS / append EOS as the vocabulary's add_bos/add_eos
 * say. parse_special: also recognise CONTROL tokens written as text
 * (USER_DEFINED tokens are always recognised). *ids is malloc'd; the caller
 * frees it (it is non-NULL even when *n_ids is 0). Returns 0 or -1. */
int tokenizer_encode(const tokenizer *t, const char *text, size_t len, bool add_special,
                     bool parse_special, int32_t **ids, size_t *n_ids, ember_error *err);

/* ---- Rendered chats ----
 * Text a user wrote may spell a control token ("<|im_end|>"); in a rendered
 * chat only the template's own markup may become one. Before rendering,
 * tokenizer_defuse_specials copies a user string with
 * TOKENIZER_DEFUSE_MARK (a byte that valid UTF-8 never holds) between the
 * bytes of every CONTROL/UNKNOWN token text in it, and at an edge of the
 * string that a neighbouring string could complete into one. The render is
 * then tokenized with tokenizer_encode_rendered: special tokens parsed
 * (the template's markup), the marks dropped from the text between them,
 * so a defused string tokenizes as plain text and a string without token
 * text tokenizes exactly as before. Returns a malloc'd, NUL-terminated copy
 * (*out_len bytes) or NULL. USER_DEFINED tokens are matched either way, as
 * with parse_special off. */
#define TOKENIZER_DEFUSE_MARK 0xFF
char *tokenizer_defuse_specials(const tokenizer *t, const char *s, size_t len, size_t *out_len);
int tokenizer_encode_rendered(const tokenizer *t, const char *text, size_t len, bool add_special, int32_t **ids,
                              size_t *n_ids, ember_error *err);

/* ---- Decoding ----
 * The raw bytes of one token (possibly a partial UTF-8 sequence). CONTROL,
 * UNKNOWN and UNUSED tokens are empty unless render_special. Returns the
 * number of bytes written, or -(bytes needed) when cap is too small (nothing
 * is written then). Out-of-range ids are empty. */
int tokenizer_token_to_piece(const tokenizer *t, int32_t id, bool render_special, char *buf,
                             size_t cap);

/* Concatenated pieces of ids (raw bytes, NUL-terminated, caller frees). For
 * SPM vocabularies with add_space_prefix the space that encoding inserted
 * before the first text is removed. Returns 0 or -1. */
int tokenizer_decode(const tokenizer *t, const int32_t *ids, size_t n_ids, bool render_special,
                     char **text, size_t *len, ember_error *err);

/* Streaming detokenizer: feed ids one at a time, receive only complete,
 * valid UTF-8 (bytes of a character split across tokens are held back;
 * malformed bytes become U+FFFD). The returned pointer is owned by the stream
 * and valid until the next call; it is NUL-terminated. */
tok_stream *tok_stream_create(const tokenizer *t, bool render_special);
void tok_stream_free(tok_stream *s);
const char *tok_stream_push(tok_stream *s, int32_t id, size_t *len);
/* Emits whatever is still held back (an incomplete sequence as U+FFFD) and
 * resets the stream for a new text. */
const char *tok_stream_flush(tok_stream *s, size_t *len);

/* ---- Accessors ---- */
int32_t tokenizer_n_vocab(const tokenizer *t);
int32_t tokenizer_bos(const tokenizer *t); /* -1 when the vocabulary has none */
int32_t tokenizer_eos(const tokenizer *t);
int32_t tokenizer_eot(const tokenizer *t);
int32_t tokenizer_pad(const tokenizer *t);
int32_t tokenizer_unk(const tokenizer *t);
bool tokenizer_is_eog(const tokenizer *t, int32_t id);
bool tokenizer_add_bos(const tokenizer *t); /* true only when a BOS id exists too */
bool tokenizer_add_eos(const tokenizer *t);
/* Token text exactly as stored in the vocabulary (byte-mapped for BPE, with
 * U+2581 for spaces in SPM), NUL-terminated; NULL for an out-of-range id. */
const char *tokenizer_token_text(const tokenizer *t, int32_t id, size_t *len);
tok_type tokenizer_token_type(const tokenizer *t, int32_t id);
/* Id of an exact vocabulary text, or -1. */
int32_t tokenizer_find_token(const tokenizer *t, const char *text, size_t len);
const char *tokenizer_model_name(const tokenizer *t); /* "llama" or "gpt2" */
const char *tokenizer_pre_name(const tokenizer *t);   /* "" for SPM */
const char *tokenizer_chat_template(const tokenizer *t); /* NULL when absent */

/* ---- Export ----
 * Writes the full tokenizer.ggml.* key set (model, pre, tokens, token_type,
 * scores for SPM, merges for BPE, special ids, add_bos/add_eos,
 * add_space_prefix for SPM, chat_template) so that the written file loads
 * back identically here and in llama.cpp. Returns 0 or -1. */
int tokenizer_write_gguf_keys(const tokenizer *t, gguf_writer *w, ember_error *err);

/*
 * API by purpose:
 *   create/free  tokenizer_load_gguf, tokenizer_load_hf_dir, tokenizer_builtin_bytes,
 *                tokenizer_free
 *   encode       tokenizer_encode
 *   decode       tokenizer_token_to_piece, tokenizer_decode,
 *                tok_stream_create, tok_stream_push, tok_stream_flush, tok_stream_free
 *   inspect      tokenizer_n_vocab, tokenizer_bos, tokenizer_eos, tokenizer_eot,
 *                tokenizer_pad, tokenizer_unk, tokenizer_is_eog, tokenizer_add_bos,
 *                tokenizer_add_eos, tokenizer_token_text, tokenizer_token_type,
 *                tokenizer_find_token, tokenizer_model_name, tokenizer_pre_name,
 *                tokenizer_chat_template
 *   export       tokenizer_write_gguf_keys
 */

#endif
