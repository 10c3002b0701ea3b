"""Gated-MLP activations besides SwiGLU, and the QKV projection with a bias, for the model
families of ``coda_cutlass.nn.hf`` (GeGLU-tanh: Gemma; ReGLU: relu configs; q/k/v biases: Qwen 2).

Each activation has the three programs a block runs (``coda_cutlass.nn.activations``): the gate/up
GEMM writing z and y (``geglu`` / ``reglu`` in ``pairwise``), the same without z for the forward
alone (``*_only``), and the down-proj dX GEMM of the backward, which writes dz' = r * dz (packed),
the per-row partials of z . dz and y again from z (``*_backward_y``, as ``swiglu_backward_y``;
``*_backward_scaled``: without y).
"""

import math

import torch

import coda_cutlass as cc

F32 = torch.float32
_K = math.sqrt(2.0 / math.pi)     # GELU tanh form: gelu(x) = x/2 (1 + tanh(K (x + C x^3)))
_C = 0.044715


@cc.epilogue
def geglu_only(acc, r: cc.PerRow(F32)):
    """GeGLU (tanh form) forward without the pre-activation: y = gelu(z_2i) * z_2i+1, half width."""
    g, u = cc.pairs(acc * r)
    return {"y": cc.half_width(cc.gelu(g, approximate="tanh") * u)}


@cc.epilogue
def reglu_only(acc, r: cc.PerRow(F32)):
    """ReGLU forward without the pre-activation: y = relu(z_2i) * z_2i+1, half width."""
    g, u = cc.pairs(acc * r)
    return {"y": cc.half_width(cc.relu(g) * u)}


def geglu_backward_outputs(acc, z, r) -> tuple:
    """(g, u, outputs) of the GeGLU (tanh form) backward: dz' = r * dz interleaved and the per-row
    partials of z . dz (as swiglu_backward_outputs)."""
    g, u = cc.unpack(z)
    t = cc.tanh(_K * (g + _C * g * g * g))
    slope = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _K * (1.0 + 3.0 * _C * g * g)
    dg = acc * u * slope
    du = acc * (0.5 * g * (1.0 + t))
    return g, u, {"dz": cc.pack(dg * r, du * r), "zdz": cc.row_sum(g * dg + u * du)}


def reglu_backward_outputs(acc, z, r) -> tuple:
    """(g, u, outputs) of the ReGLU backward (as swiglu_backward_outputs)."""
    g, u = cc.unpack(z)
    dg = cc.where(g > 0.0, acc * u, 0.0)
    du = acc * cc.relu(g)
    return g, u, {"dz": cc.pack(dg * r, du * r), "zdz": cc.row_sum(g * dg + u * du)}


@cc.epilogue
def geglu_backward_scaled(acc, z: cc.PairTile, r: cc.PerRow(F32)):
    """Down-proj dX GEMM of GeGLU (tanh form): acc = dy; writes dz' = r * dz interleaved and the
    per-row partials of z . dz."""
    return geglu_backward_outputs(acc, z, r)[2]


@cc.epilogue
def reglu_backward_scaled(acc, z: cc.PairTile, r: cc.PerRow(F32)):
    """Down-proj dX GEMM of ReGLU: acc = dy; writes dz' = r * dz interleaved and the per-row
    partials of z . dz."""
    return reglu_backward_outputs(acc, z, r)[2]


@cc.epilogue
def geglu_backward_y(acc, z: cc.PairTile, r: cc.PerRow(F32)):
    """geglu_backward_scaled that also writes y = gelu(gate) * up (M x f) again from the saved z."""
    g, u, out = geglu_backward_outputs(acc, z, r)
    return {**out, "y": cc.gelu(g, approximate="tanh") * u}


@cc.epilogue
def reglu_backward_y(acc, z: cc.PairTile, r: cc.PerRow(F32)):
    """reglu_backward_scaled that also writes y = relu(gate) * up (M x f) again from the saved z."""
    g, u, out = reglu_backward_outputs(acc, z, r)
    return {**out, "y": cc.relu(g) * u}


@cc.epilogue
def rope_bias(acc, r: cc.PerRow(F32), bias: cc.PerCol, pos: cc.PerRow(F32), freq: cc.PerCol(F32)):
    """QKV GEMM after an RMSNorm, with a per-column bias before RoPE: R(pos * freq) (r * acc + bias)."""
    return cc.rotate_pairs(acc * r + bias, pos * freq)


@cc.epilogue
def rope_backward_bias(acc, y: cc.Tile, r: cc.PerRow(F32), bias: cc.PerCol, pos: cc.PerRow(F32),
                       freq: cc.PerCol(F32)):
    """Map kernel over the attention gradient dy (acc) of the rotated, biased q, k or v (y, saved):
    dz' = r * R(-theta) dy and the per-row partials of (z - bias) . dz, z = R(-theta) y (the norm
    backward needs the product with the bias-free GEMM output)."""
    theta = -(pos * freq)
    dz = cc.rotate_pairs(acc, theta)
    return {"dz": dz * r, "zdz": cc.row_sum(dz * (cc.rotate_pairs(y, theta) - bias))}
