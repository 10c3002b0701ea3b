"""Probe: the blockwise recipe's operand map kernels, one launch each at Llama-3-8B shapes (M 8192),
beside torch's own cast to e4m3 of the same tensor, for ncu (what limits them: DRAM throughput,
occupancy, warp stalls):

    ncu --clock-control none -k regex:"map_kernel|elementwise" --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        python bench/probes/map_ncu.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import coda_cutlass as cc  # noqa: E402
from coda_cutlass import epilogues as E  # noqa: E402

for M, N, what in ((8192, 28672, "dz"), (8192, 4096, "o")):
    x = torch.randn(M, N, device="cuda").to(torch.bfloat16)
    for name, k in (("quantize_rows_t", cc.compile_map(E.quantize_rows_t, torch.bfloat16)),
                    ("quantize_rows", cc.compile_map(E.quantize_rows, torch.bfloat16))):
        k(x)
        torch.cuda.synchronize()
        print(what, M, N, name, flush=True)
    x.to(torch.float8_e4m3fn)
    torch.cuda.synchronize()
    print(what, M, N, "torch cast", flush=True)
