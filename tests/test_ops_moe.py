"""MoE: grouped expert compute equals the per-expert loop (outputs and gradients); router semantics."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import assert_close

from openk3.model.layers import situ_glu, swiglu
from openk3.ops.moe import experts_grouped, experts_loop, experts_sparse, route

GLUS = {"situ": functools.partial(situ_glu, beta=4.0, linear_beta=25.0), "swiglu": swiglu}


def _routing(N, E, K, kind, g):
    """idx [N, K] (distinct experts per token) and positive weights [N, K] in fp32/fp64 later."""
    if kind == "uniform":
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    elif kind == "unbalanced":
        # experts 0..K-1 take almost everything, a few tokens go elsewhere; the last experts get none
        idx = torch.arange(K).expand(N, K).clone()
        for n in range(0, N, 3):
            idx[n, 0] = K + n % (E // 2 - K)
    elif kind == "one-expert-hot":
        # every token's first choice is expert E - 1, the rest are drawn from a small pool
        idx = torch.stack([torch.cat([torch.tensor([E - 1]), torch.randperm(3, generator=g)[:K - 1]])
                           for _ in range(N)])
    else:
        raise AssertionError(kind)
    assert all(len(set(r.tolist())) == K for r in idx)
    return idx


CASES = {
    # id: (N tokens, C width, I hidden, E experts, K top-k, routing)
    "N13-uniform": (13, 6, 10, 8, 3, "uniform"),
    "N1-uniform": (1, 6, 10, 8, 3, "uniform"),
    "N29-unbalanced": (29, 6, 10, 12, 2, "unbalanced"),
    "N17-one-expert-hot": (17, 5, 7, 9, 3, "one-expert-hot"),
}


def _inputs(case, dtype, widths=None):
    N, Cw, I, E, K, kind = CASES[case]
    if widths is not None:
        Cw, I = widths
    g = torch.Generator().manual_seed(N * 31 + E)
    x = torch.randn(N, Cw, generator=g, dtype=torch.float64)
    w1 = torch.randn(E, I, Cw, generator=g, dtype=torch.float64) / Cw**0.5
    w3 = torch.randn(E, I, Cw, generator=g, dtype=torch.float64) / Cw**0.5
    w2 = torch.randn(E, Cw, I, generator=g, dtype=torch.float64) / I**0.5
    idx = _routing(N, E, K, kind, g)
    weights = torch.rand(N, K, generator=g, dtype=torch.float64) + 0.1
    x, w1, w3, w2 = (t.to(dtype) for t in (x, w1, w3, w2))
    weights = weights.to(torch.float64 if dtype == torch.float64 else torch.float32)
    return [t.requires_grad_() for t in (x, weights, w1, w3, w2)], idx


def _check(case, dtype, glu_name, tol, widths=None, experts=experts_grouped):
    (x, weights, w1, w3, w2), idx = _inputs(case, dtype, widths)
    glu = GLUS[glu_name]
    ref = experts_loop(x, weights, idx, w1, w3, w2, glu)
    got = experts(x, weights, idx, w1, w3, w2, glu)
    assert ref.dtype == got.dtype == dtype
    assert_close(f"{case} out", ref, got, tol)
    do = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    params = (x, weights, w1, w3, w2)
    g_ref = torch.autograd.grad(ref, params, do)
    g_got = torch.autograd.grad(got, params, do)
    for name, a, b in zip(("dx", "dweights", "dw1", "dw3", "dw2"), g_ref, g_got):
        assert_close(f"{case} {name}", a, b, tol)
    # experts that received no token get exactly zero gradient (not garbage) in both forms
    unused = sorted(set(range(w1.shape[0])) - set(idx.flatten().tolist()))
    for gr in g_ref[2:] + g_got[2:]:
        if unused:
            assert torch.equal(gr[unused], torch.zeros_like(gr[unused]))
    return ref


@pytest.mark.parametrize("glu_name", list(GLUS))
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_equals_loop_float64(case, glu_name):
    _check(case, torch.float64, glu_name, 1e-12)


@pytest.mark.parametrize("glu_name", list(GLUS))
@pytest.mark.parametrize("case", list(CASES))
def test_sparse_equals_loop_float64(case, glu_name):
    """The decode path (only the chosen experts, weights read in place) is the same function."""
    _check(case, torch.float64, glu_name, 1e-12, experts=experts_sparse)


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_equals_loop_float32_grouped_mm(case):
    """Widths that are multiples of 4 send float32 through torch's grouped_mm kernel."""
    ref = _check(case, torch.float32, "situ", 2e-6, widths=(8, 12))
    # and against the float64 loop, to make sure both float32 paths are accurate, not just equal
    (x, weights, w1, w3, w2), idx = _inputs(case, torch.float64, widths=(8, 12))
    exact = experts_loop(x, weights, idx, w1, w3, w2, GLUS["situ"])
    assert_close(f"{case} fp32 vs fp64", exact, ref, 2e-6)


def test_grouped_mm_path_is_taken_for_aligned_float32(monkeypatch):
    import openk3.ops.moe as moe_mod

    calls = []
    real = moe_mod.F.grouped_mm

    def spy(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(moe_mod.F, "grouped_mm", spy)
    (x, weights, w1, w3, w2), idx = _inputs("N13-uniform", torch.float32, widths=(8, 12))
    experts_grouped(x, weights, idx, w1, w3, w2, GLUS["situ"])
    assert len(calls) == 3
    calls.clear()
    (x, weights, w1, w3, w2), idx = _inputs("N13-uniform", torch.float64)
    experts_grouped(x, weights, idx, w1, w3, w2, GLUS["situ"])
    assert calls == [], "float64 must use the exact segment loop"


# ---- router ------------------------------------------------------------------------------------

def test_route_bias_changes_selection_not_weights():
    g = torch.Generator().manual_seed(0)
    N, D, E, K = 11, 16, 10, 3
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    w = torch.randn(E, D, generator=g, dtype=torch.float64)
    scores = torch.sigmoid(x @ w.T)
    zero = torch.zeros(E, dtype=torch.float64)
    w0, idx0, s0 = route(x, w, zero, top_k=K, renormalize=True, scaling=1.0)
    assert torch.equal(s0, scores)
    assert torch.equal(torch.sort(idx0, -1).values, torch.sort(scores.topk(K, -1).indices, -1).values)
    # a large bias on experts 7, 8, 9 forces them to be chosen by every token
    bias = torch.zeros(E, dtype=torch.float64)
    bias[7:] = 10.0
    wb, idxb, sb = route(x, w, bias, top_k=K, renormalize=True, scaling=1.0)
    assert torch.equal(sb, scores), "scores returned for balancing are unbiased"
    assert (torch.sort(idxb, -1).values == torch.tensor([7, 8, 9])).all()
    expect = scores[:, 7:] / scores[:, 7:].sum(-1, keepdim=True)
    got = wb.gather(1, torch.argsort(idxb, -1))
    assert_close("weights from unbiased scores, renormalised", expect, got, 1e-14)
    assert torch.allclose(wb.sum(-1), torch.ones(N, dtype=torch.float64))


def test_route_weights_follow_idx_and_scaling():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 8, generator=g, dtype=torch.float64)
    w = torch.randn(6, 8, generator=g, dtype=torch.float64)
    bias = torch.randn(6, generator=g, dtype=torch.float64)
    wts, idx, scores = route(x, w, bias, top_k=2, renormalize=False, scaling=2.5)
    assert torch.allclose(wts, 2.5 * scores.gather(1, idx))
    chosen = torch.sort(idx, -1).values
    assert torch.equal(chosen, torch.sort((scores + bias).topk(2, -1).indices, -1).values)
    wts_r, idx_r, _ = route(x, w, bias, top_k=2, renormalize=True, scaling=2.5)
    sel = scores.gather(1, idx_r)
    assert torch.allclose(wts_r, 2.5 * sel / sel.sum(-1, keepdim=True))


def test_route_is_fp32_for_bf16_input():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 16, generator=g).to(torch.bfloat16)
    w = torch.randn(8, 16, generator=g).to(torch.bfloat16)
    bias = torch.zeros(8)
    wts, idx, scores = route(x, w, bias, top_k=2, renormalize=True, scaling=1.0)
    assert wts.dtype == torch.float32 and scores.dtype == torch.float32 and idx.dtype == torch.int64
    # logits from fp32 upcasts of the bf16 values, not a bf16 matmul
    expect = torch.sigmoid(x.float() @ w.float().T)
    assert_close("fp32 router scores", expect, scores, 1e-6)


def test_route_top1_weight_is_the_raw_score():
    """Top-1 keeps the raw sigmoid score (the reference renormalises only when top_k > 1, spec §4.6);
    renormalising a single weight would make it exactly 1 and cut the router's gradient."""
    x = torch.tensor([[1.0, -2.0], [0.5, 0.25]], dtype=torch.float64)
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    bias = torch.tensor([0.0, 0.0, 5.0], dtype=torch.float64)  # selects expert 2 for every token
    # by hand: logits of expert 2 are x0 + x1 = -1.0 and 0.75
    expect = torch.tensor([[1 / (1 + torch.e)], [1 / (1 + torch.e ** -0.75)]], dtype=torch.float64)
    for renormalize in (True, False):
        wts, idx, _ = route(x, w, bias, top_k=1, renormalize=renormalize, scaling=2.0)
        assert idx.tolist() == [[2], [2]]
        assert_close(f"top-1 weight (renormalize={renormalize})", 2.0 * expect, wts, 1e-15)
    # the router still gets a gradient through the score (a renormalised weight of 1.0 would give none)
    w_req = w.clone().requires_grad_()
    wts, _, _ = route(x, w_req, bias, top_k=1, renormalize=True, scaling=1.0)
    (g,) = torch.autograd.grad(wts.sum(), w_req)
    assert g[2].abs().sum() > 0


def test_route_top2_still_renormalises():
    """k > 1 is unchanged: the chosen scores are divided by their sum (here computed by hand)."""
    x = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    bias = torch.tensor([5.0, 0.0, 5.0], dtype=torch.float64)  # selects experts 0 and 2
    wts, idx, _ = route(x, w, bias, top_k=2, renormalize=True, scaling=1.0)
    s0, s2 = 1 / (1 + torch.e ** -1.0), 1 / (1 + torch.e)  # sigmoid(1), sigmoid(-1)
    got = dict(zip(idx[0].tolist(), wts[0].tolist()))
    assert got.keys() == {0, 2}
    assert abs(got[0] - s0 / (s0 + s2)) < 1e-15 and abs(got[2] - s2 / (s0 + s2)) < 1e-15
