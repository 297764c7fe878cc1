"""Tests for openk3/ops/kda.py: chunked == recurrent == step (values, states, gradients), packed documents,
numerical stability under steep decays, and agreement with fla's independent naive reference."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from openk3.ops import fla_kernels
from openk3.ops import kda as kda_mod
from openk3.ops import kda_chunked as chunk_mod
from openk3.ops.kda import kda, kda_chunked, kda_recurrent, kda_step, kda_step_

F64 = torch.float64


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, ratio: float, floor: float = 1e-30) -> None:
    """Relative RMS error ||ref - got|| / max(||ref||, floor) must be <= ratio (and got finite)."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    ref, got = ref.double(), got.double()
    err = ((ref - got).norm() / max(ref.norm().item(), floor)).item()
    assert err <= ratio, f"{name}: relative RMS error {err:.3e} > {ratio:.1e}"


def make_inputs(B, T, H, K, V, *, dtype=F64, seed=0, gate="softplus"):
    """Realistic inputs: L2-normalised q/k, beta = sigmoid(randn), negative log-decay g.

    gate: "softplus" (Kimi-Linear form, -softplus(randn)), "k3" (uniform in [-5, 0), as deep as K3's bounded
    gate goes) or "hard" (k3 plus a few -1e4 steps: hard resets through the gate).
    """
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=F64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=F64))
    if gate == "softplus":
        g = -F.softplus(torch.randn(B, T, H, K, generator=gen, dtype=F64))
    else:
        g = -5.0 * torch.rand(B, T, H, K, generator=gen, dtype=F64)
        if gate == "hard":
            g[:, T // 3, :, : K // 2] = -1e4
            g[:, T // 2] = -1e4
    return [x.to(dtype) for x in (q, k, v, g, beta)]


def make_state(B, H, K, V, *, dtype=F64, seed=1):
    return torch.randn(B, H, K, V, generator=torch.Generator().manual_seed(seed), dtype=F64).to(dtype)


def _grads(fn, inputs, seed=2):
    """Outputs and gradients of a random linear functional of (o, final_state) w.r.t. every input."""
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    o, state = fn(*inputs)
    gen = torch.Generator().manual_seed(seed)
    w_o = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    w_s = torch.randn(state.shape, generator=gen, dtype=state.dtype)
    grads = torch.autograd.grad((o * w_o).sum() + (state * w_s).sum(), inputs)
    return o.detach(), state.detach(), grads


GRAD_NAMES = ["q", "k", "v", "g", "beta", "initial_state"]


# (T, chunk): odd lengths, T < C, several chunks, and C = 24 (sub-tiles of gcd(24, 16) = 8).
LENGTHS_AND_CHUNKS = [(1, 16), (7, 16), (63, 64), (100, 16), (130, 64), (130, 32), (50, 24)]


@pytest.mark.parametrize(("T", "chunk_size"), LENGTHS_AND_CHUNKS, ids=[f"T{t}-C{c}" for t, c in LENGTHS_AND_CHUNKS])
def test_chunked_matches_recurrent_values_and_grads(T, chunk_size):
    B, H, K, V = 2, 2, 12, 10
    inputs = make_inputs(B, T, H, K, V, seed=T) + [make_state(B, H, K, V)]
    scale = K**-0.5

    def rec(q, k, v, g, beta, h0):
        return kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=h0)

    def chk(q, k, v, g, beta, h0):
        return kda_chunked(q, k, v, g, beta, scale=scale, initial_state=h0, chunk_size=chunk_size)

    o_ref, s_ref, g_ref = _grads(rec, inputs)
    o, s, grads = _grads(chk, inputs)
    assert o.dtype == F64 and s.dtype == F64
    assert_close("o", o_ref, o, 1e-12)
    assert_close("final_state", s_ref, s, 1e-12)
    for name, ref, got in zip(GRAD_NAMES, g_ref, grads):
        assert_close(f"d{name}", ref, got, 1e-10)


def test_zero_initial_state_is_default():
    inputs = make_inputs(1, 20, 2, 8, 8)
    o1, s1 = kda_chunked(*inputs, scale=0.3, chunk_size=16)
    o2, s2 = kda_chunked(*inputs, scale=0.3, chunk_size=16, initial_state=torch.zeros(1, 2, 8, 8, dtype=F64))
    assert torch.equal(o1, o2) and torch.equal(s1, s2)


def test_step_iterated_equals_recurrent():
    B, T, H, K, V = 2, 9, 2, 12, 10
    q, k, v, g, beta = make_inputs(B, T, H, K, V)
    h0 = make_state(B, H, K, V)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, scale=0.4, initial_state=h0)
    state, outs = h0, []
    for t in range(T):
        o_t, state = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], scale=0.4, state=state)
        assert o_t.shape == (B, H, V) and state.shape == (B, H, K, V)
        outs.append(o_t)
    assert_close("o", o_ref, torch.stack(outs, 1), 1e-13)
    assert_close("state", s_ref, state, 1e-13)


@pytest.mark.parametrize("gate", ["softplus", "hard"])
def test_inplace_step_equals_step(gate):
    """`kda_step_` (the engine's decode: state updated in place) == `kda_step`, token after token."""
    B, T, H, K, V = 3, 7, 2, 12, 10
    q, k, v, g, beta = make_inputs(B, T, H, K, V, gate=gate)
    ref = make_state(B, H, K, V)
    state = ref.clone()
    ptr = state.data_ptr()
    for t in range(T):
        o_ref, ref = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], scale=0.4, state=ref)
        o = kda_step_(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], scale=0.4, state=state)
        assert_close(f"o[{t}]", o_ref, o, 1e-14)
    assert state.data_ptr() == ptr
    assert_close("state", ref, state, 1e-14)


@pytest.mark.parametrize("prefix", [1, 40, 64], ids=lambda p: f"prefix{p}")
def test_chunked_prefill_then_decode_equals_recurrent(prefix):
    B, T, H, K, V = 1, 70, 2, 12, 10
    q, k, v, g, beta = make_inputs(B, T, H, K, V, gate="k3")
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, scale=0.3)
    o_pre, state = kda_chunked(q[:, :prefix], k[:, :prefix], v[:, :prefix], g[:, :prefix], beta[:, :prefix],
                               scale=0.3, chunk_size=64)
    outs = [o_pre]
    for t in range(prefix, T):
        o_t, state = kda_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], scale=0.3, state=state)
        outs.append(o_t[:, None])
    assert_close("o", o_ref, torch.cat(outs, 1), 1e-12)
    assert_close("state", s_ref, state, 1e-12)


# Document starts per row for T = 80: row 0 opens at t=0 (discarding initial_state) and exactly on the chunk
# boundary t=16 (chunk 16) or t=64 (chunk 64); row 1 keeps initial_state for its first document.
DOC_STARTS = {0: [0, 16, 37, 64], 1: [5, 16, 50]}


def _doc_start(B, T):
    doc_start = torch.zeros(B, T, dtype=torch.bool)
    for row, starts in DOC_STARTS.items():
        doc_start[row, starts] = True
    return doc_start


def _separate_documents(inputs, h0, doc_start, scale):
    """Reference for packed rows: run every document of every row on its own with kda_recurrent."""
    q, k, v, g, beta = inputs
    B, T = doc_start.shape
    o_rows, s_rows = [], []
    for b in range(B):
        bounds = [0, *[t for t in doc_start[b].nonzero().flatten().tolist() if t > 0], T]
        outs, state = [], None
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            init = h0[b : b + 1] if lo == 0 and not doc_start[b, 0] else None
            o, state = kda_recurrent(*(x[b : b + 1, lo:hi] for x in (q, k, v, g, beta)), scale=scale,
                                     initial_state=init)
            outs.append(o)
        o_rows.append(torch.cat(outs, 1))
        s_rows.append(state)
    return torch.cat(o_rows), torch.cat(s_rows)


@pytest.mark.parametrize("impl", ["recurrent", "chunked16", "chunked64"])
def test_doc_start_equals_separate_documents(impl):
    B, T, H, K, V = 2, 80, 2, 12, 10
    inputs = make_inputs(B, T, H, K, V, seed=3)
    h0 = make_state(B, H, K, V)
    doc_start = _doc_start(B, T)
    o_ref, s_ref = _separate_documents(inputs, h0, doc_start, 0.3)
    if impl == "recurrent":
        o, s = kda_recurrent(*inputs, scale=0.3, initial_state=h0, doc_start=doc_start)
    else:
        o, s = kda_chunked(*inputs, scale=0.3, initial_state=h0, doc_start=doc_start, chunk_size=int(impl[7:]))
    assert_close("o", o_ref, o, 1e-12)
    assert_close("final_state (last document)", s_ref, s, 1e-12)


def test_doc_start_gradients_chunked_vs_recurrent():
    B, T, H, K, V = 2, 80, 2, 12, 10
    inputs = make_inputs(B, T, H, K, V, seed=4) + [make_state(B, H, K, V)]
    doc_start = _doc_start(B, T)

    def rec(q, k, v, g, beta, h0):
        return kda_recurrent(q, k, v, g, beta, scale=0.3, initial_state=h0, doc_start=doc_start)

    def chk(q, k, v, g, beta, h0):
        return kda_chunked(q, k, v, g, beta, scale=0.3, initial_state=h0, doc_start=doc_start, chunk_size=16)

    _, _, g_ref = _grads(rec, inputs)
    _, _, grads = _grads(chk, inputs)
    for name, ref, got in zip(GRAD_NAMES, g_ref, grads):
        assert_close(f"d{name}", ref, got, 1e-10)


@pytest.fixture
def pairwise_calls(monkeypatch):
    """Counts calls of the exact pairwise fallback used for tiles whose decay is too steep to factorise."""
    calls = []
    original = chunk_mod._pairwise_tiles

    def counting(*args):
        calls.append(args[0].shape[0])
        return original(*args)

    monkeypatch.setattr(chunk_mod, "_pairwise_tiles", counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("gate", ["k3", "hard"])
def test_stability_steep_decay(dtype, gate, pairwise_calls):
    """g in [-5, 0) with chunk 64 (cumulative decay ~-160 per chunk, beyond exp's fp32 range when factorised
    naively) and hard -1e4 resets: chunked stays finite and equal to the recurrence, gradients too."""
    B, T, H, K, V = 1, 150, 2, 16, 12
    inputs = make_inputs(B, T, H, K, V, dtype=dtype, seed=5, gate=gate) + [make_state(B, H, K, V, dtype=dtype)]
    ratio = 1e-11 if dtype == F64 else 3e-5

    def rec(q, k, v, g, beta, h0):
        return kda_recurrent(q, k, v, g, beta, scale=0.25, initial_state=h0)

    def chk(q, k, v, g, beta, h0):
        return kda_chunked(q, k, v, g, beta, scale=0.25, initial_state=h0, chunk_size=64)

    o_ref, s_ref, g_ref = _grads(rec, inputs)
    o, s, grads = _grads(chk, inputs)
    assert o.dtype == dtype and s.dtype == dtype
    assert_close("o", o_ref, o, ratio)
    assert_close("final_state", s_ref, s, ratio)
    for name, ref, got in zip(GRAD_NAMES, g_ref, grads):
        assert_close(f"d{name}", ref, got, 100 * ratio)
    # K3's bounded gate must stay on the fast factorised path; -1e4 steps must take the exact fallback.
    assert (len(pairwise_calls) > 0) == (gate == "hard")


def test_low_precision_inputs_compute_in_fp32():
    inputs = make_inputs(1, 40, 2, 16, 16, dtype=torch.float32)
    o32, s32 = kda_chunked(*inputs, scale=0.25, chunk_size=16)
    o16, s16 = kda_chunked(*(x.bfloat16() for x in inputs), scale=0.25, chunk_size=16)
    assert o16.dtype == torch.bfloat16 and s16.dtype == torch.bfloat16
    assert_close("o bf16", o32, o16, 3e-2)


def _load_fla_naive():
    path = Path(sysconfig.get_paths()["purelib"]) / "fla" / "ops" / "kda" / "naive.py"
    if not path.is_file():
        pytest.skip(f"fla's naive KDA reference is not installed ({path} missing)")
    spec = importlib.util.spec_from_file_location("fla_kda_naive_oracle", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as err:  # it needs einops
        pytest.skip(f"fla's naive KDA reference cannot be loaded: {err}")
    return module


@pytest.mark.parametrize("impl", ["recurrent", "chunked"])
def test_matches_fla_naive_oracle(impl):
    """fla's naive_recurrent_kda (an independent implementation) computes in fp32 internally, does not
    normalise q/k, multiplies q by `scale` and decays with exp(g) before the delta write, like ours."""
    naive = _load_fla_naive()
    B, T, H, K, V = 2, 70, 2, 16, 12
    q, k, v, g, beta = make_inputs(B, T, H, K, V, dtype=torch.float32, seed=6, gate="k3")
    h0 = make_state(B, H, K, V, dtype=torch.float32)
    o_ref, s_ref = naive.naive_recurrent_kda(q, k, v, g, beta, scale=0.25, initial_state=h0, output_final_state=True)
    if impl == "recurrent":
        o, s = kda_recurrent(q, k, v, g, beta, scale=0.25, initial_state=h0)
    else:
        o, s = kda_chunked(q, k, v, g, beta, scale=0.25, initial_state=h0, chunk_size=64)
    assert_close("o vs fla naive", o_ref, o, 3e-6)
    assert_close("final_state vs fla naive", s_ref, s, 3e-6)


def test_dispatcher_uses_chunked_on_cpu_without_looking_for_fla():
    fla_kernels._import_fla.cache_clear()
    inputs = make_inputs(1, 33, 2, 8, 6)
    doc_start = torch.zeros(1, 33, dtype=torch.bool)
    doc_start[0, 20] = True
    o_ref, s_ref = kda_chunked(*inputs, scale=0.3, doc_start=doc_start, chunk_size=16)
    o, s = kda(*inputs, scale=0.3, doc_start=doc_start, chunk_size=16)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)
    assert fla_kernels._import_fla.cache_info().misses == 0, "CPU inputs must not even try to import fla"


def test_module_import_does_not_import_fla():
    # In a fresh interpreter: other tests of the session may import fla themselves.
    code = "import sys, openk3.ops.kda; assert 'fla' not in sys.modules, sorted(m for m in sys.modules if 'fla' in m)"
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def _fake_fla_varlen_kernel(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens,
                            cu_seqlens_cpu, use_qk_l2norm_in_kernel):
    """Stand-in for fla's chunk_kda in varlen mode (B = 1, one fp32 initial state per sequence)."""
    assert q.shape[0] == 1 and output_final_state and not use_qk_l2norm_in_kernel
    assert torch.equal(cu_seqlens.cpu(), cu_seqlens_cpu)
    assert initial_state is None or initial_state.dtype == torch.float32
    bounds = cu_seqlens_cpu.tolist()
    outs, finals = [], []
    for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = None if initial_state is None else initial_state[n : n + 1].to(q.dtype)
        o, s = kda_recurrent(*(x[:, lo:hi] for x in (q, k, v, g, beta)), scale=scale, initial_state=init)
        outs.append(o)
        finals.append(s)
    return torch.cat(outs, 1), torch.cat(finals).float()


@pytest.mark.parametrize("with_state", [False, True], ids=["no_h0", "h0"])
def test_varlen_conversion_for_fla(with_state, monkeypatch):
    """doc_start -> cu_seqlens, per-sequence initial states and per-row final states, as `kda` feeds fla (with a
    stand-in kernel; tests/test_fla_backend.py runs fla's own under Triton's interpreter)."""
    monkeypatch.setattr(fla_kernels, "fla_ops", lambda x: SimpleNamespace(chunk_kda=_fake_fla_varlen_kernel))
    B, T, H, K, V = 2, 80, 2, 12, 10
    inputs = make_inputs(B, T, H, K, V, seed=7)
    h0 = make_state(B, H, K, V) if with_state else None
    doc_start = _doc_start(B, T)
    o_ref, s_ref = kda_recurrent(*inputs, scale=0.3, initial_state=h0, doc_start=doc_start)
    o, s = fla_kernels.chunk_kda(*inputs, scale=0.3, initial_state=h0, doc_start=doc_start)
    # fla takes and returns fp32 states, so h0 and the final state pass through fp32.
    assert_close("o", o_ref, o, 1e-6 if with_state else 1e-12)
    assert_close("final_state", s_ref, s, 1e-6)


def test_rejects_bad_shapes():
    q, k, v, g, beta = make_inputs(1, 10, 2, 8, 6)
    with pytest.raises(ValueError, match="beta"):
        kda_chunked(q, k, v, g, beta[..., :1], scale=1.0)
    with pytest.raises(ValueError, match="initial_state"):
        kda_chunked(q, k, v, g, beta, scale=1.0, initial_state=torch.zeros(1, 2, 6, 8, dtype=F64))
    with pytest.raises(ValueError, match="doc_start"):
        kda_recurrent(q, k, v, g, beta, scale=1.0, doc_start=torch.zeros(1, 10))


@pytest.fixture
def custom_backward_calls(monkeypatch):
    """Counts calls of the hand-written chunked backward (kda._chunk_backward)."""
    calls = []
    original = chunk_mod._chunk_backward

    def counting(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(chunk_mod, "_chunk_backward", counting)
    return calls


# (T, chunk, gate, with doc_start): one and several sub-tiles per chunk, T < C, odd T, sub-tiles of 8 (C = 24).
CUSTOM_CASES = [(1, 16, "softplus", False), (7, 16, "k3", True), (63, 64, "softplus", False),
                (130, 64, "k3", True), (130, 32, "softplus", True), (50, 24, "k3", False), (97, 48, "k3", True)]


@pytest.mark.parametrize(("T", "chunk_size", "gate", "docs"), CUSTOM_CASES,
                         ids=[f"T{t}-C{c}-{g}{'-docs' if d else ''}" for t, c, g, d in CUSTOM_CASES])
def test_custom_backward_matches_autograd_twin(T, chunk_size, gate, docs, custom_backward_calls):
    """The hand-derived backward equals autograd through the same forward (and the recurrence), all inputs."""
    B, H, K, V = 2, 2, 12, 10
    inputs = make_inputs(B, T, H, K, V, seed=T + 11, gate=gate) + [make_state(B, H, K, V)]
    doc_start = None
    if docs:
        doc_start = torch.zeros(B, T, dtype=torch.bool)
        doc_start[0, [0, T // 3, T // 2]] = True
        doc_start[1, T - 1] = True

    def run(fn):
        return lambda q, k, v, g, beta, h0: fn(q, k, v, g, beta, scale=0.3, initial_state=h0, doc_start=doc_start,
                                                chunk_size=chunk_size)

    o_twin, s_twin, g_twin = _grads(run(kda_mod.kda_chunked_autograd), inputs)
    assert not custom_backward_calls
    o, s, grads = _grads(run(kda_chunked), inputs)
    assert custom_backward_calls, "kda_chunked must use its hand-written backward on non-steep decays"
    assert torch.equal(o, o_twin) and torch.equal(s, s_twin)  # one shared forward
    _, _, g_ref = _grads(run(lambda *a, chunk_size, **kw: kda_recurrent(*a, **kw)), inputs)
    for name, twin, got, ref in zip(GRAD_NAMES, g_twin, grads, g_ref):
        assert_close(f"d{name} vs autograd twin", twin, got, 1e-12)
        assert_close(f"d{name} vs recurrent", ref, got, 1e-10)


def test_custom_backward_single_output_and_fp32(custom_backward_calls):
    """Gradients of o alone and of the final state alone (the other output unused), and fp32 agreement."""
    B, T, H, K, V = 1, 100, 2, 16, 12
    for dtype, ratio in ((F64, 1e-12), (torch.float32, 1e-5)):
        inputs = make_inputs(B, T, H, K, V, dtype=dtype, seed=9, gate="k3") + [make_state(B, H, K, V, dtype=dtype)]
        for pick in (0, 1):
            grads = []
            for fn in (kda_chunked, kda_mod.kda_chunked_autograd):
                xs = [x.detach().clone().requires_grad_() for x in inputs]
                out = fn(*xs[:5], scale=0.25, initial_state=xs[5], chunk_size=32)[pick]
                grads.append(torch.autograd.grad(out.square().sum(), xs))
            for name, got, twin in zip(GRAD_NAMES, *grads):
                assert_close(f"{dtype} output {pick} d{name}", twin, got, ratio)
    assert len(custom_backward_calls) == 4


def test_steep_decay_falls_back_to_autograd(custom_backward_calls):
    """Hard resets (-1e4 steps) make sub-tiles steep: the exact pairwise path, differentiated by autograd."""
    inputs = [x.requires_grad_() for x in make_inputs(1, 40, 2, 8, 8, gate="hard")]
    o, s = kda_chunked(*inputs, scale=0.3, chunk_size=16)
    (o.sum() + s.sum()).backward()
    assert not custom_backward_calls
    assert all(torch.isfinite(x.grad).all() for x in inputs)
