"""FSDP2 over the data-sharding ranks, applied from outside the single-device model (background B.2).

    apply_fsdp(model, mesh)        # fully_shard per decoder layer, then the root (embeddings, final norm,
                                   # the output AttnRes site, lm_head); params become DTensors Shard(0)

Each decoder layer is one FSDP unit (its parameters are all-gathered for its forward and backward and freed
after; `DecoderLayer.forward` is the whole layer, so the hooks see it), the root holds the rest. The trainer
normalises the loss by the global count of loss tokens (local loss sum / all-reduced count), so the *sum* of
the ranks' gradients is the single-process gradient of the concatenated global batch, padding and packing
included. FSDP2 averages over the data ranks (a custom divide factor of 1 needs PREMUL_SUM, which gloo
lacks), so the trainer runs backward on that loss times the number of data ranks. Parameters stay in their
training dtype (fp32: K3's fp32 islands need nothing special); bf16 compute comes from the trainer's
autocast, as on one device (tested equal to one process in bf16). Not FSDP2's MixedPrecisionPolicy (bf16
all-gathers, half the bytes): it casts whole units, and the islands `A_log` / `dt_bias` are parameters of the
attention module itself, so they could not keep fp32 without leaving FSDP (docs/distributed.md).
With parallel.dp_replicate > 1 the mesh is 2-D and FSDP2 runs HSDP (sharded
within a group, replicated across groups).

Buffers (the router's correction bias, which Quantile Balancing updates) are not sharded: every rank holds
them whole and applies the same update from the global batch's statistics (`train.balance`).
"""

from __future__ import annotations

from torch import nn

from openk3.parallel.mesh import Mesh


def apply_fsdp(model: nn.Module, mesh: Mesh, *, reshard_after_forward: bool = True) -> nn.Module:
    """Shard `model` (a `K3ForCausalLM`) in place over `mesh`'s data ranks; a no-op with one data rank."""
    if not mesh.data_parallel:
        return model
    import warnings

    from torch.distributed.fsdp import fully_shard

    # A Block AttnRes layer hands the earlier blocks' snapshots on unchanged; FSDP2 returns those as views of
    # themselves (its backward hooks), then warns that a later in-place op on such a view would skip a hook.
    # Layers never modify their inputs or outputs in place (the equivalence tests would see it), so the warning
    # is noise here, once per layer and step.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor",
                            category=UserWarning)
    device_mesh = mesh.fsdp_mesh()
    # parameters already distributed (routed experts under expert parallelism, `parallel/ep.py`) stay as they
    # are: each lives whole on one rank, nothing to gather
    placed = {p for p in model.parameters() if hasattr(p, "device_mesh")}
    for layer in model.model.layers:
        fully_shard(layer, mesh=device_mesh, reshard_after_forward=reshard_after_forward,
                    ignored_params=placed or None)
    # the root last: it owns what no layer does; it is gathered for the whole step anyway
    fully_shard(model, mesh=device_mesh, reshard_after_forward=False, ignored_params=placed or None)
    return model


def reshard(model: nn.Module) -> None:
    """Put every FSDP unit of `model` back in its sharded state. The root is not resharded after its forward
    (it is needed again at once in training), so after a forward without backward (an evaluation) its
    parameters are still the gathered ones, not the sharded DTensors the optimizer holds; naming the
    optimizer's state through the model (DCP) needs the sharded ones. A no-op on an unsharded model."""
    for module in model.modules():
        if hasattr(module, "reshard") and hasattr(module, "unshard"):
            module.reshard()


def gathered_model(model: nn.Module, mesh: Mesh, build, pipeline=None) -> nn.Module | None:
    """A plain copy of a sharded model on rank 0 (None elsewhere; the model itself on the null mesh), for
    writing the release format. Every rank must call it (each parameter is all-gathered); `build()` makes an
    empty model of the same config. Rank 0 then holds the model twice while saving."""
    if not mesh.distributed:
        return model
    if not mesh.data_parallel:  # pipeline stages: the stages' weights broadcast into every rank's whole model
        if pipeline is not None:
            pipeline.sync(model)
        return model if mesh.is_main else None
    reshard(model)  # named_parameters() then gives every rank the same DTensors
    full = {n: full_tensor(p).detach() for n, p in model.named_parameters()}
    if not mesh.is_main:
        return None
    import torch

    copy = build()
    with torch.no_grad():
        for n, p in copy.named_parameters():
            p.copy_(full[n])
        buffers = dict(model.named_buffers())
        for n, b in copy.named_buffers():
            b.copy_(full_tensor(buffers[n]))
    for name in ("loaded_format",):  # what save() reads off the model
        if hasattr(model, name):
            setattr(copy, name, getattr(model, name))
    return copy


def full_tensor(t):
    """A DTensor's whole value (a collective: every rank must call it); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
