"""File mechanics: a streaming safetensors writer, shard planning and the index, reading shard
headers with errors that name the file, and the atomic folder swap.

The writer emits the standard safetensors format (8-byte little-endian header length, JSON header
with `dtype`/`shape`/`data_offsets`, `__metadata__ {"format": "pt"}`, header padded with spaces to a
multiple of 8, then the raw little-endian bytes). Tensors are written one at a time, so saving needs
no second copy of the model; within a file they are ordered by item size (largest first), which keeps
every tensor's offset aligned to its dtype.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from openk3.checkpoint.layout import ST_DTYPES, checkpoint_file
from openk3.fsutil import fsync_dir

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

Item = tuple[str, tuple[int, ...], torch.dtype, Callable[[], torch.Tensor]]  # name, shape, dtype, producer


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def plan_shards(items: list[Item], max_shard_bytes: int) -> list[list[Item]]:
    """Greedy, in order: start a new shard when the next tensor would push this one over the limit
    (a tensor larger than the limit gets a shard of its own). One shard when everything fits."""
    shards: list[list[Item]] = [[]]
    size = 0
    for it in items:
        nb = _nbytes(it)
        if shards[-1] and size + nb > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += nb
    return shards


def _nbytes(it: Item) -> int:
    n = it[2].itemsize
    for d in it[1]:
        n *= d
    return n


def write_tensor(fh, t: torch.Tensor) -> None:
    """Append one tensor's raw bytes (module-level so tests can make a save fail midway)."""
    t = t.detach().to("cpu").contiguous().reshape(-1)
    if t.numel():
        fh.write(memoryview(t.view(torch.uint8).numpy()))


def write_safetensors(path: Path, items: list[Item]) -> int:
    """Write `items` (produced one at a time) to `path`, fsynced. Returns the tensor bytes written."""
    items = sorted(items, key=lambda it: -it[2].itemsize)  # stable: keeps the layout order per dtype size
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype, _ in items:
        nb = _nbytes((name, shape, dtype, None))
        header[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nb]}
        offset += nb
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for name, shape, dtype, produce in items:
            t = produce()
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"cannot save {name}: the model holds {list(t.shape)} {t.dtype}, the layout of its "
                                 f"config expects {list(shape)} {dtype}")
            write_tensor(fh, t)
        fh.flush()
        os.fsync(fh.fileno())
    return offset


def write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def write_weights(folder: Path, items: list[Item], max_shard_bytes: int) -> None:
    """`model.safetensors`, or shards + `model.safetensors.index.json` when the total exceeds the limit."""
    total = sum(_nbytes(it) for it in items)
    if total <= max_shard_bytes:
        write_safetensors(folder / SINGLE, items)
        return
    shards = plan_shards(items, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        name = shard_name(i, len(shards))
        write_safetensors(folder / name, shard)
        weight_map.update({it[0]: name for it in shard})
    write_json(folder / INDEX, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


# ---- reading -----------------------------------------------------------------------------------

def weight_map(folder: Path) -> dict[str, str]:
    """tensor name -> shard file name, from the index or the single file's header."""
    index = folder / INDEX
    if index.exists():
        try:
            data = json.loads(index.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{index}: not valid JSON ({e})") from None
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise ValueError(f"{index}: field 'weight_map' must be an object mapping tensor names to shard files")
        # only plain names: `..` parts, sub-folders or absolute paths could make a load (or `openk3 info`)
        # open files outside the checkpoint folder
        bad = sorted(f"{k!r}: {v!r}" for k, v in wm.items() if os.path.basename(v) != v or v in ("", ".", ".."))
        if bad:
            raise ValueError(f"{index}: weight_map entries must name shard files inside the folder (plain file "
                             f"names), got {some_names(bad, 4)}")
        return wm
    single = folder / SINGLE
    if not single.exists():
        raise ValueError(f"{folder}: no {SINGLE} or {INDEX} (not a checkpoint folder?)")
    with open_shard(single) as h:
        return {name: SINGLE for name in h.keys()}


_PREAD: list[bool] = []  # whether this safetensors has the `pread` backend (>= 0.8), probed once


def reads_owned_tensors() -> bool:
    """True when `get_tensor` returns freshly read tensors (pread) rather than views of a file mapping."""
    return bool(_PREAD and _PREAD[0])


def open_shard(path: Path):
    """`safe_open` with a ValueError naming the file for a missing, truncated or corrupt shard.

    Uses the `pread` backend where available: tensors are read into their own memory instead of
    mapping the file, so a load never holds the model plus the mapped shards.
    """
    from safetensors import safe_open

    if not path.exists():
        raise ValueError(f"{path}: shard file is missing")
    try:
        if not _PREAD or _PREAD[0]:
            try:
                h = safe_open(str(path), framework="pt", backend="pread")
                _PREAD[:] = [True]
                return h
            except TypeError:  # older safetensors: mmap only
                _PREAD[:] = [False]
        return safe_open(str(path), framework="pt")
    except Exception as e:  # SafetensorError, OSError
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


def headers(folder: Path, wm: dict[str, str]) -> tuple[dict[str, tuple[str, list[int]]], dict[str, Any]]:
    """({name: (dtype, shape)}, {file: open handle}) for every tensor the weight map names.

    Raises ValueError when an indexed shard is missing or unreadable, when the index names a tensor its
    shard does not hold, or when a shard holds tensors the index does not name.
    """
    by_file: dict[str, list[str]] = {}
    for name, file in wm.items():
        by_file.setdefault(file, []).append(name)
    handles: dict[str, Any] = {}
    info: dict[str, tuple[str, list[int]]] = {}
    try:
        _read_headers(folder, by_file, handles, info)
    except BaseException:
        close(handles)
        raise
    return info, handles


def close(handles: dict[str, Any]) -> None:
    for h in handles.values():
        h.__exit__(None, None, None)
    handles.clear()


def _read_headers(folder: Path, by_file: dict[str, list[str]], handles: dict[str, Any],
                  info: dict[str, tuple[str, list[int]]]) -> None:
    for file, names in sorted(by_file.items()):
        path = folder / file
        if not path.exists():
            raise ValueError(f"{folder / INDEX}: shard {file} (holding {len(names)} tensors, e.g. {names[0]}) "
                             f"is missing")
        handles[file] = h = open_shard(path)
        keys = set(h.keys())
        absent = sorted(set(names) - keys)
        if absent:
            raise ValueError(f"{folder / INDEX}: names tensors that shard {file} does not hold: {some_names(absent)}")
        extra = sorted(keys - set(names))
        if extra:
            raise ValueError(f"{path}: holds tensors that {INDEX} does not name: {some_names(extra)}")
        for name in names:
            sl = h.get_slice(name)
            info[name] = (sl.get_dtype(), list(sl.get_shape()))


def some_names(names: Iterable[str], limit: int = 12) -> str:
    names = list(names)
    head = ", ".join(names[:limit])
    return head + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


# ---- atomic folder swap --------------------------------------------------------------------------

def temp_sibling(path: Path, tag: str) -> Path:
    return path.parent / f".{path.name}.{tag}-{uuid.uuid4().hex[:8]}"


def clean_leftovers(path: Path) -> None:
    """Tidy what an interrupted earlier save of `path` left: temp folders are deleted; if that save
    died between moving the previous checkpoint aside and moving the new one in, the previous one is
    moved back to `path` first (so it survives should this save fail too)."""
    olds = sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if olds and not path.exists():
        os.rename(olds.pop(), path)
    for p in olds + sorted(path.parent.glob(f".{path.name}.tmp-*")):
        shutil.rmtree(p, ignore_errors=True)


def swap_in(tmp: Path, path: Path) -> None:
    """Make `tmp` (complete, fsynced) become `path`. An existing `path` is renamed aside, the new folder
    renamed in, files of the old folder that are not checkpoint files (tokenizer, notes) moved over, and
    the old folder deleted. At every instant a complete checkpoint exists at `path` or aside it."""
    fsync_dir(tmp)
    if not path.exists():
        os.rename(tmp, path)
        fsync_dir(path.parent)
        return
    old = temp_sibling(path, "old")
    os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(path.parent)
    for entry in os.listdir(old):
        if not checkpoint_file(entry) and not (path / entry).exists():
            os.rename(old / entry, path / entry)
    shutil.rmtree(old, ignore_errors=True)
