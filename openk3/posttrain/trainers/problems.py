"""RL prompts per domain: the problems one RL step samples, each with its verifier and think budget.

    source = ProblemSource("general", "low", tokenizer, budget_from="high")
    problems = source.draw(step, n=8, total_steps=200)      # rollout.Problem list, deterministic in (seed, step)
    ...; source.release(problems)                           # closes the sandboxes of env problems

general: `general.generate` problems of every family in turn, rendered as the SFT records are (the user
message with the effort's system message and the generation prompt); task reward `general.score` of the
parsed response, 0 when the turn does not parse cleanly (a format failure).
agent / coding: the task families of `agentic.DOMAINS` in a `SandboxEnv` (reset here; the rollout forks it
per sample); task reward the task's own verifier.

Budget of a problem x at effort e (background §3.3): B_e(x) = max(b_floor, ceil(kappa_e * L(x))) with L(x)
the think tokens of the generator's max-verbosity reference trace (general: the generator's max trace;
agent/coding: the scripted expert's max episode, played once per problem). With `budget_from` (annealing,
the previous effort's teacher as the starting checkpoint) the budget moves linearly from B_from(x) to
B_e(x) over the first `anneal_fraction` of the run (`budget.annealed_budget`), then stays at B_e(x).
"""

from __future__ import annotations

import random

from openk3.chat import THINKING_EFFORTS, encode_segments, render
from openk3.posttrain.domains.budget import BudgetConfig, annealed_budget
from openk3.posttrain.domains.records import DOMAINS, SPLITS, render_request
from openk3.posttrain.trainers.rollout import Problem
from openk3.tokenizer.files import tokenizer_fingerprint

DIFFICULTIES = (1, 2, 3)
#: L(x) of agent / coding problems, (task id, tokenizer fingerprint) -> think tokens of the expert's max episode:
#: one sandboxed episode per problem, the same for every model evaluated in a process (eval of 12 models
#: would otherwise replay each problem's expert 12 times: ~0.3 s per problem)
_REFERENCE: dict[tuple[str, str], int] = {}


def _general_score(verifier: dict):
    from openk3.posttrain.domains.general import score

    def task_reward(turn: dict) -> float:
        message = turn["message"]
        return 0.0 if message["problems"] else score(verifier, message.get("content") or "")

    return task_reward


class ProblemSource:
    """Deterministic problems of one (domain, effort) cell: step s draws the same ones in every run."""

    def __init__(self, domain: str, effort: str, tokenizer, *, split: str = "train", seed: int = 0,
                 budget: BudgetConfig | None = None, budget_from: str | None = None, max_turns: int = 8,
                 sandbox_options: dict | None = None, levels=None) -> None:
        from openk3.posttrain.domains.general import check_levels

        if domain not in DOMAINS:
            raise ValueError(f"rl domain must be one of {list(DOMAINS)}, got {domain!r}")
        for name, value in (("effort", effort), ("budget_from", budget_from)):
            if value is not None and value not in THINKING_EFFORTS:
                raise ValueError(f"rl {name} must be one of {list(THINKING_EFFORTS)}, got {value!r}")
        if split not in SPLITS:
            raise ValueError(f"rl split must be one of {list(SPLITS)}, got {split!r}")
        self.domain, self.effort, self.tok, self.split, self.seed = domain, effort, tokenizer, split, seed
        self.budget, self.budget_from = budget or BudgetConfig(), budget_from
        self.max_turns, self.sandbox_options = max_turns, dict(sandbox_options or {})
        # general only: the difficulty levels drawn (SFT's, so RL and eval ask what SFT taught); None: all
        self.levels = check_levels(levels, "levels")

    def budget_at(self, reference: int, step: int, total_steps: int) -> int:
        b_to = self.budget.budget(reference, self.effort)
        if self.budget_from is None:
            return b_to
        b_from = self.budget.budget(reference, self.budget_from)
        return annealed_budget(step, total_steps, b_from, b_to, fraction=self.budget.anneal_fraction)

    def draw(self, step: int, n: int, total_steps: int) -> list[Problem]:
        rng = random.Random(f"rl|{self.domain}|{self.split}|{self.seed}|{step}")
        seeds = [rng.randrange(2 ** 31) for _ in range(n)]
        if self.domain == "general":
            return [self._general(step * n + k, s, step, total_steps) for k, s in enumerate(seeds)]
        problems: list[Problem] = []
        try:
            for k, s in enumerate(seeds):
                problems.append(self._agentic(step * n + k, s, step, total_steps))
        except BaseException:
            self.release(problems)
            raise
        return problems

    def release(self, problems: list[Problem]) -> None:
        for p in problems:
            if p.env is not None:
                p.env.close()

    # ---- domains -------------------------------------------------------------------------------------

    def _general(self, k: int, seed: int, step: int, total_steps: int) -> Problem:
        from openk3.posttrain.domains.general import FAMILIES, generate, to_records

        families = sorted(FAMILIES)
        level = None if self.levels is None else random.Random(f"level|{seed}").choice(self.levels)
        problem = generate(families[k % len(families)], seed, self.split, level)
        record = next(r for r in to_records(problem, self.tok, self.budget) if r["effort"] == self.effort)
        reference = record["stats"]["reference_think_tokens"]
        prompt = record["messages"][:1]
        ids = encode_segments(render(render_request(record, prompt, add_generation_prompt=True)), self.tok).ids
        meta = {"domain": "general", "effort": self.effort, "family": problem.family, "difficulty": problem.difficulty,
                "seed": seed, "split": self.split, "tools": [], "messages": prompt, "reference_think_tokens": reference,
                "verifier": dict(problem.verifier)}
        return Problem(record["id"], ids, self.budget_at(reference, step, total_steps),
                       score=_general_score(problem.verifier), meta=meta)

    def _agentic(self, k: int, seed: int, step: int, total_steps: int) -> Problem:
        from openk3.agent import SandboxEnv
        from openk3.agent.tasks import generate
        from openk3.posttrain.domains.agentic import DOMAINS as FAMILIES
        from openk3.posttrain.domains.agentic import act
        from openk3.posttrain.domains.records import think_tokens

        families = FAMILIES[self.domain]
        task = generate(families[k % len(families)], seed, DIFFICULTIES[k // len(families) % len(DIFFICULTIES)],
                        self.split)
        key = (task.id, tokenizer_fingerprint(self.tok))
        if key not in _REFERENCE:
            expert = act(task, "max", tokenizer=self.tok)
            _REFERENCE[key] = think_tokens({"messages": expert["messages"], "tools": expert["tools"],
                                            "effort": "max"}, self.tok)
        reference = _REFERENCE[key]
        env = SandboxEnv(task, self.tok, effort=self.effort, max_steps=self.max_turns,
                         sandbox_options=self.sandbox_options)
        try:
            obs = env.reset()
        except BaseException:
            env.close()
            raise
        meta = {"domain": self.domain, "effort": self.effort, "family": task.family, "difficulty": task.difficulty,
                "seed": seed, "split": self.split, "tools": obs.tools, "reference_think_tokens": reference,
                "verifier": {"kind": "task", "task": task.id}}
        return Problem(f"{self.domain}/{task.id}/{self.effort}", obs.prompt_ids,
                       self.budget_at(reference, step, total_steps), env=env, meta=meta)
