"""Evaluation of post-trained models on every (domain, effort) cell (issue 18 item 6).

    M = evaluate("runs/student", n_per_cell=64, samples=4)          # {domain: {effort: cell metrics}}

The report over several models (report.json, report.md, the plots) is `openk3.posttrain.evaluation.report`.

A cell (d, e) draws `n_per_cell` problems of domain d from `trainers.problems.ProblemSource` (the RL problems, on
the `test` split by default; the same problems for every model and every effort, since the draw depends on
(domain, split, seed) only), renders them with effort e's system message and samples `samples` trajectories
per problem through the inference engine (`rollout.rollout`: agent and coding turns run in the sandbox).

Unlike RL, nothing is stopped at the think budget: the deployed model is not truncated (background §3.3,
§3.8), so evaluation measures how long it really thinks and reports budget compliance beside accuracy. The
only stop inside the think channel is `think_cap` (default: the context limit), a compute bound that should
sit far above the budgets; a trajectory that hits it scores 0 and is counted in `think_cap_rate`.

Per cell (background §3.9), over all n = problems x samples trajectories:

    accuracy             mean task reward (the verifier's; 1/0 for exact answers and hidden tests, the share of
                         constraints met for instruction following), whatever the think length
    thinking_tokens      mean think-channel tokens over all assistant turns (tags excluded); _p90 nearest-rank
    budget_compliance    share of trajectories with think tokens <= B_e(x), the cell's budget for the problem
    invalid_tool_calls   mean invalid tool calls per trajectory (agent/coding; 0 for general)
    turns, generated_tokens   mean assistant turns and sampled tokens (all channels) per trajectory
    format_failure_rate  share whose reward component `format` is 0 (response cap, context, env truncation)
    think_cap_rate       share stopped at `think_cap`
    forced_rate          share whose response was forced at the budget (budget forcing only)
    think_difficulty_corr     Pearson correlation of think tokens with problem difficulty (adaptivity;
                         None when either is constant)
    think_tokens_samples the per-trajectory think counts (the effort-separation plot's distributions)
    task_samples, problem_ids   the per-trajectory task rewards and problems (paired comparisons, `report`)
    ci95                 95 % intervals of accuracy, thinking_tokens and budget_compliance (`openk3.stats`:
                         Wilson for a 0/1 rate with one sample per problem, else the bootstrap over problems)
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Sequence

from openk3.chat import CLOSE, SEP, THINKING_EFFORTS
from openk3.posttrain.domains.budget import BudgetConfig
from openk3.posttrain.domains.records import DOMAINS, SPLITS
from openk3.posttrain.trainers.problems import ProblemSource
from openk3.posttrain.trainers.rollout import RESPONSE_CAP, Problem, RolloutConfig, parse_turn, rollout
from openk3.stats import gap_closed, mean_ci, per_problem, rate_ci

#: Every cell, as "domain/effort" (the order of the report's tables and of the teachers' keys).
CELLS = tuple(f"{d}/{e}" for d in DOMAINS for e in THINKING_EFFORTS)
#: The single models of the report contract (issue 18 item 7); the nine teachers are under "teachers".
MODEL_KEYS = ("sft", "student", "merged")
#: The least trajectories per cell the report contract asks for.
MIN_N = 16
#: Problems a cell draws per source step: fixed, so the problems do not depend on how rounds are packed.
DRAW_CHUNK = 32
#: A sampling temperature the sampler treats as greedy (`infer.sample.MIN_TEMPERATURE` is 1e-5) while the
#: rollout, which refuses 0 (it records behaviour log-probs for RL), still accepts it.
_GREEDY_TEMPERATURE = 1e-6


def parse_cells(spec: str | Iterable[str] | None) -> list[tuple[str, str]]:
    """Cells from "general/low,agent" (a bare domain means its three efforts; "all" or None: every cell),
    in CELLS order without repeats. An unknown domain or effort is a ValueError naming it."""
    if spec is None:
        items = ["all"]
    elif isinstance(spec, str):
        items = [s.strip() for s in spec.split(",") if s.strip()]
    else:
        items = list(spec)
    chosen: set[str] = set()
    for item in items:
        if item == "all":
            chosen.update(CELLS)
            continue
        domain, _, effort = item.partition("/")
        if domain not in DOMAINS:
            raise ValueError(f"eval cells: unknown domain {domain!r} in {item!r} (domains: {list(DOMAINS)})")
        if effort and effort not in THINKING_EFFORTS:
            raise ValueError(f"eval cells: unknown effort {effort!r} in {item!r} (efforts: {list(THINKING_EFFORTS)})")
        chosen.update(f"{domain}/{e}" for e in ([effort] if effort else THINKING_EFFORTS))
    if not chosen:
        raise ValueError(f"eval cells: no cell in {spec!r}")
    return [tuple(c.split("/")) for c in CELLS if c in chosen]


# ---- metrics -----------------------------------------------------------------------------------------


def p90(values: Sequence[float]) -> float:
    """The nearest-rank 90th percentile (the value 90 % of the samples are at or below)."""
    ordered = sorted(values)
    return float(ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]) if ordered else 0.0


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Pearson's r, or None when either side is constant (or there are fewer than two points)."""
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return None
    return sxy / math.sqrt(sxx * syy)


def cell_metrics(records: Sequence[dict]) -> dict:
    """The metrics of one cell from its evaluation records (rollout records whose `budget_think_tokens` is
    the cell's budget B_e(x), as `evaluate_engine` leaves them); see the module docstring."""
    if not records:
        raise ValueError("eval: a cell with no trajectories has no metrics")
    n = len(records)

    def mean(values) -> float:
        return sum(values) / n

    think = [int(r["think_tokens"]) for r in records]
    task = [float(r["reward_components"]["task"]) for r in records]
    within = [float(t <= r["budget_think_tokens"]) for t, r in zip(think, records, strict=True)]
    problems = [str(r.get("problem_id", r.get("id"))) for r in records]
    return {
        "accuracy": mean(task),
        "thinking_tokens": mean(think),
        "thinking_tokens_p90": p90(think),
        "n": n,
        "problems": len(set(problems)),
        "budget_compliance": mean(within),
        "budget_think_tokens": mean(r["budget_think_tokens"] for r in records),
        "invalid_tool_calls": mean(r["reward_components"]["invalid_calls"] for r in records),
        "turns": mean(r["turns"] for r in records),
        "generated_tokens": mean(sum(r["gen_mask"]) for r in records),
        "format_failure_rate": mean(r["reward_components"]["format"] == 0 for r in records),
        "think_cap_rate": mean(r["stopped_reason"] == "budget" for r in records),
        "forced_rate": mean(bool(r.get("forced")) for r in records),
        "think_difficulty_corr": pearson(think, [float(r.get("difficulty", 0)) for r in records]),
        "think_tokens_samples": think,
        # per trajectory, aligned with think_tokens_samples: what paired comparisons between models need
        "task_samples": task,
        "problem_ids": problems,
        # 95 % intervals (`openk3.stats`): Wilson for a 0/1 rate with one sample per problem, else the
        # bootstrap over problems
        "ci95": {"accuracy": list(rate_ci(task, problems)), "thinking_tokens": list(mean_ci(think, problems)),
                 "budget_compliance": list(rate_ci(within, problems))},
    }


def per_problem_scores(c: dict, key: str = "thinking_tokens") -> dict | None:
    """{problem: mean of its samples} of a cell's think tokens (`key` "thinking_tokens") or task reward
    ("accuracy"), for paired tests; None for a cell evaluated before the per-trajectory lists were kept."""
    samples = c.get({"thinking_tokens": "think_tokens_samples", "accuracy": "task_samples"}[key])
    problems = c.get("problem_ids")
    if not samples or not problems or len(samples) != len(problems):
        return None
    return per_problem(samples, problems)


def share_of_gain(c: dict, sft: dict, teacher: dict):
    """`stats.gap_closed` of a cell's accuracy: the share of the teacher's gain over SFT that `c` closes, paired
    over the problems; None when a cell lacks per-problem samples or the teacher gained nothing."""
    arms = [per_problem_scores(x, "accuracy") for x in (c, sft, teacher)]
    return None if None in arms else gap_closed(*arms)


# ---- running a model ---------------------------------------------------------------------------------


def budget_forced_rollout(engine, problems: Sequence[Problem], budgets: dict[str, int], tokenizer,
                          cfg: RolloutConfig) -> list[dict]:
    """Budget forcing (background §3.8): sample as `rollout` does, but a trajectory whose thinking reaches
    its budget B = budgets[problem id] keeps its first B think tokens, gets `<|close|>think<|sep|>`
    appended (not sampled: gen_mask 0) and samples its response from there; it is scored on the whole
    turn and marked "forced". Single-turn problems only."""
    for p in problems:
        if p.env is not None:
            raise ValueError(f"budget forcing: problem {p.id!r} is multi-turn; it is implemented for single-turn "
                             "problems only")
    first = rollout(engine, [dataclasses.replace(p, budget=budgets[p.id]) for p in problems], tokenizer, cfg)
    close = [tokenizer.special_ids[CLOSE], *tokenizer.encode("think"), tokenizer.special_ids[SEP]]
    by_id = {p.id: p for p in problems}
    forced: list[int] = []
    seconds: list[Problem] = []
    for i, r in enumerate(first):
        if r["stopped_reason"] != "budget":
            continue
        p, b = by_id[r["problem_id"]], budgets[r["problem_id"]]
        prefix = r["token_ids"][r["prompt_len"]:][:b] + close  # the (B+1)-th think token is dropped

        def score(turn: dict, prefix=prefix, p=p) -> float:  # the whole turn: forced thinking + response
            ids = prefix + list(turn["ids"])
            return p.score({"ids": ids, "message": parse_turn(ids, tokenizer)})

        seconds.append(Problem(r["id"], r["token_ids"][:r["prompt_len"]] + prefix, b, score=score))
        forced.append(i)
    if not seconds:
        return first
    second = rollout(engine, seconds, tokenizer, dataclasses.replace(cfg, group_size=1, seed=cfg.seed + 1))
    for i, r2 in zip(forced, second, strict=True):
        r, b = first[i], budgets[first[i]["problem_id"]]
        sampled = r2["gen_mask"][r2["prompt_len"]:]
        first[i] = {**r, "token_ids": r2["token_ids"], "think_tokens": b, "forced": True,
                    "gen_mask": [0] * r["prompt_len"] + [1] * b + [0] * len(close) + sampled,
                    "behaviour_logprobs": r["behaviour_logprobs"][:b] + r2["behaviour_logprobs"],
                    "stopped_reason": r2["stopped_reason"], "reward": r2["reward"],
                    "reward_components": r2["reward_components"]}
    return first


def evaluate_engine(engine, tokenizer, cells: Iterable[tuple[str, str]] | str | None = None, n_per_cell: int = MIN_N,
                    split: str = "test", seed: int = 0, temperature: float = 1.0, samples: int = 1, *,
                    think_cap: int | None = None, response_cap: int = RESPONSE_CAP, max_turns: int = 8,
                    budget: BudgetConfig | None = None, batch_problems: int = 32, sandbox_options: dict | None = None,
                    prompt_effort: str | None = None, budget_forcing: bool = False, levels=None,
                    on_records: Callable[[str, str, list[dict]], None] | None = None) -> dict:
    """M = {domain: {effort: cell_metrics}} of the model behind `engine` (an `infer.Engine`, or anything
    with its add_request/step/abort surface) on `cells` (default all nine). temperature 0 is greedy (one
    sample per problem). on_records(domain, effort, records) sees each cell's records.

    prompt_effort: render every cell's prompts with this effort's system message (the budgets stay the
    cell's); budget_forcing: stop thinking at the cell's budget and force the response
    (`budget_forced_rollout`; single-turn domains). Together, prompt_effort="max" and budget_forcing give
    the background's baseline: the max teacher forced to each effort's budget (§3.8). levels: the general
    difficulty levels drawn (None: all; a model SFT-trained on levels 1-2 is evaluated on those)."""
    cells = parse_cells(cells) if cells is None or isinstance(cells, str) else list(cells)
    for name, value, least in (("n_per_cell", n_per_cell, 1), ("samples", samples, 1),
                               ("batch_problems", batch_problems, 1), ("response_cap", response_cap, 1),
                               ("max_turns", max_turns, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"eval {name} must be an integer >= {least}, got {value!r}")
    if split not in SPLITS:
        raise ValueError(f"eval split must be one of {list(SPLITS)}, got {split!r}")
    if not temperature >= 0:
        raise ValueError(f"eval temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if temperature == 0 and samples != 1:
        raise ValueError(f"eval: greedy decoding (temperature 0) draws the same trajectory every time; "
                         f"use samples=1, got {samples}")
    cap = engine.max_model_len if think_cap is None else think_cap
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"eval think_cap must be an integer >= 1, got {think_cap!r}")
    if prompt_effort is not None and prompt_effort not in THINKING_EFFORTS:
        raise ValueError(f"eval prompt_effort must be one of {list(THINKING_EFFORTS)} or None, got {prompt_effort!r}")
    if budget_forcing and any(d != "general" for d, _ in cells):
        raise ValueError("eval: budget forcing is implemented for the single-turn general domain only, got cells "
                         f"{[f'{d}/{e}' for d, e in cells if d != 'general']}")
    budget = budget or BudgetConfig()
    sources = {cell: ProblemSource(cell[0], prompt_effort or cell[1], tokenizer, split=split, seed=seed,
                                   budget=budget, max_turns=max_turns, sandbox_options=sandbox_options,
                                   levels=levels)
               for cell in cells}
    records: dict[tuple[str, str], list[dict]] = {cell: [] for cell in cells}
    # Problems of several cells share one rollout (one continuous batch) up to batch_problems at a time: a
    # cell alone (16 problems) leaves most of a 32-slot engine idle while its slowest episode finishes.
    for k, round_ in enumerate(eval_rounds(cells, n_per_cell, batch_problems)):
        problems, owner = [], []
        try:
            for cell, chunk, n in round_:
                drawn = sources[cell].draw(chunk, n, total_steps=1)
                if prompt_effort is not None:  # every cell draws the prompt effort's problems: ids would repeat
                    drawn = [dataclasses.replace(p, id=f"{p.id}@{cell[1]}") for p in drawn]
                problems += drawn
                owner += [cell] * len(drawn)
            budgets = {p.id: budget.budget(p.meta["reference_think_tokens"], cell[1])
                       for p, cell in zip(problems, owner, strict=True)}
            roll = RolloutConfig(group_size=samples, temperature=temperature or _GREEDY_TEMPERATURE,
                                 response_cap=response_cap, seed=seed * 100_003 + k, logprobs=False)
            if budget_forcing:
                round_records = budget_forced_rollout(engine, problems, budgets, tokenizer, roll)
            else:  # the rollout's think stop moves from the budget (RL's rule) up to the compute cap
                round_records = rollout(engine, [dataclasses.replace(p, budget=cap) for p in problems], tokenizer,
                                        roll)
        finally:
            for p in problems:
                if p.env is not None:
                    p.env.close()
        cell_of = {p.id: cell for p, cell in zip(problems, owner, strict=True)}
        assert len(cell_of) == len(problems), "two problems of one round share an id"
        for r in round_records:
            r["budget_think_tokens"], r["think_cap"] = budgets[r["problem_id"]], cap
            r["effort"] = cell_of[r["problem_id"]][1]  # the cell's (the prompt's may differ: prompt_effort)
            records[cell_of[r["problem_id"]]].append(r)
    out: dict = {}
    for cell in cells:
        if on_records is not None:
            on_records(*cell, records[cell])
        out.setdefault(cell[0], {})[cell[1]] = cell_metrics(records[cell])
    return out


def eval_rounds(cells: list[tuple[str, str]], n_per_cell: int, batch_problems: int) -> list[list[tuple]]:
    """The rollouts of an evaluation: lists of (cell, chunk, n). Every cell is cut into chunks of at most
    DRAW_CHUNK problems (chunk k is its source's step k), so a cell draws the same problems whatever the
    engine's size and whichever other cells run; chunks fill rounds of up to batch_problems problems (at least
    one chunk each) in cell order."""
    rounds: list[list[tuple]] = [[]]
    room = max(batch_problems, DRAW_CHUNK)
    for cell in cells:
        for chunk, start in enumerate(range(0, n_per_cell, DRAW_CHUNK)):
            n = min(DRAW_CHUNK, n_per_cell - start)
            if n > room and rounds[-1]:
                rounds.append([])
                room = max(batch_problems, DRAW_CHUNK)
            rounds[-1].append((cell, chunk, n))
            room -= n
    return rounds


def evaluate(model_dir: str | os.PathLike, cells: Iterable[tuple[str, str]] | str | None = None,
             n_per_cell: int = MIN_N, split: str = "test", seed: int = 0, temperature: float = 1.0,
             samples: int = 1, *, max_num_seqs: int = 32, max_model_len: int | None = None, device: str | None = None,
             **options) -> dict:
    """`evaluate_engine` on the checkpoint (or run folder) `model_dir`, with its own tokenizer."""
    from openk3.infer.llm import LLM

    llm = LLM(model_dir, max_num_seqs=max_num_seqs, max_model_len=max_model_len, device=device,
              prefix_cache=2 * max_num_seqs + 8)
    if llm.tokenizer is None:
        raise ValueError(f"{model_dir}: eval renders prompts with the model's own tokenizer, and it has none")
    # a round fills the engine: its problems' trajectories are decoded together (one round per 64 by default)
    options.setdefault("batch_problems", max(1, max_num_seqs // samples))
    return evaluate_engine(llm.engine, llm.tokenizer, cells, n_per_cell, split, seed, temperature, samples,
                           **options)


# ---- the models of a report ---------------------------------------------------------------------------


def model_rows(models: dict) -> list[tuple[str, dict]]:
    """(label, M) of every evaluated model in report order: sft, student, merged, any other names, then the
    teachers as "teacher D/E" in CELLS order."""
    named = [k for k in MODEL_KEYS if k in models] + sorted(k for k in models if k not in MODEL_KEYS
                                                            and k != "teachers")
    rows = [(k, models[k]) for k in named]
    teachers = models.get("teachers", {})
    rows += [(f"teacher {c}", teachers[c]) for c in CELLS if c in teachers]
    rows += [(f"teacher {c}", teachers[c]) for c in sorted(teachers) if c not in CELLS]
    return rows
