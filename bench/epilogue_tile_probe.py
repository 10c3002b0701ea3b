"""Probe: what do the RoPE node's shortcuts save, and does an explicit epilogue subtile (instead of
CUTLASS's EpilogueTileAuto) speed up cooperative 128x256 kernels? Times RoPE and identity on the
QKV shape against cuBLAS, calls alternating (bench/pairwise.py's method), with three frequency
vectors on the same kernel:
  rope_*            Llama frequencies: V columns (freq 0) skip the trig, and the second head of each
                    256-wide tile reuses the first head's cos/sin (same angles);
  rope_*_noreuse    odd heads' frequencies scaled by (1 + 1e-6): angles differ, nothing is reused;
  rope_*_noshortcut as noreuse, and V frequencies 1e-30 instead of 0: every pair takes the sincos
                    path (what RoPE cost before either shortcut).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import coda_cutlass as cc  # noqa: E402
from coda_cutlass import epilogues as E  # noqa: E402
from coda_cutlass.timing import interleaved  # noqa: E402
from pairwise import HEAD_DIM, WORKLOADS, make_set  # noqa: E402
from report import GpuSampler, require_hopper  # noqa: E402

BASE = dict(tile_m=128, tile_n=256, tile_k=64, cluster_m=2, cluster_n=1)
TILES = [None, (128, 64)]   # 128x32 measured the same as auto; 64x64 does not build for 2 consumer warp groups


def main() -> None:
    import argparse
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    require_hopper("bench/epilogue_tile_probe.py")
    w = WORKLOADS["rope"]
    sets = [make_set(w, 8192, s) for s in (1, 2)]
    head = torch.arange(sets[0]["freq"].numel(), device="cuda") // HEAD_DIM
    for x in sets:
        odd = (head % 2 == 1).float()
        x["freq_noreuse"] = x["freq"] * (1 + 1e-6 * odd)
        v = torch.where(x["freq"] == 0, 1e-30 * (1 + odd), torch.zeros_like(odd))
        x["freq_noshortcut"] = x["freq_noreuse"] + v
    args = [a for a in sets[0] if a not in ("A", "W") and not a.startswith("freq_")]
    fns = {"cublas": lambda x: torch.mm(x["A"], x["W"].t())}
    for et in TILES:
        cfg = cc.KernelConfig(**BASE, epilogue_tile=et)
        rope = cc.compile_epilogue(E.rope, torch.bfloat16, config=cfg)
        ident = cc.compile_epilogue(E.identity, torch.bfloat16, config=cfg)
        tag = "auto" if et is None else f"{et[0]}x{et[1]}"
        fns[f"rope_{tag}"] = lambda x, k=rope: k(x["A"], x["W"], raster="m", swizzle=4, **{a: x[a] for a in args})
        for variant in ("noreuse", "noshortcut"):
            fns[f"rope_{tag}_{variant}"] = lambda x, k=rope, f=f"freq_{variant}": k(
                x["A"], x["W"], raster="m", swizzle=4, **{a: x[a] for a in args if a != "freq"}, freq=x[f])
        fns[f"identity_{tag}"] = lambda x, k=ident: k(x["A"], x["W"], raster="m", swizzle=4)
    with GpuSampler() as gpu:
        times = interleaved(fns, sets, rounds=4, reps=20)
    for name, us in times.items():
        print(f"{name:22s} {us:8.1f} us  {us / times['cublas']:.3f}x")
    print(gpu.summary())


if __name__ == "__main__":
    main()
