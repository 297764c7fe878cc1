"""Durable file-system steps shared by every atomic writer (checkpoints, token shards, trainer state), errors
that name the file a failed write was writing, and JSON parsing with errors that name the source (and a bound
on nesting, so no later recursive walk of the value can hit Python's recursion limit)."""

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
    small-file writer of the project (configs, tokenizer files, metrics, plots, the `latest` pointer). An
    OSError that names no file (a full disk) is raised naming `path` (`naming`)."""
    tmp = f"{os.fspath(path)}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "xb") as fh:  # a plain open: the file gets the usual umask permissions
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise naming(e, path, "writing it; the file as it was is kept", temp=tmp) from e
        raise


def naming(e: OSError, path: str | os.PathLike, doing: str, *, temp: str | os.PathLike | None = None) -> OSError:
    """`e` when it already names a file; else the same error naming `path` and what was being done (a write
    to a full disk says only "No space left on device", which leaves the user to guess where). An error that
    names `temp` or a file inside it (a writer's temporary, removed by now) names `path` instead."""
    reason = e.strerror or str(e)
    if e.filename is not None:
        named, temp = os.fspath(e.filename), os.fspath(temp) if temp is not None else None
        if temp is None or not (named == temp or named.startswith(temp.rstrip(os.sep) + os.sep)):
            return e
        reason = os.strerror(e.errno) if e.errno else reason  # not what an inner writer added about its temp
    return OSError(e.errno, f"{reason} ({doing})", os.fspath(path))


#: Nesting that `check_depth` allows in request-like JSON (chat requests, tool schemas, SFT lines). Real tool
#: schemas nest a few tens of levels; a value 600 levels deep parses, but walking it recursively (sorting its
#: keys, `json.dumps`) raises RecursionError, a bug's exception, far from where the value came in.
MAX_JSON_DEPTH = 128


def parse_json(text: str | bytes, source: str, *, max_depth: int | None = None):
    """Parse JSON text; malformed JSON, and JSON nested too deeply for Python's parser (which raises
    RecursionError, a bug's exception, for input such as 100,000 `[`), are a ValueError naming `source`
    (a file name, or a description such as "the request on stdin"). `max_depth`: also refuse a value nested
    deeper than that (`check_depth`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source}: not valid JSON ({e})") from None
    except UnicodeDecodeError as e:  # bytes that are not UTF-8/16/32
        raise ValueError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise ValueError(f"{source}: JSON nested too deeply to parse") from None
    if max_depth is not None:
        check_depth(value, max_depth, source)
    return value


def check_depth(value, max_depth: int = MAX_JSON_DEPTH, source: str = "") -> None:
    """ValueError when lists/dicts in `value` nest deeper than `max_depth`, naming where (`source`, then the
    path of the first too-deep branch, e.g. `tools[0].function.parameters.properties...`). Iterative: it never
    recurses, whatever the depth."""
    stack: list[tuple[object, tuple]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        if len(path) >= max_depth:
            where = json_path(path[:8]) + ("..." if len(path) > 8 else "")
            prefix = f"{source}: " if source else ""
            raise ValueError(f"{prefix}{where or 'the value'}: nested more than {max_depth} levels deep "
                             "(lists and objects)")
        children = item.items() if isinstance(item, dict) else enumerate(item)
        stack.extend((child, (*path, key)) for key, child in children)


def json_path(path) -> str:
    """("messages", 1, "tool_calls") -> "messages[1].tool_calls"."""
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


def decode_utf8(data: bytes, where: str) -> str:
    """`data` as UTF-8 text; bytes that are not are a ValueError naming `where` (a file, `file:line`) and the
    offending byte and its offset (Python's own error names neither the file nor the line)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}: {e.reason})") \
            from None


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
