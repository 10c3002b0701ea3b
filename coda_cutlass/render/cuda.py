"""Jinja rendering of a lowered EVT graph into a `.cu` translation unit.

The template holds the kernel's C++ shape; each visitor node's type, arguments and declarations
come from its node kind (lower/kinds.py). User strings (program, operand and output names) reach the
C++ only through the ``comment`` and ``c_string`` filters.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

import jinja2

from .. import __version__
from ..config import EPILOGUE_SCHEDULE, TILE_SCHEDULER
from ..ir.nodes import Kind
from ..ir.printer import node_line
from ..lower.graph import ABI_VERSION, TensorSlot, VisitorNode
from ..lower.kinds import AUX_STORE
from ..lower.mainloop import kernel_schedule
from ..lower.plan import KernelPlan
from ..fp8.scales import ScaleLayout
from ..paths import templates_dir

_UNSAFE_COMMENT = re.compile(r"[^\x20-\x7e]|\*/|\\")


def comment(text: object) -> str:
    """Make text safe inside a // comment: printable ASCII, no line breaks or continuations."""
    return _UNSAFE_COMMENT.sub("?", str(text))


def c_string(text: object) -> str:
    """Escape text for a C string literal (the JSON description is ASCII already)."""
    s = str(text).encode("ascii", "backslashreplace").decode("ascii")
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("?", "\\?")


@lru_cache(maxsize=1)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["comment"] = comment
    env.filters["c_string"] = c_string
    return env


def slot_doc(t: TensorSlot, tile_n: int) -> str:
    if t.role == "gemm_scale":
        return ScaleLayout(t.name, "A" if t.name == "scale_a" else "W", t.layout).describe().split(": ", 1)[1]
    shape = {Kind.TILE: "[M, N]", Kind.ROW: "[M]", Kind.COL: "[N]", Kind.SCALAR: "[] (one value, on the device)"}[t.kind]
    if t.partials is not None:
        return t.partials.doc(tile_n)
    role = {"input": "input", "output": "output", "inout": "accumulated output (read, then written)"}[t.role]
    if t.layout == "packed":
        return f"{role} {t.dtype.name} [M, 2N] interleaved pairs, read as [M, N] 32-bit words (ld in words)"
    if t.layout == "half":
        return f"{role} {t.dtype.name} [M, N/2] (half width: column i from the pair 2i, 2i+1)"
    if t.layout in ("t", "half_t"):
        cols = "N" if t.layout == "t" else "N/2 (half width)"
        return f"{role} {t.dtype.name} [{cols}, M], the transpose (M contiguous; ld = row stride)"
    if t.layout == "scale":
        rows = {"tile": "M", "half": "M", "t": "N", "half_t": "N/2"}[t.scale_of]
        if t.group != 1:
            return (f"{role} f32 block scales, stored [runs, {rows}/{t.group}] (run-major; ld >= {rows}/{t.group}): "
                    f"one per {t.group} x {t.block} block of the quantised output's stored rows")
        return (f"{role} f32 block scales, stored [runs, {rows}] (run-major; ld = {rows}): one per 1 x {t.block} "
                "run of each stored row of the quantised output")
    return f"{role} {t.dtype.name} {shape}"


def slot_check(t: TensorSlot) -> str:
    if t.role == "gemm_scale":      # fp32 scales; alignment and strides are checked in Python (fp8/scales.py)
        return "coda::SlotKind::Vector, 4"
    if t.role == "partials":
        return "coda::SlotKind::Partials, 4"
    if t.layout == "packed":
        return "coda::SlotKind::Tile, 4"    # 32-bit words holding a pair each
    if t.stored_from_registers:
        return f"coda::SlotKind::Vector, {t.dtype.bits // 8}"  # register stores: no TMA constraints
    kind = "Tile" if t.kind == Kind.TILE else "Vector"
    return f"coda::SlotKind::{kind}, {t.dtype.bits // 8}"


@dataclass(frozen=True)
class NodeView:
    """One visitor node as the template writes it."""
    index: int
    children: tuple[int, ...]
    comment: str
    type: str
    args: str
    declaration: str


def node_view(v: VisitorNode, plan: KernelPlan) -> NodeView:
    k = v.kind
    return NodeView(v.index, v.children, k.comment(v, plan), k.cpp_type(v, plan), k.arguments(v, plan),
                    k.declaration(v, plan))


def render_kernel(plan: KernelPlan) -> str:
    graph, cfg = plan.graph, plan.config
    if cfg.epilogue_tile is None:
        epilogue_tile = "cutlass::epilogue::collective::EpilogueTileAuto"
    else:
        epilogue_tile = f"Shape<_{cfg.epilogue_tile[0]}, _{cfg.epilogue_tile[1]}>"
    aux_stores = [v for v in graph.nodes if v.kind is AUX_STORE]
    smem_element = aux_stores[0].params["element"].cpp if aux_stores else graph.dtype.cpp
    align_c = 128 // (graph.element_c.bits if graph.element_c else graph.dtype.bits)
    align_d = 128 // (graph.element_d.bits if graph.element_d else graph.dtype.bits)
    mainloop = plan.mainloop
    template = environment().get_template("kernel.cu.j2")
    return template.render(
        mainloop=mainloop,
        scale_slots={t.name: t.index for t in graph.tensors if t.role == "gemm_scale"},
        name=graph.program.name,
        version=__version__,
        graph=graph,
        nodes=[node_view(v, plan) for v in graph.nodes],
        headers=plan.headers(),
        cfg=cfg,
        dtype=graph.dtype,
        weight_layout=plan.weight_layout,
        ir_lines=[node_line(n) for n in graph.program.nodes],
        kernel_schedule=kernel_schedule(cfg, mainloop),
        epilogue_schedule=EPILOGUE_SCHEDULE[cfg.schedule],
        tile_scheduler=TILE_SCHEDULER[cfg.scheduler],
        epilogue_tile=epilogue_tile,
        node_names=[f"Node{n.index}" for n in graph.nodes],
        smem_element=smem_element,
        align_c=align_c,
        align_d=align_d,
        description=json.dumps(plan.describe(), sort_keys=True),
        abi_version=ABI_VERSION,
        slot_doc=lambda t: slot_doc(t, cfg.tile_n),
        slot_check=slot_check,
    )
