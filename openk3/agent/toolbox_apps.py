"""The agent's stateful apps, run INSIDE the sandbox: a key-value store, SQL over SQLite, and Submit.

STDLIB ONLY (it runs under the system `/usr/bin/python3` beside `toolbox.py`, which dispatches to it).
Every app keeps its state in a SQLite file under `<root>/.state/` (`kv.sqlite`, `app.db`) and nothing in
memory between calls, so a filesystem snapshot of the workspace captures it and a fork or restore brings
it back. Each call opens its database, works in one transaction, and closes it. The journal stays in
SQLite's default rollback mode (no `-wal` file beside the database) so the database is a single file
whenever no call is running, which is when snapshots are taken.

KV store: keys map to JSON values with a version that grows by one on every write of the key (a delete
leaves a tombstone so the version never goes back: a stale `if_version` cannot match a re-created key).
A missing key has version 0, or its tombstone's version. `KVSet(if_version=v)` writes only when the
current version is v (optimistic concurrency; v=0 means "only if absent").

SQL: one statement per call. An authorizer denies ATTACH (which also covers `VACUUM INTO`, any file
outside `.state/`), `load_extension` and the `writable_schema` pragma always; in read-only mode (the
environment's setting, passed to dispatch, never the model's) it also denies every write, on top of
opening the file read-only with `query_only` on. A progress handler interrupts a statement that runs
past `sql_timeout` seconds. A result's `data` holds each cell cut to MAX_DATA_CELL chars (a blob as hex of
its first bytes) and rows until MAX_SQL_DATA chars, with `truncated: true` when anything was cut; the text
output shows MAX_CELL chars a cell.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import time
from pathlib import Path


class ToolError(Exception):
    """A bad call: the message becomes the tool observation (`ok: False`)."""


STATE_DIR = ".state"
KV_FILE = "kv.sqlite"
SQL_FILE = "app.db"
MAX_KEY = 256
MAX_VALUE = 64 * 1024     # bytes of a KV value's JSON
MAX_KV_LIST = 1_000
MAX_SQL_ROWS = 1_000
MAX_PARAMS = 1_000
MAX_CELL = 200            # chars of one SQL cell in the text output
MAX_DATA_CELL = 64 * 1024  # chars of one SQL cell in `data` (a blob's hex counts; longer ones are cut)
MAX_SQL_DATA = 1 << 19    # chars of all the cells in `data`: rows past it are left out (well under 1 MiB)

_WRITES = {  # authorizer actions denied in read-only mode
    sqlite3.SQLITE_INSERT, sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_DELETE, sqlite3.SQLITE_ALTER_TABLE,
    sqlite3.SQLITE_CREATE_INDEX, sqlite3.SQLITE_CREATE_TABLE, sqlite3.SQLITE_CREATE_TEMP_INDEX,
    sqlite3.SQLITE_CREATE_TEMP_TABLE, sqlite3.SQLITE_CREATE_TEMP_TRIGGER, sqlite3.SQLITE_CREATE_TEMP_VIEW,
    sqlite3.SQLITE_CREATE_TRIGGER, sqlite3.SQLITE_CREATE_VIEW, sqlite3.SQLITE_CREATE_VTABLE,
    sqlite3.SQLITE_DROP_INDEX, sqlite3.SQLITE_DROP_TABLE, sqlite3.SQLITE_DROP_TEMP_INDEX,
    sqlite3.SQLITE_DROP_TEMP_TABLE, sqlite3.SQLITE_DROP_TEMP_TRIGGER, sqlite3.SQLITE_DROP_TEMP_VIEW,
    sqlite3.SQLITE_DROP_TRIGGER, sqlite3.SQLITE_DROP_VIEW, sqlite3.SQLITE_DROP_VTABLE,
    sqlite3.SQLITE_REINDEX, sqlite3.SQLITE_ANALYZE,
}


_REQUIRED = object()


def arg(args: dict, name: str, kind, default=_REQUIRED):
    """args[name], checked to be of `kind` (a type or a tuple of types; bool is never an int, 2.0 is 2)."""
    if name not in args:
        if default is _REQUIRED:
            raise ToolError(f"missing required argument '{name}'")
        return default
    value = args[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if int in kinds and isinstance(value, float) and value.is_integer():
        return int(value)  # JSON Schema's integer includes 2.0, and the host validated against it
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise ToolError(f"argument '{name}' must be {names}, not {type(value).__name__}")
    return value


class Ctx:
    """Where a call runs: the workspace root and the environment's SQL settings."""

    def __init__(self, root: str, sql_mode: str, sql_timeout: float):
        self.root, self.sql_mode, self.sql_timeout = root, sql_mode, sql_timeout

    def path(self, value: str) -> str:
        """A file tool's path argument as a path in the sandbox's view (relative paths are under root).

        The apps' state folder is refused here too, after resolving symlinks: the host's path rules are
        lexical, so `ln -s .state s` then `WriteFile s/kv.sqlite` would pass them."""
        if not value:
            raise ToolError("the path is empty")
        if "\0" in value:
            raise ToolError("the path contains a NUL character")
        path = value if os.path.isabs(value) else os.path.join(self.root, value)
        real, state = os.path.realpath(path), os.path.realpath(os.path.join(self.root, STATE_DIR))
        if real == state or real.startswith(state + os.sep):
            raise ToolError(f"{value} is in the apps' state folder ({STATE_DIR}/); use the KV and SQL tools")
        return path

    def open(self, path: str, mode: str = "rb"):
        """Open a regular file ("rb", "wb" or "ab"). Non-blocking first, so a FIFO (which would block the
        agent until someone writes to it) or a device is refused instead of hanging the call."""
        flags = {"rb": os.O_RDONLY, "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                 "ab": os.O_WRONLY | os.O_CREAT | os.O_APPEND}[mode]
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ToolError(f"{self.show(path)} is not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode)

    def show(self, path: str) -> str:
        """How a path is written back to the model: relative to root when it is under root."""
        rel = os.path.relpath(path, self.root)
        return path if rel == ".." or rel.startswith("../") else rel


def _state_file(ctx, name: str, create: bool) -> str:
    folder = os.path.join(ctx.root, STATE_DIR)
    if create:
        os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, name)


# --------------------------------------------------------------------------------------------------
# KV store


def _kv(ctx) -> sqlite3.Connection:
    conn = sqlite3.connect(_state_file(ctx, KV_FILE, create=True), timeout=5.0, isolation_level=None)
    conn.execute("CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT, version INTEGER NOT NULL, "
                 "deleted INTEGER NOT NULL DEFAULT 0)")
    conn.execute("BEGIN IMMEDIATE")  # read-check-write is one transaction: if_version cannot race
    return conn


def _key(args) -> str:
    key = arg(args, "key", str)
    if not 1 <= len(key) <= MAX_KEY:
        raise ToolError(f"key must be 1 to {MAX_KEY} chars, got {len(key)}")
    return key


def _current(conn, key: str) -> tuple[bool, object, int]:
    row = conn.execute("SELECT value, version, deleted FROM kv WHERE key = ?", (key,)).fetchone()
    if row is None:
        return False, None, 0
    return (False, None, row[1]) if row[2] else (True, json.loads(row[0]), row[1])


def _kv_get(args, ctx):
    key = _key(args)
    conn = _kv(ctx)
    try:
        found, value, version = _current(conn, key)
    finally:
        conn.close()
    text = json.dumps(value, ensure_ascii=False) if found else "(not found)"
    return f"{key} = {text} (version {version})", {"key": key, "found": found, "value": value, "version": version}


def _kv_set(args, ctx):
    key = _key(args)
    if "value" not in args:
        raise ToolError("missing required argument 'value'")
    if_version = arg(args, "if_version", (int, type(None)), None)
    try:
        text = json.dumps(args["value"], ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ToolError(f"value is not JSON: {e}") from None
    if len(text.encode("utf-8", "surrogatepass")) > MAX_VALUE:
        raise ToolError(f"value is {len(text.encode('utf-8', 'surrogatepass'))} bytes of JSON; the limit is "
                        f"{MAX_VALUE}")
    conn = _kv(ctx)
    try:
        _, _, version = _current(conn, key)
        if if_version is not None and if_version != version:
            raise ToolError(f"version mismatch for {key!r}: if_version={if_version} but the current version is "
                            f"{version} (nothing was written)")
        conn.execute("INSERT INTO kv (key, value, version, deleted) VALUES (?, ?, ?, 0) ON CONFLICT(key) DO "
                     "UPDATE SET value = excluded.value, version = excluded.version, deleted = 0",
                     (key, text, version + 1))
        conn.execute("COMMIT")
    finally:
        conn.close()  # an uncommitted transaction rolls back here
    return f"{key} set (version {version + 1})", {"key": key, "version": version + 1}


def _kv_delete(args, ctx):
    key = _key(args)
    conn = _kv(ctx)
    try:
        found, _, version = _current(conn, key)
        if found:
            version += 1
            conn.execute("UPDATE kv SET value = NULL, version = ?, deleted = 1 WHERE key = ?", (version, key))
        conn.execute("COMMIT")
    finally:
        conn.close()
    text = f"{key} deleted (version {version})" if found else f"{key} was not set"
    return text, {"key": key, "deleted": found, "version": version}


def _kv_list(args, ctx):
    prefix = arg(args, "prefix", str, "")
    limit = arg(args, "limit", int, 100)
    if not 1 <= limit <= MAX_KV_LIST:
        raise ToolError(f"limit must be between 1 and {MAX_KV_LIST}, not {limit}")
    conn = _kv(ctx)
    try:
        rows = conn.execute("SELECT key, version FROM kv WHERE deleted = 0 AND substr(key, 1, ?) = ? "
                            "ORDER BY key LIMIT ?", (len(prefix), prefix, limit + 1)).fetchall()
    finally:
        conn.close()
    more = len(rows) > limit
    keys = [{"key": k, "version": v} for k, v in rows[:limit]]
    body = "\n".join(f"{k['key']} (version {k['version']})" for k in keys) or f"no keys with prefix {prefix!r}"
    if more:
        body += f"\n[more than {limit} keys; raise limit or narrow the prefix]"
    return body, {"keys": keys, "more": more}


# --------------------------------------------------------------------------------------------------
# SQL


def _authorizer(read_only: bool, denied: list):
    def check(action, arg1, arg2, db_name, trigger):
        reason = None
        if action == sqlite3.SQLITE_ATTACH:
            reason = "ATTACH (and VACUUM INTO) is not allowed: the database is .state/app.db only"
        elif action == sqlite3.SQLITE_FUNCTION and arg2 and arg2.lower() == "load_extension":
            reason = "load_extension is not allowed"
        elif action == sqlite3.SQLITE_PRAGMA and arg1 and arg1.lower() == "writable_schema":
            reason = "PRAGMA writable_schema is not allowed"
        elif read_only and action in _WRITES:
            reason = "the database is read-only in this environment"
        elif read_only and action == sqlite3.SQLITE_PRAGMA and arg1 and arg1.lower() == "query_only":
            reason = "the database is read-only in this environment"
        if reason is None:
            return sqlite3.SQLITE_OK
        denied.append(reason)
        return sqlite3.SQLITE_DENY
    return check


def _cell(value) -> tuple[object, bool]:
    """A result cell as JSON data (blobs as hex), cut to MAX_DATA_CELL chars; and whether it was cut."""
    if isinstance(value, bytes):  # slice before hex: `randomblob(9000000)` must not become 18 MB of text
        return value[:MAX_DATA_CELL // 2].hex(), len(value) > MAX_DATA_CELL // 2
    if isinstance(value, str) and len(value) > MAX_DATA_CELL:
        return value[:MAX_DATA_CELL], True
    return value, False


def _cell_text(value) -> str:
    if isinstance(value, bytes):
        text, n = f"x'{value[:MAX_CELL].hex()}'", 2 * len(value) + 3
    else:
        text = "NULL" if value is None else str(value)
        n = len(text)
    return text if n <= MAX_CELL else f"{text[:MAX_CELL]}[...{n - MAX_CELL} chars]"


def _sql(args, ctx):
    query = arg(args, "query", str)
    params = arg(args, "params", list, [])
    max_rows = arg(args, "max_rows", int, 200)
    if not 1 <= max_rows <= MAX_SQL_ROWS:
        raise ToolError(f"max_rows must be between 1 and {MAX_SQL_ROWS}, not {max_rows}")
    if len(params) > MAX_PARAMS or not all(p is None or isinstance(p, (str, int, float)) for p in params):
        raise ToolError(f"params must be a list of at most {MAX_PARAMS} strings, numbers, booleans or nulls")
    if not query.strip():
        raise ToolError("the query is empty")
    read_only = ctx.sql_mode == "read_only"
    path = _state_file(ctx, SQL_FILE, create=not read_only)
    if read_only:
        if not os.path.exists(path):
            raise ToolError(f"there is no database ({STATE_DIR}/{SQL_FILE}) and it is read-only in this environment")
        uri = Path(path).absolute().as_uri() + "?mode=ro"  # as_uri quotes any `?` or `#` in the path
        conn = sqlite3.connect(uri, uri=True, timeout=5.0, isolation_level=None)
    else:
        conn = sqlite3.connect(path, timeout=5.0, isolation_level=None)
    denied: list[str] = []
    deadline = time.monotonic() + ctx.sql_timeout
    try:
        if read_only:
            conn.execute("PRAGMA query_only = ON")
        conn.set_authorizer(_authorizer(read_only, denied))
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
        try:
            cur = conn.execute(query, params)
            rows = cur.fetchmany(max_rows + 1)
        except (sqlite3.Error, sqlite3.Warning) as e:
            if denied:
                raise ToolError(f"denied: {denied[0]}") from None
            if "one statement at a time" in str(e):
                raise ToolError("one SQL statement per call (split the statements into separate calls)") from None
            if "interrupted" in str(e):
                raise ToolError(f"the statement ran past the {ctx.sql_timeout:g} s limit and was stopped") from None
            raise ToolError(f"{type(e).__name__}: {e}") from None
        columns = [d[0] for d in cur.description or ()]
        changed = conn.total_changes
    finally:
        conn.close()
    more = len(rows) > max_rows
    rows = rows[:max_rows]
    kept, size, cut = [], 0, False
    for r in rows:
        if size > MAX_SQL_DATA:  # the rest of the rows are left out of data (the text still shows them, cut)
            cut = True
            break
        cells = [_cell(v) for v in r]
        cut = cut or any(c for _, c in cells)
        size += sum(len(v) if isinstance(v, str) else 8 for v, _ in cells)
        kept.append([v for v, _ in cells])
    data = {"columns": columns, "rows": kept, "more": more, "changes": changed, "truncated": cut}
    if not columns:
        return f"OK ({changed} row{'s' * (changed != 1)} changed)", data
    lines = [" | ".join(columns)] + [" | ".join(_cell_text(v) for v in r) for r in rows]
    lines.append(f"({len(rows)} row{'s' * (len(rows) != 1)}{'; more rows exist, raise max_rows' if more else ''})")
    return "\n".join(lines), data


def _submit(args, ctx):
    answer = arg(args, "answer", str)
    return "Submitted.", {"answer": answer}


TOOLS = {
    "KVGet": (_kv_get, {"key"}),
    "KVSet": (_kv_set, {"key", "value", "if_version"}),
    "KVDelete": (_kv_delete, {"key"}),
    "KVList": (_kv_list, {"prefix", "limit"}),
    "SQL": (_sql, {"query", "params", "max_rows"}),
    "Submit": (_submit, {"answer"}),
}
