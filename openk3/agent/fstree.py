"""Copy and remove directory trees that sandboxed code wrote, whatever it put in them.

A workspace can hold what path-based tools stumble on: folders nested past PATH_MAX (`cp -a` and
`shutil` name every file by its full path: "File name too long"), nested so deep that a recursive walk
overflows Python's stack, 100k files, symlink loops, FIFOs, sockets, overlay whiteouts (0:0 character
devices), mode-000 folders, names with newlines or bytes that are not UTF-8. Both walks here hold two
directory fds at a time and move with the *at() calls: down by name (O_NOFOLLOW, so never through a
symlink) and up by "..", checked against the (device, inode) recorded on the way down, so a walk never
leaves its tree. Memory grows with the names listed along the current path, not with the depth in fds.

Stdlib only, and a script: the sandbox copies a live workspace out of its tmpfs (and back) inside the
sandbox's own user and mount namespaces, as that namespace's root, with

    /usr/bin/python3 -I -S fstree.py copy SRC DST     # stdout: the problems, one a line; exit 1: no copy

Exit status 0: copied (the problems named); 3: the host failed (HOST_FAILED: its disk is full, or it
fails to read or write); 1: no copy for any other reason (the tree moved under the walk, no memory).
Hard links cost O(1) each whatever the depth: the first copy of a multi-link file is also linked into a
staging folder at the top of the destination, named by the source's (device, inode), and every later name
is linked from there; the folder goes when the copy ends.

It imports nothing beyond the interpreter's own modules (not even json): on a loaded machine each import
is milliseconds on every snapshot.
"""

from __future__ import annotations

import errno
import os
import stat
import sys

# A failure of the host itself (its disk is full, its file table too): the copy cannot be trusted, the
# caller keeps the previous one. Any other error is about one entry and becomes a problem naming it.
HOST_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EROFS}
# Of those, the failures of the host's disk: only these make the caller raise (exit status HOST_FAILED). Memory
# and file-table exhaustion can be the copier's own rlimits, which a hostile tree can reach.
DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS}
HOST_FAILED = 3
MAX_PROBLEMS = 20  # problems named one by one; the rest are counted
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class TreeChanged(OSError):
    """A walk's ".." did not lead back to the folder it came from: something moved the tree under it."""


def _ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _open_dir(name: str, dir_fd: int | None = None) -> int:
    return os.open(name, DIR_FLAGS, dir_fd=dir_fd)


def _up(fd: int, parent: tuple[int, int]) -> int:
    """A new fd of the folder above `fd`, checked to be the one the walk came down from (`fd` stays open)."""
    up = _open_dir("..", fd)
    if _ident(up) != parent:
        os.close(up)
        raise TreeChanged(errno.ESTALE, "the tree was moved during the walk")
    return up


def printable(text: str) -> str:
    """`text` safe for one line of a log: every character that is not printable (newline, carriage return,
    ESC, bidi overrides, ...) escaped as `repr` would, and undecodable bytes (surrogateescape) as \\xNN.
    Sandboxed code chooses file and variable names: none may forge a log line or drive a terminal. A
    backslash stays as it is, so that text escaped once is left alone by a second pass."""
    if text.isprintable():
        return text
    out = []
    for c in text:
        if c.isprintable():
            out.append(c)
        elif "\udc80" <= c <= "\udcff":  # a byte that was not UTF-8
            out.append(f"\\x{ord(c) - 0xDC00:02x}")
        else:
            out.append(repr(c)[1:-1])
    return "".join(out)


def show(parts: list[str]) -> str:
    """A path for a message, on one line: long paths and names shortened, control characters and
    undecodable bytes escaped (`printable`)."""
    if len(parts) > 6:
        parts = [*parts[:2], f"...({len(parts) - 4} more folders)...", *parts[-2:]]
    parts = [p if len(p) <= 60 else f"{p[:28]}...{p[-28:]}" for p in parts]
    return printable("/".join(parts))


class _Copy:
    """One `copy_tree` run: the walk's two current folders, the hard links seen, the problems found."""

    def __init__(self, src: int, dst: int) -> None:
        self.src, self.dst = src, dst  # the current folder on each side (owned: closed by `run`)
        self.src_root, self.dst_root = os.dup(src), os.dup(dst)
        self.links: set[tuple[int, int]] = set()  # (dev, ino) of the multi-link files in the staging folder
        self.stage: tuple[str, int] | None = None  # name and fd of the staging folder, once one is needed
        self.path: list[str] = []  # folder names from the root down to the current folder
        self.problems: list[str] = []
        self.count = 0

    def note(self, name: str | None, what: str, e: OSError, *, host: bool = True) -> None:
        if host and e.errno in HOST_ERRORS:
            raise e
        self.count += 1
        if len(self.problems) < MAX_PROBLEMS:
            where = show([*self.path, name] if name is not None else self.path) or "."
            self.problems.append(f"{where}: {what}: {e.strerror or e}".replace("\n", " "))

    def run(self) -> list[str]:
        try:
            self.walk()
        finally:
            if self.stage is not None:  # a failed copy: the caller drops it, but leave no staging folder
                try:
                    self.drop_stage()
                except OSError:
                    pass
            for fd in {self.src, self.dst, self.src_root, self.dst_root}:
                os.close(fd)
        if self.count > len(self.problems):
            self.problems.append(f"... and {self.count - len(self.problems)} more")
        return self.problems

    def walk(self) -> None:
        # each level: [(dev, ino) of src and dst, its stat, the names still to copy]
        levels = [[_ident(self.src), _ident(self.dst), os.fstat(self.src), self.listing()]]
        self.xattrs(self.src, self.dst, None)
        while True:
            src_id, dst_id, st, names = levels[-1]
            if names:
                name = names.pop()
                try:
                    sub = self.entry(name)
                except OSError as e:
                    self.note(name, "not copied", e)
                    continue
                if sub is not None:  # a folder, now open on both sides: go down
                    os.close(self.src)
                    os.close(self.dst)
                    self.src, self.dst = sub[0], sub[1]
                    self.path.append(name)
                    levels.append([_ident(self.src), _ident(self.dst), sub[2], self.listing()])
                continue
            levels.pop()
            if not levels:
                if self.stage is not None:
                    self.drop_stage()  # before the top folder's times are set: removing it changes them
                self.attrs(self.dst, st)
                return
            # up first, while the folder may still deny its own search bit; then its attributes, after its
            # contents (which changed its times)
            src_up, dst_up = _up(self.src, levels[-1][0]), None
            try:
                dst_up = _up(self.dst, levels[-1][1])
                self.attrs(self.dst, st)
            finally:
                os.close(self.src)
                self.src = src_up
                if dst_up is not None:
                    os.close(self.dst)
                    self.dst = dst_up
            self.path.pop()

    def listing(self) -> list[str]:
        try:
            return os.listdir(self.src)
        except OSError as e:
            self.note(None, "folder not listed", e)
            return []

    def entry(self, name: str) -> tuple[int, int, os.stat_result] | None:
        st = os.stat(name, dir_fd=self.src, follow_symlinks=False)
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            os.mkdir(name, 0o700, dir_fd=self.dst)
            s = _open_dir(name, self.src)
            try:
                d = _open_dir(name, self.dst)
            except OSError:
                os.close(s)
                raise
            self.xattrs(s, d, name)
            return s, d, st
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in self.links:  # another name of a file copied before
            os.link(_stage_name(key), name, src_dir_fd=self.stage[1], dst_dir_fd=self.dst, follow_symlinks=False)
            return None
        if stat.S_ISREG(mode):
            self.file(name, st)
        else:
            if stat.S_ISLNK(mode):
                os.symlink(os.readlink(name, dir_fd=self.src), name, dir_fd=self.dst)
            else:  # FIFO, socket, device (an overlay whiteout is the device 0:0): never opened
                os.mknod(name, mode, st.st_rdev, dir_fd=self.dst)
                os.chmod(name, _safe_mode(mode), dir_fd=self.dst)  # just made here: not a symlink
            os.utime(name, ns=(st.st_atime_ns, st.st_mtime_ns), dir_fd=self.dst, follow_symlinks=False)
        if st.st_nlink > 1:
            self.keep_link(name, key)
        return None

    def file(self, name: str, st: os.stat_result) -> None:
        i = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.src)
        try:
            if (os.fstat(i).st_dev, os.fstat(i).st_ino) != (st.st_dev, st.st_ino):
                raise TreeChanged(errno.ESTALE, "the file was replaced during the copy")
            o = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                        dir_fd=self.dst)
            try:
                if st.st_size:
                    _copy_data(i, o, st.st_size)
                self.xattrs(i, o, name)
                self.attrs(o, st)
            finally:
                os.close(o)
        finally:
            os.close(i)

    def keep_link(self, name: str, key: tuple[int, int]) -> None:
        """Link the first copy of a multi-link file into the staging folder, where its later names find it."""
        if self.stage is None:
            self.stage = self.make_stage()
        try:
            os.link(name, _stage_name(key), src_dir_fd=self.dst, dst_dir_fd=self.stage[1], follow_symlinks=False)
        except OSError as e:  # too many links (EMLINK): its later names become copies
            self.note(name, "hard links not kept (later names are copies)", e)
            return
        self.links.add(key)

    def make_stage(self) -> tuple[str, int]:
        """A new folder at the top of the destination, under a random name the source does not hold."""
        while True:
            name = f".fstree-links-{os.urandom(8).hex()}"
            try:
                os.stat(name, dir_fd=self.src_root, follow_symlinks=False)
                continue
            except OSError:
                pass
            try:
                os.mkdir(name, 0o700, dir_fd=self.dst_root)
            except FileExistsError:
                continue
            return name, _open_dir(name, self.dst_root)

    def drop_stage(self) -> None:
        name, fd = self.stage
        self.stage = None
        try:
            _empty(fd)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=self.dst_root)

    def xattrs(self, i: int, o: int, name: str | None) -> None:
        """Extended attributes (overlay's opaque-folder marks among them) of a file or folder: only those
        two kinds carry user.* attributes."""
        try:
            keys = os.listxattr(i)
        except OSError as e:
            if e.errno != errno.ENOTSUP:
                self.note(name, "attributes not listed", e)
            return
        for key in keys:
            value = b""
            try:
                value = os.getxattr(i, key)
                os.setxattr(o, key, value)
            except OSError as e:  # a value too large for the host's file system (ENOSPC there): this one is lost
                self.note(name, f"extended attribute {key} ({len(value)} bytes) not kept", e, host=False)

    def attrs(self, fd: int, st: os.stat_result) -> None:
        uid, gid = os.geteuid(), os.getegid()
        if (st.st_uid, st.st_gid) != (uid, gid):
            os.fchown(fd, st.st_uid, st.st_gid)
        os.fchmod(fd, _safe_mode(st.st_mode))
        os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))


def _stage_name(key: tuple[int, int]) -> str:
    return f"{key[0]}-{key[1]}"


def _safe_mode(mode: int) -> int:
    """Permission bits without set-user/group-id: a layer must not hold a setuid binary of the sandbox uid
    for a local user to run."""
    return stat.S_IMODE(mode) & ~(stat.S_ISUID | stat.S_ISGID)


def _copy_data(i: int, o: int, size: int) -> None:
    """The bytes of a file, holes kept as holes (a sparse 200 MB file on the tmpfs stays small on disk)."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(i, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno != errno.ENXIO:  # ENXIO: only a hole is left
                raise
            break
        end = min(os.lseek(i, start, os.SEEK_HOLE), size)
        os.lseek(o, start, os.SEEK_SET)
        while start < end:
            sent = os.sendfile(o, i, start, min(end - start, 1 << 30))
            if sent == 0:  # the file shrank under the copy: what is there is copied
                break
            start += sent
        if start < end or end <= pos:
            break
        pos = end
    os.ftruncate(o, size)


def copy_tree(src: str, dst: str) -> list[str]:
    """Copy folder `src` (contents and the folder's own attributes) into folder `dst`, created if missing:
    every kind of entry, hard links as links, holes, times, modes (set-id bits dropped), extended
    attributes, owners where they differ from the copier's. Returns the problems, each naming its path;
    raises OSError on a failure of the host (HOST_ERRORS) or when `src` or `dst` cannot be opened."""
    try:
        os.mkdir(dst, 0o700)
    except FileExistsError:
        pass
    s = _open_dir(src)
    try:
        d = _open_dir(dst)
    except OSError:
        os.close(s)
        raise
    return _Copy(s, d).run()


def _enter(name: str, dir_fd: int | None) -> int:
    """Open a folder to empty it, making it searchable first if its mode denies that (only ever a folder
    inside the tree: the chmod goes through an O_PATH fd of the very folder, never a path)."""
    try:
        fd = _open_dir(name, dir_fd)
    except PermissionError:
        p = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            os.chmod(f"/proc/self/fd/{p}", 0o700)
        finally:
            os.close(p)
        fd = _open_dir(name, dir_fd)
    if os.geteuid() != 0 and stat.S_IMODE(os.fstat(fd).st_mode) & 0o700 != 0o700:
        try:
            os.fchmod(fd, 0o700)  # entries can only be unlinked from a writable folder
        except OSError:
            pass
    return fd


def remove_tree(path: str) -> int:
    """Remove `path` and everything below it, never following a symlink and never changing anything outside
    it. Never raises: returns how many entries could not be removed (0 when `path` is gone)."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
            return 0
        fd = _enter(path, None)
    except FileNotFoundError:
        return 0
    except OSError:
        return 1
    try:
        failed = _empty(fd)
    finally:
        os.close(fd)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        failed += 1
    return failed


def _empty(root: int) -> int:
    """Remove everything inside the open folder `root` (which stays open); returns the failures."""
    failed = 0
    fd = root
    levels = [["", _ident(root), _listing(root)]]  # [name, (dev, ino), names left]
    try:
        while levels:
            names = levels[-1][2]
            if names:
                name = names.pop()
                try:
                    if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                        os.unlink(name, dir_fd=fd)
                        continue
                    sub = _enter(name, fd)
                except OSError:
                    failed += 1
                    continue
                if fd != root:
                    os.close(fd)
                fd = sub
                levels.append([name, _ident(fd), _listing(fd)])
                continue
            name = levels.pop()[0]
            if not levels:
                break
            up = _up(fd, levels[-1][1])
            os.close(fd)
            fd = up
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError:
                failed += 1
    except OSError:  # the tree moved under the walk: stop rather than remove anything elsewhere
        failed += 1
    finally:
        if fd != root:
            os.close(fd)
    return failed


def _listing(fd: int) -> list[str]:
    try:
        return os.listdir(fd)
    except OSError:
        return []


def main(argv: list[str]) -> int:
    if len(argv) != 4 or argv[1] != "copy":
        print("usage: fstree.py copy SRC DST", file=sys.stderr)
        return 2
    try:
        problems = copy_tree(argv[2], argv[3])
    except OSError as e:
        print(f"{e.strerror or e} ({show([e.filename]) if isinstance(e.filename, str) else 'copying'})",
              file=sys.stderr)
        return HOST_FAILED if e.errno in DISK_ERRORS else 1
    except MemoryError:
        print("out of memory (the copier's address-space limit)", file=sys.stderr)
        return 1
    for problem in problems:
        print(problem)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
