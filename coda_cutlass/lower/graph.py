"""The lowered epilogue: visitor nodes in topological order plus the host ABI's tensor slots. Plain
frozen dataclasses, independent of the kernel configuration (``plan`` adds the tile-dependent facts).

Every tensor the kernel touches gets a numbered slot in the host ABI; user names only ever reach
the generated C++ inside comments, never as identifiers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..dtypes import DType
from ..fp8.gemm import Fp8Gemm
from ..ir.nodes import Kind, Program, layout_columns, layout_shape, scale_shape
from ..partials import PartialLayout

if TYPE_CHECKING:
    from .kinds import NodeKind

ABI_VERSION = 1


@dataclass(frozen=True)
class TensorSlot:
    """One device pointer of the host ABI."""
    index: int
    name: str         # the operand or output it carries (documentation only)
    role: str         # "input", "output", "inout" (accumulated output), "partials" or "gemm_scale" (an FP8
                      # GEMM's scale_a / scale_b)
    kind: Kind        # TILE, ROW (length M), COL (length N); partials: ROW for row/total, COL for col;
                      # scales: SCALAR (their shape is the layout's, fp8/scales.py)
    dtype: DType
    layout: str = "tile"   # tile slots: "tile" (M x N), "packed" (M x 2N 16-bit pairs, passed to the
                           # kernel as M x N 32-bit elements: ld in 32-bit units), "half" (M x N/2);
                           # gemm_scale slots: the ScaleLayout kind ("tensor", "row", "block_1x128", ...)
    partials: PartialLayout | None = None   # role "partials": how the reduction's buffer is laid out
    scale_of: str | None = None   # layout "scale": the block scales of a quantised output of this layout
    block: int = 0                # layout "scale": elements per run (1 x block along its stored rows)
    group: int = 1                # layout "scale": stored rows sharing each run's scale
    stored_from_registers: bool = False   # written by a coda node without TMA (no 16-byte row rule)

    def columns(self, N: int) -> int:
        """Columns of a tile slot's tensor for a GEMM N."""
        return layout_columns(self.layout, N)

    def shape(self, M: int, N: int) -> tuple[int, int]:
        """The (rows, columns) of the tensor a call returns for this output slot."""
        if self.layout == "scale":
            return scale_shape(self.scale_of, M, N, self.block, self.group)
        return layout_shape(self.layout, M, N)

    def storage(self, M: int, N: int) -> tuple[int, int]:
        """The row-major buffer behind it: block scales are stored run-major ("MN-major": scale[run,
        row], with the row count rounded up to 4 so each run's column of scales is 16-byte aligned:
        the layout the blockwise-scaled GEMMs read with TMA); ``shape`` is the transpose of its
        first ``rows`` columns."""
        rows, cols = self.shape(M, N)
        return (cols, -(-rows // 4) * 4) if self.layout == "scale" else (rows, cols)

    def view(self, buffer: torch.Tensor, M: int, N: int) -> torch.Tensor:
        """The tensor a call returns from this slot's ``storage`` buffer."""
        if self.layout == "scale":
            return buffer[:, :self.shape(M, N)[0]].t()
        return buffer

    def describe(self, tile_n: int) -> dict[str, Any]:
        d = {"index": self.index, "name": self.name, "role": self.role, "kind": self.kind.value,
             "dtype": self.dtype.name}
        if self.partials is not None:
            d["reduce"] = f"{self.partials.axis}_{self.partials.fn}"
            if self.partials.width:
                d["width"] = self.partials.width
                d["segments"] = self.partials.segments(tile_n)
        if self.layout != "tile":
            d["layout"] = self.layout
        if self.scale_of is not None:
            d["scale_of"], d["block"] = self.scale_of, self.block
            if self.group != 1:
                d["group"] = self.group
        return d


@dataclass(frozen=True)
class VisitorNode:
    index: int
    kind: "NodeKind"               # what the node is in C++ (lower/kinds.py)
    children: tuple[int, ...]
    comment: str                   # the IR node behind it
    params: dict[str, Any] = field(default_factory=dict)   # what its kind needs: slot, element, ...


@dataclass(frozen=True)
class EvtGraph:
    program: Program
    dtype: DType                   # GEMM operand dtype (FP8 GEMMs: bf16, their epilogue's default)
    nodes: tuple[VisitorNode, ...]
    tensors: tuple[TensorSlot, ...]
    scalars: tuple[str, ...]       # runtime scalar operands, in slot order
    element_c: DType | None
    c_slot: int | None
    element_d: DType | None
    d_slot: int | None
    fp8: Fp8Gemm | None = None     # FP8 operands (A/W dtypes, scaling, accumulation); None: 16-bit

    def slot(self, name: str) -> TensorSlot:
        return next(t for t in self.tensors if t.name == name)
