"""Disk space a training run needs, known before anything is written (`openk3 train` checks it before the
tokenizer is trained and the data cached): checkpoints from the model config alone (no model is built),
the token cache from the data's file sizes. A full disk is then one clear error at the start, not an ENOSPC
in the middle of caching or at the first checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from openk3.train.config import TrainConfig


def checkpoint_bytes(model_cfg, *, muon: bool = True) -> int:
    """About one checkpoint on disk, from the model config alone (no model is built): fp32 weights plus
    the optimizer's fp32 state per parameter (Muon: one momentum buffer; AdamW: two moments), split as
    `openk3.train.optim` groups them (`openk3.plan.train.optimizer_split`; `optim.muon_router` moves the
    small router onto Muon, so this is then a slight overestimate; `muon=False`, `optim.muon`'s ablation,
    puts everything on AdamW). Tokenizer files, loader, RNG and metrics state are negligible beside it."""
    from openk3.plan.counts import params
    from openk3.plan.train import optimizer_split

    split = optimizer_split(model_cfg)
    if not muon:
        split = {"muon": 0, "adamw": split["muon"] + split["adamw"]}
    return 4 * params(model_cfg).total + 4 * split["muon"] + 8 * split["adamw"]


def planned_saves(cfg: TrainConfig, start: int) -> int:
    """Checkpoints a run at step `start` writes before it ends: one per multiple of `save_every` in
    (start, max_steps], and one at the end unless that step was one of them."""
    if start >= cfg.max_steps:
        return 0
    if not cfg.save_every:
        return 1
    return cfg.max_steps // cfg.save_every - start // cfg.save_every + (cfg.max_steps % cfg.save_every != 0)


def checkpoints_to_fit(saves: int, existing: int, keep: int | None) -> int:
    """How many checkpoints beyond the `existing` ones the disk holds at the peak while a run writes `saves`
    more and prunes to the newest `keep` after each (None: keeps all). A save is written whole before older
    ones go, so before save i the disk holds what save i-1 left (`existing` before the first, then at most
    `keep`) and the one being written comes on top: a run resumed with keep_checkpoints=1 needs room for one
    more checkpoint, as it did after its first save."""
    if saves <= 0:
        return 0
    if keep is None:
        return saves
    return max(existing, min(existing + saves - 1, keep)) + 1 - existing


# The built-in corpus is each stdlib file's code plus its docstrings and comments as a second document:
# the prose measured 27 % of the code's bytes on CPython 3.11 (openk3/data/corpus.py), so file sizes x 1.5
# bound the text without parsing anything.
_BUILTIN_TEXT_PER_FILE_BYTE = 1.5


def source_bytes(data_cfg) -> int:
    """About the UTF-8 bytes of text `data_cfg` yields, from file sizes alone (nothing is read):
    `max_bytes` when that is smaller. Compressed sources (parquet, datasets folders) count their
    on-disk size, which their text can exceed."""
    from openk3.data.sources import resolve_sources

    total = 0.0
    for src in resolve_sources(data_cfg):
        if src.kind == "builtin":
            from openk3.data import corpus

            root = corpus.stdlib_dir()
            total += _BUILTIN_TEXT_PER_FILE_BYTE * sum(os.path.getsize(os.path.join(root, rel))
                                                        for rel in corpus.stdlib_files(root))
        elif src.kind == "hf":
            total += sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(src.path) for f in files)
        else:
            total += os.path.getsize(src.path)
    total = int(total)
    return total if data_cfg.max_bytes is None else min(total, data_cfg.max_bytes)


def cache_bytes(data_cfg, vocab_size: int, cache_dir: Path, tok=None) -> int:
    """What building the token cache will add under `cache_dir`: 0 when the cache for (`data_cfg`, `tok`)
    is already there, else at most one token per byte of text (`source_bytes`; byte-level BPE never
    does worse, and typically 2-4x better) at 2 bytes per id (4 above 65,536 ids). Document offsets
    and the per-id byte table are small beside it and not counted."""
    from openk3.data.shards import dataset_key, token_dtype

    if tok is not None and (cache_dir / dataset_key(data_cfg, tok)).is_dir():
        return 0
    return source_bytes(data_cfg) * token_dtype(vocab_size).itemsize


def _existing(path: Path) -> Path:
    """`path` or its nearest existing parent (a folder the run has yet to create is on that disk)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_free_space(out: Path, checkpoints: int, checkpoint_size: int, cache_dir: Path, cache_size: int) -> None:
    """ValueError naming the folder, the bytes needed (and for what) and the bytes free when a disk cannot
    take what this run will write: `checkpoints` checkpoints of `checkpoint_size` bytes under `out` and
    `cache_size` bytes of token cache under `cache_dir` (added up when both are on one disk)."""
    disks: dict[int, dict] = {}  # st_dev -> the first folder on that disk, an existing path there, needs
    for folder, size, what in (
            (out, checkpoints * checkpoint_size,
             f"{checkpoints} checkpoint(s) of {checkpoint_size:,} bytes (fp32 weights + optimizer state)"),
            (cache_dir, cache_size, f"the token cache in {cache_dir} (at most one token per byte of text)")):
        if size <= 0:
            continue
        anchor = _existing(folder)
        disk = disks.setdefault(os.stat(anchor).st_dev, {"folder": folder, "anchor": anchor, "needs": []})
        disk["needs"].append((size, f"{size:,} for {what}"))
    for disk in disks.values():
        needed, free = sum(n for n, _ in disk["needs"]), shutil.disk_usage(disk["anchor"]).free
        if free < needed:
            raise ValueError(f"{disk['folder']}: not enough free disk space for this run: need about {needed:,} "
                             f"bytes ({needed / 2**30:.2f} GiB: {'; '.join(w for _, w in disk['needs'])}), "
                             f"{free:,} bytes ({free / 2**30:.2f} GiB) free; free some space, or choose another "
                             f"--out (or cache_dir=..., data.max_bytes=...)")
