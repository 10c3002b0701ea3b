"""The node kind interface (``NodeKind``) and what kinds share: the lowering context, the staging
geometry for shared-memory estimates, element types and float literals."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...dtypes import F32, DType
from ...fp8.gemm import Fp8Gemm
from ...ir.nodes import Node
from ..graph import TensorSlot, VisitorNode

if TYPE_CHECKING:
    from ...config import KernelConfig
    from ..plan import KernelPlan


@dataclass(frozen=True)
class Staging:
    """Shared-memory geometry of the epilogue (lower/smem.py): elements per epilogue subtile, the C
    (load) and D (store) pipeline stages, the CTA tile width."""
    elems: int
    stages_c: int
    stages_d: int
    tile_n: int


@dataclass(frozen=True)
class LowerContext:
    """What lowering knows when it maps an IR node: the host ABI slots, which tile input the
    collective's C load reads, and an FP8 GEMM's operands."""
    tensors: tuple[TensorSlot, ...]
    slot_of: dict[str, int]
    scalars: tuple[str, ...]
    c_operand: str | None
    fp8: Fp8Gemm | None = None

    def slot(self, name: str) -> TensorSlot:
        return self.tensors[self.slot_of[name]]


def element(slot: TensorSlot) -> DType:
    """The kernel's element type of a tile slot: packed 16-bit pairs travel as one 32-bit word."""
    return F32 if slot.layout == "packed" else slot.dtype


def float_literal(value: float) -> str:
    """A C++ float literal for the fp32 value the interpreter uses: ``value`` rounded to fp32 (a
    constant beyond fp32's range, e.g. 1e39, is then infinity, as ``torch.tensor(1e39,
    dtype=torch.float32)`` is)."""
    if math.isnan(value):
        return "cutlass::platform::numeric_limits<float>::quiet_NaN()"
    f32 = float(torch.tensor(value, dtype=torch.float32))
    if math.isinf(f32):
        inf = "cutlass::platform::numeric_limits<float>::infinity()"
        return inf if f32 > 0 else "-" + inf
    text = "%.9g" % f32
    if not any(c in text for c in ".e"):
        text += ".0"
    return text + "f"


class NodeKind:
    """A kind of visitor node. Subclasses override what differs from these defaults."""
    name = ""
    header: str | None = None      # the coda header the node's C++ type is defined in
    ops: frozenset[str] = frozenset()   # the IR ops it lowers (unless ``matches`` says more)

    def __repr__(self) -> str:
        return f"<node kind {self.name}>"

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op in self.ops

    def params(self, n: Node, ctx: LowerContext) -> dict[str, Any]:
        return {}

    def comment(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return v.comment

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        raise NotImplementedError

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return "{}"

    def declaration(self, v: VisitorNode, plan: "KernelPlan") -> str:
        return ""

    def headers(self, v: VisitorNode, plan: "KernelPlan") -> tuple[str, ...]:
        return (self.header,) if self.header else ()

    def smem_bytes(self, v: VisitorNode, staging: Staging) -> int:
        return 0

    def config_problem(self, v: VisitorNode, config: "KernelConfig") -> str | None:
        """Why this node cannot run with ``config`` (e.g. a run that must lie inside the CTA tile), or None."""
        return None
