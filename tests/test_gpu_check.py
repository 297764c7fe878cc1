"""scripts/gpu_check.sh on a machine without a GPU: its arguments, its plan and its summary's format (the GPU
steps themselves run where a GPU is: docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)


def run(*args):
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})


def test_dry_run_writes_the_plan(tmp_path):
    out = run("--dry-run", "--out", str(tmp_path), "--budget-s", "300")
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["schema"] == gpu_check.SCHEMA and data["dry_run"] and data["ok"] is False  # nothing ran
    assert [s["name"] for s in data["steps"]] == list(gpu_check.STEPS)
    assert all(s["status"] == "planned" and s["command"] for s in data["steps"])
    assert sum(s["timeout_s"] for s in data["steps"]) <= 300
    tests = next(s for s in data["steps"] if s["name"] == "tests")
    assert "-m" in tests["command"] and "gpu" in tests["command"]


@pytest.mark.parametrize("args, message", [(["--budget-s", "10"], "--budget-s must be >= 60"),
                                           (["--steps", "tests,fuzz"], "unknown ['fuzz']")])
def test_bad_arguments_exit_2_naming_the_option(args, message):
    out = run(*args, "--dry-run")
    assert out.returncode == 2 and message in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_a_gpu_it_says_so_and_keeps_a_summary(tmp_path):
    out = run("--out", str(tmp_path), "--steps", "tests")
    assert out.returncode == 3 and "no CUDA device" in out.stderr
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["ok"] is False and data["device"]["cuda_available"] is False and data["device"]["torch"]
    assert [s["name"] for s in data["steps"]] == ["environment"] and data["steps"][0]["status"] == "ok"


def test_plan_knows_the_device_peak_and_the_subset():
    args = gpu_check.parse_args(["--steps", "bench_train", "--out", "/tmp/x"])
    steps = gpu_check.plan(args, "NVIDIA H200")
    assert [s["name"] for s in steps] == ["environment", "bench_train"]
    train = steps[1]["command"]
    assert train[train.index("--peak-tflops") + 1] == "989.4" and "--device" in train
    assert "--peak-tflops" not in gpu_check.plan(args, "Some New GPU")[1]["command"]


def test_junit_counts(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite name="pytest" tests="5" failures="1" errors="0" skipped="2">'
                   '</testsuite></testsuites>')
    assert gpu_check.junit_counts(xml) == {"passed": 2, "failed": 1, "errors": 0, "skipped": 2}
    assert gpu_check.junit_counts(tmp_path / "missing.xml") is None
