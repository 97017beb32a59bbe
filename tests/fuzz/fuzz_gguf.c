/* fuzz_gguf.c - libFuzzer target for the GGUF reader.
 *
 * The input is a whole file image. gguf_open_memory runs the same header,
 * metadata, tensor-table and bounds validation as gguf_open on a mapped
 * file; on success every accessor is walked (every key by type, every array
 * element, every tensor's data range), then the tokenizer is built from the
 * image's tokenizer.* keys, the next thing model_load does with a file.
 * A rejected image must come with a message. Seeds (tests/fuzz/gguf/corpus)
 * are small valid GGUF files written by this target's -seeds option with the
 * GGUF writer (every scalar type, arrays, a tokenizer, tensors of several
 * types), so mutations start past the magic and the counts:
 *
 *   build-fuzz/fuzz_gguf -seeds tests/fuzz/gguf/corpus
 *   make fuzz-all FUZZ_SECONDS=600        # every target, 10 minutes each */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/log.h"
#include "gguf/gguf.h"
#include "tokenizer/tokenizer.h"
#include "fuzz_target.h"

/* ---- seeds ---- */

static void write_seed(const char *dir, int idx, bool with_vocab, uint32_t type) {
    gguf_writer *w = gguf_writer_create();
    ember_error err;
    gguf_writer_set_str(w, "general.architecture", "llama");
    gguf_writer_set_str(w, "general.name", "fuzz seed");
    gguf_writer_set_u32(w, "llama.block_count", 1);
    gguf_writer_set_i32(w, "llama.signed", -7);
    gguf_writer_set_u64(w, "llama.context_length", 64);
    gguf_writer_set_f32(w, "llama.rope.freq_base", 10000.0f);
    gguf_writer_set_bool(w, "llama.flag", true);
    const int32_t sections[4] = {3, 3, 2, 0};
    gguf_writer_set_arr(w, "llama.rope.dimension_sections", GGUF_TYPE_INT32, sections, 4);
    const char *strs[3] = {"a", "bc", ""};
    gguf_writer_set_arr_str(w, "fuzz.strings", strs, NULL, 3);
    if (with_vocab) {
        tokenizer *tok = tokenizer_builtin_bytes(&err);
        if (tok) {
            tokenizer_write_gguf_keys(tok, w, &err);
            tokenizer_free(tok);
        }
    }
    static float f32[64];
    static uint8_t q8[34 * 2];
    for (int i = 0; i < 64; i++) f32[i] = (float)i / 8.0f;
    const int64_t ne_vec[1] = {64}, ne_mat[2] = {32, 2};
    gguf_writer_add_tensor(w, "output_norm.weight", 0 /* f32 */, 1, ne_vec, f32, &err);
    if (type == 8) /* q8_0: two blocks of 32 */
        gguf_writer_add_tensor(w, "token_embd.weight", type, 2, ne_mat, q8, &err);
    else
        gguf_writer_add_tensor(w, "token_embd.weight", 0, 2, ne_mat, f32, &err);
    char path[4096];
    snprintf(path, sizeof path, "%s/seed-%02d.gguf", dir, idx);
    if (gguf_writer_write(w, path, &err) < 0) fprintf(stderr, "fuzz_gguf: %s\n", err.msg);
    gguf_writer_free(w);
}

/* libFuzzer calls this before its own argument parsing. */
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    ember_log_set_level(EMBER_LOG_ERROR);
    for (int i = 1; i + 1 < *argc; i++)
        if (strcmp((*argv)[i], "-seeds") == 0) {
            write_seed((*argv)[i + 1], 0, false, 0);
            write_seed((*argv)[i + 1], 1, true, 0);
            write_seed((*argv)[i + 1], 2, true, 8);
            printf("wrote 3 seeds to %s\n", (*argv)[i + 1]);
            exit(0);
        }
    return 0;
}

static volatile uint64_t sink; /* keeps the reads from being optimised away */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ember_error err;
    err.msg[0] = '\0';
    gguf_file *f = gguf_open_memory(data, size, &err);
    if (f == NULL) {
        if (err.msg[0] == '\0') abort(); /* a rejection must say why */
        return 0;
    }
    uint64_t acc = gguf_version(f) + gguf_alignment(f) + gguf_data_offset(f) + gguf_file_size(f);
    for (int64_t i = 0; i < gguf_kv_count(f); i++) {
        const char *key = gguf_kv_key(f, i);
        acc += strlen(key) + (uint64_t)gguf_kv_type(f, i);
        if (gguf_find_key(f, key) < 0) abort(); /* every listed key can be found */
        int64_t iv;
        double dv;
        bool bv;
        gguf_str s;
        if (gguf_kv_int(f, i, &iv)) acc += (uint64_t)iv;
        if (gguf_kv_float(f, i, &dv)) acc += (uint64_t)(dv == dv);
        if (gguf_kv_bool(f, i, &bv)) acc += bv;
        if (gguf_kv_str(f, i, &s)) {
            for (uint64_t k = 0; k < s.len; k++) acc += (uint8_t)s.ptr[k];
        }
        gguf_value_type et;
        uint64_t count;
        if (gguf_kv_arr(f, i, &et, &count)) {
            for (uint64_t k = 0; k < count && k < 4096; k++) {
                if (et == GGUF_TYPE_STRING) {
                    gguf_str e = gguf_arr_str(f, i, k);
                    if (e.len) acc += (uint8_t)e.ptr[e.len - 1];
                } else if (et == GGUF_TYPE_FLOAT32 || et == GGUF_TYPE_FLOAT64) {
                    acc += (uint64_t)(gguf_arr_float(f, i, k) == 0.0);
                } else if (et != GGUF_TYPE_ARRAY) {
                    acc += (uint64_t)gguf_arr_int(f, i, k);
                }
            }
            if (count > 0 && gguf_arr_data(f, i) == NULL && et != GGUF_TYPE_STRING && et != GGUF_TYPE_ARRAY) abort();
        }
    }
    for (int64_t i = 0; i < gguf_tensor_count(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        if (gguf_find_tensor(f, t->name) == NULL) abort();
        /* A tensor that passed validation lies inside the image. */
        const uint8_t *p = t->data;
        if (t->nbytes > 0) acc += p[0] + p[t->nbytes - 1];
    }
    tokenizer *tok = tokenizer_load_gguf(f, &err);
    if (tok) {
        acc += (uint64_t)tokenizer_n_vocab(tok);
        int32_t *ids = NULL;
        size_t n = 0;
        if (tokenizer_encode(tok, "Hello world", 11, true, true, &ids, &n, &err) == 0) acc += n;
        free(ids);
        tokenizer_free(tok);
    }
    sink = acc;
    gguf_close(f);
    return 0;
}
