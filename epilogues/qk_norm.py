"""Per-head RMSNorm of q and k before RoPE (Qwen 3's q_norm / k_norm), as epilogue programs.

A per-head statistic cannot be used inside the epilogue that computes it (no reduction result is
read back in the same program), so the forward is the QKV GEMM writing z = r * acc and the
per-head sums of z^2 (``qk_norm_stats``, one ``cc.segment_sum``), then one map kernel per q and k
over z viewed as (tokens * heads, head_dim) rows: y = R(theta) (z * s * g) with s = rsqrt(mean z^2 +
eps) per (token, head) (``qk_norm_rope``). The backward is two map kernels over the same rows
(``qk_norm_rope_backward``: dn = R(-theta) dy and the per-row c = dn . g . x_hat; then
``qk_norm_backward``: dz' = r * s (g dn - x_hat c / head_dim) and the per-row z . dz the attention
norm's backward needs). When the tile-local reduction primitive lands, the statistics and the
normalisation can move into the QKV epilogue itself.
"""

import torch

import coda_cutlass as cc

F32 = torch.float32


@cc.epilogue
def qk_norm_rope(acc, s: cc.PerRow(F32), g: cc.PerCol, pos: cc.PerRow(F32), freq: cc.PerCol(F32)):
    """Map kernel over one head per row (acc = z of q or k): the normed, weighted, rotated head."""
    return {"y": cc.rotate_pairs(acc * s * g, pos * freq)}


@cc.epilogue
def qk_norm_rope_backward(acc, z: cc.Tile, s: cc.PerRow(F32), g: cc.PerCol, pos: cc.PerRow(F32),
                          freq: cc.PerCol(F32)):
    """Map kernel over the attention gradient of one rotated head per row (acc): dn = R(-theta) dy
    (the gradient of the normed head n = x_hat * g) and the per-row partials of dn . g . x_hat."""
    dn = cc.rotate_pairs(acc, -(pos * freq))
    return {"dn": dn, "c": cc.row_sum(dn * g * (z * s))}


@cc.epilogue
def qk_norm_backward(acc, z: cc.Tile, s: cc.PerRow(F32), c: cc.PerRow(F32), g: cc.PerCol, r: cc.PerRow(F32)):
    """Map kernel over dn of one head per row (acc): dz = s (g dn - x_hat c), c the row mean of
    dn . g . x_hat; writes dz' = r * dz (the QKV dX GEMM's operand) and the per-row partials of z . dz."""
    dz = (acc * g - (z * s) * c) * s
    return {"dz": dz * r, "zdz": cc.row_sum(z * dz)}
