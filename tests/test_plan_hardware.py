"""The hardware catalogue behind `openk3 plan`: every number cited, fallbacks, lookup, and no torch import."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from openk3.plan import hardware
from openk3.plan.hardware import CATALOGUE, Hardware, get, markdown_table

KEYS = ["h100", "h200", "b200", "b300", "gb200", "mi300x", "mi355x", "a100", "rtx4090", "rtx5090", "m3-ultra",
        "cpu-ddr5"]
NUMERIC = ["memory_bytes", "memory_bandwidth", "interconnect_bandwidth", "devices_per_node", "price_per_hour"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_keys_present_in_order():
    assert list(CATALOGUE) == KEYS
    assert all(k == h.key for k, h in CATALOGUE.items())
    assert all(isinstance(h, Hardware) for h in CATALOGUE.values())


@pytest.mark.parametrize("key", KEYS)
def test_numbers_positive_and_typed(key):
    h = CATALOGUE[key]
    assert h.kind in ("gpu", "apple", "cpu")
    assert h.name and h.interconnect
    assert isinstance(h.memory_bytes, int) and isinstance(h.devices_per_node, int)
    for name in NUMERIC:
        value = getattr(h, name)
        if name == "interconnect_bandwidth" and h.kind != "gpu" and h.devices_per_node == 1:
            assert value >= 0  # a single machine may have nothing to talk to
        else:
            assert value > 0, (key, name)
    assert h.flops and all(v > 0 for v in h.flops.values())
    assert set(h.flops) <= {"bf16", "fp8", "fp4"} and "bf16" in h.flops


@pytest.mark.parametrize("key", KEYS)
def test_every_number_cited(key):
    h = CATALOGUE[key]
    wanted = set(NUMERIC) | {f"flops.{f}" for f in h.flops}
    assert set(h.sources) == wanted, (key, set(h.sources) ^ wanted)  # nothing missing, no stray field names
    fields = {f.name for f in dataclasses.fields(Hardware)}
    for src_key, src in h.sources.items():
        field, _, fmt = src_key.partition(".")
        assert field in fields and (not fmt or fmt in h.flops), src_key
        assert isinstance(src, str) and src.strip() and "http" in src, (key, src_key)
    assert "as of" in h.sources["price_per_hour"]


def test_flops_for_falls_back_to_wider_format():
    h100, a100, b200 = get("h100"), get("a100"), get("b200")
    assert h100.flops_for("fp4") == (h100.flops["fp8"], "fp8")
    assert h100.flops_for("bf16") == (h100.flops["bf16"], "bf16")
    assert a100.flops_for("fp8") == (a100.flops["bf16"], "bf16")
    assert a100.flops_for("fp4") == (a100.flops["bf16"], "bf16")
    assert b200.flops_for("fp4") == (b200.flops["fp4"], "fp4")
    for h in CATALOGUE.values():
        for fmt in ("bf16", "fp8", "fp4"):
            flops, used = h.flops_for(fmt)
            assert used in h.flops and flops == h.flops[used]
    with pytest.raises(ValueError, match="fp16x"):
        h100.flops_for("fp16x")


def test_get_is_case_insensitive_and_suggests():
    assert get("H100") is CATALOGUE["h100"]
    assert get(" M3-Ultra ") is CATALOGUE["m3-ultra"]
    with pytest.raises(ValueError) as e:
        get("h1000")
    assert "h100" in str(e.value) and "h1000" in str(e.value)


@pytest.mark.parametrize("key", KEYS)
def test_sanity(key):
    h = CATALOGUE[key]
    f = h.flops
    if "fp4" in f:
        assert f["fp4"] >= f.get("fp8", f["bf16"])
    if "fp8" in f:
        assert f["fp8"] >= f["bf16"]
    assert 16e9 <= h.memory_bytes <= 3e12
    assert h.memory_bandwidth < 20e12 and h.interconnect_bandwidth < h.memory_bandwidth
    assert h.price_per_hour < 100


def test_known_anchors():
    assert get("h100").memory_bytes == 80 * 10**9 and get("h200").memory_bytes == 141 * 10**9
    assert get("h100").flops["bf16"] == pytest.approx(989e12, rel=0.01)
    assert get("b200").flops["fp4"] == pytest.approx(9e15)
    assert get("gb200").devices_per_node == 72 and get("gb200").flops["fp4"] == pytest.approx(10e15)
    assert get("mi300x").flops["bf16"] == pytest.approx(1307.4e12)
    assert get("m3-ultra").memory_bandwidth == pytest.approx(819e9)
    assert get("cpu-ddr5").memory_bytes >= 1.5e12


def test_invalid_entry_rejected():
    h = get("a100")
    with pytest.raises(ValueError):
        dataclasses.replace(h, sources={k: v for k, v in h.sources.items() if k != "price_per_hour"})
    with pytest.raises(ValueError):
        dataclasses.replace(h, flops={"fp8": 1.0})
    with pytest.raises(ValueError):
        dataclasses.replace(h, kind="tpu")
    with pytest.raises(ValueError, match="interconnect"):  # 8 GPUs per node that cannot talk: TP would divide by 0
        dataclasses.replace(h, interconnect_bandwidth=0.0)
    assert len({h, get("a100"), get("h100")}) == 2  # hashable by key


def test_markdown_table_mentions_every_key():
    md = markdown_table()
    for key in KEYS:
        assert f"| {key} |" in md and f"**{key}**" in md
    assert md.count("http") >= sum(len(h.sources) for h in CATALOGUE.values())


def test_import_does_not_pull_torch():
    code = "import sys, openk3.plan.hardware; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert hardware.__name__ == "openk3.plan.hardware"
