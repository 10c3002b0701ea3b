#!/usr/bin/env bash
# The GPU parts of the test plan, in stages (each fits one device call). Run on a Hopper machine:
#   scripts/gpu_suite.sh tests|host|bad|sanitize|fuzz|bench [OUTDIR]
# Results (logs, JSON, tables) go to OUTDIR (default gpu-results/).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?stage: tests host bad sanitize fuzz bench}
out=${2:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
case "$stage" in
  tests)    python3 -m pytest -q tests/gpu/test_kernels.py 2>&1 | tee "$out/gpu_tests.log" ;;
  host)     python3 bench/host_overhead.py --out "$out/host_overhead.json" ;;
  bad)      python3 tests/gpu/bad_tensors.py --out "$out/bad_tensors.md" ;;
  sanitize) for tool in memcheck racecheck; do
              PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool $tool --error-exitcode 3 \
                python3 tests/gpu/sanitize_run.py 2>&1 | tail -n 40 | tee "$out/sanitizer_$tool.log"
            done ;;
  fuzz)     python3 tests/gpu/fuzz_gpu.py --n "${FUZZ_N:-200}" --out "$out/fuzz.json" 2>&1 | tail -n 60 | tee "$out/fuzz.log" ;;
  bench)    python3 bench/run.py --out "$out/bench" 2>&1 | tee "$out/bench.log" ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
