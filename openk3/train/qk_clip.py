"""QK-Clip (Kimi K2's MuonClip) for the gated MLA layers.

K2's rule, per attention head h: S_max^h = the largest pre-softmax logit (scale included) seen in
the batch; after the optimizer step, if S_max^h > tau, gamma_h = tau / S_max^h and
  - the head-specific query/key parts (q_nope, k_nope) are each scaled by sqrt(gamma_h),
  - the head-specific query "rope" part q_pe is scaled by gamma_h,
  - the shared key part k_pe (one head, used by all heads) is left alone,
so every logit of head h scales by exactly gamma_h and its maximum becomes tau. Heads at or under tau
are untouched. In K3's MLA that means rows of `q_b_proj` (or `q_proj`): per head Dn nope rows x
sqrt(gamma), Dr pe rows x gamma; and the Dn key rows of head h in `kv_b_proj` x sqrt(gamma); value
rows, `kv_a_proj_with_mqa` (k_pe) and `q_a_proj` are unchanged. KDA layers have no softmax logits
(their q, k are L2-normalised) and are not clipped. With RoPE on the "rope" dims (`mla_use_nope: false`,
the K2-style baseline: K2's own setting) the same holds: the rotation is linear, so scaling the q_pe rows
scales the rotated q_pe alike.

Measuring S_max: the model code does not return attention logits, so `QKClipRecorder` re-computes
them in a forward hook of each `GatedMLA` (no grad): the q and k projections plus one QK^T pass,
B*H*T^2*(Dn+Dr) multiply-adds per MLA layer, i.e. roughly a third of that layer's attention forward,
no backward, and an fp32 [B, H, T, T] score buffer per layer at a time. A fused attention kernel
could return the per-head max instead; that is later work.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from openk3.common import upcast
from openk3.model.mla import GatedMLA
from openk3.ops import mla as mla_ops


@torch.no_grad()
def mla_max_logits(layer: GatedMLA, x_BTD: torch.Tensor, seg_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head max pre-softmax logit [H] (fp32, scale included) over the causal (and same-document)
    pairs of the normed layer input `x_BTD`, exactly as `GatedMLA.forward` (naive form) scores them."""
    B, T, _ = x_BTD.shape
    H, dn, dr = layer.num_heads, layer.dn, layer.dr
    # the layer's own projections (with RoPE: q and kpe rotated to the forward's positions)
    q_BTHD, ckv_BTC, kpe_BTR = layer.project(x_BTD, layer.positions(T, seg_BT=seg_BT, device=x_BTD.device))
    q_BTHD = upcast(q_BTHD)
    kv_BTHE = ckv_BTC @ layer.kv_b_proj.weight.t()
    k_nope_BTHN = upcast(kv_BTHE).view(B, T, H, -1)[..., :dn]
    k_BTHD = torch.cat([k_nope_BTHN, upcast(kpe_BTR)[:, :, None, :].expand(B, T, H, dr)], dim=-1)
    scores_BHTS = torch.einsum("bthd,bshd->bhts", q_BTHD, k_BTHD) * layer.scale
    mask_BTS = mla_ops.attention_mask(T, T, doc_q_BT=seg_BT, doc_k_BS=seg_BT, device=x_BTD.device)
    scores_BHTS = scores_BHTS.masked_fill(~mask_BTS[:, None], float("-inf"))
    return scores_BHTS.amax(dim=(0, 2, 3))


class QKClipRecorder:
    """Forward hooks on every `GatedMLA` keeping the running per-head max logit (`max_logits`, keyed by
    module name) since the last `clear()`. Decode calls (with a cache state) are skipped."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = {n: m for n, m in model.named_modules() if isinstance(m, GatedMLA)}
        self.max_logits: dict[str, torch.Tensor] = {}
        self._handles: list = []

    def _hook(self, name: str):
        def hook(module, args, kwargs, output):
            if kwargs.get("state") is not None:
                return
            x_BTD = args[0] if args else kwargs["x_BTD"]
            m = mla_max_logits(module, x_BTD.detach(), kwargs.get("seg_BT"))
            old = self.max_logits.get(name)
            self.max_logits[name] = m if old is None else torch.maximum(old, m)
        return hook

    def enable(self) -> QKClipRecorder:
        if not self._handles:
            self._handles = [m.register_forward_hook(self._hook(n), with_kwargs=True) for n, m in self.layers.items()]
        return self

    def disable(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> QKClipRecorder:
        return self.enable()

    def __exit__(self, *exc) -> None:
        self.disable()

    def clear(self) -> None:
        self.max_logits = {}


@torch.no_grad()
def qk_clip_(model: nn.Module, max_logits: dict[str, torch.Tensor], tau: float) -> dict[str, int]:
    """Rescale the q/k weights of every head whose max logit exceeds `tau` (K2's rule, module doc).

    `max_logits`: per-head maxima [H] keyed by `GatedMLA` module name (`QKClipRecorder.max_logits`).
    Call after the optimizer step. Returns the number of clipped heads per layer.
    """
    clipped = {}
    for name, smax_H in max_logits.items():
        layer = model.get_submodule(name)
        H, dn, dr, dv = layer.num_heads, layer.dn, layer.dr, layer.dv
        over_H = smax_H > tau
        clipped[name] = int(over_H.sum())
        if not clipped[name]:
            continue
        gamma_H = torch.where(over_H, tau / smax_H.float().clamp_min(tau), torch.ones_like(smax_H, dtype=torch.float32))
        wq = (layer.q_proj if hasattr(layer, "q_proj") else layer.q_b_proj).weight
        wq_HDC = wq.view(H, dn + dr, wq.shape[-1])
        wq_HDC[:, :dn].mul_(gamma_H.sqrt().to(wq.dtype)[:, None, None])
        wq_HDC[:, dn:].mul_(gamma_H.to(wq.dtype)[:, None, None])
        wkv = layer.kv_b_proj.weight
        wkv.view(H, dn + dv, wkv.shape[-1])[:, :dn].mul_(gamma_H.sqrt().to(wkv.dtype)[:, None, None])
    return clipped
