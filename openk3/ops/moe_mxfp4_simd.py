"""The SIMD forms of the float32 MXFP4 expert kernel (`moe_mxfp4_cpu.py`): AVX-512 and AVX2 (with FMA).

Both read each 32-element group's 16 packed bytes straight into registers (no weight row is materialised):
the bytes' low nibbles are the group's even elements and the high nibbles its odd ones, looked up in the E2M1
table pre-multiplied by the group's E8M0 scale, and multiplied into accumulators against inputs stored
de-interleaved to match (per group: its 16 even, then its 16 odd elements), so no permutation restores
element order. The sums of a block of rows (16 on AVX-512, 8 on AVX2) are reduced together by a transposing
tree, then the GLU, then the down projection the same way; an expert's tokens go four at a time, and the
next touched expert's rows are prefetched while one computes.

* AVX-512: one 16-entry table lookup (vpermps) per 16 elements; the GLU on 16 rows at once (a vector exp and
  tanh of ~2 ulp).
* AVX2: vpermps looks up 8 entries, so the table holds the 8 magnitudes and the nibble's top bit is moved to
  the float's sign bit; 8 elements per lookup; the GLU per row in scalar C (`glu_f32`, the portable kernel's),
  a small share: I GLUs against 3 C I multiply-adds per token.

`SOURCE_F32` is C that `moe_mxfp4_cpu._SOURCE` includes after the shared pieces (E2M1_f32, scale_f32,
sort_pairs, glu_f32); it defines `openk3_moe_mxfp4_f32` when the compiler targets AVX-512 or AVX2 + FMA (the
machine's, or `$OPENK3_KERNEL_ISA`'s) and defines OPENK3_SIMD_F32 so the portable float32 form is left out.
`-DOPENK3_SCALAR` forces the portable form (tests). Results equal the portable kernel's up to summation order
(tests in float32 against float64 references, on every path).
"""

_AVX512 = r"""
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
        const int nl, const uint8_t *const *w, const uint8_t *const *nw, int pf, const float *const *xt,
        float *const *ot, const float *wt, int64_t C, int64_t I, int act, float b1, float b2,
        float *hn, float *hd, __m512 (*S)[4][16]) {
    const __m512 lut = _mm512_loadu_ps(E2M1_f32);
    const int64_t pc = C / 2, sc = C / 32, pi = I / 2, si = I / 32;
    for (int64_t ib = 0; ib < I; ib += 16) {  /* gate and up: 16 rows, then their sums and GLU at once */
        for (int r = 0; r < 16; r++) {
            int64_t row = ib + r;
            if (pf) {
                for (int64_t b = 0; b < pc; b += 64) {
                    __builtin_prefetch(nw[0] + row * pc + b, 0, 1); __builtin_prefetch(nw[2] + row * pc + b, 0, 1); }
                __builtin_prefetch(nw[1] + row * sc, 0, 1); __builtin_prefetch(nw[3] + row * sc, 0, 1);
            }
            __m512 ag[4], au[4];
            for (int t = 0; t < nl; t++) ag[t] = au[t] = _mm512_setzero_ps();
            for (int64_t g = 0; g < sc; g++) {
                __m512 e1, o1, e3, o3;
                DEQ_GROUP(w[0] + row * pc + g * 16, w[1][row * sc + g], e1, o1);
                DEQ_GROUP(w[2] + row * pc + g * 16, w[3][row * sc + g], e3, o3);
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
            int64_t row = cb + r;
            if (pf) {
                for (int64_t b = 0; b < pi; b += 64) __builtin_prefetch(nw[4] + row * pi + b, 0, 1);
                __builtin_prefetch(nw[5] + row * si, 0, 1);
            }
            __m512 a[4];
            for (int t = 0; t < nl; t++) a[t] = _mm512_setzero_ps();
            for (int64_t g = 0; g < si; g++) {
                __m512 ev, od;
                DEQ_GROUP(w[4] + row * pi + g * 16, w[5][row * si + g], ev, od);
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

"""

_AVX2 = r"""
#include <immintrin.h>

/* 8 elements of a group from 8 packed bytes at p: low nibbles -> ev (elements 0, 2, .., 14 of those bytes'
   16), high nibbles -> od. `mag` holds the 8 E2M1 magnitudes times the scale; vpermps reads an index's low
   3 bits, and the nibble's bit 3 becomes the sign bit. */
#define DEQ_HALF(p, mag, ev, od) do {                                                                  \
    __m256i v_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)));                         \
    ev = _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, v_),                                             \
                       _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v_, 28), sign)));      \
    od = _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, _mm256_srli_epi32(v_, 4)),                       \
                       _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v_, 24), sign)));      \
} while (0)

/* r[j] = the sum of v[j]'s 8 lanes, j < 8: pairwise horizontal adds, then the two 128-bit halves added. */
static inline __m256 hsum8(const __m256 *v) {
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Groups of 32 stored as their 16 even then 16 odd elements (the order DEQ_HALF yields weights in). */
static inline void deinterleave(const float *a, int64_t n, float *o) {
    for (int64_t g = 0; g < n; g += 32)
        for (int j = 0; j < 16; j++) { o[g + j] = a[g + 2 * j]; o[g + 16 + j] = a[g + 2 * j + 1]; }
}

/* nl (1..4, a constant after inlining) tokens of expert e: xt their de-interleaved inputs, ot their output
   rows, wt their routing weights. hn/hd: [4][I] scratch; S: [2][4][8] accumulators. */
static inline __attribute__((always_inline)) void expert_block_f32(
        const int nl, const uint8_t *const *w, const uint8_t *const *nw, int pf, const float *const *xt,
        float *const *ot, const float *wt, int64_t C, int64_t I, int act, double b1, double b2,
        float *hn, float *hd, __m256 (*S)[4][8]) {
    const __m256 lut = _mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
    const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
    const int64_t pc = C / 2, sc = C / 32, pi = I / 2, si = I / 32;
    for (int64_t ib = 0; ib < I; ib += 8) {  /* gate and up: 8 rows, then their sums and GLUs */
        for (int r = 0; r < 8; r++) {
            int64_t row = ib + r;
            if (pf) {
                for (int64_t b = 0; b < pc; b += 64) {
                    __builtin_prefetch(nw[0] + row * pc + b, 0, 1); __builtin_prefetch(nw[2] + row * pc + b, 0, 1); }
                __builtin_prefetch(nw[1] + row * sc, 0, 1); __builtin_prefetch(nw[3] + row * sc, 0, 1);
            }
            __m256 ag[4], au[4];
            for (int t = 0; t < nl; t++) ag[t] = au[t] = _mm256_setzero_ps();
            for (int64_t g = 0; g < sc; g++) {
                const __m256 m1 = _mm256_mul_ps(lut, _mm256_set1_ps(scale_f32(w[1][row * sc + g])));
                const __m256 m3 = _mm256_mul_ps(lut, _mm256_set1_ps(scale_f32(w[3][row * sc + g])));
                for (int h = 0; h < 2; h++) {  /* bytes 8h..8h+7: elements 16h..16h+15 of the group */
                    __m256 e1, o1, e3, o3;
                    DEQ_HALF(w[0] + row * pc + g * 16 + 8 * h, m1, e1, o1);
                    DEQ_HALF(w[2] + row * pc + g * 16 + 8 * h, m3, e3, o3);
                    for (int t = 0; t < nl; t++) {
                        __m256 xe = _mm256_loadu_ps(xt[t] + g * 32 + 8 * h);
                        __m256 xo = _mm256_loadu_ps(xt[t] + g * 32 + 16 + 8 * h);
                        ag[t] = _mm256_fmadd_ps(o1, xo, _mm256_fmadd_ps(e1, xe, ag[t]));
                        au[t] = _mm256_fmadd_ps(o3, xo, _mm256_fmadd_ps(e3, xe, au[t]));
                    }
                }
            }
            for (int t = 0; t < nl; t++) { S[0][t][r] = ag[t]; S[1][t][r] = au[t]; }
        }
        for (int t = 0; t < nl; t++) {
            float g8[8], u8[8];
            _mm256_storeu_ps(g8, hsum8(S[0][t]));
            _mm256_storeu_ps(u8, hsum8(S[1][t]));
            for (int j = 0; j < 8; j++) hn[t * I + ib + j] = glu_f32(g8[j], u8[j], act, b1, b2);
        }
    }
    for (int t = 0; t < nl; t++) deinterleave(hn + t * I, I, hd + t * I);
    for (int64_t cb = 0; cb < C; cb += 8) {  /* down: 8 output columns, then weighted into each row */
        for (int r = 0; r < 8; r++) {
            int64_t row = cb + r;
            if (pf) {
                for (int64_t b = 0; b < pi; b += 64) __builtin_prefetch(nw[4] + row * pi + b, 0, 1);
                __builtin_prefetch(nw[5] + row * si, 0, 1);
            }
            __m256 a[4];
            for (int t = 0; t < nl; t++) a[t] = _mm256_setzero_ps();
            for (int64_t g = 0; g < si; g++) {
                const __m256 m2 = _mm256_mul_ps(lut, _mm256_set1_ps(scale_f32(w[5][row * si + g])));
                for (int h = 0; h < 2; h++) {
                    __m256 ev, od;
                    DEQ_HALF(w[4] + row * pi + g * 16 + 8 * h, m2, ev, od);
                    for (int t = 0; t < nl; t++)
                        a[t] = _mm256_fmadd_ps(od, _mm256_loadu_ps(hd + t * I + g * 32 + 16 + 8 * h),
                                               _mm256_fmadd_ps(ev, _mm256_loadu_ps(hd + t * I + g * 32 + 8 * h), a[t]));
                }
            }
            for (int t = 0; t < nl; t++) S[0][t][r] = a[t];
        }
        for (int t = 0; t < nl; t++)
            _mm256_storeu_ps(ot[t] + cb, _mm256_fmadd_ps(_mm256_set1_ps(wt[t]), hsum8(S[0][t]),
                                                         _mm256_loadu_ps(ot[t] + cb)));
    }
}
"""

# The entry points, the same for both: pairs sorted by expert, inputs de-interleaved once, blocks of up to four
# tokens per touched expert; experts found in stacked buffers or, for streamed experts, through a table of
# addresses (`Src`, defined in moe_mxfp4_cpu._SOURCE). VEC_T / VEC_ROWS / B1 / B2 are filled in per form.
_DRIVER = r"""
static inline int any_nan_scale(const uint8_t *s, int64_t n) {
    int bad = 0;
    for (int64_t j = 0; j < n; j++) bad |= s[j] == 255;
    return bad;
}

static int mxfp4_f32(const float *x, const int64_t *idx, const float *wts, int64_t N, int64_t K, int64_t C,
                     const Src *src, int64_t E, int64_t I, int act, double b1, double b2, int64_t e_lo,
                     int64_t e_hi, int acc, float *out) {
    int64_t M = N * K;
    int64_t *start = malloc(sizeof(int64_t) * (E + 1)), *order = malloc(sizeof(int64_t) * (M + 1));
    float *xd = malloc(sizeof(float) * (N * C + 1)), *hn = malloc(sizeof(float) * 4 * I + 64);
    float *hd = malloc(sizeof(float) * 4 * I + 64);
    VEC_T S[2][4][VEC_ROWS];
    int rc = (start && order && xd && hn && hd) ? sort_pairs(idx, M, E, start, order) : -2;
    if (rc == 0) {
        if (!acc) memset(out, 0, sizeof(float) * N * C);
        for (int64_t n = 0; n < N; n++) deinterleave(x + n * C, C, xd + n * C);
    }
    const uint8_t *w[6], *nw[6];
    for (int64_t e = e_lo; rc == 0 && e < e_hi; e++) {
        if (start[e + 1] == start[e]) continue;
        if (expert_ptrs(src, e, w)) { rc = -4; break; }
        if (any_nan_scale(w[1], I * (C / 32)) || any_nan_scale(w[3], I * (C / 32))
            || any_nan_scale(w[5], C * (I / 32))) { rc = -3; break; }
        int64_t en = e + 1;
        while (en < e_hi && start[en + 1] == start[en]) en++;
        int has_next = en < e_hi && !expert_ptrs(src, en, nw);
        for (int64_t q = start[e]; q < start[e + 1]; q += 4) {
            int nl = (int)(start[e + 1] - q < 4 ? start[e + 1] - q : 4);
            int pf = has_next && q == start[e];  /* the next touched expert, while this one's first block runs */
            const float *xt[4]; float *ot[4]; float wt[4];
            for (int t = 0; t < nl; t++) {
                int64_t m = order[q + t];
                xt[t] = xd + (m / K) * C; ot[t] = out + (m / K) * C; wt[t] = wts[m];
            }
#define BLOCK(NL) expert_block_f32(NL, w, pf ? nw : w, pf, xt, ot, wt, C, I, act, B1, B2, hn, hd, S)
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

int openk3_moe_mxfp4_f32(const float *x, const int64_t *idx, const float *wts, int64_t N, int64_t K, int64_t C,
                         const uint8_t *p1, const uint8_t *s1, const uint8_t *p3, const uint8_t *s3,
                         const uint8_t *p2, const uint8_t *s2, int64_t E, int64_t I, int act, double b1,
                         double b2, float *out) {
    Src src = stacked(p1, s1, p3, s3, p2, s2, C, I);
    return mxfp4_f32(x, idx, wts, N, K, C, &src, E, I, act, b1, b2, 0, E, 0, out);
}

int openk3_moe_mxfp4_tab_f32(const float *x, const int64_t *idx, const float *wts, int64_t N, int64_t K, int64_t C,
                             const int64_t *tab, int64_t E, int64_t I, int act, double b1, double b2,
                             int64_t e_lo, int64_t e_hi, int acc, float *out) {
    Src src = {{0}, {0}, tab};
    return mxfp4_f32(x, idx, wts, N, K, C, &src, E, I, act, b1, b2, e_lo, e_hi, acc, out);
}
"""

SOURCE_F32 = (
    "#if defined(__AVX512F__) && !defined(OPENK3_SCALAR)\n#define OPENK3_SIMD_F32 512\n" + _AVX512
    + _DRIVER.replace("VEC_T", "__m512").replace("VEC_ROWS", "16").replace("B1", "(float)b1").replace("B2", "(float)b2")
    + "#elif defined(__AVX2__) && defined(__FMA__) && !defined(OPENK3_SCALAR)\n#define OPENK3_SIMD_F32 2\n" + _AVX2
    + _DRIVER.replace("VEC_T", "__m256").replace("VEC_ROWS", "8").replace("B1", "b1").replace("B2", "b2")
    + "#endif\n"
)
