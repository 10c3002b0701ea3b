"""Sandwich norms (Gemma 2 / 3): an RMSNorm on a projection's output before the residual add,
x1 = x + norm_post(o) with norm_post(o) = o * s * g_post, s = rsqrt(mean o^2 + eps) per row.

s is a row statistic of the GEMM's own output, which its epilogue cannot use (no reduction result is
read back in the same program), so the projection's epilogue writes o and the per-row partials of
o^2 (``out_sumsq``), and one map kernel adds the normed o to the stream and computes the next
norm's h and statistics (``post_norm_residual``; ``post_norm_residual_last`` without a next norm).
The backward (the gradient of o from the stream's, dx1) is two map kernels: the per-row c of the
norm (``post_norm_c``), then do = s (g dx1 - o_hat c) (``post_norm_backward``).
"""

import torch

import coda_cutlass as cc

F32 = torch.float32


@cc.epilogue
def out_sumsq(acc):
    """A projection whose output is normed next: o (D) and the per-row partials of o^2."""
    return {"D": acc, "sumsq": cc.row_sum(acc * acc)}


@cc.epilogue
def post_norm_residual(acc, resid: cc.Tile, s: cc.PerRow(F32), g: cc.PerCol, g_next: cc.PerCol):
    """Map kernel over o: x1 = resid + o * s * g; h = x1 * g_next (the next GEMM's operand) and the
    per-row partials of x1^2 (from the fp32 x1)."""
    x = resid + acc * s * g
    return {"x": x, "h": x * g_next, "sumsq": cc.row_sum(x * x)}


@cc.epilogue
def post_norm_residual_last(acc, resid: cc.Tile, s: cc.PerRow(F32), g: cc.PerCol):
    """As post_norm_residual where no norm follows inside the block stack's step."""
    return {"x": resid + acc * s * g}


@cc.epilogue
def post_norm_c(acc, o: cc.Tile, s: cc.PerRow(F32), g: cc.PerCol):
    """Map kernel over dx1 (acc): the per-row partials of dx1 . g . o_hat (o_hat = o * s)."""
    return {"c": cc.row_sum(acc * g * (o * s))}


@cc.epilogue
def post_norm_backward(acc, o: cc.Tile, s: cc.PerRow(F32), c: cc.PerRow(F32), g: cc.PerCol):
    """Map kernel over dx1 (acc): do = s (g dx1 - o_hat c), c the row mean of dx1 . g . o_hat."""
    return {"do": (acc * g - (o * s) * c) * s}
