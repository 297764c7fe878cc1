"""The sandbox contract (run / snapshot / restore / fork / close) and the state it keeps.

The escape and abuse list (shared/context/next-agents-serving.md §2) is in test_agent_escape.py.
"""

from __future__ import annotations

import hashlib
import os
import threading

import pytest

from openk3.agent import Sandbox, SandboxError, SandboxUnavailable, unavailable_reason
from openk3.agent import sandbox as sandbox_mod
from openk3.agent.proc import children

WHY = unavailable_reason()
needs_sandbox = pytest.mark.skipif(WHY is not None, reason=f"no sandbox on this host: {WHY}")


@pytest.fixture
def sb():
    with Sandbox(files={"a.txt": "hello\n", "src/m.py": "X = 1\n"}) as s:
        yield s


@needs_sandbox
def test_run_persists_cwd_and_exported_env_but_not_processes(sb):
    r = sb.run("cat a.txt && id -u && pwd")
    assert (r.exit_code, r.stdout, r.timed_out, r.error) == (0, "hello\n1000\n/workspace\n", False, None)
    assert sb.run("mkdir -p d/e && cd d/e && export FOO=bar && LOCAL=x && echo out && echo err >&2").stderr == "err\n"
    r = sb.run('pwd; echo "$FOO|$LOCAL"')
    assert r.stdout == "/workspace/d/e\nbar|\n"  # exported variables persist, shell variables do not
    assert sb.run("exit 7").exit_code == 7
    assert sb.run("cd /nonexistent").exit_code != 0 and sb.run("pwd").stdout == "/workspace/d/e\n"


@needs_sandbox
def test_timeout_kills_the_command_and_the_sandbox_stays_usable(sb):
    r = sb.run("echo started; sleep 30", timeout=0.5)
    assert r.timed_out and r.stdout == "started\n" and r.duration < 5
    assert sb.run("echo fine").stdout == "fine\n"


@needs_sandbox
def test_nothing_outlives_its_call(sb):
    r = sb.run("setsid nohup sleep 300 >/dev/null 2>&1 & (trap '' TERM HUP; sleep 300) & echo spawned")
    assert r.stdout == "spawned\n"
    procs = sb.run("ls /proc | grep -E '^[0-9]+$' | wc -l").stdout.strip()
    # bwrap's init, the agent, bash, ls, grep, wc: nothing left from the previous call
    assert int(procs) <= 6, procs


@needs_sandbox
def test_snapshot_and_restore_bring_back_files_and_shell_state(sb):
    sb.run("echo v1 > state.txt && mkdir w && cd w && export STAGE=one")
    snap = sb.snapshot()
    sb.run("echo v2 > ../state.txt && rm ../a.txt && cd / && export STAGE=two && rm -rf /workspace/src")
    assert sb.run("cat /workspace/state.txt; ls /workspace").stdout == "v2\nstate.txt\nw\n"
    sb.restore(snap)
    assert sb.run('cat ../state.txt; pwd; echo $STAGE; ls /workspace; cat /workspace/src/m.py').stdout == (
        "v1\n/workspace/w\none\na.txt\nsrc\nstate.txt\nw\nX = 1\n")
    sb.restore(snap)  # a snapshot can be restored any number of times
    assert sb.run("cat /workspace/state.txt").stdout == "v1\n"
    with pytest.raises(ValueError, match="unknown snapshot"):
        sb.restore("nope")
    with pytest.raises(ValueError, match="unknown snapshot"):
        sb.restore("../../etc")


@needs_sandbox
def test_fork_children_start_equal_then_diverge_independently(sb):
    sb.run("echo base > shared.txt && export WHO=parent")
    kids = sb.fork(3)
    try:
        for i, k in enumerate(kids):
            assert k.run("cat shared.txt; echo $WHO").stdout == "base\nparent\n"
            k.run(f"echo child{i} > shared.txt && echo {i} > only{i} && rm a.txt")
        for i, k in enumerate(kids):
            assert k.run("cat shared.txt; ls").stdout == f"child{i}\nonly{i}\nshared.txt\nsrc\n"
        assert sb.run("cat shared.txt; ls").stdout == "base\na.txt\nshared.txt\nsrc\n"
        grandkids = kids[0].fork(2)
        grandkids[0].run("echo g > shared.txt")
        assert grandkids[1].run("cat shared.txt").stdout == "child0\n"
        for g in grandkids:
            g.close()
    finally:
        for k in kids:
            k.close()
    assert sb.run("cat shared.txt").stdout == "base\n"  # the family's layers outlive the children


@needs_sandbox
def test_base_layer_is_never_written(sb):
    base = os.path.join(sb.store.layer_path("base"), "a.txt")
    before = hashlib.sha256(open(base, "rb").read()).hexdigest()
    sb.run("echo more >> a.txt")  # copy-up into this sandbox's upper
    kid = sb.fork(1)[0]
    kid.run("echo kid >> a.txt")
    kid.close()
    assert hashlib.sha256(open(base, "rb").read()).hexdigest() == before
    assert sb.run("cat a.txt").stdout == "hello\nmore\n"


@needs_sandbox
def test_close_kills_everything_and_removes_the_store():
    sb = Sandbox()
    sb.run("sleep 300 &")  # killed at the end of the call already; start a long call in a thread
    root = sb.store.root
    t = threading.Thread(target=sb.run, args=("sleep 300",), daemon=True)
    t.start()
    for _ in range(500):  # until the call runs (its sleep is a process inside)
        agent = sb.agent_pid()
        if agent is not None and any(children(c) for c in children(agent)):
            break
        threading.Event().wait(0.01)
    pid = sb.pid
    assert pid is not None
    sb.close()  # from another thread than the call in progress: the call ends at once with an error
    t.join(10)
    assert not t.is_alive()
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
    assert not os.path.exists(root)
    assert not _host_procs_mentioning(root)
    with pytest.raises(SandboxError, match="closed"):
        sb.run("true")
    sb.close()  # idempotent


@needs_sandbox
def test_garbage_collected_sandbox_cleans_up():
    sb = Sandbox()
    sb.run("true")
    root, pid = sb.store.root, sb.pid
    del sb
    import gc

    gc.collect()
    assert not os.path.exists(root)
    assert not os.path.exists(f"/proc/{pid}")


@needs_sandbox
def test_kill_everything_from_inside_leaves_the_agent_and_the_host(sb):
    sb.run("echo keep > kept.txt")
    r = sb.run("sleep 100 & kill -9 -1; wait; echo caller survives")  # Linux spares the caller
    # The agent is the PID namespace's init (bwrap --as-pid-1): signals from inside cannot kill it.
    assert r.error is None and r.exit_code == 0 and r.stdout == "caller survives\n"
    assert sb.run("cat kept.txt").stdout == "keep\n"
    assert sb.run("kill -9 1; echo $?").stdout == "0\n"  # sent, and ignored by the namespace's init
    assert sb.run("echo alive").stdout == "alive\n"


@needs_sandbox
def test_agent_death_is_reported_and_the_sandbox_recovers(sb):
    sb.run("echo keep > kept.txt")
    pid = sb.pid
    # the agent dies from outside during a call (the host's OOM killer, an operator)
    threading.Timer(0.5, os.kill, (sb.agent_pid(), 9)).start()
    r = sb.run("sleep 20")
    assert r.exit_code == -1 and "agent" in r.error and r.duration < 10
    assert sb.run("cat kept.txt").stdout == "keep\n"  # files live in the layers, not in the processes
    assert sb.pid != pid  # a fresh incarnation


@needs_sandbox
def test_forged_agent_replies_are_protocol_errors_not_host_exceptions(sb):
    # Commands run as the agent's uid; the agent is not dumpable, so its pipe to the host (/proc/<agent>/fd/1)
    # and its memory cannot be opened to forge replies: the best a command can do is kill it (reported).
    # The agent is pid 1 (there is no other unfiltered process inside to attack).
    assert sb.run("cat /proc/1/cmdline | tr '\\0' ' '").stdout.startswith("/usr/bin/python3 -I -S /opt/openk3/agentd")
    r = sb.run("echo '{\"ok\": true}' > /proc/1/fd/1; head -c1 /proc/1/mem; cat /proc/1/environ; echo done")
    assert r.error is None and r.stdout == "done\n" and r.stderr.count("Permission denied") == 3, r
    assert sb.run("echo ok").stdout == "ok\n"


@needs_sandbox
def test_files_and_base_dir_and_bad_arguments(tmp_path):
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "f.txt").write_text("from dir")
    os.symlink("/etc/shadow", tmp_path / "proj" / "link")
    with Sandbox(base_dir=str(tmp_path / "proj"), files={"/workspace/g.txt": "given"}) as sb:
        r = sb.run("cat f.txt g.txt; cat link 2>&1 | head -c 40; echo; readlink link")
        assert r.stdout.startswith("from dirgiven") and r.stdout.endswith("/etc/shadow\n")
        assert "root:" not in r.stdout  # the link resolves inside the sandbox, where /etc/shadow does not exist
    for bad in ({"../x": "1"}, {"/etc/x": "1"}, {"a/../../x": "1"}):
        with pytest.raises(ValueError, match="outside /workspace"):
            Sandbox(files=bad)
    with pytest.raises(ValueError, match="unknown limit"):
        Sandbox(memroy_bytes=1)
    with pytest.raises(ValueError, match="memory_bytes"):
        Sandbox(memory_bytes=0)
    with pytest.raises(ValueError, match="ro_binds"):
        Sandbox(ro_binds={"/usr": "/tmp"})
    with Sandbox() as sb:
        with pytest.raises(ValueError, match="timeout"):
            sb.run("true", timeout=0)
        with pytest.raises(ValueError, match="command"):
            sb.run(["ls"])
        with pytest.raises(ValueError, match="fork"):
            sb.fork(0)


def test_missing_pieces_are_refused_by_name(monkeypatch):
    monkeypatch.setattr(sandbox_mod.shutil, "which", lambda name: None if name == "bwrap" else f"/usr/bin/{name}")
    why = sandbox_mod._probe(65534)
    assert why is not None and "bwrap" in why and "bubblewrap" in why
    monkeypatch.setattr(sandbox_mod, "_probe_result", {})
    with pytest.raises(SandboxUnavailable, match="bwrap"):
        Sandbox()
    monkeypatch.setattr(sandbox_mod.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(sandbox_mod, "PYTHON", "/nonexistent/python3")
    assert "python3" in sandbox_mod._probe(65534)


def _host_procs_mentioning(text: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


UNPRIVILEGED_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
from agentpkg.sandbox import Sandbox, unavailable_reason
assert unavailable_reason() is None, unavailable_reason()
with Sandbox(files={"a.txt": "1"}) as sb:
    r = sb.run("id -u; cat a.txt; echo; cd /tmp; export K=v")
    assert r.stdout == "1000\n1\n", r
    snap = sb.snapshot()
    kids = sb.fork(2)
    kids[0].run("echo 2 > /workspace/a.txt; rm -f /workspace/gone")
    assert kids[1].run("cat /workspace/a.txt; echo; pwd; echo $K").stdout == "1\n/tmp\nv\n"
    assert kids[0].run("cat /workspace/a.txt").stdout == "2\n"
    sb.run("rm /workspace/a.txt; cd /workspace && mkdir -p locked/in && echo s > locked/in/f && "
           "chmod 000 locked/in/f locked/in")
    kids.append(sb.fork(1)[0])  # the copy-out reads what the sandboxed code made unreadable
    assert kids[-1].run("chmod 755 /workspace/locked/in; chmod 644 /workspace/locked/in/f; "
                        "cat /workspace/locked/in/f").stdout == "s\n"
    deep = "cd /workspace; for i in $(seq 21); do mkdir -p " + "d" * 200 + " && cd " + "d" * 200 + "; done; "
    sb.run(deep + "echo deep > f")  # past PATH_MAX: the copy-out falls back to fstree.py, as this user too
    kids.append(sb.fork(1)[0])
    assert kids[-1].run(deep + "cat f").stdout == "deep\n"
    sb.restore(snap)
    assert sb.run("cat /workspace/a.txt").stdout == "1"
    assert sb.run("python3 -c 'import socket; socket.socket()'").exit_code != 0
    for k in kids:
        k.close()
print("UNPRIVILEGED OK")
"""


@needs_sandbox
def test_the_same_contract_holds_for_an_unprivileged_host_process(tmp_path):
    """As root the sandbox already runs its processes as uid 65534; this runs the host side as well as an
    ordinary user (the sandbox modules need only the stdlib and the system Python)."""
    if os.getuid() != 0:
        pytest.skip("already unprivileged: every sandbox test here is the unprivileged case")
    import shutil
    import subprocess
    import tempfile

    top = tempfile.mkdtemp(prefix="openk3-unpriv-")
    try:
        pkg = os.path.join(top, "agentpkg")
        os.makedirs(pkg)
        open(os.path.join(pkg, "__init__.py"), "w").close()
        for name in ("sandbox.py", "layers.py", "proc.py", "cgroup.py", "seccomp.py", "agentd.py", "toolbox.py",
                     "toolbox_apps.py", "fstree.py", "upper.py", "limits.py"):
            src = os.path.join(sandbox_mod.AGENT_DIR, name)
            if os.path.exists(src):
                shutil.copy(src, pkg)
        script = os.path.join(top, "check.py")
        with open(script, "w") as f:
            f.write(UNPRIVILEGED_SCRIPT)
        for dirpath, _, names in os.walk(top):
            os.chmod(dirpath, 0o755)
            for n in names:
                os.chmod(os.path.join(dirpath, n), 0o644)
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
                              "-I", script, top], capture_output=True, text=True, timeout=120,
                             env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, cwd="/")
        assert out.returncode == 0 and "UNPRIVILEGED OK" in out.stdout, out.stderr[-3000:]
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_sandbox_is_available_where_the_host_has_every_piece():
    """Skips are for hosts that lack a piece (the reason is printed); on a host that has them all, an
    unavailable sandbox is a bug of ours and must fail, not skip."""
    import shutil

    pieces = ["bwrap", "unshare", "prlimit", "mount", "setpriv", "nsenter", "cp", "find"]
    missing = [p for p in pieces if shutil.which(p) is None]
    try:
        userns = int(open("/proc/sys/user/max_user_namespaces").read()) > 0
    except OSError:
        userns = False
    if missing or not userns or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip(f"host lacks a piece: missing {missing}, user namespaces {'on' if userns else 'off'}")
    assert WHY is None, WHY


def test_removing_a_store_never_changes_anything_outside_it(tmp_path, monkeypatch):
    """`layers.rmtree` fixes modes inside the tree it removes (mode-000 dirs the sandboxed code made) but never
    outside: when another process removed the same stale store first, the error on the store's own path once
    made it chmod the parent (/tmp) to 0700, locking every sandbox uid out of /tmp."""
    import stat

    from openk3.agent import layers

    parent = tmp_path / "parent"
    tree = parent / "openk3-sb-x"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_text("x")
    (tree / "a" / "b").chmod(0o000)  # made unreadable inside the sandbox: fixed up, then removed
    parent.chmod(0o755)
    real_rmdir = os.rmdir

    def racing_rmdir(p, *args, **kwargs):  # the tree's own removal fails as if another process got there first
        if os.fspath(p) == str(tree):
            raise FileNotFoundError(2, "No such file or directory", str(tree))
        return real_rmdir(p, *args, **kwargs)

    monkeypatch.setattr(os, "rmdir", racing_rmdir)
    layers.rmtree(str(tree))
    monkeypatch.undo()
    assert stat.S_IMODE(parent.stat().st_mode) == 0o755
    assert not (tree / "a").exists()
    assert layers.inside("/tmp/s", "/tmp/s/u") and layers.inside("/tmp/s", "/tmp/s")
    assert not layers.inside("/tmp/s", "/tmp") and not layers.inside("/tmp/s", "/tmp/sx")
