"""Moving a sandbox's live upper (the files written since the last snapshot) between its tmpfs and the disk.

Between two incarnations of a sandbox the upper lives on disk as `saved`: the host copies it out of the
holder's tmpfs when an incarnation ends (`save`), and the next holder copies it back in before anything
sandboxed starts (`proc.HOLDER`, which then greets the host: `read_greeting`). Both directions keep one rule:
`saved` is replaced only by a whole copy of a whole upper. A copy that fails, runs out of time, or starts
from an upper that was never whole (a restore the host gave up on) leaves `saved` as it was, and the caller
says so in a notice; only the host's own disk failing makes it raise.

The copy out is the host's own child (nsenter into the holder's namespaces), outside the sandbox's cgroup,
and a workspace is made by untrusted code: it runs under rlimits (CPU seconds, address space) and a wall
clock (`Limits.copy_timeout`), in its own process group, killed whole when the time is up.
"""

from __future__ import annotations

import math
import os
import time

from .fstree import HOST_FAILED, printable
from .layers import rmtree
from .proc import READY, RESTORE_FAILED, run_bounded

AGENT_DIR = os.path.dirname(os.path.abspath(__file__))
FSTREE = os.path.join(AGENT_DIR, "fstree.py")  # copies uppers in and out, inside the holder's namespaces
PYTHON = "/usr/bin/python3"  # the system interpreter: the only one inside the sandbox's /usr view
COPY_MEMORY = 1 << 30  # address space of the host-side copier (fstree needs tens of MB for 100k entries)
# The fast copy of an upper, set-id bits dropped after it. It declines (exit status != 0, and fstree.py copies
# instead) a tree more than 256 folders deep, where cp's full-path lookups cost O(depth^2) (26 s of host CPU
# at 2,100 levels, where fstree takes 0.5 s); it fails past PATH_MAX; and xattr is named, not implied by -a,
# so that an attribute the host's file system refuses fails the copy instead of vanishing.
CP_UPPER = ('[ -z "$(find "$1" -mindepth 256 -print -quit)" ] && '
            'cp -dR --preserve=mode,ownership,timestamps,links,xattr -- "$1" "$2" && '
            'find "$2" -perm /6000 ! -type l -exec chmod ug-s {} +')


class CopyFailed(Exception):
    """The upper was not saved; `saved` is as it was. `host` is True when the host's disk failed (the caller
    raises), False when the workspace or its holder is to blame (the caller notes it and goes on)."""

    def __init__(self, why: str, host: bool) -> None:
        super().__init__(why)
        self.host = host


def save(holder: int, src: str, saved: str, timeout: float) -> list[str]:
    """Copy the holder's tmpfs upper `src` (whiteouts and opaque-dir xattrs included) to `saved`, atomically;
    returns what the copy could not keep (each naming its path). Raises CopyFailed.
    The copy runs inside the holder's user and mount namespaces (nsenter), as the namespace's root: it reads
    files the sandboxed code made unreadable (chmod 000) even when the host is an ordinary user, and writes
    them owned by the sandbox's uid. Set-user/group-id bits are dropped: a layer must not hold a setuid
    binary of the sandbox uid for a local user to run. `cp` first (CP_UPPER: fast, a few ms); where it
    declines or fails (folders nested past PATH_MAX or deeper than 256, an attribute the host's file system
    refuses), `fstree.py` copies: it walks by directory fds, so no depth, file kind or name stops it, at the
    price of a Python start-up."""
    tmp = saved + ".new"
    rmtree(tmp)
    # An ordinary user keeps its credentials (its uid is the namespace's root; setgroups is denied there);
    # root becomes the namespace's root, i.e. the sandbox uid, so the copies belong to that uid.
    keep = ["--preserve-credentials"] if os.getuid() != 0 else []
    bounded = ["prlimit", f"--cpu={max(1, math.ceil(timeout))}", f"--as={COPY_MEMORY}", "--core=0", "--",
               "nsenter", f"--target={holder}", "--user", "--mount", *keep, "--"]
    env = {"PATH": "/usr/bin:/bin"}
    deadline = time.monotonic() + timeout
    r = run_bounded([*bounded, "/bin/sh", "-c", CP_UPPER, "sh", src, tmp], timeout, env)
    problems: list[str] = []
    if r is not None and r.returncode != 0:
        rmtree(tmp)
        left = max(0.01, deadline - time.monotonic())
        r = run_bounded([*bounded, PYTHON, "-I", "-S", FSTREE, "copy", src, tmp], left, env)
        problems = r.stdout.decode("utf-8", "replace").splitlines() if r is not None else []
    if r is None or r.returncode != 0:
        rmtree(tmp)
        if r is None:
            raise CopyFailed(f"the copy took longer than {timeout:g} s (Limits.copy_timeout)", host=False)
        why = r.stderr.decode("utf-8", "replace").strip()[-500:] or f"exit status {r.returncode}"
        raise CopyFailed(printable(why), host=r.returncode == HOST_FAILED)
    rmtree(saved)
    os.rename(tmp, saved)
    return [printable(p) for p in problems]


def read_greeting(line: bytes) -> tuple[str, list[str]]:
    """The holder's first line (`proc.HOLDER`): ("ready" | "failed" | "malformed", its items, escaped)."""
    status, _, rest = line.decode("utf-8", "replace").partition("\t")
    items = [printable(x) for x in rest.split("\t") if x.strip()]
    kind = {READY: "ready", RESTORE_FAILED: "failed"}.get(status, "malformed")
    return kind, items
