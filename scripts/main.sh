#!/usr/bin/env bash
# The main job on a fresh machine: set up, pretrain the `nano` K3 on the built-in corpus (about
# 5 minutes on this project's 2-core CPU box), report validation bits per byte and print samples,
# then generate from the trained checkpoint with the inference engine (`openk3 generate`).
# Extra arguments go to `openk3 train` (later flags win), e.g. `--max-steps 20 --out /tmp/run`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
out=runs/nano
prev=""
for a in "$@"; do  # the run folder: the last --out / --out=DIR given
    [[ "$prev" == "--out" ]] && out="$a"
    [[ "$a" == --out=* ]] && out="${a#--out=}"
    prev="$a"
done
openk3 train --preset nano --out runs/nano --max-steps 240 "$@"
echo
echo "== openk3 generate --model $out (the trained checkpoint, through the inference engine)"
openk3 generate --model "$out" --prompt "def " --max-tokens 64 --temperature 0.8 --top-p 0.95 --seed 0
