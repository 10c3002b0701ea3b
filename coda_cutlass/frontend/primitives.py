"""The ``cc.*`` functions usable inside epilogue programs.

Elementwise math (fp32): exp, log, sqrt, rsqrt, reciprocal, tanh, sigmoid, silu, gelu, relu, square,
abs, maximum, minimum, pow, where, cast, cos, sin; row_index / col_index (the element's position).
Pairwise over adjacent columns (2i, 2i+1): pairs, interleave, pair_map, rotate_pairs; half_width outputs;
packed 16-bit pairs: unpack (cc.PairTile operands), pack (outputs).
Reductions, returned as outputs only: row_sum/row_max/row_min (over N: one value per row),
col_sum/col_max/col_min (over M: one value per column), total_sum/total_max/total_min (all),
row_logsumexp (online log-sum-exp per row), segment_sum (per row and fixed-width column segment,
e.g. per head), gather (one column per row, chosen by a per-row index vector).
"""

from __future__ import annotations

import inspect
import math
import numbers
from typing import Any

import torch

from ..dtypes import FLOAT_DTYPES, FP8_DTYPES, as_dtype
from ..errors import ConfigError, EpilogueError
from ..ir.nodes import Kind
from .torch_functions import gelu_op
from .values import (Accumulate, HalfWidth, Number, Quantized, ReductionResult, Value, active_tracer, apply,
                     find_tracer, power)


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
def cos(x: Any) -> Any: return apply("cos", x)
def sin(x: Any) -> Any: return apply("sin", x)


def row_index() -> Value:
    """The row m of each element (fp32, exact below 2^24): a per-row value."""
    tracer = active_tracer("cc.row_index()")
    return Value(tracer, tracer.emit("index", (), Kind.ROW, axis="row"))


def col_index() -> Value:
    """The column n of each element (fp32, exact below 2^24): a per-column value."""
    tracer = active_tracer("cc.col_index()")
    return Value(tracer, tracer.emit("index", (), Kind.COL, axis="col"))


# ---------------------------------------------------------------------------------------------
# Pairwise transformations over adjacent columns (2i, 2i+1)
# ---------------------------------------------------------------------------------------------

def _pairwise_operand(x: Any, what: str) -> Any:
    if isinstance(x, (HalfWidth, Accumulate)):
        raise EpilogueError(f"{what}: takes an elementwise value")
    return x


def pairs(x: Any) -> tuple[Any, Any]:
    """``(even, odd)``: for each column pair (2i, 2i+1), x's value at column 2i and at column 2i+1,
    each available on both columns of the pair. Per-row values and numbers are the same on both."""
    _pairwise_operand(x, "cc.pairs")
    if not isinstance(x, Value) or x.kind in (Kind.ROW, Kind.SCALAR):
        if isinstance(x, (int, float, Value)):
            return x, x
        find_tracer((x,))
        raise EpilogueError(f"cc.pairs: cannot use a {type(x).__name__}")
    return apply("pair_first", x), apply("pair_second", x)


def interleave(even: Any, odd: Any) -> Any:
    """The value that is ``even`` on column 2i and ``odd`` on column 2i+1 of each pair."""
    _pairwise_operand(even, "cc.interleave")
    _pairwise_operand(odd, "cc.interleave")
    if find_tracer((even, odd)) is None:
        raise EpilogueError("cc.interleave: needs a traced value")
    return apply("pair_merge", even, odd)


def pair_map(fn: Any, x: Any, *args: Any) -> Any:
    """Pairwise 2 -> 2: ``out_2i, out_2i+1 = fn(x_2i, x_2i+1, *args)``; ``fn`` is traced like the
    rest of the program (e.g. a rotation for RoPE) and must return two values. A per-column
    ``args`` value (a ``cc.PerCol``, ``cc.col_index()``) is read at each output's own column: at 2i
    in ``out_2i``'s expression and at 2i+1 in ``out_2i+1``'s (``cc.rotate_pairs`` reads its angle at
    the pair's column 2i)."""
    # refused here, not as "cc.pairs: cannot use a function" (fn and x swapped) or a bare TypeError
    if not callable(fn):
        got = "a traced value (the function comes first)" if isinstance(fn, Value) else type(fn).__name__
        raise EpilogueError(f"cc.pair_map(fn, x, *args): fn must be a function of (x_2i, x_2i+1, *args), got {got}")
    try:
        inspect.signature(fn).bind(x, x, *args)
    except TypeError as e:
        raise EpilogueError(f"cc.pair_map: fn is called as fn(x_2i, x_2i+1, *args) with {2 + len(args)} arguments: "
                            f"{e}") from None
    except ValueError:      # no signature to check (a builtin): calling it will tell
        pass
    even, odd = pairs(x)
    result = fn(even, odd, *args)
    if not isinstance(result, tuple) or len(result) != 2:
        raise EpilogueError("cc.pair_map: the function must return a pair (out_even, out_odd)")
    return interleave(*result)


def rotate_pairs(x: Any, theta: Any) -> Any:
    """Rotate each column pair: ``out_2i = x_2i cos t - x_2i+1 sin t``, ``out_2i+1 = x_2i sin t +
    x_2i+1 cos t`` with ``t = theta`` at column 2i (RoPE, with theta = pos * freq). The same as
    ``cc.pair_map`` with a rotation, but one sine/cosine per pair and a single fused node."""
    _pairwise_operand(x, "cc.rotate_pairs")
    _pairwise_operand(theta, "cc.rotate_pairs")
    if find_tracer((x, theta)) is None:
        raise EpilogueError("cc.rotate_pairs: needs a traced value")
    return apply("pair_rotate", x, theta)


def half_width(value: Any) -> HalfWidth:
    """Mark an output as half width (pairwise 2 -> 1, e.g. SwiGLU): an M x N/2 tensor whose column i
    is ``value`` at column 2i. Compute the value from ``cc.pairs(...)``."""
    if isinstance(value, (HalfWidth, Accumulate, ReductionResult)):
        raise EpilogueError("cc.half_width takes an elementwise value")
    return HalfWidth(value)


def unpack(x: Any) -> tuple[Value, Value]:
    """The two 16-bit values of each packed pair of a ``cc.PairTile`` operand, as fp32:
    ``(x[:, 2n], x[:, 2n+1])`` for output column n."""
    if not isinstance(x, Value):
        raise EpilogueError(f"cc.unpack takes a cc.PairTile operand, got {type(x).__name__}")
    src = x.tracer.nodes[x.id]
    if not (src.op == "load" and src.attr("packed")):
        raise x.tracer.error("cc.unpack takes a cc.PairTile operand (an M x 2N tensor of pairs)", node=x.label)
    return apply("unpack_lo", x), apply("unpack_hi", x)


def pack(a: Any, b: Any) -> Value:
    """Return as an output: an M x 2N tensor holding ``a`` at column 2n and ``b`` at 2n+1, each
    rounded to the output dtype (the interleaved layout a cc.PairTile operand reads back)."""
    tracer = find_tracer((a, b))
    if tracer is None:
        raise EpilogueError("cc.pack: needs a traced value")
    return apply("pack", a, b, dtype="")   # the dtype is the output's, bound by the type pass


def gelu(x: Any, approximate: str = "none") -> Any:
    """GELU; ``approximate="tanh"`` selects the tanh form (as in ``torch.nn.functional.gelu``)."""
    return apply(gelu_op(approximate), x)


def where(cond: Any, a: Any, b: Any) -> Any:
    """``a`` where ``cond`` is non-zero, else ``b`` (comparisons give 1.0 / 0.0)."""
    return apply("where", cond, a, b)


def cast(x: Any, dtype: Any = None) -> Any:
    """Round ``x`` to ``dtype`` here (e.g. to model a bf16 intermediate); computation continues in fp32.
    Without a dtype, round it as a tile output's store does (to the GEMM dtype bound at compile
    time; not at the interpreter's "fp32" precision, which rounds no store): later math then sees
    the value a kernel reading that output back will see."""
    if dtype is None:
        if isinstance(x, (int, float)):
            raise EpilogueError("cc.cast of a Python number needs a dtype (it is rounded right away)")
        return apply("cast", x, dtype=None, as_stored=True)
    try:
        d = as_dtype(dtype, what="cast dtype")
    except ConfigError as e:
        raise EpilogueError(str(e)) from None
    if d not in FLOAT_DTYPES:
        raise EpilogueError(f"cast dtype {d.torch} is not supported; epilogue math is floating point "
                            "(bf16, f16, f32)")
    if isinstance(x, (int, float)):
        return float(torch.tensor(float(x), dtype=d.torch))  # a constant rounds right away
    return apply("cast", x, dtype=d.name)


def _reduce(x: Any, fn: str, axis: str, name: str | None = None, **attrs: Any) -> ReductionResult:
    tracer = find_tracer((x,))
    name = name or (f"{axis}_{fn}" if axis != "all" else f"total_{fn}")
    if tracer is None:
        raise EpilogueError(f"{name}: needs a traced value, got {type(x).__name__}")
    v = tracer.lift(x, name)
    kind = {"row": Kind.ROW, "col": Kind.COL, "all": Kind.SCALAR, "segment": Kind.ROW}[axis]
    nid = tracer.emit("reduce", (v.id,), kind, fn=fn, axis=axis, name="", **attrs)
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


def total_max(x: Any) -> ReductionResult:
    """Max over the whole M x N output: a 0-dim fp32 tensor (-inf when M or N is 0), e.g. the amax
    of an fp8 scale."""
    return _reduce(x, "max", "all")


def total_min(x: Any) -> ReductionResult:
    """Min over the whole M x N output: a 0-dim fp32 tensor (+inf when M or N is 0)."""
    return _reduce(x, "min", "all")


def row_logsumexp(x: Any) -> ReductionResult:
    """log(sum(exp(x))) over N: one fp32 value per row, shape (M,). Computed online per N-tile as
    (max, sum of exp(x - max)), so it is safe for large logits, -inf entries and empty tiles."""
    return _reduce(x, "lse", "row", "row_logsumexp")


def _whole(v: Any) -> Any:
    """A compile-time count as a Python int: a whole float (a float constant, def f(acc, w=64.0)) or
    a numpy integer means its int; anything else (bools included) is returned for the caller to refuse."""
    if isinstance(v, bool):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return int(v) if isinstance(v, numbers.Integral) else v


def segment_sum(x: Any, width: int) -> ReductionResult:
    """Sum over each ``width``-wide column segment of a row (e.g. per attention head): shape
    (M, N // width). N must be a multiple of width, and width a multiple of 8."""
    width = _whole(width)
    if isinstance(width, bool) or not isinstance(width, int) or width <= 0 or width % 8 != 0:
        raise EpilogueError(f"segment_sum: width must be a positive multiple of 8 known when tracing (a number or "
                            f"a constant parameter), got {width!r}")
    return _reduce(x, "sum", "segment", "segment_sum", width=width)


def gather(x: Any, index: Any) -> ReductionResult:
    """``x[m, index[m]]`` for every row m: shape (M,). ``index`` is a cc.PerRow operand (int32 or
    int64; out-of-range entries such as an ignore index give 0). Computed as a row sum of x where
    the column equals the index, so exactly one element contributes."""
    tracer = find_tracer((x, index))
    if tracer is None:
        raise EpilogueError("gather: needs a traced value")
    if not isinstance(index, Value) or index.kind != Kind.ROW:
        raise tracer.error("gather: the index must be a per-row value (a cc.PerRow operand)")
    return _reduce(where(col_index() == index, x, 0.0), "sum", "row", "gather")


QUANT_BLOCKS = (128,)
QUANT_GROUPS = (1, 16)    # columns sharing a transposed copy's run scale (1, or the W scales of "block_16x128")


def quantize(value: Any, dtype: Any = torch.float8_e4m3fn, *, scale: Any = None, block: int | None = None,
             transpose: bool = False, pow2: bool = True, group: int = 1) -> Quantized:
    """Mark an output as stored in FP8 (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``), quantised by
    the kernel that computes it. Exactly one of:

    - ``scale=s``: per tensor with a given dequantisation scale (delayed scaling): the codes are
      ``fp8(value * (1 / s))``, saturated to the format's largest finite value (NaN stays NaN). ``s``
      is a number or a traced scalar (a ``cc.DeviceScalar`` keeps it on the GPU). Return
      ``cc.amax(value)`` beside it for the next step's scale.
    - ``block=128``: per 1 x 128 run of each stored row, the run's amax computed inside the tile and
      used to scale what the same epilogue stores. The output ``name`` holds the codes and
      ``name_scale`` (fp32) the dequantisation scales, one per run: ``value ~= codes * scale``.
      ``pow2=True`` (default) rounds each scale up to a power of two (exact to apply and invert);
      ``pow2=False`` uses amax / fp8_max. A run whose amax is inf or NaN gives a NaN scale and NaN
      codes (the consumer then computes NaN: an overflow is never hidden); an all-zero run gives
      scale 1 and zero codes.

    ``transpose=True`` stores the transpose (N x M, M contiguous: the K-major operand of a weight
    gradient GEMM whose K is the token dimension); with ``block`` its runs are 128 x 1 blocks of
    the untransposed output (128 rows of one column). ``group=16`` (with ``block`` and ``transpose``)
    gives 16 neighbouring stored rows (output columns) one scale per run: 128 x 16 blocks of the
    untransposed output, 16 x 128 blocks of the stored transpose, scales (ceil(rows / 16), runs):
    what an FP8 GEMM with ``scaling="block_16x128"`` reads as W's scales. ``value`` may be
    ``cc.half_width(v)`` (a group then counts output columns, i.e. pairs of tile columns)."""
    if isinstance(value, (Accumulate, ReductionResult, Quantized)):
        raise EpilogueError("cc.quantize takes an elementwise value or cc.half_width(value)")
    try:
        d = as_dtype(dtype, what="cc.quantize dtype")
    except ConfigError as e:
        raise EpilogueError(str(e)) from None
    if d not in FP8_DTYPES:
        raise EpilogueError(f"cc.quantize: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {d.torch}")
    if (scale is None) == (block is None):
        raise EpilogueError("cc.quantize: give exactly one of scale= (per tensor, a given scale) or block=128 "
                            "(scales computed per 1 x 128 run inside the tile)")
    block, group = _whole(block), _whole(group)
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block not in QUANT_BLOCKS):
        raise EpilogueError(f"cc.quantize: block must be one of {QUANT_BLOCKS} (the blockwise FP8 GEMMs read "
                            f"1 x 128 scales), got {block!r}")
    if not isinstance(transpose, bool) or not isinstance(pow2, bool):
        raise EpilogueError("cc.quantize: transpose and pow2 are True or False")
    if isinstance(group, bool) or not isinstance(group, int) or group not in QUANT_GROUPS:
        raise EpilogueError(f"cc.quantize: group must be one of {QUANT_GROUPS} (stored rows sharing a run's scale), "
                            f"got {group!r}")
    if group != 1 and (block is None or not transpose):
        raise EpilogueError("cc.quantize: group= applies to transposed copies with block scales "
                            "(cc.quantize(v, block=128, transpose=True, group=16)); a row-major output's runs "
                            "are 1 x 128 of one row")
    if scale is not None and not pow2:
        raise EpilogueError("cc.quantize: pow2= applies to block scales; with scale= the scale is given")
    if isinstance(scale, (HalfWidth, Accumulate, ReductionResult, Quantized)):
        raise EpilogueError("cc.quantize: scale must be a number or a traced scalar value")
    if isinstance(scale, bool) or (isinstance(scale, Number) and not (0 < float(scale) < math.inf)):
        raise EpilogueError(f"cc.quantize: scale={scale!r}: a dequantisation scale (value ~ code * scale) is a "
                            "positive finite number")
    return Quantized(value, d, scale, block, transpose, pow2, group)


def amax(x: Any) -> ReductionResult:
    """max |x| over the whole output: a 0-dim fp32 tensor, NaN when any element is NaN (the amax an
    FP8 recipe keeps a history of). The same as ``cc.total_max(cc.abs(x))``."""
    return _reduce(apply("abs", x), "max", "all", "amax")


def accumulate(value: Any) -> Accumulate:
    """Mark an output as accumulated: the caller passes the tensor and it is updated ``out += value``."""
    if isinstance(value, (Accumulate, ReductionResult)):
        raise EpilogueError("cc.accumulate takes an elementwise value (not a reduction or another accumulate)")
    if isinstance(value, Quantized):
        raise EpilogueError("cc.accumulate takes an elementwise value, not cc.quantize(...): an accumulated "
                            "output is updated in the dtype of the tensor passed (out += value)")
    return Accumulate(value)
