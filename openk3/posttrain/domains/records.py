"""Post-training records: one JSON object per trajectory, validated, in JSONL, rendered to XTML.

    {"id", "domain": general|agent|coding, "effort": low|high|max, "family", "difficulty", "seed",
     "split": train|test|heldout, "messages": [OpenAI-shape messages], "tools": [OpenAI tool schemas],
     "budget_think_tokens", "stats": {...}, "verifier": {...}}           (+ optional extra keys)

    validate_record(r)                 -> r, or ValueError naming the record and the field
    write_jsonl(path, records)         atomic (temporary file + rename); read_jsonl(path) -> records
    render_record(r, tok)              -> Encoded(ids, mask): the XTML token ids and the SFT loss mask
    think_tokens(r, tok)               think-channel tokens over all assistant turns, tags excluded
    render_sha256(r, tok)              sha256 of the rendered ids (decimal, comma-separated)
    roundtrip_problems(r, tok)         [] when every assistant turn parses back to itself
    fill_budgets(records, tok)         stats and per-effort budgets of one problem's low/high/max records
    reference_problems(records, tok)   [] when those references are fit for SFT

Rendering is `openk3.chat.render` with the record's effort as `thinking_effort` (spec §7): the mask
covers each assistant message from its first channel tag through `<|end_of_msg|>`, never its header
and never system, user or tool messages. Background: shared/context/next-post-training.md §4.2.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from typing import Any

from openk3.chat import (
    CLOSE,
    OPEN,
    SEP,
    THINKING_EFFORTS,
    Encoded,
    encode_segments,
    marker_ids_of,
    parse_tokens,
    render,
    token_pieces,
)
from openk3.fsutil import parse_json, write_atomic
from openk3.posttrain.domains.budget import BudgetConfig

DOMAINS = ("general", "agent", "coding")
SPLITS = ("train", "test", "heldout")
REQUIRED = ("id", "domain", "effort", "family", "difficulty", "seed", "split", "messages", "tools",
            "budget_think_tokens", "stats", "verifier")
ROLES = ("system", "user", "assistant", "tool")


@functools.cache
def byte_tokenizer():
    """The byte-level tokenizer the tests and the nano preset use (256 byte ids + K3's 256 specials);
    the default token counter wherever a tokenizer is optional."""
    from openk3.tokenizer import Tokenizer

    return Tokenizer({bytes([b]): b for b in range(256)})


# ------------------------------------------------------------------------------------------ validation


def _fail(record: Any, field: str, why: str) -> None:
    rid = record.get("id") if isinstance(record, dict) else None
    raise ValueError(f"record {rid!r}: {field} {why}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_message(record: dict, k: int, msg: Any, call_ids: set) -> None:
    where = f"messages[{k}]"
    if not isinstance(msg, dict):
        _fail(record, where, "must be an object")
    role = msg.get("role")
    if role not in ROLES:
        _fail(record, f"{where}.role", f"must be one of {list(ROLES)}, got {role!r}")
    for key in ("content", "reasoning_content"):
        if msg.get(key) is not None and not isinstance(msg[key], str):
            _fail(record, f"{where}.{key}", f"must be a string or null, got {type(msg[key]).__name__}")
    if role == "tool":
        if msg.get("tool_call_id") not in call_ids:
            _fail(record, f"{where}.tool_call_id", f"{msg.get('tool_call_id')!r} answers no earlier tool call")
        return
    calls = msg.get("tool_calls")
    if calls is None:
        return
    if role != "assistant" or not isinstance(calls, list):
        _fail(record, f"{where}.tool_calls", "must be a list on an assistant message")
    for j, call in enumerate(calls):
        cwhere = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(call.get("id"), str) or call.get("type") != "function":
            _fail(record, cwhere, 'must be {"id": str, "type": "function", "function": {...}}')
        if not isinstance(fn.get("name"), str) or not fn["name"].strip():
            _fail(record, f"{cwhere}.function.name", "must be a non-blank string")
        try:
            args = json.loads(fn.get("arguments"))
        except (TypeError, ValueError, RecursionError):
            args = None
        if not isinstance(args, dict):
            _fail(record, f"{cwhere}.function.arguments", "must be a JSON object encoded as a string")
        call_ids.add(call["id"])


def validate_record(record: Any) -> dict:
    """Check the shared record format; returns the record, raises ValueError naming the bad field."""
    if not isinstance(record, dict):
        raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
    missing = [key for key in REQUIRED if key not in record]
    if missing:
        _fail(record, "fields", f"missing: {', '.join(missing)}")
    if not isinstance(record["id"], str) or not record["id"]:
        _fail(record, "id", "must be a non-empty string")
    for key, allowed in (("domain", DOMAINS), ("effort", THINKING_EFFORTS), ("split", SPLITS)):
        if record[key] not in allowed:
            _fail(record, key, f"must be one of {list(allowed)}, got {record[key]!r}")
    if not isinstance(record["family"], str) or not record["family"]:
        _fail(record, "family", "must be a non-empty string")
    for key in ("difficulty", "seed", "budget_think_tokens"):
        if not _is_int(record[key]) or (key != "seed" and record[key] < 0):
            _fail(record, key, f"must be an integer{'' if key == 'seed' else ' >= 0'}, got {record[key]!r}")
    for key in ("stats", "verifier"):
        if not isinstance(record[key], dict):
            _fail(record, key, "must be an object")
    tools = record["tools"]
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        _fail(record, "tools", "must be a list of tool schema objects")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        _fail(record, "messages", "must be a non-empty list")
    call_ids: set = set()
    for k, msg in enumerate(messages):
        _check_message(record, k, msg, call_ids)
    if not any(m["role"] == "assistant" for m in messages):
        _fail(record, "messages", "has no assistant message (nothing to train on)")
    return record


# ------------------------------------------------------------------------------------------- JSONL


def write_jsonl(path: str | os.PathLike, records, validate: bool = True) -> int:
    """Write records one per line, atomically (a reader sees the old file or the new one); returns the count."""
    lines = []
    for record in records:
        if validate:
            validate_record(record)
        lines.append(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
    write_atomic(path, "".join(lines).encode("utf-8"))
    return len(lines)


def read_jsonl(path: str | os.PathLike, validate: bool = True) -> list[dict]:
    """Records of a JSONL file (blank lines skipped); errors name the file and line."""
    records = []
    with open(path, "rb") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            record = parse_json(line, f"{os.fspath(path)}:{lineno}")
            if validate:
                try:
                    validate_record(record)
                except ValueError as e:
                    raise ValueError(f"{os.fspath(path)}:{lineno}: {e}") from None
            records.append(record)
    return records


# ---------------------------------------------------------------------------------------- rendering


def render_request(record: dict, messages: list | None = None, add_generation_prompt: bool = False) -> dict:
    """The chat request a record renders as: its messages (or a prefix), tools and effort."""
    return {"messages": record["messages"] if messages is None else messages, "tools": record["tools"],
            "thinking_effort": record["effort"], "add_generation_prompt": add_generation_prompt}


def render_record(record: dict, tokenizer) -> Encoded:
    """(ids, mask) of the whole trajectory; mask[i] is true for tokens the SFT loss trains on."""
    return encode_segments(render(render_request(record)), tokenizer)


def think_tokens(record: dict, tokenizer=None) -> int:
    """Think-channel tokens summed over every assistant turn, tags excluded: the tokens of each segment
    between an assistant's `<|open|>think<|sep|>` and its `<|close|>`, encoded as the renderer encodes them."""
    tokenizer = tokenizer or byte_tokenizer()
    segments = render(render_request(record))
    total, i = 0, 0
    while i < len(segments):
        seg = segments[i]
        if (seg.train and seg.structural and seg.text == OPEN and i + 2 < len(segments)
                and segments[i + 1].text == "think" and segments[i + 2].text == SEP):
            i += 3  # past the tag: `<|open|>`, `think`, `<|sep|>`
            while i < len(segments) and not (segments[i].structural and segments[i].text == CLOSE):
                if not segments[i].structural:
                    total += len(tokenizer.encode(segments[i].text, allow_special=False))
                i += 1
        i += 1
    return total


def render_sha256(record: dict, tokenizer) -> str:
    """sha256 hex of the rendered token ids written as decimal numbers joined by commas."""
    return hashlib.sha256(",".join(map(str, render_record(record, tokenizer).ids)).encode()).hexdigest()


def _comparable(msg: dict) -> tuple:
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"] or "{}"))
             for c in msg.get("tool_calls") or []]
    reasoning = msg.get("reasoning_content") or None
    return (reasoning if reasoning and reasoning.strip() else None, msg.get("content") or "", calls)


def roundtrip_problems(record: dict, tokenizer) -> list[str]:
    """Render each assistant turn after the prompt before it, parse the generated part back by token id,
    and compare with the message; [] when all turns survive (think, response, tool calls, no parser
    problems). The rendered prompt must also be a prefix of the rendered history, as the sampler needs."""
    markers = marker_ids_of(tokenizer)
    messages = record["messages"]
    problems = []
    for k, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prompt = encode_segments(render(render_request(record, messages[:k], True)), tokenizer).ids
        full = encode_segments(render(render_request(record, messages[:k + 1])), tokenizer).ids
        if full[:len(prompt)] != prompt:
            problems.append(f"messages[{k}]: the generation prompt is not a prefix of the rendered turn")
            continue
        parsed = parse_tokens(token_pieces(full[len(prompt):], tokenizer, markers), marker_ids=markers)
        if parsed["problems"]:
            problems.append(f"messages[{k}]: parser problems {[p['code'] for p in parsed['problems']]}")
        if _comparable(parsed) != _comparable(msg):
            problems.append(f"messages[{k}]: parses back as {_comparable(parsed)!r}, not {_comparable(msg)!r}")
    return problems


# ------------------------------------------------------------------------------ references per effort


def fill_budgets(records: list[dict], tokenizer=None, budget: BudgetConfig | None = None) -> list[dict]:
    """Complete one problem's reference records, one per effort (in place; returned): `stats` gets
    think_tokens, turns and tool_calls, and reference_think_tokens L = the max record's think tokens,
    which sets every effort's `budget_think_tokens` (budget.py); `render_sha256` is added."""
    tok, cfg = tokenizer or byte_tokenizer(), budget or BudgetConfig()
    by_effort = {r["effort"]: r for r in records}
    if sorted(by_effort) != sorted(THINKING_EFFORTS) or len(records) != len(THINKING_EFFORTS):
        raise ValueError(f"fill_budgets needs one record per effort {list(THINKING_EFFORTS)}, "
                         f"got {[r.get('effort') for r in records]}")
    reference = think_tokens(by_effort["max"], tok)
    for record in records:
        assistants = [m for m in record["messages"] if m.get("role") == "assistant"]
        record["stats"] = {**record.get("stats", {}), "think_tokens": think_tokens(record, tok),
                           "reference_think_tokens": reference, "turns": len(assistants),
                           "tool_calls": sum(len(m.get("tool_calls") or []) for m in assistants)}
        record["budget_think_tokens"] = cfg.budget(reference, record["effort"])
        validate_record(record)
        record["render_sha256"] = render_sha256(record, tok)
    return records


def reference_problems(records: list[dict], tokenizer=None) -> list[str]:
    """Why one problem's reference records (from fill_budgets) are unfit for SFT; [] when fit. Unfit: a
    verifier reward other than 1, think tokens over the budget or not strictly ordered low < high < max,
    a turn that does not survive the render/parse round trip."""
    tok = tokenizer or byte_tokenizer()
    problems = [f"{r['id']}: the reference's verifier reward is {r['verifier'].get('reward')!r}, not 1"
                for r in records if r["verifier"].get("reward") != 1]
    problems += [f"{r['id']}: {r['stats']['think_tokens']} think tokens > budget {r['budget_think_tokens']}"
                 for r in records if r["stats"]["think_tokens"] > r["budget_think_tokens"]]
    counts = [r["stats"]["think_tokens"] for r in sorted(records, key=lambda r: THINKING_EFFORTS.index(r["effort"]))]
    if counts != sorted(set(counts)):
        problems.append(f"{records[0]['id']}: think tokens low/high/max {counts} are not strictly increasing")
    return problems + [p for r in records for p in roundtrip_problems(r, tok)]
