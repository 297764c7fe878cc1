"""The scaling lab's model families: K3 and the baselines it is measured against, each at any width.

    cfg = family("k2-style").config(width=64, layers=9)      # a K3Config (validated), K2's layout
    fam = family("k3-adamw"); fam.train_overrides             # {"optim.muon": False}: a recipe ablation
    flops_per_token(cfg, seq_len=256)                         # training FLOPs/token, openk3.model.accounting

Every family is one `K3Config` recipe of `width` (the hidden size d) and `layers`, so the same code trains,
saves, loads and generates all of them. Per-head dims stay fixed (32 wide, as `nano`), head counts grow
with d; expert counts and top-k are K3's small-scale ones (`nano`: 32 experts, top-4, latent d/2).

- `k3`: 3:1 KDA : gated NoPE MLA (last layer MLA), Block AttnRes, Stable LatentMoE (latent d/2, 2 shared experts),
  SiTU-GLU, Quantile Balancing, Per-Head Muon.
- `k2-style` (Kimi K2 / DeepSeek-V3): all MLA with RoPE on the decoupled dims and no output gate, PreNorm additive
  residual, plain MoE at width d (half K3's experts and top-k), 1 shared expert, SwiGLU, sign-rule balancing
  (`balance=sign`), Muon.
- `kimi-linear-style`: Kimi Linear's 3:1 KDA : MLA (low-rank KDA gate, no MLA output gate), PreNorm, plain MoE at
  width d, SwiGLU, QB, Muon (`openk3.config.as_kimi_linear` plus k2-style's expert counts).
- `dense`: k2-style attention, residual and balancing rule, a dense SwiGLU FFN in every layer.
- one-feature ablations of `k3`: `k3-no-attnres` (PreNorm residual), `k3-no-latent-moe` (plain MoE at width d,
  half the experts and top-k), `k3-swiglu`, `k3-all-mla` (gated MLA with RoPE in every layer), `k3-1to1` (KDA:MLA
  1:1 instead of 3:1), `k3-adamw` (AdamW for every parameter: `optim.muon=false`).

Cost matching (issue 31: "equal FLOPs/token accounting within 10 %"): families whose FFN is a different kind
(`k2-style`, `dense`, `kimi-linear-style`, `k3-no-latent-moe`) have their expert (or dense) hidden size
chosen so that their training FLOPs/token at the ladder's sequence length is as close as possible to
`k3`'s at the same width and depth (`matched_config`); the single-feature ablations whose change costs
almost nothing (AttnRes, the activation, the optimizer) are not adjusted; `k3-all-mla` is not adjusted either
nor `k3-1to1` (the attention kind is the feature; the fits use each run's actual compute, so a small mismatch does not
bias the multiplier). FLOPs are `openk3.model.accounting.flops_per_token(training=True)`: 2 per active
matmul weight (LM head included, embedding lookup excluded), MLA's q.k and p.v over the causal average
context, KDA's recurrent 6 K V per head, x3 for forward + backward; the same counter for every family.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from openk3.config import K3Config, LinearAttnConfig, as_kimi_linear, hybrid_layers

HEAD = 32  # per-head width of every attention kind (nano's)
EXPERTS, TOP_K = 32, 4  # K3's small-scale routing (nano); plain-MoE families take half of each (latent = d/2)


def k3_config(width: int, layers: int, vocab: int = 512) -> K3Config:
    """K3's layout at hidden size `width` (a multiple of 32) and `layers` (4m+1 keeps K3's 3:1 hybrid)."""
    if width % HEAD or width < HEAD:
        raise ValueError(f"width must be a positive multiple of {HEAD}, got {width}")
    if layers < 2:
        raise ValueError(f"layers must be >= 2, got {layers}")
    heads = width // HEAD
    return K3Config(
        vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, q_lora_rank=width // 2, kv_lora_rank=max(16, width // 4), qk_nope_head_dim=HEAD,
        qk_rope_head_dim=HEAD // 2, v_head_dim=HEAD, mla_use_nope=True, mla_use_output_gate=True,
        max_position_embeddings=4096, hidden_act="situ", intermediate_size=4 * width, first_k_dense_replace=1,
        moe_layer_freq=1, num_experts=EXPERTS, num_experts_per_token=TOP_K, num_shared_experts=2,
        moe_intermediate_size=width // 2, routed_expert_hidden_size=width // 2, latent_moe_use_norm=True,
        attn_res_block_size=max(2, layers // 3),
        linear_attn_config=LinearAttnConfig(num_heads=heads, head_dim=HEAD, short_conv_kernel_size=4,
                                            gate_lower_bound=-5.0, use_full_rank_gate=True,
                                            full_attn_layers=hybrid_layers(layers)))


def _all_mla(cfg: K3Config) -> dict:
    return {"linear_attn_config.full_attn_layers": list(range(1, cfg.num_hidden_layers + 1)),
            "linear_attn_config.kda_layers": None}  # (derived again: no KDA layer left)


def _plain_moe(cfg: K3Config) -> dict:
    return dict(routed_expert_hidden_size=None, latent_moe_use_norm=False, num_experts=EXPERTS // 2,
                num_experts_per_token=TOP_K // 2)


def _k2(cfg: K3Config) -> K3Config:
    return cfg.replace(mla_use_nope=False, mla_use_output_gate=False, hidden_act="silu", attn_res_block_size=None,
                       num_shared_experts=1, **_plain_moe(cfg), **_all_mla(cfg))


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    summary: str
    recipe: Callable[[K3Config], K3Config]  # K3's config at (width, layers) -> this family's
    # the FFN knob matched to k3's FLOPs/token: "moe_intermediate_size", "intermediate_size" or None
    match: str | None = None
    train_overrides: dict = dataclasses.field(default_factory=dict)  # TrainConfig keys (optimizer, balancing)

    def config(self, width: int, layers: int, vocab: int = 512, seq_len: int = 256) -> K3Config:
        """This family at (width, layers), cost-matched to k3 where `match` says (module docstring)."""
        return matched_config(self.name, width, layers, vocab, seq_len)


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("k3", "Kimi K3: 3:1 KDA:MLA hybrid, Block AttnRes, Stable LatentMoE, SiTU-GLU, QB, Per-Head Muon",
           lambda c: c),
    Family("k2-style", "Kimi K2 / DeepSeek-V3 layout: all-MLA with RoPE, PreNorm residual, plain MoE at width d "
           "(half K3's experts and top-k), 1 shared expert, SwiGLU, sign-rule balancing, Muon",
           _k2, match="moe_intermediate_size", train_overrides={"balance": "sign"}),
    Family("kimi-linear-style", "Kimi Linear: 3:1 KDA:MLA, no AttnRes, plain MoE at width d, SwiGLU",
           lambda c: as_kimi_linear(c).replace(**_plain_moe(c)), match="moe_intermediate_size"),
    Family("dense", "dense anchor: k2-style attention and residual, a dense SwiGLU FFN in every layer",
           lambda c: _k2(c).replace(first_k_dense_replace=c.num_hidden_layers), match="intermediate_size",
           train_overrides={"balance": "sign"}),
    Family("k3-no-attnres", "K3 with the standard residual stream instead of Block AttnRes",
           lambda c: c.replace(attn_res_block_size=None)),
    Family("k3-no-latent-moe", "K3 with a plain MoE at width d (half the experts and top-k) instead of LatentMoE",
           lambda c: c.replace(**_plain_moe(c)), match="moe_intermediate_size"),
    Family("k3-swiglu", "K3 with SwiGLU instead of SiTU-GLU", lambda c: c.replace(hidden_act="silu")),
    # RoPE: with no KDA layer left, NoPE attention has no position signal but the causal mask (the first run of
    # this arm, NoPE, stayed at 3.6-3.8 bits/byte at every size: docs/scaling.md); Kimi Linear's full-attention
    # baseline is a standard (rotary) MLA model
    Family("k3-all-mla", "K3 with gated MLA with RoPE in every layer (no KDA)",
           lambda c: c.replace(mla_use_nope=False, **_all_mla(c))),
    Family("k3-1to1", "K3 with a 1:1 KDA:MLA ratio (MLA in every second layer and the last) instead of 3:1",
           lambda c: c.replace(**{"linear_attn_config.full_attn_layers":
                                  sorted(set(range(2, c.num_hidden_layers + 1, 2)) | {c.num_hidden_layers}),
                                  "linear_attn_config.kda_layers": None})),
    Family("k3-adamw", "K3 trained with AdamW for every parameter instead of Per-Head Muon", lambda c: c,
           train_overrides={"optim.muon": False}),
)}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r} (families: {', '.join(FAMILIES)})")
    return FAMILIES[name]


@functools.lru_cache(maxsize=256)
def flops_per_token(cfg_json: str, seq_len: int) -> int:
    """Training FLOPs/token of the config (its JSON form, so it can be cached), counted on the meta device."""
    import json

    import torch

    from openk3.model import accounting
    from openk3.model.model import K3ForCausalLM

    cfg = K3Config.from_dict(json.loads(cfg_json))
    with torch.device("meta"):
        model = K3ForCausalLM(cfg)
    return accounting.flops_per_token(model, seq_len, training=True)


def config_flops(cfg: K3Config, seq_len: int) -> int:
    import json

    return flops_per_token(json.dumps(cfg.to_dict(), sort_keys=True), seq_len)


@functools.lru_cache(maxsize=256)
def matched_config(name: str, width: int, layers: int, vocab: int = 512, seq_len: int = 256) -> K3Config:
    fam = family(name)
    base = k3_config(width, layers, vocab)
    cfg = fam.recipe(base)
    if fam.match is None:
        return cfg
    target = config_flops(base, seq_len)
    # FLOPs are linear in the knob: two evaluations give the slope; round to the nearest integer >= 1
    lo_v = 1
    hi_v = max(2, getattr(cfg, fam.match))
    f_lo = config_flops(cfg.replace(**{fam.match: lo_v}), seq_len)
    f_hi = config_flops(cfg.replace(**{fam.match: hi_v}), seq_len)
    slope = (f_hi - f_lo) / (hi_v - lo_v)
    assert slope > 0, (name, fam.match)
    best = max(1, round(lo_v + (target - f_lo) / slope))
    return cfg.replace(**{fam.match: best})
