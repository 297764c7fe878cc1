"""What a sandbox may use and what one call returns: `Limits`, `RunResult`, and the two errors `Sandbox` raises.

Kept apart from `sandbox.py` (the mechanism) so that the contract reads on one page; `openk3.agent` and
`openk3.agent.sandbox` export the same names.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


class SandboxUnavailable(RuntimeError):
    """This host cannot run a sandbox; the message names what is missing."""


class SandboxError(RuntimeError):
    """A sandbox operation failed (the sandbox is closed, or its agent misbehaved)."""


@dataclass(frozen=True)
class Limits:
    """Per-sandbox limits. rlimits apply to every process inside (`memory_bytes` bounds each one's address
    space); where the host lets us create cgroups (root), `max_processes` and `total_memory_bytes` bound the
    whole sandbox, else `max_processes` is RLIMIT_NPROC, which all sandboxes of one uid share. `timeout` is the
    default wall clock of one `run`; `copy_timeout` bounds one copy of the live workspace to disk or back (and
    the copier's CPU seconds): past it the copy is abandoned, the last saved state kept, and a notice says so."""

    timeout: float = 60.0
    max_timeout: float = 3600.0
    cpu_seconds: int = 600
    memory_bytes: int = 2 << 30
    total_memory_bytes: int = 4 << 30  # cgroup memory limit of the whole sandbox (when cgroups are available)
    max_processes: int = 256
    file_size_bytes: int = 256 << 20
    open_files: int = 1024
    tmp_bytes: int = 64 << 20
    workspace_bytes: int = 512 << 20  # the live delta of /workspace (a tmpfs: ENOSPC beyond it)
    workspace_inodes: int = 100_000
    copy_timeout: float = 300.0

    def validate(self) -> Limits:
        for f in fields(self):
            v = getattr(self, f.name)
            kinds = (int, float) if f.name in ("timeout", "max_timeout", "copy_timeout") else (int,)
            if isinstance(v, bool) or not isinstance(v, kinds) or v <= 0:
                what = "number" if len(kinds) == 2 else "integer"
                raise ValueError(f"Sandbox limit {f.name} must be a positive {what}, got {v!r}")
        if self.timeout > self.max_timeout:
            raise ValueError(f"Sandbox limit timeout={self.timeout} exceeds max_timeout={self.max_timeout}")
        if self.max_processes < 8:
            raise ValueError(f"Sandbox limit max_processes={self.max_processes} is too low to run a shell (>= 8)")
        if self.memory_bytes < 64 << 20:
            raise ValueError(f"Sandbox limit memory_bytes={self.memory_bytes} is below 64 MiB: Python cannot start")
        return self


@dataclass(frozen=True)
class RunResult:
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    duration: float = 0.0
    truncated: bool = False
    error: str | None = None  # set when the sandbox itself failed (agent died, protocol error)
    notice: str | None = None  # what the sandbox could not keep (an oversized exported variable, ...)
