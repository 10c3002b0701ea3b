"""A plain-torch emulation of the FP8 "tensorwise" Llama block, written from the recipe's description
(docs/FP8.md), not from coda's code: the standard Llama layer in fp32 where every linear is an FP8
linear (its input, weight and output gradient each quantised per tensor with a current power-of-two
scale, dequantised, multiplied in fp32) and each RMSNorm's row scale r is applied after the linear
(the quantised operand is x * g; the recipe keeps r in the consumer's epilogue). The fused weights
(q|k|v, gate|up) are quantised as one tensor each, as the block stores them.

With the same input twice, coda's delayed scales equal these current ones, so a coda block running
in fp32 through the interpreter matches this up to summation order."""

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


class Fp8Linear(torch.autograd.Function):
    """a @ w.T with a, w and (in the backward) the output gradient each through fake_quant; both
    weights' rows (fused q|k|v, gate|up) given as one tensor."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, w: torch.Tensor, fmt: tuple) -> torch.Tensor:  # type: ignore[override]
        qa, qw = fake_quant(a, fmt[0]), fake_quant(w, fmt[2])
        ctx.save_for_backward(qa, qw)
        ctx.fmt = fmt
        return qa @ qw.t()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor):  # type: ignore[override]
        qa, qw = ctx.saved_tensors
        qd = fake_quant(dy, ctx.fmt[1])
        return qd @ qw, qd.flatten(0, -2).t() @ qa.flatten(0, -2), None


def _rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def emulated_block(x: torch.Tensor, w: dict[str, torch.Tensor], dims: Any, inv_freq: torch.Tensor,
                   fmt: tuple[torch.dtype, torch.dtype, torch.dtype]) -> torch.Tensor:
    """One FP8 Llama layer on x (B, S, D) fp32; ``w`` as reference.standard_weights; ``fmt`` the
    (activation, gradient, weight) formats."""
    B, S, D = x.shape
    hd, H, KV = dims.head_dim, dims.n_heads, dims.n_kv_heads
    qkv = _rstd(x, dims.eps) * Fp8Linear.apply(x * w["attn_norm"], torch.cat([w["q"], w["k"], w["v"]]), fmt)
    q, k, v = qkv.split((H * hd, KV * hd, KV * hd), dim=-1)
    q, k, v = (t.reshape(B, S, -1, hd).transpose(1, 2) for t in (q, k, v))
    theta = torch.arange(S, dtype=torch.float32)[:, None] * inv_freq.float()[None]
    emb = torch.cat((theta, theta), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != KV)
    x1 = x + Fp8Linear.apply(o.transpose(1, 2).reshape(B, S, H * hd), w["o"], fmt)
    z = _rstd(x1, dims.eps) * Fp8Linear.apply(x1 * w["mlp_norm"], torch.cat([w["gate"], w["up"]]), fmt)
    gate, up = z.chunk(2, dim=-1)
    return x1 + Fp8Linear.apply(F.silu(gate) * up, w["down"], fmt)
