#!/usr/bin/env bash
# The main job on a fresh machine: set up, then build and run a K3 model (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
openk3 demo "$@"
