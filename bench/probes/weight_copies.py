"""Probe: the tensorwise FP8 weight copies of one Llama-3-8B block, by the map kernel, by compiled
torch one weight at a time, and by compiled torch the four together (what the blocks do since the
twenty-sixth session): host wall time per remake and the device time per kernel (torch.profiler)."""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from coda_cutlass.nn.fp8.recipe import as_recipe
from coda_cutlass.nn.fp8.weights import Fp8Weights, _per_tensor
from coda_cutlass.nn.runner import KernelRunner

D, F, KV = 4096, 14336, 1024
shapes = {"qkv": (D + 2 * KV, D), "o": (D, D), "down": (D, F), "gate_up": (2 * F, D)}
recipe = as_recipe("tensorwise")
runner = KernelRunner(torch.bfloat16)
ws = {k: torch.randn(s, device="cuda", dtype=torch.bfloat16) / 64 for k, s in shapes.items()}


def remake(run):
    if run == "together":              # as the blocks make them (Fp8Weights.get_all: one compiled call)
        Fp8Weights(recipe).get_all([(w, k == "gate_up") for k, w in ws.items()])
        return
    for k, w in ws.items():
        _per_tensor(w, recipe, k == "gate_up", run)


for name, run in (("map kernel", runner), ("torch", None), ("torch, the four together", "together")):
    for _ in range(3):
        remake(run)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        remake(run)
    torch.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - t) / 10 * 1e3:.2f} ms wall per remake (4 weights)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            remake(run)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    sys.stdout.flush()
