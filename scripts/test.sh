#!/usr/bin/env bash
# The test suite on a fresh machine: set up, then run pytest on one thread (CI's budget is one core).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
python -m pytest "$@"
