"""Probe: what each output of the gate/up epilogue costs, and the half-width store's quad exchange.

In the blockwise FP8 block (fifteenth session, docs/RESULTS.md) the gate/up GEMM with its SwiGLU
epilogue (`swiglu_fp8`: z in bf16, y in bf16 at half width, y^T in FP8 with 128 x 1 scales) ran
2401-2500 us against ~1590 for the same GEMM with an identity epilogue, though its outputs are
only ~0.8 GB (~270 us at DRAM speed). This probe times, in one process (calls interleaved,
medians), the same GEMM with programs that keep some of those outputs, so the difference between
two rows is the cost of one output, and each half-width program twice: with coda::HalfWidthStore's
quad exchange (8-byte stores, the default) and with every value stored on its own (the source
edited to `HalfWidthStore<..., false>`; the values stored are the same, checked bit for bit).

    python bench/probes/epilogue_outputs.py --build     # build the kernels (no GPU needed)
    python bench/probes/epilogue_outputs.py OUTDIR      # H200: check and time; writes results.json

Shapes: Llama-3-8B gate/up, M = 8192 (8192 x 28672 x 4096): FP8 "block" scaling with the shipped
blockwise plan's configuration, and bf16 with the bf16 plan's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import coda_cutlass as cc  # noqa: E402
from coda_cutlass import epilogues as E  # noqa: E402
from coda_cutlass import fp8  # noqa: E402
from coda_cutlass.api import split_options  # noqa: E402
from coda_cutlass.compiler import compile_parallel  # noqa: E402
from coda_cutlass.config import KernelConfig  # noqa: E402
from coda_cutlass.pipeline import generate, lower_program  # noqa: E402

F32 = torch.float32
E4 = torch.float8_e4m3fn
M, N, K = 8192, 28672, 4096
CONFIGS = {"fp8": KernelConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=1, cluster_n=2),
           "bf16": KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=1, cluster_n=2, schedule="pingpong")}


@cc.epilogue
def z_only(acc, r: cc.PerRow(F32)):
    return {"z": acc * r}


@cc.epilogue
def z_y(acc, r: cc.PerRow(F32)):
    z = acc * r
    g, u = cc.pairs(z)
    return {"z": z, "y": cc.half_width(cc.silu(g) * u)}


@cc.epilogue
def z_yt(acc, r: cc.PerRow(F32)):
    z = acc * r
    g, u = cc.pairs(z)
    return {"z": z, "yt": cc.quantize(cc.half_width(cc.silu(g) * u), block=128, transpose=True)}


# name: (dtype kind, program, half-width store edited to store value by value)
VARIANTS: dict[str, tuple[str, Any, bool]] = {
    "fp8 identity": ("fp8", E.identity, False),
    "fp8 z": ("fp8", z_only, False),
    "fp8 z+y": ("fp8", z_y, False),
    "fp8 z+y (scalar y)": ("fp8", z_y, True),
    "fp8 z+yt": ("fp8", z_yt, False),
    "fp8 swiglu_fp8": ("fp8", E.swiglu_fp8, False),
    "fp8 swiglu_fp8 (scalar y)": ("fp8", E.swiglu_fp8, True),
    "bf16 identity": ("bf16", E.identity, False),
    "bf16 swiglu": ("bf16", E.swiglu, False),
    "bf16 swiglu (scalar y)": ("bf16", E.swiglu, True),
}


def scalar_half_store(src: str) -> str:
    out = src.replace("coda::HalfWidthStore<cutlass::bfloat16_t>", "coda::HalfWidthStore<cutlass::bfloat16_t, false>")
    assert out != src, "the generated source has no bf16 HalfWidthStore: update the probe"
    return out


def kernels() -> dict[str, Any]:
    gens = []
    for kind, program, scalar in VARIANTS.values():
        opts = {"dtype": E4, "scaling": "block"} if kind == "fp8" else {"dtype": torch.bfloat16}
        options, _ = split_options({**opts, "config": CONFIGS[kind]})
        gen = generate(lower_program(program, options))
        gens.append((dataclasses.replace(gen, source=scalar_half_store(gen.source)) if scalar else gen, {}))
    return dict(zip(VARIANTS, compile_parallel(gens)))


def make_set(seed: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    A = torch.randn(M, K, device="cuda", generator=g)
    W = torch.randn(N, K, device="cuda", generator=g) * K ** -0.5
    x: dict[str, Any] = {"r": torch.rand(M, device="cuda", generator=g) + 0.5}
    x["A8"], x["sa"] = fp8.quantize(A, E4, "block", "A", pow2=True)
    x["W8"], x["sb"] = fp8.quantize(W, E4, "block", "W", pow2=True)
    x["A16"], x["W16"] = A.to(torch.bfloat16), W.to(torch.bfloat16)
    a8, sa = fp8.quantize(A, E4, "tensor", "A")
    w8, sb = fp8.quantize(W, E4, "tensor", "W")
    x["tensor"] = (a8, w8.t(), sa, sb)
    return x


def call(name: str, k: Any) -> Callable[..., Any]:
    kind, program, _ = VARIANTS[name]
    has_r = program is not E.identity

    def run(x: dict, out: dict | None = None) -> Any:
        ops = {"r": x["r"]} if has_r else {}
        if kind == "fp8":
            return k(x["A8"], x["W8"], scale_a=x["sa"], scale_b=x["sb"], out=out, **ops)
        return k(x["A16"], x["W16"], out=out, **ops)
    return run


def poisoned(like: dict[str, torch.Tensor], names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """NaN-filled copies of the tile outputs ``names`` of a call's result (for out=)."""
    return {n: torch.full_like(like[n], float("nan")) for n in names if n in like}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    ks = kernels()
    if args.build:
        print("built:", ", ".join(ks))
        return
    from report import environment, require_hopper
    from coda_cutlass.timing import interleaved
    require_hopper("bench/probes/epilogue_outputs.py")
    args.out.mkdir(parents=True, exist_ok=True)
    sets = [make_set(seed) for seed in (1, 2)]
    fns = {name: call(name, k) for name, k in ks.items()}
    fns["scaled_mm tensorwise"] = lambda x: torch._scaled_mm(*x["tensor"][:2], scale_a=x["tensor"][2],
                                                           scale_b=x["tensor"][3], out_dtype=torch.bfloat16)
    fns["bf16 mm (cuBLAS)"] = lambda x: x["A16"] @ x["W16"].t()
    # the exchange must store what the value-by-value store does, into poisoned outputs
    same: dict[str, bool] = {}
    for name in ks:
        if name.endswith("(scalar y)"):
            base = name.replace(" (scalar y)", "")
            first = fns[base](sets[0])
            try:
                a = fns[base](sets[0], out=poisoned(first, ("z", "y")))
                b = fns[name](sets[0], out=poisoned(first, ("z", "y")))
            except cc.CallError as e:      # y not accepted as out=: compare fresh outputs
                print(f"{base}: out= refused ({e}); comparing fresh outputs", flush=True)
                a, b = first, fns[name](sets[0])
            same[base] = all(torch.equal(a[o].contiguous().view(torch.uint8), b[o].contiguous().view(torch.uint8)) for o in a)
            y = a["y"].float()
            assert y.abs().max() > 0 and torch.isfinite(y).all(), f"{base}: y is empty or has unwritten (NaN) values"
            print(f"{base}: outputs bit for bit those of the value-by-value store: {same[base]}", flush=True)
    torch.cuda.synchronize()
    t = interleaved(fns, sets, rounds=args.rounds, reps=args.reps)
    for name, us in t.items():
        print(f"{name:28s} {us:8.1f} us", flush=True)
    env = environment()
    (args.out / "results.json").write_text(json.dumps({"environment": env, "M": M, "N": N, "K": K,
                                                       "configs": {k: c.name() for k, c in CONFIGS.items()},
                                                       "us": t, "exchange_matches_scalar": same}, indent=1))
    print(f"wrote {args.out}/results.json")


if __name__ == "__main__":
    main()
