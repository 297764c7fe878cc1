"""Which model the planner plans for: a preset, a config.json, overrides, and Kimi K2 for comparison.

`k2` is the planner's own preset: Kimi K2's published config.json (61 MLA layers, 1 dense, 384
experts top-8 + 1 shared, SwiGLU, no KDA, no AttnRes, no latent MoE) expressed as a `K3Config`. K2
rotates its 64 rope dims and openk3's model does not, but rotation changes no parameter, byte or
FLOP the planner counts, so the counts are K2's own.
"""

from __future__ import annotations

import json

from openk3.config import PRESETS, K3Config, LinearAttnConfig, preset

# Figures the vendors publish, printed next to ours (docs/planner.md explains the differences).
PUBLISHED = {
    "k3": {"total_params": 2.78e12, "active_params": 104.2e9,
           "source": "Kimi K3 report, Table 1 (2.78T total / 104.2B activated)"},
    "k2": {"total_params": 1.04e12, "active_params": 32.6e9,
           "source": "Kimi K2 report (arXiv 2507.20534) and K3 report Table 1 (1.04T / 32.6B)"},
}


# The formats each release ships (what `openk3 plan` prices unless told otherwise). K3: MXFP4 routed
# experts, bf16 elsewhere (spec §1.5). K2-Instruct: fp8 E4M3 with 128x128 block scales for the
# linear layers, the embedding and lm_head in bf16 (its quantization_config). Any other config is
# priced in K3's release formats.
RELEASE_FORMATS = {
    "k3": {"expert_format": "mxfp4", "trunk_format": "bf16", "embedding_format": "bf16"},
    "k2": {"expert_format": "fp8", "trunk_format": "fp8", "embedding_format": "bf16"},
}


def release_formats(name: str) -> dict:
    return RELEASE_FORMATS.get(name, RELEASE_FORMATS["k3"])


def k2() -> K3Config:
    """Kimi K2 (moonshotai/Kimi-K2-Instruct config.json) for counting and planning only."""
    return K3Config(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        intermediate_size=18432, first_k_dense_replace=1, moe_layer_freq=1, num_experts=384,
        num_experts_per_token=8, num_shared_experts=1, moe_intermediate_size=2048, routed_scaling_factor=2.827,
        hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-6,
        linear_attn_config=LinearAttnConfig(num_heads=64, head_dim=128, full_attn_layers=list(range(1, 62))),
    )


PLAN_PRESETS = {**PRESETS, "k2": k2}


def plan_preset(name: str) -> K3Config:
    return k2() if name == "k2" else preset(name)


def parse_overrides(items: list[str] | None) -> dict:
    """`["num_experts=64", "linear_attn_config.head_dim=64"]` -> dict; values are JSON (bare words are strings)."""
    out = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like field=value (e.g. num_experts=64)")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out


def resolve(preset_name: str | None = None, config_path: str | None = None,
            overrides: list[str] | None = None) -> tuple[K3Config, str]:
    """The config to plan for and a display name; overrides apply on top (re-validated)."""
    if config_path:
        cfg, name = K3Config.from_json(config_path), config_path
    else:
        name = preset_name or "k3"
        cfg = plan_preset(name)
    changes = parse_overrides(overrides)
    if changes:
        cfg = cfg.replace(**changes)
        name += " (" + ", ".join(f"{k}={v}" for k, v in changes.items()) + ")"
    return cfg, name
