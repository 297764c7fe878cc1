"""The JSONL audit log of an agent's tool calls: one line per call, appended, read back as records.

    log = AuditLog("runs/ep/audit.jsonl")
    log.record(episode="ep1", step=3, tool="Shell", args={"command": "ls"}, allowed=True, duration_s=0.02,
               exit_status=0, ok=True, bytes_out=120, truncated=False, snapshot_before="s1", snapshot_after="s2")
    for rec in read_audit("runs/ep/audit.jsonl"): ...

A record holds: `ts` (UTC, ISO 8601, ms), `episode`, `step`, `tool`, `args` (canonical JSON: sorted keys, no
spaces) or, when that is over 4 KiB, only `args_bytes` -- `args_sha256` is always there, so a replay can
check it ran the same call -- then `decision` (allow | deny), `rule_id`, and, when given, `duration_s`,
`exit_status`, `ok`, `bytes_out`, `truncated`, `snapshot_before`, `snapshot_after` and `extra`.

Lines are JSON with `ensure_ascii`: a newline, an ANSI escape or U+2028 inside an argument is written as a
`\\u` escape, so what a model puts in its arguments can never start a line of its own (no forged records).
Each record is one `write` on a descriptor opened with O_APPEND, so lines from several writers never
interleave and each is in the file (flushed to the kernel) when `record` returns.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

MAX_INLINE_ARGS = 4096  # bytes of canonical JSON kept inline; larger args are logged by hash


def canonical_json(value: Any, *, strict: bool = False) -> str:
    """Sorted keys, no spaces: the form whose sha256 identifies a call's arguments (non-ASCII kept, anything not
    JSON as its repr) and, `strict` (non-ASCII escaped, anything not JSON a TypeError: what the task graders
    compute in the sandbox), whose HMAC a task's hidden expected results are kept as."""
    if strict:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr)


class AuditLog:
    """An append-only JSONL file. `fsync=True` also forces each line to disk (slower; for crash-safe logs)."""

    def __init__(self, path: str | os.PathLike, fsync: bool = False):
        self.path = os.fspath(path)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self.fsync = fsync
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)

    def record(self, *, episode: str, step: int, tool: str, args: Any, allowed: bool, rule_id: str | None = None,
               duration_s: float | None = None, exit_status: int | None = None, ok: bool | None = None,
               bytes_out: int | None = None, truncated: bool | None = None, snapshot_before: str | None = None,
               snapshot_after: str | None = None, extra: dict | None = None) -> dict:
        """Append one call's record and return it (as written)."""
        if self._fd is None:
            raise ValueError(f"audit log {self.path} is closed")
        args_json = canonical_json(args)
        encoded = args_json.encode("utf-8", "surrogatepass")
        rec: dict[str, Any] = {
            "ts": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "episode": episode, "step": step, "tool": tool,
            "args_sha256": hashlib.sha256(encoded).hexdigest(),
        }
        if len(encoded) <= MAX_INLINE_ARGS:
            rec["args"] = args_json
        else:
            rec["args_bytes"] = len(encoded)
        rec["decision"] = "allow" if allowed else "deny"
        rec["rule_id"] = rule_id
        optional = {"duration_s": duration_s, "exit_status": exit_status, "ok": ok, "bytes_out": bytes_out,
                    "truncated": truncated, "snapshot_before": snapshot_before, "snapshot_after": snapshot_after,
                    "extra": extra}
        rec.update((k, v) for k, v in optional.items() if v is not None)
        line = (json.dumps(rec, ensure_ascii=True, separators=(",", ":"), default=repr) + "\n").encode("ascii")
        written = os.write(self._fd, line)
        if written != len(line):  # a full disk; a second write would no longer be one atomic append
            raise OSError(f"audit log {self.path}: short write ({written} of {len(line)} bytes)")
        if self.fsync:
            os.fsync(self._fd)
        return rec

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_audit(path: str | os.PathLike) -> Iterator[dict]:
    """The records of an audit log, in order. A last line without its newline (a writer killed mid-write)
    is skipped; any other line that is not a JSON object raises ValueError naming the file and line."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                return
            try:
                rec = json.loads(raw)
            except ValueError as e:
                raise ValueError(f"{os.fspath(path)}:{number}: not a JSON audit record: {e}") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{os.fspath(path)}:{number}: not a JSON audit record (a {type(rec).__name__})")
            yield rec
