"""Sharded training state through torch DCP (`torch.distributed.checkpoint`), for runs on several processes.

    save_optimizer(model, opt, staging)     # every rank writes its shards (a collective)
    load_optimizer(model, opt, folder)      # any world size: DCP reshards to this run's layout
    save_model(model, staging) / load_model(model, folder)     # the weights and router biases, the same way

Why: the optimizer state is the largest part of a training checkpoint (Muon's momentum and AdamW's two
moments: up to 3x the fp32 parameters); gathering it whole on rank 0 at every save is what stops a sharded run
from scaling. At world size > 1 the trainer writes it with DCP into a staging folder next to the checkpoints
(`.dcp-step_*`), and rank 0 moves that folder into the checkpoint (`optimizer_dcp/`) inside the same atomic
write that commits the weights and `trainer_state.pt` (whose "optimizer" entry then says where it is), so a
save killed at any point leaves the previous checkpoint as `latest` and a staging folder that the next start
removes. The weights go both ways: as DCP shards (`model_dcp/`, what a multi-process resume reads: each rank
only its rows) and whole in the release format (the export `openk3.load` opens, and what a one-process resume
reads).

The state dicts are torch's (`get_optimizer_state_dict`: parameters by their names), so a checkpoint written
by N processes loads on M, or on one process, where the model is not sharded (tests/test_parallel.py).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

#: the checkpoint sub-folders with the optimizer's and the weights' DCP shards, and the staging folders' prefix
OPTIMIZER_DIR = "optimizer_dcp"
MODEL_DIR = "model_dcp"
STAGING_PREFIX = ".dcp-"


def _state(model: nn.Module, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from openk3.parallel.fsdp import reshard

    reshard(model)  # the optimizer holds the sharded parameters; DCP maps them to names through the model
    return {name: get_optimizer_state_dict(model, o) for name, o in (("muon", opt.muon), ("adamw", opt.adamw))
            if o is not None}


def save_optimizer(model: nn.Module, opt, folder: str | Path) -> None:
    """Write `opt` (an `OptimizerSet`) as DCP shards into `folder` (every rank calls it)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, opt), checkpoint_id=str(folder))


def load_optimizer(model: nn.Module, opt, folder: str | Path) -> None:
    """Load DCP shards from `folder` into `opt`, resharded to this run's parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    folder = Path(folder)
    if not (folder / ".metadata").is_file():
        raise ValueError(f"{folder}: no DCP optimizer state (.metadata missing)")
    from torch.distributed.checkpoint import DefaultLoadPlanner

    state = _state(model, opt)  # the target layout (initialises the state with a zero-lr step if empty)
    # partial: a parameter that never had a gradient (layer 0's first AttnRes site mixes nothing) has no state
    # in the checkpoint; the zero state the initialisation gave it never moves it either
    dcp.load(state, checkpoint_id=str(folder), planner=DefaultLoadPlanner(allow_partial_load=True))
    for name, o in (("muon", opt.muon), ("adamw", opt.adamw)):
        if o is not None:
            set_optimizer_state_dict(model, o, state[name])


def save_model(model: nn.Module, folder: str | Path) -> None:
    """Write the model's weights and buffers as DCP shards into `folder` (every rank calls it; each writes the
    rows it holds: FSDP2 and expert shards, or, where every rank holds a tensor whole, one copy)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from openk3.parallel.fsdp import reshard

    reshard(model)
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(folder))


def load_model(model: nn.Module, folder: str | Path) -> None:
    """Load DCP weight shards from `folder` into `model` in place, resharded to its layout: each rank reads
    only the rows it holds (a resume on N processes does not read the whole model N times)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from openk3.parallel.fsdp import reshard

    folder = Path(folder)
    if not (folder / ".metadata").is_file():
        raise ValueError(f"{folder}: no DCP weights (.metadata missing)")
    reshard(model)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(folder))
    set_model_state_dict(model, state["model"])
