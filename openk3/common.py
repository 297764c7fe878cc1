"""Small shared helpers: precision islands, CPU set-up, seeding, opaque operators."""

from __future__ import annotations

import os
import random

import torch


def upcast(x: torch.Tensor) -> torch.Tensor:
    """To at least float32. The spec's fp32 islands (§4.8) must not *down*cast float64 test inputs."""
    return x if x.dtype == torch.float64 else x.float()


def fp32_island(t: torch.Tensor):
    """Context in which autocast is off, so a spec fp32 island (§4.8) stays fp32 inside a bf16
    autocast region (autocast would otherwise run its matmuls in bf16)."""
    return torch.autocast(t.device.type, enabled=False)


def setup_cpu(threads: int | None = None) -> int:
    """Flush denormals (a 50x slowdown of KDA training on CPU otherwise, spec §10.15); set threads.

    `threads` defaults to $OPENK3_THREADS, else 1 on machines with at most 2 CPUs (a second OpenMP
    thread stalls for milliseconds per small matmul when the host takes the other vCPU away, which
    made a nano training step 10x slower on the project's CI machine), else torch's default.
    Returns the thread count in use.
    """
    torch.set_flush_denormal(True)
    threads = threads or int(os.environ.get("OPENK3_THREADS", "0") or 0)
    if not threads and (os.cpu_count() or 1) <= 2:
        threads = 1
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def seed_everything(seed: int) -> torch.Generator:
    """Seed python, torch (CPU and CUDA); returns a CPU generator seeded the same way."""
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


_OP_LIBS: list = []  # a torch.library.Library must stay alive for its registrations to last


def opaque_op(name: str, schema: str, fn, dispatch_key: str):
    """Register `fn` as the operator `openk3::<name>` (`schema`: its arguments and result), run for
    `dispatch_key` ("CPU", or "CompositeExplicitAutograd" for any device), with a shape-only twin that
    returns an empty tensor shaped like the first argument. Returns the operator.

    What a compiled graph calls as one opaque kernel. A plain `torch.library.Library` registration rather
    than `torch.library.custom_op`, whose Python wrappers cost ~70 us per call inside a compiled graph
    against ~25 us here (measured); there is no autograd kernel: callers use these ops without grad."""
    lib = torch.library.Library("openk3", "FRAGMENT")
    lib.define(f"{name}{schema}")
    lib.impl(name, fn, dispatch_key)
    torch.library.register_fake(f"openk3::{name}", lambda x, *rest: torch.empty_like(
        x, memory_format=torch.contiguous_format), lib=lib)
    _OP_LIBS.append(lib)
    return getattr(torch.ops.openk3, name).default
