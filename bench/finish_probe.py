"""Probe: what does finishing a reduction after the GEMM cost, and which call is cheapest? The
kernel writes fp32 partials [ceil(N / tile_n), M_pad] (one row per N-tile); the runtime sums them
over the tiles with a second launch. Each candidate is timed right after an untimed bare GEMM of
out-proj shape (as in a training step), calls shuffled, on M = 8192 and 16384 (32 N-tiles), next
to cuBLAS, the smallest possible launch (zeroing 4 bytes) and the whole norm-statistics call with
and without the runtime's finishing step (`partial_reductions=True`).

    python bench/finish_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import coda_cutlass as cc  # noqa: E402
from coda_cutlass import epilogues as E  # noqa: E402
from coda_cutlass.timing import interleaved  # noqa: E402
from report import require_hopper  # noqa: E402
from run import make_set  # noqa: E402

N, K, TILES = 4096, 4096, 32


def main() -> None:
    import argparse
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    require_hopper("bench/finish_probe.py")
    residual = cc.compile_epilogue(E.residual_add, torch.bfloat16)
    full = cc.compile_epilogue(E.residual_norm_stats, torch.bfloat16)
    partial = cc.compile_epilogue(E.residual_norm_stats, torch.bfloat16, partial_reductions=True)
    for M in (8192, 16384):
        sets = [make_set(M, N, K, {"resid": "tile", "g": "col"}, seed) for seed in (1, 2)]
        for x in sets:
            x["buf"] = torch.randn(TILES, M, device="cuda")
            x["ones"] = torch.ones(TILES, device="cuda")
            x["tiny"] = torch.empty(1, device="cuda")
        ref = torch.sum(sets[0]["buf"], 0)
        alt = torch.mv(sets[0]["buf"].t(), sets[0]["ones"])
        print(f"M={M}: max |mv - sum| / max |sum| = {float((alt - ref).abs().max() / ref.abs().max()):.2e}")
        fns = {
            "cublas": lambda x: torch.mm(x["A"], x["W"].t()),
            "residual": lambda x: residual(x["A"], x["W"], resid=x["resid"]),
            "launch_floor": lambda x: x["tiny"].zero_(),
            "torch_sum_dim0": lambda x: torch.sum(x["buf"], 0),
            "mv_ones": lambda x: torch.mv(x["buf"].t(), x["ones"]),
            "norm_stats": lambda x: full(x["A"], x["W"], resid=x["resid"], g=x["g"]),
            "norm_stats_partials": lambda x: partial(x["A"], x["W"], resid=x["resid"], g=x["g"]),
        }
        times = interleaved(fns, sets, rounds=2, reps=40, before=lambda x: torch.mm(x["A"], x["W"].t()))
        for name, us in times.items():
            print(f"  {name:22s} {us:8.1f} us  {us / times['cublas']:.3f}x cuBLAS")


if __name__ == "__main__":
    main()
