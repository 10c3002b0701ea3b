"""coda models on PyTorch's own distributed engines: FSDP2 (``fully_shard``), DDP, activation
checkpointing (docs/DISTRIBUTED.md).

    from torch.distributed.fsdp import MixedPrecisionPolicy
    shard_model(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                activation_checkpointing=True)
    model(tokens, targets).backward(); optimizer.step()

``shard_model`` makes every coda block its own FSDP unit (all-gathered before it runs, resharded
after it with ``reshard_after_forward``, all-gathered again for its backward, its gradients
reduce-scattered into the sharded parameters), then the whole module one more (the embedding, the
final norm and the LM head, with whatever else the module holds). A stack calls its blocks through
``LlamaBlock.run``, so that method is registered as the blocks' FSDP forward method; and the blocks
take fp32 inputs besides the stream (the rstd r, RoPE positions and frequencies), so their units
keep ``cast_forward_inputs`` off (the stream is already in the compute dtype). DDP needs nothing:
``DistributedDataParallel(model)`` works as for any module.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from .block import LlamaBlock

PARAM_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


def coda_blocks(module: nn.Module) -> list[LlamaBlock]:
    """The coda blocks in ``module`` (itself included), in module order."""
    return [m for m in module.modules() if isinstance(m, LlamaBlock)]


def checkpoint_blocks(module: nn.Module, enabled: bool = True) -> nn.Module:
    """Activation checkpointing of every coda block in ``module`` (nn.checkpointing): a block keeps
    only its inputs and recomputes its forward in the backward. Returns ``module``."""
    blocks = coda_blocks(module)
    if not blocks:
        raise ValueError(f"checkpoint_blocks: {type(module).__name__} holds no coda_cutlass.nn.LlamaBlock")
    for b in blocks:
        b.activation_checkpointing = bool(enabled)
    return module


def block_policy(policy: MixedPrecisionPolicy) -> MixedPrecisionPolicy:
    """A blocks' unit's policy: the same parameter and reduction dtypes, inputs and outputs as they
    are (r, the RoPE inputs and the next norm's rstd are fp32 by design)."""
    return dataclasses.replace(policy, cast_forward_inputs=False, output_dtype=None)


def shard_model(module: nn.Module, *, mesh: Any = None, mp_policy: MixedPrecisionPolicy | None = None,
                reshard_after_forward: bool | int = True, activation_checkpointing: bool = False,
                **fsdp_options: Any) -> nn.Module:
    """FSDP2 over ``module`` (a LlamaModel, a from_hf model, any module holding coda blocks, or one
    LlamaBlock): each block its own unit, then ``module``. ``mesh``: a 1-D DeviceMesh (default:
    the whole world); ``mp_policy``: e.g. ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32)`` (the blocks' units keep it but cast no inputs);
    ``reshard_after_forward`` for the blocks (the root keeps FSDP's default); other options
    (``offload_policy``, ...) go to every ``fully_shard`` call. Returns ``module``, sharded in place."""
    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {type(policy).__name__}")
    if policy.param_dtype not in PARAM_DTYPES:
        raise ValueError(f"mp_policy.param_dtype must be one of {PARAM_DTYPES} (the kernels compute in bf16 or "
                         f"fp16, the reference interpreter also in fp32), got {policy.param_dtype}")
    blocks = coda_blocks(module)
    if not blocks:
        raise ValueError(f"shard_model: {type(module).__name__} holds no coda_cutlass.nn.LlamaBlock")
    sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if sharded:
        raise ValueError(f"shard_model: {type(sharded[0]).__name__} in the module is already sharded (fully_shard)")
    if activation_checkpointing:
        checkpoint_blocks(module)
    if isinstance(module, LlamaBlock):      # alone, it is called through forward
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward, **fsdp_options)
        return module
    for b in blocks:
        fully_shard(b, mesh=mesh, mp_policy=block_policy(policy), reshard_after_forward=reshard_after_forward,
                    **fsdp_options)
        register_fsdp_forward_method(b, "run")
    fully_shard(module, mesh=mesh, mp_policy=policy, **fsdp_options)
    return module
