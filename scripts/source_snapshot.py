"""Emit the generated source of every catalogue program and write {label: sha256 of the source}.

Used to prove a refactor leaves generated kernels byte-identical (compare two snapshots), and by
tests/test_source_snapshot.py (a subset with content keys, committed as
tests/data/source_keys.json, checked in CI).

    python scripts/source_snapshot.py --out before.json [--sources DIR]
    python scripts/source_snapshot.py --compare before.json after.json
    python scripts/source_snapshot.py --keys tests/data/source_keys.json    # after an intended change

The set: every case of tests/catalog.py at its options and at every autotuning candidate config;
the benchmark programs (bench/programs.py, bench/pairwise.py) and every library epilogue at the
default and every candidate, in bf16 and f16, both weight layouts; 200 fuzz programs; a few
explicit configs (fallback tiles, an explicit epilogue tile, stream-K); the map kernel
(cc.emit_map) of every catalogue and library program (an error where maps do not support it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

import torch  # noqa: E402

import coda_cutlass as cc  # noqa: E402
from coda_cutlass.api import GENERATION_OPTIONS, with_candidate_configs  # noqa: E402

EXTRA_CONFIGS = (
    cc.KernelConfig(tile_m=128, tile_n=128, tile_k=64, cluster_m=2, cluster_n=1),
    cc.KernelConfig(tile_m=128, tile_n=64, tile_k=32, cluster_m=2, cluster_n=1),
    cc.KernelConfig(tile_m=128, tile_n=256, tile_k=64, cluster_m=1, cluster_n=1, epilogue_tile=(128, 32)),
    cc.KernelConfig(tile_m=128, tile_n=256, tile_k=64, cluster_m=2, cluster_n=1, scheduler="streamk"),
)


def _label(prog: Any, opts: dict[str, Any]) -> str:
    parts = [getattr(prog, "name", "?")]
    for k in sorted(opts):
        v = opts[k]
        if isinstance(v, cc.KernelConfig):
            v = v.name()
        elif isinstance(v, dict):
            v = ",".join(f"{a}={b}" for a, b in sorted(v.items()))
        parts.append(f"{k}={v}")
    return " ".join(str(p) for p in parts)


GEN_KEYS = GENERATION_OPTIONS


def _library() -> list[Any]:
    """Every epilogue program of the library (coda_cutlass.epilogues)."""
    from coda_cutlass import epilogues as E
    return [getattr(E, n) for n in E.__all__ if isinstance(getattr(E, n), cc.EpilogueProgram)]


def _segment_program(width: int) -> Any:
    def seg(acc, r: cc.PerRow(torch.float32)):
        z = acc * r
        return {"D": z, "ss": cc.segment_sum(z * z, width)}
    return cc.epilogue(seg, name=f"segment_sum_{width}")


SEGMENT_WIDTHS = (16, 32, 64, 96, 128, 192, 256, 384, 512)


def items() -> list[tuple[Any, dict[str, Any]]]:
    import catalog
    import fuzzgen
    import pairwise
    import programs

    base: list[tuple[Any, dict[str, Any]]] = []
    base += [(p, {k: v for k, v in o.items() if k in GEN_KEYS}) for p, o in catalog.PREBUILD]
    library = _library()
    for p in list(programs.PROGRAMS) + [p for p, _ in pairwise.PREBUILD] + library:
        for dt in (torch.bfloat16, torch.float16):
            for wl in ("nk", "kn"):
                base.append((p, {"dtype": dt, "weight_layout": wl}))
    base += [(_segment_program(w), {"dtype": torch.bfloat16}) for w in SEGMENT_WIDTHS]
    out = list(base)
    for it in base:
        if "config" not in it[1]:
            try:
                out += with_candidate_configs([it])
            except cc.CodaError:
                pass
    for p, o in base[:len(catalog.PREBUILD)]:
        if "config" not in o:
            out += [(p, {**o, "config": c}) for c in EXTRA_CONFIGS]
    out += [(p, {k: v for k, v in o.items() if k in GEN_KEYS}) for p, o in fuzzgen.prebuild_items(200)]
    return out


def map_items() -> list[tuple[Any, dict[str, Any]]]:
    import catalog
    library = _library()
    keys = ("dtype", "input_dtypes", "output_dtypes", "constants")
    return ([(p, {k: v for k, v in o.items() if k in keys}) for p, o in catalog.PREBUILD]
            + [(p, {"dtype": dt}) for p in library for dt in (torch.bfloat16, torch.float16)])


def key_items() -> list[tuple[str, Any, Any, dict[str, Any]]]:
    """The committed set (tests/data/source_keys.json): every catalogue case at its options, every
    library epilogue at the default (bf16 nk, f16 kn) and at every candidate config (bf16 nk), the
    segment-width programs, and the map kernel of every library program the map generator takes."""
    import catalog
    library = _library()
    gemm = [(p, {k: v for k, v in o.items() if k in GEN_KEYS}) for p, o in catalog.PREBUILD]
    for p in library:
        gemm += [(p, {"dtype": torch.bfloat16}), (p, {"dtype": torch.float16, "weight_layout": "kn"})]
    gemm += with_candidate_configs([(p, {"dtype": torch.bfloat16}) for p in library])
    gemm += [(_segment_program(w), {"dtype": torch.bfloat16}) for w in SEGMENT_WIDTHS if w != 96]
    jobs = [(_label(p, o), cc.emit, p, o) for p, o in gemm]
    return jobs + [("map " + _label(p, {"dtype": torch.bfloat16}), cc.emit_map, p, {"dtype": torch.bfloat16})
                   for p in library]


def content_keys() -> dict[str, dict[str, str]]:
    """{label: {"source": sha256 of the source, "key": its content key (build/keys.py)}}."""
    from coda_cutlass.build.keys import source_key
    out: dict[str, dict[str, str]] = {}
    for label, emit, prog, opts in key_items():
        try:
            src = emit(prog, **opts)
        except cc.CodaError:     # a library program the map generator does not take
            continue
        out[label] = {"source": hashlib.sha256(src.encode()).hexdigest(), "key": source_key(src)}
    return out


def snapshot(sources_dir: Path | None = None) -> dict[str, str]:
    result: dict[str, str] = {}
    jobs = [(_label(p, o), cc.emit, p, o) for p, o in items()]
    jobs += [("map " + _label(p, o), cc.emit_map, p, o) for p, o in map_items()]
    for label, emit, prog, opts in jobs:
        if label in result:
            continue
        try:
            src = emit(prog, **opts)
        except cc.CodaError as e:
            result[label] = f"error: {type(e).__name__}"
            continue
        digest = hashlib.sha256(src.encode()).hexdigest()
        result[label] = digest
        if sources_dir is not None:
            sources_dir.mkdir(parents=True, exist_ok=True)
            (sources_dir / f"{digest}.cu").write_text(src)
    return result


def compare(a: dict[str, str], b: dict[str, str]) -> int:
    changed = [k for k in a if k in b and a[k] != b[k]]
    only_a = [k for k in a if k not in b]
    only_b = [k for k in b if k not in a]
    same = sum(1 for k in a if k in b and a[k] == b[k])
    errors = sum(1 for k in a if k in b and a[k] == b[k] and a[k].startswith("error"))
    print(f"{same} identical ({errors} of them errors in both), {len(changed)} changed, "
          f"{len(only_a)} only in the first, {len(only_b)} only in the second")
    for k in changed:
        print(f"  changed: {k}: {a[k][:16]} -> {b[k][:16]}")
    for k in only_a:
        print(f"  only first: {k}")
    for k in only_b:
        print(f"  only second: {k}")
    return 1 if changed or only_a or only_b else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--sources")
    ap.add_argument("--compare", nargs=2)
    ap.add_argument("--keys", help="write the committed content-key snapshot to this file")
    args = ap.parse_args()
    if args.keys:
        keys = content_keys()
        Path(args.keys).write_text(json.dumps(keys, indent=1, sort_keys=True) + "\n")
        print(f"{len(keys)} content keys written to {args.keys}")
        return 0
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        return compare(a, b)
    snap = snapshot(Path(args.sources) if args.sources else None)
    Path(args.out).write_text(json.dumps(snap, indent=1, sort_keys=True))
    n_err = sum(v.startswith("error") for v in snap.values())
    print(f"{len(snap)} programs, {len(snap) - n_err} sources, {len(set(snap.values()))} distinct, {n_err} errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
