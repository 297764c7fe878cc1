"""Process plumbing of a sandbox: the holder script, finding its processes, reading the agent's pipe.

Kept apart from `sandbox.py` (the contract and the state) because none of it is about what a sandbox is,
only about driving the processes that make one. Stdlib only: it runs as an unprivileged user too.
"""

from __future__ import annotations

import os
import queue
import selectors
import signal
import subprocess
import threading
import time

REPLY_CAP = 16 << 20  # bytes of one agent reply the host accepts

# The holder: mounts the workspace (a size-capped tmpfs upper over the sealed layers) in the private mount
# namespace `unshare` made, runs bwrap, and then stays alive holding that namespace, with our pipe closed,
# until the host has copied the upper out and kills it. The saved upper comes back with fstree.py (any depth;
# `cp -a` names files by full path and stops at PATH_MAX). Before bwrap starts, the holder greets the host on
# the pipe with one line (nothing sandboxed runs yet, so nothing else can write it): READY and what the
# restore could not bring back, tab-separated, once the workspace is whole and mounted; or RESTORE_FAILED
# and why, and it exits. Only a workspace that was greeted READY is ever saved over `saved`: a half-restored
# one (a slow restore the host gave up on) never replaces the files it was restoring. Arguments:
# bytes inodes tmpfs saved lowerdir mnt python fstree.py -- bwrap...
READY, RESTORE_FAILED = "openk3-holder ready", "openk3-holder restore-failed"
HOLDER = r"""set -e
q=$1 n=$2 t=$3 saved=$4 lower=$5 mnt=$6 python=$7 fstree=$8
shift 9
mount -t tmpfs -o "size=$q,nr_inodes=$n,mode=0755" openk3-workspace "$t"
mkdir "$t/up" "$t/wk"
p=
if [ -d "$saved" ] && ! p=$("$python" -I -S "$fstree" copy "$saved" "$t/up" 2>&1); then
  printf '%s\t%s\n' '@FAILED@' "$(printf '%s' "$p" | tr '\n\t' '\t ')"
  exit 1
fi
mount -t overlay overlay -o "userxattr,lowerdir=$lower,upperdir=$t/up,workdir=$t/wk" "$mnt"
if [ -n "$p" ]; then p=$(printf '%s' "$p" | tr '\n\t' '\t '); fi
printf '%s\t%s\n' '@READY@' "$p"
set +e
"$@"
exec sleep infinity </dev/null >/dev/null 2>&1
""".replace("@READY@", READY).replace("@FAILED@", RESTORE_FAILED)


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


def pid_ns() -> str:
    """This process's PID namespace (the inode of /proc/self/ns/pid), "" where /proc cannot tell: a pid
    and a start time name a process only within one PID namespace, and only through a /proc of that
    namespace (so "" also where /proc belongs to another one)."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return ""
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def owner_gone(ns: str | None, pid: int, start: str | None) -> bool:
    """Whether the host process (`pid`, `start`) of PID namespace `ns` has certainly ended: never for
    another namespace's (its pids mean nothing here), nor where ours is unknown. `ns` None: a record from
    before namespaces were recorded, taken as ours."""
    mine = pid_ns()
    return bool(mine) and (ns is None or ns == mine) and not alive(pid, start)


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    """The live processes below `pid` (zombies left out: they hold nothing but their exit status)."""
    found, todo = [], children(pid)
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
        except (OSError, IndexError):
            continue
        found.append(p)
        todo += children(p)
    return found


def kill_descendants(pid: int, wait: float) -> bool:
    """SIGKILL every process below `pid` (not `pid` itself) until none is left; False if some outlive `wait`
    seconds (a process stuck in the kernel)."""
    deadline = time.monotonic() + wait
    while found := descendants(pid):
        if time.monotonic() > deadline:
            return False
        for p in found:
            signal_pid(p, signal.SIGKILL)
        time.sleep(0.005)
    return True


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def drain_to_eof(stream, wait: float) -> bool:
    """Read and drop what comes until EOF (True) or for `wait` seconds (False: a writer is still alive)."""
    deadline = time.monotonic() + wait
    fd = stream.fileno()
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if sel.select(timeout=left) and not os.read(fd, 1 << 16):
                return True
    return False


def kill(proc: subprocess.Popen) -> None:
    """End the holder and everything under it. Its children first, while it is stopped: killed first, it
    would leave them (a restore's copier) running, reparented out of reach."""
    if proc.poll() is None:
        signal_pid(proc.pid, signal.SIGSTOP)
        kill_descendants(proc.pid, 5.0)
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def run_bounded(argv: list[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess | None:
    """Run `argv` in its own process group with output captured; None when it ran past `timeout` seconds
    (the whole group is then killed: nothing it started keeps running)."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=True)
    done = False
    try:
        out, err = proc.communicate(timeout=timeout)
        done = True
    except subprocess.TimeoutExpired:
        pass
    finally:
        if not done:  # timed out, or interrupted (Ctrl-C): the copier goes with its whole group
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            kill(proc)
    if not done:
        return None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


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
