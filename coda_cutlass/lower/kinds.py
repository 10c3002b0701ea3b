"""Visitor node kinds: one class per kind of node in the generated ``Sm90TopologicalVisitor``, the
one place that says what the node is in C++.

A kind knows which IR nodes it lowers (``matches``), what the C++ needs from the IR node
(``params``), the node's C++ type (``cpp_type``), its runtime ``Arguments`` initialiser
(``arguments``; slots index the host ABI arrays ``p.tensors``, ``p.ld`` and ``p.scalars``), type
aliases it refers to (``declaration``), the coda headers it needs (``headers``) and the shared
memory it stages tiles in (``smem_bytes``). What a kind says may depend on the kernel plan (the
CTA tile): a segment sum is a per-tile row reduction, or a ``coda::SegmentRowSum`` when a tile
holds several segments. Output buffers, their partials layout and finishing live on the node's
``TensorSlot`` (``partials.PartialLayout``). ``KINDS`` lists the kinds lowering tries, in order.

CUTLASS's names are inverted from ours: a per-row vector (length M) is a *Col*Broadcast and a
per-row reduction (over N) is a *Col*Reduction; a per-column vector (length N) is a *Row*Broadcast.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..dtypes import F32, DType, as_dtype
from ..ir.nodes import Kind, Node
from ..ir.ops import OPS, PACK_OPS, PAIR_OPS
from .graph import TensorSlot, VisitorNode

if TYPE_CHECKING:
    from .plan import KernelPlan


@dataclass(frozen=True)
class Staging:
    """Shared-memory geometry of the epilogue (lower/smem.py): elements per epilogue subtile, the C
    (load) and D (store) pipeline stages, the CTA tile width."""
    elems: int
    stages_c: int
    stages_d: int
    tile_n: int


@dataclass(frozen=True)
class LowerContext:
    """What lowering knows when it maps an IR node: the host ABI slots and which tile input the
    collective's C load reads."""
    tensors: tuple[TensorSlot, ...]
    slot_of: dict[str, int]
    scalars: tuple[str, ...]
    c_operand: str | None

    def slot(self, name: str) -> TensorSlot:
        return self.tensors[self.slot_of[name]]


def element(slot: TensorSlot) -> DType:
    """The kernel's element type of a tile slot: packed 16-bit pairs travel as one 32-bit word."""
    return F32 if slot.layout == "packed" else slot.dtype


def float_literal(value: float) -> str:
    """A C++ float literal that rounds to the same fp32 value the interpreter uses."""
    if math.isnan(value):
        return "cutlass::platform::numeric_limits<float>::quiet_NaN()"
    if math.isinf(value):
        inf = "cutlass::platform::numeric_limits<float>::infinity()"
        return inf if value > 0 else "-" + inf
    f32 = struct.unpack("f", struct.pack("f", value))[0]
    text = "%.9g" % f32
    if not any(c in text for c in ".e"):
        text += ".0"
    return text + "f"


class NodeKind:
    """A kind of visitor node. Subclasses override what differs from these defaults."""
    name = ""
    header: str | None = None      # the coda header the node's C++ type is defined in

    def __repr__(self) -> str:
        return f"<node kind {self.name}>"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return False

    def params(self, n: Node, ctx: LowerContext) -> dict[str, Any]:
        return {}

    def comment(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return v.comment

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        raise NotImplementedError

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return "{}"

    def declaration(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return ""

    def headers(self, v: VisitorNode, plan: "KernelPlan") -> tuple[str, ...]:
        return (self.header,) if self.header else ()

    def smem_bytes(self, v: VisitorNode, staging: Staging) -> int:
        return 0


# ------------------------------------------------------------------------------------------ leaves
class AccFetch(NodeKind):
    name = "acc"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "acc"

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return "fusion::Sm90AccFetch"


class IndexFetch(NodeKind):
    name, header = "index", "coda/coordinates.hpp"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "index"

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


class ScalarBroadcast(NodeKind):
    """A runtime scalar operand."""
    name = "scalar"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "scalar"

    def params(self, n: Node, ctx: LowerContext) -> dict[str, Any]:
        return {"scalar": ctx.scalars.index(n.attr("operand"))}

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return "fusion::Sm90ScalarBroadcast<ElementCompute, StrideScalar>"

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"{{{{p.scalars[{v.params['scalar']}]}}, {{nullptr}}, {{}}}}"


class Constant(ScalarBroadcast):
    """A Python constant, baked into the arguments as a float literal."""
    name = "const"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "const"

    def params(self, n: Node, ctx: LowerContext) -> dict[str, Any]:
        return {"literal": float_literal(n.attr("value"))}

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"{{{{{v.params['literal']}}}, {{nullptr}}, {{}}}}"


# ------------------------------------------------------------------------------------------ compute
class Compute(NodeKind):
    """An elementwise op: ``Sm90Compute`` with the op's functor. ``cast`` rounds through the node's
    output element type; packed pairs unpack/pack through ``coda::Unpack``."""
    name = "compute"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op in OPS

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

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op in PAIR_OPS

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"coda::PairCompute<{v.params['functor']}, {v.params['element'].cpp}, ElementCompute, RoundStyle>"

    def headers(self, v: VisitorNode, plan: "KernelPlan") -> tuple[str, ...]:
        return (self.header,)


class PairRotate(PairCompute):
    """Rotation of each pair by its angle: one sincos per pair, reused across the tile."""
    name, header = "pair_rotate", "coda/rotate.hpp"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "pair_rotate"

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"coda::PairRotate<{v.params['element'].cpp}, ElementCompute, RoundStyle>"


# ------------------------------------------------------------------------------------------ stores
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


# ------------------------------------------------------------------------------------------ reductions
REDUCE_FUNCTOR = {"sum": "cutlass::plus", "max": "cutlass::maximum", "min": "cutlass::minimum"}
REDUCE_IDENTITY = {"sum": "0.0f",
                   "max": "-cutlass::platform::numeric_limits<float>::infinity()",
                   "min": "cutlass::platform::numeric_limits<float>::infinity()"}


class _Reduce(NodeKind):
    def params(self, n: Node, ctx: LowerContext) -> dict[str, Any]:
        return {"slot": ctx.slot(n.attr("name")).index, "fn": n.attr("fn")}


class RowReduce(_Reduce):
    """Per-row partials over each N-tile (row sums/max/min, total sums): FinalReduction=false."""
    name = "row_reduce"
    cutlass, stride = "Sm90ColReduction", "StridePerRow"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "reduce" and n.attr("axis") in ("row", "all")

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        f = REDUCE_FUNCTOR[v.params["fn"]]
        return (f"fusion::{self.cutlass}<\n      {f}, {f}, {f}, 0, TileShape, float, ElementCompute,\n"
                f"      RoundStyle, {self.stride}, 4, /*EnableNullptr=*/true, /*FinalReduction=*/false>")

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return f"{{p.tensors[{v.params['slot']}], {REDUCE_IDENTITY[v.params['fn']]}, {{}}}}"


class ColReduce(RowReduce):
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
        return (self.header,) if self._segments(v, plan) > 1 else ()


ACC, D_STORE, NO_D = AccFetch(), DStore(), NoD()
AUX_STORE = AuxStore()

# Lowering takes the first kind that matches an IR node (specific kinds before general ones).
KINDS: tuple[NodeKind, ...] = (
    ACC, IndexFetch(), SrcFetch(), AuxLoad(), PerRowBroadcast(), PerColBroadcast(), ScalarBroadcast(),
    Constant(), PairRotate(), PairCompute(), Compute(), HalfWidthStore(), AUX_STORE, LseReduce(),
    SegmentSum(), RowReduce(), ColReduce(),
)


def kind_of(n: Node, ctx: LowerContext) -> NodeKind | None:
    return next((k for k in KINDS if k.matches(n, ctx)), None)
