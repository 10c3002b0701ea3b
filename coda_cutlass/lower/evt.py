"""Lowering: a typed, validated IR program -> one flat ``Sm90TopologicalVisitor`` plus the host ABI.

Each IR node becomes one visitor node (same order), except:
- the output that the collective epilogue writes as its D tensor (the output named ``D``, else the
  first tile output) becomes the visitor's last node, an identity Compute whose element type is D's
  (the collective stores it); with no tile output at all, D is void;
- the first tile input is read through the collective's C load (``Sm90SrcFetch``), the others through
  ``Sm90AuxLoad``.

CUTLASS's names are inverted from ours: a per-row vector (length M) is a *Col*Broadcast and a per-row
reduction (over N) is a *Col*Reduction; a per-column vector (length N) is a *Row*Broadcast.

Every tensor the kernel touches gets a numbered slot in the host ABI; user names only ever reach
the generated C++ inside comments, never as identifiers.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

from ..config import KernelConfig
from ..dtypes import F32, DType, as_dtype
from ..errors import ConfigError, EpilogueError
from ..finish import check_segment_tiling, segments_per_tile
from ..ir.nodes import Kind, Node, Program
from ..ir.ops import OPS, PAIR_OPS
from ..ir.printer import node_text

REDUCE_FUNCTOR = {"sum": "cutlass::plus", "max": "cutlass::maximum", "min": "cutlass::minimum"}
REDUCE_IDENTITY = {"sum": "0.0f",
                   "max": "-cutlass::platform::numeric_limits<float>::infinity()",
                   "min": "cutlass::platform::numeric_limits<float>::infinity()"}


@dataclass(frozen=True)
class TensorSlot:
    """One device pointer of the host ABI."""
    index: int
    name: str         # the operand or output it carries (documentation only)
    role: str         # "input", "output", "inout" (accumulated output) or "partials"
    kind: Kind        # TILE, ROW (length M), COL (length N); partials: ROW for row/total, COL for col
    dtype: DType
    reduce_fn: str | None = None
    reduce_axis: str | None = None
    layout: str = "tile"   # tile slots: "tile" (M x N), "packed" (M x 2N 16-bit pairs, passed to the
                           # kernel as M x N 32-bit elements: ld in 32-bit units), "half" (M x N/2)
    width: int = 0         # segment partials: the segment width
    segments: int = 0      # segment partials: segments per N-tile (k of the [tiles * k, M] layout)

    @property
    def is_tile(self) -> bool:
        return self.kind == Kind.TILE and self.role != "partials"

    def describe(self) -> dict[str, Any]:
        d = {"index": self.index, "name": self.name, "role": self.role, "kind": self.kind.value,
             "dtype": self.dtype.name}
        if self.reduce_fn:
            d["reduce"] = f"{self.reduce_axis}_{self.reduce_fn}"
        if self.layout != "tile":
            d["layout"] = self.layout
        if self.width:
            d["width"] = self.width
            d["segments"] = self.segments
        return d


@dataclass(frozen=True)
class VisitorNode:
    index: int
    kind: str                      # acc, src, aux_load, row_vec, col_vec, scalar, const, compute,
                                   # aux_store, row_reduce, col_reduce, d_store
    children: tuple[int, ...]
    comment: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EvtGraph:
    program: Program
    config: KernelConfig
    dtype: DType                   # GEMM operand dtype
    weight_layout: str             # "nk" (W is [N, K], nn.Linear) or "kn"
    nodes: tuple[VisitorNode, ...]
    tensors: tuple[TensorSlot, ...]
    scalars: tuple[str, ...]       # runtime scalar operands, in slot order
    element_c: DType | None
    c_slot: int | None
    element_d: DType | None
    d_slot: int | None
    headers: tuple[str, ...] = ()  # coda headers beyond the base set that the nodes need

    def describe(self) -> dict[str, Any]:
        """What the kernel's coda_describe() returns (JSON types: the comparison after loading a
        library is with this, so tuples such as an epilogue tile appear as lists)."""
        return json.loads(json.dumps(self._describe()))

    def _describe(self) -> dict[str, Any]:
        return {
            "abi": ABI_VERSION,
            "program": self.program.name,
            "dtype": self.dtype.name,
            "weight_layout": self.weight_layout,
            "config": self.config.build_key,
            "tensors": [t.describe() for t in self.tensors],
            "scalars": list(self.scalars),
            "outputs": list(self.program.outputs),
            "c_slot": self.c_slot,
            "d_slot": self.d_slot,
        }


ABI_VERSION = 1
MIN_VISITOR_NODES = 5


# Which extra coda header each visitor node kind / functor needs (kernels that use none of them
# include exactly the original headers, so their content keys do not change).
_NODE_HEADERS = {"pair_compute": "coda/pairwise.hpp", "index": "coda/coordinates.hpp",
                 "half_store": "coda/half_store.hpp", "lse_reduce": "coda/logsumexp.hpp",
                 "segment_sum": "coda/segments.hpp", "pair_rotate": "coda/rotate.hpp"}
_FUNCTOR_HEADERS = {"cos": "coda/math_extra.hpp", "sin": "coda/math_extra.hpp", "gelu": "coda/gelu.hpp",
                    "exp": "coda/exp_math.hpp", "sigmoid": "coda/exp_math.hpp", "silu": "coda/exp_math.hpp",
                    "unpack_lo": "coda/pairwise.hpp", "unpack_hi": "coda/pairwise.hpp",
                    "pack": "coda/pairwise.hpp"}


def collective_d_output(program: Program) -> Node | None:
    """The output the collective writes as D: the one named D, else the first full-tile output
    (half-width outputs are written by their own node)."""
    stores = [n for n in program.nodes if n.op == "store" and n.attr("layout", "tile") != "half"]
    for n in stores:
        if n.attr("name") == "D":
            return n
    return stores[0] if stores else None


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


def lower(program: Program, config: KernelConfig, dtype: DType, weight_layout: str) -> EvtGraph:
    if weight_layout not in ("nk", "kn"):
        raise EpilogueError(f"weight_layout must be 'nk' (W is [N, K], as nn.Linear) or 'kn', got "
                            f"{weight_layout!r}", program=program.name)
    d_node = collective_d_output(program)
    accumulated = {n.attr("name") for n in program.nodes if n.op == "store" and n.attr("accumulate")}

    # ---- host ABI slots: live tensor operands first (declaration order), then outputs ----
    tensors: list[TensorSlot] = []
    slot_of: dict[str, int] = {}
    live_loads = {n.attr("operand") for n in program.nodes if n.op == "load"}
    for o in program.operands:
        if o.kind == Kind.SCALAR or o.name not in live_loads:
            continue
        role = "inout" if o.name in accumulated else "input"
        slot_of[o.name] = len(tensors)
        tensors.append(TensorSlot(len(tensors), o.name, role, o.kind, o.dtype,
                                  layout="packed" if o.packed else "tile"))
    for name in program.outputs:
        n = program.sink(name)
        if n.op == "store":
            if name in accumulated:
                continue
            slot_of[name] = len(tensors)
            tensors.append(TensorSlot(len(tensors), name, "output", Kind.TILE, n.dtype,
                                      layout=n.attr("layout", "tile")))
        else:
            axis = n.attr("axis")
            width = n.attr("width", 0) if axis == "segment" else 0
            segments = 0
            if width:
                why = check_segment_tiling(width, config.tile_n)
                if why:
                    raise ConfigError(f"{program.name}: output '{name}': {why}; pick a config whose tile "
                                      "width fits the segment width")
                segments = segments_per_tile(width, config.tile_n)
            slot_of[name] = len(tensors)
            tensors.append(TensorSlot(len(tensors), name, "partials", Kind.COL if axis == "col" else Kind.ROW,
                                      F32, n.attr("fn"), axis, width=width, segments=segments))
    scalars = tuple(o.name for o in program.operands
                    if o.kind == Kind.SCALAR and any(n.op == "scalar" and n.attr("operand") == o.name
                                                     for n in program.nodes))

    # ---- the C source: the first tile input ----
    c_operand = next((t.name for t in tensors if t.role in ("input", "inout") and t.kind == Kind.TILE), None)
    element_c = _element(tensors[slot_of[c_operand]]) if c_operand else None

    # ---- visitor nodes, in IR order; D last ----
    vnodes: list[VisitorNode] = []
    index_of: dict[int, int] = {}
    for n in program.nodes:
        if d_node is not None and n.id == d_node.id:
            continue
        children = tuple(index_of[i] for i in n.inputs)
        v = _visitor_node(n, len(vnodes), children, slot_of, c_operand, scalars, program, tensors)
        index_of[n.id] = v.index
        vnodes.append(v)

    # CUTLASS gives visitors of 2-4 nodes special base classes with a different Arguments layout
    # (a 2-node visitor fails to compile, and the 2-4 node bases misplace reduction workspaces,
    # CUTLASS_EVT.md section 6); 5 or more nodes use the generic tuple base. Pad with unused leaves.
    while len(vnodes) < MIN_VISITOR_NODES - 1:
        vnodes.append(VisitorNode(len(vnodes), "acc", (), "padding (unused): keeps the visitor at >= 5 nodes"))

    if d_node is not None:
        d_slot: int | None = slot_of[d_node.attr("name")]
        element_d: DType | None = _element(tensors[d_slot])
        vnodes.append(VisitorNode(len(vnodes), "d_store", (index_of[d_node.inputs[0]],),
                                  f"{node_text(d_node)}  (the collective's D store)",
                                  {"slot": d_slot, "element": element_d}))
    else:
        element_d, d_slot = None, None
        vnodes.append(VisitorNode(len(vnodes), "d_none", (0,), "no tile output: D is void", {}))

    headers: list[str] = []
    for v in vnodes:
        for h in (_NODE_HEADERS.get(v.kind), _FUNCTOR_HEADERS.get(v.params.get("op", ""))):
            if h and h not in headers:
                headers.append(h)
    return EvtGraph(program=program, config=config, dtype=dtype, weight_layout=weight_layout,
                    nodes=tuple(vnodes), tensors=tuple(tensors), scalars=scalars,
                    element_c=element_c, c_slot=slot_of[c_operand] if c_operand else None,
                    element_d=element_d, d_slot=d_slot, headers=tuple(sorted(headers)))


def _element(slot: TensorSlot) -> DType:
    """The kernel's element type of a tile slot: packed 16-bit pairs travel as one 32-bit word."""
    return F32 if slot.layout == "packed" else slot.dtype


def _visitor_node(n: Node, index: int, children: tuple[int, ...], slot_of: dict[str, int],
                  c_operand: str | None, scalars: tuple[str, ...], program: Program,
                  tensors: list[TensorSlot]) -> VisitorNode:
    comment = node_text(n)
    if n.op == "acc":
        return VisitorNode(index, "acc", children, comment)
    if n.op == "index":
        return VisitorNode(index, "index", children, comment, {"axis": 0 if n.attr("axis") == "row" else 1})
    if n.op == "load":
        name = n.attr("operand")
        slot = slot_of[name]
        if n.kind == Kind.TILE:
            kind = "src" if name == c_operand else "aux_load"
        else:
            kind = "row_vec" if n.kind == Kind.ROW else "col_vec"
        return VisitorNode(index, kind, children, comment, {"slot": slot, "element": _element(tensors[slot])})
    if n.op == "scalar":
        return VisitorNode(index, "scalar", children, comment, {"scalar": scalars.index(n.attr("operand"))})
    if n.op == "const":
        return VisitorNode(index, "const", children, comment, {"literal": float_literal(n.attr("value"))})
    if n.op in ("unpack_lo", "unpack_hi", "pack"):
        half = as_dtype(n.attr("dtype"))
        return VisitorNode(index, "compute", children, comment,
                           {"functor": f"coda::Unpack<{half.cpp}>::{OPS[n.op].functor}", "element": F32,
                            "op": n.op})
    if n.op == "pair_rotate":   # its own node: reuses cos/sin across the tile (coda/rotate.hpp)
        return VisitorNode(index, "pair_rotate", children, comment, {"element": F32})
    if n.op in PAIR_OPS:
        return VisitorNode(index, "pair_compute", children, comment,
                           {"functor": f"coda::{OPS[n.op].functor}", "element": F32})
    if n.op in OPS:
        out = as_dtype(n.attr("dtype")) if n.op == "cast" else F32
        params = {"functor": f"coda::{OPS[n.op].functor}", "element": out}
        if n.op in _FUNCTOR_HEADERS:
            params["op"] = n.op
        return VisitorNode(index, "compute", children, comment, params)
    if n.op == "store":
        slot = tensors[slot_of[n.attr("name")]]
        kind = "half_store" if slot.layout == "half" else "aux_store"
        return VisitorNode(index, kind, children, comment, {"slot": slot.index, "element": _element(slot)})
    if n.op == "reduce" and n.attr("fn") == "lse":
        return VisitorNode(index, "lse_reduce", children, comment, {"slot": slot_of[n.attr("name")]})
    if n.op == "reduce" and n.attr("axis") == "segment":
        slot = tensors[slot_of[n.attr("name")]]
        if slot.segments > 1:   # several segments per tile: per-(row, segment) sums in one node
            return VisitorNode(index, "segment_sum", children, f"{comment}: {slot.segments} segments per tile",
                               {"slot": slot.index, "width": slot.width})
        # else segments span whole tiles: a plain per-tile row sum, summed per segment afterwards
    if n.op == "reduce":
        fn, axis = n.attr("fn"), n.attr("axis")
        kind = "col_reduce" if axis == "col" else "row_reduce"
        return VisitorNode(index, kind, children, comment,
                           {"slot": slot_of[n.attr("name")], "functor": REDUCE_FUNCTOR[fn],
                            "identity": REDUCE_IDENTITY[fn]})
    raise EpilogueError(f"cannot lower op '{n.op}'", program=program.name, node=n.label)
