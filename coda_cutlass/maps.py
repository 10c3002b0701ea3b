"""Map kernels: an epilogue program applied to an existing tensor instead of a GEMM accumulator.

    @cc.epilogue
    def norm_stats(acc, g: cc.PerCol):
        return {"h": acc * g, "sumsq": cc.row_sum(acc * acc)}

    k = cc.compile_map(norm_stats, dtype=torch.bfloat16)
    out = k(x, g=gamma)                              # {"h": (M, N), "sumsq": (M,)}
    cc.map_reference(norm_stats, x, g=gamma)         # the same dict from the torch interpreter

For the memory-bound work of a Transformer that has no GEMM in front of it (the first RMSNorm's
statistics after the embedding, the RoPE backward on attention gradients). One launch, each input
read once, each output written once. lower/map.py lists what the generator supports.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Mapping

import torch

from .build.builder import build
from .errors import CallError, ConfigError, checked_options
from .frontend.trace import check_option_values
from .interpret import check_mode, interpret
from .ir.nodes import Program
from .lower.map import PARTIALS_TILE, lower_map
from .pipeline import Options, typed_ir
from .render.map import render_map_kernel
from .runtime.map_call import MapReferenceCall
from .runtime.map_kernel import CompiledMap, logical_shape


def _map_options(dtype: Any, input_dtypes: Mapping[str, Any] | None, output_dtypes: Mapping[str, Any] | None,
                 constants: Mapping[str, float] | None) -> Options:
    opts = Options.make(dtype, input_dtypes=input_dtypes, output_dtypes=output_dtypes, constants=constants)
    if opts.fp8 is not None:
        raise ConfigError(f"map kernels have no GEMM: X is bf16 or fp16, not {opts.fp8.describe()} (FP8 operands "
                          "are for cc.compile_epilogue)")
    return opts


@checked_options
def emit_map(program: Any, dtype: Any = torch.bfloat16, *, input_dtypes: Mapping[str, Any] | None = None,
             output_dtypes: Mapping[str, Any] | None = None, constants: Mapping[str, float] | None = None) -> str:
    """The generated `.cu` of a map kernel, as text (no compiler runs)."""
    opts = _map_options(dtype, input_dtypes, output_dtypes, constants)
    return render_map_kernel(lower_map(typed_ir(program, opts), opts.dtype))


@checked_options
def compile_map(program: Any, dtype: Any = torch.bfloat16, *, input_dtypes: Mapping[str, Any] | None = None,
                output_dtypes: Mapping[str, Any] | None = None, constants: Mapping[str, float] | None = None,
                partial_reductions: bool = False, cache_dir: str | Path | None = None,
                verbose: bool | None = None, force_rebuild: bool = False) -> CompiledMap:
    """Compile an epilogue program into a map kernel over an existing tensor ``X`` (the program's
    ``acc``), with no GEMM. ``dtype`` is X's dtype and the default of tile operands and outputs.
    Row reductions are finished after the kernel (``partial_reductions=True``: raw (ceil(N/256), M)
    partials). A few seconds of nvcc; cached like GEMM kernels."""
    opts = _map_options(dtype, input_dtypes, output_dtypes, constants)
    graph = lower_map(typed_ir(program, opts), opts.dtype)
    source = render_map_kernel(graph)
    result = build(source, graph.program.name, cache_dir=cache_dir, verbose=verbose, force=force_rebuild,
                   dtype=opts.dtype)
    return CompiledMap(graph, source, result, partial_reductions=partial_reductions)


def map_reference(program: Any, X: torch.Tensor, /, *, dtype: Any = None, precision: str = "kernel",
                  input_dtypes: Mapping[str, Any] | None = None, output_dtypes: Mapping[str, Any] | None = None,
                  constants: Mapping[str, float] | None = None, partial_reductions: bool = False,
                  out: Mapping[str, torch.Tensor] | None = None, **operands: Any) -> dict[str, torch.Tensor]:
    """The torch interpreter's result of a map kernel call ``k(X, out=out, **operands)`` (CPU or GPU).

    The program is checked as ``compile_map`` checks it (what map kernels refuse is refused here) and
    the arguments as the kernel call checks them, with the same messages, but for memory layout
    (strides, alignment, N a multiple of 8, a CUDA device); ``precision="fp32"`` also takes float32
    copies of X and of every tensor. X and tile operands may be 2-D, 3-D or 4-D like the kernel's.
    Outputs are (M, N) matrices, or written into the ``out=`` tensors and returned as passed;
    accumulated outputs are updated in place. ``partial_reductions``: row reductions as the
    kernel's per-(row, 256-column tile) partials."""
    check_option_values("cc.map_reference", program, constants, {
        "dtype": dtype, "precision": precision, "input_dtypes": input_dtypes, "output_dtypes": output_dtypes,
        "constants": constants, "partial_reductions": partial_reductions})
    check_mode(precision)
    if dtype is None:
        dtype = _map_reference_dtype(X, precision)
    ir, call = _reference_call(program, _map_options(dtype, input_dtypes, output_dtypes, constants))
    M, N = call.check(X, operands, out, fp32_ok=precision == "fp32")
    flat: dict[str, Any] = {}
    copy_back: list[tuple[str, torch.Tensor, torch.Tensor]] = []   # accumulated 3-/4-D views that needed a copy
    for name, v in operands.items():
        if isinstance(v, torch.Tensor) and v.dim() > 2:
            try:
                flat[name] = v.view(M, -1)
            except RuntimeError:     # e.g. (B, S, H, D) transposed from (B, H, S, D): read through a copy
                if name in ir.outputs and any(st == 0 and sz > 1 for sz, st in zip(v.shape, v.stride())):
                    raise CallError(f"'{name}' is accumulated in place (cc.accumulate) but the tensor passed is a "
                                    "broadcast view (a stride of 0): pass one that owns its elements "
                                    "(.contiguous())") from None
                flat[name] = v.reshape(M, -1)
                copy_back.append((name, v, flat[name]))
        else:
            flat[name] = v
    res = interpret(ir, None, None, flat, precision=precision,  # type: ignore[arg-type]
                    acc=X.reshape(M, N), partial_tile=PARTIALS_TILE if partial_reductions else None)
    for name, v in operands.items():      # as the kernel: the tensor passed, updated in place
        if name in res:
            res[name] = v
    for name, v, flat_v in copy_back:
        if name in res:
            v.copy_(flat_v.view(v.shape))
    for name, t in (out or {}).items():   # as the kernel: written into the tensor given, returned as given
        t.copy_(res[name].reshape(t.shape))
        res[name] = t
    return res


def interpret_map(program: Any, X: torch.Tensor, dtype: torch.dtype, precision: str, partial_reductions: bool,
                  operands: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The interpreter on a map call the library itself makes (nn's ReferenceRunner: its arguments
    are its own), without cc.map_reference's program and call checks. Those checks (the map
    lowering among them) moved torch.compile's graph breaks in a compiled training step on the CPU
    so that an in-place write of the interpreter was replayed onto a tensor saved for the backward."""
    M, N = logical_shape("X", X)
    flat = {k: (v.reshape(M, -1) if isinstance(v, torch.Tensor) and v.dim() > 2 else v) for k, v in operands.items()}
    return interpret(typed_ir(program, _map_options(dtype, None, None, None)), None, None, flat,  # type: ignore[arg-type]
                     precision=precision, acc=X.reshape(M, N),
                     partial_tile=PARTIALS_TILE if partial_reductions else None)


def _map_reference_dtype(X: Any, precision: str) -> Any:
    """cc.map_reference's default dtype: X's when it is bf16 or fp16."""
    x_dtype = getattr(X, "dtype", None)
    if x_dtype in (torch.bfloat16, torch.float16):
        return x_dtype
    if precision == "fp32" or x_dtype != torch.float32:
        return torch.bfloat16     # fp32 precision rounds nothing X's dtype decides; anything else is reported
    raise CallError(f"cc.map_reference: X is {x_dtype} and no dtype was given. Precision '{precision}' models "
                    "the kernel's dtype: pass dtype=torch.bfloat16 or torch.float16 (with X in it), or use "
                    "precision='fp32' for the unrounded reference")


def _reference_call(program: Any, opts: Options) -> tuple[Program, MapReferenceCall]:
    """The typed program and its call checks, lowered as compile_map lowers it (so that what a map
    kernel refuses is refused). Traced on every call, as cc.reference traces: a program reads its
    globals and closures when traced (a cache by the program object ran on stale values); the
    lowering is cached by the typed program itself."""
    ir = typed_ir(program, opts)
    return ir, _checked_call(ir, opts.dtype)


@functools.lru_cache(maxsize=256)
def _checked_call(ir: Program, dtype: Any) -> MapReferenceCall:
    return MapReferenceCall(lower_map(ir, dtype), keywords=_MAP_REFERENCE_OPTIONS)


_MAP_REFERENCE_OPTIONS = ("dtype", "precision", "input_dtypes", "output_dtypes", "constants", "partial_reductions")
