"""Small shared helpers: precision islands, CPU set-up, seeding, opaque operators."""

from __future__ import annotations

import os
import random
from contextlib import nullcontext

import torch

# The helpers below skip their torch call when it would change nothing: an eager decode step calls them a few
# hundred times, and each call (`.float()` of a float32 tensor, entering `torch.autocast`) costs microseconds
# of Python and dispatch while returning its input unchanged.


def upcast(x: torch.Tensor) -> torch.Tensor:
    """To at least float32. The spec's fp32 islands (§4.8) must not *down*cast float64 test inputs."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)`, without the call when `x` already has it (`.to` returns `x` itself then too)."""
    return x if x.dtype == dtype else x.to(dtype)


def fp32_island(t: torch.Tensor):
    """Context in which autocast is off, so a spec fp32 island (§4.8) stays fp32 inside a bf16
    autocast region (autocast would otherwise run its matmuls in bf16); a plain context when autocast
    is not on for `t`'s device (the island is then fp32 already)."""
    if not torch.is_autocast_enabled(t.device.type):
        return nullcontext()
    return torch.autocast(t.device.type, enabled=False)


def cpus_available() -> int:
    """CPUs this process may run on (its affinity mask: a container or `taskset` limit counts)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def fixed_threads(threads: int | None) -> int | None:
    """The thread count someone chose: `threads`, else $OPENK3_THREADS, else $OMP_NUM_THREADS; None if nobody
    did. ValueError names a value that is not a count >= 1."""
    for value, name in ((threads, "threads"), (os.environ.get("OPENK3_THREADS"), "OPENK3_THREADS"),
                        (os.environ.get("OMP_NUM_THREADS"), "OMP_NUM_THREADS")):
        if value is None or (isinstance(value, str) and value.strip() in ("", "0")):
            continue
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"{name} must be a whole number of threads, got {value!r}") from None
        if n < 1:
            raise ValueError(f"{name} must be >= 1, got {n}")
        return n
    return None


def setup_cpu(threads: int | None = None) -> int:
    """Flush denormals (a 50x slowdown of KDA training on CPU otherwise, spec §10.15); set threads.

    `threads` defaults to `fixed_threads` (the argument, $OPENK3_THREADS, $OMP_NUM_THREADS), else 1 on machines
    with at most 2 CPUs (a second OpenMP thread stalls for milliseconds per small matmul when the host takes
    the other vCPU away, which made a nano training step 10x slower on the project's CI machine), else torch's
    default. `openk3 train` instead measures which is faster (`train/threads.py`). Returns the count in use.
    """
    torch.set_flush_denormal(True)
    threads = fixed_threads(threads)
    if threads is None and cpus_available() <= 2:
        threads = 1
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
          "fp64": torch.float64, "float64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """None (keep what is there: "auto"/"none"/""), a torch dtype, or a name such as "bf16", "bfloat16",
    "fp32", "float32", "torch.float32". Every `--dtype` flag and `dtype=` argument goes through here, so
    the accepted spellings are the same everywhere. ValueError names the value."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key in ("auto", "none", ""):
        return None
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, bf16/bfloat16, fp16/float16, "
                         f"fp32/float32, fp64/float64")
    return DTYPES[key]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """A torch.device for a user's `--device` / `device=` value, refused with a ValueError (not torch's
    AssertionError deep inside a later `.to()`) when this machine cannot run it: "cuda" without a CUDA
    build or GPU, an index past the device count, "mps" where Metal is absent, or a malformed name."""
    if device is None:
        return torch.device("cpu")
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r} ({e}); use cpu, cuda or cuda:N") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available here "
                             f"(torch {torch.__version__}, a CPU build or no GPU); use --device cpu")
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif d.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ValueError(f"device {device!r}: MPS (Apple Metal) is not available here; use --device cpu")
    elif d.type != "cpu":
        raise ValueError(f"device {device!r}: openk3 runs on cpu, cuda or mps")
    return d


def autocast_context(dtype: str, device: torch.device):
    """A training dtype setting ("fp32" / "bf16") as a context: bf16 is torch.autocast on the device (parameters
    stay fp32; the model's fp32 islands upcast)."""
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


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
