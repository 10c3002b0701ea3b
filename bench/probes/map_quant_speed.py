"""Standalone speed of the quantising map kernels at Llama-3-8B block shapes (M = 8192) against a
bandwidth reference: torch's own cast of the same tensor to FP8 (reads 2 bytes, writes 1 per
element) and a bf16 copy. Prints us and the effective bandwidth (bytes the kernel must move / time).

    python bench/probes/map_quant_speed.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import coda_cutlass as cc  # noqa: E402
from coda_cutlass import epilogues as E  # noqa: E402
from coda_cutlass.timing import interleaved  # noqa: E402


def main() -> None:
    s = torch.tensor(0.01, device="cuda")
    rows = []
    for M, N, what in ((8192, 28672, "dz"), (8192, 4096, "o / dx"), (8192, 6144, "dqkv")):
        xs = [torch.randn(M, N, device="cuda").to(torch.bfloat16) for _ in range(2)]
        both = cc.compile_map(E.quantize_rows_t, torch.bfloat16)
        rows_only = cc.compile_map(E.quantize_rows, torch.bfloat16)
        tensor_t = cc.compile_map(E.quantize_tensor, torch.bfloat16)
        fns = {"quantize_rows_t": both, "quantize_rows": rows_only,
               "quantize_tensor (+ t)": lambda x: tensor_t(x, s=s),
               "torch cast to e4m3": lambda x: x.to(torch.float8_e4m3fn), "torch bf16 copy": lambda x: x.clone()}
        moved = {"quantize_rows_t": 4, "quantize_rows": 3, "quantize_tensor (+ t)": 4, "torch cast to e4m3": 3,
                 "torch bf16 copy": 4}          # bytes per element that must cross DRAM
        times = interleaved(fns, xs, rounds=3, reps=10)
        for name, t in times.items():
            rows.append((what, M, N, name, t, moved[name] * M * N / t / 1e3))
        del xs
    print("| tensor | M | N | kernel | us | GB/s moved |\n|---|---|---|---|---|---|")
    for what, M, N, name, t, bw in rows:
        print(f"| {what} | {M} | {N} | {name} | {t:.0f} | {bw:.0f} |")


if __name__ == "__main__":
    main()
