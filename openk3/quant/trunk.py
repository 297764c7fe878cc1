"""Weight-only integer trunks: the non-routed linears in int8 (one scale per output row) or int4 (one scale and
zero per group of 32 inputs), computed by torch's own CPU packed-weight matmuls.

Why: the release's trunk is 113.5 GB in bf16 (spec §2); with the routed experts on disk (`openk3.stream`) it is
what must fit in RAM, and a 64 GB machine needs it at ~31-33 GB: int4 with group scales, int8 where int4 costs
too much quality (`docs/inference.md`, "Running the release on one machine", measures it). Activations stay
float32 (or bf16); only the weights are integers.

* `Int8Linear`: q int8 [N, K], w = q * s[n] (symmetric, |q| <= 127); `torch._weight_int8pack_mm`.
* `Int4Linear`: q in 0..15 per group of G inputs, w = (q - 8) * scale + zero with scale = (max - min) / 15 and
  zero = min + 8 scale (asymmetric: the group's range, not its largest magnitude); the codes packed by
  `torch._convert_weight_to_int4pack_for_cpu`, run by `torch._weight_int4pack_mm_for_cpu`.

Each keeps its slow, obviously-correct twin: `dequantize()` gives the float weight those codes stand for, and
`F.linear(x, layer.dequantize())` is what the packed matmul computes (tests: float32, odd shapes, to matmul
rounding). Not quantised, by design: the router (used in fp32 for selection), `kv_b_proj` (MLA reads it as a
tensor to absorb it into the attention), the AttnRes projections (vectors), norms, convolutions, the embedding
table (a lookup). `quantize_trunk_(model, "int4")` replaces the rest in place; `promote` names the groups kept
at int8 (`GROUPS`).

Legend: N output features, K input features, G group size.
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

TRUNK_FORMATS = ("bf16", "int8", "int4")  # bf16: leave the trunk as loaded
INT4_GROUP = 32

# Name patterns of the trunk's linears, by group (what `promote` and the quality gate speak of).
GROUPS = {
    "lm_head": r"lm_head",
    "dense_mlp": r"model\.layers\.\d+\.mlp\.(gate|up|down)_proj",
    "shared_experts": r"model\.layers\.\d+\.block_sparse_moe\.shared_experts\.(gate|up|down)_proj",
    "latent": r"model\.layers\.\d+\.block_sparse_moe\.routed_expert_(down|up)_proj",
    "kda": r"model\.layers\.\d+\.self_attn\.[a-z_]+",  # a KimiDeltaAttention layer's linears
    "mla": r"model\.layers\.\d+\.self_attn\.[a-z_]+",  # a gated MLA layer's (g_proj, o_proj: both kinds)
}
# Never quantised: read as tensors elsewhere, or vectors.
_KEEP = re.compile(r".*(kv_b_proj|attn_res_proj|res_proj)$")


class Int8Linear(nn.Module):
    """y = x @ (q * s[:, None]).T; q int8 [N, K], s float32 [N]."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> Int8Linear:
        w = lin.weight.detach().float()
        s = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, s)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return F.linear(x, self.dequantize(x.dtype))
        y = torch._weight_int8pack_mm(x2.contiguous(), self.q, self.scale.to(x.dtype))
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per row"


class Int4Linear(nn.Module):
    """y = x @ W.T with W[n, g*G + j] = (q - 8) * scale[g, n] + zero[g, n]; codes packed for torch's CPU kernel."""

    def __init__(self, codes: torch.Tensor, scale_zero: torch.Tensor, group: int) -> None:
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group = group
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(codes, 1))  # uint8 [N, K/2]
        self.register_buffer("scale_zero", scale_zero)  # float32 [K/G, N, 2]

    @staticmethod
    def quantize(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes int32 [N, K] in 0..15, scale_zero float32 [K/G, N, 2]) of a float weight [N, K]."""
        w = w.detach().float()
        N, K = w.shape
        if not int4_fits(N, K, group):
            raise ValueError(f"int4 needs the output width ({N}) a multiple of {_BLOCK_N} and the input width ({K}) "
                             f"a multiple of the group ({group})")
        wg = w.reshape(N, K // group, group)
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(N, K)
        zero = lo + 8 * scale
        return q, torch.stack([scale.t(), zero.t()], -1).contiguous()

    @staticmethod
    def weight_of(codes: torch.Tensor, scale_zero: torch.Tensor, group: int) -> torch.Tensor:
        """The float32 weight [N, K] that codes and scales stand for: the slow twin, (q - 8) * scale + zero."""
        N, K = codes.shape
        scale, zero = scale_zero[..., 0].t(), scale_zero[..., 1].t()  # [N, K/G]
        return ((codes.reshape(N, K // group, group).float() - 8) * scale[..., None] + zero[..., None]).reshape(N, K)

    @classmethod
    def from_linear(cls, lin: nn.Linear, group: int = INT4_GROUP) -> Int4Linear:
        return cls(*cls.quantize(lin.weight, group), group)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K], read back through the packed matmul on slices of the identity (torch's packed
        layout differs by CPU: AVX-512, AVX2 and the default kernels block rows differently, so it is not unpacked
        by hand). The fallback for devices and dtypes the packed matmul does not take."""
        K = self.in_features
        sz = self.scale_zero.to(torch.float32)
        cols = []
        for k0 in range(0, K, 1024):
            eye = torch.zeros(min(1024, K - k0), K)
            eye[:, k0:k0 + eye.shape[0]].fill_diagonal_(1.0)
            cols.append(torch._weight_int4pack_mm_for_cpu(eye, self.packed.cpu(), self.group, sz.cpu()))
        return torch.cat(cols, 0).t().contiguous().to(device=self.packed.device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return F.linear(x, self.dequantize(x.dtype))
        x2 = x.reshape(-1, self.in_features).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, self.group, self.scale_zero.to(x.dtype))
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 group {self.group}"


_BLOCK_N = 64  # torch's CPU int4 kernels pack rows in blocks (64 on AVX-512, 32 on AVX2): a multiple of both


def int4_fits(N: int, K: int, group: int = INT4_GROUP) -> bool:
    return N % _BLOCK_N == 0 and K % group == 0


def group_of(name: str, model: nn.Module) -> str | None:
    """The `GROUPS` key of `model`'s linear `name` (None: not a trunk linear this module quantises). An attention
    linear's group is its layer's kind (g_proj and o_proj exist in both)."""
    if _KEEP.match(name):
        return None
    for g, pat in GROUPS.items():
        if re.fullmatch(pat, name):
            if g in ("kda", "mla"):
                kind = type(model.get_submodule(name.rsplit(".", 1)[0])).__name__
                return "kda" if "Delta" in kind else "mla"
            return g
    return None


@torch.no_grad()
def quantize_trunk_(model: nn.Module, fmt: str, *, promote: tuple[str, ...] | None = None,
                    only: tuple[str, ...] | None = None, group: int = INT4_GROUP) -> dict[str, str]:
    """Replace the trunk's `nn.Linear`s of `model` in place: "int8" all of them, "int4" all but the groups in
    `promote` (default `DEFAULT_PROMOTE`), which get int8; "bf16" leaves the model alone. `only` restricts the
    change to those groups (the quality gate quantises one group at a time). A linear that torch's int4 layout
    cannot hold (`int4_fits`: rows a multiple of 64, inputs of the group) gets int8. Returns {module name: format}
    of what changed."""
    if fmt not in TRUNK_FORMATS:
        raise ValueError(f"trunk must be one of {TRUNK_FORMATS}, got {fmt!r}")
    promote = DEFAULT_PROMOTE if promote is None else tuple(promote)
    for g in (*promote, *(only or ())):
        if g not in GROUPS:
            raise ValueError(f"unknown trunk group {g!r}; groups: {', '.join(GROUPS)}")
    done: dict[str, str] = {}
    if fmt == "bf16":
        return done
    for name, _ in list(model.named_modules()):
        g = group_of(name, model)
        if g is None or (only is not None and g not in only):
            continue
        kind = replace_linear_(model, name, fmt, promote, group)
        if kind is not None:
            done[name] = kind
    if done:
        model.__dict__["trunk_format"] = fmt
        for m in model.modules():  # fused decode weights of the replaced linears are gone
            m.__dict__.pop("_decode_cache", None)
    return done


def replace_linear_(model: nn.Module, name: str, fmt: str, promote: tuple[str, ...] = (),
                    group: int = INT4_GROUP) -> str | None:
    """Quantise the linear `name` of `model` in place (one module: the loader calls this as each weight arrives, so
    a trunk too large for memory in bf16 never is). Returns "int8"/"int4", or None where it stays as it is (not a
    trunk linear, a bias, fmt "bf16")."""
    if fmt == "bf16":
        return None
    mod = model.get_submodule(name)
    g = group_of(name, model)
    if type(mod) is not nn.Linear or mod.bias is not None or g is None or mod.weight.is_meta:
        return None
    kind = "int8" if fmt == "int8" or g in promote or not int4_fits(mod.out_features, mod.in_features, group) \
        else "int4"
    with torch.no_grad():
        new = Int8Linear.from_linear(mod) if kind == "int8" else Int4Linear.from_linear(mod, group)
    new.to(mod.weight.device)
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return kind


# Groups int4 keeps at int8 by default: chosen by the quality gate (docs/inference.md, "Running the release on
# one machine"); lm_head, as the ports that ran K3 do (its errors land directly on the logits).
DEFAULT_PROMOTE: tuple[str, ...] = ("lm_head",)


def nbytes(model: nn.Module) -> int:
    """Bytes the quantised linears hold as the packed matmuls read them (codes + scales; not the int32 twin)."""
    total = 0
    for m in model.modules():
        if isinstance(m, Int8Linear):
            total += m.q.numel() + 4 * m.scale.numel()
        elif isinstance(m, Int4Linear):
            total += m.packed.numel() + 4 * m.scale_zero.numel()
    return total
