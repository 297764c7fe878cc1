"""Durable file-system steps shared by every atomic writer (checkpoints, token shards, trainer state)."""

from __future__ import annotations

import json
import os
import uuid


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


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` through a temporary file in the same folder (`<name>.tmp.<pid>.<hex>`, so
    concurrent writers never share one), fsync and os.replace: a reader, or a kill at any point, sees the
    old file or the new one, never half of one; a failed write removes its temporary. The one atomic
    small-file writer of the project (configs, tokenizer files, metrics, plots, the `latest` pointer)."""
    tmp = f"{os.fspath(path)}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "xb") as fh:  # a plain open: the file gets the usual umask permissions
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def parse_json(text: str | bytes, source: str):
    """Parse JSON text; malformed JSON, and JSON nested too deeply for Python's parser (which raises
    RecursionError, a bug's exception, for input such as 100,000 `[`), are a ValueError naming `source`
    (a file name, or a description such as "the request on stdin")."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:  # bytes that are not UTF-8/16/32
        raise ValueError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise ValueError(f"{source}: JSON nested too deeply to parse") from None


def read_json(path: str | os.PathLike):
    """Parse a JSON file. Malformed, non-UTF-8 or too deeply nested JSON, and a path that is a folder or
    cannot be read, are a ValueError naming the file; a missing file stays FileNotFoundError."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except FileNotFoundError:
        raise
    except OSError as e:  # a folder where the file should be, permissions, I/O
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
    return parse_json(data, str(path))
