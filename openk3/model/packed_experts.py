"""Keep-packed routed experts: one MoE layer's experts held in MXFP4 (4.25 bits/weight) and
dequantised one expert at a time at matmul time, only for experts that received tokens.

`SparseMoE.forward` dispatches here when its `experts` is a `PackedExperts` (it tests for the
`w1_packed` attribute and calls `PackedExperts.run`, so `model/moe.py` never imports this module): decode
batches and short prompts on CPU go to the MXFP4 kernel (`openk3/ops/moe_mxfp4_cpu.py`, which reads the
packed bytes directly), everything else to `experts_packed` below. Inference only: the packed buffers
are uint8 and get no gradients; activations may still require grad (see `experts_packed`).

Legend: N tokens, C expert input width (latent in K3), I expert hidden width, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from openk3.common import upcast
from openk3.model.moe import Experts, SparseMoE
from openk3.ops.moe import Glu
from openk3.quant.mxfp4 import GROUP, pack, unpack

_MATS = ("w1", "w3", "w2")  # gate, up [E, I, C]; down [E, C, I] (as `openk3.model.moe.Experts`)


class PackedExperts(nn.Module):
    """All routed experts of a layer in MXFP4: uint8 buffers `w1_packed`, `w3_packed` [E, I, C/2],
    `w1_scale`, `w3_scale` [E, I, C/32], `w2_packed` [E, C, I/2], `w2_scale` [E, C, I/32].

    Build with `from_experts` (quantise an `Experts`) or construct empty (zeros; `device="meta"` for
    a loader to fill) and load a state dict. C and I must be multiples of 32.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        if dim % GROUP or hidden % GROUP:
            raise ValueError(f"MXFP4 experts need dim ({dim}) and hidden ({hidden}) divisible by {GROUP}")
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        for name, (rows, cols) in (("w1", (hidden, dim)), ("w3", (hidden, dim)), ("w2", (dim, hidden))):
            self.register_buffer(f"{name}_packed", torch.zeros(num_experts, rows, cols // 2, dtype=torch.uint8,
                                                               device=device))
            self.register_buffer(f"{name}_scale", torch.zeros(num_experts, rows, cols // GROUP, dtype=torch.uint8,
                                                              device=device))

    @classmethod
    def from_experts(cls, experts: Experts) -> PackedExperts:
        """Quantise (OCP MX rounding, `mxfp4.pack`) every expert of `experts`, on its device."""
        E, I, C = experts.w1.shape
        out = cls(E, C, I, device="meta")
        for name in _MATS:
            p, s = pack(getattr(experts, name).detach())
            setattr(out, f"{name}_packed", p)
            setattr(out, f"{name}_scale", s)
        return out

    def to_experts(self, dtype: torch.dtype = torch.bfloat16) -> Experts:
        """Dequantise all experts into a plain `Experts` (parameters in `dtype`, exact)."""
        with torch.device("meta"):
            out = Experts(self.num_experts, self.dim, self.hidden)
        for name in _MATS:
            w = unpack(getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale"), dtype)
            setattr(out, name, nn.Parameter(w))
        return out

    def dequant(self, e: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert `e`'s (w1 [I, C], w3 [I, C], w2 [C, I]) in `dtype`."""
        return tuple(unpack(getattr(self, f"{n}_packed")[e], getattr(self, f"{n}_scale")[e], dtype) for n in _MATS)

    def nbytes(self) -> int:
        """Bytes held (packed codes + scales): 4.25/8 bytes per weight."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, dim={self.dim}, hidden={self.hidden}, mxfp4"

    def run(self, x_NC: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, glu: Glu,
            dtype: torch.dtype | None = None) -> torch.Tensor:
        """`experts_packed` on these experts: what `SparseMoE` calls (model/moe.py does not import this module,
        which imports it)."""
        return experts_packed(x_NC, weights_NK, idx_NK, self, glu, dtype)


def experts_packed(x_NC: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, packed: PackedExperts,
                   glu: Glu, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`openk3.ops.moe.experts_loop` with the experts dequantised to `dtype` (default x's dtype) one at a
    time, only for experts that received tokens. Same operations in the same order (experts ascending,
    each expert's (token, slot) pairs in row-major order, fp32 combine), so the result is bitwise what
    `experts_loop` gives on `packed.to_experts(dtype)`.

    Gradients flow to `x_NC` and `weights_NK` if they require grad, but autograd then keeps every
    used expert's dequantised weights until backward; run under `torch.inference_mode()` (or
    `no_grad`) to keep memory at one dequantised expert.

    Returns:
        [N, C] in the dtype of `x_NC`.
    """
    dtype = dtype or x_NC.dtype
    N, K = idx_NK.shape
    flat_M = idx_NK.reshape(-1)
    order_M = torch.argsort(flat_M, stable=True)  # by expert, then row-major (token, slot): torch.where's order
    counts = torch.bincount(flat_M, minlength=packed.num_experts).tolist()
    out_NC = torch.zeros(x_NC.shape, dtype=upcast(x_NC).dtype, device=x_NC.device)
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        pair = order_M[start:start + n]
        start += n
        tok, slot = pair // K, pair % K
        w1, w3, w2 = packed.dequant(e, dtype)
        xe = x_NC[tok]
        ye = glu(xe @ w1.t(), xe @ w3.t()) @ w2.t()
        out_NC = out_NC.index_add(0, tok, upcast(ye) * weights_NK[tok, slot, None])
    return out_NC.to(x_NC.dtype)


def _moe_layers(model: nn.Module) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


@torch.no_grad()
def pack_model_experts_(model: nn.Module) -> nn.Module:
    """Replace, in place, every MoE layer's `experts` (`Experts`) by a `PackedExperts` (MXFP4-rounding
    them); layers already packed are left alone. Returns `model`.

    Note `K3ForCausalLM.cast` must not be called on a packed model (it would cast the uint8 buffers).
    """
    for moe in _moe_layers(model):
        if isinstance(moe.experts, Experts):
            moe.experts = PackedExperts.from_experts(moe.experts)
    return model


@torch.no_grad()
def unpack_model_experts_(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Reverse of `pack_model_experts_`: every `PackedExperts` back to an `Experts` in `dtype`. Returns `model`."""
    for moe in _moe_layers(model):
        if isinstance(moe.experts, PackedExperts):
            moe.experts = moe.experts.to_experts(dtype)
    return model
