"""`Sandbox`: a process tree in fresh Linux namespaces with a layered, snapshottable `/workspace`.

    with Sandbox(memory_bytes=1 << 30) as sb:
        sb.run("echo hi > a.txt && cd sub || mkdir sub && cd sub")   # cwd and exported env persist
        snap = sb.snapshot()                                         # seal the workspace as a layer
        kids = sb.fork(4)                                            # four sandboxes from this state
        sb.restore(snap)

How it is built (design: shared/context/next-agents-serving.md §1; threat model: docs/agents.md), from the
outside in, each layer holding even if an inner one is wrong:
- the host spawns the launcher with a scrubbed environment (PATH only), so no secret can show up in
  /proc/*/environ inside; as root it first drops to an unprivileged uid (`sandbox_uid`, default 65534), so
  the sandbox never runs with host privileges and the per-user process limit applies;
- rlimits (prlimit): CPU seconds, address space, processes, file size, open files, no core dumps;
- `unshare --user --map-root-user --mount` mounts the overlay (lower = sealed layers, upper = live delta) in
  a private mount namespace that dies with the sandbox: nothing is mounted on the host;
- bubblewrap: new user (uid 1000 inside, no further user namespaces), mount, PID, network (only its own
  `lo`), IPC, UTS and cgroup namespaces; a minimal read-only view (/usr and its symlinks, a few /etc files,
  stub passwd/group), a size-capped /tmp, fresh /dev and /proc, no /sys, no home, no host folders;
  `--die-with-parent` and `--new-session`;
- seccomp-BPF (`seccomp.py`): ptrace, mount, keyctl, bpf, io_uring, non-Unix sockets, ... fail with EPERM;
- the in-sandbox agent (`agentd.py`) runs each command in its own process group with a wall-clock timeout,
  caps output, and kills whatever a command leaves running before it replies.
There is no unsandboxed fallback: where the kernel or the system lacks a piece, `Sandbox()` raises
`SandboxUnavailable` naming it.

Processes are not part of a snapshot (no CRIU): state is the files (the layers) plus the shell's cwd and
exported environment (metadata). `snapshot`, `restore` and `fork` therefore stop the sandbox's processes;
the next call starts a fresh agent (tens of ms) over the new layers.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from dataclasses import fields, replace

from . import upper
from .cgroup import Cgroup, group_name
from .fstree import printable
from .layers import MAX_LAYERS, MAX_LOWERDIR, LayerStore, new_id, remove_stale_stores, rmtree
from .limits import Limits, RunResult, SandboxError, SandboxUnavailable  # noqa: F401 (the public names live here too)
from .proc import HOLDER, children, descendants, drain_to_eof, kill, kill_descendants, read_line, signal_pid, spawn
from .upper import AGENT_DIR, FSTREE, PYTHON

AGENT_FILES = ("agentd.py", "toolbox.py", "toolbox_apps.py")  # bound read-only at /opt/openk3 inside
NOTICE_CAP = 2000  # characters of one notice the agent's reply may carry
# What an exported name may be: a shell identifier, or env's form of an exported function (bash imports
# any function name without a slash)
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|BASH_FUNC_[^\x00-\x20\x7f/=]+%%")
BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/workspace", "LANG": "C.UTF-8", "TERM": "dumb",
            "USER": "agent", "LOGNAME": "agent"}
log = logging.getLogger(__name__)


_probe_lock = threading.Lock()
_probe_result: dict[tuple, str | None] = {}
_cleaned: set[str] = set()
_clean_lock = threading.Lock()  # not _probe_lock: the probe builds a Sandbox while holding that one


def unavailable_reason(sandbox_uid: int = 65534) -> str | None:
    """None if sandboxes can run here, else one line naming what is missing (checked once per process)."""
    key = (os.getuid(), sandbox_uid)
    with _probe_lock:
        if _probe_result.get(key, "") is not None:  # a failure is probed again next time (it may be transient)
            _probe_result[key] = _probe(sandbox_uid)
        return _probe_result[key]


def _probe(sandbox_uid: int) -> str | None:
    tools = ["bwrap", "unshare", "prlimit", "mount", "setpriv", "nsenter", "cp", "find"]
    for tool in tools:
        if shutil.which(tool) is None:
            hint = "apt-get install bubblewrap" if tool == "bwrap" else "util-linux"
            raise_msg = f"`{tool}` is not installed ({hint})"
            return raise_msg
    if not os.access(PYTHON, os.X_OK):
        return f"{PYTHON} is missing: the in-sandbox agent runs on the system Python"
    try:
        with open("/proc/sys/user/max_user_namespaces") as f:
            if int(f.read()) == 0:
                return "user namespaces are disabled (sysctl user.max_user_namespaces = 0)"
    except OSError:
        pass
    from . import seccomp

    why = seccomp.unavailable_reason()
    if why is not None:
        return f"seccomp: {why}"
    # The real test: a throw-away sandbox must start and answer (overlay in a user namespace, bwrap nesting).
    try:
        sb = Sandbox(_probe=True, sandbox_uid=sandbox_uid)
        try:
            r = sb.run("echo ok", timeout=20)
        finally:
            sb.close()
    except SandboxUnavailable as e:
        return str(e)
    if r.error or r.stdout.strip() != "ok":
        return f"a test sandbox did not run: {r.error or r.stderr.strip() or r.stdout.strip()}"
    return None


class Sandbox:
    """The contract: `run`, `tool`, `snapshot`, `restore`, `fork`, `close` (and a context manager)."""

    def __init__(self, *, files: dict[str, str | bytes] | None = None, base_dir: str | None = None,
                 ro_binds: dict[str, str] | None = None, env: dict[str, str] | None = None,
                 store_dir: str | None = None, sandbox_uid: int = 65534, _probe: bool = False,
                 _parent: tuple[LayerStore, str, Limits] | None = None, **limits) -> None:
        unknown = set(limits) - {f.name for f in fields(Limits)}
        if unknown:
            raise ValueError(f"Sandbox: unknown limit(s) {sorted(unknown)}; known: {[f.name for f in fields(Limits)]}")
        self._closed = True  # until fully built, close() has nothing to undo
        if _parent is None and not _probe:
            why = unavailable_reason(sandbox_uid)
            if why is not None:
                raise SandboxUnavailable(f"cannot start a sandbox on this host: {why}")
        self.id = new_id()
        self._lock = threading.RLock()
        self._proc: subprocess.Popen | None = None
        self._probing = _probe
        self._closing = False  # set by close() before it kills anything: no new incarnation may start
        self._notices: list[str] = []  # for the next call's result (also logged when they arise)
        self._ready = False  # the live incarnation's holder reported its workspace whole: only then is it saved
        self.sandbox_uid = sandbox_uid
        if _parent is not None:
            self.store, snap_id, self.limits = _parent
            snap = self.store.load_snapshot(snap_id)
            self.layers, self.cwd, self.env = list(snap["layers"]), snap["cwd"], dict(snap["env"])
            self.ro_binds = dict(ro_binds or {})
        else:
            self.limits = replace(Limits(), **limits).validate()
            self.ro_binds = _check_binds(ro_binds or {})
            owner = (sandbox_uid, sandbox_uid) if os.getuid() == 0 else None
            parent = store_dir or tempfile.gettempdir()
            with _clean_lock:
                if parent not in _cleaned:  # once per process and folder: stores left by a killed host
                    _cleaned.add(parent)
                    remove_stale_stores(parent)
            root = tempfile.mkdtemp(prefix="openk3-sb-", dir=parent)
            self.store = LayerStore(root, owner)
            try:
                self.layers = [self.store.make_base(files, base_dir)]
            except BaseException:
                rmtree(root)
                raise
            self.cwd = "/workspace"
            self.env = {**BASE_ENV, **(env or {})}
        self.store.acquire()
        self.store.new_upper(self.id)
        self._closed = False
        # Whatever happens to this object (garbage collection, interpreter exit), its processes die and its
        # folders go.
        # the live process and the cgroup, shared with the finalizer (which must not hold self)
        self._proc_box: list = [None, None]
        self._finalizer = weakref.finalize(self, Sandbox._cleanup, self.store, self.id, self._proc_box)

    # ---- context manager ---------------------------------------------------------------------------------

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the contract ---------------------------------------------------------------------------------------

    def run(self, command: str, timeout: float | None = None) -> RunResult:
        """Run a shell command in the sandbox (cwd and exported env persist between calls)."""
        if not isinstance(command, str):
            raise ValueError(f"Sandbox.run: command must be a string, got {type(command).__name__}")
        if "\0" in command:
            raise ValueError("Sandbox.run: command contains a NUL byte (a shell command cannot carry one)")
        t = self.limits.timeout if timeout is None else timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= self.limits.max_timeout:
            raise ValueError(f"Sandbox.run: timeout must be in (0, {self.limits.max_timeout}], got {timeout!r}")
        with self._lock:
            t0 = time.monotonic()
            reply = self._request({"op": "run", "command": command, "timeout": float(t), "cwd": self.cwd,
                                   "env": self.env}, wait=t + 10)
            if "error" in reply or not _valid_run_reply(reply):
                err = reply.get("error") or "the sandbox agent sent a malformed reply"
                return RunResult(-1, "", "", bool(reply.get("timed_out")), time.monotonic() - t0, False, str(err),
                                 self._take_notices())
            if isinstance(reply.get("notice"), str):  # what the agent could not carry to the next call
                self._notice(reply["notice"][:NOTICE_CAP])
            self.cwd, self.env = reply["cwd"], self._checked_env(reply["env"])
            return RunResult(reply["exit_code"], reply["stdout"], reply["stderr"], reply["timed_out"],
                             float(reply["duration"]), bool(reply.get("truncated")), None, self._take_notices())

    def tool(self, name: str, args: dict, *, timeout: float = 60.0, **options) -> dict:
        """Call an in-sandbox tool (`toolbox.dispatch`): {"ok", "output", "data"} or {"ok": False, "error"}."""
        with self._lock:
            reply = self._request({"op": "tool", "name": name, "args": args, "options": options}, wait=timeout)
            if "ok" not in reply:
                reply = {"ok": False, "error": "the sandbox agent sent a malformed reply", "output": ""}
            notice = self._take_notices()
            return reply if notice is None else {**reply, "notice": notice}

    def snapshot(self) -> str:
        """Seal the current workspace (files, app state) + cwd/env; returns an id for `restore`/`fork`.
        Running processes are stopped: they are not part of the state."""
        with self._lock:
            self._check_open()
            # refuse before anything changes: one more layer must still fit the overlay's option page
            deeper = [new_id(), *self.layers]
            if len(deeper) > MAX_LAYERS or len(self.store.lowerdir(deeper)) > MAX_LOWERDIR:
                raise SandboxError(f"the sandbox has {len(self.layers)} stacked snapshots: no room for another "
                                   f"(at most {MAX_LAYERS}, and the layer paths must fit {MAX_LOWERDIR} bytes)")
            self._stop()
            self.layers = self.store.seal(self.id, self.layers)
            self.store.new_upper(self.id)
            return self.store.save_snapshot(self.layers, self.cwd, self.env)

    def restore(self, snapshot_id: str) -> None:
        """Go back to a snapshot of this sandbox family (processes stop; files, cwd and env come back)."""
        with self._lock:
            self._check_open()
            snap = self.store.load_snapshot(snapshot_id)
            self._stop(save=False)
            self.store.new_upper(self.id)
            self.layers, self.cwd, self.env = list(snap["layers"]), snap["cwd"], dict(snap["env"])

    def fork(self, n: int, *, ro_binds: dict[str, str] | None = None) -> list[Sandbox]:
        """`n` sandboxes starting from the current state, then diverging independently. `ro_binds` adds
        read-only host folders to the children only (a verifier's grader files, which the parent never sees)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"Sandbox.fork: n must be a positive int, got {n!r}")
        binds = {**self.ro_binds, **_check_binds(ro_binds or {})}
        snap = self.snapshot()
        kids = [Sandbox(_parent=(self.store, snap, self.limits), ro_binds=binds,
                        sandbox_uid=self.sandbox_uid) for _ in range(n)]
        for kid in kids:  # what this state lost is news to each child as well
            kid._notices = list(self._notices)
        return kids

    def close(self) -> None:
        """Kill everything the sandbox started and remove its folders (layers go with the last of a family).
        Safe to call from another thread while a `run` is in progress: that call returns with an error."""
        self._closing = True
        proc = self._proc
        if proc is not None:
            proc.kill()  # first, without the lock, so a call blocked on this sandbox ends now
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop(save=False)
            self._finalizer()  # runs _cleanup once

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pid(self) -> int | None:
        """Host pid of the sandbox's outer process (the holder of its mount namespace), while one runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def agent_pid(self) -> int | None:
        """Host pid of the in-sandbox agent (pid 1 of the sandbox's PID namespace), while it runs."""
        if self.pid is None:
            return None
        agents = [a for b in children(self.pid) for a in children(b)]
        return agents[0] if agents else None

    # ---- process management -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError("the sandbox is closed")

    def _start(self) -> None:
        from . import seccomp

        t = os.path.join(self.store.root, "u", self.id, "t")
        mnt = os.path.join(self.store.root, "m", self.id)
        etc = self._etc_stubs()
        lim = self.limits
        argv: list[str] = []
        cgroup = self._proc_box[1]
        # made at the first start, and again where it went (another host, misjudging us, removed it)
        if os.getuid() == 0 and (cgroup is None or not cgroup.intact()):
            if cgroup is not None:
                cgroup.remove()
            cgroup = self._proc_box[1] = Cgroup.create(group_name(self.id), pids_max=lim.max_processes,
                                                       memory_max=lim.total_memory_bytes)
        if cgroup is not None:  # join the sandbox's cgroups first, while still root, then exec the rest
            argv += ["/bin/sh", "-c", 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 1; shift; done; shift; '
                     'exec "$@"', "sh", *cgroup.procs_files, "--"]
        # per-uid RLIMIT_NPROC only where no cgroup counts this sandbox's own processes
        nproc = [f"--nproc={lim.max_processes}"] if cgroup is None else []
        # setpriv: the holder dies with the spawner thread (--pdeathsig), and as root everything runs unprivileged
        argv += ["setpriv", "--pdeathsig", "KILL"]
        if os.getuid() == 0:
            argv += [f"--reuid={self.sandbox_uid}", f"--regid={self.sandbox_uid}", "--clear-groups"]
        argv += ["--",
                 "prlimit", *nproc, f"--as={lim.memory_bytes}",
                 f"--cpu={int(lim.cpu_seconds)}", f"--fsize={lim.file_size_bytes}", f"--nofile={lim.open_files}",
                 "--core=0", "--",
                 "unshare", "--user", "--map-root-user", "--mount", "--propagation", "private", "--",
                 "/bin/sh", "-c", HOLDER, "sh", str(lim.workspace_bytes), str(lim.workspace_inodes), t,
                 self.store.saved_path(self.id), self.store.lowerdir(self.layers), mnt, PYTHON, FSTREE, "--"]
        bpf = seccomp.filter_bpf()
        sfd = os.memfd_create("openk3-seccomp")
        os.write(sfd, bpf)
        os.lseek(sfd, 0, os.SEEK_SET)
        argv += ["bwrap", "--unshare-all", "--unshare-user", "--uid", "1000", "--gid", "1000", "--disable-userns",
                 "--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv", "--as-pid-1",
                 "--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                argv += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                argv += ["--ro-bind", top, top]
        for path in ("/etc/alternatives", "/etc/ld.so.cache", "/etc/ssl/certs", "/etc/localtime"):
            argv += ["--ro-bind-try", path, path]
        argv += ["--ro-bind", os.path.join(etc, "passwd"), "/etc/passwd",
                 "--ro-bind", os.path.join(etc, "group"), "/etc/group",
                 # /dev is bwrap's own tmpfs: read-only, except a size-capped /dev/shm (tmpfs is RAM that
                 # no rlimit counts, so every writable tmpfs gets a size)
                 "--dev", "/dev", "--remount-ro", "/dev", "--size", str(lim.tmp_bytes), "--tmpfs", "/dev/shm",
                 "--proc", "/proc", "--size", str(lim.tmp_bytes), "--tmpfs", "/tmp",
                 "--bind", mnt, "/workspace"]
        for name in AGENT_FILES:
            src = os.path.join(AGENT_DIR, name)
            if os.path.exists(src):
                argv += ["--ro-bind", src, f"/opt/openk3/{name}"]
        for dest, src in self.ro_binds.items():
            argv += ["--ro-bind", src, dest]
        argv += ["--remount-ro", "/", "--seccomp", str(sfd), "--chdir", "/workspace",
                 PYTHON, "-I", "-S", "/opt/openk3/agentd.py"]
        log_path = os.path.join(self.store.root, "u", self.id, "log")
        with open(log_path, "wb") as log:
            try:
                self._proc = spawn(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                   env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, pass_fds=(sfd,), close_fds=True)
            finally:
                os.close(sfd)
        self._proc_box[0] = self._proc
        self._ready = False
        self._log_path = log_path

    def _etc_stubs(self) -> str:
        etc = os.path.join(self.store.root, "etc")
        if not os.path.exists(os.path.join(etc, "group")):
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "passwd"), "w") as f:
                f.write("agent:x:1000:1000:agent:/workspace:/bin/bash\nnobody:x:65534:65534::/:/usr/sbin/nologin\n")
            with open(os.path.join(etc, "group"), "w") as f:
                f.write("agent:x:1000:\nnogroup:x:65534:\n")
            for name in ("passwd", "group"):
                os.chmod(os.path.join(etc, name), 0o644)
        return etc

    def _stop(self, save: bool = True) -> None:
        """End the current incarnation. With `save`, the live upper is first copied out of its tmpfs to disk
        (`saved`), so the files written since the last snapshot survive into the next incarnation: only an
        upper its holder reported whole, and only once nothing sandboxed runs. Whatever cannot be saved is
        named in a notice and `saved` keeps the last good state; only the host's own disk failing raises."""
        proc, self._proc = self._proc, None
        self._proc_box[0] = None
        ready, self._ready = self._ready, False
        if proc is None:
            return
        try:
            if save and ready:
                self._save_live(proc)
        finally:
            kill(proc)  # whatever happened above, nothing of this incarnation outlives it

    def _save_live(self, proc: subprocess.Popen) -> None:
        lost = "the files written since the last save are lost; the sandbox goes on from the last saved state"
        if proc.poll() is not None:
            self._notice(f"the workspace's holder process ended unexpectedly: {lost}")
        elif not self._end_processes(proc):
            self._notice(f"the sandbox's processes could not be stopped, so the workspace was not saved: {lost}")
        else:
            self._save_upper(proc.pid, lost)

    @staticmethod
    def _end_processes(proc: subprocess.Popen) -> bool:
        """Stop everything sandboxed under the holder (which stays: its namespaces are the copy's way in);
        True once nothing is left. Killing the agent (pid 1 of the sandbox's PID namespace) takes every
        process inside with it; bwrap then exits and the holder, left alone, closes our pipe: EOF."""
        for pid in children(proc.pid):
            for agent in children(pid):
                signal_pid(agent, 9)
        if drain_to_eof(proc.stdout, 10.0) and not descendants(proc.pid):
            return True
        # no EOF in time (or processes left without the pipe): kill every process below the holder
        return kill_descendants(proc.pid, 5.0) and drain_to_eof(proc.stdout, 5.0)

    def _save_upper(self, holder: int, lost: str) -> None:
        """`upper.save`, as the namespace's root of the holder; raises SandboxError only for the host's disk."""
        src = os.path.join(self.store.root, "u", self.id, "t", "up")
        saved = self.store.saved_path(self.id)
        try:
            problems = upper.save(holder, src, saved, self.limits.copy_timeout)
        except upper.CopyFailed as e:
            if e.host:
                raise SandboxError(f"could not save the sandbox's workspace to {saved}: {e}") from None
            self._notice(f"the workspace could not be saved ({e}): {lost}")
            return
        if problems:
            self._notice("the workspace was saved without: " + "; ".join(problems))

    def _notice(self, text: str) -> None:
        text = printable(text)  # names in it come from sandboxed code: no line of it may forge a log line
        log.warning("sandbox %s: %s", self.id, text)
        self._notices.append(text)

    def _checked_env(self, env: dict[str, str]) -> dict[str, str]:
        """The exported environment as the agent reported it, less what no shell could take back: names
        that are not shell identifiers (the state pipe is the command's to write), values with a NUL."""
        bad = {k for k, v in env.items() if not ENV_NAME.fullmatch(k) or "\0" in v}
        if bad:
            names = ", ".join(repr(k[:60]) for k in sorted(bad)[:5]) + (
                f" and {len(bad) - 5} more" if len(bad) > 5 else "")
            self._notice(f"not kept for the next call: exported name(s) {names}: not a shell identifier "
                         "(or a value holding a NUL byte)")
        return {k: v for k, v in env.items() if k not in bad} if bad else env

    def _take_notices(self) -> str | None:
        notes, self._notices = self._notices, []
        return "; ".join(notes) if notes else None

    def _request(self, req: dict, wait: float) -> dict:
        self._check_open()
        if self._proc is None or self._proc.poll() is not None:
            if self._closing:
                raise SandboxError("the sandbox is closed")
            self._proc = None
            self._start()
            if self._closing:  # close() began while this incarnation started: it must not outlive close()
                self._stop(save=False)
                raise SandboxError("the sandbox is closed")
            failed = self._greeted()
            if failed is not None:
                return failed
        proc = self._proc
        try:
            proc.stdin.write((json.dumps(req) + "\n").encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return self._died(proc, "the sandbox agent is not running")
        try:
            line = read_line(proc.stdout, wait)
        except BaseException:
            # interrupted (Ctrl-C, a signal handler raising): the reply still in flight would answer the next
            # request, so this incarnation goes (its files are kept)
            self._stop(save=True)
            raise
        if line is None:
            return self._died(proc, f"no reply from the sandbox agent within {wait:.0f} s", timed_out=True)
        if not line:
            return self._died(proc, "the sandbox agent died (its process tree was killed from inside, or it "
                                    "failed to start)")
        try:
            reply = json.loads(line)
        except ValueError:
            return self._died(proc, "the sandbox agent sent a malformed reply")
        if not isinstance(reply, dict):
            return self._died(proc, "the sandbox agent sent a malformed reply")
        return reply

    def _greeted(self) -> dict | None:
        """Wait for the new holder's greeting (`proc.HOLDER`): the workspace is whole and mounted. Restoring
        the files written since the last snapshot is part of it, so the wait is the copy's, not the call's.
        None when ready, else the call's error reply (`saved` untouched: this incarnation is never saved)."""
        proc, wait = self._proc, self.limits.copy_timeout
        try:
            line = read_line(proc.stdout, wait)
        except BaseException:
            self._stop(save=False)
            raise
        kept = "they are kept on disk and the next call restores them again; restore() a snapshot to go on "\
               "without them"
        if line is None:
            self._notice(f"restoring the files written since the last snapshot took longer than {wait:g} s "
                         f"(Limits.copy_timeout): {kept}")
            return self._died(proc, f"the sandbox's workspace was not restored within {wait:g} s", timed_out=True)
        if not line:
            return self._died(proc, "the sandbox agent died (its process tree was killed from inside, or it "
                                    "failed to start)")
        kind, items = upper.read_greeting(line)
        if kind == "failed":
            why = "; ".join(items) or "no reason given"
            self._notice(f"the files written since the last snapshot could not be restored ({why}): {kept}")
            return self._died(proc, "the sandbox's workspace could not be restored")
        if kind != "ready":
            return self._died(proc, "the sandbox's holder sent a malformed greeting")
        self._ready = True
        if items:
            self._notice("the files written since the last snapshot were restored without: " + "; ".join(items))
        return None

    def _died(self, proc: subprocess.Popen, why: str, timed_out: bool = False) -> dict:
        """The agent is gone or untrustworthy: tear the incarnation down, keeping its files (the next call
        starts afresh). Never raises for the sandbox's sake: a save the host's disk refused is a notice here."""
        try:
            self._stop(save=True)
        except SandboxError as e:
            self._notice(str(e))
        detail = ""
        try:
            with open(self._log_path, "rb") as f:  # the launcher's stderr, and the agent's: escaped line by line
                text = f.read()[-2000:].decode("utf-8", "replace").strip()
                detail = "\n".join(printable(line) for line in text.splitlines())
        except OSError:
            pass
        if detail and "failed to start" in why:
            why += f": {detail}"
        if self._probing and detail:  # the availability probe: the launcher's own complaint names the cause
            raise SandboxUnavailable(f"cannot start a sandbox on this host: {detail}")
        if detail and not why.endswith(detail):
            why += f" (launcher: {detail.splitlines()[-1][:300]})"
        return {"ok": False, "error": why, "timed_out": timed_out}

    @staticmethod
    def _cleanup(store: LayerStore, sandbox_id: str, proc_box: list) -> None:
        if proc_box[0] is not None:
            kill(proc_box[0])
            proc_box[0] = None
        if proc_box[1] is not None:
            proc_box[1].remove()
            proc_box[1] = None
        store.drop_upper(sandbox_id)
        store.release()


def _valid_run_reply(r: dict) -> bool:
    return (isinstance(r.get("exit_code"), int) and isinstance(r.get("stdout"), str)
            and isinstance(r.get("stderr"), str) and isinstance(r.get("timed_out"), bool)
            and isinstance(r.get("duration"), (int, float)) and isinstance(r.get("cwd"), str)
            and r["cwd"].startswith("/") and isinstance(r.get("env"), dict) and len(r["env"]) < 4096
            and all(isinstance(k, str) and isinstance(v, str) for k, v in r["env"].items()))


def _check_binds(binds: dict[str, str]) -> dict[str, str]:
    out = {}
    for dest, src in binds.items():
        if not isinstance(dest, str) or not dest.startswith("/") or dest.rstrip("/") in (
                "", "/usr", "/workspace", "/proc", "/dev", "/tmp", "/etc", "/opt/openk3"):
            raise ValueError(f"Sandbox(ro_binds=): destination {dest!r} must be a new absolute path (e.g. /task)")
        if not os.path.exists(src):
            raise ValueError(f"Sandbox(ro_binds=): source {src!r} for {dest!r} does not exist")
        out[dest] = os.path.abspath(src)
    return out
