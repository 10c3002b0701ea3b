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

import math
import struct
from dataclasses import dataclass, field
from typing import Any

from ..config import KernelConfig
from ..dtypes import F32, DType, as_dtype
from ..errors import EpilogueError
from ..ir.nodes import Kind, Node, Program
from ..ir.ops import OPS
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

    @property
    def is_tile(self) -> bool:
        return self.kind == Kind.TILE and self.role != "partials"

    def describe(self) -> dict[str, Any]:
        d = {"index": self.index, "name": self.name, "role": self.role, "kind": self.kind.value,
             "dtype": self.dtype.name}
        if self.reduce_fn:
            d["reduce"] = f"{self.reduce_axis}_{self.reduce_fn}"
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

    def describe(self) -> dict[str, Any]:
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


def collective_d_output(program: Program) -> Node | None:
    stores = [n for n in program.nodes if n.op == "store"]
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
        tensors.append(TensorSlot(len(tensors), o.name, role, o.kind, o.dtype))
    for name in program.outputs:
        n = program.sink(name)
        if n.op == "store":
            if name in accumulated:
                continue
            slot_of[name] = len(tensors)
            tensors.append(TensorSlot(len(tensors), name, "output", Kind.TILE, n.dtype))
        else:
            axis = n.attr("axis")
            slot_of[name] = len(tensors)
            tensors.append(TensorSlot(len(tensors), name, "partials", Kind.COL if axis == "col" else Kind.ROW,
                                      F32, n.attr("fn"), axis))
    scalars = tuple(o.name for o in program.operands
                    if o.kind == Kind.SCALAR and any(n.op == "scalar" and n.attr("operand") == o.name
                                                     for n in program.nodes))

    # ---- the C source: the first tile input ----
    c_operand = next((t.name for t in tensors if t.role in ("input", "inout") and t.kind == Kind.TILE), None)
    element_c = tensors[slot_of[c_operand]].dtype if c_operand else None

    # ---- visitor nodes, in IR order; D last ----
    vnodes: list[VisitorNode] = []
    index_of: dict[int, int] = {}
    for n in program.nodes:
        if d_node is not None and n.id == d_node.id:
            continue
        children = tuple(index_of[i] for i in n.inputs)
        v = _visitor_node(n, len(vnodes), children, slot_of, c_operand, scalars, program)
        index_of[n.id] = v.index
        vnodes.append(v)

    # CUTLASS gives visitors of 2-4 nodes special base classes with a different Arguments layout
    # (a 2-node visitor fails to compile, and the 2-4 node bases misplace reduction workspaces,
    # CUTLASS_EVT.md section 6); 5 or more nodes use the generic tuple base. Pad with unused leaves.
    while len(vnodes) < MIN_VISITOR_NODES - 1:
        vnodes.append(VisitorNode(len(vnodes), "acc", (), "padding (unused): keeps the visitor at >= 5 nodes"))

    if d_node is not None:
        element_d: DType | None = d_node.dtype
        d_slot: int | None = slot_of[d_node.attr("name")]
        vnodes.append(VisitorNode(len(vnodes), "d_store", (index_of[d_node.inputs[0]],),
                                  f"{node_text(d_node)}  (the collective's D store)",
                                  {"slot": d_slot, "element": d_node.dtype}))
    else:
        element_d, d_slot = None, None
        vnodes.append(VisitorNode(len(vnodes), "d_none", (0,), "no tile output: D is void", {}))

    return EvtGraph(program=program, config=config, dtype=dtype, weight_layout=weight_layout,
                    nodes=tuple(vnodes), tensors=tuple(tensors), scalars=scalars,
                    element_c=element_c, c_slot=slot_of[c_operand] if c_operand else None,
                    element_d=element_d, d_slot=d_slot)


def _visitor_node(n: Node, index: int, children: tuple[int, ...], slot_of: dict[str, int],
                  c_operand: str | None, scalars: tuple[str, ...], program: Program) -> VisitorNode:
    comment = node_text(n)
    if n.op == "acc":
        return VisitorNode(index, "acc", children, comment)
    if n.op == "load":
        name = n.attr("operand")
        slot = slot_of[name]
        if n.kind == Kind.TILE:
            kind = "src" if name == c_operand else "aux_load"
        else:
            kind = "row_vec" if n.kind == Kind.ROW else "col_vec"
        return VisitorNode(index, kind, children, comment, {"slot": slot, "element": n.dtype})
    if n.op == "scalar":
        return VisitorNode(index, "scalar", children, comment, {"scalar": scalars.index(n.attr("operand"))})
    if n.op == "const":
        return VisitorNode(index, "const", children, comment, {"literal": float_literal(n.attr("value"))})
    if n.op in OPS:
        out = as_dtype(n.attr("dtype")) if n.op == "cast" else F32
        return VisitorNode(index, "compute", children, comment,
                           {"functor": f"coda::{OPS[n.op].functor}", "element": out})
    if n.op == "store":
        return VisitorNode(index, "aux_store", children, comment,
                           {"slot": slot_of[n.attr("name")], "element": n.dtype})
    if n.op == "reduce":
        fn, axis = n.attr("fn"), n.attr("axis")
        kind = "col_reduce" if axis == "col" else "row_reduce"
        return VisitorNode(index, kind, children, comment,
                           {"slot": slot_of[n.attr("name")], "functor": REDUCE_FUNCTOR[fn],
                            "identity": REDUCE_IDENTITY[fn]})
    raise EpilogueError(f"cannot lower op '{n.op}'", program=program.name, node=n.label)
