"""Parameters, FLOPs and decode state of a config, by arithmetic alone (no torch, microseconds).

`tensors(cfg)` lists every stored tensor group of the text model with its size, the component it
belongs to and whether the release keeps it in fp32. Everything else in the planner is sums over that
list, and `tests/test_plan.py` checks the sums against the model's own accounting
(`openk3.model.accounting`, read off a model built on the meta device) for every preset, so the
planner cannot drift from the code that trains and loads checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from openk3.config import K3Config

# Components, in the order tables print them.
COMPONENTS = ("embedding", "lm_head", "kda", "mla", "dense_mlp", "shared_experts", "router", "latent_proj",
              "routed_experts", "norms_and_attn_res")


@dataclass(frozen=True)
class TensorGroup:
    name: str  # e.g. "layers.3.self_attn.q_proj" or "layers.*.block_sparse_moe.experts" (one entry per layer)
    component: str  # one of COMPONENTS
    numel: int
    vector: bool = False  # 1-D (norm gains, A_log, dt_bias, router bias): no multiply-add per token
    fp32: bool = False  # stored F32 in the release (spec §2), whatever the weight format


_TENSORS: dict[str, tuple[TensorGroup, ...]] = {}  # by repr(cfg): one plan asks about one config many times


def tensors(cfg: K3Config) -> tuple[TensorGroup, ...]:
    """Every parameter (and the persistent router bias) of the text model, grouped per layer."""
    key = repr(cfg)
    if key not in _TENSORS:
        if len(_TENSORS) >= 64:
            _TENSORS.clear()
        _TENSORS[key] = tuple(_build_tensors(cfg))
    return _TENSORS[key]


def _build_tensors(cfg: K3Config) -> list[TensorGroup]:
    D, V = cfg.hidden_size, cfg.vocab_size
    out = [TensorGroup("embed_tokens", "embedding", V * D), TensorGroup("lm_head", "lm_head", V * D),
           TensorGroup("norm", "norms_and_attn_res", D, vector=True)]
    if cfg.use_attn_res:
        out += [TensorGroup("output_attn_res_norm", "norms_and_attn_res", D, vector=True),
                TensorGroup("output_attn_res_proj", "norms_and_attn_res", D)]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        out += [TensorGroup(p + "input_layernorm", "norms_and_attn_res", D, vector=True),
                TensorGroup(p + "post_attention_layernorm", "norms_and_attn_res", D, vector=True)]
        if cfg.use_attn_res:
            out += [TensorGroup(p + f"{site}_res_{kind}", "norms_and_attn_res", D, vector=kind == "norm")
                    for site in ("self_attention", "mlp") for kind in ("norm", "proj")]
        out += _mla(cfg, p) if cfg.is_mla_layer(i) else _kda(cfg, p)
        if cfg.is_moe_layer(i):
            out += _moe(cfg, p)
        else:
            out.append(TensorGroup(p + "mlp", "dense_mlp", 3 * D * cfg.intermediate_size))
    return out


def _kda(cfg: K3Config, p: str) -> list[TensorGroup]:
    la = cfg.linear_attn_config
    D, H, K = cfg.hidden_size, la.num_heads, la.head_dim
    P, W = H * K, la.short_conv_kernel_size
    p += "self_attn."
    gate = [TensorGroup(p + "g_proj", "kda", D * P)] if la.use_full_rank_gate else [
        TensorGroup(p + "g_a_proj", "kda", D * K), TensorGroup(p + "g_b_proj", "kda", K * P)]
    return [TensorGroup(p + "q_k_v_proj", "kda", 3 * D * P),
            TensorGroup(p + "q_k_v_conv1d", "kda", 3 * P * W, fp32=True),
            TensorGroup(p + "f_a_proj", "kda", D * K), TensorGroup(p + "f_b_proj", "kda", K * P),
            TensorGroup(p + "b_proj", "kda", D * H),
            TensorGroup(p + "A_log", "kda", cfg.a_log_size, vector=True, fp32=True),
            TensorGroup(p + "dt_bias", "kda", P, vector=True, fp32=True), *gate,
            TensorGroup(p + "o_norm", "kda", K, vector=True, fp32=True),
            TensorGroup(p + "o_proj", "kda", P * D)]


def _mla(cfg: K3Config, p: str) -> list[TensorGroup]:
    D, H, C = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    p += "self_attn."
    if cfg.q_lora_rank:
        q = [TensorGroup(p + "q_a_proj", "mla", D * cfg.q_lora_rank),
             TensorGroup(p + "q_a_layernorm", "mla", cfg.q_lora_rank, vector=True),
             TensorGroup(p + "q_b_proj", "mla", cfg.q_lora_rank * H * (dn + dr))]
    else:
        q = [TensorGroup(p + "q_proj", "mla", D * H * (dn + dr))]
    gate = [TensorGroup(p + "g_proj", "mla", D * H * dv)] if cfg.mla_use_output_gate else []
    return [*q, TensorGroup(p + "kv_a_proj_with_mqa", "mla", D * (C + dr)),
            TensorGroup(p + "kv_a_layernorm", "mla", C, vector=True),
            TensorGroup(p + "kv_b_proj", "mla", C * H * (dn + dv)), *gate,
            TensorGroup(p + "o_proj", "mla", H * dv * D)]


def _moe(cfg: K3Config, p: str) -> list[TensorGroup]:
    D, E, C, I = cfg.hidden_size, cfg.num_experts, cfg.expert_in_dim, cfg.moe_intermediate_size
    p += "block_sparse_moe."
    out = [TensorGroup(p + "gate", "router", E * D),
           TensorGroup(p + "gate.e_score_correction_bias", "router", E, vector=True, fp32=True)]
    if cfg.use_latent_moe:
        out += [TensorGroup(p + "routed_expert_down_up_proj", "latent_proj", 2 * D * C)]
        if cfg.latent_moe_use_norm:
            out.append(TensorGroup(p + "routed_expert_norm", "latent_proj", C, vector=True))
    out.append(TensorGroup(p + "experts", "routed_experts", 3 * E * C * I))
    if cfg.num_shared_experts:
        out.append(TensorGroup(p + "shared_experts", "shared_experts", 3 * D * I * cfg.num_shared_experts))
    return out


def params_per_expert(cfg: K3Config) -> int:
    """Weights of one routed expert: gate, up [I, C] and down [C, I] (C the latent width in K3)."""
    return 3 * cfg.expert_in_dim * cfg.moe_intermediate_size


def num_moe_layers(cfg: K3Config) -> int:
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def num_attn_res_blocks(cfg: K3Config) -> int:
    """Block representations AttnRes keeps (0 without AttnRes)."""
    return math.ceil(cfg.num_hidden_layers / cfg.attn_res_block_size) if cfg.use_attn_res else 0


@dataclass(frozen=True)
class Params:
    """Parameter counts; field meanings as in `openk3.model.accounting.ParamCounts` (plus components)."""

    total: int
    embedding: int
    lm_head: int
    routed_experts: int
    routed_active: int
    active: int  # per token, excluding the input-embedding lookup (the "104B" convention)
    active_with_embedding: int
    matmul_active: int  # active weights that cost one multiply-add per token (active minus vectors)
    fp32: int  # values the release stores in F32 (KDA conv/A_log/dt_bias/o_norm, router bias)
    by_component: dict

    @property
    def non_routed(self) -> int:
        return self.total - self.routed_experts

    def to_dict(self) -> dict:
        d = asdict(self)
        d["non_routed"] = self.non_routed
        return d


def params(cfg: K3Config) -> Params:
    ts = tensors(cfg)
    by = dict.fromkeys(COMPONENTS, 0)
    for t in ts:
        by[t.component] += t.numel
    total = sum(by.values())
    routed = by["routed_experts"]
    routed_active = num_moe_layers(cfg) * params_per_expert(cfg) * cfg.num_experts_per_token
    active_emb = total - routed + routed_active
    vectors = sum(t.numel for t in ts if t.vector)
    return Params(total=total, embedding=by["embedding"], lm_head=by["lm_head"], routed_experts=routed,
                  routed_active=routed_active, active=active_emb - by["embedding"], active_with_embedding=active_emb,
                  matmul_active=active_emb - by["embedding"] - vectors, fp32=sum(t.numel for t in ts if t.fp32),
                  by_component=by)


# ---- FLOPs ---------------------------------------------------------------------------------------

def attention_flops(cfg: K3Config, context: float, *, absorbed: bool = False) -> dict[str, float]:
    """Token-mixer FLOPs per token beyond the projections, attending to `context` keys.

    MLA naive (prefill, keys expanded per head): q.k over dn+dr and p.v over dv per key and head.
    MLA absorbed (decode, attention in the 576-wide latent): q.[c;k_pe] over C+dr and p.c over C; the
    absorbed q_nope/output projections cost what kv_b costs per token, which the projections already count.
    KDA (recurrent form): S^T k, the rank-1 delta write and S^T q, 6 K V FLOPs per head, constant in
    context (the same algorithmic count `openk3.model.accounting` uses).
    """
    la = cfg.linear_attn_config
    H, C = cfg.num_attention_heads, cfg.kv_lora_rank
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    n_mla = len(cfg.mla_layers)
    per_key = (2 * C + dr) if absorbed else (dn + dr + dv)
    return {"mla": n_mla * 2 * H * per_key * context,
            "kda": (cfg.num_hidden_layers - n_mla) * 6 * la.num_heads * la.head_dim * la.head_dim}


def flops_per_token(cfg: K3Config, seq_len: int, *, training: bool = False) -> int:
    """Model FLOPs per token of a `seq_len` sequence, same convention as `accounting.flops_per_token`
    (context (T+1)//2 on average, naive MLA, training = 3 x forward)."""
    attn = attention_flops(cfg, (seq_len + 1) // 2)
    fwd = 2 * params(cfg).matmul_active + attn["mla"] + attn["kda"]
    return int(3 * fwd if training else fwd)


def decode_flops_per_token(cfg: K3Config, context: int, p: Params | None = None) -> dict[str, float]:
    """One decoded token at `context` cached tokens (absorbed MLA), split routed / other for formats."""
    p = p or params(cfg)
    attn = attention_flops(cfg, context, absorbed=True)
    routed = 2 * p.routed_active
    other = 2 * p.matmul_active - routed + attn["mla"] + attn["kda"]
    return {"routed": routed, "other": other, "mla_attention": attn["mla"], "kda_attention": attn["kda"],
            "total": routed + other}


def prefill_flops_per_token(cfg: K3Config, prompt: int, p: Params | None = None) -> dict[str, float]:
    """Average per prompt token of a `prompt`-token prefill (naive MLA, mean context (T+1)/2)."""
    p = p or params(cfg)
    attn = attention_flops(cfg, (prompt + 1) / 2)
    routed = 2 * p.routed_active
    other = 2 * p.matmul_active - routed + attn["mla"] + attn["kda"]
    return {"routed": routed, "other": other, "mla_attention": attn["mla"], "kda_attention": attn["kda"],
            "total": routed + other}


# ---- decode state ---------------------------------------------------------------------------------

def state_sizes(cfg: K3Config) -> dict[str, int]:
    """Decode state in values: KDA recurrent per sequence, KDA conv windows per sequence (W-1 taps of
    q, k, v), MLA latent + shared key per token (spec §8). Bytes = values x the chosen format's size."""
    la = cfg.linear_attn_config
    n_mla = len(cfg.mla_layers)
    n_kda = cfg.num_hidden_layers - n_mla
    return {"kda_state_values_per_sequence": n_kda * la.num_heads * la.head_dim * la.head_dim,
            "kda_conv_values_per_sequence": n_kda * 3 * la.num_heads * la.head_dim * (la.short_conv_kernel_size - 1),
            "mla_cache_values_per_token": n_mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim),
            "num_kda_layers": n_kda, "num_mla_layers": n_mla}
