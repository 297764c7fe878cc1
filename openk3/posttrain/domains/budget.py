"""Per-problem thinking budgets per effort, the budget reward and the annealing schedule (issue 18).

K3's efforts are learned, not truncated at inference: during RL every problem x has a budget of
think-channel tokens for the effort being trained, a trajectory over it is penalised, and the lower
efforts come from annealing the budget down (background §3.3). Everything here is a pure function of
numbers so the SFT generators, the RL sampler and the evaluator share one definition:

    B_e(x) = max(b_floor, ceil(kappa_e * L(x)))        think_budget(L, effort)
    r      = r_task if T_think <= B else penalty       budget_reward(r_task, T, B)
    stop sampling once T_think reaches B + 1           should_stop(T, B)
    B(step) linear from B_from to B_to, then flat      annealed_budget(step, steps, B_from, B_to)

L(x) is the think-token count of the generator's max-verbosity reference trace; T_think counts the
think channel of every assistant turn of a trajectory, tags excluded (`records.think_tokens`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from openk3.chat import THINKING_EFFORTS

#: kappa_e: the budget as a multiple of the reference length. max gets slack for self-verification;
#: high and low force genuinely shorter reasoning (background §3.3; K3's numbers are not public).
KAPPA = {"max": 2.0, "high": 0.6, "low": 0.25}
#: The smallest budget any problem gets, so easy problems still leave room for a few words of thought:
#: 16 for `small` and larger presets, 8 for `pico` (pass b_floor=8).
B_FLOOR = 16
#: The reward of an over-budget trajectory (one K3 summary says -1; the K2 report's budget control
#: truncates and penalises, the same outcome).
OVER_BUDGET_REWARD = -1.0
#: The share of a teacher's run over which its budget anneals from the parent effort's to its own.
ANNEAL_FRACTION = 0.5


def _count(value, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class BudgetConfig:
    """The named options of the budget stage, with the defaults of the background note."""

    kappa: dict = field(default_factory=lambda: dict(KAPPA))
    b_floor: int = B_FLOOR
    cap: int | None = None  # a global ceiling (the context the sampler can afford); None: no ceiling
    over_budget_reward: float = OVER_BUDGET_REWARD
    anneal_fraction: float = ANNEAL_FRACTION

    def __post_init__(self):
        missing = [e for e in THINKING_EFFORTS if e not in self.kappa]
        if missing or set(self.kappa) - set(THINKING_EFFORTS):
            raise ValueError(f"budget kappa needs exactly the efforts {list(THINKING_EFFORTS)}, "
                             f"got {sorted(self.kappa)}")
        for effort, k in self.kappa.items():
            if isinstance(k, bool) or not isinstance(k, (int, float)) or not k > 0:
                raise ValueError(f"budget kappa[{effort!r}] must be a positive number, got {k!r}")
        _count(self.b_floor, "budget b_floor")
        if self.cap is not None and _count(self.cap, "budget cap", 1) < self.b_floor:
            raise ValueError(f"budget cap {self.cap} is below b_floor {self.b_floor}")
        if not 0.0 < self.anneal_fraction <= 1.0:
            raise ValueError(f"budget anneal_fraction must be in (0, 1], got {self.anneal_fraction!r}")

    def budget(self, reference_tokens: int, effort: str) -> int:
        return think_budget(reference_tokens, effort, kappa=self.kappa, b_floor=self.b_floor, cap=self.cap)

    def reward(self, task_reward: float, think_count: int, budget: int) -> float:
        return budget_reward(task_reward, think_count, budget, over_budget_reward=self.over_budget_reward)


def think_budget(reference_tokens: int, effort: str, *, kappa: dict | None = None, b_floor: int = B_FLOOR,
                 cap: int | None = None) -> int:
    """B_e(x) = max(b_floor, ceil(kappa_e * L(x))), then at most `cap`."""
    _count(reference_tokens, "reference think tokens")
    kappa = KAPPA if kappa is None else kappa
    if effort not in kappa:
        raise ValueError(f"unknown thinking effort {effort!r}; budgets exist for {sorted(kappa)}")
    # the product goes through a decimal string first: 0.6 * 5 is 3.0000000000000004 in binary floats,
    # and a plain ceil would give one token more than the written rule says
    budget = max(_count(b_floor, "b_floor"), math.ceil(round(kappa[effort] * reference_tokens, 9)))
    return budget if cap is None else min(budget, cap)


def over_budget(think_count: int, budget: int) -> bool:
    """True when a trajectory's think tokens exceed its budget (T_think > B)."""
    return _count(think_count, "think token count") > _count(budget, "think budget")


def budget_reward(task_reward: float, think_count: int, budget: int, *,
                  over_budget_reward: float = OVER_BUDGET_REWARD) -> float:
    """r = r_task within the budget, else `over_budget_reward` (a step penalty, not a slope: a correct
    answer inside the budget is never worth less for being longer, which is what keeps GRPO-style
    advantages from collapsing under continuous length penalties; background §2.3)."""
    return float(over_budget_reward) if over_budget(think_count, budget) else float(task_reward)


def should_stop(think_count: int, budget: int) -> bool:
    """The sampler's stop rule: stop as soon as the think count reaches budget + 1 (the reward is
    already fixed at the penalty, so further tokens would only cost compute)."""
    return over_budget(think_count, budget)


def annealed_budget(step: int, total_steps: int, b_from: int, b_to: int, *,
                    fraction: float = ANNEAL_FRACTION) -> int:
    """The budget at `step` (0-based) of a run of `total_steps`: linear from b_from at step 0 to b_to at
    step fraction * total_steps, then b_to. Rounded up, so the schedule never undercuts the line."""
    _count(step, "anneal step")
    _count(total_steps, "anneal total_steps", 1)
    _count(b_from, "anneal b_from")
    _count(b_to, "anneal b_to")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"anneal fraction must be in (0, 1], got {fraction!r}")
    span = fraction * total_steps
    if step >= span:
        return b_to
    return math.ceil(round(b_from + (b_to - b_from) * (step / span), 9))
