"""Structured outputs: grammar-constrained decoding with llguidance (docs/inference.md, structured outputs).

A request that carries a `Structured` (`SamplingParams.structured`) has, at every step, the logits of the
tokens its grammar cannot take next set to -inf before sampling, so a masked token is never drawn, greedy or
sampled. The grammar is an llguidance grammar: a Lark-like grammar whose rules may hold `%json {schema}`,
regexes and special tokens by name (`<|close|>`); `Structured.of` builds one from the usual specs:

    {"json": SCHEMA}        a JSON value matching a JSON schema (a dict or its JSON text)
    {"json_object": True}   any JSON object
    {"regex": PATTERN}      text matching a regex (whole match)
    {"choice": [S, ...]}    exactly one of these strings
    {"grammar": LARK}       an llguidance Lark grammar (its `start` rule)

JSON is written with the separators `, ` and `: ` and no other whitespace (the form the XTML renderer gives
tool-call argument values; fixed whitespace also keeps a weak model from filling its budget with blanks); a
schema's own `x-guidance` options override this.

Thinking: a `Structured` with `after_think` leaves the thinking channel free (only the stop ids are masked,
so the message cannot end inside its reasoning) and applies the grammar from the token after the first
`<|close|>`, which ends that channel (as vLLM's reasoning-aware structured outputs start at the reasoning
parser's end marker). When the grammar is complete, only the end-of-sequence ids (the tokenizer's stop
ids) are allowed, so the model ends the request and its finish reason is "stop". A grammar that can go no
further (llguidance's error, or no token allowed) ends the request with finish reason "error" and the
reason as its `stop_reason`; it never hangs.

`Grammars` holds one tokenizer's llguidance side: the `LLTokenizer` (built from openk3's tiktoken ranks and
its special tokens, which grammars name as `<|open|>` or by id as `<[163587]>`), a cache of compiled
grammars, validation with llguidance's reason, and the batched mask of the engine's constrained rows.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: JSON compile options for every schema (a schema's own `x-guidance` wins).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SPEC_KEYS = ("json", "json_object", "regex", "choice", "grammar")
_REASON_CHARS = 400  # llguidance's messages can list every special token: keep what names the problem
_CACHE = 64  # compiled grammars (and validation results) kept per tokenizer


def llg():
    # imported on first use: `import openk3.infer` should not pay for it (~60 ms) when nothing is constrained
    import llguidance

    return llguidance


class StructuredError(ValueError):
    """A grammar or schema that cannot be used; `field` names where the request gave it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def short(reason: str) -> str:
    reason = " ".join(reason.split())
    return reason if len(reason) <= _REASON_CHARS else reason[:_REASON_CHARS] + " ..."


@dataclass(frozen=True)
class Structured:
    """What a request's output must match. grammar: an llguidance grammar (Lark text, or the JSON of
    {"grammars": [...]}); after_think: the grammar starts after the thinking channel's first `<|close|>`;
    field: where the request gave it, named in errors."""

    grammar: str
    after_think: bool = False
    field: str = "structured"

    @classmethod
    def of(cls, spec: Any, field: str = "structured") -> Structured:
        """A `Structured` from a spec dict (see the module docstring) or a `Structured` (returned as is)."""
        if isinstance(spec, Structured):
            return spec
        body, side = fragment(spec, field)
        return cls(assemble(f"start: {body}", side), field=field)


def json_fragment(schema: Any, field: str) -> str:
    """`%json {...}` for a schema (a dict, True, or its JSON text), with `JSON_OPTIONS` merged in."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise StructuredError(field, f"not valid JSON ({e})") from None
    if schema is True or schema == {}:
        schema = {}
    if not isinstance(schema, dict):
        raise StructuredError(field, f"a JSON schema must be an object, got {type(schema).__name__}")
    own = schema.get("x-guidance")
    options = {**JSON_OPTIONS, **own} if isinstance(own, dict) else JSON_OPTIONS
    try:
        return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)
    except RecursionError:
        raise StructuredError(field, "the schema is nested too deeply") from None
    except (TypeError, ValueError) as e:
        raise StructuredError(field, f"the schema cannot be written as JSON ({e})") from None


def literal(text: str) -> str:
    """A Lark string literal matching `text` exactly (llguidance reads JSON string escapes)."""
    return json.dumps(text, ensure_ascii=False)


def fragment(spec: Any, field: str) -> tuple[str, list[dict]]:
    """A spec -> (a Lark rule body, side grammars it references as `@name`)."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in SPEC_KEYS:
        raise StructuredError(field, f"must be an object with exactly one of {', '.join(SPEC_KEYS)}, got {spec!r:.200}")
    (kind, value), = spec.items()
    if kind == "json":
        return json_fragment(value, f"{field}.json"), []
    if kind == "json_object":
        if value is not True:
            raise StructuredError(field, f"json_object must be true, got {value!r}")
        return json_fragment({"type": "object"}, field), []
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(s, str) for s in value)):
            raise StructuredError(field, "choice must be a non-empty list of strings")
        return "(" + " | ".join(literal(s) for s in value) + ")", []
    if not isinstance(value, str) or not value:
        raise StructuredError(field, f"{kind} must be a non-empty string")
    if kind == "regex":
        return "/" + llg().regex_to_lark(value) + "/", []
    return "@user", [{"name": "user", "lark_grammar": value}]


def response_format_fragment(response_format: Any) -> tuple[str, str] | None:
    """(`%json` fragment, field) of an OpenAI `response_format` json_object / json_schema; None for text or none."""
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        return json_fragment({"type": "object"}, "response_format"), "response_format"
    if kind != "json_schema":
        return None
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise StructuredError("response_format.json_schema", "must be an object with the schema in `schema`")
    field = "response_format.json_schema.schema"
    return json_fragment(spec.get("schema", {"type": "object"}), field), field


def assemble(main: str, side: list[dict]) -> str:
    """The grammar text llguidance takes: the Lark text alone, or a {"grammars": [...]} with side grammars."""
    return json.dumps({"grammars": [{"lark_grammar": main}, *side]}) if side else main


# ---- one tokenizer's llguidance side --------------------------------------------------------------------


class _Recent:
    """The `_CACHE` most recently used entries of a mapping (thread-safe: an in-thread server validates on
    the event loop while the engine thread compiles)."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[bool, Any]:
        with self._lock:
            if key not in self._items:
                return False, None
            self._items.move_to_end(key)
            return True, self._items[key]

    def put(self, key: str, value: Any) -> Any:
        with self._lock:
            self._items[key] = value
            while len(self._items) > _CACHE:
                self._items.popitem(last=False)
        return value


class Grammars:
    """llguidance for one `openk3.tokenizer.Tokenizer`: validation, compiled matchers, batched masks."""

    def __init__(self, tok) -> None:
        from openk3.tokenizer.bpe import K3_PAT_STR

        self.vocab_size = tok.vocab_size
        self.stop_ids = list(tok.stop_ids)
        # ~1 s for K3's 163,840 ids: built once per tokenizer (`grammars_for`)
        self.lltok = llg().LLTokenizer.from_tiktoken(encoder=tok.ranks, special_tokens=tok.special_ids,
                                                   pattern=K3_PAT_STR, eos_token=self.stop_ids or None,
                                                   n_vocab=tok.vocab_size)
        self.close_id = tok.special_ids.get("<|close|>")
        self._compiled = _Recent()  # grammar text -> compiled matcher (copied for each request)
        self._errors = _Recent()  # grammar text -> llguidance's reason, or None
        self._executor = None
        self._words = (tok.vocab_size + 31) // 32
        self._bitmask: np.ndarray | None = None

    def error(self, grammar: str) -> str | None:
        """llguidance's reason for refusing a grammar (shortened), or None when it compiles (remembered: a
        server sees the same tools and schemas again and again)."""
        found, reason = self._errors.get(grammar)
        if not found:
            reason = llg().LLMatcher.validate_grammar(grammar, self.lltok)
            reason = self._errors.put(grammar, short(reason) if reason else None)
        return reason

    def check(self, s: Structured) -> None:
        """Raise `StructuredError` (a ValueError naming the field) when llguidance refuses the grammar."""
        reason = self.error(s.grammar)
        if reason:
            raise StructuredError(s.field, f"the grammar was refused by llguidance: {reason}")

    def _matcher(self, grammar: str):
        """A fresh matcher: compiled once per grammar text (then copied, ~microseconds)."""
        found, base = self._compiled.get(grammar)
        if not found:
            base = llg().LLMatcher(self.lltok, grammar, log_level=0)
            if base.is_error():
                raise ValueError(f"the grammar was refused by llguidance: {short(base.get_error())}")
            self._compiled.put(grammar, base)
        return base.deep_copy()

    def start(self, s: Structured, stop_ids) -> Constraint:
        """The per-request state for `s` (stop_ids: the request's stop ids, masked while it thinks)."""
        try:
            matcher = self._matcher(s.grammar)
        except ValueError as e:
            raise StructuredError(s.field, str(e)) from None
        if s.after_think and self.close_id is None:
            raise StructuredError(s.field, "a grammar after the thinking channel needs <|close|> in the tokenizer")
        return Constraint(matcher, self.close_id if s.after_think else None,
                          sorted(set(stop_ids) | set(self.stop_ids)), frozenset(self.stop_ids))

    def mask(self, logits_nV: torch.Tensor, rows: list[int], constraints: list[Constraint]) -> torch.Tensor:
        """A copy of the logits (bf16 as float32, which the sampler computes in anyway) with every row in `rows`
        masked by its constraint (-inf where not allowed). A grammar row that allows no token is left as it is
        and its constraint marked failed (the engine then ends that request without taking its token)."""
        out = logits_nV.to(torch.float32 if logits_nV.dtype == torch.bfloat16 else logits_nV.dtype, copy=True)
        live = []
        for r, c in zip(rows, constraints, strict=True):
            if not c.in_grammar:
                out[r, c.ban_ids] = float("-inf")
            elif c.error is None:
                live.append((r, c))
        if not live:
            return out
        blocked, stuck = self._blocked([c.matcher for _, c in live], out.shape[-1])
        values = out.numpy() if out.device.type == "cpu" else None  # numpy's masked copy is ~2x torch's here
        for k, (r, c) in enumerate(live):
            if stuck[k]:
                c.error = short(c.matcher.get_error()) or "the grammar allows no next token"
            elif values is not None:
                np.copyto(values[r], -np.inf, where=blocked[k])
            else:
                out[r].masked_fill_(torch.from_numpy(blocked[k]).to(out.device), float("-inf"))
        return out

    def _blocked(self, matchers: list, V: int) -> tuple[np.ndarray, np.ndarray]:
        """([len(matchers), V] bool: True for the ids each matcher does not allow next, and every id past the
        tokenizer's vocabulary; [len(matchers)] bool: the matchers that allow nothing)."""
        n = len(matchers)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = np.zeros((max(n, 16), self._words), dtype=np.int32)
        bm = self._bitmask
        if n == 1:
            matchers[0].unsafe_compute_mask_ptr(bm.ctypes.data, self._words * 4)
        else:  # llguidance computes the rows in parallel, outside the GIL
            if self._executor is None:
                self._executor = llg().LLExecutor()
            self._executor.unsafe_compute_mask_ptr([(m, k) for k, m in enumerate(matchers)], bm.ctypes.data,
                                                   self._words * 4, bm.shape[0])
        bits = np.unpackbits(bm[:n].view(np.uint8), axis=-1, bitorder="little")
        blocked = bits[:, :V] == 0
        if blocked.shape[-1] < V:
            blocked = np.pad(blocked, ((0, 0), (0, V - blocked.shape[-1])), constant_values=True)
        return blocked, ~bm[:n].any(axis=1)


class Constraint:
    """One request's grammar state. Before `in_grammar` (a thinking request still in its reasoning) only
    `ban_ids` are masked; the first `<|close|>` (close_id) starts the grammar at the next token. `done`: the
    grammar has ended and its end-of-sequence token was taken (the engine stops the request even when that
    token is not one of its stop ids, with `ignore_eos`)."""

    def __init__(self, matcher, close_id: int | None, ban_ids: list[int], end_ids: frozenset[int]) -> None:
        self.matcher = matcher
        self.close_id = close_id
        self.in_grammar = close_id is None
        self.ban_ids = ban_ids
        self.end_ids = end_ids  # the grammar's end-of-sequence ids (the tokenizer's stop ids)
        self.error: str | None = None
        self.done = False

    def consume(self, tok: int) -> None:
        """Take the sampled token; sets `done` once the grammar has ended (its end-of-sequence token taken)
        and `error` when the grammar cannot take it."""
        if not self.in_grammar:
            self.in_grammar = tok == self.close_id
            return
        if not self.matcher.consume_token(tok):
            self.error = short(self.matcher.get_error()) or f"the grammar cannot take token {tok}"
        elif tok in self.end_ids and self.matcher.is_stopped():
            self.done = True


_GRAMMARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GRAMMARS_LOCK = threading.Lock()


def grammars_for(tok) -> Grammars:
    """The `Grammars` of a tokenizer, built on first use and kept while the tokenizer lives."""
    with _GRAMMARS_LOCK:
        g = _GRAMMARS.get(tok)
        if g is None:
            g = _GRAMMARS[tok] = Grammars(tok)
        return g
