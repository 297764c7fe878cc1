"""The trained arms of the smoke experiments: on-policy steps (`rl_step`, `mopd_step`) from a start, on prompts
drawn from a task's training split.

    model = rl_arm(start, seed, train, s, name=NAME, problem=lambda it, step: Problem(...), label="treatment",
                   say=say, roll=dict(extra_stop_ids=tasks.ONE_TOKEN), rewards_fn=None)
    model = run_arm(start, seed, train, cfg, name=NAME, problem=..., step=lambda model, opt, engine, problems,
                    roll, i: metrics, label="MOPD", line=lambda m: "...", say=say)

Every arm of an experiment draws the same prompts at each step (`random.Random(f"{name}|{seed}")`, without
repeats within a step) with the same sampler seeds, so arms differ only by what the experiment changes (the
rewards the loss sees, the budget, the routing).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from openk3.experiments import tasks


def run_arm(start: dict, seed: int, train: list, cfg, *, name: str, problem: Callable, step: Callable, label: str,
            line: Callable[[dict], str], say, roll: dict | None = None,
            build: Callable[[], torch.nn.Module] | None = None) -> torch.nn.Module:
    """`cfg.steps` steps (an `OnPolicyConfig`: steps, prompts per step, group size, lr, the engine) from the
    `start` weights: `problem(item, i)` makes each drawn item's Problem, `roll` adds to its RolloutConfig,
    `step(model, opt, engine, problems, rollout config, i) -> metrics` takes the step; `line(metrics)` is the
    progress line's text, every 10 steps. `build()`: a fresh model of the start's shape (default: the smoke
    profiles' `tasks.tiny_k3(seed)`)."""
    from openk3.posttrain.trainers.rollout import RolloutConfig

    model = build() if build is not None else tasks.tiny_k3(seed)
    model.load_state_dict(start)
    opt = tasks.optimizer(model, cfg.lr)
    engine = cfg.engine(model)
    draw = random.Random(f"{name}|{seed}")
    for i in range(cfg.steps):
        items = [train[k] for k in draw.sample(range(len(train)), cfg.prompts_per_step)]
        config = RolloutConfig(group_size=cfg.group_size, seed=seed * 100_003 + i, **(roll or {}))
        m = step(model, opt, engine, [problem(it, i) for it in items], config, i)
        if (i + 1) % 10 == 0:
            say(f"{label} step {i + 1}/{cfg.steps}: {line(m)}")
    return model


def rl_arm(start: dict, seed: int, train: list, s: dict, *, name: str, problem: Callable, label: str, say,
           roll: dict | None = None, rewards_fn: Callable | None = None, tok=None,
           build: Callable[[], torch.nn.Module] | None = None) -> torch.nn.Module:
    """`run_arm` with `rl_step` (K2's loss, `s["group_size"]` samples of `s["prompts_per_step"]` prompts, lr
    `s["rl_lr"]`, `s["steps"]` steps, sampling and log-probs at `s.get("temperature", 1.0)`, the engine's
    context `s.get("context")`); `rewards_fn` goes to `rl_step`; `tok`: the prompts' tokenizer (default the
    smoke profiles' byte tokenizer)."""
    from openk3.posttrain.trainers.rl import RLConfig, rl_step

    temperature = s.get("temperature", 1.0)
    cfg = RLConfig(model="(in memory)", group_size=s["group_size"], loss="kimi", lr=s["rl_lr"],
                   prompts_per_step=s["prompts_per_step"], steps=s["steps"], seed=seed, temperature=temperature,
                   max_model_len=s.get("context"))
    roll = {**(roll or {}), "temperature": temperature}

    def step(model, opt, engine, problems, config, i) -> dict:
        return rl_step(cfg, model, opt, engine, problems, tok or tasks.TOK, config, i, rewards_fn)[1]

    def line(m: dict) -> str:
        return (f"reward {m['reward']:.3f}, think {m['think_mean']:.1f}, over budget {m['over_budget_rate']:.2f}, "
                f"update scale {m['update_scale']:.2f}, skipped {m['skipped']}")

    return run_arm(start, seed, train, cfg, name=name, problem=problem, step=step, label=label, line=line, say=say,
                   roll=roll, build=build)
