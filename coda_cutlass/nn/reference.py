"""A plain torch Llama (separate q/k/v and gate/up weights, half-split RoPE, F.rms_norm, SDPA),
the eager reference coda_cutlass.nn is checked against: in the tests, in the training example and
in the block benchmark. Weights are taken from (and gradients mapped back to) the coda modules.
"""

from __future__ import annotations

from typing import Any, Callable

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


def standard_block(x: torch.Tensor, w: dict[str, torch.Tensor], dims: Any, inv_freq: torch.Tensor,
                   linear: Callable[[torch.Tensor, str], torch.Tensor] | None = None) -> torch.Tensor:
    """One Llama decoder layer on x (B, S, D), weights named as standard_weights returns them.
    ``linear(t, name)`` replaces the projection ``t @ w[name].t()`` (then ``w`` needs only the norms)."""
    B, S, D = x.shape
    hd, H, KV = dims.head_dim, dims.n_heads, dims.n_kv_heads
    mm = linear or (lambda t, name: t @ w[name].t())
    h = F.rms_norm(x, (D,), weight=w["attn_norm"], eps=dims.eps)
    q = mm(h, "q").view(B, S, H, hd).transpose(1, 2)
    k = mm(h, "k").view(B, S, KV, hd).transpose(1, 2)
    v = mm(h, "v").view(B, S, KV, hd).transpose(1, 2)
    theta = torch.arange(S, dtype=torch.float32, device=x.device)[:, None] * inv_freq.to(x.device, torch.float32)[None]
    emb = torch.cat((theta, theta), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=H != KV)
    x1 = x + mm(o.transpose(1, 2).reshape(B, S, H * hd), "o")
    h1 = F.rms_norm(x1, (D,), weight=w["mlp_norm"], eps=dims.eps)
    return x1 + mm(F.silu(mm(h1, "gate")) * mm(h1, "up"), "down")


PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


class LinearBlock(nn.Module):
    """``standard_block`` with nn.Linear projections: the modules FP8 training libraries swap
    (torchao's ``convert_to_float8_training``). ``w`` as standard_weights returns it (copied)."""

    def __init__(self, w: dict[str, torch.Tensor], dims: Any, inv_freq: torch.Tensor):
        super().__init__()
        self.dims = dims
        for name in PROJECTIONS:
            t = w[name].detach()
            lin = nn.Linear(t.shape[1], t.shape[0], bias=False, device=t.device, dtype=t.dtype)
            with torch.no_grad():
                lin.weight.copy_(t)
            setattr(self, name, lin)
        self.attn_norm = nn.Parameter(w["attn_norm"].detach().clone())
        self.mlp_norm = nn.Parameter(w["mlp_norm"].detach().clone())
        self.register_buffer("inv_freq", inv_freq.detach().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norms = {"attn_norm": self.attn_norm, "mlp_norm": self.mlp_norm}
        return standard_block(x, norms, self.dims, self.inv_freq, linear=lambda t, name: getattr(self, name)(t))


class ReferenceLlama(nn.Module):
    """The plain torch twin of a coda LlamaModel (same weights, standard layout). ``forward(tokens,
    targets)`` returns the mean cross-entropy (ignore_index skipped), else the logits. With
    ``linear=True`` each block's projections are nn.Linear modules (``LinearBlock``), for FP8
    training libraries that swap them; the LM head stays a plain weight (so they leave it alone)."""

    def __init__(self, model: Any, dtype: torch.dtype | None = None, *, linear: bool = False):
        super().__init__()
        cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)  # noqa: E731
        self.dims = model.dims
        self.embed = nn.Parameter(cast(model.embed.detach().clone()))
        self.norm = nn.Parameter(cast(model.norm.detach().clone()))
        self.lm_head = nn.Parameter(cast(model.lm_head.detach().clone()))
        self.blocks = nn.ModuleList()
        inv_freq = model.blocks[0].inv_freq
        for b in model.blocks:
            w = {n: cast(t.detach()) for n, t in standard_weights(b).items()}
            self.blocks.append(LinearBlock(w, self.dims, inv_freq) if linear
                               else nn.ParameterDict({n: nn.Parameter(t) for n, t in w.items()}))
        self.register_buffer("inv_freq", inv_freq.clone(), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, *,
                ignore_index: int = -100) -> torch.Tensor:
        x = F.embedding(tokens, self.embed)
        for w in self.blocks:
            x = w(x) if isinstance(w, LinearBlock) else standard_block(x, dict(w.items()), self.dims, self.inv_freq)
        logits = F.rms_norm(x, (self.dims.dim,), weight=self.norm, eps=self.dims.eps) @ self.lm_head.t()
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                               ignore_index=ignore_index)
