"""What the nn modules need to know about sharded (DTensor) parameters, without importing
torch.distributed unless a DTensor is actually met.

Under FSDP2 (``fully_shard``) a module's parameters are sharded DTensors outside its forward and
plain unsharded tensors inside it. Two things follow for a stack of blocks (nn.parallel wraps
them so):

- a block runs through ``LlamaBlock.run``, not ``forward``: it must be registered as an FSDP
  forward method (``torch.distributed.fsdp.register_fsdp_forward_method``), else it would read its
  sharded parameters; that is refused here with the fix named;
- a block's down-proj epilogue applies the *next* block's attention-norm gain (the norm statistics
  travel with the residual stream), read while the next block is still sharded: ``full_value``
  gathers that (dim,)-vector (one small all-gather per block and forward).

FSDP2's ``MixedPrecisionPolicy(cast_forward_inputs=True)`` would round a block's fp32 inputs (the
rstd r, the RoPE positions and frequencies) to bf16: that is refused too.
"""

from __future__ import annotations

from typing import Any

import torch


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a torch.distributed DTensor (nn.Parameters of one are too)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def sharded_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (a whole tensor) sharded as ``like`` is, on its mesh and placements, when ``like`` is a
    DTensor (load_state_dict of whole tensors into a sharded model: torch copies DTensor into DTensor
    only); else ``full`` itself."""
    if not is_dtensor(like):
        return full
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(full.to(device=like.device, dtype=like.dtype), like.device_mesh, like.placements)


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a possibly sharded parameter (an all-gather for a sharded DTensor)."""
    return t.full_tensor() if is_dtensor(t) else t


def check_stack_call(block: Any, step: Any, r: torch.Tensor) -> None:
    """Refuse a block call that cannot compute the right thing: sharded parameters (run not
    registered with FSDP2), fp32 inputs that something rounded down."""
    if is_dtensor(block.qkv):
        raise RuntimeError(
            "LlamaBlock.run got sharded (DTensor) parameters: under FSDP2 a stack calls its blocks' run(), so "
            "register it as a forward method (torch.distributed.fsdp.register_fsdp_forward_method(block, 'run')) "
            "or shard with coda_cutlass.nn.parallel.shard_model; tensor-parallel DTensor plans are not "
            "implemented (docs/DISTRIBUTED.md)")
    for name, t in (("r (the rstd of the residual stream)", r), ("the RoPE positions", step.pos),
                    ("the RoPE frequencies", step.freq)):
        if t.dtype != torch.float32:
            raise TypeError(
                f"LlamaBlock.run: {name} must be float32, got {t.dtype}; FSDP2's MixedPrecisionPolicy with "
                "cast_forward_inputs=True rounds a block's inputs: shard blocks with cast_forward_inputs=False "
                "(coda_cutlass.nn.parallel.shard_model does)")
