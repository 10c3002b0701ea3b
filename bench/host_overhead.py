"""Host-side cost of a warm call: k(A, W, ...) versus the bare C launch (coda_run through ctypes with
prepared arguments) and versus torch.mm, on a tiny problem where the GPU is never the bottleneck.

    python bench/host_overhead.py [--out results.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch

import coda_cutlass as cc
from report import require_hopper
from coda_cutlass.epilogues import residual_norm_stats


def per_call_us(fn, n: int = 2000, rounds: int = 5) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_hopper("bench/host_overhead.py")
    M = N = K = 256
    dev = "cuda"
    A = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    W = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
    R = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    g = torch.randn(N, device=dev, dtype=torch.bfloat16)
    k = cc.compile_epilogue(residual_norm_stats, torch.bfloat16)
    k(A, W, resid=R, g=g)
    lib = k.library
    D = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    H = torch.empty_like(D)
    S = torch.empty(1, 256, device=dev, dtype=torch.float32)
    ptrs = (ctypes.c_void_p * 5)(R.data_ptr(), g.data_ptr(), D.data_ptr(), H.data_ptr(), S.data_ptr())
    lds = (ctypes.c_int64 * 5)(N, 0, N, N, 0)
    scal = (ctypes.c_float * 1)(0.0)
    stream = torch.cuda.current_stream().cuda_stream

    def bare() -> None:
        lib.run(A.data_ptr(), K, W.data_ptr(), K, M, N, K, ptrs, lds, scal, 0, 1, None, 0, stream)

    results = {
        "torch.mm": per_call_us(lambda: torch.mm(A, W.t())),
        "bare coda_run (ctypes, prepared args)": per_call_us(bare),
        "k(A, W, ...) full call": per_call_us(lambda: k(A, W, resid=R, g=g)),
        "k.run without the finishing reduction": None,
    }
    saved = k._finish
    k._finish = lambda name, buf, M, N: buf
    results["k.run without the finishing reduction"] = per_call_us(lambda: k(A, W, resid=R, g=g))
    k._finish = saved
    overhead = results["k(A, W, ...) full call"] - results["bare coda_run (ctypes, prepared args)"]
    results["added host time over the launch"] = overhead
    for name, v in results.items():
        print(f"{name:45s} {v:8.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "us": results}, f, indent=2)


if __name__ == "__main__":
    main()
