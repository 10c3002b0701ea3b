"""A plain torch Llama block and model (separate q/k/v and gate/up weights, half-split RoPE,
F.rms_norm, SDPA), the reference the coda_cutlass.nn modules are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from coda_cutlass.layouts import deinterleave_gate_up, unpermute_rope_rows


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def standard_weights(block) -> dict[str, torch.Tensor]:
    """A coda LlamaBlock's weights in the standard (Hugging Face) layout, as leaf tensors."""
    d = block.dims
    q, k, v = block.qkv.detach().split((d.q_width, d.kv_width, d.kv_width))
    gate, up = deinterleave_gate_up(block.gate_up.detach())
    w = {"q": unpermute_rope_rows(q, d.head_dim), "k": unpermute_rope_rows(k, d.head_dim), "v": v,
         "o": block.o.detach(), "gate": gate, "up": up, "down": block.down.detach(),
         "attn_norm": block.attn_norm.detach(), "mlp_norm": block.mlp_norm.detach()}
    return {n: t.clone().requires_grad_() for n, t in w.items()}


def coda_grads_standard(block) -> dict[str, torch.Tensor]:
    """The coda block's parameter gradients converted to the standard layout."""
    d = block.dims
    q, k, v = block.qkv.grad.split((d.q_width, d.kv_width, d.kv_width))
    gate, up = deinterleave_gate_up(block.gate_up.grad)
    return {"q": unpermute_rope_rows(q, d.head_dim), "k": unpermute_rope_rows(k, d.head_dim), "v": v,
            "o": block.o.grad, "gate": gate, "up": up, "down": block.down.grad,
            "attn_norm": block.attn_norm.grad, "mlp_norm": block.mlp_norm.grad}


def standard_block(x: torch.Tensor, w: dict[str, torch.Tensor], dims, inv_freq: torch.Tensor) -> torch.Tensor:
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


def standard_model_loss(model, tokens: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100):
    """The same model as a plain torch stack; returns (loss, leaves) with the leaves' gradients
    after backward in the standard layout (per block: standard_weights names)."""
    embed = model.embed.detach().clone().requires_grad_()
    norm = model.norm.detach().clone().requires_grad_()
    head = model.lm_head.detach().clone().requires_grad_()
    blocks = [standard_weights(b) for b in model.blocks]
    d = model.dims
    inv = model.blocks[0].inv_freq
    x = F.embedding(tokens, embed)
    for w, b in zip(blocks, model.blocks):
        x = standard_block(x, w, b.dims, inv)
    h = F.rms_norm(x, (d.dim,), weight=norm, eps=d.eps)
    logits = h @ head.t()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=ignore_index)
    return loss, {"embed": embed, "norm": norm, "lm_head": head, "blocks": blocks}
