"""The checkpoints of a run folder (pretraining, SFT, RL, MOPD): release-format weights + everything else
needed to resume exactly.

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

import os
import re
import shutil
from pathlib import Path

from openk3.fsutil import fsync_dir

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


# ---- find and clean ---------------------------------------------------------------------------------

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
