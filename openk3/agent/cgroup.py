"""Per-sandbox cgroups: a process count and a memory total for the whole sandbox, where the host allows it.

rlimits are per process (RLIMIT_AS) or per user (RLIMIT_NPROC, shared by every sandbox running as the same
uid), so alone they bound neither one sandbox's total memory nor its process count apart from its
neighbours'. A cgroup does both: `pids.max` counts the sandbox's own processes, and the memory limit counts
everything they touch, including the pages of its RAM-backed workspace and /tmp. Creating cgroups needs
write access to a cgroup hierarchy: root on a cgroup v1 host (pids and memory controllers mounted, as on
the project's machines) or on a v2 host with those controllers enabled. Elsewhere `Cgroup.create` returns
None and the sandbox runs on rlimits alone (docs/agents.md says what that leaves open).

Stdlib only: imported by the sandbox modules, which also run as an unprivileged user.
"""

from __future__ import annotations

import os
import time

from .proc import owner_gone, pid_ns, start_time

ROOT = "/sys/fs/cgroup"
GROUP = "openk3"
# sb-<PID namespace>-<host pid>-<its start time>-<sandbox id>: the owner, so that leftovers can be told apart.
# The namespace matters: hosts in containers (or under `unshare -p`) share one cgroup hierarchy, and a pid
# of another namespace is absent from ours or names another process.
PREFIX = "sb-"


def _writable(path: str) -> bool:
    return os.path.isdir(path) and os.access(path, os.W_OK)


def _layout() -> list[tuple[str, dict[str, str]]] | None:
    """[(parent dir, {limit name: file name})] for the hierarchies to use, or None."""
    v1_pids, v1_mem = os.path.join(ROOT, "pids"), os.path.join(ROOT, "memory")
    if _writable(v1_pids) and _writable(v1_mem) and os.path.exists(os.path.join(v1_pids, "cgroup.procs")):
        return [(v1_pids, {"pids": "pids.max"}), (v1_mem, {"memory": "memory.limit_in_bytes"})]
    controllers = os.path.join(ROOT, "cgroup.controllers")
    if os.path.exists(controllers) and _writable(ROOT):
        with open(controllers) as f:
            have = set(f.read().split())
        if {"pids", "memory"} <= have:
            return [(ROOT, {"pids": "pids.max", "memory": "memory.max"})]
    return None


def group_name(sandbox_id: str) -> str:
    """This process's name for a sandbox's group."""
    return f"{PREFIX}{pid_ns() or 0}-{os.getpid()}-{start_time(os.getpid())}-{sandbox_id}"


def _owner(name: str) -> tuple[str | None, int, str | None] | None:
    """(PID namespace, pid, start time) of the host process that made the group `name`; the namespace None
    for the names before it was recorded (sb-<pid>-<start>-<id>), and the start time too for the oldest
    (sb-<pid>-<id>); None for a group that is not a sandbox's."""
    parts = name.split("-")
    if not name.startswith(PREFIX) or len(parts) not in (3, 4, 5) or not all(p.isdigit() for p in parts[1:-1]):
        return None
    if len(parts) == 5:
        return parts[1], int(parts[2]), parts[3]
    return None, int(parts[1]), (parts[2] if len(parts) == 4 else None)


def reclaim_stale() -> int:
    """Remove the groups of sandboxes whose host process is gone: a host killed with SIGKILL cannot remove
    its own (its sandboxes die with it, through --pdeathsig, and leave their groups empty). Only groups of
    this PID namespace are judged (`owner_gone`); a group of a live host is never touched, even between
    incarnations when it has no tasks; a group that still has tasks (processes still dying) refuses rmdir
    and is taken by a later call. Returns how many went."""
    layout = _layout()
    removed = 0
    for parent, _ in layout or []:
        base = os.path.join(parent, GROUP)
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            owner = _owner(name)
            if owner is None or not owner_gone(*owner):
                continue
            try:
                os.rmdir(os.path.join(base, name))
                removed += 1
            except OSError:
                pass
    return removed


class Cgroup:
    """One sandbox's cgroup(s); `procs_files` are where the launcher writes its pid before it execs."""

    def __init__(self, dirs: list[str], procs_files: list[str]) -> None:
        self.dirs = dirs
        self.procs_files = procs_files

    @classmethod
    def create(cls, name: str, *, pids_max: int, memory_max: int) -> Cgroup | None:
        layout = _layout()
        if layout is None:
            return None
        reclaim_stale()  # each start-up takes what killed hosts left, so leftovers never pile up
        dirs: list[str] = []
        try:
            for parent, files in layout:
                base = os.path.join(parent, GROUP)
                os.makedirs(base, exist_ok=True)
                if parent == ROOT:  # v2: the group's children need the controllers enabled in it
                    with open(os.path.join(base, "cgroup.subtree_control"), "w") as f:
                        f.write("+pids +memory")
                d = os.path.join(base, name)
                os.makedirs(d, exist_ok=True)
                dirs.append(d)
                values = {"pids": str(pids_max), "memory": str(memory_max)}
                for key, fname in files.items():
                    with open(os.path.join(d, fname), "w") as f:
                        f.write(values[key])
        except OSError:
            cls(dirs, []).remove()
            return None
        return cls(dirs, [os.path.join(d, "cgroup.procs") for d in dirs])

    def intact(self) -> bool:
        """Whether every group is still there (a host that misjudged us may have removed one)."""
        return all(os.path.isdir(d) for d in self.dirs)

    def remove(self) -> None:
        """rmdir the groups once their processes are gone (a dying process can hold one for a moment)."""
        for d in self.dirs:
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
        self.dirs = []

    def oom_killed(self) -> bool:
        """Whether the memory limit killed something (v1: memory.failcnt / oom_control; v2: memory.events)."""
        for d in self.dirs:
            for fname, key in (("memory.events", "oom_kill"), ("memory.oom_control", "oom_kill")):
                try:
                    with open(os.path.join(d, fname)) as f:
                        for line in f:
                            k, _, v = line.partition(" ")
                            if k == key and int(v) > 0:
                                return True
                except (OSError, ValueError):
                    pass
        return False
