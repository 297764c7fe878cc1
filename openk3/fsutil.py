"""Durable file-system steps shared by every atomic writer (checkpoints, token shards, trainer state)."""

from __future__ import annotations

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
