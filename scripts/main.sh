#!/usr/bin/env bash
# The main job on a fresh machine: set up, then pretrain the `nano` K3 on the built-in corpus (about
# 5 minutes on this project's 2-core CPU box), report validation bits per byte and print samples.
# Extra arguments go to `openk3 train` (later flags win), e.g. `--max-steps 20 --out /tmp/run`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
openk3 train --preset nano --out runs/nano --max-steps 240 "$@"
