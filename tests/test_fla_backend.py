"""The GPU path on the CPU: fla's Triton kernels, run by Triton's interpreter, against openk3's PyTorch twins.

Tier `triton` (conftest.py sets TRITON_INTERPRET=1 where there is no CUDA, before anything imports fla): float32,
tiny shapes, every fla kernel openk3 calls (`chunk_kda` with its in-kernel gate and L2 norm, `causal_conv1d`,
`rms_norm_gated`) against the PyTorch path, outputs, final states and all gradients to 1e-5 relative; packed
documents with a state carried into each row's first document and rows of different document counts; and the
whole nano model, forward and backward, fla against chunked. The backend choice and its errors are checked
without the interpreter (they must be fast and clear).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from openk3.ops import fla_kernels
from openk3.ops.kda import kda, kda_recurrent

ROOT = Path(__file__).resolve().parents[1]
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                                 reason="needs TRITON_INTERPRET=1 on a machine without CUDA (conftest.py sets it)")
triton = [pytest.mark.triton, interpreted]


def rel(ref: torch.Tensor, got: torch.Tensor) -> float:
    assert got.shape == ref.shape, (tuple(got.shape), tuple(ref.shape))
    assert torch.isfinite(got).all()
    return ((ref.double() - got.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def packed(B: int, T: int, starts: dict[int, list[int]]) -> torch.Tensor:
    """doc_start [B, T] with documents opening at `starts[row]`; rows hold different numbers of documents."""
    doc_start = torch.zeros(B, T, dtype=torch.bool)
    for row, ts in starts.items():
        doc_start[row, ts] = True
    return doc_start


def kda_inputs(B, T, H, K, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, K, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen))  # K3's bounded gate: (-5, 0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    h0 = torch.randn(B, H, K, K, generator=gen)
    return [q, k, v, g, beta], h0


def naive_per_document(q, k, v, g, beta, scale, h0, doc_start):
    """fla's own pure-torch recurrence (`naive_recurrent_kda`, independent of openk3), run document by document:
    each row's carried state feeds its first document, every later document starts from zero; returns the
    outputs [B, T, H, V] and each row's final state."""
    from fla.ops.kda.naive import naive_recurrent_kda

    outs, finals = [], []
    for b in range(q.shape[0]):
        bounds = [0, *[t for t in doc_start[b].nonzero().flatten().tolist() if t > 0], q.shape[1]]
        start = None if h0 is None or doc_start[b, 0] else h0[b:b + 1]
        row = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            o, state = naive_recurrent_kda(*(x[b:b + 1, lo:hi] for x in (q, k, v, g, beta)), scale=scale,
                                           initial_state=start, output_final_state=True)
            row.append(o)
            start = None  # the next document starts from zero
        outs.append(torch.cat(row, 1))
        finals.append(state)
    return torch.cat(outs), torch.cat(finals)


def grads_of(fn, tensors, seed=3):
    """(outputs, gradients) of a random linear functional of everything `fn` returns, w.r.t. `tensors`."""
    tensors = [t.detach().clone().requires_grad_() for t in tensors]
    outs = fn(*tensors)
    gen = torch.Generator().manual_seed(seed)
    total = sum((o * torch.randn(o.shape, generator=gen)).sum() for o in outs)
    return [o.detach() for o in outs], torch.autograd.grad(total, tensors)


# ---- the backend choice (no interpreter needed) ----------------------------------------------------------------

def test_backend_names_and_environment(monkeypatch):
    monkeypatch.delenv(fla_kernels.ENV, raising=False)
    assert fla_kernels.check_backend(None) == "auto"
    monkeypatch.setenv(fla_kernels.ENV, "chunked")
    assert fla_kernels.check_backend(None) == "chunked"
    monkeypatch.setenv(fla_kernels.ENV, "triton")
    with pytest.raises(ValueError, match="OPENK3_KDA_BACKEND.*'triton'"):
        fla_kernels.check_backend(None)
    with pytest.raises(ValueError, match="kda_backend.*'cuda'"):
        fla_kernels.check_backend("cuda", "kda_backend")
    x = torch.zeros(1, 4)
    assert not fla_kernels.use_fla("auto", x) and not fla_kernels.use_fla("chunked", x)  # never the interpreter
    with pytest.raises(ValueError, match="float64"):
        fla_kernels.use_fla("fla", x.double())


def test_fla_on_cpu_without_the_interpreter_is_a_clear_error():
    code = ("import torch; from openk3.ops.kda import kda\n"
            "x = torch.zeros(1, 8, 1, 16)\n"
            "try:\n    kda(x, x, x, x, x[..., 0], scale=1.0, backend='fla')\n"
            "except ValueError as e:\n    print('ERR', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "ERR" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stdout + out.stderr


def test_a_layer_set_to_chunked_ignores_the_environment(monkeypatch):
    """A layer's own backend wins over OPENK3_KDA_BACKEND, down to the delta rule (no interpreter needed)."""
    from openk3 import config as presets
    from openk3.model.model import K3ForCausalLM

    monkeypatch.setenv(fla_kernels.ENV, "fla")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # fla on these CPU tensors would be a ValueError
    model = K3ForCausalLM.build(presets.nano(), seed=0, kda_backend="chunked")
    model(torch.zeros(1, 5, dtype=torch.long)).sum().backward()  # no fla, no "TRITON_INTERPRET" error


def test_packing_maps_row_states_to_documents():
    """Row states go to each row's first document unless the row opens with a document start; final states come
    back from each row's last document."""
    doc_start = packed(3, 10, {0: [4, 7], 2: [0, 5]})
    pack = fla_kernels.Packing.of(doc_start, 3, 10)
    assert pack.cu_seqlens_cpu.tolist() == [0, 4, 7, 10, 20, 25, 30]
    assert pack.first.tolist() == [0, 3, 4] and pack.last.tolist() == [2, 3, 5]
    assert pack.carried.tolist() == [True, True, False]
    rows = torch.arange(1.0, 4.0).view(3, 1)
    assert pack.spread(rows, torch.float32).flatten().tolist() == [1, 0, 0, 2, 0, 0]
    assert pack.gather_last(torch.arange(6.0)).tolist() == [2, 3, 5]


def test_the_model_takes_a_backend():
    from openk3 import config as presets
    from openk3.model.model import K3ForCausalLM

    model = K3ForCausalLM.build(presets.nano(), kda_backend="chunked")
    layers = [m for m in model.modules() if type(m).__name__ == "KimiDeltaAttention"]
    assert layers and all(m.backend == "chunked" for m in layers)
    with pytest.raises(ValueError, match="kda_backend.*'gpu'"):
        model.set_kda_backend("gpu")


# ---- the triton tier -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "carried_state"])
@pytest.mark.triton
@interpreted
def test_chunk_kda_equals_the_recurrence_on_packed_rows(with_state):
    """`kda(backend="fla")` against fla's independent naive recurrence (document by document) and openk3's token
    loop: two rows of different document counts (the first opens two documents mid-row, the second one), 70
    tokens (two of fla's 64-token chunks), a state carried into each row's first document."""
    B, T, H, K = 2, 70, 2, 16
    inputs, h0 = kda_inputs(B, T, H, K)
    doc_start = packed(B, T, {0: [30, 66], 1: [41]})
    extra = [h0] if with_state else []

    def run(backend):
        def fn(q, k, v, g, beta, *h):
            h0 = h[0] if h else None
            if backend == "fla's naive":
                return naive_per_document(q, k, v, g, beta, K ** -0.5, h0, doc_start)
            if backend == "recurrent":
                return kda_recurrent(q, k, v, g, beta, scale=K ** -0.5, initial_state=h0, doc_start=doc_start)
            return kda(q, k, v, g, beta, scale=K ** -0.5, initial_state=h0, doc_start=doc_start, backend=backend)
        return grads_of(fn, [*inputs, *extra])

    (o, s), g = run("fla")
    for reference in ("fla's naive", "recurrent"):  # an independent implementation, and openk3's token loop
        (o_ref, s_ref), g_ref = run(reference)
        assert rel(o_ref, o) < 1e-5 and rel(s_ref, s) < 1e-5, reference
        for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], g_ref, g):
            assert rel(a, b) < 1e-5, (reference, name)


def within_float32(name: str, exact: torch.Tensor, twin: torch.Tensor, fla: torch.Tensor) -> None:
    """fla (float32) equals the PyTorch twin up to float32 rounding: its error against the twin run in float64 is at
    most 1e-5 relative, or (a sum of many terms that cancel, such as A_log's gradient) at most 4x the float32
    twin's own error."""
    err, own = rel(exact, fla), rel(exact, twin)
    assert err <= max(1e-5, 4 * own), f"{name}: fla {err:.1e} vs float64, the float32 twin {own:.1e}"


def run_layer(layer, backend, dtype, x, seg, state0):
    """Output, new state, and the gradients (input and every parameter) of a random functional of both."""
    import copy

    from openk3.model.cache import KDAState

    layer = copy.deepcopy(layer).to(dtype)
    layer.backend = backend
    xg = x.to(dtype).requires_grad_()
    state = KDAState(state0.conv.to(dtype), state0.recurrent.to(dtype))
    out, new = layer(xg, seg_BT=seg, state=state)
    gen = torch.Generator().manual_seed(5)
    total = sum((t * torch.randn(t.shape, generator=gen, dtype=torch.float64).to(dtype)).sum()
                for t in (out, new.recurrent, new.conv))
    total.backward()
    grads = {"x": xg.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    grads["A_log"] = grads["A_log"][:layer.num_heads]  # the release's zero padding is never read
    return {"out": out, "recurrent": new.recurrent, "conv": new.conv, **grads}


@pytest.mark.parametrize("lower_bound", [-5.0, None, -8.0],
                         ids=["k3_bounded_gate", "kimi_linear_gate", "bound_beyond_safe_gate"])
@pytest.mark.triton
@interpreted
def test_kda_layer_fla_equals_chunked(lower_bound):
    """One KDA layer (nano's widths) with fla's conv, in-kernel gate and L2 norm, and gated norm, against the
    PyTorch path: packed documents, a carried decode state (conv history and recurrent state), every gradient.
    A lower bound below fla's safe-gate range (-5) hands fla the decay computed outside the kernel."""
    from openk3 import config as presets
    from openk3.model.kda import KimiDeltaAttention

    cfg = presets.nano()
    cfg.linear_attn_config.gate_lower_bound = lower_bound
    torch.manual_seed(0)
    layer = KimiDeltaAttention(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    B, T = 2, 37
    x = torch.randn(B, T, cfg.hidden_size)
    seg = torch.zeros(B, T, dtype=torch.long)
    seg[0, 20:] = 1
    state0 = layer.empty_state(B, x.device, x.dtype)
    state0.conv.normal_()
    state0.recurrent.normal_()
    exact = run_layer(layer, "chunked", torch.float64, x, seg, state0)
    twin = run_layer(layer, "chunked", torch.float32, x, seg, state0)
    fla = run_layer(layer, "fla", torch.float32, x, seg, state0)
    assert torch.equal(twin["conv"], fla["conv"])  # the conv history: the last inputs, copied
    for name in exact:
        within_float32(name, exact[name], twin[name], fla[name])


@pytest.mark.triton
@interpreted
def test_nano_model_fla_equals_chunked():
    """The whole nano model (6 KDA layers), forward and backward on packed rows: the loss and every parameter's
    gradient with backend="fla" equal backend="chunked" (up to float32 rounding, against a float64 run)."""
    from openk3 import config as presets
    from openk3.model.model import K3ForCausalLM

    model = K3ForCausalLM.build(presets.nano(), seed=0)
    B, T = 2, 24
    ids = torch.randint(0, model.config.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1))
    seg = torch.zeros(B, T, dtype=torch.long)
    seg[1, 9:] = 1

    def run(backend, dtype):
        model.to(dtype).set_kda_backend(backend)
        model.zero_grad()
        logits = model(ids[:, :-1], seg_BT=seg)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
        grads = {n: g[:4] if n.endswith("A_log") else g for n, g in grads.items()}  # 4 heads; the rest padding
        return {"loss": loss.detach().double(), **grads}

    exact = run("chunked", torch.float64)
    twin = run("chunked", torch.float32)
    fla = run("fla", torch.float32)
    assert fla.keys() == exact.keys() and len(fla) > 50
    for name in exact:
        within_float32(name, exact[name], twin[name], fla[name])


@pytest.mark.triton
@interpreted
def test_nano_decode_steps_fla_equal_chunked(monkeypatch):
    """Prefill (fla's conv and chunk_kda) and three decode steps (fla's fused_recurrent_kda) of the nano model
    against the PyTorch path: the logits of every step (which carry the KDA states forward)."""
    from openk3 import config as presets
    from openk3.model.model import K3ForCausalLM

    calls = []
    step = fla_kernels.recurrent_step_
    monkeypatch.setattr(fla_kernels, "recurrent_step_", lambda *a, **k: calls.append(1) or step(*a, **k))

    model = K3ForCausalLM.build(presets.nano(), seed=0).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(2))

    def run(backend):
        model.set_kda_backend(backend)
        with torch.no_grad():
            cache = model.new_cache()
            logits = [model(ids[:, :20], cache=cache)[:, -1]]
            logits += [model(ids[:, t:t + 1], cache=cache)[:, -1] for t in range(20, 23)]
        return torch.stack(logits, 1)

    ref = run("chunked")
    assert not calls
    got = run("fla")
    assert len(calls) == 3 * 6  # three decode steps x six KDA layers
    for t in range(ref.shape[1]):
        assert rel(ref[:, t], got[:, t]) < 1e-5, t
