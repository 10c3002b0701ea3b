"""FP8 GEMMs whose epilogues quantise their own outputs (cc.quantize) against the same GEMM writing
bf16, and against what they replace: torch._scaled_mm followed by separately compiled quantisation
kernels (torch.compile) of its bf16 output. All variants of a shape in the same run, calls
interleaved one by one in a shuffled order over 2 rotating input sets (CUDA events, medians).

    python bench/fp8_quant.py OUTDIR                 # M = 8192, Llama-3-8B out-proj / down, 70B down
    python bench/fp8_quant.py OUTDIR --shapes 8b-out --rounds 2

Variants (A and W e4m3, blockwise scaling: 1 x 128 A, 128 x 128 W, CUTLASS's blockwise mainloop):
- ``plain``: identity epilogue, bf16 D (the reference of the target);
- ``q``: the output quantised per 1 x 128 run (codes + scales), no bf16 copy;
- ``qt``: the transposed copy alone;
- ``q+qt``: that and the transposed copy with 128 x 1 runs (what a weight-gradient GEMM reads);
- ``norm_bf16`` / ``norm_q+qt``: an FP8 block's out-proj / down-proj epilogue (residual add, the
  next norm's h = x * g and its statistics) writing h in bf16, or quantised with its transposed copy;
- ``scaled_mm+quant``: _scaled_mm (blockwise where this torch has it, else tensorwise: stated)
  then compiled 1 x 128 and 128 x 1 quantisations of its output (fp32 scales).
Target (issue): ``q+qt`` <= 1.08x ``plain``. Writes results.json and results.md.
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
from coda_cutlass.quantization import quantize_blocks  # noqa: E402
from coda_cutlass.timing import interleaved  # noqa: E402
from fp8_gemm import FORWARD_SHAPES, SHAPES, make_set, references  # noqa: E402
from report import environment, machine_line, require_hopper  # noqa: E402

E4 = torch.float8_e4m3fn
DEFAULT_SHAPES = ["8b-out", "8b-down", "70b-down"]


@cc.epilogue
def quant_rows(acc):
    return {"q": cc.quantize(acc, block=128)}


@cc.epilogue
def quant_rows_t(acc):
    return {"q": cc.quantize(acc, block=128), "qt": cc.quantize(acc, block=128, transpose=True)}


@cc.epilogue
def norm_quant(acc, resid: cc.Tile, g: cc.PerCol):
    """The out-proj / down-proj epilogue of an FP8 block: x = acc + resid, the next norm's operand
    h = x * g quantised for the next GEMM (and transposed for its weight gradient), sum x^2."""
    x = acc + resid
    h = x * g
    return {"x": x, "h": cc.quantize(h, block=128), "ht": cc.quantize(h, block=128, transpose=True),
            "sumsq": cc.row_sum(x * x)}


@cc.epilogue
def quant_t(acc):
    return {"qt": cc.quantize(acc, block=128, transpose=True)}


PROGRAMS = {"plain": (E.identity, ""), "q": (quant_rows, ""), "qt": (quant_t, ""), "q+qt": (quant_rows_t, ""),
            "norm_bf16": (E.residual_norm_stats, "norm"), "norm_q+qt": (norm_quant, "norm")}


def kernel_items() -> list[tuple[Any, dict[str, Any]]]:
    return [(p, {"dtype": E4, "scaling": "block", "partial_reductions": True}) for p, _ in PROGRAMS.values()]


def _quant_pair(y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q, s = quantize_blocks(y.float(), E4, 128, pow2=False)
    qt, st = quantize_blocks(y.float().t(), E4, 128, pow2=False)
    return q, s, qt, st


def run(M: int, shapes: list[str], rounds: int, reps: int, done: Callable[[list[dict], dict], None]
        ) -> tuple[list[dict], dict]:
    """Every shape in turn; ``done(rows, notes)`` after each (results survive a cut-short run)."""
    kernels = dict(zip(PROGRAMS, cc.compile_many(kernel_items(), skip_failed=True)))
    missing = [n for n, k in kernels.items() if k is None]
    if missing:
        print(f"not built (left out): {missing}", flush=True)
    quant = torch.compile(_quant_pair, dynamic=False)
    rows, notes = [], {}
    for shape in shapes:
        N, K = SHAPES[shape]
        sets = [make_set(M, N, K, seed) for seed in (1, 2)]
        refs, unsupported = references(sets[0])
        notes.update(unsupported)
        gemm_name = "blockwise" if "blockwise" in refs else "tensorwise"
        gemm = refs[gemm_name]
        fns: dict[str, Callable[[dict], Any]] = {f"scaled_mm_{gemm_name}": gemm,
                                                  "scaled_mm+quant": lambda x, f=gemm: quant(f(x))}
        for name, k in kernels.items():
            if k is None:
                continue
            extra = PROGRAMS[name][1]

            def call(x: dict, k=k, extra=extra) -> Any:
                q = x["block"]
                ops = {"scale_a": q["sa"], "scale_b": q["sb"]}
                if extra == "norm":
                    ops.update(resid=x["resid"], g=x["g"])
                return k(q["A"], q["W"], **ops)
            fns[name] = call
        fns["scaled_mm+quant"](sets[0])          # compile before timing
        torch.cuda.synchronize()
        times = interleaved(fns, sets, rounds=rounds, reps=reps)
        base = times.get("plain")
        for name, t in times.items():
            row = {"M": M, "N": N, "K": K, "shape": shape, "variant": name, "us": t,
                   "config": kernels[name].config.name() if name in kernels and kernels[name] else "",
                   "ratio_to_plain": t / base if base else None,
                   "scaled_mm": gemm_name}
            if name == "norm_q+qt" and "norm_bf16" in times:
                row["ratio_to_norm_bf16"] = t / times["norm_bf16"]
            if name in ("q+qt", "norm_q+qt"):
                row["ratio_to_scaled_mm_quant"] = t / times["scaled_mm+quant"]
            rows.append(row)
            print(f"M={M} {shape:10s} {name:22s} {t:9.1f} us  " +
                  (f"{row['ratio_to_plain']:.3f}x plain" if base else ""), flush=True)
        del sets
        done(rows, notes)
    return rows, notes


def write_markdown(rows: list[dict], env: dict, notes: dict, path: Path) -> None:
    lines = [f"# FP8 GEMMs that quantise their own outputs ({env['date']})", "",
             machine_line(env, "A and W e4m3, blockwise scaling (1x128 A, 128x128 W)") + "M = tokens. Medians of CUDA-event-timed calls, all "
             "variants of a shape interleaved one by one in a shuffled order over 2 rotating input sets.", "",
             "| shape (N x K) | variant | config | us | / plain | / scaled_mm+quant | / norm_bf16 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda k: f"{r[k]:.3f}" if r.get(k) else ""  # noqa: E731
        lines.append(f"| {r['shape']} {r['N']}x{r['K']} | {r['variant']} | {r['config']} | {r['us']:.1f} | "
                     f"{f('ratio_to_plain')} | {f('ratio_to_scaled_mm_quant')} | {f('ratio_to_norm_bf16')} |")
    gemms = sorted({r["scaled_mm"] for r in rows})
    lines += ["", f"scaled_mm+quant: torch._scaled_mm ({', '.join(gemms)}) then torch.compile'd 1 x 128 and "
              "128 x 1 quantisations of its bf16 output (fp32 scales)."]
    if notes:
        lines += ["", "Not supported by this torch:", ""] + [f"- {n}: {w}" for n, w in notes.items()]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="folder for results.json and results.md")
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=FORWARD_SHAPES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    require_hopper("bench/fp8_quant.py")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()

    def done(rows: list[dict], notes: dict) -> None:
        (out / "results.json").write_text(json.dumps({"environment": env, "results": rows, "notes": notes},
                                                     indent=1))
        write_markdown(rows, env, notes, out / "results.md")

    run(args.m, args.shapes, args.rounds, args.reps, done)
    print(f"wrote {out}/results.json, results.md")


if __name__ == "__main__":
    main()
