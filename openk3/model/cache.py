"""Per-sequence decode state: what each layer keeps between forward calls (spec §8).

KDA layers keep a constant-size state (recurrent S plus the last `kernel-1` inputs of each short
conv); MLA layers keep the normalised latent and the shared key dims of every past token (576
values per token in K3); AttnRes keeps nothing.

Two containers speak the same protocol to the layers:
- `DenseCache`: a batch of rows that advance together (tests, training samples, one request's
  prefill). Its MLA buffers grow by doubling, so decode appends in amortised O(1).
- `SlotCache` (engine): `max_slots` rows of different lengths; `view(n)` hands the layers the first
  n rows, whose MLA keys are masked per row (`SlotMLAView`). Decode (T == 1) only.

Protocol: a KDA layer reads `conv_q/conv_k/conv_v/recurrent` and, when decoding one token, updates
them in place; an MLA layer calls `state.extend(ckv_BTC, kpe_BTR)` and gets back every key plus the
attention mask. A RoPE MLA layer (`mla_use_nope: false`) first asks `state.positions(T)` for the positions
of its new tokens, [B or 1, T]: the cache index each is written at, which is also what the mask counts
(so the cached `kpe` is already rotated, as in DeepSeek-V3).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from openk3.ops import mla as mla_ops


class KDAState:
    """conv: last kernel-1 projected inputs of the q, k and v convs side by side [B, kernel-1, 3P];
    recurrent: [B, H, K, V] fp32. One conv tensor lets decode run the three convs as one op."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        self.conv, self.recurrent = conv, recurrent

    @property
    def conv_q(self) -> torch.Tensor:
        return self.conv.chunk(3, dim=-1)[0]

    @property
    def conv_k(self) -> torch.Tensor:
        return self.conv.chunk(3, dim=-1)[1]

    @property
    def conv_v(self) -> torch.Tensor:
        return self.conv.chunk(3, dim=-1)[2]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv, self.recurrent

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def grow_tokens(t_BSC: torch.Tensor, keep: int, capacity: int) -> torch.Tensor:
    """A zeroed [B, capacity, C] buffer holding the first `keep` token positions of `t_BSC`.

    Zeros, not empty: masked key positions are multiplied by 0 in attention, so they must be finite.
    """
    grown = t_BSC.new_zeros(t_BSC.shape[0], capacity, t_BSC.shape[2])
    grown[:, :keep] = t_BSC[:, :keep]
    return grown


class MLAState:
    """MLA latent cache of rows of equal length: ckv [B, S, C] (normalised latent), kpe [B, S, Dr].

    Storage has spare capacity (doubling), so appending a decode token copies one row, not the cache.
    """

    def __init__(self, ckv: torch.Tensor, kpe: torch.Tensor) -> None:
        self._ckv, self._kpe, self.length = ckv, kpe, ckv.shape[1]

    @property
    def ckv(self) -> torch.Tensor:
        return self._ckv[:, :self.length]

    @property
    def kpe(self) -> torch.Tensor:
        return self._kpe[:, :self.length]

    def _reserve(self, needed: int) -> None:
        cap = self._ckv.shape[1]
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap, 16)
        self._ckv, self._kpe = (grow_tokens(t, self.length, new_cap) for t in (self._ckv, self._kpe))

    def positions(self, num_tokens: int) -> torch.Tensor:
        """[1, T] positions of the next `num_tokens` tokens: every row has `length` tokens already."""
        return torch.arange(self.length, self.length + num_tokens, device=self._ckv.device)[None]

    def extend(self, ckv_BTC: torch.Tensor, kpe_BTR: torch.Tensor):
        """Append T tokens; returns (ckv_BSC, kpe_BSR, mask_BTS or None) over all S keys."""
        T = ckv_BTC.shape[1]
        self._reserve(self.length + T)
        self._ckv[:, self.length:self.length + T] = ckv_BTC
        self._kpe[:, self.length:self.length + T] = kpe_BTR
        self.length += T
        mask = None if T == 1 else mla_ops.attention_mask(T, self.length, device=ckv_BTC.device)
        return self.ckv, self.kpe, mask

    def nbytes(self) -> int:
        """Bytes of the cached tokens (not the spare capacity)."""
        return self.ckv.numel() * self.ckv.element_size() + self.kpe.numel() * self.kpe.element_size()


@dataclass
class DenseCache:
    """Decode state of a batch of sequences of equal length; `layers[i]` is filled by layer i."""

    num_layers: int
    seq_len: int = 0
    layers: list[KDAState | MLAState | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.layers:
            self.layers = [None] * self.num_layers

    def advance(self, num_tokens: int) -> None:
        self.seq_len += num_tokens

    def nbytes(self) -> dict[str, int]:
        """Bytes held by KDA state and by the MLA cache."""
        kda = sum(s.nbytes() for s in self.layers if isinstance(s, KDAState))
        mla = sum(s.nbytes() for s in self.layers if isinstance(s, MLAState))
        return {"kda_state": kda, "mla_cache": mla}


class SlotMLAView:
    """The first n rows of a `SlotCache` MLA layer for one decode step: each row appends its token at
    its own length and attends to its own keys only (the other positions are masked)."""

    def __init__(self, owner: SlotCache, layer: int, n: int) -> None:
        self.owner, self.layer, self.n = owner, layer, n

    def positions(self, num_tokens: int) -> torch.Tensor:
        """[n, 1] position of each row's new token: its own length, where `extend` writes it."""
        assert num_tokens == 1, "slot views decode one token per row"
        return self.owner.lengths[:self.n, None]

    def extend(self, ckv_BTC: torch.Tensor, kpe_BTR: torch.Tensor):
        assert ckv_BTC.shape[1] == 1 and ckv_BTC.shape[0] == self.n, "slot views decode one token per row"
        o = self.owner
        rows, pos = o.row_index[:self.n], o.lengths[:self.n]
        ckv_buf, kpe_buf = o.ckv[self.layer], o.kpe[self.layer]
        ckv_buf[rows, pos] = ckv_BTC[:, 0]
        kpe_buf[rows, pos] = kpe_BTR[:, 0]
        S = o.max_len(self.n) + 1
        mask_B1S = (o.key_pos[:S][None, :] <= pos[:, None])[:, None]
        return ckv_buf[:self.n, :S], kpe_buf[:self.n, :S], mask_B1S


class SlotView:
    """What the model sees as `cache` for one batched decode step over slots [0, n)."""

    def __init__(self, owner: SlotCache, n: int) -> None:
        self.owner, self.n = owner, n
        self.layers = [SlotMLAView(owner, i, n) if s is None else KDAState(*(t[:n] for t in s.tensors()))
                       for i, s in enumerate(owner.kda)]

    def advance(self, num_tokens: int) -> None:
        assert num_tokens == 1
        self.owner.advance(self.n)


class SlotCache:
    """Decode state for up to `max_slots` sequences of different lengths (the engine's batch).

    Active sequences occupy slots 0..n-1 (the engine keeps them compact with `move`), so a decode
    step works on contiguous views. KDA state is preallocated ([max_slots, ...] per layer: constant
    size); MLA buffers [max_slots, capacity, C] grow by doubling to the longest sequence.
    """

    def __init__(self, model, max_slots: int, *, device=None, dtype: torch.dtype | None = None) -> None:
        p = next(model.parameters())
        device = p.device if device is None else device
        dtype = p.dtype if dtype is None else dtype
        self.max_slots, self.device, self.dtype = max_slots, device, dtype
        self.kda: list[KDAState | None] = []
        self.ckv: list[torch.Tensor | None] = []
        self.kpe: list[torch.Tensor | None] = []
        for layer in model.model.layers:
            attn = layer.self_attn
            if layer.is_mla:
                self.kda.append(None)
                self.ckv.append(torch.zeros(max_slots, 0, attn.kv_lora_rank, device=device, dtype=dtype))
                self.kpe.append(torch.zeros(max_slots, 0, attn.dr, device=device, dtype=dtype))
            else:
                self.kda.append(attn.empty_state(max_slots, device, dtype))
                self.ckv.append(None)
                self.kpe.append(None)
        self.lengths = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.host_lengths = [0] * max_slots  # the same numbers on the host: no device sync to read them
        self.row_index = torch.arange(max_slots, device=device)
        self.key_pos = torch.arange(0, device=device)

    @property
    def capacity(self) -> int:
        return next((t.shape[1] for t in self.ckv if t is not None), 0)

    def max_len(self, n: int) -> int:
        return max(self.host_lengths[:n], default=0)

    def reserve(self, tokens: int) -> None:
        """Make every MLA buffer hold at least `tokens` positions per slot (doubling)."""
        cap = self.capacity
        if tokens > cap:
            new_cap = max(tokens, 2 * cap, 64)
            for lst in (self.ckv, self.kpe):
                for i, t in enumerate(lst):
                    if t is not None:
                        lst[i] = grow_tokens(t, cap, new_cap)
        if self.key_pos.numel() < max(tokens, cap):
            self.key_pos = torch.arange(max(tokens, cap, 64), device=self.device)

    def view(self, n: int) -> SlotView:
        """Cache for one decode step of slots [0, n); reserves room for the new token."""
        assert 0 < n <= self.max_slots
        self.reserve(self.max_len(n) + 1)
        return SlotView(self, n)

    def advance(self, n: int) -> None:
        """Slots [0, n) decoded one token."""
        self.lengths[:n] += 1
        for i in range(n):
            self.host_lengths[i] += 1

    def install(self, slot: int, cache: DenseCache, row: int = 0) -> None:
        """Copy row `row` of a prefilled `DenseCache` into `slot`."""
        length = cache.seq_len
        self.reserve(length + 1)
        for i, st in enumerate(cache.layers):
            if isinstance(st, KDAState):
                for dst, src in zip(self.kda[i].tensors(), st.tensors(), strict=True):
                    dst[slot].copy_(src[row])
            elif isinstance(st, MLAState):
                self.ckv[i][slot, :length] = st.ckv[row]
                self.kpe[i][slot, :length] = st.kpe[row]
            else:
                raise AssertionError(f"layer {i} has no state in the prefilled cache")
        self.lengths[slot] = length
        self.host_lengths[slot] = length

    def extract(self, slot: int) -> DenseCache:
        """A batch-1 `DenseCache` copy of `slot`'s state (the inverse of `install`; prefix snapshots)."""
        length = self.host_lengths[slot]
        layers: list[KDAState | MLAState | None] = []
        for i, st in enumerate(self.kda):
            if st is not None:
                layers.append(KDAState(*(t[slot:slot + 1].clone() for t in st.tensors())))
            else:
                layers.append(MLAState(self.ckv[i][slot:slot + 1, :length].clone(),
                                       self.kpe[i][slot:slot + 1, :length].clone()))
        return DenseCache(num_layers=len(self.kda), seq_len=length, layers=layers)

    def move(self, src: int, dst: int) -> None:
        """Copy slot `src` into slot `dst` (compaction after a sequence leaves)."""
        if src == dst:
            return
        n = self.host_lengths[src]
        for i, st in enumerate(self.kda):
            if st is not None:
                for t in st.tensors():
                    t[dst].copy_(t[src])
            else:
                self.ckv[i][dst, :n] = self.ckv[i][src, :n]
                self.kpe[i][dst, :n] = self.kpe[i][src, :n]
        self.lengths[dst] = n
        self.host_lengths[dst] = n

    def clear(self, slot: int) -> None:
        """Forget a slot (its buffers are overwritten by the next install)."""
        self.lengths[slot] = 0
        self.host_lengths[slot] = 0

    def nbytes(self) -> dict[str, int]:
        """Allocated bytes: KDA state (constant) and MLA buffers (capacity)."""
        kda = sum(s.nbytes() for s in self.kda if s is not None)
        mla = sum(t.numel() * t.element_size() for lst in (self.ckv, self.kpe) for t in lst if t is not None)
        return {"kda_state": kda, "mla_cache": mla}
