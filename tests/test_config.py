"""Config: presets, the release's values (spec §1.3-1.6), JSON loading, validation, parameter counts."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

from openk3.config import PRESETS, K3Config, as_kimi_linear, k3, kimi_linear_48b, nano, preset
from openk3.config_rules import K3_REQUIRED_FIELDS, NUM_RESERVED_SPECIALS, SPECIAL_ID_OFFSETS, k3_special_id
from openk3.model.accounting import count_params, state_bytes
from openk3.model.model import K3ForCausalLM

PRESET_NAMES = ["nano", "small", "base", "k3", "kimi-linear-48b"]


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_presets_exist_and_validate(name):
    assert name in PRESETS
    cfg = preset(name)
    cfg.validate()
    la = cfg.linear_attn_config
    L = cfg.num_hidden_layers
    assert sorted(la.full_attn_layers + la.kda_layers) == list(range(1, L + 1))
    assert L in la.full_attn_layers, "the last layer is always full attention"


def test_preset_unknown_raises():
    with pytest.raises(ValueError, match="nope"):
        preset("nope")
    with pytest.raises(ValueError, match="did you mean 'nano'"):
        preset("nanp")


def test_preset_kl_suffix_is_kimi_linear_form():
    assert preset("nano-kl") == as_kimi_linear(nano())


def test_k3_values_equal_spec():
    c = k3()
    expect = dict(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=93, num_attention_heads=96, num_key_value_heads=96,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        mla_use_nope=True, mla_use_output_gate=True, max_position_embeddings=1048576, hidden_act="situ",
        activation_situ_beta=4.0, activation_situ_linear_beta=25.0, intermediate_size=33792,
        first_k_dense_replace=1, moe_layer_freq=1, num_experts=896, num_experts_per_token=16, num_shared_experts=2,
        moe_intermediate_size=3072, routed_expert_hidden_size=3584, latent_moe_use_norm=True,
        moe_router_activation_func="sigmoid", moe_renormalize=True, routed_scaling_factor=1.0, topk_method="noaux_tc",
        use_grouped_topk=True, num_expert_group=1, topk_group=1, rms_norm_eps=1e-5, attn_res_block_size=12,
        num_nextn_predict_layers=0, tie_word_embeddings=False, eos_token_id=163586, model_type="kimi_linear",
        architectures=["KimiLinearForCausalLM"],
    )
    got = {k: getattr(c, k) for k in expect}
    assert got == expect
    la = c.linear_attn_config
    assert (la.num_heads, la.head_dim, la.short_conv_kernel_size) == (96, 128, 4)
    assert la.gate_lower_bound == -5.0 and la.use_full_rank_gate is True
    assert la.full_attn_layers == list(range(4, 93, 4)) + [93]
    assert len(la.full_attn_layers) == 24 and len(la.kda_layers) == 69
    assert la.kda_layers == [i for i in range(1, 92) if i % 4 != 0]
    assert c.a_log_size == 128 and c.qk_head_dim == 192


def test_k3_layer_layout_is_one_indexed():
    c = k3()
    assert c.mla_layers == [3 + 4 * i for i in range(23)] + [92]
    assert c.mla_layers[-3:] == [87, 91, 92]
    assert [l for l in range(93) if c.is_mla_layer(l)] == c.mla_layers
    assert not c.is_mla_layer(0) and not c.is_mla_layer(4) and c.is_mla_layer(3)
    snaps = [l for l in range(93) if c.is_snapshot_layer(l)]
    assert snaps == [0, 12, 24, 36, 48, 60, 72, 84]
    assert not any(c.is_mla_layer(l) for l in snaps), "every K3 snapshot layer is a KDA layer"
    assert [l for l in range(93) if not c.is_moe_layer(l)] == [0]
    assert all(c.is_moe_layer(l) for l in range(1, 93))


def test_small_presets_layout_follow_configs_doc():
    n = nano()
    assert n.mla_layers == [3, 7, 8]
    assert [l for l in range(9) if n.is_snapshot_layer(l)] == [0, 3, 6]
    s = preset("small")
    assert s.mla_layers == [3, 7, 11, 12] and [l for l in range(13) if s.is_snapshot_layer(l)] == [0, 5, 10]
    b = preset("base")
    assert b.mla_layers == [3, 7, 11, 15, 19, 20] and [l for l in range(21) if b.is_snapshot_layer(l)] == [0, 8, 16]


# ---- JSON loading ------------------------------------------------------------------------------

def _k3_wrapper() -> dict:
    text = k3().to_dict()
    text["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
        "kv_cache_scheme": None, "global_compression_ratio": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "mxfp4-pack-quantized",
                                      "weights": {"num_bits": 4, "type": "float", "strategy": "group",
                                                  "group_size": 32, "symmetric": True, "dynamic": False}}},
        "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*lm_head.*"],
    }
    text["dtype"] = "bfloat16"
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        "media_placeholder_token_id": 163605, "image_placeholder": "<|kimi_image_placeholder|>",
        "tie_word_embeddings": False, "ignore_index": -100, "text_config": text,
        "vision_config": {"patch_size": 14, "vt_hidden_size": 1024, "vt_num_hidden_layers": 27,
                          "merge_kernel_size": [2, 2], "text_hidden_size": 7168},
    }


def _kimi_linear_48b_json() -> dict:
    """Shaped like the Kimi-Linear-48B-A3B config.json, metadata keys included."""
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                     "AutoModel": "modeling_kimi.KimiLinearModel",
                     "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        "first_k_dense_replace": 1, "head_dim": 72, "hidden_act": "silu", "hidden_size": 2304,
        "initializer_range": 0.02, "intermediate_size": 9216, "kv_lora_rank": 512,
        "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
                               "kda_layers": [i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                               "num_heads": 32, "short_conv_kernel_size": 4},
        "mla_use_nope": True, "model_max_length": 1048576, "model_type": "kimi_linear",
        "moe_intermediate_size": 1024, "moe_layer_freq": 1, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "num_attention_heads": 32, "num_expert_group": 1,
        "num_experts": 256, "num_experts_per_token": 8, "num_hidden_layers": 27, "num_key_value_heads": 32,
        "num_nextn_predict_layers": 0, "num_shared_experts": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 10000.0,
        "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16", "transformers_version": "4.56.2", "use_cache": True, "use_grouped_topk": True,
        "v_head_dim": 128, "vocab_size": 163840,
    }


def test_from_json_kimi_k3_wrapper(tmp_path):
    d = _k3_wrapper()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    cfg = K3Config.from_json(path)
    ref = k3()
    assert {k: v for k, v in cfg.__dict__.items() if k != "extra"} == {k: v for k, v in ref.__dict__.items()
                                                                        if k != "extra"}
    wrapper = cfg.extra["_wrapper"]
    assert "text_config" not in wrapper
    assert wrapper["vision_config"] == d["vision_config"] and wrapper["model_type"] == "kimi_k3"
    assert cfg.extra["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert cfg.extra["dtype"] == "bfloat16"


def test_from_dict_bare_kimi_linear_with_metadata():
    d = _kimi_linear_48b_json()
    cfg = K3Config.from_dict(d)
    assert cfg.hidden_size == 2304 and cfg.q_lora_rank is None and cfg.linear_attn_config.gate_lower_bound is None
    assert cfg.mla_layers == [3, 7, 11, 15, 19, 23, 26]
    for key in ("model_max_length", "head_dim", "rope_theta", "auto_map", "torch_dtype"):
        assert cfg.extra[key] == d[key]
    assert cfg == K3Config.from_dict(kimi_linear_48b().to_dict() | {k: d[k] for k in cfg.extra})
    ref = kimi_linear_48b()
    assert {k: v for k, v in cfg.__dict__.items() if k != "extra"} == {k: v for k, v in ref.__dict__.items()
                                                                        if k != "extra"}


def test_from_dict_missing_required_field_is_named():
    d = nano().to_dict()
    del d["kv_lora_rank"]
    with pytest.raises(ValueError, match="kv_lora_rank"):
        K3Config.from_dict(d)
    d = nano().to_dict()
    del d["linear_attn_config"]["num_heads"]
    with pytest.raises(ValueError, match="num_heads"):
        K3Config.from_dict(d)


def test_unknown_fields_are_kept_with_a_warning_and_written_back(tmp_path):
    """The release's config may carry keys the spec does not list: kept (warning naming file and keys,
    with a suggestion for a near miss), at every level, and written back by to_dict and by a save."""
    from openk3.checkpoint.layout import config_files

    d = nano().to_dict()
    d["num_expert_per_token"] = 4
    d["linear_attn_config"]["gate_lower_bnd"] = -5.0
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    with pytest.warns(UserWarning, match=rf"{re.escape(str(path))}: unknown field\(s\) num_expert_per_token "
                                         r"\(did you mean 'num_experts_per_token'\?\)"):
        with pytest.warns(UserWarning, match=r"linear_attn_config\.gate_lower_bnd"):
            cfg = K3Config.from_json(path)
    assert cfg.num_experts_per_token == 4 and cfg.extra["num_expert_per_token"] == 4
    out = cfg.to_dict()
    assert out["num_expert_per_token"] == 4 and out["linear_attn_config"]["gate_lower_bnd"] == -5.0
    cfg.to_json(tmp_path / "again.json")
    with pytest.warns(UserWarning):
        assert K3Config.from_json(tmp_path / "again.json") == cfg
    w = _k3_wrapper()
    w["audio_config"] = {"layers": 2}
    w["text_config"]["moe_new_knob"] = 1
    with pytest.warns(UserWarning, match="top-level audio_config"):
        with pytest.warns(UserWarning, match="moe_new_knob"):
            cfg = K3Config.from_dict(w, source="w.json")
    top, _ = config_files(cfg, wrapper=True, experts_format="bf16", dtype=torch.bfloat16)
    assert top["audio_config"] == {"layers": 2} and top["text_config"]["moe_new_knob"] == 1
    bare, _ = config_files(cfg, wrapper=False, experts_format="bf16", dtype=torch.bfloat16)
    assert bare["moe_new_knob"] == 1


def test_missing_required_field_names_a_likely_typo():
    """Unknown keys only warn now, so a misspelt required field is named in the missing-field error."""
    d = nano().to_dict()
    d["hidden_sise"] = d.pop("hidden_size")
    with pytest.warns(UserWarning, match="hidden_sise"):
        with pytest.raises(ValueError, match=r"missing required field\(s\) \['hidden_size'\] \(misspelt\? the file "
                                             r"has 'hidden_sise' for 'hidden_size'\)"):
            K3Config.from_dict(d)
    d = nano().to_dict()
    d["linear_attn_config"]["num_head"] = d["linear_attn_config"].pop("num_heads")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"linear_attn_config: missing .*'num_head' for"):
        K3Config.from_dict(d)


def test_known_metadata_keys_load_without_a_warning(recwarn):
    K3Config.from_dict(_kimi_linear_48b_json())
    K3Config.from_dict(_k3_wrapper())
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("name", K3_REQUIRED_FIELDS)
def test_k3_config_missing_a_k3_field_is_refused(name, tmp_path):
    """Every default in K3_REQUIRED_FIELDS is Kimi-Linear's (SiLU, softplus gate, no AttnRes, ...): a
    K3 config without the field, wrapped or bare, is refused naming the file and the field."""
    head, _, leaf = name.rpartition(".")
    for form in ("wrapper", "bare"):
        d = _k3_wrapper() if form == "wrapper" else nano().to_dict()
        text = d["text_config"] if form == "wrapper" else d
        del (text[head] if head else text)[leaf]
        path = tmp_path / f"{form}.json"
        path.write_text(json.dumps(d))
        with pytest.raises(ValueError, match=rf"{re.escape(str(path))}.*missing K3 field\(s\) '{re.escape(name)}'"):
            K3Config.from_json(path)


def test_missing_k3_field_error_says_why_and_spots_a_misspelling():
    d = nano().to_dict()
    d["hiden_act"] = d.pop("hidden_act")
    with pytest.warns(UserWarning):
        with pytest.raises(ValueError, match=r"missing K3 field\(s\) 'hidden_act' \(misspelt\? the file has "
                                             r"'hiden_act' for 'hidden_act'\).*attn_res_block_size.*'silu'"):
            K3Config.from_dict(d)
    # a Kimi-Linear file (no K3 feature declared) keeps the defaults: nothing is required of it
    kl = _kimi_linear_48b_json()
    for key in ("routed_scaling_factor", "moe_renormalize", "rms_norm_eps", "first_k_dense_replace"):
        del kl[key]
    cfg = K3Config.from_dict(kl)
    assert cfg.hidden_act == "silu" and cfg.linear_attn_config.gate_lower_bound is None
    assert cfg.routed_scaling_factor == 1.0 and cfg.rms_norm_eps == 1e-5
    # SwiGLU in K3 form needs no SiTU betas
    d = _k3_wrapper()
    d["text_config"]["hidden_act"] = "silu"
    del d["text_config"]["activation_situ_beta"], d["text_config"]["activation_situ_linear_beta"]
    assert K3Config.from_dict(d).hidden_act == "silu"


@pytest.mark.parametrize("field, value", [
    ("rms_norm_eps", 0.0), ("rms_norm_eps", -1e-5), ("rms_norm_eps", float("nan")), ("max_position_embeddings", 0),
    ("q_lora_rank", 0), ("num_shared_experts", -1), ("activation_situ_beta", 0.0),
    ("activation_situ_linear_beta", -25.0), ("routed_scaling_factor", float("inf")),
    ("linear_attn_config.gate_lower_bound", float("-inf")), ("hidden_size", 0),
])
def test_numeric_sanity_names_field_and_value(field, value):
    d = nano().to_dict()
    head, _, leaf = field.rpartition(".")
    (d[head] if head else d)[leaf] = value
    expect = rf"cfg\.json: config field '{re.escape(field)}' must be .*got {re.escape(repr(value))}"
    with pytest.raises(ValueError, match=expect):
        K3Config.from_dict(d, source="cfg.json")


def test_special_ids_must_lie_in_the_vocabulary(tmp_path):
    d = nano().to_dict()
    d["eos_token_id"] = 163586  # the release's id beside a 512-token vocabulary: no engine would ever stop
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}: config field 'eos_token_id' must be a token id "
                                         r"in \[0, 512\).*got 163586 \(K3's layout puts it at 258"):
        K3Config.from_json(path)
    for key, value in (("eos_token_id", [258, 512]), ("eos_token_id", -1), ("bos_token_id", 512),
                       ("pad_token_id", "511"), ("eos_token_id", [None])):
        with pytest.raises(ValueError, match=rf"config field '{key}' must be (a token id|an integer)"):
            K3Config.from_dict({**nano().to_dict(), key: value})
    w = _k3_wrapper()
    w["pad_token_id"] = 163840
    with pytest.raises(ValueError, match=r"w\.json: config field 'pad_token_id' \(top level\) must be a token id "
                                         r"in \[0, 163840\).*163839"):
        K3Config.from_dict(w, source="w.json")
    # null is allowed, and an eos list inside the vocabulary
    cfg = K3Config.from_dict({**nano().to_dict(), "eos_token_id": None, "bos_token_id": None})
    assert cfg.eos_token_id is None
    assert K3Config.from_dict({**nano().to_dict(), "eos_token_id": [258, 257]}).eos_token_id == [258, 257]
    with pytest.raises(ValueError, match="eos_token_id"):
        nano().replace(eos_token_id=600)


def test_presets_special_ids_follow_their_vocabulary():
    """K3's 256 reserved ids are the top of the vocabulary, so eos (<|end_of_msg|>) is vocab_size - 254;
    the k3 preset keeps the release's ids exactly."""
    for name in PRESET_NAMES + ["small-kl"]:
        cfg = preset(name)
        assert cfg.eos_token_id == cfg.vocab_size - 256 + 2 < cfg.vocab_size, name
    assert nano().eos_token_id == 258 and preset("small").eos_token_id == 7938
    assert k3().eos_token_id == 163586
    assert [k3_special_id(163840, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id",
                                               "media_placeholder_token_id")] == [163584, 163586, 163839, 163605]
    assert k3_special_id(255, "eos_token_id") is None


def test_special_offsets_match_the_tokenizer_table():
    from openk3.tokenizer.special import K3_NAMED_SPECIALS, NUM_RESERVED

    offsets = {name: off for off, name, _ in K3_NAMED_SPECIALS}
    assert NUM_RESERVED == NUM_RESERVED_SPECIALS
    assert SPECIAL_ID_OFFSETS == {"bos_token_id": offsets["[BOS]"], "eos_token_id": offsets["<|end_of_msg|>"],
                                  "media_placeholder_token_id": offsets["<|media_pad|>"],
                                  "pad_token_id": offsets["[PAD]"]}


def test_eos_default_and_resize_follow_the_vocabulary():
    d = nano().to_dict()
    del d["eos_token_id"]
    assert K3Config.from_dict({**d, "vocab_size": 1000}).eos_token_id == 746
    assert K3Config.from_dict({**d, "vocab_size": 100}).eos_token_id is None  # no room for the reserved block
    assert nano().replace(vocab_size=1024).eos_token_id == 770
    assert nano().replace(vocab_size=1024, eos_token_id=5).eos_token_id == 5  # an explicit id wins
    assert nano().replace(vocab_size=100).eos_token_id is None
    cfg = nano().replace(eos_token_id=[258, 3], extra={"bos_token_id": 256, "pad_token_id": 0})
    big = cfg.replace(vocab_size=2048)
    assert big.eos_token_id == [1794, 3] and big.extra == {"bos_token_id": 1792, "pad_token_id": 0}
    assert cfg.eos_token_id == [258, 3], "replace must not mutate the original"
    assert K3Config.from_dict(_k3_wrapper()).replace(vocab_size=1024).extra["_wrapper"]["pad_token_id"] == 1023


@pytest.mark.parametrize("case", ["kda_overlaps_full", "kda_missing_layer", "full_out_of_range", "full_duplicate"])
def test_inconsistent_layer_lists_raise(case):
    d = nano().to_dict()
    la = d["linear_attn_config"]
    if case == "kda_overlaps_full":
        la["kda_layers"] = la["kda_layers"] + [4]
    elif case == "kda_missing_layer":
        la["kda_layers"] = la["kda_layers"][1:]
    elif case == "full_out_of_range":
        la["full_attn_layers"] = [4, 8, 10]
        la["kda_layers"] = None
    else:
        la["full_attn_layers"] = [4, 8, 9, 9]
    with pytest.raises(ValueError, match="kda_layers|full_attn_layers"):
        K3Config.from_dict(d)


@pytest.mark.parametrize("name", PRESET_NAMES + ["nano-kl"])
def test_to_dict_round_trip(name, tmp_path):
    cfg = preset(name)
    d = cfg.to_dict()
    assert json.loads(json.dumps(d)) == d, "to_dict must be plain JSON"
    assert K3Config.from_dict(copy.deepcopy(d)) == cfg
    cfg.to_json(tmp_path / "config.json")
    assert K3Config.from_json(tmp_path / "config.json") == cfg


def test_wrapper_config_saves_and_reloads(tmp_path):
    """A config read from a kimi_k3 wrapper can be written (bare kimi_linear form) and read back."""
    cfg = K3Config.from_dict(_k3_wrapper())
    cfg.to_json(tmp_path / "config.json")
    again = K3Config.from_json(tmp_path / "config.json")
    assert again.to_dict() == cfg.to_dict()
    assert again.num_experts == 896 and again.extra["quantization_config"] == cfg.extra["quantization_config"]


def test_replace_revalidates_and_names_unknown_keys():
    cfg = nano().replace(num_experts=16, **{"linear_attn_config.gate_lower_bound": None})
    assert cfg.num_experts == 16 and cfg.linear_attn_config.gate_lower_bound is None
    assert nano().linear_attn_config.gate_lower_bound == -5.0, "replace must not mutate the original"
    with pytest.raises(ValueError, match="num_expertz"):
        nano().replace(num_expertz=3)
    with pytest.raises(ValueError, match="num_experts_per_token"):
        nano().replace(num_experts_per_token=64)


# ---- parameter and state accounting (meta-device builds) ---------------------------------------

# k3-configs.md totals (A_log unpadded) + the stored padding: kda_layers * (128 - heads).
SPEC_TOTALS = {
    "nano": (4_795_512, 1_977_464, 6, 4),
    "small": (42_321_014, 15_451_254, 9, 6),
    "base": (1_555_806_516, 444_315_956, 15, 12),
}


@pytest.mark.parametrize("name", list(SPEC_TOTALS))
def test_param_counts_match_configs_doc(name):
    total, active, kda_layers, heads = SPEC_TOTALS[name]
    pad = kda_layers * (128 - heads)
    counts = count_params(K3ForCausalLM.build(preset(name), device="meta"))
    assert counts.total == total + pad
    assert counts.active == active + pad
    assert counts.active_with_embedding == counts.active + counts.embedding


def test_param_counts_k3_match_spec():
    m = K3ForCausalLM.build(k3(), device="meta", dtype=torch.bfloat16)
    counts = count_params(m)
    assert counts.total == 2_779_484_478_208
    assert counts.active == 104_189_614_848
    assert counts.routed_experts == 92 * 896 * 33_030_144 == 2_722_740_830_208
    assert counts.total - counts.routed_experts == 56_743_648_000
    assert counts.embedding == counts.lm_head == 163840 * 7168
    assert counts.active_with_embedding == 105_364_019_968
    kda = next(l.self_attn for l in m.model.layers if not l.is_mla)
    mla = next(l.self_attn for l in m.model.layers if l.is_mla)
    # per-layer attention counts (spec §1.7; the KDA figure counts A_log as stored, padded to 128)
    assert kda.A_log.numel() == 128
    assert sum(p.numel() for p in kda.parameters()) == 443_740_416
    assert sum(p.numel() for p in mla.parameters()) == 232_196_096


def test_state_bytes_k3():
    sb = state_bytes(K3ForCausalLM.build(k3(), device="meta", dtype=torch.bfloat16))
    assert sb["kda_state_bytes_per_sequence"] == 69 * 96 * 128 * 128 * 4
    assert sb["mla_cache_bytes_per_token"] == 24 * 576 * 2 == 27_648


def test_transformers_derived_fields_are_checked_then_dropped():
    """transformers' save_pretrained adds layer_types etc.; they must agree with the release fields."""
    d = as_kimi_linear(nano()).to_dict()
    d.pop("max_position_embeddings")
    derived = {
        "layer_types": ["full_attention" if i in (3, 7, 8) else "linear_attention" for i in range(9)],
        "mlp_layer_types": ["dense"] + ["sparse"] * 8,
        "linear_conv_kernel_dim": 4, "linear_head_dim": 32, "linear_num_heads": 4, "qk_head_dim": 48,
        "model_max_length": 1234,
    }
    cfg = K3Config.from_dict({**d, **derived})
    assert cfg.max_position_embeddings == 1234  # transformers' spelling of the field
    assert "layer_types" not in cfg.to_dict()
    bad = {**d, **derived, "layer_types": ["linear_attention"] * 9}
    with pytest.raises(ValueError, match="layer_types"):
        K3Config.from_dict(bad)
    with pytest.raises(ValueError, match="linear_head_dim"):
        K3Config.from_dict({**d, "linear_head_dim": 64})


@pytest.mark.parametrize("field, value, expected", [
    ("moe_layer_freq", "x", "an integer"),
    ("rms_norm_eps", "a", "a number"),
    ("hidden_act", 3, "a string"),
    ("eos_token_id", [1, "a"], "an integer or a list of integers or null"),
    ("tie_word_embeddings", 0, "true or false"),
    ("num_experts", True, "an integer"),
])
def test_wrong_types_are_value_errors_naming_file_and_field(tmp_path, field, value, expected):
    """A string where a number belongs (and the like) is a one-line ValueError naming the file, the
    field and the value, never a TypeError from a comparison deep in validate()."""
    d = preset("nano").to_dict()
    d[field] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=f"{path}: config field '{field}' must be {re.escape(expected)}"):
        K3Config.from_json(path)
