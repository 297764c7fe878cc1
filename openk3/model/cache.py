"""Per-sequence decode state: what each layer keeps between forward calls (spec §8).

KDA layers keep a constant-size state (recurrent S plus the last `kernel-1` inputs of each short
conv); MLA layers keep the normalised latent and the shared key dims of every past token (576
values per token in K3); AttnRes keeps nothing. `DenseCache` holds them contiguously for a batch of
rows that advance together (tests, chat); a paged engine can implement the same attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KDAState:
    """conv_*: last kernel-1 projected inputs [B, kernel-1, P]; recurrent: [B, H, K, V] fp32."""

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    recurrent: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_q, self.conv_k, self.conv_v, self.recurrent))


@dataclass
class MLAState:
    """ckv: normalised KV latent [B, S, C]; kpe: shared un-rotated key dims [B, S, Dr]."""

    ckv: torch.Tensor
    kpe: torch.Tensor

    def nbytes(self) -> int:
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

    def nbytes(self) -> dict[str, int]:
        """Bytes held by KDA state and by the MLA cache."""
        kda = sum(s.nbytes() for s in self.layers if isinstance(s, KDAState))
        mla = sum(s.nbytes() for s in self.layers if isinstance(s, MLAState))
        return {"kda_state": kda, "mla_cache": mla}
