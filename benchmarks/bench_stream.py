"""Streamed experts on a release-shaped checkpoint: the disk's speed on expert-sized reads, then decode with the
experts on disk, against the bound.

    python scripts/synth_release.py /data/k3synth              # K3's widths, 3 layers (2 MoE: 31.4 GB of experts)
    python benchmarks/bench_stream.py /data/k3synth --expert-cache 2GB --tokens 8 [--json out.json]

Prints, for the checkpoint (n MoE layers) and extrapolated to K3's 92:
* disk GB/s: random whole-expert reads (17.5 MB at K3's width, O_DIRECT where allowed) at 1, 2 and --io-threads
  reads in flight (the page cache is bypassed by direct reads; buffered figures may include cached bytes);
* per decoded token: expert requests, reads, bytes read, hit rate (1 - reads / requests), s/token, the seconds the
  engine stalled on reads, and compute = s/token - stall;
* bytes/token over the bound at that hit rate ((1 - h) x requests x expert bytes: the planner's figure,
  `openk3.plan.stream`), and s/token over max(disk, compute) with disk = bytes / measured GB/s.

The issue's targets: bytes/token within 10 % of the bound, s/token within 1.25x of max(disk, compute).
"""

from __future__ import annotations

import argparse
import json
import mmap
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import setup_threads  # noqa: E402


def disk_gbps(folder: Path, depths: list[int], reads: int, direct: bool | None, seed: int = 0) -> dict:
    """GB/s of random whole-expert reads at each queue depth (threads of a `Reader`)."""
    from openk3.checkpoint.load import inventory
    from openk3.stream import ExpertIndex, Reader

    inv, _ = inventory(folder)
    index = ExpertIndex.from_inventory(inv)
    rng = random.Random(seed)
    out = {}
    for qd in depths:
        reader = Reader(index.folder, index.files(), threads=qd, direct=direct)
        mem = mmap.mmap(-1, qd * index.slot_bytes)
        mv = memoryview(mem)
        picks = [(rng.choice(index.layers), rng.randrange(index.num_experts)) for _ in range(reads)]
        t0 = time.perf_counter()
        pending = []
        for i, (layer, e) in enumerate(picks):
            if len(pending) == qd:
                pending.pop(0).result()
            slot = i % qd
            pending.append(reader.submit(reader.read, index.loc(layer, e).extents,
                                         mv[slot * index.slot_bytes:(slot + 1) * index.slot_bytes]))
        for f in pending:
            f.result()
        dt = time.perf_counter() - t0
        out[qd] = {"gbps": reader.bytes_read / dt / 1e9, "direct": bool(reader.direct_files)}
        reader.close()
        mv.release()
        mem.close()
    return out


def decode(folder: Path, cache: str, tokens: int, threads_io: int, direct: bool | None, prompt_len: int) -> dict:
    """Greedy decode of `tokens` tokens after a `prompt_len`-token prompt; per-step seconds and counter deltas."""
    import torch

    import openk3
    from openk3.infer.llm import LLM
    from openk3.infer.sample import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(folder, experts="stream", expert_cache=cache, io_threads=threads_io, direct_io=direct,
              dtype=torch.float32)
    load_s = time.perf_counter() - t0
    engine = llm.engine
    prompt = list(range(3, 3 + prompt_len))
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=tokens + 1), ignore_eos=True)
    steps = []
    last = openk3.stream.stats(llm.model)
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        now = openk3.stream.stats(llm.model)
        steps.append({"s": dt, **{k: now[k] - last[k] for k in ("requests", "reads", "bytes_read", "stall_seconds",
                                                                "read_seconds")}})
        last = now
    cfg = llm.model.config
    cache_stats = openk3.stream.stats(llm.model)
    return {"load_s": load_s, "prefill": steps[0], "decode": steps[1:], "cache": cache_stats,
            "expert_bytes": llm.model.expert_stream.index.expert_bytes, "moe_layers": len(cache_stats["quotas"]),
            "top_k": cfg.num_experts_per_token, "num_experts": cfg.num_experts}


def summarise(d: dict, gbps: float) -> dict:
    """Per decoded token figures and the ratios to the bound (medians over the decode steps)."""
    from openk3.plan.stream import expert_bytes_per_token

    dec = d["decode"]
    req = sum(s["requests"] for s in dec)
    reads = sum(s["reads"] for s in dec)
    h = 1 - reads / req
    n = len(dec)
    bytes_tok = sum(s["bytes_read"] for s in dec) / n
    bound = expert_bytes_per_token(d["moe_layers"], d["top_k"], d["expert_bytes"], h)
    s_tok = statistics.median(s["s"] for s in dec)
    stall = statistics.median(s["stall_seconds"] for s in dec)
    compute = s_tok - stall
    disk = bytes_tok / (gbps * 1e9)
    k3 = 92 / d["moe_layers"]
    return {
        "tokens": n, "requests_per_token": req / n, "reads_per_token": reads / n, "hit_rate": h,
        "bytes_per_token": bytes_tok, "bound_bytes_per_token": bound,
        "bytes_over_bound": bytes_tok / bound if bound else None,
        "s_per_token": s_tok, "s_per_token_range": [min(s["s"] for s in dec), max(s["s"] for s in dec)],
        "stall_s_per_token": stall, "compute_s_per_token": compute, "disk_s_per_token": disk,
        "s_over_max_disk_compute": s_tok / max(disk, compute),
        "k3_bytes_per_token": bytes_tok * k3, "k3_disk_s_per_token": disk * k3,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--expert-cache", default="2GB")
    p.add_argument("--tokens", type=int, default=8, help="decoded tokens (default 8)")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--io", default="auto", choices=("auto", "direct", "buffered"))
    p.add_argument("--disk-reads", type=int, default=48, help="reads per queue depth for the disk figure")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    import os

    threads = setup_threads(args.threads or os.cpu_count() or 1)
    direct = {"auto": None, "direct": True, "buffered": False}[args.io]
    depths = sorted({1, 2, args.io_threads})
    disk = disk_gbps(args.folder, depths, args.disk_reads, direct)
    for qd, r in disk.items():
        print(f"disk: {r['gbps']:.2f} GB/s at {qd} read(s) in flight ({'direct' if r['direct'] else 'buffered'})")
    gbps = disk[args.io_threads]["gbps"]
    d = decode(args.folder, args.expert_cache, args.tokens, args.io_threads, direct, args.prompt_len)
    s = summarise(d, gbps)
    print(f"decode ({threads} torch thread(s), {args.io_threads} I/O threads, cache {args.expert_cache} = "
          f"{d['cache']['slots']} experts, {d['moe_layers']} MoE layers, {s['tokens']} tokens):")
    print(f"  per token: {s['requests_per_token']:.0f} requests, {s['reads_per_token']:.1f} reads, "
          f"{s['bytes_per_token'] / 1e9:.3f} GB read, hit rate {s['hit_rate']:.3f}")
    print(f"  bytes/token over the bound at that hit rate: {s['bytes_over_bound']:.4f} (target <= 1.10)")
    print(f"  s/token {s['s_per_token']:.3f} (range {s['s_per_token_range'][0]:.3f}-{s['s_per_token_range'][1]:.3f}); "
          f"stalled {s['stall_s_per_token']:.3f}, compute {s['compute_s_per_token']:.3f}, disk "
          f"{s['disk_s_per_token']:.3f} at {gbps:.2f} GB/s")
    print(f"  s/token over max(disk, compute): {s['s_over_max_disk_compute']:.3f} (target <= 1.25)")
    print(f"  extrapolated to K3's 92 MoE layers: {s['k3_bytes_per_token'] / 1e9:.2f} GB/token, disk "
          f"{s['k3_disk_s_per_token']:.2f} s/token at {gbps:.2f} GB/s")
    if args.json:
        args.json.write_text(json.dumps({"disk": disk, "decode": d, "summary": s, "threads": threads,
                                         "expert_cache": args.expert_cache}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
