"""Tokenise a `DataConfig` once into memory-mapped token shards, keyed by (data, tokenizer).

    ds = build_dataset(DataConfig(source="builtin", max_bytes=50_000_000), tokenizer, "cache/data")
    ds.train.tokens    # np.memmap, uint16 (vocab <= 65536) or uint32: every document's ids + [EOS]
    ds.train.doc_offsets  # int64 [n_docs + 1]: document d is tokens[doc_offsets[d]:doc_offsets[d + 1]]

Cache folder `cache_dir/<key>/`, key = sha256 of: the format version, `source_identity(cfg)` (file
paths + sizes + mtimes, or the built-in corpus' identity), `max_bytes`, `val_fraction`,
`text_field` and the tokenizer's content (its rank table and special ids exactly as its
`tiktoken.model` / `tokenizer_config.json` hold them, its eos id and its encode slicing limits).
It holds, per split, `<split>.bin` (raw little-endian ids) and `<split>.offsets.npy`, plus
`token_bytes.npy` (UTF-8 bytes of each id's text; 0 for special ids) and `meta.json`.

Atomicity: a build writes into a temporary sibling folder (`.<key>.tmp-<pid>-<rand>`), fsyncs every
file, writes `meta.json` last and renames the folder into place, so `cache_dir/<key>` is either
absent or complete. Opening checks `meta.json` (format, key), every file's size, the offsets (0 ..
num_tokens, each document at least one id + EOS) and that every document ends in EOS (`verify=True`
also re-hashes every file against the sha256 in `meta.json`); anything wrong -> the folder is
removed and rebuilt. Temporary folders of dead builders are removed. An OSError while building (a full
disk) names the cache folder. Builders of the same key on
one machine take turns via a lock file (`fcntl`), so the second just maps what the first wrote.

Validation split: a document goes to `val` when the first 8 bytes of sha1(its UTF-8 text), read as
a big-endian integer, are below `val_fraction * 2**64` -- stable across runs, independent of order,
and exact duplicates always land on the same side. If no document is chosen, the train document with
the smallest hash moves to val (appended at its end), so val is never empty; train must keep at
least one document (fewer than 2 documents in all is an error).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from openk3.data.sources import DataConfig, iter_texts, source_identity
from openk3.fsutil import fsync_dir
from openk3.tokenizer.files import tokenizer_fingerprint

__all__ = ["FORMAT", "TokenDataset", "TokenSplit", "build_dataset", "dataset_key"]

FORMAT = "openk3-tokens-v1"
SPLITS = ("train", "val")
_FLUSH_TOKENS = 1 << 20


# ------------------------------------------------------------------------------------------- splits


@dataclass(frozen=True, eq=False)
class TokenSplit:
    """One split's token stream. tokens: ids (memmap; each document = its ids + EOS), doc_offsets:
    int64 document starts with the total at the end, num_bytes: UTF-8 bytes of the split's text,
    token_bytes: UTF-8 bytes of each id's text (indexed by id; 0 for special ids), or None."""

    name: str
    tokens: np.ndarray
    doc_offsets: np.ndarray
    num_bytes: int
    token_bytes: np.ndarray | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        return (f"TokenSplit({self.name!r}, docs={self.num_docs}, tokens={self.num_tokens}, bytes={self.num_bytes}, "
                f"dtype={self.tokens.dtype})")

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_docs(self) -> int:
        return int(self.doc_offsets.shape[0]) - 1

    @property
    def bytes_per_token(self) -> float:
        """Average UTF-8 bytes per token (EOS tokens included in the count)."""
        return self.num_bytes / max(1, self.num_tokens)

    def document(self, i: int) -> np.ndarray:
        """Ids of document `i` (ending in EOS)."""
        return self.tokens[int(self.doc_offsets[i]):int(self.doc_offsets[i + 1])]



@dataclass(frozen=True, eq=False)
class TokenDataset:
    train: TokenSplit
    val: TokenSplit
    path: str
    key: str
    meta: dict

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])


# ------------------------------------------------------------------------------------------- keys


def dataset_key(cfg: DataConfig, tokenizer) -> str:
    payload = {"format": FORMAT, "source": source_identity(cfg), "max_bytes": cfg.max_bytes,
               "val_fraction": float(cfg.val_fraction), "text_field": cfg.text_field,
               "tokenizer": tokenizer_fingerprint(tokenizer)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def token_byte_lengths(tokenizer) -> np.ndarray:
    """int32 [vocab]: UTF-8 bytes of each ordinary id's text; 0 for the special block."""
    out = np.zeros(tokenizer.vocab_size, dtype=np.int32)
    for tok, rank in tokenizer.ranks.items():
        out[rank] = len(tok)
    return out


def _is_val(text: str, val_fraction: float) -> tuple[bool, int]:
    h = int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:8], "big")
    return h < val_fraction * 2.0**64, h


# ------------------------------------------------------------------------------------------- writing


def _fsync_file(path: str) -> None:
    with open(path, "rb+") as fh:
        os.fsync(fh.fileno())


class _SplitWriter:
    """Appends documents to `<folder>/<name>.bin`; tracks offsets, bytes, sha256 and one hash per doc."""

    def __init__(self, folder: str, name: str, dtype: np.dtype):
        self.folder, self.name, self.dtype = folder, name, dtype
        self.path = os.path.join(folder, f"{name}.bin")
        self.fh = open(self.path, "xb")
        self.sha = hashlib.sha256()
        self.buffer: list[np.ndarray] = []
        self.buffered = 0
        self.offsets = [0]
        self.doc_bytes: list[int] = []
        self.doc_hash: list[int] = []

    def add(self, ids: np.ndarray, nbytes: int, h: int) -> None:
        self.buffer.append(ids)
        self.buffered += len(ids)
        self.offsets.append(self.offsets[-1] + len(ids))
        self.doc_bytes.append(nbytes)
        self.doc_hash.append(h)
        if self.buffered >= _FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            data = np.concatenate(self.buffer).astype(self.dtype, copy=False).tobytes()
            self.fh.write(data)
            self.sha.update(data)
            self.buffer, self.buffered = [], 0

    def finish(self) -> dict:
        self.flush()
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        offsets = np.asarray(self.offsets, dtype=np.int64)
        off_path = os.path.join(self.folder, f"{self.name}.offsets.npy")
        np.save(off_path, offsets)
        _fsync_file(off_path)
        return {"num_tokens": int(offsets[-1]), "num_docs": len(self.doc_bytes), "num_bytes": int(sum(self.doc_bytes)),
                "sha256": {f"{self.name}.bin": self.sha.hexdigest(), f"{self.name}.offsets.npy": _sha256(off_path)}}

    def read_doc(self, i: int) -> np.ndarray:
        if not self.fh.closed:
            self.flush()
            self.fh.flush()
        with open(self.path, "rb") as fh:
            fh.seek(self.offsets[i] * self.dtype.itemsize)
            data = fh.read((self.offsets[i + 1] - self.offsets[i]) * self.dtype.itemsize)
        return np.frombuffer(data, dtype=self.dtype).copy()

    def docs_except(self, skip: int) -> Iterator[tuple[np.ndarray, int, int]]:
        for i in range(len(self.doc_bytes)):
            if i != skip:
                yield self.read_doc(i), self.doc_bytes[i], self.doc_hash[i]

    def abort(self) -> None:
        if not self.fh.closed:
            self.fh.close()


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _move_one(src: _SplitWriter, dst: _SplitWriter, pick: int, folder: str) -> _SplitWriter:
    """Move document `pick` of `src` to the end of `dst`; returns the rewritten `src` writer."""
    dst.add(src.read_doc(pick), src.doc_bytes[pick], src.doc_hash[pick])
    src.flush()
    src.fh.close()
    old = src.path + ".old"
    os.replace(src.path, old)
    src.path = old
    new = _SplitWriter(folder, src.name, src.dtype)
    for ids, nbytes, h in src.docs_except(pick):
        new.add(ids, nbytes, h)
    os.unlink(old)
    return new


def _tokenise_into(folder: str, cfg: DataConfig, tokenizer, progress: bool) -> dict:
    from tqdm import tqdm

    eos = tokenizer.eos_id
    if eos is None:
        raise ValueError("the tokenizer has no eos id (tokenizer_config eos_token or [EOS]): documents need one")
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {name: _SplitWriter(folder, name, dtype) for name in SPLITS}
    try:
        with tqdm(desc="tokenising", unit="B", unit_scale=True, total=cfg.max_bytes, file=sys.stderr,
                  disable=not progress, mininterval=0.5) as bar:
            for text in iter_texts(cfg):
                ids = tokenizer.encode(text)
                arr = np.empty(len(ids) + 1, dtype=np.int64)
                arr[:-1] = ids
                arr[-1] = eos
                nbytes = len(text.encode("utf-8"))
                val, h = _is_val(text, cfg.val_fraction)
                writers["val" if val else "train"].add(arr, nbytes, h)
                bar.update(nbytes)
        train, val = writers["train"], writers["val"]
        if len(train.doc_bytes) + len(val.doc_bytes) < 2:
            raise ValueError(f"the data of {cfg.source!r} has {len(train.doc_bytes) + len(val.doc_bytes)} non-empty "
                             "document(s); a train/val split needs at least 2 (a .txt file is one document)")
        if not val.doc_bytes:
            writers["train"] = _move_one(train, val, int(np.argmin(train.doc_hash)), folder)
        elif not train.doc_bytes:
            writers["val"] = _move_one(val, train, int(np.argmax(val.doc_hash)), folder)
        splits = {name: writers[name].finish() for name in SPLITS}
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    tb_path = os.path.join(folder, "token_bytes.npy")
    np.save(tb_path, token_byte_lengths(tokenizer))
    _fsync_file(tb_path)
    return {"splits": splits, "token_bytes_sha256": _sha256(tb_path), "dtype": dtype.str,
            "vocab_size": tokenizer.vocab_size, "eos_id": eos}


# ------------------------------------------------------------------------------------------- opening


def _open(folder: str, key: str, verify: bool) -> TokenDataset:
    """Map a complete cache folder; raises ValueError (or OSError) when anything is off."""
    with open(os.path.join(folder, "meta.json"), encoding="utf-8") as fh:
        meta = json.load(fh)
    if meta.get("format") != FORMAT or meta.get("key") != key:
        raise ValueError("format or key mismatch")
    dtype = np.dtype(meta["dtype"])
    eos = int(meta["eos_id"])
    tb_path = os.path.join(folder, "token_bytes.npy")
    if verify and _sha256(tb_path) != meta["token_bytes_sha256"]:
        raise ValueError("token_bytes.npy checksum mismatch")
    token_bytes = np.load(tb_path)
    if token_bytes.shape != (int(meta["vocab_size"]),):
        raise ValueError("token_bytes.npy has the wrong shape")
    splits = {}
    for name in SPLITS:
        info = meta["splits"][name]
        n, docs = int(info["num_tokens"]), int(info["num_docs"])
        if verify:
            for file, digest in info["sha256"].items():
                if _sha256(os.path.join(folder, file)) != digest:
                    raise ValueError(f"{file} checksum mismatch")
        path = os.path.join(folder, f"{name}.bin")
        if n < 2 or docs < 1 or os.path.getsize(path) != n * dtype.itemsize:
            raise ValueError(f"{name}.bin has the wrong size")
        offsets = np.load(os.path.join(folder, f"{name}.offsets.npy"))
        if (offsets.dtype != np.int64 or offsets.shape != (docs + 1,) or offsets[0] != 0 or offsets[-1] != n
                or np.any(np.diff(offsets) < 2)):
            raise ValueError(f"{name}.offsets.npy is inconsistent")
        tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
        if np.any(tokens[offsets[1:] - 1] != eos):
            raise ValueError(f"{name}.bin: a document does not end in EOS")
        splits[name] = TokenSplit(name, tokens, offsets, int(info["num_bytes"]), token_bytes)
    return TokenDataset(splits["train"], splits["val"], folder, key, meta)


@contextlib.contextmanager
def _lock(path: str):
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no cross-process lock
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _remove_stale(cache_dir: str, key: str) -> None:
    prefix = f".{key}."
    for entry in os.listdir(cache_dir):
        if not entry.startswith(prefix):
            continue
        tag = entry[len(prefix):]
        if tag.startswith("tmp-"):
            try:
                pid = int(tag.split("-")[1])
            except (IndexError, ValueError):
                pid = -1
            if pid == os.getpid() or (pid > 0 and _pid_alive(pid)):
                continue
        elif not tag.startswith("bad-"):
            continue
        shutil.rmtree(os.path.join(cache_dir, entry), ignore_errors=True)


def build_dataset(cfg: DataConfig, tokenizer, cache_dir: str, *, progress: bool = True,
                  verify: bool = False) -> TokenDataset:
    """Tokenise `cfg`'s documents once into `cache_dir/<key>/` (see the module docstring) and map them.

    A complete cache for the same key is just mapped (no reading of the data, no tokenising); an
    incomplete or damaged one is removed and rebuilt. progress: a tqdm bar on stderr while tokenising.
    verify: also check every file's sha256 when mapping an existing cache.
    """
    cache_dir = os.fspath(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    key = dataset_key(cfg, tokenizer)
    final = os.path.join(cache_dir, key)
    with _lock(os.path.join(cache_dir, f".{key}.lock")):
        if os.path.exists(final):
            try:
                return _open(final, key, verify)
            except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError):
                bad = os.path.join(cache_dir, f".{key}.bad-{uuid.uuid4().hex[:8]}")
                os.rename(final, bad)
                shutil.rmtree(bad, ignore_errors=True)
        _remove_stale(cache_dir, key)
        tmp = os.path.join(cache_dir, f".{key}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        try:
            built = _tokenise_into(tmp, cfg, tokenizer, progress)
            meta = {"format": FORMAT, "key": key, **built,
                    "config": {"source": cfg.source, "max_bytes": cfg.max_bytes, "val_fraction": cfg.val_fraction,
                               "text_field": cfg.text_field},
                    "tokenizer": tokenizer_fingerprint(tokenizer)}
            meta_path = os.path.join(tmp, "meta.json")
            with open(meta_path, "w", encoding="utf-8") as fh:
                json.dump(meta, fh, indent=2)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
            fsync_dir(tmp)
            os.rename(tmp, final)
            fsync_dir(cache_dir)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if e.filename is not None:
                raise
            # A write to a full disk says only "No space left on device": name the cache being written.
            raise OSError(e.errno, f"{e.strerror or e} (writing the token cache)", final) from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return _open(final, key, verify=False)
