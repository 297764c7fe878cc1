"""Test set-up: one CPU thread, denormals flushed, and NaN-poisoned `torch.empty`.

Poisoning: every floating tensor created by `torch.empty`, `torch.empty_like` or `Tensor.new_empty`
during a test starts full of NaN instead of whatever the allocator returned (FLA's trick), so an
output or parameter that is never written shows up as NaN in the checks instead of passing by luck.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # `from helpers import assert_close` in every layout

torch.set_num_threads(1)
# The `triton` tier (tests/test_fla_backend.py) runs fla's Triton kernels on the CPU through Triton's interpreter,
# which triton reads when a kernel is decorated, i.e. when fla is imported: so it is chosen here, before any test
# imports fla. Never where CUDA is: there the kernels compile (scripts/gpu_check.sh). Nothing else uses Triton here
# (torch.compile on the CPU generates C++).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# ...and every openk3 entry point the tests call (in process or as a subprocess) stays on one thread: without a
# count, `openk3 train` measures whether all CPUs are faster and may switch (train/threads.py)
os.environ.setdefault("OPENK3_THREADS", "1")
torch.set_flush_denormal(True)

try:  # `with torch.device(...)` caches its set of factory functions on first use: cache the real ones
    from torch.utils._device import _device_constructors

    _device_constructors()
except ImportError:  # pragma: no cover - private API moved
    pass


def _poison(t):
    if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.device.type != "meta":
        with torch.no_grad():
            t.fill_(float("nan"))
    return t


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """NaN-fill floating tensors from torch.empty / torch.empty_like / Tensor.new_empty for this test."""
    empty, empty_like, new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def poisoned_empty(*args, **kwargs):
        return _poison(empty(*args, **kwargs))

    def poisoned_empty_like(*args, **kwargs):
        return _poison(empty_like(*args, **kwargs))

    def poisoned_new_empty(self, *args, **kwargs):
        return _poison(new_empty(self, *args, **kwargs))

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    monkeypatch.setattr(torch, "empty_like", poisoned_empty_like)
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned_new_empty)
    yield


def pytest_collection_modifyitems(config, items):
    """Longest first: a `slow` test may say how long it takes (`@pytest.mark.slow(seconds=90)`, measured on the
    2-core CI machine) and runs before the shorter ones, so the workers finish together instead of one starting
    a 90 s test when the other has nothing left (scripts/test.sh hands the slow pass out one test at a time,
    xdist's `--dist load`). In one process, modules stay together (their module-scoped fixtures are built once),
    ordered by their longest test. A stable sort: the rest keeps its order."""
    def seconds(item) -> float:
        mark = item.get_closest_marker("slow")
        return float(mark.kwargs.get("seconds", 0)) if mark is not None else 0.0

    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: -seconds(item))
        return
    longest: dict[str, float] = {}
    for item in items:
        longest[item.module.__name__] = max(longest.get(item.module.__name__, 0.0), seconds(item))
    items.sort(key=lambda item: (-longest[item.module.__name__], item.module.__name__, -seconds(item)))


# ---- what the run was, and what it could not run -----------------------------------------------------------
#: Skip reasons that an installable system package removes: (what, words in the reason, apt packages).
INSTALLABLE = (("bubblewrap", ("bwrap", "bubblewrap"), "bubblewrap"),
               ("Chromium", ("chromium",), "chromium chromium-driver"))


def pytest_report_header(config):
    isa = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                                      "OPENK3_KERNEL_ISA") if os.environ.get(k)}
    limits = ", ".join(f"{k}={v}" for k, v in isa.items()) or "none (the machine's own)"
    return f"openk3: torch CPU capability {torch.backends.cpu.get_cpu_capability()}; ISA limits: {limits}"


def pytest_unconfigure(config):
    """The last line of the run counts the skipped tests by what would run them (scripts/test.sh installs the
    packages where it may; elsewhere this says which command does). In the controller only (xdist workers)."""
    terminalreporter = config.pluginmanager.get_plugin("terminalreporter")
    if hasattr(config, "workerinput") or terminalreporter is None:
        return
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    counts: dict[str, int] = {}
    for rep in skipped:
        reason = (rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)).lower()
        what = next((name for name, words, _ in INSTALLABLE if any(w in reason for w in words)), "other reasons")
        counts[what] = counts.get(what, 0) + 1
    parts = [f"{n} for want of {what}" if what != "other reasons" else f"{n} for other reasons (SKIPPED lines above)"
             for what, n in counts.items()]
    packages = " ".join(pkgs for name, _, pkgs in INSTALLABLE if name in counts)
    fix = f"; to run them: sudo apt-get install {packages} (scripts/test.sh does it as root)" if packages else ""
    terminalreporter.write_line(f"openk3: {len(skipped)} test(s) skipped: {', '.join(parts)}{fix}", yellow=True)
