"""Public entry points: compile_epilogue, compile_many, emit, reference."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from .build.builder import build
from .build.progress import say
from .config import KernelConfig
from .errors import BuildError
from .dtypes import BF16, as_dtype, as_operand_dtype
from .interpret import PRECISIONS, interpret
from .pipeline import Options, lower_program, typed_ir
from .runtime.kernel import CompiledEpilogue


def _options(dtype: Any, weight_layout: str, config: KernelConfig | None, input_dtypes: Mapping[str, Any] | None,
             output_dtypes: Mapping[str, Any] | None, constants: Mapping[str, float] | None) -> Options:
    return Options.make(dtype, weight_layout, config, input_dtypes, output_dtypes, constants)


GENERATION_OPTIONS = ("dtype", "weight_layout", "config", "input_dtypes", "output_dtypes", "constants")
BUILD_OPTIONS = ("partial_reductions", "cache_dir", "force_rebuild", "build_timeout")


def split_options(opts: Mapping[str, Any]) -> tuple[Options, dict[str, Any]]:
    """compile_epilogue-style keyword options -> (what decides the source, the build/runtime rest)."""
    unknown = set(opts) - set(GENERATION_OPTIONS) - set(BUILD_OPTIONS)
    if unknown:
        raise TypeError(f"unknown options {sorted(unknown)}")
    gen = {k: opts[k] for k in GENERATION_OPTIONS if k in opts}
    gen.setdefault("dtype", torch.bfloat16)
    return Options.make(**gen), {k: opts[k] for k in BUILD_OPTIONS if k in opts}


def with_candidate_configs(items: Sequence[tuple[Any, Mapping[str, Any]]]) -> list[tuple[Any, dict[str, Any]]]:
    """(program, options) pairs -> one pair per autotuning candidate config of each program (to
    build every candidate ahead of time, e.g. for prebuilt kernels)."""
    from .tuning.space import candidate_configs
    return [(p, {**o, "config": c}) for p, o in items
            for c in candidate_configs(lower_program(p, split_options(o)[0]).graph)]


def emit(program: Any, dtype: Any = torch.bfloat16, *, weight_layout: str = "nk",
         config: KernelConfig | None = None, input_dtypes: Mapping[str, Any] | None = None,
         output_dtypes: Mapping[str, Any] | None = None, constants: Mapping[str, float] | None = None) -> str:
    """The generated `.cu` for a program, as text. Traces, validates and renders; runs no compiler."""
    return lower_program(program, _options(dtype, weight_layout, config, input_dtypes, output_dtypes,
                                           constants)).source


def compile_epilogue(program: Any, dtype: Any = torch.bfloat16, *, weight_layout: str = "nk",
                     config: KernelConfig | str | None = None, input_dtypes: Mapping[str, Any] | None = None,
                     output_dtypes: Mapping[str, Any] | None = None, constants: Mapping[str, float] | None = None,
                     partial_reductions: bool = False, cache_dir: str | Path | None = None,
                     verbose: bool | None = None, force_rebuild: bool = False,
                     build_timeout: float | None = None) -> Any:
    """Compile an epilogue program into a fused GEMM + epilogue kernel (or fetch it from the cache).

    Args:
        program: a function decorated with ``@cc.epilogue``.
        dtype: GEMM operand dtype, ``torch.bfloat16`` or ``torch.float16``; accumulation is fp32.
        weight_layout: ``"nk"``: W is (N, K) as in ``nn.Linear`` (acc = A @ W.T); ``"kn"``: W is (K, N).
        config: a ``KernelConfig`` to pin (tile, cluster, schedule, raster, swizzle); None for the
            heuristic default (128x128x64, cluster 1x2, ping-pong); ``"tune"`` for a ``TunedEpilogue``
            that autotunes per (N, K, M bucket) on first use and remembers the choice on disk.
        input_dtypes: dtype per operand name (default: ``dtype``; scalars are fp32).
        output_dtypes: dtype per output name (default: ``dtype`` for tiles, fp32 for reductions).
        constants: values for the program's constant parameters.
        partial_reductions: return reductions as raw per-tile fp32 partials (rows: (ceil(N/tile_n), M);
            columns: (ceil(M/tile_m), N)) for a consumer to finish, instead of finished vectors.
        cache_dir: kernel cache directory (default ``$CODA_CUTLASS_CACHE_DIR`` or ~/.cache/coda-cutlass).
        verbose: progress output on stderr (default on; ``CODA_CUTLASS_QUIET=1`` turns it off).
        force_rebuild: ignore prebuilt and cached kernels (the cached entry is replaced only once the
            new build succeeded).
        build_timeout: seconds nvcc may run (default ``$CODA_CUTLASS_BUILD_TIMEOUT`` or 1800; 0: none).

    Works without a GPU: the kernel is built and can be inspected; calling it needs an sm_90 GPU.
    """
    if isinstance(config, str):
        if config != "tune":
            raise TypeError(f"config must be a KernelConfig, None (the heuristic default) or 'tune', got {config!r}")
        from .tuning import TunedEpilogue
        return TunedEpilogue(program, _options(dtype, weight_layout, None, input_dtypes, output_dtypes, constants),
                             partial_reductions=partial_reductions, cache_dir=cache_dir, verbose=verbose)
    opts = _options(dtype, weight_layout, config, input_dtypes, output_dtypes, constants)
    lowered = lower_program(program, opts)
    result = build(lowered.source, lowered.program.name, cache_dir=cache_dir, verbose=verbose, force=force_rebuild,
                   timeout=build_timeout, dtype=opts.dtype.torch)
    return CompiledEpilogue(lowered, result, partial_reductions=partial_reductions)


def default_jobs() -> int:
    """Parallel nvcc jobs: one per core, but at most one per 2 GiB of memory (cicc peaks near that)."""
    cores = os.cpu_count() or 2
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return cores
    return max(1, min(cores, int(mem_gib // 2)))


def compile_many(programs: Sequence[Any], dtype: Any = torch.bfloat16, *, jobs: int | None = None,
                 verbose: bool | None = None, skip_failed: bool = False, **kwargs: Any) -> list[CompiledEpilogue]:
    """Compile several kernels in parallel (nvcc runs concurrently; results in input order).

    Each item is a program, or a ``(program, options_dict)`` pair overriding the shared keyword
    options. ``jobs`` defaults to the number of CPU cores (nvcc uses one core per kernel), capped by
    memory.
    A failed build raises ``BuildError`` once all builds finish, unless ``skip_failed`` (then its
    entry is None).
    """
    items: list[tuple[Any, Options, dict[str, Any]]] = []
    for item in programs:
        prog, extra = item if isinstance(item, tuple) else (item, {})
        opts, rest = split_options({"dtype": dtype, **kwargs, **extra})
        items.append((prog, opts, rest))
    # Lower everything first so program errors surface before any compiler runs.
    lowered = [lower_program(p, opts) for p, opts, _ in items]
    rests = [rest for _, _, rest in items]
    jobs = jobs or default_jobs()
    total = len(lowered)
    start = time.monotonic()
    done = [0]

    def one(i: int) -> CompiledEpilogue | BuildError:
        lo = lowered[i]
        try:
            res = build(lo.source, lo.program.name, cache_dir=rests[i].get("cache_dir"), verbose=False,
                        force=rests[i].get("force_rebuild", False), timeout=rests[i].get("build_timeout"),
                        dtype=lo.options.dtype.torch)
        except BuildError as e:
            done[0] += 1
            say(f"[{done[0]}/{total}] {lo.program.name}: FAILED (log: {e.log_path})", verbose)
            return e
        done[0] += 1
        say(f"[{done[0]}/{total}] {lo.program.name}: {res.origin}"
            + (f" in {res.seconds:.0f} s" if res.origin == "built" else ""), verbose)
        return CompiledEpilogue(lo, res, partial_reductions=rests[i].get("partial_reductions", False))

    say(f"building {total} kernels with up to {jobs} parallel nvcc jobs", verbose)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        out = list(pool.map(one, range(total)))
    failed = [(lowered[i].program.name, r) for i, r in enumerate(out) if isinstance(r, BuildError)]
    say(f"{total - len(failed)} of {total} kernels ready in {time.monotonic() - start:.0f} s", verbose)
    if failed and skip_failed:
        return [None if isinstance(r, BuildError) else r for r in out]  # type: ignore[misc]
    if failed:
        names = "\n".join(f"  {name}: {e.source_path} (log {e.log_path})" for name, e in failed)
        raise BuildError(f"{len(failed)} of {total} kernels failed to build (the others are cached):\n{names}")
    return out  # type: ignore[return-value]


def reference(program: Any, A: torch.Tensor, W: torch.Tensor, *, dtype: Any = None, weight_layout: str = "nk",
              precision: str = "kernel", input_dtypes: Mapping[str, Any] | None = None,
              output_dtypes: Mapping[str, Any] | None = None, constants: Mapping[str, float] | None = None,
              **operands: Any) -> dict[str, torch.Tensor]:
    """Evaluate a program with the torch reference interpreter (CPU or GPU), returning the same dict
    a compiled kernel returns. ``precision``: ``"kernel"`` (the kernel's rounding points), ``"fp32"``
    (no rounding) or ``"lowp"`` (every op rounded to the operand dtype, like eager torch)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if dtype is None:
        dtype = A.dtype if A.dtype in (torch.bfloat16, torch.float16) else BF16
    opts = _options(as_operand_dtype(as_dtype(dtype)), weight_layout, None, input_dtypes, output_dtypes, constants)
    ir = typed_ir(program, opts)
    return interpret(ir, A, W, operands, weight_layout=weight_layout, precision=precision)
