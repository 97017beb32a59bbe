/* cmd_inspect.c - `ember inspect MODEL`: metadata, tensor table, tokenizer
 * and the cache stack ember detects. The GGUF is listed first from the
 * reader alone, so a file whose architecture ember cannot run can still be
 * inspected; the model-level sections follow when the model loads. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "cli/cli_opts.h"
#include "cli/commands.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "tensor/dtype.h"

static void print_value(const gguf_file *f, int64_t i) {
    int64_t iv;
    double dv;
    gguf_str s;
    gguf_value_type et;
    uint64_t count;
    bool bv;
    if (gguf_kv_bool(f, i, &bv)) {
        printf("%s", bv ? "true" : "false");
    } else if (gguf_kv_int(f, i, &iv)) {
        printf("%" PRId64, iv);
    } else if (gguf_kv_float(f, i, &dv)) {
        printf("%g", dv);
    } else if (gguf_kv_str(f, i, &s)) {
        int n = s.len > 80 ? 80 : (int)s.len;
        printf("\"");
        for (int k = 0; k < n; k++) putchar(s.ptr[k] == '\n' ? ' ' : s.ptr[k]);
        printf("\"%s", s.len > 80 ? "... (" : "");
        if (s.len > 80) printf("%" PRIu64 " bytes)", s.len);
    } else if (gguf_kv_arr(f, i, &et, &count)) {
        printf("[%s x %" PRIu64 "]", gguf_type_name(et), count);
        if (count > 0 && count <= 8 && et != GGUF_TYPE_STRING) {
            printf(" =");
            for (uint64_t k = 0; k < count; k++) {
                if (et == GGUF_TYPE_FLOAT32 || et == GGUF_TYPE_FLOAT64) printf(" %g", gguf_arr_float(f, i, k));
                else printf(" %" PRId64, gguf_arr_int(f, i, k));
            }
        }
    }
}

static const cli_option inspect_options[] = {
    {0, NULL, NULL, NULL, NULL, NULL},
};

const cli_command cmd_inspect_command = {
    "inspect", cmd_inspect, "MODEL", "show metadata, tensors, tokenizer and cache stack",
    "The GGUF listing needs only the reader, so a file whose architecture ember cannot run can still be "
    "inspected; the model, tokenizer and cache-stack sections follow when the model loads (exit 1 when it "
    "does not).",
    inspect_options, false, false,
};

int cmd_inspect(int argc, char **argv) {
    const char *path = NULL;
    cli_args args;
    cli_args_init(&args, &cmd_inspect_command, argc, argv);
    while (cli_next(&args) != CLI_END) {
        if (path) return cli_usage_error(&cmd_inspect_command, "one model only ('%s' and '%s')", path, args.value);
        path = args.value;
    }
    if (args.status >= 0) return args.status;
    if (path == NULL) return cli_usage_error(&cmd_inspect_command, "no model file");
    ember_error err;
    gguf_file *f = gguf_open(path, &err);
    if (f == NULL) {
        fprintf(stderr, "ember: %s\n", err.msg);
        return 1;
    }
    printf("file: %s\nGGUF v%u, alignment %u, data at offset %" PRIu64 ", %" PRIu64 " bytes\n\n", path,
           gguf_version(f), gguf_alignment(f), gguf_data_offset(f), gguf_file_size(f));
    printf("metadata (%" PRId64 " keys):\n", gguf_kv_count(f));
    for (int64_t i = 0; i < gguf_kv_count(f); i++) {
        printf("  %-48s %-4s ", gguf_kv_key(f, i), gguf_type_name(gguf_kv_type(f, i)));
        print_value(f, i);
        printf("\n");
    }
    uint64_t total = 0;
    printf("\ntensors (%" PRId64 "):\n", gguf_tensor_count(f));
    for (int64_t i = 0; i < gguf_tensor_count(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        const dtype_info *info = dtype_info_of(t->type);
        char shape[96];
        int len = snprintf(shape, sizeof shape, "{%" PRId64, t->ne[0]);
        for (uint32_t d = 1; d < t->n_dims; d++) len += snprintf(shape + len, sizeof shape - (size_t)len, ", %" PRId64, t->ne[d]);
        snprintf(shape + len, sizeof shape - (size_t)len, "}");
        printf("  %-40s %-5s %-24s %12" PRIu64 " bytes\n", t->name, info ? info->name : "?", shape, t->nbytes);
        total += t->nbytes;
    }
    printf("  total %" PRIu64 " bytes\n", total);
    gguf_close(f);

    model *m = model_load(path, &err);
    if (m == NULL) {
        printf("\nmodel: not loadable by ember: %s\n", err.msg);
        return 1;
    }
    const model_hparams *hp = model_get_hparams(m);
    printf("\nmodel: %s (%s), %d layers, n_embd %d, heads %d/%d (q/kv), head size %d/%d (k/v), FFN %d, vocab %d, "
           "context %d, rope %s base %g over %d dims, %s output\n",
           hp->arch_name, hp->name, hp->n_layer, hp->n_embd, hp->n_head, hp->n_head_kv, hp->d_k, hp->d_v, hp->n_ff,
           hp->n_vocab, hp->n_ctx_train, hp->rope.mode == ROPE_NORM ? "normal" : "neox", hp->rope.freq_base,
           hp->rope.n_rot, hp->tied_output ? "tied" : "separate");
    if (hp->n_expert) printf("experts: %d, %d used per token, expert FFN %d\n", hp->n_expert, hp->n_expert_used, hp->n_ff_exp);

    const tokenizer *tok = model_get_tokenizer(m);
    printf("tokenizer: %s%s%s, %d tokens, bos %d, eos %d, eot %d, add_bos %s, chat template %s\n",
           tokenizer_model_name(tok), tokenizer_pre_name(tok)[0] ? " pre " : "", tokenizer_pre_name(tok),
           tokenizer_n_vocab(tok), tokenizer_bos(tok), tokenizer_eos(tok), tokenizer_eot(tok),
           tokenizer_add_bos(tok) ? "yes" : "no", tokenizer_chat_template(tok) ? "present" : "absent");

    const cache_layer *stack = model_cache_stack(m);
    int counts[CACHE_KIND_OTHER + 1] = {0};
    printf("cache stack:");
    for (int il = 0; il < hp->n_layer; il++) {
        counts[stack[il].kind]++;
        printf(" %s", cache_kind_name(stack[il].kind));
    }
    printf("\ncache stack summary: %d kv / %d rot / %d arr / %d list / %d other\n", counts[CACHE_KIND_KV],
           counts[CACHE_KIND_ROT], counts[CACHE_KIND_ARR], counts[CACHE_KIND_LIST], counts[CACHE_KIND_OTHER]);
    model_free(m);
    return 0;
}
