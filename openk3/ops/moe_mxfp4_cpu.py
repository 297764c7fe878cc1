"""A fused CPU kernel for routed experts held in MXFP4 (the release's packed experts, 4.25 bits per
weight): decode reads the packed bytes, never a dequantised copy.

Why: a decode step's routed experts cost about the bytes of their weights (one CPU core streams them).
Kept packed (`openk3.model.packed_experts.PackedExperts`), an expert is 7.5x smaller than in float32, so a step reads
7.5x fewer expert bytes; `experts_packed` (torch operators) instead dequantises each touched expert
into a temporary and runs three matmuls on it. Two kinds of kernel, tested equal:

* float32 on AVX-512 or AVX2 + FMA (the decode path; `moe_mxfp4_simd.py`): no weight row is materialised.
  Each 32-element group's packed bytes are decoded in registers (the E2M1 table pre-multiplied by the group's
  E8M0 scale 2^(b-127), looked up by the low and by the high nibbles: the group's even and odd elements) and
  multiplied straight into accumulators, against inputs stored de-interleaved to match; the sums of a block
  of rows are reduced together, then the GLU; an expert's tokens go four at a time: gate/up rows, GLU, down
  rows weighted into the output. On AVX-512 at nano-kl's expert shape it took a layer's 16-token call from
  145 to 48 us and a one-token call from 15 to 7.5 us (one core) against the row-buffer form it replaced;
  the AVX2 form's figures are in docs/benchmarks.md.
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
    raise_for,
)
from openk3.ops.moe_mxfp4_simd import SOURCE_F32

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

/* Where expert e's six tensors are, in the order gate codes, gate scales, up codes, up scales, down codes,
   down scales: base[k] + e * stride[k] (stacked buffers, `PackedExperts`), or tab[6 e + k] (absolute
   addresses, one row per expert; 0 where an expert is not resident: streamed experts, `openk3.stream`). */
typedef struct { const uint8_t *base[6]; int64_t stride[6]; const int64_t *tab; } Src;

static inline Src stacked(const uint8_t *p1, const uint8_t *s1, const uint8_t *p3, const uint8_t *s3,
                          const uint8_t *p2, const uint8_t *s2, int64_t C, int64_t I) {
    Src s = {{p1, s1, p3, s3, p2, s2}, {I * (C / 2), I * (C / 32), I * (C / 2), I * (C / 32), C * (I / 2),
             C * (I / 32)}, NULL};
    return s;
}

/* w[k] = expert e's tensor k; -1 for an expert the table does not hold. */
static inline int expert_ptrs(const Src *s, int64_t e, const uint8_t **w) {
    for (int k = 0; k < 6; k++) {
        if (s->tab) {
            if (!s->tab[6 * e + k]) return -1;
            w[k] = (const uint8_t *)(intptr_t)s->tab[6 * e + k];
        } else {
            w[k] = s->base[k] + e * s->stride[k];
        }
    }
    return 0;
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
static int mxfp4_##SUF(const T *x, const int64_t *idx, const T *wts, int64_t N, int64_t K, int64_t C,        \
                       const Src *src, int64_t E, int64_t I, int act, double b1, double b2, int64_t e_lo,  \
                       int64_t e_hi, int acc, T *out) {                                                     \
    int64_t M = N * K;                                                                              \
    const int64_t pc = C / 2, sc = C / 32, pi = I / 2, si = I / 32; /* bytes per row */            \
    int64_t *start = malloc(sizeof(int64_t) * (E + 1)), *order = malloc(sizeof(int64_t) * (M + 1)); \
    T *h = malloc(sizeof(T) * CHUNK * (I + 1));                                                     \
    T *r1 = malloc(sizeof(T) * (C + 1)), *r3 = malloc(sizeof(T) * (C + 1)), *r2 = malloc(sizeof(T) * 4 * (I + 1)); \
    int rc = (start && order && h && r1 && r3 && r2) ? sort_pairs(idx, M, E, start, order) : -2;   \
    if (rc == 0 && !acc) memset(out, 0, sizeof(T) * N * C);                                         \
    const uint8_t *w[6], *nw[6];                                                                    \
    for (int64_t e = e_lo; rc == 0 && e < e_hi; e++) {                                              \
        if (start[e + 1] == start[e]) continue;                                                     \
        if (expert_ptrs(src, e, w)) { rc = -4; break; }                                             \
        int64_t en = e + 1;                                                                         \
        while (en < e_hi && start[en + 1] == start[en]) en++;                                       \
        int pf = en < e_hi && !expert_ptrs(src, en, nw);                                            \
        const uint8_t *p1 = w[0], *s1 = w[1], *p3 = w[2], *s3 = w[3], *p2 = w[4], *s2 = w[5];       \
        const uint8_t *n1 = pf ? nw[0] : p1, *m1 = pf ? nw[1] : s1, *n3 = pf ? nw[2] : p3;          \
        const uint8_t *m3 = pf ? nw[3] : s3, *n2 = pf ? nw[4] : p2, *m2 = pf ? nw[5] : s2;          \
        for (int64_t q0 = start[e]; rc == 0 && q0 < start[e + 1]; q0 += CHUNK) {                    \
            int64_t nq = start[e + 1] - q0 < CHUNK ? start[e + 1] - q0 : CHUNK;                     \
            int first = pf && q0 == start[e];                                                       \
            for (int64_t i = 0; i < I; i++) {                                                       \
                if (deq_##SUF(p1 + i * pc, s1 + i * sc, C, r1)                                      \
                    || deq_##SUF(p3 + i * pc, s3 + i * sc, C, r3)) { rc = -3; break; }              \
                if (first) {                                                                        \
                    prefetch_##SUF(n1 + i * pc, pc); prefetch_##SUF(n3 + i * pc, pc);               \
                    prefetch_##SUF(m1 + i * sc, sc); prefetch_##SUF(m3 + i * sc, sc); }             \
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
                        int64_t row = c + r;                                                        \
                        if (deq_##SUF(p2 + row * pi, s2 + row * si, I, r2 + r * I)) { rc = -3; break; } \
                        if (first) { prefetch_##SUF(n2 + row * pi, pi); prefetch_##SUF(m2 + row * si, si); } \
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
                if (deq_##SUF(p2 + c * pi, s2 + c * si, I, r2)) { rc = -3; break; }                 \
                if (first) { prefetch_##SUF(n2 + c * pi, pi); prefetch_##SUF(m2 + c * si, si); }    \
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
}                                                                                                   \
                                                                                                    \
int openk3_moe_mxfp4_##SUF(const T *x, const int64_t *idx, const T *wts, int64_t N, int64_t K,     \
                           int64_t C, const uint8_t *p1, const uint8_t *s1, const uint8_t *p3,      \
                           const uint8_t *s3, const uint8_t *p2, const uint8_t *s2, int64_t E,      \
                           int64_t I, int act, double b1, double b2, T *out) {                      \
    Src src = stacked(p1, s1, p3, s3, p2, s2, C, I);                                                \
    return mxfp4_##SUF(x, idx, wts, N, K, C, &src, E, I, act, b1, b2, 0, E, 0, out);                \
}                                                                                                   \
                                                                                                    \
int openk3_moe_mxfp4_tab_##SUF(const T *x, const int64_t *idx, const T *wts, int64_t N, int64_t K, \
                               int64_t C, const int64_t *tab, int64_t E, int64_t I, int act,        \
                               double b1, double b2, int64_t e_lo, int64_t e_hi, int acc, T *out) { \
    Src src = {{0}, {0}, tab};                                                                      \
    return mxfp4_##SUF(x, idx, wts, N, K, C, &src, E, I, act, b1, b2, e_lo, e_hi, acc, out);        \
}

""" + SOURCE_F32 + r"""
#ifndef OPENK3_SIMD_F32
#define OPENK3_SIMD_F32 0
DEQ_SCALAR(float, f32)
DEFINE(float, f32)
#endif
DEFINE(double, f64)

/* Which float32 form was built: 512 (AVX-512), 2 (AVX2 + FMA) or 0 (portable C). */
int openk3_moe_mxfp4_simd(void) { return OPENK3_SIMD_F32; }
"""

# `PackedExperts` buffers in the kernel's argument order (the model and the benchmark pass them so).
BUFFERS = ("w1_packed", "w1_scale", "w3_packed", "w3_scale", "w2_packed", "w2_scale")
_P, _L, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_ARGS = [_P, _P, _P, _L, _L, _L, _P, _P, _P, _P, _P, _P, _L, _L, ctypes.c_int, _D, _D, _P]
# The table form: (x, ids, weights, N, K, C, table, E, I, activation, beta, linear_beta, e_lo, e_hi, accumulate, out)
_TAB_ARGS = [_P, _P, _P, _L, _L, _L, _P, _L, _L, ctypes.c_int, _D, _D, _L, _L, ctypes.c_int, _P]


@functools.cache
def _lib() -> ctypes.CDLL | None:
    return cbuild.load("moe_mxfp4", _SOURCE, {"openk3_moe_mxfp4_f32": _ARGS, "openk3_moe_mxfp4_f64": _ARGS,
                                              "openk3_moe_mxfp4_tab_f32": _TAB_ARGS,
                                              "openk3_moe_mxfp4_tab_f64": _TAB_ARGS,
                                              "openk3_moe_mxfp4_simd": []}, "MXFP4 CPU MoE kernel")


def simd_form() -> str | None:
    """The float32 form this process's kernel was built with: "avx512", "avx2", "portable"; None without one."""
    lib = _lib()
    return None if lib is None else {512: "avx512", 2: "avx2", 0: "portable"}[lib.openk3_moe_mxfp4_simd()]


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


def experts_mxfp4_table(x_NC: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, table_E6: torch.Tensor,
                        hidden: int, hidden_act: str, beta: float, linear_beta: float, e_lo: int, e_hi: int,
                        out_NC: torch.Tensor | None = None) -> torch.Tensor:
    """`experts_mxfp4` on experts found through a table of addresses instead of stacked buffers, for the
    experts e_lo <= e < e_hi only, added into `out_NC` (None: a zeroed new one). Returns out_NC [N, C].

    `table_E6` int64 [E, 6]: row e holds the addresses of expert e's gate codes, gate scales, up codes, up
    scales, down codes and down scales (the `PackedExperts` layouts of one expert, rows contiguous), or
    zeros where the expert is not resident. The caller keeps that memory alive and unchanged during the
    call (`openk3.stream.ExpertCache` pins the slots). Calls over ascending, disjoint ranges that together
    cover every routed expert give, bit for bit, what one `experts_mxfp4` call gives on the same bytes: each
    output row is summed expert by expert in ascending order either way. A routed expert in range without
    a table row raises RuntimeError; a scale byte 255 ValueError (as `experts_mxfp4`).
    """
    lib = _lib()
    if lib is None:
        raise RuntimeError("the MXFP4 CPU MoE kernel is unavailable (see available())")
    E = table_E6.shape[0]
    assert table_E6.dtype == torch.int64 and table_E6.shape == (E, 6) and table_E6.is_contiguous()
    x, wts, idx = lean_inputs(x_NC, weights_NK, idx_NK)
    N, C = x.shape
    assert C % 32 == 0 and hidden % 32 == 0 and 0 <= e_lo <= e_hi <= E and idx.shape == (N, wts.shape[1])
    acc = out_NC is not None
    if out_NC is None:
        out_NC = x.new_empty((N, C))
    assert out_NC.dtype == x.dtype and out_NC.shape == (N, C) and out_NC.is_contiguous()
    if N == 0 or C == 0 or e_lo == e_hi:
        return out_NC.zero_() if not acc else out_NC
    fn = lib.openk3_moe_mxfp4_tab_f32 if x.dtype == torch.float32 else lib.openk3_moe_mxfp4_tab_f64
    rc = fn(x.data_ptr(), idx.data_ptr(), wts.data_ptr(), N, idx.shape[1], C, table_E6.data_ptr(), E, hidden,
            ACTS[hidden_act], beta, linear_beta, e_lo, e_hi, int(acc), out_NC.data_ptr())
    if rc == -4:
        raise RuntimeError(f"experts_mxfp4_table: a routed expert in [{e_lo}, {e_hi}) has no table row")
    raise_for(rc, "experts_mxfp4_table", E)
    return out_NC


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
