"""coda-cutlass: fused GEMM + epilogue kernels for Hopper, compiled from small Python programs.

    import torch, coda_cutlass as cc

    @cc.epilogue
    def residual_norm_stats(acc, resid: cc.Tile, g: cc.PerCol):
        x = acc + resid
        return {"D": x, "h": x * g, "sumsq": cc.row_sum(x * x)}

    k = cc.compile_epilogue(residual_norm_stats, dtype=torch.bfloat16)
    out = k(A, W, resid=R, g=gamma)          # dict of outputs
"""

__version__ = "0.1.0"

from .config import KernelConfig
from .errors import (ArgumentError, BuildError, CallError, CodaError, ConfigError, DeviceError, EpilogueError,
                     ToolchainError)
from .frontend.operands import DeviceScalar, PairTile, PerCol, PerRow, Scalar, Tile
from .frontend.primitives import (abs, accumulate, amax, cast, col_index, col_max, col_min, col_sum, cos, exp,
                                  gather, gelu, half_width, interleave, log, maximum, minimum, pack,
                                  pair_map, pairs, pow, quantize, reciprocal, relu, rotate_pairs, row_index,
                                  row_logsumexp,
                                  row_max, row_min, row_sum, rsqrt, segment_sum, sigmoid, silu, sin,
                                  sqrt, square, tanh, total_max, total_min, total_sum, unpack,
                                  where)
from .frontend.trace import EpilogueProgram, epilogue
from .api import compile_epilogue, compile_many, emit, reference
from .maps import compile_map, emit_map, map_reference

__all__ = [
    "__version__", "epilogue", "EpilogueProgram", "compile_epilogue", "compile_many", "emit", "reference",
    "compile_map", "emit_map", "map_reference",
    "Tile", "PairTile", "PerRow", "PerCol", "Scalar", "DeviceScalar", "KernelConfig",
    "abs", "accumulate", "amax", "cast", "col_index", "col_max", "col_min", "col_sum", "cos", "exp", "gather",
    "gelu", "half_width", "interleave", "log", "maximum", "minimum", "pack", "pair_map", "pairs", "pow", "quantize",
    "reciprocal", "relu", "rotate_pairs", "row_index", "row_logsumexp", "row_max", "row_min", "row_sum", "rsqrt",
    "segment_sum", "sigmoid", "silu", "sin", "sqrt", "square", "tanh", "total_max", "total_min", "total_sum",
    "unpack", "where",
    "CodaError", "EpilogueError", "ConfigError", "CallError", "BuildError", "ToolchainError", "DeviceError",
    "ArgumentError",
]
