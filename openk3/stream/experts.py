"""`StreamedExperts`: a MoE layer's routed experts left on disk and computed from an `ExpertCache`.

`SparseMoE` dispatches here when its `experts` has `stream_run` (model/moe.py never imports this module). The
arithmetic is the in-memory packed path's, bit for bit (tests/test_stream.py): the same choice between the
MXFP4 kernel and per-expert dequantisation (`SparseMoE._packed_experts`), experts in ascending id order, each
output row summed expert by expert. A layer call runs in windows of at most its quota of experts (ascending);
within a window, each run of consecutive experts whose bytes are in goes to the kernel at once
(`experts_mxfp4_table` over that id range, accumulating), so cached experts compute while later ones are read.
`prefetch` (called by `SparseMoE` right after routing) starts the first window's reads before the latent
projection and the shared experts run. Scale bytes were checked as each read landed (`ExpertCache`), so the
kernel's and the dequantiser's own NaN-scale checks never fire on streamed experts.

Legend: N tokens, C expert width (latent), I expert hidden width, E experts, K top-k.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from openk3.ops import moe_mxfp4_cpu
from openk3.ops.moe import Glu
from openk3.quant.mxfp4 import unpack
from openk3.stream.cache import ExpertCache


class StreamedExperts(nn.Module):
    """Layer `layer`'s routed experts, read on demand from `cache`. Holds no tensors of its own."""

    def __init__(self, cache: ExpertCache, layer: int, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.cache, self.layer = cache, layer
        self.num_experts, self.dim, self.hidden = num_experts, dim, hidden
        self._call: _Call | None = None

    def extra_repr(self) -> str:
        return f"layer={self.layer}, experts={self.num_experts}, dim={self.dim}, hidden={self.hidden}, streamed"

    def prefetch(self, idx_NK: torch.Tensor) -> None:
        """Start reading this call's first window (SparseMoE calls it right after routing)."""
        if self._call is not None:
            self._call.close()
        self._call = _Call(self, torch.unique(idx_NK).tolist())

    def stream_run(self, z_NC: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor, glu: Glu, act: tuple,
                   use_kernel: bool) -> torch.Tensor:
        """The routed experts' weighted sum [N, C], as `SparseMoE._packed_experts` computes it in memory."""
        call, self._call = self._call, None
        if call is None:
            call = _Call(self, torch.unique(idx_NK).tolist())
        try:
            if use_kernel:
                out = None
                for lo, hi in call.runs():
                    out = moe_mxfp4_cpu.experts_mxfp4_table(z_NC, w_NK, idx_NK, self.cache.table(self.layer),
                                                            self.hidden, *act, lo, hi, out)
                return out if out is not None else torch.zeros_like(z_NC)
            from openk3.model.packed_experts import experts_packed

            return experts_packed(z_NC, w_NK, idx_NK, call, glu, z_NC.dtype)
        finally:
            call.close()


class _Call:
    """One layer call: its needed experts (ascending), walked in windows of at most the layer's quota. Doubles as
    the `packed` argument of `experts_packed` (num_experts, dequant), which visits the experts in ascending order."""

    def __init__(self, owner: StreamedExperts, needed: list[int]) -> None:
        self.owner, self.cache, self.layer = owner, owner.cache, owner.layer
        self.num_experts = owner.num_experts
        self.needed = needed
        self.pos = 0  # needed[:pos] acquired so far
        self.window: list[int] = []
        self.done = 0  # experts of the window already handed out
        self._next_window()

    def _next_window(self) -> None:
        if self.window:
            self.cache.release(self.layer, self.window)
        q = self.cache.quota(self.layer)
        self.window = self.needed[self.pos:self.pos + q]
        self.pos += len(self.window)
        self.done = 0
        if self.window:
            self.cache.acquire(self.layer, self.window)

    def runs(self):
        """(lo, hi) id ranges of experts whose bytes are in, ascending, covering every needed expert."""
        while self.window:
            w, i = self.window, self.done
            self.cache.wait(self.layer, w[i])
            j = i + 1
            while j < len(w) and self.cache.ready(self.layer, w[j]):
                self.cache.wait(self.layer, w[j])
                j += 1
            self.done = j
            yield w[i], w[j - 1] + 1
            if j == len(w):
                self._next_window()

    def dequant(self, e: int, dtype: torch.dtype):
        """Expert e's (w1 [I, C], w3 [I, C], w2 [C, I]) in `dtype` from its slot (experts_packed's call)."""
        while e not in self.window[self.done:]:
            self._next_window()
            if not self.window:
                raise AssertionError(f"expert {e} is not among this call's experts")
        self.done = self.window.index(e) + 1
        slot = self.cache.wait(self.layer, e)
        raw = self.cache.slot_tensor(slot)
        off = self.cache.index.tensor_offsets[self.layer][e].tolist()
        C, I = self.owner.dim, self.owner.hidden
        shapes = ((I, C // 2), (I, C // 32), (I, C // 2), (I, C // 32), (C, I // 2), (C, I // 32))
        t = [raw[o:o + r * c].view(r, c) for o, (r, c) in zip(off, shapes, strict=True)]
        return unpack(t[0], t[1], dtype), unpack(t[2], t[3], dtype), unpack(t[4], t[5], dtype)

    def close(self) -> None:
        """Release what is still pinned (also after an error). Reads still in flight stay `loading` in the cache
        (never evicted until they land), so unpinning here cannot let a slot be reused under a read."""
        window, self.window = self.window, []
        if window:
            self.cache.release(self.layer, window)
