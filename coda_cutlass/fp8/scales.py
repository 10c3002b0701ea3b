"""The scale tensors FP8 kernels read (``scale_a`` for A, ``scale_b`` for W): shapes, memory layouts,
allocation, and the checks a call runs on them.

A scale is what the FP8 value is multiplied by to give the real value (``x ~ q * s``; torch's
``_scaled_mm`` calls the same numbers inverse scales). All scales are fp32.

| scaling | scale_a (A is M x K) | scale_b (W is N x K) |
|---|---|---|
| tensor | 0-dim (or one element) | 0-dim (or one element) |
| row | (M, 1) or (M,), contiguous | (1, N) or (N,), contiguous |
| block | (M, K/128): 1 x 128 blocks, M-major | (N/128, K/128): 128 x 128 blocks, K-major |
| block_1x128 | (M, K/128): 1 x 128 blocks, M-major | (N, K/128): 1 x 128 blocks, N-major |
| block_16x128 | (M, K/128): 1 x 128 blocks, M-major | (N/16, K/128): 16 x 128 blocks, N-major |

1 x 128 scales (``scale_a`` of both block scalings, ``scale_b`` of ``block_1x128``), for an operand
X with R rows: element (r, j) scales X[r, 128 j : 128 j + 128]. Memory: rows contiguous, strides
(1, ld) with ld >= R and ld % 4 == 0 (16 bytes: the kernel loads these columns with TMA), the base
16-byte aligned, and the storage must hold ld * (K/128) elements (whole ld-long columns are read;
the padding rows' values are never used). ``new_scales`` allocates exactly this with
ld = round_up(R, 4); with R % 4 == 0 the layout is torch's 1x128 ``_scaled_mm`` layout
(``torch.empty(K // 128, M).t()``).

16 x 128 scales (``scale_b`` of ``block_16x128``): element (i, j) scales W[16 i : 16 i + 16,
128 j : 128 j + 128]; memory as 1 x 128 scales with R = ceil(N / 16) rows (``new_scales(N, K,
(16, 128))``; what ``cc.quantize(..., transpose=True, group=16)`` writes).

128 x 128 scales (``scale_b`` of ``block``): element (i, j) scales W[128 i : 128 i + 128,
128 j : 128 j + 128]. Memory: K-blocks contiguous, strides (ld, 1) with ld >= K/128 (a row-major
(N/128, K/128) tensor, or a view with padded rows, as torch's 128x128 layout is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CallError
from .gemm import BLOCK_K, SCALINGS, Fp8Gemm

SCALE_NAMES = ("scale_a", "scale_b")
TMA_ALIGN = 4      # fp32 elements in 16 bytes


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class ScaleLayout:
    """The scale tensor of one operand under one scaling."""
    name: str                 # "scale_a" or "scale_b"
    operand: str              # "A" or "W"
    kind: str                 # "tensor", "row", "block_1x128", "block_16x128" or "block_128x128"

    def shape(self, rows: int, K: int) -> tuple[int, ...]:
        """The logical shape for an operand of ``rows`` rows (M for A, N for W) and depth K."""
        if self.kind == "tensor":
            return ()
        if self.kind == "row":
            return (rows, 1) if self.operand == "A" else (1, rows)
        return (-(-rows // self.row_block), K // BLOCK_K)

    @property
    def row_block(self) -> int:
        """Rows of the operand one block scale covers (block kinds)."""
        return {"block_1x128": 1, "block_16x128": 16, "block_128x128": 128}[self.kind]

    @property
    def rows_contiguous(self) -> bool:
        """1 x 128 and 16 x 128 scales keep each K block's scales of all row blocks together (M- / N-major)."""
        return self.kind in ("block_1x128", "block_16x128")

    def describe(self) -> str:
        return {
            "tensor": f"{self.name}: 0-dim fp32, one scale for {self.operand}",
            "row": f"{self.name}: fp32 {'(M, 1)' if self.operand == 'A' else '(1, N)'}, one scale per row of "
                   f"{self.operand}, contiguous",
            "block_1x128": f"{self.name}: fp32 ({'M' if self.operand == 'A' else 'N'}, K/128), one scale per row and "
                           "128-deep K block; rows contiguous: strides (1, ld), ld >= rows, ld % 4 == 0",
            "block_16x128": f"{self.name}: fp32 (N/16, K/128), one scale per 16 rows of W and 128-deep K block; "
                            "rows contiguous: strides (1, ld), ld >= N/16, ld % 4 == 0",
            "block_128x128": f"{self.name}: fp32 (N/128, K/128), one scale per 128 x 128 block of W; K blocks "
                             "contiguous: strides (ld, 1), ld >= K/128",
        }[self.kind]


def scale_layouts(scaling: str) -> tuple[ScaleLayout, ScaleLayout]:
    """(scale_a's layout, scale_b's layout) under a scaling (gemm.SCALINGS)."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    a_kind = {"tensor": "tensor", "row": "row"}.get(scaling, "block_1x128")
    b_kind = {"tensor": "tensor", "row": "row", "block": "block_128x128"}.get(scaling, scaling)
    return ScaleLayout("scale_a", "A", a_kind), ScaleLayout("scale_b", "W", b_kind)


SCALE_BLOCKS = ((1, BLOCK_K), (16, BLOCK_K), (128, BLOCK_K))


def block_scale_shape(rows: int, K: int, block: tuple[int, int] = (1, BLOCK_K)) -> tuple[int, int]:
    """The shape of the scales of an operand with ``rows`` rows and depth ``K`` quantised in
    ``block`` = (rows, K) blocks: (g, 128) -> (ceil(rows/g), K/128)."""
    if block not in SCALE_BLOCKS:
        raise ValueError(f"block must be one of {SCALE_BLOCKS}, got {block!r}")
    if K % BLOCK_K:
        raise ValueError(f"K = {K} is not a multiple of {BLOCK_K}")
    return (-(-rows // block[0]), K // BLOCK_K)


def new_scales(rows: int, K: int, block: tuple[int, int] = (1, BLOCK_K), *, device: Any = None,
               fill: float = 0.0) -> torch.Tensor:
    """An fp32 scale tensor in exactly the layout FP8 kernels read (module docstring): 1 x 128 and
    16 x 128 blocks as an (R, K/128) view with strides (1, round_up(R, 4)), R = ceil(rows / 16) for
    16 x 128; 128 x 128 blocks as a contiguous (ceil(rows/128), K/128) tensor. Padding is filled
    with ``fill`` too."""
    r, kb = block_scale_shape(rows, K, block)
    if block[0] < 128:
        ld = max(round_up(r, TMA_ALIGN), TMA_ALIGN)
        return torch.full((kb, ld), fill, dtype=torch.float32, device=device)[:, :r].t()
    return torch.full((r, kb), fill, dtype=torch.float32, device=device)


def _tensor(name: str, t: Any, device: torch.device | None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise CallError(f"{name}: expected an fp32 torch.Tensor of scales, got {type(t).__name__}")
    if t.dtype != torch.float32:
        raise CallError(f"{name}: dtype is {t.dtype}; FP8 scales are torch.float32")
    if device is not None and t.device != device:
        raise CallError(f"{name}: is on {t.device}, but A is on {device}; the kernel reads the scales from the "
                        "GPU's memory (no host sync): put them on A's device")
    return t


def check_scale(layout: ScaleLayout, t: Any, rows: int, K: int, device: torch.device | None, *,
                tma: bool = True) -> int:
    """Checks one scale tensor; returns the stride the kernel gets (the ld of block layouts, else 0).
    ``tma=False`` (the reference) skips what only concerns memory layout."""
    name = layout.name
    t = _tensor(name, t, device)
    if layout.kind == "tensor":
        if t.numel() != 1 or t.dim() > 1:
            raise CallError(f"{name}: shape is {tuple(t.shape)}; tensor scaling takes one fp32 scale per operand "
                            "(a 0-dim tensor)")
        return 0
    if layout.kind == "row":
        expect = layout.shape(rows, K)
        if tuple(t.shape) not in (expect, (rows,)):
            raise CallError(f"{name}: shape is {tuple(t.shape)}, expected {expect} (or ({rows},)): one scale per row "
                            f"of {layout.operand}")
        if tma and not t.is_contiguous():
            raise CallError(f"{name}: must be contiguous, got strides {t.stride()}; call .contiguous()")
        return 0
    expect = layout.shape(rows, K)
    if t.dim() != 2 or tuple(t.shape) != expect:
        raise CallError(f"{name}: shape is {tuple(t.shape)}, expected {expect} ({layout.describe()})")
    if not tma:
        return 0
    if layout.rows_contiguous:
        return _check_rows_contiguous(name, t, expect[0], expect[1], f"{layout.row_block} x {BLOCK_K}")
    ld = t.stride(0) if expect[0] > 1 else max(expect[1], t.stride(0))
    if expect[1] > 1 and t.stride(1) != 1:
        raise CallError(f"{name}: 128 x 128 scales must have contiguous K blocks (strides (ld, 1)), got strides "
                        f"{t.stride()}; call .contiguous()")
    if ld < expect[1]:
        raise CallError(f"{name}: row stride {ld} is smaller than K/128 = {expect[1]}")
    return ld


def _check_rows_contiguous(name: str, t: torch.Tensor, rows: int, kb: int, what: str = "1 x 128") -> int:
    ld = t.stride(1) if kb > 1 else round_up(rows, TMA_ALIGN)
    if rows > 1 and t.stride(0) != 1:
        raise CallError(f"{name}: {what} scales must have contiguous rows (strides (1, ld), i.e. the transpose of "
                        f"a (K/128, ld) tensor), got strides {t.stride()}; allocate with "
                        "coda_cutlass.fp8.new_scales or pass s.t().contiguous().t()")
    if ld < rows or ld % TMA_ALIGN:
        raise CallError(f"{name}: the stride between K blocks is {ld}; it must be >= {rows} (the rows) and a "
                        f"multiple of {TMA_ALIGN} (16 bytes, TMA): pad it to {max(round_up(rows, TMA_ALIGN), 4)} "
                        "(coda_cutlass.fp8.new_scales does)")
    if t.data_ptr() % 16:
        raise CallError(f"{name}: data pointer is not 16-byte aligned (TMA reads these scales); call .clone() in "
                        "the layout of coda_cutlass.fp8.new_scales")
    needed = (t.storage_offset() + ld * kb) * 4
    if t.untyped_storage().nbytes() < needed:
        raise CallError(f"{name}: its storage holds {t.untyped_storage().nbytes() // 4} floats from the start, but "
                        f"the kernel reads whole K-block columns of {ld} rows ({needed // 4} floats); allocate with "
                        "coda_cutlass.fp8.new_scales")
    return ld


def split_scales(operands: dict[str, Any], fp8: Fp8Gemm | None, program: str) -> dict[str, Any]:
    """Take scale_a / scale_b out of a call's keyword arguments (in place); an FP8 kernel needs both,
    a 16-bit one takes neither."""
    given = {n: operands.pop(n) for n in SCALE_NAMES if n in operands}
    if fp8 is None:
        if given:
            raise CallError(f"{program}: {', '.join(given)} given, but the kernel has 16-bit operands; scales are "
                            "for FP8 kernels (compile with dtype=torch.float8_e4m3fn, ...)")
        return given
    missing = [n for n in SCALE_NAMES if n not in given]
    if missing:
        a, b = scale_layouts(fp8.scaling)
        raise CallError(f"{program}: missing {' and '.join(missing)}: an FP8 kernel ({fp8.describe()}) takes "
                        f"scale_a= and scale_b= ({a.describe()}; {b.describe()})")
    return given


def check_scales(fp8: Fp8Gemm, scales: dict[str, Any], M: int, N: int, K: int, device: torch.device | None, *,
                 tma: bool = True) -> tuple[int, int]:
    """Checks scale_a and scale_b of a call; returns the strides the kernel gets."""
    a, b = scale_layouts(fp8.scaling)
    return (check_scale(a, scales["scale_a"], M, K, device, tma=tma),
            check_scale(b, scales["scale_b"], N, K, device, tma=tma))


def check_fp8_shapes(fp8: Fp8Gemm, M: int, N: int, K: int, program: str) -> None:
    """What block scaling needs of the GEMM's shape: whole 128-deep K blocks, and whole 128-row W
    blocks for 128 x 128 scales."""
    if not fp8.blockwise:
        return
    if K % BLOCK_K:
        raise CallError(f"{program}: K = {K} is not a multiple of {BLOCK_K}: scaling={fp8.scaling!r} scales A and W "
                        f"in {BLOCK_K}-deep K blocks (pad K, or use scaling='tensor' / 'row')")
    gn = fp8.w_block[0]  # type: ignore[index]
    if N % gn:
        raise CallError(f"{program}: N = {N} is not a multiple of {gn}: scaling={fp8.scaling!r} scales W in "
                        f"{gn} x {BLOCK_K} blocks (pad N, or use scaling='block_1x128')")
