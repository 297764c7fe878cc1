"""A per-layer cache of whole routed experts, filled from disk (`Reader`), with counters.

Why per layer: a decode step walks the MoE layers in order, so a single LRU over all layers smaller than one
token's working set (16 experts x 92 layers = 25.8 GB in K3) evicts every expert before its layer comes back
and keeps nothing (a C port measured 0 % from 28 to 1,344 slots). Each layer instead owns `quota` slots and
runs LRU among its own experts; what a layer keeps is then about reuse x quota / top-k.

Quotas start equal and follow the observed hits (`rebalance`): a miss on an expert the layer evicted recently
(its ghost list, as long as its quota) says one more slot would have hit; a hit on one of the layer's
least-recent experts says one fewer would have missed. Every `rebalance_every` layer calls one slot moves from
the layer whose oldest experts are hit least to the one with the most ghost hits, when that gains.

The memory is one anonymous mapping (page-aligned, so O_DIRECT reads land in it directly) of `slots` x
`slot_bytes`; a slot holds one expert at the offsets of `ExpertIndex`. Experts in use are pinned and never
evicted; an expert being read is in its slot already (pinned until its reader waits for it). Each layer keeps a
[E, 6] int64 table of its resident experts' tensor addresses for the MXFP4 kernel (zeros elsewhere).

Counters (`stats()`): requests (a layer call's distinct experts), hits, reads (misses, every read counts: the
hit rate is 1 - reads / requests), bytes read, stall seconds (the compute thread waiting for reads), read
seconds (summed over I/O threads).
"""

from __future__ import annotations

import mmap
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from openk3.stream.index import ExpertIndex
from openk3.stream.io import ExpertReadError, Reader


@dataclass
class LayerStats:
    requests: int = 0
    hits: int = 0
    reads: int = 0
    ghost_hits: int = 0  # misses on an expert evicted within the last `quota` evictions
    tail_hits: int = 0  # hits on one of the least-recent quarter of the layer's experts


@dataclass
class _Layer:
    quota: int  # slots this layer owns: those of `resident` plus `free`
    free: list[int] = field(default_factory=list)  # owned, empty
    resident: OrderedDict = field(default_factory=OrderedDict)  # expert -> slot, least recent first
    loading: dict = field(default_factory=dict)  # expert -> Future of its read
    pins: dict = field(default_factory=dict)  # expert -> count
    ghosts: deque = field(default_factory=deque)
    stats: LayerStats = field(default_factory=LayerStats)
    table: torch.Tensor | None = None  # [E, 6] int64 tensor addresses of resident, loaded experts


class ExpertCache:
    """`slots` cache slots over `index`'s MoE layers, filled by `reader`. `cache_bytes` is the budget: slots =
    cache_bytes // slot_bytes, at least one per MoE layer (ValueError naming the minimum otherwise)."""

    def __init__(self, index: ExpertIndex, reader: Reader, cache_bytes: int, *, rebalance_every: int | None = None,
                 max_scale_byte: int = 252):
        self.index, self.reader = index, reader
        # E8M0 scale bytes above this are refused as each read lands (255 is NaN; above ~252 the weights overflow
        # the compute dtype): the check `load` makes for in-memory experts, made here for streamed ones
        self.max_scale_byte = max_scale_byte
        n_layers = len(index.layers)
        slots = cache_bytes // index.slot_bytes
        if slots < n_layers:
            raise ValueError(f"expert cache of {cache_bytes:,} bytes holds {slots} experts of {index.slot_bytes:,} "
                             f"bytes; streaming needs at least one per MoE layer ({n_layers}): at least "
                             f"{n_layers * index.slot_bytes:,} bytes")
        self.slots = slots
        self.slot_bytes = index.slot_bytes
        self._mem = mmap.mmap(-1, slots * self.slot_bytes)  # anonymous: page-aligned, zero-filled, lazily backed
        self._mv = memoryview(self._mem)
        self._base = torch.frombuffer(self._mem, dtype=torch.uint8)
        self.base_address = self._base.data_ptr()
        self.rebalance_every = rebalance_every if rebalance_every is not None else 4 * n_layers
        self._calls = 0
        self.stall_seconds = 0.0
        self.layers: dict[int, _Layer] = {}
        per, extra = divmod(slots, n_layers)
        next_slot = 0
        for i, layer in enumerate(index.layers):
            q = per + (i < extra)
            ids = list(range(next_slot, next_slot + q))
            next_slot += q
            self.layers[layer] = _Layer(q, list(reversed(ids)), table=torch.zeros(index.num_experts, 6,
                                                                                  dtype=torch.int64))

    # ---- the call protocol: acquire a window, wait for its experts in order, release ---------------------

    def quota(self, layer: int) -> int:
        return self.layers[layer].quota

    def acquire(self, layer: int, experts: list[int]) -> None:
        """Pin `experts` (ascending, distinct, at most `quota(layer)`) in `layer`'s slots, reading the missing ones
        (submitted in file-offset order). Counts requests, hits and reads."""
        L = self.layers[layer]
        assert len(experts) <= L.quota, (len(experts), L.quota)
        misses = []
        tail = set(list(L.resident)[:L.quota // 4 + 1]) if L.resident else set()
        pinned: list[int] = []
        for e in experts:
            self._settle(layer, e)  # a read that failed in an earlier call (never waited for) is a miss now
        try:
            for e in experts:
                L.pins[e] = L.pins.get(e, 0) + 1
                pinned.append(e)
                if e not in L.resident:
                    misses.append(e)
            for e in misses:
                slot = L.free.pop() if L.free else self._evict(layer)
                L.resident[e] = slot
            for e in sorted(misses, key=lambda e: self.index.loc(layer, e).first_offset):
                L.loading[e] = self.reader.submit(self._read, layer, e, self._slot_mv(L.resident[e]))
        except BaseException:  # nothing half-done stays: unsubmitted misses leave, the window is unpinned
            for e in misses:
                if e in L.resident and e not in L.loading:
                    L.free.append(L.resident.pop(e))
            self._unpin(L, pinned)
            raise
        for e in experts:  # counted once the window is in place
            L.stats.requests += 1
            if e in misses:
                L.stats.reads += 1
                L.stats.ghost_hits += e in L.ghosts
            else:
                L.stats.hits += 1
                L.stats.tail_hits += e in tail
                L.resident.move_to_end(e)

    def _read(self, layer: int, e: int, slot_mv: memoryview) -> None:
        """On an I/O thread: the expert's extents into its slot, then its scale bytes checked."""
        loc = self.index.loc(layer, e)
        self.reader.read(loc.extents, slot_mv)
        C, I = self.index.dim, self.index.hidden
        for k, n in ((1, I * C // 32), (3, I * C // 32), (5, C * I // 32)):
            o = loc.tensor_offsets[k]
            scales = torch.frombuffer(slot_mv, dtype=torch.uint8, count=n, offset=o)
            if int(scales.max()) > self.max_scale_byte:
                pos = o + int((scales > self.max_scale_byte).nonzero()[0])
                x = next(x for x in loc.extents if x.region + x.pad <= pos < x.region + x.pad + x.length)
                at = x.offset + pos - x.region - x.pad
                byte = int(scales[pos - o])
                what = ("(E8M0 NaN); refusing to produce NaN weights" if byte == 255 else
                        f"(2^{byte - 127}: weights too large for the compute dtype, whose limit is byte "
                        f"{self.max_scale_byte}); refusing to produce inf")
                raise ExpertReadError(f"{self.index.folder / x.file}: MXFP4 scale byte {byte} {what} at offset {at} "
                                      f"(layer {layer}, expert {e})")

    def ready(self, layer: int, e: int) -> bool:
        f = self.layers[layer].loading.get(e)
        return f is None or f.done()

    def wait(self, layer: int, e: int) -> int:
        """Expert e's slot once its bytes are in (a pinned expert of `layer`); a failed read raises its
        `ExpertReadError` and frees the slot."""
        L = self.layers[layer]
        f: Future | None = L.loading.get(e)
        if f is not None:
            t0 = time.perf_counter()
            try:
                f.result()
            finally:
                self.stall_seconds += time.perf_counter() - t0
                # done: the table row set, or a failed read's slot freed (its error raises on). Interrupted while
                # the read is still in flight (Ctrl-C): it stays `loading`, so the slot is not reused under it.
                self._settle(layer, e)
        return L.resident[e]

    def release(self, layer: int, experts: list[int]) -> None:
        self._unpin(self.layers[layer], experts)
        self._calls += 1
        if self._calls % self.rebalance_every == 0 and not any(x.pins or x.loading for x in self.layers.values()):
            self.rebalance()

    @staticmethod
    def _unpin(L: _Layer, experts: list[int]) -> None:
        for e in experts:
            n = L.pins.get(e, 0) - 1
            if n > 0:
                L.pins[e] = n
            else:
                L.pins.pop(e, None)

    def slot_tensor(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s bytes (uint8 [slot_bytes], a view of the cache)."""
        return self._base[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]

    def table(self, layer: int) -> torch.Tensor:
        return self.layers[layer].table

    # ---- eviction and quotas -------------------------------------------------------------------------------

    def _settle(self, layer: int, e: int) -> None:
        """A finished read of expert e not yet waited for: done (table row set) or failed (slot freed)."""
        L = self.layers[layer]
        f = L.loading.get(e)
        if f is None or not f.done():
            return
        del L.loading[e]
        if f.exception() is not None:
            L.free.append(L.resident.pop(e))
        else:
            L.table[e] = self.index.tensor_offsets[layer][e] + (self.base_address + L.resident[e] * self.slot_bytes)

    def _evict(self, layer: int) -> int:
        """The least-recent unpinned, loaded expert of `layer` leaves; its slot is returned."""
        L = self.layers[layer]
        for e in [e for e in L.loading if e not in L.pins]:
            self._settle(layer, e)
        if L.free:
            return L.free.pop()
        for e in L.resident:
            if e not in L.pins and e not in L.loading:
                slot = L.resident.pop(e)
                L.table[e] = 0
                L.ghosts.append(e)
                while len(L.ghosts) > L.quota:
                    L.ghosts.popleft()
                return slot
        for e in [e for e in L.loading if e not in L.pins]:  # only reads in flight left (after an interrupt):
            try:  # the first to land gives its slot
                L.loading[e].result()
            except Exception:  # noqa: BLE001 - a failed read frees its slot just the same (`_settle`)
                pass
            self._settle(layer, e)
            return self._evict(layer)
        raise AssertionError(f"layer {layer}: every slot is pinned (quota {L.quota})")

    def _give_slot(self, donor: int) -> int:
        L = self.layers[donor]
        slot = L.free.pop() if L.free else self._evict(donor)
        L.quota -= 1
        return slot

    def rebalance(self) -> bool:
        """Move one slot from the layer whose oldest experts are hit least to the layer with the most ghost hits,
        when the receiver's ghost hits exceed the donor's tail hits; halve the counters. True if a slot moved.
        Only between calls (nothing pinned or loading)."""
        ls = self.layers
        recv = max(ls, key=lambda k: ls[k].stats.ghost_hits)
        donors = [k for k in ls if k != recv and ls[k].quota > 1]
        moved = False
        if donors:
            donor = min(donors, key=lambda k: ls[k].stats.tail_hits)
            if ls[recv].stats.ghost_hits > ls[donor].stats.tail_hits:
                slot = self._give_slot(donor)
                ls[recv].free.append(slot)
                ls[recv].quota += 1
                moved = True
        for x in ls.values():
            x.stats.ghost_hits //= 2
            x.stats.tail_hits //= 2
        return moved

    # ---- reporting -----------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Totals and per-layer figures; hit_rate = 1 - reads / requests."""
        req = sum(x.stats.requests for x in self.layers.values())
        reads = sum(x.stats.reads for x in self.layers.values())
        return {
            "requests": req, "hits": sum(x.stats.hits for x in self.layers.values()), "reads": reads,
            "bytes_read": self.reader.bytes_read, "hit_rate": 1 - reads / req if req else 0.0,
            "stall_seconds": self.stall_seconds, "read_seconds": self.reader.read_seconds,
            "slots": self.slots, "slot_bytes": self.slot_bytes, "cache_bytes": self.slots * self.slot_bytes,
            "io_threads": self.reader.threads, "direct_io": bool(self.reader.direct_files)
            and not self.reader.buffered_files,
            "quotas": {k: x.quota for k, x in self.layers.items()},
        }

    def _slot_mv(self, slot: int) -> memoryview:
        return self._mv[slot * self.slot_bytes:(slot + 1) * self.slot_bytes]

    def close(self) -> None:
        """Stop the I/O threads and close the shards (reads in flight finish first). Idempotent."""
        for L in self.layers.values():
            for f in L.loading.values():
                f.cancel()
        self.reader.close()


__all__ = ["ExpertCache", "ExpertReadError", "LayerStats"]
