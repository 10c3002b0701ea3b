"""Let epilogue programs call familiar torch functions (``torch.sigmoid(x)``, ``F.silu(x)``) on traced
values; each maps onto an IR op. Anything else is refused with the list of what is supported."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..errors import EpilogueError
from . import primitives as P
from .values import Value, apply


def _binary(op: str) -> Callable[..., Any]:
    return _plain(lambda a, b: apply(op, a, b), 2, op)


def _gelu(x: Any, approximate: str = "none") -> Any:
    return P.gelu(x, approximate=approximate)


def _pow(x: Any, exponent: Any) -> Any:
    return P.pow(x, exponent)


def _where(cond: Any, a: Any, b: Any) -> Any:
    return P.where(cond, a, b)


def _plain(fn: Callable[..., Any], arity: int = 1, name: str = "") -> Callable[..., Any]:
    """Accept torch's extra keyword arguments when they are harmless (inplace=False, out=None)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs.pop("inplace", False) or kwargs.pop("out", None) is not None or kwargs or len(args) != arity:
            raise EpilogueError(f"{name or getattr(fn, '__name__', 'op')}: only the plain functional form is supported "
                                "in epilogue programs (no inplace=, out= or extra arguments)")
        return fn(*args)
    return call


TORCH_FUNCTIONS: dict[Any, Callable[..., Any]] = {
    torch.add: _binary("add"), torch.sub: _binary("sub"), torch.mul: _binary("mul"),
    torch.div: _binary("div"), torch.maximum: _binary("maximum"), torch.minimum: _binary("minimum"),
    torch.lt: _binary("lt"), torch.le: _binary("le"), torch.gt: _binary("gt"), torch.ge: _binary("ge"),
    torch.eq: _binary("eq"), torch.ne: _binary("ne"),
    torch.neg: _plain(lambda x: apply("neg", x)), torch.abs: _plain(P.abs), torch.exp: _plain(P.exp),
    torch.log: _plain(P.log), torch.sqrt: _plain(P.sqrt), torch.rsqrt: _plain(P.rsqrt),
    torch.reciprocal: _plain(P.reciprocal), torch.tanh: _plain(P.tanh), torch.sigmoid: _plain(P.sigmoid),
    torch.relu: _plain(P.relu), torch.square: _plain(P.square), torch.pow: _plain(_pow, 2),
    torch.where: _plain(_where, 3), torch.cos: _plain(P.cos), torch.sin: _plain(P.sin),
    F.silu: _plain(P.silu), F.relu: _plain(P.relu), F.sigmoid: _plain(P.sigmoid), F.tanh: _plain(P.tanh),
    F.gelu: _gelu,
}


def dispatch_torch_function(func: Any, args: tuple, kwargs: dict) -> Any:
    impl = TORCH_FUNCTIONS.get(func)
    if impl is None:
        name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
        supported = sorted({getattr(f, "__name__", "?") for f in TORCH_FUNCTIONS.keys()})
        tracer = next((a.tracer for a in args if isinstance(a, Value)), None)
        msg = (f"torch function {name} is not supported on traced epilogue values; "
               f"supported: {', '.join(supported)} (or the cc.* functions)")
        raise tracer.error(msg) if tracer is not None else EpilogueError(msg)
    return impl(*args, **kwargs)
