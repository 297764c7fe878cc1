"""The routed experts of a decode step: the fused CPU kernel (`openk3/ops/moe_cpu.py`) against the torch
paths it replaces, on the same inputs, in the same run.

Per MoE layer, fp32, uniform random routing, `--layers` layers' weights used in turn (so they are not all
hot in the cache, as in a real step), contenders alternated round by round:

* fused: `moe_cpu.experts_fused` (the kernel, called from Python as the eager engine does);
* sparse: `ops.moe.experts_sparse` (torch matmuls over the chosen experts: the eager path for <= 4 tokens);
* grouped: `ops.moe.experts_grouped` (sorted rows, torch's grouped matmul: the eager path above 4 tokens);
* dense: `ops.moe.experts_dense` (every expert on every token: the compiled step's form without the kernel).

    python benchmarks/bench_moe_decode.py                      # nano-kl and small-kl shapes, 1 and 16 tokens
    python benchmarks/bench_moe_decode.py --threads 2 --tokens 16 64 128

Nothing asserts on time; the kernel's outputs are checked against `experts_loop` first.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_line, median, setup_threads, time_interleaved, write_json  # noqa: E402

from openk3.config import preset  # noqa: E402
from openk3.model.layers import make_glu  # noqa: E402
from openk3.ops import moe as moe_ops  # noqa: E402
from openk3.ops import moe_cpu  # noqa: E402


def bench_shape(cfg, tokens: int, layers: int, repeats: int) -> dict:
    E, K, I, C = cfg.num_experts, cfg.num_experts_per_token, cfg.moe_intermediate_size, cfg.expert_in_dim
    g = torch.Generator().manual_seed(tokens)
    ws = [(torch.randn(E, I, C, generator=g) / C**0.5, torch.randn(E, I, C, generator=g) / C**0.5,
           torch.randn(E, C, I, generator=g) / I**0.5) for _ in range(layers)]
    x = torch.randn(tokens, C, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    wts = torch.rand(tokens, K, generator=g)
    glu = make_glu(cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    act = (cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    ref = moe_ops.experts_loop(x, wts, idx, *ws[0], glu)
    got = moe_cpu.experts_fused(x, wts, idx, *ws[0], *act)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    if err > 1e-5:
        raise RuntimeError(f"the fused kernel disagrees with experts_loop (relative error {err:.1e})")

    def over_layers(fn):
        return lambda: [fn(*w) for w in ws]

    fns = {"fused": over_layers(lambda w1, w3, w2: moe_cpu.experts_fused(x, wts, idx, w1, w3, w2, *act)),
           "sparse": over_layers(lambda w1, w3, w2: moe_ops.experts_sparse(x, wts, idx, w1, w3, w2, glu)),
           "grouped": over_layers(lambda w1, w3, w2: moe_ops.experts_grouped(x, wts, idx, w1, w3, w2, glu)),
           "dense": over_layers(lambda w1, w3, w2: moe_ops.experts_dense(x, wts, idx, w1, w3, w2, glu))}
    times = time_interleaved(fns, warmup=1, repeats=repeats)
    per_layer_us = {name: 1e6 * median(ts) / layers for name, ts in times.items()}
    best_torch = min(v for k, v in per_layer_us.items() if k != "fused")
    return {"tokens": tokens, "experts": E, "top_k": K, "I": I, "C": C, "relative_error": err,
            "us_per_layer": per_layer_us, "speedup_vs_best_torch": best_torch / per_layer_us["fused"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["nano-kl", "small-kl"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--layers", type=int, default=8, help="layers' weights used in turn (default 8)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    threads = setup_threads(args.threads)
    if not moe_cpu.available():
        raise SystemExit("the fused CPU MoE kernel is unavailable here (no C compiler, or OPENK3_NO_KERNELS set)")
    print(machine_line(threads))
    rows = []
    print("| preset | tokens | experts (top-k), I x C | fused | sparse | grouped | dense | fused vs best torch |")
    print("|---|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for name in args.presets:
            for n in args.tokens:
                r = bench_shape(preset(name), n, args.layers, args.repeats)
                rows.append({"preset": name, **r})
                us = r["us_per_layer"]
                print(f"| {name} | {n} | {r['experts']} ({r['top_k']}), {r['I']} x {r['C']} | "
                      + " | ".join(f"{us[k]:.0f} us" for k in ("fused", "sparse", "grouped", "dense"))
                      + f" | **{r['speedup_vs_best_torch']:.2f}x** |", flush=True)
    return write_json(args.json, {"machine": machine_line(threads), "layers": args.layers, "rows": rows})


if __name__ == "__main__":
    main()
