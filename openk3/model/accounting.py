"""Accounting read off a built model (meta device is fine): parameters, FLOPs, decode-state bytes.

This is the ground truth the planner and the MFU meter use. Counts are of what the checkpoint
stores: parameters plus the persistent `e_score_correction_bias` buffers, with `A_log` padded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import GatedMLA
from openk3.model.moe import SparseMoE


@dataclass
class ParamCounts:
    total: int  # everything stored
    embedding: int  # input embedding table (a lookup, no FLOPs)
    lm_head: int
    routed_experts: int  # all routed experts of all layers
    routed_active: int  # top-k experts of every MoE layer
    active: int  # per token, excluding the embedding lookup (the "104B" convention)
    active_with_embedding: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def _expert_weights(moe: SparseMoE) -> int:
    """Logical weights of a layer's routed experts, stacked or kept packed in MXFP4 (2 codes per byte)."""
    experts = moe.experts
    if hasattr(experts, "stream_run"):  # on disk (openk3.stream): gate, up, down of every expert
        return 3 * experts.num_experts * experts.dim * experts.hidden
    if hasattr(experts, "w1_packed"):
        return 2 * sum(getattr(experts, f"{w}_packed").numel() for w in ("w1", "w3", "w2"))
    return sum(p.numel() for p in experts.parameters())


def _numel(module: torch.nn.Module) -> int:
    """Stored parameters + correction biases + logical weights of MXFP4-packed or streamed experts and of integer
    linears (`openk3.quant.trunk`)."""
    packed = sum(_expert_weights(m) for m in module.modules()
                 if isinstance(m, SparseMoE) and (hasattr(m.experts, "w1_packed") or hasattr(m.experts, "stream_run")))
    packed += sum(m.in_features * m.out_features for m in module.modules()
                  if type(m).__name__ in ("Int8Linear", "Int4Linear"))
    return packed + sum(p.numel() for p in module.parameters()) + sum(
        b.numel() for name, b in module.named_buffers() if name.endswith("e_score_correction_bias"))


def count_params(model) -> ParamCounts:
    """Total and active parameters of a `K3ForCausalLM`."""
    cfg = model.config
    total = _numel(model)
    emb = model.model.embed_tokens.weight.numel()
    routed = routed_active = 0
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if isinstance(moe, SparseMoE):
            n = _expert_weights(moe)
            routed += n
            routed_active += n * cfg.num_experts_per_token // cfg.num_experts
    active_emb = total - routed + routed_active
    head = model.lm_head.in_features * model.lm_head.out_features
    return ParamCounts(total=total, embedding=emb, lm_head=head, routed_experts=routed,
                       routed_active=routed_active, active=active_emb - emb, active_with_embedding=active_emb)


def _matmul_params_active(model) -> int:
    """Active weights that cost 2 FLOPs (one multiply-add) per token: everything active except
    vectors (norm gains, `A_log`, `dt_bias`, router bias). Short-conv taps and the AttnRes
    pseudo-queries are multiply-adds per token too, so they count."""
    vectors = sum(p.numel() for p in model.parameters() if p.dim() < 2)
    biases = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    return count_params(model).active - vectors - biases


def attention_flops_per_token(model, context: int) -> dict[str, int]:
    """Forward FLOPs per token spent inside the token mixers beyond their projections.

    MLA (naive form): q.k over 192 dims and p.v over 128 dims for each of `context` keys, per head.
    KDA (recurrent form): S^T k, the rank-1 delta write and S^T q: 3 matvec-sized products of K x V
    per head, 6 K V FLOPs; constant in context. (The chunked training form does extra intra-chunk
    work; this counts the algorithmic minimum, like the attention term of the usual 6N rule.)
    """
    mla = kda = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        if isinstance(attn, GatedMLA):
            mla += 2 * attn.num_heads * (attn.dn + attn.dr + attn.dv) * context
        elif isinstance(attn, KimiDeltaAttention):
            kda += 6 * attn.num_heads * attn.head_dim * attn.head_dim
    return {"mla": mla, "kda": kda}


def flops_per_token(model, seq_len: int, *, training: bool = False) -> int:
    """Model FLOPs per token for a sequence of `seq_len` tokens (causal average context (T+1)/2).

    Forward = 2 x matmul weights active per token (head included, embedding lookup excluded) +
    the attention terms; training = 3 x forward (backward is twice the forward).
    """
    context = (seq_len + 1) // 2
    attn = attention_flops_per_token(model, context)
    fwd = 2 * _matmul_params_active(model) + attn["mla"] + attn["kda"]
    return 3 * fwd if training else fwd


def state_bytes(model, *, kda_state_dtype: torch.dtype = torch.float32, conv_dtype: torch.dtype = torch.bfloat16,
                mla_cache_dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Decode state: KDA bytes per sequence (recurrent S + conv windows, constant in context) and
    MLA cache bytes per token (normalised latent + shared key dims, spec §8)."""
    kda_rec = kda_conv = mla = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        if isinstance(attn, KimiDeltaAttention):
            kda_rec += attn.num_heads * attn.head_dim * attn.head_dim * kda_state_dtype.itemsize
            W = attn.q_conv1d.weight.shape[-1] - 1
            kda_conv += 3 * attn.num_heads * attn.head_dim * W * conv_dtype.itemsize
        elif isinstance(attn, GatedMLA):
            mla += (attn.kv_lora_rank + attn.dr) * mla_cache_dtype.itemsize
    return {"kda_state_bytes_per_sequence": kda_rec, "kda_conv_bytes_per_sequence": kda_conv,
            "mla_cache_bytes_per_token": mla}


def summary(model, seq_len: int = 4096) -> dict:
    """Everything above in one JSON-able dict (what `openk3 info --json` prints)."""
    counts = count_params(model)
    layers = model.model.layers
    return {
        "total_params": counts.total,
        "active_params": counts.active,
        "active_params_with_embedding": counts.active_with_embedding,
        "params": counts.to_dict(),
        "num_kda_layers": sum(isinstance(layer.self_attn, KimiDeltaAttention) for layer in layers),
        "num_mla_layers": sum(isinstance(layer.self_attn, GatedMLA) for layer in layers),
        "flops_per_token": {"seq_len": seq_len, "forward": flops_per_token(model, seq_len),
                            "training": flops_per_token(model, seq_len, training=True)},
        **state_bytes(model),
    }
