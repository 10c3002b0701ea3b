"""Argument checks of the Llama modules: what the kernels can take is refused the same way on the
CPU (the reference interpreter would take more) and on the GPU, when the module is made or called,
with messages that name the argument."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import ArgumentError, CallError, ConfigError, DeviceError
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
    if head_dim is None and isinstance(dim, int) and dim % n_heads:
        raise ValueError(f"dim ({dim}) is not a multiple of n_heads ({n_heads}): head_dim would be dim / n_heads; "
                         "pass head_dim= for heads of another width")
    head_dim = dim // n_heads if head_dim is None else head_dim
    _positive_int("dim", dim, 8, vec)
    _positive_int("n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
    _positive_int("head_dim", head_dim, 8, " (RoPE rotates adjacent pairs; the RoPE backward reads each head "
                                           "in 8-element vectors)")
    _positive_int("ffn_dim", ffn_dim, 8, vec)
    return head_dim, _positive_float("eps", eps)


def check_rope_args(rope_theta: Any, inv_freq: Any, rope: Any) -> None:
    """The standard frequencies need a positive finite rope_theta (0 or NaN gave NaN silently); a
    given table, finite frequencies (its length is the Rope's to check)."""
    if rope is None and inv_freq is None:
        _positive_float("rope_theta", rope_theta)
    elif inv_freq is not None and (not isinstance(inv_freq, torch.Tensor) or not bool(torch.isfinite(inv_freq).all())):
        raise ValueError(f"LlamaBlock: inv_freq must be a tensor of finite frequencies, got "
                         f"{type(inv_freq).__name__ if not isinstance(inv_freq, torch.Tensor) else 'non-finite values'}")


def check_model_args(vocab_size: Any, n_layers: Any, ce_chunk_bytes: Any) -> None:
    """n_layers may be 0 (a stack filled afterwards, as from_hf does); a forward needs a block."""
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 0:
        raise ValueError(f"LlamaModel: n_layers must be an int >= 0, got {n_layers!r}")
    for name, value in (("vocab_size", vocab_size), ("ce_chunk_bytes", ce_chunk_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"LlamaModel: {name} must be a positive int, got {value!r}")


def check_vocab_for_kernels(vocab_size: int, runner: Any) -> None:
    """The LM head's kernels take a vocabulary of a multiple of 8 (their N, and K of its backward):
    refused before any launch. The reference interpreter takes any (the distributed tests shard an
    uneven one on the CPU)."""
    if isinstance(runner, KernelRunner) and vocab_size % 8:
        raise ValueError(f"LlamaModel: vocab_size {vocab_size} is not a multiple of 8, which the LM head's kernels "
                         "need (pad the vocabulary, e.g. to the next multiple of 64)")


def check_stream(x: torch.Tensor, weight: torch.Tensor) -> None:
    """The input is a floating tensor on the weights' device (it is then cast to the compute dtype,
    nn.precision). An integer input would be cast silently, on the CPU as on the GPU."""
    if not x.is_floating_point():
        raise CallError(f"LlamaBlock: x must be a floating-point tensor, got {x.dtype}")
    if x.device != weight.device:
        raise CallError(f"LlamaBlock: x is on {x.device} but the weights are on {weight.device}")


def check_kernel_runner(runner: KernelRunner, device: torch.device, dtype: torch.dtype) -> None:
    """A KernelRunner set on a module runs kernels of one dtype, on a GPU: say so when the module was
    moved away from it (the default runners follow the module's device and compute dtype)."""
    if device.type != "cuda":
        raise DeviceError(f"the block's runner is a KernelRunner (compiled kernels, a Hopper GPU) but its weights "
                          f"are on {device}; move the module to the GPU or set block.runner = None "
                          "(model.set_runner(None)) for the default")
    if runner.dtype != dtype:
        raise ConfigError(f"the block's runner is a KernelRunner for {runner.dtype} but this call computes in "
                          f"{dtype} (moved with .to() / .half()?); set block.runner = KernelRunner({dtype}) or None "
                          "(the default runners follow the module)")


def check_switch(on: Any) -> None:
    """track_fp8_stats' ``on``: True or False (a truthy "off" or "no" turned the statistics on)."""
    if not isinstance(on, bool):
        raise ArgumentError(f"track_fp8_stats: on must be True or False, got {on!r}")


def check_token_ids(tokens: Any, vocab: int) -> None:
    """Token ids (``input_ids`` of the from_hf models) as the embedding takes them: an int64 or int32
    tensor of values in [0, vocab). torch's lookup said "index out of range in self" with neither the
    token nor the vocabulary; like the targets' check, asynchronous on a GPU (a device-side assert)."""
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens (input_ids) must be a tensor of token ids, got {type(tokens).__name__}")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"tokens (input_ids) must be integer token ids (int64 or int32), got {tokens.dtype}")
    t = tokens.reshape(-1)
    if t.is_cuda:       # four small launches, no synchronisation
        torch._assert_async(((t >= 0) & (t < vocab)).all(),
                            f"a token id is out of the vocabulary: token ids are in [0, {vocab})")
        return
    bad = (t < 0) | (t >= vocab)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise IndexError(f"token id {int(t[i])} (at flat position {i}) is out of the vocabulary: token ids are in "
                         f"[0, {vocab})")


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


def refuse_double_backward(what: str) -> None:
    """A backward with create_graph=True runs with autograd on: coda's gradients come from kernels (and
    the fused LM head's from its forward), which autograd cannot differentiate, so second-order
    terms would be silently missing (measured: a hypergradient 9.74 where 11.09 was right)."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{what}: a backward with create_graph=True (double backward: gradient penalties, "
                           "Hessian-vector products, hypergradients) is not supported: the gradients come from "
                           "kernels autograd cannot differentiate, so second-order terms would be missing")
