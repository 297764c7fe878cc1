"""Data- and expert-parallel scaling on this machine (issue 19 item 7): tokens/s of N ranks against 1 at the
same rows per rank, and the bytes each step moves, from the arithmetic of what FSDP2, expert parallelism and
the trainer communicate.

    python benchmarks/bench_distributed.py                          # nano, 2 ranks vs 1, 4 rows x 256 per rank
    python benchmarks/bench_distributed.py --preset small --rows 2 --seq-len 512 --steps 6 --json out.json

The script launches itself: once as one process, then once under `torch.distributed.run --standalone
--nproc_per_node N` (gloo on CPU, one thread per rank as torchrun sets it), whose processes run FSDP2 alone
(parallel.dp_shard=N) and then with expert parallelism (parallel.ep=N: each rank keeps E/N whole experts,
tokens travel to them), each with a fresh model, mesh and trainer on the one process group.
Each run trains `--steps` steps of `--rows` rows per rank (so N ranks train N times the tokens per step) on
random ids with the default optimizers and Quantile Balancing; the first `--warmup` steps are not timed.
Reported: median step time, global tokens/s, the speed-up (N-rank tokens/s / 1-rank tokens/s) and the
scaling efficiency (speed-up / N).

Communication per step and rank (fp32 parameters; W ranks; P parameters, P_muon of them on Muon, P_x in
routed experts), the arithmetic printed beside the measurement:
- FSDP2 all-gathers every layer's parameters in forward and again in backward (reshard after forward) and
  reduce-scatters the gradients: 3 x 4 P (W-1)/W bytes received; with expert parallelism P - P_x;
- Muon gathers each matrix's direction to orthogonalise it whole, except the stacked experts, which every
  rank holds as whole matrices (Shard(0)): 4 (P_muon - P_x) (W-1)/W;
- expert parallelism's all-to-alls (dispatch and combine, forward and backward) move the latent-wide rows
  that leave the rank: 4 x 4 N_tokens K C (W-1)/W per MoE layer under uniform routing;
- Quantile Balancing all-gathers the router scores: 4 N_tokens E (W-1) per MoE layer; the loss-token count
  and the logged loss: two 8-byte all-reduces.
`openk3 plan --train` counts the same parameter bytes for its memory. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker(args: argparse.Namespace) -> None:
    """The runs of `args.layout` (comma-separated "shard" / "ep"), one after another in this process (one rank,
    or the only one); rank 0 writes {layout: step times} to args.out."""
    import torch

    from openk3.common import setup_cpu
    from openk3.config import preset
    from openk3.model.model import K3ForCausalLM
    from openk3.parallel.mesh import ParallelConfig, init_mesh, world_from_env
    from openk3.train.config import TrainConfig
    from openk3.train.trainer import build_trainer

    setup_cpu(1)
    world = world_from_env()[0]
    results, mesh = {}, None
    for layout in args.layout.split(","):
        cfg = TrainConfig(model=preset(args.preset), batch_size=args.rows * world, seq_len=args.seq_len,
                          max_steps=args.steps + args.warmup, warmup=1,
                          parallel=ParallelConfig(dp_shard=world, ep=world if layout == "ep" else 1))
        mesh = init_mesh(cfg.parallel, batch_size=cfg.batch_size)  # joins the process group the first time
        model = K3ForCausalLM.build(cfg.model, seed=0)
        trainer = build_trainer(model, None, cfg, mesh=mesh)
        g = torch.Generator().manual_seed(0)
        times = []
        for step in range(args.steps + args.warmup):
            ids = torch.randint(0, cfg.model.vocab_size, (cfg.batch_size, cfg.seq_len), generator=g)
            batch = {"input_ids": ids, "labels": torch.roll(ids, -1, dims=1), "seg": None}
            mesh.barrier()
            t0 = time.perf_counter()
            trainer.train_step(batch)
            mesh.barrier()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
        trainer.close()
        results[layout] = {"world": world, "times": times, "tokens_per_step": cfg.batch_size * cfg.seq_len}
        del trainer, model  # the next layout is built without this one's model and optimizer state
        gc.collect()
        mesh.barrier()
    if mesh.is_main:
        with open(args.out, "w") as f:
            json.dump(results, f)
    mesh.close()


def comm_bytes(preset_name: str, world: int, tokens_per_rank: int, ep: bool = False) -> dict:
    """Bytes received per rank and step, from the arithmetic in the module docstring."""
    from openk3.config import preset
    from openk3.plan import counts
    from openk3.plan.train import optimizer_split

    cfg = preset(preset_name)
    p, split = counts.params(cfg).total, optimizer_split(cfg)
    share = (world - 1) / world
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    experts = moe_layers * cfg.num_experts * 3 * cfg.moe_intermediate_size * cfg.expert_in_dim
    fsdp = 3 * 4 * (p - experts if ep else p) * share
    muon = 4 * (split["muon"] - experts) * share
    qb = 4 * tokens_per_rank * cfg.num_experts * (world - 1) * moe_layers
    a2a = 4 * 4 * tokens_per_rank * cfg.num_experts_per_token * cfg.expert_in_dim * share * moe_layers if ep else 0
    return {"fsdp": fsdp, "muon": muon, "qb": qb, "all_to_all": a2a, "scalars": 16,
            "total": fsdp + muon + qb + a2a + 16}


def run(cmd: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"bench_distributed: {' '.join(cmd[:6])} ... failed:\n{proc.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="nano")
    p.add_argument("--ranks", type=int, default=2, help="processes of the data-parallel run (default 2)")
    p.add_argument("--rows", type=int, default=4, help="rows per rank and step (default 4)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps (default 2)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one rank, write here
    p.add_argument("--layout", default="shard", help=argparse.SUPPRESS)  # internal: "shard", "ep" or "shard,ep"
    args = p.parse_args(argv)
    if args.worker is not None:
        args.out = args.worker
        worker(args)
        return {}
    here = os.path.abspath(__file__)
    common = ["--preset", args.preset, "--rows", str(args.rows), "--seq-len", str(args.seq_len),
              "--steps", str(args.steps), "--warmup", str(args.warmup)]
    from openk3.config import preset

    launches = [(1, ["shard"]), (args.ranks, ["shard"])]
    if preset(args.preset).num_experts % args.ranks == 0:
        launches[1][1].append("ep")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world, layouts in launches:
            out = os.path.join(tmp, f"w{world}.json")
            launch = [sys.executable] if world == 1 else \
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
            run([*launch, here, *common, "--layout", ",".join(layouts), "--worker", out])
            with open(out) as f:
                results = json.load(f)
            for layout in layouts:
                r = results[layout]
                step = statistics.median(r["times"])
                rows.append({"world": world, "layout": "one process" if world == 1 else
                             {"shard": "FSDP2", "ep": "FSDP2 + EP"}[layout], "step_s": step,
                             "tokens_per_s": r["tokens_per_step"] / step, "tokens_per_step": r["tokens_per_step"]})
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / rows[0]["tokens_per_s"]
        r["comm_bytes_per_rank_step"] = comm_bytes(args.preset, r["world"], args.rows * args.seq_len,
                                                   ep=r["layout"] == "FSDP2 + EP") if r["world"] > 1 else {}
    speedup = rows[1]["speedup"]
    result = {"preset": args.preset, "rows_per_rank": args.rows, "seq_len": args.seq_len, "runs": rows,
              "speedup": speedup, "efficiency": speedup / args.ranks,
              "comm_bytes_per_rank_step": rows[1]["comm_bytes_per_rank_step"], "cpus": os.cpu_count()}
    print(f"bench_distributed: {args.preset}, {args.rows} rows x {args.seq_len} tokens per rank, "
          f"{args.steps} timed steps (median), gloo, one thread per rank, {os.cpu_count()} CPUs")
    print(f"{'ranks':>5} {'layout':>12} {'step s':>8} {'tokens/s':>10} {'speed-up':>9}  communication per rank "
          "and step (arithmetic)")
    for r in rows:
        c = r["comm_bytes_per_rank_step"]
        comm = "" if not c else (f"FSDP {c['fsdp'] / 2**20:.1f} + Muon {c['muon'] / 2**20:.1f} + QB "
                                 f"{c['qb'] / 2**20:.2f} + all-to-all {c['all_to_all'] / 2**20:.2f} = "
                                 f"{c['total'] / 2**20:.1f} MiB")
        print(f"{r['world']:>5} {r['layout']:>12} {r['step_s']:>8.3f} {r['tokens_per_s']:>10,.0f} "
              f"{r['speedup']:>8.2f}x  {comm}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
