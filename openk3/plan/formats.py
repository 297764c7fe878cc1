"""Number formats the planner prices: bytes per stored value and the compute type each runs in.

Block formats include their scales (MXFP4 = 4-bit E2M1 codes + one E8M0 byte per 32 values = 4.25
bits, exactly the release's routed experts, spec §6). Weight-only integer formats (W8A16, W4A16)
dequantise to bf16 before the matmul, so they compute at the bf16 rate.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    name: str
    bytes_per_value: float
    compute: str  # "bf16" | "fp8" | "fp4": the tensor-core rate a matmul on these weights uses
    note: str


WEIGHT_FORMATS = {f.name: f for f in (
    Format("bf16", 2.0, "bf16", "bfloat16; the release's format for everything but the routed experts"),
    Format("fp8", 1.0 + 4 / (128 * 128), "fp8", "E4M3 with one fp32 scale per 128x128 block (DeepSeek-V3 style)"),
    Format("mxfp4", 0.5 + 1 / 32, "fp4", "OCP MXFP4: E2M1 codes + one E8M0 scale byte per 32 (release experts)"),
    Format("int8", 1.0 + 2 / 128, "bf16", "weight-only int8, one bf16 scale per group of 128 (W8A16)"),
    Format("int4", 0.5 + 2 / 32, "bf16", "weight-only int4, one bf16 scale per group of 32 (W4A16, K2-Thinking's QAT)"),
)}

# Decode state: KDA recurrent state (fp32 in the reference), MLA latent cache (bf16; fp8 in some engines).
STATE_FORMATS = {"fp32": 4, "bf16": 2, "fp8": 1}


def weight_format(name: str, what: str = "weight format") -> Format:
    if name not in WEIGHT_FORMATS:
        raise ValueError(f"unknown {what} {name!r}{_hint(name, WEIGHT_FORMATS)}; choose from {sorted(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[name]


def state_format(name: str, what: str = "state format") -> int:
    """Bytes per value of a cache/state format."""
    if name not in STATE_FORMATS:
        raise ValueError(f"unknown {what} {name!r}{_hint(name, STATE_FORMATS)}; choose from {sorted(STATE_FORMATS)}")
    return STATE_FORMATS[name]


def _hint(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), 1)
    return f" (did you mean {close[0]!r}?)" if close else ""
