"""Build a small C source into a shared library on first use, cache it per machine, load it with ctypes.

The CPU kernels (`moe_cpu.py`, `moe_mxfp4_cpu.py`) are plain C compiled with the system compiler (`$CC`,
else `cc`; `$CC` may carry arguments) at `-O3 -march=native`, so they fit the machine they run on.
`$OPENK3_KERNEL_ISA` (x86-64 only) builds them for less than the machine has: `avx2` (x86-64-v3: AVX2 and FMA,
no AVX-512) or `default` (baseline x86-64: SSE2), so that one machine tests the paths other CPUs take
(`scripts/test.sh --isa avx2|default`).
Each library is cached in `$OPENK3_KERNEL_CACHE` (else `$XDG_CACHE_HOME/openk3/kernels`, else
`~/.cache/openk3/kernels`, else one fixed directory per user under the temporary directory) under a key
of source + flags + compiler version + architecture + CPU flags: a library built for one CPU is never
loaded on another. Writes are atomic (built in a private temporary directory, then renamed), and a
library that does not load is never cached. The temporary-directory fallback is used only when it is a
private directory of this user.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
import warnings

# -ffp-contract=fast lets the compiler fuse multiply-adds; `omp simd` pragmas allow vectorised
# reductions (another summation order than torch's, within rounding; the kernels' float64 tests bound it).
# The -march flag comes from `isa_flags()`.
FLAGS = ["-O3", "-fopenmp-simd", "-ffp-contract=fast", "-shared", "-fPIC"]
#: $OPENK3_KERNEL_ISA -> the target flag: the machine's own instruction set, or x86-64 levels below it.
ISAS = {"native": "-march=native", "avx2": "-march=x86-64-v3", "default": "-march=x86-64"}


def isa_flags() -> list[str]:
    """The -march flag for $OPENK3_KERNEL_ISA (default "native"). ValueError names a bad value; asking an x86
    level of another architecture is an error too (the compiler would refuse it)."""
    isa = os.environ.get("OPENK3_KERNEL_ISA", "").strip().lower() or "native"
    if isa not in ISAS:
        raise ValueError(f"OPENK3_KERNEL_ISA must be one of {', '.join(ISAS)}, got {isa!r}")
    if isa != "native" and platform.machine().lower() not in ("x86_64", "amd64"):
        raise ValueError(f"OPENK3_KERNEL_ISA={isa} names an x86-64 level; this machine is {platform.machine()}")
    return [ISAS[isa]]


def _private(path: str) -> bool:
    """A real directory (not a link) owned by this user that no one else may write to."""
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def cache_dir() -> str:
    path = os.environ.get("OPENK3_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "openk3", "kernels")
    # The fallback is one fixed directory per user, not a new one per process. Its name is predictable in a
    # shared temporary directory, so it is used only if it is ours and private: anyone who could write there
    # could plant a library this process would load.
    fallback = os.path.join(tempfile.gettempdir(), f"openk3-kernels-{os.getuid()}")
    for candidate, private in ((path, False), (fallback, True)):
        try:
            os.makedirs(candidate, mode=0o700 if private else 0o777, exist_ok=True)
            if (not private or _private(candidate)) and os.access(candidate, os.W_OK):
                return candidate
        except OSError:
            pass
    raise RuntimeError(f"no writable kernel cache directory ({path} is not; {fallback} is not, or is not "
                       "a private directory of this user)")


def machine_key(source: str, flags: list[str], cc: list[str]) -> str:
    """Compiler version, architecture and CPU flags: a library built with -march=native is only reused on
    a machine like the one that built it."""
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as fh:  # x86: "flags", aarch64: "Features"
            cpu = next((line for line in fh if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return "\n".join([source, " ".join(flags), " ".join(cc), version, platform.machine(), cpu])


def build(prefix: str, source: str, flags: list[str] | None = None) -> ctypes.CDLL:
    """Compile `source` (C) into `<cache>/<prefix>_<key>.so` unless already there; return it loaded.
    Raises RuntimeError when there is no compiler or it fails (callers fall back to torch operators)."""
    flags = [*isa_flags(), *FLAGS] if flags is None else flags
    cc = shlex.split(os.environ.get("CC") or "cc")
    if not cc or shutil.which(cc[0]) is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC') or 'cc'!r} not found)")
    key = hashlib.sha256(machine_key(source, flags, cc).encode()).hexdigest()[:16]
    out_dir = cache_dir()
    lib_path = os.path.join(out_dir, f"{prefix}_{key}.so")
    if not os.path.exists(lib_path):
        # Source and library are written in a fresh private directory (mkdtemp: 0700, a unique name), not
        # beside the cache's files: in a shared cache, a name derived from a temporary one could be
        # planted (e.g. as a link) by another user between its creation and our write.
        work = tempfile.mkdtemp(prefix=f".{prefix}-build-", dir=out_dir)
        try:
            src, tmp_so = os.path.join(work, "kernel.c"), os.path.join(work, "kernel.so")
            with open(src, "w") as fh:
                fh.write(source)
            res = subprocess.run([*cc, *flags, src, "-o", tmp_so, "-lm"], capture_output=True, text=True,
                                 timeout=300)
            if res.returncode != 0:
                raise RuntimeError(f"{' '.join(cc)} failed: {res.stderr.strip()[-400:]}")
            ctypes.CDLL(tmp_so)  # a compiler that "succeeds" without a loadable library must not be cached
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp_so, 0o755 & ~umask)  # others sharing the cache may load it
            os.replace(tmp_so, lib_path)  # atomic: a concurrent builder sees the old or the complete file
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return ctypes.CDLL(lib_path)


def disabled() -> bool:
    """`OPENK3_NO_KERNELS` set to anything but "" or "0": use torch operators only."""
    return os.environ.get("OPENK3_NO_KERNELS", "0") not in ("", "0")


def load(prefix: str, source: str, functions: dict[str, list], what: str) -> ctypes.CDLL | None:
    """`build` and declare each of `functions` (name -> ctypes argument types; all return int), or None with
    one RuntimeWarning naming `what` when kernels are disabled (`disabled()`, no warning) or the build fails:
    callers keep their torch paths. Kernel modules cache the result per process."""
    if disabled():
        return None
    isa_flags()  # a bad $OPENK3_KERNEL_ISA is the user's error, not a missing compiler
    try:
        lib = build(prefix, source)
    except Exception as e:  # noqa: BLE001 - any build failure only costs speed
        warnings.warn(f"openk3: the {what} is unavailable ({e}); using torch operators", RuntimeWarning,
                      stacklevel=4)
        return None
    for name, argtypes in functions.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    return lib
