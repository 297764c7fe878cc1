"""`openk3 rl`: on-policy RL of one (domain, effort) teacher (issue 18, stage 2; docs/posttraining.md).

    openk3 rl --model runs/sft --domain general --effort max --out runs/t-general-max --steps 200
    openk3 rl --model runs/t-general-max --domain general --effort high --budget-from-effort max \\
        --out runs/t-general-high                      # annealed from the max teacher's budget

Samples `--group-size` trajectories for each of `--prompts-per-step` problems per step through the
inference engine, rewards them (verifier, think budget), and takes one optimizer step with the `kimi`
(K2's policy-mirror-descent square) or `grpo` loss (`openk3.posttrain.trainers.rl`). Running it again with the same
--out resumes from the last checkpoint (only --steps and --save-every may change).
"""

from __future__ import annotations

import argparse

from openk3.chat import THINKING_EFFORTS
from openk3.commands.common import add_rollout_run_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    from openk3.posttrain.domains.records import DOMAINS
    from openk3.posttrain.trainers import losses
    from openk3.posttrain.trainers.rl import LOSSES, RLConfig

    d = RLConfig()
    p.add_argument("--model", required=True, help="starting checkpoint or run folder (SFT, or the previous "
                                                  "effort's teacher when annealing); its tokenizer is used")
    p.add_argument("--domain", required=True, choices=DOMAINS)
    p.add_argument("--effort", required=True, choices=THINKING_EFFORTS)
    p.add_argument("--out", required=True, help="run folder: checkpoints, metrics.jsonl, rollouts/ (resumed if there)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step,
                   help=f"problems per step (default {d.prompts_per_step})")
    p.add_argument("--group-size", type=int, default=d.group_size,
                   help=f"samples per problem, >= 2 (default {d.group_size})")
    p.add_argument("--loss", choices=LOSSES, default=d.loss, help=f"default {d.loss}")
    p.add_argument("--lr", type=float, default=d.lr, help=f"learning rate (default {d.lr})")
    p.add_argument("--tau", type=float, default=d.tau, help=f"kimi: the KL strength tau (default {d.tau})")
    p.add_argument("--baseline", choices=losses.BASELINES, default=d.baseline, help=f"grpo (default {d.baseline})")
    p.add_argument("--std", choices=losses.STD_MODES, default=d.std, help=f"grpo: advantage scaling (default {d.std})")
    p.add_argument("--clip-low", type=float, default=d.clip_low, help=f"grpo (default {d.clip_low})")
    p.add_argument("--clip-high", type=float, default=d.clip_high, help=f"grpo (default {d.clip_high})")
    p.add_argument("--is-mode", choices=losses.IS_MODES, default=d.is_mode,
                   help=f"grpo: sampler/trainer importance correction (default {d.is_mode})")
    p.add_argument("--is-bounds", type=float, nargs=2, default=d.is_bounds, metavar=("LOW", "HIGH"),
                   help=f"grpo: the importance weights' band (default {d.is_bounds[0]} {d.is_bounds[1]})")
    p.add_argument("--temperature", type=float, default=d.temperature,
                   help="sampling temperature; the trainer scores at the same one (default 1.0)")
    p.add_argument("--response-cap", type=int, default=d.response_cap,
                   help=f"tokens per turn after the think channel; more is a format failure (default {d.response_cap})")
    p.add_argument("--max-turns", type=int, default=d.max_turns, help=f"agent/coding turns (default {d.max_turns})")
    p.add_argument("--budget-from-effort", choices=THINKING_EFFORTS, default=None,
                   help="anneal the think budget from this effort's B(x) to --effort's (default: no annealing)")
    p.add_argument("--anneal-fraction", type=float, default=d.anneal_fraction,
                   help=f"share of the steps the annealing takes (default {d.anneal_fraction})")
    p.add_argument("--b-floor", type=int, default=d.b_floor, help=f"smallest think budget (default {d.b_floor})")
    p.add_argument("--budget-cap", type=int, default=None,
                   help="largest think budget: every B(x) is cut to it (default: no cap)")
    add_rollout_run_arguments(p, d, seed_help="problems and sampling")


def main(args: argparse.Namespace) -> int:
    from openk3.commands.common import on_policy_done, rollout_run_settings
    from openk3.posttrain.trainers.rl import RLConfig, rl

    cfg = RLConfig(model=args.model, domain=args.domain, effort=args.effort, steps=args.steps,
                   prompts_per_step=args.prompts_per_step, group_size=args.group_size, loss=args.loss, lr=args.lr,
                   tau=args.tau, baseline=args.baseline, std=args.std, clip_low=args.clip_low,
                   clip_high=args.clip_high, is_mode=args.is_mode, is_bounds=tuple(args.is_bounds),
                   temperature=args.temperature, response_cap=args.response_cap, max_turns=args.max_turns,
                   budget_from_effort=args.budget_from_effort, anneal_fraction=args.anneal_fraction,
                   b_floor=args.b_floor, budget_cap=args.budget_cap, **rollout_run_settings(args))
    last = rl(cfg, args.out)
    on_policy_done("rl", last, args.out, cfg.steps, last and f"reward {last['reward']:.3f}, over budget "
                   f"{last['over_budget_rate']:.2f}, think {last['think_mean']:.1f}")
    return 0
