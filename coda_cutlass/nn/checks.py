"""Argument checks of the Llama modules: what the kernels can take is refused the same way on the
CPU (the reference interpreter would take more) and on the GPU, when the module is made or called,
with messages that name the argument."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import CallError, ConfigError, DeviceError
from .attention import rope_inv_freq
from .runner import KernelRunner


def _positive_int(name: str, value: Any, multiple: int = 1, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % multiple:
        what = "a positive int" if multiple == 1 else f"a positive multiple of {multiple}{why}"
        raise ValueError(f"LlamaBlock: {name} must be {what}, got {value!r}")
    return value


def _positive_float(name: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = float("nan")
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"LlamaBlock: {name} must be a positive finite number, got {value!r}")
    return v


def check_block_args(dim: int, n_heads: int, n_kv_heads: int, head_dim: int | None, ffn_dim: int,
                     eps: Any) -> tuple[int, float]:
    """(head_dim, eps) of a block, checked when it is made: every GEMM's K and N and every map
    kernel's row a multiple of 8, RoPE pairs within a head of such a width, a positive finite eps
    (0 or NaN gave NaN silently)."""
    vec = " (the kernels move 8-element vectors: every GEMM's K and N)"
    _positive_int("n_heads", n_heads)
    head_dim = dim // n_heads if head_dim is None else head_dim
    _positive_int("dim", dim, 8, vec)
    _positive_int("n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
    _positive_int("head_dim", head_dim, 8, " (RoPE rotates adjacent pairs; the RoPE backward reads each head "
                                           "in 8-element vectors)")
    _positive_int("ffn_dim", ffn_dim, 8, vec)
    return head_dim, _positive_float("eps", eps)


def checked_inv_freq(head_dim: int, rope_theta: Any, inv_freq: Any) -> torch.Tensor:
    """The RoPE frequencies per pair: the standard ones for a positive finite rope_theta, or the
    given ones (head_dim / 2 finite values)."""
    if inv_freq is None:
        return rope_inv_freq(head_dim, _positive_float("rope_theta", rope_theta))
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.shape != (head_dim // 2,) \
            or not bool(torch.isfinite(inv_freq).all()):
        raise ValueError(f"LlamaBlock: inv_freq must be a tensor of head_dim / 2 = {head_dim // 2} finite "
                         f"frequencies, got {getattr(inv_freq, 'shape', inv_freq)!r}")
    return inv_freq


def check_model_args(vocab_size: Any, n_layers: Any, ce_chunk_bytes: Any) -> None:
    for name, value, multiple in (("vocab_size", vocab_size, 8), ("n_layers", n_layers, 1),
                                  ("ce_chunk_bytes", ce_chunk_bytes, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % multiple:
            what = "a positive int" if multiple == 1 else "a positive multiple of 8 (the LM head's N and its backward's K)"
            raise ValueError(f"LlamaModel: {name} must be {what}, got {value!r}")


def check_stream(x: torch.Tensor, weight: torch.Tensor) -> None:
    """The input's dtype and device are the weights' (the kernels' operands share one dtype; the
    reference interpreter would take others, and say nothing)."""
    if x.dtype != weight.dtype:
        raise CallError(f"LlamaBlock: x is {x.dtype} but the weights are {weight.dtype}; cast x (or the module "
                        f"with .to({x.dtype}))")
    if x.device != weight.device:
        raise CallError(f"LlamaBlock: x is on {x.device} but the weights are on {weight.device}")


def check_kernel_runner(runner: KernelRunner, weight: torch.Tensor) -> None:
    """A KernelRunner set on a module runs kernels of one dtype, on a GPU: say so when the module
    was moved away from it (the default runner follows the module by itself)."""
    if weight.device.type != "cuda":
        raise DeviceError(f"the block's runner is a KernelRunner (compiled kernels, a Hopper GPU) but its weights "
                          f"are on {weight.device}; move the module to the GPU or set block.runner = None (the "
                          "reference interpreter)")
    if runner.dtype != weight.dtype:
        raise ConfigError(f"the block's runner is a KernelRunner for {runner.dtype} but its weights are "
                          f"{weight.dtype} (moved with .to() / .half()?); set block.runner = KernelRunner("
                          f"{weight.dtype}) or None (the default runner follows the weights)")


def checked_targets(targets: Any, tokens: torch.Tensor, vocab: int, ignore_index: int) -> torch.Tensor:
    """The targets as one int64 vector, refused as torch's cross_entropy refuses them: class indices
    of an integer dtype, the tokens' shape and device, each in [0, vocab) or ``ignore_index``. On a
    GPU the range check is asynchronous (``torch._assert_async``: no synchronisation, a few small
    launches over M elements; a bad target is a device-side assert, as in torch's cross_entropy)."""
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a tensor of class indices, got {type(targets).__name__}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must be integer class indices (int64 or int32), got {targets.dtype}; "
                        "class probabilities are not supported")
    if targets.shape != tokens.shape:
        raise ValueError(f"targets must have the tokens' shape {tuple(tokens.shape)}, got {tuple(targets.shape)}")
    if targets.device != tokens.device:
        raise ValueError(f"targets are on {targets.device}, the tokens on {tokens.device}")
    t = targets.reshape(-1).to(torch.int64)
    bad = (t != ignore_index) & ((t < 0) | (t >= vocab))
    if t.is_cuda:
        torch._assert_async(~bad.any(), f"a target is out of bounds: class indices are in [0, {vocab}) or "
                                        f"ignore_index ({ignore_index})")
    elif bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise IndexError(f"target {int(t[i])} (at flat position {i}) is out of bounds: class indices are in "
                         f"[0, {vocab}) or ignore_index ({ignore_index})")
    return t
