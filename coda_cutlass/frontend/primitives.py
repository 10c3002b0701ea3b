"""The ``cc.*`` functions usable inside epilogue programs.

Elementwise math (fp32): exp, log, sqrt, rsqrt, reciprocal, tanh, sigmoid, silu, gelu, relu, square,
abs, maximum, minimum, pow, where, cast. Reductions, returned as outputs only: row_sum/row_max/row_min
(over N: one value per row), col_sum/col_max/col_min (over M: one value per column), total_sum (all).
"""

from __future__ import annotations

from typing import Any

from ..dtypes import as_dtype
from ..errors import ConfigError, EpilogueError
from ..ir.nodes import Kind
from .values import Accumulate, ReductionResult, Value, apply, find_tracer, power


def exp(x: Any) -> Any: return apply("exp", x)
def log(x: Any) -> Any: return apply("log", x)
def sqrt(x: Any) -> Any: return apply("sqrt", x)
def rsqrt(x: Any) -> Any: return apply("rsqrt", x)
def reciprocal(x: Any) -> Any: return apply("reciprocal", x)
def tanh(x: Any) -> Any: return apply("tanh", x)
def sigmoid(x: Any) -> Any: return apply("sigmoid", x)
def silu(x: Any) -> Any: return apply("silu", x)
def relu(x: Any) -> Any: return apply("relu", x)
def square(x: Any) -> Any: return apply("square", x)
def abs(x: Any) -> Any: return apply("abs", x)  # noqa: A001 - mirrors torch.abs
def maximum(a: Any, b: Any) -> Any: return apply("maximum", a, b)
def minimum(a: Any, b: Any) -> Any: return apply("minimum", a, b)
def pow(x: Any, exponent: float) -> Any: return power(x, exponent)  # noqa: A001


def gelu(x: Any, approximate: str = "none") -> Any:
    """GELU; ``approximate="tanh"`` selects the tanh form (as in ``torch.nn.functional.gelu``)."""
    if approximate == "none":
        return apply("gelu", x)
    if approximate == "tanh":
        return apply("gelu_tanh", x)
    raise EpilogueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")


def where(cond: Any, a: Any, b: Any) -> Any:
    """``a`` where ``cond`` is non-zero, else ``b`` (comparisons give 1.0 / 0.0)."""
    return apply("where", cond, a, b)


def cast(x: Any, dtype: Any) -> Any:
    """Round ``x`` to ``dtype`` here (e.g. to model a bf16 intermediate); computation continues in fp32."""
    try:
        d = as_dtype(dtype, what="cast dtype")
    except ConfigError as e:
        raise EpilogueError(str(e)) from None
    if isinstance(x, (int, float)):
        import torch
        return float(torch.tensor(float(x), dtype=d.torch))  # a constant rounds right away
    return apply("cast", x, dtype=d.name)


def _reduce(x: Any, fn: str, axis: str) -> ReductionResult:
    tracer = find_tracer((x,))
    name = f"{axis}_{fn}" if axis != "all" else f"total_{fn}"
    if tracer is None:
        raise EpilogueError(f"{name}: needs a traced value, got {type(x).__name__}")
    v = tracer.lift(x, name)
    kind = {"row": Kind.ROW, "col": Kind.COL, "all": Kind.SCALAR}[axis]
    nid = tracer.emit("reduce", (v.id,), kind, fn=fn, axis=axis, name="")
    return ReductionResult(tracer, nid, f"{name}(%{v.id})")


def row_sum(x: Any) -> ReductionResult:
    """Sum over N: one fp32 value per row, shape (M,)."""
    return _reduce(x, "sum", "row")


def row_max(x: Any) -> ReductionResult:
    """Max over N: one value per row, shape (M,)."""
    return _reduce(x, "max", "row")


def row_min(x: Any) -> ReductionResult:
    """Min over N: one value per row, shape (M,)."""
    return _reduce(x, "min", "row")


def col_sum(x: Any) -> ReductionResult:
    """Sum over M: one fp32 value per column, shape (N,)."""
    return _reduce(x, "sum", "col")


def col_max(x: Any) -> ReductionResult:
    """Max over M: one value per column, shape (N,)."""
    return _reduce(x, "max", "col")


def col_min(x: Any) -> ReductionResult:
    """Min over M: one value per column, shape (N,)."""
    return _reduce(x, "min", "col")


def total_sum(x: Any) -> ReductionResult:
    """Sum over the whole M x N output: a 0-dim fp32 tensor."""
    return _reduce(x, "sum", "all")


def accumulate(value: Any) -> Accumulate:
    """Mark an output as accumulated: the caller passes the tensor and it is updated ``out += value``."""
    if isinstance(value, (Accumulate, ReductionResult)):
        raise EpilogueError("cc.accumulate takes an elementwise value (not a reduction or another accumulate)")
    return Accumulate(value)
