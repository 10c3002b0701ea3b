"""GPU differential fuzzing (issue 5): random epilogue programs, built in parallel, each run at a
random shape (ragged ones included) with fresh inputs and poisoned outputs, checked against the
reference interpreter under the 2x-error rule, and run twice for bitwise determinism.

    python tests/gpu/fuzz_gpu.py --n 200 --out fuzz.json

Kernels come from the cache or $CODA_CUTLASS_PREBUILT_PATH when present
(`python -m coda_cutlass prebuild tests/fuzzgen.py --out DIR` builds the same 200 ahead of time).
Exit status 1 if any program mismatches.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent.parent))

import coda_cutlass as cc  # noqa: E402
from coda_cutlass.runtime import kernel as kernel_module  # noqa: E402
from fuzzgen import random_program  # noqa: E402

FIXED_SHAPES = [(8192, 4096, 4096), (1000, 776, 520), (129, 136, 64)]


def random_shape(rng: random.Random) -> tuple[int, int, int]:
    if rng.random() < 0.3:
        return rng.choice(FIXED_SHAPES)
    return rng.randint(1, 3000), 8 * rng.randint(1, 300), 8 * rng.randint(1, 160)


def check(k, g, shape, seed) -> dict:
    M, N, K = shape
    A, W, ops = g.make_inputs(M, N, K, "cuda", seed)
    before = {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in ops.items()}

    def fresh() -> dict:
        """Copies of the inputs as they were: the kernel and the reference both update
        cc.accumulate outputs in place, so each call gets its own."""
        return {n: (v.clone() if isinstance(v, torch.Tensor) else v) for n, v in before.items()}

    out = k(A, W, **ops)
    ref32 = k.reference(A.float(), W.float(), precision="fp32",
                        **{n: (v.to(torch.float32, copy=True) if isinstance(v, torch.Tensor) else v)
                           for n, v in before.items()})
    lowp = k.reference(A, W, precision="lowp", **fresh())
    worst = {}
    for name in ref32:
        o, r, l = out[name].float(), ref32[name].float(), lowp[name].float()
        finite = torch.isfinite(r)
        if not torch.equal(torch.isfinite(o), finite):
            return {"ok": False, "why": f"{name}: non-finite pattern differs (unwritten output?)"}
        if finite.any():
            err = (o - r)[finite].abs().max().item()
            tol = 2 * (l - r)[finite].abs().max().item() + 1e-6
            worst[name] = (err, tol)
            if err > tol:
                return {"ok": False, "why": f"{name}: max error {err:.3e} > bound {tol:.3e}"}
    again = k(A, W, **fresh())
    for name in out:
        if not torch.equal(out[name].nan_to_num(), again[name].nan_to_num()):
            return {"ok": False, "why": f"{name}: two runs differ bitwise"}
    return {"ok": True, "worst": {n: e / t for n, (e, t) in worst.items()}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("needs a Hopper GPU (sm_90)")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    kernel_module.POISON = True
    gens = [random_program(s) for s in range(args.start, args.start + args.n)]
    t0 = time.monotonic()
    kernels = cc.compile_many([(g.program, g.options) for g in gens], skip_failed=True)
    build_s = time.monotonic() - t0
    rng = random.Random(1234)
    results = []
    for g, k in zip(gens, kernels):
        shape = random_shape(rng)
        if k is None:
            results.append({"seed": g.seed, "ok": False, "why": "build failed", "program": g.text})
            continue
        try:
            r = check(k, g, shape, seed=g.seed + 10_000)
        except Exception as e:  # noqa: BLE001 - any crash is a finding
            r = {"ok": False, "why": f"exception: {e!r}", "trace": traceback.format_exc()[-2000:]}
        r.update({"seed": g.seed, "shape": shape})
        if not r["ok"]:
            r["program"] = g.text
            print(f"MISMATCH seed {g.seed} {shape}: {r['why']}", flush=True)
        results.append(r)
    bad = [r for r in results if not r["ok"]]
    summary = {"programs": len(results), "mismatches": len(bad), "build_seconds": round(build_s, 1),
               "shapes_ragged": sum(1 for r in results if "shape" in r and (r["shape"][0] % 128 or r["shape"][1] % 256)),
               "worst_error_over_bound": max((max(r["worst"].values(), default=0) for r in results if r.get("worst")),
                                             default=0.0),
               "failures": bad}
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({**summary, "results": results}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
