"""`openk3 export hf|vllm`: folders that transformers (with only openk3 installed, through the shims) and vLLM read."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from helpers import nano_cut, perturb  # noqa: E402

import openk3  # noqa: E402
from openk3.__main__ import main as cli  # noqa: E402
from openk3.chat.xtml import encode_segments, render  # noqa: E402
from openk3.data.corpus import builtin_corpus  # noqa: E402
from openk3.hf.export import VLLM_LINEAR_ATTN_FIELDS, VLLM_TEXT_FIELDS, export_hf, vllm_text_config  # noqa: E402
from openk3.model.model import K3ForCausalLM  # noqa: E402
from openk3.tokenizer import train_bpe  # noqa: E402

VOCAB = 1024
REQUEST = {
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2? I typed <|open|> on purpose."},
        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
        {"role": "user", "content": "Call the tool."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 2}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
    ],
    "tools": [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}],
}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    tok = train_bpe(builtin_corpus(200_000), VOCAB)
    m = K3ForCausalLM.build(nano_cut(4).replace(vocab_size=VOCAB), dtype=torch.float64, seed=0)
    d = tmp_path_factory.mktemp("export") / "src"
    openk3.save(perturb(m).cast(torch.float32), d, dtype=torch.float32, experts_format="mxfp4")
    tok.save(str(d))
    return d


def test_export_hf_loads_with_remote_code_only_and_encodes_as_openk3(src, tmp_path):
    out = tmp_path / "hf"
    assert cli(["export", "hf", str(src), str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_openk3.KimiK3ForConditionalGeneration"
    assert cfg["architectures"] == ["KimiK3ForConditionalGeneration"]
    for name in ("configuration_openk3.py", "modeling_openk3.py", "tokenizer.json", "tokenizer_config.json",
                 "tiktoken.model", "generation_config.json"):
        assert (out / name).is_file(), name
    # a fresh process that never imports openk3.hf itself: the shims do, through trust_remote_code
    ids = [5, 77, 300, 12, 900, 41, 8]
    code = textwrap.dedent(f"""
        import json, sys, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True, dtype=torch.float32)
        assert 'openk3.hf' in sys.modules and type(m).__name__ == 'KimiK3ForConditionalGeneration'
        ids = torch.tensor([{ids}])
        with torch.no_grad():
            torch.save(m(ids).logits, {str(tmp_path / 'logits.pt')!r})
        out = m.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
        tok = AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True)
        chat = tok.apply_chat_template({REQUEST['messages']!r}, tools={REQUEST['tools']!r},
                                       add_generation_prompt=True)["input_ids"]
        print(json.dumps({{"gen": out[0, {len(ids)}:].tolist(), "chat": list(chat), "cls": type(tok).__name__}}))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    ref = openk3.load(out, dtype=torch.float32)
    with torch.no_grad():  # (another process may pick other MoE kernels for its thread count: bit equality is
        # tests/test_hf.py's, in one process)
        torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), ref(torch.tensor([ids])), rtol=1e-5, atol=1e-6)
    want = openk3.LLM(ref).generate([ids], temperature=0, max_tokens=5, ignore_eos=True)[0].token_ids
    assert got["gen"] == want
    tok = openk3.tokenizer.Tokenizer.from_dir(str(src))
    assert got["chat"] == encode_segments(render(dict(REQUEST)), tok).ids


def test_export_vllm_writes_every_field_vllm_reads(src, tmp_path):
    out = tmp_path / "vllm"
    assert cli(["export", "hf", str(src), str(out)]) == 0  # over an earlier hf export: its shims must go
    assert cli(["export", "vllm", str(src), str(out)]) == 0
    assert not list(out.glob("*_openk3.py"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k3" and cfg["architectures"] == ["KimiK3ForConditionalGeneration"]
    assert "auto_map" not in cfg and not (out / "modeling_openk3.py").exists()
    text = cfg["text_config"]
    assert text["model_type"] == "kimi_linear"
    missing = [f for f in VLLM_TEXT_FIELDS if f not in text]
    missing += [f"linear_attn_config.{f}" for f in VLLM_LINEAR_ATTN_FIELDS if text["linear_attn_config"].get(f) is None
                and f not in ("gate_lower_bound",)]
    assert not missing, missing
    assert text["mla_use_nope"] is True
    assert text["quantization_config"]["format"] == "mxfp4-pack-quantized"  # the experts as in SRC
    assert (out / "tokenizer.json").is_file()
    # the folder is still openk3's: it loads to the same model
    a, b = openk3.load(out, dtype=torch.float32), openk3.load(src, dtype=torch.float32)
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())


def test_vllm_tiny_preset_has_vllm_kernel_shapes():
    cfg = openk3.preset("vllm-tiny")
    text = vllm_text_config(cfg)
    assert (text["kv_lora_rank"], text["qk_rope_head_dim"], text["qk_nope_head_dim"], text["v_head_dim"]) == (
        512, 64, 128, 128)
    assert text["linear_attn_config"]["head_dim"] == 128 and text["num_attention_heads"] % 8 == 0
    assert cfg.mla_latent_norm_eps == cfg.rms_norm_eps  # vLLM's latent norm eps
    assert cfg.use_attn_res and cfg.use_latent_moe and cfg.hidden_act == "situ"


def test_export_refuses_a_checkpoint_without_a_tokenizer(tmp_path):
    d = tmp_path / "ck"
    openk3.save(K3ForCausalLM.build(nano_cut(4), seed=0), d)
    with pytest.raises(ValueError, match="--tokenizer"):
        export_hf(d, tmp_path / "out")
    assert not (tmp_path / "out").exists()
