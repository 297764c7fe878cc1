"""The agent's tools as declared to the model: JSON Schemas (draft 2020-12) after kimi-cli's names.

    SCHEMAS[name] -> {"description": str, "parameters": {"type": "object", "additionalProperties": False, ...}}
    declare(names) -> [{"type": "function", "function": {"name", "description", "parameters"}}, ...]

`declare` gives the OpenAI tools format that `openk3.chat.render(request)` puts under `# Tools` (keys sorted
recursively there, so the order here does not matter). The same schemas validate the model's arguments in
`openk3.agent.policy` before a call runs, so a declared constraint (`maximum`, `enum`, `maxLength`, no extra
keys) is also an enforced one. `Shell` runs in the sandbox itself; every other tool runs through
`openk3.agent.toolbox.dispatch` inside the sandbox.
"""

from __future__ import annotations

import copy
import re

#: A tool name the XTML wire format can carry: it sits in a `tool="..."` attribute, which has no escape for
#: `<` (TRT-LLM notes the same), and the parser drops blank names. kimi-cli's names are all CamelCase.
TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")

_PATH = {"type": "string", "minLength": 1, "maxLength": 4096,
         "description": "A path relative to /workspace, or an absolute path inside the sandbox."}
_KEY = {"type": "string", "minLength": 1, "maxLength": 256}
_EDIT = {
    "type": "object", "additionalProperties": False, "required": ["old", "new"],
    "properties": {
        "old": {"type": "string", "minLength": 1, "description": "The exact text to replace."},
        "new": {"type": "string", "description": "The text to put in its place."},
        "replace_all": {"type": "boolean", "default": False,
                        "description": "Replace every occurrence (otherwise `old` must occur exactly once)."},
    },
}


def _tool(description: str, properties: dict, required: list[str]) -> dict:
    return {"description": description,
            "parameters": {"type": "object", "additionalProperties": False, "properties": properties,
                           "required": required}}


SCHEMAS: dict[str, dict] = {
    "Shell": _tool(
        "Run a bash command in /workspace inside the sandbox. Each call is a fresh `bash -c`; the working "
        "directory and exported variables carry over to the next call, background processes do not (they are "
        "killed when the command returns). No network. Output is capped at 50,000 chars (head and tail "
        "kept) and 2,000 chars per line.",
        {"command": {"type": "string", "minLength": 1, "maxLength": 16384, "description": "The bash command."},
         "timeout": {"type": "integer", "minimum": 1, "maximum": 300, "default": 60,
                     "description": "Seconds before the command is killed."},
         "description": {"type": "string", "maxLength": 200, "default": "",
                         "description": "What the command does, in a few words (shown to the user)."}},
        ["command"]),
    "ReadFile": _tool(
        "Read a text file; lines come numbered. Binary files are refused (their size and type are given). "
        "Invalid UTF-8 shows as U+FFFD. Lines longer than 2,000 chars are cut.",
        {"path": _PATH,
         "line_offset": {"type": "integer", "default": 1,
                         "description": "First line to read, 1-based; a negative value counts from the end "
                                        "(-10 starts 10 lines before the end)."},
         "n_lines": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 1000,
                     "description": "How many lines to read."}},
        ["path"]),
    "WriteFile": _tool(
        "Write text to a file (UTF-8), creating parent folders. Overwrites unless mode is append.",
        {"path": _PATH,
         "content": {"type": "string", "maxLength": 1048576},
         "mode": {"enum": ["overwrite", "append"], "default": "overwrite"}},
        ["path", "content"]),
    "StrReplaceFile": _tool(
        "Replace exact text in a file. Each edit's `old` must occur exactly once unless replace_all is set; "
        "edits apply in order and all-or-nothing. Returns a short diff.",
        {"path": _PATH,
         "edit": {"anyOf": [_EDIT, {"type": "array", "items": _EDIT, "minItems": 1, "maxItems": 50}],
                  "description": "One edit or a list of edits."}},
        ["path", "edit"]),
    "Glob": _tool(
        "List paths matching a glob pattern (`**` matches any depth), at most 1,000.",
        {"pattern": {"type": "string", "minLength": 1, "maxLength": 4096,
                     "description": "A relative pattern such as `src/**/*.py`."},
         "directory": {"type": ["string", "null"], "maxLength": 4096,
                       "description": "Folder to search from (default /workspace)."},
         "include_dirs": {"type": "boolean", "default": True}},
        ["pattern"]),
    "Grep": _tool(
        "Search file contents with a Python regular expression. Binary files and .git are skipped.",
        {"pattern": {"type": "string", "minLength": 1, "maxLength": 4096},
         "path": {"type": "string", "minLength": 1, "maxLength": 4096, "default": ".",
                  "description": "File or folder to search."},
         "glob": {"type": ["string", "null"], "maxLength": 4096,
                  "description": "Only files whose name or relative path matches, e.g. `*.py`."},
         "output_mode": {"enum": ["content", "files_with_matches", "count_matches"],
                         "default": "files_with_matches"},
         "-i": {"type": "boolean", "default": False, "description": "Ignore case."},
         "-n": {"type": "boolean", "default": True, "description": "Line numbers (content mode)."},
         "-C": {"type": ["integer", "null"], "minimum": 0, "maximum": 100,
                "description": "Lines of context around each match (content mode)."},
         "head_limit": {"type": "integer", "minimum": 0, "default": 250,
                        "description": "At most this many output lines or files (0: no limit)."}},
        ["pattern"]),
    "KVGet": _tool("Read a key from the key-value store: its JSON value and version (0 if never set).",
                   {"key": _KEY}, ["key"]),
    "KVSet": _tool(
        "Store a JSON value (at most 64 KiB) under a key; returns the new version. With if_version, the write "
        "happens only if the key's current version equals it (0: only if absent).",
        {"key": _KEY, "value": {"description": "Any JSON value."},
         "if_version": {"type": ["integer", "null"], "minimum": 0}},
        ["key", "value"]),
    "KVDelete": _tool("Delete a key from the key-value store.", {"key": _KEY}, ["key"]),
    "KVList": _tool(
        "List keys of the key-value store (sorted) with their versions.",
        {"prefix": {"type": "string", "maxLength": 256, "default": ""},
         "limit": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}},
        []),
    "SQL": _tool(
        "Run one SQLite statement on the environment's database, with `?` parameters. The environment may "
        "make it read-only; ATTACH and extensions are not available; long statements are stopped.",
        {"query": {"type": "string", "minLength": 1, "maxLength": 65536},
         "params": {"type": "array", "maxItems": 1000, "default": [],
                    "items": {"type": ["string", "number", "integer", "boolean", "null"]}},
         "max_rows": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 200}},
        ["query"]),
    "Submit": _tool("Submit the final answer; this ends the episode.",
                    {"answer": {"type": "string", "maxLength": 65536}}, ["answer"]),
}


def check_name(name: object) -> str:
    """`name` if the XTML wire format can carry it as a tool name, else ValueError."""
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise ValueError(f"tool name {name!r} is not allowed: use 1-64 letters, digits, `_`, `.` or `-`, "
                         "starting with a letter or `_` (a `<`, quote or space cannot be carried in XTML)")
    return name


def declare(names, schemas: dict[str, dict] | None = None) -> list[dict]:
    """The tools `names` in the OpenAI tools format, in the order given (deep copies: callers may edit them).

    Args:
        names: tool names, each a key of `schemas`.
        schemas: name -> {"description", "parameters"}; default SCHEMAS (pass a merged dict to add tools).
    """
    schemas = SCHEMAS if schemas is None else schemas
    out, seen = [], set()
    for name in names:
        check_name(name)
        if name not in schemas:
            raise ValueError(f"no schema for tool {name!r}; known tools: {', '.join(sorted(schemas))}")
        if name in seen:
            raise ValueError(f"tool {name!r} is declared twice")
        seen.add(name)
        spec = copy.deepcopy(schemas[name])
        out.append({"type": "function",
                    "function": {"name": name, "description": spec["description"], "parameters": spec["parameters"]}})
    return out
