"""The front half of the compiler, shared by emit, compile and reference: program -> typed IR ->
EVT graph (``lower_program``, once per program and options) -> kernel plan and CUDA source for a
configuration (``generate``, once per configuration). No nvcc, no GPU."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

from .config import KernelConfig
from .dtypes import DType, as_dtype, as_operand_dtype
from .frontend.trace import EpilogueProgram, as_program
from .ir.nodes import Program
from .lower.evt import lower
from .lower.graph import EvtGraph
from .lower.plan import KernelPlan, plan
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
    """A program traced, typed and lowered: everything that does not depend on the configuration."""
    program: EpilogueProgram
    ir: Program
    graph: EvtGraph
    options: Options               # as asked for (config may be None)


@dataclass(frozen=True)
class Generated:
    """A lowered program planned with one configuration, and its CUDA source."""
    lowered: Lowered
    plan: KernelPlan
    source: str

    @property
    def program(self) -> EpilogueProgram:
        return self.lowered.program

    @property
    def ir(self) -> Program:
        return self.lowered.ir

    @property
    def graph(self) -> EvtGraph:
        return self.lowered.graph

    @property
    def config(self) -> KernelConfig:
        return self.plan.config

    @property
    def options(self) -> Options:
        """The options with the configuration that was used."""
        return replace(self.lowered.options, config=self.plan.config)


def typed_ir(program: Any, options: Options) -> Program:
    prog = as_program(program)
    return run_passes(prog.trace(dict(options.constants)), options.dtype, dict(options.input_dtypes),
                      dict(options.output_dtypes))


def lower_program(program: Any, options: Options) -> Lowered:
    prog = as_program(program)
    ir = typed_ir(prog, options)
    return Lowered(prog, ir, lower(ir), options)


def generate(lowered: Lowered, config: KernelConfig | None = None) -> Generated:
    """Plan and render ``lowered`` with ``config`` (default: the options' config, else the heuristic
    default for the program)."""
    kplan = plan(lowered.graph, config or lowered.options.config, lowered.options.weight_layout)
    return Generated(lowered, kplan, render_kernel(kplan))
