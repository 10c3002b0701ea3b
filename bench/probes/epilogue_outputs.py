"""Probe: what each output of a fused FP8 epilogue costs, and A/B of coda header changes.

In the blockwise FP8 block (fifteenth session, docs/RESULTS.md) the gate/up GEMM with its SwiGLU
epilogue (`swiglu_fp8`: z in bf16, y in bf16 at half width, y^T in FP8 with 128 x 1 scales) ran
2401-2500 us against ~1590 for the same GEMM with an identity epilogue, though its outputs are
only ~0.8 GB (~270 us at DRAM speed). This probe times, in one process (calls interleaved,
medians), GEMMs of the block's shapes with programs that keep some of their outputs, so the
difference between two rows of a site is the cost of an output, and:

- each half-width program twice: with coda::HalfWidthStore's quad exchange (8-byte stores, the
  default) and with every value stored on its own (the source edited to
  `HalfWidthStore<..., false>`);
- the tensorwise epilogues with CUTLASS's per-row reductions ("(full checks)": Sm90ColReduction,
  each value's row and column tested) in place of the library's column-checked node
  (templates/coda/row_reduction.hpp, the library's since the twenty-eighth session);
- with ``--baseline DIR``: every kernel whose source includes a coda header found in DIR/coda/ also
  built with that header's text in place of the include (e.g. the previous commit's
  quant_store.hpp: ``git show REV:templates/coda/quant_store.hpp``), timed beside the current one.

Variants of one program must store the same values: checked bit for bit into NaN-poisoned tile
outputs (scales and amaxes included). Each program's operands are made once per input set, outside
the timed calls (until the seventeenth session they were remade, and the program traced, inside
every call: at the out-proj shape that host work outlasted the kernel and inflated its time, e.g.
d_h 555 us timed against 249 us under ncu; docs/RESULTS.md). ``--only LABEL...`` keeps the variants
with those labels ('block d_h').

    python bench/probes/epilogue_outputs.py --build [--baseline DIR] [--sites S...] [--only L...]
    python bench/probes/epilogue_outputs.py OUTDIR [--baseline DIR] [--sites S...] [--only L...]

(--build needs no GPU and prints what ptxas made of each kernel: registers, stack frame, spills;
the second form checks and times on an H200.) ``--baseline DIR`` pastes
DIR/coda/NAME.hpp wherever the source, or a pasted header, includes coda/NAME.hpp: put only the
headers being compared there (both copies of an unchanged header would be defined twice).

Sites (Llama-3-8B widths, M = 8192; the shipped plans' configurations): gate/up 8192 x 28672 x 4096
(FP8 "block" 128 x 128 cooperative; tensorwise 128 x 128 ping-pong with fast accumulation; bf16
128 x 128 ping-pong), down 8192 x 4096 x 14336 and out-proj 8192 x 4096 x 4096 ("block" 128 x 128
cooperative, tensorwise 128 x 128 ping-pong), down dX 8192 x 14336 x 4096 (tensorwise in both schedules,
the ping-pong forms that do not spill (a 64 x 16 epilogue subtile, 64 x 128 and 128 x 64 tiles), one
amax for both halves, "block" with dz in bf16 beside the quantize_rows_t map kernel on it, and the
fused swiglu_backward_fp8).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
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
from coda_cutlass.epilogues.block import swiglu_grads  # noqa: E402

F32 = torch.float32
E4 = torch.float8_e4m3fn
COOP = KernelConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=1, cluster_n=2)
PING8 = KernelConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=1, cluster_n=2, schedule="pingpong")
PING16 = KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=1, cluster_n=2, schedule="pingpong")
KINDS = {"block": ({"dtype": E4, "scaling": "block"}, COOP),
         "tensor": ({"dtype": E4, "scaling": "tensor", "fast_accum": True}, PING8),
         "tensor coop": ({"dtype": E4, "scaling": "tensor", "fast_accum": True}, COOP),
         "bf16": ({"dtype": torch.bfloat16}, PING16),
         "block e128x64": ({"dtype": E4, "scaling": "block"}, dataclasses.replace(COOP, epilogue_tile=(128, 64))),
         # ping-pong forms of the down dX site that ptxas compiles without spills (the 128 x 128 one
         # with the default 64 x 32 subtile keeps a 208-byte stack frame; twenty-fourth session)
         "tensor e64x16": ({"dtype": E4, "scaling": "tensor", "fast_accum": True},
                           dataclasses.replace(PING8, epilogue_tile=(64, 16))),
         "tensor 64x128": ({"dtype": E4, "scaling": "tensor", "fast_accum": True}, dataclasses.replace(PING8, tile_m=64)),
         "tensor 128x64": ({"dtype": E4, "scaling": "tensor", "fast_accum": True}, dataclasses.replace(PING8, tile_n=64))}


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


@cc.epilogue
def residual_h(acc, resid: cc.Tile, g: cc.PerCol):
    x = acc + resid
    return {"D": x, "h": cc.quantize(x * g, block=128)}


@cc.epilogue
def residual_d(acc, resid: cc.Tile):
    return {"D": acc + resid}


@cc.epilogue
def d_h(acc, g: cc.PerCol):
    return {"D": acc, "h": cc.quantize(acc * g, block=128)}


@cc.epilogue
def d_ht(acc, g: cc.PerCol):
    return {"D": acc, "ht": cc.quantize(acc * g, block=128, transpose=True)}


@cc.epilogue
def residual_sumsq(acc, resid: cc.Tile):
    x = acc + resid
    return {"D": x, "sumsq": cc.row_sum(x * x)}


@cc.epilogue
def swiglu_backward_t_rows(acc, z: cc.PairTile, r: cc.PerRow(F32), s: cc.DeviceScalar):
    """E.swiglu_backward_t without the transposed copies (what they cost)."""
    g, u, dg, du = swiglu_grads(acc, z)
    dgr, dur = dg * r, du * r
    return {"dg": cc.quantize(dgr, scale=s), "du": cc.quantize(dur, scale=s), "amax_g": cc.amax(dgr),
            "amax_u": cc.amax(dur), "zdz": cc.row_sum(g * dg + u * du)}


@cc.epilogue
def swiglu_backward_t_one_amax(acc, z: cc.PairTile, r: cc.PerRow(F32), s: cc.DeviceScalar):
    """E.swiglu_backward_t with one amax for both halves (they share one scale): one row reduction
    fewer (ping-pong: 184-byte stack frame against 208)."""
    g, u, dg, du = swiglu_grads(acc, z)
    dgr, dur = dg * r, du * r
    return {"dg": cc.quantize(dgr, scale=s), "dgt": cc.quantize(dgr, scale=s, transpose=True),
            "du": cc.quantize(dur, scale=s), "dut": cc.quantize(dur, scale=s, transpose=True),
            "amax": cc.amax(cc.maximum(cc.abs(dgr), cc.abs(dur))), "zdz": cc.row_sum(g * dg + u * du)}


@cc.epilogue
def swiglu_t_rows(acc, r: cc.PerRow(F32), s: cc.DeviceScalar):
    """E.swiglu_t without y's transposed copy."""
    z = acc * r
    g, u = cc.pairs(z)
    v = cc.silu(g) * u
    return {"z": z, "y": cc.quantize(cc.half_width(v), scale=s), "amax": cc.amax(v)}


@cc.epilogue
def residual_norm_stats_t_rows(acc, resid: cc.Tile, g: cc.PerCol, s: cc.DeviceScalar):
    """E.residual_norm_stats_t without h's transposed copy."""
    x = acc + resid
    h = x * g
    return {"D": x, "h": cc.quantize(h, scale=s), "amax": cc.amax(h), "sumsq": cc.row_sum(x * x)}


# site: (M, N, K, [(kind, program, source edit (EDITS) or None)])
SITES: dict[str, tuple[int, int, int, list[tuple[str, Any, str | None]]]] = {
    "gate_up": (8192, 28672, 4096, [
        ("block", E.identity, None), ("block", z_only, None), ("block", z_y, None), ("block", z_y, "scalar y"),
        ("block", z_yt, None), ("block", E.swiglu_fp8, None), ("block", E.swiglu_fp8, "scalar y"),
        ("tensor", E.identity, None), ("tensor", E.swiglu_t, None), ("tensor", swiglu_t_rows, None),
        ("tensor", E.swiglu_t, "full checks"), ("tensor 128x64", E.identity, None), ("tensor 128x64", E.swiglu_t, None),
        ("bf16", E.identity, None), ("bf16", E.swiglu, None), ("bf16", E.swiglu, "scalar y")]),
    # the down-proj dX GEMM of "tensorwise" (dz's halves, FP8 with both transposed copies)
    "down_dgrad": (8192, 14336, 4096, [
        ("tensor coop", E.identity, None), ("tensor coop", E.swiglu_backward_t, None),
        ("tensor", E.identity, None), ("tensor", E.swiglu_backward_t, None),
        ("tensor coop", swiglu_backward_t_rows, None), ("tensor", swiglu_backward_t_rows, None),
        ("tensor e64x16", E.identity, None), ("tensor e64x16", E.swiglu_backward_t, None),
        ("tensor 64x128", E.identity, None), ("tensor 64x128", E.swiglu_backward_t, None),
        ("tensor 128x64", E.identity, None), ("tensor 128x64", E.swiglu_backward_t, None),
        ("tensor", swiglu_backward_t_one_amax, None), ("tensor coop", swiglu_backward_t_one_amax, None),
        ("tensor", E.swiglu_backward_t, "full checks"), ("tensor coop", E.swiglu_backward_t, "full checks"),
        ("block", E.identity, None), ("block", E.swiglu_backward_scaled, None),
        ("block", E.swiglu_backward_fp8, None)]),   # the fused dz epilogue the recipes do not use
    "down": (8192, 4096, 14336, [
        ("block", E.identity, None), ("block", residual_h, None), ("block", E.residual_norm_stats_fp8, None),
        ("tensor", E.identity, None), ("tensor", E.residual_norm_stats_t, None),
        ("tensor", E.residual_norm_stats_t, "full checks")]),
    "o": (8192, 4096, 4096, [
        ("block", E.identity, None), ("block", residual_h, None), ("block", E.residual_norm_stats_fp8, None),
        ("tensor", E.identity, None), ("tensor", E.residual_norm_stats_t, None),
        ("tensor", residual_norm_stats_t_rows, None), ("tensor", E.residual_norm_stats_t, "full checks")]),
    # the out-proj epilogue taken apart: each output on its own, and a wider epilogue subtile
    "o_parts": (8192, 4096, 4096, [
        ("block", E.identity, None), ("block", residual_d, None), ("block", d_h, None),
        ("block", d_ht, None), ("block", residual_sumsq, None), ("block", E.residual_norm_stats, None),
        ("block", residual_h, None), ("block", E.residual_norm_stats_fp8, None),
        ("block e128x64", E.identity, None), ("block e128x64", residual_h, None),
        ("block e128x64", E.residual_norm_stats_fp8, None)]),
}
# Map kernels timed beside a site's GEMMs: (label, program, columns of X as a multiple of N).
MAPS: dict[str, list[tuple[str, Any, int]]] = {
    "down_dgrad": [("map quantize_rows_t (dz: M x 2N)", E.quantize_rows_t, 2)],
}
# FP8 codes transposed on their own, beside a site's GEMMs: (label, rows, columns) of the codes;
# torch's strided copy and torch.compile's (what moving a transposed copy out of an epilogue costs)
TRANSPOSES: dict[str, list[tuple[str, int]]] = {
    "down_dgrad": [("dz (M x 2N)", 2)], "gate_up": [("y (M x N/2)", 0)], "o": [("h (M x N)", 1)]}
_INCLUDE = re.compile(r'^#include "(coda/[A-Za-z0-9_]+\.hpp)"$', re.M)


def label(kind: str, program: Any, edit: str | None) -> str:
    return f"{kind} {program.name}" + (f" ({edit})" if edit else "")


def scalar_half_store(src: str) -> str:
    out = src.replace("coda::HalfWidthStore<cutlass::bfloat16_t>", "coda::HalfWidthStore<cutlass::bfloat16_t, false>")
    assert out != src, "the generated source has no bf16 HalfWidthStore: update the probe"
    return out


_ROW_REDUCTION = re.compile(r"coda::ColumnCheckedRowReduction<(cutlass::[a-z_]+), TileShape, StridePerRow, RoundStyle>")


def full_checked_reductions(src: str) -> str:
    """Every per-row partial reduction as CUTLASS's own node (row and column tested per value, a
    null-pointer test per visit): the library's form before the twenty-eighth session."""
    out, n = _ROW_REDUCTION.subn(r"fusion::Sm90ColReduction<\n      \1, \1, \1, 0, TileShape, float, ElementCompute,\n"
                                r"      RoundStyle, StridePerRow, 4, /*EnableNullptr=*/true, /*FinalReduction=*/false>", src)
    assert n, "the generated source has no coda::ColumnCheckedRowReduction: update the probe"
    return out


# source edits a variant may name: the same program's kernel, built from an edited source
EDITS: dict[str, Callable[[str], str]] = {"scalar y": scalar_half_store, "full checks": full_checked_reductions}


def with_baseline(src: str, baseline: Path) -> str | None:
    """``src`` with each coda header that ``baseline`` holds pasted in place of its include, also
    where a pasted header includes another (once each, as #pragma once would); None when it
    includes none of them."""
    hit = False
    pasted: set[str] = set()

    def paste(m: re.Match) -> str:
        nonlocal hit
        path = baseline / m.group(1)
        if not path.is_file():
            return m.group(0)
        hit = True
        if m.group(1) in pasted:
            return f"// ---- baseline {m.group(1)} (above)"
        pasted.add(m.group(1))
        text = path.read_text().replace("#pragma once", "")
        return f"// ---- baseline {m.group(1)}\n" + _INCLUDE.sub(paste, text)
    out = _INCLUDE.sub(paste, src)
    return out if hit else None


def variants_of(site: str, only: list[str] | None) -> list[tuple[str, Any, str | None]]:
    """The site's variants, or those whose label ``only`` names."""
    return [v for v in SITES[site][3] if not only or label(*v) in only]


def kernels(baseline: Path | None, sites: list[str], only: list[str] | None = None) -> dict[tuple[str, str], Any]:
    """(site, variant label) -> kernel."""
    names, gens = [], []
    for site in sites:
        for kind, program, edit in variants_of(site, only):
            opts, config = KINDS[kind]
            options, _ = split_options({**opts, "config": config})
            gen = generate(lower_program(program, options))
            if edit:
                gen = dataclasses.replace(gen, source=EDITS[edit](gen.source))
            names.append((site, label(kind, program, edit)))
            gens.append((gen, {}))
            old = with_baseline(gen.source, baseline) if baseline else None
            if old is not None:
                names.append((site, label(kind, program, edit) + " (baseline)"))
                gens.append((dataclasses.replace(gen, source=old), {}))
    return dict(zip(names, compile_parallel(gens)))


def operands(program: Any, M: int, N: int, g: torch.Generator) -> dict[str, Any]:
    ops: dict[str, Any] = {}
    for o in program.trace().operands:
        if o.kind.value == "tile":
            cols = 2 * N if o.packed else N      # cc.PairTile: M x 2N interleaved pairs
            ops[o.name] = torch.randn(M, cols, device="cuda", generator=g).to(torch.bfloat16)
        elif o.kind.value == "row":
            ops[o.name] = torch.rand(M, device="cuda", generator=g) + 0.5
        elif o.kind.value == "col":
            ops[o.name] = (torch.rand(N, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
        elif o.kind.value == "scalar" and o.device:
            ops[o.name] = torch.tensor(2.0 ** -4, device="cuda")
        else:
            raise ValueError(f"{program.name}: no input rule for operand {o}")
    return ops


def make_set(M: int, N: int, K: int, seed: int) -> dict[str, Any]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    A = torch.randn(M, K, device="cuda", generator=g)
    W = torch.randn(N, K, device="cuda", generator=g) * K ** -0.5
    x: dict[str, Any] = {"gen": g, "M": M, "N": N}
    x["block"] = fp8.quantize(A, E4, "block", "A", pow2=True) + fp8.quantize(W, E4, "block", "W", pow2=True)
    x["tensor"] = fp8.quantize(A, E4, "tensor", "A", pow2=True) + fp8.quantize(W, E4, "tensor", "W", pow2=True)
    x["bf16"] = (A.to(torch.bfloat16), W.to(torch.bfloat16))
    x["ops"] = {}
    return x


def call(kind: str, program: Any, k: Any) -> Callable[..., Any]:
    def run(x: dict, out: dict | None = None) -> Any:
        if program.name not in x["ops"]:     # made once per input set: not timed
            x["ops"][program.name] = operands(program, x["M"], x["N"], x["gen"])
        ops = x["ops"][program.name]
        if kind.split()[0] == "bf16":
            return k(*x["bf16"], out=out, **ops)
        a8, sa, w8, sb = x[kind.split()[0]]     # "block e128x64", "tensor coop": the block / tensor operands
        return k(a8, w8, scale_a=sa, scale_b=sb, out=out, **ops)
    return run


def same_outputs(fns: list[Callable[..., Any]], x: dict, tile_outputs: list[str]) -> bool:
    """Every variant's outputs bit for bit the first's, written into NaN-poisoned tile outputs, and
    each variant's outputs the same in a second run (a kernel with a race can match another once;
    docs/RESULTS.md, twenty-second session)."""
    first = fns[0](x)
    outs = []
    for fn in fns:
        poison = {n: torch.full_like(first[n], float("nan")) for n in tile_outputs if n in first}
        try:
            outs.append(fn(x, out=poison))
        except cc.CallError as e:       # an output out= does not take: compare fresh outputs
            print(f"  (out= refused: {e}; fresh outputs)", flush=True)
            outs.append(fn(x))
    bits = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    again = [fn(x) for fn in fns]
    steady = all(torch.equal(bits(a[n]), bits(o[n])) for a, o in zip(again, outs) for n in o)
    if not steady:
        print("  a variant's outputs changed between two runs", flush=True)
    return steady and all(torch.equal(bits(o[n]), bits(outs[0][n])) for o in outs[1:] for n in outs[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--baseline", type=Path, help="a folder holding coda/*.hpp headers to build baselines from")
    ap.add_argument("--sites", nargs="+", default=list(SITES), choices=list(SITES))
    ap.add_argument("--only", nargs="+", help="only the variants with these labels, e.g. 'block d_h'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    ks = kernels(args.baseline, args.sites, args.only)
    maps = {(site, name): cc.compile_map(program, torch.bfloat16)
            for site in args.sites for name, program, _ in MAPS.get(site, []) if not args.only or name in args.only}
    if args.build:      # what ptxas made of each kernel (no GPU needed): spills show here first
        for (s, n), k in ks.items():
            r = k.resources
            print(f"built {s}: {n}: {r.describe() if r else 'no ptxas record (cached by an older coda-cutlass)'}")
        return
    from report import environment, require_hopper
    from coda_cutlass.timing import interleaved
    require_hopper("bench/probes/epilogue_outputs.py")
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for site in args.sites:
        M, N, K, _ = SITES[site]
        variants = variants_of(site, args.only)
        sets = [make_set(M, N, K, seed) for seed in (1, 2)]
        fns: dict[str, Callable[..., Any]] = {}
        same: dict[str, bool] = {}
        for kind, program, edit in variants:
            name = label(kind, program, edit)
            group = [n for n in (name, name + " (baseline)") if (site, n) in ks]
            for n in group:
                fns[n] = call(kind, program, ks[(site, n)])
            base = label(kind, program, None)
            if edit or len(group) > 1:
                tiles = [n for n, _ in ks[(site, name)].spec.tile_outputs]
                check = [fns[n] for n in group] + ([fns[base]] if edit else [])
                same[name] = same_outputs(check, sets[0], tiles)
                print(f"{site} {name}: outputs bit for bit the same across {len(check)} variants and runs: {same[name]}",
                      flush=True)
        fns["scaled_mm tensorwise"] = lambda x: torch._scaled_mm(x["tensor"][0], x["tensor"][2].t(),
                                                               scale_a=x["tensor"][1], scale_b=x["tensor"][3],
                                                               out_dtype=torch.bfloat16)
        fns["bf16 mm (cuBLAS)"] = lambda x: x["bf16"][0] @ x["bf16"][1].t()
        for name, _, cols in MAPS.get(site, []):
            if (site, name) in maps:
                for x in sets:
                    x[name] = torch.randn(M, cols * N, device="cuda", generator=x["gen"]).to(torch.bfloat16)
                fns[name] = lambda x, k=maps[(site, name)], name=name: k(x[name])
        for name, mult in TRANSPOSES.get(site, []):
            cols = mult * N if mult else N // 2
            for x in sets:
                x[name] = torch.randint(0, 120, (M, cols), device="cuda", dtype=torch.uint8,
                                        generator=x["gen"]).view(E4)
            compiled = torch.compile(lambda t: t.t().contiguous())
            fns[f"transpose {name} torch"] = lambda x, name=name: x[name].view(torch.uint8).t().contiguous()
            fns[f"transpose {name} compiled"] = lambda x, name=name, c=compiled: c(x[name].view(torch.uint8))
        torch.cuda.synchronize()
        t = interleaved(fns, sets, rounds=args.rounds, reps=args.reps)
        for name, us in t.items():
            print(f"{site:8s} {name:44s} {us:8.1f} us", flush=True)
        results[site] = {"M": M, "N": N, "K": K, "us": t, "same_outputs": same}
        del sets
    env = environment()
    (args.out / "results.json").write_text(json.dumps({"environment": env, "configs": {
        k: c.name() for k, (_, c) in KINDS.items()}, "baseline": str(args.baseline or ""), "sites": results},
        indent=1))
    print(f"wrote {args.out}/results.json")


if __name__ == "__main__":
    main()
