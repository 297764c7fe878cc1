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
