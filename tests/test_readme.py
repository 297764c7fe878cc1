"""The README's two fresh-machine commands exist, point at real scripts, and the main job runs."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Two commands on a fresh machine\s+```bash\n(.*?)```", text, re.S)
    assert block, "README must open with the two fresh-machine commands in a bash block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]


def test_readme_has_main_and_test_commands():
    cmds = _readme_commands()
    assert cmds == ["bash scripts/main.sh", "bash scripts/test.sh"]
    for cmd in cmds:
        assert (ROOT / cmd.split()[1]).is_file()
    # CI runs exactly the README's test command.
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.slow(seconds=10)  # a real `bash scripts/main.sh` (tokenizer, shards, training, generate): 10-80 s
def test_readme_main_command_short(tmp_path):
    """The main job (pretraining nano on the built-in corpus), shortened by flags passed through; setup is a
    no-op once .venv exists."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENK3_THREADS": "1"}
    args = ["--out", str(tmp_path / "run"), "--max-steps", "2", "--no-progress", "batch_size=2", "seq_len=32",
            "data.max_bytes=300000", "sample_tokens=8"]
    r = subprocess.run(["bash", "scripts/main.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "validation bits per byte" in r.stdout
    assert "sample" in r.stdout
    assert "== openk3 generate --model" in r.stdout and str(tmp_path / "run") in r.stdout  # inference on the result
    assert (tmp_path / "run" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_readme_file_tree_is_current():
    """Every file in the annotated tree exists, and every package module is in the tree."""
    text = (ROOT / "README.md").read_text()
    tree = re.search(r"## Files\s+```\n(.*?)```", text, re.S).group(1)
    names = set(re.findall(r"^\s*([\w./-]+)\s", tree, re.M))
    for path in ROOT.glob("openk3/**/*.py"):
        if path.name == "__init__.py":
            continue
        assert path.name in names or str(path.relative_to(ROOT)) in names, f"{path} missing from README tree"
