"""The epilogue programs of an FP8 Llama block under per-tensor scaling (``coda_cutlass.nn.fp8``, recipe
"tensorwise"): the block's bf16 programs where each output that feeds an FP8 GEMM is stored in FP8
with a given per-tensor scale ``s`` (a ``cc.DeviceScalar``: delayed scaling, the scale comes from
an amax history on the GPU), beside its amax (the history's next entry) and, where a weight-gradient
GEMM reads it with the tokens as K, its transposed copy (same scale: a per-tensor scale survives
the transpose). Per-tensor quantisation is elementwise, so no output here constrains the tile.

Forward:  residual_norm_stats_t (out-proj and down-proj: h = x * g, the next GEMM's operand),
          swiglu_t (gate/up: the SwiGLU output), quantize_tensor (map kernel: the attention output,
          the first block's h, a gradient no epilogue produced; with its transposed copy).
Backward: swiglu_backward_t (down-proj dX: dz as its gate and up halves, each with its transposed
          copy), norm_backward_t (gate/up and QKV dX: dx in bf16 and in FP8), rope_backward_t (map
          kernel: the RoPE backward of q, k and v, quantised, with its transposed copy).

Each program stores its FP8 outputs in one format, e4m3 by default; ``tensorwise_programs(activation,
gradient, weight)`` gives the set for a recipe's formats (the module's names are the e4m3 programs; an
e5m2 program's name ends in "_e5m2").
"""

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

import coda_cutlass as cc

from .block import swiglu_grads

F32, E4M3 = torch.float32, torch.float8_e4m3fn


def _in_format(make: Callable[[torch.dtype], Callable[..., Any]]) -> Callable[[torch.dtype], Any]:
    """``make(fmt)`` -> its function as an epilogue program storing ``fmt`` codes, once per format (the
    same program object each time: runners and prebuilds key kernels by it). e4m3 programs keep the
    function's name, so their kernels are the ones built before formats were a choice."""
    @functools.cache
    def program(fmt: torch.dtype) -> Any:
        fn = make(fmt)
        return cc.epilogue(fn, name=None if fmt == E4M3 else f"{fn.__name__}_{str(fmt).split('_')[-1]}")
    return program


@_in_format
def _quantize_tensor(fmt: torch.dtype) -> Callable[..., Any]:
    def quantize_tensor(acc, s: cc.DeviceScalar):
        """Map kernel: a tensor no GEMM produces, in FP8 with the given scale, its transposed copy (its
        weight gradient's operand) and its amax."""
        return {"q": cc.quantize(acc, fmt, scale=s), "qt": cc.quantize(acc, fmt, scale=s, transpose=True),
                "amax": cc.amax(acc)}
    return quantize_tensor


@_in_format
def _residual_norm_stats_t(fmt: torch.dtype) -> Callable[..., Any]:
    def residual_norm_stats_t(acc, resid: cc.Tile, g: cc.PerCol, s: cc.DeviceScalar):
        """Out-proj / down-proj: x = acc + resid (D, bf16: the residual stream), h = x * g in FP8 (the
        next GEMM's A) with its transposed copy (its weight gradient's operand), h's amax, and the
        per-row partials of x^2 (the next norm's r)."""
        x = acc + resid
        h = x * g
        return {"D": x, "h": cc.quantize(h, fmt, scale=s), "ht": cc.quantize(h, fmt, scale=s, transpose=True),
                "amax": cc.amax(h), "sumsq": cc.row_sum(x * x)}
    return residual_norm_stats_t


@_in_format
def _swiglu_t(fmt: torch.dtype) -> Callable[..., Any]:
    def swiglu_t(acc, r: cc.PerRow(F32), s: cc.DeviceScalar):
        """Gate/up: z = r * acc (bf16, saved for the backward), y = silu(gate) * up (half width) in FP8
        with its transposed copy, and y's amax (v holds y's value on both columns of its pair)."""
        z = acc * r
        g, u = cc.pairs(z)
        v = cc.silu(g) * u
        y = cc.half_width(v)
        return {"z": z, "y": cc.quantize(y, fmt, scale=s), "yt": cc.quantize(y, fmt, scale=s, transpose=True),
                "amax": cc.amax(v)}
    return swiglu_t


@_in_format
def _swiglu_backward_t(fmt: torch.dtype) -> Callable[..., Any]:
    def swiglu_backward_t(acc, z: cc.PairTile, r: cc.PerRow(F32), s: cc.DeviceScalar):
        """Down-proj dX (acc = dy, M x f): the SwiGLU backward of swiglu_backward_scaled, with dz' = r * dz
        written as its two halves, dg (gate) and du (up), each M x f in FP8 with its transposed copy
        (the caller points them at the two halves of one M x 2f buffer: the gate/up dX GEMM reads it
        against W^T's columns in the same order), their amaxes, and the per-row partials of z . dz."""
        g, u, dg, du = swiglu_grads(acc, z)
        dgr, dur = dg * r, du * r
        return {"dg": cc.quantize(dgr, fmt, scale=s), "dgt": cc.quantize(dgr, fmt, scale=s, transpose=True),
                "du": cc.quantize(dur, fmt, scale=s), "dut": cc.quantize(dur, fmt, scale=s, transpose=True),
                "amax_g": cc.amax(dgr), "amax_u": cc.amax(dur), "zdz": cc.row_sum(g * dg + u * du)}
    return swiglu_backward_t


@_in_format
def _norm_backward_t(fmt: torch.dtype) -> Callable[..., Any]:
    def norm_backward_t(acc, x: cc.Tile, r: cc.PerRow(F32), c: cc.PerRow(F32), g: cc.PerCol, dres: cc.Tile,
                        s: cc.DeviceScalar):
        """Norm-backward dX (as norm_backward): dx = dres + acc * g - r^2 c x in bf16 (the next
        accumulation's dres) and in FP8 with its transposed copy (the GEMMs that read it), dx's amax,
        and acc * x in bf16, whose column sums (summed in fp32 by the caller) are dgamma. A column sum
        in the epilogue (CUTLASS's Sm90RowReduction) keeps a whole tile of per-thread partials in a
        1.1-1.7 KB stack frame, which measured 0.8-0.9 ms at 8B widths (M = 8192) against the bare
        GEMM's 0.3; the extra bf16 tile costs one store (docs/RESULTS.md)."""
        dx = dres + acc * g - (r * r * c) * x
        return {"dx": dx, "dx8": cc.quantize(dx, fmt, scale=s), "dx8t": cc.quantize(dx, fmt, scale=s, transpose=True),
                "amax": cc.amax(dx), "ax": acc * x}
    return norm_backward_t


@_in_format
def _rope_backward_t(fmt: torch.dtype) -> Callable[..., Any]:
    def rope_backward_t(acc, y: cc.Tile, r: cc.PerRow(F32), pos: cc.PerRow(F32), freq: cc.PerCol(F32),
                        s: cc.DeviceScalar):
        """Map kernel (as rope_backward): dz' = r * R(-theta) dy in FP8 with the given scale, its
        transposed copy (the QKV weight gradient's operand), its amax, and the per-row partials of y . dy."""
        dz = cc.rotate_pairs(acc, -(pos * freq)) * r
        return {"dz": cc.quantize(dz, fmt, scale=s), "dzt": cc.quantize(dz, fmt, scale=s, transpose=True),
                "amax": cc.amax(dz), "zdz": cc.row_sum(acc * y)}
    return rope_backward_t


@dataclass(frozen=True)
class TensorwisePrograms:
    """A per-tensor FP8 block's programs for its formats: the forward's outputs (h, y, the attention
    output) in the activations' format, the backward's (dz, dx, dqkv, an incoming gradient) in the
    gradients', the weights' copies in theirs."""
    quantize_activation: Any
    quantize_gradient: Any
    quantize_weight: Any
    residual_norm_stats_t: Any
    swiglu_t: Any
    swiglu_backward_t: Any
    norm_backward_t: Any
    rope_backward_t: Any


@functools.cache
def tensorwise_programs(activation: torch.dtype = E4M3, gradient: torch.dtype = E4M3,
                        weight: torch.dtype = E4M3) -> TensorwisePrograms:
    return TensorwisePrograms(_quantize_tensor(activation), _quantize_tensor(gradient), _quantize_tensor(weight),
                              _residual_norm_stats_t(activation), _swiglu_t(activation),
                              _swiglu_backward_t(gradient), _norm_backward_t(gradient), _rope_backward_t(gradient))


quantize_tensor = _quantize_tensor(E4M3)
residual_norm_stats_t = _residual_norm_stats_t(E4M3)
swiglu_t = _swiglu_t(E4M3)
swiglu_backward_t = _swiglu_backward_t(E4M3)
norm_backward_t = _norm_backward_t(E4M3)
rope_backward_t = _rope_backward_t(E4M3)
