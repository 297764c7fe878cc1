"""One LatentMoE layer under expert parallelism against the same layer in one process, for
tests/test_parallel.py (run under torchrun with 2 processes; rank 0 writes the errors to OUT.pt).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ep_layer_worker.py OUT.pt

Cases: nano's layer in float64 with its random routing (uneven loads), with every token steered to rank 0's
experts (rank 1's experts get no rows), and the same in float32 (torch's grouped matmul on empty groups).
Each rank feeds its own tokens; the reference runs the whole global batch through an undistributed copy.
Errors are relative to the largest reference value.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from openk3.common import setup_cpu
from openk3.config import preset
from openk3.model.layers import make_glu
from openk3.model.moe import SparseMoE
from openk3.parallel.ep import ExpertDispatcher

N = 13  # tokens per rank (odd, so nothing lines up by accident)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error relative to the largest reference value (0 when both are zero: experts without rows)."""
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)


def case(dtype: torch.dtype, steer: bool, device_mesh, rank: int, world: int) -> dict:
    cfg = preset("nano")
    torch.manual_seed(0)
    glu = make_glu(cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    ref = SparseMoE(cfg, glu).to(dtype)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    bias = torch.zeros(cfg.num_experts)
    if steer:  # top-4 of the 16 experts of rank 0: rank 1 computes nothing, sends everything
        bias[: cfg.num_experts // world] = 10.0
    ref.gate.e_score_correction_bias.copy_(bias)
    ep = SparseMoE(cfg, glu).to(dtype)
    ep.load_state_dict(ref.state_dict())
    per = cfg.num_experts // world
    from torch.distributed.tensor import DTensor, Shard

    for name in ("w1", "w3", "w2"):
        full = getattr(ref.experts, name).detach()
        local = full[rank * per:(rank + 1) * per].clone()
        setattr(ep.experts, name, torch.nn.Parameter(DTensor.from_local(local, device_mesh, [Shard(0)])))
    ep.dispatcher = ExpertDispatcher(device_mesh, world, cfg.num_experts, grad_divisor=1)

    g = torch.Generator().manual_seed(7)
    x_all = torch.randn(world, N, cfg.hidden_size, generator=g, dtype=dtype)
    dy_all = torch.randn(world, N, cfg.hidden_size, generator=g, dtype=dtype)
    # reference: the global batch in one call
    x_ref = x_all.clone().requires_grad_()
    (ref(x_ref) * dy_all).sum().backward()
    # expert parallel: this rank's tokens
    x = x_all[rank:rank + 1].clone().requires_grad_()
    (ep(x) * dy_all[rank:rank + 1]).sum().backward()
    rows = ep.dispatcher.rows_received  # of that one call
    out = ep(x_all[rank:rank + 1]).detach()
    errs = {"out": rel(out, ref(x_all)[rank:rank + 1].detach()), "dx": rel(x.grad, x_ref.grad[rank:rank + 1])}
    for name, p in ep.named_parameters():
        ref_grad = dict(ref.named_parameters())[name].grad
        if hasattr(p.grad, "to_local"):  # this rank's experts: every token's contribution is already here
            got, want = p.grad.to_local(), ref_grad[rank * per:(rank + 1) * per]
        else:  # replicated weights: each rank holds its tokens' share
            got, want = p.grad.clone(), ref_grad
            dist.all_reduce(got)
        errs[name] = rel(got, want)
    errs["rows_received"] = rows
    return errs


def main(out_path: str) -> None:
    setup_cpu(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    results = {f"{dtype}/{'steered' if steer else 'random'}": case(dtype, steer, device_mesh, rank, world)
               for dtype in (torch.float64, torch.float32) for steer in (False, True)}
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        torch.save(gathered, out_path)
    dist.barrier()  # nobody tears its group down while another still talks
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # Under load, about one run in three aborted *after* a clean destroy_process_group, in the interpreter's
    # teardown ("terminate called without an active exception": a C++ thread of torch still joinable when its
    # static owner is destroyed). The work is done and written by then; leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
