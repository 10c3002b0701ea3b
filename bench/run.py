"""The benchmark suite (issue 3): fused GEMM + epilogue kernels against bare cuBLAS, our own identity
epilogue, eager PyTorch and torch.compile doing the same work, on Llama-3-8B shapes, all timed in
the same run (calls interleaved one by one in a shuffled order, rotating input sets, CUDA events,
medians).

    python bench/run.py --out bench/results            # everything (tunes on first use)
    python bench/run.py --m 8192 --epilogues identity norm_stats --no-tune

Writes results.json, results.md and results.png (time ratio to bare cuBLAS per workload).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coda_cutlass as cc  # noqa: E402
from coda_cutlass import epilogues as E  # noqa: E402
from coda_cutlass.timing import interleaved, sustained  # noqa: E402
from report import (GpuSampler, config_label, environment, machine_line, ratio_bars,  # noqa: E402
                    require_hopper, write_results)

D_MODEL, FFN, QKV = 4096, 14336, 6144
SHAPES = {  # name: (N, K)
    "out-proj": (D_MODEL, D_MODEL),
    "gate/up": (2 * FFN, D_MODEL),
    "down": (D_MODEL, FFN),
    "qkv": (QKV, D_MODEL),
}


def _eager_identity(x: dict) -> Any:
    return x["A"] @ x["W"].t()


def _eager_residual(x: dict) -> Any:
    return x["A"] @ x["W"].t() + x["resid"]


def _eager_norm_stats(x: dict) -> Any:
    h = x["A"] @ x["W"].t() + x["resid"]
    return h, h * x["g"], h.float().pow(2).sum(-1)


def _eager_rowscale_silu(x: dict) -> Any:
    y = (x["A"] @ x["W"].t()).float() * x["r"][:, None]
    return (F.silu(y) * x["up"]).to(x["A"].dtype)


def _eager_bias_gelu(x: dict) -> Any:
    return F.gelu(x["A"] @ x["W"].t() + x["bias"])


# name: (program, eager function, operand makers)
EPILOGUES: dict[str, tuple[Any, Callable[[dict], Any], dict[str, str]]] = {
    "identity": (E.identity, _eager_identity, {}),
    "residual": (E.residual_add, _eager_residual, {"resid": "tile"}),
    "norm_stats": (E.residual_norm_stats, _eager_norm_stats, {"resid": "tile", "g": "col"}),
    "rowscale_silu_gate": (E.rowscale_silu, _eager_rowscale_silu, {"r": "row32", "up": "tile"}),
    "bias_gelu": (E.bias_gelu, _eager_bias_gelu, {"bias": "col"}),
}


def make_set(M: int, N: int, K: int, operands: dict[str, str], seed: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16
    x = {"A": (torch.randn(M, K, device="cuda", generator=g) * 0.5).to(bf),
         "W": (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(bf)}
    for name, kind in operands.items():
        if kind == "tile":
            x[name] = torch.randn(M, N, device="cuda", generator=g).to(bf)
        elif kind == "col":
            x[name] = (torch.rand(N, device="cuda", generator=g) + 0.5).to(bf)
        elif kind == "row32":
            x[name] = torch.rand(M, device="cuda", generator=g) + 0.5
    return x


def run(ms: list[int], epilogue_names: list[str], shape_names: list[str], tune: bool, rounds: int
        ) -> list[dict[str, Any]]:
    config = "tune" if tune else None
    kernels = {name: cc.compile_epilogue(EPILOGUES[name][0], torch.bfloat16, config=config)
               for name in set(epilogue_names) | {"identity"}}
    compiled = {name: torch.compile(EPILOGUES[name][1], dynamic=True) for name in epilogue_names}
    rows = []
    for M in ms:
        for shape in shape_names:
            N, K = SHAPES[shape]
            for name in epilogue_names:
                prog, eager, operands = EPILOGUES[name]
                sets = [make_set(M, N, K, operands, seed) for seed in (1, 2)]
                fused, ident = kernels[name], kernels["identity"]
                args = list(operands)
                fns = {
                    "cublas": lambda x: torch.mm(x["A"], x["W"].t()),
                    "coda_identity": lambda x: ident(x["A"], x["W"]),
                    "coda_fused": lambda x, k=fused: k(x["A"], x["W"], **{a: x[a] for a in args}),
                    "eager": eager,
                    "torch_compile": compiled[name],
                }
                if tune:    # tune (or load the stored choice) before anything is timed
                    fused.choice(sets[0]["A"], sets[0]["W"])
                    ident.choice(sets[0]["A"], sets[0]["W"])
                with GpuSampler() as gpu:   # per row: cuBLAS itself moves with the clock (docs/RESULTS.md)
                    times = interleaved(fns, sets, rounds=rounds)
                    # the sustained figure: each of cuBLAS and the fused kernel in long runs of itself
                    held = sustained({k: fns[k] for k in ("cublas", "coda_fused")}, sets)
                row = {"M": M, "N": N, "K": K, "shape": shape, "epilogue": name, "us": times,
                       "ratio": {k: v / times["cublas"] for k, v in times.items()}, "gpu": gpu.summary(),
                       "sustained_us": held, "sustained_ratio": held["coda_fused"] / held["cublas"]}
                if tune:
                    row["config"] = fused.choice(sets[0]["A"], sets[0]["W"])
                    row["config"] = {k: row["config"][k] for k in ("config", "raster", "swizzle", "tuned")}
                rows.append(row)
                r = row["ratio"]
                print(f"M={M:5d} {shape:8s} {name:18s} cuBLAS {times['cublas']:8.1f} us | fused {r['coda_fused']:.3f}x"
                      f" (sustained {row['sustained_ratio']:.3f}x)"
                      f" identity {r['coda_identity']:.3f}x eager {r['eager']:.3f}x compile {r['torch_compile']:.3f}x",
                      flush=True)
                del sets
    return rows


def write_markdown(rows: list[dict[str, Any]], env: dict[str, Any], path: Path) -> None:
    lines = [f"# coda-cutlass benchmark ({env['date']})", "",
             machine_line(env) +
             "Times are medians of CUDA-event-timed calls queued back to back over 2 rotating input sets, "
             "one by one in a freshly shuffled order every pass; "
             "ratios are to bare cuBLAS (`torch.mm`) of the same GEMM in the same run. "
             f"GPU during the run: {env.get('gpu_state', 'not sampled')} (per row: `gpu` in results.json).", "",
             "The sustained column times cuBLAS and the fused kernel each in long runs of itself (bursts of 40 "
             "back-to-back calls, the GPU at its power limit as inside a block's sequence of GEMMs); "
             "bench/block.py measures the kernels in the block's own sequence.", "",
             "| M | GEMM (N x K) | epilogue | cuBLAS us | coda identity | coda fused | fused, sustained | eager | "
             "torch.compile | config |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = r["ratio"]
        cfg = config_label(r.get("config"))
        lines.append(f"| {r['M']} | {r['shape']} {r['N']}x{r['K']} | {r['epilogue']} | {r['us']['cublas']:.1f} | "
                     f"{q['coda_identity']:.3f} | **{q['coda_fused']:.3f}** | {r['sustained_ratio']:.3f} | {q['eager']:.3f} | "
                     f"{q['torch_compile']:.3f} | {cfg} |")
    path.write_text("\n".join(lines) + "\n")


def write_plot(rows: list[dict[str, Any]], path: Path) -> None:
    ratio_bars(rows, [f"{r['shape']} M={r['M']//1024}k\n{r['epilogue']}" for r in rows],
               [("coda_fused", "coda fused"), ("coda_identity", "coda identity"), ("torch_compile", "torch.compile"),
                ("eager", "eager")],
               "Fused GEMM + epilogue vs bare cuBLAS (H200, bf16, Llama-3-8B shapes)", path,
               figsize=(max(10, len(rows) * 0.55), 5.5), rotation=90, fontsize=7,
               ylim=(0.8, max(2.0, max(r["ratio"]["eager"] for r in rows) * 1.05)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--m", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--epilogues", nargs="+", default=list(EPILOGUES), choices=list(EPILOGUES))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--no-tune", action="store_true", help="use the heuristic default config")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    require_hopper("bench/run.py")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    with GpuSampler() as sampler:
        rows = run(args.m, args.epilogues, args.shapes, not args.no_tune, args.rounds)
    env["gpu_state"] = sampler.summary()
    write_results(out, env, rows, write_markdown, write_plot)


if __name__ == "__main__":
    main()
