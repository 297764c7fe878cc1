#!/usr/bin/env bash
# The test suite on a fresh machine: set up (.venv; bubblewrap and Chromium where this user may install them),
# then run pytest (two worker processes on one thread each). Arguments go to pytest, except:
#   --isa avx2|default   run with every CPU kernel limited to that x86-64 level (torch's ATen kernels, oneDNN,
#                        MKL and openk3's own C kernels): what a CPU without AVX-512 (avx2) or without AVX
#                        (default) computes, on this machine. Tests marked `isa` depend on it.
set -euo pipefail
cd "$(dirname "$0")/.."
isa=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --isa) isa=${2:-}; shift 2 || { echo "test.sh: --isa needs a value (avx2 or default)" >&2; exit 2; } ;;
    --isa=*) isa=${1#--isa=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
case "$isa" in
  "") ;;
  avx2) export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 OPENK3_KERNEL_ISA=avx2 ;;
  default) export ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2 \
               OPENK3_KERNEL_ISA=default ;;
  *) echo "test.sh: --isa must be avx2 or default, got '$isa'" >&2; exit 2 ;;
esac
bash scripts/setup.sh
bash scripts/system-deps.sh
. .venv/bin/activate
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Bytecode caches on, whatever the caller's PYTHONDONTWRITEBYTECODE: the suite starts a few hundred Python
# processes (CLI runs, torchrun ranks, engine and server processes), and without cached bytecode each one compiles
# torch's modules from source again (~2 s per process), and each pytest worker rewrites every test module's asserts
# again. The caches are __pycache__ folders (git-ignored) in .venv, openk3/ and tests/.
unset PYTHONDONTWRITEBYTECODE
# Two worker processes (pytest-xdist) where there are two CPUs, each test on one thread: the suite's ~1,600
# tests take about half the time of one process. OPENK3_TEST_WORKERS=1 runs them in this process.
# (nproc counts OMP_NUM_THREADS as the CPU count, so it is asked without it)
cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
workers=${OPENK3_TEST_WORKERS:-$(( cpus >= 2 ? 2 : 1 ))}
if [ "$workers" -gt 1 ]; then
  # worksteal: an idle worker takes queued tests from a busy one, so a few long tests (compiled graphs,
  # torchrun launches) at the end of one worker's share do not leave the other idle. The slow pass alone
  # (`-m slow`: ~15 tests of 3-90 s) is handed out one by one in the order conftest.py gives, longest first.
  dist=worksteal
  prev=""
  for a in ${args[@]+"${args[@]}"}; do
    [ "$prev" = "-m" ] && [ "$a" = "slow" ] && dist=load
    prev=$a
  done
  python -m pytest -n "$workers" --dist "$dist" ${args[@]+"${args[@]}"}
else
  python -m pytest ${args[@]+"${args[@]}"}
fi
