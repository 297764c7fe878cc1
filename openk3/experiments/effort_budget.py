"""`openk3 experiment effort-budget`: RL with thinking budgets cuts thinking tokens by >= 30 % at no accuracy
loss beyond the interval, against the same RL without budgets (background §3.10).

Smoke profile (one CPU core, 3.3-4.2 minutes):
1. a tiny K3 (`tasks.tiny_k3`) is fine-tuned on whole turns for the digit task (`tasks.digit_items`): a think
   channel of 2-14 dots, then the answer (d + 1) mod 10 in the response channel (`tasks.turn_ids`), until
   >= 60 % of its greedy validation answers are right (checked every 5 steps): the SFT start, thinking a
   length that carries no information;
2. two RL runs from that start, identical but for the budget: `rl_step` (K2's loss, groups of 8, 8 prompts
   per step, 25 steps at lr 3e-4, the same problems and sampler seeds; reward 1 for the right answer), the
   treatment with a think budget annealed from 14 to 5 tokens over the first half (a trajectory over it stops
   at budget + 1 think tokens with reward -1, as `openk3 rl` budgets do), the control with none (only a compute
   cap at 48 think tokens, scored 0 like any truncation);
3. greedy turns (no budget; a think cap of 64, as evaluation keeps one) on 300 held-out prompts: think tokens
   and accuracy per prompt. The metric is think tokens saved from the start, paired per prompt; the effect is
   the treatment's saving minus the control's. Requirements: the treatment thinks >= 30 % less than the
   control, and the treatment-minus-control accuracy difference's 95 % interval reaches 0 (no loss beyond the
   interval).

The dots carry no information, so the smoke shows the mechanism (a budget shortens thinking without costing
the answer) and not that budgets keep useful reasoning: that is the full profile's question.

Full profile (one CPU core, ~20-30 minutes a seed; `full.py`):
1. the start is the pipeline's smoke SFT model of the `general` domain (as `rl-heldout`'s full profile);
2. prompts of the `max` cell (train split, level 1), where the start writes the max traces' full scratchpad
   and verification (~L(x) think tokens, L the max reference's length);
3. the treatment is RL with the budget rule of `openk3 rl`: the budget anneals from B_max(x) = 2 L(x) to
   B_high(x) = 0.6 L(x) over the first half (`budget_from_effort`, as the pipeline's high teacher starts from
   the max one), over it the trajectory stops and scores -1; the control is the same RL with only the
   320-token cap (scored 0 like any truncation); K2's loss, 8 prompts x 8 samples, T = 0.7;
4. greedy think tokens and task scores on 200 held-out test prompts of the cell, paired per prompt.
   Requirements as in smoke: >= 30 % fewer think tokens than the control, and the accuracy difference's
   interval reaches 0.
"""

from __future__ import annotations

import copy
import random
import time

import torch

from openk3.experiments import tasks
from openk3.experiments.arms import rl_arm
from openk3.experiments.result import Result, arm
from openk3.experiments.tasks import mean
from openk3.stats import paired

NAME = "effort-budget"
CLAIM = ("RL with thinking budgets cuts thinking tokens by >= 30 % at no accuracy loss beyond the interval, "
         "against the same RL without budgets")
METRIC = "greedy think tokens saved per held-out prompt"

SMOKE = dict(train=2000, val=64, test=300, think=(2, 14), sft_lr=2e-3, sft_at=0.6, sft_max_steps=400,
             rl_lr=3e-4, steps=25, prompts_per_step=8, group_size=8, budget=5, think_cap=48, eval_cap=64,
             response_cap=64, cut=0.30)
FULL = dict(start_profile="smoke", effort="max", budget_from="max", budget_to="high", pool=400, test=200,
            think_cap=320, response_cap=64, temperature=0.7, rl_lr=3e-4, steps=30, prompts_per_step=8,
            group_size=8, context=1024, cut=0.30)
PROFILES = {"smoke": SMOKE, "full": FULL}


def greedy_turns(model, items, s: dict) -> tuple[dict[str, float], dict[str, float]]:
    """({item id: think tokens}, {item id: 1.0 if the answer is right}) of greedy turns without a budget (a
    turn still thinking at `eval_cap` is stopped there and scored 0, as `openk3 eval`'s think cap does)."""
    from openk3.infer.engine import Engine
    from openk3.posttrain.trainers.rollout import Problem, RolloutConfig, rollout

    engine = Engine(model, None, max_num_seqs=min(256, len(items)))
    problems = [Problem(it.id, it.prompt, budget=s["eval_cap"], score=_scorer(it)) for it in items]
    records = rollout(engine, problems, tasks.TOK, RolloutConfig(group_size=1, temperature=1e-6, logprobs=False,
                                                                 response_cap=s["response_cap"],
                                                                 over_budget_reward=0.0))
    think = {r["problem_id"]: float(r["think_tokens"]) for r in records}
    right = {r["problem_id"]: float(r["reward_components"]["task"]) for r in records}
    return think, right


def _scorer(item):
    want = tasks.TOK.decode([item.answer])
    return lambda turn: float((turn["message"].get("content") or "").strip() == want)


def rl_run(start: dict, seed: int, train, s: dict, budget: int | None, say) -> torch.nn.Module:
    """RL from `start` with a think `budget` (over it: stopped, reward -1), or with none (None: only the compute
    cap `think_cap`, far above the budget, which stops a trajectory and scores it 0 like any truncation)."""
    from openk3.posttrain.domains.budget import annealed_budget
    from openk3.posttrain.trainers.rollout import Problem

    def problem(it, step: int) -> Problem:
        # the budget anneals from the start's longest thinking down to `budget` over the first half (as
        # `openk3 rl --budget-from-effort` does): a budget that starts under most samples makes nearly every
        # reward -1 at once, and the answers suffer before the thinking shortens
        b = annealed_budget(step, s["steps"], s["think"][1], budget, fraction=0.5) if budget else s["think_cap"]
        return Problem(f"{it.id}@{step}", it.prompt, budget=b, score=_scorer(it))

    roll = dict(response_cap=s["response_cap"], **({} if budget else {"over_budget_reward": 0.0}))
    return rl_arm(start, seed, train, s, name=NAME, problem=problem, label="budget" if budget else "no budget",
                  say=say, roll=roll)


def run(profile: str, s: dict, seed: int, say, out) -> Result:
    if profile == "full":
        return run_full(s, seed, say, out)
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    train, val, test = tasks.splits(tasks.digit_items, s, seed)
    rng = random.Random(f"think|{seed}")
    lo, hi = s["think"]
    turns = [tasks.turn_ids("." * rng.randint(lo, hi), tasks.TOK.decode([it.answer])) for it in train]
    model = tasks.tiny_k3(seed)
    reached: list[float] = []

    def done(step: int) -> bool:
        reached.append(sum(greedy_turns(model, val, s)[1].values()) / len(val))
        return reached[-1] >= s["sft_at"]

    steps = tasks.supervise(model, [i.prompt for i in train], turns, steps=s["sft_max_steps"], lr=s["sft_lr"],
                            seed=seed, every=5, stop=done)
    say(f"SFT start: {steps} steps, validation accuracy {reached[-1] if reached else 0:.3f}")
    start = copy.deepcopy(model.state_dict())
    think0, acc0 = greedy_turns(model, test, s)
    arms = {}
    for name, budget in (("budget", s["budget"]), ("no budget", None)):
        arms[name] = greedy_turns(rl_run(start, seed, train, s, budget, say), test, s)
    (think_t, acc_t), (think_c, acc_c) = arms["budget"], arms["no budget"]
    cut, accuracy, requirements = _judge(s, think_t, think_c, acc_t, acc_c, seed)
    say(f"held-out think tokens: start {mean(think0):.2f}, budget {mean(think_t):.2f}, no budget {mean(think_c):.2f} "
        f"(cut {cut:.0%}); accuracy {mean(acc0):.3f} / {mean(acc_t):.3f} / {mean(acc_c):.3f}")
    reason = None if reached and reached[-1] >= s["sft_at"] else (
        f"the SFT start never reached {s['sft_at']:.0%} validation accuracy in {steps} steps")
    return Result(NAME, CLAIM, METRIC, profile, [seed], treatment=arm(think0, think_t, seed=seed),
                  control=arm(think0, think_c, seed=seed, name="the same RL without budgets"),
                  effect=arm(think_c, think_t, seed=seed), seconds=time.perf_counter() - t0, reason=reason,
                  requirements=requirements,
                  details={"think_tokens": {"start": mean(think0), "budget": mean(think_t),
                                            "no budget": mean(think_c)},
                           "accuracy": {"start": mean(acc0), "budget": mean(acc_t), "no budget": mean(acc_c)},
                           "accuracy_budget_minus_control": accuracy.to_dict(), "cut": cut, "sft_steps": steps,
                           "sft_val_history": reached},
                  settings=dict(s))


def _judge(s: dict, think_t: dict, think_c: dict, acc_t: dict, acc_c: dict, seed: int) -> tuple[float, object, dict]:
    """(the cut against the control, the paired accuracy difference, the requirements)."""
    cut = 1 - mean(think_t) / mean(think_c) if mean(think_c) else 0.0
    accuracy = paired(acc_t, acc_c, seed=seed)
    requirements = {
        f"thinks >= {s['cut']:.0%} less than the control": {"holds": cut >= s["cut"], "detail": f"cut {cut:.3f}"},
        "no accuracy loss beyond the interval (budget - no budget)": {
            "holds": accuracy.ci95[1] >= 0,
            "detail": f"{accuracy.estimate:+.3f} [{accuracy.ci95[0]:+.3f}, {accuracy.ci95[1]:+.3f}]"}}
    return cut, accuracy, requirements


def run_full(s: dict, seed: int, say, out) -> Result:
    """The full profile (module docstring): budgets on the general domain's max cell from the smoke SFT model."""
    import dataclasses

    from openk3.experiments import full
    from openk3.posttrain.domains.budget import BudgetConfig, annealed_budget

    t0 = time.perf_counter()
    start = full.open_start(out, seed, say, s["start_profile"])
    model, tok = start.model, start.tok
    name = f"general/{s['effort']}"
    budgets = BudgetConfig()

    def evaluate(m) -> dict:
        c = full.greedy(m, tok, [("general", s["effort"])], n=s["test"], seed=seed, think_cap=s["think_cap"],
                        response_cap=s["response_cap"])[name]
        return {"think": full.scores(c, "thinking_tokens"), "accuracy": full.scores(c, "accuracy")}

    pool = full.problems(tok, s["effort"], "train", s["pool"], seed)

    def rl_full(budget: bool) -> torch.nn.Module:
        def problem(p, step: int):
            L = p.meta["reference_think_tokens"]
            b = annealed_budget(step, s["steps"], budgets.budget(L, s["budget_from"]),
                                budgets.budget(L, s["budget_to"]), fraction=budgets.anneal_fraction) \
                if budget else s["think_cap"]
            return dataclasses.replace(p, id=f"{p.id}@{step}", budget=b)

        roll = dict(response_cap=s["response_cap"], **({} if budget else {"over_budget_reward": 0.0}))
        return rl_arm(start.state, seed, pool, s, name=NAME, problem=problem,
                      label="budget" if budget else "no budget", say=say, roll=roll, tok=tok, build=start.fresh)

    base = full.arm_cache(out, "start", lambda: evaluate(model))
    treated = full.arm_cache(out, "budget", lambda: evaluate(rl_full(True)))
    control = full.arm_cache(out, "no budget", lambda: evaluate(rl_full(False)))
    cut, accuracy, requirements = _judge(s, treated["think"], control["think"], treated["accuracy"],
                                         control["accuracy"], seed)
    think = {"start": mean(base["think"]), "budget": mean(treated["think"]), "no budget": mean(control["think"])}
    acc = {"start": mean(base["accuracy"]), "budget": mean(treated["accuracy"]),
           "no budget": mean(control["accuracy"])}
    say(f"held-out think tokens: start {think['start']:.1f}, budget {think['budget']:.1f}, no budget "
        f"{think['no budget']:.1f} (cut {cut:.0%}); accuracy {acc['start']:.3f} / {acc['budget']:.3f} / "
        f"{acc['no budget']:.3f}")
    return Result(NAME, CLAIM, METRIC, "full", [seed], treatment=arm(base["think"], treated["think"], seed=seed),
                  control=arm(base["think"], control["think"], seed=seed, name="the same RL without budgets"),
                  effect=arm(control["think"], treated["think"], seed=seed), seconds=time.perf_counter() - t0,
                  requirements=requirements,
                  details={"think_tokens": think, "accuracy": acc,
                           "accuracy_budget_minus_control": accuracy.to_dict(), "cut": cut,
                           "start_checkpoint": str(start.folder)},
                  settings=dict(s))
