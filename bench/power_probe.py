"""Energy per GEMM under the power limit: does a CTA tile's energy per FLOP set its speed?

Inside a training step an H200 runs large GEMMs at its 700 W limit, where the SM clock drops until
the power fits. Two kernels doing the same FLOPs then run at the speed their energy per FLOP allows,
not at the speed they reach on a cool card. This probe runs each variant (cuBLAS, and coda's
identity-epilogue GEMM in several tile configurations) sustained, back to back for about
``--block-s`` seconds at a time, the variants in a fresh shuffled order each round, and reads the
board's energy counter (NVML) around each block. Reported per variant: median kernel time, energy
per launch (J), mean board power and the SM clock sampled mid-block.

    python bench/power_probe.py --shapes 70b-gate_up 70b-down --rounds 3 --out probe.json

Each coda configuration first gets its best raster order and swizzle from a short timing of the
runtime choices (no rebuild).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import coda_cutlass as cc  # noqa: E402
from coda_cutlass import epilogues as E  # noqa: E402
from coda_cutlass.timing import time_cuda  # noqa: E402
from coda_cutlass.tuning.space import RUNTIME_CHOICES  # noqa: E402

from report import Nvml, environment, machine_line, require_hopper  # noqa: E402

# (M, N, K) of the block's GEMMs, A (M, K) times W (N, K)^T
SHAPES: dict[str, tuple[int, int, int]] = {
    "70b-gate_up": (8192, 57344, 8192),
    "70b-down": (8192, 8192, 28672),
    "70b-qkv": (8192, 10240, 8192),
    "8b-gate_up": (16384, 28672, 4096),
    "8b-down": (16384, 4096, 14336),
}

CONFIGS = (
    "128x128x64_c1x2_pingpong", "128x128x64_c2x1_pingpong", "128x256x64_c2x1_cooperative",
    "256x128x64_c2x1_cooperative", "256x128x64_c1x2_cooperative", "128x192x64_c2x1_cooperative",
    "128x192x64_c1x2_cooperative", "256x192x64_c2x1_cooperative", "128x192x64_c2x1_pingpong",
    "128x128x128_c1x2_pingpong", "256x128x128_c2x1_cooperative",
)


def coda_variant(name: str, A: torch.Tensor, W: torch.Tensor, out: torch.Tensor) -> Callable[[], Any] | None:
    """coda's identity GEMM in configuration ``name`` with its best runtime choice (None: no build)."""
    try:
        k = cc.compile_epilogue(E.identity, torch.bfloat16, config=cc.KernelConfig.from_name(name))
    except cc.CodaError as e:
        print(f"  {name}: not available ({type(e).__name__}: {str(e).splitlines()[0][:120]})", flush=True)
        return None
    o = {"D": out}
    best = min(RUNTIME_CHOICES, key=lambda rs: time_cuda(
        lambda _: k(A, W, raster=rs[0], swizzle=rs[1], out=o), [None], warmup=2, reps=5))
    return lambda: k(A, W, raster=best[0], swizzle=best[1], out=o)


def run_block(fn: Callable[[], Any], n: int, nvml: Nvml, block_s: float) -> dict[str, float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    with nvml.window() as w:
        for i in range(n):
            starts[i].record()
            fn()
            ends[i].record()
        time.sleep(block_s / 2)     # the launches are queued: read the clock while they run
        clock = nvml.sm_clock_mhz()
    us = statistics.median(s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends))
    return {"us": us, "j_per_call": w["joules"] / n, "watts": w["joules"] / w["seconds"], "mhz": clock}


def probe_shape(shape: str, configs: list[str], rounds: int, block_s: float, nvml: Nvml, seed: int) -> dict[str, Any]:
    M, N, K = SHAPES[shape]
    dev = torch.device("cuda")
    A = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    W = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * K ** -0.5
    out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    variants: dict[str, Callable[[], Any]] = {"cublas": lambda: torch.mm(A, W.t(), out=out)}
    for name in configs:
        fn = coda_variant(name, A, W, out)
        if fn is not None:
            variants[name] = fn
    est = {v: time_cuda(lambda _: fn(), [None], warmup=3, reps=5) for v, fn in variants.items()}
    rng = random.Random(seed)
    samples: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for r in range(rounds):
        order = list(variants)
        rng.shuffle(order)
        for v in order:
            n = max(5, int(block_s * 1e6 / est[v]))
            samples[v].append(run_block(variants[v], n, nvml, block_s))
        print(f"  {shape} round {r + 1}/{rounds} done", flush=True)
    flops = 2.0 * M * N * K
    rows = {}
    for v, s in samples.items():
        row = {k: statistics.median(x[k] for x in s) for k in s[0]}
        row["tflops"] = flops / row["us"] / 1e6
        row["pj_per_flop"] = row["j_per_call"] / flops * 1e12
        rows[v] = row
    base = rows["cublas"]
    for row in rows.values():
        row["time_vs_cublas"] = row["us"] / base["us"]
        row["energy_vs_cublas"] = row["j_per_call"] / base["j_per_call"]
    return {"shape": shape, "M": M, "N": N, "K": K, "variants": rows}


def markdown(results: list[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = ["# Energy per GEMM at the power limit (bench/power_probe.py)", "",
             machine_line(env) + "Identity epilogue; medians over sustained blocks.", ""]
    for res in results:
        lines += [f"## {res['shape']} (M={res['M']}, N={res['N']}, K={res['K']})", "",
                  "| variant | us | time / cuBLAS | J per call | energy / cuBLAS | W | SM MHz | TFLOP/s |",
                  "|---|---|---|---|---|---|---|---|"]
        for v, r in sorted(res["variants"].items(), key=lambda kv: kv[1]["us"]):
            lines.append(f"| {v} | {r['us']:.0f} | {r['time_vs_cublas']:.3f} | {r['j_per_call']:.3f} | "
                         f"{r['energy_vs_cublas']:.3f} | {r['watts']:.0f} | {r['mhz']:.0f} | {r['tflops']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["70b-gate_up", "70b-down"], choices=list(SHAPES))
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block-s", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="directory for results.json and results.md")
    args = ap.parse_args()
    require_hopper("bench/power_probe.py")
    nvml = Nvml()
    # warm the card to its sustained state before the first timed block
    A = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = time.perf_counter()
    while time.perf_counter() - t < 3.0:
        for _ in range(20):
            A @ A
        torch.cuda.synchronize()
    results = [probe_shape(s, args.configs, args.rounds, args.block_s, nvml, args.seed) for s in args.shapes]
    env = environment()
    text = markdown(results, env)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"env": env, "results": results}, indent=1))
        (out / "results.md").write_text(text)


if __name__ == "__main__":
    main()
