"""The FP8 block as a ``torch.autograd.Function``, and how its gradients' FP8 copies reach the
previous block.

Autograd hands a block's backward only the bf16 gradient of its output. The FP8 copies of that
gradient (1 x 128 codes and the transposed copy) are written by the next block's QKV dX epilogue
beside the bf16 tensor; they travel in the step's ``stash``, keyed by the bf16 tensor (its storage,
shape and strides, checked when taken). A gradient that no coda epilogue produced (the LM head's,
or a user's ``y.backward(dy)``) is quantised on arrival instead.
"""

from __future__ import annotations

from typing import Any

import torch

from .paths import Path

WEIGHT_NAMES = ("qkv", "o", "gate_up", "down", "attn_norm", "mlp_norm")


def _stamp(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def stash_put(step: Any, t: torch.Tensor, q: Any) -> None:
    # Blocks run their backward one after another, each taking the entry the next block put, so the
    # stash holds one entry: clearing it drops the first block's, which nothing takes (a step reused
    # across iterations, as a benchmark does, would otherwise keep every iteration's copies).
    step.stash.clear()
    step.stash[id(t)] = (_stamp(t), q)


def stash_take(step: Any, t: torch.Tensor) -> Any:
    hit = step.stash.pop(id(t), None)
    return hit[1] if hit is not None and hit[0] == _stamp(t) else None


class Fp8BlockFunction(torch.autograd.Function):
    """(x, r, weights...) -> x2 [, h2, r2] for one FP8 block; h (the FP8 operand of the block's
    first GEMM), the step and the recipe's path (paths.py) come in as plain arguments."""

    @staticmethod
    def forward(ctx: Any, x, r, w_qkv, w_o, w_gu, w_down, g_attn, g_mlp, g_next, h: Any, step: Any,  # type: ignore[override]
                path: Path, next_fp8: bool, weights: Any):
        x2, h2, r2, saved = path.forward(step, x, h, r, weights, g_next, next_fp8)
        ctx.step, ctx.saved, ctx.weights, ctx.path = step, saved, weights, path
        if h2 is None:
            return x2
        if isinstance(h2, torch.Tensor):
            ctx.mark_non_differentiable(h2, r2)
        else:
            ctx.mark_non_differentiable(r2)
        return x2, h2, r2

    @staticmethod
    def backward(ctx: Any, dx2: torch.Tensor, *unused: Any):  # type: ignore[override]
        dx2 = dx2.contiguous()
        dx, dxq, g = ctx.path.backward(ctx.step, ctx.saved, ctx.weights, dx2, stash_take(ctx.step, dx2))
        stash_put(ctx.step, dx, dxq)
        ctx.saved = None
        w = ctx.weights
        grads = tuple(g[n].to(getattr(w, n).dtype) for n in WEIGHT_NAMES)
        return (dx, None, *grads, None, None, None, None, None, None)
