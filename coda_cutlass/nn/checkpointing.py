"""Activation checkpointing of a block: keep only its inputs, recompute its forward in the backward.

The reentrant form of ``torch.utils.checkpoint.checkpoint`` fits the block's autograd Function as
it is: the first pass runs without autograd and keeps nothing but the inputs, the backward reruns
the forward with autograd and differentiates it. (The Function saves its tensors through
``ctx.save_for_backward``, but the attention keeps a graph of its own, which torch's non-reentrant
checkpoint would not drop; the reentrant form needs no such care.)

The first pass runs the training kernels (``block_forward(train=True)``, its saved tuple dropped at
once), not the forward-only ones: the recompute then reproduces the outputs the next block consumed
bit for bit (the kernels are deterministic), so a checkpointed block's gradients equal an
uncheckpointed one's exactly.

Under FSDP2 the block's registered forward method wraps this call: FSDP's pre-backward hook
all-gathers the parameters again before the recompute reads them (``reshard_after_forward=True``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

from .fp8.autograd import gradient_stamp, stash_follow


def recompute_in_backward(run: Callable[..., Any], step: Any, x: torch.Tensor, h: torch.Tensor, r: torch.Tensor,
                          g_next: torch.Tensor | None) -> Any:
    """``run(step, x, h, r, g_next, train)`` (LlamaBlock._run) without keeping its activations."""
    if not x.requires_grad:
        # the reentrant checkpoint differentiates only through inputs that require a gradient: with
        # a frozen embedding the weights would get none (the gradient of this copy is dropped)
        x = x.detach().requires_grad_()
    # h, r and the next norm's gain get no gradient through the block (its Function returns none,
    # and detaches g_next): as inputs of the checkpoint they must not require one either, or the
    # next block's gain (a Parameter) would see a second, empty gradient (DDP refuses that)
    h = h.detach() if isinstance(h, torch.Tensor) else h      # an FP8 block's h: its FP8 operand
    r = r.detach()
    g_next = None if g_next is None else g_next.detach()
    out = checkpoint(_pass, run, step, x, h, r, g_next, use_reentrant=True, preserve_rng_state=True)
    x2 = out[0] if isinstance(out, tuple) else out
    if x2.requires_grad:        # runs before the checkpoint's backward, which would name use_reentrant
        x2.register_hook(_refuse_partial_backward)
    return out


def _refuse_partial_backward(grad: torch.Tensor) -> torch.Tensor:
    """torch's reentrant checkpoint cannot run under ``torch.autograd.grad`` or ``backward(inputs=)``;
    its own error advises ``use_reentrant=False``, which the blocks' user never passed and cannot."""
    if not torch.autograd._is_checkpoint_valid():
        raise RuntimeError("a block with activation checkpointing (checkpoint_blocks(model), "
                           "block.activation_checkpointing, gradient_checkpointing_enable()) recomputes its forward "
                           "with torch's reentrant checkpoint, which torch.autograd.grad and backward(inputs=...) "
                           "cannot run through; call loss.backward() and read the .grad of the parameters, or turn "
                           "the checkpointing off (checkpoint_blocks(model, False))")
    return grad


def _pass(run: Callable[..., Any], step: Any, x: torch.Tensor, h: torch.Tensor, r: torch.Tensor,
          g_next: torch.Tensor | None) -> Any:
    # without autograd (the first pass) the training kernels run and nothing is kept; with it (the
    # recompute) the block's Function runs
    if torch.is_grad_enabled() and x.is_leaf and x.requires_grad and getattr(step, "stash", None) is not None:
        # an FP8 block's backward leaves its input gradient's FP8 copy in the step's stash for the
        # previous block, keyed by that tensor; the checkpoint hands on a copy of it (x.grad,
        # accumulated under grad mode), which the entry follows (else the previous block would
        # quantise the gradient again, on its own scale)
        arrived: dict[str, tuple] = {}
        x.register_hook(lambda g: arrived.__setitem__("stamp", gradient_stamp(g)))    # before accumulation
        x.register_post_accumulate_grad_hook(lambda leaf: stash_follow(step, arrived.get("stamp"), leaf.grad))
    return run(step, x, h, r, g_next, train=True)


def check_stack(blocks: Any, block_class: type) -> None:
    """A stack calls its blocks' ``run``: a wrapper around a block's forward (torch's
    checkpoint_wrapper, torch.compile) would be passed by unseen, silently doing nothing (such
    wrappers hand unknown attributes, run included, to the block inside)."""
    for i, b in enumerate(blocks):
        if not isinstance(b, block_class):
            raise TypeError(f"blocks[{i}] is a {type(b).__name__}, not a LlamaBlock: the model calls its blocks' "
                            "run(), which a wrapper around forward never sees (torch's checkpoint_wrapper would "
                            "checkpoint nothing); for activation checkpointing use "
                            "coda_cutlass.nn.parallel.checkpoint_blocks(model)")
        hooks = stack_skipped_hooks(b)
        if hooks:
            raise TypeError(f"blocks[{i}] has a {' and a '.join(hooks)}, which would never be called: the model calls "
                            "its blocks' run(), not their forward, so module hooks on a block in a model do nothing "
                            "(an adapter or probe there would be silently skipped); remove it (handle.remove()), "
                            "or hook the model itself")


# FSDP2's fully_shard registers a block's forward hooks; shard_model has them called around run too
# (register_fsdp_forward_method)
_HOOKS_AROUND_RUN = ("torch.distributed.fsdp.",)


def stack_skipped_hooks(block: Any) -> list[str]:
    """The kinds of module hook on ``block`` that a stack's call of its run() would skip."""
    kinds = {"forward pre-hook": block._forward_pre_hooks, "forward hook": block._forward_hooks,
             "backward hook": block._backward_hooks, "backward pre-hook": block._backward_pre_hooks}
    return [kind for kind, hooks in kinds.items()
            if any(not (getattr(h, "__module__", None) or "").startswith(_HOOKS_AROUND_RUN) for h in hooks.values())]
