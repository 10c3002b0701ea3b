"""Causal self-attention between the QKV GEMM and the out-proj GEMM (the one part of a block that
is not a GEMM epilogue). It reads q, k, v straight out of the QKV kernel's (M, q + 2 kv) output as
strided views and gives its gradients back as (B, S, heads, head_dim) views, which the RoPE
backward map kernel reads without a copy.

Backends: ``"sdpa"`` (torch.nn.functional.scaled_dot_product_attention, any device) and
``"flash"`` (the flash-attn package's flash_attn_func, when installed; (B, S, H, D) layout natively).
The backward differentiates the attention call recorded in the forward (no recomputation).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("sdpa", "flash")


def flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class Attention:
    def __init__(self, backend: str = "sdpa"):
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {backend!r}")
        if backend == "flash" and not flash_available():
            raise ValueError("attention='flash' needs the flash-attn package (pip install flash-attn); "
                             "use attention='sdpa'")
        self.backend = backend

    def forward(self, qkv: torch.Tensor, batch: int, seq: int, dims: Any) -> tuple[torch.Tensor, tuple]:
        """qkv (M, q + 2 kv) -> (attention output (M, q), context for the backward)."""
        hd, nq, nkv = dims.head_dim, dims.q_width, dims.kv_width
        bshd = lambda t, h: t.view(batch, seq, h, hd)  # noqa: E731
        q = bshd(qkv[:, :nq], dims.n_heads)
        k = bshd(qkv[:, nq:nq + nkv], dims.n_kv_heads)
        v = bshd(qkv[:, nq + nkv:], dims.n_kv_heads)
        with torch.enable_grad():
            leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
            if self.backend == "flash":
                from flash_attn import flash_attn_func
                o = flash_attn_func(*leaves, causal=True)                       # (B, S, H, D)
            else:
                q_, k_, v_ = (t.transpose(1, 2) for t in leaves)                 # (B, H, S, D) views
                o = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True,
                                                   enable_gqa=dims.n_heads != dims.n_kv_heads).transpose(1, 2)
        out = o.detach().reshape(batch * seq, nq)       # a view when o is laid out (B, S, H, D)
        return out, (leaves, o)

    @staticmethod
    def backward(ctx: tuple, d_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Gradient of the output (M, q) -> (dq, dk, dv) as (B, S, heads, head_dim) tensors. The
        recorded graph is kept (a block's backward may run again under ``retain_graph``); it is freed
        with the block's saved tensors, which hold ``o``, once the backward is done."""
        leaves, o = ctx
        return torch.autograd.grad(o, leaves, d_out.view(o.shape), retain_graph=True)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """The standard RoPE frequencies theta^(-2i / head_dim), i < head_dim / 2."""
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
