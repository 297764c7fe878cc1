"""Packed batches of a `TokenSplit` with document boundaries, and bits-per-byte evaluation.

Windows: a split's stream of N ids is cut into W = (N - 1) // T windows of T + 1 ids starting at
0, T, 2T, ... (consecutive windows share one id, so every id after the first is a label exactly once
per epoch). A row is one window: `input_ids` = its first T ids, `labels` = its last T ids (the next
token), `seg` = the document index of each input position counted from the row's first document
(0, 0, .., 1, 1, ..; from `doc_offsets`), non-decreasing. A label is -100 exactly where the next id
belongs to another document -- at each document's final EOS, whose successor starts the next
document -- so nothing is learned across documents; with `seg` passed to the model (KDA state reset,
block-diagonal causal MLA) nothing is seen across them either. (A document's first id is therefore
never a label; its last real id predicts EOS.)

`PackedLoader` visits the windows of each epoch in the order `np.random.default_rng([seed,
epoch]).permutation(W)`; one step consumes `world_size * batch_size` consecutive entries of it and
rank r takes entries [r * B, (r + 1) * B) of those, so ranks are disjoint. An epoch ends when fewer
than `world_size * batch_size` entries remain (they are skipped: every batch is full and all ranks
step together). `state_dict()` = (epoch, position in windows, seed, seq_len, windows), and
`load_state_dict` resumes exactly; `position` counts windows, so a resume may change batch size or
world size (it continues from the same point of the same permutation).

`eval_batches` walks the windows in stream order, non-overlapping; the last window may be partial
(padded with id 0, labels -100, `seg` one past the last document) and the last batch is padded to
`batch_size` rows with rows that have only -100 labels, so shapes never change. Every label position
of the split is covered exactly once.

bits per byte = summed cross-entropy (nats) / ln 2 / UTF-8 bytes. `evaluate_bpb` counts the bytes of
exactly the tokens it scores: the sum of `token_bytes[label]` (the UTF-8 length of each predicted
id; EOS counts 0 bytes but its loss counts) when the split carries the table (always, for
`build_dataset` splits), otherwise `bytes_per_token * tokens` (an average, stated as approximate).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from openk3.data.shards import TokenSplit
from openk3.ops.loss import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "PackedLoader", "bits_per_byte", "eval_batches", "evaluate_bpb", "make_rows"]



def _check_shape(split: TokenSplit, batch_size: int, seq_len: int) -> None:
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    if split.num_tokens < 2:
        raise ValueError(f"split {split.name!r} has {split.num_tokens} tokens: nothing to predict")


def make_rows(split: TokenSplit, starts: np.ndarray, seq_len: int) -> dict[str, torch.Tensor]:
    """Rows for windows starting at `starts` (see the module docstring). A window running past the end
    of the stream is padded: input id 0, label -100, seg one past its last document."""
    T = seq_len
    starts = np.asarray(starts, dtype=np.int64).reshape(-1)
    B, N = len(starts), split.num_tokens
    x = np.zeros((B, T + 1), dtype=np.int64)
    valid = np.zeros(B, dtype=np.int64)
    for b, s in enumerate(starts.tolist()):
        if not 0 <= s < N:
            raise ValueError(f"window start {s} outside the split's {N} tokens")
        row = split.tokens[s:s + T + 1]
        x[b, :len(row)] = row
        valid[b] = len(row)
    pos = starts[:, None] + np.arange(T + 1)
    doc = np.searchsorted(split.doc_offsets, pos, side="right") - 1  # past the end -> last doc + 1
    real = np.arange(T + 1)[None, :] < valid[:, None]
    last = doc[np.arange(B), valid - 1]
    doc = np.where(real, doc, last[:, None] + 1)
    seg = doc[:, :T] - doc[:, :1]
    same = (doc[:, 1:] == doc[:, :T]) & real[:, 1:]
    labels = np.where(same, x[:, 1:], IGNORE_INDEX)
    return {"input_ids": torch.from_numpy(x[:, :T].copy()), "labels": torch.from_numpy(labels),
            "seg": torch.from_numpy(np.ascontiguousarray(seg))}


class PackedLoader:
    """Seeded, resumable, rank-sharded packed training batches of a split (module docstring)."""

    def __init__(self, split: TokenSplit, batch_size: int, seq_len: int, seed: int = 0, *, rank: int = 0,
                 world_size: int = 1):
        _check_shape(split, batch_size, seq_len)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.split, self.batch_size, self.seq_len = split, batch_size, seq_len
        self.seed, self.rank, self.world_size = int(seed), rank, world_size
        self.num_windows = (split.num_tokens - 1) // seq_len
        if self.num_windows < batch_size * world_size:
            raise ValueError(f"split {split.name!r} has {split.num_tokens} tokens = {self.num_windows} windows of "
                             f"{seq_len}+1, fewer than one step's {batch_size} x {world_size} rows")
        self.epoch = 0
        self.position = 0
        self._perm: np.ndarray | None = None
        self._perm_epoch = -1

    def order(self, epoch: int) -> np.ndarray:
        """Window indices of `epoch`, in visiting order."""
        if self._perm_epoch != epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._perm_epoch = epoch
        return self._perm

    def next(self) -> dict[str, torch.Tensor]:
        step = self.batch_size * self.world_size
        if self.position + step > self.num_windows:
            self.epoch += 1
            self.position = 0
        lo = self.position + self.rank * self.batch_size
        windows = self.order(self.epoch)[lo:lo + self.batch_size]
        self.position += step
        return make_rows(self.split, windows * self.seq_len, self.seq_len)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "seq_len": self.seq_len,
                "num_windows": self.num_windows}

    def load_state_dict(self, state: dict) -> None:
        for name, mine in (("seq_len", self.seq_len), ("num_windows", self.num_windows)):
            if name in state and int(state[name]) != mine:
                raise ValueError(f"loader state is for {name}={state[name]}, this loader has {mine} (different "
                                 "data or sequence length: the window order would not match)")
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._perm_epoch = -1


def eval_batches(split: TokenSplit, batch_size: int, seq_len: int, max_batches: int | None = None, *,
                 rank: int = 0, world_size: int = 1) -> Iterator[dict[str, torch.Tensor]]:
    """The split in stream order as batches (module docstring). With `world_size` > 1, batch i of the
    (max_batches-limited) sequence goes to rank i % world_size."""
    _check_shape(split, batch_size, seq_len)
    n_windows = math.ceil((split.num_tokens - 1) / seq_len)
    n_batches = math.ceil(n_windows / batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    for i in range(rank, n_batches, world_size):
        windows = np.arange(i * batch_size, min((i + 1) * batch_size, n_windows))
        batch = make_rows(split, windows * seq_len, seq_len)
        short = batch_size - len(windows)
        if short:
            pad = {"input_ids": torch.zeros(short, seq_len, dtype=torch.long),
                   "labels": torch.full((short, seq_len), IGNORE_INDEX, dtype=torch.long),
                   "seg": torch.zeros(short, seq_len, dtype=torch.long)}
            batch = {k: torch.cat([v, pad[k]]) for k, v in batch.items()}
        yield batch


def bits_per_byte(total_nats: float, num_bytes: int) -> float:
    """Summed cross-entropy in nats over the UTF-8 bytes it covers, in bits per byte."""
    if num_bytes <= 0:
        raise ValueError(f"num_bytes must be positive, got {num_bytes}")
    return float(total_nats) / math.log(2) / num_bytes


@torch.no_grad()
def evaluate_bpb(model: torch.nn.Module, split: TokenSplit, batch_size: int, seq_len: int,
                 max_batches: int | None = None, *, rank: int = 0, world_size: int = 1,
                 device: torch.device | str | None = None, chunk_rows: int | None = None) -> dict:
    """Summed CE (ignore_index -100) of `model(input_ids, seg_BT=seg)` over `eval_batches`, and bits
    per byte over the bytes of exactly the scored tokens (module docstring). Returns dict(loss (mean
    nats per scored token), bpb, tokens, bytes, nats); with world_size > 1 sum `nats`, `tokens`,
    `bytes` over ranks and recompute. chunk_rows: run each batch through the model this many rows at a time
    (the same sums; the logits of a whole batch need not fit). The model is put in eval mode and restored."""
    if device is None:
        device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nats, tokens, nbytes = 0.0, 0, 0.0
    try:
        for batch in eval_batches(split, batch_size, seq_len, max_batches, rank=rank, world_size=world_size):
            labels = batch["labels"]
            mask = labels != IGNORE_INDEX
            if not bool(mask.any()):
                continue
            step = chunk_rows or labels.shape[0]
            for r in range(0, labels.shape[0], step):
                rows = slice(r, r + step)
                logits = model(batch["input_ids"][rows].to(device), seg_BT=batch["seg"][rows].to(device))
                if logits.dtype in (torch.float16, torch.bfloat16):
                    logits = logits.float()
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                         labels[rows].to(device).reshape(-1),
                                                         ignore_index=IGNORE_INDEX, reduction="sum")
                nats += float(loss)
            tokens += int(mask.sum())
            if split.token_bytes is not None:
                nbytes += int(split.token_bytes[labels[mask].numpy()].sum())
            else:
                nbytes += split.bytes_per_token * int(mask.sum())
    finally:
        model.train(was_training)
    return {"loss": nats / max(1, tokens), "bpb": bits_per_byte(nats, nbytes) if nbytes > 0 else float("nan"),
            "tokens": tokens, "bytes": nbytes, "nats": nats}
