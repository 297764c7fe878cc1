"""Host-side permission layers for the agent's tool calls (design background §1.7).

Each call goes through, in order, before it is sent to the sandbox:

1. the per-episode allow-list: a name not in `Policy.tools` -> `unknown tool 'X'`;
2. JSON Schema (draft 2020-12) validation of the arguments against the declared schema -> an observation
   naming the field;
3. path rules, for the file tools' paths: ordered `PathRule(glob, access)` with access none | read | write,
   the most specific matching rule wins (ties: the more restrictive); whatever any rule says, `protected`
   globs (and git hooks and config) are read-only and `/workspace/.state` is reachable only through the
   app tools (KV*, SQL) -- for writes a deny always beats an allow;
4. approval rules: the first `ApprovalRule` that matches decides allow / deny / ask; `ask` goes to the
   `approval_hook` (chat) or, without one, to `ask_default` (RL), whose denial reads
   `rejected by policy: <rule id>`.

`Policy.check(name, arguments) -> Decision(allowed, observation, rule_id)`; it never raises on what the model
sent. These checks are guidance and friction: paths are normalised lexically (`..` resolved against
/workspace; symlinks are not followed here; a Glob pattern with a `..` segment is refused) and command rules
match words of the command (`argv`, linear time) or regexes, which a determined command can dodge. A rule
regex with nested quantifiers (`regex_hazard`) is refused when the policy is built: the command comes from
the model, and the check runs on the host.
The sandbox's kernel boundary (namespaces, read-only binds, the overlay) is the real guard, and snapshots
undo what an allowed call did.
"""

from __future__ import annotations

import functools
import json
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError, best_match

from openk3.agent.toolbox import regex_hazard
from openk3.agent.tools import SCHEMAS, check_name

WORKSPACE = "/workspace"
STATE = "/workspace/.state"
ACCESS = ("none", "read", "write")          # ordered: a higher index grants more
DECISIONS = ("allow", "deny", "ask")
ANSWERS = ("approve", "approve_for_session", "reject")
#: The path arguments of the file tools and the access each needs (Glob's default folder is /workspace).
PATH_ARGS = {"ReadFile": ("path", "read"), "WriteFile": ("path", "write"), "StrReplaceFile": ("path", "write"),
             "Glob": ("directory", "read"), "Grep": ("path", "read")}
SQL_KINDS = frozenset({
    "SELECT", "VALUES", "WITH", "INSERT", "REPLACE", "UPDATE", "DELETE", "CREATE", "DROP", "ALTER", "PRAGMA",
    "ATTACH", "DETACH", "VACUUM", "ANALYZE", "REINDEX", "BEGIN", "COMMIT", "END", "ROLLBACK", "SAVEPOINT",
    "RELEASE", "EXPLAIN", "DELETE_WITHOUT_WHERE", "UPDATE_WITHOUT_WHERE",
})


def normalize(path: str) -> str:
    """A sandbox path, lexically: relative paths are under /workspace and `..` is resolved (never above /)."""
    p = posixpath.normpath(posixpath.join(WORKSPACE, path))
    return "/" + p.lstrip("/")  # normpath keeps a leading `//`


def _glob_regex(glob: str) -> re.Pattern:
    """A path glob (`*` within one name, `**` across folders, `?` one char) that also covers everything
    below a matching folder."""
    g, out, i = normalize(glob), [], 0
    if g == "/":
        return re.compile("/.*")
    while i < len(g):
        if g.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif g.startswith("**", i):
            out.append(".*")
            i += 2
        else:
            out.append({"*": "[^/]*", "?": "[^/]"}.get(g[i], re.escape(g[i])))
            i += 1
    return re.compile("".join(out) + "(?:/.*)?")


def _specificity(glob: str) -> tuple[int, int]:
    """Longer literal prefix first, then more literal chars."""
    g = normalize(glob)
    wild = [g.index(c) for c in "*?" if c in g]
    return (min(wild) if wild else len(g), len(g) - g.count("*") - g.count("?"))


def sql_kinds(query: str) -> set[str]:
    """The statement kinds in `query` (the first keyword of each statement, the main verb after a WITH),
    plus DELETE_WITHOUT_WHERE / UPDATE_WITHOUT_WHERE when no top-level WHERE follows that verb."""
    statements: list[list[str]] = [[]]
    depth, i, n = 0, 0, len(query)
    while i < n:
        c = query[i]
        if query.startswith("--", i):
            end = query.find("\n", i)
            i = n if end < 0 else end + 1
        elif query.startswith("/*", i):
            end = query.find("*/", i + 2)
            i = n if end < 0 else end + 2
        elif c in "'\"`[":
            close = "]" if c == "[" else c
            end = query.find(close, i + 1)
            while end >= 0 and close != "]" and query.startswith(close * 2, end):  # '' is an escaped quote
                end = query.find(close, end + 2)
            i = n if end < 0 else end + 1
        elif c.isalpha() or c == "_":
            j = i
            while j < n and (query[j].isalnum() or query[j] in "_$"):
                j += 1
            if depth == 0:
                statements[-1].append(query[i:j].upper())
            i = j
        else:
            depth += (c == "(") - (c == ")")
            if c == ";" and depth <= 0:
                statements.append([])
            i += 1
    kinds = set()
    for words in statements:
        if not words:
            continue
        verb = words[0]
        if verb == "WITH":
            verb = next((w for w in words[1:] if w in ("SELECT", "INSERT", "REPLACE", "UPDATE", "DELETE",
                                                       "VALUES")), "WITH")
        kinds.add(verb)
        if verb in ("DELETE", "UPDATE") and "WHERE" not in words[words.index(verb):]:
            kinds.add(f"{verb}_WITHOUT_WHERE")
    return kinds



@functools.lru_cache(maxsize=256)
def _validator(schema_json: str) -> Draft202012Validator:
    """A checked validator per distinct schema: checking a schema costs ~5 ms, and every sandboxed episode
    builds a policy (an eval of 144 agent episodes spent 5.5 s here before). Validators are read-only."""
    parameters = json.loads(schema_json)
    Draft202012Validator.check_schema(parameters)
    return Draft202012Validator(parameters)

@dataclass(frozen=True)
class PathRule:
    """Access to the paths a glob matches (and everything below them). Relative globs are under /workspace."""

    glob: str
    access: str

    def __post_init__(self):
        if not isinstance(self.glob, str) or not self.glob.strip():
            raise ValueError(f"path rule glob must be a non-empty string, not {self.glob!r}")
        if self.access not in ACCESS:
            raise ValueError(f"path rule {self.glob!r}: access must be one of {', '.join(ACCESS)}, "
                             f"not {self.access!r}")


_SEGMENTS = re.compile(r"[;&|()`\n]")   # where one simple command ends (also inside quotes: `bash -c "a; b"`)
_WORDS = re.compile(r"[\s'\"<>]+")     # what separates words (quotes too, so `bash -c "rm -r x"` shows rm)


def command_words(command: str) -> list[list[str]]:
    """A Shell command as lists of words, one list per simple command, lexically and in linear time: split
    at ; & | ( ), backquotes and newlines, then at whitespace, quotes and redirections; backslashes dropped
    (`\\rm` is rm). Not a shell parser: quoted text is split like the rest, as a regex over the command
    would see it."""
    segments = []
    for segment in _SEGMENTS.split(command):
        words = [w.replace("\\", "") for w in _WORDS.split(segment)]
        words = [w for w in words if w]
        if words:
            segments.append(words)
    return segments


@dataclass(frozen=True)
class ApprovalRule:
    """When a call of `tool` ("*": any tool) matches, `decision` applies. At most one matcher: `argv` (word
    regexes, below), `command` (a regex searched in Shell's command), `path` (a glob on the call's path),
    `sql` (a kind from `sql_kinds`, e.g. DROP or DELETE_WITHOUT_WHERE); none matches every call of the tool.

    `argv` is a list of word regexes, or a list of such lists (alternatives): a Shell call matches when, in
    one simple command of `command_words(command)`, words that fullmatch the regexes appear in that order
    (not necessarily adjacent): ["git", "push"] matches `git -C repo push`. Matching is linear in the
    command's length, so prefer it to `command`. A regex with nested quantifiers (`(a+)+`) is refused in
    either: it can take exponential time on the model's input."""

    id: str
    tool: str
    decision: str
    command: str | None = None
    path: str | None = None
    sql: str | None = None
    argv: tuple | None = None

    def __post_init__(self):
        where = f"approval rule {self.id!r}"
        if not isinstance(self.id, str) or not self.id.strip():
            raise ValueError(f"approval rule id must be a non-empty string, not {self.id!r}")
        if self.tool != "*":
            try:
                check_name(self.tool)
            except ValueError as e:
                raise ValueError(f"{where}: tool: {e}") from None
        if self.decision not in DECISIONS:
            raise ValueError(f"{where}: decision must be one of {', '.join(DECISIONS)}, not {self.decision!r}")
        given = [k for k in ("command", "path", "sql", "argv") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"{where}: give at most one of command, path, sql, argv (got {', '.join(given)})")
        if given and given[0] in ("command", "argv") and self.tool not in ("Shell", "*"):
            raise ValueError(f"{where}: {given[0]} matches Shell calls only, but tool is {self.tool!r}")
        if self.command is not None:
            object.__setattr__(self, "_matcher", _compile(self.command, f"{where}: command"))
        if self.argv is not None:
            alternatives = self.argv
            if isinstance(alternatives, (list, tuple)) and alternatives and all(isinstance(w, str)
                                                                                for w in alternatives):
                alternatives = [alternatives]
            if (not isinstance(alternatives, (list, tuple)) or not alternatives
                    or not all(isinstance(a, (list, tuple)) and a and all(isinstance(w, str) for w in a)
                               for a in alternatives)):
                raise ValueError(f"{where}: argv must be a non-empty list of word regexes (or a list of such "
                                 f"lists), not {self.argv!r}")
            alternatives = tuple(tuple(a) for a in alternatives)
            object.__setattr__(self, "argv", alternatives)  # hashable and in one shape, whatever was given
            object.__setattr__(self, "_matcher", tuple(
                tuple(_compile(w, f"{where}: argv[{k}][{j}]") for j, w in enumerate(a))
                for k, a in enumerate(alternatives)))
        if self.path is not None:
            if not isinstance(self.path, str) or not self.path.strip():
                raise ValueError(f"{where}: path must be a non-empty glob, not {self.path!r}")
            object.__setattr__(self, "_matcher", _glob_regex(self.path))
        if self.sql is not None and self.sql not in SQL_KINDS:
            raise ValueError(f"{where}: sql must be one of {', '.join(sorted(SQL_KINDS))}, not {self.sql!r}")

    def matches(self, name: str, args: dict, path: str | None) -> bool:
        if self.tool not in ("*", name):
            return False
        if self.command is not None:
            return name == "Shell" and bool(self._matcher.search(str(args.get("command", ""))))
        if self.argv is not None:
            return name == "Shell" and any(_in_order(words, seq) for words in
                                           command_words(str(args.get("command", ""))) for seq in self._matcher)
        if self.path is not None:
            return path is not None and self._matcher.fullmatch(path) is not None
        if self.sql is not None:
            return name == "SQL" and self.sql in sql_kinds(str(args.get("query", "")))
        return True


@dataclass(frozen=True)
class Decision:
    allowed: bool
    observation: str | None = None  # the tool-error text the model sees when not allowed
    rule_id: str | None = None      # what decided: an approval rule id, "path:<glob>", "path:no-rule" (no path
    #                                 rule matches), "path" (a malformed path or pattern), "schema", "allow-list"


@dataclass(frozen=True)
class ToolCall:
    """What `approval_hook` is asked about."""

    name: str
    arguments: dict
    rule_id: str


def _compile(pattern: Any, where: str) -> re.Pattern:
    try:
        rx, hazard = re.compile(pattern), regex_hazard(pattern)
    except (re.error, TypeError) as e:
        raise ValueError(f"{where} is not a valid regex: {e}") from None
    if hazard:
        raise ValueError(f"{where}: the regex {pattern!r} has {hazard}, which can take exponential time")
    return rx


def _in_order(words: list[str], regexes: tuple[re.Pattern, ...]) -> bool:
    """Whether words fullmatching `regexes` appear in `words` in that order (the earliest match of each
    leaves the most words for the rest, so one pass decides)."""
    k = 0
    for word in words:
        if regexes[k].fullmatch(word):
            k += 1
            if k == len(regexes):
                return True
    return False


DEFAULT_PATH_RULES = (
    PathRule("/", "read"),             # the sandbox's own view: read-only binds, nothing of the host's
    PathRule(WORKSPACE, "write"),
    PathRule("/tmp", "write"),
    PathRule(STATE, "none"),           # enforced whatever the rules say: apps only
)
#: Read-only for the file tools in every policy; an environment's `protected` adds tests/, grader files, ...
ALWAYS_PROTECTED = ("**/.git/hooks", "**/.git/config")
# Word regexes only (each fullmatches one word) and no two quantifiers that could share a char, so every
# rule is linear in the command; the fork bomb's shape needs its punctuation, hence a `command` regex whose
# quantifiers each match only whitespace between fixed chars.
_R_FLAG = r"-[^\W\d_rR]*[rR][a-zA-Z]*|--recursive"   # -r, -fr, -Rf: the letters before the first r are not r
_F_FLAG = r"-[^\W\d_f]*f[a-zA-Z]*|--force"
DEFAULT_APPROVAL_RULES = (
    ApprovalRule("R-rm", "Shell", "ask", argv=("rm", _R_FLAG)),
    ApprovalRule("R-sudo", "Shell", "deny", argv=("sudo|doas|pkexec|su",)),
    ApprovalRule("R-fork-bomb", "Shell", "deny", command=r":\s*\(\s*\)\s*\{"),
    ApprovalRule("R-network", "Shell", "ask", argv=("curl|wget|nc|ncat|netcat|ssh|scp|sftp|rsync|telnet|ftp",)),
    ApprovalRule("R-git-push", "Shell", "ask", argv=("git", "push")),
    ApprovalRule("R-git-discard", "Shell", "ask", argv=(("git", "reset", "--hard"), ("git", "clean", _F_FLAG))),
    ApprovalRule("R-disk", "Shell", "ask", argv=(r"mkfs(?:\.\w+)?|dd|shred|wipefs",)),
    ApprovalRule("R-sql-drop", "SQL", "ask", sql="DROP"),
    ApprovalRule("R-sql-delete-all", "SQL", "ask", sql="DELETE_WITHOUT_WHERE"),
    ApprovalRule("R-sql-update-all", "SQL", "ask", sql="UPDATE_WITHOUT_WHERE"),
)


@dataclass
class Policy:
    """The permission layers of one episode (or chat session).

    Args:
        tools: the allow-list; only these are declared to the model and may run.
        path_rules: ordered PathRules for the file tools (default DEFAULT_PATH_RULES).
        protected: globs that are read-only whatever path_rules say (added to ALWAYS_PROTECTED: git hooks
            and config).
        approval_rules: ordered ApprovalRules, first match decides (default DEFAULT_APPROVAL_RULES).
        ask_default: "deny" or "allow": what `ask` resolves to without an approval_hook (RL).
        approval_hook: `hook(ToolCall) -> "approve" | "approve_for_session" | "reject"` or a tuple
            (answer, feedback); feedback is appended to a rejection's observation.
        schemas: name -> {"description", "parameters"} (default openk3.agent.tools.SCHEMAS).
    """

    tools: tuple[str, ...]
    path_rules: tuple[PathRule, ...] = DEFAULT_PATH_RULES
    protected: tuple[str, ...] = ()
    approval_rules: tuple[ApprovalRule, ...] = DEFAULT_APPROVAL_RULES
    ask_default: str = "deny"
    approval_hook: Callable[[ToolCall], Any] | None = None
    schemas: dict[str, dict] | None = None
    approved_for_session: set[str] = field(default_factory=set)  # rule ids the user approved for the session

    def __post_init__(self):
        if isinstance(self.tools, str) or not all(isinstance(t, str) for t in self.tools or ()):
            raise ValueError(f"policy.tools must be a list of tool names, not {self.tools!r}")
        self.tools = tuple(self.tools)
        schemas = SCHEMAS if self.schemas is None else self.schemas
        self._validators = {}
        for name in self.tools:
            check_name(name)
            if name not in schemas:
                raise ValueError(f"policy.tools: no schema for {name!r}; known: {', '.join(sorted(schemas))}")
            try:
                parameters = schemas[name]["parameters"]
                self._validators[name] = _validator(json.dumps(parameters, sort_keys=True))
            except (KeyError, TypeError, ValueError, SchemaError) as e:
                raise ValueError(f"policy.schemas[{name!r}]: not a valid JSON Schema: {str(e)[:300]}") from None
        self.path_rules = tuple(_coerce(PathRule, r, f"policy.path_rules[{k}]") for k, r in
                                enumerate(self.path_rules))
        self.approval_rules = tuple(_coerce(ApprovalRule, r, f"policy.approval_rules[{k}]") for k, r in
                                    enumerate(self.approval_rules))
        ids = [r.id for r in self.approval_rules]
        if len(set(ids)) != len(ids):
            raise ValueError(f"policy.approval_rules: duplicate rule id {next(i for i in ids if ids.count(i) > 1)!r}")
        if isinstance(self.protected, str) or not all(isinstance(g, str) and g.strip() for g in self.protected):
            raise ValueError(f"policy.protected must be a list of path globs, not {self.protected!r}")
        self.protected = tuple(self.protected)
        if self.ask_default not in ("deny", "allow"):
            raise ValueError(f"policy.ask_default must be 'deny' or 'allow', not {self.ask_default!r}")
        self._rules = [(_glob_regex(r.glob), _specificity(r.glob), r) for r in self.path_rules]
        # Caps beat any rule: protected paths are at most read, the app state at most none.
        self._caps = [(_glob_regex(g), "read", g) for g in ALWAYS_PROTECTED + self.protected]
        self._caps.append((_glob_regex(STATE), "none", STATE))

    @classmethod
    def from_dict(cls, spec: dict, **kwargs) -> Policy:
        """A policy from an environment spec's JSON: {tools, path_rules: [{glob, access}], protected: [glob],
        approval_rules: [{id, tool, decision, command | path | sql}], ask_default}; kwargs add the rest."""
        if not isinstance(spec, dict):
            raise ValueError(f"policy must be a JSON object, not {type(spec).__name__}")
        known = {"tools", "path_rules", "protected", "approval_rules", "ask_default"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"policy: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
        if "tools" not in spec:
            raise ValueError("policy: the field 'tools' (the allow-list) is required")
        return cls(**spec, **kwargs)

    def path_access(self, path: str) -> tuple[str, str | None]:
        """(access, deciding glob) for a normalised path."""
        matched = [(spec, -ACCESS.index(r.access), r) for rx, spec, r in self._rules if rx.fullmatch(path)]
        if not matched:
            return "none", None
        rule = max(matched, key=lambda m: m[:2])[2]
        access, glob = rule.access, rule.glob
        for rx, cap, cap_glob in self._caps:
            if rx.fullmatch(path) and ACCESS.index(cap) < ACCESS.index(access):
                access, glob = cap, cap_glob
        return access, glob

    def check(self, name: Any, arguments: Any) -> Decision:
        """Run the layers in order for one call; the first that refuses gives the observation."""
        if not isinstance(name, str) or name not in self.tools:
            return Decision(False, f"unknown tool '{str(name)[:100]}'", "allow-list")
        if not isinstance(arguments, dict):
            return Decision(False, f"invalid arguments for {name}: the arguments must be a JSON object", "schema")
        error = best_match(self._validators[name].iter_errors(arguments))
        if error is not None:
            field_name = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)[1:]
            where = f"field '{field_name}': " if field_name else ""
            return Decision(False, f"invalid arguments for {name}: {where}{error.message[:300]}", "schema")
        path = None
        if name in PATH_ARGS:
            key, need = PATH_ARGS[name]
            raw = arguments.get(key)
            raw = ("." if raw is None else raw) if name != "Glob" else _glob_base(raw, arguments["pattern"])
            if any(ord(c) < 32 or c == "\x7f" for c in raw):
                return Decision(False, f"invalid path {raw[:200]!r}: control characters are not allowed", "path")
            if name == "Glob" and ".." in arguments["pattern"].split("/"):
                # Only the folder a pattern starts from is checked: `*/../../etc/*` would list what it climbs to.
                return Decision(False, f"invalid pattern {arguments['pattern'][:200]!r}: a Glob pattern must not "
                                "contain '..'; put the folder in 'directory'", "path")
            path = normalize(raw)
            access, glob = self.path_access(path)
            if ACCESS.index(access) < ACCESS.index(need):
                why = "not accessible to file tools" if access == "none" else "read-only"
                # No rule matching is a refusal too (the default is none): say so rather than `path:None`.
                rule = glob or "no path rule matches it"
                return Decision(False, f"path not allowed by policy: {path} is {why} ({rule})",
                                f"path:{glob}" if glob else "path:no-rule")
        for rule in self.approval_rules:
            if rule.matches(name, arguments, path):
                return self._decide(rule, name, arguments)
        return Decision(True)

    def _decide(self, rule: ApprovalRule, name: str, arguments: dict) -> Decision:
        if rule.decision == "allow" or (rule.decision == "ask" and rule.id in self.approved_for_session):
            return Decision(True, None, rule.id)
        if rule.decision == "deny":
            return Decision(False, f"rejected by policy: {rule.id}", rule.id)
        if self.approval_hook is None:
            allowed = self.ask_default == "allow"
            return Decision(allowed, None if allowed else f"rejected by policy: {rule.id}", rule.id)
        answer, feedback = self.approval_hook(ToolCall(name, dict(arguments), rule.id)), None
        if isinstance(answer, tuple) and len(answer) == 2:
            answer, feedback = answer
        if answer not in ANSWERS:
            raise ValueError(f"approval_hook returned {answer!r}; expected one of {', '.join(ANSWERS)}")
        if answer == "reject":
            return Decision(False, f"rejected by the user: {rule.id}" + (f": {feedback}" if feedback else ""),
                            rule.id)
        if answer == "approve_for_session":
            self.approved_for_session.add(rule.id)
        return Decision(True, None, rule.id)


def _glob_base(directory: str | None, pattern: str) -> str:
    """The folder a Glob call reads: its directory joined with the pattern's literal leading part (so that
    `../../etc/*` is checked as the folder it lists)."""
    head = []
    for part in pattern.split("/"):
        if any(c in part for c in "*?["):
            break
        head.append(part)
    return posixpath.join(directory or WORKSPACE, *head) if head else (directory or WORKSPACE)


def _coerce(cls, value, where: str):
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object, not {type(value).__name__}")
    try:
        return cls(**value)
    except TypeError as e:  # an unknown or missing key
        raise ValueError(f"{where}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
