"""Sweep kernel configurations for a program over the Llama shapes: the best raster/swizzle time of
each config as a ratio to cuBLAS measured alongside. For choosing the autotuner's candidate space.

    python bench/config_sweep.py --programs identity norm_stats --extra 64x256x64_c2x1_pingpong
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import coda_cutlass as cc  # noqa: E402
from report import require_hopper  # noqa: E402
from coda_cutlass.timing import time_cuda  # noqa: E402
from coda_cutlass.tuning import TunedEpilogue  # noqa: E402
from coda_cutlass.tuning.space import CANDIDATES  # noqa: E402

from run import EPILOGUES, SHAPES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--programs", nargs="+", default=["identity", "norm_stats"], choices=list(EPILOGUES))
    ap.add_argument("--extra", nargs="*", default=[], help="configs beyond the candidate space")
    ap.add_argument("--m", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_hopper("bench/config_sweep.py")
    configs = list(CANDIDATES) + [cc.KernelConfig.from_name(x) for x in args.extra]
    rows = []
    for name in args.programs:
        prog = EPILOGUES[name][0]
        tuned = cc.compile_epilogue(prog, torch.bfloat16, config="tune")
        assert isinstance(tuned, TunedEpilogue)
        tuned.candidates = configs
        for M in args.m:
            for shape, (N, K) in SHAPES.items():
                rec = tuned.tune(M, N, K, torch.device("cuda"))
                sets = [tuned._inputs(M, N, K, torch.device("cuda"), s) for s in (1, 2)]
                cublas = time_cuda(lambda s: torch.mm(s[0], s[1].t()), sets, reps=20)
                best: dict[str, float] = {}
                for t in rec["timings"]:
                    c = cc.KernelConfig.from_dict(t["config"]).name()
                    best[c] = min(best.get(c, float("inf")), t["us"])
                row = {"program": name, "M": M, "shape": shape, "cublas_us": cublas,
                       "ratio": {c: us / cublas for c, us in sorted(best.items(), key=lambda kv: kv[1])}}
                rows.append(row)
                top = list(row["ratio"].items())[:4]
                print(f"{name:10s} M={M:5d} {shape:8s} " + " | ".join(f"{c} {r:.3f}" for c, r in top), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
