"""openk3.agent.seccomp: every denial checked on a real child under bwrap (`--seccomp FD`), as the caller and,
when the caller is root, as `nobody` through setpriv; ordinary work still runs; other ABIs are killed.

A probe script runs inside the sandbox and does each named operation in a forked child (so one operation's
effect, or a kill, never touches the next), printing {operation: 0 | errno | "signal:N" | value} as JSON."""

from __future__ import annotations

import errno
import json
import os
import platform
import shutil
import subprocess

import pytest

from openk3.agent import seccomp

BWRAP = "/usr/bin/bwrap"
PYTHON = "/usr/bin/python3"  # the system python, as the sandbox's agent uses
MARKER = 133  # EHWPOISON: no syscall below returns it on its own, so it can only come from a rule
SIGSYS = 31

PROBE = r"""
import ctypes, json, mmap, os, socket, subprocess, sys, threading

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def sys_(nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
    return 0 if r >= 0 else ctypes.get_errno()

buf = ctypes.create_string_buffer(256)
iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 16)
NEWNS, NEWUSER, NEWPID, NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000

def pty_slave():
    return os.openpty()[1]

def sock(family):
    return sys_(41, family, socket.SOCK_DGRAM, 0)

def pair(family):
    return sys_(53, family, socket.SOCK_STREAM, 0, ctypes.byref((ctypes.c_int * 2)()))

def clone(flags):
    r = libc.syscall(ctypes.c_long(56), ctypes.c_long(flags | 17), 0, 0, 0, 0)  # | SIGCHLD
    if r == 0:
        os._exit(0)
    if r < 0:
        return ctypes.get_errno()
    os.waitpid(r, 0)
    return 0

def ptrace_attach_1():
    libc.ptrace.restype = ctypes.c_long
    return 0 if libc.ptrace(ctypes.c_long(16), ctypes.c_long(1), None, None) >= 0 else ctypes.get_errno()

def ptrace_seize_1():
    # for the unfiltered control: PTRACE_SEIZE does not stop pid 1 (an ATTACH would leave bwrap's reaper
    # stopped, and the sandbox hung, once the tracer exits)
    return 0 if libc.ptrace(ctypes.c_long(0x4206), ctypes.c_long(1), None, None) >= 0 else ctypes.get_errno()

def pidfd_1():
    return libc.syscall(ctypes.c_long(434), ctypes.c_long(1), ctypes.c_long(0))  # pidfd_open(1)

def i386_getpid():
    # mov eax, 20 (i386 getpid); int 0x80; ret
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(b"\xb8\x14\x00\x00\x00\xcd\x80\xc3")
    r = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))()
    return 0 if r == os.getpid() else "returned %d" % r

def threads():
    out = []
    ts = [threading.Thread(target=out.append, args=(i,)) for i in range(4)]
    for t in ts: t.start()
    for t in ts: t.join()
    return 0 if sorted(out) == [0, 1, 2, 3] else out

def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    return 0 if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7 else "bad status"

def run(argv):
    p = subprocess.run(argv, capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else "rc=%d %s" % (p.returncode, p.stderr)

def pool():
    import multiprocessing
    with multiprocessing.get_context("fork").Pool(2) as p:
        return 0 if p.map(abs, [-1, -2, -3]) == [1, 2, 3] else "bad map"

def inet_loopback():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0)); srv.listen()
        with socket.create_connection(srv.getsockname()) as c, srv.accept()[0] as s:
            c.sendall(b"ping")
            return 0 if s.recv(4) == b"ping" else "no data"

def seccomp_mode():
    return [l.split()[1] for l in open("/proc/self/status") if l.startswith("Seccomp:")][0]

GRANDCHILD = ("import ctypes, socket\n"
              "libc = ctypes.CDLL(None, use_errno=True)\n"
              "e = 0 if libc.syscall(41, %d, socket.SOCK_DGRAM, 0) >= 0 else ctypes.get_errno()\n"
              "p = 0 if libc.ptrace(16, 1, None, None) >= 0 else ctypes.get_errno()\n"
              "print(e, p)")

OPS = {
    "socket_inet": lambda: sock(2), "socket_inet6": lambda: sock(10), "socket_netlink": lambda: sock(16),
    "socket_packet": lambda: sock(17), "socket_vsock": lambda: sock(40), "socket_unix": lambda: sock(1),
    "socket_inet_high_bits": lambda: sock(1 << 32 | 2),  # the kernel's int reads AF_INET
    "socketpair_inet": lambda: pair(2), "socketpair_netlink": lambda: pair(16), "socketpair_unix": lambda: pair(1),
    "ptrace_attach_1": ptrace_attach_1, "ptrace_seize_1": ptrace_seize_1,
    "process_vm_readv_1": lambda: sys_(310, 1, iov, 1, iov, 1, 0),
    "process_vm_writev_1": lambda: sys_(311, 1, iov, 1, iov, 1, 0),
    "pidfd_getfd_1": lambda: sys_(438, pidfd_1(), 0, 0),
    "process_madvise_1": lambda: sys_(440, pidfd_1(), iov, 1, 8, 0),  # MADV_FREE
    "move_pages_1": lambda: sys_(279, 1, 1, buf, 0, buf, 0), "migrate_pages_1": lambda: sys_(256, 1, 64, buf, buf),
    "io_uring_setup": lambda: sys_(425, 8, ctypes.create_string_buffer(120)),
    "io_uring_enter": lambda: sys_(426, -1, 0, 0, 0, 0, 0),
    "io_uring_register": lambda: sys_(427, -1, 0, 0, 0),
    "perf_event_open": lambda: sys_(298, 0, 0, -1, -1, 0),
    "bpf": lambda: sys_(321, 0, 0, 0),
    "userfaultfd": lambda: sys_(323, 1),  # UFFD_USER_MODE_ONLY: allowed unprivileged
    "kexec_load": lambda: sys_(246, 0, 0, 0, 0), "kexec_file_load": lambda: sys_(320, -1, -1, 0, 0, 0),
    "init_module": lambda: sys_(175, 0, 0, b""), "finit_module": lambda: sys_(313, -1, b"", 0),
    "delete_module": lambda: sys_(176, b"openk3_none", 0),
    "mount": lambda: sys_(165, b"none", b"/tmp", b"tmpfs", 0, 0), "umount2": lambda: sys_(166, b"/proc", 0),
    "pivot_root": lambda: sys_(155, b"/", b"/"), "chroot": lambda: sys_(161, b"/"),
    "open_tree": lambda: sys_(428, -100, b"/", 0), "move_mount": lambda: sys_(429, -1, b"", -1, b"", 0),
    "fsopen": lambda: sys_(430, b"tmpfs", 0), "fsconfig": lambda: sys_(431, -1, 0, 0, 0, 0),
    "fsmount": lambda: sys_(432, -1, 0, 0), "fspick": lambda: sys_(433, -100, b"/", 0),
    "mount_setattr": lambda: sys_(442, -1, b"", 0, 0, 0),
    "unshare_user": lambda: sys_(272, NEWUSER), "unshare_mount": lambda: sys_(272, NEWNS),
    "setns": lambda: sys_(308, os.open("/proc/self/ns/net", os.O_RDONLY), 0),
    "clone_newuser": lambda: clone(NEWUSER), "clone_newns": lambda: clone(NEWNS),
    "clone_newpid": lambda: clone(NEWPID), "clone_newnet": lambda: clone(NEWNET),
    "keyctl": lambda: sys_(250, 0, -3, 0),  # KEYCTL_GET_KEYRING_ID of the session keyring
    "add_key": lambda: sys_(248, b"user", b"openk3", b"x", 1, -3),
    "request_key": lambda: sys_(249, b"user", b"openk3_none", 0, 0),
    "syslog": lambda: sys_(103, 10, 0, 0), "uselib": lambda: sys_(134, b"/nonexistent"),
    "acct": lambda: sys_(163, 0), "modify_ldt": lambda: sys_(154, 0, buf, 16),
    "quotactl": lambda: sys_(179, 0, 0, 0, 0), "quotactl_fd": lambda: sys_(443, -1, 0, 0, 0),
    "swapon": lambda: sys_(167, b"/nonexistent", 0), "swapoff": lambda: sys_(168, b"/nonexistent"),
    "reboot": lambda: sys_(169, 0, 0, 0, 0),  # bad magic: EINVAL even where it could reboot
    "personality_no_aslr": lambda: sys_(135, 0x0040000), "personality_query": lambda: sys_(135, 0xFFFFFFFF),
    "ioctl_tiocsti": lambda: sys_(16, pty_slave(), 0x5412, b"x"),
    "ioctl_tiocsti_high_bits": lambda: sys_(16, pty_slave(), 1 << 32 | 0x5412, b"x"),  # CVE-2019-10063
    "ioctl_tioclinux": lambda: sys_(16, pty_slave(), 0x541C, buf),
    "clone3": lambda: sys_(435, 0, 0),
    # other ABIs
    "i386_getpid": i386_getpid, "x32_getpid": lambda: sys_(0x40000000 | 39),
    # ordinary work
    "personality_default": lambda: sys_(135, 0), "ioctl_tiocgwinsz": lambda: sys_(16, pty_slave(), 0x5413, buf),
    "clone_plain": lambda: clone(0), "fork": fork, "threads": threads, "pool": pool,
    "bash_ls": lambda: run(["/bin/bash", "-c", "ls / >/dev/null && echo ok"]),
    "python": lambda: run([sys.executable, "-c", "print(6 * 7)"]),
    "inet_loopback": inet_loopback, "seccomp_mode": seccomp_mode,
    "grandchild": lambda: run(["/bin/bash", "-c", 'exec "$0" -c "$1"', sys.executable, GRANDCHILD % 2]),
}

results = {}
for name in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            value = OPS[name]()
        except OSError as e:
            value = e.errno
        except Exception as e:
            value = repr(e)
        os.write(w, json.dumps(value).encode())
        os._exit(0)
    os.close(w)
    data = b"".join(iter(lambda: os.read(r, 65536), b""))
    os.close(r)
    status = os.waitpid(pid, 0)[1]
    results[name] = "signal:%d" % os.WTERMSIG(status) if os.WIFSIGNALED(status) else json.loads(data)
print(json.dumps(results))
"""

DENIED = [
    "socket_inet", "socket_inet6", "socket_netlink", "socket_packet", "socket_vsock", "socket_inet_high_bits",
    "socketpair_inet", "socketpair_netlink",
    "ptrace_attach_1", "process_vm_readv_1", "process_vm_writev_1", "pidfd_getfd_1", "process_madvise_1",
    "move_pages_1", "migrate_pages_1",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "perf_event_open", "bpf", "userfaultfd",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr", "unshare_user", "unshare_mount", "setns",
    "clone_newuser", "clone_newns", "clone_newpid", "clone_newnet",
    "keyctl", "add_key", "request_key", "syslog", "uselib", "acct", "modify_ldt", "quotactl", "quotactl_fd",
    "swapon", "swapoff", "reboot", "personality_no_aslr", "personality_query",
    "ioctl_tiocsti", "ioctl_tiocsti_high_bits", "ioctl_tioclinux",
]  # fmt: skip
WORK = ["socket_unix", "socketpair_unix", "personality_default", "ioctl_tiocgwinsz", "clone_plain", "fork",
        "threads", "pool"]  # fmt: skip


def _sandbox_unavailable() -> str | None:
    if platform.machine() != "x86_64":
        return f"the probe uses x86_64 syscall numbers; this machine is {platform.machine()}"
    reason = seccomp.unavailable_reason()
    if reason is not None:
        return reason
    if not os.access(BWRAP, os.X_OK) or not os.access(PYTHON, os.X_OK):
        return f"needs {BWRAP} (bubblewrap) and {PYTHON}"
    smoke = subprocess.run([BWRAP, "--ro-bind", "/", "/", "--unshare-all", "true"], capture_output=True, text=True)
    if smoke.returncode != 0:
        return f"bwrap cannot create a sandbox here: {smoke.stderr.strip()}"
    return None


_UNAVAILABLE = _sandbox_unavailable()
needs_sandbox = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"no sandbox: {_UNAVAILABLE}")


@pytest.fixture(params=["caller", "nobody"])
def as_user(request) -> list[str]:
    """The command prefix for each identity: the caller's own, and nobody (65534) dropped to from root."""
    if request.param == "caller":
        return []
    if os.geteuid() != 0:
        pytest.skip("already unprivileged: the caller run is the unprivileged one")
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is missing")
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def run_probe(program: bytes | None, ops: list[str], prefix: list[str] | None = None) -> dict:
    """Run the probe's `ops` in a bwrap sandbox, under `program` (None: no filter)."""
    cmd = [*(prefix or []), BWRAP, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-all",
           "--die-with-parent"]  # fmt: skip
    fds: tuple[int, ...] = ()
    if program is not None:
        fd = os.memfd_create("test-seccomp", 0)  # fresh per run: bwrap reads from the shared offset
        os.write(fd, program)
        os.lseek(fd, 0, os.SEEK_SET)
        cmd += ["--seccomp", str(fd)]
        fds = (fd,)
    cmd += [PYTHON, "-c", PROBE, *ops]
    try:
        proc = subprocess.run(cmd, pass_fds=fds, capture_output=True, text=True, timeout=60, cwd="/",
                              env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})  # fmt: skip
    finally:
        for fd in fds:
            os.close(fd)
    assert proc.returncode == 0, f"probe failed ({proc.returncode}): {proc.stderr}"
    return json.loads(proc.stdout)


@needs_sandbox
def test_denied_calls_fail_with_eperm(as_user):
    got = run_probe(seccomp.filter_bpf(), [*DENIED, "clone3"], as_user)
    assert got == {**{op: errno.EPERM for op in DENIED}, "clone3": errno.ENOSYS}


@needs_sandbox
def test_each_denial_comes_from_its_rule():
    """The same table with EPERM swapped for a marker errno: every denial above is the filter's doing, not
    the kernel refusing an unprivileged caller (mount, bpf, AF_PACKET... fail with EPERM without a filter)."""
    table = [(name, cmps, MARKER if err == errno.EPERM else err) for name, cmps, err in seccomp.rules()]
    got = run_probe(seccomp.compile_bpf(table), [*DENIED, "clone3"])
    assert got == {**{op: MARKER for op in DENIED}, "clone3": errno.ENOSYS}


@needs_sandbox
def test_without_the_filter_the_probe_reaches_the_kernel():
    """Control: the probe's calls really are made, and some dangerous ones work without the filter."""
    got = run_probe(None, ["socket_inet", "socket_netlink", "ptrace_seize_1", "open_tree", "keyctl",
                           "personality_no_aslr", "clone3", "seccomp_mode"])  # fmt: skip
    assert got == {"socket_inet": 0, "socket_netlink": 0, "ptrace_seize_1": 0, "open_tree": 0, "keyctl": 0,
                   "personality_no_aslr": 0, "clone3": errno.EINVAL, "seccomp_mode": "0"}  # fmt: skip


@needs_sandbox
def test_ordinary_work_runs_under_the_filter(as_user):
    got = run_probe(seccomp.filter_bpf(), [*WORK, "bash_ls", "python", "seccomp_mode"], as_user)
    assert got == {**{op: 0 for op in WORK}, "bash_ls": "ok", "python": "42", "seccomp_mode": "2"}


@needs_sandbox
def test_allow_inet_allows_ip_sockets_on_the_own_loopback_only(as_user):
    ops = ["socket_inet", "socket_inet6", "inet_loopback", "socket_unix", "socket_netlink", "socket_packet",
           "socket_vsock", "socket_inet_high_bits", "socketpair_netlink"]  # fmt: skip
    got = run_probe(seccomp.filter_bpf(allow_inet=True), ops, as_user)
    eperm = errno.EPERM
    assert got == {"socket_inet": 0, "socket_inet6": 0, "inet_loopback": 0, "socket_unix": 0,
                   "socket_netlink": eperm, "socket_packet": eperm, "socket_vsock": eperm,
                   "socket_inet_high_bits": eperm, "socketpair_netlink": eperm}  # fmt: skip


@needs_sandbox
def test_filter_is_inherited_by_grandchildren(as_user):
    """python -> bash -> python: the grandchild's socket(AF_INET) and ptrace(ATTACH, 1) still fail."""
    got = run_probe(seccomp.filter_bpf(), ["grandchild"], as_user)
    assert got == {"grandchild": f"{errno.EPERM} {errno.EPERM}"}


@needs_sandbox
def test_other_abis_are_killed():
    """An i386 syscall (int 0x80) or an x32 number would skip the x86_64 rule table: the process is killed
    with SIGSYS. Without the filter the same calls reach the kernel (getpid works; x32 is not built here)."""
    ops = ["i386_getpid", "x32_getpid"]
    assert run_probe(seccomp.filter_bpf(), ops) == {op: f"signal:{SIGSYS}" for op in ops}
    baseline = run_probe(None, ops)
    assert baseline["i386_getpid"] == 0 and baseline["x32_getpid"] in (0, errno.ENOSYS), baseline


def test_outside_matches_exactly_the_complement():
    def matches(rows, v):
        ops = {seccomp.GT: lambda a: v > a, seccomp.LT: lambda a: v < a, seccomp.EQ: lambda a: v == a}
        return any(all(ops[op](a) for _, op, a, _ in row) for row in rows)

    values = [*range(64), 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**32 + 2, 2**63, 2**64 - 1]
    for allowed in [(1,), (1, 2, 10), (0, 5)]:
        rows = seccomp._outside(0, allowed)
        assert [v for v in values if not matches(rows, v)] == sorted(allowed), allowed


def test_unavailable_reason_names_the_missing_library(monkeypatch):
    monkeypatch.setattr(seccomp, "_LIBRARY", "libseccomp-openk3-missing.so.9")
    reason = seccomp.unavailable_reason()
    assert reason is not None and "libseccomp-openk3-missing.so.9" in reason and "\n" not in reason
    with pytest.raises(RuntimeError, match="libseccomp-openk3-missing"):
        seccomp.compile_bpf(seccomp.rules())


def test_unavailable_reason_names_the_missing_kernel_support(monkeypatch, tmp_path):
    if seccomp.unavailable_reason() is not None:
        pytest.skip(seccomp.unavailable_reason())
    actions = tmp_path / "actions_avail"
    monkeypatch.setattr(seccomp, "_ACTIONS_AVAIL", str(actions))
    assert "no seccomp filters" in seccomp.unavailable_reason() and str(actions) in seccomp.unavailable_reason()
    actions.write_text("kill_thread trap errno allow\n")  # a kernel older than 4.14's kill_process
    assert "kill_process" in seccomp.unavailable_reason()
    actions.write_text("kill_process kill_thread trap errno user_notif trace log allow\n")
    assert seccomp.unavailable_reason() is None


def test_compile_rejects_rows_it_cannot_enforce():
    if seccomp.unavailable_reason() is not None:
        pytest.skip(seccomp.unavailable_reason())
    with pytest.raises(ValueError, match="openk3_nosuchcall"):
        seccomp.compile_bpf([("openk3_nosuchcall", seccomp.ALWAYS, errno.EPERM)])
    with pytest.raises(ValueError, match="errno 0"):
        seccomp.compile_bpf([("ptrace", seccomp.ALWAYS, 0)])
    two_on_one_arg = ((0, seccomp.GE, 3, 0), (0, seccomp.LT, 10, 0))  # libseccomp takes one per argument
    with pytest.raises(ValueError, match="socket"):
        seccomp.compile_bpf([("socket", two_on_one_arg, errno.EPERM)])
