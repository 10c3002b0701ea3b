"""FP8 quantisation and dequantisation in plain torch (CPU or GPU), in the scale layouts the kernels
read (``scales.py``): the reference's dequantisation, and the quantisation tests, benchmarks and
examples feed the kernels with.

``quantize(x, dtype, scaling, operand)`` returns ``(q, scale)`` with ``x ~ q * scale`` for each
block: the scale maps the block's largest magnitude to the dtype's largest finite value, and the
cast saturates (``coda_cutlass.quantization`` does the arithmetic; this module lays the scales out
for the GEMM). ``dequantize(q, scale, scaling, operand)`` is the fp32 ``q * scale`` per block.
"""

from __future__ import annotations

import torch

from ..errors import CallError
from ..quantization import quantize_blocks, quantize_tensor, quantize_tiles, scales_from_amax
from .gemm import BLOCK_K
from .scales import ScaleLayout, new_scales, scale_layouts

def _layout(scaling: str, operand: str) -> ScaleLayout:
    if operand not in ("A", "W"):
        raise ValueError(f"operand must be 'A' or 'W', got {operand!r}")
    a, b = scale_layouts(scaling)
    return a if operand == "A" else b


def _expand(scale: torch.Tensor, layout: ScaleLayout, rows: int, K: int) -> torch.Tensor:
    """The per-element (rows, K) fp32 scale of an operand (for dequantisation)."""
    s = scale.float()
    if layout.kind == "tensor":
        return s.reshape(1, 1)
    if layout.kind == "row":
        return s.reshape(rows, 1)
    return s.repeat_interleave(layout.row_block, dim=0)[:rows].repeat_interleave(BLOCK_K, dim=1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, scaling: str, operand: str) -> torch.Tensor:
    """fp32 ``q * scale`` with the scale of each element's block; ``q`` is (rows, K) (A or W as
    (N, K)), in FP8 or any float dtype (e.g. an fp32 copy of the FP8 values)."""
    layout = _layout(scaling, operand)
    rows, K = q.shape
    return q.float() * _expand(scale.to(q.device), layout, rows, K)


def quantize(x: torch.Tensor, dtype: torch.dtype, scaling: str = "tensor", operand: str = "A", *,
             pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): ``x`` (rows, K) in ``dtype`` (torch.float8_e4m3fn / e5m2) with the scales of
    ``scaling`` for ``operand`` ("A", or "W" for an (N, K) weight), in the kernels' layouts. The
    arithmetic is ``coda_cutlass.quantization``'s (the quantising epilogues' reference): each run's
    scale is amax / fp8_max (``pow2``: rounded up to a power of two), an all-zero run gets scale 1."""
    if x.dim() != 2:
        raise CallError(f"quantize: expected a 2-D (rows, K) tensor, got shape {tuple(x.shape)}")
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise CallError(f"quantize: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    layout = _layout(scaling, operand)
    rows, K = x.shape
    if layout.kind == "tensor":
        amax = x.float().abs().amax().reshape(1, 1)
        scale = scales_from_amax(amax, dtype, pow2)[0].reshape(())
        return quantize_tensor(x, dtype, scale), scale
    if layout.kind == "row":
        q, s = quantize_blocks(x, dtype, block=K, pow2=pow2)
        return q, (s.reshape(rows, 1) if operand == "A" else s.reshape(1, rows))
    _check_k(K)
    if layout.rows_contiguous:
        g = layout.row_block
        q, s = quantize_blocks(x, dtype, block=BLOCK_K, pow2=pow2, rows=g)
        scale = new_scales(rows, K, (g, BLOCK_K), device=x.device, fill=1.0)
        scale.copy_(s)
        return q, scale
    if rows % 128:
        raise CallError(f"quantize: 128 x 128 blocks need rows % 128 == 0, got {rows}")
    q, s = quantize_tiles(x, dtype, block=128, pow2=pow2)
    return q, s.contiguous()


def _check_k(K: int) -> None:
    if K % BLOCK_K:
        raise CallError(f"quantize: block scaling needs K % {BLOCK_K} == 0, got K = {K}")
