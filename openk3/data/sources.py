"""Where pretraining text comes from: the built-in corpus or user files, as a stream of documents.

`DataConfig.source` is `"builtin"` (the stdlib corpus of `openk3.data.corpus`, no download) or one or
more comma-separated paths, each one of:

    * a `.txt` file: the whole file is **one document** (read as bytes and decoded as UTF-8, invalid
      bytes replaced by U+FFFD; no newline translation, so the byte counts are the file's own);
    * a `.jsonl` file: one JSON object per line, the document is its `text_field` (default "text");
      blank lines are skipped, a line that is not an object holding a string there is an error
      naming the file and line (a `null` is skipped);
    * a `.parquet` file: the `text_field` column, row by row (`null` skipped) -- needs `pyarrow`;
    * a Hugging Face `datasets.save_to_disk` folder (it holds `state.json` + `dataset_info.json`, or
      `dataset_dict.json` for a DatasetDict, whose splits are read in sorted order) -- needs `datasets`;
    * any other folder: every `.txt` / `.jsonl` / `.parquet` file and `save_to_disk` folder below it,
      recursively, in sorted path order (names starting with "." are skipped, other files ignored).

Documents come in that order, path by path as given. Empty documents are skipped. Lone surrogates
(which JSON can carry) become U+FFFD, as the tokenizer would make them, so every document has a
well-defined UTF-8 byte count. `max_bytes` keeps the first that many UTF-8 bytes of the stream (the
last document cut at a character boundary), for every kind of source.

`source_identity(cfg)` is what the shard cache key is made of: for files, their absolute paths,
sizes and modification times (ns); for the built-in corpus, the Python version, the stdlib folder,
every corpus file's path/size/mtime and the bytes of `corpus.py` itself (the extraction rules).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["DataConfig", "SOURCE_SUFFIXES", "iter_texts", "resolve_sources", "source_identity"]

SOURCE_SUFFIXES = (".txt", ".jsonl", ".parquet")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What to train on. source: "builtin" or comma-separated paths (see the module docstring);
    max_bytes: keep only the first that many UTF-8 bytes of documents; val_fraction: the share of
    documents (chosen by a hash of their text) held out for validation; text_field: the JSONL field /
    parquet column / dataset column holding the text."""

    source: str = "builtin"
    max_bytes: int | None = None
    val_fraction: float = 0.01
    text_field: str = "text"

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError("DataConfig.source must be 'builtin' or one or more comma-separated paths")
        if self.max_bytes is not None and (not isinstance(self.max_bytes, int) or self.max_bytes <= 0):
            raise ValueError(f"DataConfig.max_bytes must be a positive int or None, got {self.max_bytes!r}")
        if not 0.0 < float(self.val_fraction) < 1.0:
            raise ValueError(f"DataConfig.val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if not self.text_field:
            raise ValueError("DataConfig.text_field must be a non-empty string")


# ------------------------------------------------------------------------------------------- resolution


@dataclass(frozen=True)
class Source:
    kind: str  # "builtin", "txt", "jsonl", "parquet" or "hf" (a save_to_disk folder)
    path: str  # absolute path ("" for builtin)


def _is_hf_folder(path: str) -> bool:
    return (os.path.isfile(os.path.join(path, "dataset_dict.json"))
            or (os.path.isfile(os.path.join(path, "state.json"))
                and os.path.isfile(os.path.join(path, "dataset_info.json"))))


def _kind_of_file(path: str) -> str | None:
    for suffix in SOURCE_SUFFIXES:
        if path.lower().endswith(suffix):
            return suffix[1:]
    return None


def _walk(folder: str) -> list[Source]:
    out = []
    for entry in sorted(os.listdir(folder)):
        if entry.startswith("."):
            continue
        path = os.path.join(folder, entry)
        if os.path.isdir(path):
            out.extend([Source("hf", path)] if _is_hf_folder(path) else _walk(path))
        elif os.path.isfile(path) and (kind := _kind_of_file(path)):
            out.append(Source(kind, path))
    return out


def _require(module: str, what: str):
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(f"{what} needs the optional package `{module}`, which is not installed "
                          f"(pip install {module})") from None


def resolve_sources(cfg: DataConfig) -> list[Source]:
    """The concrete sources of `cfg`, in reading order; checks that each exists, has a known kind and
    that the optional packages its kind needs are importable (so a build fails before any work)."""
    if cfg.source.strip() == "builtin":
        return [Source("builtin", "")]
    out: list[Source] = []
    for raw in cfg.source.split(","):
        raw = raw.strip()
        if not raw:
            continue
        path = os.path.abspath(os.path.expanduser(raw))
        if os.path.isdir(path):
            found = [Source("hf", path)] if _is_hf_folder(path) else _walk(path)
            if not found:
                raise ValueError(f"{path}: no {', '.join(SOURCE_SUFFIXES)} files or save_to_disk folders in it")
            out.extend(found)
        elif os.path.isfile(path):
            kind = _kind_of_file(path)
            if kind is None:
                raise ValueError(f"{path}: unknown kind of data file (expected {', '.join(SOURCE_SUFFIXES)}, a "
                                 "folder, or a datasets.save_to_disk folder)")
            out.append(Source(kind, path))
        else:
            raise ValueError(f"{raw}: no such file or folder (DataConfig.source is 'builtin' or paths)")
    if not out:
        raise ValueError(f"DataConfig.source {cfg.source!r} names no paths")
    for src in out:
        if src.kind == "parquet":
            _require("pyarrow", f"reading {src.path} (.parquet)")
        elif src.kind == "hf":
            _require("datasets", f"reading {src.path} (a Hugging Face datasets.save_to_disk folder)")
    return out


# ------------------------------------------------------------------------------------------- identity


def _stat_entry(path: str) -> list:
    st = os.stat(path)
    return [path, st.st_size, st.st_mtime_ns]


def source_identity(cfg: DataConfig) -> list:
    """A JSON-able description of the data `cfg` reads that changes whenever that data may change
    (see the module docstring). Reads no file contents except `corpus.py`."""
    out: list = []
    for src in resolve_sources(cfg):
        if src.kind == "builtin":
            from openk3.data import corpus

            root = corpus.stdlib_dir()
            with open(corpus.__file__, "rb") as fh:
                rules = hashlib.sha256(fh.read()).hexdigest()
            files = [_stat_entry(os.path.join(root, rel))[1:] + [rel] for rel in corpus.stdlib_files(root)]
            out.append(["builtin", sys.version, root, rules, files])
        elif src.kind == "hf":
            files = []
            for dirpath, dirnames, filenames in os.walk(src.path):
                dirnames.sort()
                files.extend(_stat_entry(os.path.join(dirpath, f)) for f in sorted(filenames))
            out.append(["hf", src.path, files])
        else:
            out.append([src.kind, *_stat_entry(src.path)])
    return out


# ------------------------------------------------------------------------------------------- reading

_SURROGATE = re.compile("[\ud800-\udfff]")


def _clean(text: str) -> str:
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _read_txt(path: str) -> Iterator[str]:
    with open(path, "rb") as fh:
        yield fh.read().decode("utf-8", errors="replace")


def _read_jsonl(path: str, field: str) -> Iterator[str]:
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
            if not isinstance(obj, dict) or field not in obj:
                raise ValueError(f"{path}:{lineno}: expected a JSON object with field {field!r}")
            text = obj[field]
            if text is None:
                continue
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: field {field!r} is {type(text).__name__}, not a string")
            yield text


def _check_column(path: str, names, field: str) -> None:
    if field not in names:
        raise ValueError(f"{path}: no column {field!r} (columns: {', '.join(map(str, names))})")


def _read_parquet(path: str, field: str) -> Iterator[str]:
    _require("pyarrow", f"reading {path} (.parquet)")
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    _check_column(path, pf.schema_arrow.names, field)
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text


def _read_hf(path: str, field: str) -> Iterator[str]:
    datasets = _require("datasets", f"reading {path} (a Hugging Face datasets.save_to_disk folder)")
    loaded = datasets.load_from_disk(path)
    parts = [loaded[k] for k in sorted(loaded)] if isinstance(loaded, dict) else [loaded]
    for part in parts:
        _check_column(path, part.column_names, field)
        for batch in part.select_columns([field]).iter(batch_size=1024):
            for text in batch[field]:
                if text is not None:
                    yield text


def _raw_documents(cfg: DataConfig) -> Iterator[str]:
    for src in resolve_sources(cfg):
        if src.kind == "builtin":
            from openk3.data.corpus import iter_documents

            for doc in iter_documents(cfg.max_bytes):
                yield doc.text
        elif src.kind == "txt":
            yield from _read_txt(src.path)
        elif src.kind == "jsonl":
            yield from _read_jsonl(src.path, cfg.text_field)
        elif src.kind == "parquet":
            yield from _read_parquet(src.path, cfg.text_field)
        else:
            yield from _read_hf(src.path, cfg.text_field)


def iter_texts(cfg: DataConfig) -> Iterator[str]:
    """The documents of `cfg` in their fixed order: non-empty, surrogate-free, within `max_bytes`."""
    used = 0
    for text in _raw_documents(cfg):
        text = _clean(text)
        if not text:
            continue
        if cfg.max_bytes is None:
            yield text
            continue
        left = cfg.max_bytes - used
        if left <= 0:
            return
        data = text.encode("utf-8")
        if len(data) > left:
            text = data[:left].decode("utf-8", errors="ignore")
            if text:
                yield text
            return
        used += len(data)
        yield text
