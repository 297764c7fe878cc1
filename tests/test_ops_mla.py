"""MLA: the absorbed form equals the naive (expanded K/V) form, outputs and gradients (float64)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_close

from openk3.ops.mla import attention_mask, mla_attention_absorbed, mla_attention_causal, mla_attention_naive

H, DN, DR, DV, C = 3, 8, 4, 6, 10


def _inputs(B, T, S, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, DN + DR, generator=g, dtype=dtype)
    ckv = torch.randn(B, S, C, generator=g, dtype=dtype)
    kpe = torch.randn(B, S, DR, generator=g, dtype=dtype)
    w = torch.randn(H * (DN + DV), C, generator=g, dtype=dtype) / C**0.5
    return [t.requires_grad_() for t in (q, ckv, kpe, w)]


def _assert_same_function(label, ref, got, inputs, tol=1e-12):
    """Outputs and the gradients of every input (one random output gradient) agree to `tol`."""
    assert_close(f"{label} out", ref, got, tol)
    do = torch.randn_like(ref)
    g_ref = torch.autograd.grad(ref, inputs, do)
    g_got = torch.autograd.grad(got, inputs, do)
    for name, a, b in zip(("dq", "dckv", "dkpe", "dw_kv_b"), g_ref, g_got, strict=True):
        assert_close(f"{label} {name}", a, b, tol)


def _docs(B, S, lengths):
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    assert seg.numel() == S
    return seg.expand(B, S)


CASES = {
    # id: (B, T, S, mask kind, document lengths)
    "causal-T7-S7": (2, 7, 7, "causal", None),
    "offset-T5-S13": (1, 5, 13, "causal", None),
    "offset-T1-S9": (2, 1, 9, "causal", None),
    "nomask-T1-S11": (2, 1, 11, None, None),
    "docs-T15-S15": (2, 15, 15, "docs", (4, 1, 7, 3)),
    "docs-offset-T6-S17": (1, 6, 17, "docs", (9, 5, 3)),
}


def _mask(B, T, S, kind, docs):
    if kind is None:
        return None
    if kind == "causal":
        return attention_mask(T, S)
    seg = _docs(B, S, docs)
    return attention_mask(T, S, doc_q_BT=seg[:, S - T:], doc_k_BS=seg)


@pytest.mark.parametrize("case", list(CASES))
def test_absorbed_equals_naive(case):
    B, T, S, kind, docs = CASES[case]
    q, ckv, kpe, w = _inputs(B, T, S, seed=len(case))
    mask = _mask(B, T, S, kind, docs)
    kw = dict(v_head_dim=DV, scale=(DN + DR) ** -0.5, mask_BTS=mask)
    ref = mla_attention_naive(q, ckv, kpe, w, **kw)
    got = mla_attention_absorbed(q, ckv, kpe, w, **kw)
    assert ref.shape == (B, T, H, DV) and ref.dtype == torch.float64
    _assert_same_function(case, ref, got, (q, ckv, kpe, w))


def test_attention_mask_semantics():
    m = attention_mask(3, 5)[0]
    expect = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, expect)
    seg = _docs(1, 5, (2, 3))
    m = attention_mask(5, 5, doc_q_BT=seg, doc_k_BS=seg)[0]
    expect = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]],
                          dtype=torch.bool)
    assert torch.equal(m, expect)


def test_naive_matches_per_head_loop():
    """An independent, obviously correct reference: expand each head's K and V by hand, softmax, loop."""
    B, T, S = 2, 4, 9
    q, ckv, kpe, w = (t.detach() for t in _inputs(B, T, S, seed=7))
    seg = _docs(B, S, (3, 6))
    mask = attention_mask(T, S, doc_q_BT=seg[:, S - T:], doc_k_BS=seg)
    scale = (DN + DR) ** -0.5
    out = torch.zeros(B, T, H, DV, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            w_k = w[h * (DN + DV):h * (DN + DV) + DN]  # [DN, C] key rows of head h
            w_v = w[h * (DN + DV) + DN:(h + 1) * (DN + DV)]  # [DV, C] value rows
            keys = torch.cat([ckv[b] @ w_k.T, kpe[b]], dim=-1)  # [S, DN + DR]; kpe shared by heads
            values = ckv[b] @ w_v.T  # [S, DV]
            for t in range(T):
                s = (keys @ q[b, t, h]) * scale
                s = torch.where(mask[b, t], s, torch.tensor(float("-inf"), dtype=s.dtype))
                p = torch.exp(s - s.max())
                p = p / p.sum()
                out[b, t, h] = p @ values
    got = mla_attention_naive(q, ckv, kpe, w, v_head_dim=DV, scale=scale, mask_BTS=mask)
    assert_close("naive vs per-head loop", out, got, 1e-12)
    got = mla_attention_absorbed(q, ckv, kpe, w, v_head_dim=DV, scale=scale, mask_BTS=mask)
    assert_close("absorbed vs per-head loop", out, got, 1e-12)


def test_float32_and_bfloat16_agree_loosely():
    """The absorbed form in the activation dtype stays close to the float64 naive result."""
    B, T, S = 1, 6, 11
    q, ckv, kpe, w = (t.detach() for t in _inputs(B, T, S, seed=3))
    kw = dict(v_head_dim=DV, scale=(DN + DR) ** -0.5, mask_BTS=attention_mask(T, S))
    ref = mla_attention_naive(q, ckv, kpe, w, **kw)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        got = mla_attention_absorbed(*(t.to(dtype) for t in (q, ckv, kpe, w)), **kw)
        assert got.dtype == dtype
        assert_close(f"absorbed {dtype}", ref, got, tol)


def test_single_query_without_mask_sees_every_key():
    """Decode passes mask None for T = 1: the same as the causal mask with the query last."""
    q, ckv, kpe, w = (t.detach() for t in _inputs(2, 1, 8, seed=11))
    kw = dict(v_head_dim=DV, scale=(DN + DR) ** -0.5)
    ref = mla_attention_naive(q, ckv, kpe, w, mask_BTS=attention_mask(1, 8), **kw)
    assert_close("T=1 mask None", ref, mla_attention_absorbed(q, ckv, kpe, w, mask_BTS=None, **kw), 1e-12)


@pytest.mark.parametrize("rows", [
    [(4, 1, 7, 3)],                 # one row, a one-token document inside
    [(15,), (2, 13)],               # a row of one document beside one of two
    [(1, 1, 1, 12), (5, 5, 5)],     # one-token documents at the start
])
@pytest.mark.parametrize("min_mean", [1, 32])
def test_per_document_attention_equals_the_masked_form(rows, min_mean, monkeypatch):
    """The packed-row fast path (one causal attention per document; min_mean 1 takes it for every row here,
    32 sends these short rows to the mask) against the T x T block-diagonal mask, outputs and gradients in
    float64; and a row whose ids go down takes the masked form."""
    from openk3.ops import mla as mla_module
    from openk3.ops.mla import document_runs, mla_attention_documents

    monkeypatch.setattr(mla_module, "MIN_MEAN_DOCUMENT", min_mean)
    calls = []  # the lengths attended: per document (the causal form) or whole rows (the mask)
    naive, causal = mla_module.mla_attention_naive, mla_module.mla_attention_causal

    def counted_naive(*a, **k):
        if k.get("mask_BTS") is not None and k["mask_BTS"].shape[-1] == T:  # a whole row under the mask
            calls.append(T)
        return naive(*a, **k)

    monkeypatch.setattr(mla_module, "mla_attention_naive", counted_naive)
    monkeypatch.setattr(mla_module, "mla_attention_causal",
                        lambda *a, **k: calls.append(a[0].shape[1]) or causal(*a, **k))

    T = sum(rows[0])
    seg = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(r)]) for r in rows])
    q, ckv, kpe, w = _inputs(len(rows), T, T, seed=5)
    ref = mla_attention_naive(q, ckv, kpe, w, v_head_dim=DV, scale=0.3,
                              mask_BTS=attention_mask(T, T, doc_q_BT=seg, doc_k_BS=seg))
    got = mla_attention_documents(q, ckv, kpe, w, seg_BT=seg, v_head_dim=DV, scale=0.3)
    assert calls == ([n for r in rows for n in r] if min_mean == 1 else [T] * len(rows))  # the path taken
    _assert_same_function("documents", ref, got, (q, ckv, kpe, w))
    assert document_runs(torch.tensor([0, 0, 1, 1, 1, 2])) == [(0, 2), (2, 5), (5, 6)]
    down = torch.tensor([[0, 0, 1, 1, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2][:T]])
    if T == 15:
        assert document_runs(down[0]) is None
        q1, ckv1, kpe1, w1 = (t.detach()[:1] if t.dim() > 2 else t.detach() for t in (q, ckv, kpe, w))
        masked = mla_attention_naive(q1, ckv1, kpe1, w1, v_head_dim=DV, scale=0.3,
                                     mask_BTS=attention_mask(T, T, doc_q_BT=down, doc_k_BS=down))
        assert torch.equal(mla_attention_documents(q1, ckv1, kpe1, w1, seg_BT=down, v_head_dim=DV, scale=0.3), masked)


@pytest.mark.parametrize("T", [1, 2, 7, 13, 300])
@pytest.mark.parametrize("dv", [DV, DN + DR])  # narrower values (every preset: zero-padded), equal widths
def test_fused_causal_equals_naive(T, dv, monkeypatch):
    """`mla_attention_causal` (torch's fused attention, `is_causal=True`) against the naive form with the causal
    mask, outputs and gradients in float64 at odd lengths; float32 within rounding. It takes the fused kernel
    for float32/float64 outside autocast (T > 1) and the naive form under bf16 autocast and for bf16 inputs,
    whose rounding points are the eager reference's. The fused kernel is the flash one, which never holds the
    T x T scores, also with narrower value heads (padded to the key width): with torch restricted to it, the
    call runs (torch's math kernel took narrower values before the padding)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: fused.append(1) or sdpa(*a, **k))
    q, ckv, kpe, w = _inputs(2, T, T, seed=T)
    if dv != DV:  # kv_b_proj rows for wider value heads
        w = torch.randn(H * (DN + dv), C, generator=torch.Generator().manual_seed(T), dtype=torch.float64) / C**0.5
        w.requires_grad_()
    ref = mla_attention_naive(q, ckv, kpe, w, v_head_dim=dv, scale=0.3,
                              mask_BTS=attention_mask(T, T) if T > 1 else None)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # "No available kernel" if the inputs need another one
        got = mla_attention_causal(q, ckv, kpe, w, v_head_dim=dv, scale=0.3)
    assert len(fused) == (T > 1)
    _assert_same_function(f"causal T={T} dv={dv}", ref, got, (q, ckv, kpe, w))
    f32 = [t.detach().float() for t in (q, ckv, kpe, w)]
    assert_close("fp32", ref.detach().float(), mla_attention_causal(*f32, v_head_dim=dv, scale=0.3), 1e-5)
    fused.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mla_attention_causal(*f32, v_head_dim=dv, scale=0.3)
    mla_attention_causal(*(t.bfloat16() for t in f32), v_head_dim=dv, scale=0.3)
    assert fused == []  # bf16: the eager form


def test_fused_causal_path_is_cpu_float_outside_autocast_only():
    """The fused kernel only where it is exact and repeatable: CPU float32/float64 outside autocast; a meta
    tensor (shape tracing) or bf16 answers False instead of raising or changing rounding points."""
    from openk3.ops.mla import fused_causal_ok

    assert fused_causal_ok(torch.zeros(1, 2, 1, 4)) and fused_causal_ok(torch.zeros(1, 2, 1, 4, dtype=torch.float64))
    assert not fused_causal_ok(torch.zeros(1, 2, 1, 4, dtype=torch.bfloat16))
    assert not fused_causal_ok(torch.zeros(1, 2, 1, 4, device="meta"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fused_causal_ok(torch.zeros(1, 2, 1, 4))
    q, ckv, kpe, w = (torch.zeros(1, 5, H, DN + DR, device="meta"), torch.zeros(1, 5, C, device="meta"),
                      torch.zeros(1, 5, DR, device="meta"), torch.zeros(H * (DN + DV), C, device="meta"))
    assert mla_attention_causal(q, ckv, kpe, w, v_head_dim=DV, scale=0.3).shape == (1, 5, H, DV)
