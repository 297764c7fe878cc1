"""`implement_spec` (coding domain, C1): implement a list function from a one-sentence spec rendered from the
same small AST as the reference code, graded on hidden cases. A family of `openk3.agent.tasks` (`Family`,
`build(rng, difficulty, template)`, the grader protocol of base.py); its scripted expert is in posttrain's
agentic traces.
"""

from __future__ import annotations

import json
import random

from openk3.agent.tasks.base import Call, Family, Task, register

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
        cases = [(args, fix_test.run_function(source, name, args)[1]) for args in inputs]
        # The visible cases: the three with the most telling results (long lists, not []), and at least one
        # that a body without the final step fails (what a recovery episode trips on). Hidden: all sixteen.
        hits = [c for c in cases if fix_test.run_function(partial, name, c[0]) != ("ok", c[1])]
        if hits:
            break
    else:
        raise ValueError(f"implement_spec: no draw in 50 tells the final step apart (difficulty {difficulty}, "
                         f"template {template!r})")
    telling = sorted(cases, key=lambda c: -len(json.dumps(c[1])))
    shown = [max(hits, key=lambda c: len(json.dumps(c[1])))]
    shown += [c for c in telling if c is not shown[0]][:2]
    stub = source[:source.index("    out = list(xs)")] + "    raise NotImplementedError\n"
    files = {f"{module}.py": stub, f"tests/test_{module}.py": fix_test.render_test_file(module, [name], {name: shown}),
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
