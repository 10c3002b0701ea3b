"""Standalone speed of the quantising map kernels at Llama-3-8B block shapes (M = 8192), each two-pass
kernel built twice: as generated (its inputs staged in shared memory once per block) and with the
staging switched off (the second pass re-reads its inputs from L2 / DRAM), timed against each other
and against a bandwidth reference (torch's own cast to FP8: reads 2 bytes, writes 1 per element),
calls interleaved in one process. Checks that both builds write the same bytes. Prints a table and
writes map_speed.json.

With --before DIR, each kernel is also built from DIR/NAME.cu (the source an earlier version of the
library generated, saved with ``cc.emit_map``) and timed in the same rounds as "NAME (before)": a
change to the map kernel template judged against the code it replaces, outputs bit for bit the same.

    python bench/probes/map_quant_speed.py --out /tmp/map            # on the GPU
    python bench/probes/map_quant_speed.py --build-only               # build both variants (no GPU)
    python bench/probes/map_quant_speed.py --before .probe/map_before --out /tmp/map
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import coda_cutlass as cc  # noqa: E402
from coda_cutlass import epilogues as E  # noqa: E402
from coda_cutlass.lower import map as lower_map  # noqa: E402
from coda_cutlass.timing import interleaved  # noqa: E402

SHAPES = ((8192, 28672, "dz"), (8192, 6144, "dqkv"), (8192, 4096, "o / dx / h"))
# (name, program, takes the norm gain g, bytes per element that must cross DRAM)
KERNELS = (("quantize_rows_t", E.quantize_rows_t, False, 4), ("quantize_rows_t_g16", E.quantize_rows_t_g16, False, 4),
           ("norm_stats_fp8", E.norm_stats_fp8, True, 4))


@contextlib.contextmanager
def unstaged() -> Iterator[None]:
    """Kernels rendered inside this context do not stage their inputs (the previous generated code)."""
    prop = lower_map.MapGraph.stage_offsets
    lower_map.MapGraph.stage_offsets = property(lambda self: {})
    try:
        yield
    finally:
        lower_map.MapGraph.stage_offsets = prop


def from_source(program: Any, source_file: Path, label: str) -> Any:
    """The map kernel built from a saved source for ``program`` (an earlier library version's, or a
    hand-written probe variant with the same host ABI)."""
    from coda_cutlass.build.builder import build
    from coda_cutlass.pipeline import Options, typed_ir
    from coda_cutlass.runtime.map_kernel import CompiledMap
    opts = Options.make(torch.bfloat16)
    graph = lower_map.lower_map(typed_ir(program, opts), opts.dtype)
    # the one helper call the template no longer emits (all groups of staged rows landed)
    source = source_file.read_text().replace("coda::map::stage_wait();", "coda::map::stage_commit(); coda::map::stage_wait_pending(0);")
    return CompiledMap(graph, source, build(source, f"{program.name}_{label}", verbose=False))


def builds(variants: dict[str, Path]) -> dict[str, tuple[Any, dict[str, Any], bool, int]]:
    """name -> (the library's kernel, {label: other kernel}, takes g, bytes moved per element)."""
    out = {}
    for name, program, gain, moved in KERNELS:
        others = {label: from_source(program, d / f"{name}.cu", label)
                  for label, d in variants.items() if (d / f"{name}.cu").exists()}
        if not variants:
            with unstaged():
                others["unstaged"] = cc.compile_map(program, torch.bfloat16, verbose=False)
        out[name] = (cc.compile_map(program, torch.bfloat16, verbose=False), others, gain, moved)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--before", type=Path, default=None, help="a folder of NAME.cu sources of an earlier version")
    ap.add_argument("--alt", type=Path, default=None, help="a folder of NAME.cu probe variants (same host ABI)")
    args = ap.parse_args()
    variants = {label: d for label, d in (("before", args.before), ("alt", args.alt)) if d is not None}
    kernels = builds(variants)
    if args.build_only:
        print(f"built {sum(1 + len(k[1]) for k in kernels.values())} map kernels")
        return
    rows: list[dict[str, Any]] = []
    for M, N, what in SHAPES:
        xs = [torch.randn(M, N, device="cuda").to(torch.bfloat16) for _ in range(2)]
        g = torch.rand(N, device="cuda").to(torch.bfloat16) + 0.5
        fns: dict[str, Any] = {"torch cast to e4m3": lambda x: x.to(torch.float8_e4m3fn)}
        moved = {"torch cast to e4m3": 3}
        for name, (staged, others, gain, nbytes) in kernels.items():
            extra = {"g": g} if gain else {}
            a = staged(xs[0], **extra)
            fns[f"{name}"] = lambda x, k=staged, e=extra: k(x, **e)
            moved[name] = nbytes
            for label, other in others.items():
                b = other(xs[0], **extra)
                same = all(torch.equal(a[k].view(torch.uint8) if a[k].element_size() == 1 else a[k],
                                       b[k].view(torch.uint8) if b[k].element_size() == 1 else b[k]) for k in a)
                if not same:
                    raise SystemExit(f"{name} {M}x{N}: the library's and the {label} kernels disagree")
                fns[f"{name} ({label})"] = lambda x, k=other, e=extra: k(x, **e)
                moved[f"{name} ({label})"] = nbytes
        times = interleaved(fns, xs, rounds=5, reps=10)
        for name, t in times.items():
            rows.append({"tensor": what, "M": M, "N": N, "kernel": name, "us": t,
                         "TB/s moved": moved[name] * M * N / t / 1e6})
        del xs
    lines = ["| tensor | M | N | kernel | us | TB/s moved |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['tensor']} | {r['M']} | {r['N']} | {r['kernel']} | {r['us']:.1f} | {r['TB/s moved']:.2f} |"
              for r in rows]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}
        (args.out / "map_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (args.out / "map_speed.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
