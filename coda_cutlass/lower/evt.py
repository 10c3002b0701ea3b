"""Lowering: a typed, validated IR program -> one flat ``Sm90TopologicalVisitor`` plus the host ABI.
Independent of the kernel configuration (``plan.plan`` adds it).

Each IR node becomes one visitor node (same order) of the first kind in ``kinds.KINDS`` that
matches it, except:
- the output that the collective epilogue writes as its D tensor (the output named ``D``, else the
  first tile output) becomes the visitor's last node, an identity Compute whose element type is D's
  (the collective stores it); with no tile output at all, D is void;
- the first tile input is read through the collective's C load (``Sm90SrcFetch``), the others through
  ``Sm90AuxLoad``;
- an FP8 GEMM's scales get the last two slots (``scale_a``, ``scale_b``); with tensor or row scaling
  the accumulator node multiplies the accumulator by them (``kinds/fp8.py``), so the program's
  ``acc`` is the scaled product; block scales are the mainloop's (``lower/mainloop.py``).
"""

from __future__ import annotations

from ..dtypes import F32, DType, as_dtype
from ..errors import EpilogueError
from ..fp8.gemm import Fp8Gemm
from ..fp8.scales import scale_layouts
from ..ir.nodes import Kind, Node, Program
from ..ir.printer import node_text
from ..partials import PartialLayout
from .graph import ABI_VERSION, EvtGraph, TensorSlot, VisitorNode
from .kinds import ACC, D_STORE, NO_D, LowerContext, element, kind_of

__all__ = ["ABI_VERSION", "MIN_VISITOR_NODES", "collective_d_output", "lower"]

MIN_VISITOR_NODES = 5
REGISTER_STORE_LAYOUTS = frozenset({"half", "t", "half_t"})   # written by coda nodes from registers


def collective_d_output(program: Program) -> Node | None:
    """The output the collective writes as D: the one named D, else the first full-tile output
    (half-width outputs are written by their own node)."""
    stores = [n for n in program.nodes if n.op == "store" and n.attr("layout", "tile") in ("tile", "packed")
              and n.attr("quant") is None]
    for n in stores:
        if n.attr("name") == "D":
            return n
    return stores[0] if stores else None


def host_slots(program: Program) -> LowerContext:
    """The host ABI: live tensor operands first (declaration order), then outputs (return order);
    runtime scalars; the tile input the collective's C load reads."""
    accumulated = {n.attr("name") for n in program.nodes if n.op == "store" and n.attr("accumulate")}
    tensors: list[TensorSlot] = []
    slot_of: dict[str, int] = {}
    live_loads = {n.attr("operand") for n in program.nodes if n.op == "load"}
    for o in program.operands:
        if o.host_scalar or o.name not in live_loads:
            continue
        role = "inout" if o.name in accumulated else "input"
        slot_of[o.name] = len(tensors)
        tensors.append(TensorSlot(len(tensors), o.name, role, o.kind, o.dtype,
                                  layout="packed" if o.packed else "tile"))
    for name in program.outputs:
        n = program.sink(name)
        if n.op == "store" and name in accumulated:
            continue
        slot_of[name] = len(tensors)
        if n.op == "store":
            layout = n.attr("layout", "tile")
            tensors.append(TensorSlot(len(tensors), name, "output", Kind.TILE, n.dtype, layout=layout,
                                      stored_from_registers=layout in REGISTER_STORE_LAYOUTS
                                      or n.attr("quant") is not None))
        elif n.op == "block_scale":
            tensors.append(TensorSlot(len(tensors), name, "output", Kind.TILE, F32, layout="scale",
                                      scale_of=n.attr("layout"), block=n.attr("block"), group=n.attr("group", 1),
                                      stored_from_registers=True))
        else:
            partials = PartialLayout.of(n)
            tensors.append(TensorSlot(len(tensors), name, "partials", Kind.ROW if partials.over_n else Kind.COL,
                                      F32, partials=partials))
    scalars = tuple(o.name for o in program.operands
                    if o.host_scalar and any(n.op == "scalar" and n.attr("operand") == o.name
                                                     for n in program.nodes))
    c_operand = next((t.name for t in tensors if t.role in ("input", "inout") and t.kind == Kind.TILE), None)
    fp8 = Fp8Gemm.from_meta(program.meta.get("fp8"))
    if fp8 is not None:
        for layout in scale_layouts(fp8.scaling):
            slot_of[layout.name] = len(tensors)
            tensors.append(TensorSlot(len(tensors), layout.name, "gemm_scale", Kind.SCALAR, F32, layout=layout.kind))
    return LowerContext(tuple(tensors), slot_of, scalars, c_operand, fp8)


def gemm_dtype(program: Program) -> DType:
    """The GEMM operand dtype the type-binding pass recorded."""
    if "gemm_dtype" not in program.meta:
        raise EpilogueError("lowering needs a typed program (run the passes first; internal error)",
                            program=program.name)
    return as_dtype(program.meta["gemm_dtype"])


def lower(program: Program) -> EvtGraph:
    ctx = host_slots(program)
    d_node = collective_d_output(program)

    # ---- visitor nodes, in IR order; D last ----
    vnodes: list[VisitorNode] = []
    index_of: dict[int, int] = {}
    for n in program.nodes:
        if d_node is not None and n.id == d_node.id:
            continue
        kind = kind_of(n, ctx)
        if kind is None:
            raise EpilogueError(f"cannot lower op '{n.op}'", program=program.name, node=n.label)
        v = VisitorNode(len(vnodes), kind, tuple(index_of[i] for i in n.inputs), node_text(n), kind.params(n, ctx))
        index_of[n.id] = v.index
        vnodes.append(v)

    # CUTLASS gives visitors of 2-4 nodes special base classes with a different Arguments layout
    # (a 2-node visitor fails to compile, and the 2-4 node bases misplace reduction workspaces,
    # docs/CUTLASS_EVT.md section 6); 5 or more nodes use the generic tuple base. Pad with unused leaves.
    while len(vnodes) < MIN_VISITOR_NODES - 1:
        vnodes.append(VisitorNode(len(vnodes), ACC, (), "padding (unused): keeps the visitor at >= 5 nodes"))

    element_c = element(ctx.slot(ctx.c_operand)) if ctx.c_operand else None
    if d_node is not None:
        d_slot: int | None = ctx.slot_of[d_node.attr("name")]
        element_d: DType | None = element(ctx.tensors[d_slot])
        vnodes.append(VisitorNode(len(vnodes), D_STORE, (index_of[d_node.inputs[0]],),
                                  f"{node_text(d_node)}  (the collective's D store)",
                                  {"slot": d_slot, "element": element_d}))
    else:
        element_d, d_slot = None, None
        vnodes.append(VisitorNode(len(vnodes), NO_D, (0,), "no tile output: D is void"))

    return EvtGraph(program=program, dtype=gemm_dtype(program), nodes=tuple(vnodes), tensors=ctx.tensors,
                    scalars=ctx.scalars, element_c=element_c,
                    c_slot=ctx.slot_of[ctx.c_operand] if ctx.c_operand else None,
                    element_d=element_d, d_slot=d_slot, fp8=ctx.fp8)
