"""Prefix snapshots for the engine: prefill a shared prompt prefix once, continue a finished turn.

    cache = PrefixCache(max_entries=64, max_bytes=1 << 30)
    cache.put(ids[:k], dense_cache)          # the decode state after exactly those k tokens (copied)
    hit = cache.lookup(prompt)               # (k, a private copy of the state) for the longest stored
                                             # prefix of `prompt` shorter than it, or None

Why: K3's decode state is a constant-size KDA state per KDA layer plus the MLA latents of the past tokens
(`model/cache.py`), so the state after any prefix is small and exact to store. Two workloads prefill the
same tokens again and again: many requests sharing a long head (a family's tool declarations in eval and RL:
1-1.3k tokens of a 1.5-3k-token agent prompt; RL's group samples of one prompt), and multi-turn episodes whose
next turn is the previous turn's sequence plus the tool results. The engine stores a snapshot where the
caller says a prefix is shared (`add_request(cache_prefix=k)`) and when a request that asks for it
(`keep_cache=True`) finishes; a new request starts from the longest stored prefix of its prompt and only
prefills the rest.

Exactness: the continuation computes the same function as a fresh prefill (chunked prefill at another
boundary); in float64 the logits agree to rounding (tests/test_prefix_cache.py), in fp32 to float noise, so a
greedy near-tie may resolve differently with and without the cache. The key is the token ids themselves, so a
hit is never a collision. Least recently used entries go first when either limit is reached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from openk3.model.cache import DenseCache, KDAState, MLAState


def clone_cache(cache: DenseCache) -> DenseCache:
    """A deep copy of a batch-1 `DenseCache` (MLA buffers trimmed to their length)."""
    layers: list = []
    for st in cache.layers:
        if isinstance(st, KDAState):
            layers.append(KDAState(*(t.clone() for t in st.tensors())))
        elif isinstance(st, MLAState):
            layers.append(MLAState(st.ckv.clone(), st.kpe.clone()))
        else:
            raise AssertionError("a snapshot needs every layer's state")
    return DenseCache(num_layers=cache.num_layers, seq_len=cache.seq_len, layers=layers)


def cache_nbytes(cache: DenseCache) -> int:
    return sum(cache.nbytes().values())


class PrefixCache:
    """LRU store of decode-state snapshots keyed by the exact token ids they follow."""

    def __init__(self, max_entries: int = 64, max_bytes: int = 1 << 30) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError(f"prefix cache limits must be >= 1, got max_entries={max_entries}, "
                             f"max_bytes={max_bytes}")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[tuple[int, ...], tuple[DenseCache, int]] = OrderedDict()
        self.nbytes = 0
        self.stats = {"hits": 0, "misses": 0, "hit_tokens": 0, "stored": 0, "evicted": 0}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, ids: Sequence[int]) -> bool:
        return tuple(ids) in self._entries

    def put(self, ids: Sequence[int], cache: DenseCache, *, copy: bool = True) -> None:
        """Store the state after `ids` (cache.seq_len == len(ids)); a key already stored is refreshed."""
        key = tuple(ids)
        assert cache.seq_len == len(key) > 0, f"snapshot of {cache.seq_len} tokens keyed by {len(key)} ids"
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        snap = clone_cache(cache) if copy else cache
        size = cache_nbytes(snap)
        if size > self.max_bytes:
            return  # larger than the whole budget: storing it would evict everything for one entry
        self._entries[key] = (snap, size)
        self.nbytes += size
        self.stats["stored"] += 1
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            _, (_, gone) = self._entries.popitem(last=False)
            self.nbytes -= gone
            self.stats["evicted"] += 1

    def lookup(self, prompt: Sequence[int]) -> tuple[int, DenseCache] | None:
        """(k, a private copy of the state after prompt[:k]) for the longest stored prefix with k < len(prompt)
        (at least one token is left to prefill: its logits start the generation); None if none."""
        prompt = tuple(prompt)
        best: tuple[int, ...] | None = None
        for key in self._entries:
            k = len(key)
            if k < len(prompt) and (best is None or k > len(best)) and prompt[:k] == key:
                best = key
        if best is None:
            self.stats["misses"] += 1
            return None
        self._entries.move_to_end(best)
        self.stats["hits"] += 1
        self.stats["hit_tokens"] += len(best)
        return len(best), clone_cache(self._entries[best][0])

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0
