"""Operand annotations of epilogue programs: ``cc.Tile``, ``cc.PerRow``, ``cc.PerCol``, ``cc.Scalar``,
``cc.DeviceScalar``.

Use the class itself (``resid: cc.Tile``: dtype bound at compile time, default the GEMM dtype) or an
instance with an explicit dtype (``rstd: cc.PerRow(torch.float32)``).

"Per row" means indexed by the row m of the M x N output (a length-M vector, one value per token);
"per column" is indexed by n (length N). CUTLASS names these the other way round; this API does not.
"""

from __future__ import annotations

from typing import Any

from ..dtypes import DType, as_dtype
from ..ir.nodes import Kind


class OperandSpec:
    kind: Kind = Kind.TILE
    shape_doc: str = ""
    packed: bool = False
    device: bool = False      # a scalar read from a device tensor (cc.DeviceScalar)

    def __init__(self, dtype: Any = None):
        self.dtype: DType | None = None if dtype is None else as_dtype(dtype, what=f"{type(self).__name__} dtype")

    def __repr__(self) -> str:
        return f"cc.{type(self).__name__}({'' if self.dtype is None else self.dtype.torch})"


class Tile(OperandSpec):
    """An M x N tensor, read tile by tile (TMA), e.g. a residual."""
    kind = Kind.TILE
    shape_doc = "(M, N)"


class PairTile(OperandSpec):
    """An M x 2N tensor of interleaved 16-bit pairs (columns 2n, 2n+1 belong to output column n),
    read as one packed 32-bit element per output element, e.g. the saved gate/up pre-activation in
    the SwiGLU backward. Use ``a, b = cc.unpack(x)`` in the program."""
    kind = Kind.TILE
    shape_doc = "(M, 2N)"
    packed = True


class PerRow(OperandSpec):
    """A length-M vector: one value per row (token), broadcast along N, e.g. rstd."""
    kind = Kind.ROW
    shape_doc = "(M,)"


class PerCol(OperandSpec):
    """A length-N vector: one value per column (feature), broadcast along M, e.g. a bias or gamma."""
    kind = Kind.COL
    shape_doc = "(N,)"


class Scalar(OperandSpec):
    """A runtime number (fp32), e.g. a loss scale."""
    kind = Kind.SCALAR
    shape_doc = "a Python number"


class DeviceScalar(OperandSpec):
    """One fp32 number that lives on the GPU: a 0-dim (or one-element) fp32 CUDA tensor, read by the
    kernel itself, so nothing waits for the host (e.g. an FP8 scale computed from an amax history)."""
    kind = Kind.SCALAR
    shape_doc = "a 0-dim fp32 tensor"
    device = True


SPEC_CLASSES: tuple[type[OperandSpec], ...] = (Tile, PairTile, PerRow, PerCol, Scalar, DeviceScalar)


def resolve_spec(annotation: Any) -> OperandSpec | None:
    """The operand spec an annotation stands for, or None when it is not one."""
    if isinstance(annotation, type) and issubclass(annotation, OperandSpec) and annotation is not OperandSpec:
        return annotation()
    if isinstance(annotation, OperandSpec):
        return annotation
    return None
