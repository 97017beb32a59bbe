/* ops.c - per-row operations (see ops.h). Written as plain loops that the
 * compiler vectorizes at -O2 only where that cannot reorder a reduction:
 * sums are accumulated in double in index order, so their bits are a
 * function of the row alone. */
#include "tensor/ops.h"

#include <math.h>
#include <string.h>

#include "tensor/attention_impl.h"
#include "tensor/quant.h"

void op_rmsnorm(float *y, const float *x, const float *w, int n, float eps) {
    double sum = 0.0;
    for (int i = 0; i < n; i++) sum += (double)x[i] * (double)x[i];
    float scale = (float)(1.0 / sqrt(sum / n + (double)eps));
    if (w)
        for (int i = 0; i < n; i++) y[i] = x[i] * scale * w[i];
    else
        for (int i = 0; i < n; i++) y[i] = x[i] * scale;
}

/* YaRN correction range: the pair indices between which rotation switches
 * from extrapolation to interpolation. */
static float yarn_corr_dim(int n_rot, int n_ctx_orig, float n_turns, float base) {
    return (float)n_rot * logf((float)n_ctx_orig / (n_turns * 2.0f * (float)M_PI)) / (2.0f * logf(base));
}

static float yarn_ramp(float low, float high, int pair) {
    float y = ((float)pair - low) / fmaxf(0.001f, high - low);
    return 1.0f - fminf(1.0f, fmaxf(0.0f, y));
}

void op_rope(float *x, int n_heads, int head_dim, int64_t pos, const rope_params *rp) {
    int n_rot = rp->n_rot;
    int half = n_rot / 2;
    float corr_low = 0, corr_high = 0;
    float mscale = rp->attn_factor;
    if (rp->ext_factor != 0.0f) {
        corr_low = floorf(yarn_corr_dim(n_rot, rp->n_ctx_orig, rp->beta_fast, rp->freq_base));
        corr_high = ceilf(yarn_corr_dim(n_rot, rp->n_ctx_orig, rp->beta_slow, rp->freq_base));
        if (corr_low < 0) corr_low = 0;
        if (corr_high > n_rot - 1) corr_high = (float)(n_rot - 1);
        mscale *= 1.0f + 0.1f * logf(1.0f / rp->freq_scale);
    }
    float theta_scale = powf(rp->freq_base, -2.0f / (float)n_rot);
    float theta_base = (float)pos;
    for (int i = 0; i < half; i++) {
        float theta_extrap = theta_base;
        if (rp->freq_factors) theta_extrap /= rp->freq_factors[i];
        float theta_interp = rp->freq_scale * theta_extrap;
        float theta = theta_interp;
        if (rp->ext_factor != 0.0f) {
            float mix = yarn_ramp(corr_low, corr_high, i) * rp->ext_factor;
            theta = theta_interp * (1 - mix) + theta_extrap * mix;
        }
        float c = cosf(theta) * mscale, s = sinf(theta) * mscale;
        for (int h = 0; h < n_heads; h++) {
            float *v = x + (int64_t)h * head_dim;
            int a = rp->mode == ROPE_NORM ? 2 * i : i;
            int b = rp->mode == ROPE_NORM ? 2 * i + 1 : i + half;
            float x0 = v[a], x1 = v[b];
            v[a] = x0 * c - x1 * s;
            v[b] = x0 * s + x1 * c;
        }
        theta_base *= theta_scale;
    }
}

void op_softmax(float *x, int n) {
    float max = -INFINITY;
    for (int i = 0; i < n; i++)
        if (x[i] > max) max = x[i];
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - max);
        sum += x[i];
    }
    float inv = (float)(1.0 / sum);
    for (int i = 0; i < n; i++) x[i] *= inv;
}

void op_swiglu(float *y, const float *gate, const float *up, int n) {
    for (int i = 0; i < n; i++) {
        float g = gate[i];
        y[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

void op_add(float *x, const float *y, int n) {
    for (int i = 0; i < n; i++) x[i] += y[i];
}

static float dot_f32(const float *a, const float *b, int n) {
    float acc[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[i + k] * b[i + k];
    float sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

/* Key or value j of this head as floats: in place for f32 rows, else
 * decoded into buf. */
static const float *head_row(const void *const *blocks, size_t stride, int64_t j, int offset, int n,
                             kv_row_type type, float *buf) {
    const uint8_t *row = attention_row(blocks, stride, j);
    if (type == KV_ROW_F32) return (const float *)row + offset;
    kv_row_decode(type, row, offset, n, buf);
    return buf;
}

void attention_head_scalar(const attention_head_args *a) {
    int64_t n = a->n_keys - a->first;
    float buf[ATTENTION_MAX_HEAD];
    for (int64_t j = a->first; j < a->n_keys; j++) {
        const float *k = head_row(a->k_blocks, a->k_stride, j, a->k_offset, a->d_k, a->k_type, buf);
        a->scores[j - a->first] = dot_f32(a->q, k, a->d_k) * a->scale;
    }
    op_softmax(a->scores, (int)n);
    for (int d = 0; d < a->d_v; d++) a->out[d] = 0.0f;
    for (int64_t j = a->first; j < a->n_keys; j++) {
        const float *v = head_row(a->v_blocks, a->v_stride, j, a->v_offset, a->d_v, a->v_type, buf);
        float p = a->scores[j - a->first];
        for (int d = 0; d < a->d_v; d++) a->out[d] += p * v[d];
    }
}

void op_attention_paged(float *out, const float *q, const void *const *k_blocks, const void *const *v_blocks,
                        kv_row_type type, int64_t n_keys, int64_t query_pos, int n_head, int n_head_kv, int d_k,
                        int d_v, float scale, int64_t window, int head_begin, int head_end, float *scratch) {
    quant_isa isa = quant_get_isa();
    void (*head_fn)(const attention_head_args *) = isa == QUANT_ISA_AVX512 ? attention_head_avx512
                                                   : isa == QUANT_ISA_AVX2 ? attention_head_avx2
                                                                           : attention_head_scalar;
    int group = n_head / n_head_kv;
    int64_t first = 0;
    if (window > 0 && query_pos - window + 1 > 0) first = query_pos - window + 1;
    kv_row_type k_type = kv_row_key_type(type);
    float qk[ATTENTION_MAX_HEAD];
    for (int h = head_begin; h < head_end; h++) {
        int kvh = h / group;
        const float *qh = q + (int64_t)h * d_k;
        if (kv_row_rotated(k_type)) { /* heads of a rotated type are at most ATTENTION_MAX_HEAD (forward.c) */
            kv_row_query(k_type, qh, qk, d_k);
            qh = qk;
        }
        attention_head_args a = {out + (int64_t)h * d_v, qh, k_blocks, v_blocks, first, n_keys,
                                 kv_row_bytes(k_type, n_head_kv * d_k), kv_row_bytes(type, n_head_kv * d_v),
                                 kvh * d_k, kvh * d_v, d_k, d_v, k_type, type, scale, scratch};
        head_fn(&a);
    }
}

const char *op_attention_precision_fallback(attention_precision want, int d_k, int d_v) {
    if (want == ATTENTION_F32) return NULL;
    /* QUANT_ISA_AVX512 is AVX-512 with VNNI (vpdpbusd, the int8 dots) */
    if (quant_get_isa() != QUANT_ISA_AVX512 || !quant_cpu_has_avx512_bf16())
        return "this CPU has no AVX512_BF16 (vdpbf16ps)";
    if (d_k != d_v || (d_k != 64 && d_k != 128))
        return want == ATTENTION_INT8 ? "int8 attention needs heads of 64 or 128 values"
                                      : "bf16 attention needs heads of 64 or 128 values";
    return NULL;
}

attention_precision op_attention_precision(attention_precision want, int d_k, int d_v) {
    return op_attention_precision_fallback(want, d_k, d_v) == NULL ? want : ATTENTION_F32;
}

const char *attention_precision_name(attention_precision p) {
    return p == ATTENTION_BF16 ? "bf16" : p == ATTENTION_INT8 ? "int8" : "f32";
}

bool attention_precision_parse(const char *s, attention_precision *out) {
    if (s == NULL) return false;
    if (strcmp(s, "f32") == 0) *out = ATTENTION_F32;
    else if (strcmp(s, "bf16") == 0) *out = ATTENTION_BF16;
    else if (strcmp(s, "int8") == 0) *out = ATTENTION_INT8;
    else return false;
    return true;
}

static void run_heads(const attention_head_args *args, int n, attention_precision prec) {
    quant_isa isa = quant_get_isa();
    if (prec != ATTENTION_F32) { /* bf16 or int8: the pairs' int8 says which */
        attention_heads_avx512bf16(args, n);
    } else if (isa == QUANT_ISA_AVX512) {
        attention_heads_avx512(args, n);
    } else if (isa == QUANT_ISA_AVX2) {
        attention_heads_avx2(args, n);
    } else {
        for (int i = 0; i < n; i++) attention_head_scalar(&args[i]);
    }
}

void op_attention_paged_rows(float *out, size_t out_stride, const float *q, size_t q_stride,
                             const void *const *k_blocks, const void *const *v_blocks, kv_row_type type,
                             const int64_t *query_pos,
                             int n_rows, int n_head, int n_head_kv, int d_k, int d_v, float scale,
                             int64_t window, int head_begin, int head_end, float *scratch) {
    op_attention_paged_rows_prec(out, out_stride, q, q_stride, k_blocks, v_blocks, type, query_pos, n_rows, n_head,
                                 n_head_kv, d_k, d_v, scale, window, head_begin, head_end, scratch, ATTENTION_F32,
                                 NULL);
}

size_t op_attention_bf16_tiles_bytes(attention_precision prec, int64_t n_keys, int d) {
    return (size_t)((n_keys + 63) / 64) * (prec == ATTENTION_INT8 ? ATTENTION_INT8_TILE_BYTES(d) : ATTENTION_BF16_TILE_BYTES(d));
}

bool op_attention_bf16_tiles_build(attention_precision prec, void *head_tiles, const void *const *k_blocks,
                                   const void *const *v_blocks,
                                   kv_row_type type, int n_head_kv, int d, int kv_head, int64_t n_keys,
                                   int64_t block_begin, int64_t block_end) {
    if (prec == ATTENTION_F32 || op_attention_precision(prec, d, d) != prec) return false;
    kv_row_type k_type = kv_row_key_type(type);
    attention_head_args a = {.k_blocks = k_blocks, .v_blocks = v_blocks, .first = 0, .n_keys = n_keys,
                             .k_stride = kv_row_bytes(k_type, n_head_kv * d), .v_stride = kv_row_bytes(type, n_head_kv * d),
                             .k_offset = kv_head * d, .v_offset = kv_head * d, .d_k = d, .d_v = d,
                             .k_type = k_type, .v_type = type, .int8 = prec == ATTENTION_INT8};
    attention_bf16_tiles_build_avx512bf16(head_tiles, &a, block_begin, block_end);
    return true;
}

void op_attention_paged_rows_prec(float *out, size_t out_stride, const float *q, size_t q_stride,
                                  const void *const *k_blocks, const void *const *v_blocks, kv_row_type type,
                                  const int64_t *query_pos, int n_rows, int n_head, int n_head_kv, int d_k, int d_v,
                                  float scale, int64_t window, int head_begin, int head_end, float *scratch,
                                  attention_precision prec, const attention_bf16_tiles *tiles) {
    /* a caller that skipped op_attention_precision still gets a kernel that exists here */
    if (op_attention_precision(prec, d_k, d_v) != prec) prec = ATTENTION_F32;
    enum { MAX_PAIRS = 256, QK_FLOATS = 8192 };
    attention_head_args args[MAX_PAIRS];
    /* each pair's query in the keys' domain (kv_row_query); flushing early
     * when it is full changes no bits (pairs are independent) */
    float qk[QK_FLOATS];
    kv_row_type k_type = kv_row_key_type(type);
    int group = n_head / n_head_kv, n = 0;
    int64_t max_keys = 0;
    for (int r = 0; r < n_rows; r++)
        if (query_pos[r] + 1 > max_keys) max_keys = query_pos[r] + 1;
    /* Head-major within a kv group, rows inner: neighbours share a kv head. */
    for (int h = head_begin; h < head_end; h++) {
        for (int r = 0; r < n_rows; r++) {
            bool rotated = kv_row_rotated(k_type);
            if (n == MAX_PAIRS || (rotated && (size_t)(n + 1) * (size_t)d_k > QK_FLOATS)) {
                run_heads(args, n, prec);
                n = 0;
            }
            int64_t first = 0;
            if (window > 0 && query_pos[r] - window + 1 > 0) first = query_pos[r] - window + 1;
            int kvh = h / group;
            const float *qh = q + r * q_stride + (int64_t)h * d_k;
            if (rotated) {
                kv_row_query(k_type, qh, qk + (size_t)n * (size_t)d_k, d_k);
                qh = qk + (size_t)n * (size_t)d_k;
            }
            args[n] = (attention_head_args){out + r * out_stride + (int64_t)h * d_v, qh,
                                            k_blocks, v_blocks, first, query_pos[r] + 1,
                                            kv_row_bytes(k_type, n_head_kv * d_k), kv_row_bytes(type, n_head_kv * d_v),
                                            kvh * d_k, kvh * d_v, d_k, d_v, k_type, type, scale,
                                            prec != ATTENTION_F32 ? NULL : scratch + (size_t)n * (size_t)max_keys};
            args[n].int8 = prec == ATTENTION_INT8;
            if (prec != ATTENTION_F32 && tiles) {
                args[n].bf16_tiles = (const uint8_t *)tiles->base + (size_t)kvh * tiles->head_bytes;
                args[n].bf16_tiled_keys = tiles->n_keys;
            }
            n++;
        }
    }
    run_heads(args, n, prec);
}
