"""Checkpoint folders (openk3.checkpoint): lossless round trips in both forms, exact names/shapes/dtypes
per spec §2, config files per §1, MXFP4 experts per §6, strictness errors, atomic saves."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import openk3
from openk3.checkpoint import files as ckfiles
from openk3.checkpoint import load, read_config, save
from openk3.config import as_kimi_linear, nano
from openk3.model.model import K3ForCausalLM
from openk3.model.packed_experts import PackedExperts
from openk3.quant.mxfp4 import pack, quantize_dequantize

ST_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1}
P = "language_model."
# spec §1.5, written out independently of openk3's own constant
SPEC_QUANT = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None, "global_compression_ratio": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "format": "mxfp4-pack-quantized",
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                    "dynamic": False, "scale_dtype": "torch.uint8", "zp_dtype": None, "observer": "minmax"},
        "input_activations": None, "output_activations": None}},
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
}


@torch.no_grad()
def _randomize(model: K3ForCausalLM, seed: int) -> K3ForCausalLM:
    """Give the tensors that init to constants (A_log, router bias, AttnRes queries, norms) random values
    so that a round trip that dropped or mangled one of them would change the logits."""
    g = torch.Generator().manual_seed(seed)
    H = model.config.linear_attn_config.num_heads
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("A_log"):
            t.zero_()
            t[:H] = torch.randn(H, generator=g) * 0.5
        elif name.endswith(("e_score_correction_bias", "_res_proj.weight")):
            t.copy_(torch.randn(t.shape, generator=g) * 0.1)
        elif name.endswith("norm.weight"):
            t.copy_(1 + torch.randn(t.shape, generator=g) * 0.1)
    return model


_MODELS: dict[tuple[str, int], K3ForCausalLM] = {}


def _model(form: str, layers: int = 9) -> K3ForCausalLM:
    """A fresh copy of the fp32 nano model in K3 form ("k3") or Kimi-Linear form ("kl"); `layers` < 9: nano cut
    to that depth (4: 3 KDA + 1 MLA, a dense layer then MoE, two AttnRes blocks: every layer kind)."""
    if (form, layers) not in _MODELS:
        from openk3.train.config import TrainConfig, apply_overrides

        cfg = apply_overrides(TrainConfig(model=nano()), [f"model.num_hidden_layers={layers}"]).model  # K3's rules
        cfg = cfg if form == "k3" else as_kimi_linear(cfg)
        _MODELS[form, layers] = _randomize(K3ForCausalLM.build(cfg, dtype=torch.float32, seed=3), seed=4).eval()
    return copy.deepcopy(_MODELS[form, layers])


IDS = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _logits(model, **kw) -> torch.Tensor:
    return model(IDS, **kw)


def _headers(folder: Path) -> dict[str, tuple[str, list[int]]]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                s = h.get_slice(k)
                out[k] = (s.get_dtype(), list(s.get_shape()))
    return out


def _assert_same_state(a: K3ForCausalLM, b: K3ForCausalLM) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


# ---- round trips ---------------------------------------------------------------------------------

@pytest.mark.parametrize("sharded", [False, True], ids=["single", "shards"])
@pytest.mark.parametrize("form", ["k3", "kl"])
def test_round_trip_is_lossless(tmp_path, form, sharded):
    model = _model(form)
    ref = _logits(model)
    limit = 200_000 if sharded else 5 * 2**30
    save(model, tmp_path / "ck", dtype=torch.float32, max_shard_bytes=limit)
    names = sorted(os.listdir(tmp_path / "ck"))
    if sharded:
        shards = [n for n in names if n.startswith("model-")]
        assert len(shards) > 3 and "model.safetensors" not in names
        assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
        index = json.loads((tmp_path / "ck" / "model.safetensors.index.json").read_text())
        heads = _headers(tmp_path / "ck")
        assert index["metadata"]["total_size"] == sum(math.prod(s) * ST_BYTES[d] for d, s in heads.values())
        assert set(index["weight_map"]) == set(heads) and set(index["weight_map"].values()) == set(shards)
        for s in shards:  # each shard within the limit, or a single tensor larger than it (embedding, head)
            with safe_open(str(tmp_path / "ck" / s), "pt") as h:
                size = sum(math.prod(h.get_slice(k).get_shape()) * ST_BYTES[h.get_slice(k).get_dtype()]
                           for k in h.keys())
                assert size <= limit or len(h.keys()) == 1
    else:
        assert names == ["config.json", "generation_config.json", "model.safetensors"]
    back = load(tmp_path / "ck", dtype=torch.float32)
    assert type(back) is K3ForCausalLM and back.config.extra["dtype"] == "float32"
    assert {k: v for k, v in vars(back.config).items() if k != "extra"} == \
        {k: v for k, v in vars(model.config).items() if k != "extra"}
    _assert_same_state(model, back)
    assert torch.equal(_logits(back.eval()), ref)


def test_bf16_save_rounds_trunk_and_keeps_fp32_islands(tmp_path):
    model = _model("k3")
    save(model, tmp_path / "ck")  # default dtype bf16
    back = load(tmp_path / "ck")  # dtype=None: on-disk dtypes
    for name, t in back.state_dict().items():
        island = name.endswith(("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias"))
        assert t.dtype == (torch.float32 if island else torch.bfloat16), name
    rounded = copy.deepcopy(model).cast(torch.bfloat16)
    _assert_same_state(rounded, back)
    as32 = load(tmp_path / "ck", dtype=torch.float32)
    assert all(t.dtype == torch.float32 for t in as32.state_dict().values())
    assert torch.equal(_logits(as32), _logits(rounded.cast(torch.float32)))


# ---- names, shapes, dtypes (spec §2) ---------------------------------------------------------------

def test_k3_form_names_shapes_dtypes(tmp_path):
    model = _model("k3")
    cfg = model.config
    save(model, tmp_path / "ck")
    h = _headers(tmp_path / "ck")
    assert all(k.startswith(P) for k in h)
    D, Pw, C, I, E = 128, 4 * 32, 64, 64, 32
    expect = {
        "model.embed_tokens.weight": ("BF16", [512, D]), "lm_head.weight": ("BF16", [512, D]),
        "model.norm.weight": ("BF16", [D]), "model.output_attn_res_norm.weight": ("BF16", [D]),
        "model.output_attn_res_proj.weight": ("BF16", [1, D]),
        "model.layers.0.mlp.gate_proj.weight": ("BF16", [512, D]),
        "model.layers.0.mlp.down_proj.weight": ("BF16", [D, 512]),
        "model.layers.5.self_attention_res_proj.weight": ("BF16", [1, D]),
        "model.layers.5.mlp_res_norm.weight": ("BF16", [D]),
        "model.layers.5.self_attn.q_proj.weight": ("BF16", [Pw, D]),
        "model.layers.5.self_attn.q_conv1d.weight": ("F32", [Pw, 1, 4]),
        "model.layers.5.self_attn.v_conv1d.weight": ("F32", [Pw, 1, 4]),
        "model.layers.5.self_attn.f_a_proj.weight": ("BF16", [32, D]),
        "model.layers.5.self_attn.f_b_proj.weight": ("BF16", [Pw, 32]),
        "model.layers.5.self_attn.b_proj.weight": ("BF16", [4, D]),
        "model.layers.5.self_attn.A_log": ("F32", [128]),
        "model.layers.5.self_attn.dt_bias": ("F32", [Pw]),
        "model.layers.5.self_attn.g_proj.weight": ("BF16", [Pw, D]),
        "model.layers.5.self_attn.o_norm.weight": ("F32", [32]),
        "model.layers.3.self_attn.q_a_proj.weight": ("BF16", [64, D]),
        "model.layers.3.self_attn.q_b_proj.weight": ("BF16", [4 * 48, 64]),
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": ("BF16", [32 + 16, D]),
        "model.layers.3.self_attn.kv_b_proj.weight": ("BF16", [4 * 64, 32]),
        "model.layers.3.self_attn.g_proj.weight": ("BF16", [4 * 32, D]),
        "model.layers.3.block_sparse_moe.gate.weight": ("BF16", [E, D]),
        "model.layers.3.block_sparse_moe.gate.e_score_correction_bias": ("F32", [E]),
        "model.layers.3.block_sparse_moe.routed_expert_down_proj.weight": ("BF16", [C, D]),
        "model.layers.3.block_sparse_moe.routed_expert_norm.weight": ("BF16", [C]),
        "model.layers.3.block_sparse_moe.routed_expert_up_proj.weight": ("BF16", [D, C]),
        "model.layers.3.block_sparse_moe.shared_experts.gate_proj.weight": ("BF16", [2 * I, D]),
        "model.layers.3.block_sparse_moe.experts.17.w1.weight": ("BF16", [I, C]),
        "model.layers.3.block_sparse_moe.experts.17.w3.weight": ("BF16", [I, C]),
        "model.layers.3.block_sparse_moe.experts.17.w2.weight": ("BF16", [C, I]),
    }
    for name, want in expect.items():
        assert h[P + name] == want, name
    assert not any("A_log" in k for k in h if ".layers.3." in k), "layer 3 is MLA"
    L, mla = 9, 3
    assert len(h) == 5 + L * 6 + (L - mla) * 14 + mla * 8 + (L - 1) * (8 + E * 3) + 3
    with safe_open(str(tmp_path / "ck" / "model.safetensors"), "pt") as f:
        a = f.get_tensor(P + "model.layers.5.self_attn.A_log")
    assert torch.equal(a[4:], torch.zeros(124)) and torch.equal(a[:4], model.model.layers[5].self_attn.A_log[:4])
    assert cfg.use_attn_res


def test_kimi_linear_form_names_shapes_dtypes(tmp_path):
    model = _model("kl")
    save(model, tmp_path / "ck")
    h = _headers(tmp_path / "ck")
    assert not any(k.startswith(P) for k in h)
    I = model.config.moe_intermediate_size
    assert h["model.layers.0.self_attn.A_log"] == ("F32", [1, 1, 4, 1])
    assert h["model.layers.0.self_attn.g_a_proj.weight"] == ("BF16", [32, 128])
    assert h["model.layers.0.self_attn.g_b_proj.weight"] == ("BF16", [128, 32])
    assert h["model.layers.2.block_sparse_moe.experts.31.w1.weight"] == ("BF16", [I, 128])
    assert h["model.layers.2.block_sparse_moe.experts.31.w2.weight"] == ("BF16", [128, I])
    assert not any("_res_" in k or "routed_expert" in k for k in h)
    assert set(h) == {n for n in h if not n.startswith(("vision", "mm_"))}


def test_release_layout_matches_spec_totals():
    """The full K3 layout (meta only): the release's tensor count and text bytes exactly (spec §1.7, §2)."""
    from openk3.checkpoint.layout import layout
    from openk3.config import k3

    entries = layout(k3(), "mxfp4")
    assert len(entries) == 497_052
    assert sum(math.prod(e.shape) * e.disk_dtype(torch.bfloat16).itemsize for e in entries) == 1_559_965_606_912
    by_name = {e.name: e for e in entries}
    assert by_name["model.layers.92.self_attn.kv_b_proj.weight"].shape == (24576, 512)
    assert by_name["model.layers.90.self_attn.A_log"].shape == (128,)
    assert by_name["model.layers.7.block_sparse_moe.experts.895.w2.weight_scale"].shape == (3584, 96)
    first = [e.name.rsplit(".", 3)[-3:] for e in entries if ".layers.1.block_sparse_moe.experts.0." in e.name]
    assert [".".join(x) for x in first] == [f"0.{w}.weight_{k}" for w in ("w1", "w2", "w3")
                                           for k in ("packed", "scale")]  # back to back, as the release


# ---- config files (spec §1) -----------------------------------------------------------------------

def test_config_files_wrapper_and_bare(tmp_path):
    k3 = _model("k3")
    k3.config.eos_token_id = [258, 257]  # a list of stop ids, inside nano's vocabulary
    save(k3, tmp_path / "w")
    top = json.loads((tmp_path / "w" / "config.json").read_text())
    assert top["architectures"] == ["KimiK3ForConditionalGeneration"] and top["model_type"] == "kimi_k3"
    assert top["tie_word_embeddings"] is False and top["eos_token_id"] == [258, 257]
    assert "bos_token_id" in top and "pad_token_id" in top
    text = top["text_config"]
    assert text["model_type"] == "kimi_linear" and text["architectures"] == ["KimiLinearForCausalLM"]
    assert "quantization_config" not in text and "quantization_config" not in top
    assert text == k3.config.to_dict() | {"dtype": "bfloat16"}
    gen = json.loads((tmp_path / "w" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [258, 257]
    cfg = read_config(tmp_path / "w")
    assert cfg == read_config(tmp_path / "w" / "config.json")
    assert {k: v for k, v in vars(cfg).items() if k != "extra"} == \
        {k: v for k, v in vars(k3.config).items() if k != "extra"}
    assert "_wrapper" in cfg.extra

    kl = _model("kl")
    save(kl, tmp_path / "b")
    bare = json.loads((tmp_path / "b" / "config.json").read_text())
    assert bare["model_type"] == "kimi_linear" and "text_config" not in bare
    # K3's layout for vocab 512 (256 ranks + the reserved block), as eos: [BOS] 256, [PAD] 511
    assert (bare["bos_token_id"], bare["eos_token_id"], bare["pad_token_id"]) == (256, 258, 511)
    assert json.loads((tmp_path / "b" / "generation_config.json").read_text()) == \
        {"bos_token_id": 256, "eos_token_id": kl.config.eos_token_id, "pad_token_id": 511}
    # the wrapper default follows the config: a Kimi-Linear config read from a wrapper stays a wrapper
    kl.config.extra["_wrapper"] = {"vision_config": {"patch_size": 14}, "bos_token_id": 1, "pad_token_id": 0,
                                   "media_placeholder_token_id": 7}
    save(kl, tmp_path / "kw")
    top = json.loads((tmp_path / "kw" / "config.json").read_text())
    assert top["vision_config"] == {"patch_size": 14} and top["media_placeholder_token_id"] == 7
    assert (top["bos_token_id"], top["pad_token_id"]) == (1, 0)
    assert json.loads((tmp_path / "kw" / "generation_config.json").read_text()) == \
        {"bos_token_id": 1, "eos_token_id": kl.config.eos_token_id, "pad_token_id": 0}
    assert all(k.startswith(P) for k in _headers(tmp_path / "kw"))
    save(k3, tmp_path / "k3bare", wrapper=False)  # explicit override
    assert "text_config" not in json.loads((tmp_path / "k3bare" / "config.json").read_text())
    assert torch.equal(_logits(load(tmp_path / "k3bare", dtype=torch.float32)),
                       _logits(load(tmp_path / "w", dtype=torch.float32)))


# ---- MXFP4 (spec §6) ------------------------------------------------------------------------------

def _rounded_experts(model: K3ForCausalLM) -> K3ForCausalLM:
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for layer in ref.model.layers:
            if hasattr(layer, "block_sparse_moe"):
                ex = layer.block_sparse_moe.experts
                for w in (ex.w1, ex.w2, ex.w3):
                    w.copy_(quantize_dequantize(w))
    return ref


@pytest.mark.parametrize("form", ["k3", "kl"])
def test_mxfp4_save_load(tmp_path, form):
    model = _model(form, layers=4)
    save(model, tmp_path / "q", experts_format="mxfp4", dtype=torch.float32)
    top = json.loads((tmp_path / "q" / "config.json").read_text())
    text = top["text_config"] if form == "k3" else top
    assert text["quantization_config"] == SPEC_QUANT  # inside text_config for a wrapper (spec §1.5)
    assert form == "kl" or "quantization_config" not in top
    h = _headers(tmp_path / "q")
    pre = P if form == "k3" else ""
    C = 64 if form == "k3" else 128
    I = model.config.moe_intermediate_size
    e = f"{pre}model.layers.1.block_sparse_moe.experts.5."
    assert h[e + "w1.weight_packed"] == ("U8", [I, C // 2]) and h[e + "w1.weight_scale"] == ("U8", [I, C // 32])
    assert h[e + "w2.weight_packed"] == ("U8", [C, I // 2]) and h[e + "w2.weight_scale"] == ("U8", [C, I // 32])
    assert not any(k.endswith("experts.5.w1.weight") for k in h)
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        p, s = pack(model.model.layers[1].block_sparse_moe.experts.w3[5])
        assert torch.equal(f.get_tensor(e + "w3.weight_packed"), p)
        assert torch.equal(f.get_tensor(e + "w3.weight_scale"), s)

    ref = _rounded_experts(model)
    back = load(tmp_path / "q", dtype=torch.float32)
    _assert_same_state(ref, back)
    assert "quantization_config" not in back.config.extra  # unpacked: no stale quantization metadata
    assert torch.equal(_logits(back), _logits(ref))

    packed = load(tmp_path / "q", dtype=torch.float32, keep_packed=True)
    ex = packed.model.layers[1].block_sparse_moe.experts
    assert isinstance(ex, PackedExperts) and ex.w2_packed.dtype == torch.uint8
    assert packed.config.extra["quantization_config"] == SPEC_QUANT
    # float32: the MXFP4 kernel sums in another order and its vector GLU is within ~2 ulp of libm's
    torch.testing.assert_close(_logits(packed), _logits(back, moe_impl="loop"), rtol=1e-5, atol=1e-5)

    # re-saving as bf16 (explicitly: the default keeps MXFP4) from either copy drops the
    # quantization_config; mxfp4 from packed is bit-exact
    save(back, tmp_path / "b1", experts_format="bf16", dtype=torch.float32)
    save(packed, tmp_path / "b2", experts_format="bf16", dtype=torch.float32)
    for d in ("b1", "b2"):
        cfg_d = json.loads((tmp_path / d / "config.json").read_text())
        assert "quantization_config" not in json.dumps(cfg_d)
        _assert_same_state(ref, load(tmp_path / d, dtype=torch.float32))
    save(packed, tmp_path / "q2", experts_format="mxfp4", dtype=torch.float32)
    a, b = load_file(tmp_path / "q" / "model.safetensors"), load_file(tmp_path / "q2" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_mxfp4_bf16_load_and_keep_packed_on_float_checkpoint(tmp_path):
    model = _model("k3", layers=4)
    save(model, tmp_path / "q", experts_format="mxfp4")
    back = load(tmp_path / "q")
    assert back.model.layers[2].block_sparse_moe.experts.w1.dtype == torch.bfloat16
    ref = _rounded_experts(model).cast(torch.bfloat16)
    _assert_same_state(ref, back)
    save(model, tmp_path / "f")
    plain = load(tmp_path / "f", keep_packed=True)  # no effect on float experts
    assert not isinstance(plain.model.layers[2].block_sparse_moe.experts, PackedExperts)


@pytest.mark.parametrize("keep_packed", [False, True])
def test_mxfp4_nan_scale_is_refused_at_load(tmp_path, keep_packed):
    """An E8M0 NaN scale byte (255) in the file is a ValueError naming the tensor when the checkpoint is
    read, packed in memory or not (not a NaN logit, or an error in the middle of a later decode step)."""
    save(_model("kl"), tmp_path / "q", experts_format="mxfp4", dtype=torch.float32)
    bad = "model.layers.1.block_sparse_moe.experts.3.w2.weight_scale"
    _rewrite(tmp_path / "q", lambda t: t[bad].view(-1).__setitem__(0, 255))
    with pytest.raises(ValueError, match=r"experts\.3\.w2\.weight_scale.*scale byte 255"):
        load(tmp_path / "q", dtype=torch.float32, keep_packed=keep_packed)


# ---- A_log forms accepted on load -------------------------------------------------------------------

def _rewrite(folder: Path, edit) -> None:
    """Apply `edit(dict)` to the single model.safetensors of `folder`."""
    f = folder / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


@pytest.mark.parametrize("form", ["k3", "kl"])
def test_a_log_forms_accepted(tmp_path, form):
    model = _model(form)
    save(model, tmp_path / "ck", dtype=torch.float32)
    name = (P if form == "k3" else "") + "model.layers.1.self_attn.A_log"
    heads = model.model.layers[1].self_attn.A_log[:4].detach()
    for shape in ([4], [1, 1, 4, 1], [128]):
        _rewrite(tmp_path / "ck", lambda t, s=shape: t.__setitem__(name, torch.cat([heads, torch.zeros(124)])[
            : math.prod(s)].reshape(s).contiguous()))
        back = load(tmp_path / "ck", dtype=torch.float32)
        assert torch.equal(back.model.layers[1].self_attn.A_log, model.model.layers[1].self_attn.A_log)


# ---- strictness --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A bf16 K3-form single-file checkpoint and a sharded one, reused (copied) by the error tests."""
    root = tmp_path_factory.mktemp("saved")
    model = _model("k3")
    save(model, root / "single")
    save(model, root / "shards", max_shard_bytes=300_000)
    return root


def _copy(saved: Path, kind: str, dst: Path) -> Path:
    import shutil

    shutil.copytree(saved / kind, dst)
    return dst


def _raises(folder: Path, *needles: str, **kw) -> str:
    with pytest.raises(ValueError) as ei:
        load(folder, **kw)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in:\n{msg}"
    return msg


Q = P + "model.layers.5.self_attn.q_proj.weight"


def test_error_missing_tensor(saved, tmp_path):
    ck = _copy(saved, "single", tmp_path / "ck")
    _rewrite(ck, lambda t: t.pop(Q))
    _raises(ck, "missing tensors (1)", Q)


def test_error_unexpected_tensor(saved, tmp_path):
    ck = _copy(saved, "single", tmp_path / "ck")
    _rewrite(ck, lambda t: t.update({P + "model.layers.5.self_attn.q_proj.bias": torch.zeros(128)}))
    _raises(ck, "unexpected tensors (1)", "q_proj.bias")


def test_vision_tensors_are_set_aside_in_wrapper_form(saved, tmp_path):
    ck = _copy(saved, "single", tmp_path / "ck")
    _rewrite(ck, lambda t: t.update({"vision_tower.patch_embed.weight": torch.zeros(4, 3),
                                     "mm_projector.proj.weight": torch.zeros(2, 2)}))
    load(ck)


def test_error_wrong_shape(saved, tmp_path):
    ck = _copy(saved, "single", tmp_path / "ck")
    _rewrite(ck, lambda t: t.update({Q: torch.zeros(128, 64, dtype=torch.bfloat16)}))
    _raises(ck, "wrong shape (1)", f"{Q}: expected [128, 128], got [128, 64]")
    _rewrite(ck, lambda t: t.update({Q: torch.zeros(128, 128, dtype=torch.bfloat16),
                                     P + "model.layers.5.self_attn.A_log": torch.zeros(32)}))
    _raises(ck, "model.layers.5.self_attn.A_log: expected [4] or [128] or [1, 1, 4, 1], got [32]")


def test_error_wrong_dtype(saved, tmp_path):
    ck = _copy(saved, "single", tmp_path / "ck")
    _rewrite(ck, lambda t: t.update({Q: torch.zeros(128, 128, dtype=torch.int32)}))
    _raises(ck, "wrong dtype (1)", f"{Q}: expected a float dtype", "got I32")


def test_error_wrong_dtype_packed(tmp_path):
    save(_model("k3"), tmp_path / "q", experts_format="mxfp4")
    name = P + "model.layers.2.block_sparse_moe.experts.3.w2.weight_scale"
    _rewrite(tmp_path / "q", lambda t: t.update({name: t[name].float()}))
    _raises(tmp_path / "q", f"{name}: expected U8", "got F32")


def test_error_format_mismatch_hints(saved, tmp_path):
    ck = _copy(saved, "single", tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["text_config"]["quantization_config"] = SPEC_QUANT
    (ck / "config.json").write_text(json.dumps(cfg))
    _raises(ck, "declares MXFP4", "experts.0.w1.weight_packed")
    cfg["text_config"].pop("quantization_config")
    bare = {**cfg["text_config"]}
    (ck / "config.json").write_text(json.dumps(bare))
    _raises(ck, "carry the `language_model.` prefix", "unexpected tensors")


def test_error_nonzero_a_log_padding(saved, tmp_path):
    ck = _copy(saved, "single", tmp_path / "ck")
    name = P + "model.layers.2.self_attn.A_log"
    _rewrite(ck, lambda t: t[name].__setitem__(100, 0.5))
    _raises(ck, name, "must be exactly 0")


def test_error_missing_shard(saved, tmp_path):
    ck = _copy(saved, "shards", tmp_path / "ck")
    victim = sorted(ck.glob("model-*.safetensors"))[1]
    victim.unlink()
    _raises(ck, victim.name, "is missing")


def test_error_truncated_or_corrupt_shard(saved, tmp_path):
    ck = _copy(saved, "shards", tmp_path / "ck")
    victim = sorted(ck.glob("model-*.safetensors"))[2]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])
    _raises(ck, victim.name, "not a readable safetensors file")
    victim.write_bytes(b"\x00" * 64)
    _raises(ck, victim.name)


def test_error_corrupt_index(saved, tmp_path):
    ck = _copy(saved, "shards", tmp_path / "ck")
    index = ck / "model.safetensors.index.json"
    good = index.read_text()
    index.write_text(good[: len(good) // 2])
    _raises(ck, "model.safetensors.index.json", "not valid JSON")
    index.write_text(json.dumps({"metadata": {}, "weight_map": ["a"]}))
    _raises(ck, "model.safetensors.index.json", "weight_map")
    data = json.loads(good)
    wm = data["weight_map"]
    first, other = wm[Q], sorted(set(wm.values()) - {wm[Q]})[0]
    wm[Q] = other  # the index points at a shard that does not hold the tensor
    index.write_text(json.dumps(data))
    msg = _raises(ck, "model.safetensors.index.json", Q, other)
    assert "does not hold" in msg
    wm[Q] = first
    del wm[P + "lm_head.weight"]  # a shard holds a tensor the index does not name
    index.write_text(json.dumps(data))
    _raises(ck, "lm_head.weight", "does not name")


def test_error_corrupt_config(saved, tmp_path):
    ck = _copy(saved, "single", tmp_path / "ck")
    (ck / "config.json").write_text('{"model_type": "kimi_k3", "text_config": ')
    _raises(ck, "config.json", "not valid JSON")
    (ck / "config.json").write_text(json.dumps({"model_type": "kimi_linear", "hidden_sise": 3}))
    _raises(ck, "config.json", "hidden_sise")
    cfg = json.loads((saved / "single" / "config.json").read_text())
    cfg["text_config"]["quantization_config"] = {"format": "float-quantized"}
    (ck / "config.json").write_text(json.dumps(cfg))
    _raises(ck, "config.json", "quantization_config.format")
    (ck / "config.json").unlink()
    _raises(ck, "no config.json")
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "nowhere")


def test_error_no_weights_and_bad_arguments(saved, tmp_path):
    ck = _copy(saved, "single", tmp_path / "ck")
    (ck / "model.safetensors").unlink()
    _raises(ck, "no model.safetensors")
    with pytest.raises(ValueError, match="experts_format"):
        save(_model("kl"), tmp_path / "x", experts_format="fp8")
    with pytest.raises(ValueError, match="dtype"):
        load(saved / "single", dtype=torch.int8)


# ---- atomic save ---------------------------------------------------------------------------------------

def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    old = _model("kl")
    ck = tmp_path / "ck"
    save(old, ck, dtype=torch.float32, max_shard_bytes=400_000)
    (ck / "tokenizer_config.json").write_text("{}")  # a file the save does not own
    before = sorted(os.listdir(ck))
    real, calls = ckfiles.write_tensor, [0]

    def failing(fh, t):
        calls[0] += 1
        if calls[0] == 150:
            raise OSError("disk full (simulated)")
        real(fh, t)

    monkeypatch.setattr(ckfiles, "write_tensor", failing)
    new = _randomize(_model("kl"), seed=99)
    with pytest.raises(OSError, match="disk full"):
        save(new, ck, dtype=torch.float32)
    assert calls[0] == 150
    assert sorted(os.listdir(ck)) == before
    assert sorted(os.listdir(tmp_path)) == ["ck"], "temp folder left behind"
    _assert_same_state(old, load(ck, dtype=torch.float32))

    # a crash (no cleanup) that left a temp folder, and one that died mid-swap with ck moved aside
    (tmp_path / ".ck.tmp-deadbeef").mkdir()
    (tmp_path / ".ck.tmp-deadbeef" / "model.safetensors").write_bytes(b"partial")
    os.rename(ck, tmp_path / ".ck.old-cafe0000")
    with pytest.raises(OSError):
        calls[0] = 0
        save(new, ck, dtype=torch.float32)
    assert sorted(os.listdir(tmp_path)) == ["ck"], "the previous checkpoint is restored, the debris removed"
    _assert_same_state(old, load(ck, dtype=torch.float32))

    monkeypatch.setattr(ckfiles, "write_tensor", real)
    save(new, ck, dtype=torch.float32)  # single file now: the old shards and index are gone
    assert sorted(os.listdir(ck)) == ["config.json", "generation_config.json", "model.safetensors",
                                      "tokenizer_config.json"]
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    _assert_same_state(new, load(ck, dtype=torch.float32))


def test_save_into_a_file_path_raises(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        save(_model("kl"), tmp_path / "f")


# ---- package surface ----------------------------------------------------------------------------------

def test_top_level_exports_are_lazy():
    assert openk3.load is load and openk3.save is save and openk3.checkpoint.read_config is read_config
    code = "import sys, openk3; openk3.__all__; sys.exit('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stderr
