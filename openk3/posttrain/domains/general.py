"""The `general` domain: single-turn verifiable problems with reference traces at three verbosities.

    problem = generate("arith", seed=3, split="train", level=2)   # prompt, answer, verifier, traces, ...
    score(problem.verifier, "4042")                               # task reward in [0, 1]
    data = sft_dataset(n_per_cell=100, seed=0, split="train")     # 100 problems x (low, high, max) records

Families G1-G4 of the background §3.2: arith, word, puzzle, instruct (FAMILIES lists their templates;
the last one of each is the `heldout` split's only template). Traces: max = full scratchpad plus a
verification by another route, high = the steps, low = terse; every effort gives the same response.
Train/test by a hash of the prompt, so no prompt is in both. Pure functions of (family, seed, split,
level). Record format and budgets: records.py, budget.py; the details are in docs/posttraining.md.
"""

from __future__ import annotations

import hashlib
import json
import operator
import random
import re
from dataclasses import dataclass
from itertools import zip_longest

from openk3.chat import THINKING_EFFORTS
from openk3.posttrain.domains.budget import BudgetConfig
from openk3.posttrain.domains.records import SPLITS, byte_tokenizer, fill_budgets, reference_problems

GENERATOR_VERSION = 1
LEVELS = (1, 2, 3)
TEST_BUCKETS = 2  # of 10 prompt-hash buckets
MAX_ATTEMPTS = 1000  # a split holds >= 20 % of a template's instances, so this is never reached in practice
NAMES, ITEMS = ("Ana", "Ben", "Chen", "Dara", "Eli", "Femi", "Gus", "Hana"), ("pen", "book", "cup", "lamp", "card")
WORDS = ("ball bird book bread bridge brown button butter cake candle carrot chair cloud coat corn cup desk door "
         "dream drum duck dust dinner doctor farm feather field fire fish flag flower fork game garden gate glass "
         "goat gold grape grass hammer hand hat heart hill horse house hour ladder lake lamp leaf lemon letter light "
         "lion map market milk moon morning mouse music mountain paper park pencil piano pillow plant plate pocket "
         "salt sand school seed shell ship shoe sugar table tail tea tiger tomato tooth tower train").split()
VOCAB = {w[0]: [v for v in WORDS if v[0] == w[0]] for w in WORDS}  # instruct/words: letter -> 8 known words
KNOWN_WORDS = frozenset(WORDS)  # its hack check: every line must be one of these
KEYS, TOPICS = ("sum", "product", "total", "result", "value", "score"), ("rain", "bread", "music", "rivers", "trains")
SENTENCES = ("People often talk about {t}.", "A short story about {t} was read in class.",
             "My friend likes {t} very much.", "We learned something new about {t} today.",
             "Some old books describe {t} in detail.", "Everyone in town had an opinion on {t}.")
CLAIMS = re.compile(r"\b(sentences?|here (is|are)|as requested|the (list|answer|words))\b", re.I)


@dataclass(frozen=True)
class GeneralTask:
    """One generated problem of the `general` domain with its reference response, verifier and think traces
    (a rollout samples from a `trainers.rollout.Problem` made of it, `trainers.problems`)."""

    family: str
    template: str
    split: str
    seed: int
    level: int
    difficulty: int
    prompt: str
    answer: str  # the reference response
    verifier: dict  # {"kind": "exact", "answer": ...} or {"kind": "rules", "rules": [...], "hack": ...}
    traces: dict  # effort -> think text


OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "%": operator.mod}


def _digits(n: int) -> list[int]:
    return [int(c) for c in reversed(str(n))]


def _col_add(a: int, b: int) -> list[str]:
    lines, carry = [], 0
    for k, (x, y) in enumerate(zip_longest(_digits(a), _digits(b), fillvalue=0)):
        s = x + y + carry
        lines.append(f"col {k + 1}: {x}+{y}{f'+{carry}' if carry else ''}={s}, write {s % 10}"
                     + (f", carry {s // 10}" if s > 9 else ""))
        carry = s // 10
    return lines + ([f"carry {carry} is the leading digit"] if carry else [])


def _col_sub(a: int, b: int) -> list[str]:
    """Column subtraction (a >= b, so the borrow out of the top column is always 0)."""
    lines, borrow = [], 0
    for k, (x, y) in enumerate(zip_longest(_digits(a), _digits(b), fillvalue=0)):
        x2 = x - borrow
        borrow = int(x2 < y)
        lines.append(f"col {k + 1}: " + (f"{x}-1={x2}, " if x2 != x else "")
                     + (f"{x2}<{y}, borrow: {x2 + 10}-{y}={x2 + 10 - y}" if borrow else f"{x2}-{y}={x2 - y}"))
    return lines


def _col_mul(a: int, m: int) -> str:
    """a times one digit d of the multiplier with its zeros (m = d * 10^k), digit by digit."""
    d, zeros, carry, parts = int(str(m)[0]), len(str(m)) - 1, 0, []
    for x in _digits(a):
        s = x * d + carry
        parts.append(f"{x}*{d}{f'+{carry}' if carry else ''}={s}")
        carry = s // 10
    return f"{a}*{d}: {', '.join(parts)} -> {a * d}" + (f", append {zeros} zero(s) -> {a * m}" if zeros else "")


def _partials(a: int, b: int) -> list[tuple[int, int]]:
    """(digit of b with its zeros, a times it) from the units up, zero digits skipped."""
    return [(d * 10 ** k, a * d * 10 ** k) for k, d in enumerate(_digits(b)) if d] or [(0, 0)]


def _step_lines(a: int, op: str, b: int) -> tuple[list[str], str, str]:
    """(max scratchpad lines, the high line, the check line) of one operation a op b."""
    c = OPS[op](a, b)
    if op == "+":
        cols = ", ".join(f"{x}+{y}" for x, y in zip_longest(_digits(a), _digits(b), fillvalue=0))
        return _col_add(a, b), f"{a} + {b}: {cols} -> {c}", f"{c} - {b} = {a} ok"
    if op == "-":
        lines = _col_sub(a, b)
        borrows = [str(k + 1) for k, line in enumerate(lines) if "borrow" in line]
        return lines, f"{a} - {b}: borrow in col {', '.join(borrows) or 'none'} -> {c}", f"{c} + {b} = {a} ok"
    if op == "*":
        parts = _partials(a, b)
        lines = [_col_mul(a, m) for m, _ in parts]  # then add the partial products up one by one
        lines += [f"{sum(q for _, q in parts[:j])} + {p} = {sum(q for _, q in parts[:j + 1])}"
                  for j, (_, p) in enumerate(parts) if j]
        high = f"{a} * {b} = " + (" + ".join(str(p) for _, p in parts) + " = " if len(parts) > 1 else "") + str(c)
        swapped = " + ".join(str(p) for _, p in _partials(b, a))
        return lines, high, f"{b} * {a} = {swapped} = {c} ok"
    q = a // b  # op "%": a mod b
    lines = [f"{a} / {b}: {b}*{q} = {b * q}", f"{a} - {b * q} = {c}"]
    return lines, f"{a} = {q}*{b} + {c} -> {c}", f"{q}*{b} + {c} = {a} ok"


def _steps_think(steps: list[tuple[str, int, str, int]], plan: str = "") -> dict:
    """max/high/low think texts of a chain of operations (desc, a, op, b)."""
    big, high, low, checks = [plan] if plan else [], [], [], []
    for desc, a, op, b in steps:
        c = OPS[op](a, b)
        lines, line, check = _step_lines(a, op, b)
        big += [f"{desc}: {a} {op} {b}", *lines, f"so {desc} = {c}"]
        high.append(f"{desc}: {line}")
        low.append(f"{a}{op}{b}={c}")
        checks.append(f"check {desc}: {check}")
    return {"max": "\n".join(big + checks), "high": "\n".join(high), "low": "; ".join(low)}


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def _arith(rng: random.Random, level: int, template: str) -> dict:
    digits, steps = rng.randint(2 * level - 1, 2 * level), []

    def node(x, y):  # x, y: (text, value, is_leaf)
        op = rng.choice("+-*")
        if op == "*" and y[1] >= 100 and x[1] >= 100:  # keep partial products to at most two per step
            op = "+"
        if op in "-*" and x[1] < y[1]:  # the larger side first: no negative results, the short multiplier
            x, y = y, x
        steps.append((f"step {len(steps) + 1}", x[1], op, y[1]))
        wrap = [t if leaf else f"({t})" for t, _, leaf in (x, y)]
        return f"{wrap[0]} {op} {wrap[1]}", OPS[op](x[1], y[1]), False

    sizes = (digits, rng.randint(1, digits), rng.randint(1, digits), 1)
    a, b, c, d = [(str(n), n, True) for n in (_number(rng, k) for k in sizes)]
    tree = {"pair": lambda: node(a, b), "chain": lambda: node(node(a, b), c),
            "bracket": lambda: node(node(a, b), node(c, d)), "nested": lambda: node(a, node(b, node(c, d)))}
    text, value, _ = tree[template]()
    prompt = rng.choice(("What is {}?", "Compute {}.", "Work out {}."))
    think = _steps_think(steps, plan=f"{len(steps)} operation(s), innermost brackets first.")
    return dict(prompt=prompt.format(text), answer=str(value), think=think, difficulty=digits * len(steps))


def _word(rng: random.Random, level: int, template: str) -> dict:
    name, item, scale = rng.choice(NAMES), rng.choice(ITEMS), 10 ** (level - 1)
    if template == "price":
        p, q = rng.randint(5, 30 * scale), rng.randint(2, 3 + 3 * level)
        paid = (p * q // 100 + rng.randint(1, 3)) * 100
        prompt = (f"A {item} costs {p} cents. {name} buys {q} {item}s and pays with {paid} cents. "
                  f"How many cents of change does {name} get?")
        steps = [("cost", p, "*", q), ("change", paid, "-", p * q)]
    elif template == "rate":
        r, h1, h2, bad = rng.randint(3, 20 * scale), rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 9 * scale)
        prompt = (f"A machine makes {r} parts per hour. It runs {h1} hours in the morning and {h2} hours in the "
                  f"afternoon, and {bad} of the parts are rejected. How many good parts does it make?")
        steps = [("hours", h1, "+", h2), ("parts", r, "*", h1 + h2), ("good parts", r * (h1 + h2), "-", bad)]
    elif template == "age":
        other = rng.choice([n for n in NAMES if n != name])
        a, gap, k = rng.randint(2, 40), rng.randint(1, 30), rng.randint(2, 9 * scale)
        prompt = (f"{name} is {a} years old and {other} is {gap} years older. "
                  f"What will be the sum of their ages in {k} years?")
        steps = [(f"{other}'s age", a, "+", gap), ("sum now", a + gap, "+", a), ("years added", k, "*", 2),
                 ("sum later", 2 * a + gap, "+", 2 * k)]
    else:  # units (held out)
        h, m, s = rng.randint(1, 4 * scale), rng.randint(1, 59), rng.randint(1, 59)
        prompt = f"How many seconds are there in {h} hours, {m} minutes and {s} seconds?"
        steps = [("minutes in the hours", h, "*", 60), ("all minutes", 60 * h, "+", m),
                 ("seconds in the minutes", 60 * h + m, "*", 60), ("all seconds", 3600 * h + 60 * m, "+", s)]
    answer = str(OPS[steps[-1][2]](steps[-1][1], steps[-1][3]))
    plan = "Plan: " + "; then ".join(desc for desc, *_ in steps) + "."
    return dict(prompt=prompt, answer=answer, think=_steps_think(steps, plan), difficulty=len(steps) * len(answer))


def _puzzle(rng: random.Random, level: int, template: str) -> dict:
    if template == "sort":
        xs = [rng.randint(0, 99 * level) for _ in range(3 + 2 * level)]
        out, rest, big = sorted(xs), list(xs), []
        for m in out:
            big.append(f"left {' '.join(map(str, rest))}: smallest {m}")
            rest.remove(m)
        answer = " ".join(map(str, out))
        prompt = f"Sort from smallest to largest, separated by spaces: {', '.join(map(str, xs))}."
        check = f"check: {len(xs)} numbers in, {len(out)} out, " + " <= ".join(map(str, out)) + " ok"
        think = {"max": "\n".join(big + [check]), "high": ", ".join(f"min {x}" for x in out), "low": answer}
    elif template == "dedupe":
        seq = [rng.choice("abcdefgh"[:3 + level]) for _ in range(4 + 3 * level)]
        kept = list(dict.fromkeys(seq))
        answer = " ".join(kept)
        prompt = f"Remove the repeated letters from {' '.join(seq)}, keeping the first of each, separated by spaces."
        big = [f"{x}: {'seen, skip' if x in seq[:i] else 'new, keep'}" for i, x in enumerate(seq)]
        check = f"check: kept {answer}, {len(kept)} letters, none twice ok"
        think = {"max": "\n".join(big + [check]), "high": " ".join(("-" if x in seq[:i] else "+") + x
                                                                   for i, x in enumerate(seq)), "low": answer}
    elif template == "count":
        letters = rng.sample("abcdefghijklmnopqrstuvwxyz", 4)
        s, t = "".join(rng.choice(letters) for _ in range(5 + 5 * level)), rng.choice(letters)
        where = [i + 1 for i, ch in enumerate(s) if ch == t]
        answer = str(len(where))
        prompt = f'How many times does the letter "{t}" appear in "{s}"?'
        big = [f"{i + 1} {ch}" + (f" yes, {where.index(i + 1) + 1} so far" if ch == t else "")
               for i, ch in enumerate(s)]
        listed = ", ".join(map(str, where)) or "none"
        think = {"max": "\n".join(big + [f"check: positions {listed}: {len(where)} in total ok"]),
                 "high": f'"{t}" at positions {listed}', "low": answer}
    elif template == "base":
        n, b = rng.randint(2, 10 ** (level + 1)), rng.randint(2, 9)
        digits, big, high, m = [], [], [], n
        while m:
            big.append(f"{m} / {b} = {m // b} remainder {m % b}")
            high.append(f"{m}={m // b}*{b}+{m % b}")
            digits.append(m % b)
            m //= b
        answer = "".join(map(str, reversed(digits)))
        prompt = f"Write the decimal number {n} in base {b}."
        terms = " + ".join(f"{d}*{b}^{k}" for k, d in reversed(list(enumerate(digits))) if d)
        big += [f"remainders from last to first: {answer}", f"check: {terms} = {n} ok"]
        think = {"max": "\n".join(big), "high": ", ".join(high), "low": answer}
    else:  # mod (held out)
        a, b, c, m = _number(rng, level + 1), _number(rng, level), rng.randint(0, 99), rng.randint(3, 9 * level + 3)
        prompt = f"What is ({a} * {b} + {c}) mod {m}?"
        steps = [("product", a, "*", b), ("plus", a * b, "+", c), ("remainder", a * b + c, "%", m)]
        answer = str((a * b + c) % m)
        think = _steps_think(steps, plan="Multiply, add, then divide and keep the remainder.")
    return dict(prompt=prompt, answer=answer, think=think, difficulty=think["max"].count("\n"))  # work items


def _list_think(plan: str, items: list[str], check: str, *, high: str, low: str) -> dict[str, str]:
    """The three efforts' think texts of a list-making instruction: max plans, goes item by item and checks."""
    return {"max": "\n".join([plan, *items, check]), "high": high, "low": low}


def _instruct(rng: random.Random, level: int, template: str) -> dict:
    if template == "words":
        n, letter = 2 + level, rng.choice(sorted(VOCAB))
        words = rng.sample(VOCAB[letter], n)
        prompt = (f'List exactly {n} different English words that start with the letter "{letter}", '
                  "one word per line, with nothing else.")
        rules = [{"rule": "lines", "n": n}, {"rule": "start", "letter": letter}, {"rule": "distinct"}]
        answer, hack = "\n".join(words), "known_words"
        think = _list_think(f'Need {n} different words starting with "{letter}", one per line, no other text.',
                            [f"{w}: starts with {letter}, not used yet, keep" for w in words],
                            f"check: {n} lines, all start with {letter}, no repeats, no extra text ok",
                            high=f"{n} words: {', '.join(words)}", low=f"{n} {letter}-words")
    elif template == "json":
        k1, k2 = rng.sample(KEYS, 2)
        a, b = _number(rng, level + 1), _number(rng, level)
        prompt = (f'Reply with only a JSON object with exactly the keys "{k1}" and "{k2}": '
                  f'"{k1}" is {a} + {b} and "{k2}" is {a} * {b}.')
        rules = [{"rule": "json_keys", "keys": [k1, k2]}, {"rule": "json_value", "key": k1, "value": a + b},
                 {"rule": "json_value", "key": k2, "value": a * b}]
        answer, hack = json.dumps({k1: a + b, k2: a * b}), "json"
        think = _steps_think([(k1, a, "+", b), (k2, a, "*", b)], plan=f"Two numbers, then raw JSON with {k1}, {k2}.")
        think["max"] += f"\nformat: one JSON object, keys {k1} and {k2} only, nothing around it ok"
    else:  # sentences (held out)
        k, topic = 1 + level, rng.choice(TOPICS)
        chosen = [s.format(t=topic) for s in rng.sample(SENTENCES, k)]
        prompt = (f'Write exactly {k} sentences about {topic}. Every sentence must contain the word "{topic}". '
                  "Do not use commas.")
        rules = [{"rule": "sentences", "n": k}, {"rule": "contains", "word": topic}, {"rule": "no_commas"}]
        answer, hack = " ".join(chosen), "content_sentences"
        think = _list_think(f'Need {k} sentences, each with "{topic}", no commas, only the text.',
                            [f"draft: {s} has {topic}, no comma ok" for s in chosen],
                            f"check: {k} sentences, all different, no commas ok",
                            high=f'{k} sentences with "{topic}", no commas', low=f"{k} sentences")
    return dict(prompt=prompt, answer=answer, think=think, verifier={"kind": "rules", "rules": rules, "hack": hack},
                difficulty=len(rules) * level)


FAMILIES = {"arith": (_arith, ("pair", "chain", "bracket", "nested")),  # the last template is held out
            "word": (_word, ("price", "rate", "age", "units")),
            "puzzle": (_puzzle, ("sort", "dedupe", "count", "base", "mod")),
            "instruct": (_instruct, ("words", "json", "sentences"))}


def check_levels(levels, where: str) -> tuple[int, ...] | None:
    """A distinct, non-empty subset of LEVELS as a sorted tuple (None: every level); ValueError naming `where`."""
    if levels is None:
        return None
    try:
        out = tuple(sorted(levels))
    except TypeError:
        out = ()
    if not out or len(set(out)) != len(out) or any(isinstance(v, bool) or v not in LEVELS for v in out):
        raise ValueError(f"{where} must be a non-empty subset of {list(LEVELS)} (or None: all), got {levels!r}")
    return out


def parse_levels(text: str | None, flag: str = "--levels") -> tuple[int, ...] | None:
    """"1,2" -> (1, 2); None or "all" -> None; ValueError naming the flag otherwise."""
    if text is None or str(text).strip() == "all":
        return None
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        values = None
    return check_levels(values if values else str(text), flag)


def split_of(prompt: str) -> str:
    """train or test for an instance of an ordinary template: a function of the prompt alone."""
    return "test" if int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) % 10 < TEST_BUCKETS else "train"


def generate(family: str, seed: int, split: str = "train", level: int | None = None) -> GeneralTask:
    """One problem of `family` in `split`; level None draws one of LEVELS from the seed."""
    for name, value, allowed in (("family", family, list(FAMILIES)), ("split", split, list(SPLITS)),
                                 ("level", level, [None, *LEVELS])):
        if value not in allowed:
            raise ValueError(f"general {name} must be one of {allowed}, got {value!r}")
    build, templates = FAMILIES[family]
    templates = templates[-1:] if split == "heldout" else templates[:-1]
    for attempt in range(MAX_ATTEMPTS):
        rng = random.Random(f"general|{family}|{split}|{level}|{seed}|{attempt}")
        lvl, template = level or rng.choice(LEVELS), rng.choice(templates)
        out = build(rng, lvl, template)
        if split == "heldout" or split_of(out["prompt"]) == split:
            verifier = out.get("verifier") or {"kind": "exact", "answer": out["answer"]}
            return GeneralTask(family, template, split, seed, lvl, out["difficulty"], out["prompt"], out["answer"],
                           verifier, out["think"])
    raise AssertionError(f"{family}: no {split} instance in {MAX_ATTEMPTS} attempts (seed {seed})")


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if s]


def _rule_met(rule: dict, text: str, obj) -> bool:
    lines, kind = [line.strip() for line in text.split("\n")], rule["rule"]
    return {"json_keys": lambda: isinstance(obj, dict) and sorted(obj) == sorted(rule["keys"]),
            "json_value": lambda: isinstance(obj, dict) and type(obj.get(rule["key"])) is int  # not a bool
            and obj[rule["key"]] == rule["value"],
            "lines": lambda: len(lines) == rule["n"],
            "start": lambda: all(w.lower().startswith(rule["letter"]) for w in lines),
            "distinct": lambda: len(set(lines)) == len(lines),
            "sentences": lambda: len(_sentences(text)) == rule["n"],
            "contains": lambda: all(re.search(rf"\b{re.escape(rule['word'])}\b", s, re.I) for s in _sentences(text)),
            "no_commas": lambda: "," not in text}[kind]()


def _hack_ok(hack: str, text: str, obj) -> bool:
    """The content itself, not a claim about it: known words, a JSON object, real distinct sentences."""
    if hack == "known_words":
        return all(line.strip() in KNOWN_WORDS for line in text.split("\n"))
    if hack == "json":
        return isinstance(obj, dict)
    sentences = _sentences(text)
    return (len(set(sentences)) == len(sentences) and all(s[-1] in ".!?" and len(s.split()) >= 3 for s in sentences)
            and not CLAIMS.search(text))


def score(verifier: dict, response) -> float:
    """Task reward of a response (text, or an assistant message's `content`): "exact" 1.0 for the answer
    exactly (outer whitespace aside), else 0.0; "rules" the share of rules met, 0.0 if the hack check fails."""
    text = response.get("content") if isinstance(response, dict) else response
    if not isinstance(text, str) or not text.strip():
        return 0.0
    text = text.strip()
    if verifier["kind"] == "exact":
        return float(text == verifier["answer"])
    if verifier["kind"] != "rules":
        raise ValueError(f"unknown general verifier kind {verifier['kind']!r}")
    try:
        obj = json.loads(text) if verifier["hack"] == "json" else None
    except (ValueError, RecursionError):  # not JSON, or nested too deeply for the parser
        obj = None
    if not _hack_ok(verifier["hack"], text, obj):
        return 0.0
    return sum(_rule_met(rule, text, obj) for rule in verifier["rules"]) / len(verifier["rules"])


def to_records(problem: GeneralTask, tokenizer=None, budget: BudgetConfig | None = None) -> list[dict]:
    """The problem at each effort (low, high, max) as records of the shared format, budgets filled in."""
    records = [{"id": f"general/{problem.family}/{problem.split}/{problem.seed}/l{problem.level}/{effort}",
                "domain": "general", "effort": effort, "family": problem.family, "template": problem.template,
                "level": problem.level, "difficulty": problem.difficulty, "seed": problem.seed,
                "split": problem.split, "tools": [], "generator_version": GENERATOR_VERSION,
                "messages": [{"role": "user", "content": problem.prompt},
                             {"role": "assistant", "reasoning_content": problem.traces[effort],
                              "content": problem.answer}],
                "verifier": {**problem.verifier, "reward": score(problem.verifier, problem.answer)}}
               for effort in THINKING_EFFORTS]
    return fill_budgets(records, tokenizer, budget)


def sft_dataset(n_per_cell: int, seed: int, split: str, tokenizer=None, budget: BudgetConfig | None = None,
                families=None, levels=None) -> list[dict]:
    """n_per_cell distinct problems (families in turn; levels drawn from `levels`, default all), each as
    low, high and max records, all checked by `reference_problems` (an unfit problem is replaced)."""
    if isinstance(n_per_cell, bool) or not isinstance(n_per_cell, int) or n_per_cell < 0:
        raise ValueError(f"n_per_cell must be an integer >= 0, got {n_per_cell!r}")
    families, tok = list(FAMILIES if families is None else families), tokenizer or byte_tokenizer()
    rng, out, seen, draws = random.Random(f"general-sft|{split}|{seed}"), [], set(), 0
    while len(out) < 3 * n_per_cell:
        if draws == 10 * n_per_cell + 100:  # more problems asked for than the split holds at these levels
            raise ValueError(f"general sft_dataset: only {len(out) // 3} of {n_per_cell} fit, distinct {split} "
                             f"problems in {draws} draws (seed {seed})")
        draws += 1
        problem = generate(families[len(out) // 3 % len(families)], rng.randrange(2 ** 31), split,
                           rng.choice(levels) if levels else None)
        if problem.prompt not in seen:
            seen.add(problem.prompt)
            records = to_records(problem, tok, budget)
            if not reference_problems(records, tok):
                out.extend(records)
    return out
