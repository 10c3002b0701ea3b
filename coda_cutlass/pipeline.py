"""The front half of the compiler, shared by emit, compile and reference: program -> typed IR ->
EVT graph (``lower_program``, once per program and options) -> kernel plan and CUDA source for a
configuration (``generate``, once per configuration). No nvcc, no GPU."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .config import KernelConfig
from .dtypes import FLOAT_DTYPES, FP8_DTYPES, DType, as_dtype, as_operand_dtype
from .errors import ArgumentError, ConfigError
from .fp8.gemm import EPILOGUE_DTYPE, Fp8Gemm, fp8_gemm
from .frontend.trace import EpilogueProgram, as_program, constant_value
from .ir.nodes import Program
from .lower.evt import lower
from .lower.graph import EvtGraph
from .lower.plan import KernelPlan, plan
from .passes import run_passes
from .render.cuda import render_kernel


@dataclass(frozen=True)
class Options:
    """Everything besides the program that decides the generated kernel.

    ``dtype`` is the GEMM operand dtype of a 16-bit GEMM, which is also the default dtype of tile
    inputs and outputs. An FP8 GEMM has ``fp8`` (A's and W's dtypes, the scaling, the accumulation)
    and ``dtype`` bf16, the default of its tile inputs and outputs."""
    dtype: DType
    weight_layout: str = "nk"
    config: KernelConfig | None = None      # None: the heuristic default for the program
    input_dtypes: tuple[tuple[str, str], ...] = ()
    output_dtypes: tuple[tuple[str, str], ...] = ()
    constants: tuple[tuple[str, float], ...] = ()
    fp8: Fp8Gemm | None = None              # FP8 operands (coda_cutlass/fp8); None: 16-bit operands

    @classmethod
    def make(cls, dtype: Any, weight_layout: str = "nk", config: KernelConfig | None = None,
             input_dtypes: Mapping[str, Any] | None = None, output_dtypes: Mapping[str, Any] | None = None,
             constants: Mapping[str, float] | None = None, scaling: str | None = None,
             fast_accum: bool = False) -> "Options":
        if config is not None and not isinstance(config, KernelConfig):
            raise ArgumentError(f"config must be a KernelConfig or None (the heuristic default), got {config!r}"
                                + (" (config='tune' is for cc.compile_epilogue)" if config == "tune" else ""))
        if not isinstance(weight_layout, str):
            raise ArgumentError(f"weight_layout must be 'nk' or 'kn', got {weight_layout!r}")
        fp8 = fp8_gemm(dtype, scaling, fast_accum)
        if fp8 is not None:
            check_fp8_layout(weight_layout)
        return cls(
            dtype=EPILOGUE_DTYPE if fp8 is not None else as_operand_dtype(dtype),
            weight_layout=weight_layout,
            config=config,
            input_dtypes=tuple(sorted((k, as_dtype(v, what=f"dtype of operand '{k}'").name)
                                      for k, v in _mapping(input_dtypes, "input_dtypes"))),
            output_dtypes=tuple(sorted((k, as_dtype(v, what=f"dtype of output '{k}'",
                                                    allowed=FLOAT_DTYPES + FP8_DTYPES).name)
                                       for k, v in _mapping(output_dtypes, "output_dtypes"))),
            constants=tuple(sorted((k, constant_value(v, f"constants['{k}']"))
                                   for k, v in _mapping(constants, "constants"))),
            fp8=fp8,
        )

    @property
    def operand_text(self) -> str:
        """The GEMM operands in words, for messages: 'torch.bfloat16' or 'e4m3 x e4m3, tensor scaling'."""
        return self.fp8.describe() if self.fp8 is not None else str(self.dtype.torch)


def check_fp8_layout(weight_layout: str) -> None:
    """Hopper's FP8 wgmma reads K-major operands only: A (M, K) and W (N, K) row-major."""
    if weight_layout == "kn":
        raise ConfigError("W: FP8 operands must be K-major: W as (N, K) with K contiguous (weight_layout='nk', "
                          "as nn.Linear stores it). Hopper's FP8 tensor-core instructions read K-major tiles only, "
                          "and CUTLASS's FP8 fast-accumulation and blockwise-scaled mainloops accept no other "
                          "layout; a (K, N) weight needs a transposed FP8 copy (W8.t().contiguous())")


def _mapping(m: Mapping[str, Any] | None, what: str) -> list[tuple[str, Any]]:
    """The items of a name -> value option (None: none); a clear error for anything else."""
    if m is None:
        return []
    if not isinstance(m, Mapping):
        raise ArgumentError(f"{what} must be a dict of name -> value, got {type(m).__name__}")
    bad = [k for k in m if not isinstance(k, str)]
    if bad:
        raise ArgumentError(f"{what}: names must be strings, got {bad[0]!r}")
    return list(m.items())


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
    """The program traced and typed; an FP8 GEMM's operands are recorded in its metadata ("fp8"),
    where lowering and the interpreter find them."""
    prog = as_program(program)
    ir = run_passes(prog.trace(dict(options.constants)), options.dtype, dict(options.input_dtypes),
                    dict(options.output_dtypes))
    if options.fp8 is None:
        return ir
    return replace(ir, meta={**ir.meta, "fp8": options.fp8.to_meta()})


def lower_program(program: Any, options: Options) -> Lowered:
    prog = as_program(program)
    ir = typed_ir(prog, options)
    return Lowered(prog, ir, lower(ir), options)


def generate(lowered: Lowered, config: KernelConfig | None = None) -> Generated:
    """Plan and render ``lowered`` with ``config`` (default: the options' config, else the heuristic
    default for the program)."""
    kplan = plan(lowered.graph, config or lowered.options.config, lowered.options.weight_layout)
    return Generated(lowered, kplan, render_kernel(kplan))
