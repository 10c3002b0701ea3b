"""The front half of the compiler, shared by emit, compile and reference: program -> typed IR ->
EVT graph -> CUDA source. No nvcc, no GPU."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from .config import DEFAULT, KernelConfig
from .dtypes import DType, as_operand_dtype
from .frontend.trace import EpilogueProgram, as_program
from .ir.nodes import Program
from .lower.evt import EvtGraph, lower
from .passes import run_passes
from .render.cuda import render_kernel


@dataclass(frozen=True)
class Options:
    """Everything besides the program that decides the generated kernel."""
    dtype: DType
    weight_layout: str = "nk"
    config: KernelConfig | None = None      # None: the heuristic default for the program
    input_dtypes: tuple[tuple[str, str], ...] = ()
    output_dtypes: tuple[tuple[str, str], ...] = ()
    constants: tuple[tuple[str, float], ...] = ()

    @classmethod
    def make(cls, dtype: Any, weight_layout: str = "nk", config: KernelConfig | None = None,
             input_dtypes: Mapping[str, Any] | None = None, output_dtypes: Mapping[str, Any] | None = None,
             constants: Mapping[str, float] | None = None) -> "Options":
        from .dtypes import as_dtype
        return cls(
            dtype=as_operand_dtype(dtype),
            weight_layout=weight_layout,
            config=config,
            input_dtypes=tuple(sorted((k, as_dtype(v, what=f"dtype of operand '{k}'").name)
                                      for k, v in (input_dtypes or {}).items())),
            output_dtypes=tuple(sorted((k, as_dtype(v, what=f"dtype of output '{k}'").name)
                                       for k, v in (output_dtypes or {}).items())),
            constants=tuple(sorted((k, float(v)) for k, v in (constants or {}).items())),
        )


@dataclass(frozen=True)
class Lowered:
    program: EpilogueProgram
    ir: Program
    graph: EvtGraph
    source: str
    options: Options


def typed_ir(program: Any, options: Options) -> Program:
    prog = as_program(program)
    return run_passes(prog.trace(dict(options.constants)), options.dtype, dict(options.input_dtypes),
                      dict(options.output_dtypes))


def lower_program(program: Any, options: Options) -> Lowered:
    prog = as_program(program)
    ir = typed_ir(prog, options)
    if options.config is None:      # the graph does not depend on the config; pick one from it
        from .tuning.space import default_config
        options = replace(options, config=default_config(lower(ir, DEFAULT, options.dtype, options.weight_layout)))
    graph = lower(ir, options.config, options.dtype, options.weight_layout)
    from .tuning.space import check_fits
    check_fits(options.config, graph)
    return Lowered(prog, ir, graph, render_kernel(graph), options)
