"""Probe: the FP8 quantising epilogues of bench/fp8_quant.py, one launch each at the 8B out-proj
shape (M 8192, N 4096, K 4096), for ncu:

    ncu --clock-control none -k regex:device_kernel --section SpeedOfLight --section WarpStateStats \
        python bench/probes/quant_ncu.py
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import coda_cutlass as cc  # noqa: E402
from fp8_gemm import make_set  # noqa: E402
from fp8_quant import PROGRAMS, kernel_items  # noqa: E402

x = make_set(8192, 4096, 4096, 1)
q = x["block"]
for (name, (program, extra)), (p, opts) in zip(PROGRAMS.items(), kernel_items()):
    k = cc.compile_epilogue(p, **opts)
    ops = {"scale_a": q["sa"], "scale_b": q["sb"]}
    if extra == "norm":
        ops.update(resid=x["resid"], g=x["g"])
    k(q["A"], q["W"], **ops)
    torch.cuda.synchronize()
    print(name, k.config.name(), flush=True)
