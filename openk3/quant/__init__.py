"""Quantised weights: MXFP4 (the release's routed-expert format, spec §6) and keep-packed experts.

`openk3.quant.mxfp4` holds pure pack/unpack functions; `openk3.quant.packed_experts` the
`PackedExperts` module that `SparseMoE` runs directly from MXFP4.
"""

from openk3.quant.mxfp4 import E2M1_VALUES, GROUP, bits_per_weight, pack, quantize_dequantize, unpack
from openk3.quant.packed_experts import (
    PackedExperts,
    experts_packed,
    pack_model_experts_,
    unpack_model_experts_,
)

__all__ = ["E2M1_VALUES", "GROUP", "PackedExperts", "bits_per_weight", "experts_packed", "pack",
           "pack_model_experts_", "quantize_dequantize", "unpack", "unpack_model_experts_"]
