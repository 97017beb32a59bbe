/* scan.h - one token's step of the state-space recurrences: Mamba2's
 * selective scan and the gated delta rule (qwen35 / qwen3next).
 *
 * Contract: each call advances one head's state by one token, in place, and
 * writes that head's output. Results are bit-identical on every ISA (scalar,
 * AVX2, AVX-512, picked by quant_get_isa()): element-wise updates are single
 * fused multiply-adds or plain products in every path, and every sum over
 * the state dimension keeps 16 lanes (element i in lane i % 16, each lane in
 * index order) folded by one fixed tree (lane i + 8, then + 4, + 2, + 1). A
 * token's result therefore depends only on the state and its own inputs,
 * never on the batch, the thread or the instruction set.
 *
 *   Mamba2, head of P channels, state s (P x N):
 *     s[p][n] = fma(s[p][n], dA, B[n] * (x[p] * dt))
 *     y[p]    = fma(x[p], D, sum_n s[p][n] * C[n])
 *   Gated delta rule, state S (d_v x d_k), row j:
 *     S[j]  = S[j] * decay;  du = beta * (v[j] - S[j] . k)
 *     S[j] += k * du (fused);  y[j] = S[j] . q */
#ifndef EMBER_TENSOR_SCAN_H
#define EMBER_TENSOR_SCAN_H

typedef void (*scan_ssd_fn)(float *s, int P, int N, const float *x, const float *B, const float *C, float dt, float dA,
                            float D, float *y);
typedef void (*scan_delta_fn)(float *S, int d_v, int d_k, const float *q, const float *k, const float *v, float beta,
                              float decay, float *y);

/* ---- one token step, current ISA ---- */
void scan_ssd_step(float *s, int P, int N, const float *x, const float *B, const float *C, float dt, float dA, float D,
                   float *y);
void scan_delta_step(float *S, int d_v, int d_k, const float *q, const float *k, const float *v, float beta,
                     float decay, float *y);

/* ---- per-ISA kernels (tests compare them; NULL where the ISA has none) ---- */
scan_ssd_fn scan_ssd_kernel(int isa);
scan_delta_fn scan_delta_kernel(int isa);

/* ---- shared with the SIMD files ---- */
/* The fixed fold of 16 lane sums: (i + 8), (i + 4), (i + 2), (i + 1). */
float scan_fold16(const float lanes[16]);
void scan_ssd_avx2(float *s, int P, int N, const float *x, const float *B, const float *C, float dt, float dA, float D,
                   float *y);
void scan_delta_avx2(float *S, int d_v, int d_k, const float *q, const float *k, const float *v, float beta,
                     float decay, float *y);
void scan_ssd_avx512(float *s, int P, int N, const float *x, const float *B, const float *C, float dt, float dA,
                     float D, float *y);
void scan_delta_avx512(float *S, int d_v, int d_k, const float *q, const float *k, const float *v, float beta,
                       float decay, float *y);

#endif
