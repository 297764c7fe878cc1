"""The trainer's side of a run folder: RNG states, opening a run folder to resume it, recording the config.

The checkpoints themselves are `openk3.checkpoint`'s: their folder layout, finding and cleaning (`runs`),
atomic saves and reading back the newest intact one (`steps`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from openk3.checkpoint.runs import clean_leftovers, find_latest, refuse_lost_checkpoints, restore_resaves
from openk3.checkpoint.steps import load_latest, load_weights_into


def rng_state() -> dict:
    """Python, numpy, torch CPU (and CUDA when present) RNG states, as tensors/plain containers."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_tuplify(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


def open_run_folder(out: Path, resume: bool, say: Callable[[str], None], warn: Callable[[str], None], *,
                    weights_dcp_ok: bool = False):
    """(checkpoint folder, trainer state, weights) of the newest intact checkpoint in `out` to resume, or
    Nones. Torn saves are removed first (a step a killed re-save set aside is restored); a folder whose
    checkpoints are gone is refused (`refuse_lost_checkpoints`); resume=False refuses a folder that has
    checkpoints."""
    for name in restore_resaves(out):
        say(f"restored {name} (a re-save of it was interrupted between moving the old copy aside and moving "
            "the new one in)")
    for name in clean_leftovers(out):
        say(f"removed {name} (left by an interrupted checkpoint)")
    refuse_lost_checkpoints(out)
    if not resume and (latest := find_latest(out)) is not None:
        raise ValueError(f"{out} already has checkpoints (latest {latest.name}); resume, or choose a new --out")
    if not resume or (found := load_latest(out, weights_dcp_ok=weights_dcp_ok)) is None:
        return None, None, None
    ckpt, saved, saved_weights, problems = found
    for problem in problems:
        warn(f"skipping a damaged checkpoint: {problem}")
    if problems:
        warn(f"resuming from the newest intact checkpoint, {ckpt.name}")
    return ckpt, saved, saved_weights


def restart_changes(out: Path, cfg, name: str, free_keys=None) -> list[str]:
    """For a run folder with no checkpoint: the free changes (`openk3.train.config.resume_changes`) from an
    earlier run's `<name>.json` there (one stopped before its first checkpoint), which then starts over from
    step 0; [] when there is none. Settings that change the run's maths are a ValueError listing them, with
    nothing written: the folder's config is not replaced by a different run's."""
    from openk3.fsutil import read_json
    from openk3.train.config import resume_changes

    path = out / f"{name}.json"
    if not path.is_file():
        return []
    free, refused = resume_changes(read_json(path), cfg.to_dict(), free_keys)
    if refused:
        raise ValueError(f"{out}: holds a run that stopped before its first checkpoint, with other settings "
                         f"({path.name} -> now):\n  " + "\n  ".join(refused) + f"\nto start that run over, give its "
                         f"settings (they are in {path}); to start a new run, choose a new --out (or remove "
                         f"{path.name} and metrics.jsonl from {out})")
    return free


def resume_trainer(trainer, ckpt: Path | None, saved: dict | None, saved_weights, metrics_path: Path,
                   say: Callable[[str], None], *, write: bool = True) -> int | None:
    """Load the checkpoint into the trainer's model and state and drop metrics logged after it (returns the
    step resumed from); a fresh run (no checkpoint) starts a new metrics file. write=False (ranks other than
    0): load only, leave the metrics file alone."""
    if ckpt is None:
        if write and metrics_path.exists():
            metrics_path.unlink()  # no stale records from an earlier attempt without a checkpoint
            say(f"no checkpoint in {metrics_path.parent}: the earlier attempt stopped before its first one; "
                f"starting over from step 0 (its {metrics_path.name} restarts)")
        return None
    if saved_weights is None and saved.get("weights_dcp"):  # a multi-process save read by several processes
        from openk3.parallel.checkpoint import load_model

        load_model(trainer.model, ckpt / saved["weights_dcp"])
    else:
        load_weights_into(trainer.model, ckpt, saved_weights)
    trainer.load_state_dict(saved, ckpt)
    from openk3.train.metrics import truncate_after

    dropped = truncate_after(str(metrics_path), trainer.step) if write else 0
    say(f"resuming from step {trainer.step} ({ckpt})" + (f"; dropped {dropped} metrics record(s) logged after it"
                                                          if dropped else ""))
    return trainer.step


def record_config(out: Path, cfg, *, step: int | None, changes: list[str], name: str = "train_config") -> None:
    """Write the config in force to `out/<name>.json` (`openk3 sft` uses name="sft_config"). When a resume
    changed it, the config it replaces is appended first to `out/<name>_history.jsonl` (one JSON line: the
    step the change takes effect after, the changes, the previous config), so no earlier config is ever lost."""
    path = out / f"{name}.json"
    if changes and path.is_file():
        from openk3.fsutil import read_json

        entry = {"step": step, "time": time.time(), "changes": changes, "previous": read_json(path)}
        with open(out / f"{name}_history.jsonl", "a") as fh:
            fh.write(json.dumps(entry) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    cfg.to_json(path)


def settings_changes(out: Path, ckpt: Path, saved_config: dict, cfg, *, allow: bool, say: Callable[[str], None],
                     free_keys=None, name: str = "train_config") -> list[str]:
    """The differences between the checkpoint's config and `cfg` (`openk3.train.config.resume_changes`), said
    aloud; a ValueError listing those that change the run's maths unless `allow` (they are then recorded, with
    the old config, in `<name>_history.jsonl` by `record_config`)."""
    from openk3.train.config import resume_changes

    free, refused = resume_changes(saved_config, cfg.to_dict(), free_keys)
    if refused and not allow:
        raise ValueError(f"{out}: the config differs from checkpoint {ckpt.name}'s in settings that change the run's "
                         f"maths (checkpoint -> now):\n  " + "\n  ".join(refused) + "\nto resume the run as it was, "
                         "drop those options (or give the checkpoint's values); to continue with the new ones, pass "
                         f"--allow-config-change (allow_config_change=True); the old config is then kept in "
                         f"{name}_history.jsonl")
    changes = refused + free
    if changes:
        say(f"config changed since {ckpt.name}: " + "; ".join(changes))
    return changes


def recover_final_eval(history: list[dict], step: int, keys: tuple[str, ...], metrics_path: Path | None = None
                       ) -> int | None:
    """The last step the run evaluated, from its history; when that is not `step` and `metrics_path` is given,
    the eval of `step` logged in metrics.jsonl (a run an older version finished saved before its final eval:
    that eval is in the metrics, not in the checkpoint's history) is appended to `history` (only `keys`), so the
    resumed run does not evaluate, and log, it again."""
    from openk3.train.metrics import logged_eval

    last = max((h["step"] for h in history if h["kind"] == "eval"), default=None)
    if last != step and metrics_path is not None and (rec := logged_eval(str(metrics_path), step)) is not None:
        history.append({k: rec[k] for k in ("kind", "step", *keys)})
        last = step
    return last


@dataclasses.dataclass
class Resumed:
    """Where a trainer's run stands as the loop starts: the step it resumed from (None: a new run), its metrics
    log (open for appending), and the last steps it saved and evaluated (so the loop's end does neither twice)."""

    step: int | None
    log: Any
    last_saved: int | None
    last_eval: int | None


def resume_run(trainer, ckpt: Path | None, saved: dict | None, saved_weights, metrics_path: Path,
               say: Callable[[str], None], *, write: bool = True, eval_keys: tuple[str, ...] = (),
               recover_eval: bool = True) -> Resumed:
    """`resume_trainer`, then the metrics log (a "resume" record when resuming; write=False: ranks that do not
    write get a log that drops records) and `recover_final_eval` (`eval_keys`: what an eval record keeps in the
    history; recover_eval=False: only the history's own evaluations count)."""
    from openk3.train.loop import NO_LOG
    from openk3.train.metrics import MetricsLog

    resumed_from = resume_trainer(trainer, ckpt, saved, saved_weights, metrics_path, say, write=write)
    log = MetricsLog(str(metrics_path)) if write else NO_LOG
    if resumed_from is not None:
        log.log({"kind": "resume", "step": resumed_from, "time": time.time()})
    last_eval = recover_final_eval(trainer.history, trainer.step, eval_keys,
                                   metrics_path if resumed_from is not None and recover_eval else None)
    return Resumed(resumed_from, log, trainer.step if ckpt is not None else None, last_eval)
