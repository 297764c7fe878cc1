"""The agent's file tools, run INSIDE the sandbox by the in-sandbox agent (`agentd.py`).

    dispatch(name, args, *, root="/workspace", sql_mode="read_write", sql_timeout=10.0)
        -> {"ok": bool, "output": str, "data": dict}

`output` is the tool message the model sees, capped at 50,000 chars (head and tail kept) and 2,000 chars
per line, each cut marked `[...truncated N chars]`; `data` is a structured copy for RL and UIs. It always
holds `truncated`, and stays under MAX_DATA = 1 MiB of JSON: the SQL tool cuts cells and rows to fit (and
says so), and a result still over the limit has its `data` replaced by a summary. A bad call (unknown tool,
bad argument, missing file) gives `ok: False` with a message; no exception leaves `dispatch`, because the
agent must keep serving the episode.

Glob patterns and Grep globs with a `..` segment are refused (a pattern must not climb out of its folder:
the host's path rules check the folder only). Grep refuses a regex with nested quantifiers (`(a+)+`,
`regex_hazard`), which can take exponential time, and stops a search that still runs past SCAN_SECONDS
(a SIGALRM in the agent's main thread: python's re checks for signals while it backtracks).

This module and `toolbox_apps.py` (KV store, SQL, Submit) run under the system `/usr/bin/python3` with only
their own folder on `sys.path`: STDLIB ONLY, never `openk3`. Paths are relative to `root` or absolute; they
are resolved in the sandbox's own view of the filesystem, so the kernel boundary (read-only binds, the
overlay) is what stops a path from reaching anything it should not, whatever the host-side policy checked.

Text decoding: files and tool output are UTF-8; invalid bytes become U+FFFD, and NUL bytes are kept as
U+0000 (the JSON line carries them as `\\u0000`). ReadFile refuses files that look binary (a known magic
number, or more than 10% control/invalid bytes in the first 8 KiB) and names their size and type.
"""

from __future__ import annotations

import codecs
import contextlib
import difflib
import fnmatch
import json
import os
import re
import signal
import threading
import time
from collections import deque
from pathlib import Path

try:  # inside the sandbox this file is a top-level module with toolbox_apps.py beside it
    from . import toolbox_apps as apps
except ImportError:
    import toolbox_apps as apps

Ctx, ToolError, arg = apps.Ctx, apps.ToolError, apps.arg

MAX_OUTPUT = 50_000      # chars per tool result (head + tail kept)
MAX_LINE = 2_000         # chars per output line
MAX_READ_LINES = 1_000   # ReadFile n_lines cap
MAX_GLOB = 1_000         # Glob paths per result
MAX_EDITS = 50           # StrReplaceFile edits per call
SCAN_SECONDS = 30.0      # Glob / Grep stop walking after this long and return what they found
GREP_LINE = 1 << 20      # Grep matches on a line's first MiB (a 100 MB line must not fill memory)
MAX_DATA = 1 << 20       # chars of a result's `data` as JSON; past it `data` is replaced by a summary
SKIP_DIRS = {".git", apps.STATE_DIR}  # Grep never walks into these (.git as ripgrep; .state is apps only)

# Magic numbers of common binary formats (checked before the control-byte ratio).
_MAGIC = (
    (b"\x7fELF", "ELF executable"), (b"\x89PNG", "PNG image"), (b"\xff\xd8\xff", "JPEG image"),
    (b"GIF8", "GIF image"), (b"%PDF", "PDF document"), (b"PK\x03\x04", "zip archive"),
    (b"\x1f\x8b", "gzip data"), (b"SQLite format 3\x00", "SQLite database"), (b"\xfd7zXZ\x00", "xz data"),
    (b"7z\xbc\xaf", "7-zip archive"), (b"\x00asm", "WebAssembly module"), (b"\xca\xfe\xba\xbe", "Java class"),
)
_TEXT_CONTROLS = set(b"\t\n\r\f\b\x1b")
_MARKED = re.compile(r"\[\.\.\.truncated \d+ chars\]\Z")


try:  # the regex parser: `re._parser` from 3.11 (the system python), `sre_parse` before
    from re import _parser as _re_parser
except ImportError:  # pragma: no cover - python < 3.11
    import sre_parse as _re_parser

_REPEATS = {"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"}


def regex_hazard(pattern: str, flags: int = 0) -> str | None:
    """Why `pattern` can take exponential time in a backtracking engine, or None: a quantifier inside a
    quantified group, as in `(a+)+` or `(x|y*)*` (the ways to split a run of input grow exponentially).

    A structural check on the parsed pattern, no timing. It does not see every slow pattern (`(a|a)*`
    backtracks too, and two overlapping quantifiers in a row are polynomial), so callers still bound the
    input or the time. Raises re.error for an invalid pattern."""
    return _nested_repeat(_re_parser.parse(pattern, flags), inside=None)


def _nested_repeat(sub, inside: str | None) -> str | None:
    for op, av in sub:
        if str(op) in _REPEATS:
            lo, hi, body = av
            if hi > lo and inside is not None:  # a fixed count such as {2} adds no way to split the input
                return f"a quantifier nested inside a quantified group ({inside})"
            if hi > 1 and inside is None:  # `?` repeats nothing: `(?:\.\w+)?` is fine
                inside = "{" + f"{lo},{'' if hi == _re_parser.MAXREPEAT else hi}" + "}"
                inside = {"{0,}": "*", "{1,}": "+"}.get(inside, inside)
                found = _nested_repeat(body, inside)
                inside = None
            else:
                found = _nested_repeat(body, inside)
        else:
            found = None
            for child in _children(av):
                found = found or _nested_repeat(child, inside)
        if found:
            return found
    return None


def _children(av):
    """The sub-patterns inside one parsed node (groups, branches, lookarounds, conditionals)."""
    if isinstance(av, _re_parser.SubPattern):
        yield av
    elif isinstance(av, (tuple, list)):
        for item in av:
            yield from _children(item)


def cap_output(text: str, max_chars: int = MAX_OUTPUT, max_line: int = MAX_LINE) -> tuple[str, int]:
    """`text` with every line cut at `max_line` chars, then the middle cut so it fits in about `max_chars`.

    Returns (capped text, number of chars dropped); each cut is marked `[...truncated N chars]`.
    """
    dropped = 0
    if len(text) > max_line and any(_too_long(line, max_line) for line in text.split("\n")):
        lines = text.split("\n")
        for k, line in enumerate(lines):
            if _too_long(line, max_line):
                dropped += len(line) - max_line
                lines[k] = f"{line[:max_line]}[...truncated {len(line) - max_line} chars]"
        text = "\n".join(lines)
    if len(text) > max_chars:
        keep = max_chars // 2
        cut = len(text) - 2 * keep
        dropped += cut
        text = f"{text[:keep]}\n[...truncated {cut} chars]\n{text[-keep:]}"
    return text, dropped


def _too_long(line: str, max_line: int) -> bool:
    # A line a tool already cut (ReadFile's numbered lines) keeps its own marker: a few chars of prefix
    # and marker over the limit are not cut a second time.
    return len(line) > max_line and not (len(line) <= max_line + 64 and _MARKED.search(line))


def binary_kind(head: bytes) -> str | None:
    """What a file starting with `head` is, if it is not text (None for text)."""
    for magic, kind in _MAGIC:
        if head.startswith(magic):
            return kind
    if not head:
        return None
    decoded = head.decode("utf-8", "replace")
    # A multi-byte character cut at the end of `head` adds one U+FFFD; 10% leaves room for that and for
    # a text file with a few stray NULs or Latin-1 bytes, which is read (NUL kept as U+0000).
    bad = sum(1 for ch in decoded if ch == "\ufffd" or (ord(ch) < 32 and ord(ch) not in _TEXT_CONTROLS))
    return "data" if bad > 0.1 * len(decoded) else None


def _iter_lines(f, cap: int):
    """Lines of binary file `f` decoded as UTF-8 (replacement chars), without the newline; a line longer
    than `cap` chars is cut there and marked, and never held in memory whole."""
    while True:
        chunk = f.readline(65536)
        if not chunk:
            return
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        text, extra = "", 0
        while True:
            ends = chunk.endswith(b"\n")
            piece = decoder.decode(chunk[:-1] if ends else chunk, final=ends)
            text += piece
            if len(text) > cap:
                extra += len(text) - cap
                text = text[:cap]
            if ends:
                break
            chunk = f.readline(65536)
            if not chunk:
                text += decoder.decode(b"", final=True)
                break
        if text.endswith("\r") and not extra:
            text = text[:-1]
        yield f"{text}[...truncated {extra} chars]" if extra else text


def _read_file(args: dict, ctx: Ctx) -> tuple[str, dict]:
    path = ctx.path(arg(args, "path", str))
    offset = arg(args, "line_offset", int, 1)
    n_lines = arg(args, "n_lines", int, MAX_READ_LINES)
    if not 1 <= n_lines <= MAX_READ_LINES:
        raise ToolError(f"n_lines must be between 1 and {MAX_READ_LINES}, not {n_lines}")
    if offset == 0:
        raise ToolError("line_offset is 1-based (a negative one counts from the end); 0 is not a line")
    if os.path.isdir(path):
        raise ToolError(f"{ctx.show(path)} is a directory; use Glob to list it")
    with ctx.open(path) as f:
        kind = binary_kind(f.read(8192))
        if kind:
            size = os.fstat(f.fileno()).st_size
            raise ToolError(f"{ctx.show(path)} is a binary file ({kind}, {size} bytes); ReadFile reads text only")
        f.seek(0)
        total, picked = 0, []
        window = deque(maxlen=-offset) if offset < 0 else None
        for total, line in enumerate(_iter_lines(f, MAX_LINE), start=1):
            if window is not None:
                window.append((total, line))
            elif offset <= total < offset + n_lines:
                picked.append((total, line))
        if window is not None:
            picked = list(window)[:n_lines]
    body = "\n".join(f"{i:6d}\t{line}" for i, line in picked)
    first = picked[0][0] if picked else None
    last = picked[-1][0] if picked else 0
    if not picked:
        body = f"(no lines: {ctx.show(path)} has {total} lines)"
    elif last < total:
        body += f"\n[{total} lines in all; continue with line_offset={last + 1}]"
    return body, {"path": ctx.show(path), "first_line": first, "n_lines": len(picked), "total_lines": total}


def _write_file(args: dict, ctx: Ctx) -> tuple[str, dict]:
    path = ctx.path(arg(args, "path", str))
    content = arg(args, "content", str)
    mode = arg(args, "mode", str, "overwrite")
    if mode not in ("overwrite", "append"):
        raise ToolError(f"mode must be 'overwrite' or 'append', not {mode!r}")
    if os.path.isdir(path):
        raise ToolError(f"{ctx.show(path)} is a directory")
    try:
        data = content.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON can carry lone surrogates, which no UTF-8 file can hold
        raise ToolError(f"content is not valid Unicode at char {e.start} (a lone surrogate)") from None
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with ctx.open(path, "ab" if mode == "append" else "wb") as f:
        f.write(data)
    verb = "Appended" if mode == "append" else "Wrote"
    return f"{verb} {len(data)} bytes to {ctx.show(path)}", {"path": ctx.show(path), "bytes": len(data), "mode": mode}


def _edits(value) -> list[tuple[str, str, bool]]:
    edits = [value] if isinstance(value, dict) else value
    if not isinstance(edits, list) or not edits:
        raise ToolError("argument 'edit' must be an object {old, new, replace_all} or a non-empty list of them")
    if len(edits) > MAX_EDITS:
        raise ToolError(f"at most {MAX_EDITS} edits per call, got {len(edits)}")
    out = []
    for k, e in enumerate(edits, start=1):
        if not isinstance(e, dict):
            raise ToolError(f"edit {k} must be an object, not {type(e).__name__}")
        extra = sorted(set(e) - {"old", "new", "replace_all"})
        if extra:
            raise ToolError(f"edit {k}: unexpected key '{extra[0]}'")
        try:
            old, new, replace_all = arg(e, "old", str), arg(e, "new", str), arg(e, "replace_all", bool, False)
        except ToolError as err:
            raise ToolError(f"edit {k}: {err}") from None
        if not old:
            raise ToolError(f"edit {k}: 'old' is empty; give the exact text to replace")
        out.append((old, new, replace_all))
    return out


def _str_replace_file(args: dict, ctx: Ctx) -> tuple[str, dict]:
    path = ctx.path(arg(args, "path", str))
    edits = _edits(arg(args, "edit", (dict, list)))
    with ctx.open(path) as f:
        raw = f.read()
    try:
        before = raw.decode("utf-8")
    except UnicodeDecodeError:  # a replacement-char round trip would corrupt the file's other bytes
        raise ToolError(f"{ctx.show(path)} is not valid UTF-8 text; edit it with Shell") from None
    text, replaced = before, 0
    for k, (old, new, replace_all) in enumerate(edits, start=1):
        count = text.count(old)
        if count == 0:
            raise ToolError(f"edit {k}: 'old' not found in {ctx.show(path)} (nothing was changed)")
        if count > 1 and not replace_all:
            raise ToolError(f"edit {k}: 'old' occurs {count} times in {ctx.show(path)}; add context to make it "
                            "unique or set replace_all (nothing was changed)")
        text = text.replace(old, new) if replace_all else text.replace(old, new, 1)
        replaced += count if replace_all else 1
    data = text.encode("utf-8")  # edits are all-or-nothing: the file is written once, after every check
    with ctx.open(path, "wb") as f:
        f.write(data)
    name = ctx.show(path)
    diff = "".join(difflib.unified_diff(before.splitlines(keepends=True), text.splitlines(keepends=True),
                                        f"a/{name}", f"b/{name}", n=2))
    return (f"Edited {name}: {replaced} replacement{'s' * (replaced != 1)}\n{diff}".rstrip("\n"),
            {"path": name, "replacements": replaced, "bytes": len(data)})


def _glob(args: dict, ctx: Ctx) -> tuple[str, dict]:
    pattern = arg(args, "pattern", str)
    directory = arg(args, "directory", (str, type(None)), None)
    include_dirs = arg(args, "include_dirs", bool, True)
    base = ctx.path(directory) if directory else ctx.root
    if not pattern:
        raise ToolError("the pattern is empty")
    if os.path.isabs(pattern):
        raise ToolError("the pattern must be relative; put the absolute part in 'directory'")
    if ".." in pattern.split("/"):  # `*/../../etc/*` would list folders the path rules never saw
        raise ToolError(f"the pattern must not contain '..' ({pattern!r}); put the folder in 'directory'")
    if not os.path.isdir(base):
        raise ToolError(f"{ctx.show(base)} is not a directory")
    found, more, deadline = [], False, time.monotonic() + SCAN_SECONDS
    for p in Path(base).glob(pattern):
        if time.monotonic() > deadline:
            more = True
            break
        is_dir = p.is_dir()
        if is_dir and not include_dirs:
            continue
        if len(found) == MAX_GLOB:
            more = True
            break
        found.append(os.path.relpath(p, base) + ("/" if is_dir else ""))
    found.sort()
    body = "\n".join(found) if found else f"no paths match {pattern!r} in {ctx.show(base)}"
    if more:
        body += f"\n[stopped at {len(found)} paths; narrow the pattern]"
    return body, {"directory": ctx.show(base), "paths": found, "more": more}


def _grep_files(target: str, glob: str | None):
    if os.path.isfile(target):
        yield target
        return
    for dirpath, dirnames, filenames in os.walk(target):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            # `*.py` matches by file name, `src/*.py` by path below the searched folder (`*` crosses `/`).
            if glob and not (fnmatch.fnmatch(name, glob) or fnmatch.fnmatch(os.path.relpath(full, target), glob)):
                continue
            yield full


def _grep(args: dict, ctx: Ctx) -> tuple[str, dict]:
    pattern = arg(args, "pattern", str)
    target = ctx.path(arg(args, "path", str, "."))
    glob = arg(args, "glob", (str, type(None)), None)
    mode = arg(args, "output_mode", str, "files_with_matches")
    numbers = arg(args, "-n", bool, True)
    context = arg(args, "-C", (int, type(None)), None) or 0
    limit = arg(args, "head_limit", int, 250)
    if mode not in ("content", "files_with_matches", "count_matches"):
        raise ToolError(f"output_mode must be content, files_with_matches or count_matches, not {mode!r}")
    if context < 0 or limit < 0:
        raise ToolError("-C and head_limit must not be negative")
    if glob and ".." in glob.split("/"):  # it could match nothing (files are walked below path): say so
        raise ToolError(f"the glob must not contain '..' ({glob!r}): it filters the files below 'path'")
    flags = re.IGNORECASE if arg(args, "-i", bool, False) else 0
    try:
        rx, hazard = re.compile(pattern, flags), regex_hazard(pattern, flags)
    except re.error as e:
        raise ToolError(f"invalid regular expression {pattern!r}: {e}") from None
    if hazard:  # `(a+)+b` on a long run of a's would hold the agent far past any sensible time
        raise ToolError(f"the regular expression {pattern!r} has {hazard}, which can take exponential time; "
                        "rewrite it without the nesting (e.g. `(a+)+` as `a+`)")
    if not os.path.exists(target):
        raise ToolError(f"no such file or directory: {ctx.show(target)}")
    out: list[str] = []
    files, n_matches, more, skipped = [], 0, False, 0
    deadline = time.monotonic() + SCAN_SECONDS

    def full() -> bool:  # head_limit 0 means no limit
        return bool(limit) and len(out) >= limit

    # The deadline is checked between files; the alarm also stops one slow search inside a file (a
    # polynomial pattern such as `.*a.*b` on a long line), which no check between lines can.
    with _alarm(SCAN_SECONDS) as expired:
        for path in _grep_files(target, glob):
            if full() or time.monotonic() > deadline:
                more = True
                break
            try:
                f = ctx.open(path)
            except (OSError, ToolError):
                skipped += 1  # unreadable (permissions, a dangling symlink, a FIFO): skipped, as grep -s does
                continue
            with f:
                if binary_kind(f.read(8192)):
                    continue
                f.seek(0)
                name, count, before, after, last = ctx.show(path), 0, deque(maxlen=context), 0, 0
                for i, line in enumerate(_iter_lines(f, GREP_LINE), start=1):
                    hit = rx.search(line) is not None
                    count += hit
                    if mode != "content":
                        continue
                    if full():
                        more = True
                        break
                    if hit:
                        start = before[0][0] if before else i
                        if context and out and (last == 0 or start > last + 1):
                            out.append("--")  # context groups are separated, as in grep -C
                        out.extend((f"{name}-{j}-" if numbers else f"{name}-") + text for j, text in before)
                        before.clear()
                        out.append((f"{name}:{i}:" if numbers else f"{name}:") + line)
                        last, after = i, context
                    elif after:
                        out.append((f"{name}-{i}-" if numbers else f"{name}-") + line)
                        last, after = i, after - 1
                    elif context:
                        before.append((i, line))
                if count:
                    n_matches += count
                    files.append(name)
                    if mode == "files_with_matches":
                        out.append(name)
                    elif mode == "count_matches":
                        out.append(f"{name}:{count}")
    more = more or expired()
    body = "\n".join(out) if out else f"no matches for {pattern!r}"
    if expired():
        body += (f"\n[stopped: a search ran past the {SCAN_SECONDS:g} s scan limit; "
                 "simplify the pattern or narrow the search]")
    elif more:
        body += f"\n[stopped at head_limit={limit} or the {SCAN_SECONDS:g} s scan limit; narrow the search]"
    return body, {"mode": mode, "files": files, "matches": n_matches, "more": more, "unreadable": skipped}


class _Expired(Exception):
    """Raised by `_alarm`'s signal handler inside a running search."""


@contextlib.contextmanager
def _alarm(seconds: float):
    """Raise _Expired in the main thread after `seconds` (python's re checks for signals while it
    backtracks, so this stops a single runaway search); yields a function telling whether it fired.

    In another thread (signals go to the main thread only) it does nothing. A timer already set by
    someone else (ITIMER_REAL is one per process) is put back, less the time spent, afterwards."""
    fired = []
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield lambda: False
        return

    def handler(signum, frame):
        fired.append(True)
        raise _Expired

    previous = signal.signal(signal.SIGALRM, handler)
    t0 = time.monotonic()
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield lambda: bool(fired)
    except _Expired:
        pass  # the search stopped; the caller reads expired()
    finally:
        while True:  # disarm before the old handler is back (SIGALRM's default action ends the process)
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
                break
            except _Expired:  # it fired just now; it cannot fire again once disarmed
                continue
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)
        if old_delay:
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - t0), 1e-3), old_interval)


TOOLS = {
    "ReadFile": (_read_file, {"path", "line_offset", "n_lines"}),
    "WriteFile": (_write_file, {"path", "content", "mode"}),
    "StrReplaceFile": (_str_replace_file, {"path", "edit"}),
    "Glob": (_glob, {"pattern", "directory", "include_dirs"}),
    "Grep": (_grep, {"pattern", "path", "glob", "output_mode", "-i", "-n", "-C", "head_limit"}),
    **apps.TOOLS,
}


def dispatch(name: str, args: dict, *, root: str = "/workspace", sql_mode: str = "read_write",
             sql_timeout: float = 10.0) -> dict:
    """Run tool `name` with `args`; returns {"ok", "output", "data"} and never raises.

    Args:
        root: the workspace; relative paths are under it and the apps keep their files in `root/.state/`.
        sql_mode: "read_only" or "read_write", the environment's setting for the SQL tool (the model's
            arguments cannot change it).
        sql_timeout: seconds after which a running SQL statement is interrupted.
    """
    try:
        if not isinstance(name, str) or name not in TOOLS:
            raise ToolError(f"unknown tool {str(name)[:100]!r}")
        if sql_mode not in ("read_only", "read_write"):
            raise ToolError(f"sql_mode must be 'read_only' or 'read_write', not {sql_mode!r}")
        if not isinstance(args, dict):
            raise ToolError(f"the arguments must be a JSON object, not {type(args).__name__}")
        fn, keys = TOOLS[name]
        extra = sorted(str(k) for k in set(args) - keys)
        if extra:
            raise ToolError(f"unexpected argument '{extra[0][:100]}'")
        output, data = fn(args, Ctx(root, sql_mode, sql_timeout))
        ok = True
    except ToolError as e:
        ok, output, data = False, str(e), {"error": str(e)}
    except OSError as e:  # missing file, permission, read-only filesystem, ...: the path as the model wrote it
        where = f": {Ctx(root, sql_mode, sql_timeout).show(str(e.filename))}" if e.filename else ""
        ok, output, data = False, f"{e.strerror or e}{where}", {"error": type(e).__name__}
    except Exception as e:  # a bug in a tool must not take the agent (and the episode) down
        ok, output, data = False, f"internal error: {type(e).__name__}: {e}", {"error": type(e).__name__}
    if not ok and isinstance(name, str) and name in TOOLS:
        output = f"{name}: {output}"
    output, dropped = cap_output(output)
    data["truncated"] = dropped > 0 or bool(data.get("truncated"))  # a tool may have cut its data itself
    size = len(json.dumps(data, ensure_ascii=False, default=str))
    if size > MAX_DATA:  # a last guard: the tools cap their own data below this
        data = {"truncated": True, "omitted": f"data of {size} chars (more than {MAX_DATA}) left out"}
    return {"ok": ok, "output": output, "data": data}
