#!/usr/bin/env bash
# The test suite on a fresh machine: set up, then run pytest (two worker processes on one thread each).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Two worker processes (pytest-xdist) where there are two CPUs, each test on one thread: the suite's ~1,050
# tests take about half the time of one process. OPENK3_TEST_WORKERS=1 runs them in this process.
# (nproc counts OMP_NUM_THREADS as the CPU count, so it is asked without it)
cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
workers=${OPENK3_TEST_WORKERS:-$(( cpus >= 2 ? 2 : 1 ))}
if [ "$workers" -gt 1 ]; then
  # worksteal: an idle worker takes queued tests from a busy one, so a few long tests (compiled graphs,
  # torchrun launches) at the end of one worker's share do not leave the other idle
  python -m pytest -n "$workers" --dist worksteal "$@"
else
  python -m pytest "$@"
fi
