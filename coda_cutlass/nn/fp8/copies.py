"""FP8 copies of the weights made in torch, bit for bit the kernels' power-of-two quantisation, once
per optimizer step:

- ``weight_tiles``: a weight's 128 x 128 tiles in both layouts (once per optimizer step).
- ``tensor_copies``: a weight's per-tensor codes in both layouts ("tensorwise").

Bit for bit ``quantize_tiles`` with ``pow2=True`` (coda_cutlass/quantization.py,
the kernels' semantics), computed without a division: for amax = m * 2^e (1 <= m < 2) and an FP8
format whose largest value is 1.75 * 2^E, the smallest power of two s with s * fp8_max >= amax is
2^(e - E) when m <= 1.75 and 2^(e - E + 1) otherwise; s is at least 2^-126. That is exactly what
the kernels' IEEE division and rounding up give, and it leaves nothing for a compiler to reorder.
On a GPU both run compiled by torch.compile (shapes dynamic: one graph serves every operand);
elsewhere eagerly. Per-tensor copies without power-of-two scales (``pow2=False``) run eagerly on a
GPU too, as the delayed scales' fold does: their scale is a division and their codes a reciprocal,
which a compiled graph rounds differently (Triton divides fp32 with ``div.full.f32``, not IEEE
division), so the GPU's copies would not be the CPU's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...dtypes import FP8_MAX, as_dtype, round_to
from .compiled import on_device
from .delayed import tensor_scales

BLOCK = 128
_EXP = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}     # fp8_max = 1.75 * 2^E
_MIN_EXP = -126


def _pow2_scales(amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1 / scale) per run from its fp32 amax: powers of two (NaN for inf / NaN, 1 for 0)."""
    bits = amax.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 127                       # amax's exponent (subnormals: -127)
    up = (bits & 0x7FFFFF) > 0x600000                     # mantissa above 1.75
    se = (e - _EXP[dtype] + up.to(torch.int32)).clamp(min=_MIN_EXP)
    s = ((se + 127) << 23).view(torch.float32)
    inv = ((127 - se) << 23).view(torch.float32)          # 2^-se: se >= -126 keeps it finite
    one, nan = torch.ones_like(s), torch.full_like(s, float("nan"))
    finite, zero = torch.isfinite(amax), amax == 0
    return (torch.where(finite, torch.where(zero, one, s), nan),
            torch.where(finite, torch.where(zero, one, inv), nan))


def _on_device(fn: Callable[..., Any], t: torch.Tensor, dtype: torch.dtype, pow2: bool = True) -> Callable[..., Any]:
    """``fn`` compiled once per function and FP8 format on a GPU (compiled.py); ``fn`` elsewhere, and
    without ``pow2`` everywhere (a division: the module docstring)."""
    if not pow2:
        return fn
    return on_device(fn, t, dtype, f"FP8 copies: {fn.__name__.lstrip('_')} ({dtype})")


def _tensor_scale(w: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    return tensor_scales(w.abs().amax().float(), float(FP8_MAX[as_dtype(dtype)]), 0, pow2)


def _tensor_copies(w: torch.Tensor, dtype: torch.dtype, halves: bool, pow2: bool) -> tuple[torch.Tensor, ...]:
    scale = _tensor_scale(w, dtype, pow2)
    q = round_to(w.float() * (1.0 / scale), as_dtype(dtype))
    src = torch.cat([q[0::2], q[1::2]]) if halves else q
    return q, scale, src.t().contiguous()


def tensor_copies(w: torch.Tensor, dtype: torch.dtype, halves: bool, pow2: bool) -> tuple[torch.Tensor, ...]:
    """A weight W (R, C) with one scale: (codes, the 0-dim scale, W^T's codes); ``halves``: W^T's
    columns are W's even rows, then its odd rows (nn/fp8/weights.py). Compiled on a GPU."""
    return _on_device(_tensor_copies, w, dtype, pow2)(w.contiguous(), dtype, halves, pow2)


def tensor_scale(w: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """W's one scale (0-dim fp32), as ``tensor_copies`` makes it: one compiled call on a GPU (the eager
    amax and scale arithmetic were a dozen launches a weight, which made the map kernel's copies
    host-bound)."""
    return _on_device(_tensor_scale, w, dtype, pow2)(w, dtype, pow2)


def _tensor_scales_all(ws: list[torch.Tensor], dtype: torch.dtype, pow2: bool) -> list[torch.Tensor]:
    return [_tensor_scale(w, dtype, pow2) for w in ws]


def tensor_scales_all(ws: list[torch.Tensor], dtype: torch.dtype, pow2: bool) -> list[torch.Tensor]:
    """``tensor_scale`` of several weights in one compiled call on a GPU (the map kernel's copies of a
    block's four weights: one host call for their scales instead of four); the same scales."""
    return _on_device(_tensor_scales_all, ws[0], dtype, pow2)(ws, dtype, pow2)


def _tiles(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    R, C = w.shape
    wb = w.view(R // BLOCK, BLOCK, C // BLOCK, BLOCK).float()
    s, inv = _pow2_scales(wb.abs().amax(dim=(1, 3)), dtype)     # (R / 128, C / 128)
    q = round_to(wb * inv[:, None, :, None], as_dtype(dtype)).view(R, C)
    return q, s, q.t().contiguous(), s.t().contiguous()


def weight_tiles(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """W (R, C), both multiples of 128 -> (codes, scales (R/128, C/128), W^T's codes, W^T's scales):
    ``quantize_tiles(w, dtype, 128, pow2=True)`` bit for bit, and its transpose (compiled on a GPU)."""
    return _on_device(_tiles, w, dtype)(w.contiguous(), dtype)


def _tensor_copies_all(ws: list[torch.Tensor], dtype: torch.dtype, halves: tuple[bool, ...],
                       pow2: bool) -> list[tuple[torch.Tensor, ...]]:
    return [_tensor_copies(w, dtype, h, pow2) for w, h in zip(ws, halves)]


def _tiles_all(ws: list[torch.Tensor], dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    return [_tiles(w, dtype) for w in ws]


def tensor_copies_all(ws: list[torch.Tensor], dtype: torch.dtype, halves: tuple[bool, ...],
                      pow2: bool) -> list[tuple[torch.Tensor, ...]]:
    """``tensor_copies`` of several weights (a block's, after an optimizer step) in one compiled call
    on a GPU: one host call and one graph's launches instead of a call per weight; the same codes."""
    return _on_device(_tensor_copies_all, ws[0], dtype, pow2)([w.contiguous() for w in ws], dtype, halves, pow2)


def _blocks_tensor_copies(ws: list[torch.Tensor], dtype: torch.dtype, halves: tuple[bool, ...],
                          pow2: bool) -> list[tuple[torch.Tensor, ...]]:
    return _tensor_copies_all(ws, dtype, halves, pow2)


def blocks_tensor_copies(ws: list[torch.Tensor], dtype: torch.dtype, halves: tuple[bool, ...],
                         pow2: bool) -> list[tuple[torch.Tensor, ...]]:
    """``tensor_copies_all`` of several blocks' weights at once (a model's, before its first block),
    a graph of its own: its lists are longer than a block's, and Dynamo recompiles per list length
    against a limit per function."""
    return _on_device(_blocks_tensor_copies, ws[0], dtype, pow2)([w.contiguous() for w in ws], dtype, halves, pow2)


def weight_tiles_all(ws: list[torch.Tensor], dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """``weight_tiles`` of several weights in one compiled call on a GPU (as ``tensor_copies_all``)."""
    return _on_device(_tiles_all, ws[0], dtype)([w.contiguous() for w in ws], dtype)
