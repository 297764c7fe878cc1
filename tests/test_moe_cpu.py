"""The fused CPU MoE kernel (`ops/moe_cpu.py`) equals the per-expert loop, builds and caches safely,
and steps aside (to the torch paths) when it cannot be built; the compiled step's KDA form equals
the matmul form."""

from __future__ import annotations

import os
import platform
import shutil

import pytest
import torch
from helpers import assert_close
from test_ops_moe import CASES, GLUS, _inputs

from openk3.config import preset
from openk3.model.model import K3ForCausalLM
from openk3.ops import cbuild, moe_cpu
from openk3.ops.kda import kda_step, kda_step_fused_
from openk3.ops.moe import experts_loop

pytestmark = pytest.mark.isa  # results depend on the CPU's kernels: .ci/run reruns them with AVX2 only

F64 = torch.float64
ACTS = {"situ": ("situ", 4.0, 25.0), "swiglu": ("silu", 4.0, 25.0)}  # GLUS names -> the kernel's recipe

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler")


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """A kernel built from scratch into an empty cache directory (and the process cache restored after)."""
    monkeypatch.setenv("OPENK3_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("OPENK3_NO_KERNELS", raising=False)
    moe_cpu._lib.cache_clear()
    yield tmp_path
    moe_cpu._lib.cache_clear()


@needs_cc
def test_kernel_is_available_with_a_compiler():
    assert moe_cpu.available()


@needs_cc
@pytest.mark.parametrize("glu_name", list(GLUS))
@pytest.mark.parametrize("case", list(CASES))
def test_fused_equals_loop_float64(case, glu_name):
    """Odd widths, one token, unbalanced routing, an expert taking every token: blocks of 1-4 tokens."""
    (x, weights, w1, w3, w2), idx = _inputs(case, F64)
    args = [t.detach() for t in (x, weights)] + [idx] + [t.detach() for t in (w1, w3, w2)]
    ref = experts_loop(*args, GLUS[glu_name])
    got = moe_cpu.experts_fused(*args, *ACTS[glu_name])
    assert got.dtype == F64 and got.shape == ref.shape
    assert_close(f"{case} {glu_name}", ref, got, 1e-12)


@needs_cc
@pytest.mark.parametrize("case", list(CASES))
def test_fused_float32_is_accurate(case):
    (x, weights, w1, w3, w2), idx = _inputs(case, F64, widths=(37, 19))
    args = [t.detach() for t in (x, weights)] + [idx] + [t.detach() for t in (w1, w3, w2)]
    exact = experts_loop(*args, GLUS["situ"])
    got = moe_cpu.experts_fused(*[t.float() for t in args[:2]], idx, *[t.float() for t in args[3:]], *ACTS["situ"])
    assert got.dtype == torch.float32
    assert_close(f"{case} fp32 vs fp64", exact, got.double(), 2e-6)


@needs_cc
def test_fused_operator_schema_and_fake():
    (x, weights, w1, w3, w2), idx = _inputs("N13-uniform", torch.float32, widths=(8, 12))
    args = [t.detach() for t in (x, weights)] + [idx] + [t.detach() for t in (w1, w3, w2)]
    assert torch.equal(moe_cpu.experts_fused_op(*args, *ACTS["situ"]), moe_cpu.experts_fused(*args, *ACTS["situ"]))
    torch.library.opcheck(moe_cpu.experts_fused_op, (*args, *ACTS["situ"]),
                          test_utils=("test_schema", "test_faketensor"))


@needs_cc
def test_bad_expert_id_is_a_value_error():
    (x, weights, w1, w3, w2), idx = _inputs("N13-uniform", F64)
    idx = idx.clone()
    idx[3, 1] = w1.shape[0]
    with pytest.raises(ValueError, match="out of range"):
        moe_cpu.experts_fused(x.detach(), weights.detach(), idx, w1.detach(), w3.detach(), w2.detach(), "silu", 4, 25)


@needs_cc
def test_empty_widths_return_without_calling_c():
    """C = 0: an empty output (no buffer behind its data_ptr: C is never called); I = 0: zeros."""
    x, idx, wts = torch.randn(3, 0, dtype=F64), torch.tensor([[0, 1]] * 3), torch.rand(3, 2, dtype=F64)
    out = moe_cpu.experts_fused(x, wts, idx, *(torch.zeros(2, 4, 0, dtype=F64) for _ in range(2)),
                                torch.zeros(2, 0, 4, dtype=F64), "silu", 4, 25)
    assert out.shape == (3, 0)
    x = torch.randn(3, 8, dtype=F64)
    out = moe_cpu.experts_fused(x, wts, idx, *(torch.zeros(2, 0, 8, dtype=F64) for _ in range(2)),
                                torch.zeros(2, 8, 0, dtype=F64), "silu", 4, 25)
    assert torch.equal(out, torch.zeros(3, 8, dtype=F64))


@needs_cc
def test_calls_skip_the_naming_checks_only_for_inputs_as_they_are(monkeypatch):
    """A decode call whose inputs are valid and in the form C reads goes straight to the kernel; one that
    needs a conversion or would be refused takes the checks, and both reach the same result."""
    (x, weights, w1, w3, w2), idx = _inputs("N13-uniform", F64)
    x, weights, w1, w3, w2 = (t.detach() for t in (x, weights, w1, w3, w2))
    as_is = moe_cpu.inputs_as_is
    assert as_is(x, weights, idx, (w1, w3, w2), F64, "situ")
    assert not as_is(x, weights, idx.int(), (w1, w3, w2), F64, "situ")  # ids to convert
    assert not as_is(torch._neg_view(x), weights, idx, (w1, w3, w2), F64, "situ")
    assert not as_is(x, weights, idx, (w1.float(), w3, w2), F64, "situ")
    assert not as_is(x, weights, idx, (w1.transpose(1, 2), w3, w2), F64, "situ")
    assert not as_is(x, weights[:2], idx[:2], (w1, w3, w2), F64, "situ")
    assert not as_is(x, weights, idx, (w1, w3, w2), F64, "gelu")
    checked = []
    monkeypatch.setattr(moe_cpu, "check_call", lambda *a: checked.append(a[0]) or None)
    fast = moe_cpu.experts_fused(x, weights, idx, w1, w3, w2, "situ", 4, 25)
    assert checked == []
    slow = moe_cpu.experts_fused(x, weights, idx.int(), w1, w3, w2, "situ", 4, 25)
    assert checked == ["experts_fused"] and torch.equal(fast, slow)
    w2_short = w2[:, :, :-1]  # as is, but its shape does not fit: the checks run (and refuse it)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="shapes do not fit"):
        moe_cpu.experts_fused(x, weights, idx, w1, w3, w2_short.contiguous(), "situ", 4, 25)


def test_supports_names_what_the_kernel_takes():
    x, w = torch.zeros(2, 4), torch.zeros(3, 5, 4)
    with torch.no_grad():
        assert moe_cpu.supports(x, w, "silu") and moe_cpu.supports(x.double(), w.double(), "situ")
        assert not moe_cpu.supports(x.bfloat16(), w.bfloat16(), "silu")  # bf16: the torch paths
        assert not moe_cpu.supports(x, w.double(), "silu")
        assert not moe_cpu.supports(x, w, "gelu")
    assert not moe_cpu.supports(x, w, "silu")  # autograd on: the kernel has no backward


@needs_cc
def test_build_is_cached_and_atomic(fresh_kernel):
    assert moe_cpu.available()
    built = sorted(os.listdir(fresh_kernel))
    assert len(built) == 1 and built[0].startswith("moe_") and built[0].endswith(".so"), built  # no temp files
    stamp = os.stat(fresh_kernel / built[0]).st_mtime_ns
    moe_cpu._lib.cache_clear()
    assert moe_cpu.available()
    assert sorted(os.listdir(fresh_kernel)) == built and os.stat(fresh_kernel / built[0]).st_mtime_ns == stamp


def test_missing_compiler_warns_once_and_falls_back(fresh_kernel, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.warns(RuntimeWarning, match="fused CPU MoE kernel is unavailable"):
        assert not moe_cpu.available()
    assert not moe_cpu.available()  # decided once per process
    assert os.listdir(fresh_kernel) == []


def _decode_logits(model, ids_BT, next_BS, **kw):
    """Logits of the prompt's last position and of each decode step fed `next_BS` one column at a time."""
    cache = model.new_cache()
    out = [model(ids_BT, cache=cache, **kw)[:, -1]]
    out += [model(next_BS[:, s:s + 1], cache=cache, **kw)[:, -1] for s in range(next_BS.shape[1])]
    return torch.stack(out)


@needs_cc
@pytest.mark.parametrize("name", ["nano", "nano-kl"])
def test_model_decode_takes_the_kernel_and_matches_the_loop(name, monkeypatch):
    """Without autograd, `moe_impl="auto"` sends decode (and short prompts) through the kernel; the
    logits equal the reference loop's (float64, K3 form with latent MoE + SiTU, and Kimi-Linear form)."""
    import openk3.ops.moe_cpu as mod

    model = K3ForCausalLM.build(preset(name), seed=0).to(F64).eval()
    ids = torch.randint(0, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(0))
    calls = []
    real = mod.experts_fused
    monkeypatch.setattr(mod, "experts_fused", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    nxt = torch.randint(0, model.config.vocab_size, (3, 3), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = _decode_logits(model, ids, nxt)
        monkeypatch.setattr(mod, "experts_fused", real)
        ref = _decode_logits(model, ids, nxt, moe_impl="loop")
    assert calls and 21 in calls and 3 in calls, calls  # the prompt (3 x 7 tokens) and the decode steps
    assert_close("logits", ref, got, 1e-10)


def test_without_the_kernel_decode_uses_torch_operators(monkeypatch):
    monkeypatch.setenv("OPENK3_NO_KERNELS", "1")
    moe_cpu._lib.cache_clear()
    try:
        assert not moe_cpu.available()
        model = K3ForCausalLM.build(preset("nano-kl"), seed=0).to(F64).eval()
        ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            assert_close("auto vs loop", model(ids, moe_impl="loop"), model(ids), 1e-12)
    finally:
        monkeypatch.delenv("OPENK3_NO_KERNELS")
        moe_cpu._lib.cache_clear()


# ---- the KDA step as the compiled decode step writes it -----------------------------------------------------

@pytest.mark.parametrize("B,H,K,V", [(1, 1, 3, 5), (5, 3, 7, 4), (16, 2, 8, 8)])
def test_kda_step_fused_equals_matmul_form_float64(B, H, K, V):
    g = torch.Generator().manual_seed(B * 100 + K)
    state = torch.randn(B, H, K, V, generator=g, dtype=F64)
    ref_state = state.clone()
    for _ in range(4):  # several tokens: the in-place state carries over exactly
        q, k = (torch.nn.functional.normalize(torch.randn(B, H, K, generator=g, dtype=F64), dim=-1) for _ in range(2))
        v = torch.randn(B, H, V, generator=g, dtype=F64)
        gdecay = -torch.rand(B, H, K, generator=g, dtype=F64)
        beta = torch.rand(B, H, generator=g, dtype=F64)
        ref_o, ref_state = kda_step(q, k, v, gdecay, beta, scale=K ** -0.5, state=ref_state)
        o = kda_step_fused_(q, k, v, gdecay, beta, scale=K ** -0.5, state=state)
        assert_close("o", ref_o, o, 1e-12)
        assert_close("state", ref_state, state, 1e-12)


def test_compiled_step_picks_gather_for_tiny_picks_and_the_kernel_otherwise():
    from openk3.model.moe import compiled_impl

    nano, small = (32, 32, 128), (64, 48, 256)  # (E, I, C) of nano-kl and small-kl
    assert compiled_impl(1, 4, *nano, fused=True) == "gather"  # 4 x 32 x 128 weights: gathered in the graph
    assert compiled_impl(1, 8, *small, fused=True) == "fused_op"
    assert compiled_impl(16, 4, *nano, fused=True) == "fused_op"
    assert compiled_impl(1, 8, *small, fused=False) == "gather"  # without the kernel
    assert compiled_impl(16, 4, *nano, fused=False) == "dense"
    assert compiled_impl(16, 8, *small, fused=False) == "grouped_op"


@needs_cc
@pytest.mark.parametrize("case", ["w2_dtype", "x_f64_w_f32", "bf16", "idx_rows", "weights_cols", "meta", "act"])
def test_inputs_the_kernel_cannot_take_are_value_errors(case):
    """The C kernel trusts pointers and sizes: every mismatch is refused before it is called."""
    (x, weights, w1, w3, w2), idx = _inputs("N13-uniform", torch.float32, widths=(8, 12))
    args = dict(x=x.detach(), weights=weights.detach(), idx=idx, w1=w1.detach(), w3=w3.detach(), w2=w2.detach())
    act = "silu"
    if case == "w2_dtype":
        args["w2"] = args["w2"].double()
    elif case == "x_f64_w_f32":
        args["x"] = args["x"].double()
    elif case == "bf16":
        args = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in args.items()}
    elif case == "idx_rows":
        args["idx"] = args["idx"][:-1]
    elif case == "weights_cols":
        args["weights"] = args["weights"][:, :-1]
    elif case == "meta":
        args["w1"] = args["w1"].to("meta")
    elif case == "act":
        act = "gelu"
    with pytest.raises(ValueError, match="experts_fused"):
        moe_cpu.experts_fused(*args.values(), act, 4.0, 25.0)


@needs_cc
def test_no_tokens_gives_an_empty_result():
    (x, weights, w1, w3, w2), idx = _inputs("N13-uniform", F64)
    out = moe_cpu.experts_fused(x.detach()[:0], weights.detach()[:0], idx[:0], w1.detach(), w3.detach(), w2.detach(),
                                "silu", 4.0, 25.0)
    assert out.shape == (0, x.shape[1])


@needs_cc
def test_cached_library_is_readable_by_others_and_cc_may_carry_arguments(fresh_kernel, monkeypatch):
    monkeypatch.setenv("CC", f"{shutil.which('cc')} -std=c11")
    monkeypatch.setenv("OPENK3_NO_KERNELS", "0")  # "0" means kernels on
    assert moe_cpu.available()
    (lib,) = os.listdir(fresh_kernel)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(fresh_kernel / lib).st_mode & 0o777 == 0o755 & ~umask


def test_a_compiler_that_makes_nothing_is_not_cached(fresh_kernel, monkeypatch):
    monkeypatch.setenv("CC", shutil.which("true") or "/bin/true")
    with pytest.warns(RuntimeWarning, match="unavailable"):
        assert not moe_cpu.available()
    assert os.listdir(fresh_kernel) == []


@needs_cc
@pytest.mark.parametrize("limit,over,threads", [("FUSED_MAX_EXPERT", 32 * 128 - 1, 1),
                                                ("FUSED_MAX_WORK", 6 * 32 * 128 - 1, 1),
                                                ("FUSED_MAX_WORK", 6 * 32 * 128, 2)])
def test_kernel_yields_to_torch_matmuls(limit, over, threads, monkeypatch):
    """Experts above FUSED_MAX_EXPERT weights per matrix, and work above FUSED_MAX_WORK (tokens x I x C x
    torch threads: the kernel is single-threaded), go to torch's matmuls; at the bounds, to the kernel.
    nano-kl experts are 32 x 128; the prompt is 6 tokens."""
    import openk3.model.moe as moe_mod

    model = K3ForCausalLM.build(preset("nano-kl"), seed=0).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 3))
    calls = []
    real = moe_cpu.experts_fused
    monkeypatch.setattr(moe_cpu, "experts_fused", lambda *a: calls.append(1) or real(*a))

    def kernel_calls(expert_bound, work_bound, num_threads):
        monkeypatch.setattr(moe_mod, "FUSED_MAX_EXPERT", expert_bound)
        monkeypatch.setattr(moe_mod, "FUSED_MAX_WORK", work_bound)
        monkeypatch.setattr(moe_mod.torch, "get_num_threads", lambda: num_threads)
        calls.clear()
        with torch.no_grad():
            model(ids)
        return len(calls)

    assert kernel_calls(32 * 128, 6 * 32 * 128, 1) > 0
    bounds = {"FUSED_MAX_EXPERT": 32 * 128, "FUSED_MAX_WORK": 6 * 32 * 128, limit: over}
    assert kernel_calls(bounds["FUSED_MAX_EXPERT"], bounds["FUSED_MAX_WORK"], threads) == 0


# ---- review fixes: call-side checks and the build cache -----------------------------------------------------

@needs_cc
@pytest.mark.parametrize("case", ["complex_weights", "sparse_weights", "sparse_x", "nested_x", "idx_1d"])
def test_more_inputs_the_kernel_cannot_take_are_named_value_errors(case):
    """Complex routing weights (their imaginary part would be dropped), layouts without a flat buffer behind
    data_ptr() (sparse, nested), and ids that are not [N, K] are ValueErrors naming the argument."""
    (x, weights, w1, w3, w2), idx = _inputs("N13-uniform", torch.float32, widths=(8, 12))
    args = dict(x=x.detach(), weights=weights.detach(), idx=idx, w1=w1.detach(), w3=w3.detach(), w2=w2.detach())
    want = {"complex_weights": "weights must be real", "sparse_weights": r"weights \(torch.sparse_coo\)",
            "sparse_x": r"x \(torch.sparse_coo\)", "nested_x": r"x \(nested\)",
            "idx_1d": r"idx \(13,\) is not \[N, K\]"}
    if case == "complex_weights":
        args["weights"] = args["weights"].to(torch.complex64)
    elif case == "sparse_weights":
        args["weights"] = args["weights"].to_sparse()
    elif case == "sparse_x":
        args["x"] = args["x"].to_sparse()
    elif case == "nested_x":
        args["x"] = torch.nested.nested_tensor(list(args["x"]))
    elif case == "idx_1d":
        args["idx"] = args["idx"][:, 0]
    with pytest.raises(ValueError, match=want[case]):
        moe_cpu.experts_fused(*args.values(), "silu", 4.0, 25.0)


@needs_cc
def test_negated_views_are_read_as_their_values():
    """`z.conj().imag` is a view with the neg bit: data_ptr() holds the unnegated values, and at [1, 1] it is
    even contiguous. The kernel must see -1, not +1 (it used to read +1: a silent sign flip)."""
    (x, weights, w1, w3, w2), idx = _inputs("N1-uniform", F64)
    args = [x.detach(), None, idx[:, :1], w1.detach(), w3.detach(), w2.detach()]
    neg = torch.complex(torch.zeros(1, 1, dtype=F64), torch.ones(1, 1, dtype=F64)).conj().imag
    assert neg.is_neg() and neg.is_contiguous()
    args[1] = -torch.ones(1, 1, dtype=F64)
    ref = moe_cpu.experts_fused(*args, "silu", 4.0, 25.0)
    args[1] = neg
    assert torch.equal(moe_cpu.experts_fused(*args, "silu", 4.0, 25.0), ref)
    args[1], args[3] = -torch.ones(1, 1, dtype=F64), torch._neg_view(-w1.detach())  # a negated weight view too
    assert args[3].is_neg() and torch.equal(moe_cpu.experts_fused(*args, "silu", 4.0, 25.0), ref)


def _fallback_only(monkeypatch, tmp_path):
    """Make the configured cache unusable (its path lies under a file) and the temporary directory tmp_path."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("OPENK3_KERNEL_CACHE", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(cbuild.tempfile, "tempdir", str(tmp_path))
    return tmp_path / f"openk3-kernels-{os.getuid()}"


def test_temporary_fallback_cache_is_private(monkeypatch, tmp_path):
    fallback = _fallback_only(monkeypatch, tmp_path)
    assert cbuild.cache_dir() == str(fallback)
    assert fallback.stat().st_mode & 0o077 == 0  # created 0700
    assert cbuild.cache_dir() == str(fallback)  # reused


@pytest.mark.parametrize("kind", ["world_writable", "symlink"])
def test_temporary_fallback_cache_others_could_write_is_refused(monkeypatch, tmp_path, kind):
    """The fallback's name is predictable: a directory planted there (writable by others, or a link to one)
    would let another user plant a library this process loads. It is refused, not used."""
    fallback = _fallback_only(monkeypatch, tmp_path)
    if kind == "world_writable":
        fallback.mkdir()
        fallback.chmod(0o777)
    else:
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        fallback.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RuntimeError, match="not a private directory"):
        cbuild.cache_dir()


@needs_cc
def test_build_writes_source_and_library_in_a_private_directory(fresh_kernel, monkeypatch):
    """Nothing is written under a name another user of a shared cache could guess or pre-plant: the
    compiler's input and output live in a fresh 0700 directory, removed afterwards."""
    seen = []
    real = cbuild.subprocess.run

    def spy(cmd, *a, **kw):
        if "-o" in cmd:
            src, out = cmd[-4], cmd[cmd.index("-o") + 1]
            seen.append((os.path.dirname(src), os.path.dirname(out), os.stat(os.path.dirname(src)).st_mode))
        return real(cmd, *a, **kw)

    monkeypatch.setattr(cbuild.subprocess, "run", spy)
    lib = cbuild.build("probe", "int openk3_probe(void) { return 7; }\n")
    assert lib.openk3_probe() == 7
    (work, out_dir, mode), = seen
    assert work == out_dir and os.path.dirname(work) == str(fresh_kernel) and mode & 0o077 == 0
    assert not os.path.exists(work)
    assert [f for f in os.listdir(fresh_kernel) if not f.startswith("probe_")] == []


PROBE_ISA = """int openk3_isa(void) {
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX2__)
    return 2;
#else
    return 0;
#endif
}
"""


@needs_cc
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 levels only")
@pytest.mark.parametrize("isa,want", [("avx2", {2}), ("default", {0}), ("native", {0, 2, 512})])
def test_kernel_isa_builds_for_less_than_the_machine(fresh_kernel, monkeypatch, isa, want):
    """$OPENK3_KERNEL_ISA compiles for an x86-64 level below the machine's (what another CPU's users run), in its
    own cache entry; a bad value is a ValueError naming it, not a silent fallback to torch operators."""
    monkeypatch.setenv("OPENK3_KERNEL_ISA", isa)
    assert cbuild.build("probe", PROBE_ISA).openk3_isa() in want
    monkeypatch.setenv("OPENK3_KERNEL_ISA", "avx9")
    with pytest.raises(ValueError, match="OPENK3_KERNEL_ISA.*avx9"):
        cbuild.load("probe", PROBE_ISA, {"openk3_isa": []}, "probe")
