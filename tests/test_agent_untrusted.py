"""What sandboxed code names reaches the host as data, never as a lever (security review of issue 28's C1 fix):
hard links cost the host's copier O(1) each, variable names come back as they were or are named as dropped,
no name forges a host log line, and a host in another PID namespace cannot take a live sandbox's cgroups or
store for a dead one's.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile

import pytest

from openk3.agent import Sandbox, fstree, layers, unavailable_reason
from openk3.agent import cgroup as cgroup_mod
from openk3.agent import proc as proc_mod

WHY = unavailable_reason()
needs_sandbox = pytest.mark.skipif(WHY is not None, reason=f"no sandbox on this host: {WHY}")
# the command's own state pipe (the one pipe past stdout and stderr): it may write any "state" there
STATE_FD = 'for f in /proc/$$/fd/*; do n=${f##*/}; [ "$n" -gt 2 ] && [[ $(readlink "$f") == pipe:* ]] && s=$n; done'


def test_hard_links_deep_in_a_tree_cost_the_copier_o1_each(tmp_path, monkeypatch):
    depth, pairs = 200, 200
    src = tmp_path / "src"
    src.mkdir()
    fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=fd)
        sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = sub
    for i in range(pairs):
        os.close(os.open(f"f{i}", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd))
        os.link(f"f{i}", f"g{i}", src_dir_fd=fd, dst_dir_fd=fd)
    os.close(fd)
    opens = [0]
    real_open = os.open

    def counting_open(*a, **k):
        opens[0] += 1
        return real_open(*a, **k)

    monkeypatch.setattr(os, "open", counting_open)
    assert fstree.copy_tree(str(src), str(tmp_path / "dst")) == []
    monkeypatch.undo()
    # was: every second name re-walked the path from the top, depth * pairs = 40,000 opens
    assert opens[0] < 4 * (depth + 2 * pairs), opens[0]
    bottom = os.path.join(tmp_path / "dst", *["d"] * depth)
    assert os.stat(f"{bottom}/f7").st_ino == os.stat(f"{bottom}/g7").st_ino
    assert os.stat(f"{bottom}/f7").st_nlink == 2  # the staging folder's link went with it
    assert os.listdir(tmp_path / "dst") == ["d"]
    assert os.stat(tmp_path / "dst").st_mtime_ns == os.stat(src).st_mtime_ns


def test_names_are_escaped_for_the_log():
    assert fstree.show(["a\rb\x1b[2J\u202ec", "\udcff"]) == "a\\rb\\x1b[2J\\u202ec/\\xff"
    assert fstree.printable(fstree.printable("x\ny\\z")) == "x\\ny\\z"


@needs_sandbox
def test_a_working_directory_named_to_forge_a_log_line_is_escaped(caplog):
    with Sandbox() as sb:
        sb.run("d=$'x\\r\\n2026-01-01 00:00:00 CRITICAL openk3.auth: root login\\e[2J'; mkdir \"$d\"; "
               "cd \"$d\"; chmod 000 .")
        with caplog.at_level(logging.WARNING, logger="openk3.agent.sandbox"):
            r = sb.run("pwd")
    (record,) = [x for x in caplog.records if "cannot be entered" in x.getMessage()]
    logged = record.getMessage()
    assert not any(c in logged for c in "\r\n\x1b"), repr(logged)  # was: the agent's notice logged raw
    assert "x\\r\\n2026-01-01 00:00:00 CRITICAL" in logged and "\\x1b[2J" in logged and r.notice in logged


@needs_sandbox
def test_exported_names_come_back_as_they_were_or_are_named_as_dropped():
    long = "L" * 250
    with Sandbox() as sb:
        r = sb.run(f"export {long}=one ARR=(a b); declare -A MAP=([k]=v); export MAP")
        # was: no notice; the arrays came back as scalars ("a") or not at all (MAP)
        assert r.error is None and "exported array ARR, MAP:" in r.notice, r
        r = sb.run(f'echo "${{{long}}}"; declare -p ARR MAP 2>&1 | wc -l')
        assert r.stdout == "one\n2\n" and r.notice is None, r  # was: "L" * 200 set, "L" * 250 empty
        # names no shell can take, forged on the state pipe
        forged = r"/workspace\0=empty\0with space=1\0BASH_FUNC_f%%%%=() { :; }\0OK=1\0"
        r = sb.run(f"{STATE_FD}; printf '{forged}' >&$s")
        assert r.error is None and "'', 'with space'" in r.notice and "not a shell identifier" in r.notice, r
        assert "" not in sb.env and "with space" not in sb.env and sb.env["OK"] == "1"
        assert sb.env["BASH_FUNC_f%%"] == "() { :; }"  # env's form of an exported function is a valid name
        assert sb.run('echo "$OK"').stdout == "1\n"


def test_stores_of_another_pid_namespace_are_left_alone(tmp_path):
    dead = 999_999_999  # past any pid_max: never a live process
    records = {"theirs": f"{dead} 0 1", "ours": f"{dead} 0 {proc_mod.pid_ns()}", "before-namespaces": f"{dead} 0"}
    for name, owner in records.items():
        (tmp_path / f"openk3-sb-{name}").mkdir()
        (tmp_path / f"openk3-sb-{name}" / layers.OWNER_FILE).write_text(owner)
    assert layers.remove_stale_stores(str(tmp_path)) == 2
    assert sorted(os.listdir(tmp_path)) == ["openk3-sb-theirs"]


OTHER_NAMESPACE = """
import sys
from openk3.agent import cgroup, layers
print(cgroup.reclaim_stale(), layers.remove_stale_stores(sys.argv[1]))
"""


@needs_sandbox
def test_a_host_in_another_pid_namespace_leaves_a_live_sandbox_alone():
    if os.getuid() != 0 or cgroup_mod._layout() is None:
        pytest.skip("sandboxes get cgroups only as root on a host with a writable cgroup hierarchy")
    store = tempfile.mkdtemp(prefix="openk3-ns-")
    os.chmod(store, 0o755)  # the sandbox's uid goes through it
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(cgroup_mod.__file__))))
    try:
        with Sandbox(store_dir=store) as sb:
            assert sb.run("echo 1 > a").exit_code == 0
            sb.snapshot()  # between incarnations: no process in its groups
            dirs = sb._proc_box[1].dirs
            out = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                                  OTHER_NAMESPACE, store], capture_output=True, text=True, timeout=60,
                                 env={**os.environ, "PYTHONPATH": pkg_root})
            assert out.returncode == 0, out.stderr
            assert out.stdout.split() == ["0", "0"]  # was: "2 1": its groups and its whole store removed
            assert all(os.path.isdir(d) for d in dirs) and os.path.isdir(sb.store.root)
            assert sb.run("cat a").stdout == "1\n"
            sb.snapshot()
            for d in dirs:  # removed by someone all the same (an older host): the next start makes them again
                os.rmdir(d)
            r = sb.run("cat a")  # was: every start failed ("cannot create .../cgroup.procs")
            assert (r.stdout, r.error) == ("1\n", None), r
            assert all(os.path.isdir(d) for d in sb._proc_box[1].dirs)
    finally:
        layers.rmtree(store)
