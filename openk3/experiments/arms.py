"""An RL arm of a smoke experiment: `rl_step` from a start, on problems drawn from a task's training split.

    model = rl_arm(start, seed, train, s, problem=lambda it, step: Problem(...), label="treatment", say=say,
                   roll=dict(extra_stop_ids=tasks.ONE_TOKEN), rewards_fn=None)

Every arm of an experiment draws the same prompts at each step (`random.Random(f"{name}|{seed}")`, without
repeats within a step) with the same sampler seeds, so arms differ only by what the experiment changes (the
rewards the loss sees, the budget).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from openk3.experiments import tasks


def rl_arm(start: dict, seed: int, train: list, s: dict, *, name: str, problem: Callable, label: str, say,
           roll: dict | None = None, rewards_fn: Callable | None = None) -> torch.nn.Module:
    """`s["steps"]` RL steps (K2's loss, `s["group_size"]` samples of `s["prompts_per_step"]` prompts, lr
    `s["rl_lr"]`) from the `start` weights; `problem(item, step)` makes each drawn item's Problem, `roll` adds
    to its RolloutConfig, `rewards_fn` goes to `rl_step`. A progress line every 10 steps."""
    from openk3.infer.engine import Engine
    from openk3.posttrain.trainers.rl import RLConfig, rl_step
    from openk3.posttrain.trainers.rollout import RolloutConfig

    model = tasks.tiny_k3(seed)
    model.load_state_dict(start)
    cfg = RLConfig(model="(in memory)", group_size=s["group_size"], loss="kimi", lr=s["rl_lr"],
                   prompts_per_step=s["prompts_per_step"], steps=s["steps"], seed=seed)
    opt = tasks.optimizer(model, cfg.lr)
    engine = Engine(model, None, max_num_seqs=cfg.prompts_per_step * cfg.group_size)
    draw = random.Random(f"{name}|{seed}")
    for step in range(cfg.steps):
        items = [train[k] for k in draw.sample(range(len(train)), cfg.prompts_per_step)]
        config = RolloutConfig(group_size=cfg.group_size, seed=seed * 100_003 + step, **(roll or {}))
        _, m = rl_step(cfg, model, opt, engine, [problem(it, step) for it in items], tasks.TOK, config, step,
                       rewards_fn)
        if (step + 1) % 10 == 0:
            say(f"{label} step {step + 1}/{cfg.steps}: reward {m['reward']:.3f}, think {m['think_mean']:.1f}, "
                f"over budget {m['over_budget_rate']:.2f}, update scale {m['update_scale']:.2f}, "
                f"skipped {m['skipped']}")
    return model
