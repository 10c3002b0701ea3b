"""A plain torch Llama (separate q/k/v and gate/up weights, half-split RoPE, F.rms_norm, SDPA),
the eager reference coda_cutlass.nn is checked against: in the tests, in the training example and
in the block benchmark. Weights are taken from (and gradients mapped back to) the coda modules.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layouts import deinterleave_gate_up, unpermute_rope_rows


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def standard_weights(block: Any) -> dict[str, torch.Tensor]:
    """A coda LlamaBlock's weights in the standard (Hugging Face) layout, as new leaf tensors."""
    d = block.dims
    q, k, v = block.qkv.detach().split((d.q_width, d.kv_width, d.kv_width))
    gate, up = deinterleave_gate_up(block.gate_up.detach())
    w = {"q": unpermute_rope_rows(q, d.head_dim), "k": unpermute_rope_rows(k, d.head_dim), "v": v,
         "o": block.o.detach(), "gate": gate, "up": up, "down": block.down.detach(),
         "attn_norm": block.attn_norm.detach(), "mlp_norm": block.mlp_norm.detach()}
    return {n: t.clone().requires_grad_() for n, t in w.items()}


def coda_grads_standard(block: Any) -> dict[str, torch.Tensor]:
    """A coda block's parameter gradients in the standard layout (names as standard_weights)."""
    d = block.dims
    q, k, v = block.qkv.grad.split((d.q_width, d.kv_width, d.kv_width))
    gate, up = deinterleave_gate_up(block.gate_up.grad)
    return {"q": unpermute_rope_rows(q, d.head_dim), "k": unpermute_rope_rows(k, d.head_dim), "v": v,
            "o": block.o.grad, "gate": gate, "up": up, "down": block.down.grad,
            "attn_norm": block.attn_norm.grad, "mlp_norm": block.mlp_norm.grad}


def standard_block(x: torch.Tensor, w: dict[str, torch.Tensor], dims: Any, inv_freq: torch.Tensor) -> torch.Tensor:
    """One Llama decoder layer on x (B, S, D), weights named as standard_weights returns them."""
    B, S, D = x.shape
    hd, H, KV = dims.head_dim, dims.n_heads, dims.n_kv_heads
    h = F.rms_norm(x, (D,), weight=w["attn_norm"], eps=dims.eps)
    q = (h @ w["q"].t()).view(B, S, H, hd).transpose(1, 2)
    k = (h @ w["k"].t()).view(B, S, KV, hd).transpose(1, 2)
    v = (h @ w["v"].t()).view(B, S, KV, hd).transpose(1, 2)
    theta = torch.arange(S, dtype=torch.float32, device=x.device)[:, None] * inv_freq.to(x.device, torch.float32)[None]
    emb = torch.cat((theta, theta), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != KV)
    x1 = x + o.transpose(1, 2).reshape(B, S, H * hd) @ w["o"].t()
    h1 = F.rms_norm(x1, (D,), weight=w["mlp_norm"], eps=dims.eps)
    return x1 + (F.silu(h1 @ w["gate"].t()) * (h1 @ w["up"].t())) @ w["down"].t()


class ReferenceLlama(nn.Module):
    """The plain torch twin of a coda LlamaModel (same weights, standard layout). ``forward(tokens,
    targets)`` returns the mean cross-entropy (ignore_index skipped), else the logits."""

    def __init__(self, model: Any, dtype: torch.dtype | None = None):
        super().__init__()
        cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)  # noqa: E731
        self.dims = model.dims
        self.embed = nn.Parameter(cast(model.embed.detach().clone()))
        self.norm = nn.Parameter(cast(model.norm.detach().clone()))
        self.lm_head = nn.Parameter(cast(model.lm_head.detach().clone()))
        self.blocks = nn.ModuleList()
        for b in model.blocks:
            layer = nn.ParameterDict({n: nn.Parameter(cast(t.detach())) for n, t in standard_weights(b).items()})
            self.blocks.append(layer)
        self.register_buffer("inv_freq", model.blocks[0].inv_freq.clone(), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                ignore_index: int = -100) -> torch.Tensor:
        x = F.embedding(tokens, self.embed)
        for w in self.blocks:
            x = standard_block(x, dict(w.items()), self.dims, self.inv_freq)
        logits = F.rms_norm(x, (self.dims.dim,), weight=self.norm, eps=self.dims.eps) @ self.lm_head.t()
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                               ignore_index=ignore_index)
