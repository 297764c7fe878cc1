"""The tensor-only decode step (openk3/infer/graph.py): its eager form equals the engine's eager path
in float64 (K3 and Kimi-Linear forms, slots of different lengths joining and leaving, key windows
that grow), the compiled form equals the eager one, a failed compile falls back without touching the
real state, and the MoE forms the compiled step uses are twins of the reference loop."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import assert_close, needs_vector_inductor

from openk3.config import preset
from openk3.infer.engine import Engine
from openk3.infer.graph import ROW_MAJOR_LINEARS, DecodeGraph, column_major_linears_
from openk3.infer.sample import SamplingParams
from openk3.model.model import K3ForCausalLM
from openk3.model.moe import Router
from openk3.ops import moe as moe_ops

F64 = torch.float64


def _prompts(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _short(name: str):
    """`name` cut to 3 layers (1 dense + 2 MoE; KDA 1-2, MLA 3; in the K3 form AttnRes blocks of 2 layers, so one
    block boundary): every structural feature of the preset, with a third of the graph to compile (cold inductor
    cache on a fresh CI machine: tracing, lowering and the C++ wrapper's compile grow with the layers)."""
    cfg = preset(name)
    blocks = {"attn_res_block_size": 2} if cfg.attn_res_block_size is not None else {}
    return cfg.replace(num_hidden_layers=3, **blocks, **{"linear_attn_config.full_attn_layers": [3],
                                                         "linear_attn_config.kda_layers": None})


def _run(model, graph, prompts, *, max_tokens, slots, vary=True):
    """Greedy generation; with `graph`, every decode step goes through it. Returns tokens and the
    logits of every decode step (per request, in order)."""
    eng = Engine(model, None, max_num_seqs=slots, prefill_chunk=64)
    eng.graph = graph
    logits: dict[str, list[torch.Tensor]] = {}
    sample = eng._sample

    def spy(reqs, logits_nV):
        for r, row in zip(reqs, logits_nV, strict=True):
            logits.setdefault(r.id, []).append(row.clone())
        return sample(reqs, logits_nV)

    eng._sample = spy
    extra = [i % 3 if vary else 0 for i in range(len(prompts))]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens + e) for e in extra]
    ids = [eng.add_request(p, sp, ignore_eos=True) for p, sp in zip(prompts, params, strict=True)]
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    return [outs[i] for i in ids], [torch.stack(logits[i]) for i in ids]


@pytest.mark.parametrize("name", ["nano", "nano-kl"])
def test_eager_graph_step_equals_engine_path_float64(name):
    """Seven requests through three slots: joins, leaves, compaction; prompts long enough that the
    power-of-two key window of the graph step grows several times."""
    model = K3ForCausalLM.build(preset(name), dtype=F64, seed=0).eval()
    prompts = _prompts((5, 17, 1, 30, 9, 3, 70), model.config.vocab_size)
    ref_tok, ref_logits = _run(model, None, prompts, max_tokens=9, slots=3)
    got_tok, got_logits = _run(model, DecodeGraph(model, compile=False), prompts, max_tokens=9, slots=3)
    assert got_tok == ref_tok
    for a, b in zip(ref_logits, got_logits, strict=True):
        assert_close("logits", a, b, 1e-11)


def test_compile_failure_falls_back_to_eager():
    model = K3ForCausalLM.build(preset("nano"), dtype=F64, seed=0).eval()
    prompts = _prompts((6, 11), model.config.vocab_size)
    ref_tok, _ = _run(model, None, prompts, max_tokens=5, slots=2)
    graph = DecodeGraph(model, compile=False)
    graph.compiled = True  # pretend: the first call goes through the guarded compile attempt

    def broken(*args):
        raise RuntimeError("no C++ compiler")

    graph._fn = broken
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got_tok, _ = _run(model, graph, prompts, max_tokens=5, slots=2)
    assert got_tok == ref_tok
    assert not graph.compiled and sum("no C++ compiler" in str(w.message) for w in caught) == 1


@pytest.mark.slow(seconds=52)
@needs_vector_inductor
def test_compiled_step_equals_eager_step(monkeypatch):
    """torch.compile of the step, K3 form (AttnRes, gates, latent MoE): the first call compiles (about
    50 s on one CPU core with a cold inductor cache; kept to one graph here: three rows decoding together in four slots,
    which takes the fused MoE kernel as an opaque operator when it is available, else the dense form).
    The key window grows past the buffers' first capacity under the same graph. Greedy tokens equal,
    logits within fp32 rounding. (The MoE branches the compiled step can take are twins of the
    reference loop, tested below and in test_moe_cpu.py; a batch of one row compiles a second graph.)"""
    from openk3.model.moe import compiled_impl
    from openk3.ops import moe_cpu

    model = K3ForCausalLM.build(_short("nano"), seed=0).eval()
    c = model.config
    form = compiled_impl(3, c.num_experts_per_token, c.num_experts, c.moe_intermediate_size, c.expert_in_dim,
                         fused=moe_cpu.available())
    assert form == ("fused_op" if moe_cpu.available() else "dense")
    prompts = _prompts((30, 9, 23), c.vocab_size)  # 62 tokens: all three prefill in the first step
    ref_tok, ref_logits = _run(model, None, prompts, max_tokens=40, slots=4, vary=False)
    calls = []
    if moe_cpu.available():  # count the kernel's calls from inside the compiled graph
        lib = moe_cpu._lib()
        monkeypatch.setattr(moe_cpu, "_lib", lambda: calls.append(1) or lib)
    graph = DecodeGraph(model, compile=True)
    got_tok, got_logits = _run(model, graph, prompts, max_tokens=40, slots=4, vary=False)
    assert graph.compiled, "the step should have compiled here (gcc is part of the CI image)"
    moe_layers = sum(1 for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))
    assert len(calls) >= (39 * moe_layers if moe_cpu.available() else 0), (len(calls), moe_layers)
    assert got_tok == ref_tok
    for a, b in zip(ref_logits, got_logits, strict=True):
        assert_close("logits", a, b, 2e-4)


@pytest.mark.slow(seconds=28)
@needs_vector_inductor
def test_compiled_step_on_packed_mxfp4_experts(monkeypatch):
    """A model with MXFP4-packed experts (`keep_packed=True` loads) decodes compiled: every MoE layer of the
    graph calls the MXFP4 kernel as `openk3::experts_mxfp4`; greedy tokens equal the eager engine's, logits
    within fp32 rounding. (About 25 s of compiling on one CPU core, cold cache.)"""
    from openk3.model.packed_experts import pack_model_experts_
    from openk3.ops import moe_mxfp4_cpu

    if not moe_mxfp4_cpu.available():
        pytest.skip("no C compiler: compiled decode of packed experts is refused (tested in test_moe_mxfp4_cpu.py)")
    model = pack_model_experts_(K3ForCausalLM.build(_short("nano-kl"), seed=0).eval())
    prompts = _prompts((12, 5, 9), model.config.vocab_size)
    ref_tok, ref_logits = _run(model, None, prompts, max_tokens=10, slots=4, vary=False)
    calls = []
    lib = moe_mxfp4_cpu._lib()
    monkeypatch.setattr(moe_mxfp4_cpu, "_lib", lambda: calls.append(1) or lib)
    graph = DecodeGraph(model, compile=True)
    got_tok, got_logits = _run(model, graph, prompts, max_tokens=10, slots=4, vary=False)
    assert graph.compiled
    moe_layers = sum(1 for layer in model.model.layers if hasattr(layer, "block_sparse_moe"))
    assert len(calls) >= 9 * moe_layers, (len(calls), moe_layers)
    assert got_tok == ref_tok
    for a, b in zip(ref_logits, got_logits, strict=True):
        assert_close("logits", a, b, 2e-4)


# ---- the MoE forms used inside the compiled step ----------------------------------------------------------

def _moe_inputs(N=11, C=6, I=5, E=9, K=3, dtype=F64):
    g = torch.Generator().manual_seed(N * 7 + E)
    x = torch.randn(N, C, generator=g, dtype=dtype)
    w1, w3 = (torch.randn(E, I, C, generator=g, dtype=dtype) / C**0.5 for _ in range(2))
    w2 = torch.randn(E, C, I, generator=g, dtype=dtype) / I**0.5
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    weights = torch.rand(N, K, generator=g, dtype=dtype) + 0.1
    return [t.requires_grad_() for t in (x, weights, w1, w3, w2)], idx


def test_column_major_linears_keep_the_model(tmp_path):
    """The compiled CPU step's weight layout: every linear but kv_b_proj and tied or one-row weights moves
    to column-major memory; forward, backward and a save/load round trip see the same values."""
    from openk3.checkpoint import load, save

    cfg = preset("nano")
    model = K3ForCausalLM.build(cfg, dtype=F64, seed=0)
    model.lm_head.weight = model.model.embed_tokens.weight  # shared by hand (K3 is untied): must stay row-major
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    twin = copy.deepcopy(model)
    ref = model(ids)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Router))}
    moved = column_major_linears_(model)
    kept = {n for n, m in linears.items() if m.weight.is_contiguous()}
    assert moved == len(linears) - len(kept) > 30
    assert all(m.weight.t().is_contiguous() for n, m in linears.items() if n not in kept)
    assert {n.rsplit(".", 1)[-1] for n in kept} >= {*ROW_MAJOR_LINEARS, "lm_head", "mlp_res_proj"}
    assert any(isinstance(m, Router) for n, m in linears.items() if n not in kept)
    assert all(linears[n].weight.shape[0] == 1 or n.endswith(("kv_b_proj", "lm_head")) for n in kept)
    assert column_major_linears_(model) == 0  # idempotent
    out = model(ids)
    assert_close("forward", ref, out, 1e-12)
    out.sum().backward()
    twin(ids).sum().backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert_close(name, q.grad, p.grad, 1e-12)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied for the file
    save(model, tmp_path / "ckpt", dtype=F64)
    back = load(tmp_path / "ckpt")
    assert all(t.is_contiguous() for t in back.state_dict().values())
    assert_close("reloaded", ref, back(ids), 1e-12)


@pytest.mark.parametrize("form", ["gather", "dense"])
@pytest.mark.parametrize("N", [1, 4, 11])
def test_static_expert_forms_equal_loop_float64(N, form):
    from openk3.model.layers import swiglu

    (x, weights, w1, w3, w2), idx = _moe_inputs(N=N)
    ref = moe_ops.experts_loop(x, weights, idx, w1, w3, w2, swiglu)
    got = getattr(moe_ops, f"experts_{form}")(x, weights, idx, w1, w3, w2, swiglu)
    assert_close("out", ref, got, 1e-12)
    do = torch.randn(ref.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
    for a, b in zip(torch.autograd.grad(ref, (x, weights, w1, w3, w2), do),
                    torch.autograd.grad(got, (x, weights, w1, w3, w2), do), strict=True):
        assert_close("grad", a, b, 1e-12)


@pytest.mark.parametrize("act", [("situ", 4.0, 25.0), ("silu", 4.0, 25.0)])
def test_grouped_experts_operator(act):
    """The opaque operator is `experts_grouped` with the activation rebuilt from its recipe, and its
    fake (shape-only) implementation agrees with the real one (torch.library.opcheck)."""
    from openk3.model.layers import make_glu
    from openk3.model.moe import _experts_grouped_op

    (x, weights, w1, w3, w2), idx = _moe_inputs(N=13, C=8, I=12, dtype=torch.float32)
    args = [t.detach() for t in (x, weights)] + [idx] + [t.detach() for t in (w1, w3, w2)]
    ref = moe_ops.experts_grouped(*args, make_glu(*act))
    assert torch.equal(_experts_grouped_op(*args, *act), ref)
    torch.library.opcheck(_experts_grouped_op, (*args, *act), test_utils=("test_schema", "test_faketensor"))


def test_llm_and_engine_take_compile():
    """`openk3.LLM(..., compile=True)` and `Engine(compile=True)` share one compiled step per model
    (compilation itself is lazy: nothing compiles here)."""
    from openk3.infer.llm import LLM

    model = K3ForCausalLM.build(preset("nano"), seed=0).eval()
    llm = LLM(model, compile=True)
    assert llm.engine.graph is not None and llm.engine.graph.compiled
    assert Engine(model, None, compile=True).graph is llm.engine.graph
    assert Engine(model, None).graph is None
    assert llm.engine.graph.cpp_wrapper  # on CPU the graph's wrapper is C++ (less per-step overhead)
