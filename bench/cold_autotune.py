"""Cold autotune of one kernel (issue 3 target: within 3 minutes on the H200 machine): a program
none of whose candidate configurations is cached or prebuilt, tuned from scratch (parallel builds
plus timing), then a second process-level lookup that must hit the tuning cache.

    python bench/cold_autotune.py [--out cold_autotune.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import coda_cutlass as cc  # noqa: E402
from report import require_hopper  # noqa: E402
from coda_cutlass.tuning import TunedEpilogue  # noqa: E402


@cc.epilogue
def bias_relu_scaled(acc, bias: cc.PerCol, s: cc.Scalar):
    """A program no test or benchmark builds, so nothing of it is cached or prebuilt."""
    return cc.relu(acc + bias) * s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_hopper("bench/cold_autotune.py")
    cache = tempfile.mkdtemp(prefix="coda-cold-tune-")
    M, N, K = 8192, 4096, 4096
    A = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
    bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    t = time.monotonic()
    k = cc.compile_epilogue(bias_relu_scaled, torch.bfloat16, config="tune", cache_dir=cache)
    k(A, W, bias=bias, s=0.5)
    torch.cuda.synchronize()
    cold = time.monotonic() - t
    rec = k.choice(A, W)
    t = time.monotonic()
    k2 = cc.compile_epilogue(bias_relu_scaled, torch.bfloat16, config="tune", cache_dir=cache)
    k2.tune = None      # a tuning-cache hit must not tune again
    k2(A, W, bias=bias, s=0.5)
    torch.cuda.synchronize()
    warm = time.monotonic() - t
    result = {"cold_autotune_s": round(cold, 1), "cache_hit_s": round(warm, 3),
              "candidates": len(k.candidates), "timed_variants": len(rec["timings"]),
              "choice": {"config": cc.KernelConfig.from_dict(rec["config"]).name(), "raster": rec["raster"],
                         "swizzle": rec["swizzle"], "us": rec["us"]}}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    assert isinstance(k2, TunedEpilogue)


if __name__ == "__main__":
    main()
