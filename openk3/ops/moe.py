"""Mixture-of-experts routing and expert compute: a per-expert loop (reference) and a sorted,
grouped dispatch (fast), proven equal in tests.

Legend: N tokens, D router input width, C expert input width (latent in K3), I expert hidden width,
E experts, K experts per token (top-k), M = N * K routed rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from openk3.common import fp32_island, upcast

Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def route(x_ND: torch.Tensor, w_router_ED: torch.Tensor, bias_E: torch.Tensor, *, top_k: int,
          renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sigmoid router with a selection-only correction bias (DeepSeek-V3 `noaux_tc`, spec §4.6, §5).

    Everything is fp32 (or float64 when given float64). The bias steers *which* experts are chosen;
    the mixing weights come from the unbiased scores, renormalised over the chosen k when
    `renormalize` and k > 1. With k = 1 the weight stays the raw sigmoid score, as in the reference
    (`top_k > 1 and renormalize`, spec §4.6): renormalising would make it exactly 1 and drop the score's
    scale (and its gradient into the router).

    Returns:
        weights_NK (fp32), idx_NK (int64), scores_NE (fp32 sigmoid scores, for balancing).
    """
    with fp32_island(x_ND):
        logits_NE = upcast(x_ND) @ upcast(w_router_ED).t()
    scores_NE = torch.sigmoid(logits_NE)
    choice_NE = scores_NE + bias_E.to(scores_NE.dtype)
    idx_NK = torch.topk(choice_NE, k=top_k, dim=-1, sorted=False).indices
    weights_NK = scores_NE.gather(1, idx_NK)
    if renormalize and top_k > 1:
        weights_NK = weights_NK / (weights_NK.sum(dim=-1, keepdim=True) + 1e-20)
    return weights_NK * scaling, idx_NK, scores_NE


def experts_loop(x_NC: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, w1_EIC: torch.Tensor,
                 w3_EIC: torch.Tensor, w2_ECI: torch.Tensor, glu: Glu) -> torch.Tensor:
    """Reference: for each expert, gather its tokens, run the GLU MLP, add weighted outputs.

    Each expert output is in the activation dtype, weighted and summed over the k slots in fp32,
    cast back once (the reference's combine, spec §4.6 step 6).

    Returns:
        [N, C] in the dtype of `x_NC`.
    """
    out_NC = torch.zeros(x_NC.shape, dtype=upcast(x_NC).dtype, device=x_NC.device)
    for e in range(w1_EIC.shape[0]):
        tok, slot = torch.where(idx_NK == e)
        if tok.numel() == 0:
            continue
        xe = x_NC[tok]
        ye = glu(xe @ w1_EIC[e].t(), xe @ w3_EIC[e].t()) @ w2_ECI[e].t()
        out_NC = out_NC.index_add(0, tok, upcast(ye) * weights_NK[tok, slot, None])
    return out_NC.to(x_NC.dtype)


def experts_sparse(x_NC: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, w1_EIC: torch.Tensor,
                   w3_EIC: torch.Tensor, w2_ECI: torch.Tensor, glu: Glu, *,
                   views: tuple[list[torch.Tensor], ...] | None = None) -> torch.Tensor:
    """Decode twin of `experts_loop` for a few tokens: visits only the selected experts (their weights
    are read in place, never gathered) and runs the activation once for all of them.

    Cost is O(selected experts) small matmuls instead of one per expert of the layer, which is what a
    batch of 1-4 decode tokens needs. `views` (see `Experts.decode_views`): per expert, the gate, up and
    down weights already transposed ([C, I], [C, I], [I, C]), which saves indexing and transposing them at
    every step. Same arguments and result as `experts_loop`.
    """
    N, K = idx_NK.shape
    rows_of: dict[int, list[int]] = {}
    for m, e in enumerate(idx_NK.reshape(-1).tolist()):
        rows_of.setdefault(e, []).append(m)
    experts = list(rows_of)
    order = [m for e in experts for m in rows_of[e]]
    xs = [x_NC[ms[0] // K:ms[0] // K + 1] if len(ms) == 1 else x_NC[[m // K for m in ms]]
          for ms in rows_of.values()]
    if views is None:
        views = tuple(w.transpose(1, 2) for w in (w1_EIC, w3_EIC, w2_ECI))
    gate = torch.cat([xe @ views[0][e] for xe, e in zip(xs, experts, strict=True)])
    up = torch.cat([xe @ views[1][e] for xe, e in zip(xs, experts, strict=True)])
    h_MI = glu(gate, up)
    ys, start = [], 0
    for e in experts:
        n = len(rows_of[e])
        ys.append(h_MI[start:start + n] @ views[2][e])
        start += n
    order_M = torch.tensor(order, device=x_NC.device)
    yw_MC = upcast(torch.cat(ys)) * weights_NK.reshape(-1)[order_M, None]
    if N == 1:
        return yw_MC.sum(0, keepdim=True).to(x_NC.dtype)
    out_NC = torch.zeros(x_NC.shape, dtype=yw_MC.dtype, device=x_NC.device).index_add(0, order_M // K, yw_MC)
    return out_NC.to(x_NC.dtype)


def experts_gather(x_NC: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, w1_EIC: torch.Tensor,
                   w3_EIC: torch.Tensor, w2_ECI: torch.Tensor, glu: Glu) -> torch.Tensor:
    """Static-shape twin of `experts_loop` for a compiled decode step: gather each token's k experts'
    weights ([N, K, I, C]) and contract, no data-dependent shapes or host reads. It copies N*K experts'
    weights, so it pays only while N*K is small against the expert count (the caller decides).
    Same arguments and result as `experts_loop`."""
    gate_NKI = torch.einsum("nc,nkic->nki", x_NC, w1_EIC[idx_NK])
    up_NKI = torch.einsum("nc,nkic->nki", x_NC, w3_EIC[idx_NK])
    y_NKC = torch.einsum("nki,nkci->nkc", glu(gate_NKI, up_NKI), w2_ECI[idx_NK])
    return (upcast(y_NKC) * weights_NK[..., None]).sum(1).to(x_NC.dtype)


def experts_dense(x_NC: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, w1_EIC: torch.Tensor,
                  w3_EIC: torch.Tensor, w2_ECI: torch.Tensor, glu: Glu) -> torch.Tensor:
    """Static-shape twin of `experts_loop` that runs every expert on every token and combines with
    zero weight for the experts not chosen: E/K times the FLOPs, but three large contractions instead
    of three small matmuls per expert. Pays when experts are tiny and a step touches most of them
    (small models, batched decode); the caller decides. Same arguments and result as `experts_loop`."""
    h_NEI = glu(torch.einsum("nc,eic->nei", x_NC, w1_EIC), torch.einsum("nc,eic->nei", x_NC, w3_EIC))
    y_NEC = torch.einsum("nei,eci->nec", h_NEI, w2_ECI)
    dense_NE = weights_NK.new_zeros(x_NC.shape[0], w1_EIC.shape[0]).scatter(1, idx_NK, weights_NK)
    return (upcast(y_NEC) * dense_NE[..., None]).sum(1).to(x_NC.dtype)


def _grouped_mm_ok(x: torch.Tensor, w_EOC: torch.Tensor) -> bool:
    # torch's grouped_mm kernels take fp32/bf16 only and need 16-byte aligned row strides. Traced by torch.compile
    # only in bf16: its shape function refuses float32 (torch 2.13; eager float32 runs on the CPU).
    if x.dtype not in (torch.float32, torch.bfloat16) or w_EOC.dtype != x.dtype:
        return False
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return False
    per16 = 16 // x.element_size()
    return x.shape[-1] % per16 == 0 and w_EOC.shape[1] % per16 == 0


def grouped_matmul(x_MC: torch.Tensor, w_EOC: torch.Tensor, counts: list[int], offs: torch.Tensor) -> torch.Tensor:
    """Rows of `x_MC` sorted by expert, expert e's rows times `w_EOC[e]`^T -> [M, O].

    Uses `F.grouped_mm` (one kernel for all experts, with autograd on CPU and CUDA) when dtype and
    alignment allow, else a loop over the contiguous per-expert segments.
    """
    if _grouped_mm_ok(x_MC, w_EOC):
        return F.grouped_mm(x_MC.contiguous(), w_EOC.transpose(1, 2), offs=offs)
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            outs.append(x_MC[start:start + n] @ w_EOC[e].t())
        start += n
    if not outs:  # no rows: still a function of x and w (zero gradients, not none: an expert-parallel rank
        # whose experts got no tokens must run the same backward collectives as the others)
        return x_MC @ w_EOC[0].t()
    return torch.cat(outs)


def expert_rows(xs_MC: torch.Tensor, counts: list[int], offs: torch.Tensor, w1_EIC: torch.Tensor,
                w3_EIC: torch.Tensor, w2_ECI: torch.Tensor, glu: Glu) -> torch.Tensor:
    """The GLU MLP of each expert on its rows: `xs_MC` sorted by expert (`counts[e]` rows of expert e,
    `offs` their cumulative ends, int32) -> [M, C] unweighted outputs in the same order. The compute
    core of `experts_grouped`, shared with the expert-parallel dispatcher (`openk3/parallel/ep.py`)."""
    h_MI = glu(grouped_matmul(xs_MC, w1_EIC, counts, offs), grouped_matmul(xs_MC, w3_EIC, counts, offs))
    return grouped_matmul(h_MI, w2_ECI, counts, offs)


def experts_grouped(x_NC: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, w1_EIC: torch.Tensor,
                    w3_EIC: torch.Tensor, w2_ECI: torch.Tensor, glu: Glu) -> torch.Tensor:
    """Fast twin of `experts_loop`: sort the N*K (token, expert) pairs by expert once, run three
    grouped matmuls, scatter the weighted rows back. Same arguments and result."""
    N, K = idx_NK.shape
    E = w1_EIC.shape[0]
    flat_M = idx_NK.reshape(-1)
    order_M = torch.argsort(flat_M, stable=True)
    tok_M = order_M // K
    counts_E = torch.bincount(flat_M, minlength=E)
    offs = counts_E.cumsum(0).to(torch.int32)
    counts = counts_E.tolist()
    y_MC = expert_rows(x_NC[tok_M], counts, offs, w1_EIC, w3_EIC, w2_ECI, glu)
    yw_MC = upcast(y_MC) * weights_NK.reshape(-1)[order_M, None]
    out_NC = torch.zeros(x_NC.shape, dtype=yw_MC.dtype, device=x_NC.device).index_add(0, tok_M, yw_MC)
    return out_NC.to(x_NC.dtype)
