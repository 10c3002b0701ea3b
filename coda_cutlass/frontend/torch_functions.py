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
    return lambda a, b, **_: apply(op, a, b)


def _gelu(x: Any, approximate: str = "none") -> Any:
    return P.gelu(x, approximate=approximate)


def _pow(x: Any, exponent: Any) -> Any:
    return P.pow(x, exponent)


def _where(cond: Any, a: Any, b: Any) -> Any:
    return P.where(cond, a, b)


TORCH_FUNCTIONS: dict[Any, Callable[..., Any]] = {
    torch.add: _binary("add"), torch.sub: _binary("sub"), torch.mul: _binary("mul"),
    torch.div: _binary("div"), torch.maximum: _binary("maximum"), torch.minimum: _binary("minimum"),
    torch.neg: lambda x: apply("neg", x),
    torch.abs: P.abs, torch.exp: P.exp, torch.log: P.log, torch.sqrt: P.sqrt, torch.rsqrt: P.rsqrt,
    torch.reciprocal: P.reciprocal, torch.tanh: P.tanh, torch.sigmoid: P.sigmoid, torch.relu: P.relu,
    torch.square: P.square, torch.pow: _pow, torch.where: _where,
    F.silu: P.silu, F.relu: P.relu, F.gelu: _gelu, F.sigmoid: P.sigmoid, F.tanh: P.tanh,
    torch.lt: _binary("lt"), torch.le: _binary("le"), torch.gt: _binary("gt"), torch.ge: _binary("ge"),
    torch.eq: _binary("eq"), torch.ne: _binary("ne"),
}


def dispatch_torch_function(func: Any, args: tuple, kwargs: dict) -> Any:
    impl = TORCH_FUNCTIONS.get(func)
    if impl is None:
        name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
        supported = sorted({getattr(f, "__name__", "?") for f in TORCH_FUNCTIONS})
        tracer = next((a.tracer for a in args if isinstance(a, Value)), None)
        msg = (f"torch function {name} is not supported on traced epilogue values; "
               f"supported: {', '.join(supported)} (or the cc.* functions)")
        raise tracer.error(msg) if tracer is not None else EpilogueError(msg)
    return impl(*args, **kwargs)
