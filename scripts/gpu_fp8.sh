#!/usr/bin/env bash
# FP8 operands on a Hopper machine, in one call (each stage bounded in time: 7.5 minutes at most):
#   scripts/gpu_fp8.sh OUTDIR
#   1. build  every kernel of tests/gpu/fp8_cases.py and bench/fp8_gemm.py in parallel (one nvcc per
#             core, cc.compile_many), into $CODA_CUTLASS_CACHE_DIR (default OUTDIR/cache)
#   2. tests  tests/gpu/test_fp8_gpu.py (loads the kernels from that cache); measured errors go to
#             OUTDIR/fp8_errors.jsonl
#   3. bench  bench/fp8_gemm.py OUTDIR/bench (M = 8192, Llama-3-8B and 70B shapes vs torch._scaled_mm)
# Limits (seconds): BUILD_LIMIT (210), TESTS_LIMIT (120), BENCH_LIMIT (120); BENCH_ARGS are passed on.
# The CUTLASS headers come from the nvidia-cutlass wheel on PYTHONPATH or $CODA_CUTLASS_CUTLASS_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
export CODA_CUTLASS_CACHE_DIR=${CODA_CUTLASS_CACHE_DIR:-$out/cache}
export CODA_FP8_ERRORS=$out/fp8_errors.jsonl
rm -f "$CODA_FP8_ERRORS"
summary=()
run() {
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit} s)"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  summary+=("$name: rc=$rc in $((SECONDS - t0)) s (log $out/$name.log)")
  return $rc
}

run build "${BUILD_LIMIT:-210}" python3 -c '
import sys, time
sys.path[:0] = ["tests", "tests/gpu", "bench"]
import coda_cutlass as cc
from fp8_cases import build_items
from fp8_gemm import kernel_items
items = build_items() + kernel_items()
t = time.time()
built = cc.compile_many(items, skip_failed=True)
failed = [p.name for (p, _), k in zip(items, built) if k is None]
print(f"{len(items) - len(failed)} of {len(items)} FP8 kernels ready in {time.time() - t:.0f} s; failed: {failed}")
sys.exit(1 if failed else 0)'

run tests "${TESTS_LIMIT:-120}" python3 -m pytest -q -p no:logging -p no:cacheprovider tests/gpu/test_fp8_gpu.py

run bench "${BENCH_LIMIT:-120}" python3 bench/fp8_gemm.py "$out/bench" ${BENCH_ARGS:-}

echo "== summary"
printf '%s\n' "${summary[@]}"
grep -E "passed|failed|error" "$out/tests.log" | tail -n 1
if [ -s "$CODA_FP8_ERRORS" ]; then
  python3 - "$CODA_FP8_ERRORS" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
worst = {}
for r in rows:
    if "err" in r:
        key = r["case"]
        worst[key] = max(worst.get(key, 0.0), r["err"] / max(r["bound"], 1e-30))
print("worst error / bound per case:", ", ".join(f"{k} {v:.2f}" for k, v in sorted(worst.items())))
for r in rows:
    if r.get("case") == "fast_vs_exact":
        print(f"K={r['K']}: max rel error exact {r['exact_rel']:.2e}, fast {r['fast_rel']:.2e}; "
              f"mean rel exact {r['exact_mean_abs_rel']:.2e}, fast {r['fast_mean_abs_rel']:.2e}")
EOF
fi
[ -f "$out/bench/results.md" ] && grep -E "^\| " "$out/bench/results.md" | head -n 80
exit 0
