"""`openk3 info PATH` and `openk3 convert` on real checkpoint folders."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import nano_cut

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


@pytest.fixture(scope="module")
def saved4(tmp_path_factory):
    """nano cut to 4 layers (every layer kind, MoE experts to convert), sharded the same way."""
    root = tmp_path_factory.mktemp("cli4")
    cfg = nano_cut()
    openk3.save(K3ForCausalLM.build(cfg, dtype=torch.float32, seed=3), root / "bf16", max_shard_bytes=2 * 2**20)
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


def test_info_path_with_nan_or_inf_weights_exits_2_naming_the_tensors(saved, tmp_path, capsys):
    """The headers of such a checkpoint are fine; `info` reads the values too (unless --headers-only)."""
    model = openk3.load(saved / "bf16", dtype=torch.float32)
    with torch.no_grad():
        model.model.embed_tokens.weight[3, 5] = float("nan")
        model.model.norm.weight[0] = float("inf")
    openk3.save(model, tmp_path / "nan", max_shard_bytes=2 * 2**20)
    assert main(["info", str(tmp_path / "nan")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"openk3 info: error: {tmp_path / 'nan'}: 2 tensor(s) hold NaN or inf values")
    assert "language_model.model.embed_tokens.weight (model-" in err and "language_model.model.norm.weight" in err
    assert main(["info", str(tmp_path / "nan"), "--headers-only", "--json"]) == 0  # as before: headers only
    assert main(["info", str(saved / "bf16")]) == 0


def test_convert_mxfp4_and_back_and_config_forms(saved4, capsys):
    saved = saved4
    src = saved / "bf16"
    assert len(list(src.glob("*.safetensors"))) > 1  # convert reads and writes shards
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


def test_convert_carries_the_other_files_and_reads_a_run_folder(saved, tmp_path, capsys):
    """Tokenizer files, templates and code come along (a converted checkpoint still generates); the weights,
    configs and a training checkpoint's optimizer state are what convert rewrites or leaves out."""
    import shutil

    from openk3.tokenizer import Tokenizer

    src = tmp_path / "src"
    shutil.copytree(saved / "bf16", src)
    Tokenizer({bytes([b]): b for b in range(256)}).save(str(src))  # 256 bytes + 256 specials = nano's 512
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "trainer_state.pt").write_bytes(b"optimizer state")
    assert main(["convert", str(src), str(tmp_path / "mx"), "--experts", "mxfp4"]) == 0
    names = {p.name for p in (tmp_path / "mx").iterdir()}
    assert {"tiktoken.model", "tokenizer_config.json", "chat_template.jinja"} <= names
    assert "trainer_state.pt" not in names
    assert (tmp_path / "mx" / "tiktoken.model").read_bytes() == (src / "tiktoken.model").read_bytes()
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "mx"), "--prompt", "a", "--max-tokens", "3",
                 "--temperature", "0"]) == 0
    # a run folder converts its latest checkpoint
    run = tmp_path / "run" / "checkpoints"
    shutil.copytree(src, run / "step_000003")
    (run / "latest").write_text("step_000003\n")
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "from-run")]) == 0
    assert (tmp_path / "from-run" / "tiktoken.model").is_file()


def test_config_json_that_is_a_folder_is_named_by_info_and_generate(tmp_path, capsys):
    (tmp_path / "ck" / "config.json").mkdir(parents=True)
    for argv in (["info", str(tmp_path / "ck")], ["generate", "--model", str(tmp_path / "ck"), "--prompt", "a"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.endswith(f"{tmp_path / 'ck' / 'config.json'}: not a file; a checkpoint's config.json must be "
                            f"a JSON file"), err


def test_load_and_save_take_dtype_names(saved, tmp_path):
    model = openk3.load(saved / "bf16", dtype="float32")
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert openk3.load(saved / "bf16", dtype="bf16").model.embed_tokens.weight.dtype == torch.bfloat16
    assert openk3.load(saved / "bf16", dtype="auto").model.embed_tokens.weight.dtype == torch.bfloat16  # as stored
    openk3.save(model, tmp_path / "f32", dtype="fp32")
    assert openk3.load(tmp_path / "f32").model.embed_tokens.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        openk3.save(model, tmp_path / "x", dtype="fp8")
    with pytest.raises(ValueError, match="not a plain file name"):
        openk3.save(model, tmp_path / "x", extra_files={"../escape": str(tmp_path / "f32" / "config.json")})
    for own in ("config.json", "generation_config.json", "model.safetensors.index.json", "model.safetensors"):
        with pytest.raises(ValueError, match="a file save writes itself"):
            openk3.save(model, tmp_path / "x", extra_files={own: str(tmp_path / "f32" / "config.json")})
    assert not (tmp_path / "x").exists()
    openk3.save(model, tmp_path / "auto", dtype="auto")  # "auto": the model's own trunk dtype (float32 here)
    assert openk3.load(tmp_path / "auto").model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_load_on_a_missing_device_is_a_value_error(saved):
    with pytest.raises(ValueError, match="CUDA is not available"):
        openk3.load(saved / "bf16", device="cuda")


def test_warnings_of_a_command_are_one_line(tmp_path, capsys, saved):
    """An unknown config field is a warning: one `[openk3] warning:` line naming the file, not Python's
    source-path-plus-code format; `info PATH` reads the config once, so warns once."""
    path = tmp_path / "config.json"
    text = openk3.config.preset("nano").to_dict()
    text["some_new_field"] = 1
    path.write_text(json.dumps(text))
    assert main(["info", "--config", str(path)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("[openk3] warning: ") and "some_new_field" in err[0], err
    assert str(path) in err[0] and "UserWarning" not in err[0]
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(saved / "bf16", ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg["some_new_field"] = 1
    (ck / "config.json").write_text(json.dumps(cfg))
    assert main(["info", str(ck)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "some_new_field" in err[0], err
