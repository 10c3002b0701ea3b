"""Compute nodes: elementwise ops (``Sm90Compute`` with the op's functor), pair ops and the
fused pair rotation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...dtypes import F32, as_dtype
from ...ir.nodes import Node
from ...ir.ops import OPS, PACK_OPS, PAIR_OPS
from ..graph import VisitorNode
from .base import LowerContext, NodeKind

if TYPE_CHECKING:
    from ..plan import KernelPlan


class Compute(NodeKind):
    """An elementwise op: ``Sm90Compute`` with the op's functor. ``cast`` rounds through the node's
    output element type; packed pairs unpack/pack through ``coda::Unpack``."""
    name = "compute"
    ops = frozenset(OPS)

    def params(self, n: Node, ctx: LowerContext) -> dict[str, Any]:
        op = OPS[n.op]
        if n.op in PACK_OPS:
            functor = f"coda::Unpack<{as_dtype(n.attr('dtype')).cpp}>::{op.functor}"
        else:
            functor = f"coda::{op.functor}"
        out = as_dtype(n.attr("dtype")) if n.op == "cast" else F32
        return {"functor": functor, "element": out, "op": n.op}

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"fusion::Sm90Compute<{v.params['functor']}, {v.params['element'].cpp}, ElementCompute, RoundStyle>"

    def headers(self, v: VisitorNode, plan: "KernelPlan") -> tuple[str, ...]:
        header = OPS[v.params["op"]].header
        return (header,) if header else ()


class PairCompute(Compute):
    """A pair op over adjacent columns; checks the fragment layout keeps pairs in one thread."""
    name, header = "pair_compute", "coda/pairwise.hpp"
    ops = PAIR_OPS

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"coda::PairCompute<{v.params['functor']}, {v.params['element'].cpp}, ElementCompute, RoundStyle>"

    def headers(self, v: VisitorNode, plan: "KernelPlan") -> tuple[str, ...]:
        return (self.header,)


class PairRotate(PairCompute):
    """Rotation of each pair by its angle: one sincos per pair, reused across the tile."""
    name, header = "pair_rotate", "coda/rotate.hpp"
    ops = frozenset({"pair_rotate"})

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"coda::PairRotate<{v.params['element'].cpp}, ElementCompute, RoundStyle>"


# in match order: specific ops before the general elementwise kind
COMPUTE: tuple[NodeKind, ...] = (PairRotate(), PairCompute(), Compute())
