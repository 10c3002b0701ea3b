"""Probe: the norm-statistics kernel with its per-row sum finished inside the kernel against the same
program lowered the way it was before (partials only, finished by a cuBLAS product after the launch;
a probe-only switch), on out-proj (32 N-tiles per row block) and gate/up (224 N-tiles) at M = 8192,
both rasters, pinned to the default config, calls shuffled, an untimed GEMM before every call.

    python bench/finish_ab_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import coda_cutlass as cc  # noqa: E402
from coda_cutlass import epilogues as E  # noqa: E402
from coda_cutlass.lower import evt  # noqa: E402
from coda_cutlass.timing import interleaved  # noqa: E402
from report import GpuSampler, require_hopper  # noqa: E402
from run import SHAPES, make_set  # noqa: E402

M = 8192


def legacy(program, **kw):
    """The program lowered without in-kernel finishing (as before): partials + a finishing launch."""
    saved = evt.finished_in_kernel
    evt.finished_in_kernel = lambda fn, axis: False
    try:
        return cc.compile_epilogue(program, torch.bfloat16, **kw)
    finally:
        evt.finished_in_kernel = saved


def main() -> None:
    require_hopper("bench/finish_ab_probe.py")
    residual = cc.compile_epilogue(E.residual_add, torch.bfloat16)
    new = cc.compile_epilogue(E.residual_norm_stats, torch.bfloat16)
    old = legacy(E.residual_norm_stats)
    old_partials = legacy(E.residual_norm_stats, partial_reductions=True)
    assert new.source_key != old.source_key   # two different kernels
    for shape in ("out-proj", "gate/up"):
        N, K = SHAPES[shape]
        sets = [make_set(M, N, K, {"resid": "tile", "g": "col"}, seed) for seed in (1, 2)]
        x0 = sets[0]
        a, b = new(x0["A"], x0["W"], resid=x0["resid"], g=x0["g"]), old(x0["A"], x0["W"], resid=x0["resid"], g=x0["g"])
        rel = float((a["sumsq"] - b["sumsq"]).abs().max() / b["sumsq"].abs().max())
        fns = {"cublas": lambda x: torch.mm(x["A"], x["W"].t()),
               "residual": lambda x: residual(x["A"], x["W"], resid=x["resid"])}
        for r in ("m", "n"):
            for label, k in (("in_kernel", new), ("after_launch", old), ("partials_only", old_partials)):
                fns[f"{label}_{r}"] = lambda x, k=k, r=r: k(x["A"], x["W"], resid=x["resid"], g=x["g"], raster=r,
                                                            swizzle=8)
        with GpuSampler() as gpu:
            times = interleaved(fns, sets, rounds=3, reps=20, before=lambda x: torch.mm(x["A"], x["W"].t()))
        print(f"{shape} M={M} N={N} K={K} (max rel. difference of sumsq, new vs old: {rel:.1e}) [{gpu.summary()}]")
        for name, us in times.items():
            print(f"  {name:18s} {us:8.1f} us  {us / times['cublas']:.3f}x cuBLAS")


if __name__ == "__main__":
    main()
