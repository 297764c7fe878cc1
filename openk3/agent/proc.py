"""Process plumbing of a sandbox: the holder script, finding its processes, reading the agent's pipe.

Kept apart from `sandbox.py` (the contract and the state) because none of it is about what a sandbox is,
only about driving the processes that make one. Stdlib only: it runs as an unprivileged user too.
"""

from __future__ import annotations

import os
import queue
import selectors
import subprocess
import threading
import time

REPLY_CAP = 16 << 20  # bytes of one agent reply the host accepts

# The holder: mounts the workspace (a size-capped tmpfs upper over the sealed layers) in the private mount
# namespace `unshare` made, runs bwrap, and then stays alive holding that namespace, with our pipe closed,
# until the host has copied the upper out and kills it. The saved upper comes back with fstree.py (any depth;
# `cp -a` names files by full path and stops at PATH_MAX). Arguments:
# bytes inodes tmpfs saved lowerdir mnt python fstree.py -- bwrap...
HOLDER = r"""set -e
q=$1 n=$2 t=$3 saved=$4 lower=$5 mnt=$6 python=$7 fstree=$8
shift 9
mount -t tmpfs -o "size=$q,nr_inodes=$n,mode=0755" openk3-workspace "$t"
mkdir "$t/up" "$t/wk"
if [ -d "$saved" ]; then "$python" -I -S "$fstree" copy "$saved" "$t/up" >&2; fi
mount -t overlay overlay -o "userxattr,lowerdir=$lower,upperdir=$t/up,workdir=$t/wk" "$mnt"
set +e
"$@"
exec sleep infinity </dev/null >/dev/null 2>&1
"""


class _Spawner:
    """Every sandbox process is forked from this one long-lived thread. The holder asks to be killed when its
    parent dies (PR_SET_PDEATHSIG, so nothing outlives the host), and Linux fires that when the parent
    *thread* exits: a sandbox first used from a short-lived worker thread would lose its processes, and the
    files of its live workspace, when that thread ended."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="openk3-sandbox-spawner", daemon=True)
                self._thread.start()
        box: dict = {}
        done = threading.Event()
        self._q.put((argv, kwargs, box, done))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["proc"]

    def _loop(self) -> None:
        while True:
            argv, kwargs, box, done = self._q.get()
            try:
                box["proc"] = subprocess.Popen(argv, **kwargs)
            except BaseException as e:  # handed to the caller's thread
                box["error"] = e
            finally:
                done.set()


spawn = _Spawner().popen


def start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (field 22 of /proc/<pid>/stat): with the pid, it
    names one process for good (a pid alone is reused). "0" where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "0"


def alive(pid: int, start: str | None) -> bool:
    """Whether the process `pid` that started at `start` (None: any start) still runs."""
    return os.path.exists(f"/proc/{pid}") and (start is None or start_time(pid) == start)


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def drain_to_eof(stream, wait: float) -> None:
    deadline = time.monotonic() + wait
    fd = stream.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if sel.select(timeout=left) and not os.read(fd, 1 << 16):
                return


def kill(proc: subprocess.Popen) -> None:
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def read_line(stream, wait: float) -> bytes | None:
    """One reply line within `wait` seconds: None on timeout, b"" at EOF; capped at REPLY_CAP."""
    deadline = time.monotonic() + wait
    buf = bytearray()
    fd = stream.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not sel.select(timeout=left):
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            buf += chunk
            if b"\n" in buf:
                return bytes(buf[: buf.index(b"\n")])
            if len(buf) > REPLY_CAP:
                return b"\0"  # not JSON: treated as a protocol error
