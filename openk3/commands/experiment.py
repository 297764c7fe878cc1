"""`openk3 experiment`: run one of the project's claims as an experiment with a control (issue 30).

    openk3 experiment --list
    openk3 experiment rl-heldout --profile smoke --seed 0 --out runs/exp/rl-heldout
    openk3 experiment mopd-vs-merge --profile smoke --seed 1 --out runs/exp/mopd-vs-merge
    openk3 experiment k3-vs-k2 --profile smoke --out runs/exp/k3-vs-k2   # ladder points in runs/exp/points

Writes DIR/result.json (the claim, the treatment's and the control's change from the common start, their
paired difference, each with a 95 % interval, and the verdict) and DIR/result.png; prints the verdict. The
verdict rule and the schema: docs/experiments.md.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", default=None, help="the experiment (see --list)")
    p.add_argument("--list", action="store_true", help="print every experiment's name, profiles and claim")
    p.add_argument("--profile", default="smoke",
                   help="smoke (minutes on one CPU core), full (post-training: a real start on the general domain, "
                        "15-40 minutes a seed on one core; scaling: the CPU ladder, resumable point by point) or gpu "
                        "(scaling only: a one-GPU-hour ladder) (default smoke)")
    p.add_argument("--seed", type=int, default=0, help="the run's seed: data, model, sampling (default 0)")
    p.add_argument("--out", default=None, help="folder for result.json and result.png (default runs/exp/NAME)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: $OPENK3_THREADS, else 1 on a 2-CPU machine, else torch's)")


def main(args: argparse.Namespace) -> int:
    from openk3.experiments import EXPERIMENTS, experiment, run_experiment

    if args.list:
        for name in EXPERIMENTS:
            m = experiment(name)
            print(f"{name}  [profiles: {', '.join(m.PROFILES)}]\n    {m.CLAIM}\n    metric: {m.METRIC}")
        return 0
    if args.name is None:
        raise ValueError(f"name an experiment ({', '.join(EXPERIMENTS)}) or give --list")
    from openk3.common import setup_cpu

    setup_cpu(args.threads)
    out = args.out or f"runs/exp/{args.name}"
    d = run_experiment(args.name, args.profile, args.seed, out)
    e, c = d["effect"], d["control"]
    failed = [f"{name}: {r['detail']}" for name, r in d.get("requirements", {}).items() if not r["holds"]]
    why = f"; requirement not met: {'; '.join(failed)}" if failed else ""
    why += f"; {d['reason']}" if d.get("reason") else ""
    if d.get("null") == 1:  # a compute multiplier (the scaling lab)
        pub = d.get("published")
        print(f"[experiment] {args.name}: {d['verdict']} (compute multiplier {e['estimate']:.2f}x "
              f"[{e['ci95'][0]:.2f}, {e['ci95'][1]:.2f}] of {d['treatment']['name']} over {c['name']}; published "
              f"{'none' if pub is None else f'{pub}x'}, matches_published {d.get('matches_published')}; minimal "
              f"detectable multiplier {d['fit']['multiplier']['mdm']:.2f}x{why}); {out}/result.json, "
              f"{out}/result.png", flush=True)
        return 0
    print(f"[experiment] {args.name}: {d['verdict']} (effect {e['estimate']:+.3f} [{e['ci95'][0]:+.3f}, "
          f"{e['ci95'][1]:+.3f}]; control {c['estimate']:+.3f}, {c['verdict']}{why}); {out}/result.json, "
          f"{out}/result.png", flush=True)
    return 0
