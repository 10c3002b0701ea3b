"""Public entry points: compile_epilogue, compile_many, emit, reference.

Built on the pipeline (program -> source), the compiler (source -> kernel) and, for
``config="tune"``, the autotuner.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from .compiler import CompiledEpilogue, checked_reference, compile_generated, compile_parallel, parallel_jobs
from .config import KernelConfig
from .dtypes import BF16
from .errors import ArgumentError, CallError, ConfigError, check_options, checked_options
from .frontend.trace import check_option_values
from .interpret import check_mode
from .pipeline import Lowered, Options, generate, lower_program, typed_ir
from .runtime.arguments import CallSpec
from .tuning.space import candidate_configs
from .tuning.tuner import TunedEpilogue


def _options(dtype: Any, weight_layout: str, config: KernelConfig | None, input_dtypes: Mapping[str, Any] | None,
             output_dtypes: Mapping[str, Any] | None, constants: Mapping[str, float] | None,
             scaling: str | None = None, fast_accum: bool = False) -> Options:
    return Options.make(dtype, weight_layout, config, input_dtypes, output_dtypes, constants, scaling, fast_accum)


GENERATION_OPTIONS = ("dtype", "weight_layout", "config", "input_dtypes", "output_dtypes", "constants", "scaling",
                      "fast_accum")
BUILD_OPTIONS = ("partial_reductions", "cache_dir", "force_rebuild", "build_timeout")


def split_options(opts: Mapping[str, Any]) -> tuple[Options, dict[str, Any]]:
    """compile_epilogue-style keyword options -> (what decides the source, the build/runtime rest)."""
    check_options(opts, GENERATION_OPTIONS + BUILD_OPTIONS)
    gen = {k: opts[k] for k in GENERATION_OPTIONS if k in opts}
    gen.setdefault("dtype", torch.bfloat16)
    return Options.make(**gen), {k: opts[k] for k in BUILD_OPTIONS if k in opts}


class _LowerOnce:
    """Lowers each (program, options other than the config) once, however many configs follow."""

    def __init__(self) -> None:
        self._done: dict[tuple[Any, Options], Lowered] = {}

    def __call__(self, program: Any, options: Options) -> Lowered:
        key = (program, replace(options, config=None))
        lo = self._done.get(key)
        if lo is None:
            lo = self._done[key] = lower_program(program, key[1])
        return lo


def with_candidate_configs(items: Sequence[tuple[Any, Mapping[str, Any]]]) -> list[tuple[Any, dict[str, Any]]]:
    """(program, options) pairs -> one pair per autotuning candidate config of each program (to
    build every candidate ahead of time, e.g. for prebuilt kernels)."""
    lower_once = _LowerOnce()
    return [(p, {**o, "config": c}) for p, o in items
            for c in candidate_configs(lower_once(p, split_options(o)[0]).graph)]


@checked_options
def emit(program: Any, dtype: Any = torch.bfloat16, *, weight_layout: str = "nk",
         config: KernelConfig | None = None, input_dtypes: Mapping[str, Any] | None = None,
         output_dtypes: Mapping[str, Any] | None = None, constants: Mapping[str, float] | None = None,
         scaling: str | None = None, fast_accum: bool = False) -> str:
    """The generated `.cu` for a program, as text. Traces, validates and renders; runs no compiler."""
    return generate(lower_program(program, _options(dtype, weight_layout, config, input_dtypes, output_dtypes,
                                                    constants, scaling, fast_accum))).source


def emit_many(items: Sequence[tuple[Any, Mapping[str, Any]]]) -> list[str]:
    """The generated `.cu` of each (program, options) pair (options as for compile_epilogue)."""
    lower_once = _LowerOnce()
    out = []
    for p, o in items:
        opts = split_options(o)[0]
        out.append(generate(lower_once(p, opts), opts.config).source)
    return out


@checked_options
def compile_epilogue(program: Any, dtype: Any = torch.bfloat16, *, weight_layout: str = "nk",
                     config: KernelConfig | str | None = None, input_dtypes: Mapping[str, Any] | None = None,
                     output_dtypes: Mapping[str, Any] | None = None, constants: Mapping[str, float] | None = None,
                     scaling: str | None = None, fast_accum: bool = False,
                     partial_reductions: bool = False, cache_dir: str | Path | None = None,
                     verbose: bool | None = None, force_rebuild: bool = False,
                     build_timeout: float | None = None) -> Any:
    """Compile an epilogue program into a fused GEMM + epilogue kernel (or fetch it from the cache).

    Args:
        program: a function decorated with ``@cc.epilogue``.
        dtype: GEMM operand dtype, ``torch.bfloat16`` or ``torch.float16``; accumulation is fp32. FP8:
            ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``, or an (A, W) pair of them (mixed); the call
            then takes ``scale_a=`` / ``scale_b=`` and ``acc`` is the scaled product (coda_cutlass/fp8;
            tile inputs and outputs default to bf16).
        weight_layout: ``"nk"``: W is (N, K) as in ``nn.Linear`` (acc = A @ W.T); ``"kn"``: W is (K, N).
        config: a ``KernelConfig`` to pin (tile, cluster, schedule, raster, swizzle); None for the
            heuristic default (128x128x64, cluster 1x2, ping-pong); ``"tune"`` for a ``TunedEpilogue``
            that autotunes per (N, K, M bucket) on first use and remembers the choice on disk.
        input_dtypes: dtype per operand name (default: ``dtype``; scalars are fp32).
        output_dtypes: dtype per output name (default: ``dtype`` for tiles, fp32 for reductions).
        constants: values for the program's constant parameters.
        scaling: FP8 only: ``"tensor"`` (default: one fp32 scale per operand), ``"row"`` (per row of A
            and of W), ``"block"`` (1x128 blocks of A, 128x128 of W), ``"block_16x128"`` (1x128 of A,
            16x128 of W) or ``"block_1x128"`` (1x128 blocks
            of both); the scale layouts: ``coda_cutlass.fp8.scales``.
        fast_accum: FP8 tensor/row scaling only: CUTLASS's fast-accumulation schedules (faster, the
            wgmma accumulators are not promoted to fp32 every 128 of K).
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
            raise ArgumentError(f"config must be a KernelConfig, None (the heuristic default) or 'tune', got {config!r}")
        return TunedEpilogue(program, _options(dtype, weight_layout, None, input_dtypes, output_dtypes, constants,
                                               scaling, fast_accum),
                             partial_reductions=partial_reductions, cache_dir=cache_dir, verbose=verbose)
    opts = _options(dtype, weight_layout, config, input_dtypes, output_dtypes, constants, scaling, fast_accum)
    return compile_generated(generate(lower_program(program, opts)), partial_reductions=partial_reductions,
                             cache_dir=cache_dir, verbose=verbose, force_rebuild=force_rebuild,
                             build_timeout=build_timeout)


def compile_many(programs: Sequence[Any], dtype: Any = torch.bfloat16, *, jobs: int | None = None,
                 verbose: bool | None = None, skip_failed: bool = False, **kwargs: Any) -> list[CompiledEpilogue]:
    """Compile several kernels in parallel (nvcc runs concurrently; results in input order).

    Each item is a program, or a ``(program, options_dict)`` pair (tuple or list) overriding the
    shared keyword options. ``jobs`` defaults to the number of CPU cores (nvcc uses one core per
    kernel), capped by memory.
    A failed build raises ``BuildError`` once all builds finish, unless ``skip_failed`` (then its
    entry is None).
    """
    # One program passed bare raised a raw "not iterable" TypeError; a str or dict was iterated by name.
    if callable(programs) or isinstance(programs, (str, bytes, Mapping)) or not isinstance(programs, Iterable):
        hint = "; for one program: compile_many([program]) or cc.compile_epilogue(program)" if callable(programs) else ""
        raise ArgumentError(f"compile_many takes a list of programs or (program, options dict) pairs, got "
                            f"{type(programs).__name__}{hint}")
    # Generate everything first (each program lowered once) so program errors surface before any
    # compiler runs.
    jobs = parallel_jobs(jobs)
    lower_once = _LowerOnce()
    items: list[tuple[Any, dict[str, Any]]] = []
    for i, item in enumerate(programs):
        if isinstance(item, (tuple, list)):     # a [program, options] list too, as PREBUILD takes
            if len(item) != 2 or not isinstance(item[1], Mapping):
                raise ConfigError(f"compile_many item {i}: expected a program or a (program, options dict) pair, "
                                  f"got {item!r:.200}")
            prog, extra = item
        else:
            prog, extra = item, {}
        try:
            opts, rest = split_options({"dtype": dtype, **kwargs, **extra})
        except ArgumentError as e:
            raise ArgumentError(f"compile_many item {i} ({getattr(prog, 'name', prog)!r:.80}): {e}") from None
        items.append((generate(lower_once(prog, opts), opts.config), rest))
    return compile_parallel(items, jobs=jobs, verbose=verbose, skip_failed=skip_failed)  # type: ignore[return-value]


def reference(program: Any, A: torch.Tensor, W: torch.Tensor, /, *, dtype: Any = None, weight_layout: str = "nk",
              precision: str = "kernel", input_dtypes: Mapping[str, Any] | None = None,
              output_dtypes: Mapping[str, Any] | None = None, constants: Mapping[str, float] | None = None,
              scaling: str | None = None, out: Mapping[str, torch.Tensor] | None = None,
              partial_reductions: bool = False, **operands: Any) -> dict[str, torch.Tensor]:
    """Evaluate a program with the torch reference interpreter (CPU or GPU), returning the same dict
    the kernel compiled with these options returns for this call (its reductions finished:
    ``partial_reductions=True`` is refused, as a kernel's raw partials depend on its tile config).

    ``precision``: ``"kernel"`` (the kernel's rounding points), ``"fp32"`` (nothing rounded but
    explicit casts) or ``"lowp"`` (every op rounded to the operand dtype, like eager torch).

    The arguments are checked as the kernel call checks them (names, dtypes, shapes, devices; not
    memory layout), with the same messages. ``precision="fp32"`` also takes float32 copies of A, W
    and every tensor operand, for the exact reference. ``dtype`` (the GEMM operand dtype) defaults
    to A's when A is bf16 or fp16; with a float32 A it must be given, except at ``precision="fp32"``,
    whose results do not depend on it. As the kernel, accumulated outputs are updated in place in
    the tensors passed, tile outputs are written into the ``out={name: tensor}`` tensors given (and
    returned as given), A may have leading batch dimensions, and reductions over an empty M or N
    give their identity.

    FP8 operands (A and W in float8, or float32 copies with ``dtype`` given): pass ``scale_a`` and
    ``scale_b`` (and ``scaling`` unless "tensor") as to the kernel. The reference dequantises A and
    W with the scales of each block and runs the fp32 program; ``"lowp"`` rounds the product and
    every op to bf16, like ``torch._scaled_mm(..., out_dtype=torch.bfloat16)`` and eager ops after it."""
    check_option_values("cc.reference", program, constants, {
        "dtype": dtype, "weight_layout": weight_layout, "precision": precision, "input_dtypes": input_dtypes,
        "output_dtypes": output_dtypes, "constants": constants, "scaling": scaling})
    check_mode(precision)
    if partial_reductions is not False:
        raise ArgumentError("cc.reference: partial_reductions is not supported: a GEMM kernel's raw partials depend "
                            "on its tile config (one per CTA tile); compare a kernel compiled without it, or the "
                            "finished values (cc.map_reference takes partial_reductions: map kernels tile by 256 "
                            "columns)")
    if dtype is None:
        dtype = _reference_dtype(A, W, precision)
    opts = _options(dtype, weight_layout, None, input_dtypes, output_dtypes, constants, scaling)
    ir = typed_ir(program, opts)
    return checked_reference(ir, CallSpec.of(ir), A, W, operands, dtype=opts.dtype, weight_layout=weight_layout,
                             precision=precision, out=out)


def _reference_dtype(A: Any, W: Any, precision: str) -> Any:
    """cc.reference's default GEMM dtype: A's (with W's, for FP8 operands)."""
    a_dtype = getattr(A, "dtype", None)
    if a_dtype in (torch.bfloat16, torch.float16):
        return a_dtype
    if a_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        w_dtype = getattr(W, "dtype", a_dtype)
        return a_dtype if w_dtype == a_dtype or w_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) \
            else (a_dtype, w_dtype)
    if precision == "fp32" or not isinstance(A, torch.Tensor):
        return BF16      # fp32 precision rounds nothing the GEMM dtype decides; a non-tensor A is reported below
    raise CallError(f"cc.reference: A is {a_dtype} and no dtype was given. Precision '{precision}' "
                    "models the kernel's operand dtype: pass dtype=torch.bfloat16 or torch.float16 (with "
                    "A and W in it), or use precision='fp32' for the unrounded reference")
