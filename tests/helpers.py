"""Shared test helpers (importable as `from helpers import ...`; conftest puts tests/ on sys.path)."""

from __future__ import annotations

import os

import pytest
import torch


def nano_cut(layers: int = 4):
    """The nano preset cut to its first `layers` layers through the trainer's override path (so the layer lists
    that depend on the count follow). 4 layers: 3 KDA + 1 MLA, a dense FFN then MoE, two AttnRes blocks: every
    layer kind at under half of nano's cost."""
    from openk3.train.config import TrainConfig, apply_overrides

    return apply_overrides(TrainConfig(), [f"model.num_hidden_layers={layers}"]).model


def rel_rms_error(ref: torch.Tensor, got: torch.Tensor) -> float:
    """||got - ref||_rms / ||ref||_rms in float64 (0 when both are exactly zero)."""
    ref64, got64 = ref.detach().double(), got.detach().double()
    err = (got64 - ref64).pow(2).mean().sqrt().item()
    base = ref64.pow(2).mean().sqrt().item()
    if base == 0.0:
        return err
    return err / base


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, ratio: float) -> None:
    """Assert `got` matches `ref` to a relative RMS error <= `ratio` (FLA's `assert_close` idea).

    Shapes must match exactly and `got` must be finite wherever `ref` is, so a NaN from an
    uninitialised buffer or an overflow fails loudly instead of being averaged away.
    """
    assert ref.shape == got.shape, f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    finite = torch.isfinite(ref)
    bad = (~torch.isfinite(got) & finite).sum().item()
    assert bad == 0, f"{name}: {bad} non-finite values where the reference is finite"
    err = rel_rms_error(ref[finite], got[finite])
    abs_max = (ref[finite].double() - got[finite].double()).abs().max().item() if finite.any() else 0.0
    assert err <= ratio, f"{name}: relative RMS error {err:.3e} > {ratio:.1e} (max abs diff {abs_max:.3e})"


#: torch's inductor (2.13) writes `at::vec` code that its own header leaves out when ATEN_CPU_CAPABILITY=default
#: (the level of an x86-64 CPU without AVX2; `scripts/test.sh --isa default` sets it): the C++ build of some graphs
#: fails, and openk3's DecodeGraph then decodes eagerly with a warning. Tests that assert a compiled graph skip there.
needs_vector_inductor = pytest.mark.skipif(
    os.environ.get("ATEN_CPU_CAPABILITY") == "default",
    reason="torch's inductor cannot build vectorized C++ with ATEN_CPU_CAPABILITY=default (a torch bug; "
           "openk3 decodes eagerly there)")

