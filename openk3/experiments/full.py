"""The full profiles' material: a real post-training start (the pipeline's smoke SFT model of the `general`
domain), its problems, sampled scores for filtering prompts and greedy evaluation per problem.

    start = open_start(out, seed, say, "smoke")                  # the pipeline's smoke SFT, general only
    model, tok = start.model, start.tok                          # (start.folder, start.state, start.fresh())
    pool = problems(tok, "high", "train", 320, seed)            # rollout.Problem list, deterministic in seed
    samples = sample_scores(model, tok, pool, k=8, temperature=0.7, think_cap=320, response_cap=64, seed=seed)
    scores = greedy(model, tok, [("general", "high")], n=300, seed=seed, think_cap=320)   # per-problem cells
    arm_cache(out, "treatment", lambda: ...)                     # an arm's per-problem scores, kept in out/arms/

Where the smoke profiles (`tasks.py`) use a two-layer model on one-token tasks that run in seconds, these use
what `openk3 posttrain` uses: its BPE tokenizer, nano cut to 4 layers, XTML prompts with the effort's system
message, `general.score` as the verifier, whole think channels and responses, `openk3 eval`'s evaluation.
An experiment's folder keeps the start (a pipeline run folder: a killed run continues it) and each finished
arm's per-problem scores (`arms/NAME.json`), so a rerun of the same command continues where it stopped.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from openk3.fsutil import write_atomic

#: the start's pipeline: preset and domain (its profile is the experiment's `start_profile` setting: smoke; the
#: tests' toy sizes use tiny); general levels 1 only, what that SFT teaches
START = dict(preset="nano", domains=("general",))
LEVELS = (1,)
CONTEXT = 1024  # tokens per general trajectory, as the smoke pipeline's RL and eval


def sft_start(folder: Path, seed: int, say, profile: str = "smoke", data_fn: Callable | None = None) -> Path:
    """The pipeline's SFT model (`profile`: smoke) of the general domain for `seed` (run in `folder`, or
    continued there): the checkpoint folder. `data_fn(path)` may rewrite the SFT records (a jsonl) before SFT
    runs."""
    from openk3.checkpoint.load import resolve_checkpoint
    from openk3.posttrain.pipeline import Pipeline

    pipeline = Pipeline(folder, seed=seed, threads=torch.get_num_threads(), profile=profile, **START)
    if data_fn is not None and not pipeline.done("sft"):
        pipeline.run(stop_after="data")
        data = folder / "data" / "sft_train.jsonl"
        marker = folder / "data" / "rewritten"
        if not marker.exists():
            data_fn(data)
            write_atomic(marker, b"rewritten by the experiment before SFT\n")
    pipeline.run(stop_after="sft")
    say(f"start: {folder / 'sft'}")
    return resolve_checkpoint(folder / "sft")


def open_model(folder: str | Path):
    """(model in float32, eval mode; its tokenizer) of a checkpoint folder."""
    from openk3.checkpoint import load
    from openk3.tokenizer.files import checkpoint_tokenizer

    tok, _ = checkpoint_tokenizer(Path(folder), "the experiments render prompts with the model's own tokenizer")
    return load(folder, dtype=torch.float32).eval(), tok


@dataclass
class Start:
    """The common start of a full profile's arms: its checkpoint folder, the model (float32, eval mode), its
    tokenizer and a copy of its weights (every arm starts from them)."""

    folder: Path
    model: torch.nn.Module
    tok: object
    state: dict

    def fresh(self) -> torch.nn.Module:
        """Another model of the start's shape (an arm's, which loads `state` into it)."""
        return open_model(self.folder)[0]


def open_start(out: Path, seed: int, say, profile: str, data_fn: Callable | None = None) -> Start:
    """`sft_start` in out/start (`profile`, `data_fn` as there), opened, with its weights copied; the experiment's
    RNG seeded first."""
    torch.manual_seed(seed)
    folder = sft_start(out / "start", seed, say, profile, data_fn=data_fn)
    model, tok = open_model(folder)
    return Start(folder, model, tok, copy.deepcopy(model.state_dict()))


def problems(tok, effort: str, split: str, n: int, seed: int, chunk: int = 64) -> list:
    """`n` general problems of `effort` from `split` (levels `LEVELS`), the same for every model: drawn as
    `openk3 rl` / `openk3 eval` draw them (`ProblemSource`), `chunk` per draw, ids unique."""
    from openk3.posttrain.trainers.problems import ProblemSource

    source = ProblemSource("general", effort, tok, split=split, seed=seed, levels=LEVELS)
    out, seen = [], set()
    step = 0
    while len(out) < n:
        for p in source.draw(step, chunk, total_steps=1):
            if p.id not in seen and len(out) < n:
                seen.add(p.id)
                out.append(p)
        step += 1
    return out


def engine_for(model, slots: int = 64):
    from openk3.infer.engine import Engine

    return Engine(model, None, max_num_seqs=slots, max_model_len=CONTEXT, prefix_cache=2 * slots + 8)


def sample_scores(model, tok, pool: Sequence, *, k: int, temperature: float, think_cap: int, response_cap: int,
                  seed: int) -> dict[str, list[float]]:
    """{problem id: the task scores of k samples at `temperature`} (think capped at `think_cap`; a turn over
    it or malformed scores 0)."""
    import dataclasses

    from openk3.posttrain.trainers.rollout import RolloutConfig, rollout

    engine = engine_for(model)
    out: dict[str, list[float]] = {p.id: [] for p in pool}
    per_round = max(1, 64 // k)
    for r, start in enumerate(range(0, len(pool), per_round)):
        part = [dataclasses.replace(p, budget=think_cap) for p in pool[start:start + per_round]]
        cfg = RolloutConfig(group_size=k, temperature=temperature, response_cap=response_cap, logprobs=False,
                            seed=seed * 100_003 + 7_919 + r, over_budget_reward=0.0)
        for rec in rollout(engine, part, tok, cfg):
            out[rec["problem_id"]].append(float(rec["reward_components"]["task"]))
    return out


def greedy(model, tok, cells: Sequence[tuple[str, str]], *, n: int, seed: int, think_cap: int,
           response_cap: int) -> dict:
    """{"domain/effort": cell metrics} of greedy turns on `n` test problems per cell (`openk3 eval`'s
    `evaluate_engine`: per-problem think tokens and task scores in each cell's samples)."""
    from openk3.posttrain.evaluation.evaluate import evaluate_engine

    m = evaluate_engine(engine_for(model), tok, list(cells), n, "test", seed, 0.0, think_cap=think_cap,
                        response_cap=response_cap, levels=LEVELS, batch_problems=64)
    return {f"{d}/{e}": m[d][e] for d, e in cells}


def scores(cell: dict, key: str) -> dict[str, float]:
    """{problem id: score} of a greedy cell ("accuracy" or "thinking_tokens")."""
    from openk3.posttrain.evaluation.evaluate import per_problem_scores

    out = per_problem_scores(cell, key)
    assert out is not None, "greedy cells keep per-problem samples"
    return out


def arm_cache(out: Path, name: str, compute: Callable[[], dict]) -> dict:
    """`compute()` (a JSON-able dict: an arm's per-problem scores), or what an earlier run of the same
    experiment folder saved for `name` (so a killed experiment continues with its first unfinished arm)."""
    path = out / "arms" / f"{name.replace(' ', '_').replace('/', '-').replace(':', '')}.json"
    if path.is_file():
        return json.loads(path.read_text())
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(value).encode())
    return value
