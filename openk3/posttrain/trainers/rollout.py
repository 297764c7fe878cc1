"""On-policy rollouts for RL: problems x group size sampled through the inference `Engine`, token in, token out.

    problems = [Problem("p0", prompt_ids, budget=64, score=my_verifier, meta={...}), ...]
    records = rollout(engine, problems, tokenizer, RolloutConfig(group_size=8, seed=step))

Every sampled token id is kept with its behaviour log-prob (the engine's log-prob of the token at the
sampling temperature; temperature 1 and top-p 1 by default, background §3.5), so the trainer scores
exactly what was sampled. Per trajectory (background §3.3):

* think tokens are counted online over every assistant turn: a turn whose prompt ends in
  `<|open|>think<|sep|>` is in the think channel until its first `<|close|>` id (the start of
  `<|close|>think<|sep|>`; tags excluded, as `records.think_tokens` counts them). As soon as the count
  reaches budget + 1 (`budget.should_stop`) the request is aborted: the reward is already fixed at the
  over-budget penalty, so further tokens only cost compute;
* the rest of a turn (from the closing tag through the response and tool calls) has its own cap,
  `response_cap` tokens; going over it is a format failure (reward 0), so reasoning cannot hide there;
* a turn ends at a stop id (`<|end_of_msg|>`, `[EOS]`); the context limit ends the trajectory (format
  failure too);
* multi-turn problems (agent, coding) run in a `SandboxEnv`, forked once per group sample: after each
  turn the env executes the tool calls and appends the tool messages and the next generation prompt
  (gen_mask 0); the ids stay a from-scratch render of the conversation (env_render.Transcript).

A rollout record (background §4.2): the problem's `meta` (id, domain, effort, family, ...) plus
`token_ids` (prompt + generated + env, the full sequence), `gen_mask` (1 = sampled by the policy),
`behaviour_logprobs` (one per sampled token, i.e. per 1 in gen_mask, in order; empty with
`RolloutConfig(logprobs=False)`), `prompt_len`,
`think_tokens`, `budget_think_tokens`, `turns`, `stopped_reason` (eos | budget | response_cap | context,
or the env's end: submit | stop | max_steps | max_tool_seconds | sandbox_error), `reward` and
`reward_components` (`task`, `budget`, `format`, `invalid_calls`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from openk3.chat import CLOSE, OPEN, SEP, parse_tokens
from openk3.chat.lexer import token_pieces
from openk3.chat.parse import marker_ids_of
from openk3.infer.sample import MIN_TEMPERATURE, SamplingParams
from openk3.posttrain.domains.budget import OVER_BUDGET_REWARD, budget_reward, should_stop

#: The per-turn cap on tokens after the think channel closes (response and tool calls): generous (an
#: answer needs far fewer), so hitting it means the model is padding or looping (background §3.3).
RESPONSE_CAP = 256
#: Shared prompt heads shorter than this are not worth a snapshot (a copy of the state costs about as much).
MIN_SHARED_PREFIX = 16
#: What the reward is when a trajectory breaks the format (response cap, context limit, env truncation).
FORMAT_FAILURE_REWARD = 0.0


@dataclass
class Problem:
    """One prompt to sample a group for.

    id: names the problem in the records (sample k of it is `<id>#k`).
    prompt_ids: the rendered conversation ending in the generation prompt (single-turn problems; for
        env problems the env's own ids are used).
    budget: think tokens allowed over the whole trajectory (B_e(x), annealed at this step).
    score: single-turn task reward, called with the finished turn as {"ids": generated ids, "message":
        the parsed assistant message (content, reasoning_content, tool_calls, problems)} -> float.
    env: a reset `SandboxEnv` (multi-turn); forked once per sample, its task's verifier is the reward.
        The caller owns it (closes it); the forks are closed here.
    meta: copied into every record (domain, effort, family, difficulty, seed, split, messages, ...).
    """

    id: str
    prompt_ids: list[int]
    budget: int
    score: Callable[[dict], float] | None = None
    env: Any = None
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 8
    temperature: float = 1.0
    response_cap: int = RESPONSE_CAP
    seed: int = 0  # turn t of sample k of problem i draws with the seed sample_seed(seed, i, k, t)
    extra_stop_ids: tuple[int, ...] = ()  # ids that end a turn besides the tokenizer's stop ids
    over_budget_reward: float = OVER_BUDGET_REWARD
    # behaviour log-probs per sampled token (RL's importance correction needs them; the engine's "processed"
    # log-probs, temperature applied); eval turns them off
    logprobs: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"rollout group_size must be an int >= 1, got {self.group_size!r}")
        if not self.temperature > 0:
            raise ValueError(f"rollout temperature must be > 0 (RL samples; greedy has no behaviour policy to "
                             f"correct for), got {self.temperature!r}")
        if self.logprobs and self.temperature < MIN_TEMPERATURE:  # the engine samples greedily below it (as
            # vLLM), so no tempered behaviour log-prob exists; eval (logprobs off) uses a tiny T for argmax
            raise ValueError(f"rollout temperature must be >= {MIN_TEMPERATURE} when behaviour log-probs are "
                             f"recorded (below it sampling is greedy), got {self.temperature!r}")
        if isinstance(self.response_cap, bool) or not isinstance(self.response_cap, int) or self.response_cap < 1:
            raise ValueError(f"rollout response_cap must be an int >= 1, got {self.response_cap!r}")


def sample_seed(seed: int, problem: int, sample: int, turn: int = 0) -> int:
    """The sampler seed of one turn of one group sample: a hash of (call seed, problem index, sample index,
    turn), the same in every process, so a resumed run draws exactly the tokens the uninterrupted run drew
    and no two turns of a call share a random stream."""
    key = f"{seed}|{problem}|{sample}|{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class _Episode:
    """One group sample's trajectory being built (token in, token out)."""

    def __init__(self, problem: Problem, index: int, sample: int, env) -> None:
        self.problem, self.index, self.sample, self.env = problem, index, sample, env
        self.ids = list(env.ids if env is not None else problem.prompt_ids)
        self.prompt_len = len(self.ids)
        self.gen_mask = [0] * len(self.ids)
        self.logprobs: list[float] = []
        self.think = self.turns = self.invalid_calls = 0
        self.stopped: str | None = None
        self.env_reward = 0.0
        self.last_turn: list[int] = []
        # per turn
        self.turn: list[int] = []
        self.in_think = False
        self.rest = 0
        self.turn_end: str | None = None

    @property
    def key(self) -> str:
        return f"{self.problem.id}#{self.sample}"


class Sampler:
    """Drives one `Engine` (no tokenizer needed there: prompts are ids) over episodes; see `rollout`."""

    def __init__(self, engine, tokenizer, cfg: RolloutConfig) -> None:
        self.engine, self.tok, self.cfg = engine, tokenizer, cfg
        self.close_id = tokenizer.special_ids[CLOSE]
        self.think_open = [tokenizer.special_ids[OPEN], *tokenizer.encode("think"), tokenizer.special_ids[SEP]]
        self.stop_ids = frozenset(tokenizer.stop_ids) | frozenset(cfg.extra_stop_ids)
        self.live: dict[str, _Episode] = {}
        self.aborted = False
        # with the engine's prefix cache: shared prompt heads are prefilled once and a next turn continues
        # from the state its previous turn left (infer/prefix.py); `shared` is set per run
        self.snapshots = getattr(engine, "prefix", None) is not None
        self.shared: dict[int, tuple[int, ...]] = {}  # id(episode) -> prompt lengths it shares with others

    # ---- per turn ------------------------------------------------------------------------------------

    def _start_turn(self, ep: _Episode) -> None:
        ep.turn, ep.rest, ep.turn_end = [], 0, None
        ep.in_think = ep.ids[-len(self.think_open):] == self.think_open
        left = ep.problem.budget - ep.think + 1  # think tokens until should_stop fires
        max_tokens = (max(left, 0) + 1 if ep.in_think else 0) + self.cfg.response_cap + 1
        params = SamplingParams(temperature=self.cfg.temperature, top_p=1.0, max_tokens=max_tokens,
                                seed=sample_seed(self.cfg.seed, ep.index, ep.sample, ep.turns),
                                # the behaviour policy's log-prob: of p^(1/T) renormalised, computed in the engine
                                logprobs=0 if self.cfg.logprobs else None, logprobs_mode="processed")
        rid = f"{ep.key}/t{ep.turns}"
        hints = {}
        if self.snapshots:
            shared = self.shared.get(id(ep), ()) if ep.turns == 0 else ()
            points = [p for p in (min(k, len(ep.ids) - 1) for k in shared) if p >= MIN_SHARED_PREFIX]  # engine sorts
            hints = {"cache_prefix": points or None, "keep_cache": ep.env is not None}
        try:
            self.engine.add_request(ep.ids, params, request_id=rid, stop_token_ids=self.stop_ids, ignore_eos=True,
                                    **hints)
        except ValueError:
            if len(ep.ids) < self.engine.max_model_len:
                raise
            ep.stopped = "context"  # no room left for even one token
            return
        self.live[rid] = ep

    def _accept(self, ep: _Episode, tok: int, entry) -> None:
        """One sampled token: record it, then apply the stop rules in order (stop id, think budget, cap)."""
        ep.turn.append(tok)
        ep.ids.append(tok)
        ep.gen_mask.append(1)
        if entry is not None:
            ep.logprobs.append(float(entry[0]))
        self._stop_rules(ep, tok)

    def _stop_rules(self, ep: _Episode, tok: int) -> None:
        if tok in self.stop_ids:
            ep.turn_end = "eos"
        elif ep.in_think:
            if tok == self.close_id:
                ep.in_think = False
            else:
                ep.think += 1
                if should_stop(ep.think, ep.problem.budget):
                    ep.turn_end = "budget"
        else:
            ep.rest += 1
            if ep.rest > self.cfg.response_cap:
                ep.turn_end = "response_cap"

    def _end_turn(self, ep: _Episode) -> None:
        ep.turns += 1
        ep.last_turn = ep.turn
        if ep.env is None or ep.turn_end != "eos":
            ep.stopped = ep.turn_end
            return
        obs, reward, terminated, truncated, info = ep.env.step(list(ep.turn))
        ep.invalid_calls += sum(not c["ok"] for c in info["calls"])
        ep.ids += obs.append_ids
        ep.gen_mask += [0] * len(obs.append_ids)
        assert ep.ids == ep.env.ids, "the trajectory's ids drifted from the env's render"
        if terminated or truncated:
            ep.env_reward, ep.stopped = float(reward), info.get("reason", "stop")
            return
        self._start_turn(ep)

    # ---- the loop ------------------------------------------------------------------------------------

    def run(self, episodes: list[_Episode]) -> None:
        if self.snapshots:
            self.shared = {id(ep): n for ep, n in zip(episodes, shared_prefixes([ep.ids for ep in episodes]),
                                                      strict=True)}
        for ep in episodes:
            self._start_turn(ep)
        while self.live:
            outputs = self.engine.step()
            for out in outputs:
                ep = self.live.get(out.request_id)
                if ep is None:
                    continue
                entries = out.delta_logprobs if self.cfg.logprobs else [None] * len(out.delta_token_ids)
                for tok, entry in zip(out.delta_token_ids, entries or [], strict=True):
                    self._accept(ep, tok, entry)
                    if ep.turn_end is not None:
                        break  # a token sampled in the same step after the stop is dropped
                if ep.turn_end is None and out.finished:
                    # our max_tokens never binds before the rules above, so a length finish is the context
                    ep.turn_end = "context" if out.finish_reason == "length" else out.finish_reason
                if ep.turn_end is not None:
                    del self.live[out.request_id]
                    if not out.finished:
                        self.engine.abort(out.request_id)
                        self.aborted = True
                    self._end_turn(ep)
            if not outputs and not self.engine.has_unfinished() and self.live:
                raise AssertionError(f"engine idle with episodes still live: {sorted(self.live)}")


def shared_prefixes(seqs: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """For each sequence, the lengths of the prefixes it shares with the others (the distinct longest common
    prefixes with each other sequence, increasing; empty when it shares nothing): where the prompts branch.
    Snapshots at every branch point let each prompt start from the deepest one it passes (tool declarations
    shared by all, then an effort's system message shared by a cell, then a group's identical prompt), where
    one snapshot per prompt at its longest shared prefix left most prompts missing every stored one.
    In sorted order the common prefix with the m-th neighbour is the minimum of the adjacent ones between."""
    order = sorted(range(len(seqs)), key=lambda i: list(seqs[i]))
    adjacent = []  # adjacent[r]: common prefix of sorted positions r and r + 1
    for a, b in zip(order, order[1:], strict=False):
        x, y = seqs[a], seqs[b]
        adjacent.append(next((k for k, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y))))
    out: list[tuple[int, ...]] = [()] * len(seqs)
    for r, i in enumerate(order):
        lengths = set()
        for side in (adjacent[r:], adjacent[:r][::-1]):  # neighbours to the right, then to the left
            run = None
            for n in side:
                run = n if run is None else min(run, n)
                if run == 0:
                    break
                lengths.add(run)
        out[i] = tuple(sorted(lengths))
    return out


def parse_turn(ids: Sequence[int], tokenizer, thinking: bool = True) -> dict:
    """The assistant message of one generated turn, parsed on ids (markers by id; runs of other ids are
    decoded together, since a byte-level tokenizer splits multi-byte characters across ids)."""
    markers = marker_ids_of(tokenizer)
    return parse_tokens(token_pieces(ids, tokenizer, markers), thinking=thinking, marker_ids=markers)


def _reward(ep: _Episode, tokenizer, over: float) -> tuple[float, dict]:
    """(reward, components): over budget -> `over`; a format failure -> 0; else the task reward."""
    components = {"task": 0.0, "budget": 0.0, "format": 1.0, "invalid_calls": ep.invalid_calls}
    if ep.think > ep.problem.budget:
        components["budget"] = over
        return budget_reward(0.0, ep.think, ep.problem.budget, over_budget_reward=over), components
    if ep.env is not None:
        task = ep.env_reward
        components["format"] = float(ep.stopped in ("submit", "stop"))
    elif ep.stopped == "eos":
        message = parse_turn(ep.last_turn, tokenizer, thinking=bool(ep.problem.meta.get("thinking", True)))
        task = float(ep.problem.score({"ids": list(ep.last_turn), "message": message}))
    else:
        components["format"] = 0.0
        task = FORMAT_FAILURE_REWARD
    components["task"] = task
    return budget_reward(task, ep.think, ep.problem.budget, over_budget_reward=over), components


def rollout(engine, problems: Sequence[Problem], tokenizer, cfg: RolloutConfig, *,
            policy_version: int = 0) -> list[dict]:
    """Sample `cfg.group_size` trajectories per problem (all in one continuous batch) and score them.

    Returns the records in problem order, the samples of a problem contiguous (as the group losses
    expect). `engine` is an `openk3.infer.engine.Engine` over the policy being trained (sharing its
    modules, so an optimizer step is what the next rollout samples from). With the engine's prefix cache
    (`Engine(prefix_cache=N)`) the problems' shared prompt heads and every finished env turn are snapshot,
    so each token is prefilled about once; the snapshots live for this call only.
    """
    for p in problems:
        if (p.env is None) == (p.score is None):
            raise ValueError(f"problem {p.id!r}: give exactly one of score (single-turn) and env (multi-turn)")
    sampler = Sampler(engine, tokenizer, cfg)
    if sampler.snapshots:
        engine.prefix.clear()  # states of an earlier call may come from weights the trainer has changed since
    episodes: list[_Episode] = []
    forks: list = []
    try:
        for i, p in enumerate(problems):
            envs = p.env.fork(cfg.group_size) if p.env is not None else [None] * cfg.group_size
            forks += [e for e in envs if e is not None]
            episodes += [_Episode(p, i, k, env) for k, env in enumerate(envs)]
        sampler.run(episodes)
        records = []
        for ep in episodes:
            reward, components = _reward(ep, tokenizer, cfg.over_budget_reward)
            record = {**ep.problem.meta, "id": ep.key, "problem_id": ep.problem.id, "sample": ep.sample,
                      "policy_version": policy_version, "token_ids": ep.ids, "gen_mask": ep.gen_mask,
                      "behaviour_logprobs": ep.logprobs, "prompt_len": ep.prompt_len, "think_tokens": ep.think,
                      "budget_think_tokens": ep.problem.budget, "turns": ep.turns, "stopped_reason": ep.stopped,
                      "reward": reward, "reward_components": components}
            if ep.env is not None:
                record["messages"] = [dict(m) for m in ep.env.transcript.messages]
            records.append(record)
        return records
    finally:
        for rid in list(sampler.live):
            engine.abort(rid)
        if sampler.aborted or sampler.live:
            engine.step()  # aborts apply at a step's start: leave the engine empty for the next caller
        for env in forks:
            env.close()
        if sampler.snapshots:
            engine.prefix.clear()
