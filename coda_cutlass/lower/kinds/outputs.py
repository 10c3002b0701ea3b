"""Output nodes: tile stores (Aux stores, half-width stores, the collective's D) and reductions
written as per-tile partials (their buffers are described by the slot's ``PartialLayout``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...ir.nodes import Node
from ..graph import VisitorNode
from .base import LowerContext, NodeKind, Staging, element

if TYPE_CHECKING:
    from ..plan import KernelPlan


class AuxStore(NodeKind):
    """A tile output other than D: staged in shared memory, stored by TMA."""
    name = "aux_store"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "store"

    def params(self, n: Node, ctx: LowerContext) -> dict[str, Any]:
        slot = ctx.slot(n.attr("name"))
        return {"slot": slot.index, "element": element(slot)}

    def declaration(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return (f"using AuxStoreDesc{v.index} = cutlass::epilogue::collective::detail::AuxStoreDescriptor<"
                f"EpilogueDescriptor, StrideTile, {v.params['element'].cpp}>;")

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        i, e = v.index, v.params["element"].cpp
        return (f"fusion::Sm90AuxStore<\n      AuxStoreDesc{i}::Stages, typename EpilogueDescriptor::EpilogueTile, "
                f"{e},\n      RoundStyle, StrideTile, typename AuxStoreDesc{i}::SmemLayoutAtom,\n"
                f"      typename AuxStoreDesc{i}::CopyOpR2S>")

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        e, slot = v.params["element"].cpp, v.params["slot"]
        return f"{{static_cast<{e}*>(p.tensors[{slot}]), tile_stride(p.ld[{slot}])}}"

    def smem_bytes(self, v: VisitorNode, staging: Staging) -> int:
        return staging.elems * v.params["element"].bits // 8 * staging.stages_d


class HalfWidthStore(AuxStore):
    """An M x N/2 output (the even column of each pair), stored from registers."""
    name, header = "half_store", "coda/half_store.hpp"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "store" and n.attr("layout", "tile") == "half"

    def declaration(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return ""

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"coda::HalfWidthStore<{v.params['element'].cpp}>"

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        e, slot = v.params["element"].cpp, v.params["slot"]
        return f"{{static_cast<{e}*>(p.tensors[{slot}]), p.ld[{slot}]}}"

    def smem_bytes(self, v: VisitorNode, staging: Staging) -> int:
        return 0


class DStore(NodeKind):
    """The visitor's last node: its value is what the collective stores as D."""
    name = "d_store"

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return "fusion::Sm90Compute<coda::identity, ElementD, ElementCompute, RoundStyle>"


class NoD(NodeKind):
    """The last node when the program has no tile output (D is void)."""
    name = "d_none"

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return "fusion::Sm90Compute<coda::identity, ElementCompute, ElementCompute, RoundStyle>"


# max / min propagate NaN, as torch's amax / amin do (and the interpreter): an amax of a tensor with
# a NaN must say so (hardware max.NaN.f32).
REDUCE_FUNCTOR = {"sum": "cutlass::plus", "max": "cutlass::maximum_with_nan_propagation",
                  "min": "cutlass::minimum_with_nan_propagation"}
REDUCE_IDENTITY = {"sum": "0.0f",
                   "max": "-cutlass::platform::numeric_limits<float>::infinity()",
                   "min": "cutlass::platform::numeric_limits<float>::infinity()"}


class _Reduce(NodeKind):
    def params(self, n: Node, ctx: LowerContext) -> dict[str, Any]:
        return {"slot": ctx.slot(n.attr("name")).index, "fn": n.attr("fn")}


class _TileReduce(_Reduce):
    """Partials over each tile, as CUTLASS's node: ``cutlass`` along ``stride``, FinalReduction=false."""
    cutlass, stride = "", ""

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        f = REDUCE_FUNCTOR[v.params["fn"]]
        return (f"fusion::{self.cutlass}<\n      {f}, {f}, {f}, 0, TileShape, float, ElementCompute,\n"
                f"      RoundStyle, {self.stride}, 4, /*EnableNullptr=*/true, /*FinalReduction=*/false>")

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"{{p.tensors[{v.params['slot']}], {REDUCE_IDENTITY[v.params['fn']]}, {{}}}}"


class RowReduce(_TileReduce):
    """Per-row partials over each N-tile (row sums/max/min, total sums), bounds-tested on columns
    only (templates/coda/row_reduction.hpp: rows past M land in the partials' padding)."""
    name, header = "row_reduce", "coda/row_reduction.hpp"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "reduce" and n.attr("axis") in ("row", "all")

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        f = REDUCE_FUNCTOR[v.params["fn"]]
        return f"coda::ColumnCheckedRowReduction<{f}, TileShape, StridePerRow, RoundStyle>"


class ColReduce(_TileReduce):
    """Per-column partials over each M-tile."""
    name = "col_reduce"
    cutlass, stride = "Sm90RowReduction", "StridePerCol"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "reduce" and n.attr("axis") == "col"


class LseReduce(_Reduce):
    """Online log-sum-exp per row: (max, sum exp(x - max)) states combined in CUTLASS's reduction."""
    name, header = "lse_reduce", "coda/logsumexp.hpp"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "reduce" and n.attr("fn") == "lse"

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return ("fusion::Sm90ColReduction<\n      coda::lse_combine, coda::lse_combine, coda::lse_combine, 0, "
                "TileShape, coda::LseState, coda::LseState,\n      RoundStyle, StridePerRow, 2, "
                "/*EnableNullptr=*/true, /*FinalReduction=*/false>")

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return (f"{{p.tensors[{v.params['slot']}], coda::LseState(-cutlass::platform::numeric_limits<float>"
                "::infinity(), 0.0f), {}}")


class SegmentSum(RowReduce):
    """Sums over width-wide column segments of each row. When a tile holds several segments, one
    ``coda::SegmentRowSum`` node (per-thread (row, segment) accumulators); when segments span whole
    tiles, a plain per-tile row sum that finishing adds up per segment."""
    name, header = "segment_sum", "coda/segments.hpp"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "reduce" and n.attr("axis") == "segment"

    def params(self, n: Node, ctx: LowerContext) -> dict[str, Any]:
        return {**super().params(n, ctx), "width": n.attr("width")}

    def _segments(self, v: VisitorNode, plan: "KernelPlan") -> int:
        return plan.segments(v.params["slot"])

    def comment(self, v: VisitorNode, plan: "KernelPlan") -> str:
        k = self._segments(v, plan)
        return f"{v.comment}: {k} segments per tile" if k > 1 else v.comment

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        if self._segments(v, plan) > 1:
            return f"coda::SegmentRowSum<{v.params['width']}, TileShape>"
        return super().cpp_type(v, plan)

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        if self._segments(v, plan) > 1:
            return f"{{static_cast<float*>(p.tensors[{v.params['slot']}])}}"
        return super().arguments(v, plan)

    def headers(self, v: VisitorNode, plan: "KernelPlan") -> tuple[str, ...]:
        return (self.header if self._segments(v, plan) > 1 else RowReduce.header,)

D_STORE, NO_D, AUX_STORE = DStore(), NoD(), AuxStore()
# in match order: half-width stores before other stores; log-sum-exp and segments before row sums
OUTPUTS: tuple[NodeKind, ...] = (HalfWidthStore(), AUX_STORE, LseReduce(), SegmentSum(), RowReduce(), ColReduce())
