"""`openk3 eval`: every model on every (domain, effort) cell, with a report and plots (issue 18, item 6).

    openk3 eval --models sft=runs/sft student=runs/student merged=runs/merged-ties \\
        general/low=runs/t-general-low general/high=runs/t-general-high ... --out runs/eval --n 64 --samples 4
    openk3 eval --models sft=runs/sft --cells general --n 16 --out runs/eval-sft --temperature 0   # greedy
    openk3 eval --models forced-max=runs/t-general-max --cells general --prompt-effort max --budget-forcing \
        --out runs/eval-forced                         # the budget-forcing baseline (background §3.8)

A model name that is a cell ("general/low") is that cell's RL teacher and goes under "teachers" in
report.json; any other name (sft, student, merged, merged-ties, ...) is a model of its own. Each model is
evaluated on every chosen cell (`openk3.posttrain.evaluation.report.evaluate_models`); the command writes
<out>/report.json ({"models", "checkpoints", "settings"}), <out>/report.md and the PNG plots, plus the training
curves of --teacher-metrics / --mopd-metrics files when given. Each finished model is also saved to
<out>/models/<name>.json, so an interrupted run restarts from the next model (same settings only).
"""

from __future__ import annotations

import argparse

# = openk3.posttrain.trainers.rollout.RESPONSE_CAP, not imported: building the CLI parser must not import torch
# (tests/test_posttrain_eval.py checks they agree)
RESPONSE_CAP = 256


def add_arguments(p: argparse.ArgumentParser) -> None:
    from openk3.chat import THINKING_EFFORTS
    from openk3.commands.common import positive_int
    from openk3.posttrain.domains.budget import B_FLOOR
    from openk3.posttrain.domains.records import SPLITS

    p.add_argument("--models", required=True, nargs="+", metavar="NAME=DIR",
                   help="checkpoints (or run folders) to evaluate; NAME sft, student, merged, any other word, or a "
                        "cell D/E for that cell's teacher")
    p.add_argument("--out", required=True, help="folder for report.json, report.md and the plots")
    p.add_argument("--cells", default="all",
                   help="comma-separated cells D/E or domains D (all three efforts); default all nine")
    p.add_argument("--n", type=int, default=16, help="problems per cell (default 16; the report contract wants "
                                                     "n >= 16 trajectories per cell)")
    p.add_argument("--samples", type=int, default=1, help="trajectories per problem (default 1; the background's "
                                                          "pass@1 is the mean of 4)")
    p.add_argument("--split", choices=SPLITS, default="test", help="problems' split (default test)")
    p.add_argument("--levels", default=None, help="general difficulty levels drawn, e.g. 1,2 (default all)")
    p.add_argument("--seed", type=int, default=0, help="problems and sampling (default 0)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 = greedy (default 1.0)")
    p.add_argument("--think-cap", type=int, default=None,
                   help="stop a trajectory's thinking after this many tokens, scored 0 (a compute bound; keep it far "
                        "above the budgets; default: the context limit)")
    p.add_argument("--response-cap", type=int, default=RESPONSE_CAP,
                   help=f"tokens per turn after the think channel; more is a format failure (default {RESPONSE_CAP})")
    p.add_argument("--max-turns", type=int, default=8, help="agent/coding turns (default 8)")
    p.add_argument("--b-floor", type=int, default=B_FLOOR,
                   help=f"smallest think budget, as in training (default {B_FLOOR})")
    p.add_argument("--prompt-effort", choices=THINKING_EFFORTS, default=None,
                   help="render every cell's prompts with this effort's system message (budgets stay the cell's)")
    p.add_argument("--budget-forcing", action="store_true",
                   help="stop thinking at the cell's budget and force the response (general domain only); with "
                        "--prompt-effort max on the max teacher: the budget-forcing baseline")
    p.add_argument("--teacher-metrics", nargs="+", default=[], metavar="NAME=FILE",
                   help="RL teachers' metrics.jsonl files for teacher_rl.png")
    p.add_argument("--mopd-metrics", default=None, metavar="FILE", help="the MOPD run's metrics.jsonl for "
                                                                        "mopd_training.png")
    p.add_argument("--max-num-seqs", type=int, default=32, help="trajectories decoded together (default 32)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context limit per trajectory (default: the model's max_position_embeddings)")
    p.add_argument("--device", default=None, help="cpu (default), cuda or cuda:N")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: $OPENK3_THREADS, else 1 on a 2-CPU machine, else torch's)")


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{flag}: expected NAME=PATH, got {value!r}")
        if name in out:
            raise ValueError(f"{flag}: {name!r} given twice")
        out[name] = path
    return out


def main(args: argparse.Namespace) -> int:
    from openk3.common import setup_cpu
    from openk3.posttrain.domains.general import parse_levels
    from openk3.posttrain.evaluation.report import evaluate_models

    setup_cpu(args.threads)
    evaluate_models(_pairs(args.models, "--models"), args.out, cells=args.cells, n_per_cell=args.n,
                    samples=args.samples, split=args.split, seed=args.seed, temperature=args.temperature,
                    think_cap=args.think_cap, response_cap=args.response_cap, max_turns=args.max_turns,
                    b_floor=args.b_floor, levels=parse_levels(args.levels), prompt_effort=args.prompt_effort,
                    budget_forcing=args.budget_forcing, max_num_seqs=args.max_num_seqs,
                    max_model_len=args.max_model_len, device=args.device,
                    teacher_metrics=_pairs(args.teacher_metrics, "--teacher-metrics"),
                    mopd_metrics=args.mopd_metrics)
    return 0
