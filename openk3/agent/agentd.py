"""The in-sandbox agent: the first process inside every sandbox, speaking JSON lines over stdin/stdout.

It runs under the system `/usr/bin/python3` inside the namespaces, so it imports only the stdlib and the
`toolbox` module bound beside it. The host sends one request per line and reads one reply per line:

    {"op": "run", "command": str, "timeout": float, "cwd": str, "env": {str: str}}
        -> {"ok": true, "exit_code": int, "stdout": str, "stderr": str, "timed_out": bool,
            "duration": float, "cwd": str, "env": {...}, "truncated": bool}
    {"op": "tool", "name": str, "args": {...}, "options": {...}}  -> toolbox.dispatch's dict
    {"op": "ping"} -> {"ok": true, "pid": int}
    {"op": "exit"} -> (no reply; every process of the sandbox is killed)

Why commands run here and not from the host: the working directory, the files the command sees and the
processes it starts all live in the sandbox's namespaces; the host only ever sees this agent's replies, and
treats them as untrusted (size-bounded, schema-checked), because sandboxed code can kill or impersonate it.

Shell state persists as metadata, not as a live shell: each command is a fresh `bash -c` in its own process
group, started in the recorded cwd with the recorded exported environment; an EXIT trap writes the final
`$PWD` and `env -0` to a private pipe. So `cd` and `export` carry over between calls, and the state is plain
data that a snapshot can store. Anything still running when the command returns (daemons, `&` jobs) is
killed before the reply: nothing outlives its call.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time

OUTPUT_CAP = 50_000  # characters of stdout + stderr kept per call (head and tail), as kimi-cli
LINE_CAP = 2_000  # characters per line
READ_CAP = 8 << 20  # bytes read per stream before the rest is drained unread
REPLY_CAP = 12 << 20  # bytes of one JSON reply (the host accepts 16 MiB): bigger results become an error reply
KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL of a timed-out command

# The EXIT trap runs however the command ends (exit N, end of script, set -e): it reports where the shell
# stands. $1 is the user's command; FD is the state pipe. The command inherits it and may write its own
# state there, which is harmless: it could `cd` and `export` anyway.
_WRAPPER = (
    'trap \'__openk3_rc=$?; { printf "%s\\0" "$PWD"; env -0; } >&FD 2>/dev/null; exit $__openk3_rc\' EXIT\n'
    'eval "$1"\n'
)


def _cap_text(text: str) -> tuple[str, bool]:
    """Cap line lengths then the total (head and tail kept), marking what was cut."""
    truncated = False
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if len(line) > LINE_CAP:
            lines[i] = line[:LINE_CAP] + f"[...truncated {len(line) - LINE_CAP} chars]"
            truncated = True
    text = "\n".join(lines)
    if len(text) > OUTPUT_CAP:
        half = OUTPUT_CAP // 2
        cut = len(text) - 2 * half
        text = text[:half] + f"\n[...truncated {cut} chars]\n" + text[-half:]
        truncated = True
    return text, truncated


def _other_pids() -> list[int]:
    """Every process of the sandbox except this agent and the namespace's init (pid 1)."""
    me = os.getpid()
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            pid = int(name)
            if pid not in (1, me):
                pids.append(pid)
    return pids


def kill_others() -> None:
    """SIGKILL everything else in the sandbox, then reap: stragglers must not outlive their call."""
    for _ in range(50):
        pids = _other_pids()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap()
        time.sleep(0.002)


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def run(command: str, timeout: float, cwd: str, env: dict[str, str]) -> dict:
    if not os.path.isdir(cwd):  # the directory was removed, or a restore went back before it existed
        cwd = "/workspace"
    state_r, state_w = os.pipe()
    os.set_inheritable(state_w, True)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        ["/bin/bash", "-c", _WRAPPER.replace("FD", str(state_w)), "bash", command],
        cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True, pass_fds=(state_w,),
    )
    os.close(state_w)
    state_f = os.fdopen(state_r, "rb", buffering=0)
    bufs: dict[int, bytearray] = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray(),
                                  state_r: bytearray()}
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    # the state pipe is read while the command runs too: a big exported environment would otherwise fill
    # the pipe and block the EXIT trap, and the command would never end
    sel.register(state_f, selectors.EVENT_READ)
    timed_out = False
    deadline = t0 + timeout
    term_at = None
    while True:
        now = time.monotonic()
        if proc.poll() is not None:
            break
        if now >= deadline and term_at is None:
            timed_out = True
            term_at = now
            _signal_group(proc.pid, signal.SIGTERM)
        if term_at is not None and now >= term_at + KILL_GRACE:
            _signal_group(proc.pid, signal.SIGKILL)
        for key, _ in sel.select(timeout=0.05):
            _read_into(key.fileobj, bufs, sel)
    # The command is done: whatever it left running (daemons, `&` jobs) holds pipes open; kill it all,
    # then drain what was written.
    kill_others()
    for key in list(sel.get_map().values()):
        while _read_into(key.fileobj, bufs, sel):
            pass
    sel.close()
    state = bufs[state_r]
    state_f.close()
    new_cwd, new_env = cwd, env
    parts = bytes(state).split(b"\0")
    if len(parts) >= 2 and len(state) < READ_CAP:  # a state cut at the cap is not trusted: keep the old one
        new_cwd = parts[0].decode("utf-8", "replace")
        new_env = {}
        for item in parts[1:]:
            if b"=" in item:
                k, v = item.split(b"=", 1)
                new_env[k.decode("utf-8", "replace")] = v.decode("utf-8", "replace")
        for k in ("PWD", "OLDPWD", "SHLVL", "_"):
            new_env.pop(k, None)
    rc = proc.returncode
    stdout, t1 = _cap_text(bytes(bufs[proc.stdout.fileno()]).decode("utf-8", "replace"))
    stderr, t2 = _cap_text(bytes(bufs[proc.stderr.fileno()]).decode("utf-8", "replace"))
    return {
        "ok": True, "exit_code": rc if rc >= 0 else 128 - rc, "stdout": stdout, "stderr": stderr,
        "timed_out": timed_out, "duration": time.monotonic() - t0, "cwd": new_cwd, "env": new_env,
        "truncated": t1 or t2,
    }


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _read_into(f, bufs: dict[int, bytearray], sel: selectors.BaseSelector) -> bool:
    """Read one chunk; unregister at EOF. Bytes past READ_CAP are read and dropped (never block the writer)."""
    fd = f.fileno()
    try:
        chunk = os.read(fd, 1 << 16)
    except BlockingIOError:
        return False
    if not chunk:
        sel.unregister(f)
        return False
    buf = bufs[fd]
    if len(buf) < READ_CAP:
        buf += chunk[: READ_CAP - len(buf)]
    return True


def _tool(req: dict) -> dict:
    import toolbox  # bound beside this file; imported lazily so `run` never pays for it

    options = req.get("options") or {}
    return toolbox.dispatch(req.get("name"), req.get("args") or {}, root="/workspace", **options)


def _undumpable() -> None:
    """PR_SET_DUMPABLE 0: commands run as the same uid, and could otherwise open /proc/<agent>/fd/1 to forge
    replies, or /proc/<agent>/mem. (Their own children become dumpable again at execve: this covers the agent
    only.)"""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _clean(value):
    """Strings as valid UTF-8: file names and outputs can carry undecodable bytes (lone surrogates after
    Python's surrogateescape), which would break any strict UTF-8 consumer downstream."""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _encode(reply: dict) -> str:
    text = json.dumps(_clean(reply))
    if len(text) > REPLY_CAP:
        text = json.dumps({"ok": False, "output": "", "data": {},
                           "error": f"the result is too large to return ({len(text)} bytes of JSON; the limit is "
                                    f"{REPLY_CAP}): ask for less (fewer rows, a smaller range)"})
    return text


def _ignore_signals() -> None:
    """As pid 1 of its namespace the agent gets only signals it handles. Python handles SIGINT (and would
    raise KeyboardInterrupt), so every catchable signal gets a handler that does nothing: `kill -INT 1` from
    inside cannot end the agent. Handlers, unlike SIG_IGN, are reset at exec, so commands get the defaults."""
    import signal as sig

    for s in (sig.SIGINT, sig.SIGTERM, sig.SIGHUP, sig.SIGQUIT, sig.SIGUSR1, sig.SIGUSR2, sig.SIGALRM,
              sig.SIGPIPE, sig.SIGTSTP, sig.SIGTTIN, sig.SIGTTOU, sig.SIGVTALRM, sig.SIGPROF, sig.SIGWINCH):
        sig.signal(s, lambda *_: None)


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _undumpable()
    _ignore_signals()
    out = sys.stdout
    for line in sys.stdin:
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "exit":
                kill_others()
                return
            if op == "ping":
                reply = {"ok": True, "pid": os.getpid()}
            elif op == "run":
                reply = run(str(req["command"]), float(req["timeout"]), str(req["cwd"]), dict(req["env"]))
            elif op == "tool":
                reply = _tool(req)
            else:
                reply = {"ok": False, "error": f"unknown op {op!r}"}
        except Exception as e:  # a bad request or a tool bug must not kill the agent
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out.write(_encode(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
