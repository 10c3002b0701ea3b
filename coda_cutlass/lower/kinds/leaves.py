"""Leaf nodes: the accumulator, element indices, tensor operands (the C load, Aux loads, per-row
and per-column broadcasts), runtime scalars and constants."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...ir.nodes import Kind, Node
from ..graph import VisitorNode
from .base import LowerContext, NodeKind, Staging, element, float_literal

if TYPE_CHECKING:
    from ..plan import KernelPlan


class AccFetch(NodeKind):
    name = "acc"
    ops = frozenset({"acc"})

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return "fusion::Sm90AccFetch"


class IndexFetch(NodeKind):
    name, header = "index", "coda/coordinates.hpp"
    ops = frozenset({"index"})

    def params(self, n: Node, ctx: LowerContext) -> dict[str, Any]:
        return {"axis": 0 if n.attr("axis") == "row" else 1}

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"coda::IndexFetch<{v.params['axis']}>"


class _Load(NodeKind):
    def params(self, n: Node, ctx: LowerContext) -> dict[str, Any]:
        slot = ctx.slot(n.attr("operand"))
        return {"slot": slot.index, "element": element(slot)}

    def _pointer(self, v: VisitorNode) -> str:
        e = v.params["element"].cpp
        return f"static_cast<{e} const*>(p.tensors[{v.params['slot']}]), {e}(0)"


class SrcFetch(_Load):
    """The first tile input, read by the collective's C load."""
    name = "src"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "load" and n.kind == Kind.TILE and n.attr("operand") == ctx.c_operand

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return "fusion::Sm90SrcFetch<ElementC>"


class AuxLoad(_Load):
    """Further tile inputs: TMA loads staged in shared memory next to C."""
    name = "aux_load"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "load" and n.kind == Kind.TILE

    def declaration(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return (f"using AuxLoadDesc{v.index} = cutlass::epilogue::collective::detail::AuxLoadDescriptor<"
                f"EpilogueDescriptor, StrideTile, {v.params['element'].cpp}>;")

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        i = v.index
        return (f"fusion::Sm90AuxLoad<\n      AuxLoadDesc{i}::Stages, typename EpilogueDescriptor::EpilogueTile, "
                f"{v.params['element'].cpp},\n      StrideTile, typename AuxLoadDesc{i}::SmemLayoutAtom, "
                f"typename AuxLoadDesc{i}::CopyOpS2R>")

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"{{{self._pointer(v)}, tile_stride(p.ld[{v.params['slot']}])}}"

    def smem_bytes(self, v: VisitorNode, staging: Staging) -> int:
        return staging.elems * v.params["element"].bits // 8 * staging.stages_c


class PerRowBroadcast(_Load):
    name = "row_vec"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "load" and n.kind == Kind.ROW

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"fusion::Sm90ColBroadcast<0, TileShape, {v.params['element'].cpp}, ElementCompute, StridePerRow>"

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"{{{self._pointer(v)}, {{}}}}"


class PerColBroadcast(PerRowBroadcast):
    name = "col_vec"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "load" and n.kind == Kind.COL

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"fusion::Sm90RowBroadcast<0, TileShape, {v.params['element'].cpp}, ElementCompute, StridePerCol>"

    def smem_bytes(self, v: VisitorNode, staging: Staging) -> int:
        return staging.tile_n * v.params["element"].bits // 8


class DeviceScalarLoad(_Load):
    """A cc.DeviceScalar: one fp32 value read from device memory by every thread."""
    name = "device_scalar"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "load" and n.kind == Kind.SCALAR

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return "fusion::Sm90ScalarBroadcast<ElementCompute, StrideScalar>"

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"{{{{0.0f}}, {{static_cast<float const*>(p.tensors[{v.params['slot']}])}}, {{}}}}"


class ScalarBroadcast(NodeKind):
    """A runtime scalar operand."""
    name = "scalar"
    ops = frozenset({"scalar"})

    def params(self, n: Node, ctx: LowerContext) -> dict[str, Any]:
        return {"scalar": ctx.scalars.index(n.attr("operand"))}

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return "fusion::Sm90ScalarBroadcast<ElementCompute, StrideScalar>"

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"{{{{p.scalars[{v.params['scalar']}]}}, {{nullptr}}, {{}}}}"


class Constant(ScalarBroadcast):
    """A Python constant, baked into the arguments as a float literal."""
    name = "const"
    ops = frozenset({"const"})

    def params(self, n: Node, ctx: LowerContext) -> dict[str, Any]:
        return {"literal": float_literal(n.attr("value"))}

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"{{{{{v.params['literal']}}}, {{nullptr}}, {{}}}}"


ACC = AccFetch()
# in match order: the C load before other tile loads
LEAVES: tuple[NodeKind, ...] = (ACC, IndexFetch(), SrcFetch(), AuxLoad(), PerRowBroadcast(), PerColBroadcast(),
                                DeviceScalarLoad(), ScalarBroadcast(), Constant())
