"""The seccomp layer of the agent sandbox: a BPF program that denies a list of syscalls, allows the rest.

bwrap installs the program in the sandboxed command just before exec (`bwrap --seccomp FD`, FD a readable fd
holding `filter_bpf()`); every descendant inherits it and no process can remove it. The filter is the kernel
boundary for what the namespaces do not cover (design: next-agents-serving.md §1.2 row 7, escapes N5, N6, P3,
P6, P8 in §2): reaching into bwrap's unfiltered pid 1 (ptrace, process_vm_*, pidfd_getfd), io_uring (it opens
sockets and files without the syscalls a filter sees), new namespaces and mounts, kernel keyrings, modules,
BPF, perf, TTY input injection, and sockets other than AF_UNIX (plus AF_INET/AF_INET6 for mock services on the
sandbox's own `lo` when asked). Denied calls fail with EPERM, so programs report an error instead of dying;
clone3 fails with ENOSYS because its flags sit in memory a filter cannot read, and glibc then falls back to
clone, whose flags it can. A syscall made through another ABI (i386 `int 0x80`, x32 numbers) kills the process:
the rule table is for the native ABI only, so letting it through would bypass every row.

Built with ctypes over the system libseccomp (`libseccomp.so.2`, 2.5 or newer); no Python dependency.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import socket
from collections.abc import Iterable, Sequence

_LIBRARY = "libseccomp.so.2"
_ACTIONS_AVAIL = "/proc/sys/kernel/seccomp/actions_avail"  # the kernel's seccomp actions (Linux 4.14+)

# libseccomp's ABI (seccomp.h): actions, filter attributes and argument comparison operators.
_ACT_KILL_PROCESS = 0x8000_0000
_ACT_ERRNO = 0x0005_0000  # | errno
_ACT_ALLOW = 0x7FFF_0000
_ATTR_ACT_BADARCH = 2
_NR_SCMP_ERROR = -1  # seccomp_syscall_resolve_name: a name libseccomp does not know
NE, LT, LE, EQ, GE, GT, MASKED_EQ = range(1, 8)

# One argument comparison: (argument index, operator, datum_a, datum_b); MASKED_EQ is (arg & a) == b.
Cmp = tuple[int, int, int, int]
# One row of the table: the syscall fails with `errno` when every comparison holds (none: always).
# Several rows for one syscall are alternatives (OR).
Rule = tuple[str, tuple[Cmp, ...], int]

ALWAYS: tuple[Cmp, ...] = ()


def _has_bit(arg: int, bit: int) -> tuple[Cmp, ...]:
    return ((arg, MASKED_EQ, bit, bit),)


def _int_eq(arg: int, value: int) -> tuple[Cmp, ...]:
    # The kernel reads this argument as a 32-bit int and ignores the upper half of the register, so compare
    # the lower 32 bits only: a plain EQ is bypassed by value | 1 << 32 (Flatpak's CVE-2019-10063).
    return ((arg, MASKED_EQ, 0xFFFF_FFFF, value),)


def _outside(arg: int, allowed: Sequence[int]) -> list[tuple[Cmp, ...]]:
    """Rows that together match every value of `arg` except the small non-negative ints in `allowed`.
    libseccomp takes one comparison per argument and rule, so the complement is a union: below the
    smallest, each gap value, above the largest. The comparisons are on all 64 bits, so a value with
    high bits set (2**32 + AF_INET, which the kernel's int would read as AF_INET) is above the largest."""
    lo, hi = min(allowed), max(allowed)
    rows = [((arg, GT, hi, 0),)]
    if lo > 0:
        rows.append(((arg, LT, lo, 0),))
    rows += [((arg, EQ, v, 0),) for v in range(lo + 1, hi) if v not in allowed]
    return rows


# Denied whatever the arguments. Each group says why a sandboxed tool has no business calling it.
_DENIED = (
    # reaching into another process (escape P3: without --as-pid-1, bwrap's reaper is pid 1, unfiltered)
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "process_madvise",
    "move_pages", "migrate_pages",  # Flatpak's NUMA calls that act on another process (the own-memory ones stay)
    # io_uring performs socket/open/connect as ring operations no filter sees (escape N6)
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    # kernel attack surface: tracing, BPF, page-fault handling, kernel code loading
    "perf_event_open", "bpf", "userfaultfd", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module",
    # changing the mount view or the namespaces bwrap set up (escape P6), old and new mount APIs
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    # kernel keyrings: only partly namespaced (Docker's default profile denies them too), a CVE-prone surface
    "keyctl", "add_key", "request_key",
    # Flatpak's list: the host's kernel log, obsolete (uselib, 16-bit LDT segments) or privileged interfaces
    "syslog", "uselib", "acct", "modify_ldt", "quotactl", "quotactl_fd", "swapon", "swapoff", "reboot",
)  # fmt: skip

# clone flags that create namespaces: the same operation as unshare, through clone. CLONE_NEWTIME is left out:
# clone() cannot take it (its bit is part of the exit-signal byte there), only clone3 and unshare can.
# (<linux/sched.h>; Python has os.CLONE_* only from 3.12)
_NAMESPACE_FLAGS = (
    0x0002_0000,  # CLONE_NEWNS
    0x0200_0000,  # CLONE_NEWCGROUP
    0x0400_0000,  # CLONE_NEWUTS
    0x0800_0000,  # CLONE_NEWIPC
    0x1000_0000,  # CLONE_NEWUSER
    0x2000_0000,  # CLONE_NEWPID
    0x4000_0000,  # CLONE_NEWNET
)
_PER_LINUX = 0  # the default personality
_TIOCSTI = 0x5412  # push a byte into a terminal's input: type commands into the user's shell (escape P8)
_TIOCLINUX = 0x541C  # virtual-console tricks, including selection paste (same effect)


def rules(*, allow_inet: bool = False) -> list[Rule]:
    """The deny table: (syscall, argument comparisons, errno) rows over a default of allow."""
    families = (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6) if allow_inet else (socket.AF_UNIX,)
    eperm = errno.EPERM
    return [
        *((name, ALWAYS, eperm) for name in _DENIED),
        ("clone3", ALWAYS, errno.ENOSYS),
        *(("clone", _has_bit(0, flag), eperm) for flag in _NAMESPACE_FLAGS),
        # personality(0xffffffff), the query, is refused too (as in Flatpak): nothing ordinary asks.
        ("personality", ((0, NE, _PER_LINUX, 0),), eperm),
        ("ioctl", _int_eq(1, _TIOCSTI), eperm),
        ("ioctl", _int_eq(1, _TIOCLINUX), eperm),
        # netlink, packet, vsock, ... (escape N5): every family but the allowed ones, for both calls
        *(("socket", cmps, eperm) for cmps in _outside(0, families)),
        *(("socketpair", cmps, eperm) for cmps in _outside(0, families)),
    ]


# ---- ctypes layer --------------------------------------------------------------------------------------


class _ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]  # fmt: skip


class _Version(ctypes.Structure):  # struct scmp_version
    _fields_ = [("major", ctypes.c_uint), ("minor", ctypes.c_uint), ("micro", ctypes.c_uint)]


@functools.cache
def _load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    ctx = ctypes.c_void_p
    signatures = {
        "seccomp_version": (ctypes.POINTER(_Version), []),
        "seccomp_init": (ctx, [ctypes.c_uint32]),
        "seccomp_release": (None, [ctx]),
        "seccomp_attr_set": (ctypes.c_int, [ctx, ctypes.c_int, ctypes.c_uint32]),
        "seccomp_syscall_resolve_name": (ctypes.c_int, [ctypes.c_char_p]),
        "seccomp_rule_add_array": (
            ctypes.c_int, [ctx, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp)]),
        "seccomp_export_bpf": (ctypes.c_int, [ctx, ctypes.c_int]),
    }  # fmt: skip
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)  # AttributeError for a library too old to have it: caught as "too old"
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _version(lib: ctypes.CDLL) -> tuple[int, int, int]:
    v = lib.seccomp_version().contents
    return v.major, v.minor, v.micro


def unavailable_reason() -> str | None:
    """None when the filter can be built and enforced here; otherwise one line naming what is missing.
    The sandbox refuses to start on a reason: it never runs without the filter."""
    try:
        lib = _load(_LIBRARY)
    except OSError as e:
        return f"cannot load {_LIBRARY} ({e}); install the libseccomp2 package"
    except AttributeError as e:
        return f"{_LIBRARY} is too old ({e}); need libseccomp 2.5 or newer"
    if _version(lib) < (2, 5, 0):
        return f"{_LIBRARY} is version {'.'.join(map(str, _version(lib)))}; need 2.5 or newer"
    try:
        with open(_ACTIONS_AVAIL) as fh:
            actions = set(fh.read().split())
    except OSError as e:
        return f"the kernel has no seccomp filters ({_ACTIONS_AVAIL}: {e.strerror})"
    missing = sorted({"allow", "errno", "kill_process"} - actions)
    if missing:
        return f"the kernel lacks the seccomp action(s) {', '.join(missing)} ({_ACTIONS_AVAIL})"
    return None


def _check(rc: int, what: str) -> None:
    if rc < 0:  # libseccomp returns -errno
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")


def compile_bpf(table: Iterable[Rule]) -> bytes:
    """The BPF program (struct sock_filter array, native byte order) for a deny table over default allow,
    for the native architecture; other ABIs are killed. Raises RuntimeError when seccomp is unavailable
    (with `unavailable_reason()`), ValueError for a row libseccomp cannot take."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"seccomp filter unavailable: {reason}")
    lib = _load(_LIBRARY)
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise MemoryError("seccomp_init failed")
    try:
        _check(lib.seccomp_attr_set(ctx, _ATTR_ACT_BADARCH, _ACT_KILL_PROCESS), "seccomp_attr_set(ACT_BADARCH)")
        for name, cmps, err in table:
            if not 0 < err < 4096:
                raise ValueError(f"seccomp rule {name}: errno {err} is not in 1..4095")
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr == _NR_SCMP_ERROR:
                version = ".".join(map(str, _version(lib)))
                raise ValueError(f"seccomp rule {name}: libseccomp {version} does not know this syscall")
            if nr < 0:  # a pseudo number: the syscall does not exist on this architecture, nothing to deny
                continue
            array = (_ArgCmp * len(cmps))(*(_ArgCmp(*c) for c in cmps)) if cmps else None
            rc = lib.seccomp_rule_add_array(ctx, _ACT_ERRNO | err, nr, len(cmps), array)
            if rc < 0:
                raise ValueError(f"seccomp rule {name} {cmps} -> errno {err}: libseccomp refused it "
                                 f"({os.strerror(-rc)})")  # fmt: skip
        fd = os.memfd_create("openk3-seccomp", os.MFD_CLOEXEC)
        try:
            _check(lib.seccomp_export_bpf(ctx, fd), "seccomp_export_bpf")
            program = os.pread(fd, os.fstat(fd).st_size, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)
    assert program and len(program) % 8 == 0, f"seccomp_export_bpf wrote {len(program)} bytes, not sock_filters"
    return program


@functools.cache
def filter_bpf(*, allow_inet: bool = False) -> bytes:
    """The sandbox's seccomp program: `rules(allow_inet=...)` compiled for the native architecture.
    Pass it to bwrap as `--seccomp FD` with FD a readable fd positioned at its start (a memfd or a pipe,
    inherited through `pass_fds`); bwrap reads it from the current offset, so use a fresh fd per sandbox.
    allow_inet=True also allows AF_INET/AF_INET6 sockets, for mock services on the sandbox's own `lo`."""
    return compile_bpf(rules(allow_inet=allow_inet))
