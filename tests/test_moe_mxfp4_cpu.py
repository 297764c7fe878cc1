"""The MXFP4 CPU MoE kernel (`ops/moe_mxfp4_cpu.py`) equals the per-expert loop on the dequantised
experts (its AVX-512 and portable dequantisers alike), refuses bad input with a clear error, and is
what a model with packed experts decodes through, eager and compiled."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from helpers import assert_close
from test_ops_moe import GLUS, _inputs

from openk3.config import preset
from openk3.infer.graph import DecodeGraph
from openk3.model.model import K3ForCausalLM
from openk3.model.packed_experts import pack_model_experts_
from openk3.ops import cbuild, moe_mxfp4_cpu
from openk3.ops.moe import experts_loop
from openk3.quant.mxfp4 import pack, unpack

pytestmark = pytest.mark.isa  # results depend on the CPU's kernels: .ci/run reruns them with AVX2 only

F64 = torch.float64
ACTS = {"situ": ("situ", 4.0, 25.0), "swiglu": ("silu", 4.0, 25.0)}  # GLUS names -> the kernel's recipe
needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler")

# (case of test_ops_moe's routing, C, I): every width a multiple of 32. N1: the one-token decode paths;
# N29 unbalanced: experts with 1..4+ tokens (padded lanes); one-expert-hot with 150 tokens: > 64 per expert.
SHAPES = [("N1-uniform", 64, 32), ("N13-uniform", 96, 64), ("N29-unbalanced", 32, 96), ("N17-one-expert-hot", 160, 32)]


def _packed_inputs(case, C, I, dtype, tokens=None):
    (x, weights, w1, w3, w2), idx = _inputs(case, F64, widths=(C, I))
    if tokens is not None:  # more tokens, the same routing kind: tile the rows
        reps = -(-tokens // x.shape[0])
        x, weights, idx = (t.detach().repeat(reps, 1)[:tokens] for t in (x, weights, idx))
    bufs = [b for w in (w1, w3, w2) for b in pack(w.detach())]
    deq = [unpack(bufs[2 * j], bufs[2 * j + 1], dtype) for j in range(3)]
    return x.detach().to(dtype), weights.detach().to(dtype), idx, bufs, deq


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            return set(next((line for line in fh if line.startswith("flags")), "").split())
    except OSError:
        return set()


# The AVX2 form as a third kernel only where the native one is more (an AVX-512 machine then tests both SIMD
# forms in one pass; elsewhere it would repeat "native" or not build)
_FORMS = ["native", "portable"] + (["avx2"] if {"avx2", "fma", "avx512f"} <= cpu_flags() else [])


@pytest.fixture(params=_FORMS)
def kernel(request, monkeypatch):
    """The kernel as built for this machine (its SIMD form: AVX-512 or AVX2 where the CPU has them), the portable
    C one, and the AVX2 form on a machine with AVX-512."""
    if request.param == "avx2":
        monkeypatch.setenv("OPENK3_KERNEL_ISA", "avx2")
    if request.param == "portable":
        monkeypatch.setattr(cbuild, "FLAGS", [*cbuild.FLAGS, "-DOPENK3_SCALAR"])
    if request.param != "native":
        built = moe_mxfp4_cpu._lib.__wrapped__()  # the build function, uncached
        monkeypatch.setattr(moe_mxfp4_cpu, "_lib", lambda: built)
    return request.param


@needs_cc
def test_the_simd_form_is_the_one_the_cpu_allows(kernel):
    """The float32 kernel that runs: AVX-512 where the CPU (and $OPENK3_KERNEL_ISA) has it, else AVX2 + FMA, else
    portable C; the forced forms as asked."""
    flags = cpu_flags()
    isa = os.environ.get("OPENK3_KERNEL_ISA", "native")
    if kernel == "portable" or isa == "default" or not flags:
        want = "portable" if kernel == "portable" or isa == "default" else moe_mxfp4_cpu.simd_form()
    elif kernel == "avx2" or isa == "avx2" or "avx512f" not in flags:
        want = "avx2" if {"avx2", "fma"} <= flags else "portable"
    else:
        want = "avx512"
    assert moe_mxfp4_cpu.simd_form() == want


@needs_cc
@pytest.mark.parametrize("glu_name", list(GLUS))
@pytest.mark.parametrize("case,C,I", SHAPES)
def test_mxfp4_kernel_equals_loop_float64(kernel, case, C, I, glu_name):
    x, weights, idx, bufs, deq = _packed_inputs(case, C, I, F64)
    ref = experts_loop(x, weights, idx, *deq, GLUS[glu_name])
    got = moe_mxfp4_cpu.experts_mxfp4(x, weights, idx, *bufs, *ACTS[glu_name])
    assert got.dtype == F64 and got.shape == ref.shape
    assert_close(f"{case} {glu_name}", ref, got, 1e-12)


@needs_cc
def test_mxfp4_kernel_many_tokens_per_expert(kernel):
    """150 tokens on one hot expert: the kernel's 64-token chunks."""
    x, weights, idx, bufs, deq = _packed_inputs("N17-one-expert-hot", 64, 32, F64, tokens=150)
    assert int(torch.bincount(idx.flatten()).max()) > 64
    ref = experts_loop(x, weights, idx, *deq, GLUS["situ"])
    assert_close("150 tokens", ref, moe_mxfp4_cpu.experts_mxfp4(x, weights, idx, *bufs, *ACTS["situ"]), 1e-12)


@needs_cc
@pytest.mark.parametrize("case,C,I", SHAPES)
def test_mxfp4_kernel_float32_is_accurate(kernel, case, C, I):
    """float32: the dequantised weights are exact, so only the sums' rounding differs from float64."""
    x, weights, idx, bufs, deq = _packed_inputs(case, C, I, torch.float32)
    exact = experts_loop(x.double(), weights.double(), idx, *(w.double() for w in deq), GLUS["situ"])
    got = moe_mxfp4_cpu.experts_mxfp4(x, weights, idx, *bufs, *ACTS["situ"])
    assert got.dtype == torch.float32
    assert_close(case, exact, got.double(), 1e-5)


@needs_cc
def test_mxfp4_kernel_refuses_bad_input():
    x, weights, idx, bufs, _ = _packed_inputs("N13-uniform", 64, 32, torch.float32)
    call = moe_mxfp4_cpu.experts_mxfp4
    nan = [b.clone() for b in bufs]
    nan[1][idx[0, 0], 0, 0] = 255  # E8M0 NaN in a routed expert's gate scales
    with pytest.raises(ValueError, match="scale byte 255"):
        call(x, weights, idx, *nan, *ACTS["situ"])
    with pytest.raises(ValueError, match="out of range"):
        call(x, weights, idx + 100, *bufs, *ACTS["situ"])
    with pytest.raises(ValueError, match="must be uint8"):
        call(x, weights, idx, bufs[0].float(), *bufs[1:], *ACTS["situ"])
    with pytest.raises(ValueError, match="float32 or float64"):
        call(x.bfloat16(), weights, idx, *bufs, *ACTS["situ"])
    with pytest.raises(ValueError, match="shapes do not fit"):
        call(x, weights, idx, *bufs[:5], bufs[5][:, :, :0], *ACTS["situ"])
    with pytest.raises(ValueError, match="multiples of 32"):
        call(x[:, :48], weights, idx, *bufs, *ACTS["situ"])
    with pytest.raises(ValueError, match="unknown activation"):
        call(x, weights, idx, *bufs, "gelu", 4.0, 25.0)


@needs_cc
def test_mxfp4_op_registration():
    x, weights, idx, bufs, _ = _packed_inputs("N13-uniform", 64, 32, torch.float32)
    torch.library.opcheck(moe_mxfp4_cpu.experts_mxfp4_op, (x, weights, idx, *bufs, *ACTS["situ"]),
                          test_utils=("test_schema", "test_faketensor"))


def _decode_logits(model, ids_BT, next_BS):
    cache = model.new_cache()
    out = [model(ids_BT, cache=cache)[:, -1]]
    out += [model(next_BS[:, s:s + 1], cache=cache)[:, -1] for s in range(next_BS.shape[1])]
    return torch.stack(out)


@needs_cc
@pytest.mark.parametrize("name", ["nano", "nano-kl"])
def test_packed_model_decodes_through_the_kernel(name, monkeypatch):
    """A model with MXFP4-packed experts (`keep_packed=True` loads, `pack_model_experts_`) decodes through
    the kernel, and its logits equal the unpacked model's on the same (dequantised) weights, float64."""
    plain = K3ForCausalLM.build(preset(name), seed=0).to(F64).eval()
    packed = pack_model_experts_(K3ForCausalLM.build(preset(name), seed=0).to(F64).eval())
    for moe_p, moe_q in zip(*([m for m in mdl.modules() if hasattr(m, "experts")] for mdl in (plain, packed)),
                            strict=True):
        moe_p.experts = moe_q.experts.to_experts(F64)  # the same weights, dequantised
    calls = []
    real = moe_mxfp4_cpu.experts_mxfp4
    monkeypatch.setattr(moe_mxfp4_cpu, "experts_mxfp4", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    ids = torch.randint(0, plain.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))
    nxt = torch.randint(0, plain.config.vocab_size, (3, 3), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = _decode_logits(packed, ids, nxt)
        ref = _decode_logits(plain, ids, nxt)
    assert calls and 21 in calls and 3 in calls, calls
    assert_close("logits", ref, got, 1e-10)


@needs_cc
def test_packed_experts_compile_into_one_op(monkeypatch):
    """Under torch.compile (fullgraph) the packed layer is the opaque `openk3::experts_mxfp4` call, equal
    to eager."""
    model = pack_model_experts_(K3ForCausalLM.build(preset("nano-kl"), seed=0).eval())
    moe = next(m for m in model.modules() if hasattr(m, "experts") and hasattr(m.experts, "w1_packed"))
    x = torch.randn(1, 3, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    with torch.no_grad():
        ref = moe(x)
        got = torch.compile(moe, fullgraph=True, backend="aot_eager")(x)
    assert_close("compiled", ref, got, 1e-6)


def test_the_kernel_availability_marks_match_torchs_own():
    """openk3.model.moe marks its availability probes without importing torch._dynamo; the mark must be the
    attribute `torch.compiler.assume_constant_result` sets (a torch that renames it fails here)."""
    from openk3.model import moe as moe_mod

    def probe() -> bool:
        return True

    torch.compiler.assume_constant_result(probe)
    marks = {k: v for k, v in vars(probe).items()}
    assert marks, "assume_constant_result no longer marks the function object"
    for fn in (moe_mod._fused_available, moe_mod._mxfp4_available):
        assert {k: getattr(fn, k, None) for k in marks} == marks, fn


def test_compiled_decode_of_packed_experts_without_the_kernel_is_refused(monkeypatch):
    model = pack_model_experts_(K3ForCausalLM.build(preset("nano-kl"), seed=0).eval())
    monkeypatch.setenv("OPENK3_NO_KERNELS", "1")
    moe_mxfp4_cpu._lib.cache_clear()
    try:
        with pytest.raises(ValueError, match="MXFP4 CPU kernel"):
            DecodeGraph(model, compile=True)
        DecodeGraph(model, compile=False)  # eager decode stays available (experts_packed)
        ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert torch.isfinite(model(ids)).all()
    finally:
        monkeypatch.delenv("OPENK3_NO_KERNELS")
        moe_mxfp4_cpu._lib.cache_clear()


# ---- review additions: edges the C harness covered, kept as cheap regressions -------------------------------

def _raw(E, I, C, N, K, gen, scale_bytes=(118, 126)):
    """Random MXFP4 buffers (any codes, scale bytes drawn from `scale_bytes` as a range or a tuple of values)."""
    def scales(*shape):
        if isinstance(scale_bytes, range):
            return torch.randint(scale_bytes.start, scale_bytes.stop, shape, generator=gen, dtype=torch.uint8)
        pick = torch.tensor(scale_bytes, dtype=torch.uint8)
        return pick[torch.randint(0, len(scale_bytes), shape, generator=gen)]

    bufs = [torch.randint(0, 256, (E, I, C // 2), generator=gen, dtype=torch.uint8), scales(E, I, C // 32),
            torch.randint(0, 256, (E, I, C // 2), generator=gen, dtype=torch.uint8), scales(E, I, C // 32),
            torch.randint(0, 256, (E, C, I // 2), generator=gen, dtype=torch.uint8), scales(E, C, I // 32)]
    x = torch.randn(N, C, generator=gen, dtype=F64)
    return x, torch.rand(N, K, generator=gen, dtype=F64), bufs


@needs_cc
@pytest.mark.parametrize("N,C,I,E,hot,scales", [
    (64, 32, 32, 5, 2, range(118, 126)),  # exactly one 64-token chunk
    (65, 32, 32, 5, 2, range(118, 126)),  # 64 + a one-token chunk (the decode path inside a prefill)
    (1, 3584, 32, 4, None, range(118, 126)),  # wide C, narrow I, one token
    (5, 64, 64, 6, None, (0, 1, 120, 254)),  # E8M0 extremes: 2^-127 .. 2^127, exact in float64
])
def test_mxfp4_kernel_edges_float64(kernel, N, C, I, E, hot, scales):
    gen = torch.Generator().manual_seed(N + C)
    x, weights, bufs = _raw(E, I, C, N, 2, gen, scales)
    idx = torch.randint(0, E, (N, 2), generator=gen)
    if hot is not None:
        idx[:, 0] = hot
    idx[0, 1] = idx[0, 0]  # one token picks the same expert twice
    deq = [unpack(bufs[2 * j], bufs[2 * j + 1], F64) for j in range(3)]
    ref = experts_loop(x, weights, idx, *deq, GLUS["situ"])
    assert_close(f"N{N} C{C} I{I}", ref, moe_mxfp4_cpu.experts_mxfp4(x, weights, idx, *bufs, *ACTS["situ"]), 1e-12)


@needs_cc
def test_mxfp4_nan_scale_only_matters_in_a_routed_expert(kernel):
    gen = torch.Generator().manual_seed(5)
    x, weights, bufs = _raw(4, 32, 64, 3, 2, gen)
    idx = torch.tensor([[0, 1], [1, 2], [2, 0]])
    bufs[5][3, 7, 0] = 255  # expert 3 is never routed: not read, not an error
    bufs[1][3, 0, 1] = 255
    deq = [unpack(bufs[2 * j][:3], bufs[2 * j + 1][:3], F64) for j in range(3)]
    assert_close("unused NaN", experts_loop(x, weights, idx, *deq, GLUS["swiglu"]),
                 moe_mxfp4_cpu.experts_mxfp4(x, weights, idx, *bufs, *ACTS["swiglu"]), 1e-12)
    bufs[5][1, 63, 0] = 255  # the last down row of a routed expert
    with pytest.raises(ValueError, match="scale byte 255"):
        moe_mxfp4_cpu.experts_mxfp4(x, weights, idx, *bufs, *ACTS["swiglu"])
    with pytest.raises(ValueError, match="out of range"):
        moe_mxfp4_cpu.experts_mxfp4(x, weights, idx - 1, *bufs, *ACTS["swiglu"])  # id -1


@needs_cc
def test_mxfp4_kernel_reads_negated_views_and_noncontiguous_buffers():
    """A neg-bit view (data_ptr() holds the unnegated values) and transposed buffers are materialised."""
    gen = torch.Generator().manual_seed(6)
    x, weights, bufs = _raw(3, 32, 64, 1, 2, gen)
    idx = torch.tensor([[2, 0]])
    ref = moe_mxfp4_cpu.experts_mxfp4(-x, weights, idx, *bufs, *ACTS["situ"])
    xn = torch._neg_view(x)
    assert xn.is_neg() and xn.is_contiguous()
    assert torch.equal(moe_mxfp4_cpu.experts_mxfp4(xn, weights, idx, *bufs, *ACTS["situ"]), ref)
    t = bufs[0].transpose(1, 2).contiguous().transpose(1, 2)  # the same values, column-major
    assert not t.is_contiguous()
    assert torch.equal(moe_mxfp4_cpu.experts_mxfp4(-x, weights, idx, t, *bufs[1:], *ACTS["situ"]), ref)


@needs_cc
def test_mxfp4_bad_buffers_are_named():
    gen = torch.Generator().manual_seed(7)
    x, weights, bufs = _raw(3, 32, 64, 2, 2, gen)
    idx = torch.tensor([[0, 1], [1, 2]])
    call = moe_mxfp4_cpu.experts_mxfp4
    with pytest.raises(ValueError, match=r"w2_scale on meta"):
        call(x, weights, idx, *bufs[:5], bufs[5].to("meta"), *ACTS["situ"])
    with pytest.raises(ValueError, match=r"w1_scale \(3, 32, 1\)"):
        call(x, weights, idx, bufs[0], bufs[1][:, :, :1], *bufs[2:], *ACTS["situ"])
    with pytest.raises(ValueError, match=r"w3_packed torch.int8"):
        call(x, weights, idx, *bufs[:2], bufs[2].to(torch.int8), *bufs[3:], *ACTS["situ"])
    with pytest.raises(ValueError, match=r"w2_packed \(3, 16, 64\)"):
        call(x, weights, idx, *bufs[:4], bufs[4].transpose(1, 2), bufs[5], *ACTS["situ"])
    with pytest.raises(ValueError, match="weights must be real"):
        call(x, weights.to(torch.complex128), idx, *bufs, *ACTS["situ"])
    with pytest.raises(ValueError, match=r"w1_packed \(torch.sparse_coo\)"):
        call(x, weights, idx, bufs[0].to_sparse(), *bufs[1:], *ACTS["situ"])
    assert call(x, weights, idx.int(), *bufs, *ACTS["situ"]).shape == (2, 64)  # int32 ids are converted
    out = call(x, weights[:, :0], idx[:, :0], *[b[:0] for b in bufs], *ACTS["situ"])  # E = 0, K = 0
    assert torch.equal(out, torch.zeros(2, 64, dtype=F64))
    empty_c = [*(b[:, :, :0] for b in bufs[:4]), bufs[4][:, :0], bufs[5][:, :0]]
    assert call(x[:, :0], weights, idx, *empty_c, *ACTS["situ"]).shape == (2, 0)  # C = 0: C is never called


# ---- the float32 kernel (SIMD: weights decoded into registers) against float64 ---------------------------------

@needs_cc
@pytest.mark.parametrize("glu_name", list(GLUS))
@pytest.mark.parametrize("N,C,I,E,hot", [
    (5, 64, 32, 6, 2),  # five tokens on one expert: a block of four and a block of one
    (70, 32, 64, 5, 1),  # > 64 tokens on one expert, blocks of 1..4 on the others
    (3, 128, 96, 4, None),  # three 16-row blocks of hidden rows, eight of output columns
    (1, 3584, 32, 4, None),  # wide C, one token
])
def test_mxfp4_kernel_float32_blocks(kernel, glu_name, N, C, I, E, hot):
    gen = torch.Generator().manual_seed(N * 7 + C)
    x, weights, bufs = _raw(E, I, C, N, 2, gen)
    idx = torch.randint(0, E, (N, 2), generator=gen)
    if hot is not None:
        idx[:, 0] = hot
    idx[0, 1] = idx[0, 0]  # one token picks the same expert twice
    deq = [unpack(bufs[2 * j], bufs[2 * j + 1], torch.float32) for j in range(3)]
    ref = experts_loop(x, weights, idx, *(w.double() for w in deq), GLUS[glu_name])  # exact weights, float64
    got = moe_mxfp4_cpu.experts_mxfp4(x.float(), weights.float(), idx, *bufs, *ACTS[glu_name])
    assert_close(f"N{N} C{C} I{I}", ref, got.double(), 1e-5)


@needs_cc
@pytest.mark.parametrize("glu_name", list(GLUS))
def test_mxfp4_kernel_float32_glu_range(kernel, glu_name):
    """Token rows from 1e-6 to 1e3 in scale: the GLU's small arguments (tanh near 0, no cancellation), its
    saturation (tanh -> +-1, sigmoid -> 0 or 1, exp overflowing to inf) and everything between, each row
    to its own relative error."""
    gen = torch.Generator().manual_seed(11)
    scales = torch.tensor([1e-6, 1e-3, 0.1, 1.0, 3.0, 30.0, 300.0, 1e3], dtype=F64)
    x, weights, bufs = _raw(3, 32, 64, len(scales), 2, gen)
    x = x * scales[:, None]
    idx = torch.randint(0, 3, (len(scales), 2), generator=gen)
    deq = [unpack(bufs[2 * j], bufs[2 * j + 1], torch.float32).double() for j in range(3)]
    ref = experts_loop(x.float().double(), weights.float().double(), idx, *deq, GLUS[glu_name])
    got = moe_mxfp4_cpu.experts_mxfp4(x.float(), weights.float(), idx, *bufs, *ACTS[glu_name]).double()
    for n in range(len(scales)):
        assert_close(f"row scaled {scales[n]:g}", ref[n], got[n], 2e-5)


@needs_cc
def test_mxfp4_kernel_float32_propagates_nan(kernel):
    """A NaN activation poisons its own token's output row only (the vector exp's clamps keep NaN)."""
    gen = torch.Generator().manual_seed(12)
    x, weights, bufs = _raw(3, 32, 64, 4, 2, gen)
    x, weights = x.float(), weights.float()
    idx = torch.tensor([[0, 1], [1, 2], [0, 2], [2, 1]])
    clean = moe_mxfp4_cpu.experts_mxfp4(x, weights, idx, *bufs, *ACTS["situ"])
    x[1, 5] = float("nan")
    for act in ("situ", "swiglu"):
        got = moe_mxfp4_cpu.experts_mxfp4(x, weights, idx, *bufs, *ACTS[act])
        assert torch.isnan(got[1]).all(), act
        assert torch.isfinite(got[[0, 2, 3]]).all(), act
    assert torch.equal(moe_mxfp4_cpu.experts_mxfp4(x, weights, idx, *bufs, *ACTS["situ"])[[0, 2, 3]], clean[[0, 2, 3]])


def test_mxfp4_fast_path_only_takes_inputs_as_they_are():
    """The decode call skips the named checks only when every one of them would pass with no conversion;
    anything else goes through them (and is converted or refused)."""
    gen = torch.Generator().manual_seed(13)
    x, weights, bufs = _raw(3, 32, 64, 2, 2, gen)
    idx = torch.tensor([[0, 1], [1, 2]])
    ready = moe_mxfp4_cpu._ready_as_is
    assert ready(x, weights, idx, bufs, "situ")
    assert ready(x.float(), weights.float(), idx, bufs, "silu")
    t = bufs[0].transpose(1, 2).contiguous().transpose(1, 2)
    variants = {
        "unknown activation": (x, weights, idx, bufs, "gelu"),
        "neg view": (torch._neg_view(x), weights, idx, bufs, "situ"),
        "int32 ids": (x, weights, idx.int(), bufs, "situ"),
        "weights in another dtype": (x, weights.float(), idx, bufs, "situ"),
        "bfloat16 x": (x.bfloat16(), weights.bfloat16(), idx, bufs, "situ"),
        "non-contiguous buffer": (x, weights, idx, [t, *bufs[1:]], "situ"),
        "short scale": (x, weights, idx, [bufs[0], bufs[1][:, :, :0], *bufs[2:]], "situ"),
        "int8 buffer": (x, weights, idx, [*bufs[:2], bufs[2].to(torch.int8), *bufs[3:]], "situ"),
        "meta buffer": (x, weights, idx, [*bufs[:5], bufs[5].to("meta")], "situ"),
        "sparse buffer": (x, weights, idx, [bufs[0].to_sparse(), *bufs[1:]], "situ"),
        "ids [N]": (x, weights, idx[:, 0], bufs, "situ"),
        "ids of another N": (x, weights[:1], idx[:1], bufs, "situ"),
        "C not a multiple of 32": (x[:, :48], weights, idx, bufs, "situ"),
    }
    for name, args in variants.items():
        assert not ready(*args), name


def _scattered_table(bufs, E):
    """Each expert's six tensors copied to its own places in one big buffer, in a shuffled order and at odd (but
    row-aligned) offsets, as a streamed cache holds them; returns (keep-alive storage, table [E, 6])."""
    gen = torch.Generator().manual_seed(5)
    per = [[b[e].contiguous() for b in bufs] for e in range(E)]
    sizes = [t.numel() for row in per for t in row]
    store = torch.zeros(sum(sizes) + 97 * len(sizes), dtype=torch.uint8)
    table = torch.zeros(E, 6, dtype=torch.int64)
    pos = 0
    for flat in torch.randperm(E * 6, generator=gen).tolist():
        e, k = divmod(flat, 6)
        t = per[e][k].reshape(-1)
        pos += int(torch.randint(0, 97, (1,), generator=gen))
        store[pos:pos + t.numel()] = t
        table[e, k] = store.data_ptr() + pos
        pos += t.numel()
    return store, table


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("case,C,I", SHAPES)
def test_mxfp4_table_form_is_bitwise_the_stacked_form(kernel, case, C, I, dtype):
    """Experts found through a table of addresses (streamed experts), computed in one call or in ascending ranges
    that accumulate, equal the stacked-buffer call bit for bit; a routed expert without a table row is refused."""
    x, weights, idx, bufs, _ = _packed_inputs(case, C, I, dtype)
    order = bufs  # gate, up, down codes and scales: the kernel's order
    E = bufs[0].shape[0]
    ref = moe_mxfp4_cpu.experts_mxfp4(x, weights, idx, *order, "situ", 4.0, 25.0)
    store, table = _scattered_table(order, E)
    one = moe_mxfp4_cpu.experts_mxfp4_table(x, weights, idx, table, I, "situ", 4.0, 25.0, 0, E)
    assert torch.equal(one, ref)
    cuts = sorted({0, E, *torch.randint(0, E + 1, (3,), generator=torch.Generator().manual_seed(1)).tolist()})
    out = None
    for lo, hi in zip(cuts, cuts[1:]):
        out = moe_mxfp4_cpu.experts_mxfp4_table(x, weights, idx, table, I, "situ", 4.0, 25.0, lo, hi, out)
    assert torch.equal(out, ref)
    used = int(idx.reshape(-1)[0])
    table[used] = 0
    with pytest.raises(RuntimeError, match="no table row"):
        moe_mxfp4_cpu.experts_mxfp4_table(x, weights, idx, table, I, "situ", 4.0, 25.0, 0, E)
    del store
