"""Plain epilogues: identity (a bare GEMM through the same pipeline), residual add, row scale, and a
scale by a device scalar."""

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


@cc.epilogue
def scale_by(acc, s: cc.DeviceScalar):
    """D = acc * s, the product in fp32 with s as given (fp32, read on the device), rounded once to the
    output dtype. As a map kernel, in place (out = X): the fused LM head's gradients scaled by dloss
    in one pass (torch's ``g.mul_(dloss)`` would round dloss to g's dtype first)."""
    return acc * s
