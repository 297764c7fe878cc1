"""`K3Cache`: openk3's decode state (`openk3.model.cache.DenseCache`: KDA conv + recurrent state, MLA latents) as
a transformers `Cache`, so `generate` carries it from step to step, reorders it for beam search and selects rows.

transformers' own hybrid `DynamicCache` stores other layouts (conv history [B, C, K], MLA latents per head) and
works through per-layer `update` calls that openk3's layers do not make; this object instead hands the whole
`DenseCache` to `K3ForCausalLM`, whose layers extend it in place. Recurrent state cannot be rolled back, so
`crop` (assisted decoding) raises, and the cache is never compileable (no static shapes).

Legend: B rows.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from openk3.model.cache import DenseCache, KDAState, MLAState


class K3Cache(Cache):
    """The decode state of `num_layers` layers for a batch of rows of equal length."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[])
        self.dense = DenseCache(num_layers=num_layers)

    # transformers asks these of any cache ------------------------------------------------------------------
    @property
    def is_compileable(self) -> bool:
        return False  # (Cache's default is all(layers), true for none)

    @property
    def is_initialized(self) -> bool:
        return self.dense.seq_len > 0

    def __len__(self) -> int:
        return self.dense.num_layers

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.dense.seq_len

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1  # grows without bound

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.dense.seq_len + query_length, 0

    @property
    def max_batch_size(self) -> int | None:
        for s in self.dense.layers:
            if s is not None:
                return (s.conv if isinstance(s, KDAState) else s.ckv).shape[0]
        return None

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.dense.seq_len > 0

    # row operations (beam search, contrastive search, batch selection) --------------------------------------
    def _index_rows(self, index_B: torch.Tensor) -> None:
        for i, s in enumerate(self.dense.layers):
            if isinstance(s, KDAState):
                idx = index_B.to(s.conv.device)
                self.dense.layers[i] = KDAState(s.conv.index_select(0, idx), s.recurrent.index_select(0, idx))
            elif isinstance(s, MLAState):
                idx = index_B.to(s.ckv.device)
                self.dense.layers[i] = MLAState(s.ckv.index_select(0, idx), s.kpe.index_select(0, idx))
            else:
                assert s is None, type(s)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._index_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._index_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        B = self.max_batch_size
        if B is not None:
            self._index_rows(torch.arange(B).repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("K3Cache cannot be cropped: KDA layers keep a recurrent state, which cannot be rolled back "
                         "(assisted decoding and prompt-lookup decoding need it)")

    def reset(self) -> None:
        self.dense = DenseCache(num_layers=self.dense.num_layers)

    def __repr__(self) -> str:
        return f"K3Cache(layers={self.dense.num_layers}, seq_len={self.dense.seq_len}, rows={self.max_batch_size})"
