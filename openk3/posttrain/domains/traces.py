"""Scripted experts for the `agent` and `coding` domains: one per task family, at three verbosities.

An expert is a generator over assistant turns. It yields a turn ({reasoning_content, content, tool_calls})
and is sent back the tool messages the real sandbox produced for that turn's calls (agentic.py drives it
through `SandboxEnv`), so every tool result in a trajectory is genuine and the values the think text quotes
come from those results. The calls follow the task's reference solution (`Task.solution`); what the
expert adds is the reading and checking around it and the think text:

    max  = full reasoning + a verification action (read the stored key back, re-read the written file or
           table, re-read the fixed module and re-run the tests)
    high = the same steps, said briefly, no verification; its first turn lists them in one sentence opening
           with "Steps:" (3-10x low's first line)
    low  = terse: the action, one line of thought

The three first turns open differently (low: the bare action, "Read the code."; high: "Steps: ..."; max: the
task restated, "The tests fail ..."). A small model tells the efforts apart by its first think token: in the
smoke profile, efforts whose first turns opened alike (low and high both "Read the ...", or later high and max
both "The docstring ...") came out with the same thinking, the others separated (docs/posttraining.md).

A recovery episode makes one scripted mistake first (a misspelt key or prefix, a script pointed at the wrong
folder, an edit of a file that does not exist), sees the error in the tool message and fixes it.
Paraphrases are drawn from `rng`, so a trace is a function of (task, effort, recovery, rng seed).
"""

from __future__ import annotations

import ast
import difflib
import json
import random
import re
from collections.abc import Generator

from openk3.agent.tasks import Call, Task

Expert = Generator[dict, list[str], None]

# The test command the coding expert runs. unittest prints "Ran N tests in 0.001s": the time is cut so that
# a replay in a fresh sandbox sees the same observation (multi-stage verification compares them).
TEST_CMD = "python3 -m unittest discover -s tests -t . 2>&1 | sed -E 's/ in [0-9.]+s$//'"
KV_LINE = re.compile(r"^(?P<key>.*) = (?P<value>.*) \(version (?P<version>\d+)\)$")
LIST_LINE = re.compile(r"^(?P<key>\S.*) \(version \d+\)$")
OPS = {ast.Add: ("+", lambda a, b: a + b), ast.Sub: ("-", lambda a, b: a - b), ast.Mult: ("*", lambda a, b: a * b)}


def turn(think: str, *calls: Call, content: str = "") -> dict:
    """An assistant turn; call ids are given by the env (`call_<k>` over the conversation)."""
    msg = {"role": "assistant", "reasoning_content": think, "content": content}
    if calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": json.dumps(c.args)}}
                             for c in calls]
    return msg


class Say:
    """Think text for one trace: `say(low=..., high=..., max=...)` picks this effort's paraphrase list and
    draws one (a str is a list of one); `None` or a missing effort says nothing."""

    def __init__(self, effort: str, rng: random.Random) -> None:
        self.effort, self.rng = effort, rng

    def __call__(self, **by_effort) -> str:
        options = by_effort.get(self.effort)
        if not options:
            return ""
        return self.rng.choice([options] if isinstance(options, str) else options)

    @property
    def max(self) -> bool:
        return self.effort == "max"


def _typo(call: Call) -> tuple[Call, str]:
    """The recovery episodes' misspelling of a KV read: a key or prefix that does not exist."""
    arg = "key" if call.name == "KVGet" else "prefix"
    good = call.args[arg]
    bad = good.replace("/", "s/", 1) if "/" in good else good.replace("_", "", 1) if "_" in good else good.title()
    assert bad != good, good
    return Call(call.name, {**call.args, arg: bad}), bad


def _kv_value(output: str):
    m = KV_LINE.match(output.strip())
    return None if m is None or m["value"] == "(not found)" else json.loads(m["value"])


def _listed(output: str) -> list[str]:
    return [m["key"] for m in map(LIST_LINE.match, output.strip().splitlines()) if m]


def _evaluate(formula: str, values: dict) -> tuple[int, list[str]]:
    """The formula's value over `values`, with each binary step written out (innermost first)."""
    steps: list[str] = []

    def ev(node):
        if isinstance(node, ast.Name):
            return values[node.id]
        sym, fn = OPS[type(node.op)]
        a, b = ev(node.left), ev(node.right)
        steps.append(f"{a} {sym} {b} = {fn(a, b)}")
        return fn(a, b)

    return ev(ast.parse(formula, mode="eval").body), steps


# ---- tool_arith -------------------------------------------------------------------------------------------


def tool_arith(task: Task, effort: str, recovery: bool, rng: random.Random) -> Expert:
    say = Say(effort, rng)
    tpl = task.template
    values: dict[str, object] = {}  # key -> the JSON value the store returned

    def read(calls: list[Call], think: str):
        """One turn of reads (the first one misspelt in a recovery episode, then retried); records values."""
        nonlocal recovery
        sent = list(calls)
        if recovery:
            sent[0], bad = _typo(calls[0])
        outs = yield turn(think, *sent)
        if recovery:
            recovery = False
            what = "key" if calls[0].name == "KVGet" else "prefix"
            note = say(low=f"Typo: {bad}.",
                       high=[f"'{bad}' is not in the store: I misspelt the {what}. Retrying as in the task.",
                             f"Nothing under '{bad}', a typo on my side; the {what} is the one the task names."],
                       max=[f"The read of '{bad}' came back empty: I misspelt the {what}. The task spells it "
                            f"differently, so I repeat that call with the exact spelling before going on.",
                            f"'{bad}' does not exist in the store, which is my mistake, not the data's: the "
                            f"{what} in the task is spelt another way. Let me redo that one read exactly."])
            outs = [(yield turn(note, calls[0]))[0]] + outs[1:]
        for call, out in zip(calls, outs):
            if call.name == "KVGet":
                values[call.args["key"]] = _kv_value(out)
        return outs

    # What the expert can know before reading: the keys the formula names, or only where to start.
    n = len([c for c in task.solution if c.name == "KVGet"])
    reads = {"expression": (f"{n} keys", f"read the {n} keys the formula names (in one turn: none depends on "
                                         f"another)"),
             "chain": ("from 'start'", "follow the chain from 'start' one record at a time, since each record "
                                       "names the next key")}.get(tpl, ("the prefix", "list the keys under the "
                                                                "prefix, then read every record it lists"))
    plan = say(low=["Read the keys.", f"Read {reads[0]}."],
               high=[f"Steps: read {reads[0]} from the store, do the arithmetic, store it under 'result', submit.",
                     f"Steps: the values are in the store, so read {reads[0]}, compute, save the number as "
                     f"'result', then submit."],
               max=[f"None of the values is in the prompt; they are in the key-value store. Plan: {reads[1]}, "
                    f"compute step by step and write every intermediate down, store the result under 'result', "
                    f"read it back to check it landed as a number, then submit.",
                    f"The inputs live in the key-value store. I will {reads[1]}, work the arithmetic out one "
                    f"operation at a time, save the number under 'result', verify the stored value by reading it "
                    f"back, and only then submit."])
    lines: list[str] = []  # the max trace's worked steps
    if tpl == "expression":
        keys = [c.args["key"] for c in task.solution if c.name == "KVGet"]
        yield from read([Call("KVGet", {"key": k}) for k in keys], plan)
        formula = re.search(r"Compute (.+?), where", task.instruction)[1]
        result, steps = _evaluate(formula, values)
        subst = re.sub(r"[A-Za-z_]\w*", lambda m: str(values[m[0]]), formula)
        given = ", ".join(f"{k} = {values[k]}" for k in keys)
        lines = [f"Values: {given}.", f"Substituting into {formula}: {subst}."]
        lines += [f"Step {i}: {s}." for i, s in enumerate(steps, 1)]
        check = f"Check: evaluating {subst} again in one pass gives {result}, the same."
        brief = f"{given}. {'; '.join(steps)}."
        terse = f"{subst} = {result}."
    elif tpl == "chain":
        key, visited = "start", []
        think = plan
        while key is not None:
            yield from read([Call("KVGet", {"key": key})], think)
            record = values[key]
            visited.append((key, record["value"]))
            key = record["next"]
            think = say(low=f"Next {key}." if key else "", high=f"{visited[-1][0]} = {visited[-1][1]}, next {key}.",
                        max=f"'{visited[-1][0]}' has value {visited[-1][1]} and points to {key!r}; running total "
                            f"{sum(v for _, v in visited)}. Follow it.") if key else ""
        result = sum(v for _, v in visited)
        lines = ["The last record's next is null, so the chain ends here.",
                 "Visited: " + ", ".join(f"{k} ({v})" for k, v in visited) + "."]
        lines += [f"Sum: {' + '.join(str(v) for _, v in visited)} = {result}."]
        check = f"Check: adding them from the end, {' + '.join(str(v) for _, v in visited[::-1])} = {result}."
        brief = f"Sum of {len(visited)} values = {result}."
        terse = f"= {result}."
    else:  # ledger, inventory: list the prefix, then read every listed key
        prefix = task.solution[0].args["prefix"]
        outs = yield from read([Call("KVList", {"prefix": prefix})], plan)
        keys = _listed(outs[0])
        think = say(low="Read them.", high=f"{len(keys)} keys under {prefix}; read them all.",
                    max=f"{len(keys)} keys under '{prefix}'. Each is a record I need in full, so I read all of "
                        f"them in one turn; the order does not matter.")
        yield from read([Call("KVGet", {"key": k}) for k in keys], think)
        if tpl == "ledger":
            kept = [(k, values[k]["amount"]) for k in keys if not values[k]["void"]]
            lines = [f"{k.rsplit('/', 1)[-1]}: {values[k]['amount']}" + (" (void, skipped)" if values[k]["void"]
                                                                         else "") + "." for k in keys]
        else:
            kept = [(k, values[k]["qty"] * values[k]["price"]) for k in keys if not values[k]["discontinued"]]
            lines = [f"{k}: " + ("discontinued, skipped" if values[k]["discontinued"] else
                                 f"{values[k]['qty']} * {values[k]['price']} = {values[k]['qty'] * values[k]['price']}")
                     + "." for k in keys]
        result = sum(v for _, v in kept)
        lines.append(f"Total of the {len(kept)} counted: {' + '.join(str(v) for _, v in kept)} = {result}.")
        check = f"Check: summing in reverse, {' + '.join(str(v) for _, v in kept[::-1])} = {result} again."
        brief = f"Counted {', '.join(str(v) for _, v in kept)}: sum {result}."
        terse = f"Sum = {result}."

    store = Call("KVSet", {"key": "result", "value": result})
    submit = Call("Submit", {"answer": str(result)})
    if effort == "low":
        yield turn(terse, store, submit)
        return
    if effort == "high":
        yield turn(f"{brief} Store it.", store)
        yield turn(say(high=["Stored; submit.", f"Saved {result}. Submitting."]), submit)
        return
    yield turn(" ".join(lines) + " " + check + f" Store {result} under 'result'.", store)
    yield turn(say(max=["Stored. Before submitting, read 'result' back to make sure it holds the number itself "
                        "and not a string or a stale value.",
                        "The write succeeded; reading the key back is cheap and confirms the value and type."]),
               Call("KVGet", {"key": "result"}))
    yield turn(f"The store holds {result} as a JSON number under 'result', matching my computation. Submitting "
               f"{result}.", submit)


# ---- multi_hop (A3, registered in agentic.py) -----------------------------------------------------------


def multi_hop(task: Task, effort: str, recovery: bool, rng: random.Random) -> Expert:
    say = Say(effort, rng)
    owner = re.search(r"follow the references for (.+?);", task.instruction)[1]
    path = re.search(r"Start at (\S+) and follow", task.instruction)[1]
    think = say(low="Start file.", high=f"Steps: follow {owner}'s references from {path} hop by hop, skip the "
                                        f"other owners' lines, then read the key and submit.",
                max=[f"The answer sits at the end of a chain of references for {owner}, starting at {path}. The files "
                     f"also hold lines for other owners, which lead to other keys: at every hop I take only the line "
                     f"for {owner}. Then read the key, check that nothing else points to it, and submit.",
                     f"I follow {owner}'s references file by file from {path}; lines for anyone else are decoys. "
                     f"The last file names a key; I read it, confirm which file names it, and submit the number."])
    hops, key = [], None
    while key is None:
        call = Call("ReadFile", {"path": path})
        if recovery:  # the first read drops a letter of the folder name
            recovery, bad = False, path.replace("notes/", "note/", 1)
            out = (yield turn(think, Call("ReadFile", {"path": bad})))[0]
            think = say(low="Folder is notes/.", high=f"No {bad}: the folder is notes/. Retry.",
                        max=f"{bad} does not exist: I misspelt the folder, which the task calls notes/. Read the "
                            f"file at its real path.")
        out = (yield turn(think, call))[0]
        hops.append(path)
        nxt = re.search(rf"For {re.escape(owner)}: see (\S+\.md)\.", out)
        if nxt:
            path = nxt[1]
            think = say(low=f"Next {path}.", high=f"{hops[-1]} sends {owner} to {path}.",
                        max=f"{hops[-1]} has one line for {owner}: see {path}. The other lines are for other owners "
                            f"and lead elsewhere. Hop {len(hops) + 1}: read {path}.")
        else:
            key = re.search(rf"For {re.escape(owner)}: the .+? is stored under the key `([^`]+)`", out)[1]
    outs = yield turn(say(low=f"Key {key}.", high=f"{hops[-1]} names the key {key}; read it.",
                          max=f"{hops[-1]} ends the chain: for {owner} the value is under the key `{key}`. The "
                              f"chain was {' -> '.join(hops)} -> {key}. Read the key."), Call("KVGet", {"key": key}))
    code = _kv_value(outs[0])
    if say.max:
        outs = yield turn(f"The store holds {code} under {key}. Check that only {hops[-1]} names this key, so I did "
                          f"not take a decoy's line.", Call("Grep", {"pattern": re.escape(key), "path": "notes"}))
        yield turn(f"Only {hops[-1]}, the last file of {owner}'s chain, names `{key}`. The answer is {code}.",
                   Call("Submit", {"answer": str(code)}))
        return
    yield turn(say(low=f"{code}.", high=f"{key} = {code}. Submit."), Call("Submit", {"answer": str(code)}))


# ---- data_wrangle -----------------------------------------------------------------------------------------


def data_wrangle(task: Task, effort: str, recovery: bool, rng: random.Random) -> Expert:
    say = Say(effort, rng)
    spec = json.loads(task.grader_files["spec.json"])  # what the instruction says, as data
    group, column, d = spec["group"], spec["columns"][1], spec["difficulty"]
    write, run = task.solution[0], task.solution[1]
    target = f"`{spec['path']}`" if spec["output"] == "file" else f"table `{spec['table']}`"
    joins = ("" if d == 1 else " The group needs a join: the customer's region from customers.json."
             if group == "region" else " The group needs a join: the product's category from the products table.")
    returns = " Returned orders (the returns table) must be left out." if d == 3 else ""
    if effort != "low":
        looks = [Call("Shell", {"command": "head -n 4 data/orders.csv"})]
        if d > 1:
            looks.append(Call("ReadFile", {"path": "data/customers.json", "n_lines": 6}) if group == "region" else
                         Call("SQL", {"query": "SELECT name, category FROM products LIMIT 4"}))
        if d == 3:
            looks.append(Call("SQL", {"query": "SELECT COUNT(*) FROM returns"}))
        outs = yield turn(say(high=f"Steps: {column} per {group} into {target}.{' It needs a join.' if d > 1 else ''} "
                                   f"Look at the inputs, then write one script, run it and submit.",
                              max=f"The task: {column} per {group}, written to {target}.{joins}{returns} Plan: look "
                                  f"at the inputs' shape, write one small stdlib script (csv, json, sqlite3) that "
                                  f"does the whole aggregation, run it, check its output, then submit."), *looks)
        header = outs[0].splitlines()[0]
        joined = " The join source has the fields the task names." if d > 1 else ""
        seen = say(high=f"Columns: {header}. Writing the script.",
                   max=f"orders.csv has the columns {header}; the rows look clean (integer qty, decimal prices)."
                       f"{joined} I'll put the logic in "
                       f"solve.py: read the orders, map each to its {group}, "
                       f"{'skip returned ones, ' if d == 3 else ''}aggregate, round to 2 decimals, write.")
    else:
        seen = say(low=["Script it.", f"Aggregate {column} by {group} with a script."])
    script = write.args["content"]
    if recovery:  # the script reads a folder that does not exist; the traceback says so
        script = script.replace("aggregate('data', ", "aggregate('input', ", 1)
        assert script != write.args["content"], "the data_wrangle script no longer calls aggregate('data', ...)"
    outs = yield turn(seen, Call("WriteFile", {**write.args, "content": script}), run)
    if recovery:
        # The family's tools have no StrReplaceFile: the fixed script is written again whole.
        outs = yield turn(say(low="Wrong folder: data/.",
                              high="FileNotFoundError: the script looks in input/, the files are in data/. Fix, rerun.",
                              max="The run failed with FileNotFoundError for input/orders.csv: I pointed the script "
                                  "at a folder that does not exist. The inputs are under data/. Write the script "
                                  "again with that one argument fixed and run it."), write, run)
        outs = outs[1:]
    count = outs[-1].strip()
    summary = f"Wrote {column} per {group} ({count} groups) to {target.strip('`').replace('`', '')}."
    if say.max:
        check = (Call("ReadFile", {"path": spec["path"]}) if spec["output"] == "file" else
                 Call("SQL", {"query": f"SELECT * FROM {spec['table']} ORDER BY 1"}))
        yield turn(f"The script printed {count}: {count} groups. Check the output itself before submitting: the "
                   f"header or columns, one row per {group}, values with at most 2 decimals.", check)
        yield turn(f"{count} rows, one per {group}, named {group} and {column} as asked; the values are rounded to "
                   f"2 decimals. Done.", Call("Submit", {"answer": summary}))
        return
    yield turn(say(low="Done.", high=f"{count} groups written. Submit."), Call("Submit", {"answer": summary}))


# ---- fix_test ---------------------------------------------------------------------------------------------


def _bug(edit: Call) -> tuple[str, str, list[str], list[str]]:
    """(function, its docstring, lines the fix removes, lines it adds) of one reference edit."""
    old, new = edit.args["edit"]["old"], edit.args["edit"]["new"]
    diff = list(difflib.ndiff(old.splitlines(), new.splitlines()))
    gone = [line[2:].strip() for line in diff if line.startswith("- ")]
    added = [line[2:].strip() for line in diff if line.startswith("+ ")]
    return re.match(r"def (\w+)\(", new)[1], re.search(r'"""(.*?)"""', new, re.S)[1], gone, added


def fix_test(task: Task, effort: str, recovery: bool, rng: random.Random) -> Expert:
    say = Say(effort, rng)
    edits = [c for c in task.solution if c.name == "StrReplaceFile"]
    modules = sorted(p for p in task.files if p.endswith(".py") and not p.startswith("tests/"))
    reads = [Call("ReadFile", {"path": m}) for m in modules]
    if effort == "low":
        yield turn(say(low=["Read the code.", "Look at the modules."]), *reads)
        failing = ""
    else:
        outs = yield turn(say(high=f"Steps: run the tests, read {', '.join(modules)}, fix each bug against its "
                                   f"docstring, rerun.",
                              max=f"The tests fail and the bug{'s are' if len(edits) > 1 else ' is'} in "
                                  f"{', '.join(modules)}, not in the tests. First see what fails and read the code; "
                                  f"each function's docstring is the spec."), Call("Shell", {"command": TEST_CMD}),
                          *reads)
        names = re.findall(r"^(?:FAIL|ERROR): (\w+)", outs[0], re.M)
        failing = f"Failing: {', '.join(sorted(set(names)))}. " if names else ""
    notes = []
    for edit in edits:
        fn, doc, gone, added = _bug(edit)
        doc = " ".join(doc.split())
        if gone:
            was, fixed = "; ".join(gone), "; ".join(added)
            notes.append(say(low=f"{fn}: `{fixed}`.", high=f"{fn}: `{was}` should be `{fixed}`.",
                             max=f"In {fn} ({edit.args['path']}) the docstring says \"{doc}\", but the code has "
                                 f"`{was}`, which breaks that for the failing cases; it must be `{fixed}`."))
        else:
            fixed = "; ".join(added)
            notes.append(say(low=f"{fn}: add `{fixed}`.", high=f"{fn} is missing `{fixed}`.",
                             max=f"{fn} ({edit.args['path']}) is missing `{fixed}`: without it the function does "
                                 f"not do what its docstring says (\"{doc}\")."))
    plan = say(low="", high="Replacing each function with the fixed version, then rerun the tests.",
               max="I replace each broken function whole (the edit stays unambiguous even when the bad line "
                   "occurs twice), then re-read the modules and re-run the tests before submitting.")
    sent = list(edits)
    if recovery:  # the first edit goes to a path that does not exist
        wrong = f"src/{edits[0].args['path']}"
        sent[0] = Call("StrReplaceFile", {**edits[0].args, "path": wrong})
    final = [] if say.max else [Call("Shell", {"command": TEST_CMD + " | tail -n 3"})]
    yield turn(failing + " ".join(notes) + (" " + plan if plan else ""), *sent, *final)
    if recovery:
        yield turn(say(low=f"No {wrong}; it is {edits[0].args['path']}.",
                       high=f"The edit failed: there is no {wrong}. The module is {edits[0].args['path']} at the "
                            f"workspace root; redo it there.",
                       max=f"The first edit failed: {wrong} does not exist. I made up a src/ folder; my first ReadFile "
                           f"opened the module at the workspace root, {edits[0].args['path']}. Apply the same "
                           f"edit there."), edits[0], *final)
    fixed = ", ".join(_bug(e)[0] for e in edits)
    if say.max:
        outs = yield turn("Verify: read the edited modules back and run the whole suite.",
                          *[Call("ReadFile", {"path": m}) for m in sorted({e.args["path"] for e in edits})],
                          Call("Shell", {"command": TEST_CMD + " | tail -n 3"}))
        yield turn(f"The modules read as intended and the run ends with {outs[-1].strip().splitlines()[-1]}. "
                   f"Every fixed function now matches its docstring. Submitting.",
                   Call("Submit", {"answer": f"Fixed {fixed}."}))
        return
    yield turn(say(low="Pass.", high="Tests pass. Submit."), Call("Submit", {"answer": f"Fixed {fixed}."}))


def implement_spec(task: Task, effort: str, recovery: bool, rng: random.Random) -> Expert:
    say = Say(effort, rng)
    write = task.solution[0]
    module, body = write.args["path"], write.args["edit"]["new"]
    name = re.search(r"Implement `(\w+)`", task.instruction)[1]
    spec = " ".join(re.search(r'"""(.*?)"""', task.files[module], re.S)[1].split())
    clauses = re.split(r", then |, and finally ", spec.removeprefix("Given a list of integers xs, ").rstrip("."))
    code = [line.strip() for line in body.splitlines()[1:]]  # after `out = list(xs)`: one line per clause
    test_file = next(p for p in task.files if p.startswith("tests/test_"))
    outs = yield turn(say(low="Read the stub and tests.",
                          high=f"Steps: read the spec of {name} and the tests, write one line per step, run the "
                               f"tests.",
                          max=f"The docstring of {name} in {module} is the spec and the tests show examples. Read "
                              f"both before writing anything."),
                      Call("ReadFile", {"path": module}), Call("ReadFile", {"path": test_file}))
    steps = [say(high=f"{c}: `{line}`", max=f"\"{c}\" becomes `{line}`") for c, line in zip(clauses, code)]
    think = say(low=[f"{len(clauses)} steps, as the docstring lists them.", "One line per step of the spec."],
                high=f"{len(clauses)} steps on a copy of xs: " + "; ".join(steps) + ".",
                max=f"The spec is a pipeline of {len(clauses)} steps on a copy of xs, so I write it as one "
                    f"assignment per step, in the spec's order: " + "; ".join(steps) + ". Each line keeps the "
                    "order of the list, which the later steps rely on. The tests' first case should come out "
                    "as shown; run them after the edit.")
    first = dict(write.args)
    if recovery:  # the first attempt forgets the final step
        first["edit"] = {**write.args["edit"], "new": body[:body.rindex("    return ")] + "    return out\n"}
    run = Call("Shell", {"command": TEST_CMD + " | tail -n 3"})
    outs = yield turn(think, Call("StrReplaceFile", first), run)
    if recovery:
        outs = yield turn(say(low="Forgot the last step.", high="Tests fail: I skipped the last step. Add it.",
                              max=f"The tests fail: my body returns `out` as it is, and the spec's last clause "
                                  f"(\"{clauses[-1]}\") is missing. Return `{code[-1].removeprefix('return ')}` "
                                  f"instead and run the tests again."),
                          Call("StrReplaceFile", {"path": module, "edit": {"old": "    return out\n",
                                                                          "new": f"    {code[-1]}\n"}}), run)
    result = outs[-1].strip().splitlines()[-1]
    if say.max:
        probe = f"python3 -c 'from {module[:-3]} import {name}; print({name}([]))'"
        outs = yield turn(f"The tests end with {result}. The edge the tests do not show: an empty list. Re-read the "
                          f"function and call it on [].", Call("ReadFile", {"path": module}),
                          Call("Shell", {"command": probe}))
        yield turn(f"The function reads as the spec, and {name}([]) gives {outs[-1].strip()}, which is what the "
                   f"steps give for no numbers. Submitting.", Call("Submit", {"answer": f"Implemented {name}."}))
        return
    yield turn(say(low="Pass.", high=f"Tests: {result}. Submit."), Call("Submit", {"answer": f"Implemented {name}."}))


EXPERTS = {"tool_arith": tool_arith, "multi_hop": multi_hop, "data_wrangle": data_wrangle, "fix_test": fix_test,
           "implement_spec": implement_spec}
