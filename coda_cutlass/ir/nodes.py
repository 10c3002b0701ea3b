"""The typed IR: a DAG of nodes in topological order, plain frozen dataclasses.

A value's *kind* says how it is indexed over the GEMM output tile (M x N):

- ``SCALAR``  one value for the whole tile (a runtime scalar or a Python constant)
- ``ROW``     one value per row m (a length-M vector, broadcast along N)
- ``COL``     one value per column n (a length-N vector, broadcast along M)
- ``TILE``    one value per element (m, n)

Node ops:

- ``acc``                       the fp32 GEMM accumulator
- ``load``    attrs operand     a tensor operand (TILE, ROW or COL)
- ``scalar``  attrs operand     a runtime scalar operand
- ``const``   attrs value       a Python constant
- ``index``   attrs axis        the row (ROW) or column (COL) index of the element, as fp32
- compute ops (see ``ops.py``)  elementwise math in fp32; ``cast`` rounds to ``attrs dtype``;
                                pair ops read the adjacent column pair (2i, 2i+1)
- ``store``   attrs name, accumulate, layout    a tile output (sink); layout "tile" (M x N),
                                "packed" (a pack(a, b) value, M x 2N), "half" (M x N/2, the even
                                column of each pair), "t" (the transpose, N x M: row n holds column
                                n) or "half_t" (the transpose of a half-width output, N/2 x M);
                                attrs quant "block" (with block, pow2, and group when > 1): an FP8
                                output scaled per 1 x block run of each stored row, or per group
                                x block block of stored rows (``cc.quantize(..., block=, group=)``)
- ``block_scale`` attrs name, of, layout, block, pow2 (group)   the dequantisation scales of the
                                quantised output ``of`` (sink, fp32): one per 1 x block run of its
                                stored rows (per group x block block with group)
- ``reduce``  attrs name, fn, axis      a reduction output (sink): fn sum/max/min over axis
                                row/col/all; fn lse (log-sum-exp) over row; fn sum over axis segment
                                (attrs width: one sum per row and width-wide column segment)

A load with attrs packed reads an M x 2N tensor of interleaved 16-bit pairs; its value may only
feed unpack_lo / unpack_hi. A pack value may only be stored.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from typing import Any, Iterable

from ..dtypes import DType
from .kind import Kind
from .printer import format_program, format_signature

SINK_OPS = frozenset({"store", "reduce", "block_scale"})
LEAF_OPS = frozenset({"acc", "load", "scalar", "const", "index"})
OPERAND_OPS = frozenset({"load", "scalar"})      # leaves that read a named operand
REDUCE_FNS = ("sum", "max", "min", "lse")
# What a reduction over nothing gives (an empty M or N, padding in partials).
REDUCTION_IDENTITY = {"sum": 0.0, "max": float("-inf"), "min": float("inf"), "lse": float("-inf")}
REDUCE_AXES = ("row", "col", "all", "segment")
STORE_LAYOUTS = ("tile", "packed", "half", "t", "half_t")
TRANSPOSED_LAYOUTS = frozenset({"t", "half_t"})    # written as the transpose: rows are the columns n
HALF_LAYOUTS = frozenset({"half", "half_t"})       # the even column of each pair (2i, 2i+1), as column i


def layout_columns(layout: str, N: int) -> int:
    """Columns of a tile tensor of this layout: M x N, packed pairs M x 2N, half width M x N/2
    (for the transposed layouts: the columns of the untransposed output)."""
    return 2 * N if layout == "packed" else (N // 2 if layout in HALF_LAYOUTS else N)


def layout_shape(layout: str, M: int, N: int) -> tuple[int, int]:
    """The (rows, columns) of a stored output of this layout for an M x N GEMM output."""
    cols = layout_columns(layout, N)
    return (cols, M) if layout in TRANSPOSED_LAYOUTS else (M, cols)


def scale_shape(codes_layout: str, M: int, N: int, block: int, group: int = 1) -> tuple[int, int]:
    """The (rows, blocks) of the block scales of a quantised output: one per 1 x block run of each
    stored row (a partial run at the end of a row included); with ``group``, one per run of each
    ``group`` stored rows (a group x block block; a partial group at the end included)."""
    rows, cols = layout_shape(codes_layout, M, N)
    return -(-rows // group), -(-cols // block)


@dataclass(frozen=True)
class Node:
    id: int
    op: str
    inputs: tuple[int, ...] = ()
    attrs: tuple[tuple[str, Any], ...] = ()
    kind: Kind = Kind.TILE
    dtype: DType | None = None   # set by the binding pass: the value's storage/rounding type

    def attr(self, name: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == name:
                return v
        return default

    @property
    def is_sink(self) -> bool:
        return self.op in SINK_OPS

    @property
    def label(self) -> str:
        """How errors and comments name this node: ``%3 (mul)``."""
        return f"%{self.id} ({self.op})"


def make_attrs(**kwargs: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(kwargs.items()))


def const_key(value: float) -> bytes:
    """What tells two constants apart: their bit pattern, so -0.0 and 0.0 (equal as floats, but
    1/x tells them apart) stay two constants."""
    return struct.pack("<d", value)


def attrs_key(attrs: tuple[tuple[str, Any], ...]) -> tuple[tuple[str, Any], ...]:
    """Attributes as a key for deduplication: float values by bit pattern (``const_key``)."""
    return tuple((k, const_key(v) if isinstance(v, float) else v) for k, v in attrs)


@dataclass(frozen=True)
class Operand:
    """A named argument of the epilogue program (besides the accumulator)."""
    name: str
    kind: Kind
    dtype: DType | None = None     # None: bound to the GEMM operand dtype (tensors) / f32 (scalars)
    packed: bool = False           # an M x 2N tile of interleaved 16-bit pairs (cc.PairTile)
    device: bool = False           # a SCALAR read from a 0-dim device tensor (cc.DeviceScalar): a
                                   # tensor slot of the ABI, loaded with op "load" like tensors

    @property
    def host_scalar(self) -> bool:
        """A runtime number passed by value (cc.Scalar), not a tensor slot."""
        return self.kind == Kind.SCALAR and not self.device


@dataclass(frozen=True)
class Program:
    """An epilogue program. ``nodes`` are in topological order and ``nodes[i].id == i``."""
    name: str
    operands: tuple[Operand, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]           # output names in the order the program returned them
    source: str = ""                   # where the program was defined (file:line), for messages
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __str__(self) -> str:
        """The whole program, one node per line (``print(k.ir)``)."""
        return format_program(self)

    def __repr__(self) -> str:
        return f"<Program {format_signature(self)}, {len(self.nodes)} nodes>"

    def node(self, i: int) -> Node:
        return self.nodes[i]

    def users(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {n.id: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.id)
        return out

    def sinks(self) -> list[Node]:
        return [n for n in self.nodes if n.is_sink]

    def sink(self, name: str) -> Node:
        for n in self.nodes:
            if n.is_sink and n.attr("name") == name:
                return n
        raise KeyError(name)

    def operand(self, name: str) -> Operand:
        for o in self.operands:
            if o.name == name:
                return o
        raise KeyError(name)

    def with_nodes(self, nodes: Iterable[Node]) -> "Program":
        return replace(self, nodes=renumber(list(nodes)))


def renumber(nodes: list[Node]) -> tuple[Node, ...]:
    """Re-index nodes 0..n-1 in the given (topological) order, remapping inputs."""
    remap: dict[int, int] = {}
    out: list[Node] = []
    for new_id, n in enumerate(nodes):
        remap[n.id] = new_id
        out.append(replace(n, id=new_id, inputs=tuple(remap[i] for i in n.inputs)))
    return tuple(out)
