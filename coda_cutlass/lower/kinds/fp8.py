"""The accumulator of an FP8 GEMM with tensor or row scaling: one visitor node that is a small tree,
the accumulator times the scales, so that every node of the program sees ``acc`` as the scaled
product (with block scaling the mainloop scales, and ``acc`` is a plain ``Sm90AccFetch``).

- tensor: ``acc * (scale_a * scale_b)``: one ``Sm90ScalarBroadcast`` over the two scalar pointers,
  combined with ``multiplies`` and read by the kernel from device memory (no host sync);
- row: ``(acc * scale_a[m]) * scale_b[n]``: a per-row (``Sm90ColBroadcast``) and a per-column
  (``Sm90RowBroadcast``) fp32 vector.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...ir.nodes import Node
from ..graph import VisitorNode
from .base import LowerContext, NodeKind, Staging

if TYPE_CHECKING:
    from ..plan import KernelPlan

MULTIPLY = "fusion::Sm90Compute<cutlass::multiplies, ElementCompute, ElementCompute, RoundStyle>"


def _scale_pointer(slot: int) -> str:
    return f"static_cast<float const*>(p.tensors[{slot}])"


class ScaledAccFetch(NodeKind):
    name = "scaled_acc"
    ops = frozenset({"acc"})

    def matches(self, n: Node, ctx: LowerContext) -> bool:
        return n.op == "acc" and ctx.fp8 is not None and ctx.fp8.epilogue_scaled

    def params(self, n: Node, ctx: LowerContext) -> dict[str, Any]:
        assert ctx.fp8 is not None
        return {"scaling": ctx.fp8.scaling, "a": ctx.slot_of["scale_a"], "b": ctx.slot_of["scale_b"]}

    def comment(self, v: VisitorNode, plan: "KernelPlan") -> str:
        how = ("* (scale_a * scale_b)" if v.params["scaling"] == "tensor"
               else "* scale_a[m] * scale_b[n]")
        return f"{v.comment}  = (A @ W^T) {how}: FP8 {v.params['scaling']} scaling"

    def declaration(self, v: VisitorNode, plan: "KernelPlan") -> str:
        i = v.index
        if v.params["scaling"] == "tensor":
            return (f"// FP8 tensor scaling: scale_a * scale_b, two fp32 scalars read from device memory\n"
                    f"using ScaleAB{i} = fusion::Sm90ScalarBroadcast<ElementCompute, StrideScalar, 2, "
                    "cutlass::multiplies>;")
        return (f"// FP8 row scaling: scale_a (one fp32 per row m) and scale_b (one fp32 per column n)\n"
                f"using ScaleA{i} = fusion::Sm90ColBroadcast<0, TileShape, float, ElementCompute, StridePerRow>;\n"
                f"using ScaleB{i} = fusion::Sm90RowBroadcast<0, TileShape, float, ElementCompute, StridePerCol>;")

    def cpp_type(self, v: VisitorNode, plan: "KernelPlan") -> str:
        i = v.index
        if v.params["scaling"] == "tensor":
            return f"fusion::Sm90EVT<{MULTIPLY},\n      fusion::Sm90AccFetch, ScaleAB{i}>"
        return (f"fusion::Sm90EVT<{MULTIPLY},\n      fusion::Sm90EVT<{MULTIPLY}, fusion::Sm90AccFetch, ScaleA{i}>,"
                f"\n      ScaleB{i}>")

    def arguments(self, v: VisitorNode, plan: "KernelPlan") -> str:
        a, b = _scale_pointer(v.params["a"]), _scale_pointer(v.params["b"])
        if v.params["scaling"] == "tensor":
            return f"{{{{}}, {{{{1.f, 1.f}}, {{{a}, {b}}}, {{}}}}, {{}}}}"
        return f"{{{{{{}}, {{{a}, 0.f, {{}}}}, {{}}}}, {{{b}, 0.f, {{}}}}, {{}}}}"

    def smem_bytes(self, v: VisitorNode, staging: Staging) -> int:
        return staging.tile_n * 4 if v.params["scaling"] == "row" else 0


SCALED_ACC = ScaledAccFetch()
