"""CPU benchmark of chunked KDA: forward + backward of `kda_chunked` against fla's naive chunked reference.

fla's `naive_chunk_kda` is loaded from its file (fla itself needs triton, which the CPU venv lacks). If fla is not
installed, `kda_recurrent` is timed instead as the baseline. Usage:

    python benchmarks/bench_kda.py --threads 1 --repeats 5 --T 2048 --H 4 --D 64
    python benchmarks/bench_kda.py --threads 1 --repeats 7 --T 512 --H 6 --baseline autograd
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from openk3.ops.kda import CHUNK_SIZE, kda_chunked, kda_chunked_autograd, kda_recurrent  # noqa: E402


def load_fla_naive():
    """fla/ops/kda/naive.py as a stand-alone module, or None when fla is not installed."""
    path = Path(sysconfig.get_paths()["purelib"]) / "fla" / "ops" / "kda" / "naive.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("fla_kda_naive", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_inputs(B: int, T: int, H: int, D: int, gate: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    k = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen)
    z = torch.randn(B, T, H, D, generator=gen)
    # "logsigmoid": mean step about -0.18 (the machine-facts setup); "k3": K3's bounded gate -5 * sigmoid(z),
    # whose chunk-wide decay reaches about -160 (beyond exp's fp32 range if factorised naively).
    g = F.logsigmoid(z + 2.0) if gate == "logsigmoid" else -5.0 * torch.sigmoid(z)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def time_fwd_bwd(fn, inputs, repeats: int):
    """Medians of forward and forward+backward wall seconds, of forward+backward CPU seconds of this thread
    (insensitive to a busy host stealing the vCPU), and the last output (detached)."""
    fwd, total, cpu = [], [], []
    for _ in range(repeats + 1):  # +1: the first call warms up allocator and kernels
        for x in inputs:
            x.grad = None
        c0, t0 = time.thread_time(), time.perf_counter()
        o, state = fn(*inputs)
        t1 = time.perf_counter()
        (o.square().sum() + state.square().sum()).backward()
        t2, c2 = time.perf_counter(), time.thread_time()
        fwd.append(t1 - t0)
        total.append(t2 - t0)
        cpu.append(c2 - c0)
    return statistics.median(fwd[1:]), statistics.median(total[1:]), statistics.median(cpu[1:]), o.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--D", type=int, default=64, help="head dim (K = V)")
    parser.add_argument("--chunk", type=int, default=CHUNK_SIZE, help="chunk size (default: kda_chunked's)")
    parser.add_argument("--baseline", choices=["fla", "autograd", "none"], default="fla",
                        help="what to compare against: fla's naive_chunk_kda (kda_recurrent if fla is missing), "
                        "kda_chunked differentiated by autograd (its pre-custom-backward twin), or nothing")
    parser.add_argument("--gate", choices=["logsigmoid", "k3"], default="logsigmoid", help="log-decay distribution")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)  # subnormal decayed states cost ~50x on CPU (spec §10.15)
    B, T, H, D, C = args.B, args.T, args.H, args.D, args.chunk
    scale = D**-0.5
    inputs = make_inputs(B, T, H, D, args.gate)
    print(f"KDA fwd+bwd, fp32, B={B} T={T} H={H} K=V={D} chunk={C} gate={args.gate}, "
          f"threads={torch.get_num_threads()}, repeats={args.repeats} (median)")

    ours = time_fwd_bwd(lambda *x: kda_chunked(*x, scale=scale, chunk_size=C), inputs, args.repeats)
    rows = [("openk3 kda_chunked", *ours)]
    naive = load_fla_naive() if args.baseline == "fla" else None
    if args.baseline == "autograd":
        base_name = "kda_chunked autograd"
        base = time_fwd_bwd(lambda *x: kda_chunked_autograd(*x, scale=scale, chunk_size=C), inputs, args.repeats)
        rows.append((base_name, *base))
    elif args.baseline == "fla" and naive is None:
        print("fla not installed: baseline is openk3 kda_recurrent")
        base_name = "openk3 kda_recurrent"
        base = time_fwd_bwd(lambda *x: kda_recurrent(*x, scale=scale), inputs, args.repeats)
        rows.append((base_name, *base))
    elif args.baseline == "fla":
        base_name = "fla naive_chunk_kda"
        if T % C:
            raise SystemExit(f"naive_chunk_kda needs T % chunk == 0 (T={T}, chunk={C})")

        def run_naive(q, k, v, g, beta):
            return naive.naive_chunk_kda(q, k, v, g, beta, scale=scale, output_final_state=True, chunk_size=C)

        base = time_fwd_bwd(run_naive, inputs, args.repeats)
        rows.append((base_name, *base))

    print(f"{'implementation':<24} {'fwd ms':>9} {'fwd+bwd ms':>11} {'(cpu ms)':>9} {'fwd+bwd tok/s':>14}")
    for name, fwd, total, cpu, _ in rows:
        print(f"{name:<24} {1e3 * fwd:>9.1f} {1e3 * total:>11.1f} {1e3 * cpu:>9.1f} {B * T / total:>14,.0f}")
    if args.baseline == "none":
        return
    print(f"speed-up of kda_chunked over {base_name}: fwd+bwd {base[1] / ours[1]:.1f}x "
          f"(cpu time {base[2] / ours[2]:.1f}x), fwd {base[0] / ours[0]:.1f}x")
    print(f"max |o_ours - o_{base_name.split()[-1]}| = {(ours[3] - base[3]).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
