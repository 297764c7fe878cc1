#!/usr/bin/env bash
# Create ./.venv with the CPU build of torch and openk3 (editable, with test extras). Idempotent:
# it reinstalls only when pyproject.toml changed since the last install (hash kept in .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# (find_spec, not an import: importing torch costs ~2 s, and test.sh runs this before every pass)
if ! python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"; then
  # Pinned so pip takes the CPU wheel; an unpinned torch would download a multi-GB CUDA build.
  pip install -q --no-compile torch==2.13.0
fi
stamp=.venv/.openk3-pyproject.sha256
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! python -c "import openk3" 2>/dev/null; then  # (openk3's own import is light)
  # interpreter: triton (pinned, ~690 MB) for the `triton` test tier, fla's kernels run on the CPU
  pip install -q --no-compile -e ".[dev,interpreter]"
  echo "$want" > "$stamp"
fi
