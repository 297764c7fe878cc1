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


def bench_shape(d_in: int, d_out: int, batch: int, copies: int, repeats: int, dtype: torch.dtype) -> dict:
    g = torch.Generator().manual_seed(d_in * d_out + batch)
    rows = [torch.randn(d_out, d_in, generator=g, dtype=dtype) for _ in range(copies)]
    cols = [w.t().contiguous().t() for w in rows]
    x = torch.randn(batch, d_in, generator=g, dtype=dtype)
    for a, b in zip(rows, cols, strict=True):
        ya, yb = F.linear(x, a), F.linear(x, b)
        if ((ya - yb).abs().max() / ya.abs().max()).item() > 1e-5:  # summation order may differ
            raise RuntimeError(f"the two layouts disagree at {d_in} -> {d_out}")
    fns = {"row-major": lambda: [F.linear(x, w) for w in rows], "column-major": lambda: [F.linear(x, w) for w in cols]}
    times = time_interleaved(fns, warmup=1, repeats=repeats)
    us = {name: 1e6 * median(ts) / copies for name, ts in times.items()}
    return {"in": d_in, "out": d_out, "batch": batch, "us": us, "speedup": us["row-major"] / us["column-major"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["nano-kl", "small-kl"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--copies", type=int, default=16, help="weights per shape used in turn (default 16)")
    ap.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
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
            print("| batch | in -> out (linears) | row-major | column-major | speedup |")
            print("|---|---|---|---|---|")
            rows = []
            for batch in args.batch:
                total = {"row-major": 0.0, "column-major": 0.0}
                for (d_in, d_out), n in sorted(shapes.items()):
                    r = bench_shape(d_in, d_out, batch, args.copies, args.repeats, dtype)
                    rows.append({**r, "linears": n})
                    for k in total:
                        total[k] += n * r["us"][k]
                    print(f"| {batch} | {d_in} -> {d_out} ({n}) | {r['us']['row-major']:.1f} us | "
                          f"{r['us']['column-major']:.1f} us | {r['speedup']:.2f}x |", flush=True)
                print(f"| {batch} | **all, one step** | {total['row-major']:.0f} us | {total['column-major']:.0f} us | "
                      f"**{total['row-major'] / total['column-major']:.2f}x** |", flush=True)
                rows.append({"batch": batch, "step_us": total})
            result["presets"][name] = rows
    return write_json(args.json, result)


if __name__ == "__main__":
    main()
