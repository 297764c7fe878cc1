#!/usr/bin/env bash
# Create ./.venv with the CPU build of torch and openk3 (editable, with test extras). Idempotent:
# a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  # Pinned so pip takes the CPU wheel; an unpinned torch would download a multi-GB CUDA build.
  pip install -q torch==2.13.0
fi
if ! python -c "import openk3, pytest, transformers, safetensors, tqdm" 2>/dev/null; then
  pip install -q -e ".[dev]"
fi
