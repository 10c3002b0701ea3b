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

from ..checks import refuse_double_backward
from ..precision import no_autocast
from .paths import Path
from .weights import PinnedWeights

WEIGHT_NAMES = ("qkv", "o", "gate_up", "down", "attn_norm", "mlp_norm")
INPUT_NAMES = ("input x", "input rstd", "weight qkv", "weight o", "weight gate_up", "weight down",
               "attention norm gain", "MLP norm gain")


def gradient_stamp(t: torch.Tensor) -> tuple:
    """What the stash keys an entry's gradient by (its storage, shape, strides, dtype, device)."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def stash_put(step: Any, t: torch.Tensor, q: Any) -> None:
    # Blocks run their backward one after another, each taking the entry the next block put, so the
    # stash holds one entry: clearing it drops the first block's, which nothing takes (a step reused
    # across iterations, as a benchmark does, would otherwise keep every iteration's copies).
    step.stash.clear()
    step.stash[id(t)] = (gradient_stamp(t), q)


def stash_follow(step: Any, put_for: tuple | None, t: torch.Tensor) -> None:
    """The stash's entry, if it was put for the gradient stamped ``put_for``, now belongs to ``t``, a
    copy of that gradient: a checkpointed FP8 block's input gradient, which the reentrant checkpoint
    accumulates into its input's ``.grad`` under grad mode, and so copies (nn.checkpointing). An
    entry put for another tensor (a later block's, passed over by a bf16 block) is left alone."""
    if put_for is not None and len(step.stash) == 1:
        (stamp, q), = step.stash.values()
        if stamp == put_for and stamp[1:] == gradient_stamp(t)[1:]:
            step.stash.clear()
            step.stash[id(t)] = (gradient_stamp(t), q)


def stash_take(step: Any, t: torch.Tensor) -> Any:
    hit = step.stash.pop(id(t), None)
    return hit[1] if hit is not None and hit[0] == gradient_stamp(t) else None


def _versions(tensors: tuple) -> tuple[int, ...]:
    return tuple(t._version for t in tensors)


class Fp8BlockFunction(torch.autograd.Function):
    """(x, r, weights...) -> x2 [, h2, r2] for one FP8 block; h (the FP8 operand of the block's
    first GEMM), the step and the recipe's path (paths.py) come in as plain arguments.

    What the backward needs stays on the ctx (FP8 operands are not tensors ``save_for_backward``
    takes) and is freed by the backward: a second backward through the same graph
    (``retain_graph=True``, double backward) is refused with a clear error, and saved-tensor hooks
    (``save_on_cpu``) do not see these activations. ``record=False`` (an empty batch): the delayed
    scales record nothing, forward or backward; ``fold_after``: a forward recomputed inside a
    backward (torch.utils.checkpoint), whose amaxes are folded when its backward ends. The backward reads the weights' FP8 copies the
    forward read (weights.PinnedWeights); a weight or input changed in place between the forward
    and the backward (its version counter moved) is refused, as autograd refuses it for saved
    tensors. Autocast is off inside (the kernels' fp32 finishing steps run as written)."""

    @staticmethod
    def forward(ctx: Any, x, r, w_qkv, w_o, w_gu, w_down, g_attn, g_mlp, g_next, h: Any, step: Any,  # type: ignore[override]
                path: Path, next_fp8: bool, weights: Any, record: bool, fold_after: bool = False):
        wq = PinnedWeights(path.weights)
        with no_autocast(x.device):
            x2, h2, r2, saved = path.forward(step, x, h, r, weights, g_next, next_fp8, wq=wq, record=record)
        ctx.step, ctx.saved, ctx.weights, ctx.path, ctx.wq, ctx.record = step, saved, weights, path, wq, record
        ctx.fold_after = fold_after
        ctx.inputs = (x, r, w_qkv, w_o, w_gu, w_down, g_attn, g_mlp)
        ctx.versions = _versions(ctx.inputs)
        if h2 is None:
            return x2
        if isinstance(h2, torch.Tensor):
            ctx.mark_non_differentiable(h2, r2)
        else:
            ctx.mark_non_differentiable(r2)
        return x2, h2, r2

    @staticmethod
    def backward(ctx: Any, dx2: torch.Tensor, *unused: Any):  # type: ignore[override]
        refuse_double_backward("an FP8 block")
        if ctx.saved is None:
            raise RuntimeError("Trying to backward through an FP8 block a second time: FP8 blocks (nn.fp8) free "
                               "their saved FP8 activations in their backward, so retain_graph=True and double "
                               "backward are not supported; run the forward again for another backward "
                               "(docs/FP8.md)")
        for name, t, before, now in zip(INPUT_NAMES, ctx.inputs, ctx.versions, _versions(ctx.inputs)):
            if now != before:
                raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an "
                                   f"inplace operation: the FP8 block's {name} ({t.dtype}, {tuple(t.shape)}) is at "
                                   f"version {now}; expected version {before} instead. Change weights after the "
                                   "backward (optimizer.step() after loss.backward())")
        with no_autocast(dx2.device):
            dx2 = dx2.contiguous()
            dx, dxq, g = ctx.path.backward(ctx.step, ctx.saved, ctx.weights, dx2, stash_take(ctx.step, dx2),
                                           wq=ctx.wq, record=ctx.record)
        stash_put(ctx.step, dx, dxq)
        if ctx.fold_after:          # a checkpoint's recompute: its step ends with this backward
            ctx.path.begin_step(dx2.device)
        ctx.path.backward_done()    # amaxes reduced over ranks: when the whole backward ends
        ctx.saved = ctx.wq = ctx.inputs = None
        w = ctx.weights
        grads = tuple(g[n].to(getattr(w, n).dtype) for n in WEIGHT_NAMES)
        return (dx, None, *grads, None, None, None, None, None, None, None, None)
