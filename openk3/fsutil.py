"""Durable file-system steps shared by every atomic writer (checkpoints, token shards, trainer state)."""

from __future__ import annotations

import json
import os


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so renames inside it survive a crash; a no-op where directories can't be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike):
    """Parse a JSON file; malformed JSON is a ValueError naming the file (and the position)."""
    with open(path) as fh:
        try:
            return json.load(fh)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
