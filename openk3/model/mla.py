"""Gated NoPE multi-head latent attention layer (spec §4.5), and its RoPE form.

K3 and Kimi-Linear never rotate the Dr "rope" dims (`mla_use_nope: true`, every preset). With
`mla_use_nope: false` (the scaling lab's Kimi K2 / DeepSeek-V3 style baseline) the last Dr dims of each
query head and the shared key part `kpe` are rotated by the token's position (`openk3.ops.rope`: half-split
pairs, inv_freq = rope_theta^(-2i/Dr)) before attention and before caching, so every attention form and the
cache see rotated values. Positions: 0..T-1 without a cache; within each document of a packed row
(`seg_BT`); after the cached tokens with a cache (`state.positions`, per row in a slot cache).

Legend: B batch, T new tokens, S all key tokens (cache + new), D hidden, H heads, C kv_lora_rank,
Dn/Dr/Dv nope/"rope"/value head dims, Q q_lora_rank.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from openk3.config import K3Config
from openk3.model.cache import MLAState
from openk3.model.layers import RMSNorm, linear_weight
from openk3.ops import mla as mla_ops
from openk3.ops import rope as rope_ops


class GatedMLA(nn.Module):
    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = H
        self.dn, self.dr, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        # NoPE, but the softmax scale uses the full 192-wide q head (spec §10.5).
        self.scale = (self.dn + self.dr) ** -0.5
        # None: NoPE, nothing is rotated (K3); else the RoPE base of the Dr dims (K2-style baseline)
        self.rope_theta = None if cfg.mla_use_nope else cfg.rope_theta
        if cfg.q_lora_rank is not None:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_latent_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * (self.dn + self.dr), bias=False)
        else:
            self.q_proj = nn.Linear(D, H * (self.dn + self.dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, cfg.kv_lora_rank + self.dr, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.mla_latent_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (self.dn + self.dv), bias=False)
        if cfg.mla_use_output_gate:
            self.g_proj = nn.Linear(D, H * self.dv, bias=False)
        self.o_proj = nn.Linear(H * self.dv, D, bias=False)

    def empty_state(self, batch: int, device: torch.device, dtype: torch.dtype) -> MLAState:
        return MLAState(torch.zeros(batch, 0, self.kv_lora_rank, device=device, dtype=dtype),
                        torch.zeros(batch, 0, self.dr, device=device, dtype=dtype))

    def positions(self, num_tokens: int, *, seg_BT: torch.Tensor | None = None, state: MLAState | None = None,
                  device: torch.device | None = None) -> torch.Tensor | None:
        """RoPE positions [B or 1, T] of the new tokens (see the module docstring), or None for NoPE."""
        if self.rope_theta is None:
            return None
        if state is not None:
            return state.positions(num_tokens)
        if seg_BT is not None:
            return rope_ops.document_positions(seg_BT)
        return torch.arange(num_tokens, device=device)[None]

    def project(self, x_BTD: torch.Tensor, pos_BT: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
        """x [B, T, D] -> (queries [B, T, H, Dn + Dr], normalised latent [B, T, C], shared key dims [B, T, Dr]):
        what attention reads and the cache stores. With `pos_BT` (RoPE) the Dr dims of q and kpe are rotated."""
        B, T, _ = x_BTD.shape
        if hasattr(self, "q_proj"):
            q = self.q_proj(x_BTD)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BTD)))
        q_BTHD = q.view(B, T, self.num_heads, self.dn + self.dr)
        latent_BTC, kpe_BTR = self.kv_a_proj_with_mqa(x_BTD).split([self.kv_lora_rank, self.dr], dim=-1)
        ckv_BTC = self.kv_a_layernorm(latent_BTC)
        if pos_BT is not None:
            cos_BTR, sin_BTR = rope_ops.cos_sin(pos_BT, self.dr, self.rope_theta, rope_ops.compute_dtype(q.dtype))
            q_nope_BTHN, q_pe_BTHR = q_BTHD.split([self.dn, self.dr], dim=-1)
            q_BTHD = torch.cat([q_nope_BTHN, rope_ops.apply_rope(q_pe_BTHR, cos_BTR, sin_BTR)], dim=-1)
            kpe_BTR = rope_ops.apply_rope(kpe_BTR, cos_BTR, sin_BTR)
        return q_BTHD, ckv_BTC, kpe_BTR

    def forward(self, x_BTD: torch.Tensor, *, seg_BT: torch.Tensor | None = None, state: MLAState | None = None,
                impl: str = "naive") -> tuple[torch.Tensor, MLAState | None]:
        """x: normed layer input [B, T, D] -> (output [B, T, D], extended cache or None).

        `seg_BT` makes attention block-diagonal over the documents of a packed row; `impl` is
        "naive" (expanded K/V, training) or "absorbed" (latent, decode). Both are exact.
        """
        B, T, _ = x_BTD.shape
        H = self.num_heads
        q_BTHD, ckv_BTC, kpe_BTR = self.project(x_BTD, self.positions(T, seg_BT=seg_BT, state=state,
                                                                     device=x_BTD.device))
        if state is not None:
            assert seg_BT is None, "packed documents are a training/prefill feature"
            ckv_BSC, kpe_BSR, mask = state.extend(ckv_BTC, kpe_BTR)
        else:
            ckv_BSC, kpe_BSR = ckv_BTC, kpe_BTR
        # (the matrix, not the module: MLA folds it into keys/values or, absorbed, into queries and outputs;
        # `linear_weight` sees a LoRA adapter wrapped around it)
        w_kv_b = linear_weight(self.kv_b_proj)
        if state is None and impl == "naive" and seg_BT is not None:
            # packed rows: one causal attention per document (exact: the masked form's other-document keys
            # get probability 0), at the cost of the squared document lengths instead of T^2
            o_BTHV = mla_ops.mla_attention_documents(q_BTHD, ckv_BSC, kpe_BSR, w_kv_b, seg_BT=seg_BT,
                                                     v_head_dim=self.dv, scale=self.scale)
        elif state is None and impl == "naive":  # plain causal attention: the fused kernel where it is exact
            o_BTHV = mla_ops.mla_attention_causal(q_BTHD, ckv_BSC, kpe_BSR, w_kv_b, v_head_dim=self.dv,
                                                  scale=self.scale)
        else:
            if state is None:  # the absorbed form without a cache: the causal (block-diagonal) mask, built here
                mask = None if T == 1 and seg_BT is None else mla_ops.attention_mask(
                    T, T, doc_q_BT=seg_BT, doc_k_BS=seg_BT, device=x_BTD.device)
            attn = mla_ops.mla_attention_absorbed if impl == "absorbed" else mla_ops.mla_attention_naive
            o_BTHV = attn(q_BTHD, ckv_BSC, kpe_BSR, w_kv_b, v_head_dim=self.dv, scale=self.scale,
                          mask_BTS=mask)
        o_BTP = o_BTHV.reshape(B, T, H * self.dv)
        if hasattr(self, "g_proj"):
            # Sigmoid output gate from the same normed input; no norm on the MLA output (spec §10.9).
            o_BTP = o_BTP * torch.sigmoid(self.g_proj(x_BTD))
        return self.o_proj(o_BTP), state
