"""Hostile state: nothing sandboxed code leaves in its workspace or its shell makes the host side raise, and
nothing is dropped without a message (issue 28: C1, S4, S5).

Folders nested past PATH_MAX and deeper than a recursive walk, every kind of entry at once, an attribute
the host's file system cannot hold, exported variables past what Linux can pass to a program, a command
past the argument limit, an unenterable working directory, and the cgroups of a host killed with SIGKILL.
`fstree` (the fallback copier and the remover behind snapshots and cleanup) is also checked on host
folders, which needs no sandbox.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from openk3.agent import Sandbox, fstree, layers, unavailable_reason
from openk3.agent import cgroup as cgroup_mod

WHY = unavailable_reason()
needs_sandbox = pytest.mark.skipif(WHY is not None, reason=f"no sandbox on this host: {WHY}")

DEEP = "d" * 200  # 21 of them nest past PATH_MAX (4096 bytes)
MAKE_DEEP = f"for i in $(seq 21); do mkdir -p {DEEP} && cd {DEEP} || exit 1; done; echo deep > f"
READ_DEEP = f"cd /workspace; for i in $(seq 21); do cd {DEEP} || exit 1; done; cat f"
# Every kind of entry, made inside the sandbox (the base layer gives `gone` and `src/old` to delete).
KINDS = ("mkfifo fifo && python3 -c \"import socket; socket.socket(socket.AF_UNIX).bind('sock')\" && "
         "ln -s loop loop && ln -s /etc/shadow abs && echo h > h1 && ln h1 h2 && mkdir -p sub && ln h1 sub/h3 && "
         "truncate -s 100M sparse && echo end >> sparse && mkdir -p locked/in && echo s > locked/in/f && "
         "chmod 000 locked/in/f locked/in locked && echo w > wo && chmod 200 wo && echo x > suid && "
         "chmod 6755 suid && touch \"$(printf 'new\\nline')\" \"$(printf 'bad\\xffname')\" && "
         "python3 -c \"import os; os.setxattr('h1', 'user.k', b'v')\" && rm gone && rm -r src && "
         "mkdir src && echo n > src/new")
# type, mode (set-id bits dropped by a snapshot), size, links and link target of each entry but the deep
# branch (read on its own), NUL-separated: names may hold newlines
LISTING = rf"cd /workspace && find . -path ./{DEEP} -prune -o -printf '%P|%y|%m|%s|%n|%l\0' | sort -z"


@pytest.fixture
def sb():
    with Sandbox(files={"a.txt": "hello\n", "gone": "x", "src/old": "o"}) as s:
        yield s


def _listing(box) -> list[str]:
    r = box.run(LISTING)
    assert r.exit_code == 0 and r.error is None, r
    rows = []
    for row in filter(None, r.stdout.split("\0")):
        path, kind, mode, size, *rest = row.split("|")
        size = "-" if kind == "d" else size  # a folder's size is its file system's (tmpfs live, disk sealed)
        rows.append("|".join([path, kind, oct(int(mode, 8) & ~0o6000), size, *rest]))
    return rows


@needs_sandbox
def test_c1_folders_past_path_max_survive_snapshot_restore_fork_and_a_dead_agent(sb):
    assert sb.run(MAKE_DEEP + "; echo top > /workspace/t").exit_code == 0
    snap = sb.snapshot()  # was: SandboxError "File name too long" from the host, and the changes lost
    sb.run("echo later > /workspace/l")
    sb.restore(snap)
    assert sb.run(READ_DEEP + "; cat /workspace/t; ls /workspace/l 2>&1 | wc -l").stdout == "deep\ntop\n1\n"
    (kid,) = sb.fork(1)
    assert kid.run(READ_DEEP).stdout == "deep\n"
    kid.close()
    # The agent dies mid-call: the upper is copied out before the teardown, and back in at the next start.
    sb.run(f"mkdir -p /workspace/x && cd /workspace/x && {MAKE_DEEP.replace('deep >', 'again >')}")
    threading.Timer(0.5, os.kill, (sb.agent_pid(), signal.SIGKILL)).start()
    r = sb.run("sleep 20")  # was: SandboxError raised from run (the copy-out failed) and the files lost
    assert r.error is not None and "agent" in r.error, r
    r = sb.run(f"cd /workspace/x; for i in $(seq 21); do cd {DEEP} || exit 1; done; cat f")
    assert (r.stdout, r.error) == ("again\n", None), r


@needs_sandbox
def test_c1_a_tree_deeper_than_a_recursive_walk_is_saved_and_removed():
    # in RAM where the host has it: removing thousands of folders one by one is slow on some disks
    sb = Sandbox(store_dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    root = sb.store.root
    # 2100 levels: past PATH_MAX (cp stops) and past Python's recursion limit (shutil.rmtree stopped)
    r = sb.run("python3 -c \"import os\nfor _ in range(2100):\n os.mkdir('a'); os.chdir('a')\nopen('f','w')\"")
    assert r.exit_code == 0, r
    sb.snapshot()  # was: RecursionError in the host (removing the partial copy), and at close
    (kid,) = sb.fork(1)
    assert kid.run("find . -name f | wc -l").stdout == "1\n"
    kid.close()
    sb.close()
    assert not os.path.exists(root)


@needs_sandbox
def test_c1_every_kind_of_entry_survives_the_fallback_copy(sb):
    """The deep folder makes `cp` fail, so the whole upper goes through fstree.py: what it keeps must equal
    what the sandbox had (whiteouts and opaque folders included), set-id bits dropped."""
    assert sb.run(KINDS).exit_code == 0
    assert sb.run(MAKE_DEEP).exit_code == 0
    before = _listing(sb)
    assert "gone|" not in "\n".join(before) and any(row.startswith("src/new|") for row in before)
    (kid,) = sb.fork(1)
    assert _listing(kid) == before and kid.run(READ_DEEP).stdout == "deep\n"
    r = kid.run("stat -c %i h1 h2 sub/h3 | uniq | wc -l; du -k sparse | cut -f1; tail -c4 sparse; stat -c %a suid; "
                "chmod 755 locked locked/in; chmod 644 locked/in/f; cat locked/in/f; ls src; readlink loop; "
                "python3 -c \"import os; print(os.getxattr('h1', 'user.k'))\"")
    count, du_kib, *rest = r.stdout.splitlines()
    assert count == "1" and int(du_kib) < 1024, r.stdout  # one inode for the three names; holes stay holes
    assert rest == ["end", "755", "s", "new", "loop", "b'v'"], r.stdout
    kid.close()


@needs_sandbox
def test_c1_an_attribute_the_host_cannot_hold_is_named_not_dropped(sb, caplog):
    sb.run("echo x > f && python3 -c \"import os; os.setxattr('f', 'user.big', b'v' * 60000)\"")
    with caplog.at_level(logging.WARNING, logger="openk3.agent.sandbox"):
        (kid,) = sb.fork(1)
    kept = kid.run("python3 -c \"import os; print(len(os.getxattr('f', 'user.big')))\"")
    if kept.stdout != "60000\n":  # the host's file system refused it (ext4: ~4 KiB per inode): say so
        assert "user.big" in (kept.notice or "") and "f:" in kept.notice, kept
        assert "user.big" in caplog.text
        assert "user.big" in sb.run("true").notice  # the parent's next call hears it too
    kid.close()


@needs_sandbox
def test_s5_oversized_exported_variables_are_named_and_the_rest_is_kept(sb, caplog):
    big = 'export SMALL=1 BIG="$(head -c 20000000 /dev/zero | tr "\\0" x)"; f() { echo "fn $1"; }; export -f f; cd /tmp'
    with caplog.at_level(logging.WARNING, logger="openk3.agent.sandbox"):
        r = sb.run(big)
    assert r.exit_code == 0 and r.error is None, r
    assert "BIG (20000004 bytes)" in r.notice and "131071" in r.notice, r.notice
    assert "BIG" in caplog.text and "131071" in caplog.text
    # was: the whole environment (PATH, HOME, SMALL, ...) silently dropped
    r = sb.run('echo "$SMALL|${#BIG}|$HOME|$PATH"; pwd; f arg')
    assert r.stdout == "1|0|/workspace|/usr/local/bin:/usr/bin:/bin\n/tmp\nfn arg\n" and r.notice is None, r
    r = sb.run("for i in $(seq 4100); do export V$i=1; done")  # was: a malformed reply (a sandbox error)
    assert r.error is None and "at most 4000 exported variables" in r.notice, r
    r = sb.run('for i in $(seq 4100); do unset V$i; done; for i in $(seq 10); do '
               'export W$i="$(head -c 120000 /dev/zero | tr "\\0" z)"; done')
    assert "W9 (120003 bytes)" in r.notice and str(1 << 20) in r.notice, r.notice
    assert sb.run("env | wc -c").exit_code == 0


@needs_sandbox
def test_a_command_past_the_argument_limit_runs(sb):
    r = sb.run("cat > big <<'EOF'\n" + "x" * 200_000 + "\nEOF\nwc -c < big")  # was: E2BIG, a sandbox error
    assert (r.exit_code, r.stdout, r.error) == (0, "200001\n", None), r


@needs_sandbox
def test_an_unenterable_cwd_starts_the_next_call_elsewhere_with_a_notice(sb):
    sb.run("mkdir d && cd d && chmod 000 .")
    r = sb.run("pwd")  # was: PermissionError from the agent on every later call
    assert (r.stdout, r.error) == ("/workspace\n", None) and "/workspace/d cannot be entered" in r.notice, r
    sb.run("chmod 000 /workspace")
    r = sb.run("pwd; chmod 755 /workspace")
    assert (r.stdout, r.error) == ("/\n", None) and "starts in /" in r.notice, r
    assert sb.run("pwd").notice is None


KILLED_HOST = """
import json, sys, time
from openk3.agent import Sandbox
sb = Sandbox(store_dir=sys.argv[1])
sb.run("true")
print(json.dumps(sb._proc_box[1].dirs), flush=True)
time.sleep(600)
"""


@needs_sandbox
def test_s4_the_cgroups_of_a_killed_host_are_reclaimed():
    if os.getuid() != 0 or cgroup_mod._layout() is None:
        pytest.skip("sandboxes get cgroups only as root on a host with a writable cgroup hierarchy")
    store = tempfile.mkdtemp(prefix="openk3-killed-")
    os.chmod(store, 0o755)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(
        cgroup_mod.__file__))), os.environ.get("PYTHONPATH", "")])}
    host = subprocess.Popen([sys.executable, "-c", KILLED_HOST, store], stdout=subprocess.PIPE, text=True, env=env)
    try:
        dirs = json.loads(host.stdout.readline())
    finally:
        host.kill()  # SIGKILL: no cleanup runs
        host.wait()
    try:
        assert dirs and all(os.path.isdir(d) for d in dirs)
        for _ in range(1000):  # its sandbox dies with it (--pdeathsig); wait until the groups have no tasks
            if all(not open(os.path.join(d, "cgroup.procs")).read().strip() for d in dirs):
                break
            time.sleep(0.01)
        with Sandbox() as sb:  # a new sandbox's start-up reclaims what the killed host left
            sb.run("true")
            assert not [d for d in dirs if os.path.exists(d)]
            assert all(os.path.isdir(d) for d in sb._proc_box[1].dirs)  # a live host's groups are kept
    finally:
        layers.remove_stale_stores(store)
        os.rmdir(store)


# ---- fstree on host folders (no sandbox needed) -----------------------------------------------------------


def _make_hostile_tree(root: str) -> None:
    """1500 levels of 3-byte names (6 KB: past PATH_MAX and Python's recursion limit) and every kind of entry,
    made through directory fds like the walk under test (a path would be too long)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1500):
        os.mkdir("abc", dir_fd=fd)
        sub = os.open("abc", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
    with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
        f.write("bottom")
    os.close(fd)
    os.mkfifo(os.path.join(root, "fifo"))
    s = socket.socket(socket.AF_UNIX)
    s.bind(os.path.join(root, "sock"))
    s.close()
    os.symlink("loop", os.path.join(root, "loop"))
    with open(os.path.join(root, "h1"), "w") as f:
        f.write("h")
    os.link(os.path.join(root, "h1"), os.path.join(root, "h2"))
    with open(os.path.join(root, "sparse"), "wb") as f:
        f.truncate(100 << 20)
        f.write(b"start")
    with open(os.path.join(os.fsencode(root), b"new\nline\xff"), "w") as f:
        f.write("odd")
    os.makedirs(os.path.join(root, "locked", "in"))
    os.chmod(os.path.join(root, "locked", "in"), 0)
    os.chmod(os.path.join(root, "locked"), 0)


def _find(root: str) -> list[str]:
    out = subprocess.run(["find", ".", "-printf", r"%P|%y|%m|%s|%n|%l\0"], cwd=root, capture_output=True,
                         check=True).stdout
    return sorted(out.split(b"\0"))


def test_fstree_copies_and_removes_trees_past_path_max_and_recursion(tmp_path):
    # in RAM where the host has it: removing thousands of folders one by one is slow on some disks
    top = tempfile.mkdtemp(dir="/dev/shm") if os.path.isdir("/dev/shm") else str(tmp_path)
    src, dst = os.path.join(top, "src"), os.path.join(top, "dst")
    try:
        os.mkdir(src)
        _make_hostile_tree(src)
        assert fstree.copy_tree(src, dst) == []
        assert _find(dst) == _find(src)
        assert os.stat(os.path.join(dst, "h1")).st_ino == os.stat(os.path.join(dst, "h2")).st_ino
        assert os.stat(os.path.join(dst, "sparse")).st_blocks * 512 < 1 << 20
        # the sandbox's store removal (layers.rmtree) on the same trees: was RecursionError from shutil.rmtree
        layers.rmtree(src)
        assert fstree.remove_tree(dst) == 0
        assert os.listdir(top) == []
    finally:
        subprocess.run(["rm", "-rf", top], check=True)  # GNU rm walks by fds too: whatever failed goes


def test_fstree_names_what_it_cannot_copy_and_raises_only_for_the_host(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a").write_text("a")
    (src / "b").write_text("b")
    real_setxattr = os.setxattr
    os.setxattr(src / "b", "user.k", b"v")

    def refuse(path, key, value, *a, **k):
        raise OSError(28, "No space left on device")  # what ext4 says to a value past its inode's room

    monkeypatch.setattr(os, "setxattr", refuse)
    problems = fstree.copy_tree(str(src), str(tmp_path / "dst"))
    assert problems == ["b: extended attribute user.k (1 bytes) not kept: No space left on device"]
    assert (tmp_path / "dst" / "sub" / "a").read_text() == "a"
    monkeypatch.setattr(os, "setxattr", real_setxattr)
    real_sendfile = os.sendfile

    def full_disk(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "sendfile", full_disk)  # the host's disk is full: no half copy passes for one
    with pytest.raises(OSError, match="No space"):
        fstree.copy_tree(str(src), str(tmp_path / "dst2"))
    monkeypatch.setattr(os, "sendfile", real_sendfile)
    assert fstree.show(["x" * 100, "a\nb"]) == "x" * 28 + "..." + "x" * 28 + "/a\\nb"


def test_shell_state_is_parsed_as_it_streams_with_bounded_memory():
    """The agent's parser of the EXIT trap's report (no sandbox needed): items split anywhere across reads,
    a 20 MB variable buffered only up to the limit and named, PWD and friends never carried."""
    from openk3.agent.agentd import VAR_CAP, ShellState

    report = b"/w/x\0A=1\0PWD=/w/x\0BIG=" + b"v" * 20_000_000 + b"\0EMPTY=\0garbage\0" + b"C=3\0"
    state = ShellState()
    for i in range(0, len(report), 65_531):  # odd chunks: NULs and names fall across reads
        state.feed(report[i:i + 65_531])
        assert len(state._item) <= VAR_CAP + 1
    state.finish()
    assert (state.cwd, state.env) == ("/w/x", {"A": "1", "EMPTY": "", "C": "3"})
    assert state.notices == [f"not kept for the next call: exported variable BIG (20000004 bytes): one NAME=value "
                             f"may be at most {VAR_CAP} bytes (Linux's MAX_ARG_STRLEN: no program starts with a "
                             "longer one); keep large data in a file"]
    unfinished = ShellState()
    unfinished.feed(b"/w")  # the trap never finished its first item: the caller keeps the old state
    assert unfinished.cwd is None
