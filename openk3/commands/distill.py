"""`openk3 distill`: multi-teacher on-policy distillation (MOPD) of the (domain, effort) teachers into one
student (issue 18, stage 3; docs/posttraining.md).

    openk3 distill --student runs/sft --teachers teachers.json --out runs/mopd --steps 300
    openk3 distill --student runs/sft --teachers teachers.json --out runs/mopd-gen --cells general/low,general/max

teachers.json maps cells to checkpoints: {"general/low": "runs/t-general-low", ...} (relative paths are
relative to the file). Each step the student samples on-policy, each sample is scored by its own cell's
teacher (prefill only) and the student takes a policy-gradient step on the clipped log-prob gap
(`openk3.posttrain.trainers.mopd`). Running it again with the same --out resumes from the last checkpoint (only
--steps, --save-every, --student and the teachers' paths may change).
"""

from __future__ import annotations

import argparse

from openk3.commands.common import add_rollout_run_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    from openk3.posttrain.trainers.mopd import MOPDConfig

    d = MOPDConfig()
    p.add_argument("--student", required=True, help="starting checkpoint or run folder (the SFT model); its "
                                                    "tokenizer is used, and every teacher must share it")
    p.add_argument("--teachers", required=True, help='JSON file {"general/high": CHECKPOINT, ...}')
    p.add_argument("--out", required=True, help="run folder: checkpoints, metrics.jsonl, rollouts/ (resumed if there)")
    p.add_argument("--cells", default=None, help="comma-separated cells to draw prompts from, uniformly "
                                                 "(default: every teacher's cell)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step,
                   help=f"prompts per step (default {d.prompts_per_step})")
    p.add_argument("--group-size", type=int, default=d.group_size,
                   help=f"samples per prompt (default {d.group_size}; --alpha needs >= 2)")
    p.add_argument("--clip", type=float, default=d.clip,
                   help=f"R: the per-token advantage is clipped to [-R, R] (default {d.clip}; 0 = no clip)")
    p.add_argument("--alpha", type=float, default=d.alpha,
                   help=f"outcome mixing: A += alpha * (task reward - group mean) (default {d.alpha}: pure MOPD)")
    p.add_argument("--ppo-epochs", type=int, default=d.ppo_epochs,
                   help=f"optimizer passes over each batch; later passes clip the ratio as PPO does "
                        f"(default {d.ppo_epochs})")
    p.add_argument("--ratio-clip", type=float, nargs=2, default=d.ratio_clip, metavar=("LOW", "HIGH"),
                   help=f"PPO ratio clip for passes after the first (default {d.ratio_clip[0]} {d.ratio_clip[1]})")
    p.add_argument("--adv-floor", type=float, default=d.adv_floor,
                   help=f"log-prob gaps below this count as agreement, A = 0 (default {d.adv_floor}; 0 = off)")
    p.add_argument("--teacher-temperature", type=float, default=None,
                   help="score every teacher at this temperature (default: each at the one its RL run sampled at, "
                        "from its rl_config.json; 1 for a teacher no RL run made)")
    p.add_argument("--lr", type=float, default=d.lr, help=f"learning rate (default {d.lr})")
    p.add_argument("--response-cap", type=int, default=d.response_cap,
                   help=f"tokens per turn after the think channel (default {d.response_cap})")
    p.add_argument("--think-cap", type=int, default=None,
                   help="safety cap on think tokens per trajectory (default: the context limit; no budgets in MOPD)")
    p.add_argument("--max-turns", type=int, default=d.max_turns, help=f"agent/coding turns (default {d.max_turns})")
    add_rollout_run_arguments(p, d, seed_help="cells, problems and sampling")


def main(args: argparse.Namespace) -> int:
    from openk3.commands.common import on_policy_done, rollout_run_settings
    from openk3.posttrain.trainers.mopd import MOPDConfig, distill

    cells = tuple(c.strip() for c in args.cells.split(",") if c.strip()) if args.cells else ()
    cfg = MOPDConfig(student=args.student, teachers=args.teachers, cells=cells, steps=args.steps,
                     prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                     clip=args.clip or None, alpha=args.alpha, ppo_epochs=args.ppo_epochs,
                     ratio_clip=tuple(args.ratio_clip), adv_floor=args.adv_floor,
                     teacher_temperature=args.teacher_temperature, lr=args.lr,
                     response_cap=args.response_cap, think_cap=args.think_cap, max_turns=args.max_turns,
                     **rollout_run_settings(args))
    last = distill(cfg, args.out)
    on_policy_done("distill", last, args.out, cfg.steps, last and f"reverse KL {last['reverse_kl']:.4f}, clipped "
                   f"{last['clipped_frac']:.3f}, think {last['think_mean']:.1f}")
    return 0
