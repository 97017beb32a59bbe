/* attention_avx512bf16.c - attention with bf16 products (AVX512_BF16,
 * vdpbf16ps): the opt-in ATTENTION_BF16 precision of op_attention_paged_rows,
 * and with int8 products (vpdpbusd) on the same online softmax: the opt-in
 * ATTENTION_INT8 (the I8 variants, last section of this comment).
 *
 * Why: vdpbf16ps multiplies 32 bf16 pairs into 16 f32 lanes per
 * instruction, twice the products of an f32 FMA, and at long context the
 * q.k and p.v products are most of a prefill's work (docs/attention.md).
 * What is rounded: the query (times scale * log2(e), so that scores come
 * out in log2 units) and the softmax weights to bf16 (round to nearest
 * even, as vcvtne2ps2bf16 does), and K and V rows to bf16 as their tiles
 * are decoded; the products are exact in f32 and accumulate in f32; the
 * softmax is f32, computed online: keys are taken in blocks of 64 at
 * multiples of 64, and per block each query's scores (kept in registers,
 * never a row of all its scores) are weighed against its reference m, which
 * moves up to the block's max only when a score passes m + 8 (or at its
 * first block), scaling its partial output and sum by 2^(m_old - m); its
 * weights e = 2^(s - m) (a degree-4 polynomial) are rounded to bf16 for the
 * values, the sum adds them as rounded (so the weights used sum to one),
 * and the output is divided by the sum at the end. ATTENTION_BF16_VERSION
 * (ops.h) numbers this arithmetic.
 *
 * Layouts (why the tiles are transposed):
 *  - scores: a K tile of 32 keys is stored as two groups of D/2 vectors
 *    (16 keys each), vector p of a group holding in lane k the bf16 pair
 *    (k[2p], k[2p+1]) of key k (a 16 x 16 transpose of 32-bit pairs per 32
 *    values); the query's pair (q[2p], q[2p+1]) is broadcast as one 32-bit
 *    value, so one vdpbf16ps adds two products to each of 16 keys' dots and
 *    no horizontal sum is needed. Lane k sums key k alone, pairs 0, 1, 2...
 *    in one chain, then times the scale: every key's score is a function
 *    of the query and that key only.
 *  - values: a V tile of 64 keys (one block) is stored as 32 key pairs,
 *    pair u holding for 16 output lanes d the bf16 pair (v[2u][d],
 *    v[2u+1][d]); the weights (e[2u], e[2u+1]) are broadcast. Each output
 *    lane accumulates pair after pair in key order, continuing from the
 *    previous block's result (kept in out, exact).
 * The tiles are built once per block and call and serve every query of
 * the call (GQA heads x prefill rows: forward.c gives bf16 calls up to 256
 * queries), which pays for the transposes and reads each K/V row from
 * memory once per 256 queries; a long prefill batch has them built once
 * per layer instead (attention_bf16_tiles_build_avx512bf16) and every call
 * reads them from there; f16 rows (the served format) go straight
 * from f16 to bf16 pairs, other formats through f32 rows. Per block the
 * queries go 4 at a time (4 queries x 64 keys of scores, then 4 queries x
 * 64 output lanes, are 16 accumulators), and the rows of the block after
 * next are prefetched a share per group of 4.
 *
 * Bit-identity: a query's result depends only on its query, first and
 * n_keys and the rows it sees, never on the other queries of the call:
 * scores are per lane; blocks and pairs sit at fixed absolute positions
 * (multiples of 64), and a query's max, sum and rescaling see only its
 * own visible keys; keys outside [first, n_keys) have weight +0, rows
 * outside the group's [first, hi) are zero, and a pair whose second key is
 * past this query's last but visible to another query has that value
 * masked to zero, so the pair adds the same +0 product either way; pairs
 * wholly past the query's last key are skipped. Decode and prefill both
 * run this kernel (forward.c sends every query through it in bf16 mode),
 * so warm == cold holds under this precision too.
 *
 * int8 (I8): vpdpbusd adds 4 byte products per 32-bit lane, twice
 * vdpbf16ps' products per instruction. The query (times scale * log2(e))
 * and each K and V head are quantized to signed bytes on one step each,
 * max |x| / 127 (quantize_i8). K tiles hold 16 keys per group, vector p
 * holding in lane k the 4 bytes k[4p..4p+3] + 128 (vpdpbusd's unsigned
 * operand; the query's 128 * sum(bytes) is paid back), then the keys'
 * steps: a score is the exact int32 dot times the key's step times the
 * query's, a function of the two alone. The softmax is the one above; then
 * each weight times its value row's step becomes a byte on one step per
 * query and block (pmax / 255), and the V tile holds quads of keys, vector
 * c of quad u holding in lane j the bytes v[4u..4u+3][16c + j], so the
 * weighted values are exact int32 sums over the block, times that step,
 * added to out. A key a query does not see has the byte 0 and adds 0
 * exactly, so the quads every query of a group runs over cost no bits;
 * the sum adds the f32 weights. Both dot loops (4 broadcasts x 4 vectors)
 * are one assembly loop, dp_4x4 (why there). */
#include <immintrin.h>
#include <string.h>

#include "tensor/attention_avx512_common.h"
#include "tensor/attention_impl.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum {
    KT = 32,      /* keys per K tile (two groups of 16 lanes) */
    VT = 64,      /* keys per V tile (32 pairs) */
    QB = 4,       /* queries per register block (x 4 groups of 16 keys) */
    MAX_Q = 256,  /* queries per group (op_attention_paged_rows' pairs) */
    MAX_D = 128,
};

/* int8: below this a row's max |x| (or a block's largest weight times
 * its value's step) counts as 0. The quantizer's multiplier 127 / max (255
 * / max for weights) must stay finite: a max under 127 / FLT_MAX made it
 * inf, and 0 * inf a NaN that converted to -128 (or 255). What is dropped
 * is under 2^-100 in absolute terms. */
#define I8_TINY 0x1p-100f

/* 32 floats as 16 bf16 pairs (x[2i] low half, x[2i+1] high) per 32-bit lane. */
ALWAYS_INLINE __m512i bf16_pairs(__m512 lo, __m512 hi) {
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

ALWAYS_INLINE __m512 dp(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* In-place transpose of a 16 x 16 matrix of 32-bit values (r[i] row i). */
ALWAYS_INLINE void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
    }
    /* u[4g + c]: 128-bit lane l holds column 4l + c of rows 4g..4g+3 */
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
        u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {
        __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        __m512i e = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), f = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        r[c] = _mm512_shuffle_i32x4(a, e, 0x88);
        r[4 + c] = _mm512_shuffle_i32x4(a, e, 0xDD);
        r[8 + c] = _mm512_shuffle_i32x4(b, f, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(b, f, 0xDD);
    }
}

/* Row j of a head as D floats in buf (zeros outside [lo, hi)). */
ALWAYS_INLINE void head_row_f32(const int D, const attention_head_args *a, bool key, int64_t j, int64_t lo,
                                int64_t hi, float *buf) {
    if (j < lo || j >= hi) {
        memset(buf, 0, (size_t)D * sizeof(float));
        return;
    }
    const void *const *blocks = key ? a->k_blocks : a->v_blocks;
    size_t stride = key ? a->k_stride : a->v_stride;
    kv_row_type type = key ? a->k_type : a->v_type;
    int offset = key ? a->k_offset : a->v_offset;
    const uint8_t *row = attention_row(blocks, stride, j);
    if (type == KV_ROW_F32)
        memcpy(buf, (const float *)row + offset, (size_t)D * sizeof(float));
    else
        decode_avx512(type, row, offset, D, buf);
}

/* Prefetches the K and V rows of keys [j0, j1) (below hi) of this head. */
ALWAYS_INLINE void prefetch_rows(const int D, const attention_head_args *a, int64_t j0, int64_t j1, int64_t hi) {
    const size_t k_head = value_byte(a->k_type, a->k_offset), v_head = value_byte(a->v_type, a->v_offset);
    const int k_bytes = (int)value_byte(a->k_type, D), v_bytes = (int)value_byte(a->v_type, D);
    for (int64_t j = j0; j < j1 && j < hi; j++) {
        const char *k = (const char *)attention_row(a->k_blocks, a->k_stride, j) + k_head;
        const char *v = (const char *)attention_row(a->v_blocks, a->v_stride, j) + v_head;
        for (int c = 0; 64 * c < k_bytes; c++) _mm_prefetch(k + 64 * c, _MM_HINT_T1);
        for (int c = 0; 64 * c < v_bytes; c++) _mm_prefetch(v + 64 * c, _MM_HINT_T1);
    }
}

/* Vectors of one 64-key block's tiles for heads of D values, as the
 * kernel keeps them: two K tiles (D vectors each), then the V tile (VT/2
 * pairs of MAX_D/16 vectors, D/16 of them used); at int8 (I8) four K
 * tiles of 16 keys (D/4 vectors and the keys' steps each), then the V
 * tile of VT/4 quads and the 64 keys' steps. */
#define K_VECS(D, I8) ((I8) ? (VT / 16) * ((D) / 4 + 1) : 2 * (D))
/* at int8: VT/4 quads of D/16 vectors, then the VT keys' steps */
#define V_VECS(D, I8) ((I8) ? (VT / 4) * ((D) / 16) + VT / 16 : (VT / 2) * (MAX_D / 16))
#define TILE_VECS(D, I8) (K_VECS(D, I8) + V_VECS(D, I8))
_Static_assert(TILE_VECS(128, false) * 64 == ATTENTION_BF16_TILE_BYTES(128) &&
                   TILE_VECS(64, false) * 64 == ATTENTION_BF16_TILE_BYTES(64) &&
                   TILE_VECS(128, true) * 64 == ATTENTION_INT8_TILE_BYTES(128) &&
                   TILE_VECS(64, true) * 64 == ATTENTION_INT8_TILE_BYTES(64),
               "attention_impl.h's tile size is the kernel's");

/* Prefetches group gi's share (of groups) of the n_vecs vectors at t. */
ALWAYS_INLINE void prefetch_tiles(const __m512i *t, int n_vecs, int gi, int groups) {
    for (int v = gi * n_vecs / groups; v < (gi + 1) * n_vecs / groups; v++) _mm_prefetch((const char *)(t + v), _MM_HINT_T1);
}

/* One query as the dots read it: bf16 pairs (q[2p], q[2p+1]) per word, or
 * at int8 keys 4 signed bytes (q[4p..4p+3]) per word, D/4 of them, with
 * the query's step (q = step * byte) and 128 * the sum of its bytes. The
 * query is already times scale * log2(e). */
typedef struct query_block {
    uint32_t q[MAX_D / 2];
    float step;
    int32_t corr;
} query_block;

/* What the scores of one block leave for its values, per query. */
typedef struct block_weights {
    /* the weights e as bf16 pairs (e[2u], e[2u + 1]); at int8 the 64
     * bytes round(e[k] * vstep[k] / pstep) in its first 16 words */
    uint32_t pq[VT / 2];
    float pstep;         /* int8: the weights' step (max e * vstep / 255) */
    float alpha;         /* out's rescale when m moved (grew) */
    bool grew;
    int full, straddle;  /* pairs wholly visible; the pair whose second key is past the last (-1: none) */
} block_weights;

/* 2^x for x <= 0 (the weights, in log2 units): 2^round(x) times a degree-4
 * polynomial of the rest in [-0.5, 0.5], relative error 2.7e-6, far below
 * the 2^-9 of the bf16 the weights are rounded to. */
ALWAYS_INLINE __m512 exp2_weight(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-200.0f)); /* 2^-200 is 0 after scalef; keeps -inf from a NaN */
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.560519829e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.591712147e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402498126e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931219697e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999991655e-1f));
    return _mm512_scalef_ps(p, n);
}

/* How far a score may rise above a query's reference m before m moves:
 * weights stay <= 2^REBASE_LOG2, far inside f32's and bf16's range. */
#define REBASE_LOG2 8.0f

/* One step of 16 vpdpbusd: the 4 loaded vectors (zmm16-19) by the 4
 * broadcast words (zmm20-23) into accumulators zmm0-15 (broadcast i, vector
 * g into zmm(4i + g)). ORDER(b, v, acc) spells one instruction with the
 * unsigned operand where it belongs. */
#define DP_STEP(ORDER)                                                                                         \
    ORDER(20, 16, 0) ORDER(20, 17, 1) ORDER(20, 18, 2) ORDER(20, 19, 3) ORDER(21, 16, 4) ORDER(21, 17, 5)       \
    ORDER(21, 18, 6) ORDER(21, 19, 7) ORDER(22, 16, 8) ORDER(22, 17, 9) ORDER(22, 18, 10) ORDER(22, 19, 11)     \
    ORDER(23, 16, 12) ORDER(23, 17, 13) ORDER(23, 18, 14) ORDER(23, 19, 15)
/* AT&T operands: signed source, unsigned source, accumulator */
#define VECTOR_UNSIGNED(b, v, acc) "vpdpbusd %%zmm" #b ", %%zmm" #v ", %%zmm" #acc "\n\t"
#define BROADCAST_UNSIGNED(b, v, acc) "vpdpbusd %%zmm" #v ", %%zmm" #b ", %%zmm" #acc "\n\t"
#define DP_4X4_ASM(ORDER)                                                                                      \
    __asm__ volatile(                                                                                          \
        "vpxord %%zmm0, %%zmm0, %%zmm0\n\t"                                                                    \
        "vmovdqa64 %%zmm0, %%zmm1\n\t" "vmovdqa64 %%zmm0, %%zmm2\n\t" "vmovdqa64 %%zmm0, %%zmm3\n\t"          \
        "vmovdqa64 %%zmm0, %%zmm4\n\t" "vmovdqa64 %%zmm0, %%zmm5\n\t" "vmovdqa64 %%zmm0, %%zmm6\n\t"          \
        "vmovdqa64 %%zmm0, %%zmm7\n\t" "vmovdqa64 %%zmm0, %%zmm8\n\t" "vmovdqa64 %%zmm0, %%zmm9\n\t"          \
        "vmovdqa64 %%zmm0, %%zmm10\n\t" "vmovdqa64 %%zmm0, %%zmm11\n\t" "vmovdqa64 %%zmm0, %%zmm12\n\t"       \
        "vmovdqa64 %%zmm0, %%zmm13\n\t" "vmovdqa64 %%zmm0, %%zmm14\n\t" "vmovdqa64 %%zmm0, %%zmm15\n\t"       \
        "1:\n\t"                                                                                               \
        "vmovdqa64 (%[v]), %%zmm16\n\t"                                                                        \
        "vmovdqa64 (%[v],%[vg],1), %%zmm17\n\t"                                                                \
        "vmovdqa64 (%[v],%[vg],2), %%zmm18\n\t"                                                                \
        "vmovdqa64 (%[v],%[vg3],1), %%zmm19\n\t"                                                               \
        "vpbroadcastd (%[b]), %%zmm20\n\t"                                                                     \
        "vpbroadcastd (%[b],%[bs],1), %%zmm21\n\t"                                                             \
        "vpbroadcastd (%[b],%[bs],2), %%zmm22\n\t"                                                             \
        "vpbroadcastd (%[b],%[bs3],1), %%zmm23\n\t"                                                            \
        DP_STEP(ORDER)                                                                                         \
        "add %[vstep], %[v]\n\t"                                                                               \
        "add $4, %[b]\n\t"                                                                                     \
        "dec %[n]\n\t"                                                                                         \
        "jnz 1b\n\t"                                                                                           \
        "vmovdqu64 %%zmm0, 0(%[o])\n\t" "vmovdqu64 %%zmm1, 64(%[o])\n\t" "vmovdqu64 %%zmm2, 128(%[o])\n\t"    \
        "vmovdqu64 %%zmm3, 192(%[o])\n\t" "vmovdqu64 %%zmm4, 256(%[o])\n\t" "vmovdqu64 %%zmm5, 320(%[o])\n\t"  \
        "vmovdqu64 %%zmm6, 384(%[o])\n\t" "vmovdqu64 %%zmm7, 448(%[o])\n\t" "vmovdqu64 %%zmm8, 512(%[o])\n\t"  \
        "vmovdqu64 %%zmm9, 576(%[o])\n\t" "vmovdqu64 %%zmm10, 640(%[o])\n\t" "vmovdqu64 %%zmm11, 704(%[o])\n\t" \
        "vmovdqu64 %%zmm12, 768(%[o])\n\t" "vmovdqu64 %%zmm13, 832(%[o])\n\t" "vmovdqu64 %%zmm14, 896(%[o])\n\t" \
        "vmovdqu64 %%zmm15, 960(%[o])\n\t"                                                                     \
        : [v] "+r"(vec), [b] "+r"(bcast), [n] "+r"(steps)                                                      \
        : [vg] "r"(vec_group), [vg3] "r"(3 * vec_group), [vstep] "r"(vec_step), [bs] "r"(bcast_stride),       \
          [bs3] "r"(3 * bcast_stride), [o] "r"(out)                                                            \
        : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",     \
          "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20",   \
          "xmm21", "xmm22", "xmm23")

/* The int32 dots of 4 broadcast operands with 4 vectors, steps > 0 times,
 * in assembly: 16 accumulators (zmm0-15), the 4 vectors of a step
 * (zmm16-19, vec_group bytes apart, the next step vec_step further) and 4
 * broadcast words (zmm20-23: bcast_stride bytes apart, the next step 4
 * further). out[i][g] gets the 16 lanes of broadcast i by vector g. At
 * bcast_unsigned the broadcast bytes are the unsigned operand (weights
 * times values), else the vectors' (keys times queries). Written with
 * intrinsics, gcc 12 copied accumulators in and out of spare registers on
 * every step (two moves per vpdpbusd with unroll pragmas, some without),
 * which cost a third of the loop. */
static void dp_4x4(const char *vec, long vec_step, long vec_group, const char *bcast, long bcast_stride, long steps,
                   bool bcast_unsigned, int32_t (*out)[4][16]) {
    if (bcast_unsigned)
        DP_4X4_ASM(BROADCAST_UNSIGNED);
    else
        DP_4X4_ASM(VECTOR_UNSIGNED);
}

/* The scores (log2 units) of NQ queries at int8 with the 64 keys of an
 * int8 K tile into acc: vector p of group g holds in lane k the 4 bytes
 * k[4p..4p+3] + 128 of key 16g + k; the query's 4 signed bytes are
 * broadcast (vpdpbusd: exact in int32); the dot pays the +128 back (corr)
 * and is scaled by the key's step, then the query's. dp_4x4 always runs 4
 * queries: past NQ it reads the zeroed padding of qb (heads_bf16) and
 * its sums are dropped. */
ALWAYS_INLINE void dots_i8(const int D, const int NQ, const __m512i *ktp, const query_block *qb,
                           __m512 (*acc)[VT / 16]) {
    int32_t dots[QB][VT / 16][16] __attribute__((aligned(64)));
    dp_4x4((const char *)ktp, 64, (long)(D / 4 + 1) * 64, (const char *)qb->q, sizeof(query_block), D / 4, false,
           dots);
#pragma GCC unroll 4
    for (int i = 0; i < NQ; i++) {
        __m512i corr = _mm512_set1_epi32(qb[i].corr);
        __m512 qstep = _mm512_set1_ps(qb[i].step);
#pragma GCC unroll 4
        for (int g = 0; g < VT / 16; g++) {
            __m512 kstep = _mm512_load_ps((const float *)(ktp + g * (D / 4 + 1) + D / 4));
            __m512 s = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(dots[i][g]), corr));
            acc[i][g] = _mm512_mul_ps(_mm512_mul_ps(s, kstep), qstep);
        }
    }
}

/* Scores and the online softmax step of one block of VT keys [b0, b0 + VT)
 * for NQ queries, in registers. The dots of each query (bf16 pairs qb[i],
 * already times scale * log2(e), so scores are in log2 units) with the
 * block's 64 keys (transposed K tile ktp: keys 16g..16g+15 in
 * ktp[g * D/2 ..]). m is the query's reference, not its running max: it
 * moves (to the block's max over the query's visible keys) only when the
 * query has none yet or a visible score exceeds m + REBASE_LOG2, which
 * after the first blocks is rare, so the common block needs no horizontal
 * max; when it moves, alpha = 2^(m_old - m) rescales the sum (here) and out
 * (block_values). The weights e = 2^(s - m) are rounded to bf16 pairs, and
 * the sum lanes lsum add them as rounded (a vdpbf16ps by ones), reduced
 * once at the end. At int8 (I8) the scores come from dots_i8, and the
 * weights times the values' steps (v_steps, the V tile's) become bytes
 * for block_values_i8 while lsum adds the f32 weights. Each query's
 * arithmetic is its own, whatever the other queries of the group. */
ALWAYS_INLINE void block_scores(const int D, const int NQ, const bool I8, const attention_head_args *a,
                                const __m512i *ktp, const float *v_steps, const query_block *qb, float *m,
                                __m512 *lsum, block_weights *w, int64_t b0, int64_t first) {
    __m512 acc[QB][VT / 16];
    if (I8) {
        dots_i8(D, NQ, ktp, qb, acc);
    } else {
#pragma GCC unroll 4
        for (int i = 0; i < NQ; i++)
#pragma GCC unroll 4
            for (int g = 0; g < VT / 16; g++) acc[i][g] = _mm512_setzero_ps();
        for (int p = 0; p < D / 2; p++) {
            __m512i k[VT / 16];
#pragma GCC unroll 4
            for (int g = 0; g < VT / 16; g++) k[g] = _mm512_load_si512(ktp + g * (D / 2) + p);
#pragma GCC unroll 4
            for (int i = 0; i < NQ; i++) {
                __m512i q = _mm512_set1_epi32((int)qb[i].q[p]);
#pragma GCC unroll 4
                for (int g = 0; g < VT / 16; g++) acc[i][g] = dp(acc[i][g], k[g], q);
            }
        }
    }
    const __m512i ones = _mm512_set1_epi32(0x3F803F80); /* the bf16 pair (1, 1) */
#pragma GCC unroll 4
    for (int i = 0; i < NQ; i++) {
        /* keys [lo, end) of the block are this query's own */
        int64_t lo = b0 > first ? b0 : first, end = b0 + VT < a[i].n_keys ? b0 + VT : a[i].n_keys;
        int seen = end > b0 ? (int)(end - b0) : 0; /* keys of the block this query sees, from b0 */
        w[i].full = seen / 2;
        w[i].straddle = seen % 2 ? seen / 2 : -1;
        w[i].grew = false;
        if (end <= lo) continue; /* none: pq unread, m, lsum and out as they are */
        uint64_t vis = (seen == 64 ? ~0ull : (1ull << seen) - 1) & ~((1ull << (lo - b0)) - 1);
        __m512 limit = _mm512_set1_ps(m[i] + REBASE_LOG2);
        __mmask16 over = 0;
#pragma GCC unroll 4
        for (int c = 0; c < VT / 16; c++)
            over |= _mm512_mask_cmp_ps_mask((__mmask16)(vis >> (16 * c)), acc[i][c], limit, _CMP_GT_OQ);
        if (over) { /* (m = -inf: any score is over) */
            __m512 bm = _mm512_set1_ps(-INFINITY);
#pragma GCC unroll 4
            for (int c = 0; c < VT / 16; c++) /* vmaxps keeps the running max over a NaN score */
                bm = _mm512_mask_max_ps(bm, (__mmask16)(vis >> (16 * c)), acc[i][c], bm);
            float bmax = _mm512_reduce_max_ps(bm);
            if (m[i] != -INFINITY) {
                w[i].alpha = _mm512_cvtss_f32(exp2_weight(_mm512_set1_ps(m[i] - bmax)));
                lsum[i] = _mm512_mul_ps(lsum[i], _mm512_set1_ps(w[i].alpha));
                w[i].grew = true;
            }
            m[i] = bmax;
        }
        __m512 vm = _mm512_set1_ps(m[i]), e[VT / 16];
#pragma GCC unroll 4
        for (int c = 0; c < VT / 16; c++)
            e[c] = _mm512_maskz_mov_ps((__mmask16)(vis >> (16 * c)), exp2_weight(_mm512_sub_ps(acc[i][c], vm)));
        if (I8) {
            /* the values' steps folded into the weights, which are then
             * bytes on one step per query and block; the sum adds e */
            __m512 pv[VT / 16], top = _mm512_setzero_ps();
#pragma GCC unroll 4
            for (int c = 0; c < VT / 16; c++) {
                pv[c] = _mm512_mul_ps(e[c], _mm512_load_ps(v_steps + 16 * c));
                top = _mm512_max_ps(top, pv[c]);
            }
            lsum[i] = _mm512_add_ps(lsum[i], _mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3])));
            float pmax = _mm512_reduce_max_ps(top);
            uint8_t *bytes = (uint8_t *)w[i].pq;
            if (pmax >= I8_TINY) {
                __m512 inv = _mm512_set1_ps(255.0f / pmax);
#pragma GCC unroll 4
                for (int c = 0; c < VT / 16; c++)
                    _mm_storeu_si128((__m128i *)(bytes + 16 * c),
                                     _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(pv[c], inv))));
                w[i].pstep = pmax / 255.0f;
            } else {
                memset(bytes, 0, VT);
                w[i].pstep = 0.0f;
            }
            continue;
        }
#pragma GCC unroll 2
        for (int c = 0; c < VT / 32; c++) {
            __m512i pairs = bf16_pairs(e[2 * c], e[2 * c + 1]);
            _mm512_storeu_si512(w[i].pq + 16 * c, pairs);
            lsum[i] = dp(lsum[i], pairs, ones);
        }
    }
}

/* block_values at int8: the V tile (vtp, D/16 vectors per quad of keys,
 * vector c of quad u holding in lane j the bytes v[4u..4u+3][16c + j]) by
 * the weights' bytes, exact in int32 over the quads any query of the group
 * sees (a key a query does not see has weight 0, adding 0 exactly, so its
 * bits do not depend on the group), then out = out * alpha (when m grew) +
 * dots * pstep; a query that sees none of the block keeps out as it is. */
ALWAYS_INLINE void block_values_i8(const int D, const int NQ, const __m512i *vtp, const block_weights *w,
                                   float (*out)[MAX_D], int64_t b0, int64_t first) {
    int seen = 0;
    for (int i = 0; i < NQ; i++) {
        int own = 2 * w[i].full + (w[i].straddle >= 0);
        seen = own > seen ? own : seen;
    }
    const int q0 = (int)((b0 > first ? 0 : first - b0) / 4), q1 = (seen + 3) / 4;
    if (q1 <= q0) return;
    for (int h = 0; h < D / 64; h++) {
        int32_t dots[QB][4][16] __attribute__((aligned(64)));
        const __m512i *v = vtp + (size_t)q0 * (D / 16) + 4 * h;
        /* 4 queries always: past NQ the zeroed padding of w (heads_bf16) */
        dp_4x4((const char *)v, (long)(D / 16) * 64, 64, (const char *)w[0].pq + 4 * q0, sizeof(block_weights),
               q1 - q0, true, dots);
        for (int i = 0; i < NQ; i++) {
            if (w[i].full == 0 && w[i].straddle < 0) continue;
            __m512 step = _mm512_set1_ps(w[i].pstep);
            for (int c = 0; c < 4; c++) {
                __m512 o = _mm512_load_ps(out[i] + 64 * h + 16 * c);
                if (w[i].grew) o = _mm512_mul_ps(o, _mm512_set1_ps(w[i].alpha));
                o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots[i][c])), step, o);
                _mm512_store_ps(out[i] + 64 * h + 16 * c, o);
            }
        }
    }
}

/* The weighted values of one block for NQ queries over the V tile
 * (vtp[u][c]: pair u's 16 lanes of slice c), 64 output lanes at a time,
 * continuing from out (scaled by alpha when m grew): pairs wholly visible
 * to every query first, then per query the pairs it sees whole and the
 * pair whose second key is past its last (that value masked to zero). */
ALWAYS_INLINE void block_values(const int D, const int NQ, const __m512i (*vtp)[MAX_D / 16], const block_weights *w,
                                float (*out)[MAX_D], int64_t b0, int64_t first) {
    int all = VT / 2, most = 0;
#pragma GCC unroll 4
    for (int i = 0; i < NQ; i++) {
        all = w[i].full < all ? w[i].full : all;
        int last = w[i].straddle >= 0 ? w[i].straddle + 1 : w[i].full;
        most = last > most ? last : most;
    }
    const int u0 = (int)((b0 > first ? 0 : first - b0) / 2);
    for (int h = 0; h < D / 64; h++) {
        __m512 o[QB][4];
#pragma GCC unroll 4
        for (int i = 0; i < NQ; i++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                o[i][c] = _mm512_load_ps(out[i] + 64 * h + 16 * c);
                if (w[i].grew) o[i][c] = _mm512_mul_ps(o[i][c], _mm512_set1_ps(w[i].alpha));
            }
        int u = u0;
        for (; u < all; u++) {
            __m512i v[4];
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) v[c] = _mm512_load_si512(&vtp[u][4 * h + c]);
#pragma GCC unroll 4
            for (int i = 0; i < NQ; i++) {
                __m512i p = _mm512_set1_epi32((int)w[i].pq[u]);
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) o[i][c] = dp(o[i][c], v[c], p);
            }
        }
        for (; u < most; u++) {
            __m512i v[4], half[4];
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                v[c] = _mm512_load_si512(&vtp[u][4 * h + c]);
                /* the first key's value of each pair only */
                half[c] = _mm512_maskz_mov_epi16(0x55555555u, v[c]);
            }
#pragma GCC unroll 4
            for (int i = 0; i < NQ; i++) {
                if (u >= w[i].full && u != w[i].straddle) continue;
                __m512i p = _mm512_set1_epi32((int)w[i].pq[u]);
                bool part = u == w[i].straddle;
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) o[i][c] = dp(o[i][c], part ? half[c] : v[c], p);
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < NQ; i++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) _mm512_store_ps(out[i] + 64 * h + 16 * c, o[i][c]);
    }
}

#define BLOCK_FNS(D, N, I8, TAG)                                                                               \
    static void scores_##D##_##N##TAG(const attention_head_args *a, const __m512i *ktp, const float *v_steps,      \
                                      const query_block *qb, float *m, __m512 *lsum, block_weights *w, int64_t b0, \
                                      int64_t first) {                                                             \
        block_scores(D, N, I8, a, ktp, v_steps, qb, m, lsum, w, b0, first);                                        \
    }
#define VALUE_FNS(D, N)                                                                                         \
    static void values_##D##_##N(const __m512i (*vtp)[MAX_D / 16], const block_weights *w, float (*out)[MAX_D],  \
                                 int64_t b0, int64_t first) {                                                   \
        block_values(D, N, vtp, w, out, b0, first);                                                             \
    }
typedef void (*scores_fn)(const attention_head_args *, const __m512i *, const float *, const query_block *, float *,
                          __m512 *, block_weights *, int64_t, int64_t);
typedef void (*values_fn)(const __m512i (*)[MAX_D / 16], const block_weights *, float (*)[MAX_D], int64_t, int64_t);
BLOCK_FNS(128, 1, false, ) BLOCK_FNS(128, 2, false, ) BLOCK_FNS(128, 3, false, ) BLOCK_FNS(128, 4, false, )
BLOCK_FNS(64, 1, false, ) BLOCK_FNS(64, 2, false, ) BLOCK_FNS(64, 3, false, ) BLOCK_FNS(64, 4, false, )
BLOCK_FNS(128, 1, true, _i8) BLOCK_FNS(128, 2, true, _i8) BLOCK_FNS(128, 3, true, _i8) BLOCK_FNS(128, 4, true, _i8)
BLOCK_FNS(64, 1, true, _i8) BLOCK_FNS(64, 2, true, _i8) BLOCK_FNS(64, 3, true, _i8) BLOCK_FNS(64, 4, true, _i8)
VALUE_FNS(128, 1) VALUE_FNS(128, 2) VALUE_FNS(128, 3) VALUE_FNS(128, 4)
VALUE_FNS(64, 1) VALUE_FNS(64, 2) VALUE_FNS(64, 3) VALUE_FNS(64, 4)
#define VALUE_I8_FNS(D, N)                                                                                    \
    static void values_##D##_##N##_i8(const __m512i *vtp, const block_weights *w, float (*out)[MAX_D], int64_t b0, \
                                      int64_t first) {                                                          \
        block_values_i8(D, N, vtp, w, out, b0, first);                                                          \
    }
typedef void (*values_i8_fn)(const __m512i *, const block_weights *, float (*)[MAX_D], int64_t, int64_t);
VALUE_I8_FNS(128, 1) VALUE_I8_FNS(128, 2) VALUE_I8_FNS(128, 3) VALUE_I8_FNS(128, 4)
VALUE_I8_FNS(64, 1) VALUE_I8_FNS(64, 2) VALUE_I8_FNS(64, 3) VALUE_I8_FNS(64, 4)
static const values_i8_fn values_fns_128_i8[QB + 1] = {NULL, values_128_1_i8, values_128_2_i8, values_128_3_i8,
                                                       values_128_4_i8};
static const values_i8_fn values_fns_64_i8[QB + 1] = {NULL, values_64_1_i8, values_64_2_i8, values_64_3_i8,
                                                      values_64_4_i8};
static const scores_fn scores_fns_128[QB + 1] = {NULL, scores_128_1, scores_128_2, scores_128_3, scores_128_4};
static const scores_fn scores_fns_64[QB + 1] = {NULL, scores_64_1, scores_64_2, scores_64_3, scores_64_4};
static const scores_fn scores_fns_128_i8[QB + 1] = {NULL, scores_128_1_i8, scores_128_2_i8, scores_128_3_i8,
                                                     scores_128_4_i8};
static const scores_fn scores_fns_64_i8[QB + 1] = {NULL, scores_64_1_i8, scores_64_2_i8, scores_64_3_i8, scores_64_4_i8};
static const values_fn values_fns_128[QB + 1] = {NULL, values_128_1, values_128_2, values_128_3, values_128_4};
static const values_fn values_fns_64[QB + 1] = {NULL, values_64_1, values_64_2, values_64_3, values_64_4};

/* A tile vector: streamed (non-temporal) where tiles are built for later
 * calls into a buffer of megabytes, which would otherwise read every line
 * it writes. */
ALWAYS_INLINE void store_tile(__m512i *dst, __m512i x, const bool stream) {
    if (stream)
        _mm512_stream_si512(dst, x);
    else
        _mm512_store_si512(dst, x);
}

/* The K tile of keys [t0, t0 + KT), transposed into ktp (zero rows outside
 * [first, hi)). */
ALWAYS_INLINE void build_k_tile(const int D, const attention_head_args *a, int64_t t0, int64_t first, int64_t hi,
                                float (*rows)[MAX_D], __m512i *ktp, const bool stream) {
    const size_t k_head = value_byte(a->k_type, a->k_offset);
    const bool direct = a->k_type == KV_ROW_F16 && t0 >= first && t0 + KT <= hi;
    for (int k = 0; k < KT; k++) {
        if (!direct) head_row_f32(D, a, true, t0 + k, first, hi, rows[k]);
    }
    for (int g = 0; g < KT / 16; g++)
        for (int c = 0; c < D / 32; c++) {
            __m512i r[16];
            if (direct) { /* f16 rows straight to bf16 pairs: f16 -> f32 is exact */
#pragma GCC unroll 16
                for (int k = 0; k < 16; k++) {
                    const __m256i *h =
                        (const __m256i *)(attention_row(a->k_blocks, a->k_stride, t0 + 16 * g + k) + k_head) + 2 * c;
                    r[k] = bf16_pairs(_mm512_cvtph_ps(_mm256_loadu_si256(h)), _mm512_cvtph_ps(_mm256_loadu_si256(h + 1)));
                }
            } else {
#pragma GCC unroll 16
                for (int k = 0; k < 16; k++)
                    r[k] = bf16_pairs(_mm512_load_ps(rows[16 * g + k] + 32 * c),
                                      _mm512_load_ps(rows[16 * g + k] + 32 * c + 16));
            }
            transpose16(r);
#pragma GCC unroll 16
            for (int x = 0; x < 16; x++) store_tile(ktp + g * (D / 2) + 16 * c + x, r[x], stream);
        }
}

/* x (D floats) as signed bytes round(x * 127 / max|x|) into out; returns
 * the step max|x| / 127 (0 for a row whose max is under I8_TINY, or NaN,
 * whose bytes are 0). */
ALWAYS_INLINE float quantize_i8(const int D, const float *x, int8_t *out) {
    __m512 amax = _mm512_setzero_ps();
    for (int c = 0; c < D / 16; c++) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + 16 * c)));
    float mx = _mm512_reduce_max_ps(amax);
    if (!(mx >= I8_TINY)) {
        memset(out, 0, (size_t)D);
        return 0.0f;
    }
    __m512 inv = _mm512_set1_ps(127.0f / mx);
    for (int c = 0; c < D / 16; c++)
        _mm_storeu_si128((__m128i *)(out + 16 * c),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * c), inv))));
    return mx / 127.0f;
}

/* The int8 K tile of keys [t0, t0 + VT) (zero rows outside [first, hi)):
 * per group of 16 keys, D/4 vectors whose lane k holds the bytes
 * k[4p..4p+3] + 128 of key k (unsigned, as vpdpbusd takes them), then the
 * 16 keys' steps. */
ALWAYS_INLINE void build_k_tile_i8(const int D, const attention_head_args *a, int64_t t0, int64_t first, int64_t hi,
                                   float (*rows)[MAX_D], __m512i *ktp, const bool stream) {
    int8_t bytes[16][MAX_D] __attribute__((aligned(64)));
    float steps[16] __attribute__((aligned(64)));
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    for (int g = 0; g < VT / 16; g++) {
        for (int k = 0; k < 16; k++) {
            head_row_f32(D, a, true, t0 + 16 * g + k, first, hi, rows[k]);
            steps[k] = quantize_i8(D, rows[k], bytes[k]);
        }
        __m512i *kg = ktp + g * (D / 4 + 1);
        for (int c = 0; c < D / 64; c++) {
            __m512i r[16];
#pragma GCC unroll 16
            for (int k = 0; k < 16; k++) r[k] = _mm512_xor_si512(_mm512_load_si512(bytes[k] + 64 * c), offset);
            transpose16(r);
#pragma GCC unroll 16
            for (int x = 0; x < 16; x++) store_tile(kg + 16 * c + x, r[x], stream);
        }
        store_tile(kg + D / 4, _mm512_castps_si512(_mm512_load_ps(steps)), stream);
    }
}

/* The int8 V tile of keys [v0, v0 + VT) (zero rows outside [first, hi)):
 * each row as bytes on its own step (quantize_i8), then per quad of keys u
 * D/16 vectors, vector c holding in lane j the bytes v[4u..4u+3][16c + j]
 * (what vpdpbusd sums with 4 weights), then the 64 steps. */
ALWAYS_INLINE void build_v_tile_i8(const int D, const attention_head_args *a, int64_t v0, int64_t first, int64_t hi,
                                   float (*rows)[MAX_D], __m512i *vtp, const bool stream) {
    int8_t bytes[VT][MAX_D] __attribute__((aligned(64)));
    float steps[VT] __attribute__((aligned(64)));
    for (int k = 0; k < VT; k++) {
        head_row_f32(D, a, false, v0 + k, first, hi, rows[k]);
        steps[k] = quantize_i8(D, rows[k], bytes[k]);
    }
    for (int u = 0; u < VT / 4; u++)
        for (int c = 0; c < D / 16; c++) {
            __m128i r0 = _mm_load_si128((const __m128i *)(bytes[4 * u] + 16 * c));
            __m128i r1 = _mm_load_si128((const __m128i *)(bytes[4 * u + 1] + 16 * c));
            __m128i r2 = _mm_load_si128((const __m128i *)(bytes[4 * u + 2] + 16 * c));
            __m128i r3 = _mm_load_si128((const __m128i *)(bytes[4 * u + 3] + 16 * c));
            __m128i t0 = _mm_unpacklo_epi8(r0, r1), t1 = _mm_unpackhi_epi8(r0, r1);
            __m128i t2 = _mm_unpacklo_epi8(r2, r3), t3 = _mm_unpackhi_epi8(r2, r3);
            __m512i x = _mm512_castsi128_si512(_mm_unpacklo_epi16(t0, t2));
            x = _mm512_inserti32x4(x, _mm_unpackhi_epi16(t0, t2), 1);
            x = _mm512_inserti32x4(x, _mm_unpacklo_epi16(t1, t3), 2);
            x = _mm512_inserti32x4(x, _mm_unpackhi_epi16(t1, t3), 3);
            store_tile(vtp + (size_t)u * (D / 16) + c, x, stream);
        }
    for (int c = 0; c < VT / 16; c++)
        store_tile(vtp + (VT / 4) * (D / 16) + c, _mm512_castps_si512(_mm512_load_ps(steps + 16 * c)), stream);
}

/* The V tile of keys [v0, v0 + VT) as pairs of consecutive rows (zero rows
 * outside [first, hi)). */
ALWAYS_INLINE void build_v_tile(const int D, const attention_head_args *a, int64_t v0, int64_t first, int64_t hi,
                                float (*rows)[MAX_D], __m512i (*vtp)[MAX_D / 16], const bool stream) {
    static const uint16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                            8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i perm = _mm512_loadu_si512(interleave);
    const size_t v_head = value_byte(a->v_type, a->v_offset);
    const bool direct = a->v_type == KV_ROW_F16 && v0 >= first && v0 + VT <= hi;
    for (int k = 0; k < VT; k++) {
        if (!direct) head_row_f32(D, a, false, v0 + k, first, hi, rows[k]);
    }
    for (int u = 0; u < VT / 2; u++) {
        if (direct) {
            const __m256i *h0 = (const __m256i *)(attention_row(a->v_blocks, a->v_stride, v0 + 2 * u) + v_head);
            const __m256i *h1 = (const __m256i *)(attention_row(a->v_blocks, a->v_stride, v0 + 2 * u + 1) + v_head);
#pragma GCC unroll 8
            for (int c = 0; c < D / 16; c++) {
                __m512i x = bf16_pairs(_mm512_cvtph_ps(_mm256_loadu_si256(h0 + c)), _mm512_cvtph_ps(_mm256_loadu_si256(h1 + c)));
                store_tile(&vtp[u][c], _mm512_permutexvar_epi16(perm, x), stream);
            }
        } else {
#pragma GCC unroll 8
            for (int c = 0; c < D / 16; c++) {
                __m512i x = bf16_pairs(_mm512_load_ps(rows[2 * u] + 16 * c), _mm512_load_ps(rows[2 * u + 1] + 16 * c));
                store_tile(&vtp[u][c], _mm512_permutexvar_epi16(perm, x), stream);
            }
        }
    }
}

/* n <= MAX_Q queries over one kv head: d_k = d_v = D, one first. One pass
 * over blocks of VT keys at multiples of VT (an online softmax); each
 * block's K and V tiles are built once and serve the n queries, QB at a
 * time: first every group's scores and weights (block_scores), then every
 * group's values (block_values), so that one group's softmax, a chain of
 * dependent steps, overlaps the next group's dots instead of stalling its
 * own values. A query's blocks, and what it computes in each, depend on
 * its own keys only. */
ALWAYS_INLINE void heads_bf16(const int D, const bool I8, const attention_head_args *a, int n) {
    const int64_t first = a[0].first;
    int64_t hi = a[0].n_keys;
    for (int i = 1; i < n; i++) hi = a[i].n_keys > hi ? a[i].n_keys : hi;
    const scores_fn *scores = I8 ? (D == 64 ? scores_fns_64_i8 : scores_fns_128_i8) : (D == 64 ? scores_fns_64 : scores_fns_128);
    const values_fn *values = D == 64 ? values_fns_64 : values_fns_128;
    const values_i8_fn *values_i8 = D == 64 ? values_fns_64_i8 : values_fns_128_i8;

    /* The queries as bf16 pairs; out accumulates in a contiguous buffer
     * (the callers' rows lie a row of all heads apart, 8 KiB on the 0.6B
     * shape, so 256 of them would share a few cache sets); running max and
     * sum. */
    query_block qb[MAX_Q];
    float out[MAX_Q][MAX_D] __attribute__((aligned(64)));
    float m[MAX_Q];
    __m512 lsum[MAX_Q];
    for (int i = 0; i < n; i++) {
        /* scale * log2(e) folded into the query before it is rounded:
         * scores come out in log2 units, ready for exp2_weight */
        __m512 c2 = _mm512_set1_ps(a[i].scale * 1.44269504088896341f);
        if (I8) {
            float scaled[MAX_D];
            const int8_t *bytes = (const int8_t *)qb[i].q;
            for (int c = 0; c < D / 16; c++) _mm512_storeu_ps(scaled + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(a[i].q + 16 * c), c2));
            qb[i].step = quantize_i8(D, scaled, (int8_t *)qb[i].q);
            int32_t sum = 0;
            for (int d = 0; d < D; d++) sum += bytes[d];
            qb[i].corr = 128 * sum;
        } else {
            for (int c = 0; c < D / 32; c++)
                _mm512_storeu_si512(&qb[i].q[16 * c], bf16_pairs(_mm512_mul_ps(_mm512_loadu_ps(a[i].q + 32 * c), c2),
                                                                 _mm512_mul_ps(_mm512_loadu_ps(a[i].q + 32 * c + 16), c2)));
        }
        m[i] = -INFINITY;
        lsum[i] = _mm512_setzero_ps();
        memset(out[i], 0, (size_t)D * sizeof(float));
    }
    float rows[VT][MAX_D] __attribute__((aligned(64)));
    __m512i ktp[2 * MAX_D] __attribute__((aligned(64))); /* (K_VECS(D, I8)) */
    __m512i vtp[VT / 2][MAX_D / 16] __attribute__((aligned(64)));
    block_weights w[MAX_Q];
    bool any[MAX_Q / QB];
    const int groups = (n + QB - 1) / QB;
    /* int8 runs every group as 4 queries (dp_4x4): the last group's
     * padding reads as zero bytes, and what it computes is dropped */
    if (I8 && n < groups * QB) {
        memset(qb + n, 0, (size_t)(groups * QB - n) * sizeof qb[0]);
        memset(w + n, 0, (size_t)(groups * QB - n) * sizeof w[0]);
    }
    /* Prebuilt tiles hold real rows up to their own n_keys where this call
     * would zero those past hi: the same bits, since no query weighs a key
     * past its last (masked scores, skipped or half-masked value pairs).
     * Rows before a sliding window's first would not be: built here then. */
    const __m512i *prebuilt = first == 0 && a[0].bf16_tiles && hi <= a[0].bf16_tiled_keys ? a[0].bf16_tiles : NULL;
    for (int64_t b0 = first - first % VT; b0 < hi; b0 += VT) {
        const __m512i *kt = ktp, (*vt)[MAX_D / 16] = (const __m512i (*)[MAX_D / 16])vtp;
        if (prebuilt) {
            kt = prebuilt + (b0 / VT) * TILE_VECS(D, I8);
            vt = (const __m512i (*)[MAX_D / 16])(kt + K_VECS(D, I8));
        } else if (I8) {
            build_k_tile_i8(D, &a[0], b0, first, hi, rows, ktp, false);
            build_v_tile_i8(D, &a[0], b0, first, hi, rows, &vtp[0][0], false);
        } else {
            build_k_tile(D, &a[0], b0, first, hi, rows, ktp, false);
            build_k_tile(D, &a[0], b0 + KT, first, hi, rows, ktp + D, false);
            build_v_tile(D, &a[0], b0, first, hi, rows, vtp, false);
        }
        const int64_t lo = b0 > first ? b0 : first;
        const float *v_steps = I8 ? (const float *)(&vt[0][0] + (VT / 4) * (D / 16)) : NULL;
        for (int gi = 0; gi < groups; gi++) {
            int s0 = gi * QB, nq = n - s0 < QB ? n - s0 : QB;
            /* The rows (or tiles) of the block after next, a share per
             * group of queries: a burst of 512 prefetches stalled on the
             * miss buffers. */
            if (prebuilt) {
                if (b0 + 2 * VT < hi) prefetch_tiles(prebuilt + (b0 / VT + 2) * TILE_VECS(D, I8), TILE_VECS(D, I8), gi, groups);
            } else
                prefetch_rows(D, &a[0], b0 + 2 * VT + (int64_t)gi * VT / groups,
                              b0 + 2 * VT + (int64_t)(gi + 1) * VT / groups, hi);
            any[gi] = false; /* a query of the group sees a key of the block */
            for (int i = s0; i < s0 + nq; i++) any[gi] |= a[i].n_keys > lo;
            if (any[gi])
                scores[nq](a + s0, kt, v_steps, qb + s0, m + s0, lsum + s0, w + s0, b0, first);
        }
        for (int gi = 0; gi < groups; gi++) {
            int s0 = gi * QB, nq = n - s0 < QB ? n - s0 : QB;
            if (!any[gi]) continue;
            if (I8)
                values_i8[nq](&vt[0][0], w + s0, out + s0, b0, first);
            else
                values[nq](vt, w + s0, out + s0, b0, first);
        }
    }
    for (int i = 0; i < n; i++) {
        __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(lsum[i]));
        for (int c = 0; c < D / 16; c++)
            _mm512_storeu_ps(a[i].out + 16 * c, _mm512_mul_ps(_mm512_load_ps(out[i] + 16 * c), inv));
    }
}

static void heads_bf16_128(const attention_head_args *a, int n) { heads_bf16(128, false, a, n); }
static void heads_bf16_64(const attention_head_args *a, int n) { heads_bf16(64, false, a, n); }
static void heads_i8_128(const attention_head_args *a, int n) { heads_bf16(128, true, a, n); }
static void heads_i8_64(const attention_head_args *a, int n) { heads_bf16(64, true, a, n); }

void attention_heads_avx512bf16(const attention_head_args *a, int n) {
    int i = 0;
    while (i < n) {
        int m = 1;
        const int d = a[i].d_k;
        while (i + m < n && m < MAX_Q && attention_same_kv(&a[i], &a[i + m])) m++;
        if (d == 128 && a[i].d_v == 128)
            (a[i].int8 ? heads_i8_128 : heads_bf16_128)(a + i, m);
        else if (d == 64 && a[i].d_v == 64)
            (a[i].int8 ? heads_i8_64 : heads_bf16_64)(a + i, m);
        else /* op_attention_precision never picks bf16 for these heads */
            for (int k = 0; k < m; k++) attention_head_avx512(a + i + k);
        i += m;
    }
}

static void tiles_build(const int D, const bool I8, void *tiles, const attention_head_args *a, int64_t block_begin,
                        int64_t block_end) {
    float rows[VT][MAX_D] __attribute__((aligned(64)));
    for (int64_t b = block_begin; b < block_end; b++) {
        __m512i *kt = (__m512i *)tiles + b * TILE_VECS(D, I8);
        if (b + 2 < block_end) prefetch_rows(D, a, (b + 2) * VT, (b + 3) * VT, a->n_keys);
        if (I8) {
            build_k_tile_i8(D, a, b * VT, 0, a->n_keys, rows, kt, true);
            build_v_tile_i8(D, a, b * VT, 0, a->n_keys, rows, kt + K_VECS(D, I8), true);
        } else {
            build_k_tile(D, a, b * VT, 0, a->n_keys, rows, kt, true);
            build_k_tile(D, a, b * VT + KT, 0, a->n_keys, rows, kt + D, true);
            build_v_tile(D, a, b * VT, 0, a->n_keys, rows, (__m512i (*)[MAX_D / 16])(kt + K_VECS(D, I8)), true);
        }
    }
    _mm_sfence(); /* the streamed tiles reach memory before another thread reads them */
}

void attention_bf16_tiles_build_avx512bf16(void *tiles, const attention_head_args *a, int64_t block_begin,
                                           int64_t block_end) {
    if (a->d_k == 128 && a->int8)
        tiles_build(128, true, tiles, a, block_begin, block_end);
    else if (a->d_k == 128)
        tiles_build(128, false, tiles, a, block_begin, block_end);
    else if (a->int8)
        tiles_build(64, true, tiles, a, block_begin, block_end);
    else
        tiles_build(64, false, tiles, a, block_begin, block_end);
}
