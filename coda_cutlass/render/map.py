"""Jinja rendering of a lowered map kernel (lower/map.py) into a `.cu` translation unit."""

from __future__ import annotations

import json

from .. import __version__
from ..ir.nodes import Kind
from ..ir.printer import node_line
from ..lower.map import MAP_ABI_VERSION, MapGraph, MapSlot
from .cuda import environment


def map_slot_doc(s: MapSlot) -> str:
    if s.partials is not None:
        what = f"total_{s.partials.fn}" if s.partials.axis == "all" else f"row_{s.partials.fn}"
        return f"fp32 partials of {what}, [ceil(N / 256), M]"
    if s.role == "acc":
        return f"X, the program's acc: {s.dtype.name} [M, N] (strided view)"
    if s.kind == Kind.SCALAR:
        return "input f32 [] (one value, on the device)"
    if s.kind != Kind.TILE:
        return f"input {s.dtype.name} " + ("[M]" if s.kind == Kind.ROW else "[N]")
    if s.layout == "scale" and s.scale_of == "t":
        return ("output f32 block scales of the transposed output, stored [runs, N] (run-major: views.stride_m "
                "= ld): one per 128 x 1 run of each column of X (1 x 128 along the transpose's rows)")
    if s.layout == "scale":
        return ("output f32 block scales of a quantised output, stored [runs, M] (run-major: views.stride_m "
                "= ld): one per 1 x 128 run of each row")
    if s.layout == "t":
        return (f"output {s.dtype.name} [N, M] (transposed: row n holds column n of the tile; views.stride_m "
                "= its leading dimension)")
    role = {"input": "input", "output": "output", "inout": "accumulated output (read, then written)"}[s.role]
    width = "[M, N/2] (half width: column i from the pair 2i, 2i+1)" if s.layout == "half" else "[M, N]"
    return f"{role} {s.dtype.name} {width} (strided view)"


def render_map_kernel(graph: MapGraph) -> str:
    tile_slots = [s for s in graph.slots if s.kind == Kind.TILE and s.role != "partials"
                  and s.layout not in ("scale", "t")]
    return environment().get_template("map.cu.j2").render(
        name=graph.program.name,
        version=__version__,
        graph=graph,
        tile_slots=tile_slots,
        slot_element={s.index: s.dtype.cpp for s in tile_slots},
        staged=set(graph.stage_offsets),
        stage_offset=graph.stage_offsets,
        stage_bytes=graph.stage_bytes,
        ir_lines=[node_line(n) for n in graph.program.nodes],
        description=json.dumps(graph.describe(), sort_keys=True),
        abi_version=MAP_ABI_VERSION,
        slot_doc=map_slot_doc,
    )
