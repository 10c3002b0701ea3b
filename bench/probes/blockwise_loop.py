"""Blockwise-scaled FP8 GEMMs with coda's overlapped consumer loop (coda/block_scaled_mma.hpp, the
default of cooperative tiles) against the same kernel with CUTLASS 4.2's own loop
(CODA_CUTLASS_BLOCKWISE_LOOP=cutlass), and both against
torch._scaled_mm tensorwise and rowwise of the same shape, in one run (calls interleaved one by one
in a shuffled order, 2 rotating input sets, CUDA events, medians). The two loops must agree bit
for bit: the arithmetic is the same, only its schedule differs. Fifteenth session's figures:
docs/RESULTS.md, docs/results/session15/loop/.

    python bench/probes/blockwise_loop.py --build          # build both loops' kernels (no GPU needed)
    python bench/probes/blockwise_loop.py OUTDIR           # H200: check and time

Shapes (M x N x K, Llama-3 8B / 70B widths, 8192 tokens): the forward GEMMs (scaling "block":
1 x 128 A scales, 128 x 128 W scales) and the weight-gradient GEMMs (scaling "block_1x128": both
operands 1 x 128 along K = tokens). Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import coda_cutlass as cc  # noqa: E402
from coda_cutlass import epilogues as E  # noqa: E402
from coda_cutlass import fp8  # noqa: E402
from coda_cutlass.timing import interleaved  # noqa: E402

E4 = torch.float8_e4m3fn
# name: (M, N, K, scaling); wgrad: dW[out, in] = dY^T X, K = tokens
SHAPES = {
    "8b-gate-up": (8192, 28672, 4096, "block"),
    "8b-down": (8192, 4096, 14336, "block"),
    "8b-qkv.wgrad": (6144, 4096, 8192, "block_1x128"),
    "8b-gate-up.wgrad": (28672, 4096, 8192, "block_1x128"),
    "8b-down.wgrad": (4096, 14336, 8192, "block_1x128"),
    "70b-gate-up.wgrad": (57344, 8192, 8192, "block_1x128"),
    "70b-down.wgrad": (8192, 28672, 8192, "block_1x128"),
}


def kernels() -> dict[tuple[str, str], Any]:
    """(scaling, loop) -> the identity epilogue's kernel with coda's loop or CUTLASS's."""
    out = {}
    for scaling in ("block", "block_1x128"):
        for loop, env in (("coda_loop", "overlapped"), ("cutlass_loop", "cutlass")):
            os.environ["CODA_CUTLASS_BLOCKWISE_LOOP"] = env
            out[(scaling, loop)] = cc.compile_epilogue(E.identity, E4, scaling=scaling)
    os.environ.pop("CODA_CUTLASS_BLOCKWISE_LOOP")
    return out


def make_set(M: int, N: int, K: int, scaling: str, seed: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    A = torch.randn(M, K, device="cuda", generator=g)
    W = torch.randn(N, K, device="cuda", generator=g) * 0.05
    x: dict[str, Any] = {}
    x["A"], x["sa"] = fp8.quantize(A, E4, scaling, "A", pow2=True)
    x["W"], x["sb"] = fp8.quantize(W, E4, scaling, "W", pow2=True)
    for s in ("tensor", "row"):
        a8, sa = fp8.quantize(A, E4, s, "A")
        w8, sb = fp8.quantize(W, E4, s, "W")
        x[s] = (a8, w8.t(), sa, sb)
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--build", action="store_true", help="only build the kernels")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    ks = kernels()
    if args.build:
        print("built:", ", ".join(f"{s}/{loop}" for s, loop in ks))
        return
    from report import environment, require_hopper
    require_hopper("bench/probes/blockwise_loop.py")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.shapes:
        M, N, K, scaling = SHAPES[name]
        sets = [make_set(M, N, K, scaling, seed) for seed in (1, 2)]
        fns: dict[str, Callable[[dict], Any]] = {
            loop: (lambda x, k=ks[(scaling, loop)]: k(x["A"], x["W"], scale_a=x["sa"], scale_b=x["sb"])["D"])
            for loop in ("coda_loop", "cutlass_loop")}
        for s in ("tensor", "row"):
            fns[f"scaled_mm_{s}"] = (lambda x, s=s: torch._scaled_mm(x[s][0], x[s][1], scale_a=x[s][2], scale_b=x[s][3],
                                                                   out_dtype=torch.bfloat16))
        ours, theirs = fns["coda_loop"](sets[0]), fns["cutlass_loop"](sets[0])
        ref = fns["scaled_mm_tensor"](sets[0]).float()
        differ = int((ours.view(torch.int16) != theirs.view(torch.int16)).sum())
        rel = ((ours.float() - ref).abs().max() / ref.abs().max()).item()
        torch.cuda.synchronize()
        t = interleaved(fns, sets, rounds=args.rounds, reps=args.reps)
        row = {"shape": name, "M": M, "N": N, "K": K, "scaling": scaling, "us": t,
               "coda_over_cutlass_loop": t["coda_loop"] / t["cutlass_loop"],
               "coda_over_tensorwise": t["coda_loop"] / t["scaled_mm_tensor"],
               "cutlass_over_tensorwise": t["cutlass_loop"] / t["scaled_mm_tensor"],
               "coda_over_rowwise": t["coda_loop"] / t["scaled_mm_row"],
               "elements_differing_between_loops": differ, "max_rel_diff_to_tensorwise": rel}
        rows.append(row)
        print(f"{name:18s} {scaling:12s} coda loop {t['coda_loop']:8.1f} us  cutlass loop {t['cutlass_loop']:8.1f}  "
              f"tensorwise {t['scaled_mm_tensor']:8.1f}  rowwise {t['scaled_mm_row']:8.1f}  "
              f"-> {row['coda_over_cutlass_loop']:.3f}x cutlass loop, {row['coda_over_tensorwise']:.3f}x tensorwise "
              f"(was {row['cutlass_over_tensorwise']:.3f}x); {differ} outputs differ between loops", flush=True)
        del sets
    env = environment()
    (args.out / "results.json").write_text(json.dumps({"environment": env, "results": rows}, indent=1))
    lines = ["| shape | M x N x K | scaling | coda loop us | CUTLASS loop us | _scaled_mm tensorwise us | rowwise us | "
             "coda / CUTLASS loop | coda / tensorwise | CUTLASS loop / tensorwise | outputs differing |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["us"]
        lines.append(f"| {r['shape']} | {r['M']}x{r['N']}x{r['K']} | {r['scaling']} | {t['coda_loop']:.1f} | "
                     f"{t['cutlass_loop']:.1f} | {t['scaled_mm_tensor']:.1f} | {t['scaled_mm_row']:.1f} | "
                     f"{r['coda_over_cutlass_loop']:.3f} | {r['coda_over_tensorwise']:.3f} | "
                     f"{r['cutlass_over_tensorwise']:.3f} | {r['elements_differing_between_loops']} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}/results.json, results.md")


if __name__ == "__main__":
    main()
