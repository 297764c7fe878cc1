"""The `gpu` tier: what only a CUDA device can check (skipped elsewhere; `scripts/gpu_check.sh` runs it).

Stated tolerances (relative RMS error against the float32 PyTorch twin on the same device):
- fla's kernels in float32: 2e-3 (fla's dots may run in TF32 on tensor cores, ~1e-3 relative per product, where
  the interpreter on the CPU multiplies in full float32 and meets 1e-5: tests/test_fla_backend.py);
- fla's kernels on bfloat16 inputs: 3e-2 (inputs and outputs rounded to 8 mantissa bits);
- the nano model under bf16 autocast against float32: logits 5e-2, and training still moves every parameter;
- a compiled training step against eager, float32: gradients 1e-3 (inductor's Triton kernels reorder sums).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_fla_backend import kda_inputs, packed, rel

from openk3 import config as presets
from openk3.model.model import K3ForCausalLM
from openk3.ops.kda import kda

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


def _loss(model, ids, seg=None):
    logits = model(ids[:, :-1], seg_BT=seg)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_fla_chunk_kda_equals_the_twin_on_gpu(dtype, tol):
    B, T, H, K = 2, 200, 4, 64
    inputs, h0 = kda_inputs(B, T, H, K)
    doc_start = packed(B, T, {0: [70, 133], 1: [101]}).to(CUDA)
    ref = [x.to(CUDA).requires_grad_() for x in (*inputs, h0)]
    got = [x.to(CUDA).to(dtype if i < 5 else torch.float32).detach().requires_grad_() for i, x in enumerate(ref)]
    o_ref, s_ref = kda(*ref[:5], scale=K ** -0.5, initial_state=ref[5], doc_start=doc_start, backend="chunked")
    o, s = kda(*got[:5], scale=K ** -0.5, initial_state=got[5], doc_start=doc_start, backend="fla")
    gen = torch.Generator().manual_seed(3)
    w_o, w_s = torch.randn(o_ref.shape, generator=gen).to(CUDA), torch.randn(s_ref.shape, generator=gen).to(CUDA)
    ((o_ref * w_o).sum() + (s_ref * w_s).sum()).backward()
    ((o.float() * w_o).sum() + (s.float() * w_s).sum()).backward()
    assert rel(o_ref, o) < tol and rel(s_ref, s) < tol
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], ref, got):
        assert rel(a.grad, b.grad) < tol, name


def test_nano_model_fla_equals_chunked_on_gpu():
    model = K3ForCausalLM.build(presets.nano(), seed=0, device=CUDA)
    ids = torch.randint(0, model.config.vocab_size, (2, 129), generator=torch.Generator().manual_seed(1)).to(CUDA)
    seg = torch.zeros(2, 128, dtype=torch.long, device=CUDA)
    seg[1, 50:] = 1
    grads = {}
    for backend in ("chunked", "fla"):
        model.set_kda_backend(backend)
        model.zero_grad()
        loss = _loss(model, ids, seg)
        loss.backward()
        grads[backend] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (l_ref, g_ref), (l_fla, g_fla) = grads["chunked"], grads["fla"]
    assert abs(l_fla - l_ref) <= 2e-3 * abs(l_ref)
    for n, g in g_ref.items():
        if n.endswith("A_log"):
            g, g_fla[n] = g[:4], g_fla[n][:4]
        assert rel(g, g_fla[n]) < 2e-2, n


def test_bf16_autocast_stays_close_to_float32_on_gpu():
    model = K3ForCausalLM.build(presets.nano(), seed=0, device=CUDA)
    ids = torch.randint(0, model.config.vocab_size, (2, 97), generator=torch.Generator().manual_seed(2)).to(CUDA)
    with torch.no_grad():
        ref = model(ids)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = model(ids)
    assert rel(ref, got.float()) < 5e-2
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = _loss(model, ids)
    loss.backward()
    opt.step()
    moved = [n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert torch.isfinite(loss) and len(moved) == len(before)


def test_compiled_training_step_equals_eager_on_gpu():
    cfg = presets.nano()
    model = K3ForCausalLM.build(cfg, seed=0, device=CUDA)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, cfg.vocab_size, (2, 65), generator=torch.Generator().manual_seed(4)).to(CUDA)
    _loss(model, ids).backward()
    _loss(torch.compile(twin), ids).backward()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert (p.grad is None) == (q.grad is None), f"{n}: a gradient in one run only"
        if p.grad is not None:
            assert rel(p.grad, q.grad) < 1e-3, n
