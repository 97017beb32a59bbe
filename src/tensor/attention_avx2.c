/* attention_avx2.c - causal attention of query heads over one kv head, AVX2.
 *
 * One routine serves both entry points: attention_head_avx2 is
 * heads_group with a single query, attention_heads_avx2 hands it runs of
 * neighbouring queries that share a kv head (the heads of a GQA group, the
 * rows of a prefill chunk). Each query goes through the same operations
 * whatever its neighbours, so a row's bits never depend on the batch:
 *
 *  - scores: per key, one fma chain over d_k in 8-lane steps (q and the key
 *    zero-padded to a multiple of 8), then a fixed horizontal tree
 *    ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)), then * scale. Full tiles of 8
 *    keys run 8 chains side by side and fold them with a transposed tree
 *    that pairs the lanes the same way (reduce8), so a key's score is the
 *    same bits in a tile or alone;
 *  - softmax: max, exp by a degree-6 polynomial with 2^n built in the
 *    exponent field, the sum in 8 lanes indexed by key offset from `first`,
 *    then p_j = e_j * (1 / sum);
 *  - values: per output lane, fma(p_j, v_j, acc) over keys in order. Keys go
 *    in chunks of rows (as many as fit a 32 KB tile) and lanes in slices of
 *    16; a slice's accumulators are stored to out and reloaded for the next
 *    chunk, which is exact, so the chunking never shows in the bits.
 *
 * K and V rows are decoded, each in its own format (a q8_0 pool keeps K in
 * q12h), into small f32 tiles (f16 by vcvtph2ps, q8_0 and q12h as d * q in
 * one multiply, the values kv_row_decode gives; other offsets and tails by
 * kv_row_decode itself), so attention over encoded rows equals attention
 * over their decoded f32 copies bit for bit (the query comes in the keys'
 * domain, kv_row_query). The
 * tiles are loaded once per run of queries: the more queries share a kv
 * head, the fewer times K and V stream from memory.
 *
 * The polynomial exp differs from expf in the last bits, so this kernel
 * agrees with the scalar one closely, not bit for bit (the AVX-512 kernel
 * likewise); results are bit-stable within the ISA. */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "tensor/attention_impl.h"
#include "tensor/quant.h"

enum {
    KTILE = 8,          /* keys per score tile */
    VT_FLOATS = 8192,   /* the value tile (32 KB of stack): 8192 / padded d_v rows per chunk, >= 16 */
    MQ = 4,             /* queries per value pass (2 x MQ accumulators + 2 loads + p) */
};

/* Values [offset, offset + n) of an encoded row into dst (exact). */
static inline void decode_avx2(kv_row_type type, const uint8_t *row, int offset, int n, float *dst) {
    if (type == KV_ROW_F32) {
        memcpy(dst, row + 4 * (size_t)offset, (size_t)n * sizeof(float));
        return;
    }
    if (type == KV_ROW_F16) {
        int i = 0;
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * (size_t)(offset + i)))));
        if (i < n) kv_row_decode(type, row, offset + i, n - i, dst + i);
        return;
    }
    if (type == KV_ROW_Q12H && offset % KV_ROW_Q12H_BLOCK == 0 && n % KV_ROW_Q12H_BLOCK == 0) {
        /* value j of a block: d * (16 * hi[j] + nibble j of lo), one product */
        const uint8_t *b = row + (size_t)(offset / KV_ROW_Q12H_BLOCK) * sizeof(kv_block_q12h);
        const __m128i low4 = _mm_set1_epi8(15);
        for (int i = 0; i < n; i += KV_ROW_Q12H_BLOCK, b += sizeof(kv_block_q12h)) {
            uint16_t h;
            memcpy(&h, b, 2);
            __m256 d = _mm256_set1_ps(_cvtsh_ss(h));
            __m128i lo = _mm_loadu_si128((const __m128i *)(b + 34));
            __m128i nib[2] = {_mm_and_si128(lo, low4), _mm_and_si128(_mm_srli_epi16(lo, 4), low4)};
            for (int k = 0; k < 4; k++) {
                __m256i hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * k)));
                __m128i nb = k % 2 ? _mm_srli_si128(nib[k / 2], 8) : nib[k / 2];
                __m256i q = _mm256_add_epi32(_mm256_slli_epi32(hi, 4), _mm256_cvtepu8_epi32(nb));
                _mm256_storeu_ps(dst + i + 8 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
            }
        }
        return;
    }
    if (type == KV_ROW_Q8_0 && offset % KV_ROW_Q8_0_BLOCK == 0 && n % KV_ROW_Q8_0_BLOCK == 0) {
        const uint8_t *b = row + (size_t)(offset / KV_ROW_Q8_0_BLOCK) * sizeof(block_q8_0);
        for (int i = 0; i < n; i += KV_ROW_Q8_0_BLOCK, b += sizeof(block_q8_0)) {
            uint16_t h;
            memcpy(&h, b, 2);
            __m256 d = _mm256_set1_ps(_cvtsh_ss(h)); /* exact, = quant_f16_to_f32 */
            for (int k = 0; k < 4; k++) {
                __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * k)));
                _mm256_storeu_ps(dst + i + 8 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
            }
        }
        return;
    }
    kv_row_decode(type, row, offset, n, dst);
}

static inline void prefetch_row(const void *const *blocks, size_t stride, int64_t j, size_t head, size_t bytes) {
    const char *p = (const char *)attention_row(blocks, stride, j) + head;
    for (size_t c = 0; c < bytes; c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
}

/* ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)) */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* Lane k = hsum8(v[k]) bit for bit: the same pairings for 8 vectors. */
static inline __m256 reduce8(const __m256 v[8]) {
    __m256 s[4], u[2];
    for (int p = 0; p < 4; p++) /* halves: [a0+a4 .. a3+a7 | b0+b4 .. b3+b7] */
        s[p] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x20),
                             _mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x31));
    for (int p = 0; p < 2; p++) /* [A02 A13 C02 C13 | B02 B13 D02 D13] */
        u[p] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * p], s[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(s[2 * p], s[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* [v0 v2 v4 v6 | v1 v3 v5 v7] */
    __m256 f = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm256_permutevar8x32_ps(f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline __m256 exp_ps(__m256 x) {
    const __m256 log2e = _mm256_set1_ps(1.44269504088896341f);
    const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, ln2_hi, x);
    r = _mm256_fnmadd_ps(n, ln2_lo, r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* n >= -126 after the clamp and <= 0 for x <= 0: 2^n is a normal float */
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline __m256i tail_mask(int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), idx);
}

/* s[0..n) <- softmax(s): e_j = exp(s_j - max) in lanes j % 8, sum folded by
 * hsum8, then e_j * (1 / sum). */
static void softmax_scale(float *s, int64_t n) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(s + j), m8);
    float max = -INFINITY;
    float lanes[8];
    _mm256_storeu_ps(lanes, m8);
    for (int k = 0; k < 8; k++) max = lanes[k] > max ? lanes[k] : max;
    for (; j < n; j++) max = s[j] > max ? s[j] : max;
    __m256 vmax = _mm256_set1_ps(max), vsum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmax));
        _mm256_storeu_ps(s + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    if (j < n) {
        __m256i m = tail_mask(n - j);
        __m256 e = exp_ps(_mm256_sub_ps(_mm256_maskload_ps(s + j, m), vmax));
        _mm256_maskstore_ps(s + j, m, e);
        vsum = _mm256_add_ps(vsum, _mm256_and_ps(e, _mm256_castsi256_ps(m)));
    }
    float inv = 1.0f / hsum8(vsum);
    for (j = 0; j < n; j++) s[j] *= inv;
}

/* Accumulators of up to MQ queries over lanes [d0, d0 + 8 * nreg) for keys
 * [j0, j1) of a chunk (rows in vt); they start at zero on the first chunk,
 * else from out. */
static inline __attribute__((always_inline)) void values_slice(const int NQ, const int nreg,
                                                               const attention_head_args *a, const float *vt,
                                                               int vrow, int64_t first, int64_t j0, int64_t j1,
                                                               int d0) {
    __m256 acc[MQ][2];
    __m256i mask[2];
    for (int r = 0; r < nreg; r++) mask[r] = tail_mask(a[0].d_v - (d0 + 8 * r));
    for (int i = 0; i < NQ; i++)
        for (int r = 0; r < nreg; r++)
            acc[i][r] = j0 == first ? _mm256_setzero_ps() : _mm256_maskload_ps(a[i].out + d0 + 8 * r, mask[r]);
    for (int64_t jj = j0; jj < j1; jj++) {
        const float *v = vt + (size_t)(jj - j0) * vrow + d0;
        __m256 v0 = _mm256_load_ps(v), v1 = nreg > 1 ? _mm256_load_ps(v + 8) : v0;
        for (int i = 0; i < NQ; i++) {
            if (jj >= a[i].n_keys) continue;
            __m256 p = _mm256_set1_ps(a[i].scores[jj - first]);
            acc[i][0] = _mm256_fmadd_ps(p, v0, acc[i][0]);
            if (nreg > 1) acc[i][1] = _mm256_fmadd_ps(p, v1, acc[i][1]);
        }
    }
    for (int i = 0; i < NQ; i++)
        for (int r = 0; r < nreg; r++) _mm256_maskstore_ps(a[i].out + d0 + 8 * r, mask[r], acc[i][r]);
}

#define VALUES_SLICE(N, R)                                                                                       \
    static void values_slice_##N##_##R(const attention_head_args *a, const float *vt, int vrow, int64_t first,  \
                                       int64_t j0, int64_t j1, int d0) {                                        \
        values_slice(N, R, a, vt, vrow, first, j0, j1, d0);                                                      \
    }
VALUES_SLICE(1, 1) VALUES_SLICE(2, 1) VALUES_SLICE(3, 1) VALUES_SLICE(4, 1)
VALUES_SLICE(1, 2) VALUES_SLICE(2, 2) VALUES_SLICE(3, 2) VALUES_SLICE(4, 2)
typedef void (*values_slice_fn)(const attention_head_args *, const float *, int, int64_t, int64_t, int64_t, int);
static const values_slice_fn values_slices[2][MQ + 1] = {
    {NULL, values_slice_1_1, values_slice_2_1, values_slice_3_1, values_slice_4_1},
    {NULL, values_slice_1_2, values_slice_2_2, values_slice_3_2, values_slice_4_2},
};

/* The query as kpad floats: in place when d_k is a multiple of 8, else
 * copied into buf with zeros after it (the same values either way). */
static inline const float *query_padded(const attention_head_args *a, float *buf, int kpad) {
    if (a->d_k == kpad) return a->q;
    memcpy(buf, a->q, (size_t)a->d_k * sizeof(float));
    memset(buf + a->d_k, 0, (size_t)(kpad - a->d_k) * sizeof(float));
    return buf;
}

/* n queries over one kv head: the same blocks, offsets, types, d_k, d_v and
 * first key; n_keys may differ. */
static void heads_group(const attention_head_args *a, int n) {
    const int64_t first = a[0].first;
    const kv_row_type k_type = a[0].k_type, v_type = a[0].v_type;
    const int d_k = a[0].d_k, d_v = a[0].d_v;
    const int kpad = (d_k + 7) & ~7, vpad = (d_v + 7) & ~7;
    int64_t lo = a[0].n_keys, hi = a[0].n_keys;
    for (int i = 1; i < n; i++) {
        lo = a[i].n_keys < lo ? a[i].n_keys : lo;
        hi = a[i].n_keys > hi ? a[i].n_keys : hi;
    }
    const size_t k_head = value_byte(k_type, a[0].k_offset), v_head = value_byte(v_type, a[0].v_offset);
    const size_t k_bytes = value_byte(k_type, d_k), v_bytes = value_byte(v_type, d_v);
    float kt[KTILE][ATTENTION_MAX_HEAD] __attribute__((aligned(32)));
    float qp[ATTENTION_MAX_HEAD] __attribute__((aligned(32)));
    for (int k = 0; k < KTILE; k++) memset(kt[k] + d_k, 0, (size_t)(kpad - d_k) * sizeof(float));

    /* Scores. Full tiles where every query sees all 8 keys, then key by key. */
    int64_t j = first;
    for (; j + KTILE <= lo; j += KTILE) {
        for (int k = 0; k < KTILE; k++) {
            if (j + KTILE + k < hi) prefetch_row(a[0].k_blocks, a[0].k_stride, j + KTILE + k, k_head, k_bytes);
            decode_avx2(k_type, attention_row(a[0].k_blocks, a[0].k_stride, j + k), a[0].k_offset, d_k, kt[k]);
        }
        for (int i = 0; i < n; i++) {
            const float *qi = query_padded(&a[i], qp, kpad);
            __m256 acc[KTILE];
            for (int k = 0; k < KTILE; k++) acc[k] = _mm256_setzero_ps();
            for (int c = 0; c < kpad; c += 8) {
                __m256 qv = _mm256_loadu_ps(qi + c);
#pragma GCC unroll 8
                for (int k = 0; k < KTILE; k++) acc[k] = _mm256_fmadd_ps(qv, _mm256_load_ps(kt[k] + c), acc[k]);
            }
            _mm256_storeu_ps(a[i].scores + (j - first), _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(a[i].scale)));
        }
    }
    for (; j < hi; j++) {
        decode_avx2(k_type, attention_row(a[0].k_blocks, a[0].k_stride, j), a[0].k_offset, d_k, kt[0]);
        for (int i = 0; i < n; i++) {
            if (j >= a[i].n_keys) continue;
            const float *qi = query_padded(&a[i], qp, kpad);
            __m256 acc = _mm256_setzero_ps();
            for (int c = 0; c < kpad; c += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qi + c), _mm256_load_ps(kt[0] + c), acc);
            a[i].scores[j - first] = hsum8(acc) * a[i].scale;
        }
    }
    for (int i = 0; i < n; i++) softmax_scale(a[i].scores, a[i].n_keys - first);

    /* Values: chunks of vchunk rows; every query run of MQ and slice of 16
     * lanes per chunk. */
    float vt[VT_FLOATS] __attribute__((aligned(32)));
    const int vchunk = VT_FLOATS / vpad;
    for (int64_t j0 = first; j0 < hi; j0 += vchunk) {
        int64_t j1 = j0 + vchunk < hi ? j0 + vchunk : hi;
        for (int64_t jj = j0; jj < j1; jj++) {
            if (jj + vchunk < hi) prefetch_row(a[0].v_blocks, a[0].v_stride, jj + vchunk, v_head, v_bytes);
            float *dst = vt + (size_t)(jj - j0) * vpad;
            decode_avx2(v_type, attention_row(a[0].v_blocks, a[0].v_stride, jj), a[0].v_offset, d_v, dst);
            for (int d = d_v; d < vpad; d++) dst[d] = 0.0f;
        }
        for (int s0 = 0; s0 < n; s0 += MQ) {
            int m = n - s0 < MQ ? n - s0 : MQ;
            for (int d0 = 0; d0 < vpad; d0 += 16)
                values_slices[d0 + 16 <= vpad][m](a + s0, vt, vpad, first, j0, j1, d0);
        }
    }
}

void attention_head_avx2(const attention_head_args *a) {
    if (a->d_k > ATTENTION_MAX_HEAD || a->d_v > ATTENTION_MAX_HEAD) {
        attention_head_scalar(a); /* f32 rows of heads wider than the tiles */
        return;
    }
    heads_group(a, 1);
}

void attention_heads_avx2(const attention_head_args *a, int n) {
    int i = 0;
    while (i < n) {
        if (a[i].d_k > ATTENTION_MAX_HEAD || a[i].d_v > ATTENTION_MAX_HEAD) {
            attention_head_scalar(a + i);
            i++;
            continue;
        }
        int m = 1;
        while (i + m < n && attention_same_kv(&a[i], &a[i + m])) m++;
        heads_group(a + i, m);
        i += m;
    }
}
