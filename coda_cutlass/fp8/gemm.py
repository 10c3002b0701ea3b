"""What an FP8 GEMM's operands are: A's and W's dtypes, how they are scaled, how the mainloop
accumulates. One frozen value (``Fp8Gemm``) that travels from the options through the typed IR's
metadata to lowering, the interpreter and the runtime checks.

Scalings (``SCALINGS``; the scales' exact shapes and memory layouts are in ``scales.py``):

- ``"tensor"``: one fp32 scale per operand (0-dim tensors ``scale_a``, ``scale_b``), read by the
  kernel from device memory and applied in the epilogue before the program: ``acc`` is
  ``(A @ W^T) * scale_a * scale_b``.
- ``"row"``: one fp32 scale per row of A (``scale_a`` (M, 1)) and per row of W (``scale_b``
  (1, N)), as ``torch._scaled_mm``'s row-wise scaling; applied in the epilogue like ``"tensor"``.
- ``"block"``: 1 x 128 blocks along K for A, 128 x 128 blocks for W (DeepSeek-V3's recipe), applied
  by CUTLASS's sm90 blockwise-scaled mainloop to each 128-deep K block's partial product.
- ``"block_1x128"``: 1 x 128 blocks along K for both A and W (both operands quantised like
  activations, e.g. the weight-gradient GEMM), same mainloop.
- ``"block_16x128"``: 1 x 128 blocks for A, 16 x 128 blocks for W (16 rows of W share a scale per
  128-deep K block: a weight-gradient GEMM whose W is a transposed copy quantised with
  ``cc.quantize(..., transpose=True, group=16)``). Per K block a thread then scales its partial
  sums by one product per (row, 16-row group) instead of one per accumulator; coda's overlapped
  consumer loop only (cooperative tiles).

``fast_accum`` (tensor and row scaling only) uses CUTLASS's FP8FastAccum schedules: the wgmma
accumulators are never promoted to a separate fp32 sum, which is faster and less accurate (the
tensor cores' FP8 accumulation keeps fewer mantissa bits than fp32). Without it the mainloop adds
each 128-deep K slice (4 wgmma k-steps) into fp32, as the blockwise mainloop does per block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..dtypes import BF16, FP8_DTYPES, DType, as_dtype
from ..errors import ConfigError

SCALINGS = ("tensor", "row", "block", "block_1x128", "block_16x128")
BLOCK_SCALINGS = ("block", "block_1x128", "block_16x128")
EPILOGUE_SCALINGS = ("tensor", "row")       # applied by a visitor node before the program
BLOCK_K = 128                               # K extent of one scale block (blockwise scalings)
# The dtype of tile inputs and outputs of FP8 kernels unless input_dtypes / output_dtypes say
# otherwise: an FP8 default would quantise every output without a scale.
EPILOGUE_DTYPE = BF16


@dataclass(frozen=True)
class Fp8Gemm:
    """The FP8 operands of a GEMM: ``a`` and ``w`` (e4m3 or e5m2, mixed allowed), ``scaling`` (one
    of ``SCALINGS``) and ``fast_accum``."""
    a: DType
    w: DType
    scaling: str = "tensor"
    fast_accum: bool = False

    def __post_init__(self) -> None:
        for name, d in (("A", self.a), ("W", self.w)):
            if d not in FP8_DTYPES:
                raise ConfigError(f"FP8 GEMM: {name} must be torch.float8_e4m3fn or torch.float8_e5m2, got {d.torch}")
        if self.scaling not in SCALINGS:
            raise ConfigError(f"scaling must be one of {SCALINGS} for FP8 operands, got {self.scaling!r}")
        if not isinstance(self.fast_accum, bool):
            raise ConfigError(f"fast_accum must be True or False, got {self.fast_accum!r}")
        if self.fast_accum and self.blockwise:
            raise ConfigError(f"fast_accum is not available with scaling={self.scaling!r}: the blockwise mainloop "
                              "promotes every 128-deep K block to fp32 itself (CUTLASS has no fast-accumulation "
                              "variant of it); use scaling='tensor' or 'row' for fast accumulation")

    @property
    def blockwise(self) -> bool:
        return self.scaling in BLOCK_SCALINGS

    @property
    def mode(self) -> str:
        """The mainloop kind: "exact" (fp32 promotion), "fast" (fast accumulation) or "block"."""
        return "block" if self.blockwise else ("fast" if self.fast_accum else "exact")

    @property
    def epilogue_scaled(self) -> bool:
        """Whether the scales are applied by a visitor node before the program (else the mainloop)."""
        return self.scaling in EPILOGUE_SCALINGS

    @property
    def w_block(self) -> tuple[int, int] | None:
        """The (N, K) extent of one W scale block (blockwise scalings), else None."""
        return {"block": (128, BLOCK_K), "block_1x128": (1, BLOCK_K), "block_16x128": (16, BLOCK_K)}.get(self.scaling)

    def describe(self) -> str:
        """One line: 'e4m3 x e5m2, tensor scaling, fast accumulation'."""
        accum = ", fast accumulation" if self.fast_accum else ""
        return f"{self.a.name} x {self.w.name}, {self.scaling} scaling{accum}"

    # The typed IR carries this in its metadata (JSON types).
    def to_meta(self) -> dict[str, Any]:
        return {"a": self.a.name, "w": self.w.name, "scaling": self.scaling, "fast_accum": self.fast_accum}

    @classmethod
    def from_meta(cls, meta: dict[str, Any] | None) -> "Fp8Gemm | None":
        if not meta:
            return None
        return cls(as_dtype(meta["a"]), as_dtype(meta["w"]), meta["scaling"], bool(meta["fast_accum"]))


def fp8_dtypes(dtype: Any) -> tuple[DType, DType] | None:
    """(A, W) dtypes when ``dtype`` names FP8 operands (an FP8 dtype, or an (A, W) pair of them), else
    None (a 16-bit GEMM, or a mistake for the 16-bit parser to report)."""
    if isinstance(dtype, (tuple, list)):
        if len(dtype) != 2:
            raise ConfigError(f"dtype: a pair gives (A's dtype, W's dtype) of an FP8 GEMM, got {len(dtype)} items")
        a, w = (as_dtype(d, what=f"dtype of {n}") for d, n in zip(dtype, ("A", "W")))
        if a not in FP8_DTYPES or w not in FP8_DTYPES:
            raise ConfigError(f"dtype: an (A, W) pair is for FP8 operands (torch.float8_e4m3fn / torch.float8_e5m2), "
                              f"got ({a.torch}, {w.torch}); a 16-bit GEMM takes one dtype")
        return a, w
    try:
        d = as_dtype(dtype, what="GEMM operand dtype")
    except ConfigError:
        return None
    return (d, d) if d in FP8_DTYPES else None


def fp8_gemm(dtype: Any, scaling: str | None = None, fast_accum: bool = False) -> Fp8Gemm | None:
    """The FP8 operands that the options ``dtype``, ``scaling`` and ``fast_accum`` ask for, or None for
    a 16-bit GEMM (which takes neither option)."""
    pair = fp8_dtypes(dtype)
    if pair is None:
        if scaling is not None:
            raise ConfigError(f"scaling={scaling!r} is for FP8 operands (dtype=torch.float8_e4m3fn, "
                              "torch.float8_e5m2 or an (A, W) pair of them); 16-bit GEMMs have no scales")
        if fast_accum:
            raise ConfigError("fast_accum=True is for FP8 operands (dtype=torch.float8_e4m3fn, ...); 16-bit "
                              "GEMMs always accumulate in fp32")
        return None
    return Fp8Gemm(pair[0], pair[1], "tensor" if scaling is None else scaling, fast_accum)
