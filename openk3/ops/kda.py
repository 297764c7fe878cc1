"""Kimi Delta Attention (KDA, spec §4.4): the gated delta rule with a per-channel decay, in pure PyTorch.

Legend: B batch, T time, H heads, K key dim, V value dim.

Per head the state S is [K, V] and every token does
    S <- Diag(exp(g_t)) S ;  u = S^T k_t ;  S <- S + k_t (beta_t (v_t - u))^T ;  o_t = S^T (scale * q_t)
i.e. S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T, read after the update.

Three exact forms share one calling convention: `kda_recurrent` (the token loop, the reference),
`kda_chunked` (matmul-based, for training and prefill; in `kda_chunked.py`) and `kda_step` (one decode token).
`kda` picks fla's Triton kernel (`backend`; by default on CUDA when fla is importable), else `kda_chunked`.
q and k must already be L2-normalised; nothing here normalises.
Computation runs in float32, or float64 for float64 inputs (`openk3.common.upcast`); results come back in the
dtype of q. `doc_start[b, t]` True resets the state to zero just before token t (packed documents).
"""

from __future__ import annotations

import torch

from openk3.common import upcast
from openk3.ops.kda_chunked import (  # noqa: F401  (CHUNK_SIZE, kda_chunked_autograd: re-exported)
    CHUNK_SIZE,
    check_inputs,
    kda_chunked,
    kda_chunked_autograd,
    safe_exp,
)

__all__ = ["CHUNK_SIZE", "kda", "kda_chunked", "kda_recurrent", "kda_step", "kda_step_", "kda_step_fused_"]


def _delta_step(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV):
    """One token of the recurrence on already-scaled q; all in the compute dtype. Returns (o_BHV, state_BHKV)."""
    state_BHKV = state_BHKV * safe_exp(g_BHK).unsqueeze(-1)
    u_BHV = torch.einsum("bhk,bhkv->bhv", k_BHK, state_BHKV)
    state_BHKV = state_BHKV + k_BHK.unsqueeze(-1) * (beta_BH.unsqueeze(-1) * (v_BHV - u_BHV)).unsqueeze(-2)
    return torch.einsum("bhk,bhkv->bhv", q_BHK, state_BHKV), state_BHKV


def kda_step(q, k, v, g, beta, *, scale: float, state: torch.Tensor):
    """One decode step; continues a state from `kda_recurrent`, `kda_chunked` or `kda` exactly.

    Args:
        q: queries [B, H, K], L2-normalised.
        k: keys [B, H, K], L2-normalised.
        v: values [B, H, V].
        g: log-decay [B, H, K], <= 0.
        beta: write strength [B, H], in (0, 1).
        scale: multiplies q (K ** -0.5 in K3).
        state: [B, H, K, V] state before this token.

    Returns:
        (o [B, H, V] in q's dtype, new state [B, H, K, V] in `state`'s dtype).
    """
    dt = upcast(q).dtype
    o, new_state = _delta_step(q.to(dt) * scale, k.to(dt), v.to(dt), g.to(dt), beta.to(dt), state.to(dt))
    return o.to(q.dtype), new_state.to(state.dtype)


def kda_step_(q, k, v, g, beta, *, scale: float, state: torch.Tensor) -> torch.Tensor:
    """`kda_step` updating `state` [B, H, K, V] in place (decode; no autograd). Returns o [B, H, V] in q's dtype.

    `state` must be contiguous and already in the compute dtype (fp32, or float64).
    """
    B, H, K = q.shape
    V = v.shape[-1]
    dt = state.dtype
    assert state.is_contiguous() and dt == upcast(q).dtype, "decode state must be contiguous fp32/float64"
    if torch.compiler.is_compiling():
        return kda_step_fused_(q, k, v, g, beta, scale=scale, state=state)
    S_NKV = state.view(B * H, K, V)
    S_NKV.mul_(safe_exp(g.to(dt)).reshape(B * H, K, 1))
    k_N1K = k.to(dt).reshape(B * H, 1, K)
    u_N1V = torch.bmm(k_N1K, S_NKV)
    d_N1V = beta.to(dt).reshape(B * H, 1, 1) * (v.to(dt).reshape(B * H, 1, V) - u_N1V)
    S_NKV.baddbmm_(k_N1K.transpose(1, 2), d_N1V)
    o_N1V = torch.bmm(q.to(dt).reshape(B * H, 1, K) * scale, S_NKV)
    return o_N1V.view(B, H, V).to(q.dtype)


def _materialized(x: torch.Tensor) -> torch.Tensor:
    """`x` itself (a view of all of it). Under torch.compile, inductor stores `x` in a buffer here rather than
    inlining its expression into every loop that reads it (`as_strided` needs storage): the state loops then
    load q and k instead of redoing their L2 norm's rsqrt for every state element they touch."""
    return x.as_strided(x.shape, x.stride())


def kda_step_fused_(q, k, v, g, beta, *, scale: float, state: torch.Tensor) -> torch.Tensor:
    """`kda_step_` written as broadcasts and sums instead of batched matmuls: what a compiled decode
    step uses (`kda_step_` picks it under torch.compile). The state [B, H, K, V] dominates a batched
    decode step's traffic (16 rows x 4 heads x 32 x 32 fp32 = 256 KiB per layer at nano), so the
    compiler gets two passes over it: one reads the decayed state D S for u = (D S)^T k and
    (D S)^T q' together, one writes S <- D S + k d^T in place. The output needs no third pass:
    o = S_new^T q' = (D S)^T q' + (k . q') d, with q' = scale q. Same contract as `kda_step_`."""
    dt = state.dtype
    qk_2BHK = _materialized(torch.stack([q.to(dt) * scale, k.to(dt)]))
    q_BHK, k_BHK = qk_2BHK[0], qk_2BHK[1]
    decayed_BHKV = state * safe_exp(g.to(dt))[..., None]
    u_BHV = (k_BHK[..., None] * decayed_BHKV).sum(-2)
    o_BHV = (q_BHK[..., None] * decayed_BHKV).sum(-2)
    d_BHV = beta.to(dt)[..., None] * (v.to(dt) - u_BHV)
    state.copy_(decayed_BHKV + k_BHK[..., None] * d_BHV[..., None, :])
    o_BHV = o_BHV + (q_BHK * k_BHK).sum(-1, keepdim=True) * d_BHV
    return o_BHV.to(q.dtype)


def kda_recurrent(q, k, v, g, beta, *, scale: float, initial_state=None, doc_start=None):
    """Reference KDA: the token-by-token loop (slow, obviously correct, differentiable by autograd).

    Args:
        q: queries [B, T, H, K], L2-normalised.
        k: keys [B, T, H, K], L2-normalised.
        v: values [B, T, H, V].
        g: per-channel log-decay [B, T, H, K], <= 0 and finite (large negative values are fine).
        beta: write strength [B, T, H], in (0, 1).
        scale: multiplies q.
        initial_state: [B, H, K, V] state before the first token, or None for zeros. It only reaches the
            tokens before the row's first `doc_start`.
        doc_start: optional bool [B, T]; True where a new document starts (state reset to zero before it).

    Returns:
        (o [B, T, H, V], final state [B, H, K, V]), both in q's dtype.
    """
    check_inputs(q, k, v, g, beta, initial_state, doc_start)
    B, T, H, K = q.shape
    out_dtype, dt = q.dtype, upcast(q).dtype
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    q = q * scale
    state = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(T):
        if doc_start is not None:
            # where() rather than a multiply, so a reset never lets 0 * inf = NaN through.
            state = torch.where(doc_start[:, t, None, None, None], torch.zeros_like(state), state)
        o_t, state = _delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o_t)
    return torch.stack(outs, dim=1).to(out_dtype), state.to(out_dtype)



def kda(q, k, v, g, beta, *, scale: float, initial_state=None, doc_start=None, chunk_size: int = CHUNK_SIZE,
        backend: str | None = None):
    """KDA for training and prefill: fla's fused `chunk_kda` or `kda_chunked`, by `backend`.

    `backend`: "auto" (fla on CUDA when fla imports, else chunked), "fla" or "chunked"; None reads
    `OPENK3_KDA_BACKEND` (`openk3.ops.fla_kernels`: fla on CPU tensors runs under Triton's interpreter).
    fla is called with pre-normalised q/k, log-space g, post-sigmoid beta and its default [K, V] state layout,
    which are our conventions; packed documents become `cu_seqlens` sequences. fla is imported lazily, on the
    first call that uses it, and never for float64 (its kernels do not take it). Arguments and result as
    `kda_chunked` (`chunk_size` applies to `kda_chunked` only; fla uses its own).
    """
    from openk3.ops import fla_kernels  # light: fla itself is imported only when used

    if not fla_kernels.use_fla(backend, q):
        return kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, doc_start=doc_start,
                           chunk_size=chunk_size)
    check_inputs(q, k, v, g, beta, initial_state, doc_start)
    o, final = fla_kernels.chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, doc_start=doc_start)
    return o.to(q.dtype), final.to(q.dtype)
