"""An independent writer of tiny Kimi K3 release-format checkpoints, from the spec alone.

Written from `k3-architecture.md` §1-§2 and §6 without importing anything from openk3, so that
openk3's loader can be checked against files it did not produce. `write_checkpoint` draws random
tensors at realistic scales, names them exactly as the release does (prefix `language_model.`,
routed experts per expert), stores each in the release's dtype (F32 for conv weights, `A_log`,
`dt_bias`, KDA `o_norm` and the router correction bias; BF16 otherwise) and writes a top-level
`kimi_k3` config.json with the text model in `text_config` (plus a small `vision_config` and two
vision tensors that a text loader must set aside), generation_config.json, shards and an index.

Routed experts are drawn as MXFP4 codes and E8M0 scale bytes whatever the output format; the bf16
format stores this module's own exact decode of them, so both formats hold the same model.
"""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import save_file

PREFIX = "language_model."
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

QUANTIZATION_CONFIG = {  # spec §1.5, verbatim structure
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "global_compression_ratio": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "format": "mxfp4-pack-quantized",
            "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                        "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": None,
                        "observer": "minmax"},
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}


def tiny_text_config(**changes) -> dict:
    """A K3-form `text_config` (release field names) small enough for a float64 reference.

    Deliberately unlike openk3's presets: MLA heads (3) != KDA heads (4), v_head_dim (24) !=
    qk_nope_head_dim (16), latent width (32) != hidden (64) != expert width (64). 9 layers, MLA at
    1-idx 4, 8, 9 (ends MLA, MLA); AttnRes snapshots at 0-idx 0, 3, 6 (final partial block 6..8).
    """
    layers = 9
    full = [4, 8, 9]
    cfg = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": 101,
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 3,
        "num_key_value_heads": 3,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 24,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "max_position_embeddings": 4096,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "intermediate_size": 96,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_experts": 8,
        "num_experts_per_token": 3,
        "num_shared_experts": 2,
        "moe_intermediate_size": 64,
        "routed_expert_hidden_size": 32,
        "latent_moe_use_norm": True,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "rms_norm_eps": 1e-5,
        "attn_res_block_size": 3,
        "num_nextn_predict_layers": 0,
        "tie_word_embeddings": False,
        "eos_token_id": 100,  # inside the vocabulary (101 ids are too few for K3's 256 reserved ones)
        "dtype": "bfloat16",
        "linear_attn_config": {
            "num_heads": 4,
            "head_dim": 16,
            "short_conv_kernel_size": 4,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": True,
            "full_attn_layers": full,
            "kda_layers": [i for i in range(1, layers + 1) if i not in full],
        },
    }
    cfg.update(changes)
    return cfg


def tiny_kimi_linear_config() -> dict:
    """The same shapes in the predecessor's (Kimi-Linear-48B) form: a bare `kimi_linear` config.json.

    Softplus decay gate, low-rank KDA output gate, no MLA output gate and no q low-rank (as the 48B),
    SwiGLU, plain residual stream, full-width experts, routed_scaling_factor 2.446 (the 48B's).
    """
    cfg = tiny_text_config(hidden_act="silu", mla_use_output_gate=False, q_lora_rank=None, routed_scaling_factor=2.446)
    for k in ("attn_res_block_size", "routed_expert_hidden_size", "latent_moe_use_norm", "activation_situ_beta",
              "activation_situ_linear_beta"):
        del cfg[k]
    cfg["linear_attn_config"] = {**cfg["linear_attn_config"], "use_full_rank_gate": False}
    del cfg["linear_attn_config"]["gate_lower_bound"]
    cfg["bos_token_id"], cfg["pad_token_id"] = 1, 0
    return cfg


def wrapper_config(text_config: dict) -> dict:
    """The top-level `kimi_k3` config.json around a text_config (spec §1.2), with a toy vision block."""
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "bos_token_id": 98,  # the release's 163584/163586/163839/163605 lie outside the tiny vocabulary
        "eos_token_id": text_config["eos_token_id"],
        "pad_token_id": 99,
        "media_placeholder_token_id": 97,
        "image_placeholder": "<|kimi_image_placeholder|>",
        "tie_word_embeddings": False,
        "ignore_index": -100,
        "text_config": text_config,
        "vision_config": {"patch_size": 14, "vt_hidden_size": 32, "vt_intermediate_size": 64,
                          "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1, "merge_kernel_size": [2, 2],
                          "merge_type": "sd2_tpool", "mm_projector_type": "patchmergerv2",
                          "mm_hidden_size": 32, "text_hidden_size": text_config["hidden_size"]},
    }


# ---- MXFP4 (spec §6), this module's own encoder-free pack: codes and scale bytes are drawn -------

def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, in] (0..15) -> bytes [out, in/2]: element 2i low nibble, 2i+1 high nibble."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def decode_codes(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes [out, in] and E8M0 bytes [out, in/32] -> exact bf16 values."""
    table = torch.tensor(E2M1, dtype=torch.float64)
    scale = torch.pow(2.0, scale_bytes.to(torch.float64) - 127).repeat_interleave(32, dim=1)
    return (table[codes.long()] * scale).to(torch.bfloat16)


def _draw_expert(gen: torch.Generator, out: int, inp: int, zero_group: bool) -> tuple[torch.Tensor, torch.Tensor]:
    assert inp % 32 == 0, "MXFP4 groups are 32 wide along the input dim"
    codes = torch.randint(0, 16, (out, inp), generator=gen, dtype=torch.uint8)
    scales = torch.randint(119, 124, (out, inp // 32), generator=gen, dtype=torch.uint8)  # 2^-8 .. 2^-4
    if zero_group:  # an all-zero group (with -0 codes) probes re-encoders' amax == 0 case
        codes[0, :32] = torch.tensor([0, 8] * 16, dtype=torch.uint8)
    return codes, scales


# ---- tensors (spec §2) ---------------------------------------------------------------------------

def make_tensors(text_config: dict, seed: int = 0, experts_format: str = "bf16",
                 pre: str = PREFIX) -> dict[str, torch.Tensor]:
    """Every text tensor of the checkpoint, keyed by its file name (`pre` = `language_model.` or "")."""
    assert experts_format in ("bf16", "mxfp4")
    c = text_config
    la = c["linear_attn_config"]
    gen = torch.Generator().manual_seed(seed)
    H, V, L = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    kh, kd = la["num_heads"], la["head_dim"]
    P = kh * kd
    out: dict[str, torch.Tensor] = {}

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def mat(name, rows, cols, gain=1.0):  # BF16 [out, in], std gain/sqrt(in) (0.09-0.18 here)
        out[pre + name] = (randn(rows, cols) * gain / math.sqrt(cols)).to(torch.bfloat16)

    def gain(name, n, dtype=torch.bfloat16):  # a norm weight around 1
        out[pre + name] = (1 + 0.15 * randn(n)).to(dtype)

    def vec(name, shape, std, dtype):
        out[pre + name] = (std * randn(*shape)).to(dtype)

    use_res = c.get("attn_res_block_size") is not None
    out[pre + "model.embed_tokens.weight"] = (0.7 * randn(V, H)).to(torch.bfloat16)
    for i in range(L):
        p = f"model.layers.{i}."
        gain(p + "input_layernorm.weight", H)
        gain(p + "post_attention_layernorm.weight", H)
        if use_res:
            for site in ("self_attention", "mlp"):
                gain(p + f"{site}_res_norm.weight", H)
                vec(p + f"{site}_res_proj.weight", (1, H), 0.15, torch.bfloat16)  # non-uniform mixing
        a = p + "self_attn."
        if (i + 1) in la["full_attn_layers"]:  # gated NoPE MLA
            nh, dn, dr, dv = c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
            if c.get("q_lora_rank"):
                mat(a + "q_a_proj.weight", c["q_lora_rank"], H)
                gain(a + "q_a_layernorm.weight", c["q_lora_rank"])
                mat(a + "q_b_proj.weight", nh * (dn + dr), c["q_lora_rank"], gain=2.0)
            else:
                mat(a + "q_proj.weight", nh * (dn + dr), H, gain=2.0)
            mat(a + "kv_a_proj_with_mqa.weight", c["kv_lora_rank"] + dr, H)
            gain(a + "kv_a_layernorm.weight", c["kv_lora_rank"])
            mat(a + "kv_b_proj.weight", nh * (dn + dv), c["kv_lora_rank"], gain=2.0)
            if c.get("mla_use_output_gate"):
                mat(a + "g_proj.weight", nh * dv, H, gain=2.0)
            mat(a + "o_proj.weight", H, nh * dv)
        else:  # KDA
            for x in "qkv":
                mat(a + f"{x}_proj.weight", P, H)
            for x in "qkv":
                vec(a + f"{x}_conv1d.weight", (P, 1, la["short_conv_kernel_size"]), 0.5, torch.float32)
            mat(a + "f_a_proj.weight", kd, H)
            mat(a + "f_b_proj.weight", P, kd)
            mat(a + "b_proj.weight", kh, H, gain=2.0)
            a_log = torch.zeros(math.ceil(kh / 128) * 128, dtype=torch.float32)
            a_log[:kh] = (0.6 * randn(kh)).float()  # per head, zero padded
            if la.get("gate_lower_bound") is None:  # Kimi-Linear stores A_log [1, 1, heads, 1], no padding
                a_log = a_log[:kh].reshape(1, 1, kh, 1).clone()
            out[pre + a + "A_log"] = a_log
            vec(a + "dt_bias", (P,), 0.7, torch.float32)
            if la.get("use_full_rank_gate"):
                mat(a + "g_proj.weight", P, H, gain=2.0)
            else:
                mat(a + "g_a_proj.weight", kd, H)
                mat(a + "g_b_proj.weight", P, kd, gain=2.0)
            gain(a + "o_norm.weight", kd, torch.float32)
            mat(a + "o_proj.weight", H, P)
        if i < c["first_k_dense_replace"] or i % c["moe_layer_freq"] != 0:
            mat(p + "mlp.gate_proj.weight", c["intermediate_size"], H, gain=2.0)
            mat(p + "mlp.up_proj.weight", c["intermediate_size"], H, gain=2.0)
            mat(p + "mlp.down_proj.weight", H, c["intermediate_size"])
            continue
        m = p + "block_sparse_moe."
        E, inter = c["num_experts"], c["moe_intermediate_size"]
        lat = c.get("routed_expert_hidden_size") or H
        mat(m + "gate.weight", E, H, gain=2.0)
        vec(m + "gate.e_score_correction_bias", (E,), 0.15, torch.float32)  # steers selection only
        if c.get("routed_expert_hidden_size"):
            mat(m + "routed_expert_down_proj.weight", lat, H)
            if c.get("latent_moe_use_norm"):
                gain(m + "routed_expert_norm.weight", lat)
            mat(m + "routed_expert_up_proj.weight", H, lat)
        sh = inter * c["num_shared_experts"]
        mat(m + "shared_experts.gate_proj.weight", sh, H, gain=2.0)
        mat(m + "shared_experts.up_proj.weight", sh, H, gain=2.0)
        mat(m + "shared_experts.down_proj.weight", H, sh)
        for e in range(E):
            for w, (rows, cols) in (("w1", (inter, lat)), ("w2", (lat, inter)), ("w3", (inter, lat))):
                codes, scales = _draw_expert(gen, rows, cols, zero_group=(e == 1 and w == "w2"))
                name = pre + m + f"experts.{e}.{w}."
                if experts_format == "mxfp4":
                    out[name + "weight_packed"] = pack_codes(codes)
                    out[name + "weight_scale"] = scales
                else:
                    out[name + "weight"] = decode_codes(codes, scales)
    gain("model.norm.weight", H)
    if use_res:
        gain("model.output_attn_res_norm.weight", H)
        vec("model.output_attn_res_proj.weight", (1, H), 0.15, torch.bfloat16)
    mat("lm_head.weight", V, H, gain=2.0)
    return out


def vision_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two stand-in vision tensors (no prefix, as in the release) that a text loader must ignore."""
    gen = torch.Generator().manual_seed(seed + 1)
    return {"vision_tower.patch_embed.proj.weight": torch.randn(32, 3, 14, 14, generator=gen).to(torch.bfloat16),
            "mm_projector.proj.0.weight": torch.randn(64, 128, generator=gen).to(torch.bfloat16)}


def write_checkpoint(path: str, text_config: dict | None = None, *, seed: int = 0, experts_format: str = "bf16",
                     num_shards: int = 3, wrapper: bool = True) -> dict[str, torch.Tensor]:
    """Write a release-format folder; returns the text tensors written (file names -> tensors).

    Tensors go to `num_shards` shards (`model-0000i-of-0000n.safetensors` + index; 1 = a single
    `model.safetensors`). Each layer's tensors go to one shard except routed experts, which are
    scattered over all shards out of id order, as in the release. `wrapper` False writes a bare
    `kimi_linear` config.json, tensors without prefix and no vision tensors (the Kimi-Linear release form).
    """
    text_config = text_config or tiny_text_config()
    if experts_format == "mxfp4":
        text_config = {**text_config, "quantization_config": QUANTIZATION_CONFIG}
    tensors = make_tensors(text_config, seed, experts_format, PREFIX if wrapper else "")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(wrapper_config(text_config) if wrapper else text_config, fh, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w") as fh:
        json.dump({"bos_token_id": 163584, "eos_token_id": 163586, "temperature": 1.0, "top_p": 1.0}, fh, indent=2)
    files = {**tensors, **(vision_tensors(seed) if wrapper else {})}
    if num_shards == 1:
        save_file(files, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return tensors
    gen = torch.Generator().manual_seed(seed + 2)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    for name, t in files.items():
        if ".experts." in name:
            k = int(torch.randint(0, num_shards, (1,), generator=gen))
        elif ".layers." in name:
            k = int(name.split(".layers.")[1].split(".")[0]) % num_shards
        else:
            k = num_shards - 1  # embedding, head, vision: the last shard
        shards[k][name] = t
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in files.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, fh, indent=2)
    return tensors
