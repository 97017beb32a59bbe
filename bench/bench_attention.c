/* bench_attention.c - one layer's prefill attention at length, f32, bf16 and int8.
 *
 * The 16k prefill target of issue 15 is bound by attention's rate
 * (docs/attention.md); the engine bench takes minutes per 16k run and mixes
 * in the weights, so this times the attention op alone. A paged pool of
 * random rows (qwen3-0.6b's shape by default: 16 query heads, 8 kv heads of
 * 128 values, f16 rows in 16-token blocks, the blocks scattered as a served
 * pool scatters them) and one chunk of --chunk query rows ending at key P
 * (the last chunk of a P-token prefill), run as the forward pass runs it:
 * op_attention_paged_rows_prec over units of --rows rows of one kv head's
 * query heads. Prints per precision the best and the median call in
 * GFLOP/s (2 * d per q.k and per p.v product of each visible key), on one
 * thread.
 *
 * Usage: bench_attention [--keys 16384] [--chunk 512] [--rows 32] [--reps 5]
 *                        [--kv f16|f32|q8_0] [--precision f32|bf16|int8|both|all]
 * --precision both: f32 and bf16 (as before int8 existed); all: the three.
 *                        [--window W] [--huge 0|1] [--pad BYTES] [--tiles 0|1]
 * --window W: a sliding window of W keys. --huge 1 asks for huge pages
 * (MADV_HUGEPAGE) on the blocks' arena; --pad adds BYTES between blocks
 * (with huge pages, blocks 1.75 MiB apart all fall on the same cache sets).
 * --tiles 1: at bf16 and int8, the K/V tiles of every kv head are built once per
 * chunk (op_attention_bf16_tiles_build, as forward.c does for long
 * batches) and the calls run on them; the build is inside the timing. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "core/clock.h"
#include "tensor/kv_rows.h"
#include "tensor/ops.h"

enum { N_HEAD = 16, N_HEAD_KV = 8, D = 128, BLOCK = 16 };

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static float frand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((*s >> 40) & 0xFFFFFF) / 16777216.0f * 2.0f - 1.0f;
}

int main(int argc, char **argv) {
    long keys = 16384, chunk = 512, rows = 32;
    int reps = 5, huge = 0, use_tiles = 0;
    long pad = 0, window = 0;
    const char *kv = "f16", *prec_name = "both";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--keys")) keys = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--chunk")) chunk = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--rows")) rows = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--reps")) reps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--kv")) kv = argv[i + 1];
        else if (!strcmp(argv[i], "--precision")) prec_name = argv[i + 1];
        else if (!strcmp(argv[i], "--huge")) huge = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--pad")) pad = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--window")) window = atol(argv[i + 1]);
        else if (!strcmp(argv[i], "--tiles")) use_tiles = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "bench_attention: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    kv_row_type type;
    if (!strcmp(kv, "f16")) type = KV_ROW_F16;
    else if (!strcmp(kv, "f32")) type = KV_ROW_F32;
    else if (!strcmp(kv, "q8_0")) type = KV_ROW_Q8_0;
    else {
        fprintf(stderr, "bench_attention: --kv f16|f32|q8_0\n");
        return 2;
    }
    if (chunk > keys || chunk < 1 || rows < 1 || reps < 1) {
        fprintf(stderr, "bench_attention: need 1 <= chunk <= keys, rows >= 1\n");
        return 2;
    }
    size_t row_bytes = kv_row_bytes(type, N_HEAD_KV * D);
    long n_blocks = (keys + BLOCK - 1) / BLOCK;
    /* Blocks 1.8 MiB apart in one mapping, as a pool of 28 layers keeps one
     * layer's blocks: each block of this layer is followed by other layers'. */
    size_t spacing = 28 * 2 * BLOCK * row_bytes + (size_t)pad;
    size_t arena_bytes = ((size_t)n_blocks * spacing + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
    uint8_t *arena = aligned_alloc(2u << 20, arena_bytes);
    if (arena && huge) madvise(arena, arena_bytes, MADV_HUGEPAGE);
    const void **k_blocks = malloc((size_t)n_blocks * sizeof(void *));
    const void **v_blocks = malloc((size_t)n_blocks * sizeof(void *));
    float *row = malloc(N_HEAD_KV * D * sizeof(float));
    if (!arena || !k_blocks || !v_blocks || !row) {
        fprintf(stderr, "bench_attention: out of memory\n");
        return 1;
    }
    uint64_t seed = 1;
    for (long b = 0; b < n_blocks; b++) {
        /* scatter: block b at slot (b * 7919) % n_blocks */
        uint8_t *base = arena + (size_t)((b * 7919) % n_blocks) * spacing;
        k_blocks[b] = base;
        v_blocks[b] = base + BLOCK * row_bytes;
        for (int t = 0; t < 2 * BLOCK; t++) {
            for (int i = 0; i < N_HEAD_KV * D; i++) row[i] = frand(&seed);
            kv_row_encode(type, row, base + (size_t)t * row_bytes, N_HEAD_KV * D);
        }
    }
    float *q = malloc((size_t)chunk * N_HEAD * D * sizeof(float));
    float *out = malloc((size_t)chunk * N_HEAD * D * sizeof(float));
    float *scratch = malloc((size_t)rows * (N_HEAD / N_HEAD_KV) * (size_t)keys * sizeof(float));
    int64_t *pos = malloc((size_t)chunk * sizeof(int64_t));
    for (long i = 0; i < chunk * N_HEAD * D; i++) q[i] = frand(&seed);
    for (long r = 0; r < chunk; r++) pos[r] = keys - chunk + r;
    double flops = 0;
    for (long r = 0; r < chunk; r++)
        flops += (double)N_HEAD * 4.0 * D * (double)(window > 0 && pos[r] + 1 > window ? window : pos[r] + 1);
    int group = N_HEAD / N_HEAD_KV;
    printf("attention: %ld query rows ending at key %ld, %s rows, units of %ld rows, %d reps, 1 thread%s\n", chunk,
           keys, kv, rows, reps, use_tiles ? ", bf16/int8 tiles built once per chunk" : "");
    /* the larger (bf16) size serves both precisions */
    size_t tile_bytes = op_attention_bf16_tiles_bytes(ATTENTION_BF16, keys, D);
    void *tile_mem = use_tiles ? aligned_alloc(64, tile_bytes * N_HEAD_KV) : NULL;
    if (use_tiles && !tile_mem) {
        fprintf(stderr, "bench_attention: out of memory for tiles\n");
        return 1;
    }
    const attention_precision precs[] = {ATTENTION_F32, ATTENTION_BF16, ATTENTION_INT8};
    for (int p = 0; p < 3; p++) {
        attention_precision prec = precs[p];
        if (strcmp(prec_name, "all") && strcmp(prec_name, attention_precision_name(prec)) &&
            !(strcmp(prec_name, "both") == 0 && prec != ATTENTION_INT8))
            continue;
        size_t head_bytes = op_attention_bf16_tiles_bytes(prec, keys, D);
        attention_bf16_tiles tiles = {tile_mem, head_bytes, keys};
        if (op_attention_precision(prec, D, D) != prec) {
            printf("%s: not on this CPU (%s)\n", attention_precision_name(prec),
                   op_attention_precision_fallback(prec, D, D));
            continue;
        }
        double *t = malloc((size_t)reps * sizeof(double)), build_best = 0;
        for (int rep = 0; rep < reps; rep++) {
            double t0 = ember_now();
            if (use_tiles && prec != ATTENTION_F32)
                for (int kvh = 0; kvh < N_HEAD_KV; kvh++)
                    op_attention_bf16_tiles_build(prec, (uint8_t *)tile_mem + (size_t)kvh * head_bytes, k_blocks,
                                                  v_blocks, type, N_HEAD_KV, D, kvh, keys, 0, (keys + 63) / 64);
            double build = ember_now() - t0;
            if (rep == 0 || build < build_best) build_best = build;
            for (int kvh = 0; kvh < N_HEAD_KV; kvh++)
                for (long r0 = 0; r0 < chunk; r0 += rows) {
                    int n = (int)(chunk - r0 < rows ? chunk - r0 : rows);
                    op_attention_paged_rows_prec(out + r0 * N_HEAD * D, N_HEAD * D, q + r0 * N_HEAD * D, N_HEAD * D,
                                                 k_blocks, v_blocks, type, pos + r0, n, N_HEAD, N_HEAD_KV, D, D,
                                                 0.0883883f, window, kvh * group, (kvh + 1) * group, scratch, prec,
                                                 use_tiles && prec != ATTENTION_F32 ? &tiles : NULL);
                }
            t[rep] = ember_now() - t0;
        }
        qsort(t, (size_t)reps, sizeof(double), cmp_double);
        /* FNV-1a of the output bits: equal across --rows (batch invariance) */
        uint64_t digest = 1469598103934665603ull;
        const uint8_t *bytes = (const uint8_t *)out;
        for (size_t i = 0; i < (size_t)chunk * N_HEAD * D * sizeof(float); i++) digest = (digest ^ bytes[i]) * 1099511628211ull;
        printf("%-4s  best %7.1f GFLOP/s  median %7.1f GFLOP/s  (%.1f ms per layer-chunk)  output %016llx",
               attention_precision_name(prec), flops / t[0] * 1e-9, flops / t[reps / 2] * 1e-9, t[0] * 1e3,
               (unsigned long long)digest);
        if (use_tiles && prec != ATTENTION_F32) printf("  (tiles built in %.1f ms at best)", build_best * 1e3);
        printf("\n");
        free(t);
    }
    free(arena), free(k_blocks), free(v_blocks), free(row), free(q), free(out), free(scratch), free(pos), free(tile_mem);
    return 0;
}
