"""Build a small C source into a shared library on first use, cache it per machine, load it with ctypes.

The CPU kernels (`moe_cpu.py`, `moe_mxfp4_cpu.py`) are plain C compiled with the system compiler (`$CC`,
else `cc`; `$CC` may carry arguments) at `-O3 -march=native`, so they fit the machine they run on.
Each library is cached in `$OPENK3_KERNEL_CACHE` (else `$XDG_CACHE_HOME/openk3/kernels`, else
`~/.cache/openk3/kernels`, else one fixed directory per user under the temporary directory) under a key
of source + flags + compiler version + architecture + CPU flags: a library built for one CPU is never
loaded on another. Writes are atomic (temp + rename), and a library that does not load is never cached.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile

# -ffp-contract=fast lets the compiler fuse multiply-adds; `omp simd` pragmas allow vectorised
# reductions (another summation order than torch's, within rounding; the kernels' float64 tests bound it).
FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=fast", "-shared", "-fPIC"]


def cache_dir() -> str:
    path = os.environ.get("OPENK3_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "openk3", "kernels")
    for candidate in (path, os.path.join(tempfile.gettempdir(), f"openk3-kernels-{os.getuid()}")):
        try:  # the fallback is one fixed directory per user, not a new one per process
            os.makedirs(candidate, exist_ok=True)
            if os.access(candidate, os.W_OK):
                return candidate
        except OSError:
            pass
    raise RuntimeError(f"no writable kernel cache directory ({path} and the temporary directory are not)")


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
    flags = FLAGS if flags is None else flags
    cc = shlex.split(os.environ.get("CC") or "cc")
    if not cc or shutil.which(cc[0]) is None:
        raise RuntimeError(f"no C compiler ({os.environ.get('CC') or 'cc'!r} not found)")
    key = hashlib.sha256(machine_key(source, flags, cc).encode()).hexdigest()[:16]
    out_dir = cache_dir()
    lib_path = os.path.join(out_dir, f"{prefix}_{key}.so")
    if not os.path.exists(lib_path):
        fd, tmp_so = tempfile.mkstemp(suffix=".so", dir=out_dir)
        os.close(fd)
        src = tmp_so[:-3] + ".c"
        try:
            with open(src, "w") as fh:
                fh.write(source)
            res = subprocess.run([*cc, *flags, src, "-o", tmp_so, "-lm"], capture_output=True, text=True,
                                 timeout=300)
            if res.returncode != 0:
                raise RuntimeError(f"{' '.join(cc)} failed: {res.stderr.strip()[-400:]}")
            ctypes.CDLL(tmp_so)  # a compiler that "succeeds" without a loadable library must not be cached
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp_so, 0o755 & ~umask)  # mkstemp made it 0600: others sharing the cache could not load it
            os.replace(tmp_so, lib_path)  # atomic: a concurrent builder sees the old or the complete file
        finally:
            for path in (src, tmp_so):
                if os.path.exists(path):
                    os.unlink(path)
    return ctypes.CDLL(lib_path)


def disabled() -> bool:
    """`OPENK3_NO_KERNELS` set to anything but "" or "0": use torch operators only."""
    return os.environ.get("OPENK3_NO_KERNELS", "0") not in ("", "0")
