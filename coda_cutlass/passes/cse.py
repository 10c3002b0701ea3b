"""Common-subexpression elimination: identical nodes (same op, inputs, attributes) become one.
Constants are identical only bit for bit (-0.0 and 0.0 stay apart); NaN constants never merge."""

from __future__ import annotations

from dataclasses import replace

from ..ir.nodes import Node, Program, attrs_key


def eliminate_common_subexpressions(program: Program) -> Program:
    canon: dict[int, int] = {}
    seen: dict[tuple, int] = {}
    kept: list[Node] = []
    for n in program.nodes:
        inputs = tuple(canon[i] for i in n.inputs)
        n = replace(n, inputs=inputs)
        key = (n.op, inputs, attrs_key(n.attrs), n.kind, n.dtype)
        if not n.is_sink and key in seen and not _is_nan_const(n):
            canon[n.id] = seen[key]
            continue
        seen.setdefault(key, n.id)
        canon[n.id] = n.id
        kept.append(n)
    return program.with_nodes(kept)


def _is_nan_const(n: Node) -> bool:
    v = n.attr("value")
    return n.op == "const" and v != v
