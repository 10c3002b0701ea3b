"""A plain-torch emulation of the FP8 Llama block under each recipe, written from the recipes'
description (docs/FP8.md), not from coda's code: the standard Llama layer in fp32 where every linear
is an FP8 linear (its input, weight and output gradient quantised with power-of-two scales,
dequantised, multiplied in fp32) and each RMSNorm's row scale r is applied after the linear (the
quantised operand is x * g; the recipes keep r in the consumer's epilogue). The fused weights
(q|k|v, gate|up) are quantised as one tensor each, as the block stores them (gate and up rows
interleaved; RoPE's row order within a 128-wide head changes no 128-row tile).

- "tensorwise": one current scale per tensor (with the same input twice, coda's delayed scales
  equal these);
- "blockwise": activations and gradients in 1 x 128 runs along each GEMM's K (so a weight
  gradient, whose K is the token dimension, reads 128 x 1 runs of both operands), weights in
  128 x 128 tiles;
- "blockwise_g16": "blockwise", but the weight gradient reads the activation in blocks of 128
  tokens x 16 channels (one scale for 16 neighbouring columns of a 128-row run)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from coda_cutlass.dtypes import FP8_MAX, as_dtype, round_to
from coda_cutlass.nn.reference import rotate_half


def fake_quant(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t through per-tensor FP8 and back: scale = amax / fp8_max rounded up to a power of two."""
    d = as_dtype(dtype)
    amax = float(t.detach().abs().max())
    if amax == 0:
        return t.detach().clone()
    v = amax / float(FP8_MAX[d])
    m, e = torch.frexp(torch.tensor(v, dtype=torch.float32))
    s = float(v) if float(m) == 0.5 else 2.0 ** int(e)
    return round_to(t.detach().float() / s, d).float() * s


def _pow2_up(v: torch.Tensor) -> torch.Tensor:
    m, e = torch.frexp(v)
    return torch.where(m == 0.5, v, torch.ldexp(torch.ones_like(v), e))


def fake_quant_runs(t: torch.Tensor, dtype: torch.dtype, dim: int) -> torch.Tensor:
    """t (R, C) through FP8 in runs of 128 along ``dim`` (1: along each row, 0: down each column)."""
    x = t.detach().float()
    if dim == 0:
        return fake_quant_runs(x.t(), dtype, 1).t()
    d = as_dtype(dtype)
    R, C = x.shape
    runs = x.reshape(R, C // 128, 128)
    amax = runs.abs().amax(-1, keepdim=True)
    s = torch.where(amax == 0, torch.ones_like(amax), _pow2_up(amax / float(FP8_MAX[d])))
    return (round_to(runs / s, d).float() * s).reshape(R, C)


def fake_quant_tiles(w: torch.Tensor, dtype: torch.dtype, rows: int = 128, cols: int = 128) -> torch.Tensor:
    """w (R, C) through FP8 in rows x cols tiles (default 128 x 128)."""
    d = as_dtype(dtype)
    R, C = w.shape
    tiles = w.detach().float().reshape(R // rows, rows, C // cols, cols)
    amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
    s = torch.where(amax == 0, torch.ones_like(amax), _pow2_up(amax / float(FP8_MAX[d])))
    return (round_to(tiles / s, d).float() * s).reshape(R, C)


class Fp8Linear(torch.autograd.Function):
    """a @ w.T with a, w and (in the backward) the output gradient through FP8 as the recipe says;
    both weights' rows (fused q|k|v, gate|up) given as one tensor. ``fmt``: (activation, gradient,
    weight) formats; ``recipe``: "tensorwise", "blockwise" or "blockwise_g16"."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, w: torch.Tensor, fmt: tuple, recipe: str) -> torch.Tensor:  # type: ignore[override]
        a2 = a.flatten(0, -2)
        if recipe == "tensorwise":
            qa, qw = fake_quant(a2, fmt[0]), fake_quant(w, fmt[2])
            ctx.save_for_backward(qa, qw)
        else:
            qa, qw = fake_quant_runs(a2, fmt[0], 1), fake_quant_tiles(w, fmt[2])
            wgrad_a = (fake_quant_tiles(a2, fmt[0], 128, 16) if recipe == "blockwise_g16"   # the weight
                       else fake_quant_runs(a2, fmt[0], 0))                                  # gradient's operand
            ctx.save_for_backward(wgrad_a, qw)
        ctx.fmt, ctx.recipe, ctx.shape = fmt, recipe, a.shape
        return (qa @ qw.t()).reshape(*a.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        qa, qw = ctx.saved_tensors
        d2 = dy.flatten(0, -2)
        if ctx.recipe == "tensorwise":
            qd = qd_t = fake_quant(d2, ctx.fmt[1])
        else:
            qd, qd_t = fake_quant_runs(d2, ctx.fmt[1], 1), fake_quant_runs(d2, ctx.fmt[1], 0)
        return (qd @ qw).reshape(ctx.shape), qd_t.t() @ qa, None, None


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def emulated_block(x: torch.Tensor, w: dict[str, torch.Tensor], dims: Any, inv_freq: torch.Tensor,
                   fmt: tuple[torch.dtype, torch.dtype, torch.dtype], recipe: str = "tensorwise") -> torch.Tensor:
    """One FP8 Llama layer on x (B, S, D) fp32; ``w`` as reference.standard_weights; ``fmt`` the
    (activation, gradient, weight) formats."""
    B, S, D = x.shape
    hd, H, KV = dims.head_dim, dims.n_heads, dims.n_kv_heads
    qkv = _rstd(x, dims.eps) * Fp8Linear.apply(x * w["attn_norm"], torch.cat([w["q"], w["k"], w["v"]]), fmt, recipe)
    q, k, v = qkv.split((H * hd, KV * hd, KV * hd), dim=-1)
    q, k, v = (t.reshape(B, S, -1, hd).transpose(1, 2) for t in (q, k, v))
    theta = torch.arange(S, dtype=torch.float32)[:, None] * inv_freq.float()[None]
    emb = torch.cat((theta, theta), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != KV)
    x1 = x + Fp8Linear.apply(o.transpose(1, 2).reshape(B, S, H * hd), w["o"], fmt, recipe)
    # gate and up rows interleaved (gate 0, up 0, gate 1, ...): the 128-row weight tiles and 1 x 128
    # gradient runs of "blockwise" cover the same elements as the block's (per tensor: either order)
    w_gu = torch.stack([w["gate"], w["up"]], dim=1).reshape(-1, w["gate"].shape[1])
    z = _rstd(x1, dims.eps) * Fp8Linear.apply(x1 * w["mlp_norm"], w_gu, fmt, recipe)
    gate, up = z[..., 0::2], z[..., 1::2]
    return x1 + Fp8Linear.apply(F.silu(gate) * up, w["down"], fmt, recipe)


def emulated_layer(x: torch.Tensor, w: dict[str, torch.Tensor], block: Any, fmt: tuple | None,
                   recipe: str | None) -> torch.Tensor:
    """``emulated_block`` with the settings a converted transformers layer brings (nn.hf): its
    norms' (offset + weight) gains (Gemma), its softmax scale (yarn / longrope fold their cos / sin
    factor into it), its sliding window and its RoPE frequencies at this length, all read from the
    coda ``block``; ``recipe`` None: the same layer in exact fp32 (no quantisation)."""
    B, S, D = x.shape
    d = block.dims
    hd, H, KV = d.head_dim, d.n_heads, d.n_kv_heads
    lin = (lambda a, wt: a @ wt.t()) if recipe is None else (lambda a, wt: Fp8Linear.apply(a, wt, fmt, recipe))
    off = block.norm_offset
    qkv = _rstd(x, d.eps) * lin(x * (w["attn_norm"] + off), torch.cat([w["q"], w["k"], w["v"]]))
    q, k, v = qkv.split((H * hd, KV * hd, KV * hd), dim=-1)
    q, k, v = (t.reshape(B, S, -1, hd).transpose(1, 2) for t in (q, k, v))
    theta = torch.arange(S, dtype=torch.float32)[:, None] * block.rope.inv_freq(S).float()[None]
    emb = torch.cat((theta, theta), dim=-1)
    q, k = q * emb.cos() + rotate_half(q) * emb.sin(), k * emb.cos() + rotate_half(k) * emb.sin()
    i, j = torch.arange(S)[:, None], torch.arange(S)[None]
    allowed = j <= i
    if block.attention.window is not None:
        allowed = allowed & (j > i - block.attention.window)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=block.attention.scale, enable_gqa=H != KV)
    x1 = x + lin(o.transpose(1, 2).reshape(B, S, H * hd), w["o"])
    w_gu = torch.stack([w["gate"], w["up"]], dim=1).reshape(-1, w["gate"].shape[1])
    z = _rstd(x1, d.eps) * lin(x1 * (w["mlp_norm"] + off), w_gu)
    return x1 + lin(F.silu(z[..., 0::2]) * z[..., 1::2], w["down"])
