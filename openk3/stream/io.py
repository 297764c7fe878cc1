"""Reading experts from the shards into cache slots: positional reads from a few threads, O_DIRECT where the
filesystem allows it.

Why O_DIRECT: the cache is ours (`ExpertCache`), the routing is flat and RAM is short, so the page cache only
costs a second copy and, under memory pressure, bandwidth (a port measured buffered reads of K3 experts at
1.8 GB/s where direct ones reached 6.3 on the same drive). Why threads and `os.preadv`: one expert is a
17.5 MB read, ~400 reads/s per 7 GB/s, so two to four reads in flight fill a drive and Python threads (the
GIL is released in the syscall) give that queue depth without io_uring.

Every failure names the file and the offset: an I/O error, a short read (a shard truncated after the load
checked it), a file that went missing.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from openk3.stream.index import ALIGN, Extent


class ExpertReadError(ValueError):
    """A routed expert could not be read; the message names the file and the byte offset."""


class Reader:
    """Reads `Extent`s of the shards in `folder` into memory, `threads` at a time.

    `direct`: True demands O_DIRECT (ValueError where a shard's filesystem refuses it), False never uses it,
    None (default) uses it where the filesystem accepts it and buffered reads elsewhere (tmpfs, some network
    filesystems). `direct_files` / `buffered_files` say which happened.

    `pread` is the one syscall every read goes through (`os.preadv`); tests replace it to inject faults.
    """

    def __init__(self, folder: Path, files: list[str], *, threads: int = 4, direct: bool | None = None) -> None:
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"io_threads must be a positive integer, got {threads!r}")
        if direct not in (None, True, False):
            raise ValueError(f"direct must be None, True or False, got {direct!r}")
        self.folder = folder
        self.threads = threads
        self.pread = os.preadv
        self._fds: dict[str, tuple[int, bool]] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0  # bytes asked of the disk (direct reads round to ALIGN)
        self.read_seconds = 0.0  # summed over threads
        try:
            for f in files:
                self._fds[f] = _open(folder / f, direct)
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="openk3-expert-read")

    @property
    def direct_files(self) -> list[str]:
        return [f for f, (_, d) in self._fds.items() if d]

    @property
    def buffered_files(self) -> list[str]:
        return [f for f, (_, d) in self._fds.items() if not d]

    def submit(self, fn, *args) -> Future:
        """Run `fn(*args)` on a pool thread (`read` and whatever checks the caller adds)."""
        return self._pool.submit(fn, *args)

    def read(self, extents: tuple[Extent, ...], slot_mv: memoryview) -> None:
        """Read every extent into its region of `slot_mv` (one cache slot, ALIGN-aligned)."""
        t0 = time.perf_counter()
        n = sum(self._read(x, slot_mv) for x in extents)
        with self._lock:
            self.bytes_read += n
            self.read_seconds += time.perf_counter() - t0

    def _read(self, x: Extent, slot_mv: memoryview) -> int:
        """One extent: a direct read of its ALIGN-rounded span (starting `pad` bytes early) or a buffered read of
        exactly its bytes at region + pad. Returns the bytes read."""
        fd, direct = self._fds[x.file]
        if direct:
            pos, want, need = x.offset - x.pad, x.region_bytes, x.pad + x.length
            buf = slot_mv[x.region:x.region + want]
        else:
            pos, want, need = x.offset, x.length, x.length
            buf = slot_mv[x.region + x.pad:x.region + x.pad + x.length]
        got = 0
        while got < need:
            try:
                n = self.pread(fd, [buf[got:]], pos + got)
            except OSError as e:
                raise ExpertReadError(f"{self.folder / x.file}: cannot read {x.length} bytes at offset {x.offset} "
                                      f"({'direct' if direct else 'buffered'} read at {pos + got}: {e})") from None
            if n <= 0:
                raise ExpertReadError(f"{self.folder / x.file}: short read at offset {pos + got}: the file ends "
                                      f"{got} of {need} bytes into the expert at offset {x.offset} (truncated "
                                      f"shard?)")
            got += n
            if direct and got < need and got % ALIGN:  # a short direct read not at EOF cannot continue aligned
                raise ExpertReadError(f"{self.folder / x.file}: short direct read at offset {pos}: {got} of {need} "
                                      f"bytes (truncated shard?)")
        return min(got, want)

    def close(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _open(path: Path, direct: bool | None) -> tuple[int, bool]:
    """(descriptor, is_direct): O_DIRECT when asked or allowed, verified by one aligned read (some filesystems
    accept the flag at open and fail the read)."""
    if not path.is_file():
        raise ValueError(f"{path}: shard file is missing")
    if direct is not False and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if direct:
                raise ValueError(f"{path}: O_DIRECT is refused here ({e}); use direct=False / --io buffered") from None
        else:
            if _direct_read_works(fd):
                return fd, True
            os.close(fd)
            if direct:
                raise ValueError(f"{path}: this filesystem refuses O_DIRECT reads; use direct=False / --io buffered")
    elif direct:
        raise ValueError("O_DIRECT is not available on this platform; use direct=False / --io buffered")
    try:
        return os.open(path, os.O_RDONLY), False
    except OSError as e:
        raise ValueError(f"{path}: cannot open ({e})") from None


def _direct_read_works(fd: int) -> bool:
    import mmap

    buf = mmap.mmap(-1, ALIGN)  # page-aligned
    try:
        os.preadv(fd, [buf], 0)
        return True
    except OSError:
        return False
    finally:
        buf.close()
