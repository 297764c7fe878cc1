"""The decode and serving benchmarks run end to end at toy sizes (their numbers are not checked: no timed asserts),
so a change that breaks a benchmark script fails CI rather than the next person measuring."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler")


@needs_cc
def test_bench_mxfp4_decode_runs(tmp_path):
    import bench_mxfp4_decode

    out = bench_mxfp4_decode.main(["--presets", "nano", "--tokens", "1", "3", "--layers", "1", "--repeats", "1",
                                   "--json", str(tmp_path / "r.json")])
    rows = out["rows"]
    assert [r["tokens"] for r in rows] == [1, 3] and all(r["relative_error"] < 1e-5 for r in rows)
    assert (tmp_path / "r.json").exists()
    assert rows[0]["packed_bytes_per_layer"] == 32 * 3 * 64 * 64 * 17 // 32  # 4.25 bits per weight


@needs_cc
def test_bench_decode_with_mxfp4_experts_runs():
    """openk3 on packed experts against transformers on the same values: the greedy tokens agree."""
    pytest.importorskip("transformers")
    import bench_decode

    out = bench_decode.main(["--preset", "nano-kl", "--experts", "mxfp4", "--batch", "1", "2", "--prompt-len", "8",
                             "--new-tokens", "4", "--repeats", "1", "--warmup", "0"])
    assert out["experts"] == "mxfp4"
    assert all(r["greedy_agreement"] == 1.0 for r in out["batches"]), [r["greedy_agreement"] for r in out["batches"]]


def test_bench_linear_layout_runs(tmp_path):
    import bench_linear_layout

    out = bench_linear_layout.main(["--presets", "nano-kl", "--batch", "1", "3", "--copies", "1", "--repeats", "1",
                                    "--json", str(tmp_path / "r.json")])
    rows = out["presets"]["nano-kl"]
    steps = [r for r in rows if "step_us" in r]
    assert [r["batch"] for r in steps] == [1, 3] and all(r["step_us"]["column-major"] > 0 for r in steps)
    assert sum(r["linears"] for r in rows if r.get("batch") == 1 and "linears" in r) > 30


def test_bench_serve_runs(tmp_path):
    """The serving benchmark starts `openk3 serve` in its own process, streams through it and stops it."""
    import bench_serve

    out = bench_serve.main(["--preset", "nano", "--concurrency", "1", "3", "--requests", "3", "--prompt-len", "8",
                            "--max-tokens", "4", "--json", str(tmp_path / "r.json")])
    levels = out["levels"]
    assert [r["concurrency"] for r in levels] == [1, 3] and (tmp_path / "r.json").exists()
    assert all(r["completed"] == 3 and r["failed"] == 0 for r in levels), [r["errors"] for r in levels]
    assert all(r["output_tokens_per_s"] > 0 and r["ttft_ms"]["p50"] > 0 for r in levels)
