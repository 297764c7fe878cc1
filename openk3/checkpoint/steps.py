"""Step checkpoints of a run folder: write one atomically, read back the newest intact one (its layout, finding
and cleaning are `openk3.checkpoint.runs`, which `openk3.load` also uses to open a run folder).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from openk3.checkpoint.load import load
from openk3.checkpoint.runs import (
    LATEST,
    STATE_FILE,
    checkpoint_root,
    find_latest,
    list_checkpoints,
    step_dir_name,
)
from openk3.checkpoint.save import save
from openk3.fsutil import fsync_dir, naming, write_atomic


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


def load_trainer_state(path: str | os.PathLike) -> dict:
    return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=True)


def read_weights(path: str | os.PathLike):
    """The fp32 model held by checkpoint `path` (`openk3.load`: every tensor read and checked)."""
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
