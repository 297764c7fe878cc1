"""Rotary position embedding (RoPE) of MLA's decoupled "rope" dims, for `mla_use_nope: false` configs.

K3 and Kimi-Linear never rotate these dims (NoPE). A Kimi K2 / DeepSeek-V3 style MLA, the K2-style baseline
of the scaling lab, rotates the last Dr dims of every query head and the shared key part `kpe` by the
token's position, so the "rope" part of a q.k score depends only on the distance between the two tokens.

Convention: half-split (GPT-NeoX, transformers' `rotate_half`). Dim i pairs with dim i + R/2 and both turn by
the angle pos * inv_freq[i], inv_freq[i] = theta^(-2i/R), i < R/2:
  out = x * cos + rotate_half(x) * sin,  rotate_half([x1, x2]) = [-x2, x1].
DeepSeek-V3's and Kimi K2's own inference code pairs adjacent dims (2i, 2i+1) as complex numbers instead. The
two are the same function up to a fixed permutation of the R rope rows of `q_b_proj` and
`kv_a_proj_with_mqa`: a model trained here is unaffected, but weights from those releases would need those
rows permuted first.

Angles, cos/sin and the rotation are computed in float32 (float64 for float64 inputs) and the result is cast
back to the input's dtype, as DeepSeek-V3 does; a bf16 model's rotated q and kpe are rounded once.

Legend: B batch (or 1: the same positions for every row), T tokens, H heads, R rope dims (Dr).
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where the rotation is computed: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def inv_freq(dim: int, theta: float, *, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """[R/2] angular frequencies theta^(-2i/R) of the R = `dim` rope dims (pair i turns by pos * inv_freq[i])."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=dtype, device=device) / dim)


def cos_sin(pos_BT: torch.Tensor, dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, T, R] of integer positions `pos_BT` in `dtype`, each half-pair's angle written twice
    (dims i and i + R/2), ready for `apply_rope`."""
    angle_BTF = pos_BT.to(dtype)[..., None] * inv_freq(dim, theta, dtype=dtype, device=pos_BT.device)
    angle_BTR = torch.cat([angle_BTF, angle_BTF], dim=-1)
    return angle_BTR.cos(), angle_BTR.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim (its two halves)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [B, T, R] or [B, T, H, R] (every head alike) by `cos_sin`'s tables; same shape and dtype."""
    if x.dim() == 4:
        cos_BTR, sin_BTR = cos_BTR[:, :, None], sin_BTR[:, :, None]
    xc = x.to(cos_BTR.dtype)
    return (xc * cos_BTR + rotate_half(xc) * sin_BTR).to(x.dtype)


def rotate(x: torch.Tensor, pos_BT: torch.Tensor, theta: float) -> torch.Tensor:
    """`x` [B, T, R] or [B, T, H, R] rotated to positions `pos_BT` [B or 1, T] (the whole last dim is rope)."""
    return apply_rope(x, *cos_sin(pos_BT, x.shape[-1], theta, compute_dtype(x.dtype)))


def document_positions(seg_BT: torch.Tensor) -> torch.Tensor:
    """[B, T] position of each token within its document of a packed row: 0 at the row's start and wherever
    the document id changes (where KDA's state resets), counting up until the next change."""
    B, T = seg_BT.shape
    t_BT = torch.arange(T, device=seg_BT.device).expand(B, T)
    start_BT = torch.ones_like(seg_BT, dtype=torch.bool)
    start_BT[:, 1:] = seg_BT[:, 1:] != seg_BT[:, :-1]
    return t_BT - torch.where(start_BT, t_BT, 0).cummax(dim=1).values
