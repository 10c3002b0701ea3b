#!/usr/bin/env bash
# The GPU parts of the test plan. On a Hopper machine, everything in one command:
#   scripts/gpu_suite.sh all [OUTDIR]
# or one stage at a time: tests|host|bad|sanitize|fuzz|bench [OUTDIR]
# Results (logs, JSON, tables) go to OUTDIR (default gpu-results/).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?stage: all tests host bad sanitize fuzz bench}
out=${2:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ "$stage" = all ]; then
  rc=0
  for s in tests host bad sanitize fuzz bench; do "$0" "$s" "$out" || rc=1; done
  exit $rc
fi
case "$stage" in
  tests)    python3 -m pytest -q -p no:logging tests/gpu/test_kernels.py 2>&1 | tee "$out/gpu_tests.log" ;;
  host)     python3 bench/host_overhead.py --out "$out/host_overhead.json" ;;
  bad)      python3 tests/gpu/bad_tensors.py --out "$out/bad_tensors.md" ;;
  sanitize) PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 3 \
              python3 tests/gpu/sanitize_run.py > "$out/sanitizer_memcheck.log" 2>&1; echo "memcheck exit $?"
            # racecheck is slow on warp-specialized kernels: a smaller set
            PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck --error-exitcode 3 \
              python3 tests/gpu/sanitize_run.py residual_norm_stats kn_accumulate_no_d many_reductions \
              > "$out/sanitizer_racecheck.log" 2>&1; echo "racecheck exit $?"
            tail -n 3 "$out"/sanitizer_*.log ;;
  fuzz)     python3 tests/gpu/fuzz_gpu.py --n "${FUZZ_N:-200}" --out "$out/fuzz.json" > "$out/fuzz.log" 2>&1  # whole log kept (a timeout keeps what ran)
            rc=$?; tail -n 60 "$out/fuzz.log"; exit $rc ;;
  bench)    python3 bench/run.py --out "$out/bench" 2>&1 | tee "$out/bench.log"
            python3 bench/pairwise.py --out "$out/bench_pairwise" 2>&1 | tee "$out/bench_pairwise.log" ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
