"""Causal self-attention between the QKV GEMM and the out-proj GEMM (the one part of a block that
is not a GEMM epilogue). It reads q, k, v straight out of the QKV kernel's (M, q + 2 kv) output as
strided views and gives its gradients back as (B, S, heads, head_dim) views, which the RoPE
backward map kernel reads without a copy.

Backends: ``"sdpa"`` (torch.nn.functional.scaled_dot_product_attention, any device) and
``"flash"`` (the flash-attn package's flash_attn_func, when installed; (B, S, H, D) layout natively).
The backward differentiates the attention call recorded in the forward (no recomputation).
A sliding window longer than the sequence changes nothing; a shorter one is a banded causal mask
for SDPA (which then runs without its causal fast path) and ``window_size`` for flash-attn.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..partials import cached_tensor

ATTENTION_BACKENDS = ("sdpa", "flash")
# What SDPA is handed (``Attention.inputs``): "views", the strided (B, S, heads, D) views of the QKV
# output with GQA in the kernel (the default); "heads", head-major (B, heads, S, D) copies;
# "heads_repeated", those with k and v repeated to every query head (no GQA in the kernel), as
# transformers' repeat_kv does. The same cuDNN kernels ran ~300 us a block slower on the views than
# in torch.compile's block (8B widths, twenty-eighth session), but the copies cost more than they
# gain: on the H200 the 8B FP8 blocks ran 0.4-3.7% slower with either form, the 1B and 8B bf16 models
# 0.6-1.1% slower with "heads" (docs/RESULTS.md, thirtieth session). Views stay the default.
ATTENTION_INPUTS = ("views", "heads", "heads_repeated")


def flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


class Attention:
    """One block's attention settings: the backend, the softmax scale (None: head_dim ** -0.5), a
    sliding window (each token sees itself and the window - 1 tokens before it; None: all before it)."""

    def __init__(self, backend: str = "sdpa", *, scale: float | None = None, window: int | None = None,
                 softcap: float | None = None, inputs: str = "views"):
        if inputs not in ATTENTION_INPUTS:
            raise ValueError(f"attention inputs must be one of {ATTENTION_INPUTS}, got {inputs!r}")
        if backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {backend!r}")
        if backend == "flash" and not flash_available():
            raise ValueError("attention='flash' needs the flash-attn package (pip install flash-attn); "
                             "use attention='sdpa'")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {window!r}")
        if scale is not None and not scale > 0:
            raise ValueError(f"attention_scale must be positive, got {scale!r}")
        if softcap is not None and not softcap > 0:
            raise ValueError(f"attention_softcap must be positive, got {softcap!r}")
        self.backend = backend
        self.scale = scale
        self.window = window
        self.softcap = softcap       # logits -> softcap * tanh(logits / softcap) (Gemma 2): eager attention
        self.inputs = inputs         # ATTENTION_INPUTS (SDPA without a soft-cap only)

    def __repr__(self) -> str:
        inputs = getattr(self, "inputs", "views")
        inputs = "" if inputs == "views" else f", inputs={inputs!r}"
        return f"Attention({self.backend!r}, scale={self.scale}, window={self.window}, softcap={self.softcap}{inputs})"

    def forward(self, qkv: torch.Tensor, batch: int, seq: int, dims: Any, dropout: float = 0.0,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple]:
        """qkv (M, q + 2 kv) -> (attention output (M, q), context for the backward). ``dropout``:
        the probability of dropping an attention weight (training only); ``mask``: (B, 1, S, S)
        bool, True = attend, causal included (nn.masks: padding, packed documents)."""
        hd, nq, nkv = dims.head_dim, dims.q_width, dims.kv_width
        bshd = lambda t, h: t.view(batch, seq, h, hd)  # noqa: E731
        q = bshd(qkv[:, :nq], dims.n_heads)
        k = bshd(qkv[:, nq:nq + nkv], dims.n_kv_heads)
        v = bshd(qkv[:, nq + nkv:], dims.n_kv_heads)
        windowed = self.window is not None and seq > self.window
        if (mask is not None or self.softcap is not None) and self.backend == "flash":
            if self.softcap is not None:
                raise ValueError("attention='flash' does not take a soft-cap here: use attention='sdpa'")
            raise ValueError("attention='flash' does not take padding or packed documents yet: use attention='sdpa'")
        if self.softcap is not None and mask is None:
            mask = causal_mask(seq, qkv.device)
        inputs = getattr(self, "inputs", "views")      # an Attention pickled before the setting: the views
        heads = inputs != "views" and self.backend == "sdpa" and self.softcap is None
        with torch.enable_grad():
            # the leaves the backward differentiates to: the views, or head-major (B, H, S, D) copies
            leaves = tuple((t.transpose(1, 2).contiguous() if heads else t).detach().requires_grad_()
                           for t in (q, k, v))
            if self.backend == "flash":
                from flash_attn import flash_attn_func
                o = flash_attn_func(*leaves, dropout_p=dropout, softmax_scale=self.scale, causal=True,
                                    window_size=(self.window - 1, 0) if windowed else (-1, -1))  # (B, S, H, D)
            else:
                q_, k_, v_ = leaves if heads else (t.transpose(1, 2) for t in leaves)   # (B, H, S, D)
                gqa = dims.n_heads != dims.n_kv_heads
                if heads and gqa and inputs == "heads_repeated":
                    k_, v_ = (t.repeat_interleave(dims.n_heads // dims.n_kv_heads, dim=1) for t in (k_, v_))
                    gqa = False
                if windowed:
                    band = window_mask(seq, self.window, qkv.device)
                    mask = band if mask is None else (mask & band) | torch.eye(seq, dtype=torch.bool, device=qkv.device)
                if self.softcap is not None:
                    o = softcapped(q_, k_, v_, mask, self.scale or dims.head_dim ** -0.5, self.softcap,
                                   dropout).transpose(1, 2)
                else:
                    o = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, is_causal=mask is None,
                                                       dropout_p=dropout, scale=self.scale,
                                                       enable_gqa=gqa).transpose(1, 2)
        out = o.detach().reshape(batch * seq, nq)       # a view when o is laid out (B, S, H, D), else a copy
        return out, (leaves, o, heads)

    @staticmethod
    def backward(ctx: tuple, d_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Gradient of the output (M, q) -> (dq, dk, dv) as (B, S, heads, head_dim) tensors. The
        recorded graph is kept (a block's backward may run again under ``retain_graph``); it is freed
        with the block's saved tensors, which hold ``o``, once the backward is done."""
        leaves, o, heads = ctx
        grads = torch.autograd.grad(o, leaves, d_out.view(o.shape), retain_graph=True)
        # head-major leaves: their gradients as (B, S, heads, D) views, which the RoPE backward map
        # kernels read without a copy
        return tuple(g.transpose(1, 2) for g in grads) if heads else grads


def softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float, cap: float,
               dropout: float) -> torch.Tensor:
    """Attention with soft-capped logits, in torch (B, H, S, D) -> (B, H, S, D): scores = cap *
    tanh(q k^T scale / cap), masked, softmax in fp32 (as transformers' eager Gemma 2). It holds the
    (B, H, S, S) scores: slower and larger than SDPA, which has no soft-cap."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout:
        p = F.dropout(p, dropout)
    return torch.matmul(p, v)


def causal_mask(seq: int, device: torch.device) -> torch.Tensor:
    """(seq, seq) bool: query i sees key j <= i (cached)."""
    return cached_tensor(("causal_mask", seq, device),
                         lambda: torch.ones(seq, seq, dtype=torch.bool, device=device).tril())


def window_mask(seq: int, window: int, device: torch.device) -> torch.Tensor:
    """(seq, seq) bool: query i sees key j when i - window < j <= i (cached)."""
    return cached_tensor(("window_mask", seq, window, device), lambda: _window_mask(seq, window, device))


def _window_mask(seq: int, window: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    return (j <= i) & (j > i - window)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """The standard RoPE frequencies theta^(-2i / head_dim), i < head_dim / 2."""
    return theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
