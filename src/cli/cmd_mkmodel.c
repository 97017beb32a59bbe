/* cmd_mkmodel.c - `ember mkmodel`: write a random-weight GGUF model.
 *
 * Design: the command only resolves options into (architecture, preset
 * config, weight type, tokenizer source, seed) and then drives three steps
 * from mkmodel_*.c: hyperparameter keys, the tensor plan, and streamed
 * weights. The tokenizer decides the vocabulary size: ember's built-in byte
 * vocabulary by default, the tokenizer.* keys of another GGUF with --vocab,
 * or a Hugging Face directory with --tokenizer-dir. The qwen3-0.6b preset
 * looks for the Qwen3 tokenizer among the fixtures and pads the vocabulary
 * to the real model's 151,936 rows with unused <|reserved_N|> tokens, as
 * the released model pads its 151,669 real tokens.
 *
 * Exit status: 0 written, 1 failure while building or writing, 2 bad usage. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli_opts.h"
#include "cli/commands.h"
#include "cli/mkmodel.h"
#include "tokenizer/tokenizer.h"

typedef struct mk_options {
    const char *arch;
    const char *preset;
    const char *type;
    const char *vocab;
    const char *tokenizer_dir;
    const char *out;
    uint64_t seed;
    int threads;
    bool mtp;
} mk_options;

enum { OPT_ARCH, OPT_PRESET, OPT_TYPE, OPT_VOCAB, OPT_TOKENIZER_DIR, OPT_OUT, OPT_SEED, OPT_THREADS, OPT_MTP };

static const char *weight_types(void) { return "f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q2_k q3_k q4_k q5_k q6_k iq4_nl iq4_xs"; }

static const cli_option mkmodel_options[] = {
    {OPT_ARCH, "--arch", NULL, "ARCH", "architecture (implied by --preset qwen3-0.6b)", mk_arch_names},
    {OPT_PRESET, "--preset", NULL, "NAME", "size preset (default tiny)", mk_preset_names},
    {OPT_TYPE, "--type", NULL, "TYPE", "weight type of the matrices; norms stay f32 (default f32)", weight_types},
    {OPT_VOCAB, "--vocab", NULL, "GGUF", "copy the tokenizer.* keys of this GGUF", NULL},
    {OPT_TOKENIZER_DIR, "--tokenizer-dir", NULL, "DIR", "import a Hugging Face byte-level BPE tokenizer directory", NULL},
    {OPT_OUT, "--out", "-o", "FILE", "output path, written via FILE.tmp and renamed (required)", NULL},
    {OPT_SEED, "--seed", NULL, "S", "weight seed (default 1); same seed, same bytes", NULL},
    {OPT_THREADS, "--threads", NULL, "N", "worker threads (default: all CPUs)", NULL},
    {OPT_MTP, "--mtp", NULL, NULL, "qwen35: store one MTP (nextn) block after the trunk, as converted Qwen3.5 files do", NULL},
    {0, NULL, NULL, NULL, NULL, NULL},
};

const cli_command cmd_mkmodel_command = {
    "mkmodel", cmd_mkmodel, "--arch ARCH [--preset NAME] [--type TYPE] [--vocab GGUF | --tokenizer-dir DIR] --out FILE",
    "write a random-weight GGUF model of any supported architecture",
    "The weights are deterministic: the same seed gives the same bytes. The tokenizer decides the vocabulary: ember's "
    "built-in byte vocabulary by default, another GGUF's with --vocab, or a Hugging Face directory with "
    "--tokenizer-dir.",
    mkmodel_options, false, false,
};

static int usage_error(const char *fmt, const char *arg) {
    char msg[512];
    snprintf(msg, sizeof msg, fmt, arg);
    return cli_usage_error(&cmd_mkmodel_command, "%s", msg);
}

/* Returns 0, or the exit status for a usage problem / help (-1 = help shown). */
static int parse_options(int argc, char **argv, mk_options *o) {
    *o = (mk_options){.preset = "tiny", .type = "f32", .seed = 1, .threads = 0};
    cli_args args;
    cli_args_init(&args, &cmd_mkmodel_command, argc, argv);
    for (int id; (id = cli_next(&args)) != CLI_END;) {
        const char *value = args.value;
        switch (id) {
        case OPT_ARCH: o->arch = value; continue;
        case OPT_PRESET: o->preset = value; continue;
        case OPT_TYPE: o->type = value; continue;
        case OPT_VOCAB: o->vocab = value; continue;
        case OPT_TOKENIZER_DIR: o->tokenizer_dir = value; continue;
        case OPT_OUT: o->out = value; continue;
        case OPT_MTP: o->mtp = true; continue;
        case CLI_ARG: return usage_error("unexpected argument '%s'", value);
        default: break;
        }
        char *end;
        errno = 0;
        unsigned long long v = strtoull(value, &end, 10);
        if (errno != 0 || end == value || *end != '\0' || value[0] == '-')
            return usage_error("'%s' is not a non-negative integer", value);
        if (id == OPT_SEED) {
            o->seed = v;
        } else {
            if (v > 1024) return usage_error("--threads %s is out of range (0..1024)", value);
            o->threads = (int)v;
        }
    }
    return args.status == 0 ? -1 : args.status > 0 ? args.status : 0;
}

/* ---- tokenizer ---- */

/* Where the Qwen3 tokenizer fixture would be, or NULL. */
static const char *find_qwen3_tokenizer(char *buf, size_t cap) {
    const char *root = getenv("EMBER_FIXTURES");
    if (root == NULL || root[0] == '\0') root = "../shared/fixtures";
    snprintf(buf, cap, "%s/models/tokenizers/qwen3", root);
    char probe[4200];
    snprintf(probe, sizeof probe, "%s/vocab.json", buf);
    struct stat st;
    return stat(probe, &st) == 0 ? buf : NULL;
}

/* Rewrites tokens and token_type with unused <|reserved_N|> entries up to
 * target, keeping everything else tokenizer_write_gguf_keys wrote. */
static int pad_vocabulary(const tokenizer *tok, int64_t target, gguf_writer *w, ember_error *err) {
    int32_t n = tokenizer_n_vocab(tok);
    if (strcmp(tokenizer_model_name(tok), "gpt2") != 0)
        return ember_fail(err, "cannot pad a '%s' vocabulary (scores would be needed)", tokenizer_model_name(tok));
    const char **texts = calloc((size_t)target, sizeof *texts);
    uint64_t *lens = calloc((size_t)target, sizeof *lens);
    int32_t *types = calloc((size_t)target, sizeof *types);
    char *pad_text = malloc((size_t)(target - n) * 24 + 1);
    if (texts == NULL || lens == NULL || types == NULL || pad_text == NULL) {
        free(texts);
        free(lens);
        free(types);
        free(pad_text);
        return ember_fail(err, "out of memory");
    }
    char *p = pad_text;
    for (int64_t id = 0; id < target; id++) {
        if (id < n) {
            size_t len;
            texts[id] = tokenizer_token_text(tok, (int32_t)id, &len);
            lens[id] = len;
            types[id] = (int32_t)tokenizer_token_type(tok, (int32_t)id);
        } else {
            int len = sprintf(p, "<|reserved_%lld|>", (long long)(id - n));
            texts[id] = p;
            lens[id] = (uint64_t)len;
            types[id] = TOK_TYPE_UNUSED;
            p += len + 1;
        }
    }
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", texts, lens, (uint64_t)target);
    gguf_writer_set_arr(w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, types, (uint64_t)target);
    free(texts);
    free(lens);
    free(types);
    free(pad_text);
    return 0;
}

/* Writes the tokenizer keys and returns the vocabulary size, or -1. */
static int64_t write_tokenizer(const mk_options *o, const mk_preset *preset, gguf_writer *w, ember_error *err) {
    if (o->vocab) {
        gguf_file *src = gguf_open(o->vocab, err);
        if (src == NULL) return -1;
        int64_t n_vocab = -1;
        gguf_value_type et;
        uint64_t count;
        if (gguf_get_arr(src, "tokenizer.ggml.tokens", &et, &count) && et == GGUF_TYPE_STRING && count > 0)
            n_vocab = (int64_t)count;
        else
            ember_fail(err, "%s: no tokenizer.ggml.tokens string array", o->vocab);
        if (n_vocab > 0)
            for (int64_t i = 0; i < gguf_kv_count(src); i++)
                if (strncmp(gguf_kv_key(src, i), "tokenizer.", 10) == 0) gguf_writer_copy_kv(w, src, i);
        gguf_close(src);
        return n_vocab;
    }
    char dir_buf[4096];
    const char *dir = o->tokenizer_dir;
    /* The qwen3 presets take Qwen3's own tokenizer when the fixtures have it. */
    if (dir == NULL && preset->vocab_target > 0 && preset->only_arch && strcmp(preset->only_arch, "qwen3") == 0)
        dir = find_qwen3_tokenizer(dir_buf, sizeof dir_buf);
    tokenizer *tok = dir ? tokenizer_load_hf_dir(dir, NULL, err) : tokenizer_builtin_bytes(err);
    if (tok == NULL) {
        if (dir) ember_fail_prefix(err, "tokenizer directory %s", dir);
        return -1;
    }
    int64_t n_vocab = tokenizer_n_vocab(tok);
    int rc = tokenizer_write_gguf_keys(tok, w, err);
    if (rc == 0 && preset->vocab_target > n_vocab) {
        rc = pad_vocabulary(tok, preset->vocab_target, w, err);
        n_vocab = preset->vocab_target;
    }
    tokenizer_free(tok);
    return rc == 0 ? n_vocab : -1;
}

/* ---- command ---- */

/* Large presets take a while: one self-overwriting line on a terminal. */
#define MK_PROGRESS_MIN_BYTES (8ull << 20)

static void show_progress(void *user, uint64_t done, uint64_t total) {
    (void)user;
    fprintf(stderr, "\rember mkmodel: weights %.1f of %.1f MiB (%d%%)", (double)done / 1048576.0,
            (double)total / 1048576.0, total ? (int)(100 * done / total) : 100);
    if (done >= total) fputs("\r\033[K", stderr);
    fflush(stderr);
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

int cmd_mkmodel(int argc, char **argv) {
    mk_options o;
    int rc = parse_options(argc, argv, &o);
    if (rc != 0) return rc < 0 ? 0 : rc;

    const mk_preset *preset = mk_preset_find(o.preset);
    if (preset == NULL) return usage_error("unknown preset '%s'", o.preset);
    if (o.arch == NULL) o.arch = preset->only_arch;
    if (o.arch == NULL) return usage_error("--arch is required%s", "");
    const mk_arch *arch = mk_arch_find(o.arch);
    if (arch == NULL) return usage_error("unknown architecture '%s'", o.arch);
    if (preset->only_arch && strcmp(preset->only_arch, o.arch) != 0)
        return usage_error("preset '%s' is only for its own architecture", preset->name);
    int type_id = dtype_from_name(o.type);
    if (type_id < 0 || !mk_weight_type_ok((ember_dtype)type_id)) return usage_error("unsupported --type '%s'", o.type);
    if (o.out == NULL) return usage_error("--out is required%s", "");
    if (o.mtp && !mk_arch_has_mtp(arch)) return usage_error("--mtp: architecture '%s' has no MTP block", o.arch);
    if (o.vocab && o.tokenizer_dir) return usage_error("--vocab and --tokenizer-dir exclude each other%s", "");

    double t0 = now_seconds();
    ember_error err = {{0}};
    mk_config config = preset->config;
    if (preset->only_arch == NULL) config.tied = mk_arch_tied(arch);
    config.n_nextn = o.mtp ? 1 : 0;
    gguf_writer *w = gguf_writer_create();
    ember_pool *pool = NULL;
    mk_tensor *tensors = NULL;
    mk_weights *weights = NULL;
    int n_tensors = 0;
    rc = 1;
    if (w == NULL) {
        ember_fail(&err, "out of memory");
        goto done;
    }
    char model_name[128];
    snprintf(model_name, sizeof model_name, "ember-random-%s-%s", mk_arch_name(arch), preset->name);
    mk_write_hparams(arch, &config, model_name, (ember_dtype)type_id, o.seed, w);
    /* The tokenizer fixes n_vocab, which the embedding shapes need. */
    config.n_vocab = write_tokenizer(&o, preset, w, &err);
    if (config.n_vocab < 0) goto done;

    n_tensors = mk_plan_tensors(arch, &config, (ember_dtype)type_id, &tensors, &err);
    if (n_tensors < 0) goto done;
    pool = ember_pool_create(o.threads);
    weights = mk_weights_add(w, tensors, n_tensors, &config, o.seed, pool, &err);
    if (weights == NULL) goto done;
    if (isatty(STDERR_FILENO) && mk_weights_bytes(weights) >= MK_PROGRESS_MIN_BYTES)
        mk_weights_set_progress(weights, show_progress, NULL);
    if (gguf_writer_write(w, o.out, &err) != 0) goto done;
    rc = 0;

done:
    if (rc == 0) {
        struct stat st;
        long long size = stat(o.out, &st) == 0 ? (long long)st.st_size : -1;
        printf("wrote %s: %s %s, %s, %d tensors, vocab %lld, %lld bytes in %.2f s\n", o.out, mk_arch_name(arch),
               preset->name, dtype_info_of((uint32_t)type_id)->name, n_tensors, (long long)config.n_vocab, size,
               now_seconds() - t0);
    } else {
        fprintf(stderr, "ember mkmodel: %s\n", err.msg);
    }
    mk_weights_free(weights);
    free(tensors);
    ember_pool_free(pool);
    gguf_writer_free(w);
    return rc;
}
