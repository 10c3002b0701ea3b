"""Pairwise epilogues: gated MLP activations on interleaved gate/up weights, RoPE, and their
backward passes (docs/TRANSFORMER_MATH.md: SwiGLU, RoPE). Convert standard checkpoints with
``coda_cutlass.layouts`` (interleave_gate_up, rope_half_split_to_pairs)."""

import torch

import coda_cutlass as cc


@cc.epilogue
def swiglu(acc, r: cc.PerRow(torch.float32)):
    """Gate/up GEMM after an RMSNorm (W has gate/up columns interleaved, N = 2f):
    z = r * acc (saved for the backward, M x 2f) and y = silu(z_2i) * z_2i+1 (M x f, half width)."""
    z = acc * r
    g, u = cc.pairs(z)
    return {"z": z, "y": cc.half_width(cc.silu(g) * u)}


@cc.epilogue
def swiglu_only(acc, r: cc.PerRow(torch.float32)):
    """As swiglu, without writing the pre-activation (inference, or recompute in the backward)."""
    g, u = cc.pairs(acc * r)
    return {"y": cc.half_width(cc.silu(g) * u)}


@cc.epilogue
def geglu(acc, r: cc.PerRow(torch.float32)):
    """GeGLU: y = gelu(z_2i) * z_2i+1 (tanh form), half width; z saved."""
    z = acc * r
    g, u = cc.pairs(z)
    return {"z": z, "y": cc.half_width(cc.gelu(g, approximate="tanh") * u)}


@cc.epilogue
def reglu(acc, r: cc.PerRow(torch.float32)):
    """ReGLU: y = relu(z_2i) * z_2i+1, half width; z saved."""
    z = acc * r
    g, u = cc.pairs(z)
    return {"z": z, "y": cc.half_width(cc.relu(g) * u)}


@cc.epilogue
def swiglu_backward(acc, z: cc.PairTile):
    """Down-proj dX GEMM (acc = dy, M x f) of the SwiGLU backward. Reads the saved interleaved
    pre-activation z (M x 2f) as packed pairs (g, u); writes dz interleaved (M x 2f), the recomputed
    y = silu(g) * u as D (for dW_down), and the per-row partial of z . dz (for the norm backward)."""
    g, u = cc.unpack(z)
    s = cc.sigmoid(g)
    dg = acc * u * s * (1.0 + g * (1.0 - s))
    du = acc * g * s
    return {"D": g * s * u, "dz": cc.pack(dg, du), "zdz": cc.row_sum(g * dg + u * du)}


@cc.epilogue
def rope(acc, r: cc.PerRow(torch.float32), pos: cc.PerRow(torch.float32), freq: cc.PerCol(torch.float32)):
    """QKV GEMM after an RMSNorm, with RoPE on adjacent column pairs: z = r * acc, then each pair is
    rotated by pos[m] * freq[n] (freq is the pair's frequency on both of its columns; 0 for V
    columns, which then pass through unchanged). One fused rotation node (cc.rotate_pairs)."""
    return cc.rotate_pairs(acc * r, pos * freq)


def _rotate(x, y, c, s):
    return x * c - y * s, x * s + y * c


@cc.epilogue
def rope_generic(acc, r: cc.PerRow(torch.float32), pos: cc.PerRow(torch.float32), freq: cc.PerCol(torch.float32)):
    """rope written with the generic pair function cc.pair_map (same math, more nodes)."""
    theta = pos * freq
    return cc.pair_map(_rotate, acc * r, cc.cos(theta), cc.sin(theta))
