"""A fused CPU kernel for the routed experts of a decode step: every touched expert's weights are
read once, for all the tokens routed to it, in one call.

Why: decode runs a few tokens per step. As torch operators, the experts cost either three small
matmul calls per touched expert (`experts_sparse`: per-call overhead, ~5 us x 3 x 56 experts per
small-kl layer) or all experts densely (`experts_dense`: E/K times the FLOPs) or a grouped matmul that
CPU torch runs as one call per expert. This kernel sorts the (token, expert) pairs by expert and, for
each touched expert, streams its gate/up rows past up to four of its tokens at a time, applies the
GLU in registers and accumulates the weighted down-projection straight into the output: the weights
are read once per four tokens of an expert (once, in decode) and nothing is materialised.

It is plain C (float and double), compiled on first use with the system C compiler into a per-machine
cache (`ops/cbuild.py`; single-threaded), and called through ctypes. Without a compiler it is
simply unavailable (`available()` is False) and callers keep the torch paths. `experts_fused` has the
contract of `ops.moe.experts_loop`; tests prove them equal in float64. The activation is the model's
GLU recipe, written out here for SiLU and SiTU (spec §4.2); tests compare it with `layers.make_glu`.

Legend: N tokens, C expert input width, I expert hidden width, E experts, K experts per token.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from openk3.common import opaque_op
from openk3.ops import cbuild

# Shared with `moe_mxfp4_cpu.py`: pair sorting and the GLU recipes (spec §4.2) in float and double.
C_COMMON = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { ACT_SILU = 0, ACT_SITU = 1 };

/* The pairs m = n*K + k grouped by expert: order[start[e] .. start[e+1]). Returns -1 on a bad id. */
static int sort_pairs(const int64_t *idx, int64_t M, int64_t E, int64_t *start, int64_t *order) {
    memset(start, 0, sizeof(int64_t) * (E + 1));
    for (int64_t m = 0; m < M; m++) {
        if (idx[m] < 0 || idx[m] >= E) return -1;
        start[idx[m] + 1]++;
    }
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    int64_t *fill = malloc(sizeof(int64_t) * (E + 1));
    if (!fill) return -2;
    memcpy(fill, start, sizeof(int64_t) * E);
    for (int64_t m = 0; m < M; m++) order[fill[idx[m]]++] = m;
    free(fill);
    return 0;
}

/* glu(gate, up): SiLU(g) u, or SiTU: b1 tanh(g / b1) sigmoid(g) * b2 tanh(u / b2). */
static inline float glu_f32(float g, float u, int act, double b1, double b2) {
    float sig = 1.0f / (1.0f + expf(-g));
    return act == ACT_SILU ? g * sig * u : (float)b1 * tanhf(g / (float)b1) * sig * ((float)b2 * tanhf(u / (float)b2));
}
static inline double glu_f64(double g, double u, int act, double b1, double b2) {
    double sig = 1.0 / (1.0 + exp(-g));
    return act == ACT_SILU ? g * sig * u : b1 * tanh(g / b1) * sig * (b2 * tanh(u / b2));
}

/* Dot products of weight rows with nl (1, 2 or 4) vectors in one pass over the rows: gate and up rows
   (g[t] = r1 . v[t], u[t] = r3 . v[t]) or one down row (a[t] = r . v[t]). `dots_*` split any 1..4 vectors
   into such groups (3 = 2 + 1): no lane computes a padded copy. */
#define DEFINE_DOTS(T, SUF)                                                                          \
static inline void dot_up_##SUF(const T *r1, const T *r3, const T *const *v, int nl, int64_t n,      \
                                T *g, T *u) {                                                        \
    if (nl == 4) {                                                                                  \
        const T *v0 = v[0], *v1 = v[1], *v2 = v[2], *v3 = v[3];                                     \
        T g0 = 0, g1 = 0, g2 = 0, g3 = 0, u0 = 0, u1 = 0, u2 = 0, u3 = 0;                           \
        _Pragma("omp simd reduction(+:g0,g1,g2,g3,u0,u1,u2,u3)")                                    \
        for (int64_t c = 0; c < n; c++) {                                                           \
            T a = r1[c], b = r3[c];                                                                 \
            g0 += a * v0[c]; g1 += a * v1[c]; g2 += a * v2[c]; g3 += a * v3[c];                     \
            u0 += b * v0[c]; u1 += b * v1[c]; u2 += b * v2[c]; u3 += b * v3[c];                     \
        }                                                                                           \
        g[0] = g0; g[1] = g1; g[2] = g2; g[3] = g3; u[0] = u0; u[1] = u1; u[2] = u2; u[3] = u3;     \
    } else if (nl == 2) {                                                                           \
        const T *v0 = v[0], *v1 = v[1];                                                             \
        T g0 = 0, g1 = 0, u0 = 0, u1 = 0;                                                           \
        _Pragma("omp simd reduction(+:g0,g1,u0,u1)")                                                \
        for (int64_t c = 0; c < n; c++) {                                                           \
            T a = r1[c], b = r3[c];                                                                 \
            g0 += a * v0[c]; g1 += a * v1[c]; u0 += b * v0[c]; u1 += b * v1[c];                     \
        }                                                                                           \
        g[0] = g0; g[1] = g1; u[0] = u0; u[1] = u1;                                                 \
    } else {                                                                                        \
        const T *v0 = v[0];                                                                         \
        T g0 = 0, u0 = 0;                                                                           \
        _Pragma("omp simd reduction(+:g0,u0)")                                                      \
        for (int64_t c = 0; c < n; c++) { g0 += r1[c] * v0[c]; u0 += r3[c] * v0[c]; }               \
        g[0] = g0; u[0] = u0;                                                                       \
    }                                                                                               \
}                                                                                                   \
static inline void dot_down_##SUF(const T *r, const T *const *v, int nl, int64_t n, T *a) {          \
    if (nl == 4) {                                                                                  \
        const T *v0 = v[0], *v1 = v[1], *v2 = v[2], *v3 = v[3];                                     \
        T a0 = 0, a1 = 0, a2 = 0, a3 = 0;                                                           \
        _Pragma("omp simd reduction(+:a0,a1,a2,a3)")                                                \
        for (int64_t i = 0; i < n; i++) {                                                           \
            T w = r[i];                                                                             \
            a0 += w * v0[i]; a1 += w * v1[i]; a2 += w * v2[i]; a3 += w * v3[i];                     \
        }                                                                                           \
        a[0] = a0; a[1] = a1; a[2] = a2; a[3] = a3;                                                 \
    } else if (nl == 2) {                                                                           \
        const T *v0 = v[0], *v1 = v[1];                                                             \
        T a0 = 0, a1 = 0;                                                                           \
        _Pragma("omp simd reduction(+:a0,a1)")                                                      \
        for (int64_t i = 0; i < n; i++) { a0 += r[i] * v0[i]; a1 += r[i] * v1[i]; }                 \
        a[0] = a0; a[1] = a1;                                                                       \
    } else {                                                                                        \
        const T *v0 = v[0];                                                                         \
        T a0 = 0;                                                                                   \
        _Pragma("omp simd reduction(+:a0)")                                                         \
        for (int64_t i = 0; i < n; i++) a0 += r[i] * v0[i];                                         \
        a[0] = a0;                                                                                  \
    }                                                                                               \
}                                                                                                   \
static inline void dots_up_##SUF(const T *r1, const T *r3, const T *const *v, int nb, int64_t n,     \
                                 T *g, T *u) {                                                       \
    for (int t = 0; t < nb;) {                                                                      \
        int nl = nb - t >= 4 ? 4 : nb - t >= 2 ? 2 : 1;                                             \
        dot_up_##SUF(r1, r3, v + t, nl, n, g + t, u + t);                                           \
        t += nl;                                                                                    \
    }                                                                                               \
}                                                                                                   \
static inline void dots_down_##SUF(const T *r, const T *const *v, int nb, int64_t n, T *a) {         \
    for (int t = 0; t < nb;) {                                                                      \
        int nl = nb - t >= 4 ? 4 : nb - t >= 2 ? 2 : 1;                                             \
        dot_down_##SUF(r, v + t, nl, n, a + t);                                                     \
        t += nl;                                                                                    \
    }                                                                                               \
}
DEFINE_DOTS(float, f32)
DEFINE_DOTS(double, f64)
"""

_SOURCE = C_COMMON + r"""
/* out[N, C] = sum over each token's K picks of weight * w2[e] . glu(w1[e] x, w3[e] x).
   Four tokens of one expert share each pass over a weight row (the rows are read once per block). */
#define DEFINE(T, SUF)                                                                               \
int openk3_moe_##SUF(const T *x, const int64_t *idx, const T *wts, int64_t N, int64_t K, int64_t C, \
                     const T *w1, const T *w3, const T *w2, int64_t E, int64_t I, int act, double b1, \
                     double b2, T *out) {                                                            \
    int64_t M = N * K;                                                                              \
    int64_t *start = malloc(sizeof(int64_t) * (E + 1)), *order = malloc(sizeof(int64_t) * (M + 1)); \
    T *h = malloc(sizeof(T) * 4 * (I + 1));                                                          \
    int rc = (start && order && h) ? sort_pairs(idx, M, E, start, order) : -2;                      \
    if (rc == 0) memset(out, 0, sizeof(T) * N * C);                                                 \
    for (int64_t e = 0; rc == 0 && e < E; e++) {                                                    \
        if (start[e + 1] == start[e]) continue;                                                     \
        /* The next touched expert's rows are prefetched while this one computes: cold weights \
           otherwise stall at every 4 KiB page, where the hardware prefetcher stops. */             \
        int64_t en = e + 1;                                                                         \
        while (en < E && start[en + 1] == start[en]) en++;                                          \
        int pf = en < E;                                                                            \
        const char *n1 = (const char *)(w1 + (pf ? en : e) * I * C);                                \
        const char *n3 = (const char *)(w3 + (pf ? en : e) * I * C);                                \
        const char *n2 = (const char *)(w2 + (pf ? en : e) * C * I);                                \
        const int64_t row_up = C * (int64_t)sizeof(T), row_down = I * (int64_t)sizeof(T);          \
        for (int64_t p = start[e]; p < start[e + 1]; p += 4) {                                      \
            int nb = (int)(start[e + 1] - p < 4 ? start[e + 1] - p : 4);                            \
            const T *xr[4]; T *orow[4]; T wt[4]; T *hr[4]; /* lanes past nb are never read */      \
            for (int t = 0; t < 4; t++) {                                                           \
                int64_t m = order[p + (t < nb ? t : 0)];                                            \
                xr[t] = x + (m / K) * C; orow[t] = out + (m / K) * C; wt[t] = wts[m];               \
                hr[t] = h + t * I;                                                                  \
            }                                                                                       \
            for (int64_t i = 0; i < I; i++) {                                                       \
                const T *r1 = w1 + (e * I + i) * C, *r3 = w3 + (e * I + i) * C;                     \
                if (pf && p == start[e]) for (int64_t b = 0; b < row_up; b += 64) {                 \
                    __builtin_prefetch(n1 + i * row_up + b, 0, 1); __builtin_prefetch(n3 + i * row_up + b, 0, 1); } \
                T g[4], u[4];                                                                       \
                dots_up_##SUF(r1, r3, xr, nb, C, g, u);                                             \
                for (int t = 0; t < nb; t++) hr[t][i] = glu_##SUF(g[t], u[t], act, b1, b2);         \
            }                                                                                       \
            for (int64_t c = 0; c < C; c++) {                                                       \
                const T *r = w2 + (e * C + c) * I;                                                  \
                if (pf && p == start[e]) for (int64_t b = 0; b < row_down; b += 64)                 \
                    __builtin_prefetch(n2 + c * row_down + b, 0, 1);                                \
                T a[4];                                                                             \
                dots_down_##SUF(r, (const T *const *)hr, nb, I, a);                                 \
                for (int t = 0; t < nb; t++) orow[t][c] += wt[t] * a[t];                            \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    free(start); free(order); free(h);                                                              \
    return rc;                                                                                      \
}

DEFINE(float, f32)
DEFINE(double, f64)
"""

ACTS = {"silu": 0, "situ": 1}


_P, _L, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_ARGS = [_P, _P, _P, _L, _L, _L, _P, _P, _P, _L, _L, ctypes.c_int, _D, _D, _P]


@functools.cache
def _lib() -> ctypes.CDLL | None:
    return cbuild.load("moe", _SOURCE, {"openk3_moe_f32": _ARGS, "openk3_moe_f64": _ARGS},
                       "fused CPU MoE kernel")


def available() -> bool:
    """True when the kernel is built (or can be): a C compiler exists and `OPENK3_NO_KERNELS` is unset or 0."""
    return _lib() is not None


def supports(x_NC: torch.Tensor, w1_EIC: torch.Tensor, hidden_act: str) -> bool:
    """Whether `experts_fused` takes these inputs (the kernel's availability aside: `available()`): CPU,
    float32 or float64 (activations and weights alike), a known activation, and no autograd (the kernel
    has no backward)."""
    return (x_NC.device.type == "cpu" and x_NC.dtype in (torch.float32, torch.float64) and w1_EIC.dtype == x_NC.dtype
            and hidden_act in ACTS and not torch.is_grad_enabled())


def experts_fused(x_NC: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, w1_EIC: torch.Tensor,
                  w3_EIC: torch.Tensor, w2_ECI: torch.Tensor, hidden_act: str, beta: float,
                  linear_beta: float) -> torch.Tensor:
    """`experts_loop` with the GLU given by its recipe (`hidden_act`, SiTU's `beta`, `linear_beta`), in one
    kernel call. Inputs must pass `supports` and `available()` (anything else is a ValueError, not a
    call into C). Returns [N, C] in x's dtype.
    `experts_fused_op` (`openk3::experts_fused`) is the same as a torch.library operator: what a compiled
    decode step calls (one opaque kernel in its graph; eager callers call this function directly)."""
    weights = (w1_EIC, w3_EIC, w2_ECI)
    lib = _lib()
    if lib is not None and inputs_as_is(x_NC, weights_NK, idx_NK, weights, x_NC.dtype, hidden_act):
        E, I, C = w1_EIC.shape if w1_EIC.dim() == 3 else (-1, -1, -1)
        if (C == x_NC.shape[1] and w3_EIC.shape == w1_EIC.shape and w2_ECI.shape == (E, C, I)):
            return call_kernel(lib.openk3_moe_f32, lib.openk3_moe_f64, "experts_fused", x_NC, weights_NK, idx_NK,
                               weights, E, I, hidden_act, beta, linear_beta)
    check_call("experts_fused", x_NC, weights_NK, idx_NK, dict(zip(("w1", "w3", "w2"), weights, strict=True)),
               hidden_act)
    if any(w.dtype != x_NC.dtype for w in weights):
        raise ValueError("experts_fused takes weights of the activations' dtype; got "
                         f"x {x_NC.dtype}, w1 {w1_EIC.dtype}, w3 {w3_EIC.dtype}, w2 {w2_ECI.dtype}")
    if w1_EIC.dim() != 3:
        raise ValueError(f"experts_fused: w1 must be [E, I, C]; got {tuple(w1_EIC.shape)}")
    C, (E, I) = x_NC.shape[1], w1_EIC.shape[:2]
    check_shapes("experts_fused", x_NC, weights_NK, idx_NK, {"w1": (w1_EIC, (E, I, C)), "w3": (w3_EIC, (E, I, C)),
                                                             "w2": (w2_ECI, (E, C, I))})
    if lib is None:
        raise RuntimeError("the fused CPU MoE kernel is unavailable (see available())")
    x, wts, idx = lean_inputs(x_NC, weights_NK, idx_NK)
    return call_kernel(lib.openk3_moe_f32, lib.openk3_moe_f64, "experts_fused", x, wts, idx,
                       [dense(w) for w in weights], E, I, hidden_act, beta, linear_beta)


# ---- call-side checks shared with `moe_mxfp4_cpu.py` ----------------------------------------------------------
# The C kernels trust their pointers and sizes: everything they rely on is checked (not asserted: `python -O`
# must not turn a wrong call into a heap overflow). They run once per MoE layer per decode step, so the
# common case costs a few attribute reads; messages are built only on failure.

def check_call(name: str, x_NC, weights_NK, idx_NK, others: dict, hidden_act: str) -> None:
    """Devices (all CPU), x float32/float64 [N, C], integer ids, a known activation."""
    tensors = {"x": x_NC, "weights": weights_NK, "idx": idx_NK, **others}
    if not all(t.is_cpu for t in tensors.values()):
        off = [n for n, t in tensors.items() if not t.is_cpu]
        raise ValueError(f"{name} runs on CPU tensors; {', '.join(off)} on {tensors[off[0]].device}")
    if not all(t.layout == torch.strided and not t.is_nested for t in tensors.values()):
        # sparse, mkldnn or nested: no flat buffer behind data_ptr()
        off = [f"{n} ({'nested' if t.is_nested else t.layout})" for n, t in tensors.items()
               if t.layout != torch.strided or t.is_nested]
        raise ValueError(f"{name} takes dense strided tensors; got {', '.join(off)}")
    if x_NC.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{name} takes float32 or float64 activations, got {x_NC.dtype}")
    if idx_NK.dtype.is_floating_point or idx_NK.dtype.is_complex or idx_NK.dtype == torch.bool:
        raise ValueError(f"{name}: expert ids (idx) must be integers, got {idx_NK.dtype}")
    if weights_NK.dtype.is_complex:  # .to(x.dtype) would drop the imaginary part
        raise ValueError(f"{name}: routing weights must be real, got {weights_NK.dtype}")
    if hidden_act not in ACTS:
        raise ValueError(f"{name}: unknown activation {hidden_act!r} (known: {', '.join(ACTS)})")
    if x_NC.dim() != 2:
        raise ValueError(f"{name}: x must be [N, C]; got {tuple(x_NC.shape)}")


def as_is(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """`t` is what C reads without a copy: `dtype`, CPU, dense strided (not sparse or nested),
    contiguous, no lazy negation (what `check_call` and `dense` ask, in an order that keeps each test
    defined)."""
    return (t.dtype == dtype and t.is_cpu and t.layout == torch.strided and not t.is_nested and t.is_contiguous()
            and not t.is_neg())


def inputs_as_is(x_NC, weights_NK, idx_NK, buffers, buffer_dtype: torch.dtype, hidden_act: str) -> bool:
    """The common call (a decode step's): activations, routing and the kernel's `buffers` (of
    `buffer_dtype`) already valid and in the form C reads, so the checks that name what is wrong, and
    the conversions, can be skipped; each kernel adds its buffers' shapes. False sends the call through
    `check_call`, `check_shapes` and `lean_inputs`; True only when they would pass converting nothing."""
    if hidden_act not in ACTS or x_NC.dtype not in (torch.float32, torch.float64):
        return False
    if not (as_is(x_NC, x_NC.dtype) and as_is(weights_NK, x_NC.dtype) and as_is(idx_NK, torch.int64)
            and all(as_is(b, buffer_dtype) for b in buffers)):
        return False  # first: a sparse or nested tensor has no sizes to compare
    return (x_NC.dim() == 2 and idx_NK.dim() == 2 and idx_NK.shape[0] == x_NC.shape[0]
            and weights_NK.shape == idx_NK.shape)


def check_shapes(name: str, x_NC, weights_NK, idx_NK, want: dict) -> None:
    """idx and weights [N, K]; each of `want` (name -> (tensor, shape)) exactly its shape."""
    N, C = x_NC.shape
    K = idx_NK.shape[-1] if idx_NK.dim() == 2 else -1
    want = {"idx": (idx_NK, (N, K)), "weights": (weights_NK, (N, K)), **want}
    if K < 0:
        raise ValueError(f"{name}: shapes do not fit x [N={N}, C={C}]: idx {tuple(idx_NK.shape)} is not [N, K]")
    if any(t.shape != w for t, w in want.values()):
        bad = [f"{n} {tuple(t.shape)} (want {w})" for n, (t, w) in want.items() if t.shape != w]
        raise ValueError(f"{name}: shapes do not fit x [N={N}, C={C}]: " + ", ".join(bad))


def dense(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` as the C kernels read it: contiguous, its values in memory (no lazy negation: a view with the
    neg bit, e.g. `z.conj().imag`, keeps the unnegated values behind data_ptr() and may still be
    contiguous), in `dtype` if given; copied only when it is not so already."""
    if t.is_contiguous() and not t.is_neg() and (dtype is None or t.dtype == dtype):
        return t
    return t.resolve_neg().to(t.dtype if dtype is None else dtype).contiguous()


def lean_inputs(x_NC, weights_NK, idx_NK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x contiguous, weights in x's dtype, ids int64 (each `dense`)."""
    x = dense(x_NC)
    return x, dense(weights_NK, x.dtype), dense(idx_NK, torch.int64)


def call_kernel(fn_f32, fn_f64, name: str, x, wts, idx, buffers, E: int, I: int, hidden_act: str, beta: float,
                linear_beta: float) -> torch.Tensor:
    """One kernel call on checked inputs in the form C reads: (x, ids, weights, N, K, C, *buffers, E, I,
    activation, beta, linear_beta, out), the signature both kernels share. Returns out [N, C]."""
    N, C = x.shape
    out = x.new_empty((N, C))
    if N == 0 or C == 0:  # nothing to compute (and no buffer behind out.data_ptr())
        return out
    fn = fn_f32 if x.dtype == torch.float32 else fn_f64
    rc = fn(x.data_ptr(), idx.data_ptr(), wts.data_ptr(), N, idx.shape[1], C, *(b.data_ptr() for b in buffers), E, I,
            ACTS[hidden_act], beta, linear_beta, out.data_ptr())
    raise_for(rc, name, E)
    return out


def raise_for(rc: int, name: str, num_experts: int) -> None:
    """The kernels' return codes: 0 ok, -1 a bad expert id, -2 no memory, -3 an E8M0 NaN scale (MXFP4)."""
    if rc == -1:
        raise ValueError(f"expert ids out of range [0, {num_experts}) in the routing")
    if rc == -3:
        raise ValueError("MXFP4 scale byte 255 (E8M0 NaN) in a routed expert; refusing to produce NaN weights")
    if rc != 0:
        raise MemoryError(f"{name}: the kernel could not allocate its buffers")


experts_fused_op = opaque_op(
    "experts_fused", "(Tensor x_NC, Tensor weights_NK, Tensor idx_NK, Tensor w1_EIC, Tensor w3_EIC, Tensor w2_ECI, "
    "str hidden_act, float beta, float linear_beta) -> Tensor", experts_fused, "CPU")
