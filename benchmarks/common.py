"""Shared helpers for the benchmarks: CPU set-up, repeat-and-median timing, peak FLOP/s and MFU.

Peak figures are per core on the project's CPU machine (Zen 4, AVX-512 + AVX512_BF16 through
oneDNN; machine-facts §1.3): 95 GFLOP/s fp32 and 210 GFLOP/s bf16. The host is shared and the
second vCPU is unreliable, so results are medians of repeats and always state the thread count.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

PEAK_FLOPS_PER_CORE = {torch.float32: 95e9, torch.bfloat16: 210e9}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def setup_threads(threads: int) -> int:
    """One-process CPU set-up: `threads` intra-op threads, denormals flushed (spec §10.15). Returns threads."""
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once parallel work has started
        pass
    torch.set_flush_denormal(True)
    return torch.get_num_threads()


def peak_flops(dtype: torch.dtype, threads: int) -> float:
    """Matmul peak of `threads` cores in `dtype` (FLOP/s)."""
    if dtype not in PEAK_FLOPS_PER_CORE:
        raise ValueError(f"no peak figure for {dtype}; known: {list(PEAK_FLOPS_PER_CORE)}")
    return PEAK_FLOPS_PER_CORE[dtype] * threads


def mfu(tokens_per_s: float, flops_per_token: float, dtype: torch.dtype, threads: int) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the matmul peak of the cores used."""
    return tokens_per_s * flops_per_token / peak_flops(dtype, threads)


def time_once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def time_repeats(fn: Callable[[], object], *, warmup: int = 1, repeats: int = 5) -> list[float]:
    """Seconds per call for `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return [time_once(fn) for _ in range(repeats)]


def time_interleaved(fns: dict[str, Callable[[], object]], *, warmup: int = 1,
                     repeats: int = 5) -> dict[str, list[float]]:
    """Like `time_repeats` for several contenders, alternating them each round so that a slow spell of the
    shared host hits all of them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            out[name].append(time_once(fn))
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float]) -> str:
    """'median (min-max)' in milliseconds."""
    return f"{1e3 * median(xs):.1f} ms ({1e3 * min(xs):.1f}-{1e3 * max(xs):.1f})"


def machine_line(threads: int) -> str:
    """One line describing where the numbers come from."""
    cap = torch.backends.cpu.get_cpu_capability()
    return (f"torch {torch.__version__}, {cap}, {threads} thread(s) of {os.cpu_count()} CPUs, "
            f"flush_denormal on, python {platform.python_version()}")


def write_json(path: str | None, result: dict) -> dict:
    """Write `result` to `path` (the --json option) when one is given; returns `result`."""
    if path:
        with open(path, "w") as fh:
            json.dump(result, fh, indent=2)
    return result
