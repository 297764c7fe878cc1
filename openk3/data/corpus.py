"""A built-in text corpus that every Python installation carries: the standard library's own sources.

What it is
    * **code documents**: each `.py` file of the running interpreter's standard library
      (`sysconfig.get_paths()["stdlib"]`), read with its declared source encoding, as one document;
    * **prose documents**: for each of those files, its docstrings (module, classes, functions, in
      source order, via `ast.get_docstring`) followed by its comment paragraphs (runs of full-line
      `#` comments outside string literals, `#` and indentation stripped), as one document.

    Documents come file by file in sorted path order, code then prose, so any prefix (`max_bytes`) is
    a mix of both. Left out: the test suites (`test`, `tests` folders), `idlelib`, `turtledemo`,
    `lib2to3`, the generated codec tables (`encodings`), the machine-specific `_sysconfigdata*`
    module, `site-packages`/`dist-packages`, `__pycache__`, `config-*` folders, and anything that
    does not parse.

Size (CPython 3.11.7 on Linux): 453 files -> 453 code documents (9.55 MB) and 440 prose documents
(2.61 MB), 12.16 MB in all; `describe()` gives the figures for the interpreter at hand. Building it
all takes about 2 s (one `ast.parse` per file); a `max_bytes` prefix only reads what it needs
(2 MB: 0.3 s).

Determinism: the same interpreter (same stdlib files) always gives the same documents in the same
order; a different Python version gives a different (but again fixed) corpus.

Licence: the CPython standard library is under the PSF License Agreement (PSF-2.0), a permissive
licence; a few files carry additional permissive notices. Text derived from it (tokenizers trained
on it, counts) can be redistributed under the same terms.
"""

from __future__ import annotations

import ast
import io
import os
import sys
import sysconfig
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Document", "builtin_corpus", "describe", "iter_documents", "stdlib_files"]

EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "turtledemo", "lib2to3", "encodings", "site-packages",
                           "dist-packages", "__pycache__"})
LICENSE = "PSF-2.0"


@dataclass(frozen=True)
class Document:
    kind: str  # "code" or "prose"
    source: str  # path of the stdlib file, relative to the stdlib folder, '/'-separated
    text: str


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root: str | None = None) -> list[str]:
    """The stdlib `.py` files that make up the corpus, as sorted '/'-separated paths relative to `root`."""
    root = root or stdlib_dir()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("config-")]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if not name.endswith(".py") or name.startswith("_sysconfigdata"):
                continue
            rel = name if rel_dir == "." else os.path.join(rel_dir, name)
            out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def _read_source(path: str) -> str | None:
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        return raw.decode(encoding).replace("\r\n", "\n")
    except (OSError, SyntaxError, UnicodeDecodeError, LookupError):
        return None


_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _prose(tree: ast.Module, source: str) -> str:
    """Docstrings in source order, then full-line comment paragraphs outside string literals."""
    docs, string_lines = [], set()
    for node in ast.walk(tree):
        if isinstance(node, _DOC_NODES):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                docs.append((getattr(node, "lineno", 0), doc.strip()))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.end_lineno != node.lineno:
            string_lines.update(range(node.lineno + 1, node.end_lineno + 1))  # lines inside a multi-line string
        elif isinstance(node, ast.JoinedStr) and node.end_lineno != node.lineno:
            string_lines.update(range(node.lineno + 1, node.end_lineno + 1))
    docs.sort(key=lambda d: d[0])
    paragraphs, current = [], []
    for number, line in enumerate(source.split("\n"), start=1):
        stripped = line.strip()
        if stripped.startswith("#") and number not in string_lines and not stripped.startswith("#!"):
            text = stripped.lstrip("#").strip()
            if text and not text.startswith("-*-"):
                current.append(text)
                continue
        if current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    parts = [d for _, d in docs] + [p for p in paragraphs if len(p) > 2]
    return "\n\n".join(parts)


def _iter_all(root: str) -> Iterator[Document]:
    for rel in stdlib_files(root):
        source = _read_source(os.path.join(root, rel))
        if not source or not source.strip():
            continue
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError, RecursionError):
            continue
        yield Document("code", rel, source)
        prose = _prose(tree, source)
        if prose:
            yield Document("prose", rel, prose)


def iter_documents(max_bytes: int | None = None, root: str | None = None) -> Iterator[Document]:
    """The corpus in its fixed order; with `max_bytes`, stop once that many UTF-8 bytes were given
    (the last document is cut at a character boundary to fit exactly within the budget)."""
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    used = 0
    for doc in _iter_all(root or stdlib_dir()):
        if max_bytes is None:
            yield doc
            continue
        left = max_bytes - used
        if left <= 0:
            return
        size = len(doc.text.encode("utf-8"))
        if size > left:
            text = doc.text.encode("utf-8")[:left].decode("utf-8", errors="ignore")
            if text:
                yield Document(doc.kind, doc.source, text)
            return
        used += size
        yield doc


def builtin_corpus(max_bytes: int | None = None) -> list[str]:
    """The corpus as a list of document strings (see the module docstring), at most `max_bytes` UTF-8 bytes."""
    return [d.text for d in iter_documents(max_bytes)]


def describe(max_bytes: int | None = None) -> dict:
    """Counts and sizes of the corpus as built on this interpreter."""
    counts = {"code": 0, "prose": 0}
    sizes = {"code": 0, "prose": 0}
    files = set()
    for d in iter_documents(max_bytes):
        counts[d.kind] += 1
        sizes[d.kind] += len(d.text.encode("utf-8"))
        files.add(d.source)
    return {
        "source": stdlib_dir(),
        "python": sys.version.split()[0],
        "licence": LICENSE,
        "files": len(files),
        "documents": counts["code"] + counts["prose"],
        "code_documents": counts["code"],
        "prose_documents": counts["prose"],
        "code_bytes": sizes["code"],
        "prose_bytes": sizes["prose"],
        "total_bytes": sizes["code"] + sizes["prose"],
    }
