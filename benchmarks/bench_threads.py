"""One thread or all CPUs for a training step, on a quiet machine and beside a busy one (issue 28, item 4).

Why this exists: `openk3 train` picks its thread count by measuring (`openk3/train/threads.py`) because on the
small shared machines openk3 runs on, a second OpenMP thread helps while the host gives the process both vCPUs
and hurts badly while another process wants one of them. This script measures the two situations so the claim
has numbers: the README main job's step (`nano` preset, the default `TrainConfig`: batch 8 x 256 tokens, Per-Head
Muon + AdamW, fp32) timed at each thread count, each in a fresh process, with `--busy K` extra processes spinning
a Python loop beside it (0 = quiet), and with OpenMP's wait policy as torch ships it (threads spin a while at each
barrier) or `OMP_WAIT_POLICY=PASSIVE` (they sleep).

    python benchmarks/bench_threads.py                      # threads 1 and all, quiet and with 1 busy process
    python benchmarks/bench_threads.py --busy 0 --steps 6   # quiet only

Each cell: the median step time of `--steps` steps after 2 warm-up steps (a step much slower than the others is
the host, and shows in the min-max). Nothing asserts on time. The table is markdown for `docs/benchmarks.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def child(threads: int, steps: int, preset: str, overrides: list[str]) -> dict:
    """One configuration in this process: `steps` timed training steps after 2 warm-up steps."""
    import torch
    from common import setup_threads

    from openk3.config import preset as get_preset
    from openk3.model.model import K3ForCausalLM
    from openk3.train.config import TrainConfig
    from openk3.train.optim import build_optimizer
    from openk3.train.schedule import LRSchedule
    from openk3.train.trainer import Trainer

    setup_threads(threads)
    fields = dict(kv.split("=", 1) for kv in overrides)  # TrainConfig's int fields (the test makes the step small)
    cfg = TrainConfig(model=get_preset(preset), **{k: int(v) for k, v in fields.items()})
    torch.manual_seed(0)
    model = K3ForCausalLM.build(cfg.model, seed=0)
    opt = build_optimizer(model, cfg.optim)
    schedule = LRSchedule(opt, warmup=1, total=steps + 2)
    trainer = Trainer(model, iter(()), opt, schedule, cfg, threads=threads)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (cfg.batch_size, cfg.seq_len + 1), generator=g)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        trainer.train_step(batch)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return {"threads": torch.get_num_threads(), "tokens": cfg.batch_size * cfg.seq_len, "times": times}


def run_child(threads: int, steps: int, preset: str, passive: bool, overrides: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("OPENK3_THREADS", None)
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        env.pop("OMP_WAIT_POLICY", None)
    out = subprocess.run([sys.executable, __file__, "--child", str(threads), "--steps", str(steps), "--preset",
                          preset, *overrides], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    from common import machine_line, median

    from openk3.common import cpus_available

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="nano")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1], help="extra spinning processes (default 0 1)")
    ap.add_argument("--threads", type=int, nargs="+", default=None, help="counts to time (default 1 and all CPUs)")
    ap.add_argument("--wait", nargs="+", choices=("default", "PASSIVE"), default=["default", "PASSIVE"],
                    help="OpenMP wait policies to time (default both)")
    ap.add_argument("overrides", nargs="*", help="TrainConfig key=value (e.g. seq_len=64 batch_size=2)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.steps, args.preset, args.overrides)))
        return []
    rows = []
    cpus = cpus_available()
    counts = args.threads or sorted({1, cpus})
    print(f"preset {args.preset}, the default TrainConfig step; {cpus} CPUs; {machine_line(1).split(', 1 thread')[0]}")
    print("\n| busy processes | OMP wait policy | threads | step (median, min-max) | tokens/s |")
    print("|---|---|---|---|---|")
    for busy in args.busy:
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            for passive in [w == "PASSIVE" for w in args.wait]:
                for n in counts:
                    r = run_child(n, args.steps, args.preset, passive, args.overrides)
                    t = r["times"]
                    rows.append({"busy": busy, "passive": passive, "threads": n, "threads_seen": r["threads"],
                                 "step_s": median(t), "tokens_per_s": r["tokens"] / median(t)})
                    print(f"| {busy} | {'PASSIVE' if passive else 'default'} | {n} | {median(t) * 1e3:.0f} ms "
                          f"({min(t) * 1e3:.0f}-{max(t) * 1e3:.0f}) | {r['tokens'] / median(t):,.0f} |", flush=True)
        finally:
            for p in spinners:
                p.kill()
                p.wait()
    return rows


if __name__ == "__main__":
    main()
