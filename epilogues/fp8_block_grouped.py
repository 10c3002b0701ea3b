"""The epilogue programs of the ``"blockwise_g16"`` FP8 recipe (coda_cutlass.nn.fp8): the blockwise
block's programs (fp8_block.py) with one change: the transposed copies of activations (h^T, y^T,
o^T: the weight-gradient GEMMs' W operand) share one scale per 16 neighbouring columns and 128
tokens (``cc.quantize(..., transpose=True, group=16)``), the 16 x 128 W scales a
``scaling="block_16x128"`` GEMM reads. Gradients keep their 128 x 1 runs (fp8_block.py's
``quantize_rows_t``). Why: a weight-gradient GEMM with 1 x 128 scales on both operands runs ~1.5x
the per-tensor GEMM; with 16-row W blocks a thread scales its partial sums by a few products per
K block instead of one per accumulator (docs/FP8.md).
"""

import torch

import coda_cutlass as cc

from .fp8_block import both_copies, norm_stats_outputs, residual_norm_outputs, swiglu_outputs

F32 = torch.float32
GROUP = 16


@cc.epilogue
def norm_stats_fp8_g16(acc, g: cc.PerCol):
    """norm_stats_fp8 (map kernel after the embedding) with h^T in 16 x 128 blocks."""
    return norm_stats_outputs(acc, g, GROUP)


@cc.epilogue
def quantize_rows_t_g16(acc):
    """quantize_rows_t for an activation no GEMM epilogue quantised (the attention output, a block's
    incoming h): 1 x 128 runs and the transposed copy in 16 x 128 blocks."""
    return both_copies(acc, GROUP)


@cc.epilogue
def residual_norm_stats_fp8_g16(acc, resid: cc.Tile, g: cc.PerCol):
    """residual_norm_stats_fp8 (out-proj, down-proj) with h^T in 16 x 128 blocks."""
    return residual_norm_outputs(acc, resid, g, GROUP)


@cc.epilogue
def swiglu_fp8_g16(acc, r: cc.PerRow(F32)):
    """swiglu_fp8 (gate/up) with y^T in 16 x 128 blocks (16 SwiGLU outputs: 32 tile columns)."""
    return swiglu_outputs(acc, r, GROUP)
