#!/usr/bin/env bash
# One-shot device check on one CUDA GPU (issue 32), <= 8 minutes: the `gpu` test tier (fla's kernels and the
# nano model against the PyTorch twins in float32 and bf16, bf16 autocast against float32, a compiled training
# step against eager), bench_train at the `base` shape (tokens/s, TFLOP/s, MFU) and the engine's decode speed,
# summarised in one JSON file (scripts/gpu_check.py says what each step measures and the summary's format).
#
#   bash scripts/gpu_check.sh [--out DIR] [--budget-s 480] [--steps tests,bench_train,bench_decode] [--dry-run]
#
# It needs a Python whose torch is a CUDA build, with triton (a CUDA torch brings it) and fla-core: $PYTHON, else
# ./.venv if its torch sees a GPU, else python3. openk3's own .venv holds the CPU torch (scripts/setup.sh), so on a
# GPU machine install openk3 beside its CUDA torch first: pip install -e '.[dev,gpu]' (no torch is pulled).
# Exit status: 0 all steps ok, 1 a step failed or timed out, 2 bad arguments, 3 no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-}
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    py=.venv/bin/python
  else
    py=python3
  fi
fi
exec "$py" scripts/gpu_check.py --python "$py" "$@"
