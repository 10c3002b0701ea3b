"""Visitor node kinds: one class per kind of node in the generated ``Sm90TopologicalVisitor``, the
one place that says what the node is in C++.

A kind knows which IR nodes it lowers (``ops`` / ``matches``), what the C++ needs from the IR node
(``params``), the node's C++ type (``cpp_type``), its runtime ``Arguments`` initialiser
(``arguments``; slots index the host ABI arrays ``p.tensors``, ``p.ld`` and ``p.scalars``), type
aliases it refers to (``declaration``), the coda headers it needs (``headers``) and the shared
memory it stages tiles in (``smem_bytes``). What a kind says may depend on the kernel plan (the
CTA tile): a segment sum is a per-tile row reduction, or a ``coda::SegmentRowSum`` when a tile
holds several segments. Output buffers, their partials layout and finishing live on the node's
``TensorSlot`` (``partials.PartialLayout``). ``KINDS`` lists the kinds lowering tries, in order:
fp8.py (the scaled accumulator of FP8 GEMMs), leaves.py, compute.py and outputs.py, each in its own
match order; base.py is the interface.

CUTLASS's names are inverted from ours: a per-row vector (length M) is a *Col*Broadcast and a
per-row reduction (over N) is a *Col*Reduction; a per-column vector (length N) is a *Row*Broadcast.
"""

from __future__ import annotations

from ...ir.nodes import Node
from .base import LowerContext, NodeKind, Staging, element, float_literal
from .compute import COMPUTE
from .fp8 import SCALED_ACC
from .leaves import ACC, LEAVES
from .outputs import AUX_STORE, D_STORE, NO_D, OUTPUTS, REDUCE_IDENTITY
from .quantized import QUANTIZED

# Lowering takes the first kind that matches an IR node (the groups match disjoint ops; the scaled
# accumulator of FP8 GEMMs before the plain one; quantised and transposed stores before the other stores).
KINDS: tuple[NodeKind, ...] = (SCALED_ACC, *LEAVES, *COMPUTE, *QUANTIZED, *OUTPUTS)


def kind_of(n: Node, ctx: LowerContext) -> NodeKind | None:
    return next((k for k in KINDS if k.matches(n, ctx)), None)


__all__ = ["KINDS", "NodeKind", "LowerContext", "Staging", "element", "float_literal", "kind_of", "ACC", "AUX_STORE",
           "D_STORE", "NO_D", "REDUCE_IDENTITY"]
