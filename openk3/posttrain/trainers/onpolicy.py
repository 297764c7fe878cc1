"""The on-policy run, shared by `openk3 rl` (rl.py) and `openk3 distill` (mopd.py): a job of the run loop.

    run = open_run(out, cfg, config_file="rl_config.json", start_field="model", resumable=RESUMABLE_CHANGES,
                   missing="no starting model: give --model", report=report)
    opt = optimizer_for(run.model, cfg.lr, cfg.grad_clip, run.state)
    job = OnPolicyJob("rl", out, run, opt, draw=..., step_fn=..., release=..., line=...)
    drive(job, cfg.steps, cfg.save_every, report, on_step)

Both start from a release-format checkpoint, or resume the newest intact checkpoint of their `--out` folder
(refusing changed settings), train with the Muon + AdamW set, log one metrics line per step, keep each step's
rollout records (`<out>/rollouts/step_N.jsonl`), save atomic checkpoints with the tokenizer beside the weights
(`openk3.checkpoint.steps`), and must leave the router's Quantile Balancing bias untouched. The step loop,
the metrics log, the progress bar and the checkpoint cadence are `openk3.train.loop`'s; what differs (the
step, the problems, the settings that may change on resume) stays in rl.py and mopd.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from openk3.fsutil import read_json, write_atomic
from openk3.posttrain.trainers.rollout import RESPONSE_CAP
from openk3.train.loop import Job

BIAS_SUFFIX = "e_score_correction_bias"


@dataclasses.dataclass
class RunStart:
    cfg: Any  # the run's settings, the starting checkpoint resolved (or as saved, when resuming)
    folder: Path  # the checkpoint the weights came from
    model: torch.nn.Module  # float32
    tok: Any
    tok_files: dict[str, str]  # tokenizer files to write beside every checkpoint
    start: int  # optimizer steps already done
    state: dict | None  # the trainer state to restore (None for a new run)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OnPolicyConfig:
    """The section RL's and MOPD's configs share (they inherit it; their files stay flat): how long and how wide a
    step is, the sampling limits, which problems, and the loop's seed, optimizer, checkpoints, engine and memory.
    Also their JSON form, read back strictly."""

    KIND: ClassVar[str] = "run"  # the name in messages ("rl", "mopd")
    TUPLES: ClassVar[tuple[str, ...]] = ()  # fields JSON gives back as lists
    MIN_GROUP: ClassVar[int] = 1  # the least `group_size`

    steps: int = 100
    prompts_per_step: int = 8
    group_size: int = 8
    lr: float = 1e-5
    # sampling
    response_cap: int = RESPONSE_CAP
    max_turns: int = 8
    split: str = "train"
    levels: tuple[int, ...] | None = None  # general: the difficulty levels drawn (None: all; the pipeline: SFT's)
    # loop
    seed: int = 0
    grad_clip: float | None = 1.0
    # Steps scale with the gradient norm against its running mean, never against less than this (`signal_step`).
    # None: every step full size (Muon's fixed-norm update, a fresh AdamW's ~lr * sign(g)).
    update_ref: float | None = 1.0
    save_every: int = 10
    max_num_seqs: int = 64
    max_model_len: int | None = None
    micro_tokens: int | None = None  # forward/backward (and teacher scoring) in row chunks of this many tokens

    def __post_init__(self) -> None:
        self.check()

    def bad(self, field: str, rule: str) -> ValueError:
        return ValueError(f"{self.KIND} {field} must be {rule}, got {getattr(self, field)!r}")

    def check(self) -> None:
        """ValueError naming the first setting out of range (subclasses add theirs after these)."""
        from openk3.posttrain.domains.general import check_levels
        from openk3.posttrain.domains.records import SPLITS

        if self.split not in SPLITS:
            raise self.bad("split", f"one of {list(SPLITS)}")
        object.__setattr__(self, "levels", check_levels(self.levels, f"{self.KIND} levels"))
        for field, least in (("steps", 1), ("prompts_per_step", 1), ("group_size", self.MIN_GROUP),
                             ("response_cap", 1), ("max_turns", 1), ("save_every", 1), ("max_num_seqs", 1)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise self.bad(field, f"an integer >= {least}")
        if not self.lr > 0:
            raise self.bad("lr", "> 0")
        if self.update_ref is not None and not (isinstance(self.update_ref, (int, float))
                                                and not isinstance(self.update_ref, bool) and self.update_ref > 0):
            raise self.bad("update_ref", "> 0 or None")
        m = self.micro_tokens  # None: the whole batch at once
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 2):
            raise ValueError(f"{self.KIND} micro_tokens must be an integer >= 2 or None, got {m!r}")

    def engine(self, model: torch.nn.Module):
        """The inference engine a step samples through, on `model` itself (so every step samples from the weights
        the last optimizer step wrote): one slot per trajectory of a step (at most `max_num_seqs`), and a prefix
        cache of 2 x slots + 8 snapshots (shared prompt heads and finished turns, `infer/prefix.py`), as the
        evaluation's engine keeps."""
        from openk3.infer.engine import Engine

        slots = min(self.max_num_seqs, self.prompts_per_step * self.group_size)
        return Engine(model, None, max_num_seqs=slots, max_model_len=self.max_model_len, prefix_cache=2 * slots + 8)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, source: str | None = None):
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"{source or cls.KIND + ' config'}: unknown {cls.KIND} settings {unknown}")
        return cls(**{k: tuple(v) if k in cls.TUPLES and v is not None else v for k, v in d.items()})


def check_resume(out: Path, cfg, *, config_file: str, start_field: str, resumable: Sequence[str],
                 extra_changes: Callable[[Any, Any], list[str]] | None = None):
    """`cfg` for resuming the run in `out`, its starting checkpoint as saved; or a ValueError naming the settings
    that changed (any but `resumable`: the finished steps were computed with the saved ones, plus what
    `extra_changes(saved, cfg)` reports)."""
    path = out / config_file
    saved = type(cfg).from_dict(read_json(path), str(path))
    changed = [f"{k}: {getattr(saved, k)!r} -> {v!r}" for k, v in dataclasses.asdict(cfg).items()
               if getattr(saved, k) != v and k not in resumable]
    if extra_changes is not None:
        changed += extra_changes(saved, cfg)
    if changed:
        raise ValueError(f"{out}: resuming a run with changed settings ({'; '.join(changed)}); use a new --out "
                         f"or the saved settings ({path})")
    return dataclasses.replace(cfg, **{start_field: getattr(saved, start_field)})


def open_run(out: Path, cfg, *, config_file: str, start_field: str, missing: str, resumable: Sequence[str],
             report: logging.Logger, extra_changes: Callable[[Any, Any], list[str]] | None = None) -> RunStart:
    """Resume `out` (its newest intact checkpoint; changed settings refused, `check_resume`) or start from the
    checkpoint named by `cfg.<start_field>` (`missing`: the error's start when there is none); cuts
    metrics.jsonl back to the checkpoint and writes the settings file."""
    from openk3.checkpoint import load
    from openk3.checkpoint.load import resolve_checkpoint
    from openk3.tokenizer.files import checkpoint_tokenizer
    from openk3.train.metrics import truncate_after
    from openk3.train.state import open_run_folder

    why = "on-policy training renders prompts and parses answers with the model's own tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    folder, state, model = open_run_folder(out, True, report.info, report.warning)
    if folder is not None:
        cfg = check_resume(out, cfg, config_file=config_file, start_field=start_field, resumable=resumable,
                           extra_changes=extra_changes)
        start = int(state["step"])
        tok, tok_files = checkpoint_tokenizer(folder, why)
        report.info(f"resuming {out} at step {start} from {folder.name}")
    else:
        if not getattr(cfg, start_field):
            raise ValueError(f"{missing} (a checkpoint folder or a run folder)")
        folder = resolve_checkpoint(getattr(cfg, start_field)).resolve()
        cfg = dataclasses.replace(cfg, **{start_field: str(folder)})
        tok, tok_files = checkpoint_tokenizer(folder, why)
        model = load(folder, dtype=torch.float32)
        start, state = 0, None
    truncate_after(str(out / "metrics.jsonl"), start)
    write_atomic(out / config_file, (json.dumps(cfg.to_dict(), indent=1) + "\n").encode())
    return RunStart(cfg, folder, model, tok, tok_files, start, state)


def optimizer_for(model: torch.nn.Module, lr: float, grad_clip: float, state: dict | None):
    """The Muon + AdamW set (no weight decay, no QK-Clip), its state and the RNG restored when resuming."""
    from openk3.train.optim import OptimConfig, build_optimizer
    from openk3.train.state import set_rng_state

    opt = build_optimizer(model, OptimConfig(lr=lr, weight_decay=0.0, grad_clip=grad_clip, qk_clip_tau=None))
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
    return opt


#: weight of the past in the running mean of gradient norms that `signal_step` compares each step's with (~10 steps)
GRAD_NORM_EMA = 0.9


def signal_step(opt, update_ref: float | None) -> tuple[float, float]:
    """Clip the gradients, then one optimizer step whose size follows the learning signal: the learning rate
    times min(1, |g| / r), |g| the global gradient norm before clipping and r = max(update_ref, the running
    mean of the norms of the steps taken before, `opt.grad_norm_mean`, EMA weight `GRAD_NORM_EMA`). Returns
    (|g|, that scale). `update_ref` None: every step full size.

    Why: Muon orthogonalises its momentum, so its update has the same norm whatever the gradient's, and a
    fresh AdamW's first update is about lr * sign(g); both turn a weak or noisy signal (a few groups whose
    rewards vary, teacher gaps of sampler/trainer rounding) into a full step. Against the running mean, a
    gradient k times smaller than the run's recent ones moves the weights about k times less; `update_ref`
    is the floor of that reference, the norm below which a gradient counts as weak even on the first step
    and in a run whose signal is weak throughout (a matched MOPD teacher's ~1e-6 gaps give ~1e-6 of a step).
    Measured: docs/experiments.md, "Update size"."""
    grad_norm = float(opt.clip_grad_norm_())
    scale = 1.0
    if update_ref is not None:
        past = opt.grad_norm_mean
        scale = min(1.0, grad_norm / max(update_ref, past or 0.0))
        opt.grad_norm_mean = grad_norm if past is None else GRAD_NORM_EMA * past + (1 - GRAD_NORM_EMA) * grad_norm
    opt.set_lr_multiplier(scale)
    opt.step()
    return grad_norm, scale


def router_biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith(BIAS_SUFFIX)}


def check_router_biases(model: torch.nn.Module, before: dict[str, torch.Tensor], what: str) -> None:
    for name, b in before.items():
        assert torch.equal(b, model.get_buffer(name)), f"{name} moved during {what} (it must stay frozen)"


class OnPolicyJob(Job):
    """An on-policy run as a job of the run loop: each step draws its problems (`draw(step)`, 0-based), runs
    `step_fn(problems, step) -> (rollout records, metrics)` (sample, score, one optimizer step), releases the
    problems' sandboxes whatever happens, and keeps the records in `<out>/rollouts/step_N.jsonl`; a checkpoint
    holds the weights, the optimizer, the step, the settings and the RNG."""

    def __init__(self, tag: str, out: Path, run: RunStart, opt, *, draw: Callable[[int], list],
                 step_fn: Callable[[list, int], tuple[list[dict], dict]], release: Callable[[list], None],
                 line: Callable[[dict], str]) -> None:
        self.tag, self.out, self.run, self.opt = tag, out, run, opt
        self.draw, self.step_fn, self.release, self.line = draw, step_fn, release, line
        self.done = run.start
        self.last: dict = {}  # the last step's metrics
        (out / "rollouts").mkdir(exist_ok=True)

    @property
    def step(self) -> int:
        return self.done

    def next_step(self) -> dict:
        from openk3.checkpoint.runs import step_dir_name

        problems = self.draw(self.done)
        try:
            records, self.last = self.step_fn(problems, self.done)
        finally:
            self.release(problems)
        self.done += 1
        write_atomic(self.out / "rollouts" / f"{step_dir_name(self.done)}.jsonl",
                     "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode())
        return self.last

    def step_line(self, rec: dict, max_steps: int) -> str:
        return f"step {rec['step']}/{max_steps}: {self.line(rec)}"

    def save(self) -> Path:
        from openk3.checkpoint.steps import save_checkpoint
        from openk3.train.state import rng_state

        state = {"step": self.done, "optimizer": self.opt.state_dict(), "config": self.run.cfg.to_dict(),
                 "rng": rng_state()}
        return save_checkpoint(self.out, self.done, self.run.model, state, extra_files=self.run.tok_files)


def drive(job: OnPolicyJob, steps: int, save_every: int, report: logging.Logger,
          on_step: Callable[[int, dict], None] | None, *, what: str, progress: bool = True) -> dict:
    """Run `job` to `steps` in the run loop (a console line and a metrics line per step, a checkpoint every
    `save_every` steps and at the end); `on_step(step, metrics)` after each step's metrics are logged, before
    its checkpoint. The router's selection bias must not have moved (`what`: the run's name in that error).
    Returns the last step's metrics."""
    from openk3.train.loop import Cadence, run_loop
    from openk3.train.metrics import MetricsLog

    def on_event(kind: str, info: dict) -> None:
        if kind == "step" and on_step is not None:
            on_step(info["step"], info)

    bias_before = router_biases(job.run.model)
    run_loop(job, Cadence(steps, save_every=save_every), MetricsLog(str(job.out / "metrics.jsonl")), report=report,
             progress=progress, on_event=on_event, last_saved=job.run.start if job.run.start else None)
    check_router_biases(job.run.model, bias_before, what)
    return job.last
