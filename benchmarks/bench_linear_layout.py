"""The layout of linear weights at decode's few rows: row-major (as built and loaded) against column-major
(`openk3.infer.graph.column_major_linears_`, what a compiled CPU decode step uses), the same values.

`F.linear(x, W)` computes `x @ W.t()`. With W row-major the BLAS (MKL for float32/float64 on CPU) packs
W's transpose into a buffer on every call; column-major, `W.t()` is a row-major matrix it reads as is.
For every distinct linear shape of a preset's model (each shape's weight held `--copies` times and used
in turn, so they are not all hot in the cache, as in a real step), per call, contenders alternated:

    python benchmarks/bench_linear_layout.py                          # nano-kl and small-kl, batch 1 and 16
    python benchmarks/bench_linear_layout.py --presets base --batch 1 4 16

The last row adds the shapes up as one decode step uses them (each shape times the number of its
weights). Outputs are checked equal first; nothing asserts on time.

`--bf16-reduce` adds two compiled contenders (one torch.compile graph over a shape's copies each): the
column-major float32 linears, and bfloat16 weights upcast inside a multiply-and-sum that inductor fuses into
one vectorised reduction reading the bf16 bytes (float32 arithmetic, so the result is float32 compute on the
same bf16 weights: a release checkpoint's own values). It is the candidate lever for issue 15's batch-1
decode (docs/benchmarks.md): half the weight bytes at one row; at many rows it gives up the BLAS's reuse.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_line, median, setup_threads, time_interleaved, write_json  # noqa: E402

from openk3.config import preset  # noqa: E402
from openk3.infer.graph import column_major_linears_  # noqa: E402
from openk3.model.model import K3ForCausalLM  # noqa: E402


def linear_shapes(cfg) -> Counter:
    """(in, out) -> how many weights of that shape the relayout moves (linears and MoE routers)."""
    model = K3ForCausalLM.build(cfg.replace(), seed=0)
    before = {name: p.stride() for name, p in model.named_parameters()}
    column_major_linears_(model)
    return Counter((p.shape[1], p.shape[0]) for name, p in model.named_parameters() if p.stride() != before[name])


def _bf16_reduce(x: torch.Tensor, ws: list[torch.Tensor]) -> list[torch.Tensor]:
    """x (B, in) float32, ws [(out, in)] bfloat16 -> [(B, out)] float32: x @ w.float().t() as multiply + sum."""
    return [(x[:, None, :] * w.float()).sum(-1) for w in ws]


def _linears(x: torch.Tensor, ws: list[torch.Tensor]) -> list[torch.Tensor]:
    return [F.linear(x, w) for w in ws]


def bench_shape(d_in: int, d_out: int, batch: int, copies: int, repeats: int, dtype: torch.dtype,
                bf16_reduce: bool = False) -> dict:
    g = torch.Generator().manual_seed(d_in * d_out + batch)
    rows = [torch.randn(d_out, d_in, generator=g, dtype=dtype) for _ in range(copies)]
    cols = [w.t().contiguous().t() for w in rows]
    x = torch.randn(batch, d_in, generator=g, dtype=dtype)
    for a, b in zip(rows, cols, strict=True):
        ya, yb = F.linear(x, a), F.linear(x, b)
        if ((ya - yb).abs().max() / ya.abs().max()).item() > 1e-5:  # summation order may differ
            raise RuntimeError(f"the two layouts disagree at {d_in} -> {d_out}")
    fns = {"row-major": lambda: _linears(x, rows), "column-major": lambda: _linears(x, cols)}
    if bf16_reduce:
        if dtype != torch.float32:
            raise ValueError("--bf16-reduce compares against float32 linears: use --dtype float32")
        halves = [w.bfloat16() for w in rows]
        compiled_cols, compiled_halves = torch.compile(_linears, dynamic=False), torch.compile(_bf16_reduce,
                                                                                                dynamic=False)
        for y, w in zip(compiled_halves(x, halves), halves, strict=True):
            ref = F.linear(x, w.float())  # the same bf16 values in float32: only the summation order differs
            if ((y - ref).abs().max() / ref.abs().max()).item() > 1e-5:
                raise RuntimeError(f"the bf16 reduce disagrees with float32 linears at {d_in} -> {d_out}")
        fns["column-major, compiled"] = lambda: compiled_cols(x, cols)
        fns["bf16 reduce, compiled"] = lambda: compiled_halves(x, halves)
    times = time_interleaved(fns, warmup=1, repeats=repeats)
    us = {name: 1e6 * median(ts) / copies for name, ts in times.items()}
    out = {"in": d_in, "out": d_out, "batch": batch, "us": us, "speedup": us["row-major"] / us["column-major"]}
    if bf16_reduce:
        out["bf16_speedup"] = us["column-major, compiled"] / us["bf16 reduce, compiled"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["nano-kl", "small-kl"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--copies", type=int, default=16, help="weights per shape used in turn (default 16)")
    ap.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--bf16-reduce", action="store_true",
                    help="add compiled float32 linears and compiled bf16-weight multiply-and-sum (float32 only)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    threads = setup_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(machine_line(threads))
    result = {"machine": machine_line(threads), "dtype": args.dtype, "presets": {}}
    with torch.no_grad():
        for name in args.presets:
            shapes = linear_shapes(preset(name))
            print(f"\n{name}: {sum(shapes.values())} weights in {len(shapes)} shapes, {args.dtype}")
            extra = " column-major, compiled | bf16 reduce, compiled | bf16 speedup |" if args.bf16_reduce else ""
            print("| batch | in -> out (linears) | row-major | column-major | speedup |" + extra)
            print("|---|---|---|---|---|" + "---|---|---|" * bool(extra))
            rows = []
            for batch in args.batch:
                total: dict[str, float] = {}
                for (d_in, d_out), n in sorted(shapes.items()):
                    if args.bf16_reduce:  # fresh graphs per shape: the recompile limit never falls back to eager
                        torch._dynamo.reset()
                    r = bench_shape(d_in, d_out, batch, args.copies, args.repeats, dtype, args.bf16_reduce)
                    rows.append({**r, "linears": n})
                    for k, v in r["us"].items():
                        total[k] = total.get(k, 0.0) + n * v
                    more = (f" {r['us']['column-major, compiled']:.1f} us | {r['us']['bf16 reduce, compiled']:.1f} us "
                            f"| {r['bf16_speedup']:.2f}x |") if args.bf16_reduce else ""
                    print(f"| {batch} | {d_in} -> {d_out} ({n}) | {r['us']['row-major']:.1f} us | "
                          f"{r['us']['column-major']:.1f} us | {r['speedup']:.2f}x |" + more, flush=True)
                more = (f" {total['column-major, compiled']:.0f} us | {total['bf16 reduce, compiled']:.0f} us | "
                        f"**{total['column-major, compiled'] / total['bf16 reduce, compiled']:.2f}x** |"
                        if args.bf16_reduce else "")
                print(f"| {batch} | **all, one step** | {total['row-major']:.0f} us | {total['column-major']:.0f} us | "
                      f"**{total['row-major'] / total['column-major']:.2f}x** |" + more, flush=True)
                rows.append({"batch": batch, "step_us": total})
            result["presets"][name] = rows
    return write_json(args.json, result)


if __name__ == "__main__":
    main()
