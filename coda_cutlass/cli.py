"""Command line: ``python -m coda_cutlass <command>``.

    demo                      the main job: trace, validate, generate, compile and check a fused
                              kernel; on a Hopper GPU also run it and time it against cuBLAS
    emit FILE:PROGRAM         print the generated CUDA of a program
    prebuild FILE --out DIR   compile every program of a file (or its PREBUILD list) and export
                              them as prebuilt kernels
    cache                     show the kernel cache location and size
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def load_module(spec: str) -> Any:
    """A Python file path or an importable module name."""
    path = Path(spec)
    if path.suffix == ".py" and path.is_file():
        sys.path.insert(0, str(path.resolve().parent))
        mspec = importlib.util.spec_from_file_location(path.stem, path)
        assert mspec and mspec.loader
        mod = importlib.util.module_from_spec(mspec)
        sys.modules[path.stem] = mod
        mspec.loader.exec_module(mod)
        return mod
    return importlib.import_module(spec)


def programs_of(mod: Any) -> list[tuple[Any, dict[str, Any]]]:
    from .frontend.trace import EpilogueProgram
    if hasattr(mod, "PREBUILD"):
        return [(p, dict(o)) for p, o in mod.PREBUILD]
    return [(v, {}) for v in vars(mod).values() if isinstance(v, EpilogueProgram)]


def cmd_emit(args: argparse.Namespace) -> int:
    import torch
    from .api import emit
    file, _, name = args.target.partition(":")
    mod = load_module(file)
    progs = {p.name: p for p, _ in programs_of(mod)}
    if name not in progs:
        print(f"no program '{name}' in {file}; programs: {', '.join(sorted(progs))}", file=sys.stderr)
        return 2
    print(emit(progs[name], getattr(torch, args.dtype), weight_layout=args.weight_layout), end="")
    return 0


def cmd_prebuild(args: argparse.Namespace) -> int:
    from .api import compile_many
    from .build.export import export_prebuilt, export_sources
    items = programs_of(load_module(args.file))
    if not items:
        print(f"no epilogue programs in {args.file}", file=sys.stderr)
        return 2
    if args.sources_only:
        from .api import emit_many
        for path in export_sources(emit_many(items), args.out):
            print(path)
        return 0
    if args.all_candidates:     # every autotuning candidate config of every program
        from .api import with_candidate_configs
        items = with_candidate_configs(items)
    kernels = compile_many(items, jobs=args.jobs)
    for k in kernels:
        path = export_prebuilt(k, args.out)
        print(f"{k.name}: {path}")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from .build.cache import KernelCache, default_root
    root = default_root()
    entries = list((root / "kernels").glob("*/*")) if (root / "kernels").is_dir() else []
    size = sum(f.stat().st_size for e in entries for f in e.rglob("*") if f.is_file())
    print(f"cache: {root}\nkernels: {len(entries)}\nsize: {size / 1e6:.1f} MB")
    if args.export:
        from .build.export import export_cache_entry
        cache = KernelCache(root)
        n = sum(export_cache_entry(cache, e.name, args.export) for e in entries)
        print(f"exported {n} verified kernels as prebuilt kernels to {args.export}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import main
    return main(quick=args.quick)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m coda_cutlass", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="the main job (see README)")
    p.add_argument("--quick", action="store_true", help="smaller timing runs")
    p.set_defaults(fn=cmd_demo)
    p = sub.add_parser("emit", help="print the generated CUDA of FILE:PROGRAM")
    p.add_argument("target")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--weight-layout", default="nk", choices=["nk", "kn"])
    p.set_defaults(fn=cmd_emit)
    p = sub.add_parser("prebuild", help="compile and export prebuilt kernels")
    p.add_argument("file")
    p.add_argument("--out", required=True)
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--all-candidates", action="store_true",
                   help="build every autotuning candidate configuration (tuning then needs no nvcc)")
    p.add_argument("--sources-only", action="store_true",
                   help="write the generated .cu files (and headers) for CMakeLists.txt instead of compiling")
    p.set_defaults(fn=cmd_prebuild)
    p = sub.add_parser("cache", help="show the kernel cache")
    p.add_argument("--export", metavar="DIR", help="copy every verified kernel out as a prebuilt kernel")
    p.set_defaults(fn=cmd_cache)
    args = parser.parse_args(argv)
    return args.fn(args)
