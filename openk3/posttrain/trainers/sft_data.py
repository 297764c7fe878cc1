"""SFT data: JSONL conversations -> token ids with the assistant-channel loss mask -> packed batches.

    convs, stats = load_conversations(["sft.jsonl"], tok, seq_len=1024)
    loader = SFTLoader(convs, batch_size=8, seq_len=1024, seed=0, pad_id=tok.pad_id or 0)
    batch = loader.next()     # {"input_ids", "labels", "seg"}, each [B, T]

Lines: one JSON object each, in either shape
  - a post-training record (`openk3.posttrain.domains.records`; recognised by its "domain" or "effort" field),
    checked by `validate_record` and rendered by `render_request` (its messages, tools and effort); only
    the "split"s asked for are read (default train), the others are counted as skipped;
  - a plain OpenAI chat line: "messages", optional "tools", and the renderer's thinking options
    ("thinking_effort", "reasoning_effort", "thinking", "enable_thinking"; none given: effort max).
Blank lines are skipped. Anything else -- not JSON, not an object, a missing or mistyped field, a
conversation the renderer refuses -- is a ValueError naming `file:line` and the field.

Encoding: `openk3.chat.render(request | add_generation_prompt=False)` then `encode_segments`: each
conversation is `ids` plus `mask`, the renderer's loss mask per token (true exactly on the assistant
channels, from `<|open|>think`/`<|open|>response` through `<|close|>message<|sep|><|end_of_msg|>`;
never an assistant header, system, user or tool text). Inside a row a conversation of L ids takes L
positions: input i is ids[i], label i is ids[i + 1] where mask[i + 1] is true, else -100 (so the last
position of a conversation never has a label: nothing after it belongs to it). A conversation longer
than `seq_len` is dropped and counted (`overflow="drop"`, the default), or cut to its first `seq_len`
ids (`overflow="truncate"`); one with no trained id (no assistant message, or truncated before the
first one) is dropped and counted.

Packing (`SFTLoader`): each epoch visits the conversations in the order
`np.random.default_rng([seed, epoch]).permutation(N)` and packs them into rows of `seq_len`, best-fit by
default (each goes into the row with the least room that still fits it, else a new row; `packing="next_fit"`:
a conversation that does not fit in the open row starts a new one, what runs before the option used).
`seg` numbers the conversations of a row 0, 1, ...; padding (input `pad_id`, label -100) gets one past
the last, so with `seg` passed to the model (KDA state reset, block-diagonal causal MLA) no conversation
sees or predicts another.
A step takes `batch_size` consecutive rows; the last batch of an epoch is filled up with padding rows
(every conversation is trained on once per epoch; the loss is normalised by labelled tokens, so
padding rows weigh nothing). `state_dict()` = (epoch, position in rows, seed, seq_len, fingerprint of
the encoded data, packing); `load_state_dict` refuses a state whose data, seq_len or packing differ (a state
without packing was saved before the option and packed next-fit).
"""

from __future__ import annotations

import bisect
import hashlib
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from openk3.ops.loss import IGNORE_INDEX
from openk3.posttrain.domains.records import SPLITS

OVERFLOW = ("drop", "truncate")
PACKING = ("best_fit", "next_fit")
LEGACY_PACKING = "next_fit"  # what runs saved before the packing option packed
#: Request keys a plain chat line may carry through to the renderer.
CHAT_OPTIONS = ("tools", "thinking_effort", "reasoning_effort", "thinking", "enable_thinking")


@dataclass(frozen=True)
class Conversation:
    """One encoded conversation: token ids, per-token loss mask, and where it came from (`file:line`)."""

    ids: np.ndarray  # int64 [L]
    mask: np.ndarray  # bool [L]
    source: str

    def __len__(self) -> int:
        return len(self.ids)

    def labels(self) -> np.ndarray:
        """Next-token labels of the positions (module docstring): -100 where the next id is not trained."""
        out = np.full(len(self.ids), IGNORE_INDEX, dtype=np.int64)
        out[:-1] = np.where(self.mask[1:], self.ids[1:], IGNORE_INDEX)
        return out


@dataclass
class DataStats:
    """What `load_conversations` kept and dropped (counts; `tokens` and `trained_tokens` of the kept)."""

    kept: int = 0
    too_long: int = 0
    truncated: int = 0
    no_target: int = 0
    other_split: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    trained_tokens: int = 0

    def describe(self) -> str:
        parts = [f"{self.kept} conversations ({self.tokens:,} tokens, {self.trained_tokens:,} trained)"]
        if self.too_long:
            parts.append(f"{self.too_long} dropped as longer than seq_len (overflow=truncate keeps their start)")
        if self.truncated:
            parts.append(f"{self.truncated} truncated to seq_len")
        if self.no_target:
            parts.append(f"{self.no_target} dropped with no assistant tokens to learn")
        for split, n in sorted(self.other_split.items()):
            parts.append(f"{n} skipped in split {split!r}")
        return "; ".join(parts)


def parse_line(text: str, where: str, splits: tuple[str, ...] = ("train",)) -> tuple[dict | None, str | None]:
    """(render request, split) of one JSONL line; the request is None when its split is not asked for.
    A line that is not a usable conversation is a ValueError naming `where` and the field."""
    from openk3.fsutil import parse_json

    obj = parse_json(text, where)  # malformed or too deeply nested: a ValueError naming `where`
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if "domain" in obj or "effort" in obj:  # a post-training record: its own format's checks and rendering
        from openk3.posttrain.domains.records import render_request, validate_record

        try:
            validate_record(obj)
        except ValueError as e:  # names the record and the field ("record 'x': effort must be one of ...")
            raise ValueError(f"{where}: {e}") from None
        if obj["split"] not in splits:
            return None, obj["split"]
        return render_request(obj), obj["split"]
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: field 'messages' must be a non-empty list, got {messages!r:.80}")
    tools = obj.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"{where}: field 'tools' must be a list of tool schemas, got {type(tools).__name__}")
    request = {k: obj[k] for k in CHAT_OPTIONS if k in obj}
    return dict(request, messages=messages, add_generation_prompt=False), None


def encode_request(request: dict, tok, where: str) -> tuple[list[int], list[bool]]:
    """(ids, loss mask) of a render request; the renderer's ValueError prefixed with `where`."""
    from openk3.chat import encode_segments, render

    try:
        segments = render(request)
    except ValueError as e:  # the renderer names the message ("messages[3] tool_calls[0]: ...")
        raise ValueError(f"{where}: {e}") from None
    ids, mask = encode_segments(segments, tok)
    return ids, mask


def load_conversations(paths, tok, *, seq_len: int, overflow: str = "drop",
                       splits: tuple[str, ...] = ("train",)) -> tuple[list[Conversation], DataStats]:
    """Every conversation of the JSONL files `paths`, encoded and filtered (module docstring)."""
    from openk3.fsutil import decode_utf8

    if overflow not in OVERFLOW:
        raise ValueError(f"overflow must be one of {OVERFLOW}, got {overflow!r}")
    bad = [s for s in splits if s not in SPLITS]
    if bad or not splits:
        raise ValueError(f"splits must be a non-empty subset of {SPLITS}, got {tuple(splits)!r}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (one input and one label), got {seq_len}")
    vocab = tok.vocab_size
    convs: list[Conversation] = []
    stats = DataStats()
    for path in paths:
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no such data file (give JSONL files of conversations)")
        with open(path, "rb") as fh:  # decoded line by line: bytes that are not UTF-8 are named by file:line
            for lineno, raw in enumerate(fh, start=1):
                where = f"{path}:{lineno}"
                line = decode_utf8(raw, where)
                if not line.strip():
                    continue
                request, split = parse_line(line, where, splits)
                if request is None:
                    stats.other_split[split] = stats.other_split.get(split, 0) + 1
                    continue
                ids, mask = encode_request(request, tok, where)
                if len(ids) > seq_len:
                    if overflow == "drop":
                        stats.too_long += 1
                        continue
                    ids, mask = ids[:seq_len], mask[:seq_len]
                    stats.truncated += 1
                # The first id is never a label (nothing predicts it): a mask that is true only there
                # teaches nothing.
                if not any(mask[1:]):
                    stats.no_target += 1
                    continue
                arr = np.asarray(ids, dtype=np.int64)
                assert arr.size == 0 or (0 <= arr.min() and arr.max() < vocab), "tokenizer ids outside its vocab"
                convs.append(Conversation(arr, np.asarray(mask, dtype=bool), where))
                stats.kept += 1
                stats.tokens += len(ids)
                stats.trained_tokens += int(np.count_nonzero(np.asarray(mask[1:])))
    return convs, stats


def fingerprint(convs: list[Conversation]) -> str:
    """sha256 of every conversation's ids and mask, in order: a resumed loader must see the same data."""
    h = hashlib.sha256()
    for c in convs:
        h.update(len(c).to_bytes(8, "little"))
        h.update(c.ids.astype("<i8").tobytes())
        h.update(np.packbits(c.mask).tobytes())
    return h.hexdigest()


def pack(lengths: list[int], order: np.ndarray, seq_len: int, method: str = "best_fit") -> list[list[int]]:
    """Pack conversations `order` (indices into `lengths`, visited in that order) into rows of `seq_len`; the
    rows, in the order they were opened, as lists of conversation indices.

    `next_fit`: a conversation that does not fit in the open row starts a new one. `best_fit`: it goes into the
    row with the least room that still fits it (the most recently filled to that room on a tie), else a new
    row. Best-fit leaves far less padding when conversations are long beside `seq_len` (issue 18's smoke SFT:
    1-2.8k-token agent and coding conversations in 2,048-token rows: 71-76 rows an epoch next-fit, 55
    best-fit, for 111k tokens), and which conversations share a row still follows the shuffled order. Rows
    are kept by their free room (a sorted list of the distinct values, at most `seq_len`), so a conversation
    costs a bisection, not a scan of the rows.
    """
    if method not in PACKING:
        raise ValueError(f"packing must be one of {PACKING}, got {method!r}")
    rows: list[list[int]] = []
    if method == "next_fit":
        used = seq_len  # no open row yet
        for i in order.tolist():
            n = lengths[i]
            assert n <= seq_len, "conversations are filtered to seq_len before packing"
            if used + n > seq_len:
                rows.append([])
                used = 0
            rows[-1].append(i)
            used += n
        return rows
    rooms: list[int] = []  # sorted distinct free room of the rows that have some
    rows_with: dict[int, list[int]] = {}  # free room -> rows with exactly that room
    for i in order.tolist():
        n = lengths[i]
        assert n <= seq_len, "conversations are filtered to seq_len before packing"
        k = bisect.bisect_left(rooms, n)
        if k < len(rooms):
            room = rooms[k]
            r = rows_with[room].pop()
            if not rows_with[room]:
                del rows_with[room]
                rooms.pop(k)
        else:
            room, r = seq_len, len(rows)
            rows.append([])
        rows[r].append(i)
        room -= n
        if room > 0:
            if room not in rows_with:
                rows_with[room] = []
                bisect.insort(rooms, room)
            rows_with[room].append(r)
    return rows


def make_batch(convs: list[Conversation], rows: list[list[int]], batch_size: int, seq_len: int,
               pad_id: int) -> dict[str, torch.Tensor]:
    """`batch_size` rows of packed conversations (missing rows are all padding): input_ids, labels, seg."""
    B, T = batch_size, seq_len
    ids = np.full((B, T), pad_id, dtype=np.int64)
    labels = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
    seg = np.zeros((B, T), dtype=np.int64)
    for b, row in enumerate(rows):
        at = 0
        for k, i in enumerate(row):
            c = convs[i]
            n = len(c)
            ids[b, at:at + n] = c.ids
            labels[b, at:at + n] = c.labels()
            seg[b, at:at + n] = k
            at += n
        seg[b, at:] = len(row)  # padding is its own document
    return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels), "seg": torch.from_numpy(seg)}


class SFTLoader:
    """Seeded, resumable batches of packed conversations (module docstring)."""

    def __init__(self, convs: list[Conversation], batch_size: int, seq_len: int, seed: int = 0, *,
                 pad_id: int = 0, packing: str = "best_fit") -> None:
        if not convs:
            raise ValueError("no conversations to train on")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.convs, self.batch_size, self.seq_len = convs, batch_size, seq_len
        if packing not in PACKING:
            raise ValueError(f"packing must be one of {PACKING}, got {packing!r}")
        self.seed, self.pad_id, self.packing = int(seed), pad_id, packing
        self.lengths = [len(c) for c in convs]
        self.fingerprint = fingerprint(convs)
        self.epoch = 0
        self.position = 0  # rows of the current epoch already served
        self._rows: dict[int, list[list[int]]] = {}

    def rows(self, epoch: int) -> list[list[int]]:
        """The packed rows of `epoch` (conversation indices), in visiting order."""
        if epoch not in self._rows:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.convs))
            self._rows = {epoch: pack(self.lengths, order, self.seq_len, self.packing)}  # keep one epoch in memory
        return self._rows[epoch]

    def steps_in_epoch(self, epoch: int) -> int:
        rows = self.rows(epoch)
        return math.ceil(len(rows) / self.batch_size)

    def steps_for_epochs(self, epochs: int) -> int:
        """Optimizer steps that train on every conversation `epochs` times."""
        return sum(self.steps_in_epoch(e) for e in range(epochs))

    def next(self) -> dict[str, torch.Tensor]:
        if self.position >= len(self.rows(self.epoch)):
            self.epoch += 1
            self.position = 0
        rows = self.rows(self.epoch)[self.position:self.position + self.batch_size]
        self.position += self.batch_size
        return make_batch(self.convs, rows, self.batch_size, self.seq_len, self.pad_id)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "seq_len": self.seq_len,
                "fingerprint": self.fingerprint, "packing": self.packing}

    def load_state_dict(self, state: dict) -> None:
        if int(state["seq_len"]) != self.seq_len:
            raise ValueError(f"loader state is for seq_len={state['seq_len']}, this run has {self.seq_len}")
        if state["fingerprint"] != self.fingerprint:
            raise ValueError("the SFT data differ from the data the checkpoint was trained on (their token "
                             "fingerprints differ): the rows would not match; restore the data files or choose a "
                             "new --out")
        packed = state.get("packing", LEGACY_PACKING)
        if packed != self.packing:
            raise ValueError(f"the checkpoint's rows were packed {packed}, this run asks for {self.packing}: packing "
                             f"cannot change when a run resumes (the epoch in progress and the step count would no "
                             f"longer match); give packing={packed}, or start a new --out")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])


def eval_batches(convs: list[Conversation], batch_size: int, seq_len: int, pad_id: int = 0):
    """The conversations in file order, packed next-fit, as batches (every conversation once)."""
    rows = pack([len(c) for c in convs], np.arange(len(convs)), seq_len, "next_fit")
    for i in range(0, len(rows), batch_size):
        yield make_batch(convs, rows[i:i + batch_size], batch_size, seq_len, pad_id)
