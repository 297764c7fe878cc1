"""Task families the post-training domains add to `openk3.agent.tasks` (registered on import).

`multi_hop` (agent domain, background §3.2 A3): multi-hop retrieval across notes files to a key-value store
entry, with decoy owners at every hop. `implement_spec` (coding domain, C1): implement a list function from
a one-sentence spec rendered from the same small AST as the reference code, graded on hidden cases.
Both follow the families of openk3/agent/tasks/ (`Family`, `build(rng, difficulty, template)`, the grader
protocol of tasks/base.py); their experts are in agentic_traces.py.
"""

from __future__ import annotations

import json
import random

from openk3.agent.tasks import Call, Family, Task, register
from openk3.agent.tasks.base import GRADER_PRELUDE
from openk3.agent.tasks.tool_arith import KV_PATH, _kv_file

# ---- multi_hop (A3): multi-hop retrieval, a task family registered with openk3.agent.tasks ----------------
#
# The workspace holds notes/*.md files and a key-value store. The instruction names a start file and an owner
# ("project apollo"); each file on the owner's chain says which file to read next for that owner, beside lines
# for other owners that lead to decoy files and decoy keys; the last file names the KV key holding the answer.
# Difficulty 1-3: 1-3 files, then the key (2-4 hops). Reward 1.0 iff the submitted number is the owner's.

HOP_TEMPLATES = {"supplier": ("supplier code", "project"), "door": ("door code", "team"),
                 "incident": ("incident number", "service")}  # the last one is held out
HOP_OWNERS = ("apollo", "borealis", "cobalt", "delta", "ember", "fjord", "granite", "helix", "iris", "juniper",
              "krypton", "lumen")
HOP_WORDS = ("memo", "brief", "plan", "log", "digest", "minutes", "ledger", "summary", "draft", "record", "index",
             "report", "handover", "review")
HOP_FILLER = ("Nothing else here changed since the last review.", "Kept for reference; ask the owners for edits.",
              "Figures are checked monthly.", "Older entries were archived.")
HOP_GRADE = GRADER_PRELUDE + '''\
with open("/grader/expected.json") as f:
    expected = json.load(f)["answer"]
finish(1.0 if ANSWER is not None and parse_number(ANSWER) == expected else 0.0)
'''


def _hop_build(rng: random.Random, difficulty: int, template: str) -> dict:
    what, kind = HOP_TEMPLATES[template]
    owner, *rivals = (f"{kind} {o}" for o in rng.sample(HOP_OWNERS, 3))
    names = [f"notes/{w}_{rng.randint(10, 99)}.md" for w in rng.sample(HOP_WORDS, 2 * difficulty + 1)]
    chain, decoys = names[:difficulty], names[difficulty:]
    key, *decoy_keys = (f"{what.split()[0]}/{n}" for n in rng.sample(range(100, 1000), 3))  # no tell in the name
    codes = rng.sample(range(1000, 9999), 3)

    def note(title: str, lines: list[str]) -> str:
        rng.shuffle(lines)  # the owner's line is not always first
        return f"# {title}\n\n{rng.choice(HOP_FILLER)}\n" + "".join(f"- {line}\n" for line in lines)

    files: dict[str, str | bytes] = {}
    for i, path in enumerate(chain):
        if i + 1 < len(chain):
            lines = [f"For {owner}: see {chain[i + 1]}."]
        else:
            lines = [f"For {owner}: the {what} is stored under the key `{key}`."]
        # each rival's line leads to a decoy file at every hop but the last, where it names a decoy key
        lines += [f"For {r}: see {decoys[i * 2 + j]}." if i + 1 < len(chain)
                  else f"For {r}: the {what} is stored under the key `{decoy_keys[j]}`." for j, r in enumerate(rivals)]
        files[path] = note(path.split("/")[1][:-3].replace("_", " ").title(), lines)
    for j, path in enumerate(decoys[:2 * (difficulty - 1)]):  # the files the rivals' lines point to
        files[path] = note("Archive", [f"For {rivals[j % 2]}: the {what} is stored under the key "
                                       f"`{decoy_keys[j % 2]}`."])
    files[KV_PATH] = _kv_file({key: codes[0], decoy_keys[0]: codes[1], decoy_keys[1]: codes[2]})
    instruction = (f"Find the {what} of {owner}. Start at {chain[0]} and follow the references for {owner}; the last "
                   f"one names a key of the key-value store that holds the {what}. Submit the {what} (a number).")
    solution = [Call("ReadFile", {"path": p}) for p in chain] + [Call("KVGet", {"key": key}),
                                                                 Call("Submit", {"answer": str(codes[0])})]
    return {"instruction": instruction, "files": files,
            "grader_files": {"grade.py": HOP_GRADE, "expected.json": json.dumps({"answer": codes[0]}) + "\n"},
            "tools": ["ReadFile", "Glob", "Grep", "KVGet", "KVList", "Submit"], "solution": solution}


def _hop_wrong(task: Task) -> list[Call]:
    """A number one off the owner's code: scores 0."""
    return [Call("Submit", {"answer": str(json.loads(task.grader_files["expected.json"])["answer"] + 1)})]


MULTI_HOP = register(Family(name="multi_hop", templates=("supplier", "door"), heldout_templates=("incident",),
                            build=_hop_build, wrong=_hop_wrong,
                            description="follow references across notes files to a key-value store entry"))


# ---- implement_spec (C1): implement a list function from its spec -------------------------------------------
#
# A module holds one stub `def NAME(xs): """SPEC"""; raise NotImplementedError` and tests/test_MODULE.py shows
# a few cases. SPEC is rendered from a pipeline AST (1-3 filter/map stages, then a final step: the template),
# and the reference body from the same AST, so the spec and the reference cannot disagree. The grader is
# fix_test's: hidden cases (the visible ones + random lists), expected results only as HMACs.

STAGES = (  # (spec phrase, the comprehension that does it on `out`); {k} is drawn per task
    ("keep only the even numbers", "[x for x in out if x % 2 == 0]"),
    ("keep only the odd numbers", "[x for x in out if x % 2 != 0]"),
    ("keep only the numbers greater than {k}", "[x for x in out if x > {k}]"),
    ("drop the negative numbers", "[x for x in out if x >= 0]"),
    ("multiply each number by {k}", "[x * {k} for x in out]"),
    ("add {k} to each number", "[x + {k} for x in out]"),
    ("square each number", "[x * x for x in out]"),
    ("replace each number by its absolute value", "[abs(x) for x in out]"),
)
FINALS = {  # template -> (function name, spec phrase, return expression); {w} is drawn per task
    "sorted": ("sorted_values", "return the numbers sorted in ascending order", "sorted(out)"),
    "total": ("total", "return their sum (0 for no numbers)", "sum(out)"),
    "dedupe": ("unique_values", "return them without repeats, each kept where it first appears",
               "list(dict.fromkeys(out))"),
    "window": ("window_sums", "return the sums of every run of {w} consecutive numbers, in order",
               "[sum(out[i:i + {w}]) for i in range(len(out) - {w} + 1)]"),
    "largest": ("largest", "return the largest of them, or None when none is left",  # held out
                "max(out) if out else None"),
    "count": ("count_distinct", "return how many distinct numbers there are", "len(set(out))"),  # held out
}


def _spec_source(rng: random.Random, difficulty: int, template: str) -> tuple[str, str, str, str]:
    """(function name, spec sentence, reference source, the source without its final step: the recovery
    episodes' first attempt)."""
    name, final_phrase, final_code = FINALS[template]
    w = rng.randint(2, 3)
    stages = []
    for phrase, code in rng.sample(STAGES, difficulty):
        k = rng.randint(2, 5)
        stages.append((phrase.format(k=k), code.format(k=k)))
    spec = ("Given a list of integers xs, " + ", then ".join(p for p, _ in stages)
            + f", and finally {final_phrase.format(w=w)}.")
    doc = "\n    ".join(_wrap(spec, 100))
    body = "    out = list(xs)\n" + "".join(f"    out = {code}\n" for _, code in stages)
    head = f'def {name}(xs):\n    """{doc}"""\n'
    return name, spec, head + body + f"    return {final_code.format(w=w)}\n", head + body + "    return out\n"


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [line]


def _spec_build(rng: random.Random, difficulty: int, template: str) -> dict:
    from openk3.agent.tasks import fix_test
    from openk3.agent.tasks.base import hmac_digest

    # Some pipelines' final step changes nothing on any drawn input (e.g. a sort after a sort): such a draw
    # could not show a missing step, so the generator draws again (from the same rng: still deterministic).
    for _ in range(50):
        name, spec, source, partial = _spec_source(rng, difficulty, template)
        module = rng.choice(fix_test.MODULE_NAMES)
        key = f"{rng.getrandbits(128):032x}"
        inputs = [[[]]] + [[[rng.randint(-9, 20) for _ in range(rng.randint(4, 10))]] for _ in range(15)]
        cases = [(args, fix_test._call(source, name, args)[1]) for args in inputs]
        # The visible cases: the three with the most telling results (long lists, not []), and at least one
        # that a body without the final step fails (what a recovery episode trips on). Hidden: all sixteen.
        hits = [c for c in cases if fix_test._call(partial, name, c[0]) != ("ok", c[1])]
        if hits:
            break
    else:
        raise ValueError(f"implement_spec: no draw in 50 tells the final step apart (difficulty {difficulty}, "
                         f"template {template!r})")
    telling = sorted(cases, key=lambda c: -len(json.dumps(c[1])))
    shown = [max(hits, key=lambda c: len(json.dumps(c[1])))]
    shown += [c for c in telling if c is not shown[0]][:2]
    stub = source[:source.index("    out = list(xs)")] + "    raise NotImplementedError\n"
    files = {f"{module}.py": stub, f"tests/test_{module}.py": fix_test._test_file(module, [name], {name: shown}),
             "tests/__init__.py": ""}
    hidden = [{"module": module, "func": name, "args": a, "digest": hmac_digest(key, v)} for a, v in cases]
    instruction = (f"Implement `{name}` in {module}.py: its docstring is the spec. The unit tests in tests/ "
                   f"(`python3 -m unittest discover -s tests -t .`) show a few cases; hidden tests check more. "
                   f"When the tests pass, call Submit with a one-line summary.")
    edit = {"old": "    raise NotImplementedError\n", "new": source[source.index("    out = list(xs)"):]}
    solution = [Call("StrReplaceFile", {"path": f"{module}.py", "edit": edit}),
                Call("Shell", {"command": "python3 -m unittest discover -s tests -t . 2>&1 | tail -n 3"}),
                Call("Submit", {"answer": f"Implemented {name}."})]
    return {"instruction": instruction, "files": files, "tools": list(fix_test.TOOLS), "solution": solution,
            "grader_files": {"grade.py": fix_test.GRADE, "runner.py": fix_test.RUNNER,
                             "cases.json": json.dumps(hidden, indent=1) + "\n"},
            "grader_key": key, "env": {"PYTHONDONTWRITEBYTECODE": "1"}, "protected": ("/workspace/tests",)}


def _spec_wrong(task: Task) -> list[Call]:
    """The body without its final step (the pipeline's list is returned as it is): scores 0."""
    edit = task.solution[0].args["edit"]
    body = edit["new"][:edit["new"].rindex("    return ")] + "    return out\n"
    return [Call("StrReplaceFile", {"path": task.solution[0].args["path"], "edit": {**edit, "new": body}}),
            Call("Submit", {"answer": "done"})]


IMPLEMENT_SPEC = register(Family(name="implement_spec", templates=("sorted", "total", "dedupe", "window"),
                                 heldout_templates=("largest", "count"), build=_spec_build, wrong=_spec_wrong,
                                 description="implement a list function from a one-sentence spec"))
