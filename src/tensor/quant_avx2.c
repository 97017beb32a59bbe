/* quant_avx2.c - AVX2 + FMA dot products, for CPUs without AVX-512 VNNI.
 *
 * Design: as in quant_avx512.c, each block's exact integer dot is computed
 * with SIMD and folded with quant.h's shared formula, so quantized dots are
 * bit-identical to the scalar kernels. Without VNNI the byte products use
 * pmaddubsw (unsigned x signed, saturating 16-bit pair sums) then pmaddwd:
 *  - Q8_0: the sign of w is moved onto a (psignb) so that |w| <= 128 and the
 *    pair sums stay below 2^15;
 *  - Q4_0: nibbles u = q + 8 (<= 15) and the offset is paid back with
 *    8 * sum(a);
 *  - Q4_K / Q6_K: unsigned values (<= 63) times the activations, pmaddwd with
 *    the 16-bit sub-block scales; mins / the Q6_K offset through bsums.
 * Types not listed here use the scalar kernels (identical results). The
 * float row dots (f32/f16/bf16) use 8-lane accumulators: deterministic for
 * this ISA. Small batches (1..8 tokens) have strips of rows x tokens that
 * load each weight block once (see the strips section). */
#include <immintrin.h>
#include <string.h>

#include "tensor/quant.h"
#include "tensor/quant_avx2_strip.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

ALWAYS_INLINE float load_f16(const void *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

ALWAYS_INLINE int32_t hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* Signed x signed byte dot of 32 pairs as 8 int32 lanes. */
ALWAYS_INLINE __m256i dot_s8(__m256i w, __m256i a) {
    __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

static float dot_q8_0(int64_t n, const void *w, const void *a) {
    const block_q8_0 *x = w, *y = a;
    float acc = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        __m256i t = dot_s8(_mm256_loadu_si256((const __m256i *)x[i].qs),
                           _mm256_loadu_si256((const __m256i *)y[i].qs));
        acc = quant_fold(acc, hsum_epi32(t), load_f16(&x[i].d), load_f16(&y[i].d));
    }
    return acc;
}

static float dot_q4_0(int64_t n, const void *w, const void *a) {
    const block_q4_0 *x = w;
    const block_q8_0 *y = a;
    const __m256i ones16 = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(15);
    float acc = 0;
    for (int64_t i = 0; i < n / 32; i++) {
        __m128i q = _mm_loadu_si128((const __m128i *)x[i].qs);
        __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
        __m256i av = _mm256_loadu_si256((const __m256i *)y[i].qs);
        __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(u, av), ones16);
        __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(8), av), ones16);
        acc = quant_fold(acc, hsum_epi32(_mm256_sub_epi32(t, s)), load_f16(&x[i].d), load_f16(&y[i].d));
    }
    return acc;
}

/* Scale words for 32-element chunk k (units 2k, 2k+1). */
ALWAYS_INLINE __m256i chunk_scales(const int16_t *unit_scales, int k) {
    return _mm256_set_m128i(_mm_set1_epi16(unit_scales[2 * k + 1]), _mm_set1_epi16(unit_scales[2 * k]));
}

static float dot_q4_K(int64_t n, const void *w, const void *a) {
    const block_q4_K *x = w;
    const block_q8_K *y = a;
    const __m256i m4 = _mm256_set1_epi8(15);
    float acc = 0;
    for (int64_t i = 0; i < n / 256; i++) {
        int16_t scales[16], mins[16];
        for (int j = 0; j < 8; j++) {
            uint8_t sc, m;
            quant_k4_scale_min(j, x[i].scales, &sc, &m);
            scales[2 * j] = scales[2 * j + 1] = sc;
            mins[2 * j] = mins[2 * j + 1] = m;
        }
        __m256i lanes = _mm256_setzero_si256();
        for (int g = 0; g < 4; g++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * g));
            __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            __m256i a0 = _mm256_loadu_si256((const __m256i *)(y[i].qs + 64 * g));
            __m256i a1 = _mm256_loadu_si256((const __m256i *)(y[i].qs + 64 * g + 32));
            /* chunk 2g = sub-block 2g (units 4g, 4g+1), chunk 2g+1 = sub-block 2g+1 */
            lanes = _mm256_add_epi32(lanes, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, a0), chunk_scales(scales, 2 * g)));
            lanes = _mm256_add_epi32(lanes, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, a1), chunk_scales(scales, 2 * g + 1)));
        }
        int32_t msum = hsum_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)mins),
                                                    _mm256_loadu_si256((const __m256i *)y[i].bsums)));
        acc = quant_fold_min(acc, hsum_epi32(lanes), msum, load_f16(&x[i].d), load_f16(&x[i].dmin), y[i].d);
    }
    return acc;
}

static float dot_q6_K(int64_t n, const void *w, const void *a) {
    const block_q6_K *x = w;
    const block_q8_K *y = a;
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    float acc = 0;
    for (int64_t i = 0; i < n / 256; i++) {
        int16_t scales[16];
        for (int k = 0; k < 16; k++) scales[k] = x[i].scales[k];
        __m256i lanes = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i ql0 = _mm256_loadu_si256((const __m256i *)(x[i].ql + 64 * h));
            __m256i ql1 = _mm256_loadu_si256((const __m256i *)(x[i].ql + 64 * h + 32));
            __m256i qh = _mm256_loadu_si256((const __m256i *)(x[i].qh + 32 * h));
            __m256i u[4] = {
                _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4)),
                _mm256_or_si256(_mm256_and_si256(ql1, m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4)),
            };
            for (int k = 0; k < 4; k++) {
                __m256i av = _mm256_loadu_si256((const __m256i *)(y[i].qs + 128 * h + 32 * k));
                lanes = _mm256_add_epi32(lanes, _mm256_madd_epi16(_mm256_maddubs_epi16(u[k], av),
                                                                  chunk_scales(scales, 4 * h + k)));
            }
        }
        /* q = u - 32: subtract 32 * sum_k scale_k * bsum_k */
        __m256i sc16 = _mm256_slli_epi16(_mm256_loadu_si256((const __m256i *)scales), 5);
        int32_t corr = hsum_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)y[i].bsums)));
        acc = quant_fold(acc, hsum_epi32(lanes) - corr, load_f16(&x[i].d), y[i].d);
    }
    return acc;
}

#define FLOAT_DOT(NAME, LOADW)                                                                 \
    static float dot_##NAME(int64_t n, const void *w, const void *a) {                         \
        const uint8_t *x = w;                                                                  \
        const float *y = a;                                                                    \
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                         \
        int64_t i = 0;                                                                         \
        for (; i + 16 <= n; i += 16) {                                                         \
            acc0 = _mm256_fmadd_ps(LOADW(x, i), _mm256_loadu_ps(y + i), acc0);                 \
            acc1 = _mm256_fmadd_ps(LOADW(x, i + 8), _mm256_loadu_ps(y + i + 8), acc1);         \
        }                                                                                      \
        acc0 = _mm256_add_ps(acc0, acc1);                                                      \
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc0), _mm256_extractf128_ps(acc0, 1));   \
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                                \
        s = _mm_add_ss(s, _mm_movehdup_ps(s));                                                 \
        float sum = _mm_cvtss_f32(s);                                                          \
        for (; i < n; i++) { /* tail: scalar, in order */                                      \
            float wi;                                                                          \
            LOADW##_ONE(x, i, wi);                                                             \
            sum = __builtin_fmaf(wi, y[i], sum);                                               \
        }                                                                                      \
        return sum;                                                                            \
    }

#define LOAD_F32(x, i) _mm256_loadu_ps((const float *)(x) + (i))
#define LOAD_F32_ONE(x, i, v) memcpy(&(v), (x) + 4 * (i), 4)
#define LOAD_F16(x, i) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((x) + 2 * (i))))
#define LOAD_F16_ONE(x, i, v) ((v) = load_f16((x) + 2 * (i)))
#define LOAD_BF16(x, i) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((x) + 2 * (i)))), 16))
#define LOAD_BF16_ONE(x, i, v)             \
    do {                                   \
        uint16_t h_;                       \
        memcpy(&h_, (x) + 2 * (i), 2);     \
        (v) = quant_bf16_to_f32(h_);       \
    } while (0)

FLOAT_DOT(f32, LOAD_F32)
FLOAT_DOT(f16, LOAD_F16)
FLOAT_DOT(bf16, LOAD_BF16)

/* vcvtps2ph with round-to-nearest-even: the IEEE conversion that
 * quant_f32_to_f16 spells out bit by bit, including subnormal results,
 * overflow to infinity and quiet NaNs with their payload's top bits (f32
 * subnormal inputs give signed zero either way, with or without DAZ). */
void quant_avx2_f32_to_f16_row(const float *src, uint16_t *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) dst[i] = quant_f32_to_f16(src[i]);
}

void quant_avx2_kernels(quant_dot_fn dots[DT_COUNT]) {
    dots[DT_F32] = dot_f32;
    dots[DT_F16] = dot_f16;
    dots[DT_BF16] = dot_bf16;
    dots[DT_Q4_0] = dot_q4_0;
    dots[DT_Q8_0] = dot_q8_0;
    dots[DT_Q4_K] = dot_q4_K;
    dots[DT_Q6_K] = dot_q6_K;
}

/* ------------------------------------------------ small-batch strips */

/* meta (quant.h): per (token, block) {-128 * sum(qs), d as f32}, the
 * activation scales already converted. */
ALWAYS_INLINE void strip_q8_0(const int R, const int C, int64_t n, const void *w, size_t ws, int rows,
                              const void *a, size_t as, const int32_t *meta, float *yout, size_t ys) {
    const uint8_t *wr[8], *act = a;
    rows_of(R, w, ws, rows, wr);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 32; i++) {
        __m256i t[8];
        float dw[8], da[8];
        UNROLL
        for (int c = 0; c < C; c++) da[c] = meta_d(meta_of(meta, n, c, i));
        UNROLL
        for (int r = 0; r < R; r++) {
            const uint8_t *b = wr[r] + i * 34;
            dw[r] = load_f16(b);
            __m256i wv = _mm256_loadu_si256((const __m256i *)(b + 2)), wabs = _mm256_sign_epi8(wv, wv);
            UNROLL
            for (int c = 0; c < C; c++) {
                __m256i av = _mm256_loadu_si256((const __m256i *)(act + c * as + i * 34 + 2));
                t[r * C + c] = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(av, wv)), ones);
            }
        }
        UNROLL
        for (int p = R * C; p < 8; p++) t[p] = _mm256_setzero_si256();
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(t)), _mm256_mul_ps(by_row(R, C, dw), by_tok(C, da)), acc);
    }
    store_pairs(R, C, rows, acc, yout, ys);
}

ALWAYS_INLINE void strip_q4_0(const int R, const int C, int64_t n, const void *w, size_t ws, int rows,
                              const void *a, size_t as, const int32_t *meta, float *yout, size_t ys) {
    const uint8_t *wr[8], *act = a;
    rows_of(R, w, ws, rows, wr);
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(15);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 32; i++) {
        __m256i t[8];
        float dw[8], da[8];
        /* 8 * sum(a) per token, spread to pairs: meta holds -128 * sum,
         * so 8 * sum = -(m >> 4) exactly */
        int32_t o8[8];
        UNROLL
        for (int c = 0; c < C; c++) {
            const int32_t *m = meta_of(meta, n, c, i);
            o8[c] = -(m[0] >> 4);
            da[c] = meta_d(m);
        }
        __m256i offs = _mm256_setr_epi32(o8[0 % C], o8[1 % C], o8[2 % C], o8[3 % C], o8[4 % C], o8[5 % C],
                                         o8[6 % C], o8[7 % C]);
        UNROLL
        for (int r = 0; r < R; r++) {
            const uint8_t *b = wr[r] + i * 18;
            dw[r] = load_f16(b);
            __m128i q = _mm_loadu_si128((const __m128i *)(b + 2));
            __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
            UNROLL
            for (int c = 0; c < C; c++) {
                __m256i av = _mm256_loadu_si256((const __m256i *)(act + c * as + i * 34 + 2));
                t[r * C + c] = _mm256_madd_epi16(_mm256_maddubs_epi16(u, av), ones);
            }
        }
        UNROLL
        for (int p = R * C; p < 8; p++) t[p] = _mm256_setzero_si256();
        __m256i isum = _mm256_sub_epi32(reduce8(t), offs);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(by_row(R, C, dw), by_tok(C, da)), acc);
    }
    store_pairs(R, C, rows, acc, yout, ys);
}

/* Q4_K: per row the 6-bit scales and mins once, then every token; the mins
 * term (msum) of each pair goes through a second tree. */
ALWAYS_INLINE void strip_q4_K(const int R, const int C, int64_t n, const void *w, size_t ws, int rows,
                              const void *a, size_t as, const int32_t *meta, float *yout, size_t ys) {
    (void)meta; /* Q8_K activations carry no meta */
    const uint8_t *wr[8], *act = a;
    rows_of(R, w, ws, rows, wr);
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        __m256i t[8], m[8];
        float dw[8], dmw[8], da[8];
        UNROLL
        for (int c = 0; c < C; c++) da[c] = ((const block_q8_K *)(act + c * as) + i)->d;
        UNROLL
        for (int r = 0; r < R; r++) {
            const block_q4_K *x = (const block_q4_K *)wr[r] + i;
            int16_t scales[16], mins[16];
            for (int j = 0; j < 8; j++) {
                uint8_t sc, mn;
                quant_k4_scale_min(j, x->scales, &sc, &mn);
                scales[2 * j] = scales[2 * j + 1] = sc;
                mins[2 * j] = mins[2 * j + 1] = mn;
            }
            dw[r] = load_f16(&x->d);
            dmw[r] = load_f16(&x->dmin);
            __m256i mins16 = _mm256_loadu_si256((const __m256i *)mins);
            UNROLL
            for (int c = 0; c < C; c++) {
                t[r * C + c] = _mm256_setzero_si256();
                m[r * C + c] = _mm256_madd_epi16(mins16, _mm256_loadu_si256((const __m256i *)((const block_q8_K *)(act + c * as) + i)->bsums));
            }
            for (int g = 0; g < 4; g++) {
                __m256i q = _mm256_loadu_si256((const __m256i *)(x->qs + 32 * g));
                __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                __m256i s0 = chunk_scales(scales, 2 * g), s1 = chunk_scales(scales, 2 * g + 1);
                UNROLL
                for (int c = 0; c < C; c++) {
                    const int8_t *aq = ((const block_q8_K *)(act + c * as) + i)->qs + 64 * g;
                    __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)aq)), s0);
                    __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(aq + 32))), s1);
                    t[r * C + c] = _mm256_add_epi32(t[r * C + c], _mm256_add_epi32(p0, p1));
                }
            }
        }
        UNROLL
        for (int p = R * C; p < 8; p++) t[p] = m[p] = _mm256_setzero_si256();
        __m256 da8 = by_tok(C, da);
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(t)), _mm256_mul_ps(by_row(R, C, dw), da8), acc);
        acc = _mm256_fmadd_ps(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtepi32_ps(reduce8(m))),
                              _mm256_mul_ps(by_row(R, C, dmw), da8), acc);
    }
    store_pairs(R, C, rows, acc, yout, ys);
}

ALWAYS_INLINE void strip_q6_K(const int R, const int C, int64_t n, const void *w, size_t ws, int rows,
                              const void *a, size_t as, const int32_t *meta, float *yout, size_t ys) {
    (void)meta; /* Q8_K activations carry no meta */
    const uint8_t *wr[8], *act = a;
    rows_of(R, w, ws, rows, wr);
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / 256; i++) {
        __m256i t[8], m[8];
        float dw[8], da[8];
        UNROLL
        for (int c = 0; c < C; c++) da[c] = ((const block_q8_K *)(act + c * as) + i)->d;
        UNROLL
        for (int r = 0; r < R; r++) {
            const block_q6_K *x = (const block_q6_K *)wr[r] + i;
            int16_t scales[16];
            for (int k = 0; k < 16; k++) scales[k] = x->scales[k];
            dw[r] = load_f16(&x->d);
            __m256i sc16 = _mm256_slli_epi16(_mm256_loadu_si256((const __m256i *)scales), 5);
            UNROLL
            for (int c = 0; c < C; c++) {
                t[r * C + c] = _mm256_setzero_si256();
                m[r * C + c] = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)((const block_q8_K *)(act + c * as) + i)->bsums));
            }
            for (int h = 0; h < 2; h++) {
                __m256i ql0 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h));
                __m256i ql1 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h + 32));
                __m256i qh = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * h));
                __m256i u[4] = {
                    _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4)),
                    _mm256_or_si256(_mm256_and_si256(ql1, m4),
                                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4)),
                };
                for (int k = 0; k < 4; k++) {
                    __m256i sk = chunk_scales(scales, 4 * h + k);
                    UNROLL
                    for (int c = 0; c < C; c++) {
                        const int8_t *aq = ((const block_q8_K *)(act + c * as) + i)->qs + 128 * h + 32 * k;
                        t[r * C + c] = _mm256_add_epi32(
                            t[r * C + c], _mm256_madd_epi16(_mm256_maddubs_epi16(u[k], _mm256_loadu_si256((const __m256i *)aq)), sk));
                    }
                }
            }
        }
        UNROLL
        for (int p = R * C; p < 8; p++) t[p] = m[p] = _mm256_setzero_si256();
        __m256i isum = _mm256_sub_epi32(reduce8(t), reduce8(m));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(by_row(R, C, dw), by_tok(C, da)), acc);
    }
    store_pairs(R, C, rows, acc, yout, ys);
}

/* Float rows: FLOAT_DOT's two 8-lane accumulators per pair, its 16-chunk
 * order, horizontal sum and in-order scalar tail, for at most 4 pairs at a
 * time (8 accumulators); 5..8 tokens take two passes over a row still in L1. */
#define FLOAT_STRIP(NAME, LOADW)                                                                   \
    ALWAYS_INLINE void pass_##NAME(const int R, const int C, int64_t n, const uint8_t *const *wr,  \
                                   int rows, const float *a, size_t fs, float *y, size_t ys) {     \
        __m256 acc0[4], acc1[4];                                                                   \
        UNROLL                                                                                     \
        for (int p = 0; p < R * C; p++) acc0[p] = acc1[p] = _mm256_setzero_ps();                   \
        int64_t i = 0;                                                                             \
        for (; i + 16 <= n; i += 16)                                                               \
            UNROLL                                                                                 \
            for (int r = 0; r < R; r++) {                                                          \
                __m256 w0 = LOADW(wr[r], i), w1 = LOADW(wr[r], i + 8);                             \
                UNROLL                                                                             \
                for (int c = 0; c < C; c++) {                                                      \
                    acc0[r * C + c] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(a + c * fs + i), acc0[r * C + c]); \
                    acc1[r * C + c] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(a + c * fs + i + 8), acc1[r * C + c]); \
                }                                                                                  \
            }                                                                                      \
        UNROLL                                                                                     \
        for (int r = 0; r < R; r++)                                                                \
            UNROLL                                                                                 \
            for (int c = 0; c < C; c++) {                                                          \
                __m256 v = _mm256_add_ps(acc0[r * C + c], acc1[r * C + c]);                        \
                __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));     \
                s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                            \
                s = _mm_add_ss(s, _mm_movehdup_ps(s));                                             \
                float sum = _mm_cvtss_f32(s);                                                      \
                for (int64_t k = i; k < n; k++) {                                                  \
                    float wk;                                                                      \
                    LOADW##_ONE(wr[r], k, wk);                                                     \
                    sum = __builtin_fmaf(wk, a[c * fs + k], sum);                                  \
                }                                                                                  \
                if (r < rows) y[c * ys + r] = sum;                                                 \
            }                                                                                      \
    }                                                                                              \
    ALWAYS_INLINE void strip_##NAME(const int R, const int C, int64_t n, const void *w, size_t ws, \
                                    int rows, const void *a, size_t as, const int32_t *meta,       \
                                    float *y, size_t ys) {                                         \
        (void)meta;                                                                                \
        const uint8_t *wr[8];                                                                      \
        rows_of(R, w, ws, rows, wr);                                                               \
        const size_t fs = as / sizeof(float);                                                      \
        if (C <= 4) {                                                                              \
            pass_##NAME(R, C, n, wr, rows, a, fs, y, ys);                                          \
        } else {                                                                                   \
            pass_##NAME(R, 4, n, wr, rows, a, fs, y, ys);                                          \
            pass_##NAME(R, C - 4, n, wr, rows, (const float *)a + 4 * fs, fs, y + 4 * ys, ys);     \
        }                                                                                          \
    }

FLOAT_STRIP(f32, LOAD_F32)
FLOAT_STRIP(f16, LOAD_F16)
FLOAT_STRIP(bf16, LOAD_BF16)

STRIPS(q8_0, INT_H)
STRIPS(q4_0, INT_H)
STRIPS(q4_K, INT_H)
STRIPS(q6_K, INT_H)
STRIPS(f32, FLT_H)
STRIPS(f16, FLT_H)
STRIPS(bf16, FLT_H)

void quant_avx2_strips(quant_strip_fn strips[DT_COUNT][QUANT_STRIP_TOKENS + 1],
                       int heights[DT_COUNT][QUANT_STRIP_TOKENS + 1]) {
    set_strips_q8_0(strips[DT_Q8_0], heights[DT_Q8_0]);
    set_strips_q4_0(strips[DT_Q4_0], heights[DT_Q4_0]);
    set_strips_q4_K(strips[DT_Q4_K], heights[DT_Q4_K]);
    set_strips_q6_K(strips[DT_Q6_K], heights[DT_Q6_K]);
    set_strips_f32(strips[DT_F32], heights[DT_F32]);
    set_strips_f16(strips[DT_F16], heights[DT_F16]);
    set_strips_bf16(strips[DT_BF16], heights[DT_BF16]);
    /* a lone float token: the GEMV dot is faster (as on AVX-512) */
    strips[DT_F32][1] = NULL;
    strips[DT_F16][1] = NULL;
    strips[DT_BF16][1] = NULL;
}
