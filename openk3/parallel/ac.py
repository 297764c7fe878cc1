"""Activation checkpointing, applied from outside the single-device model (as FSDP and EP are).

    apply_activation_checkpointing(model)   # every decoder layer's token mixer and FFN recomputed in the backward

A decoder layer has no single forward worth wrapping whole: with Block AttnRes it mixes the snapshots between
its two sub-layers. So `DecoderLayer.forward` calls its token mixer (`attn`) and FFN (`ffn`) through the
layer's `sublayer_wrapper`, which this module sets to a non-reentrant `torch.utils.checkpoint`. What stays
resident per layer is each sub-layer's input plus the AttnRes mixes; the backward re-runs each sub-layer's
forward (forward hooks fire again: the trainer drops the repeated MoE routing records). Without grad
(evaluation, decoding) the sub-layers run plainly, and an attention call with a decode state never reaches
the wrapper. No module is wrapped, renamed or moved: parameter and state-dict names stay the model's.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.model.model import DecoderLayer


def checkpointed(fn, *args):
    """`fn(*args)`, its activations recomputed in the backward instead of kept (when grad is enabled)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(fn, *args, use_reentrant=False)


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each decoder layer's token mixer and FFN in the backward, in place, on `model` (a
    `K3ForCausalLM`, a `K3Model` or any module holding `DecoderLayer`s). Idempotent: applying it again changes
    nothing. ValueError when `model` has no decoder layer or a layer already has another sub-layer wrapper."""
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    if not layers:
        raise ValueError(f"activation checkpointing: {type(model).__name__} has no decoder layers")
    for layer in layers:
        if layer.sublayer_wrapper not in (None, checkpointed):
            raise ValueError(f"activation checkpointing: decoder layer {layer.layer} already calls its sub-layers "
                             f"through {layer.sublayer_wrapper!r}")
    for layer in layers:
        layer.sublayer_wrapper = checkpointed
    return model
