"""The skeleton of an on-policy run folder, shared by `openk3 rl` (rl.py) and `openk3 distill` (mopd.py).

Both start from a release-format checkpoint, or resume the newest intact checkpoint of their `--out`
folder (refusing changed settings), train with the Muon + AdamW set, log one metrics line per step, keep
each step's rollout records, save atomic checkpoints with the tokenizer beside the weights, and must leave
the router's Quantile Balancing bias untouched. What differs (the step, the problems, the settings that may
change on resume) stays in each.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from openk3.fsutil import write_atomic

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


def check_micro_tokens(value, where: str) -> None:
    """`micro_tokens` of an RL / MOPD config: None (the whole batch at once) or an integer >= 2."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
        raise ValueError(f"{where} micro_tokens must be an integer >= 2 or None, got {value!r}")


def say(tag: str, msg: str) -> None:
    print(f"[{tag}] {msg}", file=sys.stderr, flush=True)


def tokenizer_of(folder: Path):
    """The checkpoint's own tokenizer and its files, or ValueError: prompts are rendered and answers parsed
    with the model's tokenizer."""
    from openk3.tokenizer import Tokenizer

    if not (folder / "tiktoken.model").is_file():
        raise ValueError(f"{folder}: the checkpoint has no tokenizer (tiktoken.model); on-policy training renders "
                         "prompts and parses answers with the model's own tokenizer")
    files = {name: str(folder / name) for name in ("tiktoken.model", "tokenizer_config.json")
             if (folder / name).is_file()}
    return Tokenizer.from_dir(str(folder)), files


def open_run(out: Path, cfg, *, config_file: str, start_field: str, missing: str, tag: str,
             check_resume: Callable[[Path, Any], Any]) -> RunStart:
    """Resume `out` (its newest intact checkpoint; `check_resume` refuses changed settings) or start from the
    checkpoint named by `cfg.<start_field>` (`missing`: the error's start when there is none); writes the
    settings file."""
    from openk3.checkpoint import load, runs, steps
    from openk3.checkpoint.load import resolve_checkpoint

    out.mkdir(parents=True, exist_ok=True)
    for name in runs.restore_resaves(out):
        say(tag, f"restored {name} (a re-save of it was interrupted between its two renames)")
    runs.clean_leftovers(out)
    runs.refuse_lost_checkpoints(out)  # a run whose checkpoints are gone is not started over silently
    resumed = steps.load_latest(out)
    if resumed is not None:
        cfg = check_resume(out, cfg)
        folder, state, model, problems = resumed
        for p in problems:
            say(tag, f"warning: skipped a damaged checkpoint: {p}")
        start = int(state["step"])
        tok, tok_files = tokenizer_of(folder)
        say(tag, f"resuming {out} at step {start} from {folder.name}")
    else:
        if not getattr(cfg, start_field):
            raise ValueError(f"{missing} (a checkpoint folder or a run folder)")
        folder = resolve_checkpoint(getattr(cfg, start_field)).resolve()
        cfg = dataclasses.replace(cfg, **{start_field: str(folder)})
        tok, tok_files = tokenizer_of(folder)
        model = load(folder, dtype=torch.float32)
        start, state = 0, None
    write_atomic(out / config_file, (json.dumps(cfg.to_dict(), indent=1) + "\n").encode())
    return RunStart(cfg, folder, model, tok, tok_files, start, state)


def optimizer_for(model: torch.nn.Module, lr: float, grad_clip: float, state: dict | None):
    """The Muon + AdamW set (no weight decay, no QK-Clip), its state and the RNG restored when resuming."""
    from openk3.train import state as train_state
    from openk3.train.optim import OptimConfig, build_optimizer

    opt = build_optimizer(model, OptimConfig(lr=lr, weight_decay=0.0, grad_clip=grad_clip, qk_clip_tau=None))
    if state is not None:
        opt.load_state_dict(state["optimizer"])
        train_state.set_rng_state(state["rng"])
    return opt


def save_step(out: Path, step: int, model, opt, cfg, tok_files: dict[str, str]) -> None:
    from openk3.checkpoint.steps import save_checkpoint
    from openk3.train.state import rng_state

    save_checkpoint(out, step, model, {"step": step, "optimizer": opt.state_dict(), "config": cfg.to_dict(),
                                       "rng": rng_state()}, extra_files=tok_files)


def write_rollouts(out: Path, step: int, records: list[dict]) -> None:
    """`out/rollouts/step_N.jsonl`: the step's rollout records, written atomically."""
    from openk3.checkpoint import runs

    write_atomic(out / "rollouts" / f"{runs.step_dir_name(step)}.jsonl",
                 "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode())


def router_biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith(BIAS_SUFFIX)}


def check_router_biases(model: torch.nn.Module, before: dict[str, torch.Tensor], what: str) -> None:
    for name, b in before.items():
        assert torch.equal(b, model.get_buffer(name)), f"{name} moved during {what} (it must stay frozen)"
