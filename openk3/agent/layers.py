"""The state store of a sandbox family: sealed read-only layers, live uppers, and snapshot records.

A sandbox's `/workspace` is an overlayfs: its read-only lower layers are sealed snapshots (oldest last in
the mount option, as overlayfs wants), its upper is the live delta. So

    snapshot = seal: copy the upper out of its tmpfs into a new layer, start a fresh empty upper;
    restore  = drop the upper, start a fresh one over the snapshot's layers;
    fork(n)  = snapshot once, then n fresh uppers over the same layers (children share every byte).

Layers are never written after sealing, so any number of sandboxes can stack them. The store lives in one
folder (`root/`) that all sandboxes forked from one another share; it is deleted when the last of them
closes. Whiteouts (deleted lower files) are 0/0 character devices and opaque directories carry the
`user.overlay.opaque` xattr (the mount uses `userxattr`, which is what an unprivileged overlay needs); a
sealed upper keeps both, so deletions survive restacking.

Layout (short names: the lowerdir mount option must fit in one page, ~4 KiB):
    root/l/<id>/        sealed layers (root/l/base is the initial workspace)
    root/u/<id>/t       mount point of a live sandbox's tmpfs (its upper and overlay work dir, in RAM)
    root/u/<id>/saved   that upper copied to disk when the sandbox's processes stop between snapshots
    root/m/<id>/        mount points (inside each sandbox's own mount namespace)
    root/s/<id>.json    snapshot records: {"layers": [...], "cwd": str, "env": {...}}
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import threading

from .fstree import remove_tree
from .proc import owner_gone, pid_ns, start_time

MAX_LAYERS = 48  # deeper stacks are refused with a clear message (overlay lookups slow down with depth)
MAX_LOWERDIR = 3000  # bytes of the lowerdir option: the whole mount option string must fit in one 4 KiB page
# "<host pid> <its start time> <its PID namespace>": a store whose owner is gone is removed at start-up
OWNER_FILE = "owner"


def new_id() -> str:
    return secrets.token_hex(6)


def inside(root: str, p: str) -> bool:
    """`p` is `root` or below it (lexically; both absolute or both relative)."""
    root, p = os.path.normpath(root), os.path.normpath(p)
    return p == root or p.startswith(root.rstrip(os.sep) + os.sep)


def rmtree(path: str) -> None:
    """Remove a tree that sandboxed code wrote (`fstree.remove_tree`): it may hold mode-000 dirs (overlay's
    work dir, or made so on purpose), whiteout devices, and folders nested past PATH_MAX or deeper than any
    recursive walk goes. Never follows a symlink, never changes anything outside `path` (an error on `path`
    itself, from another process removing the same stale store first, once made this chmod its parent,
    /tmp, to 0700, and every sandbox uid was locked out), never raises: what cannot be removed stays."""
    remove_tree(path)


class LayerStore:
    """One folder of layers shared by a sandbox and its forks; reference-counted by them."""

    def __init__(self, root: str, owner: tuple[int, int] | None) -> None:
        self.root = root
        self.owner = owner  # (uid, gid) the sandbox processes run as, when the host is root
        self._refs = 0
        self._lock = threading.Lock()
        # Only the store's owner (and, as root, the sandbox uid) can enter its folders: layers may hold files
        # the sandboxed code made, which no other local user should reach.
        for sub in ("l", "u", "m", "s"):
            os.makedirs(os.path.join(root, sub), exist_ok=True)
            os.chmod(os.path.join(root, sub), 0o700)
            self._chown(os.path.join(root, sub))
        os.chmod(root, 0o711)
        self._chown(root)
        tmp = os.path.join(root, OWNER_FILE + ".tmp")
        with open(tmp, "w") as f:  # whole or absent: a partial record could read as an older, shorter one
            f.write(f"{os.getpid()} {start_time(os.getpid())} {pid_ns() or 0}")
        os.replace(tmp, os.path.join(root, OWNER_FILE))

    # ---- reference counting -----------------------------------------------------------------------

    def acquire(self) -> None:
        with self._lock:
            self._refs += 1

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            rmtree(self.root)

    # ---- layers -------------------------------------------------------------------------------------

    def layer_path(self, layer_id: str) -> str:
        return os.path.join(self.root, "l", layer_id)

    def make_base(self, files: dict[str, str | bytes] | None, base_dir: str | None) -> str:
        """The first layer: a copy of `base_dir` and/or the given files (paths relative to /workspace)."""
        path = self.layer_path("base")
        if base_dir is not None:
            if not os.path.isdir(base_dir):
                raise ValueError(f"Sandbox(base_dir=): {base_dir!r} is not a directory")
            # symlinks are copied as links (resolved later inside the sandbox's view, never on the host)
            shutil.copytree(base_dir, path, symlinks=True)
        else:
            os.makedirs(path)
        for rel, content in (files or {}).items():
            dest = _inside(path, rel)
            _no_symlink_on_the_way(path, dest, rel)  # base_dir may hold links: never write through one
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            _no_symlink_on_the_way(path, dest, rel)
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else bytes(content))
        self._chown_tree(path)
        return "base"

    def new_upper(self, sandbox_id: str) -> tuple[str, str]:
        """A fresh delta for one sandbox: (tmpfs mount point, mount point of the merged /workspace).
        The live upper is a size-capped tmpfs inside the sandbox's own mount namespace (that is what bounds
        /workspace); `saved_path` holds it on disk between incarnations."""
        u = os.path.join(self.root, "u", sandbox_id)
        rmtree(u)
        t = os.path.join(u, "t")
        mnt = os.path.join(self.root, "m", sandbox_id)
        for d in (u, t, mnt):
            os.makedirs(d, exist_ok=True)
            self._chown(d)
        return t, mnt

    def saved_path(self, sandbox_id: str) -> str:
        return os.path.join(self.root, "u", sandbox_id, "saved")

    def drop_upper(self, sandbox_id: str) -> None:
        rmtree(os.path.join(self.root, "u", sandbox_id))
        rmtree(os.path.join(self.root, "m", sandbox_id))

    def seal(self, sandbox_id: str, layers: list[str]) -> list[str]:
        """Turn the sandbox's saved delta into a new top layer; returns the new layer list (top first)."""
        saved = self.saved_path(sandbox_id)
        if not os.path.isdir(saved) or not os.listdir(saved):  # nothing changed since the last seal
            return list(layers)
        layer_id = new_id()
        os.rename(saved, self.layer_path(layer_id))
        _fsync_dir(os.path.join(self.root, "l"))
        return [layer_id, *layers]

    def lowerdir(self, layers: list[str]) -> str:
        paths = [self.layer_path(x) for x in layers]
        for p in paths:
            if "," in p or ":" in p:
                raise ValueError(f"sandbox store path {p!r} contains ',' or ':' (overlayfs option syntax)")
        return ":".join(paths)

    # ---- snapshot records -----------------------------------------------------------------------------

    def save_snapshot(self, layers: list[str], cwd: str, env: dict[str, str]) -> str:
        snap_id = new_id()
        path = os.path.join(self.root, "s", snap_id + ".json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"layers": layers, "cwd": cwd, "env": env}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a crash leaves the previous snapshots intact
        return snap_id

    def load_snapshot(self, snap_id: str) -> dict:
        if not isinstance(snap_id, str) or not snap_id.isalnum():
            raise ValueError(f"unknown snapshot id {snap_id!r}")
        path = os.path.join(self.root, "s", snap_id + ".json")
        if not os.path.exists(path):
            raise ValueError(f"unknown snapshot id {snap_id!r} (snapshots live as long as the sandbox family)")
        with open(path) as f:
            return json.load(f)

    # ---- ownership ----------------------------------------------------------------------------------------

    def _chown(self, path: str) -> None:
        if self.owner is not None:
            os.chown(path, *self.owner, follow_symlinks=False)

    def _chown_tree(self, path: str) -> None:
        """Lower files must belong to the uid mapped inside the sandbox, or overlay copy-up fails (EOVERFLOW)."""
        if self.owner is None:
            return
        for dirpath, dirnames, filenames in os.walk(path):
            self._chown(dirpath)
            for name in dirnames + filenames:
                p = os.path.join(dirpath, name)
                self._chown(p)
                st = os.lstat(p)
                if stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                    os.chmod(p, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))


def _inside(root: str, rel: str) -> str:
    """`root/rel`, refusing absolute paths and `..` that would leave root (these come from task authors)."""
    r = rel[len("/workspace/"):] if rel.startswith("/workspace/") else rel
    norm = os.path.normpath(r)
    if os.path.isabs(norm) or norm in (".", "..") or norm.startswith("../") or "\0" in norm:
        raise ValueError(f"Sandbox(files=): path {rel!r} is outside /workspace")
    return os.path.join(root, norm)


def _no_symlink_on_the_way(root: str, dest: str, rel: str) -> None:
    p = root
    for part in os.path.relpath(dest, root).split(os.sep):
        p = os.path.join(p, part)
        if os.path.islink(p):
            raise ValueError(f"Sandbox(files=): {rel!r} would be written through the symlink {p!r} of base_dir")


def remove_stale_stores(parent: str) -> int:
    """Remove `openk3-sb-*` stores whose owning process is gone (a host killed with SIGKILL cannot clean up;
    its sandboxes died with it, through --pdeathsig). Only stores of this PID namespace are judged: a host
    in another one (a container sharing /tmp) may be alive under a pid that is free here (`owner_gone`).
    Returns how many were removed."""
    removed = 0
    try:
        names = [n for n in os.listdir(parent) if n.startswith("openk3-sb-")]
    except OSError:
        return 0
    for name in names:
        root = os.path.join(parent, name)
        try:
            with open(os.path.join(root, OWNER_FILE)) as f:
                pid_s, start, *ns = f.read().split()  # no namespace: written before it was recorded
            st = os.lstat(root)
            owner = (ns[0] if len(ns) == 1 else None, int(pid_s), start)
        except (OSError, ValueError):
            continue  # not ours, or still being created
        if st.st_uid not in (os.getuid(), 65534) and os.getuid() != 0:
            continue
        if not owner_gone(*owner):
            continue  # its owner still runs, or runs where we cannot tell
        rmtree(root)
        removed += 1
    return removed


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
