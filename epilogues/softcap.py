"""The LM head with soft-capped logits (Gemma 2's final_logit_softcapping): y = cap * tanh(z / cap)
of the logits z = r * acc, whose derivative is 1 - (y / cap)^2. One program per LM-head program of
``loss.py`` / ``block.py``, with the cap as a runtime scalar."""

import torch

import coda_cutlass as cc

F32 = torch.float32


def _cap(z, cap):
    return cc.tanh(z / cap) * cap


@cc.epilogue
def rowscale_softcap(acc, r: cc.PerRow(F32), cap: cc.Scalar):
    """The logits: cap * tanh(r * acc / cap)."""
    return _cap(acc * r, cap)


@cc.epilogue
def lm_head_lse_softcap(acc, r: cc.PerRow(F32), target: cc.PerRow(torch.int64), cap: cc.Scalar):
    """As lm_head_lse, over the capped logits (not written)."""
    y = _cap(acc * r, cap)
    return {"lse": cc.row_logsumexp(y), "target_logit": cc.gather(y, target)}


@cc.epilogue
def lm_head_lse_logits_softcap(acc, r: cc.PerRow(F32), target: cc.PerRow(torch.int64), cap: cc.Scalar):
    """As lm_head_lse_logits: writes the uncapped logits z (D) for cross_entropy_grad_softcap; the
    log-sum-exp and target logit are of the capped logits as written (z rounded to the GEMM dtype)."""
    z = cc.cast(acc * r)
    y = _cap(z, cap)
    return {"D": z, "lse": cc.row_logsumexp(y), "target_logit": cc.gather(y, target)}


def _grad(z, lse, target, scale, cap):
    y = _cap(z, cap)
    onehot = cc.where(cc.col_index() == target, 1.0, 0.0)
    return (cc.exp(y - lse) - onehot) * scale * (1.0 - (y / cap) * (y / cap))


@cc.epilogue
def cross_entropy_backward_softcap(acc, r: cc.PerRow(F32), lse: cc.PerRow(F32), target: cc.PerRow(torch.int64),
                                   scale: cc.PerRow(F32), cap: cc.Scalar):
    """As cross_entropy_backward (the LM head recomputed), through the cap: dz = dy (1 - (y/cap)^2)."""
    z = acc * r
    dz = _grad(z, lse, target, scale, cap)
    return {"D": dz * r, "zdz": cc.row_sum(z * dz)}


@cc.epilogue
def cross_entropy_grad_softcap(acc, r: cc.PerRow(F32), lse: cc.PerRow(F32), target: cc.PerRow(torch.int64),
                               scale: cc.PerRow(F32), cap: cc.Scalar):
    """As cross_entropy_grad (a map kernel over written logits z), through the cap."""
    dz = _grad(acc, lse, target, scale, cap)
    return {"D": dz * r, "zdz": cc.row_sum(acc * dz)}
