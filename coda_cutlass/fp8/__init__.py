"""FP8 GEMM operands: A and W in float8 (e4m3 / e5m2), fp32 accumulation, the scales as call
arguments ``scale_a=`` / ``scale_b=``.

    k = cc.compile_epilogue(program, dtype=torch.float8_e4m3fn)                  # per-tensor scales
    k = cc.compile_epilogue(program, dtype=torch.float8_e4m3fn, scaling="block")  # 1x128 A, 128x128 W
    out = k(A8, W8, scale_a=sa, scale_b=sb, **operands)      # acc in the program is the scaled product

``gemm.py`` says what the operands are (``Fp8Gemm``, the scalings), ``scales.py`` the exact shapes
and memory layouts of the scales (and ``new_scales``, which allocates them), ``quantize.py``
torch quantisation and dequantisation in those layouts.
"""

from .gemm import BLOCK_K, SCALINGS, Fp8Gemm
from .quantize import dequantize, quantize
from .scales import SCALE_NAMES, ScaleLayout, block_scale_shape, new_scales, scale_layouts

__all__ = ["BLOCK_K", "SCALINGS", "SCALE_NAMES", "Fp8Gemm", "ScaleLayout", "block_scale_shape", "dequantize",
           "new_scales", "quantize", "scale_layouts"]
