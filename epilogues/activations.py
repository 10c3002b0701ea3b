"""Activation epilogues."""

import torch

import coda_cutlass as cc


@cc.epilogue
def bias_gelu(acc, bias: cc.PerCol):
    """D = gelu(A @ W.T + bias) (exact erf form)."""
    return cc.gelu(acc + bias)


@cc.epilogue
def bias_relu(acc, bias: cc.PerCol):
    """D = relu(A @ W.T + bias)."""
    return cc.relu(acc + bias)


@cc.epilogue
def rowscale_silu(acc, r: cc.PerRow(torch.float32), up: cc.Tile):
    """D = silu(r * acc) * up: SwiGLU with gate and up in separate tensors, after an RMSNorm whose
    scale r is deferred into this GEMM."""
    return cc.silu(acc * r) * up
