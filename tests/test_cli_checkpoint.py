"""`openk3 info PATH` and `openk3 convert` on real checkpoint folders."""

from __future__ import annotations

import json

import pytest
import torch

import openk3
from openk3.__main__ import main
from openk3.config import nano
from openk3.model.model import K3ForCausalLM


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = K3ForCausalLM.build(nano(), dtype=torch.float32, seed=3)
    openk3.save(model, root / "bf16", max_shard_bytes=2 * 2**20)
    return root


def _ids():
    return torch.randint(0, 512, (2, 19), generator=torch.Generator().manual_seed(0))


def _logits(path, **kw):
    with torch.no_grad():
        return openk3.load(path, dtype=torch.float32, **kw)(_ids())


def test_info_path_reports_files_by_dtype(saved, capsys):
    assert main(["info", str(saved / "bf16"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["total_params"] == 4_795_512 + 6 * (128 - 4)
    files = info["files"]
    assert files["files"] > 1 and files["missing_shards"] == []
    assert set(files["by_dtype"]) == {"BF16", "F32"}
    index = json.loads((saved / "bf16" / "model.safetensors.index.json").read_text())
    assert files["total_bytes"] == index["metadata"]["total_size"]


def test_info_path_of_a_checkpoint_missing_a_shard_exits_2_naming_it(saved, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(saved / "bf16", broken)
    victim = sorted(broken.glob("model-*.safetensors"))[0]
    victim.unlink()
    assert main(["info", str(broken)]) == 2
    assert victim.name in capsys.readouterr().err


def test_convert_mxfp4_and_back_and_config_forms(saved, capsys):
    src = saved / "bf16"
    assert main(["convert", str(src), str(saved / "mx"), "--experts", "mxfp4"]) == 0
    assert main(["info", str(saved / "mx"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out.split("\n", 1)[1])  # first line is convert's report
    assert "U8" in info["files"]["by_dtype"]
    assert "quantization_config" in json.loads((saved / "mx" / "config.json").read_text())["text_config"]
    # mxfp4 -> bf16 is lossless; -> mxfp4 again keeps the codes byte for byte.
    assert main(["convert", str(saved / "mx"), str(saved / "mx-bf16"), "--experts", "bf16"]) == 0
    assert main(["convert", str(saved / "mx"), str(saved / "mx2")]) == 0
    want = _logits(saved / "mx")
    assert torch.equal(_logits(saved / "mx-bf16"), want)
    assert torch.equal(_logits(saved / "mx2"), want)
    # wrapper -> bare -> wrapper keeps the model; the config form follows the flag.
    assert main(["convert", str(src), str(saved / "bare"), "--bare"]) == 0
    assert json.loads((saved / "bare" / "config.json").read_text())["model_type"] == "kimi_linear"
    assert main(["convert", str(saved / "bare"), str(saved / "wrapped"), "--wrapper"]) == 0
    assert json.loads((saved / "wrapped" / "config.json").read_text())["model_type"] == "kimi_k3"
    assert torch.equal(_logits(saved / "bare"), _logits(src))
    assert torch.equal(_logits(saved / "wrapped"), _logits(src))


def test_convert_refuses_same_folder(saved, capsys):
    assert main(["convert", str(saved / "bf16"), str(saved / "bf16")]) == 2
    assert "differ" in capsys.readouterr().err
