"""tool_arith: multi-step arithmetic through the key-value store.

The workspace starts with a KV store (`.state/kv.sqlite`, the KV tools' file) holding integers (or small JSON
records) under keys. The agent must read them (KVGet, KVList), combine them as the instruction says, store
the result under the key `result` (KVSet) and Submit the number. The grader reads the KV file of the final
workspace and the answer: half the reward each, so a right number that never reached the store scores 0.5.

Templates (train/test): `expression` (a formula over named keys), `ledger` (sum the amounts under a prefix,
skipping voided entries and distractor keys). Held out: `chain` (follow `next` pointers from `start`, summing
values), `inventory` (sum qty * price over records, skipping discontinued items).
Difficulty 1-3 grows the number of values and steps (2-3, 4-6, 6-10 reads).
"""

from __future__ import annotations

import json
import os
import random

from .. import toolbox
from ..toolbox_apps import KV_FILE, STATE_DIR
from .base import GRADER_PRELUDE, Call, Family, Task, register, scratch_dir

TOOLS = ["KVGet", "KVSet", "KVDelete", "KVList", "Submit"]
KV_PATH = f"{STATE_DIR}/{KV_FILE}"
RESULT_KEY = "result"
WORDS = ("apples", "pears", "bolts", "nuts", "cables", "boxes", "crates", "lamps", "tiles", "pipes", "fans",
         "gears", "wheels", "plates", "cups", "rods", "valves", "pumps", "sensors", "chips")

GRADE = GRADER_PRELUDE + '''\
import sqlite3

with open("/grader/expected.json") as f:
    expected = json.load(f)["result"]

stored = None
try:  # the KV tools' file in the final workspace (read-only: the grader changes nothing)
    conn = sqlite3.connect("file:" + WORKSPACE + "/.state/kv.sqlite?mode=ro", uri=True)
    try:
        row = conn.execute("SELECT value FROM kv WHERE key = ? AND deleted = 0", ("result",)).fetchone()
    finally:
        conn.close()
    stored = json.loads(row[0]) if row else None
except Exception:
    stored = None
kv_ok = isinstance(stored, (int, float)) and not isinstance(stored, bool) and stored == expected
answer_ok = ANSWER is not None and parse_number(ANSWER) == expected
finish(0.5 * kv_ok + 0.5 * answer_ok, kv_ok=kv_ok, answer_ok=answer_ok)
'''


def kv_file(entries: dict[str, object]) -> bytes:
    """The KV tools' SQLite file holding `entries`, written by the tool code itself (one schema, theirs)."""
    with scratch_dir() as root:
        for key, value in entries.items():
            r = toolbox.dispatch("KVSet", {"key": key, "value": value}, root=root)
            assert r["ok"], r
        with open(os.path.join(root, KV_PATH), "rb") as f:
            return f.read()


def _names(rng: random.Random, n: int) -> list[str]:
    return [f"{w}_{rng.randint(10, 99)}" for w in rng.sample(WORDS, n)]


def _expression(rng: random.Random, difficulty: int):
    n = {1: 2, 2: 3, 3: 5}[difficulty]
    names = _names(rng, n)
    vals = [rng.randint(2, 60) for _ in names]
    a, b, *rest = names
    x, y, *vrest = vals
    if difficulty == 1:
        formula, result = f"{a} + {b}", x + y
    elif difficulty == 2:
        formula, result = f"{a} * {b} - {rest[0]}", x * y - vrest[0]
    else:
        c, d, e = rest
        formula, result = f"({a} + {b}) * {c} - {d} * {e}", (x + y) * vrest[0] - vrest[1] * vrest[2]
    entries = dict(zip(names, vals))
    instruction = (f"The key-value store holds integers under the keys {', '.join(names)}. Compute {formula}, "
                   f"where each name stands for the value stored under that key.")
    reads = [Call("KVGet", {"key": k}) for k in names]
    return entries, instruction, result, reads


def _ledger(rng: random.Random, difficulty: int):
    n, n_void, n_other = {1: (3, 0, 0), 2: (5, 1, 2), 3: (8, 2, 3)}[difficulty]
    account = rng.choice(("acme", "globex", "initech", "umbrella", "stark", "wayne"))
    entries: dict[str, object] = {}
    result = 0
    ids = rng.sample(range(100, 1000), n + n_void)
    for i, tx in enumerate(ids):
        amount = rng.randint(-500, 900)
        if i < n_void:
            entries[f"ledger/{account}/{tx}"] = {"amount": amount, "void": True}
        else:
            entries[f"ledger/{account}/{tx}"] = {"amount": amount, "void": False}
            result += amount
    for tx in rng.sample(range(100, 1000), n_other):  # another account's entries: a wrong prefix is caught
        entries[f"ledger/other-{account}/{tx}"] = {"amount": rng.randint(1, 900), "void": False}
    instruction = (f"The key-value store holds the ledger of account {account!r}: one JSON record "
                   f"{{\"amount\": int, \"void\": bool}} per key under the prefix 'ledger/{account}/'. Compute "
                   f"the account's balance: the sum of the amounts of its entries that are not void.")
    keys = sorted(k for k in entries if k.startswith(f"ledger/{account}/"))
    reads = [Call("KVList", {"prefix": f"ledger/{account}/"})] + [Call("KVGet", {"key": k}) for k in keys]
    return entries, instruction, result, reads


def _chain(rng: random.Random, difficulty: int):
    n = {1: 2, 2: 4, 3: 7}[difficulty]
    names = ["start"] + _names(rng, n - 1)
    entries: dict[str, object] = {}
    result = 0
    for i, k in enumerate(names):
        v = rng.randint(1, 99)
        result += v
        entries[k] = {"value": v, "next": names[i + 1] if i + 1 < n else None}
    for k in _names(rng, 2):  # records off the chain
        if k not in entries:
            entries[k] = {"value": rng.randint(1, 99), "next": None}
    instruction = ("The key-value store holds records {\"value\": int, \"next\": key or null}. Start at the key "
                   "'start' and follow `next` until it is null. Compute the sum of the values of the records "
                   "you visit (including 'start' and the last one).")
    reads = [Call("KVGet", {"key": k}) for k in names]
    return entries, instruction, result, reads


def _inventory(rng: random.Random, difficulty: int):
    n, n_disc = {1: (2, 0), 2: (3, 1), 3: (5, 2)}[difficulty]
    names = _names(rng, n + n_disc)
    entries: dict[str, object] = {}
    result = 0
    for i, name in enumerate(names):
        qty, price = rng.randint(1, 40), rng.randint(2, 75)
        disc = i >= n
        entries[f"item/{name}"] = {"qty": qty, "price": price, "discontinued": disc}
        result += 0 if disc else qty * price
    instruction = ("The key-value store holds stock records {\"qty\": int, \"price\": int, \"discontinued\": "
                   "bool} under keys 'item/<name>'. Compute the stock value: the sum of qty * price over the "
                   "items that are not discontinued.")
    keys = sorted(entries)
    reads = [Call("KVList", {"prefix": "item/"})] + [Call("KVGet", {"key": k}) for k in keys]
    return entries, instruction, result, reads


BUILDERS = {"expression": _expression, "ledger": _ledger, "chain": _chain, "inventory": _inventory}


def build(rng: random.Random, difficulty: int, template: str) -> dict:
    entries, instruction, result, reads = BUILDERS[template](rng, difficulty)
    instruction += (f" Store the result as a JSON number under the key {RESULT_KEY!r} with KVSet, then call "
                    f"Submit with the number as the answer.")
    solution = reads + [Call("KVSet", {"key": RESULT_KEY, "value": result}), Call("Submit", {"answer": str(result)})]
    return {
        "instruction": instruction,
        "files": {KV_PATH: kv_file(entries)},
        "grader_files": {"grade.py": GRADE, "expected.json": json.dumps({"result": result}) + "\n"},
        "tools": list(TOOLS),
        "solution": solution,
    }


def wrong(task: Task) -> list[Call]:
    """Off by one in the result, stored and submitted: scores 0."""
    result = next(c.args["value"] for c in task.solution if c.name == "KVSet")
    return [Call("KVSet", {"key": RESULT_KEY, "value": result + 1}), Call("Submit", {"answer": str(result + 1)})]


FAMILY = register(Family(name="tool_arith", templates=("expression", "ledger"),
                         heldout_templates=("chain", "inventory"), build=build, wrong=wrong,
                         description="multi-step arithmetic through the key-value store, then Submit"))
