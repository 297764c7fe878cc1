"""Building blocks shared by the layers: RMSNorm, the GLU activations, the GLU MLP.

Legend: ... any leading dims, D width, I hidden width of an MLP.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from openk3.common import as_dtype, upcast

FUSE_MAX_BYTES = 32 << 20


def cached_on(owner: nn.Module, key: str, parts: list[torch.Tensor], build):
    """`build()` cached on `owner` under `key` until one of `parts` gets new storage (load, cast, `.to`) or an
    in-place update through autograd's eyes (the tensor's version counter). Only for builds that are *views* of
    the parts: a view cannot go stale, whatever writes its memory (`p.data += x` bumps no version counter)."""
    sig = tuple((p.data_ptr(), p._version, p.dtype) for p in parts)
    cache = owner.__dict__.setdefault("_decode_cache", {})
    hit = cache.get(key)
    if hit is None or hit[0] != sig:
        with torch.no_grad():
            hit = cache[key] = (sig, build())
    return hit[1]


def packed_weight(owner: nn.Module, key: str, params: list[torch.Tensor]) -> torch.Tensor | None:
    """cat(params, 0) for decode, without a second copy that could go stale: the parameters are moved, once, into
    one buffer as consecutive slices of it (`p.data` = a contiguous view), and the buffer is what this returns
    from then on. Every write to a parameter, `p.data += delta` included (a PEFT merge, a user's edit: no version
    counter sees those), is a write to the buffer. When a parameter no longer lives in the buffer (a load, a cast,
    `.to`), they are packed again. None when the parameters exceed `FUSE_MAX_BYTES` (one big matmul per part
    costs nothing extra at that size), under torch.compile (a compiled step removes the per-op overhead anyway),
    for parameters that are not plain tensors (FSDP's DTensors) or not row-major (a layout chosen elsewhere).

    Small-batch decode is bound by per-op overhead, so one matmul over the packed weight replaces several; the
    result is the same as the separate matmuls (tests compare decode with forward).
    """
    if torch.compiler.is_compiling() or sum(p.numel() * p.element_size() for p in params) > FUSE_MAX_BYTES:
        return None
    if any(type(p.data) is not torch.Tensor or p.dtype != params[0].dtype or p.device != params[0].device
           or p.shape[1:] != params[0].shape[1:] for p in params):
        return None
    cache = owner.__dict__.setdefault("_decode_cache", {})
    buffer = cache.get(key)
    if buffer is not None and _lives_in(params, buffer):
        return buffer
    if not all(p.is_contiguous() for p in params):
        # A layout someone chose (`infer.graph.column_major_linears_` for a compiled decode graph, which skips its
        # guards on the model's parameters and so must never see their strides change): left alone, and the
        # caller runs the separate matmuls.
        cache.pop(key, None)
        return None
    # (a normal tensor even when decode runs under inference_mode: the parameters live in it and train afterwards,
    # and autograd cannot save inference tensors; RL generates and trains the same model in turn)
    with torch.inference_mode(False), torch.no_grad():
        buffer = torch.cat([p.detach() for p in params], 0)
        for p, view in zip(params, buffer.split([p.shape[0] for p in params], 0)):
            p.data = view
    cache[key] = buffer
    return buffer


def _lives_in(params: list[torch.Tensor], buffer: torch.Tensor) -> bool:
    """Whether each parameter is still its slice of `buffer` (same memory, same layout)."""
    if buffer.dtype != params[0].dtype or buffer.device != params[0].device:
        return False
    storage, start = buffer.untyped_storage().data_ptr(), buffer.storage_offset()
    for p in params:
        if (p.untyped_storage().data_ptr() != storage or p.storage_offset() != start or not p.is_contiguous()
                or p.shape[1:] != buffer.shape[1:]):
            return False
        start += p.numel()
    return start == buffer.storage_offset() + buffer.numel()


def linear_weight(m: nn.Module) -> torch.Tensor:
    """The weight [out, in] that linear-like module `m` applies, for code that uses a projection's matrix rather
    than calling it (MLA's `kv_b_proj`, the AttnRes pseudo-queries). An `nn.Linear` gives its `weight`.

    A PEFT LoRA layer (whose `.weight` is the *base* weight, without the adapter) gives base + each active
    adapter's `get_delta_weight` (with autograd, so an adapter trains and decodes through these uses as well);
    LoRA dropout acts on a module's input rows, which a matrix use does not have, so it does not apply here.
    Any other wrapper (DoRA, other tuners) is probed: the module applied to the identity rows is W^T exactly (each
    output sums one product with 1 and zeros) plus what the wrapper adds; exact, but it costs an in x in input."""
    if isinstance(m, nn.Linear):  # (FSDP2 makes subclasses of the modules it wraps)
        return m.weight
    base = m
    while not isinstance(base, nn.Linear) and hasattr(base, "base_layer"):
        base = base.base_layer
    if not isinstance(base, nn.Linear) or base.bias is not None:
        raise ValueError(f"{type(m).__name__}: expected a bias-free linear layer (or a wrapper of one)")
    if _plain_lora(m, base):
        w = base.weight
        if m.disable_adapters or m.merged:  # (merged: the base weight holds the deltas already)
            return w
        for name in m.active_adapters:
            if name in m.lora_A:
                if m.lora_bias.get(name, False):
                    raise ValueError(f"{type(m).__name__}: a LoRA bias (lora_bias=True) cannot be part of a matrix "
                                     f"(MLA's kv_b_proj, the AttnRes projections); train without it")
                w = w + m.get_delta_weight(name).to(w.dtype)
        return w
    eye = torch.eye(base.weight.shape[1], dtype=base.weight.dtype, device=base.weight.device)
    return m(eye).t()


def _plain_lora(m: nn.Module, base: nn.Linear) -> bool:
    """A PEFT `lora.Linear` directly around `base`, without DoRA or another variant (duck-typed: no peft import)."""
    return (getattr(m, "base_layer", None) is base and hasattr(m, "get_delta_weight") and hasattr(m, "lora_A")
            and hasattr(m, "lora_bias") and not any(getattr(m, "use_dora", {}).values())
            and not getattr(m, "lora_variant", None))


class RMSNorm(nn.Module):
    """K3's RMSNorm (spec §4.1): statistics in fp32, cast back to the input dtype, *then* times weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = upcast(x)
        normed = as_dtype(x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps), x.dtype)
        return as_dtype(self.weight, x.dtype) * normed

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def situ_glu(gate: torch.Tensor, up: torch.Tensor, *, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU (spec §4.2): [b1 tanh(g/b1) sigmoid(g)] * [b2 tanh(u/b2)], in fp32, cast back.

    The sigmoid sees the *uncapped* gate; both branches are soft-capped so |out| <= b1 * b2.
    """
    g, u = upcast(gate), upcast(up)
    out = beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))
    return out.to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU as in Kimi-Linear (silu(g) * u in the activation dtype)."""
    return F.silu(gate) * up


def make_glu(hidden_act: str, beta: float, linear_beta: float):
    """The GLU used everywhere in the model (dense MLP, shared and routed experts)."""
    if hidden_act == "situ":
        return functools.partial(situ_glu, beta=beta, linear_beta=linear_beta)
    assert hidden_act == "silu", hidden_act
    return swiglu


class GluMLP(nn.Module):
    """down(glu(gate x, up x)): the dense MLP of layer 0 and the fused shared experts."""

    def __init__(self, dim: int, hidden: int, glu) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.glu = glu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.glu(self.gate_proj(x), self.up_proj(x)))
