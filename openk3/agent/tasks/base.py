"""Verifiable tasks for agentic RL: the `Task` record, the family registry, `generate`, and the grader protocol.

    task = generate("fix_test", seed=7, difficulty=2, split="train")
    with Sandbox(files=task.files, env=task.env) as sb:
        ...                                   # the episode: the agent sees task.instruction and task.tools
        reward = task.score(sb, answer)       # forks sb with /grader bound read-only, runs the grader there

A task is plain data made on the host: the initial `/workspace` (`files`), the grader's files (`grader_files`,
bound at `/grader` only in the verifier's fork, so the agent never sees nor changes them), the tools the
episode may use and a reference solution (host-side only, for tests and sanity checks).

Grader protocol (one for every family): the verifier runs `/usr/bin/python3 -I /grader/grade.py` in the fork,
in `/workspace`, with the answer (JSON) and a fresh nonce in its environment. The grader's last stdout line
must be `{"nonce": ..., "reward": r}` with the same nonce, and its exit status 0; anything else scores 0.
Why the nonce: a grader that runs the agent's code (fix_test) does so in a child process after making itself
undumpable, so the child can neither read the nonce (/proc/<grader>/environ) nor forge the grader's reply.
The fork's shell state is reset to the base environment first: the agent's exported variables (BASH_ENV,
exported bash functions shadowing `cd` or `python3`) must not reach the grader.

Splits. `train` and `test` draw from a family's ordinary templates and are told apart by a hash of what the
agent sees (instruction + files): a generated instance belongs to exactly one of them (80/20), and
`generate` retries the seed's next attempt until the instance falls in the requested split, so the two never
share a task. `heldout` draws only from templates that train and test never use (held-out templates).
Everything is a function of (family, seed, difficulty, split): the same arguments give the same task.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import random
import secrets
import shlex
import shutil
import sqlite3
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from openk3.agent.audit import canonical_json

SPLITS = ("train", "test", "heldout")
TEST_BUCKETS = 2  # of 10 hash buckets: the test share of the ordinary templates' instances
MAX_ATTEMPTS = 1000  # a split holds ~20 % or more of a family's instances: this is never reached in practice
GRADE_TIMEOUT = 60.0  # seconds the grader may run in the verifier fork
SQLITE_MAGIC = b"SQLite format 3\x00"


class Call(NamedTuple):
    """One step of a scripted solution: a tool name (kimi-cli's) and its arguments."""

    name: str
    args: dict


@dataclass
class Task:
    family: str
    seed: int
    difficulty: int
    split: str
    template: str  # the family's template the instance came from (held-out templates only in `heldout`)
    instruction: str  # the user message
    files: dict[str, str | bytes]  # the initial /workspace (relative paths)
    grader_files: dict[str, str | bytes]  # bound read-only at /grader in the verifier's fork only
    tools: list[str]  # the tools the episode may use (kimi-cli names)
    sql_mode: str = "read_write"  # the SQL tool's mode for this episode
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the episode: Sandbox(env=task.env)
    protected: tuple[str, ...] = ()  # path globs the file tools must not write (Policy(protected=...))
    solution: list[Call] = field(default_factory=list, repr=False)  # a reference solution (host-side only)
    grader_key: str = field(default="", repr=False)  # secret passed to the grader at verify time (see fix_test)

    @property
    def id(self) -> str:
        return f"{self.family}/{self.split}/d{self.difficulty}/s{self.seed}"

    def content_hash(self) -> str:
        """sha256 of what the agent sees (instruction and files); SQLite files count by their SQL dump, so the
        hash, and with it the train/test split, does not depend on the SQLite library's file layout."""
        h = hashlib.sha256()
        h.update(self.instruction.encode())
        for path in sorted(self.files):
            data = self.files[path]
            h.update(b"\0" + path.encode() + b"\0")
            h.update(_canonical_bytes(data))
        return h.hexdigest()

    @contextlib.contextmanager
    def grader_dir(self) -> Iterator[str]:
        """The grader files in a fresh temp folder that the sandbox uid can read (dirs 0o755, files 0o644),
        removed on exit."""
        root = tempfile.mkdtemp(prefix="openk3-grader-")
        try:
            os.chmod(root, 0o755)
            write_tree(root, self.grader_files)
            yield root
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def verify(self, sandbox_fork, answer: str | None, timeout: float = GRADE_TIMEOUT) -> float:
        """Reward in [0, 1] from /grader/grade.py run in `sandbox_fork` (a fork with this task's grader files
        bound at /grader). The fork's shell state is reset first; use a fork, never the episode's sandbox."""
        from ..sandbox import BASE_ENV

        if answer is not None and not isinstance(answer, str):
            raise ValueError(f"Task.verify({self.id}): answer must be a string or None, got {type(answer).__name__}")
        sandbox_fork.env, sandbox_fork.cwd = dict(BASE_ENV), "/workspace"
        nonce = secrets.token_hex(16)
        env = {"OPENK3_NONCE": nonce, "OPENK3_ANSWER": json.dumps(answer), "OPENK3_KEY": self.grader_key}
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        r = sandbox_fork.run(f"cd /workspace && {assigns} exec /usr/bin/python3 -I /grader/grade.py",
                             timeout=timeout)
        return parse_grade(r, nonce)

    def score(self, sandbox, answer: str | None, timeout: float = GRADE_TIMEOUT) -> float:
        """Fork `sandbox` with the grader bound at /grader, verify there, close the fork. `sandbox` keeps its
        state (a fork snapshots it first; its processes stop, as with any snapshot)."""
        with self.grader_dir() as d:
            (fork,) = sandbox.fork(1, ro_binds={"/grader": d})
            try:
                return self.verify(fork, answer, timeout)
            finally:
                fork.close()


def parse_grade(result, nonce: str) -> float:
    """The reward from a grader run (a RunResult): 0.0 unless it exited 0 and its last stdout line is the
    reply with our nonce and a reward in [0, 1]."""
    if result.error or result.timed_out or result.exit_code != 0:
        return 0.0
    lines = result.stdout.strip().splitlines()
    if not lines:
        return 0.0
    try:
        reply = json.loads(lines[-1])
    except ValueError:
        return 0.0
    if not isinstance(reply, dict) or reply.get("nonce") != nonce:
        return 0.0
    r = reply.get("reward")
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
        return 0.0
    return float(r)


def run_calls(sandbox, calls: list[Call], sql_mode: str = "read_write", timeout: float = 60.0) -> str | None:
    """Replay a scripted solution in `sandbox`: `Shell` through `run`, every other tool through `tool`.
    Returns the last `Submit` answer (None if none). A failing call does not stop the script: the reward says
    whether it worked."""
    answer = None
    for call in calls:
        if call.name == "Shell":
            sandbox.run(call.args["command"], timeout=call.args.get("timeout", timeout))
        else:
            if call.name == "Submit":
                answer = call.args["answer"]
            sandbox.tool(call.name, call.args, timeout=timeout, sql_mode=sql_mode)
    return answer


# ---- the registry ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """A task family. `build(rng, difficulty, template)` returns the Task fields the family decides
    (instruction, files, grader_files, tools, sql_mode, solution, grader_key); it must draw every random choice
    from `rng`. `wrong(task)` is a plausible solution that must score 0 (tests use it)."""

    name: str
    templates: tuple[str, ...]  # train and test
    heldout_templates: tuple[str, ...]  # heldout only
    build: Callable[[random.Random, int, str], dict]
    wrong: Callable[[Task], list[Call]]
    difficulties: tuple[int, ...] = (1, 2, 3)
    description: str = ""


#: Every registered family. The package (`openk3/agent/tasks/__init__.py`) imports each of its family modules,
#: and any import of this module imports the package first, so all of them are here whatever was imported
#: before; a family defined elsewhere joins with `register`.
FAMILIES: dict[str, Family] = {}


def families() -> list[str]:
    """The registered families' names: the package's own and any registered since."""
    return sorted(FAMILIES)


def register(family: Family) -> Family:
    if family.name in FAMILIES:
        raise ValueError(f"task family {family.name!r} is registered twice")
    if set(family.templates) & set(family.heldout_templates) or not family.templates or not family.heldout_templates:
        raise ValueError(f"task family {family.name!r}: needs ordinary and held-out templates, disjoint")
    FAMILIES[family.name] = family
    return family


def generate(family: str, seed: int, difficulty: int = 1, split: str = "train") -> Task:
    """The task of `family` for (seed, difficulty, split); deterministic."""
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; known: {sorted(FAMILIES)}")
    fam = FAMILIES[family]
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"task seed must be an int >= 0, got {seed!r}")
    if difficulty not in fam.difficulties:
        raise ValueError(f"task family {family!r}: difficulty must be one of {list(fam.difficulties)}, "
                         f"got {difficulty!r}")
    if split not in SPLITS:
        raise ValueError(f"task split must be one of {list(SPLITS)}, got {split!r}")
    # Made once per process and handed out as copies: an evaluation draws the same test tasks for every model
    # it scores, and a test-split task takes ~5 builds (the split is a hash of the instance: ~20 % land in test).
    key = (family, seed, difficulty, split)
    hit = _MADE.get(key)
    if hit is not None and hit[0] is fam:  # (a family replaced under the same name is built afresh)
        _MADE.move_to_end(key)
        return copy.deepcopy(hit[1])
    task = _build(fam, seed, difficulty, split)
    _MADE[key] = (fam, task)
    if len(_MADE) > MADE_KEEP:
        _MADE.popitem(last=False)
    return copy.deepcopy(task)


MADE_KEEP = 1024  # tasks `generate` keeps (a few KB each)
_MADE: OrderedDict[tuple, tuple[Family, Task]] = OrderedDict()


def _build(fam: Family, seed: int, difficulty: int, split: str) -> Task:
    family = fam.name
    templates = fam.heldout_templates if split == "heldout" else fam.templates
    for attempt in range(MAX_ATTEMPTS):
        # A string seed goes through sha512 in `random`: the stream does not depend on PYTHONHASHSEED.
        rng = random.Random(f"{family}|{split}|{difficulty}|{seed}|{attempt}")
        template = rng.choice(templates)
        task = Task(family=family, seed=seed, difficulty=difficulty, split=split, template=template,
                    **fam.build(rng, difficulty, template))
        if split == "heldout" or split_of(task) == split:
            return task
    raise AssertionError(f"{family}: no {split} instance in {MAX_ATTEMPTS} attempts (seed {seed})")


def split_of(task: Task) -> str:
    """Which split an instance of an ordinary template belongs to: a function of what the agent sees."""
    return "test" if int(task.content_hash()[:8], 16) % 10 < TEST_BUCKETS else "train"


# ---- helpers for families ---------------------------------------------------------------------------------

# The start of every grade.py (stdlib only: it runs under the sandbox's /usr/bin/python3 -I). It makes the
# grader undumpable before anything else runs, so code it later starts (the agent's) cannot read its
# environment (the nonce, the key) through /proc, then takes the protocol's inputs out of os.environ so no
# child inherits them. `finish(r)` prints the reply line and exits 0.
GRADER_PRELUDE = '''\
import ctypes, json, os, sys
if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0
    sys.exit("grade.py: prctl(PR_SET_DUMPABLE) failed")
NONCE = os.environ.pop("OPENK3_NONCE", "")
ANSWER = json.loads(os.environ.pop("OPENK3_ANSWER", "null"))
KEY = os.environ.pop("OPENK3_KEY", "")
WORKSPACE = "/workspace"


def finish(reward, **detail):
    print(json.dumps({"nonce": NONCE, "reward": max(0.0, min(1.0, float(reward))), **detail}))
    sys.exit(0)


def parse_number(text):
    """A number the agent wrote (int or float text), or None."""
    try:
        value = float(str(text).strip().replace(",", ""))
    except ValueError:
        return None
    return value if value == value and abs(value) != float("inf") else None

'''


def write_tree(root: str, files: dict[str, str | bytes]) -> None:
    """Write `files` (relative paths) under `root`, world-readable (dirs 0o755, files 0o644)."""
    for rel, data in files.items():
        if os.path.isabs(rel) or ".." in rel.split("/"):
            raise ValueError(f"task file path {rel!r} must be relative, without '..'")
        path = os.path.join(root, rel)
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        d = parent
        while len(d) >= len(root):  # makedirs honours the umask: open every level up to root
            os.chmod(d, 0o755)
            d = os.path.dirname(d)
        with open(path, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(path, 0o644)


def scratch_dir() -> tempfile.TemporaryDirectory:
    """A temp folder for building task files, in memory where the host has /dev/shm: SQLite syncs every
    commit, which costs tens of ms a task on a disk."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.TemporaryDirectory(prefix="openk3-task-", dir=shm)


def sqlite_bytes(build: Callable[[sqlite3.Connection], None]) -> bytes:
    """The bytes of a fresh SQLite file (rollback journal, closed cleanly) that `build(conn)` filled."""
    with scratch_dir() as d:
        path = os.path.join(d, "db.sqlite")
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            build(conn)
        finally:
            conn.close()
        with open(path, "rb") as f:
            return f.read()


def _canonical_bytes(data: str | bytes) -> bytes:
    if isinstance(data, str):
        return data.encode()
    if not data.startswith(SQLITE_MAGIC):
        return data
    with scratch_dir() as d:
        path = os.path.join(d, "db.sqlite")
        with open(path, "wb") as f:
            f.write(data)
        conn = sqlite3.connect(path)
        try:
            return "\n".join(conn.iterdump()).encode()
        finally:
            conn.close()


def hmac_digest(key: str, value) -> str:
    """The digest a grader compares a result against: HMAC-SHA256 of its canonical JSON under `key`."""
    import hmac

    return hmac.new(key.encode(), canonical_json(value, strict=True).encode(), hashlib.sha256).hexdigest()
