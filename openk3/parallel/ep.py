"""Expert parallelism for the (Latent)MoE, applied from outside the single-device model (background B.2).

    apply_ep(model, mesh)     # before apply_fsdp: each rank keeps E/ep routed experts of every MoE layer
                              # (DTensors Shard(0) over the ep ranks) and each SparseMoE gets a dispatcher

Each MoE layer still routes and down-projects its own tokens where they are (the router at full width D in
fp32, then the shared latent projection D -> C), so the all-to-all moves C-wide rows: half of D at K3's
sizes (3584 vs 7168). Per layer and step, on this rank's N tokens:

 1. sort the N*K (token, slot) pairs by expert (experts are numbered rank-major: rank r holds
    [r*E/ep, (r+1)*E/ep)), so the rows for each destination rank are contiguous;
 2. all-to-all the per-expert counts (E integers): how many rows each source sends to each of my experts;
    the send and receive splits follow (one host sync per layer);
 3. all-to-all the rows (`_AllToAll`: its backward is the reverse all-to-all);
 4. order the received rows expert-major and run the local experts (`ops.moe.expert_rows`, grouped matmuls);
 5. undo the order and the all-to-all; combine with the routing weights in fp32 at the source, as
    `experts_grouped` does (the latent norm, the up-projection and the shared experts follow, dense).

Dropless: no capacity factor, so the layer is exactly the one-process function whatever the loads (a rank
may receive no rows at all). Gradients: an expert's weight gradient is summed over every token routed to it
from any rank, while FSDP averages the other gradients over the data ranks (the trainer multiplies the loss
by their number, `parallel/fsdp.py`); the dispatcher divides the expert-weight gradients by the same number
so both follow one convention. Every rank must run every MoE layer the same number of times per step (the
all-to-all is a collective), which the data-parallel trainer does: the same model on every rank's rows.

This version carves ep from dp_shard whole (ep = dp_shard, no dp_replicate): the experts need no FSDP
(each lives on one rank) and their DTensors are Shard(0) on the same mesh as the FSDP-sharded parameters,
so gradient clipping, Muon (per-expert Newton-Schulz on the local experts, no gathering), DCP checkpoints
and the release-format export treat them like any other sharded parameter.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.common import upcast
from openk3.ops.moe import expert_rows
from openk3.parallel.mesh import Mesh


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` (the expert weights' share of the data-rank average)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.scale, None


class _AllToAll(torch.autograd.Function):
    """Rows [sum(send), C] -> [sum(recv), C]: rank r's send[j] rows go to rank j, which receives recv[r] rows from
    it; the backward is the same exchange reversed. Synchronous (torch.distributed.all_to_all_single): no
    collective is left pending when the step ends."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        import torch.distributed as dist

        out = g.new_empty(sum(ctx.send), *g.shape[1:])
        dist.all_to_all_single(out, g.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return out, None, None, None


class ExpertDispatcher:
    """`SparseMoE.dispatcher` under expert parallelism: (z_NC, weights_NK, idx_NK, experts, glu) -> r_NC."""

    def __init__(self, device_mesh, ep: int, num_experts: int, *, grad_divisor: int) -> None:
        assert num_experts % ep == 0, (num_experts, ep)
        self.device_mesh, self.ep, self.num_experts = device_mesh, ep, num_experts
        self.local = num_experts // ep
        self.grad_scale = 1.0 / grad_divisor
        self.group = device_mesh.get_group()
        self.calls = 0  # MoE layer calls dispatched, and the rows this rank's experts computed (load statistics)
        self.rows_received = 0

    def exchange_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """counts_E[e]: rows this rank sends to expert e -> [ep, E/ep]: rows each source sends to each local
        expert (all-to-all of equal splits of E/ep integers)."""
        import torch.distributed as dist

        recv = torch.empty_like(counts_E)
        dist.all_to_all_single(recv, counts_E.contiguous(), group=self.group)
        return recv.view(self.ep, self.local)

    def __call__(self, z_NC: torch.Tensor, weights_NK: torch.Tensor, idx_NK: torch.Tensor, experts: nn.Module,
                 glu) -> torch.Tensor:
        N, K = idx_NK.shape
        flat_M = idx_NK.reshape(-1)
        order_M = torch.argsort(flat_M, stable=True)
        tok_M = order_M // K
        counts_E = torch.bincount(flat_M, minlength=self.num_experts)
        recv_SL = self.exchange_counts(counts_E)
        send_splits = counts_E.view(self.ep, self.local).sum(1).tolist()
        recv_splits = recv_SL.sum(1).tolist()  # the one host sync
        self.calls += 1
        self.rows_received += sum(recv_splits)

        xs_MC = z_NC[tok_M]  # destination-rank-major, expert-major within
        recv_RC = _AllToAll.apply(xs_MC, send_splits, recv_splits, self.group)
        # received: source-major, then expert within each source -> expert-major (stable: sources in order)
        local_R = torch.repeat_interleave(torch.arange(self.local, device=z_NC.device).repeat(self.ep),
                                          recv_SL.reshape(-1).to(z_NC.device))
        perm_R = torch.argsort(local_R, stable=True)
        counts_L = recv_SL.sum(0)
        offs = counts_L.cumsum(0).to(device=z_NC.device, dtype=torch.int32)
        w1, w3, w2 = (_ScaleGrad.apply(_local(w), self.grad_scale) for w in (experts.w1, experts.w3, experts.w2))
        y_RC = expert_rows(recv_RC[perm_R], counts_L.tolist(), offs, w1, w3, w2, glu)
        inv_R = torch.empty_like(perm_R)
        inv_R[perm_R] = torch.arange(perm_R.numel(), device=perm_R.device)
        back_MC = _AllToAll.apply(y_RC[inv_R], recv_splits, send_splits, self.group)
        yw_MC = upcast(back_MC) * weights_NK.reshape(-1)[order_M, None]
        out_NC = torch.zeros(z_NC.shape, dtype=yw_MC.dtype, device=z_NC.device).index_add(0, tok_M, yw_MC)
        return out_NC.to(z_NC.dtype)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def check_ep(num_experts: int, ep: int) -> None:
    """ValueError naming the degree when `ep` ranks cannot split the experts evenly."""
    if ep > 1 and (num_experts == 0 or num_experts % ep):
        raise ValueError(f"parallel.ep={ep} must divide the model's num_experts={num_experts} (each expert-parallel "
                         f"rank holds num_experts / ep whole experts of every MoE layer)")


def expert_map(num_experts: int, ep: int) -> list[tuple[int, int]]:
    """[(first, last expert)] held by each expert-parallel rank."""
    per = num_experts // ep
    return [(r * per, (r + 1) * per - 1) for r in range(ep)]


def apply_ep(model: nn.Module, mesh: Mesh) -> nn.Module:
    """Spread `model`'s (a `K3ForCausalLM`) routed experts over `mesh`'s expert-parallel ranks, in place; a
    no-op when parallel.ep is 1. Call it before `apply_fsdp` (which leaves these parameters to it) and before
    the optimizer is built. Every rank must hold the same weights (the same seed, or the same checkpoint)."""
    ep = mesh.cfg.ep
    if ep == 1 or not mesh.distributed:
        return model
    from torch.distributed.tensor import Shard, distribute_tensor

    from openk3.model.moe import SparseMoE

    check_ep(model.config.num_experts, ep)
    device_mesh = mesh.ep_mesh()
    dispatcher = ExpertDispatcher(device_mesh, ep, model.config.num_experts, grad_divisor=mesh.dp_size)
    for module in model.modules():
        if not isinstance(module, SparseMoE):
            continue
        ex = module.experts
        if hasattr(ex, "w1_packed"):
            raise ValueError("expert parallelism trains unpacked experts; load the checkpoint with "
                             "keep_packed=False (MXFP4 experts are dequantised for training)")
        for name in ("w1", "w3", "w2"):
            p = getattr(ex, name)
            # each rank keeps its own slice of its own (identical) copy: no communication
            shard = distribute_tensor(p.detach(), device_mesh, [Shard(0)], src_data_rank=None)
            setattr(ex, name, nn.Parameter(shard, requires_grad=p.requires_grad))
        module.dispatcher = dispatcher
    return model
