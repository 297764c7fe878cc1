"""Weight-only integer trunks (`openk3/quant/trunk.py`): the packed torch matmuls equal their slow twins (the
dequantised weight through F.linear), the quantisation error is within half a step, the loader quantises as it
reads (the same model as quantising afterwards), decode through the engine equals full forwards, and the modules
that are read as tensors are left alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_llm import byte_tokenizer, full_forward_greedy

import openk3
from openk3.checkpoint import load
from openk3.infer.llm import LLM
from openk3.quant.trunk import (
    GROUPS,
    Int4Linear,
    Int8Linear,
    group_of,
    int4_fits,
    quantize_trunk_,
)


@pytest.mark.isa  # torch's packed int4 layout and kernel differ by CPU level: .ci/run reruns this with AVX2 only
@pytest.mark.parametrize("N,K", [(64, 32), (128, 96), (576, 224), (192, 64), (64, 2080)])
def test_int4_packed_matmul_equals_the_codes_it_was_given(N, K):
    """The packed matmul and `dequantize()` (read back through it) equal the weight the codes and scales stand for,
    computed independently ((q - 8) * scale + zero), on this CPU's kernel form; float64 input takes that twin."""
    torch.manual_seed(N + K)
    w = torch.randn(N, K)
    codes, sz = Int4Linear.quantize(w)
    want = Int4Linear.weight_of(codes, sz, 32)
    m = Int4Linear(codes, sz, 32)
    torch.testing.assert_close(m.dequantize(), want, rtol=0, atol=1e-6)
    x = torch.randn(3, K)
    torch.testing.assert_close(m(x), F.linear(x, want), rtol=1e-5, atol=1e-5 * max(1, K / 256))  # float32 sums
    torch.testing.assert_close(m(x.double()), F.linear(x.double(), want.double()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls", [Int8Linear, Int4Linear])
@pytest.mark.parametrize("N,K,lead", [(64, 32, (1,)), (128, 96, (3, 7)), (192, 160, (2, 1, 5))])
def test_packed_matmul_equals_its_slow_twin(cls, N, K, lead):
    torch.manual_seed(0)
    lin = nn.Linear(K, N, bias=False)
    m = cls.from_linear(lin)
    w = m.dequantize()
    x = torch.randn(*lead, K)
    torch.testing.assert_close(m(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    xb = x.to(torch.bfloat16)  # bf16 activations: the same weights, bf16 rounding
    torch.testing.assert_close(m(xb).float(), F.linear(xb.float(), w), rtol=3e-2, atol=3e-2)
    # within half a quantisation step of the float weight, per element
    if cls is Int8Linear:
        step = m.scale[:, None].expand(N, K)
    else:
        step = m.scale_zero[..., 0].t().repeat_interleave(m.group, 1)
    assert bool(((w - lin.weight).abs() <= step / 2 + 1e-6).all())


def test_int4_needs_a_fitting_shape():
    assert int4_fits(128, 64) and not int4_fits(96, 64) and not int4_fits(128, 48)
    with pytest.raises(ValueError, match="multiple"):
        Int4Linear.from_linear(nn.Linear(48, 96, bias=False))


def test_quantize_trunk_leaves_tensors_read_elsewhere():
    """Every trunk linear is replaced; kv_b_proj (absorbed into MLA attention), the AttnRes projections, the router,
    norms and the embedding stay; int4 promotes lm_head to int8 by default; an unfitting shape gets int8."""
    model = openk3.K3ForCausalLM.build(openk3.preset("nano"), seed=0)
    done = quantize_trunk_(model, "int4")
    names = {n for n, m in model.named_modules() if isinstance(m, (Int8Linear, Int4Linear))}
    assert names == set(done)
    assert done["lm_head"] == "int8"
    assert {group_of(n, model) for n in done} == set(GROUPS)  # every group exists in nano's K3 form
    for i, layer in enumerate(model.model.layers):  # an attention linear's group is its layer's kind
        kind = "kda" if type(layer.self_attn).__name__ == "KimiDeltaAttention" else "mla"
        for leaf in ("o_proj", "g_proj"):
            if hasattr(layer.self_attn, leaf):
                assert group_of(f"model.layers.{i}.self_attn.{leaf}", model) == kind
    left = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert left and all(n.endswith(("kv_b_proj", "res_proj")) for n in left)
    assert any(k == "int4" for k in done.values())
    with pytest.raises(ValueError, match="unknown trunk group"):
        quantize_trunk_(openk3.K3ForCausalLM.build(openk3.preset("nano"), seed=0), "int4", promote=("heads",))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("trunk") / "ck"
    openk3.save(openk3.K3ForCausalLM.build(openk3.preset("nano"), seed=0), path, dtype=torch.float32,
                experts_format="mxfp4")
    byte_tokenizer().save(str(path))
    return path


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_load_quantises_as_it_reads(ckpt, fmt):
    """`load(trunk=fmt)` (each linear quantised as its weight arrives) is the loaded model quantised afterwards,
    bit for bit; streamed experts combine with it."""
    a = load(ckpt, trunk=fmt, keep_packed=True)
    b = load(ckpt, keep_packed=True)
    quantize_trunk_(b, fmt)
    ids = torch.randint(0, 512, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(a(ids), b(ids))
        c = load(ckpt, trunk=fmt, experts="stream", expert_cache="1MB")
        assert torch.equal(c(ids), a(ids))
    with pytest.raises(ValueError, match="trunk must be one of"):
        load(ckpt, trunk="int3")


def test_int4_trunk_decodes_as_its_full_forward(ckpt):
    """The engine's cached decode (KDA's decode step with integer projections, MLA's absorbed path) gives the greedy
    tokens of full forwards of the same int4 model; compile is refused."""
    llm = LLM(ckpt, trunk="int4", keep_packed=True)
    ids = llm.tokenizer.encode("Hello")
    (out,) = llm.generate(ids, max_tokens=6, temperature=0, ignore_eos=True)
    assert out.token_ids == full_forward_greedy(llm.model, ids, 6)
    with pytest.raises(ValueError, match="uncompiled"):
        LLM(ckpt, trunk="int4", compile=True)
    with pytest.raises(ValueError, match="checkpoint path"):
        LLM(llm.model, trunk="int4")


def test_generate_cli_trunk(ckpt, capsys):
    from openk3.__main__ import main

    assert main(["generate", "--model", str(ckpt), "--prompt", "a", "--max-tokens", "3", "--temperature", "0",
                 "--trunk", "int4", "--experts", "stream", "--expert-cache", "1MB", "--stats"]) == 0
    assert "[experts]" in capsys.readouterr().err


def test_parameter_counts_see_through_integer_trunks_and_streamed_experts(ckpt):
    from openk3.model.accounting import count_params

    want = count_params(load(ckpt)).to_dict()
    assert count_params(load(ckpt, trunk="int4", experts="stream", expert_cache="1MB")).to_dict() == want
