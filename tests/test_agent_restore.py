"""Saving and restoring the files written since the last snapshot (`saved`) keeps one rule: `saved` is replaced
only by a whole copy of a whole workspace, and whatever cannot be saved or restored is named in a notice,
never raised out of the host for the sandbox's sake (security review of issue 28's C1 fix).

Slow or failing copies are made with stand-ins for the copiers (a fake fstree.py, a `CP_UPPER` that
hangs), so the tests take seconds and no timing decides an outcome: a stand-in that blocks forever
outlasts any wait.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile

import pytest

from openk3.agent import Sandbox, unavailable_reason
from openk3.agent import proc as proc_mod
from openk3.agent import sandbox as sandbox_mod

WHY = unavailable_reason()
needs_sandbox = pytest.mark.skipif(WHY is not None, reason=f"no sandbox on this host: {WHY}")
KEEP = "for i in $(seq 40); do echo precious > keep$i; done"
COUNT = "ls /workspace | grep -c keep"
# copies every other entry, then blocks: a restore that is half done when the host stops waiting
HALF_THEN_HANG = """
import os, shutil, sys, time
src, dst = sys.argv[2], sys.argv[3]
for name in sorted(os.listdir(src))[::2]:
    shutil.copy2(os.path.join(src, name), dst)
time.sleep(600)
"""


@pytest.fixture
def script_dir():
    """A folder the sandbox's uid can read (the holder runs the restore copier as that uid)."""
    top = tempfile.mkdtemp(prefix="openk3-fake-")
    os.chmod(top, 0o755)
    yield top
    for pid in _running(top):  # a stand-in that outlived its sandbox (the bug some tests check)
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(top, ignore_errors=True)


def _script(top: str, name: str, code: str) -> str:
    path = os.path.join(top, name)
    with open(path, "w") as f:
        f.write(code)
    os.chmod(path, 0o644)
    return path


def _running(marker: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def _save_by_agent_death(sb: Sandbox) -> None:
    """End the incarnation the way a dead agent does: the host saves the live upper to `saved` (unsealed)."""
    os.kill(sb.agent_pid(), signal.SIGKILL)
    r = sb.run("true")
    assert r.error is not None and "agent" in r.error, r


@needs_sandbox
def test_a_restore_the_host_gives_up_on_never_replaces_saved(monkeypatch, script_dir):
    with Sandbox() as sb:
        assert sb.run(KEEP).exit_code == 0
        _save_by_agent_death(sb)
        fake = _script(script_dir, "slow_fstree.py", HALF_THEN_HANG)
        monkeypatch.setattr(sandbox_mod, "FSTREE", fake)
        real_read_line = sandbox_mod.read_line
        monkeypatch.setattr(sandbox_mod, "read_line", lambda stream, wait: real_read_line(stream, min(wait, 2.0)))
        gave_up = sb.run("true")  # its restore never ends: the host stops waiting
        left = _running(fake)
        monkeypatch.undo()
        r = sb.run(COUNT)
        assert (r.stdout, r.error) == ("40\n", None), r  # was: "20": the half-restored upper saved over `saved`
        assert gave_up.exit_code == -1 and "not restored" in gave_up.error, gave_up
        assert "kept on disk" in gave_up.notice, gave_up  # was: no notice
        assert left == []  # was: the copier left running, reparented out of the holder


RESTORE_THEN_REPORT = """
import sys
sys.path.insert(0, {agent_dir!r})
import fstree
fstree.copy_tree(sys.argv[2], sys.argv[3])
print("keep1: extended attribute user.k (9 bytes) not kept: No space left on device")
"""
RESTORE_FAILS = """
import sys
print("No space left on device (keep3)", file=sys.stderr)
sys.exit(3)
"""


@needs_sandbox
def test_what_a_restore_could_not_bring_back_is_a_notice(monkeypatch, script_dir):
    with Sandbox() as sb:
        assert sb.run(KEEP).exit_code == 0
        _save_by_agent_death(sb)
        code = RESTORE_THEN_REPORT.format(agent_dir=sandbox_mod.AGENT_DIR)
        monkeypatch.setattr(sandbox_mod, "FSTREE", _script(script_dir, "report.py", code))
        r = sb.run(COUNT)  # was: the problem went to the holder's log only
        assert (r.stdout, r.error) == ("40\n", None), r
        assert "restored without: keep1: extended attribute user.k" in r.notice, r
        _save_by_agent_death(sb)
        monkeypatch.setattr(sandbox_mod, "FSTREE", _script(script_dir, "fails.py", RESTORE_FAILS))
        r = sb.run(COUNT)
        assert r.error is not None and "could not be restored" in r.error, r
        assert "No space left on device (keep3)" in r.notice and "kept on disk" in r.notice, r
        monkeypatch.undo()
        assert sb.run(COUNT).stdout == "40\n"  # nothing was lost


# the host-side copier's limits, reported by stand-ins for both copiers (cp's path, then fstree's): a failure
REPORT_LIMITS_CP = 'echo "cp: cpu $(ulimit -t)" >&2; exit 1'
REPORT_LIMITS_FSTREE = """
import resource, sys
cpu = resource.getrlimit(resource.RLIMIT_CPU)[0]
mem = resource.getrlimit(resource.RLIMIT_AS)[0]
print(f"the tree was moved during the walk (cpu {cpu} s, address space {mem} bytes)", file=sys.stderr)
sys.exit(1)
"""


@needs_sandbox
def test_the_host_side_copier_is_bounded_and_its_failures_keep_the_last_saved_state(monkeypatch, script_dir):
    from openk3.agent import upper

    with Sandbox(copy_timeout=3) as sb:
        assert sb.run("echo 1 > a").exit_code == 0
        _save_by_agent_death(sb)
        assert sb.run("cat a").stdout == "1\n"
        monkeypatch.setattr(upper, "CP_UPPER", "sleep 600")  # a copy that never ends
        assert sb.run("echo 2 > a; echo new > b").exit_code == 0
        snap = sb.snapshot()  # was: no bound at all (the host blocked for as long as the copy ran)
        assert _running("sleep 600") == []  # its whole process group went
        r = sb.run("cat a; ls b")
        assert r.stdout == "1\n" and "could not be saved" in r.notice and "longer than 3 s" in r.notice, r
        monkeypatch.setattr(upper, "CP_UPPER", REPORT_LIMITS_CP)
        monkeypatch.setattr(upper, "FSTREE", _script(script_dir, "limits.py", REPORT_LIMITS_FSTREE))
        assert sb.run("echo 3 > a").exit_code == 0
        sb.restore(snap)  # a fresh upper over the snapshot: nothing to save
        assert sb.run("echo 4 > a").exit_code == 0
        sb.snapshot()  # was: SandboxError from the host ("could not save ... moved during the walk")
        r = sb.run("cat a")
        assert r.stdout == "1\n" and "moved during the walk (cpu 3 s, address space 1073741824 bytes)" in r.notice, r


@needs_sandbox
def test_a_holder_that_vanishes_before_the_copy_out_is_a_notice_not_an_exception(monkeypatch):
    with Sandbox() as sb:
        assert sb.run("echo 1 > a").exit_code == 0
        _save_by_agent_death(sb)
        assert sb.run("echo 2 > a").exit_code == 0
        holder = sb._proc
        holder.send_signal(signal.SIGKILL)
        while os.path.exists(f"/proc/{holder.pid}/ns/mnt"):  # gone, not yet reaped: nsenter cannot enter it
            os.sched_yield()
        monkeypatch.setattr(holder, "poll", lambda: None)  # it died after the host's last look
        sb.snapshot()  # was: SandboxError "nsenter: cannot open /proc/N/ns/mnt"
        monkeypatch.undo()
        r = sb.run("cat a")
        assert r.stdout == "1\n" and "could not be saved" in r.notice and "lost" in r.notice, r


def _live_below(pid: int) -> list[int]:
    """The processes under `pid` that still run (a zombie holds nothing)."""
    found = []
    for child in proc_mod.children(pid):
        try:
            with open(f"/proc/{child}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                    continue
        except OSError:
            continue
        found += [child, *_live_below(child)]
    return found


@needs_sandbox
def test_nothing_sandboxed_runs_while_the_workspace_is_copied_out(monkeypatch):
    """If killing the agent does not close the pipe in time, every process under the holder is killed before
    the copy, never copied from under a live writer."""
    seen: list[list[int]] = []
    real_save, real_drain = Sandbox._save_upper, sandbox_mod.drain_to_eof

    def save(self, holder, *args):
        seen.append(_live_below(holder))
        return real_save(self, holder, *args)

    with Sandbox() as sb:
        assert sb.run("echo 1 > a").exit_code == 0
        monkeypatch.setattr(Sandbox, "_save_upper", save)
        monkeypatch.setattr(sandbox_mod, "signal_pid", lambda pid, sig: None)  # the agent outlives its kill
        monkeypatch.setattr(sandbox_mod, "drain_to_eof", lambda stream, wait: real_drain(stream, min(wait, 0.5)))
        sb.snapshot()  # was: copied while the agent still ran (drain_to_eof timed out as quietly as EOF)
        monkeypatch.undo()
        assert seen == [[]]
        assert sb.run("cat a").stdout == "1\n"
