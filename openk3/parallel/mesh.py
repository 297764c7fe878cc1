"""The process mesh of a training run: degrees from the config, checked against the world torchrun made.

    cfg = ParallelConfig(dp_shard=2)                 # TrainConfig.parallel; overrides parallel.dp_shard=2
    mesh = init_mesh(cfg)                            # reads WORLD_SIZE / RANK / LOCAL_RANK; gloo on CPU, NCCL on GPU
    rows = mesh.batch_rows(batch_size)               # this data-parallel rank's slice of the global batch
    n = mesh.all_reduce_sum(torch.tensor(count))     # collectives; identities on the world-size-1 mesh
    mesh.close()

Degrees (background B.2): dp_replicate x dp_shard x pp x cp must equal the world size; ep is carved from
dp_shard x cp (it adds no ranks) and must divide it. This version runs data parallelism: `dp_shard` (FSDP2,
`parallel/fsdp.py`) and `dp_replicate` (HSDP: replicas of a sharded group), and expert parallelism over the
whole dp_shard group (`ep` = dp_shard without dp_replicate, `parallel/ep.py`). Pipeline and context
parallelism, and the other ep layouts, are refused with a message that says so, never silently ignored.
Without torchrun (no
WORLD_SIZE, or 1) every degree must be 1 and the mesh is the null mesh: world size 1, no process group,
every collective the identity, so one training loop serves both.

The batch contract: `batch_size` is the global batch. Data-parallel rank r takes rows [r*B/D, (r+1)*B/D)
of every global batch the loader yields, so the same command line is the same optimizer steps at any world
size; a batch that does not divide is refused here, before anything runs.
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

#: Degrees this version implements (> 1); the others are refused with NOT_YET.
IMPLEMENTED = ("dp_shard", "dp_replicate", "ep", "pp")
NOT_YET = ("cp",)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Parallel degrees (torchtitan's names). 1 everywhere = one process."""

    dp_shard: int = 1  # FSDP2: parameters, gradients and optimizer state sharded over these ranks
    dp_replicate: int = 1  # replicas of the sharded group (HSDP); gradients all-reduced across them
    ep: int = 1  # expert parallel, carved from dp_shard x cp (this version: ep = dp_shard)
    pp: int = 1  # pipeline stages cut at AttnRes block boundaries (`parallel/pipeline.py`; pp alone, this version)
    cp: int = 1  # context parallel for KDA and MLA (not yet)
    pp_cuts: tuple[int, ...] = ()  # first layer of each stage after the first; () = balanced at block boundaries

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "pp_cuts":
                if not isinstance(v, (tuple, list)) or any(isinstance(c, bool) or not isinstance(c, int) for c in v):
                    raise ValueError(f"parallel.pp_cuts must be a list of layer indices, got {v!r}")
                object.__setattr__(self, "pp_cuts", tuple(v))
            elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"parallel.{f.name} must be an integer >= 1, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each takes its own share of the global batch."""
        return self.dp_replicate * self.dp_shard

    def check(self, world_size: int, batch_size: int | None = None, grad_accum: int = 1) -> None:
        """ValueError naming the degree when this layout cannot run on `world_size` processes."""
        for name in NOT_YET:
            if getattr(self, name) > 1:
                raise ValueError(f"parallel.{name}={getattr(self, name)}: {name} parallelism is not implemented "
                                 f"yet (issue 19); this version runs parallel.dp_shard, parallel.dp_replicate "
                                 f"and parallel.ep")
        if self.ep > 1 and (self.dp_shard * self.cp) % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must divide parallel.dp_shard x parallel.cp = "
                             f"{self.dp_shard * self.cp} (experts are spread over the data-sharding ranks)")
        if self.pp > 1 and self.pp != self.world_size:
            raise ValueError(f"parallel.pp={self.pp} with dp_replicate x dp_shard x cp = "
                             f"{self.dp_replicate} x {self.dp_shard} x {self.cp}: this version runs pipeline "
                             "parallelism alone (every other degree 1)")
        if self.pp_cuts and len(self.pp_cuts) != self.pp - 1:
            raise ValueError(f"parallel.pp_cuts={list(self.pp_cuts)}: parallel.pp={self.pp} stages need "
                             f"{self.pp - 1} cut(s)")
        if self.ep > 1 and (self.ep != self.dp_shard or self.dp_replicate > 1):
            raise ValueError(f"parallel.ep={self.ep} with dp_shard {self.dp_shard} and dp_replicate "
                             f"{self.dp_replicate}: this version runs expert parallelism over the whole dp_shard "
                             f"group without replicas (parallel.ep = parallel.dp_shard, parallel.dp_replicate=1); "
                             f"experts FSDP-sharded within an expert group (ep < dp_shard) are not implemented yet")
        if self.world_size != world_size:
            what = ("run it under torchrun with that many processes, e.g. `torchrun --standalone "
                    f"--nproc_per_node {self.world_size} -m openk3 train ...`" if world_size == 1 else
                    f"set the degrees so that they multiply to {world_size} (e.g. parallel.dp_shard={world_size})")
            raise ValueError(f"parallel degrees dp_replicate x dp_shard x pp x cp = {self.dp_replicate} x "
                             f"{self.dp_shard} x {self.pp} x {self.cp} = {self.world_size} processes, but the world "
                             f"size is {world_size}: {what}")
        if batch_size is not None and batch_size % (self.dp * grad_accum):
            raise ValueError(f"batch_size {batch_size} is the global batch and must divide among the "
                             f"{self.dp} data-parallel ranks (dp_replicate x dp_shard) x grad_accum={grad_accum} "
                             f"micro-batches; choose a multiple of {self.dp * grad_accum}")


class Mesh:
    """This process's place in the run. The null mesh (world size 1) has no process group."""

    def __init__(self, cfg: ParallelConfig, *, rank: int = 0, local_rank: int = 0, device_mesh=None) -> None:
        self.cfg, self.rank, self.local_rank, self.device_mesh = cfg, rank, local_rank, device_mesh
        self.world_size = cfg.world_size
        # rank = replicate_index * dp_shard + shard_index (the device mesh's row-major order); dp rank = rank
        # while pp = cp = 1
        self.dp_rank, self.dp_size = (rank, cfg.dp) if cfg.pp == 1 else (0, 1)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.device_mesh is not None

    def batch_rows(self, batch_size: int) -> slice:
        """This data-parallel rank's rows of a global batch of `batch_size` rows."""
        per = batch_size // self.dp_size
        return slice(self.dp_rank * per, (self.dp_rank + 1) * per)

    def ep_mesh(self):
        """The DeviceMesh the routed experts are spread over (ep = dp_shard in this version: the same ranks,
        so expert DTensors and FSDP's share one mesh)."""
        assert self.cfg.ep == self.cfg.dp_shard and self.cfg.dp_replicate == 1, self.cfg
        return self.device_mesh["dp_shard"]

    def fsdp_mesh(self):
        """The DeviceMesh FSDP2 shards over: 1-D (dp_shard), or 2-D (dp_replicate, dp_shard) for HSDP."""
        if self.cfg.dp_replicate > 1:
            return self.device_mesh["dp_replicate", "dp_shard"]
        return self.device_mesh["dp_shard"]

    # ---- collectives over the data-parallel ranks (identities with one data rank) ----
    # The data ranks are every rank while pp = cp = 1; with pipeline stages (pp alone) there is one data rank.

    @property
    def data_parallel(self) -> bool:
        return self.distributed and self.dp_size > 1

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.data_parallel:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `t` along dim 0 in rank order (= the global batch's order)."""
        if not self.data_parallel:
            return t
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts)

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    @contextmanager
    def main_first(self):
        """Rank 0 runs the block, then the others do: for find-or-create steps (the run folder's cleanup, the
        tokenizer, the token cache) that every rank needs but only one may write."""
        if not self.is_main:
            self.barrier()
        try:
            yield
        finally:
            if self.is_main:
                self.barrier()

    def close(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()  # nobody tears its group down while another still talks
                dist.destroy_process_group()
            self.device_mesh = None


def null_mesh() -> Mesh:
    return Mesh(ParallelConfig())


def world_from_env() -> tuple[int, int, int]:
    """(world size, rank, local rank) as torchrun sets them; (1, 0, 0) outside torchrun."""
    def read(name: str, default: int) -> int:
        text = os.environ.get(name)
        if text is None:
            return default
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"environment variable {name}={text!r} is not an integer") from None

    return read("WORLD_SIZE", 1), read("RANK", 0), read("LOCAL_RANK", 0)


def init_mesh(cfg: ParallelConfig, device: torch.device | str = "cpu", *, batch_size: int | None = None,
              grad_accum: int = 1) -> Mesh:
    """The mesh of this process: checks the degrees against the world, joins the process group (gloo on CPU,
    NCCL on CUDA) and builds the named DeviceMesh; the null mesh outside torchrun."""
    world, rank, local_rank = world_from_env()
    cfg.check(world, batch_size, grad_accum)
    if world == 1:
        return Mesh(cfg)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    dims, names = ((cfg.pp,), ("pp",)) if cfg.pp > 1 else ((cfg.dp_replicate, cfg.dp_shard),
                                                           ("dp_replicate", "dp_shard"))
    device_mesh = init_device_mesh(device.type, dims, mesh_dim_names=names)
    return Mesh(cfg, rank=rank, local_rank=local_rank, device_mesh=device_mesh)
