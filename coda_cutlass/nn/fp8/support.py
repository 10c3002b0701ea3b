"""What a LlamaBlock needs to run in FP8 (the one place the block module calls into nn.fp8): the
check of what the FP8 path covers, and a block's call."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from ...errors import ConfigError
from ..functional import BlockWeights, first_norm
from ..precision import cast, no_autocast
from ..sharding import is_dtensor
from . import functional as blockwise
from .amax_reduce import in_backward
from .autograd import Fp8BlockFunction
from .functional import check_tokens
from .paths import BlockwisePath, Path, TensorwisePath
from .recipe import Fp8Recipe
from .delayed import DelayedScales
from .tensorwise import copies_per_call, folding_together, new_scales, weight_pairs
from .weights import Fp8Weights, make_tensor_copies_together

__all__ = ["begin_fp8_steps", "check_block", "check_compute_dtype", "first_norm_fp8", "hands_fp8", "make_weight_copies",
           "new_path", "run"]


def new_path(recipe: Fp8Recipe) -> Path:
    """A block's per-recipe state: its FP8 weight copies (and delayed scales)."""
    weights = Fp8Weights(recipe)
    return TensorwisePath(weights, new_scales(recipe)) if recipe.scaling == "tensor" else BlockwisePath(weights)


def make_weight_copies(blocks: Iterable[Any]) -> None:
    """Before a model's first block: its per-tensor FP8 blocks' stale weight copies, several blocks'
    in one call where ``nn.fp8.tensorwise.copies_blocks_per_call`` says so (else each block makes its
    own in its forward). Blocks sharded by FSDP2 are left to themselves: their parameters are gathered
    only for their own forward, so their shards here are neither the weights nor what the copies'
    stamps will see."""
    tensorwise = [b for b in _unique(list(blocks)) if b.fp8 is not None and b.fp8.scaling == "tensor"
                  and not is_dtensor(b.qkv)]
    per_call = copies_per_call() if tensorwise else 1
    if per_call > 1:
        make_tensor_copies_together([(b.fp8_path().weights, weight_pairs(b)) for b in tensorwise], per_call)


def begin_fp8_steps(blocks: Iterable[Any], x: torch.Tensor) -> None:
    """Before a model's first block, ``x`` the stream entering it: the per-tensor FP8 blocks' delayed
    scales folded together where ``nn.fp8.tensorwise.folds_together`` says so (else each block folds
    its own in its call), for the blocks whose own call would fold them
    now (``run``: a training forward, a non-empty batch, not a checkpoint's recompute, and a
    parameter of the block's own that requires a gradient), on ``x``'s device; the rest fold in their
    own calls, as before. Where the ranks reduce their amaxes (nn/fp8/amax_reduce.py) an empty batch
    folds too, as the blocks' own calls then do."""
    tensorwise = _unique([b for b in blocks if b.fp8 is not None and b.fp8.scaling == "tensor"])
    if not tensorwise or not torch.is_grad_enabled() or in_backward():
        return          # (a bf16 model stops at the first test)
    if not folding_together():
        return
    # the calls' own refusals first: a refused call changes no scale (run)
    check_tokens(x.shape[0])
    for b in tensorwise:
        check_compute_dtype(b.fp8, x.dtype)
    # a checkpointed block's first pass runs without autograd and folds in its recompute
    scales = [b.fp8_path().scales for b in tensorwise if b.qkv.device == x.device and not b.activation_checkpointing
              and any(t.requires_grad for t in (b.qkv, b.o, b.gate_up, b.down, b.attn_norm, b.mlp_norm))
              and (x.shape[0] > 0 or b.fp8_path().reduces_amax())]
    if scales:
        DelayedScales.begin_steps_together(scales, x.device)


def _unique(blocks: list[Any]) -> list[Any]:
    """Each block once (a model may list one block object twice: one fold, one set of copies)."""
    return list({id(b): b for b in blocks}.values())


def hands_fp8(recipe: Fp8Recipe | None, nxt: Fp8Recipe | None) -> bool | Fp8Recipe:
    """The ``next_fp8`` of a block of ``recipe`` followed by a block of ``nxt``: whether its down-proj
    epilogue writes the next block's first operand in FP8, as that block reads it. Blockwise recipes
    write it in the next one's weight-gradient groups (the recipe is returned: "blockwise" and
    "blockwise_g16" mix without requantising); per-tensor recipes when the activation formats
    agree (the operand carries this block's delayed scale). Otherwise (False) h goes in bf16 and the
    next block quantises it itself (an FP8 copy dequantised and quantised again would round twice)."""
    if recipe is None or nxt is None or recipe.scaling != nxt.scaling:
        return False
    if recipe.scaling == "block":
        if nxt == recipe:
            return True
        # this block's down GEMM runs with the next recipe's options (its h2 in that recipe's groups):
        # only where the two differ in nothing else (its weight's format, above all; reduce_amax,
        # which blockwise scaling ignores, aside)
        same = dataclasses.replace(nxt, name=recipe.name, wgrad_group=recipe.wgrad_group,
                                   reduce_amax=recipe.reduce_amax)
        return nxt if same == recipe else False
    return recipe.activation == nxt.activation


def check_compute_dtype(recipe: Fp8Recipe, dtype: torch.dtype | None) -> None:
    """FP8 blocks compute in bf16 around their GEMMs (the FP8 GEMMs' epilogues write bf16): fp16 is
    refused, as is an fp32 stream."""
    if dtype == torch.float16:
        raise ConfigError(f"fp8={recipe.name!r}: FP8 blocks compute in bf16 around their FP8 GEMMs (their "
                          "epilogues write bf16 activations), not in float16; use dtype=torch.bfloat16, or "
                          "compute_dtype=torch.bfloat16 (fp16 or fp32 parameters), or "
                          "torch.autocast(dtype=torch.bfloat16); fp16 training runs with fp8=None")
    if dtype is not None and dtype != torch.bfloat16:
        raise ConfigError(f"fp8={recipe.name!r}: FP8 blocks compute in bf16 around their FP8 GEMMs, but the "
                          f"stream is {dtype}; make the model with dtype=torch.bfloat16, or keep fp32 parameters "
                          "with compute_dtype=torch.bfloat16 (or torch.autocast(dtype=torch.bfloat16))")


def first_norm_fp8(step: Any, x: torch.Tensor, g: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """(h, r) of the stream entering the first FP8 block: blockwise, h quantised by the norm's map
    kernel; per tensor, h in bf16 (the block quantises it with its own delayed scale)."""
    check_compute_dtype(step.fp8, x.dtype)
    if step.fp8.scaling == "tensor":
        return first_norm(step, x, g)
    return blockwise.first_norm_fp8(step, x, g)


def check_block(block: Any, recipe: Fp8Recipe | None) -> Fp8Recipe | None:
    """The recipe, once the block is one the FP8 path computes (a Llama block in bf16, or in fp32 that
    autocast or compute_dtype will make bf16); else a clear error."""
    if recipe is None:
        return None
    # what decides the compute dtype now: compute_dtype, else 16-bit parameters (fp32 ones may run
    # under autocast: run() checks the stream)
    dtype = block.compute_dtype or block.qkv.dtype
    if dtype == torch.float16:
        check_compute_dtype(recipe, dtype)
    if block.compute_dtype == torch.float32:
        # an explicit compute_dtype wins over autocast (nn.precision), so this block could never run:
        # refused now, naming the setting (the call's check would blame the parameters' dtype)
        raise ConfigError(f"fp8={recipe.name!r}: FP8 blocks compute in bf16 around their FP8 GEMMs, but "
                          "compute_dtype=torch.float32 makes this block compute in fp32 (autocast does not change "
                          "an explicit compute_dtype); use compute_dtype=torch.bfloat16, or compute_dtype=None "
                          "with bf16 parameters; fp32 training runs with fp8=None")
    d = block.dims
    unsupported = [name for name, on in (
        ("qkv_bias", block.qkv_bias is not None), ("qk_norm", block.q_norm is not None),
        ("sandwich_norms", block.post_attn_norm is not None), (f"activation={block.mlp.name!r}", block.mlp.name != "silu"),
        ("attention_softcap", block._softcap is not None)) if on]
    if unsupported:
        raise ConfigError(f"fp8={recipe.name!r}: the FP8 block covers Llama blocks (SwiGLU, no biases, no q/k or "
                          f"sandwich norms) for now; this block has {', '.join(unsupported)}")
    for name, width in (("dim", d.dim), ("ffn_dim", d.ffn_dim), ("q width (n_heads * head_dim)", d.q_width),
                        ("kv width (n_kv_heads * head_dim)", d.kv_width)):
        if width % 128:
            raise ConfigError(f"fp8={recipe.name!r}: {name} = {width} is not a multiple of 128 (FP8 blocks read "
                              "every GEMM operand in 128-wide blocks)")
    return recipe


def run(block: Any, step: Any, x: torch.Tensor, h: Any, r: torch.Tensor, g_next: torch.Tensor | None,
        next_fp8: bool | Fp8Recipe) -> Any:
    """One FP8 block on the stream (the FP8 twin of LlamaBlock._run): the weights are quantised from
    the parameters themselves (fp32 masters included), the norm gains cast to the compute dtype.
    Everything is checked before any state moves (a refused call changes no scale). A forward
    without autograd (no_grad, inference_mode, or nothing that requires a gradient: evaluation,
    inference) runs on the current scales and records nothing, as does an empty batch; only training
    forwards move the delayed scales on. Autocast is off inside (the kernels' fp32 finishing steps
    and the weights' copies run as written)."""
    check_compute_dtype(block.fp8, x.dtype)
    check_tokens(x.shape[0])
    step = block.local_step(step)       # this block's recipe (a model's blocks may mix them)
    dtype = step.dtype or torch.bfloat16
    path = block.fp8_path()
    g_attn, g_mlp = (cast(g, dtype) for g in (block.gain(block.attn_norm), block.gain(block.mlp_norm)))
    gn = None if g_next is None else cast(g_next.detach(), dtype)
    w = BlockWeights(block.qkv, block.o, block.gate_up, block.down, g_attn, g_mlp)
    tensors = (block.qkv, block.o, block.gate_up, block.down, g_attn, g_mlp)
    train = torch.is_grad_enabled() and any(t.requires_grad for t in (x, *tensors))
    record = train and x.shape[0] > 0        # an empty batch is no step: it has no amaxes
    # Where the ranks reduce their amaxes together (nn/fp8/amax_reduce.py) every training forward is
    # a step, an empty batch's too (it records nothing): every rank folds and reduces alike
    reduces = train and path.reduces_amax()
    steps = train if reduces else record
    # A checkpoint's recompute (torch.utils.checkpoint) runs inside the backward and must see the
    # scales its first pass saw: it starts no step; its amaxes are recorded (again, for the
    # non-reentrant form: the same values) and folded when its own backward ends (the reentrant
    # form's first pass, without autograd, recorded nothing)
    recompute = steps and in_backward()
    with no_autocast(x.device):
        if steps and not recompute:
            path.begin_step(x.device)
        if reduces:
            path.recording(x.device)
        h = path.quantize_input(step, h, record=record)   # from a bf16 block, a caller or another recipe
        if train:
            return Fp8BlockFunction.apply(x, r, *tensors, gn, h, step, path, next_fp8, w, record, recompute)
        x2, h2, r2, _ = path.forward(step, x, h, r, w, gn, next_fp8, record=False)
    return x2 if h2 is None else (x2, h2, r2)
