"""Chunked KDA for training and prefill: the WY form in batched matmuls, with a hand-written backward.

Legend: B batch, T time, H heads, K key dim, V value dim, C chunk size, N chunks, P sub-tiles per chunk,
L sub-tile length (C = P * L).

`kda_chunked` computes exactly what `openk3.ops.kda.kda_recurrent` computes (tests prove it in float64, outputs
and gradients) and is finite for any finite g <= 0: decays are factorised only inside 16-token sub-tiles around
a reference point, and sub-tiles whose decay is too steep for that (hard resets such as g = -1e4) are recomputed
from pairwise differences. The backward is a hand-derived `autograd.Function` (`_KDAChunkFunction`);
`kda_chunked_autograd` is the same forward differentiated by autograd, its tested twin.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from openk3.common import upcast

__all__ = ["CHUNK_SIZE", "kda_chunked"]


# Default chunk length: fwd+bwd on one CPU thread (B=1, T=512/2048, H=4..6, K=V=32/64, fp32) measured 10-30%
# faster at 32 than at 64 (smaller [C, C] work per token; the chunk loop stays short). See benchmarks/bench_kda.py.
CHUNK_SIZE = 32
_SUBTILE = 16  # longest run of tokens whose decays are factorised around one reference point


def check_inputs(q, k, v, g, beta, initial_state, doc_start) -> None:
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

def _to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, *rest] -> [B, H, N, C, *rest], zero-padding time up to a multiple of C.

    Zero padding is neutral at the end of a row: g = 0 keeps the state, beta = k = 0 writes nothing.
    """
    pad = -x.shape[1] % C
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    x = x.movedim(1, 2)
    return x.reshape(*x.shape[:2], -1, C, *x.shape[3:])


# Log-decays below this give subnormal or zero exp(); see `safe_exp`.
_EXP_FLOOR = {dt: math.log(torch.finfo(dt).tiny) + 1.0 for dt in (torch.float32, torch.float64)}  # -86.3, -707.4


def _exp_limit(dtype: torch.dtype) -> float:
    """Largest e such that a product exp(e) * exp(e), summed over K terms, stays finite in `dtype` (40.4 fp32)."""
    return 0.5 * (math.log(torch.finfo(dtype).max) - 8.0)


def safe_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for x <= ~0, with x floored just above the subnormal range.

    On CPU, exp of an argument whose result is subnormal or underflows takes a slow scalar path (~50x slower,
    measured on this project's CPU, flush-denormal or not); chunk-wide decays of K3's gate reach -300, so this
    matters. The floor changes a result of at most ~1e-37 (fp32) / ~1e-307 (fp64) into about that value.
    """
    return x.clamp(min=_EXP_FLOOR[x.dtype]).exp_()  # in place: one fewer full-size buffer (autograd-safe)


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
    ek_ZLLK = safe_exp(diff_ZLLK) * k_ZLK.unsqueeze(-3)
    return (k_ZLK.unsqueeze(-2) * ek_ZLLK).sum(-1), (q_ZLK.unsqueeze(-2) * ek_ZLLK).sum(-1)


def _tile_bounds(G_BHNCK: torch.Tensor, L: int):
    """Per sub-tile decay bounds of the chunk-cumulative log-decay G [B, H, N, C, K] (L divides C).

    Returns (end [.., P, K] decay at each tile's end, ref [.., P, K] decay just before it, steep [.., P] bool:
    tiles whose decay span is too wide to factorise around its middle in the dtype).
    """
    *lead, C, K = G_BHNCK.shape
    end_PK = G_BHNCK.reshape(*lead, C // L, L, K)[..., -1, :]
    ref_PK = F.pad(end_PK[..., :-1, :], (0, 0, 1, 0))
    return end_PK, ref_PK, (ref_PK - end_PK).amax(-1) > 2 * _exp_limit(G_BHNCK.dtype)


def _intra_chunk_scores(q_BHNCK, k_BHNCK, G_BHNCK, L: int, saved: dict | None = None):
    """Decayed key-key and query-key scores inside each chunk, never forming an exp that can overflow.

    Args:
        q_BHNCK, k_BHNCK: scaled queries and keys, chunked.
        G_BHNCK: cumulative log-decay from the chunk start (inclusive), <= 0 and non-increasing in C.
        L: sub-tile length, divides C.
        saved: if a dict, the factors the hand-written backward reuses are stored in it (only valid when no
            tile is steep; see `_scores_backward` for their names).

    Returns:
        [B, H, N, 2C, C]: rows [:C] key-key, rows [C:] query-key scores; entry [i, j] is
        sum_d {k_i | q_i}[d] k_j[d] exp(G_i[d] - G_j[d]) for j <= i, finite garbage above the diagonal.
    """
    *lead, C, K = k_BHNCK.shape
    P = C // L
    q_t, k_t, G_t = (x.reshape(*lead, P, L, K) for x in (q_BHNCK, k_BHNCK, G_BHNCK))
    end_PK, ref_PK, steep_P = _tile_bounds(G_BHNCK, L)
    lim = _exp_limit(G_BHNCK.dtype)

    # Same tile: exp(G_i - G_j) = exp(G_i - mid) * exp(mid - G_j) around the tile's mid decay keeps both factors
    # within exp(+-span/2); K3's gate (> -5) bounds span/2 by 16 * 5 / 2 = 40 < lim, so this is the path that
    # runs. One [2C, K] x [K, C] matmul per chunk is cheaper on CPU than P small per-tile ones; its entries across
    # tiles mix references (finite garbage) and are replaced below.
    rel = (G_t - (0.5 * (ref_PK + end_PK)).unsqueeze(-2)).flatten(-3, -2)
    any_steep = bool(steep_P.any())
    if any_steep:
        rel = rel.clamp(-lim, lim)  # keeps steep tiles finite; they are recomputed exactly below
    # |rel| <= lim keeps exp(rel) in [exp(-lim), exp(lim)], far from fp32's subnormals, so the second factor is
    # a reciprocal (cheaper than a second exp, within an ulp of exp(-rel)).
    up = rel.exp()
    down = up.reciprocal()
    rows2 = torch.cat([k_BHNCK * up, q_BHNCK * up], dim=-2)  # [.., 2C, K]
    kdown = k_BHNCK * down
    scores = rows2 @ kdown.mT
    if saved is not None:
        saved.update(up=up, down=down, rows2=rows2, kdown=kdown)
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
    # small [P, P', K] tensor. Only
    # query tiles p >= 1 and key tiles p' <= P-2 are computed.
    left_PLK = safe_exp(G_t[..., 1:, :, :] - ref_PK[..., 1:, None, :])
    eout_PLK = safe_exp(end_PK[..., :-1, None, :] - G_t[..., :-1, :, :])
    # Zero (not garbage) for p' >= p, so the off-tile product is exactly zero on and above the block diagonal
    # and can be added to the block-diagonal scores instead of selected with where().
    after_PP1 = torch.ones(P - 1, P - 1, dtype=k_t.dtype, device=k_t.device).tril().unsqueeze(-1)
    mid_PPK = safe_exp((ref_PK[..., 1:, None, :] - end_PK[..., None, :-1, :]).clamp(max=0.0)) * after_PP1
    right_PCK = (mid_PPK.unsqueeze(-2) * (k_t[..., :-1, :, :] * eout_PLK).unsqueeze(-4)).flatten(-3, -2)
    # One matmul for both kinds of score: rows are [L key rows | L query rows] of each query tile.
    rows = torch.cat([k_t[..., 1:, :, :] * left_PLK, q_t[..., 1:, :, :] * left_PLK], dim=-2)
    if saved is not None:
        saved.update(left=left_PLK, eout=eout_PLK, mid=mid_PPK, right=right_PCK, rows=rows)
    off = (rows @ right_PCK.mT).unflatten(-2, (2, L)).transpose(-4, -3)  # [.., 2, P-1, L, (P-1)L]
    off = F.pad(off.flatten(-3, -2), (0, L, L, 0)).flatten(-3, -2)  # [.., 2C, C], zero outside p' < p
    block_eye = torch.eye(P, dtype=k_t.dtype, device=k_t.device).view(P, 1, P, 1)
    return scores.view(*lead, 2, P, L, P, L).mul_(block_eye).view_as(scores).add_(off)


def _chunk_forward(q_c, k_c, v_c, G, beta_c, state, seg, L: int, saved: dict | None = None):
    """The chunked recurrence on chunked inputs in the compute dtype (differentiable by autograd).

    Args:
        q_c, k_c: scaled queries, keys [B, H, N, C, K]; v_c [B, H, N, C, V]; beta_c [B, H, N, C].
        G: cumulative (floored) log-decay from each chunk start, inclusive [B, H, N, C, K].
        state: [B*H, K, V] state before the first chunk.
        seg: None, or [B, 1, N, C] long: documents started inside the chunk up to each token (0 = the document
            running at the chunk start).
        L: sub-tile length of `_intra_chunk_scores`.
        saved: if a dict, what `_chunk_backward` needs is stored in it.

    Returns:
        (o [B, H, N, C, V], final state [B*H, K, V]).
    """
    B, H, N, C, K = q_c.shape
    V = v_c.shape[-1]
    scores = _intra_chunk_scores(q_c, k_c, G, L, saved)  # [B, H, N, 2C, C]: key rows, query rows

    G_end = G[..., -1:, :]
    decay = safe_exp(G)
    eout = safe_exp(G_end - G)
    state_decay = safe_exp(G_end.squeeze(-2))  # [B, H, N, K]
    # Causal masks by tril (a fast triangular pass), not where() with a broadcast bool mask (~20x slower on CPU).
    akk, aqk = scores.split(C, dim=-2)
    akk, aqk = akk.tril(-1), aqk.tril()  # key-key strictly causal, query-key inclusive
    seg_eq = None
    if seg is not None:
        seg_eq = (seg.unsqueeze(-1) == seg.unsqueeze(-2)).to(G.dtype)  # [B, 1, N, C, C]: same document
        akk, aqk = akk * seg_eq, aqk * seg_eq
        carry = (seg == 0).to(G.dtype).unsqueeze(-1)  # tokens that read the incoming state
        decay = decay * carry
        eout = eout * (seg == seg[..., -1:]).to(G.dtype).unsqueeze(-1)  # only the last document reaches the end
        state_decay = state_decay * carry[..., -1, :]
    q_in, k_in, k_out = q_c * decay, k_c * decay, k_c * eout

    # (I + A)^-1 [beta V | beta K~] for every chunk at once, A = Diag(beta) akk; the unit diagonal is implicit.
    rhs = beta_c.unsqueeze(-1) * torch.cat([v_c, k_in], dim=-1)
    a = akk * beta_c.unsqueeze(-1)
    sol = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)

    # With sol = [u0 | w], all that follows is linear in the incoming state S: pseudo-values U = u0 - w S,
    # o = (q_in - aqk w) S + aqk u0, S' = (Diag(state_decay) - k_out^T w) S + k_out^T u0. Every chunk's
    # products are batched; only the recurrence of S' loops.
    o_local, aqk_w = (aqk @ sol).split([V, K], dim=-1)
    inject, kout_w = (k_out.mT @ sol).split([V, K], dim=-1)
    # [B*H, N, ...] views (no permuted copies): baddbmm takes any batch stride.
    transition = kout_w.neg()
    transition.diagonal(dim1=-2, dim2=-1).add_(state_decay)  # not diag_embed: no [K, K] zero fill and subtract
    transition = transition.view(B * H, N, K, K)
    inject = inject.reshape(B * H, N, K, V)
    states = []
    # unbind, not indexing: one backward node instead of N full-size scatters.
    for transition_n, inject_n in zip(transition.unbind(1), inject.unbind(1)):
        states.append(state)
        state = torch.baddbmm(inject_n, transition_n, state)
    states_BHNKV = torch.stack(states, dim=1).view(B, H, N, K, V)
    q_eff = q_in - aqk_w
    o = q_eff @ states_BHNKV + o_local
    if saved is not None:
        saved.update(decay=decay, eout_c=eout, state_decay=state_decay, q_in=q_in, k_in=k_in,
                     k_out=k_out, akk=akk, aqk=aqk, a=a, sol=sol, transition=transition, states=states_BHNKV,
                     q_eff=q_eff)
        if seg_eq is not None:
            saved.update(seg_eq=seg_eq)
    return o, state


# Hand-derived backward of the chunked form, batched over chunks; ".." below is [B, H, N].
# Per chunk, with incoming state S, the forward is (A strictly lower, M = I + A unit lower triangular):
#     A = Diag(beta) akk,  U = M^-1 Diag(beta) (V - K_in S),  o = Q_in S + aqk U,  S' = Diag(sd) S + K_out^T U.
# Given dO and dS' this gives, with R = Diag(beta)(V - K_in S):
#     dU = aqk^T dO + K_out dS',  dR = M^-T dU  (a second unit triangular solve, now upper),
#     dA = -dR U^T,  daqk = dO U^T,  dQ_in = dO S^T,  dK_in = -Diag(beta) dR S^T,  dK_out = U dS'^T,
#     dS = (Q_in - aqk M^-1 Diag(beta) K_in)^T dO + (Diag(sd) - K_out^T M^-1 Diag(beta) K_in)^T dS'.
# The last line is the only sequential part: one baddbmm per chunk, in reverse. Every other product is batched
# over all chunks once the dS' of every chunk is known. Nothing of size [C, C, K] is formed: the decayed scores
# are differentiated with the same sub-tile factorisation (and factors saved by) the forward, and the gradient
# with respect to the log-decay uses that every score term x_i k_j exp(G_i - G_j) gives
# dG_i = x_i * dx_i and dG_j = -k_j * dk_j (elementwise in the key dimension).


def _scores_backward(s: dict, dakk: torch.Tensor, daqk: torch.Tensor, L: int):
    """Backward of `_intra_chunk_scores` when no sub-tile is steep. Overwrites dakk and daqk.

    Args:
        s: the forward's saved factors: q, k [.., C, K] (scaled queries, keys); up, down [.., C, K]
            (exp(+-(G - tile mid))); rows2 = [k * up | q * up] [.., 2C, K]; kdown = k * down; and when P > 1:
            left [.., P-1, L, K] (exp(G - tile start), tiles 1..P-1), eout [.., P-1, L, K] (exp(tile end - G),
            tiles 0..P-2), mid [.., P-1, P-1, K] (exp(start of tile p - end of tile p')), right
            [.., P-1, (P-1)L, K] (mid * k * eout per query tile) and rows [.., P-1, 2L, K] (k * left | q * left).
        dakk, daqk: [.., C, C] gradients of the key-key and query-key scores, zero outside the used entries.
        L: sub-tile length.

    Returns:
        (dq [.., C, K], dk [.., C, K], dG [.., C, K]).
    """
    q, k, rows2 = s["q"], s["k"], s["rows2"]
    C = k.shape[-2]
    P = C // L
    if P > 1:
        # Query tile p >= 1 against key tile p' <= P-2, laid out as the forward's off-tile product (taken
        # before the block-diagonal masking below overwrites dakk and daqk).
        d_off = torch.cat([d[..., L:, : C - L].unflatten(-2, (P - 1, L)) for d in (dakk, daqk)], dim=-2)
        # Entries with key tile p' >= p need no masking: the forward's right (and mid) factors are zero there.
        same = torch.eye(P, dtype=k.dtype, device=k.device).view(P, 1, P, 1)
        for d in (dakk, daqk):
            d.view(*d.shape[:-2], P, L, P, L).mul_(same)
    # Same tile: scores = rows2 @ kdown^T restricted to the block diagonal.
    d_rows_k = (dakk @ s["kdown"]).mul_(s["up"])
    d_rows_q = (daqk @ s["kdown"]).mul_(s["up"])
    d_cols = dakk.mT @ rows2[..., :C, :]
    d_cols += daqk.mT @ rows2[..., C:, :]
    d_cols.mul_(s["down"])
    if P > 1:
        d_rows_off = (d_off @ s["right"]).unflatten(-2, (2, L)).mul_(s["left"].unsqueeze(-3))  # [.., P-1, 2, L, K]
        d_rows_k.unflatten(-2, (P, L))[..., 1:, :, :] += d_rows_off[..., 0, :, :]
        d_rows_q.unflatten(-2, (P, L))[..., 1:, :, :] += d_rows_off[..., 1, :, :]
        d_right = (d_off.mT @ s["rows"]).unflatten(-2, (P - 1, L))  # [.., P-1 (p), P-1 (p'), L, K]
        d_right = d_right.mul_(s["mid"].unsqueeze(-2)).sum(-4)  # through right = mid * (k * eout)
        d_cols.unflatten(-2, (P, L))[..., :-1, :, :] += d_right.mul_(s["eout"])
    dk = d_rows_k + d_cols
    dG = d_rows_k.sub_(d_cols).mul_(k).addcmul_(q, d_rows_q)
    return d_rows_q, dk, dG


def _chunk_backward(s: dict, do_BHNCV: torch.Tensor, dstate_BHKV: torch.Tensor, L: int):
    """Backward of `_chunk_forward` (no steep sub-tile) from its saved tensors.

    In-place updates of fresh temporaries throughout: on CPU an elementwise pass over a tensor larger than L2
    costs about 3x more when it writes a new buffer.

    Args:
        s: the forward's saved tensors (`_chunk_forward(..., saved=s)` plus q, k, v, beta, the chunked inputs).
        do_BHNCV: gradient of the chunked output [B, H, N, C, V].
        dstate_BHKV: gradient of the final state [B, H, K, V].
        L: sub-tile length.

    Returns:
        (dq, dk [B, H, N, C, K], dv [B, H, N, C, V], dG [B, H, N, C, K] w.r.t. the cumulative log-decay,
        dbeta [B, H, N, C], dstate0 [B, H, K, V]).
    """
    q, v, beta, states, seg_eq = s["q"], s["v"], s["beta"], s["states"], s.get("seg_eq")
    B, H, N, C, K = q.shape
    V = v.shape[-1]

    # Reverse-time state gradients: dS_n = E_n + T_n^T dS_{n+1}, E_n = q_eff_n^T dO_n batched beforehand.
    E = (s["q_eff"].mT @ do_BHNCV).view(B * H, N, K, V)
    trans_T = s["transition"].mT  # [B*H, N, K, K]
    d_state = dstate_BHKV.reshape(B * H, K, V)
    d_next = [d_state] * N  # d_next[n]: gradient w.r.t. the state leaving chunk n
    for n in range(N - 1, 0, -1):
        d_state = torch.baddbmm(E[:, n], trans_T[:, n], d_state)
        d_next[n - 1] = d_state
    d_state0 = torch.baddbmm(E[:, 0], trans_T[:, 0], d_state)
    d_next = torch.stack(d_next, dim=1).view(B, H, N, K, V)

    u0, w = s["sol"].split([V, K], dim=-1)
    U = (w @ states).neg_().add_(u0)  # pseudo-values U = u0 - w S
    dU = s["aqk"].mT @ do_BHNCV
    dU += s["k_out"] @ d_next
    dR = torch.linalg.solve_triangular(s["a"].mT, dU, upper=True, unitriangular=True)
    dv = dR * beta.unsqueeze(-1)
    dq_in = do_BHNCV @ states.mT
    dR_S = dR @ states.mT
    dk_in = dR_S * beta.unsqueeze(-1)  # the gradient of K_in is minus this
    dA = (dR @ U.mT).tril_(-1)  # minus the gradient of A (strictly lower)
    daqk = (do_BHNCV @ U.mT).tril_()
    if seg_eq is not None:
        dA.mul_(seg_eq)
        daqk.mul_(seg_eq)
    dk_out = U @ d_next.mT
    # beta enters R = Diag(beta)(V - K_in S) and A = Diag(beta) akk; sum_v dR (K_in S) = sum_k K_in (dR S^T).
    dbeta = (dR * v).sum(-1) - (dR_S.mul_(s["k_in"])).sum(-1) - (dA * s["akk"]).sum(-1)
    dakk = dA.mul_(beta.neg().unsqueeze(-1))

    dq, dk, dG = _scores_backward(s, dakk, daqk, L)
    decay = s["decay"]
    dq.addcmul_(dq_in, decay)
    dk.addcmul_(dk_out, s["eout_c"]).addcmul_(dk_in, decay, value=-1.0)
    dG.addcmul_(dq_in, s["q_in"]).addcmul_(dk_in, s["k_in"], value=-1.0)
    k_out_dk_out = dk_out.mul_(s["k_out"])
    dG -= k_out_dk_out
    # G_end enters k_out (exp(G_end - G)) and the state decay (exp(G_end)).
    dG[..., -1, :] += k_out_dk_out.sum(-2).addcmul_((states * d_next).sum(-1), s["state_decay"])
    return dq, dk, dv, dG, dbeta, d_state0.view(B, H, K, V)


class _KDAChunkFunction(torch.autograd.Function):
    """`_chunk_forward` with the hand-derived backward `_chunk_backward` (no steep sub-tile).

    Autograd through the chunked form saves and replays dozens of [B, H, N, C, K]-sized elementwise steps and
    their broadcast masks; here the backward reuses the forward's factors and runs about as many batched matmuls
    as the forward. Inputs are the chunked tensors in the compute dtype; G is the detached cumulative decay of g
    (computed once by the caller, who also checked that no sub-tile is steep).
    """

    @staticmethod
    def forward(ctx, q_c, k_c, v_c, g_c, beta_c, state, G, seg, L):
        saved = {}
        o, final = _chunk_forward(q_c, k_c, v_c, G, beta_c, state, seg, L, saved)
        saved.update(q=q_c, k=k_c, v=v_c, beta=beta_c)
        floored = g_c < _EXP_FLOOR[G.dtype]  # steps whose gradient the floor of the cumulative decay stops
        if bool(floored.any()):
            saved.update(floored=floored)
        ctx.names = list(saved)
        ctx.save_for_backward(*saved.values())
        ctx.L = L
        return o, final

    @staticmethod
    @once_differentiable
    def backward(ctx, do, dstate):
        s = dict(zip(ctx.names, ctx.saved_tensors))
        B, H, N, C, K = s["q"].shape
        if do is None:
            do = s["q"].new_zeros(B, H, N, C, s["v"].shape[-1])
        if dstate is None:
            dstate = s["q"].new_zeros(B * H, K, s["v"].shape[-1])
        dq, dk, dv, dG, dbeta, dstate0 = _chunk_backward(s, do.contiguous(), dstate.reshape(B, H, K, -1), ctx.L)
        # G = cumsum(clamp(g, floor)): dg is the reversed cumulative sum of dG, zero where the floor was active.
        dg = dG.cumsum(-2)
        dg = torch.sub(dg[..., -1:, :], dg).add_(dG)
        if "floored" in s:
            dg.masked_fill_(s["floored"], 0.0)
        return dq, dk, dv, dg, dbeta, dstate0.reshape(B * H, K, -1), None, None, None


def _kda_chunked_impl(q, k, v, g, beta, *, scale, initial_state, doc_start, chunk_size, custom_backward):
    check_inputs(q, k, v, g, beta, initial_state, doc_start)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    B, T, H, K = q.shape
    V, C = v.shape[-1], chunk_size
    out_dtype, dt = q.dtype, upcast(q).dtype
    q_c, k_c, v_c, g_c, beta_c = (_to_chunks(x.to(dt), C) for x in (q * scale, k, v, g, beta))
    L = math.gcd(C, _SUBTILE)
    state = q_c.new_zeros(B * H, K, V) if initial_state is None else initial_state.to(dt).reshape(B * H, K, V)
    # seg = documents started inside the chunk so far; 0 is the document that was running at the chunk start.
    seg = None if doc_start is None else _to_chunks(doc_start[:, :, None].long(), C).cumsum(-1)  # [B, 1, N, C]

    # Floor each step where exp() already flushes to ~0 (as `safe_exp` does in the recurrence): a -1e4 step stays a
    # full reset but no longer inflates |G|, whose fp32 rounding (ulp(|G|)) sets the error of every exp(G_i - G_j).
    def cumulative_decay(g_c):
        return g_c.clamp(min=_EXP_FLOOR[dt]).cumsum(-2)  # decay since the chunk start, inclusive; <= 0

    if custom_backward:
        with torch.no_grad():
            G = cumulative_decay(g_c)
        # Steep sub-tiles (only from pathological g, e.g. -1e4 resets) take the exact pairwise path, whose
        # backward is left to autograd.
        custom_backward = not bool(_tile_bounds(G, L)[2].any())
    if custom_backward:
        o, state = _KDAChunkFunction.apply(q_c, k_c, v_c, g_c, beta_c, state, G, seg, L)
    else:
        o, state = _chunk_forward(q_c, k_c, v_c, cumulative_decay(g_c), beta_c, state, seg, L)
    o = o.reshape(B, H, -1, V)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype), state.view(B, H, K, V).to(out_dtype)


def kda_chunked(q, k, v, g, beta, *, scale: float, initial_state=None, doc_start=None, chunk_size: int = CHUNK_SIZE):
    """Chunked KDA (WY form): batched matmuls inside chunks, a Python loop only for the chunk-to-chunk state.

    Exact (same maths as `kda_recurrent`) and finite for any finite g <= 0, e.g. -1e4 steps. Differentiable,
    with a hand-derived backward (`_chunk_backward`) unless a sub-tile's decay is too steep to
    factorise (pathological g only), where autograd differentiates the exact fallback (`kda_chunked_autograd`).
    Within a chunk with cumulative decay G_t, pseudo-values U solve (I + A) U = Diag(beta)(V - K~ S0)
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
    return _kda_chunked_impl(q, k, v, g, beta, scale=scale, initial_state=initial_state, doc_start=doc_start,
                             chunk_size=chunk_size, custom_backward=True)


def kda_chunked_autograd(q, k, v, g, beta, *, scale: float, initial_state=None, doc_start=None,
                          chunk_size: int = CHUNK_SIZE):
    """`kda_chunked` differentiated by autograd throughout: the twin its hand-written backward is tested against."""
    return _kda_chunked_impl(q, k, v, g, beta, scale=scale, initial_state=initial_state, doc_start=doc_start,
                             chunk_size=chunk_size, custom_backward=False)
