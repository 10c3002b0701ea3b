"""Symbolic values: what an epilogue function computes with while it is traced.

Operators on ``Value`` record IR nodes in the active ``Tracer``. Python numbers mixed in become
constants. Anything the IR cannot express raises ``EpilogueError`` at the line that used it.
"""

from __future__ import annotations

import math
import numbers
import operator
import threading
from typing import Any, Callable

import torch

from ..errors import EpilogueError
from ..ir.nodes import Kind, Node, const_key, make_attrs
from ..ir.ops import OPS, UNPACK_OPS, result_kind
from .torch_functions import CAPTURED_TENSOR, plain_call

Number = (numbers.Real,)     # int, float and numpy's scalars (bool is an int: checked where it matters)


class _ActiveTracers(threading.local):
    """The programs being traced, innermost last: one stack per thread, so programs traced in
    several threads at once never see each other's traces."""

    def __init__(self) -> None:
        self.stack: list[Tracer] = []


_ACTIVE = _ActiveTracers()


def active_tracer(what: str) -> "Tracer":
    """The tracer of the program being traced in this thread (for cc.* functions that take no
    traced value)."""
    if not _ACTIVE.stack:
        raise EpilogueError(f"{what} can only be used inside an epilogue program while it is traced")
    return _ACTIVE.stack[-1]


class Tracer:
    """Collects the nodes of one program while its Python function runs."""

    def __init__(self, program: str):
        self.program = program
        self.nodes: list[Node] = []
        self._consts: dict[bytes, int] = {}

    def error(self, reason: str, node: str | None = None) -> EpilogueError:
        return EpilogueError(reason, program=self.program, node=node)

    def emit(self, op: str, inputs: tuple[int, ...], kind: Kind, **attrs: Any) -> int:
        nid = len(self.nodes)
        self.nodes.append(Node(id=nid, op=op, inputs=inputs, attrs=make_attrs(**attrs), kind=kind))
        return nid

    def const(self, value: float) -> "Value":
        """One node per constant, told apart by bit pattern (-0.0 is not 0.0; NaNs are never shared)."""
        value = float(value)
        key = const_key(value)
        if key not in self._consts or math.isnan(value):
            self._consts[key] = self.emit("const", (), Kind.SCALAR, value=value)
        return Value(self, self._consts[key])

    def __enter__(self) -> "Tracer":
        _ACTIVE.stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.stack.remove(self)

    def lift(self, x: Any, what: str) -> "Value":
        if isinstance(x, Value):
            if x.tracer is not self:
                raise self.error(f"{what}: a value from another epilogue trace was mixed in")
            return x
        if isinstance(x, HalfWidth):
            raise self.error(f"{what}: cc.half_width(...) may only appear as a value of the returned dict")
        if isinstance(x, bool):
            return self.const(1.0 if x else 0.0)
        if isinstance(x, Number):
            return self.const(number(x, what, self))
        if isinstance(x, ReductionResult):
            raise self.error(x.misuse_message(what), node=x.label)
        if isinstance(x, Accumulate):
            raise self.error(f"{what}: cc.accumulate(...) may only appear as a value of the returned dict")
        if isinstance(x, torch.Tensor):
            raise self.error(f"{what}: {CAPTURED_TENSOR}")
        raise self.error(f"{what}: cannot use a {type(x).__name__} in an epilogue program")


class TracedAttributeError(EpilogueError, AttributeError):
    """A tensor method used on a traced value: an EpilogueError, and an AttributeError for hasattr()."""


def number(x: int | float, what: str, tracer: Tracer | None = None) -> float:
    """A Python number used in a program, as a float (an int too large for one is an error)."""
    try:
        return float(x)
    except OverflowError:
        reason = f"{what}: the int {str(x)[:10]}... ({len(str(x))} digits) is too large for a float"
        raise (tracer.error(reason) if tracer else EpilogueError(reason)) from None


def find_tracer(args: tuple[Any, ...]) -> Tracer | None:
    for a in args:
        if isinstance(a, Value):
            return a.tracer
        if isinstance(a, ReductionResult):
            raise a.tracer.error(a.misuse_message("this operation"), node=a.label)
    return None


def apply(op: str, *args: Any, **attrs: Any) -> Any:
    """Record ``op(*args)``; with only Python numbers as arguments, evaluate it in fp32 right away."""
    tracer = find_tracer(args)
    opdef = OPS[op]
    if len(args) != opdef.arity:
        raise EpilogueError(f"{op} takes {opdef.arity} arguments, got {len(args)}")
    if tracer is None:
        for a in args:
            if not isinstance(a, Number):
                raise EpilogueError(f"{op}: cannot use a {type(a).__name__} in an epilogue program")
        ts = [torch.tensor(number(a, f"argument {i} of {op}"), dtype=torch.float32) for i, a in enumerate(args)]
        return float(opdef.ref(*ts))
    values = [tracer.lift(a, f"argument {i} of {op}") for i, a in enumerate(args)]
    for v in values:
        src = tracer.nodes[v.id]
        if src.op == "load" and src.attr("packed") and op not in UNPACK_OPS:
            raise tracer.error(f"{op}: '{src.attr('operand')}' holds packed pairs (cc.PairTile); "
                               "get its two values with a, b = cc.unpack(x) first", node=src.label)
        if src.op == "pack":
            raise tracer.error(f"{op}: a cc.pack(...) value can only be returned as an output", node=src.label)
    kind = result_kind(op, [v.kind for v in values])
    return Value(tracer, tracer.emit(op, tuple(v.id for v in values), kind, **attrs))


def _unsupported(symbol: str) -> Callable[..., Any]:
    def method(self: "Value", *args: Any) -> Any:
        raise self.tracer.error(f"operator {symbol} is not supported in epilogue programs", node=self.label)
    return method


class Value:
    """A symbolic fp32 value over the output tile (or a broadcast vector/scalar)."""

    __slots__ = ("tracer", "id")

    def __init__(self, tracer: Tracer, nid: int):
        self.tracer = tracer
        self.id = nid

    @property
    def kind(self) -> Kind:
        return self.tracer.nodes[self.id].kind

    @property
    def label(self) -> str:
        return self.tracer.nodes[self.id].label

    def __repr__(self) -> str:
        return f"<traced {self.kind.value} value %{self.id}>"

    __hash__ = object.__hash__

    # arithmetic
    def __add__(self, o: Any) -> "Value": return apply("add", self, o)
    def __radd__(self, o: Any) -> "Value": return apply("add", o, self)
    def __sub__(self, o: Any) -> "Value": return apply("sub", self, o)
    def __rsub__(self, o: Any) -> "Value": return apply("sub", o, self)
    def __mul__(self, o: Any) -> "Value": return apply("mul", self, o)
    def __rmul__(self, o: Any) -> "Value": return apply("mul", o, self)
    def __truediv__(self, o: Any) -> "Value": return apply("div", self, o)
    def __rtruediv__(self, o: Any) -> "Value": return apply("div", o, self)
    def __neg__(self) -> "Value": return apply("neg", self)
    def __pos__(self) -> "Value": return self
    def __abs__(self) -> "Value": return apply("abs", self)

    def __pow__(self, exponent: Any) -> "Value":
        return power(self, exponent)

    def __rpow__(self, base: Any) -> "Value":
        if not isinstance(base, Number) or isinstance(base, bool) or base <= 0:
            raise self.tracer.error("c ** x is supported only for a positive Python number c", node=self.label)
        return apply("exp", apply("mul", self, math.log(base)))

    # comparisons give 1.0 / 0.0, for cc.where
    def __lt__(self, o: Any) -> "Value": return apply("lt", self, o)
    def __le__(self, o: Any) -> "Value": return apply("le", self, o)
    def __gt__(self, o: Any) -> "Value": return apply("gt", self, o)
    def __ge__(self, o: Any) -> "Value": return apply("ge", self, o)
    def __eq__(self, o: Any) -> "Value": return apply("eq", self, o)  # type: ignore[override]
    def __ne__(self, o: Any) -> "Value": return apply("ne", self, o)  # type: ignore[override]

    # Python control flow and conversions cannot see traced values
    def __bool__(self) -> bool:
        raise self.tracer.error(
            # max()/min() end here too (they compare, then ask the result's truth value): name them,
            # since max(x, 0.0) is the usual way to write a ReLU in Python
            "a traced value has no Python truth value (if/while/and/or/not, or the builtins max()/min() on it); "
            "the epilogue runs on the GPU, so use cc.where(cond, a, b) instead (cc.maximum/cc.minimum for "
            "max/min)", node=self.label)

    def _no_number(self, *_: Any) -> Any:
        raise self.tracer.error(
            "a traced value cannot be converted to a Python number (math.* functions, float(), int(), round()); "
            "use the cc.* functions, e.g. cc.exp(x)", node=self.label)

    __float__ = __int__ = __index__ = __complex__ = __round__ = __trunc__ = __floor__ = __ceil__ = _no_number

    def __getattr__(self, name: str) -> Any:
        # only for names the class lacks: tensor methods (x.sigmoid(), x.clamp(...), x.to(...))
        if name.startswith("_"):
            raise AttributeError(name)
        hint = (f"use cc.{name}(x)" if name in OPS       # an elementwise op cc.* names the same
                else "use the cc.* functions (cc.where, cc.maximum, cc.cast, ...) or torch functions such as "
                     "torch.sigmoid(x)")
        raise TracedAttributeError(f"a traced value has no attribute '{name}' (it is not a tensor); {hint}",
                                   program=self.tracer.program, node=self.label)

    def __len__(self) -> int:
        raise self.tracer.error("a traced value has no length; it stands for one element of the tile",
                                node=self.label)

    def __iter__(self) -> Any:
        raise self.tracer.error("a traced value cannot be iterated or unpacked", node=self.label)

    def __getitem__(self, _: Any) -> Any:
        raise self.tracer.error("indexing is not supported: the program is written for one element of the "
                                "tile", node=self.label)

    __matmul__ = __rmatmul__ = _unsupported("@")
    __floordiv__ = __rfloordiv__ = _unsupported("//")
    __mod__ = __rmod__ = _unsupported("%")
    __and__ = __rand__ = _unsupported("&")
    __or__ = __ror__ = _unsupported("|")
    __xor__ = __rxor__ = _unsupported("^")
    __lshift__ = __rlshift__ = _unsupported("<<")
    __rshift__ = __rrshift__ = _unsupported(">>")
    __invert__ = _unsupported("~")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        """``torch.sigmoid(x)`` and friends on a traced value record their IR op (torch_functions)."""
        op, args = plain_call(func, args, kwargs or {})
        return power(*args) if op == "pow" else apply(op, *args)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """numpy on a traced value: its operators (``np.float32(2) * x`` comes here) work as Python's,
        any other ufunc (``np.exp(x)``) is an error naming the cc.* function to use."""
        methods = _NUMPY_OPERATORS.get(ufunc.__name__)
        # numpy hands comparisons (and 0-d arrays) over as 0-d ndarrays: their Python value
        inputs = tuple(x.item() if type(x).__module__ == "numpy" and getattr(x, "ndim", None) == 0 else x
                       for x in inputs)
        if methods is not None and method == "__call__" and not kwargs and len(inputs) == ufunc.nin:
            if isinstance(inputs[0], Value):
                return getattr(inputs[0], methods[0])(*inputs[1:])
            return getattr(inputs[1], methods[1])(inputs[0])     # e.g. np.float32(2) * x: x.__rmul__
        if method != "__call__":
            raise _numpy_error(self, f"numpy.{ufunc.__name__}.{method}", "", 0)
        raise _numpy_error(self, f"numpy.{ufunc.__name__}", ufunc.__name__, ufunc.nin)

    def __array_function__(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        """Other numpy functions (``np.clip(x, 0, 1)``, ``np.where(...)``): an error, not an object array."""
        raise _numpy_error(self, f"numpy.{func.__name__}", func.__name__, 1)


# numpy ufuncs that are Python operators on a traced value (a numpy scalar on the left, e.g.
# np.float32(2) * x, reaches Value.__array_ufunc__ rather than Value.__rmul__)
_NUMPY_OPERATORS: dict[str, tuple[str, str]] = {     # ufunc -> (Value's method, the reflected one)
    "add": ("__add__", "__radd__"), "subtract": ("__sub__", "__rsub__"), "multiply": ("__mul__", "__rmul__"),
    "true_divide": ("__truediv__", "__rtruediv__"), "divide": ("__truediv__", "__rtruediv__"),
    "power": ("__pow__", "__rpow__"), "floor_divide": ("__floordiv__", "__rfloordiv__"),
    "remainder": ("__mod__", "__rmod__"), "less": ("__lt__", "__gt__"), "less_equal": ("__le__", "__ge__"),
    "greater": ("__gt__", "__lt__"), "greater_equal": ("__ge__", "__le__"), "equal": ("__eq__", "__eq__"),
    "not_equal": ("__ne__", "__ne__"), "negative": ("__neg__", ""), "positive": ("__pos__", ""),
    "absolute": ("__abs__", "")}
_NUMPY_HINTS = {"fmax": "cc.maximum(a, b)", "fmin": "cc.minimum(a, b)", "fabs": "cc.abs(x)",
                "clip": "cc.minimum(cc.maximum(x, lo), hi)", "where": "cc.where(cond, a, b)"}


def _numpy_error(value: "Value", name: str, fn: str, nin: int) -> EpilogueError:
    hint = _NUMPY_HINTS.get(fn) or (f"cc.{fn}({'x' if nin == 1 else 'a, b'})" if fn in OPS else None)
    hint = (f"use {hint}" if hint else
            "use the cc.* functions (cc.exp, cc.maximum, cc.where, ...) or torch functions such as torch.exp(x)")
    return value.tracer.error(f"{name} cannot compute on a traced value (numpy runs on the host, the epilogue "
                              f"in the kernel); {hint}", node=value.label)


def power(x: Any, exponent: Any) -> Any:
    """``x ** c`` for a Python number ``c``; common exponents become cheaper ops."""
    if isinstance(exponent, Value) or isinstance(exponent, ReductionResult):
        tracer = exponent.tracer
        raise tracer.error("pow: the exponent must be a Python number (pow by a constant)")
    if not isinstance(exponent, Number):
        raise EpilogueError(f"pow: exponent must be a number, got {type(exponent).__name__}")
    c = number(exponent, "pow: the exponent", x.tracer if isinstance(x, Value) else None)
    if c == 1.0:
        return x
    if c == 2.0:
        return apply("square", x)
    if c == 0.5:
        return apply("sqrt", x)
    if c == -0.5:
        return apply("rsqrt", x)
    if c == -1.0:
        return apply("reciprocal", x)
    return apply("pow", x, c)


class ReductionResult:
    """The result of a cross-tile reduction: only finished after the kernel, so it can only be returned."""

    __slots__ = ("tracer", "id", "desc")

    def __init__(self, tracer: Tracer, nid: int, desc: str):
        self.tracer = tracer
        self.id = nid
        self.desc = desc

    @property
    def label(self) -> str:
        return f"%{self.id} ({self.desc})"

    def misuse_message(self, what: str) -> str:
        node = self.tracer.nodes[self.id]
        if node.attr("axis") == "segment":
            operand = "a cc.Tile operand: its shape is (M, N / width)"
        else:
            operand = {Kind.ROW: "a cc.PerRow operand", Kind.COL: "a cc.PerCol operand",
                       Kind.SCALAR: "a cc.Scalar operand"}[node.kind]
        return (f"{what} uses the result of {self.desc}, a reduction across the whole tile grid that is "
                "only finished after the kernel; it cannot be used later in the same epilogue. Return it "
                f"as an output and pass it to the next kernel (e.g. as {operand})")

    def _misuse(self, *_: Any) -> Any:
        raise self.tracer.error(self.misuse_message("an expression"), node=self.label)

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _misuse
    __truediv__ = __rtruediv__ = __pow__ = __rpow__ = __neg__ = __abs__ = _misuse
    __lt__ = __le__ = __gt__ = __ge__ = _misuse
    __bool__ = __float__ = __int__ = _misuse

    def __repr__(self) -> str:
        return f"<reduction {self.desc}>"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        for a in list(args) + list((kwargs or {}).values()):
            if isinstance(a, ReductionResult):
                a._misuse()
        raise EpilogueError("unexpected torch function on a reduction result")


class _OutputMarker:
    """Wraps a value that may only be a value of the returned dict (cc.half_width, cc.accumulate)."""

    __slots__ = ("value",)
    marker = ""

    def __init__(self, value: Any):
        self.value = value

    def _misuse(self, *_: Any) -> Any:
        raise EpilogueError(f"{self.marker}(...) may only appear as a value of the returned dict, not in an "
                            "expression; apply it to the finished value")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _misuse
    __truediv__ = __rtruediv__ = __pow__ = __rpow__ = __neg__ = __abs__ = _misuse
    __lt__ = __le__ = __gt__ = __ge__ = __bool__ = __float__ = _misuse


class HalfWidth(_OutputMarker):
    """``cc.half_width(v)`` in the returned dict: an M x N/2 output holding v's value on the even
    column of each pair (2i, 2i+1), written at column i."""

    __slots__ = ()
    marker = "cc.half_width"


class Quantized(_OutputMarker):
    """``cc.quantize(v, ...)`` in the returned dict: an FP8 output (and, with ``block``, its scales)."""

    __slots__ = ("dtype", "scale", "block", "transpose", "pow2", "group")
    marker = "cc.quantize"

    def __init__(self, value: Any, dtype: Any, scale: Any, block: int | None, transpose: bool, pow2: bool,
                 group: int = 1):
        super().__init__(value)
        self.dtype, self.scale, self.block, self.transpose, self.pow2 = dtype, scale, block, transpose, pow2
        self.group = group


class Accumulate(_OutputMarker):
    """``cc.accumulate(v)`` in the returned dict: the output tensor is passed in and updated in place."""

    __slots__ = ()
    marker = "cc.accumulate"
