"""Probe: does the call that runs just before a timed call move its time? Times out-proj M=8192
(8192x4096x4096, the shape whose ratios moved most between runs) under four call orders, each
twice, in one process:

  rotate        the order shifted by one each pass (bench/run.py's order until this probe): the
                cyclic order is fixed, so cuBLAS nearly always follows torch.compile of the
                workload, our identity kernel follows cuBLAS, the fused kernel our identity;
  shuffle       a fresh seeded permutation every pass (every function follows every other);
  after_gemm    shuffled, and an untimed cuBLAS GEMM of the same shape queued before every timed call;
  after_memory  shuffled, and an untimed eager norm-statistics (memory-bound) before every call.

It also splits the norm-statistics kernel's cost: the same kernel returning raw partials (no
finishing launch), and the finishing torch reduction alone.

    python bench/order_probe.py --out bench/results/order_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import coda_cutlass as cc  # noqa: E402
from coda_cutlass import epilogues as E  # noqa: E402
from coda_cutlass.timing import interleaved  # noqa: E402
from report import GpuSampler, environment, require_hopper  # noqa: E402
from run import EPILOGUES, make_set  # noqa: E402

M, N, K = 8192, 4096, 4096
OPERANDS = {"resid": "tile", "g": "col", "r": "row32", "up": "tile"}


def functions() -> dict:
    k = {name: cc.compile_epilogue(EPILOGUES[name][0], torch.bfloat16)
         for name in ("identity", "residual", "norm_stats", "rowscale_silu_gate")}
    partials = cc.compile_epilogue(E.residual_norm_stats, torch.bfloat16, partial_reductions=True)
    buf = torch.randn(N // 128, M, device="cuda")
    eager_ns, eager_rs = EPILOGUES["norm_stats"][1], EPILOGUES["rowscale_silu_gate"][1]
    compiled_ns = torch.compile(eager_ns, dynamic=True)
    return {
        "cublas": lambda x: torch.mm(x["A"], x["W"].t()),
        "identity": lambda x: k["identity"](x["A"], x["W"]),
        "residual": lambda x: k["residual"](x["A"], x["W"], resid=x["resid"]),
        "norm_stats": lambda x: k["norm_stats"](x["A"], x["W"], resid=x["resid"], g=x["g"]),
        "norm_stats_partials": lambda x: partials(x["A"], x["W"], resid=x["resid"], g=x["g"]),
        "finish_sum_only": lambda x: torch.sum(buf, 0),
        "rowscale_silu": lambda x: k["rowscale_silu_gate"](x["A"], x["W"], r=x["r"], up=x["up"]),
        "eager_norm_stats": eager_ns,
        "compile_norm_stats": compiled_ns,
        "eager_rowscale_silu": eager_rs,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/order_probe.json")
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    require_hopper("bench/order_probe.py")
    sets = [make_set(M, N, K, OPERANDS, seed) for seed in (1, 2)]
    fns = functions()
    gemm, memory = fns["cublas"], fns["eager_norm_stats"]
    orders = {"rotate": dict(order="rotate"), "shuffle": dict(order="shuffle"),
              "after_gemm": dict(order="shuffle", before=gemm), "after_memory": dict(order="shuffle", before=memory)}
    results = []
    for repeat in range(2):
        for label, kw in orders.items():
            with GpuSampler() as gpu:
                times = interleaved(fns, sets, rounds=1, reps=args.reps, **kw)
            row = {"order": label, "repeat": repeat, "us": times, "gpu": gpu.summary(),
                   "ratio": {k: v / times["cublas"] for k, v in times.items()}}
            results.append(row)
            print(f"{label:13s} #{repeat}  cuBLAS {times['cublas']:6.1f} us  " +
                  "  ".join(f"{k} {v:.3f}" for k, v in row["ratio"].items() if k != "cublas") + f"  [{row['gpu']}]",
                  flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env": environment(), "shape": [M, N, K], "rows": results}, indent=1))


if __name__ == "__main__":
    main()
