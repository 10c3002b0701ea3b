"""FP8 quantisation in torch, bit for bit what the kernels' quantising stores compute
(``templates/coda/quant_store.hpp``): the interpreter's semantics of ``cc.quantize`` and the
helpers FP8 recipes use for tensors no epilogue produces (weights, once per optimizer step).

Semantics (fp32 throughout):
- per 1 x block run of each stored row: ``amax`` = max |x| over the run (NaN if any element is NaN);
- ``pow2=True``: the dequantisation scale is ``v = amax / fp8_max`` rounded up to a power of two
  (exactly ``v`` when it already is one; at least 2^-126), and the codes are ``x * (1 / scale)``,
  which is exact; ``pow2=False``: ``scale = amax / fp8_max`` and codes ``x * (fp8_max / amax)``;
- an all-zero run: scale 1, codes 0; a run with inf or NaN: scale NaN, codes NaN;
- the codes round to nearest even, saturated to +-fp8_max (NaN stays NaN), like every FP8 store.
"""

from __future__ import annotations

import torch

from .dtypes import FP8_MAX, DType, as_dtype, round_to

MIN_POW2_SCALE = 2.0 ** -126     # keeps 1 / scale finite


def block_amax(x: torch.Tensor, block: int, rows: int = 1) -> torch.Tensor:
    """(R, C) -> (ceil(R / rows), ceil(C / block)): max |x| over each 1 x block run of a row (each
    rows x block block with ``rows``), NaN-propagating."""
    R, C = x.shape
    nb, rb = -(-C // block), -(-R // rows)
    a = x.float().abs()
    if nb * block != C or rb * rows != R:
        a = torch.nn.functional.pad(a, (0, nb * block - C, 0, rb * rows - R))   # |x| >= 0: zeros never win
    return a.reshape(rb, rows, nb, block).amax(dim=(1, 3))


def scales_from_amax(amax: torch.Tensor, dtype: DType | torch.dtype, pow2: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantisation scale, quantisation multiplier) per run, from its amax (fp32)."""
    amax = amax.float()
    # IEEE divisions of two tensors, as the kernel divides: torch turns a division by (or of) a
    # Python number into a multiplication by its reciprocal, which rounds differently
    fmax = torch.full_like(amax, FP8_MAX[as_dtype(dtype)])
    if pow2:
        v = amax / fmax
        mant, exp = torch.frexp(v)
        s = torch.where(mant == 0.5, v, torch.ldexp(torch.ones_like(v), exp)).clamp_min(MIN_POW2_SCALE)
        inv = 1.0 / s
    else:
        s = amax / fmax
        inv = fmax / amax
    one = torch.ones_like(s)
    nan = torch.full_like(s, float("nan"))
    finite = torch.isfinite(amax)
    zero = amax == 0
    s = torch.where(finite, torch.where(zero, one, s), nan)
    inv = torch.where(finite, torch.where(zero, one, inv), nan)
    return s, inv


def run_major(scale: torch.Tensor) -> torch.Tensor:
    """(rows, runs) scales laid out as the kernels store them: a run-major buffer with the row count
    rounded up to 4 (16-byte aligned runs, the layout blockwise FP8 GEMMs read), returned as the
    (rows, runs) view."""
    rows, runs = scale.shape
    buf = torch.empty(runs, -(-rows // 4) * 4, dtype=torch.float32, device=scale.device)
    view = buf[:, :rows].t()
    view.copy_(scale)
    return view


def quantize_blocks(x: torch.Tensor, dtype: DType | torch.dtype, block: int = 128, pow2: bool = True,
                    round_codes: bool = True, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, C) -> (codes (R, C) in ``dtype``, scales (ceil(R / rows), ceil(C / block)) fp32): 1 x block
    runs (``rows`` x block blocks). ``round_codes=False`` returns the unrounded fp32 ``x * inv``
    instead of the codes."""
    d = as_dtype(dtype)
    R, C = x.shape
    scale, inv = scales_from_amax(block_amax(x, block, rows), d, pow2)
    y = x.float() * inv.repeat_interleave(rows, dim=0)[:R].repeat_interleave(block, dim=1)[:, :C]
    if not round_codes:
        return y, scale
    return round_to(y, d), scale


def quantize_tiles(w: torch.Tensor, dtype: DType | torch.dtype, block: int = 128, pow2: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, C) -> (codes (R, C), scales (ceil(R / block), ceil(C / block))): block x block tiles (the
    layout blockwise FP8 GEMMs read for weights)."""
    d = as_dtype(dtype)
    R, C = w.shape
    rb, cb = -(-R // block), -(-C // block)
    a = torch.nn.functional.pad(w.float().abs(), (0, cb * block - C, 0, rb * block - R))
    amax = a.reshape(rb, block, cb, block).amax(dim=(1, 3))
    scale, inv = scales_from_amax(amax, d, pow2)
    full = inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:R, :C]
    return round_to(w.float() * full, d), scale


def quantize_tensor(x: torch.Tensor, dtype: DType | torch.dtype, scale: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor codes with a given dequantisation scale: ``fp8(x * (1 / scale))``, saturated."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return round_to(x.float() * (1.0 / s), as_dtype(dtype))


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, block: int = 128, rows: int = 1) -> torch.Tensor:
    """Inverse of ``quantize_blocks`` (up to rounding): codes * scale per 1 x block run (per rows x
    block block), fp32."""
    R, C = codes.shape
    return codes.float() * scale.float().repeat_interleave(rows, dim=0)[:R].repeat_interleave(block, dim=1)[:, :C]


__all__ = ["block_amax", "run_major", "scales_from_amax", "quantize_blocks", "quantize_tiles", "quantize_tensor",
           "dequantize_blocks", "MIN_POW2_SCALE"]
