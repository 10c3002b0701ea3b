"""Dead-code elimination: drop every node no output depends on (the accumulator always stays)."""

from __future__ import annotations

from ..ir.nodes import Program


def eliminate_dead_code(program: Program) -> Program:
    live: set[int] = set()
    for n in reversed(program.nodes):
        if n.is_sink or n.id in live or n.op == "acc":   # the accumulator stays even if unused
            live.add(n.id)
            live.update(n.inputs)
    return program.with_nodes(n for n in program.nodes if n.id in live)
