"""fix_test: fix seeded bugs in a tiny Python repo so its failing unittest passes.

The workspace is one or two modules of small functions plus `tests/test_<module>.py` (unittest), which fails
because some functions carry a seeded bug (an off-by-one, a wrong operator, a missing case). Difficulty 1-3:
1, 2 or 3 bugs in one, one or two modules. Templates are the functions: train/test tasks draw theirs from six
functions, held-out tasks from three others that never appear in train or test.

The grader runs hidden cases (the visible tests' cases plus random ones, each bug hit at least once) against
the workspace's modules. It never reads the workspace's tests/, so editing them cannot change the reward. The
agent's code runs in a child process of the grader (which is undumpable: the child cannot read its nonce),
and the expected results are stored only as HMACs under a key the verifier passes in, so the child can read
/grader/cases.json and still not learn what to return. Reward: 1.0 when every hidden case passes, else 0.0.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass

from openk3.agent.audit import canonical_json

from .base import GRADER_PRELUDE, Call, Family, Task, hmac_digest, register

TOOLS = ["Shell", "ReadFile", "WriteFile", "StrReplaceFile", "Glob", "Grep", "Submit"]
MODULE_NAMES = ("utils", "helpers", "core", "mathx", "textops", "listkit", "calc", "numbers_util", "misc")
EXTRA_CASES = 6  # random hidden cases per function, on top of the visible ones


@dataclass(frozen=True)
class Fn:
    name: str
    source: str
    bugs: tuple[tuple[str, str], ...]  # (correct text, buggy text): each a unique substring of `source`
    inputs: object  # rng -> a list of argument lists (candidates; boundary cases first)


def _ints(rng, n, lo=-20, hi=40):
    return [rng.randint(lo, hi) for _ in range(n)]


def _word(rng):
    return "".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(1, 9)))


FUNCTIONS = {
    "running_total": Fn("running_total", '''\
def running_total(xs):
    """Prefix sums: running_total([1, 2, 3]) == [1, 3, 6]."""
    out = []
    total = 0
    for i in range(len(xs)):
        total += xs[i]
        out.append(total)
    return out
''', (("range(len(xs))", "range(1, len(xs))"), ("total += xs[i]", "total = xs[i]")),
        lambda rng: [[_ints(rng, rng.randint(2, 6))] for _ in range(12)]),
    "count_vowels": Fn("count_vowels", '''\
def count_vowels(text):
    """Vowels (a, e, i, o, u) in text, either case: count_vowels("Banana") == 3."""
    return sum(1 for ch in text.lower() if ch in "aeiou")
''', (("text.lower()", "text"), ('in "aeiou"', 'in "aeio"')),
        lambda rng: [["OA" + _word(rng) + "u"]] + [[_word(rng) + _word(rng)] for _ in range(12)]),
    "is_leap": Fn("is_leap", '''\
def is_leap(year):
    """Gregorian leap year: divisible by 4, except centuries, except every 400 years."""
    if year % 400 == 0:
        return True
    if year % 100 == 0:
        return False
    return year % 4 == 0
''', (("    if year % 400 == 0:\n        return True\n", ""), ("year % 100 == 0", "year % 100 == 1")),
        lambda rng: [[400 * rng.randint(1, 6)], [100 * rng.choice((1, 3, 5, 7, 9, 13))]]
        + [[rng.randint(1, 2500)] for _ in range(12)]),
    "last_n": Fn("last_n", '''\
def last_n(xs, n):
    """The last n items of xs (all of them when n >= len(xs), [] when n <= 0)."""
    if n <= 0:
        return []
    return xs[-n:]
''', (("if n <= 0:", "if n < 0:"), ("xs[-n:]", "xs[-n + 1:]")),
        lambda rng: [[_ints(rng, 4), 0]] + [[_ints(rng, rng.randint(1, 6)), rng.randint(-1, 7)] for _ in range(12)]),
    "median": Fn("median", '''\
def median(xs):
    """Median of a non-empty list (the mean of the two middle values when the length is even)."""
    s = sorted(xs)
    mid = len(s) // 2
    if len(s) % 2 == 1:
        return s[mid]
    return (s[mid - 1] + s[mid]) / 2
''', (("s = sorted(xs)", "s = list(xs)"), ("s[mid - 1] + s[mid]", "s[mid] + s[mid + 1]")),
        lambda rng: [[[5, 1, 4, 2]]] + [[_ints(rng, rng.randint(1, 7))] for _ in range(14)]),
    "letter_grade": Fn("letter_grade", '''\
def letter_grade(score):
    """A for 90 and above, B for 80-89, C for 70-79, D for 60-69, F below 60."""
    if score >= 90:
        return "A"
    if score >= 80:
        return "B"
    if score >= 70:
        return "C"
    if score >= 60:
        return "D"
    return "F"
''', (("score >= 80", "score > 80"), ("score >= 60", "score > 60")),
        lambda rng: [[80], [60]] + [[rng.randint(40, 100)] for _ in range(12)]),
    # held-out templates: never in train or test
    "power": Fn("power", '''\
def power(base, exp):
    """base ** exp for an int exp >= 0, by repeated multiplication."""
    result = 1
    for _ in range(exp):
        result *= base
    return result
''', (("result = 1", "result = base"), ("result *= base", "result += base")),
        lambda rng: [[rng.randint(-5, 9), rng.randint(0, 6)] for _ in range(12)]),
    "safe_div": Fn("safe_div", '''\
def safe_div(a, b):
    """Floor division of a by b, or None when b is 0."""
    if b == 0:
        return None
    return a // b
''', (("a // b", "a % b"), ("if b == 0:", "if b == 0 and a == 0:")),
        lambda rng: [[rng.randint(1, 90), 0]] + [[rng.randint(-50, 90), rng.randint(-6, 9)] for _ in range(12)]),
    "dedupe": Fn("dedupe", '''\
def dedupe(xs):
    """The items of xs without repeats, in order of first appearance."""
    seen = set()
    out = []
    for x in xs:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out
''', (("            seen.add(x)\n", ""), ("out.append(x)", "out.insert(0, x)")),
        lambda rng: [[[3, 1, 3, 2]]] + [[_ints(rng, rng.randint(3, 8), 0, 5)] for _ in range(12)]),
}
TEMPLATES = ("running_total", "count_vowels", "is_leap", "last_n", "median", "letter_grade")
HELDOUT = ("power", "safe_div", "dedupe")

GRADE = GRADER_PRELUDE + '''\
import hashlib, hmac, subprocess

with open("/grader/cases.json") as f:
    cases = json.load(f)
# The agent's code runs only in this child, which gets no nonce, no key, no pipe to the verifier. Its bytecode
# cache lives outside the workspace: a .pyc the agent left (stale or forged) must not stand in for the source.
try:
    child = subprocess.run(
        ["/usr/bin/python3", "-I", "-X", "pycache_prefix=/tmp/openk3-grader-pyc", "/grader/runner.py"],
        cwd=WORKSPACE, env={"PATH": "/usr/bin:/bin"},
        input=json.dumps([[c["module"], c["func"], c["args"]] for c in cases]), capture_output=True,
        text=True, timeout=30, close_fds=True, start_new_session=True)
    results = json.loads(child.stdout.strip().splitlines()[-1])
except Exception as e:
    finish(0.0, error=type(e).__name__)
if not isinstance(results, list) or len(results) != len(cases):
    finish(0.0, error="malformed runner output")
passed = 0
for case, got in zip(cases, results):
    if isinstance(got, str):
        digest = hmac.new(KEY.encode(), got.encode(), hashlib.sha256).hexdigest()
        passed += hmac.compare_digest(digest, case["digest"])
finish(1.0 if passed == len(cases) else 0.0, passed=passed, cases=len(cases))
'''

RUNNER = '''\
"""Calls the workspace's functions on the hidden cases' arguments (stdin); prints their canonical JSON."""
import importlib, json, sys

sys.path.insert(0, "/workspace")
out = []
for module, func, args in json.loads(sys.stdin.read()):
    try:
        value = getattr(importlib.import_module(module), func)(*args)
        out.append(json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True))
    except BaseException:  # a case that raises (or exits) fails; the others still count
        out.append(None)
print(json.dumps(out))
'''


def run_function(source: str, name: str, args: list):
    """Run one template function on `args` (host side; our own template code). An exception is a result too."""
    ns: dict = {}
    exec(source, ns)  # noqa: S102 - the family's own templates, never the agent's code
    try:
        return ("ok", json.loads(canonical_json(ns[name](*json.loads(json.dumps(args))), strict=True)))
    except Exception as e:
        return ("raises", type(e).__name__)


def render_test_file(module: str, fns: list[str], cases: dict[str, list]) -> str:
    lines = ["import unittest", "", f"from {module} import {', '.join(fns)}", "", "",
             f"class Test{module.title().replace('_', '')}(unittest.TestCase):"]
    for fn in fns:
        lines.append(f"    def test_{fn}(self):")
        for args, expected in cases[fn]:
            call = f"{fn}({', '.join(repr(a) for a in args)})"
            lines.append(f"        self.assertEqual({call}, {expected!r})")
        lines.append("")
    lines += ["", 'if __name__ == "__main__":', "    unittest.main()", ""]
    return "\n".join(lines)


def build(rng: random.Random, difficulty: int, template: str) -> dict:
    pool = HELDOUT if template in HELDOUT else TEMPLATES
    n_bugs = difficulty
    others = [f for f in pool if f != template]
    rng.shuffle(others)
    buggy = [template] + others[: n_bugs - 1]
    fns = buggy + others[n_bugs - 1: n_bugs]  # one correct function beside them, when the pool has one left
    rng.shuffle(fns)
    n_modules = 2 if difficulty == 3 else 1
    modules = rng.sample(MODULE_NAMES, n_modules)
    where = {fn: modules[i % n_modules] for i, fn in enumerate(fns)}
    key = f"{rng.getrandbits(128):032x}"

    files: dict[str, str] = {}
    visible: dict[str, list] = {}
    hidden: list[dict] = []
    fixes: list[Call] = []
    for fn in fns:
        spec = FUNCTIONS[fn]
        correct, bad = rng.choice(spec.bugs) if fn in buggy else (None, None)
        source = spec.source if correct is None else spec.source.replace(correct, bad, 1)
        if correct is not None:
            assert spec.source.count(correct) == 1, (fn, correct)
            edit = {"old": source, "new": spec.source}  # the whole function: `bad` may be empty or repeated
            fixes.append(Call("StrReplaceFile", {"path": f"{where[fn]}.py", "edit": edit}))
        files.setdefault(f"{where[fn]}.py", "")
        files[f"{where[fn]}.py"] += ("\n\n" if files[f"{where[fn]}.py"] else "") + source
        cands = spec.inputs(rng)
        good = [(args, run_function(spec.source, fn, args)) for args in cands]
        good = [(a, r[1]) for a, r in good if r[0] == "ok"]
        hits = [(a, v) for a, v in good if correct is not None and run_function(source, fn, a) != ("ok", v)]
        assert correct is None or hits, f"{fn}: no candidate input shows the bug {bad!r}"
        shown = (hits[:1] + [c for c in good if c not in hits[:1]])[:3]
        visible[fn] = shown
        extra = [c for c in good if c not in shown]
        rng.shuffle(extra)
        extra = extra[:EXTRA_CASES] + [h for h in hits[1:2] if h not in extra[:EXTRA_CASES]]
        for args, value in shown + extra:
            hidden.append({"module": where[fn], "func": fn, "args": args, "digest": hmac_digest(key, value)})

    for module in modules:
        in_mod = [fn for fn in fns if where[fn] == module]
        files[f"tests/test_{module}.py"] = render_test_file(module, in_mod, visible)
    files["tests/__init__.py"] = ""
    n_files = " and ".join(f"{m}.py" for m in modules)
    instruction = (f"The unit tests in tests/ fail: `python3 -m unittest discover -s tests -t .` run in the "
                   f"workspace reports failures. Find and fix the bug{'s' if n_bugs > 1 else ''} in {n_files} "
                   f"(not in the tests: each function's docstring says what it must do; hidden tests check more "
                   f"cases). When the tests pass, call Submit with a one-line summary of the fix.")
    solution = fixes + [Call("Shell", {"command": "python3 -m unittest discover -s tests -t . 2>&1 | tail -n 3"}),
                        Call("Submit", {"answer": "fixed"})]
    return {
        "instruction": instruction,
        "files": files,
        "grader_files": {"grade.py": GRADE, "runner.py": RUNNER, "cases.json": json.dumps(hidden, indent=1) + "\n"},
        "tools": list(TOOLS),
        "solution": solution,
        "grader_key": key,
        # Bytecode caches are keyed on the source's mtime (whole seconds) and size: an edit that keeps the
        # size within the second a test run cached the module would run the stale code.
        "env": {"PYTHONDONTWRITEBYTECODE": "1"},
        # The tests are the spec: the file tools may not rewrite them (a Shell `sed` still can, and the grader,
        # which never reads them, does not care).
        "protected": ("/workspace/tests",),
    }


def wrong(task: Task) -> list[Call]:
    """Make the visible tests pass by rewriting them (every assertion becomes a no-op): scores 0."""
    cmd = ("for f in tests/test_*.py; do sed -i 's/self.assertEqual(/self.assertTrue(True or /' \"$f\"; done; "
           "python3 -m unittest discover -s tests -t . 2>&1 | tail -n 1")
    return [Call("Shell", {"command": cmd}), Call("Submit", {"answer": "fixed"})]


FAMILY = register(Family(name="fix_test", templates=TEMPLATES, heldout_templates=HELDOUT, build=build, wrong=wrong,
                         description="fix seeded bugs in a tiny Python repo so its failing unittest passes"))
