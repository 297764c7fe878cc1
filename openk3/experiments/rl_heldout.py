"""`openk3 experiment rl-heldout`: RL with a verifiable reward raises greedy accuracy on held-out prompts over
its SFT start; the control is the same run with the rewards shuffled within each batch.

Smoke profile (one CPU core, ~1-2 minutes):
1. a tiny K3 (`tasks.tiny_k3`) is fine-tuned on the digit task (`tasks.digit_items`: a digit hidden among
   letters, answer (d + 1) mod 10) until its greedy accuracy on the validation split first reaches 30 %
   (checked after every step, at a learning rate low enough to stop inside 30-50 %): the SFT start, with room
   to learn;
2. two RL runs from that start, identical but for the rewards the loss sees: `rl_step` (K2's loss, groups of
   8, 8 prompts per step, 40 steps, the same problems and sampler seeds), the treatment with the verifier's
   reward (1 for the right digit), the control with the batch's rewards permuted (`rewards_fn`), so it has the
   same reward distribution, sampling and update sizes but no link between answer and reward;
3. greedy accuracy of the start, the treatment and the control on 400 held-out test prompts; treatment and
   control are each paired with the start, the effect is treatment - control, paired over the problems.
"""

from __future__ import annotations

import copy
import time

import torch

from openk3.experiments import tasks
from openk3.experiments.arms import rl_arm
from openk3.experiments.result import Result, arm
from openk3.experiments.tasks import mean

NAME = "rl-heldout"
CLAIM = ("RL with a verifiable reward raises greedy accuracy on held-out prompts over its SFT start, against the "
         "same RL with rewards shuffled within the batch")
METRIC = "greedy accuracy on held-out prompts"
PROFILES = ("smoke",)

SMOKE = dict(train=2000, val=200, test=400, sft_lr=5e-4, sft_batch=32, sft_max_steps=300, start_at=0.30,
             rl_lr=1e-3, steps=40, prompts_per_step=8, group_size=8)


def accuracy(model, items) -> dict[str, float]:
    """{item id: 1.0 if the greedy first token is the answer}."""
    got = tasks.first_tokens(model, [i.prompt for i in items])
    return {i.id: float(t == i.answer) for i, t in zip(items, got, strict=True)}


def rl_run(start: dict, seed: int, train, s: dict, shuffle: bool, say) -> torch.nn.Module:
    """The RL run from the `start` weights; `shuffle`: the control's permuted rewards."""
    from openk3.posttrain.trainers.rollout import Problem

    def permute(rewards_B: torch.Tensor, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 100_003 + step)
        return rewards_B[torch.randperm(rewards_B.shape[0], generator=g)]

    def problem(it, step: int) -> Problem:
        return Problem(f"{it.id}@{step}", it.prompt, budget=8, score=lambda turn: float(turn["ids"][0] == it.answer))

    return rl_arm(start, seed, train, s, name=NAME, problem=problem, label="control" if shuffle else "treatment",
                  say=say, roll=dict(extra_stop_ids=tasks.ONE_TOKEN), rewards_fn=permute if shuffle else None)


def run(profile: str, seed: int, say) -> Result:
    s = SMOKE
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    train, val, test = tasks.splits(tasks.digit_items, s, seed)
    model = tasks.tiny_k3(seed)
    history: list[tuple[int, float]] = []

    def reached(step: int) -> bool:
        history.append((step, mean(accuracy(model, val))))
        return history[-1][1] >= s["start_at"]

    steps = tasks.supervise(model, [i.prompt for i in train], [i.answer for i in train], steps=s["sft_max_steps"],
                            lr=s["sft_lr"], seed=seed, batch=s["sft_batch"], every=1, stop=reached)
    start_val = history[-1][1] if history else 0.0
    say(f"SFT start: {steps} steps, validation accuracy {start_val:.3f}")
    start = copy.deepcopy(model.state_dict())
    base = accuracy(model, test)
    treated = accuracy(rl_run(start, seed, train, s, False, say), test)
    control = accuracy(rl_run(start, seed, train, s, True, say), test)
    say(f"held-out accuracy: start {mean(base):.3f}, treatment {mean(treated):.3f}, control {mean(control):.3f}")
    reason = None if start_val >= s["start_at"] else (
        f"the SFT start never reached {s['start_at']:.0%} validation accuracy in {steps} steps")
    return Result(NAME, CLAIM, METRIC, profile, [seed], treatment=arm(treated, base, seed=seed),
                  control=arm(control, base, seed=seed, name="rewards shuffled within the batch"),
                  effect=arm(treated, control, seed=seed), seconds=time.perf_counter() - t0, reason=reason,
                  details={"start_accuracy": mean(base), "treatment_accuracy": mean(treated),
                           "control_accuracy": mean(control), "sft_steps": steps, "sft_val_accuracy": start_val,
                           "sft_val_history": history},
                  settings=dict(s))
