"""A fused CPU kernel for routed experts held in MXFP4 (the release's packed experts, 4.25 bits per
weight): decode reads the packed bytes, never a dequantised copy.

Why: a decode step's routed experts cost about the bytes of their weights (one CPU core streams them).
Kept packed (`openk3.quant.PackedExperts`), an expert is 7.5x smaller than in float32, so a step reads
7.5x fewer expert bytes; `experts_packed` (torch operators) instead dequantises each touched expert
into a temporary and runs three matmuls on it. Two forms of the kernel, tested equal:

* float32 on AVX-512 (the decode path): no weight row is materialised. Each 32-element group is decoded
  into two registers (a 16-entry E2M1 table pre-multiplied by the group's E8M0 scale 2^(b-127), looked
  up by the low and by the high nibbles: the group's even and odd elements) and multiplied straight
  into accumulators, against inputs stored de-interleaved to match. The sums of 16 rows are reduced
  together (a transposing tree: 45 instructions for 16 sums) and the GLU runs 16 rows at a time (vector
  exp and tanh). An expert's tokens go four at a time: gate/up rows, GLU, down rows weighted into the
  output. At nano-kl's expert shape it took a layer's 16-token call from 145 to 48 us and a one-token
  call from 15 to 7.5 us (one core) against the row-buffer form it replaced.
* portable C (float64, and float32 elsewhere or with `-DOPENK3_SCALAR`): one weight row at a time is
  decoded into a buffer that stays in L1 and run past up to 64 of the expert's tokens, four per pass,
  as `moe_cpu.py` does for float weights.

Both prefetch the next touched expert's rows while one computes.

Built and cached like `moe_cpu.py` (`ops/cbuild.py`; `OPENK3_NO_KERNELS=1` disables it). Computes in
the activations' dtype (float32 or float64); dequantisation is exact there (module `quant.mxfp4`), so
`experts_mxfp4` equals `experts_loop` on the dequantised experts up to summation order (tests: float64,
odd shapes). Inference only (no autograd). MXFP4 layout: see `quant/mxfp4.py`; C and I are multiples
of 32.

Legend: N tokens, C expert input width, I expert hidden width, E experts, K experts per token.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from openk3.common import opaque_op
from openk3.ops import cbuild
from openk3.ops.moe_cpu import (
    ACTS,
    C_COMMON,
    call_kernel,
    check_call,
    check_shapes,
    dense,
    inputs_as_is,
    lean_inputs,
)

# The float32 kernel on AVX-512 (the decode path): no weight row is materialised. Each 32-element group
# is decoded into two registers (its even and odd elements: low and high nibbles through the 16-entry
# table pre-multiplied by the group's scale) and multiplied straight into accumulators against inputs
# stored de-interleaved to match, so no permutation restores element order. The sums of 16 rows are
# reduced together by a transposing tree (45 operations for 16 sums instead of ~8 per sum), and the GLU
# runs on 16 rows at once (a vector exp and tanh of ~2 ulp). Tokens of an expert go four at a time.
_AVX512_F32 = r"""
#include <immintrin.h>

/* e^x to ~1 ulp: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial in r, times 2^n. The clamps keep
   NaN (max/min return their second operand on NaN) and give 0 and inf beyond float range. */
static inline __m512 exp_v(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(89.f), _mm512_max_ps(_mm512_set1_ps(-104.f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* tanh: an odd polynomial below |y| = 0.625 (no cancellation near 0), else 1 - 2 / (e^{2|y|} + 1). */
static inline __m512 tanh_v(__m512 y) {
    const __m512 one = _mm512_set1_ps(1.f);
    __m512 a = _mm512_abs_ps(y), z = _mm512_mul_ps(y, y);
    __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
    __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), y, y);
    __m512 big = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f),
                                                  _mm512_add_ps(exp_v(_mm512_add_ps(a, a)), one)));
    big = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(big), _mm512_and_si512(
        _mm512_castps_si512(y), _mm512_set1_epi32((int)0x80000000u))));  /* sign of y */
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_LT_OQ), big, small);
}

/* glu_f32 on 16 rows, the same recipe and order of operations. */
static inline __m512 glu_v(__m512 g, __m512 u, int act, float b1, float b2) {
    const __m512 one = _mm512_set1_ps(1.f);
    __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp_v(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    if (act == ACT_SILU) return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
    __m512 v1 = _mm512_set1_ps(b1), v2 = _mm512_set1_ps(b2);
    __m512 tg = _mm512_mul_ps(v1, tanh_v(_mm512_div_ps(g, v1)));
    __m512 tu = _mm512_mul_ps(v2, tanh_v(_mm512_div_ps(u, v2)));
    return _mm512_mul_ps(_mm512_mul_ps(tg, sig), tu);
}

/* r[j] = the sum of v[j]'s 16 lanes, j < 16: pairs of vectors are interleaved and added, halving the
   vectors at each of four levels (within 128-bit lanes twice, then across them twice). */
static inline __m512 hsum16(const __m512 *v) {
    __m512 s[8], t[4], w[2];
    for (int k = 0; k < 8; k++)
        s[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++)
        t[k] = _mm512_add_ps(_mm512_shuffle_ps(s[2 * k], s[2 * k + 1], 0x44),
                             _mm512_shuffle_ps(s[2 * k], s[2 * k + 1], 0xEE));
    for (int k = 0; k < 2; k++)
        w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

/* One 32-element group: its 16 bytes -> even elements (low nibbles) and odd ones (high nibbles), scaled.
   vpermps reads only an index's low 4 bits, so the low nibble needs no mask. */
#define DEQ_GROUP(ptr, sbyte, ev, od) do {                                                            \
    __m512 ls_ = _mm512_mul_ps(lut, _mm512_set1_ps(scale_f32(sbyte)));                                \
    __m512i v_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ptr)));                       \
    ev = _mm512_permutexvar_ps(v_, ls_);                                                              \
    od = _mm512_permutexvar_ps(_mm512_srli_epi32(v_, 4), ls_);                                        \
} while (0)

static inline int any_nan_scale(const uint8_t *s, int64_t n) {
    int bad = 0;
    for (int64_t j = 0; j < n; j++) bad |= s[j] == 255;
    return bad;
}

/* Groups of 32 stored as their 16 even then 16 odd elements (the order DEQ_GROUP yields weights in). */
static inline void deinterleave(const float *a, int64_t n, float *o) {
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int64_t g = 0; g < n; g += 32) {
        __m512 lo = _mm512_loadu_ps(a + g), hi = _mm512_loadu_ps(a + g + 16);
        _mm512_storeu_ps(o + g, _mm512_permutex2var_ps(lo, ev, hi));
        _mm512_storeu_ps(o + g + 16, _mm512_permutex2var_ps(lo, od, hi));
    }
}

/* nl (1..4, a constant after inlining) tokens of expert e: xt their de-interleaved inputs, ot their output
   rows, wt their routing weights. hn/hd: [4][I] scratch; S: [2][4][16] accumulators. */
static inline __attribute__((always_inline)) void expert_block_f32(
        const int nl, int64_t e, int64_t en, int pf, const float *const *xt, float *const *ot, const float *wt,
        int64_t C, const uint8_t *p1, const uint8_t *s1, const uint8_t *p3, const uint8_t *s3,
        const uint8_t *p2, const uint8_t *s2, int64_t I, int act, float b1, float b2,
        float *hn, float *hd, __m512 (*S)[4][16]) {
    const __m512 lut = _mm512_loadu_ps(E2M1_f32);
    const int64_t pc = C / 2, sc = C / 32, pi = I / 2, si = I / 32;
    for (int64_t ib = 0; ib < I; ib += 16) {  /* gate and up: 16 rows, then their sums and GLU at once */
        for (int r = 0; r < 16; r++) {
            int64_t row = e * I + ib + r, nrow = en * I + ib + r;
            if (pf) {
                for (int64_t b = 0; b < pc; b += 64) {
                    __builtin_prefetch(p1 + nrow * pc + b, 0, 1); __builtin_prefetch(p3 + nrow * pc + b, 0, 1); }
                __builtin_prefetch(s1 + nrow * sc, 0, 1); __builtin_prefetch(s3 + nrow * sc, 0, 1);
            }
            __m512 ag[4], au[4];
            for (int t = 0; t < nl; t++) ag[t] = au[t] = _mm512_setzero_ps();
            for (int64_t g = 0; g < sc; g++) {
                __m512 e1, o1, e3, o3;
                DEQ_GROUP(p1 + row * pc + g * 16, s1[row * sc + g], e1, o1);
                DEQ_GROUP(p3 + row * pc + g * 16, s3[row * sc + g], e3, o3);
                for (int t = 0; t < nl; t++) {
                    __m512 xe = _mm512_loadu_ps(xt[t] + g * 32), xo = _mm512_loadu_ps(xt[t] + g * 32 + 16);
                    ag[t] = _mm512_fmadd_ps(o1, xo, _mm512_fmadd_ps(e1, xe, ag[t]));
                    au[t] = _mm512_fmadd_ps(o3, xo, _mm512_fmadd_ps(e3, xe, au[t]));
                }
            }
            for (int t = 0; t < nl; t++) { S[0][t][r] = ag[t]; S[1][t][r] = au[t]; }
        }
        for (int t = 0; t < nl; t++)
            _mm512_storeu_ps(hn + t * I + ib, glu_v(hsum16(S[0][t]), hsum16(S[1][t]), act, b1, b2));
    }
    for (int t = 0; t < nl; t++) deinterleave(hn + t * I, I, hd + t * I);
    for (int64_t cb = 0; cb < C; cb += 16) {  /* down: 16 output columns, then weighted into each row */
        for (int r = 0; r < 16; r++) {
            int64_t row = e * C + cb + r, nrow = en * C + cb + r;
            if (pf) {
                for (int64_t b = 0; b < pi; b += 64) __builtin_prefetch(p2 + nrow * pi + b, 0, 1);
                __builtin_prefetch(s2 + nrow * si, 0, 1);
            }
            __m512 a[4];
            for (int t = 0; t < nl; t++) a[t] = _mm512_setzero_ps();
            for (int64_t g = 0; g < si; g++) {
                __m512 ev, od;
                DEQ_GROUP(p2 + row * pi + g * 16, s2[row * si + g], ev, od);
                for (int t = 0; t < nl; t++)
                    a[t] = _mm512_fmadd_ps(od, _mm512_loadu_ps(hd + t * I + g * 32 + 16),
                                           _mm512_fmadd_ps(ev, _mm512_loadu_ps(hd + t * I + g * 32), a[t]));
            }
            for (int t = 0; t < nl; t++) S[0][t][r] = a[t];
        }
        for (int t = 0; t < nl; t++)
            _mm512_storeu_ps(ot[t] + cb, _mm512_fmadd_ps(_mm512_set1_ps(wt[t]), hsum16(S[0][t]),
                                                         _mm512_loadu_ps(ot[t] + cb)));
    }
}

int openk3_moe_mxfp4_f32(const float *x, const int64_t *idx, const float *wts, int64_t N, int64_t K, int64_t C,
                         const uint8_t *p1, const uint8_t *s1, const uint8_t *p3, const uint8_t *s3,
                         const uint8_t *p2, const uint8_t *s2, int64_t E, int64_t I, int act, double b1,
                         double b2, float *out) {
    int64_t M = N * K;
    int64_t *start = malloc(sizeof(int64_t) * (E + 1)), *order = malloc(sizeof(int64_t) * (M + 1));
    float *xd = malloc(sizeof(float) * (N * C + 1)), *hn = malloc(sizeof(float) * 4 * I + 64);
    float *hd = malloc(sizeof(float) * 4 * I + 64);
    __m512 S[2][4][16];
    int rc = (start && order && xd && hn && hd) ? sort_pairs(idx, M, E, start, order) : -2;
    if (rc == 0) {
        memset(out, 0, sizeof(float) * N * C);
        for (int64_t n = 0; n < N; n++) deinterleave(x + n * C, C, xd + n * C);
    }
    for (int64_t e = 0; rc == 0 && e < E; e++) {
        if (start[e + 1] == start[e]) continue;
        if (any_nan_scale(s1 + e * I * (C / 32), I * (C / 32)) || any_nan_scale(s3 + e * I * (C / 32), I * (C / 32))
            || any_nan_scale(s2 + e * C * (I / 32), C * (I / 32))) { rc = -3; break; }
        int64_t en = e + 1;
        while (en < E && start[en + 1] == start[en]) en++;
        for (int64_t q = start[e]; q < start[e + 1]; q += 4) {
            int nl = (int)(start[e + 1] - q < 4 ? start[e + 1] - q : 4);
            int pf = en < E && q == start[e];  /* the next touched expert, while this one's first block runs */
            const float *xt[4]; float *ot[4]; float wt[4];
            for (int t = 0; t < nl; t++) {
                int64_t m = order[q + t];
                xt[t] = xd + (m / K) * C; ot[t] = out + (m / K) * C; wt[t] = wts[m];
            }
#define BLOCK(NL) expert_block_f32(NL, e, pf ? en : e, pf, xt, ot, wt, C, p1, s1, p3, s3, p2, s2, I, act, \
                                   (float)b1, (float)b2, hn, hd, S)
            switch (nl) {
                case 1: BLOCK(1); break;
                case 2: BLOCK(2); break;
                case 3: BLOCK(3); break;
                default: BLOCK(4);
            }
#undef BLOCK
        }
    }
    free(start); free(order); free(xd); free(hn); free(hd);
    return rc;
}
"""


_SOURCE = C_COMMON + r"""
static const float E2M1_f32[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                  -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
static const double E2M1_f64[16] = {0., .5, 1., 1.5, 2., 3., 4., 6., -0., -.5, -1., -1.5, -2., -3., -4., -6.};

/* 2^(b - 127), built from its bits (exact; byte 0 is the float32 subnormal 2^-127). */
static inline float scale_f32(uint8_t b) {
    union { uint32_t u; float f; } v;
    v.u = b ? (uint32_t)b << 23 : 0x00400000u;
    return v.f;
}
static inline double scale_f64(uint8_t b) {
    union { uint64_t u; double f; } v;
    v.u = (uint64_t)(b + 1023 - 127) << 52;
    return v.f;
}

enum { CHUNK = 64 };  /* tokens of one expert whose hidden rows are held at once */

/* One row of n (a multiple of 32) elements: packed p[n/2], scales s[n/32] -> o[n]. -1 on byte 255. */
#define DEQ_SCALAR(T, SUF)                                                                          \
static inline int deq_##SUF(const uint8_t *p, const uint8_t *s, int64_t n, T *o) {                       \
    for (int64_t g = 0; g < n / 32; g++) {                                                          \
        if (s[g] == 255) return -1;                                                                 \
        T sc = scale_##SUF(s[g]);                                                                   \
        const uint8_t *pg = p + g * 16;                                                             \
        T *og = o + g * 32;                                                                         \
        for (int j = 0; j < 16; j++) {                                                              \
            og[2 * j] = E2M1_##SUF[pg[j] & 15] * sc;                                                \
            og[2 * j + 1] = E2M1_##SUF[pg[j] >> 4] * sc;                                            \
        }                                                                                           \
    }                                                                                               \
    return 0;                                                                                       \
}
DEQ_SCALAR(double, f64)

#define DEFINE(T, SUF)                                                                               \
static inline void prefetch_##SUF(const uint8_t *a, int64_t n) {                                     \
    for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(a + b, 0, 1);                            \
}                                                                                                   \
                                                                                                    \
int openk3_moe_mxfp4_##SUF(const T *x, const int64_t *idx, const T *wts, int64_t N, int64_t K,     \
                           int64_t C, const uint8_t *p1, const uint8_t *s1, const uint8_t *p3,      \
                           const uint8_t *s3, const uint8_t *p2, const uint8_t *s2, int64_t E,      \
                           int64_t I, int act, double b1, double b2, T *out) {                      \
    int64_t M = N * K;                                                                              \
    const int64_t pc = C / 2, sc = C / 32, pi = I / 2, si = I / 32; /* bytes per row */            \
    int64_t *start = malloc(sizeof(int64_t) * (E + 1)), *order = malloc(sizeof(int64_t) * (M + 1)); \
    T *h = malloc(sizeof(T) * CHUNK * (I + 1));                                                     \
    T *r1 = malloc(sizeof(T) * (C + 1)), *r3 = malloc(sizeof(T) * (C + 1)), *r2 = malloc(sizeof(T) * 4 * (I + 1)); \
    int rc = (start && order && h && r1 && r3 && r2) ? sort_pairs(idx, M, E, start, order) : -2;   \
    if (rc == 0) memset(out, 0, sizeof(T) * N * C);                                                 \
    for (int64_t e = 0; rc == 0 && e < E; e++) {                                                    \
        if (start[e + 1] == start[e]) continue;                                                     \
        int64_t en = e + 1;                                                                         \
        while (en < E && start[en + 1] == start[en]) en++;                                          \
        int pf = en < E;                                                                            \
        for (int64_t q0 = start[e]; rc == 0 && q0 < start[e + 1]; q0 += CHUNK) {                    \
            int64_t nq = start[e + 1] - q0 < CHUNK ? start[e + 1] - q0 : CHUNK;                     \
            int first = pf && q0 == start[e];                                                       \
            for (int64_t i = 0; i < I; i++) {                                                       \
                int64_t row = e * I + i, nrow = en * I + i;                                         \
                if (deq_##SUF(p1 + row * pc, s1 + row * sc, C, r1)                                  \
                    || deq_##SUF(p3 + row * pc, s3 + row * sc, C, r3)) { rc = -3; break; }          \
                if (first) {                                                                        \
                    prefetch_##SUF(p1 + nrow * pc, pc); prefetch_##SUF(p3 + nrow * pc, pc);         \
                    prefetch_##SUF(s1 + nrow * sc, sc); prefetch_##SUF(s3 + nrow * sc, sc); }       \
                for (int64_t t0 = 0; t0 < nq; t0 += 4) {                                            \
                    int nb = (int)(nq - t0 < 4 ? nq - t0 : 4);                                      \
                    const T *xr[4];                                                                 \
                    T g[4], u[4];                                                                   \
                    for (int t = 0; t < nb; t++) xr[t] = x + (order[q0 + t0 + t] / K) * C;          \
                    dots_up_##SUF(r1, r3, xr, nb, C, g, u);                                         \
                    for (int t = 0; t < nb; t++) h[(t0 + t) * I + i] = glu_##SUF(g[t], u[t], act, b1, b2); \
                }                                                                                   \
            }                                                                                       \
            if (nq == 1 && C % 4 == 0) { /* decode: four down rows per pass */                   \
                T *o0 = out + (order[q0] / K) * C, w0 = wts[order[q0]];                             \
                for (int64_t c = 0; rc == 0 && c < C; c += 4) {                                     \
                    for (int r = 0; r < 4; r++) {                                                   \
                        int64_t row = e * C + c + r, nrow = en * C + c + r;                         \
                        if (deq_##SUF(p2 + row * pi, s2 + row * si, I, r2 + r * I)) { rc = -3; break; } \
                        if (first) { prefetch_##SUF(p2 + nrow * pi, pi); prefetch_##SUF(s2 + nrow * si, si); } \
                    }                                                                               \
                    if (rc) break;                                                                  \
                    T a0 = 0, a1 = 0, a2 = 0, a3 = 0;                                               \
                    const T *q1 = r2 + I, *q2 = r2 + 2 * I, *q3 = r2 + 3 * I;                       \
                    _Pragma("omp simd reduction(+:a0,a1,a2,a3)")                                    \
                    for (int64_t i = 0; i < I; i++) {                                               \
                        T v = h[i];                                                                 \
                        a0 += r2[i] * v; a1 += q1[i] * v; a2 += q2[i] * v; a3 += q3[i] * v;         \
                    }                                                                               \
                    o0[c] += w0 * a0; o0[c + 1] += w0 * a1; o0[c + 2] += w0 * a2; o0[c + 3] += w0 * a3; \
                }                                                                                   \
                continue;                                                                           \
            }                                                                                       \
            for (int64_t c = 0; rc == 0 && c < C; c++) {                                            \
                int64_t row = e * C + c, nrow = en * C + c;                                         \
                if (deq_##SUF(p2 + row * pi, s2 + row * si, I, r2)) { rc = -3; break; }             \
                if (first) { prefetch_##SUF(p2 + nrow * pi, pi); prefetch_##SUF(s2 + nrow * si, si); } \
                for (int64_t t0 = 0; t0 < nq; t0 += 4) {                                            \
                    int nb = (int)(nq - t0 < 4 ? nq - t0 : 4);                                      \
                    const T *hr[4];                                                                 \
                    T a[4];                                                                         \
                    for (int t = 0; t < nb; t++) hr[t] = h + (t0 + t) * I;                          \
                    dots_down_##SUF(r2, hr, nb, I, a);                                              \
                    for (int t = 0; t < nb; t++) {                                                  \
                        int64_t m = order[q0 + t0 + t];                                             \
                        out[(m / K) * C + c] += wts[m] * a[t];                                      \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    free(start); free(order); free(h); free(r1); free(r3); free(r2);                                \
    return rc;                                                                                      \
}

#if defined(__AVX512F__) && !defined(OPENK3_SCALAR)
""" + _AVX512_F32 + r"""
#else
DEQ_SCALAR(float, f32)
DEFINE(float, f32)
#endif
DEFINE(double, f64)
"""

# `PackedExperts` buffers in the kernel's argument order (the model and the benchmark pass them so).
BUFFERS = ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale")
_P, _L, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_ARGS = [_P, _P, _P, _L, _L, _L, _P, _P, _P, _P, _P, _P, _L, _L, ctypes.c_int, _D, _D, _P]


@functools.cache
def _lib() -> ctypes.CDLL | None:
    return cbuild.load("moe_mxfp4", _SOURCE, {"openk3_moe_mxfp4_f32": _ARGS, "openk3_moe_mxfp4_f64": _ARGS},
                       "MXFP4 CPU MoE kernel")


def available() -> bool:
    """True when the kernel is built (or can be): a C compiler exists and `OPENK3_NO_KERNELS` is unset or 0."""
    return _lib() is not None


def supports(x_NC: torch.Tensor, hidden_act: str) -> bool:
    """Whether `experts_mxfp4` takes these activations (availability aside): CPU, float32 or float64, a
    known activation, no autograd."""
    return (x_NC.device.type == "cpu" and x_NC.dtype in (torch.float32, torch.float64) and hidden_act in ACTS
            and not torch.is_grad_enabled())


def experts_mxfp4(x_NC: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, w1_packed: torch.Tensor,
                  w1_scale: torch.Tensor, w3_packed: torch.Tensor, w3_scale: torch.Tensor, w2_packed: torch.Tensor,
                  w2_scale: torch.Tensor, hidden_act: str, beta: float, linear_beta: float) -> torch.Tensor:
    """`experts_loop` on the dequantised experts (`PackedExperts` buffers: w1/w3 packed [E, I, C/2] and
    scale [E, I, C/32], w2 packed [E, C, I/2] and scale [E, C, I/32], uint8), with the GLU given by its
    recipe, in one kernel call. Returns [N, C] in x's dtype. Bad inputs (and scale byte 255, E8M0 NaN,
    in a used expert) raise ValueError; nothing unchecked reaches C."""
    bufs = (w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale)
    lib = _lib()
    if lib is not None and _ready_as_is(x_NC, weights_NK, idx_NK, bufs, hidden_act):
        return call_kernel(lib.openk3_moe_mxfp4_f32, lib.openk3_moe_mxfp4_f64, "experts_mxfp4", x_NC, weights_NK,
                           idx_NK, bufs, w1_packed.shape[0], w1_packed.shape[1], hidden_act, beta, linear_beta)
    named = dict(zip(BUFFERS, bufs, strict=True))
    check_call("experts_mxfp4", x_NC, weights_NK, idx_NK, named, hidden_act)
    if any(b.dtype != torch.uint8 for b in bufs):
        bad = [f"{n} {b.dtype}" for n, b in named.items() if b.dtype != torch.uint8]
        raise ValueError(f"experts_mxfp4: MXFP4 buffers must be uint8; got {', '.join(bad)}")
    if w1_packed.dim() != 3:
        raise ValueError(f"experts_mxfp4: w1_packed must be [E, I, C/2]; got {tuple(w1_packed.shape)}")
    C, (E, I) = x_NC.shape[1], w1_packed.shape[:2]
    if C % 32 or I % 32:
        raise ValueError(f"experts_mxfp4: C ({C}) and I ({I}) must be multiples of 32 (MXFP4 groups)")
    up, up_s, down, down_s = (E, I, C // 2), (E, I, C // 32), (E, C, I // 2), (E, C, I // 32)
    check_shapes("experts_mxfp4", x_NC, weights_NK, idx_NK,
                 {n: (b, w) for (n, b), w in zip(named.items(), (up, up_s, up, up_s, down, down_s), strict=True)})
    if lib is None:
        raise RuntimeError("the MXFP4 CPU MoE kernel is unavailable (see available())")
    x, wts, idx = lean_inputs(x_NC, weights_NK, idx_NK)
    return call_kernel(lib.openk3_moe_mxfp4_f32, lib.openk3_moe_mxfp4_f64, "experts_mxfp4", x, wts, idx,
                       [dense(b) for b in bufs], E, I, hidden_act, beta, linear_beta)


def _ready_as_is(x, wts, idx, bufs, hidden_act: str) -> bool:
    """`moe_cpu.inputs_as_is` with the packed buffers' shapes: the call can skip the naming checks."""
    if not inputs_as_is(x, wts, idx, bufs, torch.uint8, hidden_act) or bufs[0].dim() != 3:
        return False
    C, (E, I) = x.shape[1], bufs[0].shape[:2]
    if C % 32 or I % 32:
        return False
    up, up_s, down, down_s = (E, I, C // 2), (E, I, C // 32), (E, C, I // 2), (E, C, I // 32)
    return (bufs[0].shape == up and bufs[1].shape == up_s and bufs[2].shape == up and bufs[3].shape == up_s
            and bufs[4].shape == down and bufs[5].shape == down_s)


experts_mxfp4_op = opaque_op(
    "experts_mxfp4", "(Tensor x_NC, Tensor weights_NK, Tensor idx_NK, Tensor w1_packed, Tensor w1_scale, "
    "Tensor w3_packed, Tensor w3_scale, Tensor w2_packed, Tensor w2_scale, str hidden_act, float beta, "
    "float linear_beta) -> Tensor", experts_mxfp4, "CPU")
