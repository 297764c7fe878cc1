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

Full profile (one CPU core, ~15-20 minutes a seed; `full.py`):
1. the start is the pipeline's smoke SFT model of the `general` domain (`openk3 posttrain --profile smoke
   --domains general`, stopped after SFT; kept in OUT/start, so a rerun continues it);
2. training prompts: 320 general problems of the `high` effort (train split, level 1, as that SFT saw),
   filtered to those whose 8 samples at the RL temperature do not all score alike (for 0/1 scores pass@8 in
   [1/8, 7/8]; the instruct family's rule verifiers give partial credit): the prompts where a group's rewards
   vary, so RL has a signal;
3. treatment and control as in smoke, on those prompts: K2's loss, groups of 8, 8 prompts per step, T = 0.7
   (the pipeline's full profile's RL temperature), reward = `general.score` of the response (a think channel
   over the 320-token cap or a malformed turn scores 0: accuracy is the only signal);
4. greedy accuracy (`openk3 eval`'s evaluation) on 300 held-out test problems of the same cell.
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
SMOKE = dict(train=2000, val=200, test=400, sft_lr=5e-4, sft_batch=32, sft_max_steps=300, start_at=0.30,
             rl_lr=1e-3, steps=40, prompts_per_step=8, group_size=8)
FULL = dict(start_profile="smoke", effort="high", candidates=320, pass_k=8, test=300, think_cap=320,
            response_cap=64, temperature=0.7, rl_lr=3e-4, steps=40, prompts_per_step=8, group_size=8, context=1024)
PROFILES = {"smoke": SMOKE, "full": FULL}


def accuracy(model, items) -> dict[str, float]:
    """{item id: 1.0 if the greedy first token is the answer}."""
    got = tasks.first_tokens(model, [i.prompt for i in items])
    return {i.id: float(t == i.answer) for i, t in zip(items, got, strict=True)}


def raised(treatment: dict) -> dict:
    """The claim's own words: accuracy rises over the SFT start (the treatment's change, its interval above 0),
    not only against the control (shuffled rewards can also pull accuracy down)."""
    lo, hi = treatment["ci95"]
    return {"accuracy rises over the SFT start": {"holds": lo > 0, "detail": f"{treatment['estimate']:+.3f} "
                                                                           f"[{lo:+.3f}, {hi:+.3f}]"}}


def shuffled_rewards(seed: int):
    """The control's `rewards_fn`: each step's batch of rewards permuted (seeded by the run's seed and the step)."""
    def permute(rewards_B: torch.Tensor, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 100_003 + step)
        return rewards_B[torch.randperm(rewards_B.shape[0], generator=g)]

    return permute


def rl_run(start: dict, seed: int, train, s: dict, shuffle: bool, say) -> torch.nn.Module:
    """The RL run from the `start` weights; `shuffle`: the control's permuted rewards."""
    from openk3.posttrain.trainers.rollout import Problem

    def problem(it, step: int) -> Problem:
        return Problem(f"{it.id}@{step}", it.prompt, budget=8, score=lambda turn: float(turn["ids"][0] == it.answer))

    return rl_arm(start, seed, train, s, name=NAME, problem=problem, label="control" if shuffle else "treatment",
                  say=say, roll=dict(extra_stop_ids=tasks.ONE_TOKEN),
                  rewards_fn=shuffled_rewards(seed) if shuffle else None)


def run(profile: str, s: dict, seed: int, say, out) -> Result:
    if profile == "full":
        return run_full(s, seed, say, out)
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
    treatment = arm(treated, base, seed=seed)
    return Result(NAME, CLAIM, METRIC, profile, [seed], treatment=treatment, requirements=raised(treatment),
                  control=arm(control, base, seed=seed, name="rewards shuffled within the batch"),
                  effect=arm(treated, control, seed=seed), seconds=time.perf_counter() - t0, reason=reason,
                  details={"start_accuracy": mean(base), "treatment_accuracy": mean(treated),
                           "control_accuracy": mean(control), "sft_steps": steps, "sft_val_accuracy": start_val,
                           "sft_val_history": history},
                  settings=dict(s))


def run_full(s: dict, seed: int, say, out) -> Result:
    """The full profile (module docstring): RL on the general domain from the pipeline's smoke SFT model."""
    import dataclasses

    from openk3.experiments import full

    t0 = time.perf_counter()
    start = full.open_start(out, seed, say, s["start_profile"])
    model, tok = start.model, start.tok
    cell = ("general", s["effort"])
    name = f"general/{s['effort']}"
    lengths = dict(think_cap=s["think_cap"], response_cap=s["response_cap"])

    def evaluate(m) -> dict:
        return {"accuracy": full.scores(full.greedy(m, tok, [cell], n=s["test"], seed=seed, **lengths)[name],
                                        "accuracy")}

    pool = full.problems(tok, s["effort"], "train", s["candidates"], seed)
    sampled = full.arm_cache(out, "sample_scores", lambda: full.sample_scores(
        model, tok, pool, k=s["pass_k"], temperature=s["temperature"], seed=seed, **lengths))
    # a prompt teaches only when its samples' scores differ (binary scores: pass@k in [1/k, (k-1)/k]; the
    # instruct family's rules give partial credit, so "differ" is the general form of that band)
    band = f"scores that differ among {s['pass_k']} samples"
    train = [p for p in pool if len(set(sampled[p.id])) > 1]
    passes = {pid: sum(v >= 1.0 for v in scores) for pid, scores in sampled.items()}
    histogram = {str(c): sum(v == c for v in passes.values()) for c in range(s["pass_k"] + 1)}
    say(f"training prompts: {len(train)} of {len(pool)} with {band} (full passes per prompt: {histogram})")
    base = full.arm_cache(out, "start", lambda: evaluate(model))["accuracy"]

    def rl_full(shuffle: bool) -> torch.nn.Module:
        def problem(p, step: int):  # the cap, not a budget: over it the turn scores 0 (no -1 penalty)
            return dataclasses.replace(p, id=f"{p.id}@{step}", budget=s["think_cap"])

        return rl_arm(start.state, seed, train, s, name=NAME, problem=problem,
                      label="control" if shuffle else "treatment", say=say,
                      roll=dict(response_cap=s["response_cap"], over_budget_reward=0.0),
                      rewards_fn=shuffled_rewards(seed) if shuffle else None, tok=tok, build=start.fresh)

    reason = None
    if len(train) < s["prompts_per_step"]:
        reason = f"only {len(train)} training prompts have {band} (a step draws {s['prompts_per_step']})"
        treated = control = base
    else:
        treated = full.arm_cache(out, "treatment", lambda: evaluate(rl_full(False)))["accuracy"]
        control = full.arm_cache(out, "control", lambda: evaluate(rl_full(True)))["accuracy"]
    say(f"held-out accuracy: start {mean(base):.3f}, treatment {mean(treated):.3f}, control {mean(control):.3f}")
    treatment = arm(treated, base, seed=seed)
    return Result(NAME, CLAIM, METRIC, "full", [seed], treatment=treatment, requirements=raised(treatment),
                  control=arm(control, base, seed=seed, name="rewards shuffled within the batch"),
                  effect=arm(treated, control, seed=seed), seconds=time.perf_counter() - t0, reason=reason,
                  details={"start_accuracy": mean(base), "treatment_accuracy": mean(treated),
                           "control_accuracy": mean(control), "start_checkpoint": str(start.folder),
                           "training_prompts": len(train), "candidates": len(pool),
                           "pass_histogram": histogram,
                           "training_families": {f: sum(p.meta["family"] == f for p in train)
                                                 for f in sorted({p.meta["family"] for p in pool})}},
                  settings=dict(s))
