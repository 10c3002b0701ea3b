"""Text form of the IR, used by ``repr``, error messages and comments in the generated `.cu`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .kind import Kind
from .ops import DTYPE_OPS, UNPACK_OPS

if TYPE_CHECKING:     # nodes.py prints its Program with this module
    from .nodes import Node, Program

_KIND = {Kind.SCALAR: "scalar", Kind.ROW: "per-row", Kind.COL: "per-col", Kind.TILE: "tile"}


def format_value(value: float) -> str:
    return repr(float(value))


def node_text(n: Node) -> str:
    """The right-hand side of a node, e.g. ``mul %2, %3`` or ``store h = %4``."""
    args = ", ".join(f"%{i}" for i in n.inputs)
    if n.op == "acc":
        return "acc"
    if n.op == "load":
        return f"load {n.attr('operand')}" + (" (packed pairs)" if n.attr("packed") else "")
    if n.op == "index":
        return f"index {n.attr('axis')}"
    if n.op == "scalar":
        return f"scalar {n.attr('operand')}"
    if n.op == "const":
        return f"const {format_value(n.attr('value'))}"
    if n.op in DTYPE_OPS:
        dtype = n.attr("dtype") or "the GEMM dtype"     # cc.cast(x) before type binding
        note = " (as stored)" if n.attr("as_stored") else ""
        return f"{n.op} {args} {'from' if n.op in UNPACK_OPS else 'to'} {dtype}{note}"
    if n.op == "store":
        verb = "accumulate" if n.attr("accumulate") else "store"
        layout = n.attr("layout", "tile")
        notes = [] if layout == "tile" else [layout]
        if n.attr("quant") == "block":
            notes.append(f"quantised per {n.attr('group', 1)}x{n.attr('block')} "
                         f"{'block' if n.attr('group', 1) > 1 else 'run'}{', pow2 scales' if n.attr('pow2') else ''}")
        return f"{verb} {n.attr('name')} = {args}" + (f" ({'; '.join(notes)})" if notes else "")
    if n.op == "block_scale":
        return f"block_scale {n.attr('name')} = scales of {n.attr('of')} {args}"
    if n.op == "reduce":
        width = f" width {n.attr('width')}" if n.attr("axis") == "segment" else ""
        return f"reduce {n.attr('name')} = {n.attr('axis')}_{n.attr('fn')}{width} {args}"
    return f"{n.op} {args}"


def node_line(n: Node) -> str:
    dtype = f" {n.dtype}" if n.dtype is not None else ""
    lhs = "" if n.is_sink else f"%{n.id} = "
    return f"{lhs}{node_text(n)}".ljust(40) + f"  : {_KIND[n.kind]}{dtype}"


def format_signature(p: Program) -> str:
    """``name(acc, resid: tile bf16, ...) -> (D, ...)``."""
    params = ", ".join(
        f"{o.name}: {'device scalar' if o.device else _KIND[o.kind]}" + (f" {o.dtype}" if o.dtype is not None else "")
        for o in p.operands)
    return f"{p.name}(acc{', ' if params else ''}{params}) -> ({', '.join(p.outputs)})"


def format_program(p: Program) -> str:
    lines = [f"epilogue {format_signature(p)}"]
    lines += ["  " + node_line(n) for n in p.nodes]
    return "\n".join(lines)
