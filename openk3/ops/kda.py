"""Kimi Delta Attention (KDA, spec §4.4): the gated delta rule with a per-channel decay, in pure PyTorch.

Legend: B batch, T time, H heads, K key dim, V value dim, C chunk size, N chunks, P sub-tiles per chunk,
L sub-tile length (C = P * L).

Per head the state S is [K, V] and every token does
    S <- Diag(exp(g_t)) S ;  u = S^T k_t ;  S <- S + k_t (beta_t (v_t - u))^T ;  o_t = S^T (scale * q_t)
i.e. S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T, read after the update.

Three exact forms share one calling convention: `kda_recurrent` (the token loop, the reference), `kda_chunked`
(matmul-based, for training and prefill) and `kda_step` (one decode token). `kda` picks fla's Triton kernel on
CUDA when fla is importable, else `kda_chunked`. q and k must already be L2-normalised; nothing here normalises.
Computation runs in float32, or float64 for float64 inputs (`openk3.common.upcast`); results come back in the
dtype of q. `doc_start[b, t]` True resets the state to zero just before token t (packed documents).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from openk3.common import upcast

__all__ = ["kda", "kda_chunked", "kda_recurrent", "kda_step"]

_SUBTILE = 16  # longest run of tokens whose decays are factorised around one reference point


def _check_inputs(q, k, v, g, beta, initial_state, doc_start) -> None:
    B, T, H, K = q.shape
    if T < 1:
        raise ValueError("KDA needs at least one token (T >= 1)")
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share shape [B, T, H, K]; got {q.shape}, {k.shape}, {g.shape}")
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"v must be [B, T, H, V] and beta [B, T, H]; got {v.shape}, {beta.shape}")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, H, K, V]; got {initial_state.shape}")
    if doc_start is not None and (doc_start.shape != (B, T) or doc_start.dtype != torch.bool):
        raise ValueError(f"doc_start must be a bool [B, T] tensor; got {doc_start.dtype} {doc_start.shape}")


def _delta_step(q_BHK, k_BHK, v_BHV, g_BHK, beta_BH, state_BHKV):
    """One token of the recurrence on already-scaled q; all in the compute dtype. Returns (o_BHV, state_BHKV)."""
    state_BHKV = state_BHKV * _exp(g_BHK).unsqueeze(-1)
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
    _check_inputs(q, k, v, g, beta, initial_state, doc_start)
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


def _to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, *rest] -> [B, H, N, C, *rest], zero-padding time up to a multiple of C.

    Zero padding is neutral at the end of a row: g = 0 keeps the state, beta = k = 0 writes nothing.
    """
    pad = -x.shape[1] % C
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    x = x.movedim(1, 2)
    return x.reshape(*x.shape[:2], -1, C, *x.shape[3:])


# Log-decays below this give subnormal or zero exp(); see `_exp`.
_EXP_FLOOR = {dt: math.log(torch.finfo(dt).tiny) + 1.0 for dt in (torch.float32, torch.float64)}  # -86.3, -707.4


def _exp_limit(dtype: torch.dtype) -> float:
    """Largest e such that a product exp(e) * exp(e), summed over K terms, stays finite in `dtype` (40.4 fp32)."""
    return 0.5 * (math.log(torch.finfo(dtype).max) - 8.0)


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for x <= ~0, with x floored just above the subnormal range.

    On CPU, exp of an argument whose result is subnormal or underflows takes a slow scalar path (~50x slower,
    measured on this project's CPU, flush-denormal or not); chunk-wide decays of K3's gate reach -300, so this
    matters. The floor changes a result of at most ~1e-37 (fp32) / ~1e-307 (fp64) into about that value.
    """
    return x.clamp(min=_EXP_FLOOR[x.dtype]).exp()


def _block_diagonal(x_PLL: torch.Tensor) -> torch.Tensor:
    """[..., P, L, L] diagonal blocks -> the [..., P*L, P*L] block-diagonal matrix."""
    P, L = x_PLL.shape[-3], x_PLL.shape[-1]
    if P == 1:
        return x_PLL.squeeze(-3)
    eye_P1P1 = torch.eye(P, dtype=x_PLL.dtype, device=x_PLL.device).view(P, 1, P, 1)
    return (x_PLL.unsqueeze(-2) * eye_P1P1).reshape(*x_PLL.shape[:-3], P * L, P * L)


def _pairwise_tiles(q_ZLK, k_ZLK, G_ZLK):
    """Exact [Z, L, L] tile scores sum_d x_i k_j exp(G_i - G_j) for j <= i, from pairwise differences."""
    # Clamped at 0 *before* exp: for j > i the difference is a growth that could overflow (entries unused).
    diff_ZLLK = (G_ZLK.unsqueeze(-2) - G_ZLK.unsqueeze(-3)).clamp(max=0.0)
    ek_ZLLK = _exp(diff_ZLLK) * k_ZLK.unsqueeze(-3)
    return (k_ZLK.unsqueeze(-2) * ek_ZLLK).sum(-1), (q_ZLK.unsqueeze(-2) * ek_ZLLK).sum(-1)


def _intra_chunk_scores(q_BHNCK, k_BHNCK, G_BHNCK, L: int):
    """Decayed key-key and query-key scores inside each chunk, never forming an exp that can overflow.

    Args:
        q_BHNCK, k_BHNCK: scaled queries and keys, chunked.
        G_BHNCK: cumulative log-decay from the chunk start (inclusive), <= 0 and non-increasing in C.
        L: sub-tile length, divides C.

    Returns:
        [B, H, N, 2C, C]: rows [:C] key-key, rows [C:] query-key scores; entry [i, j] is
        sum_d {k_i | q_i}[d] k_j[d] exp(G_i[d] - G_j[d]) for j <= i, finite garbage above the diagonal.
    """
    *lead, C, K = k_BHNCK.shape
    P = C // L
    q_t, k_t, G_t = (x.reshape(*lead, P, L, K) for x in (q_BHNCK, k_BHNCK, G_BHNCK))
    end_PK = G_t[..., -1, :]  # decay at the end of each tile
    ref_PK = F.pad(end_PK[..., :-1, :], (0, 0, 1, 0))  # decay just before each tile
    lim = _exp_limit(G_BHNCK.dtype)

    # Same tile: exp(G_i - G_j) = exp(G_i - mid) * exp(mid - G_j) around the tile's mid decay keeps both factors
    # within exp(+-span/2); K3's gate (> -5) bounds span/2 by 16 * 5 / 2 = 40 < lim, so this is the path that
    # runs. One [2C, K] x [K, C] matmul per chunk is cheaper on CPU than P small per-tile ones; its entries across
    # tiles mix references (finite garbage) and are replaced below.
    rel = (G_t - (0.5 * (ref_PK + end_PK)).unsqueeze(-2)).flatten(-3, -2)
    steep_P = (ref_PK - end_PK).amax(-1) > 2 * lim
    any_steep = bool(steep_P.any())
    if any_steep:
        rel = rel.clamp(-lim, lim)  # keeps steep tiles finite; they are recomputed exactly below
    up = rel.exp()
    scores = torch.cat([k_BHNCK * up, q_BHNCK * up], dim=-2) @ (k_BHNCK * rel.neg().exp()).mT
    tile_C = torch.arange(C, device=k_t.device) // L
    same_tile_CC = tile_C[:, None] == tile_C[None, :]
    if any_steep:  # pathological decays (hard resets through g): exact pairwise form for those tiles only
        idx = steep_P.reshape(-1).nonzero().squeeze(-1)
        zeros = k_t.new_zeros(steep_P.numel(), L, L)
        pair = [_block_diagonal(zeros.index_copy(0, idx, x).view(*lead, P, L, L))
                for x in _pairwise_tiles(*(x.reshape(-1, L, K)[idx] for x in (q_t, k_t, G_t)))]
        steep_CC = steep_P.repeat_interleave(L, dim=-1).unsqueeze(-1) & same_tile_CC
        scores = torch.where(steep_CC.repeat(*([1] * len(lead)), 2, 1), torch.cat(pair, dim=-2), scores)
    if P == 1:
        return scores

    # Query tile p > key tile p': exp(G_i - G_j) = exp(G_i - ref_p) * exp(ref_p - end_p') * exp(end_p' - G_j),
    # three factors <= 1, so nothing overflows and underflow only drops what is tiny. The middle factor is a
    # small [P, P', K] tensor; for p' >= p it is clamped to 1 (finite garbage, masked by the caller). Only
    # query tiles p >= 1 and key tiles p' <= P-2 are computed.
    left_PLK = _exp(G_t[..., 1:, :, :] - ref_PK[..., 1:, None, :])
    right_PLK = k_t[..., :-1, :, :] * _exp(end_PK[..., :-1, None, :] - G_t[..., :-1, :, :])
    mid_PPK = _exp((ref_PK[..., 1:, None, :] - end_PK[..., None, :-1, :]).clamp(max=0.0))
    right_PCK = (mid_PPK.unsqueeze(-2) * right_PLK.unsqueeze(-4)).flatten(-3, -2)
    # One matmul for both kinds of score: rows are [L key rows | L query rows] of each query tile.
    rows = torch.cat([k_t[..., 1:, :, :] * left_PLK, q_t[..., 1:, :, :] * left_PLK], dim=-2)
    off = (rows @ right_PCK.mT).unflatten(-2, (2, L)).transpose(-4, -3)  # [.., 2, P-1, L, (P-1)L]
    off = F.pad(off.flatten(-3, -2), (0, L, L, 0)).flatten(-3, -2)  # [.., 2C, C]
    return torch.where(same_tile_CC.repeat(2, 1), scores, off)


def kda_chunked(q, k, v, g, beta, *, scale: float, initial_state=None, doc_start=None, chunk_size: int = 64):
    """Chunked KDA (WY form): batched matmuls inside chunks, a Python loop only for the chunk-to-chunk state.

    Exact (same maths as `kda_recurrent`) and finite for any finite g <= 0, e.g. -1e4 steps. Differentiable by
    autograd. Within a chunk with cumulative decay G_t, pseudo-values U solve (I + A) U = Diag(beta)(V - K~ S0)
    with A_ij = beta_i sum_d k_i k_j exp(G_i - G_j) (j < i, same document) and K~_t = k_t * exp(G_t).

    Args:
        q, k: [B, T, H, K], L2-normalised.
        v: [B, T, H, V].
        g: log-decay [B, T, H, K], <= 0 and finite.
        beta: [B, T, H], in (0, 1).
        scale: multiplies q.
        initial_state: [B, H, K, V] or None (zeros); reaches only the tokens before the row's first doc_start.
        doc_start: optional bool [B, T]; True resets the state to zero just before that token.
        chunk_size: tokens per chunk C; T need not be a multiple of it.

    Returns:
        (o [B, T, H, V], final state [B, H, K, V]), both in q's dtype.
    """
    _check_inputs(q, k, v, g, beta, initial_state, doc_start)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    B, T, H, K = q.shape
    V, C = v.shape[-1], chunk_size
    out_dtype, dt = q.dtype, upcast(q).dtype
    q_c, k_c, v_c, g_c, beta_c = (_to_chunks(x.to(dt), C) for x in (q * scale, k, v, g, beta))
    N = q_c.shape[2]
    # Floor each step where exp() already flushes to ~0 (as `_exp` does in the recurrence): a -1e4 step stays a
    # full reset but no longer inflates |G|, whose fp32 rounding (ulp(|G|)) sets the error of every exp(G_i - G_j).
    G = g_c.clamp(min=_EXP_FLOOR[dt]).cumsum(-2)  # decay since the chunk start, inclusive; <= 0
    scores = _intra_chunk_scores(q_c, k_c, G, math.gcd(C, _SUBTILE))  # [B, H, N, 2C, C]: key rows, query rows

    causal_CC = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    mask = torch.cat([causal_CC.tril(-1), causal_CC])  # key-key strictly causal, query-key inclusive
    G_end = G[..., -1:, :]
    decay = _exp(G)
    q_in, k_in, k_out = q_c * decay, k_c * decay, k_c * _exp(G_end - G)
    state_decay = _exp(G_end.squeeze(-2))  # [B, H, N, K]
    if doc_start is not None:
        # seg = documents started inside the chunk so far; 0 is the document that was running at the chunk start.
        seg = _to_chunks(doc_start[:, :, None].long(), C).cumsum(-1)  # [B, 1, N, C]
        mask = mask & (seg.unsqueeze(-1) == seg.unsqueeze(-2)).repeat(1, 1, 1, 2, 1)
        carry = (seg == 0).to(dt).unsqueeze(-1)  # tokens that read the incoming state
        q_in, k_in = q_in * carry, k_in * carry
        k_out = k_out * (seg == seg[..., -1:]).to(dt).unsqueeze(-1)  # only the last document reaches the end
        state_decay = state_decay * carry[..., -1, :]
    akk, aqk = torch.where(mask, scores, G.new_zeros(())).split(C, dim=-2)

    # (I + A)^-1 [beta V | beta K~] for every chunk at once, A = Diag(beta) akk; the unit diagonal is implicit.
    rhs = beta_c.unsqueeze(-1) * torch.cat([v_c, k_in], dim=-1)
    sol = torch.linalg.solve_triangular(akk * beta_c.unsqueeze(-1), rhs, upper=False, unitriangular=True)

    # With sol = [u0 | w], all that follows is linear in the incoming state S: pseudo-values U = u0 - w S,
    # o = (q_in - aqk w) S + aqk u0, S' = (Diag(state_decay) - k_out^T w) S + k_out^T u0. Every chunk's
    # products are batched; only the recurrence of S' loops.
    o_local, aqk_w = (aqk @ sol).split([V, K], dim=-1)
    inject, kout_w = (k_out.mT @ sol).split([V, K], dim=-1)
    transition = (torch.diag_embed(state_decay) - kout_w).permute(2, 0, 1, 3, 4).reshape(N, B * H, K, K)
    inject = inject.permute(2, 0, 1, 3, 4).reshape(N, B * H, K, V)
    state = q_c.new_zeros(B * H, K, V) if initial_state is None else initial_state.to(dt).reshape(B * H, K, V)
    states = []
    # unbind, not indexing: one backward node instead of N full-size scatters.
    for transition_n, inject_n in zip(transition.unbind(0), inject.unbind(0)):
        states.append(state)
        state = torch.baddbmm(inject_n, transition_n, state)
    states_BHNKV = torch.stack(states).view(N, B, H, K, V).permute(1, 2, 0, 3, 4)
    o = ((q_in - aqk_w) @ states_BHNKV + o_local).reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype), state.view(B, H, K, V).to(out_dtype)


@functools.cache
def _fla_chunk_kda():
    """fla's Triton `chunk_kda`, or None when fla (or triton) is not importable. Imported lazily, once."""
    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # ImportError without triton; fla may also fail with other errors on odd platforms
        return None
    return chunk_kda


def _kda_varlen(kernel, q, k, v, g, beta, *, scale, initial_state, doc_start):
    """Run a fla-style varlen kernel (B = 1, `cu_seqlens`, one state per sequence) over packed rows.

    Every row start and every `doc_start` opens a sequence; a row's `initial_state` feeds its first sequence
    unless that row also starts with a `doc_start`; the row's final state is that of its last sequence.
    """
    B, T, H, K = q.shape
    opens_BT = doc_start.clone()
    opens_BT[:, 0] = True
    starts = opens_BT.reshape(-1).nonzero().squeeze(-1)
    cu_seqlens_cpu = torch.cat([starts.cpu(), torch.tensor([B * T])])
    per_row = opens_BT.sum(-1)
    last = per_row.cumsum(0) - 1  # index of each row's last sequence
    h0 = None
    if initial_state is not None:
        first = last - per_row + 1
        keep = ~doc_start[:, 0, None, None, None]
        h0 = initial_state.new_zeros(starts.numel(), *initial_state.shape[1:], dtype=torch.float32)
        h0 = h0.index_copy(0, first, torch.where(keep, initial_state.float(), 0.0))
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o, final = kernel(*flat, scale=scale, initial_state=h0, output_final_state=True,
                      cu_seqlens=cu_seqlens_cpu.to(q.device), cu_seqlens_cpu=cu_seqlens_cpu)
    return o.reshape(B, T, H, -1), final[last]


def kda(q, k, v, g, beta, *, scale: float, initial_state=None, doc_start=None, chunk_size: int = 64):
    """KDA for training and prefill: fla's fused `chunk_kda` on CUDA when fla is installed, else `kda_chunked`.

    fla is called with pre-normalised q/k, log-space g, post-sigmoid beta and its default [K, V] state layout,
    which are our conventions; packed documents become `cu_seqlens` sequences. fla is imported lazily, on the
    first CUDA call, and never for float64 (its kernels do not take it).

    Args:
        q, k: [B, T, H, K], L2-normalised.
        v: [B, T, H, V].
        g: log-decay [B, T, H, K], <= 0 and finite.
        beta: [B, T, H], in (0, 1).
        scale: multiplies q.
        initial_state: [B, H, K, V] or None (zeros); reaches only the tokens before the row's first doc_start.
        doc_start: optional bool [B, T]; True resets the state to zero just before that token.
        chunk_size: chunk length of the `kda_chunked` fallback (fla uses its own).

    Returns:
        (o [B, T, H, V], final state [B, H, K, V]), both in q's dtype.
    """
    kernel = _fla_chunk_kda() if q.is_cuda and q.dtype != torch.float64 else None
    if kernel is None:
        return kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, doc_start=doc_start,
                           chunk_size=chunk_size)
    _check_inputs(q, k, v, g, beta, initial_state, doc_start)
    if doc_start is None:
        h0 = None if initial_state is None else initial_state.float()  # fla asserts an fp32 initial state
        o, final = kernel(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True)
    else:
        o, final = _kda_varlen(kernel, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                               doc_start=doc_start)
    return o.to(q.dtype), final.to(q.dtype)
