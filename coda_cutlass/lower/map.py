"""Lowering for map kernels: an epilogue program applied to an existing M x N tensor, no GEMM.

The program's ``acc`` is the tensor ``X`` the kernel is called with. The same language and the same
typed IR as GEMM epilogues; only the code generator differs: a plain CUDA kernel in which each
thread evaluates the IR nodes in order on 8 consecutive columns of one row (templates/map.cu.j2,
templates/coda/map_kernel.hpp). Used where a Transformer needs memory-bound work with no GEMM in
front of it: the first RMSNorm's statistics (after the embedding) and the RoPE backward on the
attention gradients.

Node placement: values that do not vary along M (scalars, constants, per-column vectors and math on
them) are computed once per thread before the row loop; per-row and per-element values inside it.
A value that varies along N is an 8-element array, one that does not is a single float.

Supported: every elementwise op and cast, the pair ops (pairs, interleave, pair_map, rotate_pairs),
row/col indices, tile / per-row / per-column / scalar / device-scalar operands, tile outputs (full
or half width, FP8 included), FP8 outputs quantised per tensor or per 1 x 128 run (the 16 lanes of
a run reduce its amax with shuffles), transposed outputs (N x M: the block's 32 x 256 tile staged
in shared memory, written as 32-element runs of its 256 rows; a per-tensor scale survives the
transpose, so ``cc.quantize(..., scale=s, transpose=True)`` is one), accumulated outputs, and row
reductions (sum, max, min, gather) and total sums as per-(row, 256-column tile) partials.

A transposed output with 128 x 1 block scales (``cc.quantize(..., block=128, transpose=True)``: the
weight-gradient operand of the blockwise recipe) makes each block walk 128 rows, one run of each of
its 256 columns, in two passes, warp w over rows 16w .. 16w + 15: the first evaluates only what that
output needs and reduces each column's amax (registers, then the 8 warps in shared memory); the
second evaluates the whole program with the column scales known and keeps the transposed codes in
registers, 8 bytes a row, which byte permutes transpose into 16-byte runs of the output's rows (no
shared-memory tile: reading one back took an instruction per byte). The block's tile inputs (up to
STAGE_BYTES of them, X first) are copied once into shared memory before the first pass (cp.async,
every row in flight at once) and both passes read them there, not L2 again. One such output per
kernel, and no other transposed output beside it (that one would need a 128-row staging tile).

Refused with an error naming the node: packed pairs, log-sum-exp, segment sums, column reductions,
half-width transposed outputs, and a second transposed output beside a block-scaled one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..dtypes import F32, DType, as_dtype
from ..errors import EpilogueError
from ..ir.nodes import Kind, Node, Program
from ..ir.ops import OPS, PACK_OPS, PAIR_OPS
from ..ir.printer import node_text
from ..partials import PartialLayout
from .kinds import REDUCE_IDENTITY, float_literal

MAP_ABI_VERSION = 1
TILE_N = 256          # columns per partial (templates/coda/map_kernel.hpp kTileN)
ROWS, RUN_ROWS = 32, 128   # rows per block: plain, and with a 128 x 1 block-scaled transposed output
PARTIALS_TILE = (1, TILE_N)   # the map kernel's partials: per (row, 256-column tile), rows unpadded
# Dynamic shared memory for the tile inputs a two-pass block stages: one bf16 128 x 256 tile, so that
# with the column scales (~9 KB) three blocks fit an SM.
STAGE_BYTES = 64 * 1024

_REDUCE_FUNCTOR = {"sum": "coda::scalar::add", "max": "coda::scalar::maximum", "min": "coda::scalar::minimum"}
# Functor headers beyond the op table's (ir/ops.py): a map kernel rotates pairs with the sin/cos
# of coda/math_extra.hpp (GEMM epilogues use the coda::PairRotate node of coda/rotate.hpp).
_MAP_HEADERS = {"pair_rotate": "coda/math_extra.hpp"}


@dataclass(frozen=True)
class MapSlot:
    """One tensor of the host ABI of a map kernel."""
    index: int
    name: str
    role: str          # "acc" (the input X), "input", "output", "inout", "partials"
    kind: Kind         # TILE, ROW (length M), COL (length N); partials: ROW
    dtype: DType
    layout: str = "tile"          # tile outputs: "tile" (M x N), "half" (M x N/2), "t" (N x M) or "scale"
                                  # (block scales)
    partials: PartialLayout | None = None   # role "partials" (with PARTIALS_TILE)
    scale_of: str | None = None   # layout "scale": the layout of the quantised output it scales
    group: int = 1                # layout "scale": stored rows sharing each run's scale

    def describe(self) -> dict[str, Any]:
        d = {"index": self.index, "name": self.name, "role": self.role, "kind": self.kind.value,
             "dtype": self.dtype.name}
        if self.layout != "tile":
            d["layout"] = self.layout
        if self.group != 1:
            d["group"] = self.group
        if self.partials:
            d["reduce"] = f"{self.partials.axis}_{self.partials.fn}"
        return d


@dataclass(frozen=True)
class MapNode:
    """One IR node as the map template emits it."""
    id: int
    op: str                    # the template macro: see map.cu.j2
    vector: bool               # an 8-element array (varies along N) or one float
    hoisted: bool              # computed before the row loop (does not vary along M)
    inputs: tuple[tuple[int, bool], ...]   # (node id, is vector)
    comment: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class MapGraph:
    program: Program
    dtype: DType               # dtype of X (and the default of tile operands)
    slots: tuple[MapSlot, ...]
    scalars: tuple[str, ...]
    nodes: tuple[MapNode, ...]
    headers: tuple[str, ...]
    first_pass: tuple[MapNode, ...] = ()   # what the column scales of a block-scaled transposed output need

    @property
    def transposed(self) -> tuple[MapSlot, ...]:
        """The transposed (N x M) outputs: each stages the block's tile in shared memory."""
        return tuple(s for s in self.slots if s.role == "output" and s.layout == "t")

    @property
    def column_scaled(self) -> tuple[MapNode, ...]:
        """The stores of transposed outputs with 128 x 1 block scales (at most one)."""
        return tuple(n for n in self.nodes if n.op == "t_quant_store")

    @property
    def stage_offsets(self) -> dict[int, int]:
        """With a block-scaled transposed output: slot index -> byte offset in the dynamic shared
        memory of each 16-bit tile input a block copies once for its two passes (in slot order, X
        first, while they fit STAGE_BYTES)."""
        if not self.column_scaled:
            return {}
        out, used = {}, 0
        for s in self.slots:
            if s.kind == Kind.TILE and s.role in ("acc", "input") and s.layout == "tile" and s.dtype.bits == 16:
                if used + _stage_bytes(s) <= STAGE_BYTES:
                    out[s.index] = used
                    used += _stage_bytes(s)
        return out

    @property
    def staged(self) -> tuple[MapSlot, ...]:
        """The staged tile inputs (``stage_offsets``), in slot order."""
        return tuple(self.slots[i] for i in self.stage_offsets)

    @property
    def stage_bytes(self) -> int:
        """The dynamic shared memory a block takes for its staged inputs."""
        return sum(_stage_bytes(s) for s in self.staged)

    @property
    def rows(self) -> int:
        """Rows per block: a 128 x 1 run of each column when an output needs its column scales."""
        return RUN_ROWS if self.column_scaled else ROWS

    def describe(self) -> dict[str, Any]:
        return json.loads(json.dumps({
            "abi": f"map-{MAP_ABI_VERSION}", "program": self.program.name, "dtype": self.dtype.name,
            "slots": [s.describe() for s in self.slots], "scalars": list(self.scalars),
            "outputs": list(self.program.outputs)}))


def _stage_bytes(s: MapSlot) -> int:
    """A staged input's 128 x 256 tile, in bytes."""
    return RUN_ROWS * TILE_N * s.dtype.bits // 8


def _refuse(program: Program, n: Node, why: str) -> EpilogueError:
    return EpilogueError(f"map kernels (no GEMM) do not support {why}; use it in a GEMM epilogue",
                         program=program.name, node=n.label)


def lower_map(program: Program, dtype: DType) -> MapGraph:
    """Typed IR -> the map kernel's slots and nodes. Raises EpilogueError for unsupported nodes."""
    accumulated = {n.attr("name") for n in program.nodes if n.op == "store" and n.attr("accumulate")}
    slots: list[MapSlot] = [MapSlot(0, "acc", "acc", Kind.TILE, dtype)]
    slot_of: dict[str, int] = {}
    live = {n.attr("operand") for n in program.nodes if n.op == "load"}
    for o in program.operands:
        if o.host_scalar or o.name not in live:
            continue
        if o.packed:
            raise EpilogueError(f"operand '{o.name}': map kernels do not read packed pairs (cc.PairTile)",
                                program=program.name)
        slot_of[o.name] = len(slots)
        role = "inout" if o.name in accumulated else "input"
        slots.append(MapSlot(len(slots), o.name, role, o.kind, o.dtype or dtype))
    for name in program.outputs:
        n = program.sink(name)
        if n.op == "store":
            if name in accumulated:
                continue
            slot_of[name] = len(slots)
            slots.append(MapSlot(len(slots), name, "output", Kind.TILE, n.dtype, layout=n.attr("layout", "tile")))
        elif n.op == "block_scale":
            slot_of[name] = len(slots)
            slots.append(MapSlot(len(slots), name, "output", Kind.TILE, F32, layout="scale",
                                 scale_of=n.attr("layout"), group=n.attr("group", 1)))
        else:
            slot_of[name] = len(slots)
            out = as_dtype(n.attr("out_dtype", "f32"))   # partials are fp32; the finished result is this
            slots.append(MapSlot(len(slots), name, "partials", Kind.ROW, out, partials=PartialLayout.of(n)))
    scalars = tuple(o.name for o in program.operands
                    if o.host_scalar and any(n.op == "scalar" and n.attr("operand") == o.name
                                                     for n in program.nodes))

    vector: dict[int, bool] = {}
    nodes: list[MapNode] = []
    headers: set[str] = set()
    for n in program.nodes:
        vec = n.kind in (Kind.TILE, Kind.COL)
        hoisted = n.kind in (Kind.SCALAR, Kind.COL)
        vector[n.id] = vec
        ins = tuple((i, vector[i]) for i in n.inputs)
        op, params = _node(program, n, slot_of, scalars)
        header = _MAP_HEADERS.get(n.op) or (OPS[n.op].header if n.op in OPS else None)
        if header:
            headers.add(header)
        if n.op == "store" and n.dtype is not None and n.dtype.bits == 8:
            headers.add("coda/fp8_scale.hpp")     # FP8 conversion (and the scales of quantised outputs)
        if n.is_sink:
            hoisted = False
        nodes.append(MapNode(n.id, op, vec, hoisted, ins, node_text(n), params))
    first = _first_pass(program, nodes)
    return MapGraph(program, dtype, tuple(slots), scalars, tuple(nodes), tuple(sorted(headers)), first)


def _first_pass(program: Program, nodes: list[MapNode]) -> tuple[MapNode, ...]:
    """The nodes (in order, hoisted ones excluded: they are computed once) that the value of a
    block-scaled transposed output depends on; checks that it is the kernel's only transposed output."""
    column = [m for m in nodes if m.op == "t_quant_store"]
    if not column:
        return ()
    transposed = [m for m in nodes if m.op in ("t_store", "t_quant_store")]
    if len(transposed) > 1:
        ir = {n.id: n for n in program.nodes}
        names = ", ".join(f"'{ir[m.id].attr('name')}'" for m in transposed)
        raise EpilogueError(f"map kernels write one transposed output when it has 128 x 1 block scales, this program "
                            f"has {len(transposed)} ({names}): the other would need a 128-row shared-memory "
                            "staging tile; split the program into two map kernels",
                            program=program.name)
    by_id = {m.id: m for m in nodes}
    need: set[int] = set()
    todo = [i for i, _ in column[0].inputs]
    while todo:
        i = todo.pop()
        if i not in need:
            need.add(i)
            todo.extend(j for j, _ in by_id[i].inputs)
    return tuple(m for m in nodes if m.id in need and not m.hoisted)


def _node(program: Program, n: Node, slot_of: dict[str, int], scalars: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    if n.op == "acc":
        return "tile_load", {"slot": 0}
    if n.op == "load":
        slot = slot_of[n.attr("operand")]
        kind = {Kind.TILE: "tile_load", Kind.ROW: "row_load", Kind.COL: "col_load", Kind.SCALAR: "device_scalar"}[n.kind]
        return kind, {"slot": slot, "element": _cpp(n.dtype)}
    if n.op == "scalar":
        return "scalar", {"index": scalars.index(n.attr("operand"))}
    if n.op == "const":
        return "const", {"literal": float_literal(n.attr("value"))}
    if n.op == "index":
        return ("row_index" if n.attr("axis") == "row" else "col_index"), {}
    if n.op in PACK_OPS:
        raise _refuse(program, n, "packed pairs (cc.unpack / cc.pack)")
    if n.op == "cast":
        return "cast", {"element": as_dtype(n.attr("dtype")).cpp}
    if n.op in PAIR_OPS:
        return n.op, {}
    if n.op in OPS:
        return "fn", {"functor": f"coda::scalar::{OPS[n.op].functor}"}
    if n.op == "store":
        layout = n.attr("layout", "tile")
        if layout not in ("tile", "half", "t"):
            raise _refuse(program, n, f"half-width transposed ('{layout}') outputs")
        if layout == "t":
            if n.attr("quant") == "block":
                return "t_quant_store", {"slot": slot_of[n.attr("name")], "element": _cpp(n.dtype),
                                         "scale": slot_of[f"{n.attr('name')}_scale"],
                                         "pow2": "true" if n.attr("pow2") else "false", "group": n.attr("group", 1)}
            return "t_store", {"slot": slot_of[n.attr("name")], "element": _cpp(n.dtype)}
        if n.attr("quant") == "block":
            return "quant_store", {"slot": slot_of[n.attr("name")], "element": _cpp(n.dtype),
                                   "scale": slot_of[f"{n.attr('name')}_scale"], "half": layout == "half",
                                   "pow2": "true" if n.attr("pow2") else "false"}
        op = "half_store" if layout == "half" else "store"
        return op, {"slot": slot_of[n.attr("name")], "element": _cpp(n.dtype)}
    if n.op == "block_scale":
        return "none", {}        # written by the quantising store
    if n.op == "reduce":
        fn, axis = n.attr("fn"), n.attr("axis")
        if fn == "lse":
            raise _refuse(program, n, "log-sum-exp reductions")
        if axis not in ("row", "all"):
            raise _refuse(program, n, f"{axis} reductions")
        return "row_reduce", {"slot": slot_of[n.attr("name")], "functor": _REDUCE_FUNCTOR[fn],
                              "identity": REDUCE_IDENTITY[fn]}
    raise _refuse(program, n, f"op '{n.op}'")


def _cpp(dtype: DType | None) -> str:
    return (dtype or F32).cpp
