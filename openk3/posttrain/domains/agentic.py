"""SFT trajectories for the `agent` and `coding` domains: scripted experts acting in the real sandbox (issue 18).

    records = agentic_dataset("agent", n_per_cell=4, seed=0, split="train")   # tool_arith, data_wrangle, multi_hop
    records = agentic_dataset("coding", n_per_cell=4, seed=0, split="test")   # fix_test, implement_spec
    verify_record(records[0])                                                 # [] when it is accepted

Each problem is a task of `openk3.agent.tasks` (generated from a seed; train/test/heldout as the family
splits them; multi_hop and implement_spec are families there too). For every problem the expert of
its family (traces.py) plays one episode per effort (low, high, max) through `SandboxEnv`, so the tool
messages are what the sandbox really returned and the reward is the task's own verifier. About
`recovery_rate` of the episodes are recovery episodes: a scripted mistake, its error observed, then the fix.

A record is accepted only after multi-stage verification (background §4.3), `verify_record`:
  1. the verifier's reward is 1.0, and (replay_episode) the record's assistant turns, replayed in a fresh
     sandbox, get the same tool messages and reward 1.0 again;
  2. the render -> parse round trip gives back every assistant turn (`records.roundtrip_problems`);
  3. its think tokens fit the effort's budget B_e = max(b_floor, ceil(kappa_e * L)), where L is the think
     length of the problem's clean max trace (`budget.think_budget`);
and the dataset keeps one problem per signature (family + what the agent sees), so no problem repeats.
A problem whose record at any effort fails is dropped whole, so every problem has all three efforts.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random

from openk3.agent import SandboxEnv
from openk3.agent.tasks import Task, generate
from openk3.chat import THINKING_EFFORTS
from openk3.posttrain.domains.budget import B_FLOOR, think_budget
from openk3.posttrain.domains.records import (
    SPLITS,
    byte_tokenizer,
    render_sha256,
    roundtrip_problems,
    think_tokens,
    validate_record,
)
from openk3.posttrain.domains.traces import EXPERTS

log = logging.getLogger(__name__)

DOMAINS = {"agent": ("tool_arith", "data_wrangle", "multi_hop"), "coding": ("fix_test", "implement_spec")}
GENERATOR_VERSION = "agentic-2"  # 2: high effort's first turn states the plan (2026-12-02)
RECOVERY_RATE = 0.15
MAX_TURNS = 16  # the longest scripted trace is 11 turns (a 7-record chain at max, recovering); more is a bug
MAX_TRIES = 20  # task seeds drawn per wanted problem before giving up (duplicates, rejected records)


def problem_signature(task: Task) -> str:
    """What makes two problems the same: the family and what the agent sees (instruction and files)."""
    return hashlib.sha256(f"{task.family}\0{task.content_hash()}".encode()).hexdigest()


def act(task: Task, effort: str, *, recovery: bool = False, tokenizer=None) -> dict:
    """Play the family's expert for `task` at `effort` in a fresh sandbox; returns the episode:
    {"messages", "tools", "reward", "calls", "tool_errors", "turns"} (messages in the record format)."""
    tokenizer = tokenizer or byte_tokenizer()
    rng = random.Random(f"{task.id}|{effort}|{int(recovery)}")  # the paraphrase draws
    expert = EXPERTS[task.family](task, effort, recovery, rng)
    with SandboxEnv(task, tokenizer, effort=effort, max_steps=MAX_TURNS) as env:
        obs = env.reset()
        step = next(expert)
        reward, calls, errors = 0.0, 0, 0
        for _ in range(MAX_TURNS):
            obs, reward, terminated, truncated, info = env.step(step)
            calls += len(info["calls"])
            errors += sum(not c["ok"] for c in info["calls"])
            if terminated or truncated:
                break
            try:
                step = expert.send([c["output"] for c in info["calls"]])
            except StopIteration:  # the script ended before the episode did: reward 0, the record is refused
                break
        expert.close()
        return {"messages": obs.messages, "tools": obs.tools, "reward": float(reward), "calls": calls,
                "tool_errors": errors, "turns": sum(m["role"] == "assistant" for m in obs.messages)}


def make_record(task: Task, domain: str, effort: str, episode: dict, reference_think: int, *, recovery: bool,
                tokenizer, b_floor: int = B_FLOOR) -> dict:
    """An episode in the shared record format (records.py), with its budget from the clean max trace."""
    record = {
        "id": f"{domain}/{task.id}/{effort}", "domain": domain, "effort": effort, "family": task.family,
        "difficulty": task.difficulty, "seed": task.seed, "split": task.split,
        "messages": episode["messages"], "tools": episode["tools"],
        "budget_think_tokens": think_budget(reference_think, effort, b_floor=b_floor),
        "stats": {}, "verifier": {"kind": "sandbox_grader", "task": task.id, "reward": episode["reward"]},
        "generator_version": GENERATOR_VERSION, "signature": problem_signature(task),
    }
    record["stats"] = {"think_tokens": think_tokens(record, tokenizer), "reference_think_tokens": reference_think,
                       "turns": episode["turns"], "calls": episode["calls"], "tool_errors": episode["tool_errors"],
                       "recovery": recovery, "template": task.template}
    record["render_sha256"] = render_sha256(record, tokenizer)
    return record


def replay(record: dict, tokenizer=None) -> tuple[float, list[str]]:
    """Replay a record's assistant turns in a fresh sandbox (its task regenerated from family, seed,
    difficulty, split); returns (reward, problems): a tool message that differs from the record's is one."""
    tokenizer = tokenizer or byte_tokenizer()
    task = generate(record["family"], record["seed"], record["difficulty"], record["split"])
    messages, problems, reward = record["messages"], [], 0.0
    with SandboxEnv(task, tokenizer, effort=record["effort"], max_steps=MAX_TURNS) as env:
        env.reset()
        done = False
        for k, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            if done:
                problems.append(f"messages[{k}]: an assistant turn after the episode ended")
                break
            obs, reward, terminated, truncated, info = env.step(msg)
            done = terminated or truncated
            got = [m["content"] for m in obs.messages[k + 1:]]  # this turn's tool messages
            want = []
            for m in messages[k + 1:]:
                if m["role"] != "tool":
                    break
                want.append(m["content"])
            if got != want:
                problems.append(f"messages[{k}]: replayed tool messages {got!r} differ from the record's {want!r}")
    return float(reward), problems


def verify_record(record: dict, tokenizer=None, *, replay_episode: bool = True) -> list[str]:
    """The multi-stage verification of one record; [] when it is accepted, else what failed."""
    tokenizer = tokenizer or byte_tokenizer()
    try:
        validate_record(record)
    except ValueError as e:
        return [str(e)]
    problems = []
    if record["verifier"].get("reward") != 1.0:
        problems.append(f"verifier reward {record['verifier'].get('reward')!r}, not 1.0")
    if replay_episode:
        reward, differ = replay(record, tokenizer)
        problems += differ
        if reward != 1.0:
            problems.append(f"replayed in a fresh sandbox, the verifier gives {reward}, not 1.0")
    problems += roundtrip_problems(record, tokenizer)
    used = think_tokens(record, tokenizer)
    if used > record["budget_think_tokens"]:
        problems.append(f"{used} think tokens, over the {record['effort']} budget {record['budget_think_tokens']}")
    return problems


def _recovery_slots(rate: float, offset: float):
    """Which episodes are recovery episodes: the k-th is one when floor(k * rate + offset) steps up, so the
    share is `rate` to within one episode at any length (a coin per episode leaves small sets without any)."""
    k = 0
    while True:
        yield math.floor((k + 1) * rate + offset) > math.floor(k * rate + offset)
        k += 1


def agentic_dataset(domain: str, n_per_cell: int, seed: int, split: str, *, tokenizer=None,
                    difficulties: tuple[int, ...] = (1, 2, 3), recovery_rate: float = RECOVERY_RATE,
                    replay_episodes: bool = True, b_floor: int = B_FLOOR) -> list[dict]:
    """`n_per_cell` problems per family of `domain`, each at every effort (so n_per_cell records per
    (family, effort) cell), verified; deterministic in (domain, n_per_cell, seed, split) and the options.

    Args:
        domain: "agent" (tool_arith, data_wrangle, multi_hop) or "coding" (fix_test, implement_spec).
        split: "train", "test" or "heldout" (the task families keep them disjoint).
        tokenizer: counts think tokens for the budgets and renders the round trip (default: byte-level).
        difficulties: cycled over a family's problems.
        recovery_rate: the share of recovery episodes.
        replay_episodes: replay every record in a fresh sandbox before accepting it (doubles the cost).
    """
    if domain not in DOMAINS:
        raise ValueError(f"agentic_dataset: domain must be one of {sorted(DOMAINS)}, got {domain!r}")
    if isinstance(n_per_cell, bool) or not isinstance(n_per_cell, int) or n_per_cell < 0:
        raise ValueError(f"agentic_dataset: n_per_cell must be an int >= 0, got {n_per_cell!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"agentic_dataset: seed must be an int >= 0, got {seed!r}")
    if split not in SPLITS:
        raise ValueError(f"agentic_dataset: split must be one of {list(SPLITS)}, got {split!r}")
    if not difficulties or any(d not in (1, 2, 3) for d in difficulties):
        raise ValueError(f"agentic_dataset: difficulties must be a non-empty subset of 1, 2, 3, got {difficulties!r}")
    if not 0.0 <= recovery_rate <= 1.0:
        raise ValueError(f"agentic_dataset: recovery_rate must be in [0, 1], got {recovery_rate!r}")
    tokenizer = tokenizer or byte_tokenizer()
    records, seen = [], set()
    for family in DOMAINS[domain]:
        rng = random.Random(f"agentic|{domain}|{family}|{split}|{seed}")
        slots = _recovery_slots(recovery_rate, rng.random())
        made = 0
        for _ in range(MAX_TRIES * n_per_cell):
            if made == n_per_cell:
                break
            task = generate(family, rng.randrange(2**31), difficulties[made % len(difficulties)], split)
            signature = problem_signature(task)
            if signature in seen:
                continue
            seen.add(signature)
            recovery = {effort: next(slots) for effort in THINKING_EFFORTS}
            problem = _problem_records(task, domain, recovery, tokenizer, replay_episodes, b_floor)
            if problem:
                records += problem
                made += 1
        if made < n_per_cell:
            raise RuntimeError(f"agentic_dataset: only {made} of {n_per_cell} {family} problems passed verification "
                               f"in {MAX_TRIES * n_per_cell} tries (seed {seed}, split {split}); see the log")
    return records


def _problem_records(task: Task, domain: str, recovery: dict, tokenizer, replay_episodes: bool,
                     b_floor: int) -> list[dict]:
    """The problem's records at every effort, or [] (logged) when any of them fails verification."""
    reference = act(task, "max", tokenizer=tokenizer)
    length = think_tokens({"messages": reference["messages"], "tools": reference["tools"], "effort": "max"},
                          tokenizer)
    out = []
    for effort in THINKING_EFFORTS:
        episode = reference if effort == "max" and not recovery[effort] else \
            act(task, effort, recovery=recovery[effort], tokenizer=tokenizer)
        record = make_record(task, domain, effort, episode, length, recovery=recovery[effort], tokenizer=tokenizer,
                             b_floor=b_floor)
        problems = verify_record(record, tokenizer, replay_episode=replay_episodes)
        if problems:
            log.warning("agentic: rejected %s: %s", record["id"], "; ".join(problems))
            return []
        out.append(record)
    return out
