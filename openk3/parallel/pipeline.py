"""Pipeline parallelism with stages cut at Block AttnRes boundaries (background B.3), on torch's pipelining.

    bounds = stage_bounds(model.config, pp=2)         # [(0, 3), (3, 9)]: layers of each stage
    pipe = PipelineParallel(model, mesh, n_micro=4)   # this rank's stage; Schedule1F1B over the pp ranks
    loss = pipe.step(ids, labels, seg, count)         # forward + backward of the step's micro-batches
    pipe.sync(model)                                  # every rank gets every stage's weights (eval, saves)

What crosses a stage boundary. With Block AttnRes there is no residual stream: a layer reads the snapshots
of the completed blocks (the bank) and the running sum of the current block (the prefix). A cut placed at a
block boundary (a snapshot layer starts the next stage) sends the bank so far plus the prefix, which the
next stage's first layer turns into the newest snapshot at once: (snapshots before the cut + 1) x [b, T, D],
packed into one tensor so the row count is static per boundary, as torch's pipelining needs. A cut inside a
block would have to send the same rows and split a block's prefix between two stages for no gain; it is
refused (`parallel.pp_cuts`). Without AttnRes (Kimi-Linear configs) the packed tensor is the residual stream
and any layer may start a stage. The token's document index (packed rows) travels beside it, so every stage
keeps KDA and MLA inside documents.

The schedule is torch's `Schedule1F1B` (`ScheduleGPipe` when there are fewer micro-batches than stages) with
`scale_grads=False`: the last stage's loss is each micro-batch's token-loss sum divided by the step's loss-
token count, so the micro-batch gradients add up to the whole batch's, as in one process. The micro-batches
are the trainer's `grad_accum`. Stage 0 holds the embedding, the last stage the output AttnRes mix, the final
norm and the head. A stage runs the model's own pieces (`K3Model.embed`, `run_layers` over its layers,
`output`), so it computes exactly the one-process forward's share.

This version: pp alone (no data, expert or context parallelism beside it), and every rank keeps the whole
model: it trains and holds gradients and optimizer state only for its own stage's parameters (the optimizer
skips parameters without gradients), and `sync` broadcasts each stage's weights and router biases from their
owner before an evaluation or a save, which then run as in one process. Activation, gradient and optimizer
memory is split; weight memory is not yet.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.parallel.mesh import Mesh


def stage_bounds(model_cfg, pp: int, cuts: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """The [start, end) layers of each of `pp` stages: at `cuts` (the first layer of stages 1..pp-1) when given,
    else at the AttnRes block boundaries that balance the layer counts best. ValueError naming parallel.pp or
    parallel.pp_cuts when the model cannot be cut so."""
    n = model_cfg.num_hidden_layers
    block = model_cfg.attn_res_block_size
    allowed = [i for i in range(1, n) if block is None or i % block == 0]
    if cuts:
        cuts = tuple(int(c) for c in cuts)
        if len(cuts) != pp - 1:
            raise ValueError(f"parallel.pp_cuts={list(cuts)}: {pp} stages need {pp - 1} cut(s) (the first layer of "
                             "every stage after the first)")
        if list(cuts) != sorted(set(cuts)) or cuts[0] < 1 or cuts[-1] >= n:
            raise ValueError(f"parallel.pp_cuts={list(cuts)}: cuts must increase strictly within 1..{n - 1}")
        for c in cuts:
            if c not in allowed:
                raise ValueError(f"parallel.pp_cuts={list(cuts)}: layer {c} is inside an AttnRes block (blocks start "
                                 f"every {block} layers: {', '.join(map(str, [0, *allowed]))}); a stage must "
                                 "start at a block boundary, where the bank of snapshots is all that crosses")
    else:
        if len(allowed) < pp - 1:
            what = f"{len(allowed) + 1} AttnRes blocks" if block is not None else f"{n} layers"
            raise ValueError(f"parallel.pp={pp}: the model has only {what}; a stage needs at least one")
        chosen: list[int] = []
        for s in range(1, pp):  # the allowed cut nearest the ideal, leaving enough for the cuts after it
            after = pp - 1 - s
            options = [c for c in allowed if c > (chosen[-1] if chosen else 0)
                       and sum(r > c for r in allowed) >= after]
            chosen.append(min(options, key=lambda c: (abs(c - s * n / pp), c)))
        cuts = tuple(chosen)
    edges = [0, *cuts, n]
    return [(edges[i], edges[i + 1]) for i in range(pp)]


def bank_rows(model_cfg, cut: int) -> int:
    """Rows of the packed tensor crossing the boundary before layer `cut`: the snapshots taken before it plus
    the prefix (1 without AttnRes: the residual stream)."""
    if not model_cfg.use_attn_res:
        return 1
    return sum(model_cfg.is_snapshot_layer(i) for i in range(cut)) + 1


class StageModule(nn.Module):
    """Layers [start, end) of a `K3ForCausalLM` (shared, not copied), with the embedding on the first stage
    and the output mix, final norm and head on the last. forward: (ids or packed bank, document index) ->
    (packed bank, document index), or logits on the last stage.

    It runs the model's own pieces (`K3Model.embed`, `run_layers`, `output`), so a stage computes exactly what
    the one-process forward computes for its layers. Only the stage's modules are registered (torch's
    `PipelineStage` trains, moves and clips `parameters()`); the whole `K3Model` is held unregistered."""

    def __init__(self, model: nn.Module, start: int, end: int) -> None:
        super().__init__()
        cfg = model.config
        self.start, self.end = start, end
        self.first, self.last = start == 0, end == cfg.num_hidden_layers
        self.use_seg = False  # set per step by the pipeline (the seg tensor always travels: static signature)
        object.__setattr__(self, "body", model.model)  # not a submodule: its other stages' parameters stay out
        self.layers = nn.ModuleList(model.model.layers[start:end])
        if self.first:
            self.embed_tokens = model.model.embed_tokens
        if self.last:
            self.norm, self.lm_head = model.model.norm, model.lm_head
            if cfg.use_attn_res:
                self.output_attn_res_norm = model.model.output_attn_res_norm
                self.output_attn_res_proj = model.model.output_attn_res_proj

    def forward(self, x: torch.Tensor, seg_f: torch.Tensor):
        seg_BT = seg_f.long() if self.use_seg else None
        if self.first:
            x_BTD, blocks = self.body.embed(x), []
        else:  # [bank rows + 1, b, T, D]: the snapshots so far, then the prefix (or the residual stream)
            rows = list(x.unbind(0))
            x_BTD, blocks = rows[-1], rows[:-1]
        x_BTD, blocks = self.body.run_layers(self.start, self.end, x_BTD, blocks, seg_BT=seg_BT)
        if not self.last:
            return torch.stack([*blocks, x_BTD]), seg_f
        return self.lm_head(self.body.output(x_BTD, blocks))


class PipelineParallel:
    """This rank's stage of a `parallel.pp` run and the schedule that drives it (module docstring)."""

    def __init__(self, model: nn.Module, mesh: Mesh, *, n_micro: int, device: torch.device | str = "cpu") -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        pp = mesh.cfg.pp
        assert mesh.distributed and pp > 1 and mesh.world_size == pp, mesh.cfg
        self.mesh, self.pp, self.index = mesh, pp, mesh.rank
        self.bounds = stage_bounds(model.config, pp, mesh.cfg.pp_cuts)
        self.module = StageModule(model, *self.bounds[self.index])
        self.group = mesh.device_mesh.get_group()
        self.stage = PipelineStage(self.module, self.index, pp, torch.device(device), group=self.group)
        self.count = torch.ones(())
        kind = Schedule1F1B if n_micro >= pp else ScheduleGPipe
        self.schedule = kind(self.stage, n_microbatches=n_micro, loss_fn=self._loss, scale_grads=False)

    @property
    def last(self) -> bool:
        return self.index == self.pp - 1

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from openk3.ops.loss import cross_entropy_sum

        loss_sum, _ = cross_entropy_sum(logits, labels)
        return loss_sum / self.count

    def step(self, ids: torch.Tensor, labels: torch.Tensor, seg: torch.Tensor | None,
             count: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one step's rows (split into the micro-batches); every rank returns the
        step's loss (the mean over its loss tokens), which only the last stage computes."""
        self.count = count.clamp_min(1)
        self.module.use_seg = seg is not None
        seg_f = (seg if seg is not None else torch.zeros_like(ids)).float()
        loss = torch.zeros((), device=ids.device)
        if self.index == 0:
            self.schedule.step(ids, seg_f)
        elif self.last:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=labels, losses=losses)
            loss = torch.stack([x.detach() for x in losses]).sum()
        else:
            self.schedule.step()
        import torch.distributed as dist

        dist.broadcast(loss, src=self.pp - 1, group=self.group)
        return loss

    def clip_grad_norm_(self, params, max_norm: float | None) -> torch.Tensor:
        """The gradient norm over every stage (each rank holds its stage's gradients), clipped to `max_norm`."""
        import torch.distributed as dist

        grads = [p.grad for p in params if p.grad is not None]
        sq = torch.stack([g.detach().float().square().sum() for g in grads]).sum() if grads else torch.zeros(())
        dist.all_reduce(sq, group=self.group)
        norm = sq.sqrt()
        if max_norm is not None and norm > max_norm:
            for g in grads:
                g.mul_(max_norm / (norm + 1e-6))
        return norm

    def drop_foreign_state(self, opt) -> None:
        """Forget optimizer state of parameters outside this stage (a resume from a one-process checkpoint loads
        all of it): they never get gradients here, so their state would only go stale and, saved through DCP
        beside their owner's, could be the copy kept."""
        own = {id(p) for p in self.module.parameters()}
        for o in opt.optimizers:
            for p in list(o.state):
                if id(p) not in own:
                    del o.state[p]

    def sync(self, model: nn.Module) -> None:
        """Every rank gets each stage's current weights and buffers (the router biases Quantile Balancing moves)
        from the rank that trains them; then the whole model is the same everywhere."""
        import torch.distributed as dist

        for owner, (start, end) in enumerate(self.bounds):
            stage = StageModule(model, start, end)  # that owner's modules, as its rank holds them
            with torch.no_grad():
                for t in [*stage.parameters(), *stage.buffers()]:
                    dist.broadcast(t.data, src=owner, group=self.group)
