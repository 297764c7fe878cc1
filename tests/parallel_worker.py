"""One data-parallel training run for tests/test_parallel.py, in this process or under torchrun.

    python tests/parallel_worker.py OUT.pt [steps]                                      # one process
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/parallel_worker.py OUT.pt [steps] [LAYOUT] [N]
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/parallel_worker.py OUT.pt steps LAYOUT:N ...

LAYOUT: "shard" (parallel.dp_shard = world size, FSDP2), "replicate" (parallel.dp_replicate = world size:
HSDP with shard groups of one), "ep" (parallel.dp_shard = parallel.ep = world size: the routed experts
spread over the ranks, the rest FSDP2) or "pp" (parallel.pp = world size: pipeline stages at AttnRes block
boundaries, N micro-batches through torch's schedule); a "-bf16" suffix trains under bf16 autocast (the trainer's
mixed precision: fp32 parameters and islands, bf16 matmuls) instead of fp32, "bf16" alone in one process; a
"-sign" suffix balances with the sign rule (`balance=sign`, sign_rate 0.01) instead of QB, "sign" alone in one
process.
N: micro-batches per step on each rank (grad_accum, default 1). Several LAYOUT:N runs one after another in the
same processes (one launch, one process group; a fresh model, mesh and trainer each): OUT.pt then holds
{"LAYOUT:N": result, ...}; "LAYOUT:N#label" runs a spec again under its own key (the determinism check).

nano cut to 4 layers (3 KDA + 1 MLA, a dense FFN then 3 MoE layers, two AttnRes blocks: every layer kind, and a
block boundary to cut pipeline stages at) in fp32, the default optimizers (Muon + AdamW) and Quantile Balancing,
on synthetic global batches of packed rows whose loss-token counts differ from row to row (so the global
normalisation matters). Rank 0 writes {"losses", "grad_norms", "params" (full tensors), "biases" (QB), "world",
"dispatched" (MoE layer calls through the expert-parallel dispatcher), "local_experts" (per MoE layer)} to OUT.pt.
The bf16 layouts run the whole nano (9 layers). tests/test_parallel.py runs the one-process runs in its own process
(`run`), the others under torchrun.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from openk3.common import setup_cpu
from openk3.config import preset
from openk3.model.model import K3ForCausalLM
from openk3.model.moe import SparseMoE
from openk3.parallel.fsdp import full_tensor
from openk3.parallel.mesh import ParallelConfig, init_mesh, world_from_env
from openk3.train.config import TrainConfig, apply_overrides
from openk3.train.trainer import build_trainer

B, T = 4, 24


def batches(steps: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (B, T), generator=g)
        labels = torch.roll(ids, -1, dims=1)
        seg = torch.zeros(B, T, dtype=torch.long)
        for b in range(B):  # 1-3 documents per row, and rows with few loss tokens
            for cut in sorted(torch.randint(1, T, (b % 3,), generator=g).tolist()):
                seg[b, cut:] += 1
            labels[b, T - 1 - 6 * b:] = -100
        out.append({"input_ids": ids, "labels": labels, "seg": seg})
    return out


def nano_cut(layers: int):
    return apply_overrides(TrainConfig(model=preset("nano")), [f"model.num_hidden_layers={layers}"]).model


def run(out_path: str | None, steps: int = 3, layout: str = "shard", grad_accum: int = 1,
        close: bool = True, layers: int | None = None) -> dict:
    """One run; rank 0 writes its result to `out_path` (if given) and every rank returns it. `close=False`
    keeps the process group for a next run. `layers`: nano's depth (default 9 for bf16 layouts, else 4)."""
    setup_cpu(1)
    world, _, _ = world_from_env()
    layout, sign = layout.removesuffix("-sign"), layout.endswith("sign")
    layout, bf16 = layout.removesuffix("-bf16"), layout.endswith("bf16")
    degrees = {"shard": {"dp_shard": world}, "bf16": {}, "sign": {}, "replicate": {"dp_replicate": world},
               "ep": {"dp_shard": world, "ep": world}, "pp": {"pp": world}}[layout]
    # bf16: all 9 layers, where the measured tolerances of the mixed-precision test hold (on the 4-layer cut the
    # first loss of ep-bf16 differs from one process in its last bits)
    cfg = TrainConfig(model=nano_cut(layers or (9 if bf16 else 4)), batch_size=B, seq_len=T, max_steps=steps, warmup=1,
                      grad_accum=grad_accum, parallel=ParallelConfig(**degrees), dtype="bf16" if bf16 else "fp32",
                      balance="sign" if sign else "qb", sign_rate=0.01)
    mesh = init_mesh(cfg.parallel, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum)
    model = K3ForCausalLM.build(cfg.model, seed=0)  # the same weights on every rank
    trainer = build_trainer(model, None, cfg, mesh=mesh)
    losses, norms = [], []
    for batch in batches(steps, cfg.model.vocab_size):
        rec = trainer.train_step(batch)
        losses.append(rec["loss"])
        norms.append(rec["grad_norm"])
    if trainer.pipeline is not None:  # rank 0 holds stage 0 only: the others' weights come to it
        trainer.pipeline.sync(model)
    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    dispatched = sum(d.calls for d in {id(m.dispatcher): m.dispatcher for m in moes if m.dispatcher}.values())
    local_experts = [m.experts.w1.to_local().shape[0] if hasattr(m.experts.w1, "to_local") else m.experts.w1.shape[0]
                     for m in moes]
    params = {n: full_tensor(p).detach().clone() for n, p in model.named_parameters()}
    biases = {n: b.detach().clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    trainer.close()
    result = {"losses": losses, "grad_norms": norms, "params": params, "biases": biases, "world": world,
              "dispatched": dispatched, "local_experts": local_experts,
              "stages": None if trainer.pipeline is None else [list(b) for b in trainer.pipeline.bounds]}
    if mesh.is_main and out_path is not None:
        torch.save(result, out_path)
    if close:
        mesh.close()
    elif mesh.distributed:  # the next run builds its own mesh on the same process group
        dist.barrier()
    return result


def run_many(out_path: str, steps: int, specs: list[str]) -> None:
    """`LAYOUT:N` runs in turn in these processes; rank 0 writes {spec: result} to `out_path`."""
    if len(set(specs)) != len(specs):  # results are keyed by spec: a repeat would silently replace the first
        raise ValueError(f"run_many: repeated specs in {specs}")
    results = {}
    for i, spec in enumerate(specs):
        layout, _, accum = spec.split("#")[0].partition(":")  # "#label": a repeat of a spec, kept apart
        results[spec] = run(None, steps, layout, int(accum or 1), close=i == len(specs) - 1)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, out_path)


if __name__ == "__main__":
    if len(sys.argv) > 3 and ":" in sys.argv[3]:
        run_many(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
    else:
        run(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3, sys.argv[3] if len(sys.argv) > 3 else "shard",
            int(sys.argv[4]) if len(sys.argv) > 4 else 1)
    # the interpreter's teardown can abort after a clean destroy_process_group under load (ep_layer_worker.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
