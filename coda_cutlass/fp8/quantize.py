"""FP8 quantisation and dequantisation in plain torch (CPU or GPU), in the scale layouts the kernels
read (``scales.py``): the reference's dequantisation, and the quantisation tests, benchmarks and
examples feed the kernels with.

``quantize(x, dtype, scaling, operand)`` returns ``(q, scale)`` with ``x ~ q * scale`` for each
block: the scale maps the block's largest magnitude to the dtype's largest finite value, and the
cast saturates. ``dequantize(q, scale, scaling, operand)`` is the fp32 ``q * scale`` per block.
"""

from __future__ import annotations

import torch

from ..errors import CallError
from .gemm import BLOCK_K
from .scales import ScaleLayout, new_scales, scale_layouts

# Block scales never go below this (an all-zero block would otherwise get scale 0 and 0/0 values).
MIN_AMAX = 1e-12


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
    if layout.kind == "block_1x128":
        return s.repeat_interleave(BLOCK_K, dim=1)
    return s.repeat_interleave(128, dim=0)[:rows].repeat_interleave(BLOCK_K, dim=1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, scaling: str, operand: str) -> torch.Tensor:
    """fp32 ``q * scale`` with the scale of each element's block; ``q`` is (rows, K) (A or W as
    (N, K)), in FP8 or any float dtype (e.g. an fp32 copy of the FP8 values)."""
    layout = _layout(scaling, operand)
    rows, K = q.shape
    return q.float() * _expand(scale.to(q.device), layout, rows, K)


def quantize(x: torch.Tensor, dtype: torch.dtype, scaling: str = "tensor", operand: str = "A"
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): ``x`` (rows, K) in ``dtype`` (torch.float8_e4m3fn / e5m2) with the scales of
    ``scaling`` for ``operand`` ("A", or "W" for an (N, K) weight), in the kernels' layouts."""
    if x.dim() != 2:
        raise CallError(f"quantize: expected a 2-D (rows, K) tensor, got shape {tuple(x.shape)}")
    layout = _layout(scaling, operand)
    rows, K = x.shape
    fmax = torch.finfo(dtype).max
    xf = x.float()
    if layout.kind == "tensor":
        scale = (xf.abs().amax().clamp(min=MIN_AMAX) / fmax).reshape(())
    elif layout.kind == "row":
        amax = xf.abs().amax(dim=1).clamp(min=MIN_AMAX) / fmax
        scale = amax.reshape(rows, 1) if operand == "A" else amax.reshape(1, rows)
    elif layout.kind == "block_1x128":
        _check_k(K)
        amax = xf.reshape(rows, K // BLOCK_K, BLOCK_K).abs().amax(dim=2).clamp(min=MIN_AMAX) / fmax
        scale = new_scales(rows, K, (1, BLOCK_K), device=x.device, fill=1.0)
        scale.copy_(amax)
    else:
        _check_k(K)
        if rows % 128:
            raise CallError(f"quantize: 128 x 128 blocks need rows % 128 == 0, got {rows}")
        amax = xf.reshape(rows // 128, 128, K // BLOCK_K, BLOCK_K).abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / fmax
        scale = amax.contiguous()
    q = (xf / _expand(scale, layout, rows, K)).clamp(-fmax, fmax).to(dtype)
    return q, scale


def _check_k(K: int) -> None:
    if K % BLOCK_K:
        raise CallError(f"quantize: block scaling needs K % {BLOCK_K} == 0, got K = {K}")
