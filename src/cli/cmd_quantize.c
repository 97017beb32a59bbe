/* cmd_quantize.c - `ember quantize IN.gguf OUT.gguf --type TYPE`.
 *
 * Writes a copy of a model with its matrices in another weight type, as a
 * draft model for speculative decoding is usually made (a Q8_0 or Q4_0 copy
 * of the target). Every key is copied; general.file_type is set to the new
 * type. A tensor is converted when it is a matrix (two or more dimensions)
 * stored in f32, f16 or bf16; 1-D tensors (norms, biases) and tensors that
 * are already quantized are copied as they are. Rows whose length the type's
 * block does not divide fall back as `ember mkmodel` does (k-quants to 32-
 * element types, then f16). Each row goes through f32: dequantize, then
 * quant_quantize_row. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_common.h"
#include "cli/cli_opts.h"
#include "cli/commands.h"
#include "cli/mkmodel.h"
#include "gguf/gguf.h"
#include "tensor/dtype.h"
#include "tensor/quant.h"

enum { OPT_TYPE };

static const char *quant_types(void) { return "f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 q2_k q3_k q4_k q5_k q6_k iq4_nl iq4_xs"; }

static const cli_option quantize_options[] = {
    {OPT_TYPE, "--type", NULL, "TYPE", "weight type of the matrices (required)", quant_types},
    {0, NULL, NULL, NULL, NULL, NULL},
};

const cli_command cmd_quantize_command = {
    "quantize", cmd_quantize, "IN.gguf OUT.gguf --type TYPE",
    "write a copy of a model with its matrices in another weight type",
    "Norms, biases and already quantized tensors are copied as they are. A Q8_0 or Q4_0 copy of a model is the usual "
    "draft model for speculative decoding with it (`ember serve MODEL --draft COPY`).",
    quantize_options, false, false,
};

static bool convertible(const gguf_tensor *t) {
    return t->n_dims >= 2 && (t->type == DT_F32 || t->type == DT_F16 || t->type == DT_BF16);
}

/* The rows of t converted to type: (rows, row bytes of type) in *out. */
static int convert(const gguf_tensor *t, ember_dtype type, void **out, ember_error *err) {
    int64_t n_in = t->ne[0], rows = t->nbytes / dtype_row_bytes((ember_dtype)t->type, n_in);
    size_t src_row = dtype_row_bytes((ember_dtype)t->type, n_in), dst_row = dtype_row_bytes(type, n_in);
    uint8_t *dst = malloc((size_t)rows * dst_row);
    float *row = malloc((size_t)n_in * sizeof(float));
    if (dst == NULL || row == NULL) {
        free(dst);
        free(row);
        return ember_fail(err, "out of memory converting '%s'", t->name);
    }
    for (int64_t r = 0; r < rows; r++) {
        quant_dequantize_row((ember_dtype)t->type, (const uint8_t *)t->data + (size_t)r * src_row, row, n_in);
        if (quant_quantize_row(type, row, dst + (size_t)r * dst_row, n_in) < 0) {
            free(dst);
            free(row);
            return ember_fail(err, "'%s': no quantizer for %s", t->name, dtype_info_of(type)->name);
        }
    }
    free(row);
    *out = dst;
    return 0;
}

int cmd_quantize(int argc, char **argv) {
    const char *paths[2] = {NULL, NULL}, *type_name = NULL;
    int n_paths = 0;
    cli_args args;
    cli_args_init(&args, &cmd_quantize_command, argc, argv);
    for (int id; (id = cli_next(&args)) != CLI_END;) {
        if (id == OPT_TYPE) type_name = args.value;
        else if (id == CLI_ARG) {
            if (n_paths == 2) return cli_usage_error(&cmd_quantize_command, "unexpected argument '%s'", args.value);
            paths[n_paths++] = args.value;
        }
    }
    if (args.status >= 0) return args.status;
    if (n_paths != 2) return cli_usage_error(&cmd_quantize_command, "give the input and the output file");
    if (type_name == NULL) return cli_usage_error(&cmd_quantize_command, "--type is required");
    int type_id = dtype_from_name(type_name);
    if (type_id < 0 || type_id == DT_F32 || !mk_weight_type_ok((ember_dtype)type_id))
        return cli_usage_error(&cmd_quantize_command, "unsupported --type '%s'", type_name);

    ember_error err = {{0}};
    gguf_file *in = gguf_open(paths[0], &err);
    if (in == NULL) {
        fprintf(stderr, "ember: %s\n", err.msg);
        return 1;
    }
    gguf_writer *w = gguf_writer_create();
    int64_t n_tensors = gguf_tensor_count(in), converted = 0;
    void **owned = calloc((size_t)(n_tensors ? n_tensors : 1), sizeof *owned);
    int rc = 1;
    if (w == NULL || owned == NULL) {
        ember_fail(&err, "out of memory");
        goto done;
    }
    for (int64_t i = 0; i < gguf_kv_count(in); i++) gguf_writer_copy_kv(w, in, i);
    gguf_writer_set_u32(w, "general.file_type", mk_file_type((ember_dtype)type_id));
    for (int64_t i = 0; i < n_tensors; i++) {
        const gguf_tensor *t = gguf_tensor_at(in, i);
        const void *data = t->data;
        uint32_t type = t->type;
        if (convertible(t)) {
            ember_dtype to = mk_fallback_type((ember_dtype)type_id, t->ne[0]);
            if (to != (ember_dtype)t->type) {
                if (convert(t, to, &owned[i], &err) < 0) goto done;
                data = owned[i];
                type = to;
                converted++;
            }
        }
        if (gguf_writer_add_tensor(w, t->name, type, t->n_dims, t->ne, data, &err) < 0) goto done;
    }
    if (gguf_writer_write(w, paths[1], &err) < 0) goto done;
    fprintf(stderr, "ember: wrote %s: %lld of %lld tensors converted to %s\n", paths[1], (long long)converted,
            (long long)n_tensors, type_name);
    rc = 0;
done:
    if (rc != 0) fprintf(stderr, "ember: %s\n", err.msg);
    for (int64_t i = 0; i < n_tensors && owned; i++) free(owned[i]);
    free(owned);
    gguf_writer_free(w);
    gguf_close(in);
    return rc;
}
