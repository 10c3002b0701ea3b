"""Validation: reject programs the kernel cannot run, naming the node and the reason."""

from __future__ import annotations

from ..errors import EpilogueError
from ..ir.nodes import LEAF_OPS, REDUCE_AXES, REDUCE_FNS, Kind, Program
from ..ir.ops import OPS
from ..ir.printer import node_text

# Hopper shared memory bounds how many tiles the epilogue can stream: each tile input or output
# beyond C and D needs its own staging buffers next to the mainloop's.
MAX_TILE_INPUTS = 4
MAX_TILE_OUTPUTS = 6


def validate(program: Program) -> Program:
    def fail(reason: str, node_id: int | None = None) -> EpilogueError:
        label = None
        if node_id is not None:
            n = program.nodes[node_id]
            label = f"%{n.id} `{node_text(n)}`"
        return EpilogueError(reason, program=program.name, node=label)

    names = set()
    seen_acc = False
    for index, n in enumerate(program.nodes):
        if n.id != index:
            raise fail("nodes are not numbered in order (internal error)", n.id)
        for i in n.inputs:
            if i >= n.id:
                raise fail("an input is defined after its user (internal error)", n.id)
            src = program.nodes[i]
            if src.is_sink:
                what = "reduction" if src.op == "reduce" else "output store"
                raise fail(f"uses the result of a {what} (%{i}); a reduction is only finished after the "
                           "kernel and cannot be used later in the same epilogue", n.id)
        if n.op in LEAF_OPS:
            if n.inputs:
                raise fail("a leaf node has inputs (internal error)", n.id)
            seen_acc |= n.op == "acc"
            continue
        if n.op in OPS:
            if len(n.inputs) != OPS[n.op].arity:
                raise fail(f"{n.op} takes {OPS[n.op].arity} inputs, has {len(n.inputs)}", n.id)
            expected = Kind.SCALAR
            for i in n.inputs:
                expected = expected.join(program.nodes[i].kind)
            if n.kind != expected:
                raise fail(f"kind {n.kind.value} does not match its inputs ({expected.value})", n.id)
            if n.op == "pow" and program.nodes[n.inputs[1]].op != "const":
                raise fail("pow needs a constant exponent", n.id)
            continue
        if n.op in ("store", "reduce"):
            name = n.attr("name")
            if not name:
                raise fail("an output without a name (internal error)", n.id)
            if name in names:
                raise fail(f"output '{name}' is defined twice", n.id)
            names.add(name)
            if len(n.inputs) != 1:
                raise fail("an output takes exactly one value", n.id)
            if n.op == "reduce":
                if n.attr("fn") not in REDUCE_FNS or n.attr("axis") not in REDUCE_AXES:
                    raise fail(f"unsupported reduction {n.attr('axis')}_{n.attr('fn')}", n.id)
            continue
        raise fail(f"unsupported op '{n.op}'", n.id)

    if not names:
        raise EpilogueError("the program has no outputs", program=program.name)
    if set(program.outputs) != names:
        raise EpilogueError("the output list does not match the output nodes (internal error)",
                            program=program.name)
    if not seen_acc:
        raise EpilogueError("no accumulator node (internal error)", program=program.name)

    tile_loads = {n.attr("operand") for n in program.nodes if n.op == "load" and n.kind == Kind.TILE}
    tile_stores = [n for n in program.nodes if n.op == "store" and n.attr("name") != "D"]
    if len(tile_loads) > MAX_TILE_INPUTS:
        raise EpilogueError(f"{len(tile_loads)} M x N tile inputs ({', '.join(sorted(tile_loads))}); at most "
                            f"{MAX_TILE_INPUTS} fit the epilogue's shared memory", program=program.name)
    if len(tile_stores) > MAX_TILE_OUTPUTS:
        raise EpilogueError(f"{len(tile_stores)} tile outputs besides D; at most {MAX_TILE_OUTPUTS} fit the "
                            "epilogue's shared memory", program=program.name)
    return program
