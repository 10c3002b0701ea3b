"""The extra epilogue programs of a Llama block trained end to end (``coda_cutlass.nn``).

The forward uses the library's programs as they are: rope (QKV + rstd + RoPE), residual_norm_stats
(out-proj and down-proj), swiglu (gate/up + rstd + SwiGLU), residual_add, lm_head_lse. This module
adds the two map kernels (no GEMM) and a backward that follows
docs/TRANSFORMER_MATH.md with one change that saves bytes:

The producer of a norm consumer's gradient ``dz`` writes ``dz' = r * dz`` (r = rstd per row)
instead of dz. Then the norm-backward dX GEMM's accumulator is ``r * delta`` (delta = dL/dy) and
    dx     = r (delta g - x_hat c)   = acc * g - r^2 c x
    dgamma = sum_m delta * x_hat     = sum_m acc * x
    dW     = dz^T y = dz^T (r h)     = dz'^T h
with h = x * g the consumer GEMM's A operand: the backward never writes y, and
c = (1/d) z . dz is still the unscaled row sum that the dz producer computes.

Map kernels: norm_stats (the first RMSNorm after the embedding), rope_backward (on the attention
gradients). Backward GEMM epilogues: swiglu_backward_scaled (down-proj dX) and swiglu_backward_y
(also y again, from z), norm_backward (norm backward dX, residual gradient carried in) and
norm_backward_h (also h = x * g again, from x), norm_backward_first (none carried in: the final
norm), cross_entropy_backward (LM head recomputed: dlogits' = r * (softmax - onehot) * scale).
"""

import torch

import coda_cutlass as cc

F32 = torch.float32


@cc.epilogue
def norm_stats(acc, g: cc.PerCol):
    """Map kernel over the residual stream x (acc): h = x * g (the next GEMM's A operand) and the
    per-row sum of x^2 (from the fp32 x)."""
    return {"h": acc * g, "sumsq": cc.row_sum(acc * acc)}


def swiglu_grads(acc, z) -> tuple:
    """(g, u, dg, du): the saved z read as packed (gate, up) pairs and the SwiGLU backward's gate and
    up gradients for acc = dy (M x f); every down-proj dX program's math (bf16 and FP8 recipes)."""
    g, u = cc.unpack(z)
    s = cc.sigmoid(g)
    return g, u, acc * u * s * (1.0 + g * (1.0 - s)), acc * g * s


def swiglu_backward_outputs(acc, z, r) -> tuple:
    """(g, u, outputs) of the SwiGLU backward in the down-proj dX GEMM (acc = dy, M x f):
    dz' = r * dz interleaved (M x 2f) and the per-row partials of z . dz (unscaled); shared by the
    two programs below."""
    g, u, dg, du = swiglu_grads(acc, z)
    return g, u, {"dz": cc.pack(dg * r, du * r), "zdz": cc.row_sum(g * dg + u * du)}


@cc.epilogue
def swiglu_backward_scaled(acc, z: cc.PairTile, r: cc.PerRow(F32)):
    """Down-proj dX GEMM (acc = dy, M x f): reads the saved z as packed (gate, up) pairs, writes
    dz' = r * dz interleaved (M x 2f) and the per-row partials of z . dz (unscaled)."""
    return swiglu_backward_outputs(acc, z, r)[2]


@cc.epilogue
def swiglu_backward_y(acc, z: cc.PairTile, r: cc.PerRow(F32)):
    """swiglu_backward_scaled that also writes y = silu(gate) * up (M x f) again from the saved z,
    for the down-proj weight gradient: the block's forward then keeps z but not y (a third of its
    MLP activations; y costs this epilogue one more store)."""
    g, u, out = swiglu_backward_outputs(acc, z, r)
    return {**out, "y": cc.silu(g) * u}


@cc.epilogue
def norm_backward(acc, x: cc.Tile, r: cc.PerRow(F32), c: cc.PerRow(F32), g: cc.PerCol, dres: cc.Tile):
    """Norm-backward dX GEMM (acc = r * delta, from dz'): dx = dres + acc * g - r^2 c x, with dres
    the incoming residual gradient; dgamma = sum over rows of acc * x. c = (1/d) z . dz."""
    return norm_backward_outputs(acc, x, r, c, g, dres)


def norm_backward_outputs(acc, x, r, c, g, dres) -> dict:
    """dx and dgamma of the norm backward; shared by norm_backward and norm_backward_h."""
    return {"dx": dres + acc * g - (r * r * c) * x, "dgamma": cc.col_sum(acc * x)}


@cc.epilogue
def norm_backward_h(acc, x: cc.Tile, r: cc.PerRow(F32), c: cc.PerRow(F32), g: cc.PerCol, dres: cc.Tile):
    """norm_backward that also writes h = x * g again (the weight gradient's operand) from the x it
    reads anyway: the block's forward then keeps x but not h (one M x D tensor less per norm)."""
    return {**norm_backward_outputs(acc, x, r, c, g, dres), "h": x * g}


@cc.epilogue
def norm_backward_first(acc, x: cc.Tile, r: cc.PerRow(F32), c: cc.PerRow(F32), g: cc.PerCol):
    """As norm_backward, where no residual gradient comes in (the final norm before the LM head)."""
    return {"dx": acc * g - (r * r * c) * x, "dgamma": cc.col_sum(acc * x)}


@cc.epilogue
def rope_backward(acc, y: cc.Tile, r: cc.PerRow(F32), pos: cc.PerRow(F32), freq: cc.PerCol(F32)):
    """Map kernel over the attention gradient dy (acc) of the rotated q, k or v (y, saved):
    dz' = r * R(-theta) dy and the per-row partials of y . dy (= z . dz: the rotation is orthogonal)."""
    return {"dz": cc.rotate_pairs(acc, -(pos * freq)) * r, "zdz": cc.row_sum(acc * y)}


@cc.epilogue
def cross_entropy_backward(acc, r: cc.PerRow(F32), lse: cc.PerRow(F32), target: cc.PerRow(torch.int64),
                           scale: cc.PerRow(F32)):
    """LM head recomputed in the backward (A = x * g): logits = r * acc;
    dlogits = (softmax(logits) - onehot(target)) * scale[m] (scale = dloss / tokens, 0 on ignored
    rows); writes dz' = r * dlogits (D: the operand of the dX and dW GEMMs) and the per-row
    partials of logits . dlogits (the final norm's c)."""
    logits = acc * r
    onehot = cc.where(cc.col_index() == target, 1.0, 0.0)
    dl = (cc.exp(logits - lse) - onehot) * scale
    return {"D": dl * r, "zdz": cc.row_sum(logits * dl)}


@cc.epilogue
def cross_entropy_grad(acc, r: cc.PerRow(F32), lse: cc.PerRow(F32), target: cc.PerRow(torch.int64),
                       scale: cc.PerRow(F32)):
    """Map kernel over a chunk of written logits (acc; ``lm_head_lse_logits``' D): dlogits =
    (softmax - onehot(target)) * scale[m]; writes dz' = r * dlogits (D) and the per-row partials of
    logits . dlogits (the final norm's c). The LM head's backward without recomputing the logits."""
    onehot = cc.where(cc.col_index() == target, 1.0, 0.0)
    dl = (cc.exp(acc - lse) - onehot) * scale
    return {"D": dl * r, "zdz": cc.row_sum(acc * dl)}
