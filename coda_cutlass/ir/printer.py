"""Text form of the IR, used by ``repr``, error messages and comments in the generated `.cu`."""

from __future__ import annotations

from .nodes import Kind, Node, Program

_KIND = {Kind.SCALAR: "scalar", Kind.ROW: "per-row", Kind.COL: "per-col", Kind.TILE: "tile"}


def format_value(value: float) -> str:
    return repr(float(value))


def node_text(n: Node) -> str:
    """The right-hand side of a node, e.g. ``mul %2, %3`` or ``store h = %4``."""
    args = ", ".join(f"%{i}" for i in n.inputs)
    if n.op == "acc":
        return "acc"
    if n.op == "load":
        return f"load {n.attr('operand')}"
    if n.op == "scalar":
        return f"scalar {n.attr('operand')}"
    if n.op == "const":
        return f"const {format_value(n.attr('value'))}"
    if n.op == "cast":
        return f"cast {args} to {n.attr('dtype')}"
    if n.op == "store":
        verb = "accumulate" if n.attr("accumulate") else "store"
        return f"{verb} {n.attr('name')} = {args}"
    if n.op == "reduce":
        return f"reduce {n.attr('name')} = {n.attr('axis')}_{n.attr('fn')} {args}"
    return f"{n.op} {args}"


def node_line(n: Node) -> str:
    dtype = f" {n.dtype}" if n.dtype is not None else ""
    lhs = "" if n.is_sink else f"%{n.id} = "
    return f"{lhs}{node_text(n)}".ljust(40) + f"  : {_KIND[n.kind]}{dtype}"


def format_program(p: Program) -> str:
    params = ", ".join(
        f"{o.name}: {_KIND[o.kind]}" + (f" {o.dtype}" if o.dtype is not None else "") for o in p.operands)
    lines = [f"epilogue {p.name}(acc{', ' if params else ''}{params}) -> ({', '.join(p.outputs)})"]
    lines += ["  " + node_line(n) for n in p.nodes]
    return "\n".join(lines)
