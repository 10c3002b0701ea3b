"""How much of each fused kernel's gap to cuBLAS its epilogue's extra HBM bytes explain.

    python bench/byte_bound.py docs/results/block/run15_fwd_tune/results.json [more results.json ...]

Reads bench/block.py results (no GPU needed). For every fused site of the block it counts the bytes
the epilogue moves beyond the bare GEMM's output (coda_cutlass.lower.traffic: C and auxiliary
tiles, the SwiGLU pre-activation, reduction partials) and sets their time at the card's copy
bandwidth beside the measured gap:
- "unhidden bound": 1 + extra bytes' time / cuBLAS time, the ratio if nothing hid the extra bytes;
- "hidden": the share of the extra bytes' time the kernel did not pay (1: all hidden behind the
  mainloop; 0: paid in full; below 0: the kernel lost more than its bytes explain; "-" where the
  epilogue adds no bytes worth a microsecond, e.g. RoPE, or writes fewer than the bare GEMM).
A site whose unhidden bound exceeds 1.05 meets a 1.05 target only by hiding part of its traffic.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coda_cutlass.lower.traffic import epilogue_traffic  # noqa: E402
from coda_cutlass.nn.functional import BlockDims  # noqa: E402
from coda_cutlass.nn.kernels import FORWARD_ONLY, SITES, forward_only_site  # noqa: E402
from coda_cutlass.pipeline import Options, lower_program  # noqa: E402

from block import WIDTHS  # noqa: E402

COPY_BANDWIDTH = 4.25e12   # bytes/s, H200 device-to-device copy (read + write), docs/GPU.md
MIN_EXTRA_US = 1.0         # below this the "hidden" share is noise over nothing: not shown


def gemm_n(site: str, d: BlockDims) -> int:
    """The GEMM's N (accumulator width) at a block site."""
    return {"qkv": d.qkv_width, "o": d.dim, "gate_up": 2 * d.ffn_dim, "down": d.dim, "down.last": d.dim,
            "down.dgrad": d.ffn_dim, "gate_up.dgrad": d.dim, "qkv.dgrad": d.dim}[site.removesuffix(FORWARD_ONLY)]


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    dims, M = BlockDims(**WIDTHS[result["width"]], eps=0.0), result["M"]
    out = []
    for table, forward_only in (("sites", False), ("sites_fwd", True)):
        coda, cublas = result.get(table, {}).get("coda", {}), result.get(table, {}).get("cublas", {})
        for site, us in coda.items():
            base = site.removesuffix(FORWARD_ONLY)     # the cuBLAS skeleton names sites without it
            if site not in SITES or forward_only_site(site) != forward_only or base not in cublas:
                continue
            program, layout = SITES[site]
            graph = lower_program(program, Options.make(torch.bfloat16, layout)).graph
            t = epilogue_traffic(graph, M, gemm_n(site, dims))
            extra_us = t.extra_seconds(COPY_BANDWIDTH) * 1e6
            gap = us - cublas[base]
            out.append({"width": result["width"], "M": M, "site": site, "coda_us": us, "cublas_us": cublas[base],
                        "ratio": us / cublas[base], "extra_mib": t.extra / 2**20, "extra_us": extra_us,
                        "unhidden": 1 + extra_us / cublas[base],
                        "hidden": 1 - gap / extra_us if extra_us >= MIN_EXTRA_US else None})
    return out


def markdown(all_rows: list[dict[str, Any]]) -> str:
    lines = [f"Extra epilogue bytes at {COPY_BANDWIDTH / 1e12:.2f} TB/s against each fused kernel's gap to its "
             "cuBLAS GEMM in the same sequence:\n",
             "| width | M | site | coda us | cuBLAS us | ratio | extra MiB | extra us | unhidden bound | hidden |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in all_rows:
        hidden = "-" if r["hidden"] is None else f"{r['hidden']:.2f}"
        lines.append(f"| {r['width']} | {r['M']} | {r['site']} | {r['coda_us']:.0f} | {r['cublas_us']:.0f} | "
                     f"{r['ratio']:.3f} | {r['extra_mib']:.0f} | {r['extra_us']:.0f} | {r['unhidden']:.3f} | {hidden} |")
    return "\n".join(lines) + "\n"


def read_results(ap: argparse.ArgumentParser, path: Path) -> list[dict[str, Any]]:
    """The "results" list of a bench/block.py results.json; a usage error naming the file otherwise."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        ap.error(f"{path}: {e.strerror or e}")
    except json.JSONDecodeError as e:
        ap.error(f"{path}: not JSON ({e})")
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        ap.error(f"{path}: not a bench/block.py results.json (no 'results' list)")
    return data["results"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="results.json files written by bench/block.py")
    ap.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = ap.parse_args()
    all_rows = [r for p in args.results for res in read_results(ap, p) for r in rows(res)]
    if not all_rows:    # e.g. an FP8 block run: its sites are timed against _scaled_mm, not in these tables
        ap.error("no bf16 fused site with a cuBLAS time in " + ", ".join(map(str, args.results))
                 + " (it reads the 'coda' variant's sites: a run of the bf16 block with --skip coda has none)")
    text = markdown(all_rows)
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
