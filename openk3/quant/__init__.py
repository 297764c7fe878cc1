"""Quantised weight formats: MXFP4, the release's routed-expert format (spec §6).

`openk3.quant.mxfp4` holds pure pack/unpack functions; the `PackedExperts` module that `SparseMoE` runs
directly from MXFP4 is a model piece (`openk3.model.packed_experts`).
"""

from openk3.quant.mxfp4 import E2M1_VALUES, GROUP, bits_per_weight, pack, quantize_dequantize, unpack

__all__ = ["E2M1_VALUES", "GROUP", "bits_per_weight", "pack", "quantize_dequantize", "unpack"]
