"""Validation: reject programs the kernel cannot run, naming the node and the reason."""

from __future__ import annotations

from ..errors import EpilogueError
from ..dtypes import FP8_DTYPES
from ..ir.nodes import LEAF_OPS, REDUCE_AXES, REDUCE_FNS, SINK_OPS, STORE_LAYOUTS, TRANSPOSED_LAYOUTS, Kind, Program
from ..ir.ops import OPS, PAIR_PICK_OPS, UNPACK_OPS, result_kind
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
    users = program.users()
    for index, n in enumerate(program.nodes):
        if n.id != index:
            raise fail("nodes are not numbered in order (internal error)", n.id)
        for i in n.inputs:
            if i >= n.id:
                raise fail("an input is defined after its user (internal error)", n.id)
            src = program.nodes[i]
            if src.is_sink:
                what = "reduction" if src.op in ("reduce", "block_scale") else "output store"
                raise fail(f"uses the result of a {what} (%{i}); a reduction is only finished after the "
                           "kernel and cannot be used later in the same epilogue", n.id)
        if n.op in LEAF_OPS:
            if n.inputs:
                raise fail("a leaf node has inputs (internal error)", n.id)
            seen_acc |= n.op == "acc"
            if n.op == "index" and n.attr("axis") not in ("row", "col"):
                raise fail("index axis must be row or col (internal error)", n.id)
            if n.op == "load" and n.attr("packed"):
                for u in users[n.id]:
                    if program.nodes[u].op not in UNPACK_OPS:
                        raise fail("a cc.PairTile operand is used other than through cc.unpack", u)
            continue
        if n.op in OPS:
            if len(n.inputs) != OPS[n.op].arity:
                raise fail(f"{n.op} takes {OPS[n.op].arity} inputs, has {len(n.inputs)}", n.id)
            expected = result_kind(n.op, [program.nodes[i].kind for i in n.inputs])
            if n.kind != expected:
                raise fail(f"kind {n.kind.value} does not match its inputs ({expected.value})", n.id)
            if n.op == "pow" and program.nodes[n.inputs[1]].op != "const":
                raise fail("pow needs a constant exponent", n.id)
            if n.op in UNPACK_OPS:
                src = program.nodes[n.inputs[0]]
                if not (src.op == "load" and src.attr("packed")):
                    raise fail("unpack takes a cc.PairTile operand", n.id)
            if n.op == "pack":
                for u in users[n.id]:
                    un = program.nodes[u]
                    if not (un.op == "store" and un.attr("layout") == "packed"):
                        raise fail("a cc.pack(...) value can only be returned as an output", u)
            if n.op in PAIR_PICK_OPS and \
                    any(program.nodes[i].kind in (Kind.ROW, Kind.SCALAR) for i in n.inputs):
                raise fail("a pair op on a per-row or scalar value (internal error: it is the value itself)", n.id)
            continue
        if n.op in SINK_OPS:
            name = n.attr("name")
            if not name:
                raise fail("an output without a name (internal error)", n.id)
            if name in names:
                raise fail(f"output '{name}' is defined twice", n.id)
            names.add(name)
            if len(n.inputs) != 1:
                raise fail("an output takes exactly one value", n.id)
            if n.op == "reduce":
                fn, axis = n.attr("fn"), n.attr("axis")
                if fn not in REDUCE_FNS or axis not in REDUCE_AXES:
                    raise fail(f"unsupported reduction {axis}_{fn}", n.id)
                if fn == "lse" and axis != "row":
                    raise fail("log-sum-exp is supported over rows (row_logsumexp) only", n.id)
                if axis == "segment":
                    w = n.attr("width")
                    if fn != "sum" or not isinstance(w, int) or w <= 0 or w % 8:
                        raise fail("segment reductions are sums over a width that is a positive multiple "
                                   "of 8", n.id)
            elif n.op == "block_scale":
                of = [m for m in program.nodes if m.op == "store" and m.attr("name") == n.attr("of")]
                if len(of) != 1 or of[0].attr("quant") != "block" or of[0].inputs != n.inputs:
                    raise fail("block scales without their quantised output (internal error)", n.id)
            else:
                layout = n.attr("layout", "tile")
                if layout not in STORE_LAYOUTS:
                    raise fail(f"unknown store layout {layout!r} (internal error)", n.id)
                if n.attr("quant") == "block" and n.dtype is not None and n.dtype not in FP8_DTYPES:
                    raise fail("a blockwise-quantised output must be FP8 (internal error)", n.id)
                if layout in TRANSPOSED_LAYOUTS and n.attr("accumulate"):
                    raise fail("a transposed output cannot be accumulated", n.id)
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
    tile_stores = [n for n in program.nodes if n.op == "store" and n.attr("name") != "D"
                   and n.attr("layout") not in ("half", "t", "half_t")   # stored from registers
                   and n.attr("quant") is None]
    if len(tile_loads) > MAX_TILE_INPUTS:
        raise EpilogueError(f"{len(tile_loads)} M x N tile inputs ({', '.join(sorted(tile_loads))}); at most "
                            f"{MAX_TILE_INPUTS} fit the epilogue's shared memory", program=program.name)
    if len(tile_stores) > MAX_TILE_OUTPUTS:
        raise EpilogueError(f"{len(tile_stores)} tile outputs besides D; at most {MAX_TILE_OUTPUTS} fit the "
                            "epilogue's shared memory", program=program.name)
    return program
