"""FP8 GEMM kernels against torch._scaled_mm (cuBLASLt) of the same shape and scaling, at the
Llama-3-8B and 70B block shapes, all timed in the same run (calls interleaved one by one in a
shuffled order, 2 rotating input sets, CUDA events, medians).

    python bench/fp8_gemm.py OUTDIR                      # M = 8192, every shape and variant
    python bench/fp8_gemm.py OUTDIR --shapes 8b-qkv --rounds 2
    python bench/fp8_gemm.py OUTDIR --wgrad        # the weight-gradient shapes and scalings only

Variants: the identity epilogue with tensor, row and block scaling (each with the promoting and,
where CUTLASS has one, the fast-accumulation mainloop, in a default and an alternative tile), and
two real epilogues (residual + norm statistics with tensor scaling, SwiGLU with block scaling),
each against ``torch._scaled_mm`` with the same scaling and accumulation; block scaling also
against ``_scaled_mm`` tensorwise (the target: <= 1.10x). Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import coda_cutlass as cc  # noqa: E402
from coda_cutlass import epilogues as E  # noqa: E402
from coda_cutlass import fp8  # noqa: E402
from coda_cutlass.timing import interleaved  # noqa: E402
from report import environment, machine_line, require_hopper  # noqa: E402

E4 = torch.float8_e4m3fn
SHAPES = {  # name: (N, K) at the Llama-3 block widths (M = --m), or (M, N, K) of a weight gradient
    "8b-qkv": (6144, 4096), "8b-out": (4096, 4096), "8b-gate-up": (28672, 4096), "8b-down": (4096, 14336),
    "70b-gate-up": (57344, 8192), "70b-down": (8192, 28672),
    # dW = dY^T X with K the tokens (8192): M the layer's outputs, N its inputs
    "8b-qkv-dw": (6144, 4096, 8192), "8b-out-dw": (4096, 4096, 8192), "8b-gate-up-dw": (28672, 4096, 8192),
    "8b-down-dw": (4096, 14336, 8192), "70b-gate-up-dw": (57344, 8192, 8192), "70b-down-dw": (8192, 28672, 8192),
}
WGRAD_SHAPES = [s for s, v in SHAPES.items() if len(v) == 3]
FORWARD_SHAPES = [s for s in SHAPES if s not in WGRAD_SHAPES]
KC = cc.KernelConfig
ALT_PROMOTING = KC(tile_m=64, tile_n=128, tile_k=128, cluster_m=2, cluster_n=1, schedule="pingpong")
ALT_FAST = KC(tile_m=128, tile_n=256, tile_k=128, cluster_m=2, cluster_n=1, schedule="cooperative")

# name: (program, options, the _scaled_mm reference it is compared with, epilogue operands)
VARIANTS: dict[str, tuple[Any, dict[str, Any], str, str]] = {
    "tensor": (E.identity, {"scaling": "tensor"}, "tensorwise", ""),
    "tensor_alt": (E.identity, {"scaling": "tensor", "config": ALT_PROMOTING}, "tensorwise", ""),
    "tensor_fast": (E.identity, {"scaling": "tensor", "fast_accum": True}, "tensorwise_fast", ""),
    "tensor_fast_alt": (E.identity, {"scaling": "tensor", "fast_accum": True, "config": ALT_FAST},
                        "tensorwise_fast", ""),
    "row": (E.identity, {"scaling": "row"}, "rowwise", ""),
    "row_fast": (E.identity, {"scaling": "row", "fast_accum": True}, "rowwise_fast", ""),
    "block": (E.identity, {"scaling": "block"}, "blockwise", ""),
    "block_alt": (E.identity, {"scaling": "block", "config": ALT_PROMOTING}, "blockwise", ""),
    # the weight gradients' scalings (W: an activation's transposed copy), against tensorwise
    "block_1x128": (E.identity, {"scaling": "block_1x128"}, "blockwise_1x128", ""),
    "block_16x128": (E.identity, {"scaling": "block_16x128"}, "tensorwise", ""),
    "norm_stats_tensor": (E.residual_norm_stats, {"scaling": "tensor"}, "tensorwise", "norm_stats"),
    "swiglu_block": (E.swiglu, {"scaling": "block"}, "blockwise", "swiglu"),
}


def kernel_items(variants: list[str] | None = None) -> list[tuple[Any, dict[str, Any]]]:
    """(program, options) of every variant, for cc.compile_many (scripts/gpu_fp8.sh builds them first)."""
    return [(VARIANTS[v][0], {"dtype": E4, **VARIANTS[v][1]}) for v in (variants or list(VARIANTS))]


def scaled_mm(x: dict[str, Any], scaling: str, fast: bool) -> torch.Tensor:
    """torch._scaled_mm with our operands in its layouts (b = W.t(); its 128x128 scale_b is the
    transpose of ours, which is already the (N/128, K/128) row-major tensor it checks; its 1x128
    scale_b is the transpose of our N-major (N, K/128), as cuBLAS reads it)."""
    q = x[scaling]
    sb = q["sb"].t() if scaling in ("block", "block_1x128") else q["sb"]
    return torch._scaled_mm(q["A"], q["W"].t(), scale_a=q["sa"], scale_b=sb, out_dtype=torch.bfloat16,
                            use_fast_accum=fast)


def make_set(M: int, N: int, K: int, seed: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    A = torch.randn(M, K, device="cuda", generator=g) * 0.5
    W = torch.randn(N, K, device="cuda", generator=g) * 0.02
    x: dict[str, Any] = {"resid": torch.randn(M, N, device="cuda", generator=g).bfloat16(),
                         "g": (torch.rand(N, device="cuda", generator=g) + 0.5).bfloat16(),
                         "r": torch.rand(M, device="cuda", generator=g) + 0.5}
    for scaling in ("tensor", "row", "block", "block_1x128", "block_16x128"):
        A8, sa = fp8.quantize(A, E4, scaling, "A")
        W8, sb = fp8.quantize(W, E4, scaling, "W")
        x[scaling] = {"A": A8, "W": W8, "sa": sa, "sb": sb}
    return x


def references(probe: dict[str, Any]) -> tuple[dict[str, Callable[[dict], Any]], dict[str, str]]:
    """The _scaled_mm variants this torch supports here; the others with the reason they fail."""
    fns, unsupported = {}, {}
    for name, scaling, fast in (("tensorwise", "tensor", False), ("tensorwise_fast", "tensor", True),
                                ("rowwise", "row", False), ("rowwise_fast", "row", True),
                                ("blockwise", "block", False), ("blockwise_1x128", "block_1x128", False)):
        fn = (lambda x, s=scaling, f=fast: scaled_mm(x, s, f))
        try:
            fn(probe)
        except Exception as e:  # noqa: BLE001 - an unsupported scaling is reported, not fatal
            unsupported[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        fns[name] = fn
    torch.cuda.synchronize()
    return fns, unsupported


def coda_call(k: Any, scaling: str, epilogue: str) -> Callable[[dict], Any]:
    def call(x: dict) -> Any:
        q = x[scaling]
        ops = {"scale_a": q["sa"], "scale_b": q["sb"]}
        if epilogue == "norm_stats":
            ops.update(resid=x["resid"], g=x["g"])
        elif epilogue == "swiglu":
            ops["r"] = x["r"]
        return k(q["A"], q["W"], **ops)
    return call


def agreement(k_out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |coda - _scaled_mm| / max |_scaled_mm| of one call (both bf16)."""
    return ((k_out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def run(M: int, shapes: list[str], variants: list[str], rounds: int, reps: int,
        done: Callable[[list[dict], dict], None] = lambda rows, unsupported: None) -> tuple[list[dict], dict]:
    """Every shape in turn; ``done(rows, unsupported)`` after each (results survive a cut-short run)."""
    m_default = M
    built = dict(zip(variants, cc.compile_many(kernel_items(variants), skip_failed=True)))
    kernels = {v: k for v, k in built.items() if k is not None}
    if len(kernels) < len(variants):
        print(f"not built (left out): {sorted(set(variants) - set(kernels))}", flush=True)
    variants = [v for v in variants if v in kernels]
    rows, unsupported = [], {}
    for shape in shapes:
        M, N, K = SHAPES[shape] if len(SHAPES[shape]) == 3 else (m_default, *SHAPES[shape])
        sets = [make_set(M, N, K, seed) for seed in (1, 2)]
        refs, unsupported = references(sets[0])
        fns: dict[str, Callable[[dict], Any]] = {f"scaled_mm_{n}": f for n, f in refs.items()}
        agree = {}
        for v in variants:
            opts = VARIANTS[v][1]
            fns[v] = coda_call(kernels[v], opts["scaling"], VARIANTS[v][3])
            ref = VARIANTS[v][2]
            if VARIANTS[v][3] == "" and ref in refs:
                agree[v] = agreement(fns[v](sets[0])["D"], refs[ref](sets[0]))
        times = interleaved(fns, sets, rounds=rounds, reps=reps)
        for v in variants:
            ref = VARIANTS[v][2]
            row = {"M": M, "N": N, "K": K, "shape": shape, "variant": v, "config": kernels[v].config.name(),
                   "us": times[v], "reference": ref, "reference_us": times.get(f"scaled_mm_{ref}"),
                   "tensorwise_us": times.get("scaled_mm_tensorwise"),
                   "tflops": 2 * M * N * K / times[v] / 1e6}
            row["ratio"] = row["us"] / row["reference_us"] if row["reference_us"] else None
            row["ratio_to_tensorwise"] = row["us"] / row["tensorwise_us"] if row["tensorwise_us"] else None
            if v in agree:
                row["max_rel_diff_to_reference"] = agree[v]
            rows.append(row)
            ratio = f"{row['ratio']:.3f}x" if row["ratio"] else "n/a"
            print(f"M={M} {shape:12s} {v:18s} {row['config']:30s} {times[v]:9.1f} us  {ratio} {ref}"
                  + (f"  ({row['ratio_to_tensorwise']:.3f}x tensorwise)" if v.startswith("block") else ""),
                  flush=True)
        for n, t in refs.items():
            rows.append({"M": M, "N": N, "K": K, "shape": shape, "variant": f"scaled_mm_{n}",
                         "us": times[f"scaled_mm_{n}"], "tflops": 2 * M * N * K / times[f"scaled_mm_{n}"] / 1e6})
        del sets
        done(rows, unsupported)
    return rows, unsupported


def write_markdown(rows: list[dict], env: dict, unsupported: dict, path: Path) -> None:
    lines = [f"# FP8 GEMMs vs torch._scaled_mm ({env['date']})", "",
             machine_line(env, "A and W e4m3, bf16 outputs") + "M = tokens. Medians of CUDA-event-timed calls, all variants of a shape interleaved "
             "one by one in a shuffled order over 2 rotating input sets. Ratio: time / torch._scaled_mm of the "
             "same scaling and accumulation (`fast`: use_fast_accum=True); block scaling also / _scaled_mm "
             "tensorwise. Real epilogues are compared with the bare _scaled_mm GEMM.", "",
             "| shape (M x N x K) | variant | config | us | TFLOP/s | reference | ref us | ratio | / tensorwise |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["variant"].startswith("scaled_mm_"):
            continue
        ratio = f"**{r['ratio']:.3f}**" if r.get("ratio") else "n/a"
        tw = f"{r['ratio_to_tensorwise']:.3f}" if r.get("ratio_to_tensorwise") else ""
        ref_us = f"{r['reference_us']:.1f}" if r.get("reference_us") else "n/a"
        lines.append(f"| {r['shape']} {r['M']}x{r['N']}x{r['K']} | {r['variant']} | {r['config']} | {r['us']:.1f} | "
                     f"{r['tflops']:.0f} | {r['reference']} | {ref_us} | {ratio} | {tw} |")
    lines += ["", "torch._scaled_mm alone:", "", "| shape | variant | us | TFLOP/s |", "|---|---|---|---|"]
    lines += [f"| {r['shape']} {r['M']}x{r['N']}x{r['K']} | {r['variant'][10:]} | {r['us']:.1f} | {r['tflops']:.0f} |"
              for r in rows if r["variant"].startswith("scaled_mm_")]
    if unsupported:
        lines += ["", "Not supported by this torch (so not compared):", ""]
        lines += [f"- {n}: {why}" for n, why in unsupported.items()]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="folder for results.json and results.md")
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--shapes", nargs="+", default=FORWARD_SHAPES, choices=list(SHAPES))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--wgrad", action="store_true",
                    help="the weight-gradient shapes (K = 8192 tokens) with tensor, block_1x128 and block_16x128")
    args = ap.parse_args()
    if args.wgrad:
        args.shapes, args.variants = WGRAD_SHAPES, ["tensor", "block_1x128", "block_16x128"]
    require_hopper("bench/fp8_gemm.py")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    def done(rows: list[dict], unsupported: dict) -> None:
        (out / "results.json").write_text(json.dumps({"environment": env, "results": rows,
                                                      "unsupported": unsupported}, indent=1))
        write_markdown(rows, env, unsupported, out / "results.md")

    rows, unsupported = run(args.m, args.shapes, args.variants, args.rounds, args.reps, done)
    (out / "results.json").write_text(json.dumps({"environment": env, "results": rows,
                                                  "unsupported": unsupported}, indent=1))
    write_markdown(rows, env, unsupported, out / "results.md")
    print(f"wrote {out}/results.json, results.md")


if __name__ == "__main__":
    main()
