"""Command line: ``python -m coda_cutlass <command>``.

    demo                      the main job: trace, validate, generate, compile and check a fused
                              kernel; on a Hopper GPU also run it and time it against cuBLAS
    emit FILE:PROGRAM         print the generated CUDA of a program
    prebuild FILE --out DIR   compile every program of a file (or its PREBUILD list) and export
                              them as prebuilt kernels
    cache                     show the kernel cache location and size

FILE is a path to a .py file or an importable module (``coda_cutlass.epilogues``). A mistake on the
user's side (a typo, a missing file, a file that fails to load, a program the compiler rejects, no
toolchain) prints an ``error:`` message without a traceback (one line, except the errors that list
where they looked) and exits with status 2; ``--debug`` (or ``CODA_CUTLASS_DEBUG=1``) shows the
traceback too (the variable takes 1/0, true/false, yes/no, on/off).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import importlib
import importlib.util
import os
import re
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, NoReturn

USER_ERROR = 2


class UserError(Exception):
    """Something the user can fix; printed as one line without a traceback."""


class Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line in one line, with a suggestion for a misspelt word."""

    def error(self, message: str) -> NoReturn:
        m = re.search(r"invalid choice: (.*) \(choose from (.*)\)", message)
        if m:       # (Python versions differ in how they quote the choices)
            choices = [c.strip().strip("'\"") for c in m.group(2).split(",")]
            close = difflib.get_close_matches(m.group(1).strip("'\""), choices, n=1)
            message += f"; did you mean '{close[0]}'?" if close else ""
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(USER_ERROR)


def _private_name(path: Path) -> str:
    """A module name no other module has: a user's math.py must not replace the real math."""
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    return f"_coda_cutlass_user_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}_{digest}"


_USER_FILES: set[str] = set()     # files loaded for the user: errors raised in them are the user's


def load_module(spec: str) -> Any:
    """A Python file path (loaded under a private module name) or an importable module name."""
    path = Path(spec)
    if path.is_file() and not spec.endswith(".py"):
        raise UserError(f"{spec} is not a Python file: FILE is a .py file or a module name")
    if spec.endswith(".py") or os.sep in spec:
        if not path.is_file():
            raise UserError(f"no such file: {spec}")
        path = path.resolve()
        name = _private_name(path)
        if name in sys.modules:
            return sys.modules[name]
        # Siblings of the file stay importable, but after everything else: they never shadow a
        # standard or installed module.
        if str(path.parent) not in sys.path:
            sys.path.append(str(path.parent))
        mspec = importlib.util.spec_from_file_location(name, path)
        if mspec is None or mspec.loader is None:
            raise UserError(f"cannot load {spec} as Python source")
        mod = importlib.util.module_from_spec(mspec)
        _USER_FILES.add(str(path))
        sys.modules[name] = mod         # dataclasses and typing look their module up here
        try:
            mspec.loader.exec_module(mod)
        except Exception as e:
            del sys.modules[name]
            raise UserError(f"loading {spec} failed: {_describe(e)}") from e
        return mod
    _check_module_name(spec)
    try:
        mod = importlib.import_module(spec)
    except ModuleNotFoundError as e:
        if e.name and (spec == e.name or spec.startswith(e.name + ".")):
            raise UserError(f"no such file or module: {spec}") from None
        raise UserError(f"importing {spec} failed: {_describe(e)}") from e
    except Exception as e:
        raise UserError(f"importing {spec} failed: {_describe(e)}") from e
    if getattr(mod, "__file__", None):
        _USER_FILES.add(str(Path(mod.__file__).resolve()))
    return mod


def _check_module_name(spec: str) -> None:
    """Refuse what cannot be a module without running anything: a name that is not dotted
    identifiers, or a dotted name under a top-level module that is not a package (``notpy.txt``
    would run notpy.py before failing on its ``txt``)."""
    parts = spec.split(".")
    if not all(part.isidentifier() for part in parts):
        raise UserError(f"no such file or module: {spec}")
    if parts[0] in sys.modules:
        top = getattr(sys.modules[parts[0]], "__spec__", None)
    else:
        try:
            top = importlib.util.find_spec(parts[0])     # a top-level spec: found, not executed
        except (ImportError, ValueError):
            top = None
    if top is None:
        raise UserError(f"no such file or module: {spec}")
    if len(parts) > 1 and top.submodule_search_locations is None:
        raise UserError(f"no such file or module: {spec} ({parts[0]} is a module, not a package)")


def _module_label(mod: Any) -> str:
    """How messages name a module: a file loaded under its private name by its path (that name
    means nothing to the user), an imported module by its name."""
    if mod.__name__.startswith("_coda_cutlass_user_") and getattr(mod, "__file__", None):
        return str(mod.__file__)
    return str(mod.__name__)


def programs_of(mod: Any) -> list[tuple[Any, dict[str, Any]]]:
    """The module's PREBUILD list of (program, options) pairs, else every epilogue program in it."""
    from .api import split_options
    from .errors import CodaError
    from .frontend.trace import EpilogueProgram
    if not hasattr(mod, "PREBUILD"):
        return [(v, {}) for v in vars(mod).values() if isinstance(v, EpilogueProgram)]
    where = _module_label(mod)
    if not isinstance(mod.PREBUILD, (list, tuple)):
        raise UserError(f"PREBUILD of {where} must be a list of (program, options dict) pairs, got "
                        f"{type(mod.PREBUILD).__name__}")
    items = []
    for i, item in enumerate(mod.PREBUILD):
        ok = isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], EpilogueProgram) \
            and isinstance(item[1], dict)
        if not ok:
            raise UserError(f"PREBUILD[{i}] of {where} must be a (program, options dict) pair, got {item!r}")
        try:                  # unknown options and bad values, before any build
            split_options(item[1])
        except CodaError as e:
            raise UserError(f"PREBUILD[{i}] ({item[0].name}): {e}") from e
        items.append((item[0], dict(item[1])))
    return items


def find_program(mod: Any, file: str, name: str) -> tuple[Any, dict[str, Any]]:
    """The program ``name`` names in the module: the variable of that name, else the one program
    whose name it is; with its options when the module's PREBUILD lists it once."""
    from .api import GENERATION_OPTIONS
    from .frontend.trace import EpilogueProgram
    variables = {k: v for k, v in vars(mod).items() if isinstance(v, EpilogueProgram) and not k.startswith("_")}
    listed = programs_of(mod) if hasattr(mod, "PREBUILD") else []
    if name in variables:
        prog = variables[name]
    else:
        found = {id(p): p for p in [*variables.values(), *(p for p, _ in listed)] if p.name == name}
        if len(found) > 1:
            names = sorted(k for k, v in variables.items() if v.name == name)
            raise UserError(f"'{name}' is the name of {len(found)} programs in {file}"
                            + (f" (variables {', '.join(names)})" if names else "") + "; name one by its variable")
        if not found:
            known = sorted(set(variables) | {p.name for p, _ in listed} | {p.name for p in variables.values()})
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise UserError(f"no program '{name}' in {file}{hint} (programs: {', '.join(known) or 'none'})")
        prog = next(iter(found.values()))
    options = [o for p, o in listed if p is prog]
    opts = options[0] if len(options) == 1 else {}
    return prog, {k: v for k, v in opts.items() if k in GENERATION_OPTIONS}


def cmd_emit(args: argparse.Namespace) -> int:
    import torch
    from .api import emit
    file, sep, name = args.target.rpartition(":")
    if not sep or not file or not name:
        raise UserError(f"expected FILE:PROGRAM (e.g. my_epilogues.py:bias_gelu), got {args.target!r}")
    prog, opts = find_program(load_module(file), file, name)
    given = {"dtype": getattr(torch, args.dtype) if args.dtype else None, "weight_layout": args.weight_layout,
             "scaling": args.scaling, "fast_accum": args.fast_accum}
    opts.update({k: v for k, v in given.items() if v is not None})     # flags given override PREBUILD's
    print(emit(prog, **opts), end="")
    return 0


def cmd_prebuild(args: argparse.Namespace) -> int:
    from .api import compile_many
    from .build.export import export_prebuilt, export_sources
    items = programs_of(load_module(args.file))
    if not items:
        raise UserError(f"no epilogue programs in {args.file}")
    writable_folder(args.out)       # before any build: an unwritable --out must not cost the builds
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


def writable_folder(out: str, flag: str = "--out") -> Path:
    """``--out`` (or another flag's folder): a folder (made when missing) this process can write in."""
    path = Path(out)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".coda-cutlass-write-check-"):
            pass
    except OSError as e:
        raise UserError(f"{flag} {out}: cannot write there ({e.strerror or e})") from None
    return path


def cmd_cache(args: argparse.Namespace) -> int:
    from .build.cache import KernelCache
    cache = KernelCache()
    if cache.check_root() == "not a folder":   # (someone's folder, not a cache: check_root names it)
        raise UserError(f"the kernel cache {cache.root} is not a folder (CODA_CUTLASS_CACHE_DIR)")
    keys = list(cache.keys())
    size = sum(f.stat().st_size for k in keys for f in cache.entry_dir(k).rglob("*") if f.is_file())
    print(f"cache: {cache.root}\nkernels: {len(keys)}\nsize: {size / 1e6:.1f} MB")
    spilling = _spilling(cache, keys)
    if spilling:
        print(f"spilling registers ({len(spilling)}, ptxas's report):")
        for line in spilling:
            print(f"  {line}")
    if args.export:
        from .build.export import export_cache_entry
        out = Path(args.export)
        below = next((p for p in (out, *out.parents) if os.path.lexists(p)), None)
        if below is not None and not below.is_dir():
            raise UserError(f"--export {args.export}: {below} is not a folder (give a new or existing folder)")
        writable_folder(args.export, "--export")    # an empty cache too: no success reported for nowhere
        n = sum(export_cache_entry(cache, k, args.export) for k in keys)
        print(f"exported {n} verified kernels as prebuilt kernels to {args.export}")
    return 0


def _spilling(cache: Any, keys: list[str]) -> list[str]:
    """'name [key]: resources' of each cached kernel whose build recorded register spills."""
    from .build.files import read_json_object
    from .build.resources import Resources
    out = []
    for k in keys:
        meta = read_json_object(cache.entry_dir(k) / "meta.json") or {}
        r = Resources.from_json(meta.get("resources"))
        if r is not None and r.spills:
            out.append(f"{meta.get('name', '?')} [{k[:12]}]: {r.describe()}")
    return sorted(out)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import main
    return main(quick=args.quick)


def _positive_int(text: str) -> int:
    """An option's whole number >= 1 (``--jobs 0`` was taken, and ignored under --sources-only)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def parser() -> Parser:
    # the docstring's reST literals (``x``) print as `x` in a terminal
    p = Parser(prog="python -m coda_cutlass", description=(__doc__ or "").replace("``", "`"),
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    common = argparse.ArgumentParser(add_help=False)      # --debug also after the command
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    s = sub.add_parser("demo", parents=[common], help="the main job (see README)")
    s.add_argument("--quick", action="store_true", help="smaller timing runs")
    s.set_defaults(fn=cmd_demo)
    s = sub.add_parser("emit", parents=[common], help="print the generated CUDA of FILE:PROGRAM")
    s.add_argument("target", metavar="FILE:PROGRAM",
                   help="a .py file or module name, and a program in it (its variable or its name)")
    s.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"],
                   help="default: the program's PREBUILD entry, else bfloat16")
    s.add_argument("--weight-layout", default=None, choices=["nk", "kn"],
                   help="default: the program's PREBUILD entry, else nk")
    s.add_argument("--scaling", default=None, choices=["tensor", "row", "block", "block_1x128", "block_16x128"],
                   help="FP8 operands: how A and W are scaled (default: tensor)")
    s.add_argument("--fast-accum", action="store_true", default=None, help="FP8 operands: fast-accumulation mainloop")
    s.set_defaults(fn=cmd_emit)
    s = sub.add_parser("prebuild", parents=[common], help="compile and export prebuilt kernels")
    s.add_argument("file", help="a .py file or module name: its PREBUILD list of (program, options) pairs, "
                   "else every program in it")
    s.add_argument("--out", required=True, metavar="DIR",
                   help="where the <key>.so and <key>.json files go (coda_cutlass/prebuilt for a wheel, or a "
                   "folder on $CODA_CUTLASS_PREBUILT_PATH)")
    s.add_argument("--jobs", type=_positive_int, default=None, help="parallel nvcc builds (default: the CPUs')")
    s.add_argument("--all-candidates", action="store_true",
                   help="build every autotuning candidate configuration (tuning then needs no nvcc)")
    s.add_argument("--sources-only", action="store_true",
                   help="write the generated .cu files (and headers) for CMakeLists.txt instead of compiling")
    s.set_defaults(fn=cmd_prebuild)
    s = sub.add_parser("cache", parents=[common], help="show the kernel cache",
                       description="Show the kernel cache ($CODA_CUTLASS_CACHE_DIR, else ~/.cache/coda-cutlass): "
                       "its folder, kernel count, size and the kernels that spill registers.")
    s.add_argument("--export", metavar="DIR", help="copy every verified kernel out as a prebuilt kernel")
    s.set_defaults(fn=cmd_cache)
    return p


def _user_frame(exc: BaseException) -> str | None:
    """'file:line' of the innermost traceback frame in a file loaded for the user, if any."""
    where = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if str(Path(frame.filename).resolve()) in _USER_FILES:
            where = f"{frame.filename}:{frame.lineno}"
    return where


def _describe(e: BaseException) -> str:
    """One line for an exception: its type and message, and where in the user's files it was raised."""
    text = str(e) if isinstance(e, UserError) or _is_coda_error(e) else f"{type(e).__name__}: {e}"
    if isinstance(e, SyntaxError) and e.filename:
        return f"SyntaxError: {e.msg} ({e.filename}:{e.lineno})"
    at = _user_frame(e)
    return text + (f" (at {at})" if at else "")


def _is_coda_error(e: BaseException) -> bool:
    from .errors import CodaError
    return isinstance(e, CodaError)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from .env import env_flag
    from .errors import ConfigError
    try:
        debug = getattr(args, "debug", False) or env_flag("CODA_CUTLASS_DEBUG", False)
        env_flag("CODA_CUTLASS_QUIET", False)          # refused here, whatever the command prints
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # One line for what the user can fix: our own errors, a bad file or path, anything raised
        # in the user's code. Anything else is a bug in coda-cutlass and keeps its traceback.
        if not (isinstance(e, (UserError, OSError)) or _is_coda_error(e) or _user_frame(e)):
            raise
        if debug:
            traceback.print_exc()
        print(f"error: {_describe(e)}", file=sys.stderr)
        return USER_ERROR
