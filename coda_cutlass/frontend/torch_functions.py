"""Which familiar torch functions (``torch.sigmoid(x)``, ``F.silu(x)``) epilogue programs may call on
traced values, and the IR op each one maps to. Data only: ``values.Value.__torch_function__``
records the op; anything not listed is refused with the list of what is supported."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..errors import EpilogueError

# torch function -> (IR op, number of positional arguments). "pow" goes through values.power
# (cheaper ops for common exponents); F.gelu takes its ``approximate`` keyword (gelu_op).
TORCH_OPS: dict[Any, tuple[str, int]] = {
    torch.add: ("add", 2), torch.sub: ("sub", 2), torch.mul: ("mul", 2), torch.div: ("div", 2),
    torch.maximum: ("maximum", 2), torch.minimum: ("minimum", 2),
    torch.lt: ("lt", 2), torch.le: ("le", 2), torch.gt: ("gt", 2), torch.ge: ("ge", 2),
    torch.eq: ("eq", 2), torch.ne: ("ne", 2),
    torch.neg: ("neg", 1), torch.abs: ("abs", 1), torch.exp: ("exp", 1), torch.log: ("log", 1),
    torch.sqrt: ("sqrt", 1), torch.rsqrt: ("rsqrt", 1), torch.reciprocal: ("reciprocal", 1),
    torch.tanh: ("tanh", 1), torch.sigmoid: ("sigmoid", 1), torch.relu: ("relu", 1),
    torch.square: ("square", 1), torch.pow: ("pow", 2), torch.where: ("where", 3),
    torch.cos: ("cos", 1), torch.sin: ("sin", 1),
    F.silu: ("silu", 1), F.relu: ("relu", 1), F.sigmoid: ("sigmoid", 1), F.tanh: ("tanh", 1),
    F.gelu: ("gelu", 1),
}

GELU_OPS = {"none": "gelu", "tanh": "gelu_tanh"}

CAPTURED_TENSOR = ("a torch.Tensor was captured inside the epilogue; pass tensors as operands (cc.Tile, cc.PerRow, "
                   "cc.PerCol) and numbers as Python constants or cc.Scalar")


def gelu_op(approximate: str) -> str:
    """The IR op of GELU with torch's ``approximate`` argument."""
    if approximate not in GELU_OPS:
        raise EpilogueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return GELU_OPS[approximate]


def public_name(func: Any) -> str:
    """The name a user calls a torch function by (torch.clamp, torch.nn.functional.softplus): its
    __qualname__ is an internal one for many (_VariableFunctionsClass.clamp, special_erf)."""
    name = getattr(func, "__name__", None)
    if name:
        for prefix, module in (("torch", torch), ("torch.nn.functional", F), ("torch.special", torch.special)):
            for attr in (name, name.removeprefix("special_")):
                if getattr(module, attr, None) is func:
                    return f"{prefix}.{attr}"
    return getattr(func, "__qualname__", name or repr(func))


def plain_call(func: Any, args: tuple, kwargs: dict) -> tuple[str, tuple]:
    """(IR op, arguments) of a supported torch call. Accepts torch's extra keyword arguments when
    they are harmless (inplace=False, out=None); refuses the rest, naming what is supported."""
    entry = TORCH_OPS.get(func)
    name = getattr(func, "__name__", "op")
    # ``tensor + x`` with a captured tensor on the left arrives as Tensor.add, which is not listed:
    # name the captured tensor, not the op (the op, add, is supported)
    if entry is None and any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
        raise EpilogueError(f"{name}: {CAPTURED_TENSOR}")
    if entry is None:
        supported = sorted({getattr(f, "__name__", "?") for f in TORCH_OPS})
        raise EpilogueError(f"torch function {public_name(func)} is not supported on traced epilogue values; "
                            f"supported: {', '.join(supported)} (or the cc.* functions)")
    op, arity = entry
    kwargs = dict(kwargs)
    if func is F.gelu:
        op = gelu_op(kwargs.pop("approximate", args[1] if len(args) > 1 else "none"))
        args = args[:1]
    if kwargs.pop("inplace", False) or kwargs.pop("out", None) is not None or kwargs or len(args) != arity:
        raise EpilogueError(f"{name}: only the plain functional form is supported in epilogue programs "
                            "(no inplace=, out= or extra arguments)")
    return op, args
