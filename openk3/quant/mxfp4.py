"""MXFP4 (OCP Microscaling v1.0, FP4 E2M1 elements, E8M0 scales, groups of 32) as stored by the
release's compressed-tensors `mxfp4-pack-quantized` routed experts (spec §6). Pure functions.

Layout per logical matrix W [out, in] (any leading batch dims allowed, e.g. [E, out, in]):

* `packed` uint8 [..., in/2]: element 2i in the **low** nibble of byte i, element 2i+1 in the high one.
  Nibble = E2M1 code: bit 3 sign, bits 0-2 index into {0, 0.5, 1, 1.5, 2, 3, 4, 6} (`E2M1_VALUES`).
* `scale` uint8 [..., in/32]: E8M0 byte b -> 2^(b - 127), one per group of 32 along `in`.
  Byte 255 is NaN in OCP MX; `unpack` refuses it (ValueError) instead of producing NaN weights.

Dequantisation `W = E2M1(code) * 2^(b - 127)` is exact in float64 for every byte, and in float32 /
bfloat16 whenever the product is a normal number (bytes 2..252 for any code; the release uses
112..122). `pack` quantises by the OCP rule; see its docstring for the zero-group and tie choices.
`pack(unpack(p, s))` gives back the same values (and the same bytes when they are in `pack`'s
canonical form), which is what lets `openk3.save` re-write experts loaded from MXFP4.
"""

from __future__ import annotations

import math

import torch

GROUP = 32  # elements sharing one E8M0 scale, along the input (last) dimension
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of the largest E2M1 normal (6 = 1.5 * 2^2)
SCALE_BIAS = 127
SCALE_NAN = 255
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# All 16 codes, by code: 0..7 positive, 8..15 the same magnitudes negated (code 8 is -0).
E2M1_VALUES = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32)

# Round-to-nearest on magnitudes: midpoints between neighbouring magnitudes, split by which side wins
# a tie. Ties go to the even code (magnitude index with LSB 0 = mantissa bit 0, as IEEE RNE does):
# the midpoint after an even index rounds down, the one after an odd index rounds up.
_MID_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)  # after indices 0, 2, 4, 6
_MID_TIE_UP = (0.75, 1.75, 3.5)  # after indices 1, 3, 5

_PACK_CHUNK = 1 << 22  # elements quantised at a time (bounds pack's float64 working memory)
_LUTS: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def bits_per_weight() -> float:
    """4 bits per element plus one 8-bit scale per group of 32: 4.25."""
    return 4 + 8 / GROUP


def _lut(kind: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Cached small tables, built exactly in Python floats then moved to (dtype, device).

    "pairs": [256, 2] the two element values of each packed byte (low nibble first).
    "scale": [256] 2^(b - 127) (entry 255 is NaN, never used: `unpack` rejects the byte).
    "inv_scale": [256] 2^(127 - b), float64 (pack's exact division).
    """
    key = (kind, dtype, torch.device(device))
    t = _LUTS.get(key)
    if t is None:
        if kind == "pairs":
            vals = E2M1_VALUES.tolist()
            data = [[vals[b & 0xF], vals[b >> 4]] for b in range(256)]
        elif kind == "scale":
            data = [math.ldexp(1.0, b - SCALE_BIAS) for b in range(255)] + [math.nan]
        else:
            data = [math.ldexp(1.0, SCALE_BIAS - b) for b in range(255)] + [math.nan]
        t = torch.tensor(data, dtype=dtype, device=device)
        _LUTS[key] = t
    return t


def _check_packed(packed: torch.Tensor, scale: torch.Tensor) -> int:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8, got packed {packed.dtype} and scale {scale.dtype}")
    if packed.dim() < 1 or packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] * 2 != scale.shape[-1] * GROUP:
        raise ValueError(f"MXFP4 shapes disagree: packed {tuple(packed.shape)} needs scale "
                         f"{tuple(packed.shape[:-1]) + (packed.shape[-1] * 2 // GROUP,)}, got {tuple(scale.shape)}")
    return packed.shape[-1] * 2


def unpack(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantise: packed uint8 [..., in/2] + scale uint8 [..., in/32] -> [..., in] in `dtype`.

    Two table gathers (byte -> its two E2M1 values; scale byte -> 2^(b-127)) and one multiply, computed
    in `dtype` for bfloat16/float32/float64 (exact, see the module docstring) and in float32 for any
    other floating dtype (then rounded to it); in float64 when a scale byte is 0 (a subnormal scale
    in float32), so that every product that is a normal number comes out exact. Raises ValueError on
    scale byte 255 (E8M0 NaN), on non-uint8 inputs and on mismatched shapes.
    """
    n_in = _check_packed(packed, scale)
    if not dtype.is_floating_point:
        raise ValueError(f"unpack needs a floating dtype, got {dtype}")
    out_shape = (*packed.shape[:-1], n_in)
    if packed.device.type == "meta":
        return torch.empty(out_shape, dtype=dtype, device="meta")
    # one host read for both bounds (a device sync on GPU: this runs per expert on the packed decode path)
    lo, hi = torch.stack(torch.aminmax(scale)).tolist() if scale.numel() else (SCALE_BIAS, SCALE_BIAS)
    if hi == SCALE_NAN:
        raise ValueError("MXFP4 scale byte 255 (E8M0 NaN) found; refusing to produce NaN weights")
    cdt = dtype if dtype in (torch.bfloat16, torch.float32, torch.float64) else torch.float32
    if lo == 0 and cdt != torch.float64:
        # 2^-127 is subnormal in float32/bfloat16 (flushed to 0 where denormals are flushed), although
        # its products with codes >= 2 are normal: such rows are computed in float64, then rounded
        cdt = torch.float64
    vals = _lut("pairs", cdt, packed.device)[packed.int()]  # [..., in/2, 2]
    vals = vals.reshape(*packed.shape[:-1], n_in // GROUP, GROUP)
    s = _lut("scale", cdt, packed.device)[scale.int()]  # [..., in/32]
    return (vals * s.unsqueeze(-1)).reshape(out_shape).to(dtype)


def _pack_rows(w_RG: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise rows of float64 groups [R, G, 32] -> codes uint8 [R, G, 32], scale bytes uint8 [R, G]."""
    amax = w_RG.abs().amax(-1)
    _, e = torch.frexp(amax)  # amax = m * 2^e with m in [0.5, 1): floor(log2(amax)) = e - 1
    x = (e.to(torch.int32) - 1 - E2M1_EMAX).clamp(-SCALE_BIAS, SCALE_BIAS)
    x = torch.where(amax == 0, -SCALE_BIAS, x)  # all-zero group -> byte 0 (log2(0) = -inf, clamped)
    sbyte = (x + SCALE_BIAS).to(torch.uint8)
    scaled = w_RG * _lut("inv_scale", torch.float64, w_RG.device)[sbyte.int()].unsqueeze(-1)  # exact
    a = scaled.abs()
    lo = torch.tensor(_MID_TIE_DOWN, dtype=torch.float64, device=a.device)
    hi = torch.tensor(_MID_TIE_UP, dtype=torch.float64, device=a.device)
    # index = #(tie-down midpoints strictly below a) + #(tie-up midpoints at or below a); saturates at 7
    mag = torch.bucketize(a, lo, right=False) + torch.bucketize(a, hi, right=True)
    codes = mag.to(torch.uint8) | (torch.signbit(scaled).to(torch.uint8) << 3)
    return codes, sbyte


def pack(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise `weight` [..., in] (floating, finite, in % 32 == 0) to MXFP4 -> (packed [..., in/2],
    scale [..., in/32]), both uint8, on the weight's device. OCP MX v1.0 conversion:

    * shared exponent per group of 32: X = floor(log2(amax)) - 2 (2 = emax of E2M1), clamped to the
      E8M0 range [-127, 127]; scale byte = X + 127. An all-zero group gets byte 0 (X = -127, the
      clamp of log2(0) = -inf: the smallest scale); its elements decode to (+-)0.
    * element = w / 2^X (exact, in float64) rounded to the nearest E2M1 value, ties to the even code
      (magnitude index with LSB 0: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4,
      5 -> 4), saturating at +-6 (|w| / 2^X can reach just under 8). The sign bit is w's sign bit, so
      -0.0 and negatives that round to zero give code 8 (-0).

    Values that are already MXFP4-representable with the scale this rule picks (e.g. `unpack`'s
    output) come back bit for bit.
    """
    if not torch.is_floating_point(weight):
        raise ValueError(f"pack needs a floating tensor, got {weight.dtype}")
    if weight.dim() < 1 or weight.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {GROUP}, got shape {tuple(weight.shape)}")
    n_in = weight.shape[-1]
    lead = weight.shape[:-1]
    if weight.device.type == "meta":
        return (torch.empty((*lead, n_in // 2), dtype=torch.uint8, device="meta"),
                torch.empty((*lead, n_in // GROUP), dtype=torch.uint8, device="meta"))
    w = weight.detach().reshape(-1, n_in)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("pack needs finite weights (found inf or NaN)")
    packed = torch.empty((w.shape[0], n_in // 2), dtype=torch.uint8, device=w.device)
    scale = torch.empty((w.shape[0], n_in // GROUP), dtype=torch.uint8, device=w.device)
    rows = max(1, _PACK_CHUNK // n_in)
    for r0 in range(0, w.shape[0], rows):
        chunk = w[r0:r0 + rows].to(torch.float64).reshape(-1, n_in // GROUP, GROUP)
        codes, sbyte = _pack_rows(chunk)
        codes = codes.reshape(-1, n_in)
        packed[r0:r0 + rows] = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scale[r0:r0 + rows] = sbyte
    return packed.reshape(*lead, n_in // 2), scale.reshape(*lead, n_in // GROUP)


def quantize_dequantize(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`unpack(*pack(weight))` in `dtype` (default the weight's): the nearest MXFP4-representable tensor."""
    return unpack(*pack(weight), dtype=dtype or weight.dtype)
