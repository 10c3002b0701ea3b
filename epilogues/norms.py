"""RMSNorm around GEMMs, split as in docs/TRANSFORMER_MATH.md: statistics in the producer GEMM's
epilogue, the row scale in the consumer's, the backward in the norm-backward dX GEMM."""

import torch

import coda_cutlass as cc


@cc.epilogue
def residual_norm_stats(acc, resid: cc.Tile, g: cc.PerCol):
    """Producer of an RMSNorm (out-proj / down-proj): x = acc + resid (the new residual stream, D),
    h = x * g (the next GEMM's A operand) and the per-row sum of x^2 (from the fp32 x)."""
    x = acc + resid
    return {"D": x, "h": x * g, "sumsq": cc.row_sum(x * x)}


@cc.epilogue
def rmsnorm_backward(acc, x: cc.Tile, r: cc.PerRow(torch.float32), c: cc.PerRow(torch.float32), g: cc.PerCol):
    """Norm-backward dX GEMM (acc = delta = dz W): x_hat = x * r;
    dres += (delta * g - x_hat * c) * r  (accumulated into the residual gradient),
    y = x_hat * g (recomputed, for dW), dgamma = sum over rows of delta * x_hat.
    c = (1/d) * sum_n z*dz per row, from the consumer's backward."""
    xhat = x * r
    return {"dres": cc.accumulate((acc * g - xhat * c) * r), "y": xhat * g, "dgamma": cc.col_sum(acc * xhat)}


def rstd_from_sumsq(sumsq: torch.Tensor, d: int, eps: float = 1e-6) -> torch.Tensor:
    """Finish RMSNorm statistics: r = rsqrt(sumsq / d + eps), fp32, one value per row."""
    return torch.rsqrt(sumsq.float() / d + eps)


@cc.epilogue
def qk_norm_stats(acc, r: cc.PerRow(torch.float32), head_dim: int = 128):
    """QKV GEMM that also returns per-head sums of squares of z = r * acc (QK-norm statistics):
    shape (M, N / head_dim)."""
    z = acc * r
    return {"D": z, "head_sumsq": cc.segment_sum(z * z, int(head_dim))}
