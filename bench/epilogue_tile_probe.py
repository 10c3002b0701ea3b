"""Probe: does an explicit epilogue subtile (instead of CUTLASS's EpilogueTileAuto) speed up the
epilogue of cooperative 128x256 kernels, and what does skipping the trig on V tiles save? Times
RoPE and identity on the QKV shape with each epilogue tile against cuBLAS, calls alternating
(bench/pairwise.py's method). `rope_*_noskip` runs the same kernel with the V frequencies set to
1e-30 instead of 0: every fragment then takes the sincos path (the rotation is still the identity
to fp32 precision), which is what RoPE cost before V fragments skipped it.

    python bench/epilogue_tile_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import coda_cutlass as cc  # noqa: E402
from coda_cutlass import epilogues as E  # noqa: E402
from coda_cutlass.timing import interleaved  # noqa: E402
from pairwise import WORKLOADS, make_set  # noqa: E402
from report import GpuSampler  # noqa: E402

BASE = dict(tile_m=128, tile_n=256, tile_k=64, cluster_m=2, cluster_n=1)
TILES = [None, (128, 64)]   # 128x32 measured the same as auto; 64x64 does not build for 2 consumer warp groups


def main() -> None:
    w = WORKLOADS["rope"]
    sets = [make_set(w, 8192, s) for s in (1, 2)]
    for x in sets:
        x["freq_noskip"] = torch.where(x["freq"] == 0, torch.full_like(x["freq"], 1e-30), x["freq"])
    args = [a for a in sets[0] if a not in ("A", "W", "freq_noskip")]
    fns = {"cublas": lambda x: torch.mm(x["A"], x["W"].t())}
    for et in TILES:
        cfg = cc.KernelConfig(**BASE, epilogue_tile=et)
        rope = cc.compile_epilogue(E.rope, torch.bfloat16, config=cfg)
        ident = cc.compile_epilogue(E.identity, torch.bfloat16, config=cfg)
        tag = "auto" if et is None else f"{et[0]}x{et[1]}"
        fns[f"rope_{tag}"] = lambda x, k=rope: k(x["A"], x["W"], raster="m", swizzle=4, **{a: x[a] for a in args})
        fns[f"rope_{tag}_noskip"] = lambda x, k=rope: k(x["A"], x["W"], raster="m", swizzle=4,
                                                      **{a: x[a] for a in args if a != "freq"}, freq=x["freq_noskip"])
        fns[f"identity_{tag}"] = lambda x, k=ident: k(x["A"], x["W"], raster="m", swizzle=4)
    with GpuSampler() as gpu:
        times = interleaved(fns, sets, rounds=4, reps=20)
    for name, us in times.items():
        print(f"{name:16s} {us:8.1f} us  {us / times['cublas']:.3f}x")
    print(gpu.summary())


if __name__ == "__main__":
    main()
