/* test_ops.c - the per-row operations of src/tensor/ops.h.
 *
 * The multi-row attention kernel must give every (row, head) the same bits
 * as the single-row kernel (that is what keeps prefill and decode logits
 * identical), for the head sizes real models use - 64, 128, 256 and odd
 * small ones - with GQA groups, sliding windows and key counts that do and
 * do not fill whole 16-token blocks, in every KV row format (f32, f16,
 * q8_0 with its K rows in q12h), where attention over encoded rows must
 * also equal attention over the decoded rows bit for bit (for q12h keys,
 * with the query rotated by kv_row_query: the decoded keys are rotated).
 * Also: the formats' round-trip error, q12h's rotation against the
 * Hadamard matrix written out, q8_0 attention against exact attention, and
 * rmsnorm and rope against plain formulas. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/kv_rows.h"
#include "tensor/ops.h"
#include "tensor/quant.h"
#include "test_util.h"

static float frand(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((*s >> 40) & 0xFFFFFF) / 16777216.0f * 2.0f - 1.0f;
}

/* Blocks of random K (or V) rows in `type`, and the same rows decoded to
 * f32: attention over the encoded blocks must equal attention over the
 * decoded ones bit for bit. */
typedef struct enc_blocks {
    void **enc;
    float **dec;
    int n;
} enc_blocks;

static enc_blocks make_blocks(kv_row_type type, int n_blocks, int width, uint64_t *seed) {
    enc_blocks b = {malloc((size_t)n_blocks * sizeof(void *)), malloc((size_t)n_blocks * sizeof(float *)), n_blocks};
    size_t rb = kv_row_bytes(type, width);
    float *row = malloc((size_t)width * sizeof(float));
    for (int i = 0; i < n_blocks; i++) {
        b.enc[i] = malloc(16 * rb);
        b.dec[i] = malloc(16 * (size_t)width * sizeof(float));
        for (int r = 0; r < 16; r++) {
            for (int j = 0; j < width; j++) row[j] = frand(seed);
            kv_row_encode(type, row, (uint8_t *)b.enc[i] + (size_t)r * rb, width);
            kv_row_decode(type, (uint8_t *)b.enc[i] + (size_t)r * rb, 0, width, b.dec[i] + (size_t)r * width);
        }
    }
    free(row);
    return b;
}

static void free_blocks(enc_blocks *b) {
    for (int i = 0; i < b->n; i++) free(b->enc[i]), free(b->dec[i]);
    free(b->enc);
    free(b->dec);
}

static void check_rows_equal_single(kv_row_type type, int n_head, int n_head_kv, int d, int n_keys, int n_rows,
                                    int64_t window) {
    uint64_t seed = (uint64_t)(n_head * 131 + d * 7 + n_keys);
    int n_blocks = (n_keys + 15) / 16;
    int k_row = n_head_kv * d;
    kv_row_type k_type = kv_row_key_type(type);
    enc_blocks kb = make_blocks(k_type, n_blocks, k_row, &seed), vb = make_blocks(type, n_blocks, k_row, &seed);
    int q_width = n_head * d;
    float *q = malloc((size_t)n_rows * q_width * sizeof(float));
    for (int i = 0; i < n_rows * q_width; i++) q[i] = frand(&seed) * 2.0f;
    /* the decoded keys of a rotated type are rotated: so is the query against them */
    float *q_dec = malloc((size_t)n_rows * q_width * sizeof(float));
    kv_row_query(k_type, q, q_dec, n_rows * q_width);
    int64_t *pos = malloc((size_t)n_rows * sizeof *pos);
    for (int r = 0; r < n_rows; r++) pos[r] = n_keys - n_rows + r; /* the last n_rows positions */
    float *fast = calloc((size_t)n_rows * q_width, sizeof(float));
    float *slow = calloc((size_t)n_rows * q_width, sizeof(float));
    float *plain = calloc((size_t)n_rows * q_width, sizeof(float));
    float *scratch = malloc((size_t)n_rows * n_head * (n_keys + 1) * sizeof(float));
    float scale = 1.0f / sqrtf((float)d);
    int group = n_head / n_head_kv;
    const void *const *ke = (const void *const *)kb.enc, *const *ve = (const void *const *)vb.enc;
    const void *const *kd = (const void *const *)kb.dec, *const *vd = (const void *const *)vb.dec;
    /* at most 64 (row, head) pairs per multi-row call: one kv head's group at a time */
    for (int h0 = 0; h0 < n_head; h0 += group)
        for (int r0 = 0; r0 < n_rows; r0 += 64 / group) {
            int nr = n_rows - r0 < 64 / group ? n_rows - r0 : 64 / group;
            op_attention_paged_rows(fast + (size_t)r0 * q_width, (size_t)q_width, q + (size_t)r0 * q_width,
                                    (size_t)q_width, ke, ve, type, pos + r0, nr, n_head, n_head_kv, d, d, scale,
                                    window, h0, h0 + group, scratch);
        }
    for (int r = 0; r < n_rows; r++) {
        op_attention_paged(slow + (size_t)r * q_width, q + (size_t)r * q_width, ke, ve, type, pos[r] + 1, pos[r],
                           n_head, n_head_kv, d, d, scale, window, 0, n_head, scratch);
        op_attention_paged(plain + (size_t)r * q_width, q_dec + (size_t)r * q_width, kd, vd, KV_ROW_F32, pos[r] + 1,
                           pos[r], n_head, n_head_kv, d, d, scale, window, 0, n_head, scratch);
    }
    if (memcmp(fast, slow, (size_t)n_rows * q_width * sizeof(float)) != 0)
        fail_msg("%s attention rows differ from single rows: heads %d/%d, d %d, keys %d, rows %d, window %lld",
                 kv_row_type_name(type), n_head, n_head_kv, d, n_keys, n_rows, (long long)window);
    if (memcmp(slow, plain, (size_t)n_rows * q_width * sizeof(float)) != 0)
        fail_msg("%s attention differs from attention on its decoded rows: heads %d/%d, d %d, keys %d",
                 kv_row_type_name(type), n_head, n_head_kv, d, n_keys);
    free_blocks(&kb);
    free_blocks(&vb);
    free(q); free(q_dec); free(pos); free(fast); free(slow); free(plain); free(scratch);
}

static void test_attention_rows_bit_identical(void **state) {
    (void)state;
    const quant_isa isas[] = {QUANT_ISA_SCALAR, QUANT_ISA_AVX2, QUANT_ISA_AVX512};
    const kv_row_type types[] = {KV_ROW_F32, KV_ROW_F16, KV_ROW_Q8_0};
    quant_isa saved = quant_get_isa();
    int checked = 0;
    for (int i = 0; i < 3; i++) {
        if (!quant_set_isa(isas[i])) continue;
        for (int t = 0; t < 3; t++) {
            check_rows_equal_single(types[t], 16, 8, 128, 300, 40, 0);  /* qwen3-0.6b heads */
            check_rows_equal_single(types[t], 4, 2, 64, 80, 17, 0);
            check_rows_equal_single(types[t], 8, 1, 256, 33, 5, 0);     /* gemma-like MQA, d 256 */
            check_rows_equal_single(types[t], 4, 1, 32, 100, 20, 24);   /* sliding window */
            check_rows_equal_single(types[t], 8, 4, 8, 16, 16, 0);      /* stories260K head size */
            check_rows_equal_single(types[t], 16, 8, 128, 1, 1, 0);
        }
        if (quant_get_isa() != QUANT_ISA_SCALAR) { /* odd head sizes: the decoders' scalar tails, padded lanes */
            check_rows_equal_single(KV_ROW_F16, 4, 2, 24, 40, 8, 0);
            check_rows_equal_single(KV_ROW_F16, 4, 2, 20, 70, 9, 0);
            check_rows_equal_single(KV_ROW_F32, 6, 3, 12, 50, 11, 0);
        }
        checked++;
    }
    quant_set_isa(saved);
    assert_true(checked >= 1);
}

/* The vector kernels compute exp by a polynomial, so they agree with the
 * scalar kernel closely rather than bit for bit: every output of AVX2 and
 * AVX-512 (each where the CPU has it) within 2e-6 + 2e-5 * |scalar| of the
 * scalar result, over the formats, GQA groups, windows and head sizes. */
static void isa_attention(quant_isa isa, kv_row_type type, const enc_blocks *kb, const enc_blocks *vb, const float *q,
                          const int64_t *pos, int n_rows, int n_head, int n_head_kv, int d, int64_t window,
                          float *scratch, float *out) {
    quant_isa saved = quant_get_isa();
    assert_true(quant_set_isa(isa));
    int q_width = n_head * d;
    op_attention_paged_rows(out, (size_t)q_width, q, (size_t)q_width, (const void *const *)kb->enc,
                            (const void *const *)vb->enc, type, pos, n_rows, n_head, n_head_kv, d, d,
                            1.0f / sqrtf((float)d), window, 0, n_head, scratch);
    quant_set_isa(saved);
}

static void test_attention_isas_agree(void **state) {
    (void)state;
    const struct { int n_head, n_head_kv, d, n_keys, n_rows; int64_t window; } shapes[] = {
        {16, 8, 128, 300, 3, 0}, {4, 2, 64, 80, 5, 0}, {8, 1, 256, 33, 2, 0}, {4, 1, 32, 100, 4, 24}, {8, 4, 8, 16, 6, 0},
    };
    const kv_row_type types[] = {KV_ROW_F32, KV_ROW_F16, KV_ROW_Q8_0};
    const quant_isa vec[] = {QUANT_ISA_AVX2, QUANT_ISA_AVX512};
    int compared = 0;
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int t = 0; t < 3; t++) {
            uint64_t seed = 77 + s * 3 + (uint64_t)t;
            int n_head = shapes[s].n_head, d = shapes[s].d, n_rows = shapes[s].n_rows, n_keys = shapes[s].n_keys;
            int n_blocks = (n_keys + 15) / 16, q_width = n_head * d;
            enc_blocks kb = make_blocks(kv_row_key_type(types[t]), n_blocks, shapes[s].n_head_kv * d, &seed);
            enc_blocks vb = make_blocks(types[t], n_blocks, shapes[s].n_head_kv * d, &seed);
            float *q = malloc((size_t)n_rows * q_width * sizeof(float));
            for (int i = 0; i < n_rows * q_width; i++) q[i] = frand(&seed) * 3.0f;
            int64_t pos[8];
            for (int r = 0; r < n_rows; r++) pos[r] = n_keys - n_rows + r;
            float *scratch = malloc((size_t)n_rows * n_head * (n_keys + 1) * sizeof(float));
            float *ref = malloc((size_t)n_rows * q_width * sizeof(float)), *got = malloc((size_t)n_rows * q_width * sizeof(float));
            isa_attention(QUANT_ISA_SCALAR, types[t], &kb, &vb, q, pos, n_rows, n_head, shapes[s].n_head_kv, d,
                          shapes[s].window, scratch, ref);
            for (int v = 0; v < 2; v++) {
                quant_isa saved = quant_get_isa();
                bool have = quant_set_isa(vec[v]);
                quant_set_isa(saved);
                if (!have) continue;
                isa_attention(vec[v], types[t], &kb, &vb, q, pos, n_rows, n_head, shapes[s].n_head_kv, d,
                              shapes[s].window, scratch, got);
                for (int i = 0; i < n_rows * q_width; i++)
                    if (!(fabsf(got[i] - ref[i]) <= 2e-6f + 2e-5f * fabsf(ref[i])))
                        fail_msg("%s attention, ISA %d, heads %d/%d d %d keys %d: output %d is %.9g, scalar %.9g",
                                 kv_row_type_name(types[t]), (int)vec[v], n_head, shapes[s].n_head_kv, d, n_keys, i,
                                 got[i], ref[i]);
                compared++;
            }
            free_blocks(&kb);
            free_blocks(&vb);
            free(q); free(scratch); free(ref); free(got);
        }
    if (compared == 0) skip(); /* a CPU without AVX2: nothing to compare */
}

/* Each format round-trips a known pattern within its stated error: f32
 * exactly, f16 within half an ulp of binary16 (relative 2^-11 for normal
 * values), q8_0 within 0.6 of a quantization step (amax / 127) per block
 * of 32 (half a step, plus the fp16 rounding of the scale), q12h to the
 * rotated values H x (H the 8x8 +-1 Hadamard, written out here as
 * (-1)^popcount(i & j)) within 0.6 of its step (amax |H x| / 2047). */
static void test_kv_rows_round_trip(void **state) {
    (void)state;
    enum { W = 256 };
    float x[W], y[W];
    uint8_t buf[W * 4];
    for (int i = 0; i < W; i++) x[i] = (float)((i * 37) % 101 - 50) * (i < 128 ? 0.013f : 3.7f) + 0.001f * (float)i;
    float hx[W];
    for (int s0 = 0; s0 < W; s0 += 8)
        for (int i = 0; i < 8; i++) {
            double acc = 0;
            for (int j = 0; j < 8; j++) acc += (__builtin_popcount((unsigned)(i & j)) % 2 ? -1.0 : 1.0) * x[s0 + j];
            hx[s0 + i] = (float)acc;
        }
    const kv_row_type types[] = {KV_ROW_F32, KV_ROW_F16, KV_ROW_Q8_0, KV_ROW_Q12H};
    for (int t = 0; t < 4; t++) {
        assert_true(kv_row_supported(types[t], W));
        assert_true(kv_row_bytes(types[t], W) % 4 == 0);
        kv_row_encode(types[t], x, buf, W);
        kv_row_decode(types[t], buf, 0, W, y);
        const float *want = types[t] == KV_ROW_Q12H ? hx : x;
        for (int b = 0; b < W / 32; b++) {
            float amax = 0;
            for (int i = 32 * b; i < 32 * b + 32; i++) amax = fabsf(want[i]) > amax ? fabsf(want[i]) : amax;
            for (int i = 32 * b; i < 32 * b + 32; i++) {
                float err = fabsf(y[i] - want[i]);
                float bound = types[t] == KV_ROW_F32    ? 0.0f
                              : types[t] == KV_ROW_F16  ? fabsf(x[i]) * 0x1p-11f
                              : types[t] == KV_ROW_Q8_0 ? 0.6f * amax / 127.0f
                                                        : 0.6f * amax / 2047.0f + 1e-6f * amax;
                if (err > bound)
                    fail_msg("%s: value %d (%g) came back as %g, error %g > %g", kv_row_type_name(types[t]), i,
                             (double)want[i], (double)y[i], (double)err, (double)bound);
            }
        }
        /* a slice decodes to the same values as the whole row */
        float part[40];
        kv_row_decode(types[t], buf, 64, 40, part);
        assert_memory_equal(part, y + 64, sizeof part);
    }
    assert_int_equal(kv_row_bytes(KV_ROW_F16, W), 2 * W);
    assert_int_equal(kv_row_bytes(KV_ROW_Q8_0, W), W / 32 * 34);
    assert_int_equal(kv_row_bytes(KV_ROW_Q8_0, 32), 36); /* 34 padded to a word */
    assert_false(kv_row_supported(KV_ROW_Q8_0, 48));
    assert_int_equal(kv_row_bytes(KV_ROW_Q12H, W), W / 32 * 50);
    assert_int_equal(kv_row_bytes(KV_ROW_Q12H, 32), 52);
    assert_false(kv_row_supported(KV_ROW_Q12H, 48));
    assert_int_equal(kv_row_key_type(KV_ROW_Q8_0), KV_ROW_Q12H);
    assert_int_equal(kv_row_key_type(KV_ROW_F16), KV_ROW_F16);
    /* the query's rotation undoes the keys': (H q / 8) . (H k) = q . k */
    float qr[W], kd = 0, rd = 0;
    kv_row_query(KV_ROW_Q12H, x, qr, W);
    for (int i = 0; i < W; i++) kd += x[i] * x[i], rd += qr[i] * hx[i];
    assert_true(fabsf(kd - rd) <= 1e-5f * kd);
}

/* A q8_0 pool (K in q12h, rotated; V in Q8_0) attends like exact f32
 * attention over the same values, in every ISA: the rotation of the keys
 * is undone by the query's, and what is left is quantization error (V's
 * step amax / 127 dominates: values here are in [-1, 1]). Heads of 8
 * (stories260K) and 128, GQA. */
static void check_q8_0_close_to_exact(int n_head, int n_head_kv, int d, int n_keys) {
    uint64_t seed = (uint64_t)(d * 977 + n_keys);
    int n_blocks = (n_keys + 15) / 16, k_row = n_head_kv * d, q_width = n_head * d;
    enc_blocks k8 = make_blocks(KV_ROW_Q12H, n_blocks, k_row, &seed), v8 = make_blocks(KV_ROW_Q8_0, n_blocks, k_row, &seed);
    uint64_t again = (uint64_t)(d * 977 + n_keys); /* the same random rows, unencoded */
    enc_blocks kf = make_blocks(KV_ROW_F32, n_blocks, k_row, &again), vf = make_blocks(KV_ROW_F32, n_blocks, k_row, &again);
    float *q = malloc((size_t)q_width * sizeof(float)), *got = malloc((size_t)q_width * sizeof(float));
    float *want = malloc((size_t)q_width * sizeof(float)), *scratch = malloc((size_t)(n_keys + 1) * sizeof(float));
    for (int i = 0; i < q_width; i++) q[i] = frand(&seed) * 4.0f;
    float scale = 1.0f / sqrtf((float)d);
    op_attention_paged(got, q, (const void *const *)k8.enc, (const void *const *)v8.enc, KV_ROW_Q8_0, n_keys,
                       n_keys - 1, n_head, n_head_kv, d, d, scale, 0, 0, n_head, scratch);
    op_attention_paged(want, q, (const void *const *)kf.enc, (const void *const *)vf.enc, KV_ROW_F32, n_keys,
                       n_keys - 1, n_head, n_head_kv, d, d, scale, 0, 0, n_head, scratch);
    for (int i = 0; i < q_width; i++)
        if (fabsf(got[i] - want[i]) > 6e-3f)
            fail_msg("q8_0 attention, heads %d/%d of %d: output %d is %g, exact %g", n_head, n_head_kv, d, i,
                     (double)got[i], (double)want[i]);
    free_blocks(&k8); free_blocks(&v8); free_blocks(&kf); free_blocks(&vf);
    free(q); free(got); free(want); free(scratch);
}

static void test_q8_0_attention_close_to_exact(void **state) {
    (void)state;
    const quant_isa isas[] = {QUANT_ISA_SCALAR, QUANT_ISA_AVX2, QUANT_ISA_AVX512};
    quant_isa saved = quant_get_isa();
    for (int i = 0; i < 3; i++) {
        if (!quant_set_isa(isas[i])) continue;
        check_q8_0_close_to_exact(8, 4, 8, 100);
        check_q8_0_close_to_exact(16, 8, 128, 70);
    }
    quant_set_isa(saved);
}

/* ---- ATTENTION_BF16 and ATTENTION_INT8 ----
 * Where the CPU has AVX512_BF16: (1) a (row, head)'s bits do not depend on
 * the call it is in - rows 256 (row, head) pairs at a time, each row alone (as decode runs it)
 * and rows in chunks of 7 one head at a time give memcmp-equal outputs, in
 * every format, with GQA and a sliding window; (2) the kernel computes
 * attention on bf16-rounded operands: within 1e-4 + 1e-3 |ref| of a double
 * reference whose query, keys, values and (online-softmax) weights are
 * rounded to bf16 (what is left is f32 summation and a weight's rounding
 * near a tie: 6.8e-5 measured); (3) it differs from f32 attention (so it
 * ran) by at most 1e-2 on these values (2.6e-3 measured). */
static float bf16_round(float x) { return quant_bf16_to_f32(quant_f32_to_bf16(x)); }

static void bf16_rows(float *out, const float *q, const enc_blocks *kb, const enc_blocks *vb, kv_row_type type,
                      const int64_t *pos, int n_rows, int n_head, int n_head_kv, int d, int64_t window,
                      int rows_per_call, int heads_per_call, float *scratch, attention_precision prec,
                      const attention_bf16_tiles *tiles) {
    int q_width = n_head * d;
    for (int h0 = 0; h0 < n_head; h0 += heads_per_call)
        for (int r0 = 0; r0 < n_rows; r0 += rows_per_call) {
            int nr = n_rows - r0 < rows_per_call ? n_rows - r0 : rows_per_call;
            op_attention_paged_rows_prec(out + (size_t)r0 * q_width, (size_t)q_width, q + (size_t)r0 * q_width,
                                         (size_t)q_width, (const void *const *)kb->enc, (const void *const *)vb->enc,
                                         type, pos + r0, nr, n_head, n_head_kv, d, d, 1.0f / sqrtf((float)d), window,
                                         h0, h0 + heads_per_call, scratch, prec, tiles);
        }
}

/* The kernel's 2^x for its weights (attention_avx512bf16.c's exp2_weight),
 * in scalar f32: a weight lying near a bf16 rounding tie rounds as the
 * kernel rounds it, so the comparison below measures the kernel's sums,
 * not where a 2.7e-6 polynomial error tips a rounding (one flipped weight
 * of a few dominant keys moves an output by 2e-4). */
static float exp2_weight_ref(float x) {
    x = x > -200.0f ? x : -200.0f;
    float n = nearbyintf(x), f = x - n;
    float p = 9.560519829e-3f;
    p = fmaf(p, f, 5.591712147e-2f);
    p = fmaf(p, f, 2.402498126e-1f);
    p = fmaf(p, f, 6.931219697e-1f);
    p = fmaf(p, f, 9.999991655e-1f);
    return ldexpf(p, (int)n);
}

/* x (d floats) as the int8 kernel quantizes a query, key or value head:
 * round(x * (127 / max|x|)) to nearest even, saturated; returns the step
 * max|x| / 127 (0, and bytes 0, for a head whose max is under 2^-100). */
static float int8_quantize_ref(const float *x, int d, int *bytes) {
    float amax = 0;
    for (int i = 0; i < d; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    if (!(amax >= 0x1p-100f)) { /* the kernel's I8_TINY */
        for (int i = 0; i < d; i++) bytes[i] = 0;
        return 0;
    }
    float inv = 127.0f / amax;
    for (int i = 0; i < d; i++) {
        float r = nearbyintf(x[i] * inv);
        bytes[i] = r > 127 ? 127 : r < -128 ? -128 : (int)r;
    }
    return amax / 127.0f;
}

/* Double attention of one (row, head) on bf16-rounded operands, with the
 * kernel's online softmax: the query times scale * log2(e) before it is
 * rounded (scores in log2 units); at int8 the scores are instead the
 * kernel's own f32 arithmetic (exact int32 dot of the quantized query and
 * key, times the key's step, times the query's), and so are the weighted
 * values of each block (below); keys in blocks of 64 at multiples of 64,
 * each block's reference m_b moving to the block's max only when a score
 * passes m_b + 8 (or at the first block); each key's weight 2^(s - m_b)
 * (exp2_weight_ref) rounded to bf16, scaled to the last reference, over the sum of those
 * weights. */
static void bf16_reference(double *out, const float *q, const enc_blocks *kb, const enc_blocks *vb, int k_off,
                           int width, int d, int64_t first, int64_t n_keys, attention_precision prec, int *rebases) {
    int64_t n = n_keys - first;
    double *s = malloc((size_t)n * sizeof(double)), *mb = malloc((size_t)n * sizeof(double)), m = -INFINITY, sum = 0;
    float c2 = (1.0f / sqrtf((float)d)) * 1.44269504088896341f;
    float q_scaled[128];
    int q8[128], k8[128];
    for (int i = 0; i < d; i++) q_scaled[i] = q[i] * c2;
    float q_step = int8_quantize_ref(q_scaled, d, q8);
    for (int64_t j = first; j < n_keys; j++) {
        const float *k = kb->dec[j / 16] + (size_t)(j % 16) * width + k_off;
        if (prec == ATTENTION_INT8) {
            float k_step = int8_quantize_ref(k, d, k8);
            int32_t dot = 0;
            for (int i = 0; i < d; i++) dot += q8[i] * k8[i];
            s[j - first] = (float)dot * k_step * q_step;
            continue;
        }
        double dot = 0;
        for (int i = 0; i < d; i++) dot += (double)bf16_round(q_scaled[i]) * bf16_round(k[i]);
        s[j - first] = dot;
    }
    for (int64_t b0 = first - first % 64; b0 < n_keys; b0 += 64) {
        double bmax = -INFINITY;
        for (int64_t j = b0 > first ? b0 : first; j < b0 + 64 && j < n_keys; j++) bmax = s[j - first] > bmax ? s[j - first] : bmax;
        if (m != -INFINITY && bmax > m + 8) ++*rebases;
        if (m == -INFINITY || bmax > m + 8) m = bmax;
        for (int64_t j = b0 > first ? b0 : first; j < b0 + 64 && j < n_keys; j++) mb[j - first] = m;
    }
    for (int i = 0; i < d; i++) out[i] = 0;
    if (prec == ATTENTION_INT8) {
        /* per block: weights e (f32) times each value row's step, as bytes on
         * the block's step max / 255; the exact int32 sums of bytes by the
         * values' bytes, times that step; the sum adds e itself */
        int v8[64][128];
        for (int64_t b0 = first - first % 64; b0 < n_keys; b0 += 64) {
            float pv[64] = {0}, pmax = 0;
            int64_t j0 = b0 > first ? b0 : first, j1 = b0 + 64 < n_keys ? b0 + 64 : n_keys;
            for (int64_t j = j0; j < j1; j++) {
                float e = exp2_weight_ref((float)(s[j - first] - mb[j - first]));
                const float *v = vb->dec[j / 16] + (size_t)(j % 16) * width + k_off;
                pv[j - b0] = e * int8_quantize_ref(v, d, v8[j - b0]);
                pmax = pv[j - b0] > pmax ? pv[j - b0] : pmax;
                sum += e * exp2(mb[j - first] - m);
            }
            if (!(pmax >= 0x1p-100f)) continue; /* the kernel's I8_TINY */
            float inv = 255.0f / pmax, pstep = pmax / 255.0f;
            for (int i = 0; i < d; i++) {
                int32_t dot = 0;
                for (int64_t j = j0; j < j1; j++) dot += (int32_t)nearbyintf(pv[j - b0] * inv) * v8[j - b0][i];
                out[i] += (double)((float)dot * pstep) * exp2(mb[j0 - first] - m);
            }
        }
        for (int i = 0; i < d; i++) out[i] /= sum;
        free(s);
        free(mb);
        return;
    }
    for (int64_t j = 0; j < n; j++) sum += bf16_round(exp2_weight_ref((float)(s[j] - mb[j]))) * exp2(mb[j] - m);
    for (int64_t j = first; j < n_keys; j++) {
        double p = bf16_round(exp2_weight_ref((float)(s[j - first] - mb[j - first]))) * exp2(mb[j - first] - m) / sum;
        const float *v = vb->dec[j / 16] + (size_t)(j % 16) * width + k_off;
        for (int i = 0; i < d; i++) out[i] += p * bf16_round(v[i]);
    }
    free(s);
    free(mb);
}

static void check_bf16_attention(attention_precision prec, kv_row_type type, int n_head, int n_head_kv, int d,
                                 int n_keys, int n_rows, int64_t window, float q_gain, float *max_vs_f32,
                                 double *max_vs_ref, int *rebases) {
    const char *pname = attention_precision_name(prec);
    uint64_t seed = (uint64_t)(n_head * 31 + d * 5 + n_keys + type);
    int n_blocks = (n_keys + 15) / 16, width = n_head_kv * d, q_width = n_head * d, group = n_head / n_head_kv;
    kv_row_type k_type = kv_row_key_type(type);
    enc_blocks kb = make_blocks(k_type, n_blocks, width, &seed), vb = make_blocks(type, n_blocks, width, &seed);
    size_t n_out = (size_t)n_rows * q_width;
    float *q = malloc(n_out * sizeof(float)), *q_dec = malloc(n_out * sizeof(float));
    for (size_t i = 0; i < n_out; i++) q[i] = frand(&seed) * 2.0f * q_gain;
    kv_row_query(k_type, q, q_dec, (int)n_out);
    int64_t *pos = malloc((size_t)n_rows * sizeof *pos);
    for (int r = 0; r < n_rows; r++) pos[r] = n_keys - n_rows + r;
    float *all = calloc(n_out, sizeof(float)), *alone = calloc(n_out, sizeof(float));
    float *chunked = calloc(n_out, sizeof(float)), *f32 = calloc(n_out, sizeof(float));
    float *scratch = malloc((size_t)64 * (n_keys + 1) * sizeof(float));
    /* up to 256 (row, head) pairs per call, as forward.c gives the bf16 kernel */
    bf16_rows(all, q, &kb, &vb, type, pos, n_rows, n_head, n_head_kv, d, window, 256 / group, group, scratch, prec, NULL);
    bf16_rows(alone, q, &kb, &vb, type, pos, n_rows, n_head, n_head_kv, d, window, 1, n_head, scratch, prec, NULL);
    bf16_rows(chunked, q, &kb, &vb, type, pos, n_rows, n_head, n_head_kv, d, window, 7, 1, scratch, prec, NULL);
    bf16_rows(f32, q, &kb, &vb, type, pos, n_rows, n_head, n_head_kv, d, window, 64 / group, group, scratch, ATTENTION_F32, NULL);
    if (memcmp(all, alone, n_out * sizeof(float)) != 0 || memcmp(all, chunked, n_out * sizeof(float)) != 0)
        fail_msg("%s %s attention depends on the batch: heads %d/%d, d %d, keys %d, rows %d, window %lld",
                 pname, kv_row_type_name(type), n_head, n_head_kv, d, n_keys, n_rows, (long long)window);
    /* Prebuilt tiles of all n_keys keys, built in two ranges per head (as
     * threads split them): the same bits, in calls whose last key is short
     * of n_keys (the tiles then hold rows the call would have zeroed) and
     * under a window (rows whose window starts past key 0 build their own). */
    size_t head_bytes = op_attention_bf16_tiles_bytes(prec, n_keys, d);
    void *tile_mem = aligned_alloc(64, head_bytes * (size_t)n_head_kv);
    int64_t tile_blocks = (n_keys + 63) / 64;
    for (int h = 0; h < n_head_kv; h++) {
        assert_true(op_attention_bf16_tiles_build(prec, (uint8_t *)tile_mem + (size_t)h * head_bytes, (const void *const *)kb.enc,
                                                  (const void *const *)vb.enc, type, n_head_kv, d, h, n_keys, 0, tile_blocks / 2));
        assert_true(op_attention_bf16_tiles_build(prec, (uint8_t *)tile_mem + (size_t)h * head_bytes, (const void *const *)kb.enc,
                                                  (const void *const *)vb.enc, type, n_head_kv, d, h, n_keys, tile_blocks / 2,
                                                  tile_blocks));
    }
    attention_bf16_tiles tiles = {tile_mem, head_bytes, n_keys};
    float *tiled = calloc(n_out, sizeof(float)), *tiled_chunked = calloc(n_out, sizeof(float));
    bf16_rows(tiled, q, &kb, &vb, type, pos, n_rows, n_head, n_head_kv, d, window, 256 / group, group, scratch, prec, &tiles);
    bf16_rows(tiled_chunked, q, &kb, &vb, type, pos, n_rows, n_head, n_head_kv, d, window, 7, 1, scratch, prec, &tiles);
    if (memcmp(all, tiled, n_out * sizeof(float)) != 0 || memcmp(all, tiled_chunked, n_out * sizeof(float)) != 0)
        fail_msg("%s %s attention on prebuilt tiles differs: heads %d/%d, d %d, keys %d, rows %d, window %lld",
                 pname, kv_row_type_name(type), n_head, n_head_kv, d, n_keys, n_rows, (long long)window);
    free(tile_mem); free(tiled); free(tiled_chunked);
    double *ref = malloc((size_t)d * sizeof(double));
    for (int r = 0; r < n_rows; r++)
        for (int h = 0; h < n_head; h++) {
            int64_t first = window > 0 && pos[r] - window + 1 > 0 ? pos[r] - window + 1 : 0;
            size_t o = (size_t)r * q_width + (size_t)h * d;
            bf16_reference(ref, q_dec + o, &kb, &vb, (h / group) * d, width, d, first, pos[r] + 1, prec, rebases);
            for (int i = 0; i < d; i++) {
                if (!(fabs(all[o + i] - ref[i]) <= 1e-4 + 1e-3 * fabs(ref[i])))
                    fail_msg("%s %s attention, heads %d/%d d %d keys %d: row %d head %d lane %d is %.9g, %s "
                             "reference %.9g", pname, kv_row_type_name(type), n_head, n_head_kv, d, n_keys, r, h, i,
                             (double)all[o + i], pname, ref[i]);
                if (fabs(all[o + i] - ref[i]) > *max_vs_ref) *max_vs_ref = fabs(all[o + i] - ref[i]);
                float diff = fabsf(all[o + i] - f32[o + i]);
                if (diff > *max_vs_f32) *max_vs_f32 = diff;
            }
        }
    free(ref);
    free_blocks(&kb);
    free_blocks(&vb);
    free(q); free(q_dec); free(pos); free(all); free(alone); free(chunked); free(f32); free(scratch);
}

static void test_bf16_attention(void **state) {
    (void)state;
    /* heads the kernel does not take, and CPUs without the instruction, fall back to f32 and say why */
    assert_int_equal(op_attention_precision(ATTENTION_BF16, 256, 256), ATTENTION_F32);
    assert_non_null(op_attention_precision_fallback(ATTENTION_BF16, 8, 8));
    assert_null(op_attention_precision_fallback(ATTENTION_F32, 8, 8));
    quant_isa saved = quant_get_isa();
    if (quant_set_isa(QUANT_ISA_AVX2)) {
        assert_int_equal(op_attention_precision(ATTENTION_BF16, 128, 128), ATTENTION_F32);
        quant_set_isa(saved);
    }
    if (op_attention_precision(ATTENTION_BF16, 128, 128) != ATTENTION_BF16) {
        assert_non_null(op_attention_precision_fallback(ATTENTION_BF16, 128, 128));
        skip(); /* no AVX512_BF16 here */
    }
    const kv_row_type types[] = {KV_ROW_F32, KV_ROW_F16, KV_ROW_Q8_0};
    const attention_precision precs[] = {ATTENTION_BF16, ATTENTION_INT8};
    for (int p = 0; p < 2; p++) {
        attention_precision prec = precs[p];
        assert_int_equal(op_attention_precision(prec, 128, 128), prec);
        float max_vs_f32 = 0, peaked_vs_f32 = 0;
        double max_vs_ref = 0;
        int rebases = 0, peaked_rebases = 0;
        for (int t = 0; t < 3; t++) {
            check_bf16_attention(prec, types[t], 16, 8, 128, 300, 40, 0, 1, &max_vs_f32, &max_vs_ref, &rebases); /* qwen3-0.6b heads */
            check_bf16_attention(prec, types[t], 4, 2, 64, 80, 17, 0, 1, &max_vs_f32, &max_vs_ref, &rebases);
            check_bf16_attention(prec, types[t], 4, 1, 64, 150, 37, 29, 1, &max_vs_f32, &max_vs_ref, &rebases); /* sliding window: odd firsts */
            check_bf16_attention(prec, types[t], 16, 8, 128, 1, 1, 0, 1, &max_vs_f32, &max_vs_ref, &rebases);
            check_bf16_attention(prec, types[t], 2, 1, 128, 33, 33, 0, 1, &max_vs_f32, &max_vs_ref, &rebases); /* every row of a short prompt */
            /* Queries 24x larger: scores spread over tens of log2 units, so a
             * later block's max passes the reference + 8 and m moves (the
             * rescale of sum and out), which the scores above never do. */
            check_bf16_attention(prec, types[t], 4, 2, 128, 600, 24, 0, 24, &peaked_vs_f32, &max_vs_ref, &peaked_rebases);
        }
        print_message("%s attention: max |%s - f32| = %.3g, max |%s - %s reference| = %.3g, reference moved %d "
                      "times in the peaked runs\n", attention_precision_name(prec), attention_precision_name(prec),
                      (double)max_vs_f32, attention_precision_name(prec), attention_precision_name(prec), max_vs_ref,
                      peaked_rebases);
        assert_true(max_vs_f32 > 0);
        assert_true(max_vs_f32 < (prec == ATTENTION_INT8 ? 2e-2f : 1e-2f));
        assert_true(peaked_rebases > 0);
    }
}

static void test_rmsnorm_and_rope(void **state) {
    (void)state;
    float x[64], y[64], w[64];
    double ss = 0;
    for (int i = 0; i < 64; i++) x[i] = (float)(i - 30) / 7.0f, w[i] = 1.0f + i / 100.0f, ss += (double)x[i] * x[i];
    op_rmsnorm(y, x, w, 64, 1e-6f);
    for (int i = 0; i < 64; i++) assert_true(fabs(y[i] - x[i] / sqrt(ss / 64 + 1e-6) * w[i]) < 1e-5);

    /* rope at position 0 is the identity; NORM rotates adjacent pairs, NEOX halves */
    rope_params rp = {ROPE_NORM, 8, 10000.0f, 1.0f, 0.0f, 1.0f, 32.0f, 1.0f, 4096, NULL};
    float v[8] = {1, 2, 3, 4, 5, 6, 7, 8}, orig[8];
    memcpy(orig, v, sizeof v);
    op_rope(v, 1, 8, 0, &rp);
    assert_memory_equal(v, orig, sizeof v);
    op_rope(v, 1, 8, 3, &rp);
    /* pair 0 (theta = 3 rad) of NORM mode is (v0, v1) */
    assert_true(fabs(v[0] - (1 * cosf(3) - 2 * sinf(3))) < 1e-5);
    assert_true(fabs(v[1] - (1 * sinf(3) + 2 * cosf(3))) < 1e-5);
    memcpy(v, orig, sizeof v);
    rp.mode = ROPE_NEOX;
    op_rope(v, 1, 8, 3, &rp);
    /* pair 0 of NEOX mode is (v0, v4) */
    assert_true(fabs(v[0] - (1 * cosf(3) - 5 * sinf(3))) < 1e-5);
    assert_true(fabs(v[4] - (1 * sinf(3) + 5 * cosf(3))) < 1e-5);
    /* linear scaling by 2 at position 6 equals no scaling at position 3 */
    float a[8], b[8];
    memcpy(a, orig, sizeof a);
    memcpy(b, orig, sizeof b);
    op_rope(a, 1, 8, 3, &rp);
    rp.freq_scale = 0.5f;
    op_rope(b, 1, 8, 6, &rp);
    for (int i = 0; i < 8; i++) assert_true(fabsf(a[i] - b[i]) < 1e-5f);
    /* YaRN keeps vector norms scaled by mscale only */
    rp.ext_factor = 1.0f;
    rp.freq_scale = 0.25f;
    float c[8];
    memcpy(c, orig, sizeof c);
    op_rope(c, 1, 8, 100, &rp);
    double n0 = 0, n1 = 0;
    for (int i = 0; i < 8; i++) n0 += orig[i] * orig[i], n1 += c[i] * c[i];
    double mscale = 1.0 + 0.1 * log(4.0);
    assert_true(fabs(sqrt(n1) - sqrt(n0) * mscale) < 1e-4 * sqrt(n0));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attention_rows_bit_identical),
        cmocka_unit_test(test_attention_isas_agree),
        cmocka_unit_test(test_kv_rows_round_trip),
        cmocka_unit_test(test_q8_0_attention_close_to_exact),
        cmocka_unit_test(test_bf16_attention),
        cmocka_unit_test(test_rmsnorm_and_rope),
    };
    return test_run_group(tests, NULL, NULL);
}
