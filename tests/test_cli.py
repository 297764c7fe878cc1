"""The one door in: `python -m openk3 <command>` in a subprocess, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENK3_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "openk3", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_info_k3_json():
    r = _run("info", "--preset", "k3", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["total_params"] == 2_779_484_478_208
    assert info["active_params"] == 104_189_614_848
    assert info["num_kda_layers"] == 69 and info["num_mla_layers"] == 24
    assert info["mla_cache_bytes_per_token"] == 27_648
    assert info["kda_state_bytes_per_sequence"] == 69 * 96 * 128 * 128 * 4


def test_info_k3_table(capsys):
    """In-process (same `main` the console script calls) to spare a second interpreter start."""
    from openk3.__main__ import main

    assert main(["info", "--preset", "k3"]) == 0
    out = capsys.readouterr().out
    assert "2,779,484,478,208" in out
    assert "104,189,614,848" in out


def test_info_unknown_preset_is_one_line_error():
    """Said before torch is imported (~2 s): the `main` that `python -m openk3` runs, then what it imported."""
    code = ("import sys, openk3.__main__ as m; rc = m.main(); print('torch' in sys.modules, file=sys.stderr); "
            "sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, "info", "--preset", "nope"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1", "OPENK3_THREADS": "1"})
    assert r.returncode == 2
    *lines, imported_torch = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "nope" in lines[0] and "Traceback" not in r.stderr
    assert r.stdout == "" and imported_torch == "False"


def test_info_from_config_json(tmp_path, capsys):
    from openk3.__main__ import main
    from openk3.config import nano

    path = tmp_path / "config.json"
    nano().to_json(path)
    assert main(["info", "--config", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total_params"] == 4_795_512 + 6 * (128 - 4)


@pytest.mark.slow(seconds=4)
def test_demo_nano():
    r = _run("demo", "--preset", "nano", "--steps", "3", "--seq-len", "16", "--new-tokens", "4", "--threads", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "agrees with full forwards on 100%" in r.stdout, r.stdout


def test_missing_checkpoint_path_is_one_line_error(tmp_path, capsys):
    from openk3.__main__ import main

    assert main(["info", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0] and "no such checkpoint" in err[0]
