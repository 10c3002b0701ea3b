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

from pathlib import Path
from typing import Any, Mapping

import torch

from .build.builder import build
from .dtypes import as_dtype, as_operand_dtype
from .errors import ConfigError
from .interpret import check_mode, interpret
from .lower.map import PARTIALS_TILE, lower_map
from .pipeline import Options, typed_ir
from .render.map import render_map_kernel
from .runtime.map_kernel import CompiledMap, logical_shape


def _map_options(dtype: Any, input_dtypes: Mapping[str, Any] | None, output_dtypes: Mapping[str, Any] | None,
                 constants: Mapping[str, float] | None) -> Options:
    opts = Options.make(dtype, input_dtypes=input_dtypes, output_dtypes=output_dtypes, constants=constants)
    if opts.fp8 is not None:
        raise ConfigError(f"map kernels have no GEMM: X is bf16 or fp16, not {opts.fp8.describe()} (FP8 operands "
                          "are for cc.compile_epilogue)")
    return opts


def emit_map(program: Any, dtype: Any = torch.bfloat16, *, input_dtypes: Mapping[str, Any] | None = None,
             output_dtypes: Mapping[str, Any] | None = None, constants: Mapping[str, float] | None = None) -> str:
    """The generated `.cu` of a map kernel, as text (no compiler runs)."""
    opts = _map_options(dtype, input_dtypes, output_dtypes, constants)
    return render_map_kernel(lower_map(typed_ir(program, opts), opts.dtype))


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
                  **operands: Any) -> dict[str, torch.Tensor]:
    """The torch interpreter's result of a map kernel call ``k(X, **operands)`` (CPU or GPU).
    Tile operands may be 2-D, 3-D or 4-D like the kernel's; outputs are (M, N) matrices.
    ``partial_reductions``: row reductions as the kernel's per-(row, 256-column tile) partials."""
    check_mode(precision)
    if dtype is None:
        dtype = X.dtype if X.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    opts = Options.make(as_operand_dtype(as_dtype(dtype)), input_dtypes=input_dtypes, output_dtypes=output_dtypes,
                        constants=constants)
    M, N = logical_shape("X", X)
    flat = {k: (v.reshape(M, -1) if isinstance(v, torch.Tensor) and v.dim() > 2 else v) for k, v in operands.items()}
    return interpret(typed_ir(program, opts), None, None, flat, precision=precision,  # type: ignore[arg-type]
                     acc=X.reshape(M, N), partial_tile=PARTIALS_TILE if partial_reductions else None)
