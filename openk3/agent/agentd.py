"""The in-sandbox agent: the first process inside every sandbox, speaking JSON lines over stdin/stdout.

It runs under the system `/usr/bin/python3` inside the namespaces, so it imports only the stdlib and the
`toolbox` module bound beside it. The host sends one request per line and reads one reply per line:

    {"op": "run", "command": str, "timeout": float, "cwd": str, "env": {str: str}}
        -> {"ok": true, "exit_code": int, "stdout": str, "stderr": str, "timed_out": bool,
            "duration": float, "cwd": str, "env": {...}, "truncated": bool[, "notice": str]}
    {"op": "tool", "name": str, "args": {...}, "options": {...}}  -> toolbox.dispatch's dict
    {"op": "ping"} -> {"ok": true, "pid": int}
    {"op": "exit"} -> (no reply; every process of the sandbox is killed)

Why commands run here and not from the host: the working directory, the files the command sees and the
processes it starts all live in the sandbox's namespaces; the host only ever sees this agent's replies, and
treats them as untrusted (size-bounded, schema-checked), because sandboxed code can kill or impersonate it.

Shell state persists as metadata, not as a live shell: each command is a fresh `bash -c` in its own process
group, started in the recorded cwd with the recorded exported environment; an EXIT trap writes the final
`$PWD` and the exported variables and functions to a private pipe, with shell builtins only (an external
`env` could not even start once one variable is too big to pass to a program). So `cd` and `export` carry
over between calls, and the state is plain data that a snapshot can store. What cannot be carried (a
variable past Linux's per-string limit, an environment past ENV_CAP, an exported array, a cwd past
PATH_MAX) is named in the reply's `notice`, never dropped silently. Anything still running when the command
returns (daemons, `&` jobs) is killed before the reply: nothing outlives its call.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import stat
import subprocess
import sys
import time

OUTPUT_CAP = 50_000  # characters of stdout + stderr kept per call (head and tail), as kimi-cli
LINE_CAP = 2_000  # characters per line
READ_CAP = 8 << 20  # bytes read per stream before the rest is drained unread
REPLY_CAP = 12 << 20  # bytes of one JSON reply (the host accepts 16 MiB): bigger results become an error reply
KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL of a timed-out command
# What the next call's execve can take: one NAME=value string at most MAX_ARG_STRLEN (32 pages) with its NUL;
# all of them, with the command, within a quarter of the stack limit (2 MiB by default): room is left for it.
VAR_CAP = 32 * 4096 - 1
ENV_CAP = 1 << 20
ENV_COUNT_CAP = 4000  # variables (the host takes fewer than 4096)
PATH_CAP = 4095  # PATH_MAX less its NUL: a deeper cwd cannot be entered by name

# The EXIT trap runs however the command ends (exit N, end of script, set -e): it reports where the shell
# stands, NUL-separated: $PWD, NAME=value per exported variable, BASH_FUNC_name%%=() {...} per exported
# function (env's form), @NAME per exported array (no program can receive one: it is named, not carried).
# Builtins only, so no exec can fail on a huge variable, and one fork for the names (each call pays for it);
# `|| :` keeps set -e from cutting it short. @STATE@ is the state pipe: the command
# inherits it and may write its own state there, which is harmless (it could `cd` and `export` anyway). The
# command itself is read from the memfd @COMMAND@ (by `read`: `$(< file)` would fork), not passed as an
# argument: Linux refuses to start a program with an argument over 128 KiB.
# All on the first line, so that the command's own line 1 is "line 2" in bash's messages, as it always was.
_WRAPPER = (
    r"""__openk3_state() { builtin printf '%s\0' "$PWD"; """
    r"""builtin mapfile -t __openk3_l < <(builtin compgen -e; builtin declare -F); """
    r"""for __openk3_n in "${__openk3_l[@]}"; do """
    r"""if [[ $__openk3_n == "declare -"* ]]; then """  # a function: "declare -f[x] name"
    r"""__openk3_f=${__openk3_n#declare -} __openk3_n=${__openk3_n##* }; """
    r"""[[ ${__openk3_f%% *} == *x* ]] || continue; """
    r"""__openk3_d=$(builtin declare -f -- "$__openk3_n"); """
    r"""builtin printf 'BASH_FUNC_%s%%%%=() %s\0' "$__openk3_n" "${__openk3_d#*$'\n'}"; """
    r"""elif [[ ${!__openk3_n@a} == *[aA]* ]]; then builtin printf '@%s\0' "$__openk3_n"; """  # an array
    r"""elif [[ -v $__openk3_n ]]; then builtin printf '%s=%s\0' "$__openk3_n" "${!__openk3_n}"; fi; """
    r"""done; }; """
    r"""trap '__openk3_rc=$?; { __openk3_state; } >&@STATE@ 2>/dev/null || :; exit $__openk3_rc' EXIT; """
    r"""IFS= read -r -d '' __openk3_c < /dev/fd/@COMMAND@ || :""" "\n"
    r"""eval "$__openk3_c" """ "\n"
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


def start_dir(cwd: str) -> tuple[str, str | None]:
    """Where a command starts: the recorded cwd; else /workspace (the folder was removed, or a restore went
    back before it existed), or / when the code made even /workspace unenterable (chmod 000). A folder that
    is there but cannot be entered is named in a notice: a call must never fail for where it starts."""
    why = None
    try:
        if not stat.S_ISDIR(os.stat(cwd).st_mode):
            why = "not a folder"
        elif not os.access(cwd, os.X_OK):
            why = "permission denied"
        else:
            return cwd, None
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as e:
        why = e.strerror
    start = "/workspace" if os.access("/workspace", os.X_OK) else "/"
    if why is None and start == "/workspace":
        return start, None
    return start, f"the working directory {cwd} cannot be entered ({why or 'removed'}): this call starts in {start}"


def run(command: str, timeout: float, cwd: str, env: dict[str, str]) -> dict:
    cwd, moved = start_dir(cwd)
    state_r, state_w = os.pipe()
    cmd_fd = os.memfd_create("openk3-command")
    data = command.encode("utf-8", "surrogateescape")
    while data:
        data = data[os.write(cmd_fd, data):]
    wrapper = _WRAPPER.replace("@STATE@", str(state_w)).replace("@COMMAND@", str(cmd_fd))
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            ["/bin/bash", "-c", wrapper, "bash"], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, pass_fds=(state_w, cmd_fd),
        )
    except BaseException:
        os.close(state_r)
        raise
    finally:
        os.close(state_w)
        os.close(cmd_fd)
    state_f = os.fdopen(state_r, "rb", buffering=0)
    out, err, state = bytearray(), bytearray(), ShellState()
    sinks = {proc.stdout.fileno(): _capped(out), proc.stderr.fileno(): _capped(err), state_r: state.feed}
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
            _read_into(key.fileobj, sinks, sel)
    # The command is done: whatever it left running (daemons, `&` jobs) holds pipes open; kill it all,
    # then drain what was written.
    kill_others()
    for key in list(sel.get_map().values()):
        while _read_into(key.fileobj, sinks, sel):
            pass
    sel.close()
    state.finish()
    state_f.close()
    new_cwd, new_env = (cwd, env) if state.cwd is None else (state.cwd, state.env)  # no report: keep the old
    rc = proc.returncode
    stdout, t1 = _cap_text(bytes(out).decode("utf-8", "replace"))
    stderr, t2 = _cap_text(bytes(err).decode("utf-8", "replace"))
    reply = {
        "ok": True, "exit_code": rc if rc >= 0 else 128 - rc, "stdout": stdout, "stderr": stderr,
        "timed_out": timed_out, "duration": time.monotonic() - t0, "cwd": new_cwd, "env": new_env,
        "truncated": t1 or t2,
    }
    notices = [moved] if moved else []
    if notices + state.notices:
        reply["notice"] = "; ".join(notices + state.notices)
    return reply


class ShellState:
    """The EXIT trap's report, parsed as it streams in: `cwd` (None until it came whole) and `env`, with
    what could not be kept for the next call named in `notices`. Memory stays bounded however big the
    report: an item is buffered only up to VAR_CAP + 1 bytes, and beyond the caps only names are kept."""

    def __init__(self) -> None:
        self.cwd: str | None = None
        self.env: dict[str, str] = {}
        self.size = 0  # bytes of the kept variables, each with its NUL
        self.dropped = {"big": [], "total": [], "count": [], "array": []}  # reason -> the first 5 it dropped
        self.dropped_count = dict.fromkeys(self.dropped, 0)
        self.notices: list[str] = []
        self._item, self._len = bytearray(), 0

    def feed(self, chunk: bytes) -> None:
        start = 0
        while True:
            end = chunk.find(b"\0", start)
            part = chunk[start:] if end < 0 else chunk[start:end]
            if len(self._item) <= VAR_CAP:
                self._item += part[: VAR_CAP + 1 - len(self._item)]
            self._len += len(part)
            if end < 0:
                return
            self._take(bytes(self._item), self._len)
            self._item, self._len = bytearray(), 0
            start = end + 1

    def _take(self, item: bytes, size: int) -> None:
        if self.cwd is None:
            self.cwd = item.decode("utf-8", "replace")
            if size > PATH_CAP:
                self.cwd = "/workspace"
                self.notices.append(f"the working directory ({size} bytes) is longer than PATH_MAX ({PATH_CAP} "
                                    "bytes) and cannot be entered by name: the next call starts in /workspace")
            return
        name, eq, value = item.partition(b"=")
        if not eq and size <= VAR_CAP:
            if name.startswith(b"@") and len(name) > 1:
                self._drop("array", name[1:].decode("utf-8", "replace"), None)
            return  # else not a variable (the command wrote to the state pipe itself)
        key = name.decode("utf-8", "replace")  # whole: a name is carried as it is or not at all
        if key in ("PWD", "OLDPWD", "SHLVL", "_"):
            return
        reason = "big" if size > VAR_CAP else "count" if len(self.env) >= ENV_COUNT_CAP else (
            "total" if self.size + size + 1 > ENV_CAP else None)
        if reason is not None:
            self._drop(reason, key, size)
            return
        self.env[key] = value.decode("utf-8", "replace")
        self.size += size + 1

    def _drop(self, reason: str, key: str, size: int | None) -> None:
        self.dropped_count[reason] += 1
        if len(self.dropped[reason]) < 5:
            short = key if len(key) <= 60 else f"{key[:28]}...{key[-28:]} ({len(key)} characters)"
            self.dropped[reason].append(short if size is None else f"{short} ({size} bytes)")

    def finish(self) -> None:
        """Turn what was dropped into notices (called once the pipe is at EOF)."""
        why = {"big": f"one NAME=value may be at most {VAR_CAP} bytes (Linux's MAX_ARG_STRLEN: no program "
                      "starts with a longer one); keep large data in a file",
               "total": f"the exported environment may total at most {ENV_CAP} bytes",
               "count": f"at most {ENV_COUNT_CAP} exported variables are kept",
               "array": "bash passes no array to a program (the environment holds strings): declare it in each "
                        "call, or keep it in a file"}
        for reason, items in self.dropped.items():
            if items:
                left = self.dropped_count[reason] - len(items)
                more = f" and {left} more" if left else ""
                what = "array" if reason == "array" else "variable"
                self.notices.append(f"not kept for the next call: exported {what} {', '.join(items)}{more}: "
                                    f"{why[reason]}")


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _capped(buf: bytearray):
    """A sink keeping the first READ_CAP bytes of a stream; the rest is read and dropped (never block the
    writer)."""

    def sink(chunk: bytes) -> None:
        if len(buf) < READ_CAP:
            buf.extend(chunk[: READ_CAP - len(buf)])

    return sink


def _read_into(f, sinks: dict, sel: selectors.BaseSelector) -> bool:
    """Read one chunk into the stream's sink; unregister at EOF."""
    fd = f.fileno()
    try:
        chunk = os.read(fd, 1 << 16)
    except BlockingIOError:
        return False
    if not chunk:
        sel.unregister(f)
        return False
    sinks[fd](chunk)
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
