"""Plain epilogues: identity (a bare GEMM through the same pipeline), residual add, row scale."""

import torch

import coda_cutlass as cc


@cc.epilogue
def identity(acc):
    """D = A @ W.T."""
    return acc


@cc.epilogue
def residual_add(acc, resid: cc.Tile):
    """D = A @ W.T + resid: the residual add of the out-proj and down-proj."""
    return acc + resid


@cc.epilogue
def rowscale(acc, r: cc.PerRow(torch.float32)):
    """D = diag(r) (A @ W.T): the deferred RMSNorm scale in the consumer GEMM, with r = rstd (fp32)."""
    return acc * r
