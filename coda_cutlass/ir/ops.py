"""The elementwise op table: one entry per compute op, the single source of truth for tracing,
the reference interpreter and lowering.

Each op computes in fp32. ``functor`` names the C++ functor (in ``templates/coda/functors.hpp``
unless ``header`` names another coda header); ``ref`` is the torch implementation on fp32 tensors
that the interpreter runs. The op families below are the only place op names are grouped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .kind import Kind

Tensor = torch.Tensor


@dataclass(frozen=True)
class OpDef:
    name: str
    arity: int
    functor: str
    ref: Callable[..., Tensor]
    doc: str
    header: str | None = None   # the coda header defining the functor, beyond functors.hpp


def _cmp(fn: Callable[[Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
    return lambda a, b: fn(a, b).to(torch.float32)


_SQRT_HALF = 1.0 / math.sqrt(2.0)

_OPS: list[OpDef] = [
    OpDef("add", 2, "add", torch.add, "a + b"),
    OpDef("sub", 2, "sub", torch.sub, "a - b"),
    OpDef("mul", 2, "mul", torch.mul, "a * b"),
    OpDef("div", 2, "div", torch.div, "a / b (IEEE division)"),
    OpDef("neg", 1, "neg", torch.neg, "-a"),
    OpDef("abs", 1, "abs", torch.abs, "|a|"),
    OpDef("maximum", 2, "maximum", torch.maximum, "max(a, b), NaN-propagating"),
    OpDef("minimum", 2, "minimum", torch.minimum, "min(a, b), NaN-propagating"),
    OpDef("exp", 1, "exp_fast", torch.exp, "e^a (hardware exp2: ~1e-6 relative)", "coda/exp_math.hpp"),
    OpDef("log", 1, "log", torch.log, "natural log"),
    OpDef("sqrt", 1, "sqrt", torch.sqrt, "square root"),
    OpDef("rsqrt", 1, "rsqrt", torch.rsqrt, "1 / sqrt(a)"),
    OpDef("reciprocal", 1, "reciprocal", torch.reciprocal, "1 / a"),
    OpDef("tanh", 1, "tanh", torch.tanh, "hyperbolic tangent"),
    OpDef("sigmoid", 1, "sigmoid_fast", torch.sigmoid, "1 / (1 + e^-a) (hardware exp2 and reciprocal)",
          "coda/exp_math.hpp"),
    OpDef("silu", 1, "silu_fast", F.silu, "a * sigmoid(a) (hardware exp2 and reciprocal)", "coda/exp_math.hpp"),
    OpDef("gelu", 1, "gelu_exact", F.gelu, "GELU, exact (erf) form", "coda/gelu.hpp"),
    OpDef("gelu_tanh", 1, "gelu_tanh", lambda a: F.gelu(a, approximate="tanh"), "GELU, tanh approximation"),
    OpDef("relu", 1, "relu", torch.relu, "max(a, 0)"),
    OpDef("square", 1, "square", torch.square, "a * a"),
    OpDef("pow", 2, "pow", torch.pow, "a ** b (b is a constant)"),
    OpDef("lt", 2, "lt", _cmp(torch.lt), "1.0 if a < b else 0.0"),
    OpDef("le", 2, "le", _cmp(torch.le), "1.0 if a <= b else 0.0"),
    OpDef("gt", 2, "gt", _cmp(torch.gt), "1.0 if a > b else 0.0"),
    OpDef("ge", 2, "ge", _cmp(torch.ge), "1.0 if a >= b else 0.0"),
    OpDef("eq", 2, "eq", _cmp(torch.eq), "1.0 if a == b else 0.0"),
    OpDef("ne", 2, "ne", _cmp(torch.ne), "1.0 if a != b else 0.0"),
    OpDef("where", 3, "select", lambda c, a, b: torch.where(c != 0, a, b), "a if c != 0 else b"),
    # cast rounds to attrs['dtype'] and back to fp32; its functor is the identity, the rounding
    # comes from the visitor node's output element type.
    OpDef("cast", 1, "identity", lambda a: a, "round to a dtype"),
    OpDef("cos", 1, "cos", torch.cos, "cosine (radians)", "coda/math_extra.hpp"),
    OpDef("sin", 1, "sin", torch.sin, "sine (radians)", "coda/math_extra.hpp"),
    # Pairwise ops over adjacent columns (2i, 2i+1); fragment-local on the GPU (coda/pairwise.hpp).
    OpDef("pair_first", 1, "pair_first", lambda a: _pair_pick(a, 0), "x[2i] on both columns of pair i"),
    OpDef("pair_second", 1, "pair_second", lambda a: _pair_pick(a, 1), "x[2i+1] on both columns of pair i"),
    OpDef("pair_merge", 2, "pair_merge", lambda a, b: _pair_merge(a, b), "a on even columns, b on odd"),
    OpDef("pair_rotate", 2, "pair_rotate", lambda x, t: _pair_rotate(x, t),
          "rotate each pair (x_2i, x_2i+1) by the angle theta_2i"),
    # Packed 2 x 16-bit pairs (attrs dtype): a packed value is M x 2N, its pairs are (2j, 2j+1).
    OpDef("unpack_lo", 1, "lo", lambda a: a[..., 0::2], "the even value of each packed pair", "coda/pairwise.hpp"),
    OpDef("unpack_hi", 1, "hi", lambda a: a[..., 1::2], "the odd value of each packed pair", "coda/pairwise.hpp"),
    OpDef("pack", 2, "pack", lambda a, b: torch.stack((a, b), -1).flatten(-2), "pack (a, b) into pairs",
          "coda/pairwise.hpp"),
]


def _pair_pick(x: Tensor, which: int) -> Tensor:
    pairs = x.unflatten(-1, (-1, 2))
    return pairs[..., which:which + 1].expand(pairs.shape).flatten(-2)


def _pair_merge(a: Tensor, b: Tensor) -> Tensor:
    a, b = torch.broadcast_tensors(a, b)
    return torch.stack((a.unflatten(-1, (-1, 2))[..., 0], b.unflatten(-1, (-1, 2))[..., 1]), -1).flatten(-2)


def _pair_rotate(x: Tensor, theta: Tensor) -> Tensor:
    x, theta = torch.broadcast_tensors(x, theta)
    p = x.unflatten(-1, (-1, 2))
    t = theta.unflatten(-1, (-1, 2))[..., 0]
    c, s = torch.cos(t), torch.sin(t)
    a, b = p[..., 0], p[..., 1]
    return torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)


# ---- op families ----
PAIR_PICK_OPS = frozenset({"pair_first", "pair_second"})   # one column of each pair, on both columns
INTERLEAVING_OPS = frozenset({"pair_merge", "pair_rotate"})  # results differ between the two columns
PAIR_OPS = PAIR_PICK_OPS | INTERLEAVING_OPS                # fragment-local ops over (2i, 2i+1)
UNPACK_OPS = frozenset({"unpack_lo", "unpack_hi"})         # the only ops that may read a packed load
PACK_OPS = UNPACK_OPS | {"pack"}                           # round through a 16-bit attrs dtype
DTYPE_OPS = PACK_OPS | {"cast"}                            # carry attrs dtype

OPS: dict[str, OpDef] = {op.name: op for op in _OPS}


def result_kind(op: str, kinds: list[Kind]) -> Kind:
    """The kind of an op's result: the broadcast of its inputs, except that interleaving two values
    that do not vary along N gives one that does."""
    kind = Kind.SCALAR
    for k in kinds:
        kind = kind.join(k)
    if op in INTERLEAVING_OPS:
        kind = {Kind.ROW: Kind.TILE, Kind.SCALAR: Kind.COL}.get(kind, kind)
    return kind


def opdef(name: str) -> OpDef:
    return OPS[name]


def is_compute(name: str) -> bool:
    return name in OPS
