"""Bridges to peer implementations, used as correctness oracles and speed baselines.

`to_transformers(model)` rebuilds an openk3 `K3ForCausalLM` whose config is in Kimi-Linear form (see
`openk3.config.as_kimi_linear`) as transformers' `KimiLinearForCausalLM` with the same weights, in fp32 (or
bf16 with the release's fp32 tensors kept fp32: `dtype=`).
transformers is a dev/test extra, so it is imported lazily inside the functions.

Parameter name mapping, openk3 (Moonshot checkpoint names) -> transformers 5.x, per layer prefix
`model.layers.{i}.`; everything not listed keeps its name:

| openk3 | transformers |
|---|---|
| `self_attn.{q,k,v}_conv1d.weight` [P, 1, W] each | `self_attn.conv1d.weight` [3P, 1, W] = cat(q, k, v) |
| `self_attn.f_a_proj.weight`, `self_attn.f_b_proj.weight` | `self_attn.forget_gate.f_{a,b}_proj.weight` |
| `self_attn.dt_bias` [P] | `self_attn.forget_gate.dt_bias` [P] |
| `self_attn.A_log` [ceil(H/128)*128], per head, 0-padded | `self_attn.forget_gate.A_log` [1, 1, H, 1], pads dropped |
| `block_sparse_moe.gate.{weight,e_score_correction_bias}` | `mlp.gate.{weight,e_score_correction_bias}` |
| `block_sparse_moe.experts.w1` (gate), `.w3` (up) [E, I, D] | `mlp.experts.gate_up_proj` [E, 2I, D] = cat(w1, w3) |
| `block_sparse_moe.experts.w2` (down) [E, D, I] | `mlp.experts.down_proj` [E, D, I] |
| `block_sparse_moe.shared_experts.*` | `mlp.shared_experts.*` |

Config mapping (`transformers_config`): `num_experts` -> `num_local_experts`, `num_experts_per_token` ->
`num_experts_per_tok`, `moe_renormalize` -> `norm_topk_prob`, `num_shared_experts` -> `n_shared_experts`,
`num_expert_group` -> `n_group`; the hybrid layout is passed as explicit `layer_types` (from the 1-indexed
`linear_attn_config.full_attn_layers`) and `mlp_layer_types` (from `first_k_dense_replace` and
`moe_layer_freq`). Token ids outside the vocabulary (the release's bos/eos/pad ids in a small test vocabulary)
become None. transformers builds the MLA latent norms with eps 1e-6; a different `mla_latent_norm_eps` is
written into those modules after construction.

In bf16 (`dtype=torch.bfloat16`) the peer rounds where openk3 does (tests/test_peer_bf16.py) except at one
point, where openk3 follows the released model's code (spec §4.4 step 5): transformers computes KDA's
beta = sigmoid(b_proj x) on the bf16 projection and so rounds beta to bf16; the release computes it in fp32.
transformers' non-default "eager" experts also sum the weighted expert outputs in bf16 instead of fp32.
"""

from __future__ import annotations

from typing import Any

import torch

from openk3.config_rules import k3_special_id

__all__ = ["check_kimi_linear_form", "to_transformers", "to_transformers_state_dict", "transformers_config"]


def check_kimi_linear_form(cfg) -> None:
    """Raise ValueError naming the first K3-only feature (or RoPE MLA) that transformers' KimiLinear cannot express."""
    la = cfg.linear_attn_config
    k3_only = [
        ("attn_res_block_size", cfg.attn_res_block_size is not None, "Block Attention Residuals"),
        ("routed_expert_hidden_size", cfg.routed_expert_hidden_size is not None, "Latent MoE"),
        ("latent_moe_use_norm", bool(cfg.latent_moe_use_norm), "Latent MoE norm"),
        ("linear_attn_config.gate_lower_bound", la.gate_lower_bound is not None, "bounded sigmoid decay gate"),
        ("linear_attn_config.use_full_rank_gate", bool(la.use_full_rank_gate), "full-rank KDA output gate"),
        ("mla_use_output_gate", bool(cfg.mla_use_output_gate), "MLA sigmoid output gate"),
        ("hidden_act", cfg.hidden_act != "silu", f"activation {cfg.hidden_act!r} (SiTU-GLU)"),
        ("num_shared_experts", cfg.num_shared_experts < 1, "MoE without shared experts"),
    ]
    for name, used, what in k3_only:
        if used:
            raise ValueError(f"config field {name!r} selects a K3-only feature ({what}) that transformers' "
                             f"KimiLinear does not implement; convert the config with openk3.config.as_kimi_linear")
    if not cfg.mla_use_nope:
        raise ValueError("config field 'mla_use_nope' is false (RoPE MLA, the K2-style baseline): transformers' "
                         "KimiLinear implements NoPE MLA only")


def _token_id(value: Any, vocab: int) -> Any:
    """A special-token id, or None where it falls outside a (small test) vocabulary."""
    if isinstance(value, int) and 0 <= value < vocab:
        return value
    if isinstance(value, list):
        kept = [v for v in value if isinstance(v, int) and 0 <= v < vocab]
        return kept or None
    return None


def transformers_config(cfg, *, attn_implementation: str = "eager"):
    """The `KimiLinearConfig` of an openk3 `K3Config` in Kimi-Linear form (raises ValueError otherwise)."""
    from transformers import KimiLinearConfig

    check_kimi_linear_form(cfg)
    la = cfg.linear_attn_config
    L, vocab = cfg.num_hidden_layers, cfg.vocab_size
    hf = KimiLinearConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        moe_intermediate_size=cfg.moe_intermediate_size, num_hidden_layers=L,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        num_shared_experts=cfg.num_shared_experts, routed_scaling_factor=cfg.routed_scaling_factor,
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim, num_expert_group=cfg.num_expert_group,
        topk_group=cfg.topk_group, num_experts=cfg.num_experts, num_experts_per_token=cfg.num_experts_per_token,
        # transformers renormalises even a single expert's weight to 1; the release (and spec §4.6) only when
        # top-k > 1, so at top-1 the peer is told not to
        moe_renormalize=cfg.moe_renormalize and cfg.num_experts_per_token > 1, hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        pad_token_id=None, bos_token_id=_token_id(cfg.extra.get("bos_token_id", k3_special_id(vocab, "bos_token_id")),
                                                  vocab),
        eos_token_id=_token_id(cfg.eos_token_id, cfg.vocab_size), tie_word_embeddings=False,
        layer_types=["full_attention" if cfg.is_mla_layer(i) else "linear_attention" for i in range(L)],
        mlp_layer_types=["sparse" if cfg.is_moe_layer(i) else "dense" for i in range(L)],
        linear_attn_config={"num_heads": la.num_heads, "head_dim": la.head_dim,
                            "short_conv_kernel_size": la.short_conv_kernel_size,
                            "full_attn_layers": list(la.full_attn_layers), "kda_layers": list(la.kda_layers)},
        first_k_dense_replace=cfg.first_k_dense_replace,
    )
    hf._attn_implementation = attn_implementation
    return hf


def to_transformers_state_dict(model) -> dict[str, torch.Tensor]:
    """openk3 state dict -> transformers KimiLinear state dict (fp32 copies), following the table above."""
    cfg = model.config
    H = cfg.linear_attn_config.num_heads
    src = {k: v.detach().to(torch.float32) for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for name in list(src):
        if name not in src:  # consumed together with a sibling below
            continue
        t = src.pop(name)
        prefix, _, leaf = name.rpartition("self_attn.")
        if leaf in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"):
            convs = [t if leaf.startswith(x) else src.pop(f"{prefix}self_attn.{x}_conv1d.weight") for x in "qkv"]
            out[f"{prefix}self_attn.conv1d.weight"] = torch.cat(convs, dim=0)
        elif leaf in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias"):
            out[f"{prefix}self_attn.forget_gate.{leaf}"] = t
        elif leaf == "A_log":
            out[f"{prefix}self_attn.forget_gate.A_log"] = t[:H].reshape(1, 1, H, 1).clone()
        elif ".block_sparse_moe." in name:
            prefix, _, leaf = name.partition(".block_sparse_moe.")
            if leaf in ("experts.w1", "experts.w3"):
                w1 = t if leaf == "experts.w1" else src.pop(f"{prefix}.block_sparse_moe.experts.w1")
                w3 = t if leaf == "experts.w3" else src.pop(f"{prefix}.block_sparse_moe.experts.w3")
                out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.cat([w1, w3], dim=1)
            elif leaf == "experts.w2":
                out[f"{prefix}.mlp.experts.down_proj"] = t
            else:  # gate.weight, gate.e_score_correction_bias, shared_experts.*
                out[f"{prefix}.mlp.{leaf}"] = t
        else:
            out[name] = t
    return out


# transformers names of the tensors the release stores in fp32 (openk3.model.model.FP32_NAMES): kept fp32 by
# `to_transformers(dtype=torch.bfloat16)`, as a loader that respects the checkpoint's dtypes leaves them. Each
# transformers module computes with them in fp32: the conv upcasts its input to the weight's dtype and casts the
# SiLU output back, the forget gate and the gated o_norm call .float(), the router adds the bias to fp32 scores.
FP32_TRANSFORMERS_NAMES = ("self_attn.conv1d.weight", "forget_gate.A_log", "forget_gate.dt_bias",
                           "self_attn.o_norm.weight", "e_score_correction_bias")


_KIMI_LINEAR = "transformers.models.kimi_linear.modeling_kimi_linear"


def _reference_kimi_linear():
    """transformers' `KimiLinearForCausalLM` on its reference PyTorch path.

    transformers runs KDA and the short convolution through fla's Triton kernels whenever `import fla` works
    (decided once, when its modeling module is imported), also for CPU tensors, where they cannot run without a GPU
    driver (with triton installed: openk3's `triton` test tier) or run under Triton's interpreter. The peer is
    meant to be the plain-torch implementation, so fla and causal_conv1d are hidden while that module is imported,
    and a module imported before with fla's kernels is an error rather than a silently different peer.
    """
    import importlib
    import sys

    if _KIMI_LINEAR not in sys.modules:
        hidden = {name: sys.modules.get(name) for name in ("fla", "causal_conv1d")}
        try:
            for name in hidden:
                sys.modules[name] = None  # `import fla` raises ImportError: transformers falls back to torch
            importlib.import_module(_KIMI_LINEAR)
        finally:
            for name, module in hidden.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module
    modeling = sys.modules[_KIMI_LINEAR]
    for fn_name in ("chunk_kimi_delta_attention", "causal_conv1d_fn"):
        fn = getattr(modeling, fn_name, None)
        cells = dict(zip(getattr(fn, "__code__", None) and fn.__code__.co_freevars or (), fn.__closure__ or ()))
        chosen = cells.get("implementation")
        if chosen is not None and chosen.cell_contents is not getattr(fn, "__wrapped__", None):
            raise RuntimeError(f"transformers' {_KIMI_LINEAR} was imported before openk3.peers with fla's kernels "
                               f"for {fn_name}; the peer must be its PyTorch path: use openk3.peers.to_transformers "
                               "before anything else imports KimiLinearForCausalLM")
    return modeling.KimiLinearForCausalLM


def to_transformers(model, *, experts_implementation: str | None = None, attn_implementation: str = "eager",
                    dtype: torch.dtype = torch.float32):
    """A transformers `KimiLinearForCausalLM` (eval mode) with exactly the weights of `model`.

    Args:
        model: an openk3 `K3ForCausalLM` whose config is in Kimi-Linear form.
        experts_implementation: passed to `set_experts_implementation` ("eager", "grouped_mm",
            "batched_mm"); None keeps transformers' default.
        attn_implementation: MLA attention kernel ("eager" is the fp32-softmax reference).
        dtype: the peer's dtype; with bfloat16 the `FP32_TRANSFORMERS_NAMES` tensors stay fp32 with the
            values of `model` (rounding them first would make the peer a different model).

    Raises:
        ValueError: naming the config field of a K3-only feature, or on a weight-name/shape mismatch.
    """
    KimiLinearForCausalLM = _reference_kimi_linear()

    hf_cfg = transformers_config(model.config, attn_implementation=attn_implementation)
    with torch.device("meta"):
        hf = KimiLinearForCausalLM(hf_cfg)
    island = torch.promote_types(dtype, torch.float32)  # fp32, or float64 for a float64 peer
    sd = {k: v.to(island if k.endswith(FP32_TRANSFORMERS_NAMES) else dtype)
          for k, v in to_transformers_state_dict(model).items()}
    expected = hf.state_dict()
    missing, unexpected = sorted(set(expected) - set(sd)), sorted(set(sd) - set(expected))
    wrong = [f"{k}: {tuple(sd[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items()
             if k in sd and sd[k].shape != v.shape]
    if missing or unexpected or wrong:
        raise ValueError(f"weight mapping mismatch: missing {missing}, unexpected {unexpected}, shapes {wrong}")
    hf.load_state_dict(sd, strict=True, assign=True)
    eps = model.config.mla_latent_norm_eps
    for mod in hf.modules():
        if type(mod).__name__ == "KimiLinearAttention":
            for norm in (mod.q_a_layernorm, mod.kv_a_layernorm):
                if norm is not None:
                    norm.variance_epsilon = eps
    leftover = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if leftover:
        raise ValueError(f"tensors left uninitialised by the mapping: {leftover}")
    hf.config.dtype = dtype
    if experts_implementation is not None:
        hf.set_experts_implementation(experts_implementation)
    return hf.eval()
