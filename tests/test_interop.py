"""openk3's checkpoint loading and model against INDEPENDENT implementations.

* `k3_writer` writes release-format folders from the spec alone (no openk3 import) and
  `k3_reference` computes float64 logits from the file tensors with plain loops (no openk3 import):
  `openk3.load` of those files must reproduce the reference to float64 rounding (rel. err < 1e-10),
  for bf16 and MXFP4 experts, sharded and single-file, T crossing a 32-token KDA chunk.
* `openk3.save` must write back exactly the release's tensor names, shapes, dtypes and values.
* transformers' `KimiLinearForCausalLM` (a third, independent implementation of the Kimi-Linear
  family) must load openk3's files and vice versa, with matching logits.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import k3_reference as ref
import k3_writer as writer
import pytest
import torch
from helpers import rel_rms_error

import openk3

TOL64 = 1e-10  # float64 openk3 vs float64 reference: only summation-order rounding may differ
TOL32 = 1e-4  # fp32 vs transformers (which computes norms, KDA, router, softmax in fp32)
VISION = ("vision_tower.", "mm_projector.")


def make_ids(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def safetensors_headers(folder: Path) -> dict[str, tuple[str, list[int]]]:
    """{tensor: (dtype, shape)} over every *.safetensors file, parsed from the raw headers; checks the
    index (if any) names exactly the file that holds each tensor."""
    out, where = {}, {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        for name, h in header.items():
            assert name not in out, f"{name} stored twice ({f.name})"
            out[name], where[name] = (h["dtype"], h["shape"]), f.name
    index = folder / "model.safetensors.index.json"
    if index.exists():
        assert json.loads(index.read_text())["weight_map"] == where
    else:
        assert list(set(where.values())) == ["model.safetensors"]
    return out


@pytest.fixture(scope="module")
def k3_files(tmp_path_factory):
    """The same K3-form model written twice by the independent writer: bf16 experts in 3 shards, MXFP4
    experts in one file; plus float64 reference logits for two odd lengths (11, 37 > one 32-chunk)."""
    root = tmp_path_factory.mktemp("k3")
    cfg = writer.tiny_text_config()
    bf16 = writer.write_checkpoint(str(root / "bf16"), cfg, seed=1, experts_format="bf16", num_shards=3)
    mx = writer.write_checkpoint(str(root / "mxfp4"), cfg, seed=1, experts_format="mxfp4", num_shards=1)
    config = json.loads((root / "bf16" / "config.json").read_text())
    ids = {T: make_ids(2, T, cfg["vocab_size"], seed=T) for T in (11, 37)}
    logits = {T: ref.forward(config, bf16, x) for T, x in ids.items()}
    return {"root": root, "cfg": cfg, "config": config, "bf16": bf16, "mxfp4": mx, "ids": ids, "ref": logits}


# ---- the independent pieces themselves ---------------------------------------------------------

def test_writer_layout_follows_spec(k3_files):
    """Tensor inventory per spec §2 (count formula, F32 islands, A_log zero tail, MXFP4 shapes)."""
    c, la = k3_files["cfg"], k3_files["cfg"]["linear_attn_config"]
    L, E = c["num_hidden_layers"], c["num_experts"]
    mla, kda = len(la["full_attn_layers"]), len(la["kda_layers"])
    moe = L - c["first_k_dense_replace"]
    base = 5 + L * 6 + kda * 14 + mla * 8 + moe * 8 + 3
    assert len(k3_files["bf16"]) == base + moe * E * 3
    assert len(k3_files["mxfp4"]) == base + moe * E * 6
    f32 = {n for n, t in k3_files["bf16"].items() if t.dtype == torch.float32}
    assert f32 and all(n.endswith(("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias"))
                       for n in f32)
    assert len(f32) == kda * 6 + moe
    a_log = k3_files["bf16"]["language_model.model.layers.0.self_attn.A_log"]
    assert a_log.shape == (128,) and (a_log[la["num_heads"]:] == 0).all() and (a_log[: la["num_heads"]] != 0).all()
    p = "language_model.model.layers.2.block_sparse_moe.experts.5.w2."
    lat, inter = c["routed_expert_hidden_size"], c["moe_intermediate_size"]
    assert k3_files["mxfp4"][p + "weight_packed"].shape == (lat, inter // 2)
    assert k3_files["mxfp4"][p + "weight_scale"].shape == (lat, inter // 32)
    assert k3_files["bf16"][p + "weight"].shape == (lat, inter)
    qc = k3_files["config"]["text_config"].get("quantization_config")
    assert qc is None  # bf16 copy declares no quantization; the MXFP4 copy does (inside text_config)
    mx_cfg = json.loads((k3_files["root"] / "mxfp4" / "config.json").read_text())
    assert mx_cfg["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"


def test_writer_mxfp4_pack_and_reference_unpack_agree(k3_files):
    """The writer's direct decode (bf16 copy) == the reference's unpack of the packed copy, bit for bit."""
    n = 0
    for name, t in k3_files["bf16"].items():
        if ".experts." in name:
            stem = name[: -len("weight")]
            got = ref.dequant_mxfp4(k3_files["mxfp4"][stem + "weight_packed"], k3_files["mxfp4"][stem + "weight_scale"])
            assert torch.equal(got, t.double()), name
            n += 1
    assert n == (k3_files["cfg"]["num_hidden_layers"] - 1) * k3_files["cfg"]["num_experts"] * 3
    # nibble order: element 0 is the low nibble of byte 0 (spec §6)
    codes = torch.tensor([[1, 15] + [0] * 30], dtype=torch.uint8)
    assert writer.pack_codes(codes)[0, 0].item() == 0xF1
    assert ref.dequant_mxfp4(writer.pack_codes(codes), torch.tensor([[127]], dtype=torch.uint8))[0, :2].tolist() == [
        0.5, -6.0]


def test_reference_exercises_every_feature(k3_files):
    """The tiny model is not degenerate: zeroing an AttnRes pseudo-query (mixes are far from uniform),
    the router correction bias (it changes the selection) or A_log moves the logits by > 1 %, and the
    MLA latent-norm eps (1e-6 vs 1e-5, spec §11) is visible far above TOL64."""
    config, t, ids = k3_files["config"], k3_files["bf16"], k3_files["ids"][11]
    P = "language_model.model."
    base = k3_files["ref"][11]
    for name in (P + "layers.7.mlp_res_proj.weight", P + "layers.4.self_attention_res_proj.weight",
                 P + "output_attn_res_proj.weight", P + "layers.2.block_sparse_moe.gate.e_score_correction_bias",
                 P + "layers.1.self_attn.A_log"):
        changed = ref.forward(config, {**t, name: torch.zeros_like(t[name])}, ids)
        assert rel_rms_error(base, changed) > 1e-2, name
    eps = ref.forward(config, t, ids, mla_latent_eps=1e-5)
    assert rel_rms_error(base, eps) > 1e3 * TOL64


# ---- openk3.load against the reference --------------------------------------------------------

@pytest.fixture(scope="module")
def loaded(k3_files):
    root = k3_files["root"]
    return {"bf16": openk3.load(root / "bf16", dtype=torch.float64).eval(),
            "mxfp4": openk3.load(root / "mxfp4", dtype=torch.float64).eval()}


@pytest.mark.parametrize("T", [11, 37])
def test_load_matches_reference(k3_files, loaded, T):
    ids, want = k3_files["ids"][T], k3_files["ref"][T]
    with torch.no_grad():
        got = loaded["bf16"](ids)
        got_mx = loaded["mxfp4"](ids)
    assert got.dtype == torch.float64 and got.shape == want.shape
    assert rel_rms_error(want, got) < TOL64
    assert (got - want).abs().max().item() < TOL64 * want.abs().max().item()
    assert torch.equal(got, got_mx), "MXFP4 and bf16 copies of the same experts must give identical logits"


def test_decode_and_packed_rows_match_reference(k3_files, loaded):
    """The cache path (MLA absorbed, KDA step) and packed documents (seg_BT) against the same reference:
    prefill 30 tokens then decode 7 one at a time; a row holding two documents = each run alone."""
    model, ids, want = loaded["bf16"], k3_files["ids"][37], k3_files["ref"][37]
    with torch.no_grad():
        cache = model.new_cache()
        steps = [model(ids[:, :30], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(30, 37)]
        assert rel_rms_error(want, torch.cat(steps, 1)) < TOL64
        seg = (torch.arange(37) >= 13).long().expand(2, 37)
        packed = model(ids, seg_BT=seg)
    alone = torch.cat([want[:, :13], ref.forward(k3_files["config"], k3_files["bf16"], ids[:, 13:])], 1)
    assert rel_rms_error(alone, packed) < TOL64


def test_load_default_dtype_keeps_fp32_islands(k3_files):
    """dtype=None: trunk in the file's bf16, and the F32 tensors (spec §10.13) stay F32, bit for bit."""
    model = openk3.load(k3_files["root"] / "bf16")
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    islands = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")
    for name, t in state.items():
        assert t.dtype == (torch.float32 if name.endswith(islands) else torch.bfloat16), name
    for name in ("model.layers.0.self_attn.q_conv1d.weight", "model.layers.4.self_attn.dt_bias",
                 "model.layers.5.block_sparse_moe.gate.e_score_correction_bias"):
        assert torch.equal(state[name], k3_files["bf16"]["language_model." + name]), name


def test_load_keeps_config(k3_files, loaded):
    """The text config survives the load (vision_config and vision tensors are set aside, not an error)."""
    cfg = loaded["bf16"].config
    c = k3_files["cfg"]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.v_head_dim, cfg.routed_expert_hidden_size) == (
        c["hidden_size"], c["num_attention_heads"], c["v_head_dim"], c["routed_expert_hidden_size"])
    assert [i for i in range(c["num_hidden_layers"]) if cfg.is_mla_layer(i)] == [3, 7, 8]
    assert cfg.mla_latent_norm_eps == 1e-6


def test_keep_packed(k3_files):
    root, ids = k3_files["root"], k3_files["ids"][37]
    with torch.no_grad():
        # moe_impl="grouped": packed experts dequantise each touched expert and run the grouped dispatch,
        # the plain model runs the same dispatch (nearly bitwise). The default for 37 tokens is the MXFP4
        # CPU kernel on the packed bytes (the float kernel on plain experts), whose fp32 sums run in
        # another order.
        plain_model = openk3.load(root / "bf16", dtype=torch.float32).eval()
        packed_model = openk3.load(root / "mxfp4", dtype=torch.float32, keep_packed=True).eval()
        plain = plain_model(ids, moe_impl="grouped")
        packed = packed_model(ids, moe_impl="grouped")
        packed_kernel = packed_model(ids)
    assert rel_rms_error(plain, packed) < 1e-6
    assert rel_rms_error(plain, packed_kernel) < 1e-5
    assert rel_rms_error(k3_files["ref"][37], packed) < TOL32  # fp32 rounding, amplified over 9 layers
    assert rel_rms_error(k3_files["ref"][37], packed_kernel) < TOL32


# ---- openk3.save: the release's layout, bit for bit ------------------------------------------

@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_save_roundtrip(k3_files, loaded, tmp_path, fmt):
    """save(load(writer files)) has exactly the writer's text tensors (names, shapes, dtypes and values;
    MXFP4 compared decoded, since a re-encoder may pick other bytes for the same values) and reloads
    to identical logits."""
    src = k3_files["root"] / fmt
    model = loaded[fmt]
    out = tmp_path / "saved"
    shard = 200_000 if fmt == "bf16" else 5 * 2**30  # bf16: several shards + index; mxfp4: one file
    openk3.save(model, out, experts_format=fmt, dtype=torch.bfloat16, max_shard_bytes=shard)
    assert (out / "model.safetensors.index.json").exists() == (fmt == "bf16")
    want = {k: v for k, v in safetensors_headers(src).items() if not k.startswith(VISION)}
    got = {k: v for k, v in safetensors_headers(out).items() if not k.startswith(VISION)}  # text model only
    assert sorted(set(want) - set(got)) == [] and sorted(set(got) - set(want)) == []
    bad = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not bad
    config, tensors = ref.read_checkpoint(str(out))
    written = k3_files[fmt]
    for name, t in written.items():
        if name.endswith("weight_packed"):
            stem = name[: -len("weight_packed")]
            assert torch.equal(ref.dequant_mxfp4(tensors[name], tensors[stem + "weight_scale"]),
                               ref.dequant_mxfp4(t, written[stem + "weight_scale"])), name
        elif not name.endswith("weight_scale"):
            assert torch.equal(tensors[name], t), name
    # config: every text_config field written by the writer comes back with its value
    tc = config["text_config"]
    diff = {k: (tc.get(k), v) for k, v in json.loads((src / "config.json").read_text())["text_config"].items()
            if tc.get(k) != v}
    assert not diff
    assert config["model_type"] == "kimi_k3" and config["vision_config"] == k3_files["config"]["vision_config"]
    ids = k3_files["ids"][37]
    with torch.no_grad():
        again = openk3.load(out, dtype=torch.float64).eval()(ids)
        assert torch.equal(again, model(ids))
    assert rel_rms_error(k3_files["ref"][37], ref.forward(config, tensors, ids)) < TOL64


# ---- transformers' KimiLinear: a third implementation ----------------------------------------

@torch.no_grad()
def randomize(model, seed: int):
    """O(1) weights so every sub-layer moves the logits (the 0.02 init would make them near-uniform)."""
    gen = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float64)
        if name.endswith(("A_log", "dt_bias")):
            continue  # the init's realistic decay range (and A_log's zero padding)
        if name.endswith("conv1d.weight"):
            t.copy_(0.5 * noise)
        elif name.endswith("e_score_correction_bias"):
            t.copy_(0.15 * noise)
        elif t.dim() == 1:
            t.copy_(1 + 0.15 * noise)
        elif name.endswith("embed_tokens.weight"):
            t.copy_(0.7 * noise)
        else:
            t.copy_(noise / math.sqrt(t.shape[-1]))
    return model


def hf_load(path, **kw):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager", output_loading_info=True, **kw)


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    pytest.importorskip("transformers")
    from openk3.config import as_kimi_linear, nano
    from openk3.peers import to_transformers

    model = randomize(openk3.K3ForCausalLM.build(as_kimi_linear(nano()), dtype=torch.float32, seed=0), 3).eval()
    return {"model": model, "hf": to_transformers(model), "ids": make_ids(2, 23, model.config.vocab_size, 7),
            "root": tmp_path_factory.mktemp("kl")}


def test_transformers_loads_openk3_save(kimi_linear):
    model, ids, path = kimi_linear["model"], kimi_linear["ids"], kimi_linear["root"] / "openk3"
    openk3.save(model, path, dtype=torch.float32)
    hf, info = hf_load(path)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    with torch.no_grad():
        want = model(ids)
        got = hf.eval()(ids).logits
    assert rel_rms_error(want, got) < TOL32
    # and the independent reference reads the same files to the same logits
    config, tensors = ref.read_checkpoint(str(path))
    assert rel_rms_error(ref.forward(config, tensors, ids), want) < TOL32


# What transformers 5.x `save_pretrained` writes for KimiLinear that openk3.load does not accept (yet).
HF_DERIVED_FIELDS = ("layer_types", "mlp_layer_types", "linear_conv_kernel_dim", "linear_head_dim",
                     "linear_num_heads", "qk_head_dim")


def hf_dense_mlp_name(name: str) -> bool:
    """transformers reverses its `block_sparse_moe` -> `mlp` rename on *every* `.mlp.`, so the dense
    layer 0 comes out as `model.layers.0.block_sparse_moe.{gate,up,down}_proj.weight`."""
    return ".block_sparse_moe." in name and name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")) \
        and ".shared_experts." not in name


def test_openk3_loads_transformers_save(kimi_linear):
    """transformers writes derived config fields and renames the dense layer-0 MLP `block_sparse_moe.*`:
    openk3 accepts both (checking the derived fields agree) and reads its files as they are."""
    hf, ids, path = kimi_linear["hf"], kimi_linear["ids"], kimi_linear["root"] / "hf"
    hf.save_pretrained(path)
    model = openk3.load(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(ids).logits
        got = model(ids)
    assert rel_rms_error(want, got) < TOL32


def test_openk3_loads_transformers_save_after_fixups(kimi_linear):
    """With those two frictions undone by hand, openk3 reads transformers' files exactly (the weights too)."""
    from safetensors.torch import load_file, save_file

    hf, ids, path = kimi_linear["hf"], kimi_linear["ids"], kimi_linear["root"] / "hf-fixed"
    hf.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert set(HF_DERIVED_FIELDS) <= set(config)
    assert "max_position_embeddings" not in config and config["model_max_length"] == 4096  # transformers' spelling
    config = {k: v for k, v in config.items() if k not in HF_DERIVED_FIELDS}
    (path / "config.json").write_text(json.dumps(config))
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    dense = sorted(n for n in tensors if hf_dense_mlp_name(n))
    assert dense == [f"model.layers.0.block_sparse_moe.{x}_proj.weight" for x in ("down", "gate", "up")]
    save_file({n.replace(".block_sparse_moe.", ".mlp.") if n in dense else n: t for n, t in tensors.items()}, file,
              metadata={"format": "pt"})
    model = openk3.load(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(ids).logits
        assert rel_rms_error(want, model(ids)) < TOL32
        assert torch.equal(model(ids), kimi_linear["model"](ids))  # the very same weights came back


def test_kimi_linear_release_form_three_ways(tmp_path):
    """A bare `kimi_linear` folder from the independent writer (A_log [1, 1, H, 1], q_proj, low-rank
    gate, routed scaling 2.446): transformers, openk3 and the reference agree on it."""
    path = tmp_path / "kl"
    tensors = writer.write_checkpoint(str(path), writer.tiny_kimi_linear_config(), seed=5, num_shards=2, wrapper=False)
    config = json.loads((path / "config.json").read_text())
    ids = make_ids(2, 37, config["vocab_size"], 11)
    want = ref.forward(config, tensors, ids)
    with torch.no_grad():
        got = openk3.load(path, dtype=torch.float64).eval()(ids)
    assert rel_rms_error(want, got) < TOL64
    hf, info = hf_load(path, experts_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    with torch.no_grad():
        assert rel_rms_error(want, hf.eval()(ids).logits) < TOL32
