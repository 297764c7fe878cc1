"""Checkpoints keep their form and refuse what is broken (issue 15, B4/B6/B8):

* `save` of a model loaded from MXFP4 writes MXFP4 again, with the source `quantization_config`
  verbatim (same tensor names, dtypes, count, bytes); `experts_format=` still overrides;
* `load` / `openk3 info` of a training run folder open its latest checkpoint;
* NaN/inf weights (in the file, or from a cast or an MXFP4 scale that overflows the load dtype) are
  refused naming tensor and file; `openk3 info` of a broken checkpoint is exit 2 with one stderr line;
  index entries pointing outside the folder are refused before anything is opened.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import k3_writer as writer
import pytest
import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from openk3.__main__ import main
from openk3.checkpoint import LoadedFormat, load, resolve_checkpoint, save
from openk3.config import nano
from openk3.model.model import K3ForCausalLM
from openk3.model.packed_experts import PackedExperts, pack_model_experts_
from openk3.quant.mxfp4 import unpack

P = "language_model."
EXPERT = P + "model.layers.1.block_sparse_moe.experts.3.w2."


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    return K3ForCausalLM.build(nano(), dtype=torch.float32, seed=3).eval()


@pytest.fixture(scope="module")
def mx(model, tmp_path_factory) -> Path:
    """nano K3 form, MXFP4 experts, bf16 trunk, one file; its quantization_config carries an extra
    ignore regex and key, as other tools write (so "verbatim" is told apart from "the release's")."""
    path = tmp_path_factory.mktemp("mx") / "ck"
    save(model, path, experts_format="mxfp4")
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["quantization_config"]["ignore"].append("re:.*block_sparse_moe\\.gate$")
    cfg["text_config"]["quantization_config"]["version"] = "0.12.2"
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _text_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["text_config"]


def _headers(folder: Path) -> dict[str, tuple[str, list[int]]]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: (h.get_slice(k).get_dtype(), list(h.get_slice(k).get_shape())) for k in h.keys()})
    return out


def _rewrite(folder: Path, edit, file: str = "model.safetensors") -> None:
    tensors = load_file(folder / file)
    edit(tensors)
    save_file(tensors, folder / file, metadata={"format": "pt"})


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---- B4: save keeps the format the model was loaded in --------------------------------------------

@pytest.mark.parametrize("keep_packed", [False, True], ids=["unpacked", "packed"])
def test_save_of_mxfp4_load_writes_mxfp4_byte_for_byte(mx, tmp_path, keep_packed):
    back = load(mx, keep_packed=keep_packed)  # dtype None: bf16 trunk, experts unpacked to bf16 (exact)
    assert back.loaded_format == LoadedFormat("mxfp4", _text_config(mx)["quantization_config"])
    assert isinstance(back.model.layers[1].block_sparse_moe.experts, PackedExperts) == keep_packed
    save(back, tmp_path / "again")
    want, got = _headers(mx), _headers(tmp_path / "again")
    assert len(got) == len(want) == 1770 and got == want  # names, dtypes and shapes
    assert _text_config(tmp_path / "again")["quantization_config"] == _text_config(mx)["quantization_config"]
    a, b = load_file(mx / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # every byte, the re-packed experts' too

    save(back, tmp_path / "bf16", experts_format="bf16")  # an explicit format still wins
    h = _headers(tmp_path / "bf16")
    assert len(h) == 1002 and h[EXPERT + "weight"] == ("BF16", [64, 64])
    assert "quantization_config" not in _text_config(tmp_path / "bf16")
    assert torch.equal(load(tmp_path / "bf16").model.layers[1].block_sparse_moe.experts.w2,
                       load(mx).model.layers[1].block_sparse_moe.experts.w2)


def test_models_not_loaded_from_mxfp4_save_bf16_experts(model, tmp_path):
    save(model, tmp_path / "built")  # built in memory: bf16 experts, as always
    assert "quantization_config" not in _text_config(tmp_path / "built")
    assert _headers(tmp_path / "built")[EXPERT + "weight"] == ("BF16", [64, 64])
    back = load(tmp_path / "built", keep_packed=True)  # keep_packed has nothing to keep here
    assert back.loaded_format == LoadedFormat("bf16")
    pack_model_experts_(back)  # packed in memory after loading: still saved in the loaded form
    save(back, tmp_path / "again")
    assert EXPERT + "weight" in _headers(tmp_path / "again")
    assert not hasattr(model, "loaded_format")


def test_foreign_mxfp4_bytes_reencode_to_the_same_values(tmp_path):
    """The independent writer draws codes freely (a group's largest code may be small, an all-zero group
    has a non-zero scale), so re-packing may pick other bytes for a group; the values never change."""
    src = tmp_path / "src"
    # bare form, eos inside the writer's 101-token vocabulary: only the experts matter here
    written = writer.write_checkpoint(str(src), writer.tiny_text_config(eos_token_id=2), experts_format="mxfp4",
                                      num_shards=1, wrapper=False)
    save(load(src), tmp_path / "again", wrapper=False)
    assert _headers(tmp_path / "again") == _headers(src)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["quantization_config"] == \
        writer.QUANTIZATION_CONFIG
    got = load_file(tmp_path / "again" / "model.safetensors")
    moved = 0
    for name in (n for n in written if n.endswith("weight_packed")):
        stem = name[: -len("weight_packed")]
        old = unpack(written[name], written[stem + "weight_scale"], torch.float64)
        assert torch.equal(unpack(got[name], got[stem + "weight_scale"], torch.float64), old), name
        moved += not torch.equal(got[stem + "weight_scale"], written[stem + "weight_scale"])
    assert moved  # this source is not in pack's canonical form, so the test above is not vacuous


# ---- B6: a training run folder --------------------------------------------------------------------

def test_load_and_info_open_the_latest_checkpoint_of_a_run(model, tmp_path, capsys):
    from openk3.checkpoint.steps import save_checkpoint

    run = tmp_path / "run"
    other = K3ForCausalLM.build(nano(), dtype=torch.float32, seed=4)
    save_checkpoint(run, 1, model, {"step": 1})
    save_checkpoint(run, 2, other, {"step": 2})
    want = other.lm_head.weight
    for path in (run, run / "checkpoints"):
        assert resolve_checkpoint(path) == run / "checkpoints" / "step_000002"
        assert torch.equal(load(path).lm_head.weight, want)
    assert main(["info", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"] == str(run / "checkpoints" / "step_000002")

    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="without a complete checkpoint"):
        load(tmp_path / "empty")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not a checkpoint folder .* nor a training run folder"):
        load(tmp_path / "plain")
    with pytest.raises(FileNotFoundError, match="no such checkpoint or training run folder"):
        load(tmp_path / "nowhere")


# ---- B8: non-finite weights ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def f32(model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("f32") / "ck"
    save(model, path, dtype=torch.float32)
    return path


@pytest.mark.parametrize("name, value", [
    (P + "model.layers.5.self_attn.q_proj.weight", float("nan")),  # trunk
    (P + "model.layers.2.self_attn.dt_bias", float("-inf")),  # an fp32 island
    (EXPERT + "weight", float("inf")),  # a routed expert, stacked while it streams in
])
def test_non_finite_weight_is_refused_naming_tensor_and_file(f32, tmp_path, name, value):
    ck = _copy(f32, tmp_path / "ck")
    _rewrite(ck, lambda t: t[name].view(-1).__setitem__(7, value))
    for dtype in (None, torch.bfloat16):
        with pytest.raises(ValueError, match=f"model.safetensors: tensor {name} holds NaN or inf"):
            load(ck, dtype=dtype)


def test_values_that_overflow_the_load_dtype_are_refused(f32, tmp_path):
    ck = _copy(f32, tmp_path / "ck")
    name = P + "model.layers.5.self_attn.q_proj.weight"
    _rewrite(ck, lambda t: t[name].view(-1).__setitem__(0, 1e5))  # fine in fp32, inf in fp16
    assert load(ck).model.layers[5].self_attn.q_proj.weight.view(-1)[0] == 1e5
    with pytest.raises(ValueError, match=f"tensor {name} has values too large for torch.float16"):
        load(ck, dtype=torch.float16)


@pytest.mark.parametrize("keep_packed", [False, True], ids=["unpacked", "packed"])
def test_mxfp4_scales_that_overflow_the_load_dtype_are_refused(model, tmp_path, keep_packed):
    """E2M1 codes cannot be NaN/inf and byte 255 is refused already, so the one other way to non-finite
    weights is a scale too large for the dtype the experts are decoded to; exactly those are refused."""
    ck = tmp_path / "ck"
    save(model, ck, experts_format="mxfp4", dtype=torch.float32)
    packed, scale = EXPERT + "weight_packed", EXPERT + "weight_scale"

    def group0(code_byte: int, scale_byte: int):
        def edit(t):
            t[packed][0, :16] = code_byte  # the 32 elements of group 0 of row 0
            t[scale][0, 0] = scale_byte
        return edit

    _rewrite(ck, group0(0x22, 254))  # all 1.0 * 2^127: finite in fp32 and bf16 (max ~2^128)
    w = load(ck, dtype=torch.float32).model.layers[1].block_sparse_moe.experts.w2
    assert w[3, 0, 0].item() == 2.0**127
    load(ck, dtype=torch.bfloat16, keep_packed=keep_packed)
    _rewrite(ck, group0(0x27, 254))  # one element 6 * 2^127: inf in fp32 and bf16
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(ValueError, match=f"model.safetensors: tensor {scale} has values too large for {dtype}"):
            load(ck, dtype=dtype, keep_packed=keep_packed)
    load(ck, dtype=torch.float64, keep_packed=keep_packed)  # exact in float64
    _rewrite(ck, group0(0x77, 141))  # 6 * 2^14 = 98304: past float16's 65504
    load(ck, dtype=torch.float32, keep_packed=keep_packed)
    with pytest.raises(ValueError, match=f"tensor {scale} has values too large for torch.float16"):
        load(ck, dtype=torch.float16, keep_packed=keep_packed)


# ---- B8: index entries outside the folder; `openk3 info` of broken checkpoints ---------------------

@pytest.fixture(scope="module")
def shards(model, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("shards") / "ck"
    save(model, path, max_shard_bytes=2 * 2**20)
    return path


Q = P + "model.layers.5.self_attn.q_proj.weight"


def _info_error(path: Path, capsys) -> str:
    assert main(["info", str(path)]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("target", ["../outside.safetensors", "ABS"])
def test_index_entries_outside_the_folder_are_refused_unopened(shards, tmp_path, monkeypatch, capsys, target):
    ck = _copy(shards, tmp_path / "ck")
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    outside = tmp_path / "outside.safetensors"
    shutil.copy(ck / index["weight_map"][Q], outside)  # a readable shard that holds the tensor
    entry = str(outside) if target == "ABS" else target
    index["weight_map"][Q] = entry
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    opened = []
    real = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda path, *a, **k: opened.append(path) or real(path, *a, **k))
    with pytest.raises(ValueError, match="weight_map entries must name shard files inside the folder") as ei:
        load(ck)
    assert f"'{Q}': '{entry}'" in str(ei.value)
    msg = _info_error(ck, capsys)
    assert Q in msg and entry in msg
    assert not [p for p in opened if Path(p).resolve().parent != ck.resolve()]


def test_info_of_a_broken_checkpoint_is_one_line_and_exit_2(shards, tmp_path, capsys):
    assert main(["info", str(shards)]) == 0  # the intact copy
    capsys.readouterr()
    ck = _copy(shards, tmp_path / "missing-tensor")
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    shard = index["weight_map"].pop(Q)
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    _rewrite(ck, lambda t: t.pop(Q), file=shard)
    msg = _info_error(ck, capsys)
    assert "missing tensors (1)" in msg and Q in msg

    ck = _copy(shards, tmp_path / "missing-shard")
    victim = sorted(ck.glob("model-*.safetensors"))[1]
    victim.unlink()
    msg = _info_error(ck, capsys)
    assert victim.name in msg and "is missing" in msg

    ck = tmp_path / "no-weights"
    ck.mkdir()
    shutil.copy(shards / "config.json", ck / "config.json")
    assert "no model.safetensors" in _info_error(ck, capsys)
