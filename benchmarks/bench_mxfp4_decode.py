"""Routed experts kept in MXFP4 (the release's packed experts, `keep_packed=True`) in a decode step: the
MXFP4 CPU kernel (`openk3/ops/moe_mxfp4_cpu.py`) against the torch path it replaces and against the same
experts dequantised to float32, on the same inputs, in the same run.

Per MoE layer, fp32 activations, uniform random routing, `--layers` layers' weights used in turn (so they
are not all hot in the cache, as in a real step), contenders alternated round by round:

* mxfp4 kernel: `moe_mxfp4_cpu.experts_mxfp4` on the packed bytes (4.25 bits per weight);
* packed torch: `model.packed_experts.experts_packed` (dequantise each touched expert, three matmuls: the
  path packed experts took before the kernel, and still take for long prompts);
* float32: the same experts dequantised to float32 once, through the best float path a model would use
  (the fused float kernel of `moe_cpu.py` for small experts, else `experts_sparse`'s matmuls): what
  unpacking the experts at load time buys, at 7.5x the memory;
* with `--forms`: the same kernel source built as its other float32 forms on this CPU (`avx2` where the CPU
  has AVX-512, and `portable`, the plain C row-buffer form), so each SIMD form is measured against the
  others in one run (`moe_mxfp4_simd.py`).

    python benchmarks/bench_mxfp4_decode.py                      # nano, nano-kl, base, kimi-linear-48b shapes
    python benchmarks/bench_mxfp4_decode.py --presets base --tokens 1 4 16
    python benchmarks/bench_mxfp4_decode.py --presets nano-kl base --forms   # SIMD forms against each other

Large presets keep at most `--max-experts` experts per layer (routing among them; default 32), so the
float32 copies fit in memory. Nothing asserts on time; the kernel's outputs are checked against
`experts_loop` on the dequantised weights first.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_line, median, setup_threads, time_interleaved, write_json  # noqa: E402

from openk3.config import preset  # noqa: E402
from openk3.model.layers import make_glu  # noqa: E402
from openk3.model.moe import FUSED_MAX_EXPERT, Experts  # noqa: E402
from openk3.model.packed_experts import PackedExperts, experts_packed  # noqa: E402
from openk3.ops import cbuild, moe_cpu, moe_mxfp4_cpu  # noqa: E402
from openk3.ops import moe as moe_ops  # noqa: E402


def other_forms() -> dict:
    """{form: experts_mxfp4-like callable} for the kernel built as each float32 form other than this machine's
    own: "avx2" (x86-64-v3) where the CPU has AVX-512, and "portable" (-DOPENK3_SCALAR)."""
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    builds = {"portable": [*cbuild.isa_flags(), *cbuild.FLAGS, "-DOPENK3_SCALAR"]}
    if " avx512f" in flags and " avx2" in flags:
        builds["avx2"] = [cbuild.ISAS["avx2"], *cbuild.FLAGS]
    forms = {}
    for form, build_flags in builds.items():
        lib = cbuild.build("moe_mxfp4", moe_mxfp4_cpu._SOURCE, build_flags)
        for fn in (lib.openk3_moe_mxfp4_f32, lib.openk3_moe_mxfp4_f64):
            fn.argtypes, fn.restype = moe_mxfp4_cpu._ARGS, ctypes.c_int

        def call(x, wts, idx, *rest, _lib=lib):
            *bufs, act, beta, linear_beta = rest
            return moe_cpu.call_kernel(_lib.openk3_moe_mxfp4_f32, _lib.openk3_moe_mxfp4_f64, "mxfp4", x, wts, idx,
                                       bufs, bufs[0].shape[0], bufs[0].shape[1], act, beta, linear_beta)
        forms[form] = call
    return forms


def bench_shape(cfg, tokens: int, layers: int, repeats: int, max_experts: int, forms: dict | None = None) -> dict:
    E, K, I, C = min(cfg.num_experts, max_experts), cfg.num_experts_per_token, cfg.moe_intermediate_size, \
        cfg.expert_in_dim
    g = torch.Generator().manual_seed(tokens)
    packed, plain = [], []
    for _ in range(layers):
        ex = Experts(E, C, I)
        for w, fan_in in ((ex.w1, C), (ex.w3, C), (ex.w2, I)):
            w.data = torch.randn(w.shape, generator=g) / fan_in**0.5
        pe = PackedExperts.from_experts(ex)
        packed.append(pe)
        plain.append(pe.to_experts(torch.float32))
    x = torch.randn(tokens, C, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    wts = torch.rand(tokens, K, generator=g)
    glu = make_glu(cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    act = (cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)

    def bufs(pe):
        return [getattr(pe, name) for name in moe_mxfp4_cpu.BUFFERS]

    ref = moe_ops.experts_loop(x, wts, idx, plain[0].w1, plain[0].w3, plain[0].w2, glu)
    got = moe_mxfp4_cpu.experts_mxfp4(x, wts, idx, *bufs(packed[0]), *act)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    if err > 1e-5:
        raise RuntimeError(f"the MXFP4 kernel disagrees with experts_loop (relative error {err:.1e})")

    small = I * C <= FUSED_MAX_EXPERT and moe_cpu.available()
    float_path = "fused kernel" if small else "sparse matmuls"

    def float32(ex):
        if small:
            return moe_cpu.experts_fused(x, wts, idx, ex.w1, ex.w3, ex.w2, *act)
        return moe_ops.experts_sparse(x, wts, idx, ex.w1, ex.w3, ex.w2, glu)

    fns = {"mxfp4 kernel": lambda: [moe_mxfp4_cpu.experts_mxfp4(x, wts, idx, *bufs(pe), *act) for pe in packed],
           "packed torch": lambda: [experts_packed(x, wts, idx, pe, glu) for pe in packed],
           "float32": lambda: [float32(ex) for ex in plain]}
    for form, call in (forms or {}).items():
        err_f = ((call(x, wts, idx, *bufs(packed[0]), *act) - ref).abs().max() / ref.abs().max()).item()
        if err_f > 1e-5:
            raise RuntimeError(f"the {form} form disagrees with experts_loop (relative error {err_f:.1e})")
        fns[f"mxfp4 {form}"] = lambda call=call: [call(x, wts, idx, *bufs(pe), *act) for pe in packed]
    times = time_interleaved(fns, warmup=1, repeats=repeats)
    us = {name: 1e6 * median(ts) / layers for name, ts in times.items()}
    return {"tokens": tokens, "experts": E, "top_k": K, "I": I, "C": C, "relative_error": err, "us_per_layer": us,
            "float_path": float_path, "packed_bytes_per_layer": packed[0].nbytes(),
            "vs_packed_torch": us["packed torch"] / us["mxfp4 kernel"],
            "vs_float32": us["float32"] / us["mxfp4 kernel"],
            "vs_forms": {f: us[f"mxfp4 {f}"] / us["mxfp4 kernel"] for f in (forms or {})}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["nano", "nano-kl", "base", "kimi-linear-48b"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--layers", type=int, default=8, help="layers' weights used in turn (default 8)")
    ap.add_argument("--max-experts", type=int, default=32, help="experts kept per layer (default 32)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--forms", action="store_true", help="also time the kernel's other float32 forms on this CPU")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    threads = setup_threads(args.threads)
    if not moe_mxfp4_cpu.available():
        raise SystemExit("the MXFP4 CPU MoE kernel is unavailable here (no C compiler, or OPENK3_NO_KERNELS set)")
    print(machine_line(threads))
    forms = other_forms() if args.forms else {}
    print(f"the kernel's float32 form here: {moe_mxfp4_cpu.simd_form()}"
          + (f"; also timed: {', '.join(forms)}" if forms else ""))
    rows = []
    extra = "".join(f" mxfp4 {f} (kernel faster by) |" for f in forms)
    print("| preset | tokens | experts (top-k), I x C | mxfp4 kernel | packed torch | float32 (path) | "
          f"vs packed torch | vs float32 |{extra}")
    print("|---|---|---|---|---|---|---|---|" + "---|" * len(forms))
    with torch.no_grad():
        for name in args.presets:
            for n in args.tokens:
                r = bench_shape(preset(name), n, args.layers, args.repeats, args.max_experts, forms)
                rows.append({"preset": name, **r})
                us = r["us_per_layer"]
                print(f"| {name} | {n} | {r['experts']} ({r['top_k']}), {r['I']} x {r['C']} | "
                      f"{us['mxfp4 kernel']:.0f} us | {us['packed torch']:.0f} us | {us['float32']:.0f} us "
                      f"({r['float_path']}) | **{r['vs_packed_torch']:.2f}x** | **{r['vs_float32']:.2f}x** |"
                      + "".join(f" {us['mxfp4 ' + f]:.0f} us ({r['vs_forms'][f]:.2f}x) |" for f in forms), flush=True)
    return write_json(args.json, {"machine": machine_line(threads), "layers": args.layers, "rows": rows})


if __name__ == "__main__":
    main()
