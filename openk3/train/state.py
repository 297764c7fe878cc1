"""Checkpoints of a training run: release-format weights + everything else needed to resume exactly.

    <out>/checkpoints/step_000300/   config.json, generation_config.json, model.safetensors (fp32: lossless),
                                     tokenizer files (when given), trainer_state.pt
    <out>/checkpoints/latest         "step_000300\\n", replaced atomically after the folder is complete

`trainer_state.pt` (torch.save, loadable with weights_only=True): step, tokens, elapsed, the optimizer
set's and schedule's state dicts, the data loader's state, RNG states (python, torch CPU and CUDA,
numpy), the metrics history and the run's config dict.

Atomicity: a checkpoint is written into a hidden temp folder (`.tmp-step_000300-<pid>`, itself built
by `openk3.save` in a sibling `..tmp-step_000300-<pid>.tmp-<hex>` and renamed), fsynced and renamed to
its final name, then `latest` is replaced. A kill at any point leaves either the previous `latest` or
the new one pointing at a complete folder; `clean_leftovers` removes what a torn save left. Re-saving a
step that exists (a run resumed from an older checkpoint) moves the old folder aside (`.old-step_N-<pid>`)
before the new one takes its name: a kill between the two renames leaves the aside copy as the only
complete one of that step, and `restore_resaves` (run first by `clean_leftovers`) renames it back.
`find_latest` trusts `latest` only if its folder is complete (its files exist), else falls back to the
newest complete `step_*` folder. `load_latest` goes further for a resume: it reads the state and the
weights, and when a checkpoint's files are there but unreadable (truncated, corrupt) it falls back to
the next newest one, reporting what was wrong.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from openk3.fsutil import fsync_dir, naming, write_atomic

STATE_FILE = "trainer_state.pt"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_ASIDE_DIR = re.compile(r"^\.old-(step_\d+)-\d+$")  # a step folder moved aside by a re-save (`save_checkpoint`)
# What an interrupted save leaves in checkpoints/: our `.tmp-step_*-<pid>` / `.old-step_*-<pid>` folders,
# `openk3.save`'s own temp sibling of the former (`..tmp-step_*-<pid>.tmp-<hex>`, `files.temp_sibling`),
# `trainer_state.pt.tmp` of `write_trainer_state` and `latest.tmp.<pid>.<hex>` of `fsutil.write_atomic`.
# torn saves: ".tmp-step_*" / ".old-step_*" folders, write_atomic's temps, and the DCP optimizer staging
# folders (".dcp-step_*", `openk3.parallel.checkpoint`) of a multi-process save that never committed
_LEFTOVER = re.compile(r"^\.+(tmp|old|dcp)-|^\..*\.(tmp|old)-[0-9a-f]+$|\.tmp(\.\d+\.[0-9a-f]+)?$")


def checkpoint_root(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


# ---- RNG --------------------------------------------------------------------------------------------

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


# ---- save -------------------------------------------------------------------------------------------

def write_trainer_state(path: Path, state: dict) -> None:
    """torch.save into `path` via a temp file + fsync + rename (a separate function so tests can
    simulate a kill in the middle of a checkpoint)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        try:
            torch.save(state, fh)
        except RuntimeError as e:
            # a write that fails inside torch.save (a full disk: OSError ENOSPC) surfaces as the RuntimeError
            # its zip writer raises while closing ("unexpected pos ..."); the OSError is the cause to report
            if isinstance(e.__context__, OSError):
                raise e.__context__ from None
            raise
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save_checkpoint(out_dir: str | os.PathLike, step: int, model, state: dict, *,
                    extra_files: dict[str, str] | None = None, keep: int | None = None,
                    extra_dirs: dict[str, Path] | None = None) -> Path:
    """Write checkpoint `step` (weights via `openk3.save` in fp32, `trainer_state.pt`, `extra_files`
    {name: source path} copied in, `extra_dirs` {name: folder} moved in: a multi-process run's DCP optimizer
    shards), atomically; update `latest`; prune to the newest `keep`."""
    from openk3.checkpoint import save

    root = checkpoint_root(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        save(model, tmp, dtype=torch.float32, extra_files=extra_files)
        write_trainer_state(tmp / STATE_FILE, state)
        for name, src in (extra_dirs or {}).items():  # same file system: a rename, inside the atomic write
            os.replace(src, tmp / name)
        fsync_dir(tmp)
        if final.exists():  # re-saving a step (e.g. the end of a run resumed at its last step)
            old = root / f".old-{step_dir_name(step)}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = find_latest(out_dir)
        raise naming(e, final, "writing a checkpoint; its partial copy was removed, " + (
            f"{kept.name} stays the checkpoint to resume from" if kept else "no checkpoint was kept"), temp=tmp) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        write_atomic(root / LATEST, (final.name + "\n").encode())
        fsync_dir(root)
    except OSError as e:
        raise naming(e, root / LATEST, f"pointing latest at the new checkpoint; {final.name} is complete") from e
    if keep is not None:
        for _, path in list_checkpoints(out_dir)[:-keep]:
            if path != final:
                shutil.rmtree(path, ignore_errors=True)
    return final


# ---- find and load ----------------------------------------------------------------------------------

def is_complete(path: Path) -> bool:
    return path.is_dir() and (path / STATE_FILE).is_file() and (path / "config.json").is_file()


def list_checkpoints(out_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete `step_*` checkpoints, oldest first."""
    root = checkpoint_root(out_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def find_latest(out_dir: str | os.PathLike) -> Path | None:
    """The checkpoint to resume from: `latest` if it names a complete folder, else the newest complete
    `step_*` folder, else None."""
    root = checkpoint_root(out_dir)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if _STEP_DIR.match(name) and is_complete(root / name):
            return root / name
    found = list_checkpoints(out_dir)
    return found[-1][1] if found else None


def _set_aside_step(path: Path) -> Path | None:
    """The step folder `path` is the only complete copy of: `path` is a complete `.old-step_N-<pid>` folder (a
    re-save moved it aside) and `step_N` is not complete. None otherwise."""
    m = _ASIDE_DIR.match(path.name)
    if m is None or not is_complete(path) or is_complete(final := path.parent / m.group(1)):
        return None
    return final


def has_checkpoint(out_dir: str | os.PathLike) -> bool:
    """Whether the run folder holds a checkpoint to resume: a complete `step_*` folder, or one a killed re-save
    set aside (which the run's start restores)."""
    root = checkpoint_root(out_dir)
    return find_latest(out_dir) is not None or (root.is_dir() and any(_set_aside_step(p) for p in root.iterdir()))


def restore_resaves(out_dir: str | os.PathLike) -> list[str]:
    """Rename back each step folder a killed re-save left aside (`.old-step_N-<pid>`) where it is the only
    complete copy of that step and `step_N` is missing. Returns the steps restored."""
    root = checkpoint_root(out_dir)
    restored = []
    for aside in sorted(root.iterdir()) if root.is_dir() else []:
        final = _set_aside_step(aside)
        if final is not None and not final.exists():
            os.replace(aside, final)
            restored.append(final.name)
    if restored:
        fsync_dir(root)
    return restored


def clean_leftovers(out_dir: str | os.PathLike) -> list[str]:
    """Remove temp folders/files a killed save left in the checkpoint folder; returns their names. A folder
    a re-save set aside is restored first (`restore_resaves`), and never removed while it is the only complete
    copy of its step."""
    root = checkpoint_root(out_dir)
    removed = []
    if not root.is_dir():
        return removed
    restore_resaves(out_dir)
    for p in sorted(root.iterdir()):
        if _LEFTOVER.search(p.name) and _set_aside_step(p) is None:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def load_trainer_state(path: str | os.PathLike) -> dict:
    return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)


def read_weights(path: str | os.PathLike):
    """The fp32 model held by checkpoint `path` (`openk3.load`: every tensor read and checked)."""
    from openk3.checkpoint import load

    return load(path, dtype=torch.float32)


def load_latest(out_dir: str | os.PathLike, *, weights_dcp_ok: bool = False
                ) -> tuple[Path, dict, object, list[str]] | None:
    """(checkpoint, trainer state, fp32 model, problems) of the newest checkpoint that reads back whole,
    or None when there is no complete checkpoint.

    Order: the folder `latest` names, then the other complete `step_*` folders, newest first. A
    checkpoint whose files exist but do not load (a truncated `trainer_state.pt` or safetensors file,
    bytes flipped on disk) is skipped; `problems` has one "<folder>: <error>" line per skipped one, for
    the caller to warn with. The weights are read here, not after the model is built, so a corrupt
    file is found before anything else is set up (and the read is not done twice: the caller copies
    from the returned model). Raises ValueError listing every problem if no checkpoint loads.
    `weights_dcp_ok` (a multi-process resume): a checkpoint with DCP weight shards (`weights_dcp`) is not read
    here; its model is None and the caller loads the shards into the laid-out model (`resume_trainer`).
    """
    found = [p for _, p in reversed(list_checkpoints(out_dir))]
    latest = find_latest(out_dir)
    if latest is None:
        return None
    candidates = [latest] + [p for p in found if p != latest]
    problems = []
    for path in candidates:
        # Anything a damaged file can raise: torch.load gives EOFError/RuntimeError/UnpicklingError,
        # safetensors its own SafetensorError, openk3.load ValueError. Interrupts are not Exceptions.
        try:
            state = load_trainer_state(path)
        except Exception as e:  # reported by name below, and fatal if no checkpoint loads
            problems.append(f"{path / STATE_FILE}: {type(e).__name__}: {e}")
            continue
        dcp_dir = state.get("optimizer", {}).get("dcp") if isinstance(state.get("optimizer"), dict) else None
        if dcp_dir is not None and not (path / dcp_dir / ".metadata").is_file():
            problems.append(f"{path / dcp_dir}: the optimizer's DCP shards are missing")
            continue
        shards = state.get("weights_dcp")
        if shards is not None and weights_dcp_ok:
            if not (path / shards / ".metadata").is_file():
                problems.append(f"{path / shards}: the weights' DCP shards are missing")
                continue
            return path, state, None, problems
        try:
            weights = read_weights(path)
        except Exception as e:
            problems.append(f"{path} (weights): {type(e).__name__}: {e}")
            continue
        return path, state, weights, problems
    raise ValueError(f"{checkpoint_root(out_dir)}: no checkpoint can be resumed from:\n  " + "\n  ".join(problems)
                     + "\n(remove the damaged folders to start afresh, or choose a new --out)")


@torch.no_grad()
def load_weights_into(model, path: str | os.PathLike, loaded=None) -> None:
    """Copy the release-format weights of checkpoint `path` (or `loaded`, the model `read_weights(path)`
    returned) into `model` in place (parameters keep their identity, so an optimizer built on `model`
    stays valid)."""
    if loaded is None:
        loaded = read_weights(path)
    src = dict(loaded.named_parameters()) | dict(loaded.named_buffers())
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name not in src:
            raise ValueError(f"{path}: checkpoint has no tensor for {name}")
        if src[name].shape != t.shape:
            raise ValueError(f"{path}: {name} has shape {tuple(src[name].shape)}, the model {tuple(t.shape)}")
        if hasattr(t, "device_mesh"):  # a sharded (FSDP2) parameter: this rank's part of the full tensor
            from torch.distributed.tensor import distribute_tensor

            t.copy_(distribute_tensor(src[name].to(t.dtype), t.device_mesh, t.placements, src_data_rank=None))
        else:
            t.copy_(src[name])


# ---- the run folder: what `openk3 train` and `openk3 sft` open, resume and record -------------------------

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


def refuse_lost_checkpoints(out: Path) -> None:
    """ValueError when `checkpoints/latest` exists (the run completed a checkpoint once) but no complete
    checkpoint is left: starting over there would replace the run's config and metrics with a new run's."""
    root = checkpoint_root(out)
    pointer = root / LATEST
    if not pointer.is_file() or find_latest(out) is not None:
        return
    named = pointer.read_text(errors="replace").strip()[:80]
    raise ValueError(f"{out}: the run's checkpoints are gone ({pointer} names {named!r}, and {root} holds no "
                     "complete checkpoint); nothing was changed. Put the checkpoint folder back to resume the run; "
                     f"to start over, choose a new --out (or remove {pointer}: a new run then replaces this "
                     "folder's config and metrics)")


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
